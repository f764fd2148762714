//! The agent APIs' prompts as the chat messages vLLM 0.33 builds from them before it applies
//! the chat template, so precise mode tokenises a `/v1/messages` or `/v1/responses` request
//! exactly as the chat request vLLM turns it into (`vllm/entrypoints/anthropic/serving.py`,
//! `AnthropicServingMessages.to_chat_completion_request`; `vllm/entrypoints/openai/responses/
//! utils.py`, `construct_input_messages` and `construct_tool_dicts`; `vllm/renderers/
//! online_renderer.py`, where both end as `tool.model_dump()` and template options).
//!
//! What vLLM's result depends on and a router cannot know is refused with
//! [`AgentChatError::Unsupported`], and the request is then routed approximately: a Responses
//! history stored on a replica (`previous_response_id`), a template option vLLM derives from
//! a setting (Anthropic `thinking` disabled, `output_config.effort`, Responses
//! `reasoning.effort`, `tool_choice: none`), encrypted reasoning, and inline system messages
//! when the template's ordering rule is not known (the caller passes `None`, as the control
//! plane's remote tokenizer does).
//!
//! Pure `serde_json` over the prompt fields the filter forwards: no tokenizer, no template, so
//! the fuzz targets run it as the control plane does.

use serde_json::{Map, Value, json};

/// Why a prompt was not converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentChatError {
    /// The prompt is valid, but what vLLM makes of it depends on state or settings outside the
    /// request (a stored history, a server flag): route it approximately.
    #[error("not converted here: {0}")]
    Unsupported(String),
    /// The prompt fields do not have the shape the API requires.
    #[error("bad prompt: {0}")]
    BadPrompt(String),
}

/// Anthropic's per-request attribution block, which vLLM drops from system prompts (its hash
/// changes every request and would defeat prefix caching).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn unsupported(what: &str) -> AgentChatError {
    AgentChatError::Unsupported(what.to_string())
}

fn bad(what: &str) -> AgentChatError {
    AgentChatError::BadPrompt(what.to_string())
}

/// Who converts a prompt, which decides what becomes of what only the serving process knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Converter {
    /// A router predicting vLLM's prompt: refuses what depends on the server's clock or
    /// settings ([`AgentChatError::Unsupported`]).
    Router,
    /// The serving process itself (the simulator): decides those as vLLM does, naming a tool
    /// call that has no id `call_{unix_now_s}`.
    Server {
        /// The server's clock, in whole seconds since the Unix epoch.
        unix_now_s: u64,
    },
}

/// The chat prompt (`model`, `messages`, `tools`, `chat_template_kwargs`) vLLM builds from an
/// Anthropic Messages request's prompt fields. `merge_inline_system`: whether the model's
/// template needs system messages first (vLLM then merges inline ones into the leading one);
/// `None` when unknown, which refuses a request that has inline system messages.
pub fn messages_to_chat(
    prompt: &Map<String, Value>,
    merge_inline_system: Option<bool>,
) -> Result<Map<String, Value>, AgentChatError> {
    let messages = message_list(prompt)?;
    refuse_template_options(prompt)?;
    let inline_system = messages.iter().any(|m| role(m) == Some("system"));
    let merge = match (inline_system, merge_inline_system) {
        (false, _) => false,
        (true, Some(merge)) => merge,
        (true, None) => {
            return Err(unsupported(
                "inline system messages, whose order depends on the chat template",
            ));
        }
    };
    let out = anthropic_chat_messages(prompt, merge, Converter::Router)?;
    let mut chat = Map::new();
    if let Some(model) = prompt.get("model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Value::Array(out));
    if let Some(tools) = resolved_tools(prompt, messages)? {
        if tool_choice_none(prompt) && !tools.is_empty() {
            return Err(unsupported(
                "tool_choice none (the server may drop the tools)",
            ));
        }
        let converted = tools
            .iter()
            .map(|t| chat_tool(t, "input_schema"))
            .collect::<Result<Vec<_>, AgentChatError>>()?;
        chat.insert("tools".into(), Value::Array(converted));
    }
    if let Some(kwargs) = prompt.get("chat_template_kwargs").filter(|k| !k.is_null()) {
        chat.insert("chat_template_kwargs".into(), kwargs.clone());
    }
    Ok(chat)
}

fn message_list(prompt: &Map<String, Value>) -> Result<&Vec<Value>, AgentChatError> {
    prompt
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("messages must be an array"))
}

/// The chat messages vLLM builds from a Messages request's `system` and `messages`
/// (`_convert_messages`), whatever template options the request sets: what a server renders.
/// `merge_inline_system`: inline system messages join the leading one (the template needs
/// system messages first) rather than staying in place.
pub fn anthropic_chat_messages(
    prompt: &Map<String, Value>,
    merge_inline_system: bool,
    converter: Converter,
) -> Result<Vec<Value>, AgentChatError> {
    let messages = message_list(prompt)?;
    let mut out: Vec<Value> = Vec::new();
    let mut system_parts: Vec<String> = Vec::new();
    match prompt.get("system") {
        Some(Value::String(s)) if !s.is_empty() => system_parts.push(s.clone()),
        Some(Value::Array(blocks)) => {
            for block in blocks {
                if let Some(text) = text_block(block).filter(|t| !t.starts_with(BILLING_HEADER)) {
                    system_parts.push(text.to_string());
                }
            }
        }
        Some(Value::String(_) | Value::Null) | None => {}
        Some(_) => return Err(bad("system must be a string or blocks")),
    }
    if merge_inline_system {
        for m in messages.iter().filter(|m| role(m) == Some("system")) {
            if let Some(text) = system_text(m)? {
                system_parts.push(text);
            }
        }
    }
    if !system_parts.is_empty() {
        out.push(json!({"role": "system", "content": system_parts.concat()}));
    }
    for m in messages {
        let role = role(m).ok_or_else(|| bad("a message has no role"))?;
        if role == "system" {
            if !merge_inline_system && let Some(text) = system_text(m)? {
                out.push(json!({"role": "system", "content": text}));
            }
            continue;
        }
        let mut message = Map::new();
        message.insert("role".into(), Value::String(role.into()));
        match m.get("content") {
            Some(Value::String(s)) => {
                message.insert("content".into(), Value::String(s.clone()));
            }
            Some(Value::Array(blocks)) => {
                convert_blocks(role, blocks, converter, &mut message, &mut out)?;
            }
            _ => return Err(bad("content must be a string or blocks")),
        }
        // vLLM drops a user message left with no content (its tool results went out as tool
        // messages); an assistant message stays even when empty.
        if role != "user" || message.contains_key("content") {
            out.push(Value::Object(message));
        }
    }
    Ok(out)
}

/// Settings vLLM turns into template options (`reasoning_effort`, dropped tools) by rules of
/// the serving process: a prompt that sets them is not tokenised here.
fn refuse_template_options(prompt: &Map<String, Value>) -> Result<(), AgentChatError> {
    if prompt
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("disabled")
    {
        return Err(unsupported(
            "thinking disabled (a reasoning effort the server picks)",
        ));
    }
    if is_set(prompt, "output_config", Some("effort")) {
        return Err(unsupported("output_config.effort"));
    }
    refuse_dropped_tools(prompt)
}

/// Whether the prompt sets `field` (or `field.inner`): present and not null.
fn is_set(prompt: &Map<String, Value>, field: &str, inner: Option<&str>) -> bool {
    let value = prompt.get(field);
    let value = match inner {
        Some(key) => value.and_then(|v| v.get(key)),
        None => value,
    };
    value.is_some_and(|v| !v.is_null())
}

/// `tool_choice: none` with tools: vLLM drops the tools from the template or not by a server
/// flag (`--exclude-tools-when-tool-choice-none`) the control plane cannot see.
fn refuse_dropped_tools(prompt: &Map<String, Value>) -> Result<(), AgentChatError> {
    let has_tools = prompt
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if tool_choice_none(prompt) && has_tools {
        return Err(unsupported(
            "tool_choice none (the server may drop the tools)",
        ));
    }
    Ok(())
}

/// Whether the request says `tool_choice: none` (Anthropic spells it `{"type": "none"}`,
/// Responses `"none"`).
fn tool_choice_none(prompt: &Map<String, Value>) -> bool {
    let choice = prompt.get("tool_choice");
    choice
        .and_then(|c| c.get("type"))
        .or(choice)
        .and_then(Value::as_str)
        == Some("none")
}

fn role(m: &Value) -> Option<&str> {
    m.get("role").and_then(Value::as_str)
}

/// The text of a non-empty `text` block.
fn text_block(block: &Value) -> Option<&str> {
    (block.get("type").and_then(Value::as_str) == Some("text"))
        .then(|| block.get("text").and_then(Value::as_str))
        .flatten()
        .filter(|t| !t.is_empty())
}

/// An inline system message's text: its string, or its text blocks joined, without billing
/// headers; `None` when nothing is left.
fn system_text(m: &Value) -> Result<Option<String>, AgentChatError> {
    match m.get("content") {
        Some(Value::String(s)) => Ok((!s.starts_with(BILLING_HEADER)).then(|| s.clone())),
        Some(Value::Array(blocks)) => {
            let parts: Vec<&str> = blocks
                .iter()
                .filter_map(text_block)
                .filter(|t| !t.starts_with(BILLING_HEADER))
                .collect();
            Ok((!parts.is_empty()).then(|| parts.concat()))
        }
        _ => Err(bad("a system message's content must be a string or blocks")),
    }
}

/// One message's blocks: text and images become content parts, thinking the message's
/// `reasoning`, `tool_use` its `tool_calls`; a user's `tool_result` becomes a tool message of
/// its own, appended to `out` before the message itself, as vLLM does.
fn convert_blocks(
    role: &str,
    blocks: &[Value],
    converter: Converter,
    message: &mut Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), AgentChatError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut reasoning: Vec<String> = Vec::new();
    for block in blocks {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(text) = text_block(block) {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            Some("image") => {
                if let Some(source) = block.get("source").filter(|s| !s.is_null()) {
                    parts.push(
                        json!({"type": "image_url", "image_url": {"url": image_url(source)}}),
                    );
                }
            }
            Some("thinking") => {
                if let Some(t) = block.get("thinking").and_then(Value::as_str) {
                    reasoning.push(t.to_string());
                }
            }
            Some("tool_use") => {
                let id = match block.get("id").and_then(Value::as_str) {
                    Some(id) if !id.is_empty() => id.to_string(),
                    // vLLM makes one from its clock: no router's render would agree.
                    _ => match converter {
                        Converter::Router => {
                            return Err(unsupported("a tool_use block without an id"));
                        }
                        Converter::Server { unix_now_s } => format!("call_{unix_now_s}"),
                    },
                };
                let input = match block.get("input") {
                    None | Some(Value::Null) => json!({}),
                    Some(v) if v.as_object().is_some_and(Map::is_empty) => json!({}),
                    Some(v) => v.clone(),
                };
                tool_calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {
                        "name": block.get("name").and_then(Value::as_str).unwrap_or(""),
                        "arguments": python_json(&input),
                    },
                }));
            }
            Some("tool_result") if role == "user" => tool_result(block, out)?,
            Some("tool_result") => match block.get("content") {
                None | Some(Value::Null) => {
                    parts.push(json!({"type": "text", "text": "Tool result: "}));
                }
                Some(Value::String(s)) => {
                    let text = format!("Tool result: {s}");
                    parts.push(json!({"type": "text", "text": text}));
                }
                // vLLM writes Python's repr of the blocks, which a router does not predict.
                Some(blocks) => match converter {
                    Converter::Router => {
                        return Err(unsupported("an assistant's tool_result with blocks"));
                    }
                    Converter::Server { .. } => {
                        let text = format!("Tool result: {}", python_repr(blocks));
                        parts.push(json!({"type": "text", "text": text}));
                    }
                },
            },
            // vLLM accepts them only in system messages.
            Some("tool_addition" | "tool_removal") => {
                return Err(bad(
                    "tool_addition and tool_removal blocks outside system messages",
                ));
            }
            // redacted_thinking, tool_reference and block types vLLM's converter passes over.
            _ => {}
        }
    }
    if !reasoning.is_empty() {
        message.insert("reasoning".into(), Value::String(reasoning.concat()));
    }
    if !tool_calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    match parts.as_slice() {
        [] => {}
        [one] if one["type"] == "text" => {
            message.insert("content".into(), one["text"].clone());
        }
        _ => {
            message.insert("content".into(), Value::Array(parts));
        }
    }
    Ok(())
}

/// A user's `tool_result` block as vLLM's tool message: its text (text items joined by
/// newlines), then a user message with its images, then a tool message naming its tool
/// references.
fn tool_result(block: &Value, out: &mut Vec<Value>) -> Result<(), AgentChatError> {
    let id = block
        .get("tool_use_id")
        .and_then(Value::as_str)
        .unwrap_or("");
    let (mut text, mut images, mut references) = (String::new(), Vec::new(), Vec::new());
    match block.get("content") {
        Some(Value::String(s)) => text = s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items.iter().filter(|i| i.is_object()) {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        texts.push(item.get("text").and_then(Value::as_str).unwrap_or(""));
                    }
                    Some("image") => {
                        let empty = json!({});
                        let url = image_url(item.get("source").unwrap_or(&empty));
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    Some("tool_reference") => {
                        let name = item
                            .get("tool_name")
                            .and_then(Value::as_str)
                            .filter(|n| !n.is_empty())
                            .or_else(|| item.get("name").and_then(Value::as_str));
                        if let Some(name) = name.filter(|n| !n.is_empty()) {
                            references.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
            text = texts.join("\n");
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(bad("a tool_result's content must be a string or blocks")),
    }
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
    if !references.is_empty() {
        out.push(json!({"role": "tool", "tool_call_id": id, "content": references}));
    }
    Ok(())
}

/// An Anthropic image source as the URL vLLM gives the chat parser.
fn image_url(source: &Value) -> String {
    let field = |k: &str, default: &str| {
        source
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_string()
    };
    if source.get("type").and_then(Value::as_str) == Some("url") {
        return field("url", "");
    }
    format!(
        "data:{};base64,{}",
        field("media_type", "image/jpeg"),
        field("data", "")
    )
}

/// The Anthropic tools in effect at the end of the conversation, as vLLM's `_resolve_tools`
/// makes them: the request's `tools` (a later one of the same name replaces an earlier one in
/// its place), then every `tool_addition` and `tool_removal` block in message order. An
/// addition by value declares or replaces a tool, one by reference undefers a declared tool,
/// a removal drops it until it is added again. `None` when there are neither tools nor
/// changes.
fn resolved_tools(
    prompt: &Map<String, Value>,
    messages: &[Value],
) -> Result<Option<Vec<Value>>, AgentChatError> {
    let tools = match prompt.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(tools),
        Some(_) => return Err(bad("tools must be an array")),
    };
    let changes: Vec<&Value> = messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|b| {
            matches!(
                b.get("type").and_then(Value::as_str),
                Some("tool_addition" | "tool_removal")
            )
        })
        .collect();
    if changes.is_empty() {
        return Ok(tools.cloned());
    }
    let name_of = |t: &Value| -> Result<String, AgentChatError> {
        t.get("name")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| bad("a tool has no name"))
    };
    // preserve_order: replacing a name keeps its place, as a Python dict does.
    let mut by_name = Map::new();
    for tool in tools.into_iter().flatten() {
        by_name.insert(name_of(tool)?, tool.clone());
    }
    let mut removed: Vec<String> = Vec::new();
    for block in changes {
        let removal = block.get("type").and_then(Value::as_str) == Some("tool_removal");
        let change = block
            .get("tool")
            .filter(|t| !t.is_null())
            .ok_or_else(|| bad("a tool change block has no tool"))?;
        let name = match change.get("type").and_then(Value::as_str) {
            Some("tool_definition") if !removal => {
                let definition = change
                    .get("definition")
                    .filter(|d| d.is_object())
                    .ok_or_else(|| bad("a tool_definition has no definition"))?;
                let name = name_of(definition)?;
                by_name.insert(name.clone(), definition.clone());
                name
            }
            Some("tool_reference") => {
                let name = name_of(change)?;
                let Some(tool) = by_name.get_mut(&name) else {
                    return Err(bad("a tool change names a tool not declared in tools"));
                };
                if !removal && let Some(tool) = tool.as_object_mut() {
                    tool.insert("defer_loading".into(), Value::Null);
                }
                name
            }
            _ => {
                return Err(bad(
                    "a tool change is a tool_reference or, to add, a definition",
                ));
            }
        };
        removed.retain(|r| *r != name);
        if removal {
            removed.push(name);
        }
    }
    Ok(Some(
        by_name
            .into_iter()
            .filter(|(name, _)| !removed.contains(name))
            .map(|(_, tool)| tool)
            .collect(),
    ))
}

/// A function tool as vLLM hands it to the chat template, `ChatCompletionToolsParam`'s
/// `model_dump()`: `name`, then `description` and `parameters` even when null (templates that
/// write `tool | tojson` print them), then `strict` and `defer_loading` only when set, and no
/// other field. `parameters` is read from `parameters_key` (`input_schema` for Anthropic).
fn chat_tool(tool: &Value, parameters_key: &str) -> Result<Value, AgentChatError> {
    let name = tool
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a tool has no name"))?;
    let field = |k: &str| tool.get(k).cloned().unwrap_or(Value::Null);
    let mut function = Map::new();
    function.insert("name".into(), Value::String(name.into()));
    function.insert("description".into(), field("description"));
    function.insert("parameters".into(), field(parameters_key));
    for k in ["strict", "defer_loading"] {
        if let Some(v) = tool.get(k).filter(|v| !v.is_null()) {
            function.insert(k.into(), v.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// The chat prompt vLLM builds from a Responses request's prompt fields: `instructions` as the
/// system message, then the `input` items (function calls merged into the assistant message
/// before them), the function tools in chat's shape, the client's `chat_template_kwargs`, and
/// `continue_final_message` (without a generation prompt) when the last item was cut short.
pub fn responses_to_chat(
    prompt: &Map<String, Value>,
) -> Result<Map<String, Value>, AgentChatError> {
    if is_set(prompt, "previous_response_id", None) {
        return Err(unsupported(
            "previous_response_id (the history is stored on a replica)",
        ));
    }
    if is_set(prompt, "reasoning", Some("effort")) {
        return Err(unsupported(
            "reasoning.effort (the server's --reasoning-effort-map may rewrite it)",
        ));
    }
    refuse_dropped_tools(prompt)?;
    let mut out: Vec<Value> = Vec::new();
    if let Some(instructions) = prompt.get("instructions").and_then(Value::as_str)
        && !instructions.is_empty()
    {
        out.push(json!({"role": "system", "content": instructions}));
    }
    match prompt.get("input") {
        Some(Value::String(s)) => out.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            let start = out.len();
            for item in items {
                push_item(item, &mut out, start)?;
            }
        }
        _ => return Err(bad("input must be a string or items")),
    }
    let mut chat = Map::new();
    if let Some(model) = prompt.get("model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Value::Array(out));
    // vLLM passes no tools for an empty list, but an empty list when none of them is a
    // function (a template may tell `[]` from none).
    if let Some(tools) = prompt.get("tools").and_then(Value::as_array)
        && !tools.is_empty()
    {
        chat.insert("tools".into(), Value::Array(responses_tools(tools)?));
    }
    if let Some(kwargs) = prompt.get("chat_template_kwargs").filter(|k| !k.is_null()) {
        chat.insert("chat_template_kwargs".into(), kwargs.clone());
    }
    // A last message or reasoning item still `in_progress` or `incomplete` is continued, not
    // answered (`should_continue_final_message`).
    if let Some(Value::Array(items)) = prompt.get("input")
        && items.last().is_some_and(is_partial)
    {
        chat.insert("add_generation_prompt".into(), Value::Bool(false));
        chat.insert("continue_final_message".into(), Value::Bool(true));
    }
    Ok(chat)
}

/// A message (an item's type defaults to `message`) or reasoning item that was cut short.
fn is_partial(item: &Value) -> bool {
    let kind = item.get("type").map_or(Some("message"), Value::as_str);
    let status = item.get("status").and_then(Value::as_str);
    matches!(kind, Some("message" | "reasoning"))
        && matches!(status, Some("in_progress" | "incomplete"))
}

/// The function tools of a Responses request in chat's shape (vLLM renders no other kind).
fn responses_tools(tools: &[Value]) -> Result<Vec<Value>, AgentChatError> {
    let mut out = Vec::new();
    for tool in tools {
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => out.push(chat_tool(tool, "parameters")?),
            // Each function of a namespace, named `namespace__name`.
            Some("namespace") => {
                let namespace = tool
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a namespace has no name"))?;
                let functions = tool.get("tools").and_then(Value::as_array);
                for function in functions.into_iter().flatten() {
                    if function.get("type").and_then(Value::as_str) != Some("function") {
                        continue;
                    }
                    let name = function
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("a tool has no name"))?;
                    let mut flat = function.clone();
                    flat["name"] = json!(format!("{namespace}{NAMESPACE_SEPARATOR}{name}"));
                    out.push(chat_tool(&flat, "parameters")?);
                }
            }
            // A function of one string argument, `input`, with vLLM's own schema for it.
            Some("custom") => {
                let mut shim = Map::new();
                for k in ["name", "description"] {
                    if let Some(v) = tool.get(k) {
                        shim.insert(k.into(), v.clone());
                    }
                }
                shim.insert("parameters".into(), custom_tool_parameters());
                out.push(chat_tool(&Value::Object(shim), "parameters")?);
            }
            _ => {}
        }
    }
    Ok(out)
}

/// How vLLM names a namespace's function for the template (`flat_namespace_tool_name`).
const NAMESPACE_SEPARATOR: &str = "__";

/// The one argument of the function a custom tool is shown as.
const CUSTOM_TOOL_INPUT_KEY: &str = "input";

/// The parameters of the function a custom tool is shown as (`custom_tool_parameters`).
fn custom_tool_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": false,
    })
}

/// One `input` item as vLLM's `_construct_message_from_response_item` makes it; `start` is
/// where this request's items begin in `out` (an item merges only into one of them).
fn push_item(item: &Value, out: &mut Vec<Value>, start: usize) -> Result<(), AgentChatError> {
    let kind = item.get("type").and_then(Value::as_str);
    let role = role(item);
    let field = |k: &str| item.get(k).and_then(Value::as_str);
    // The assistant message an item may complete: the last one, if it is an assistant's.
    let last_assistant = |out: &mut Vec<Value>| -> Option<usize> {
        let at = out.len().checked_sub(1).filter(|&i| i >= start)?;
        (role_of(&out[at]) == Some("assistant")).then_some(at)
    };
    match kind {
        Some(kind @ ("function_call" | "custom_tool_call")) => {
            let name = field("name").unwrap_or("");
            let (name, arguments) = if kind == "function_call" {
                // A namespaced tool's call names the flattened tool the template was shown.
                let name = match field("namespace").filter(|n| !n.is_empty()) {
                    Some(namespace) => format!("{namespace}{NAMESPACE_SEPARATOR}{name}"),
                    None => name.to_string(),
                };
                (name, field("arguments").unwrap_or("").to_string())
            } else {
                // A custom tool is shown as a function of one string argument, `input`.
                let input = match item.get("input") {
                    None | Some(Value::Null) => "",
                    Some(Value::String(s)) => s.as_str(),
                    Some(_) => return Err(bad("a custom tool call's input must be a string")),
                };
                let mut arguments = String::new();
                write_python(
                    &json!({CUSTOM_TOOL_INPUT_KEY: input}),
                    &mut arguments,
                    Python::Json { ascii: false },
                );
                (name.to_string(), arguments)
            };
            let call = json!({
                "id": field("call_id").unwrap_or(""),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            });
            match last_assistant(out) {
                Some(at) => match out[at].get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => {
                        out[at]["tool_calls"] = json!([call]);
                    }
                },
                None => out.push(json!({"role": "assistant", "tool_calls": [call]})),
            }
        }
        Some("reasoning") => {
            if item
                .get("encrypted_content")
                .is_some_and(|c| !c.is_null() && c != "")
            {
                return Err(unsupported("encrypted reasoning"));
            }
            let first_text = |k: &str| {
                item.get(k)
                    .and_then(Value::as_array)
                    .and_then(|a| a.first())
                    .and_then(|p| p.get("text"))
                    .and_then(Value::as_str)
            };
            let text = first_text("content")
                .or_else(|| first_text("summary"))
                .unwrap_or("");
            match last_assistant(out) {
                Some(at) if out[at].get("reasoning").is_none() => {
                    out[at]["reasoning"] = json!(text);
                }
                _ => out.push(json!({"role": "assistant", "reasoning": text})),
            }
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            out.push(json!({
                "role": "tool",
                "content": item.get("output").cloned().unwrap_or(Value::Null),
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
            }));
        }
        Some("message") | None if role == Some("assistant") => {
            let text = match item.get("content") {
                Some(Value::String(s)) => Some(s.as_str()),
                Some(Value::Array(parts)) => parts
                    .first()
                    .and_then(|p| p.get("text"))
                    .and_then(Value::as_str),
                _ => None,
            };
            let Some(text) = text else {
                return Err(unsupported("an assistant message without text"));
            };
            match last_assistant(out) {
                Some(at) if out[at].get("content").is_none_or(Value::is_null) => {
                    out[at]["content"] = json!(text);
                }
                _ => out.push(json!({"role": "assistant", "content": text})),
            }
        }
        Some("message") | None if role.is_some() => {
            // Passed on as sent; the chat parser reads its role and content.
            let mut message = Map::new();
            for k in ["role", "content", "name"] {
                if let Some(v) = item.get(k) {
                    message.insert(k.into(), v.clone());
                }
            }
            out.push(Value::Object(message));
        }
        _ => return Err(unsupported("an input item vLLM does not render")),
    }
    Ok(())
}

fn role_of(m: &Value) -> Option<&str> {
    m.get("role").and_then(Value::as_str)
}

/// `json.dumps(value)` as Python writes it: `", "` and `": "` separators and every non-ASCII
/// character escaped (vLLM writes a `tool_use` block's input so).
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python(value, &mut out, Python::Json { ascii: true });
    out
}

/// Python's `repr()` of the object `json.loads` makes of `value` (vLLM writes an assistant's
/// `tool_result` blocks so): single-quoted strings, `None`, `True`, `False`.
pub fn python_repr(value: &Value) -> String {
    let mut out = String::new();
    write_python(value, &mut out, Python::Repr);
    out
}

/// How Python writes a value: `json.dumps` (with `ensure_ascii` or without) or `repr()`. Both
/// lay out lists and dicts alike (`[a, b]`, `{k: v}`) and floats by `repr(float)`.
#[derive(Debug, Clone, Copy)]
enum Python {
    Json { ascii: bool },
    Repr,
}

fn write_python(value: &Value, out: &mut String, style: Python) {
    let repr = matches!(style, Python::Repr);
    match value {
        Value::Null => out.push_str(if repr { "None" } else { "null" }),
        Value::Bool(b) => out.push_str(match (b, repr) {
            (true, false) => "true",
            (false, false) => "false",
            (true, true) => "True",
            (false, true) => "False",
        }),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => write_python_float(f, out),
            None => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_python_string(s, out, style),
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python(v, out, style);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_string(k, out, style);
                out.push_str(": ");
                write_python(v, out, style);
            }
            out.push('}');
        }
    }
}

fn write_python_string(s: &str, out: &mut String, style: Python) {
    match style {
        Python::Json { ascii } => write_python_str(s, out, ascii),
        Python::Repr => write_python_repr_str(s, out),
    }
}

/// Python's `repr(float)`: the shortest digits that read back, positional from 1e-4 up to
/// 1e16 (always with a fraction), else `d.ddde+XX`.
fn write_python_float(f: f64, out: &mut String) {
    // `{:e}` gives the shortest round-trip digits: `1.5e-5`, `1e20`, `-2.5e0`.
    let sci = format!("{f:e}");
    let Some((mantissa, exp)) = sci.split_once('e') else {
        out.push_str(&sci);
        return;
    };
    let Ok(exp) = exp.parse::<i32>() else {
        out.push_str(&sci);
        return;
    };
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    out.push_str(sign);
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', point.unsigned_abs() as usize));
            out.push_str(&digits);
        } else if point as usize >= digits.len() {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point as usize - digits.len()));
            out.push_str(".0");
        } else {
            let (whole, fraction) = digits.split_at(point as usize);
            out.push_str(whole);
            out.push('.');
            out.push_str(fraction);
        }
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if exp < 0 { '-' } else { '+' };
        out.push_str(&format!("e{sign}{:02}", exp.unsigned_abs()));
    }
}

/// A Python string literal as `json.dumps` writes it: with `ascii`, everything outside space
/// to `~` escaped (non-BMP characters as surrogate pairs); without, only quotes, backslashes
/// and control characters below U+0020.
fn write_python_str(s: &str, out: &mut String, ascii: bool) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
            c if !ascii && c >= ' ' => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// A string as Python's `repr()` writes it: single quotes unless the text holds a single quote
/// and no double quote; backslashes, the quote, `\n`, `\r`, `\t` and other control
/// characters escaped; printable non-ASCII text as it is.
fn write_python_repr_str(s: &str, out: &mut String) {
    use std::fmt::Write;
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    // What only the serving process knows: a router refuses it, the server (the simulator)
    // decides it as vLLM does, from its clock and with Python's repr.
    #[test]
    fn a_server_decides_what_a_router_refuses() {
        let prompt = map(json!({"messages": [
            {"role": "assistant", "content": [
                {"type": "tool_use", "name": "ls", "input": {}},
                {"type": "tool_result", "content": [{"type": "text", "text": "it's", "n": null}]}
            ]}
        ]}));
        assert!(matches!(
            anthropic_chat_messages(&prompt, false, Converter::Router),
            Err(AgentChatError::Unsupported(_))
        ));
        let server = Converter::Server { unix_now_s: 1_700 };
        let out = anthropic_chat_messages(&prompt, false, server).unwrap();
        assert_eq!(out[0]["tool_calls"][0]["id"], "call_1700");
        assert_eq!(
            out[0]["content"],
            r#"Tool result: [{'type': 'text', 'text': "it's", 'n': None}]"#
        );
    }

    #[test]
    fn python_repr_matches_repr_of_json_loads() {
        // repr(json.loads('{"a": [1, 2.5, true, null], "b": "x\ny", "c": "\u00e9"}'))
        let v = json!({"a": [1, 2.5, true, null], "b": "x\ny", "c": "é"});
        assert_eq!(
            python_repr(&v),
            r#"{'a': [1, 2.5, True, None], 'b': 'x\ny', 'c': 'é'}"#
        );
        assert_eq!(python_repr(&json!("it's")), r#""it's""#);
        assert_eq!(python_repr(&json!("a'\"b")), r#"'a\'"b'"#);
    }

    #[test]
    fn python_json_matches_json_dumps() {
        // json.dumps({"path": "src/é.rs", "n": [1, true, None], "q": "a\"b\n😀"})
        let v = json!({"path": "src/é.rs", "n": [1, true, null], "q": "a\"b\n😀"});
        assert_eq!(
            python_json(&v),
            r#"{"path": "src/\u00e9.rs", "n": [1, true, null], "q": "a\"b\n\ud83d\ude00"}"#
        );
        assert_eq!(python_json(&json!({})), "{}");
        // repr(float) for each: json.dumps([1.0, 0.5, 1e20, 1.5e-05, 0.0001, 123456.789,
        // 1e16, 9999999999999998.0, -2.5, 0.0])
        let floats = json!([
            1.0,
            0.5,
            1e20,
            1.5e-5,
            0.0001,
            123456.789,
            1e16,
            9999999999999998.0,
            -2.5,
            0.0
        ]);
        assert_eq!(
            python_json(&floats),
            "[1.0, 0.5, 1e+20, 1.5e-05, 0.0001, 123456.789, 1e+16, 9999999999999998.0, -2.5, 0.0]"
        );
        assert_eq!(python_json(&json!([7, -3])), "[7, -3]");
    }

    #[test]
    fn python_json_writes_a_clients_floats_back_as_python_reads_and_writes_them() {
        // json.dumps(json.loads(text)) == text for each: the nearest double, then its repr.
        // 3.388888888888889e+69 is the agent_chat fuzz target's find: serde_json's default
        // parser read it one ulp off, so the repr written back was not the client's.
        let text = "[3.388888888888889e+69, 0.1, 2.2250738585072014e-308, 5e-324, \
                    1.7976931348623157e+308, 1e-05, 1.2345678901234568e+17, 0.30000000000000004]";
        let value: Value = serde_json::from_str(text).unwrap();
        assert_eq!(python_json(&value), text);
    }

    #[test]
    fn a_messages_conversation_becomes_vllms_chat_messages() {
        let prompt = map(json!({
            "model": "m",
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                       {"type": "text", "text": "You are ", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "helpful."}],
            "tools": [{"name": "ls", "description": "lists", "input_schema": {"type": "object"},
                       "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "list it"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"d": "."}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1",
                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"type": "text", "text": "next", "cache_control": {"type": "ephemeral"}}]},
            ],
        }));
        let chat = messages_to_chat(&prompt, Some(false)).unwrap();
        assert_eq!(
            Value::Object(chat),
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": "list it"},
                    {"role": "assistant", "reasoning": "hm", "content": "Sure.",
                     "tool_calls": [{"id": "t1", "type": "function",
                                     "function": {"name": "ls", "arguments": "{\"d\": \".\"}"}}]},
                    {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
                    {"role": "user", "content": "next"},
                ],
                "tools": [{"type": "function", "function": {"name": "ls", "description": "lists",
                           "parameters": {"type": "object"}}}],
            })
        );
    }

    #[test]
    fn inline_system_messages_follow_the_templates_rule_or_are_refused() {
        let prompt = map(json!({"system": "a", "messages": [
            {"role": "user", "content": "q"},
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            {"role": "user", "content": "r"}]}));
        let merged = messages_to_chat(&prompt, Some(true)).unwrap();
        assert_eq!(
            merged["messages"][0],
            json!({"role": "system", "content": "areminder"})
        );
        assert_eq!(merged["messages"].as_array().unwrap().len(), 3);
        let inline = messages_to_chat(&prompt, Some(false)).unwrap();
        assert_eq!(
            inline["messages"][2],
            json!({"role": "system", "content": "reminder"})
        );
        assert!(matches!(
            messages_to_chat(&prompt, None),
            Err(AgentChatError::Unsupported(_))
        ));
    }

    #[test]
    fn what_the_server_decides_is_refused_and_bad_shapes_are_errors() {
        for refused in [
            json!({"messages": [], "thinking": {"type": "disabled"}}),
            json!({"messages": [], "output_config": {"effort": "low"}}),
            json!({"messages": [], "tool_choice": {"type": "none"}, "tools": [{"name": "x"}]}),
            json!({"messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "name": "x", "input": {}}]}]}),
        ] {
            let e = messages_to_chat(&map(refused.clone()), Some(false)).unwrap_err();
            assert!(
                matches!(e, AgentChatError::Unsupported(_)),
                "{refused}: {e}"
            );
        }
        for bad in [
            json!({}),
            json!({"messages": [{"content": "no role"}]}),
            json!({"messages": [{"role": "user", "content": 3}]}),
            json!({"messages": [], "system": 3}),
            json!({"messages": [], "tools": [{"input_schema": {}}]}),
            // vLLM takes tool changes in system messages only.
            json!({"messages": [{"role": "user", "content": [
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}]}]}),
        ] {
            let e = messages_to_chat(&map(bad.clone()), Some(false)).unwrap_err();
            assert!(matches!(e, AgentChatError::BadPrompt(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn any_json_is_converted_or_refused_never_a_panic() {
        // Every value of a few shapes in every place a converter reads.
        let values = [
            json!(null),
            json!(3),
            json!("s"),
            json!([]),
            json!({}),
            json!([null, 1, "x", [], {}]),
            json!([{"type": "text"}, {"type": "tool_use"}, {"type": "tool_result", "content": 3},
                   {"type": "image", "source": 1}, {"type": "thinking", "thinking": 2}]),
            json!([{"role": "assistant", "content": 1}, {"type": "function_call", "namespace": 1},
                   {"type": "reasoning", "content": "x"}, {"type": "message"}]),
        ];
        // The fields a prompt carries for either API (what the filter forwards).
        let keys = scorer_core::protocol::ApiKind::Messages
            .prompt_fields()
            .iter()
            .chain(scorer_core::protocol::ApiKind::Responses.prompt_fields());
        for &key in keys {
            for v in &values {
                let mut prompt = Map::new();
                prompt.insert(key.into(), v.clone());
                prompt.insert("messages".into(), json!([{"role": "user", "content": v}]));
                let _ = messages_to_chat(&prompt, Some(true));
                let _ = messages_to_chat(&prompt, None);
                let mut responses = Map::new();
                responses.insert(key.into(), v.clone());
                responses.insert("input".into(), json!([v, {"role": "user", "content": v}]));
                let _ = responses_to_chat(&responses);
            }
        }
    }

    #[test]
    fn a_responses_loop_becomes_vllms_chat_messages() {
        let prompt = map(json!({
            "model": "m",
            "instructions": "be brief",
            "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}},
                      {"type": "web_search"}],
            "input": [
                {"role": "user", "content": "list it"},
                {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "hm"}]},
                {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
                 "content": [{"type": "output_text", "text": "one file", "annotations": []}]},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "thanks"}]},
            ],
        }));
        let chat = responses_to_chat(&prompt).unwrap();
        assert_eq!(
            Value::Object(chat),
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "list it"},
                    {"role": "assistant", "reasoning": "hm", "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "ls", "arguments": "{}"}}]},
                    {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
                    {"role": "assistant", "content": "one file"},
                    {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
                ],
                "tools": [{"type": "function", "function": {"name": "ls", "description": null,
                                                           "parameters": {"type": "object"}}}],
            })
        );
        let chained = map(json!({"input": "more", "previous_response_id": "resp_1"}));
        assert!(matches!(
            responses_to_chat(&chained),
            Err(AgentChatError::Unsupported(_))
        ));
        assert!(responses_to_chat(&map(json!({"input": 3}))).is_err());
        // `none` matters only with tools to drop.
        let no_tools = map(json!({"input": "hi", "tool_choice": "none"}));
        assert!(responses_to_chat(&no_tools).is_ok());
        let with_tools = map(json!({"input": "hi", "tool_choice": "none",
                                    "tools": [{"type": "function", "name": "ls"}]}));
        assert!(matches!(
            responses_to_chat(&with_tools),
            Err(AgentChatError::Unsupported(_))
        ));
        let string = responses_to_chat(&map(json!({"input": "hi"}))).unwrap();
        assert_eq!(
            string["messages"],
            json!([{"role": "user", "content": "hi"}])
        );
    }

    #[test]
    fn tools_are_what_vllms_model_dump_gives_the_template() {
        // ChatCompletionToolsParam(...).model_dump(): name, description and parameters even
        // when null, strict and defer_loading only when set, in the model's order, no extras.
        let messages = map(json!({"messages": [], "tools": [
            {"name": "a", "input_schema": {"type": "object"}, "cache_control": {"type": "x"}},
            {"description": "d", "name": "b", "strict": true, "defer_loading": null}]}));
        let chat = messages_to_chat(&messages, Some(false)).unwrap();
        assert_eq!(
            python_json(&chat["tools"]),
            r#"[{"type": "function", "function": {"name": "a", "description": null, "parameters": {"type": "object"}}}, {"type": "function", "function": {"name": "b", "description": "d", "parameters": null, "strict": true}}]"#
        );
        let responses = map(json!({"input": "hi", "tools": [
            {"type": "function", "strict": null, "parameters": {"type": "object"}, "name": "a",
             "extra": 1},
            {"type": "function", "name": "b", "strict": false, "defer_loading": true},
            {"type": "web_search"}]}));
        let chat = responses_to_chat(&responses).unwrap();
        assert_eq!(
            python_json(&chat["tools"]),
            r#"[{"type": "function", "function": {"name": "a", "description": null, "parameters": {"type": "object"}}}, {"type": "function", "function": {"name": "b", "description": null, "parameters": null, "strict": false, "defer_loading": true}}]"#
        );
        // Tools none of which is a function: an empty list, as construct_tool_dicts returns.
        let built_in = map(json!({"input": "hi", "tools": [{"type": "web_search"}]}));
        assert_eq!(responses_to_chat(&built_in).unwrap()["tools"], json!([]));
        let no_name = map(json!({"input": "hi", "tools": [{"type": "function"}]}));
        assert!(matches!(
            responses_to_chat(&no_name),
            Err(AgentChatError::BadPrompt(_))
        ));
    }

    #[test]
    fn responses_template_options_are_the_clients_or_refused() {
        // The client's kwargs reach the template; a reasoning effort goes through the server's
        // --reasoning-effort-map first, so it is refused; a summary alone changes nothing.
        let kwargs = map(
            json!({"input": "hi", "chat_template_kwargs": {"enable_thinking": false},
                                "reasoning": {"effort": null, "summary": "auto"}}),
        );
        let chat = responses_to_chat(&kwargs).unwrap();
        assert_eq!(
            chat["chat_template_kwargs"],
            json!({"enable_thinking": false})
        );
        assert!(!chat.contains_key("continue_final_message"));
        let effort = map(json!({"input": "hi", "reasoning": {"effort": "low"}}));
        assert!(matches!(
            responses_to_chat(&effort),
            Err(AgentChatError::Unsupported(_))
        ));
        // should_continue_final_message: a last message or reasoning item cut short.
        for (last, continued) in [
            (
                json!({"role": "assistant", "content": "par", "status": "incomplete"}),
                true,
            ),
            (
                json!({"type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "par"}]}),
                true,
            ),
            (
                json!({"type": "reasoning", "summary": [], "status": "incomplete",
                    "content": [{"type": "reasoning_text", "text": "hm"}]}),
                true,
            ),
            (
                json!({"type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "done"}]}),
                false,
            ),
            (
                json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                    "status": "incomplete"}),
                false,
            ),
        ] {
            let prompt = map(json!({"input": [{"role": "user", "content": "q"}, last]}));
            let chat = responses_to_chat(&prompt).unwrap();
            let flag = |k: &str| chat.get(k).and_then(Value::as_bool);
            if continued {
                assert_eq!(flag("continue_final_message"), Some(true), "{last}");
                assert_eq!(flag("add_generation_prompt"), Some(false), "{last}");
            } else {
                assert_eq!(flag("continue_final_message"), None, "{last}");
                assert_eq!(flag("add_generation_prompt"), None, "{last}");
            }
        }
    }

    #[test]
    fn namespaced_and_custom_tools_are_shown_as_vllm_flattens_them() {
        let prompt = map(json!({
            "tools": [
                {"type": "namespace", "name": "fs", "description": "files", "tools": [
                    {"type": "function", "name": "ls", "parameters": {"type": "object"}},
                    {"type": "web_search"}]},
                {"type": "custom", "name": "patch", "description": "apply a patch",
                 "format": {"type": "text"}}],
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "namespace": "fs", "call_id": "c1", "name": "ls",
                 "arguments": "{}"},
                {"type": "custom_tool_call", "call_id": "c2", "name": "patch",
                 "input": "caf\u{e9}\n\"x\""},
                {"type": "function_call_output", "call_id": "c1", "output": "a"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
            ],
        }));
        let chat = responses_to_chat(&prompt).unwrap();
        assert_eq!(
            chat["tools"],
            json!([
                {"type": "function", "function": {"name": "fs__ls", "description": null,
                                                  "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "patch", "description": "apply a patch",
                    "parameters": {"type": "object", "properties": {"input": {"type": "string",
                        "description": "The freeform text payload for this tool."}},
                        "required": ["input"], "additionalProperties": false}}},
            ])
        );
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "fs__ls", "arguments": "{}"}},
                    // json.dumps({"input": payload}, ensure_ascii=False)
                    {"id": "c2", "type": "function",
                     "function": {"name": "patch",
                                  "arguments": "{\"input\": \"caf\u{e9}\\n\\\"x\\\"\"}"}}]},
                {"role": "tool", "content": "a", "tool_call_id": "c1"},
                {"role": "tool", "content": "ok", "tool_call_id": "c2"},
            ])
        );
        let odd = map(json!({"input": [{"type": "custom_tool_call", "name": "p", "input": 3}]}));
        assert!(matches!(
            responses_to_chat(&odd),
            Err(AgentChatError::BadPrompt(_))
        ));
    }

    #[test]
    fn tool_changes_resolve_into_the_tools_in_effect_at_the_end() {
        let tool = |name: &str| {
            json!({"name": name, "input_schema": {"type": "object"},
                                       "defer_loading": true})
        };
        let change = |kind: &str, tool: Value| json!({"type": kind, "tool": tool});
        let reference = |name: &str| json!({"type": "tool_reference", "name": name});
        let prompt = map(json!({
            "tools": [tool("a"), tool("b"), tool("c")],
            "messages": [
                {"role": "system", "content": [
                    {"type": "text", "text": "tools changed"},
                    change("tool_addition", reference("a")),
                    change("tool_removal", reference("b")),
                    change("tool_addition",
                           json!({"type": "tool_definition", "definition": tool("d")})),
                    change("tool_removal", reference("c")),
                    change("tool_addition", reference("c"))]},
                {"role": "user", "content": "go"}],
        }));
        let chat = messages_to_chat(&prompt, Some(true)).unwrap();
        let names: Vec<_> = chat["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let f = &t["function"];
                (
                    f["name"].as_str().unwrap(),
                    f.get("defer_loading").is_some(),
                )
            })
            .collect();
        // a undeferred, b removed, c removed then added back (undeferred), d declared.
        assert_eq!(names, [("a", false), ("c", false), ("d", true)]);
        assert_eq!(
            chat["messages"][0],
            json!({"role": "system", "content": "tools changed"})
        );
        // Added tools count for tool_choice none; an unknown reference is vLLM's 400.
        let mut added = map(json!({"tool_choice": {"type": "none"}, "messages": [
            {"role": "system", "content": [change("tool_addition",
                json!({"type": "tool_definition", "definition": tool("d")}))]}]}));
        assert!(matches!(
            messages_to_chat(&added, Some(true)),
            Err(AgentChatError::Unsupported(_))
        ));
        added.remove("tool_choice");
        assert_eq!(
            messages_to_chat(&added, Some(true)).unwrap()["tools"][0]["function"]["name"],
            "d"
        );
        let unknown = map(json!({"messages": [{"role": "system", "content": [
            change("tool_removal", reference("zz"))]}]}));
        assert!(matches!(
            messages_to_chat(&unknown, Some(true)),
            Err(AgentChatError::BadPrompt(_))
        ));
    }
}
