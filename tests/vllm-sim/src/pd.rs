//! llm-d's P/D routing sidecar, as vllm-sim models it on a decode replica.
//!
//! A request carrying `x-prefiller-host-port: ip:port` is first sent to that prefill replica as
//! a clone with `max_tokens` 1, `stream` false and `kv_transfer_params.do_remote_decode`
//! (vLLM's NIXL connector flow, as llm-d's routing sidecar drives it). The prefill replica
//! runs the prompt through its own engine (so its prefix cache holds the blocks) and answers
//! with `kv_transfer_params`. The decode replica then waits the KV transfer time (prompt tokens
//! × KV bytes per token ÷ link bandwidth) and decodes with those blocks present. A failed or
//! malformed prefill call falls back to a local prefill, as a request without the header gets.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{Value, json};

/// The header llm-d's scheduler (and kvroute's filter) sets on disaggregated requests.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// Longest a remote prefill may take before the decode replica prefills locally instead.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(120);

/// The decode-side sidecar: an HTTP client for prefill calls, the transfer model and counters.
#[derive(Debug)]
pub struct Sidecar {
    client: Client<HttpConnector, Full<Bytes>>,
    kv_bytes_per_token: u64,
    transfer_bytes_per_s: f64,
    remote_prefills: AtomicU64,
    remote_prefill_failures: AtomicU64,
    transfer_us: AtomicU64,
    prefills_served: AtomicU64,
}

/// What `/sim/stats` shows about disaggregated serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SidecarStats {
    /// Requests this (decode) replica had prefilled remotely.
    pub remote_prefills: u64,
    /// Remote prefills that failed (the request was prefilled locally instead).
    pub remote_prefill_failures: u64,
    /// Simulated KV transfer time summed over remote prefills, seconds.
    pub kv_transfer_seconds: f64,
    /// Prefill-only requests this (prefill) replica served for a decode replica.
    pub prefills_served: u64,
}

/// Whether a request body asks for a prefill on behalf of a remote decode.
pub fn is_remote_decode_request(body: &Value) -> bool {
    body.pointer("/kv_transfer_params/do_remote_decode") == Some(&Value::Bool(true))
}

/// The `kv_transfer_params` a prefill replica returns (vLLM's NIXL connector shape).
pub fn prefill_answer_params(replica: &str) -> Value {
    let (host, port) = replica.rsplit_once(':').unwrap_or((replica, "0"));
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": replica,
        "remote_block_ids": [],
        "remote_host": host,
        "remote_port": port.parse::<u16>().unwrap_or(0),
    })
}

/// The clone the sidecar sends to the prefill replica: one token, unstreamed, asking for a
/// remote decode. `None` when the body is not a JSON object.
pub fn prefill_request_body(body: &[u8]) -> Option<Value> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let o = v.as_object_mut()?;
    o.insert("max_tokens".into(), json!(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), json!(1));
    }
    // A Responses API body (`input`) limits its output with `max_output_tokens`.
    if o.contains_key("input") || o.contains_key("max_output_tokens") {
        o.insert("max_output_tokens".into(), json!(1));
    }
    o.insert("stream".into(), json!(false));
    o.remove("stream_options");
    o.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    Some(v)
}

/// `ip:port` from the header, when present and well formed.
pub fn prefiller(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(PREFILLER_HEADER)?.to_str().ok()?.trim();
    let (host, port) = value.rsplit_once(':')?;
    (!host.is_empty()
        && port.parse::<u16>().is_ok()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b)))
    .then(|| value.to_string())
}

impl Sidecar {
    /// A sidecar moving KV at `gbps` gigabytes per second (NIXL over RDMA: tens of GB/s).
    pub fn new(kv_bytes_per_token: u64, gbps: f64) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            kv_bytes_per_token,
            transfer_bytes_per_s: (gbps * 1e9).max(1.0),
            remote_prefills: AtomicU64::new(0),
            remote_prefill_failures: AtomicU64::new(0),
            transfer_us: AtomicU64::new(0),
            prefills_served: AtomicU64::new(0),
        }
    }

    /// Simulated seconds to move `prompt_tokens` tokens of KV from the prefill replica.
    pub fn transfer_s(&self, prompt_tokens: usize) -> f64 {
        prompt_tokens as f64 * self.kv_bytes_per_token as f64 / self.transfer_bytes_per_s
    }

    /// Counts one prefill served for a remote decode (prefill side).
    pub fn count_prefill_served(&self) {
        self.prefills_served.fetch_add(1, Ordering::Relaxed);
    }

    /// Counters so far.
    pub fn stats(&self) -> SidecarStats {
        SidecarStats {
            remote_prefills: self.remote_prefills.load(Ordering::Relaxed),
            remote_prefill_failures: self.remote_prefill_failures.load(Ordering::Relaxed),
            kv_transfer_seconds: self.transfer_us.load(Ordering::Relaxed) as f64 / 1e6,
            prefills_served: self.prefills_served.load(Ordering::Relaxed),
        }
    }

    /// Runs the remote prefill of a request with the prefiller header, then waits the KV
    /// transfer time (`speed` simulated seconds per wall second). Returns whether the prompt's
    /// KV is now present here; false (prefill locally) when there is no header, this request
    /// is itself a prefill for someone else, or the prefill call failed.
    pub async fn prefill_remotely(
        &self,
        headers: &HeaderMap,
        path: &str,
        body: &[u8],
        prompt_tokens: usize,
        speed: f64,
    ) -> bool {
        let Some(prefiller) = prefiller(headers) else {
            return false;
        };
        let Some(clone) = prefill_request_body(body) else {
            return false;
        };
        let ok = match self.call(&prefiller, path, &clone).await {
            Ok(answer) => answer.get("kv_transfer_params").is_some(),
            Err(e) => {
                tracing::warn!("remote prefill on {prefiller} failed: {e}");
                false
            }
        };
        if !ok {
            self.remote_prefill_failures.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let transfer = self.transfer_s(prompt_tokens);
        tokio::time::sleep(Duration::from_secs_f64(
            (transfer / speed.max(1e-6)).min(600.0),
        ))
        .await;
        self.remote_prefills.fetch_add(1, Ordering::Relaxed);
        self.transfer_us
            .fetch_add((transfer * 1e6) as u64, Ordering::Relaxed);
        true
    }

    async fn call(&self, prefiller: &str, path: &str, body: &Value) -> Result<Value, String> {
        let req = hyper::Request::builder()
            .method("POST")
            .uri(format!("http://{prefiller}{path}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let fut = async {
            let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("status {status}"));
            }
            serde_json::from_slice(&bytes).map_err(|e| e.to_string())
        };
        tokio::time::timeout(PREFILL_TIMEOUT, fut)
            .await
            .map_err(|_| "timed out".to_string())?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_clone_asks_for_one_unstreamed_token_and_a_remote_decode() {
        let body = br#"{"model":"m","messages":[],"max_completion_tokens":300,"max_tokens":300,
            "stream":true,"stream_options":{"include_usage":true}}"#;
        let v = prefill_request_body(body).unwrap();
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        assert!(is_remote_decode_request(&v));
        assert!(!is_remote_decode_request(&json!({"model": "m"})));
        assert_eq!(prefill_request_body(b"[1,2]"), None);
    }

    #[test]
    fn header_values_are_checked() {
        let mut h = HeaderMap::new();
        assert_eq!(prefiller(&h), None);
        h.insert(PREFILLER_HEADER, "127.0.0.1:8001".parse().unwrap());
        assert_eq!(prefiller(&h).as_deref(), Some("127.0.0.1:8001"));
        for bad in ["127.0.0.1", "a/b:80", ":80", "h:99999"] {
            h.insert(PREFILLER_HEADER, bad.parse().unwrap());
            assert_eq!(prefiller(&h), None, "{bad}");
        }
    }

    #[test]
    fn transfer_time_follows_kv_bytes_and_bandwidth() {
        let s = Sidecar::new(131_072, 25.0);
        // 8k tokens of 128 KiB at 25 GB/s: about 43 ms.
        let t = s.transfer_s(8192);
        assert!((t - 0.0429).abs() < 0.001, "{t}");
        assert_eq!(
            prefill_answer_params("10.0.0.1:8000")["remote_port"],
            json!(8000)
        );
    }
}
