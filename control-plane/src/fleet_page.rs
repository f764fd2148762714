//! The live fleet page on the admin port: `GET /` (or `/fleet`) serves a self-contained HTML page
//! that polls `GET /debug/fleet.json` and draws every endpoint's queue, KV use, cache hit rate and
//! in-flight work, with sparklines, plus the most recent decisions.
//!
//! The history behind the sparklines is a small ring of samples per endpoint, kept here rather
//! than in [`State`]: a sampler task reads the router's endpoint views every
//! [`SAMPLE_INTERVAL`] for as long as the admin router lives. Per-endpoint cache hit rates come
//! from the outcomes the filter reports (`usage.prompt_tokens_details.cached_tokens`), so they
//! are the engines' own numbers, not the router's predictions.
//!
//! Assets are compiled in (`include_str!`), reference nothing outside this server, and are
//! served with a `default-src 'self'` content security policy.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use scorer_core::protocol::RouteResponse;
use scorer_core::reuse::ReuseTotals;
use scorer_core::router::{EndpointView, Health, ServedTotals};
use serde::Serialize;

use crate::state::{KvStreamStatus, State};

/// How often the sampler records one point per endpoint.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(500);
/// Points kept per endpoint: two minutes at [`SAMPLE_INTERVAL`].
pub const HISTORY_LEN: usize = 240;
/// Samples a sparkline's hit rate is computed over (5 s at [`SAMPLE_INTERVAL`]): outcomes
/// arrive in bursts, a per-sample rate would mostly be gaps.
pub const HIT_RATE_WINDOW: usize = 10;
/// Decisions listed on the page.
const RECENT_DECISIONS: usize = 25;
/// Decisions the reason breakdown is computed over.
const REASON_WINDOW: usize = 1_000;

const PAGE_HTML: &str = include_str!("../assets/fleet.html");
const PAGE_JS: &str = include_str!("../assets/fleet.js");
const PAGE_CSS: &str = include_str!("../assets/fleet.css");
/// Only this server's own assets and JSON; no inline script, no CDN.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One point of one endpoint's history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    /// When, in ms since the control plane started.
    pub t_ms: u64,
    /// `vllm:num_requests_waiting` (the engine's queue), when scraped.
    pub waiting: Option<u32>,
    /// `vllm:num_requests_running`, when scraped.
    pub running: Option<u32>,
    /// `vllm:kv_cache_usage_perc` (0..1), when scraped.
    pub kv_usage: Option<f64>,
    /// Requests routed there and not yet reported.
    pub inflight: u32,
    /// Prefix-cache hit rate of the outcomes reported over the last [`HIT_RATE_WINDOW`] samples
    /// (tokens), when any were reported.
    pub hit_rate: Option<f64>,
    /// Whether the endpoint was a candidate (answering and not stale).
    pub up: bool,
}

#[derive(Debug, Default)]
struct Ring {
    samples: VecDeque<Sample>,
    /// Served totals at the latest samples (at most [`HIT_RATE_WINDOW`] + 1), to turn
    /// cumulative counts into a windowed rate.
    served: VecDeque<ServedTotals>,
}

/// Per-endpoint sample rings, bounded in points and in endpoints.
#[derive(Debug, Default)]
pub struct History {
    rings: Mutex<BTreeMap<String, Ring>>,
}

impl History {
    /// Records one sample per endpoint in `views`; endpoints no longer present are forgotten.
    pub fn record(&self, now_ms: u64, views: &[EndpointView]) {
        let mut rings = self.rings.lock();
        rings.retain(|address, _| views.iter().any(|v| &v.address == address));
        for view in views {
            let ring = rings.entry(view.address.clone()).or_default();
            let base = ring.served.front().copied().unwrap_or_default();
            let prompt = view.served.prompt_tokens.saturating_sub(base.prompt_tokens);
            let cached = view.served.cached_tokens.saturating_sub(base.cached_tokens);
            if ring.served.len() >= HIT_RATE_WINDOW {
                ring.served.pop_front();
            }
            ring.served.push_back(view.served);
            if ring.samples.len() >= HISTORY_LEN {
                ring.samples.pop_front();
            }
            ring.samples.push_back(Sample {
                t_ms: now_ms,
                waiting: view.metrics.map(|m| m.waiting),
                running: view.metrics.map(|m| m.running),
                kv_usage: view.metrics.map(|m| m.kv_usage),
                inflight: view.inflight,
                hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
                up: view.health == Health::Ready && !view.stale,
            });
        }
    }

    /// `address`'s samples, oldest first.
    pub fn samples(&self, address: &str) -> Vec<Sample> {
        self.rings
            .lock()
            .get(address)
            .map(|r| r.samples.iter().copied().collect())
            .unwrap_or_default()
    }
}

/// Samples `state` into `history` every `interval` until either is dropped.
pub fn spawn_sampler(state: Weak<State>, history: Weak<History>, interval: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // Outside a runtime (a unit test building the router): the page shows live values only.
        return;
    };
    runtime.spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (Some(state), Some(history)) = (state.upgrade(), history.upgrade()) else {
                return;
            };
            history.record(state.now_ms(), &state.endpoints());
        }
    });
}

/// One endpoint as the page shows it.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointRow {
    /// Everything the router knows about it.
    #[serde(flatten)]
    pub view: EndpointView,
    /// Milliseconds since its `/metrics` last answered (`None`: never).
    pub scrape_age_ms: Option<u64>,
    /// The latest scrape error, if the last scrape failed.
    pub scrape_error: Option<String>,
    /// Prefix-cache hit rate over every reported outcome it served (tokens).
    pub hit_rate: Option<f64>,
    /// Its KV-event subscription (precise mode): connection, gaps, lag.
    pub kv_events: Option<KvStreamStatus>,
    /// Its sparkline samples, oldest first.
    pub history: Vec<Sample>,
}

/// Fleet-wide numbers at the top of the page.
#[derive(Debug, Clone, Serialize)]
pub struct Totals {
    /// Decisions made since start.
    pub decisions: u64,
    /// Decisions scored from KV events.
    pub precise_decisions: u64,
    /// Decisions with no usable endpoint (the filter failed open).
    pub no_endpoint: u64,
    /// Decisions where the guard or the wait cap skipped the cheapest endpoint.
    pub guarded: u64,
    /// Outcomes received.
    pub outcomes: u64,
    /// Outcomes served by a fallback endpoint.
    pub fallbacks: u64,
    /// Requests routed and not yet reported.
    pub inflight: usize,
    /// Distinct blocks in the prefix index.
    pub index_blocks: usize,
    /// Approximate heap bytes of the prefix index.
    pub index_bytes: usize,
    /// Cached tokens the router predicted, over outcomes that reported cached tokens.
    pub predicted_cached_tokens: u64,
    /// Cached tokens the engines reported, over the same outcomes.
    pub actual_cached_tokens: u64,
    /// Fleet prefix-cache hit rate over reported outcomes (tokens).
    pub hit_rate: Option<f64>,
    /// Reasons of the most recent decisions (at most 1,000), counted.
    pub recent_reasons: BTreeMap<String, u64>,
    /// The fleet numbers over every pool: reuse available, aimed for, delivered, the gap.
    pub reuse: ReuseTotals,
}

/// One pool (model) in the fleet numbers' table.
#[derive(Debug, Clone, Serialize)]
pub struct PoolRow {
    /// The model its requests named.
    pub pool: String,
    /// Reuse available, aimed for, delivered and the gap by reason, in tokens.
    pub reuse: ReuseTotals,
}

/// What `GET /debug/fleet.json` answers.
#[derive(Debug, Clone, Serialize)]
pub struct FleetJson {
    /// Milliseconds since the control plane started.
    pub now_ms: u64,
    /// Milliseconds between two history samples.
    pub sample_interval_ms: u64,
    /// Fleet-wide numbers.
    pub totals: Totals,
    /// Every endpoint, in configuration order.
    pub endpoints: Vec<EndpointRow>,
    /// The fleet numbers per pool, in the order pools were first routed.
    pub pools: Vec<PoolRow>,
    /// The latest decisions, newest first.
    pub recent: Vec<RouteResponse>,
}

fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

/// Builds the page's JSON from the live state and the sample history.
pub fn fleet_json(state: &State, history: &History) -> FleetJson {
    let now_ms = state.now_ms();
    let snap = state.snapshot();
    let scrapes: BTreeMap<String, _> = state
        .scrape_statuses()
        .into_iter()
        .map(|s| (s.address.clone(), s))
        .collect();
    let mut streams: BTreeMap<String, KvStreamStatus> = state
        .kv_streams()
        .into_iter()
        .map(|s| (s.address.clone(), s))
        .collect();
    let (mut prompt, mut cached) = (0, 0);
    let endpoints = snap
        .endpoints
        .into_iter()
        .map(|view| {
            prompt += view.served.prompt_tokens;
            cached += view.served.cached_tokens;
            let scrape = scrapes.get(&view.address);
            EndpointRow {
                scrape_age_ms: scrape
                    .and_then(|s| s.last_success_ms)
                    .map(|t| now_ms.saturating_sub(t)),
                scrape_error: scrape.and_then(|s| s.last_error.clone()),
                hit_rate: ratio(view.served.cached_tokens, view.served.prompt_tokens),
                kv_events: streams.remove(&view.address),
                history: history.samples(&view.address),
                view,
            }
        })
        .collect();
    let window = state.recent_decisions(REASON_WINDOW);
    let mut recent_reasons = BTreeMap::new();
    for d in &window {
        *recent_reasons
            .entry(d.reason.as_str().to_owned())
            .or_insert(0) += 1;
    }
    let s = snap.stats;
    let mut reuse = ReuseTotals::default();
    for (_, t) in &snap.pools {
        reuse.merge(t);
    }
    let pools = snap
        .pools
        .into_iter()
        .map(|(pool, reuse)| PoolRow { pool, reuse })
        .collect();
    FleetJson {
        now_ms,
        sample_interval_ms: SAMPLE_INTERVAL.as_millis() as u64,
        totals: Totals {
            decisions: s.decisions,
            precise_decisions: s.precise_decisions,
            no_endpoint: s.no_endpoint,
            guarded: s.guarded,
            outcomes: s.outcomes,
            fallbacks: s.fallbacks,
            inflight: snap.inflight,
            index_blocks: snap.index_blocks,
            index_bytes: snap.index_bytes,
            predicted_cached_tokens: s.predicted_cached_tokens,
            actual_cached_tokens: s.actual_cached_tokens,
            hit_rate: ratio(cached, prompt),
            recent_reasons,
            reuse,
        },
        endpoints,
        pools,
        recent: window.into_iter().take(RECENT_DECISIONS).collect(),
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `GET /` and `GET /fleet`: the page.
pub async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE_HTML)
}

/// `GET /assets/fleet.js`.
pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", PAGE_JS)
}

/// `GET /assets/fleet.css`.
pub async fn stylesheet() -> Response {
    asset("text/css; charset=utf-8", PAGE_CSS)
}

/// `/metrics` additions that read the router and the scrape book at scrape time: per-endpoint
/// scrape age and served totals (hit rates), decisions by scoring policy, fallbacks.
#[derive(Debug)]
pub struct ObservabilityCollector(pub Arc<State>);

impl Collector for ObservabilityCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let state = &self.0;
        let now_ms = state.now_ms();
        let snap = state.snapshot();
        let s = snap.stats;

        let approximate = s
            .decisions
            .saturating_sub(s.no_endpoint)
            .saturating_sub(s.precise_decisions);
        let mut family = encoder.encode_descriptor(
            "decisions_by_policy",
            "Decisions by how the chosen endpoint was scored: precise (KV events) or approximate \
             (the filter's prompt hashes); no_endpoint when none was usable",
            None,
            MetricType::Counter,
        )?;
        for (policy, n) in [
            ("approximate", approximate),
            ("precise", s.precise_decisions),
            ("no_endpoint", s.no_endpoint),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&[("policy", policy)])?)?;
        }
        ConstCounter::new(s.fallbacks).encode(encoder.encode_descriptor(
            "fallback_outcomes",
            "Outcomes served by another endpoint than the chosen one (Envoy used a fallback)",
            None,
            MetricType::Counter,
        )?)?;

        type Served = fn(&EndpointView) -> u64;
        let served: [(&str, &str, Served); 4] = [
            (
                "endpoint_served_outcomes",
                "Outcomes reported for requests the endpoint served",
                |e| e.served.outcomes,
            ),
            (
                "endpoint_fallback_outcomes",
                "Outcomes the endpoint served as a fallback of another endpoint's decision",
                |e| e.served.fallbacks,
            ),
            (
                "endpoint_served_prompt_tokens",
                "Prompt tokens of outcomes that reported cached tokens (hit-rate denominator)",
                |e| e.served.prompt_tokens,
            ),
            (
                "endpoint_served_cached_tokens",
                "Cached prompt tokens the engine reported (hit-rate numerator)",
                |e| e.served.cached_tokens,
            ),
        ];
        for (name, help, get) in served {
            crate::telemetry::endpoint_counter(&mut encoder, &snap.endpoints, name, help, get)?;
        }

        let scrapes = state.scrape_statuses();
        let mut family = encoder.encode_descriptor(
            "endpoint_scrape_age_seconds",
            "Seconds since the endpoint's /metrics last answered (absent: never)",
            None,
            MetricType::Gauge,
        )?;
        for status in &scrapes {
            if let Some(t) = status.last_success_ms {
                let age = now_ms.saturating_sub(t) as f64 / 1e3;
                let labels = [("endpoint", status.address.as_str())];
                ConstGauge::new(age).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use scorer_core::protocol::{FeedbackBatch, Outcome, RouteRequest};
    use scorer_core::router::{EndpointMetrics, RouterConfig};

    use super::*;

    fn state() -> Arc<State> {
        let eps = vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()];
        Arc::new(State::new(RouterConfig::default(), &eps, 64, 1).unwrap())
    }

    fn route_and_report(state: &State, prompt: u32, cached: u32) -> RouteResponse {
        let r = state.route(&RouteRequest {
            model: "m".into(),
            block_hashes: vec![1, 2, 3],
            prompt_tokens: prompt,
            ..Default::default()
        });
        state.feedback(&FeedbackBatch {
            outcomes: vec![Outcome {
                decision_id: r.decision_id,
                endpoint: r.endpoints[0].clone(),
                status: 200,
                prompt_tokens: Some(prompt),
                cached_tokens: Some(cached),
                ..Default::default()
            }],
            ..Default::default()
        });
        r
    }

    #[test]
    fn samples_turn_served_totals_into_interval_hit_rates() {
        let state = state();
        let history = History::default();
        state.update_metrics(
            "10.0.0.1:8000",
            EndpointMetrics {
                running: 3,
                waiting: 2,
                kv_usage: 0.5,
                capacity_tokens: None,
                counters: None,
                ..Default::default()
            },
        );
        history.record(0, &state.endpoints());
        let first = route_and_report(&state, 100, 0);
        let second = route_and_report(&state, 100, 80);
        history.record(500, &state.endpoints());
        let chosen = &first.endpoints[0];
        assert_eq!(
            chosen, &second.endpoints[0],
            "the second turn follows the first"
        );
        let samples = history.samples(chosen);
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].hit_rate, None);
        assert_eq!(samples[1].hit_rate, Some(0.4));
        let other = history.samples(if chosen == "10.0.0.1:8000" {
            "10.0.0.2:8000"
        } else {
            "10.0.0.1:8000"
        });
        assert_eq!(other[1].hit_rate, None);
        // The rate covers a window of samples, then lapses without new outcomes.
        for t in 1..=HIT_RATE_WINDOW as u64 {
            history.record(500 + t * 500, &state.endpoints());
        }
        let samples = history.samples(chosen);
        assert_eq!(samples[samples.len() - 2].hit_rate, Some(0.4));
        assert_eq!(samples.last().unwrap().hit_rate, None);
        let scraped = history.samples("10.0.0.1:8000");
        assert_eq!((scraped[0].waiting, scraped[0].running), (Some(2), Some(3)));
        assert_eq!(history.samples("10.0.0.2:8000")[0].waiting, None);

        let json = fleet_json(&state, &history);
        assert_eq!(json.totals.decisions, 2);
        assert_eq!(json.totals.outcomes, 2);
        assert_eq!(json.totals.hit_rate, Some(0.4));
        // The fleet numbers: one pool, the same outcomes; the second turn's reuse was in the
        // window and 80 tokens of it delivered.
        assert_eq!(json.pools.len(), 1);
        assert_eq!(json.pools[0].pool, "m");
        assert_eq!(json.pools[0].reuse, json.totals.reuse);
        assert_eq!(json.totals.reuse.outcomes, 2);
        assert_eq!(json.totals.reuse.delivered_tokens, 80);
        assert!(json.totals.reuse.available_tokens > 0);
        assert_eq!(json.recent.len(), 2);
        assert_eq!(json.recent[0].decision_id, second.decision_id);
        assert_eq!(json.totals.recent_reasons.values().sum::<u64>(), 2);
        let row = json.endpoints.iter().find(|e| &e.view.address == chosen);
        assert_eq!(row.unwrap().hit_rate, Some(0.4));
        let text = serde_json::to_value(&json).unwrap();
        assert!(text["endpoints"][0]["address"].is_string(), "{text}");
        assert!(text["endpoints"][0]["history"].is_array(), "{text}");
    }

    #[test]
    fn rows_carry_the_kv_event_stream_of_their_endpoint() {
        let state = state();
        state.kv_stream("10.0.0.2:8000", |k| {
            k.connected = true;
            k.gaps = 2;
            k.lag_ms = Some(3.5);
        });
        let json = fleet_json(&state, &History::default());
        let row = |a: &str| json.endpoints.iter().find(|e| e.view.address == a).unwrap();
        assert!(row("10.0.0.1:8000").kv_events.is_none());
        let k = row("10.0.0.2:8000").kv_events.as_ref().unwrap();
        assert_eq!((k.gaps, k.lag_ms), (2, Some(3.5)));
    }

    #[test]
    fn rings_are_bounded_and_forget_removed_endpoints() {
        let state = state();
        let history = History::default();
        let views = state.endpoints();
        for t in 0..(HISTORY_LEN as u64 + 10) {
            history.record(t, &views);
        }
        let samples = history.samples("10.0.0.1:8000");
        assert_eq!(samples.len(), HISTORY_LEN);
        assert_eq!(samples[0].t_ms, 10);
        history.record(1_000, &views[..1]);
        assert!(history.samples("10.0.0.2:8000").is_empty());
    }

    #[test]
    fn collector_exports_policy_fallback_and_served_metrics() {
        let state = state();
        route_and_report(&state, 200, 50);
        state.record_scrape("10.0.0.1:8000", None, Duration::from_millis(1));
        let mut registry = prometheus_client::registry::Registry::with_prefix("kvroute");
        registry.register_collector(Box::new(ObservabilityCollector(state.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        crate::test_util::assert_exposes(
            &text,
            &[
                "kvroute_decisions_by_policy_total{policy=\"approximate\"} 1",
                "kvroute_decisions_by_policy_total{policy=\"precise\"} 0",
                "kvroute_fallback_outcomes_total 0",
                "kvroute_endpoint_served_cached_tokens_total{endpoint=",
                "kvroute_endpoint_scrape_age_seconds{endpoint=\"10.0.0.1:8000\"}",
            ],
        );
    }
}
