//! The vLLM engine simulator.
//!
//! - [`engine`] is a sans-IO model of one vLLM V1 engine (scheduler, paged KV cache with prefix
//!   caching, step-time cost model, KV events); fleet-sim drives it in virtual time;
//! - [`kv`] is its block pool;
//! - [`profile`] holds the hardware/model numbers (YAML data);
//! - [`tokenizer`] holds the Hugging Face tokenizer and Jinja chat templates, and the fast
//!   built-in word tokenizer and ChatML template;
//! - [`server`] is the live `vllm-sim` HTTP server (OpenAI API, the Responses and Anthropic
//!   Messages agent APIs, `/metrics`, ZMQ KV events);
//! - [`kv_events`] encodes KV events byte for byte as vLLM 0.33 publishes them over ZMQ, and
//!   decodes what any vLLM version publishes;
//! - [`metrics`] renders vLLM-named Prometheus metrics.

pub mod engine;
pub mod kv;
pub mod kv_events;
pub mod metrics;
pub mod pd;
pub mod profile;
pub mod server;
pub mod tokenizer;

pub use engine::{
    Engine, EngineConfig, EngineRequest, EngineStats, KvEvent, RequestEvent, RequestId,
    RequestSummary, StepOutput,
};
pub use profile::{BUILTIN_PROFILES, Profile};

/// Errors of the simulator library.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A profile or engine setting is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The request id is already inside the engine.
    #[error("request {0} is already in the engine")]
    DuplicateRequest(RequestId),
    /// The request can never run (empty, too long for the model or the cache, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A socket could not be bound or an I/O operation failed.
    #[error("i/o error: {0}")]
    Io(String),
}
