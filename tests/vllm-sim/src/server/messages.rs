//! The Anthropic Messages API as vLLM 0.33 serves it (`vllm/entrypoints/anthropic/`):
//! `POST /v1/messages`, `POST /v1/messages/count_tokens` and `POST /v1/messages/render`.
//!
//! vLLM turns a Messages request into a chat completion request
//! (`AnthropicServingMessages.to_chat_completion_request`, serving.py) and runs the chat path;
//! so does the simulator, so both APIs share rendering, prefix cache, metrics and KV events.
//! The answer is an `AnthropicMessagesResponse` dumped with `exclude_none`; its usage is
//! `_build_anthropic_usage` of the chat usage with prompt-token details (vLLM's
//! `--enable-prompt-tokens-details`, which the simulator's chat usage always reports), so
//! `input_tokens` is the prompt less its cache reads and cache writes. The simulated model
//! always stops at `max_tokens`: `stop_reason` is `"max_tokens"`.
//!
//! Errors a handler returns are translated into Anthropic's shape,
//! `{"type": "error", "error": {"type", "message"}}` with `type` from the status
//! (`translate_error_type`, protocol.py); request-validation errors are raised by FastAPI
//! before the handler and keep vLLM's OpenAI shape (`validation_exception_handler`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::validation::{self, FieldError};
use super::{
    ApiError, EngineJob, Generation, PromptEnd, Shared, cache_salt, cache_write_tokens,
    disaggregation, sse_response,
};
use crate::engine::RequestSummary;
use crate::tokenizer::{ChatMessage, ChatTemplate};

/// Claude Code's attribution header, which vLLM drops from system text (a per-request hash
/// would defeat prefix caching).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Block types `AnthropicContentBlock` accepts.
const BLOCK_TYPES: [&str; 9] = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
];

/// vLLM's `_detect_merge_inline_system`, run once at startup: a template that refuses a
/// system message after the first turn (Qwen's `loop.first` guard) needs inline system
/// messages merged into the leading one.
pub(super) fn template_needs_merged_system(template: &dyn ChatTemplate) -> bool {
    let msg = |role: &str| ChatMessage {
        role: role.into(),
        content: "t".into(),
    };
    let probe = [msg("system"), msg("user"), msg("system"), msg("user")];
    template.render(&probe, false).is_err()
}

// ---------------------------------------------------------------------------------------------
// The request

/// The `AnthropicMessagesRequest` (or `AnthropicCountTokensRequest`) fields the simulator uses.
#[derive(Debug)]
struct MessagesRequest {
    model: String,
    messages: Vec<Value>,
    /// Absent only on `count_tokens`.
    max_tokens: Option<u32>,
    system: Option<Value>,
    stream: bool,
    cache_salt: Option<String>,
}

/// Parses and validates a body as FastAPI and pydantic do (errors: 400, OpenAI shape).
fn parse_request(raw: &[u8], count_tokens: bool) -> Result<MessagesRequest, ApiError> {
    let body = validation::json_object(raw)?;
    let required: &[&str] = if count_tokens {
        &["model", "messages"]
    } else {
        &["model", "messages", "max_tokens"]
    };
    let mut errors = validation::require(&body, required);
    let model = match validation::string_field(&body, "model") {
        Ok(Some("")) => {
            errors.push(FieldError::value_error(
                "model",
                "Model is required",
                &json!(""),
            ));
            None
        }
        Ok(m) => m,
        Err(e) => {
            errors.push(e);
            None
        }
    };
    let messages = match validation::list_field(&body, "messages") {
        Ok(m) => m.cloned().unwrap_or_default(),
        Err(e) => {
            errors.push(e);
            Vec::new()
        }
    };
    for (i, m) in messages.iter().enumerate() {
        check_message(i, m, &mut errors);
    }
    let max_tokens = if count_tokens {
        None
    } else {
        max_tokens(&body, &mut errors)
    };
    let stream = validation::bool_field(&body, "stream").unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    let system = body.get("system").filter(|v| !v.is_null()).cloned();
    if let Some(v) = &system
        && !v.is_string()
        && !v.is_array()
    {
        errors.extend(validation::str_or_list_errors("system", v));
    }
    let salt = validation::string_field(&body, "cache_salt").unwrap_or_else(|e| {
        errors.push(e);
        None
    });
    if !errors.is_empty() {
        return Err(validation::validation_error(&errors));
    }
    Ok(MessagesRequest {
        model: model.unwrap_or_default().to_owned(),
        messages,
        max_tokens,
        system,
        stream: stream.unwrap_or(false),
        cache_salt: salt.map(str::to_owned),
    })
}

/// `max_tokens: int` with its `validate_max_tokens` check.
fn max_tokens(body: &Map<String, Value>, errors: &mut Vec<FieldError>) -> Option<u32> {
    match validation::int_field(body, "max_tokens") {
        Ok(Some(n)) if n <= 0 => {
            let v = body.get("max_tokens").cloned().unwrap_or(Value::Null);
            errors.push(FieldError::value_error(
                "max_tokens",
                "max_tokens must be positive",
                &v,
            ));
            None
        }
        Ok(n) => n.map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        Err(e) => {
            errors.push(e);
            None
        }
    }
}

/// `AnthropicMessage`: a role among `user`, `assistant`, `system`, and content that is a
/// string or a list of known blocks.
fn check_message(i: usize, m: &Value, errors: &mut Vec<FieldError>) {
    let Some(obj) = m.as_object() else {
        errors.push(FieldError::value_error(
            &format!("messages.{i}"),
            "Input should be a valid dictionary or instance of AnthropicMessage",
            m,
        ));
        return;
    };
    for missing in validation::require(obj, &["role", "content"]) {
        errors.push(missing.nested(&format!("messages.{i}")));
    }
    if let Some(role) = obj.get("role")
        && !matches!(role.as_str(), Some("user" | "assistant" | "system"))
    {
        errors.push(FieldError::literal(
            &format!("messages.{i}.role"),
            "'user', 'assistant' or 'system'",
            role,
        ));
    }
    if let Some(Value::Array(blocks)) = obj.get("content") {
        for (j, b) in blocks.iter().enumerate() {
            let kind = b.get("type");
            if !kind
                .and_then(Value::as_str)
                .is_some_and(|k| BLOCK_TYPES.contains(&k))
            {
                errors.push(FieldError::literal(
                    &format!("messages.{i}.content.{j}.type"),
                    "'text', 'image', 'tool_use', 'tool_result', 'tool_reference', \
                     'thinking', 'redacted_thinking', 'tool_addition' or 'tool_removal'",
                    kind.unwrap_or(&Value::Null),
                ));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Conversion to chat messages (serving.py `to_chat_completion_request`)

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// The OpenAI chat messages vLLM builds from a Messages request.
fn chat_messages(req: &MessagesRequest, merge_inline_system: bool) -> Vec<Value> {
    let mut out = Vec::new();
    if let Some(system) = system_text(req, merge_inline_system) {
        out.push(json!({"role": "system", "content": system}));
    }
    for msg in &req.messages {
        convert_message(msg, merge_inline_system, &mut out);
    }
    out
}

/// `_convert_system_message`: the top-level `system` (and, when merging, every inline system
/// message) joined into one text, billing headers dropped.
fn system_text(req: &MessagesRequest, merge_inline_system: bool) -> Option<String> {
    let mut parts = Vec::new();
    match &req.system {
        Some(Value::String(s)) if !s.is_empty() => parts.push(s.clone()),
        Some(Value::Array(blocks)) => parts.extend(text_blocks(blocks)),
        _ => {}
    }
    if merge_inline_system {
        let inline = req.messages.iter().filter(|m| role(m) == "system");
        parts.extend(inline.filter_map(inline_system_text));
    }
    (!parts.is_empty()).then(|| parts.concat())
}

fn role(m: &Value) -> &str {
    str_field(m, "role").unwrap_or("")
}

/// The non-empty text blocks, billing headers dropped.
fn text_blocks(blocks: &[Value]) -> Vec<String> {
    blocks
        .iter()
        .filter(|b| str_field(b, "type") == Some("text"))
        .filter_map(|b| str_field(b, "text"))
        .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
        .map(str::to_owned)
        .collect()
}

/// `_extract_system_text` of an inline system message.
fn inline_system_text(m: &Value) -> Option<String> {
    match m.get("content") {
        Some(Value::String(s)) if s.starts_with(BILLING_HEADER) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(blocks)) => {
            let parts = text_blocks(blocks);
            (!parts.is_empty()).then(|| parts.concat())
        }
        _ => None,
    }
}

/// `_convert_messages` for one message; a user's tool results become `tool` messages placed
/// before the rest of the user message.
fn convert_message(msg: &Value, merge_inline_system: bool, out: &mut Vec<Value>) {
    let role = role(msg);
    if role == "system" {
        if !merge_inline_system
            && let Some(text) = inline_system_text(msg).filter(|t| !t.is_empty())
        {
            out.push(json!({"role": "system", "content": text}));
        }
        return;
    }
    let mut chat = Map::new();
    chat.insert("role".into(), json!(role));
    match msg.get("content") {
        Some(Value::String(s)) => {
            chat.insert("content".into(), json!(s));
        }
        Some(Value::Array(blocks)) => convert_blocks(blocks, role, &mut chat, out),
        _ => {}
    }
    // A user message left with no content (only tool results) is not sent.
    if role != "user" || chat.contains_key("content") {
        out.push(Value::Object(chat));
    }
}

/// `_convert_message_content`: texts and images become content parts, thinking becomes
/// `reasoning`, tool uses `tool_calls`, a user's tool results separate `tool` messages.
fn convert_blocks(
    blocks: &[Value],
    role: &str,
    chat: &mut Map<String, Value>,
    out: &mut Vec<Value>,
) {
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning = Vec::new();
    for b in blocks {
        match str_field(b, "type") {
            Some("text") => {
                if let Some(t) = str_field(b, "text").filter(|t| !t.is_empty()) {
                    parts.push(json!({"type": "text", "text": t}));
                }
            }
            Some("image") => {
                if let Some(src) = b.get("source").filter(|s| !s.is_null()) {
                    parts.push(json!({"type": "image_url", "image_url": {"url": image_url(src)}}));
                }
            }
            Some("thinking") => reasoning.extend(str_field(b, "thinking")),
            Some("tool_use") => calls.push(tool_call(b)),
            Some("tool_result") if role == "user" => user_tool_result(b, out),
            Some("tool_result") => {
                let text = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => validation::py_repr(v),
                };
                parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
            }
            _ => {}
        }
    }
    if !reasoning.is_empty() {
        chat.insert("reasoning".into(), json!(reasoning.concat()));
    }
    if !calls.is_empty() {
        chat.insert("tool_calls".into(), Value::Array(calls));
    }
    match parts.as_slice() {
        [] => {}
        [only] if only["type"] == "text" => {
            chat.insert("content".into(), only["text"].clone());
        }
        _ => {
            chat.insert("content".into(), Value::Array(parts));
        }
    }
}

/// `_convert_image_source_to_url`.
fn image_url(source: &Value) -> String {
    if str_field(source, "type") == Some("url") {
        return str_field(source, "url").unwrap_or("").to_owned();
    }
    let media = str_field(source, "media_type").unwrap_or("image/jpeg");
    let data = str_field(source, "data").unwrap_or("");
    format!("data:{media};base64,{data}")
}

/// `_convert_tool_use_block`: arguments are `json.dumps(input)`.
fn tool_call(b: &Value) -> Value {
    let id = str_field(b, "id").map_or_else(
        || format!("call_{}", super::unix_now_s() as u64),
        str::to_owned,
    );
    let input = b
        .get("input")
        .filter(|v| !v.is_null())
        .cloned()
        .unwrap_or(json!({}));
    json!({"id": id, "type": "function",
           "function": {"name": str_field(b, "name").unwrap_or(""),
                        "arguments": json_dumps(&input)}})
}

/// `_convert_user_tool_result`: a `tool` message with the result's text, then its images as
/// a user message and its tool references as another `tool` message.
fn user_tool_result(b: &Value, out: &mut Vec<Value>) {
    let call_id = str_field(b, "tool_use_id").unwrap_or("");
    let mut texts = Vec::new();
    let mut images = Vec::new();
    let mut refs = Vec::new();
    let text = match b.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            for item in items {
                match str_field(item, "type") {
                    Some("text") => texts.push(str_field(item, "text").unwrap_or("")),
                    Some("image") => {
                        let url = image_url(item.get("source").unwrap_or(&Value::Null));
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    Some("tool_reference") => {
                        let name = str_field(item, "tool_name").or(str_field(item, "name"));
                        if let Some(name) = name.filter(|n| !n.is_empty()) {
                            refs.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    out.push(json!({"role": "tool", "tool_call_id": call_id, "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
    if !refs.is_empty() {
        out.push(json!({"role": "tool", "tool_call_id": call_id, "content": refs}));
    }
}

/// Python's `json.dumps(v)` with its defaults: `", "` and `": "` separators, non-ASCII
/// escaped.
fn json_dumps(v: &Value) -> String {
    validation::py_layout(v, ascii_json_str, Value::to_string)
}

/// A JSON string literal with every non-ASCII character as `\uXXXX` (`ensure_ascii=True`).
fn ascii_json_str(s: &str) -> String {
    let mut out = String::new();
    for c in Value::from(s).to_string().chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Answers

/// `_build_anthropic_usage` of a finished request's chat usage.
fn usage(sum: &RequestSummary, block_size: u32) -> Value {
    let created = cache_write_tokens(sum, block_size);
    let input = sum
        .prompt_tokens
        .saturating_sub(sum.cached_tokens)
        .saturating_sub(created);
    json!({"input_tokens": input, "output_tokens": sum.output_tokens,
           "cache_creation_input_tokens": created, "cache_read_input_tokens": sum.cached_tokens})
}

/// Who the answer is from, and how it is labelled.
struct Answer {
    s: Arc<Shared>,
    /// The chat completion id vLLM reuses (`chatcmpl-...`).
    id: String,
    model: String,
    prompt_tokens: usize,
    /// A prefill for a remote decode: answer with `kv_transfer_params`.
    kv_transfer: bool,
}

/// `messages_full_converter`.
async fn full_answer(a: &Answer, generation: Generation) -> Result<Value, ApiError> {
    let (text, summary) = generation.finish().await?;
    let mut body = json!({
        "id": a.id,
        "type": "message",
        "role": "assistant",
        // An empty completion is still one (empty) text block.
        "content": [{"type": "text", "text": text}],
        "model": a.model,
        "stop_reason": "max_tokens",
        "usage": usage(&summary, a.s.info.block_size),
    });
    if a.kv_transfer {
        body["kv_transfer_params"] = crate::pd::prefill_answer_params(&a.s.replica);
    }
    Ok(body)
}

/// One SSE frame of vLLM's `message_stream_converter` (`wrap_data_with_event`).
fn frame(event: &str, data: &Value) -> String {
    format!("event: {event}\ndata: {data}\n\n")
}

/// The stream vLLM derives from the chat stream: `message_start` at the first token (with the
/// chat's first-chunk usage: the prompt, no output), a text block opened by the first text and
/// fed one `content_block_delta` per engine step, then `content_block_stop`, `message_delta`
/// (stop reason and final usage) and `message_stop`.
struct EventStream {
    a: Answer,
    generation: Generation,
    started: bool,
    block_open: bool,
    done: bool,
}

impl EventStream {
    async fn next(&mut self) -> Option<String> {
        if self.done {
            return None;
        }
        let step = self.generation.next_step().await?;
        let mut out = String::new();
        if !self.started {
            self.started = true;
            let start = json!({"type": "message_start", "message": {
                "id": self.a.id, "type": "message", "role": "assistant", "content": [],
                "model": self.a.model, "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.a.prompt_tokens, "output_tokens": 0}}});
            out.push_str(&frame("message_start", &start));
        }
        if !step.text.is_empty() {
            if !self.block_open {
                self.block_open = true;
                let start = json!({"type": "content_block_start",
                                   "content_block": {"type": "text", "text": ""}, "index": 0});
                out.push_str(&frame("content_block_start", &start));
            }
            let delta = json!({"type": "content_block_delta",
                               "delta": {"type": "text_delta", "text": step.text}, "index": 0});
            out.push_str(&frame("content_block_delta", &delta));
        }
        if let Some(summary) = step.finished {
            self.done = true;
            if self.block_open {
                let stop = json!({"type": "content_block_stop", "index": 0});
                out.push_str(&frame("content_block_stop", &stop));
            }
            let delta = json!({"type": "message_delta",
                               "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                               "usage": usage(&summary, self.a.s.info.block_size)});
            out.push_str(&frame("message_delta", &delta));
            out.push_str(&frame("message_stop", &json!({"type": "message_stop"})));
        }
        Some(out)
    }
}

/// `translate_error_response` (api_router.py) for errors the handler returns.
fn anthropic_error(e: ApiError) -> Response {
    if e.framework {
        return e.into_response();
    }
    let code = e.status.as_u16();
    let kind = match code {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        c if c >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    (e.status, axum::Json(body)).into_response()
}

/// `POST /v1/messages`.
pub(super) async fn create(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match create_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => anthropic_error(e),
    }
}

async fn create_inner(
    s: Arc<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    s.inject_faults().await?;
    let req = parse_request(&body, false)?;
    let lora = s.resolve_model(Some(&req.model))?;
    let salt = cache_salt(req.cache_salt.clone())?;
    let prompt = s.chat_prompt_of(
        &chat_messages(&req, s.merge_inline_system),
        PromptEnd::Generate,
    )?;
    let prompt_tokens = prompt.len();
    let (remote_prefilled, kv_transfer) =
        disaggregation(&s, &headers, "/v1/messages", &body, prompt_tokens).await;
    let generation = Generation::start(
        &s,
        EngineJob {
            lora,
            cache_salt: salt,
            prompt,
            max_tokens: req.max_tokens,
            remote_prefilled,
        },
    )?;
    let answer = Answer {
        id: format!("chatcmpl-sim-{}", generation.guard.id),
        s: s.clone(),
        model: req.model,
        prompt_tokens,
        kv_transfer,
    };
    if !req.stream {
        return Ok(axum::Json(full_answer(&answer, generation).await?).into_response());
    }
    let st = EventStream {
        a: answer,
        generation,
        started: false,
        block_open: false,
        done: false,
    };
    Ok(sse_response(futures_util::stream::unfold(
        st,
        |mut st| async move {
            let frames = st.next().await?;
            Some((frames, st))
        },
    )))
}

/// `POST /v1/messages/count_tokens`: the rendered prompt's length, with the
/// `context_management` vLLM adds.
pub(super) async fn count_tokens(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let inner = || -> Result<Response, ApiError> {
        let req = parse_request(&body, true)?;
        s.resolve_model(Some(&req.model))?;
        let msgs = chat_messages(&req, s.merge_inline_system);
        let n = s.chat_prompt_of(&msgs, PromptEnd::Generate)?.len();
        let body = json!({"input_tokens": n, "context_management": {"original_input_tokens": n}});
        Ok(axum::Json(body).into_response())
    };
    inner().unwrap_or_else(anthropic_error)
}

/// `POST /v1/messages/render` (scale_out/render): the prompt ids, in the shape the simulator's
/// other render endpoints answer; its errors keep the OpenAI shape, as vLLM's render router
/// does not translate them.
pub(super) async fn render(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let inner = || -> Result<Response, ApiError> {
        let req = parse_request(&body, false)?;
        s.resolve_model(Some(&req.model))?;
        let msgs = chat_messages(&req, s.merge_inline_system);
        let tokens = s.chat_prompt_of(&msgs, PromptEnd::Generate)?;
        Ok(axum::Json(json!({"token_ids": tokens, "model": s.model})).into_response())
    };
    inner().unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{ChatMl, JinjaTemplate};
    use axum::http::StatusCode;

    fn request(v: Value) -> MessagesRequest {
        parse_request(v.to_string().as_bytes(), false).unwrap()
    }

    #[test]
    fn system_tools_and_tool_results_become_chat_messages_like_vllm() {
        let req = request(json!({
            "model": "m", "max_tokens": 5,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: 123"},
                       {"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "tu1", "name": "ls", "input": {"path": "/", "é": 1}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu1",
                     "content": [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "b"}]},
                    {"type": "text", "text": "now read a.txt"}
                ]}
            ]
        }));
        let msgs = chat_messages(&req, false);
        assert_eq!(msgs[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(msgs[1], json!({"role": "user", "content": "list files"}));
        assert_eq!(msgs[2]["reasoning"], "hmm");
        assert_eq!(msgs[2]["content"], "Let me look.");
        assert_eq!(
            msgs[2]["tool_calls"][0]["function"]["arguments"],
            "{\"path\": \"/\", \"\\u00e9\": 1}"
        );
        assert_eq!(
            msgs[3],
            json!({"role": "tool", "tool_call_id": "tu1", "content": "a.txt\nb"})
        );
        assert_eq!(
            msgs[4],
            json!({"role": "user", "content": "now read a.txt"})
        );
    }

    #[test]
    fn a_user_message_of_only_tool_results_adds_no_user_message() {
        let req = request(json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}
        ]}));
        assert_eq!(
            chat_messages(&req, false),
            vec![json!({"role": "tool", "tool_call_id": "t", "content": "ok"})]
        );
    }

    #[test]
    fn inline_system_messages_merge_only_when_the_template_needs_it() {
        let req = request(json!({"model": "m", "max_tokens": 1, "system": "A",
            "messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "B"}]}));
        assert_eq!(chat_messages(&req, true)[0]["content"], "AB");
        assert_eq!(chat_messages(&req, false).len(), 3);
        assert!(!template_needs_merged_system(&ChatMl));
        let strict = JinjaTemplate::new(
            "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
             {{ raise_exception('System message must be first') }}{% endif %}\
             {{ m.content }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert!(template_needs_merged_system(&strict));
    }

    #[test]
    fn validation_errors_read_like_vllm() {
        let e = parse_request(br#"{"model": "m", "messages": []}"#, false).unwrap_err();
        assert!(e.framework);
        assert_eq!(e.param.as_deref(), Some("body.max_tokens"));
        assert!(
            e.message.contains("'msg': 'Field required'"),
            "{}",
            e.message
        );
        let e = parse_request(br#"{"model": "m", "messages": [], "max_tokens": 0}"#, false)
            .unwrap_err();
        assert!(e.message.contains("max_tokens must be positive"));
        assert!(parse_request(br#"{"model": "m", "messages": []}"#, true).is_ok());
        let e = parse_request(
            br#"{"model": "m", "max_tokens": 1, "messages": [{"role": "bot", "content": "x"}]}"#,
            false,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body.messages.0.role"));
    }

    #[test]
    fn handler_errors_take_the_anthropic_shape() {
        let r = anthropic_error(ApiError::new(StatusCode::NOT_FOUND, "gone"));
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let r = anthropic_error(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "busy"));
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
