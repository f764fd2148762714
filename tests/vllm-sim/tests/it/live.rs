//! The live `vllm-sim` server: OpenAI API, usage and prefix caching, metrics, KV events over
//! ZMQ, failure injection. Servers run in-process on OS-picked ports (one test also runs the
//! built binary), every wait has a timeout.

use std::time::Duration;

use crate::common::{T, json_body, replay_from_zero, run_binary, spawn_binary, start};
use clap::Parser;
use http_body_util::{BodyExt, Full};
use kvroute_harness::{HttpClient, HttpResponse};
use serde_json::{Value, json};
use vllm_sim::server::{self, REPLICA_HEADER, SimArgs};
use vllm_wire::kv_events::{BlockHash, WireBatch, WireEvent, decode_batch};
use zeromq::{Socket, SocketRecv, SubSocket};

async fn post(c: &HttpClient, url: &str, body: Value) -> HttpResponse {
    c.post_json(url, &body, T).await.expect("response")
}

/// The OpenAI-style `error.message` of a refused request.
fn error_message(r: &HttpResponse) -> String {
    json_body(r)["error"]["message"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The `data:` payloads of an SSE body, `[DONE]` excluded (asserted last).
fn sse_chunks(body: &str) -> Vec<Value> {
    let datas: Vec<&str> = body
        .split("\n\n")
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad event {s:?}"))
        })
        .collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "stream ends with [DONE]");
    datas[..datas.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk is json"))
        .collect()
}

/// The value of the sample written `series` (`name{labels}` as rendered), read with the
/// router's parser.
fn metric(page: &str, series: &str) -> f64 {
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}').expect("labels end in }")),
        None => (series, ""),
    };
    vllm_wire::prom::samples(page)
        .map(|s| s.expect("a well-formed page"))
        .find(|s| s.name == name && s.raw_labels == labels)
        .map(|s| s.value)
        .unwrap_or_else(|| panic!("metric {series} missing"))
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "sim-llama",
        "messages": [
            {"role": "system", "content": "You are a terse assistant. ".repeat(20)},
            {"role": "user", "content": content}
        ],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true}
    })
}

#[tokio::test]
async fn streaming_usage_and_cached_tokens_on_a_repeated_prompt() {
    let sim = start(&[]).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/chat/completions", sim.url());
    let body = chat(
        "Tell me about prefix caching in paged attention engines.",
        5,
        true,
    );

    let r = post(&c, &url, body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(
        r.header(REPLICA_HEADER),
        Some(sim.addr.to_string().as_str())
    );
    let chunks = sse_chunks(&r.body);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text.split_whitespace().count(), 5, "five words: {text:?}");
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, "length");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(usage["completion_tokens"], 5);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 100);
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt_tokens + 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The same prompt again, non-streaming: everything but the last partial block is cached.
    let mut body = body;
    body["stream"] = json!(false);
    let r = post(&c, &url, body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = json_body(&r);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"]["content"].as_str().unwrap(),
        text
    );
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (prompt_tokens - 1) / 16 * 16);
    sim.shutdown().await;
}

#[tokio::test]
async fn completions_and_the_next_chat_turn_reuse_the_answer() {
    let sim = start(&[]).await;
    let c = HttpClient::new();
    let base = sim.url();

    let r = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"prompt": "Once upon a time", "max_tokens": 3}),
    )
    .await;
    let v = json_body(&r);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let r = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"prompt": [5, 6, 7], "max_tokens": 2, "stream": true}),
    )
    .await;
    let chunks = sse_chunks(&r.body);
    assert_eq!(chunks[0]["object"], "text_completion");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Turn 1, then turn 2 carrying turn 1's answer: the answer's blocks are cached too.
    let mut body = chat("Explain KV caches. ".repeat(30).as_str(), 40, false);
    let v = json_body(&post(&c, &format!("{base}/v1/chat/completions"), body.clone()).await);
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let turn1_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": answer}),
        json!({"role": "user", "content": "Thanks!"}),
    ]);
    let render = json_body(
        &post(
            &c,
            &format!("{base}/v1/chat/completions/render"),
            body.clone(),
        )
        .await,
    );
    let tok = json_body(
        &post(
            &c,
            &format!("{base}/tokenize"),
            json!({"messages": body["messages"].clone()}),
        )
        .await,
    );
    assert_eq!(render["token_ids"], tok["tokens"]);
    assert_eq!(
        tok["count"].as_u64().unwrap() as usize,
        tok["tokens"].as_array().unwrap().len()
    );
    assert_eq!(tok["max_model_len"], 131072);
    let v = json_body(&post(&c, &format!("{base}/v1/chat/completions"), body).await);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Prompt + 39 computed answer tokens, rounded down to full blocks.
    assert_eq!(cached, (turn1_prompt + 39) / 16 * 16);

    let r = post(
        &c,
        &format!("{base}/v1/completions/render"),
        json!({"prompt": "a b"}),
    )
    .await;
    assert_eq!(json_body(&r)["token_ids"].as_array().unwrap().len(), 2);
    let models = json_body(&c.get(&format!("{base}/v1/models"), T).await.unwrap());
    assert_eq!(models["data"][0]["id"], "sim-llama");
    assert_eq!(
        c.get(&format!("{base}/health"), T).await.unwrap().status,
        200
    );
    let load = json_body(&c.get(&format!("{base}/load"), T).await.unwrap());
    assert_eq!(load["server_load"], 0);
    let version = json_body(&c.get(&format!("{base}/version"), T).await.unwrap());
    assert!(version["version"].as_str().unwrap().starts_with("0.33"));
    sim.shutdown().await;
}

#[tokio::test]
async fn metrics_use_vllm_names_and_counters_move() {
    let sim = start(&["--lora-modules", "sql-lora=/adapters/sql"]).await;
    let c = HttpClient::new();
    let base = sim.url();
    let before = c.get(&format!("{base}/metrics"), T).await.unwrap().body;
    let l = "{model_name=\"sim-llama\",engine=\"0\"}";
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ] {
        assert_eq!(metric(&before, &format!("{name}{l}")), 0.0, "{name}");
    }
    assert!(before.contains("vllm:cache_config_info{block_size=\"16\""));
    assert!(before.contains("num_gpu_blocks=\"30625\""));
    assert!(before.contains("enable_prefix_caching=\"True\""));
    assert!(before.contains("vllm:lora_requests_info{max_lora=\"1\""));

    let body = chat("Metrics, please.", 4, false);
    for _ in 0..2 {
        assert_eq!(
            post(&c, &format!("{base}/v1/chat/completions"), body.clone())
                .await
                .status,
            200
        );
    }
    let mut lora = body.clone();
    lora["model"] = json!("sql-lora");
    assert_eq!(
        post(&c, &format!("{base}/v1/chat/completions"), lora)
            .await
            .status,
        200
    );

    let after = c.get(&format!("{base}/metrics"), T).await.unwrap().body;
    let prompt = metric(&after, &format!("vllm:prompt_tokens_total{l}"));
    let queries = metric(&after, &format!("vllm:prefix_cache_queries_total{l}"));
    assert!(prompt > 300.0);
    assert_eq!(queries, prompt);
    assert!(metric(&after, &format!("vllm:prefix_cache_hits_total{l}")) > 0.0);
    assert_eq!(
        metric(&after, &format!("vllm:generation_tokens_total{l}")),
        12.0
    );
    assert_eq!(
        metric(
            &after,
            "vllm:request_success_total{model_name=\"sim-llama\",engine=\"0\",finished_reason=\"length\"}"
        ),
        3.0
    );
    for h in [
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ] {
        assert_eq!(metric(&after, &format!("{h}{l}")), 3.0, "{h}");
    }
    assert_eq!(
        metric(
            &after,
            &format!("vllm:inter_token_latency_seconds_count{l}")
        ),
        9.0
    );
    assert_eq!(
        metric(&after, &format!("vllm:num_requests_running{l}")),
        0.0
    );
    sim.shutdown().await;
}

/// A payload through the decoder the control plane uses.
fn decode(payload: &[u8]) -> WireBatch {
    decode_batch(payload).expect("a KV event batch")
}

async fn recv(sub: &mut SubSocket) -> Vec<Vec<u8>> {
    let m = tokio::time::timeout(T, sub.recv())
        .await
        .expect("event in time")
        .expect("recv");
    m.into_vec().into_iter().map(|b| b.to_vec()).collect()
}

#[tokio::test]
async fn kv_events_over_zmq_with_replay() {
    let sim = start(&[
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-topic",
        "kv@sim",
    ])
    .await;
    let endpoint = sim.kv_events_endpoint.clone().expect("pub endpoint");
    let replay = sim
        .kv_events_replay_endpoint
        .clone()
        .expect("replay endpoint");
    assert!(!endpoint.ends_with(":0"), "port resolved: {endpoint}");

    let mut sub = SubSocket::new();
    sub.connect(&endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    // ZMQ's slow joiner: events published before the subscription reached the publisher are
    // lost, so send distinct prompts until one batch arrives (the replay below sees them all).
    let c = HttpClient::new();
    let mut frames = None;
    for attempt in 0..40 {
        let prompt: Vec<String> = (0..40).map(|i| format!("w{attempt}x{i}")).collect();
        let r = post(
            &c,
            &format!("{}/v1/completions", sim.url()),
            json!({"prompt": prompt.join(" "), "max_tokens": 1}),
        )
        .await;
        assert_eq!(r.status, 200);
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(250), sub.recv()).await {
            frames = Some(
                m.into_vec()
                    .into_iter()
                    .map(|b| b.to_vec())
                    .collect::<Vec<_>>(),
            );
            break;
        }
    }
    let frames = frames.expect("a kv event batch");
    assert_eq!(frames.len(), 3);
    assert_eq!(frames[0], b"kv@sim");
    let first_seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
    let batch = decode(&frames[2]);
    assert!(batch.ts > 1.7e9, "unix timestamp");
    assert_eq!(batch.data_parallel_rank, Some(0));
    let WireEvent::BlockStored(ev) = &batch.events[0] else {
        panic!("a store first: {:?}", batch.events[0]);
    };
    assert_eq!(ev.parent_block_hash, None);
    assert_eq!(ev.block_size, 16);
    assert_eq!(ev.medium.as_deref(), Some("GPU"));
    assert!(ev.lora_id.is_none() && ev.lora_name.is_none());
    assert_eq!(ev.block_hashes.len(), 2, "40 prompt tokens fill two blocks");
    assert_eq!(ev.token_ids.len(), 32);
    let want = scorer_core::hash::token_block_hashes(0, &ev.token_ids, 16);
    assert_eq!(
        ev.block_hashes
            .iter()
            .map(BlockHash::to_u64)
            .collect::<Vec<_>>(),
        want
    );

    let r = post(&c, &format!("{}/reset_prefix_cache", sim.url()), json!({})).await;
    assert_eq!(r.status, 200);
    assert_eq!(json_body(&r), json!({"success": true}));
    let frames = recv(&mut sub).await;
    let last_seq = first_seq + 1;
    assert_eq!(frames[1], last_seq.to_be_bytes());
    assert_eq!(decode(&frames[2]).events, vec![WireEvent::AllBlocksCleared]);

    // Replay everything from seq 0: both batches, then the end marker.
    let mut seqs = Vec::new();
    for f in replay_from_zero(&replay).await {
        assert_eq!(f[1].as_ref(), b"kv@sim");
        seqs.push(u64::from_be_bytes(f[2].as_ref().try_into().unwrap()));
        decode(&f[3]);
    }
    assert_eq!(seqs, (0..=last_seq).collect::<Vec<_>>());
    sim.shutdown().await;
}

#[tokio::test]
async fn failure_injection_and_clear_errors() {
    let sim = start(&["--fail-rate", "1", "--fail-status", "503"]).await;
    let c = HttpClient::new();
    let base = sim.url();
    let url = format!("{base}/v1/chat/completions");
    let r = post(&c, &url, chat("hi", 1, false)).await;
    assert_eq!(r.status, 503);
    assert_eq!(
        r.header(REPLICA_HEADER),
        Some(sim.addr.to_string().as_str())
    );
    assert_eq!(
        post(&c, &format!("{base}/sim/fault"), json!({"fail_rate": 0.0}))
            .await
            .status,
        200
    );
    assert_eq!(post(&c, &url, chat("hi", 1, false)).await.status, 200);

    // Bad input: clear 4xx errors in vLLM's shape.
    let r = c
        .request("POST", &url, &[], Some("{not json".into()), T)
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(json_body(&r)["error"]["type"], "BadRequestError");
    let mut unknown = chat("hi", 1, false);
    unknown["model"] = json!("gpt-9");
    assert_eq!(post(&c, &url, unknown).await.status, 404);
    let r = post(&c, &url, chat("hi", 200_000, false)).await;
    assert_eq!(r.status, 400);
    assert!(
        error_message(&r).contains("cannot be greater than max_model_len=131072"),
        "{}",
        error_message(&r)
    );
    assert_eq!(post(&c, &url, json!({"messages": []})).await.status, 400);
    assert_eq!(
        post(&c, &format!("{base}/sim/fault"), json!({"bogus": 1}))
            .await
            .status,
        400
    );

    // Garbage metrics.
    post(
        &c,
        &format!("{base}/sim/fault"),
        json!({"garbage_metrics": true}),
    )
    .await;
    let page = c.get(&format!("{base}/metrics"), T).await.unwrap().body;
    assert!(!page.contains("vllm:kv_cache_usage_perc"));
    post(
        &c,
        &format!("{base}/sim/fault"),
        json!({"garbage_metrics": false}),
    )
    .await;

    // Hang: requests get no answer until the fault is cleared.
    post(&c, &format!("{base}/sim/fault"), json!({"hang": true})).await;
    let short = Duration::from_millis(300);
    assert!(
        c.get(&format!("{base}/health"), short).await.is_err(),
        "hangs"
    );
    let pending = {
        let c = c.clone();
        let url = format!("{base}/health");
        tokio::spawn(async move { c.get(&url, T).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    post(&c, &format!("{base}/sim/fault"), json!({"hang": false})).await;
    assert_eq!(pending.await.unwrap().unwrap().status, 200, "released");
    sim.shutdown().await;
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() {
    let sim = start(&["--speed", "1"]).await;
    let c = HttpClient::new();
    let req = hyper::Request::post(format!("{}/v1/chat/completions", sim.url()))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(
            chat("long", 100_000, true).to_string(),
        )))
        .unwrap();
    let resp = tokio::time::timeout(T, c.hyper().request(req))
        .await
        .unwrap()
        .unwrap();
    let mut body = resp.into_body();
    let first = tokio::time::timeout(T, body.frame()).await.unwrap();
    assert!(first.is_some());
    let stats = |c: &HttpClient| {
        let url = format!("{}/sim/stats", sim.url());
        let c = c.clone();
        async move { json_body(&c.get(&url, T).await.unwrap())["engine"].clone() }
    };
    assert_eq!(stats(&c).await["num_running"], 1);
    drop(body);
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let s = stats(&c).await;
        if s["num_running"] == 0 && s["requests_aborted"] == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "request not aborted: {s}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn the_binary_serves_and_stops() {
    let (mut child, base) = spawn_binary(
        &["--host", "127.0.0.1", "--model", "m", "--profile", "fast"],
        &[],
    )
    .await;
    let c = HttpClient::new();
    let r = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"model": "m", "prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(json_body(&r)["usage"]["completion_tokens"], 2);
    let bad = run_binary(&["--port", "0", "--speed", "0"], &[]).await;
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--speed"));
    child.start_kill().unwrap();
    tokio::time::timeout(T, child.wait())
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn shutdown_releases_hung_requests() {
    let sim = start(&[]).await;
    let c = HttpClient::new();
    let base = sim.url();
    post(&c, &format!("{base}/sim/fault"), json!({"hang": true})).await;
    let hung = {
        let c = c.clone();
        let url = format!("{base}/v1/chat/completions");
        tokio::spawn(async move { c.post_json(&url, &chat("hi", 1, false), T).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    sim.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "shutdown waited for a hung request"
    );
    let r = hung.await.unwrap().expect("answered");
    assert_eq!(r.status, 503);
}

/// `name{labels} value` of the first sample whose line starts with `prefix`, or 0.
fn sample(page: &str, prefix: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn speed_scales_wall_time_not_simulated_time() {
    use vllm_sim::{Engine, EngineConfig, EngineRequest, Profile, RequestEvent};

    let sim = start(&["--speed", "10"]).await;
    let c = HttpClient::new();
    let base = sim.url();
    let prompt: Vec<String> = (0..2000).map(|i| format!("p{i}")).collect();
    let prompt = prompt.join(" ");
    let max_tokens = 400;
    let tokens: Vec<u32> = json_body(
        &post(
            &c,
            &format!("{base}/tokenize"),
            json!({"prompt": prompt.clone()}),
        )
        .await,
    )["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(tokens.len(), 2000);

    // The same request in a bare engine with the same (default) profile: simulated timings.
    let mut engine = Engine::new(EngineConfig::new(Profile::llama8b_h100())).unwrap();
    engine
        .add_request(EngineRequest {
            id: 1,
            prompt_tokens: tokens,
            max_output_tokens: max_tokens,
            lora: None,
            cache_salt: None,
            arrival_s: 0.0,
        })
        .unwrap();
    let mut now = 0.0;
    let mut summary = None;
    while engine.has_work() {
        let out = engine.step(now);
        now = out.end_s;
        for ev in out.events {
            if let RequestEvent::Finished { summary: s, .. } = ev {
                summary = Some(s);
            }
        }
    }
    let summary = summary.expect("finished");
    let sim_e2e = summary.finished_s - summary.arrival_s;
    let sim_ttft = summary.first_token_s - summary.arrival_s;
    assert!(sim_e2e > 2.0, "a long enough run to time: {sim_e2e}");

    let started = std::time::Instant::now();
    let r = post(
        &c,
        &format!("{base}/v1/completions"),
        json!({"prompt": prompt, "max_tokens": max_tokens}),
    )
    .await;
    let wall = started.elapsed().as_secs_f64();
    assert_eq!(r.status, 200, "{}", r.body);
    // Ten simulated seconds per wall second: never faster, and far from real time.
    assert!(
        wall >= sim_e2e / 10.0 * 0.95,
        "wall {wall} for sim {sim_e2e}"
    );
    assert!(wall < sim_e2e / 10.0 + 1.0, "wall {wall} for sim {sim_e2e}");

    // The latency metrics are in wall seconds, as a real engine's are (a router learning rates
    // from them must see the same clock as its own timings): the engine's own timings over
    // the speed, up to a slip forward if a loaded machine stalled the driver by more than
    // 50 ms of wall time.
    let page = c.get(&format!("{base}/metrics"), T).await.unwrap().body;
    let l = "{model_name=\"sim-llama\",engine=\"0\"}";
    let e2e = sample(&page, &format!("vllm:e2e_request_latency_seconds_sum{l}"));
    let ttft = sample(&page, &format!("vllm:time_to_first_token_seconds_sum{l}"));
    let (wall_e2e, wall_ttft) = (sim_e2e / 10.0, sim_ttft / 10.0);
    assert!(
        e2e > 0.98 * wall_e2e && e2e < 1.5 * wall_e2e + 0.1,
        "e2e {e2e} vs {wall_e2e}"
    );
    assert!(
        ttft > 0.98 * wall_ttft - 0.01 && ttft < 1.5 * wall_ttft + 0.1,
        "ttft {ttft} vs {wall_ttft}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_real_tokenizer_and_chat_template_keep_chat_turns_cached() {
    let corpus = [
        "You are a terse assistant. Answer in one line.",
        "Explain how a prefix cache helps the next turn of a conversation.",
        "the of and to in is was that for on with as by at from it an be this are",
        "which or have not has but were had their one all been can more its new other",
        "Thanks! And how does the router pick a replica for each request?",
    ];
    // The model's own template comes from tokenizer_config.json, as in vLLM.
    let dir = vllm_sim::tokenizer::temp_chatml_model_dir("sim-tok", &corpus, 400).unwrap();
    let sim = start(&["--tokenizer", dir.to_str().unwrap()]).await;
    let c = HttpClient::new();
    let base = sim.url();

    let mut messages = vec![
        json!({"role": "system", "content": corpus[0]}),
        json!({"role": "user", "content": corpus[1].repeat(4)}),
    ];
    let render = |messages: &Vec<Value>| {
        let c = c.clone();
        let url = format!("{base}/v1/chat/completions/render");
        let body = json!({"messages": messages});
        async move {
            json_body(&post(&c, &url, body).await)["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect::<Vec<u64>>()
        }
    };
    let turn1 = render(&messages).await;
    assert_eq!(
        turn1[0], 0,
        "the template's bos_token is the special token <|endoftext|>"
    );

    // Streamed and whole answers are the same text.
    let ask = |messages: &Vec<Value>, stream: bool| {
        json!({"messages": messages, "max_tokens": 24, "stream": stream,
               "stream_options": {"include_usage": true}})
    };
    let url = format!("{base}/v1/chat/completions");
    let chunks = sse_chunks(&post(&c, &url, ask(&messages, true)).await.body);
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["prompt_tokens"].as_u64().unwrap() as usize,
        turn1.len()
    );
    let v = json_body(&post(&c, &url, ask(&messages, false)).await);
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(answer, streamed);
    assert_eq!(v["usage"]["completion_tokens"], 24);

    // Turn 2 carries the answer: turn 1's tokens are its prefix, and the cache covers turn 1
    // plus the answer's computed tokens.
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": corpus[4]}));
    let turn2 = render(&messages).await;
    assert_eq!(
        turn2[..turn1.len()],
        turn1[..],
        "turn 1 is a token prefix of turn 2"
    );
    let v = json_body(&post(&c, &url, ask(&messages, false)).await);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (turn1.len() as u64 + 23) / 16 * 16);

    // token_strs are vocabulary strings (byte-level BPE's "Ġ" for a space).
    let tok = json_body(
        &post(
            &c,
            &format!("{base}/tokenize"),
            json!({"prompt": "Thanks!", "return_token_strs": true}),
        )
        .await,
    );
    assert!(tok["token_strs"][0].as_str().unwrap().starts_with("Th"));
    sim.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();

    // An inline --chat-template; one that rejects the conversation gives a 400, as in vLLM.
    let sim = start(&[
        "--chat-template",
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}\
         {{ messages[0]['content'] }}",
    ])
    .await;
    let url = format!("{}/v1/chat/completions", sim.url());
    let r = post(&c, &url, chat("hi", 1, false)).await;
    assert_eq!(r.status, 400);
    assert!(error_message(&r).contains("user first"), "{}", r.body);
    let user_first = json!({"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 1});
    let v = json_body(&post(&c, &url, user_first).await);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    sim.shutdown().await;

    // Unusable files are startup errors that name the file.
    for bad in [
        ["--tokenizer", "/nonexistent/tokenizer.json"],
        ["--chat-template", "/nonexistent/template"],
    ] {
        let mut argv = vec!["vllm-sim", "--port", "0"];
        argv.extend_from_slice(&bad);
        let err = server::start(SimArgs::try_parse_from(argv).unwrap())
            .await
            .err()
            .expect("startup fails");
        assert!(err.to_string().contains("/nonexistent"), "{err}");
    }
}

#[tokio::test]
async fn reset_prefix_cache_fails_while_blocks_are_held_like_vllm() {
    let sim = start(&["--speed", "1"]).await;
    let c = HttpClient::new();
    let base = sim.url();
    let running = {
        let c = c.clone();
        let url = format!("{base}/v1/completions");
        tokio::spawn(async move {
            let body = json!({"prompt": "a long story", "max_tokens": 60});
            c.post_json(&url, &body, T).await
        })
    };
    let deadline = tokio::time::Instant::now() + T;
    while json_body(&c.get(&format!("{base}/sim/stats"), T).await.unwrap())["engine"]["num_running"]
        != 1
    {
        assert!(tokio::time::Instant::now() < deadline, "request never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let reset = format!("{base}/reset_prefix_cache");
    let r = post(&c, &reset, json!({})).await;
    assert_eq!(
        json_body(&r),
        json!({"success": false}),
        "a running request holds blocks"
    );
    let r = post(
        &c,
        &format!("{reset}?reset_running_requests=maybe"),
        json!({}),
    )
    .await;
    assert_eq!(r.status, 422);
    let r = post(
        &c,
        &format!("{reset}?reset_running_requests=true"),
        json!({}),
    )
    .await;
    assert_eq!(json_body(&r), json!({"success": true}));
    // The preempted request recomputes and still returns every token.
    let done = running.await.unwrap().expect("answered");
    assert_eq!(json_body(&done)["usage"]["completion_tokens"], 60);
    let stats = json_body(&c.get(&format!("{base}/sim/stats"), T).await.unwrap());
    assert_eq!(stats["engine"]["num_preemptions"], 1);
    sim.shutdown().await;
}

async fn set_fault(c: &HttpClient, base: &str, fault: Value) {
    let r = post(c, &format!("{base}/sim/fault"), fault).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The replay buffer's batches as `(seq, batch)`, once `done` holds on them (polled: a batch
/// reaches the buffer a little after its request is answered).
async fn replayed_until(
    replay: &str,
    done: impl Fn(&[(u64, WireBatch)]) -> bool,
) -> Vec<(u64, WireBatch)> {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let batches: Vec<(u64, WireBatch)> = replay_from_zero(replay)
            .await
            .iter()
            .map(|f| {
                (
                    u64::from_be_bytes(f[2].as_ref().try_into().unwrap()),
                    decode(&f[3]),
                )
            })
            .collect();
        if done(&batches) {
            return batches;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replay buffer never got there: {:?}",
            batches.iter().map(|b| b.0).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `lora_name` of the last store in `batches`.
fn last_stored_lora(batches: &[(u64, WireBatch)]) -> Option<Option<String>> {
    batches
        .iter()
        .rev()
        .flat_map(|(_, b)| b.events.iter().rev())
        .find_map(|e| match e {
            WireEvent::BlockStored(s) => Some(s.lora_name.clone()),
            _ => None,
        })
}

// The faults issue #18's self-check tests misconfigure one replica with, each set and cleared
// at run time: KV-event batches lost outright (not even kept for replay), an adapter the
// engine knows by an alias, and chat served with another template than `/tokenize` renders.
#[tokio::test]
async fn self_check_faults_lose_batches_alias_adapters_and_change_the_chat_template() {
    let sim = start(&[
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
        "--lora-modules",
        "sql=/adapters/sql",
    ])
    .await;
    let replay = sim
        .kv_events_replay_endpoint
        .clone()
        .expect("replay endpoint");
    let c = HttpClient::new();
    let base = sim.url();
    let completions = format!("{base}/v1/completions");
    // Sends completion `i` (40 words of its own) to `model` and asserts it was served: each
    // fault is watched through the KV-event batches of a few such requests.
    let complete = async |model: &str, i: u32| {
        let words: Vec<String> = (0..40).map(|k| format!("w{i}x{k}")).collect();
        let body = json!({"model": model, "prompt": words.join(" "), "max_tokens": 1});
        assert_eq!(post(&c, &completions, body).await.status, 200);
    };

    // One batch in two lost: the replay buffer holds only the even sequence numbers.
    set_fault(&c, &base, json!({"lose_kv_batch_every": 2})).await;
    for i in 0..6 {
        complete("sim-llama", i).await;
    }
    let batches = replayed_until(&replay, |b| b.len() >= 3).await;
    let seqs: Vec<u64> = batches.iter().map(|b| b.0).collect();
    assert!(seqs.iter().all(|s| s % 2 == 0), "{seqs:?}");
    // Cleared: every batch kept again.
    set_fault(&c, &base, json!({"lose_kv_batch_every": 0})).await;
    let last = *seqs.last().unwrap();
    for i in 6..8 {
        complete("sim-llama", i).await;
    }
    let batches = replayed_until(&replay, |b| b.len() >= seqs.len() + 2).await;
    let tail: Vec<u64> = batches.iter().map(|b| b.0).skip(seqs.len()).collect();
    assert!(
        tail.windows(2).all(|w| w[1] == w[0] + 1) && tail[0] > last,
        "{tail:?}"
    );

    // The adapter known by an alias: its blocks are stored under `sql-alias`, then, with the
    // fault cleared, under `sql`.
    let mut seen = batches.len();
    for (alias, i, stored) in [(true, 100, "sql-alias"), (false, 101, "sql")] {
        set_fault(&c, &base, json!({"lora_alias": alias})).await;
        complete("sql", i).await;
        let batches = replayed_until(&replay, |b| b.len() > seen).await;
        assert_eq!(
            last_stored_lora(&batches),
            Some(Some(stored.into())),
            "lora_alias {alias}"
        );
        seen = batches.len();
    }

    // Another chat template: generation prepends its default system message; `/tokenize`
    // (the render path a router tokenises through) keeps the pool's template.
    let chat_url = format!("{base}/v1/chat/completions");
    let tokenize = |body: Value| {
        let (c, url) = (&c, format!("{base}/tokenize"));
        async move {
            json_body(&post(c, &url, body).await)["count"]
                .as_u64()
                .unwrap()
        }
    };
    let messages = json!({"model": "sim-llama", "messages": chat("hi", 1, false)["messages"]});
    let prompt_tokens = |r: HttpResponse| json_body(&r)["usage"]["prompt_tokens"].as_u64().unwrap();
    let plain = prompt_tokens(post(&c, &chat_url, chat("hi", 1, false)).await);
    let rendered = tokenize(messages.clone()).await;
    set_fault(&c, &base, json!({"other_chat_template": true})).await;
    let other = prompt_tokens(post(&c, &chat_url, chat("hi", 1, false)).await);
    let preamble = tokenize(json!({
        "model": "sim-llama",
        "prompt": server::OTHER_TEMPLATE_PREAMBLE,
        "add_special_tokens": false
    }))
    .await;
    assert!(preamble > 0);
    assert_eq!(other, plain + preamble);
    assert_eq!(tokenize(messages.clone()).await, rendered);
    set_fault(&c, &base, json!({"other_chat_template": false})).await;
    assert_eq!(
        prompt_tokens(post(&c, &chat_url, chat("hi", 1, false)).await),
        plain
    );
    sim.shutdown().await;
}
