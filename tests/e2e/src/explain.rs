//! Explain, end to end through a real Envoy: a client asking with `x-kvroute-explain: 1` gets an
//! `x-kvroute-decision` response header when the filter allows it, and the control plane's
//! `/debug/decisions/{id}` gives that decision's candidates with their score terms. The filter's
//! own metrics (requests routed, hashing time) show in Envoy's stats.

use std::time::Duration;

use kvroute_harness::{Fleet, HttpClient, REPLICA_HEADER, Tools};
use serde_json::{Value, json};

use crate::common::{self, Form, both_forms, tools};

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(90);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-explain-model";
const DECISION: &str = "x-kvroute-decision";

async fn start(tools: &Tools, name: &str, replicas: usize, plugin: Value, form: Form) -> Fleet {
    let mut cfg = common::fleet_config(name, replicas, MODEL);
    form.apply(&mut cfg);
    cfg.plugin_config = plugin;
    common::start_fleet(cfg, tools).await
}

fn conversation(turns: usize) -> Value {
    let system = common::words(5, 1_200);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!("question {t}?")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {t}.")}));
    }
    messages.push(json!({"role": "user", "content": "and then?"}));
    json!({"model": MODEL, "messages": messages, "max_tokens": 4})
}

/// A non-streaming chat completion through Envoy with `headers`; returns the response.
async fn chat(
    client: &HttpClient,
    fleet: &Fleet,
    body: &Value,
    headers: &[(&str, &str)],
) -> kvroute_harness::HttpResponse {
    common::chat_ok(client, fleet, body, headers, REQUEST_TIMEOUT).await
}

/// `key=value; ...` of an explain header.
fn fields(value: &str) -> Vec<(String, String)> {
    value
        .split("; ")
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .unwrap_or_else(|| panic!("bad field {kv:?} in {value:?}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn field<'a>(fields: &'a [(String, String)], key: &str) -> &'a str {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {key} in {fields:?}"))
}

/// The filter form: its own stats are in Envoy's (the picker's explain header is checked in
/// `picker::picker_sends_each_turn_where_the_last_one_was_served`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_header_and_debug_endpoint_agree() {
    let tools = tools();
    let body = async {
        let fleet = start(
            &tools,
            "e2e-explain",
            2,
            json!({"allow_explain": true}),
            Form::Filter,
        )
        .await;
        let client = HttpClient::new();
        let admin = common::cp_admin(&fleet);

        // Not asked: no header, even when the client sends one of its own.
        let plain = chat(
            &client,
            &fleet,
            &conversation(0),
            &[(DECISION, "id=1; reason=forged")],
        )
        .await;
        assert_eq!(plain.header(DECISION), None, "{:?}", plain.headers);

        // Asked: the first turn, then a longer second turn sharing its prefix.
        let mut seen = Vec::new();
        for turns in [1, 2] {
            let resp = chat(
                &client,
                &fleet,
                &conversation(turns),
                &[("x-kvroute-explain", "1")],
            )
            .await;
            let value = resp
                .header(DECISION)
                .unwrap_or_else(|| panic!("no {DECISION} in {:?}", resp.headers))
                .to_string();
            let f = fields(&value);
            let keys: Vec<&str> = f.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(
                keys,
                ["id", "reason", "endpoint", "cached_blocks"],
                "{value}"
            );
            let endpoint = field(&f, "endpoint");
            assert_eq!(
                Some(endpoint),
                resp.header(REPLICA_HEADER),
                "the explained endpoint served it: {value}"
            );
            seen.push(f.clone());

            // The debug endpoint explains the same decision, candidate by candidate.
            let id = field(&f, "id");
            let url = format!("{admin}/debug/decisions/{id}");
            let d = client.get(&url, REQUEST_TIMEOUT).await.unwrap();
            assert_eq!(d.status, 200, "{}", d.body);
            let d: Value = serde_json::from_str(&d.body).unwrap();
            assert_eq!(d["response"]["decision_id"].to_string(), id);
            assert_eq!(d["response"]["reason"], field(&f, "reason"));
            assert_eq!(
                d["response"]["cached_blocks"].to_string(),
                field(&f, "cached_blocks")
            );
            let candidates = d["candidates"].as_array().unwrap();
            assert_eq!(candidates.len(), 2, "{d:#}");
            assert_eq!(candidates[0]["endpoint"], endpoint);
            for c in candidates {
                for term in ["queue_ms", "prefill_ms", "decode_ms", "kv_ms", "total_ms"] {
                    assert!(c[term].is_number(), "{term} missing in {c:#}");
                }
            }
            let totals: Vec<f64> = candidates
                .iter()
                .map(|c| c["total_ms"].as_f64().unwrap())
                .collect();
            assert!(
                candidates[0]["guarded"] == true || totals[0] <= totals[1] + 0.5,
                "the chosen candidate is the cheapest (or a tie): {d:#}"
            );
        }
        // The second turn follows the first, for its prefix.
        assert_eq!(field(&seen[1], "endpoint"), field(&seen[0], "endpoint"));
        assert_eq!(field(&seen[1], "reason"), "prefix", "{seen:?}");
        let cached: u32 = field(&seen[1], "cached_blocks").parse().unwrap();
        assert!(cached >= 20, "{seen:?}");

        // A skipped inference request says why.
        let url = format!("{}/v1/chat/completions", fleet.url());
        let skipped = common::request(
            &client,
            "GET",
            &url,
            &[("x-kvroute-explain", "1")],
            None,
            REQUEST_TIMEOUT,
            &fleet,
        )
        .await;
        assert_eq!(
            skipped.header(DECISION),
            Some("reason=skipped; skip=not_post")
        );

        // The filter's metrics, as Envoy exports them.
        let stats = fleet.envoy_stats("kvroute_").await.unwrap();
        let counter = |name: &str| -> u64 {
            stats
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(": ")?;
                    k.ends_with(name).then(|| v.trim().parse().ok())?
                })
                .unwrap_or_else(|| panic!("no {name} in Envoy stats:\n{stats}"))
        };
        assert!(counter("kvroute_requests_routed") >= 3, "{stats}");
        assert_eq!(counter("kvroute_body_parse_errors"), 0, "{stats}");
        // Envoy merges histograms into its admin view on each stats flush (every 5 s).
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let hash = loop {
            let stats = fleet.envoy_stats("kvroute_hash_duration_us").await.unwrap();
            let line = stats
                .lines()
                .find(|l| l.contains("kvroute_hash_duration_us"))
                .unwrap_or_else(|| panic!("no hashing-time histogram in Envoy stats:\n{stats}"))
                .to_string();
            if !line.contains("No recorded values") {
                break line;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the hashing-time histogram stayed empty: {line}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        eprintln!("hashing time as Envoy reports it: {hash}");

        // The names the Grafana dashboard queries: Envoy exports the filter's metrics (its
        // `wasmcustom` stat namespace) to Prometheus under their own names.
        let url = format!("http://{}/stats/prometheus", fleet.envoy.admin_address);
        let prom = client.get(&url, REQUEST_TIMEOUT).await.unwrap().body;
        let value = |name: &str| -> f64 {
            prom.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix("{} ")?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in Envoy's /stats/prometheus"))
        };
        assert!(value("kvroute_requests_routed") >= 3.0);
        assert_eq!(value("kvroute_fail_open"), 0.0);
        assert_eq!(value("kvroute_body_parse_errors"), 0.0);
        assert!(value("kvroute_hash_duration_us_count") >= 3.0);
        assert!(
            value("kvroute_hash_duration_us_sum") > 0.0,
            "the host clock is too coarse"
        );
        assert!(value("kvroute_route_latency_ms_count") >= 3.0);
    };
    common::bounded(TEST_TIMEOUT, body).await;
}

both_forms!(explain_is_off_unless_the_config_allows_it);

async fn explain_is_off_unless_the_config_allows_it(form: Form) {
    let tools = tools();
    let body = async {
        let fleet = start(&tools, "e2e-explain-off", 1, json!({}), form).await;
        let client = HttpClient::new();
        let resp = chat(
            &client,
            &fleet,
            &conversation(1),
            &[("x-kvroute-explain", "1")],
        )
        .await;
        assert_eq!(resp.header(DECISION), None, "{:?}", resp.headers);
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
