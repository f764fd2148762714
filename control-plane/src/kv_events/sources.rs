//! `endpoints[].kv_events: auto`: a server's publishers from its own `GET /kv_event_sources`
//! (vLLM 0.33), so a data-parallel server's ranks, or a publisher bound to port 0, need no
//! socket configuration. One task per server asks until the server answers (backing off from
//! 1 s to 30 s), then subscribes each of the server's engines to its rank's publisher and keeps
//! those subscriptions until shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use vllm_wire::kv_events::{PublisherConfig, connect_endpoint, parse_event_sources};

use super::{EventSource, SubscriberSettings};
use crate::scrape::{ScrapeError, ScrapeSettings};
use crate::state::State;

/// One server whose publishers are asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoServer {
    /// The server's `ip:port`.
    pub server: String,
    /// Its engines: each endpoint's name and data-parallel rank (0 without data parallelism).
    pub engines: Vec<(String, u32)>,
    /// Model name that seeds the hashes of blocks stored without a LoRA adapter.
    pub model: String,
    /// Topic prefix to subscribe to when the server's answer names none.
    pub topic: String,
}

impl AutoServer {
    /// The subscriptions `sources` (a `/kv_event_sources` answer) call for: each engine whose
    /// rank has a ZMQ publisher, connected at the server's host where the publisher reports a
    /// bind spelling.
    pub fn sources(
        &self,
        sources: &std::collections::BTreeMap<u32, PublisherConfig>,
    ) -> Vec<EventSource> {
        let host = match self.server.parse::<std::net::SocketAddr>() {
            Ok(std::net::SocketAddr::V6(a)) => format!("[{}]", a.ip()),
            Ok(a) => a.ip().to_string(),
            Err(_) => self
                .server
                .rsplit_once(':')
                .map_or(self.server.clone(), |(h, _)| h.to_owned()),
        };
        self.engines
            .iter()
            .filter_map(|(address, rank)| {
                let p = sources.get(rank).filter(|p| p.is_zmq())?;
                Some(EventSource {
                    address: address.clone(),
                    endpoint: connect_endpoint(&p.endpoint, &host),
                    replay_endpoint: p
                        .replay_endpoint
                        .as_deref()
                        .map(|r| connect_endpoint(r, &host)),
                    topic: if p.topic.is_empty() {
                        self.topic.clone()
                    } else {
                        p.topic.clone()
                    },
                    model: self.model.clone(),
                })
            })
            .collect()
    }
}

/// Starts one task per server (asking with `scrape`'s client settings, subscribing with
/// `subscriber`'s); they end when `shutdown` turns true or is dropped.
pub fn spawn(
    state: Arc<State>,
    servers: Vec<AutoServer>,
    settings: (ScrapeSettings, SubscriberSettings),
    shutdown: watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    super::spawn_each(&state, servers, &settings, &shutdown, resolve_and_subscribe)
}

async fn resolve_and_subscribe(
    state: Arc<State>,
    server: AutoServer,
    (scrape, subscriber): (ScrapeSettings, SubscriberSettings),
    mut shutdown: watch::Receiver<bool>,
) {
    let client = crate::scrape::client(&scrape);
    let mut wait = Duration::from_secs(1);
    let sources = loop {
        let asked = crate::scrape::get(&client, &server.server, "/kv_event_sources", &scrape).await;
        let answer = asked.and_then(|body| {
            parse_event_sources(&body).map_err(|e| ScrapeError::Body(e.to_string()))
        });
        match answer {
            Ok(listed) => {
                let sources = server.sources(&listed);
                if sources.len() == server.engines.len() {
                    break sources;
                }
                tracing::warn!(server = %server.server, listed = listed.len(),
                    engines = server.engines.len(),
                    "kv_event_sources lists no ZMQ publisher for some ranks; asking again");
            }
            Err(e) => {
                tracing::debug!(server = %server.server, error = %e, "kv_event_sources failed");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        wait = (wait * 2).min(Duration::from_secs(30));
    };
    for s in &sources {
        tracing::info!(endpoint = %s.address, publisher = %s.endpoint, "kv_event_sources: subscribing");
    }
    let tasks = super::subscriber::spawn(state, sources, subscriber, shutdown.clone());
    let _ = shutdown.wait_for(|stop| *stop).await;
    for t in tasks {
        t.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_engine_subscribes_to_its_ranks_publisher_at_the_servers_host() {
        let server = AutoServer {
            server: "10.0.0.5:8000".into(),
            engines: vec![
                ("10.0.0.5:8000#dp0".into(), 0),
                ("10.0.0.5:8000#dp1".into(), 1),
            ],
            model: "m".into(),
            topic: String::new(),
        };
        let listed = parse_event_sources(
            br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
                 "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "kv"},
                 "1": {"enable_kv_cache_events": true, "publisher": "zmq",
                 "endpoint": "tcp://10.0.0.5:41001"}}"#,
        )
        .unwrap();
        let sources = server.sources(&listed);
        assert_eq!(sources.len(), 2);
        assert_eq!(
            (
                sources[0].endpoint.as_str(),
                sources[0].replay_endpoint.as_deref()
            ),
            ("tcp://10.0.0.5:5557", Some("tcp://10.0.0.5:5600"))
        );
        assert_eq!(sources[0].topic, "kv");
        assert_eq!(sources[1].address, "10.0.0.5:8000#dp1");
        assert_eq!(sources[1].endpoint, "tcp://10.0.0.5:41001");
        // A rank without a publisher gets no subscription.
        let partial = parse_event_sources(
            br#"{"0": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": ""}}"#,
        )
        .unwrap();
        assert!(server.sources(&partial).is_empty());
    }
}
