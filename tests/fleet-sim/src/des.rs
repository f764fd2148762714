//! The discrete-event driver: N simulated engines, one policy, virtual time.
//!
//! Deterministic for a seed: one event heap ordered by (time, sequence number). Engines step
//! back to back while they have work; a step's events become visible at its end. Replica
//! metrics are "scraped" on an interval, so policies see them as stale as a real router would.
//! Later chat turns arrive a think time after their previous turn finished and repeat its
//! prompt and generated answer, so the engines' prefix caches see real multi-turn reuse.

use crate::events::EventQueue;
use hashbrown::HashMap;
use scorer_core::precise::{KvEvent as CoreKvEvent, Medium};

use super::policy::{Policy, PolicyRequest, ReplicaSnapshot};
use super::workload::{PromptSource, Workload, push_stream};
use vllm_sim::{
    Engine, EngineConfig, EngineRequest, KvEvent, Profile, RequestEvent, SimError, StoredBlocks,
};

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Arrival(usize),
    StepDone(usize),
    Scrape,
}

fn to_core(e: &KvEvent) -> CoreKvEvent {
    // The GPU and the CPU offload tier store the same payload; only the medium differs.
    let stored = |s: &StoredBlocks, medium| CoreKvEvent::BlockStored {
        block_hashes: s.block_hashes.clone(),
        parent_block_hash: s.parent_block_hash,
        token_ids: s.token_ids.clone(),
        block_size: s.block_size,
        lora_name: s.lora_name.clone(),
        cache_salt: s.cache_salt.clone(),
        medium,
    };
    match e {
        KvEvent::BlockStored(s) => stored(s, Medium::Gpu),
        KvEvent::BlockRemoved { block_hashes } => CoreKvEvent::BlockRemoved {
            block_hashes: block_hashes.clone(),
            medium: Medium::Gpu,
        },
        KvEvent::AllBlocksCleared => CoreKvEvent::AllBlocksCleared,
        KvEvent::OffloadStored(s) => stored(s, Medium::Cpu),
        KvEvent::OffloadRemoved { block_hashes } => CoreKvEvent::BlockRemoved {
            block_hashes: block_hashes.clone(),
            medium: Medium::Cpu,
        },
    }
}

/// Replays `workload` through `cfg.replicas` engines routed by `policy`.
pub fn run(
    workload: &Workload,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
) -> Result<RunResult, SimError> {
    let wants_events = policy.wants_kv_events();
    let mut fleet = EngineSteps::new(build_engines(
        &cfg.profile,
        cfg.replicas,
        cfg.seed,
        wants_events,
    )?);
    let n = workload.requests.len();
    let mut records = vec![RequestRecord::default(); n];
    let mut dependent: HashMap<usize, usize> = HashMap::new();
    for i in 0..n {
        if let Some(p) = workload.depends_on(i) {
            dependent.insert(p, i);
        }
    }
    // Prompt + generated tokens of requests a later turn will repeat.
    let mut context: HashMap<usize, Vec<u32>> = HashMap::new();
    let mut queue = EventQueue::new();
    for i in 0..n {
        if workload.depends_on(i).is_none() {
            queue.push(workload.requests[i].arrival_ms, Event::Arrival(i));
        }
    }
    queue.push(0.0, Event::Scrape);
    let mut unresolved = n;
    let mut result = RunResult {
        policy: policy.name().to_string(),
        ..RunResult::default()
    };
    let block_size = cfg.profile.block_size;
    let capacity_tokens = cfg.profile.kv_capacity_tokens;

    while let Some((now, event)) = queue.pop() {
        match event {
            Event::Arrival(i) => {
                let spec = &workload.requests[i];
                let tokens = match &spec.prompt {
                    PromptSource::Continue { previous, user } => {
                        let mut t = context
                            .remove(previous)
                            .unwrap_or_else(|| workload.prompt_tokens(*previous));
                        push_stream(&mut t, user.0, user.1);
                        t
                    }
                    _ => workload.prompt_tokens(i),
                };
                let request = PolicyRequest {
                    id: i,
                    tokens: &tokens,
                    output_tokens: spec.output_tokens,
                    session: spec.session,
                };
                let replica = policy.route(&request, now).min(cfg.replicas - 1);
                records[i] = RequestRecord {
                    arrival_ms: now,
                    prompt_tokens: tokens.len() as u32,
                    replica,
                    predicted_cached_tokens: policy.predicted_cached_tokens(i),
                    ..RequestRecord::default()
                };
                if dependent.contains_key(&i) {
                    context.insert(i, tokens.clone());
                }
                let request = arriving(i, tokens, spec.output_tokens, now);
                if fleet
                    .add(replica, request, now, &mut queue, Event::StepDone)
                    .is_err()
                {
                    records[i].rejected = true;
                    unresolved -= 1;
                    policy.on_finish(i, replica, now, 0);
                    if let Some(&d) = dependent.get(&i) {
                        queue.push(now + workload.requests[d].arrival_ms, Event::Arrival(d));
                    }
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
                            if let Some(c) = context.get_mut(&i) {
                                c.push(*token_id);
                            }
                            policy.on_first_token(i, r, now);
                        }
                        RequestEvent::Token { request, token_id } => {
                            let i = *request as usize;
                            records[i].output_tokens += 1;
                            if let Some(c) = context.get_mut(&i) {
                                c.push(*token_id);
                            }
                        }
                        RequestEvent::Preempted { .. } => {}
                        RequestEvent::Finished { request, summary } => {
                            let i = *request as usize;
                            records[i].finish_ms = Some(now);
                            records[i].output_tokens = summary.output_tokens;
                            unresolved -= 1;
                            policy.on_finish(i, r, now, summary.cached_tokens);
                            if let Some(&d) = dependent.get(&i) {
                                queue
                                    .push(now + workload.requests[d].arrival_ms, Event::Arrival(d));
                            }
                        }
                    }
                }
                if wants_events && !out.kv_events.is_empty() {
                    let events: Vec<CoreKvEvent> = out.kv_events.iter().map(to_core).collect();
                    policy.on_kv_events(r, &events, now);
                }
                fleet.start_step(r, now, &mut queue, Event::StepDone);
            }
            Event::Scrape => {
                let snapshots: Vec<ReplicaSnapshot> = fleet
                    .engines
                    .iter()
                    .map(|e| ReplicaSnapshot::of(&e.stats(), capacity_tokens, block_size))
                    .collect();
                result.max_waiting = result
                    .max_waiting
                    .max(snapshots.iter().map(|s| s.waiting).max().unwrap_or(0));
                policy.on_metrics(&snapshots, now);
                if unresolved > 0 {
                    queue.push(now + cfg.metrics_interval_ms, Event::Scrape);
                }
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
    result.records = records;
    Ok(result)
}

/// `replicas` engines of `profile`, each seeded from `seed` and its index, publishing KV events
/// when `kv_events` (the fleet every fleet-sim model steps).
pub(crate) fn build_engines(
    profile: &Profile,
    replicas: usize,
    seed: u64,
    kv_events: bool,
) -> Result<Vec<Engine>, SimError> {
    (0..replicas)
        .map(|i| {
            let mut ec = EngineConfig::new(profile.clone());
            ec.seed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9);
            ec.kv_events = kv_events;
            Engine::new(ec)
        })
        .collect()
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
