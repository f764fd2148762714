//! In-process tokenisation: the model's `tokenizer.json` (`tokenizers` crate) and its chat
//! template (`vllm_wire::chat_template`, rendered like transformers' `apply_chat_template` and
//! shared with vllm-sim).
//!
//! Prefix reuse: a Hugging Face tokenizer splits its input at added tokens before anything else
//! runs, so the text between two special tokens tokenises independently of the rest. The
//! rendered prompt is therefore cut just before each special token (chat templates put one at
//! every message boundary), each piece is tokenised on its own and cached by its content hash,
//! and turn N of a chat only tokenises the pieces that are new. A piece keeps its leading special
//! token, so it is tokenised in the same position-dependent way as inside the whole prompt
//! (Metaspace's "prepend on first split only"). Tokens that strip whitespace on their left, match
//! only whole words or are normalised are never cut before: inside a piece they behave as in the
//! whole prompt.
//!
//! A self-check re-tokenises the whole prompt on the first requests and then on every
//! [`VERIFY_EVERY`]th; on any difference it logs once and stops splitting.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use scorer_core::protocol::ApiKind;
use serde_json::{Map, Value};
use vllm_wire::chat_template::ChatTemplate;
use xxhash_rust::xxh3::xxh3_64;

use super::cache::TokenCache;
use super::{TokenizeError, Tokenized};
use crate::config::PreciseSettings;

/// Requests checked against whole-prompt tokenisation at start.
const VERIFY_FIRST: u64 = 16;
/// Then one request in this many is checked.
const VERIFY_EVERY: u64 = 256;

/// The model's tokenizer and chat template, with a segment cache.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    bos_token: String,
    eos_token: String,
    /// Special tokens a prompt may be cut before, longest first within each first byte.
    cuts: Vec<String>,
    cache: TokenCache,
    requests: AtomicU64,
    split_ok: AtomicBool,
    /// The template rejects a system message after the first turn (vLLM's probe), so vLLM
    /// merges a Messages request's inline system messages into the leading one.
    merge_inline_system: bool,
    /// The replicas' `--default-chat-template-kwargs`, merged under each request's.
    default_kwargs: Map<String, Value>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("cuts", &self.cuts.len())
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    /// Loads `tokenizer_json`, and the chat template from `chat_template` or
    /// `tokenizer_config` (`chat_template`, `bos_token`, `eos_token`).
    pub fn load(p: &PreciseSettings) -> Result<Self, TokenizeError> {
        let path = p
            .tokenizer_json
            .as_ref()
            .ok_or_else(|| TokenizeError::Load("precise.tokenizer_json is not set".into()))?;
        let json = std::fs::read(path)
            .map_err(|e| TokenizeError::Load(format!("{}: {e}", path.display())))?;
        let config = match &p.tokenizer_config {
            Some(c) => {
                let text = std::fs::read_to_string(c)
                    .map_err(|e| TokenizeError::Load(format!("{}: {e}", c.display())))?;
                Some(
                    serde_json::from_str::<Value>(&text)
                        .map_err(|e| TokenizeError::Load(format!("{}: {e}", c.display())))?,
                )
            }
            None => None,
        };
        let template = match &p.chat_template {
            Some(t) => Some(
                std::fs::read_to_string(t)
                    .map_err(|e| TokenizeError::Load(format!("{}: {e}", t.display())))?,
            ),
            None => config.as_ref().and_then(config_template),
        };
        let token = |key: &str| {
            config
                .as_ref()
                .and_then(|c| c.get(key))
                .and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()))
                .unwrap_or_default()
                .to_owned()
        };
        let mut tokenizer = Self::new(
            &json,
            template.as_deref(),
            &token("bos_token"),
            &token("eos_token"),
            p.cache_entries,
        )?;
        tokenizer.default_kwargs = p.default_chat_template_kwargs.clone();
        Ok(tokenizer)
    }

    /// A tokenizer from the bytes of a `tokenizer.json` and an optional chat template.
    pub fn new(
        tokenizer_json: &[u8],
        chat_template: Option<&str>,
        bos_token: &str,
        eos_token: &str,
        cache_entries: usize,
    ) -> Result<Self, TokenizeError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| TokenizeError::Load(format!("tokenizer.json: {e}")))?;
        let mut cuts: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.lstrip && !t.single_word && !t.normalized)
            .map(|t| t.content)
            .filter(|c| !c.is_empty())
            .collect();
        // Longest first, so a token that extends another one wins at the same position.
        cuts.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        let template = chat_template
            .map(ChatTemplate::new)
            .transpose()
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut tokenizer = Self {
            tokenizer,
            template,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            cuts,
            cache: TokenCache::new(cache_entries),
            requests: AtomicU64::new(0),
            split_ok: AtomicBool::new(true),
            merge_inline_system: true,
            default_kwargs: Map::new(),
        };
        tokenizer.merge_inline_system = tokenizer.rejects_inline_system();
        Ok(tokenizer)
    }

    /// vLLM's probe (`_detect_merge_inline_system`): a template that fails on
    /// `[system, user, system, user]`, or no template, needs system messages first.
    fn rejects_inline_system(&self) -> bool {
        let probe = serde_json::json!({
            "messages": [
                {"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                {"role": "system", "content": "t"}, {"role": "user", "content": "t"}],
            "add_generation_prompt": false,
        });
        probe
            .as_object()
            .is_none_or(|prompt| self.render(prompt).is_err())
    }

    /// Whether vLLM merges a Messages request's inline system messages into the leading one
    /// for this template (see [`HfTokenizer::new`]'s probe).
    pub fn merges_inline_system(&self) -> bool {
        self.merge_inline_system
    }

    /// Token ids of a chat or completion prompt, as vLLM computes them: a chat is rendered
    /// through the template and tokenised without added special tokens; a completion prompt
    /// is tokenised with them (the post-processor's BOS).
    pub fn tokenize(
        &self,
        api: ApiKind,
        prompt: &Map<String, Value>,
    ) -> Result<Tokenized, TokenizeError> {
        match api {
            ApiKind::Chat => {
                let text = self.render(prompt)?;
                self.encode_split(&text)
            }
            ApiKind::Completion => {
                let text = match prompt.get("prompt") {
                    Some(Value::String(s)) => s.as_str(),
                    Some(Value::Array(a)) if a.len() == 1 => a[0].as_str().unwrap_or_default(),
                    _ => return Err(TokenizeError::BadPrompt("prompt must be a string".into())),
                };
                Ok(Tokenized {
                    ids: self.encode(text, true)?,
                    cached: 0,
                })
            }
            // `Precise::tokenize` converts these to chat first.
            ApiKind::Responses | ApiKind::Messages => Err(TokenizeError::BadPrompt(format!(
                "the {} API is tokenised as the chat request vLLM makes of it",
                api.as_str()
            ))),
        }
    }

    /// The chat template's output for `prompt` (its messages, tools and template options).
    pub fn render(&self, prompt: &Map<String, Value>) -> Result<String, TokenizeError> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| TokenizeError::Template("the model has no chat template".into()))?;
        let messages = prompt
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| TokenizeError::BadPrompt("messages must be an array".into()))?;
        let mut ctx = Map::new();
        let request_kwargs = match prompt.get("chat_template_kwargs") {
            Some(Value::Object(kwargs)) => kwargs.clone(),
            _ => Map::new(),
        };
        ctx.extend(merged_kwargs(&self.default_kwargs, request_kwargs));
        let messages: Vec<Value> = messages.iter().map(flatten_message).collect();
        // The text a `continue_final_message` prompt ends in (vLLM: the last message's).
        let final_text = messages
            .last()
            .and_then(|m| m.get("content"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        ctx.insert("messages".into(), Value::Array(messages));
        for key in ["tools", "documents"] {
            if let Some(v) = prompt.get(key).filter(|v| !v.is_null()) {
                ctx.insert(key.into(), v.clone());
            }
        }
        let flag =
            |k: &str, default: bool| prompt.get(k).and_then(Value::as_bool).unwrap_or(default);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(flag("add_generation_prompt", true)),
        );
        let continue_final = flag("continue_final_message", false);
        ctx.insert("continue_final_message".into(), Value::Bool(continue_final));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let rendered = template
            .render(&ctx, now)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        if !continue_final {
            return Ok(rendered);
        }
        // As transformers does for vLLM: the prompt ends right after the final message's text.
        vllm_wire::chat_template::cut_after_final_message(&rendered, &final_text).ok_or_else(|| {
            TokenizeError::Template(
                "continue_final_message is set but the final message does not appear in the \
                 chat after applying the chat template"
                    .into(),
            )
        })
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    }

    /// Tokenises `text` piece by piece through the cache (see the module docs).
    pub fn encode_split(&self, text: &str) -> Result<Tokenized, TokenizeError> {
        if !self.split_ok.load(Ordering::Relaxed) {
            return Ok(Tokenized {
                ids: self.encode(text, false)?,
                cached: 0,
            });
        }
        let mut ids = Vec::new();
        let mut cached = 0;
        let mut start = 0;
        for end in self.cut_points(text).into_iter().chain([text.len()]) {
            if end <= start {
                continue;
            }
            let piece = &text[start..end];
            // Only the first piece can lack a leading special token, and it is always at offset
            // 0; every other piece tokenises the same wherever it sits: content is the key.
            let key = xxh3_64(piece.as_bytes());
            match self.cache.get(key) {
                Some(hit) => {
                    cached += hit.len();
                    ids.extend_from_slice(&hit);
                }
                None => {
                    let fresh = self.encode(piece, false)?;
                    ids.extend_from_slice(&fresh);
                    self.cache.insert(key, fresh.into());
                }
            }
            start = end;
        }
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        if n < VERIFY_FIRST || n.is_multiple_of(VERIFY_EVERY) {
            let whole = self.encode(text, false)?;
            if whole != ids {
                tracing::warn!(
                    "piecewise tokenisation differs from whole-prompt tokenisation for this \
                     tokenizer: segment caching disabled"
                );
                self.split_ok.store(false, Ordering::Relaxed);
                return Ok(Tokenized {
                    ids: whole,
                    cached: 0,
                });
            }
        }
        Ok(Tokenized { ids, cached })
    }

    /// Byte offsets where a special token that may start a piece begins.
    fn cut_points(&self, text: &str) -> Vec<usize> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let rest = &text[i..];
            match self.cuts.iter().find(|c| rest.starts_with(c.as_str())) {
                Some(c) => {
                    out.push(i);
                    i += c.len();
                }
                None => {
                    i += rest.chars().next().map_or(1, char::len_utf8);
                }
            }
        }
        out
    }

    /// Pieces currently cached.
    pub fn cached_pieces(&self) -> usize {
        self.cache.len()
    }
}

/// `chat_template` of a `tokenizer_config.json`: a string, or of a list of named templates the
/// one named `default` (else the first).
fn config_template(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| named.first())
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// vLLM's "string" content format: a list of text parts becomes their texts joined by newlines.
/// The template variables vLLM 0.33 renders with: the server's defaults, then the request's
/// over them, where a request value of `null` or `"auto"` leaves the default (`merge_kwargs` in
/// `vllm/renderers/params.py`, applied only when the server has defaults).
fn merged_kwargs(defaults: &Map<String, Value>, request: Map<String, Value>) -> Map<String, Value> {
    if defaults.is_empty() {
        return request;
    }
    let mut merged = defaults.clone();
    merged.extend(
        request
            .into_iter()
            .filter(|(_, v)| !v.is_null() && v.as_str() != Some("auto")),
    );
    merged
}

fn flatten_message(m: &Value) -> Value {
    let mut m = m.clone();
    if let Some(Value::Array(parts)) = m.get("content") {
        let texts: Vec<&str> = parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                p => p.get("text").and_then(Value::as_str),
            })
            .collect();
        let joined = texts.join("\n");
        if let Some(obj) = m.as_object_mut() {
            obj.insert("content".into(), Value::String(joined));
        }
    }
    m
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::{AddedToken, Tokenizer};

    pub(crate) const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    /// A word-level tokenizer with a Metaspace pre-tokenizer that prepends only on the first
    /// split: the position-dependent case the piece split must reproduce.
    pub(crate) fn test_tokenizer_json() -> Vec<u8> {
        let words = "▁hello ▁world ▁what ▁is ▁a ▁cache ▁and ▁prefix ? user assistant system \
                     ▁be ▁brief . ▁user ▁assistant ▁system hello user\n assistant\n system\n \n";
        let mut vocab: std::collections::HashMap<String, u32> = words
            .split(' ')
            .filter(|w| !w.is_empty())
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32 + 10))
            .collect();
        vocab.insert("[UNK]".into(), 0);
        let model = WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut t = Tokenizer::new(model);
        t.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, true)));
        t.add_special_tokens(vec![
            AddedToken::from("<|im_start|>", true),
            AddedToken::from("<|im_end|>", true),
        ])
        .unwrap();
        t.to_string(false).unwrap().into_bytes()
    }

    fn tokenizer() -> HfTokenizer {
        HfTokenizer::new(&test_tokenizer_json(), Some(CHATML), "", "", 1024).unwrap()
    }

    // The replicas' `--default-chat-template-kwargs` sit under the request's, and a request
    // value of null or "auto" leaves the default, as vLLM 0.33 merges them.
    #[test]
    fn server_default_template_kwargs_sit_under_the_requests() {
        let template = "{{ mode }}|{{ messages[0].content }}";
        let mut t = HfTokenizer::new(&test_tokenizer_json(), Some(template), "", "", 16).unwrap();
        t.default_kwargs = serde_json::json!({"mode": "server"})
            .as_object()
            .unwrap()
            .clone();
        let with = |t: &HfTokenizer, kwargs: Value| {
            let mut p = prompt(&[("user", "hi")]);
            p.insert("chat_template_kwargs".into(), kwargs);
            t.render(&p).unwrap()
        };
        assert_eq!(t.render(&prompt(&[("user", "hi")])).unwrap(), "server|hi");
        assert_eq!(with(&t, serde_json::json!({"mode": "client"})), "client|hi");
        assert_eq!(with(&t, serde_json::json!({"mode": "auto"})), "server|hi");
        assert_eq!(with(&t, serde_json::json!({"mode": null})), "server|hi");
        // Without server defaults the request's values stand as given.
        t.default_kwargs.clear();
        assert_eq!(with(&t, serde_json::json!({"mode": "auto"})), "auto|hi");
    }

    fn prompt(msgs: &[(&str, &str)]) -> Map<String, Value> {
        let messages: Vec<Value> = msgs
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        serde_json::json!({"model": "m", "messages": messages})
            .as_object()
            .unwrap()
            .clone()
    }

    #[test]
    fn pieces_match_whole_prompt_and_turn_two_reuses_turn_one() {
        let t = tokenizer();
        let mut turn = vec![
            ("system", "be brief."),
            ("user", "hello world what is a cache?"),
        ];
        let one = t.tokenize(ApiKind::Chat, &prompt(&turn)).unwrap();
        let text = t.render(&prompt(&turn)).unwrap();
        assert!(text.starts_with("<|im_start|>system\nbe brief.<|im_end|>\n"));
        assert_eq!(one.ids, t.encode(&text, false).unwrap());
        // Only the repeated `<|im_end|>\n` piece is reused within turn 1.
        assert_eq!(one.cached, 2);

        turn.push(("assistant", "a prefix cache"));
        turn.push(("user", "and a prefix?"));
        let two = t.tokenize(ApiKind::Chat, &prompt(&turn)).unwrap();
        let text2 = t.render(&prompt(&turn)).unwrap();
        assert_eq!(two.ids, t.encode(&text2, false).unwrap());
        // Everything but the generation prompt of turn 1 is reused.
        assert!(
            two.cached >= one.ids.len() - 3,
            "{} of {}",
            two.cached,
            one.ids.len()
        );
        assert_eq!(two.ids[..one.ids.len() - 3], one.ids[..one.ids.len() - 3]);
        assert!(t.split_ok.load(Ordering::Relaxed));
    }

    #[test]
    fn first_piece_is_position_dependent() {
        let t = tokenizer();
        // "hello" at offset 0 gets the Metaspace prefix, after a special token it does not.
        let a = t.encode_split("hello<|im_start|>hello").unwrap();
        assert_eq!(a.ids, t.encode("hello<|im_start|>hello", false).unwrap());
        assert_ne!(a.ids[0], a.ids[2]);
        let b = t.encode_split("<|im_start|>hello").unwrap();
        assert_eq!(b.cached, 2, "the second piece of `a` is reused");
    }

    #[test]
    fn completions_add_special_tokens_and_content_parts_flatten() {
        let t = tokenizer();
        let p = serde_json::json!({"prompt": "hello world"});
        let ids = t
            .tokenize(ApiKind::Completion, p.as_object().unwrap())
            .unwrap()
            .ids;
        assert_eq!(ids, t.encode("hello world", true).unwrap());
        let parts = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]});
        let text = t.render(parts.as_object().unwrap()).unwrap();
        assert!(text.contains("hello\nworld"), "{text}");
    }

    #[test]
    fn template_errors_are_errors() {
        let t = HfTokenizer::new(
            &test_tokenizer_json(),
            Some("{{ raise_exception('roles must alternate') }}"),
            "",
            "",
            8,
        )
        .unwrap();
        let e = t
            .tokenize(ApiKind::Chat, &prompt(&[("user", "x")]))
            .unwrap_err();
        assert!(e.to_string().contains("roles must alternate"), "{e}");
        assert!(HfTokenizer::new(&test_tokenizer_json(), Some("{% if %}"), "", "", 8).is_err());
        assert!(HfTokenizer::new(b"{}", None, "", "", 8).is_err());
        let none = HfTokenizer::new(&test_tokenizer_json(), None, "", "", 8).unwrap();
        assert!(none.render(&prompt(&[("user", "x")])).is_err());
    }
}
