//! A sans-IO model of a vLLM V1 engine: scheduler, paged KV cache with prefix caching, and a
//! step-time cost model.
//!
//! The engine reads no clock and starts no thread. A driver calls [`Engine::step`] with the
//! current simulated time; the step schedules one batch, "runs" it, and returns how long it
//! took plus everything that happened, stamped at `end_s = now_s + duration_s`. The driver
//! delivers the events at `end_s` and calls `step` again no earlier than that. The live
//! `vllm-sim` server drives it in scaled wall time; fleet-sim drives it in virtual time.
//!
//! Scheduling follows vLLM V1 with chunked prefill: running requests first (decode needs one
//! token, a partial prefill the rest of its prompt), each limited by the step's token budget;
//! when a running request cannot get a block, the newest running request is preempted
//! (recompute: its blocks are freed, it goes back to the head of the queue). Then, if nothing
//! was preempted, waiting requests are admitted first-come-first-served while the batch has
//! room, budget is left and their blocks fit. A newly admitted request reuses the longest run
//! of cached full blocks of its tokens, but always recomputes at least its last token. Blocks
//! are cached (and published in one `BlockStored` per request and step) as soon as the tokens
//! that fill them are scheduled, as vLLM's `KVCacheManager.allocate_slots` commits them, so a
//! request admitted later in the same step, or beside another's chunked prefill, already
//! finds them. The pool still keeps a second copy when two requests compute the same block
//! (vLLM does not de-duplicate either).
//!
//! Step duration = `decode_step_s_min + (decode_step_s_full - decode_step_s_min) *
//! batch_kv_tokens / kv_capacity_tokens + prefill_tokens / prefill_tokens_per_s`, times
//! optional seeded jitter, where `batch_kv_tokens` is the KV context of every scheduled
//! sequence and `prefill_tokens` the prompt (or recomputed) tokens computed this step.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use hashbrown::{HashMap, HashSet};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use vllm_wire::kv_events::{BlockHash, BlockStored, block_extra_keys};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::SimError;
use super::kv::{BlockId, BlockPool};
use super::profile::Profile;

/// Mixed into a salted block-0 seed so a salt never reproduces a LoRA's chain seed.
const SALT_SEED: u64 = 0x6361_6368_655f_7361; // "cache_sa"
use super::tokenizer::{Tokenizer, WordTokenizer};

/// Caller-chosen request id, unique among the requests inside one engine.
pub type RequestId = u64;

/// Engine configuration: a profile plus the knobs that are not hardware.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Hardware and model numbers.
    pub profile: Profile,
    /// Seed of the step-time jitter.
    pub seed: u64,
    /// Seed of the block hash chain (vLLM's `PYTHONHASHSEED`); LoRA adapters mix their name in.
    pub hash_seed: u64,
    /// Ids the engine generates (deterministically from the prompt, like greedy decoding).
    pub output_vocab: Arc<[u32]>,
    /// Build [`KvEvent`]s (turn off in simulations that do not need them).
    pub kv_events: bool,
    /// LoRA adapter slots (vLLM `--max-loras`); 0 = unlimited. A waiting request whose
    /// adapter is not loaded and finds every slot held by adapters of running requests is
    /// skipped until one frees (idle adapters are evicted least recently used first).
    pub max_loras: u32,
    /// Blocks of the CPU offload tier (vLLM's native KV offloading); 0 = none. Every block
    /// cached on the GPU is also written to it (published as `BlockStored`, medium `CPU`); a
    /// prefix that left the GPU but is still there is loaded at `cpu_load_tokens_per_s`
    /// instead of being recomputed. Least recently used blocks leave first.
    pub cpu_offload_blocks: u32,
}

impl EngineConfig {
    /// Configuration for `profile` with the default tokenizer's output words and seed 0.
    pub fn new(profile: Profile) -> Self {
        Self {
            profile,
            seed: 0,
            hash_seed: 0,
            output_vocab: WordTokenizer::default().output_vocab().into(),
            kv_events: true,
            max_loras: 0,
            cpu_offload_blocks: 0,
        }
    }
}

/// One request as the engine sees it: already tokenised.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Unique id, echoed in every event about this request.
    pub id: RequestId,
    /// The prompt (never empty).
    pub prompt_tokens: Vec<u32>,
    /// Output length: the engine generates exactly this many tokens (ignore_eos semantics).
    pub max_output_tokens: u32,
    /// LoRA adapter name; blocks of different adapters never share cache.
    pub lora: Option<String>,
    /// vLLM's `cache_salt`: like vLLM, the engine adds it to block 0's hash only, so through
    /// the chain a salted prompt shares no cached block with other salts or none.
    pub cache_salt: Option<String>,
    /// Simulated arrival time, seconds.
    pub arrival_s: f64,
}

/// What happened to one request during a step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum RequestEvent {
    /// Prefill finished and the first output token was sampled.
    FirstToken {
        /// The request.
        request: RequestId,
        /// The sampled token.
        token_id: u32,
        /// Prompt tokens served from the prefix cache when the request was first scheduled.
        cached_tokens: u32,
    },
    /// One more output token.
    Token {
        /// The request.
        request: RequestId,
        /// The sampled token.
        token_id: u32,
    },
    /// The request was preempted (it will recompute; tokens already streamed stay valid).
    Preempted {
        /// The request.
        request: RequestId,
    },
    /// The request produced its last token and left the engine (after its token event).
    Finished {
        /// The request.
        request: RequestId,
        /// Totals and timestamps.
        summary: RequestSummary,
    },
}

/// Totals and timestamps of a finished request (simulated seconds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestSummary {
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: u32,
    /// Times this request was preempted.
    pub num_preemptions: u32,
    /// Arrival time.
    pub arrival_s: f64,
    /// Time the request was first scheduled (end of queueing).
    pub scheduled_s: f64,
    /// Time of the first token.
    pub first_token_s: f64,
    /// Time of the last token.
    pub finished_s: f64,
    /// LoRA adapter, if any.
    pub lora: Option<String>,
}

/// A KV cache event, as vLLM publishes them (medium `GPU`, or `CPU` for the offload tier).
///
/// A run of stored blocks is vllm-wire's [`BlockStored`] as the GPU tier fills it (medium
/// `GPU`, no KV group, the extra keys of every block: LoRA name, and the cache salt on block 0);
/// [`crate::kv_events::wire_event`] sets the medium and group of the tier that publishes it.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks became cached on the GPU.
    BlockStored(BlockStored),
    /// A cached block was evicted (one event per block, as vLLM 0.33 does; a duplicate copy of
    /// a block reports the same hash again when it goes).
    BlockRemoved {
        /// The evicted hashes.
        block_hashes: Vec<u64>,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
    /// Blocks were written to the CPU offload tier (`BlockStored` with medium `CPU`).
    OffloadStored(BlockStored),
    /// A block left the CPU offload tier (`BlockRemoved` with medium `CPU`).
    OffloadRemoved {
        /// The dropped hashes.
        block_hashes: Vec<u64>,
    },
    /// Blocks of a hybrid model's sliding-window layers became cached: `BlockStored` with
    /// `group_idx` [`SLIDING_WINDOW_GROUP`], the same hashes as the full-attention run.
    WindowStored(BlockStored),
    /// A sliding-window block was dropped (`BlockRemoved` with `group_idx`
    /// [`SLIDING_WINDOW_GROUP`]): it fell out of the window, or the full-attention copy went.
    WindowRemoved {
        /// The dropped hash.
        block_hashes: Vec<u64>,
    },
}

/// The KV-cache group of a hybrid model's sliding-window layers (full attention is group 0).
pub const SLIDING_WINDOW_GROUP: u32 = 1;

/// Everything one step did.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Simulated time the batch took; 0 when nothing was scheduled.
    pub duration_s: f64,
    /// `now_s + duration_s`: when the events below become visible.
    pub end_s: f64,
    /// Sequences in the batch.
    pub num_scheduled: u32,
    /// Tokens computed (prefill + decode).
    pub num_batched_tokens: u32,
    /// Per-request events, in order.
    pub events: Vec<RequestEvent>,
    /// KV cache events, in order (evictions happen while scheduling, stores after compute).
    pub kv_events: Vec<KvEvent>,
}

/// A point-in-time view of the engine for metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineStats {
    /// Requests in the running batch.
    pub num_running: u32,
    /// Requests queued (including preempted ones).
    pub num_waiting: u32,
    /// Fraction of KV blocks referenced by requests (0..1).
    pub kv_cache_usage: f64,
    /// Total KV blocks.
    pub num_gpu_blocks: u32,
    /// Blocks holding a cached hash.
    pub num_cached_blocks: u32,
    /// Tokens looked up in the prefix cache at first admission (counter).
    pub prefix_cache_queries: u64,
    /// Tokens found in the prefix cache at first admission (counter).
    pub prefix_cache_hits: u64,
    /// Preemptions (counter).
    pub num_preemptions: u64,
    /// Prompt tokens of requests that produced a first token (counter).
    pub prompt_tokens: u64,
    /// Generated tokens (counter).
    pub generation_tokens: u64,
    /// Seconds finished requests spent from first scheduling to first token (the sum of
    /// vLLM's `vllm:request_prefill_time_seconds`).
    pub prefill_seconds: f64,
    /// Prompt tokens finished requests computed rather than found cached (the sum of vLLM's
    /// `vllm:request_prefill_kv_computed_tokens`).
    pub prefill_computed_tokens: u64,
    /// Seconds between consecutive output tokens, summed, and how many such gaps (the sum and
    /// count of vLLM's `vllm:inter_token_latency_seconds`).
    pub itl_seconds: f64,
    /// See `itl_seconds`.
    pub itl_count: u64,
    /// Requests that finished (counter).
    pub requests_finished: u64,
    /// Requests aborted (counter).
    pub requests_aborted: u64,
    /// Steps run (counter).
    pub steps: u64,
    /// LoRA adapters of running requests.
    pub running_loras: BTreeSet<String>,
    /// LoRA adapters of waiting requests.
    pub waiting_loras: BTreeSet<String>,
}

#[derive(Debug, Clone)]
struct Req {
    tokens: Vec<u32>,
    prompt_len: u32,
    max_output: u32,
    lora_id: Option<u32>,
    lora_name: Option<Arc<str>>,
    cache_salt: Option<Arc<str>>,
    chain_seed: u64,
    output_seed: u64,
    block_hashes: Vec<u64>,
    blocks: Vec<BlockId>,
    num_computed: u32,
    num_registered: u32,
    cached_tokens: Option<u32>,
    num_preemptions: u32,
    arrival_s: f64,
    scheduled_s: Option<f64>,
    first_token_s: Option<f64>,
    /// When its latest token came (for the inter-token latency counters).
    last_token_s: f64,
}

impl Req {
    /// The parent of block 0: the chain seed, with the cache salt mixed in when there is one
    /// (vLLM hashes the salt into block 0's extra keys, nowhere else).
    fn block0_seed(&self) -> u64 {
        match &self.cache_salt {
            Some(salt) => xxh3_64_with_seed(salt.as_bytes(), self.chain_seed ^ SALT_SEED),
            None => self.chain_seed,
        }
    }

    /// The cache salt for an event whose run starts at block `first`: only block 0 carries it.
    /// vLLM's `BlockStored` for this request's full blocks `first..=last`: the GPU tier and
    /// the CPU offload tier publish the same run.
    fn stored(&self, first: usize, last: usize, bs: u32) -> BlockStored {
        let bsz = bs as usize;
        let hashes = &self.block_hashes[first..=last];
        // vLLM keeps the salt in block 0's extra keys only.
        let salt = self.cache_salt.as_deref().filter(|_| first == 0);
        BlockStored {
            lora_id: self.lora_id.map(u64::from),
            lora_name: self.lora_name.as_deref().map(str::to_owned),
            extra_keys: Some(block_extra_keys(
                hashes.len(),
                self.lora_name.as_deref(),
                salt,
            )),
            ..BlockStored::on_gpu(
                hashes.iter().copied().map(BlockHash::Int).collect(),
                first
                    .checked_sub(1)
                    .map(|p| BlockHash::Int(self.block_hashes[p])),
                self.tokens[first * bsz..(last + 1) * bsz].to_vec(),
                bs,
            )
        }
    }

    fn output_len(&self) -> u32 {
        self.tokens.len() as u32 - self.prompt_len
    }

    /// Extends the chained block hashes to cover the first `n` full blocks.
    fn hashes_up_to(&mut self, n: usize, block_size: usize) {
        let mut buf = Vec::with_capacity(block_size * 4);
        while self.block_hashes.len() < n {
            let i = self.block_hashes.len();
            let parent = if i == 0 {
                self.block0_seed()
            } else {
                self.block_hashes[i - 1]
            };
            buf.clear();
            for t in &self.tokens[i * block_size..(i + 1) * block_size] {
                buf.extend_from_slice(&t.to_le_bytes());
            }
            self.block_hashes.push(xxh3_64_with_seed(&buf, parent));
        }
    }
}

/// The CPU offload tier: block hashes, least recently used first out.
#[derive(Debug, Clone, Default)]
struct CpuTier {
    /// Hash → use stamp.
    stamps: HashMap<u64, u64>,
    /// Use stamp → hash, oldest first.
    order: std::collections::BTreeMap<u64, u64>,
    clock: u64,
}

impl CpuTier {
    fn contains(&self, hash: u64) -> bool {
        self.stamps.contains_key(&hash)
    }

    fn bump(&mut self, hash: u64) {
        self.clock += 1;
        if let Some(old) = self.stamps.insert(hash, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, hash);
    }

    /// Marks loaded blocks recently used.
    fn touch(&mut self, hashes: &[u64]) {
        for h in hashes {
            if self.contains(*h) {
                self.bump(*h);
            }
        }
    }

    /// Writes `hash` (or refreshes it); returns whether it is new, and the hash dropped to
    /// stay within `cap` blocks.
    fn insert(&mut self, hash: u64, cap: usize) -> (bool, Option<u64>) {
        let new = !self.contains(hash);
        self.bump(hash);
        let mut dropped = None;
        if self.stamps.len() > cap
            && let Some((_, oldest)) = self.order.pop_first()
        {
            self.stamps.remove(&oldest);
            dropped = Some(oldest);
        }
        (new, dropped)
    }

    fn clear(&mut self) {
        self.stamps.clear();
        self.order.clear();
    }
}

/// One `OffloadStored` per contiguous run of newly offloaded block indices of `r`.
fn offload_events(r: &Req, offloaded: &[usize], bs: u32, events: &mut Vec<KvEvent>) {
    let mut start = 0;
    while start < offloaded.len() {
        let mut end = start + 1;
        while end < offloaded.len() && offloaded[end] == offloaded[end - 1] + 1 {
            end += 1;
        }
        let (first, last) = (offloaded[start], offloaded[end - 1]);
        events.push(KvEvent::OffloadStored(r.stored(first, last, bs)));
        start = end;
    }
}

/// The simulated engine (see the module docs).
#[derive(Debug, Clone)]
pub struct Engine {
    cfg: EngineConfig,
    block_size: u32,
    pool: BlockPool,
    reqs: HashMap<RequestId, Req>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    lora_ids: HashMap<String, u32>,
    /// Adapters in GPU slots, least recently used first.
    loaded_loras: Vec<Arc<str>>,
    /// The CPU offload tier.
    cpu: CpuTier,
    /// Tokens loaded from the CPU tier by this step's admissions (costed in the step).
    cpu_loaded_tokens: u64,
    /// Hashes the CPU tier dropped, not yet published.
    cpu_dropped: Vec<u64>,
    rng: SmallRng,
    stats: EngineStats,
    evicted: Vec<u64>,
    /// Prompt tokens whose KV a remote prefill computed and transferred, per waiting request
    /// (disaggregated serving): admission counts them as present, like local prefix hits.
    remote_kv: HashMap<RequestId, u32>,
    /// Whether admissions look up the prefix cache (vLLM's `--enable-prefix-caching`, on by
    /// default); off, every prompt is computed whole and no request reports cached tokens.
    prefix_caching: bool,
    /// Fault injection: requests' cache salts are left out of their block hashes (and events),
    /// as an engine that does not know `cache_salt` would hash them.
    ignore_cache_salt: bool,
    /// A hybrid model's sliding-window group: the hashes it holds (empty without a window).
    window_blocks: HashSet<u64>,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(cfg: EngineConfig) -> Result<Self, SimError> {
        cfg.profile.validate()?;
        if cfg.output_vocab.is_empty() {
            return Err(SimError::Config("output_vocab must not be empty".into()));
        }
        let blocks = cfg.profile.num_gpu_blocks() as u32;
        Ok(Self {
            block_size: cfg.profile.block_size,
            pool: BlockPool::new(blocks),
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            lora_ids: HashMap::new(),
            loaded_loras: Vec::new(),
            cpu: CpuTier::default(),
            cpu_loaded_tokens: 0,
            cpu_dropped: Vec::new(),
            rng: SmallRng::seed_from_u64(cfg.seed),
            remote_kv: HashMap::new(),
            stats: EngineStats {
                num_gpu_blocks: blocks,
                ..EngineStats::default()
            },
            evicted: Vec::new(),
            prefix_caching: true,
            ignore_cache_salt: false,
            window_blocks: HashSet::new(),
            cfg,
        })
    }

    /// Turns prefix-cache lookups on or off, as vLLM's `--[no-]enable-prefix-caching` would
    /// (at run time here, so a test can misconfigure one replica and fix it again).
    pub fn set_prefix_caching(&mut self, on: bool) {
        self.prefix_caching = on;
    }

    /// Fault injection: leaves requests' cache salts out of their block hashes and KV events
    /// (`ignore`), so salted prompts share blocks with unsalted ones and their events name
    /// blocks no salt-aware router hashes.
    pub fn set_cache_salt_ignored(&mut self, ignore: bool) {
        self.ignore_cache_salt = ignore;
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues a request. Rejects requests that could never run instead of letting them hang.
    pub fn add_request(&mut self, req: EngineRequest) -> Result<(), SimError> {
        let p = &self.cfg.profile;
        if self.reqs.contains_key(&req.id) {
            return Err(SimError::DuplicateRequest(req.id));
        }
        if req.prompt_tokens.is_empty() {
            return Err(SimError::InvalidRequest("prompt is empty".into()));
        }
        if req.max_output_tokens == 0 {
            return Err(SimError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        // vLLM 0.33 refuses only a prompt that leaves no room for one output token and clamps
        // the output to the context left (`get_max_tokens` in
        // `vllm/entrypoints/serve/utils/api_utils.py`); a `max_tokens` above the whole context
        // is refused before the engine (the server's check).
        let prompt = req.prompt_tokens.len() as u64;
        let limit = u64::from(p.max_model_len);
        if prompt == limit {
            // No room left: the clamped budget is 0, which `SamplingParams` refuses.
            return Err(SimError::InvalidRequest(
                "max_tokens must be at least 1, got 0.".into(),
            ));
        }
        if prompt > limit {
            return Err(SimError::InvalidRequest(format!(
                "This model's maximum context length is {limit} tokens. However, your prompt \
                 contains {prompt} input tokens, which exceeds this limit even without any \
                 output tokens. Please reduce the length of the input prompt."
            )));
        }
        let max_output = u64::from(req.max_output_tokens).min(limit - prompt) as u32;
        let total = prompt + u64::from(max_output);
        let blocks_needed = total.div_ceil(u64::from(self.block_size));
        if blocks_needed > u64::from(self.pool.num_blocks()) {
            return Err(SimError::InvalidRequest(format!(
                "request needs {blocks_needed} KV blocks but the cache holds only {}",
                self.pool.num_blocks()
            )));
        }
        let (lora_id, lora_name, chain_seed) = match &req.lora {
            Some(name) => {
                let next = self.lora_ids.len() as u32 + 1;
                let id = *self.lora_ids.entry(name.clone()).or_insert(next);
                let seed = self.cfg.hash_seed ^ xxh3_64(name.as_bytes());
                (Some(id), Some(Arc::<str>::from(name.as_str())), seed)
            }
            None => (None, None, self.cfg.hash_seed),
        };
        let output_seed = xxh3_64_with_seed(
            &req.prompt_tokens
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
            chain_seed,
        );
        let mut tokens = req.prompt_tokens;
        tokens.reserve(max_output as usize);
        self.reqs.insert(
            req.id,
            Req {
                prompt_len: tokens.len() as u32,
                tokens,
                max_output,
                lora_id,
                lora_name,
                cache_salt: req
                    .cache_salt
                    .as_deref()
                    .filter(|_| !self.ignore_cache_salt)
                    .map(Arc::from),
                chain_seed,
                output_seed,
                block_hashes: Vec::new(),
                blocks: Vec::new(),
                num_computed: 0,
                num_registered: 0,
                cached_tokens: None,
                num_preemptions: 0,
                arrival_s: req.arrival_s,
                scheduled_s: None,
                first_token_s: None,
                last_token_s: 0.0,
            },
        );
        self.waiting.push_back(req.id);
        Ok(())
    }

    /// Queues a request whose prompt was prefilled on another replica and whose KV has been
    /// transferred here (llm-d's P/D flow, vLLM's NIXL connector): its prompt blocks count as
    /// present at admission (all but the last token, which vLLM always recomputes), and they
    /// enter this replica's prefix cache once the step that admits it completes.
    pub fn add_remote_prefilled(&mut self, req: EngineRequest) -> Result<(), SimError> {
        let (id, prompt) = (req.id, req.prompt_tokens.len() as u32);
        self.add_request(req)?;
        self.remote_kv.insert(id, prompt);
        Ok(())
    }

    /// Removes a request wherever it is (client went away). Returns false if unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(req) = self.reqs.remove(&id) else {
            return false;
        };
        self.remote_kv.remove(&id);
        self.pool.free(&req.blocks);
        if let Some(i) = self.running.iter().position(|r| *r == id) {
            self.running.remove(i);
        } else if let Some(i) = self.waiting.iter().position(|r| *r == id) {
            self.waiting.remove(i);
        }
        self.stats.requests_aborted += 1;
        true
    }

    /// True while any request is queued or running.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Requests inside the engine.
    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    /// vLLM's `reset_prefix_cache`: forgets every cached block and returns the event to
    /// publish. Like vLLM it fails (`None`, nothing changes) while running requests hold
    /// blocks, unless `reset_running_requests` first preempts them all (newest first, so they
    /// resume in their order; they recompute).
    pub fn reset_prefix_cache(&mut self, reset_running_requests: bool) -> Option<Vec<KvEvent>> {
        if reset_running_requests {
            let mut out = StepOutput::default();
            while let Some(id) = self.running.pop() {
                self.preempt(id, &mut out);
            }
        }
        if self.pool.num_free() != self.pool.num_blocks() {
            return None;
        }
        self.pool.clear_cache();
        self.cpu.clear();
        self.window_blocks.clear();
        Some(vec![KvEvent::AllBlocksCleared])
    }

    /// A metrics snapshot.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.clone();
        s.num_running = self.running.len() as u32;
        s.num_waiting = self.waiting.len() as u32;
        s.kv_cache_usage = self.pool.usage();
        s.num_cached_blocks = self.pool.num_cached() as u32;
        let lora = |ids: &mut dyn Iterator<Item = &RequestId>| -> BTreeSet<String> {
            ids.filter_map(|id| self.reqs.get(id)?.lora_name.as_deref().map(str::to_owned))
                .collect()
        };
        s.running_loras = lora(&mut self.running.iter());
        s.waiting_loras = lora(&mut self.waiting.iter());
        s
    }

    /// Schedules and runs one batch at simulated time `now_s` (see the module docs).
    pub fn step(&mut self, now_s: f64) -> StepOutput {
        let mut out = StepOutput {
            end_s: now_s,
            ..StepOutput::default()
        };
        if !self.has_work() {
            return out;
        }
        let bs = self.block_size;
        let mut budget = self.cfg.profile.max_num_batched_tokens;
        let max_seqs = self.cfg.profile.max_num_seqs as usize;
        // (id, tokens computed this step)
        let mut scheduled: Vec<(RequestId, u32)> = Vec::with_capacity(self.running.len() + 8);
        let mut preempted = false;

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (num_new, need) = {
                let r = &self.reqs[&id];
                let num_new = (r.tokens.len() as u32 - r.num_computed).min(budget);
                let blocks = (r.num_computed + num_new).div_ceil(bs) as usize;
                (num_new, blocks.saturating_sub(r.blocks.len()) as u32)
            };
            let mut fits = true;
            while need > self.pool.num_free() {
                let Some(victim) = self.running.pop() else {
                    fits = false;
                    break;
                };
                self.preempt(victim, &mut out);
                preempted = true;
                if victim == id {
                    fits = false;
                    break;
                }
            }
            if !fits {
                break;
            }
            self.grow(id, need);
            self.cache_scheduled(id, num_new, &mut out);
            scheduled.push((id, num_new));
            budget -= num_new;
            i += 1;
        }

        // 2. Waiting requests, first come first served, unless memory is already short. A
        // request whose adapter finds no free slot is skipped (vLLM does the same).
        let mut j = 0;
        let mut lora_loads = 0u32;
        while !preempted && budget > 0 && self.running.len() < max_seqs {
            let Some(&id) = self.waiting.get(j) else {
                break;
            };
            let lora = self.reqs.get(&id).and_then(|r| r.lora_name.clone());
            if let Some(l) = &lora
                && !self.lora_slot_available(l)
            {
                j += 1;
                continue;
            }
            let Some(admitted) = self.try_admit(id, budget, now_s) else {
                break;
            };
            if let Some(l) = lora
                && self.activate_lora(l)
            {
                lora_loads += 1;
            }
            self.cache_scheduled(id, admitted, &mut out);
            self.waiting.remove(j);
            self.running.push(id);
            scheduled.push((id, admitted));
            budget -= admitted;
        }

        self.flush_evictions(&mut out);
        if scheduled.is_empty() {
            return out;
        }

        // 3. Cost of the batch.
        let mut prefill_tokens = 0u64;
        let mut kv_tokens = 0u64;
        for (id, n) in &scheduled {
            let r = &self.reqs[id];
            let is_decode =
                *n == 1 && r.output_len() > 0 && r.num_computed + 1 == r.tokens.len() as u32;
            if !is_decode {
                prefill_tokens += u64::from(*n);
            }
            kv_tokens += u64::from(r.num_computed + n);
        }
        let p = &self.cfg.profile;
        let fill = kv_tokens as f64 / p.kv_capacity_tokens as f64;
        let mut duration = p.decode_step_s_min
            + (p.decode_step_s_full - p.decode_step_s_min) * fill
            + prefill_tokens as f64 / p.prefill_tokens_per_s
            + f64::from(lora_loads) * p.lora_load_s
            + std::mem::take(&mut self.cpu_loaded_tokens) as f64 / p.cpu_load_tokens_per_s;
        if p.jitter > 0.0 {
            duration *= 1.0 + self.rng.random_range(-p.jitter..=p.jitter);
        }
        let end_s = now_s + duration;
        out.duration_s = duration;
        out.end_s = end_s;
        out.num_scheduled = scheduled.len() as u32;
        out.num_batched_tokens = scheduled.iter().map(|(_, n)| n).sum();
        self.stats.steps += 1;

        // 4. Results: sample tokens, finish requests.
        let mut finished = Vec::new();
        for (id, n) in scheduled {
            self.complete(id, n, end_s, &mut out, &mut finished);
        }
        if !finished.is_empty() {
            self.running.retain(|id| !finished.contains(id));
        }
        out
    }

    /// Whether a request for adapter `l` may run now: loaded, a slot free, or an idle
    /// adapter (no running request uses it) to evict.
    fn lora_slot_available(&self, l: &Arc<str>) -> bool {
        let max = self.cfg.max_loras as usize;
        max == 0
            || self.loaded_loras.contains(l)
            || self.loaded_loras.len() < max
            || self.loaded_loras.iter().any(|a| !self.lora_in_use(a))
    }

    fn lora_in_use(&self, l: &Arc<str>) -> bool {
        self.running
            .iter()
            .any(|id| self.reqs.get(id).and_then(|r| r.lora_name.as_ref()) == Some(l))
    }

    /// Marks `l` most recently used, loading it (evicting the least recently used idle
    /// adapter when the slots are full); returns whether it had to be loaded.
    fn activate_lora(&mut self, l: Arc<str>) -> bool {
        if let Some(i) = self.loaded_loras.iter().position(|a| *a == l) {
            let a = self.loaded_loras.remove(i);
            self.loaded_loras.push(a);
            return false;
        }
        let max = self.cfg.max_loras as usize;
        if max > 0
            && self.loaded_loras.len() >= max
            && let Some(i) = self
                .loaded_loras
                .iter()
                .position(|a| !self.lora_in_use(a) && *a != l)
        {
            self.loaded_loras.remove(i);
        }
        self.loaded_loras.push(l);
        true
    }

    /// Adapters in GPU slots now, least recently used first.
    pub fn loaded_loras(&self) -> Vec<String> {
        self.loaded_loras.iter().map(|l| l.to_string()).collect()
    }

    /// Allocates `need` more blocks for a running request (the caller checked they are free).
    fn grow(&mut self, id: RequestId, need: u32) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        for _ in 0..need {
            match self.pool.allocate(&mut self.evicted) {
                Some(b) => r.blocks.push(b),
                None => break,
            }
        }
    }

    fn preempt(&mut self, id: RequestId, out: &mut StepOutput) {
        if let Some(r) = self.reqs.get_mut(&id) {
            self.pool.free(&r.blocks);
            r.blocks.clear();
            r.num_computed = 0;
            r.num_registered = 0;
            r.num_preemptions += 1;
        }
        self.waiting.push_front(id);
        self.stats.num_preemptions += 1;
        out.events.push(RequestEvent::Preempted { request: id });
    }

    /// Admits the waiting request `id` if its blocks fit; returns tokens to compute this step.
    fn try_admit(&mut self, id: RequestId, budget: u32, now_s: f64) -> Option<u32> {
        let bs = self.block_size;
        let r = self.reqs.get_mut(&id)?;
        let num_tokens = r.tokens.len() as u32;
        // Always recompute at least the last token (vLLM: max_cache_hit_length = n - 1).
        let max_hit_blocks = match self.prefix_caching {
            true => ((num_tokens - 1) / bs) as usize,
            false => 0,
        };
        r.hashes_up_to(max_hit_blocks, bs as usize);
        let mut hits: Vec<BlockId> = Vec::new();
        for h in &r.block_hashes[..max_hit_blocks] {
            match self.pool.lookup(*h) {
                Some(b) => hits.push(b),
                None => break,
            }
        }
        // The CPU offload tier continues the GPU hit where it stops.
        let cpu_hit_blocks = r.block_hashes[hits.len()..max_hit_blocks]
            .iter()
            .take_while(|h| self.cpu.contains(**h))
            .count() as u32;
        let local_hit_tokens = hits.len() as u32 * bs;
        let cpu_hit_tokens = cpu_hit_blocks * bs;
        // Transferred KV (disaggregated prefill) covers what the local cache does not.
        let remote_tokens = self
            .remote_kv
            .get(&id)
            .map_or(0, |t| (*t).min(max_hit_blocks as u32 * bs) / bs * bs);
        let hit_tokens = (local_hit_tokens + cpu_hit_tokens).max(remote_tokens);
        let num_new = (num_tokens - hit_tokens).min(budget);
        let total_blocks = (hit_tokens + num_new).div_ceil(bs);
        let new_blocks = total_blocks - hits.len() as u32;
        let pinned = hits
            .iter()
            .filter(|b| self.pool.ref_count(**b) == 0)
            .count() as u32;
        if new_blocks + pinned > self.pool.num_free() {
            return None;
        }
        self.pool.touch(&hits);
        let hits_len = hits.len();
        r.blocks = hits;
        for _ in 0..new_blocks {
            if let Some(b) = self.pool.allocate(&mut self.evicted) {
                r.blocks.push(b);
            }
        }
        r.num_computed = hit_tokens;
        r.num_registered = local_hit_tokens / bs;
        if r.cached_tokens.is_none() {
            // vLLM reports local and connector (offload) hits together.
            r.cached_tokens = Some(local_hit_tokens + cpu_hit_tokens);
        }
        if hit_tokens == local_hit_tokens + cpu_hit_tokens && cpu_hit_tokens > 0 {
            self.cpu_loaded_tokens += u64::from(cpu_hit_tokens);
            let loaded = &r.block_hashes[hits_len..hits_len + cpu_hit_blocks as usize];
            self.cpu.touch(loaded);
        }
        self.remote_kv.remove(&id);
        if r.scheduled_s.is_none() {
            r.scheduled_s = Some(now_s);
        }
        // vLLM counts a request's lookup at its first admission only; re-admissions after a
        // preemption go to separate `preempted_*` stats that it does not export.
        if r.num_preemptions == 0 {
            self.stats.prefix_cache_queries += u64::from(num_tokens);
            self.stats.prefix_cache_hits += u64::from(local_hit_tokens);
        }
        Some(num_new)
    }

    fn flush_evictions(&mut self, out: &mut StepOutput) {
        if self.cfg.kv_events {
            for h in self.evicted.drain(..) {
                out.kv_events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                });
                // The block's sliding-window copy goes with it (vLLM frees both when a request's
                // blocks are reused).
                if self.window_blocks.remove(&h) {
                    out.kv_events.push(KvEvent::WindowRemoved {
                        block_hashes: vec![h],
                    });
                }
            }
        } else {
            self.evicted.clear();
        }
    }

    /// A hybrid model publishes its sliding-window group's copy of each full-attention run
    /// stored at `from..` in `events`.
    fn window_copies(&mut self, events: &mut Vec<KvEvent>, from: usize) {
        if self.cfg.profile.sliding_window_tokens.is_none() {
            return;
        }
        let mut copies = Vec::new();
        for e in &events[from..] {
            if let KvEvent::BlockStored(run) = e {
                self.window_blocks
                    .extend(run.block_hashes.iter().map(BlockHash::to_u64));
                copies.push(KvEvent::WindowStored(run.clone()));
            }
        }
        events.extend(copies);
    }

    /// A finished request's sliding-window blocks that lie wholly before its last `window`
    /// tokens: vLLM frees them as the request advances, and they are the first reused, so the
    /// simulator drops them (and publishes it) when the request ends.
    fn drop_out_of_window(&mut self, hashes: &[u64], tokens: usize, out: &mut StepOutput) {
        let Some(window) = self.cfg.profile.sliding_window_tokens else {
            return;
        };
        let bs = self.block_size as usize;
        let outside = tokens.saturating_sub(window as usize) / bs;
        for h in hashes.iter().take(outside) {
            if self.window_blocks.remove(h) && self.cfg.kv_events {
                out.kv_events.push(KvEvent::WindowRemoved {
                    block_hashes: vec![*h],
                });
            }
        }
    }

    /// Caches the blocks that `n` more tokens of request `id` fill, when they are scheduled.
    /// vLLM 0.33 commits a request's full blocks in `KVCacheManager.allocate_slots`, before
    /// the step runs, so a request admitted later in the same step, or while this one's
    /// chunked prefill goes on, already finds them; the step's KV writes precede its
    /// attention reads layer by layer. Evictions caused so far are published first, in the
    /// order vLLM's block pool queues its events.
    fn cache_scheduled(&mut self, id: RequestId, n: u32, out: &mut StepOutput) {
        self.flush_evictions(out);
        let bs = self.block_size;
        let emit = self.cfg.kv_events;
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        // Cache the blocks that become full, one BlockStored per contiguous run.
        let full = (r.num_computed + n) / bs;
        let stored_from = out.kv_events.len();
        if full > r.num_registered {
            r.hashes_up_to(full as usize, bs as usize);
            // The run of blocks stored so far, first and last index.
            let mut run: Option<(usize, usize)> = None;
            let mut offloaded: Vec<usize> = Vec::new();
            for i in r.num_registered..full {
                let i = i as usize;
                let stored = self.pool.register(r.blocks[i], r.block_hashes[i]);
                if self.cfg.cpu_offload_blocks > 0 {
                    let cap = self.cfg.cpu_offload_blocks as usize;
                    let (new, dropped) = self.cpu.insert(r.block_hashes[i], cap);
                    if new {
                        offloaded.push(i);
                    }
                    if emit && let Some(h) = dropped {
                        self.cpu_dropped.push(h);
                    }
                }
                if !emit {
                    continue;
                }
                if stored {
                    run = Some((run.map_or(i, |(first, _)| first), i));
                } else if let Some((first, last)) = run.take() {
                    out.kv_events
                        .push(KvEvent::BlockStored(r.stored(first, last, bs)));
                }
            }
            if let Some((first, last)) = run {
                out.kv_events
                    .push(KvEvent::BlockStored(r.stored(first, last, bs)));
            }
            if emit {
                out.kv_events
                    .extend(self.cpu_dropped.drain(..).map(|h| KvEvent::OffloadRemoved {
                        block_hashes: vec![h],
                    }));
                offload_events(r, &offloaded, bs, &mut out.kv_events);
            }
            r.num_registered = full;
            self.window_copies(&mut out.kv_events, stored_from);
        }
    }

    fn complete(
        &mut self,
        id: RequestId,
        n: u32,
        end_s: f64,
        out: &mut StepOutput,
        finished: &mut Vec<RequestId>,
    ) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        r.num_computed += n;

        if r.num_computed < r.tokens.len() as u32 {
            return; // chunked prefill continues next step
        }
        // Sample the next token, deterministically from the prompt (greedy-like).
        let k = r.output_len();
        let vocab = &self.cfg.output_vocab;
        let pick = xxh3_64_with_seed(&k.to_le_bytes(), r.output_seed) % vocab.len() as u64;
        let token_id = vocab[pick as usize];
        r.tokens.push(token_id);
        self.stats.generation_tokens += 1;
        if r.first_token_s.is_none() {
            r.first_token_s = Some(end_s);
            r.last_token_s = end_s;
            self.stats.prompt_tokens += u64::from(r.prompt_len);
            out.events.push(RequestEvent::FirstToken {
                request: id,
                token_id,
                cached_tokens: r.cached_tokens.unwrap_or(0),
            });
        } else {
            self.stats.itl_seconds += end_s - r.last_token_s;
            self.stats.itl_count += 1;
            r.last_token_s = end_s;
            out.events.push(RequestEvent::Token {
                request: id,
                token_id,
            });
        }
        if r.output_len() < r.max_output {
            return;
        }
        let summary = RequestSummary {
            prompt_tokens: r.prompt_len,
            output_tokens: r.output_len(),
            cached_tokens: r.cached_tokens.unwrap_or(0),
            num_preemptions: r.num_preemptions,
            arrival_s: r.arrival_s,
            scheduled_s: r.scheduled_s.unwrap_or(r.arrival_s),
            first_token_s: r.first_token_s.unwrap_or(end_s),
            finished_s: end_s,
            lora: r.lora_name.as_deref().map(str::to_owned),
        };
        self.stats.prefill_seconds += summary.first_token_s - summary.scheduled_s;
        self.stats.prefill_computed_tokens +=
            u64::from(summary.prompt_tokens.saturating_sub(summary.cached_tokens));
        let blocks = std::mem::take(&mut r.blocks);
        let (hashes, tokens) = (std::mem::take(&mut r.block_hashes), r.tokens.len());
        self.pool.free(&blocks);
        self.reqs.remove(&id);
        self.drop_out_of_window(&hashes, tokens, out);
        self.stats.requests_finished += 1;
        finished.push(id);
        out.events.push(RequestEvent::Finished {
            request: id,
            summary,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published block hashes as the engine's own u64s.
    fn ints(hashes: &[BlockHash]) -> Vec<u64> {
        hashes.iter().map(BlockHash::to_u64).collect()
    }

    /// 8 blocks of 4 tokens, 1000 prefill tokens/s, 10..20 ms decode steps.
    fn tiny(blocks: u64) -> EngineConfig {
        let mut p = Profile::llama8b_h100();
        p.block_size = 4;
        p.kv_capacity_tokens = blocks * 4;
        p.prefill_tokens_per_s = 1000.0;
        p.decode_step_s_min = 0.010;
        p.decode_step_s_full = 0.020;
        EngineConfig::new(p)
    }

    fn req(id: RequestId, prompt: &[u32], out: u32) -> EngineRequest {
        EngineRequest {
            id,
            prompt_tokens: prompt.to_vec(),
            max_output_tokens: out,
            lora: None,
            cache_salt: None,
            arrival_s: 0.0,
        }
    }

    fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    /// Runs until idle; returns every step's output.
    fn drain(e: &mut Engine, mut now: f64) -> Vec<StepOutput> {
        let mut outs = Vec::new();
        for _ in 0..100_000 {
            if !e.has_work() {
                return outs;
            }
            let out = e.step(now);
            now = out.end_s;
            outs.push(out);
        }
        panic!("engine did not drain");
    }

    fn summaries(outs: &[StepOutput]) -> HashMap<RequestId, RequestSummary> {
        outs.iter()
            .flat_map(|o| &o.events)
            .filter_map(|e| match e {
                RequestEvent::Finished { request, summary } => Some((*request, summary.clone())),
                _ => None,
            })
            .collect()
    }

    fn outputs(outs: &[StepOutput], id: RequestId) -> Vec<u32> {
        outs.iter()
            .flat_map(|o| &o.events)
            .filter_map(|e| match e {
                RequestEvent::FirstToken {
                    request, token_id, ..
                }
                | RequestEvent::Token { request, token_id }
                    if *request == id =>
                {
                    Some(*token_id)
                }
                _ => None,
            })
            .collect()
    }

    fn removed(outs: &[StepOutput]) -> Vec<u64> {
        outs.iter()
            .flat_map(|o| &o.kv_events)
            .filter_map(|e| match e {
                KvEvent::BlockRemoved { block_hashes } => Some(block_hashes[0]),
                _ => None,
            })
            .collect()
    }

    fn hashes(tokens: &[u32], bs: usize) -> Vec<u64> {
        scorer_core::hash::token_block_hashes(0, tokens, bs)
    }

    #[test]
    fn without_prefix_caching_a_repeated_prompt_is_computed_whole() {
        let mut e = Engine::new(EngineConfig::new(Profile::llama8b_h100())).unwrap();
        e.set_prefix_caching(false);
        let prompt = toks(1000..5000);
        e.add_request(req(1, &prompt, 1)).unwrap();
        drain(&mut e, 0.0);
        e.add_request(req(2, &prompt, 1)).unwrap();
        assert_eq!(summaries(&drain(&mut e, 10.0))[&2].cached_tokens, 0);
        // Back on, the blocks the engine kept are found again.
        e.set_prefix_caching(true);
        e.add_request(req(3, &prompt, 1)).unwrap();
        assert_eq!(summaries(&drain(&mut e, 20.0))[&3].cached_tokens, 3984);
    }

    #[test]
    fn warm_prefix_prefills_faster_by_its_cached_share() {
        let cfg = EngineConfig::new(Profile::llama8b_h100());
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let prompt = toks(1000..5000); // 4000 tokens = 250 blocks
        e.add_request(req(1, &prompt, 1)).unwrap();
        let cold = drain(&mut e, 0.0);
        e.add_request(req(2, &prompt, 1)).unwrap();
        let warm = drain(&mut e, 10.0);
        // Last token recomputed: 249 of 250 blocks hit.
        assert_eq!(summaries(&warm)[&2].cached_tokens, 3984);
        let cold_s = cold[0].duration_s;
        let warm_s = warm[0].duration_s;
        let saved = cold_s - warm_s;
        assert!(
            (saved - 3984.0 / p.prefill_tokens_per_s).abs() < 1e-9,
            "saved {saved}"
        );
        assert!(warm_s < cold_s * 0.05);
        let st = e.stats();
        assert_eq!(st.prefix_cache_queries, 8000);
        assert_eq!(st.prefix_cache_hits, 3984);
    }

    #[test]
    fn a_partly_cached_prompt_saves_exactly_its_cached_share() {
        let cfg = EngineConfig::new(Profile::llama8b_h100());
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        // Two 4000-token prompts sharing their first 2000 tokens (125 blocks).
        let mut a = toks(0..2000);
        a.extend(10_000..12_000);
        let mut b = toks(0..2000);
        b.extend(20_000..22_000);
        let mut c = toks(30_000..32_000);
        c.extend(40_000..42_000);
        e.add_request(req(1, &a, 1)).unwrap();
        drain(&mut e, 0.0);
        e.add_request(req(2, &b, 1)).unwrap();
        let warm = drain(&mut e, 10.0);
        e.add_request(req(3, &c, 1)).unwrap();
        let cold = drain(&mut e, 20.0);
        assert_eq!(summaries(&warm)[&2].cached_tokens, 2000);
        assert_eq!(summaries(&cold)[&3].cached_tokens, 0);
        let saved = cold[0].duration_s - warm[0].duration_s;
        assert!(
            (saved - 2000.0 / p.prefill_tokens_per_s).abs() < 1e-9,
            "saved {saved}"
        );
        // Time to first token falls by the same amount.
        let ttft = |o: &[StepOutput], id, start: f64| summaries(o)[&id].first_token_s - start;
        assert!((ttft(&cold, 3, 20.0) - ttft(&warm, 2, 10.0) - saved).abs() < 1e-9);
    }

    #[test]
    fn mixed_prefill_and_decode_step_costs_both() {
        let cfg = EngineConfig::new(Profile::llama8b_h100());
        let p = cfg.profile.clone();
        let slope = (p.decode_step_s_full - p.decode_step_s_min) / p.kv_capacity_tokens as f64;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req(1, &toks(0..500), 5)).unwrap();
        let first = e.step(0.0);
        // Request 1 decodes (1 token, 501 tokens of KV) while request 2 prefills 3000 tokens.
        e.add_request(req(2, &toks(5000..8000), 5)).unwrap();
        let mixed = e.step(first.end_s);
        assert_eq!(mixed.num_scheduled, 2);
        assert_eq!(mixed.num_batched_tokens, 3001);
        let want = p.decode_step_s_min + slope * (501.0 + 3000.0) + 3000.0 / p.prefill_tokens_per_s;
        assert!(
            (mixed.duration_s - want).abs() < 1e-12,
            "{}",
            mixed.duration_s
        );
    }

    #[test]
    fn step_time_follows_the_profile() {
        let cfg = EngineConfig::new(Profile::llama8b_h100());
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req(1, &toks(0..1000), 3)).unwrap();
        let slope = (p.decode_step_s_full - p.decode_step_s_min) / p.kv_capacity_tokens as f64;
        let prefill = e.step(0.0);
        let want = p.decode_step_s_min + slope * 1000.0 + 1000.0 / p.prefill_tokens_per_s;
        assert!((prefill.duration_s - want).abs() < 1e-12);
        assert!((prefill.end_s - want).abs() < 1e-12);
        let decode = e.step(prefill.end_s);
        assert!((decode.duration_s - (p.decode_step_s_min + slope * 1001.0)).abs() < 1e-12);
        // A batch whose KV fills the cache pool costs decode_step_s_full.
        assert!((p.decode_step_s_min + slope * p.kv_capacity_tokens as f64 - 0.022).abs() < 1e-12);
        // One short sequence costs about decode_step_s_min.
        assert!((decode.duration_s - 0.0048).abs() < 0.0001);
    }

    #[test]
    fn jitter_is_bounded_and_seeded() {
        let mut cfg = tiny(64);
        cfg.profile.jitter = 0.2;
        cfg.seed = 7;
        let run = |cfg: EngineConfig| {
            let mut e = Engine::new(cfg).unwrap();
            e.add_request(req(1, &toks(0..8), 20)).unwrap();
            drain(&mut e, 0.0)
                .iter()
                .map(|o| o.duration_s)
                .collect::<Vec<_>>()
        };
        let a = run(cfg.clone());
        assert_eq!(a, run(cfg.clone()));
        assert!(a.iter().any(|d| (d - a[1]).abs() > 1e-9), "jitter varies");
        assert!(
            a[1..]
                .iter()
                .all(|d| *d >= 0.010 * 0.8 && *d <= 0.012 * 1.2)
        );
    }

    #[test]
    fn last_prompt_token_is_always_recomputed() {
        let mut e = Engine::new(tiny(64)).unwrap();
        let prompt = toks(0..8); // exactly two blocks
        e.add_request(req(1, &prompt, 1)).unwrap();
        drain(&mut e, 0.0);
        e.add_request(req(2, &prompt, 1)).unwrap();
        let outs = drain(&mut e, 1.0);
        assert_eq!(summaries(&outs)[&2].cached_tokens, 4);
        assert_eq!(outs[0].num_batched_tokens, 4);
        // One token past the cached blocks: both blocks hit, one token computed.
        e.add_request(req(3, &toks(0..9), 1)).unwrap();
        let outs = drain(&mut e, 2.0);
        assert_eq!(summaries(&outs)[&3].cached_tokens, 8);
        assert_eq!(outs[0].num_batched_tokens, 1);
    }

    #[test]
    fn eviction_only_under_pressure_and_lru() {
        let mut e = Engine::new(tiny(8)).unwrap();
        let (a, b, c, d) = (toks(0..8), toks(100..108), toks(200..216), toks(300..308));
        e.add_request(req(1, &a, 1)).unwrap();
        let mut outs = drain(&mut e, 0.0);
        e.add_request(req(2, &b, 1)).unwrap();
        outs.extend(drain(&mut e, 1.0));
        // Reuse both blocks of A, so B becomes the least recently used.
        e.add_request(req(3, &toks(0..9), 1)).unwrap();
        outs.extend(drain(&mut e, 2.0));
        assert_eq!(e.stats().num_cached_blocks, 4);
        // C takes the four empty blocks: nothing is evicted yet.
        e.add_request(req(4, &c, 1)).unwrap();
        outs.extend(drain(&mut e, 3.0));
        assert!(removed(&outs).is_empty(), "no eviction without pressure");
        assert_eq!(e.stats().num_cached_blocks, 8);
        // D needs two blocks: B's go, tail block first.
        e.add_request(req(5, &d, 1)).unwrap();
        let outs = drain(&mut e, 4.0);
        let hb = hashes(&b, 4);
        assert_eq!(removed(&outs), vec![hb[1], hb[0]]);
        // A is still cached.
        e.add_request(req(6, &toks(0..9), 1)).unwrap();
        assert_eq!(summaries(&drain(&mut e, 5.0))[&6].cached_tokens, 8);
    }

    // A hybrid model's sliding-window group publishes a copy of every stored run under its
    // own group, drops what fell out of the window when the request ends, and loses a block's
    // copy when the full-attention block is evicted; the full-attention group is untouched.
    #[test]
    fn a_sliding_window_group_publishes_its_own_stores_and_drops() {
        let mut cfg = tiny(8);
        cfg.profile.sliding_window_tokens = Some(8);
        let mut e = Engine::new(cfg).unwrap();
        let prompt = toks(0..20); // five full blocks; the last 8 tokens are blocks 3 and 4
        e.add_request(req(1, &prompt, 1)).unwrap();
        let outs = drain(&mut e, 0.0);
        let events: Vec<&KvEvent> = outs.iter().flat_map(|o| &o.kv_events).collect();
        let runs = |pick: fn(&KvEvent) -> Option<&BlockStored>| -> Vec<u64> {
            events
                .iter()
                .filter_map(|e| pick(e))
                .flat_map(|r| ints(&r.block_hashes))
                .collect()
        };
        let h = hashes(&prompt, 4);
        let full = runs(|e| match e {
            KvEvent::BlockStored(r) => Some(r),
            _ => None,
        });
        let window = runs(|e| match e {
            KvEvent::WindowStored(r) => Some(r),
            _ => None,
        });
        assert_eq!(full, h[..5].to_vec());
        assert_eq!(window, full, "the window group stores the same blocks");
        let dropped: Vec<u64> = events
            .iter()
            .filter_map(|e| match e {
                KvEvent::WindowRemoved { block_hashes } => Some(block_hashes[0]),
                _ => None,
            })
            .collect();
        // 21 tokens at the end (20 + 1 generated): blocks wholly before the last 8 are 0..3.
        assert_eq!(dropped, h[..3].to_vec());
        assert!(
            removed(&outs).is_empty(),
            "full attention keeps every block"
        );
        // The wire tags them with their group.
        let wire = crate::kv_events::wire_batch(0.0, &outs[0].kv_events, 0);
        let groups: Vec<Option<u32>> = wire
            .events
            .iter()
            .map(|e| match e {
                vllm_wire::kv_events::WireEvent::BlockStored(s) => s.group_idx,
                _ => None,
            })
            .collect();
        assert!(groups.contains(&Some(0)) && groups.contains(&Some(SLIDING_WINDOW_GROUP)));
        // Evicting the full-attention blocks drops their remaining window copies too.
        e.add_request(req(2, &toks(100..128), 1)).unwrap();
        let outs = drain(&mut e, 1.0);
        let window_gone = outs
            .iter()
            .flat_map(|o| &o.kv_events)
            .filter(|e| matches!(e, KvEvent::WindowRemoved { .. }))
            .count();
        assert!(
            window_gone >= 2,
            "{window_gone} window copies dropped on eviction"
        );
    }

    #[test]
    fn a_request_admitted_in_the_same_step_finds_the_blocks_scheduled_before_it() {
        let mut e = Engine::new(tiny(8)).unwrap();
        let prompt = toks(0..9); // two full blocks
        e.add_request(req(1, &prompt, 1)).unwrap();
        e.add_request(req(2, &prompt, 1)).unwrap();
        let outs = drain(&mut e, 0.0);
        // vLLM commits request 1's blocks when it schedules them, so request 2, admitted
        // right after it in the same step, hits them and computes only its last token.
        let s = summaries(&outs);
        assert_eq!((s[&1].cached_tokens, s[&2].cached_tokens), (0, 8));
        assert_eq!(outs[0].num_batched_tokens, 9 + 1);
        let h = hashes(&prompt, 4);
        let stored: Vec<Vec<u64>> = outs
            .iter()
            .flat_map(|o| &o.kv_events)
            .filter_map(|e| match e {
                KvEvent::BlockStored(BlockStored { block_hashes, .. }) => Some(ints(block_hashes)),
                _ => None,
            })
            .collect();
        assert_eq!(stored, vec![h[..2].to_vec()], "stored once");
        assert_eq!(e.stats().num_cached_blocks, 2);
    }

    #[test]
    fn a_request_arriving_during_another_s_chunked_prefill_finds_all_it_scheduled() {
        let mut cfg = tiny(16);
        cfg.profile.max_num_batched_tokens = 5;
        let mut e = Engine::new(cfg).unwrap();
        let prompt = toks(0..13); // three full blocks
        e.add_request(req(1, &prompt, 1)).unwrap();
        let first = e.step(0.0);
        e.add_request(req(2, &prompt, 1)).unwrap();
        let mut outs = vec![first];
        outs.extend(drain(&mut e, outs[0].end_s));
        // Request 1 takes each step's whole budget until its last chunk (running requests
        // go first); request 2 is admitted beside that chunk and finds every block request
        // 1 has scheduled, so the prompt's blocks are computed and published once.
        let s = summaries(&outs);
        assert_eq!((s[&1].cached_tokens, s[&2].cached_tokens), (0, 12));
        let h = hashes(&prompt, 4);
        let stored: Vec<u64> = outs
            .iter()
            .flat_map(|o| &o.kv_events)
            .filter_map(|e| match e {
                KvEvent::BlockStored(BlockStored { block_hashes, .. }) => Some(ints(block_hashes)),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(stored, h[..3].to_vec());
        assert_eq!(e.stats().num_cached_blocks, 3);
    }

    /// Requests 1 (tokens 0..12) and 2 (100..112), 12 output tokens each, run to idle in 8
    /// blocks: each needs 6 blocks at its end, both together 12, so one is preempted. The
    /// preemption tests read different things off this one overflow.
    fn overflowing_pair() -> (Engine, Vec<StepOutput>) {
        let mut e = Engine::new(tiny(8)).unwrap();
        e.add_request(req(1, &toks(0..12), 12)).unwrap();
        e.add_request(req(2, &toks(100..112), 12)).unwrap();
        let outs = drain(&mut e, 0.0);
        (e, outs)
    }

    #[test]
    fn a_preempted_request_is_counted_once_and_recomputes_from_cache() {
        let (e, outs) = overflowing_pair();
        let s = summaries(&outs);
        assert!(s[&2].num_preemptions > 0);
        // vLLM exports the lookups of first admissions only.
        let st = e.stats();
        assert_eq!(st.prefix_cache_queries, 24);
        assert_eq!(st.prefix_cache_hits, 0);
        assert_eq!(
            s[&2].cached_tokens, 0,
            "cached tokens of the first admission"
        );
        // The re-admission reused the blocks request 2 had filled before its preemption:
        // fewer tokens computed than its prompt plus everything it had generated.
        // Preempted with 17 tokens (4 full blocks cached), request 2's blocks went to the free
        // queue tail first; request 1's growth then evicted its two tail blocks, in that order.
        let done1 = outs
            .iter()
            .position(|o| {
                o.events
                    .iter()
                    .any(|e| matches!(e, RequestEvent::Finished { request: 1, .. }))
            })
            .unwrap();
        let mut seq2 = toks(100..112);
        seq2.extend(outputs(&outs, 2));
        let h2 = hashes(&seq2, 4);
        assert_eq!(removed(&outs[..=done1]), vec![h2[3], h2[2]]);
        // Re-admitted after request 1 finished, it hit the two surviving blocks and computed
        // the other 17 - 8 = 9 tokens.
        assert_eq!(outs[done1 + 1].num_batched_tokens, 9);
    }

    #[test]
    fn preempts_newest_when_cache_overflows() {
        let (e, outs) = overflowing_pair();
        let pre: Vec<_> = outs
            .iter()
            .flat_map(|o| &o.events)
            .filter_map(|e| match e {
                RequestEvent::Preempted { request } => Some(*request),
                _ => None,
            })
            .collect();
        assert!(!pre.is_empty());
        assert!(
            pre.iter().all(|r| *r == 2),
            "the newest request is preempted"
        );
        let s = summaries(&outs);
        assert_eq!(s[&1].num_preemptions, 0);
        assert_eq!(s[&2].num_preemptions as usize, pre.len());
        assert_eq!(s[&1].output_tokens, 12);
        assert_eq!(s[&2].output_tokens, 12);
        assert_eq!(outputs(&outs, 2).len(), 12, "no token is lost or repeated");
        assert_eq!(e.stats().num_preemptions as usize, pre.len());
        assert_eq!(e.stats().kv_cache_usage, 0.0);
    }

    #[test]
    fn generated_tokens_are_cached_for_the_next_turn() {
        let mut e = Engine::new(tiny(64)).unwrap();
        let prompt = toks(0..8);
        e.add_request(req(1, &prompt, 8)).unwrap();
        let outs = drain(&mut e, 0.0);
        let answer = outputs(&outs, 1);
        assert_eq!(answer.len(), 8);
        // 8 prompt + 7 computed output tokens = 3 full blocks.
        let stored: Vec<u64> = outs
            .iter()
            .flat_map(|o| &o.kv_events)
            .flat_map(|e| match e {
                KvEvent::BlockStored(BlockStored { block_hashes, .. }) => ints(block_hashes),
                _ => vec![],
            })
            .collect();
        let mut turn2 = prompt.clone();
        turn2.extend(&answer);
        turn2.extend([900, 901, 902, 903]);
        assert_eq!(stored, hashes(&turn2, 4)[..3].to_vec());
        e.add_request(req(2, &turn2, 1)).unwrap();
        assert_eq!(summaries(&drain(&mut e, 1.0))[&2].cached_tokens, 12);
    }

    #[test]
    fn block_stored_events_chain_like_scorer_core() {
        let mut e = Engine::new(tiny(64)).unwrap();
        e.add_request(req(1, &toks(0..9), 1)).unwrap();
        let outs = drain(&mut e, 0.0);
        let h = hashes(&toks(0..9), 4);
        assert_eq!(
            outs[0].kv_events,
            vec![KvEvent::BlockStored(BlockStored {
                extra_keys: Some(block_extra_keys(2, None, None)),
                ..BlockStored::on_gpu(
                    h.iter().copied().map(BlockHash::Int).collect(),
                    None,
                    toks(0..8),
                    4
                )
            })]
        );
        e.add_request(req(2, &toks(0..13), 1)).unwrap();
        let outs = drain(&mut e, 1.0);
        match &outs[0].kv_events[..] {
            [
                KvEvent::BlockStored(BlockStored {
                    parent_block_hash,
                    token_ids,
                    ..
                }),
            ] => {
                assert_eq!(*parent_block_hash, Some(BlockHash::Int(h[1])));
                assert_eq!(token_ids, &toks(8..12));
            }
            other => panic!("unexpected events {other:?}"),
        }
        assert_eq!(
            e.reset_prefix_cache(false),
            Some(vec![KvEvent::AllBlocksCleared])
        );
        assert_eq!(e.stats().num_cached_blocks, 0);
    }

    #[test]
    fn reset_prefix_cache_waits_for_running_requests_unless_told() {
        let mut e = Engine::new(tiny(64)).unwrap();
        e.add_request(req(1, &toks(0..9), 1)).unwrap();
        drain(&mut e, 0.0);
        e.add_request(req(2, &toks(100..120), 20)).unwrap();
        e.add_request(req(3, &toks(200..220), 20)).unwrap();
        e.step(1.0);
        assert_eq!(e.stats().num_running, 2);
        assert_eq!(e.reset_prefix_cache(false), None, "blocks are held");
        assert!(e.stats().num_cached_blocks > 0);
        assert_eq!(
            e.reset_prefix_cache(true),
            Some(vec![KvEvent::AllBlocksCleared])
        );
        let st = e.stats();
        assert_eq!((st.num_running, st.num_waiting), (0, 2));
        assert_eq!(st.num_cached_blocks, 0);
        assert_eq!(st.num_preemptions, 2);
        // Both resume in their order and finish; nothing is served from the old cache.
        e.add_request(req(4, &toks(0..9), 1)).unwrap();
        let outs = drain(&mut e, 2.0);
        let s = summaries(&outs);
        assert_eq!(s[&2].output_tokens, 20);
        assert_eq!(s[&3].output_tokens, 20);
        assert_eq!(s[&4].cached_tokens, 0);
    }

    #[test]
    fn lora_adapters_do_not_share_cache() {
        let mut e = Engine::new(tiny(64)).unwrap();
        let prompt = toks(0..9);
        e.add_request(req(1, &prompt, 1)).unwrap();
        drain(&mut e, 0.0);
        let mut r = req(2, &prompt, 1);
        r.lora = Some("sql".into());
        e.add_request(r).unwrap();
        let outs = drain(&mut e, 1.0);
        assert_eq!(summaries(&outs)[&2].cached_tokens, 0);
        match &outs[0].kv_events[0] {
            KvEvent::BlockStored(BlockStored {
                lora_id, lora_name, ..
            }) => {
                assert_eq!(*lora_id, Some(1));
                assert_eq!(lora_name.as_deref(), Some("sql"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// The cache salt a stored run's extra keys carry, read as the control plane reads it.
    fn salt_of(run: &BlockStored) -> Option<String> {
        vllm_wire::kv_events::cache_salt(run.extra_keys.as_ref(), run.lora_name.as_deref())
    }

    fn salted(id: RequestId, prompt: &[u32], salt: &str) -> EngineRequest {
        let mut r = req(id, prompt, 1);
        r.cache_salt = Some(salt.into());
        r
    }

    /// Runs `prompt` unsalted (request 1), then salted "a" (request 2), and returns the salted
    /// copy's cached tokens with its steps: both salt tests open this way, one expecting a
    /// miss, the other (salts ignored) a hit.
    fn salted_after_unsalted(e: &mut Engine, prompt: &[u32]) -> (u32, Vec<StepOutput>) {
        e.add_request(req(1, prompt, 1)).unwrap();
        drain(e, 0.0);
        e.add_request(salted(2, prompt, "a")).unwrap();
        let outs = drain(e, 1.0);
        (summaries(&outs)[&2].cached_tokens, outs)
    }

    #[test]
    fn a_cache_salt_isolates_the_prefix_cache_and_rides_on_block_zero() {
        let mut e = Engine::new(tiny(64)).unwrap();
        let prompt = toks(0..13);
        let (cached, outs) = salted_after_unsalted(&mut e, &prompt);
        assert_eq!(cached, 0, "no hit on the unsalted copy");
        match &outs[0].kv_events[..] {
            [
                KvEvent::BlockStored(
                    run @ BlockStored {
                        parent_block_hash: None,
                        block_hashes,
                        ..
                    },
                ),
            ] => {
                assert_eq!(salt_of(run).as_deref(), Some("a"));
                assert_eq!(block_hashes.len(), 3);
            }
            other => panic!("unexpected {other:?}"),
        }
        e.add_request(salted(3, &prompt, "b")).unwrap();
        assert_eq!(
            summaries(&drain(&mut e, 2.0))[&3].cached_tokens,
            0,
            "nor on salt a"
        );
        // The same salt hits, and a longer prompt's new run (parent set) carries no salt.
        e.add_request(salted(4, &toks(0..17), "a")).unwrap();
        let outs = drain(&mut e, 3.0);
        assert_eq!(summaries(&outs)[&4].cached_tokens, 12);
        match &outs[0].kv_events[..] {
            [
                KvEvent::BlockStored(
                    run @ BlockStored {
                        parent_block_hash: Some(_),
                        ..
                    },
                ),
            ] if salt_of(run).is_none() => {}
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn an_engine_that_ignores_cache_salts_hashes_salted_prompts_as_unsalted() {
        let mut e = Engine::new(tiny(64)).unwrap();
        e.set_cache_salt_ignored(true);
        let prompt = toks(0..13);
        let (cached, _) = salted_after_unsalted(&mut e, &prompt);
        assert_eq!(cached, 12, "the salted copy hits the unsalted blocks");
        e.set_cache_salt_ignored(false);
        e.add_request(salted(3, &prompt, "b")).unwrap();
        let outs = drain(&mut e, 2.0);
        assert_eq!(summaries(&outs)[&3].cached_tokens, 0, "salted again");
        match &outs[0].kv_events[..] {
            [KvEvent::BlockStored(run)] => {
                assert_eq!(salt_of(run).as_deref(), Some("b"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    fn lora_req(id: RequestId, prompt: &[u32], out: u32, lora: &str) -> EngineRequest {
        let mut r = req(id, prompt, out);
        r.lora = Some(lora.into());
        r
    }

    #[test]
    fn at_max_loras_a_new_adapter_waits_for_a_slot_and_others_pass_it() {
        let mut cfg = tiny(256);
        cfg.max_loras = 1;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(lora_req(1, &toks(0..9), 20, "sql")).unwrap();
        e.add_request(lora_req(2, &toks(100..109), 2, "chat"))
            .unwrap();
        e.add_request(req(3, &toks(200..209), 2)).unwrap();
        e.add_request(lora_req(4, &toks(300..309), 2, "sql"))
            .unwrap();
        let first = e.step(0.0);
        assert_eq!(first.num_scheduled, 3, "chat is skipped, base and sql run");
        let s = e.stats();
        assert_eq!(s.running_loras, BTreeSet::from(["sql".to_string()]));
        assert_eq!(s.waiting_loras, BTreeSet::from(["chat".to_string()]));
        let outs = drain(&mut e, first.end_s);
        let sums = summaries(&outs);
        // chat starts only after every sql request finished and freed the slot.
        assert!(sums[&2].scheduled_s >= sums[&1].finished_s, "{sums:?}");
        assert!(sums[&2].scheduled_s >= sums[&4].finished_s, "{sums:?}");
        assert_eq!(e.loaded_loras(), ["chat"]);
    }

    #[test]
    fn an_evicted_prefix_comes_back_from_the_cpu_tier_cheaper_than_recompute() {
        let mut cfg = tiny(8);
        cfg.cpu_offload_blocks = 64;
        cfg.profile.jitter = 0.0;
        cfg.profile.cpu_load_tokens_per_s = 10_000.0;
        let mut e = Engine::new(cfg).unwrap();
        let prompt = toks(0..17);
        e.add_request(req(1, &prompt, 1)).unwrap();
        let first = drain(&mut e, 0.0);
        let offloaded: Vec<&KvEvent> = first
            .iter()
            .flat_map(|o| &o.kv_events)
            .filter(|ev| matches!(ev, KvEvent::OffloadStored(_)))
            .collect();
        assert_eq!(offloaded.len(), 1, "{offloaded:?}");
        match offloaded[0] {
            KvEvent::OffloadStored(BlockStored {
                block_hashes,
                token_ids,
                parent_block_hash,
                ..
            }) => {
                assert_eq!(block_hashes.len(), 4);
                assert_eq!(token_ids, &toks(0..16));
                assert_eq!(*parent_block_hash, None);
            }
            other => panic!("{other:?}"),
        }
        // Another prompt takes every GPU block: the first one's blocks leave the GPU only.
        e.add_request(req(2, &toks(100..129), 1)).unwrap();
        let evict = drain(&mut e, 1.0);
        assert!(
            evict
                .iter()
                .flat_map(|o| &o.kv_events)
                .any(|ev| matches!(ev, KvEvent::BlockRemoved { .. }))
        );
        // The first prompt again: its 16 leading tokens load from CPU instead of prefill.
        e.add_request(req(3, &prompt, 1)).unwrap();
        let again = drain(&mut e, 2.0);
        let sums = summaries(&again);
        assert_eq!(sums[&3].cached_tokens, 16);
        let p = &e.config().profile;
        let expected = p.decode_step_s_min
            + (p.decode_step_s_full - p.decode_step_s_min) * 17.0 / p.kv_capacity_tokens as f64
            + 1.0 / p.prefill_tokens_per_s
            + 16.0 / p.cpu_load_tokens_per_s;
        assert!(
            (again[0].duration_s - expected).abs() < 1e-9,
            "{} vs {expected}",
            again[0].duration_s
        );
        // Loaded blocks are cached on the GPU again (published there).
        assert!(
            again
                .iter()
                .flat_map(|o| &o.kv_events)
                .any(|ev| matches!(ev, KvEvent::BlockStored(_)))
        );
    }

    #[test]
    fn the_cpu_tier_drops_least_recently_used_blocks() {
        let mut cfg = tiny(64);
        cfg.cpu_offload_blocks = 2;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req(1, &toks(0..13), 1)).unwrap();
        let outs = drain(&mut e, 0.0);
        let removed: usize = outs
            .iter()
            .flat_map(|o| &o.kv_events)
            .filter(|ev| matches!(ev, KvEvent::OffloadRemoved { .. }))
            .count();
        assert_eq!(removed, 1, "three blocks through a two-block tier");
    }

    #[test]
    fn loading_an_adapter_costs_its_load_time_once() {
        let mut cfg = tiny(256);
        cfg.profile.lora_load_s = 0.5;
        cfg.profile.jitter = 0.0;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req(1, &toks(0..8), 1)).unwrap();
        let base = e.step(0.0).duration_s;
        e.add_request(lora_req(2, &toks(10..18), 1, "sql")).unwrap();
        let loaded = e.step(1.0).duration_s;
        assert!((loaded - base - 0.5).abs() < 1e-9, "{base} {loaded}");
        e.add_request(lora_req(3, &toks(20..28), 1, "sql")).unwrap();
        let warm = e.step(2.0).duration_s;
        assert!((warm - base).abs() < 1e-9, "{base} {warm}");
    }

    #[test]
    fn chunked_prefill_respects_the_token_budget() {
        let mut cfg = tiny(64);
        cfg.profile.max_num_batched_tokens = 16;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req(1, &toks(0..40), 2)).unwrap();
        let outs = drain(&mut e, 0.0);
        let batched: Vec<u32> = outs.iter().map(|o| o.num_batched_tokens).collect();
        assert_eq!(batched, vec![16, 16, 8, 1]);
        assert!(outs[0].events.is_empty() && outs[1].events.is_empty());
        assert!(matches!(outs[2].events[0], RequestEvent::FirstToken { .. }));
    }

    #[test]
    fn batch_size_is_capped() {
        let mut cfg = tiny(64);
        cfg.profile.max_num_seqs = 2;
        let mut e = Engine::new(cfg).unwrap();
        for i in 0..3 {
            e.add_request(req(i, &toks(i as u32 * 10..i as u32 * 10 + 4), 3))
                .unwrap();
        }
        let out = e.step(0.0);
        assert_eq!(out.num_scheduled, 2);
        assert_eq!(e.stats().num_waiting, 1);
        let outs = drain(&mut e, out.end_s);
        let s = summaries(&outs);
        assert!(s[&2].scheduled_s > 0.0, "the third request queued");
    }

    #[test]
    fn rejects_requests_that_cannot_run() {
        let mut e = Engine::new(tiny(8)).unwrap();
        assert!(e.add_request(req(1, &[], 1)).is_err());
        assert!(e.add_request(req(1, &[1], 0)).is_err());
        assert!(
            e.add_request(req(1, &toks(0..30), 10)).is_err(),
            "more than the cache"
        );
        e.add_request(req(1, &[1], 1)).unwrap();
        assert!(matches!(
            e.add_request(req(1, &[1], 1)),
            Err(SimError::DuplicateRequest(1))
        ));
    }

    /// vLLM 0.33 serves a prompt whose `max_tokens` overruns the context, generating only as
    /// many tokens as fit, and refuses a prompt that leaves no room for one.
    #[test]
    fn the_output_is_clamped_to_the_context_and_a_full_prompt_refused() {
        let mut cfg = tiny(1 << 20);
        cfg.profile.max_model_len = 100;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req(1, &toks(0..90), 50)).unwrap();
        let outs = drain(&mut e, 0.0);
        assert_eq!(outputs(&outs, 1).len(), 10, "clamped to the 10 tokens left");
        let err = e.add_request(req(2, &toks(0..100), 1)).unwrap_err();
        assert!(err.to_string().contains("at least 1, got 0"), "{err}");
        let err = e.add_request(req(3, &toks(0..101), 1)).unwrap_err();
        assert!(
            err.to_string().contains("maximum context length is 100"),
            "{err}"
        );
        e.add_request(req(4, &toks(0..99), 1)).unwrap();
    }

    #[test]
    fn abort_frees_blocks() {
        let mut e = Engine::new(tiny(64)).unwrap();
        e.add_request(req(1, &toks(0..20), 50)).unwrap();
        e.add_request(req(2, &toks(50..70), 50)).unwrap();
        e.step(0.0);
        assert!(e.stats().kv_cache_usage > 0.0);
        assert!(e.abort(1));
        assert!(e.abort(2));
        assert!(!e.abort(2));
        assert!(!e.has_work());
        assert_eq!(e.stats().kv_cache_usage, 0.0);
        assert_eq!(e.stats().requests_aborted, 2);
    }

    #[test]
    fn output_is_deterministic_per_prompt() {
        let mut e = Engine::new(tiny(64)).unwrap();
        e.add_request(req(1, &toks(0..5), 6)).unwrap();
        e.add_request(req(2, &toks(0..5), 6)).unwrap();
        e.add_request(req(3, &toks(1..6), 6)).unwrap();
        let outs = drain(&mut e, 0.0);
        assert_eq!(outputs(&outs, 1), outputs(&outs, 2));
        assert_ne!(outputs(&outs, 1), outputs(&outs, 3));
    }

    #[test]
    fn thousands_of_requests_run_fast() {
        let mut e = Engine::new(EngineConfig::new(Profile::llama8b_h100())).unwrap();
        let system = toks(0..512);
        let start = std::time::Instant::now();
        let mut now = 0.0;
        let mut finished = 0;
        for i in 0..3000u32 {
            let mut prompt = system.clone();
            prompt.extend(10_000 + i * 300..10_000 + i * 300 + 200);
            let mut r = req(u64::from(i), &prompt, 32);
            r.arrival_s = now;
            e.add_request(r).unwrap();
            // 100 requests per simulated second.
            let until = now + 0.01;
            while e.has_work() && now < until {
                let out = e.step(now);
                now = out.end_s;
                finished += out
                    .events
                    .iter()
                    .filter(|e| matches!(e, RequestEvent::Finished { .. }))
                    .count();
            }
            now = now.max(until);
        }
        finished += summaries(&drain(&mut e, now)).len();
        assert_eq!(finished, 3000);
        let st = e.stats();
        assert!(st.prefix_cache_hits as f64 / st.prefix_cache_queries as f64 > 0.6);
        assert!(
            start.elapsed().as_secs_f64() < 10.0,
            "took {:?}",
            start.elapsed()
        );
    }
}

#[cfg(test)]
mod remote_prefill_tests {
    use super::*;

    fn engine() -> Engine {
        let mut p = Profile::llama8b_h100();
        p.block_size = 4;
        p.kv_capacity_tokens = 4096;
        p.prefill_tokens_per_s = 1000.0;
        p.decode_step_s_min = 0.010;
        p.decode_step_s_full = 0.020;
        Engine::new(EngineConfig::new(p)).unwrap()
    }

    fn request(id: RequestId, prompt: &[u32]) -> EngineRequest {
        EngineRequest {
            id,
            prompt_tokens: prompt.to_vec(),
            max_output_tokens: 2,
            lora: None,
            cache_salt: None,
            arrival_s: 0.0,
        }
    }

    /// Steps until `id` has its first token; returns that time and its reported cached tokens.
    fn first_token(e: &mut Engine, id: RequestId) -> (f64, u32) {
        let mut now = 0.0;
        for _ in 0..10_000 {
            let out = e.step(now);
            now = out.end_s;
            for ev in out.events {
                if let RequestEvent::FirstToken {
                    request,
                    cached_tokens,
                    ..
                } = ev
                    && request == id
                {
                    return (now, cached_tokens);
                }
            }
        }
        panic!("no first token");
    }

    #[test]
    fn transferred_kv_skips_the_prefill_and_is_cached_afterwards() {
        let prompt: Vec<u32> = (0..401).collect();
        let mut local = engine();
        local.add_request(request(1, &prompt)).unwrap();
        let (local_ttft, _) = first_token(&mut local, 1);
        assert!(local_ttft >= 0.4, "{local_ttft}");

        let mut decode = engine();
        decode.add_remote_prefilled(request(1, &prompt)).unwrap();
        let (remote_ttft, cached) = first_token(&mut decode, 1);
        assert!(remote_ttft < 0.05, "{remote_ttft}");
        assert_eq!(cached, 0, "transferred blocks are not local prefix hits");
        // The transferred blocks are in this replica's prefix cache now.
        while decode.has_work() {
            decode.step(1.0);
        }
        decode.add_request(request(2, &prompt)).unwrap();
        assert_eq!(first_token(&mut decode, 2).1, 400);
    }
}
