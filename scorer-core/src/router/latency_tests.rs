use super::*;
use crate::hash::{block_hashes, model_seed};

fn request(i: u64, bytes: usize) -> RouteRequest {
    let text = format!("{i} distinct prompt ").repeat(bytes / 20);
    RouteRequest {
        model: "m".into(),
        block_hashes: block_hashes(model_seed("m"), text.as_bytes(), 256),
        prompt_bytes: text.len() as u64,
        prompt_tokens: (text.len() / 4) as u32,
        max_output_tokens: Some(1),
        ..Default::default()
    }
}

/// `slow:1` prefills three times slower than the prior assumes, `fast:1` as assumed.
fn observed_ttft(endpoint: &str, uncached: u32) -> u64 {
    let per_token = if endpoint == "slow:1" { 0.3 } else { 0.1 };
    (10.0 + f64::from(uncached) * per_token) as u64
}

/// Routes request `i` (2,000 to 8,000 bytes) at `now` with a seed that varies in every bit
/// (so ties split evenly) and reports it served in `ttft(endpoint, uncached tokens)` ms;
/// returns the chosen candidate.
fn serve(r: &mut Router, i: u64, now: u64, ttft: impl Fn(&str, u32) -> u64) -> CandidateScore {
    let seed = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let d = r.route(&request(i, 2_000 + (i as usize % 7) * 1_000), now, seed);
    let chosen = d.candidates[0].clone();
    let ttft = ttft(&chosen.endpoint, chosen.uncached_tokens);
    r.feedback(
        &Outcome {
            decision_id: d.response.decision_id,
            endpoint: chosen.endpoint.to_string(),
            status: 200,
            ttfb_ms: Some(ttft),
            total_ms: ttft,
            completion_tokens: Some(1),
            ..Default::default()
        },
        now + ttft,
    );
    chosen
}

#[test]
fn outcomes_teach_each_endpoint_its_own_latency() {
    let mut config = RouterConfig::default();
    config.scoring.prefill_tokens_per_ms = 10.0;
    let mut r = Router::new(config, 1);
    for a in ["slow:1", "fast:1"] {
        r.upsert_endpoint(a).unwrap();
    }
    let mut now = 0;
    for i in 0..200u64 {
        now += 60_000;
        let chosen = serve(&mut r, i, now, observed_ttft);
        assert!(chosen.predicted_ttft_ms > 0.0 && chosen.predicted_tpot_ms > 0.0);
    }
    let views = r.endpoints(now);
    let slow = views.iter().find(|e| e.address == "slow:1").unwrap();
    assert!(slow.latency_samples >= 32, "{views:?}");
    assert!(slow.latency_errors.ttft_error_ratio < 0.2, "{views:?}");
    // Once warm, the slow endpoint's learned TTFT is higher and it stops winning.
    let d = r.route(&request(999, 4_000), now + 60_000, 1);
    let by = |a: &str| d.candidates.iter().find(|c| c.endpoint == a).unwrap();
    let (slow, fast) = (by("slow:1"), by("fast:1"));
    let expected = observed_ttft("slow:1", slow.uncached_tokens) as f64;
    assert!(
        (slow.predicted_ttft_ms - expected).abs() / expected < 0.15,
        "{slow:?}"
    );
    assert!(
        slow.predicted_ttft_ms > 2.0 * fast.predicted_ttft_ms,
        "{d:?}"
    );
    assert!(slow.latency_ms > fast.latency_ms, "{d:?}");
    assert_eq!(d.response.endpoints[0], "fast:1");
}

// Two replicas warm up on an idle pool, each learning that it prefills twice as fast as
// the prior assumes; then a third joins. Scored against a warm model's negative
// correction with none of its own, it would never be chosen and never warm up; with the
// warm replicas' median correction it takes its share at once.
#[test]
fn a_replica_that_joins_a_warm_idle_pool_gets_its_share() {
    let mut config = RouterConfig::default();
    config.scoring.prefill_tokens_per_ms = 10.0;
    let mut r = Router::new(config, 1);
    let mut now = 0;
    // Twice as fast as the prior's 0.1 ms a token.
    let fast = |_: &str, uncached: u32| (10.0 + f64::from(uncached) * 0.05) as u64;
    let mut serve_next = |r: &mut Router, i: u64| {
        now += 60_000;
        serve(r, i, now, fast).endpoint.to_string()
    };
    for a in ["a:1", "b:1"] {
        r.upsert_endpoint(a).unwrap();
    }
    for i in 0..120 {
        serve_next(&mut r, i);
    }
    r.upsert_endpoint("new:1").unwrap();
    let joined = (120..180)
        .filter(|&i| serve_next(&mut r, i) == "new:1")
        .count();
    assert!(
        (12..=30).contains(&joined),
        "the new replica got {joined} of 60 requests"
    );
    let views = r.endpoints(now);
    let new = views.iter().find(|e| e.address == "new:1").unwrap();
    assert!(new.latency_samples > 0, "{new:?}");
}

#[test]
fn disabled_model_predicts_but_does_not_steer() {
    let config = RouterConfig {
        latency: LatencyConfig {
            enabled: false,
            ..LatencyConfig::default()
        },
        ..RouterConfig::default()
    };
    let mut r = Router::new(config, 1);
    r.upsert_endpoint("a:1").unwrap();
    for i in 0..50 {
        let d = r.route(&request(i, 1_000), i * 60_000, i);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: "a:1".into(),
                status: 200,
                ttfb_ms: Some(500),
                total_ms: 500,
                completion_tokens: Some(1),
                ..Default::default()
            },
            i * 60_000 + 500,
        );
    }
    let d = r.route(&request(77, 1_000), 10_000_000, 1);
    assert_eq!(d.candidates[0].latency_ms, 0.0);
    assert!(d.candidates[0].predicted_ttft_ms > 300.0, "{d:?}");
}
