//! Prometheus text exposition with vLLM 0.33's metric names and labels.
//!
//! Rendered by hand rather than with a metrics library so names (`vllm:` prefix, `_total`
//! counters), label sets and histogram buckets match vLLM exactly.

use std::fmt::Write;

use super::engine::EngineStats;

/// vLLM's time-to-first-token buckets, seconds.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token-latency buckets, seconds.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets (e2e, queue), seconds.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's token-count buckets (`build_1_2_5_buckets` up to a 128k context).
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

/// A cumulative Prometheus histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with upper bounds `bounds` (plus `+Inf`).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation (negative values clamp to 0).
    pub fn observe(&mut self, v: f64) {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{}\"}} {cum}", float(*b));
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", float(self.sum));
    }
}

/// The latency histograms a server keeps.
#[derive(Debug, Clone)]
pub struct LatencyHistograms {
    /// `vllm:time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// `vllm:inter_token_latency_seconds`.
    pub itl: Histogram,
    /// `vllm:e2e_request_latency_seconds`.
    pub e2e: Histogram,
    /// `vllm:request_queue_time_seconds`.
    pub queue: Histogram,
    /// `vllm:request_prefill_time_seconds`: first scheduling to first token.
    pub prefill: Histogram,
    /// `vllm:request_prefill_kv_computed_tokens`: prompt tokens computed, cached ones excluded.
    pub prefill_computed: Histogram,
}

impl Default for LatencyHistograms {
    fn default() -> Self {
        Self {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_computed: Histogram::new(TOKEN_BUCKETS),
        }
    }
}

/// Static facts shown in `vllm:cache_config_info` and `vllm:lora_requests_info`.
#[derive(Debug, Clone)]
pub struct ServerInfo {
    /// Served model name (`model_name` label).
    pub model_name: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Maximum number of LoRA adapters.
    pub max_loras: u32,
    /// The `prefix_caching_hash_algo` label (a vLLM value; informational).
    pub prefix_caching_hash_algo: String,
    /// The `engine` label: the engine's data-parallel rank (0 without data parallelism).
    pub engine: u32,
}

impl ServerInfo {
    /// The page of a fresh server (nothing served, nothing aborted) for `model_name` with
    /// 16-token blocks and sha256 hashes: what the tests check names and label escaping on.
    pub fn idle_page(model_name: &str, max_loras: u32) -> String {
        let info = ServerInfo {
            model_name: model_name.into(),
            block_size: 16,
            max_loras,
            prefix_caching_hash_algo: "sha256".into(),
            engine: 0,
        };
        render(
            &info,
            &EngineStats::default(),
            &LatencyHistograms::default(),
            0,
            1.0,
        )
    }
}

/// Formats like Python's `float.__repr__` for the common cases (`1.0`, `0.25`).
fn float(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// One `/metrics` page from the pages of a data-parallel server's engines, as vLLM's single
/// registry writes it: each metric family's `# HELP`/`# TYPE` once, then every engine's
/// samples (they differ by their `engine` label). A sample that is the same line in several
/// pages (a family without an `engine` label) is written once. The pages must come from
/// [`render`], so they list the same families in the same order.
pub fn merge_engine_pages(pages: &[String]) -> String {
    // A family: its comment lines and its sample lines, in page order.
    fn families(page: &str) -> Vec<(Vec<&str>, Vec<&str>)> {
        let mut out: Vec<(Vec<&str>, Vec<&str>)> = Vec::new();
        for line in page.lines() {
            if line.starts_with("# HELP ") || out.is_empty() {
                out.push((Vec::new(), Vec::new()));
            }
            let Some(family) = out.last_mut() else {
                continue;
            };
            if line.starts_with('#') {
                family.0.push(line);
            } else {
                family.1.push(line);
            }
        }
        out
    }
    let per_page: Vec<_> = pages.iter().map(|p| families(p)).collect();
    let mut out = String::with_capacity(pages.iter().map(String::len).sum());
    let count = per_page.first().map_or(0, Vec::len);
    for i in 0..count {
        let mut seen = std::collections::HashSet::new();
        for (n, page) in per_page.iter().enumerate() {
            let Some((comments, samples)) = page.get(i) else {
                continue;
            };
            if n == 0 {
                for c in comments {
                    let _ = writeln!(out, "{c}");
                }
            }
            for s in samples {
                if seen.insert(*s) {
                    let _ = writeln!(out, "{s}");
                }
            }
        }
    }
    out
}

/// Escapes a Prometheus label value.
pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, labels: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name}{{{labels}}} {}", float(value));
}

/// Renders the full `/metrics` page. `unix_now_s` stamps `vllm:lora_requests_info`.
pub fn render(
    info: &ServerInfo,
    stats: &EngineStats,
    hist: &LatencyHistograms,
    requests_aborted: u64,
    unix_now_s: f64,
) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // prometheus_client writes labels in declaration order: vLLM declares model_name, engine.
    let l = format!(
        "model_name=\"{}\",engine=\"{}\"",
        escape_label(&info.model_name),
        info.engine
    );
    let o = &mut out;
    metric(
        o,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &l,
        f64::from(stats.num_running),
    );
    metric(
        o,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &l,
        f64::from(stats.num_waiting),
    );
    metric(
        o,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &l,
        stats.kv_cache_usage,
    );
    metric(
        o,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &l,
        stats.prefix_cache_queries as f64,
    );
    metric(
        o,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &l,
        stats.prefix_cache_hits as f64,
    );
    metric(
        o,
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        &l,
        stats.num_preemptions as f64,
    );
    metric(
        o,
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &l,
        stats.prompt_tokens as f64,
    );
    metric(
        o,
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &l,
        stats.generation_tokens as f64,
    );

    let _ = writeln!(
        o,
        "# HELP vllm:request_success_total Count of successfully processed requests."
    );
    let _ = writeln!(o, "# TYPE vllm:request_success_total counter");
    // Every vLLM 0.33 FinishReason, in enum order.
    for (reason, n) in [
        ("stop", 0),
        ("length", stats.requests_finished),
        ("abort", requests_aborted),
        ("error", 0),
        ("repetition", 0),
    ] {
        let _ = writeln!(
            o,
            "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {}",
            float(n as f64)
        );
    }

    // The CacheConfig fields routers read, in vLLM's field order, then `engine` (vLLM adds it
    // last). Values are Python `str()`s of vLLM 0.33's defaults.
    let cache_labels = format!(
        "block_size=\"{}\",gpu_memory_utilization=\"0.92\",cache_dtype=\"auto\",\
         enable_prefix_caching=\"True\",prefix_caching_hash_algo=\"{}\",num_gpu_blocks=\"{}\",\
         num_cpu_blocks=\"None\",engine=\"{}\"",
        info.block_size,
        escape_label(&info.prefix_caching_hash_algo),
        stats.num_gpu_blocks,
        info.engine
    );
    metric(
        o,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        &cache_labels,
        1.0,
    );

    let join = |s: &std::collections::BTreeSet<String>| {
        escape_label(&s.iter().cloned().collect::<Vec<_>>().join(","))
    };
    let lora_labels = format!(
        "max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
        info.max_loras,
        join(&stats.running_loras),
        join(&stats.waiting_loras)
    );
    metric(
        o,
        "vllm:lora_requests_info",
        "gauge",
        "Running stats on lora requests.",
        &lora_labels,
        unix_now_s,
    );

    hist.ttft.render(
        o,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &l,
    );
    hist.itl.render(
        o,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &l,
    );
    hist.e2e.render(
        o,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &l,
    );
    hist.queue.render(
        o,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &l,
    );
    hist.prefill.render(
        o,
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        &l,
    );
    hist.prefill_computed.render(
        o,
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        &l,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut s = String::new();
        h.render(&mut s, "x", "help", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.1\"} 1\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"1.0\"} 2\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count{a=\"b\"} 3\n"));
        assert!(s.contains("x_sum{a=\"b\"} 5.55\n"));
    }

    #[test]
    fn page_has_vllm_names() {
        let page = ServerInfo::idle_page("m\"x", 4);
        for name in [
            "vllm:num_requests_running{model_name=\"m\\\"x\",engine=\"0\"} 0.0",
            "vllm:kv_cache_usage_perc{",
            "vllm:prefix_cache_hits_total{",
            "vllm:request_success_total{model_name=\"m\\\"x\",engine=\"0\",finished_reason=\"length\"}",
            "vllm:cache_config_info{block_size=\"16\"",
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"\"",
            "vllm:request_queue_time_seconds_bucket{",
        ] {
            assert!(page.contains(name), "missing {name}");
        }
    }
}
