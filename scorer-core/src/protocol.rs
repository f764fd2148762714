//! Wire types shared by the filter (client) and the control plane (server).
//!
//! The filter sends only hashes and numbers in approximate mode: never the prompt text.
//! All types are plain serde structs so both sides, fleet-sim and the tests agree on one shape.

use serde::{Deserialize, Serialize};

/// Path of the route call the filter makes to the control plane.
pub const ROUTE_PATH: &str = "/v1/route";
/// Path of the batched outcome report the filter sends from its root context.
pub const FEEDBACK_PATH: &str = "/v1/feedback";

/// Which OpenAI-compatible API a request uses; decides how its prompt is canonicalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiKind {
    /// `/v1/chat/completions`: a list of messages (plus tools).
    Chat,
    /// `/v1/completions`: a string or an array prompt.
    Completion,
}

/// "Where should this request go?": what the filter asks the control plane.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// The `model` field of the body (vLLM names a LoRA adapter as the model).
    pub model: String,
    /// Chained block hashes of the canonical prompt, first block first.
    #[serde(default)]
    pub block_hashes: Vec<u64>,
    /// Size of the canonical prompt in bytes.
    #[serde(default)]
    pub prompt_bytes: u64,
    /// Estimated prompt length in tokens (the filter estimates from bytes).
    #[serde(default)]
    pub prompt_tokens: u32,
    /// `max_tokens` / `max_completion_tokens` of the request, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    /// Optional session key (header or body `user`) for session affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Chained hashes of the prompt's token ids in engine-block units (precise mode). The
    /// control plane fills these after tokenising `prompt_text`; fleet-sim fills them directly.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub token_block_hashes: Vec<u64>,
    /// The request's prompt fields as a JSON object (`{"model","messages","tools",...}` for
    /// chat, `{"model","prompt"}` for completions); sent only on routes configured as precise,
    /// so the control plane can tokenise it exactly as the engine will.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_text: Option<String>,
    /// Which API `prompt_text` belongs to (set whenever `prompt_text` is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<ApiKind>,
    /// The body's vLLM `cache_salt`, sent only with `prompt_text` (precise routes), so the
    /// control plane seeds its token-block hashes like the engine does
    /// (`hash::request_seed`). Approximate routes need not send it: their `block_hashes` are
    /// salted already. Absent means no salt, which is how older filters are read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// Tenant (fairness id) from the tenant header, for per-tenant limits and fair sharing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Criticality from the criticality header (`critical`, `standard`, `sheddable`), so the
    /// control plane sheds the least important requests first when the fleet is saturated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criticality: Option<String>,
}

/// The control plane refuses a request; the filter answers it locally with an OpenAI-style error.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reject {
    /// HTTP status for the client (404 unknown model, 413 too large for the tenant, 429 shed).
    pub status: u16,
    /// Human-readable message for `error.message`.
    pub message: String,
    /// OpenAI-style `error.type`, e.g. `model_not_found`, `rate_limit_exceeded`, `request_too_large`.
    pub error_type: String,
    /// Seconds for a `Retry-After` header (429 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<u32>,
}

/// The control plane's answer: endpoints to try, best first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteResponse {
    /// Identifies this decision in feedback and in the explain endpoint.
    pub decision_id: u64,
    /// `ip:port` of the chosen endpoint followed by fallbacks.
    pub endpoints: Vec<String>,
    /// Prefix blocks the chosen endpoint is believed to hold.
    #[serde(default)]
    pub cached_blocks: u32,
    /// Short machine-readable reason (`prefix`, `load`, `guard`, ...).
    #[serde(default)]
    pub reason: String,
    /// Set when the control plane refuses the request; the filter answers it locally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reject: Option<Reject>,
    /// `ip:port` of a prefill replica for `x-prefiller-host-port` (disaggregated serving).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefiller: Option<String>,
}

/// What happened to one routed request, reported after it finished.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The decision this outcome belongs to (0 when the request was not routed by kvroute).
    pub decision_id: u64,
    /// `ip:port` that actually served the request, when known.
    #[serde(default)]
    pub endpoint: String,
    /// HTTP status of the upstream response (0 when the stream was reset).
    #[serde(default)]
    pub status: u16,
    /// Time from routing to the first response body byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttfb_ms: Option<u64>,
    /// Time from routing to the end of the response.
    #[serde(default)]
    pub total_ms: u64,
    /// `usage.prompt_tokens` of the response, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u32>,
    /// `usage.completion_tokens` of the response, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`, when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
}

/// A batch of outcomes: the filter's root context flushes these on a tick.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FeedbackBatch {
    /// Outcomes in the order the requests finished.
    pub outcomes: Vec<Outcome>,
}
