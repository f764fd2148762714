//! Tokenisation cost per precise request, as the control plane itself measures it.
//!
//! A precise route's prompt is tokenised before it is scored, either in process (`hf`:
//! `tokenizer.json` + chat template, with a per-message-segment cache) or by a replica's render
//! API (`remote`, with a whole-prompt cache). This benchmark starts a one-replica fleet per
//! backend (KV events on, so precise scoring is live), posts route requests straight to the
//! control plane's `/v1/route`, and reads the control plane's own metrics before and after each
//! phase: `kvroute_tokenize_duration_seconds` (sum and count: the mean per request),
//! `kvroute_tokenized_tokens_total{source=cached|fresh}` (tokens and the cache's share).
//!
//! Two phases per backend: `multi-turn` (conversations whose turn N repeats turn N-1's messages
//! and adds an answer and a question; the hf segment cache only tokenises the new text) and
//! `cold` (every prompt new, of the same sizes as the multi-turn ones).
//!
//! The in-process tokenizer is a small byte-level BPE trained here (no download); a production
//! vocabulary (128k+ entries) costs more per token.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::SeedableRng as _;
use rand::rngs::SmallRng;
use serde::Serialize;
use serde_json::{Value, json};

use kvroute_harness::loadgen::words;
use kvroute_harness::{
    Fleet, FleetConfig, HarnessError, HttpClient, TextTable, Tools, percent, prometheus_sum,
    prometheus_sum_with,
};
use vllm_sim::tokenizer::{CHATML_JINJA, SPECIAL_TOKENS, train_byte_level_bpe};

/// What the `hf` rows measured, for `summary.json`.
pub const HF_TOKENIZER: &str =
    "byte-level BPE with a 2,000-token vocabulary trained in process, ChatML template";

/// Model name of the tokenisation benchmark's fleet and requests.
const MODEL: &str = "kvroute-bench-tokenize";

/// Why the tokenisation benchmark could not measure.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeBenchError {
    /// Starting or probing the fleet failed.
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// The tokenizer files could not be written.
    #[error("tokenizer files: {0}")]
    Files(String),
    /// The control plane did not tokenise as asked (errors, or no precise scoring).
    #[error("{0}")]
    Control(String),
}

/// The prompts of the benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeBenchConfig {
    /// Conversations of the multi-turn phase (and prompts of the cold phase, times `turns`).
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Words of each conversation's system prompt.
    pub system_words: usize,
    /// Words of each user message.
    pub user_words: usize,
    /// Words of each assistant answer put back into the history.
    pub answer_words: usize,
}

impl Default for TokenizeBenchConfig {
    fn default() -> Self {
        TokenizeBenchConfig {
            conversations: 16,
            turns: 6,
            system_words: 1_000,
            user_words: 150,
            answer_words: 100,
        }
    }
}

/// One backend x phase of the table and of `summary.json`'s `tokenize` object.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeRow {
    /// `hf` (in process) or `remote` (a replica's render API).
    pub backend: String,
    /// `multi-turn` or `cold`.
    pub phase: String,
    /// Tokenisations the control plane counted as `ok`.
    pub requests: u64,
    /// Mean tokenisation time per request, µs (the control plane's histogram sum / count).
    pub us_per_request: f64,
    /// Mean prompt tokens per request.
    pub tokens_per_request: f64,
    /// Prompt tokens per second of tokenisation time.
    pub tokens_per_s: f64,
    /// Share of the prompt tokens taken from the tokenisation cache.
    pub cache_hit_share: f64,
}

/// The counters read around a phase.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    seconds: f64,
    count: f64,
    ok: f64,
    cached: f64,
    fresh: f64,
}

fn read_counters(text: &str) -> Counters {
    let labelled = |name: &str, label: &str| prometheus_sum_with(text, name, label);
    Counters {
        seconds: prometheus_sum(text, "kvroute_tokenize_duration_seconds_sum"),
        count: prometheus_sum(text, "kvroute_tokenize_duration_seconds_count"),
        ok: labelled("kvroute_tokenizations_total", "result=\"ok\""),
        cached: labelled("kvroute_tokenized_tokens_total", "source=\"cached\""),
        fresh: labelled("kvroute_tokenized_tokens_total", "source=\"fresh\""),
    }
}

/// Builds a row from the counters before and after a phase.
fn row(backend: &str, phase: &str, before: Counters, after: Counters) -> TokenizeRow {
    let seconds = after.seconds - before.seconds;
    let count = after.count - before.count;
    let cached = after.cached - before.cached;
    let fresh = after.fresh - before.fresh;
    let tokens = cached + fresh;
    let per = |v: f64, d: f64| if d > 0.0 { v / d } else { 0.0 };
    let round = |v: f64, f: f64| (v * f).round() / f;
    TokenizeRow {
        backend: backend.to_string(),
        phase: phase.to_string(),
        requests: (after.ok - before.ok).max(0.0) as u64,
        us_per_request: round(per(seconds * 1e6, count), 10.0),
        tokens_per_request: round(per(tokens, count), 10.0),
        tokens_per_s: per(tokens, seconds).round(),
        cache_hit_share: round(per(cached, tokens), 1e4),
    }
}

/// Writes a byte-level BPE model directory (`tokenizer.json`, `tokenizer_config.json` with a
/// ChatML template) under `dir`.
pub fn write_model_dir(dir: &Path) -> Result<(), TokenizeBenchError> {
    let corpus_text: Vec<String> = (0..64)
        .map(|i| words(&mut SmallRng::seed_from_u64(9_000 + i), 200))
        .collect();
    let mut corpus: Vec<&str> = corpus_text.iter().map(String::as_str).collect();
    corpus.push("You are a helpful assistant. Conversation, question, answer, follow-up.");
    let json = train_byte_level_bpe(&corpus, 2_000, &SPECIAL_TOKENS)
        .map_err(|e| TokenizeBenchError::Files(e.to_string()))?;
    let io = |e: std::io::Error| TokenizeBenchError::Files(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("tokenizer.json"), json).map_err(io)?;
    let config = json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                        "chat_template": CHATML_JINJA});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).map_err(io)?;
    Ok(())
}

/// The messages of conversation `c` up to and including turn `turn`'s question; `salt` makes
/// every text distinct from other phases.
fn messages(cfg: &TokenizeBenchConfig, salt: u64, c: usize, turn: usize) -> Vec<Value> {
    let seed = |k: u64| salt.wrapping_mul(1_000_003) ^ ((c as u64) << 24) ^ k;
    let text = |k: u64, n: usize| words(&mut SmallRng::seed_from_u64(seed(k)), n);
    let mut m = vec![json!({"role": "system",
        "content": format!("Conversation {salt}-{c}. {}", text(0, cfg.system_words))})];
    for t in 0..=turn {
        m.push(json!({"role": "user", "content": text(1 + 2 * t as u64, cfg.user_words)}));
        if t < turn {
            m.push(
                json!({"role": "assistant", "content": text(2 + 2 * t as u64, cfg.answer_words)}),
            );
        }
    }
    m
}

/// Posts one precise route request for `messages` to the control plane.
async fn route(
    client: &HttpClient,
    url: &str,
    messages: Vec<Value>,
) -> Result<(), TokenizeBenchError> {
    let prompt = json!({"model": MODEL, "messages": messages});
    let body = json!({
        "model": MODEL,
        "block_hashes": [],
        "prompt_bytes": 0,
        "prompt_tokens": 0,
        "prompt_text": prompt.to_string(),
        "api": "chat",
    });
    let r = client
        .post_json(url, &body, Duration::from_secs(10))
        .await?;
    if r.status != 200 {
        return Err(TokenizeBenchError::Control(format!(
            "{url} answered {}: {}",
            r.status, r.body
        )));
    }
    Ok(())
}

/// Runs both phases against one backend; `precise` is the control plane's `precise:` section.
async fn run_backend(
    tools: &Tools,
    cfg: &TokenizeBenchConfig,
    backend: &str,
    precise: Value,
    sim_args: Vec<String>,
) -> Result<Vec<TokenizeRow>, TokenizeBenchError> {
    let mut fc = FleetConfig::new(&format!("bench-tokenize-{backend}"));
    fc.replicas = 1;
    fc.model = MODEL.to_string();
    fc.envoy_concurrency = 1;
    fc.kv_events = true;
    fc.sim_args = vec!["--profile".into(), "fast".into()];
    fc.sim_args.extend(sim_args);
    fc.control_plane_extra = json!({"precise": precise});
    let fleet = Fleet::start(fc, tools).await?;
    let cp = fleet
        .control_plane
        .as_ref()
        .ok_or_else(|| TokenizeBenchError::Control("no control plane".into()))?;
    let metrics_url = format!("http://{}/metrics", cp.admin_address);
    let route_url = format!("http://{}/v1/route", cp.api_address);
    let client = fleet.client().clone();
    let metrics = async || -> Result<String, TokenizeBenchError> {
        Ok(client.get(&metrics_url, Duration::from_secs(5)).await?.body)
    };
    // Precise scoring (and so tokenisation) starts once the replica's event stream is live.
    let live = format!(
        "kvroute_endpoint_events_live{{endpoint=\"{}\"}} ",
        fleet.replica_addresses()[0]
    );
    let is_live = |text: &str| {
        text.lines()
            .filter_map(|l| l.strip_prefix(&live))
            .any(|v| v.trim().parse::<f64>().ok() == Some(1.0))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !is_live(&metrics().await?) {
        if tokio::time::Instant::now() >= deadline {
            return Err(TokenizeBenchError::Control(format!(
                "the KV-event stream never went live ({})",
                fleet.describe()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut rows = Vec::new();
    // Multi-turn: conversation by conversation, turn after turn (as a chat arrives).
    let before = read_counters(&metrics().await?);
    for c in 0..cfg.conversations {
        for turn in 0..cfg.turns {
            route(&client, &route_url, messages(cfg, 1, c, turn)).await?;
        }
    }
    let after = read_counters(&metrics().await?);
    rows.push(row(backend, "multi-turn", before, after));
    // Cold: the same sizes, every prompt a conversation never seen.
    let before = after;
    for c in 0..cfg.conversations {
        for turn in 0..cfg.turns {
            let fresh = 2 + (c * cfg.turns + turn) as u64;
            route(&client, &route_url, messages(cfg, fresh, c, turn)).await?;
        }
    }
    let after = read_counters(&metrics().await?);
    rows.push(row(backend, "cold", before, after));
    let expected = (cfg.conversations * cfg.turns) as u64;
    if let Some(r) = rows.iter().find(|r| r.requests != expected) {
        return Err(TokenizeBenchError::Control(format!(
            "{backend} {}: {} of {expected} prompts tokenised ({})",
            r.phase,
            r.requests,
            fleet.describe()
        )));
    }
    Ok(rows)
}

/// Measures the `hf` and `remote` backends; `work_dir` receives the tokenizer files.
pub async fn run(
    tools: &Tools,
    cfg: &TokenizeBenchConfig,
    work_dir: &Path,
) -> Result<Vec<TokenizeRow>, TokenizeBenchError> {
    let dir: PathBuf = work_dir.join("tokenize-model");
    write_model_dir(&dir)?;
    let mut rows = run_backend(
        tools,
        cfg,
        "hf",
        json!({"tokenizer": "hf", "tokenizer_json": dir.join("tokenizer.json"),
               "tokenizer_config": dir.join("tokenizer_config.json")}),
        vec!["--tokenizer".into(), dir.display().to_string()],
    )
    .await?;
    rows.extend(
        run_backend(
            tools,
            cfg,
            "remote",
            json!({"tokenizer": "remote", "remote_api": "render", "tokenize_timeout_ms": 2000}),
            Vec::new(),
        )
        .await?,
    );
    Ok(rows)
}

/// The printed table.
pub fn render_table(rows: &[TokenizeRow]) -> String {
    TextTable::new()
        .left("backend", 8, |r: &TokenizeRow| r.backend.to_string())
        .left("phase", 11, |r| r.phase.to_string())
        .right("requests", 8, |r| r.requests.to_string())
        .right("µs/request", 12, |r| format!("{:.1}", r.us_per_request))
        .right("tokens/req", 11, |r| format!("{:.0}", r.tokens_per_request))
        .right("tokens/s", 12, |r| format!("{:.0}", r.tokens_per_s))
        .right("cache hit", 10, |r| percent(r.cache_hit_share))
        .render(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_diff_into_per_request_figures() {
        let before = read_counters(
            "kvroute_tokenize_duration_seconds_sum 1.0\n\
             kvroute_tokenize_duration_seconds_count 10\n\
             kvroute_tokenizations_total{backend=\"hf\",result=\"ok\"} 10\n\
             kvroute_tokenized_tokens_total{backend=\"hf\",source=\"fresh\"} 1000\n",
        );
        let after = read_counters(
            "kvroute_tokenize_duration_seconds_sum 1.002\n\
             kvroute_tokenize_duration_seconds_count 14\n\
             kvroute_tokenizations_total{backend=\"hf\",result=\"ok\"} 14\n\
             kvroute_tokenizations_total{backend=\"hf\",result=\"error\"} 3\n\
             kvroute_tokenized_tokens_total{backend=\"hf\",source=\"cached\"} 300\n\
             kvroute_tokenized_tokens_total{backend=\"hf\",source=\"fresh\"} 1100\n",
        );
        let r = row("hf", "multi-turn", before, after);
        assert_eq!(r.requests, 4);
        assert_eq!(r.us_per_request, 500.0);
        assert_eq!(r.tokens_per_request, 100.0);
        assert_eq!(r.tokens_per_s, 200_000.0);
        assert_eq!(r.cache_hit_share, 0.75);
    }

    #[test]
    fn multi_turn_histories_extend_the_previous_turn() {
        let cfg = TokenizeBenchConfig::default();
        let t1 = messages(&cfg, 1, 3, 1);
        let t2 = messages(&cfg, 1, 3, 2);
        assert_eq!(&t2[..t1.len()], &t1[..], "turn 2 repeats turn 1");
        assert_eq!(t2.len(), t1.len() + 2);
        assert_ne!(
            messages(&cfg, 2, 3, 1)[0],
            t1[0],
            "another salt, another text"
        );
    }
}
