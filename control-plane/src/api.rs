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

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State as AxumState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use ring::hmac;
use scorer_core::protocol::{
    FEEDBACK_PATH, FeedbackBatch, FirstToken, Outcome, ROUTE_PATH, RouteRequest,
};
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
    /// How long a route call waits for the report of a stored response it names and nobody
    /// has reported yet (`stored_response_wait_ms`).
    pub stored_response_wait: Duration,
    /// Tokeniser and hashing of precise routes.
    pub precise: Arc<Precise>,
}

#[derive(Debug)]
struct App {
    state: Arc<State>,
    settings: ApiSettings,
    tags: DecisionTags,
}

/// Signs decision ids for the proxy that asked, so an outcome can be checked to come from it:
/// ids are sequential, and without this anyone reaching the API could release or rate other
/// proxies' decisions by counting. Keyed by `auth_token`, so every replica sharing state (and
/// the token) checks every other's tags; with no token the API is open anyway and the key is
/// a fixed one (tags then bind ids to the asking address only).
struct DecisionTags {
    key: hmac::Key,
}

impl std::fmt::Debug for DecisionTags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DecisionTags")
    }
}

impl DecisionTags {
    fn new(auth_token: Option<&str>) -> Self {
        let secret = auth_token.unwrap_or("kvroute: no auth_token configured");
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()),
        }
    }

    /// The tag of `decision_id` answered to `peer`; never 0 (0 means "no tag").
    fn sign(&self, decision_id: u64, peer: Option<IpAddr>) -> u64 {
        let mut message = [0u8; 8 + 16 + 16];
        message[..16].copy_from_slice(b"kvroute-decision");
        message[16..24].copy_from_slice(&decision_id.to_le_bytes());
        let ip = match peer {
            Some(IpAddr::V4(v4)) => v4.to_ipv6_mapped().octets(),
            Some(IpAddr::V6(v6)) => v6.octets(),
            None => [0; 16],
        };
        message[24..].copy_from_slice(&ip);
        let mac = hmac::sign(&self.key, &message);
        let mut first = [0u8; 8];
        first.copy_from_slice(&mac.as_ref()[..8]);
        u64::from_le_bytes(first).max(1)
    }

    /// Whether a report carries `tag`, the one decision `decision_id` was answered with to
    /// `peer`.
    fn verify(&self, decision_id: u64, tag: u64, peer: Option<IpAddr>) -> bool {
        tag != 0
            && constant_time_eq(
                &tag.to_le_bytes(),
                &self.sign(decision_id, peer).to_le_bytes(),
            )
    }
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
    let tags = DecisionTags::new(settings.auth_token.as_deref());
    let app = Arc::new(App {
        state,
        settings,
        tags,
    });
    axum::Router::new()
        .route(ROUTE_PATH, post(|s, r| guarded(ROUTE_PATH, route(s, r))))
        .route(
            FEEDBACK_PATH,
            post(|s, r| guarded(FEEDBACK_PATH, feedback(s, r))),
        )
        .route(SYNC_PATH, post(|s, h, b| guarded(SYNC_PATH, sync(s, h, b))))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .with_state(app)
}

/// Runs one call's handler so that a panic in it (a bug, or a dependency choking on one
/// client's input) answers that call 500 and leaves the service serving: the connection task
/// would otherwise end without an answer and the proxy wait for its route timeout.
/// (`parking_lot` locks do not poison, so the state stays usable.)
async fn guarded(path: &'static str, handler: impl Future<Output = Response>) -> Response {
    use futures_util::FutureExt as _;
    match std::panic::AssertUnwindSafe(handler).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(path, panic = %what, "a request handler panicked; the request fails, the service goes on");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "panic",
                "internal error while handling this request",
            )
            .into_response()
        }
    }
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

/// The address the call came from (served with connect info), which decision tags bind to.
fn peer_of(request: &Request) -> Option<IpAddr> {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
}

async fn route(AxumState(app): AxumState<Arc<App>>, request: Request) -> Response {
    let peer = peer_of(&request);
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let result = async {
        let mut request: RouteRequest = app.read_json(&headers, body).await?;
        let started = Instant::now();
        app.check_route(&request)?;
        // The proxy's finished and started requests first: they no longer wait anywhere.
        let finished = std::mem::take(&mut request.finished);
        let first_tokens = std::mem::take(&mut request.first_tokens);
        if !finished.is_empty() || !first_tokens.is_empty() {
            app.apply_reports(finished, first_tokens, Vec::new(), peer);
        }
        app.state
            .await_stored_response(&request, app.settings.stored_response_wait)
            .await;
        let mut response = app
            .settings
            .precise
            .route(&app.state, &mut request, |r| app.state.route(r))
            .await;
        if !response.endpoints.is_empty() {
            response.decision_tag = app.tags.sign(response.decision_id, peer);
        }
        let out = Json(response).into_response();
        app.state.telemetry().observe_route(started.elapsed());
        Ok::<_, ApiError>(out)
    }
    .await;
    result.unwrap_or_else(|e| app.reject(ROUTE_PATH, e))
}

async fn feedback(AxumState(app): AxumState<Arc<App>>, request: Request) -> Response {
    let peer = peer_of(&request);
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let result = async {
        let batch: FeedbackBatch = app.read_json(&headers, body).await?;
        let max = app.settings.max_feedback_outcomes;
        if batch.withdrawn.len() > max {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "too_many_withdrawn",
                format!(
                    "{} withdrawn calls in one batch, at most {max}",
                    batch.withdrawn.len()
                ),
            ));
        }
        if batch.outcomes.len() > max || batch.first_tokens.len() > max {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "too_many_outcomes",
                format!(
                    "{} outcomes and {} first tokens in one batch, at most {max} each",
                    batch.outcomes.len(),
                    batch.first_tokens.len(),
                ),
            ));
        }
        app.apply_reports(batch.outcomes, batch.first_tokens, batch.withdrawn, peer);
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
        let compact = request.compact_hashes;
        let served = app.state.sync(request);
        app.state.telemetry().count_sync(
            served.decisions,
            served.outcomes,
            served.reset,
            !served.response.delta,
        );
        // Hash lists in base64 only for a copy that said it reads them.
        let body = scorer_core::sync::to_json(&served.response, compact).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "serialize",
                format!("cannot write the sync answer: {e}"),
            )
        })?;
        Ok::<_, ApiError>(
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(|e| app.reject(SYNC_PATH, e))
}

impl App {
    /// Applies the first tokens and outcomes that carry their decision's tag for `peer` (the
    /// others are counted and dropped: a forged or misdirected report releases nothing), then
    /// the withdrawals.
    fn apply_reports(
        &self,
        mut outcomes: Vec<Outcome>,
        mut first_tokens: Vec<FirstToken>,
        withdrawn: Vec<u64>,
        peer: Option<IpAddr>,
    ) {
        let before = outcomes.len() + first_tokens.len();
        outcomes.retain(|o| self.tags.verify(o.decision_id, o.decision_tag, peer));
        first_tokens.retain(|f| self.tags.verify(f.decision_id, f.decision_tag, peer));
        for _ in outcomes.len() + first_tokens.len()..before {
            self.state
                .telemetry()
                .count_rejected(FEEDBACK_PATH, "unknown_decision");
        }
        // First tokens before outcomes: a request reported in both had its first token first.
        self.state.first_tokens(&first_tokens);
        if !outcomes.is_empty() {
            self.state.feedback(&FeedbackBatch {
                outcomes,
                ..FeedbackBatch::default()
            });
        }
        self.state.withdraw(&withdrawn);
    }

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
        let max = self.settings.max_feedback_outcomes;
        if r.finished.len() > max || r.first_tokens.len() > max {
            return Err(bad(format!(
                "{} finished and {} first tokens, at most {max} each",
                r.finished.len(),
                r.first_tokens.len()
            )));
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
        if r.first_tokens.len() > max {
            return Err(bad(format!(
                "{} first tokens in one sync, at most {max}",
                r.first_tokens.len()
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
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_the_next_call_is_served() {
        let failed = guarded("/v1/route", async { panic!("a dependency choked") }).await;
        assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let next = guarded("/v1/route", async {
            StatusCode::NO_CONTENT.into_response()
        })
        .await;
        assert_eq!(next.status(), StatusCode::NO_CONTENT);
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secre"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
