//! The wire level against fixtures that vLLM 0.33's own code made or accepted
//! (`scripts/check_vllm_compat.py`, run against the `vllm==0.33.0` wheel; the fixtures are
//! committed in `tests/fixtures/vllm/`, so these tests need no wheel):
//!
//! - payloads encoded by vLLM's event classes, in both the current map and the old array
//!   encoding, decode to what vLLM put in them;
//! - the encoder writes byte-identical payloads for the events a vLLM GPU block pool publishes;
//! - payloads captured from a live vllm-sim (which vLLM's decoder read and re-encoded to the
//!   same bytes) decode and come out of today's encoder unchanged.

// An integration test: its helpers may unwrap (the product's ban is for product code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use vllm_wire::kv_events::{
    BlockHash, BlockRemoved, BlockStored, WireBatch, WireEvent, decode_batch, encode_batch,
};
use vllm_wire::rmpv;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm")
}

fn read_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(name)).expect("fixture");
    serde_json::from_str(&text).expect("fixture json")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hash_json(h: &BlockHash) -> Value {
    match h {
        BlockHash::Int(n) => json!(n),
        BlockHash::Bytes(b) => json!({"bytes": hex(b)}),
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

/// The inverse of [`msgpack_json`] for the shapes the fixtures hold.
fn json_msgpack(v: &Value) -> rmpv::Value {
    match v {
        Value::Null => rmpv::Value::Nil,
        Value::Bool(b) => rmpv::Value::from(*b),
        Value::Number(n) => n
            .as_u64()
            .map(rmpv::Value::from)
            .or_else(|| n.as_i64().map(rmpv::Value::from))
            .unwrap_or_else(|| rmpv::Value::F64(n.as_f64().unwrap())),
        Value::String(s) => rmpv::Value::from(s.as_str()),
        Value::Array(a) => rmpv::Value::Array(a.iter().map(json_msgpack).collect()),
        Value::Object(o) => rmpv::Value::Binary(unhex(o["bytes"].as_str().unwrap())),
    }
}

/// A decoded event in the shape the script's `describe()` writes.
fn describe(e: &WireEvent) -> Value {
    let hashes = |hs: &[BlockHash]| Value::Array(hs.iter().map(hash_json).collect());
    match e {
        WireEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
        WireEvent::Unknown(tag) => panic!("vLLM 0.33 has no event {tag}"),
        WireEvent::BlockRemoved(r) => json!({"type": "BlockRemoved",
            "block_hashes": hashes(&r.block_hashes), "medium": r.medium,
            "group_idx": r.group_idx}),
        WireEvent::BlockStored(s) => json!({"type": "BlockStored",
            "block_hashes": hashes(&s.block_hashes), "medium": s.medium,
            "group_idx": s.group_idx,
            "parent_block_hash": s.parent_block_hash.as_ref().map(hash_json),
            "token_ids": s.token_ids, "block_size": s.block_size, "lora_id": s.lora_id,
            "lora_name": s.lora_name, "extra_keys": s.extra_keys.as_ref().map(msgpack_json),
            "kv_cache_spec_kind": s.kv_cache_spec_kind}),
    }
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

/// The fixture's JSON events (the script's `describe()` of vLLM's objects) as wire events.
fn wire_events(events: &Value) -> Vec<WireEvent> {
    let hash = |h: &Value| match h {
        Value::Object(o) => BlockHash::Bytes(unhex(o["bytes"].as_str().unwrap())),
        h => BlockHash::Int(h.as_u64().unwrap_or_else(|| h.as_i64().unwrap() as u64)),
    };
    let hashes = |v: &Value| v.as_array().unwrap().iter().map(hash).collect();
    let string = |v: &Value| v.as_str().map(str::to_owned);
    let small = |v: &Value| v.as_u64().map(|n| u32::try_from(n).unwrap());
    events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "BlockStored" => WireEvent::BlockStored(BlockStored {
                block_hashes: hashes(&e["block_hashes"]),
                parent_block_hash: Some(&e["parent_block_hash"])
                    .filter(|p| !p.is_null())
                    .map(hash),
                token_ids: e["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| small(t).unwrap())
                    .collect(),
                block_size: small(&e["block_size"]).unwrap(),
                lora_id: e["lora_id"].as_u64(),
                medium: string(&e["medium"]),
                lora_name: string(&e["lora_name"]),
                extra_keys: Some(&e["extra_keys"])
                    .filter(|k| !k.is_null())
                    .map(json_msgpack),
                group_idx: small(&e["group_idx"]),
                kv_cache_spec_kind: string(&e["kv_cache_spec_kind"]),
            }),
            "BlockRemoved" => WireEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes(&e["block_hashes"]),
                medium: string(&e["medium"]),
                group_idx: small(&e["group_idx"]),
            }),
            "AllBlocksCleared" => WireEvent::AllBlocksCleared,
            other => panic!("unexpected event {other}"),
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
        let want_events = expected_events(&want["events"]);
        assert_eq!(got.len(), want_events.len(), "{encoding}");
        for (g, w) in got.iter().zip(&want_events) {
            assert_eq!(g, w, "{encoding}");
        }
        // And the JSON side of the fixture reads into the same wire events.
        assert_eq!(batch.events, wire_events(&want["events"]), "{encoding}");
    }
}

#[test]
fn encoder_writes_the_bytes_vllm_writes() {
    let shape = read_json("vllm_sim_shape.json");
    let vllm_bytes = std::fs::read(fixtures().join("vllm_sim_shape.msgpack")).unwrap();
    let batch = WireBatch {
        ts: shape["ts"].as_f64().unwrap(),
        events: wire_events(&shape["events"]),
        data_parallel_rank: shape["data_parallel_rank"].as_u64().map(|r| r as u32),
    };
    assert_eq!(
        encode_batch(&batch),
        vllm_bytes,
        "byte-identical to vLLM 0.33's msgspec encoding"
    );
    // And the decoder reads every field vLLM set.
    let back = decode_batch(&vllm_bytes).unwrap();
    let got: Vec<Value> = back.events.iter().map(describe).collect();
    assert_eq!(got, expected_events(&shape["events"]));
    assert_eq!(back, batch);
}

#[test]
fn captured_sim_payloads_decode_and_encode_the_same() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures().join("sim_capture"))
        .expect("sim_capture")
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 3, "captured batches");
    let mut kinds = [0usize; 3];
    for file in &files {
        let raw = std::fs::read(file).unwrap();
        let batch = decode_batch(&raw).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert_eq!(batch.data_parallel_rank, Some(0));
        for e in &batch.events {
            match e {
                WireEvent::BlockStored(s) => {
                    kinds[0] += 1;
                    assert_eq!(
                        s.token_ids.len(),
                        s.block_size as usize * s.block_hashes.len()
                    );
                    assert_eq!(s.medium.as_deref(), Some("GPU"));
                    assert_eq!(s.group_idx, Some(0));
                    assert!(s.extra_keys.is_some());
                    assert_eq!(s.lora_id.is_some(), s.lora_name.is_some());
                    assert!(
                        s.block_hashes
                            .iter()
                            .all(|h| matches!(h, BlockHash::Int(_))),
                        "the simulator publishes integer hashes"
                    );
                }
                WireEvent::BlockRemoved(_) => kinds[1] += 1,
                WireEvent::AllBlocksCleared => kinds[2] += 1,
                WireEvent::Unknown(tag) => panic!("{}: unknown event {tag}", file.display()),
            }
        }
        assert_eq!(
            encode_batch(&batch),
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
