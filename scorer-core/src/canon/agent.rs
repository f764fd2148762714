//! The agent APIs: OpenAI Responses (`/v1/responses`) and Anthropic Messages (`/v1/messages`),
//! reduced to the records chat uses, so a tool-calling loop's turn N+1 extends turn N's bytes.
//!
//! What a template renders is kept (text, tool names, arguments and results, images by their
//! JSON); what a client rewrites between turns is not (`cache_control` markers, the `id` and
//! `status` vLLM adds to output items a stateless client sends back).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{
    CanonError, CanonicalPrompt, FIELD_SEP, first_key, invalid, push_record, push_tools, salt,
};

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    safety_identifier: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

/// One Responses `input` item: a message (`role` + `content`), a function call or its output,
/// or another item (reasoning, references) kept by its JSON.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    output: Option<&'a RawValue>,
}

/// A content part or block of either API: the fields that decide what a template renders.
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    refusal: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_control: Option<&'a RawValue>,
}

/// Canonicalises a `/v1/responses` body: tools, `instructions` as the system record, then the
/// `input` items. A chain continued by `previous_response_id` carries only its new items; the
/// router follows the id to the replica that holds the rest.
pub(crate) fn canonicalize_responses(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: ResponsesBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
    let input = parsed.input.ok_or(CanonError::MissingPrompt)?;
    let mut out = Vec::with_capacity(body.len());
    if let Some(tools) = parsed.tools.filter(|t| !is_empty_array(t)) {
        push_tools(&mut out, tools.get().as_bytes());
    }
    if let Some(instructions) = parsed.instructions.as_deref() {
        push_record(&mut out, "system", "", |o| {
            o.extend_from_slice(instructions.as_bytes())
        });
    }
    let raw = input.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            let text: Cow<'_, str> = serde_json::from_str(raw).map_err(invalid)?;
            push_record(&mut out, "user", "", |o| {
                o.extend_from_slice(text.as_bytes())
            });
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(raw).map_err(invalid)?;
            for item in items {
                push_item(&mut out, item)?;
            }
        }
        _ => {
            return Err(CanonError::InvalidBody(
                "input must be a string or an array of items".into(),
            ));
        }
    }
    Ok(CanonicalPrompt {
        model: parsed.model.map(Cow::into_owned).unwrap_or_default(),
        bytes: out,
        stream: parsed.stream.unwrap_or(false),
        max_output_tokens: parsed.max_output_tokens,
        session_hint: first_key([
            parsed.prompt_cache_key,
            parsed.safety_identifier,
            parsed.user,
        ]),
        previous_response_id: parsed
            .previous_response_id
            .filter(|id| !id.is_empty())
            .map(Cow::into_owned),
        cache_salt: salt(parsed.cache_salt)?,
        cache_control: false,
    })
}

/// One `input` item as a record. A message without `type` is a message (the easy form).
fn push_item(out: &mut Vec<u8>, raw: &RawValue) -> Result<(), CanonError> {
    let item: Item<'_> = serde_json::from_str(raw.get()).map_err(invalid)?;
    let kind = item
        .kind
        .as_deref()
        .unwrap_or(if item.role.is_some() { "message" } else { "" });
    match kind {
        "message" => {
            let role = item.role.as_deref().unwrap_or("user");
            let mut failed = None;
            push_record(out, role, "", |o| {
                if let Some(content) = item.content {
                    failed = push_parts(o, content).err();
                }
            });
            failed.map_or(Ok(()), Err)
        }
        "function_call" => {
            push_record(out, "assistant", item.name.as_deref().unwrap_or(""), |o| {
                o.extend_from_slice(item.arguments.as_deref().unwrap_or("").as_bytes());
                o.push(FIELD_SEP);
                o.extend_from_slice(item.call_id.as_deref().unwrap_or("").as_bytes());
            });
            Ok(())
        }
        "function_call_output" => {
            let mut failed = None;
            push_record(out, "tool", "", |o| {
                if let Some(output) = item.output {
                    failed = push_parts(o, output).err();
                }
                o.push(FIELD_SEP);
                o.extend_from_slice(item.call_id.as_deref().unwrap_or("").as_bytes());
            });
            failed.map_or(Ok(()), Err)
        }
        other => {
            push_record(out, other, "", |o| {
                o.extend_from_slice(raw.get().as_bytes())
            });
            Ok(())
        }
    }
}

#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<Vec<AnthropicMessage<'a>>>,
    #[serde(borrow, default)]
    tools: Option<Vec<&'a RawValue>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(borrow, default)]
    metadata: Option<Metadata<'a>>,
}

#[derive(Deserialize)]
struct AnthropicMessage<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

/// Canonicalises a `/v1/messages` body: tools (without their `cache_control`), `system`, then
/// the messages' content blocks.
pub(crate) fn canonicalize_messages(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: MessagesBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
    let messages = parsed.messages.ok_or(CanonError::MissingPrompt)?;
    let mut out = Vec::with_capacity(body.len());
    let mut cache_control = false;
    if let Some(tools) = parsed.tools.filter(|t| !t.is_empty()) {
        let mut joined = Vec::new();
        for tool in tools {
            cache_control |= push_without_cache_control(&mut joined, tool)?;
            joined.push(FIELD_SEP);
        }
        push_tools(&mut out, &joined);
    }
    let mut failed = None;
    if let Some(system) = parsed.system.filter(|s| s.get() != "null") {
        push_record(&mut out, "system", "", |o| match push_blocks(o, system) {
            Ok(marked) => cache_control |= marked,
            Err(e) => failed = Some(e),
        });
    }
    for message in &messages {
        let role = message.role.as_deref().unwrap_or("");
        push_record(&mut out, role, "", |o| {
            if let Some(content) = message.content {
                match push_blocks(o, content) {
                    Ok(marked) => cache_control |= marked,
                    Err(e) => failed = failed.take().or(Some(e)),
                }
            }
        });
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(CanonicalPrompt {
        model: parsed.model.map(Cow::into_owned).unwrap_or_default(),
        bytes: out,
        stream: parsed.stream.unwrap_or(false),
        max_output_tokens: parsed.max_tokens,
        session_hint: parsed
            .metadata
            .and_then(|m| m.user_id)
            .as_deref()
            .and_then(claude_session),
        previous_response_id: None,
        cache_salt: None,
        cache_control,
    })
}

/// The session in Anthropic's `metadata.user_id`: Claude Code sends a JSON object with a
/// `session_id` (since 2.1.86) or `user_<hash>_account_<id>_session_<uuid>` (before); any
/// other value is the key itself.
fn claude_session(user_id: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Ids<'a> {
        #[serde(borrow, default)]
        session_id: Option<Cow<'a, str>>,
    }
    let session = if user_id.trim_start().starts_with('{') {
        serde_json::from_str::<Ids<'_>>(user_id)
            .ok()
            .and_then(|ids| ids.session_id)
            .map(Cow::into_owned)
    } else {
        None
    };
    let session = session.or_else(|| user_id.rsplit_once("_session_").map(|(_, s)| s.to_string()));
    Some(session.unwrap_or_else(|| user_id.to_string())).filter(|s| !s.is_empty())
}

/// Appends Responses content (a string, or parts: `input_text`/`output_text` by their text,
/// `refusal` by its text, anything else, such as images and files, by its JSON).
fn push_parts(out: &mut Vec<u8>, content: &RawValue) -> Result<(), CanonError> {
    push_blocks(out, content).map(|_| ())
}

/// Appends content of either API: a string, `null`, or an array of parts/blocks. Returns
/// whether a block carried `cache_control`.
fn push_blocks(out: &mut Vec<u8>, content: &RawValue) -> Result<bool, CanonError> {
    let raw = content.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            let text: Cow<'_, str> = serde_json::from_str(raw).map_err(invalid)?;
            out.extend_from_slice(text.as_bytes());
            Ok(false)
        }
        Some(b'[') => {
            let blocks: Vec<&RawValue> = serde_json::from_str(raw).map_err(invalid)?;
            let mut marked = false;
            for block in blocks {
                marked |= push_block(out, block)?;
                out.push(FIELD_SEP);
            }
            Ok(marked)
        }
        Some(b'n') => Ok(false),
        _ => Err(CanonError::InvalidBody(
            "content must be a string, an array or null".into(),
        )),
    }
}

/// One part or block as its template renders it.
fn push_block(out: &mut Vec<u8>, raw: &RawValue) -> Result<bool, CanonError> {
    let part: Part<'_> = serde_json::from_str(raw.get()).map_err(invalid)?;
    let marked = part.cache_control.is_some_and(|c| c.get() != "null");
    let field = |out: &mut Vec<u8>, s: Option<&str>| {
        out.extend_from_slice(s.unwrap_or("").as_bytes());
        out.push(FIELD_SEP);
    };
    match part.kind.as_deref() {
        Some("text" | "input_text" | "output_text") | None if part.text.is_some() => {
            field(out, part.text.as_deref());
        }
        Some("refusal") => field(out, part.refusal.as_deref()),
        Some("thinking") => field(out, part.thinking.as_deref()),
        Some("tool_use") => {
            out.extend_from_slice(b"tool_use");
            out.push(FIELD_SEP);
            field(out, part.id.as_deref());
            field(out, part.name.as_deref());
            field(out, part.input.map(RawValue::get));
        }
        Some("tool_result") => {
            out.extend_from_slice(b"tool_result");
            out.push(FIELD_SEP);
            field(out, part.tool_use_id.as_deref());
            if let Some(content) = part.content {
                return Ok(push_blocks(out, content)? | marked);
            }
        }
        _ => return Ok(push_without_cache_control(out, raw)? | marked),
    }
    Ok(marked)
}

/// Appends `raw` JSON without a top-level `cache_control` key (it moves between turns and is
/// not prompt text). Returns whether there was one.
fn push_without_cache_control(out: &mut Vec<u8>, raw: &RawValue) -> Result<bool, CanonError> {
    let text = raw.get();
    if !text.contains("\"cache_control\"") {
        out.extend_from_slice(text.as_bytes());
        return Ok(false);
    }
    let mut value: serde_json::Value = serde_json::from_str(text).map_err(invalid)?;
    let marked = value
        .as_object_mut()
        .and_then(|o| o.remove("cache_control"))
        .is_some_and(|c| !c.is_null());
    out.extend_from_slice(value.to_string().as_bytes());
    Ok(marked)
}

fn is_empty_array(raw: &RawValue) -> bool {
    let t = raw.get().trim();
    t == "[]" || t == "null"
}

#[cfg(test)]
mod tests {
    use crate::canon::{CanonError, canonicalize};
    use crate::protocol::ApiKind;

    fn responses(body: &str) -> crate::canon::CanonicalPrompt {
        canonicalize(ApiKind::Responses, body.as_bytes()).unwrap()
    }

    fn messages(body: &str) -> crate::canon::CanonicalPrompt {
        canonicalize(ApiKind::Messages, body.as_bytes()).unwrap()
    }

    #[test]
    fn a_stateless_responses_turn_extends_the_last_one() {
        let t1 = responses(
            r#"{"model":"m","instructions":"be brief","tools":[{"type":"function","name":"ls"}],
            "input":[{"role":"user","content":"list files"}]}"#,
        );
        // The client sends back the output items (with ids and statuses vLLM gave them), the
        // tool's output, and the next question.
        let t2 = responses(
            r#"{"model":"m","instructions":"be brief","tools":[{"type":"function","name":"ls"}],
            "input":[{"role":"user","content":[{"type":"input_text","text":"list files"}]},
            {"type":"function_call","id":"fc_1","call_id":"c1","name":"ls","arguments":"{}","status":"completed"},
            {"type":"function_call_output","call_id":"c1","output":"a.txt"},
            {"type":"message","id":"msg_9","status":"completed","role":"assistant",
             "content":[{"type":"output_text","text":"one file","annotations":[]}]},
            {"role":"user","content":"and now?"}],"stream":true,"max_output_tokens":9}"#,
        );
        let t1_user_text = t1.bytes.len() - 1;
        assert!(t2.bytes.starts_with(&t1.bytes[..t1_user_text]));
        assert!(t2.stream);
        assert_eq!(t2.max_output_tokens, Some(9));
        assert_eq!(t1.model, "m");
    }

    #[test]
    fn responses_string_input_equals_one_user_message() {
        let s = responses(r#"{"input":"hi"}"#);
        let m = responses(r#"{"input":[{"role":"user","content":"hi"}]}"#);
        assert_eq!(s.bytes, m.bytes);
    }

    #[test]
    fn responses_chain_and_session_fields() {
        let r = responses(
            r#"{"input":"x","previous_response_id":"resp_1","prompt_cache_key":"k","user":"u"}"#,
        );
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(r.session_hint.as_deref(), Some("k"));
        let u = responses(r#"{"input":"x","previous_response_id":"","user":"u"}"#);
        assert_eq!(u.previous_response_id, None);
        assert_eq!(u.session_hint.as_deref(), Some("u"));
        let s = responses(r#"{"input":"x","safety_identifier":"s","user":"u"}"#);
        assert_eq!(s.session_hint.as_deref(), Some("s"));
    }

    #[test]
    fn responses_items_differ_by_what_they_render() {
        let a =
            responses(r#"{"input":[{"type":"function_call_output","call_id":"c","output":"1"}]}"#);
        let b =
            responses(r#"{"input":[{"type":"function_call_output","call_id":"c","output":"2"}]}"#);
        assert_ne!(a.bytes, b.bytes);
        let i1 = responses(
            r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"a"}]}]}"#,
        );
        let i2 = responses(
            r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"b"}]}]}"#,
        );
        assert_ne!(i1.bytes, i2.bytes);
        let r = responses(r#"{"input":[{"type":"reasoning","id":"rs","summary":[]}]}"#);
        assert!(!r.bytes.is_empty());
    }

    #[test]
    fn moving_cache_control_markers_keep_the_prefix() {
        let t1 = messages(
            r#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],
            "tools":[{"name":"ls","input_schema":{},"cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"go","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        let t2 = messages(
            r#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],
            "tools":[{"name":"ls","input_schema":{},"cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"go"}]},
            {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},
              {"type":"tool_use","id":"t1","name":"ls","input":{"d":"."}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"a.txt"}]},
              {"type":"text","text":"next","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        assert!(t2.bytes.starts_with(&t1.bytes));
        assert!(t1.cache_control && t2.cache_control);
        assert_eq!(t2.max_output_tokens, Some(5));
        let plain = messages(r#"{"max_tokens":1,"messages":[{"role":"user","content":"go"}]}"#);
        assert!(!plain.cache_control);
    }

    #[test]
    fn system_string_equals_one_text_block_up_to_the_separator() {
        let s = messages(r#"{"system":"sys","messages":[]}"#);
        let b = messages(r#"{"system":[{"type":"text","text":"sys"}],"messages":[]}"#);
        assert!(b.bytes.starts_with(&s.bytes[..s.bytes.len() - 1]));
    }

    #[test]
    fn claude_code_sessions_are_read_from_metadata() {
        let json = messages(
            r#"{"messages":[],"metadata":{"user_id":"{\"device_id\":\"d\",\"session_id\":\"s-1\"}"}}"#,
        );
        assert_eq!(json.session_hint.as_deref(), Some("s-1"));
        let legacy =
            messages(r#"{"messages":[],"metadata":{"user_id":"user_ab_account_c_session_s-2"}}"#);
        assert_eq!(legacy.session_hint.as_deref(), Some("s-2"));
        let other = messages(r#"{"messages":[],"metadata":{"user_id":"alice"}}"#);
        assert_eq!(other.session_hint.as_deref(), Some("alice"));
        let empty = messages(r#"{"messages":[],"metadata":{"user_id":""}}"#);
        assert_eq!(empty.session_hint, None);
    }

    #[test]
    fn bad_agent_bodies_are_errors_not_panics() {
        for body in [
            "",
            "{",
            r#"{"input":5}"#,
            r#"{"input":[5]}"#,
            r#"{"input":[{"role":"user","content":5}]}"#,
            r#"{"input":[{"type":"function_call_output","output":{}}]}"#,
            r#"{"input":"x","cache_salt":""}"#,
        ] {
            assert!(
                canonicalize(ApiKind::Responses, body.as_bytes()).is_err(),
                "{body}"
            );
        }
        assert_eq!(
            canonicalize(ApiKind::Responses, b"{}"),
            Err(CanonError::MissingPrompt)
        );
        for body in [
            r#"{"messages":5}"#,
            r#"{"messages":[{"role":"user","content":5}]}"#,
            r#"{"messages":[{"role":"user","content":[5]}]}"#,
            r#"{"system":5,"messages":[]}"#,
        ] {
            assert!(
                canonicalize(ApiKind::Messages, body.as_bytes()).is_err(),
                "{body}"
            );
        }
        assert_eq!(
            canonicalize(ApiKind::Messages, b"{}"),
            Err(CanonError::MissingPrompt)
        );
    }
}
