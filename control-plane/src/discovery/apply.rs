//! Applies discovered endpoint sets to the running control plane.
//!
//! For every endpoint that appears: a router slot, a `/metrics` scrape loop and, when it has a
//! KV-event endpoint, an event subscriber, all stopped by one per-endpoint signal. For every
//! endpoint that disappears: the signal fires, the tasks end, and the router forgets the slot
//! (its prefix-index entries, in-flight requests and event-fed blocks). An address whose pod
//! changed is removed and added again (see [`super::diff`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{DiscoveredEndpoint, DiscoveredEndpoints, DiscoveryConfig, diff};
use crate::config::Config;
use crate::kv_events::{EventSource, SubscriberSettings};
use crate::scrape::ScrapeSettings;
use crate::state::State;

/// Everything a newly discovered endpoint's tasks need.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How its `/metrics` is scraped.
    pub scrape: ScrapeSettings,
    /// How its KV events are followed.
    pub subscriber: SubscriberSettings,
    /// Topic prefix subscribed to on every publisher.
    pub kv_events_topic: String,
}

impl Settings {
    /// The same settings `ControlPlane::run` gives statically configured endpoints.
    pub fn from_config(config: &Config) -> Self {
        let p = &config.precise;
        Self {
            scrape: ScrapeSettings {
                interval: Duration::from_millis(config.scrape_interval_ms),
                timeout: Duration::from_millis(config.scrape_timeout_ms),
                unreachable_after: config.unreachable_after_failures,
                max_body_bytes: config.max_metrics_bytes,
                models_interval: Duration::from_millis(config.models_interval_ms),
            },
            subscriber: SubscriberSettings {
                connect_timeout: Duration::from_millis(p.kv_connect_timeout_ms),
                replay_timeout: Duration::from_millis(p.kv_replay_timeout_ms),
                reconnect_min: Duration::from_millis(p.kv_reconnect_min_ms),
                reconnect_max: Duration::from_millis(p.kv_reconnect_max_ms),
            },
            kv_events_topic: p.kv_events_topic.clone(),
        }
    }
}

/// The tasks of one applied endpoint.
struct Running {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Signals and aborts the tasks, then waits until they are gone, so none of them can touch
    /// the endpoint's state after it is removed.
    async fn stop(self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }

    fn abort(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.abort();
        }
    }
}

/// Keeps the control plane's endpoints equal to the latest discovered set.
pub struct Applier {
    state: Arc<State>,
    settings: Settings,
    applied: DiscoveredEndpoints,
    running: BTreeMap<String, Running>,
}

impl std::fmt::Debug for Applier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Applier")
            .field("applied", &self.applied.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Applier {
    /// An applier with nothing applied yet.
    pub fn new(state: Arc<State>, settings: Settings) -> Self {
        Self {
            state,
            settings,
            applied: DiscoveredEndpoints::new(),
            running: BTreeMap::new(),
        }
    }

    /// What is currently applied.
    pub fn applied(&self) -> &DiscoveredEndpoints {
        &self.applied
    }

    /// Brings the control plane to `set`.
    pub async fn apply(&mut self, set: &DiscoveredEndpoints) {
        let d = diff(&self.applied, set);
        for address in &d.removed {
            if let Some(r) = self.running.remove(address) {
                r.stop().await;
            }
            self.state.remove_endpoint(address);
            self.applied.remove(address);
            tracing::info!(endpoint = %address, "discovery: endpoint removed");
        }
        for endpoint in d.added {
            if let Err(e) = self.state.add_endpoint(&endpoint.address) {
                tracing::error!(endpoint = %endpoint.address, error = %e, "discovery: cannot add endpoint");
                continue;
            }
            if let Some(role) = endpoint.role {
                self.state.set_role(&endpoint.address, role);
            }
            let running = self.start(&endpoint);
            tracing::info!(
                endpoint = %endpoint.address,
                pod = endpoint.name.as_deref().unwrap_or(""),
                kv_events = endpoint.kv_events.as_deref().unwrap_or(""),
                "discovery: endpoint added"
            );
            self.running.insert(endpoint.address.clone(), running);
            self.applied.insert(endpoint.address.clone(), endpoint);
        }
    }

    fn start(&self, endpoint: &DiscoveredEndpoint) -> Running {
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = crate::scrape::spawn(
            self.state.clone(),
            vec![endpoint.address.clone()],
            self.settings.scrape.clone(),
            stop_rx.clone(),
        );
        if let Some(kv) = &endpoint.kv_events {
            let source = EventSource {
                address: endpoint.address.clone(),
                endpoint: kv.clone(),
                replay_endpoint: endpoint.kv_events_replay.clone(),
                topic: self.settings.kv_events_topic.clone(),
                model: endpoint.model.clone().unwrap_or_default(),
            };
            tasks.extend(crate::kv_events::subscriber::spawn(
                self.state.clone(),
                vec![source],
                self.settings.subscriber.clone(),
                stop_rx,
            ));
        }
        Running { stop, tasks }
    }

    /// Stops every endpoint's tasks (the router keeps its slots).
    pub fn shutdown(&mut self) {
        for (_, r) in std::mem::take(&mut self.running) {
            r.abort();
        }
    }
}

impl Drop for Applier {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Runs discovery and applies every published set until the task is dropped or aborted.
pub async fn run(state: Arc<State>, config: DiscoveryConfig, settings: Settings) {
    let (tx, mut rx) = watch::channel(None);
    let source = tokio::spawn(super::run(config, tx));
    let mut applier = Applier::new(state, settings);
    while rx.changed().await.is_ok() {
        let set = rx.borrow_and_update().clone();
        if let Some(set) = set {
            applier.apply(&set).await;
        }
    }
    source.abort();
}

/// Starts [`run`] as a task.
pub fn spawn(state: Arc<State>, config: DiscoveryConfig, settings: Settings) -> JoinHandle<()> {
    tokio::spawn(run(state, config, settings))
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use scorer_core::protocol::RouteRequest;
    use scorer_core::router::RouterConfig;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    fn settings() -> Settings {
        Settings::from_config(&Config {
            scrape_interval_ms: 20,
            ..Config::default()
        })
    }

    fn ep(address: &str, name: &str) -> DiscoveredEndpoint {
        DiscoveredEndpoint {
            address: address.into(),
            kv_events: None,
            kv_events_replay: None,
            model: None,
            name: Some(name.into()),
            role: None,
        }
    }

    fn set(eps: &[DiscoveredEndpoint]) -> DiscoveredEndpoints {
        eps.iter().map(|e| (e.address.clone(), e.clone())).collect()
    }

    fn routable(state: &State) -> Vec<String> {
        let mut r = state
            .route(&RouteRequest {
                model: "m".into(),
                prompt_tokens: 5,
                ..Default::default()
            })
            .endpoints;
        r.sort();
        r
    }

    /// A fake vLLM `/metrics` endpoint that counts scrapes.
    async fn metrics_server() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    loop {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let body = "vllm:num_requests_running{engine=\"0\"} 0\nvllm:num_requests_waiting{engine=\"0\"} 0\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n";
                        let resp = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if sock.write_all(resp.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, hits)
    }

    #[tokio::test]
    async fn endpoints_follow_discovery_and_scrapes_start_and_stop() {
        let state = Arc::new(State::new(RouterConfig::default(), &[], 16, 1).unwrap());
        let (a, hits_a) = metrics_server().await;
        let (b, _) = metrics_server().await;
        let (a, b) = (a.to_string(), b.to_string());
        let mut applier = Applier::new(state.clone(), settings());

        applier
            .apply(&set(&[ep(&a, "llm/vllm-0"), ep(&b, "llm/vllm-1")]))
            .await;
        assert_eq!(routable(&state), {
            let mut v = vec![a.clone(), b.clone()];
            v.sort();
            v
        });
        // The new endpoint is scraped.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while hits_a.load(std::sync::atomic::Ordering::Relaxed) < 2 {
            assert!(tokio::time::Instant::now() < deadline, "no scrapes of {a}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // vllm-0 goes away: it stops being routable and stops being scraped.
        applier.apply(&set(&[ep(&b, "llm/vllm-1")])).await;
        assert_eq!(routable(&state), vec![b.clone()]);
        tokio::time::sleep(Duration::from_millis(60)).await;
        let after = hits_a.load(std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            hits_a.load(std::sync::atomic::Ordering::Relaxed),
            after,
            "a removed endpoint is no longer scraped"
        );
        assert!(state.scrape_statuses().iter().all(|s| s.address != a));

        // A new pod reusing vllm-1's IP is re-added (fresh state), not kept.
        applier.apply(&set(&[ep(&b, "llm/vllm-7")])).await;
        assert_eq!(routable(&state), vec![b.clone()]);
        assert_eq!(applier.applied()[&b].name.as_deref(), Some("llm/vllm-7"));
        applier.apply(&DiscoveredEndpoints::new()).await;
        assert!(routable(&state).is_empty());
        applier.shutdown();
    }

    /// Precise mode: a discovered pod's KV-event subscription starts with it and ends with it.
    #[tokio::test]
    async fn kv_event_subscriptions_follow_pod_churn() {
        let state = Arc::new(State::new(RouterConfig::default(), &[], 16, 1).unwrap());
        let mut applier = Applier::new(state.clone(), settings());
        let streams = |state: &State| -> Vec<(String, String)> {
            state
                .kv_streams()
                .into_iter()
                .map(|s| (s.address, s.endpoint))
                .collect()
        };
        // Nothing listens on port 1: the subscriber keeps retrying, its status shows the source.
        let mut pod = ep("127.0.0.1:8000", "llm/vllm-0");
        pod.kv_events = Some("tcp://127.0.0.1:1".into());
        applier.apply(&set(&[pod.clone()])).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while streams(&state).is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no subscriber started"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            streams(&state),
            vec![(
                "127.0.0.1:8000".to_string(),
                "tcp://127.0.0.1:1".to_string()
            )]
        );
        // The pod is re-created with another publisher port: re-subscribed there.
        pod.kv_events = Some("tcp://127.0.0.1:2".into());
        pod.name = Some("llm/vllm-0b".into());
        applier.apply(&set(&[pod])).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while streams(&state)
            != vec![(
                "127.0.0.1:8000".to_string(),
                "tcp://127.0.0.1:2".to_string(),
            )]
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?}",
                streams(&state)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Gone: no status left, and none comes back from a lingering task.
        applier.apply(&DiscoveredEndpoints::new()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(streams(&state).is_empty(), "{:?}", streams(&state));
    }

    #[tokio::test]
    async fn run_applies_what_dns_discovery_publishes() {
        let state = Arc::new(State::new(RouterConfig::default(), &[], 16, 1).unwrap());
        let config = DiscoveryConfig {
            kubernetes: None,
            dns: Some(super::super::DnsDiscovery {
                name: "127.0.0.3".into(),
                port: 1,
                kv_events_port: None,
                kv_events_replay_port: None,
                model: None,
                data_parallel_size: None,
                interval_ms: 100,
            }),
            file: None,
        };
        let task = spawn(state.clone(), config, settings());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while routable(&state).is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "nothing applied");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(routable(&state), vec!["127.0.0.3:1".to_string()]);
        task.abort();
    }

    /// File discovery gives every replica its own port (what loopback test fleets need), and
    /// a replica taken out of the file stops being routable.
    #[tokio::test]
    async fn run_applies_what_file_discovery_publishes() {
        let state = Arc::new(State::new(RouterConfig::default(), &[], 16, 1).unwrap());
        let dir = std::env::temp_dir().join(format!("kvroute-apply-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("endpoints.yaml");
        let write = |text: &str| {
            let tmp = dir.join("endpoints.yaml.tmp");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        };
        write("endpoints:\n  - 127.0.0.1:1\n  - 127.0.0.1:2\n");
        let config = DiscoveryConfig {
            file: Some(super::super::FileDiscovery {
                path: path.clone(),
                interval_ms: 20,
            }),
            ..DiscoveryConfig::default()
        };
        let task = spawn(state.clone(), config, settings());
        let wait_for = |want: Vec<&'static str>| {
            let state = state.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                while routable(&state) != want {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "{:?} != {want:?}",
                        routable(&state)
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        wait_for(vec!["127.0.0.1:1", "127.0.0.1:2"]).await;
        write("endpoints:\n  - 127.0.0.1:2\n");
        wait_for(vec!["127.0.0.1:2"]).await;
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
