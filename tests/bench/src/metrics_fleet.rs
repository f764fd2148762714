//! Many scrape targets in one process, for the control plane's HTTP decisions/s benchmark.
//!
//! Routing cost depends on how many endpoints are usable, and an endpoint is usable only while
//! its `/metrics` answers. Sixty-four `vllm-sim` processes would crowd a 2-core machine, so
//! the benchmark takes the Prometheus text of one real `vllm-sim` and serves it from 64
//! loopback listeners in this process: the control plane scrapes vLLM-format metrics (running,
//! waiting, KV usage, KV capacity) from every endpoint, as it would from a fleet at rest.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::http::Uri;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Listeners serving one fixed Prometheus text at `/metrics` (and 200 at `/health`); the
/// tasks stop when this is dropped. [`MetricsFleet::set_changing`] makes every answer differ
/// from the listener's last one, as a busy replica's do.
#[derive(Debug)]
pub struct MetricsFleet {
    /// `127.0.0.1:port` of every listener.
    pub addresses: Vec<String>,
    tasks: Vec<JoinHandle<()>>,
    changing: Arc<AtomicBool>,
}

impl MetricsFleet {
    /// Binds `n` listeners on 127.0.0.1 (free ports) serving `metrics_text`.
    pub async fn start(n: usize, metrics_text: String) -> std::io::Result<MetricsFleet> {
        Self::start_serving(n, metrics_text, false).await
    }

    /// [`MetricsFleet::start`], and with `restricted` the listeners also serve vLLM's
    /// `/metrics/?name[]=…` (only the named samples, `vllm_wire::prom::restrict_page`);
    /// without it `/metrics/` is not found, as on a server that does not have it, and a
    /// scraper falls back to the whole page.
    pub async fn start_serving(
        n: usize,
        metrics_text: String,
        restricted: bool,
    ) -> std::io::Result<MetricsFleet> {
        let text = Arc::new(metrics_text);
        let changing = Arc::new(AtomicBool::new(false));
        let mut addresses = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for _ in 0..n {
            let (text, changing) = (text.clone(), changing.clone());
            let served = Arc::new(AtomicU64::new(0));
            let metrics = move || {
                let page = if changing.load(Ordering::Relaxed) {
                    // One more engine whose running count alternates: the sum the router reads
                    // differs from this listener's previous answer.
                    let n = served.fetch_add(1, Ordering::Relaxed) % 2;
                    format!("{text}vllm:num_requests_running{{engine=\"busy\"}} {n}.0\n")
                } else {
                    text.to_string()
                };
                std::future::ready(page)
            };
            let whole = metrics.clone();
            let restricted_page = move |uri: Uri| {
                let page = whole();
                async move { vllm_wire::prom::vllm_metrics_answer(uri.path(), uri.query(), page.await) }
            };
            let mut app = Router::new()
                .route("/metrics", get(metrics))
                .route("/health", get(|| std::future::ready("")));
            if restricted {
                app = app.route(
                    vllm_wire::prom::RESTRICTED_METRICS_PATH,
                    get(restricted_page),
                );
            }
            let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
            addresses.push(listener.local_addr()?.to_string());
            tasks.push(tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            }));
        }
        Ok(MetricsFleet {
            addresses,
            tasks,
            changing,
        })
    }

    /// Whether every answer differs from the listener's previous one (a busy fleet, whose
    /// load numbers move between scrapes) or all are the same text (a fleet at rest).
    pub fn set_changing(&self, on: bool) {
        self.changing.store(on, Ordering::Relaxed);
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
        fleet.set_changing(true);
        let url = format!("http://{}/metrics", fleet.addresses[0]);
        let get = async || {
            client
                .get(&url, std::time::Duration::from_secs(5))
                .await
                .unwrap()
        };
        assert_ne!(
            get().await.body,
            get().await.body,
            "a busy fleet's answers move"
        );
    }
}
