//! vllm-sim behaves like vLLM 0.33 from outside, checked against fixtures that vLLM's own code
//! made or accepted (`scripts/check_vllm_compat.py`, run against the `vllm==0.33.0` wheel; the
//! fixtures are committed, so these tests need no wheel). The wire format itself (decoding and
//! encoding `KVEventBatch`es) is vllm-wire's and is checked there, on the fixtures in
//! `control-plane/vllm-wire/tests/fixtures/vllm/`; this file checks what the simulator puts in it:
//!
//! - the engine's events for a small scenario are the events a vLLM GPU block pool publishes
//!   for it, down to the byte;
//! - the batches captured from a live vllm-sim show a block pool's bookkeeping (parents stored
//!   first, one hash per removal, only stored blocks evicted);
//! - every metric the simulator exports is a metric vLLM 0.33 registers, with the same type,
//!   and the router's parser reads the page;
//! - every object of the agent APIs' answers (Responses, Messages, their streams, errors,
//!   `/detokenize`) has the fields of the vLLM 0.33 class it stands for, in its order
//!   (`agent_fields.json`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use vllm_sim::engine::KvEvent;
use vllm_sim::kv_events::wire_batch;
use vllm_sim::metrics::ServerInfo;
use vllm_wire::kv_events::{
    BlockHash, BlockStored, WireBatch, WireEvent, block_extra_keys, cache_salt, decode_batch,
    encode_batch,
};

/// The simulator's own fixtures (metric names and a captured `/metrics` page).
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vllm")
}

/// The KV-event fixtures, kept with the codec they pin.
fn wire_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../control-plane/vllm-wire/tests/fixtures/vllm")
}

/// The engine events a decoded batch reports: what the engine knows of a run (hashes as
/// integers, LoRA, the salt as the router reads it with `vllm_wire::kv_events::cache_salt`),
/// the extra keys rebuilt from those as the engine builds them. Each store and removal here is
/// on the GPU.
fn engine_events(batch: &WireBatch) -> Vec<KvEvent> {
    let int = |h: &BlockHash| BlockHash::Int(h.to_u64());
    let ints = |hs: &[BlockHash]| hs.iter().map(BlockHash::to_u64).collect();
    batch
        .events
        .iter()
        .map(|e| match e {
            WireEvent::BlockStored(s) => {
                let salt = s
                    .parent_block_hash
                    .is_none()
                    .then(|| cache_salt(s.extra_keys.as_ref(), s.lora_name.as_deref()))
                    .flatten();
                let blocks = s.block_hashes.len();
                KvEvent::BlockStored(BlockStored {
                    lora_id: s.lora_id,
                    lora_name: s.lora_name.clone(),
                    extra_keys: Some(block_extra_keys(
                        blocks,
                        s.lora_name.as_deref(),
                        salt.as_deref(),
                    )),
                    ..BlockStored::on_gpu(
                        s.block_hashes.iter().map(int).collect(),
                        s.parent_block_hash.as_ref().map(int),
                        s.token_ids.clone(),
                        s.block_size,
                    )
                })
            }
            WireEvent::BlockRemoved(r) => KvEvent::BlockRemoved {
                block_hashes: ints(&r.block_hashes),
            },
            WireEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
            WireEvent::Unknown(tag) => panic!("unexpected event {tag}"),
        })
        .collect()
}

#[test]
fn the_engines_events_are_the_events_a_vllm_block_pool_publishes() {
    // What vLLM's own GPU block pool published for a small scenario (LoRA, salts, eviction).
    let vllm_bytes = std::fs::read(wire_fixtures().join("vllm_sim_shape.msgpack")).unwrap();
    let vllm = decode_batch(&vllm_bytes).unwrap();
    let events = engine_events(&vllm);
    assert!(
        events.iter().any(|e| matches!(
            e,
            KvEvent::BlockStored(s) if s.lora_name.is_some()
                && cache_salt(s.extra_keys.as_ref(), s.lora_name.as_deref()).is_some()
        )),
        "the scenario has a salted LoRA store"
    );
    // The same engine events, published the simulator's way, are the same bytes.
    let ours = wire_batch(vllm.ts, &events, vllm.data_parallel_rank.unwrap());
    assert_eq!(
        encode_batch(&ours),
        vllm_bytes,
        "byte-identical to what vLLM 0.33 publishes for the same scenario"
    );
}

#[test]
fn captured_batches_show_a_block_pools_bookkeeping() {
    // The capture's batches are `000.msgpack`, `001.msgpack`, ... in sequence order.
    let dir = wire_fixtures().join("sim_capture");
    let files: Vec<PathBuf> = (0..)
        .map(|seq| dir.join(format!("{seq:03}.msgpack")))
        .take_while(|f| f.exists())
        .collect();
    assert!(files.len() >= 3, "captured batches in {}", dir.display());
    let int = |h: &BlockHash| match h {
        BlockHash::Int(n) => *n,
        BlockHash::Bytes(_) => panic!("the simulator publishes integer hashes"),
    };
    let mut stored = HashSet::new();
    let mut stored_twice = 0;
    for file in &files {
        let batch = decode_batch(&std::fs::read(file).unwrap()).unwrap();
        for e in &batch.events {
            match e {
                WireEvent::BlockStored(s) => {
                    if let Some(p) = &s.parent_block_hash {
                        assert!(stored.contains(&int(p)), "parent was stored before");
                    }
                    for h in &s.block_hashes {
                        stored_twice += usize::from(!stored.insert(int(h)));
                    }
                }
                WireEvent::BlockRemoved(r) => {
                    assert_eq!(
                        r.block_hashes.len(),
                        1,
                        "one hash per BlockRemoved, as vLLM 0.33"
                    );
                    assert!(
                        stored.contains(&int(&r.block_hashes[0])),
                        "only stored blocks are evicted"
                    );
                }
                WireEvent::AllBlocksCleared => {}
                WireEvent::Unknown(tag) => panic!("unknown event {tag}"),
            }
        }
    }
    assert!(
        stored_twice > 0,
        "identical concurrent blocks are stored twice, as in vLLM"
    );
}

/// `name -> type` of a Prometheus page (counters without `_total`).
fn page_metrics(page: &str) -> Vec<(String, String)> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (name, kind) = l.split_once(' ').expect("TYPE line");
            let name = match kind {
                "counter" => name.strip_suffix("_total").expect("counters end in _total"),
                _ => name,
            };
            (name.to_owned(), kind.to_owned())
        })
        .collect()
}

#[test]
fn exported_metrics_are_vllm_metrics() {
    let text = std::fs::read_to_string(fixtures().join("metric_names.txt")).unwrap();
    let vllm: std::collections::HashMap<&str, &str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split_once('\t').expect("name<TAB>type"))
        .collect();
    assert!(vllm.len() > 30, "the generated list is complete");
    let page = ServerInfo::idle_page("m", 2);
    let ours = page_metrics(&page);
    assert!(ours.len() >= 15);
    for (name, kind) in &ours {
        assert_eq!(
            vllm.get(name.as_str()).copied(),
            Some(kind.as_str()),
            "{name} ({kind}) is not a vLLM 0.33 metric of that type"
        );
    }
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ] {
        assert!(ours.iter().any(|(n, _)| n == name), "{name} exported");
    }
    // The label a vLLM-compat reader checks carries a vLLM value.
    assert!(page.contains("prefix_caching_hash_algo=\"sha256\""));
    // And the router's parser reads the page.
    let parsed = vllm_wire::prom::parse_vllm_metrics(&page).expect("the router reads it");
    assert_eq!(parsed.kv_usage, 0.0);
}

// ---------------------------------------------------------------------------------------------
// The agent APIs' wire shapes

/// What `scripts/check_vllm_compat.py` read from vLLM 0.33's protocol classes (and the openai
/// SDK classes vLLM builds Responses items and events from): each class's fields in order,
/// and whether vLLM dumps every field (`all`) or only the set ones (`subset`).
fn agent_fields() -> Value {
    let text = std::fs::read_to_string(fixtures().join("agent_fields.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Checks `value` against `class` and the classes its fields hold; returns the objects checked.
fn check_shape(fields: &Value, value: &Value, class: &str, at: &str) -> usize {
    let spec = &fields["classes"][class];
    assert!(spec.is_object(), "{at}: {class} is in the fixture");
    let obj = value
        .as_object()
        .unwrap_or_else(|| panic!("{at}: a {class} is an object: {value}"));
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    let want: Vec<&str> = spec["fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    if spec["dump"] == "all" {
        let omit = spec["omit_when_none"].as_array().unwrap();
        let expected: Vec<&str> = want
            .iter()
            .copied()
            .filter(|f| !(omit.iter().any(|o| o == f) && obj.get(*f).is_none_or(Value::is_null)))
            .collect();
        assert_eq!(
            keys, expected,
            "{at}: {class} has vLLM's fields in vLLM's order"
        );
    } else {
        let pos: Vec<usize> = keys
            .iter()
            .map(|k| {
                want.iter()
                    .position(|f| f == k)
                    .unwrap_or_else(|| panic!("{at}: {class} has no field {k}"))
            })
            .collect();
        assert!(
            pos.is_sorted(),
            "{at}: {class} keys {keys:?} in vLLM's order"
        );
    }
    let mut n = 1;
    for (field, inner) in spec["nested"].as_object().unwrap() {
        let inner = inner.as_str().unwrap();
        match obj.get(field) {
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    n += check_shape(fields, item, inner, &format!("{at}.{field}[{i}]"));
                }
            }
            Some(Value::Null) | None => {}
            Some(v) => n += check_shape(fields, v, inner, &format!("{at}.{field}")),
        }
    }
    n
}

/// The `(event, data)` pairs of an SSE body.
fn sse(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| {
            let (event, data) = f.split_once('\n').unwrap();
            let data = data.strip_prefix("data: ").unwrap();
            (
                event.strip_prefix("event: ").unwrap().to_owned(),
                serde_json::from_str(data).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn agent_api_answers_have_vllms_fields() {
    use clap::Parser;
    let fields = agent_fields();
    let argv = [
        "vllm-sim",
        "--port",
        "0",
        "--model",
        "sim-compat",
        "--profile",
        "fast",
        "--enable-responses-store",
    ];
    let sim = vllm_sim::server::start(vllm_sim::server::SimArgs::try_parse_from(argv).unwrap())
        .await
        .unwrap();
    let c = kvroute_harness::HttpClient::new();
    let t = std::time::Duration::from_secs(10);
    let ask = async |method: &str, path: &str, body: Option<Value>| {
        let url = format!("{}{path}", sim.url());
        let r = c
            .request(method, &url, &[], body.map(|b| b.to_string()), t)
            .await
            .unwrap();
        (r.status, r.body)
    };
    let json = |b: &str| -> Value { serde_json::from_str(b).unwrap() };
    let mut checked = 0;

    let turn = serde_json::json!({"model": "sim-compat", "instructions": "Be terse.",
                                  "input": "list the files", "max_output_tokens": 4});
    let (_, one) = ask("POST", "/v1/responses", Some(turn.clone())).await;
    let one = json(&one);
    checked += check_shape(&fields, &one, "ResponsesResponse", "responses");
    let id = one["id"].as_str().unwrap();
    let mut streamed = turn.clone();
    streamed["stream"] = true.into();
    streamed["previous_response_id"] = id.into();
    let (_, body) = ask("POST", "/v1/responses", Some(streamed)).await;
    let events = sse(&body);
    assert!(events.len() >= 9);
    for (i, (event, data)) in events.iter().enumerate() {
        let class = fields["responses_events"][event.as_str()]
            .as_str()
            .unwrap_or_else(|| panic!("vLLM streams no {event}"));
        assert_eq!(data["type"], event.as_str());
        assert_eq!(data["sequence_number"], i);
        checked += check_shape(&fields, data, class, event);
    }
    let (_, got) = ask("GET", &format!("/v1/responses/{id}"), None).await;
    checked += check_shape(&fields, &json(&got), "ResponsesResponse", "GET");
    for (path, body) in [
        (format!("/v1/responses/{id}/cancel"), serde_json::json!({})),
        (
            "/v1/responses".to_owned(),
            serde_json::json!({"input": "x", "previous_response_id": "resp_x"}),
        ),
        (
            "/v1/messages".to_owned(),
            serde_json::json!({"model": "sim-compat", "messages": []}),
        ),
    ] {
        let (status, err) = ask("POST", &path, Some(body)).await;
        assert!(status >= 400);
        checked += check_shape(&fields, &json(&err), "ErrorResponse", &path);
    }

    let msg = serde_json::json!({"model": "sim-compat", "max_tokens": 4, "system": "Be terse.",
                                 "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
                                 "messages": [{"role": "user", "content": "list the files"}]});
    let (_, m) = ask("POST", "/v1/messages", Some(msg.clone())).await;
    checked += check_shape(&fields, &json(&m), "AnthropicMessagesResponse", "messages");
    let mut streamed = msg.clone();
    streamed["stream"] = true.into();
    let (_, body) = ask("POST", "/v1/messages", Some(streamed)).await;
    let types = fields["anthropic_event_types"].as_array().unwrap();
    for (event, data) in sse(&body) {
        assert!(types.iter().any(|t| t == event.as_str()), "{event}");
        assert_eq!(data["type"], event.as_str());
        checked += check_shape(&fields, &data, "AnthropicStreamEvent", &event);
    }
    let (_, n) = ask("POST", "/v1/messages/count_tokens", Some(msg.clone())).await;
    checked += check_shape(&fields, &json(&n), "AnthropicCountTokensResponse", "count");
    let mut unknown = msg;
    unknown["model"] = "nope".into();
    let (_, e) = ask("POST", "/v1/messages", Some(unknown)).await;
    checked += check_shape(
        &fields,
        &json(&e),
        "AnthropicErrorResponse",
        "messages error",
    );
    let tokens = Some(serde_json::json!({"tokens": [1, 2]}));
    let (_, d) = ask("POST", "/detokenize", tokens).await;
    checked += check_shape(&fields, &json(&d), "DetokenizeResponse", "detokenize");
    assert!(checked > 60, "{checked} objects checked");
    sim.shutdown().await;
}
