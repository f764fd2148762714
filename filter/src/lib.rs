//! kvroute's proxy-wasm HTTP filter for Envoy.
//!
//! For each inference request (`POST /v1/chat/completions`, `POST /v1/completions`) the filter
//! holds the headers, buffers the JSON body, canonicalises and block-hashes the prompt with
//! `scorer-core`, asks the control plane `POST /v1/route` (hashes and numbers only, never the
//! prompt, unless the route is configured as precise), writes the answer into
//! `x-gateway-destination-endpoint` and resumes; Envoy's
//! `override_host` load balancer then sends the request there. Outcomes (status, latency, token
//! usage) go back in batches to `POST /v1/feedback`. Any failure fails open.
//!
//! With `"decision":"local"` the VM decides approximate requests itself, on its own copy of the
//! routing state (`scorer_core::sync::LocalRouter`): no call on the request path. Its tick
//! syncs that copy (`POST /v1/sync`: its decisions and outcomes out, every other router's and
//! the endpoint table in). Until the first sync lands, or when the copy is older than
//! `max_state_age_ms`, requests ask the control plane as above.
//!
//! Layout (sans-IO core, thin glue):
//! - [`config`]: the plugin configuration JSON;
//! - [`machine`]: the per-request state machine, returning actions and effects;
//! - [`usage`]: bounded scanning of response bodies for the `usage` object;
//! - [`metrics`]: the proxy metrics' names and what bumps each, for every host;
//! - [`root`]: root-context state (outcome queue, counters, the local routing copy);
//! - `host` (wasm32 only): the only module that touches proxy-wasm.
//!
//! Plugin configuration (all fields optional):
//! `{"control_plane_cluster":"kvroute_control_plane","control_plane_authority":"kvroute-control-plane",
//!   "route_timeout_ms":50,"destination_header":"x-gateway-destination-endpoint","block_bytes":256,
//!   "feedback_interval_ms":200,"feedback_timeout_ms":1000,"max_body_bytes":4194304,
//!   "max_queued_outcomes":4096,"auth_token":null,"allow_explain":false,
//!   "tenant_header":"x-kvroute-tenant","criticality_header":"x-kvroute-criticality",
//!   "decision":"control-plane","sync_interval_ms":25,"max_state_age_ms":1000,
//!   "max_pending_reports":4096,"max_index_blocks":0,
//!   "routes":[{"path":"/v1/chat/completions","api":"chat","mode":"approximate"},
//!             {"path":"/v1/completions","api":"completion","mode":"approximate"}]}`
//!
//! A route with `"mode":"precise"` also sends the request's prompt fields (`model`, `messages`,
//! `tools` and the chat-template options, or `model` and `prompt`) in `RouteRequest.prompt_text`,
//! so the control plane can tokenise them and score on the engines' reported KV blocks;
//! approximate routes never send prompt text.
//!
//! The tenant and criticality headers (or llm-d's `x-llm-d-inference-fairness-id` and
//! `x-llm-d-inference-objective`) travel in the route call for admission; when the control plane
//! refuses a request (`RouteResponse.reject`), the filter answers it locally with an OpenAI-style
//! JSON error (404, 413, 429 with `Retry-After`) and counts it in `kvroute_requests_rejected`.

pub mod config;
pub mod machine;
pub mod metrics;
pub mod response_id;
pub mod root;
pub mod usage;

#[cfg(target_arch = "wasm32")]
mod host;

/// Header carrying the shared secret on calls to the control plane.
pub const TOKEN_HEADER: &str = "x-kvroute-token";

/// A `:status` header's value as a number (every host reads the answers' status this way).
pub fn parse_status(value: &[u8]) -> Option<u16> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}
