//! The OpenAI Responses API as vLLM 0.33 serves it for a non-Harmony model
//! (`vllm/entrypoints/openai/responses/`): `POST /v1/responses`, `GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel` and the stateless `POST /v1/responses/render`.
//!
//! - Input items become OpenAI chat messages as vLLM's `construct_input_messages` builds them
//!   (utils.py): `instructions` as a system message; with `previous_response_id`, the previous
//!   response's messages (its system message dropped: instructions do not carry over) and its
//!   output text as assistant messages; then the new input. They render through the chat path,
//!   so a chain of responses extends one prompt and reuses its cached blocks.
//! - [`Store`] is vLLM's in-memory `response_store` + `msg_store`, off unless enabled. Off,
//!   `store: true` is silently ignored (serving.py `_create_responses`) and every
//!   `previous_response_id` is unknown: 404, as for an id another replica answered.
//! - The simulated model always stops at its token limit (finish reason `length`), and vLLM
//!   reports such an answer as `status: "incomplete"` with `incomplete_details.reason`
//!   `"max_output_tokens"`, its message item `incomplete` too, and ends a stream with
//!   `response.incomplete` (serving.py `responses_full_generator`, `responses_stream_generator`;
//!   utils.py `response_item_status`).
//! - Background mode (`background: true`, store on) answers `queued` at once and generates in a
//!   task, as vLLM does; `cancel` stops it. Only `queued`/`in_progress` answers can be
//!   cancelled; any other is refused with vLLM's "Cannot cancel a synchronous response.".

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hashbrown::HashMap;
use parking_lot::Mutex;
use serde_json::{Map, Value, json};
use tokio::sync::Notify;

use super::validation::{self, FieldError};
use super::{
    ApiError, ApiResult, EngineJob, Generation, PromptEnd, Shared, bad_request, cache_salt,
    cache_write_tokens, disaggregation, query_bool, sse_response, unix_now_secs, vllm_validation,
};
use crate::engine::RequestSummary;

/// The Responses API's paths, which the server mounts beside the chat and completion APIs.
pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/responses", post(create))
        .route("/v1/responses/render", post(render))
        .route("/v1/responses/{response_id}", get(retrieve))
        .route("/v1/responses/{response_id}/cancel", post(cancel))
}

/// vLLM's switch for the store (`vllm/envs.py`), read as `bool(int(value))`.
pub const STORE_ENV: &str = "VLLM_ENABLE_RESPONSES_API_STORE";

/// Responses one process keeps. vLLM keeps every one forever (its own FIXME warns of the
/// leak); the simulator drops the oldest beyond this, so a long run cannot exhaust memory.
pub const MAX_STORED_RESPONSES: usize = 10_000;

/// Status of every finished answer: the simulated model always stops at `max_output_tokens`.
const FINISHED_STATUS: &str = "incomplete";

// ---------------------------------------------------------------------------------------------
// The store

/// The per-process store of answers and the chat messages they were rendered from.
pub(super) struct Store {
    enabled: bool,
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    /// Ids, oldest first (for eviction).
    order: VecDeque<String>,
    entries: HashMap<String, Entry>,
}

struct Entry {
    response: Value,
    /// The chat messages of the response's prompt (vLLM's `msg_store`).
    messages: Vec<Value>,
    /// The generation of a background response still running.
    task: Option<tokio::task::AbortHandle>,
    /// The events of a background stream.
    events: Option<Arc<EventLog>>,
}

/// Why a cancel was refused.
enum CancelRefusal {
    NotFound,
    NotRunning,
}

impl Store {
    /// A store that keeps answers only when `enabled`.
    pub(super) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            inner: Mutex::new(StoreInner::default()),
        }
    }

    /// The stored answer `id` and its prompt's messages.
    fn get(&self, id: &str) -> Option<(Value, Vec<Value>)> {
        let inner = self.inner.lock();
        let e = inner.entries.get(id)?;
        Some((e.response.clone(), e.messages.clone()))
    }

    /// Keeps `response` (replacing an earlier version of it) unless it was cancelled meanwhile,
    /// as `responses_full_generator` stores; evicts the oldest beyond the bound.
    fn keep(&self, id: &str, response: Value, messages: Vec<Value>) {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.entries.get_mut(id) {
            if e.response["status"] != "cancelled" {
                e.response = response;
                e.messages = messages;
                e.task = None;
            }
            return;
        }
        let entry = Entry {
            response,
            messages,
            task: None,
            events: None,
        };
        inner.entries.insert(id.to_owned(), entry);
        inner.order.push_back(id.to_owned());
        while inner.order.len() > MAX_STORED_RESPONSES {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some(e) = inner.entries.remove(&old) {
                e.stop();
            }
        }
    }

    /// Attaches the running background generation (and its event log) to `id`.
    fn attach(&self, id: &str, task: tokio::task::AbortHandle, events: Option<Arc<EventLog>>) {
        match self.inner.lock().entries.get_mut(id) {
            Some(e) if e.response["status"] != "cancelled" => {
                e.task = (!task.is_finished()).then_some(task);
                e.events = events;
            }
            _ => task.abort(),
        }
    }

    /// The event log of background stream `id`.
    fn events(&self, id: &str) -> Option<Arc<EventLog>> {
        self.inner.lock().entries.get(id)?.events.clone()
    }

    /// Marks a failed background response `failed` (`_run_background_request`).
    fn fail(&self, id: &str) {
        if let Some(e) = self.inner.lock().entries.get_mut(id)
            && !matches!(
                e.response["status"].as_str(),
                Some("completed" | "cancelled")
            )
        {
            e.response["status"] = json!("failed");
        }
    }

    /// vLLM's `cancel_responses`: only a `queued` or `in_progress` answer is cancelled (its
    /// generation stopped); the cancelled answer is returned.
    fn cancel(&self, id: &str) -> Result<Value, CancelRefusal> {
        let mut inner = self.inner.lock();
        let e = inner.entries.get_mut(id).ok_or(CancelRefusal::NotFound)?;
        if !matches!(
            e.response["status"].as_str(),
            Some("queued" | "in_progress")
        ) {
            return Err(CancelRefusal::NotRunning);
        }
        e.response["status"] = json!("cancelled");
        e.stop();
        Ok(e.response.clone())
    }
}

impl Entry {
    /// Stops a background generation and ends its readers' streams.
    fn stop(&self) {
        if let Some(t) = &self.task {
            t.abort();
        }
        if let Some(log) = &self.events {
            log.close();
        }
    }
}

/// The events of a background stream, for its client and for `GET ...?stream=true` readers
/// (vLLM's `event_store`).
struct EventLog {
    events: Mutex<Vec<Event>>,
    notify: Notify,
    closed: AtomicBool,
}

impl EventLog {
    fn new() -> Self {
        Self {
            events: Mutex::new(Vec::new()),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
        }
    }

    fn push(&self, events: Vec<Event>) {
        self.events.lock().extend(events);
        self.notify.notify_waiters();
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// The SSE frames from index `from` on, as they come, until the terminal event (or a
    /// cancel, where vLLM's reader would wait forever).
    fn replay(self: Arc<Self>, from: usize) -> impl futures_util::Stream<Item = String> {
        futures_util::stream::unfold((self, from, false), |(log, mut at, done)| async move {
            if done {
                return None;
            }
            let ev = loop {
                // Registered before the check, so a push in between still wakes it.
                let notified = log.notify.notified();
                let next = log.events.lock().get(at).cloned();
                if let Some(ev) = next {
                    break ev;
                }
                if log.closed.load(Ordering::Acquire) {
                    return None;
                }
                notified.await;
            };
            at += 1;
            let done = matches!(ev.0, "response.completed" | "response.incomplete");
            Some((ev.frame(), (log, at, done)))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The request

/// The `ResponsesRequest` fields (protocol.py) the simulator acts on; the echoed ones are read
/// from `body` when the answer is built.
struct ResponsesRequest {
    body: Map<String, Value>,
    model: Option<String>,
    input: Value,
    instructions: Option<String>,
    /// `tool_choice` after vLLM's `check_tool_usage` (`"none"` when there are no tools).
    tool_choice: Value,
    previous_response_id: Option<String>,
    store: bool,
    stream: bool,
    background: bool,
    max_output_tokens: Option<i64>,
    request_id: Option<String>,
    cache_salt: Option<String>,
}

/// Python's truth value of a JSON value (`if data.get("background")`).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Keeps the value of a field check, or records its error.
fn checked<T>(errors: &mut Vec<FieldError>, r: Result<Option<T>, FieldError>) -> Option<T> {
    r.unwrap_or_else(|e| {
        errors.push(e);
        None
    })
}

/// Parses and validates a body as FastAPI and `ResponsesRequest`'s validators do: the
/// `model_validator`s first (their `VLLMValidationError`s reach the client as 400
/// `BadRequestError`), then the fields (400 `Bad Request` listing pydantic's errors).
fn parse_request(raw: &[u8]) -> Result<ResponsesRequest, ApiError> {
    let body = validation::json_object(raw)?;
    let tool_choice = check_tool_usage(&body)?;
    if body.get("prompt").is_some_and(|p| !p.is_null()) {
        return Err(vllm_validation(
            "prompt template is not supported",
            "prompt",
        ));
    }
    let background = body.get("background").is_some_and(truthy);
    if background && !body.get("store").is_none_or(truthy) {
        return Err(vllm_validation(
            "background can only be used when `store` is true",
            "background",
        ));
    }
    let salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => cache_salt(Some(s.clone()))?,
        Some(_) => {
            return Err(vllm_validation(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
                "cache_salt",
            ));
        }
    };
    let mut errors = validation::require(&body, &["input"]);
    let model = checked(&mut errors, validation::string_field(&body, "model"));
    let instructions = checked(&mut errors, validation::string_field(&body, "instructions"));
    let previous = checked(
        &mut errors,
        validation::string_field(&body, "previous_response_id"),
    );
    let request_id = checked(&mut errors, validation::string_field(&body, "request_id"));
    let max_output_tokens = checked(
        &mut errors,
        validation::int_field(&body, "max_output_tokens"),
    );
    let store = match body.get("store") {
        None => true,
        Some(_) => checked(&mut errors, validation::bool_field(&body, "store")).unwrap_or(false),
    };
    let stream = checked(&mut errors, validation::bool_field(&body, "stream")).unwrap_or(false);
    checked(&mut errors, validation::list_field(&body, "tools"));
    let input = body.get("input").cloned().unwrap_or(Value::Null);
    if !input.is_null() && !input.is_string() && !input.is_array() {
        errors.extend(validation::str_or_list_errors("input", &input));
    }
    if !errors.is_empty() {
        return Err(validation::validation_error(&errors));
    }
    Ok(ResponsesRequest {
        model: model.map(str::to_owned),
        input,
        instructions: instructions.map(str::to_owned),
        tool_choice,
        previous_response_id: previous.map(str::to_owned),
        store,
        stream,
        background,
        max_output_tokens,
        request_id: request_id.map(str::to_owned),
        cache_salt: salt,
        body,
    })
}

/// vLLM's `check_tool_usage` validator: without tools, `auto`/`none` become `"none"` and
/// `required` or a named tool is refused; a named tool must be among the tools.
fn check_tool_usage(body: &Map<String, Value>) -> Result<Value, ApiError> {
    let tools = body.get("tools").and_then(Value::as_array);
    let has_tools = tools.is_some_and(|t| !t.is_empty());
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => json!("auto"),
        Some(c) => c.clone(),
    };
    let named = matches!(
        choice.get("type").and_then(Value::as_str),
        Some("function" | "custom")
    );
    let not_found = || {
        vllm_validation(
            "Tool choice 'function' not found in 'tools' parameter.",
            "tool_choice",
        )
    };
    if !has_tools {
        return match choice.as_str() {
            Some("auto" | "none") => Ok(json!("none")),
            Some("required") => Err(vllm_validation(
                "Tool choice 'required' must be specified with 'tools' parameter.",
                "tool_choice",
            )),
            _ if named => Err(not_found()),
            _ => Ok(choice),
        };
    }
    if named {
        let name = choice.get("name").and_then(Value::as_str).unwrap_or("");
        let declared = tools
            .into_iter()
            .flatten()
            .any(|t| tool_names(t).iter().any(|n| n == name));
        if name.is_empty() || !declared {
            return Err(not_found());
        }
    }
    Ok(choice)
}

/// The names a tool choice may give a tool: its own, or for each tool of a namespace
/// `namespace__name` and its local name (`_resolve_named_tool_choice`).
fn tool_names(tool: &Value) -> Vec<String> {
    let name = str_field(tool, "name");
    if str_field(tool, "type") != Some("namespace") {
        return name.map(str::to_owned).into_iter().collect();
    }
    let ns = name.unwrap_or("");
    let locals = tool["tools"].as_array().into_iter().flatten();
    locals
        .filter_map(|t| str_field(t, "name"))
        .flat_map(|n| [format!("{ns}__{n}"), n.to_owned()])
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rendering: input items to chat messages (utils.py)

/// A stored response a new one continues (`previous_response_id`).
struct Previous {
    response: Value,
    messages: Vec<Value>,
}

/// The chat messages of a turn (`construct_input_messages`).
fn input_messages(
    instructions: Option<&str>,
    input: &Value,
    previous: Option<&Previous>,
) -> Result<Vec<Value>, ApiError> {
    let mut msgs = Vec::new();
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        msgs.push(json!({"role": "system", "content": text}));
    }
    if let Some(p) = previous {
        let not_system = |m: &&Value| m.get("role").and_then(Value::as_str) != Some("system");
        msgs.extend(p.messages.iter().filter(not_system).cloned());
        // Only message items carry over; reasoning and tool calls of the output do not.
        for item in p.response["output"].as_array().into_iter().flatten() {
            if item.get("type").and_then(Value::as_str) != Some("message") {
                continue;
            }
            for part in item["content"].as_array().into_iter().flatten() {
                msgs.push(json!({"role": "assistant", "content": part.get("text")}));
            }
        }
    }
    match input {
        Value::String(text) => msgs.push(json!({"role": "user", "content": text})),
        items => {
            // `construct_chat_messages_with_tool_call`: items merge only among themselves.
            let mut turn = Vec::new();
            for item in items.as_array().into_iter().flatten() {
                push_item(item, &mut turn)?;
            }
            msgs.extend(turn);
        }
    }
    Ok(msgs)
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// Adds one input item to the turn's messages (`_construct_message_from_response_item`): a
/// tool call, reasoning or assistant text joins the previous assistant message when that
/// lacks one.
fn push_item(item: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let kind = str_field(item, "type");
    let role = str_field(item, "role");
    if let Some(call) = tool_call(item, kind) {
        merge_or_push(out, "tool_calls", call, true);
        return Ok(());
    }
    match kind {
        Some("reasoning") if item.get("summary").is_some_and(Value::is_array) => {
            if item.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                return Err(vllm_validation(
                    "Encrypted content is not supported.",
                    "input",
                ));
            }
            let first_text = |key: &str| {
                item[key]
                    .as_array()
                    .and_then(|parts| parts.first())
                    .and_then(|p| str_field(p, "text"))
            };
            let text = first_text("content").or_else(|| first_text("summary"));
            merge_or_push(out, "reasoning", json!(text.unwrap_or("")), false);
            return Ok(());
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            out.push(json!({"role": "tool", "content": item.get("output"),
                            "tool_call_id": item.get("call_id")}));
            return Ok(());
        }
        _ => {}
    }
    if role == Some("assistant") {
        let text = match item.get("content") {
            Some(Value::String(s)) => Some(s.as_str()),
            Some(Value::Array(parts)) => parts.first().and_then(|p| str_field(p, "text")),
            _ => None,
        };
        if let Some(text) = text {
            merge_or_push(out, "content", json!(text), false);
            return Ok(());
        }
    }
    if role.is_some() {
        out.push(item.clone());
        return Ok(());
    }
    let kind = kind.unwrap_or("None");
    Err(vllm_validation(
        &format!("Unsupported input item type: {kind}"),
        "input",
    ))
}

/// The chat tool call of a `function_call` (or `custom_tool_call`) item that parses as one.
fn tool_call(item: &Value, kind: Option<&str>) -> Option<Value> {
    let call_id = str_field(item, "call_id")?;
    let name = str_field(item, "name")?;
    let (name, arguments) = match kind? {
        "function_call" => {
            let arguments = str_field(item, "arguments")?;
            match str_field(item, "namespace") {
                Some(ns) => (format!("{ns}__{name}"), arguments.to_owned()),
                None => (name.to_owned(), arguments.to_owned()),
            }
        }
        // `encode_custom_tool_input`: `json.dumps({"input": payload})`.
        "custom_tool_call" => {
            let payload = Value::from(str_field(item, "input").unwrap_or(""));
            (name.to_owned(), format!("{{\"input\": {payload}}}"))
        }
        _ => return None,
    };
    Some(
        json!({"id": call_id, "function": {"name": name, "arguments": arguments},
                "type": "function"}),
    )
}

/// Sets `key` on the last message when it is an assistant message without it (appending to
/// its `tool_calls` when `list`), else appends a new assistant message holding it.
fn merge_or_push(out: &mut Vec<Value>, key: &str, value: Value, list: bool) {
    if let Some(last) = out.last_mut()
        && last.get("role").and_then(Value::as_str) == Some("assistant")
    {
        match last.get_mut(key) {
            Some(Value::Array(calls)) if list => {
                calls.push(value);
                return;
            }
            None | Some(Value::Null) => {
                last[key] = if list { json!([value]) } else { value };
                return;
            }
            _ => {}
        }
    }
    let value = if list { json!([value]) } else { value };
    out.push(json!({"role": "assistant", key: value}));
}

/// `should_continue_final_message`: the input ends with an unfinished assistant message or
/// reasoning item, which the model continues instead of starting a new turn.
fn continues_final_message(input: &Value) -> bool {
    let Some(last) = input.as_array().and_then(|items| items.last()) else {
        return false;
    };
    matches!(
        str_field(last, "type").unwrap_or("message"),
        "message" | "reasoning"
    ) && matches!(
        str_field(last, "status"),
        Some("in_progress" | "incomplete")
    )
}

// ---------------------------------------------------------------------------------------------
// Answers

/// One answer being produced: the response object's fields (echoed from the request, in
/// `ResponsesResponse`'s field order) and what the store needs.
struct Answer {
    s: Arc<Shared>,
    id: String,
    fields: Map<String, Value>,
    messages: Vec<Value>,
    store: bool,
}

impl Answer {
    /// The response object with `status`, `output` and usage filled in
    /// (`ResponsesResponse.from_request`).
    fn object(&self, status: &str, output: Vec<Value>, summary: Option<&RequestSummary>) -> Value {
        let mut o = self.fields.clone();
        if status == "incomplete" {
            o["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        o["output"] = Value::Array(output);
        o["status"] = json!(status);
        o["usage"] = summary.map_or(Value::Null, |sum| usage(sum, self.s.info.block_size));
        Value::Object(o)
    }

    /// Stores the finished answer when the request asked to and the store is on.
    fn keep(&self, response: &Value) {
        if self.store {
            self.s
                .responses
                .keep(&self.id, response.clone(), self.messages.clone());
        }
    }
}

/// The `ResponsesResponse` fields a request decides, in the class's field order; `status`,
/// `output`, `usage` and `incomplete_details` are placeholders [`Answer::object`] fills.
fn response_fields(
    req: &ResponsesRequest,
    id: &str,
    created_at: u64,
    model: &str,
    max_tokens: u32,
    kv_transfer: Option<Value>,
) -> Map<String, Value> {
    let b = &req.body;
    let echo = |k: &str| b.get(k).cloned().unwrap_or(Value::Null);
    let float = |k: &str, default: f64| b.get(k).and_then(Value::as_f64).unwrap_or(default);
    let temperature = float("temperature", 1.0);
    // SamplingParams: a greedy temperature resets top_p to 1.
    let top_p = if temperature < 1e-5 {
        1.0
    } else {
        float("top_p", 1.0)
    };
    let logprobs = b
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|i| i.iter().any(|x| x == "message.output_text.logprobs"));
    let cache_options = b
        .get("prompt_cache_options")
        .and_then(Value::as_object)
        .map_or(Value::Null, |o| {
            json!({"mode": o.get("mode").cloned().unwrap_or(json!("implicit")),
                   "ttl": o.get("ttl").cloned().unwrap_or(json!("30m")),
                   "comparison_response_id": o.get("comparison_response_id")})
        });
    let retention = match b.get("prompt_cache_retention") {
        Some(v) if v == "in-memory" => json!("in_memory"),
        other => other.cloned().unwrap_or(Value::Null),
    };
    let or = |k: &str, default: Value| match b.get(k) {
        None | Some(Value::Null) => default,
        Some(v) => v.clone(),
    };
    let fields = json!({
        "id": id,
        "created_at": created_at,
        "incomplete_details": null,
        "instructions": req.instructions,
        "metadata": echo("metadata"),
        "model": model,
        "object": "response",
        "output": [],
        "parallel_tool_calls": or("parallel_tool_calls", json!(true)),
        "temperature": temperature,
        "tool_choice": req.tool_choice,
        "tools": or("tools", json!([])),
        "top_p": top_p,
        "background": req.background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": echo("max_tool_calls"),
        "previous_response_id": req.previous_response_id,
        "prompt": null,
        "prompt_cache_options": cache_options,
        "prompt_cache_key": echo("prompt_cache_key"),
        "prompt_cache_retention": retention,
        "reasoning": echo("reasoning"),
        "safety_identifier": echo("safety_identifier"),
        "service_tier": or("service_tier", json!("auto")),
        "status": null,
        "text": echo("text"),
        "top_logprobs": if logprobs { or("top_logprobs", json!(0)) } else { Value::Null },
        "truncation": or("truncation", json!("disabled")),
        "usage": null,
        "user": echo("user"),
        "presence_penalty": float("presence_penalty", 0.0),
        "frequency_penalty": float("frequency_penalty", 0.0),
        "kv_transfer_params": kv_transfer,
        "ec_transfer_params": null,
        "input_messages": null,
        "output_messages": null,
    });
    match fields {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// `ResponseUsage` (protocol.py), from the finished request's counts.
fn usage(sum: &RequestSummary, block_size: u32) -> Value {
    json!({
        "input_tokens": sum.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": sum.cached_tokens,
            "cache_write_tokens": cache_write_tokens(sum, block_size),
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": sum.output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": sum.prompt_tokens + sum.output_tokens,
    })
}

/// `ResponseOutputText` (openai SDK): the generated text of a message item.
fn output_text(text: &str, logprobs: Value) -> Value {
    json!({"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs})
}

/// `ResponseOutputMessage` (openai SDK), the assistant's message item.
fn output_message(id: &str, content: Vec<Value>, status: &str) -> Value {
    json!({"id": id, "content": content, "role": "assistant", "status": status,
           "type": "message", "phase": null})
}

/// What `POST /v1/responses` answers unstreamed: the finished response, stored if asked.
async fn full_answer(a: &Answer, generation: Generation) -> Result<Value, ApiError> {
    let (text, summary) = generation.finish().await?;
    // Without a parser vLLM builds the item itself; empty text gives no content part.
    let content = if text.is_empty() {
        vec![]
    } else {
        vec![output_text(&text, Value::Null)]
    };
    let item = output_message(&a.s.random_id("msg_"), content, FINISHED_STATUS);
    let response = a.object(FINISHED_STATUS, vec![item], Some(&summary));
    a.keep(&response);
    Ok(response)
}

// ---------------------------------------------------------------------------------------------
// Streaming (streaming_events.py `SimpleStreamingEventProcessor`)

/// One SSE event: its `type` and its data object.
#[derive(Debug, Clone)]
struct Event(&'static str, Value);

impl Event {
    /// The frame `_convert_stream_to_sse_events` writes (api_router.py).
    fn frame(&self) -> String {
        format!("event: {}\ndata: {}\n\n", self.0, self.1)
    }
}

/// The message item a stream has opened.
struct OpenItem {
    id: String,
    text: String,
}

/// The events of a streamed answer, in vLLM's order: `response.created` and
/// `response.in_progress` at once (before any token), `output_item.added` and
/// `content_part.added` with the first text, one `output_text.delta` per engine step with
/// text, then `output_text.done`, `content_part.done`, `output_item.done` and the terminal
/// `response.incomplete` with usage. Every event carries its `sequence_number` from 0.
struct EventStream {
    a: Answer,
    generation: Generation,
    seq: u64,
    started: bool,
    item: Option<OpenItem>,
    done: bool,
}

impl EventStream {
    fn new(a: Answer, generation: Generation) -> Self {
        Self {
            a,
            generation,
            seq: 0,
            started: false,
            item: None,
            done: false,
        }
    }

    fn seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    /// The next events; `None` once the stream ended (or the request was dropped).
    async fn next(&mut self) -> Option<Vec<Event>> {
        if self.done {
            return None;
        }
        if !self.started {
            self.started = true;
            let initial = self.a.object("in_progress", vec![], None);
            let created = json!({"response": initial.clone(), "sequence_number": self.seq(),
                                 "type": "response.created"});
            let progress = json!({"response": initial, "sequence_number": self.seq(),
                                  "type": "response.in_progress"});
            return Some(vec![
                Event("response.created", created),
                Event("response.in_progress", progress),
            ]);
        }
        let step = self.generation.next_step().await?;
        let mut out = Vec::new();
        if !step.text.is_empty() {
            if self.item.is_none() {
                out.extend(self.open_item());
            }
            out.push(self.delta(&step.text));
        }
        if let Some(summary) = step.finished {
            self.done = true;
            let (events, output) = self.close_item();
            out.extend(events);
            let response = self.a.object(FINISHED_STATUS, output, Some(&summary));
            self.a.keep(&response);
            out.push(Event(
                "response.incomplete",
                json!({"response": response, "sequence_number": self.seq(),
                       "type": "response.incomplete"}),
            ));
        }
        Some(out)
    }

    fn open_item(&mut self) -> Vec<Event> {
        let id = self.a.s.random_id("msg_");
        let added = json!({"item": output_message(&id, vec![], "in_progress"), "output_index": 0,
                           "sequence_number": self.seq(), "type": "response.output_item.added"});
        let part = json!({"content_index": 0, "item_id": id, "output_index": 0,
                          "part": output_text("", json!([])), "sequence_number": self.seq(),
                          "type": "response.content_part.added"});
        self.item = Some(OpenItem {
            id,
            text: String::new(),
        });
        vec![
            Event("response.output_item.added", added),
            Event("response.content_part.added", part),
        ]
    }

    fn delta(&mut self, text: &str) -> Event {
        let seq = self.seq();
        let item = self.item.as_mut().map_or(String::new(), |i| {
            i.text.push_str(text);
            i.id.clone()
        });
        Event(
            "response.output_text.delta",
            json!({"content_index": 0, "delta": text, "item_id": item, "logprobs": [],
                   "output_index": 0, "sequence_number": seq,
                   "type": "response.output_text.delta"}),
        )
    }

    /// The done events of the open item, and the answer's output items.
    fn close_item(&mut self) -> (Vec<Event>, Vec<Value>) {
        let Some(item) = self.item.take() else {
            return (vec![], vec![]);
        };
        let part = output_text(&item.text, Value::Null);
        let message = output_message(&item.id, vec![part.clone()], FINISHED_STATUS);
        let events = vec![
            Event(
                "response.output_text.done",
                json!({"content_index": 0, "item_id": item.id, "logprobs": [],
                       "output_index": 0, "sequence_number": self.seq(), "text": item.text,
                       "type": "response.output_text.done"}),
            ),
            Event(
                "response.content_part.done",
                json!({"content_index": 0, "item_id": item.id, "output_index": 0,
                       "part": part, "sequence_number": self.seq(),
                       "type": "response.content_part.done"}),
            ),
            Event(
                "response.output_item.done",
                json!({"item": message, "output_index": 0, "sequence_number": self.seq(),
                       "type": "response.output_item.done"}),
            ),
        ];
        (events, vec![message])
    }

    /// The stream as SSE frames.
    fn frames(self) -> impl futures_util::Stream<Item = String> {
        futures_util::stream::unfold(self, |mut st| async move {
            let events = st.next().await?;
            let frames: String = events.iter().map(Event::frame).collect();
            Some((frames, st))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers

/// `POST /v1/responses`.
pub(super) async fn create(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    s.inject_faults().await?;
    let req = parse_request(&body)?;
    let lora = s.resolve_model(req.model.as_deref())?;
    // `_validate_create_responses_input`.
    if req.store && !s.responses.enabled && req.background {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "This vLLM engine does not support `store=True` and therefore does not support \
             the background mode. To enable these features, set the environment variable \
             `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
        )
        .kind("invalid_request_error")
        .param("background"));
    }
    // With the store off, `store=True` (the default) is silently ignored.
    let store = req.store && s.responses.enabled;
    let previous = match &req.previous_response_id {
        None => None,
        Some(id) => {
            let (response, messages) = s.responses.get(id).ok_or_else(|| not_found(id))?;
            Some(Previous { response, messages })
        }
    };
    let messages = input_messages(req.instructions.as_deref(), &req.input, previous.as_ref())?;
    let end = if continues_final_message(&req.input) {
        PromptEnd::ContinueFinal
    } else {
        PromptEnd::Generate
    };
    let prompt = s.chat_prompt_of(&messages, end)?;
    let max_tokens = output_limit(&s, &req, prompt.len())?;
    let (remote_prefilled, kv_transfer) =
        disaggregation(&s, &headers, "/v1/responses", &body, prompt.len()).await;
    let generation = Generation::start(
        &s,
        EngineJob {
            lora: lora.clone(),
            cache_salt: req.cache_salt.clone(),
            prompt,
            max_tokens: Some(max_tokens),
            remote_prefilled,
        },
    )?;
    let id = req
        .request_id
        .clone()
        .unwrap_or_else(|| s.random_id("resp_"));
    let model = lora.unwrap_or_else(|| s.model.clone());
    let kv = kv_transfer.then(|| crate::pd::prefill_answer_params(&s.replica));
    let answer = Answer {
        fields: response_fields(&req, &id, unix_now_secs(&s), &model, max_tokens, kv),
        s: s.clone(),
        id,
        messages,
        store,
    };
    match (req.background, req.stream) {
        (true, stream) => Ok(start_background(answer, generation, stream)),
        (false, true) => Ok(sse_response(EventStream::new(answer, generation).frames())),
        (false, false) => Ok(axum::Json(full_answer(&answer, generation).await?).into_response()),
    }
}

/// The generated length: `max_output_tokens` (else `--default-max-tokens`) within the context
/// left, after vLLM's `_validate_generator_input` refused a prompt that fills it.
fn output_limit(s: &Shared, req: &ResponsesRequest, prompt_len: usize) -> Result<u32, ApiError> {
    let max_len = s.max_model_len as usize;
    if prompt_len >= max_len {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "The engine prompt length {prompt_len} exceeds the max_model_len {max_len}. \
                 Please reduce prompt."
            ),
        )
        .kind("invalid_request_error")
        .param("input"));
    }
    let room = (max_len - prompt_len) as i64;
    let wanted = req
        .max_output_tokens
        .unwrap_or(i64::from(s.default_max_tokens));
    let max_tokens = wanted.min(room);
    if max_tokens < 1 {
        return Err(bad_request(format!(
            "max_tokens must be at least 1, got {max_tokens}."
        )));
    }
    Ok(max_tokens as u32)
}

/// Background mode: store the `queued` answer, generate in a task, answer at once (or with the
/// task's event stream). The task ends with the server.
fn start_background(answer: Answer, generation: Generation, stream: bool) -> Response {
    let s = answer.s.clone();
    let id = answer.id.clone();
    let queued = answer.object("queued", vec![], None);
    s.responses
        .keep(&id, queued.clone(), answer.messages.clone());
    let mut stop = s.shutdown_rx.clone();
    let log = stream.then(|| Arc::new(EventLog::new()));
    let writer = log.clone();
    let task_id = id.clone();
    let work = async move {
        match writer {
            Some(log) => {
                let mut events = EventStream::new(answer, generation);
                while let Some(batch) = events.next().await {
                    log.push(batch);
                }
                log.close();
            }
            None => {
                if full_answer(&answer, generation).await.is_err() {
                    answer.s.responses.fail(&task_id);
                }
            }
        }
    };
    let task = tokio::spawn(async move {
        tokio::select! {
            () = work => {}
            _ = stop.wait_for(|stopped| *stopped) => {}
        }
    });
    s.responses.attach(&id, task.abort_handle(), log.clone());
    match log {
        Some(log) => sse_response(log.replay(0)),
        None => axum::Json(queued).into_response(),
    }
}

/// vLLM's `_make_not_found_error`.
fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Response with id '{id}' not found."),
    )
    .kind("invalid_request_error")
    .param("response_id")
}

/// `GET /v1/responses/{response_id}[?stream=true&starting_after=N]`.
pub(super) async fn retrieve(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> ApiResult {
    let (response, _) = s.responses.get(&id).ok_or_else(|| not_found(&id))?;
    if !query_bool(&query, "stream")? {
        return Ok(axum::Json(response).into_response());
    }
    let from = match query.get("starting_after") {
        None => 0,
        Some(v) => v
            .parse::<i64>()
            .map(|n| (n + 1).max(0) as usize)
            .map_err(|_| {
                ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("starting_after must be an integer, not {v:?}"),
                )
            })?,
    };
    match s.responses.events(&id) {
        Some(log) => Ok(sse_response(log.replay(from))),
        None => Ok(broken_stream()),
    }
}

/// What vLLM sends for a stream of a response that has no event log (it was not a background
/// stream): `responses_background_stream_generator` raises inside the already started
/// streaming response, so the client sees 200 and then the connection cut mid-body.
fn broken_stream() -> Response {
    let body = futures_util::stream::once(async {
        Err::<Bytes, _>(std::io::Error::other("unknown response_id"))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `POST /v1/responses/{response_id}/cancel`.
pub(super) async fn cancel(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult {
    match s.responses.cancel(&id) {
        Ok(response) => Ok(axum::Json(response).into_response()),
        Err(CancelRefusal::NotFound) => Err(not_found(&id)),
        Err(CancelRefusal::NotRunning) => Err(bad_request("Cannot cancel a synchronous response.")
            .kind("invalid_request_error")
            .param("response_id")),
    }
}

/// `POST /v1/responses/render` (scale_out/render): the prompt ids of a stateless request, in
/// the shape the simulator's other render endpoints answer.
pub(super) async fn render(State(s): State<Arc<Shared>>, body: Bytes) -> ApiResult {
    let req = parse_request(&body)?;
    s.resolve_model(req.model.as_deref())?;
    if req.previous_response_id.is_some() {
        return Err(bad_request(
            "previous_response_id is not supported by the stateless render endpoint.",
        )
        .kind("invalid_request_error")
        .param("previous_response_id"));
    }
    let messages = input_messages(req.instructions.as_deref(), &req.input, None)?;
    let end = if continues_final_message(&req.input) {
        PromptEnd::ContinueFinal
    } else {
        PromptEnd::Generate
    };
    let tokens = s.chat_prompt_of(&messages, end)?;
    Ok(axum::Json(json!({"token_ids": tokens, "model": s.model})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::tests::obj;

    fn role_content(m: &Value) -> (String, Value) {
        (
            m["role"].as_str().unwrap_or("").to_owned(),
            m.get("content").cloned().unwrap_or(Value::Null),
        )
    }

    #[test]
    fn a_chain_renders_previous_messages_and_output_without_old_instructions() {
        let prev = Previous {
            messages: vec![
                json!({"role": "system", "content": "old rules"}),
                json!({"role": "user", "content": "hi"}),
            ],
            response: json!({"output": [
                {"type": "reasoning", "summary": []},
                {"type": "message", "content": [{"type": "output_text", "text": "hello"}]}
            ]}),
        };
        let msgs = input_messages(Some("new rules"), &json!("more"), Some(&prev)).unwrap();
        let got: Vec<_> = msgs.iter().map(role_content).collect();
        assert_eq!(
            got,
            vec![
                ("system".into(), json!("new rules")),
                ("user".into(), json!("hi")),
                ("assistant".into(), json!("hello")),
                ("user".into(), json!("more")),
            ]
        );
    }

    #[test]
    fn tool_calls_reasoning_and_text_merge_into_one_assistant_message() {
        let input = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": "{}",
             "namespace": "fs"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {"type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "done"}]}
        ]);
        let msgs = input_messages(None, &input, None).unwrap();
        assert_eq!(msgs.len(), 4, "{msgs:?}");
        assert_eq!(msgs[1]["reasoning"], "think");
        assert_eq!(msgs[1]["tool_calls"][0]["id"], "c1");
        assert_eq!(msgs[1]["tool_calls"][1]["function"]["name"], "fs__cat");
        assert_eq!(
            msgs[2],
            json!({"role": "tool", "content": "a.txt", "tool_call_id": "c1"})
        );
        assert_eq!(msgs[3], json!({"role": "assistant", "content": "done"}));
    }

    #[test]
    fn unsupported_items_and_encrypted_reasoning_are_refused_like_vllm() {
        let e = input_messages(None, &json!([{"type": "web_search_call"}]), None).unwrap_err();
        assert_eq!(
            e.message,
            "Unsupported input item type: web_search_call (parameter=input)"
        );
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = input_messages(
            None,
            &json!([{"type": "reasoning", "summary": [], "encrypted_content": "x"}]),
            None,
        )
        .unwrap_err();
        assert!(e.message.starts_with("Encrypted content is not supported."));
    }

    #[test]
    fn tool_choice_rules() {
        assert_eq!(check_tool_usage(&obj(json!({}))).unwrap(), "none");
        assert_eq!(
            check_tool_usage(&obj(json!({"tools": [{"type": "function", "name": "f"}]}))).unwrap(),
            "auto"
        );
        let e = check_tool_usage(&obj(json!({"tool_choice": "required"}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let named = json!({"tools": [{"type": "function", "name": "f"}],
                           "tool_choice": {"type": "function", "name": "g"}});
        assert!(check_tool_usage(&obj(named)).is_err());
    }

    #[test]
    fn an_unfinished_last_message_is_continued() {
        assert!(continues_final_message(&json!([
            {"role": "assistant", "type": "message", "status": "incomplete",
             "content": [{"type": "output_text", "text": "half"}]}
        ])));
        assert!(!continues_final_message(&json!("text")));
        assert!(!continues_final_message(
            &json!([{"role": "user", "content": "x"}])
        ));
    }

    #[test]
    fn the_store_keeps_the_newest_and_respects_cancels() {
        let store = Store::new(true);
        for i in 0..MAX_STORED_RESPONSES + 2 {
            store.keep(&format!("r{i}"), json!({"status": "completed"}), vec![]);
        }
        assert!(store.get("r0").is_none() && store.get("r1").is_none());
        assert!(store.get("r2").is_some());
        assert!(matches!(store.cancel("r2"), Err(CancelRefusal::NotRunning)));
        assert!(matches!(store.cancel("nope"), Err(CancelRefusal::NotFound)));
        store.keep("q", json!({"status": "queued"}), vec![]);
        assert_eq!(store.cancel("q").ok().unwrap()["status"], "cancelled");
        store.keep("q", json!({"status": "incomplete"}), vec![]);
        assert_eq!(store.get("q").unwrap().0["status"], "cancelled");
    }

    #[test]
    fn usage_counts_cache_writes_in_full_blocks() {
        let sum = RequestSummary {
            prompt_tokens: 100,
            output_tokens: 5,
            cached_tokens: 32,
            num_preemptions: 0,
            arrival_s: 0.0,
            scheduled_s: 0.0,
            first_token_s: 0.0,
            finished_s: 0.0,
            lora: None,
        };
        let u = usage(&sum, 16);
        assert_eq!(u["input_tokens_details"]["cache_write_tokens"], 96 - 32);
        assert_eq!(u["total_tokens"], 105);
    }
}
