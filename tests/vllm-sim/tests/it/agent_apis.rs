//! The agent APIs of a live vllm-sim, as vLLM 0.33 answers them: the OpenAI Responses API
//! (chains through `previous_response_id`, the store, GET, cancel, background mode, the event
//! stream), Anthropic's Messages API (tools, tool results, count_tokens, the event stream,
//! errors), and what the server answers on the paths a generative vLLM does not mount.
//! Servers run in-process on OS-picked ports; every wait has a timeout.

use std::time::Duration;

use crate::common::{MODEL, T, json_body, replay_from_zero, run_binary, spawn_binary, start};
use kvroute_harness::{HttpClient, HttpResponse};
use serde_json::{Value, json};
use vllm_sim::server::SimServer;
use vllm_wire::kv_events::{WireEvent, decode_batch};

async fn call(c: &HttpClient, method: &str, url: &str, body: Option<Value>) -> HttpResponse {
    let headers = [("content-type", "application/json")];
    c.request(method, url, &headers, body.map(|b| b.to_string()), T)
        .await
        .expect("response")
}

async fn post(c: &HttpClient, url: &str, body: Value) -> HttpResponse {
    call(c, "POST", url, Some(body)).await
}

/// The `(event, data)` pairs of an SSE body framed `event: <type>\ndata: <json>\n\n`.
fn sse_events(r: &HttpResponse) -> Vec<(String, Value)> {
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    r.body
        .split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| {
            let (event, data) = f.split_once('\n').unwrap_or_else(|| panic!("frame {f:?}"));
            let event = event.strip_prefix("event: ").expect("event line");
            let data = data.strip_prefix("data: ").expect("data line");
            (
                event.to_owned(),
                serde_json::from_str(data).expect("data is json"),
            )
        })
        .collect()
}

/// The event names of `events` in order, and how many of them are `delta`: both stream tests
/// compare the order with vLLM's around however many deltas the answer took.
fn names_and_deltas<'a>(events: &'a [(String, Value)], delta: &str) -> (Vec<&'a str>, usize) {
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    let deltas = names.iter().filter(|n| **n == delta).count();
    (names, deltas)
}

fn is_hex_id(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix)
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn cached(resp: &Value) -> u64 {
    resp["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

/// The value of metric `name` for the served model, from `/metrics`.
async fn metric(c: &HttpClient, base: &str, name: &str) -> f64 {
    let page = c.get(&format!("{base}/metrics"), T).await.unwrap().body;
    let series = format!("{name}{{model_name=\"{MODEL}\",engine=\"0\"}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("{name} missing"))
        .parse()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Responses

/// A simulator started with `args`, a client and its `/v1/responses` URL: what most Responses
/// tests open with.
async fn start_responses(args: &[&str]) -> (SimServer, HttpClient, String) {
    let sim = start(args).await;
    let url = format!("{}/v1/responses", sim.url());
    (sim, HttpClient::new(), url)
}

#[tokio::test]
async fn a_three_turn_responses_chain_reads_its_prefix_from_the_cache() {
    let (sim, c, url) = start_responses(&[
        "--enable-responses-store",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
    ])
    .await;
    let first = json!({"model": MODEL, "instructions": "You are terse.",
                       "input": words("task", 120), "max_output_tokens": 6});
    let rendered = json_body(&post(&c, &format!("{url}/render"), first.clone()).await);
    let r = post(&c, &url, first).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let one = json_body(&r);
    let keys: Vec<&String> = one.as_object().unwrap().keys().collect();
    assert_eq!(keys[0], "id", "the id is the first key");
    assert!(
        is_hex_id(one["id"].as_str().unwrap(), "resp_"),
        "{}",
        one["id"]
    );
    assert_eq!(one["object"], "response");
    assert_eq!(one["model"], MODEL);
    assert_eq!(
        one["status"], "incomplete",
        "the simulated model stops at its limit"
    );
    assert_eq!(
        one["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(one["max_output_tokens"], 6);
    assert_eq!(one["instructions"], "You are terse.");
    assert_eq!(one["tool_choice"], "none");
    let item = &one["output"][0];
    assert!(is_hex_id(item["id"].as_str().unwrap(), "msg_"));
    assert_eq!(
        (&item["type"], &item["role"], &item["status"]),
        (&json!("message"), &json!("assistant"), &json!("incomplete"))
    );
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["annotations"], json!([]));
    let usage = &one["usage"];
    let prompt = rendered["token_ids"].as_array().unwrap().len() as u64;
    assert_eq!(usage["input_tokens"], prompt);
    assert_eq!(usage["output_tokens"], 6);
    assert_eq!(usage["total_tokens"], prompt + 6);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    assert_eq!(cached(&one), 0);
    assert_eq!(
        usage["input_tokens_details"]["cache_write_tokens"],
        prompt / 16 * 16
    );

    // Turn 2 (streamed) and 3 send only the new input: the replica renders the rest.
    let mut previous = one["id"].as_str().unwrap().to_owned();
    let mut hits = vec![];
    for (turn, stream) in [(2, true), (3, false)] {
        let body = json!({"model": MODEL, "instructions": "You are terse.",
                          "input": words(&format!("tool{turn}x"), 30), "max_output_tokens": 6,
                          "previous_response_id": previous, "stream": stream});
        let r = post(&c, &url, body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let resp = if stream {
            let events = sse_events(&r);
            events.last().unwrap().1["response"].clone()
        } else {
            json_body(&r)
        };
        assert_eq!(resp["previous_response_id"], previous.as_str());
        hits.push(cached(&resp));
        previous = resp["id"].as_str().unwrap().to_owned();
    }
    assert!(
        hits[0] > 0 && hits[1] > hits[0],
        "cached tokens rise: {hits:?}"
    );
    assert!(
        hits[0] >= prompt / 16 * 16,
        "turn 2 reads all of turn 1's full blocks"
    );

    // The same engine: vLLM's counters and histograms moved, the blocks were published.
    let base = sim.url();
    assert_eq!(
        metric(&c, &base, "vllm:generation_tokens_total").await,
        18.0
    );
    assert!(
        metric(&c, &base, "vllm:prefix_cache_hits_total").await >= hits.iter().sum::<u64>() as f64
    );
    assert_eq!(
        metric(&c, &base, "vllm:time_to_first_token_seconds_count").await,
        3.0
    );
    let stored = replay_stored_tokens(sim.kv_events_replay_endpoint.as_deref().unwrap()).await;
    let first_block: Vec<u32> = rendered["token_ids"].as_array().unwrap()[..16]
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert!(
        stored.iter().any(|t| t.starts_with(&first_block)),
        "the first turn's prompt blocks were published"
    );
    sim.shutdown().await;
}

/// The token ids of every `BlockStored` event, replayed from sequence 0.
async fn replay_stored_tokens(replay: &str) -> Vec<Vec<u32>> {
    let mut stored = Vec::new();
    for f in replay_from_zero(replay).await {
        for ev in decode_batch(&f[3]).unwrap().events {
            if let WireEvent::BlockStored(s) = ev {
                stored.push(s.token_ids);
            }
        }
    }
    stored
}

#[tokio::test]
async fn an_unknown_previous_response_id_is_vllms_404() {
    let (sim, c, url) = start_responses(&["--enable-responses-store"]).await;
    let r = post(
        &c,
        &url,
        json!({"model": MODEL, "input": "hi", "previous_response_id": "resp_0123456789abcdef"}),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(
        json_body(&r),
        json!({"error": {"message": "Response with id 'resp_0123456789abcdef' not found.",
                         "type": "invalid_request_error", "param": "response_id", "code": 404}})
    );
    assert!(
        r.body.starts_with(r#"{"error":{"message":"#),
        "field order: {}",
        r.body
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn with_the_store_off_even_a_returned_id_is_unknown() {
    if std::env::var(vllm_sim::server::responses::STORE_ENV).is_ok() {
        eprintln!("skipped: the environment turns the store on");
        return;
    }
    let (sim, c, url) = start_responses(&[]).await;
    let r = post(
        &c,
        &url,
        json!({"model": MODEL, "input": "hi", "store": true}),
    )
    .await;
    assert_eq!(r.status, 200, "store=true is silently ignored: {}", r.body);
    let id = json_body(&r)["id"].as_str().unwrap().to_owned();
    let next = json!({"model": MODEL, "input": "more", "previous_response_id": id});
    let r = post(&c, &url, next).await;
    assert_eq!(r.status, 404);
    assert_eq!(
        json_body(&r)["error"]["message"],
        format!("Response with id '{id}' not found.")
    );
    let r = call(&c, "GET", &format!("{url}/{id}"), None).await;
    assert_eq!(r.status, 404);
    let r = post(
        &c,
        &url,
        json!({"model": MODEL, "input": "x", "background": true}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(json_body(&r)["error"]["param"], "background");
    sim.shutdown().await;
}

#[tokio::test]
async fn get_and_cancel_follow_vllm() {
    let (sim, c, url) = start_responses(&["--enable-responses-store"]).await;
    let r = post(
        &c,
        &url,
        json!({"model": MODEL, "input": "hello", "max_output_tokens": 3}),
    )
    .await;
    let done = json_body(&r);
    let id = done["id"].as_str().unwrap();
    let got = call(&c, "GET", &format!("{url}/{id}"), None).await;
    assert_eq!(got.status, 200);
    assert_eq!(json_body(&got), done, "GET answers the stored response");
    let cancel = post(&c, &format!("{url}/{id}/cancel"), json!({})).await;
    assert_eq!(
        cancel.status, 400,
        "a finished response cannot be cancelled"
    );
    assert_eq!(
        json_body(&cancel),
        json!({"error": {"message": "Cannot cancel a synchronous response.",
                         "type": "invalid_request_error", "param": "response_id", "code": 400}})
    );
    let r = post(&c, &format!("{url}/resp_nope/cancel"), json!({})).await;
    assert_eq!(r.status, 404);
    // A stream of a response with no event log: 200, then the body breaks off, as in vLLM.
    let broken = c
        .request("GET", &format!("{url}/{id}?stream=true"), &[], None, T)
        .await;
    assert!(broken.is_err() || broken.unwrap().body.is_empty());

    // Background: answered `queued` at once, cancelled while it runs.
    let bg = json!({"model": MODEL, "input": words("bg", 50), "max_output_tokens": 2000,
                    "background": true});
    let r = post(&c, &url, bg).await;
    let queued = json_body(&r);
    assert_eq!(queued["status"], "queued");
    assert_eq!(queued["background"], true);
    let id = queued["id"].as_str().unwrap();
    let cancelled = json_body(&post(&c, &format!("{url}/{id}/cancel"), json!({})).await);
    assert_eq!(cancelled["status"], "cancelled");
    assert_eq!(
        json_body(&call(&c, "GET", &format!("{url}/{id}"), None).await)["status"],
        "cancelled"
    );

    // Background to completion: GET shows it queued, then finished with usage.
    let bg = json!({"model": MODEL, "input": "short", "max_output_tokens": 2, "background": true});
    let id = json_body(&post(&c, &url, bg).await)["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let deadline = tokio::time::Instant::now() + T;
    let finished = loop {
        let now = json_body(&call(&c, "GET", &format!("{url}/{id}"), None).await);
        if now["status"] != "queued" {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "background response finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(finished["status"], "incomplete");
    assert_eq!(finished["usage"]["output_tokens"], 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_streamed_response_sends_vllms_events_in_order() {
    let (sim, c, url) = start_responses(&["--enable-responses-store"]).await;
    let body = json!({"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "stream this"}]}
    ], "max_output_tokens": 5, "stream": true});
    let r = post(&c, &url, body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r);
    let (names, deltas) = names_and_deltas(&events, "response.output_text.delta");
    assert!(deltas >= 1);
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(names, want);
    for (i, (event, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], event.as_str());
        assert_eq!(data["sequence_number"], i, "{event}");
    }
    let created = &events[0].1["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["usage"], Value::Null);
    let id = created["id"].as_str().unwrap();
    assert!(is_hex_id(id, "resp_"));
    let text: String = events
        .iter()
        .filter(|(e, _)| e == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    let done = &events[names.len() - 4].1;
    assert_eq!(done["text"], text.as_str());
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["id"], id);
    assert_eq!(last["status"], "incomplete");
    assert_eq!(last["usage"]["output_tokens"], 5);
    assert_eq!(last["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(last["output"][0]["id"], events[2].1["item"]["id"]);
    // Streamed answers are stored too.
    let got = json_body(&call(&c, "GET", &format!("{url}/{id}"), None).await);
    assert_eq!(&got, last);

    // A background stream: the same events, also readable again with GET ?stream=true.
    let bg = json!({"model": MODEL, "input": "again", "max_output_tokens": 3, "stream": true,
                    "background": true});
    let r = post(&c, &url, bg).await;
    let events = sse_events(&r);
    assert_eq!(events.last().unwrap().0, "response.incomplete");
    let id = events[0].1["response"]["id"].as_str().unwrap();
    let again = call(
        &c,
        "GET",
        &format!("{url}/{id}?stream=true&starting_after=1"),
        None,
    )
    .await;
    let replayed = sse_events(&again);
    assert_eq!(replayed.len(), events.len() - 2);
    assert_eq!(replayed[0].1["sequence_number"], 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn responses_requests_vllm_refuses() {
    let (sim, c, url) = start_responses(&["--max-model-len", "512"]).await;
    let r = post(&c, &url, json!({"model": MODEL})).await;
    assert_eq!(r.status, 400);
    let e = json_body(&r)["error"].clone();
    assert_eq!(
        (&e["type"], &e["param"]),
        (&json!("Bad Request"), &json!("body.input"))
    );
    let r = post(&c, &url, json!({"model": "other", "input": "x"})).await;
    assert_eq!(r.status, 404);
    assert_eq!(
        json_body(&r)["error"]["message"],
        "The model `other` does not exist. Valid aliases: sim-llama."
    );
    let image = json!({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]});
    let r = post(&c, &url, image).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        json_body(&r)["error"]["message"],
        "sim-llama is not a multimodal model"
    );
    let r = post(
        &c,
        &url,
        json!({"input": [{"type": "item_reference", "id": "x"}]}),
    )
    .await;
    assert_eq!(
        json_body(&r)["error"]["message"],
        "Unsupported input item type: item_reference (parameter=input)"
    );
    let r = post(&c, &url, json!({"input": words("w", 600)})).await;
    assert_eq!(r.status, 400);
    assert_eq!(json_body(&r)["error"]["param"], "input");
    let r = post(
        &c,
        &format!("{url}/render"),
        json!({"input": "x", "previous_response_id": "r"}),
    )
    .await;
    assert_eq!(json_body(&r)["error"]["param"], "previous_response_id");
    sim.shutdown().await;
}

#[tokio::test]
async fn the_store_follows_vllms_environment_variable() {
    let (mut child, base) = spawn_binary(
        &["--model", MODEL, "--profile", "fast"],
        &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")],
    )
    .await;
    let c = HttpClient::new();
    let url = format!("{base}/v1/responses");
    let one = json_body(&post(&c, &url, json!({"input": "a b c", "max_output_tokens": 2})).await);
    let next = json!({"input": "d", "max_output_tokens": 2, "previous_response_id": one["id"]});
    assert_eq!(post(&c, &url, next).await.status, 200);
    child.start_kill().unwrap();
    let _ = tokio::time::timeout(T, child.wait()).await;

    let bad = run_binary(
        &["--port", "0"],
        &[("VLLM_ENABLE_RESPONSES_API_STORE", "yes")],
    )
    .await;
    assert!(
        !bad.status.success(),
        "int('yes') fails, so vLLM does not start"
    );
    assert!(String::from_utf8_lossy(&bad.stderr).contains("VLLM_ENABLE_RESPONSES_API_STORE"));
}

// ---------------------------------------------------------------------------------------------
// Messages

fn tools() -> Value {
    json!([{"name": "read_file", "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}])
}

#[tokio::test]
async fn a_messages_conversation_with_tool_results_reads_more_from_the_cache_each_turn() {
    let sim = start(&[]).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/messages", sim.url());
    let mut messages = vec![json!({"role": "user", "content": words("task", 100)})];
    let mut reads = Vec::new();
    for turn in 0..3 {
        let body = json!({"model": MODEL, "max_tokens": 6, "system": "You read files.",
                          "tools": tools(), "messages": messages, "metadata": {"user_id": "u"}});
        let counted = json_body(&post(&c, &format!("{url}/count_tokens"), body.clone()).await);
        let r = post(&c, &url, body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let m = json_body(&r);
        let keys: Vec<&String> = m.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "id",
                "type",
                "role",
                "content",
                "model",
                "stop_reason",
                "usage"
            ]
        );
        assert!(m["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(
            (&m["type"], &m["role"]),
            (&json!("message"), &json!("assistant"))
        );
        assert_eq!(m["stop_reason"], "max_tokens");
        let u = &m["usage"];
        let parts = [
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
        ];
        let total: u64 = parts.iter().map(|k| u[k].as_u64().unwrap()).sum();
        assert_eq!(
            total,
            counted["input_tokens"].as_u64().unwrap(),
            "turn {turn}: {u}"
        );
        assert_eq!(
            counted["context_management"]["original_input_tokens"],
            counted["input_tokens"]
        );
        assert_eq!(u["output_tokens"], 6);
        reads.push(u["cache_read_input_tokens"].as_u64().unwrap());
        let text = m["content"][0]["text"].as_str().unwrap().to_owned();
        messages.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": text},
            {"type": "tool_use", "id": format!("toolu_{turn}"), "name": "read_file",
             "input": {"path": format!("f{turn}.txt")}}]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{turn}"),
             "content": words(&format!("out{turn}x"), 20)}]}));
    }
    assert_eq!(reads[0], 0);
    assert!(
        reads[1] > 0 && reads[2] > reads[1],
        "cache reads rise: {reads:?}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_streamed_message_sends_anthropics_events_as_vllm_does() {
    let sim = start(&[]).await;
    let c = HttpClient::new();
    let body = json!({"model": MODEL, "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": "stream please"}]});
    let r = post(&c, &format!("{}/v1/messages", sim.url()), body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r);
    let (names, deltas) = names_and_deltas(&events, "content_block_delta");
    let mut want = vec!["message_start", "content_block_start"];
    want.extend(std::iter::repeat_n("content_block_delta", deltas));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want);
    for (event, data) in &events {
        assert_eq!(data["type"], event.as_str());
    }
    let start = &events[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    let prompt = start["usage"]["input_tokens"].as_u64().unwrap();
    assert_eq!(
        start["usage"],
        json!({"input_tokens": prompt, "output_tokens": 0})
    );
    assert_eq!(
        events[1].1,
        json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""},
               "index": 0})
    );
    assert_eq!(events[2].1["delta"]["type"], "text_delta");
    let end = &events[names.len() - 2].1;
    assert_eq!(
        end["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    assert_eq!(end["usage"]["output_tokens"], 4);
    assert!(end["usage"].get("cache_read_input_tokens").is_some());
    assert_eq!(events.last().unwrap().1, json!({"type": "message_stop"}));
    sim.shutdown().await;
}

#[tokio::test]
async fn messages_errors_take_vllms_shapes() {
    let sim = start(&[]).await;
    let c = HttpClient::new();
    let url = format!("{}/v1/messages", sim.url());
    // Validation (FastAPI, before the handler): vLLM's OpenAI shape.
    let r = post(&c, &url, json!({"model": MODEL, "messages": []})).await;
    assert_eq!(r.status, 400);
    let e = &json_body(&r)["error"];
    assert_eq!(e["type"], "Bad Request");
    assert_eq!(e["param"], "body.max_tokens");
    assert_eq!(
        e["message"],
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', \
         'msg': 'Field required', 'input': '<dict of 2 items>'}"
    );
    // The handler's errors: Anthropic's shape.
    let r = post(
        &c,
        &url,
        json!({"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(
        json_body(&r),
        json!({"type": "error", "error": {"type": "not_found_error",
               "message": "The model `nope` does not exist. Valid aliases: sim-llama."}})
    );
    let image = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    ]}]});
    let r = post(&c, &url, image).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        json_body(&r)["error"],
        json!({"type": "invalid_request_error", "message": "sim-llama is not a multimodal model"})
    );
    sim.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Other paths

#[tokio::test]
async fn paths_a_generative_vllm_does_not_mount_are_404_and_detokenize_works() {
    let dir = vllm_sim::tokenizer::temp_chatml_model_dir(
        "sim-agent",
        &[
            "hello world, the cache keeps the prefix",
            "of every request so routing works",
        ],
        400,
    )
    .unwrap();
    let sim = start(&["--tokenizer", dir.to_str().unwrap()]).await;
    let c = HttpClient::new();
    let base = sim.url();
    // Every path the filter routes by load is a pooling or scoring API (vLLM mounts none of
    // them for a generative model) except Messages' token count, which it serves; the audio
    // APIs are not mounted either.
    let unmounted = kvroute_filter::config::LOAD_PATHS
        .into_iter()
        .filter(|p| *p != "/v1/messages/count_tokens")
        .chain(["/v1/audio/transcriptions", "/v1/audio/translations"]);
    for path in unmounted {
        let r = post(
            &c,
            &format!("{base}{path}"),
            json!({"model": MODEL, "input": "x"}),
        )
        .await;
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(json_body(&r), json!({"detail": "Not Found"}), "{path}");
    }
    let text = "<|im_start|>hello world<|im_end|>";
    let tokens = json_body(&post(&c, &format!("{base}/tokenize"), json!({"prompt": text})).await);
    let r = post(
        &c,
        &format!("{base}/detokenize"),
        json!({"tokens": tokens["tokens"]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        json_body(&r),
        json!({"prompt": text}),
        "special tokens are kept"
    );
    let r = post(&c, &format!("{base}/detokenize"), json!({"model": MODEL})).await;
    assert_eq!(r.status, 400);
    assert_eq!(json_body(&r)["error"]["param"], "body.tokens");
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
