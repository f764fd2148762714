//! Prompt canonicalisation: turns an OpenAI-style or Anthropic request body into one byte string
//! whose prefixes are stable across the turns of a conversation.
//!
//! Turn N+1 of a chat repeats turn N's messages and appends new ones, so the canonical bytes of
//! turn N are a byte prefix of turn N+1's. Tool definitions come first because chat templates
//! render them into the system prompt. Separators are control bytes that JSON strings rarely
//! carry, so `("ab","c")` and `("a","bc")` differ.
//!
//! Every API is reduced to the same records (role, name, content): a Responses `input` item or
//! an Anthropic content block becomes what its template renders, never its raw JSON where that
//! carries fields a client changes between turns (Anthropic's `cache_control` markers move to
//! the newest message on every turn; Responses output items gain an `id` and a `status`).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::protocol::ApiKind;

mod agent;

/// Separates the fields of one message (role, name, content).
pub(crate) const FIELD_SEP: u8 = 0x1f;
/// Ends one message (or one tool definition block).
pub(crate) const RECORD_SEP: u8 = 0x1e;

/// Why a body could not be canonicalised. The filter fails open on every variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonError {
    /// The body is not valid JSON or has the wrong shape for its API.
    #[error("invalid request body: {0}")]
    InvalidBody(String),
    /// A chat body without `messages`, or a completion body without `prompt`.
    #[error("request has no prompt")]
    MissingPrompt,
}

/// The routing-relevant view of one request body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CanonicalPrompt {
    /// The `model` field ("" when absent: vLLM then serves its only model).
    pub model: String,
    /// Canonical prompt bytes; hashed in blocks.
    pub bytes: Vec<u8>,
    /// `stream` of the request.
    pub stream: bool,
    /// `max_tokens`, `max_completion_tokens` or (Responses) `max_output_tokens`.
    pub max_output_tokens: Option<u32>,
    /// The body's own session key, in this order: `prompt_cache_key` (OpenAI), the session of
    /// Anthropic's `metadata.user_id`, `safety_identifier`, `user`. Headers come before it.
    pub session_hint: Option<String>,
    /// Responses `previous_response_id`: the stored response this request continues.
    pub previous_response_id: Option<String>,
    /// Whether an Anthropic block carries a `cache_control` marker: the client asks for the
    /// prefix up to it to stay cached.
    pub cache_control: bool,
    /// vLLM's `cache_salt`: it keys the prompt's cached blocks, so only requests with the same
    /// salt share them. `None` when absent or `null`; a non-string or empty salt (which vLLM
    /// answers with 400) makes the body invalid, and the filter fails open.
    pub cache_salt: Option<String>,
}

impl CanonicalPrompt {
    /// Rough token count: 4 bytes a token is close for English BPE vocabularies.
    pub fn estimated_tokens(&self) -> u32 {
        u32::try_from(self.bytes.len().div_ceil(4)).unwrap_or(u32::MAX)
    }
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    safety_identifier: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_call_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ContentPart<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

/// Canonicalises `body` for `api`. Pure and allocation-light: strings are borrowed when they
/// carry no escapes.
pub fn canonicalize(api: ApiKind, body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    match api {
        ApiKind::Chat => canonicalize_chat(body),
        ApiKind::Completion => canonicalize_completion(body),
        ApiKind::Responses => agent::canonicalize_responses(body),
        ApiKind::Messages => agent::canonicalize_messages(body),
    }
}

/// The first non-empty of `keys`, owned: a body's session key by precedence.
pub(crate) fn first_key<const N: usize>(keys: [Option<Cow<'_, str>>; N]) -> Option<String> {
    keys.into_iter()
        .flatten()
        .find(|k| !k.is_empty())
        .map(Cow::into_owned)
}

/// Appends one record: `role`, the name field, then `content` pushed by the caller.
pub(crate) fn push_record(
    out: &mut Vec<u8>,
    role: &str,
    name: &str,
    content: impl FnOnce(&mut Vec<u8>),
) {
    out.extend_from_slice(role.as_bytes());
    out.push(FIELD_SEP);
    out.extend_from_slice(name.as_bytes());
    out.push(FIELD_SEP);
    content(out);
    out.push(RECORD_SEP);
}

pub(crate) fn invalid(e: serde_json::Error) -> CanonError {
    CanonError::InvalidBody(e.to_string())
}

fn canonicalize_chat(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: ChatBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
    let messages = parsed.messages.ok_or(CanonError::MissingPrompt)?;
    let mut out = Vec::with_capacity(body.len());
    if let Some(tools) = parsed.tools {
        push_tools(&mut out, tools.get().as_bytes());
    }
    for message in &messages {
        out.extend_from_slice(message.role.as_deref().unwrap_or("").as_bytes());
        out.push(FIELD_SEP);
        if let Some(name) = &message.name {
            out.extend_from_slice(name.as_bytes());
        }
        out.push(FIELD_SEP);
        if let Some(content) = message.content {
            push_content(&mut out, content)?;
        }
        if let Some(calls) = message.tool_calls {
            out.push(FIELD_SEP);
            out.extend_from_slice(calls.get().as_bytes());
        }
        if let Some(id) = &message.tool_call_id {
            out.push(FIELD_SEP);
            out.extend_from_slice(id.as_bytes());
        }
        out.push(RECORD_SEP);
    }
    Ok(CanonicalPrompt {
        model: parsed.model.map(Cow::into_owned).unwrap_or_default(),
        bytes: out,
        stream: parsed.stream.unwrap_or(false),
        max_output_tokens: parsed.max_completion_tokens.or(parsed.max_tokens),
        session_hint: first_key([
            parsed.prompt_cache_key,
            parsed.safety_identifier,
            parsed.user,
        ]),
        cache_salt: salt(parsed.cache_salt)?,
        ..CanonicalPrompt::default()
    })
}

/// The tools record every API starts with (templates render tools into the system prompt).
pub(crate) fn push_tools(out: &mut Vec<u8>, tools: &[u8]) {
    out.extend_from_slice(b"tools");
    out.push(FIELD_SEP);
    out.extend_from_slice(tools);
    out.push(RECORD_SEP);
}

/// The request's `cache_salt`, held to vLLM's rule: absent or null is no salt, anything but a
/// non-empty string is refused. (A non-string already failed to deserialise.)
pub(crate) fn salt(raw: Option<Cow<'_, str>>) -> Result<Option<String>, CanonError> {
    match raw {
        None => Ok(None),
        Some(s) if s.is_empty() => Err(CanonError::InvalidBody(
            "cache_salt must be a non-empty string".into(),
        )),
        Some(s) => Ok(Some(s.into_owned())),
    }
}

/// Appends a message's content: a string, or an array of parts (text parts as text, other parts
/// such as images by their JSON, so two different images never share a hash).
fn push_content(out: &mut Vec<u8>, content: &RawValue) -> Result<(), CanonError> {
    let raw = content.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            let text: Cow<'_, str> = serde_json::from_str(raw).map_err(invalid)?;
            out.extend_from_slice(text.as_bytes());
        }
        Some(b'[') => {
            let parts: Vec<&RawValue> = serde_json::from_str(raw).map_err(invalid)?;
            for part in parts {
                let head: ContentPart<'_> = serde_json::from_str(part.get()).map_err(invalid)?;
                match (head.kind.as_deref(), head.text) {
                    (Some("text") | None, Some(text)) => out.extend_from_slice(text.as_bytes()),
                    _ => out.extend_from_slice(part.get().as_bytes()),
                }
                out.push(FIELD_SEP);
            }
        }
        Some(b'n') => {}
        _ => {
            return Err(CanonError::InvalidBody(
                "message content must be a string, an array or null".into(),
            ));
        }
    }
    Ok(())
}

fn canonicalize_completion(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: CompletionBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
    let prompt = parsed.prompt.ok_or(CanonError::MissingPrompt)?;
    let raw = prompt.get();
    let mut out = Vec::with_capacity(raw.len());
    match raw.as_bytes().first() {
        Some(b'"') => {
            let text: Cow<'_, str> = serde_json::from_str(raw).map_err(invalid)?;
            out.extend_from_slice(text.as_bytes());
        }
        Some(b'[') => push_prompt_array(&mut out, raw)?,
        _ => {
            return Err(CanonError::InvalidBody(
                "prompt must be a string or an array".into(),
            ));
        }
    }
    Ok(CanonicalPrompt {
        model: parsed.model.map(Cow::into_owned).unwrap_or_default(),
        bytes: out,
        stream: parsed.stream.unwrap_or(false),
        max_output_tokens: parsed.max_tokens,
        session_hint: first_key([parsed.user]),
        cache_salt: salt(parsed.cache_salt)?,
        ..CanonicalPrompt::default()
    })
}

/// A prompt array is either token ids (hashed as little-endian u32) or a batch of strings
/// (joined with record separators).
fn push_prompt_array(out: &mut Vec<u8>, raw: &str) -> Result<(), CanonError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum PromptArray<'a> {
        Tokens(Vec<u32>),
        #[serde(borrow)]
        Texts(Vec<Cow<'a, str>>),
    }
    match serde_json::from_str::<PromptArray<'_>>(raw).map_err(invalid)? {
        PromptArray::Tokens(tokens) => {
            for token in tokens {
                out.extend_from_slice(&token.to_le_bytes());
            }
        }
        PromptArray::Texts(texts) => {
            for text in texts {
                out.extend_from_slice(text.as_bytes());
                out.push(RECORD_SEP);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> CanonicalPrompt {
        canonicalize(ApiKind::Chat, body.as_bytes()).unwrap()
    }

    #[test]
    fn later_turn_extends_earlier_turn() {
        let t1 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#,
        );
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"},
            {"role":"assistant","content":"hello"},{"role":"user","content":"more"}],"stream":true}"#,
        );
        assert!(t2.bytes.starts_with(&t1.bytes));
        assert!(t2.stream);
        assert_eq!(t1.model, "m");
    }

    #[test]
    fn text_parts_equal_plain_string_and_images_count() {
        let plain = chat(r#"{"messages":[{"role":"user","content":"abc"}]}"#);
        let parts =
            chat(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"abc"}]}]}"#);
        assert!(
            parts
                .bytes
                .starts_with(&plain.bytes[..plain.bytes.len() - 1])
        );
        let img1 = chat(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}}]}]}"#,
        );
        let img2 = chat(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"b"}}]}]}"#,
        );
        assert_ne!(img1.bytes, img2.bytes);
    }

    #[test]
    fn tools_and_tool_calls_are_part_of_the_prompt() {
        let a = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        );
        let b = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"g"}}]}"#,
        );
        assert_ne!(a.bytes, b.bytes);
        let c = chat(
            r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","content":"r"}]}"#,
        );
        assert!(!c.bytes.is_empty());
    }

    #[test]
    fn escapes_are_decoded() {
        let a = chat(r#"{"messages":[{"role":"user","content":"a\u0062c"}]}"#);
        let b = chat(r#"{"messages":[{"role":"user","content":"abc"}]}"#);
        assert_eq!(a.bytes, b.bytes);
    }

    #[test]
    fn completion_prompt_shapes() {
        let s = canonicalize(
            ApiKind::Completion,
            br#"{"model":"m","prompt":"hello","max_tokens":5}"#,
        )
        .unwrap();
        assert_eq!(s.bytes, b"hello");
        assert_eq!(s.max_output_tokens, Some(5));
        let t = canonicalize(ApiKind::Completion, br#"{"prompt":[1,2]}"#).unwrap();
        assert_eq!(t.bytes, [1, 0, 0, 0, 2, 0, 0, 0]);
        let b = canonicalize(ApiKind::Completion, br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(b.bytes, b"a\x1eb\x1e");
    }

    #[test]
    fn cache_salt_is_extracted_and_bad_salts_are_invalid() {
        let salted = chat(r#"{"messages":[{"role":"user","content":"x"}],"cache_salt":"t\u0031"}"#);
        assert_eq!(salted.cache_salt.as_deref(), Some("t1"));
        let plain = chat(r#"{"messages":[{"role":"user","content":"x"}],"cache_salt":null}"#);
        assert_eq!(plain.cache_salt, None);
        assert_eq!(salted.bytes, plain.bytes, "the salt is not prompt text");
        let c = canonicalize(ApiKind::Completion, br#"{"prompt":"p","cache_salt":"s"}"#).unwrap();
        assert_eq!(c.cache_salt.as_deref(), Some("s"));
        for body in [
            r#"{"messages":[],"cache_salt":""}"#,
            r#"{"messages":[],"cache_salt":5}"#,
            r#"{"messages":[],"cache_salt":["s"]}"#,
        ] {
            assert!(
                matches!(
                    canonicalize(ApiKind::Chat, body.as_bytes()),
                    Err(CanonError::InvalidBody(_))
                ),
                "{body}"
            );
        }
        assert!(canonicalize(ApiKind::Completion, br#"{"prompt":"p","cache_salt":""}"#).is_err());
    }

    #[test]
    fn bad_bodies_are_errors_not_panics() {
        for body in [
            "",
            "{",
            "[]",
            "{\"messages\":5}",
            "{\"messages\":[{\"content\":5}]}",
            "\u{0}",
        ] {
            assert!(
                canonicalize(ApiKind::Chat, body.as_bytes()).is_err(),
                "{body}"
            );
        }
        assert_eq!(
            canonicalize(ApiKind::Chat, b"{}"),
            Err(CanonError::MissingPrompt)
        );
        assert!(canonicalize(ApiKind::Completion, br#"{"prompt":5}"#).is_err());
        assert!(canonicalize(ApiKind::Chat, &[0xff, 0xfe]).is_err());
    }
}
