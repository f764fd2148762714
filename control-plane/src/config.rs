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
    /// Recent decisions kept for `/debug/decisions/{id}`.
    pub decision_history: usize,
    /// The vLLM replicas, as `ip:port` exactly like Envoy's `vllm` cluster lists them.
    pub endpoints: Vec<EndpointConfig>,
    /// Scorer and index settings (`scorer_core::router::RouterConfig`).
    pub router: RouterConfig,
}

/// One vLLM replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` of the replica; also where its `/metrics` is scraped.
    pub address: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9002)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9003)),
            auth_token: None,
            scrape_interval_ms: 100,
            scrape_timeout_ms: 250,
            unreachable_after_failures: 3,
            max_metrics_bytes: 8 << 20,
            max_body_bytes: 16 << 20,
            max_block_hashes: 65_536,
            max_feedback_outcomes: 10_000,
            body_timeout_ms: 2_000,
            decision_history: 1_024,
            endpoints: Vec::new(),
            router: RouterConfig::default(),
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
}

impl Config {
    /// Reads, parses and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml(&text)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = serde_yaml_ng::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Endpoint addresses in configuration order.
    pub fn endpoint_addresses(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| e.address.clone()).collect()
    }

    /// Checks every cross-field and range constraint.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() {
            return Err(ConfigError::NoEndpoints);
        }
        if self.endpoints.len() > MAX_ENDPOINTS {
            return Err(ConfigError::TooManyEndpoints {
                count: self.endpoints.len(),
            });
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
        }
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            return Err(ConfigError::SameListener(self.listen));
        }
        if self
            .auth_token
            .as_ref()
            .is_some_and(|t| t.is_empty() || !t.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(ConfigError::BadAuthToken);
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
        validate_router(&self.router)
    }
}

fn range_u64(
    field: &'static str,
    value: u64,
    min: u64,
    max: u64,
    range: &'static str,
) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
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
    if !(0.0..1.0).contains(&s.kv_pressure_threshold) {
        return Err(ConfigError::OutOfRange {
            field: "router.scoring.kv_pressure_threshold",
            value: s.kv_pressure_threshold.to_string(),
            range: "0 <= x < 1",
        });
    }
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
    let p = &r.precise;
    range_u64(
        "router.precise.block_tokens",
        p.block_tokens as u64,
        1,
        1 << 16,
        "1..=65536",
    )?;
    if !(0.0..=1.0).contains(&p.offload_weight) {
        return Err(ConfigError::OutOfRange {
            field: "router.precise.offload_weight",
            value: p.offload_weight.to_string(),
            range: "0 <= x <= 1",
        });
    }
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
        assert!(
            err(&format!(
                "{MINIMAL}router:\n  scoring:\n    decode_weight: -1\n"
            ))
            .contains("decode_weight")
        );
        assert!(
            err(&format!(
                "{MINIMAL}router:\n  precise:\n    block_tokens: 0\n"
            ))
            .contains("block_tokens")
        );
        assert!(
            err(&format!(
                "{MINIMAL}router:\n  precise:\n    offload_weight: 2\n"
            ))
            .contains("offload_weight")
        );
        assert!(
            err(&format!("{MINIMAL}scrape_interval_ms: 0\n"))
                .contains("scrape_interval_ms = 0 is out of range")
        );
        assert!(err(&format!("{MINIMAL}max_block_hashes: 0\n")).contains("max_block_hashes"));
        assert!(
            err(&format!("{MINIMAL}unreachable_after_failures: 0\n"))
                .contains("unreachable_after_failures")
        );
        assert!(
            err(&format!("{MINIMAL}router:\n  block_bytes: 0\n")).contains("router.block_bytes")
        );
        assert!(
            err(&format!("{MINIMAL}router:\n  bytes_per_token: .nan\n"))
                .contains("router.bytes_per_token")
        );
        assert!(
            err(&format!(
                "{MINIMAL}router:\n  scoring:\n    prefill_tokens_per_ms: 0\n"
            ))
            .contains("prefill_tokens_per_ms")
        );
        assert!(
            err(&format!(
                "{MINIMAL}router:\n  scoring:\n    kv_pressure_threshold: 1.0\n"
            ))
            .contains("kv_pressure_threshold")
        );
        assert!(
            err(&format!(
                "{MINIMAL}listen: 127.0.0.1:7000\nadmin_listen: 127.0.0.1:7000\n"
            ))
            .contains("both")
        );
        assert!(err(&format!("{MINIMAL}auth_token: \"\"\n")).contains("auth_token"));
        assert!(err(&format!("{MINIMAL}auth_token: \"a b\"\n")).contains("auth_token"));
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let e = Config::load(Path::new("/nonexistent/kvroute.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/kvroute.yaml"), "{e}");
    }
}
