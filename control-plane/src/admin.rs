//! The admin port: Prometheus `/metrics`, `/healthz`, `/debug/*` explanations and the live
//! fleet page (`/`, `/fleet`, `/debug/fleet.json`; see [`fleet_page`]).
//!
//! Kept off the API port (and on loopback by default) because `/debug` reveals per-endpoint
//! load and decision details that the data path has no business exposing.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State as AxumState};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use serde::Deserialize;

use crate::api::{healthz, not_found};
use crate::state::State;
use crate::telemetry;

#[path = "fleet_page.rs"]
pub mod fleet_page;

use fleet_page::History;

/// OpenMetrics text, what `prometheus_client::encoding::text` writes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug)]
struct Admin {
    state: Arc<State>,
    /// Precise mode's tokenizer and kept prompts, for `/debug/mismatch`'s diverging block.
    precise: Option<Arc<crate::tokenize::Precise>>,
    registry: Registry,
    /// Sparkline samples; the sampler task stops once this is dropped with the router.
    history: Arc<History>,
}

/// The admin router; serve it on `admin_listen`. Inside a tokio runtime it also starts the
/// fleet page's sampler, which lives as long as the router. With `admin_token`, every page
/// but `/healthz` and `/metrics` asks for it (see [`PageAuth`]). `precise` (the control
/// plane's tokenizer and its kept prompts) lets `/debug/mismatch` show where a precise
/// prompt's two views part.
pub fn router(
    state: Arc<State>,
    admin_token: Option<String>,
    precise: Option<Arc<crate::tokenize::Precise>>,
) -> axum::Router {
    let mut registry = telemetry::registry(state.clone());
    registry.register_collector(Box::new(fleet_page::ObservabilityCollector(state.clone())));
    if let Some(gate) = state.admission() {
        gate.register(&mut registry);
    }
    if let Some(window) = state.slo() {
        registry.register_collector(Box::new(crate::slo::SloCollector {
            state: state.clone(),
            window: window.clone(),
        }));
    }
    let history = Arc::new(History::default());
    fleet_page::spawn_sampler(
        Arc::downgrade(&state),
        Arc::downgrade(&history),
        fleet_page::SAMPLE_INTERVAL,
    );
    let auth = PageAuth::new(admin_token);
    let pages = axum::Router::new()
        .route("/", get(fleet_page::page))
        .route("/fleet", get(fleet_page::page))
        .route("/assets/fleet.js", get(fleet_page::script))
        .route("/assets/fleet.css", get(fleet_page::stylesheet))
        .route("/debug/fleet.json", get(fleet))
        .route("/debug/endpoints", get(endpoints))
        .route("/debug/scrapes", get(scrapes))
        .route("/debug/kv_events", get(kv_events))
        .route("/debug/decisions", get(decisions))
        .route("/debug/decisions/{id}", get(decision))
        .route("/debug/mismatch", get(mismatch))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::new(auth),
            PageAuth::check,
        ));
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .merge(pages)
        .fallback(not_found)
        .with_state(Arc::new(Admin {
            state,
            precise,
            registry,
            history,
        }))
}

/// The admin pages' credential: they explain decisions and show per-endpoint load, which only
/// operators should see once the port leaves loopback. Accepts `Authorization: Bearer <token>`
/// (scripts) or HTTP Basic with the token as password (a browser asks for it once).
#[derive(Debug)]
pub struct PageAuth {
    bearer: Option<String>,
    token: Option<String>,
}

impl PageAuth {
    fn new(token: Option<String>) -> Self {
        Self {
            bearer: token.as_ref().map(|t| format!("Bearer {t}")),
            token,
        }
    }

    fn allows(&self, authorization: Option<&[u8]>) -> bool {
        let (Some(bearer), Some(token)) = (&self.bearer, &self.token) else {
            return true;
        };
        let Some(given) = authorization else {
            return false;
        };
        if crate::api::constant_time_eq(given, bearer.as_bytes()) {
            return true;
        }
        use base64::Engine as _;
        given
            .strip_prefix(b"Basic ")
            .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
            .and_then(|pair| {
                let colon = pair.iter().position(|&b| b == b':')?;
                Some(crate::api::constant_time_eq(
                    &pair[colon + 1..],
                    token.as_bytes(),
                ))
            })
            .unwrap_or(false)
    }

    async fn check(
        AxumState(auth): AxumState<Arc<PageAuth>>,
        request: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> Response {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        if auth.allows(given) {
            return next.run(request).await;
        }
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Basic realm=\"kvroute\"")],
            Json(serde_json::json!({ "error": "this page needs the admin token" })),
        )
            .into_response()
    }
}

async fn fleet(AxumState(admin): AxumState<Arc<Admin>>) -> Response {
    let body = fleet_page::fleet_json(&admin.state, &admin.history);
    ([(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

async fn metrics(AxumState(admin): AxumState<Arc<Admin>>) -> Response {
    let mut text = String::with_capacity(16 * 1024);
    match prometheus_client::encoding::text::encode(&mut text, &admin.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], text).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "metrics encoding failed").into_response(),
    }
}

async fn endpoints(AxumState(admin): AxumState<Arc<Admin>>) -> Response {
    Json(admin.state.endpoints()).into_response()
}

async fn scrapes(AxumState(admin): AxumState<Arc<Admin>>) -> Response {
    Json(admin.state.scrape_statuses()).into_response()
}

/// Per-endpoint KV-event subscription status (precise mode).
async fn kv_events(AxumState(admin): AxumState<Arc<Admin>>) -> Response {
    Json(admin.state.kv_streams()).into_response()
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    limit: Option<usize>,
}

async fn decisions(
    AxumState(admin): AxumState<Arc<Admin>>,
    Query(q): Query<ListQuery>,
) -> Response {
    Json(admin.state.recent_decisions(q.limit.unwrap_or(100))).into_response()
}

/// One `/debug/mismatch` entry: the router's record and, for a precise decision whose prompt
/// is still kept, both views' token ids of the block where they part.
#[derive(serde::Serialize)]
struct MismatchView {
    #[serde(flatten)]
    record: scorer_core::reuse::MismatchRecord,
    #[serde(skip_serializing_if = "Option::is_none")]
    diverging_block: Option<crate::tokenize::kept::DivergingBlock>,
}

/// The worst recent outcomes that delivered less than the index believed: predicted, believed
/// and delivered tokens, and the engine block where the two views of the prompt part; for
/// precise decisions, that block's token ids as the router tokenised the prompt and as the
/// serving replica's render API renders it (asked now, concurrently, each within the
/// tokenizer's timeout).
async fn mismatch(AxumState(admin): AxumState<Arc<Admin>>) -> Response {
    let records = admin.state.mismatches();
    let views = records.into_iter().map(|record| {
        let precise = admin.precise.clone();
        async move {
            let diverging_block = match &precise {
                Some(p) => p.diverging_block(&record).await,
                None => None,
            };
            MismatchView {
                record,
                diverging_block,
            }
        }
    });
    Json(futures_util::future::join_all(views).await).into_response()
}

async fn decision(AxumState(admin): AxumState<Arc<Admin>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        let body = serde_json::json!({ "error": format!("decision id {id:?} is not a number") });
        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
    };
    match admin.state.decision(id) {
        Some(d) => Json(d).into_response(),
        None => {
            let body = serde_json::json!({ "error": format!("decision {id} is unknown or no longer kept") });
            (StatusCode::NOT_FOUND, Json(body)).into_response()
        }
    }
}
