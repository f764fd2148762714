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
//!   and the router's parser reads the page.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use vllm_sim::engine::{KvEvent, StoredBlocks};
use vllm_sim::kv_events::wire_batch;
use vllm_sim::metrics::ServerInfo;
use vllm_wire::kv_events::{
    BlockHash, WireBatch, WireEvent, cache_salt, decode_batch, encode_batch,
};

/// The simulator's own fixtures (metric names and a captured `/metrics` page).
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vllm")
}

/// The KV-event fixtures, kept with the codec they pin.
fn wire_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../control-plane/vllm-wire/tests/fixtures/vllm")
}

/// The engine events a decoded batch reports: hashes as integers, the salt as the router reads
/// it (`vllm_wire::kv_events::cache_salt`). Each store and removal here is on the GPU.
fn engine_events(batch: &WireBatch) -> Vec<KvEvent> {
    let ints = |hs: &[BlockHash]| hs.iter().map(BlockHash::to_u64).collect();
    batch
        .events
        .iter()
        .map(|e| match e {
            WireEvent::BlockStored(s) => KvEvent::BlockStored(StoredBlocks {
                block_hashes: ints(&s.block_hashes),
                parent_block_hash: s.parent_block_hash.as_ref().map(BlockHash::to_u64),
                token_ids: s.token_ids.clone(),
                block_size: s.block_size,
                lora_id: s.lora_id.map(|l| u32::try_from(l).unwrap()),
                lora_name: s.lora_name.clone(),
                cache_salt: s
                    .parent_block_hash
                    .is_none()
                    .then(|| cache_salt(s.extra_keys.as_ref(), s.lora_name.as_deref()))
                    .flatten(),
            }),
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
            KvEvent::BlockStored(StoredBlocks {
                cache_salt: Some(_),
                lora_name: Some(_),
                ..
            })
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
