//! Precise mode's input: each engine's KV-cache events (vLLM `--kv-events-config`).
//!
//! - decoding one ZMQ message (both of vLLM's msgpack encodings) is `vllm_wire::kv_events`,
//!   the codec the simulator publishes with, re-exported here;
//! - [`seq`]: per-publisher sequence bookkeeping (gap, duplicate, restart), free of I/O;
//! - [`subscriber`]: the SUB + replay DEALER sockets per endpoint, feeding the router.
//!
//! The router keys precise state by kvroute's own hash of each block's tokens, so nothing here
//! depends on vLLM's hash algorithm or seed (see `scorer_core::precise`).

pub mod seq;
pub mod subscriber;

pub use subscriber::{EventSource, SubscriberSettings};
pub use vllm_wire::kv_events::{
    DecodeError, EventBatch, EventMessage, decode_event_batch, decode_message,
};
