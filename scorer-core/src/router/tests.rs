use super::*;
use crate::hash::{block_hashes, model_seed};
use crate::protocol::ApiKind;

fn router(n: usize) -> Router {
    router_with(RouterConfig::default(), n)
}

/// A router of `config` over `n` endpoints.
fn router_with(config: RouterConfig, n: usize) -> Router {
    let mut r = Router::new(config, 1);
    for i in 0..n {
        r.upsert_endpoint(&format!("10.0.0.{i}:8000")).unwrap();
    }
    r
}

fn request(text: &str) -> RouteRequest {
    let hashes = block_hashes(model_seed("m"), text.as_bytes(), 256);
    RouteRequest {
        model: "m".into(),
        block_hashes: hashes,
        prompt_bytes: text.len() as u64,
        prompt_tokens: (text.len() / 4) as u32,
        ..Default::default()
    }
}

/// Asserts that one scoring term alone moves a request off its prefix holder: at `weight`
/// (its default) the request leaves the holder, at 0 it stays. `pick` routes the scenario
/// with the term at a weight (and any other term that would move it off) and returns
/// (holder, chosen). Each scenario turns the wait cap off: the cap bounds how far any term
/// may move a request (`the_wait_cap_keeps_a_chat_request_off_a_queue_...`).
fn term_moves_off_the_holder(weight: f64, pick: impl Fn(f64) -> (String, String)) {
    let (holder, chosen) = pick(weight);
    assert_ne!(
        chosen, holder,
        "the term at {weight} left the request on its holder"
    );
    let (holder, chosen) = pick(0.0);
    assert_eq!(
        chosen, holder,
        "without the term the request left its holder"
    );
}

#[test]
fn second_turn_follows_first() {
    let mut r = router(4);
    let t1 = "system prompt ".repeat(200);
    let first = r.route(&request(&t1), 0, 7);
    let t2 = format!("{t1} and the next turn");
    // Much later, so the backlog has drained.
    let second = r.route(&request(&t2), 10_000, 8);
    assert_eq!(first.response.endpoints[0], second.response.endpoints[0]);
    assert_eq!(second.response.reason.as_str(), "prefix");
    assert!(second.response.cached_blocks > 0);
    assert_eq!(second.response.endpoints.len(), 3);
}

#[test]
fn a_stored_response_pins_its_chain_to_the_replica_that_answered() {
    let mut r = router(4);
    let first = r.route(&request("tell me a story"), 0, 1);
    let served = first.response.endpoints[0].clone();
    r.feedback(
        &Outcome {
            decision_id: first.response.decision_id,
            endpoint: served.clone(),
            status: 200,
            response_id: Some("resp_1".into()),
            ..Outcome::default()
        },
        5,
    );
    // Short new input only: without the pin, load alone would choose.
    for (i, now) in [10u64, 20, 30].into_iter().enumerate() {
        let mut next = request(&format!("go on {i}"));
        next.previous_response_id = Some("resp_1".into());
        let d = r.route(&next, now, i as u64);
        assert_eq!(d.response.endpoints, vec![served.clone()], "no fallbacks");
        assert_eq!(d.response.reason, RouteReason::StoredResponse);
    }
    assert_eq!(r.stats().stored_response_pinned, 3);
    // A failed answer stores nothing.
    r.feedback(
        &Outcome {
            decision_id: 99,
            endpoint: "10.0.0.3:8000".into(),
            status: 500,
            response_id: Some("resp_2".into()),
            ..Outcome::default()
        },
        40,
    );
    let mut lost = request("x");
    lost.previous_response_id = Some("resp_2".into());
    assert_ne!(
        r.route(&lost, 50, 9).response.reason,
        RouteReason::StoredResponse
    );
    assert_eq!(r.stats().stored_response_unknown, 1);
}

#[test]
fn a_stored_response_follows_the_proxys_hint_until_reported_and_not_a_gone_replica() {
    let mut r = router(3);
    let mut next = request("go on");
    next.previous_response_id = Some("resp_9".into());
    next.previous_response_endpoint = Some("10.0.0.2:8000".into());
    let d = r.route(&next, 0, 1);
    assert_eq!(d.response.endpoints, vec!["10.0.0.2:8000".to_string()]);
    // Its replica is removed: the id is forgotten and the request is routed as any other
    // (the replica it reaches answers 404, as vLLM does).
    r.feedback(
        &Outcome {
            decision_id: d.response.decision_id,
            endpoint: "10.0.0.2:8000".into(),
            status: 200,
            response_id: Some("resp_10".into()),
            ..Outcome::default()
        },
        5,
    );
    r.remove_endpoint("10.0.0.2:8000");
    let mut after = request("go on");
    after.previous_response_id = Some("resp_10".into());
    let d = r.route(&after, 10, 2);
    assert_ne!(d.response.reason, RouteReason::StoredResponse);
    assert!(!d.response.endpoints.contains(&"10.0.0.2:8000".to_string()));
}

/// A streamed request for `text` (its first token is reported).
fn streamed(text: &str) -> RouteRequest {
    RouteRequest {
        stream: true,
        ..request(text)
    }
}

/// `endpoint`'s candidate in `d`.
fn candidate<'d>(d: &'d Decision, endpoint: &str) -> &'d CandidateScore {
    d.candidates
        .iter()
        .find(|c| c.endpoint.as_str() == endpoint)
        .unwrap()
}

/// The queue term `d` priced on `endpoint`.
fn queue_on(d: &Decision, endpoint: &str) -> f64 {
    candidate(d, endpoint).queue_ms
}

// While first tokens are reported, a streamed request stays in its endpoint's queue until
// its own first token, however long the assumed rate says its prefill should take, and
// leaves it the moment the report comes.
#[test]
fn first_token_reports_measure_the_queue_instead_of_a_rate() {
    let mut r = router(2);
    let system = "a shared system prompt ".repeat(300);
    let first = r.route(&streamed(&system), 0, 1);
    let home = first.response.endpoints[0].clone();
    r.first_token(first.response.decision_id, 10, None);
    let second = r.route(
        &streamed(&format!("{system} and a long question ").repeat(3)),
        20,
        2,
    );
    assert_eq!(second.response.endpoints[0], home);
    // Long after the prior rate would have drained it: still queued, not yet started.
    let probe = r.route(&request("unrelated"), 5_000, 3);
    assert!(queue_on(&probe, &home) > 0.0, "{probe:?}");
    r.first_token(second.response.decision_id, 5_001, None);
    let probe = r.route(&request("unrelated too"), 5_002, 4);
    assert_eq!(queue_on(&probe, &home), 0.0);
    assert_eq!(r.stats().first_tokens, 2);
}

// An endpoint that was idle has sent no first token lately, yet the long miss it was just
// given stays queued there until its own first token is reported, while reports arrive
// from elsewhere: drained at the prior rate it would look empty long before the prefill
// ends on slower hardware, and the next long misses would pile onto it.
#[test]
fn an_idle_endpoints_first_prefill_is_measured_while_others_report() {
    let mut r = router(2);
    let busy = r.route(&streamed(&"one conversation ".repeat(200)), 0, 1);
    r.first_token(busy.response.decision_id, 10, None);
    // 20,000 tokens: 4 s of queue at the prior rate, which would have drained them by 6 s.
    let long = r.route(&streamed(&"a long new document ".repeat(4_000)), 20, 2);
    let idle = long.response.endpoints[0].clone();
    assert_ne!(idle, busy.response.endpoints[0]);
    let probe = r.route(&request("unrelated"), 6_000, 3);
    assert!(queue_on(&probe, &idle) > 3_000.0, "{probe:?}");
    r.first_token(long.response.decision_id, 6_001, None);
    let probe = r.route(&request("unrelated too"), 6_002, 4);
    assert_eq!(queue_on(&probe, &idle), 0.0);
}

/// The prefill term `d` priced on `endpoint`.
fn prefill_on(d: &Decision, endpoint: &str) -> f64 {
    candidate(d, endpoint).prefill_ms
}

/// `router(n)` with `calibration.first_tokens` off.
fn router_without_first_tokens(n: usize) -> Router {
    let mut config = RouterConfig::default();
    config.calibration.first_tokens = false;
    router_with(config, n)
}

/// Two long misses routed at 0, which land on two different endpoints.
fn two_long_misses(r: &mut Router) -> (Decision, Decision) {
    let one = r.route(&streamed(&"a long document, one ".repeat(2_000)), 0, 1);
    let two = r.route(&streamed(&"a long document, two ".repeat(2_000)), 0, 2);
    assert_ne!(one.response.endpoints[0], two.response.endpoints[0]);
    (one, two)
}

/// The slowdown `r` prices `address`'s prefill at, at `at_ms`.
fn slowdown_of(r: &Router, at_ms: u64, address: &str) -> f64 {
    r.endpoints(at_ms)
        .into_iter()
        .find(|e| e.address == address)
        .map_or(f64::NAN, |e| e.prefill_slowdown)
}

/// Two long misses, one on each of two endpoints, whose first tokens are reported as
/// `(arrival ms, the proxy's own time)`; then a third long miss, priced on both. Returns (the
/// second endpoint's prefill over the first one's, whether the third went to the first one).
fn third_after_first_tokens(
    mut r: Router,
    first: (u64, Option<u64>),
    second: (u64, Option<u64>),
) -> (f64, bool) {
    let (one, two) = two_long_misses(&mut r);
    let (one_home, two_home) = (&one.response.endpoints[0], &two.response.endpoints[0]);
    r.first_token(one.response.decision_id, first.0, first.1);
    r.first_token(two.response.decision_id, second.0, second.1);
    let at = first.0.max(second.0) + 1;
    let third = r.route(&streamed(&"a third document ".repeat(2_000)), at, 3);
    let ratio = prefill_on(&third, two_home) / prefill_on(&third, one_home);
    (ratio, &third.response.endpoints[0] == one_home)
}

// A pool of two GPU generations: the first long prompt each endpoint prefills shows its rate,
// and the one that took ten times as long is priced slower from then on, long before any
// request there has finished (which counters-based calibration would wait for).
#[test]
fn a_first_token_shows_an_endpoint_on_slower_hardware() {
    let (ratio, to_fast) = third_after_first_tokens(router(2), (1_000, None), (10_000, None));
    // The median of the two shown rates is their midpoint: 5.5 times the slow one's.
    assert!((ratio - 5.5).abs() < 0.01, "{ratio}");
    assert!(to_fast);
}

// A report that arrives late (a feedback tick, a failover to another control plane) carries the
// proxy's own time to the first token, and that is what the rate is read from: two replicas
// that both prefilled in a second read alike, however late one's report came (without that
// time, the test above: ten times slower).
#[test]
fn a_late_first_token_report_reads_the_proxys_own_time() {
    let late = third_after_first_tokens(router(2), (1_000, Some(1_000)), (10_000, Some(1_000)));
    assert_eq!(late.0, 1.0);
}

// A copy hears of another router's decision late (its `age_ms`), often in the same sync as
// its first token: the rate is read from when the decision was taken. Read from when the copy
// heard of it, a one-second prefill showed as instant, and the copy priced every endpoint
// that had shown a true rate tens of times slower (as a real-Envoy test with two proxies did).
#[test]
fn a_decision_heard_of_late_is_timed_from_when_it_was_taken() {
    let mut copy = router(2);
    let own = copy.route(&streamed(&"a long document, one ".repeat(2_000)), 0, 1);
    let own_home = own.response.endpoints[0].clone();
    let other = copy
        .endpoints(0)
        .into_iter()
        .map(|e| e.address)
        .find(|a| *a != own_home)
        .expect("a second endpoint");
    copy.first_token(own.response.decision_id, 1_000, Some(1_000));
    // Another router's decision, taken at 0 and heard of with its first token at 1 s.
    let theirs = (1 << crate::sync::REPLICA_SHIFT) + 1;
    let request = streamed(&"a long document, two ".repeat(2_000));
    assert!(copy.record_decision(&request, &other, theirs, 1_000, 1_000));
    copy.first_token(theirs, 1_000, Some(1_000));
    let third = copy.route(&streamed(&"a third document ".repeat(2_000)), 1_001, 2);
    let ratio = prefill_on(&third, &own_home) / prefill_on(&third, &other);
    assert_eq!(ratio, 1.0);
}

// In a pool of two GPU generations, a replica that has not yet shown its rate may be of
// either: it is priced at the mean of the shown replicas' slowdowns, not taken for the fast
// kind until its first long prompt says so. In a pool of one kind that mean is 1.
#[test]
fn a_replica_not_yet_shown_is_priced_at_its_pools_mean_slowdown() {
    // (fast, slow, cold): the slowdowns once the second long prefill took `second_ms`.
    let slowdowns = |second_ms: u64| {
        let mut r = router(3);
        let (one, two) = two_long_misses(&mut r);
        r.first_token(one.response.decision_id, 1_000, Some(1_000));
        r.first_token(two.response.decision_id, 10_000, Some(second_ms));
        let (one_home, two_home) = (&one.response.endpoints[0], &two.response.endpoints[0]);
        let cold = r
            .endpoints(10_000)
            .into_iter()
            .find(|e| e.address != *one_home && e.address != *two_home)
            .expect("a third endpoint");
        (
            slowdown_of(&r, 10_000, one_home),
            slowdown_of(&r, 10_000, two_home),
            cold.prefill_slowdown,
        )
    };
    assert_eq!(slowdowns(1_500), (1.0, 1.0, 1.0), "one kind");
    // The median of the two shown rates is their midpoint, 5.5 times the slow one's.
    let (fast, slow, cold) = slowdowns(10_000);
    assert_eq!(fast, 1.0);
    assert!((slow - 5.5).abs() < 0.01, "{slow}");
    assert!((cold - 3.25).abs() < 0.01, "{cold}");
}

// A prompt the router believed a miss that the engine served from cache shows its replica
// many times faster than it is, and with two replicas the other reads that much slower, until
// the outcome's cached tokens take the sample back.
#[test]
fn an_outcome_takes_back_a_first_token_the_cache_served() {
    let mut r = router(2);
    let (one, two) = two_long_misses(&mut r);
    let (one_home, two_home) = (&one.response.endpoints[0], &two.response.endpoints[0]);
    r.first_token(one.response.decision_id, 1_000, Some(1_000));
    r.first_token(two.response.decision_id, 1_000, Some(10));
    let before = slowdown_of(&r, 1_000, one_home);
    assert!(before > 2.0, "{before}");
    let served_from_cache = Outcome {
        decision_id: two.response.decision_id,
        endpoint: two_home.clone(),
        status: 200,
        ttfb_ms: Some(10),
        total_ms: 500,
        prompt_tokens: Some(8_000),
        completion_tokens: Some(20),
        cached_tokens: Some(7_968),
        ..Outcome::default()
    };
    r.feedback(&served_from_cache, 1_000);
    assert_eq!(slowdown_of(&r, 1_000, one_home), 1.0);
}

// Replicas of one kind read apart by their queues and their prompts' overheads: a gap under
// `SLOWER_HARDWARE` changes nothing.
#[test]
fn a_first_token_somewhat_slower_prices_nothing_differently() {
    let (ratio, _) = third_after_first_tokens(router(2), (1_000, None), (1_500, None));
    assert_eq!(ratio, 1.0);
}

// Off, first tokens price nothing differently.
#[test]
fn first_tokens_show_nothing_when_off() {
    let (ratio, _) = third_after_first_tokens(
        router_without_first_tokens(2),
        (1_000, None),
        (10_000, None),
    );
    assert_eq!(ratio, 1.0);
}

// A copy leaves long placements by load and sessions' first requests to the control plane:
// never a hit or a short prompt of a session already placed, never a request with nowhere
// else to go, and it accounts for none of them.
#[test]
fn only_a_long_placement_by_load_among_several_is_deferred() {
    let long = "a long document nobody has sent before ".repeat(400);
    let threshold = 50.0;
    let mut alone = router(1);
    assert!(
        alone
            .route_or_defer(&request(&long), 0, 1, threshold)
            .is_some()
    );

    let mut r = router(4);
    assert!(r.route_or_defer(&request(&long), 0, 1, threshold).is_none());
    assert_eq!((r.stats().deferred, r.stats().decisions), (1, 0));
    assert_eq!(r.inflight_len(), 0, "a deferred request holds no load");
    let short = r.route_or_defer(&request("hi"), 0, 2, threshold);
    assert!(short.is_some_and(|d| !d.response.endpoints.is_empty()));
    let first = r.route(&request(&long), 0, 3);
    let again = r
        .route_or_defer(
            &request(&format!("{long} and a question")),
            10_000,
            4,
            threshold,
        )
        .expect("a hit is decided where it is");
    assert_eq!(again.response.endpoints[0], first.response.endpoints[0]);

    // A subagent fork: a hit on its parent's context, but a new session. Left to the control
    // plane; once the control plane's decision has reached this copy, the session's next
    // request is decided here.
    let fork = RouteRequest {
        session: Some("subagent 1".into()),
        ..request(&format!("{long} and a subagent's task"))
    };
    assert!(r.route_or_defer(&fork, 10_001, 5, threshold).is_none());
    assert!(r.record_decision(&fork, &first.response.endpoints[0], 77, 10_002, 0));
    let next = RouteRequest {
        session: Some("subagent 1".into()),
        ..request(&format!(
            "{long} and a subagent's task, and its tool's result"
        ))
    };
    let decided = r.route_or_defer(&next, 10_003, 6, threshold);
    assert!(decided.is_some_and(|d| d.response.endpoints[0] == first.response.endpoints[0]));
}

#[test]
fn distinct_prompts_spread_over_the_fleet() {
    let mut r = router(4);
    let mut used = std::collections::BTreeSet::new();
    for i in 0..8 {
        let d = r.route(&request(&format!("{i} conversation ").repeat(100)), 0, i);
        used.insert(d.response.endpoints[0].clone());
    }
    assert_eq!(used.len(), 4);
}

/// Routes turn 2 of a conversation whose 8,000-byte turn 1 is cached on one of two
/// endpoints, once that holder reports `waiting` unknown requests queued: whether the holder
/// kept it, and the decision. `marked`: turn 1's prefix carries `cache_control`.
fn marked_probe(waiting: u32, marked: bool, reuse_weight: f64) -> (bool, Decision) {
    let mut config = RouterConfig::default();
    config.cache_control.reuse_weight = reuse_weight;
    // The marker's worth in queued requests, not the wait cap's bound, is measured here.
    config.scoring.wait_cap = 0.0;
    let mut r = Router::new(config, 1);
    let idle = EndpointMetrics::default();
    for i in 0..2 {
        let a = format!("10.0.0.{i}:8000");
        r.upsert_endpoint(&a).unwrap();
        r.update_metrics(&a, idle, 0);
    }
    let t1 = "tool definitions and a system prompt ".repeat(216);
    let first = r.route(&request(&t1), 0, 1);
    let holder = first.response.endpoints[0].clone();
    r.feedback(
        &Outcome {
            decision_id: first.response.decision_id,
            endpoint: holder.clone(),
            status: 200,
            ..Default::default()
        },
        1_000,
    );
    let later = 60_000;
    for i in 0..2 {
        let a = format!("10.0.0.{i}:8000");
        let metrics = match a == holder {
            true => EndpointMetrics { waiting, ..idle },
            false => idle,
        };
        r.update_metrics(&a, metrics, later);
    }
    let mut turn2 = request(&format!("{t1} and the next question"));
    if marked {
        turn2.marked_blocks = (t1.len() / 256) as u32;
    }
    let d = r.route(&turn2, later + 10, 2);
    (d.response.endpoints[0] == holder, d)
}

/// The fewest queued requests on the holder that move the probe off it.
fn spill_point(marked: bool, reuse_weight: f64) -> u32 {
    (0..400)
        .find(|&w| !marked_probe(w, marked, reuse_weight).0)
        .expect("a long enough queue moves any request")
}

#[test]
fn a_marked_prefix_stays_on_its_holder_under_a_queue_that_moves_an_unmarked_one() {
    let reuse = 1.0;
    let (unmarked, marked) = (spill_point(false, reuse), spill_point(true, reuse));
    // Between the two points the holder keeps marked requests and loses unmarked ones.
    assert!(unmarked < marked, "unmarked {unmarked}, marked {marked}");
    assert!(marked_probe(unmarked, true, reuse).0);
    assert!(!marked_probe(unmarked, false, reuse).0);
    // The margin is bounded by what the marker is worth: `reuse_weight` x the marked
    // prefix's prefill, here in queued requests of `unknown_request_tokens` each.
    let (_, d) = marked_probe(0, true, reuse);
    let s = ScoringConfig::default();
    let holder = &d.candidates[0];
    assert!(holder.cached_tokens > 0);
    let marked_tokens = f64::from(holder.cached_tokens);
    assert!(
        (holder.cache_control_ms + reuse * marked_tokens / s.prefill_tokens_per_ms).abs() < 1e-6,
        "{holder:?}"
    );
    let margin = reuse * marked_tokens / s.unknown_request_tokens;
    let moved = f64::from(marked - unmarked);
    assert!((moved - margin).abs() <= 1.0, "{moved} against {margin}");
    // Off (the default), a marker changes nothing.
    let off = CacheControlConfig::default().reuse_weight;
    assert_eq!(spill_point(true, off), unmarked);
    // The endpoint holding nothing is credited nothing.
    assert!(d.candidates[1].cache_control_ms == 0.0);
}

#[test]
fn the_configuration_copies_get_names_cache_control_only_when_on() {
    let off = serde_json::to_value(RouterConfig::default()).unwrap();
    assert!(off.get("cache_control").is_none(), "{off}");
    // Nor the reuse window's defaults (copies keep none): older copies still parse it.
    assert!(off.get("reuse").is_none(), "{off}");
    let mut config = RouterConfig::default();
    config.cache_control.reuse_weight = 1.0;
    let on = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<RouterConfig>(&on).unwrap(), config);
    assert_eq!(
        serde_json::from_value::<RouterConfig>(off).unwrap(),
        RouterConfig::default()
    );
}

#[test]
fn a_forged_marked_count_marks_at_most_the_prompt() {
    let mut config = RouterConfig::default();
    config.cache_control.reuse_weight = 1.0;
    let mut r = Router::new(config, 1);
    r.upsert_endpoint("10.0.0.0:8000").unwrap();
    r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
    let text = "abc ".repeat(2_000);
    r.route(&request(&text), 0, 1);
    let mut again = request(&text);
    again.marked_blocks = u32::MAX;
    let d = r.route(&again, 60_000, 2);
    let c = &d.candidates[0];
    let prompt_tokens = (text.len() / 4) as f64;
    let rate = ScoringConfig::default().prefill_tokens_per_ms;
    assert!(c.cache_control_ms < 0.0);
    assert!(-c.cache_control_ms <= prompt_tokens / rate, "{c:?}");
}

#[test]
fn busy_replica_is_avoided() {
    let mut r = router(2);
    r.update_metrics(
        "10.0.0.0:8000",
        EndpointMetrics {
            running: 50,
            waiting: 30,
            kv_usage: 0.95,
            capacity_tokens: None,
            counters: None,
            ..Default::default()
        },
        0,
    );
    r.update_metrics("10.0.0.1:8000", EndpointMetrics::default(), 0);
    let d = r.route(&request(&"x".repeat(1000)), 10, 1);
    assert_eq!(d.response.endpoints[0], "10.0.0.1:8000");
}

#[test]
fn a_prefix_holder_busy_decoding_is_left_when_a_miss_elsewhere_stalls_no_one() {
    // The holder of a 4,200-token prefix runs 60 sequences: a 600-token suffix prefilled
    // there stalls each of them, which costs more than prefilling the whole prompt on the
    // idle replica. Without the stall term the hit wins regardless.
    let system = "shared system prompt ".repeat(800);
    let follow_up = format!("{system}{}", "question words ".repeat(160));
    let pick = |stall_weight: f64| {
        let mut r = router(2);
        r.config.scoring.prefill_contention_weight = 0.0;
        r.config.scoring.prefill_stall_weight = stall_weight;
        r.config.scoring.wait_cap = 0.0;
        let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
        let busy = EndpointMetrics {
            running: 60,
            kv_usage: 0.3,
            ..EndpointMetrics::default()
        };
        for i in 0..2 {
            let address = format!("10.0.0.{i}:8000");
            let m = if address == holder {
                busy
            } else {
                EndpointMetrics::default()
            };
            r.update_metrics(&address, m, 60_000);
        }
        let chosen = r.route(&request(&follow_up), 60_000, 2).response.endpoints[0].clone();
        (holder, chosen)
    };
    term_moves_off_the_holder(ScoringConfig::default().prefill_stall_weight, pick);
}

// A control plane that restarts replays the shared stream before it has polled every
// endpoint's models or scraped it: decisions for those endpoints are facts all the same,
// and their prefixes must be in the index it serves from.
#[test]
fn recorded_decisions_count_whatever_this_router_knows_of_the_endpoint() {
    let mut r = router(3);
    let served = |id: &str| {
        vec![ServedModel {
            id: id.into(),
            parent: None,
            max_model_len: None,
        }]
    };
    // Endpoint 0 was polled and lists the model; 1 not yet polled; 2 lists another model
    // (this router's view is stale) and its metrics stopped answering.
    r.set_served_models("10.0.0.0:8000", served("m"));
    r.set_served_models("10.0.0.2:8000", served("other"));
    r.mark_unreachable("10.0.0.2:8000");
    for (k, endpoint) in ["10.0.0.1:8000", "10.0.0.2:8000"].into_iter().enumerate() {
        let text = format!("conversation {k} ").repeat(200);
        let req = request(&text);
        assert!(r.record_decision(&req, endpoint, 100 + k as u64, 10, 0));
        let id = r.endpoint_id(endpoint).unwrap();
        assert!(
            req.block_hashes.iter().all(|&h| r.index().holds(id, h)),
            "{endpoint}: prefix not indexed"
        );
        // The same report again is the same decision.
        assert!(!r.record_decision(&req, endpoint, 100 + k as u64, 11, 0));
    }
    // A model no endpoint lists, under `reject`, was still routed by whoever decided.
    r.config.models.unknown_model = crate::pools::UnknownModelPolicy::Reject;
    let mut unknown = request(&"an unlisted model ".repeat(200));
    unknown.model = "unlisted".into();
    assert!(r.record_decision(&unknown, "10.0.0.0:8000", 200, 12, 0));
}

// Twenty agents run on the replica holding the tool prompt they all share, each with 6,000
// tokens of its own context in flight. A new agent's first turn hits that prompt there,
// but joining them costs more than prefilling the prompt once on the idle replica: the
// decode occupancy prices what their sequences hold. Without it the hit wins.
#[test]
fn a_new_session_leaves_a_prefix_holder_full_of_other_sessions_context() {
    let tools = "tool definitions shared by every agent ".repeat(400);
    let pick = |weight: f64| {
        let mut r = router(2);
        r.config.scoring.decode_occupancy_weight = 0.0;
        r.config.scoring.prefill_contention_weight = 0.0;
        let holder = r.route(&request(&tools), 0, 1).response.endpoints[0].clone();
        // Placed there earlier (when it held little), as another router's decisions are.
        for k in 0..20u64 {
            let context = format!("{tools} agent {k} {}", "tool output ".repeat(2_000));
            assert!(r.record_decision(&request(&context), &holder, 1_000 + k, 10 + k, 0));
        }
        r.config.scoring.decode_occupancy_weight = weight;
        r.config.scoring.wait_cap = 0.0;
        let next = format!("{tools} a new agent's task");
        let chosen = r.route(&request(&next), 60_000, 99).response.endpoints[0].clone();
        (holder, chosen)
    };
    term_moves_off_the_holder(ScoringConfig::default().decode_occupancy_weight, pick);
}

/// Records `n` sessions' first turns (`first(k)`) on `on` and their second turns (the first
/// and `reply`) a second later, as another router's decisions reach this one, so the learned
/// share of sessions that come back is high.
fn place_returning_sessions(
    r: &mut Router,
    on: &str,
    n: u64,
    make: impl Fn(&str, &str) -> RouteRequest,
    first: impl Fn(u64) -> String,
    reply: &str,
) {
    for k in 0..n {
        let session = format!("session {k}");
        let text = first(k);
        assert!(r.record_decision(&make(&text, &session), on, 100 + k, 10 + k, 0));
        let next = format!("{text} {reply}");
        assert!(r.record_decision(&make(&next, &session), on, 200 + k, 1_010 + k, 0));
    }
    let share = r.session_return_share();
    assert!(share > 0.8, "{share}");
}

// Chat sessions run on the replica holding the system prompt they all share, and each came
// back for a second turn soon (the sessions return). A new session's first turn hits that
// prompt there; on its own turn the hit is worth more than the other sessions' decode beside
// it, but its later turns will follow their cache there too, and the session-start charge
// prices their decode beside the others once more: the new session starts on the idle
// replica. Its next turn, a request naming no session, and an agent API's first request
// (which prices its own decode turn by turn already) are not charged.
#[test]
fn a_new_session_starts_away_from_a_holder_full_of_sessions_that_return() {
    let system = "a system prompt shared by every session ".repeat(21);
    let chat = |text: &str, session: &str| RouteRequest {
        session: Some(session.into()),
        ..request(text)
    };
    let pick = |turns: f64| {
        let mut r = router(2);
        r.config.scoring.decode_occupancy_weight = 0.0;
        r.config.scoring.prefill_contention_weight = 0.0;
        r.config.scoring.prefill_stall_weight = 0.0;
        r.config.sessions.start_turns = turns;
        r.config.scoring.wait_cap = 0.0;
        let metrics = EndpointMetrics {
            capacity_tokens: Some(400_000),
            ..Default::default()
        };
        for i in 0..2 {
            r.update_metrics(&format!("10.0.0.{i}:8000"), metrics, 0);
        }
        let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
        let first = |k| format!("{system} session {k} {}", "a question ".repeat(20));
        place_returning_sessions(&mut r, &holder, 24, chat, first, "and its answer");
        let first = chat(&format!("{system} a new session's question"), "new");
        let d = r.route(&first, 2_000, 99);
        let chosen = d.response.endpoints[0].clone();
        if turns > 0.0 {
            assert!(d.candidates.iter().any(|c| c.session_start_ms > 0.0));
            let second = chat(&format!("{system} a new session's question, go on"), "new");
            let d = r.route(&second, 2_001, 100);
            assert!(d.candidates.iter().all(|c| c.session_start_ms == 0.0));
            let d = r.route(&request(&format!("{system} no session")), 2_002, 101);
            assert!(d.candidates.iter().all(|c| c.session_start_ms == 0.0));
            let agent = RouteRequest {
                api: Some(ApiKind::Messages),
                ..chat(&format!("{system} a new agent's task"), "agent")
            };
            let d = r.route(&agent, 2_003, 102);
            assert!(d.candidates.iter().all(|c| c.session_start_ms == 0.0));
        }
        (holder, chosen)
    };
    term_moves_off_the_holder(crate::affinity::SessionConfig::default().start_turns, pick);
}

// A coding agent forks six subagents off its context in one millisecond: each fork is a new
// session whose prompt is the parent's context plus its own task. The parent's replica holds
// that context and runs the other agents' sessions, which came back soon; the other replica
// is idle. Scored to the last token, each fork already pays for the decode beside those
// sessions; charged for its later turns too, that decode counted twice and from the fourth
// fork on the burst prefilled the context again on the idle replica. All six stay with it.
#[test]
fn a_subagent_burst_stays_with_its_parents_context_on_a_replica_with_room() {
    let mut r = router(2);
    let metrics = EndpointMetrics {
        capacity_tokens: Some(400_000),
        ..Default::default()
    };
    for i in 0..2 {
        r.update_metrics(&format!("10.0.0.{i}:8000"), metrics, 0);
    }
    let agent = |text: &str, session: &str| RouteRequest {
        api: Some(ApiKind::Messages),
        session: Some(session.into()),
        ..request(text)
    };
    let tools = "tool definitions every agent shares ".repeat(100);
    let context = format!(
        "{tools} the parent's task {}",
        "and its tool results ".repeat(600)
    );
    let parent = r.route(&agent(&context, "parent"), 0, 1).response.endpoints[0].clone();
    // Other agents run there.
    let task = |k| format!("{tools} agent {k}'s task");
    place_returning_sessions(&mut r, &parent, 4, agent, task, "and its tool's result");
    for k in 0..6u64 {
        let fork = agent(
            &format!("{context} subagent {k}'s task"),
            &format!("parent/{k}"),
        );
        let d = r.route(&fork, 2_000, 10 + k);
        assert_eq!(
            d.response.endpoints[0], parent,
            "fork {k}: {:?}",
            d.candidates
        );
        assert!(d.candidates.iter().all(|c| c.session_start_ms == 0.0));
    }
}

// Four long prompts were just prefilled on the replica holding a conversation's context
// (their first tokens are in: no queue is left), and they are still decoding there. The
// conversation's next turn would decode in steps those prompts' prefill keeps stretching,
// and on an idle replica it pays its context's prefill once: the contention term prices the
// first above the second; without it the hit wins. Ten windows later nothing is left of it.
#[test]
fn a_turn_leaves_a_holder_that_is_absorbing_prefill() {
    // About 2,000 tokens of context, four prompts of about 1,000 tokens; all streamed, so
    // their first tokens take their prefill out of the measured queue.
    let context = "a conversation's long context ".repeat(270);
    let streamed = |text: &str| RouteRequest {
        stream: true,
        ..request(text)
    };
    let pick = |weight: f64| {
        let mut r = router(2);
        r.config.scoring.prefill_contention_weight = weight;
        r.config.scoring.wait_cap = 0.0;
        let first = r.route(&streamed(&context), 0, 1).response;
        r.first_token(first.decision_id, 50, None);
        let holder = first.endpoints[0].clone();
        for k in 0..4u64 {
            let other = format!("another prompt {k} ").repeat(240);
            assert!(r.record_decision(&streamed(&other), &holder, 1_000 + k, 60_000, 0));
            r.first_token(1_000 + k, 60_050, None);
        }
        let next = format!("{context} the next question");
        let chosen = r.route(&streamed(&next), 60_100, 2).response.endpoints[0].clone();
        (holder, chosen)
    };
    term_moves_off_the_holder(ScoringConfig::default().prefill_contention_weight, pick);

    let mut r = router(1);
    let probe =
        |r: &mut Router, at: u64| r.route(&request("probe"), at, at).candidates[0].decode_ms;
    let idle = probe(&mut r, 0);
    r.route(&request(&"another prompt ".repeat(1_000)), 1_000, 1);
    let busy = probe(&mut r, 1_001);
    let window = ScoringConfig::default().prefill_contention_window_ms as u64;
    // The prompt's request is still in flight: its occupancy and running sequence remain.
    let later = probe(&mut r, 1_001 + 10 * window);
    assert!(busy > idle + 1_000.0, "{idle} {busy}");
    assert!(later < idle + 200.0, "{idle} {busy} {later}");
}

// A copy deciding beside other routers sees their prefill up to one sync late: it scores a
// chat request without the prefill contention (`local.first_token_contention_weight`, 0 by
// default), and an agent request, scored to its last token, with the scoring's weight. The
// same router deciding alone (`route`) prices both.
#[test]
fn a_copy_beside_others_leaves_the_contention_out_of_a_chat_request_only() {
    let decode_ms = |api: Option<ApiKind>, beside_others: bool| {
        let mut r = router(1);
        r.route(&request(&"another prompt ".repeat(1_000)), 1_000, 1);
        let mut probe = request("probe");
        probe.api = api;
        let decision = if beside_others {
            r.route_or_defer(&probe, 1_001, 2, 0.0)
                .expect("nothing deferred at 0")
        } else {
            r.route(&probe, 1_001, 2)
        };
        decision.candidates[0].decode_ms
    };
    let (chat_alone, chat_copy) = (decode_ms(None, false), decode_ms(None, true));
    assert!(chat_alone > chat_copy + 100.0, "{chat_alone} {chat_copy}");
    let agent = Some(ApiKind::Messages);
    let (agent_alone, agent_copy) = (decode_ms(agent, false), decode_ms(agent, true));
    assert!(
        (agent_alone - agent_copy).abs() < 1e-9,
        "{agent_alone} {agent_copy}"
    );
}

// With learned rates on, a replica that has learned a decode step ten times the configured
// one still has its prefill contention priced at the configured step: the learned step time
// of a replica under prefill load already includes that prefill, so reading it would count
// the contention twice.
#[test]
fn the_contention_prices_decode_at_the_configured_step_even_with_learned_rates() {
    let decode_ms = |learn: bool| {
        let mut r = router(1);
        r.config.calibration.enabled = true;
        let address = "10.0.0.0:8000";
        if learn {
            let mut counters = EngineCounters::default();
            for scrape in 0..20u64 {
                // 100 output tokens per scrape at ten times the configured idle step.
                counters.itl_count += 100.0;
                counters.itl_seconds += 100.0 * 10.0 * r.config.scoring.itl_ms_idle / 1000.0;
                let metrics = EndpointMetrics {
                    counters: Some(counters),
                    ..Default::default()
                };
                r.update_metrics(address, metrics, scrape * 100);
            }
            let learned = r.endpoints(2_000)[0].calibration.itl_ms_idle;
            assert!(learned > 5.0 * r.config.scoring.itl_ms_idle, "{learned}");
        }
        r.route(&request(&"another prompt ".repeat(1_000)), 2_000, 1);
        r.route(&request("probe"), 2_001, 2).candidates[0].decode_ms
    };
    let (configured, learned) = (decode_ms(false), decode_ms(true));
    assert!(configured > 100.0, "{configured}");
    assert!(
        (learned - configured).abs() < 1e-6,
        "{configured} {learned}"
    );
}

// An agent acts on a whole answer: a Messages or Responses request prices its decode
// (`agent_decode_weight`), a chat request does not (`decode_weight` 0), and both price the
// output they expect, never the client's cap (an Anthropic client must send one).
#[test]
fn an_agent_api_request_prices_its_expected_decode_and_a_chat_one_does_not() {
    let s = ScoringConfig::default();
    let decode_ms = |api: Option<ApiKind>, max_tokens: u32| {
        let mut r = router(1);
        // Only the decode weight differs here (an agent request on an idle replica also pays
        // no contention for its own prefill, a chat one does).
        r.config.scoring.prefill_contention_weight = 0.0;
        let mut probe = request("probe");
        probe.api = api;
        probe.max_output_tokens = Some(max_tokens);
        r.route(&probe, 0, 1).candidates[0].decode_ms
    };
    let chat = decode_ms(Some(ApiKind::Chat), 32_000);
    assert_eq!(chat, decode_ms(None, 32_000));
    assert_eq!(chat, decode_ms(Some(ApiKind::Completion), 32_000));
    let expected = |tokens: u32| s.agent_decode_weight * f64::from(tokens) * s.itl_ms_idle;
    for api in [ApiKind::Messages, ApiKind::Responses] {
        // Capped at the default output, not 32,000 tokens' worth.
        let capped = decode_ms(Some(api), 32_000) - chat;
        assert!(
            (capped - expected(s.default_output_tokens)).abs() < 1e-6,
            "{capped}"
        );
        // A cap below the default is the most the answer can be.
        let short = decode_ms(Some(api), 100) - decode_ms(Some(ApiKind::Chat), 100);
        assert!((short - expected(100)).abs() < 1e-6, "{short}");
    }
    assert!(s.agent_decode_weight > 0.0 && s.decode_weight == 0.0);
}

// An agent request's own decode is priced at the output agent requests have had once enough
// outcomes reported it, not at the default: its client's `max_tokens` is a cap, and an agent's
// turns are mostly short tool calls. Chat requests keep the default, and the mean never
// raises a request past its own cap.
#[test]
fn an_agent_request_s_decode_is_priced_at_the_output_agents_have_had() {
    let s = ScoringConfig::default();
    let mut r = router(1);
    r.config.scoring.prefill_contention_weight = 0.0;
    let own_decode = |tokens: f64| s.agent_decode_weight * tokens * s.itl_ms_idle;
    let probe = |r: &mut Router, api, max_tokens, now| {
        let mut p = request("probe");
        p.api = Some(api);
        p.max_output_tokens = Some(max_tokens);
        let d = r.route(&p, now, now);
        // Answered without usage: it leaves the replica and teaches nothing.
        let done = Outcome {
            decision_id: d.response.decision_id,
            endpoint: d.response.endpoints[0].clone(),
            status: 200,
            ..Outcome::default()
        };
        r.feedback(&done, now);
        d.candidates[0].decode_ms
    };
    let chat = probe(&mut r, ApiKind::Chat, 32_000, 0);
    let before = probe(&mut r, ApiKind::Messages, 32_000, 0) - chat;
    assert!((before - own_decode(f64::from(s.default_output_tokens))).abs() < 1e-6);
    // Agent turns of 60 output tokens each, one fewer than needed: still the default.
    let agent_turn = |r: &mut Router, i: u64| {
        let mut turn = request(&format!("tool result {i}"));
        turn.api = Some(ApiKind::Messages);
        let d = r.route(&turn, 10 + i, i);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: d.response.endpoints[0].clone(),
                status: 200,
                completion_tokens: Some(60),
                ..Outcome::default()
            },
            11 + i,
        );
    };
    for i in 0..u64::from(LEARNED_OUTPUT_MIN_SAMPLES) - 1 {
        agent_turn(&mut r, i);
    }
    let now = 1_000;
    let chat = probe(&mut r, ApiKind::Chat, 32_000, now);
    let unlearned = probe(&mut r, ApiKind::Messages, 32_000, now) - chat;
    assert!((unlearned - before).abs() < 1e-6, "{unlearned} {before}");
    assert_eq!(r.agent_output_tokens(), f64::from(s.default_output_tokens));
    agent_turn(&mut r, 99);
    let chat_after = probe(&mut r, ApiKind::Chat, 32_000, now);
    assert!(
        (chat_after - chat).abs() < 1e-6,
        "chat moved: {chat} {chat_after}"
    );
    let learned = probe(&mut r, ApiKind::Messages, 32_000, now) - chat_after;
    assert!((learned - own_decode(60.0)).abs() < 1e-6, "{learned}");
    assert!((r.agent_output_tokens() - 60.0).abs() < 1e-9);
    // A cap below the mean is still the most the answer can be.
    let capped = probe(&mut r, ApiKind::Messages, 40, now) - probe(&mut r, ApiKind::Chat, 40, now);
    assert!((capped - own_decode(40.0)).abs() < 1e-6, "{capped}");
    // Off, the default again.
    r.config.scoring.learn_agent_output = false;
    let off =
        probe(&mut r, ApiKind::Messages, 32_000, now) - probe(&mut r, ApiKind::Chat, 32_000, now);
    assert!((off - before).abs() < 1e-6, "{off} {before}");
}

// A request scored to its last token pays no contention for its own prefill on an idle
// replica: it prefills before it decodes, and nothing else decodes there. A chat request
// still does (there the term stands for the work a miss adds), and so does an agent request
// where something runs. Counted, a 4,000-token miss read as seconds of decode contention on
// every idle replica, and an agent fleet never reached the replicas its shared tool prompt
// had not (fleet-sim's agentic workload left 2 of 8 idle).
#[test]
fn an_agent_request_pays_no_contention_for_its_own_prefill_on_an_idle_replica() {
    let s = ScoringConfig::default();
    let prompt = "an agent's tool definitions and its task ".repeat(400);
    let decode_ms = |api, busy: bool| {
        let mut r = router(1);
        if busy {
            r.route(&request("another request, still running"), 0, 0);
        }
        let mut probe = request(&prompt);
        probe.api = Some(api);
        r.route(&probe, 1, 1).candidates[0].decode_ms
    };
    let own_decode = s.agent_decode_weight * f64::from(s.default_output_tokens) * s.itl_ms_idle;
    let idle = decode_ms(ApiKind::Messages, false);
    assert!((idle - own_decode).abs() < 1e-6, "{idle} {own_decode}");
    assert!(decode_ms(ApiKind::Chat, false) > 1_000.0);
    assert!(decode_ms(ApiKind::Messages, true) > own_decode + 1_000.0);
}

// A decode step reads every running sequence's whole context: each fork of one long
// context in flight on a replica raises an agent request's decode estimate there by the
// whole context, though they share it and the scraped usage has not moved.
#[test]
fn an_agent_request_s_decode_reads_every_in_flight_context_whole() {
    let agent_over_chat = |forks: usize| {
        let mut r = router(1);
        // The prefill contention, the same for both probes but for each other's prefill, off.
        r.config.scoring.prefill_contention_weight = 0.0;
        let metrics = EndpointMetrics {
            capacity_tokens: Some(200_000),
            ..Default::default()
        };
        r.update_metrics("10.0.0.0:8000", metrics, 0);
        let context = "a long agent context its subagents share ".repeat(400);
        for k in 0..forks {
            let mut fork = request(&format!("{context} subagent {k}"));
            fork.api = Some(ApiKind::Messages);
            r.route(&fork, 1 + k as u64, k as u64);
        }
        let mut decode_ms = |api| {
            let mut probe = request("probe");
            probe.api = Some(api);
            r.route(&probe, 10, 99).candidates[0].decode_ms
        };
        decode_ms(ApiKind::Messages) - decode_ms(ApiKind::Chat)
    };
    let (none, one, two) = (agent_over_chat(0), agent_over_chat(1), agent_over_chat(2));
    let first = one - none;
    let second = two - one;
    assert!(first > 50.0, "{none} {one}");
    assert!((second - first).abs() < 0.01 * first, "{none} {one} {two}");
}

#[test]
fn decayed_tokens_decay_with_the_window_and_add_at_the_latest_time() {
    let mut d = DecayedTokens::default();
    d.add(1_000.0, 100, 1_000.0);
    assert!((d.at(1_100, 1_000.0) - 1_000.0 / std::f64::consts::E).abs() < 1e-6);
    // A copy's clock stepping back adds at the latest time seen, nothing is lost.
    d.add(500.0, 50, 1_000.0);
    assert!((d.at(100, 1_000.0) - 1_500.0).abs() < 1e-6);
    // Taking back what was added leaves what came before, decayed.
    d.remove(500.0, 100, 600, 1_000.0);
    assert!((d.at(600, 1_000.0) - 1_000.0 * (-0.5f64).exp()).abs() < 1e-6);
}

// The occupancy counts a prefix its in-flight requests share once, and leaves their
// expected output out.
#[test]
fn decode_occupancy_counts_a_shared_prefix_once_and_no_output() {
    let tools = "tool definitions shared by every agent ".repeat(400);
    let mut r = router(1);
    r.config.scoring.decode_occupancy_weight = 1.0;
    let mut alone = request(&format!("{tools} agent 0"));
    alone.max_output_tokens = Some(4_096);
    r.route(&alone, 0, 1);
    let one = r.route(&request("probe"), 60_000, 2).candidates[0].decode_ms;
    let mut second = request(&format!("{tools} agent 1"));
    second.max_output_tokens = Some(4_096);
    r.route(&second, 60_001, 3);
    let two = r.route(&request("probe too"), 120_000, 4).candidates[0].decode_ms;
    let tokens = |ms: f64| ms * ScoringConfig::default().prefill_tokens_per_ms;
    // Two requests, one shared prompt: the second adds far less than the first.
    assert!(tokens(one) > 3_500.0, "{one}");
    assert!(tokens(two) - tokens(one) < 1_000.0, "{one} {two}");
}

// Counted per request, the same two requests add their whole contexts each, and their
// expected output still not; once answered they leave nothing behind.
#[test]
fn decode_occupancy_per_request_counts_every_context_whole() {
    let tools = "tool definitions shared by every agent ".repeat(400);
    let mut r = router(1);
    r.config.scoring.decode_occupancy_weight = 1.0;
    r.config.scoring.decode_occupancy_per_request = true;
    r.config.scoring.prefill_contention_weight = 0.0;
    let tokens = |ms: f64| ms * ScoringConfig::default().prefill_tokens_per_ms;
    let mut ids = Vec::new();
    let mut occupancy = Vec::new();
    for k in 0..2u64 {
        let mut agent = request(&format!("{tools} agent {k}"));
        agent.max_output_tokens = Some(4_096);
        let routed = r.route(&agent, k * 60_000, 1 + k).response;
        ids.push((routed.decision_id, routed.endpoints[0].clone()));
        let probe = r.route(&request("probe"), k * 60_000 + 1, 10 + k);
        occupancy.push(tokens(probe.candidates[0].decode_ms));
    }
    assert!(occupancy[0] > 3_500.0, "{occupancy:?}");
    assert!(occupancy[1] - occupancy[0] > 3_500.0, "{occupancy:?}");
    assert!(
        occupancy[1] < 2.5 * occupancy[0],
        "output counted: {occupancy:?}"
    );
    for (decision_id, endpoint) in ids {
        let done = Outcome {
            decision_id,
            endpoint,
            ..Default::default()
        };
        r.feedback(&done, 200_000);
    }
    let after = r.route(&request("probe"), 300_000, 20).candidates[0].decode_ms;
    assert!(tokens(after) < 100.0, "{after}");
}

/// The first endpoint's routing state and its reason.
pub(super) fn first_state(r: &Router) -> (RoutingState, Option<StateReason>) {
    let e = &r.endpoints(0)[0];
    (e.routing_state, e.state_reason)
}

/// Asserts that the state changes noted since the last call are `endpoint` turning
/// degraded and exact again, both for `reason`.
fn assert_degraded_and_back(r: &mut Router, endpoint: &str, reason: StateReason, why: &str) {
    let changes: Vec<_> = r
        .take_state_changes()
        .into_iter()
        .map(|(e, c)| (e, c.to, c.reason))
        .collect();
    let expected = [
        (endpoint.to_string(), RoutingState::Degraded, reason),
        (endpoint.to_string(), RoutingState::Exact, reason),
    ];
    assert_eq!(changes, expected, "{why}");
}

/// `n` endpoints whose scrape reports `tokens` of KV capacity and no load.
fn router_with_kv_capacity(n: usize, tokens: u64) -> Router {
    let mut r = router(n);
    let metrics = EndpointMetrics {
        capacity_tokens: Some(tokens),
        counters: None,
        ..EndpointMetrics::default()
    };
    for i in 0..n {
        r.update_metrics(&format!("10.0.0.{i}:8000"), metrics, 0);
    }
    r
}

#[test]
fn in_flight_requests_hold_a_shared_prefix_once() {
    // 8,000 shared tokens and ~100 private ones each: twelve such requests in flight hold
    // about 9,500 tokens of a 12,000-token cache, so they all stay with their prefix (a
    // count per request, 12 x 8,100, would have spread them). Once answered, the same
    // burst fits again: nothing leaks.
    let mut r = router_with_kv_capacity(4, 12_000);
    let system = "a long shared system prompt ".repeat(1_150);
    let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
    for round in 0..2u64 {
        let mut ids = Vec::new();
        for k in 0..12u64 {
            let mut req = request(&format!("{system} question {k} {}", "why ".repeat(100)));
            req.max_output_tokens = Some(16);
            let now = 5_000 + round * 100_000 + k * 2_000;
            let d = r.route(&req, now, k);
            assert_eq!(
                d.response.endpoints[0], holder,
                "round {round}, request {k}"
            );
            ids.push(d.response.decision_id);
        }
        for decision_id in ids {
            r.feedback(
                &Outcome {
                    decision_id,
                    ..Default::default()
                },
                50_000 + round * 100_000,
            );
        }
    }
}

#[test]
fn a_burst_sharing_a_prefix_spreads_once_the_holders_kv_would_overflow() {
    // Each replica holds 12,000 KV tokens; the requests share a 525-token system prompt
    // cached on one replica and add about 2,000 tokens each. The scrape shows no load (it
    // lags the burst), and each prefill has drained before the next arrives: only the
    // router's own in-flight KV tells it that a sixth concurrent request cannot fit there
    // (525 + 6 x 2,000 > 12,000).
    let mut r = router_with_kv_capacity(4, 12_000);
    let system = "shared system prompt ".repeat(100);
    let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
    let mut placed = Vec::new();
    for k in 0..8u64 {
        let prompt = format!("{system} conversation {k} {}", "words ".repeat(1_300));
        let mut req = request(&prompt);
        req.max_output_tokens = Some(16);
        let now = 1_000 + k * 1_000;
        placed.push(r.route(&req, now, k).response.endpoints[0].clone());
    }
    let on_holder = placed.iter().filter(|e| **e == holder).count();
    assert!(on_holder >= 2, "the prefix still attracts: {placed:?}");
    assert!(
        on_holder <= 5,
        "at most what fits in 12,000 tokens: {placed:?}"
    );
}

// A request the engine refuses at once (a 400 for a prompt too long for the model) never
// prefilled: its outcome takes its prefill back out of the endpoint's backlog, so one bad
// request does not price the replica out for as long as a million tokens take to drain.
#[test]
fn a_refused_request_refunds_its_prefill_backlog() {
    let mut r = router(1);
    r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
    let huge = request(&"w".repeat(3_900_000));
    let d = r.route(&huge, 1, 1);
    let backlog = |r: &Router| r.endpoints(1)[0].backlog_tokens;
    assert!(backlog(&r) > 900_000.0, "{}", backlog(&r));
    r.feedback(
        &Outcome {
            decision_id: d.response.decision_id,
            endpoint: "10.0.0.0:8000".into(),
            status: 400,
            ..Outcome::default()
        },
        1,
    );
    assert_eq!(backlog(&r), 0.0);
    // A served request's prefill drains with time as before: its outcome refunds nothing.
    let served = r.route(&request(&"w ".repeat(4_000)), 2, 1);
    let before = backlog(&r);
    r.feedback(
        &Outcome {
            decision_id: served.response.decision_id,
            endpoint: "10.0.0.0:8000".into(),
            status: 200,
            completion_tokens: Some(8),
            ..Outcome::default()
        },
        2,
    );
    assert_eq!(backlog(&r), before);
}

// An engine that refused a request (a 400, a 5xx before any token) cached none of it: the
// prefix the decision credited to it is taken back, or the same prompt, sent again, would be
// routed there as a hit. A reset stream may have been dropped mid-prefill, after vLLM cached
// what it had scheduled, and a later decision's touch is that decision's credit: both stay.
#[test]
fn a_refused_request_takes_back_the_prefix_it_credited() {
    let text = "a prompt the engine will refuse ".repeat(40);
    let outcome = |d: &Decision, status: u16| Outcome {
        decision_id: d.response.decision_id,
        endpoint: d.response.endpoints[0].clone(),
        status,
        ..Outcome::default()
    };
    let again = |r: &mut Router| r.route(&request(&text), 60_000, 9).response.cached_blocks;
    for (status, kept) in [(400, false), (503, false), (0, true)] {
        let mut r = router(4);
        let d = r.route(&request(&text), 0, 1);
        r.feedback(&outcome(&d, status), 5);
        assert_eq!(again(&mut r) > 0, kept, "status {status}");
    }
    // Refused after a second decision touched the same blocks: they are its credit now.
    let mut r = router(4);
    let first = r.route(&request(&text), 0, 1);
    let second = r.route(&request(&text), 1, 2);
    assert_eq!(first.response.endpoints[0], second.response.endpoints[0]);
    r.feedback(&outcome(&first, 400), 5);
    assert!(again(&mut r) > 0);
    // A prefix the endpoint held before the refused request keeps its credit; only what the
    // request added goes.
    let longer = format!("{text}{}", "and a refused follow-up ".repeat(40));
    let follow_up = |status: u16| {
        let mut r = router(4);
        let served = r.route(&request(&text), 0, 1);
        r.feedback(&outcome(&served, 200), 5);
        let next = r.route(&request(&longer), 10, 2);
        assert_eq!(next.response.endpoints[0], served.response.endpoints[0]);
        r.feedback(&outcome(&next, status), 15);
        r.route(&request(&longer), 60_000, 3).response.cached_blocks
    };
    let (kept, whole) = (follow_up(400), follow_up(200));
    assert!(kept > 0 && kept < whole, "{kept} of {whole}");
}

// Issue #18: an endpoint whose engine delivers none of the hits the index believes it holds
// (prefix caching off, another chat template, a salt left out of the hash) goes load-only:
// its prefix is no longer credited. When it delivers again, it is trusted again.
#[test]
fn an_endpoint_that_delivers_no_believed_hit_goes_load_only_until_it_does() {
    let mut r = router(1);
    r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
    let prompt = "the same long prompt ".repeat(200);
    let serve = |r: &mut Router, now: u64, delivered: Option<u32>| {
        let d = r.route(&request(&prompt), now, 1);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: "10.0.0.0:8000".into(),
                status: 200,
                prompt_tokens: Some(1_000),
                cached_tokens: Some(delivered.unwrap_or(d.response.cached_tokens)),
                completion_tokens: Some(4),
                ..Outcome::default()
            },
            now,
        );
        d.response
    };
    let first = serve(&mut r, 1, Some(0));
    assert_eq!(first.cached_tokens, 0, "a cold index believes nothing");
    let believed = serve(&mut r, 2, Some(0));
    assert_eq!(believed.reason, RouteReason::Prefix);
    assert!(believed.cached_tokens > 64, "{believed:?}");
    for now in 3..9 {
        serve(&mut r, now, Some(0));
    }
    assert!(
        r.take_state_changes().is_empty(),
        "7 outcomes are not enough"
    );
    serve(&mut r, 9, Some(0));
    let changes = r.take_state_changes();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(changes[0].0, "10.0.0.0:8000");
    assert_eq!(changes[0].1.to, RoutingState::LoadOnly);
    let view = &r.endpoints(9)[0];
    assert_eq!(view.routing_state, RoutingState::LoadOnly);
    assert_eq!(view.state_reason, Some(StateReason::Mismatch));
    // No credit now: the same prompt is routed by load, and costs its whole prefill.
    let unrewarded = serve(&mut r, 10, Some(0));
    assert_eq!(unrewarded.cached_tokens, 0);
    assert_eq!(unrewarded.reason, RouteReason::Load);
    // The engine serves its cache again: the belief is checked all along, and trusted
    // again once it is met.
    for now in 11..60 {
        serve(&mut r, now, Some(1_000));
    }
    let back = r.take_state_changes();
    assert_eq!(back.len(), 1, "{back:?}");
    assert_eq!(back[0].1.to, RoutingState::Exact);
    assert_eq!(r.endpoints(60)[0].routing_state, RoutingState::Exact);
    assert_eq!(serve(&mut r, 61, None).reason, RouteReason::Prefix);
    assert_eq!(r.stats().state_changes, 2);
}

// Issue #18: an endpoint with a KV-event stream that is not live is `degraded` (precise
// requests are scored from the approximate index there), named so, and back to exact when
// the stream is.
#[test]
fn an_endpoint_whose_event_stream_is_down_is_degraded_until_it_is_live() {
    let mut r = router(2);
    let state = |r: &Router, i: usize| {
        let e = &r.endpoints(0)[i];
        (e.routing_state, e.state_reason)
    };
    assert_eq!(
        state(&r, 0),
        (RoutingState::Exact, None),
        "no stream: exact"
    );
    r.set_event_stream("10.0.0.0:8000", false);
    assert_eq!(
        state(&r, 0),
        (RoutingState::Degraded, Some(StateReason::NoKvEvents))
    );
    assert_eq!(state(&r, 1), (RoutingState::Exact, None));
    r.set_event_stream("10.0.0.0:8000", true);
    assert_eq!(state(&r, 0), (RoutingState::Exact, None));
    let changes: Vec<_> = r
        .take_state_changes()
        .into_iter()
        .map(|(a, c)| (a, c.from, c.to, c.reason))
        .collect();
    assert_eq!(
        changes,
        [
            (
                "10.0.0.0:8000".to_string(),
                RoutingState::Exact,
                RoutingState::Degraded,
                StateReason::NoKvEvents
            ),
            (
                "10.0.0.0:8000".to_string(),
                RoutingState::Degraded,
                RoutingState::Exact,
                StateReason::NoKvEvents
            ),
        ]
    );
    // Reported again as it is: no change.
    r.set_event_stream("10.0.0.0:8000", true);
    assert!(r.take_state_changes().is_empty());
}

// Issue #18: an engine whose blocks are not the configured size publishes KV events for
// blocks the router never hashes. It is `degraded` (reason block_size), its precise
// requests are scored from the approximate index, and it is exact again once the sizes
// match; each change is noted once.
#[test]
fn an_engine_with_another_block_size_is_degraded_until_its_blocks_match() {
    let mut r = router(2);
    let (a, b) = ("10.0.0.0:8000", "10.0.0.1:8000");
    let block_tokens = r.config().precise.block_tokens as u32;
    let scraped = |block_size| EndpointMetrics {
        block_size: Some(block_size),
        ..EndpointMetrics::default()
    };
    let state = first_state;
    for e in [a, b] {
        r.set_event_stream(e, true);
        r.update_metrics(e, scraped(block_tokens), 0);
    }
    assert_eq!(state(&r), (RoutingState::Exact, None));
    let scored_precisely = |r: &mut Router, now| scored_precisely(r, a, now);
    assert_eq!(scored_precisely(&mut r, 1), Some(true));
    r.update_metrics(a, scraped(2 * block_tokens), 2);
    r.update_metrics(a, scraped(2 * block_tokens), 3);
    assert_degraded_approximate(&mut r, a, StateReason::BlockSize, 4);
    r.update_metrics(a, scraped(block_tokens), 5);
    assert_exact_precise(&mut r, a, 6);
    assert_degraded_and_back(
        &mut r,
        a,
        StateReason::BlockSize,
        "one change each way, none for the repeated scrape",
    );
    // A stream going down while the blocks differ changes nothing the state says.
    r.update_metrics(a, scraped(2 * block_tokens), 7);
    r.set_event_stream(a, false);
    assert_eq!(
        state(&r),
        (RoutingState::Degraded, Some(StateReason::BlockSize))
    );
    assert_eq!(r.take_state_changes().len(), 1);
}

/// A router over `endpoints`, each with a live KV-event stream.
fn router_with_live_streams(config: RouterConfig, endpoints: &[&str]) -> Router {
    let mut r = Router::new(config, 1);
    for e in endpoints {
        r.upsert_endpoint(e).unwrap();
        r.set_event_stream(e, true);
    }
    r
}

/// Endpoint `a`'s routing state and its reason.
fn state_of(r: &Router, a: &str) -> (RoutingState, Option<StateReason>) {
    let views = r.endpoints(0);
    let v = views
        .iter()
        .find(|v| v.address == a)
        .expect("a known endpoint");
    (v.routing_state, v.state_reason)
}

/// Asserts that `a` is degraded for `reason` and that a precise request routed at `now`
/// scores it from the approximate index.
fn assert_degraded_approximate(r: &mut Router, a: &str, reason: StateReason, now: u64) {
    assert_eq!(state_of(r, a), (RoutingState::Degraded, Some(reason)));
    assert_eq!(
        scored_precisely(r, a, now),
        Some(false),
        "approximate while {reason:?}"
    );
}

/// Asserts that `a` is exact and that a precise request routed at `now` scores it from its
/// event index.
fn assert_exact_precise(r: &mut Router, a: &str, now: u64) {
    assert_eq!(state_of(r, a), (RoutingState::Exact, None));
    assert_eq!(scored_precisely(r, a, now), Some(true));
}

/// Whether a precise request of three token blocks routed at `now` scored `endpoint` from
/// its event index (it does only while that index is trusted); `None` when `endpoint` was
/// no candidate.
fn scored_precisely(r: &mut Router, endpoint: &str, now: u64) -> Option<bool> {
    let probe = RouteRequest {
        model: "m".into(),
        token_block_hashes: vec![1, 2, 3],
        prompt_tokens: 3 * r.config().precise.block_tokens as u32 + 1,
        ..Default::default()
    };
    let d = r.route(&probe, now, 1);
    let c = d
        .candidates
        .iter()
        .find(|c| c.endpoint.as_str() == endpoint);
    c.map(|c| c.precise)
}

// Issue #18: a KV-event stream that lost batches no replay could fill (the caller dropped
// the endpoint's precise state) is `degraded` (reason kv_event_gap) and scored from the
// approximate index until `clean_batches_after_gap` batches in a row arrive in sequence;
// a loss meanwhile starts the count again, and a new session forgets the gap.
#[test]
fn a_stream_that_lost_batches_is_degraded_until_it_runs_clean() {
    let mut config = RouterConfig::default();
    config.self_check.clean_batches_after_gap = 4;
    let (a, b) = ("10.0.0.0:8000", "10.0.0.1:8000");
    let mut r = router_with_live_streams(config, &[a, b]);
    let state = first_state;
    let scored_precisely = |r: &mut Router, now| scored_precisely(r, a, now);
    assert_eq!(scored_precisely(&mut r, 1), Some(true));
    r.note_event_batch_in_sequence(a);
    assert_eq!(state(&r), (RoutingState::Exact, None), "no gap: exact");

    r.note_event_gap(a);
    assert_degraded_approximate(&mut r, a, StateReason::KvEventGap, 2);
    for _ in 0..3 {
        r.note_event_batch_in_sequence(a);
    }
    r.note_event_gap(a);
    for _ in 0..3 {
        r.note_event_batch_in_sequence(a);
    }
    assert_eq!(
        state(&r),
        (RoutingState::Degraded, Some(StateReason::KvEventGap)),
        "still losing batches: the count started again"
    );
    r.note_event_batch_in_sequence(a);
    assert_exact_precise(&mut r, a, 3);
    assert_degraded_and_back(
        &mut r,
        a,
        StateReason::KvEventGap,
        "one change each way, none for the second loss",
    );

    // A session that ends and a new one that rebuilt the history: the old gap is gone.
    r.note_event_gap(a);
    r.set_event_stream(a, false);
    r.set_event_stream(a, true);
    assert_eq!(state(&r), (RoutingState::Exact, None));
}

// Issue #18: an endpoint whose KV events store only blocks of KV-cache groups the index
// cannot use (a hybrid model's other groups) is `degraded` (reason event_groups) after
// `unusable_group_batches` such batches in a row, and scored from the approximate index;
// batches that store nothing say nothing, and one usable store ends it.
#[test]
fn events_of_unusable_kv_groups_only_degrade_until_a_usable_store() {
    let mut config = RouterConfig::default();
    config.self_check.unusable_group_batches = 3;
    let a = "10.0.0.0:8000";
    let mut r = router_with_live_streams(config, &[a]);
    let state = first_state;
    // A healthy hybrid stream: both kinds in one batch, or other groups alone now and then.
    r.note_event_groups(a, 1, 1);
    r.note_event_groups(a, 0, 1);
    r.note_event_groups(a, 0, 0);
    r.note_event_groups(a, 0, 1);
    assert_eq!(state(&r), (RoutingState::Exact, None));
    // Three batches in a row stored only other groups.
    r.note_event_groups(a, 0, 1);
    assert_degraded_approximate(&mut r, a, StateReason::EventGroups, 1);
    r.note_event_groups(a, 2, 0);
    assert_exact_precise(&mut r, a, 2);
    assert_degraded_and_back(&mut r, a, StateReason::EventGroups, "one change each way");
}

// Issue #18: an endpoint whose engine counts the router's canonical bytes in clearly more
// tokens than the rest of its pool (another tokeniser behind the same model name) is
// `degraded` (reason bytes_per_token) and scored from the approximate index; a shift of
// the whole traffic moves every endpoint alike and says nothing; once it counts as the
// others do again, it is trusted again.
/// Serves `n` approximate prompts wherever `r` sends them, the `k`-th at `now + 1,000 k`;
/// endpoint e counts a prompt's bytes in `bytes / per_token(e)` tokens. Returns the last time.
fn serve_counting(r: &mut Router, now: &mut u64, n: u64, per_token: &dyn Fn(&str) -> f64) -> u64 {
    for i in 0..n {
        *now += 1_000;
        let text = format!("request {now} {}", "words ".repeat(400));
        let d = r.route(&request(&text), *now, i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let chosen = d.candidates[0].endpoint.to_string();
        let tokens = (text.len() as f64 / per_token(&chosen)) as u32;
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: chosen,
                status: 200,
                prompt_tokens: Some(tokens),
                cached_tokens: Some(0),
                ..Default::default()
            },
            *now + 10,
        );
    }
    *now
}

#[test]
fn an_endpoint_that_counts_other_tokens_than_its_pool_is_degraded_until_it_agrees() {
    let endpoints = [
        "10.0.0.0:8000",
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
    ];
    let odd = endpoints[3];
    let mut r = router_with_live_streams(RouterConfig::default(), &endpoints);
    let mut now = 0;
    let mut serve = |r: &mut Router, n: u64, per_token: &dyn Fn(&str) -> f64| {
        serve_counting(r, &mut now, n, per_token)
    };
    // English prose everywhere, then code (fewer bytes a token) everywhere: no verdict.
    serve(&mut r, 200, &|_| 4.0);
    serve(&mut r, 200, &|_| 2.5);
    assert!(
        r.take_state_changes().is_empty(),
        "a traffic shift is no drift"
    );
    // One endpoint's engine counts half again as many tokens.
    let now = serve(&mut r, 400, &|e| if e == odd { 1.6 } else { 2.5 });
    assert_degraded_approximate(&mut r, odd, StateReason::BytesPerToken, now + 1);
    for e in &endpoints[..3] {
        assert_eq!(state_of(&r, e), (RoutingState::Exact, None), "{e}");
    }
    // It counts as the others do again: trusted again.
    serve(&mut r, 800, &|_| 2.5);
    assert_eq!(state_of(&r, odd), (RoutingState::Exact, None));
    assert_degraded_and_back(
        &mut r,
        odd,
        StateReason::BytesPerToken,
        "one change each way",
    );
}

// `degraded` says an endpoint's KV-event index cannot be trusted. An endpoint without one
// (approximate mode) has its cache hits from the text whatever its tokeniser, so counting
// other tokens than its pool labels nothing there.
#[test]
fn an_endpoint_without_kv_events_is_not_degraded_for_its_token_count() {
    let mut r = router(4);
    let mut now = 0;
    serve_counting(&mut r, &mut now, 400, &|e| {
        if e == "10.0.0.3:8000" { 1.6 } else { 2.5 }
    });
    assert!(r.take_state_changes().is_empty());
    assert_eq!(state_of(&r, "10.0.0.3:8000"), (RoutingState::Exact, None));
}

// The ceiling is one cache as large as the fleet's KV: the window follows the endpoints'
// scraped capacity (bounded), so a prompt the fleet's caches could not all hold is not
// counted available again.
#[test]
fn the_reuse_window_is_as_large_as_the_fleets_kv() {
    let mut r = router(2);
    assert_eq!(r.reuse_window_blocks(), crate::reuse::DEFAULT_WINDOW_BLOCKS);
    let per_block = r.tokens_per_block();
    let with_capacity = |blocks: f64| EndpointMetrics {
        capacity_tokens: Some((blocks * per_block) as u64),
        ..EndpointMetrics::default()
    };
    // Two endpoints of 12 blocks each: a window of 24.
    for i in 0..2 {
        r.update_metrics(&format!("10.0.0.{i}:8000"), with_capacity(12.0), 0);
    }
    assert_eq!(r.reuse_window_blocks(), 24);
    // Two prompts of 16 blocks each: the second pushes half the first out of the window.
    let (a, b) = ("a".repeat(16 * 256), "b".repeat(16 * 256));
    serve_reported(&mut r, &a, 1, |_| 0);
    serve_reported(&mut r, &b, 2, |_| 0);
    let before = r.fleet_reuse().available_tokens;
    serve_reported(&mut r, &a, 3, |_| 0);
    let again = r.fleet_reuse().available_tokens - before;
    assert_eq!(again, 0, "its first blocks were the least recently seen");
    // A larger fleet remembers both.
    r.update_metrics("10.0.0.0:8000", with_capacity(100.0), 4);
    assert_eq!(r.reuse_window_blocks(), 112);
    serve_reported(&mut r, &b, 5, |_| 0);
    serve_reported(&mut r, &a, 6, |_| 0);
    let seen = r.fleet_reuse().available_tokens - before;
    assert!(seen > 0, "{seen}");
    r.remove_endpoint("10.0.0.0:8000");
    assert_eq!(r.reuse_window_blocks(), 12);
}

// A decision another router took is recorded with only its own endpoint's cost terms, but
// every candidate's cached prefix still counts: a prompt recorded onto the endpoint that does
// not hold it lost the reuse to load, exactly as if this router had spilled it.
#[test]
fn a_recorded_decision_off_the_holder_counts_the_holders_credit() {
    let mut r = scraped_router(2);
    let prompt = "a prompt another proxy routes ".repeat(200);
    let first = serve_reported(&mut r, &prompt, 1, |_| 0);
    let before = r.fleet_reuse();
    let other = if first.endpoints[0] == "10.0.0.0:8000" {
        "10.0.0.1:8000"
    } else {
        "10.0.0.0:8000"
    };
    let decision_id = 1 << 40;
    assert!(r.record_decision(&request(&prompt), other, decision_id, 10_000, 0));
    // The recorded endpoint carries the request; the holder does not.
    let inflight = |r: &Router, address: &str| {
        r.endpoints(10_000)
            .into_iter()
            .find(|e| e.address == address)
            .map(|e| e.inflight)
    };
    assert_eq!(inflight(&r, other), Some(1));
    assert_eq!(inflight(&r, &first.endpoints[0]), Some(0));
    r.feedback(
        &Outcome {
            decision_id,
            endpoint: other.into(),
            status: 200,
            prompt_tokens: Some(prompt.len() as u32 / 4),
            cached_tokens: Some(0),
            completion_tokens: Some(4),
            ..Outcome::default()
        },
        10_000,
    );
    let after = r.fleet_reuse();
    let offered = after.available_tokens - before.available_tokens;
    assert!(offered > 0, "the prompt was seen before");
    assert_eq!(
        after.aimed_tokens, before.aimed_tokens,
        "nothing held where it went"
    );
    assert_eq!(
        after.gap_tokens.load_spill - before.gap_tokens.load_spill,
        offered
    );
}

/// A router of `n` endpoints, each scraped once at time 0 (idle, so usable).
fn scraped_router(n: usize) -> Router {
    let mut r = router(n);
    for i in 0..n {
        r.update_metrics(&format!("10.0.0.{i}:8000"), EndpointMetrics::default(), 0);
    }
    r
}

/// Routes `text` at `now` and reports it served by its first endpoint, with as many prompt
/// tokens as the router counted (4 bytes a token), of which `delivered(response)` from cache.
fn serve_reported(
    r: &mut Router,
    text: &str,
    now: u64,
    delivered: impl Fn(&RouteResponse) -> u32,
) -> RouteResponse {
    let d = r.route(&request(text), now, 1);
    r.feedback(
        &Outcome {
            decision_id: d.response.decision_id,
            endpoint: d.response.endpoints[0].clone(),
            status: 200,
            prompt_tokens: Some(text.len() as u32 / 4),
            cached_tokens: Some(delivered(&d.response)),
            completion_tokens: Some(4),
            ..Outcome::default()
        },
        now,
    );
    d.response
}

// Issue #18's four numbers: the reuse the traffic offered (a prompt seen before, wherever it
// went), what the router aimed for, what the engine delivered, and the gap by reason.
#[test]
fn the_fleet_numbers_split_the_reuse_offered_by_what_became_of_it() {
    let mut r = scraped_router(2);
    let prompt = "the same long prompt ".repeat(200);
    let first = serve_reported(&mut r, &prompt, 1, |_| 0);
    let cold = r.fleet_reuse();
    assert_eq!(
        (cold.outcomes, cold.available_tokens),
        (1, 0),
        "nothing seen before"
    );
    assert_eq!(cold.gap_tokens.total(), 0);

    // The second turn goes to the holder, which delivers half of what was aimed for: the
    // rest of the hit is lost to eviction.
    let second = serve_reported(&mut r, &prompt, 10_000, |d| d.cached_tokens / 2);
    assert_eq!(second.endpoints[0], first.endpoints[0]);
    assert_eq!(second.reason, RouteReason::Prefix);
    let warm = r.fleet_reuse();
    let available = warm.available_tokens;
    assert!(available > 0);
    let delivered = u64::from(second.cached_tokens / 2);
    assert_eq!(warm.delivered_tokens, delivered);
    assert_eq!(warm.aimed_tokens, u64::from(second.cached_tokens));
    assert_eq!(warm.gap_tokens.eviction, available - delivered);
    assert_eq!(warm.gap_tokens.total(), available - delivered);

    // The holder is swamped (a queue the router did not send): the third turn spills to the
    // other endpoint, and everything the window offered is lost to load.
    let busy = EndpointMetrics {
        waiting: 400,
        running: 64,
        ..EndpointMetrics::default()
    };
    r.update_metrics(&first.endpoints[0], busy, 20_000);
    let third = serve_reported(&mut r, &prompt, 20_000, |_| 0);
    assert_ne!(third.endpoints[0], first.endpoints[0]);
    let spilled = r.fleet_reuse();
    let offered = spilled.available_tokens - warm.available_tokens;
    assert_eq!(offered, available, "the same prompt offers the same reuse");
    assert_eq!(spilled.gap_tokens.load_spill, offered);
    assert_eq!(
        spilled.gap_tokens.total(),
        spilled.available_tokens - spilled.delivered_tokens
    );

    // Per pool and per endpoint, the same outcomes.
    let pools = r.pool_reuse();
    assert_eq!(pools.len(), 1);
    assert_eq!((pools[0].0.as_str(), pools[0].1), ("m", spilled));
    let mut by_endpoint = ReuseTotals::default();
    for e in r.endpoints(20_000) {
        by_endpoint.merge(&e.reuse);
    }
    assert_eq!(by_endpoint, spilled);

    // Where the second turn's belief and the engine parted: at the first block it did not
    // serve. The spilled turn believed nothing where it went, so it is not listed.
    let worst = r.mismatches();
    assert_eq!(worst.len(), 1, "{worst:?}");
    let m = &worst[0];
    assert_eq!(m.decision_id, second.decision_id);
    assert_eq!(m.delivered_tokens as u64, delivered);
    assert_eq!(m.parting_block, m.delivered_tokens / m.block_tokens);
    assert!(m.believed_blocks > m.parting_block, "{m:?}");
    assert_eq!(m.model, "m");
}

#[test]
fn a_forged_prompt_size_prices_only_what_its_hashes_cover() {
    // One call claiming 4 GB of prompt with two block hashes: before the bound it put
    // a billion tokens in the replica's backlog (days of prefill).
    let mut r = router(1);
    r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
    let mut forged = request(&"w".repeat(600));
    forged.prompt_bytes = u64::from(u32::MAX);
    forged.prompt_tokens = u32::MAX;
    forged.max_output_tokens = Some(u32::MAX);
    r.route(&forged, 1, 1);
    let view = &r.endpoints(1)[0];
    // Two whole blocks and one partial: 768 bytes, 192 tokens at 4 bytes a token.
    assert!(view.backlog_tokens <= 192.0, "{}", view.backlog_tokens);
    // A precise request's tokens are bounded by its engine blocks the same way.
    let mut precise = request("x");
    precise.token_block_hashes = vec![1, 2];
    precise.prompt_tokens = u32::MAX;
    r.route(&precise, 2, 1);
    let view = &r.endpoints(2)[0];
    assert!(
        view.backlog_tokens <= 192.0 + 48.0,
        "{}",
        view.backlog_tokens
    );
}

#[test]
fn reported_times_cannot_exceed_the_time_since_the_decision() {
    let mut r = router(1);
    r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
    let d = r.route(&request("hello"), 1_000, 1);
    r.feedback(
        &Outcome {
            decision_id: d.response.decision_id,
            endpoint: "10.0.0.0:8000".into(),
            status: 200,
            ttfb_ms: Some(u64::MAX / 2),
            total_ms: u64::MAX / 2,
            completion_tokens: Some(4),
            ..Outcome::default()
        },
        1_050,
    );
    // Read as 50 ms, the time since the decision.
    assert_eq!(r.stats().clamped_outcomes, 1);
}

#[test]
fn a_withdrawn_call_holds_no_load_whenever_it_is_decided() {
    let mut r = router(1);
    r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
    let load = |r: &Router| {
        let v = &r.endpoints(5)[0];
        (v.inflight, v.backlog_tokens)
    };
    // Withdrawn after its decision: released at once, and the outcome says where.
    let mut late = request(&"a ".repeat(2_000));
    late.call_id = Some(11);
    let d = r.route(&late, 1, 1);
    assert_eq!(load(&r).0, 1);
    let released = r.withdraw(11, 2).expect("the decision is live");
    assert_eq!(released.decision_id, d.response.decision_id);
    assert_eq!(released.endpoint, "10.0.0.0:8000");
    assert_eq!(load(&r), (0, 0.0));
    // Withdrawn while still queued (a stalled control plane): never taken.
    assert!(r.withdraw(12, 3).is_none());
    let mut queued = request(&"b ".repeat(2_000));
    queued.call_id = Some(12);
    let d = r.route(&queued, 4, 1);
    assert_eq!(d.response.reason, RouteReason::Withdrawn);
    assert!(d.response.endpoints.is_empty());
    assert_eq!(load(&r), (0, 0.0));
    // The tombstone is used up: the same id later is an ordinary call.
    assert!(!r.route(&queued, 5, 1).response.endpoints.is_empty());
    assert_eq!(r.stats().withdrawn, 2);
}

#[test]
fn a_routed_miss_evicts_the_oldest_history_from_the_approximate_index() {
    // One replica of 12,000 KV tokens. A 3,000-token history is cached, then three other
    // 3,000-token prompts fill the cache behind it. A 6,000-token miss routed there will
    // make the engine evict its least recently used blocks: the history, which the index
    // stops promising at once. Touched last instead, the history is safe.
    let mut r = router_with_kv_capacity(1, 12_000);
    let text = |k: u64| format!("conversation {k} ").repeat(800);
    let answer = |r: &mut Router, d: Decision| {
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                ..Default::default()
            },
            0,
        )
    };
    let ask = |r: &mut Router, prompt: &str, now: u64| {
        let mut req = request(prompt);
        req.max_output_tokens = Some(16);
        r.route(&req, now, 1)
    };
    for (k, now) in [(0, 1_000), (1, 2_000), (2, 3_000), (3, 4_000)] {
        let d = ask(&mut r, &text(k), now);
        answer(&mut r, d);
    }
    let follow_up = format!("{} and then?", text(0));
    let idle = ask(&mut r, &follow_up, 10_000);
    assert!(idle.candidates[0].cached_tokens > 2_500);
    answer(&mut r, idle);

    // The follow-up touched the history: ages it from the newest end again.
    for (k, now) in [(1, 11_000), (2, 12_000), (3, 13_000)] {
        let d = ask(&mut r, &text(k), now);
        answer(&mut r, d);
    }
    let miss = ask(&mut r, &"a long new document ".repeat(1_200), 20_000);
    let queued = ask(&mut r, &follow_up, 20_000);
    assert_eq!(queued.candidates[0].cached_tokens, 0, "{queued:?}");
    answer(&mut r, queued);
    answer(&mut r, miss);

    // Touched after everything else, it is the last to go.
    let refresh = ask(&mut r, &follow_up, 30_000);
    answer(&mut r, refresh);
    let _miss = ask(&mut r, &"another new document ".repeat(1_000), 40_000);
    let queued = ask(&mut r, &follow_up, 40_000);
    assert!(queued.candidates[0].cached_tokens > 2_500, "{queued:?}");
}

#[test]
fn a_learned_ratio_counts_the_index_in_the_engines_tokens() {
    let mut r = Router::new(
        RouterConfig {
            learn_bytes_per_token: true,
            ..RouterConfig::default()
        },
        1,
    );
    r.upsert_endpoint("10.0.0.0:8000").unwrap();
    // Text at 8 bytes a token: 25,600 bytes are 100 blocks and 3,200 tokens.
    let text = "ab".repeat(12_800);
    let usage = |r: &mut Router, decision: &Decision, status: u16, prompt_tokens: u32| {
        let outcome = Outcome {
            decision_id: decision.response.decision_id,
            status,
            prompt_tokens: Some(prompt_tokens),
            ..Default::default()
        };
        r.feedback(&outcome, 1_000);
    };
    let first = r.route(&request(&text), 0, 1);
    assert!((r.bytes_per_token() - 4.0).abs() < 1e-9);
    usage(&mut r, &first, 200, 3_200);
    assert!((r.bytes_per_token() - 8.0).abs() < 1e-9);
    assert!((r.tokens_per_block() - 32.0).abs() < 1e-9);
    // The repeat is counted in the engine's tokens, not at the filter's 4 bytes a token.
    let again = r.route(&request(&text), 60_000, 2);
    let c = &again.candidates[0];
    assert_eq!(c.cached_tokens + c.uncached_tokens, 3_200, "{c:?}");
    assert!(c.cached_tokens >= 3_100, "{c:?}");
    // A failed response teaches nothing.
    usage(&mut r, &again, 500, 100);
    assert!((r.bytes_per_token() - 8.0).abs() < 1e-9);
}

#[test]
fn unreachable_is_skipped_and_none_left_is_empty() {
    let mut r = router(1);
    r.mark_unreachable("10.0.0.0:8000");
    let d = r.route(&request("abc"), 0, 1);
    assert!(d.response.endpoints.is_empty());
    assert_eq!(r.stats().no_endpoint, 1);
}

#[test]
fn feedback_releases_and_expiry_cleans() {
    let mut r = router(2);
    let d = r.route(&request(&"y".repeat(600)), 0, 1);
    assert_eq!(r.inflight_len(), 1);
    r.feedback(
        &Outcome {
            decision_id: d.response.decision_id,
            cached_tokens: Some(0),
            ..Default::default()
        },
        5,
    );
    assert_eq!(r.inflight_len(), 0);
    r.route(&request(&"z".repeat(600)), 0, 1);
    r.expire(10_000_000);
    assert_eq!(r.inflight_len(), 0);
    assert!(r.endpoints(0).iter().all(|e| e.inflight == 0));
}

#[test]
fn expiry_queue_stays_proportional_to_what_is_in_flight() {
    let mut r = router(2);
    let ttl = r.config().inflight_ttl_ms;
    for t in 0..10_000u64 {
        let d = r.route(&request(&"w".repeat(300)), t, t);
        if t % 2 == 0 {
            r.feedback(
                &Outcome {
                    decision_id: d.response.decision_id,
                    ..Default::default()
                },
                t,
            );
        }
    }
    assert_eq!(r.inflight_len(), 5_000);
    assert!(r.inflight_order.len() <= 2 * r.inflight_len() + 1024);
    // Half of them were never answered: they expire once their TTL has passed, no earlier.
    r.expire(9_999 + ttl - 5_000);
    assert!(r.inflight_len() > 0 && r.inflight_len() < 5_000);
    r.expire(10_000 + ttl);
    assert_eq!(r.inflight_len(), 0);
    assert_eq!(r.stats().expired_inflight, 5_000);
    assert!(r.endpoints(0).iter().all(|e| e.inflight == 0));
}

#[test]
fn guard_stops_hot_spotting() {
    let mut r = router(2);
    let shared = "same prefix ".repeat(200);
    let mut counts = HashMap::new();
    for i in 0..64 {
        let d = r.route(&request(&format!("{shared}{i}")), 0, i);
        *counts.entry(d.response.endpoints[0].clone()).or_insert(0) += 1;
    }
    assert_eq!(counts.len(), 2, "{counts:?}");
}

#[test]
fn outcomes_are_credited_to_the_endpoint_that_served() {
    let mut r = router(2);
    let d = r.route(&request(&"w".repeat(600)), 0, 1);
    let chosen = d.response.endpoints[0].clone();
    let other = d.response.endpoints[1].clone();
    let outcome = |endpoint: &str, id| Outcome {
        decision_id: id,
        endpoint: endpoint.into(),
        prompt_tokens: Some(150),
        cached_tokens: Some(100),
        ..Default::default()
    };
    r.feedback(&outcome(&chosen, d.response.decision_id), 1);
    let d2 = r.route(&request(&"v".repeat(600)), 0, 2);
    let fallback = if d2.response.endpoints[0] == chosen {
        other
    } else {
        chosen.clone()
    };
    r.feedback(&outcome(&fallback, d2.response.decision_id), 2);
    let views = r.endpoints(2);
    let served = |a: &str| views.iter().find(|e| e.address == a).unwrap().served;
    let total: u64 = views.iter().map(|e| e.served.outcomes).sum();
    assert_eq!(total, 2);
    assert_eq!(served(&fallback).fallbacks, 1);
    assert_eq!(r.stats().fallbacks, 1);
    assert_eq!(
        (served(&chosen).prompt_tokens, served(&chosen).cached_tokens),
        if fallback == chosen {
            (300, 200)
        } else {
            (150, 100)
        }
    );
    assert_eq!(r.stats().precise_decisions, 0);
}

#[test]
fn endpoint_limit_is_an_error() {
    let mut r = router(0);
    for i in 0..MAX_ENDPOINTS {
        r.upsert_endpoint(&format!("e{i}")).unwrap();
    }
    assert_eq!(
        r.upsert_endpoint("one-more"),
        Err(RouterError::TooManyEndpoints)
    );
    r.remove_endpoint("e3");
    assert!(r.upsert_endpoint("one-more").is_ok());
}

// Every engine refuses a prompt longer than its context (a 400 before any token), so it is
// routed by load and its blocks are credited nowhere: the next request with that prefix is
// predicted no hit, and the blocks it would have pushed out of the index stay. A decision
// another router took for it is accounted the same way.
#[test]
fn a_prompt_no_context_holds_is_credited_to_no_endpoint() {
    let text = "a long document that no replica can take ".repeat(200);
    let routed_twice = |max_model_len: Option<u32>| {
        let mut r = router(2);
        for i in 0..2 {
            let served = vec![ServedModel {
                id: "m".into(),
                parent: None,
                max_model_len,
            }];
            r.set_served_models(&format!("10.0.0.{i}:8000"), served);
        }
        let first = r.route(&request(&text), 0, 1);
        assert_eq!(first.response.endpoints.len(), 2, "routed all the same");
        r.record_decision(&request(&text), "10.0.0.1:8000", 1 << 40, 5_000, 0);
        let again = r.route(&request(&text), 10_000, 2);
        (
            again.response.cached_blocks,
            r.pool_stats().context_exceeded,
        )
    };
    let (cached, exceeded) = routed_twice(Some(1_000));
    assert_eq!((cached, exceeded), (0, 2));
    let (cached, exceeded) = routed_twice(Some(100_000));
    assert!(cached > 0, "within the context the prompt is credited");
    assert_eq!(exceeded, 0);
}

/// Every field the default configuration sends to the proxies' copies, as key paths: what a
/// filter built on 2026-12-06 (`c774960`) reads, checked against that build. A filter
/// rejects unknown fields at every level, and a copy that cannot read its configuration never
/// syncs, so a control plane upgraded before its proxies would break every proxy built before
/// a field it sends. `calibration.first_tokens` did that once: sent at its new default, it put
/// a filter of the day before on the slow path (620-700 Envoy µs a request against 150;
/// docs/BENCHMARKS.md, 2026-12-07). A new field is left out of the serialized form at its
/// default (`skip_serializing_if`), so this list stays as it is; growing it drops every older
/// filter.
const FIELDS_OLDER_FILTERS_READ: [&str; 71] = [
    "block_bytes",
    "bytes_per_token",
    "calibration",
    "calibration.enabled",
    "calibration.half_life_ms",
    "calibration.prior_decode_tokens",
    "fallbacks",
    "index_ttl_ms",
    "inflight_ttl_ms",
    "latency",
    "latency.blend",
    "latency.enabled",
    "latency.error_smoothing",
    "latency.forgetting",
    "latency.min_samples",
    "latency.overhead_ms",
    "learn_bytes_per_token",
    "local",
    "local.defer_above_ms",
    "lora",
    "lora.full_penalty_ms",
    "lora.load_ms",
    "max_request_tokens",
    "models",
    "models.unknown_model",
    "pd",
    "pd.threshold_tokens",
    "precise",
    "precise.block_tokens",
    "precise.offload_weight",
    "precise.speculative_ttl_ms",
    "responses",
    "responses.max_entries",
    "responses.ttl_ms",
    "scoring",
    "scoring.decode_ms_per_seq",
    "scoring.decode_occupancy_weight",
    "scoring.decode_weight",
    "scoring.default_output_tokens",
    "scoring.guard_abs",
    "scoring.guard_rel",
    "scoring.itl_ms_full",
    "scoring.itl_ms_idle",
    "scoring.kv_decode_ms",
    "scoring.kv_pressure_ms",
    "scoring.kv_pressure_threshold",
    "scoring.prefill_stall_weight",
    "scoring.prefill_tokens_per_ms",
    "scoring.prefill_weight",
    "scoring.tie_ms",
    "scoring.unknown_request_tokens",
    "self_check",
    "self_check.clean_batches_after_gap",
    "self_check.confirm_after_ms",
    "self_check.enabled",
    "self_check.enter_below",
    "self_check.leave_above",
    "self_check.max_probe_after_ms",
    "self_check.min_believed_tokens",
    "self_check.min_samples",
    "self_check.probe_after_ms",
    "self_check.window",
    "sessions",
    "sessions.bonus_ms",
    "sessions.max_kv_usage",
    "sessions.max_sessions",
    "sessions.max_waiting",
    "sessions.return_within_ms",
    "sessions.start_turns",
    "sessions.ttl_ms",
    "stale_after_ms",
];

#[test]
fn the_default_configuration_sends_only_fields_older_filters_read() {
    fn paths(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        for (key, value) in v.as_object().into_iter().flatten() {
            let path = match prefix {
                "" => key.clone(),
                _ => format!("{prefix}.{key}"),
            };
            out.push(path.clone());
            paths(&path, value, out);
        }
    }
    let mut sent = Vec::new();
    paths(
        "",
        &serde_json::to_value(RouterConfig::default()).unwrap(),
        &mut sent,
    );
    sent.sort();
    let mut readable: Vec<String> = FIELDS_OLDER_FILTERS_READ.map(String::from).to_vec();
    readable.sort();
    assert_eq!(sent, readable);
}

/// Two endpoints: `.0` runs 200 sequences with nothing queued, `.1` runs nothing behind 100
/// queued requests. Routes a 5,000-token miss of `api` there with `wait_cap` and returns the
/// chosen endpoint and whether any candidate was capped.
fn wait_cap_probe(api: ApiKind, wait_cap: f64) -> (String, bool) {
    let mut config = RouterConfig::default();
    config.scoring.wait_cap = wait_cap;
    let mut r = router_with(config, 2);
    let busy = EndpointMetrics {
        running: 200,
        ..EndpointMetrics::default()
    };
    let queued = EndpointMetrics {
        waiting: 100,
        ..EndpointMetrics::default()
    };
    r.update_metrics("10.0.0.0:8000", busy, 0);
    r.update_metrics("10.0.0.1:8000", queued, 0);
    let mut long = request(&"a long document to summarise ".repeat(690));
    long.api = Some(api);
    let d = r.route(&long, 10, 1);
    let capped = d.candidates.iter().any(|c| c.capped);
    (d.response.endpoints[0].clone(), capped)
}

// The load terms price the 200 decodes a 5,000-token prefill would stall on `.0`, enough to
// send the request behind 100 queued requests on `.1`: about eleven times its soonest start.
// The wait cap keeps a chat request off that queue; an agent API's request, whose cost is the
// whole answer, is not capped.
#[test]
fn the_wait_cap_keeps_a_chat_request_off_a_queue_many_times_its_soonest_start() {
    assert_eq!(
        wait_cap_probe(ApiKind::Chat, 0.0),
        ("10.0.0.1:8000".to_string(), false)
    );
    let (chosen, capped) = wait_cap_probe(ApiKind::Chat, RouterConfig::default().scoring.wait_cap);
    assert_eq!((chosen.as_str(), capped), ("10.0.0.0:8000", true));
    assert_eq!(
        wait_cap_probe(ApiKind::Messages, RouterConfig::default().scoring.wait_cap),
        ("10.0.0.1:8000".to_string(), false)
    );
}

#[test]
fn a_tie_goes_to_the_replica_with_the_most_free_kv() {
    // Two idle replicas cost a cold request the same; the one with twice the KV capacity (a
    // larger GPU, or one with more memory left for the cache) takes it under every seed, and
    // a replica whose capacity no scrape has told takes its turn in the draw.
    let fleet = || {
        let mut r = router(3);
        for (i, tokens) in [(0, 100_000u64), (1, 200_000)] {
            let metrics = EndpointMetrics {
                capacity_tokens: Some(tokens),
                counters: None,
                ..EndpointMetrics::default()
            };
            r.update_metrics(&format!("10.0.0.{i}:8000"), metrics, 0);
        }
        r
    };
    let mut chosen = std::collections::BTreeSet::new();
    for seed in 0..32u64 {
        let prompt = format!("cold prompt {seed} ").repeat(50);
        let d = fleet().route(&request(&prompt), 10, seed);
        chosen.insert(d.response.endpoints[0].clone());
    }
    let expected: std::collections::BTreeSet<String> =
        ["10.0.0.1:8000", "10.0.0.2:8000"].map(String::from).into();
    assert_eq!(chosen, expected);
}

#[test]
fn a_stale_scrape_s_usage_does_not_break_a_tie() {
    // Two replicas of one capacity, idle as far as the router knows. Replica 0's last scrape
    // said it was 90 % full, but that scrape is older than `stale_after_ms`: the cost terms
    // no longer read it, and neither does the tie-break, so the seed draws between both.
    let mut chosen = std::collections::BTreeSet::new();
    for seed in 0..32u64 {
        let mut r = router(2);
        let stale_after = r.config().stale_after_ms;
        for (i, usage) in [(0, 0.9), (1, 0.0)] {
            let metrics = EndpointMetrics {
                capacity_tokens: Some(100_000),
                kv_usage: usage,
                counters: None,
                ..EndpointMetrics::default()
            };
            let at = if i == 0 { 0 } else { stale_after + 5 };
            r.update_metrics(&format!("10.0.0.{i}:8000"), metrics, at);
        }
        let prompt = format!("cold prompt {seed} ").repeat(50);
        let d = r.route(&request(&prompt), stale_after + 10, seed);
        chosen.insert(d.response.endpoints[0].clone());
    }
    assert_eq!(chosen.len(), 2, "{chosen:?}");
}
