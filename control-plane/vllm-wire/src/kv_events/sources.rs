//! vLLM 0.33's `GET /kv_event_sources`: every data-parallel rank's KV-event publisher, as the
//! engines resolved it (`vllm/entrypoints/serve/instrumentator/basic.py`; the values are
//! `KVEventsConfig`s from `ZmqEventPublisher.get_publisher_config`, keyed by rank). A router
//! that reads it needs no per-rank socket configuration, and finds publishers bound to port 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One engine's publisher (vLLM's `KVEventsConfig` fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublisherConfig {
    /// Whether the engine publishes at all.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `zmq` (or `null`).
    #[serde(default)]
    pub publisher: Option<String>,
    /// The PUB socket; a bind spelling (`tcp://*:5557`) names the engine's own host.
    pub endpoint: String,
    /// The ROUTER replay socket, if any.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default)]
    pub buffer_steps: u64,
    /// PUB high-water mark.
    #[serde(default)]
    pub hwm: u64,
    /// Events queued before publishing.
    #[serde(default)]
    pub max_queue_size: u64,
    /// Topic frame of every message.
    #[serde(default)]
    pub topic: String,
}

impl PublisherConfig {
    /// Whether a subscriber can use it: a ZMQ publisher that is on.
    pub fn is_zmq(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() == Some("zmq")
    }
}

/// Why a `/kv_event_sources` answer is unusable.
#[derive(Debug, thiserror::Error)]
pub enum SourcesError {
    /// Not the JSON object of ranks vLLM writes.
    #[error("not a map of data-parallel ranks to publisher configs: {0}")]
    Shape(#[from] serde_json::Error),
    /// A key is not a rank number.
    #[error("{0:?} is not a data-parallel rank")]
    Rank(String),
}

/// The publishers of a `/kv_event_sources` answer, by rank.
pub fn parse_event_sources(body: &[u8]) -> Result<BTreeMap<u32, PublisherConfig>, SourcesError> {
    let by_key: BTreeMap<String, PublisherConfig> = serde_json::from_slice(body)?;
    by_key
        .into_iter()
        .map(|(k, v)| match k.parse() {
            Ok(rank) => Ok((rank, v)),
            Err(_) => Err(SourcesError::Rank(k)),
        })
        .collect()
}

/// Where a subscriber connects for a publisher that reports `published`: a bind spelling of
/// the host (`*`, `0.0.0.0`, `::`, `[::]`) is the engine's own, so `host` (the server's) takes
/// its place; a named host stays.
pub fn connect_endpoint(published: &str, host: &str) -> String {
    let Some(rest) = published.strip_prefix("tcp://") else {
        return published.to_owned();
    };
    match rest.rsplit_once(':') {
        Some(("*" | "0.0.0.0" | "::" | "[::]", port)) => format!("tcp://{host}:{port}"),
        _ => published.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_answer_and_connects_to_the_servers_host() {
        let body = br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "buffer_steps": 10000,
            "hwm": 100000, "max_queue_size": 100000, "topic": ""},
            "1": {"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://10.0.0.5:41231", "replay_endpoint": null, "buffer_steps": 10000,
            "hwm": 100000, "max_queue_size": 100000, "topic": "kv"}}"#;
        let sources = parse_event_sources(body).unwrap();
        assert_eq!(sources.len(), 2);
        assert!(sources[&0].is_zmq() && sources[&1].is_zmq());
        assert_eq!(
            connect_endpoint(&sources[&0].endpoint, "10.0.0.5"),
            "tcp://10.0.0.5:5557"
        );
        assert_eq!(
            connect_endpoint(&sources[&1].endpoint, "10.0.0.9"),
            "tcp://10.0.0.5:41231"
        );
        assert_eq!(
            connect_endpoint("tcp://[::]:5557", "[fd00::5]"),
            "tcp://[fd00::5]:5557"
        );
        assert_eq!(parse_event_sources(b"{}").unwrap().len(), 0);
        assert!(parse_event_sources(br#"{"x": {"endpoint": "tcp://a:1"}}"#).is_err());
        assert!(parse_event_sources(b"[]").is_err());
    }
}
