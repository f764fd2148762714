//! Many scrape targets in one process, for the control plane's HTTP decisions/s benchmark.
//!
//! Routing cost depends on how many endpoints are usable, and an endpoint is usable only while
//! its `/metrics` answers. Sixty-four `vllm-sim` processes would crowd a 2-core machine, so
//! the benchmark takes the Prometheus text of one real `vllm-sim` and serves it from 64
//! loopback listeners in this process: the control plane scrapes vLLM-format metrics (running,
//! waiting, KV usage, KV capacity) from every endpoint, as it would from a fleet at rest.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Listeners serving one fixed Prometheus text at `/metrics` (and 200 at `/health`); the
/// tasks stop when this is dropped.
#[derive(Debug)]
pub struct MetricsFleet {
    /// `127.0.0.1:port` of every listener.
    pub addresses: Vec<String>,
    tasks: Vec<JoinHandle<()>>,
}

impl MetricsFleet {
    /// Binds `n` listeners on 127.0.0.1 (free ports) serving `metrics_text`.
    pub async fn start(n: usize, metrics_text: String) -> std::io::Result<MetricsFleet> {
        let app = Router::new()
            .route(
                "/metrics",
                get(move || std::future::ready(metrics_text.clone())),
            )
            .route("/health", get(|| std::future::ready("")));
        let mut addresses = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for _ in 0..n {
            let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
            addresses.push(listener.local_addr()?.to_string());
            let app = app.clone();
            tasks.push(tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            }));
        }
        Ok(MetricsFleet { addresses, tasks })
    }
}

impl Drop for MetricsFleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_listener_serves_the_metrics_text() {
        let fleet = MetricsFleet::start(3, "vllm:num_requests_running 2\n".into())
            .await
            .unwrap();
        assert_eq!(fleet.addresses.len(), 3);
        let client = kvroute_harness::HttpClient::new();
        for a in &fleet.addresses {
            let r = client
                .get(
                    &format!("http://{a}/metrics"),
                    std::time::Duration::from_secs(5),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200);
            assert!(r.body.contains("vllm:num_requests_running 2"));
        }
    }
}
