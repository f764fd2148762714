//! Precise routes' prompts to token ids, then to the token-block hashes the router scores.
//!
//! The filter sends a precise route's prompt fields as JSON (`RouteRequest.prompt_text`). The
//! control plane tokenises them like the engine will, either
//! - [`remote`]: by asking a healthy replica (vLLM's render or `/tokenize` API), or
//! - [`hf`] (feature `hf-tokenizer`): in process, with the model's `tokenizer.json` and chat
//!   template, caching each rendered segment so turn N of a chat only tokenises what is new,
//!
//! then hashes the ids in engine blocks with `scorer_core::hash::token_block_hashes`. Any failure
//! leaves the request approximate: its `block_hashes` still route it.

pub mod cache;
#[cfg(feature = "hf-tokenizer")]
pub mod hf;
pub mod kept;
pub mod remote;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use scorer_core::hash::{request_seed, token_block_hashes};
use scorer_core::protocol::{ApiKind, RouteRequest, RouteResponse};
use serde_json::{Map, Value};
use vllm_wire::agent_chat::{self, AgentChatError};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::{Config, TokenizerBackend};
use crate::state::State;
use cache::TokenCache;

/// Why a prompt could not be tokenised (the request is then routed approximately).
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// `prompt_text` is not a usable prompt object.
    #[error("bad prompt: {0}")]
    BadPrompt(String),
    /// No healthy replica to ask.
    #[error("no healthy endpoint to tokenise with")]
    NoEndpoint,
    /// The call to a replica failed.
    #[error("tokenize call failed: {0}")]
    Http(String),
    /// The replica refused.
    #[error("{endpoint} answered {status}: {body}")]
    Status {
        /// The replica asked.
        endpoint: String,
        /// Its HTTP status.
        status: u16,
        /// The start of its answer.
        body: String,
    },
    /// The replica's answer has no usable token ids.
    #[error("bad tokenize answer: {0}")]
    BadResponse(String),
    /// The call did not finish in time.
    #[error("tokenize call timed out after {0:?}")]
    Timeout(Duration),
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// The in-process tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The tokenizer files could not be loaded.
    #[error("cannot load tokenizer: {0}")]
    Load(String),
    /// The prompt is valid but its tokens depend on what the control plane cannot know (a
    /// stored history, a server setting): it is routed approximately.
    #[error("not tokenised here: {0}")]
    Unsupported(String),
}

/// The agent converter's refusals keep their kind: unsupported routes approximately without a
/// tokenisation error, a bad prompt is one.
impl From<AgentChatError> for TokenizeError {
    fn from(e: AgentChatError) -> Self {
        match e {
            AgentChatError::Unsupported(what) => Self::Unsupported(what),
            AgentChatError::BadPrompt(what) => Self::BadPrompt(what),
        }
    }
}

/// Token ids of one prompt and how many came from the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// How many of them were reused from earlier tokenisations.
    pub cached: usize,
}

enum Backend {
    None,
    /// Boxed: the hyper client is most of the enum's size, and most control planes have none.
    Remote(Box<remote::RemoteTokenizer>),
    #[cfg(feature = "hf-tokenizer")]
    Hf(std::sync::Arc<hf::HfTokenizer>),
}

/// Turns precise route requests into token-block hashes.
pub struct Precise {
    backend: Backend,
    /// Recent precise prompts, for `/debug/mismatch`'s diverging block ([`kept`]).
    kept: kept::KeptPrompts,
    /// Asks a replica's render API for its view of a kept prompt.
    render: remote::RemoteTokenizer,
    /// Whole-prompt cache of the remote backend.
    prompts: TokenCache,
    /// Configured base model names (hash seeds of blocks stored without LoRA).
    base_models: HashSet<String>,
    block_tokens: usize,
    max_hashes: usize,
}

impl std::fmt::Debug for Precise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Precise")
            .field("backend", &self.backend_name())
            .field("block_tokens", &self.block_tokens)
            .finish_non_exhaustive()
    }
}

impl Precise {
    /// The tokenizer and hashing settings of `config` (loads `hf` files now, so a bad path
    /// fails at startup).
    pub fn from_config(config: &Config) -> Result<Self, TokenizeError> {
        let p = &config.precise;
        let backend = match p.tokenizer {
            TokenizerBackend::None => Backend::None,
            TokenizerBackend::Remote => Backend::Remote(Box::new(remote::RemoteTokenizer::new(
                p.remote_api,
                Duration::from_millis(p.tokenize_timeout_ms),
            ))),
            #[cfg(feature = "hf-tokenizer")]
            TokenizerBackend::Hf => Backend::Hf(std::sync::Arc::new(hf::HfTokenizer::load(p)?)),
            #[cfg(not(feature = "hf-tokenizer"))]
            TokenizerBackend::Hf => {
                return Err(TokenizeError::Load(
                    "this build has no in-process tokenizer (cargo feature `hf-tokenizer`)".into(),
                ));
            }
        };
        Ok(Self {
            backend,
            kept: kept::KeptPrompts::default(),
            render: remote::RemoteTokenizer::new(
                crate::config::RemoteApi::Render,
                Duration::from_millis(p.tokenize_timeout_ms),
            ),
            prompts: TokenCache::new(p.cache_entries),
            base_models: config
                .endpoints
                .iter()
                .filter_map(|e| e.model.clone())
                .collect(),
            block_tokens: config.router.precise.block_tokens.max(1),
            max_hashes: config.max_block_hashes,
        })
    }

    /// `remote`, `hf` or `none`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::None => "none",
            Backend::Remote(_) => "remote",
            #[cfg(feature = "hf-tokenizer")]
            Backend::Hf(_) => "hf",
        }
    }

    /// Fills `request.token_block_hashes` (and the exact `prompt_tokens`) from its
    /// `prompt_text`, which is consumed. Returns how the request will be scored: `precise`, or
    /// why it stays approximate. `None` when the request did not ask for precise mode.
    pub async fn prepare(&self, state: &State, request: &mut RouteRequest) -> Option<&'static str> {
        self.prepare_kept(state, request).await.0
    }

    /// Routes `request` with `route` (the caller's call of the router, timed as it likes):
    /// prepares it first ([`Precise::prepare`], counting how it will be scored), and keeps a
    /// precise prompt for `/debug/mismatch` under the decision's id once it has one. What the
    /// route API and the Endpoint Picker both do with a route call.
    pub async fn route(
        &self,
        state: &State,
        request: &mut RouteRequest,
        route: impl FnOnce(&RouteRequest) -> RouteResponse,
    ) -> RouteResponse {
        let (how, kept) = self.prepare_kept(state, request).await;
        if let Some(how) = how {
            state.telemetry().count_precise_route(how);
        }
        let response = route(request);
        if let Some(kept) = kept.filter(|_| !response.endpoints.is_empty()) {
            self.kept.keep(response.decision_id, kept);
        }
        response
    }

    /// [`Precise::prepare`], also returning the tokenised prompt to keep once the decision has
    /// an id.
    async fn prepare_kept(
        &self,
        state: &State,
        request: &mut RouteRequest,
    ) -> (Option<&'static str>, Option<kept::KeptPrompt>) {
        let Some(text) = request.prompt_text.take() else {
            return (None, None);
        };
        if matches!(self.backend, Backend::None) {
            return (Some("no_tokenizer"), None);
        }
        if !state.any_event_stream() {
            return (Some("no_event_stream"), None);
        }
        let started = Instant::now();
        let result = self.tokenize_prompt(state, request.api, &text).await;
        let t = state.telemetry();
        let how = match result {
            Ok((tokenized, api, prompt)) => {
                t.observe_tokenize(
                    self.backend_name(),
                    "ok",
                    started.elapsed(),
                    tokenized.cached,
                    tokenized.ids.len() - tokenized.cached,
                );
                // Seeded like the engine's blocks: by model or adapter and the cache salt, which
                // KV events carry for block 0 (`vllm_wire::kv_events::cache_salt`).
                let seed = request_seed(
                    self.seed_model(state, &request.model),
                    request.cache_salt.as_deref(),
                );
                let mut hashes = token_block_hashes(seed, &tokenized.ids, self.block_tokens);
                hashes.truncate(self.max_hashes);
                request.token_block_hashes = hashes;
                request.prompt_tokens = u32::try_from(tokenized.ids.len()).unwrap_or(u32::MAX);
                let kept = kept::KeptPrompt {
                    api,
                    prompt,
                    ids: tokenized.ids,
                };
                return (Some("precise"), Some(kept));
            }
            // Not a failure: the prompt's tokens depend on what only the replica knows.
            Err(e @ TokenizeError::Unsupported(_)) => {
                tracing::debug!(error = %e, "routing approximately");
                Some("unsupported_prompt")
            }
            Err(e) => {
                t.observe_tokenize(self.backend_name(), "error", started.elapsed(), 0, 0);
                tracing::debug!(error = %e, "tokenisation failed: routing approximately");
                Some("tokenize_error")
            }
        };
        (how, None)
    }

    /// For a precise decision's mismatch record, the router's and the serving engine's token
    /// ids of the block where its delivered hit ended; `None` when the record is not precise
    /// or its prompt is no longer kept. Asks the replica's render API.
    pub async fn diverging_block(
        &self,
        record: &scorer_core::reuse::MismatchRecord,
    ) -> Option<kept::DivergingBlock> {
        if !record.precise {
            return None;
        }
        let prompt = self.kept.get(record.decision_id)?;
        let engine = self
            .render
            .render_at(&record.endpoint, &prompt)
            .await
            .map_err(|e| e.to_string());
        Some(kept::DivergingBlock::of(
            record.parting_block,
            record.block_tokens,
            &prompt.ids,
            engine,
        ))
    }

    /// Token ids of `prompt_text` (the request's prompt fields as a JSON object).
    pub async fn tokenize(
        &self,
        state: &State,
        api: Option<ApiKind>,
        prompt_text: &str,
    ) -> Result<Tokenized, TokenizeError> {
        self.tokenize_prompt(state, api, prompt_text)
            .await
            .map(|(tokenized, _, _)| tokenized)
    }

    /// [`Precise::tokenize`], with the API and prompt fields the ids are of (the agent APIs as
    /// the chat request vLLM makes of them).
    async fn tokenize_prompt(
        &self,
        state: &State,
        api: Option<ApiKind>,
        prompt_text: &str,
    ) -> Result<(Tokenized, ApiKind, Map<String, Value>), TokenizeError> {
        let prompt: Map<String, Value> = serde_json::from_str(prompt_text)
            .map_err(|e| TokenizeError::BadPrompt(format!("not a JSON object: {e}")))?;
        let api = match api {
            Some(a) => a,
            None if prompt.contains_key("messages") => ApiKind::Chat,
            None if prompt.contains_key("prompt") => ApiKind::Completion,
            None => return Err(TokenizeError::BadPrompt("no messages and no prompt".into())),
        };
        // The agent APIs are tokenised as the chat request vLLM turns them into.
        let converted = match api {
            ApiKind::Messages => Some(agent_chat::messages_to_chat(
                &prompt,
                self.merges_inline_system(),
            )?),
            ApiKind::Responses => Some(agent_chat::responses_to_chat(&prompt)?),
            ApiKind::Chat | ApiKind::Completion => None,
        };
        let (api, prompt, key_text) = match converted {
            Some(chat) => {
                let key_text = Value::Object(chat.clone()).to_string();
                (ApiKind::Chat, chat, std::borrow::Cow::Owned(key_text))
            }
            None => (api, prompt, std::borrow::Cow::Borrowed(prompt_text)),
        };
        match api {
            ApiKind::Chat if !prompt.get("messages").is_some_and(Value::is_array) => {
                return Err(TokenizeError::BadPrompt("messages must be an array".into()));
            }
            ApiKind::Completion => {
                // A prompt of token ids needs no tokenizer.
                if let Some(ids) = token_id_prompt(prompt.get("prompt")) {
                    return Ok((Tokenized { ids, cached: 0 }, api, prompt));
                }
                match prompt.get("prompt") {
                    Some(Value::String(_)) => {}
                    Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {}
                    _ => {
                        return Err(TokenizeError::BadPrompt(
                            "prompt must be a string, one string in a list, or token ids".into(),
                        ));
                    }
                }
            }
            _ => {}
        }
        match &self.backend {
            Backend::None => Err(TokenizeError::Load("no tokenizer configured".into())),
            Backend::Remote(r) => {
                let key = xxh3_64_with_seed(key_text.as_bytes(), api as u64);
                if let Some(ids) = self.prompts.get(key) {
                    let tokenized = Tokenized {
                        cached: ids.len(),
                        ids: ids.to_vec(),
                    };
                    return Ok((tokenized, api, prompt));
                }
                let ids = r.tokenize(state, api, &prompt).await?;
                self.prompts.insert(key, ids.clone().into());
                Ok((Tokenized { ids, cached: 0 }, api, prompt))
            }
            #[cfg(feature = "hf-tokenizer")]
            // CPU work (segment caching keeps it to each turn's new text): off the async
            // workers, so a long prompt does not stall other requests.
            Backend::Hf(h) => {
                let h = h.clone();
                tokio::task::spawn_blocking(move || {
                    h.tokenize(api, &prompt).map(|t| (t, api, prompt))
                })
                .await
                .map_err(|e| TokenizeError::Tokenizer(format!("tokenizer task: {e}")))?
            }
        }
    }

    /// Whether the model's chat template needs system messages first, so vLLM merges a
    /// Messages request's inline system messages into the leading one: known from the
    /// in-process template, unknown (`None`) behind a remote tokenizer.
    fn merges_inline_system(&self) -> Option<bool> {
        match &self.backend {
            #[cfg(feature = "hf-tokenizer")]
            Backend::Hf(h) => Some(h.merges_inline_system()),
            Backend::None | Backend::Remote(_) => None,
        }
    }

    /// The name whose seed the request's tokens are hashed with, matching how blocks from KV
    /// events are hashed: a configured base model or a LoRA adapter seen in events hashes
    /// under its own name; with no models configured, base-model blocks use the empty name.
    pub fn seed_model<'a>(&self, state: &State, model: &'a str) -> &'a str {
        if self.base_models.contains(model) || state.is_known_lora(model) {
            model
        } else if self.base_models.is_empty() {
            ""
        } else {
            // Not a configured base model: an adapter whose blocks have not been seen yet.
            model
        }
    }
}

/// `prompt` as token ids when it is a list of integers (or a list holding one such list).
fn token_id_prompt(prompt: Option<&Value>) -> Option<Vec<u32>> {
    let items = match prompt? {
        Value::Array(a) if a.len() == 1 && a[0].is_array() => a[0].as_array()?,
        Value::Array(a) => a,
        _ => return None,
    };
    if items.is_empty() {
        return None;
    }
    items
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EndpointConfig, PreciseSettings};
    use scorer_core::hash::model_seed;
    use serde_json::json;

    #[test]
    fn token_id_prompts() {
        let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert_eq!(token_id_prompt(Some(&v("[1,2]"))), Some(vec![1, 2]));
        assert_eq!(token_id_prompt(Some(&v("[[3]]"))), Some(vec![3]));
        assert_eq!(token_id_prompt(Some(&v("[]"))), None);
        assert_eq!(token_id_prompt(Some(&v("[\"a\"]"))), None);
        assert_eq!(token_id_prompt(Some(&v("[-1]"))), None);
        assert_eq!(token_id_prompt(Some(&v("\"text\""))), None);
    }

    fn config(models: bool, tokenizer: TokenizerBackend) -> Config {
        let endpoint = |a: &str| EndpointConfig {
            address: a.into(),
            model: models.then(|| "base".to_string()),
            ..Default::default()
        };
        Config {
            endpoints: vec![endpoint("10.0.0.1:80"), endpoint("10.0.0.2:80")],
            precise: PreciseSettings {
                tokenizer,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn state() -> State {
        State::new(
            Default::default(),
            &["10.0.0.1:80".to_string(), "10.0.0.2:80".to_string()],
            4,
            1,
        )
        .unwrap()
    }

    #[test]
    fn seeds_follow_the_events_naming() {
        let s = state();
        let with = Precise::from_config(&config(true, TokenizerBackend::None)).unwrap();
        assert_eq!(with.seed_model(&s, "base"), "base");
        assert_eq!(with.seed_model(&s, "adapter"), "adapter");
        let without = Precise::from_config(&config(false, TokenizerBackend::None)).unwrap();
        assert_eq!(without.seed_model(&s, "base"), "");
        let mut partial = true;
        s.apply_kv_batch(
            "10.0.0.1:80",
            "",
            &[scorer_core::precise::KvEvent::BlockStored {
                block_hashes: vec![1],
                parent_block_hash: None,
                token_ids: vec![0; 16],
                block_size: 16,
                lora_name: Some("adapter".into()),
                cache_salt: None,
                medium: scorer_core::precise::Medium::Gpu,
            }],
            0,
            &mut partial,
        );
        assert_eq!(without.seed_model(&s, "adapter"), "adapter");
    }

    #[tokio::test]
    async fn prepare_says_why_a_request_stays_approximate() {
        let s = state();
        let request = || RouteRequest {
            model: "base".into(),
            prompt_text: Some(r#"{"model":"base","prompt":[1,2,3]}"#.into()),
            ..Default::default()
        };
        let none = Precise::from_config(&config(true, TokenizerBackend::None)).unwrap();
        let mut r = request();
        assert_eq!(none.prepare(&s, &mut r).await, Some("no_tokenizer"));
        assert!(r.prompt_text.is_none() && r.token_block_hashes.is_empty());

        let remote = Precise::from_config(&config(true, TokenizerBackend::Remote)).unwrap();
        assert_eq!(
            remote.prepare(&s, &mut request()).await,
            Some("no_event_stream")
        );
        s.kv_stream("10.0.0.1:80", |st| st.connected = true);
        // Token-id prompts need no tokenizer call.
        let mut r = request();
        r.prompt_text = Some(format!(
            r#"{{"model":"base","prompt":{:?}}}"#,
            (0..40).collect::<Vec<u32>>()
        ));
        assert_eq!(remote.prepare(&s, &mut r).await, Some("precise"));
        assert_eq!(r.prompt_tokens, 40);
        let ids: Vec<u32> = (0..40).collect();
        assert_eq!(
            r.token_block_hashes,
            token_block_hashes(model_seed("base"), &ids, 16)
        );
        // A salted request's hashes carry its salt, as the engine's block 0 does.
        let mut salted = request();
        salted.prompt_text = Some(format!(r#"{{"model":"base","prompt":{ids:?}}}"#));
        salted.cache_salt = Some("tenant-a".into());
        assert_eq!(remote.prepare(&s, &mut salted).await, Some("precise"));
        assert_eq!(
            salted.token_block_hashes,
            token_block_hashes(request_seed("base", Some("tenant-a")), &ids, 16)
        );
        for bad in [
            r#"not json"#,
            r#"{"model":"base"}"#,
            r#"{"messages":3}"#,
            r#"{"prompt":{}}"#,
        ] {
            let mut r = request();
            r.prompt_text = Some(bad.into());
            assert_eq!(
                remote.prepare(&s, &mut r).await,
                Some("tokenize_error"),
                "{bad}"
            );
            assert!(r.token_block_hashes.is_empty());
        }
        assert!(
            remote
                .prepare(&s, &mut RouteRequest::default())
                .await
                .is_none(),
            "approximate requests are left alone"
        );
    }

    /// A precise control plane with the in-process tokenizer (the hf tests' tiny vocabulary
    /// and a ChatML template) and a live event stream.
    #[cfg(feature = "hf-tokenizer")]
    fn hf_precise(name: &str) -> (Precise, State) {
        let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (json, template) = (dir.join("tokenizer.json"), dir.join("chat.jinja"));
        std::fs::write(&json, hf::tests::test_tokenizer_json()).unwrap();
        std::fs::write(&template, hf::tests::CHATML).unwrap();
        let mut c = config(true, TokenizerBackend::Hf);
        c.precise.tokenizer_json = Some(json);
        c.precise.chat_template = Some(template);
        let precise = Precise::from_config(&c).unwrap();
        let s = state();
        s.kv_stream("10.0.0.1:80", |st| st.connected = true);
        (precise, s)
    }

    #[cfg(feature = "hf-tokenizer")]
    #[tokio::test]
    async fn agent_requests_hash_like_the_chat_request_vllm_makes_of_them() {
        let (precise, s) = hf_precise("agent-precise");
        let text = |n: usize| "hello world what is a cache and prefix ".repeat(n);
        let (system, first, answer, next) = (text(2), text(4), text(3), text(5));
        let chat = json!({"model": "base", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": first},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": next}]});
        let messages = json!({"model": "base",
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": first}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                {"role": "user", "content": [{"type": "text", "text": next,
                                              "cache_control": {"type": "ephemeral"}}]}]});
        let responses = json!({"model": "base", "instructions": system, "input": [
            {"role": "user", "content": first},
            {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
             "content": [{"type": "output_text", "text": answer, "annotations": []}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": next}]}]});
        let route = |api: ApiKind, body: &Value| RouteRequest {
            model: "base".into(),
            prompt_text: Some(body.to_string()),
            api: Some(api),
            ..Default::default()
        };
        let mut routed = Vec::new();
        for (api, body) in [
            (ApiKind::Chat, &chat),
            (ApiKind::Messages, &messages),
            (ApiKind::Responses, &responses),
        ] {
            let ids = precise
                .tokenize(&s, Some(api), &body.to_string())
                .await
                .unwrap()
                .ids;
            let mut r = route(api, body);
            assert_eq!(
                precise.prepare(&s, &mut r).await,
                Some("precise"),
                "{api:?}"
            );
            routed.push((ids, r.token_block_hashes, r.prompt_tokens));
        }
        let (chat_ids, chat_hashes, chat_tokens) = &routed[0];
        assert!(chat_hashes.len() >= 4, "{} tokens", chat_ids.len());
        for (api, (ids, hashes, tokens)) in ["messages", "responses"].iter().zip(&routed[1..]) {
            assert_eq!(ids, chat_ids, "{api}");
            assert_eq!(hashes, chat_hashes, "{api}");
            assert_eq!(tokens, chat_tokens, "{api}");
        }
        // A continued Responses chain's history is on a replica: approximate, not an error.
        let mut chained = route(
            ApiKind::Responses,
            &json!({"model": "base", "input": "more", "previous_response_id": "resp_1"}),
        );
        assert_eq!(
            precise.prepare(&s, &mut chained).await,
            Some("unsupported_prompt")
        );
        assert!(chained.token_block_hashes.is_empty());
        let mut broken = route(ApiKind::Messages, &json!({"model": "base", "messages": 3}));
        assert_eq!(
            precise.prepare(&s, &mut broken).await,
            Some("tokenize_error")
        );
    }
}
