//! DNS discovery: every A/AAAA record of a name is one replica.
//!
//! Made for a Kubernetes headless Service (`clusterIP: None`), whose name resolves to the IPs
//! of its ready pods, so it works without API access; any name with one record per replica
//! does. Resolution uses the system resolver (`getaddrinfo` via tokio), bounded by a timeout.
//! A failed or empty answer keeps the previous set: a DNS hiccup must not drain the fleet.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;

use super::{Backoff, DiscoveredEndpoints, DnsDiscovery, EndpointTemplate, publish};

/// Longest a single resolution may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a resolution gave nothing usable.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The resolver failed (NXDOMAIN, SERVFAIL, no network).
    #[error("resolving {name}: {source}")]
    Resolve {
        /// The name.
        name: String,
        /// The resolver's error.
        source: std::io::Error,
    },
    /// The resolver did not answer in time.
    #[error("resolving {0}: timed out")]
    Timeout(String),
    /// The name has no address records.
    #[error("{0} has no addresses")]
    Empty(String),
}

/// Turns resolved socket addresses into endpoints (deduplicated, canonical text).
pub fn endpoints_from_addrs(
    name: &str,
    addrs: impl IntoIterator<Item = SocketAddr>,
    template: &EndpointTemplate,
) -> DiscoveredEndpoints {
    addrs
        .into_iter()
        .flat_map(|a| template.endpoints(a.ip(), name))
        .map(|e| (e.address.clone(), e))
        .collect()
}

/// Resolves `config.name` once.
pub async fn resolve(config: &DnsDiscovery) -> Result<DiscoveredEndpoints, DnsError> {
    let lookup = tokio::net::lookup_host((config.name.as_str(), config.port));
    let addrs = tokio::time::timeout(RESOLVE_TIMEOUT, lookup)
        .await
        .map_err(|_| DnsError::Timeout(config.name.clone()))?
        .map_err(|source| DnsError::Resolve {
            name: config.name.clone(),
            source,
        })?;
    let set = endpoints_from_addrs(&config.name, addrs, &config.template());
    if set.is_empty() {
        return Err(DnsError::Empty(config.name.clone()));
    }
    Ok(set)
}

/// Resolves on `interval_ms` forever, publishing changes; retries failures sooner, with backoff.
pub async fn run(config: DnsDiscovery, tx: watch::Sender<Option<DiscoveredEndpoints>>) {
    let interval = Duration::from_millis(config.interval_ms);
    let mut backoff = Backoff::new(Duration::from_millis(200).min(interval), interval);
    loop {
        let wait = match resolve(&config).await {
            Ok(set) => {
                let count = set.len();
                if publish(&tx, set) {
                    tracing::info!(name = %config.name, endpoints = count, "DNS discovery: endpoint set changed");
                }
                backoff.reset();
                interval
            }
            Err(e) => {
                tracing::warn!(error = %e, "DNS discovery failed; keeping the last endpoint set");
                backoff.next_delay()
            }
        };
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_canonical_and_deduplicated() {
        let addrs: Vec<SocketAddr> = vec![
            "10.1.0.7:0".parse().unwrap(),
            "10.1.0.7:0".parse().unwrap(),
            "10.1.0.5:0".parse().unwrap(),
            "[fd00::0:5]:0".parse().unwrap(),
        ];
        let template = EndpointTemplate {
            port: 8000,
            kv_events_port: Some(5557),
            kv_events_replay_port: None,
            model: None,
            data_parallel_size: None,
        };
        let set = endpoints_from_addrs("vllm.llm.svc", addrs.clone(), &template);
        assert_eq!(
            set.keys().collect::<Vec<_>>(),
            vec!["10.1.0.5:8000", "10.1.0.7:8000", "[fd00::5]:8000"]
        );
        assert_eq!(
            set["[fd00::5]:8000"].kv_events.as_deref(),
            Some("tcp://[fd00::5]:5557")
        );
        assert_eq!(set["10.1.0.5:8000"].name.as_deref(), Some("vllm.llm.svc"));
        // Data-parallel replicas: one endpoint per rank, its KV events on the port + rank.
        let ranks = EndpointTemplate {
            data_parallel_size: Some(2),
            ..template
        };
        let set = endpoints_from_addrs("vllm.llm.svc", addrs, &ranks);
        assert_eq!(set.len(), 6);
        assert_eq!(
            set["10.1.0.7:8000#dp1"].kv_events.as_deref(),
            Some("tcp://10.1.0.7:5558")
        );
    }

    fn config(name: &str) -> DnsDiscovery {
        DnsDiscovery {
            name: name.into(),
            port: 8000,
            kv_events_port: None,
            kv_events_replay_port: None,
            model: None,
            data_parallel_size: None,
            interval_ms: 100,
        }
    }

    #[tokio::test]
    async fn resolves_a_local_name() {
        let set = resolve(&config("localhost")).await.unwrap();
        assert!(
            set.contains_key("127.0.0.1:8000") || set.contains_key("[::1]:8000"),
            "{set:?}"
        );
        let ip = resolve(&config("127.0.0.9")).await.unwrap();
        assert_eq!(ip.keys().collect::<Vec<_>>(), vec!["127.0.0.9:8000"]);
    }

    #[tokio::test]
    async fn failures_keep_the_last_set() {
        // `.invalid` never resolves (RFC 6761), and without network the resolver fails fast.
        let e = resolve(&config("kvroute-test.invalid")).await.unwrap_err();
        assert!(e.to_string().contains("kvroute-test.invalid"), "{e}");

        let (tx, mut rx) = watch::channel(None);
        let task = tokio::spawn(run(config("127.0.0.9"), tx));
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .expect("published in time")
            .unwrap();
        let got = rx.borrow_and_update().clone().unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), vec!["127.0.0.9:8000"]);
        // Later rounds resolve the same set: nothing new is published.
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(!rx.has_changed().unwrap());
        task.abort();
    }
}
