//! Peer routers from PyPI (`sglang-router`, `vllm-router`) started in front of a simulated
//! fleet, so `kvroute-bench` compares kvroute with what people run instead of it.
//!
//! Both come from the project-local venv `.venv-bench` that `make bench-setup`
//! (`scripts/bench-setup.sh`) installs with pinned versions. They bind 127.0.0.1 only (router and
//! Prometheus ports) and run their `cache_aware` policy with its documented defaults.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvroute_harness::{self as harness, HttpClient, ManagedProcess};

/// Errors starting a peer router.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The venv or its entry point is missing (run `make bench-setup`).
    #[error("{peer}: {path} not found; run `make bench-setup`")]
    NotInstalled {
        /// Peer label.
        peer: &'static str,
        /// Missing executable.
        path: String,
    },
    /// Spawning or port selection failed.
    #[error("{0}")]
    Harness(#[from] harness::HarnessError),
    /// The router did not list every worker as ready in time.
    #[error("{peer} not ready within {timeout:?}: {reason}\n{tail}")]
    NotReady {
        /// Peer label.
        peer: &'static str,
        /// How long we waited.
        timeout: Duration,
        /// Last probe result.
        reason: String,
        /// End of the router's log.
        tail: String,
    },
}

/// Which peer router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// `sglang-router` 0.3.2 (`smg launch`), policy `cache_aware` (character radix tree).
    Sglang,
    /// `vllm-router` 0.1.17, policy `cache_aware` (token radix tree from the workers' render API).
    Vllm,
}

impl Peer {
    /// Both peers, in table order.
    pub const ALL: [Peer; 2] = [Peer::Sglang, Peer::Vllm];

    /// Name in tables and `summary.json`.
    pub fn label(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang-router",
            Peer::Vllm => "vllm-router",
        }
    }

    /// The pinned PyPI version (kept equal to `scripts/bench-setup.sh`).
    pub fn version(self) -> &'static str {
        match self {
            Peer::Sglang => "0.3.2",
            Peer::Vllm => "0.1.17",
        }
    }

    fn executable(self, venv: &Path) -> PathBuf {
        venv.join("bin").join(match self {
            Peer::Sglang => "smg",
            Peer::Vllm => "vllm-router",
        })
    }
}

/// The bench venv: `$KVROUTE_BENCH_VENV` or `<workspace>/.venv-bench`.
pub fn bench_venv() -> PathBuf {
    std::env::var_os("KVROUTE_BENCH_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| harness::workspace_root().join(".venv-bench"))
}

/// Whether `peer` is installed in the bench venv.
pub fn installed(peer: Peer) -> bool {
    peer.executable(&bench_venv()).is_file()
}

/// A running peer router; killed on drop.
#[derive(Debug)]
pub struct PeerRouter {
    /// Which one.
    pub peer: Peer,
    /// `http://127.0.0.1:port`.
    pub url: String,
    process: ManagedProcess,
}

impl PeerRouter {
    /// The router's OS process id (its CPU per request in the overhead section).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Starts `peer` on a free loopback port in front of `workers` (`127.0.0.1:port` each) and
    /// waits until it lists every worker (sglang: `GET /workers`; vllm-router registers them
    /// before it listens, so its `GET /health` answering is enough).
    pub async fn start(
        peer: Peer,
        workers: &[String],
        log_dir: &Path,
        client: &HttpClient,
    ) -> Result<PeerRouter, PeerError> {
        let exe = peer.executable(&bench_venv());
        if !exe.is_file() {
            return Err(PeerError::NotInstalled {
                peer: peer.label(),
                path: exe.display().to_string(),
            });
        }
        let port = harness::free_port()?;
        let prom_port = harness::free_port()?;
        let worker_urls: Vec<String> = workers.iter().map(|w| format!("http://{w}")).collect();
        let mut cmd = Command::new(&exe);
        if peer == Peer::Sglang {
            cmd.arg("launch");
        }
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &prom_port.to_string()])
            .args(["--policy", "cache_aware"])
            .arg("--worker-urls")
            .args(&worker_urls)
            // Peers that call HF on start-up would hang on a network-less machine otherwise.
            .env("HF_HUB_OFFLINE", "1");
        match peer {
            Peer::Sglang => cmd.args(["--log-level", "warn"]),
            Peer::Vllm => cmd.args(["--log-level", "warning"]),
        };
        let log = log_dir.join(format!("{}.log", peer.label()));
        let mut process = ManagedProcess::spawn(peer.label(), cmd, &log)?;
        let url = format!("http://127.0.0.1:{port}");
        let timeout = Duration::from_secs(60);
        let started = Instant::now();
        let mut reason;
        loop {
            if let Some(status) = process.exited() {
                return Err(PeerError::NotReady {
                    peer: peer.label(),
                    timeout,
                    reason: format!("exited with {status}"),
                    tail: process.log_tail(30),
                });
            }
            match ready(peer, &url, workers.len(), client).await {
                Ok(()) => break,
                Err(r) => reason = r,
            }
            if started.elapsed() > timeout {
                return Err(PeerError::NotReady {
                    peer: peer.label(),
                    timeout,
                    reason,
                    tail: process.log_tail(30),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(PeerRouter { peer, url, process })
    }

    /// Stops the router (also done on drop).
    pub fn stop(&mut self) {
        self.process.kill();
    }
}

/// Readiness probe: `Ok` once the router will spread requests over all `workers`.
async fn ready(peer: Peer, url: &str, workers: usize, client: &HttpClient) -> Result<(), String> {
    let probe = Duration::from_secs(2);
    match peer {
        Peer::Sglang => {
            let resp = client
                .get(&format!("{url}/workers"), probe)
                .await
                .map_err(|e| e.to_string())?;
            let listed = count_healthy_workers(&resp.body);
            if resp.status == 200 && listed >= workers {
                Ok(())
            } else {
                Err(format!(
                    "GET /workers: status {}, {listed} of {workers} workers",
                    resp.status
                ))
            }
        }
        Peer::Vllm => {
            let resp = client
                .get(&format!("{url}/health"), probe)
                .await
                .map_err(|e| e.to_string())?;
            if resp.status == 200 {
                Ok(())
            } else {
                Err(format!("GET /health: status {}", resp.status))
            }
        }
    }
}

/// Workers in sglang-router's `GET /workers` answer that are healthy (or carry no health
/// field): `{"workers":[{"url":..,"is_healthy":true,..}],..}`.
fn count_healthy_workers(body: &str) -> usize {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return 0;
    };
    v.get("workers").and_then(|w| w.as_array()).map_or(0, |ws| {
        ws.iter()
            .filter(|w| w.get("is_healthy").and_then(|h| h.as_bool()) != Some(false))
            .count()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_workers_are_counted_from_the_workers_listing() {
        let body = r#"{"workers":[{"url":"http://a","is_healthy":true},
            {"url":"http://b","is_healthy":false},{"url":"http://c"}],"total":3}"#;
        assert_eq!(count_healthy_workers(body), 2);
        assert_eq!(count_healthy_workers("not json"), 0);
        assert_eq!(count_healthy_workers(r#"{"workers":[]}"#), 0);
    }

    #[test]
    fn labels_are_the_pypi_names() {
        assert_eq!(Peer::Sglang.label(), "sglang-router");
        assert_eq!(Peer::Vllm.label(), "vllm-router");
    }
}
