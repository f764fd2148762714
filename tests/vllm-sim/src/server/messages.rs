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

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Map, Value, json};

use super::validation::{self, FieldError};
use super::{
    ApiError, EngineJob, Generation, PromptEnd, Shared, cache_salt, cache_write_tokens,
    disaggregation, sse_response,
};
use crate::engine::RequestSummary;
use crate::tokenizer::{ChatMessage, ChatTemplate};
use vllm_wire::agent_chat;

/// Anthropic's Messages API paths, which the server mounts beside the OpenAI ones.
pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/messages", post(create))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/messages/render", post(render))
}

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
    /// The validated body, whose `system` and `messages` become the chat messages.
    prompt: Map<String, Value>,
    /// Absent only on `count_tokens`.
    max_tokens: Option<u32>,
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
    if let Some(v) = body.get("system").filter(|v| !v.is_null())
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
    let (model, cache_salt) = (
        model.unwrap_or_default().to_owned(),
        salt.map(str::to_owned),
    );
    Ok(MessagesRequest {
        model,
        prompt: body,
        max_tokens,
        stream: stream.unwrap_or(false),
        cache_salt,
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

/// The OpenAI chat messages vLLM builds from a Messages request: the converter the router's
/// precise mode uses ([`agent_chat`]), as the serving process runs it.
fn chat_messages(req: &MessagesRequest, merge_inline_system: bool) -> Result<Vec<Value>, ApiError> {
    let converter = agent_chat::Converter::Server {
        unix_now_s: super::unix_now_s() as u64,
    };
    agent_chat::anthropic_chat_messages(&req.prompt, merge_inline_system, converter)
        .map_err(|e| super::bad_request(e.to_string()))
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
        &chat_messages(&req, s.merge_inline_system)?,
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
        let msgs = chat_messages(&req, s.merge_inline_system)?;
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
        let msgs = chat_messages(&req, s.merge_inline_system)?;
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
        let msgs = chat_messages(&req, false).unwrap();
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
            chat_messages(&req, false).unwrap(),
            vec![json!({"role": "tool", "tool_call_id": "t", "content": "ok"})]
        );
    }

    #[test]
    fn inline_system_messages_merge_only_when_the_template_needs_it() {
        let req = request(json!({"model": "m", "max_tokens": 1, "system": "A",
            "messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "B"}]}));
        assert_eq!(chat_messages(&req, true).unwrap()[0]["content"], "AB");
        assert_eq!(chat_messages(&req, false).unwrap().len(), 3);
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
