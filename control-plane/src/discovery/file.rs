//! File discovery: the replicas are listed in a YAML (or JSON) file that something else keeps
//! up to date: Consul-template, config management, a script, or a test.
//!
//! The file has the shape of the static config's `endpoints:` section, so entries can be moved
//! between the two; an entry may also be a bare `ip:port` string:
//!
//! ```yaml
//! endpoints:
//!   - 10.0.0.5:8000
//!   - address: 10.0.0.6:8000
//!     model: llama3
//!     kv_events: tcp://10.0.0.6:5557
//!     kv_events_replay: tcp://10.0.0.6:5558
//! ```
//!
//! The file is polled every `interval_ms`; it is read again only when its modification time or
//! size changed, and the set is published only when its content changed. A missing, unreadable,
//! malformed or empty file keeps the last good set and logs one error per distinct problem:
//! a half-written file must never drain the fleet. Writers should still write a temporary file
//! in the same directory and `rename` it over the path (atomic on POSIX), which is also what
//! Envoy's file-based EDS needs.

use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::sync::watch;

use super::{DiscoveredEndpoint, DiscoveredEndpoints, FileDiscovery, publish};
use crate::config::{Config, EndpointConfig};

/// Largest endpoint file read; anything bigger is a mistake, not a fleet.
const MAX_FILE_BYTES: u64 = 4 << 20;

/// Why the endpoint file gave no usable set.
#[derive(Debug, thiserror::Error)]
pub enum FileDiscoveryError {
    /// The file cannot be read (missing, permissions).
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("{path} is {bytes} bytes, more than the {MAX_FILE_BYTES} accepted")]
    TooLarge {
        /// The file.
        path: String,
        /// Its size.
        bytes: u64,
    },
    /// Not YAML of the expected shape.
    #[error("parsing {path}: {reason}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        reason: String,
    },
    /// An entry the static config would reject too (address not canonical `ip:port`,
    /// duplicates, bad ZMQ endpoints, `model` on some entries only).
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong, naming the entry.
        reason: String,
    },
    /// No endpoints: most likely a truncated or half-written file.
    #[error("{0} lists no endpoints")]
    Empty(String),
}

/// One entry: a bare `ip:port` or a static-config endpoint.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FileEntry {
    Address(String),
    Endpoint(EndpointConfig),
}

/// The file's top level.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointFile {
    endpoints: Vec<FileEntry>,
}

/// Parses the file's text into an endpoint set, checking every entry as the static config does.
///
/// `role` and `models` are rejected: discovered endpoints do not carry them yet, and silently
/// ignoring them would route differently from what the file says.
pub fn parse_endpoint_file(
    path: &str,
    text: &str,
) -> Result<DiscoveredEndpoints, FileDiscoveryError> {
    if text.trim().is_empty() {
        return Err(FileDiscoveryError::Empty(path.to_string()));
    }
    let file: EndpointFile =
        serde_yaml_ng::from_str(text).map_err(|e| FileDiscoveryError::Parse {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
    if file.endpoints.is_empty() {
        return Err(FileDiscoveryError::Empty(path.to_string()));
    }
    let endpoints: Vec<EndpointConfig> = file
        .endpoints
        .into_iter()
        .map(|e| match e {
            FileEntry::Address(address) => EndpointConfig {
                address,
                ..EndpointConfig::default()
            },
            FileEntry::Endpoint(e) => e,
        })
        .collect();
    let invalid = |reason: String| FileDiscoveryError::Invalid {
        path: path.to_string(),
        reason,
    };
    for (index, e) in endpoints.iter().enumerate() {
        if e.role.is_some() || !e.models.is_empty() {
            return Err(invalid(format!(
                "endpoints[{index}]: `role` and `models` are not supported by file discovery"
            )));
        }
    }
    // The same checks as static endpoints, so both places accept the same entries.
    let check = Config {
        endpoints: endpoints.clone(),
        ..Config::default()
    };
    check.validate().map_err(|e| invalid(e.to_string()))?;
    // A data-parallel server's ranks are endpoints of their own, as in the static list.
    Ok(endpoints
        .iter()
        .flat_map(EndpointConfig::engines)
        .map(|e| {
            let endpoint = DiscoveredEndpoint {
                address: e.address.clone(),
                kv_events: e.kv_events,
                kv_events_replay: e.kv_events_replay,
                model: e.model,
                name: Some(path.to_string()),
                role: e.role,
            };
            (e.address, endpoint)
        })
        .collect())
}

/// Reads and parses the file once.
pub fn read_endpoint_file(path: &Path) -> Result<DiscoveredEndpoints, FileDiscoveryError> {
    let shown = path.display().to_string();
    let read_err = |source| FileDiscoveryError::Read {
        path: shown.clone(),
        source,
    };
    let bytes = std::fs::metadata(path).map_err(read_err)?.len();
    if bytes > MAX_FILE_BYTES {
        return Err(FileDiscoveryError::TooLarge { path: shown, bytes });
    }
    let text = std::fs::read_to_string(path).map_err(read_err)?;
    parse_endpoint_file(&shown, &text)
}

/// What identifies one version of the file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
    })
}

/// Polls the file forever, publishing every new good set; errors keep the last one.
pub async fn run(config: FileDiscovery, tx: watch::Sender<Option<DiscoveredEndpoints>>) {
    let interval = Duration::from_millis(config.interval_ms);
    let path = config.path.clone();
    // The stamp of the last version read successfully, and the last error logged.
    let mut last_good: Option<Stamp> = None;
    let mut last_error: Option<String> = None;
    loop {
        let now = stamp(&path);
        if now.is_none() || now != last_good {
            let p = path.clone();
            let result = tokio::task::spawn_blocking(move || read_endpoint_file(&p))
                .await
                .unwrap_or_else(|e| {
                    Err(FileDiscoveryError::Read {
                        path: path.display().to_string(),
                        source: std::io::Error::other(e.to_string()),
                    })
                });
            match result {
                Ok(set) => {
                    let count = set.len();
                    if publish(&tx, set) {
                        tracing::info!(path = %path.display(), endpoints = count, "file discovery: endpoint set changed");
                    }
                    if last_error.take().is_some() {
                        tracing::info!(path = %path.display(), "file discovery: the endpoint file is usable again");
                    }
                    last_good = now;
                }
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_deref() != Some(text.as_str()) {
                        tracing::error!(error = %text, "file discovery: keeping the last endpoint set");
                        last_error = Some(text);
                    }
                    // Read again next round even if the stamp does not change (a rename within
                    // the same second and size).
                    last_good = None;
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<DiscoveredEndpoints, String> {
        parse_endpoint_file("eps.yaml", text).map_err(|e| e.to_string())
    }

    #[test]
    fn bare_addresses_and_full_entries() {
        let set = parse(
            "endpoints:\n  - 127.0.0.1:8001\n  - address: 127.0.0.1:8002\n    kv_events: tcp://127.0.0.1:5557\n    kv_events_replay: tcp://127.0.0.1:5558\n",
        )
        .unwrap();
        assert_eq!(
            set.keys().collect::<Vec<_>>(),
            vec!["127.0.0.1:8001", "127.0.0.1:8002"]
        );
        let full = &set["127.0.0.1:8002"];
        crate::discovery::assert_publishes_on(full, "127.0.0.1");
        assert_eq!(full.name.as_deref(), Some("eps.yaml"));
        assert_eq!(set["127.0.0.1:8001"].kv_events, None);
        // JSON is YAML too.
        let json = parse(r#"{"endpoints": ["10.0.0.1:80", {"address": "10.0.0.2:80"}]}"#).unwrap();
        assert_eq!(json.len(), 2);
    }

    #[test]
    fn bad_files_are_named_errors() {
        let cases = [
            ("", "lists no endpoints"),
            ("   \n", "lists no endpoints"),
            ("endpoints: []\n", "lists no endpoints"),
            // A half-written file cut inside an entry.
            (
                "endpoints:\n  - address: 127.0.0.1:80\n  - address: [",
                "parsing eps.yaml",
            ),
            ("endpoints:\n  - vllm-0:8000\n", "is not ip:port"),
            ("endpoints:\n  - 127.0.0.1:0\n", "port 0"),
            (
                "endpoints:\n  - 127.0.0.1:80\n  - address: 127.0.0.1:80\n",
                "127.0.0.1:80",
            ),
            (
                "endpoints:\n  - {address: 127.0.0.1:80, kv_events: 'http://x'}\n",
                "kv_events",
            ),
            (
                "endpoints:\n  - {address: 127.0.0.1:80, role: prefill}\n",
                "not supported by file discovery",
            ),
            ("replicas:\n  - 127.0.0.1:80\n", "parsing eps.yaml"),
            (
                "endpoints:\n  - {address: 127.0.0.1:80, wieght: 2}\n",
                "parsing",
            ),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    fn write_atomically(path: &Path, text: &str) {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    async fn next(rx: &mut watch::Receiver<Option<DiscoveredEndpoints>>) -> Vec<String> {
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .expect("published in time")
            .unwrap();
        rx.borrow_and_update()
            .clone()
            .unwrap()
            .into_keys()
            .collect()
    }

    #[tokio::test]
    async fn follows_the_file_and_keeps_the_last_good_set() {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-file-discovery-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("endpoints.yaml");
        let _ = std::fs::remove_file(&path);
        let (tx, mut rx) = watch::channel(None);
        let task = tokio::spawn(run(
            FileDiscovery {
                path: path.clone(),
                interval_ms: 20,
            },
            tx,
        ));
        // Missing at first: nothing is published, so static endpoints would stay.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!rx.has_changed().unwrap());

        write_atomically(&path, "endpoints:\n  - 127.0.0.1:8001\n");
        assert_eq!(next(&mut rx).await, vec!["127.0.0.1:8001"]);

        write_atomically(
            &path,
            "endpoints:\n  - 127.0.0.1:8001\n  - 127.0.0.1:8002\n",
        );
        assert_eq!(
            next(&mut rx).await,
            vec!["127.0.0.1:8001", "127.0.0.1:8002"]
        );

        // Truncated, garbage, then deleted: the last good set stays.
        std::fs::write(&path, "").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::write(&path, "endpoints:\n  - address: [").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!rx.has_changed().unwrap());
        assert_eq!(rx.borrow().as_ref().unwrap().len(), 2);

        // Back with a smaller fleet: the removal is published.
        write_atomically(&path, "endpoints:\n  - 127.0.0.1:8002\n");
        assert_eq!(next(&mut rx).await, vec!["127.0.0.1:8002"]);
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
