//! Wire types shared by the filter (client) and the control plane (server).
//!
//! The filter sends only hashes and numbers in approximate mode: never the prompt text.
//! All types are plain serde structs so both sides, fleet-sim and the tests agree on one shape.
//! Closed sets are enums spelled as they always were on the wire; those a newer peer may extend
//! (`reason`, `error_type`) keep a spelling they do not know verbatim instead of failing the
//! whole message, since a route answer that does not parse makes the filter fail open.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

pub mod hash_list;

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
    /// `/v1/responses` (OpenAI Responses): `instructions`, `input` items and `tools`; a
    /// `previous_response_id` names a response only the replica that stored it can continue.
    Responses,
    /// `/v1/messages` (Anthropic Messages): `system`, `messages` of content blocks and `tools`.
    Messages,
}

impl ApiKind {
    /// Every API, in the order the filter's default routes list them.
    pub const ALL: [ApiKind; 4] = [
        ApiKind::Chat,
        ApiKind::Completion,
        ApiKind::Responses,
        ApiKind::Messages,
    ];

    /// The path vLLM 0.33 serves the API on: the filter's default route for it, and how
    /// `kvroute-analyze` tells a logged request's API.
    pub fn path(self) -> &'static str {
        match self {
            ApiKind::Chat => "/v1/chat/completions",
            ApiKind::Completion => "/v1/completions",
            ApiKind::Responses => "/v1/responses",
            ApiKind::Messages => "/v1/messages",
        }
    }

    /// The body fields that decide the engine's prompt tokens (template input and options):
    /// the filter forwards exactly these as `prompt_text` and the control plane's remote
    /// tokeniser sends exactly these to vLLM, so both sides agree on what a prompt is.
    pub fn prompt_fields(self) -> &'static [&'static str] {
        match self {
            ApiKind::Chat => &[
                "model",
                "messages",
                "tools",
                "add_generation_prompt",
                "continue_final_message",
                "chat_template",
                "chat_template_kwargs",
                "documents",
            ],
            ApiKind::Completion => &["model", "prompt"],
            ApiKind::Responses => &[
                "model",
                "input",
                "instructions",
                "tools",
                "tool_choice",
                "previous_response_id",
                // vLLM turns `reasoning.effort` into template options; the client's own
                // `chat_template_kwargs` reach the template as they do for chat.
                "reasoning",
                "chat_template_kwargs",
            ],
            ApiKind::Messages => &[
                "model",
                "system",
                "messages",
                "tools",
                "tool_choice",
                "thinking",
                "output_config",
                "chat_template_kwargs",
            ],
        }
    }

    /// The wire spelling (configuration, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::Chat => "chat",
            ApiKind::Completion => "completion",
            ApiKind::Responses => "responses",
            ApiKind::Messages => "messages",
        }
    }
}

/// Serde's test for leaving a zero count off the wire (here and in `sync`).
pub(crate) fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// "Where should this request go?": what the filter asks the control plane.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// The `model` field of the body (vLLM names a LoRA adapter as the model).
    pub model: String,
    /// Chained block hashes of the canonical prompt, first block first (an array, or base64:
    /// [`hash_list`]).
    #[serde(default, with = "hash_list")]
    pub block_hashes: Vec<u64>,
    /// Size of the canonical prompt in bytes.
    #[serde(default)]
    pub prompt_bytes: u64,
    /// Estimated prompt length in tokens (the filter estimates from bytes).
    #[serde(default)]
    pub prompt_tokens: u32,
    /// Leading `block_hashes` blocks (whole blocks only) that the client marked with Anthropic
    /// `cache_control`: it will send them again, so the router holds them where they are
    /// cached more firmly (`router.cache_control`). 0 (absent): nothing marked.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub marked_blocks: u32,
    /// `max_tokens` / `max_completion_tokens` of the request, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    /// Optional session key (header or body `user`) for session affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Chained hashes of the prompt's token ids in engine-block units (precise mode). The
    /// control plane fills these after tokenising `prompt_text`; fleet-sim fills them directly.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "hash_list")]
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
    /// Criticality from the criticality header (`critical`, `standard`, `sheddable`, an llm-d
    /// priority or objective name), so the control plane sheds the least important requests
    /// first when the fleet is saturated. Any string parses (see [`RequestedCriticality`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criticality: Option<RequestedCriticality>,
    /// A stored response this request continues or reads (Responses `previous_response_id`,
    /// or the id of `GET /v1/responses/{id}` and its `cancel`): only the replica that stored
    /// it can serve the request, so the router sends it there when it knows which one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// The replica this proxy saw serve `previous_response_id` (its own recent answers), for
    /// when the router has not heard of the response yet (the report is still on its way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_endpoint: Option<String>,
    /// The proxy's own id for this route call, so that when it stops waiting (its route
    /// timeout) it can withdraw whatever the control plane decides late
    /// ([`FeedbackBatch::withdrawn`]) instead of leaving phantom load until `inflight_ttl_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<u64>,
    /// Outcomes the proxy had queued when it made this call: applied before the decision, so
    /// requests that finished since the last feedback flush no longer count as waiting.
    /// Not part of the decision (never replicated or logged).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finished: Vec<Outcome>,
    /// First-token reports the proxy had queued, applied before the decision like `finished`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first_tokens: Vec<FirstToken>,
    /// The client asked for a streamed response, so its first token is seen when it is
    /// generated and the proxy reports it ([`FirstToken`]); a buffered response shows nothing
    /// before its end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
}

/// How important a request is when the fleet is saturated.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Criticality {
    /// Shed last (only at `critical_at`, never by default).
    Critical,
    /// The default: shed at `standard_at`, or at `sheddable_at` when its tenant is over its
    /// fair share.
    #[default]
    Standard,
    /// Shed first, as soon as the fleet is saturated.
    Sheddable,
}

impl Criticality {
    /// Every level, most important first (for metrics).
    pub const ALL: [Criticality; 3] = [
        Criticality::Critical,
        Criticality::Standard,
        Criticality::Sheddable,
    ];

    /// Stable snake_case name (wire spelling, metric label, explain output).
    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Critical => "critical",
            Criticality::Standard => "standard",
            Criticality::Sheddable => "sheddable",
        }
    }

    /// Reads a header value: a level name (any case, as GIE's `Critical|Standard|Sheddable`),
    /// or an llm-d `InferenceObjective`-style integer priority (negative = sheddable, 0 =
    /// standard, positive = critical). Anything else is `None` (the caller then looks the
    /// value up as a configured objective name).
    pub fn parse(value: &str) -> Option<Criticality> {
        let v = value.trim();
        if v.eq_ignore_ascii_case("critical") {
            Some(Criticality::Critical)
        } else if v.eq_ignore_ascii_case("standard") {
            Some(Criticality::Standard)
        } else if v.eq_ignore_ascii_case("sheddable") {
            Some(Criticality::Sheddable)
        } else {
            v.parse::<i64>().ok().map(|p| match p {
                p if p < 0 => Criticality::Sheddable,
                0 => Criticality::Standard,
                _ => Criticality::Critical,
            })
        }
    }
}

/// What a request's criticality header asked for. The header is free text: a level, an
/// integer priority, or an llm-d objective name whose level only the control plane's
/// `admission.objectives` knows. So every string is accepted, never failing the route call: a
/// level or priority reads as its [`Criticality`] (spelled `critical`, `standard` or
/// `sheddable` on the wire), anything else travels verbatim as a name, and admission gives a
/// name it does not know `admission.default_criticality`, as it does a missing header.
/// A non-string JSON value is still a malformed request (rejected, as before).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RequestedCriticality {
    /// A level name (any case) or an integer priority.
    Level(Criticality),
    /// Anything else: an objective name, resolved (or defaulted) by admission.
    Named(String),
}

impl RequestedCriticality {
    /// Classifies a header value (see [`Criticality::parse`]); names keep their spelling.
    pub fn from_header(value: &str) -> Self {
        match Criticality::parse(value) {
            Some(level) => Self::Level(level),
            None => Self::Named(value.to_owned()),
        }
    }

    /// The wire spelling: a level's snake_case name, or the name as received.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Level(level) => level.as_str(),
            Self::Named(name) => name,
        }
    }
}

impl From<&str> for RequestedCriticality {
    fn from(value: &str) -> Self {
        Self::from_header(value)
    }
}

impl From<Criticality> for RequestedCriticality {
    fn from(level: Criticality) -> Self {
        Self::Level(level)
    }
}

impl Serialize for RequestedCriticality {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Level(level) => level.serialize(serializer),
            Self::Named(name) => serializer.serialize_str(name),
        }
    }
}

impl<'de> Deserialize<'de> for RequestedCriticality {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeaderValue;
        impl Visitor<'_> for HeaderValue {
            type Value = RequestedCriticality;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a criticality header value as a string (a level, a priority or an objective name)",
                )
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<Self::Value, E> {
                Ok(RequestedCriticality::from_header(value))
            }
        }
        deserializer.deserialize_str(HeaderValue)
    }
}

/// The control plane refuses a request; the filter answers it locally with an OpenAI-style error.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reject {
    /// HTTP status for the client (404 unknown model, 413 too large for the tenant, 429 shed).
    pub status: u16,
    /// Human-readable message for `error.message`.
    pub message: String,
    /// OpenAI-style `error.type`, which the filter's local answer carries.
    pub error_type: RejectType,
    /// Seconds for a `Retry-After` header (429 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<u32>,
}

/// Why the control plane refused a request: the OpenAI-style `error.type` of the filter's local
/// answer, so clients see the error they would get from OpenAI or vLLM.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectType {
    /// 404: no endpoint serves the model (`models.unknown_model: reject`).
    ModelNotFound,
    /// 413: the prompt exceeds the tenant's `max_prompt_bytes`.
    RequestTooLarge,
    /// 429: shed by admission (saturation, fair share, TTFT bound).
    RateLimitExceeded,
    /// A type this build does not know (a newer control plane), kept verbatim so the filter
    /// still answers locally with it rather than failing the route call.
    #[serde(untagged)]
    Other(String),
}

impl RejectType {
    /// The wire spelling (OpenAI's `error.type`).
    pub fn as_str(&self) -> &str {
        match self {
            Self::ModelNotFound => "model_not_found",
            Self::RequestTooLarge => "request_too_large",
            Self::RateLimitExceeded => "rate_limit_exceeded",
            Self::Other(other) => other,
        }
    }
}

impl From<&str> for RejectType {
    /// Reads a wire spelling, as deserialising it would.
    fn from(value: &str) -> Self {
        match value {
            "model_not_found" => Self::ModelNotFound,
            "request_too_large" => Self::RequestTooLarge,
            "rate_limit_exceeded" => Self::RateLimitExceeded,
            other => Self::Other(other.to_owned()),
        }
    }
}

impl Default for RejectType {
    /// The empty spelling, which is what an answer without a type always read as.
    fn default() -> Self {
        Self::Other(String::new())
    }
}

/// Why a route answer is what it is: decision metrics, the explain header and the fleet page
/// group decisions by it. Spelled in snake_case on the wire, as it always was.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteReason {
    /// The chosen endpoint holds the longest cached prefix of the prompt (none holds more).
    Prefix,
    /// Chosen on load: no candidate holds a prefix, or a busier one holds a longer one.
    Load,
    /// The guard skipped the cheapest candidate: too many requests in flight there, or the
    /// request's wait there past `scoring.wait_cap` times the soonest start.
    Guard,
    /// No usable endpoint: the list is empty and the filter fails open.
    NoEndpoint,
    /// Sent to the replica that stored the response the request continues or reads.
    StoredResponse,
    /// The control plane's admission gate refused the request (`reject` says why).
    Rejected,
    /// The router refused it: no endpoint serves the model (`reject` is the 404).
    ModelNotFound,
    /// Refused for its size (a reject type that may reach the reason through the router).
    RequestTooLarge,
    /// Refused by a rate or load limit (idem).
    RateLimitExceeded,
    /// The proxy withdrew the call before it was decided (it stopped waiting and failed
    /// open): nothing was accounted, and the answer reaches nobody.
    Withdrawn,
    /// A reason this build does not know (a newer control plane), or none (empty), kept
    /// verbatim so the answer still parses; the filter sanitises it for its header.
    #[serde(untagged)]
    Other(String),
}

impl RouteReason {
    /// The wire spelling (metric label value, explain header, debug JSON).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Prefix => "prefix",
            Self::Load => "load",
            Self::Guard => "guard",
            Self::NoEndpoint => "no_endpoint",
            Self::StoredResponse => "stored_response",
            Self::Rejected => "rejected",
            Self::ModelNotFound => "model_not_found",
            Self::RequestTooLarge => "request_too_large",
            Self::RateLimitExceeded => "rate_limit_exceeded",
            Self::Withdrawn => "withdrawn",
            Self::Other(other) => other,
        }
    }
}

impl From<&str> for RouteReason {
    /// Reads a wire spelling, as deserialising it would.
    fn from(value: &str) -> Self {
        match value {
            "prefix" => Self::Prefix,
            "load" => Self::Load,
            "guard" => Self::Guard,
            "no_endpoint" => Self::NoEndpoint,
            "stored_response" => Self::StoredResponse,
            "rejected" => Self::Rejected,
            "withdrawn" => Self::Withdrawn,
            other => RejectType::from(other).into(),
        }
    }
}

impl From<String> for RouteReason {
    fn from(value: String) -> Self {
        Self::from(value.as_str())
    }
}

impl From<RejectType> for RouteReason {
    /// The reason of a decision the router itself refused: the reject's type.
    fn from(kind: RejectType) -> Self {
        match kind {
            RejectType::ModelNotFound => Self::ModelNotFound,
            RejectType::RequestTooLarge => Self::RequestTooLarge,
            RejectType::RateLimitExceeded => Self::RateLimitExceeded,
            RejectType::Other(other) => Self::Other(other),
        }
    }
}

impl Default for RouteReason {
    /// The empty spelling, which is what an answer without a reason always read as.
    fn default() -> Self {
        Self::Other(String::new())
    }
}

/// The control plane's answer: endpoints to try, best first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteResponse {
    /// Identifies this decision in feedback and in the explain endpoint.
    pub decision_id: u64,
    /// `ip:port` of the chosen endpoint followed by fallbacks.
    pub endpoints: Vec<String>,
    /// Leading prompt blocks the chosen endpoint is believed to hold, in one unit whichever
    /// index scored it: engine KV blocks of `router.precise.block_tokens` tokens (16 by
    /// default, vLLM's `block_size`). Precise mode counts the GPU-resident blocks it saw in KV
    /// events; approximate mode the whole blocks its hit's tokens cover. `cached_tokens` is
    /// the finer figure (offloaded blocks at their weight, eviction ahead discounted).
    #[serde(default)]
    pub cached_blocks: u32,
    /// Prompt tokens the chosen endpoint is predicted to serve from its cache, in every mode:
    /// the engines' own unit (`usage.prompt_tokens_details.cached_tokens`), so a prediction is
    /// comparable with the outcome whichever index made it. Offloaded blocks count at
    /// `precise.offload_weight`, and a precise hit the queue ahead will evict is not counted.
    /// Equals the chosen candidate's `cached_tokens` in the explain output; 0 from a control
    /// plane that predates it.
    #[serde(default)]
    pub cached_tokens: u32,
    /// Why the chosen endpoint won, or why there is none: the explain header's and the
    /// decision metric's `reason`.
    #[serde(default)]
    pub reason: RouteReason,
    /// Set when the control plane refuses the request; the filter answers it locally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reject: Option<Reject>,
    /// `ip:port` of a prefill replica for `x-prefiller-host-port` (disaggregated serving).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefiller: Option<String>,
    /// A keyed MAC of `decision_id` and the asking proxy's address: an outcome must carry it
    /// back ([`Outcome::decision_tag`]), so nobody can release or rate another proxy's
    /// decisions by guessing their (sequential) ids. 0 from a router that signs nothing
    /// (fleet-sim, a proxy's local copy).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decision_tag: u64,
}

/// Serde's test for leaving a zero number off the wire (here and in `sync`).
pub(crate) fn is_zero(v: &u64) -> bool {
    *v == 0
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
    /// The id of the response the replica answered with (Responses API): a later
    /// `previous_response_id` naming it must go to `endpoint`, which stored it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    /// The route answer's [`RouteResponse::decision_tag`], echoed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decision_tag: u64,
}

/// "This request's first token has arrived": its prefill is done. The router takes it out of
/// its endpoint's measured queue at once ([`crate::router::Router::first_token`]), where the
/// outcome would come only when the whole answer has been generated; so the queue the router
/// prices is measured, not drained at an assumed prefill rate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirstToken {
    /// The decision whose response streamed its first token.
    pub decision_id: u64,
    /// The route answer's [`RouteResponse::decision_tag`], echoed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decision_tag: u64,
    /// The proxy's own time from routing the request to its first token, ms. The router reads
    /// a replica's prefill rate from it ([`crate::calibration::ShownPrefill`]): the report
    /// itself arrives a feedback tick later, or after a failover to another control plane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<u64>,
}

/// A batch of outcomes: the filter's root context flushes these on a tick.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FeedbackBatch {
    /// Outcomes in the order the requests finished.
    pub outcomes: Vec<Outcome>,
    /// [`RouteRequest::call_id`]s of route calls the proxy stopped waiting for (it failed
    /// open): their decisions, made or still to be made, hold no load.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub withdrawn: Vec<u64>,
    /// Routed requests whose first token arrived since the last batch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first_tokens: Vec<FirstToken>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value's JSON, which must be the quoted `spelling`, and the value read back from it.
    fn wire<T: Serialize + for<'de> Deserialize<'de>>(value: &T) -> (String, T) {
        let json = serde_json::to_string(value).unwrap();
        let back = serde_json::from_str(&json).unwrap();
        (json, back)
    }

    #[test]
    fn reasons_and_reject_types_keep_their_wire_spellings() {
        let reasons = [
            (RouteReason::Prefix, "prefix"),
            (RouteReason::Load, "load"),
            (RouteReason::Guard, "guard"),
            (RouteReason::NoEndpoint, "no_endpoint"),
            (RouteReason::StoredResponse, "stored_response"),
            (RouteReason::Rejected, "rejected"),
            (RouteReason::ModelNotFound, "model_not_found"),
            (RouteReason::RequestTooLarge, "request_too_large"),
            (RouteReason::RateLimitExceeded, "rate_limit_exceeded"),
        ];
        for (reason, spelling) in reasons {
            assert_eq!(reason.as_str(), spelling);
            assert_eq!(RouteReason::from(spelling), reason);
            assert_eq!(wire(&reason), (format!("\"{spelling}\""), reason));
        }
        let types = [
            (RejectType::ModelNotFound, "model_not_found"),
            (RejectType::RequestTooLarge, "request_too_large"),
            (RejectType::RateLimitExceeded, "rate_limit_exceeded"),
        ];
        for (kind, spelling) in types {
            assert_eq!(kind.as_str(), spelling);
            assert_eq!(RejectType::from(spelling), kind);
            assert_eq!(wire(&kind), (format!("\"{spelling}\""), kind.clone()));
            // A refusal by the router itself names its type as the reason.
            assert_eq!(RouteReason::from(kind).as_str(), spelling);
        }
    }

    #[test]
    fn unknown_reasons_and_reject_types_parse_and_keep_their_spelling() {
        // A newer control plane's answer still routes (and rejects) with an older filter.
        let answer = r#"{"decision_id":3,"endpoints":["10.0.0.1:8000"],"cached_blocks":2,
            "reason":"Warm Spare","reject":{"status":429,"message":"m","error_type":"quota_exceeded"}}"#;
        let r: RouteResponse = serde_json::from_str(answer).unwrap();
        assert_eq!(r.reason, RouteReason::Other("Warm Spare".into()));
        let reject = r.reject.unwrap();
        assert_eq!(
            reject.error_type,
            RejectType::Other("quota_exceeded".into())
        );
        assert_eq!(
            wire(&reject.error_type).0,
            "\"quota_exceeded\"",
            "the local answer carries the type as sent"
        );
        // An answer without a reason reads as the empty one, and writes it back as before.
        let r: RouteResponse = serde_json::from_str(r#"{"decision_id":1,"endpoints":[]}"#).unwrap();
        assert_eq!(r.reason.as_str(), "");
        let json = serde_json::to_string(&RouteResponse::default()).unwrap();
        assert_eq!(
            json,
            r#"{"decision_id":0,"endpoints":[],"cached_blocks":0,"cached_tokens":0,"reason":""}"#
        );
    }

    #[test]
    fn criticality_levels_travel_as_their_names_and_other_values_as_sent() {
        for level in Criticality::ALL {
            let requested = RequestedCriticality::Level(level);
            let spelling = format!("\"{}\"", level.as_str());
            assert_eq!(wire(&requested), (spelling.clone(), requested.clone()));
            assert_eq!(serde_json::to_string(&level).unwrap(), spelling);
        }
        // GIE's capitalised names and llm-d's integer priorities are levels.
        for (header, level) in [
            ("Critical", Criticality::Critical),
            (" SHEDDABLE ", Criticality::Sheddable),
            ("-3", Criticality::Sheddable),
            ("0", Criticality::Standard),
            ("7", Criticality::Critical),
        ] {
            assert_eq!(
                RequestedCriticality::from_header(header),
                RequestedCriticality::Level(level)
            );
            let parsed: RequestedCriticality =
                serde_json::from_str(&serde_json::to_string(header).unwrap()).unwrap();
            assert_eq!(parsed, RequestedCriticality::Level(level), "{header:?}");
        }
        // Anything else is a name, verbatim (admission maps objectives, defaults the rest).
        for name in ["batch", "Urgent!", "", "9999999999999999999999"] {
            let requested = RequestedCriticality::from_header(name);
            assert_eq!(requested, RequestedCriticality::Named(name.into()));
            assert_eq!(
                wire(&requested),
                (serde_json::to_string(name).unwrap(), requested.clone())
            );
        }
    }

    #[test]
    fn an_unknown_criticality_never_fails_the_route_call_but_a_non_string_does() {
        let request: RouteRequest =
            serde_json::from_str(r#"{"model":"m","criticality":"from-the-future"}"#).unwrap();
        assert_eq!(
            request.criticality,
            Some(RequestedCriticality::Named("from-the-future".into()))
        );
        let request: RouteRequest =
            serde_json::from_str(r#"{"model":"m","criticality":null}"#).unwrap();
        assert_eq!(request.criticality, None);
        // Headers are strings: a number was never a valid body, and says what was expected.
        let err = serde_json::from_str::<RouteRequest>(r#"{"model":"m","criticality":1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("criticality header value"), "{err}");
    }
}
