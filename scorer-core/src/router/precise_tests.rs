use super::*;
use crate::hash::{block_hashes, model_seed, token_block_hashes};
use crate::precise::Medium;

fn router() -> Router {
    let mut r = Router::new(RouterConfig::default(), 1);
    for a in ["a:1", "b:1"] {
        r.upsert_endpoint(a).unwrap();
        r.set_event_stream(a, true);
    }
    r
}

fn stored(tokens: &[u32], medium: Medium) -> KvEvent {
    stored_from(1000, tokens, medium)
}

/// A store of `tokens` at the prompt's start, named by engine hashes from `first_hash` on.
fn stored_from(first_hash: u64, tokens: &[u32], medium: Medium) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..tokens.len() as u64 / 16)
            .map(|i| first_hash + i)
            .collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 16,
        lora_name: None,
        cache_salt: None,
        medium,
    }
}

/// A router whose `endpoint` reported `tokens` stored in `medium`.
fn router_holding(endpoint: &str, tokens: &[u32], medium: Medium) -> Router {
    let mut r = router();
    r.apply_kv_event(endpoint, "m", &stored(tokens, medium), 0)
        .unwrap();
    r
}

fn request(tokens: &[u32]) -> RouteRequest {
    RouteRequest {
        model: "m".into(),
        prompt_tokens: tokens.len() as u32,
        token_block_hashes: token_block_hashes(model_seed("m"), tokens, 16),
        ..Default::default()
    }
}

#[test]
fn events_decide_where_the_prefix_is() {
    let tokens: Vec<u32> = (0..321).collect();
    let mut r = router_holding("b:1", &tokens[..320], Medium::Gpu);
    let d = r.route(&request(&tokens), 10, 3);
    assert_eq!(d.response.endpoints[0], "b:1");
    let best = &d.candidates[0];
    assert!(best.precise);
    assert_eq!(best.cached_blocks, 20);
    assert_eq!(best.cached_tokens, 320);
    assert_eq!(r.stats().precise_decisions, 1);
}

#[test]
fn the_response_predicts_cached_tokens_in_one_unit_whichever_index_scored() {
    // Precise: 20 engine blocks of 16 tokens on GPU.
    let tokens: Vec<u32> = (0..321).collect();
    let mut r = router_holding("b:1", &tokens[..320], Medium::Gpu);
    let precise = r.route(&request(&tokens), 10, 3);
    assert_eq!(
        (
            precise.response.cached_blocks,
            precise.response.cached_tokens
        ),
        (20, 320)
    );
    // Approximate: the same 320 tokens are 5 hash blocks of 256 bytes at 4 bytes a token,
    // and count as the same 20 engine blocks.
    let mut r = Router::new(RouterConfig::default(), 1);
    r.upsert_endpoint("a:1").unwrap();
    let text = "t".repeat(256 * 5);
    let hashes = block_hashes(model_seed("m"), text.as_bytes(), 256);
    r.index_mut().insert(EndpointId(0), &hashes, 0);
    let longer = format!("{text}{}", "u".repeat(64));
    let approximate = r.route(
        &RouteRequest {
            model: "m".into(),
            block_hashes: block_hashes(model_seed("m"), longer.as_bytes(), 256),
            prompt_bytes: longer.len() as u64,
            ..Default::default()
        },
        10,
        3,
    );
    assert!(!approximate.candidates[0].precise);
    assert_eq!(
        (
            approximate.response.cached_blocks,
            approximate.response.cached_tokens
        ),
        (20, 320)
    );
    for d in [&precise, &approximate] {
        assert_eq!(d.response.cached_tokens, d.candidates[0].cached_tokens);
    }
}

#[test]
fn last_token_is_never_a_hit() {
    let tokens: Vec<u32> = (0..320).collect();
    let mut r = router_holding("a:1", &tokens, Medium::Gpu);
    let d = r.route(&request(&tokens), 10, 3);
    assert_eq!(
        d.candidates[0].cached_tokens, 304,
        "19 of 20 blocks: the 320th token is recomputed"
    );
}

#[test]
fn down_stream_falls_back_to_approximate_and_drops_state() {
    let tokens: Vec<u32> = (0..160).collect();
    let mut r = router_holding("b:1", &tokens, Medium::Gpu);
    r.set_event_stream("b:1", false);
    let d = r.route(&request(&tokens), 10, 3);
    assert!(
        d.candidates
            .iter()
            .all(|c| !c.precise || c.cached_blocks == 0)
    );
    assert_eq!(
        r.endpoints(10)
            .iter()
            .map(|e| e.precise_blocks)
            .sum::<usize>(),
        0
    );
}

#[test]
fn offload_counts_below_gpu_and_above_nothing() {
    let tokens: Vec<u32> = (0..161).collect();
    let mut r = router_holding("a:1", &tokens[..160], Medium::Cpu);
    let d = r.route(&request(&tokens), 10, 3);
    let a = d.candidates.iter().find(|c| c.endpoint == "a:1").unwrap();
    assert_eq!(a.cached_tokens, 80, "half credit for 160 offloaded tokens");
    assert_eq!(d.response.endpoints[0], "a:1");
}

#[test]
fn speculative_entries_hold_a_burst_together_then_expire() {
    let mut r = router();
    let tokens: Vec<u32> = (0..800).collect();
    let first = r.route(&request(&tokens), 0, 1).response.endpoints[0].clone();
    // Much later than the backlog drain, still within the speculative TTL.
    let second = r.route(&request(&tokens), 1_500, 2);
    assert_eq!(second.response.endpoints[0], first);
    assert!(second.candidates[0].cached_blocks > 0);
    r.expire(10_000);
    let third = r.route(&request(&tokens), 10_000, 3);
    assert!(
        third
            .candidates
            .iter()
            .all(|c| c.cached_blocks == 0 || c.endpoint == first)
    );
}

// A prompt queued behind a long prefill stays credited to its replica past the speculative
// TTL: its blocks cannot be stored, nor their events sent, before its prefill runs. Once its
// first token says it ran, the TTL applies (the L4 long-doc cells: precise hit rate 0.940
// against approximate 0.953 when a 10-second queue outlived the 2-second TTL).
#[test]
fn a_queued_prompt_keeps_its_speculative_blocks_until_its_prefill_runs() {
    let mut r = router();
    let tokens: Vec<u32> = (0..800).collect();
    let streamed = RouteRequest {
        stream: true,
        ..request(&tokens)
    };
    let first = r.route(&streamed, 0, 1);
    let held = first.response.endpoints[0].clone();
    let ttl = RouterConfig::default().precise.speculative_ttl_ms;
    r.expire(5 * ttl);
    let second = r.route(&streamed, 5 * ttl, 2);
    assert_eq!(second.response.endpoints[0], held);
    assert!(second.candidates[0].cached_blocks > 0);
    r.first_token(first.response.decision_id, 5 * ttl + 1, None);
    r.first_token(second.response.decision_id, 5 * ttl + 1, None);
    r.expire(7 * ttl);
    let third = r.route(&streamed, 7 * ttl, 3);
    assert!(
        third.candidates.iter().all(|c| c.cached_blocks == 0),
        "{:?}",
        third.candidates
    );
}

// A prompt the engines evicted everywhere is still routed where the history sent it: the
// events place it nowhere, so the approximate index (the routing history) scores it, and a
// busier replica that held it keeps its group together. Once an engine reports any of it
// stored, the events decide again.
#[test]
fn a_prompt_evicted_everywhere_follows_its_history() {
    let tokens: Vec<u32> = (0..800).collect();
    let text = "a group's long system prompt ".repeat(110);
    let with_history = |tokens: &[u32]| RouteRequest {
        block_hashes: block_hashes(model_seed("m"), text.as_bytes(), 256),
        prompt_bytes: text.len() as u64,
        ..request(tokens)
    };
    let mut r = router();
    let first = r.route(&with_history(&tokens), 0, 1);
    let held = first.response.endpoints[0].clone();
    let other = if held == "a:1" { "b:1" } else { "a:1" };
    // The engine stored the prompt, then evicted all of it; the speculative entries expired.
    r.apply_kv_event(&held, "m", &stored(&tokens[..784], Medium::Gpu), 10)
        .unwrap();
    let evicted = KvEvent::BlockRemoved {
        block_hashes: (0..49).map(|i| 1000 + i).collect(),
        medium: Medium::Gpu,
    };
    r.apply_kv_event(&held, "m", &evicted, 20).unwrap();
    r.expire(60_000);
    // The holder is the busier one now.
    assert!(r.record_decision(&request(&[7; 64]), &held, 1 << 40, 60_000, 0));
    let d = r.route(&with_history(&tokens), 60_001, 2);
    assert_eq!(d.response.endpoints[0], held, "{:?}", d.candidates);
    assert!(d.candidates.iter().all(|c| !c.precise));
    // Any of it stored anywhere: the events decide, and they say the other replica.
    r.apply_kv_event(
        other,
        "m",
        &stored_from(5000, &tokens[..784], Medium::Gpu),
        60_002,
    )
    .unwrap();
    let d = r.route(&with_history(&tokens), 60_003, 3);
    assert_eq!(d.response.endpoints[0], other, "{:?}", d.candidates);
    assert!(d.candidates[0].precise);

    // The history of a replica whose events are not used (its stream is down) is read for it
    // anyway: the others stay scored on their events.
    let mut r = router();
    let held = r.route(&with_history(&tokens), 0, 1).response.endpoints[0].clone();
    let other = if held == "a:1" { "b:1" } else { "a:1" };
    r.set_event_stream(&held, false);
    r.expire(60_000);
    let d = r.route(&with_history(&tokens), 60_001, 2);
    let scored = |e: &str| {
        d.candidates
            .iter()
            .find(|c| c.endpoint == e)
            .unwrap()
            .precise
    };
    assert!(!scored(&held) && scored(other), "{:?}", d.candidates);
}

#[test]
fn a_queue_that_will_evict_a_history_takes_its_predicted_hit_away() {
    // One replica of 4,800 KV tokens, full: a 1,600-token history stored first, 3,200
    // other tokens after it. A 3,200-token miss queued ahead makes the engine evict its
    // least recently used blocks, the history among them, before the follow-up is
    // admitted; no event says so yet. Once a hit has refreshed the history, the same
    // queue evicts the other blocks first.
    let mut r = full_replica_with_history();
    let follow_up: Vec<u32> = (0..1_700).collect();
    let miss: Vec<u32> = (90_000..93_200).collect();

    let queued_miss = r.route(&request(&miss), 100_000, 1);
    let queued = r.route(&request(&follow_up), 100_000, 2);
    assert_eq!(queued.candidates[0].cached_tokens, 0, "{queued:?}");
    answer(&mut r, queued_miss, 200_000);
    answer(&mut r, queued, 200_000);

    // With no queue the history is all there; the hit refreshes it, so the 3,200 others
    // go first under the same queue.
    let idle = r.route(&request(&follow_up), 200_000, 3);
    assert_eq!(idle.candidates[0].cached_tokens, 1_600);
    answer(&mut r, idle, 200_000);
    let _miss = r.route(&request(&miss), 300_000, 4);
    let queued = r.route(&request(&follow_up), 300_000, 5);
    assert_eq!(queued.candidates[0].cached_tokens, 1_600, "{queued:?}");
}

/// One replica of 4,800 KV tokens whose events are live (the queue tests).
fn small_replica() -> Router {
    let mut r = Router::new(RouterConfig::default(), 1);
    r.upsert_endpoint("a:1").unwrap();
    r.set_event_stream("a:1", true);
    let capacity = EndpointMetrics {
        capacity_tokens: Some(4_800),
        counters: None,
        ..EndpointMetrics::default()
    };
    r.update_metrics("a:1", capacity, 0);
    r
}

/// [`small_replica`], full: a 1,600-token history (prompt tokens 0..1,600) stored, then 3,200
/// other tokens.
fn full_replica_with_history() -> Router {
    let mut r = small_replica();
    let history: Vec<u32> = (0..1_600).collect();
    let others: Vec<u32> = (50_000..53_200).collect();
    r.apply_kv_event("a:1", "m", &stored_from(1_000, &history, Medium::Gpu), 0)
        .unwrap();
    r.apply_kv_event("a:1", "m", &stored_from(5_000, &others, Medium::Gpu), 0)
        .unwrap();
    r
}

/// Reports `d` served: a 200 with one token.
fn answer(r: &mut Router, d: Decision, now_ms: u64) {
    let outcome = Outcome {
        decision_id: d.response.decision_id,
        endpoint: d.response.endpoints[0].clone(),
        status: 200,
        completion_tokens: Some(1),
        ..Default::default()
    };
    r.feedback(&outcome, now_ms);
}

#[test]
fn a_queue_evicts_a_history_but_not_the_system_prompt_every_request_refreshes() {
    // A full replica: an 800-token system prompt and a conversation's 800-token history
    // behind it, 3,200 other tokens stored after them, then another conversation refreshes
    // the system prompt. A 3,200-token miss queued ahead evicts the least recently used
    // 200 blocks: the history and 150 of the others. The follow-up keeps its system prompt.
    let mut r = full_replica_with_history();
    let another: Vec<u32> = (0..800).chain(70_000..70_100).collect();
    let refresh = r.route(&request(&another), 100_000, 1);
    assert_eq!(refresh.candidates[0].cached_tokens, 800);
    answer(&mut r, refresh, 150_000);

    let miss: Vec<u32> = (90_000..93_200).collect();
    let follow_up: Vec<u32> = (0..1_700).collect();
    let _miss = r.route(&request(&miss), 200_000, 2);
    let queued = r.route(&request(&follow_up), 200_000, 3);
    // Cut at the last sampled block the queue leaves (every eighth): up to 7 blocks short.
    let cached = queued.candidates[0].cached_tokens;
    assert!((800 - 7 * 16..=800).contains(&cached), "{queued:?}");
}

#[test]
fn a_finished_requests_blocks_outlive_those_stored_while_it_ran() {
    // A conversation's 1,600-token history is stored, its next turn is routed there, and
    // 3,200 tokens of other traffic are stored while that turn runs. When it ends, vLLM frees
    // its blocks to the recently used end of the free queue: a 3,200-token miss queued
    // ahead of the turn after evicts the other traffic, not the history.
    let mut r = small_replica();
    let history: Vec<u32> = (0..1_600).collect();
    r.apply_kv_event("a:1", "m", &stored_from(1_000, &history, Medium::Gpu), 0)
        .unwrap();
    let turn: Vec<u32> = (0..1_700).collect();
    let running = r.route(&request(&turn), 100_000, 1);
    let others: Vec<u32> = (50_000..53_200).collect();
    r.apply_kv_event(
        "a:1",
        "m",
        &stored_from(5_000, &others, Medium::Gpu),
        100_001,
    )
    .unwrap();
    answer(&mut r, running, 150_000);

    let miss: Vec<u32> = (90_000..93_200).collect();
    let _miss = r.route(&request(&miss), 200_000, 2);
    let queued = r.route(&request(&turn), 200_000, 3);
    assert_eq!(queued.candidates[0].cached_tokens, 1_600, "{queued:?}");
}

/// A store whose parent block was never seen.
fn orphan_store() -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: vec![7],
        parent_block_hash: Some(999),
        token_ids: (0..16).collect(),
        block_size: 16,
        lora_name: None,
        cache_salt: None,
        medium: Medium::Gpu,
    }
}

#[test]
fn bad_event_drops_the_endpoint_state() {
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router_holding("a:1", &tokens, Medium::Gpu);
    let orphan = orphan_store();
    assert!(r.apply_kv_event("a:1", "m", &orphan, 0).is_err());
    assert_eq!(r.stats().kv_event_errors, 1);
    assert_eq!(r.endpoints(0)[0].precise_blocks, 0);
}

#[test]
fn partial_history_skips_orphans_but_keeps_state() {
    let mut r = router();
    let tokens: Vec<u32> = (0..32).collect();
    r.apply_kv_event_partial("a:1", "m", &stored(&tokens, Medium::Gpu), 0)
        .unwrap();
    let orphan = orphan_store();
    assert_eq!(
        r.apply_kv_event_partial("a:1", "m", &orphan, 0),
        Err(ApplyError::UnknownParent(999))
    );
    assert_eq!(r.stats().kv_event_errors, 0);
    assert_eq!(r.endpoints(0)[0].precise_blocks, 2);
    let bad = KvEvent::BlockStored {
        block_hashes: vec![8],
        parent_block_hash: None,
        token_ids: (0..3).collect(),
        block_size: 16,
        lora_name: None,
        cache_salt: None,
        medium: Medium::Gpu,
    };
    assert!(r.apply_kv_event_partial("a:1", "m", &bad, 0).is_err());
    assert_eq!(
        r.endpoints(0)[0].precise_blocks,
        0,
        "other errors still drop"
    );
}

// Issue #18: an engine that hashes prompts otherwise than the router (a cache salt it
// leaves out, another chat template, a LoRA adapter under another name) publishes blocks no
// request of the router's matches, and neither side ever believes a hit there. Once the
// first blocks of the requests it served are almost never in its event index, it is
// `degraded` (reason hash_mismatch) and scored approximately; once they are again, exact.
#[test]
fn an_engine_whose_events_never_hold_the_routers_blocks_is_degraded_until_they_do() {
    let mut r = Router::new(RouterConfig::default(), 1);
    r.upsert_endpoint("a:1").unwrap();
    r.set_event_stream("a:1", true);
    let wait = r.config().self_check.confirm_after_ms;
    let samples = r.config().self_check.min_samples as u32;
    let state = super::tests::first_state;
    // Serves request `n` on a:1 at `now`; the engine publishes its prompt's blocks, as the
    // router tokenises them or (`agrees` false) as other tokens.
    let serve = |r: &mut Router, n: u32, now: u64, agrees: bool| {
        let tokens: Vec<u32> = (n * 1_000..n * 1_000 + 321).collect();
        let d = r.route(&request(&tokens), now, u64::from(n));
        assert_eq!(d.response.endpoints[0], "a:1");
        let published: Vec<u32> = if agrees {
            tokens[..320].to_vec()
        } else {
            tokens[..320].iter().map(|t| t + 500_000).collect()
        };
        let event = stored_from(u64::from(n) * 1_000, &published, Medium::Gpu);
        r.apply_kv_event("a:1", "m", &event, now).unwrap();
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: "a:1".into(),
                status: 200,
                cached_tokens: Some(0),
                ..Outcome::default()
            },
            now + 1,
        );
        d.candidates[0].precise
    };
    assert!(serve(&mut r, 1, 10, false), "scored precisely");
    for n in 2..samples {
        serve(&mut r, n, 10, false);
    }
    r.expire(wait + 10);
    assert_eq!(
        state(&r),
        (RoutingState::Exact, None),
        "awaited, not looked up"
    );
    r.expire(wait + 11);
    assert_eq!(state(&r), (RoutingState::Exact, None), "too few verdicts");
    serve(&mut r, 100, 20, false);
    r.expire(wait + 21);
    assert_eq!(
        state(&r),
        (RoutingState::Degraded, Some(StateReason::HashMismatch))
    );
    assert!(
        !serve(&mut r, 101, 30, false),
        "scored from the approximate index"
    );

    // The engine hashes as the router does again: its served requests' blocks are held.
    for n in 200..200 + samples {
        serve(&mut r, n, 40, true);
    }
    r.expire(wait + 41);
    assert_eq!(state(&r), (RoutingState::Exact, None));
    assert!(serve(&mut r, 300, 50, true));
    let changes: Vec<_> = r
        .take_state_changes()
        .into_iter()
        .map(|(e, c)| (e, c.to, c.reason, c.delivered_share))
        .collect();
    assert_eq!(
        changes,
        [
            (
                "a:1".to_string(),
                RoutingState::Degraded,
                StateReason::HashMismatch,
                0.0
            ),
            (
                "a:1".to_string(),
                RoutingState::Exact,
                StateReason::HashMismatch,
                // Decided at the eighth lookup: request 101's block and seven held ones.
                7.0 / 8.0
            ),
        ]
    );
    // A stream that is not whole says nothing: what was awaited is dropped unread.
    serve(&mut r, 400, 60, false);
    r.note_event_gap("a:1");
    r.expire(wait + 61);
    assert_eq!(
        r.endpoints(0)[0].state_reason,
        Some(StateReason::KvEventGap)
    );
}

// The speculative index credits a routed precise request's blocks until the engine's events
// confirm them; a request the engine refused unprefilled never will, so its credit goes.
#[test]
fn a_refused_precise_request_takes_back_its_speculative_blocks() {
    let tokens: Vec<u32> = (0..321).collect();
    for (status, kept) in [(400, false), (0, true)] {
        let mut r = router();
        let d = r.route(&request(&tokens), 10, 3);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: d.response.endpoints[0].clone(),
                status,
                ..Outcome::default()
            },
            20,
        );
        let again = r.route(&request(&tokens), 30, 4);
        assert_eq!(
            again.candidates[0].cached_blocks > 0,
            kept,
            "status {status}"
        );
    }
}

// Precise requests are checked in the router's own token count, not in bytes: the endpoint
// the Cyrillic documents stick to (more bytes a token than the prose elsewhere) counts as
// many tokens as the router's tokeniser did and stays exact, where its bytes alone would have
// read as another tokeniser; one whose engine counts other tokens is still degraded.
#[test]
fn a_precise_endpoint_serving_other_text_than_its_pool_is_judged_by_its_token_count() {
    let endpoints = ["a:1", "b:1", "c:1", "d:1"];
    let (cyrillic, odd) = (endpoints[3], endpoints[2]);
    let mut r = Router::new(RouterConfig::default(), 1);
    for a in endpoints {
        r.upsert_endpoint(a).unwrap();
        r.set_event_stream(a, true);
    }
    let mut now = 0;
    // Serves `n` precise prompts of 1,008 tokens, half of them in Cyrillic (5.6 bytes a
    // token, else 4): the engine stores what it computed, and usage is reported where a
    // prompt's language matches its endpoint's (so the Cyrillic endpoint's bytes read 5.6 a
    // token and the others' 4), counting `tokens(endpoint)` tokens there.
    let mut serve = |r: &mut Router, n: u32, tokens: &dyn Fn(&str) -> u32| {
        for i in 0..n {
            now += 1_000;
            // Half the prompts, in no pattern the endpoints' turns could follow.
            let in_cyrillic = u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 63 == 1;
            let first = (now as u32) << 4;
            let prompt: Vec<u32> = (first..first + 1_008).collect();
            let bytes: u64 = if in_cyrillic { 5_645 } else { 4_032 };
            let text_blocks = bytes / 256;
            let request = RouteRequest {
                block_hashes: (0..text_blocks)
                    .map(|b| u64::from(first) << 8 | b)
                    .collect(),
                prompt_bytes: bytes,
                ..request(&prompt)
            };
            let d = r.route(
                &request,
                now,
                u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            let chosen = d.response.endpoints[0].clone();
            r.apply_kv_event(
                &chosen,
                "m",
                &stored_from(u64::from(first), &prompt, Medium::Gpu),
                now,
            )
            .unwrap();
            let matches = (chosen == cyrillic) == in_cyrillic;
            r.feedback(
                &Outcome {
                    decision_id: d.response.decision_id,
                    prompt_tokens: matches.then(|| tokens(&chosen)),
                    cached_tokens: Some(0),
                    endpoint: chosen,
                    status: 200,
                    ..Default::default()
                },
                now + 10,
            );
        }
        now
    };
    serve(&mut r, 800, &|_| 1_008);
    let changes = r.take_state_changes();
    assert!(
        changes.is_empty(),
        "another language is no other tokeniser: {changes:?}"
    );
    serve(&mut r, 800, &|e| if e == odd { 1_613 } else { 1_008 });
    let state = |r: &Router, a: &str| {
        let v = r.endpoints(0);
        let v = v.iter().find(|v| v.address == a).expect("known");
        (v.routing_state, v.state_reason)
    };
    assert_eq!(
        state(&r, odd),
        (RoutingState::Degraded, Some(StateReason::BytesPerToken))
    );
    assert_eq!(state(&r, cyrillic), (RoutingState::Exact, None));
}
