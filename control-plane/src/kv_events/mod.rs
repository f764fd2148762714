//! Precise mode's input: each engine's KV-cache events (vLLM `--kv-events-config`).
//!
//! - decoding one ZMQ message (both of vLLM's msgpack encodings) is `vllm_wire::kv_events`,
//!   the codec the simulator publishes with, re-exported here;
//! - [`seq`]: per-publisher sequence bookkeeping (gap, duplicate, restart), free of I/O;
//! - [`subscriber`]: the SUB + replay DEALER sockets per endpoint, feeding the router;
//! - [`sources`]: `kv_events: auto`, the publishers a server lists at `/kv_event_sources`.
//!
//! The router keys precise state by kvroute's own hash of each block's tokens, so nothing here
//! depends on vLLM's hash algorithm or seed (see `scorer_core::precise`).

pub mod seq;
pub mod sources;
pub mod subscriber;

pub use subscriber::{EventSource, SubscriberSettings};

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::state::State;

/// One task per item of `items`, each running `run` with the state, its item, the settings
/// and the shutdown signal: how this module starts its per-endpoint and per-server loops.
fn spawn_each<I, S, F, Fut>(
    state: &Arc<State>,
    items: Vec<I>,
    settings: &S,
    shutdown: &watch::Receiver<bool>,
    run: F,
) -> Vec<JoinHandle<()>>
where
    S: Clone,
    F: Fn(Arc<State>, I, S, watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    items
        .into_iter()
        .map(|item| tokio::spawn(run(state.clone(), item, settings.clone(), shutdown.clone())))
        .collect()
}
pub use vllm_wire::kv_events::{
    DecodeError, EventBatch, EventMessage, decode_event_batch, decode_message,
};
