//! The router's view of a batch against payloads made by vLLM's own event classes
//! (scripts/gen_kv_event_fixtures.py ran vLLM 0.33.0's msgspec structs in three encodings):
//! every fixture decodes to exactly what the generator computed independently in Python
//! (hashes as u64, the cache salt, skipped KV groups), and damaged copies fail cleanly.

// An integration test: its helpers may unwrap (the product's ban is for product code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use scorer_core::precise::{KvEvent, Medium};
use serde_json::Value;
use vllm_wire::kv_events::{DecodeError, decode_event_batch, decode_message};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_events")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn medium(s: &str) -> Medium {
    match s {
        "GPU" => Medium::Gpu,
        "CPU" => Medium::Cpu,
        "STORAGE" => Medium::Storage,
        other => panic!("unexpected medium {other}"),
    }
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The Python-side normalised event as a `KvEvent`.
fn event(v: &Value) -> KvEvent {
    match v["type"].as_str().unwrap() {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: u64s(&v["block_hashes"]),
            parent_block_hash: v["parent_block_hash"].as_u64(),
            token_ids: u64s(&v["token_ids"])
                .into_iter()
                .map(|t| t as u32)
                .collect(),
            block_size: v["block_size"].as_u64().unwrap() as u32,
            lora_name: v["lora_name"].as_str().map(str::to_owned),
            cache_salt: v["cache_salt"].as_str().map(str::to_owned),
            medium: medium(v["medium"].as_str().unwrap()),
        },
        "BlockRemoved" => KvEvent::BlockRemoved {
            block_hashes: u64s(&v["block_hashes"]),
            medium: medium(v["medium"].as_str().unwrap()),
        },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => panic!("unexpected type {other}"),
    }
}

#[test]
fn vllm_payloads_decode_to_what_vllm_meant() {
    let exp = expected();
    let fixtures_map = exp["fixtures"].as_object().unwrap();
    // Three encodings of four batches.
    assert_eq!(fixtures_map.len(), 12);
    for (name, want) in fixtures_map {
        let payload = std::fs::read(fixtures().join(format!("{name}.msgpack"))).unwrap();
        let batch = decode_event_batch(&payload).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.ts, want["ts"].as_f64().unwrap(), "{name}");
        assert_eq!(
            batch.data_parallel_rank,
            want["data_parallel_rank"].as_u64().map(|r| r as u32),
            "{name}"
        );
        let events: Vec<KvEvent> = want["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(event)
            .collect();
        assert_eq!(batch.events, events, "{name}");
        assert_eq!(
            u64::from(batch.skipped.other_groups + batch.skipped.unknown_types),
            want["skipped"].as_u64().unwrap(),
            "{name}"
        );
    }
}

#[test]
fn both_encodings_agree() {
    for name in ["basic", "hash_shapes", "hybrid", "empty"] {
        let read = |enc: &str| {
            let p = std::fs::read(fixtures().join(format!("{name}.{enc}.msgpack"))).unwrap();
            decode_event_batch(&p).unwrap()
        };
        let map = read("map");
        assert_eq!(map, read("array"), "{name}");
        assert_eq!(map, read("array_trimmed"), "{name}");
    }
}

#[test]
fn the_hash_shapes_fixture_covers_what_it_claims() {
    let p = std::fs::read(fixtures().join("hash_shapes.map.msgpack")).unwrap();
    let b = decode_event_batch(&p).unwrap();
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        lora_name,
        ..
    } = &b.events[1]
    else {
        panic!("{:?}", b.events[1]);
    };
    // bytes(range(32)) -> its last 8 bytes, big-endian.
    let digest_tail = u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31]);
    assert_eq!(*parent_block_hash, Some(digest_tail));
    // -5 and i64::MIN as two's complement.
    assert_eq!(block_hashes, &vec![(-5i64) as u64, 1 << 63]);
    assert_eq!(lora_name.as_deref(), Some("sql"));
    // Block 0's extra keys `[lora, salt]` give the salt; the child run carries none.
    assert!(matches!(
        &b.events[0],
        KvEvent::BlockStored { cache_salt: Some(salt), .. } if salt == "tenant-a"
    ));
    assert!(matches!(
        &b.events[1],
        KvEvent::BlockStored {
            cache_salt: None,
            ..
        }
    ));
    assert!(matches!(
        &b.events[2],
        KvEvent::BlockStored {
            medium: Medium::Cpu,
            ..
        }
    ));
    assert_eq!(b.data_parallel_rank, Some(1));
}

#[test]
fn whole_messages_and_damaged_payloads() {
    let payload = std::fs::read(fixtures().join("basic.map.msgpack")).unwrap();
    let m = decode_message(&[&b""[..], &41u64.to_be_bytes(), &payload]).unwrap();
    assert_eq!(m.seq, 41);
    assert_eq!(m.batch.events.len(), 4);
    assert_eq!(
        decode_message(&[&b""[..], &[0u8; 4], &payload]),
        Err(DecodeError::SeqLength(4))
    );
    // Every truncation and every single-byte corruption is an error or a valid batch, never a
    // panic; truncations are always errors.
    for n in 0..payload.len() {
        assert!(decode_event_batch(&payload[..n]).is_err(), "prefix {n}");
    }
    for i in 0..payload.len() {
        for x in [0x00, 0xc1, 0xff, 0x7f, 0x90, 0xdc] {
            let mut p = payload.clone();
            p[i] = x;
            let _ = decode_event_batch(&p);
        }
    }
}
