//! Precise mode's input: each engine's KV-cache events (vLLM `--kv-events-config`).
//!
//! - [`decode`]: pure decoder of one ZMQ message (both of vLLM's msgpack encodings);
//! - [`seq`]: per-publisher sequence bookkeeping (gap, duplicate, restart), free of I/O;
//! - [`subscriber`]: the SUB + replay DEALER sockets per endpoint, feeding the router.
//!
//! The router keys precise state by kvroute's own hash of each block's tokens, so nothing here
//! depends on vLLM's hash algorithm or seed (see `scorer_core::precise`).

pub mod decode;
pub mod seq;
pub mod subscriber;

pub use decode::{DecodeError, EventBatch, EventMessage, decode_batch, decode_message};
pub use subscriber::{EventSource, SubscriberSettings};
