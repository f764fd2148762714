//! `kvroute-demo` end to end on a small workload: both fleets come up, every request succeeds,
//! `summary.json` has the agreed shape, and kvroute reuses more prefix cache than round robin.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_harness::Tools;
use serde_json::Value;

#[test]
fn demo_writes_the_summary_and_kvroute_reuses_more_cache() {
    let out_dir = kvroute_harness::target_dir()
        .join("e2e-logs")
        .join(format!("demo-smoke-{}", std::process::id()));
    // Locate the tools here, outside the demo's time limit, and hand them over.
    let tools = Tools::locate().unwrap_or_else(|e| panic!("{e}"));
    let demo = kvroute_harness::locate_bin("kvroute-demo", "KVROUTE_DEMO")
        .unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(demo)
        .env("KVROUTE_ENVOY", &tools.envoy)
        .env("KVROUTE_VLLM_SIM", &tools.vllm_sim)
        .env("KVROUTE_CONTROL_PLANE", &tools.control_plane)
        .env("KVROUTE_WASM", &tools.wasm)
        .args([
            "--conversations",
            "12",
            "--turns",
            "3",
            "--max-tokens",
            "16",
        ])
        .args([
            "--system-prompt-tokens",
            "1000",
            "--first-message-tokens",
            "600",
        ])
        .arg("--out-dir")
        .arg(&out_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kvroute-demo");
    let started = Instant::now();
    while child
        .try_wait()
        .expect("waiting for kvroute-demo")
        .is_none()
    {
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child
        .wait_with_output()
        .expect("collecting kvroute-demo output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kvroute-demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("TTFT p50"), "no table printed:\n{stdout}");

    let path = out_dir.join("summary.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let summary: Value = serde_json::from_str(&text).expect("summary.json is JSON");
    let runs = summary["runs"].as_array().expect("runs array");
    assert_eq!(runs.len(), 2, "{text}");
    assert_eq!(runs[0]["router"], "kvroute");
    assert_eq!(runs[1]["router"], "round-robin");
    for run in runs {
        assert_eq!(run["requests"], 36, "{text}");
        assert_eq!(run["errors"], 0, "{text}");
        for key in ["p50", "p90", "p99"] {
            assert!(
                run["ttft_ms"][key].as_f64().is_some_and(|v| v > 0.0),
                "{text}"
            );
        }
        for key in ["p50", "p99"] {
            assert!(
                run["e2e_ms"][key].as_f64().is_some_and(|v| v > 0.0),
                "{text}"
            );
        }
        assert!(run["output_tokens_per_s"].as_f64().is_some_and(|v| v > 0.0));
        let rate = run["prefix_cache_hit_rate"].as_f64().expect("hit rate");
        assert!((0.0..=1.0).contains(&rate), "{text}");
    }
    // kvroute's four fleet numbers are shares of its served prompt tokens; round robin has none.
    let numbers = &runs[0]["fleet_numbers"];
    for key in ["available", "aimed", "delivered"] {
        let share = numbers[key].as_f64().expect("a kvroute fleet number");
        assert!((0.0..=1.0).contains(&share), "{key}: {text}");
    }
    assert!(numbers["gap"].is_object(), "{text}");
    assert!(runs[1].get("fleet_numbers").is_none(), "{text}");
    let kv = runs[0]["prefix_cache_hit_rate"].as_f64().unwrap_or(0.0);
    let rr = runs[1]["prefix_cache_hit_rate"].as_f64().unwrap_or(1.0);
    assert!(
        kv > rr,
        "kvroute hit rate {kv} is not above round robin's {rr}:\n{stdout}"
    );
}
