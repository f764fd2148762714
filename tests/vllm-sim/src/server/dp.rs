//! Data parallelism behind one API server, as vLLM 0.33 runs `--data-parallel-size N`.
//!
//! Each rank is an engine of its own ([`Shared`]: KV cache, scheduler, `engine="<rank>"`
//! metrics, KV-event publisher on the configured port + rank) with its own router of the
//! OpenAI paths; the front router here picks the rank a request runs on:
//! - an `X-data-parallel-rank` header that parses as an integer picks that rank
//!   (`_get_data_parallel_rank` in `vllm/entrypoints/generate/base/serving.py`); one out of
//!   range fails a generating request with 400, as `InputProcessor` refuses it
//!   (`vllm/v1/engine/input_processor.py`: "data_parallel_rank R is out of range [0, N).");
//! - otherwise the least loaded rank, scored as vLLM's DP client scores its engines
//!   (`DPLBAsyncMPClient.get_core_engine_for_request` in `vllm/v1/engine/core_client.py`):
//!   the greater of this server's requests in flight there and the engine's waiting plus
//!   running, plus `6 x waiting x max(0, kv_usage - 0.5)`, ties to the lowest rank. vLLM reads
//!   the engines' counts from a coordinator snapshot every 100 ms; the simulator reads them live.
//!
//! The server-wide paths answer for every rank: `/metrics` is one page with each engine's
//! series (as vLLM's one registry writes them), `/load` sums, `/reset_prefix_cache` and
//! `POST /sim/fault` apply to every rank, `/sim/stats` lists them under `ranks`, and
//! `/kv_event_sources` lists every rank's publisher. A server
//! without data parallelism (one rank) goes through the same front, so the header is checked
//! the same way: vLLM refuses any rank but 0 there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::Value;
use tower::ServiceExt;

use super::{MAX_REQUEST_BODY_BYTES, Shared, bad_request};
use crate::SimError;

/// The request header that picks a rank (vLLM reads it case-insensitively).
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// The engine ranks a server runs: `0..size` behind one API server, or the one `rank` of an
/// external-load-balancer deployment.
pub(super) fn engine_ranks(size: u32, rank: Option<u32>) -> Result<Vec<u32>, SimError> {
    match (size, rank) {
        (0, _) => Err(SimError::Config(
            "--data-parallel-size must be at least 1".into(),
        )),
        (size, Some(rank)) if rank >= size => Err(SimError::Config(format!(
            "--data-parallel-rank {rank} is not below --data-parallel-size {size}"
        ))),
        (_, Some(rank)) => Ok(vec![rank]),
        (size, None) => Ok((0..size).collect()),
    }
}

/// One rank as the front sees it.
struct Rank {
    app: Router,
    engine: Arc<Shared>,
    /// Requests this server has sent to the rank whose responses have not ended.
    in_flight: Arc<AtomicU32>,
}

/// The front router over `ranks` (each rank's router and state, in rank order).
pub(super) fn front(ranks: Vec<(Router, Arc<Shared>)>) -> Router {
    let ranks: Arc<[Rank]> = ranks
        .into_iter()
        .map(|(app, engine)| Rank {
            app,
            engine,
            in_flight: Arc::new(AtomicU32::new(0)),
        })
        .collect();
    Router::new().fallback(move |req: Request| {
        let ranks = ranks.clone();
        async move { dispatch(&ranks, req).await }
    })
}

async fn dispatch(ranks: &[Rank], req: Request) -> Response {
    let path = req.uri().path();
    if req.method() == Method::GET && path == "/kv_event_sources" {
        return event_sources(ranks);
    }
    if ranks.len() > 1 {
        match (req.method(), path) {
            // Each rank restricts a `/metrics/` page itself; the merge keeps what they kept.
            (&Method::GET, "/metrics" | vllm_wire::prom::RESTRICTED_METRICS_PATH) => {
                return metrics(ranks, req).await;
            }
            (&Method::GET, "/load") => return load(ranks, req).await,
            (&Method::GET, "/sim/stats") => return stats(ranks, req).await,
            (&Method::POST, "/sim/fault" | "/reset_prefix_cache") => {
                return broadcast(ranks, req).await;
            }
            _ => {}
        }
    }
    let asked = requested_rank(&req);
    let index = match asked {
        Some(rank) if generates(req.method(), path) && rank >= ranks.len() as i64 => {
            return bad_request(format!(
                "data_parallel_rank {rank} is out of range [0, {}).",
                ranks.len()
            ))
            .into_response();
        }
        Some(rank) if (0..ranks.len() as i64).contains(&rank) => rank as usize,
        _ => least_loaded(ranks),
    };
    let Some(rank) = ranks.get(index) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    forward(rank, req).await
}

/// vLLM 0.33's `GET /kv_event_sources`: each publishing engine's resolved publisher, keyed by
/// its data-parallel rank (`{}` when none publishes).
fn event_sources(ranks: &[Rank]) -> Response {
    let sources: std::collections::BTreeMap<String, _> = ranks
        .iter()
        .filter_map(|r| {
            let publisher = r.engine.publisher.as_ref()?;
            Some((r.engine.info.engine.to_string(), publisher.config()))
        })
        .collect();
    axum::Json(sources).into_response()
}

/// The header's rank as vLLM reads it: `int(value)`, anything else as no header.
fn requested_rank(req: &Request) -> Option<i64> {
    let value = req.headers().get(RANK_HEADER)?.to_str().ok()?;
    value.trim().parse().ok()
}

/// The paths whose requests reach an engine, where vLLM checks the rank.
fn generates(method: &Method, path: &str) -> bool {
    *method == Method::POST
        && matches!(
            path,
            "/v1/chat/completions" | "/v1/completions" | "/v1/responses" | "/v1/messages"
        )
}

/// How loaded vLLM's DP client judges an engine (`DPLBAsyncMPClient.get_core_engine_for_request`
/// with one API server): the greater of the requests it has in flight there and the engine's
/// waiting plus running, plus `6 x waiting x max(0, kv_usage - 0.5)`. The lowest score wins,
/// the first rank on ties. fleet-sim's rank-blind servers choose by it too.
pub fn balance_score(in_flight: u32, waiting: u32, running: u32, kv_usage: f64) -> f64 {
    let queued = f64::from(waiting);
    let mut score = f64::from(in_flight).max(queued + f64::from(running));
    if waiting > 0 {
        score += queued * 6.0 * (kv_usage - 0.5).max(0.0);
    }
    score
}

/// vLLM's DP client choice: the lowest [`balance_score`], the first rank on ties.
fn least_loaded(ranks: &[Rank]) -> usize {
    let mut best = (f64::INFINITY, 0);
    for (i, rank) in ranks.iter().enumerate() {
        let stats = rank.engine.engine.lock().stats();
        let in_flight = rank.in_flight.load(Ordering::Relaxed);
        let score = balance_score(
            in_flight,
            stats.num_waiting,
            stats.num_running,
            stats.kv_cache_usage,
        );
        if score < best.0 {
            best = (score, i);
        }
    }
    best.1
}

/// Runs `req` on `rank`, counting it in flight until its response body ends or is dropped.
async fn forward(rank: &Rank, req: Request) -> Response {
    struct InFlight(Arc<AtomicU32>);
    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    rank.in_flight.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight(rank.in_flight.clone());
    let response = match rank.app.clone().oneshot(req).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let (parts, body) = response.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &guard;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// The request's head and body, to send again to every rank.
async fn replayable(req: Request) -> Result<(axum::http::request::Parts, Bytes), Response> {
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, MAX_REQUEST_BODY_BYTES).await {
        Ok(bytes) => Ok((parts, bytes)),
        Err(e) => Err(bad_request(format!("reading the body: {e}")).into_response()),
    }
}

/// Every rank's answer to the same request, in rank order.
async fn each_rank(ranks: &[Rank], req: Request) -> Result<Vec<(StatusCode, Bytes)>, Response> {
    let (parts, body) = replayable(req).await?;
    let mut out = Vec::with_capacity(ranks.len());
    for rank in ranks {
        let mut copy = Request::new(Body::from(body.clone()));
        *copy.method_mut() = parts.method.clone();
        *copy.uri_mut() = parts.uri.clone();
        *copy.headers_mut() = parts.headers.clone();
        let response = forward(rank, copy).await;
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        out.push((status, bytes));
    }
    Ok(out)
}

/// The first failure among `answers`, else the first answer.
fn first_failure_or_first(answers: Vec<(StatusCode, Bytes)>) -> Response {
    let pick = answers
        .iter()
        .position(|(status, _)| !status.is_success())
        .unwrap_or(0);
    match answers.into_iter().nth(pick) {
        Some((status, body)) => json_response(status, body),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn json_response(status: StatusCode, body: Bytes) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn broadcast(ranks: &[Rank], req: Request) -> Response {
    match each_rank(ranks, req).await {
        Ok(answers) => first_failure_or_first(answers),
        Err(response) => response,
    }
}

async fn metrics(ranks: &[Rank], req: Request) -> Response {
    let answers = match each_rank(ranks, req).await {
        Ok(answers) => answers,
        Err(response) => return response,
    };
    if answers.iter().any(|(status, _)| !status.is_success()) {
        return first_failure_or_first(answers);
    }
    let pages: Vec<String> = answers
        .into_iter()
        .map(|(_, body)| String::from_utf8_lossy(&body).into_owned())
        .collect();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::merge_engine_pages(&pages),
    )
        .into_response()
}

/// Every rank's JSON answer, or the first failure.
async fn json_answers(ranks: &[Rank], req: Request) -> Result<Vec<Value>, Response> {
    let answers = each_rank(ranks, req).await?;
    if answers.iter().any(|(status, _)| !status.is_success()) {
        return Err(first_failure_or_first(answers));
    }
    Ok(answers
        .iter()
        .map(|(_, body)| serde_json::from_slice(body).unwrap_or(Value::Null))
        .collect())
}

async fn load(ranks: &[Rank], req: Request) -> Response {
    match json_answers(ranks, req).await {
        Ok(answers) => {
            let total: u64 = answers
                .iter()
                .filter_map(|a| a.get("server_load").and_then(Value::as_u64))
                .sum();
            axum::Json(serde_json::json!({"server_load": total})).into_response()
        }
        Err(response) => response,
    }
}

async fn stats(ranks: &[Rank], req: Request) -> Response {
    match json_answers(ranks, req).await {
        Ok(answers) => {
            let mut first = answers.first().cloned().unwrap_or(Value::Null);
            if let Value::Object(map) = &mut first {
                map.insert("ranks".into(), Value::Array(answers));
            }
            axum::Json(first).into_response()
        }
        Err(response) => response,
    }
}

#[cfg(test)]
mod tests {
    use super::engine_ranks;

    #[test]
    fn a_server_runs_every_rank_or_its_own() {
        assert_eq!(engine_ranks(1, None).unwrap(), vec![0]);
        assert_eq!(engine_ranks(4, None).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(engine_ranks(4, Some(2)).unwrap(), vec![2]);
        assert!(engine_ranks(4, Some(4)).is_err());
        assert!(engine_ranks(0, None).is_err());
    }
}
