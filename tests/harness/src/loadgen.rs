//! A multi-turn chat workload driver with a streaming (SSE) reader.
//!
//! Every conversation shares one long system prompt, opens with its own long first message (a
//! "document" to discuss) and then asks short follow-ups. Each turn appends the assistant's
//! streamed answer to the history, so turn N+1 repeats turn N as its prefix: exactly the
//! traffic where routing to the replica that already holds that prefix pays off.
//!
//! Per request it measures TTFT (first chunk with content), end-to-end time and output tokens
//! (from `usage`), all in wall-clock milliseconds at the client.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

use crate::{HttpClient, TextTable, percent};

/// Why one request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestError {
    /// Connection or protocol failure.
    #[error("transport: {0}")]
    Transport(String),
    /// A non-200 answer.
    #[error("status {status}: {body}")]
    Status {
        /// HTTP status.
        status: u16,
        /// Start of the body.
        body: String,
    },
    /// The stream did not finish in time.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The stream was malformed or ended without `[DONE]`.
    #[error("bad stream: {0}")]
    BadStream(String),
}

/// What one streamed chat completion produced.
#[derive(Debug, Clone, Default)]
pub struct StreamOutcome {
    /// The assistant's text, concatenated from the deltas.
    pub text: String,
    /// Time to the first chunk with content, in ms.
    pub ttft_ms: Option<f64>,
    /// Time to the end of the stream, in ms.
    pub e2e_ms: f64,
    /// `usage.completion_tokens` (or the number of content chunks without usage).
    pub output_tokens: u64,
    /// `usage.prompt_tokens`, when reported.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// The `x-vllm-sim-replica` response header.
    pub replica: Option<String>,
}

/// Sends `body` as a streaming chat completion to `base_url` and reads the SSE stream to the end.
pub async fn stream_chat(
    client: &HttpClient,
    base_url: &str,
    body: &Value,
    extra_headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<StreamOutcome, RequestError> {
    let started = Instant::now();
    let fut = stream_chat_inner(client, base_url, body, extra_headers, started);
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| RequestError::Timeout(timeout))?
}

async fn stream_chat_inner(
    client: &HttpClient,
    base_url: &str,
    body: &Value,
    extra_headers: &[(&str, &str)],
    started: Instant,
) -> Result<StreamOutcome, RequestError> {
    let url = format!("{base_url}/v1/chat/completions");
    let mut out = StreamOutcome::default();
    let mut content_chunks = 0u64;
    let mut done = false;
    out.replica = stream_sse(client, &url, body, extra_headers, |event| {
        if event == "[DONE]" {
            done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(event)
            .map_err(|e| RequestError::BadStream(format!("{e}: {event:.200}")))?;
        if let Some(err) = v.get("error") {
            return Err(RequestError::BadStream(format!("error event: {err}")));
        }
        if let Some(content) = v
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
        {
            if out.ttft_ms.is_none() {
                out.ttft_ms = Some(ms(started.elapsed()));
            }
            content_chunks += 1;
            out.text.push_str(content);
        }
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
            out.output_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
            out.prompt_tokens = usage["prompt_tokens"].as_u64();
            out.cached_tokens = usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64);
        }
        Ok(())
    })
    .await?;
    if !done {
        return Err(RequestError::BadStream(
            "stream ended without [DONE]".into(),
        ));
    }
    if out.output_tokens == 0 {
        out.output_tokens = content_chunks;
    }
    out.e2e_ms = ms(started.elapsed());
    Ok(out)
}

/// POSTs `body` to `url` asking for an SSE stream and hands each event's `data` to `on_event`
/// as it arrives (any API: chat, Responses, Anthropic Messages). A non-200 answer is
/// [`RequestError::Status`]. Returns the `x-vllm-sim-replica` header.
pub async fn stream_sse(
    client: &HttpClient,
    url: &str,
    body: &Value,
    extra_headers: &[(&str, &str)],
    mut on_event: impl FnMut(&str) -> Result<(), RequestError>,
) -> Result<Option<String>, RequestError> {
    let mut builder = hyper::Request::builder()
        .method("POST")
        .uri(url)
        .header("content-type", "application/json")
        .header("accept", "text/event-stream");
    for (k, v) in extra_headers {
        builder = builder.header(*k, *v);
    }
    let req = builder
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| RequestError::Transport(e.to_string()))?;
    let resp = client
        .hyper()
        .request(req)
        .await
        .map_err(|e| RequestError::Transport(format!("{e:?}")))?;
    let status = resp.status().as_u16();
    let replica = crate::replica_from_headers(resp.headers());
    let mut body = resp.into_body();
    if status != 200 {
        let bytes = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        return Err(RequestError::Status {
            status,
            body: text.chars().take(300).collect(),
        });
    }
    let mut parser = SseParser::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| RequestError::Transport(e.to_string()))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for event in parser.push(data) {
            on_event(&event)?;
        }
    }
    Ok(replica)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Incremental Server-Sent-Events parser: feed bytes, get the `data:` payload of complete events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Appends bytes and returns the data of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        loop {
            // An event ends at a blank line (LF LF or CRLF CRLF).
            let end = find(&self.buf, b"\n\n")
                .map(|i| (i, 2))
                .into_iter()
                .chain(find(&self.buf, b"\r\n\r\n").map(|i| (i, 4)))
                .min_by_key(|(i, _)| *i);
            let Some((i, sep)) = end else { break };
            let raw: Vec<u8> = self.buf.drain(..i + sep).collect();
            let text = String::from_utf8_lossy(&raw[..i]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Shape of the multi-turn workload.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// Model name in every request.
    pub model: String,
    /// Conversations run concurrently.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Words in the shared system prompt (a word is about one token).
    pub system_prompt_words: usize,
    /// Words in each conversation's first user message.
    pub first_message_words: usize,
    /// Words in each follow-up user message.
    pub followup_words: usize,
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// Seeds the generated text (same seed = same workload).
    pub seed: u64,
    /// Pause between a conversation's turns (a user reading the answer).
    pub think_time: Duration,
    /// Delay between the starts of consecutive conversations.
    pub stagger: Duration,
    /// Limit for one request, stream included.
    pub request_timeout: Duration,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            model: "kvroute-demo-model".to_string(),
            conversations: 32,
            turns: 4,
            system_prompt_words: 2000,
            first_message_words: 1000,
            followup_words: 60,
            max_tokens: 48,
            seed: 7,
            think_time: Duration::from_millis(100),
            stagger: Duration::from_millis(30),
            request_timeout: Duration::from_secs(60),
        }
    }
}

const WORDS: &[&str] = &[
    "cache", "prefix", "token", "replica", "router", "latency", "prompt", "model", "queue",
    "batch", "decode", "prefill", "memory", "block", "hash", "envoy", "filter", "stream",
    "request", "answer", "history", "context", "system", "policy", "budget", "signal", "metric",
    "kernel", "tensor", "layer", "vector", "weight", "scale", "shard", "node", "fleet", "load",
    "score", "event", "index", "entry", "bucket", "window", "limit", "quota", "retry", "fault",
    "health", "probe", "route",
];

/// `n` pseudo-random words from `rng`.
pub fn words(rng: &mut SmallRng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

impl Workload {
    /// The shared system prompt.
    pub fn system_prompt(&self) -> String {
        let mut rng = SmallRng::seed_from_u64(self.seed);
        format!(
            "You are a helpful assistant for an inference platform team. Reference manual: {}",
            words(&mut rng, self.system_prompt_words)
        )
    }

    /// User message of `turn` (0-based) in conversation `conversation`.
    pub fn user_message(&self, conversation: usize, turn: usize) -> String {
        let mut rng = SmallRng::seed_from_u64(
            self.seed ^ ((conversation as u64 + 1) << 20) ^ ((turn as u64 + 1) << 40),
        );
        if turn == 0 {
            format!(
                "Conversation {conversation}. Please study this incident report: {}",
                words(&mut rng, self.first_message_words)
            )
        } else {
            format!(
                "Follow-up {turn} of conversation {conversation}: {}?",
                words(&mut rng, self.followup_words)
            )
        }
    }

    /// The request body for a history of messages.
    pub fn request_body(&self, messages: &[Value]) -> Value {
        json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    /// Number of requests the workload sends.
    pub fn total_requests(&self) -> usize {
        self.conversations * self.turns
    }
}

/// One request's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Conversation index.
    pub conversation: usize,
    /// Turn index (0-based).
    pub turn: usize,
    /// When the request was sent, ms after the run started (orders records like the router's
    /// decisions, to pair each prediction with its outcome).
    pub sent_ms: f64,
    /// Time to first content chunk, ms (None on error or empty answer).
    pub ttft_ms: Option<f64>,
    /// End-to-end time, ms.
    pub e2e_ms: f64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Cached prompt tokens reported by the replica, when given.
    pub cached_tokens: Option<u64>,
    /// Prompt tokens reported by the replica, when given.
    pub prompt_tokens: Option<u64>,
    /// Replica that served the request.
    pub replica: Option<String>,
    /// Error text, when the request failed.
    pub error: Option<String>,
}

impl RequestRecord {
    /// A request that got no answer, measured as nothing but its `error`: a failed request and
    /// a conversation task that died are recorded alike.
    fn failed(conversation: usize, turn: usize, sent_ms: f64, error: String) -> Self {
        Self {
            conversation,
            turn,
            sent_ms,
            ttft_ms: None,
            e2e_ms: 0.0,
            output_tokens: 0,
            cached_tokens: None,
            prompt_tokens: None,
            replica: None,
            error: Some(error),
        }
    }
}

/// The result of a workload run.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Every request, in completion order.
    pub records: Vec<RequestRecord>,
    /// Wall time of the whole run.
    pub wall: Duration,
}

/// Runs the workload against `base_url`; `progress(done, total)` is called after each request.
pub async fn run_workload<P>(base_url: &str, workload: &Workload, progress: P) -> RunResult
where
    P: Fn(usize, usize) + Send + Sync + 'static,
{
    let client = HttpClient::new();
    let workload = Arc::new(workload.clone());
    let progress = Arc::new(progress);
    let done = Arc::new(AtomicUsize::new(0));
    let system = Arc::new(workload.system_prompt());
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..workload.conversations {
        let client = client.clone();
        let workload = workload.clone();
        let progress = progress.clone();
        let done = done.clone();
        let system = system.clone();
        let base_url = base_url.to_string();
        tasks.spawn(async move {
            tokio::time::sleep(workload.stagger * c as u32).await;
            let mut history = vec![json!({"role": "system", "content": system.as_str()})];
            let mut records = Vec::with_capacity(workload.turns);
            for turn in 0..workload.turns {
                history.push(json!({"role": "user", "content": workload.user_message(c, turn)}));
                let body = workload.request_body(&history);
                let sent_ms = started.elapsed().as_secs_f64() * 1e3;
                let result =
                    stream_chat(&client, &base_url, &body, &[], workload.request_timeout).await;
                let record = match result {
                    Ok(o) => {
                        history.push(json!({"role": "assistant", "content": o.text}));
                        RequestRecord {
                            conversation: c,
                            turn,
                            sent_ms,
                            ttft_ms: o.ttft_ms,
                            e2e_ms: o.e2e_ms,
                            output_tokens: o.output_tokens,
                            cached_tokens: o.cached_tokens,
                            prompt_tokens: o.prompt_tokens,
                            replica: o.replica,
                            error: None,
                        }
                    }
                    Err(e) => {
                        // Keep the conversation going with a placeholder answer.
                        history.push(json!({"role": "assistant", "content": "(no answer)"}));
                        RequestRecord::failed(c, turn, sent_ms, e.to_string())
                    }
                };
                records.push(record);
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                progress(n, workload.total_requests());
                if turn + 1 < workload.turns {
                    tokio::time::sleep(workload.think_time).await;
                }
            }
            records
        });
    }
    let mut records = Vec::with_capacity(workload.total_requests());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(r) => records.extend(r),
            Err(e) => records.push(RequestRecord::failed(
                usize::MAX,
                0,
                0.0,
                format!("conversation task failed: {e}"),
            )),
        }
    }
    RunResult {
        records,
        wall: started.elapsed(),
    }
}

/// Percentiles of TTFT, as in `summary.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TtftStats {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl TtftStats {
    /// The percentiles of `values` (any order), rounded to 0.01 ms.
    pub fn of(mut values: Vec<f64>) -> TtftStats {
        values.sort_by(f64::total_cmp);
        TtftStats {
            p50: round_to(percentile(&values, 50.0), 2),
            p90: round_to(percentile(&values, 90.0), 2),
            p99: round_to(percentile(&values, 99.0), 2),
        }
    }
}

/// Percentiles of end-to-end time, as in `summary.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct E2eStats {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// One row of the demo table and one entry of `summary.json` (field names are the contract).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// `kvroute` or `round-robin`.
    pub router: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// TTFT percentiles over successful requests, wall ms at the client.
    pub ttft_ms: TtftStats,
    /// End-to-end percentiles over successful requests, wall ms at the client.
    pub e2e_ms: E2eStats,
    /// Output tokens of the run divided by its wall time.
    pub output_tokens_per_s: f64,
    /// Fleet-wide `prefix_cache_hits / prefix_cache_queries` from the replicas' metrics.
    pub prefix_cache_hit_rate: f64,
    /// kvroute's four fleet numbers for the run (absent for routers that have none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_numbers: Option<FleetNumbers>,
}

/// kvroute's four fleet numbers, each a share of the prompt tokens of the outcomes that
/// reported cached tokens (the control plane's `kvroute_pool_*` counters, summed over pools):
/// the reuse the traffic offered, what the router aimed for, what the engines delivered, and
/// the gap by the reason the router attributes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetNumbers {
    /// Prompt tokens the shares are of.
    pub prompt_tokens: f64,
    /// Reuse available in the traffic (the ceiling).
    pub available: f64,
    /// Reuse the router aimed for (predicted cached tokens of the chosen endpoints).
    pub aimed: f64,
    /// Reuse the engines delivered (their `cached_tokens`).
    pub delivered: f64,
    /// Available reuse not delivered, by reason (`load_spill`, `eviction`, `mismatch`, ...).
    pub gap: std::collections::BTreeMap<String, f64>,
}

impl FleetNumbers {
    /// Reads them from a control plane's `/metrics` text; `None` before any outcome counted.
    pub fn from_metrics(text: &str) -> Option<FleetNumbers> {
        let sum = |name: &str| crate::prometheus_sum_with(text, name, "");
        let prompt_tokens = sum("kvroute_pool_served_prompt_tokens_total");
        if prompt_tokens <= 0.0 {
            return None;
        }
        let share = |tokens: f64| round_to(tokens / prompt_tokens, 4);
        let mut gap = std::collections::BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("kvroute_pool_reuse_gap_tokens_total{") else {
                continue;
            };
            let reason = rest
                .split("reason=\"")
                .nth(1)
                .and_then(|r| r.split('"').next());
            let value = line
                .rsplit_once(' ')
                .and_then(|(_, v)| v.trim().parse::<f64>().ok());
            if let (Some(reason), Some(value)) = (reason, value) {
                *gap.entry(reason.to_string()).or_insert(0.0) += value;
            }
        }
        Some(FleetNumbers {
            prompt_tokens,
            available: share(sum("kvroute_pool_reuse_available_tokens_total")),
            aimed: share(sum("kvroute_pool_reuse_aimed_tokens_total")),
            delivered: share(sum("kvroute_pool_served_cached_tokens_total")),
            gap: gap.into_iter().map(|(k, v)| (k, share(v))).collect(),
        })
    }
}

/// `summary.json` of the demo: `{"runs":[RunSummary, ...]}`, fields in contract order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoSummary {
    /// One entry per router, kvroute first.
    pub runs: Vec<RunSummary>,
}

fn round_to(v: f64, decimals: i32) -> f64 {
    let f = 10f64.powi(decimals);
    (v * f).round() / f
}

/// Nearest-rank percentile of sorted values (0 for an empty slice).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[nearest_rank_index(sorted.len(), p)]
}

/// The index of the `p`-th nearest-rank percentile among `len` sorted values (`len` at least
/// 1): what [`percentile`] reads, for callers that select it without sorting.
pub fn nearest_rank_index(len: usize, p: f64) -> usize {
    let rank = ((p / 100.0) * len as f64).ceil() as usize;
    rank.clamp(1, len) - 1
}

/// Summarises a run; `prefix_cache_hit_rate` comes from the replicas, not the client.
pub fn summarize(router: &str, run: &RunResult, prefix_cache_hit_rate: f64) -> RunSummary {
    let ok: Vec<&RequestRecord> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    e2e.sort_by(f64::total_cmp);
    let tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let secs = run.wall.as_secs_f64();
    RunSummary {
        router: router.to_string(),
        requests: run.records.len(),
        errors: run.records.len() - ok.len(),
        ttft_ms: TtftStats::of(ttft),
        e2e_ms: E2eStats {
            p50: round_to(percentile(&e2e, 50.0), 2),
            p99: round_to(percentile(&e2e, 99.0), 2),
        },
        output_tokens_per_s: round_to(tokens as f64 / secs.max(1e-9), 2),
        prefix_cache_hit_rate: round_to(prefix_cache_hit_rate, 4),
        fleet_numbers: None,
    }
}

/// Whole milliseconds with their unit, `123ms`: the tables' latency cells.
fn whole_ms(v: f64) -> String {
    format!("{v:.0}ms")
}

impl<'a, R> TextTable<'a, R> {
    /// Right-aligned `TTFT p50`, `TTFT p90` and `TTFT p99` columns of `width` from the row's
    /// [`TtftStats`]: the latency every demo table shows.
    pub fn ttft_columns(self, width: usize, ttft: impl Fn(&R) -> &TtftStats + Copy + 'a) -> Self {
        self.right("TTFT p50", width, move |r| whole_ms(ttft(r).p50))
            .right("TTFT p90", width, move |r| whole_ms(ttft(r).p90))
            .right("TTFT p99", width, move |r| whole_ms(ttft(r).p99))
    }
}

/// The demo's one table.
pub fn render_table(rows: &[RunSummary]) -> String {
    TextTable::new()
        .left("router", 12, |r: &RunSummary| r.router.clone())
        .right("requests", 8, |r| r.requests.to_string())
        .right("errors", 6, |r| r.errors.to_string())
        .ttft_columns(10, |r| &r.ttft_ms)
        .right("e2e p50", 10, |r| whole_ms(r.e2e_ms.p50))
        .right("e2e p99", 10, |r| whole_ms(r.e2e_ms.p99))
        .right("out tok/s", 10, |r| format!("{:.1}", r.output_tokens_per_s))
        .right("prefix hit", 10, |r| percent(r.prefix_cache_hit_rate))
        .render(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_handles_split_frames_and_crlf() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(p.push(b"1}\n\ndata: [DONE]\n"), vec!["{\"a\":1}"]);
        assert_eq!(p.push(b"\n"), vec!["[DONE]"]);
        assert_eq!(p.push(b": comment\r\n\r\ndata:x\r\n\r\n"), vec!["x"]);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn workload_is_deterministic_and_turns_differ() {
        let w = Workload::default();
        assert_eq!(w.system_prompt(), w.system_prompt());
        assert_eq!(w.user_message(3, 1), w.user_message(3, 1));
        assert_ne!(w.user_message(3, 1), w.user_message(4, 1));
        assert_ne!(w.user_message(3, 0), w.user_message(3, 1));
        assert!(w.system_prompt().split(' ').count() >= 2000);
    }

    #[test]
    fn summary_counts_errors_and_serialises_the_contract_fields() {
        let rec = |ttft: Option<f64>, err: Option<&str>| RequestRecord {
            conversation: 0,
            turn: 0,
            sent_ms: 0.0,
            ttft_ms: ttft,
            e2e_ms: 100.0,
            output_tokens: 10,
            cached_tokens: None,
            prompt_tokens: None,
            replica: None,
            error: err.map(str::to_string),
        };
        let run = RunResult {
            records: vec![rec(Some(5.0), None), rec(None, Some("boom"))],
            wall: Duration::from_secs(2),
        };
        let s = summarize("kvroute", &run, 0.5);
        assert_eq!((s.requests, s.errors), (2, 1));
        assert_eq!(s.output_tokens_per_s, 5.0);
        let v = serde_json::to_value(&s).unwrap();
        for key in [
            "router",
            "requests",
            "errors",
            "ttft_ms",
            "e2e_ms",
            "output_tokens_per_s",
            "prefix_cache_hit_rate",
        ] {
            assert!(v.get(key).is_some(), "{key}");
        }
        assert!(v["ttft_ms"].get("p90").is_some());
        let text = serde_json::to_string(&DemoSummary {
            runs: vec![s.clone()],
        })
        .unwrap();
        assert!(
            text.starts_with(
                r#"{"runs":[{"router":"kvroute","requests":2,"errors":1,"ttft_ms":{"p50":5.0,"#
            ),
            "{text}"
        );
        assert!(render_table(&[s]).contains("kvroute"));
    }

    #[test]
    fn fleet_numbers_are_shares_of_the_served_prompt_tokens() {
        let text = "# HELP kvroute_pool_served_prompt_tokens ...\n\
            kvroute_pool_served_prompt_tokens_total{pool=\"a\"} 600\n\
            kvroute_pool_served_prompt_tokens_total{pool=\"b\"} 400\n\
            kvroute_pool_reuse_available_tokens_total{pool=\"a\"} 800\n\
            kvroute_pool_reuse_aimed_tokens_total{pool=\"a\"} 700\n\
            kvroute_pool_served_cached_tokens_total{pool=\"a\"} 650\n\
            kvroute_pool_reuse_gap_tokens_total{pool=\"a\",reason=\"eviction\"} 100\n\
            kvroute_pool_reuse_gap_tokens_total{pool=\"b\",reason=\"eviction\"} 20\n\
            kvroute_pool_reuse_gap_tokens_total{pool=\"a\",reason=\"load_spill\"} 30\n";
        let n = FleetNumbers::from_metrics(text).unwrap();
        assert_eq!(n.prompt_tokens, 1000.0);
        assert_eq!((n.available, n.aimed, n.delivered), (0.8, 0.7, 0.65));
        assert_eq!(n.gap["eviction"], 0.12);
        assert_eq!(n.gap["load_spill"], 0.03);
        assert_eq!(FleetNumbers::from_metrics("kvroute_up 1\n"), None);
    }
}
