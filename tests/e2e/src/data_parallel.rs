//! Data-parallel servers through real Envoy (issue #18 point 4): two `vllm-sim` servers with
//! `--data-parallel-size 4` each (vLLM's internal load balancer: four engines, each with its
//! own cache, behind one API), configured with `data_parallel_size: 4`. The router scores the
//! eight ranks as endpoints, the proxy sends each request to its server with
//! `X-data-parallel-rank`, and a multi-turn workload must keep every turn on the rank that
//! holds its conversation, as well as eight separate replicas do.

use std::time::Duration;

use kvroute_harness::{Fleet, FleetConfig, HttpClient, Tools};
use serde_json::{Value, json};

use crate::common::{self, Conversation, Turns, replica_header};

const TEST_TIMEOUT: Duration = Duration::from_secs(240);
const MODEL: &str = "kvroute-e2e-data-parallel";
const RANKS: u32 = 4;
const CONVERSATIONS: u64 = 12;
const TURNS: usize = 5;

/// How the fleet is routed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Routing {
    /// Approximate, a route call per request.
    Callout,
    /// Approximate, decided in the filter on its synced copy.
    Local,
    /// Precise: every engine's KV events (each rank's on its own port), prompts tokenised
    /// through the replicas' render API; the publishers are found through each server's
    /// `/kv_event_sources` (`kv_events: auto`).
    Precise,
}

/// Two servers of four ranks each, or (`ranks` 1) eight plain replicas.
fn topology(name: &str, ranks: u32, routing: Routing) -> FleetConfig {
    let mut cfg = common::fleet_config(name, 8 / ranks as usize, MODEL);
    cfg.data_parallel_size = ranks;
    let decision = if routing == Routing::Local {
        "local"
    } else {
        "control-plane"
    };
    cfg.plugin_config =
        json!({"decision": decision, "sync_interval_ms": 50, "allow_explain": true});
    if routing == Routing::Precise {
        cfg.sim_args = vec!["--speed".into(), "5".into()];
        cfg.kv_events = true;
        cfg.control_plane_extra = common::remote_tokenizer();
        cfg.control_plane_router = common::precise_router(200);
        cfg.plugin_config["route_timeout_ms"] = json!(3000);
        cfg.plugin_config["routes"] =
            json!([{"path": "/v1/chat/completions", "api": "chat", "mode": "precise"}]);
        let auto = json!({"kv_events": "auto", "kv_events_replay": null});
        cfg.endpoint_extra = vec![auto; 8 / ranks as usize];
    }
    cfg
}

/// What a run's follow-up turns did, and the engines that served its turns.
#[derive(Debug, Default)]
struct Run {
    turns: Turns,
    engines: std::collections::BTreeSet<String>,
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, {} engines used", self.turns, self.engines.len())
    }
}

/// The endpoint the explain header names (`endpoint=...`).
fn explained_endpoint(resp: &kvroute_harness::HttpResponse) -> Option<String> {
    let decision = resp.header("x-kvroute-decision")?;
    decision
        .split("; ")
        .find_map(|part| part.strip_prefix("endpoint="))
        .map(str::to_string)
}

/// `CONVERSATIONS` conversations of `TURNS` turns, started 150 ms apart, every turn asking
/// for the decision to be explained and (to show the proxy owns it) carrying a client
/// `X-data-parallel-rank` that is out of range for every server.
async fn run(fleet: &Fleet) -> Run {
    let client = HttpClient::new();
    let runs = (0..CONVERSATIONS).map(|c| {
        let client = &client;
        async move {
            tokio::time::sleep(Duration::from_millis(150) * c as u32).await;
            let mut conv = Conversation::new(MODEL, 7_000 + c, 800, 80);
            let mut out = Run::default();
            let mut previous: Option<String> = None;
            for _ in 0..TURNS {
                let mut body = conv.ask(8);
                body["stream"] = json!(false);
                let headers = [("x-kvroute-explain", "1"), ("x-data-parallel-rank", "9")];
                let resp =
                    common::chat_ok(client, fleet, &body, &headers, Duration::from_secs(30)).await;
                // The engine that served it, named as the router names endpoints.
                let engine = resp.replica().unwrap_or_else(|| replica_header(&resp));
                assert_eq!(
                    explained_endpoint(&resp).as_deref(),
                    Some(engine.as_str()),
                    "the explain header names the engine that served ({})",
                    fleet.describe()
                );
                let answer: Value = serde_json::from_str(&resp.body).expect("json answer");
                conv.messages.push(json!({
                    "role": "assistant",
                    "content": answer["choices"][0]["message"]["content"].clone()
                }));
                if let Some(prev) = &previous {
                    let usage = &answer["usage"];
                    out.turns.follow_up(
                        *prev == engine,
                        usage["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0),
                        usage["prompt_tokens"].as_u64().unwrap_or(0),
                    );
                }
                out.engines.insert(engine.clone());
                previous = Some(engine);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            out
        }
    });
    let mut total = Run::default();
    for r in futures_util::future::join_all(runs).await {
        total.turns.add(r.turns);
        total.engines.extend(r.engines);
    }
    total
}

async fn measured(name: &str, ranks: u32, routing: Routing, tools: &Tools) -> Run {
    let fleet = common::start_fleet(topology(name, ranks, routing), tools).await;
    match routing {
        Routing::Local => crate::local_decisions::wait_synced(&fleet, 2.0).await,
        // Every rank's own stream, on its own port, is live under its rank's name.
        Routing::Precise => common::wait_events_live(&fleet, Duration::from_secs(10)).await,
        Routing::Callout => {}
    }
    let run = run(&fleet).await;
    eprintln!("data_parallel: {name}: {run}");
    if ranks > 1 {
        // Every engine is a rank of one of the two servers.
        assert!(
            run.engines.iter().all(|e| e.contains("#dp")),
            "{:?}",
            run.engines
        );
    }
    // Twelve conversations spread over the eight engines by load (not all on rank 0).
    assert!(
        run.engines.len() >= 4,
        "{name}: conversations spread over the engines: {:?}",
        run.engines
    );
    run
}

/// Fails unless `ranks` kept its turns on their engines and reused as much as `separate`.
fn assert_as_separate(ranks: &Run, separate: &Run, what: &str) {
    assert!(
        ranks.turns.follow_rate() >= 0.95,
        "{what}: only {ranks} (separate replicas: {separate})"
    );
    assert!(
        ranks.turns.hit_rate() >= separate.turns.hit_rate() - 0.02,
        "{what}: {ranks}, against separate replicas' {separate}"
    );
}

// Each turn lands on the rank holding its conversation, through the route call and through
// the filter's local decisions, with the hit rate of eight separate replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_turn_lands_on_the_rank_that_holds_its_prefix() {
    let tools = common::tools();
    common::bounded(TEST_TIMEOUT, async {
        let separate = measured("e2e-dp-separate", 1, Routing::Callout, &tools).await;
        for routing in [Routing::Callout, Routing::Local] {
            let name = format!("e2e-dp-{routing:?}").to_lowercase();
            let ranks = measured(&name, RANKS, routing, &tools).await;
            assert_as_separate(&ranks, &separate, &name);
        }
    })
    .await;
}

// Precise mode on data-parallel servers: each rank's KV events (stamped with the rank, on the
// server's port + rank, found through the server's `/kv_event_sources`) feed that rank's index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_mode_reads_each_ranks_kv_events() {
    let tools = common::tools();
    common::bounded(TEST_TIMEOUT, async {
        let _alone = common::HEAVY.lock().await;
        let separate = measured("e2e-dp-precise-separate", 1, Routing::Precise, &tools).await;
        let ranks = measured("e2e-dp-precise", RANKS, Routing::Precise, &tools).await;
        assert_as_separate(&ranks, &separate, "precise");
    })
    .await;
}
