//! Plugin configuration: the JSON string in Envoy's wasm `configuration`.
//!
//! Every field is optional; an empty configuration means "all defaults". Unknown fields are
//! rejected so that a typo fails `on_configure` loudly instead of being silently ignored.

use scorer_core::hash::DEFAULT_BLOCK_BYTES;
use scorer_core::protocol::ApiKind;
use serde::Deserialize;

/// Why a plugin configuration was rejected. `on_configure` logs it and returns false.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The configuration is not valid JSON or has a field of the wrong type.
    #[error("plugin configuration is not valid JSON for kvroute: {0}")]
    Json(String),
    /// A field parsed but its value cannot work.
    #[error("invalid plugin configuration field `{field}`: {reason}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// How requests on a path are scored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteMode {
    /// Hashes of the canonical prompt bytes only: the prompt never leaves the proxy.
    #[default]
    Approximate,
    /// Also sends the prompt fields to the control plane, which tokenises them and scores
    /// endpoints on the KV blocks their engines report holding.
    Precise,
    /// No prefix term: only the body's `model` is read and the request goes where it would
    /// wait least (embeddings, scoring, reranking, `count_tokens`: nothing there reuses a
    /// cached prefix across requests).
    Load,
}

/// Where an approximate-mode request's destination is decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecisionMode {
    /// Each call asks the control plane (`POST /v1/route`): one side call per request.
    #[default]
    ControlPlane,
    /// The VM decides on its own copy of the routing state, kept current by a sync call on the
    /// tick (`POST /v1/sync`): no call on the request path. Until the first sync lands, or when
    /// the copy is older than `max_state_age_ms`, a request asks the control plane instead.
    /// Precise-mode paths always ask the control plane (it tokenises the prompt).
    Local,
}

/// Whether the tenant and criticality request headers are believed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdentityHeaders {
    /// A client could name any tenant's share or claim `critical` and skip shedding: the
    /// headers (kvroute's and llm-d's) are removed and every request is the default tenant,
    /// `standard`.
    #[default]
    Ignore,
    /// An authority in front of the filter sets them: `jwt_authn` (`claim_to_headers`) or
    /// `ext_authz`, with the client's own copies removed before it (the HCM's
    /// `early_header_mutation_extensions`; see envoy-config/README.md).
    Trusted,
}

/// One inference path the filter routes, and which API shape its body has.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRule {
    /// Request path, matched exactly after dropping any query string. A `responses` path also
    /// covers `{path}/{id}` (`GET`) and `{path}/{id}/cancel` (`POST`): sent to the replica that
    /// stored the response.
    pub path: String,
    /// How the body of requests on this path is canonicalised (not needed in `load` mode).
    #[serde(default)]
    pub api: Option<ApiKind>,
    /// `approximate` (default), `precise` or `load`.
    #[serde(default)]
    pub mode: RouteMode,
}

impl RouteRule {
    fn new(path: &str, api: Option<ApiKind>, mode: RouteMode) -> Self {
        RouteRule {
            path: path.into(),
            api,
            mode,
        }
    }
}

/// The paths vLLM 0.33 serves whose requests gain nothing from a cached prefix: routed by load.
/// (`/tokenize`, `/detokenize`, `/v1/models` and the audio APIs, multipart bodies, are left
/// to Envoy's own balancer.)
pub const LOAD_PATHS: [&str; 10] = [
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
];

/// Longest response id accepted in a `GET`/`cancel` path (vLLM's are 37 bytes).
const MAX_RESPONSE_ID_BYTES: usize = 128;

/// A request naming a stored response by its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponsePath<'a> {
    /// The response id.
    pub id: &'a str,
    /// `{path}/{id}/cancel` rather than `{path}/{id}`.
    pub cancel: bool,
}

/// The filter's configuration; see the crate docs for the JSON shape.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster name of the control plane (target of `dispatch_http_call`).
    pub control_plane_cluster: String,
    /// `:authority` of calls to the control plane.
    pub control_plane_authority: String,
    /// Deadline of the route call; past it the request fails open.
    pub route_timeout_ms: u64,
    /// Request header that carries the chosen `ip:port` list to Envoy's override_host LB.
    pub destination_header: String,
    /// Canonical bytes per hashed block; must match the control plane's expectation.
    pub block_bytes: usize,
    /// How often the root context flushes outcomes to `/v1/feedback` (`control-plane` mode).
    pub feedback_interval_ms: u64,
    /// Deadline of one feedback call.
    pub feedback_timeout_ms: u64,
    /// Bodies larger than this are not buffered or routed (Envoy's fallback LB picks).
    pub max_body_bytes: usize,
    /// Outcomes kept while waiting for a flush; older ones are dropped past this.
    pub max_queued_outcomes: usize,
    /// Optional shared secret sent as `x-kvroute-token`.
    pub auth_token: Option<String>,
    /// Whether a request carrying `x-kvroute-explain: 1` gets an `x-kvroute-decision` response
    /// header (decision id, reason, endpoint, cached blocks). Off by default: the header tells
    /// clients which replica served them.
    pub allow_explain: bool,
    /// Which paths are inference paths.
    pub routes: Vec<RouteRule>,
    /// Request header naming the tenant for admission and fair sharing (llm-d's
    /// `x-llm-d-inference-fairness-id` is accepted when this one is absent).
    pub tenant_header: String,
    /// Request header carrying `critical`, `standard` or `sheddable` (llm-d's
    /// `x-llm-d-inference-objective` is accepted when this one is absent).
    pub criticality_header: String,
    /// `ignore` (default) or `trusted`: whether `tenant_header`, `criticality_header` and
    /// llm-d's equivalents are believed (see [`IdentityHeaders`]).
    pub identity_headers: IdentityHeaders,
    /// Request header carrying the session key for session affinity (the body's `user` is the
    /// fallback when it is absent).
    pub session_header: String,
    /// `control-plane` (default) or `local`: see [`DecisionMode`].
    pub decision: DecisionMode,
    /// In `local` mode: how often the VM syncs its routing state (the tick period; outcomes
    /// travel in the same call, so `feedback_interval_ms` is not used). Default 25 ms
    /// ([`scorer_core::sync::DEFAULT_SYNC_INTERVAL_MS`] says why).
    pub sync_interval_ms: u64,
    /// In `local` mode: a copy not synced for this long is not trusted; requests ask the
    /// control plane until a sync lands again.
    pub max_state_age_ms: u64,
    /// In `local` mode: decisions and outcomes kept for the next sync; the oldest are dropped
    /// past this (the control plane expires what it never hears about).
    pub max_pending_reports: usize,
    /// In `local` mode: most prompt blocks the VM's copy indexes over all endpoints, the bulk
    /// of its memory (about 120 bytes a block natively). Each endpoint keeps at most this
    /// divided by the endpoints (and never more than its KV capacity), its least recently used
    /// blocks evicted first. 0: only each endpoint's KV capacity bounds it.
    pub max_index_blocks: usize,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            control_plane_cluster: "kvroute_control_plane".into(),
            control_plane_authority: "kvroute-control-plane".into(),
            route_timeout_ms: 50,
            destination_header: "x-gateway-destination-endpoint".into(),
            block_bytes: DEFAULT_BLOCK_BYTES,
            feedback_interval_ms: 200,
            feedback_timeout_ms: 1000,
            max_body_bytes: 4 * 1024 * 1024,
            max_queued_outcomes: 4096,
            auth_token: None,
            allow_explain: false,
            tenant_header: "x-kvroute-tenant".into(),
            criticality_header: "x-kvroute-criticality".into(),
            session_header: crate::machine::SESSION_HEADER.into(),
            decision: DecisionMode::ControlPlane,
            identity_headers: IdentityHeaders::Ignore,
            sync_interval_ms: scorer_core::sync::DEFAULT_SYNC_INTERVAL_MS,
            max_state_age_ms: 1000,
            max_pending_reports: 4096,
            max_index_blocks: 0,
            routes: default_routes(),
        }
    }
}

/// Every vLLM 0.33 path kvroute routes by default: the four generation APIs by their prompt's
/// cached prefix, the rest of [`LOAD_PATHS`] by load.
fn default_routes() -> Vec<RouteRule> {
    ApiKind::ALL
        .into_iter()
        .map(|api| RouteRule::new(api.path(), Some(api), RouteMode::Approximate))
        .chain(
            LOAD_PATHS
                .into_iter()
                .map(|path| RouteRule::new(path, None, RouteMode::Load)),
        )
        .collect()
}

impl FilterConfig {
    /// The headers of a JSON POST to the control plane at `path`, for either host: each names
    /// the authority its own way (`authority_header`: proxy-wasm's `:authority`, Envoy's
    /// dynamic-module callouts `host`). The shared secret rides along when one is set.
    pub fn control_plane_post<'a>(
        &'a self,
        authority_header: &'static str,
        path: &'a str,
    ) -> Vec<(&'a str, &'a str)> {
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (authority_header, self.control_plane_authority.as_str()),
            ("content-type", "application/json"),
        ];
        if let Some(token) = &self.auth_token {
            headers.push((crate::TOKEN_HEADER, token.as_str()));
        }
        headers
    }

    /// Parses and validates a plugin configuration. Empty or whitespace-only input means
    /// defaults (Envoy passes an empty buffer when `configuration` is unset).
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let trimmed = bytes.trim_ascii_start();
        let config = if trimmed.is_empty() {
            Self::default()
        } else if trimmed.first() != Some(&b'{') {
            // serde would also accept a JSON array as a struct; only an object is meant.
            return Err(ConfigError::Json("expected a JSON object".into()));
        } else {
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the values serde cannot: positive sizes and durations, a usable header name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
            ConfigError::Invalid {
                field,
                reason: reason.into(),
            }
        }
        if self.control_plane_cluster.is_empty() {
            return Err(invalid("control_plane_cluster", "must not be empty"));
        }
        if self.control_plane_authority.is_empty() {
            return Err(invalid("control_plane_authority", "must not be empty"));
        }
        if self.route_timeout_ms == 0 || self.route_timeout_ms > u64::from(u32::MAX) {
            return Err(invalid(
                "route_timeout_ms",
                "must be between 1 and 4294967295",
            ));
        }
        if self.feedback_interval_ms == 0 || self.feedback_interval_ms > u64::from(u32::MAX) {
            return Err(invalid(
                "feedback_interval_ms",
                "must be between 1 and 4294967295",
            ));
        }
        if self.sync_interval_ms == 0 || self.sync_interval_ms > u64::from(u32::MAX) {
            return Err(invalid(
                "sync_interval_ms",
                "must be between 1 and 4294967295",
            ));
        }
        if self.max_state_age_ms < self.sync_interval_ms {
            return Err(invalid(
                "max_state_age_ms",
                "must be at least sync_interval_ms (a copy would never be trusted)",
            ));
        }
        if self.max_pending_reports == 0 {
            return Err(invalid("max_pending_reports", "must be at least 1"));
        }
        if self.feedback_timeout_ms == 0 || self.feedback_timeout_ms > u64::from(u32::MAX) {
            return Err(invalid(
                "feedback_timeout_ms",
                "must be between 1 and 4294967295",
            ));
        }
        for (field, value) in [
            ("destination_header", &self.destination_header),
            ("tenant_header", &self.tenant_header),
            ("criticality_header", &self.criticality_header),
            ("session_header", &self.session_header),
        ] {
            if !is_header_name(value) {
                return Err(invalid(
                    field,
                    "must be a non-empty lowercase HTTP header name",
                ));
            }
        }
        if self.block_bytes == 0 {
            return Err(invalid("block_bytes", "must be positive"));
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be positive"));
        }
        if self.max_queued_outcomes == 0 {
            return Err(invalid("max_queued_outcomes", "must be positive"));
        }
        let bad_token = |t: &String| t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic());
        if self.auth_token.as_ref().is_some_and(bad_token) {
            return Err(invalid("auth_token", "must be non-empty visible ASCII"));
        }
        if let Some(rule) = self
            .routes
            .iter()
            .find(|r| r.api.is_none() && r.mode != RouteMode::Load)
        {
            return Err(invalid(
                "routes",
                format!(
                    "path {:?} needs an `api` (only `load` routes go without)",
                    rule.path
                ),
            ));
        }
        if let Some(rule) = self.routes.iter().find(|r| !r.path.starts_with('/')) {
            return Err(invalid(
                "routes",
                format!("path {:?} must start with '/'", rule.path),
            ));
        }
        // Requests are matched on the path without its query string, so a rule holding '?'
        // (or a fragment) could never match: refuse it instead of silently never routing.
        if let Some(rule) = self.routes.iter().find(|r| r.path.contains(['?', '#'])) {
            return Err(invalid(
                "routes",
                format!(
                    "path {:?} must not contain '?' or '#' (the query string is ignored)",
                    rule.path
                ),
            ));
        }
        Ok(())
    }

    /// The API of an inference path, or `None` when requests on `path` are not routed.
    /// The query string is ignored.
    pub fn api_for_path(&self, path: &str) -> Option<ApiKind> {
        self.route_for_path(path).and_then(|r| r.api)
    }

    /// `{responses path}/{id}` or `{responses path}/{id}/cancel` of a `responses` route, the
    /// paths that read or cancel a stored response. The query string is ignored; an id that is
    /// empty, too long or not `[A-Za-z0-9_-]` is not one.
    pub fn stored_response_path<'p>(&self, path: &'p str) -> Option<StoredResponsePath<'p>> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        self.routes
            .iter()
            .filter(|r| r.api == Some(ApiKind::Responses))
            .find_map(|r| {
                let rest = path.strip_prefix(r.path.as_str())?.strip_prefix('/')?;
                let (id, cancel) = match rest.strip_suffix("/cancel") {
                    Some(id) => (id, true),
                    None => (rest, false),
                };
                let valid = !id.is_empty()
                    && id.len() <= MAX_RESPONSE_ID_BYTES
                    && id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                valid.then_some(StoredResponsePath { id, cancel })
            })
    }

    /// The rule of an inference path (API and mode), or `None` when `path` is not routed.
    pub fn route_for_path(&self, path: &str) -> Option<&RouteRule> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        self.routes.iter().find(|r| r.path == path)
    }
}

/// Lowercase RFC 9110 token characters only (Envoy keeps header names lowercase).
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Both hosts send the same POST, each naming the authority its own way; the secret only
    // when one is set.
    #[test]
    fn a_control_plane_post_carries_the_authority_and_the_secret() {
        let mut config = FilterConfig::default();
        let headers = config.control_plane_post("host", "/v1/sync");
        assert!(headers.contains(&(":path", "/v1/sync")));
        assert!(headers.contains(&("host", config.control_plane_authority.as_str())));
        assert!(!headers.iter().any(|(k, _)| *k == crate::TOKEN_HEADER));
        config.auth_token = Some("s3cret".into());
        let headers = config.control_plane_post(":authority", "/v1/route");
        assert!(headers.contains(&(":authority", config.control_plane_authority.as_str())));
        assert!(headers.contains(&(crate::TOKEN_HEADER, "s3cret")));
    }

    #[test]
    fn empty_means_defaults() {
        assert_eq!(
            FilterConfig::from_json(b"").unwrap(),
            FilterConfig::default()
        );
        assert_eq!(
            FilterConfig::from_json(b" \n").unwrap(),
            FilterConfig::default()
        );
        assert_eq!(
            FilterConfig::from_json(b"{}").unwrap(),
            FilterConfig::default()
        );
    }

    #[test]
    fn agreed_fields_parse() {
        let c = FilterConfig::from_json(
            br#"{"control_plane_cluster":"cp","control_plane_authority":"a","route_timeout_ms":20,
            "destination_header":"x-dest","block_bytes":64,"feedback_interval_ms":100,
            "max_body_bytes":1000,"auth_token":"s3cret","allow_explain":true,
            "routes":[{"path":"/chat","api":"chat"}]}"#,
        )
        .unwrap();
        assert_eq!(c.control_plane_cluster, "cp");
        assert_eq!(c.route_timeout_ms, 20);
        assert_eq!(c.block_bytes, 64);
        assert_eq!(c.auth_token.as_deref(), Some("s3cret"));
        assert!(c.allow_explain);
        assert!(!FilterConfig::default().allow_explain);
        assert_eq!(c.api_for_path("/chat?x=1"), Some(ApiKind::Chat));
        assert_eq!(c.api_for_path("/v1/chat/completions"), None);
        assert_eq!(
            c.route_for_path("/chat").unwrap().mode,
            RouteMode::Approximate
        );
    }

    #[test]
    fn per_route_mode() {
        let c = FilterConfig::from_json(
            br#"{"routes":[{"path":"/p","api":"chat","mode":"precise"},
                          {"path":"/a","api":"completion","mode":"approximate"}]}"#,
        )
        .unwrap();
        assert_eq!(c.route_for_path("/p?q").unwrap().mode, RouteMode::Precise);
        assert_eq!(c.route_for_path("/a").unwrap().mode, RouteMode::Approximate);
        assert!(
            FilterConfig::from_json(br#"{"routes":[{"path":"/p","api":"chat","mode":"exact"}]}"#)
                .is_err()
        );
    }

    #[test]
    fn default_routes() {
        let c = FilterConfig::default();
        assert_eq!(c.api_for_path("/v1/chat/completions"), Some(ApiKind::Chat));
        assert_eq!(c.api_for_path("/v1/completions"), Some(ApiKind::Completion));
        assert_eq!(c.api_for_path("/v1/responses"), Some(ApiKind::Responses));
        assert_eq!(c.api_for_path("/v1/messages"), Some(ApiKind::Messages));
        assert_eq!(c.api_for_path("/v1/models"), None);
        assert_eq!(c.api_for_path("/v1/chat/completions/x"), None);
        for path in LOAD_PATHS {
            assert_eq!(c.route_for_path(path).unwrap().mode, RouteMode::Load);
        }
        assert!(c.route_for_path("/tokenize").is_none());
    }

    #[test]
    fn stored_response_paths() {
        let c = FilterConfig::default();
        let p = |path| c.stored_response_path(path);
        assert_eq!(
            p("/v1/responses/resp_1a?x=1"),
            Some(StoredResponsePath {
                id: "resp_1a",
                cancel: false
            })
        );
        assert!(p("/v1/responses/resp_1/cancel").unwrap().cancel);
        for not in [
            "/v1/responses",
            "/v1/responses/",
            "/v1/responses//cancel",
            "/v1/responses/a/b",
            "/v1/responses/a%2Fb",
            "/v1/responsesX/a",
            "/v1/messages/a",
        ] {
            assert_eq!(p(not), None, "{not}");
        }
        assert_eq!(p(&format!("/v1/responses/{}", "a".repeat(129))), None);
    }

    #[test]
    fn bad_configs_are_errors() {
        for bad in [
            "{",
            "[]",
            r#"{"route_timeout_ms":"fast"}"#,
            r#"{"unknown_field":1}"#,
            r#"{"route_timeout_ms":0}"#,
            r#"{"block_bytes":0}"#,
            r#"{"destination_header":"X-Upper"}"#,
            r#"{"destination_header":""}"#,
            r#"{"max_body_bytes":0}"#,
            r#"{"feedback_interval_ms":0}"#,
            r#"{"auth_token":""}"#,
            r#"{"auth_token":"a b"}"#,
            r#"{"routes":[{"path":"chat","api":"chat"}]}"#,
            r#"{"routes":[{"path":"/v1/comple?tions","api":"completion"}]}"#,
            r#"{"routes":[{"path":"/chat#x","api":"chat"}]}"#,
            r#"{"routes":[{"path":"/chat","api":"embeddings"}]}"#,
            r#"{"routes":[{"path":"/chat"}]}"#,
            r#"{"control_plane_cluster":""}"#,
            r#"{"allow_explain":"yes"}"#,
        ] {
            assert!(FilterConfig::from_json(bad.as_bytes()).is_err(), "{bad}");
        }
        // The agent APIs may be precise: the control plane tokenises them as chat.
        for good in [
            r#"{"routes":[{"path":"/r","api":"responses","mode":"precise"}]}"#,
            r#"{"routes":[{"path":"/m","api":"messages","mode":"precise"}]}"#,
        ] {
            assert!(FilterConfig::from_json(good.as_bytes()).is_ok(), "{good}");
        }
    }
}
