//! vllm-sim speaks vLLM 0.33's wire formats, checked against fixtures that vLLM's own code made
//! or accepted (`scripts/check_vllm_compat.py`, run against the `vllm==0.33.0` wheel; the
//! fixtures are committed, so these tests need no wheel):
//!
//! - payloads encoded by vLLM's event classes, in both the current map and the old array
//!   encoding, decode to what vLLM put in them;
//! - the simulator's encoder writes byte-identical payloads for the events a vLLM GPU block
//!   pool publishes;
//! - payloads captured from a live vllm-sim (which vLLM's decoder read and re-encoded to the
//!   same bytes) still come out of today's encoder unchanged;
//! - every metric the simulator exports is a metric vLLM 0.33 registers, with the same type.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use vllm_sim::engine::{EngineStats, KvEvent};
use vllm_sim::kv_events::{DecodedEvent, EventHash, decode_batch, encode_batch};
use vllm_sim::metrics::{LatencyHistograms, ServerInfo, render};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vllm")
}

fn read_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(name)).expect("fixture");
    serde_json::from_str(&text).expect("fixture json")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hash_json(h: &EventHash) -> Value {
    match h {
        EventHash::Int(n) => json!(n),
        EventHash::Bytes(b) => json!({"bytes": hex(b)}),
    }
}

/// A JSON hash as the decoder reports it: negative (pre-0.10.2 `hash()`) values keep their
/// two's-complement bits.
fn normalise_hash(v: &Value) -> Value {
    match v.as_i64() {
        Some(n) if n < 0 => json!(n as u64),
        _ => v.clone(),
    }
}

fn msgpack_json(v: &rmpv::Value) -> Value {
    match v {
        rmpv::Value::Nil => Value::Null,
        rmpv::Value::Boolean(b) => json!(b),
        rmpv::Value::Integer(i) => i
            .as_u64()
            .map(|n| json!(n))
            .or_else(|| i.as_i64().map(|n| json!(n)))
            .unwrap_or(Value::Null),
        rmpv::Value::F32(f) => json!(f),
        rmpv::Value::F64(f) => json!(f),
        rmpv::Value::String(s) => json!(s.as_str()),
        rmpv::Value::Binary(b) => json!({"bytes": hex(b)}),
        rmpv::Value::Array(a) => Value::Array(a.iter().map(msgpack_json).collect()),
        other => panic!("unexpected msgpack value {other}"),
    }
}

/// A decoded event in the shape the script's `describe()` writes.
fn describe(e: &DecodedEvent) -> Value {
    let hashes = |hs: &[EventHash]| Value::Array(hs.iter().map(hash_json).collect());
    match e {
        DecodedEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
        DecodedEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => json!({"type": "BlockRemoved", "block_hashes": hashes(block_hashes),
                    "medium": medium, "group_idx": group_idx}),
        DecodedEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
        } => json!({"type": "BlockStored", "block_hashes": hashes(block_hashes),
                    "medium": medium, "group_idx": group_idx,
                    "parent_block_hash": parent_block_hash.as_ref().map(hash_json),
                    "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id,
                    "lora_name": lora_name,
                    "extra_keys": extra_keys.as_ref().map(msgpack_json),
                    "kv_cache_spec_kind": kv_cache_spec_kind}),
    }
}

/// The salt in block 0's entry of a store's `extra_keys` (JSON), given how the simulator writes
/// them: `[salt]`, or `[lora, salt]` with a LoRA.
fn salt_in(extra_keys: &Value, lora_name: Option<&str>) -> Option<String> {
    let first = extra_keys.get(0)?.as_array()?;
    let skip = usize::from(lora_name.is_some());
    first.get(skip)?.as_str().map(str::to_owned)
}

fn expected_events(events: &Value) -> Vec<Value> {
    events
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            let mut e = e.clone();
            if let Some(hs) = e.get_mut("block_hashes").and_then(Value::as_array_mut) {
                for h in hs.iter_mut() {
                    *h = normalise_hash(h);
                }
            }
            if let Some(p) = e.get_mut("parent_block_hash") {
                *p = normalise_hash(p);
            }
            e
        })
        .collect()
}

#[test]
fn vllm_made_payloads_decode_in_both_encodings() {
    let expected = read_json("vllm_events.json");
    let encodings = expected["encodings"].as_object().expect("encodings");
    assert_eq!(encodings.len(), 2, "map and array");
    for (encoding, want) in encodings {
        let file = fixtures().join(want["file"].as_str().unwrap());
        let payload = std::fs::read(&file).expect("payload");
        let batch = decode_batch(&payload).unwrap_or_else(|e| panic!("{encoding}: {e}"));
        assert_eq!(batch.ts, want["ts"].as_f64().unwrap(), "{encoding}");
        assert_eq!(
            batch.data_parallel_rank.map(u64::from),
            want["data_parallel_rank"].as_u64(),
            "{encoding}"
        );
        let got: Vec<Value> = batch.events.iter().map(describe).collect();
        let want = expected_events(&want["events"]);
        assert_eq!(got.len(), want.len(), "{encoding}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{encoding}");
        }
    }
}

/// The fixture's JSON events as the engine's [`KvEvent`]s.
fn kv_events(events: &Value) -> Vec<KvEvent> {
    let u64s = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect()
    };
    events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "BlockStored" => KvEvent::BlockStored {
                block_hashes: u64s(&e["block_hashes"]),
                parent_block_hash: e["parent_block_hash"].as_u64(),
                token_ids: u64s(&e["token_ids"])
                    .into_iter()
                    .map(|t| t as u32)
                    .collect(),
                block_size: e["block_size"].as_u64().unwrap() as u32,
                lora_id: e["lora_id"].as_u64().map(|l| l as u32),
                lora_name: e["lora_name"].as_str().map(str::to_owned),
                cache_salt: salt_in(&e["extra_keys"], e["lora_name"].as_str()),
            },
            "BlockRemoved" => KvEvent::BlockRemoved {
                block_hashes: u64s(&e["block_hashes"]),
            },
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => panic!("unexpected event {other}"),
        })
        .collect()
}

#[test]
fn encoder_writes_the_bytes_vllm_writes() {
    let shape = read_json("vllm_sim_shape.json");
    let vllm_bytes = std::fs::read(fixtures().join("vllm_sim_shape.msgpack")).unwrap();
    let ours = encode_batch(
        shape["ts"].as_f64().unwrap(),
        &kv_events(&shape["events"]),
        shape["data_parallel_rank"].as_u64().unwrap() as u32,
    );
    assert_eq!(
        ours, vllm_bytes,
        "byte-identical to vLLM 0.33's msgspec encoding"
    );
    // And our decoder reads every field vLLM set.
    let back = decode_batch(&vllm_bytes).unwrap();
    let got: Vec<Value> = back.events.iter().map(describe).collect();
    assert_eq!(got, expected_events(&shape["events"]));
}

#[test]
fn captured_sim_payloads_still_encode_the_same() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures().join("sim_capture"))
        .expect("sim_capture")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 3, "captured batches");
    let mut stored = std::collections::HashSet::new();
    let mut kinds = [0usize; 3];
    for file in &files {
        let raw = std::fs::read(file).unwrap();
        let batch = decode_batch(&raw).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert_eq!(batch.data_parallel_rank, Some(0));
        let mut events = Vec::new();
        for e in &batch.events {
            match e {
                DecodedEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    group_idx,
                    kv_cache_spec_kind,
                } => {
                    kinds[0] += 1;
                    assert_eq!(token_ids.len(), *block_size as usize * block_hashes.len());
                    assert_eq!(medium.as_deref(), Some("GPU"));
                    assert_eq!(*group_idx, Some(0));
                    assert_eq!(*kv_cache_spec_kind, None);
                    assert!(extra_keys.is_some());
                    assert_eq!(lora_id.is_some(), lora_name.is_some());
                    let int = |h: &EventHash| match h {
                        EventHash::Int(n) => *n,
                        EventHash::Bytes(_) => panic!("the simulator publishes integer hashes"),
                    };
                    if let Some(p) = parent_block_hash {
                        assert!(stored.contains(&int(p)), "parent was stored before");
                    }
                    stored.extend(block_hashes.iter().map(int));
                    events.push(KvEvent::BlockStored {
                        block_hashes: block_hashes.iter().map(int).collect(),
                        parent_block_hash: parent_block_hash.as_ref().map(int),
                        token_ids: token_ids.clone(),
                        block_size: *block_size,
                        lora_id: lora_id.map(|l| l as u32),
                        lora_name: lora_name.clone(),
                        cache_salt: extra_keys
                            .as_ref()
                            .filter(|_| parent_block_hash.is_none())
                            .and_then(|k| salt_in(&msgpack_json(k), lora_name.as_deref())),
                    });
                }
                DecodedEvent::BlockRemoved { block_hashes, .. } => {
                    kinds[1] += 1;
                    let hashes: Vec<u64> = block_hashes
                        .iter()
                        .map(|h| match h {
                            EventHash::Int(n) => *n,
                            EventHash::Bytes(_) => panic!("integer hashes"),
                        })
                        .collect();
                    assert_eq!(hashes.len(), 1, "one hash per BlockRemoved, as vLLM 0.33");
                    assert!(
                        stored.contains(&hashes[0]),
                        "only stored blocks are evicted"
                    );
                    events.push(KvEvent::BlockRemoved {
                        block_hashes: hashes,
                    });
                }
                DecodedEvent::AllBlocksCleared => {
                    kinds[2] += 1;
                    events.push(KvEvent::AllBlocksCleared);
                }
            }
        }
        assert_eq!(
            encode_batch(batch.ts, &events, 0),
            raw,
            "{}: today's encoder writes what vLLM accepted",
            file.display()
        );
    }
    assert!(
        kinds.iter().all(|k| *k > 0),
        "stored, removed, cleared: {kinds:?}"
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
    let info = ServerInfo {
        model_name: "m".into(),
        block_size: 16,
        max_loras: 2,
        prefix_caching_hash_algo: "sha256".into(),
    };
    let page = render(
        &info,
        &EngineStats::default(),
        &LatencyHistograms::default(),
        0,
        1.0,
    );
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
}
