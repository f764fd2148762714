//! KV-event faults in precise mode, end to end through a REAL Envoy with the kvroute filter
//! (issue 8, part 2): the replicas publish vLLM's ZMQ KV events, the control plane subscribes,
//! and `vllm-sim`'s fault injection breaks the stream.
//!
//! - **Gap, replayed**: a replica keeps one batch (the one announcing a conversation's prompt
//!   blocks) in its replay buffer but does not publish it. The control plane sees the sequence
//!   jump at the next batch, replays the missing one, and its view stays exact: that
//!   conversation's turn 2, routed through Envoy, lands on the replica that holds turn 1.
//! - **Publisher restart**: a replica's engine restarts (its prefix cache emptied, sequence
//!   numbers back at 0, replay buffer empty). The control plane sees the sequence go backwards,
//!   drops that endpoint's precise state (it no longer claims the old blocks) and rebuilds it
//!   from the new history: a conversation begun after the restart sticks to it again.
//!
//! Each check reads the control plane's own account (`kvroute_kv_event_*` metrics and
//! `/debug/kv_events`). A missing Envoy fails these tests (run `make setup`); they never skip.

use std::time::Duration;

use kvroute_harness::loadgen::StreamOutcome;
use kvroute_harness::{Fleet, HttpClient, Tools};
use serde_json::{Value, json};

use crate::common::{self, Conversation, cp_get, cp_metrics, endpoint_value, replica_of, tools};

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a condition on the control plane's state may take to hold.
const WAIT: Duration = Duration::from_secs(20);
const MODEL: &str = "kvroute-kv-faults-model";
/// Speculative entries of routed requests live this long, so the events alone decide.
const SPECULATIVE_TTL_MS: u64 = 300;
/// Words (the simulator's tokens) of a conversation's system prompt: about 75 blocks of 16.
const SYSTEM_WORDS: usize = 1_200;

/// The frame of both tests: within [`TEST_TIMEOUT`], a [`precise_fleet`] called `name`, a
/// client, and the replica (of index `replica`) whose stream the test breaks, with its direct
/// URL: requests sent there make no routing decision (and no speculative entry), so only the
/// replica's KV events can tell the control plane where their prompts are.
async fn kv_fault_test(
    name: &str,
    replica: usize,
    body: impl AsyncFnOnce(&Fleet, &HttpClient, &str, &str),
) {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let fleet = precise_fleet(&tools, name).await;
        let client = HttpClient::new();
        let replica = fleet.replica_addresses()[replica].clone();
        let direct = format!("http://{replica}");
        body(&fleet, &client, &replica, &direct).await;
    })
    .await;
}

/// Two replicas publishing KV events with replay, the control plane subscribed and tokenising
/// through the replicas' render API, the chat route in precise mode.
async fn precise_fleet(tools: &Tools, name: &str) -> Fleet {
    let mut cfg = common::fleet_config(name, 2, MODEL);
    cfg.sim_args = vec!["--speed".into(), "5".into()];
    cfg.kv_events = true;
    cfg.control_plane_extra = common::remote_tokenizer();
    cfg.control_plane_router = common::precise_router(SPECULATIVE_TTL_MS);
    cfg.plugin_config = json!({
        "route_timeout_ms": 3000,
        "routes": [{"path": "/v1/chat/completions", "api": "chat", "mode": "precise"}]
    });
    let fleet = common::start_fleet(cfg, tools).await;
    common::wait_events_live(&fleet, WAIT).await;
    fleet
}

/// The sample of `name` whose labels include `endpoint="<endpoint>"` (and `extra`, if given).
fn labelled_value(text: &str, name: &str, endpoint: &str, extra: Option<&str>) -> f64 {
    let endpoint_label = format!("endpoint=\"{endpoint}\"");
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| l.contains(&endpoint_label) && extra.is_none_or(|e| l.contains(e)))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// `endpoint`'s entry of the control plane's `/debug/kv_events`.
async fn kv_stream(fleet: &Fleet, endpoint: &str) -> Value {
    let body = cp_get(fleet, "/debug/kv_events").await;
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let entries: Vec<Value> = match v {
        Value::Array(a) => a,
        Value::Object(o) => o.into_iter().map(|(_, v)| v).collect(),
        other => panic!("unexpected /debug/kv_events: {other}"),
    };
    entries
        .into_iter()
        .find(|e| e["address"] == endpoint)
        .unwrap_or_else(|| panic!("{endpoint} missing from /debug/kv_events: {body}"))
}

async fn precise_blocks(fleet: &Fleet, endpoint: &str) -> f64 {
    endpoint_value(
        &cp_metrics(fleet).await,
        "kvroute_endpoint_precise_blocks",
        endpoint,
    )
    .unwrap_or(0.0)
}

/// Polls `check` every 50 ms until it holds, or fails after [`WAIT`] with the stream status.
async fn wait_for(fleet: &Fleet, what: &str, check: impl AsyncFn(&Fleet) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check(fleet).await {
        if tokio::time::Instant::now() >= deadline {
            let streams = cp_get(fleet, "/debug/kv_events").await;
            panic!(
                "{what} did not happen within {WAIT:?} ({}); /debug/kv_events: {streams}",
                fleet.describe()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn set_fault(fleet: &Fleet, replica: &str, fault: Value) {
    common::set_sim_fault(fleet.client(), replica, &fault).await;
}

/// A conversation with its own long system prompt and 100-word questions.
fn conversation(seed: u64) -> Conversation {
    Conversation::new(MODEL, seed, SYSTEM_WORDS, 100)
}

/// Sends `conv`'s next turn (8 tokens asked) to `base_url`: Envoy, or a replica directly.
async fn turn(
    conv: &mut Conversation,
    client: &HttpClient,
    fleet: &Fleet,
    base_url: &str,
) -> StreamOutcome {
    // Each question is seeded by the history's length so far.
    let body = conv.ask_seeded(conv.seed * 1_000 + conv.messages.len() as u64, 8);
    conv.send(client, fleet, base_url, &body, &[]).await
}

/// Once the speculative entries of earlier routed turns have expired (so the KV events alone
/// decide), `conv`'s next turn through Envoy goes to `replica` and reuses its cache; `what`
/// names the expectation in a failure.
async fn assert_next_turn_follows(
    conv: &mut Conversation,
    client: &HttpClient,
    fleet: &Fleet,
    replica: &str,
    what: &str,
) {
    tokio::time::sleep(Duration::from_millis(SPECULATIVE_TTL_MS + 200)).await;
    let next = turn(conv, client, fleet, &fleet.url()).await;
    common::assert_followed_cache(&next, fleet, replica, what);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_is_replayed_and_turn_two_still_finds_its_replica() {
    kv_fault_test("e2e-kv-gap", 0, async |fleet, client, holder, direct| {
        // Some history first: a gap is a jump after batches already applied (a stream that
        // starts above 0 is a late join, replayed from 0 without counting a gap).
        turn(&mut conversation(3), client, fleet, direct).await;
        wait_for(fleet, "the first batch applied", async |f| {
            kv_stream(f, holder).await["batches"].as_u64().unwrap_or(0) >= 1
        })
        .await;
        let stream_before = kv_stream(fleet, holder).await;
        let gaps_before = stream_before["gaps"].as_u64().unwrap_or(0);
        let replays_before = stream_before["replays"].as_u64().unwrap_or(0);

        // The batch announcing conversation 1's prompt blocks is kept for replay only. The
        // request goes to the replica directly, so no routing decision (and no speculative
        // entry) tells the control plane where the prompt is: only the events can.
        set_fault(fleet, holder, json!({"drop_kv_batches": 1})).await;
        let mut conv = conversation(1);
        let first = turn(&mut conv, client, fleet, direct).await;
        assert_eq!(first.replica.as_deref(), Some(holder));
        // The next batch from that replica reveals the gap.
        turn(&mut conversation(2), client, fleet, direct).await;
        wait_for(fleet, "the gap detected and replayed", async |f| {
            let s = kv_stream(f, holder).await;
            s["gaps"].as_u64().unwrap_or(0) > gaps_before
                && s["replays"].as_u64().unwrap_or(0) > replays_before
                && s["resets"].as_u64() == Some(0)
                && s["replay_failures"].as_u64() == Some(0)
        })
        .await;
        let m = cp_metrics(fleet).await;
        assert!(
            labelled_value(&m, "kvroute_kv_event_gaps_total", holder, None) >= 1.0,
            "no gap counted:\n{m}"
        );
        assert!(
            labelled_value(
                &m,
                "kvroute_kv_event_replays_total",
                holder,
                Some("result=\"ok\"")
            ) >= 2.0,
            "the initial history and the gap were not both replayed:\n{m}"
        );
        // All three conversations' blocks are known, the replayed ones included.
        wait_for(fleet, "both prompts' blocks known", async |f| {
            precise_blocks(f, holder).await >= 210.0
        })
        .await;

        // Turn 2 through Envoy follows the replayed blocks.
        assert_next_turn_follows(
            &mut conv,
            client,
            fleet,
            holder,
            "turn 2 did not follow the replayed blocks",
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_drops_the_endpoints_state_and_it_is_rebuilt() {
    kv_fault_test(
        "e2e-kv-restart",
        1,
        async |fleet, client, target, direct| {
            // Conversation 1's blocks on the replica, known to the control plane.
            let mut old = conversation(11);
            turn(&mut old, client, fleet, direct).await;
            wait_for(fleet, "conversation 1's blocks known", async |f| {
                precise_blocks(f, target).await >= 70.0
            })
            .await;
            let before = precise_blocks(fleet, target).await;

            // The engine restarts: empty cache, sequence back at 0, nothing to replay. The first
            // batch after it (a new conversation) shows the sequence going backwards.
            set_fault(fleet, target, json!({"restart_kv_publisher": true})).await;
            let mut new = conversation(12);
            turn(&mut new, client, fleet, direct).await;
            wait_for(fleet, "the restart detected", async |f| {
                kv_stream(f, target).await["resets"].as_u64().unwrap_or(0) >= 1
            })
            .await;
            let m = cp_metrics(fleet).await;
            assert!(
                labelled_value(
                    &m,
                    "kvroute_kv_event_resets_total",
                    target,
                    Some("reason=\"restart\"")
                ) >= 1.0,
                "the reset was not counted as a restart:\n{m}"
            );
            // The old blocks are forgotten; the new conversation's are known.
            wait_for(fleet, "the state rebuilt from the new history", async |f| {
                let blocks = precise_blocks(f, target).await;
                blocks > 0.0 && blocks < before + 40.0
            })
            .await;
            let after = precise_blocks(fleet, target).await;
            assert!(
                after < before + 40.0,
                "old blocks still claimed: {before} before, {after} after the restart"
            );
            // Still live: precise scoring goes on for the endpoint.
            assert_eq!(
                endpoint_value(&m, "kvroute_endpoint_events_live", target),
                Some(1.0)
            );

            // The rebuilt state routes: the new conversation's turn 2 goes back to the replica.
            assert_next_turn_follows(
                &mut new,
                client,
                fleet,
                target,
                "turn 2 after the restart did not follow the rebuilt state",
            )
            .await;
            // And the old conversation is not sent there for a cache that is gone: wherever it
            // goes, it is served.
            let again = turn(&mut old, client, fleet, &fleet.url()).await;
            replica_of(&again, fleet);
        },
    )
    .await;
}
