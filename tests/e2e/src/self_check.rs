//! Routing that checks itself (issue #18), through real Envoy. A replica whose engine stops
//! serving its prefix cache (vLLM's `--no-enable-prefix-caching`, switched on at run time with
//! the simulator's fault API) delivers none of the hits the router's index believes it holds.
//! The control plane names it load-only with reason `mismatch`, no request fails meanwhile, and
//! once the replica serves its cache again a probe finds it so and it is trusted again. A
//! replica whose KV-event publisher never answers is named `degraded`, and so is one whose
//! engine's block size is not the router's, until it is restarted with the right one. A
//! replica whose KV-event publisher loses batches no replay can fill is named `degraded`
//! (`kv_event_gap`) and routed from the approximate index until its stream runs clean again.
//! A replica that hashes prompts otherwise than the router (a cache salt it ignores, another
//! chat template, a LoRA adapter known by another name) publishes events that never hold the
//! blocks of the requests it computed: it is named `degraded` (`hash_mismatch`) until it
//! hashes as the router does again.

use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, prometheus_sample};
use serde_json::json;

use crate::common::{self, Conversation, tools};

const MODEL: &str = "kvroute-self-check-model";
const TEST_TIMEOUT: Duration = Duration::from_secs(240);
/// Conversations the test may start while waiting for one state change.
const MAX_CONVERSATIONS: u64 = 120;
/// When a load-only replica is probed (the default is 30 s).
const PROBE_AFTER_MS: u64 = 2_000;

/// The learned latency model off. These tests need new conversations spread over both
/// replicas, but the misconfigured victim really is slower (it computes prompts the other
/// serves from cache), so a learned model rightly sends it less: with the model on, one run
/// in eight found too few believed hits there to judge. (A cold replica among warm ones is
/// no longer starved: it takes the warm ones' median correction, `cold_latency_from_warm`.)
fn no_learned_latency() -> serde_json::Value {
    json!({"enabled": false})
}

/// `endpoint`'s routing state in the exposition `text`, as `state/reason`.
fn state_in(text: &str, endpoint: &str) -> Option<&'static str> {
    let states = [
        "exact/",
        "load-only/mismatch",
        "degraded/no_kv_events",
        "degraded/block_size",
        "degraded/kv_event_gap",
        "degraded/hash_mismatch",
    ];
    states.into_iter().find(|s| {
        let (state, reason) = s.split_once('/').unwrap_or_default();
        let labels = format!("endpoint=\"{endpoint}\",state=\"{state}\",reason=\"{reason}\"");
        let series = format!("kvroute_endpoint_routing_state{{{labels}}}");
        prometheus_sample(text, &series) == Some(1.0)
    })
}

/// The replica's exported routing state, as `state/reason` (`None` before its first export).
async fn routing_state(fleet: &Fleet, endpoint: &str) -> Option<&'static str> {
    state_in(&common::cp_metrics(fleet).await, endpoint)
}

/// Runs three-turn conversations (each later turn believes a hit where its history went)
/// until `endpoint`'s state is `want`; returns the conversations and the requests it took.
/// Every request must be served: `Conversation::turn` fails the test on an error.
async fn converse_until(fleet: &Fleet, endpoint: &str, want: &str) -> (Vec<Conversation>, u64) {
    converse_with_until(fleet, endpoint, want, |c| c).await
}

/// [`converse_until`] with each new conversation passed through `shape` first (a cache salt,
/// an adapter for its model).
async fn converse_with_until(
    fleet: &Fleet,
    endpoint: &str,
    want: &str,
    shape: impl Fn(Conversation) -> Conversation,
) -> (Vec<Conversation>, u64) {
    let client = fleet.client().clone();
    let (mut conversations, mut requests) = (Vec::new(), 0);
    for seed in 1_000..1_000 + MAX_CONVERSATIONS {
        let mut c = shape(Conversation::new(MODEL, seed, 300, 30));
        for _ in 0..3 {
            c.turn(&client, fleet, 4, &[]).await;
            requests += 1;
        }
        conversations.push(c);
        if routing_state(fleet, endpoint).await == Some(want) {
            return (conversations, requests);
        }
    }
    never_became(fleet, endpoint, want, requests).await
}

/// How each test breaks one replica: `victim` exact to begin with, `fault` set there, then
/// three-turn conversations (through `shape`) until it is `want`, while `other` stays exact;
/// returns the conversations, for the test to go on with.
async fn fault_until(
    fleet: &Fleet,
    (victim, other): (&str, &str),
    fault: serde_json::Value,
    want: &str,
    shape: impl Fn(Conversation) -> Conversation,
) -> Vec<Conversation> {
    assert_eq!(routing_state(fleet, victim).await, Some("exact/"));
    common::set_sim_fault(fleet.client(), victim, &fault).await;
    let started = Instant::now();
    let (conversations, requests) = converse_with_until(fleet, victim, want, shape).await;
    eprintln!(
        "self-check: {victim} {want} after {requests} requests, {:.1} s (fault {fault}; bound: \
         {MAX_CONVERSATIONS} three-turn conversations)",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        routing_state(fleet, other).await,
        Some("exact/"),
        "{other} stays exact while {victim} is {want} (fault {fault})"
    );
    conversations
}

/// The fleet's two replicas: the one a test breaks first, then the other.
fn two_replicas(fleet: &Fleet) -> (String, String) {
    (
        fleet.replicas[0].address.clone(),
        fleet.replicas[1].address.clone(),
    )
}

/// One more turn of every conversation, each served wherever the router puts it
/// (`Conversation::turn` fails the test on an error).
async fn one_more_turn_each(fleet: &Fleet, conversations: &mut [Conversation]) {
    let client = fleet.client().clone();
    for c in conversations.iter_mut() {
        c.turn(&client, fleet, 4, &[]).await;
    }
}

/// Fails the test: `endpoint` never reached `want` in `requests` requests. Prints what the
/// control plane knew of every endpoint (outcomes served, state, queue), which tells a check
/// that never fired from one that never saw traffic.
async fn never_became(fleet: &Fleet, endpoint: &str, want: &str, requests: u64) -> ! {
    let endpoints = common::cp_get(fleet, "/debug/endpoints").await;
    panic!(
        "{endpoint} never became {want} in {requests} requests ({}); /debug/endpoints: {endpoints}",
        fleet.describe()
    );
}

/// Continues `conversations` one turn each, round and round (a pause of a quarter probe
/// interval between rounds), until `endpoint`'s state is `want`; returns the requests it took.
/// Twenty rounds outlast two probes: the first probe after a fix may credit histories the
/// replica was sent while still broken, which it never cached; that probe fails, and the next
/// comes twice the interval later.
async fn continue_until(
    fleet: &Fleet,
    conversations: &mut [Conversation],
    endpoint: &str,
    want: &str,
) -> u64 {
    let client = fleet.client().clone();
    let mut requests = 0;
    for round in 0..20u64 {
        // Two new conversations turn by turn at once. The old ones' histories may sit on both
        // replicas by now (the broken one's turns went elsewhere), and one request at a time
        // against two idle replicas can break every tie the same way. Two at once split by
        // load, so the fixed replica gets histories only it holds, credited on its probe.
        let mut pair = [0, 1].map(|i| Conversation::new(MODEL, 5_000 + 2 * round + i, 300, 30));
        for _ in 0..3 {
            let [a, b] = &mut pair;
            tokio::join!(
                a.turn(&client, fleet, 4, &[]),
                b.turn(&client, fleet, 4, &[])
            );
            requests += 2;
            if routing_state(fleet, endpoint).await == Some(want) {
                return requests;
            }
        }
        for c in conversations.iter_mut() {
            c.turn(&client, fleet, 4, &[]).await;
            requests += 1;
            if routing_state(fleet, endpoint).await == Some(want) {
                return requests;
            }
        }
        tokio::time::sleep(Duration::from_millis(PROBE_AFTER_MS / 4)).await;
    }
    never_became(fleet, endpoint, want, requests).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_serves_no_cached_prefix_is_routed_by_load_until_it_does() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-self-check", 2, MODEL, |cfg| {
            cfg.sim_args = vec!["--speed".into(), "20".into()];
            // Probe a load-only replica sooner than the default (the test's clock).
            cfg.control_plane_router = json!({
                "self_check": {"probe_after_ms": PROBE_AFTER_MS},
                "latency": no_learned_latency(),
            });
        })
        .await;
        let client = fleet.client().clone();
        let (victim, other) = two_replicas(&fleet);
        let mut conversations = fault_until(
            &fleet,
            (&victim, &other),
            json!({"prefix_caching_off": true}),
            "load-only/mismatch",
            |c| c,
        )
        .await;
        let metrics = common::cp_metrics(&fleet).await;
        let changes = format!(
            "kvroute_routing_state_changes_total{{endpoint=\"{victim}\",to=\"load-only\",reason=\"mismatch\"}}"
        );
        assert_eq!(prometheus_sample(&metrics, &changes), Some(1.0), "{metrics}");
        // Still broken: one more turn of every conversation, served wherever load puts it.
        one_more_turn_each(&fleet, &mut conversations).await;

        // Fixed. Once the probe is due, the conversations come back: those whose history the
        // replica holds are credited there again, it serves their hits, and it is exact again.
        common::set_sim_fault(&client, &victim, &json!({"prefix_caching_off": false})).await;
        let started = Instant::now();
        tokio::time::sleep(Duration::from_millis(PROBE_AFTER_MS + 500)).await;
        let to_exact = continue_until(&fleet, &mut conversations, &victim, "exact/").await;
        eprintln!(
            "self-check: {victim} exact again after {to_exact} requests, {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let endpoints = common::cp_get(&fleet, "/debug/endpoints").await;
        assert!(endpoints.contains("\"routing_state\""), "{endpoints}");

        // The fleet numbers account for the lost reuse: aimed at the victim and not delivered
        // while it was still trusted (eviction, as the router could tell then), then lost
        // because it was load-only (mismatch). `/debug/mismatch` shows where the views parted:
        // at block 0, nothing of the believed prefix served.
        let metrics = common::cp_metrics(&fleet).await;
        let pool = |name: &str| {
            let series = format!("kvroute_pool_{name}{{pool=\"{MODEL}\"}}");
            prometheus_sample(&metrics, &series).unwrap_or(0.0)
        };
        let gap = |reason: &str| {
            let series =
                format!("kvroute_pool_reuse_gap_tokens_total{{pool=\"{MODEL}\",reason=\"{reason}\"}}");
            prometheus_sample(&metrics, &series).unwrap_or(0.0)
        };
        let prompt = pool("served_prompt_tokens_total");
        eprintln!(
            "self-check: fleet numbers of {prompt} prompt tokens: available {:.1}%, aimed {:.1}%, \
             delivered {:.1}%; gap load_spill {:.1}%, eviction {:.1}%, mismatch {:.1}%, unheld {:.1}%",
            100.0 * pool("reuse_available_tokens_total") / prompt,
            100.0 * pool("reuse_aimed_tokens_total") / prompt,
            100.0 * pool("served_cached_tokens_total") / prompt,
            100.0 * gap("load_spill") / prompt,
            100.0 * gap("eviction") / prompt,
            100.0 * gap("mismatch") / prompt,
            100.0 * gap("unheld") / prompt,
        );
        assert!(gap("eviction") > 0.0 && gap("mismatch") > 0.0, "{metrics}");
        let worst: serde_json::Value =
            serde_json::from_str(&common::cp_get(&fleet, "/debug/mismatch").await).unwrap();
        let on_victim: Vec<&serde_json::Value> = worst
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["endpoint"] == victim.as_str())
            .collect();
        assert!(!on_victim.is_empty(), "{worst:#}");
        assert_eq!(on_victim[0]["parting_block"], 0, "{worst:#}");
    })
    .await;
}

/// Waits (20 s at most) until the control plane names the first of `degraded` (`what`, in a
/// failure) its state and `exact` exact: a fault of one replica shows on it alone.
async fn wait_one_degraded(fleet: &Fleet, what: &str, degraded: (&str, &str), exact: &str) {
    let (replica, state) = degraded;
    common::wait_cp_metrics(
        fleet,
        &format!("{what} {state}, the other exact"),
        Duration::from_secs(20),
        |text| state_in(text, replica) == Some(state) && state_in(text, exact) == Some("exact/"),
    )
    .await;
}

/// `n` two-turn conversations, seeded from `first_seed`: every request must be served
/// (`Conversation::turn` fails the test on an error), whatever state a replica is named.
async fn short_conversations(fleet: &Fleet, first_seed: u64, n: u64) {
    let client = fleet.client().clone();
    for seed in first_seed..first_seed + n {
        let mut c = Conversation::new(MODEL, seed, 200, 20);
        c.turn(&client, fleet, 4, &[]).await;
        c.turn(&client, fleet, 4, &[]).await;
    }
}

/// A replica whose KV-event publisher never answers (vLLM started without
/// `--kv-events-config`, or the control plane pointed at the wrong port): precise mode would
/// quietly mean approximate there. The control plane names it `degraded` (`no_kv_events`)
/// while the replica with a live stream is `exact`, and requests are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_event_publisher_never_answers_is_named_degraded() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        // Held until the test ends, so no other test's replica can take these ports.
        let (_events, events_url) = kvroute_harness::silent_tcp_endpoint().expect("a port");
        let (_replay, replay_url) = kvroute_harness::silent_tcp_endpoint().expect("a port");
        let mut cfg = common::fleet_config("e2e-self-check-events", 2, MODEL);
        cfg.kv_events = true;
        cfg.endpoint_extra = vec![json!({"kv_events": events_url, "kv_events_replay": replay_url})];
        let fleet = common::start_fleet(cfg, &tools).await;
        let (silent, live) = two_replicas(&fleet);
        wait_one_degraded(
            &fleet,
            "the silent replica",
            (&silent, "degraded/no_kv_events"),
            &live,
        )
        .await;
        short_conversations(&fleet, 3_000, 4).await;
    })
    .await;
}

/// A replica started with another block size than the router's (`--block-size 32` against the
/// default `router.precise.block_tokens` of 16): its KV events would name blocks the router
/// never hashes, and every block count the router turns into its tokens would be off. The
/// control plane reads vLLM's `block_size` label of `vllm:cache_config_info`, names the
/// replica `degraded` (`block_size`) while the other stays exact, and requests are served as
/// before; restarted with the configured size, it is exact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_block_size_is_degraded_until_it_matches() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let mut cfg = common::fleet_config("e2e-self-check-block-size", 2, MODEL);
        cfg.sim_args = vec!["--speed".into(), "20".into()];
        cfg.per_replica_args = vec![vec!["--block-size".into(), "32".into()]];
        let mut fleet = common::start_fleet(cfg, &tools).await;
        let (odd, even) = two_replicas(&fleet);
        let started = Instant::now();
        wait_one_degraded(
            &fleet,
            "the replica with 32-token blocks",
            (&odd, "degraded/block_size"),
            &even,
        )
        .await;
        eprintln!(
            "self-check: {odd} degraded (block_size) {:.1} s after the fleet was up",
            started.elapsed().as_secs_f64()
        );
        short_conversations(&fleet, 5_000, 4).await;

        // Fixed: restarted with the engine's default, the configured size.
        fleet
            .restart_replica(&tools, 0, Vec::new())
            .await
            .unwrap_or_else(|e| panic!("restarting {odd}: {e}"));
        let started = Instant::now();
        let text = common::wait_cp_metrics(
            &fleet,
            "the restarted replica exact again",
            Duration::from_secs(20),
            |text| state_in(text, &odd) == Some("exact/"),
        )
        .await;
        eprintln!(
            "self-check: {odd} exact again {:.1} s after its restart",
            started.elapsed().as_secs_f64()
        );
        for to in ["degraded", "exact"] {
            let series = format!(
                "kvroute_routing_state_changes_total{{endpoint=\"{odd}\",to=\"{to}\",reason=\"block_size\"}}"
            );
            assert_eq!(prometheus_sample(&text, &series), Some(1.0), "{text}");
        }
        short_conversations(&fleet, 6_000, 1).await;
    })
    .await;
}

/// Two replicas publishing KV events with replay, the control plane subscribed and tokenising
/// through their render API, the chat route in precise mode, `router.self_check` as given;
/// returned once both streams are live.
async fn precise_fleet(
    tools: &kvroute_harness::Tools,
    name: &str,
    self_check: serde_json::Value,
) -> Fleet {
    precise_fleet_with(tools, name, json!({ "self_check": self_check }), &[]).await
}

/// [`precise_fleet`] with `router_extra`'s sections set in the control plane's `router:` and
/// `sim_args` for every replica.
async fn precise_fleet_with(
    tools: &kvroute_harness::Tools,
    name: &str,
    router_extra: serde_json::Value,
    sim_args: &[&str],
) -> Fleet {
    let mut cfg = common::fleet_config(name, 2, MODEL);
    cfg.sim_args = vec!["--speed".into(), "20".into()];
    cfg.sim_args.extend(sim_args.iter().map(|a| a.to_string()));
    cfg.kv_events = true;
    cfg.control_plane_extra = common::remote_tokenizer();
    let mut router = common::precise_router(300);
    router["latency"] = no_learned_latency();
    for (section, value) in router_extra.as_object().into_iter().flatten() {
        router[section] = value.clone();
    }
    cfg.control_plane_router = router;
    cfg.plugin_config = json!({
        "route_timeout_ms": 3000,
        "routes": [{"path": "/v1/chat/completions", "api": "chat", "mode": "precise"}]
    });
    let fleet = common::start_fleet(cfg, tools).await;
    common::wait_events_live(&fleet, Duration::from_secs(20)).await;
    fleet
}

/// Batches in sequence a replica's stream must deliver after an unfilled gap before its event
/// index is trusted again (`router.self_check.clean_batches_after_gap`, 32 by default).
const CLEAN_BATCHES: u32 = 8;

/// A replica whose KV-event publisher loses batches (one in two, neither published nor kept
/// for replay: a PUB high-water mark dropping what the replay buffer no longer holds), in
/// precise mode. The control plane sees each sequence gap, asks the replay socket, which cannot
/// fill it, drops the replica's event index and names it `degraded` (`kv_event_gap`): it is
/// scored from the approximate index, the other replica stays exact, and no request fails.
/// While batches keep being lost it stays degraded; once every batch is published again,
/// [`CLEAN_BATCHES`] in a row make it exact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_loses_event_batches_is_degraded_until_its_stream_runs_clean() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let self_check = json!({"clean_batches_after_gap": CLEAN_BATCHES});
        let fleet = precise_fleet(&tools, "e2e-self-check-gap", self_check).await;
        let client = fleet.client().clone();
        let (victim, other) = two_replicas(&fleet);
        let mut conversations = fault_until(
            &fleet,
            (&victim, &other),
            json!({"lose_kv_batch_every": 2}),
            "degraded/kv_event_gap",
            |c| c,
        )
        .await;
        let metrics = common::cp_metrics(&fleet).await;
        let sample = |series: String| prometheus_sample(&metrics, &series).unwrap_or(0.0);
        assert!(
            sample(format!(
                "kvroute_kv_event_gaps_total{{endpoint=\"{victim}\"}}"
            )) >= 1.0,
            "{metrics}"
        );
        assert!(
            sample(format!(
                "kvroute_kv_event_replays_total{{endpoint=\"{victim}\",result=\"failed\"}}"
            )) >= 1.0,
            "the gap was not tried through the replay socket first: {metrics}"
        );
        assert!(
            sample(format!(
                "kvroute_kv_event_resets_total{{endpoint=\"{victim}\",reason=\"unreplayable_gap\"}}"
            )) >= 1.0,
            "{metrics}"
        );
        assert_degraded_in_debug_endpoints(&fleet, &victim, "kv_event_gap").await;

        // Still losing batches: every conversation goes on, served wherever the approximate
        // index and load put it, and the replica stays degraded.
        one_more_turn_each(&fleet, &mut conversations).await;
        assert_eq!(
            routing_state(&fleet, &victim).await,
            Some("degraded/kv_event_gap")
        );
        assert_newest_decision_scored(&fleet, &victim, &other).await;

        // Fixed: every batch published again. The stream runs clean and the replica is exact.
        common::set_sim_fault(&client, &victim, &json!({"lose_kv_batch_every": 0})).await;
        let started = Instant::now();
        let (_, to_exact) = converse_until(&fleet, &victim, "exact/").await;
        eprintln!(
            "self-check: {victim} exact again after {to_exact} requests, {:.1} s \
             ({CLEAN_BATCHES} batches in sequence needed)",
            started.elapsed().as_secs_f64()
        );
        assert_changed_each_way(&fleet, &victim, "kv_event_gap").await;
    })
    .await;
}

/// Verdicts (served requests' first blocks looked up in the event index) the hash check
/// decides over in the tests below (`router.self_check.window`, 32 by default).
const HASH_WINDOW: usize = 16;

/// The course of a hashing mismatch on `fleet`'s first replica: the simulator's `fault` set
/// there (`{fault: true}`), new conversations (passed through `shape`) until it is `degraded`
/// (`hash_mismatch`), with the other replica exact and `/debug/endpoints` agreeing; every
/// conversation one turn more, and it is still degraded; the fault cleared (`{fault: false}`),
/// new conversations until it is exact again, each change counted once. Every request must be
/// served throughout (`Conversation::turn` fails the test on an error). `what` names the fault
/// in the printed times.
async fn degraded_by_hashing_until_cleared(
    fleet: &Fleet,
    what: &str,
    fault: &str,
    shape: impl Fn(Conversation) -> Conversation,
) {
    let client = fleet.client().clone();
    let (victim, other) = two_replicas(fleet);
    let mut conversations = fault_until(
        fleet,
        (&victim, &other),
        json!({ fault: true }),
        "degraded/hash_mismatch",
        &shape,
    )
    .await;
    assert_degraded_in_debug_endpoints(fleet, &victim, "hash_mismatch").await;
    one_more_turn_each(fleet, &mut conversations).await;
    assert_eq!(
        routing_state(fleet, &victim).await,
        Some("degraded/hash_mismatch"),
        "still {what}: still degraded"
    );
    assert_newest_decision_scored(fleet, &victim, &other).await;

    common::set_sim_fault(&client, &victim, &json!({ fault: false })).await;
    let started = Instant::now();
    let (_, to_exact) = converse_with_until(fleet, &victim, "exact/", &shape).await;
    eprintln!(
        "self-check: {victim} exact again after {to_exact} requests, {:.1} s ({what} cleared)",
        started.elapsed().as_secs_f64()
    );
    assert_changed_each_way(fleet, &victim, "hash_mismatch").await;
}

/// The whole of a hashing test on a plain precise fleet called `name` (the hash check deciding
/// over [`HASH_WINDOW`] verdicts): [`degraded_by_hashing_until_cleared`] within
/// [`TEST_TIMEOUT`].
async fn hash_mismatch_test(
    name: &str,
    what: &str,
    fault: &str,
    shape: impl Fn(Conversation) -> Conversation,
) {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let fleet = precise_fleet(&tools, name, json!({"window": HASH_WINDOW})).await;
        degraded_by_hashing_until_cleared(&fleet, what, fault, shape).await;
    })
    .await;
}

/// A replica whose engine leaves `cache_salt` out of its block hashes (an engine that does not
/// know the field), in precise mode with salted traffic (three tenants). Its KV events name
/// unsalted blocks, which no salted request of the router's ever matches, and neither the
/// router nor the engine ever believes a hit that is not delivered, so believed-against-
/// delivered cannot see it. The first blocks of the requests it computed are looked up in its
/// event index a second after their answers: almost never there, it is named `degraded`
/// (`hash_mismatch`) and routed from the approximate index until it hashes the salt again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_ignores_the_cache_salt_is_degraded_until_it_hashes_it() {
    hash_mismatch_test(
        "e2e-self-check-salt",
        "salt ignored",
        "ignore_cache_salt",
        |mut c| {
            c.cache_salt = Some(format!("tenant-{}", c.seed % 3));
            c
        },
    )
    .await;
}

/// A replica serving chat with another chat template than the pool's (one that writes a
/// default system message first) while the router tokenises with the pool's: every prompt's
/// tokens differ there from block 0 on, so its KV events never hold a block the router
/// hashed. It is named `degraded` (`hash_mismatch`) and routed approximately until it serves
/// the pool's template again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_chat_template_is_degraded_until_it_matches() {
    hash_mismatch_test(
        "e2e-self-check-template",
        "other chat template",
        "other_chat_template",
        |c| c,
    )
    .await;
}

/// The LoRA adapter both replicas serve.
const ADAPTER: &str = "kvroute-self-check-adapter";

/// A replica that knows the LoRA adapter the requests name under another name (its block
/// hashes and KV events name `<adapter>-alias`): the router hashes the adapter's requests
/// under the adapter's name, so that replica's events never hold them. It is named `degraded`
/// (`hash_mismatch`) and routed approximately until it names the adapter as the requests do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_knows_the_adapter_by_another_name_is_degraded_until_it_does_not() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        // The aliased replica reports its running requests under the alias, so LoRA placement
        // sees its adapter slots held by another adapter and steers the adapter's requests
        // away (only 6-21 of 360 reached it in failing runs: too few computed prompts for the
        // check to judge). This test is about the check, so placement costs nothing here.
        let router_extra = json!({
            "self_check": {"window": HASH_WINDOW},
            "lora": {"load_ms": 0.0, "full_penalty_ms": 0.0},
        });
        let module = format!("{ADAPTER}=/adapters/self-check");
        let fleet = precise_fleet_with(
            &tools,
            "e2e-self-check-lora",
            router_extra,
            &["--lora-modules", &module],
        )
        .await;
        degraded_by_hashing_until_cleared(&fleet, "LoRA alias", "lora_alias", |mut c| {
            c.model = ADAPTER;
            c
        })
        .await;
    })
    .await;
}

/// Asserts `/debug/endpoints` names `endpoint` degraded for `reason`.
async fn assert_degraded_in_debug_endpoints(fleet: &Fleet, endpoint: &str, reason: &str) {
    let endpoints: serde_json::Value =
        serde_json::from_str(&common::cp_get(fleet, "/debug/endpoints").await).unwrap();
    let listed = endpoints
        .as_array()
        .and_then(|a| a.iter().find(|e| e["address"] == endpoint))
        .unwrap_or_else(|| panic!("{endpoint} not in /debug/endpoints: {endpoints:#}"));
    assert_eq!(listed["routing_state"], "degraded", "{listed:#}");
    assert_eq!(listed["state_reason"], reason, "{listed:#}");
}

/// Asserts that the newest decision (a precise request, made while `degraded` is degraded)
/// scored `degraded` from the approximate index and `exact` from its KV-event index: the
/// fallback the state names, seen in a decision's candidates.
async fn assert_newest_decision_scored(fleet: &Fleet, degraded: &str, exact: &str) {
    let recent: serde_json::Value =
        serde_json::from_str(&common::cp_get(fleet, "/debug/decisions?limit=1").await).unwrap();
    let id = recent[0]["decision_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no recent decision: {recent}"));
    let decision: serde_json::Value =
        serde_json::from_str(&common::cp_get(fleet, &format!("/debug/decisions/{id}")).await)
            .unwrap();
    let precise = |endpoint: &str| {
        decision["candidates"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["endpoint"] == endpoint))
            .unwrap_or_else(|| panic!("{endpoint} not a candidate of {decision:#}"))["precise"]
            .as_bool()
    };
    assert_eq!(precise(degraded), Some(false), "{decision:#}");
    assert_eq!(precise(exact), Some(true), "{decision:#}");
}

/// Asserts `endpoint` changed into degraded and back to exact once each, for `reason`.
async fn assert_changed_each_way(fleet: &Fleet, endpoint: &str, reason: &str) {
    let metrics = common::cp_metrics(fleet).await;
    for to in ["degraded", "exact"] {
        let series = format!(
            "kvroute_routing_state_changes_total{{endpoint=\"{endpoint}\",to=\"{to}\",reason=\"{reason}\"}}"
        );
        assert_eq!(prometheus_sample(&metrics, &series), Some(1.0), "{metrics}");
    }
}
