//! Model pools, session affinity and LoRA awareness end to end, through a real Envoy, the wasm
//! filter, the control plane and `vllm-sim` replicas serving different models.
//!
//! Fleet: replicas 0 and 1 serve `pool-a`; replicas 2 and 3 serve `pool-b` plus the LoRA
//! adapters `pool-b-sql` and `pool-b-chat`. The control plane learns this from each replica's
//! `/v1/models` (no model names in its YAML), rejects unknown models with a 404 and keeps
//! sessions on their replica.

use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, HttpClient, HttpResponse, REPLICA_HEADER, Tools, prometheus_sample};
use serde_json::{Value, json};

use crate::common::{self, tools};

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(240);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the control plane may take to learn every replica's models.
const CATALOGUE_TIMEOUT: Duration = Duration::from_secs(30);

/// Two pools of two replicas; pool B also serves two adapters.
async fn start(tools: &Tools, name: &str) -> Fleet {
    let mut cfg = common::fleet_config(name, 4, "pool-a");
    let pool_b: Vec<String> = [
        "--model",
        "pool-b",
        "--lora-modules",
        "pool-b-sql=/adapters/sql",
        "pool-b-chat=/adapters/chat",
    ]
    .map(String::from)
    .to_vec();
    cfg.per_replica_args = vec![Vec::new(), Vec::new(), pool_b.clone(), pool_b];
    cfg.plugin_config = json!({"allow_explain": true});
    cfg.control_plane_router = json!({
        "models": {"unknown_model": "reject"},
        "sessions": {"bonus_ms": 5000.0, "ttl_ms": 60000},
    });
    cfg.control_plane_extra = json!({"models_interval_ms": 200});
    common::start_fleet(cfg, tools).await
}

/// Waits until the control plane knows every replica's models (pool B lists 3).
async fn wait_for_catalogues(fleet: &Fleet) {
    let addresses: Vec<String> = fleet.replicas.iter().map(|r| r.address.clone()).collect();
    wait_for(fleet, "both catalogues learned", |text| {
        let counts: Vec<Option<f64>> = addresses
            .iter()
            .map(|a| {
                prometheus_sample(
                    text,
                    &format!("kvroute_endpoint_models{{endpoint=\"{a}\"}}"),
                )
            })
            .collect();
        counts == [Some(1.0), Some(1.0), Some(3.0), Some(3.0)]
    })
    .await;
}

/// A short chat whose prompt shares nothing with other calls (seeded words).
fn chat_body(model: &str, seed: u64, user: Option<&str>) -> Value {
    let mut body = common::user_chat(model, &common::words(seed, 60), 4);
    if let Some(u) = user {
        body["user"] = json!(u);
    }
    body
}

async fn chat(
    client: &HttpClient,
    fleet: &Fleet,
    body: &Value,
    headers: &[(&str, &str)],
) -> HttpResponse {
    common::post_chat(client, &fleet.url(), body, headers, REQUEST_TIMEOUT, fleet).await
}

fn served_by(resp: &HttpResponse, fleet: &Fleet) -> usize {
    assert_eq!(resp.status, 200, "{} ({})", resp.body, fleet.describe());
    let replica = common::replica_header(resp);
    fleet
        .replicas
        .iter()
        .position(|r| r.address == replica)
        .unwrap_or_else(|| panic!("unknown replica {replica}"))
}

/// The frame of the tests on the two-pool fleet: the fleet ([`start`]ed as `name`, every
/// replica's model catalogue scraped), a client, and `body` on them within [`TEST_TIMEOUT`].
async fn pools_test(name: &str, body: impl AsyncFnOnce(&Fleet, &HttpClient)) {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start(&tools, name).await;
        wait_for_catalogues(&fleet).await;
        body(&fleet, &HttpClient::new()).await;
    })
    .await;
}

/// Replicas 0 and 1 serve `pool-a` with a 1,024-token context, replica 2 with vLLM's default;
/// the proxies decide as `decision` says. Returned once the control plane has read every
/// card's `max_model_len` (and, deciding locally, the proxies have synced since).
async fn start_mixed_contexts(tools: &Tools, name: &str, decision: &str) -> Fleet {
    let mut cfg = common::fleet_config(name, 3, "pool-a");
    let short = ["--max-model-len", "1024"].map(String::from).to_vec();
    cfg.per_replica_args = vec![short.clone(), short, Vec::new()];
    cfg.plugin_config = json!({"decision": decision, "sync_interval_ms": 50});
    cfg.control_plane_extra = json!({"models_interval_ms": 200});
    let fleet = common::start_fleet(cfg, tools).await;
    let addresses: Vec<String> = fleet.replicas.iter().map(|r| r.address.clone()).collect();
    wait_for(&fleet, "every context learned", |text| {
        let contexts: Vec<Option<f64>> = addresses
            .iter()
            .map(|a| {
                prometheus_sample(
                    text,
                    &format!("kvroute_endpoint_max_model_len{{endpoint=\"{a}\"}}"),
                )
            })
            .collect();
        contexts == [Some(1024.0), Some(1024.0), Some(131_072.0)]
    })
    .await;
    if decision == "local" {
        // Two syncs after the catalogues changed: every copy holds them.
        let applied = fleet.envoy_counter_all("kvroute_sync_applied").await;
        let deadline = Instant::now() + CATALOGUE_TIMEOUT;
        while fleet.envoy_counter_all("kvroute_sync_applied").await < applied + 2.0 {
            assert!(Instant::now() < deadline, "no syncs ({})", fleet.describe());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    fleet
}

// A prompt longer than some replicas' context (`max_model_len` in their `/v1/models` card) is
// sent only where it fits, whether the control plane or the proxy decides, so none is refused;
// a short one may go anywhere; an output budget no context holds gets the engine's own 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_goes_only_where_its_context_holds_it() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        for decision in ["control-plane", "local"] {
            let fleet =
                start_mixed_contexts(&tools, &format!("e2e-context-{decision}"), decision).await;
            let client = HttpClient::new();
            for seed in 0..6u64 {
                // About 1,500 words: more than 1,024 tokens however they are counted.
                let long = common::user_chat("pool-a", &common::words(700 + seed, 1_500), 4);
                let resp = chat(&client, &fleet, &long, &[]).await;
                assert_eq!(
                    served_by(&resp, &fleet),
                    2,
                    "{decision}: a long prompt fits only there"
                );
                let short = chat_body("pool-a", 800 + seed, None);
                assert_eq!(
                    chat(&client, &fleet, &short, &[]).await.status,
                    200,
                    "{decision}"
                );
            }
            let mut budget = chat_body("pool-a", 900, None);
            budget["max_tokens"] = json!(200_000);
            let resp = chat(&client, &fleet, &budget, &[]).await;
            assert_eq!(resp.status, 400, "{decision}: {}", resp.body);
            assert!(resp.body.contains("max_model_len"), "{}", resp.body);
            if decision == "control-plane" {
                let text = common::cp_metrics(&fleet).await;
                let counted = |action: &str| {
                    let name = format!("kvroute_context_length_total{{action=\"{action}\"}}");
                    prometheus_sample(&text, &name)
                };
                assert_eq!(counted("narrowed"), Some(6.0), "{text}");
                assert_eq!(counted("exceeded"), Some(1.0), "{text}");
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_only_their_models_pool_and_unknown_models_get_404() {
    pools_test("e2e-pools", async |fleet, client| {
        for i in 0..12u64 {
            let (model, pool) = match i % 3 {
                0 => ("pool-a", [0, 1]),
                1 => ("pool-b", [2, 3]),
                _ => ("pool-b-sql", [2, 3]),
            };
            let resp = chat(client, fleet, &chat_body(model, i, None), &[]).await;
            let replica = served_by(&resp, fleet);
            assert!(
                pool.contains(&replica),
                "{model} served by replica {replica}, outside its pool {pool:?}"
            );
        }

        // A model nobody serves: the filter answers 404 itself, in OpenAI's error shape.
        let resp = chat(client, fleet, &chat_body("gpt-9", 99, None), &[]).await;
        assert_eq!(resp.status, 404, "{}", resp.body);
        assert_eq!(resp.header(REPLICA_HEADER), None, "no replica saw it");
        let err: Value = serde_json::from_str(&resp.body).unwrap();
        assert_eq!(err["error"]["type"], "model_not_found", "{err:#}");
        assert_eq!(err["error"]["code"], 404, "{err:#}");
        assert!(
            err["error"]["message"].as_str().unwrap().contains("gpt-9"),
            "{err:#}"
        );

        let text = common::cp_metrics(fleet).await;
        assert_eq!(
            prometheus_sample(&text, "kvroute_unknown_model_total{action=\"rejected\"}"),
            Some(1.0),
            "{text}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stay_on_their_replica_and_adapters_follow_their_holder() {
    pools_test("e2e-sessions", async |fleet, client| {
        // Three conversations by header and one by the body's `user`, interleaved; prompts
        // share no prefix, so only affinity keeps each on one replica.
        let keys = ["s-1", "s-2", "s-3", "user-4"];
        let mut homes: Vec<Option<usize>> = vec![None; keys.len()];
        for round in 0..6u64 {
            for (k, key) in keys.iter().enumerate() {
                let seed = 1_000 * (k as u64 + 1) + round;
                let resp = if key.starts_with("user") {
                    chat(client, fleet, &chat_body("pool-a", seed, Some(key)), &[]).await
                } else {
                    let body = chat_body("pool-a", seed, None);
                    chat(client, fleet, &body, &[("x-session-id", key)]).await
                };
                let replica = served_by(&resp, fleet);
                assert!([0, 1].contains(&replica), "{key} left pool-a: {replica}");
                match homes[k] {
                    None => homes[k] = Some(replica),
                    Some(home) => assert_eq!(
                        replica,
                        home,
                        "session {key} moved in round {round} ({})",
                        fleet.describe()
                    ),
                }
            }
        }
        let text = common::cp_metrics(fleet).await;
        assert_eq!(
            prometheus_sample(&text, "kvroute_sessions_total{result=\"hit\"}"),
            Some(20.0),
            "{text}"
        );
        assert_eq!(
            prometheus_sample(&text, "kvroute_sessions_total{result=\"miss\"}"),
            Some(4.0),
            "{text}"
        );
        assert_eq!(
            prometheus_sample(&text, "kvroute_sessions_remembered"),
            Some(4.0)
        );

        // LoRA: a long request for `pool-b-sql` keeps the adapter running on one replica;
        // further `pool-b-sql` requests go there (the other would have to load it).
        let long = json!({
            "model": "pool-b-sql",
            "messages": [{"role": "user", "content": "write a long report"}],
            "max_tokens": 4000,
        });
        let url = format!("{}/v1/chat/completions", fleet.url());
        let background = {
            let client = HttpClient::new();
            let url = url.clone();
            tokio::spawn(async move {
                client
                    .request("POST", &url, &[], Some(long.to_string()), TEST_TIMEOUT)
                    .await
            })
        };
        // Wait until a pool-B replica reports the adapter running.
        let deadline = Instant::now() + CATALOGUE_TIMEOUT;
        let holder = loop {
            let text = common::cp_metrics(fleet).await;
            let running: Vec<f64> = fleet.replicas[2..]
                .iter()
                .map(|r| {
                    prometheus_sample(
                        &text,
                        &format!(
                            "kvroute_endpoint_lora_running{{endpoint=\"{}\"}}",
                            r.address
                        ),
                    )
                    .unwrap_or(0.0)
                })
                .collect();
            if let Some(i) = running.iter().position(|&n| n >= 1.0) {
                break 2 + i;
            }
            assert!(Instant::now() < deadline, "no replica runs the adapter");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for i in 0..4u64 {
            let resp = chat(
                client,
                fleet,
                &chat_body("pool-b-sql", 5_000 + i, None),
                &[("x-kvroute-explain", "1")],
            )
            .await;
            assert_eq!(
                served_by(&resp, fleet),
                holder,
                "the adapter's holder serves it"
            );
        }
        // The explain output shows the LoRA term: zero on the holder, a load on the other.
        let resp = chat(
            client,
            fleet,
            &chat_body("pool-b-sql", 6_000, None),
            &[("x-kvroute-explain", "1")],
        )
        .await;
        let d = common::explained_decision(fleet, &resp).await;
        let candidates = d["candidates"].as_array().unwrap();
        assert_eq!(candidates.len(), 2, "only pool B: {d:#}");
        for c in candidates {
            let lora_ms = c["lora_ms"].as_f64().unwrap();
            if c["endpoint"] == fleet.replicas[holder].address.as_str() {
                assert_eq!(lora_ms, 0.0, "{d:#}");
            } else {
                assert!(lora_ms > 0.0, "{d:#}");
            }
        }
        background.abort();
    })
    .await;
}

/// Polls the control plane's metrics until `ok` holds.
async fn wait_for(fleet: &Fleet, what: &str, ok: impl Fn(&str) -> bool) {
    common::wait_cp_metrics(fleet, what, CATALOGUE_TIMEOUT, ok).await;
}

/// A long request in the background (it keeps its adapter in a slot while it runs).
fn long_request(url: String, model: &str) -> tokio::task::JoinHandle<()> {
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": format!("a long answer from {model}")}],
        "max_tokens": 4000,
    });
    tokio::spawn(async move {
        let _ = HttpClient::new()
            .request("POST", &url, &[], Some(body.to_string()), TEST_TIMEOUT)
            .await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_adapter_avoids_the_replica_whose_only_slot_another_adapter_holds() {
    let body = async {
        let fleet = common::start_configured("e2e-lora-slots", 2, "lora-base", |cfg| {
            cfg.sim_args = [
                "--lora-modules",
                "a=/adapters/a",
                "b=/adapters/b",
                "--max-loras",
                "1",
            ]
            .map(String::from)
            .to_vec();
            cfg.plugin_config = json!({"allow_explain": true});
            cfg.control_plane_extra = json!({"models_interval_ms": 200});
        })
        .await;
        let client = HttpClient::new();
        let gauge = |text: &str, name: &str, address: &str| {
            prometheus_sample(text, &format!("{name}{{endpoint=\"{address}\"}}")).unwrap_or(0.0)
        };
        // Every replica's sample of the per-endpoint gauge `name`, in the fleet's order.
        let per_replica = |text: &str, name: &str| -> Vec<f64> {
            let replicas = fleet.replicas.iter();
            replicas.map(|r| gauge(text, name, &r.address)).collect()
        };
        wait_for(&fleet, "both catalogues", |m| {
            per_replica(m, "kvroute_endpoint_models") == [3.0, 3.0]
        })
        .await;

        // Adapter `a` takes one replica's only slot for a long time.
        let url = format!("{}/v1/chat/completions", fleet.url());
        let mut background = vec![long_request(url.clone(), "a")];
        let mut holder = String::new();
        wait_for(&fleet, "adapter a running", |m| {
            per_replica(m, "kvroute_endpoint_lora_running").contains(&1.0)
        })
        .await;
        let text = common::cp_metrics(&fleet).await;
        for r in &fleet.replicas {
            if gauge(&text, "kvroute_endpoint_lora_running", &r.address) == 1.0 {
                holder = r.address.clone();
            }
        }
        let other = fleet
            .replicas
            .iter()
            .find(|r| r.address != holder)
            .unwrap()
            .address
            .clone();
        // The other replica gets busier with base-model work (sent to it directly).
        for _ in 0..3 {
            background.push(long_request(
                format!("http://{other}/v1/chat/completions"),
                "lora-base",
            ));
        }
        wait_for(&fleet, "the other replica busy", |m| {
            gauge(m, "kvroute_endpoint_running", &other) >= 3.0
        })
        .await;

        // Adapter `b`: the less loaded replica would make it wait for `a`'s slot.
        let resp = chat(
            &client,
            &fleet,
            &chat_body("b", 7, None),
            &[("x-kvroute-explain", "1")],
        )
        .await;
        assert_eq!(resp.status, 200, "{}", resp.body);
        assert_eq!(resp.header(REPLICA_HEADER), Some(other.as_str()));
        let d = common::explained_decision(&fleet, &resp).await;
        let lora_ms = |address: &str| {
            d["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["endpoint"] == address)
                .and_then(|c| c["lora_ms"].as_f64())
                .unwrap_or_else(|| panic!("no {address} in {d:#}"))
        };
        assert!(
            lora_ms(&holder) >= 5_000.0,
            "full slots are penalised: {d:#}"
        );
        assert!(lora_ms(&other) < 5_000.0, "{d:#}");

        // The simulator enforces the slot: `b` sent to the holder directly waits there.
        background.push(long_request(
            format!("http://{holder}/v1/chat/completions"),
            "b",
        ));
        let holder_url = format!("http://{holder}/metrics");
        let deadline = Instant::now() + CATALOGUE_TIMEOUT;
        loop {
            let page = client.get(&holder_url, REQUEST_TIMEOUT).await.unwrap().body;
            if page.lines().any(|l| {
                l.starts_with("vllm:lora_requests_info")
                    && l.contains("running_lora_adapters=\"a\"")
                    && l.contains("waiting_lora_adapters=\"b\"")
            }) {
                break;
            }
            assert!(Instant::now() < deadline, "b never waited:\n{page}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for task in background {
            task.abort();
        }
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
