//! The usual chat body read by hand ([`crate::plain_json`]: certain or silent), into the same
//! [`ChatBody`] serde fills, so everything after the read is shared.
//!
//! Nearly every chat request is plain: ASCII text or short escapes in its strings, its
//! `content` a string, no tools. For those, serde's general path is most of the filter's
//! per-request work (a UTF-8 check and a string match per key, a visitor per value); this
//! reader finds each string's end with `memchr` and checks its bytes in one vectorised pass.
//! Whatever it is not certain of (a `\u` escape, non-ASCII text, content parts, `tools`, a key
//! twice, a field of another type) goes to serde, so the answer is always serde's.

use std::borrow::Cow;

use crate::plain_json::{Reader, Seen};

use super::json::{Content, Field, Limit};
use super::{ChatBody, Message};

/// `body` as serde would read it, or `None` to ask serde.
pub(super) fn chat(body: &[u8]) -> Option<ChatBody<'_>> {
    let mut r = Reader::new(body);
    let mut out = ChatBody::default();
    let mut seen = Seen::default();
    r.object(|r, key| {
        match key {
            b"model" => out.model = seen.first(0).and(text(r))?,
            b"messages" => out.messages = seen.first(1).and(messages(r))?,
            b"tools" => seen.first(2).and(absent(r))?,
            b"stream" => {
                out.stream = seen.first(3).and(or_null(r, |r| r.bool()))?;
            }
            b"max_tokens" => out.max_tokens = seen.first(4).and(limit(r))?,
            b"max_completion_tokens" => out.max_completion_tokens = seen.first(5).and(limit(r))?,
            b"user" => out.user = seen.first(6).and(text(r))?,
            b"prompt_cache_key" => out.prompt_cache_key = seen.first(7).and(text(r))?,
            b"safety_identifier" => out.safety_identifier = seen.first(8).and(text(r))?,
            b"cache_salt" => out.cache_salt = seen.first(9).and(text(r))?,
            _ => r.skip()?,
        }
        Some(())
    })?;
    r.at_end().then_some(out)
}

/// `null` (absent), or what `read` reads.
fn or_null<'a, T>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>) -> Option<T>,
) -> Option<Field<T>> {
    if r.null() {
        return Some(Field::Absent);
    }
    read(r).map(Field::Value)
}

/// A string field (`Cow<str>` in serde's reading).
fn text<'a>(r: &mut Reader<'a>) -> Option<Field<Cow<'a, str>>> {
    or_null(r, Reader::str)
}

/// A field this reader leaves to serde unless it is `null`, which serde reads as absent
/// (`tools`, `tool_calls`: serde keeps their raw text, which only it can hand out).
fn absent(r: &mut Reader<'_>) -> Option<()> {
    r.null().then_some(())
}

/// An output-token limit: serde's [`Limit`] reads any number; this reader plain counts (and
/// `null`, which serde reads as a limit of nothing).
fn limit(r: &mut Reader<'_>) -> Option<Field<Limit>> {
    if r.null() {
        return Some(Field::Value(Limit(None)));
    }
    let n = r.unsigned()?;
    Some(Field::Value(Limit(Some(
        u32::try_from(n).unwrap_or(u32::MAX),
    ))))
}

fn messages<'a>(r: &mut Reader<'a>) -> Option<Field<Vec<Message<'a>>>> {
    or_null(r, |r| {
        let mut out = Vec::new();
        r.array(|r| {
            out.push(message(r)?);
            Some(())
        })?;
        Some(out)
    })
}

fn message<'a>(r: &mut Reader<'a>) -> Option<Message<'a>> {
    let mut out = Message::default();
    let mut seen = Seen::default();
    r.object(|r, key| {
        match key {
            b"role" => out.role = seen.first(0).and(text(r))?,
            b"name" => out.name = seen.first(1).and(text(r))?,
            b"content" => {
                out.content = seen
                    .first(2)
                    .and(or_null(r, |r| r.text().map(Content::Text)))?;
            }
            b"tool_calls" => seen.first(3).and(absent(r))?,
            b"tool_call_id" => out.tool_call_id = seen.first(4).and(text(r))?,
            _ => r.skip()?,
        }
        Some(())
    })?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::{canonicalize, canonicalize_with_serde};
    use crate::protocol::ApiKind;

    /// Chat bodies as clients send them: compact and Python-spaced, every field the prompt
    /// reads, the usual sampling fields around them.
    const BODIES: &[&str] = &[
        r#"{"max_tokens":16,"messages":[{"content":"You are a benchmark.","role":"system"},{"content":"filter answer stream cache","role":"user"}],"model":"m","stream":false,"temperature":0}"#,
        r#"{"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "system", "content": "Be brief.\nQuote \"exactly\"\\ and \/ tab\t."}, {"role": "user", "name": "ann", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": null}, {"role": "tool", "tool_call_id": "call_1", "content": "42"}], "temperature": 0.7, "top_p": 1e0, "stop": ["\n", "END"], "stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 128, "max_tokens": null, "user": "u-1", "prompt_cache_key": "pk", "safety_identifier": "", "cache_salt": "s", "tools": null, "logit_bias": {"50256": -100}, "seed": -3, "n": 1}"#,
        r#"{"messages":[],"model":"m","max_tokens":99999999999}"#,
        "{\n  \"model\" : \"m\" ,\n  \"messages\" : [ { \"role\" : \"user\" , \"content\" : \"x\" } ]\n}\n",
    ];

    fn agree(body: &[u8]) {
        assert_eq!(
            canonicalize(ApiKind::Chat, body),
            canonicalize_with_serde(ApiKind::Chat, body),
            "{}",
            String::from_utf8_lossy(body)
        );
    }

    #[test]
    fn the_hand_reader_takes_the_usual_bodies() {
        for body in BODIES {
            assert!(chat(body.as_bytes()).is_some(), "{body}");
            agree(body.as_bytes());
        }
        let prompt = canonicalize(ApiKind::Chat, BODIES[1].as_bytes()).unwrap();
        assert_eq!(prompt.max_output_tokens, Some(128));
        assert_eq!(prompt.session_hint.as_deref(), Some("pk"));
        assert!(prompt.stream);
    }

    #[test]
    fn what_it_is_not_certain_of_goes_to_serde() {
        for body in [
            r#"{"model":"m","messages":[{"role":"user","content":"caf\u00e9"}]}"#,
            "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"café\"}]}",
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#,
            r#"{"model":"m","tools":[{"type":"function"}],"messages":[]}"#,
            r#"{"model":"m","model":"n","messages":[]}"#,
            r#"{"model":"m","messages":[],"max_tokens":1.5}"#,
            r#"{"model":1,"messages":[]}"#,
        ] {
            assert!(chat(body.as_bytes()).is_none(), "{body}");
            agree(body.as_bytes());
        }
    }

    // Every body above with one byte removed, doubled, or replaced by one that changes JSON's
    // meaning reads the same by hand as through serde (or goes to serde).
    #[test]
    fn the_hand_reader_agrees_with_serde_on_every_one_byte_change() {
        const BYTES: &[u8] = b"\"\\-+09.eE{}[],: \tnul\x01\x7f\xc3";
        let mut variants = 0;
        for body in BODIES {
            let body = body.as_bytes();
            for at in 0..body.len() {
                let mut removed = body.to_vec();
                removed.remove(at);
                let mut doubled = body.to_vec();
                doubled.insert(at, body[at]);
                agree(&removed);
                agree(&doubled);
                for &b in BYTES {
                    let mut v = body.to_vec();
                    v[at] = b;
                    agree(&v);
                }
                variants += 2 + BYTES.len();
            }
        }
        assert!(variants > 20_000, "{variants}");
    }
}
