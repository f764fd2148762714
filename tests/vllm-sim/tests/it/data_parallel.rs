//! `--data-parallel-size N` behind one API server and the external-load-balancer layout
//! (`--data-parallel-rank K`): per-rank caches, the rank header, per-engine metrics and
//! per-rank KV-event publishers, as vLLM 0.33 runs them.

use std::time::Duration;

use crate::common::{T, json_body, start};
use kvroute_harness::{HttpClient, HttpResponse};
use serde_json::{Value, json};
use vllm_sim::server::DP_RANK_HEADER;
use vllm_sim::server::dp::RANK_HEADER;
use vllm_wire::kv_events::decode_batch;
use zeromq::{Socket, SocketRecv, SubSocket};

async fn completion(c: &HttpClient, url: &str, prompt: &str, rank: Option<&str>) -> HttpResponse {
    let body = json!({"prompt": prompt, "max_tokens": 1}).to_string();
    let headers: Vec<(&str, &str)> = rank.map(|r| (RANK_HEADER, r)).into_iter().collect();
    c.request(
        "POST",
        &format!("{url}/v1/completions"),
        &[&[("content-type", "application/json")], &headers[..]].concat(),
        Some(body),
        T,
    )
    .await
    .expect("response")
}

fn cached(r: &HttpResponse) -> u64 {
    json_body(r)["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn served_by(r: &HttpResponse) -> &str {
    r.header(DP_RANK_HEADER).expect("rank header")
}

#[tokio::test]
async fn the_rank_header_picks_an_engine_with_a_cache_of_its_own() {
    let sim = start(&["--data-parallel-size", "4"]).await;
    let c = HttpClient::new();
    let prompt = (0..64)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let first = completion(&c, &sim.url(), &prompt, Some("2")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(served_by(&first), "2");
    assert_eq!(cached(&first), 0);
    // The same prompt on the same rank hits its cache; on another rank it does not.
    let again = completion(&c, &sim.url(), &prompt, Some("2")).await;
    assert_eq!(served_by(&again), "2");
    assert!(cached(&again) >= 48, "{}", again.body);
    let elsewhere = completion(&c, &sim.url(), &prompt, Some("1")).await;
    assert_eq!(served_by(&elsewhere), "1");
    assert_eq!(cached(&elsewhere), 0);

    // Out of range: refused as vLLM's input processor refuses it; not a number: ignored.
    let refused = completion(&c, &sim.url(), &prompt, Some("4")).await;
    assert_eq!(refused.status, 400);
    assert_eq!(
        json_body(&refused)["error"]["message"],
        "data_parallel_rank 4 is out of range [0, 4)."
    );
    let ignored = completion(&c, &sim.url(), &prompt, Some("two")).await;
    assert_eq!(ignored.status, 200);

    // One page, each family's HELP once, a series per engine.
    let page = c
        .get(&format!("{}/metrics", sim.url()), T)
        .await
        .expect("metrics")
        .body;
    assert_eq!(page.matches("# HELP vllm:num_requests_running ").count(), 1);
    for rank in 0..4 {
        assert!(
            page.contains(&format!(
                "vllm:num_requests_running{{model_name=\"sim-llama\",engine=\"{rank}\"}}"
            )),
            "engine {rank} missing"
        );
    }
    let hits: f64 = vllm_wire::prom::samples(&page)
        .map(|s| s.expect("well formed"))
        .filter(|s| {
            s.name == "vllm:prefix_cache_hits_total" && s.raw_labels.contains("engine=\"2\"")
        })
        .map(|s| s.value)
        .sum();
    assert!(hits >= 48.0, "rank 2 counted its hit: {hits}");
    // The router's parser reads the page.
    let whole = vllm_wire::prom::parse_vllm_metrics(&page).expect("parses");

    // `/metrics/?name[]=…` (vLLM's prometheus_client mount) serves only the named samples, for
    // every engine; `/metrics` ignores the query, as vLLM's instrumentator route does.
    let names = vllm_wire::prom::READ_SERIES;
    let path = vllm_wire::prom::restricted_metrics_path(&names);
    let small = c
        .get(&format!("{}{path}", sim.url()), T)
        .await
        .expect("metrics/");
    assert_eq!(small.status, 200);
    assert!(small.body.len() * 10 < page.len(), "{}", small.body);
    assert_eq!(
        small
            .body
            .matches("# HELP vllm:num_requests_running ")
            .count(),
        1
    );
    for sample in vllm_wire::prom::samples(&small.body) {
        let sample = sample.expect("well formed");
        assert!(names.contains(&sample.name), "{}", sample.name);
    }
    let restricted = vllm_wire::prom::parse_vllm_metrics(&small.body).expect("parses");
    assert_eq!(restricted.capacity_tokens, whole.capacity_tokens);
    assert_eq!(
        vllm_wire::prom::scrape_vllm_engine_metrics(&small.body, 2).map(|m| m.capacity_tokens),
        vllm_wire::prom::scrape_vllm_engine_metrics(&page, 2).map(|m| m.capacity_tokens)
    );
    let query = path.split_once('?').expect("query").1;
    let ignored = c
        .get(&format!("{}/metrics?{query}", sim.url()), T)
        .await
        .expect("metrics?");
    assert!(
        ignored
            .body
            .contains("# HELP vllm:e2e_request_latency_seconds ")
    );
}

#[tokio::test]
async fn without_a_header_a_burst_is_spread_over_the_ranks() {
    let sim = start(&["--data-parallel-size", "4"]).await;
    let c = HttpClient::new();
    let url = sim.url();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": format!("burst {i} ").repeat(40), "max_tokens": 20});
            c.post_json(&format!("{url}/v1/completions"), &body, T)
                .await
                .expect("response")
        }));
    }
    let mut ranks = std::collections::BTreeSet::new();
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!(r.status, 200);
        ranks.insert(served_by(&r).to_owned());
    }
    assert_eq!(ranks.len(), 4, "every rank took part: {ranks:?}");
    let load = json_body(&c.get(&format!("{url}/load"), T).await.expect("load"));
    assert_eq!(load, json!({"server_load": 0}));
    let stats = json_body(&c.get(&format!("{url}/sim/stats"), T).await.expect("stats"));
    assert_eq!(stats["ranks"].as_array().map(Vec::len), Some(4));
}

/// The batch of the first message on `sub` that arrives while `send` keeps making new blocks.
async fn first_batch(sub: &mut SubSocket, mut send: impl AsyncFnMut(u32)) -> Value {
    for attempt in 0..40 {
        send(attempt).await;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(250), sub.recv()).await {
            let frames = m.into_vec();
            let batch = decode_batch(&frames[2]).expect("a batch");
            return json!({"rank": batch.data_parallel_rank, "events": batch.events.len()});
        }
    }
    panic!("no KV-event batch");
}

/// A server of `size` ranks (or only `rank`, the external-load-balancer layout) publishing KV
/// events from a fixed base port (port 0 would leave every rank to the OS, as in vLLM), and
/// that base port.
async fn publishing(size: &str, rank: Option<&str>) -> (vllm_sim::server::SimServer, u16) {
    let base = kvroute_harness::free_port_run(3).expect("free ports");
    let endpoint = format!("tcp://127.0.0.1:{base}");
    let mut args = vec![
        "--data-parallel-size",
        size,
        "--kv-events-endpoint",
        &endpoint,
    ];
    if let Some(rank) = rank {
        args.extend(["--data-parallel-rank", rank]);
    }
    (start(&args).await, base)
}

#[tokio::test]
async fn each_rank_publishes_its_kv_events_on_the_port_offset_by_its_rank() {
    let (sim, base) = publishing("3", None).await;
    let want: Vec<String> = (0..3)
        .map(|r| format!("tcp://127.0.0.1:{}", base + r))
        .collect();
    assert_eq!(sim.kv_events_endpoints, want);
    let c = HttpClient::new();
    let url = sim.url();
    // vLLM's list of every rank's publisher, as a router discovers them.
    let listed = c
        .get(&format!("{url}/kv_event_sources"), T)
        .await
        .expect("sources");
    let sources = vllm_wire::kv_events::parse_event_sources(listed.body.as_bytes()).unwrap();
    let endpoints: Vec<&str> = sources.values().map(|p| p.endpoint.as_str()).collect();
    assert_eq!(
        endpoints,
        want.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert!(sources.values().all(|p| p.is_zmq()));
    for rank in 0..3u32 {
        let mut sub = SubSocket::new();
        sub.connect(&want[rank as usize]).await.expect("connect");
        sub.subscribe("").await.expect("subscribe");
        let rank_text = rank.to_string();
        let batch = first_batch(&mut sub, async |attempt| {
            let prompt = format!("rank {rank} attempt {attempt} ").repeat(20);
            let r = completion(&c, &url, &prompt, Some(&rank_text)).await;
            assert_eq!(r.status, 200);
        })
        .await;
        assert_eq!(batch["rank"], rank, "{batch}");
    }

    // The external-load-balancer layout: one rank per server, stamped and offset the same.
    let (one, base) = publishing("3", Some("2")).await;
    assert_eq!(
        one.kv_events_endpoints,
        vec![format!("tcp://127.0.0.1:{}", base + 2)]
    );
    let page = c
        .get(&format!("{}/metrics", one.url()), T)
        .await
        .expect("metrics")
        .body;
    assert!(page.contains("engine=\"2\""));
    assert!(!page.contains("engine=\"0\""));
}
