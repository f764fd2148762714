//! vLLM's wire formats, sans-IO: what kvroute reads from a vLLM engine and what vllm-sim writes
//! in its place, in one crate so that both sides (and the fuzz targets) run the same code and
//! golden fixtures made by vLLM's own classes check it from outside.
//!
//! - [`kv_events`]: the msgpack `KVEventBatch` payloads of vLLM's KV-event publisher: one
//!   decoder (every encoding vLLM has shipped), one encoder (byte for byte what vLLM 0.33
//!   writes), and the router's view of a batch;
//! - [`prom`]: the Prometheus text parser for the vLLM gauges routing needs;
//! - [`models`]: the `/v1/models` list (served models, adapters, each model's context);
//! - [`agent_chat`]: an Anthropic Messages or OpenAI Responses prompt as the chat messages
//!   vLLM builds from it before it applies the chat template;
//! - `chat_template` (feature `chat-template`): a chat template rendered like transformers'
//!   `apply_chat_template`.
//!
//! Invariant: no I/O, no clock, no async runtime. Callers pass bytes in and get values or typed
//! errors out; the time a template may print is an argument.

pub mod agent_chat;
pub mod kv_events;
pub mod models;
pub mod prom;

#[cfg(feature = "chat-template")]
pub mod chat_template;

/// The msgpack value type of [`kv_events`]' raw fields (`extra_keys`), re-exported so callers
/// build and match them with the same version.
pub use rmpv;
