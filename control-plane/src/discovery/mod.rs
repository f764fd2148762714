//! Endpoint discovery: where the vLLM replicas are when they are not listed in the config.
//!
//! Two sources, chosen by the optional `discovery:` section of the control-plane config:
//!
//! - [`KubernetesDiscovery`]: list and watch pods through the Kubernetes API, selected by a
//!   label selector or by an InferencePool's selector ([`kube`] is the pure part, tested on
//!   recorded API-server JSON; [`kube_client`] is the HTTP/TLS client and the watch loop);
//! - [`DnsDiscovery`]: resolve a headless Service name to its A/AAAA records on an interval
//!   ([`dns`]), for use without Kubernetes API access;
//! - [`FileDiscovery`]: poll a YAML file of `ip:port` entries kept up to date by something else
//!   (Consul-template, config management) ([`file`]); unlike DNS, every entry has its own port.
//!
//! Both publish the whole current [`DiscoveredEndpoints`] into a `tokio::sync::watch` channel
//! whenever it changes. A consumer compares it with what it applied last ([`diff`]) and adds or
//! removes endpoints: the router slot, the `/metrics` scrape loop and, when `kv_events_port` is
//! set, the KV-event subscription follow pod churn that way.
//!
//! Failure policy: an API, DNS or file error never empties the set. The last known endpoints stay
//! (their scrapes mark dead ones unreachable), and the source retries with backoff.

pub mod apply;
pub mod dns;
pub mod file;
pub mod kube;
pub mod kube_client;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use self::kube::LabelSelector;

/// One discovered vLLM replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiscoveredEndpoint {
    /// Canonical `ip:port` (what Envoy's override_host header must carry).
    pub address: String,
    /// `tcp://ip:port` of the replica's KV-event publisher, when `kv_events_port` is set.
    pub kv_events: Option<String>,
    /// `tcp://ip:port` of the replica's KV-event replay socket, when `kv_events_replay_port` is set.
    pub kv_events_replay: Option<String>,
    /// Served model name, when configured (same for every replica of one source).
    pub model: Option<String>,
    /// `namespace/pod` for Kubernetes, the DNS name for DNS (logs and `/debug`).
    pub name: Option<String>,
    /// Prefill/decode role: a Kubernetes pod's `llm-d.ai/role` label, a file entry's `role`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<scorer_core::disagg::EndpointRole>,
}

/// How a discovered IP becomes an endpoint: the ports and model every replica shares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointTemplate {
    /// vLLM's HTTP port.
    pub port: u16,
    /// KV-event publisher port.
    pub kv_events_port: Option<u16>,
    /// KV-event replay port.
    pub kv_events_replay_port: Option<u16>,
    /// Served model name.
    pub model: Option<String>,
    /// vLLM's `--data-parallel-size` of every replica (see `endpoints[].data_parallel_size`).
    pub data_parallel_size: Option<u32>,
}

impl EndpointTemplate {
    /// The endpoints at `ip`, named `name`: the replica, or one per data-parallel rank
    /// (`ip:port#dp<rank>`, KV-event ports offset by the rank as vLLM binds them); addresses
    /// use the canonical `SocketAddr` text.
    pub fn endpoints(&self, ip: std::net::IpAddr, name: &str) -> Vec<DiscoveredEndpoint> {
        let at = |port: u16| std::net::SocketAddr::new(ip, port).to_string();
        let server = crate::config::EndpointConfig {
            address: at(self.port),
            kv_events: self.kv_events_port.map(|p| format!("tcp://{}", at(p))),
            kv_events_replay: self
                .kv_events_replay_port
                .map(|p| format!("tcp://{}", at(p))),
            model: self.model.clone(),
            data_parallel_size: self.data_parallel_size,
            ..crate::config::EndpointConfig::default()
        };
        server
            .engines()
            .into_iter()
            .map(|e| DiscoveredEndpoint {
                address: e.address,
                kv_events: e.kv_events,
                kv_events_replay: e.kv_events_replay,
                model: e.model,
                name: Some(name.to_string()),
                role: None,
            })
            .collect()
    }
}

/// The current replicas, keyed by address. (Not scorer-core's `EndpointSet`, the prefix
/// index's bitset of endpoint ids: one name per concept.)
pub type DiscoveredEndpoints = BTreeMap<String, DiscoveredEndpoint>;

/// What changed between two endpoint sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointDiff {
    /// New addresses, and addresses whose replica changed (re-created pod, new ports).
    pub added: Vec<DiscoveredEndpoint>,
    /// Addresses that are gone.
    pub removed: Vec<String>,
}

impl EndpointDiff {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

/// Compares what was applied with what discovery now reports.
///
/// An address whose endpoint changed in any other way (a re-created pod that got the same IP,
/// new KV-event ports, another model) is reported as removed and added again, so a consumer
/// forgets the old replica's cache state and re-subscribes instead of keeping stale state.
pub fn diff(old: &DiscoveredEndpoints, new: &DiscoveredEndpoints) -> EndpointDiff {
    let mut d = EndpointDiff::default();
    for (address, before) in old {
        match new.get(address) {
            None => d.removed.push(address.clone()),
            Some(now) if now != before => {
                d.removed.push(address.clone());
                d.added.push(now.clone());
            }
            Some(_) => {}
        }
    }
    for (address, now) in new {
        if !old.contains_key(address) {
            d.added.push(now.clone());
        }
    }
    d
}

/// The optional `discovery:` config section: exactly one of its keys.
///
/// A struct of options rather than an enum so the YAML reads `discovery: {kubernetes: {...}}`
/// (serde_yaml_ng would want a `!kubernetes` tag for an enum).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Watch pods through the Kubernetes API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesDiscovery>,
    /// Resolve a (headless Service) DNS name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsDiscovery>,
    /// Poll a file listing the endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<FileDiscovery>,
}

/// Which InferencePool to follow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolRef {
    /// The pool's name (in the discovery namespace).
    pub name: String,
    /// `group/version` of the InferencePool API.
    #[serde(default = "default_pool_api_version")]
    pub api_version: String,
}

fn default_pool_api_version() -> String {
    "inference.networking.k8s.io/v1".into()
}

/// Pods as endpoints, via the Kubernetes API (list, then watch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesDiscovery {
    /// Namespace of the pods; default: the control plane's own (service-account namespace).
    pub namespace: Option<String>,
    /// Pods to select (`matchLabels` / `matchExpressions`); exclusive with `inference_pool`.
    pub selector: Option<LabelSelector>,
    /// Follow this InferencePool's selector and target port instead of `selector`.
    pub inference_pool: Option<InferencePoolRef>,
    /// vLLM's HTTP port on the pods; required with `selector`, overrides the pool's port.
    pub port: Option<u16>,
    /// Port of vLLM's KV-event ZMQ publisher (`--kv-events-config ... tcp://*:PORT`), if used.
    pub kv_events_port: Option<u16>,
    /// Port of vLLM's KV-event replay socket (`replay_endpoint`), if used.
    pub kv_events_replay_port: Option<u16>,
    /// Served model name of these replicas (see `endpoints[].model`).
    pub model: Option<String>,
    /// vLLM's `--data-parallel-size` of these replicas (see `endpoints[].data_parallel_size`).
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    /// API server base URL; default: in-cluster `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
    /// `http://127.0.0.1:8001` works with `kubectl proxy`.
    pub api_server: Option<String>,
    /// Bearer token file, re-read on every request (projected tokens rotate).
    #[serde(default = "default_token_file")]
    pub token_file: Option<PathBuf>,
    /// CA bundle for the API server's certificate (https only).
    #[serde(default = "default_ca_file")]
    pub ca_file: Option<PathBuf>,
    /// How long one watch request lasts before it is renewed (the server ends it then).
    #[serde(default = "default_watch_timeout_s")]
    pub watch_timeout_s: u64,
    /// Deadline for connecting and for list/get answers.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
}

/// Where Kubernetes mounts a pod's service-account credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn default_token_file() -> Option<PathBuf> {
    Some(PathBuf::from(SERVICE_ACCOUNT_DIR).join("token"))
}

fn default_ca_file() -> Option<PathBuf> {
    Some(PathBuf::from(SERVICE_ACCOUNT_DIR).join("ca.crt"))
}

fn default_watch_timeout_s() -> u64 {
    290
}

fn default_request_timeout_ms() -> u64 {
    10_000
}

/// Replicas from DNS: every A/AAAA record of `name`, on `port`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsDiscovery {
    /// A headless Service (`vllm.llm.svc.cluster.local`) or any name with one record per replica.
    pub name: String,
    /// vLLM's HTTP port.
    pub port: u16,
    /// Port of the KV-event publisher on every replica, if used.
    pub kv_events_port: Option<u16>,
    /// Port of the KV-event replay socket on every replica, if used.
    pub kv_events_replay_port: Option<u16>,
    /// Served model name of these replicas (see `endpoints[].model`).
    pub model: Option<String>,
    /// vLLM's `--data-parallel-size` of these replicas (see `endpoints[].data_parallel_size`).
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    /// How often the name is resolved again.
    #[serde(default = "default_dns_interval_ms")]
    pub interval_ms: u64,
}

fn default_dns_interval_ms() -> u64 {
    5_000
}

/// Replicas from a file (see [`file`] for its format and the write-then-rename rule).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDiscovery {
    /// The endpoint file.
    pub path: PathBuf,
    /// How often its modification time and size are checked.
    #[serde(default = "default_file_interval_ms")]
    pub interval_ms: u64,
}

fn default_file_interval_ms() -> u64 {
    1_000
}

/// Why a `discovery:` section cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DiscoveryConfigError {
    /// Not exactly one of `kubernetes`, `dns` and `file`.
    #[error("discovery needs exactly one of `kubernetes`, `dns` and `file`")]
    OneSource,
    /// Neither or both of `selector` and `inference_pool`.
    #[error("discovery.kubernetes needs exactly one of `selector` and `inference_pool`")]
    SelectorOrPool,
    /// `selector` without `port`.
    #[error("discovery.kubernetes.port is required with `selector`")]
    MissingPort,
    /// A selector that selects everything, or is malformed.
    #[error("discovery.kubernetes.selector: {0}")]
    Selector(String),
    /// A value out of its range.
    #[error("discovery.{field} = {value} is out of range ({range})")]
    OutOfRange {
        /// Dotted path.
        field: &'static str,
        /// As written.
        value: String,
        /// What is accepted.
        range: &'static str,
    },
    /// An unusable API server URL or pool API version.
    #[error("discovery.{field}: {reason}")]
    Bad {
        /// Dotted path.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

impl DiscoveryConfig {
    /// Checks the section once at startup, so a typo stops the process instead of a watch loop
    /// retrying forever.
    pub fn validate(&self) -> Result<(), DiscoveryConfigError> {
        match (&self.kubernetes, &self.dns, &self.file) {
            (Some(k), None, None) => k.validate(),
            (None, Some(d), None) => d.validate(),
            (None, None, Some(f)) => f.validate(),
            _ => Err(DiscoveryConfigError::OneSource),
        }
    }
}

fn port_ok(field: &'static str, port: Option<u16>) -> Result<(), DiscoveryConfigError> {
    if port == Some(0) {
        return Err(DiscoveryConfigError::OutOfRange {
            field,
            value: "0".into(),
            range: "1..=65535",
        });
    }
    Ok(())
}

/// A data-parallel size must be 1..=[`crate::config::MAX_DATA_PARALLEL_SIZE`].
fn ranks_ok(field: &'static str, size: Option<u32>) -> Result<(), DiscoveryConfigError> {
    match size {
        Some(n) if n == 0 || n > crate::config::MAX_DATA_PARALLEL_SIZE => {
            Err(DiscoveryConfigError::OutOfRange {
                field,
                value: n.to_string(),
                range: "1..=1024",
            })
        }
        _ => Ok(()),
    }
}

impl KubernetesDiscovery {
    /// The ports and model every ready pod gets, with `port` (configured or the pool's).
    pub fn template(&self, port: u16) -> EndpointTemplate {
        EndpointTemplate {
            port,
            kv_events_port: self.kv_events_port,
            kv_events_replay_port: self.kv_events_replay_port,
            model: self.model.clone(),
            data_parallel_size: self.data_parallel_size,
        }
    }

    fn validate(&self) -> Result<(), DiscoveryConfigError> {
        match (&self.selector, &self.inference_pool) {
            (Some(selector), None) => {
                if self.port.is_none() {
                    return Err(DiscoveryConfigError::MissingPort);
                }
                if selector.is_empty() {
                    return Err(DiscoveryConfigError::Selector(
                        "empty: it would select every pod in the namespace".into(),
                    ));
                }
                selector
                    .validate()
                    .map_err(|e| DiscoveryConfigError::Selector(e.to_string()))?;
            }
            (None, Some(pool)) => {
                let parts: Vec<&str> = pool.api_version.split('/').collect();
                if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
                    return Err(DiscoveryConfigError::Bad {
                        field: "kubernetes.inference_pool.api_version",
                        reason: format!("{:?} is not group/version", pool.api_version),
                    });
                }
                if pool.name.is_empty() {
                    return Err(DiscoveryConfigError::Bad {
                        field: "kubernetes.inference_pool.name",
                        reason: "empty".into(),
                    });
                }
            }
            _ => return Err(DiscoveryConfigError::SelectorOrPool),
        }
        port_ok("kubernetes.port", self.port)?;
        port_ok("kubernetes.kv_events_port", self.kv_events_port)?;
        ranks_ok("kubernetes.data_parallel_size", self.data_parallel_size)?;
        port_ok(
            "kubernetes.kv_events_replay_port",
            self.kv_events_replay_port,
        )?;
        if !(10..=3600).contains(&self.watch_timeout_s) {
            return Err(DiscoveryConfigError::OutOfRange {
                field: "kubernetes.watch_timeout_s",
                value: self.watch_timeout_s.to_string(),
                range: "10..=3600",
            });
        }
        if !(100..=600_000).contains(&self.request_timeout_ms) {
            return Err(DiscoveryConfigError::OutOfRange {
                field: "kubernetes.request_timeout_ms",
                value: self.request_timeout_ms.to_string(),
                range: "100..=600000",
            });
        }
        if let Some(url) = &self.api_server {
            kube_client::ApiServer::parse(url).map_err(|e| DiscoveryConfigError::Bad {
                field: "kubernetes.api_server",
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }
}

impl DnsDiscovery {
    /// The ports and model every resolved address gets.
    pub fn template(&self) -> EndpointTemplate {
        EndpointTemplate {
            port: self.port,
            kv_events_port: self.kv_events_port,
            kv_events_replay_port: self.kv_events_replay_port,
            model: self.model.clone(),
            data_parallel_size: self.data_parallel_size,
        }
    }

    fn validate(&self) -> Result<(), DiscoveryConfigError> {
        if self.name.is_empty() || self.name.contains(['/', ':', ' ']) {
            return Err(DiscoveryConfigError::Bad {
                field: "dns.name",
                reason: format!("{:?} is not a host name", self.name),
            });
        }
        port_ok("dns.port", Some(self.port))?;
        port_ok("dns.kv_events_port", self.kv_events_port)?;
        ranks_ok("dns.data_parallel_size", self.data_parallel_size)?;
        port_ok("dns.kv_events_replay_port", self.kv_events_replay_port)?;
        if !(100..=3_600_000).contains(&self.interval_ms) {
            return Err(DiscoveryConfigError::OutOfRange {
                field: "dns.interval_ms",
                value: self.interval_ms.to_string(),
                range: "100..=3600000",
            });
        }
        Ok(())
    }
}

impl FileDiscovery {
    fn validate(&self) -> Result<(), DiscoveryConfigError> {
        if self.path.as_os_str().is_empty() {
            return Err(DiscoveryConfigError::Bad {
                field: "file.path",
                reason: "empty".into(),
            });
        }
        if !(10..=3_600_000).contains(&self.interval_ms) {
            return Err(DiscoveryConfigError::OutOfRange {
                field: "file.interval_ms",
                value: self.interval_ms.to_string(),
                range: "10..=3600000",
            });
        }
        Ok(())
    }
}

/// Runs the configured source until the task is dropped, publishing every change into `tx`.
///
/// `tx` starts at `None` ("nothing discovered yet"); a consumer should not remove statically
/// configured endpoints before the first `Some`.
///
/// Call it with a validated config; a config without a source publishes nothing.
pub async fn run(config: DiscoveryConfig, tx: watch::Sender<Option<DiscoveredEndpoints>>) {
    match (config.kubernetes, config.dns, config.file) {
        (Some(k), _, _) => kube_client::run(k, tx).await,
        (None, Some(d), _) => dns::run(d, tx).await,
        (None, None, Some(f)) => file::run(f, tx).await,
        (None, None, None) => tracing::error!("discovery has no source; nothing to discover"),
    }
}

/// Publishes `set` unless it equals what is already there; returns whether it changed.
pub(crate) fn publish(
    tx: &watch::Sender<Option<DiscoveredEndpoints>>,
    set: DiscoveredEndpoints,
) -> bool {
    tx.send_if_modified(|current| {
        if current.as_ref() == Some(&set) {
            false
        } else {
            *current = Some(set);
            true
        }
    })
}

/// Exponential retry delay between `min` and `max`, reset after a success.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            next: min,
        }
    }

    /// The delay to wait now; doubles the next one.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

/// Asserts that `e` publishes KV events on `ip`'s ports 5557 (live) and 5558 (replay), as
/// the discovery tests' fixtures configure every source.
#[cfg(test)]
pub(crate) fn assert_publishes_on(e: &DiscoveredEndpoint, ip: &str) {
    let socket = |port: u16| Some(format!("tcp://{ip}:{port}"));
    assert_eq!(
        (e.kv_events.clone(), e.kv_events_replay.clone()),
        (socket(5557), socket(5558)),
        "{e:?}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(address: &str, kv: Option<&str>) -> DiscoveredEndpoint {
        DiscoveredEndpoint {
            address: address.into(),
            kv_events: kv.map(str::to_string),
            kv_events_replay: None,
            model: None,
            name: None,
            role: None,
        }
    }

    fn set(eps: &[DiscoveredEndpoint]) -> DiscoveredEndpoints {
        eps.iter().map(|e| (e.address.clone(), e.clone())).collect()
    }

    #[test]
    fn diff_reports_churn_and_resubscriptions() {
        let old = set(&[
            ep("10.0.0.1:8000", Some("tcp://10.0.0.1:5557")),
            ep("10.0.0.2:8000", None),
            ep("10.0.0.3:8000", Some("tcp://10.0.0.3:5557")),
        ]);
        let new = set(&[
            ep("10.0.0.1:8000", Some("tcp://10.0.0.1:5557")),
            ep("10.0.0.3:8000", Some("tcp://10.0.0.3:6000")),
            ep("10.0.0.4:8000", None),
        ]);
        let d = diff(&old, &new);
        assert_eq!(d.removed, vec!["10.0.0.2:8000", "10.0.0.3:8000"]);
        assert_eq!(
            d.added,
            vec![
                ep("10.0.0.3:8000", Some("tcp://10.0.0.3:6000")),
                ep("10.0.0.4:8000", None)
            ]
        );
        assert!(diff(&new, &new).is_empty());
        // Same address, another pod (re-created with a recycled IP): forget and re-add.
        let mut renamed = new.clone();
        renamed.get_mut("10.0.0.4:8000").unwrap().name = Some("llm/vllm-9".into());
        let d = diff(&new, &renamed);
        assert_eq!(d.removed, vec!["10.0.0.4:8000"]);
        assert_eq!(d.added.len(), 1);
        assert_eq!(diff(&DiscoveredEndpoints::new(), &new).added.len(), 3);
    }

    fn parse(yaml: &str) -> Result<DiscoveryConfig, String> {
        let c: DiscoveryConfig = serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn config_shapes() {
        let k = parse(
            "kubernetes:\n  selector:\n    matchLabels: {app: vllm}\n  port: 8000\n  kv_events_port: 5557\n",
        )
        .unwrap();
        let k = k.kubernetes.unwrap();
        assert_eq!(k.watch_timeout_s, 290);
        assert_eq!(
            k.token_file.as_deref(),
            Some(std::path::Path::new(
                "/var/run/secrets/kubernetes.io/serviceaccount/token"
            ))
        );
        let p = parse("kubernetes:\n  inference_pool: {name: llama3}\n")
            .unwrap()
            .kubernetes
            .unwrap();
        assert_eq!(
            p.inference_pool.unwrap().api_version,
            "inference.networking.k8s.io/v1"
        );
        let d = parse("dns: {name: vllm.llm.svc.cluster.local, port: 8000}\n").unwrap();
        assert_eq!(
            d.dns,
            Some(DnsDiscovery {
                name: "vllm.llm.svc.cluster.local".into(),
                port: 8000,
                kv_events_port: None,
                kv_events_replay_port: None,
                model: None,
                data_parallel_size: None,
                interval_ms: 5000
            })
        );
        let f = parse("file: {path: /etc/kvroute/endpoints.yaml}\n").unwrap();
        assert_eq!(
            f.file,
            Some(FileDiscovery {
                path: PathBuf::from("/etc/kvroute/endpoints.yaml"),
                interval_ms: 1000
            })
        );
    }

    #[test]
    fn config_mistakes_are_named() {
        let cases = [
            ("kubernetes: {port: 8000}\n", "exactly one of"),
            (
                "kubernetes: {selector: {matchLabels: {a: b}}, inference_pool: {name: p}}\n",
                "exactly one of",
            ),
            (
                "kubernetes: {selector: {matchLabels: {a: b}}}\n",
                "port is required",
            ),
            ("kubernetes: {selector: {}, port: 1}\n", "select every pod"),
            (
                "kubernetes: {selector: {matchExpressions: [{key: a, operator: In}]}, port: 1}\n",
                "needs values",
            ),
            (
                "kubernetes: {selector: {matchLabels: {a: b}}, port: 0}\n",
                "kubernetes.port = 0",
            ),
            (
                "kubernetes: {inference_pool: {name: p, api_version: v1}}\n",
                "group/version",
            ),
            (
                "kubernetes: {inference_pool: {name: p}, watch_timeout_s: 1}\n",
                "watch_timeout_s",
            ),
            (
                "kubernetes: {inference_pool: {name: p}, api_server: 'ftp://x'}\n",
                "api_server",
            ),
            (
                "kubernetes: {inference_pool: {name: p}, labels: {}}\n",
                "unknown field `labels`",
            ),
            ("dns: {name: 'a b', port: 1}\n", "not a host name"),
            ("dns: {name: a, port: 1, interval_ms: 5}\n", "interval_ms"),
            ("dns: {name: a}\n", "missing field `port`"),
            ("consul: {name: a}\n", "unknown field `consul`"),
            ("{}\n", "exactly one of `kubernetes`, `dns` and `file`"),
            (
                "dns: {name: a, port: 1}\nkubernetes: {inference_pool: {name: p}}\n",
                "exactly one of",
            ),
            (
                "dns: {name: a, port: 1}\nfile: {path: /etc/kvroute/endpoints.yaml}\n",
                "exactly one of",
            ),
            ("file: {path: ''}\n", "file.path: empty"),
            ("file: {path: e.yaml, interval_ms: 0}\n", "file.interval_ms"),
            ("file: {interval_ms: 100}\n", "missing field `path`"),
        ];
        for (yaml, want) in cases {
            let e = parse(yaml).unwrap_err();
            assert!(e.contains(want), "{yaml}: {e}");
        }
    }

    #[test]
    fn publish_only_on_change() {
        let (tx, mut rx) = watch::channel(None);
        let s = set(&[ep("10.0.0.1:8000", None)]);
        assert!(publish(&tx, s.clone()));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        assert!(!publish(&tx, s));
        assert!(!rx.has_changed().unwrap());
        assert!(publish(&tx, DiscoveredEndpoints::new()));
    }

    #[test]
    fn backoff_doubles_to_a_cap() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let got: Vec<u128> = (0..4).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, vec![100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next_delay().as_millis(), 100);
    }
}
