use super::*;
use crate::hash::{block_hashes, model_seed};

fn request(i: u64, tokens: usize) -> RouteRequest {
    let text = format!("{i} prompt ").repeat(tokens * 4 / 9 + 1);
    RouteRequest {
        model: "m".into(),
        block_hashes: block_hashes(model_seed("m"), text.as_bytes(), 256),
        prompt_bytes: text.len() as u64,
        prompt_tokens: tokens as u32,
        ..Default::default()
    }
}

fn fleet() -> Router {
    let mut r = Router::new(RouterConfig::default(), 1);
    for (a, role) in [
        ("p:1", EndpointRole::Prefill),
        ("d:1", EndpointRole::Decode),
        ("d:2", EndpointRole::Decode),
    ] {
        r.upsert_endpoint(a).unwrap();
        r.set_role(a, role);
    }
    r
}

#[test]
fn long_uncached_prompts_get_a_prefill_endpoint_short_ones_do_not() {
    let mut r = fleet();
    let long = r.route(&request(1, 4_000), 0, 1);
    assert!(long.response.endpoints[0].starts_with("d:"), "{long:?}");
    assert!(!long.response.endpoints.contains(&"p:1".to_string()));
    assert_eq!(long.response.prefiller.as_deref(), Some("p:1"));
    let last = long.candidates.last().unwrap();
    assert_eq!(
        (last.endpoint.as_str(), last.role),
        ("p:1", EndpointRole::Prefill)
    );
    let short = r.route(&request(2, 200), 60_000, 2);
    assert_eq!(short.response.prefiller, None);
    assert_eq!(r.stats().disaggregated, 1);
    let views = r.endpoints(60_000);
    let p = views.iter().find(|e| e.address == "p:1").unwrap();
    assert_eq!((p.role, p.prefill_picks), (EndpointRole::Prefill, 1));
    // The prefill work is queued on the prefill endpoint, not on the decode endpoint.
    let d = views
        .iter()
        .find(|e| e.address == long.response.endpoints[0])
        .unwrap();
    assert!(
        p.backlog_tokens > 0.0 || d.backlog_tokens == 0.0,
        "{views:?}"
    );
}

#[test]
fn a_prompt_cached_on_the_decode_endpoint_stays_there_whole() {
    let mut r = fleet();
    let first = r.route(&request(3, 4_000), 0, 1);
    let again = r.route(&request(3, 4_000), 60_000, 2);
    assert_eq!(again.response.endpoints[0], first.response.endpoints[0]);
    assert_eq!(again.response.prefiller, None, "{again:?}");
}

#[test]
fn without_decode_endpoints_routing_fails_open_and_threshold_zero_disables() {
    let mut r = Router::new(RouterConfig::default(), 1);
    r.upsert_endpoint("p:1").unwrap();
    r.set_role("p:1", EndpointRole::Prefill);
    assert!(
        r.route(&request(1, 4_000), 0, 1)
            .response
            .endpoints
            .is_empty()
    );

    let mut r = fleet();
    r.config.pd.threshold_tokens = 0;
    assert_eq!(r.route(&request(1, 4_000), 0, 1).response.prefiller, None);
}
