//! The filter's parse and hash time inside Envoy's V8, read from its own
//! `kvroute_hash_duration_us` histogram: the one figure of the filter's speed taken where it
//! runs (the wasmtime test host compiles without optimisation).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_harness::{self as harness, HttpClient};

use crate::BenchError;

/// Envoy merges histograms into its admin view on each stats flush (every 5 s).
const FLUSH: Duration = Duration::from_millis(5_500);

/// One body size's figure.
#[derive(Debug, Clone, Copy)]
pub struct V8Parse {
    /// Approximate body size asked for.
    pub bytes: usize,
    /// Bodies the histogram counted.
    pub bodies: f64,
    /// Mean parse and hash time per body, µs (Envoy's histogram sum is bucket-approximate, a
    /// few %).
    pub us_per_body: f64,
    /// Mean body bytes over that time (bytes per µs is MB/s).
    pub mb_per_s: f64,
}

/// `(sum µs, count)` of the histogram in the Prometheus output of Envoy's admin at `admin`.
async fn histogram(client: &HttpClient, admin: &str) -> Result<(f64, f64), BenchError> {
    let url = format!("http://{admin}/stats/prometheus");
    let body = client.get(&url, Duration::from_secs(5)).await?.body;
    Ok((
        harness::prometheus_sum(&body, "kvroute_hash_duration_us_sum"),
        harness::prometheus_sum(&body, "kvroute_hash_duration_us_count"),
    ))
}

/// For each `(bytes, n)`, sends `n` sequential chat bodies of about `bytes` through the kvroute
/// Envoy at `base` (admin at `admin`) and divides their mean size by the mean time the filter
/// recorded for them. First waits until the histogram stays put across a flush, so earlier
/// requests are not counted; then each size waits (at most 20 s) until the count has moved by
/// the requests it sent. `None` for a size whose bodies were not timed.
pub async fn parse_in_v8(
    client: &HttpClient,
    admin: &str,
    base: &str,
    sizes: &[(usize, usize)],
) -> Result<Vec<Option<V8Parse>>, BenchError> {
    let mut last = histogram(client, admin).await?;
    for _ in 0..4 {
        tokio::time::sleep(FLUSH).await;
        let now = histogram(client, admin).await?;
        if now.1 == last.1 {
            break;
        }
        last = now;
    }
    let url = format!("{base}/v1/chat/completions");
    let mut out = Vec::with_capacity(sizes.len());
    for &(bytes, n) in sizes {
        let bodies: Vec<String> = (0..16)
            .map(|s| crate::chat_body(bytes, 100 + s, 1, false))
            .collect();
        let mean_len = bodies.iter().map(String::len).sum::<usize>() as f64 / bodies.len() as f64;
        let r = crate::http_load(&url, Arc::new(bodies), 1, Duration::from_secs(60), n).await;
        let sent = (r.latencies_ms.len() + r.errors) as f64;
        let deadline = Instant::now() + Duration::from_secs(20);
        let now = loop {
            let now = histogram(client, admin).await?;
            if now.1 - last.1 >= sent || Instant::now() > deadline {
                break now;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let (sum, count) = (now.0 - last.0, now.1 - last.1);
        last = now;
        out.push((count > 0.0 && sum > 0.0).then(|| {
            let us_per_body = sum / count;
            V8Parse {
                bytes,
                bodies: count,
                us_per_body,
                mb_per_s: mean_len / us_per_body,
            }
        }));
    }
    Ok(out)
}
