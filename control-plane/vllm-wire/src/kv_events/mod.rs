//! vLLM's KV-event batches: the payload of each ZMQ message `[topic, seq, payload]` that an
//! engine started with `--kv-events-config` publishes.
//!
//! - `seq` is an 8-byte big-endian counter per publisher (per data-parallel rank);
//! - `payload` is msgpack of vLLM's `KVEventBatch`: `[ts, [event, ...], data_parallel_rank?]`;
//! - an event is a tagged map `{"type": "BlockStored", "block_hashes": [...], ...}` (current
//!   vLLM) or a tagged array `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]`
//!   (vLLM before ~0.23), trailing optional fields omitted;
//! - a block hash is a u64, an i64 (vLLM < 0.10.2: two's complement) or bytes (a 32-byte
//!   digest when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
//!
//! Two levels:
//! - the wire level, [`WireBatch`] / [`WireEvent`]: every field the decoders have needed, as
//!   vLLM published it (hashes as int or bytes, medium and KV-group as given). [`decode_batch`]
//!   reads any vLLM's payload into it, [`encode_batch`] writes it back byte for byte as vLLM
//!   0.33's msgspec encoder does. vllm-sim publishes through the encoder, its tests read
//!   through the decoder;
//! - the router level, [`EventBatch`]: what precise routing applies
//!   (`scorer_core::precise::KvEvent`, hashes as u64, the cache salt recovered, other KV groups
//!   and unknown event types skipped and counted). The control plane reads through
//!   [`decode_event_batch`] and [`decode_message`].
//!
//! The fixtures in `control-plane/vllm-wire/tests/fixtures/` were made by vLLM 0.33's own
//! msgspec classes (`scripts/gen_kv_event_fixtures.py`, `scripts/check_vllm_compat.py`).
//! Every malformed input is a [`DecodeError`] naming where it went wrong; nothing here panics.

mod decode;
mod encode;
mod router;
mod scan;
mod sources;
#[cfg(test)]
mod test_util;

pub use decode::{DecodeError, decode_batch, decode_seq};
pub use encode::{block_extra_keys, encode_batch, replay_end, replay_messages};
pub use router::{
    EventBatch, EventMessage, FULL_ATTENTION_KINDS, Skipped, cache_salt, decode_event_batch,
    decode_message, parse_medium,
};
pub use sources::{PublisherConfig, SourcesError, connect_endpoint, parse_event_sources};

/// The endpoint data-parallel rank `rank`'s publisher uses when the engines are configured
/// with `endpoint`: vLLM 0.33 offsets a TCP port by the rank (`tcp://*:5557` -> rank 2 on
/// `tcp://*:5559`), leaves port 0 to the OS and suffixes `inproc://` names with `_dp<rank>`
/// (`ZmqEventPublisher.offset_endpoint_port` in `vllm/distributed/kv_events.py`). The
/// simulator binds where this says and the control plane subscribes there, so both follow the
/// one rule. `None` where vLLM would refuse to start (another transport, a port that is not a
/// number) or the offset leaves the port range.
pub fn offset_endpoint_port(endpoint: &str, rank: u32) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    if endpoint.contains("inproc") {
        return Some(format!("{endpoint}_dp{rank}"));
    }
    match endpoint.rsplit_once(':') {
        Some((base, port)) if endpoint.contains("tcp") => {
            let port: u16 = port.parse().ok()?;
            if port == 0 {
                return Some(endpoint.to_owned());
            }
            let port = u16::try_from(u32::from(port) + rank).ok()?;
            Some(format!("{base}:{port}"))
        }
        None if endpoint.contains("tcp") => Some(endpoint.to_owned()),
        // vLLM refuses other transports (`ipc://`) for ranks above 0.
        _ => None,
    }
}

#[cfg(test)]
mod offset_tests {
    use super::offset_endpoint_port;

    #[test]
    fn ranks_offset_tcp_ports_as_vllm_does() {
        let at = |e: &str, r| offset_endpoint_port(e, r);
        assert_eq!(at("tcp://*:5557", 0).as_deref(), Some("tcp://*:5557"));
        assert_eq!(at("tcp://*:5557", 2).as_deref(), Some("tcp://*:5559"));
        assert_eq!(
            at("tcp://10.0.0.5:5557", 3).as_deref(),
            Some("tcp://10.0.0.5:5560")
        );
        // Port 0 is the OS's choice for every rank.
        assert_eq!(
            at("tcp://127.0.0.1:0", 1).as_deref(),
            Some("tcp://127.0.0.1:0")
        );
        assert_eq!(
            at("inproc://cache", 1).as_deref(),
            Some("inproc://cache_dp1")
        );
        assert_eq!(at("tcp://*:65535", 1), None);
        assert_eq!(at("tcp://*:x", 1), None);
        assert_eq!(at("ipc:///tmp/kv", 1), None);
    }
}

use rmpv::Value;

/// The replay socket's end-of-replay sequence frame: `-1` as 8 signed big-endian bytes.
pub const END_SEQ: u64 = u64::MAX;

/// A block hash as published: vLLM switched from Python `hash()` ints to 64-bit projections and
/// optionally publishes raw digests, and a consumer must accept all of them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// An integer hash; a negative one (vLLM < 0.10.2) keeps its two's-complement bits.
    Int(u64),
    /// A byte-string hash (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), never empty.
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The hash as vLLM's consumers key blocks by it: an int as is, bytes as the low 64 bits
    /// of the big-endian integer (`int.from_bytes(b, "big") & (2**64 - 1)`, exactly what vLLM's
    /// own int conversion keeps).
    pub fn to_u64(&self) -> u64 {
        match self {
            BlockHash::Int(h) => *h,
            BlockHash::Bytes(b) => {
                let tail = &b[b.len().saturating_sub(8)..];
                tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
            }
        }
    }
}

/// vLLM's `BlockStored`: blocks became cached. Fields vLLM 0.33 also defines but no consumer
/// reads (`kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`,
/// `lookahead_token_ids`) are skipped by the decoder and never written by the encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in order.
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the block before them; `None` when the run starts at block 0.
    pub parent_block_hash: Option<BlockHash>,
    /// Their tokens, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA adapter id (deprecated in vLLM, still published).
    pub lora_id: Option<u64>,
    /// `GPU`, `CPU`, ... as published; absent before vLLM ~0.10.
    pub medium: Option<String>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// Per-block extra hash keys (`list[tuple | None]`), raw: vLLM publishes them untagged, so
    /// only [`cache_salt`] interprets them.
    pub extra_keys: Option<Value>,
    /// KV-cache group (hybrid models have several).
    pub group_idx: Option<u32>,
    /// `full_attention`, `sliding_window`, ... when published.
    pub kv_cache_spec_kind: Option<String>,
}

impl BlockStored {
    /// Blocks stored on the GPU with nothing else set (no LoRA, extra keys, group or kind):
    /// what a plain model's engine publishes, for tests and benchmarks to build on.
    pub fn on_gpu(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }
    }
}

/// vLLM's `BlockRemoved`: cached blocks were evicted.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// Their hashes.
    pub block_hashes: Vec<BlockHash>,
    /// `GPU`, `CPU`, ... as published.
    pub medium: Option<String>,
    /// KV-cache group.
    pub group_idx: Option<u32>,
}

/// One event of a batch, as vLLM published it.
#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    /// Blocks became cached.
    BlockStored(BlockStored),
    /// Cached blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
    /// An event type this crate does not know (a newer vLLM), by its tag; its fields are not
    /// kept, and the encoder writes the tag alone.
    Unknown(String),
}

/// One `KVEventBatch`: the events of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    /// Engine wall-clock time of the step, in Unix seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<WireEvent>,
    /// The data-parallel rank that published it; `None` when vLLM left it unset.
    pub data_parallel_rank: Option<u32>,
}
