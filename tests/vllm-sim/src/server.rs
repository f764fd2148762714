//! The live `vllm-sim` server: one [`Engine`] behind a vLLM-compatible OpenAI HTTP API.
//!
//! A driver task runs the engine in scaled wall time: simulated time advances `speed` seconds
//! per wall second. Busy, it runs steps back to back in simulated time and sleeps until each
//! step's end (so sleep overshoot never accumulates; a step ending within a timer tick is not
//! slept on); idle, it waits on a [`Notify`] and costs
//! nothing, so many replicas share a small machine.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE streaming),
//! the agent APIs `POST /v1/responses` (+ `GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`; [`responses`]) and `POST /v1/messages`
//! (+ `/v1/messages/count_tokens`; [`messages`]), `GET /v1/models`, `GET /health`,
//! `GET /version`, `GET /load`, `POST /tokenize`, `POST /detokenize`, the render endpoints
//! `POST /v1/{chat/completions,completions,responses,messages}/render`,
//! `POST /reset_prefix_cache`, `GET /metrics`, and for tests `GET|POST /sim/fault` (failure
//! injection) and `GET /sim/stats`. Every response carries `x-vllm-sim-replica: host:port`.
//!
//! Every generating endpoint renders its prompt through the one chat path
//! (`Shared::chat_prompt`) and runs it as one engine request ([`Generation`]), so they all
//! share the prefix cache, the `vllm:*` metrics and the KV events.
//!
//! The other paths of a vLLM 0.33 server, as it answers for a generative (text-only) model.
//! vLLM mounts routers by the model's supported tasks
//! (`vllm/entrypoints/launchers/api_server/routers.py::register_api_routers`): a generative
//! model supports `generate` only, so the pooling and speech routers are never mounted and
//! Starlette answers 404 `{"detail":"Not Found"}` (FastAPI's default handler for Starlette's
//! `HTTPException`; vLLM's own handler is keyed by FastAPI's subclass and does not catch it).
//! The simulator answers every unknown path so.
//!
//! | Path | vLLM 0.33 for a generative model | vllm-sim |
//! |---|---|---|
//! | `/v1/embeddings`, `/v2/embed` | not mounted (`pooling/factories.py`: needs task `embed`) | 404 `{"detail":"Not Found"}` |
//! | `/pooling` | not mounted (needs a pooling task) | 404 `{"detail":"Not Found"}` |
//! | `/classify` | not mounted (needs task `classify`) | 404 `{"detail":"Not Found"}` |
//! | `/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank` | not mounted (`enable_scoring_api`: needs `embed`/`classify`) | 404 `{"detail":"Not Found"}` |
//! | `/v1/audio/transcriptions`, `/v1/audio/translations` | not mounted (`speech_to_text/factories.py`: needs task `transcription`) | 404 `{"detail":"Not Found"}` |
//! | `/tokenize` | `serve/tokenize/api_router.py` | `{"count","max_model_len","tokens","token_strs"}` |
//! | `/detokenize` | `serve/tokenize/serving.py::create_detokenize` (decodes without skipping special tokens) | `{"prompt": text}` |

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hashbrown::HashMap;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc, watch};

use super::SimError;
use super::engine::{Engine, EngineConfig, EngineRequest, RequestEvent, RequestId, RequestSummary};
use super::kv_events::{DEFAULT_BUFFER_STEPS, Publisher};
use super::metrics::{LatencyHistograms, ServerInfo};
use super::profile::Profile;
use super::tokenizer::{
    ChatMessage, ChatMl, ChatTemplate, HfTokenizer, IncrementalDecoder, JinjaTemplate, Tokenizer,
    TokenizerConfig, WordTokenizer,
};

pub mod dp;
pub mod messages;
pub mod responses;
mod validation;

/// What `GET /version` reports: the vLLM version whose API this simulates.
pub const VERSION: &str = "0.33.0+sim";

/// Response header naming the replica that served a request.
pub const REPLICA_HEADER: &str = "x-vllm-sim-replica";

/// Response header naming the data-parallel rank (engine) that served a request, sent by a
/// server that runs several ranks behind its one API (`--data-parallel-size` above 1).
pub const DP_RANK_HEADER: &str = "x-vllm-sim-dp-rank";

/// Command line of `vllm-sim`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "vllm-sim",
    about = "A simulated vLLM server: OpenAI API, metrics, KV events",
    args_override_self = true
)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Served model name (default: the profile's model).
    #[arg(long)]
    pub model: Option<String>,
    /// Simulated seconds per wall-clock second.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Profile YAML file, or a built-in name: `llama8b-h100` (default), `fast`.
    #[arg(long)]
    pub profile: Option<String>,
    /// Override the profile's KV cache capacity, tokens (same GPU: the decode cost of a token's
    /// KV is kept).
    #[arg(long)]
    pub kv_capacity_tokens: Option<u64>,
    /// Override the profile's block size, tokens.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Override the profile's maximum context length.
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Bind a ZMQ PUB socket here and publish KV events (e.g. `tcp://127.0.0.1:5557`).
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// Bind a ZMQ ROUTER replay socket here (needs `--kv-events-endpoint`).
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic frame of KV event messages.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Seed of step-time jitter and failure injection.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Override the profile's relative step-time jitter.
    #[arg(long)]
    pub jitter: Option<f64>,
    /// Override the profile's maximum batch size.
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Override the profile's per-step token budget.
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Output length when a request sets no `max_tokens`.
    #[arg(long, default_value_t = 64)]
    pub default_max_tokens: u32,
    /// LoRA adapters served besides the base model (`name` or `name=path`; repeatable).
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// LoRA adapter slots (vLLM `--max-loras`): a request whose adapter finds every slot held
    /// by running requests' adapters waits. Default: one slot per `--lora-modules` adapter.
    #[arg(long)]
    pub max_loras: Option<u32>,
    /// Override the profile's adapter load time, milliseconds (`lora_load_s`).
    #[arg(long)]
    pub lora_load_ms: Option<f64>,
    /// Blocks of a CPU KV offload tier (vLLM's native offloading): GPU blocks are written
    /// through to it, published as KV events with medium `CPU`, and a prefix that left the GPU
    /// loads from it at the profile's `cpu_load_tokens_per_s` instead of being recomputed.
    #[arg(long, default_value_t = 0)]
    pub kv_offload_blocks: u32,
    /// Fraction of completion requests answered with `--fail-status` (failure injection).
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Status code of injected failures.
    #[arg(long, default_value_t = 500)]
    pub fail_status: u16,
    /// A Hugging Face `tokenizer.json` (or a model directory holding one) to tokenise with,
    /// instead of the built-in word tokenizer. A `tokenizer_config.json` beside it supplies
    /// `bos_token`, `eos_token` and the model's chat template, as in vLLM.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Jinja chat template: a file, or the template text itself (vLLM's `--chat-template`).
    /// Default: the tokenizer's own template, else ChatML.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// `prefix_caching_hash_algo` label of `vllm:cache_config_info`. Informational only: the
    /// simulator always hashes blocks with chained xxh3-64 (published like vLLM's default
    /// 64-bit integer event hashes).
    #[arg(long, default_value = "sha256", value_parser = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])]
    pub prefix_caching_hash_algo: String,
    /// vLLM's `--no-enable-prefix-caching`: no prefix-cache lookups (also `POST /sim/fault`
    /// `{"prefix_caching_off": true}` at run time).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// KV transfer bandwidth from a prefill replica, GB/s (llm-d's P/D sidecar: a request with
    /// `x-prefiller-host-port` is prefilled there, then its KV moves here at this rate).
    #[arg(long, default_value_t = 25.0)]
    pub kv_transfer_gbps: f64,
    /// Keep Responses API answers in memory so `previous_response_id`, `GET` and `cancel` find
    /// them, as vLLM does with `VLLM_ENABLE_RESPONSES_API_STORE=1` (either turns it on).
    #[arg(long)]
    pub enable_responses_store: bool,
    /// vLLM's `--data-parallel-size`: this many engines (ranks), each with its own KV cache,
    /// scheduler, `engine="<rank>"` metrics and KV-event publisher (port + rank), behind this
    /// one API server. A request's `X-data-parallel-rank` header picks its rank; without it
    /// the server balances as vLLM's DP client does ([`dp`]).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: u32,
    /// vLLM's `--data-parallel-rank` (the external-load-balancer layout): this server is that
    /// one rank of a `--data-parallel-size` deployment whose ranks each have their own API
    /// server and port. Its metrics say `engine="<rank>"`, its KV events carry the rank and
    /// publish on the configured port + rank.
    #[arg(long)]
    pub data_parallel_rank: Option<u32>,
}

impl SimArgs {
    /// Resolves the profile and its overrides.
    pub fn profile(&self) -> Result<Profile, SimError> {
        let mut p = match self.profile.as_deref() {
            None | Some("llama8b-h100") => Profile::llama8b_h100(),
            Some("fast") => Profile::fast(),
            Some(path) => Profile::load(&PathBuf::from(path))?,
        };
        if let Some(v) = self.kv_capacity_tokens {
            p = p.with_kv_capacity_tokens(v);
        }
        if let Some(v) = self.block_size {
            p.block_size = v;
        }
        if let Some(v) = self.max_model_len {
            p.max_model_len = v;
        }
        if let Some(v) = self.jitter {
            p.jitter = v;
        }
        if let Some(v) = self.max_num_seqs {
            p.max_num_seqs = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            p.max_num_batched_tokens = v;
        }
        if let Some(ms) = self.lora_load_ms {
            p.lora_load_s = ms / 1e3;
        }
        p.validate()?;
        Ok(p)
    }

    /// Whether the Responses API store is on: `--enable-responses-store`, or
    /// `VLLM_ENABLE_RESPONSES_API_STORE` read as vLLM reads it (`bool(int(value))`, so `"1"`
    /// is on, `"0"` off, and a value `int()` refuses stops the server from starting).
    pub fn responses_store_enabled(&self) -> Result<bool, SimError> {
        if self.enable_responses_store {
            return Ok(true);
        }
        match std::env::var(responses::STORE_ENV) {
            Err(_) => Ok(false),
            Ok(v) => python_int_is_nonzero(&v).ok_or_else(|| {
                SimError::Config(format!(
                    "{}: invalid literal for int() with base 10: {v:?}",
                    responses::STORE_ENV
                ))
            }),
        }
    }
}

/// `bool(int(text))` as Python computes it for ASCII digits: surrounding whitespace, one sign
/// and single underscores between digits are allowed; `None` where `int()` would raise.
fn python_int_is_nonzero(text: &str) -> Option<bool> {
    let t = text.trim();
    let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
    let well_formed = !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    well_formed.then(|| digits.bytes().any(|b| b.is_ascii_digit() && b != b'0'))
}

/// Failure injection state, changed with `POST /sim/fault` (fields absent keep their value).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultState {
    /// Every endpoint except `/sim/*` stops answering until this is cleared.
    pub hang: bool,
    /// `/metrics` returns unparseable text.
    pub garbage_metrics: bool,
    /// Fraction of completion requests that fail with `fail_status`.
    pub fail_rate: f64,
    /// Status of injected failures.
    pub fail_status: u16,
    /// Extra latency before a completion request is handled, milliseconds.
    pub delay_ms: u64,
    /// One-shot: the next this many KV-event batches are kept in the replay buffer but not
    /// published (a sequence gap a subscriber can replay). Reads back as 0.
    pub drop_kv_batches: u32,
    /// The engine computes every prompt whole and reports no cached tokens, as vLLM started
    /// with `--no-enable-prefix-caching` does: a replica no router index can match.
    pub prefix_caching_off: bool,
    /// The engine leaves requests' `cache_salt` out of their block hashes and KV events: salted
    /// prompts share blocks with unsalted ones, and a salt-aware router's index never matches
    /// a salted request there.
    pub ignore_cache_salt: bool,
    /// Chat completions are served with another chat template than the pool's: one that
    /// writes a default system message first ([`OTHER_TEMPLATE_PREAMBLE`]), as a replica
    /// started with another `--chat-template` would. Only generation changes: `/tokenize` and
    /// the render API keep the pool's template, as the router's tokenizer has it (a router
    /// tokenising through this replica's render API would otherwise see either template).
    pub other_chat_template: bool,
    /// With `other_chat_template`: the render API (`/v1/chat/completions/render`) renders with
    /// the other template too, as the whole server of a replica started with another
    /// `--chat-template` does; what a diagnosis reads the engine's token ids from. Off by
    /// default because a router tokenising through the replicas' render API would then see
    /// either template.
    pub other_render_template: bool,
    /// The engine knows every LoRA adapter under another name (`<name>-alias`): its block
    /// hashes and KV events name the alias, not the adapter the requests name, as a replica
    /// that loaded the adapter under another name behind a model rewrite would.
    pub lora_alias: bool,
    /// While non-zero, one KV-event batch in this many is lost: not published and not kept for
    /// replay, so a subscriber sees a sequence gap it cannot fill (a PUB socket's high-water
    /// mark dropping batches the replay buffer no longer holds). 0 publishes every batch again.
    pub lose_kv_batch_every: u32,
    /// One-shot: the engine restarts as far as KV state goes: its prefix cache is emptied
    /// (without an event) and the publisher starts again at sequence 0 with an empty replay
    /// buffer. Refused while running requests hold blocks. Reads back as false.
    pub restart_kv_publisher: bool,
}

/// What the `other_chat_template` fault's template writes before the conversation.
pub const OTHER_TEMPLATE_PREAMBLE: &str =
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n";

/// Maps simulated time to wall time: `sim = (wall - epoch) * speed`.
#[derive(Debug, Clone, Copy)]
struct SimClock {
    epoch: Instant,
    speed: f64,
}

impl SimClock {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * self.speed
    }

    fn instant_at(&self, sim_s: f64) -> Instant {
        let wall = (sim_s / self.speed).clamp(0.0, 1e9);
        self.epoch + Duration::from_secs_f64(wall)
    }
}

/// What the driver tells a waiting HTTP handler.
#[derive(Debug)]
enum Delivery {
    Token(u32),
    Finished(RequestSummary),
}

struct Pending {
    tx: mpsc::UnboundedSender<Delivery>,
    arrival_s: f64,
    last_token_s: Option<f64>,
}

struct Shared {
    model: String,
    loras: Vec<String>,
    replica: String,
    default_max_tokens: u32,
    max_model_len: u32,
    info: ServerInfo,
    clock: SimClock,
    engine: Mutex<Engine>,
    wake: Notify,
    pending: Mutex<HashMap<RequestId, Pending>>,
    next_id: AtomicU64,
    hist: Mutex<LatencyHistograms>,
    aborted: AtomicU64,
    fault: Mutex<FaultState>,
    hang_tx: watch::Sender<bool>,
    shutdown_rx: watch::Receiver<bool>,
    rng: Mutex<SmallRng>,
    tokenizer: Arc<dyn Tokenizer>,
    template: Arc<dyn ChatTemplate>,
    publisher: Option<Publisher>,
    created: u64,
    /// llm-d's P/D routing sidecar (remote prefill, KV transfer).
    pd: super::pd::Sidecar,
    /// The Responses API's stored answers (off unless enabled, as in vLLM); one store shared
    /// by every rank of a data-parallel server.
    responses: Arc<responses::Store>,
    /// `/v1/messages` merges inline system messages into the leading one when the chat
    /// template refuses a system message after the first turn (vLLM probes it at startup).
    merge_inline_system: bool,
    /// Random part of response and item ids; seeded per process so replicas never share ids.
    ids: Mutex<SmallRng>,
}

/// A running simulator; dropping it stops the server.
pub struct SimServer {
    /// The HTTP address (port resolved).
    pub addr: SocketAddr,
    /// The bound KV events PUB endpoint, if enabled (rank 0's with data parallelism).
    pub kv_events_endpoint: Option<String>,
    /// Every rank's bound KV events PUB endpoint, in rank order (one without data
    /// parallelism; empty when disabled).
    pub kv_events_endpoints: Vec<String>,
    /// The bound KV events replay endpoint, if enabled (rank 0's with data parallelism).
    pub kv_events_replay_endpoint: Option<String>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl SimServer {
    /// Base URL, `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving and waits (at most 5 s) for the tasks to end.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Binds the sockets and starts serving. Must run inside a tokio runtime.
pub async fn start(args: SimArgs) -> Result<SimServer, SimError> {
    let profile = args.profile()?;
    if !(args.speed.is_finite() && args.speed > 0.0) {
        return Err(SimError::Config("--speed must be a positive number".into()));
    }
    if !(0.0..=1.0).contains(&args.fail_rate) {
        return Err(SimError::Config("--fail-rate must be in [0, 1]".into()));
    }
    if args.default_max_tokens == 0 {
        return Err(SimError::Config("--default-max-tokens must be > 0".into()));
    }
    if !(args.kv_transfer_gbps.is_finite() && args.kv_transfer_gbps > 0.0) {
        return Err(SimError::Config(
            "--kv-transfer-gbps must be a positive number".into(),
        ));
    }
    if args.kv_events_replay_endpoint.is_some() && args.kv_events_endpoint.is_none() {
        return Err(SimError::Config(
            "--kv-events-replay-endpoint needs --kv-events-endpoint".into(),
        ));
    }
    let ranks = dp::engine_ranks(args.data_parallel_size, args.data_parallel_rank)?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| SimError::Io(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| SimError::Io(e.to_string()))?;
    let pipeline = text_pipeline(&args)?;
    // One store per API server: with data parallelism every rank's answers are kept where
    // the API server is, as vLLM's `response_store` lives in the API process.
    let store = Arc::new(responses::Store::new(args.responses_store_enabled()?));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let epoch = Instant::now();
    let mut engines = Vec::with_capacity(ranks.len());
    let mut tasks = Vec::with_capacity(ranks.len() + 1);
    for rank in ranks {
        let shared = engine_state(
            &args,
            &profile,
            addr,
            rank,
            &pipeline,
            &store,
            epoch,
            &shutdown_rx,
        )
        .await?;
        tasks.push(tokio::spawn(drive(shared.clone(), shutdown_rx.clone())));
        engines.push(shared);
    }
    let kv_events_endpoints: Vec<String> = engines
        .iter()
        .filter_map(|s| s.publisher.as_ref().map(|p| p.endpoint.clone()))
        .collect();
    let kv_events_replay_endpoint = engines
        .first()
        .and_then(|s| s.publisher.as_ref())
        .and_then(|p| p.replay_endpoint.clone());
    let several = engines.len() > 1;
    let app = dp::front(
        engines
            .iter()
            .map(|s| (router(s.clone(), several), s.clone()))
            .collect(),
    );
    let mut stop = shutdown_rx;
    tasks.push(tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        });
        if let Err(e) = serve.await {
            tracing::error!("vllm-sim http server failed: {e}");
        }
    }));
    Ok(SimServer {
        addr,
        kv_events_endpoint: kv_events_endpoints.first().cloned(),
        kv_events_endpoints,
        kv_events_replay_endpoint,
        shutdown,
        tasks,
    })
}

/// The state of one engine (one data-parallel rank) of the server at `addr`: its engine, its
/// KV-event publisher (bound at the configured endpoint offset by the rank, as vLLM does) and
/// its `engine="<rank>"` metrics.
#[allow(clippy::too_many_arguments)]
async fn engine_state(
    args: &SimArgs,
    profile: &Profile,
    addr: SocketAddr,
    rank: u32,
    (tokenizer, template): &TextPipeline,
    store: &Arc<responses::Store>,
    epoch: Instant,
    shutdown_rx: &watch::Receiver<bool>,
) -> Result<Arc<Shared>, SimError> {
    let offset = |endpoint: &str| {
        vllm_wire::kv_events::offset_endpoint_port(endpoint, rank).ok_or_else(|| {
            SimError::Config(format!(
                "KV-event endpoint {endpoint} cannot be offset to data-parallel rank {rank}"
            ))
        })
    };
    let publisher = match &args.kv_events_endpoint {
        Some(ep) => {
            let replay = args
                .kv_events_replay_endpoint
                .as_deref()
                .map(offset)
                .transpose()?;
            Some(
                Publisher::start(
                    &offset(ep)?,
                    replay.as_deref(),
                    &args.kv_events_topic,
                    DEFAULT_BUFFER_STEPS,
                    rank,
                )
                .await?,
            )
        }
        None => None,
    };
    let model = args.model.clone().unwrap_or_else(|| profile.model.clone());
    let merge_inline_system = messages::template_needs_merged_system(template.as_ref());
    let mut cfg = EngineConfig::new(profile.clone());
    // Each rank's jitter is its own, as each engine core's step times are.
    cfg.seed = args.seed ^ u64::from(rank).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    cfg.output_vocab = tokenizer.output_vocab().into();
    cfg.kv_events = publisher.is_some();
    let max_loras = args.max_loras.unwrap_or(args.lora_modules.len() as u32);
    cfg.max_loras = max_loras;
    cfg.cpu_offload_blocks = args.kv_offload_blocks;
    let mut engine = Engine::new(cfg)?;
    engine.set_prefix_caching(!args.no_enable_prefix_caching);
    let (hang_tx, _) = watch::channel(false);
    let loras: Vec<String> = args
        .lora_modules
        .iter()
        .map(|m| m.split('=').next().unwrap_or(m).to_owned())
        .collect();
    Ok(Arc::new(Shared {
        info: ServerInfo {
            model_name: model.clone(),
            block_size: profile.block_size,
            max_loras,
            prefix_caching_hash_algo: args.prefix_caching_hash_algo.clone(),
            engine: rank,
        },
        model,
        loras,
        replica: addr.to_string(),
        default_max_tokens: args.default_max_tokens,
        max_model_len: profile.max_model_len,
        clock: SimClock {
            epoch,
            speed: args.speed,
        },
        engine: Mutex::new(engine),
        wake: Notify::new(),
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        hist: Mutex::new(LatencyHistograms::default()),
        aborted: AtomicU64::new(0),
        fault: Mutex::new(FaultState {
            fail_rate: args.fail_rate,
            fail_status: args.fail_status,
            prefix_caching_off: args.no_enable_prefix_caching,
            ..FaultState::default()
        }),
        hang_tx,
        shutdown_rx: shutdown_rx.clone(),
        rng: Mutex::new(SmallRng::seed_from_u64(
            args.seed ^ 0x5eed ^ u64::from(rank),
        )),
        tokenizer: tokenizer.clone(),
        template: template.clone(),
        publisher,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        pd: super::pd::Sidecar::new(profile.kv_bytes_per_token, args.kv_transfer_gbps),
        responses: store.clone(),
        merge_inline_system,
        ids: Mutex::new(SmallRng::seed_from_u64(id_seed(&addr) ^ u64::from(rank))),
    }))
}

/// A seed no other process shares: the bound address, the wall clock and the process id.
fn id_seed(addr: &SocketAddr) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let key = format!("{addr}/{nanos}/{}", std::process::id());
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

/// The tokenizer and chat template `args` ask for (see [`SimArgs::tokenizer`]).
/// How a server turns request text into token ids.
type TextPipeline = (Arc<dyn Tokenizer>, Arc<dyn ChatTemplate>);

fn text_pipeline(args: &SimArgs) -> Result<TextPipeline, SimError> {
    let (tokenizer, config): (Arc<dyn Tokenizer>, TokenizerConfig) = match &args.tokenizer {
        Some(path) => (
            Arc::new(HfTokenizer::from_file(path)?),
            TokenizerConfig::load_beside(path)?,
        ),
        None => (
            Arc::new(WordTokenizer::default()),
            TokenizerConfig::default(),
        ),
    };
    let bos = config.bos_token.as_deref().unwrap_or("");
    let eos = config.eos_token.as_deref().unwrap_or("");
    let template: Arc<dyn ChatTemplate> = match (&args.chat_template, &config.chat_template) {
        (Some(spec), _) => Arc::new(JinjaTemplate::load(spec, bos, eos)?),
        (None, Some(source)) => Arc::new(JinjaTemplate::new(source, bos, eos)?),
        (None, None) => Arc::new(ChatMl),
    };
    Ok((tokenizer, template))
}

/// Largest request body the simulator reads: far above any proxy limit in front of it, like vLLM,
/// which sets none.
pub const MAX_REQUEST_BODY_BYTES: usize = 64 * 1024 * 1024;

/// The routes of one engine. `rank_header`: name the engine's rank in [`DP_RANK_HEADER`]
/// (a server with several ranks behind its one API).
fn router(shared: Arc<Shared>, rank_header: bool) -> Router {
    let replica = HeaderValue::from_str(&shared.replica)
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    let rank = rank_header.then_some(shared.info.engine);
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions/render", post(render_completion))
        .merge(responses::routes())
        .merge(messages::routes())
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route(
            "/version",
            get(|| async { axum::Json(json!({"version": VERSION})) }),
        )
        .route("/load", get(load))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/metrics", get(metrics))
        .route(vllm_wire::prom::RESTRICTED_METRICS_PATH, get(metrics))
        .route("/sim/fault", get(get_fault).post(set_fault))
        .route("/sim/stats", get(sim_stats))
        .fallback(not_found)
        // vLLM (uvicorn) reads bodies of any size; axum's 2 MiB default would make the simulator
        // refuse prompts a real replica serves, so only the proxy's limits apply.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES))
        .layer(middleware::from_fn_with_state(shared.clone(), hang_layer))
        .layer(middleware::map_response(move |mut res: Response| {
            let replica = replica.clone();
            async move {
                let headers = res.headers_mut();
                headers.insert(HeaderName::from_static(REPLICA_HEADER), replica);
                if let Some(rank) = rank {
                    headers.insert(
                        HeaderName::from_static(DP_RANK_HEADER),
                        HeaderValue::from(rank),
                    );
                }
                res
            }
        }))
        .with_state(shared)
}

/// A path vLLM does not mount: Starlette's 404, as FastAPI's default handler renders it.
async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"detail": "Not Found"})),
    )
        .into_response()
}

/// Holds every non-`/sim/` request while the `hang` fault is set.
async fn hang_layer(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/sim/") {
        let mut hang = s.hang_tx.subscribe();
        let mut stop = s.shutdown_rx.clone();
        tokio::select! {
            _ = hang.wait_for(|hang| !*hang) => {}
            _ = stop.wait_for(|stop| *stop) => {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down")
                    .into_response();
            }
        }
    }
    next.run(req).await
}

// ---------------------------------------------------------------------------------------------
// Engine driver

async fn drive(s: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    /// Behind wall time by more than this (wall seconds), the simulation slips instead of
    /// racing to catch up.
    const MAX_LAG_WALL_S: f64 = 0.05;
    let mut sim_now = 0.0f64;
    let mut busy = false;
    let mut empty_steps = 0u32;
    loop {
        loop {
            let notified = s.wake.notified();
            if s.engine.lock().has_work() {
                break;
            }
            busy = false;
            tokio::select! {
                _ = notified => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
        }
        let wall = s.clock.now();
        if !busy || wall - sim_now > MAX_LAG_WALL_S * s.clock.speed {
            sim_now = sim_now.max(wall);
        }
        let out = s.engine.lock().step(sim_now);
        busy = true;
        if out.num_scheduled == 0 {
            if let Some(p) = &s.publisher {
                p.publish(unix_now_s(), out.kv_events);
            }
            // A step that only preempted: the next one admits again.
            empty_steps += 1;
            if empty_steps < 2 {
                continue;
            }
            // Nothing fits at all; wait for a request or an abort to change that.
            tokio::select! {
                _ = s.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
            busy = false;
            continue;
        }
        empty_steps = 0;
        let deadline = s.clock.instant_at(out.end_s);
        if deadline > Instant::now() + TIMER_RESOLUTION {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline.into()) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
        } else {
            tokio::task::yield_now().await;
        }
        sim_now = out.end_s;
        if let Some(p) = &s.publisher {
            p.publish(unix_now_s(), out.kv_events);
        }
        deliver(&s, out.end_s, out.events);
    }
}

/// tokio's timers tick in milliseconds: a sleep of a few microseconds lasts about a whole
/// millisecond, so a step of the `fast` profile (20 µs) answered either at once (when its end
/// had passed by the check) or a millisecond later, and an upstream measured through it read
/// 0.3 or 1.3 ms by chance. A step ending less than this far ahead is not slept on: its
/// events go out at once, at most this early, and the simulated clock keeps its own time.
const TIMER_RESOLUTION: Duration = Duration::from_millis(1);

/// Wall-clock Unix time, seconds (KV event batch timestamps, `lora_requests_info`).
fn unix_now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn deliver(s: &Shared, end_s: f64, events: Vec<RequestEvent>) {
    let mut pending = s.pending.lock();
    let mut hist = s.hist.lock();
    // The histograms are in wall seconds, as a real engine's are: at `--speed 2` a simulated
    // second takes half a wall second.
    let wall = |sim_s: f64| sim_s / s.clock.speed;
    for ev in events {
        match ev {
            RequestEvent::FirstToken {
                request, token_id, ..
            } => {
                if let Some(p) = pending.get_mut(&request) {
                    hist.ttft.observe(wall(end_s - p.arrival_s));
                    p.last_token_s = Some(end_s);
                    let _ = p.tx.send(Delivery::Token(token_id));
                }
            }
            RequestEvent::Token { request, token_id } => {
                if let Some(p) = pending.get_mut(&request) {
                    if let Some(last) = p.last_token_s {
                        hist.itl.observe(wall(end_s - last));
                    }
                    p.last_token_s = Some(end_s);
                    let _ = p.tx.send(Delivery::Token(token_id));
                }
            }
            RequestEvent::Finished { request, summary } => {
                hist.e2e
                    .observe(wall(summary.finished_s - summary.arrival_s));
                hist.queue
                    .observe(wall(summary.scheduled_s - summary.arrival_s));
                hist.prefill
                    .observe(wall(summary.first_token_s - summary.scheduled_s));
                hist.prefill_computed.observe(f64::from(
                    summary.prompt_tokens.saturating_sub(summary.cached_tokens),
                ));
                if let Some(p) = pending.remove(&request) {
                    let _ = p.tx.send(Delivery::Finished(summary));
                }
            }
            RequestEvent::Preempted { .. } => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI API

/// An API error, rendered in vLLM's shape (`ErrorResponse`,
/// `vllm/entrypoints/serve/engine/protocol.py`): `{"error": {"message", "type", "param",
/// "code"}}`, `code` being the HTTP status.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    /// `error.type` when it is not vLLM's default for the status (`BadRequestError`, ...).
    kind: Option<&'static str>,
    /// `error.param`: the request field at fault, when vLLM names one.
    param: Option<String>,
    /// Raised before any handler runs (FastAPI's request validation), so it keeps the OpenAI
    /// shape even on `/v1/messages`, whose handler translates only its own errors.
    framework: bool,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: None,
            param: None,
            framework: false,
        }
    }

    /// Sets `error.type` (vLLM's `err_type`).
    fn kind(mut self, kind: &'static str) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Sets `error.param`.
    fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// `error.type` as vLLM renders it.
    fn error_type(&self) -> &'static str {
        self.kind.unwrap_or(match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            _ => "InternalServerError",
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.error_type(),
                                    "param": self.param, "code": self.status.as_u16()}});
        (self.status, axum::Json(body)).into_response()
    }
}

/// What handlers return.
type ApiResult = Result<Response, ApiError>;

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, message)
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<RawMessage>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    add_special_tokens: bool,
    #[serde(default)]
    cache_salt: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: Value,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u32>,
    #[serde(default = "yes")]
    add_special_tokens: bool,
    #[serde(default)]
    cache_salt: Option<String>,
}

fn yes() -> bool {
    true
}

/// A `VLLMValidationError(message, parameter=...)` as vLLM's handlers render it: 400
/// `BadRequestError`, the parameter in `param` and appended to the message (its `__str__`,
/// `vllm/exceptions.py`).
fn vllm_validation(message: &str, parameter: &str) -> ApiError {
    bad_request(format!("{message} (parameter={parameter})")).param(parameter)
}

/// vLLM 0.33's `validate_cache_salt` (`vllm/entrypoints/generate/base/protocol.py`): absent or
/// null is no salt; an empty salt, one over 128 characters, or one holding `@`, `/`, `\` or
/// NUL is refused with 400 (a non-string already failed to parse).
fn cache_salt(salt: Option<String>) -> Result<Option<String>, ApiError> {
    match salt {
        Some(s) if s.is_empty() => Err(vllm_validation(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            "cache_salt",
        )),
        Some(s) if s.chars().count() > 128 || s.contains(['@', '/', '\\', '\0']) => {
            Err(vllm_validation(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain \
                 '@', '/', '\\\\', or NUL.",
                "cache_salt",
            ))
        }
        salt => Ok(salt),
    }
}

#[derive(Debug, Deserialize)]
struct RawMessage {
    role: String,
    #[serde(default)]
    content: Value,
}

/// Content part types vLLM reads as text, and the field holding the text
/// (`TEXT_PART_TYPES` and `MM_PARSER_MAP`, `vllm/renderers/chat_utils/chat_message.py`).
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// Content part types vLLM hands to the multimodal processor, which a text-only model refuses.
const MEDIA_PARTS: [&str; 9] = [
    "input_image",
    "image_url",
    "image_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
];

/// Why message content cannot be rendered.
#[derive(Debug, PartialEq)]
enum ContentError {
    /// An image, audio or video part: the simulated model is text-only.
    Media,
    /// Anything else, with the reason.
    Invalid(String),
}

/// Flattens OpenAI message content (string, null, or a list of parts) into text, as vLLM's
/// "string" content format does: the parts' texts joined by newlines.
fn flatten_content(v: &Value) -> Result<String, ContentError> {
    let parts = match v {
        Value::Null => return Ok(String::new()),
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => {
            return Err(ContentError::Invalid(
                "message content must be a string or a list of parts".into(),
            ));
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        if let Some(text) = part.as_str() {
            texts.push(text);
            continue;
        }
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
        if MEDIA_PARTS.contains(&kind) {
            return Err(ContentError::Media);
        }
        let field = TEXT_PARTS
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or("text", |(_, f)| *f);
        match part.get(field) {
            Some(Value::String(text)) => texts.push(text),
            // vLLM skips a text part whose text is missing or null.
            None | Some(Value::Null) if TEXT_PARTS.iter().any(|(k, _)| *k == kind) => {}
            _ => {
                return Err(ContentError::Invalid(
                    "only text content parts are supported".into(),
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// How a rendered chat prompt ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptEnd {
    /// With the assistant turn's header (`add_generation_prompt`).
    Generate,
    /// Where the template leaves the last message.
    Plain,
    /// Right after the last message's text, so the model continues it
    /// (`continue_final_message`, cut as transformers' `apply_chat_template` cuts).
    ContinueFinal,
}

impl PromptEnd {
    fn generate(add_generation_prompt: bool) -> Self {
        if add_generation_prompt {
            Self::Generate
        } else {
            Self::Plain
        }
    }
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad_request(format!("invalid request body: {e}")))
}

impl Shared {
    /// Puts what the `other_chat_template` fault's template writes before the conversation
    /// in front of `prompt`.
    fn write_other_template(&self, prompt: &mut Vec<u32>) -> Result<(), ApiError> {
        let preamble = self
            .tokenizer
            .encode(OTHER_TEMPLATE_PREAMBLE, false)
            .map_err(|e| bad_request(e.to_string()))?;
        prompt.splice(0..0, preamble);
        Ok(())
    }

    /// Validates the `model` field; returns the LoRA adapter it names, if any.
    fn resolve_model(&self, model: Option<&str>) -> Result<Option<String>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.model => Ok(None),
            Some(m) if self.loras.iter().any(|l| l == m) => Ok(Some(m.to_owned())),
            // `_check_model`, vllm/entrypoints/serve/engine/serving.py: only base models are
            // listed as aliases.
            Some(m) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{m}` does not exist. Valid aliases: {}.",
                    self.model
                ),
            )
            .param("model")),
        }
    }

    /// The request's messages as the template sees them: each content flattened to text.
    fn chat_messages(&self, raw: &[RawMessage]) -> Result<Vec<ChatMessage>, ApiError> {
        if raw.is_empty() {
            return Err(bad_request("messages must not be empty"));
        }
        raw.iter()
            .map(|m| {
                let content = flatten_content(&m.content).map_err(|e| match e {
                    // vLLM's `MultiModalRegistry.create_processor` (a ValueError, hence 400).
                    ContentError::Media => {
                        bad_request(format!("{} is not a multimodal model", self.model))
                    }
                    ContentError::Invalid(why) => bad_request(why),
                })?;
                Ok(ChatMessage {
                    role: m.role.clone(),
                    content,
                })
            })
            .collect()
    }

    /// The prompt ids of chat messages given as JSON objects (what the agent APIs build from
    /// their requests, as vLLM builds OpenAI chat messages), through the chat path.
    fn chat_prompt_of(&self, msgs: &[Value], end: PromptEnd) -> Result<Vec<u32>, ApiError> {
        let raw = msgs
            .iter()
            .map(|m| RawMessage::deserialize(m).map_err(|e| bad_request(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        self.render_prompt(&self.chat_messages(&raw)?, end, false)
    }

    fn completion_prompt(
        &self,
        prompt: &Value,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let encode = |text: &str| {
            self.tokenizer
                .encode(text, add_special_tokens)
                .map_err(|e| bad_request(e.to_string()))
        };
        match prompt {
            Value::String(s) => encode(s),
            Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                encode(items[0].as_str().unwrap_or_default())
            }
            Value::Array(items) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| bad_request("token ids must fit in u32"))
                })
                .collect(),
            _ => Err(bad_request(
                "prompt must be a string, a list with one string, or a list of token ids",
            )),
        }
    }

    /// The prompt ids of a chat request: rendered through the template, then tokenised
    /// (special tokens are not added by default: the template writes them).
    fn chat_prompt(
        &self,
        msgs: &[ChatMessage],
        add_generation_prompt: bool,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        self.render_prompt(
            msgs,
            PromptEnd::generate(add_generation_prompt),
            add_special_tokens,
        )
    }

    /// Renders `msgs` ending as `end` asks, then tokenises the text.
    fn render_prompt(
        &self,
        msgs: &[ChatMessage],
        end: PromptEnd,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let mut text = self
            .template
            .render(msgs, end == PromptEnd::Generate)
            .map_err(|e| bad_request(e.to_string()))?;
        if end == PromptEnd::ContinueFinal {
            let last = msgs.last().map_or("", |m| m.content.as_str());
            text = vllm_wire::chat_template::cut_after_final_message(&text, last).ok_or_else(
                || {
                    bad_request(
                        "continue_final_message is set but the final message does not appear in \
                     the chat after applying the chat template!",
                    )
                },
            )?;
        }
        self.tokenizer
            .encode(&text, add_special_tokens)
            .map_err(|e| bad_request(e.to_string()))
    }

    /// A fresh id: `prefix` and 16 hex digits, the form of vLLM's `random_uuid()`
    /// (`vllm/utils/__init__.py`: the low 64 bits of a UUID4).
    fn random_id(&self, prefix: &str) -> String {
        format!("{prefix}{:016x}", self.ids.lock().random::<u64>())
    }

    /// Failure injection common to both completion endpoints.
    async fn inject_faults(&self) -> Result<(), ApiError> {
        let f = self.fault.lock().clone();
        if f.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(f.delay_ms)).await;
        }
        if f.fail_rate > 0.0 && self.rng.lock().random_bool(f.fail_rate.clamp(0.0, 1.0)) {
            let status =
                StatusCode::from_u16(f.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Err(ApiError::new(status, "injected failure"));
        }
        Ok(())
    }
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> ApiResult {
    s.inject_faults().await?;
    let req: ChatRequest = parse(&body)?;
    let lora = s.resolve_model(req.model.as_deref())?;
    let cache_salt = cache_salt(req.cache_salt)?;
    let msgs = s.chat_messages(&req.messages)?;
    let mut prompt = s.chat_prompt(&msgs, req.add_generation_prompt, req.add_special_tokens)?;
    if s.fault.lock().other_chat_template {
        s.write_other_template(&mut prompt)?;
    }
    let (remote_prefilled, kv_transfer) =
        disaggregation(&s, &headers, "/v1/chat/completions", &body, prompt.len()).await;
    let job = Job {
        chat: true,
        model: req.model.unwrap_or_else(|| s.model.clone()),
        engine: EngineJob {
            lora,
            cache_salt,
            prompt,
            max_tokens: req.max_completion_tokens.or(req.max_tokens),
            remote_prefilled,
        },
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        n: req.n,
        kv_transfer,
    };
    run_job(s, job).await
}

async fn completions(
    State(s): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> ApiResult {
    s.inject_faults().await?;
    let req: CompletionRequest = parse(&body)?;
    let lora = s.resolve_model(req.model.as_deref())?;
    let cache_salt = cache_salt(req.cache_salt)?;
    let prompt = s.completion_prompt(&req.prompt, req.add_special_tokens)?;
    let (remote_prefilled, kv_transfer) =
        disaggregation(&s, &headers, "/v1/completions", &body, prompt.len()).await;
    let job = Job {
        chat: false,
        model: req.model.unwrap_or_else(|| s.model.clone()),
        engine: EngineJob {
            lora,
            cache_salt,
            prompt,
            max_tokens: req.max_tokens,
            remote_prefilled,
        },
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        n: req.n,
        kv_transfer,
    };
    run_job(s, job).await
}

/// The P/D part of a completion request: whether its KV was prefilled remotely (decode side,
/// `x-prefiller-host-port`), and whether it is itself a prefill for a remote decode (prefill
/// side, `kv_transfer_params.do_remote_decode`), whose answer carries `kv_transfer_params`.
async fn disaggregation(
    s: &Shared,
    headers: &axum::http::HeaderMap,
    path: &str,
    body: &Bytes,
    prompt_tokens: usize,
) -> (bool, bool) {
    let remote_decode = serde_json::from_slice::<Value>(body)
        .is_ok_and(|v| super::pd::is_remote_decode_request(&v));
    if remote_decode {
        s.pd.count_prefill_served();
        return (false, true);
    }
    let remote =
        s.pd.prefill_remotely(headers, path, body, prompt_tokens, s.clock.speed)
            .await;
    (remote, false)
}

/// A chat or completion request, ready to run.
struct Job {
    chat: bool,
    model: String,
    engine: EngineJob,
    stream: bool,
    include_usage: bool,
    n: Option<u32>,
    /// This is a prefill for a remote decode: answer with `kv_transfer_params`.
    kv_transfer: bool,
}

/// What every generating endpoint hands the engine: a rendered prompt and its limits.
struct EngineJob {
    lora: Option<String>,
    /// vLLM's `cache_salt`, keying the prompt's cached blocks.
    cache_salt: Option<String>,
    prompt: Vec<u32>,
    /// Output length; `None` takes `--default-max-tokens`.
    max_tokens: Option<u32>,
    /// The prompt's KV came from a prefill replica (llm-d's P/D sidecar).
    remote_prefilled: bool,
}

/// Aborts the engine request if the handler (or stream) is dropped before it finished.
struct AbortGuard {
    shared: Arc<Shared>,
    id: RequestId,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.shared.pending.lock().remove(&self.id);
            if self.shared.engine.lock().abort(self.id) {
                self.shared.aborted.fetch_add(1, Ordering::Relaxed);
            }
            self.shared.wake.notify_one();
        }
    }
}

/// One engine request being generated, as every API reads it: the tokens the driver delivers
/// step by step, and a guard that aborts the request when its answer is dropped unfinished
/// (a client disconnect), so all APIs share one admission and abort path.
struct Generation {
    s: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Delivery>,
    guard: AbortGuard,
    detok: IncrementalDecoder,
}

/// What one engine step produced for a request.
struct StepText {
    /// Text of the step's new tokens (possibly empty: an incomplete character).
    text: String,
    /// Set on the request's last step.
    finished: Option<RequestSummary>,
}

impl Generation {
    /// Queues `job` in the engine.
    fn start(s: &Arc<Shared>, job: EngineJob) -> Result<Self, ApiError> {
        // vLLM's `TokenizeParams` refuses an output budget above the whole context; a smaller
        // one that overruns the context left is clamped by the engine.
        if let Some(max) = job.max_tokens.filter(|&m| m > s.max_model_len) {
            return Err(bad_request(format!(
                "max_tokens={max} cannot be greater than max_model_len={}. Please request \
                 fewer output tokens.",
                s.max_model_len
            )));
        }
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let arrival_s = s.clock.now();
        s.pending.lock().insert(
            id,
            Pending {
                tx,
                arrival_s,
                last_token_s: None,
            },
        );
        let request = EngineRequest {
            id,
            prompt_tokens: job.prompt,
            max_output_tokens: job.max_tokens.unwrap_or(s.default_max_tokens),
            lora: match job.lora {
                Some(name) if s.fault.lock().lora_alias => Some(format!("{name}-alias")),
                other => other,
            },
            cache_salt: job.cache_salt,
            arrival_s,
        };
        let added = if job.remote_prefilled {
            s.engine.lock().add_remote_prefilled(request)
        } else {
            s.engine.lock().add_request(request)
        };
        if let Err(e) = added {
            s.pending.lock().remove(&id);
            return Err(bad_request(e.to_string()));
        }
        s.wake.notify_one();
        Ok(Self {
            s: s.clone(),
            rx,
            guard: AbortGuard {
                shared: s.clone(),
                id,
                done: false,
            },
            detok: IncrementalDecoder::default(),
        })
    }

    /// Waits for the next step that produced something for this request and returns all of
    /// it (the driver delivers a step's tokens together); `None` if the request was dropped.
    async fn next_step(&mut self) -> Option<StepText> {
        let mut out = StepText {
            text: String::new(),
            finished: None,
        };
        let first = self.rx.recv().await?;
        self.take(first, &mut out);
        while out.finished.is_none() {
            match self.rx.try_recv() {
                Ok(d) => self.take(d, &mut out),
                Err(_) => break,
            }
        }
        if out.finished.is_some() {
            self.guard.done = true;
        }
        Some(out)
    }

    fn take(&mut self, d: Delivery, out: &mut StepText) {
        match d {
            Delivery::Token(id) => out
                .text
                .push_str(&self.detok.push(self.s.tokenizer.as_ref(), id)),
            Delivery::Finished(summary) => out.finished = Some(summary),
        }
    }

    /// Waits for the whole answer: its text (decoded at once) and summary.
    async fn finish(mut self) -> Result<(String, RequestSummary), ApiError> {
        let mut ids = Vec::new();
        let summary = loop {
            match self.rx.recv().await {
                Some(Delivery::Token(token_id)) => ids.push(token_id),
                Some(Delivery::Finished(summary)) => break summary,
                None => {
                    return Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "request was dropped",
                    ));
                }
            }
        };
        self.guard.done = true;
        Ok((self.s.tokenizer.decode(&ids), summary))
    }
}

/// Unix time in whole seconds (`created`, `created_at`).
fn unix_now_secs(s: &Shared) -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(s.created)
}

async fn run_job(s: Arc<Shared>, job: Job) -> ApiResult {
    if job.n.is_some_and(|n| n != 1) {
        return Err(bad_request("only n=1 is supported"));
    }
    let generation = Generation::start(&s, job.engine)?;
    let id = generation.guard.id;
    let prefix = if job.chat { "chatcmpl" } else { "cmpl" };
    let ctx = ChunkCtx {
        id: format!("{prefix}-sim-{id}"),
        chat: job.chat,
        model: job.model,
        created: unix_now_secs(&s),
        kv_transfer: job.kv_transfer,
    };
    if job.stream {
        Ok(stream_response(ctx, generation, job.include_usage))
    } else {
        full_response(s, ctx, generation).await
    }
}

struct ChunkCtx {
    id: String,
    chat: bool,
    model: String,
    created: u64,
    /// Answer with `kv_transfer_params` (a prefill for a remote decode).
    kv_transfer: bool,
}

/// Prompt tokens the request wrote to the prefix cache: its full blocks not read from it
/// (vLLM's `PrefillStats.finalize` with the blocks the request holds after its prefill,
/// `num_cache_creation_tokens`).
fn cache_write_tokens(sum: &RequestSummary, block_size: u32) -> u32 {
    let block = block_size.max(1);
    (sum.prompt_tokens / block * block).saturating_sub(sum.cached_tokens)
}

fn usage(summary: &RequestSummary) -> Value {
    json!({
        "prompt_tokens": summary.prompt_tokens,
        "total_tokens": summary.prompt_tokens + summary.output_tokens,
        "completion_tokens": summary.output_tokens,
        "prompt_tokens_details": {"cached_tokens": summary.cached_tokens},
    })
}

async fn full_response(s: Arc<Shared>, ctx: ChunkCtx, generation: Generation) -> ApiResult {
    let (text, summary) = generation.finish().await?;
    let choice = if ctx.chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
               "logprobs": null, "finish_reason": "length", "stop_reason": null})
    } else {
        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
               "stop_reason": null, "prompt_logprobs": null})
    };
    let mut body = json!({
        "id": ctx.id,
        "object": if ctx.chat { "chat.completion" } else { "text_completion" },
        "created": ctx.created,
        "model": ctx.model,
        "choices": [choice],
        "usage": usage(&summary),
    });
    if ctx.kv_transfer {
        body["kv_transfer_params"] = super::pd::prefill_answer_params(&s.replica);
    }
    Ok(axum::Json(body).into_response())
}

/// An SSE response whose body is `frames`.
fn sse_response<S>(frames: S) -> Response
where
    S: futures_util::Stream<Item = String> + Send + 'static,
{
    use futures_util::StreamExt;
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(
            frames.map(|f| Ok::<_, std::convert::Infallible>(Bytes::from(f))),
        ))
        .unwrap_or_else(|_| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "cannot build stream").into_response()
        })
}

fn stream_response(ctx: ChunkCtx, generation: Generation, include_usage: bool) -> Response {
    struct St {
        ctx: ChunkCtx,
        generation: Generation,
        include_usage: bool,
        sent_role: bool,
        done: bool,
    }
    let chunk = |ctx: &ChunkCtx, delta: Option<&str>, finish: Option<&str>, role: bool| {
        let choice = if ctx.chat {
            let mut d = serde_json::Map::new();
            if role {
                d.insert("role".into(), json!("assistant"));
            }
            d.insert("content".into(), json!(delta.unwrap_or("")));
            json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": delta.unwrap_or(""), "logprobs": null,
                   "finish_reason": finish, "stop_reason": null})
        };
        let obj = if ctx.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let v = json!({"id": ctx.id, "object": obj, "created": ctx.created,
                       "model": ctx.model, "choices": [choice]});
        format!("data: {v}\n\n")
    };
    let st = St {
        ctx,
        generation,
        include_usage,
        sent_role: false,
        done: false,
    };
    let stream = futures_util::stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        // Tokens are delivered one per step; send what is there, waiting for at least one.
        let step = st.generation.next_step().await?;
        let mut out = String::new();
        if st.ctx.chat && !st.sent_role {
            // Like vLLM, the chat stream opens (with an empty delta carrying the role) only
            // once the first token exists, so clients measure TTFT at the first chunk.
            st.sent_role = true;
            out.push_str(&chunk(&st.ctx, Some(""), None, true));
        }
        match step.finished {
            None => out.push_str(&chunk(&st.ctx, Some(&step.text), None, false)),
            Some(sum) => {
                st.done = true;
                out.push_str(&chunk(&st.ctx, Some(&step.text), Some("length"), false));
                if st.include_usage {
                    let v = json!({"id": st.ctx.id,
                        "object": if st.ctx.chat { "chat.completion.chunk" } else { "text_completion" },
                        "created": st.ctx.created, "model": st.ctx.model, "choices": [],
                        "usage": usage(&sum)});
                    out.push_str(&format!("data: {v}\n\n"));
                }
                out.push_str("data: [DONE]\n\n");
            }
        }
        Some((out, st))
    });
    sse_response(stream)
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<RawMessage>>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    return_token_strs: bool,
    /// Default: true for a prompt, false for messages (vLLM's defaults).
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

async fn tokenize(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let req: TokenizeRequest = parse(&body)?;
    s.resolve_model(req.model.as_deref())?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => s.completion_prompt(p, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(m)) => s.chat_prompt(
            &s.chat_messages(m)?,
            req.add_generation_prompt,
            req.add_special_tokens.unwrap_or(false),
        )?,
        _ => return Err(bad_request("give exactly one of prompt or messages")),
    };
    let token_strs = req.return_token_strs.then(|| {
        tokens
            .iter()
            .map(|t| s.tokenizer.token_str(*t))
            .collect::<Vec<_>>()
    });
    let body = json!({"count": tokens.len(), "max_model_len": s.max_model_len,
                      "tokens": tokens, "token_strs": token_strs});
    Ok(axum::Json(body).into_response())
}

/// vLLM's `POST /detokenize` (`serve/tokenize/serving.py::create_detokenize`):
/// `{"model"?, "tokens": [ids]}` answers `{"prompt": text}`, special tokens kept.
async fn detokenize(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    use validation::{FieldError, list_field, require, string_field, validation_error};
    let req = validation::json_object(&body)?;
    let mut errors = require(&req, &["tokens"]);
    let model = string_field(&req, "model").unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let mut ids = Vec::new();
    if let Ok(Some(tokens)) = list_field(&req, "tokens") {
        for (i, t) in tokens.iter().enumerate() {
            match t.as_u64().and_then(|t| u32::try_from(t).ok()) {
                Some(id) => ids.push(id),
                None => errors.push(FieldError::value_error(
                    &format!("tokens.{i}"),
                    "token ids must be non-negative integers the vocabulary holds",
                    t,
                )),
            }
        }
    } else if let Err(e) = list_field(&req, "tokens") {
        errors.push(e);
    }
    if !errors.is_empty() {
        return Err(validation_error(&errors));
    }
    s.resolve_model(model)?;
    let prompt = s.tokenizer.decode_keeping_special(&ids);
    Ok(axum::Json(json!({"prompt": prompt})).into_response())
}

async fn render_chat(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let req: ChatRequest = parse(&body)?;
    s.resolve_model(req.model.as_deref())?;
    let mut tokens = s.chat_prompt(
        &s.chat_messages(&req.messages)?,
        req.add_generation_prompt,
        req.add_special_tokens,
    )?;
    let fault = s.fault.lock().clone();
    if fault.other_chat_template && fault.other_render_template {
        s.write_other_template(&mut tokens)?;
    }
    Ok(axum::Json(json!({"token_ids": tokens, "model": s.model})).into_response())
}

async fn render_completion(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let req: CompletionRequest = parse(&body)?;
    s.resolve_model(req.model.as_deref())?;
    let tokens = s.completion_prompt(&req.prompt, req.add_special_tokens)?;
    Ok(axum::Json(json!({"token_ids": tokens, "model": s.model})).into_response())
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    let card = |id: &str, parent: Option<&str>| {
        json!({"id": id, "object": "model", "created": s.created, "owned_by": "vllm",
               "root": id, "parent": parent, "max_model_len": s.max_model_len})
    };
    let mut data = vec![card(&s.model, None)];
    data.extend(s.loras.iter().map(|l| card(l, Some(&s.model))));
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// Parses a boolean query parameter the way FastAPI/pydantic does.
fn query_bool(
    query: &std::collections::HashMap<String, String>,
    name: &str,
) -> Result<bool, ApiError> {
    match query.get(name).map(|v| v.to_ascii_lowercase()).as_deref() {
        None => Ok(false),
        Some("true" | "1" | "yes" | "on" | "t" | "y") => Ok(true),
        Some("false" | "0" | "no" | "off" | "f" | "n") => Ok(false),
        Some(other) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("{name} must be a boolean, not {other:?}"),
        )),
    }
}

/// vLLM's dev-mode `POST /reset_prefix_cache[?reset_running_requests=true]`:
/// `{"success": bool}`, false while running requests hold blocks.
async fn reset_prefix_cache(
    State(s): State<Arc<Shared>>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> ApiResult {
    let reset_running = query_bool(&query, "reset_running_requests")?;
    let events = s.engine.lock().reset_prefix_cache(reset_running);
    let success = events.is_some();
    if let (Some(p), Some(events)) = (&s.publisher, events) {
        p.publish(unix_now_s(), events);
    }
    s.wake.notify_one();
    Ok(axum::Json(json!({"success": success})).into_response())
}

/// vLLM's `/metrics`: the whole page at `/metrics`, and at `/metrics/` only the samples a
/// `name[]` query names (`vllm_wire::prom::RESTRICTED_METRICS_PATH` says why the two differ).
async fn metrics(State(s): State<Arc<Shared>>, uri: Uri) -> Response {
    if s.fault.lock().garbage_metrics {
        let body = "vllm:num_requests_running{model_name=\"\x01 }} NaNbogus\n# TYPE\n\u{fffd}{{{";
        return ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response();
    }
    let stats = s.engine.lock().stats();
    let hist = s.hist.lock().clone();
    let now = unix_now_s();
    let page = super::metrics::render(
        &s.info,
        &stats,
        &hist,
        s.aborted.load(Ordering::Relaxed),
        now,
    );
    let page = vllm_wire::prom::vllm_metrics_answer(uri.path(), uri.query(), page);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        page,
    )
        .into_response()
}

/// vLLM's `GET /load`: requests inside the server.
async fn load(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(json!({"server_load": s.pending.lock().len()})).into_response()
}

async fn get_fault(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(s.fault.lock().clone()).into_response()
}

async fn set_fault(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let patch: Value = parse(&body)?;
    let current = serde_json::to_value(s.fault.lock().clone()).unwrap_or(Value::Null);
    let (Value::Object(mut merged), Value::Object(patch)) = (current, patch) else {
        return Err(bad_request("fault must be a JSON object"));
    };
    merged.extend(patch);
    let new: FaultState = serde_json::from_value(Value::Object(merged))
        .map_err(|e| bad_request(format!("invalid fault: {e}")))?;
    if !(0.0..=1.0).contains(&new.fail_rate) {
        return Err(bad_request("fail_rate must be in [0, 1]"));
    }
    let mut new = new;
    let losing_changed = new.lose_kv_batch_every != s.fault.lock().lose_kv_batch_every;
    if new.drop_kv_batches > 0 || new.restart_kv_publisher || losing_changed {
        let Some(publisher) = &s.publisher else {
            return Err(bad_request(
                "drop_kv_batches, lose_kv_batch_every and restart_kv_publisher need \
                 --kv-events-endpoint",
            ));
        };
        if losing_changed {
            publisher.lose_every(new.lose_kv_batch_every);
        }
        if new.restart_kv_publisher {
            // A restarted engine starts with an empty cache; its subscribers learn of the
            // restart only from the sequence going back to 0, so no event is published.
            if s.engine.lock().reset_prefix_cache(false).is_none() {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "running requests hold KV blocks; restart when idle".to_string(),
                ));
            }
            publisher.restart();
        }
        if new.drop_kv_batches > 0 {
            publisher.drop_next(new.drop_kv_batches);
        }
        new.drop_kv_batches = 0;
        new.restart_kv_publisher = false;
    }
    {
        let mut engine = s.engine.lock();
        engine.set_prefix_caching(!new.prefix_caching_off);
        engine.set_cache_salt_ignored(new.ignore_cache_salt);
    }
    *s.fault.lock() = new.clone();
    s.hang_tx.send_replace(new.hang);
    Ok(axum::Json(new).into_response())
}

async fn sim_stats(State(s): State<Arc<Shared>>) -> Response {
    let stats = s.engine.lock().stats();
    axum::Json(
        json!({"replica": s.replica, "sim_time_s": s.clock.now(), "engine": stats,
                      "pd": s.pd.stats()}),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `json!` object as the body map the API modules' checks take.
    pub(crate) fn obj(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn the_store_switch_is_read_as_python_reads_it() {
        for (text, want) in [
            ("1", Some(true)),
            (" 0 ", Some(false)),
            ("+2", Some(true)),
            ("1_0", Some(true)),
            ("00", Some(false)),
            ("-0", Some(false)),
            ("yes", None),
            ("", None),
            ("1__0", None),
            ("_1", None),
            ("1.0", None),
        ] {
            assert_eq!(python_int_is_nonzero(text), want, "{text:?}");
        }
    }

    #[test]
    fn content_parts_join_by_newlines_and_media_is_refused() {
        let parts = json!([{"type": "text", "text": "a"}, "b",
                           {"type": "input_text", "text": "c"}, {"type": "text", "text": null},
                           {"type": "refusal", "refusal": "d"}]);
        assert_eq!(flatten_content(&parts), Ok("a\nb\nc\nd".into()));
        let image = json!([{"type": "image_url", "image_url": {"url": "x"}}]);
        assert_eq!(flatten_content(&image), Err(ContentError::Media));
        assert!(matches!(
            flatten_content(&json!([{"type": "mystery"}])),
            Err(ContentError::Invalid(_))
        ));
    }
}
