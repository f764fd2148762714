//! Workloads for fleet-sim: Mooncake-format traces and generators.
//!
//! A workload is a list of [`RequestSpec`]s in arrival order. Prompt token ids are made on
//! demand from compact descriptions (block ids, group ids), so a 10,000-request trace with
//! 40,000-token prompts does not sit in memory all at once. Multi-turn chat turns depend on the
//! previous turn: they arrive a think time after it finished and repeat its prompt and answer.

use std::path::Path;

use scorer_core::protocol::ApiKind;
use serde::Deserialize;
use serde::de::IntoDeserializer as _;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::policy::SplitMix;

/// Token ids start above the specials a tokenizer reserves.
const TOKEN_BASE: u32 = 1000;
const VOCAB: u64 = 120_000;

/// How a request's prompt tokens are made.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// Mooncake: chained 512-token blocks named by id, truncated to `input_length`.
    Blocks {
        /// Block ids, each standing for `block_tokens` deterministic tokens.
        ids: Vec<u64>,
        /// Tokens a block id stands for (512 in Mooncake traces).
        block_tokens: u32,
        /// Total prompt tokens (the last block may be partial).
        input_length: u32,
    },
    /// Concatenated segments, each `(stream id, length)`: a shared system prompt, a question.
    Segments(Vec<(u64, u32)>),
    /// A later chat turn: the previous turn's full prompt and answer, then a new user message.
    Continue {
        /// The request whose prompt and output this turn repeats.
        previous: usize,
        /// New user tokens `(stream id, length)`.
        user: (u64, u32),
    },
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// Arrival time in ms (for dependent turns: think time after the previous turn finished).
    pub arrival_ms: f64,
    /// How to make its prompt.
    pub prompt: PromptSource,
    /// Output tokens the answer really has (where the model would stop): the engine generates
    /// this many (cut at the client's cap); no router sees it.
    pub output_tokens: u32,
    /// Conversation id for multi-turn workloads (session affinity, analysis).
    pub session: Option<u64>,
}

/// A named workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Name for tables and plots.
    pub name: String,
    /// Requests; dependent turns come after the turn they depend on.
    pub requests: Vec<RequestSpec>,
    /// Which prefix of each prompt the client marks with Anthropic `cache_control`: what the
    /// router is told will be sent again.
    pub cache_control: Marking,
    /// The API the client speaks, which a real request carries in its path: kvroute scores
    /// the agent APIs to the last token (`scoring.agent_decode_weight`); the peers ignore it.
    pub api: ApiKind,
}

/// Which prefix of each prompt a workload's client marks with `cache_control`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Marking {
    /// No markers (OpenAI clients, the traces).
    #[default]
    None,
    /// The whole prompt, as Claude Code marks its newest block on every turn.
    WholePrompt,
    /// The first this many tokens, such as a shared tool prompt marked and the conversation not.
    Leading(u32),
}

impl Marking {
    /// Marked tokens of a prompt of `prompt_tokens` tokens.
    pub fn marked_tokens(self, prompt_tokens: usize) -> u32 {
        let prompt = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        match self {
            Marking::None => 0,
            Marking::WholePrompt => prompt,
            Marking::Leading(n) => n.min(prompt),
        }
    }
}

/// A kind of text, by how many bytes of UTF-8 a tokenizer spends on one of its tokens.
///
/// A stream (a system prompt, a document, a user message, an answer) is one style, and draws
/// its token ids from its style's quarter of the vocabulary, so a token id says what it spells
/// ([`token_text`]). Only a router that reads text (kvroute's approximate filter, through
/// `--text-styles`) sees the difference; engines and token-reading routers see the same ids.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextStyle {
    /// Name in docs.
    pub name: &'static str,
    /// Mean UTF-8 bytes a token of this style spells.
    pub bytes_per_token: f64,
}

/// The styles, one per quarter of the vocabulary. The ratios are assumptions of the order
/// reported for Llama-3-class BPE vocabularies: English prose about 4.5 bytes a token, source
/// code about 3.2, structured text (JSON, tables, logs, numbers) about 2.7, Cyrillic in UTF-8
/// (two bytes a letter) about 5.6. Their mean is 4.0, the router's default `bytes_per_token`,
/// so the styled model is right on average and wrong for every single document, as real
/// traffic is. The one real vocabulary measured here (`scripts/bytes-per-token.py`: the BPE
/// file PyPI's `anthropic` 0.7.0 ships) spreads less: 3.9 for English, 3.2 German, 3.6
/// Russian, 3.6 Rust, 3.2 JSON, 2.3 a numbers-heavy trace. So the styles are a stress, wider
/// than that vocabulary, not a calibration.
pub const TEXT_STYLES: [TextStyle; 4] = [
    TextStyle {
        name: "prose",
        bytes_per_token: 4.5,
    },
    TextStyle {
        name: "code",
        bytes_per_token: 3.2,
    },
    TextStyle {
        name: "structured",
        bytes_per_token: 2.7,
    },
    TextStyle {
        name: "cyrillic",
        bytes_per_token: 5.6,
    },
];

/// Token ids of one style's band of the vocabulary.
const STYLE_BAND: u64 = VOCAB / TEXT_STYLES.len() as u64;

/// Appends the UTF-8 bytes token `id` spells under the styled text model: 1 to 8 bytes whose
/// mean over the style's band is the style's `bytes_per_token`, the same bytes every time.
pub fn token_text(id: u32, out: &mut Vec<u8>) {
    let band = u64::from(id.saturating_sub(TOKEN_BASE)) / STYLE_BAND;
    let style = TEXT_STYLES[(band as usize).min(TEXT_STYLES.len() - 1)];
    let h = xxh3_64_with_seed(&id.to_le_bytes(), 0x7E47);
    let unit = |bits: u64| (bits & 0xFFFF_FFFF) as f64 / 4_294_967_296.0;
    // floor(x + U[0,1)) has mean x: lengths spread 3 bytes around the style's mean.
    let spread = style.bytes_per_token - 1.5 + 3.0 * unit(h) + unit(h >> 32);
    let len = (spread.floor() as usize).clamp(1, 8);
    out.extend_from_slice(&h.to_le_bytes()[..len]);
}

/// Appends the text `tokens` spell under the styled text model ([`token_text`]) to `out`.
pub fn spell(tokens: &[u32], out: &mut Vec<u8>) {
    out.reserve(tokens.len() * 4);
    for &t in tokens {
        token_text(t, out);
    }
}

/// The text `tokens` spell under the styled text model ([`spell`]).
pub fn text_of(tokens: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    spell(tokens, &mut out);
    out
}

/// Appends `len` deterministic tokens of `stream` to `out`, from the band of the stream's
/// style (drawn once per stream).
pub fn push_stream(out: &mut Vec<u32>, stream: u64, len: u32) {
    let band = xxh3_64_with_seed(b"style", stream) % TEXT_STYLES.len() as u64 * STYLE_BAND;
    out.extend((0..len).map(|i| {
        TOKEN_BASE + (band + xxh3_64_with_seed(&i.to_le_bytes(), stream) % STYLE_BAND) as u32
    }));
}

/// Output tokens a request generates: deterministic per request index, so a later turn can
/// repeat them and the engine caches the same ids it generated.
pub fn output_tokens(request: usize, len: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(len as usize);
    push_stream(&mut out, 0x0u64.wrapping_sub(1) ^ request as u64, len);
    out
}

impl Workload {
    /// Prompt tokens of request `i` (recursively expanding chat continuations).
    pub fn prompt_tokens(&self, i: usize) -> Vec<u32> {
        let spec = &self.requests[i];
        match &spec.prompt {
            PromptSource::Blocks {
                ids,
                block_tokens,
                input_length,
            } => {
                let mut out = Vec::with_capacity(*input_length as usize);
                for id in ids {
                    let left = input_length.saturating_sub(out.len() as u32);
                    if left == 0 {
                        break;
                    }
                    push_stream(
                        &mut out,
                        0xB10C_0000_0000_0000 ^ id,
                        (*block_tokens).min(left),
                    );
                }
                // Traces whose input outgrows their block list get deterministic filler.
                let left = input_length.saturating_sub(out.len() as u32);
                push_stream(&mut out, 0xF111_0000_0000_0000 ^ i as u64, left);
                out
            }
            PromptSource::Segments(segments) => {
                let mut out = Vec::new();
                for (stream, len) in segments {
                    push_stream(&mut out, *stream, *len);
                }
                out
            }
            PromptSource::Continue { previous, user } => {
                let mut out = self.prompt_tokens(*previous);
                out.extend(output_tokens(
                    *previous,
                    self.requests[*previous].output_tokens,
                ));
                push_stream(&mut out, user.0, user.1);
                out
            }
        }
    }

    /// Prompt length of request `i` without materialising tokens.
    pub fn prompt_len(&self, i: usize) -> u32 {
        match &self.requests[i].prompt {
            PromptSource::Blocks { input_length, .. } => *input_length,
            PromptSource::Segments(s) => s.iter().map(|(_, l)| l).sum(),
            PromptSource::Continue { previous, user } => {
                self.prompt_len(*previous) + self.requests[*previous].output_tokens + user.1
            }
        }
    }

    /// The request `i` depends on (a chat turn's previous turn), if any.
    pub fn depends_on(&self, i: usize) -> Option<usize> {
        match self.requests[i].prompt {
            PromptSource::Continue { previous, .. } => Some(previous),
            _ => None,
        }
    }

    /// The request `i` forks from, when it continues a request of another session (an
    /// `agentic` subagent's first turn).
    pub fn fork_parent(&self, i: usize) -> Option<usize> {
        let parent = self.depends_on(i)?;
        (self.requests[parent].session != self.requests[i].session).then_some(parent)
    }

    /// Compresses arrival times by `factor` (2.0 = twice the load).
    pub fn speed_up(&mut self, factor: f64) {
        if factor > 0.0 {
            for r in &mut self.requests {
                r.arrival_ms /= factor;
            }
        }
    }

    /// The workload of the trace file at `path` (this crate's Mooncake reader, `kvroute-analyze`'s
    /// OpenAI reader): `requests` in arrival order, named after the file's stem (`name` when it
    /// has none).
    pub fn from_trace(path: &Path, name: String, mut requests: Vec<RequestSpec>) -> Self {
        requests.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or(name);
        Workload {
            cache_control: Marking::None,
            api: ApiKind::Chat,
            name: stem,
            requests,
        }
    }

    /// Keeps the first `n` requests (dependencies always precede their dependents).
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
    }
}

/// Errors reading a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A trace line is not a Mooncake record.
    #[error("{path}:{line}: {message}")]
    BadLine {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A generator spec could not be parsed.
    #[error(
        "bad workload spec {0:?}: expected a .jsonl trace or one of shared-prefix, multi-turn, long-doc, no-sharing, agentic (options as name:key=value,...)"
    )]
    BadSpec(String),
}

#[derive(Deserialize)]
struct MooncakeRecord {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Reads a line-oriented trace file whole: the one place its I/O error is worded, for the
/// Mooncake reader here and `kvroute-analyze`'s readers.
pub fn read_trace(path: &Path) -> Result<String, WorkloadError> {
    std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Reads a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
/// `hash_ids` of chained 512-token blocks).
pub fn read_mooncake(path: &Path) -> Result<Workload, WorkloadError> {
    let name = path.display().to_string();
    let text = read_trace(path)?;
    let mut requests = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: MooncakeRecord = serde_json::from_str(line).map_err(|e| WorkloadError::BadLine {
            path: name.clone(),
            line: n + 1,
            message: e.to_string(),
        })?;
        if !r.timestamp.is_finite() || r.timestamp < 0.0 {
            return Err(WorkloadError::BadLine {
                path: name,
                line: n + 1,
                message: "timestamp must be >= 0".into(),
            });
        }
        requests.push(RequestSpec {
            arrival_ms: r.timestamp,
            prompt: PromptSource::Blocks {
                ids: r.hash_ids,
                block_tokens: 512,
                input_length: r.input_length.max(1),
            },
            output_tokens: r.output_length.max(1),
            session: None,
        });
    }
    Ok(Workload::from_trace(path, name, requests))
}

/// The workload generators' draws (and `kvroute-analyze`'s arrival clock) on the crate's one
/// splitmix64 generator, [`SplitMix`], so runs are deterministic and need no RNG crate state.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix);
impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[0, 1)`, from the top 53 bits of a draw.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Exponential inter-arrival gap with mean `mean_ms`.
    pub fn exp_ms(&mut self, mean_ms: f64) -> f64 {
        -mean_ms * (1.0 - self.unit()).ln()
    }
}

/// A generator's `key=value` options.
struct GenOptions(Vec<(String, String)>);

impl GenOptions {
    /// The API the spec names (`api=chat|completion|messages|responses`), else `default`.
    fn api(&self, default: ApiKind) -> Result<ApiKind, WorkloadError> {
        let Some((_, v)) = self.0.iter().find(|(k, _)| k == "api") else {
            return Ok(default);
        };
        // The names are the wire's (`ApiKind`'s serde form).
        ApiKind::deserialize(v.as_str().into_deserializer()).map_err(
            |_: serde::de::value::Error| {
                WorkloadError::BadSpec(format!("api={v} (chat, completion, messages, responses)"))
            },
        )
    }

    /// The values of `keys` in order, each its default unless the spec sets it.
    fn values<const N: usize>(&self, keys: [(&str, f64); N]) -> Result<[f64; N], WorkloadError> {
        let mut out = [0.0; N];
        for (slot, (key, default)) in out.iter_mut().zip(keys) {
            *slot = match self.0.iter().find(|(k, _)| k == key) {
                Some((_, v)) => v
                    .parse()
                    .map_err(|_| WorkloadError::BadSpec(format!("{key}={v}")))?,
                None => default,
            };
        }
        Ok(out)
    }
}

/// Splits a generator spec `name:key=value,...` into its name and options.
fn parse_spec(spec: &str) -> Result<(&str, GenOptions), WorkloadError> {
    let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
    let options = rest
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| WorkloadError::BadSpec(spec.into()))
        })
        .collect::<Result<_, _>>()?;
    Ok((name, GenOptions(options)))
}

/// The `max_tokens` a realistic client of each workload sends (a cap at or above what it gets
/// back), `None` where clients send none: chat UIs and the Mooncake trace's API callers mostly
/// omit it, while templated batch jobs, RAG services and agent frameworks set one. A spec's
/// `max_tokens=N` overrides it (`max_tokens=0`: none).
pub fn client_max_tokens(spec: &str) -> Result<Option<u32>, WorkloadError> {
    if spec.ends_with(".jsonl") {
        return Ok(None);
    }
    let (name, options) = parse_spec(spec)?;
    let default = match name {
        "shared-prefix" => 2048.0,
        "long-doc" => 1024.0,
        "agentic" => 4096.0,
        "multi-turn" | "no-sharing" => 0.0,
        _ => return Err(WorkloadError::BadSpec(spec.into())),
    };
    let [cap] = options.values([("max_tokens", default)])?;
    Ok((cap >= 1.0).then_some(cap as u32))
}

/// Poisson arrival times: a running clock whose gaps have mean `1000 / rps` ms.
struct Arrivals {
    t: f64,
    mean_ms: f64,
}

impl Arrivals {
    fn new(rps: f64) -> Self {
        Self {
            t: 0.0,
            mean_ms: 1000.0 / rps,
        }
    }
    fn next(&mut self, rng: &mut Rng) -> f64 {
        self.t += rng.exp_ms(self.mean_ms);
        self.t
    }
}

/// Builds a workload from a spec: a path to a `.jsonl` Mooncake trace, or a generator name with
/// options, e.g. `shared-prefix:groups=150,prompts=5,system=6000,question=1200,output=1000,rps=4`.
/// Every generator also takes `max_tokens` (see [`client_max_tokens`]; routers see only that).
pub fn from_spec(spec: &str, seed: u64) -> Result<Workload, WorkloadError> {
    if spec.ends_with(".jsonl") {
        return read_mooncake(Path::new(spec));
    }
    let (name, options) = parse_spec(spec)?;
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut requests = Vec::new();
    match name {
        "shared-prefix" => {
            // llm-d's benchmark shape: groups share a long system prompt, each prompt adds a question.
            let [groups, prompts, system, question, output, rps] = options.values([
                ("groups", 150.0),
                ("prompts", 5.0),
                ("system", 6000.0),
                ("question", 1200.0),
                ("output", 1000.0),
                ("rps", 4.0),
            ])?;
            let (groups, prompts) = (groups as u64, prompts as u64);
            let mut clock = Arrivals::new(rps);
            let mut order: Vec<(u64, u64)> = (0..groups)
                .flat_map(|g| (0..prompts).map(move |p| (g, p)))
                .collect();
            for i in (1..order.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
            for (g, p) in order {
                requests.push(RequestSpec {
                    arrival_ms: clock.next(&mut rng),
                    prompt: PromptSource::Segments(vec![
                        (0x5157_0000 ^ g, system as u32),
                        ((g << 20) ^ p ^ 0x9000_0000, question as u32),
                    ]),
                    output_tokens: output as u32,
                    session: Some(g),
                });
            }
        }
        "multi-turn" => {
            let [conversations, turns, system, user, output, rps, think_ms] = options.values([
                ("conversations", 64.0),
                ("turns", 6.0),
                ("system", 2000.0),
                ("user", 200.0),
                ("output", 150.0),
                ("rps", 2.0),
                ("think_ms", 2000.0),
            ])?;
            let (user, output) = (user as u32, output as u32);
            let mut clock = Arrivals::new(rps);
            for c in 0..conversations as u64 {
                let first = requests.len();
                requests.push(RequestSpec {
                    arrival_ms: clock.next(&mut rng),
                    prompt: PromptSource::Segments(vec![
                        (0x5157_0000, system as u32),
                        (0xC0_0000_0000 ^ (c << 8), user),
                    ]),
                    output_tokens: output,
                    session: Some(c),
                });
                let mut previous = first;
                for turn in 1..turns as u32 {
                    requests.push(RequestSpec {
                        arrival_ms: think_ms * (0.5 + rng.unit()),
                        prompt: PromptSource::Continue {
                            previous,
                            user: (0xC0_0000_0000 ^ (c << 8) ^ u64::from(turn), user),
                        },
                        output_tokens: output,
                        session: Some(c),
                    });
                    previous = requests.len() - 1;
                }
            }
        }
        "long-doc" => {
            // A few long documents asked many short questions, mixed with short chats.
            let [requests_n, docs, doc, short, output, share, rps] = options.values([
                ("requests", 400.0),
                ("docs", 8.0),
                ("doc", 50_000.0),
                ("short", 40.0),
                ("output", 100.0),
                ("doc_share", 0.5),
                ("rps", 2.0),
            ])?;
            let (docs, short) = (docs as u64, short as u32);
            let mut clock = Arrivals::new(rps);
            for i in 0..requests_n as u64 {
                let arrival_ms = clock.next(&mut rng);
                let segments = if rng.unit() < share {
                    vec![
                        (0xD0C0_0000 ^ (rng.next() % docs), doc as u32),
                        (0xA5C0_0000_0000 ^ i, short),
                    ]
                } else {
                    vec![(0x5407_0000_0000 ^ i, short)]
                };
                requests.push(RequestSpec {
                    arrival_ms,
                    prompt: PromptSource::Segments(segments),
                    output_tokens: output as u32,
                    session: None,
                });
            }
        }
        "no-sharing" => {
            let [requests_n, input, output, rps] = options.values([
                ("requests", 1000.0),
                ("input", 2000.0),
                ("output", 200.0),
                ("rps", 4.0),
            ])?;
            let mut clock = Arrivals::new(rps);
            for i in 0..requests_n as u64 {
                requests.push(RequestSpec {
                    arrival_ms: clock.next(&mut rng),
                    prompt: PromptSource::Segments(vec![(0x0005_0000_0000 ^ i, input as u32)]),
                    output_tokens: output as u32,
                    session: None,
                });
            }
        }
        "agentic" => agentic(&options, &mut rng, &mut requests)?,
        _ => return Err(WorkloadError::BadSpec(spec.into())),
    }
    // `cache_control=1` (any generator): every prompt is marked, as an Anthropic client that
    // puts a breakpoint on its newest block sends it; with `marked_tokens=N`, only its first
    // N tokens.
    let [cache_control, marked] =
        options.values([("cache_control", 0.0), ("marked_tokens", 0.0)])?;
    let cache_control = match (cache_control >= 1.0, marked >= 1.0) {
        (false, _) => Marking::None,
        (true, false) => Marking::WholePrompt,
        (true, true) => Marking::Leading(marked as u32),
    };
    // The agentic loop is a coding agent's (Claude Code's shape: a tool prompt, a growing
    // tool loop, subagents forked off it), so it speaks Anthropic Messages unless told
    // otherwise; the others are chat clients.
    let api = options.api(if name == "agentic" {
        ApiKind::Messages
    } else {
        ApiKind::Chat
    })?;
    Ok(Workload {
        cache_control,
        api,
        name: name.to_string(),
        requests,
    })
}

/// The agentic generator: `agents` sessions start as a Poisson stream (`rps`). Each is a
/// tool-call loop of `steps` turns: the first prompt is a tool-definition system prompt every
/// agent shares (`system`) plus its task (`task`); each later turn repeats the whole context,
/// the model's tool call, and the tool's result (`tool` tokens), after the tool's latency
/// (`tool_ms`, uniform 0.5x-1.5x). Every `fork_every` steps the agent forks `fanout` subagents
/// that share its context up to that turn, add their own instruction (`sub_task`) and run
/// `sub_steps` tool-call turns of their own. Outputs are tool calls (`call` tokens, 0.5x-1.5x),
/// the last turn of each loop an answer (`answer`). The parent does not wait for its subagents
/// (it continues its loop in parallel): their shared prefix is what routing is tested on.
fn agentic(
    options: &GenOptions,
    rng: &mut Rng,
    requests: &mut Vec<RequestSpec>,
) -> Result<(), WorkloadError> {
    let [
        agents,
        steps,
        system,
        task,
        tool,
        call,
        answer,
        tool_ms,
        fork_every,
        fanout,
    ] = options.values([
        ("agents", 24.0),
        ("steps", 10.0),
        ("system", 4000.0),
        ("task", 300.0),
        ("tool", 500.0),
        ("call", 100.0),
        ("answer", 400.0),
        ("tool_ms", 300.0),
        ("fork_every", 4.0),
        ("fanout", 3.0),
    ])?;
    let [sub_steps, sub_task, rps] =
        options.values([("sub_steps", 3.0), ("sub_task", 200.0), ("rps", 0.5)])?;
    let (steps, sub_steps) = (steps.max(1.0) as u32, sub_steps.max(1.0) as u32);
    let fork_every = fork_every.max(1.0) as u32;
    let mut clock = Arrivals::new(rps);
    let spread = |rng: &mut Rng, mean: f64| ((mean * (0.5 + rng.unit())).round() as u32).max(1);
    // One loop of `turns` turns whose first prompt is `first`; returns the turns' indices.
    let push_loop = |requests: &mut Vec<RequestSpec>,
                     rng: &mut Rng,
                     session: u64,
                     first: PromptSource,
                     first_arrival: f64,
                     turns: u32,
                     tool_stream: u64|
     -> Vec<usize> {
        let mut ids = Vec::with_capacity(turns as usize);
        for turn in 0..turns {
            let last = turn + 1 == turns;
            let output = if last {
                spread(rng, answer)
            } else {
                spread(rng, call)
            };
            let (arrival_ms, prompt) = match ids.last() {
                None => (first_arrival, first.clone()),
                Some(&previous) => {
                    let result = (tool_stream ^ u64::from(turn), spread(rng, tool));
                    (
                        tool_ms * (0.5 + rng.unit()),
                        PromptSource::Continue {
                            previous,
                            user: result,
                        },
                    )
                }
            };
            requests.push(RequestSpec {
                arrival_ms,
                prompt,
                output_tokens: output,
                session: Some(session),
            });
            ids.push(requests.len() - 1);
        }
        ids
    };
    for a in 0..agents as u64 {
        let session = a << 8;
        let first = PromptSource::Segments(vec![
            (0xA6E7_0000, system as u32),
            (0xA6E7_0000_0000 ^ (a << 16), task as u32),
        ]);
        let arrival = clock.next(rng);
        let main = push_loop(
            requests,
            rng,
            session,
            first,
            arrival,
            steps,
            0xA6E7_1000_0000 ^ (a << 16),
        );
        for (k, &at) in main.iter().enumerate() {
            if !(k as u32 + 1).is_multiple_of(fork_every) || k + 1 == main.len() {
                continue;
            }
            for s in 0..fanout as u64 {
                let sub = session | (k as u64 * fanout as u64 + s + 1).min(255);
                let stream = 0xA6E7_2000_0000 ^ (a << 16) ^ (k as u64) << 8 ^ s;
                let first = PromptSource::Continue {
                    previous: at,
                    user: (stream, sub_task as u32),
                };
                let delay = tool_ms * (0.5 + rng.unit());
                push_loop(requests, rng, sub, first, delay, sub_steps, stream << 4);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agentic_loop_speaks_messages_and_any_generator_takes_an_api() {
        let agent = "agentic:agents=1,steps=2,system=40,task=5,tool=5,call=3,answer=3";
        assert_eq!(from_spec(agent, 1).unwrap().api, ApiKind::Messages);
        assert_eq!(from_spec("multi-turn", 1).unwrap().api, ApiKind::Chat);
        let responses = from_spec(&format!("{agent},api=responses"), 1).unwrap();
        assert_eq!(responses.api, ApiKind::Responses);
        let chat = from_spec("shared-prefix:api=completion", 1).unwrap();
        assert_eq!(chat.api, ApiKind::Completion);
        let err = from_spec("multi-turn:api=grpc", 1).unwrap_err().to_string();
        assert!(err.contains("api=grpc"), "{err}");
    }

    #[test]
    fn cache_control_marks_a_generators_prompts_only_when_asked() {
        let spec = "agentic:agents=1,steps=2,system=40,task=5,tool=5,call=3,answer=3";
        let plain = from_spec(spec, 1).unwrap();
        let marked = from_spec(&format!("{spec},cache_control=1"), 1).unwrap();
        assert_eq!(plain.cache_control, Marking::None);
        assert_eq!(marked.cache_control, Marking::WholePrompt);
        let system = from_spec(&format!("{spec},cache_control=1,marked_tokens=40"), 1).unwrap();
        assert_eq!(system.cache_control, Marking::Leading(40));
        assert_eq!(system.cache_control.marked_tokens(30), 30);
        assert_eq!(marked.cache_control.marked_tokens(30), 30);
        assert_eq!(plain.cache_control.marked_tokens(30), 0);
        // The same requests either way: only what the client tells the router differs.
        assert_eq!(plain.requests, marked.requests);
        assert_eq!(plain.requests, system.requests);
    }

    #[test]
    fn a_stream_spells_its_styles_bytes_per_token_on_average() {
        for stream in 0..64u64 {
            let mut tokens = Vec::new();
            push_stream(&mut tokens, stream, 4_000);
            // One band, so one style, for the whole stream.
            let band = |t: &u32| u64::from(t - TOKEN_BASE) / STYLE_BAND;
            assert!(tokens.iter().all(|t| band(t) == band(&tokens[0])));
            let style = TEXT_STYLES[band(&tokens[0]) as usize];
            let text = text_of(&tokens);
            let ratio = text.len() as f64 / tokens.len() as f64;
            assert!(
                (ratio - style.bytes_per_token).abs() < 0.1,
                "{}: {ratio}",
                style.name
            );
            // The same tokens spell the same text.
            assert_eq!(text, text_of(&tokens));
        }
        let mean = TEXT_STYLES.iter().map(|s| s.bytes_per_token).sum::<f64>() / 4.0;
        assert!((mean - crate::policy::DEFAULT_TEXT_BYTES_PER_TOKEN).abs() < 1e-9);
        for id in [0, TOKEN_BASE, TOKEN_BASE + 119_999, u32::MAX] {
            let mut out = Vec::new();
            token_text(id, &mut out);
            assert!((1..=8).contains(&out.len()), "{id}");
        }
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let w = from_spec(
            "shared-prefix:groups=3,prompts=2,system=100,question=10,output=5",
            1,
        )
        .unwrap();
        assert_eq!(w.requests.len(), 6);
        let g0: Vec<usize> = (0..6)
            .filter(|&i| w.requests[i].session == Some(0))
            .collect();
        let (a, b) = (w.prompt_tokens(g0[0]), w.prompt_tokens(g0[1]));
        assert_eq!(a[..100], b[..100]);
        assert_ne!(a[100..], b[100..]);
        assert_eq!(w.prompt_len(g0[0]), 110);
    }

    #[test]
    fn chat_turns_repeat_previous_prompt_and_answer() {
        let w = from_spec(
            "multi-turn:conversations=2,turns=3,system=50,user=10,output=7",
            1,
        )
        .unwrap();
        assert_eq!(w.requests.len(), 6);
        let t0 = w.prompt_tokens(0);
        let t1 = w.prompt_tokens(1);
        assert!(t1.starts_with(&t0));
        assert_eq!(t1[t0.len()..t0.len() + 7], output_tokens(0, 7)[..]);
        assert_eq!(w.depends_on(1), Some(0));
        assert_eq!(w.prompt_len(2), t1.len() as u32 + 7 + 10);
    }

    #[test]
    fn mooncake_blocks_share_by_id() {
        let dir = std::env::temp_dir().join(format!("kvroute-mc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        std::fs::write(&path, "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 3, \"hash_ids\": [1]}\n").unwrap();
        let w = read_mooncake(&path).unwrap();
        assert_eq!(w.requests[0].arrival_ms, 0.0);
        let (a, b) = (w.prompt_tokens(0), w.prompt_tokens(1));
        assert_eq!(a.len(), 512);
        assert_eq!(b.len(), 600);
        assert_eq!(a[..], b[..512]);
        std::fs::write(&path, "{\"timestamp\": \"x\"}\n").unwrap();
        assert!(matches!(
            read_mooncake(&path),
            Err(WorkloadError::BadLine { line: 1, .. })
        ));
    }

    #[test]
    fn bad_specs_are_errors() {
        assert!(from_spec("nope", 1).is_err());
        assert!(from_spec("shared-prefix:groups", 1).is_err());
        assert!(from_spec("shared-prefix:groups=x", 1).is_err());
    }
}
