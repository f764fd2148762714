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

use serde_json::value::RawValue;

use crate::protocol::ApiKind;

mod agent;
mod fast;
mod json;

use json::{Content, Field, Limit, fragment, json_object, parse, str_of};

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
    /// `max_tokens`, `max_completion_tokens` or (Responses) `max_output_tokens`, saturated to
    /// `0..=u32::MAX` (a limit beyond it still says "long"); `None` when absent or not a number.
    pub max_output_tokens: Option<u32>,
    /// The body's own session key, in this order: `prompt_cache_key` (OpenAI), the session of
    /// Anthropic's `metadata.user_id`, `safety_identifier`, `user`. Headers come before it.
    pub session_hint: Option<String>,
    /// Responses `previous_response_id`: the stored response this request continues.
    pub previous_response_id: Option<String>,
    /// Canonical bytes up to the end of the last Anthropic block (or tool) that carries a
    /// `cache_control` marker, 0 when none does: the client declares that prefix worth keeping
    /// (it will send it again), so the router holds it where it is cached more firmly than an
    /// unmarked prefix (`router.cache_control`). Markers in tools count up to the tools' end.
    pub marked_bytes: usize,
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

json_object! {
    struct ChatBody<'a> {
        "model" => model: Cow<'a, str>,
        "messages" => messages: Vec<Message<'a>>,
        "tools" => tools: &'a RawValue,
        "stream" => stream: bool,
        "max_tokens" => max_tokens: Limit,
        "max_completion_tokens" => max_completion_tokens: Limit,
        "user" => user: Cow<'a, str>,
        "prompt_cache_key" => prompt_cache_key: Cow<'a, str>,
        "safety_identifier" => safety_identifier: Cow<'a, str>,
        "cache_salt" => cache_salt: Cow<'a, str>,
    }
}

json_object! {
    struct Message<'a> {
        "role" => role: Cow<'a, str>,
        "name" => name: Cow<'a, str>,
        "content" => content: Content<'a>,
        "tool_calls" => tool_calls: &'a RawValue,
        "tool_call_id" => tool_call_id: Cow<'a, str>,
    }
}

json_object! {
    struct ContentPart<'a> {
        "type" => kind: Cow<'a, str>,
        "text" => text: Cow<'a, str>,
    }
}

json_object! {
    struct CompletionBody<'a> {
        "model" => model: Cow<'a, str>,
        "prompt" => prompt: &'a RawValue,
        "stream" => stream: bool,
        "max_tokens" => max_tokens: Limit,
        "user" => user: Cow<'a, str>,
        "cache_salt" => cache_salt: Cow<'a, str>,
    }
}

/// `json.loads` reads bytes as `utf-8-sig`.
const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// Canonicalises `body` for `api` as vLLM reads it (module `json`: duplicate keys, `NaN`, lone
/// surrogates and the rest of what Python's `json` takes). Pure and allocation-light: strings
/// are borrowed when they carry no escapes.
pub fn canonicalize(api: ApiKind, body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    canonicalize_reading(api, body, Reading::ByHandFirst)
}

/// [`canonicalize`] with every body read by serde: the reference the hand reader of plain
/// chat bodies must agree with (its tests and the `canonicalize` fuzz target compare them).
#[doc(hidden)]
pub fn canonicalize_with_serde(api: ApiKind, body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    canonicalize_reading(api, body, Reading::Serde)
}

/// Who reads a chat body.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// The hand reader ([`fast`]) when it is certain, serde otherwise.
    ByHandFirst,
    /// serde alone.
    Serde,
}

fn canonicalize_reading(
    api: ApiKind,
    body: &[u8],
    reading: Reading,
) -> Result<CanonicalPrompt, CanonError> {
    let body = body.strip_prefix(UTF8_BOM).unwrap_or(body);
    match canonicalize_strict(api, body, reading) {
        // A second read only for a body serde_json refused, and only when it had something
        // Python takes: valid bodies never pay for it.
        Err(CanonError::InvalidBody(e)) => match json::python_compat(body) {
            Some(body) => canonicalize_strict(api, &body, reading),
            None => Err(CanonError::InvalidBody(e)),
        },
        other => other,
    }
}

fn canonicalize_strict(
    api: ApiKind,
    body: &[u8],
    reading: Reading,
) -> Result<CanonicalPrompt, CanonError> {
    match api {
        ApiKind::Chat => canonicalize_chat(body, reading),
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

/// The output-length hint: `max_completion_tokens` when it is a number, else `max_tokens`.
pub(crate) fn limit(fields: impl IntoIterator<Item = Field<Limit>>) -> Option<u32> {
    fields.into_iter().find_map(|f| match f {
        Field::Value(Limit(n)) => n,
        _ => None,
    })
}

/// The fields every API's prompt starts from: its model (`""` when absent), its canonical bytes
/// and whether it streams; each API adds its own output limit and session keys.
pub(crate) fn prompt_of(
    model: Field<Cow<'_, str>>,
    stream: Field<bool>,
    bytes: Vec<u8>,
) -> Result<CanonicalPrompt, CanonError> {
    Ok(CanonicalPrompt {
        model: model.get("model")?.map(Cow::into_owned).unwrap_or_default(),
        bytes,
        stream: stream.get("stream")?.unwrap_or(false),
        ..CanonicalPrompt::default()
    })
}

fn canonicalize_chat(body: &[u8], reading: Reading) -> Result<CanonicalPrompt, CanonError> {
    let by_hand = match reading {
        Reading::ByHandFirst => fast::chat(body),
        Reading::Serde => None,
    };
    let parsed = match by_hand {
        Some(parsed) => parsed,
        None => parse(body, "the body")?,
    };
    chat_prompt(parsed, body.len())
}

/// A chat body's prompt, however it was read (`capacity`: the body's length, which the
/// canonical bytes rarely exceed).
fn chat_prompt(parsed: ChatBody<'_>, capacity: usize) -> Result<CanonicalPrompt, CanonError> {
    let messages = parsed
        .messages
        .get("messages")?
        .ok_or(CanonError::MissingPrompt)?;
    let mut out = Vec::with_capacity(capacity);
    if let Some(tools) = parsed.tools.get("tools")? {
        push_tools(&mut out, tools.get().as_bytes());
    }
    for message in messages {
        out.extend_from_slice(
            message
                .role
                .get("role")?
                .as_deref()
                .unwrap_or("")
                .as_bytes(),
        );
        out.push(FIELD_SEP);
        if let Some(name) = message.name.get("name")? {
            out.extend_from_slice(name.as_bytes());
        }
        out.push(FIELD_SEP);
        if let Some(content) = message.content.get("content")? {
            push_content(&mut out, content)?;
        }
        if let Some(calls) = message.tool_calls.get("tool_calls")? {
            out.push(FIELD_SEP);
            out.extend_from_slice(calls.get().as_bytes());
        }
        if let Some(id) = message.tool_call_id.get("tool_call_id")? {
            out.push(FIELD_SEP);
            out.extend_from_slice(id.as_bytes());
        }
        out.push(RECORD_SEP);
    }
    Ok(CanonicalPrompt {
        max_output_tokens: limit([parsed.max_completion_tokens, parsed.max_tokens]),
        session_hint: first_key([
            parsed.prompt_cache_key.get("prompt_cache_key")?,
            parsed.safety_identifier.get("safety_identifier")?,
            parsed.user.get("user")?,
        ]),
        cache_salt: salt(parsed.cache_salt)?,
        ..prompt_of(parsed.model, parsed.stream, out)?
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
/// non-empty string is refused.
pub(crate) fn salt(raw: Field<Cow<'_, str>>) -> Result<Option<String>, CanonError> {
    match raw.get("cache_salt")? {
        None => Ok(None),
        Some(s) if s.is_empty() => Err(CanonError::InvalidBody(
            "cache_salt must be a non-empty string".into(),
        )),
        Some(s) => Ok(Some(s.into_owned())),
    }
}

/// Appends a message's content: a string, or an array of parts (text parts as text, other parts
/// such as images by their JSON, so two different images never share a hash).
fn push_content(out: &mut Vec<u8>, content: Content<'_>) -> Result<(), CanonError> {
    match content {
        Content::Text(text) => out.extend_from_slice(&text),
        Content::Parts(parts) => {
            for part in parts {
                let head: ContentPart<'_> = fragment(part.get(), "a content part")?;
                match (head.kind.get("type")?.as_deref(), head.text.get("text")?) {
                    (Some("text") | None, Some(text)) => out.extend_from_slice(text.as_bytes()),
                    _ => out.extend_from_slice(part.get().as_bytes()),
                }
                out.push(FIELD_SEP);
            }
        }
    }
    Ok(())
}

fn canonicalize_completion(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: CompletionBody<'_> = parse(body, "the body")?;
    let prompt = parsed
        .prompt
        .get("prompt")?
        .ok_or(CanonError::MissingPrompt)?;
    let raw = prompt.get();
    let mut out = Vec::with_capacity(raw.len());
    match raw.as_bytes().first() {
        Some(b'"') => out.extend_from_slice(str_of(raw)?.as_bytes()),
        Some(b'[') => push_prompt_array(&mut out, raw)?,
        _ => {
            return Err(CanonError::InvalidBody(
                "prompt must be a string or an array".into(),
            ));
        }
    }
    Ok(CanonicalPrompt {
        max_output_tokens: limit([parsed.max_tokens]),
        session_hint: first_key([parsed.user.get("user")?]),
        cache_salt: salt(parsed.cache_salt)?,
        ..prompt_of(parsed.model, parsed.stream, out)?
    })
}

/// A prompt array is either token ids (hashed as little-endian u32) or a batch of strings
/// (joined with record separators), told apart by its first element.
fn push_prompt_array(out: &mut Vec<u8>, raw: &str) -> Result<(), CanonError> {
    let first = raw.bytes().skip(1).find(|b| !b.is_ascii_whitespace());
    if first == Some(b'"') {
        let texts: Vec<Cow<'_, str>> = fragment(raw, "prompt")?;
        for text in texts {
            out.extend_from_slice(text.as_bytes());
            out.push(RECORD_SEP);
        }
    } else {
        let tokens: Vec<u32> = serde_json::from_str(raw).map_err(json::invalid)?;
        for token in tokens {
            out.extend_from_slice(&token.to_le_bytes());
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

    /// `odd` canonicalises exactly as `plain`, the body vLLM reads it as.
    fn both(api: ApiKind, odd: &[u8], plain: &str) {
        let odd = canonicalize(api, odd)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(odd)));
        assert_eq!(odd, canonicalize(api, plain.as_bytes()).unwrap(), "{plain}");
    }

    // Content is read as bytes (serde_json's unchecked path, for speed) and checked here: what
    // the checked read refused is still refused, with the two exceptions `check_text` names.
    #[test]
    fn content_read_as_bytes_is_checked_as_strings_were() {
        let chat = |content: &[u8]| {
            let mut body = br#"{"model":"m","messages":[{"role":"user","content":"#.to_vec();
            body.extend_from_slice(content);
            body.extend_from_slice(b"}]}");
            canonicalize(ApiKind::Chat, &body)
        };
        // Text, escaped or not, ASCII or not, reads as its characters.
        both(
            ApiKind::Chat,
            br#"{"messages":[{"role":"user","content":"\u041f\u0440\u0438 \"q\"\n\u00e9"}]}"#,
            "{\"messages\":[{\"role\":\"user\",\"content\":\"\u{41f}\u{440}\u{438} \\\"q\\\"\\n\u{e9}\"}]}",
        );
        assert!(chat(br#"null"#).is_ok(), "null is no content");
        for refused in [
            &b"\"a\x01b\""[..],   // a raw control character
            b"\"a\tb\"",          // even a tab
            b"\"a\xc3\x28\"",     // not UTF-8
            b"\"a\xc3\x28\\\"\"", // not UTF-8 beside an escape
        ] {
            assert!(
                chat(refused).is_err(),
                "{}",
                String::from_utf8_lossy(refused)
            );
        }
        // A raw surrogate beside an escape is still Python's (`python_compat`): U+FFFD.
        let surrogate = chat(b"\"a\xed\xa0\x80b\\\"\"").unwrap();
        assert_eq!(surrogate, chat("\"a\u{fffd}b\\\"\"".as_bytes()).unwrap());
        // Not checked: a raw control character in a string that also has escapes (the body
        // is invalid JSON either way; the engine refuses it).
        assert!(chat(b"\"a\x01\\nb\"").is_ok());
        // A wrong type fails the body at once, even with a later duplicate.
        let mut dup = br#"{"messages":[{"role":"user","content":5,"content":"x"}]}"#.to_vec();
        assert!(canonicalize(ApiKind::Chat, &dup).is_err());
        dup = br#"{"messages":[{"role":"user","content":null,"content":"x"}]}"#.to_vec();
        assert!(canonicalize(ApiKind::Chat, &dup).is_ok());
    }

    #[test]
    fn duplicate_keys_keep_the_last_value_at_every_level() {
        // Python's dict: the last duplicate wins, also over an earlier one of the wrong type.
        both(
            ApiKind::Chat,
            br#"{"model":"a","messages":[{"role":"user","content":"old"}],"max_tokens":5,
                "model":"b","stream":true,"stream":false,"max_tokens":9,"user":7,"user":"u",
                "messages":[{"role":7,"role":"user","content":"x","content":"hi",
                  "name":"n"},{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}]}"#,
            r#"{"model":"b","stream":false,"max_tokens":9,"user":"u",
                "messages":[{"role":"user","content":"hi","name":"n"},
                  {"role":"user","content":[{"type":"text","text":"b"}]}]}"#,
        );
        both(
            ApiKind::Chat,
            br#"{"model":5,"messages":"x","model":"m","messages":[{"role":"user","content":"x"}],
                "cache_salt":"","cache_salt":"s","max_completion_tokens":1,"max_completion_tokens":2}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":"s",
                "max_completion_tokens":2}"#,
        );
        both(
            ApiKind::Completion,
            br#"{"prompt":"a","model":"m","prompt":["b","c"],"max_tokens":1,"max_tokens":3}"#,
            r#"{"model":"m","prompt":["b","c"],"max_tokens":3}"#,
        );
        // The last one decides validity too.
        assert!(
            canonicalize(
                ApiKind::Chat,
                br#"{"messages":[],"cache_salt":"s","cache_salt":""}"#
            )
            .is_err()
        );
        assert_eq!(
            canonicalize(ApiKind::Chat, br#"{"messages":[],"messages":null}"#),
            Err(CanonError::MissingPrompt)
        );
    }

    #[test]
    fn lone_surrogates_read_as_replacement_characters() {
        // Python keeps a lone surrogate (escaped, or raw through `surrogatepass`); the filter
        // reads each as U+FFFD, the same way every time. Pairs stay pairs.
        let plain = r#"{"model":"m\ufffd","messages":[{"role":"user","content":"x\ufffdy\ufffd\ud83e\udd80 \ufffd"},
            {"role":"user","content":[{"type":"text","text":"\ufffd"}]}],"user":"\ufffd"}"#;
        let escaped = br#"{"model":"m\ud800","messages":[{"role":"user","content":"x\uDBFFy\udc00\ud83e\udd80 \ud800"},
            {"role":"user","content":[{"type":"text","text":"\udfff"}]}],"user":"\ud800"}"#;
        both(ApiKind::Chat, escaped, plain);
        assert_eq!(
            canonicalize(ApiKind::Chat, escaped),
            canonicalize(ApiKind::Chat, escaped),
            "deterministic"
        );
        // A lead followed by another lead: the first is lone, the second pairs.
        both(
            ApiKind::Chat,
            br#"{"messages":[{"role":"user","content":"\ud800\ud83e\udd80"}]}"#,
            r#"{"messages":[{"role":"user","content":"\ufffd🦀"}]}"#,
        );
        // Raw (UTF-8 encoded) surrogates, as Python's `surrogatepass` decodes them.
        let mut raw = br#"{"messages":[{"role":"user","content":"a"#.to_vec();
        raw.extend_from_slice(&[0xed, 0xa0, 0x80, b'b']);
        raw.extend_from_slice(br#""}]}"#);
        both(
            ApiKind::Chat,
            &raw,
            r#"{"messages":[{"role":"user","content":"a\ufffdb"}]}"#,
        );
        // In a key, and in a completion prompt.
        both(
            ApiKind::Chat,
            br#"{"x\ud800":1,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        );
        both(
            ApiKind::Completion,
            br#"{"prompt":["\ud800","b"]}"#,
            r#"{"prompt":["\ufffd","b"]}"#,
        );
        // Other invalid UTF-8 stays invalid (Python refuses it too).
        let mut bad = br#"{"messages":[{"role":"user","content":"a"#.to_vec();
        bad.extend_from_slice(&[0xc3, 0x28]);
        bad.extend_from_slice(br#""}]}"#);
        assert!(canonicalize(ApiKind::Chat, &bad).is_err());
    }

    #[test]
    fn python_number_literals_read_as_null() {
        both(
            ApiKind::Chat,
            br#"{"messages":[{"role":"user","content":"NaN Infinity"}],"temperature":NaN,
                "top_p":Infinity,"logit_bias":{"1":-Infinity},"max_tokens":NaN}"#,
            r#"{"messages":[{"role":"user","content":"NaN Infinity"}]}"#,
        );
        both(
            ApiKind::Completion,
            br#"{"prompt":"p","temperature":-Infinity,"max_tokens":4}"#,
            r#"{"prompt":"p","max_tokens":4}"#,
        );
        // Still JSON syntax errors otherwise.
        assert!(canonicalize(ApiKind::Chat, br#"{"messages":[],"t":nan}"#).is_err());
        assert!(canonicalize(ApiKind::Chat, br#"{"messages":[],"t":NaNa}"#).is_err());
    }

    #[test]
    fn output_limits_of_any_size_or_form_saturate() {
        let limit = |v: &str| {
            let body =
                format!(r#"{{"messages":[{{"role":"user","content":"x"}}],"max_tokens":{v}}}"#);
            let p = canonicalize(ApiKind::Chat, body.as_bytes()).unwrap();
            assert_eq!(
                p.bytes,
                chat(r#"{"messages":[{"role":"user","content":"x"}]}"#).bytes
            );
            p.max_output_tokens
        };
        for (v, want) in [
            ("1099511627776", Some(u32::MAX)),
            ("184467440737095516160000", Some(u32::MAX)),
            ("1e400", Some(u32::MAX)),
            ("4294967295", Some(u32::MAX)),
            ("4294967296", Some(u32::MAX)),
            ("-5", Some(0)),
            ("5.0", Some(5)),
            ("5.9", Some(5)),
            ("1e3", Some(1000)),
            ("1E+3", Some(1000)),
            ("\"7\"", Some(7)),
            ("null", None),
            ("\"many\"", None),
            ("true", None),
            ("[1]", None),
            ("{\"a\":1}", None),
        ] {
            assert_eq!(limit(v), want, "max_tokens: {v}");
        }
        let p = canonicalize(
            ApiKind::Chat,
            br#"{"messages":[],"max_tokens":3,"max_completion_tokens":99999999999999}"#,
        )
        .unwrap();
        assert_eq!(p.max_output_tokens, Some(u32::MAX));
        let p = canonicalize(ApiKind::Completion, br#"{"prompt":"p","max_tokens":1e10}"#).unwrap();
        assert_eq!(p.max_output_tokens, Some(u32::MAX));
    }

    #[test]
    fn byte_order_marks_wide_encodings_and_whitespace() {
        let plain = r#"{"model":"m","messages":[{"role":"user","content":"héllo 🦀"}]}"#;
        let mut bom = b"\xef\xbb\xbf".to_vec();
        bom.extend_from_slice(plain.as_bytes());
        both(ApiKind::Chat, &bom, plain);
        both(
            ApiKind::Chat,
            format!(" \n\t{plain}\r\n \t").as_bytes(),
            plain,
        );
        // `json.loads` on bytes detects UTF-16 and UTF-32, with or without a BOM.
        let utf16 = |be: bool| -> Vec<u8> {
            plain
                .encode_utf16()
                .flat_map(|u| if be { u.to_be_bytes() } else { u.to_le_bytes() })
                .collect()
        };
        let utf32 = |be: bool| -> Vec<u8> {
            plain
                .chars()
                .flat_map(|c| {
                    if be {
                        u32::from(c).to_be_bytes()
                    } else {
                        u32::from(c).to_le_bytes()
                    }
                })
                .collect()
        };
        for body in [
            utf16(false),
            utf16(true),
            [vec![0xff, 0xfe], utf16(false)].concat(),
            [vec![0xfe, 0xff], utf16(true)].concat(),
            utf32(false),
            utf32(true),
            [vec![0xff, 0xfe, 0, 0], utf32(false)].concat(),
        ] {
            both(ApiKind::Chat, &body, plain);
        }
        // A lone surrogate in UTF-16 too.
        let mut lone: Vec<u8> = r#"{"messages":[{"role":"user","content":""#
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        lone.extend_from_slice(&0xd800u16.to_le_bytes());
        lone.extend(r#""}]}"#.encode_utf16().flat_map(u16::to_le_bytes));
        both(
            ApiKind::Chat,
            &lone,
            r#"{"messages":[{"role":"user","content":"\ufffd"}]}"#,
        );
        // Half a UTF-16 unit is not a body.
        let mut odd = utf16(false);
        odd.push(b' ');
        assert!(canonicalize(ApiKind::Chat, &odd).is_err());
    }

    #[test]
    fn deep_and_huge_values_in_fields_the_prompt_does_not_use() {
        let plain = r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
        // Python nests ~1,000 deep; serde_json skips an unread value without recursing.
        for depth in [200, 100_000] {
            let deep = format!(
                r#"{{"model":"m","metadata":{}1{},"messages":[{{"role":"user","content":"x","extra":{}{}}}],"x":{}1{}}}"#,
                r#"{"a":"#.repeat(depth),
                "}".repeat(depth),
                "[".repeat(depth),
                "]".repeat(depth),
                r#"[{"a":"#.repeat(depth / 2),
                "}]".repeat(depth / 2),
            );
            both(ApiKind::Chat, deep.as_bytes(), plain);
        }
        both(
            ApiKind::Chat,
            br#"{"model":"m","seed":184467440737095516160000,"temperature":1e400,"n":-1e-400,
                "logit_bias":{"5":123456789012345678901234567890.5e300},"messages":[{"role":"user","content":"x"}]}"#,
            plain,
        );
        // A deep prompt array or body is refused, never a stack overflow.
        let deep_prompt = format!(
            r#"{{"prompt":{}1{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(canonicalize(ApiKind::Completion, deep_prompt.as_bytes()).is_err());
        let deep_body = "[".repeat(100_000);
        assert!(canonicalize(ApiKind::Chat, deep_body.as_bytes()).is_err());
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
