//! Workloads for fleet-sim: Mooncake-format traces and generators.
//!
//! A workload is a list of [`RequestSpec`]s in arrival order. Prompt token ids are made on
//! demand from compact descriptions (block ids, group ids), so a 10,000-request trace with
//! 40,000-token prompts does not sit in memory all at once. Multi-turn chat turns depend on the
//! previous turn: they arrive a think time after it finished and repeat its prompt and answer.

use std::path::Path;

use serde::Deserialize;
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
    /// Output tokens to generate.
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
}

/// Deterministic token `i` of stream `stream`.
fn token(stream: u64, i: u32) -> u32 {
    TOKEN_BASE + (xxh3_64_with_seed(&i.to_le_bytes(), stream) % VOCAB) as u32
}

/// Appends `len` tokens of `stream` to `out`.
pub fn push_stream(out: &mut Vec<u32>, stream: u64, len: u32) {
    out.extend((0..len).map(|i| token(stream, i)));
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
        "bad workload spec {0:?}: expected a .jsonl trace or one of shared-prefix, multi-turn, long-doc, no-sharing (options as name:key=value,...)"
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

fn opt(options: &[(String, String)], key: &str, default: f64) -> Result<f64, WorkloadError> {
    match options.iter().find(|(k, _)| k == key) {
        Some((_, v)) => v
            .parse()
            .map_err(|_| WorkloadError::BadSpec(format!("{key}={v}"))),
        None => Ok(default),
    }
}

/// Builds a workload from a spec: a path to a `.jsonl` Mooncake trace, or a generator name with
/// options, e.g. `shared-prefix:groups=150,prompts=5,system=6000,question=1200,output=1000,rps=4`.
pub fn from_spec(spec: &str, seed: u64) -> Result<Workload, WorkloadError> {
    if spec.ends_with(".jsonl") {
        return read_mooncake(Path::new(spec));
    }
    let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
    let options: Vec<(String, String)> = rest
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| WorkloadError::BadSpec(spec.into()))
        })
        .collect::<Result<_, _>>()?;
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut requests = Vec::new();
    match name {
        "shared-prefix" => {
            // llm-d's benchmark shape: groups share a long system prompt, each prompt adds a question.
            let groups = opt(&options, "groups", 150.0)? as u64;
            let prompts = opt(&options, "prompts", 5.0)? as u64;
            let system = opt(&options, "system", 6000.0)? as u32;
            let question = opt(&options, "question", 1200.0)? as u32;
            let output = opt(&options, "output", 1000.0)? as u32;
            let rps = opt(&options, "rps", 4.0)?;
            let mut t = 0.0;
            let mut order: Vec<(u64, u64)> = (0..groups)
                .flat_map(|g| (0..prompts).map(move |p| (g, p)))
                .collect();
            for i in (1..order.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
            for (g, p) in order {
                t += rng.exp_ms(1000.0 / rps);
                requests.push(RequestSpec {
                    arrival_ms: t,
                    prompt: PromptSource::Segments(vec![
                        (0x5157_0000 ^ g, system),
                        ((g << 20) ^ p ^ 0x9000_0000, question),
                    ]),
                    output_tokens: output,
                    session: Some(g),
                });
            }
        }
        "multi-turn" => {
            let conversations = opt(&options, "conversations", 64.0)? as u64;
            let turns = opt(&options, "turns", 6.0)? as u32;
            let system = opt(&options, "system", 2000.0)? as u32;
            let user = opt(&options, "user", 200.0)? as u32;
            let output = opt(&options, "output", 150.0)? as u32;
            let rps = opt(&options, "rps", 2.0)?;
            let think_ms = opt(&options, "think_ms", 2000.0)?;
            let mut t = 0.0;
            for c in 0..conversations {
                t += rng.exp_ms(1000.0 / rps);
                let first = requests.len();
                requests.push(RequestSpec {
                    arrival_ms: t,
                    prompt: PromptSource::Segments(vec![
                        (0x5157_0000, system),
                        (0xC0_0000_0000 ^ (c << 8), user),
                    ]),
                    output_tokens: output,
                    session: Some(c),
                });
                let mut previous = first;
                for turn in 1..turns {
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
            let requests_n = opt(&options, "requests", 400.0)? as u64;
            let docs = opt(&options, "docs", 8.0)? as u64;
            let doc = opt(&options, "doc", 50_000.0)? as u32;
            let short = opt(&options, "short", 40.0)? as u32;
            let output = opt(&options, "output", 100.0)? as u32;
            let share = opt(&options, "doc_share", 0.5)?;
            let rps = opt(&options, "rps", 2.0)?;
            let mut t = 0.0;
            for i in 0..requests_n {
                t += rng.exp_ms(1000.0 / rps);
                let segments = if rng.unit() < share {
                    vec![
                        (0xD0C0_0000 ^ (rng.next() % docs), doc),
                        (0xA5C0_0000_0000 ^ i, short),
                    ]
                } else {
                    vec![(0x5407_0000_0000 ^ i, short)]
                };
                requests.push(RequestSpec {
                    arrival_ms: t,
                    prompt: PromptSource::Segments(segments),
                    output_tokens: output,
                    session: None,
                });
            }
        }
        "no-sharing" => {
            let requests_n = opt(&options, "requests", 1000.0)? as u64;
            let input = opt(&options, "input", 2000.0)? as u32;
            let output = opt(&options, "output", 200.0)? as u32;
            let rps = opt(&options, "rps", 4.0)?;
            let mut t = 0.0;
            for i in 0..requests_n {
                t += rng.exp_ms(1000.0 / rps);
                requests.push(RequestSpec {
                    arrival_ms: t,
                    prompt: PromptSource::Segments(vec![(0x0005_0000_0000 ^ i, input)]),
                    output_tokens: output,
                    session: None,
                });
            }
        }
        _ => return Err(WorkloadError::BadSpec(spec.into())),
    }
    Ok(Workload {
        name: name.to_string(),
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
