//! The live fleet page on the control plane's admin port, on the demo topology: Envoy with the
//! kvroute filter, the control plane and `vllm-sim` replicas serve multi-turn chat traffic, then
//! the page's JSON must reflect it and headless Chromium must render it.
//!
//! Chromium is the Debian package `chromium` (`make setup-browser`), or `$KVROUTE_CHROMIUM`.
//! Without it the browser test prints why and passes, unless `KVROUTE_REQUIRE_BROWSER` is set
//! (CI sets it), in which case a missing browser is a failure. The screenshot is kept as
//! `target/fleet-page.png`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_harness::loadgen::{self, Workload};
use kvroute_harness::{self as harness, Fleet, HttpClient, Tools};
use serde_json::{Value, json};

use crate::common::{self, tools};

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(120);
/// One Chromium run.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(45);
const MODEL: &str = "kvroute-fleet-page-model";

fn admin_url(fleet: &Fleet) -> String {
    common::cp_admin(fleet)
}

/// A fleet that has served a few multi-turn conversations, and whose page has history.
async fn busy_fleet(tools: &Tools, name: &str, replicas: usize, speed: f64) -> Fleet {
    busy_fleet_with(tools, name, replicas, speed, |_| {}).await
}

/// [`busy_fleet`], with `configure` applied to the fleet's configuration first.
async fn busy_fleet_with(
    tools: &Tools,
    name: &str,
    replicas: usize,
    speed: f64,
    configure: impl FnOnce(&mut kvroute_harness::FleetConfig),
) -> Fleet {
    let mut cfg = common::fleet_config(name, replicas, MODEL);
    cfg.sim_args = vec!["--speed".into(), speed.to_string()];
    configure(&mut cfg);
    let fleet = common::start_fleet(cfg, tools).await;
    let run = loadgen::run_workload(&fleet.url(), &chats(11, 6, 16), |_, _| {}).await;
    assert_no_errors(&run, &fleet);
    fleet
}

/// Every request of `run` was served.
fn assert_no_errors(run: &loadgen::RunResult, fleet: &Fleet) {
    let errors: Vec<_> = run
        .records
        .iter()
        .filter_map(|r| r.error.as_ref())
        .collect();
    assert!(errors.is_empty(), "{errors:?} ({})", fleet.describe());
}

/// `conversations` three-turn chats sharing a system prompt, answers `max_tokens` long.
fn chats(seed: u64, conversations: usize, max_tokens: u32) -> Workload {
    Workload {
        model: MODEL.to_string(),
        conversations,
        turns: 3,
        system_prompt_words: 600,
        first_message_words: 300,
        followup_words: 30,
        max_tokens,
        seed,
        think_time: Duration::from_millis(150),
        stagger: Duration::from_millis(40),
        request_timeout: Duration::from_secs(30),
    }
}

/// Polls `/debug/fleet.json` until `ready` holds (or fails after a few seconds).
async fn fleet_json_when(fleet: &Fleet, ready: impl Fn(&Value) -> bool) -> Value {
    let url = format!("{}/debug/fleet.json", admin_url(fleet));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let resp = fleet
            .client()
            .get(&url, Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("{e} ({})", fleet.describe()));
        assert_eq!(resp.status, 200, "{}", resp.body);
        let json: Value = serde_json::from_str(&resp.body).expect("fleet.json is JSON");
        if ready(&json) {
            return json;
        }
        assert!(
            Instant::now() < deadline,
            "fleet.json never got ready: {json:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The traffic's outcomes are in, and a history sample was taken after some of them: the page
/// samples on an interval, so outcomes that land after the latest sample show in no sparkline
/// yet.
fn has_history_and_outcomes(json: &Value) -> bool {
    let endpoints = json["endpoints"].as_array().cloned().unwrap_or_default();
    let history = |e: &Value| e["history"].as_array().cloned().unwrap_or_default();
    json["totals"]["outcomes"].as_u64() >= Some(18)
        && endpoints.iter().all(|e| history(e).len() >= 3)
        && endpoints
            .iter()
            .any(|e| history(e).iter().any(|s| s["hit_rate"].is_number()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_page_and_json_reflect_the_traffic() {
    let tools = tools();
    let body = async {
        let fleet = busy_fleet(&tools, "fleet-page-json", 3, 4.0).await;
        let admin = admin_url(&fleet);
        let client = HttpClient::new();
        let get = |path: &str| {
            let url = format!("{admin}{path}");
            let client = client.clone();
            async move { client.get(&url, Duration::from_secs(5)).await.unwrap() }
        };

        // The page and its assets: embedded, same-origin only, locked down by CSP.
        for path in ["/", "/fleet"] {
            let page = get(path).await;
            assert_eq!(page.status, 200);
            assert!(
                page.header("content-type")
                    .unwrap()
                    .starts_with("text/html")
            );
            assert!(page.body.contains("assets/fleet.js"), "{}", page.body);
            let csp = page.header("content-security-policy").unwrap();
            assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
        }
        for (path, kind) in [
            ("/assets/fleet.js", "text/javascript"),
            ("/assets/fleet.css", "text/css"),
        ] {
            let asset = get(path).await;
            assert_eq!(asset.status, 200, "{path}");
            assert!(asset.header("content-type").unwrap().starts_with(kind));
            for external in [
                "src=\"http",
                "href=\"http",
                "url(http",
                "fetch(\"http",
                "@import",
            ] {
                assert!(!asset.body.contains(external), "{path} loads {external}");
            }
        }

        let json = fleet_json_when(&fleet, has_history_and_outcomes).await;
        let endpoints = json["endpoints"].as_array().unwrap();
        let mut addresses: Vec<String> = endpoints
            .iter()
            .map(|e| e["address"].as_str().unwrap().to_string())
            .collect();
        addresses.sort();
        let mut expected = fleet.replica_addresses();
        expected.sort();
        assert_eq!(addresses, expected);
        for e in endpoints {
            assert_eq!(e["health"], "ready", "{e:#}");
            assert!(e["scrape_age_ms"].as_u64().unwrap() < 2_000, "{e:#}");
            assert!(e["metrics"]["kv_usage"].is_number(), "{e:#}");
            let last = e["history"].as_array().unwrap().last().unwrap().clone();
            assert_eq!(last["up"], true, "{e:#}");
            assert!(last["kv_usage"].is_number(), "{e:#}");
        }
        // Later turns reuse their conversation's prefix: the engines report cache hits, and the
        // page attributes them to endpoints.
        let totals = &json["totals"];
        let hit = totals["hit_rate"].as_f64().unwrap();
        assert!(hit > 0.2, "fleet hit rate {hit}: {totals:#}");
        assert!(
            endpoints.iter().any(|e| e["hit_rate"].as_f64() > Some(0.2)),
            "{json:#}"
        );
        assert!(
            endpoints.iter().any(|e| e["history"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["hit_rate"].is_number())),
            "no interval hit rate in any sparkline: {json:#}"
        );
        assert!(totals["decisions"].as_u64() >= Some(18), "{totals:#}");
        assert!(totals["index_blocks"].as_u64() > Some(0), "{totals:#}");
        assert!(
            totals["recent_reasons"]["prefix"].as_u64() > Some(0),
            "{totals:#}"
        );
        let recent = json["recent"].as_array().unwrap();
        assert!(!recent.is_empty() && recent.len() <= 25);
        let newest = recent[0]["decision_id"].as_u64().unwrap();
        assert!(
            recent
                .iter()
                .all(|d| d["decision_id"].as_u64() <= Some(newest))
        );

        // The decision the page links to explains every candidate.
        let explained = get(&format!("/debug/decisions/{newest}")).await;
        assert_eq!(explained.status, 200, "{}", explained.body);
        let explained: Value = serde_json::from_str(&explained.body).unwrap();
        assert_eq!(explained["candidates"].as_array().unwrap().len(), 3);

        // /metrics carries the per-endpoint and per-policy series the dashboard uses.
        let metrics = get("/metrics").await.body;
        for name in [
            "kvroute_decisions_total",
            "kvroute_decisions_by_policy_total",
            "kvroute_route_duration_seconds_bucket",
            "kvroute_endpoint_waiting",
            "kvroute_endpoint_kv_usage",
            "kvroute_endpoint_inflight",
            "kvroute_endpoint_scrape_age_seconds",
            "kvroute_endpoint_served_cached_tokens_total",
            "kvroute_predicted_cached_tokens_total",
            "kvroute_actual_cached_tokens_total",
            "kvroute_index_bytes",
        ] {
            assert!(metrics.contains(name), "missing {name} in /metrics");
        }
        assert!(
            harness::prometheus_sum(&metrics, "kvroute_endpoint_served_cached_tokens_total") > 0.0
        );

        // Every series the Grafana dashboard queries exists in what this fleet exports: the
        // control plane, Envoy (the filter's metrics) and a replica.
        let envoy = format!("http://{}/stats/prometheus", fleet.envoy.admin_address);
        let envoy = client
            .get(&envoy, Duration::from_secs(5))
            .await
            .unwrap()
            .body;
        let vllm = fleet.replica_metrics(&fleet.replicas[0]).await.unwrap();
        // Labelled families that have seen no event yet (KV-event gaps in a fleet without KV
        // events, refused requests) are absent from the exposition: those must at least be
        // registered under that name by the control plane.
        let exported = [metrics.as_str(), envoy.as_str(), vllm.as_str()];
        let telemetry = std::fs::read_to_string(
            harness::workspace_root().join("control-plane/src/telemetry.rs"),
        )
        .unwrap();
        for name in dashboard_metrics() {
            let exposed = exported.iter().any(|text| {
                text.lines().any(|l| {
                    l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))
                })
            });
            let registered = name
                .strip_prefix("kvroute_")
                .map(|n| n.strip_suffix("_total").unwrap_or(n))
                .map(|n| n.strip_suffix("_bucket").unwrap_or(n))
                .is_some_and(|n| telemetry.contains(&format!("\"{n}\"")));
            assert!(
                exposed || registered,
                "the dashboard queries {name}, which nobody exports"
            );
        }
    };
    common::bounded(TEST_TIMEOUT, body).await;
}

/// Metric names (`kvroute_*`, `vllm:*`) in the Grafana dashboard's queries.
fn dashboard_metrics() -> std::collections::BTreeSet<String> {
    let path = harness::workspace_root().join("envoy-config/grafana/kvroute-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut names = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            for token in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            {
                if token.starts_with("kvroute_") || token.starts_with("vllm:") {
                    names.insert(token.to_string());
                }
            }
        }
    }
    assert!(names.len() > 40, "{names:?}");
    names
}

/// `$KVROUTE_CHROMIUM`, else the first of the usual names on `PATH`.
fn find_chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ]
    .iter()
    .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
    .find(|p| p.is_file())
}

/// Runs headless Chromium with `args` and `url`; returns stdout. Killed after
/// [`BROWSER_TIMEOUT`].
fn chromium(binary: &Path, args: &[String], url: &str) -> String {
    let profile = std::env::temp_dir().join(format!(
        "kvroute-chromium-{}-{}",
        std::process::id(),
        args.len()
    ));
    let mut cmd = Command::new(binary);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args)
    .arg(url)
    .stdin(Stdio::null());
    // A dumped DOM is larger than a pipe buffer: `run_bounded` drains both pipes meanwhile.
    let out = common::run_bounded(cmd, "chromium", BROWSER_TIMEOUT);
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_page_renders_in_headless_chromium() {
    let Some(browser) = find_chromium() else {
        if std::env::var_os("KVROUTE_REQUIRE_BROWSER").is_some() {
            panic!(
                "KVROUTE_REQUIRE_BROWSER is set but no Chromium was found: run \
                 `make setup-browser` (Debian package chromium) or set KVROUTE_CHROMIUM"
            );
        }
        eprintln!(
            "SKIPPED fleet_page_renders_in_headless_chromium: no chromium on PATH. Run \
             `make setup-browser` (or set KVROUTE_CHROMIUM); set KVROUTE_REQUIRE_BROWSER=1 to \
             make this a failure."
        );
        return;
    };
    let tools = tools();
    let body = async {
        // Precise mode, with the first replica's KV-event publisher pointed at a port nobody
        // serves: the page shows that replica `degraded` (no_kv_events) beside exact ones. The
        // ports stay held until the test ends, so no other test's replica can take them.
        let (_events, events_url) = kvroute_harness::silent_tcp_endpoint().expect("a port");
        let (_replay, replay_url) = kvroute_harness::silent_tcp_endpoint().expect("a port");
        let fleet = busy_fleet_with(&tools, "fleet-page-browser", 4, 1.0, |cfg| {
            cfg.kv_events = true;
            cfg.endpoint_extra =
                vec![json!({"kv_events": events_url, "kv_events_replay": replay_url})];
        })
        .await;
        let silent = fleet.replica_addresses()[0].to_string();
        fleet_json_when(&fleet, |json| {
            has_history_and_outcomes(json)
                && json["endpoints"].as_array().is_some_and(|endpoints| {
                    endpoints.iter().any(|e| {
                        e["address"] == silent.as_str() && e["routing_state"] == "degraded"
                    })
                })
        })
        .await;
        let url = format!("{}/fleet", admin_url(&fleet));

        // The DOM after the page's script polled the JSON at least once.
        let dom = {
            let browser = browser.clone();
            let url = url.clone();
            tokio::task::spawn_blocking(move || {
                chromium(
                    &browser,
                    &["--dump-dom".into(), "--virtual-time-budget=4000".into()],
                    &url,
                )
            })
            .await
            .expect("chromium task")
        };
        for address in fleet.replica_addresses() {
            assert!(
                dom.contains(&format!("data-endpoint=\"{address}\"")),
                "endpoint {address} is not in the rendered page:\n{dom}"
            );
        }
        assert!(dom.contains("class=\"tile\""), "no tiles rendered:\n{dom}");
        // The fleet numbers' table: a pool row, then the endpoints with their state.
        assert!(
            dom.contains("<td>pool</td>"),
            "no pool in the reuse table:\n{dom}"
        );
        assert!(
            dom.contains("<td title=\"prefix hits credited\">exact</td>"),
            "{dom}"
        );
        assert!(
            dom.contains("degraded · no_kv_events"),
            "the silent replica's state is not shown:\n{dom}"
        );
        assert!(
            dom.contains("<svg class=\"spark\""),
            "no sparklines:\n{dom}"
        );
        assert!(dom.contains("polyline"), "sparklines are empty:\n{dom}");
        assert!(
            dom.contains("badge prefix"),
            "no prefix decision listed:\n{dom}"
        );
        assert!(!dom.contains("control plane unreachable"), "{dom}");

        // The screenshot, kept as a test artefact: taken while a second wave of conversations
        // (three tenants, each with its own system prompt) runs, with the newest decision's
        // candidates explained.
        let mut wave = tokio::task::JoinSet::new();
        for tenant in 12..15 {
            let url = fleet.url();
            wave.spawn(async move {
                loadgen::run_workload(&url, &chats(tenant, 4, 120), |_, _| {}).await
            });
        }
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let json = fleet_json_when(&fleet, |_| true).await;
        let newest = json["recent"][0]["decision_id"]
            .as_u64()
            .expect("a decision");
        let png = harness::target_dir().join("fleet-page.png");
        let _ = std::fs::remove_file(&png);
        let args = vec![
            format!("--screenshot={}", png.display()),
            "--window-size=1280,900".into(),
            "--virtual-time-budget=3000".into(),
        ];
        let shot = format!("{url}#decision={newest}");
        tokio::task::spawn_blocking(move || chromium(&browser, &args, &shot))
            .await
            .expect("chromium task");
        while let Some(run) = wave.join_next().await {
            assert_no_errors(&run.expect("second wave"), &fleet);
        }
        let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
        assert!(bytes.len() > 20_000, "suspiciously small screenshot");
        eprintln!("fleet page screenshot: {}", png.display());
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
