//! The route and feedback API the filter calls (Envoy cluster `kvroute_control_plane`).
//!
//! `POST /v1/route` takes a JSON `RouteRequest` and answers a `RouteResponse`;
//! `POST /v1/feedback` takes a `FeedbackBatch` and answers 204; `POST /v1/sync` takes a
//! `SyncRequest` from a proxy deciding locally and answers a `SyncResponse` (the log entries it
//! has not seen, the endpoint table, the router config); `GET /healthz` answers `ok`.
//! Errors are JSON `{"error": "..."}` with 400 (bad input), 401 (token), 408 (slow body) or 413
//! (too large). An approximate route does no I/O after reading the body: one lock, one
//! decision. A precise route (with `prompt_text`) is tokenised first, which may call a replica
//! (`precise.tokenizer: remote`) within `precise.tokenize_timeout_ms`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use scorer_core::protocol::{FEEDBACK_PATH, FeedbackBatch, ROUTE_PATH, RouteRequest};
use scorer_core::sync::{SYNC_PATH, SyncRequest};
use serde::de::DeserializeOwned;

use crate::state::State;
use crate::tokenize::Precise;

/// Header carrying the shared secret when `auth_token` is configured.
pub const TOKEN_HEADER: &str = "x-kvroute-token";

/// Longest `model` / `session` string accepted (they are keys, not payloads).
const MAX_KEY_BYTES: usize = 4096;

/// Limits and credentials of the API.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// Required `x-kvroute-token` value, if any.
    pub auth_token: Option<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most block hashes per route request.
    pub max_block_hashes: usize,
    /// Most outcomes per feedback batch, and most decisions (and outcomes) per sync call.
    pub max_feedback_outcomes: usize,
    /// Deadline for receiving a request body.
    pub body_timeout: Duration,
    /// Tokeniser and hashing of precise routes.
    pub precise: Arc<Precise>,
}

#[derive(Debug)]
struct App {
    state: Arc<State>,
    settings: ApiSettings,
}

/// A refused request: status, metric label and a message for the caller.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    reason: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(serde_json::json!({ "error": self.message })),
        )
            .into_response()
    }
}

/// The API router; serve it on `listen`.
pub fn router(state: Arc<State>, settings: ApiSettings) -> axum::Router {
    let app = Arc::new(App { state, settings });
    axum::Router::new()
        .route(ROUTE_PATH, post(route))
        .route(FEEDBACK_PATH, post(feedback))
        .route(SYNC_PATH, post(sync))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .with_state(app)
}

/// Liveness: the process is up and serving.
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: 503 while a replica sharing state replays the shared stream, so a Service sends
/// it no traffic before its index is warm.
async fn readyz(AxumState(app): AxumState<Arc<App>>) -> Response {
    if app.state.is_ready() {
        "ok".into_response()
    } else {
        catching_up().into_response()
    }
}

/// What `/readyz` and `/v1/sync` answer while the shared stream is replayed.
fn catching_up() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "catching_up",
        "replaying the shared state stream",
    )
}

/// JSON 404 for unknown paths.
pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
}

async fn route(AxumState(app): AxumState<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let mut request: RouteRequest = app.read_json(&headers, body).await?;
        let started = Instant::now();
        app.check_route(&request)?;
        if let Some(how) = app.settings.precise.prepare(&app.state, &mut request).await {
            app.state.telemetry().count_precise_route(how);
        }
        let response = app.state.route(&request);
        let out = Json(response).into_response();
        app.state.telemetry().observe_route(started.elapsed());
        Ok::<_, ApiError>(out)
    }
    .await;
    result.unwrap_or_else(|e| app.reject(ROUTE_PATH, e))
}

async fn feedback(AxumState(app): AxumState<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let batch: FeedbackBatch = app.read_json(&headers, body).await?;
        if batch.outcomes.len() > app.settings.max_feedback_outcomes {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "too_many_outcomes",
                format!(
                    "{} outcomes in one batch, at most {}",
                    batch.outcomes.len(),
                    app.settings.max_feedback_outcomes
                ),
            ));
        }
        app.state.feedback(&batch);
        Ok(StatusCode::NO_CONTENT.into_response())
    }
    .await;
    result.unwrap_or_else(|e| app.reject(FEEDBACK_PATH, e))
}

async fn sync(AxumState(app): AxumState<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let request: SyncRequest = app.read_json(&headers, body).await?;
        app.check_sync(&request)?;
        // A replica still replaying the shared stream would hand a copy a log it is about to
        // renumber (and so a reset, twice); the proxy keeps its copy and asks another replica.
        if !app.state.is_ready() {
            return Err(catching_up());
        }
        let served = app.state.sync(request);
        app.state
            .telemetry()
            .count_sync(served.decisions, served.outcomes, served.reset);
        Ok::<_, ApiError>(Json(served.response).into_response())
    }
    .await;
    result.unwrap_or_else(|e| app.reject(SYNC_PATH, e))
}

impl App {
    fn reject(&self, path: &'static str, e: ApiError) -> Response {
        self.state.telemetry().count_rejected(path, e.reason);
        tracing::debug!(path, status = e.status.as_u16(), error = %e.message, "request rejected");
        e.into_response()
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(expected) = &self.settings.auth_token else {
            return Ok(());
        };
        let given = headers
            .get(TOKEN_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if constant_time_eq(given, expected.as_bytes()) {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                format!("missing or wrong {TOKEN_HEADER}"),
            ))
        }
    }

    /// Authorizes, then reads the whole body under the size limit and deadline, then parses it.
    async fn read_json<T: DeserializeOwned>(
        &self,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<T, ApiError> {
        self.authorize(headers)?;
        let limit = self.settings.max_body_bytes;
        let too_large = || {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request body exceeds {limit} bytes"),
            )
        };
        let declared = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let bytes: Bytes = match tokio::time::timeout(
            self.settings.body_timeout,
            Limited::new(body, limit).collect(),
        )
        .await
        {
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "timeout",
                    "request body not received in time",
                ));
            }
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(too_large()),
            Ok(Err(e)) => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "body",
                    format!("reading body: {e}"),
                ));
            }
            Ok(Ok(collected)) => collected.to_bytes(),
        };
        serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_json",
                format!("invalid JSON body: {e}"),
            )
        })
    }

    fn check_route(&self, r: &RouteRequest) -> Result<(), ApiError> {
        let bad = |msg: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", msg);
        if r.block_hashes.len() > self.settings.max_block_hashes {
            return Err(bad(format!(
                "{} block_hashes, at most {} are accepted",
                r.block_hashes.len(),
                self.settings.max_block_hashes
            )));
        }
        if r.token_block_hashes.len() > self.settings.max_block_hashes {
            return Err(bad(format!(
                "{} token_block_hashes, at most {} are accepted",
                r.token_block_hashes.len(),
                self.settings.max_block_hashes
            )));
        }
        if r.model.len() > MAX_KEY_BYTES {
            return Err(bad(format!("model is longer than {MAX_KEY_BYTES} bytes")));
        }
        if r.session.as_ref().is_some_and(|s| s.len() > MAX_KEY_BYTES) {
            return Err(bad(format!("session is longer than {MAX_KEY_BYTES} bytes")));
        }
        Ok(())
    }

    /// The same bounds a route call and a feedback batch have, per reported decision and for
    /// the whole batch; replica 0 is the control plane's own tag and no proxy's.
    fn check_sync(&self, r: &SyncRequest) -> Result<(), ApiError> {
        let bad = |msg: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", msg);
        let max = self.settings.max_feedback_outcomes;
        if r.replica == Some(0) {
            return Err(bad(
                "replica 0 is the control plane's own; omit `replica` to be given one".into(),
            ));
        }
        if r.decisions.len() > max {
            return Err(bad(format!(
                "{} decisions in one sync, at most {max}",
                r.decisions.len()
            )));
        }
        if r.outcomes.len() > max {
            return Err(bad(format!(
                "{} outcomes in one sync, at most {max}",
                r.outcomes.len()
            )));
        }
        for (i, d) in r.decisions.iter().enumerate() {
            if d.endpoint.len() > MAX_KEY_BYTES {
                return Err(bad(format!(
                    "decisions[{i}].endpoint is longer than {MAX_KEY_BYTES} bytes"
                )));
            }
            self.check_route(&d.request).map_err(|e| {
                ApiError::new(
                    e.status,
                    e.reason,
                    format!("decisions[{i}].request: {}", e.message),
                )
            })?;
        }
        Ok(())
    }
}

/// Compares without an early exit, so response timing does not reveal a token prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secre"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
