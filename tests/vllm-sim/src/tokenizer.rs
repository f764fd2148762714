//! Tokenizers and chat templates: how a request's text becomes the token ids the engine caches.
//!
//! vLLM renders a chat request through the model's chat template (Jinja, with
//! `add_generation_prompt`), tokenises the text without adding special tokens, and tokenises a
//! completion prompt *with* them (the post-processor's BOS). Prefix caching across chat turns
//! then depends on one property: turn N's prompt tokens are a prefix of turn N+1's. Both
//! implementations here keep it:
//!
//! - [`HfTokenizer`] loads a real Hugging Face `tokenizer.json` with the `tokenizers` crate, and
//!   [`JinjaTemplate`] renders a chat template like transformers' `apply_chat_template`
//!   (`vllm_wire::chat_template`, shared with the control plane);
//! - [`WordTokenizer`] and [`ChatMl`] are the fast built-in fallback: no model files, and
//!   enough for routing experiments.
//!
//! [`WordTokenizer`] pre-tokenises like byte-level BPE does at word granularity: a special token
//! (`<|im_start|>`, ...) is one token; a word together with one leading space is one token; any
//! other whitespace character is a token of its own. The id is `xxh3(piece) % vocab + offset`.
//!
//! Generated ids come from [`Tokenizer::output_vocab`]: whole words whose decoded text
//! re-tokenises to the same ids, so turn N+1 of a chat reuses the KV of turn N's answer, as it
//! does with a real model whose answer re-tokenises the same way.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::SimError;

/// Turns text into token ids and generated ids back into text.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`; `add_special_tokens` runs the tokenizer's post-processor (a BOS for
    /// most models), as vLLM does for completion prompts but not for rendered chat prompts.
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, SimError>;
    /// Text of `ids`, special tokens skipped (vLLM's default for outputs).
    fn decode(&self, ids: &[u32]) -> String;
    /// Text of `ids` with special tokens kept: `tokenizer.decode(ids)` with transformers'
    /// defaults, as vLLM's `/detokenize` decodes (`renderers/base.py::_detokenize_prompt`).
    fn decode_keeping_special(&self, ids: &[u32]) -> String {
        self.decode(ids)
    }
    /// The vocabulary string of one id (`/tokenize`'s `token_strs`).
    fn token_str(&self, id: u32) -> String {
        self.decode(&[id])
    }
    /// Ids the engine may generate; re-encoding their decoded text gives the same ids.
    fn output_vocab(&self) -> Vec<u32>;
}

/// Renders chat messages into the prompt text the model sees.
pub trait ChatTemplate: Send + Sync {
    /// The prompt text; with `add_generation_prompt` it ends with the assistant turn header.
    /// Fails (an HTTP 400) when the template rejects the conversation.
    fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, SimError>;
}

/// One chat message with its text content already flattened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// Streams generated text the way vLLM's detokenizer does: decode a short window of ids and
/// emit only the new suffix, so tokenizers whose decoding depends on neighbours (WordPiece
/// joins words with spaces, byte-level BPE may split a character) stream the same text a full
/// decode gives.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Adds one generated id; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &dyn Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset]);
        let after = tokenizer.decode(&self.ids[self.prefix_offset..]);
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next id.
        if after.len() <= before.len() || after.ends_with('\u{fffd}') {
            return String::new();
        }
        let Some(new) = after.strip_prefix(before.as_str()) else {
            // Decoding rewrote the window (cleanup rules): emit nothing rather than garbage.
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return String::new();
        };
        let new = new.to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        new
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

// ---------------------------------------------------------------------------------------------
// Hugging Face tokenizer

/// A Hugging Face `tokenizer.json` (any model type: BPE, WordPiece, Unigram, ...).
#[derive(Clone)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    output_vocab: Vec<u32>,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("output_vocab", &self.output_vocab.len())
            .finish()
    }
}

impl HfTokenizer {
    /// Most ids kept in the output vocabulary (plenty for varied, deterministic answers).
    pub const MAX_OUTPUT_VOCAB: usize = 512;

    /// Loads `path`: a `tokenizer.json`, or a model directory that holds one (like vLLM's
    /// `--tokenizer`).
    pub fn from_file(path: &Path) -> Result<Self, SimError> {
        let file = tokenizer_json_path(path);
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| {
            SimError::Config(format!("cannot load tokenizer {}: {e}", file.display()))
        })?;
        let mut t = Self::from_tokenizer(inner)?;
        t.path = Some(file);
        Ok(t)
    }

    /// Parses the text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self, SimError> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| SimError::Config(format!("invalid tokenizer.json: {e}")))?;
        Self::from_tokenizer(inner)
    }

    /// Wraps a loaded tokenizer and picks its output vocabulary. Padding and truncation
    /// settings saved in the file are dropped, as transformers does unless asked for them
    /// (a `tokenizer.json` exported for embeddings often pads every input to 128 ids).
    pub fn from_tokenizer(mut inner: tokenizers::Tokenizer) -> Result<Self, SimError> {
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| SimError::Config(format!("cannot disable truncation: {e}")))?;
        let output_vocab = pick_output_vocab(&inner);
        if output_vocab.is_empty() {
            return Err(SimError::Config(
                "the tokenizer has no token whose text re-tokenises to itself; \
                 vllm-sim cannot generate text with it"
                    .into(),
            ));
        }
        Ok(Self {
            inner,
            output_vocab,
            path: None,
        })
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The file it was loaded from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

/// `path` itself, or `path/tokenizer.json` when `path` is a directory.
fn tokenizer_json_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
}

/// Ids that decode to a plain word (letters, optionally after a space) and survive a
/// decode/encode round trip alone and next to the previously chosen word, in id order
/// (frequent words first in BPE vocabularies). Falls back to any round-tripping token.
fn pick_output_vocab(t: &tokenizers::Tokenizer) -> Vec<u32> {
    let special: HashSet<u32> = t.get_added_tokens_decoder().keys().copied().collect();
    let mut ids: Vec<u32> = t
        .get_vocab(false)
        .into_values()
        .filter(|id| !special.contains(id))
        .collect();
    ids.sort_unstable();
    let round_trips = |seq: &[u32]| {
        t.decode(seq, true)
            .ok()
            .and_then(|text| t.encode_fast(text.as_str(), false).ok())
            .is_some_and(|enc| enc.get_ids() == seq)
    };
    let pick = |accept: &dyn Fn(&str) -> bool| {
        let mut out: Vec<u32> = Vec::new();
        for &id in &ids {
            if out.len() >= HfTokenizer::MAX_OUTPUT_VOCAB {
                break;
            }
            let Ok(text) = t.decode(&[id], true) else {
                continue;
            };
            if !accept(&text) || !round_trips(&[id]) || !round_trips(&[id, id]) {
                continue;
            }
            if let Some(&prev) = out.last()
                && !(round_trips(&[prev, id]) && round_trips(&[id, prev]))
            {
                continue;
            }
            out.push(id);
        }
        out
    };
    let words = pick(&|text: &str| {
        let word = text.strip_prefix(' ').unwrap_or(text);
        (2..=16).contains(&word.len()) && word.chars().all(|c| c.is_ascii_alphabetic())
    });
    if words.len() >= 2 {
        return words;
    }
    pick(&|text: &str| !text.trim().is_empty() && !text.contains('\u{fffd}'))
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, SimError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| SimError::InvalidRequest(format!("cannot tokenize the prompt: {e}")))
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }

    fn decode_keeping_special(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    fn token_str(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_default()
    }

    fn output_vocab(&self) -> Vec<u32> {
        self.output_vocab.clone()
    }
}

/// Trains a small GPT-2-style byte-level BPE on `corpus` and returns its `tokenizer.json`, for
/// tests and demos that need a real tokenizer without downloading one. `special_tokens` become
/// added tokens (never split), e.g. ChatML's `<|im_start|>`.
pub fn train_byte_level_bpe(
    corpus: &[&str],
    vocab_size: usize,
    special_tokens: &[&str],
) -> Result<String, SimError> {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    let err = |e: tokenizers::Error| SimError::Config(format!("cannot train the tokenizer: {e}"));
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<tokenizers::AddedToken> = special_tokens
        .iter()
        .map(|s| tokenizers::AddedToken::from(*s, true))
        .collect();
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(specials.clone())
            .build(),
    );
    tokenizer.train(&mut trainer, corpus.iter()).map_err(err)?;
    tokenizer.add_special_tokens(specials).map_err(err)?;
    tokenizer.to_string(false).map_err(err)
}

/// Writes a model directory as vLLM loads one: `tokenizer.json`, a byte-level BPE trained on
/// `corpus` ([`train_byte_level_bpe`] with ChatML's special tokens), and `tokenizer_config.json`
/// naming ChatML (BOS first) as the model's own template. For the tests that start a replica or
/// a control plane on a real tokenizer without downloading one.
pub fn write_chatml_model_dir(
    dir: &Path,
    corpus: &[&str],
    vocab_size: usize,
) -> Result<(), SimError> {
    let json = train_byte_level_bpe(corpus, vocab_size, &SPECIAL_TOKENS)?;
    let io = |e: std::io::Error| SimError::Config(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("tokenizer.json"), json).map_err(io)?;
    let config = serde_json::json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                        "chat_template": format!("{{{{ bos_token }}}}{CHATML_JINJA}")});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).map_err(io)
}

/// [`write_chatml_model_dir`] into a directory of the system's temporary folder named for
/// `name` and this process (so parallel test binaries never share one); returns it.
pub fn temp_chatml_model_dir(
    name: &str,
    corpus: &[&str],
    vocab_size: usize,
) -> Result<PathBuf, SimError> {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    write_chatml_model_dir(&dir, corpus, vocab_size)?;
    Ok(dir)
}

/// What vLLM takes from `tokenizer_config.json` beside the tokenizer: the special tokens a chat
/// template refers to, and the model's own chat template.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// `bos_token` (a string or an added-token object's `content`).
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `chat_template`; of a list of named templates, the one named `default` (else the first).
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// Reads `tokenizer_config.json` from the directory of `tokenizer` (a `tokenizer.json` or a
    /// model directory). No such file gives the empty config; a malformed one is an error.
    pub fn load_beside(tokenizer: &Path) -> Result<Self, SimError> {
        let json = tokenizer_json_path(tokenizer);
        let file = json
            .parent()
            .unwrap_or(Path::new("."))
            .join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => {
                return Err(SimError::Config(format!(
                    "cannot read {}: {e}",
                    file.display()
                )));
            }
        };
        Self::from_json(&text)
            .map_err(|e| SimError::Config(format!("invalid {}: {e}", file.display())))
    }

    /// Parses the text of a `tokenizer_config.json`.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let token = |key: &str| match v.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(obj) => obj
                .get("content")
                .and_then(|c| c.as_str())
                .map(str::to_owned),
            None => None,
        };
        let chat_template = match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => {
                let template = |t: &serde_json::Value| {
                    t.get("template")
                        .and_then(|s| s.as_str())
                        .map(str::to_owned)
                };
                named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| named.first())
                    .and_then(template)
            }
            Some(serde_json::Value::Null) | None => None,
            Some(_) => return Err("chat_template must be a string or a list".into()),
        };
        Ok(Self {
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            chat_template,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Jinja chat templates

/// A Hugging Face chat template, rendered like transformers' `apply_chat_template` by
/// `vllm_wire::chat_template` (the control plane renders with the same code, so both see the
/// prompt text vLLM would). The context holds `messages`, `add_generation_prompt`,
/// `bos_token` and `eos_token`.
pub struct JinjaTemplate {
    template: vllm_wire::chat_template::ChatTemplate,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for JinjaTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JinjaTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// What a template sees, as vLLM passes it.
#[derive(Serialize)]
struct TemplateContext<'a> {
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

impl JinjaTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` fill the variables of the same name.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, SimError> {
        Ok(Self {
            template: vllm_wire::chat_template::ChatTemplate::new(source)
                .map_err(|e| SimError::Config(e.to_string()))?,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Loads a template like vLLM's `--chat-template`: the contents of the file `spec`, or
    /// `spec` itself when it is no file but looks like a template (has `{` or a newline).
    pub fn load(spec: &str, bos_token: &str, eos_token: &str) -> Result<Self, SimError> {
        let path = Path::new(spec);
        let source = if path.is_file() {
            std::fs::read_to_string(path)
                .map_err(|e| SimError::Config(format!("cannot read chat template {spec}: {e}")))?
        } else if spec.contains('{') || spec.contains('\n') {
            spec.to_owned()
        } else {
            return Err(SimError::Config(format!(
                "chat template {spec} is neither a file nor a template"
            )));
        };
        Self::new(&source, bos_token, eos_token)
    }
}

impl ChatTemplate for JinjaTemplate {
    fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, SimError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let context = TemplateContext {
            messages,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        };
        self.template
            .render(&context, now)
            .map_err(|e| SimError::InvalidRequest(format!("chat template error: {e}")))
    }
}

// ---------------------------------------------------------------------------------------------
// Built-in fallback
/// Special tokens with fixed ids below [`WordTokenizer::OFFSET`].
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Words the simulated model "generates" (lorem-ipsum English).
const WORDS: &str = "the of and to in is was that for on with as by at from it an be this are \
    which or have not has but were had their one all been can more its new other also after \
    first two time year would about there some only into most over such when between up out \
    many then these so may where any made part world state city during under while system \
    both through well each data model cache token request server route fleet block prefix \
    latency batch queue memory engine answer question light river mountain ocean forest \
    garden window paper story music market energy signal number letter simple quick bright \
    quiet gentle steady careful clever silver golden early later always never often rarely \
    today tomorrow together across around behind beyond inside outside above below near far \
    north south east west spring summer autumn winter morning evening night day week month \
    build write read learn teach think know find keep give take make move turn open close \
    start finish carry follow lead hold bring send show tell ask answer help change grow";

/// Deterministic word-level tokenizer (see the module docs).
#[derive(Debug, Clone)]
pub struct WordTokenizer {
    vocab_size: u32,
    words: Vec<(u32, String)>,
    by_id: HashMap<u32, usize>,
}

impl Default for WordTokenizer {
    fn default() -> Self {
        Self::new(128_000)
    }
}

impl WordTokenizer {
    /// First id of hashed (non-special) tokens.
    pub const OFFSET: u32 = 16;

    /// A tokenizer whose hashed ids fall in `OFFSET..OFFSET + vocab_size`.
    pub fn new(vocab_size: u32) -> Self {
        let vocab_size = vocab_size.max(1);
        let mut words = Vec::new();
        let mut by_id = HashMap::new();
        for word in WORDS.split_whitespace() {
            let piece = format!(" {word}");
            let id = Self::hashed_id(vocab_size, &piece);
            // Keep only words whose id is unique, so decoding is unambiguous.
            if let hashbrown::hash_map::Entry::Vacant(slot) = by_id.entry(id) {
                slot.insert(words.len());
                words.push((id, piece));
            }
        }
        Self {
            vocab_size,
            words,
            by_id,
        }
    }

    fn hashed_id(vocab_size: u32, piece: &str) -> u32 {
        Self::OFFSET + (xxh3_64(piece.as_bytes()) % u64::from(vocab_size)) as u32
    }

    /// Splits `text` into pieces; every piece maps to exactly one id.
    pub fn pieces(text: &str) -> Vec<&str> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if let Some(len) = special_at(&text[i..]) {
                out.push(&text[i..i + len]);
                i += len;
                continue;
            }
            let ch = next_char(&text[i..]);
            let start = i;
            if ch.is_whitespace() {
                i += ch.len_utf8();
                // A single space glues to the word that follows it.
                if ch == ' ' && i < bytes.len() && special_at(&text[i..]).is_none() {
                    let next = next_char(&text[i..]);
                    if !next.is_whitespace() {
                        i = word_end(text, i);
                    }
                }
            } else {
                i = word_end(text, i);
            }
            out.push(&text[start..i]);
        }
        out
    }
}

fn next_char(s: &str) -> char {
    s.chars().next().unwrap_or(' ')
}

/// Length of the special token `s` starts with, if any.
fn special_at(s: &str) -> Option<usize> {
    if !s.starts_with("<|") {
        return None;
    }
    SPECIAL_TOKENS
        .iter()
        .find(|t| s.starts_with(**t))
        .map(|t| t.len())
}

/// End of the run of non-whitespace characters starting at `i` (stops before a special token).
fn word_end(text: &str, mut i: usize) -> usize {
    while i < text.len() {
        let rest = &text[i..];
        let ch = next_char(rest);
        if ch.is_whitespace() || special_at(rest).is_some() {
            break;
        }
        i += ch.len_utf8();
    }
    i
}

impl WordTokenizer {
    /// Token ids of `text` (this tokenizer adds no special tokens).
    pub fn encode_text(&self, text: &str) -> Vec<u32> {
        Self::pieces(text)
            .into_iter()
            .map(
                |piece| match SPECIAL_TOKENS.iter().position(|t| *t == piece) {
                    Some(i) => i as u32,
                    None => Self::hashed_id(self.vocab_size, piece),
                },
            )
            .collect()
    }
}

impl Tokenizer for WordTokenizer {
    fn encode(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, SimError> {
        Ok(self.encode_text(text))
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for &id in ids {
            if let Some(special) = SPECIAL_TOKENS.get(id as usize) {
                out.push_str(special);
            } else if let Some(&i) = self.by_id.get(&id) {
                out.push_str(&self.words[i].1);
            } else {
                // Not invertible (a hashed prompt piece): a readable placeholder.
                out.push_str(&format!(" <{id}>"));
            }
        }
        out
    }

    fn output_vocab(&self) -> Vec<u32> {
        self.words.iter().map(|(id, _)| *id).collect()
    }
}

/// ChatML as a Jinja chat template: renders exactly what [`ChatMl`] renders.
pub const CHATML_JINJA: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The ChatML template (Qwen, many fine-tunes):
/// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatMl;

impl ChatMl {
    /// The rendered prompt (ChatML cannot fail).
    pub fn render_text(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        for m in messages {
            out.push_str("<|im_start|>");
            out.push_str(&m.role);
            out.push('\n');
            out.push_str(&m.content);
            out.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        out
    }
}

impl ChatTemplate for ChatMl {
    fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, SimError> {
        Ok(self.render_text(messages, add_generation_prompt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    const CORPUS: &[&str] = &[
        "The cache keeps the prefix of every request so the next turn starts fast.",
        "A router sends each request to the replica that already holds its prefix.",
        "When the cache is full the least recently used blocks are evicted first.",
        "Every block holds sixteen tokens and a chained hash of the tokens before it.",
        "The scheduler batches running requests and admits waiting ones while memory lasts.",
        "the of and to in is was that for on with as by at from it an be this are which",
        "or have not has but were had their one all been can more its new other also after",
    ];

    fn bpe() -> HfTokenizer {
        let json = train_byte_level_bpe(CORPUS, 600, &SPECIAL_TOKENS).unwrap();
        HfTokenizer::from_json(&json).unwrap()
    }

    /// A tiny BERT-style WordPiece tokenizer.json: lower-cases, splits on whitespace and
    /// punctuation, adds [CLS] ... [SEP] with special tokens, decodes with spaces between words.
    fn wordpiece_json() -> String {
        let words = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "cache", "the", "of", "and",
            "block", "##s", "route", "##r", ".", "?",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| ((*w).to_owned(), serde_json::json!(i)))
            .collect();
        let added: Vec<serde_json::Value> = words[..4]
            .iter()
            .enumerate()
            .map(|(i, w)| {
                serde_json::json!({"id": i, "content": w, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let special =
            |name: &str, id: u32| serde_json::json!({"id": name, "ids": [id], "tokens": [name]});
        serde_json::json!({
            // As sentence-embedding exports ship it: truncate to 8, pad every input to 8.
            "version": "1.0", "added_tokens": added,
            "truncation": {"max_length": 8, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 8}, "direction": "Right",
                "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
            "normalizer": {"type": "BertNormalizer", "clean_text": true,
                "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"[CLS]": special("[CLS]", 2), "[SEP]": special("[SEP]", 3)}},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
            "model": {"type": "WordPiece", "unk_token": "[UNK]",
                "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                "vocab": vocab}
        })
        .to_string()
    }

    #[test]
    fn pieces_glue_one_leading_space() {
        assert_eq!(
            WordTokenizer::pieces("Hi there  you\n<|im_end|>x"),
            vec!["Hi", " there", " ", " you", "\n", "<|im_end|>", "x"]
        );
        assert_eq!(WordTokenizer::pieces(""), Vec::<&str>::new());
        assert_eq!(WordTokenizer::pieces("é ü"), vec!["é", " ü"]);
    }

    #[test]
    fn deterministic_and_special_ids() {
        let t = WordTokenizer::default();
        let a = t.encode_text("<|im_start|>user\nhello world");
        assert_eq!(a, t.encode("<|im_start|>user\nhello world", true).unwrap());
        assert_eq!(a[0], 1);
        assert!(a[1..].iter().all(|&id| id >= WordTokenizer::OFFSET));
        assert_ne!(t.encode_text(" hello"), t.encode_text("hello"));
    }

    #[test]
    fn generated_text_round_trips() {
        let t = WordTokenizer::default();
        let vocab = t.output_vocab();
        assert!(vocab.len() > 150);
        let ids: Vec<u32> = vocab.iter().copied().cycle().step_by(7).take(50).collect();
        assert_eq!(t.encode_text(&t.decode(&ids)), ids);
    }

    /// Turn 1 is rendered with the generation prompt, answered, and turn 2 carries the answer:
    /// turn 1's tokens are a prefix of turn 2's, followed by exactly the generated ids.
    fn assert_turns_extend(t: &dyn Tokenizer, template: &dyn ChatTemplate) {
        let mut history = vec![msg("system", "Be brief."), msg("user", "What is a cache?")];
        let turn1 = t
            .encode(&template.render(&history, true).unwrap(), false)
            .unwrap();
        let answer: Vec<u32> = t.output_vocab().into_iter().take(9).collect();
        assert_eq!(answer.len(), 9);
        history.push(msg("assistant", &t.decode(&answer)));
        history.push(msg("user", "And a prefix?"));
        let turn2 = t
            .encode(&template.render(&history, true).unwrap(), false)
            .unwrap();
        assert_eq!(turn2[..turn1.len()], turn1[..], "turn 1 is a token prefix");
        assert_eq!(turn2[turn1.len()..turn1.len() + answer.len()], answer[..]);
    }

    #[test]
    fn chat_turns_extend_token_prefix() {
        assert_turns_extend(&WordTokenizer::default(), &ChatMl);
        let chatml = JinjaTemplate::new(CHATML_JINJA, "", "").unwrap();
        assert_turns_extend(&WordTokenizer::default(), &chatml);
        assert_turns_extend(&bpe(), &chatml);
        assert_turns_extend(&bpe(), &ChatMl);
    }

    #[test]
    fn jinja_chatml_renders_like_the_builtin() {
        let jinja = JinjaTemplate::new(CHATML_JINJA, "", "").unwrap();
        let msgs = vec![msg("system", " spaced \n"), msg("user", "q?")];
        for gen_prompt in [true, false] {
            assert_eq!(
                jinja.render(&msgs, gen_prompt).unwrap(),
                ChatMl.render_text(&msgs, gen_prompt)
            );
        }
    }

    #[test]
    fn bpe_tokenizer_from_tokenizer_json() {
        let t = bpe();
        let ids = t
            .encode("<|im_start|>user\nThe cache<|im_end|>", false)
            .unwrap();
        let start = t.inner().token_to_id("<|im_start|>").unwrap();
        let end = t.inner().token_to_id("<|im_end|>").unwrap();
        assert_eq!(ids[0], start, "a special token is one id");
        assert_eq!(*ids.last().unwrap(), end);
        assert_eq!(t.token_str(start), "<|im_start|>");
        // Output words: whole words, most with a leading space, that round-trip together.
        let vocab = t.output_vocab();
        assert!(vocab.len() >= 20, "{} output words", vocab.len());
        assert!(!vocab.contains(&start) && !vocab.contains(&end));
        let sample: Vec<u32> = vocab.iter().copied().cycle().step_by(3).take(40).collect();
        assert_eq!(t.encode(&t.decode(&sample), false).unwrap(), sample);
        // The file path and a model directory both load.
        let dir = std::env::temp_dir().join(format!("kvroute-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = t.inner().to_string(false).unwrap();
        std::fs::write(dir.join("tokenizer.json"), json).unwrap();
        let from_dir = HfTokenizer::from_file(&dir).unwrap();
        assert_eq!(from_dir.output_vocab(), vocab);
        assert_eq!(from_dir.path(), Some(dir.join("tokenizer.json").as_path()));
        std::fs::remove_dir_all(&dir).unwrap();
        let missing = HfTokenizer::from_file(Path::new("/nonexistent/tokenizer.json"));
        assert!(matches!(missing, Err(SimError::Config(m)) if m.contains("/nonexistent")));
        assert!(HfTokenizer::from_json("{\"model\": 1}").is_err());
    }

    #[test]
    fn wordpiece_special_tokens_and_streaming() {
        let t = HfTokenizer::from_json(&wordpiece_json()).unwrap();
        assert_eq!(t.encode("Hello world", true).unwrap(), vec![2, 4, 5, 3]);
        assert_eq!(t.encode("Hello world", false).unwrap(), vec![4, 5]);
        assert_eq!(t.encode("blocks", false).unwrap(), vec![10, 11]);
        let long = "hello world ".repeat(10);
        assert_eq!(t.encode(&long, false).unwrap().len(), 20, "no truncation");
        let vocab = t.output_vocab();
        assert!(vocab.contains(&4) && vocab.contains(&10), "{vocab:?}");
        assert!(!vocab.contains(&11), "'##s' does not round-trip alone");
        // Streaming the answer gives the same text as decoding it whole.
        let answer = [4, 5, 10, 7, 6];
        let mut dec = IncrementalDecoder::default();
        let streamed: String = answer.iter().map(|&id| dec.push(&t, id)).collect();
        assert_eq!(streamed, t.decode(&answer));
        assert_eq!(streamed, "hello world block the cache");
        assert_eq!(dec.ids(), answer);
        assert_eq!(t.encode(&streamed, false).unwrap(), answer);
    }

    #[test]
    fn incremental_decoding_matches_full_decoding() {
        for t in [
            Box::new(bpe()) as Box<dyn Tokenizer>,
            Box::new(WordTokenizer::default()),
        ] {
            let ids: Vec<u32> = t.output_vocab().into_iter().take(30).collect();
            let mut dec = IncrementalDecoder::default();
            let streamed: String = ids.iter().map(|&id| dec.push(t.as_ref(), id)).collect();
            assert_eq!(streamed, t.decode(&ids));
        }
    }

    #[test]
    fn jinja_templates_see_what_vllm_passes() {
        // The environment itself is vllm-wire's (tested there); this is the context the
        // simulator hands it and how its errors surface.
        let t = JinjaTemplate::new(
            "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}{{ add_generation_prompt }}\
             {% if messages[0].role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(
            t.render(&[msg("user", "a")], true).unwrap(),
            // Keys in ChatMessage's field order, with Python's json.dumps separators.
            r#"<s>[{"role": "user", "content": "a"}]</s>True"#
        );
        let err = t.render(&[msg("tool", "x")], false).unwrap_err();
        assert!(
            matches!(&err, SimError::InvalidRequest(m) if m.contains("no tools")),
            "{err}"
        );
        assert!(matches!(
            JinjaTemplate::new("{% for %}", "", ""),
            Err(SimError::Config(_))
        ));
        assert!(JinjaTemplate::load("{{ 1 }}", "", "").is_ok(), "inline");
        assert!(JinjaTemplate::load("no_such_template.jinja", "", "").is_err());
    }

    #[test]
    fn tokenizer_config_fields() {
        let c = TokenizerConfig::from_json(
            r#"{"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false},
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        assert_eq!(
            TokenizerConfig::from_json("{}").unwrap(),
            TokenizerConfig::default()
        );
        assert!(TokenizerConfig::from_json(r#"{"chat_template": 3}"#).is_err());
        assert!(TokenizerConfig::from_json("nope").is_err());
        assert_eq!(
            TokenizerConfig::load_beside(Path::new("/nonexistent/tokenizer.json")).unwrap(),
            TokenizerConfig::default()
        );
    }
}
