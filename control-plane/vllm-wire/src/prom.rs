//! A pure parser for the Prometheus text exposition format, reduced to what routing needs.
//!
//! vLLM's `/metrics` is a few hundred lines of Python `prometheus_client` output. We read four
//! series out of it and sum them over DP ranks (`engine` label):
//! - `vllm:num_requests_running` and `vllm:num_requests_waiting`;
//! - `vllm:kv_cache_usage_perc` (or the pre-0.10 name `vllm:gpu_cache_usage_perc`), averaged over
//!   engines and weighted by their capacity when known;
//! - `vllm:cache_config_info{num_gpu_blocks, block_size}`, whose product is the KV capacity;
//! - optionally, the counters online calibration learns rates from
//!   ([`scorer_core::calibration::EngineCounters`]): the sums (and counts) of the histograms
//!   `vllm:request_prefill_kv_computed_tokens`, `vllm:request_prefill_time_seconds` and
//!   `vllm:inter_token_latency_seconds`, and the counters `vllm:prompt_tokens_total` and
//!   `vllm:prefix_cache_hits_total`. An engine
//!   without all of them, or with an unusable value, simply gives no counters;
//! - optionally, `vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, the
//!   engine's own delivered reuse (the fleet numbers' scraped side).
//!
//! Invariant: no I/O, no panics, linear time. [`parse_vllm_metrics`] requires every line to be
//! well-formed (so a non-metrics page is rejected), but unknown metrics, histograms, NaN and
//! +Inf values elsewhere are fine. The scrape path, [`scrape_vllm_metrics`], reads the same
//! series and parses only their lines: any other line costs a scan of its metric name, and
//! must only start like a sample or a comment (an HTML or JSON page still fails at its first
//! line). A vLLM page is over 500 lines, of which the router reads about a dozen.
//! Timestamps and OpenMetrics exemplars are accepted and ignored.

use std::borrow::Cow;

use scorer_core::calibration::EngineCounters;
use scorer_core::router::{EndpointMetrics, PrefixCacheCounters};

/// `vllm:num_requests_running`: sequences in the running batch.
pub const RUNNING: &str = "vllm:num_requests_running";
/// `vllm:num_requests_waiting`: requests queued for admission.
pub const WAITING: &str = "vllm:num_requests_waiting";
/// `vllm:kv_cache_usage_perc`: fraction of KV blocks in use (1 = full).
pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// The name `vllm:kv_cache_usage_perc` had before vLLM 0.10; accepted for older fleets.
pub const KV_USAGE_OLD: &str = "vllm:gpu_cache_usage_perc";
/// `vllm:cache_config_info`: the engine's CacheConfig as labels of a constant gauge.
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// The series online calibration reads ([`EngineCounters`]), in the order `engine_counters`
/// takes them: prompt tokens computed (cached ones excluded) and the prefill time and count of
/// finished requests, the inter-token latency sum and count, prompt tokens prefilled, and of
/// them the prefix-cache hits.
pub const CALIBRATION_SERIES: [&str; 7] = [
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
];

/// `vllm:prefix_cache_queries_total`: prompt tokens looked up in the prefix cache (the hits
/// are `CALIBRATION_SERIES[6]`, `vllm:prefix_cache_hits_total`).
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";

/// Every series [`parse_vllm_metrics`] reads; [`scrape_vllm_metrics`] parses no other line.
pub const READ_SERIES: [&str; 13] = [
    RUNNING,
    WAITING,
    KV_USAGE,
    KV_USAGE_OLD,
    CACHE_CONFIG_INFO,
    CALIBRATION_SERIES[0],
    CALIBRATION_SERIES[1],
    CALIBRATION_SERIES[2],
    CALIBRATION_SERIES[3],
    CALIBRATION_SERIES[4],
    CALIBRATION_SERIES[5],
    CALIBRATION_SERIES[6],
    PREFIX_CACHE_QUERIES,
];

/// `vllm:lora_requests_info`: the LoRA gauge vLLM exports; its value is a timestamp, its
/// labels carry the adapters.
pub const LORA_INFO: &str = "vllm:lora_requests_info";

/// Every sample the control plane reads from a `/metrics` page: [`READ_SERIES`] and the LoRA
/// adapters; what its scrapes ask for ([`restricted_metrics_path`]).
pub const SCRAPED_SERIES: [&str; READ_SERIES.len() + 1] = {
    let mut all = [LORA_INFO; READ_SERIES.len() + 1];
    let mut i = 0;
    while i < READ_SERIES.len() {
        all[i] = READ_SERIES[i];
        i += 1;
    }
    all
};

/// Why a `/metrics` body could not be turned into [`EndpointMetrics`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PromError {
    /// The body is not UTF-8.
    #[error("metrics body is not UTF-8 (invalid byte at offset {0})")]
    NotUtf8(usize),
    /// A line does not follow the text exposition format.
    #[error("line {line}: {kind}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        kind: SyntaxError,
    },
    /// A series routing needs is absent (not a vLLM server, or a much older one).
    #[error("required metric {0} is missing")]
    Missing(&'static str),
    /// A needed gauge holds NaN, an infinity or a negative number.
    #[error("{metric} has an unusable value {value}")]
    BadValue {
        /// The metric name.
        metric: &'static str,
        /// The offending value.
        value: f64,
    },
    /// `vllm:cache_config_info` carries a block count or size that is not a number.
    #[error("vllm:cache_config_info label {label}={value:?} is not a count")]
    BadCacheConfig {
        /// `num_gpu_blocks` or `block_size`.
        label: &'static str,
        /// The label value as found.
        value: String,
    },
    /// `num_gpu_blocks * block_size` does not fit in 64 bits.
    #[error("vllm:cache_config_info capacity overflows")]
    CapacityOverflow,
}

/// The ways a single line can be malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SyntaxError {
    /// The line does not start with a valid metric name.
    #[error("invalid metric name")]
    MetricName,
    /// A label name is empty or has characters outside `[a-zA-Z0-9_]`.
    #[error("invalid label name")]
    LabelName,
    /// A label is not written `name="value"`.
    #[error("expected name=\"value\" in label set")]
    LabelSyntax,
    /// A label value's closing quote or the label set's `}` is missing.
    #[error("unterminated label set")]
    Unterminated,
    /// No sample value after the name and labels.
    #[error("missing sample value")]
    MissingValue,
    /// The sample value is not a float, `NaN` or `±Inf`.
    #[error("invalid sample value")]
    Value,
    /// The optional timestamp is not an integer.
    #[error("invalid timestamp")]
    Timestamp,
    /// Something other than a timestamp or an exemplar follows the value.
    #[error("unexpected text after the sample")]
    Trailing,
}

/// One sample line: name, raw label text (between the braces, still escaped) and value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// Metric name, e.g. `vllm:num_requests_running` or `x_bucket`.
    pub name: &'a str,
    /// The text between `{` and `}`; empty without labels. Read it with [`Sample::labels`].
    pub raw_labels: &'a str,
    /// The sample value (may be NaN or infinite).
    pub value: f64,
    /// 1-based line number in the body, for error messages.
    pub line: usize,
}

impl<'a> Sample<'a> {
    /// Calls `f(name, value)` for every label, unescaping values (`\\`, `\"`, `\n`).
    pub fn labels(&self, f: impl FnMut(&'a str, Cow<'a, str>)) -> Result<(), SyntaxError> {
        for_each_label(self.raw_labels, f)
    }

    /// The unescaped value of label `name`, if present.
    pub fn label(&self, name: &str) -> Result<Option<Cow<'a, str>>, SyntaxError> {
        let mut found = None;
        self.labels(|k, v| {
            if k == name && found.is_none() {
                found = Some(v);
            }
        })?;
        Ok(found)
    }
}

/// Iterates over the samples of a text-format body, skipping comments and blank lines.
///
/// Labels are checked for well-formedness as each line is yielded, so a malformed line anywhere
/// surfaces as an error with its line number.
pub fn samples(text: &str) -> impl Iterator<Item = Result<Sample<'_>, PromError>> + '_ {
    text.split('\n')
        .enumerate()
        .filter_map(|(i, line)| checked_sample(line, i + 1).transpose())
}

/// Like [`samples`], but only the samples of the series in `names`: another line costs a scan
/// of its metric name and is not checked further, unless it does not start like a sample or a
/// comment, which is an error as in [`samples`]. What the scrape path reads a page with.
pub fn samples_named<'a>(
    text: &'a str,
    names: &'a [&'a str],
) -> impl Iterator<Item = Result<Sample<'a>, PromError>> + 'a {
    text.split('\n')
        .enumerate()
        .filter_map(move |(i, line)| match line_head(line) {
            LineHead::Skip => None,
            LineHead::Name(name) if !names.contains(&name) => None,
            LineHead::Name(_) | LineHead::Malformed => checked_sample(line, i + 1).transpose(),
        })
}

/// One line parsed and its labels checked; `Ok(None)` for blank lines and comments.
fn checked_sample(line: &str, number: usize) -> Result<Option<Sample<'_>>, PromError> {
    parse_line(line, number)
        .and_then(|s| match s {
            Some(s) => for_each_label(s.raw_labels, |_, _| {}).map(|()| Some(s)),
            None => Ok(None),
        })
        .map_err(|kind| PromError::Syntax { line: number, kind })
}

/// What a line starts with, read without parsing the rest of it.
enum LineHead<'a> {
    /// A blank line or a comment.
    Skip,
    /// A sample of this metric (well-formed up to the name, at least).
    Name(&'a str),
    /// Not a sample line: the full parser says why.
    Malformed,
}

fn line_head(line: &str) -> LineHead<'_> {
    let line = line.trim_start_matches([' ', '\t', '\r']);
    let bytes = line.as_bytes();
    match bytes.first() {
        None | Some(b'#') => return LineHead::Skip,
        Some(c) if !is_name_start(*c) => return LineHead::Malformed,
        Some(_) => {}
    }
    let len = bytes
        .iter()
        .position(|c| !is_name_char(*c))
        .unwrap_or(bytes.len());
    match bytes.get(len) {
        None | Some(b'{' | b' ' | b'\t' | b'\r') => LineHead::Name(&line[..len]),
        Some(_) => LineHead::Malformed,
    }
}

/// Parses raw `/metrics` bytes (what the scraper receives) into routing metrics.
pub fn parse_vllm_metrics_bytes(body: &[u8]) -> Result<EndpointMetrics, PromError> {
    let text = std::str::from_utf8(body).map_err(|e| PromError::NotUtf8(e.valid_up_to()))?;
    parse_vllm_metrics(text)
}

/// Parses a vLLM `/metrics` body into routing metrics, summed over DP engines, checking every
/// line.
pub fn parse_vllm_metrics(text: &str) -> Result<EndpointMetrics, PromError> {
    metrics_from(samples(text))
}

/// What the scraper reads a `/metrics` body with: [`parse_vllm_metrics`]'s result, parsing only
/// the lines of [`READ_SERIES`] ([`samples_named`]). A page `parse_vllm_metrics` accepts gives
/// the same metrics here; a page whose other lines are malformed past their metric name is
/// accepted here and not there.
pub fn scrape_vllm_metrics(text: &str) -> Result<EndpointMetrics, PromError> {
    metrics_from(samples_named(text, &READ_SERIES))
}

/// [`scrape_vllm_metrics`] for one engine of a data-parallel server (vLLM
/// `--data-parallel-size`): only the samples labelled `engine="<engine>"`, so each rank is
/// scored on its own load, cache usage and rates. Samples without an `engine` label count for
/// no engine.
pub fn scrape_vllm_engine_metrics(text: &str, engine: u32) -> Result<EndpointMetrics, PromError> {
    let want = engine.to_string();
    metrics_from(samples_named(text, &READ_SERIES).filter(move |s| match s {
        Ok(s) => match s.label("engine") {
            Ok(Some(e)) => e == want.as_str(),
            Ok(None) => false,
            // Kept, so the malformed label is reported where it is read.
            Err(_) => true,
        },
        Err(_) => true,
    }))
}

/// Routing metrics from a page's samples.
fn metrics_from<'a>(
    samples: impl Iterator<Item = Result<Sample<'a>, PromError>>,
) -> Result<EndpointMetrics, PromError> {
    let mut running: Option<f64> = None;
    let mut waiting: Option<f64> = None;
    // (engine label, usage) per series, for the new and the old KV metric name.
    let mut kv_new: Vec<(Option<Cow<'a, str>>, f64)> = Vec::new();
    let mut kv_old: Vec<(Option<Cow<'a, str>>, f64)> = Vec::new();
    // (engine label, capacity in tokens; None when the engine has not profiled yet).
    let mut capacity: Vec<(Option<Cow<'a, str>>, Option<u64>)> = Vec::new();
    // The first engine's `block_size` (data-parallel engines share one CacheConfig).
    let mut block_size_seen: Option<u64> = None;
    // Calibration counters, summed over series: computed tokens, prefill s and count, ITL s
    // and count, prompt tokens, prefix-cache hits.
    let mut counters: [Option<f64>; 7] = [None; 7];
    let mut queries: Option<f64> = None;

    for sample in samples {
        let sample = sample?;
        let syntax = |kind| PromError::Syntax {
            line: sample.line,
            kind,
        };
        match sample.name {
            RUNNING => add_gauge(&mut running, RUNNING, sample.value)?,
            WAITING => add_gauge(&mut waiting, WAITING, sample.value)?,
            KV_USAGE | KV_USAGE_OLD => {
                let metric = if sample.name == KV_USAGE {
                    KV_USAGE
                } else {
                    KV_USAGE_OLD
                };
                if !sample.value.is_finite() || sample.value < 0.0 {
                    return Err(PromError::BadValue {
                        metric,
                        value: sample.value,
                    });
                }
                let engine = sample.label("engine").map_err(syntax)?;
                let usage = sample.value.min(1.0);
                if metric == KV_USAGE {
                    kv_new.push((engine, usage))
                } else {
                    kv_old.push((engine, usage))
                }
            }
            CACHE_CONFIG_INFO => {
                let (mut blocks, mut block_size, mut engine) = (None, None, None);
                sample
                    .labels(|k, v| match k {
                        "num_gpu_blocks" => blocks = Some(v),
                        "block_size" => block_size = Some(v),
                        "engine" => engine = Some(v),
                        _ => {}
                    })
                    .map_err(syntax)?;
                let blocks = count_label("num_gpu_blocks", blocks.as_deref())?;
                let block_size = count_label("block_size", block_size.as_deref())?;
                block_size_seen = block_size_seen.or(block_size);
                let tokens = match (blocks, block_size) {
                    (Some(b), Some(s)) => {
                        Some(b.checked_mul(s).ok_or(PromError::CapacityOverflow)?)
                    }
                    _ => None,
                };
                capacity.push((engine, tokens));
            }
            PREFIX_CACHE_QUERIES => *queries.get_or_insert(0.0) += sample.value,
            name => {
                let Some(slot) = CALIBRATION_SERIES.iter().position(|s| *s == name) else {
                    continue;
                };
                let acc = &mut counters[slot];
                *acc = Some(acc.unwrap_or(0.0) + sample.value);
            }
        }
    }

    let running = running.ok_or(PromError::Missing(RUNNING))?;
    let waiting = waiting.ok_or(PromError::Missing(WAITING))?;
    let kv = if kv_new.is_empty() { kv_old } else { kv_new };
    if kv.is_empty() {
        return Err(PromError::Missing(KV_USAGE));
    }
    let capacity_tokens = total_capacity(&capacity)?;
    Ok(EndpointMetrics {
        running: to_count(running),
        waiting: to_count(waiting),
        kv_usage: weighted_usage(&kv, &capacity),
        capacity_tokens,
        counters: engine_counters(counters),
        block_size: block_size_seen.and_then(|b| u32::try_from(b).ok()),
        prefix_cache: prefix_cache(counters[6], queries),
    })
}

/// The engine's prefix-cache hits and queries when both are present and usable.
fn prefix_cache(hits: Option<f64>, queries: Option<f64>) -> Option<PrefixCacheCounters> {
    let (hits, queries) = (hits?, queries?);
    [hits, queries]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
        .then_some(PrefixCacheCounters { hits, queries })
}

/// The calibration counters when every one is present and usable.
fn engine_counters(c: [Option<f64>; 7]) -> Option<EngineCounters> {
    let [computed, prefill, prefills, itl, gaps, prompt, hits] = c;
    let values = [computed?, prefill?, prefills?, itl?, gaps?, prompt?, hits?];
    values
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
        .then_some(EngineCounters {
            prefill_computed_tokens: values[0],
            prefill_seconds: values[1],
            prefill_count: values[2],
            itl_seconds: values[3],
            itl_count: values[4],
            prompt_tokens: values[5],
            prefix_cache_hit_tokens: values[6],
        })
}

fn add_gauge(acc: &mut Option<f64>, metric: &'static str, value: f64) -> Result<(), PromError> {
    if !value.is_finite() || value < 0.0 {
        return Err(PromError::BadValue { metric, value });
    }
    *acc = Some(acc.unwrap_or(0.0) + value);
    Ok(())
}

fn to_count(v: f64) -> u32 {
    // `as` saturates; the value is finite and non-negative here.
    v.round() as u32
}

/// A block count label: `None` for "not known yet" (vLLM writes `None` before profiling).
fn count_label(label: &'static str, value: Option<&str>) -> Result<Option<u64>, PromError> {
    match value.map(str::trim) {
        None | Some("" | "None" | "null") => Ok(None),
        Some(v) => v
            .parse::<u64>()
            .map(Some)
            .map_err(|_| PromError::BadCacheConfig {
                label,
                value: v.to_string(),
            }),
    }
}

fn total_capacity(
    capacity: &[(Option<Cow<'_, str>>, Option<u64>)],
) -> Result<Option<u64>, PromError> {
    if capacity.is_empty() || capacity.iter().any(|(_, c)| c.is_none()) {
        return Ok(None);
    }
    let mut total: u64 = 0;
    for (_, c) in capacity {
        total = total
            .checked_add(c.unwrap_or(0))
            .ok_or(PromError::CapacityOverflow)?;
    }
    Ok(Some(total))
}

/// Mean KV usage over engines, weighted by each engine's capacity when every engine's is known.
fn weighted_usage(
    kv: &[(Option<Cow<'_, str>>, f64)],
    capacity: &[(Option<Cow<'_, str>>, Option<u64>)],
) -> f64 {
    let weight = |engine: &Option<Cow<'_, str>>| {
        capacity
            .iter()
            .find(|(e, _)| e == engine)
            .and_then(|(_, c)| *c)
            .filter(|c| *c > 0)
    };
    let weights: Option<Vec<f64>> = kv
        .iter()
        .map(|(e, _)| weight(e).map(|c| c as f64))
        .collect();
    let (sum, total) = match weights {
        Some(w) => kv
            .iter()
            .zip(&w)
            .fold((0.0, 0.0), |(s, t), ((_, u), w)| (s + u * w, t + w)),
        None => kv
            .iter()
            .fold((0.0, 0.0), |(s, t), (_, u)| (s + u, t + 1.0)),
    };
    if total > 0.0 {
        (sum / total).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

fn skip_ws(s: &str) -> &str {
    s.trim_start_matches([' ', '\t'])
}

/// Parses one line; `Ok(None)` for blank lines and comments.
fn parse_line(line: &str, number: usize) -> Result<Option<Sample<'_>>, SyntaxError> {
    let line = line.trim_matches([' ', '\t', '\r']);
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let bytes = line.as_bytes();
    if !is_name_start(bytes[0]) {
        return Err(SyntaxError::MetricName);
    }
    let name_len = bytes
        .iter()
        .position(|c| !is_name_char(*c))
        .unwrap_or(bytes.len());
    let (name, rest) = line.split_at(name_len);
    if !(rest.is_empty() || rest.starts_with(['{', ' ', '\t'])) {
        return Err(SyntaxError::MetricName);
    }
    let rest = skip_ws(rest);
    let (raw_labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let end = label_set_end(inner)?;
            (&inner[..end], &inner[end + 1..])
        }
        None => ("", rest),
    };
    let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
    let value = parse_value(fields.next().ok_or(SyntaxError::MissingValue)?)?;
    match fields.next() {
        None => {}
        Some(f) if f.starts_with('#') => {} // OpenMetrics exemplar: ignored.
        Some(ts) => {
            parse_timestamp(ts)?;
            match fields.next() {
                None => {}
                Some(f) if f.starts_with('#') => {}
                Some(_) => return Err(SyntaxError::Trailing),
            }
        }
    }
    Ok(Some(Sample {
        name,
        raw_labels,
        value,
        line: number,
    }))
}

/// Finds the `}` closing a label set, skipping quoted values; `s` starts after the `{`.
fn label_set_end(s: &str) -> Result<usize, SyntaxError> {
    let mut quotes = scorer_core::quotes::QuoteState::default();
    for (i, c) in s.bytes().enumerate() {
        if quotes.outside(c) && c == b'}' {
            return Ok(i);
        }
    }
    Err(SyntaxError::Unterminated)
}

fn parse_value(s: &str) -> Result<f64, SyntaxError> {
    // Rust's float parser also takes `inf`, `infinity` and `nan` in any case, which is a superset
    // of the format's `+Inf`, `-Inf` and `NaN`. Reject hex and other oddities by charset.
    let ok = s
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.'));
    if !ok {
        return Err(SyntaxError::Value);
    }
    s.parse::<f64>().map_err(|_| SyntaxError::Value)
}

fn parse_timestamp(s: &str) -> Result<(), SyntaxError> {
    // Prometheus writes integer milliseconds; OpenMetrics allows float seconds.
    if s.parse::<i64>().is_ok() || s.parse::<f64>().is_ok_and(f64::is_finite) {
        Ok(())
    } else {
        Err(SyntaxError::Timestamp)
    }
}

/// Walks `name="value"` pairs separated by commas (a trailing comma is allowed).
fn for_each_label<'a>(
    raw: &'a str,
    mut f: impl FnMut(&'a str, Cow<'a, str>),
) -> Result<(), SyntaxError> {
    let mut rest = skip_ws(raw);
    while !rest.is_empty() {
        let bytes = rest.as_bytes();
        if !(bytes[0].is_ascii_alphabetic() || bytes[0] == b'_') {
            return Err(SyntaxError::LabelName);
        }
        let len = bytes
            .iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
            .unwrap_or(bytes.len());
        let (name, after) = rest.split_at(len);
        let after = skip_ws(after)
            .strip_prefix('=')
            .ok_or(SyntaxError::LabelSyntax)?;
        let after = skip_ws(after)
            .strip_prefix('"')
            .ok_or(SyntaxError::LabelSyntax)?;
        let (value, after) = unescape_value(after)?;
        f(name, value);
        let after = skip_ws(after);
        rest = match after.strip_prefix(',') {
            Some(more) => skip_ws(more),
            None if after.is_empty() => after,
            None => return Err(SyntaxError::LabelSyntax),
        };
    }
    Ok(())
}

/// Reads a quoted value's body (opening quote already consumed); returns it and the rest.
fn unescape_value(s: &str) -> Result<(Cow<'_, str>, &str), SyntaxError> {
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut owned: Option<String> = None;
    let mut copied = 0; // bytes of `s` already copied into `owned`
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let value = match owned {
                    Some(mut o) => {
                        o.push_str(&s[copied..i]);
                        Cow::Owned(o)
                    }
                    None => Cow::Borrowed(&s[..i]),
                };
                return Ok((value, &s[i + 1..]));
            }
            b'\\' if i + 1 < bytes.len() => {
                let o = owned.get_or_insert_with(String::new);
                o.push_str(&s[copied..i]);
                match bytes[i + 1] {
                    b'n' => o.push('\n'),
                    b'\\' => o.push('\\'),
                    b'"' => o.push('"'),
                    // Unknown escapes are kept verbatim, as Prometheus does. The escaped char is
                    // ASCII here or the start of a multi-byte char, which `copied` preserves.
                    _ => {
                        o.push('\\');
                        copied = i + 1;
                        i += 1;
                        continue;
                    }
                }
                i += 2;
                copied = i;
            }
            _ => i += 1,
        }
    }
    Err(SyntaxError::Unterminated)
}

/// The page a vLLM 0.33 server serves only the named series on. vLLM mounts
/// `prometheus_client.make_asgi_app` at `/metrics` (any path below it), but the exact path
/// `/metrics` is taken first by prometheus-fastapi-instrumentator's handler, which serves the
/// whole registry and ignores the query
/// (`vllm/entrypoints/serve/instrumentator/metrics.py`, `attach_router`). `/metrics/` reaches
/// `prometheus_client`, which honours `name[]` (`exposition.py`, `_bake_output`:
/// `registry.restricted_registry(params['name[]'])`).
pub const RESTRICTED_METRICS_PATH: &str = "/metrics/";

/// `/metrics/?name[]=a&name[]=b…`, the request for only the samples named `names`: what the
/// control plane scrapes, so a 58 KB page of histograms becomes the dozen lines it reads, on
/// both sides of the wire. Names are sample names (`x_sum`, not `x`), as `prometheus_client`
/// filters samples.
pub fn restricted_metrics_path(names: &[&str]) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for name in names {
        query.append_pair("name[]", name);
    }
    format!("{RESTRICTED_METRICS_PATH}?{}", query.finish())
}

/// The `name[]` values of a `/metrics/` query, decoded as Python's `parse_qs` decodes them
/// (blank values dropped); `None` when there are none, which means the whole page. For a
/// server (vllm-sim, the scale benchmark's listeners) that answers as vLLM does.
pub fn requested_names(query: &str) -> Option<Vec<String>> {
    let names: Vec<String> = form_urlencoded::parse(query.as_bytes())
        .filter(|(key, value)| key == "name[]" && !value.is_empty())
        .map(|(_, value)| value.into_owned())
        .collect();
    (!names.is_empty()).then_some(names)
}

/// What a vLLM 0.33 server answers to `GET {path}?{query}` from its whole `page`: at
/// [`RESTRICTED_METRICS_PATH`] only the samples a `name[]` query names, at `/metrics` the whole
/// page whatever the query. The one place a simulated server (vllm-sim, the benchmarks'
/// listeners) follows vLLM's two metrics routes.
pub fn vllm_metrics_answer(path: &str, query: Option<&str>, page: String) -> String {
    let names = (path == RESTRICTED_METRICS_PATH)
        .then(|| query.and_then(requested_names))
        .flatten();
    match names {
        Some(names) => restrict_page(&page, &names),
        None => page,
    }
}

/// What `prometheus_client`'s restricted registry serves from `text`: the sample lines whose
/// sample name is in `names`, each family's `# HELP`/`# TYPE` lines kept only when one of its
/// samples is. A server-side helper: vllm-sim and the scale benchmark answer `name[]` with it.
pub fn restrict_page(text: &str, names: &[impl AsRef<str>]) -> String {
    let mut out = String::new();
    // The comment lines of the family being read, written out with its first kept sample.
    let mut header: Vec<&str> = Vec::new();
    let mut header_family: Option<&str> = None;
    for line in text.lines() {
        if let Some(comment) = line.strip_prefix("# ") {
            let family = comment
                .strip_prefix("HELP ")
                .or_else(|| comment.strip_prefix("TYPE "))
                .and_then(|rest| rest.split([' ', '\t']).next());
            if let Some(family) = family {
                if header_family != Some(family) {
                    header.clear();
                    header_family = Some(family);
                }
                header.push(line);
            }
            continue;
        }
        let LineHead::Name(name) = line_head(line) else {
            continue;
        };
        if names.iter().any(|n| n.as_ref() == name) {
            for h in header.drain(..) {
                out.push_str(h);
                out.push('\n');
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_engine_of_a_data_parallel_page_reads_as_its_own_endpoint() {
        let page = "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3.0\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1.0\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2.0\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 0.0\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.75\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"1\"} 0.25\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\",engine=\"0\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\",engine=\"1\"} 1.0\n";
        let whole = scrape_vllm_metrics(page).unwrap();
        assert_eq!((whole.running, whole.waiting), (4, 2));
        assert_eq!(whole.capacity_tokens, Some(3200));
        let one = scrape_vllm_engine_metrics(page, 1).unwrap();
        assert_eq!((one.running, one.waiting, one.kv_usage), (1, 0, 0.25));
        assert_eq!(
            (one.capacity_tokens, one.block_size),
            (Some(1600), Some(16))
        );
        let zero = scrape_vllm_engine_metrics(page, 0).unwrap();
        assert_eq!((zero.running, zero.waiting, zero.kv_usage), (3, 2, 0.75));
        // An engine the page does not have is missing its gauges.
        assert_eq!(
            scrape_vllm_engine_metrics(page, 2),
            Err(PromError::Missing(RUNNING))
        );
    }

    #[test]
    fn reads_calibration_counters_summed_over_engines_or_none() {
        let page = |extra: &str| {
            format!(
                "vllm:num_requests_running{{engine=\"0\"}} 1.0\n\
                 vllm:num_requests_waiting{{engine=\"0\"}} 0.0\n\
                 vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.5\n\
                 vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\"}} 1000.0\n\
                 vllm:request_prefill_kv_computed_tokens_sum{{engine=\"1\"}} 500.0\n\
                 vllm:request_prefill_time_seconds_sum{{engine=\"0\"}} 0.25\n\
                 vllm:request_prefill_time_seconds_count{{engine=\"0\"}} 3.0\n\
                 vllm:prompt_tokens_total{{engine=\"0\"}} 1800.0\n\
                 vllm:prefix_cache_hits_total{{engine=\"0\"}} 300.0\n\
                 vllm:inter_token_latency_seconds_sum{{engine=\"0\"}} 2.0\n\
                 {extra}"
            )
        };
        let full = parse_vllm_metrics(&page(
            "vllm:inter_token_latency_seconds_count{engine=\"0\"} 100.0\n",
        ))
        .unwrap();
        let c = full.counters.unwrap();
        assert_eq!(c.prefill_computed_tokens, 1500.0);
        assert_eq!((c.prefill_seconds, c.prefill_count), (0.25, 3.0));
        assert_eq!((c.itl_seconds, c.itl_count), (2.0, 100.0));
        assert_eq!(
            (c.prompt_tokens, c.prefix_cache_hit_tokens),
            (1800.0, 300.0)
        );
        // One counter missing, or unusable: no counters, and the gauges still parse.
        let missing = parse_vllm_metrics(&page("")).unwrap();
        assert_eq!((missing.counters, missing.running), (None, 1));
        let nan = parse_vllm_metrics(&page(
            "vllm:inter_token_latency_seconds_count{engine=\"0\"} NaN\n",
        ))
        .unwrap();
        assert_eq!(nan.counters, None);
        // The engine's own hits over queries, summed over engines, whether or not the
        // calibration counters are all there; none without the queries.
        assert_eq!(full.prefix_cache, None);
        let with_queries = parse_vllm_metrics(&page(
            "vllm:prefix_cache_queries_total{engine=\"0\"} 1000.0\n\
             vllm:prefix_cache_queries_total{engine=\"1\"} 800.0\n",
        ))
        .unwrap();
        assert_eq!(
            with_queries.prefix_cache,
            Some(PrefixCacheCounters {
                hits: 300.0,
                queries: 1800.0
            })
        );
        assert_eq!(with_queries.counters, None);
    }

    /// Shaped like vLLM 0.3x output with two DP engines (trimmed).
    const VLLM_DP2: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_info{implementation="CPython",major="3",minor="12",patchlevel="3",version="3.12.3"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1024.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} NaN
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="1000",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="3000",prefix_caching_hash_algo="sha256"} 1.0
"#;

    #[test]
    fn sums_over_engines_and_weights_kv_by_capacity() {
        let m = parse_vllm_metrics(VLLM_DP2).unwrap();
        assert_eq!(m.running, 7);
        assert_eq!(m.waiting, 2);
        assert_eq!(m.capacity_tokens, Some(4000 * 16));
        // 0.25 * 1000 + 0.75 * 3000 over 4000 blocks.
        assert!((m.kv_usage - 0.625).abs() < 1e-12, "{}", m.kv_usage);
        // vLLM 0.33's `block_size` label: what the self-check compares with the configured size.
        assert_eq!(m.block_size, Some(16));
    }

    #[test]
    fn old_kv_name_without_engine_or_config() {
        let text = "vllm:num_requests_running{model_name=\"m\"} 1\n\
                    vllm:num_requests_waiting{model_name=\"m\"} 0\n\
                    vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n";
        let m = parse_vllm_metrics(text).unwrap();
        assert_eq!((m.running, m.waiting, m.capacity_tokens), (1, 0, None));
        assert_eq!(m.block_size, None);
        assert!((m.kv_usage - 0.5).abs() < 1e-12);
    }

    #[test]
    fn new_kv_name_wins_when_both_are_present() {
        let text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n\
                    vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n";
        assert!((parse_vllm_metrics(text).unwrap().kv_usage - 0.1).abs() < 1e-12);
    }

    #[test]
    fn unprofiled_capacity_is_unknown() {
        let text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n";
        assert_eq!(parse_vllm_metrics(text).unwrap().capacity_tokens, None);
    }

    #[test]
    fn escapes_timestamps_exemplars_and_whitespace() {
        let text = "vllm:num_requests_running{model_name=\"a \\\"quoted\\\" \\\\ name\\n\", engine=\"0\",} 2 1700000000000\n\
                    \tvllm:num_requests_waiting { engine = \"0\" }   5\r\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.5 # {trace_id=\"abc\"} 1.0\n\
                    odd{path=\"C:\\\\dir\\x\",ü=\"\"} 1\n";
        let err = parse_vllm_metrics(text).unwrap_err();
        assert_eq!(
            err,
            PromError::Syntax {
                line: 4,
                kind: SyntaxError::LabelName
            }
        );
        let text = text.replace(",ü=\"\"", "");
        let m = parse_vllm_metrics(&text).unwrap();
        assert_eq!((m.running, m.waiting), (2, 5));
        let s = samples(&text).next().unwrap().unwrap();
        assert_eq!(
            s.label("model_name").unwrap().as_deref(),
            Some("a \"quoted\" \\ name\n")
        );
        let last = samples(&text).nth(3).unwrap().unwrap();
        assert_eq!(last.label("path").unwrap().as_deref(), Some("C:\\dir\\x"));
    }

    #[test]
    fn special_values() {
        let text = "a +Inf\nb -Inf\nc NaN\nd 1e3\ne -0.5\n";
        let values: Vec<f64> = samples(text).map(|s| s.unwrap().value).collect();
        assert_eq!(values[0], f64::INFINITY);
        assert_eq!(values[1], f64::NEG_INFINITY);
        assert!(values[2].is_nan());
        assert_eq!(&values[3..], &[1000.0, -0.5]);
    }

    #[test]
    fn unusable_gauges_are_errors() {
        for (line, metric) in [
            ("vllm:num_requests_running NaN", RUNNING),
            ("vllm:num_requests_waiting -1", WAITING),
            ("vllm:kv_cache_usage_perc +Inf", KV_USAGE),
        ] {
            let text = format!(
                "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n{line}\n"
            );
            assert!(
                matches!(parse_vllm_metrics(&text), Err(PromError::BadValue { metric: m, .. }) if m == metric),
                "{line}"
            );
        }
    }

    #[test]
    fn missing_metrics_are_named() {
        assert_eq!(parse_vllm_metrics(""), Err(PromError::Missing(RUNNING)));
        assert_eq!(
            parse_vllm_metrics("vllm:num_requests_running 1\n"),
            Err(PromError::Missing(WAITING))
        );
        assert_eq!(
            parse_vllm_metrics("vllm:num_requests_running 1\nvllm:num_requests_waiting 1\n"),
            Err(PromError::Missing(KV_USAGE))
        );
    }

    #[test]
    fn bad_cache_config() {
        let base = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n";
        let text =
            format!("{base}vllm:cache_config_info{{block_size=\"x\",num_gpu_blocks=\"4\"}} 1\n");
        assert!(matches!(
            parse_vllm_metrics(&text),
            Err(PromError::BadCacheConfig {
                label: "block_size",
                ..
            })
        ));
        let text = format!(
            "{base}vllm:cache_config_info{{block_size=\"{m}\",num_gpu_blocks=\"{m}\"}} 1\n",
            m = u64::MAX
        );
        assert_eq!(parse_vllm_metrics(&text), Err(PromError::CapacityOverflow));
    }

    #[test]
    fn garbage_is_a_typed_error() {
        let cases: &[(&str, SyntaxError)] = &[
            (
                "<html><body>502 Bad Gateway</body></html>",
                SyntaxError::MetricName,
            ),
            ("9abc 1", SyntaxError::MetricName),
            ("abc", SyntaxError::MissingValue),
            ("abc{", SyntaxError::Unterminated),
            ("abc{a=\"x} 1", SyntaxError::Unterminated),
            ("abc{a=\"x\\\"} 1", SyntaxError::Unterminated),
            ("abc{a} 1", SyntaxError::LabelSyntax),
            ("abc{a=x} 1", SyntaxError::LabelSyntax),
            ("abc{a=\"x\" b=\"y\"} 1", SyntaxError::LabelSyntax),
            ("abc{=\"x\"} 1", SyntaxError::LabelName),
            ("abc{a=\"x\"}", SyntaxError::MissingValue),
            ("abc one", SyntaxError::Value),
            ("abc 0x10", SyntaxError::Value),
            ("abc 1 soon", SyntaxError::Timestamp),
            ("abc 1 2 3", SyntaxError::Trailing),
            ("abc\"x\" 1", SyntaxError::MetricName),
        ];
        for (text, kind) in cases {
            let err = parse_vllm_metrics(text).unwrap_err();
            assert_eq!(
                err,
                PromError::Syntax {
                    line: 1,
                    kind: *kind
                },
                "{text:?}"
            );
        }
        assert_eq!(
            parse_vllm_metrics_bytes(b"ok 1\n\xff\xfe"),
            Err(PromError::NotUtf8(5))
        );
    }

    /// vLLM 0.33's whole default page (`tests/bench/fixtures`, 58 KB, histograms included).
    const VLLM_033: &str = include_str!("../../../tests/bench/fixtures/vllm-0.33-metrics.txt");

    // The scrape path reads what the checking parser reads, from the lines it needs.
    #[test]
    fn the_scrape_path_reads_what_the_full_parser_reads() {
        for page in [VLLM_DP2, VLLM_033] {
            let full = parse_vllm_metrics(page).unwrap();
            assert_eq!(scrape_vllm_metrics(page), Ok(full));
        }
        let full = parse_vllm_metrics(VLLM_033).unwrap();
        assert_eq!((full.running, full.capacity_tokens), (3, Some(29_127 * 16)));
        assert!(full.counters.is_some());
        let read = samples_named(VLLM_033, &READ_SERIES).count();
        assert!(read < 20 && samples(VLLM_033).count() > 400, "{read}");
        // LoRA-style reads of one series skip the rest the same way.
        let names = ["vllm:num_requests_waiting"];
        let waiting: Vec<_> = samples_named(VLLM_DP2, &names)
            .map(|s| s.unwrap().value)
            .collect();
        assert_eq!(waiting, [0.0, 2.0]);
    }

    // A page restricted to the series the router reads (what vLLM's `/metrics/?name[]=` serves)
    // reads the same as the whole page, in a twentieth of the bytes (2.8 of 58 KB).
    #[test]
    fn a_restricted_page_reads_as_the_whole_page() {
        for page in [VLLM_DP2, VLLM_033] {
            let small = restrict_page(page, &READ_SERIES);
            assert_eq!(parse_vllm_metrics(&small), parse_vllm_metrics(page));
            assert_eq!(
                scrape_vllm_engine_metrics(&small, 1),
                scrape_vllm_engine_metrics(page, 1)
            );
        }
        let small = restrict_page(VLLM_033, &READ_SERIES);
        assert!(small.len() * 20 < VLLM_033.len(), "{}", small.len());
        // Each kept family keeps its HELP and TYPE lines once, before its first sample.
        let expected = "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
                        # TYPE vllm:num_requests_waiting gauge\n\
                        vllm:num_requests_waiting{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0\n\
                        vllm:num_requests_waiting{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 2.0\n";
        assert_eq!(restrict_page(VLLM_DP2, &[WAITING]), expected);
        // Histogram samples are named one by one, as prometheus_client filters them.
        let sums = restrict_page(VLLM_033, &["vllm:request_prefill_time_seconds_sum"]);
        assert_eq!(sums.lines().filter(|l| !l.starts_with('#')).count(), 1);
        assert_eq!(restrict_page(VLLM_033, &["nothing"]), "");
    }

    #[test]
    fn the_restricted_path_round_trips_its_names() {
        let path = restricted_metrics_path(&READ_SERIES);
        assert!(path.starts_with("/metrics/?name%5B%5D=vllm%3Anum_requests_running&"));
        let query = path.split_once('?').unwrap().1;
        assert_eq!(requested_names(query).unwrap(), READ_SERIES);
        // As Python's parse_qs: unencoded brackets and `+` for space, blank values dropped.
        assert_eq!(
            requested_names("name[]=a+b&x=1&name[]=&name%5B%5D=c").unwrap(),
            ["a b", "c"]
        );
        assert_eq!(requested_names("name[]=&other=1"), None);
        assert_eq!(requested_names(""), None);
        // vLLM's two routes: `/metrics` ignores the query, `/metrics/` honours it.
        let answer = |path| vllm_metrics_answer(path, Some(query), VLLM_DP2.to_owned());
        assert_eq!(answer("/metrics"), VLLM_DP2);
        assert_eq!(answer("/metrics/"), restrict_page(VLLM_DP2, &READ_SERIES));
        assert_eq!(
            vllm_metrics_answer("/metrics/", None, VLLM_DP2.into()),
            VLLM_DP2
        );
    }

    // Lines of series the router does not read are checked only up to their name: a page that
    // is not Prometheus text still fails at its first line, and a bad read line is an error.
    #[test]
    fn the_scrape_path_skips_unread_lines_but_not_garbage() {
        let base = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n";
        let odd = format!("{base}odd{{ü=\"\"}} 1\nhist_bucket{{le=\"1\"}} soon\n");
        assert!(parse_vllm_metrics(&odd).is_err());
        assert_eq!(scrape_vllm_metrics(&odd), parse_vllm_metrics(base));
        for (page, line, kind) in [
            (
                "<html><body>502</body></html>\n",
                1,
                SyntaxError::MetricName,
            ),
            ("{\"object\":\"error\"}", 1, SyntaxError::MetricName),
            ("abc\"x\" 1\n", 1, SyntaxError::MetricName),
            (
                "vllm:num_requests_running{engine} 1\n",
                1,
                SyntaxError::LabelSyntax,
            ),
            (
                "ok 1\nvllm:kv_cache_usage_perc one\n",
                2,
                SyntaxError::Value,
            ),
        ] {
            assert_eq!(
                scrape_vllm_metrics(page),
                Err(PromError::Syntax { line, kind }),
                "{page:?}"
            );
        }
    }

    #[test]
    fn never_panics_on_random_bodies() {
        // Bodies drawn from the format's own alphabet reach deep into the parser.
        const ALPHABET: &[u8] = b"vllm:_num{}=\",# \t\n\r0123456789.+-eEInfNa\\\xc3\xa9";
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let len = (next() % 80) as usize;
            let body: Vec<u8> = (0..len)
                .map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize])
                .collect();
            let full = parse_vllm_metrics_bytes(&body);
            if let (Ok(m), Ok(text)) = (&full, std::str::from_utf8(&body)) {
                assert_eq!(scrape_vllm_metrics(text).as_ref(), Ok(m));
            }
        }
    }

    #[test]
    fn never_panics_on_prefixes_and_mutations() {
        // Every prefix of a realistic body, and every single-byte corruption of its first lines,
        // parses or fails cleanly: a cheap stand-in until the fuzz target exists.
        for end in 0..=VLLM_DP2.len() {
            if VLLM_DP2.is_char_boundary(end) {
                let _ = parse_vllm_metrics(&VLLM_DP2[..end]);
            }
        }
        let mut bytes = VLLM_DP2.as_bytes()[..600].to_vec();
        for i in 0..bytes.len() {
            let orig = bytes[i];
            for b in [b'"', b'\\', b'{', b'}', b'=', b',', b' ', b'\n', 0xC3, b'#'] {
                bytes[i] = b;
                let _ = parse_vllm_metrics_bytes(&bytes);
            }
            bytes[i] = orig;
        }
    }
}
