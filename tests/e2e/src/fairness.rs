//! Priorities and fairness at the gateway, end to end through a real Envoy: the control plane's
//! admission gate refuses requests and the filter answers them locally with an OpenAI-style
//! error. On a simulated fleet whose KV use is driven up by long-running requests sent to the
//! replicas directly (so the saturation level is known), the test checks that
//! - a tenant's `max_prompt_bytes` answers 413 `request_too_large` whatever the load;
//! - at saturation ≥ `sheddable_at` sheddable requests get 429 with `Retry-After` while standard
//!   and critical ones are served, except a standard request from a tenant far over its fair
//!   share (VTC) which is shed too;
//! - at saturation ≥ `standard_at` standard requests are shed and critical ones still served;
//! - llm-d's `x-llm-d-inference-fairness-id` / `x-llm-d-inference-objective` headers work;
//! - the control plane counts it in `kvroute_requests_shed_total{criticality,tenant}` and the
//!   filter in Envoy's `kvroute_requests_rejected`.

use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, HttpClient, HttpResponse, Tools};
use serde_json::{Value, json};

use crate::common::{self, tools};

const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-fairness-model";
/// KV capacity of each replica, tokens.
const KV_TOKENS: u64 = 8192;
/// Admission's `kv_limit`: saturation = kv_usage / KV_LIMIT (queues stay empty here).
const KV_LIMIT: f64 = 0.15;
/// Admission's `standard_at`.
const STANDARD_AT: f64 = 3.0;

async fn start(tools: &Tools) -> Fleet {
    let mut cfg = common::fleet_config("e2e-fairness", 2, MODEL);
    // Slow simulated time so the background requests hold their KV for the whole test.
    cfg.sim_args = vec![
        "--speed".into(),
        "0.1".into(),
        "--kv-capacity-tokens".into(),
        KV_TOKENS.to_string(),
    ];
    // A loaded CI machine must not turn a route call into a fail-open (which admits).
    // The tenant and criticality headers are the test's own: believed, as behind an authority.
    cfg.plugin_config = json!({"route_timeout_ms": 5000, "identity_headers": "trusted"});
    cfg.control_plane_extra = json!({
        "admission": {
            "queue_limit": 100,
            "kv_limit": KV_LIMIT,
            "sheddable_at": 1.0,
            "standard_at": STANDARD_AT,
            "retry_after_s": 2,
            "usage_half_life_ms": 600_000,
            "tenants": {
                "small": {"max_prompt_bytes": 2000},
                "batch": {"weight": 1.0},
                "chat": {"weight": 1.0},
            },
        }
    });
    common::start_fleet(cfg, tools).await
}

fn body(words_n: usize, seed: u64, max_tokens: u32) -> Value {
    common::user_chat(MODEL, &common::words(seed, words_n), max_tokens)
}

async fn chat(fleet: &Fleet, body: &Value, headers: &[(&str, &str)]) -> HttpResponse {
    common::post_chat(
        fleet.client(),
        &fleet.url(),
        body,
        headers,
        REQUEST_TIMEOUT,
        fleet,
    )
    .await
}

/// A request that must be served.
async fn served(fleet: &Fleet, what: &str, body: &Value, headers: &[(&str, &str)]) {
    let r = chat(fleet, body, headers).await;
    assert_eq!(r.status, 200, "{what}: {} ({})", r.body, fleet.describe());
}

/// `n` prompts of `words_n` words (seeded from `first_seed`) from the flooding tenant `batch`,
/// each of which must be served: its traffic while admission still has room for it.
async fn batch_served(fleet: &Fleet, what: &str, n: u64, words_n: usize, first_seed: u64) {
    for seed in first_seed..first_seed + n {
        served(
            fleet,
            &format!("{what} (prompt {seed})"),
            &body(words_n, seed, 2),
            &[("x-kvroute-tenant", "batch")],
        )
        .await;
    }
}

/// A request that must be refused with `status`; returns the OpenAI error object.
async fn refused(
    fleet: &Fleet,
    what: &str,
    status: u16,
    body: &Value,
    headers: &[(&str, &str)],
) -> (HttpResponse, Value) {
    let r = chat(fleet, body, headers).await;
    assert_eq!(
        r.status,
        status,
        "{what}: {} ({})",
        r.body,
        fleet.describe()
    );
    assert_eq!(r.header("content-type"), Some("application/json"), "{what}");
    let v: Value = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(v["error"]["code"], status, "{what}: {v}");
    let error = v["error"].clone();
    (r, error)
}

/// Every replica's `vllm:kv_cache_usage_perc`.
async fn kv_usage(fleet: &Fleet) -> Vec<f64> {
    let mut out = Vec::new();
    for r in &fleet.replicas {
        let text = fleet.replica_metrics(r).await.unwrap();
        out.push(kvroute_harness::prometheus_sum(
            &text,
            "vllm:kv_cache_usage_perc",
        ));
    }
    out
}

/// Waits until every replica's KV use is at least `min` (the background requests prefilled).
async fn wait_kv_at_least(fleet: &Fleet, min: f64) -> Vec<f64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let kv = kv_usage(fleet).await;
        if kv.iter().all(|k| *k >= min) {
            // Let the control plane scrape it (100 ms interval).
            tokio::time::sleep(Duration::from_millis(500)).await;
            return kv;
        }
        assert!(
            Instant::now() < deadline,
            "KV use stayed below {min}: {kv:?} ({})",
            fleet.describe()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends a long-running request straight to every replica (bypassing Envoy and admission),
/// holding about `words_n` prompt tokens of KV for minutes of wall time (prompt + max_tokens
/// stays under the replica's KV capacity, or the engine refuses the request).
fn hold_kv(fleet: &Fleet, words_n: usize, seed: u64) -> Vec<tokio::task::JoinHandle<()>> {
    fleet
        .replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let url = format!("{}/v1/chat/completions", r.url());
            let b = body(words_n, seed * 100 + i as u64, 4_000).to_string();
            tokio::spawn(async move {
                let client = HttpClient::new();
                let _ = client
                    .request("POST", &url, &[], Some(b), Duration::from_secs(600))
                    .await;
            })
        })
        .collect()
}

fn sample(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheds_by_criticality_and_fair_share_and_limits_prompts_per_tenant() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start(&tools).await;
        let tenant = |t| ("x-kvroute-tenant", t);
        let crit = |c| ("x-kvroute-criticality", c);
        let small_q = body(8, 1, 2);

        // Idle fleet: everything is served (retry while the first scrapes arrive: metrics not
        // yet scraped count as saturated).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = chat(&fleet, &small_q, &[tenant("chat"), crit("sheddable")]).await;
            if r.status == 200 {
                break;
            }
            assert_eq!(r.status, 429, "{}", r.body);
            assert!(Instant::now() < deadline, "an idle fleet kept shedding");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        served(&fleet, "idle standard", &small_q, &[tenant("chat")]).await;
        served(&fleet, "idle, no headers", &small_q, &[]).await;

        // Per-tenant prompt limit: 413 whatever the load; other tenants are not limited.
        let big = body(600, 2, 2);
        let (r, error) = refused(
            &fleet,
            "over max_prompt_bytes",
            413,
            &big,
            &[tenant("small")],
        )
        .await;
        assert_eq!(
            error["type"], "request_too_large",
            "{} / {:?}",
            r.body, r.headers
        );
        assert!(
            error["message"].as_str().unwrap().contains("\"small\""),
            "{error}"
        );
        assert_eq!(r.header("retry-after"), None);
        refused(
            &fleet,
            "llm-d fairness id",
            413,
            &big,
            &[("x-llm-d-inference-fairness-id", "small")],
        )
        .await;
        served(
            &fleet,
            "small prompt of a limited tenant",
            &small_q,
            &[tenant("small")],
        )
        .await;

        // Tenant `batch` floods (standard, long prompts) while the fleet has room: admitted,
        // and its token counter runs far ahead of `chat`'s.
        batch_served(&fleet, "batch while idle", 8, 800, 10).await;

        // Saturation between sheddable_at (1) and standard_at (3): KV ≈ 0.2 of each replica.
        let mut background = hold_kv(&fleet, 1_500, 1);
        let kv = wait_kv_at_least(&fleet, KV_LIMIT * 1.1).await;
        eprintln!("moderate saturation: KV use {kv:?}");
        assert!(
            kv.iter().all(|k| *k < KV_LIMIT * STANDARD_AT * 0.9),
            "background too large for the moderate phase: {kv:?}"
        );
        let (r, error) = refused(
            &fleet,
            "sheddable when saturated",
            429,
            &small_q,
            &[tenant("chat"), crit("sheddable")],
        )
        .await;
        assert_eq!(error["type"], "rate_limit_exceeded");
        assert_eq!(r.header("retry-after"), Some("2"));
        refused(
            &fleet,
            "llm-d negative priority",
            429,
            &small_q,
            &[("x-llm-d-inference-objective", "-1")],
        )
        .await;
        served(
            &fleet,
            "standard chat, moderate",
            &small_q,
            &[tenant("chat")],
        )
        .await;
        let (_, error) = refused(
            &fleet,
            "standard batch over its fair share",
            429,
            &small_q,
            &[tenant("batch")],
        )
        .await;
        assert!(
            error["message"].as_str().unwrap().contains("fair share"),
            "{error}"
        );
        served(
            &fleet,
            "critical batch, moderate",
            &small_q,
            &[tenant("batch"), crit("critical")],
        )
        .await;

        // Saturation past standard_at: KV ≈ 0.6 of each replica.
        background.extend(hold_kv(&fleet, 1_500, 2));
        background.extend(hold_kv(&fleet, 1_500, 3));
        let kv = wait_kv_at_least(&fleet, KV_LIMIT * STANDARD_AT * 1.05).await;
        eprintln!("heavy saturation: KV use {kv:?}");
        refused(&fleet, "standard, heavy", 429, &small_q, &[tenant("chat")]).await;
        refused(&fleet, "no headers, heavy", 429, &small_q, &[]).await;
        served(
            &fleet,
            "critical, heavy",
            &small_q,
            &[tenant("chat"), crit("critical")],
        )
        .await;
        served(
            &fleet,
            "llm-d positive priority, heavy",
            &small_q,
            &[("x-llm-d-inference-objective", "5")],
        )
        .await;

        // Metrics on both sides.
        let cp = common::cp_metrics(&fleet).await;
        let shed = |labels: &str| sample(&cp, &format!("kvroute_requests_shed_total{{{labels}}}"));
        assert!(
            shed("criticality=\"sheddable\",tenant=\"chat\"") >= 1.0,
            "{cp}"
        );
        assert!(
            shed("criticality=\"standard\",tenant=\"batch\"") >= 1.0,
            "{cp}"
        );
        assert!(
            shed("criticality=\"standard\",tenant=\"default\"") >= 1.0,
            "{cp}"
        );
        assert_eq!(
            sample(&cp, "kvroute_requests_shed_total{criticality=\"critical\""),
            0.0,
            "{cp}"
        );
        assert!(sample(&cp, "kvroute_requests_shed_over_fair_share_total") >= 1.0);
        assert!(sample(&cp, "kvroute_requests_too_large_total{tenant=\"small\"}") >= 2.0);
        assert!(
            sample(&cp, "kvroute_fleet_saturation") >= STANDARD_AT,
            "{cp}"
        );
        let rejected = fleet.envoy_counter("kvroute_requests_rejected").await;
        assert!(
            rejected >= 7.0,
            "{rejected} local answers counted by the filter"
        );

        for task in background {
            task.abort();
        }
    })
    .await;
}

/// `admission.max_ttft_inflation` end to end: a tenant over its fair share is refused with 429,
/// `Retry-After` and a message naming the bound while admitting it would leave no replica within
/// the factor for the others; other tenants and critical requests are still served, and both
/// sides count the refusal. The router is configured with a very slow assumed prefill rate, so
/// the prompts it routed stay queued in its estimate for the whole test (no timing involved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_an_over_share_tenant_to_keep_the_ttft_bound() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-fairness-ttft", 2, MODEL, |cfg| {
            // The tenant and criticality headers are the test's own: believed, as behind an authority.
            cfg.plugin_config = json!({"route_timeout_ms": 5000, "identity_headers": "trusted"});
            // 2 tokens a second: a routed prompt stays in the router's queue estimate for minutes.
            cfg.control_plane_router = json!({"scoring": {"prefill_tokens_per_ms": 0.002}});
            cfg.control_plane_extra = json!({
                "admission": {
                    "max_ttft_inflation": 2.0,
                    "retry_after_s": 3,
                    "usage_half_life_ms": 600_000,
                    "tenants": {"batch": {"weight": 1.0}, "chat": {"weight": 1.0}},
                }
            });
        })
        .await;
        let tenant = |t| ("x-kvroute-tenant", t);
        let crit = |c| ("x-kvroute-criticality", c);
        let small_q = body(8, 1, 2);

        // Alone, the flooding tenant is never over its share: every prompt is admitted
        // (work-conserving), and they queue on both replicas in the router's estimate.
        batch_served(&fleet, "batch while alone", 4, 300, 20).await;
        // Another tenant shows up: far under its share, it is served.
        served(&fleet, "chat", &small_q, &[tenant("chat")]).await;
        // Now `batch` is over its share and no replica is within 2x: refused for the bound.
        let (r, error) = refused(
            &fleet,
            "batch over its share, bound reached",
            429,
            &body(300, 30, 2),
            &[tenant("batch")],
        )
        .await;
        assert_eq!(error["type"], "rate_limit_exceeded", "{error}");
        assert_eq!(r.header("retry-after"), Some("3"));
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("\"batch\"") && message.contains("max_ttft_inflation"),
            "{message}"
        );
        // Critical requests are exempt, and the protected tenant is still served.
        served(
            &fleet,
            "critical batch",
            &small_q,
            &[tenant("batch"), crit("critical")],
        )
        .await;
        served(&fleet, "chat again", &small_q, &[tenant("chat")]).await;

        let cp = common::cp_metrics(&fleet).await;
        assert_eq!(
            sample(
                &cp,
                "kvroute_requests_shed_ttft_bound_total{criticality=\"standard\",tenant=\"batch\"}"
            ),
            1.0,
            "{cp}"
        );
        assert_eq!(
            sample(&cp, "kvroute_requests_shed_over_fair_share_total"),
            0.0,
            "{cp}"
        );
        assert_eq!(
            sample(&cp, "kvroute_admission_max_ttft_inflation"),
            2.0,
            "{cp}"
        );
        assert!(
            sample(&cp, "kvroute_admission_ttft_inflation") > 2.0,
            "{cp}"
        );
        assert!(
            sample(
                &cp,
                "kvroute_requests_admitted_total{criticality=\"standard\",tenant=\"chat\"}"
            ) >= 2.0,
            "{cp}"
        );
        let rejected = fleet.envoy_counter("kvroute_requests_rejected").await;
        assert!(
            rejected >= 1.0,
            "{rejected} local answers counted by the filter"
        );
    })
    .await;
}
