//! KV offload tiers end to end: `vllm-sim` replicas with a small GPU cache and a CPU offload
//! tier publish their CPU blocks as KV events with medium `CPU`; the control plane (precise
//! mode) indexes them apart from GPU blocks, and a prompt whose prefix left the GPU but is
//! still in a replica's CPU tier goes to that replica: partial credit, below GPU and above
//! recompute. The engine then loads those blocks instead of recomputing them.

use std::time::Duration;

use kvroute_harness::{Fleet, HttpClient, HttpResponse, REPLICA_HEADER, Tools, prometheus_sample};
use serde_json::{Value, json};

use crate::common::{self, tools};

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(240);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const WAIT_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-offload-model";
/// GPU KV capacity of each replica, tokens (128 blocks of 16).
const GPU_TOKENS: u32 = 2048;
/// Words of each long prompt (the simulator's word tokenizer: about a token a word).
const PROMPT_WORDS: usize = 700;

async fn start(tools: &Tools) -> Fleet {
    let mut cfg = common::fleet_config("e2e-offload", 2, MODEL);
    cfg.sim_args = [
        "--speed",
        "5",
        "--kv-capacity-tokens",
        &GPU_TOKENS.to_string(),
        "--kv-offload-blocks",
        "4096",
    ]
    .map(String::from)
    .to_vec();
    cfg.kv_events = true;
    cfg.control_plane_extra = common::remote_tokenizer();
    // Short speculative entries, so that only events decide the second visit; the replicas
    // run at 5x speed, 50 prefill tokens a millisecond. Offloaded blocks earn half credit.
    cfg.control_plane_router = common::precise_router(300);
    cfg.control_plane_router["precise"]["offload_weight"] = json!(0.5);
    cfg.plugin_config = json!({
        "route_timeout_ms": 3000,
        "allow_explain": true,
        "routes": [{"path": "/v1/chat/completions", "api": "chat", "mode": "precise"}]
    });
    common::start_fleet(cfg, tools).await
}

/// Polls the control plane's metrics until `ok` holds.
async fn wait_metrics(fleet: &Fleet, what: &str, ok: impl Fn(&str) -> bool) {
    common::wait_cp_metrics(fleet, what, WAIT_TIMEOUT, ok).await;
}

fn prompt(seed: u64) -> Value {
    common::user_chat(MODEL, &common::words(seed, PROMPT_WORDS), 2)
}

/// A chat to `base` (Envoy, or a replica directly) that must be served.
async fn post(
    fleet: &Fleet,
    client: &HttpClient,
    base: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> HttpResponse {
    let resp = common::post_chat(client, base, body, headers, REQUEST_TIMEOUT, fleet).await;
    assert_eq!(resp.status, 200, "{}", resp.body);
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_a_cpu_tier_draws_its_request_to_that_replica() {
    let tools = tools();
    let body = async {
        let fleet = start(&tools).await;
        let client = HttpClient::new();
        let addresses = fleet.replica_addresses();
        common::wait_events_live(&fleet, WAIT_TIMEOUT).await;

        // 1. The prompt lands somewhere and is cached there, on the GPU and in the CPU tier.
        let first = post(&fleet, &client, &fleet.url(), &prompt(1), &[]).await;
        let home = first.header(REPLICA_HEADER).unwrap().to_string();
        let other = addresses.iter().find(|a| **a != home).unwrap().clone();
        wait_metrics(&fleet, "offloaded blocks indexed", |m| {
            prometheus_sample(
                m,
                &format!("kvroute_endpoint_offload_blocks{{endpoint=\"{home}\"}}"),
            )
            .is_some_and(|n| n >= 40.0)
        })
        .await;

        // 2. Other long prompts sent to that replica directly push it out of the GPU only.
        for seed in 10..14 {
            post(
                &fleet,
                &client,
                &format!("http://{home}"),
                &prompt(seed),
                &[],
            )
            .await;
        }
        wait_metrics(&fleet, "the GPU tier turned over", |m| {
            let offload = prometheus_sample(
                m,
                &format!("kvroute_endpoint_offload_blocks{{endpoint=\"{home}\"}}"),
            );
            let gpu = prometheus_sample(
                m,
                &format!("kvroute_endpoint_precise_blocks{{endpoint=\"{home}\"}}"),
            );
            offload.is_some_and(|n| n >= 150.0)
                && gpu.is_some_and(|n| n <= f64::from(GPU_TOKENS / 16))
        })
        .await;
        let text = common::cp_metrics(&fleet).await;
        assert!(
            prometheus_sample(&text, "kvroute_indexed_blocks{tier=\"offload\"}").unwrap_or(0.0)
                >= 150.0,
            "{text}"
        );
        assert!(
            prometheus_sample(&text, "kvroute_indexed_blocks{tier=\"gpu\"}").unwrap_or(0.0) > 0.0,
            "{text}"
        );
        // Speculative entries of step 1 are gone by now (300 ms).
        tokio::time::sleep(Duration::from_millis(400)).await;

        // 3. The same prompt again: only the CPU tier holds it, and that draws it home.
        let again = post(
            &fleet,
            &client,
            &fleet.url(),
            &prompt(1),
            &[("x-kvroute-explain", "1")],
        )
        .await;
        let d = common::explained_decision(&fleet, &again).await;
        let candidate = |address: &str| -> Value {
            d["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["endpoint"] == address)
                .cloned()
                .unwrap_or_else(|| panic!("no candidate {address} in {d:#}"))
        };
        let (h, o) = (candidate(&home), candidate(&other));
        assert_eq!(h["precise"], true, "{d:#}");
        assert_eq!(h["cached_blocks"], 0, "no GPU blocks left there: {d:#}");
        let credit = h["cached_tokens"].as_u64().unwrap();
        assert!(
            (200..=500).contains(&credit),
            "about half the ~700-token prefix as offload credit: {d:#}"
        );
        assert_eq!(o["cached_tokens"], 0, "{d:#}");
        assert_eq!(again.header(REPLICA_HEADER), Some(home.as_str()), "{d:#}");
        // The engine loaded the prefix from its CPU tier rather than recomputing it.
        let usage: Value = serde_json::from_str(&again.body).unwrap();
        let cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached > credit,
            "the engine loads every offloaded block: {usage:#}"
        );
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
