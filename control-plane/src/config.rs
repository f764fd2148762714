//! The control plane's YAML configuration: parsed strictly, checked once at startup.
//!
//! Unknown keys are errors (a typo must not silently fall back to a default), every field but
//! `endpoints` has a default, and [`Config::validate`] rejects values that would make the
//! service misbehave later (zero intervals, duplicate endpoints, limits out of range).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use scorer_core::index::MAX_ENDPOINTS;
use scorer_core::router::RouterConfig;
use serde::{Deserialize, Serialize};

/// Everything `kvroute-control-plane --config FILE` reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Route and feedback API (Envoy cluster `kvroute_control_plane`).
    pub listen: SocketAddr,
    /// `/metrics`, `/healthz`, `/debug/*`; loopback by default since it explains decisions.
    pub admin_listen: SocketAddr,
    /// Shared secret the filter sends in `x-kvroute-token`; `null` disables the check.
    pub auth_token: Option<String>,
    /// A file holding `auth_token` (a mounted Kubernetes Secret), read at start; surrounding
    /// whitespace is ignored. Exclusive with `auth_token`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_token_file: Option<PathBuf>,
    /// Bearer token the admin port's `/debug/*` and fleet pages require (HTTP Basic with any
    /// user name and this password works too, for a browser); `/healthz` and `/metrics` stay
    /// open for probes and scrapers. `null`: the pages are open, which is only safe on
    /// loopback (the default `admin_listen`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token: Option<String>,
    /// A file holding `admin_token`, read at start. Exclusive with `admin_token`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<PathBuf>,
    /// How often each endpoint's `/metrics` is scraped.
    pub scrape_interval_ms: u64,
    /// Deadline for one scrape (connect, headers and body).
    pub scrape_timeout_ms: u64,
    /// Consecutive failed scrapes after which an endpoint stops being a candidate.
    pub unreachable_after_failures: u32,
    /// Largest `/metrics` body accepted from an endpoint.
    pub max_metrics_bytes: usize,
    /// Largest request body accepted on the route and feedback API (precise routes carry the
    /// prompt text, and the filter buffers up to 4 MiB).
    pub max_body_bytes: usize,
    /// Most `block_hashes` one route request may carry.
    pub max_block_hashes: usize,
    /// Most outcomes one feedback batch may carry.
    pub max_feedback_outcomes: usize,
    /// Deadline for reading a request body (a stalled client must not hold a task).
    pub body_timeout_ms: u64,
    /// How long a route call naming a stored response (`previous_response_id`) that no proxy
    /// has reported yet waits for the report. The proxy that served the response reports its
    /// id at once, but a client sending the next turn the moment the answer arrives, through
    /// another proxy, can beat that report by a few ms; without the wait the turn would be
    /// placed without its response and fail on the wrong replica. Keep it below the filter's
    /// `route_timeout_ms` (50 by default). 0: no wait.
    pub stored_response_wait_ms: u64,
    /// Recent decisions kept for `/debug/decisions/{id}`.
    pub decision_history: usize,
    /// Tokio worker threads. 0 (the default) runs the service on one thread that also waits
    /// for I/O: a route call is then read, decided and answered without waking a second
    /// thread (on small machines that hand-off was a measurable part of the call's latency).
    /// Routing holds one lock either way; tokenisation runs on the blocking pool.
    pub worker_threads: usize,
    /// How often each endpoint's `/v1/models` is polled for the models it serves (model
    /// pools, LoRA adapters); 0 never polls, leaving only the configured `model`/`models`.
    pub models_interval_ms: u64,
    /// The vLLM replicas, as `ip:port` exactly like Envoy's `vllm` cluster lists them.
    pub endpoints: Vec<EndpointConfig>,
    /// Scorer and index settings (`scorer_core::router::RouterConfig`).
    pub router: RouterConfig,
    /// Precise mode: KV-event subscription and tokenisation of precise routes' prompts.
    pub precise: PreciseSettings,
    /// Where more replicas come from at run time (Kubernetes pods or DNS); with it,
    /// `endpoints` may be empty.
    pub discovery: Option<crate::discovery::DiscoveryConfig>,
    /// Priorities, per-tenant prompt limits and fair sharing at the gateway
    /// (`scorer_core::fairness::AdmissionConfig`); absent: every request is routed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission: Option<scorer_core::fairness::AdmissionConfig>,
    /// TTFT/ITL targets for the autoscaling gauges (`crate::slo::SloConfig`); absent: no
    /// SLO gauges.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo: Option<crate::slo::SloConfig>,
    /// State replication to proxies that decide locally (`POST /v1/sync`).
    pub sync: SyncSettings,
    /// State shared with other control-plane replicas through NATS JetStream
    /// (`crate::replication`); absent: this control plane is the only one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication: Option<crate::replication::ReplicationConfig>,
    /// Endpoint Picker mode: also serve Envoy's ext_proc protocol, for gateways that route an
    /// InferencePool through a picker (`crate::picker`); absent: only the filter's API.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picker: Option<crate::picker::PickerConfig>,
}

/// The `sync:` section: the replicated log that proxies deciding locally pull.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyncSettings {
    /// Decisions and outcomes kept in the log; a proxy further behind than this starts over
    /// from the whole log (a reset), so it bounds both memory and how long a proxy may lag.
    pub log_entries: usize,
}

/// Default `sync.log_entries`: at a few thousand decisions a second, tens of seconds of lag.
pub const DEFAULT_SYNC_LOG_ENTRIES: usize = 65_536;

impl Default for SyncSettings {
    fn default() -> Self {
        Self {
            log_entries: DEFAULT_SYNC_LOG_ENTRIES,
        }
    }
}

/// One vLLM replica.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` of the replica; also where its `/metrics` is scraped.
    pub address: String,
    /// Served model name: seeds the hashes of the replica's blocks stored without a LoRA
    /// adapter. Leave it unset on every endpoint (all base-model blocks share one seed) or set
    /// it on every endpoint (requests naming it use its seed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// More model names the replica serves besides `model` (its model pool membership, known
    /// before `/v1/models` is polled; polling adds what the replica lists itself).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// The replica's KV-event PUB socket (vLLM `--kv-events-config` `endpoint`), e.g.
    /// `tcp://10.0.0.5:5557`, or `auto`: ask the server's `GET /kv_event_sources` (vLLM
    /// 0.33) for every rank's publisher and replay socket; unset means the replica is always
    /// scored approximately.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The replica's replay ROUTER socket (`replay_endpoint`); without it a gap drops state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// Its role in a disaggregated fleet: `prefill`, `decode` or `both` (the default). A
    /// `prefill` replica is never a decode target; it prefills long prompts for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<scorer_core::disagg::EndpointRole>,
    /// vLLM's `--data-parallel-size` when the server runs several engines behind this one
    /// address (vLLM's internal load balancer): each rank becomes an endpoint of its own,
    /// `address#dp<rank>`, with its own index, load (the page's `engine="<rank>"` series) and
    /// KV events (`kv_events` with the port offset by the rank, as vLLM binds them); requests
    /// carry `X-data-parallel-rank`. Unset or 1: one engine. For the external-load-balancer
    /// layout (one port per rank) list each rank's address as an endpoint instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
}

impl EndpointConfig {
    /// The engines this server runs, as endpoints: itself, or one per data-parallel rank
    /// (named `address#dp<rank>`, KV-event sockets offset by the rank as vLLM offsets them).
    pub fn engines(&self) -> Vec<EndpointConfig> {
        let size = self.data_parallel_size.unwrap_or(1);
        if size <= 1 {
            return vec![self.clone()];
        }
        let offset = |socket: &Option<String>, rank| match socket.as_deref() {
            Some(AUTO_KV_EVENTS) => Some(AUTO_KV_EVENTS.to_owned()),
            other => other.and_then(|s| vllm_wire::kv_events::offset_endpoint_port(s, rank)),
        };
        (0..size)
            .map(|rank| EndpointConfig {
                address: scorer_core::address::rank_endpoint(&self.address, rank),
                kv_events: offset(&self.kv_events, rank),
                kv_events_replay: offset(&self.kv_events_replay, rank),
                data_parallel_size: None,
                ..self.clone()
            })
            .collect()
    }
}

/// `endpoints[].kv_events: auto`: the publishers come from the server's `/kv_event_sources`.
pub const AUTO_KV_EVENTS: &str = "auto";

/// The most data-parallel ranks one endpoint may declare (vLLM deployments run up to a few
/// hundred; more is a typo).
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;

/// How precise routes' prompts become token ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerBackend {
    /// Ask a healthy replica of the model (vLLM's render or tokenize API).
    #[default]
    Remote,
    /// In process: the model's `tokenizer.json` and its chat template.
    Hf,
    /// Do not tokenise: precise routes are scored approximately.
    None,
}

/// Which vLLM API the `remote` tokenizer calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoteApi {
    /// `POST /v1/chat/completions/render`, `/v1/completions/render` (vLLM >= 0.33 with
    /// `--enable-scale-out`, or a `vllm launch render` sidecar): `token_ids`.
    #[default]
    Render,
    /// `POST /tokenize` (every vLLM release with the OpenAI server): `tokens`.
    Tokenize,
}

/// The `precise:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreciseSettings {
    /// Tokenizer backend for precise routes.
    pub tokenizer: TokenizerBackend,
    /// API the `remote` backend calls.
    pub remote_api: RemoteApi,
    /// Deadline of one remote tokenisation (the filter's route timeout must cover it).
    pub tokenize_timeout_ms: u64,
    /// `hf` backend: path of the model's `tokenizer.json`.
    pub tokenizer_json: Option<PathBuf>,
    /// `hf` backend: path of `tokenizer_config.json` (chat template, BOS/EOS tokens).
    pub tokenizer_config: Option<PathBuf>,
    /// `hf` backend: a Jinja chat template file overriding the one in `tokenizer_config`.
    pub chat_template: Option<PathBuf>,
    /// `hf` backend: the replicas' `--default-chat-template-kwargs` (e.g.
    /// `{enable_thinking: false}`), which vLLM merges under each request's
    /// `chat_template_kwargs`; give the same here so the router renders as the replicas do.
    /// (The `remote` backend needs none: the replicas' render API applies their own.)
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Tokenised prompt segments (hf) or whole prompts (remote) kept for reuse.
    pub cache_entries: usize,
    /// Topic prefix subscribed to on every publisher (vLLM's `topic`; empty = all).
    pub kv_events_topic: String,
    /// Deadline for connecting to a publisher or replay socket.
    pub kv_connect_timeout_ms: u64,
    /// Deadline for a whole replay.
    pub kv_replay_timeout_ms: u64,
    /// First delay before reconnecting to a lost publisher (doubles up to the max).
    pub kv_reconnect_min_ms: u64,
    /// Largest reconnect delay.
    pub kv_reconnect_max_ms: u64,
}

impl Default for PreciseSettings {
    fn default() -> Self {
        Self {
            tokenizer: TokenizerBackend::Remote,
            remote_api: RemoteApi::Render,
            tokenize_timeout_ms: 500,
            tokenizer_json: None,
            tokenizer_config: None,
            chat_template: None,
            default_chat_template_kwargs: serde_json::Map::new(),
            cache_entries: 65_536,
            kv_events_topic: String::new(),
            kv_connect_timeout_ms: 2_000,
            kv_replay_timeout_ms: 2_000,
            kv_reconnect_min_ms: 100,
            kv_reconnect_max_ms: 5_000,
        }
    }
}

impl EndpointConfig {
    /// The model names configured for this endpoint: `model`, then `models`.
    pub fn served_model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.model.iter().cloned().collect();
        names.extend(
            self.models
                .iter()
                .filter(|m| !names.contains(m))
                .cloned()
                .collect::<Vec<_>>(),
        );
        names
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9002)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9003)),
            auth_token: None,
            auth_token_file: None,
            admin_token: None,
            admin_token_file: None,
            scrape_interval_ms: 100,
            scrape_timeout_ms: 250,
            unreachable_after_failures: 3,
            max_metrics_bytes: 8 << 20,
            max_body_bytes: 16 << 20,
            max_block_hashes: 65_536,
            max_feedback_outcomes: 10_000,
            body_timeout_ms: 2_000,
            stored_response_wait_ms: 30,
            decision_history: 1_024,
            worker_threads: 0,
            models_interval_ms: 5_000,
            endpoints: Vec::new(),
            router: RouterConfig::default(),
            precise: PreciseSettings::default(),
            discovery: None,
            admission: None,
            slo: None,
            sync: SyncSettings::default(),
            replication: None,
            picker: None,
        }
    }
}

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The path given on the command line.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML is malformed, has an unknown key or a value of the wrong type.
    #[error("invalid config: {0}")]
    Parse(#[from] serde_yaml_ng::Error),
    /// `picker.filter` is not a filter configuration.
    #[error("picker.filter: {0}")]
    Picker(String),
    /// An endpoint address is not `ip:port`.
    #[error("endpoints[{index}].address {address:?} is not ip:port ({reason})")]
    BadEndpoint {
        /// Position in the `endpoints` list.
        index: usize,
        /// The address as written.
        address: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The same endpoint is listed twice.
    #[error("endpoint {0} is listed more than once")]
    DuplicateEndpoint(String),
    /// No endpoints: every route request would fail open.
    #[error("no endpoints configured")]
    NoEndpoints,
    /// More endpoints than the prefix index can track.
    #[error("{count} endpoints configured, at most {MAX_ENDPOINTS} are supported")]
    TooManyEndpoints {
        /// How many were listed.
        count: usize,
    },
    /// A numeric setting is outside its sane range.
    #[error("{field} = {value} is out of range ({range})")]
    OutOfRange {
        /// Dotted path of the setting.
        field: &'static str,
        /// The value as written.
        value: String,
        /// The accepted range, for the message.
        range: &'static str,
    },
    /// `listen` and `admin_listen` are the same socket.
    #[error("listen and admin_listen are both {0}")]
    SameListener(SocketAddr),
    /// `auth_token` is set but empty or not a valid header value.
    #[error("auth_token must be non-empty visible ASCII (it is sent as an HTTP header)")]
    BadAuthToken,
    /// `admin_token` is set but empty or not a valid header value.
    #[error("admin_token must be non-empty visible ASCII (it is sent as an HTTP header)")]
    BadAdminToken,
    /// A secret is given both inline and as a file.
    #[error("{0} and {0}_file are both set; give the secret one way")]
    SecretTwice(&'static str),
    /// A secret file could not be read.
    #[error("reading {field} {path}: {source}")]
    SecretFile {
        /// `auth_token_file` or `admin_token_file`.
        field: &'static str,
        /// The path as configured.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A KV-event socket address is not a ZMQ `tcp://host:port` or `ipc://path` endpoint.
    #[error("endpoints[{index}].{field} {value:?} is not a ZMQ endpoint ({reason})")]
    BadZmqEndpoint {
        /// Position in the `endpoints` list.
        index: usize,
        /// `kv_events` or `kv_events_replay`.
        field: &'static str,
        /// The value as written.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The `discovery` section is unusable.
    #[error(transparent)]
    Discovery(#[from] crate::discovery::DiscoveryConfigError),
    /// The `admission` section is unusable.
    #[error(transparent)]
    Admission(#[from] scorer_core::fairness::AdmissionConfigError),
    /// The `slo` section is unusable.
    #[error(transparent)]
    Slo(#[from] crate::slo::SloConfigError),
    /// The `replication` section is unusable.
    #[error(transparent)]
    Replication(#[from] crate::replication::ReplicationConfigError),
    /// A `precise` setting is missing or inconsistent.
    #[error("precise.{field}: {reason}")]
    Precise {
        /// The setting.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl Config {
    /// Reads, parses and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Self::from_yaml(&text)?;
        config.read_secrets()?;
        Ok(config)
    }

    /// Reads `auth_token_file` and `admin_token_file` into the secrets they hold (checked like
    /// inline ones), so the rest of the service sees one field each.
    pub fn read_secrets(&mut self) -> Result<(), ConfigError> {
        let read = |field: &'static str, path: &Path| {
            std::fs::read_to_string(path)
                .map(|t| t.trim().to_string())
                .map_err(|source| ConfigError::SecretFile {
                    field,
                    path: path.to_path_buf(),
                    source,
                })
        };
        if let Some(path) = self.auth_token_file.take() {
            self.auth_token = Some(read("auth_token_file", &path)?);
        }
        if let Some(path) = self.admin_token_file.take() {
            self.admin_token = Some(read("admin_token_file", &path)?);
        }
        self.validate()
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = serde_yaml_ng::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Every engine the router scores, in configuration order: each endpoint, or each of its
    /// data-parallel ranks ([`EndpointConfig::engines`]).
    pub fn engines(&self) -> Vec<EndpointConfig> {
        self.endpoints
            .iter()
            .flat_map(EndpointConfig::engines)
            .collect()
    }

    /// The engines' endpoint addresses in configuration order (ranks as `ip:port#dp<rank>`).
    pub fn endpoint_addresses(&self) -> Vec<String> {
        self.engines().into_iter().map(|e| e.address).collect()
    }

    /// Engines with a configured KV-event publisher, as subscriber sources (those with
    /// `kv_events: auto` are found at run time: [`Config::auto_event_servers`]).
    pub fn event_sources(&self) -> Vec<crate::kv_events::EventSource> {
        self.engines()
            .into_iter()
            .filter(|e| e.kv_events.as_deref() != Some(AUTO_KV_EVENTS))
            .filter_map(|e| {
                Some(crate::kv_events::EventSource {
                    endpoint: e.kv_events?,
                    address: e.address,
                    replay_endpoint: e.kv_events_replay,
                    topic: self.precise.kv_events_topic.clone(),
                    model: e.model.unwrap_or_default(),
                })
            })
            .collect()
    }

    /// The endpoints whose publishers are to be asked for (`kv_events: auto`): each server
    /// with its engines' endpoint names and ranks.
    pub fn auto_event_servers(&self) -> Vec<crate::kv_events::sources::AutoServer> {
        self.endpoints
            .iter()
            .filter(|e| e.kv_events.as_deref() == Some(AUTO_KV_EVENTS))
            .map(|e| crate::kv_events::sources::AutoServer {
                server: e.address.clone(),
                engines: e
                    .engines()
                    .into_iter()
                    .map(|engine| {
                        let rank = scorer_core::address::split_rank(&engine.address).1;
                        (engine.address, rank.unwrap_or(0))
                    })
                    .collect(),
                model: e.model.clone().unwrap_or_default(),
                topic: self.precise.kv_events_topic.clone(),
            })
            .collect()
    }

    /// Checks every cross-field and range constraint.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(a) = &self.admission {
            a.validate()?;
        }
        if let Some(s) = &self.slo {
            s.validate()?;
        }
        if let Some(r) = &self.replication {
            r.validate()?;
        }
        if let Some(p) = &self.picker {
            p.filter_config()
                .map_err(|e| ConfigError::Picker(e.to_string()))?;
        }
        if self.endpoints.is_empty() && self.discovery.is_none() {
            return Err(ConfigError::NoEndpoints);
        }
        let engines: usize = self
            .endpoints
            .iter()
            .map(|e| {
                e.data_parallel_size
                    .unwrap_or(1)
                    .clamp(1, MAX_DATA_PARALLEL_SIZE) as usize
            })
            .sum();
        if engines > MAX_ENDPOINTS {
            return Err(ConfigError::TooManyEndpoints { count: engines });
        }
        let mut seen = HashSet::new();
        for (index, e) in self.endpoints.iter().enumerate() {
            let addr: SocketAddr = e.address.parse().map_err(|err: std::net::AddrParseError| {
                ConfigError::BadEndpoint {
                    index,
                    address: e.address.clone(),
                    reason: err.to_string(),
                }
            })?;
            if addr.port() == 0 {
                return Err(ConfigError::BadEndpoint {
                    index,
                    address: e.address.clone(),
                    reason: "port 0".into(),
                });
            }
            // Envoy matches the override header against its host list textually, so the
            // canonical form must be what is written.
            if addr.to_string() != e.address {
                return Err(ConfigError::BadEndpoint {
                    index,
                    address: e.address.clone(),
                    reason: format!("write it as {addr}"),
                });
            }
            if !seen.insert(addr) {
                return Err(ConfigError::DuplicateEndpoint(e.address.clone()));
            }
            for (field, value) in [
                ("kv_events", &e.kv_events),
                ("kv_events_replay", &e.kv_events_replay),
            ] {
                if let Some(v) = value
                    .as_ref()
                    .filter(|v| *v != AUTO_KV_EVENTS || field != "kv_events")
                {
                    check_zmq_endpoint(v).map_err(|reason| ConfigError::BadZmqEndpoint {
                        index,
                        field,
                        value: v.clone(),
                        reason,
                    })?;
                }
            }
            match e.data_parallel_size {
                Some(0) => {
                    return Err(ConfigError::BadEndpoint {
                        index,
                        address: e.address.clone(),
                        reason: "data_parallel_size 0 (at least 1)".into(),
                    });
                }
                Some(n) if n > MAX_DATA_PARALLEL_SIZE => {
                    return Err(ConfigError::BadEndpoint {
                        index,
                        address: e.address.clone(),
                        reason: format!(
                            "data_parallel_size {n} (at most {MAX_DATA_PARALLEL_SIZE})"
                        ),
                    });
                }
                Some(n) => {
                    // Every rank's sockets must exist: vLLM offsets the ports by the rank.
                    for (field, value) in [
                        ("kv_events", &e.kv_events),
                        ("kv_events_replay", &e.kv_events_replay),
                    ] {
                        let Some(v) = value.as_ref().filter(|v| *v != AUTO_KV_EVENTS) else {
                            continue;
                        };
                        if vllm_wire::kv_events::offset_endpoint_port(v, n - 1).is_none() {
                            return Err(ConfigError::BadZmqEndpoint {
                                index,
                                field,
                                value: v.clone(),
                                reason: "its port offset by the last data-parallel rank \
                                         is not a port",
                            });
                        }
                    }
                }
                None => {}
            }
            if e.kv_events.as_deref() == Some(AUTO_KV_EVENTS) && e.kv_events_replay.is_some() {
                return Err(ConfigError::BadZmqEndpoint {
                    index,
                    field: "kv_events_replay",
                    value: e.kv_events_replay.clone().unwrap_or_default(),
                    reason: "with kv_events: auto the server lists its replay sockets",
                });
            }
            if e.kv_events_replay.is_some() && e.kv_events.is_none() {
                return Err(ConfigError::BadZmqEndpoint {
                    index,
                    field: "kv_events_replay",
                    value: e.kv_events_replay.clone().unwrap_or_default(),
                    reason: "set without kv_events",
                });
            }
        }
        let with_model = self.endpoints.iter().filter(|e| e.model.is_some()).count();
        if with_model != 0 && with_model != self.endpoints.len() {
            return Err(ConfigError::Precise {
                field: "model",
                reason: "set `model` on every endpoint or on none (it seeds the block hashes)"
                    .into(),
            });
        }
        validate_precise(&self.precise)?;
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            return Err(ConfigError::SameListener(self.listen));
        }
        let bad_token = |t: &String| t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic());
        if self.auth_token.as_ref().is_some_and(bad_token) {
            return Err(ConfigError::BadAuthToken);
        }
        if self.admin_token.as_ref().is_some_and(bad_token) {
            return Err(ConfigError::BadAdminToken);
        }
        if self.auth_token.is_some() && self.auth_token_file.is_some() {
            return Err(ConfigError::SecretTwice("auth_token"));
        }
        if self.admin_token.is_some() && self.admin_token_file.is_some() {
            return Err(ConfigError::SecretTwice("admin_token"));
        }
        range_u64(
            "scrape_interval_ms",
            self.scrape_interval_ms,
            10,
            60_000,
            "10..=60000",
        )?;
        range_u64(
            "scrape_timeout_ms",
            self.scrape_timeout_ms,
            1,
            60_000,
            "1..=60000",
        )?;
        range_u64(
            "unreachable_after_failures",
            self.unreachable_after_failures.into(),
            1,
            1_000_000,
            "1..=1000000",
        )?;
        range_u64(
            "max_metrics_bytes",
            self.max_metrics_bytes as u64,
            1 << 10,
            1 << 30,
            "1 KiB..=1 GiB",
        )?;
        range_u64(
            "max_body_bytes",
            self.max_body_bytes as u64,
            1 << 10,
            1 << 30,
            "1 KiB..=1 GiB",
        )?;
        range_u64(
            "max_block_hashes",
            self.max_block_hashes as u64,
            1,
            1 << 24,
            "1..=16777216",
        )?;
        range_u64(
            "max_feedback_outcomes",
            self.max_feedback_outcomes as u64,
            1,
            1 << 24,
            "1..=16777216",
        )?;
        range_u64(
            "stored_response_wait_ms",
            self.stored_response_wait_ms,
            0,
            10_000,
            "0..=10000",
        )?;
        range_u64(
            "body_timeout_ms",
            self.body_timeout_ms,
            1,
            600_000,
            "1..=600000",
        )?;
        range_u64(
            "decision_history",
            self.decision_history as u64,
            0,
            1 << 20,
            "0..=1048576",
        )?;
        range_u64(
            "worker_threads",
            self.worker_threads as u64,
            0,
            1024,
            "0..=1024",
        )?;
        // Each entry holds a request's block hashes: the upper bound keeps the log's memory
        // within reason (a few GiB at most with long prompts).
        range_u64(
            "sync.log_entries",
            self.sync.log_entries as u64,
            1,
            1 << 22,
            "1..=4194304",
        )?;
        if let Some(discovery) = &self.discovery {
            discovery.validate()?;
        }
        validate_router(&self.router)
    }
}

/// A ZMQ endpoint this subscriber can connect to: `tcp://host:port` (port > 0) or `ipc://path`.
fn check_zmq_endpoint(v: &str) -> Result<(), &'static str> {
    if let Some(rest) = v.strip_prefix("tcp://") {
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err("expected tcp://host:port");
        };
        if host.is_empty() || host == "*" {
            return Err("a subscriber connects: give the publisher's host, not a bind address");
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(()),
            _ => Err("port must be 1..=65535"),
        }
    } else if v.strip_prefix("ipc://").is_some_and(|p| !p.is_empty()) {
        Ok(())
    } else {
        Err("expected tcp://host:port or ipc://path")
    }
}

fn validate_precise(p: &PreciseSettings) -> Result<(), ConfigError> {
    let bad = |field: &'static str, reason: &str| ConfigError::Precise {
        field,
        reason: reason.into(),
    };
    range_u64(
        "precise.tokenize_timeout_ms",
        p.tokenize_timeout_ms,
        1,
        60_000,
        "1..=60000",
    )?;
    range_u64(
        "precise.cache_entries",
        p.cache_entries as u64,
        0,
        1 << 24,
        "0..=16777216",
    )?;
    for (field, v) in [
        ("precise.kv_connect_timeout_ms", p.kv_connect_timeout_ms),
        ("precise.kv_replay_timeout_ms", p.kv_replay_timeout_ms),
        ("precise.kv_reconnect_min_ms", p.kv_reconnect_min_ms),
        ("precise.kv_reconnect_max_ms", p.kv_reconnect_max_ms),
    ] {
        range_u64(field, v, 1, 600_000, "1..=600000")?;
    }
    if p.kv_reconnect_min_ms > p.kv_reconnect_max_ms {
        return Err(bad(
            "kv_reconnect_min_ms",
            "must not exceed kv_reconnect_max_ms",
        ));
    }
    if p.tokenizer == TokenizerBackend::Hf {
        if p.tokenizer_json.is_none() {
            return Err(bad(
                "tokenizer_json",
                "the hf tokenizer needs tokenizer.json",
            ));
        }
    } else if p.tokenizer_json.is_some() || p.chat_template.is_some() {
        return Err(bad(
            "tokenizer",
            "tokenizer_json / chat_template are only read by `tokenizer: hf`",
        ));
    }
    Ok(())
}

fn range_u64(
    field: &'static str,
    value: u64,
    min: u64,
    max: u64,
    range: &'static str,
) -> Result<(), ConfigError> {
    in_range(field, value, min..=max, range)
}

/// `value` checked against `bounds`; the error names `field` and `range` (`bounds` as written
/// for people).
fn in_range<T: PartialOrd + ToString>(
    field: &'static str,
    value: T,
    bounds: impl std::ops::RangeBounds<T>,
    range: &'static str,
) -> Result<(), ConfigError> {
    if bounds.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value: value.to_string(),
            range,
        })
    }
}

fn positive(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value: value.to_string(),
            range: "finite and > 0",
        })
    }
}

fn non_negative(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value: value.to_string(),
            range: "finite and >= 0",
        })
    }
}

/// The scorer divides by some of these and compares with others: keep them meaningful.
fn validate_router(r: &RouterConfig) -> Result<(), ConfigError> {
    range_u64(
        "router.block_bytes",
        r.block_bytes as u64,
        1,
        1 << 20,
        "1..=1048576",
    )?;
    positive("router.bytes_per_token", r.bytes_per_token)?;
    range_u64(
        "router.index_ttl_ms",
        r.index_ttl_ms,
        1,
        u64::MAX / 2,
        ">= 1",
    )?;
    range_u64(
        "router.inflight_ttl_ms",
        r.inflight_ttl_ms,
        1,
        u64::MAX / 2,
        ">= 1",
    )?;
    range_u64(
        "router.fallbacks",
        r.fallbacks as u64,
        0,
        MAX_ENDPOINTS as u64,
        "0..=256",
    )?;
    range_u64(
        "router.stale_after_ms",
        r.stale_after_ms,
        1,
        u64::MAX / 2,
        ">= 1",
    )?;
    let s = &r.scoring;
    positive(
        "router.scoring.prefill_tokens_per_ms",
        s.prefill_tokens_per_ms,
    )?;
    non_negative("router.scoring.decode_ms_per_seq", s.decode_ms_per_seq)?;
    in_range(
        "router.scoring.kv_pressure_threshold",
        s.kv_pressure_threshold,
        0.0..1.0,
        "0 <= x < 1",
    )?;
    non_negative("router.scoring.kv_pressure_ms", s.kv_pressure_ms)?;
    non_negative(
        "router.scoring.unknown_request_tokens",
        s.unknown_request_tokens,
    )?;
    positive("router.scoring.guard_rel", s.guard_rel)?;
    non_negative("router.scoring.tie_ms", s.tie_ms)?;
    non_negative("router.scoring.prefill_weight", s.prefill_weight)?;
    non_negative("router.scoring.kv_decode_ms", s.kv_decode_ms)?;
    non_negative("router.scoring.itl_ms_idle", s.itl_ms_idle)?;
    non_negative("router.scoring.itl_ms_full", s.itl_ms_full)?;
    non_negative("router.scoring.decode_weight", s.decode_weight)?;
    non_negative("router.scoring.agent_decode_weight", s.agent_decode_weight)?;
    non_negative(
        "router.scoring.prefill_stall_weight",
        s.prefill_stall_weight,
    )?;
    non_negative(
        "router.scoring.decode_occupancy_weight",
        s.decode_occupancy_weight,
    )?;
    non_negative(
        "router.scoring.prefill_contention_weight",
        s.prefill_contention_weight,
    )?;
    positive(
        "router.scoring.prefill_contention_window_ms",
        s.prefill_contention_window_ms,
    )?;
    non_negative("router.local.defer_above_ms", r.local.defer_above_ms)?;
    non_negative(
        "router.local.first_token_contention_weight",
        r.local.first_token_contention_weight,
    )?;
    let p = &r.precise;
    range_u64(
        "router.precise.block_tokens",
        p.block_tokens as u64,
        1,
        1 << 16,
        "1..=65536",
    )?;
    in_range(
        "router.precise.offload_weight",
        p.offload_weight,
        0.0..=1.0,
        "0 <= x <= 1",
    )?;
    let l = &r.latency;
    let unit_ranges = [
        ("router.latency.blend", l.blend, 0.0, "0 <= x <= 1"),
        (
            "router.latency.forgetting",
            l.forgetting,
            0.5,
            "0.5 <= x <= 1",
        ),
        (
            "router.latency.error_smoothing",
            l.error_smoothing,
            0.001,
            "0.001 <= x <= 1",
        ),
    ];
    for (field, value, low, range) in unit_ranges {
        in_range(field, value, low..=1.0, range)?;
    }
    non_negative("router.latency.overhead_ms", l.overhead_ms)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "endpoints:\n  - address: 127.0.0.1:8001\n";

    fn err(text: &str) -> String {
        Config::from_yaml(text).unwrap_err().to_string()
    }

    #[test]
    fn defaults_fill_everything_but_endpoints() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:9002");
        assert_eq!(c.admin_listen.to_string(), "127.0.0.1:9003");
        assert_eq!(c.scrape_interval_ms, 100);
        assert_eq!(c.router, RouterConfig::default());
        assert_eq!(c.endpoint_addresses(), vec!["127.0.0.1:8001".to_string()]);
    }

    #[test]
    fn the_documented_example_parses() {
        let text = r#"
listen: 127.0.0.1:9002
admin_listen: 127.0.0.1:9003
auth_token: null
scrape_interval_ms: 100
endpoints:
  - address: 127.0.0.1:8001
  - address: "[::1]:8002"
router: {}
"#;
        let c = Config::from_yaml(text).unwrap();
        assert_eq!(c.endpoints.len(), 2);
        let text = "router:\n  fallbacks: 1\n  scoring:\n    tie_ms: 2.0\nendpoints:\n  - address: 10.0.0.1:8000\n";
        let c = Config::from_yaml(text).unwrap();
        assert_eq!((c.router.fallbacks, c.router.scoring.tie_ms), (1, 2.0));
    }

    #[test]
    fn typos_are_errors() {
        assert!(
            err(&format!("{MINIMAL}scrape_intervall_ms: 5\n"))
                .contains("unknown field `scrape_intervall_ms`")
        );
        assert!(
            err("endpoints:\n  - address: 127.0.0.1:8001\n    weight: 2\n")
                .contains("unknown field `weight`")
        );
        assert!(
            err(&format!("{MINIMAL}router:\n  fallback: 1\n")).contains("unknown field `fallback`")
        );
        assert!(err(&format!("{MINIMAL}scrape_interval_ms: fast\n")).contains("invalid config"));
        assert!(err("listen: [1, 2]\n").contains("invalid config"));
    }

    #[test]
    fn a_data_parallel_server_is_one_endpoint_per_rank() {
        let c = Config::from_yaml(
            "endpoints:\n  - address: 10.0.0.1:8000\n    data_parallel_size: 3\n    \
             kv_events: tcp://10.0.0.1:5557\n    kv_events_replay: tcp://10.0.0.1:5600\n  \
             - address: 10.0.0.2:8000\n",
        )
        .unwrap();
        assert_eq!(
            c.endpoint_addresses(),
            [
                "10.0.0.1:8000#dp0",
                "10.0.0.1:8000#dp1",
                "10.0.0.1:8000#dp2",
                "10.0.0.2:8000"
            ]
        );
        let sources = c.event_sources();
        let sockets: Vec<_> = sources
            .iter()
            .map(|s| {
                (
                    s.address.as_str(),
                    s.endpoint.as_str(),
                    s.replay_endpoint.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            sockets,
            [
                (
                    "10.0.0.1:8000#dp0",
                    "tcp://10.0.0.1:5557",
                    Some("tcp://10.0.0.1:5600")
                ),
                (
                    "10.0.0.1:8000#dp1",
                    "tcp://10.0.0.1:5558",
                    Some("tcp://10.0.0.1:5601")
                ),
                (
                    "10.0.0.1:8000#dp2",
                    "tcp://10.0.0.1:5559",
                    Some("tcp://10.0.0.1:5602")
                ),
            ]
        );
        assert!(
            err("endpoints:\n  - address: 10.0.0.1:8000\n    data_parallel_size: 0\n")
                .contains("data_parallel_size 0")
        );
        assert!(
            err(
                "endpoints:\n  - address: 10.0.0.1:8000\n    data_parallel_size: 4\n    \
                 kv_events: tcp://10.0.0.1:65534\n"
            )
            .contains("last data-parallel rank")
        );
        let many = format!(
            "endpoints:\n  - address: 10.0.0.1:8000\n    data_parallel_size: {}\n",
            MAX_ENDPOINTS + 1
        );
        assert!(
            err(&many).contains("endpoints configured"),
            "{}",
            err(&many)
        );
    }

    #[test]
    fn kv_events_auto_asks_the_server_for_every_ranks_publisher() {
        let c = Config::from_yaml(
            "endpoints:\n  - address: 10.0.0.1:8000\n    data_parallel_size: 2\n    \
             kv_events: auto\n  - address: 10.0.0.2:8000\n    kv_events: tcp://10.0.0.2:5557\n",
        )
        .unwrap();
        // Only the configured socket is subscribed at start; the others are asked for.
        let sources = c.event_sources();
        assert_eq!(sources.len(), 1);
        assert_eq!(sources[0].address, "10.0.0.2:8000");
        let auto = c.auto_event_servers();
        assert_eq!(auto.len(), 1);
        assert_eq!(auto[0].server, "10.0.0.1:8000");
        assert_eq!(
            auto[0].engines,
            [
                ("10.0.0.1:8000#dp0".to_string(), 0),
                ("10.0.0.1:8000#dp1".to_string(), 1)
            ]
        );
        assert!(
            err(
                "endpoints:\n  - address: 10.0.0.1:8000\n    kv_events: auto\n    \
                 kv_events_replay: tcp://10.0.0.1:5600\n"
            )
            .contains("lists its replay sockets")
        );
    }

    #[test]
    fn bad_endpoints() {
        assert!(err("endpoints: []\n").contains("no endpoints"));
        assert!(err("endpoints:\n  - address: vllm-0:8000\n").contains("is not ip:port"));
        assert!(err("endpoints:\n  - address: 127.0.0.1\n").contains("is not ip:port"));
        assert!(err("endpoints:\n  - address: 127.0.0.1:0\n").contains("port 0"));
        assert!(err("endpoints:\n  - address: \"[0:0::1]:80\"\n").contains("write it as [::1]:80"));
        let dup = "endpoints:\n  - address: 127.0.0.1:8001\n  - address: 127.0.0.1:8001\n";
        assert!(err(dup).contains("listed more than once"));
        let many: String = (0..=MAX_ENDPOINTS)
            .map(|i| format!("  - address: 10.0.{}.{}:80\n", i / 256, i % 256))
            .collect();
        assert!(err(&format!("endpoints:\n{many}")).contains("at most 256"));
    }

    #[test]
    fn bad_limits() {
        // Each setting added to a valid configuration, and what the error must name.
        for (extra, named) in [
            (
                "router:\n  scoring:\n    decode_weight: -1\n",
                "decode_weight",
            ),
            (
                "router:\n  scoring:\n    agent_decode_weight: -1\n",
                "agent_decode_weight",
            ),
            ("router:\n  precise:\n    block_tokens: 0\n", "block_tokens"),
            (
                "router:\n  precise:\n    offload_weight: 2\n",
                "offload_weight",
            ),
            (
                "router:\n  latency:\n    blend: 1.5\n",
                "router.latency.blend",
            ),
            (
                "scrape_interval_ms: 0\n",
                "scrape_interval_ms = 0 is out of range",
            ),
            ("max_block_hashes: 0\n", "max_block_hashes"),
            (
                "unreachable_after_failures: 0\n",
                "unreachable_after_failures",
            ),
            ("router:\n  block_bytes: 0\n", "router.block_bytes"),
            (
                "router:\n  bytes_per_token: .nan\n",
                "router.bytes_per_token",
            ),
            (
                "router:\n  scoring:\n    prefill_tokens_per_ms: 0\n",
                "prefill_tokens_per_ms",
            ),
            (
                "router:\n  scoring:\n    kv_pressure_threshold: 1.0\n",
                "kv_pressure_threshold",
            ),
            (
                "router:\n  local:\n    defer_above_ms: -1\n",
                "router.local.defer_above_ms",
            ),
            (
                "router:\n  local:\n    first_token_contention_weight: .nan\n",
                "router.local.first_token_contention_weight",
            ),
            (
                "listen: 127.0.0.1:7000\nadmin_listen: 127.0.0.1:7000\n",
                "both",
            ),
            ("auth_token: \"\"\n", "auth_token"),
            ("auth_token: \"a b\"\n", "auth_token"),
        ] {
            let e = err(&format!("{MINIMAL}{extra}"));
            assert!(e.contains(named), "{extra:?}: {e}");
        }
        let roles = "endpoints:\n  - address: 10.0.0.1:80\n    role: prefill\n  - address: 10.0.0.2:80\n    role: decode\n";
        let c = Config::from_yaml(roles).unwrap();
        assert_eq!(
            c.endpoints.iter().map(|e| e.role).collect::<Vec<_>>(),
            [
                Some(scorer_core::disagg::EndpointRole::Prefill),
                Some(scorer_core::disagg::EndpointRole::Decode)
            ]
        );
        assert!(
            Config::from_yaml(&roles.replace("decode", "encode")).is_err(),
            "unknown roles are errors"
        );
    }

    #[test]
    fn sync_settings() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.sync.log_entries, DEFAULT_SYNC_LOG_ENTRIES);
        let c = Config::from_yaml(&format!("{MINIMAL}sync:\n  log_entries: 10\n")).unwrap();
        assert_eq!(c.sync.log_entries, 10);
        assert!(
            err(&format!("{MINIMAL}sync:\n  log_entries: 0\n")).contains("sync.log_entries = 0")
        );
        assert!(
            err(&format!("{MINIMAL}sync:\n  log_entries: 99999999\n")).contains("sync.log_entries")
        );
        assert!(
            err(&format!("{MINIMAL}sync:\n  entries: 10\n")).contains("unknown field `entries`")
        );
    }

    #[test]
    fn precise_settings() {
        let text = r#"
endpoints:
  - address: 127.0.0.1:8001
    model: m
    kv_events: tcp://127.0.0.1:5557
    kv_events_replay: tcp://127.0.0.1:5558
  - address: 127.0.0.1:8002
    model: m
precise:
  tokenizer: remote
  remote_api: tokenize
  kv_events_topic: kv@
"#;
        let c = Config::from_yaml(text).unwrap();
        assert_eq!(c.precise.remote_api, RemoteApi::Tokenize);
        let sources = c.event_sources();
        assert_eq!(sources.len(), 1);
        assert_eq!(sources[0].address, "127.0.0.1:8001");
        assert_eq!(
            sources[0].replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(
            (sources[0].model.as_str(), sources[0].topic.as_str()),
            ("m", "kv@")
        );

        let ep = |extra: &str| format!("endpoints:\n  - address: 127.0.0.1:8001\n{extra}");
        for (extra, needle) in [
            ("    kv_events: 127.0.0.1:5557\n", "not a ZMQ endpoint"),
            ("    kv_events: tcp://*:5557\n", "bind address"),
            ("    kv_events: tcp://h:0\n", "port"),
            ("    kv_events_replay: tcp://h:1\n", "without kv_events"),
            ("    kv_event: tcp://h:1\n", "unknown field"),
        ] {
            assert!(
                err(&ep(extra)).contains(needle),
                "{extra}: {}",
                err(&ep(extra))
            );
        }
        let mixed =
            "endpoints:\n  - address: 127.0.0.1:8001\n    model: m\n  - address: 127.0.0.1:8002\n";
        assert!(err(mixed).contains("every endpoint or on none"));
        assert!(err(&format!("{MINIMAL}precise:\n  tokenizer: hf\n")).contains("tokenizer_json"));
        assert!(
            err(&format!("{MINIMAL}precise:\n  tokenizer_json: /t.json\n"))
                .contains("only read by `tokenizer: hf`")
        );
        assert!(
            err(&format!("{MINIMAL}precise:\n  tokenizer: sentencepiece\n"))
                .contains("invalid config")
        );
        assert!(
            err(&format!("{MINIMAL}precise:\n  kv_reconnect_min_ms: 9000\n"))
                .contains("kv_reconnect_min_ms")
        );
    }

    #[test]
    fn discovery_replaces_the_endpoint_list() {
        let c = Config::from_yaml(
            "discovery:\n  kubernetes:\n    selector: {matchLabels: {app: vllm}}\n    port: 8000\n",
        )
        .unwrap();
        assert!(c.endpoints.is_empty());
        assert!(c.discovery.unwrap().kubernetes.is_some());
        assert!(err("discovery:\n  dns: {name: vllm, port: 0}\n").contains("dns.port"));
        assert!(err("discovery: {}\n").contains("exactly one of"));
        assert!(err("discovery:\n  dns: {name: vllm}\n").contains("missing field `port`"));
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let e = Config::load(Path::new("/nonexistent/kvroute.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/kvroute.yaml"), "{e}");
    }
}
