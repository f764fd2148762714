//! An agent workload on the Responses API: each agent runs a tool-calling chain whose turns
//! send only `previous_response_id` and the new tool output, as the OpenAI Agents SDK and Codex
//! do with a server-side store. vLLM keeps stored responses in the memory of the replica that
//! answered (`VLLM_ENABLE_RESPONSES_API_STORE=1`), so a turn that reaches another replica fails
//! with 404; a client then retries, as the SDKs' retry policies do.
//!
//! Shared by `kvroute-demo --agent` (kvroute against round robin) and the end-to-end tests.

use std::time::{Duration, Instant};

use kvroute_harness::loadgen::{self, RequestError, TtftStats};
use kvroute_harness::{HttpClient, TextTable, percent};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::Serialize;
use serde_json::{Value, json};

/// Which turns of a chain stream their answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Streamed {
    /// Every turn (TTFT is the first output-text delta).
    All,
    /// Odd turns only, so both answer shapes carry the response id.
    Odd,
}

/// The agents and their chains.
#[derive(Debug, Clone, Serialize)]
pub struct AgentConfig {
    /// Model name in every request.
    pub model: String,
    /// Agents running concurrently, each one chain.
    pub agents: usize,
    /// Turns per chain.
    pub turns: usize,
    /// Words of each agent's task (its first turn).
    pub task_words: usize,
    /// Words of each later turn's input (a tool's output).
    pub tool_output_words: usize,
    /// `max_output_tokens` of each turn.
    pub max_output_tokens: u32,
    /// Which turns stream.
    pub streamed: Streamed,
    /// Pause between an agent's turns (running the tool).
    pub think_time: Duration,
    /// Delay between the starts of consecutive agents.
    pub stagger: Duration,
    /// Attempts of one turn before the chain is given up (the first plus retries).
    pub max_attempts: usize,
    /// Seeds the generated text.
    pub seed: u64,
    /// Limit for one request.
    pub request_timeout: Duration,
}

/// One turn of one chain.
#[derive(Debug, Clone, Serialize)]
pub struct TurnRecord {
    /// Agent index.
    pub agent: usize,
    /// Turn index (0-based).
    pub turn: usize,
    /// The replica that answered (`x-vllm-sim-replica`), when one did.
    pub replica: Option<String>,
    /// Time to the first output text (streamed), or to the whole answer, ms; of the attempt
    /// that succeeded.
    pub ttft_ms: Option<f64>,
    /// `usage.input_tokens_details.cached_tokens` of the answer.
    pub cached_tokens: u64,
    /// Attempts answered 404 (the previous response was not on the replica reached).
    pub failed_attempts: usize,
    /// Why the turn never succeeded, when it did not.
    pub error: Option<String>,
    /// The answer's response id.
    #[serde(skip)]
    pub response_id: Option<String>,
}

/// What one successful answer carried.
#[derive(Debug, Default)]
struct Answer {
    id: Option<String>,
    cached: u64,
    ttft_ms: Option<f64>,
    replica: Option<String>,
}

/// Turn `turn`'s body: the task first, then only the tool's output and the chain's link.
fn turn_body(cfg: &AgentConfig, agent: usize, turn: usize, previous: Option<&str>) -> Value {
    let mut rng = SmallRng::seed_from_u64(cfg.seed ^ ((agent as u64) << 20) ^ turn as u64);
    let input = if turn == 0 {
        loadgen::words(&mut rng, cfg.task_words)
    } else {
        format!(
            "tool output: {}",
            loadgen::words(&mut rng, cfg.tool_output_words)
        )
    };
    let stream = match cfg.streamed {
        Streamed::All => true,
        Streamed::Odd => turn % 2 == 1,
    };
    let mut body = json!({
        "model": cfg.model,
        "instructions": "You are a coding agent. Call tools, read their output, continue.",
        "input": input,
        "max_output_tokens": cfg.max_output_tokens,
        "stream": stream,
    });
    if let Some(id) = previous {
        body["previous_response_id"] = json!(id);
    }
    body
}

/// Reads an answer's id, cached tokens and first-output time from its JSON body or SSE events.
fn read_event(answer: &mut Answer, data: &str, started: Instant) {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return;
    };
    let response = v.get("response").unwrap_or(&v);
    if answer.id.is_none() {
        answer.id = response["id"].as_str().map(str::to_string);
    }
    if let Some(cached) = response
        .pointer("/usage/input_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
    {
        answer.cached = cached;
    }
    let delta = v["type"] == "response.output_text.delta";
    if answer.ttft_ms.is_none() && (delta || v.get("output").is_some()) {
        answer.ttft_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
    }
}

/// Sends one attempt of a turn.
async fn attempt(
    client: &HttpClient,
    base_url: &str,
    body: &Value,
    timeout: Duration,
) -> Result<Answer, RequestError> {
    let url = format!("{base_url}/v1/responses");
    let started = Instant::now();
    let mut answer = Answer::default();
    if body["stream"] == json!(true) {
        let sent = loadgen::stream_sse(client, &url, body, &[], |data| {
            read_event(&mut answer, data, started);
            Ok(())
        });
        answer.replica = tokio::time::timeout(timeout, sent)
            .await
            .map_err(|_| RequestError::Timeout(timeout))??;
    } else {
        let resp = client
            .post_json(&url, body, timeout)
            .await
            .map_err(|e| RequestError::Transport(e.to_string()))?;
        if resp.status != 200 {
            return Err(RequestError::Status {
                status: resp.status,
                body: resp.body.chars().take(300).collect(),
            });
        }
        read_event(&mut answer, &resp.body, started);
        answer.replica = resp
            .header(kvroute_harness::REPLICA_HEADER)
            .map(str::to_string);
    }
    if answer.id.is_none() {
        return Err(RequestError::BadStream("no response id".into()));
    }
    Ok(answer)
}

/// Runs agent `agent`'s chain: each turn is retried on a 404 up to `max_attempts`; a turn that
/// never succeeds (or fails otherwise) ends the chain. Turn `t` goes through
/// `proxies[t % proxies.len()]` (several proxies in front of one fleet).
pub async fn run_chain(
    client: &HttpClient,
    proxies: &[String],
    cfg: &AgentConfig,
    agent: usize,
) -> Vec<TurnRecord> {
    let mut records = Vec::with_capacity(cfg.turns);
    let mut previous: Option<String> = None;
    for turn in 0..cfg.turns {
        if turn > 0 {
            tokio::time::sleep(cfg.think_time).await;
        }
        let body = turn_body(cfg, agent, turn, previous.as_deref());
        let Some(base_url) = proxies.get(turn % proxies.len().max(1)) else {
            return records;
        };
        let mut record = TurnRecord {
            agent,
            turn,
            replica: None,
            ttft_ms: None,
            cached_tokens: 0,
            failed_attempts: 0,
            error: None,
            response_id: None,
        };
        for _ in 0..cfg.max_attempts.max(1) {
            match attempt(client, base_url, &body, cfg.request_timeout).await {
                Ok(answer) => {
                    record.replica = answer.replica;
                    record.ttft_ms = answer.ttft_ms;
                    record.cached_tokens = answer.cached;
                    record.response_id = answer.id;
                    record.error = None;
                    break;
                }
                Err(RequestError::Status { status: 404, body }) => {
                    record.failed_attempts += 1;
                    record.error = Some(format!("404: {body}"));
                }
                Err(e) => {
                    record.error = Some(e.to_string());
                    break;
                }
            }
        }
        previous = record.response_id.clone();
        let ended = record.error.is_some();
        records.push(record);
        if ended {
            break;
        }
    }
    records
}

/// Runs every agent's chain concurrently (starts `stagger` apart) against `base_url`.
pub async fn run_agents(base_url: &str, cfg: &AgentConfig) -> Vec<TurnRecord> {
    let client = HttpClient::new();
    let mut chains = tokio::task::JoinSet::new();
    for agent in 0..cfg.agents {
        let (client, base_url, cfg) = (client.clone(), base_url.to_string(), cfg.clone());
        chains.spawn(async move {
            tokio::time::sleep(cfg.stagger * agent as u32).await;
            run_chain(&client, &[base_url], &cfg, agent).await
        });
    }
    let mut records = Vec::new();
    while let Some(chain) = chains.join_next().await {
        // A panicked chain is a bug in this driver; its turns are simply missing.
        records.extend(chain.unwrap_or_default());
    }
    records.sort_by_key(|r| (r.agent, r.turn));
    records
}

/// One router's row of the agent table and entry of its `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentSummary {
    /// `kvroute` or `round-robin`.
    pub router: String,
    /// Turns that succeeded.
    pub turns_ok: usize,
    /// Turns the workload asked for (`agents x turns`).
    pub turns_planned: usize,
    /// Chains given up (a turn never found its previous response).
    pub chains_broken: usize,
    /// Attempts answered 404, over all attempts: how often a chain's link was lost.
    pub chain_failure_rate: f64,
    /// TTFT of the successful turns (first output text; the whole answer when not streamed),
    /// wall ms at the client.
    pub ttft_ms: TtftStats,
    /// Mean cached input tokens of the successful turns after the first.
    pub mean_cached_tokens: f64,
}

/// Summarises one run.
pub fn summarize(router: &str, cfg: &AgentConfig, records: &[TurnRecord]) -> AgentSummary {
    let ok: Vec<&TurnRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let failed: usize = records.iter().map(|r| r.failed_attempts).sum();
    let attempts = failed + ok.len();
    let later: Vec<f64> = ok
        .iter()
        .filter(|r| r.turn > 0)
        .map(|r| r.cached_tokens as f64)
        .collect();
    AgentSummary {
        router: router.to_string(),
        turns_ok: ok.len(),
        turns_planned: cfg.agents * cfg.turns,
        chains_broken: records.iter().filter(|r| r.error.is_some()).count(),
        chain_failure_rate: if attempts > 0 {
            failed as f64 / attempts as f64
        } else {
            0.0
        },
        ttft_ms: TtftStats::of(ok.iter().filter_map(|r| r.ttft_ms).collect()),
        mean_cached_tokens: if later.is_empty() {
            0.0
        } else {
            later.iter().sum::<f64>() / later.len() as f64
        },
    }
}

/// The comparison table.
pub fn render_table(rows: &[AgentSummary]) -> String {
    TextTable::new()
        .left("router", 12, |r: &AgentSummary| r.router.clone())
        .right("turns ok", 9, |r| {
            format!("{:>5}/{:<3}", r.turns_ok, r.turns_planned)
        })
        .right("broken", 7, |r| r.chains_broken.to_string())
        .right("404 attempts", 13, |r| percent(r.chain_failure_rate))
        .ttft_columns(9, |r| &r.ttft_ms)
        .right("cached/turn", 11, |r| {
            format!("{:.0}", r.mean_cached_tokens)
        })
        .render(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AgentConfig {
        AgentConfig {
            model: "m".into(),
            agents: 2,
            turns: 3,
            task_words: 10,
            tool_output_words: 4,
            max_output_tokens: 4,
            streamed: Streamed::Odd,
            think_time: Duration::ZERO,
            stagger: Duration::ZERO,
            max_attempts: 4,
            seed: 1,
            request_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn turns_link_to_their_previous_response_and_stream_as_asked() {
        let c = cfg();
        let first = turn_body(&c, 0, 0, None);
        assert!(first.get("previous_response_id").is_none());
        assert_eq!(first["stream"], json!(false));
        let second = turn_body(&c, 0, 1, Some("resp_1"));
        assert_eq!(second["previous_response_id"], json!("resp_1"));
        assert_eq!(second["stream"], json!(true));
        assert_ne!(turn_body(&c, 1, 0, None)["input"], first["input"]);
    }

    #[test]
    fn answers_are_read_from_json_and_events() {
        let t = Instant::now();
        let mut a = Answer::default();
        read_event(
            &mut a,
            r#"{"id":"resp_1","output":[],"usage":{"input_tokens_details":{"cached_tokens":7}}}"#,
            t,
        );
        assert_eq!((a.id.as_deref(), a.cached), (Some("resp_1"), 7));
        assert!(a.ttft_ms.is_some());
        let mut s = Answer::default();
        read_event(
            &mut s,
            r#"{"type":"response.created","response":{"id":"resp_2"}}"#,
            t,
        );
        assert!(s.ttft_ms.is_none());
        read_event(
            &mut s,
            r#"{"type":"response.output_text.delta","delta":"x"}"#,
            t,
        );
        read_event(
            &mut s,
            r#"{"type":"response.completed","response":{"id":"resp_2","usage":{"input_tokens_details":{"cached_tokens":9}}}}"#,
            t,
        );
        assert_eq!((s.id.as_deref(), s.cached), (Some("resp_2"), 9));
        assert!(s.ttft_ms.is_some());
    }

    #[test]
    fn summary_counts_lost_links_and_broken_chains() {
        let c = cfg();
        let ok = |turn, failed| TurnRecord {
            agent: 0,
            turn,
            replica: None,
            ttft_ms: Some(10.0 * (turn + 1) as f64),
            cached_tokens: 100,
            failed_attempts: failed,
            error: None,
            response_id: None,
        };
        let broken = TurnRecord {
            failed_attempts: 4,
            error: Some("404".into()),
            ..ok(2, 0)
        };
        let s = summarize("rr", &c, &[ok(0, 0), ok(1, 3), broken]);
        assert_eq!((s.turns_ok, s.turns_planned, s.chains_broken), (2, 6, 1));
        assert!((s.chain_failure_rate - 7.0 / 9.0).abs() < 1e-9);
        assert_eq!(s.mean_cached_tokens, 100.0);
        assert!(render_table(&[s]).contains("rr"));
    }
}
