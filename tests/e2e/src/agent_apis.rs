//! The agent APIs end to end, through a real Envoy, the wasm filter, the control plane and
//! `vllm-sim` replicas that keep vLLM's per-process response store
//! (`VLLM_ENABLE_RESPONSES_API_STORE=1`):
//! - a Responses chain that sends only `previous_response_id` reaches the replica holding the
//!   previous response on every turn (and breaks under round robin);
//! - `GET /v1/responses/{id}` and `cancel` reach it too; when it is gone the answer is vLLM's
//!   own 404;
//! - an Anthropic Messages conversation with tools stays on its replica, cached tokens rising;
//! - a session header pins across chat, Responses and Messages;
//! - a prefix marked with `cache_control` stays on its holder under a load that moves an
//!   unmarked one;
//! - every other path vLLM serves answers through Envoy as the replica answers it directly.
//!
//! Each runs in both forms ([`Form`]): the wasm filter, and the control plane as Envoy's
//! Endpoint Picker.

use std::time::Duration;

use kvroute_harness::{Fleet, HttpClient, HttpResponse, RouterKind, Tools};
use serde_json::{Value, json};

use kvroute_demo::agent::{self, AgentConfig, Streamed};

use crate::common::{self, Form, both_forms, tools};

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(240);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
pub const MODEL: &str = "agent-model";
/// Turns of each conversation.
const TURNS: usize = 10;

/// Four replicas that store responses; `router` decides the topology, `form` kvroute's form.
pub async fn start(
    tools: &Tools,
    name: &str,
    router: RouterKind,
    session_bonus: bool,
    form: Form,
) -> Fleet {
    let mut cfg = common::fleet_config(name, 4, MODEL);
    cfg.router = router;
    form.apply(&mut cfg);
    cfg.sim_args = vec!["--enable-responses-store".into()];
    cfg.plugin_config = json!({"allow_explain": true});
    if session_bonus {
        cfg.control_plane_router = json!({"sessions": {"bonus_ms": 5000.0}});
    }
    common::start_fleet(cfg, tools).await
}

both_forms!(
    a_responses_chain_reaches_its_stored_responses_and_breaks_under_round_robin,
    a_messages_conversation_with_tools_stays_where_its_prefix_is_cached,
    a_session_header_pins_across_chat_responses_and_messages,
    a_marked_prefix_stays_on_its_holder_under_a_load_that_moves_an_unmarked_one,
    every_other_vllm_path_answers_through_envoy_as_the_replica_does,
);

async fn send(
    client: &HttpClient,
    fleet: &Fleet,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> HttpResponse {
    let url = format!("{}{path}", fleet.url());
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let body = body.map(Value::to_string);
    common::request(client, method, &url, &all, body, REQUEST_TIMEOUT, fleet).await
}

/// [`send`] of a POST with no headers of its own: most of these tests' requests.
async fn post(client: &HttpClient, fleet: &Fleet, path: &str, body: &Value) -> HttpResponse {
    send(client, fleet, "POST", path, Some(body), &[]).await
}

/// The frame of the tests on one kvroute fleet: the fleet ([`start`]ed in `form` called
/// `name`, with the session bonus or not), a client, and `body` on them within
/// [`TEST_TIMEOUT`].
async fn kvroute_test(
    name: &str,
    session_bonus: bool,
    form: Form,
    body: impl AsyncFnOnce(&mut Fleet, &HttpClient),
) {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let mut fleet = start(&tools, name, RouterKind::Kvroute, session_bonus, form).await;
        body(&mut fleet, &HttpClient::new()).await;
    })
    .await;
}

fn json_body(resp: &HttpResponse) -> Value {
    serde_json::from_str(&resp.body).unwrap_or_else(|e| panic!("{e}: {}", resp.body))
}

/// One agent's chain: a long task, then short tool outputs linked only by
/// `previous_response_id`; odd turns stream. Returns the replica of each turn, its cached
/// tokens, the attempts answered 404 and the last response id.
pub async fn run_chain(
    client: &HttpClient,
    fleet: &Fleet,
    proxies: &[String],
    think_time: Duration,
) -> (Vec<String>, Vec<u64>, usize, String) {
    let cfg = AgentConfig {
        model: MODEL.into(),
        agents: 1,
        turns: TURNS,
        task_words: 400,
        tool_output_words: 12,
        max_output_tokens: 8,
        streamed: Streamed::Odd,
        think_time,
        stagger: Duration::ZERO,
        max_attempts: 8,
        seed: 71,
        request_timeout: REQUEST_TIMEOUT,
    };
    let records = agent::run_chain(client, proxies, &cfg, 0).await;
    for r in &records {
        assert!(
            r.error.is_none(),
            "turn {}: {:?} ({})",
            r.turn,
            r.error,
            fleet.describe()
        );
    }
    assert_eq!(records.len(), TURNS);
    let replicas = records.iter().filter_map(|r| r.replica.clone()).collect();
    let cached = records.iter().map(|r| r.cached_tokens).collect();
    let failures = records.iter().map(|r| r.failed_attempts).sum();
    let last = records
        .last()
        .and_then(|r| r.response_id.clone())
        .unwrap_or_default();
    (replicas, cached, failures, last)
}

/// A turn continuing `previous`, sent by hand.
fn next_turn(previous: &str) -> Value {
    json!({"model": MODEL, "input": "tool output: done", "max_output_tokens": 4,
           "previous_response_id": previous})
}

async fn a_responses_chain_reaches_its_stored_responses_and_breaks_under_round_robin(form: Form) {
    kvroute_test("e2e-responses", false, form, async |fleet, client| {
        let (replicas, cached, failures, last) =
            run_chain(client, fleet, &[fleet.url()], Duration::ZERO).await;
        println!("kvroute: replicas {replicas:?}, cached {cached:?}, failed attempts {failures}");
        assert_eq!(
            failures,
            0,
            "every turn found its response ({})",
            fleet.describe()
        );
        assert!(replicas.iter().all(|r| r == &replicas[0]), "{replicas:?}");
        assert!(cached[1..].iter().all(|&c| c > 0), "{cached:?}");
        assert!(
            cached.windows(2).skip(1).all(|w| w[1] >= w[0]),
            "{cached:?}"
        );

        // Reading it back and cancelling it reach the same replica: GET answers the stored
        // response; cancel answers what vLLM answers for a finished one (400 "Cannot cancel a
        // synchronous response.", not a 404).
        let path = format!("/v1/responses/{last}");
        let got = send(client, fleet, "GET", &path, None, &[]).await;
        assert_eq!(got.status, 200, "{}", got.body);
        assert_eq!(json_body(&got)["id"], json!(last));
        assert_eq!(common::replica_header(&got), replicas[0]);
        let cancel = send(client, fleet, "POST", &format!("{path}/cancel"), None, &[]).await;
        assert_eq!(common::replica_header(&cancel), replicas[0]);
        assert_eq!(cancel.status, 400, "{}", cancel.body);
        // A background response is still running when the cancel reaches its replica.
        let background = json!({"model": MODEL, "input": common::words(9, 50),
                                "max_output_tokens": 500, "background": true});
        let queued = post(client, fleet, "/v1/responses", &background).await;
        assert_eq!(queued.status, 200, "{}", queued.body);
        let id = json_body(&queued)["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let path = format!("/v1/responses/{id}/cancel");
        let cancelled = send(client, fleet, "POST", &path, None, &[]).await;
        assert_eq!(cancelled.status, 200, "{}", cancelled.body);
        assert_eq!(json_body(&cancelled)["status"], "cancelled");
        assert_eq!(
            common::replica_header(&cancelled),
            common::replica_header(&queued)
        );

        // Its replica gone: vLLM's own 404 from a live replica, never another's answer.
        fleet.stop_replica(&replicas[0]);
        let gone = replicas[0].clone();
        common::wait_cp_metrics(fleet, "the replica marked down", TEST_TIMEOUT, |text| {
            kvroute_harness::prometheus_sample(
                text,
                &format!("kvroute_endpoint_up{{endpoint=\"{gone}\"}}"),
            ) == Some(0.0)
        })
        .await;
        let next = next_turn(&last);
        let resp = post(client, fleet, "/v1/responses", &next).await;
        assert_eq!(resp.status, 404, "{}", resp.body);
        assert_eq!(
            json_body(&resp)["error"]["message"],
            json!(format!("Response with id '{last}' not found."))
        );

        // Round robin has no form: it runs once, beside the filter.
        if form == Form::Filter {
            let rr = start(
                &tools(),
                "e2e-responses-rr",
                RouterKind::RoundRobin,
                false,
                Form::Filter,
            )
            .await;
            let (_, _, rr_failures, _) = run_chain(client, &rr, &[rr.url()], Duration::ZERO).await;
            println!(
                "round robin: failed attempts {rr_failures} over {} turns",
                TURNS - 1
            );
            assert!(
                rr_failures >= TURNS - 1,
                "round robin broke the chain {rr_failures} times"
            );
        }
    })
    .await;
}

/// Turn `turn` of an Anthropic Messages conversation with a tool: the history so far
/// (`tool_use` and `tool_result` blocks), then a new text block carrying `cache_control`.
fn messages_turn(history: &mut Vec<Value>, turn: usize) -> Value {
    if turn > 0 {
        history.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": common::words(300 + turn as u64, 6)},
            {"type": "tool_use", "id": format!("toolu_{turn}"), "name": "read_file",
             "input": {"path": format!("src/{turn}.rs")}}
        ]}));
        history.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{turn}"),
             "content": common::words(400 + turn as u64, 40)}
        ]}));
    } else {
        history.push(json!({"role": "user", "content": [
            {"type": "text", "text": common::words(500, 300)}
        ]}));
    }
    // Claude Code marks the newest block; the marker moves every turn.
    let mut messages = history.clone();
    if let Some(last) = messages.last_mut()
        && let Some(block) = last["content"].as_array_mut().and_then(|b| b.last_mut())
    {
        block["cache_control"] = json!({"type": "ephemeral"});
    }
    json!({
        "model": MODEL,
        "max_tokens": 8,
        "system": [{"type": "text", "text": common::words(600, 120),
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "read_file", "description": "Reads a file",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "messages": messages,
        "stream": turn % 3 == 2,
    })
}

/// `usage.cache_read_input_tokens` of a Messages answer: the JSON's, or the last a stream
/// carried (vLLM's `message_start` has none; `message_delta` has the final usage).
fn cache_read(resp: &HttpResponse) -> u64 {
    if resp.body.trim_start().starts_with('{') {
        return json_body(resp)["usage"]["cache_read_input_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    resp.body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|e| {
            let usage = e.get("usage").or_else(|| e.pointer("/message/usage"))?;
            usage["cache_read_input_tokens"].as_u64()
        })
        .next_back()
        .unwrap_or(0)
}

async fn a_messages_conversation_with_tools_stays_where_its_prefix_is_cached(form: Form) {
    kvroute_test("e2e-messages", false, form, async |fleet, client| {
        let mut history = Vec::new();
        let (mut replicas, mut cached) = (Vec::new(), Vec::new());
        for turn in 0..TURNS {
            let body = messages_turn(&mut history, turn);
            let resp = post(client, fleet, "/v1/messages", &body).await;
            assert_eq!(resp.status, 200, "turn {turn}: {}", resp.body);
            replicas.push(common::replica_header(&resp));
            cached.push(cache_read(&resp));
            // Another conversation in between, so load alone would move this one.
            let other = json!({"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "user", "content": common::words(900 + turn as u64, 200)}]});
            let r = post(client, fleet, "/v1/messages", &other).await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        println!("messages: replicas {replicas:?}, cache reads {cached:?}");
        assert!(replicas.iter().all(|r| r == &replicas[0]), "{replicas:?}");
        assert!(cached[1..].iter().all(|&c| c > 0), "{cached:?}");
        assert!(cached.windows(2).all(|w| w[1] >= w[0]), "{cached:?}");
        let count = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
        let r = post(client, fleet, "/v1/messages/count_tokens", &count).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            json_body(&r)["input_tokens"]
                .as_u64()
                .is_some_and(|n| n > 0)
        );
    })
    .await;
}

/// Turn 1 (`second: false`) or 2 of a Messages conversation with a long system prompt; with
/// `marked`, the system block and the newest block carry `cache_control`, as Claude Code sends
/// them. `seed` tells conversations apart; both shapes have the same lengths.
fn marked_turn(seed: u64, second: bool, marked: bool) -> Value {
    let text = |seed: u64, n: usize| json!({"type": "text", "text": common::words(seed, n)});
    let mut messages = vec![json!({"role": "user", "content": [text(seed + 1, 200)]})];
    if second {
        messages.push(json!({"role": "assistant", "content": [text(seed + 2, 20)]}));
        messages.push(json!({"role": "user", "content": [text(seed + 3, 20)]}));
    }
    let mut system = text(seed, 3_000);
    if marked {
        system["cache_control"] = json!({"type": "ephemeral"});
        if let Some(last) = messages.last_mut() {
            last["content"][0]["cache_control"] = json!({"type": "ephemeral"});
        }
    }
    json!({"model": MODEL, "max_tokens": 4, "system": [system], "messages": messages})
}

/// What the test's router counts as a prompt's tokens, and as the hit it gives a later turn:
/// canonical bytes at 4 bytes a token, a hit in whole 256-byte blocks (`bytes_per_token`,
/// `block_bytes`).
fn router_tokens(body: &Value) -> (f64, f64) {
    use scorer_core::canon::canonicalize;
    use scorer_core::protocol::ApiKind;
    let bytes = canonicalize(ApiKind::Messages, body.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("{e}"))
        .bytes
        .len();
    ((bytes as f64 / 4.0).ceil(), (bytes / 256 * 64) as f64)
}

/// The replicas' `running` as the control plane last scraped it (0 once that scrape is
/// stale: the router then prices the replica by its own in-flight count), and its in-flight
/// count.
async fn scraped(fleet: &Fleet) -> Vec<(String, u64, u64)> {
    let body = common::cp_get(fleet, "/debug/endpoints").await;
    let views: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let views = views.as_array().cloned().unwrap_or_default();
    views
        .iter()
        .map(|v| {
            (
                v["address"].as_str().unwrap_or_default().to_string(),
                if v["stale"].as_bool().unwrap_or(false) {
                    0
                } else {
                    v["metrics"]["running"].as_u64().unwrap_or(0)
                },
                v["inflight"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// Polls `/debug/endpoints` until `ok` holds (the scrape and outcome reports land on their
/// own schedule; the test waits for them, never for a time).
async fn wait_scraped(fleet: &Fleet, what: &str, ok: impl Fn(&[(String, u64, u64)]) -> bool) {
    loop {
        let views = scraped(fleet).await;
        if ok(&views) {
            return;
        }
        println!("waiting for {what}: {views:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn a_marked_prefix_stays_on_its_holder_under_a_load_that_moves_an_unmarked_one(form: Form) {
    // Each running sequence costs a candidate `decode_ms_per_seq`; nothing else moves (no
    // learned latency, no occupancy or contention term), so the load is what the test puts
    // there. Marked prefixes count one future read (`cache_control.reuse_weight`, off by
    // default).
    const PER_SEQ_MS: f64 = 100.0;
    const REUSE_WEIGHT: f64 = 1.0;
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-cache-control", 4, MODEL, |cfg| {
            form.apply(cfg);
            // A scrape that comes late on a busy machine must not go stale between the wait
            // below and the decision (the router would then price the loaded holder by its
            // own in-flight count, which leaves the load out: one full `make test` saw the
            // unmarked turn stay).
            cfg.control_plane_router = json!({
                "stale_after_ms": 30_000,
                "scoring": {
                    "decode_ms_per_seq": PER_SEQ_MS,
                    "decode_occupancy_weight": 0.0,
                    "prefill_contention_weight": 0.0,
                },
                "latency": {"enabled": false},
                "cache_control": {"reuse_weight": REUSE_WEIGHT},
            });
        })
        .await;
        let client = HttpClient::new();
        let (marked_seed, plain_seed) = (7_000, 8_000);
        let mut holders = Vec::new();
        for (seed, marked) in [(marked_seed, true), (plain_seed, false)] {
            let body = marked_turn(seed, false, marked);
            let r = post(&client, &fleet, "/v1/messages", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            holders.push(common::replica_header(&r));
        }
        wait_scraped(&fleet, "turn 1's outcomes", |v| {
            v.iter().all(|(_, _, inflight)| *inflight == 0)
        })
        .await;

        // The load: on the holder, a marked turn 2 keeps `(prefill_weight + reuse_weight)`
        // times its held prefix's prefill over a replica without it, an unmarked one
        // `prefill_weight` times (less the stall its small suffix imposes on the running
        // sequences). Put it halfway: enough running sequences to move the unmarked one only.
        let router = scorer_core::router::RouterConfig::default();
        let (s, reuse) = (&router.scoring, REUSE_WEIGHT);
        let (prompt, _) = router_tokens(&marked_turn(marked_seed, true, true));
        let (_, held) = router_tokens(&marked_turn(marked_seed, false, true));
        let (plain_prompt, _) = router_tokens(&marked_turn(plain_seed, true, false));
        let (_, plain_held) = router_tokens(&marked_turn(plain_seed, false, false));
        assert!((plain_held - held).abs() <= 64.0 && (plain_prompt - prompt).abs() <= 16.0);
        let stall = s.prefill_stall_weight * (prompt - held) / s.prefill_tokens_per_ms;
        let keep_unmarked = s.prefill_weight * held / s.prefill_tokens_per_ms;
        let keep_marked = keep_unmarked + reuse * held / s.prefill_tokens_per_ms;
        let running = ((keep_unmarked + keep_marked) / 2.0 / (PER_SEQ_MS + stall)).round() as u64;
        println!(
            "held {held} of {prompt} tokens: the holder keeps unmarked below {keep_unmarked:.0} ms \
             and marked below {keep_marked:.0} ms of extra cost; {running} running sequences \
             cost {:.0} ms",
            running as f64 * (PER_SEQ_MS + stall)
        );
        let mut load = tokio::task::JoinSet::new();
        let mut loaded: Vec<String> = holders.clone();
        loaded.dedup();
        for holder in &loaded {
            for i in 0..running {
                let body = common::stream_chat_body(
                    MODEL,
                    &[json!({"role": "user", "content": common::words(9_000 + i, 20)})],
                    4_000,
                );
                let (client, url) = (client.clone(), format!("http://{holder}"));
                load.spawn(async move {
                    let _ = kvroute_harness::loadgen::stream_chat(
                        &client,
                        &url,
                        &body,
                        &[],
                        Duration::from_secs(200),
                    )
                    .await;
                });
            }
        }
        // Before each turn 2: the control plane's last scrape of every holder is fresh and
        // shows the load (on a busy machine a scrape can come late and go stale, and the
        // router then prices the holder by its own in-flight count, which leaves the load out).
        let loaded_fresh = |v: &[(String, u64, u64)]| {
            loaded.iter().all(|h| {
                v.iter()
                    .any(|(a, running_now, _)| a == h && *running_now >= running)
            })
        };
        wait_scraped(&fleet, "the holders' running sequences", loaded_fresh).await;

        let marked = marked_turn(marked_seed, true, true);
        let r = post(&client, &fleet, "/v1/messages", &marked).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let (marked_to, marked_cached) = (common::replica_header(&r), cache_read(&r));
        wait_scraped(&fleet, "the holders' running sequences", loaded_fresh).await;
        let plain = marked_turn(plain_seed, true, false);
        let r = post(&client, &fleet, "/v1/messages", &plain).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let plain_to = common::replica_header(&r);
        load.abort_all();
        println!(
            "holders {holders:?}; marked turn 2 -> {marked_to} ({marked_cached} cached), \
             unmarked -> {plain_to}"
        );
        assert_eq!(marked_to, holders[0], "the marked prefix left its holder");
        assert!(
            marked_cached > 0,
            "the marked turn 2 found no cached prefix"
        );
        if plain_to == holders[1] {
            // Rare under a full `make test`: say what the router saw, so the next one is read.
            let decisions = common::cp_get(&fleet, "/debug/decisions?limit=2").await;
            let views = scraped(&fleet).await;
            panic!(
                "the unmarked prefix did not move; replicas (address, running, in flight) \
                 {views:?}; the last two decisions {decisions}"
            );
        }
    })
    .await;
}

async fn a_session_header_pins_across_chat_responses_and_messages(form: Form) {
    kvroute_test("e2e-agent-session", true, form, async |fleet, client| {
        for (header, value) in [
            ("x-session-id", "s-1"),
            ("x-claude-code-session-id", "cc-2"),
            ("session-id", "codex-3"),
        ] {
            let mut served = Vec::new();
            for i in 0..6u64 {
                // Unrelated prompts: only the session can keep them together.
                let text = common::words(1000 + i * 7 + value.len() as u64, 80);
                let (path, body) = match i % 3 {
                    0 => ("/v1/chat/completions", common::user_chat(MODEL, &text, 4)),
                    1 => (
                        "/v1/responses",
                        json!({"model": MODEL, "input": text,
                                                 "max_output_tokens": 4, "store": false}),
                    ),
                    _ => (
                        "/v1/messages",
                        json!({"model": MODEL, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": text}]}),
                    ),
                };
                let resp = send(client, fleet, "POST", path, Some(&body), &[(header, value)]).await;
                assert_eq!(resp.status, 200, "{path}: {}", resp.body);
                served.push(common::replica_header(&resp));
            }
            println!("{header}: {served:?}");
            assert!(
                served.iter().all(|r| r == &served[0]),
                "{header}: {served:?}"
            );
        }
    })
    .await;
}

/// Every path of vLLM's table besides the four generation APIs: through Envoy it answers what
/// the replica answers directly (status and error type), whether kvroute routes it by load or
/// leaves it to Envoy.
async fn every_other_vllm_path_answers_through_envoy_as_the_replica_does(form: Form) {
    kvroute_test("e2e-other-paths", false, form, async |fleet, client| {
        let text = json!(common::words(7, 30));
        let cases: Vec<(&str, &str, Option<Value>)> = vec![
            (
                "POST",
                "/v1/embeddings",
                Some(json!({"model": MODEL, "input": text})),
            ),
            (
                "POST",
                "/v2/embed",
                Some(json!({"model": MODEL, "texts": [text]})),
            ),
            (
                "POST",
                "/pooling",
                Some(json!({"model": MODEL, "input": text})),
            ),
            (
                "POST",
                "/classify",
                Some(json!({"model": MODEL, "input": text})),
            ),
            (
                "POST",
                "/score",
                Some(json!({"model": MODEL, "text_1": "a", "text_2": "b"})),
            ),
            (
                "POST",
                "/v1/score",
                Some(json!({"model": MODEL, "text_1": "a", "text_2": "b"})),
            ),
            (
                "POST",
                "/rerank",
                Some(json!({"model": MODEL, "query": "a", "documents": ["b"]})),
            ),
            (
                "POST",
                "/v1/rerank",
                Some(json!({"model": MODEL, "query": "a", "documents": ["b"]})),
            ),
            (
                "POST",
                "/v2/rerank",
                Some(json!({"model": MODEL, "query": "a", "documents": ["b"]})),
            ),
            (
                "POST",
                "/v1/messages/count_tokens",
                Some(json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})),
            ),
            (
                "POST",
                "/tokenize",
                Some(json!({"model": MODEL, "prompt": text})),
            ),
            (
                "POST",
                "/detokenize",
                Some(json!({"model": MODEL, "tokens": [1, 2, 3]})),
            ),
            ("POST", "/v1/audio/transcriptions", None),
            ("POST", "/v1/audio/translations", None),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
        ];
        for (method, path, body) in &cases {
            let through = send(client, fleet, method, path, body.as_ref(), &[]).await;
            let direct_url = format!("http://{}{path}", fleet.replicas[0].address);
            let direct = client
                .request(
                    method,
                    &direct_url,
                    &[("content-type", "application/json")],
                    body.as_ref().map(Value::to_string),
                    REQUEST_TIMEOUT,
                )
                .await
                .unwrap_or_else(|e| panic!("{direct_url}: {e}"));
            println!(
                "{method} {path}: through Envoy {}, direct {}",
                through.status, direct.status
            );
            assert_eq!(
                through.status, direct.status,
                "{path}: {} vs {}",
                through.body, direct.body
            );
            assert!(
                through.header(kvroute_harness::REPLICA_HEADER).is_some(),
                "{path}"
            );
        }
        let m = common::cp_metrics(fleet).await;
        let by_load =
            kvroute_harness::prometheus_sum_with(&m, "kvroute_decisions_total", "reason=\"load\"");
        assert!(by_load >= 10.0, "the load paths were routed by load:\n{m}");
    })
    .await;
}
