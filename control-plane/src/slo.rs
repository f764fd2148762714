//! SLO signals for autoscaling: attainment of TTFT and ITL targets, queue pressure, and a
//! desired-replica estimate for the prefill and decode work of each pool, as Prometheus gauges
//! an HPA (through prometheus-adapter) or a KEDA `prometheus` trigger can scale on.
//!
//! The inputs are the outcome reports the filter already sends (TTFT = `ttfb_ms`, ITL ≈
//! `(total_ms - ttfb_ms) / (completion_tokens - 1)`) over a sliding window, and the scraped
//! replica load. The arithmetic ([`SloWindow::signals`]) is pure; the collector reads the
//! window and the router's endpoint views at scrape time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use scorer_core::protocol::Outcome;
use scorer_core::router::{EndpointView, Health};
use serde::{Deserialize, Serialize};

use crate::state::State;

/// Pool of endpoints no configuration names (the whole fleet when endpoints carry no model).
pub const DEFAULT_POOL: &str = "default";

/// One pool's targets (overrides of the top-level ones).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloTargets {
    /// Time-to-first-token target in ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Inter-token-latency target in ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
}

/// `slo:` in the control plane's YAML. Without it no SLO gauges are exported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloConfig {
    /// Time-to-first-token target in ms (a request attains it when its TTFT is at most this).
    pub ttft_ms: f64,
    /// Inter-token-latency target in ms (mean ITL of one request).
    pub itl_ms: f64,
    /// Sliding window over which attainment and demand are computed.
    pub window_ms: u64,
    /// Fraction of requests that should meet a target; below it the estimate scales up.
    pub attainment_target: f64,
    /// Uncached prompt tokens one replica prefills per second (measure it with `make bench`
    /// or vLLM's benchmark; the default matches the scorer's H100 8B profile).
    pub prefill_tokens_per_s: f64,
    /// Share of that prefill throughput the estimate plans to use (headroom for bursts).
    pub prefill_utilization: f64,
    /// Concurrent streams one replica decodes within the ITL target.
    pub decode_streams_per_replica: f64,
    /// KV-cache use per replica the estimate plans for.
    pub kv_target: f64,
    /// Upper bound of any desired-replica estimate.
    pub max_replicas: u32,
    /// Most outcomes kept in the window (a bound on memory at high request rates).
    pub max_samples: usize,
    /// Per-pool targets; a pool is the `model` of its endpoints in `endpoints:`.
    pub pools: BTreeMap<String, SloTargets>,
}

impl Default for SloConfig {
    fn default() -> Self {
        Self {
            ttft_ms: 1_000.0,
            itl_ms: 50.0,
            window_ms: 60_000,
            attainment_target: 0.9,
            prefill_tokens_per_s: 12_000.0,
            prefill_utilization: 0.7,
            decode_streams_per_replica: 64.0,
            kv_target: 0.8,
            max_replicas: 64,
            max_samples: 100_000,
            pools: BTreeMap::new(),
        }
    }
}

/// Why an SLO configuration cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("slo.{field}: {reason}")]
pub struct SloConfigError {
    /// The offending field.
    pub field: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl SloConfig {
    /// Checks ranges serde cannot.
    pub fn validate(&self) -> Result<(), SloConfigError> {
        let bad = |field: &str, reason| {
            Err(SloConfigError {
                field: field.to_string(),
                reason,
            })
        };
        let positive = |v: f64| v.is_finite() && v > 0.0;
        for (field, v) in [
            ("ttft_ms", self.ttft_ms),
            ("itl_ms", self.itl_ms),
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            (
                "decode_streams_per_replica",
                self.decode_streams_per_replica,
            ),
        ] {
            if !positive(v) {
                return bad(field, "must be a positive number");
            }
        }
        for (field, v) in [
            ("attainment_target", self.attainment_target),
            ("prefill_utilization", self.prefill_utilization),
            ("kv_target", self.kv_target),
        ] {
            if !positive(v) || v > 1.0 {
                return bad(field, "must be in (0, 1]");
            }
        }
        if self.window_ms == 0 || self.max_samples == 0 || self.max_replicas == 0 {
            return bad("window_ms/max_samples/max_replicas", "must be positive");
        }
        for (name, t) in &self.pools {
            if t.ttft_ms.is_some_and(|v| !positive(v)) || t.itl_ms.is_some_and(|v| !positive(v)) {
                return bad(&format!("pools.{name}"), "targets must be positive numbers");
            }
        }
        Ok(())
    }

    fn targets(&self, pool: &str) -> (f64, f64) {
        let t = self.pools.get(pool);
        (
            t.and_then(|t| t.ttft_ms).unwrap_or(self.ttft_ms),
            t.and_then(|t| t.itl_ms).unwrap_or(self.itl_ms),
        )
    }
}

#[derive(Debug, Clone)]
struct Sample {
    at_ms: u64,
    pool: Arc<str>,
    ttft_ms: Option<f64>,
    itl_ms: Option<f64>,
    uncached_prompt_tokens: u64,
}

/// Replica load of one pool at scrape time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolLoad {
    /// Ready endpoints in the pool.
    pub replicas: u32,
    /// Σ running requests.
    pub running: f64,
    /// Σ waiting requests.
    pub waiting: f64,
    /// Σ KV-cache use (1.0 = one full replica).
    pub kv_usage: f64,
}

/// What the gauges show for one pool.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolSignals {
    /// Fraction of windowed requests whose TTFT met the target (1 with no samples).
    pub ttft_attainment: f64,
    /// Fraction of windowed requests whose mean ITL met the target (1 with no samples).
    pub itl_attainment: f64,
    /// Requests with a TTFT in the window.
    pub ttft_samples: u64,
    /// Requests with an ITL (2+ output tokens) in the window.
    pub itl_samples: u64,
    /// Σ waiting / max(Σ running, 1): how many requests queue per request being served.
    pub queue_pressure: f64,
    /// Uncached prompt tokens per second over the window.
    pub prefill_demand_tokens_per_s: f64,
    /// Desired replicas for the prefill work.
    pub desired_prefill: u32,
    /// Desired replicas for the decode work.
    pub desired_decode: u32,
}

/// Outcomes of the last `window_ms`, by pool.
#[derive(Debug)]
pub struct SloWindow {
    config: SloConfig,
    /// `ip:port` → pool, for endpoints the configuration names with a `model`.
    pools: HashMap<String, Arc<str>>,
    default_pool: Arc<str>,
    samples: VecDeque<Sample>,
}

impl SloWindow {
    /// An empty window; `endpoint_pools` maps `ip:port` to its pool (others are `default`).
    pub fn new(config: SloConfig, endpoint_pools: HashMap<String, String>) -> Self {
        Self {
            config,
            pools: endpoint_pools
                .into_iter()
                .map(|(e, p)| (e, Arc::from(p.as_str())))
                .collect(),
            default_pool: Arc::from(DEFAULT_POOL),
            samples: VecDeque::new(),
        }
    }

    /// The active settings.
    pub fn config(&self) -> &SloConfig {
        &self.config
    }

    /// The pool `endpoint` belongs to.
    pub fn pool_of(&self, endpoint: &str) -> Arc<str> {
        self.pools
            .get(endpoint)
            .cloned()
            .unwrap_or_else(|| self.default_pool.clone())
    }

    /// Adds finished requests (only successful ones: an error's timing says nothing about the
    /// SLO a served request got).
    pub fn record(&mut self, outcomes: &[Outcome], now_ms: u64) {
        for o in outcomes.iter().filter(|o| (200..300).contains(&o.status)) {
            let ttft_ms = o.ttfb_ms.map(|t| t as f64);
            let itl_ms = match (o.ttfb_ms, o.completion_tokens) {
                (Some(ttfb), Some(n)) if n >= 2 => {
                    Some(o.total_ms.saturating_sub(ttfb) as f64 / f64::from(n - 1))
                }
                _ => None,
            };
            let uncached = o
                .prompt_tokens
                .unwrap_or(0)
                .saturating_sub(o.cached_tokens.unwrap_or(0));
            if self.samples.len() >= self.config.max_samples {
                self.samples.pop_front();
            }
            self.samples.push_back(Sample {
                at_ms: now_ms,
                pool: self.pool_of(&o.endpoint),
                ttft_ms,
                itl_ms,
                uncached_prompt_tokens: u64::from(uncached),
            });
        }
        self.expire(now_ms);
    }

    fn expire(&mut self, now_ms: u64) {
        let oldest = now_ms.saturating_sub(self.config.window_ms);
        while self.samples.front().is_some_and(|s| s.at_ms < oldest) {
            self.samples.pop_front();
        }
    }

    /// Pools with load or samples, each with its signals. `loads` is the scraped load by pool;
    /// `now_ms` bounds the window (and its length while the process is younger than it).
    pub fn signals(
        &mut self,
        loads: &BTreeMap<String, PoolLoad>,
        now_ms: u64,
    ) -> BTreeMap<String, PoolSignals> {
        self.expire(now_ms);
        let c = &self.config;
        #[derive(Default)]
        struct Acc {
            ttft_ok: u64,
            ttft_n: u64,
            itl_ok: u64,
            itl_n: u64,
            uncached: u64,
        }
        let mut acc: BTreeMap<String, Acc> =
            loads.keys().map(|p| (p.clone(), Acc::default())).collect();
        for s in &self.samples {
            let (ttft_target, itl_target) = c.targets(&s.pool);
            let a = acc.entry(s.pool.to_string()).or_default();
            if let Some(t) = s.ttft_ms {
                a.ttft_n += 1;
                a.ttft_ok += u64::from(t <= ttft_target);
            }
            if let Some(t) = s.itl_ms {
                a.itl_n += 1;
                a.itl_ok += u64::from(t <= itl_target);
            }
            a.uncached += s.uncached_prompt_tokens;
        }
        let span_s = (now_ms.min(c.window_ms).max(1_000)) as f64 / 1e3;
        acc.into_iter()
            .map(|(pool, a)| {
                let load = loads.get(&pool).copied().unwrap_or_default();
                let ratio = |ok: u64, n: u64| if n == 0 { 1.0 } else { ok as f64 / n as f64 };
                let ttft_attainment = ratio(a.ttft_ok, a.ttft_n);
                let itl_attainment = ratio(a.itl_ok, a.itl_n);
                let demand = a.uncached as f64 / span_s;
                let prefill_by_load = demand / (c.prefill_tokens_per_s * c.prefill_utilization);
                let decode_by_load =
                    (load.running / c.decode_streams_per_replica).max(load.kv_usage / c.kv_target);
                let signals = PoolSignals {
                    ttft_attainment,
                    itl_attainment,
                    ttft_samples: a.ttft_n,
                    itl_samples: a.itl_n,
                    queue_pressure: load.waiting / load.running.max(1.0),
                    prefill_demand_tokens_per_s: demand,
                    desired_prefill: desired(c, load.replicas, prefill_by_load, ttft_attainment),
                    desired_decode: desired(c, load.replicas, decode_by_load, itl_attainment),
                };
                (pool, signals)
            })
            .collect()
    }
}

/// `max(⌈by_load⌉, SLO correction, 1)`, capped at `max_replicas`. The SLO correction applies
/// when attainment is below target: current replicas × target / attainment, at most doubling
/// per evaluation (the autoscaler's own rate limits then smooth it).
fn desired(c: &SloConfig, replicas: u32, by_load: f64, attainment: f64) -> u32 {
    let by_load = if by_load.is_finite() {
        by_load.ceil()
    } else {
        0.0
    };
    let by_slo = if attainment < c.attainment_target {
        (f64::from(replicas.max(1)) * (c.attainment_target / attainment.max(1e-3)).min(2.0)).ceil()
    } else {
        0.0
    };
    let want = by_load.max(by_slo).max(1.0);
    (want as u32).min(c.max_replicas)
}

/// Scraped load of every pool, from the router's endpoint views.
pub fn pool_loads(window: &SloWindow, views: &[EndpointView]) -> BTreeMap<String, PoolLoad> {
    let mut loads: BTreeMap<String, PoolLoad> = BTreeMap::new();
    for v in views.iter().filter(|v| v.health == Health::Ready) {
        let l = loads
            .entry(window.pool_of(&v.address).to_string())
            .or_default();
        l.replicas += 1;
        if let Some(m) = v.metrics {
            l.running += f64::from(m.running);
            l.waiting += f64::from(m.waiting);
            l.kv_usage += m.kv_usage;
        }
    }
    loads
}

/// The SLO gauges, computed at scrape time from the window and the router's endpoint views.
#[derive(Debug)]
pub struct SloCollector {
    /// The control plane's state (its window and endpoints).
    pub state: Arc<State>,
    /// The window the state's feedback path fills.
    pub window: Arc<Mutex<SloWindow>>,
}

impl Collector for SloCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let now_ms = self.state.now_ms();
        let views = self.state.snapshot().endpoints;
        let signals = {
            let mut w = self.window.lock();
            let loads = pool_loads(&w, &views);
            w.signals(&loads, now_ms)
        };
        pool_gauges(
            &mut encoder,
            "slo_attainment_ratio",
            "Fraction of requests in the SLO window that met the pool's target, by kind (ttft, itl)",
            &signals,
            Some("kind"),
            |s| vec![("ttft", s.ttft_attainment), ("itl", s.itl_attainment)],
        )?;
        pool_gauges(
            &mut encoder,
            "slo_samples",
            "Requests in the SLO window with a TTFT (ttft) or a mean ITL (itl), by pool",
            &signals,
            Some("kind"),
            |s| {
                vec![
                    ("ttft", s.ttft_samples as f64),
                    ("itl", s.itl_samples as f64),
                ]
            },
        )?;
        pool_gauges(
            &mut encoder,
            "queue_pressure",
            "Waiting requests per running request over the pool's replicas (scraped)",
            &signals,
            None,
            |s| vec![("", s.queue_pressure)],
        )?;
        pool_gauges(
            &mut encoder,
            "prefill_demand_tokens_per_second",
            "Uncached prompt tokens per second over the SLO window, by pool",
            &signals,
            None,
            |s| vec![("", s.prefill_demand_tokens_per_s)],
        )?;
        pool_gauges(
            &mut encoder,
            "desired_replicas",
            "Replicas the pool needs for its prefill and decode work at the SLO (see docs/FEATURES.md)",
            &signals,
            Some("role"),
            |s| {
                vec![
                    ("prefill", i64::from(s.desired_prefill)),
                    ("decode", i64::from(s.desired_decode)),
                ]
            },
        )
    }
}

/// Writes one pool-labelled gauge family of [`SloCollector`]: per pool, a sample per
/// `(value, gauge)` that `samples` gives, labelled `pool` and, with `label`, `label=value`
/// (without it the pool's one sample carries the pool label only).
fn pool_gauges<S, N: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    by_pool: &BTreeMap<String, S>,
    label: Option<&str>,
    samples: impl Fn(&S) -> Vec<(&'static str, N)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (pool, s) in by_pool {
        for (value, gauge) in samples(s) {
            let mut labels = vec![("pool", pool.as_str())];
            labels.extend(label.map(|l| (l, value)));
            ConstGauge::new(gauge).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(
        endpoint: &str,
        ttfb: u64,
        total: u64,
        prompt: u32,
        cached: u32,
        out: u32,
    ) -> Outcome {
        Outcome {
            decision_id: 1,
            endpoint: endpoint.into(),
            status: 200,
            ttfb_ms: Some(ttfb),
            total_ms: total,
            prompt_tokens: Some(prompt),
            completion_tokens: Some(out),
            cached_tokens: Some(cached),
            ..Outcome::default()
        }
    }

    fn window() -> SloWindow {
        let config = SloConfig {
            ttft_ms: 100.0,
            itl_ms: 10.0,
            window_ms: 10_000,
            prefill_tokens_per_s: 1_000.0,
            prefill_utilization: 1.0,
            decode_streams_per_replica: 4.0,
            ..SloConfig::default()
        };
        let pools = HashMap::from([("10.0.0.2:8000".to_string(), "big".to_string())]);
        SloWindow::new(config, pools)
    }

    fn load(replicas: u32, running: f64, waiting: f64, kv: f64) -> PoolLoad {
        PoolLoad {
            replicas,
            running,
            waiting,
            kv_usage: kv,
        }
    }

    #[test]
    fn attainment_counts_requests_within_target_by_pool() {
        let mut w = window();
        w.record(
            &[
                outcome("10.0.0.1:8000", 50, 150, 100, 0, 11), // ttft ok, itl 10 ok
                outcome("10.0.0.1:8000", 150, 500, 100, 0, 11), // ttft miss, itl 35 miss
                outcome("10.0.0.1:8000", 80, 80, 100, 0, 1),   // no itl (one token)
                outcome("10.0.0.2:8000", 500, 600, 100, 0, 2), // other pool
                Outcome {
                    status: 500,
                    ..outcome("10.0.0.1:8000", 1, 1, 1, 0, 1)
                },
            ],
            5_000,
        );
        let loads = BTreeMap::from([("default".to_string(), load(2, 4.0, 2.0, 0.5))]);
        let s = w.signals(&loads, 5_000);
        let d = s["default"];
        assert!((d.ttft_attainment - 2.0 / 3.0).abs() < 1e-9);
        assert_eq!((d.ttft_samples, d.itl_samples), (3, 2));
        assert!((d.itl_attainment - 0.5).abs() < 1e-9);
        assert!((d.queue_pressure - 0.5).abs() < 1e-9);
        assert_eq!(s["big"].ttft_attainment, 0.0);
        // Out of the window: gone, attainment back to "nothing violated".
        let s = w.signals(&loads, 16_000);
        assert_eq!(s["default"].ttft_samples, 0);
        assert_eq!(s["default"].ttft_attainment, 1.0);
        assert!(!s.contains_key("big"));
    }

    #[test]
    fn desired_replicas_follow_demand_and_missed_targets() {
        let mut w = window();
        // 10 s window, 50_000 uncached tokens => 5_000 tok/s => 5 prefill replicas at 1_000.
        let outs: Vec<Outcome> = (0..50)
            .map(|_| outcome("10.0.0.1:8000", 10, 20, 1_100, 100, 2))
            .collect();
        w.record(&outs, 10_000);
        let loads = BTreeMap::from([("default".to_string(), load(2, 10.0, 0.0, 1.0))]);
        let d = w.signals(&loads, 10_000)["default"];
        assert!((d.prefill_demand_tokens_per_s - 5_000.0).abs() < 1e-6);
        assert_eq!(d.desired_prefill, 5);
        // 10 streams at 4 per replica => 3.
        assert_eq!(d.desired_decode, 3);
        // Missing the TTFT target with an idle fleet: the SLO correction doubles at most.
        let mut w = window();
        w.record(&[outcome("10.0.0.1:8000", 900, 901, 10, 0, 2)], 1_000);
        let loads = BTreeMap::from([("default".to_string(), load(3, 0.0, 0.0, 0.0))]);
        let d = w.signals(&loads, 1_000)["default"];
        assert_eq!(d.desired_prefill, 6);
        assert_eq!(d.desired_decode, 1);
    }

    #[test]
    fn the_window_is_bounded() {
        let mut w = SloWindow::new(
            SloConfig {
                max_samples: 3,
                ..SloConfig::default()
            },
            HashMap::new(),
        );
        let outs: Vec<Outcome> = (0..10).map(|_| outcome("a:1", 1, 2, 1, 0, 2)).collect();
        w.record(&outs, 1);
        let s = w.signals(&BTreeMap::new(), 1);
        assert_eq!(s["default"].ttft_samples, 3);
    }

    #[test]
    fn validation_rejects_nonsense() {
        assert!(SloConfig::default().validate().is_ok());
        for c in [
            SloConfig {
                ttft_ms: 0.0,
                ..SloConfig::default()
            },
            SloConfig {
                attainment_target: 1.5,
                ..SloConfig::default()
            },
            SloConfig {
                window_ms: 0,
                ..SloConfig::default()
            },
        ] {
            assert!(c.validate().is_err());
        }
    }
}
