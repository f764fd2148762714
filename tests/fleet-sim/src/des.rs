//! The discrete-event driver: N simulated engines, one policy, virtual time.
//!
//! Deterministic for a seed: one event heap ordered by (time, sequence number). Engines step
//! back to back while they have work; a step's events become visible at its end. Replica
//! metrics are "scraped" on an interval, so policies see them as stale as a real router would.
//! Later chat turns arrive a think time after their previous turn finished and repeat its
//! prompt and generated answer, so the engines' prefix caches see real multi-turn reuse (an
//! agent's subagents fork from one turn the same way). Routers see only what a request
//! carries: its tokens and the client's `max_tokens` cap, never the length it will generate.

use crate::events::EventQueue;
use hashbrown::HashMap;
use scorer_core::precise::KvEvent as CoreKvEvent;
use vllm_wire::kv_events::EventBatch;

use super::policy::{ExactFleet, Policy, PolicyRequest, ReplicaSnapshot, Served};
use super::workload::{PromptSource, Workload, push_stream};
use vllm_sim::{Engine, EngineConfig, EngineRequest, KvEvent, Profile, RequestEvent, SimError};

/// Settings of one simulated run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Replicas in the fleet.
    pub replicas: usize,
    /// Engine profile of every replica.
    pub profile: Profile,
    /// Seed of policies and engine jitter.
    pub seed: u64,
    /// How often replica metrics are scraped (virtual ms).
    pub metrics_interval_ms: f64,
}

/// What happened to one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestRecord {
    /// Arrival time (ms).
    pub arrival_ms: f64,
    /// First token time (ms), when it got one.
    pub first_token_ms: Option<f64>,
    /// Finish time (ms), when it finished.
    pub finish_ms: Option<f64>,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Output tokens generated.
    pub output_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// Replica it was routed to.
    pub replica: usize,
    /// Cached tokens the policy predicted, if it predicts.
    pub predicted_cached_tokens: Option<u32>,
    /// The engine refused it (too long for the model or the cache).
    pub rejected: bool,
    /// It reached its replica without passing through the router ([`RunOptions::unseen_fraction`]).
    pub unseen: bool,
    /// How much later than at the exact best replica its first token would have come, given
    /// the fleet's exact state when it was routed ([`RunOptions::regret`]; see
    /// [`crate::oracle::regret_ms`]).
    pub regret_ms: Option<f64>,
}

/// The outcome of one run.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// Policy name.
    pub policy: String,
    /// Per-request records, in workload order.
    pub records: Vec<RequestRecord>,
    /// Preemptions summed over replicas.
    pub preemptions: u64,
    /// Largest waiting queue seen on any replica at a scrape.
    pub max_waiting: u32,
    /// Prompt tokens looked up in prefix caches.
    pub prefix_queries: u64,
    /// Prompt tokens found there.
    pub prefix_hits: u64,
    /// Time from first arrival to last finish (ms).
    pub makespan_ms: f64,
    /// Share of decisions taken by a proxy's copy of the state (policies that decide in proxies).
    pub local_decision_fraction: Option<f64>,
    /// Endpoint routing-state changes of kvroute's self-check ([`Policy::routing_state_changes`]).
    pub routing_state_changes: Option<u64>,
    /// kvroute's fleet numbers ([`Policy::reuse`]).
    pub reuse: Option<scorer_core::reuse::ReuseTotals>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Arrival(usize),
    StepDone(usize),
    Scrape,
}

/// One engine step's KV events as the control plane applies them: encoded as vLLM publishes
/// them and read back through the same conversion (`vllm_wire::kv_events::EventBatch`), which
/// keeps only the full-attention group's events of a hybrid model, so a precise policy sees
/// what a real one would.
fn router_events(now_ms: f64, events: &[KvEvent]) -> Vec<CoreKvEvent> {
    EventBatch::from(vllm_sim::kv_events::wire_batch(now_ms / 1e3, events, 0)).events
}

/// What a run adds to [`SimConfig`]: what the client sends and a mixed-hardware pool.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The `max_tokens` every request carries (the client's cap), `None` when the client sends
    /// none. Routers see only this; the engine generates the request's real length, cut at the
    /// cap as vLLM would (the simulated engine has no EOS, so the real length stands in for it).
    pub max_tokens: Option<u32>,
    /// One profile per replica for a mixed-hardware pool; empty runs `cfg.profile` everywhere.
    pub replica_profiles: Vec<Profile>,
    /// The share of the traffic that reaches the replicas without passing through the router
    /// (another gateway, clients that call a replica directly), picked per session (per request
    /// without one) and sent to a replica by a hash of it. The router never sees these
    /// requests; they fill and evict the same caches, which a precise router learns from the
    /// engines' KV events and an approximate one cannot. Reports cover the routed requests.
    pub unseen_fraction: f64,
    /// Measure every routed request's placement regret against the greedy oracle
    /// ([`RequestRecord::regret_ms`]). It probes the replicas' exact state once per request
    /// (what the oracle policy costs), so it is off unless asked for.
    pub regret: bool,
}

/// Whether request `i` bypasses the router under `options`, and the replica it goes to.
fn unseen_replica(
    workload: &Workload,
    options: &RunOptions,
    i: usize,
    seed: u64,
    replicas: usize,
) -> Option<usize> {
    if options.unseen_fraction <= 0.0 {
        return None;
    }
    let key = match workload.requests[i].session {
        Some(session) => session.wrapping_mul(2).wrapping_add(1),
        None => (i as u64).wrapping_mul(2),
    };
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&key.to_le_bytes(), seed ^ 0x756e_7365_656e);
    let unit = (h >> 11) as f64 / (1u64 << 53) as f64;
    (unit < options.unseen_fraction).then(|| (h % replicas as u64) as usize)
}

/// Replays `workload` through `cfg.replicas` engines routed by `policy`; the client sends no
/// `max_tokens` (see [`run_with`]).
pub fn run(
    workload: &Workload,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
) -> Result<RunResult, SimError> {
    run_with(workload, policy, cfg, &RunOptions::default())
}

/// A request the router's own queue holds (Dynamo's router queue): its index and tokens.
struct Held {
    id: usize,
    tokens: Vec<u32>,
}

/// Request `id` with prompt `tokens` as the router sees it: the driver offers a request to the
/// policy at arrival, again from the router's queue and when it routes it, and every offer must
/// carry the same cap, session and `cache_control` marking.
fn policy_request<'a>(
    workload: &Workload,
    options: &RunOptions,
    id: usize,
    tokens: &'a [u32],
) -> PolicyRequest<'a> {
    PolicyRequest {
        id,
        tokens,
        max_tokens: options.max_tokens,
        session: workload.requests[id].session,
        marked_tokens: workload.cache_control.marked_tokens(tokens.len()),
        api: workload.api,
    }
}

/// Replays `workload` through `cfg.replicas` engines routed by `policy`, with `options`.
/// Each policy's metrics are scraped on its own interval ([`Policy::metrics_interval_ms`],
/// else `cfg.metrics_interval_ms`), so it sees them as stale as its real router does.
pub fn run_with(
    workload: &Workload,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
    options: &RunOptions,
) -> Result<RunResult, SimError> {
    let wants_events = policy.wants_kv_events();
    let profiles: Vec<Profile> = if options.replica_profiles.is_empty() {
        vec![cfg.profile.clone(); cfg.replicas]
    } else {
        if options.replica_profiles.len() != cfg.replicas {
            return Err(SimError::Config(format!(
                "{} replica profiles for {} replicas",
                options.replica_profiles.len(),
                cfg.replicas
            )));
        }
        options.replica_profiles.clone()
    };
    let mut fleet = EngineSteps::new(build_mixed_engines(&profiles, cfg.seed, wants_events)?);
    let n = workload.requests.len();
    let mut records = vec![RequestRecord::default(); n];
    // A request's dependents: later chat or agent turns, subagents forked from it.
    let mut dependents: HashMap<usize, Vec<usize>> = HashMap::new();
    for i in 0..n {
        if let Some(p) = workload.depends_on(i) {
            dependents.entry(p).or_default().push(i);
        }
    }
    // Prompt + generated tokens of requests later requests repeat, with how many still will.
    let mut context: HashMap<usize, (Vec<u32>, usize)> = HashMap::new();
    let mut queue = EventQueue::new();
    for i in 0..n {
        if workload.depends_on(i).is_none() {
            queue.push(workload.requests[i].arrival_ms, Event::Arrival(i));
        }
    }
    queue.push(0.0, Event::Scrape);
    let scrape_ms = policy
        .metrics_interval_ms()
        .unwrap_or(cfg.metrics_interval_ms)
        .max(1e-3);
    let mut unresolved = n;
    let mut held: std::collections::VecDeque<Held> = std::collections::VecDeque::new();
    let mut result = RunResult {
        policy: policy.name().to_string(),
        ..RunResult::default()
    };
    // Releases request `i`'s dependents at `now` (each after its think time).
    let release = |i: usize, now: f64, queue: &mut EventQueue<Event>| {
        for &d in dependents.get(&i).into_iter().flatten() {
            queue.push(now + workload.requests[d].arrival_ms, Event::Arrival(d));
        }
    };

    while let Some((now, event)) = queue.pop() {
        let mut ready: Vec<Held> = Vec::new();
        match event {
            Event::Arrival(i) => {
                let spec = &workload.requests[i];
                let tokens = match &spec.prompt {
                    PromptSource::Continue { previous, user } => {
                        let mut t = take_context(&mut context, *previous)
                            .unwrap_or_else(|| workload.prompt_tokens(*previous));
                        push_stream(&mut t, user.0, user.1);
                        t
                    }
                    _ => workload.prompt_tokens(i),
                };
                let unseen = unseen_replica(workload, options, i, cfg.seed, cfg.replicas);
                records[i] = RequestRecord {
                    arrival_ms: now,
                    prompt_tokens: tokens.len() as u32,
                    replica: unseen.unwrap_or_default(),
                    unseen: unseen.is_some(),
                    ..RequestRecord::default()
                };
                if let Some(d) = dependents.get(&i) {
                    context.insert(i, (tokens.clone(), d.len()));
                }
                let request = policy_request(workload, options, i, &tokens);
                if unseen.is_some() || (held.is_empty() && !policy.holds_in_queue(&request, now)) {
                    ready.push(Held { id: i, tokens });
                } else {
                    held.push_back(Held { id: i, tokens });
                }
            }
            Event::StepDone(r) => {
                let Some(out) = fleet.take_step(r) else {
                    continue;
                };
                for e in &out.events {
                    match e {
                        RequestEvent::FirstToken {
                            request,
                            token_id,
                            cached_tokens,
                        } => {
                            let i = *request as usize;
                            records[i].first_token_ms = Some(now);
                            records[i].cached_tokens = *cached_tokens;
                            records[i].output_tokens += 1;
                            if let Some((c, _)) = context.get_mut(&i) {
                                c.push(*token_id);
                            }
                            if !records[i].unseen {
                                policy.on_first_token(i, r, now);
                            }
                        }
                        RequestEvent::Token { request, token_id } => {
                            let i = *request as usize;
                            records[i].output_tokens += 1;
                            if let Some((c, _)) = context.get_mut(&i) {
                                c.push(*token_id);
                            }
                        }
                        RequestEvent::Preempted { .. } => {}
                        RequestEvent::Finished { request, summary } => {
                            let i = *request as usize;
                            records[i].finish_ms = Some(now);
                            records[i].output_tokens = summary.output_tokens;
                            unresolved -= 1;
                            if !records[i].unseen {
                                policy.on_finish(
                                    i,
                                    r,
                                    now,
                                    Served {
                                        cached_tokens: summary.cached_tokens,
                                        output_tokens: Some(summary.output_tokens),
                                    },
                                );
                            }
                            release(i, now, &mut queue);
                        }
                    }
                }
                if wants_events && !out.kv_events.is_empty() {
                    let events = router_events(now, &out.kv_events);
                    policy.on_kv_events(r, &events, now);
                }
                fleet.start_step(r, now, &mut queue, Event::StepDone);
                // The router's queue, oldest first, while the router lets requests go.
                while let Some(front) = held.front() {
                    let request = policy_request(workload, options, front.id, &front.tokens);
                    if policy.holds_in_queue(&request, now) {
                        break;
                    }
                    ready.extend(held.pop_front());
                }
            }
            Event::Scrape => {
                let snapshots: Vec<ReplicaSnapshot> = fleet
                    .engines
                    .iter()
                    .map(|e| ReplicaSnapshot::of(&e.stats(), &e.config().profile))
                    .collect();
                result.max_waiting = result
                    .max_waiting
                    .max(snapshots.iter().map(|s| s.waiting).max().unwrap_or(0));
                policy.on_metrics(&snapshots, now);
                if unresolved > 0 {
                    queue.push(now + scrape_ms, Event::Scrape);
                }
            }
        }
        for Held { id: i, tokens } in ready {
            let spec = &workload.requests[i];
            let request = policy_request(workload, options, i, &tokens);
            let busy_until = fleet.busy_until_ms();
            let exact = ExactFleet {
                engines: &fleet.engines,
                busy_until_ms: &busy_until,
            };
            // Picked at arrival: an unseen request's replica is already in its record.
            let unseen = records[i].unseen.then_some(records[i].replica);
            let replica = match unseen {
                Some(replica) => replica,
                None => policy
                    .route_exact(&request, &exact, now)
                    .unwrap_or_else(|| policy.route(&request, now))
                    .min(cfg.replicas - 1),
            };
            records[i].replica = replica;
            if unseen.is_none() {
                records[i].predicted_cached_tokens = policy.predicted_cached_tokens(i);
                if options.regret {
                    records[i].regret_ms = crate::oracle::regret_ms(&exact, &tokens, now, replica);
                }
            }
            let output = options
                .max_tokens
                .map_or(spec.output_tokens, |cap| spec.output_tokens.min(cap.max(1)));
            let request = arriving(i, tokens, output, now);
            if fleet
                .add(replica, request, now, &mut queue, Event::StepDone)
                .is_err()
            {
                records[i].rejected = true;
                unresolved -= 1;
                if unseen.is_none() {
                    policy.on_refused(i, replica, now);
                }
                release(i, now, &mut queue);
            }
        }
    }
    for e in &fleet.engines {
        let s = e.stats();
        result.preemptions += s.num_preemptions;
        result.prefix_queries += s.prefix_cache_queries;
        result.prefix_hits += s.prefix_cache_hits;
    }
    let first = records
        .iter()
        .map(|r| r.arrival_ms)
        .fold(f64::INFINITY, f64::min);
    let last = records
        .iter()
        .filter_map(|r| r.finish_ms)
        .fold(0.0, f64::max);
    result.makespan_ms = (last - first).max(0.0);
    result.local_decision_fraction = policy.local_decision_fraction();
    result.routing_state_changes = policy.routing_state_changes();
    result.reuse = policy.reuse();
    result.records = records;
    Ok(result)
}

/// Takes one use of request `previous`'s context (prompt and answer), dropping it after its
/// last dependent took it.
fn take_context(
    context: &mut HashMap<usize, (Vec<u32>, usize)>,
    previous: usize,
) -> Option<Vec<u32>> {
    let (tokens, left) = context.get_mut(&previous)?;
    if *left > 1 {
        *left -= 1;
        return Some(tokens.clone());
    }
    context.remove(&previous).map(|(t, _)| t)
}

/// One engine per profile, each seeded from `seed` and its index.
pub(crate) fn build_mixed_engines(
    profiles: &[Profile],
    seed: u64,
    kv_events: bool,
) -> Result<Vec<Engine>, SimError> {
    profiles
        .iter()
        .enumerate()
        .map(|(i, profile)| {
            let mut ec = EngineConfig::new(profile.clone());
            ec.seed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9);
            ec.kv_events = kv_events;
            Engine::new(ec)
        })
        .collect()
}

/// `replicas` engines of `profile`, each seeded from `seed` and its index, publishing KV events
/// when `kv_events` (the fleet every fleet-sim model steps).
pub(crate) fn build_engines(
    profile: &Profile,
    replicas: usize,
    seed: u64,
    kv_events: bool,
) -> Result<Vec<Engine>, SimError> {
    build_mixed_engines(&vec![profile.clone(); replicas], seed, kv_events)
}

/// Request `id` of `prompt_tokens`, arriving at `now_ms` with no LoRA adapter and no cache
/// salt: what the fleet-sim models hand their engines.
pub(crate) fn arriving(
    id: usize,
    prompt_tokens: Vec<u32>,
    max_output_tokens: u32,
    now_ms: f64,
) -> EngineRequest {
    EngineRequest {
        id: id as u64,
        prompt_tokens,
        max_output_tokens,
        lora: None,
        cache_salt: None,
        arrival_s: now_ms / 1000.0,
    }
}

/// A fleet's engines with the output of each one's step in flight: the arrival and step-end
/// bookkeeping the routed simulation and the fairness simulation share.
pub(crate) struct EngineSteps {
    /// The engines, by replica index.
    pub(crate) engines: Vec<Engine>,
    pending: Vec<Option<vllm_sim::StepOutput>>,
}

impl EngineSteps {
    /// The fleet, every engine idle.
    pub(crate) fn new(engines: Vec<Engine>) -> Self {
        let pending = vec![None; engines.len()];
        Self { engines, pending }
    }

    /// Adds `request` to `replica`'s engine and, when that engine has no step in flight,
    /// starts one; an error means the engine refused the request.
    pub(crate) fn add<E>(
        &mut self,
        replica: usize,
        request: EngineRequest,
        now_ms: f64,
        queue: &mut EventQueue<E>,
        step_done: fn(usize) -> E,
    ) -> Result<(), SimError> {
        self.engines[replica].add_request(request)?;
        if self.pending[replica].is_none() {
            self.start_step(replica, now_ms, queue, step_done);
        }
        Ok(())
    }

    /// When each engine's step in flight ends (virtual ms), `None` for idle engines.
    pub(crate) fn busy_until_ms(&self) -> Vec<Option<f64>> {
        self.pending
            .iter()
            .map(|p| p.as_ref().map(|o| o.end_s * 1000.0))
            .collect()
    }

    /// The output of `replica`'s step that just ended (`None` if none was in flight).
    pub(crate) fn take_step(&mut self, replica: usize) -> Option<vllm_sim::StepOutput> {
        self.pending[replica].take()
    }

    /// Starts `replica`'s next step (see [`start_step`]).
    pub(crate) fn start_step<E>(
        &mut self,
        replica: usize,
        now_ms: f64,
        queue: &mut EventQueue<E>,
        step_done: fn(usize) -> E,
    ) {
        start_step(
            &mut self.engines[replica],
            &mut self.pending[replica],
            replica,
            now_ms,
            queue,
            step_done,
        );
    }
}

/// Starts `replica`'s next engine step if it has work, keeping its output until the step's end
/// time, when `step_done(replica)` fires (shared by every fleet-sim model that steps engines).
pub(crate) fn start_step<E>(
    engine: &mut Engine,
    pending: &mut Option<vllm_sim::StepOutput>,
    replica: usize,
    now_ms: f64,
    queue: &mut EventQueue<E>,
    step_done: fn(usize) -> E,
) {
    if !engine.has_work() {
        return;
    }
    let out = engine.step(now_ms / 1000.0);
    if out.num_scheduled == 0 && out.events.is_empty() {
        // Nothing fits right now; the next arrival or finish elsewhere restarts it.
        return;
    }
    let end_ms = (out.end_s * 1000.0).max(now_ms);
    *pending = Some(out);
    queue.push(end_ms, step_done(replica));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{RequestSpec, client_max_tokens, from_spec};
    use scorer_core::protocol::ApiKind;

    /// Records what a router is shown, routing round robin.
    #[derive(Default)]
    struct Spy {
        seen: Vec<(usize, Option<u32>)>,
        finished: Vec<usize>,
        refused: Vec<usize>,
        scrapes: Vec<f64>,
        interval: Option<f64>,
        next: usize,
    }
    impl Policy for Spy {
        fn name(&self) -> &str {
            "spy"
        }
        fn metrics_interval_ms(&self) -> Option<f64> {
            self.interval
        }
        fn on_metrics(&mut self, _: &[ReplicaSnapshot], now_ms: f64) {
            self.scrapes.push(now_ms);
        }
        fn route(&mut self, r: &PolicyRequest<'_>, _: f64) -> usize {
            self.seen.push((r.id, r.max_tokens));
            self.next += 1;
            self.next % 2
        }
        fn on_finish(&mut self, request: usize, _: usize, _: f64, _: Served) {
            self.finished.push(request);
        }
        fn on_refused(&mut self, request: usize, _: usize, _: f64) {
            self.refused.push(request);
        }
    }

    // A prompt longer than the model's context is refused by the engine; the router hears of
    // it as vLLM's 400, not as a request served with nothing cached, and kvroute keeps no
    // prefix credit for it: the same prompt again is not a hit anywhere.
    #[test]
    fn a_refused_prompt_reaches_the_router_as_refused() {
        let request = |arrival_ms: f64, tokens: u32| RequestSpec {
            arrival_ms,
            prompt: PromptSource::Segments(vec![(7, tokens)]),
            output_tokens: 4,
            session: None,
        };
        let workload = Workload {
            name: "refused".into(),
            requests: vec![
                request(0.0, 200_000),
                request(10.0, 300),
                request(20.0, 200_000),
            ],
            cache_control: Default::default(),
            api: ApiKind::Chat,
        };
        let mut spy = Spy::default();
        let result = run(&workload, &mut spy, &cfg()).unwrap();
        assert_eq!(spy.refused, vec![0, 2]);
        assert_eq!(spy.finished, vec![1]);
        assert!(result.records[0].rejected && result.records[2].rejected);
        let mut kvroute = crate::policy::build("kvroute", 2, 1).unwrap();
        run(&workload, kvroute.as_mut(), &cfg()).unwrap();
        assert_eq!(kvroute.predicted_cached_tokens(2), Some(0));
    }

    // Placement regret is measured against the oracle's own probes: the oracle's decisions
    // have none, and a policy that ignores the caches has some on a workload that shares.
    #[test]
    fn the_oracle_places_with_no_regret_and_round_robin_with_some() {
        let workload = from_spec("multi-turn:conversations=12,turns=3,rps=6", 2).unwrap();
        let options = RunOptions {
            regret: true,
            ..RunOptions::default()
        };
        let mut oracle = crate::oracle::Oracle::new(1);
        let result = run_with(&workload, &mut oracle, &cfg(), &options).unwrap();
        let regrets: Vec<f64> = result.records.iter().filter_map(|r| r.regret_ms).collect();
        assert_eq!(regrets.len(), workload.requests.len());
        assert!(regrets.iter().all(|&r| r == 0.0), "{regrets:?}");
        let mut rr = crate::policy::build("round-robin", 2, 1).unwrap();
        let result = run_with(&workload, rr.as_mut(), &cfg(), &options).unwrap();
        assert!(result.records.iter().any(|r| r.regret_ms > Some(1.0)));
        // Off unless asked for.
        let result = run(&workload, rr.as_mut(), &cfg()).unwrap();
        assert!(result.records.iter().all(|r| r.regret_ms.is_none()));
    }

    // Traffic that bypasses the router is picked per session, never reaches the policy (no
    // route, no outcome), and is left out of the report; the rest is routed as usual.
    #[test]
    fn unseen_traffic_bypasses_the_router_by_session() {
        let workload = from_spec("multi-turn:conversations=20,turns=3,rps=8", 4).unwrap();
        let options = RunOptions {
            unseen_fraction: 0.4,
            ..RunOptions::default()
        };
        let mut spy = Spy::default();
        let result = run_with(&workload, &mut spy, &cfg(), &options).unwrap();
        let unseen: Vec<usize> = (0..result.records.len())
            .filter(|&i| result.records[i].unseen)
            .collect();
        assert!(!unseen.is_empty() && unseen.len() < workload.requests.len() / 2 + 20);
        let mut routed: Vec<usize> = spy.seen.iter().map(|&(id, _)| id).collect();
        routed.sort_unstable();
        let expected: Vec<usize> = (0..result.records.len())
            .filter(|&i| !result.records[i].unseen)
            .collect();
        assert_eq!(routed, expected);
        spy.finished.sort_unstable();
        assert_eq!(spy.finished, expected);
        // A conversation is seen or unseen as a whole.
        for (i, r) in workload.requests.iter().enumerate() {
            for (j, q) in workload.requests.iter().enumerate() {
                if r.session.is_some() && r.session == q.session {
                    assert_eq!(result.records[i].unseen, result.records[j].unseen);
                }
            }
        }
        let summary = crate::report::PolicySummary::of(&result);
        assert_eq!(summary.requests, expected.len());
        // Without the option nothing is unseen.
        let all = run(&workload, &mut Spy::default(), &cfg()).unwrap();
        assert!(all.records.iter().all(|r| !r.unseen));
    }

    fn cfg() -> SimConfig {
        SimConfig {
            replicas: 2,
            profile: Profile::llama8b_h100(),
            seed: 1,
            metrics_interval_ms: 100.0,
        }
    }

    // A hybrid model's sliding-window group publishes its own stores and drops (most of a
    // long conversation falls out of a 1,024-token window), but only full attention decides a
    // prefix hit: routers that read KV events route the hybrid fleet exactly as the plain one,
    // whose engines cost the same. Had the window's drops reached the index, follow-up turns
    // would have lost their prefix there.
    #[test]
    fn a_hybrid_models_window_group_does_not_move_precise_routing() {
        let spec = "multi-turn:conversations=6,turns=4,system=1500,user=300,output=40,rps=3";
        let workload = from_spec(spec, 2).unwrap();
        let hybrid = Profile::named("llama8b-h100-sliding-window").unwrap();
        assert_eq!(hybrid.sliding_window_tokens, Some(1024));
        for name in ["kvroute-precise", "dynamo"] {
            let placed = |profile: &Profile| {
                let cfg = SimConfig {
                    replicas: 3,
                    profile: profile.clone(),
                    ..cfg()
                };
                let mut policy = crate::policy::build(name, cfg.replicas, cfg.seed).unwrap();
                assert!(policy.wants_kv_events(), "{name} reads KV events");
                let result = run(&workload, policy.as_mut(), &cfg).unwrap();
                let cached: u64 = result
                    .records
                    .iter()
                    .map(|r| u64::from(r.cached_tokens))
                    .sum();
                let replicas: Vec<usize> = result.records.iter().map(|r| r.replica).collect();
                (replicas, cached)
            };
            let (plain, plain_cached) = placed(&Profile::llama8b_h100());
            let (windowed, windowed_cached) = placed(&hybrid);
            assert!(plain_cached > 0, "{name}: the workload reuses prefixes");
            assert_eq!(
                windowed, plain,
                "{name}: placements differ on the hybrid fleet"
            );
            assert_eq!(windowed_cached, plain_cached, "{name}");
        }
    }

    // Routers see the client's cap, never the real length; the engine stops at the real length.
    #[test]
    fn routers_see_the_cap_not_the_real_length() {
        let spec = "agentic:agents=2,steps=5,system=300,task=50,tool=80,call=40,answer=90,fork_every=2,fanout=2,sub_steps=2,rps=4";
        let workload = from_spec(spec, 3).unwrap();
        let cap = client_max_tokens(spec).unwrap();
        assert_eq!(cap, Some(4096));
        let lengths: Vec<u32> = workload.requests.iter().map(|r| r.output_tokens).collect();
        assert!(
            lengths.iter().any(|&l| l != lengths[0]),
            "real lengths vary"
        );
        let mut spy = Spy::default();
        let options = RunOptions {
            max_tokens: cap,
            ..RunOptions::default()
        };
        let result = run_with(&workload, &mut spy, &cfg(), &options).unwrap();
        assert_eq!(spy.seen.len(), workload.requests.len());
        assert!(spy.seen.iter().all(|&(_, m)| m == cap));
        for (r, spec) in result.records.iter().zip(&workload.requests) {
            assert_eq!(r.output_tokens, spec.output_tokens);
        }
        // Without a cap the router is shown nothing at all.
        let mut spy = Spy::default();
        run(&workload, &mut spy, &cfg()).unwrap();
        assert!(spy.seen.iter().all(|&(_, m)| m.is_none()));
        // A cap below the real length cuts the answer, as vLLM would.
        let options = RunOptions {
            max_tokens: Some(30),
            ..RunOptions::default()
        };
        let result = run_with(&workload, &mut Spy::default(), &cfg(), &options).unwrap();
        assert!(result.records.iter().all(|r| r.output_tokens <= 30));
    }

    // Each policy gets scraped on its own router's interval.
    #[test]
    fn scrapes_follow_the_policys_interval() {
        let workload = from_spec("no-sharing:requests=20,input=200,output=20,rps=10", 1).unwrap();
        let gaps = |interval| {
            let mut spy = Spy {
                interval,
                ..Spy::default()
            };
            run(&workload, &mut spy, &cfg()).unwrap();
            spy.scrapes[1] - spy.scrapes[0]
        };
        assert_eq!(gaps(None), 100.0);
        assert_eq!(gaps(Some(50.0)), 50.0);
    }

    // Subagents fork from one turn: each repeats that turn's prompt and answer, so they share
    // its prefix, and all of them run.
    #[test]
    fn subagents_share_the_forked_turns_context() {
        let spec = "agentic:agents=1,steps=3,system=200,task=20,tool=30,call=10,answer=10,fork_every=1,fanout=3,sub_steps=1,rps=1";
        let workload = from_spec(spec, 1).unwrap();
        let forks: Vec<usize> = (0..workload.requests.len())
            .filter(|&i| workload.depends_on(i) == Some(0))
            .collect();
        // The main loop's next turn plus three subagents.
        assert_eq!(forks.len(), 4);
        let mut spy = Spy::default();
        let result = run(&workload, &mut spy, &cfg()).unwrap();
        assert!(result.records.iter().all(|r| r.finish_ms.is_some()));
        let first = workload.prompt_tokens(0);
        for &f in &forks {
            let p = workload.prompt_tokens(f);
            assert!(p.starts_with(&first));
            assert_eq!(result.records[f].prompt_tokens, p.len() as u32);
        }
    }
}
