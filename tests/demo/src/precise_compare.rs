//! Approximate vs precise mode, live: the same multi-turn workload through real Envoy + kvroute
//! on a cold fleet of `vllm-sim` replicas whose KV caches are smaller than the workload's
//! working set, once with every route approximate and once with every route precise.
//!
//! Both runs start identical fleets (same seeds, same `--kv-capacity-tokens`, KV events published
//! in both so the replicas do the same work); only the filter's route `mode` differs. The figures
//! are the client's TTFT, the replicas' own prefix-cache hit rate, and the control plane's
//! predicted vs the engines' reported cached tokens (`kvroute_predicted_cached_tokens_total`,
//! `kvroute_actual_cached_tokens_total`). With evictions, the approximate index keeps believing
//! in blocks an engine has dropped; the precise index follows the engines' `BlockRemoved` events.
//!
//! `kvroute-demo --compare approximate,precise` prints this comparison; `tests/e2e/src/precise.rs`
//! runs a small version.

use std::time::Duration;

use serde::Serialize;
use serde_json::json;

use kvroute_harness::loadgen::{self, RunResult, RunSummary, Workload};
use kvroute_harness::{
    Fleet, FleetConfig, HarnessError, RouterKind, TextTable, Tools, percent, prometheus_sum,
};

/// How the filter asks the control plane to score every route of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Hashes of the canonical prompt's bytes; the index learns from routing decisions.
    Approximate,
    /// Approximate, with `router.learn_bytes_per_token` on: the index counts the engines'
    /// tokens instead of assuming 4 bytes a token.
    ApproximateLearned,
    /// Token-block hashes; the index follows the replicas' KV events.
    Precise,
}

impl Mode {
    /// The name used on the command line, in tables and in JSON.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Approximate => "approximate",
            Mode::ApproximateLearned => "approximate-learned",
            Mode::Precise => "precise",
        }
    }

    /// The filter's route `mode` this runs.
    pub fn route_mode(self) -> &'static str {
        match self {
            Mode::Approximate | Mode::ApproximateLearned => "approximate",
            Mode::Precise => "precise",
        }
    }

    /// Parses `approximate`, `approximate-learned` or `precise`.
    pub fn parse(s: &str) -> Result<Mode, CompareError> {
        match s.trim() {
            "approximate" => Ok(Mode::Approximate),
            "approximate-learned" => Ok(Mode::ApproximateLearned),
            "precise" => Ok(Mode::Precise),
            other => Err(CompareError::UnknownMode(other.to_string())),
        }
    }
}

/// Why a comparison run could not produce figures.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// A mode name other than `approximate`, `approximate-learned` or `precise`.
    #[error("unknown mode {0:?} (expected approximate, approximate-learned or precise)")]
    UnknownMode(String),
    /// Starting or probing the fleet failed.
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// The fleet came up but was not ready for a fair run (e.g. a KV-event stream never went live).
    #[error("{0}")]
    NotReady(String),
}

/// One comparison: the fleet and the workload every mode runs.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// Replicas per fleet.
    pub replicas: usize,
    /// KV cache capacity of every replica, tokens (`vllm-sim --kv-capacity-tokens`).
    pub kv_capacity_tokens: u64,
    /// Simulated seconds per wall second.
    pub speed: f64,
    /// Simulator profile.
    pub profile: String,
    /// Base seed of the replicas.
    pub seed: u64,
    /// The filter's deadline for the route call (precise routes tokenise first).
    pub route_timeout_ms: u64,
    /// The conversations.
    pub workload: Workload,
    /// Run first on the same fleet and left out of every figure (the replicas' caches are
    /// emptied after it), so the router scores with the rates it learned from the replicas,
    /// as one that has been serving does. A cold
    /// router drains its queue estimate at the configured prior (often far from the
    /// hardware), which makes precise mode's eviction-ahead discount depend on how fast the
    /// machine running the test happens to be. `None` measures the cold router.
    pub warmup: Option<Workload>,
    /// When set, each mode's recent routing decisions (`/debug/decisions`) are written beside
    /// this path as `<stem>.<mode>.json`.
    pub decisions_dump: Option<std::path::PathBuf>,
}

/// One mode's row of the comparison table and entry of its `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModeSummary {
    /// `approximate` or `precise`.
    pub mode: String,
    /// Client-side latency, errors and the replicas' hit rate (the demo's fields).
    #[serde(flatten)]
    pub run: RunSummary,
    /// Cached tokens the router predicted for the endpoints it chose, summed over outcomes.
    pub predicted_cached_tokens: f64,
    /// Cached tokens the engines reported for the same requests.
    pub actual_cached_tokens: f64,
    /// `(predicted - actual) / actual`: positive when the router believed in blocks the engines
    /// no longer (or never) held.
    pub prediction_error: f64,
    /// Decisions whose chosen endpoint was scored from KV events.
    pub precise_decisions: f64,
    /// All routing decisions.
    pub decisions: f64,
    /// Sum over conversations of their longest prompt (tokens the engines counted): what would
    /// have to stay cached for every turn to hit.
    pub working_set_tokens: u64,
    /// `replicas x kv_capacity_tokens`.
    pub fleet_kv_capacity_tokens: u64,
}

/// `{"config": ..., "runs": [ModeSummary, ...]}`.
#[derive(Debug, Clone, Serialize)]
pub struct CompareSummary {
    /// What was run.
    pub config: serde_json::Value,
    /// One entry per mode, in the order run.
    pub runs: Vec<ModeSummary>,
}

impl CompareConfig {
    /// The configuration as JSON, for `summary.json`.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "replicas": self.replicas,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "speed": self.speed,
            "profile": self.profile,
            "seed": self.seed,
            "route_timeout_ms": self.route_timeout_ms,
            "workload": self.workload,
            "warmup": self.warmup,
        })
    }

    /// The fleet both modes start: KV events on, small caches, every route in `mode`.
    pub fn fleet_config(&self, name: &str, mode: Mode) -> FleetConfig {
        let mut cfg = FleetConfig::new(name);
        cfg.replicas = self.replicas;
        cfg.model = self.workload.model.clone();
        cfg.router = RouterKind::Kvroute;
        cfg.seed = self.seed;
        cfg.kv_events = true;
        cfg.sim_args = vec![
            "--speed".into(),
            self.speed.to_string(),
            "--profile".into(),
            self.profile.clone(),
            "--kv-capacity-tokens".into(),
            self.kv_capacity_tokens.to_string(),
        ];
        // The render API of the replicas tokenises precise routes (what a vLLM >= 0.33 fleet
        // offers); approximate routes never tokenise, so the setting is inert for them.
        cfg.control_plane_extra = json!({
            "precise": {"tokenizer": "remote", "remote_api": "render",
                        "tokenize_timeout_ms": self.route_timeout_ms}
        });
        // Every mode scores with the replicas' learned rates: precise mode's eviction-ahead
        // discount drains the queue at them, and the comparison must not hand one mode a
        // better speed model than the others.
        cfg.control_plane_router = json!({"calibration": {"enabled": true}});
        if mode == Mode::ApproximateLearned {
            cfg.control_plane_router["learn_bytes_per_token"] = json!(true);
        }
        cfg.plugin_config = json!({
            "route_timeout_ms": self.route_timeout_ms,
            "routes": [
                {"path": "/v1/chat/completions", "api": "chat", "mode": mode.route_mode()},
                {"path": "/v1/completions", "api": "completion", "mode": mode.route_mode()}
            ]
        });
        cfg
    }
}

/// The control plane's `/metrics` text.
pub async fn control_plane_metrics(fleet: &Fleet) -> Result<String, CompareError> {
    let cp = fleet
        .control_plane
        .as_ref()
        .ok_or_else(|| CompareError::NotReady("the fleet has no control plane".into()))?;
    let url = format!("http://{}/metrics", cp.admin_address);
    Ok(fleet.client().get(&url, Duration::from_secs(5)).await?.body)
}

/// Waits (at most `limit`) until the control plane reports every replica's KV-event stream
/// live: precise scoring trusts an endpoint only then, and approximate runs wait too so both
/// modes start from the same state.
pub async fn wait_events_live(fleet: &Fleet, limit: Duration) -> Result<(), CompareError> {
    let deadline = tokio::time::Instant::now() + limit;
    let addresses = fleet.replica_addresses();
    loop {
        let text = control_plane_metrics(fleet).await?;
        let live = addresses.iter().all(|a| {
            let prefix = format!("kvroute_endpoint_events_live{{endpoint=\"{a}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .is_some_and(|v| v == 1.0)
        });
        if live {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(CompareError::NotReady(format!(
                "KV-event streams not live after {limit:?} ({})",
                fleet.describe()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The warm-up a comparison of `workload` runs by default: the same shape with other prompts
/// (another seed), long enough for the control plane to see each replica's prefill rate over
/// several scrapes.
pub fn default_warmup(workload: &Workload) -> Workload {
    Workload {
        conversations: 6,
        turns: 4,
        seed: workload.seed.wrapping_add(1_000),
        ..workload.clone()
    }
}

/// Empties every replica's prefix cache (`POST /reset_prefix_cache`, which vLLM answers with an
/// `AllBlocksCleared` event) and waits until the control plane's event-fed index is empty: the
/// warm-up leaves learned rates behind, not caches full of its own prompts (their evictions
/// would make the measured run depend on how quickly events arrive under load).
async fn empty_caches(fleet: &Fleet) -> Result<(), CompareError> {
    for address in fleet.replica_addresses() {
        let url = format!("http://{address}/reset_prefix_cache");
        fleet
            .client()
            .request("POST", &url, &[], None, Duration::from_secs(5))
            .await?;
    }
    for _ in 0..100 {
        let metrics = control_plane_metrics(fleet).await?;
        if metric_with(&metrics, "kvroute_indexed_blocks", "tier=\"gpu\"") == 0.0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(CompareError::NotReady(
        "the KV-event index did not empty after /reset_prefix_cache".into(),
    ))
}

/// Cached tokens the engines reported to the client over a run.
fn engine_cached(run: &RunResult) -> f64 {
    run.records
        .iter()
        .filter_map(|r| r.cached_tokens)
        .sum::<u64>() as f64
}

/// The cumulative counters a mode's figures are differences of (a warm-up is subtracted).
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    predicted: f64,
    actual: f64,
    precise_decisions: f64,
    decisions: f64,
    prefix_hits: f64,
    prefix_queries: f64,
}

impl Totals {
    /// Reads the counters once the control plane has the outcomes of requests whose engine
    /// cached tokens sum to `engine_cached` (the filter reports outcomes on a tick), or after
    /// 10 s.
    async fn settled(fleet: &Fleet, engine_cached: f64) -> Result<Totals, CompareError> {
        let mut metrics = String::new();
        for _ in 0..200 {
            metrics = control_plane_metrics(fleet).await?;
            if prometheus_sum(&metrics, "kvroute_actual_cached_tokens_total") >= engine_cached {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (prefix_hits, prefix_queries) = fleet.prefix_cache_totals().await?;
        Ok(Totals {
            predicted: prometheus_sum(&metrics, "kvroute_predicted_cached_tokens_total"),
            actual: prometheus_sum(&metrics, "kvroute_actual_cached_tokens_total"),
            precise_decisions: metric_with(
                &metrics,
                "kvroute_precise_routes_total",
                "reason=\"precise\"",
            ),
            decisions: prometheus_sum(&metrics, "kvroute_decisions_total"),
            prefix_hits,
            prefix_queries,
        })
    }
}

/// Sum over conversations of their longest reported prompt.
pub fn working_set_tokens(run: &RunResult) -> u64 {
    let mut longest: std::collections::BTreeMap<usize, u64> = std::collections::BTreeMap::new();
    for r in &run.records {
        if let Some(p) = r.prompt_tokens {
            let e = longest.entry(r.conversation).or_default();
            *e = (*e).max(p);
        }
    }
    longest.values().sum()
}

/// `(predicted - actual) / actual`, 0 when nothing was cached.
pub fn relative_error(predicted: f64, actual: f64) -> f64 {
    if actual > 0.0 {
        (predicted - actual) / actual
    } else {
        0.0
    }
}

/// Runs `config.workload` once in `mode` on a fresh fleet and reads the figures.
/// `progress(done, total)` is called after every request.
pub async fn run_mode<P>(
    tools: &Tools,
    config: &CompareConfig,
    mode: Mode,
    progress: P,
) -> Result<(ModeSummary, RunResult), CompareError>
where
    P: Fn(usize, usize) + Send + Sync + 'static,
{
    let label = mode.label();
    let fleet = Fleet::start(
        config.fleet_config(&format!("compare-{label}"), mode),
        tools,
    )
    .await?;
    wait_events_live(&fleet, Duration::from_secs(30)).await?;
    let before = match &config.warmup {
        Some(warmup) => {
            let run = loadgen::run_workload(&fleet.url(), warmup, |_, _| {}).await;
            let totals = Totals::settled(&fleet, engine_cached(&run)).await?;
            empty_caches(&fleet).await?;
            totals
        }
        None => Totals::default(),
    };
    let run = loadgen::run_workload(&fleet.url(), &config.workload, progress).await;
    let after = Totals::settled(&fleet, before.actual + engine_cached(&run)).await?;
    let queries = after.prefix_queries - before.prefix_queries;
    let hits = after.prefix_hits - before.prefix_hits;
    let hit_rate = if queries > 0.0 { hits / queries } else { 0.0 };
    let predicted = after.predicted - before.predicted;
    let actual = after.actual - before.actual;
    let precise_decisions = after.precise_decisions - before.precise_decisions;
    let decisions = after.decisions - before.decisions;
    if let Some(path) = &config.decisions_dump {
        // The control plane's recent decisions (candidates and their believed cached tokens),
        // for looking into a prediction error; best effort.
        let cp = fleet
            .control_plane
            .as_ref()
            .map(|cp| cp.admin_address.clone());
        if let Some(admin) = cp {
            let url = format!("http://{admin}/debug/decisions?limit=100000");
            let mut explained = Vec::new();
            if let Ok(r) = fleet.client().get(&url, Duration::from_secs(10)).await {
                let list: Vec<serde_json::Value> =
                    serde_json::from_str(&r.body).unwrap_or_default();
                for d in list {
                    let Some(id) = d["decision_id"].as_u64() else {
                        continue;
                    };
                    let url = format!("http://{admin}/debug/decisions/{id}");
                    if let Ok(r) = fleet.client().get(&url, Duration::from_secs(10)).await {
                        explained.push(serde_json::from_str(&r.body).unwrap_or(d));
                    }
                }
            }
            let _ = std::fs::write(
                path.with_extension(format!("{label}.json")),
                serde_json::to_string_pretty(&explained).unwrap_or_default(),
            );
        }
    }
    let summary = ModeSummary {
        mode: label.to_string(),
        run: loadgen::summarize(label, &run, hit_rate),
        predicted_cached_tokens: predicted,
        actual_cached_tokens: actual,
        prediction_error: (relative_error(predicted, actual) * 1e4).round() / 1e4,
        precise_decisions,
        decisions,
        working_set_tokens: working_set_tokens(&run),
        fleet_kv_capacity_tokens: config.replicas as u64 * config.kv_capacity_tokens,
    };
    drop(fleet);
    Ok((summary, run))
}

/// The sum of the samples of `name` whose label set contains `label` (the harness's reader,
/// under the name this module's callers know).
pub use kvroute_harness::prometheus_sum_with as metric_with;

/// The comparison table.
pub fn render_table(rows: &[ModeSummary]) -> String {
    let w = rows.iter().map(|r| r.mode.len()).max().unwrap_or(0).max(12);
    TextTable::new()
        .left("mode", w, |r: &ModeSummary| r.mode.clone())
        .right("requests", 8, |r| r.run.requests.to_string())
        .right("errors", 6, |r| r.run.errors.to_string())
        .ttft_columns(10, |r| &r.run.ttft_ms)
        .right("prefix hit", 10, |r| percent(r.run.prefix_cache_hit_rate))
        .right("predicted", 11, |r| {
            format!("{:.0}", r.predicted_cached_tokens)
        })
        .right("actual", 11, |r| format!("{:.0}", r.actual_cached_tokens))
        .right("pred err", 9, |r| {
            format!("{:+.1}%", r.prediction_error * 100.0)
        })
        .render(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_harness::loadgen::RequestRecord;

    fn record(conversation: usize, prompt: Option<u64>) -> RequestRecord {
        RequestRecord {
            conversation,
            turn: 0,
            sent_ms: 0.0,
            ttft_ms: Some(1.0),
            e2e_ms: 1.0,
            output_tokens: 1,
            cached_tokens: None,
            prompt_tokens: prompt,
            replica: None,
            error: None,
        }
    }

    #[test]
    fn modes_parse_and_reject_unknown_names() {
        assert_eq!(Mode::parse("precise").unwrap(), Mode::Precise);
        assert_eq!(Mode::parse(" approximate").unwrap(), Mode::Approximate);
        let err = Mode::parse("exact").unwrap_err().to_string();
        assert!(err.contains("exact"), "{err}");
    }

    #[test]
    fn working_set_counts_each_conversations_longest_prompt() {
        let run = RunResult {
            records: vec![
                record(0, Some(100)),
                record(0, Some(250)),
                record(1, Some(40)),
                record(1, None),
            ],
            wall: Duration::from_secs(1),
        };
        assert_eq!(working_set_tokens(&run), 290);
    }

    #[test]
    fn relative_error_is_signed_and_safe_on_zero() {
        assert_eq!(relative_error(110.0, 100.0), 0.1);
        assert_eq!(relative_error(90.0, 100.0), -0.1);
        assert_eq!(relative_error(5.0, 0.0), 0.0);
    }

    #[test]
    fn metric_with_reads_only_the_labelled_samples_of_that_metric() {
        let text = "kvroute_precise_routes_total{reason=\"precise\"} 7\n\
                    kvroute_precise_routes_total{reason=\"approximate\"} 2\n\
                    kvroute_precise_routes_totally{reason=\"precise\"} 99\n";
        assert_eq!(
            metric_with(text, "kvroute_precise_routes_total", "reason=\"precise\""),
            7.0
        );
    }

    #[test]
    fn fleet_config_sets_the_mode_on_every_route_and_shrinks_the_caches() {
        let cfg = CompareConfig {
            replicas: 2,
            kv_capacity_tokens: 4096,
            speed: 1.0,
            profile: "fast".into(),
            seed: 3,
            route_timeout_ms: 700,
            workload: Workload::default(),
            warmup: None,
            decisions_dump: None,
        };
        let fleet = cfg.fleet_config("x", Mode::Precise);
        assert!(fleet.kv_events);
        assert!(
            fleet
                .sim_args
                .windows(2)
                .any(|w| w == ["--kv-capacity-tokens", "4096"])
        );
        let routes = fleet.plugin_config["routes"].as_array().unwrap();
        assert!(routes.iter().all(|r| r["mode"] == "precise"));
        let fleet = cfg.fleet_config("x", Mode::Approximate);
        let routes = fleet.plugin_config["routes"].as_array().unwrap();
        assert!(routes.iter().all(|r| r["mode"] == "approximate"));
        assert_eq!(fleet.plugin_config["route_timeout_ms"], 700);
        assert_eq!(
            fleet.control_plane_router.get("learn_bytes_per_token"),
            None
        );
        let fleet = cfg.fleet_config("x", Mode::ApproximateLearned);
        let routes = fleet.plugin_config["routes"].as_array().unwrap();
        assert!(routes.iter().all(|r| r["mode"] == "approximate"));
        assert_eq!(fleet.control_plane_router["learn_bytes_per_token"], true);
    }
}
