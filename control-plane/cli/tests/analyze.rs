//! `kvroute-analyze` as a user runs it: OpenAI bodies and Mooncake traces in, a readable table
//! on stdout, progress on stderr, an SVG chart and JSON on disk, clear errors for bad input.

// An integration test: its helpers may unwrap (the product's ban is for product code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-analyze");
/// Generous for a debug build on a busy 2-core machine; the inputs here take well under a second.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// A fresh directory under the target dir for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("analyze-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvroute-analyze starts");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            panic!("kvroute-analyze {args:?} did not finish within {RUN_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// Runs `kvroute-analyze` with `args`, asserts it succeeded (showing its stderr if not) and
/// returns its stdout and stderr: every test of a good input starts this way.
fn run_ok(args: &[&str]) -> (String, String) {
    let out = run(args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    (stdout, stderr)
}

/// A chat log where every conversation shares one long system prompt.
fn chat_log(path: &Path) {
    let system = "You are a careful assistant for the kvroute project. ".repeat(60);
    let mut lines = Vec::new();
    for i in 0..24 {
        let body = json!({
            "model": "m",
            "max_tokens": 16,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("Question number {i}: what is a prefix cache?")},
            ],
        });
        // Half the lines carry an arrival time, half get one from --rps.
        let line = if i % 2 == 0 {
            json!({"timestamp": i * 100, "body": body})
        } else {
            body
        };
        lines.push(line.to_string());
    }
    lines.push(
        json!({"model": "m", "prompt": "a completions request", "max_tokens": 4}).to_string(),
    );
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn openai_bodies_show_sharing_and_both_policies() {
    let dir = scratch("openai");
    let log = dir.join("requests.jsonl");
    chat_log(&log);
    let svg = dir.join("chart.svg");
    let report = dir.join("report.json");
    let (stdout, stderr) = run_ok(&[
        log.to_str().unwrap(),
        "--replicas",
        "2",
        "--kv-capacity-tokens",
        "100000",
        "--svg",
        svg.to_str().unwrap(),
        "--json",
        report.to_str().unwrap(),
    ]);
    assert!(
        stderr.contains("simulating kvroute on 2 replicas"),
        "{stderr}"
    );
    assert!(stdout.contains("prefix sharing"), "{stdout}");
    for policy in ["round-robin", "kvroute"] {
        assert!(
            stdout.lines().any(|l| l.contains(&format!(" {policy} "))),
            "no {policy} row:\n{stdout}"
        );
    }

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let sharing = &report["sharing"];
    assert_eq!(sharing["requests"], 25);
    // 24 of 25 requests repeat a ~3,000-byte system prompt: most of the prompt text is reusable.
    let potential = sharing["potential"].as_f64().unwrap();
    assert!(potential > 0.7 && potential < 1.0, "{sharing:#}");
    assert_eq!(sharing["requests_with_reuse"], 23);
    let fleets = report["fleets"].as_array().unwrap();
    assert_eq!(fleets.len(), 2);
    for f in fleets {
        assert_eq!(f["replicas"], 2);
        assert_eq!(f["kv_capacity_tokens"], 100_000);
        assert_eq!(f["requests"], 25, "{f:#}");
        let hit = f["prefix_hit_rate"].as_f64().unwrap();
        assert!(
            hit <= potential + 1e-9,
            "hit rate {hit} above the ceiling {potential}"
        );
    }
    let kv = fleets.iter().find(|f| f["policy"] == "kvroute").unwrap();
    let rr = fleets
        .iter()
        .find(|f| f["policy"] == "round-robin")
        .unwrap();
    assert!(
        kv["prefix_hit_rate"].as_f64() >= rr["prefix_hit_rate"].as_f64(),
        "{fleets:#?}"
    );
    // kvroute's own fleet numbers: its window saw the shared system prompt, its router aimed
    // at it, and the gap is what it did not deliver; the peers have none.
    let reuse = &kv["reuse"];
    let tokens = |k: &str| reuse[k].as_u64().unwrap();
    assert!(tokens("available_tokens") > 0, "{reuse:#}");
    assert!(tokens("aimed_tokens") > 0, "{reuse:#}");
    let gap: u64 = reuse["gap_tokens"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert!(
        gap >= tokens("available_tokens").saturating_sub(tokens("delivered_tokens")),
        "{reuse:#}"
    );
    assert!(rr.get("reuse").is_none(), "{rr:#}");
    let header = stdout.lines().find(|l| l.contains("hit_rate")).unwrap();
    assert!(
        header.contains("avail") && header.contains("spill"),
        "{header}"
    );

    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.contains("TTFT CDF"),
        "{chart}"
    );
}

// An agent's log: Messages and Responses bodies, told apart by the path beside each.
#[test]
fn agent_bodies_are_read_by_their_path() {
    let dir = scratch("agent");
    let log = dir.join("requests.jsonl");
    let tools = "You are a coding agent with these tools: read, edit, run. ".repeat(50);
    let mut lines = Vec::new();
    for i in 0..12 {
        let (path, body) = if i % 2 == 0 {
            (
                "/v1/messages",
                json!({"model": "m", "max_tokens": 32000, "system": tools,
                       "messages": [{"role": "user", "content": [{"type": "text", "text": format!("task {i}")}]}]}),
            )
        } else {
            (
                "/v1/responses",
                json!({"model": "m", "instructions": tools, "input": format!("task {i}")}),
            )
        };
        lines.push(json!({"timestamp": i * 100, "path": path, "body": body}).to_string());
    }
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();
    let report = dir.join("report.json");
    let (stdout, _) = run_ok(&[
        log.to_str().unwrap(),
        "--no-sim",
        "--json",
        report.to_str().unwrap(),
    ]);
    assert!(stdout.contains("prefix sharing"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    // Each API's requests share its long tool prompt.
    assert_eq!(report["sharing"]["requests"], 12);
    assert!(
        report["sharing"]["requests_with_reuse"].as_u64().unwrap() >= 10,
        "{report:#}"
    );
}

#[test]
fn mooncake_trace_over_several_fleet_sizes_draws_both_charts() {
    let dir = scratch("mooncake");
    let trace = dir.join("trace.jsonl");
    let mut lines = Vec::new();
    for i in 0..30u64 {
        // Three documents of four 512-token blocks; each request adds a block of its own.
        let doc = i % 3;
        let ids: Vec<u64> = (0..4).map(|b| doc * 100 + b).chain([1_000 + i]).collect();
        lines.push(
            json!({"timestamp": i * 200, "input_length": 2_400, "output_length": 8, "hash_ids": ids})
                .to_string(),
        );
    }
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let svg = dir.join("fleet.svg");
    let (stdout, _) = run_ok(&[
        trace.to_str().unwrap(),
        "--replicas",
        "1,3",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    // 27 of 30 requests find their document's 2,048 tokens (minus nothing: whole blocks).
    assert!(
        stdout.contains("requests            30 (27 reuse"),
        "{stdout}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.contains(" kvroute ") || l.contains(" round-robin "))
            .count(),
        4,
        "{stdout}"
    );
    let ttft = std::fs::read_to_string(&svg).unwrap();
    assert!(ttft.contains("TTFT p50 against fleet size"), "{ttft}");
    let hits = std::fs::read_to_string(dir.join("fleet-hit-rate.svg")).unwrap();
    assert!(hits.contains("perfect routing"), "{hits}");
}

#[test]
fn generator_without_sharing_says_routing_cannot_help() {
    let (stdout, _) = run_ok(&["no-sharing:requests=40,input=500", "--no-sim"]);
    assert!(stdout.contains("prefix sharing      0.0%"), "{stdout}");
    assert!(stdout.contains("cannot help"), "{stdout}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = scratch("bad");
    let cases: Vec<(String, Vec<String>, &str)> = vec![
        (
            "{\"model\":\"m\",\"prompt\":\"fine\"}\nnot json\n".into(),
            vec![],
            "requests.jsonl:2:",
        ),
        (
            "{\"model\":\"m\",\"input\":\"embeddings\"}\n".into(),
            vec![],
            "neither `messages`",
        ),
        (
            "{\"path\":\"/v1/embeddings\",\"body\":{\"model\":\"m\",\"input\":\"x\"}}\n".into(),
            vec![],
            "is not one kvroute routes by prefix",
        ),
        (
            "{\"path\":\"/v1/messages\",\"body\":{\"model\":\"m\",\"messages\":3}}\n".into(),
            vec![],
            "requests.jsonl:1:",
        ),
        (
            "{\"timestamp\":-5,\"body\":{\"model\":\"m\",\"prompt\":\"x\"}}\n".into(),
            vec![],
            "timestamp must be >= 0",
        ),
        (
            "{\"timestamp\":1,\"input_length\":\"long\"}\n".into(),
            vec![],
            "requests.jsonl:1:",
        ),
        ("\n\n".into(), vec![], "no requests"),
        (
            "{\"model\":\"m\",\"prompt\":\"x\"}\n".into(),
            vec!["--policies".into(), "round-robin,magic".into()],
            "unknown policy \"magic\"",
        ),
        (
            "{\"model\":\"m\",\"prompt\":\"x\"}\n".into(),
            vec!["--replicas".into(), "0".into()],
            "--replicas must be between 1",
        ),
        (
            "{\"model\":\"m\",\"prompt\":\"x\"}\n".into(),
            vec!["--rps".into(), "0".into()],
            "--rps must be a positive number",
        ),
    ];
    for (content, extra, expected) in cases {
        let path = dir.join("requests.jsonl");
        std::fs::write(&path, &content).unwrap();
        let mut args = vec![path.to_str().unwrap().to_string(), "--no-sim".to_string()];
        if extra.iter().any(|a| a == "--policies" || a == "--replicas") {
            args.pop();
        }
        args.extend(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{content:?} {args:?} succeeded");
        assert!(
            stderr.contains(expected),
            "{content:?}: expected {expected:?} in\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = run(&["/nonexistent/trace.jsonl"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("cannot read /nonexistent/trace.jsonl"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&["not-a-generator"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("bad workload spec"));
}
