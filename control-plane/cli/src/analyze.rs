//! Workload analysis before deploying ("measure first"): how much of a workload's prompt text
//! could come from a prefix cache at all, and what round robin and kvroute would make of it on a
//! fleet of N replicas with a given KV capacity, through fleet-sim's engine.
//!
//! Inputs:
//! - a Mooncake-format trace (`timestamp`, `input_length`, `output_length`, `hash_ids`);
//! - a JSONL log of request bodies, one per line, either bare (`{"model", "messages",
//!   ...}` or `{"model", "prompt", ...}`) or wrapped with an arrival time and the path
//!   (`{"timestamp": ms, "path": "/v1/messages", "body": {...}}`; the path is how an Anthropic
//!   Messages or a Responses body is told apart). Bodies go through the filter's own canonicaliser and
//!   block hashing, so prefixes match exactly when the filter would see them match; each 256-byte
//!   block becomes 64 simulated tokens (the filter's 4-bytes-a-token estimate);
//! - any fleet-sim generator spec (`multi-turn:conversations=8`, ...).
//!
//! The prefix-sharing potential is the share of prompt tokens that an infinite cache shared by
//! the whole fleet would serve: for each request in arrival order, its longest prefix (in whole
//! engine blocks, never the last token, as vLLM does) already seen in an earlier request. Real
//! fleets only approach it: caches are finite and split over replicas, which is what routing
//! is about.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use scorer_core::canon;
use scorer_core::hash::{DEFAULT_BLOCK_BYTES, block_hashes, model_seed, token_block_hashes};
use scorer_core::protocol::ApiKind;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use fleet_sim::des::{self, RunResult, SimConfig};
use fleet_sim::policy;
use fleet_sim::report::{Latency, PolicySummary, line_chart, ttft_cdf_series};
use fleet_sim::workload::{self, PromptSource, RequestSpec, Workload, WorkloadError};
use vllm_sim::{Profile, SimError};

/// Canonical bytes per simulated token for OpenAI bodies (the filter's estimate).
const BYTES_PER_TOKEN: usize = 4;

/// Why an analysis could not run.
#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    /// The input holds no request.
    #[error("{0}: no requests")]
    Empty(String),
    /// The input could not be read or a line of it is not what its format expects (worded
    /// once, by fleet-sim's trace reader), or a Mooncake trace or generator spec failed.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The simulated fleet could not run.
    #[error("simulation: {0}")]
    Sim(#[from] SimError),
    /// A setting is out of range.
    #[error("{0}")]
    Invalid(String),
}

/// Which kind of file the input is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InputFormat {
    /// Decide from the first record: `input_length` means Mooncake, else OpenAI bodies.
    Auto,
    /// Mooncake trace records.
    Mooncake,
    /// OpenAI request bodies (chat or completions).
    Openai,
}

impl std::str::FromStr for InputFormat {
    type Err = AnalyzeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "mooncake" => Ok(Self::Mooncake),
            "openai" => Ok(Self::Openai),
            _ => Err(AnalyzeError::Invalid(format!(
                "unknown format {s:?}: expected auto, mooncake or openai"
            ))),
        }
    }
}

/// How OpenAI bodies become a simulated workload.
#[derive(Debug, Clone)]
pub struct OpenAiOptions {
    /// Arrival rate for bodies without a `timestamp` (Poisson, requests per second).
    pub rps: f64,
    /// Output tokens of a body without `max_tokens` / `max_completion_tokens`.
    pub default_output_tokens: u32,
    /// Seed of the arrival times.
    pub seed: u64,
}

impl Default for OpenAiOptions {
    fn default() -> Self {
        Self {
            rps: 4.0,
            default_output_tokens: 256,
            seed: 1,
        }
    }
}

#[derive(Deserialize)]
struct Wrapped {
    #[serde(default)]
    timestamp: Option<f64>,
    /// The request's path, which names its API (`/v1/messages`, `/v1/responses`, ...).
    #[serde(default)]
    path: Option<String>,
    body: serde_json::Value,
}

/// The API of one logged request: its path when the line has one (the only way to tell an
/// Anthropic Messages body or a Responses body from a chat or an embeddings one), else chat
/// for `messages` and completions for `prompt`.
fn api_of(path: Option<&str>, body: &serde_json::Value) -> Result<ApiKind, String> {
    if let Some(path) = path {
        // A gateway may log the path under a prefix of its own (or without vLLM's `/v1`):
        // what follows `/v1` in the API's path ends it. Chat comes before completions in
        // `ALL`, so `/chat/completions` is found first.
        let route = path.split('?').next().unwrap_or_default();
        let route = route.trim_end_matches('/');
        return ApiKind::ALL
            .into_iter()
            .find(|api| {
                let path = api.path();
                route.ends_with(path.strip_prefix("/v1").unwrap_or(path))
            })
            .ok_or_else(|| {
                let paths: Vec<&str> = ApiKind::ALL.iter().map(|api| api.path()).collect();
                format!(
                    "path {path:?} is not one kvroute routes by prefix ({})",
                    paths.join(", ")
                )
            });
    }
    if body.get("messages").is_some() {
        Ok(ApiKind::Chat)
    } else if body.get("prompt").is_some() {
        Ok(ApiKind::Completion)
    } else {
        Err(
            "neither `messages` (chat) nor `prompt` (completions) in the body; a Messages or \
             Responses body needs its `path` beside it"
                .into(),
        )
    }
}

/// Reads a JSONL file of OpenAI request bodies (bare, or `{"timestamp": ms, "path": "/v1/...",
/// "body": {...}}`). The workload speaks the API most of its requests use.
pub fn read_openai_jsonl(path: &Path, opts: &OpenAiOptions) -> Result<Workload, AnalyzeError> {
    if !(opts.rps.is_finite() && opts.rps > 0.0) {
        return Err(AnalyzeError::Invalid(
            "--rps must be a positive number".into(),
        ));
    }
    let name = path.display().to_string();
    let text = workload::read_trace(path)?;
    let bad = |line: usize, message: String| {
        AnalyzeError::from(WorkloadError::BadLine {
            path: name.clone(),
            line,
            message,
        })
    };
    let tokens_per_block = (DEFAULT_BLOCK_BYTES / BYTES_PER_TOKEN) as u32;
    let mut clock = workload::Rng::new(opts.seed ^ 0xA11A_11CE);
    let mut t = 0.0;
    let mut requests = Vec::new();
    let mut apis = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(line_no, e.to_string()))?;
        let (timestamp, path, body) = if value.get("body").is_some() {
            let w: Wrapped =
                serde_json::from_value(value).map_err(|e| bad(line_no, e.to_string()))?;
            (w.timestamp, w.path, w.body)
        } else {
            (None, None, value)
        };
        let api = api_of(path.as_deref(), &body).map_err(|e| bad(line_no, e))?;
        apis.push(api);
        let bytes = serde_json::to_vec(&body).map_err(|e| bad(line_no, e.to_string()))?;
        let prompt = canon::canonicalize(api, &bytes).map_err(|e| bad(line_no, e.to_string()))?;
        let arrival_ms = match timestamp {
            Some(ts) if ts.is_finite() && ts >= 0.0 => ts,
            Some(_) => return Err(bad(line_no, "timestamp must be >= 0 (ms)".into())),
            None => {
                t += clock.exp_ms(1000.0 / opts.rps);
                t
            }
        };
        requests.push(RequestSpec {
            arrival_ms,
            prompt: PromptSource::Blocks {
                ids: block_hashes(
                    model_seed(&prompt.model),
                    &prompt.bytes,
                    DEFAULT_BLOCK_BYTES,
                ),
                block_tokens: tokens_per_block,
                input_length: prompt.estimated_tokens().max(1),
            },
            output_tokens: prompt
                .max_output_tokens
                .unwrap_or(opts.default_output_tokens)
                .max(1),
            session: prompt
                .session_hint
                .as_deref()
                .map(|u| xxh3_64(u.as_bytes())),
        });
    }
    if requests.is_empty() {
        return Err(AnalyzeError::Empty(name));
    }
    let mut workload = Workload::from_trace(path, name, requests);
    workload.api = ApiKind::ALL
        .into_iter()
        .max_by_key(|kind| apis.iter().filter(|a| *a == kind).count())
        .unwrap_or(ApiKind::Chat);
    Ok(workload)
}

/// Guesses the format of a JSONL file from its first non-empty line.
pub fn detect_format(path: &Path) -> Result<InputFormat, AnalyzeError> {
    let name = path.display().to_string();
    let text = workload::read_trace(path)?;
    let Some((n, line)) = text.lines().enumerate().find(|(_, l)| !l.trim().is_empty()) else {
        return Err(AnalyzeError::Empty(name));
    };
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| WorkloadError::BadLine {
            path: name,
            line: n + 1,
            message: e.to_string(),
        })?;
    Ok(if value.get("input_length").is_some() {
        InputFormat::Mooncake
    } else {
        InputFormat::Openai
    })
}

/// Loads `input`: a JSONL file in `format`, or (when no such file exists and the format is
/// `Auto`) a fleet-sim generator spec.
pub fn load_workload(
    input: &str,
    format: InputFormat,
    opts: &OpenAiOptions,
) -> Result<Workload, AnalyzeError> {
    let path = Path::new(input);
    if !path.exists() && format == InputFormat::Auto && !input.ends_with(".jsonl") {
        return Ok(workload::from_spec(input, opts.seed)?);
    }
    let format = match format {
        InputFormat::Auto => detect_format(path)?,
        f => f,
    };
    let workload = match format {
        InputFormat::Mooncake => workload::read_mooncake(path)?,
        _ => read_openai_jsonl(path, opts)?,
    };
    if workload.requests.is_empty() {
        return Err(AnalyzeError::Empty(input.to_string()));
    }
    Ok(workload)
}

/// How much of a workload's prompt text a cache could serve.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Sharing {
    /// Requests analysed.
    pub requests: usize,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens an infinite cache shared by the fleet would serve.
    pub reusable_tokens: u64,
    /// `reusable_tokens / prompt_tokens`: the ceiling of any fleet's prefix-cache hit rate.
    pub potential: f64,
    /// Requests that reuse at least one block.
    pub requests_with_reuse: usize,
    /// Distinct prompt blocks: the cache an infinite cache would need, in blocks.
    pub distinct_blocks: usize,
    /// Tokens per block of the analysis (vLLM's `block_size`).
    pub block_tokens: u32,
    /// Mean prompt length in tokens.
    pub mean_prompt_tokens: f64,
}

/// Computes the prefix-sharing potential of `workload` at `block_tokens` granularity.
/// `progress(done, total)` is called every few hundred requests.
pub fn prefix_sharing(
    workload: &Workload,
    block_tokens: u32,
    mut progress: impl FnMut(usize, usize),
) -> Sharing {
    let block = block_tokens.max(1) as usize;
    let n = workload.requests.len();
    let seed = model_seed(policy::MODEL);
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Sharing {
        requests: n,
        block_tokens: block as u32,
        ..Sharing::default()
    };
    // Dependencies precede their dependents; otherwise arrival order.
    let mut order: Vec<usize> = (0..n).collect();
    let independent = (0..n).all(|i| workload.depends_on(i).is_none());
    if independent {
        order.sort_by(|&a, &b| {
            workload.requests[a]
                .arrival_ms
                .total_cmp(&workload.requests[b].arrival_ms)
        });
    }
    // A chat turn repeats its previous turn's answer, which the engine cached while decoding.
    let mut repeated = vec![false; n];
    for i in 0..n {
        if let Some(p) = workload.depends_on(i) {
            repeated[p] = true;
        }
    }
    for (done, &i) in order.iter().enumerate() {
        let mut tokens = workload.prompt_tokens(i);
        let prompt_len = tokens.len();
        let hashes = token_block_hashes(seed, &tokens, block);
        // vLLM always computes the last prompt token: only blocks before it can hit.
        let hittable = prompt_len.saturating_sub(1) / block;
        let matched = hashes
            .iter()
            .take(hittable)
            .take_while(|h| seen.contains(h))
            .count();
        out.prompt_tokens += prompt_len as u64;
        out.reusable_tokens += (matched * block) as u64;
        if matched > 0 {
            out.requests_with_reuse += 1;
        }
        if repeated[i] {
            let spec = &workload.requests[i];
            tokens.extend(workload::output_tokens(i, spec.output_tokens));
            seen.extend(token_block_hashes(seed, &tokens, block));
        } else {
            seen.extend(hashes);
        }
        if (done + 1) % 500 == 0 || done + 1 == n {
            progress(done + 1, n);
        }
    }
    out.distinct_blocks = seen.len();
    if out.prompt_tokens > 0 {
        out.potential = out.reusable_tokens as f64 / out.prompt_tokens as f64;
        out.mean_prompt_tokens = out.prompt_tokens as f64 / n.max(1) as f64;
    }
    out
}

/// One simulated fleet: a policy on `replicas` replicas.
#[derive(Debug, Clone, Serialize)]
pub struct FleetRow {
    /// Replicas in the fleet.
    pub replicas: usize,
    /// KV capacity of each replica, tokens.
    pub kv_capacity_tokens: u64,
    /// The policy's results.
    #[serde(flatten)]
    pub summary: PolicySummary,
}

/// Settings of the fleet simulations.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Fleet sizes to simulate.
    pub replicas: Vec<usize>,
    /// Policies to compare (fleet-sim names).
    pub policies: Vec<String>,
    /// Engine profile of every replica (its `kv_capacity_tokens` is the cache C).
    pub profile: Profile,
    /// Seed of policies and engine jitter.
    pub seed: u64,
    /// How often the simulated routers see fresh replica metrics (virtual ms).
    pub metrics_interval_ms: f64,
}

impl FleetOptions {
    /// Checks fleet sizes and policy names.
    pub fn validate(&self) -> Result<(), AnalyzeError> {
        let max = scorer_core::index::MAX_ENDPOINTS;
        if self.replicas.is_empty() || self.replicas.iter().any(|&n| n == 0 || n > max) {
            return Err(AnalyzeError::Invalid(format!(
                "--replicas must be between 1 and {max}"
            )));
        }
        if let Some(p) = self
            .policies
            .iter()
            .find(|p| !policy::POLICY_NAMES.contains(&p.as_str()))
        {
            return Err(AnalyzeError::Invalid(format!(
                "unknown policy {p:?}; known: {}",
                policy::POLICY_NAMES.join(", ")
            )));
        }
        if self.policies.is_empty() {
            return Err(AnalyzeError::Invalid("no policy to simulate".into()));
        }
        Ok(())
    }
}

/// Replays `workload` through every (fleet size, policy) pair. `progress` gets a line of text
/// before and after each run; the runs come back in the same order as the rows.
pub fn simulate(
    workload: &Workload,
    opts: &FleetOptions,
    mut progress: impl FnMut(&str),
) -> Result<(Vec<FleetRow>, Vec<RunResult>), AnalyzeError> {
    opts.validate()?;
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    for &replicas in &opts.replicas {
        let cfg = SimConfig {
            replicas,
            profile: opts.profile.clone(),
            seed: opts.seed,
            metrics_interval_ms: opts.metrics_interval_ms,
        };
        for name in &opts.policies {
            let mut p = policy::build(name, replicas, opts.seed)
                .ok_or_else(|| AnalyzeError::Invalid(format!("unknown policy {name:?}")))?;
            progress(&format!(
                "simulating {name} on {replicas} replicas ({} requests) ...",
                workload.requests.len()
            ));
            let started = Instant::now();
            let run = des::run(workload, p.as_mut(), &cfg)?;
            let summary = PolicySummary::of(&run);
            progress(&format!(
                "  done in {:.1}s: hit rate {:.1}%, TTFT p50 {:.0} ms",
                started.elapsed().as_secs_f64(),
                summary.prefix_hit_rate * 100.0,
                summary.ttft_ms.p50
            ));
            rows.push(FleetRow {
                replicas,
                kv_capacity_tokens: opts.profile.kv_capacity_tokens,
                summary,
            });
            runs.push(run);
        }
    }
    Ok((rows, runs))
}

/// The readable report: the sharing potential, then one line per simulated fleet.
pub fn render_report(workload: &str, sharing: &Sharing, rows: &[FleetRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "workload            {workload}");
    let _ = writeln!(
        out,
        "requests            {} ({} reuse a cached prefix)",
        sharing.requests, sharing.requests_with_reuse
    );
    let _ = writeln!(
        out,
        "prompt tokens       {} (mean {:.0} a request)",
        sharing.prompt_tokens, sharing.mean_prompt_tokens
    );
    let _ = writeln!(
        out,
        "prefix sharing      {:.1}% of prompt tokens reusable with perfect routing \
         (an infinite cache shared by the fleet; {}-token blocks)",
        sharing.potential * 100.0,
        sharing.block_tokens
    );
    let _ = writeln!(
        out,
        "distinct blocks     {} ({} tokens would hold every prefix)",
        sharing.distinct_blocks,
        sharing.distinct_blocks as u64 * u64::from(sharing.block_tokens)
    );
    if sharing.potential < 0.05 {
        let _ = writeln!(
            out,
            "verdict             almost nothing to reuse: cache-aware routing cannot help here"
        );
    }
    if rows.is_empty() {
        return out;
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "{:>8} {:>12} {:<14} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}{}",
        "replicas",
        "kv_cap_tok",
        "policy",
        "requests",
        "hit_rate",
        "of_ideal",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "preempt",
        reuse_columns(None)
    );
    for r in rows {
        let s = &r.summary;
        let of_ideal = if sharing.potential > 0.0 {
            format!("{:.0}%", 100.0 * s.prefix_hit_rate / sharing.potential)
        } else {
            "-".into()
        };
        let _ = writeln!(
            out,
            "{:>8} {:>12} {:<14} {:>8} {:>8.1}% {:>9} {:>9.0} {:>9.0} {:>9.0} {:>8}{}",
            r.replicas,
            r.kv_capacity_tokens,
            s.policy,
            s.requests,
            s.prefix_hit_rate * 100.0,
            of_ideal,
            s.ttft_ms.p50,
            s.ttft_ms.p90,
            s.ttft_ms.p99,
            s.preemptions,
            reuse_columns(Some(s.reuse.as_ref()))
        );
    }
    let _ = writeln!(
        out,
        "(TTFT in ms; of_ideal = hit rate over the sharing potential)"
    );
    if rows.iter().any(|r| r.summary.reuse.is_some()) {
        let _ = writeln!(
            out,
            "(kvroute's own fleet numbers, % of prompt tokens: avail = reuse its recent window saw \
             in the traffic, aimed = credited at the chosen replica, deliv = cached_tokens the \
             engines reported; the gap avail - deliv by reason: spill = chose a non-holder on \
             load, evict = aimed and not delivered, mism = load-only replica, unheld = no \
             replica believed to hold it; fleet-sim has no fallbacks)"
        );
    }
    out
}

/// The fleet-number columns of a row ([`scorer_core::reuse`]), as shares of its prompt tokens;
/// `None` writes the header, `Some(None)` dashes for a policy without them (the peers).
fn reuse_columns(row: Option<Option<&scorer_core::reuse::ReuseTotals>>) -> String {
    use scorer_core::reuse::GapReason;
    const GAPS: [(GapReason, &str); 4] = [
        (GapReason::LoadSpill, "spill"),
        (GapReason::Eviction, "evict"),
        (GapReason::Mismatch, "mism"),
        (GapReason::Unheld, "unheld"),
    ];
    let cells: Vec<String> = match row {
        None => ["avail", "aimed", "deliv"]
            .into_iter()
            .chain(GAPS.iter().map(|(_, name)| *name))
            .map(String::from)
            .collect(),
        Some(None) => vec!["-".into(); 3 + GAPS.len()],
        Some(Some(t)) => {
            let share = |n: u64| {
                if t.prompt_tokens > 0 {
                    format!("{:.1}%", 100.0 * n as f64 / t.prompt_tokens as f64)
                } else {
                    "-".into()
                }
            };
            [t.available_tokens, t.aimed_tokens, t.delivered_tokens]
                .into_iter()
                .chain(GAPS.iter().map(|(g, _)| t.gap_tokens.get(*g)))
                .map(share)
                .collect()
        }
    };
    cells.iter().map(|c| format!(" {c:>7}")).collect()
}

/// SVG charts of the analysis: `(file suffix, svg)`. One fleet size: the TTFT CDF per policy.
/// Several: TTFT p50 against fleet size, and hit rate against fleet size under the ceiling.
pub fn charts(
    workload: &str,
    sharing: &Sharing,
    rows: &[FleetRow],
    runs: &[RunResult],
) -> Vec<(&'static str, String)> {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.replicas).collect();
    sizes.dedup();
    if sizes.len() <= 1 {
        return vec![(
            "",
            line_chart(
                &format!("TTFT CDF: {workload}"),
                "TTFT (ms)",
                "fraction of requests",
                &ttft_cdf_series(runs),
                false,
            ),
        )];
    }
    let mut policies: Vec<&str> = Vec::new();
    for r in rows {
        if !policies.contains(&r.summary.policy.as_str()) {
            policies.push(&r.summary.policy);
        }
    }
    let series = |f: &dyn Fn(&Latency, f64) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        policies
            .iter()
            .map(|p| {
                let pts = rows
                    .iter()
                    .filter(|r| r.summary.policy == *p)
                    .map(|r| {
                        (
                            r.replicas as f64,
                            f(&r.summary.ttft_ms, r.summary.prefix_hit_rate),
                        )
                    })
                    .collect();
                (p.to_string(), pts)
            })
            .collect()
    };
    let ttft = line_chart(
        &format!("TTFT p50 against fleet size: {workload}"),
        "replicas",
        "TTFT p50 (ms)",
        &series(&|l, _| l.p50.max(0.1)),
        true,
    );
    let mut hits = series(&|_, h| h * 100.0);
    let (lo, hi) = (sizes[0] as f64, sizes[sizes.len() - 1] as f64);
    hits.push((
        "perfect routing".into(),
        vec![
            (lo, sharing.potential * 100.0),
            (hi, sharing.potential * 100.0),
        ],
    ));
    let hit = line_chart(
        &format!("Prefix-cache hit rate against fleet size: {workload}"),
        "replicas",
        "hit rate (%)",
        &hits,
        false,
    );
    vec![("", ttft), ("-hit-rate", hit)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(prompt: PromptSource) -> RequestSpec {
        RequestSpec {
            arrival_ms: 0.0,
            prompt,
            output_tokens: 4,
            session: None,
        }
    }

    #[test]
    fn a_logged_request_s_path_names_its_api() {
        let chat = serde_json::json!({"model": "m", "messages": []});
        let input = serde_json::json!({"model": "m", "input": "hi"});
        assert_eq!(api_of(None, &chat), Ok(ApiKind::Chat));
        assert_eq!(
            api_of(None, &serde_json::json!({"prompt": "x"})),
            Ok(ApiKind::Completion)
        );
        // Without its path a Messages body reads as chat and a Responses body as nothing.
        assert!(
            api_of(None, &input)
                .unwrap_err()
                .contains("needs its `path`")
        );
        assert_eq!(api_of(Some("/v1/messages"), &chat), Ok(ApiKind::Messages));
        assert_eq!(
            api_of(Some("/v1/responses?stream=true"), &input),
            Ok(ApiKind::Responses)
        );
        assert_eq!(
            api_of(Some("/v1/chat/completions"), &chat),
            Ok(ApiKind::Chat)
        );
        assert_eq!(
            api_of(Some("/v1/completions/"), &chat),
            Ok(ApiKind::Completion)
        );
        let err = api_of(Some("/v1/embeddings"), &input).unwrap_err();
        assert!(err.contains("/v1/embeddings"), "{err}");
    }

    #[test]
    fn shared_prefix_counts_only_whole_blocks_seen_before() {
        // Two requests share a 64-token system segment; the second adds 40 tokens.
        let w = Workload {
            cache_control: workload::Marking::None,
            api: scorer_core::protocol::ApiKind::Chat,
            name: "t".into(),
            requests: vec![
                spec(PromptSource::Segments(vec![(1, 64), (2, 40)])),
                spec(PromptSource::Segments(vec![(1, 64), (3, 40)])),
                spec(PromptSource::Segments(vec![(9, 100)])),
            ],
        };
        let s = prefix_sharing(&w, 16, |_, _| {});
        assert_eq!(s.requests, 3);
        assert_eq!(s.prompt_tokens, 308);
        assert_eq!(s.reusable_tokens, 64);
        assert_eq!(s.requests_with_reuse, 1);
        assert!((s.potential - 64.0 / 308.0).abs() < 1e-12);
    }

    #[test]
    fn identical_prompts_never_reuse_their_last_token() {
        let w = Workload {
            cache_control: workload::Marking::None,
            api: scorer_core::protocol::ApiKind::Chat,
            name: "t".into(),
            requests: vec![
                spec(PromptSource::Segments(vec![(1, 64)])),
                spec(PromptSource::Segments(vec![(1, 64)])),
            ],
        };
        // 64 tokens = 4 blocks, but only the first 3 can hit (the 64th token is recomputed).
        assert_eq!(prefix_sharing(&w, 16, |_, _| {}).reusable_tokens, 48);
    }

    #[test]
    fn no_sharing_has_no_potential() {
        let w = workload::from_spec("no-sharing:requests=50,input=300", 1).unwrap();
        let s = prefix_sharing(&w, 16, |_, _| {});
        assert_eq!(s.reusable_tokens, 0);
        assert!(render_report("no-sharing", &s, &[]).contains("cannot help"));
    }
}
