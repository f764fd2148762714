//! The agent APIs: OpenAI Responses (`/v1/responses`) and Anthropic Messages (`/v1/messages`),
//! reduced to the records chat uses, so a tool-calling loop's turn N+1 extends turn N's bytes.
//!
//! What a template renders is kept (text, tool names, arguments and results, images by their
//! JSON); what a client rewrites between turns is not (`cache_control` markers, the `id` and
//! `status` vLLM adds to output items a stateless client sends back).

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::json::{Content, Key, Limit, Members, end_in, fragment, json_object, parse, str_of};
use super::{
    CanonError, CanonicalPrompt, FIELD_SEP, first_key, limit, prompt_of, push_record, push_tools,
    salt,
};

json_object! {
    struct ResponsesBody<'a> {
        "model" => model: Cow<'a, str>,
        "input" => input: &'a RawValue,
        "instructions" => instructions: Cow<'a, str>,
        "tools" => tools: &'a RawValue,
        "previous_response_id" => previous_response_id: Cow<'a, str>,
        "stream" => stream: bool,
        "max_output_tokens" => max_output_tokens: Limit,
        "prompt_cache_key" => prompt_cache_key: Cow<'a, str>,
        "safety_identifier" => safety_identifier: Cow<'a, str>,
        "user" => user: Cow<'a, str>,
        "cache_salt" => cache_salt: Cow<'a, str>,
    }
}

json_object! {
    /// One Responses `input` item: a message (`role` + `content`), a function call or its
    /// output, or another item (reasoning, references) kept by its JSON.
    struct Item<'a> {
        "type" => kind: Cow<'a, str>,
        "role" => role: Cow<'a, str>,
        "content" => content: Content<'a>,
        "name" => name: Cow<'a, str>,
        "arguments" => arguments: Cow<'a, str>,
        "call_id" => call_id: Cow<'a, str>,
        "output" => output: Content<'a>,
    }
}

json_object! {
    /// A content part or block of either API: the fields that decide what a template renders.
    struct Part<'a> {
        "type" => kind: Cow<'a, str>,
        "text" => text: Cow<'a, str>,
        "refusal" => refusal: Cow<'a, str>,
        "thinking" => thinking: Cow<'a, str>,
        "id" => id: Cow<'a, str>,
        "name" => name: Cow<'a, str>,
        "input" => input: &'a RawValue,
        "tool_use_id" => tool_use_id: Cow<'a, str>,
        "content" => content: Content<'a>,
        "cache_control" => cache_control: &'a RawValue,
    }
}

/// Canonicalises a `/v1/responses` body: tools, `instructions` as the system record, then the
/// `input` items. A chain continued by `previous_response_id` carries only its new items; the
/// router follows the id to the replica that holds the rest.
pub(crate) fn canonicalize_responses(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: ResponsesBody<'_> = parse(body, "the body")?;
    let input = parsed
        .input
        .get("input")?
        .ok_or(CanonError::MissingPrompt)?;
    let mut out = Vec::with_capacity(body.len());
    if let Some(tools) = parsed.tools.get("tools")?.filter(|t| !is_empty_array(t)) {
        push_tools(&mut out, tools.get().as_bytes());
    }
    if let Some(instructions) = parsed.instructions.get("instructions")? {
        push_record(&mut out, "system", "", |o| {
            o.extend_from_slice(instructions.as_bytes())
        });
    }
    let raw = input.get();
    match raw.as_bytes().first() {
        Some(b'"') => {
            let text = str_of(raw)?;
            push_record(&mut out, "user", "", |o| {
                o.extend_from_slice(text.as_bytes())
            });
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = fragment(raw, "input")?;
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
        max_output_tokens: limit([parsed.max_output_tokens]),
        session_hint: first_key([
            parsed.prompt_cache_key.get("prompt_cache_key")?,
            parsed.safety_identifier.get("safety_identifier")?,
            parsed.user.get("user")?,
        ]),
        previous_response_id: parsed
            .previous_response_id
            .get("previous_response_id")?
            .filter(|id| !id.is_empty())
            .map(Cow::into_owned),
        cache_salt: salt(parsed.cache_salt)?,
        ..prompt_of(parsed.model, parsed.stream, out)?
    })
}

/// One `input` item as a record. A message without `type` is a message (the easy form).
fn push_item(out: &mut Vec<u8>, raw: &RawValue) -> Result<(), CanonError> {
    let item: Item<'_> = fragment(raw.get(), "an input item")?;
    let role = item.role.get("role")?;
    let kind = item.kind.get("type")?;
    let kind = kind
        .as_deref()
        .unwrap_or(if role.is_some() { "message" } else { "" });
    match kind {
        "message" => {
            let role = role.as_deref().unwrap_or("user");
            let content = item.content.get("content")?;
            let mut failed = None;
            push_record(out, role, "", |o| {
                if let Some(content) = content {
                    failed = push_parts(o, content).err();
                }
            });
            failed.map_or(Ok(()), Err)
        }
        "function_call" => {
            let name = item.name.get("name")?;
            let arguments = item.arguments.get("arguments")?;
            let call_id = item.call_id.get("call_id")?;
            push_record(out, "assistant", name.as_deref().unwrap_or(""), |o| {
                o.extend_from_slice(arguments.as_deref().unwrap_or("").as_bytes());
                o.push(FIELD_SEP);
                o.extend_from_slice(call_id.as_deref().unwrap_or("").as_bytes());
            });
            Ok(())
        }
        "function_call_output" => {
            let output = item.output.get("output")?;
            let call_id = item.call_id.get("call_id")?;
            let mut failed = None;
            push_record(out, "tool", "", |o| {
                if let Some(output) = output {
                    failed = push_parts(o, output).err();
                }
                o.push(FIELD_SEP);
                o.extend_from_slice(call_id.as_deref().unwrap_or("").as_bytes());
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

json_object! {
    struct MessagesBody<'a> {
        "model" => model: Cow<'a, str>,
        "system" => system: Content<'a>,
        "messages" => messages: Vec<AnthropicMessage<'a>>,
        "tools" => tools: Vec<&'a RawValue>,
        "stream" => stream: bool,
        "max_tokens" => max_tokens: Limit,
        "metadata" => metadata: Metadata<'a>,
        "cache_salt" => cache_salt: Cow<'a, str>,
    }
}

json_object! {
    struct AnthropicMessage<'a> {
        "role" => role: Cow<'a, str>,
        "content" => content: Content<'a>,
    }
}

json_object! {
    struct Metadata<'a> {
        "user_id" => user_id: Cow<'a, str>,
    }
}

/// Canonicalises a `/v1/messages` body: tools (without their `cache_control`), `system`, then
/// the messages' content blocks.
pub(crate) fn canonicalize_messages(body: &[u8]) -> Result<CanonicalPrompt, CanonError> {
    let parsed: MessagesBody<'_> = parse(body, "the body")?;
    let messages = parsed
        .messages
        .get("messages")?
        .ok_or(CanonError::MissingPrompt)?;
    let mut out = Vec::with_capacity(body.len());
    // The end of the last marked block so far: blocks are appended in prompt order, so the
    // latest marker seen is the furthest.
    let mut marked_bytes = 0;
    if let Some(tools) = parsed.tools.get("tools")?.filter(|t| !t.is_empty()) {
        let mut joined = Vec::new();
        let mut marked = false;
        for tool in tools {
            marked |= push_without_cache_control(&mut joined, tool)?;
            joined.push(FIELD_SEP);
        }
        push_tools(&mut out, &joined);
        if marked {
            marked_bytes = out.len();
        }
    }
    let mut failed = None;
    if let Some(system) = parsed.system.get("system")? {
        push_record(&mut out, "system", "", |o| match push_blocks(o, system) {
            Ok(marked) => marked_bytes = marked.unwrap_or(marked_bytes),
            Err(e) => failed = Some(e),
        });
    }
    for message in messages {
        let role = message.role.get("role")?;
        let content = message.content.get("content")?;
        push_record(&mut out, role.as_deref().unwrap_or(""), "", |o| {
            if let Some(content) = content {
                match push_blocks(o, content) {
                    Ok(marked) => marked_bytes = marked.unwrap_or(marked_bytes),
                    Err(e) => failed = failed.take().or(Some(e)),
                }
            }
        });
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let user_id = match parsed.metadata.get("metadata")? {
        Some(metadata) => metadata.user_id.get("metadata.user_id")?,
        None => None,
    };
    Ok(CanonicalPrompt {
        max_output_tokens: limit([parsed.max_tokens]),
        session_hint: user_id.as_deref().and_then(claude_session),
        marked_bytes,
        // vLLM's Messages request takes `cache_salt` too and passes it to the chat it makes.
        cache_salt: salt(parsed.cache_salt)?,
        ..prompt_of(parsed.model, parsed.stream, out)?
    })
}

json_object! {
    struct Ids<'a> {
        "session_id" => session_id: Cow<'a, str>,
    }
}

/// The session in Anthropic's `metadata.user_id`: Claude Code sends a JSON object with a
/// `session_id` (since 2.1.86) or `user_<hash>_account_<id>_session_<uuid>` (before); any
/// other value is the key itself.
fn claude_session(user_id: &str) -> Option<String> {
    let session = if user_id.trim_start().starts_with('{') {
        fragment::<Ids<'_>>(user_id, "user_id")
            .ok()
            .and_then(|ids| ids.session_id.get("session_id").ok().flatten())
            .map(Cow::into_owned)
    } else {
        None
    };
    let session = session.or_else(|| user_id.rsplit_once("_session_").map(|(_, s)| s.to_string()));
    Some(session.unwrap_or_else(|| user_id.to_string())).filter(|s| !s.is_empty())
}

/// Appends Responses content (a string, or parts: `input_text`/`output_text` by their text,
/// `refusal` by its text, anything else, such as images and files, by its JSON).
fn push_parts(out: &mut Vec<u8>, content: Content<'_>) -> Result<(), CanonError> {
    push_blocks(out, content).map(drop)
}

/// Appends content of either API: a string or an array of parts/blocks (`null` is absent, and
/// skipped by the caller). Returns the length of `out` at the end of the last block that
/// carried `cache_control` (its separator included), if one did.
fn push_blocks(out: &mut Vec<u8>, content: Content<'_>) -> Result<Option<usize>, CanonError> {
    match content {
        Content::Text(text) => {
            out.extend_from_slice(&text);
            Ok(None)
        }
        Content::Parts(blocks) => {
            let mut marked = None;
            for block in blocks {
                let this = push_block(out, block)?;
                out.push(FIELD_SEP);
                // A marker on the block covers it whole; one inside (a tool result's content)
                // covers up to its own end.
                marked = match this {
                    Some(BlockMark::Whole) => Some(out.len()),
                    Some(BlockMark::Inside(end)) => Some(end),
                    None => marked,
                };
            }
            Ok(marked)
        }
    }
}

/// Where a block's `cache_control` marker puts the end of the marked prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockMark {
    /// The block itself is marked: the prefix ends after it.
    Whole,
    /// Only a block nested in it (a tool result's content) is: the prefix ends there.
    Inside(usize),
}

/// One part or block as its template renders it; whether it, or a block inside it, was marked.
fn push_block(out: &mut Vec<u8>, raw: &RawValue) -> Result<Option<BlockMark>, CanonError> {
    let part: Part<'_> = fragment(raw.get(), "a content block")?;
    let marked = part
        .cache_control
        .get("cache_control")?
        .map(|_| BlockMark::Whole);
    let field = |out: &mut Vec<u8>, s: Option<&str>| {
        out.extend_from_slice(s.unwrap_or("").as_bytes());
        out.push(FIELD_SEP);
    };
    let text = part.text.get("text")?;
    match part.kind.get("type")?.as_deref() {
        Some("text" | "input_text" | "output_text") | None if text.is_some() => {
            field(out, text.as_deref());
        }
        Some("refusal") => field(out, part.refusal.get("refusal")?.as_deref()),
        Some("thinking") => field(out, part.thinking.get("thinking")?.as_deref()),
        Some("tool_use") => {
            out.extend_from_slice(b"tool_use");
            out.push(FIELD_SEP);
            field(out, part.id.get("id")?.as_deref());
            field(out, part.name.get("name")?.as_deref());
            field(out, part.input.get("input")?.map(RawValue::get));
        }
        Some("tool_result") => {
            out.extend_from_slice(b"tool_result");
            out.push(FIELD_SEP);
            field(out, part.tool_use_id.get("tool_use_id")?.as_deref());
            if let Some(content) = part.content.get("content")? {
                let inside = push_blocks(out, content)?.map(BlockMark::Inside);
                return Ok(marked.or(inside));
            }
        }
        _ => {
            let whole = push_without_cache_control(out, raw)?.then_some(BlockMark::Whole);
            return Ok(marked.or(whole));
        }
    }
    Ok(marked)
}

/// Appends `raw` JSON without its top-level `cache_control` members (the marker moves between
/// turns and is not prompt text). They are cut out of the text, so the rest is what the client
/// sent, byte for byte, and what it sends once the marker has moved on; nothing is re-read, so
/// no depth, number or string in it can fail. Returns whether the last one (a dict keeps the
/// last) is set.
fn push_without_cache_control(out: &mut Vec<u8>, raw: &RawValue) -> Result<bool, CanonError> {
    let text = raw.get();
    let members = match text.contains("\"cache_control\"") {
        true => fragment::<Members<'_>>(text, "a block").ok(),
        false => None,
    };
    let Some(Members(members)) = members else {
        out.extend_from_slice(text.as_bytes());
        return Ok(false);
    };
    let is_marker = |key: &Key<'_>| key.as_str() == "cache_control";
    let Some(last_marker) = members.iter().rev().find(|(k, _)| is_marker(k)) else {
        out.extend_from_slice(text.as_bytes());
        return Ok(false);
    };
    let marked = last_marker.1.get() != "null";
    let Some(first_kept) = members.iter().position(|(k, _)| !is_marker(k)) else {
        out.extend_from_slice(b"{}");
        return Ok(marked);
    };
    // What goes: a leading run of markers up to the first kept key, then each later marker
    // with the separator before it (from the end of the value before it to its own end).
    let skip_ws = |at: usize| crate::plain_json::skip_ws(text.as_bytes(), at).min(text.len());
    let mut cuts = Vec::new();
    if first_kept > 0 {
        let value_before = end_in(text, members[first_kept - 1].1.get())?;
        let comma = skip_ws(value_before);
        cuts.push(skip_ws(1)..skip_ws(comma + 1));
    }
    for (i, (key, value)) in members.iter().enumerate().skip(first_kept + 1) {
        if is_marker(key) {
            cuts.push(end_in(text, members[i - 1].1.get())?..end_in(text, value.get())?);
        }
    }
    let mut at = 0;
    for cut in cuts {
        out.extend_from_slice(text.as_bytes().get(at..cut.start).unwrap_or_default());
        at = cut.end;
    }
    out.extend_from_slice(text.as_bytes().get(at..).unwrap_or_default());
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
        assert!(t1.marked_bytes > 0 && t2.marked_bytes > t1.bytes.len());
        assert_eq!(t2.max_output_tokens, Some(5));
        let plain = messages(r#"{"max_tokens":1,"messages":[{"role":"user","content":"go"}]}"#);
        assert_eq!(plain.marked_bytes, 0);
    }

    #[test]
    fn the_marked_prefix_ends_after_the_last_marked_block() {
        let system =
            r#""system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}]"#;
        let tools =
            r#""tools":[{"name":"ls","input_schema":{},"cache_control":{"type":"ephemeral"}}]"#;
        // Only the system prompt is marked: the prefix is tools and system, not the question.
        let m = messages(&format!(
            r#"{{{tools},{system},"messages":[{{"role":"user","content":"a long question"}}]}}"#
        ));
        let head = messages(&format!(r#"{{{tools},{system},"messages":[]}}"#));
        // The system record's own end (its record separator) is not part of the block.
        assert_eq!(m.marked_bytes, head.bytes.len() - 1);
        assert!(m.bytes.starts_with(&head.bytes));
        // A marked tool alone covers the tools.
        let t = messages(&format!(r#"{{{tools},"system":"sys","messages":[]}}"#));
        let no_tools = messages(r#"{"system":"sys","messages":[]}"#);
        assert_eq!(t.marked_bytes, t.bytes.len() - no_tools.bytes.len());
        // A marker inside a tool result's content ends the prefix there, before the next block.
        let nested = messages(
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t",
            "content":[{"type":"text","text":"out","cache_control":{"type":"ephemeral"}}]},
            {"type":"text","text":"then"}]}]}"#,
        );
        let end = nested.marked_bytes;
        assert!(end > 0 && nested.bytes[..end].ends_with(b"out\x1f\x1f"));
        assert!(!nested.bytes[..end].windows(4).any(|w| w == b"then"));
        // Every marker is stripped and none makes the offset pass the prompt's end.
        assert!(m.marked_bytes <= m.bytes.len() && nested.marked_bytes <= nested.bytes.len());
    }

    #[test]
    fn a_messages_cache_salt_is_read_like_chats() {
        let salted = messages(r#"{"cache_salt":"t1","messages":[{"role":"user","content":"hi"}]}"#);
        assert_eq!(salted.cache_salt.as_deref(), Some("t1"));
        let empty = r#"{"cache_salt":"","messages":[]}"#;
        assert!(canonicalize(ApiKind::Messages, empty.as_bytes()).is_err());
        let none = messages(r#"{"cache_salt":null,"messages":[]}"#);
        assert_eq!(none.cache_salt, None);
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

    /// `odd` canonicalises exactly as `plain`, the body vLLM reads it as.
    fn both(api: ApiKind, odd: &[u8], plain: &str) {
        let odd = canonicalize(api, odd)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(odd)));
        assert_eq!(odd, canonicalize(api, plain.as_bytes()).unwrap(), "{plain}");
    }

    #[test]
    fn agent_bodies_keep_the_last_duplicate_key() {
        both(
            ApiKind::Responses,
            br#"{"input":"old","instructions":"a","max_output_tokens":3,"input":[
                {"type":"reasoning","type":"message","role":"user","content":"hi","content":[
                  {"type":"input_text","text":"a","text":"b"}]},
                {"type":"function_call","name":"f","name":"g","arguments":"{}","call_id":"1"}],
                "instructions":"b","max_output_tokens":7,"previous_response_id":"r1",
                "previous_response_id":"r2","user":5,"user":"u"}"#,
            r#"{"instructions":"b","max_output_tokens":7,"input":[
                {"type":"message","role":"user","content":[{"type":"input_text","text":"b"}]},
                {"type":"function_call","name":"g","arguments":"{}","call_id":"1"}],
                "previous_response_id":"r2","user":"u"}"#,
        );
        both(
            ApiKind::Messages,
            br#"{"messages":[{"role":"user","content":"old"}],"system":"s1","max_tokens":2,
                "system":[{"type":"text","text":"s2","text":"s3"}],"max_tokens":8,
                "metadata":{"user_id":"a","user_id":"b"},
                "messages":[{"role":"assistant","role":"user","content":[
                  {"type":"tool_use","id":"t","name":"ls","input":{},"input":{"d":1}}]}]}"#,
            r#"{"system":[{"type":"text","text":"s3"}],"max_tokens":8,"metadata":{"user_id":"b"},
                "messages":[{"role":"user","content":[{"type":"tool_use","id":"t","name":"ls","input":{"d":1}}]}]}"#,
        );
    }

    #[test]
    fn agent_bodies_take_what_python_json_takes() {
        both(
            ApiKind::Responses,
            br#"{"input":[{"role":"user","content":[{"type":"input_text","text":"x\ud800"}]}],
                "temperature":NaN,"max_output_tokens":1099511627776}"#,
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"x\ufffd"}]}],
                "max_output_tokens":4294967295}"#,
        );
        both(
            ApiKind::Messages,
            br#"{"max_tokens":1e12,"temperature":Infinity,"system":"\udc00",
                "messages":[{"role":"user","content":[{"type":"text","text":"\ud800"}]}]}"#,
            r#"{"max_tokens":4294967295,"system":"\ufffd",
                "messages":[{"role":"user","content":[{"type":"text","text":"\ufffd"}]}]}"#,
        );
        let p = canonicalize(ApiKind::Messages, br#"{"max_tokens":-3,"messages":[]}"#).unwrap();
        assert_eq!(p.max_output_tokens, Some(0));
    }

    #[test]
    fn marked_blocks_read_as_their_json_without_the_marker() {
        // A marked tool or block: its JSON as sent, minus the marker, whatever it holds (a
        // lone surrogate, a number beyond f64, a schema nested deeper than 128).
        let deep = format!("{}1{}", r#"{"a":"#.repeat(200), "}".repeat(200));
        let marked = format!(
            r#"{{"tools":[{{"name":"ls","description":"\ud800","input_schema":{deep},"max":1e400,
                "cache_control":{{"type":"ephemeral"}}}}],"messages":[]}}"#
        );
        let plain = format!(
            r#"{{"tools":[{{"name":"ls","description":"\ud800","input_schema":{deep},"max":1e400}}],"messages":[]}}"#
        );
        let m = messages(&marked);
        assert!(m.marked_bytes > 0);
        assert_eq!(m.bytes, messages(&plain).bytes);
        // The last marker decides (a dict keeps the last), and all of them go.
        let m = messages(
            r#"{"tools":[{"cache_control":{"type":"ephemeral"}, "name":"ls", "cache_control":null}],"messages":[]}"#,
        );
        assert_eq!(m.marked_bytes, 0);
        assert_eq!(
            m.bytes,
            messages(r#"{"tools":[{"name":"ls"}],"messages":[]}"#).bytes
        );
        let m = messages(r#"{"tools":[{ "cache_control":{}, "name":"ls" }],"messages":[]}"#);
        assert_eq!(
            m.bytes,
            messages(r#"{"tools":[{ "name":"ls" }],"messages":[]}"#).bytes
        );
        let m = messages(r#"{"tools":[{"cache_control":{}}],"messages":[]}"#);
        assert_eq!(m.bytes, messages(r#"{"tools":[{}],"messages":[]}"#).bytes);
    }

    #[test]
    fn a_marker_moving_off_an_image_keeps_the_prefix() {
        // Turn N marks its newest block, an image; turn N+1 marks its own newest one instead.
        let image =
            r#"{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBO"}"#;
        let t1 = messages(&format!(
            r#"{{"messages":[{{"role":"user","content":[{image},"cache_control":{{"type":"ephemeral"}}}}]}}]}}"#
        ));
        let t2 = messages(&format!(
            r#"{{"messages":[{{"role":"user","content":[{image}}}]}},{{"role":"assistant","content":"a cat"}},
               {{"role":"user","content":[{{"type":"text","text":"more","cache_control":{{"type":"ephemeral"}}}}]}}]}}"#
        ));
        assert!(t1.marked_bytes > 0 && t2.marked_bytes > t1.marked_bytes);
        assert!(t2.bytes.starts_with(&t1.bytes));
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
