//! SLO signals for autoscaling, end to end through a real Envoy: with `slo:` configured, the
//! control plane exports `kvroute_slo_attainment_ratio{pool,kind}`, `kvroute_queue_pressure`,
//! and `kvroute_desired_replicas{pool,role}` computed from the filter's outcome reports and the
//! scraped replica load. Under light load the TTFT target is met and one replica suffices;
//! under a burst of long prompts on replicas that batch only two requests, requests queue
//! (queue pressure rises), the TTFT attainment falls and the desired prefill replicas grow.

use std::time::{Duration, Instant};

use kvroute_harness::Fleet;
use serde_json::{Value, json};

use crate::common;

const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
const MODEL: &str = "kvroute-slo-model";

fn body(words_n: usize, seed: u64, max_tokens: u32) -> Value {
    let text = common::words(seed, words_n);
    // Streamed, so the filter's TTFB is the first token and usage gives the ITL.
    common::stream_chat_body(
        MODEL,
        &[json!({"role": "user", "content": text})],
        max_tokens,
    )
}

async fn chat(fleet: &Fleet, body: Value) {
    common::chat_ok(fleet.client(), fleet, &body, &[], REQUEST_TIMEOUT).await;
}

async fn metrics(fleet: &Fleet) -> String {
    common::cp_metrics(fleet).await
}

/// The value of the sample `name{labels}` (exact label text), if present.
fn gauge(text: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
}

fn need(text: &str, name: &str, labels: &str) -> f64 {
    gauge(text, name, labels).unwrap_or_else(|| panic!("no {name}{{{labels}}} in\n{text}"))
}

/// The default pool's gauge `name`.
fn pool_gauge(text: &str, name: &str) -> f64 {
    need(text, name, "pool=\"default\"")
}

/// The default pool's SLO attainment of `kind` (`ttft`, `itl`).
fn attainment(text: &str, kind: &str) -> f64 {
    let labels = format!("pool=\"default\",kind=\"{kind}\"");
    need(text, "kvroute_slo_attainment_ratio", &labels)
}

/// The default pool's desired replica count of `role`.
fn desired(text: &str, role: &str) -> f64 {
    let labels = format!("pool=\"default\",role=\"{role}\"");
    need(text, "kvroute_desired_replicas", &labels)
}

/// Waits until the window holds at least `n` TTFT samples (outcomes arrive on the filter's
/// feedback tick) and returns the metrics text.
async fn wait_samples(fleet: &Fleet, n: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = metrics(fleet).await;
        let have = gauge(
            &text,
            "kvroute_slo_samples",
            "pool=\"default\",kind=\"ttft\"",
        );
        if have.is_some_and(|h| h >= n) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "only {have:?} TTFT samples, wanted {n}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_gauges_follow_the_load() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-slo", 2, MODEL, |cfg| {
            cfg.sim_args = vec!["--max-num-seqs".into(), "2".into()];
            cfg.plugin_config = json!({"route_timeout_ms": 5000, "feedback_interval_ms": 100});
            cfg.control_plane_extra = json!({
                "slo": {"ttft_ms": 1000, "itl_ms": 200, "window_ms": 600_000,
                        "attainment_target": 0.9}
            });
        })
        .await;

        // Before any traffic the gauges exist for the pool: nothing violated, one replica.
        let text = metrics(&fleet).await;
        for kind in ["ttft", "itl"] {
            assert_eq!(attainment(&text, kind), 1.0);
        }
        assert_eq!(pool_gauge(&text, "kvroute_queue_pressure"), 0.0);
        for role in ["prefill", "decode"] {
            assert_eq!(desired(&text, role), 1.0, "{text}");
        }

        // Light load: short prompts one at a time meet the 1 s TTFT target.
        for i in 0..10 {
            chat(&fleet, body(20, i, 4)).await;
        }
        let light = wait_samples(&fleet, 10.0).await;
        let light_ttft = attainment(&light, "ttft");
        let light_prefill = desired(&light, "prefill");
        eprintln!("light: ttft attainment {light_ttft}, desired prefill {light_prefill}");
        assert!(light_ttft >= 0.9, "{light}");
        assert!(attainment(&light, "itl") >= 0.9, "{light}");

        // Heavy: 16 long prompts at once on 2 replicas batching 2 each: they queue.
        let mut burst = Vec::new();
        for i in 0..16 {
            let url = format!("{}/v1/chat/completions", fleet.url());
            let client = fleet.client().clone();
            let b = body(3_000, 100 + i, 100).to_string();
            burst.push(tokio::spawn(async move {
                client
                    .request("POST", &url, &[], Some(b), REQUEST_TIMEOUT)
                    .await
                    .map(|r| r.status)
            }));
        }
        let mut max_pressure: f64 = 0.0;
        while !burst.iter().all(|t| t.is_finished()) {
            let text = metrics(&fleet).await;
            if let Some(p) = gauge(&text, "kvroute_queue_pressure", "pool=\"default\"") {
                max_pressure = max_pressure.max(p);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for t in burst {
            let status = t.await.unwrap().unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(status, 200);
        }
        let heavy = wait_samples(&fleet, 26.0).await;
        let heavy_ttft = attainment(&heavy, "ttft");
        let heavy_prefill = desired(&heavy, "prefill");
        let demand = pool_gauge(&heavy, "kvroute_prefill_demand_tokens_per_second");
        eprintln!(
            "heavy: max queue pressure {max_pressure}, ttft attainment {heavy_ttft}, desired \
             prefill {heavy_prefill}, prefill demand {demand:.0} tok/s"
        );
        assert!(max_pressure > 0.0, "requests never queued");
        assert!(heavy_ttft < light_ttft, "{heavy}");
        assert!(heavy_ttft < 0.9, "{heavy}");
        assert!(heavy_prefill > light_prefill, "{heavy}");
        assert!(demand > 0.0);
    })
    .await;
}

// A buffered (non-streamed) answer's status is read once the client has it, from Envoy's
// `response.code`, not from the response headers: its outcome still says what the client got.
// Refused requests (vLLM's 400 for `n` > 1) are reported as refusals and leave the SLO window
// alone; answered ones are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_answers_report_the_status_the_client_got() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-slo-buffered", 2, MODEL, |cfg| {
            cfg.plugin_config = json!({"feedback_interval_ms": 100});
            cfg.control_plane_extra = json!({
                "slo": {"ttft_ms": 1000, "itl_ms": 200, "window_ms": 600_000}
            });
        })
        .await;
        let buffered = |seed: u64, n: u32| {
            json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": common::words(seed, 20)}],
                "max_tokens": 4,
                "n": n,
            })
        };
        for i in 0..3 {
            let resp = common::post_chat(
                fleet.client(),
                &fleet.url(),
                &buffered(i, 2),
                &[],
                REQUEST_TIMEOUT,
                &fleet,
            )
            .await;
            assert_eq!(resp.status, 400, "{}", resp.body);
        }
        for i in 0..5 {
            chat(&fleet, buffered(10 + i, 1)).await;
        }
        wait_samples(&fleet, 5.0).await;
        // Every report is in by now (the refusals went first); another tick adds nothing.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let text = metrics(&fleet).await;
        let samples = gauge(
            &text,
            "kvroute_slo_samples",
            "pool=\"default\",kind=\"ttft\"",
        );
        assert_eq!(samples, Some(5.0), "{text}");
    })
    .await;
}
