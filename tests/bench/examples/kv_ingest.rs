//! What ingesting vLLM's KV events costs the control plane, per block, for the 1,000-replica
//! figures (issue #15): each endpoint publishes vLLM 0.33-encoded batches (msgpack, as
//! `vllm_wire::kv_events::encode_batch` writes them byte for byte), each one `BlockStored` of a
//! chunk's blocks chained to the previous chunk plus, once the endpoint holds its share, one
//! `BlockRemoved` of as many old blocks (a full cache evicts as much as it stores). The loop
//! decodes every payload and applies its events to one `Router` (`apply_kv_event`, the call
//! the subscriber makes under the state lock), round robin over the endpoints, and prints the
//! CPU time per block and what that is in cores for 1,000 replicas at a few computed-token
//! rates. ZeroMQ receive and the sequence checks are not in the loop.
//!
//! `cargo run --release -p kvroute-bench --example kv_ingest -- [batches] [endpoints] [blocks_per_batch] [held_blocks]`

use std::time::Instant;

use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use vllm_wire::kv_events::decode_event_batch;
use vllm_wire::kv_events::{
    BlockHash, BlockRemoved, BlockStored, WireBatch, WireEvent, encode_batch,
};

/// vLLM's default block size, tokens.
const BLOCK_TOKENS: u32 = 16;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let batches = args.next().and_then(Result::ok).unwrap_or(200_000);
    let endpoints = args
        .next()
        .and_then(Result::ok)
        .unwrap_or(256)
        .clamp(1, 256);
    let per_batch = args.next().and_then(Result::ok).unwrap_or(8).max(1);
    let held = args
        .next()
        .and_then(Result::ok)
        .unwrap_or(4_096)
        .max(per_batch);

    let mut config = RouterConfig::default();
    config.precise.block_tokens = BLOCK_TOKENS as usize;
    let mut router = Router::new(config, 1);
    let addresses: Vec<String> = (0..endpoints)
        .map(|i| format!("10.{}.{}.{}:8000", i / 65_536, (i / 256) % 256, i % 256))
        .collect();
    for a in &addresses {
        router.upsert_endpoint(a).expect("at most 256 endpoints");
        let metrics = EndpointMetrics {
            // Room for what each endpoint holds, so only the published removals evict.
            capacity_tokens: Some((held as u64 + 1_024) * u64::from(BLOCK_TOKENS)),
            ..EndpointMetrics::default()
        };
        router.update_metrics(a, metrics, 0);
        router.set_event_stream(a, true);
    }

    // Encode every endpoint's batches up front: the timed loop is decode + apply only.
    let mut payloads: Vec<(usize, Vec<u8>)> = Vec::with_capacity(batches);
    let mut next_hash = vec![0u64; endpoints];
    let mut oldest = vec![0u64; endpoints];
    for b in 0..batches {
        let e = b % endpoints;
        let base = (e as u64) << 40;
        let first = next_hash[e];
        let hashes: Vec<BlockHash> = (first..first + per_batch as u64)
            .map(|h| BlockHash::Int(base | (h + 1)))
            .collect();
        next_hash[e] += per_batch as u64;
        let mut events = vec![WireEvent::BlockStored(BlockStored::on_gpu(
            hashes,
            (first > 0).then_some(BlockHash::Int(base | first)),
            (0..per_batch as u32 * BLOCK_TOKENS).collect(),
            BLOCK_TOKENS,
        ))];
        if next_hash[e] - oldest[e] > held as u64 {
            let from = oldest[e];
            oldest[e] += per_batch as u64;
            events.push(WireEvent::BlockRemoved(BlockRemoved {
                block_hashes: (from..from + per_batch as u64)
                    .map(|h| BlockHash::Int(base | (h + 1)))
                    .collect(),
                medium: Some("GPU".into()),
                group_idx: None,
            }));
        }
        let batch = WireBatch {
            ts: b as f64 * 1e-3,
            events,
            data_parallel_rank: None,
        };
        payloads.push((e, encode_batch(&batch)));
    }
    let bytes: usize = payloads.iter().map(|(_, p)| p.len()).sum();

    // Decoding alone, for the split.
    let started = Instant::now();
    let decoded = payloads
        .iter()
        .filter(|(_, p)| decode_event_batch(p).is_ok())
        .count();
    let decode_secs = started.elapsed().as_secs_f64();
    assert_eq!(decoded, payloads.len(), "every payload decodes");

    let (mut applied, mut failed, mut blocks) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    for (i, (e, payload)) in payloads.iter().enumerate() {
        let Ok(batch) = decode_event_batch(payload) else {
            failed += 1;
            continue;
        };
        for event in &batch.events {
            blocks += match event {
                scorer_core::precise::KvEvent::BlockStored { block_hashes, .. }
                | scorer_core::precise::KvEvent::BlockRemoved { block_hashes, .. } => {
                    block_hashes.len() as u64
                }
                scorer_core::precise::KvEvent::AllBlocksCleared => 0,
            };
            match router.apply_kv_event(&addresses[*e], "m", event, (i / 1_000) as u64) {
                Ok(()) => applied += 1,
                Err(_) => failed += 1,
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let ns_per_block = secs * 1e9 / blocks.max(1) as f64;
    println!(
        "{batches} batches ({:.1} MB msgpack) over {endpoints} endpoints, {per_batch} blocks a \
         batch, {held} held each: {applied} events applied, {failed} failed, {blocks} blocks \
         (stored + removed) in {secs:.2} s",
        bytes as f64 / 1e6
    );
    println!(
        "decode + apply: {:.0} ns a block ({:.0} decoding), {:.2} us a batch, {:.2} M blocks/s \
         on one core",
        ns_per_block,
        decode_secs * 1e9 / blocks.max(1) as f64,
        secs * 1e6 / batches as f64,
        1e3 / ns_per_block
    );
    // A full cache stores a block per BLOCK_TOKENS computed prompt tokens and evicts as many.
    for tokens_per_s in [5_000.0, 10_000.0, 20_000.0] {
        let blocks_per_s = 2.0 * tokens_per_s / f64::from(BLOCK_TOKENS);
        let cores = 1_000.0 * blocks_per_s * ns_per_block / 1e9;
        println!(
            "1,000 replicas each computing {tokens_per_s:.0} prompt tokens/s ({blocks_per_s:.0} \
             blocks/s stored + removed): {cores:.2} cores"
        );
    }
}
