//! Faults around a REAL Envoy 1.40 running the kvroute wasm filter (issue 8, part 2).
//!
//! Each test builds its own topology on 127.0.0.1 from the harness's pieces: `vllm-sim`
//! replicas, the control plane, Envoy, and between Envoy and the control plane a *fault proxy*
//! (an HTTP/1.1 server in this process that forwards route/feedback calls, or delays them,
//! never answers, answers garbage or an error status, or drops the connection). The faults:
//! - the control plane slow beyond the filter's 50 ms route timeout, or hung;
//! - the control plane answering garbage, errors, unknown endpoints, or resetting;
//! - the control plane killed under load, then restarted on the same port;
//! - a replica killed in the middle of streams;
//! - a replica's `/metrics` answering garbage, or the replica hanging entirely;
//! - a replica joining late (listed but down at start, started under load).
//!
//! Requests must keep flowing: every request not in flight on a killed replica is answered
//! 200, and the ones that were get a clean error, never a hang. `chaos_mixed_faults` runs
//! random faults for `KVROUTE_CHAOS_SECS` seconds (default 8; `scripts/chaos.sh` runs longer).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use kvroute_harness::{
    ENVOY_KVROUTE_TEMPLATE, HttpClient, ManagedProcess, Tools, control_plane_yaml, envoy_base_id,
    free_port_besides, log_tail, plugin_config_json, prometheus_sum, render_envoy_config,
    target_dir, workspace_root,
};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::{self, bounded, tools, words};

const MODEL: &str = "kvroute-faults-model";
/// One request, stream included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Every fault test (not the chaos run) finishes within this.
const TEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The filter's route-call deadline in these topologies (the shipped default).
const ROUTE_TIMEOUT_MS: u64 = 50;
/// Scrape period of the control plane here.
const SCRAPE_MS: u64 = 100;

// ------------------------------------------------------------------------------------------
// The fault proxy between Envoy and the control plane

/// What the fault proxy does with the next route or feedback call.
#[derive(Debug, Clone, PartialEq)]
enum Mode {
    /// Forward to the real control plane.
    Pass,
    /// Forward after this many milliseconds.
    Delay(u64),
    /// Never answer (the connection stays open until the peer gives up).
    Hang,
    /// Answer 200 with this body.
    Garbage(String),
    /// Answer this status with a JSON error.
    Status(u16),
    /// Read the request, then close the connection without an answer.
    Close,
}

struct FaultProxy {
    port: u16,
    mode: Arc<Mutex<Mode>>,
    /// Calls seen (route and feedback).
    calls: Arc<AtomicU64>,
    /// Calls seen by path: `[/v1/route, /v1/feedback]` (to show the filter never stampedes).
    by_path: Arc<[AtomicU64; 2]>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    async fn start(upstream: String) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let calls = Arc::new(AtomicU64::new(0));
        let by_path: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
        let client = HttpClient::new();
        let (m, c, p) = (mode.clone(), calls.clone(), by_path.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (m, c, p, client, upstream) = (
                    m.clone(),
                    c.clone(),
                    p.clone(),
                    client.clone(),
                    upstream.clone(),
                );
                tokio::spawn(async move {
                    let _ = serve_proxy_connection(stream, m, c, p, client, upstream).await;
                });
            }
        });
        FaultProxy {
            port,
            mode,
            calls,
            by_path,
            task,
        }
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock() = mode;
    }

    /// `(route calls, feedback calls)` seen so far.
    fn route_and_feedback_calls(&self) -> (u64, u64) {
        (
            self.by_path[0].load(Ordering::Relaxed),
            self.by_path[1].load(Ordering::Relaxed),
        )
    }
}

/// One request head + body, or `None` at EOF.
async fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<(String, Vec<u8>)>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Ok(Some((head, body)))
}

async fn serve_proxy_connection(
    mut stream: TcpStream,
    mode: Arc<Mutex<Mode>>,
    calls: Arc<AtomicU64>,
    by_path: Arc<[AtomicU64; 2]>,
    client: HttpClient,
    upstream: String,
) -> std::io::Result<()> {
    while let Some((head, body)) = read_request(&mut stream).await? {
        calls.fetch_add(1, Ordering::Relaxed);
        let path = head.split(' ').nth(1).unwrap_or("/").to_string();
        if path.starts_with("/v1/route") {
            by_path[0].fetch_add(1, Ordering::Relaxed);
        } else if path.starts_with("/v1/feedback") {
            by_path[1].fetch_add(1, Ordering::Relaxed);
        }
        let token = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("x-kvroute-token"))
            .map(|(_, v)| v.trim().to_string());
        let current = mode.lock().clone();
        let delay = match current {
            Mode::Close => return Ok(()),
            Mode::Hang => {
                // Hold the connection until Envoy gives up on it.
                let mut sink = [0u8; 1024];
                while stream.read(&mut sink).await? > 0 {}
                return Ok(());
            }
            Mode::Garbage(text) => {
                write_answer(&mut stream, 200, &text).await?;
                continue;
            }
            Mode::Status(s) => {
                write_answer(&mut stream, s, &json!({"error": "injected"}).to_string()).await?;
                continue;
            }
            Mode::Delay(ms) => Duration::from_millis(ms),
            Mode::Pass => Duration::ZERO,
        };
        tokio::time::sleep(delay).await;
        let headers: Vec<(&str, &str)> = token
            .as_deref()
            .map(|t| vec![("x-kvroute-token", t)])
            .unwrap_or_default();
        let url = format!("http://{upstream}{path}");
        let forwarded = client
            .request(
                "POST",
                &url,
                &headers,
                Some(String::from_utf8_lossy(&body).into_owned()),
                Duration::from_secs(2),
            )
            .await;
        let Ok(resp) = forwarded else {
            // The control plane is gone: so is the connection, as with the real thing.
            return Ok(());
        };
        write_answer(&mut stream, resp.status, &resp.body).await?;
    }
    Ok(())
}

async fn write_answer(stream: &mut TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    let out = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(out.as_bytes()).await
}

// ------------------------------------------------------------------------------------------
// The topology

struct Sim {
    port: u16,
    process: Option<ManagedProcess>,
}

impl Sim {
    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

struct Topo {
    name: String,
    tools: Tools,
    log_dir: PathBuf,
    client: HttpClient,
    sims: Vec<Sim>,
    cp_api_port: u16,
    cp_admin_port: u16,
    cp: Option<ManagedProcess>,
    cp_starts: u32,
    proxy: FaultProxy,
    envoy: ManagedProcess,
    envoy_listen: String,
    envoy_admin: String,
}

static TOPO_COUNTER: AtomicU32 = AtomicU32::new(0);

async fn wait_ok(
    client: &HttpClient,
    url: &str,
    process: &mut ManagedProcess,
    what: &str,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if let Some(status) = process.exited() {
            return Err(format!(
                "{what} exited ({status}): {}",
                log_tail(process.log(), 20)
            ));
        }
        if client
            .get(url, Duration::from_secs(2))
            .await
            .is_ok_and(|r| r.status == 200)
        {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "{what} not ready at {url}: {}",
                log_tail(process.log(), 20)
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn spawn_sim(tools: &Tools, log_dir: &Path, port: u16, index: usize) -> ManagedProcess {
    let client = HttpClient::new();
    let name = format!("vllm-sim-{index}");
    let mut cmd = std::process::Command::new(&tools.vllm_sim);
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--model", MODEL, "--seed", &(index + 1).to_string()])
        .args(["--speed", "2"]);
    let log = log_dir.join(format!("{name}.log"));
    let mut process = ManagedProcess::spawn(&name, cmd, &log).unwrap_or_else(|e| panic!("{e}"));
    let url = format!("http://127.0.0.1:{port}/health");
    wait_ok(&client, &url, &mut process, &name)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    process
}

impl Topo {
    /// `replicas` simulators (the first `running` started now), the control plane behind the
    /// fault proxy, and Envoy in front of all of them.
    async fn start(tools: &Tools, name: &str, replicas: usize, running: usize) -> Topo {
        let tools = tools.clone();
        let n = TOPO_COUNTER.fetch_add(1, Ordering::Relaxed);
        let log_dir = target_dir()
            .join("e2e-logs")
            .join(format!("{name}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&log_dir).expect("log dir");
        let client = HttpClient::new();
        let mut sims = Vec::new();
        // Every port this topology picks, bound now or later (a replica that starts late, the
        // control plane restarted on its ports): none may be picked twice.
        let mut picked = Vec::new();
        fn pick(picked: &mut Vec<u16>) -> u16 {
            let port = free_port_besides(picked).expect("port");
            picked.push(port);
            port
        }
        for i in 0..replicas {
            let port = pick(&mut picked);
            let process = if i < running {
                Some(spawn_sim(&tools, &log_dir, port, i).await)
            } else {
                None
            };
            sims.push(Sim { port, process });
        }
        let cp_api_port = pick(&mut picked);
        let cp_admin_port = pick(&mut picked);
        let proxy = FaultProxy::start(format!("127.0.0.1:{cp_api_port}")).await;
        let addresses: Vec<String> = sims.iter().map(Sim::address).collect();

        // A port `free_port` picked can be taken by a concurrent test before Envoy binds it:
        // then Envoy exits at once, and a fresh pair of ports is tried.
        let mut attempt = 0;
        let (envoy, listen, admin) = loop {
            attempt += 1;
            let listen = pick(&mut picked);
            let admin = pick(&mut picked);
            let rendered = render_envoy_config(
                &workspace_root().join(ENVOY_KVROUTE_TEMPLATE),
                listen,
                admin,
                proxy.port,
                &tools.wasm,
                &plugin_config_json(&json!({"route_timeout_ms": ROUTE_TIMEOUT_MS})),
                &addresses,
                &[],
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let cfg = log_dir.join("envoy.yaml");
            std::fs::write(&cfg, rendered).expect("write envoy.yaml");
            let mut cmd = std::process::Command::new(&tools.envoy);
            cmd.arg("-c")
                .arg(&cfg)
                .args(["--concurrency", "1", "-l", "warning"])
                .args(["--component-log-level", "wasm:info"])
                .args([
                    "--base-id",
                    &envoy_base_id().to_string(),
                    "--use-dynamic-base-id",
                ]);
            let mut envoy = ManagedProcess::spawn("envoy", cmd, &log_dir.join("envoy.log"))
                .unwrap_or_else(|e| panic!("{e}"));
            match wait_ok(
                &client,
                &format!("http://127.0.0.1:{admin}/ready"),
                &mut envoy,
                "envoy",
            )
            .await
            {
                Ok(()) => break (envoy, listen, admin),
                Err(e) if attempt < 3 && e.contains("Address already in use") => continue,
                Err(e) => panic!("{e}"),
            }
        };

        let mut topo = Topo {
            name: name.to_string(),
            tools,
            log_dir,
            client,
            sims,
            cp_api_port,
            cp_admin_port,
            cp: None,
            cp_starts: 0,
            proxy,
            envoy,
            envoy_listen: format!("127.0.0.1:{listen}"),
            envoy_admin: format!("127.0.0.1:{admin}"),
        };
        topo.start_control_plane().await;
        // Routing needs one successful scrape of a running replica.
        topo.wait_for(Duration::from_secs(10), "a ready endpoint", async |t| {
            t.endpoint_health().await.iter().any(|(_, h)| h == "ready")
        })
        .await;
        topo
    }

    /// Starts (or restarts) the control plane on its fixed ports.
    async fn start_control_plane(&mut self) {
        let addresses: Vec<String> = self.sims.iter().map(Sim::address).collect();
        let yaml = control_plane_yaml(
            self.cp_api_port,
            self.cp_admin_port,
            SCRAPE_MS,
            &addresses,
            &json!({}),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let path = self.log_dir.join("control-plane.yaml");
        std::fs::write(&path, yaml).expect("write control-plane.yaml");
        self.cp_starts += 1;
        let mut cmd = std::process::Command::new(&self.tools.control_plane);
        cmd.arg("--config").arg(&path).env("RUST_LOG", "info");
        let log = self
            .log_dir
            .join(format!("control-plane-{}.log", self.cp_starts));
        let mut process =
            ManagedProcess::spawn("control-plane", cmd, &log).unwrap_or_else(|e| panic!("{e}"));
        for port in [self.cp_admin_port, self.cp_api_port] {
            wait_ok(
                &self.client,
                &format!("http://127.0.0.1:{port}/healthz"),
                &mut process,
                "control plane",
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
        self.cp = Some(process);
    }

    fn kill_control_plane(&mut self) {
        if let Some(mut cp) = self.cp.take() {
            cp.kill();
        }
    }

    /// SIGKILLs replica `i` (a process this test started).
    fn kill_replica(&mut self, i: usize) {
        if let Some(mut p) = self.sims[i].process.take() {
            p.kill();
        }
    }

    async fn start_replica(&mut self, i: usize) {
        let process = spawn_sim(&self.tools, &self.log_dir, self.sims[i].port, i).await;
        self.sims[i].process = Some(process);
    }

    fn url(&self) -> String {
        format!("http://{}", self.envoy_listen)
    }

    fn describe(&self) -> String {
        format!(
            "{}: logs in {}; envoy log tail:\n{}",
            self.name,
            self.log_dir.display(),
            log_tail(self.envoy.log(), 15)
        )
    }

    /// The body of `GET url`, empty when nothing answers: the control plane may be down on
    /// purpose, and the readers below take an empty body as "nothing there".
    async fn get_or_empty(&self, url: &str, timeout: Duration) -> String {
        self.client
            .get(url, timeout)
            .await
            .map(|r| r.body)
            .unwrap_or_default()
    }

    /// `(address, health)` from the control plane's `/debug/endpoints` (empty when it is down).
    async fn endpoint_health(&self) -> Vec<(String, String)> {
        let url = format!("http://127.0.0.1:{}/debug/endpoints", self.cp_admin_port);
        let body = self.get_or_empty(&url, Duration::from_secs(2)).await;
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|e| {
                        (
                            e["address"].as_str().unwrap_or_default().to_string(),
                            e["health"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `kvroute_index_blocks` from the control plane's admin metrics (0 when it is down).
    async fn index_blocks(&self) -> f64 {
        let url = format!("http://127.0.0.1:{}/metrics", self.cp_admin_port);
        let body = self.get_or_empty(&url, Duration::from_secs(2)).await;
        prometheus_sum(&body, "kvroute_index_blocks")
    }

    async fn health_of(&self, i: usize) -> String {
        let address = self.sims[i].address();
        self.endpoint_health()
            .await
            .into_iter()
            .find(|(a, _)| *a == address)
            .map(|(_, h)| h)
            .unwrap_or_default()
    }

    /// Polls `check` every 50 ms until it holds, or fails the test after `limit`.
    async fn wait_for(&self, limit: Duration, what: &str, check: impl AsyncFn(&Topo) -> bool) {
        let started = Instant::now();
        while !check(self).await {
            assert!(
                started.elapsed() < limit,
                "{what} did not happen within {limit:?} ({})",
                self.describe()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A filter counter from Envoy's stats (`wasmcustom.kvroute_<name>`).
    async fn counter(&self, name: &str) -> f64 {
        let url = format!("http://{}/stats?filter=wasmcustom", self.envoy_admin);
        let body = self.get_or_empty(&url, Duration::from_secs(5)).await;
        body.lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(k, _)| *k == format!("wasmcustom.kvroute_{name}"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// No wasm panic or trap in Envoy's log, no VM reload.
    async fn assert_filter_healthy(&self) {
        let log = std::fs::read_to_string(self.envoy.log()).unwrap_or_default();
        for needle in ["panicked", "Uncaught", "RuntimeError"] {
            assert!(
                !log.contains(needle),
                "Envoy log mentions {needle:?}: {}",
                self.describe()
            );
        }
        let url = format!("http://{}/stats?filter=wasm", self.envoy_admin);
        let stats = self.get_or_empty(&url, Duration::from_secs(5)).await;
        assert!(
            stats.contains("wasm.kvroute.vm_reload: 0"),
            "wasm VM reloaded: {stats}"
        );
    }

    async fn set_sim_fault(&self, i: usize, fault: Value) {
        common::set_sim_fault(&self.client, &self.sims[i].address(), &fault).await;
    }

    /// One request through Envoy, which must be answered in full.
    async fn chat_ok(&self, body: &Value) -> Done {
        let done = chat(&self.client, &self.url(), body, None).await;
        assert!(done.ok(), "{done:?}");
        done
    }

    /// Waits (5 s at most) until the control plane reports replica `i` as `health`: how the
    /// replica tests see a fault, a kill or a start take effect. `what` names it in a failure.
    async fn wait_health(&self, i: usize, health: &str, what: &str) {
        self.wait_for(Duration::from_secs(5), what, async |t| {
            t.health_of(i).await == health
        })
        .await;
    }
}

// ------------------------------------------------------------------------------------------
// Requests

fn chat_body(system_seed: u64, user_seed: u64, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": format!("Session {system_seed}. {}", words(system_seed, 600))},
            {"role": "user", "content": words(user_seed, 30)},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// How one request through Envoy ended.
#[derive(Debug, Clone)]
struct Done {
    status: u16,
    replica: Option<String>,
    /// The response ended properly (`[DONE]` for streams, a JSON body otherwise).
    complete: bool,
    error: Option<String>,
    elapsed: Duration,
}

impl Done {
    fn ok(&self) -> bool {
        self.status == 200 && self.complete && self.error.is_none()
    }
}

/// Sends one chat request and reads the response to its end (or its error), bounded by
/// [`REQUEST_TIMEOUT`]. `on_headers` fires once the response headers are in.
async fn chat(
    client: &HttpClient,
    base: &str,
    body: &Value,
    on_headers: Option<tokio::sync::mpsc::UnboundedSender<String>>,
) -> Done {
    let started = Instant::now();
    let stream = body["stream"].as_bool().unwrap_or(false);
    let fut = async {
        let url = format!("{base}/v1/chat/completions");
        let req = kvroute_harness::build_request("POST", &url, &[], Some(body.to_string()))
            .map_err(|e| e.to_string())?;
        let resp = client
            .hyper()
            .request(req)
            .await
            .map_err(|e| format!("request: {e:?}"))?;
        let status = resp.status().as_u16();
        let replica = kvroute_harness::replica_from_headers(resp.headers());
        if let (Some(tx), Some(r)) = (on_headers, replica.clone()) {
            let _ = tx.send(r);
        }
        let mut body = resp.into_body();
        let mut bytes = Vec::new();
        let mut error = None;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Some(d) = f.data_ref() {
                        bytes.extend_from_slice(d);
                    }
                }
                Err(e) => {
                    error = Some(format!("body: {e}"));
                    break;
                }
            }
        }
        let text = String::from_utf8_lossy(&bytes);
        let complete = if stream {
            text.trim_end().ends_with("data: [DONE]")
        } else {
            serde_json::from_slice::<Value>(&bytes).is_ok_and(|v| v["choices"].is_array())
        };
        Ok::<_, String>((
            status,
            replica,
            complete,
            error,
            text.chars().take(200).collect::<String>(),
        ))
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Err(_) => Done {
            status: 0,
            replica: None,
            complete: false,
            error: Some(format!("hung: no end within {REQUEST_TIMEOUT:?}")),
            elapsed: started.elapsed(),
        },
        Ok(Err(e)) => Done {
            status: 0,
            replica: None,
            complete: false,
            error: Some(e),
            elapsed: started.elapsed(),
        },
        Ok(Ok((status, replica, complete, error, head))) => Done {
            status,
            replica,
            complete,
            error: error.or_else(|| (status != 200).then(|| format!("status {status}: {head}"))),
            elapsed: started.elapsed(),
        },
    }
}

/// `n` requests (alternating streamed and not) from `workers` concurrent clients, every one of
/// which must be answered in full ([`assert_all_ok`], as `what`: no burst of these tests may
/// lose a request); returns every result.
async fn burst(topo: &Topo, what: &str, seed: u64, n: usize, workers: usize) -> Vec<Done> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let client = topo.client.clone();
        let url = topo.url();
        tasks.spawn(async move {
            let mut out = Vec::new();
            for i in (w..n).step_by(workers) {
                let body = chat_body(
                    seed + i as u64 % 4,
                    seed * 1000 + i as u64,
                    4,
                    i.is_multiple_of(2),
                );
                out.push(chat(&client, &url, &body, None).await);
            }
            out
        });
    }
    let results = join_all(tasks).await;
    assert_all_ok(
        &format!("{what} (a burst of {:?})", started.elapsed()),
        &results,
        topo,
    );
    results
}

/// Every worker's results, once they have all ended: how a burst or a background load is
/// collected.
async fn join_all(mut tasks: tokio::task::JoinSet<Vec<Done>>) -> Vec<Done> {
    let mut all = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        all.extend(joined.expect("load worker"));
    }
    all
}

/// Requests from `workers` clients, each in a loop until [`Load::stop`]: the steady load the
/// kill and chaos tests keep up while faults come and go. `body(worker, i)` is worker's `i`th
/// request.
struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Requests started so far.
    sent: Arc<AtomicU64>,
    tasks: tokio::task::JoinSet<Vec<Done>>,
}

impl Load {
    /// Starts the workers on `topo`'s Envoy.
    fn start(
        topo: &Topo,
        workers: u64,
        body: impl Fn(u64, u64) -> Value + Clone + Send + 'static,
    ) -> Load {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..workers {
            let (client, url, stop, sent, body) = (
                topo.client.clone(),
                topo.url(),
                stop.clone(),
                sent.clone(),
                body.clone(),
            );
            tasks.spawn(async move {
                let mut out = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let body = body(w, i);
                    sent.fetch_add(1, Ordering::Relaxed);
                    out.push(chat(&client, &url, &body, None).await);
                    i += 1;
                }
                out
            });
        }
        Load { stop, sent, tasks }
    }

    /// Requests started so far, by every worker.
    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Asks every worker to stop after its current request.
    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stops the load and returns every request's result.
    async fn results(self) -> Vec<Done> {
        self.stop();
        join_all(self.tasks).await
    }
}

/// How many of `results` `replica` answered: a sick replica must get none, a recovered or new
/// one some.
fn answered_by(results: &[Done], replica: &str) -> usize {
    results
        .iter()
        .filter(|d| d.replica.as_deref() == Some(replica))
        .count()
}

fn assert_all_ok(what: &str, results: &[Done], topo: &Topo) {
    let failed: Vec<&Done> = results.iter().filter(|d| !d.ok()).collect();
    assert!(
        failed.is_empty(),
        "{what}: {} of {} requests failed: {failed:?} ({})",
        failed.len(),
        results.len(),
        topo.describe()
    );
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// The frame of every fault test but the chaos run: a topology of `replicas` (the first
/// `running` started), `body` on it within [`TEST_TIMEOUT`], then the filter checked for
/// panics, traps and VM reloads.
async fn fault_test(
    name: &str,
    replicas: usize,
    running: usize,
    body: impl AsyncFnOnce(&mut Topo),
) {
    let tools = tools();
    bounded(TEST_TIMEOUT, async {
        let mut topo = Topo::start(&tools, name, replicas, running).await;
        body(&mut topo).await;
        topo.assert_filter_healthy().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// Control-plane faults

/// `((route calls, feedback calls), requests sent)` through the fault proxy at one moment.
type CallCount = ((u64, u64), u64);

/// No thundering herd over a window of `elapsed` from `start` to `end` (`when`, in failures):
/// at most one route call a request (the requests in flight at its start may call too, one per
/// each of the 3 load workers) and at most one feedback batch per 200 ms tick per VM (one
/// worker VM and the main-thread VM), so no retry loop either.
fn assert_no_herd(when: &str, start: CallCount, end: CallCount, elapsed: Duration) {
    let route_calls = end.0.0 - start.0.0;
    let feedback_calls = end.0.1 - start.0.1;
    let requests = end.1 - start.1 + 3;
    let ticks = elapsed.as_millis() as u64 / 200 + 1;
    eprintln!(
        "{when}, {elapsed:?}: {requests} requests, {route_calls} route calls, \
         {feedback_calls} feedback calls ({ticks} ticks)"
    );
    assert!(
        route_calls <= requests,
        "{route_calls} route calls for {requests} requests {when}"
    );
    assert!(
        feedback_calls <= 2 * ticks,
        "{feedback_calls} feedback calls in {elapsed:?} {when}: feedback retried in a loop"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_slow_or_hung_beyond_the_route_timeout() {
    fault_test("faults-cp-slow", 2, 2, async |topo| {
        let baseline = burst(topo, "baseline", 10, 12, 3).await;
        let base_median = median(baseline.iter().map(|d| d.elapsed).collect());

        for mode in [Mode::Delay(400), Mode::Hang] {
            let fail_open = topo.counter("fail_open").await;
            topo.proxy.set(mode.clone());
            let results = burst(topo, &format!("{mode:?}"), 20, 12, 3).await;
            // The filter waits for the route answer no longer than its timeout.
            let m = median(results.iter().map(|d| d.elapsed).collect());
            eprintln!("{mode:?}: median {m:?}, without the fault {base_median:?}");
            assert!(
                m < base_median + Duration::from_millis(ROUTE_TIMEOUT_MS + 250),
                "{mode:?}: median {m:?} vs {base_median:?} without the fault"
            );
            assert!(
                topo.counter("fail_open").await >= fail_open + 12.0,
                "{mode:?}: requests did not fail open"
            );
        }
        topo.proxy.set(Mode::Pass);
        let routed = topo.counter("requests_routed").await;
        burst(topo, "recovered", 30, 8, 2).await;
        assert!(
            topo.counter("requests_routed").await >= routed + 4.0,
            "routing did not resume after the control plane recovered"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_answering_garbage_errors_or_resets() {
    fault_test("faults-cp-garbage", 2, 2, async |topo| {
        let modes = [
            Mode::Garbage("this is not json".into()),
            Mode::Garbage(String::new()),
            Mode::Garbage(r#"{"decision_id": 1}"#.into()),
            Mode::Garbage(r#"{"decision_id": 1, "endpoints": []}"#.into()),
            Mode::Garbage(r#"{"decision_id": 1, "endpoints": ["not an endpoint"]}"#.into()),
            Mode::Garbage(r#"{"decision_id": 1, "endpoints": ["a:1,b:2"]}"#.into()),
            Mode::Garbage(format!(
                r#"{{"decision_id": 1, "endpoints": ["{}"]}}"#,
                "9".repeat(300)
            )),
            // Well-formed, but a host outside Envoy's cluster: override_host falls back.
            Mode::Garbage(
                r#"{"decision_id": 1, "endpoints": ["127.0.0.1:1", "10.255.255.1:9"]}"#.into(),
            ),
            Mode::Garbage(r#"[1, 2, 3]"#.into()),
            Mode::Garbage(
                "{\"decision_id\": 18446744073709551616, \"endpoints\": [\"\u{0}:1\"]}".into(),
            ),
            Mode::Status(500),
            Mode::Status(401),
            Mode::Status(404),
            Mode::Status(429),
            Mode::Close,
        ];
        for (i, mode) in modes.iter().enumerate() {
            topo.proxy.set(mode.clone());
            let started = Instant::now();
            burst(topo, &format!("{mode:?}"), 100 + i as u64, 6, 2).await;
            eprintln!("{mode:?}: {:?}", started.elapsed());
        }
        topo.proxy.set(Mode::Pass);
        let routed = topo.counter("requests_routed").await;
        burst(topo, "recovered", 200, 6, 2).await;
        // Most of them routed again (one may still fail open on a loaded machine).
        assert!(topo.counter("requests_routed").await >= routed + 3.0);
        assert!(topo.proxy.calls.load(Ordering::Relaxed) > 90);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_killed_under_load_then_restarted() {
    fault_test("faults-cp-restart", 3, 3, async |topo| {
        // Load from 3 workers for the whole test; `load.sent()` counts requests as they start.
        let load = Load::start(topo, 3, |w, i| {
            chat_body(300 + w, 3_000 + w * 1_000 + i, 4, i.is_multiple_of(2))
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        topo.kill_control_plane();
        let down_calls = topo.proxy.route_and_feedback_calls();
        let down_sent = load.sent();
        let down_at = Instant::now();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let routed_before_restart = topo.counter("requests_routed").await;
        topo.start_control_plane().await;
        let up_calls = topo.proxy.route_and_feedback_calls();
        let up_sent = load.sent();
        let down_for = down_at.elapsed();
        topo.wait_for(
            Duration::from_secs(10),
            "endpoints ready after restart",
            async |t| {
                t.endpoint_health()
                    .await
                    .iter()
                    .filter(|(_, h)| h == "ready")
                    .count()
                    == 3
            },
        )
        .await;
        // Routing resumes against the new, empty state, and the index refills from the
        // outcomes of routed requests.
        topo.wait_for(
            Duration::from_secs(10),
            "routing after restart",
            async |t| t.counter("requests_routed").await > routed_before_restart + 3.0,
        )
        .await;
        topo.wait_for(
            Duration::from_secs(10),
            "the prefix index refilled after restart",
            async |t| t.index_blocks().await > 0.0,
        )
        .await;
        // No thundering herd: after the restart every request makes at most one route call
        // (no retries, no backlog replayed), and feedback stays one batch per tick per VM
        // (200 ms; `--concurrency 1` runs one worker VM, plus the main-thread VM).
        let window_start = (topo.proxy.route_and_feedback_calls(), load.sent());
        let window_at = Instant::now();
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        let window_end = (topo.proxy.route_and_feedback_calls(), load.sent());
        let window = window_at.elapsed();
        load.stop();
        assert_no_herd("after restart", window_start, window_end, window);
        // While it was down, requests failed open without retrying the route call either.
        assert_no_herd(
            "while down",
            (down_calls, down_sent),
            (up_calls, up_sent),
            down_for,
        );
        let results = load.results().await;
        assert!(results.len() >= 20, "only {} requests ran", results.len());
        assert_all_ok("through the kill and restart", &results, topo);

        // The rebuilt state learns again: a new conversation's second turn stays put, and
        // new conversations spread instead of herding onto one replica.
        let mut firsts = std::collections::BTreeSet::new();
        let mut moved = Vec::new();
        for c in 0..6u64 {
            let first = topo.chat_ok(&chat_body(500 + c, 1, 4, false)).await;
            let second = topo.chat_ok(&chat_body(500 + c, 2, 4, false)).await;
            if first.replica != second.replica {
                moved.push(c);
            }
            firsts.extend(first.replica);
        }
        // A route call that misses its 50 ms deadline fails open, so allow one move.
        assert!(
            moved.len() <= 1,
            "conversations {moved:?} moved after the restart ({})",
            topo.describe()
        );
        assert!(
            firsts.len() >= 2,
            "after the restart everything went to {firsts:?}"
        );
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// Replica faults

/// Makes replica 0 sick with `fault` (`what`, in failures), waits until the control plane
/// names it unreachable, then checks that a burst (seeded by `seed`) is served entirely by the
/// others: what every sickness of a replica must come to.
async fn assert_sick_replica_avoided(topo: &Topo, fault: Value, what: &str, seed: u64) {
    let sick = topo.sims[0].address();
    topo.set_sim_fault(0, fault).await;
    topo.wait_health(0, "unreachable", &format!("{what} noticed"))
        .await;
    let results = burst(topo, &format!("with {what}"), seed, 12, 3).await;
    assert_eq!(
        answered_by(&results, &sick),
        0,
        "kvroute routed to a replica with {what}: {results:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_mid_stream() {
    fault_test("faults-replica-kill", 3, 3, async |topo| {
        // Long streams (about 2 s each at --speed 2) on every replica.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let mut streams = tokio::task::JoinSet::new();
        for s in 0..9u64 {
            let (client, url, tx) = (topo.client.clone(), topo.url(), tx.clone());
            streams.spawn(async move {
                let body = chat_body(700 + s, 7_000 + s, 300, true);
                chat(&client, &url, &body, Some(tx)).await
            });
        }
        drop(tx);
        // Kill replica 0 once it is streaming and every stream has its headers.
        let mut seen = Vec::new();
        while seen.len() < 9 {
            match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
                Ok(Some(r)) => seen.push(r),
                _ => break,
            }
        }
        // The victim is the replica serving the most streams (the router decides where).
        let index = (0..topo.sims.len())
            .max_by_key(|i| {
                let a = topo.sims[*i].address();
                seen.iter().filter(|r| **r == a).count()
            })
            .unwrap_or(0);
        let victim = topo.sims[index].address();
        assert!(seen.contains(&victim), "no stream started: {seen:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        topo.kill_replica(index);

        let mut on_victim = 0;
        while let Some(joined) = streams.join_next().await {
            let done = joined.expect("stream task");
            assert!(
                done.error.as_deref().is_none_or(|e| !e.starts_with("hung")),
                "a stream hung: {done:?}"
            );
            if done.replica.as_deref() == Some(victim.as_str()) {
                on_victim += 1;
                // A clean client error: the stream ends early, without [DONE].
                assert!(
                    !done.complete,
                    "a stream on the killed replica completed: {done:?}"
                );
                assert!(done.error.is_some(), "{done:?}");
            } else {
                assert!(done.ok(), "a stream on a live replica failed: {done:?}");
            }
        }
        assert!(on_victim >= 1);

        // New requests: none is lost (Envoy retries connect failures on another host; the
        // control plane stops choosing the dead replica after its scrapes fail).
        burst(topo, "after the kill", 800, 18, 3).await;
        topo.wait_health(index, "unreachable", "the dead replica marked unreachable")
            .await;
        let results = burst(topo, "after it was marked", 900, 12, 3).await;
        assert_eq!(
            answered_by(&results, &victim),
            0,
            "a request was answered by a dead replica?"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_metrics_garbage_makes_it_unusable_until_fixed() {
    fault_test("faults-metrics-garbage", 2, 2, async |topo| {
        assert_sick_replica_avoided(
            topo,
            json!({"garbage_metrics": true}),
            "garbage metrics",
            1_000,
        )
        .await;
        topo.set_sim_fault(0, json!({"garbage_metrics": false}))
            .await;
        assert_replica_gets_traffic(topo, 0, "the recovered replica", 1_100, 16).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_hanging_is_avoided() {
    fault_test("faults-replica-hang", 2, 2, async |topo| {
        assert_sick_replica_avoided(topo, json!({"hang": true}), "a hang", 1_200).await;
        topo.set_sim_fault(0, json!({"hang": false})).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_starting_late_joins_under_load() {
    fault_test("faults-late-replica", 3, 2, async |topo| {
        // Three endpoints configured, two running: the third is "added" under load.
        burst(topo, "with one replica down", 1_300, 12, 3).await;
        topo.start_replica(2).await;
        assert_replica_gets_traffic(topo, 2, "the new replica", 1_400, 24).await;
    })
    .await;
}

/// Waits until the control plane names replica `i` (`what`, in failures) ready, then checks
/// that a burst of `n` requests (seeded by `seed`) is all served and reaches it: what a replica
/// that recovers or joins must get.
async fn assert_replica_gets_traffic(topo: &Topo, i: usize, what: &str, seed: u64, n: usize) {
    let replica = topo.sims[i].address();
    topo.wait_health(i, "ready", &format!("{what} ready")).await;
    let results = burst(topo, &format!("once {what} was ready"), seed, n, 4).await;
    assert!(
        answered_by(&results, &replica) > 0,
        "{what} got no traffic: {results:?}"
    );
}

// ------------------------------------------------------------------------------------------
// Chaos: random faults for a while (scripts/chaos.sh runs this for minutes)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mixed_faults() {
    let secs: u64 = std::env::var("KVROUTE_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let seed: u64 = std::env::var("KVROUTE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(42);
    let limit = Duration::from_secs(secs + 90);
    let tools = tools();
    bounded(limit, async {
        let mut topo = Topo::start(&tools, "faults-chaos", 3, 3).await;
        let load = Load::start(&topo, 4, |w, i| {
            chat_body(
                2_000 + (w * 7 + i) % 12,
                20_000 + w * 100_000 + i,
                4,
                i.is_multiple_of(2),
            )
        });
        let mut rng = SmallRng::seed_from_u64(seed);
        let started = Instant::now();
        let mut log = Vec::new();
        while started.elapsed() < Duration::from_secs(secs) {
            let action = rng.random_range(0..9u32);
            let what = match action {
                0 => {
                    topo.proxy.set(Mode::Pass);
                    "cp: pass".to_string()
                }
                1 => {
                    let ms = rng.random_range(20..600);
                    topo.proxy.set(Mode::Delay(ms));
                    format!("cp: delay {ms} ms")
                }
                2 => {
                    topo.proxy.set(Mode::Hang);
                    "cp: hang".into()
                }
                3 => {
                    topo.proxy.set(Mode::Garbage("{\"endpoints\": 7".into()));
                    "cp: garbage".into()
                }
                4 => {
                    topo.proxy.set(Mode::Close);
                    "cp: close".into()
                }
                5 => {
                    if topo.cp.is_some() {
                        topo.kill_control_plane();
                        "cp: killed".into()
                    } else {
                        topo.start_control_plane().await;
                        "cp: restarted".into()
                    }
                }
                6 => {
                    let i = rng.random_range(0..3);
                    let on = rng.random_bool(0.5);
                    topo.set_sim_fault(i, json!({"garbage_metrics": on})).await;
                    format!("replica {i}: garbage metrics {on}")
                }
                7 => {
                    let i = rng.random_range(0..3);
                    let ms = if rng.random_bool(0.5) {
                        rng.random_range(0..300)
                    } else {
                        0
                    };
                    topo.set_sim_fault(i, json!({"delay_ms": ms})).await;
                    format!("replica {i}: delay {ms} ms")
                }
                _ => {
                    topo.proxy.set(Mode::Status(503));
                    "cp: 503".into()
                }
            };
            log.push(format!("{:>6} ms {what}", started.elapsed().as_millis()));
            tokio::time::sleep(Duration::from_millis(rng.random_range(200..1_200))).await;
        }
        let results = load.results().await;
        let routed = topo.counter("requests_routed").await;
        let fail_open = topo.counter("fail_open").await;
        let slowest = results.iter().map(|d| d.elapsed).max().unwrap_or_default();
        eprintln!(
            "chaos: {secs} s, seed {seed}, {} faults, {} requests, {} failed, routed {routed}, \
             failed open {fail_open}, slowest {slowest:?}\n{}",
            log.len(),
            results.len(),
            results.iter().filter(|d| !d.ok()).count(),
            log.join("\n")
        );
        assert!(!results.is_empty());
        assert_all_ok("chaos", &results, &topo);
        topo.assert_filter_healthy().await;
    })
    .await;
}
