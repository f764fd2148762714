//! Bad input through a REAL Envoy 1.40 running the kvroute wasm filter (issue 8, part 1).
//!
//! One topology (2 `vllm-sim` replicas, the control plane, Envoy) is started lazily and shared by
//! every test of this binary; each test is one case, named after what it sends. Every case must
//! end, within a client timeout, in one of:
//! - a normal answer from a replica (the request was routed, or failed open to round robin);
//! - a clear OpenAI-style error (`{"error": {"message": ...}}`) from the replica; or
//! - a documented status from Envoy itself (413 for a body over Envoy's buffer limit).
//!
//! and never in a 5xx that the filter caused, a hang, or a failed wasm VM: after each case the
//! Envoy log is checked for wasm panics/traps and `/stats` for VM reloads.
//!
//! Requests are written byte by byte over raw TCP (HTTP/1.1) or with hyper's HTTP/2 client
//! (h2c prior knowledge), so malformed framing, odd headers and trailers can be sent.

use std::convert::Infallible;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_harness::{
    DESTINATION_HEADER, Fleet, HttpClient, ManagedProcess, REPLICA_HEADER, Tools, envoy_base_id,
    free_port, log_tail, plugin_config_json, render_envoy_config, workspace_root,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;

use crate::common;

const MODEL: &str = "kvroute-bad-input-model";
/// One case, request and checks included.
const CASE_TIMEOUT: Duration = Duration::from_secs(40);
/// One request: a hang shows up as a failed case, never as a stuck test binary.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Ten megabytes: above Envoy's 8 MiB buffer limit and the filter's 4 MiB `max_body_bytes`.
const TEN_MB: usize = 10 * 1024 * 1024;

// ------------------------------------------------------------------------------------------
// The shared topology

struct Topology {
    rt: Runtime,
    fleet: Fleet,
    client: HttpClient,
    /// A second Envoy (same replicas and control plane) whose filter buffers up to 16 MiB,
    /// i.e. more than Envoy's 8 MiB limit, so Envoy itself refuses big bodies with 413.
    big_buffer_envoy: OnceLock<Result<ExtraEnvoy, String>>,
    /// A third Envoy whose filter explains its decisions (`allow_explain`), for the cases that
    /// check how a body was routed, not only that it was served.
    explain_envoy: OnceLock<Result<ExtraEnvoy, String>>,
}

struct ExtraEnvoy {
    listen: String,
    _process: ManagedProcess,
}

/// Runs `f` on a thread that then stays alive for the rest of the test process. Envoy is
/// started with a parent-death signal: it gets SIGTERM when the *thread* that spawned it exits,
/// so a shared topology must not be spawned from a test's thread (which ends with its test).
fn on_keeper_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("topology-keeper".into())
        .spawn(move || {
            let _ = tx.send(f());
            loop {
                std::thread::park();
            }
        })
        .unwrap_or_else(|e| panic!("spawning the keeper thread: {e}"));
    rx.recv()
        .unwrap_or_else(|e| panic!("the keeper thread died: {e}"))
}

fn topology() -> &'static Topology {
    static TOPOLOGY: OnceLock<Result<Topology, String>> = OnceLock::new();
    TOPOLOGY
        .get_or_init(|| on_keeper_thread(start_topology))
        .as_ref()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn start_topology() -> Result<Topology, String> {
    let tools = Tools::locate().map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let mut cfg = common::fleet_config("e2e-bad-input", 2, MODEL);
    cfg.sim_args = vec!["--speed".into(), "5".into()];
    // The affinity cases check that an odd body is routed like its well-formed twin. The router
    // prices a request's decode by its `max_tokens` capped at `default_output_tokens`, so the
    // twin of a body asking for 2^40 tokens, asking for 2, would be priced 150 times lighter
    // and stay where the cases running beside it move the odd one by load. Capped at the
    // twins' 2, every body here is priced alike.
    cfg.control_plane_router = json!({"scoring": {"default_output_tokens": 2}});
    let fleet = rt
        .block_on(Fleet::start(cfg, &tools))
        .map_err(|e| format!("starting the bad-input fleet: {e}"))?;
    Ok(Topology {
        rt,
        fleet,
        client: HttpClient::new(),
        big_buffer_envoy: OnceLock::new(),
        explain_envoy: OnceLock::new(),
    })
}

impl Topology {
    fn envoy_addr(&self) -> &str {
        &self.fleet.envoy.listen_address
    }

    fn big_buffer_envoy(&'static self) -> &'static str {
        self.extra_envoy(&self.big_buffer_envoy, json!({"max_body_bytes": 16 << 20}))
    }

    fn explain_envoy(&'static self) -> &'static str {
        self.extra_envoy(&self.explain_envoy, json!({"allow_explain": true}))
    }

    fn extra_envoy(
        &'static self,
        cell: &'static OnceLock<Result<ExtraEnvoy, String>>,
        plugin_overrides: Value,
    ) -> &'static str {
        let started = cell.get_or_init(|| {
            on_keeper_thread(move || {
                self.rt
                    .block_on(start_extra_envoy(&self.fleet, &plugin_overrides))
            })
        });
        match started {
            Ok(e) => &e.listen,
            Err(e) => panic!("{e}"),
        }
    }

    /// Envoy's wasm stats as `name -> value` (histograms skipped).
    async fn wasm_stats(&self) -> Vec<(String, f64)> {
        let text = self
            .fleet
            .envoy_stats("wasm")
            .await
            .unwrap_or_else(|e| panic!("reading Envoy stats: {e}"));
        text.lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(": ")?;
                Some((k.to_string(), v.trim().parse::<f64>().ok()?))
            })
            .collect()
    }

    /// One of the filter's counters (`wasmcustom.kvroute_*`), 0 when absent.
    async fn stat(&self, name: &str) -> f64 {
        self.wasm_stats()
            .await
            .into_iter()
            .find(|(k, _)| k == name)
            .map_or(0.0, |(_, v)| v)
    }

    /// The filter is alive and never trapped: no panic or uncaught runtime error in Envoy's
    /// log, no VM reload, the VMs still exist and Envoy is ready.
    fn assert_filter_healthy(&self, case: &str) {
        let log = std::fs::read_to_string(self.fleet.envoy.process().log()).unwrap_or_default();
        for needle in [
            "panicked",
            "Uncaught",
            "RuntimeError",
            "Failed to load Wasm",
        ] {
            assert!(
                !log.contains(needle),
                "after case {case}: Envoy log mentions {needle:?} (a wasm panic or trap):\n{}",
                log_tail(self.fleet.envoy.process().log(), 40)
            );
        }
        let stats = self.rt.block_on(self.wasm_stats());
        let get = |n: &str| stats.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        assert!(
            get("wasm.envoy.wasm.runtime.v8.active").unwrap_or(0.0) >= 1.0,
            "after case {case}: no active wasm VM: {stats:?}"
        );
        for reload in ["wasm.kvroute.vm_reload", "wasm.kvroute.vm_reload_failure"] {
            assert_eq!(
                get(reload).unwrap_or(0.0),
                0.0,
                "after case {case}: {reload} moved: {stats:?}"
            );
        }
        assert!(
            get("wasmcustom.kvroute_requests_skipped").is_some(),
            "after case {case}: the filter's counters are gone: {stats:?}"
        );
        let ready = self.rt.block_on(async {
            let url = format!("http://{}/ready", self.fleet.envoy.admin_address);
            self.client.get(&url, Duration::from_secs(5)).await
        });
        assert!(
            ready.as_ref().is_ok_and(|r| r.status == 200),
            "after case {case}: Envoy is not ready: {ready:?}"
        );
    }
}

/// Starts one more Envoy in front of the fleet's replicas and control plane, with the filter
/// configuration overridden by `plugin_overrides`.
async fn start_extra_envoy(fleet: &Fleet, plugin_overrides: &Value) -> Result<ExtraEnvoy, String> {
    let tools = Tools::locate().map_err(|e| e.to_string())?;
    let cp_port: u16 = fleet
        .control_plane
        .as_ref()
        .and_then(|cp| cp.api_address.rsplit_once(':'))
        .and_then(|(_, p)| p.parse().ok())
        .ok_or("the fleet has no control plane")?;
    let client = HttpClient::new();
    let mut last = String::new();
    for attempt in 0..3 {
        let listen = free_port().map_err(|e| e.to_string())?;
        let admin = free_port().map_err(|e| e.to_string())?;
        let rendered = render_envoy_config(
            &workspace_root().join(kvroute_harness::ENVOY_KVROUTE_TEMPLATE),
            listen,
            admin,
            cp_port,
            &tools.wasm,
            &plugin_config_json(plugin_overrides),
            &fleet.replica_addresses(),
            &[],
        )
        .map_err(|e| e.to_string())?;
        let cfg = fleet.log_dir.join(format!("envoy-extra-{attempt}.yaml"));
        std::fs::write(&cfg, rendered).map_err(|e| format!("writing {}: {e}", cfg.display()))?;
        let mut cmd = std::process::Command::new(&tools.envoy);
        cmd.arg("-c")
            .arg(&cfg)
            .args(["--concurrency", "1", "-l", "warning"])
            .args([
                "--base-id",
                &envoy_base_id().to_string(),
                "--use-dynamic-base-id",
            ]);
        let log = fleet.log_dir.join(format!("envoy-extra-{attempt}.log"));
        let mut process =
            ManagedProcess::spawn("envoy-extra", cmd, &log).map_err(|e| e.to_string())?;
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Some(status) = process.exited() {
                last = format!("extra Envoy exited ({status}): {}", log_tail(&log, 20));
                break;
            }
            let url = format!("http://127.0.0.1:{admin}/ready");
            if client
                .get(&url, Duration::from_secs(2))
                .await
                .is_ok_and(|r| r.status == 200)
            {
                return Ok(ExtraEnvoy {
                    listen: format!("127.0.0.1:{listen}"),
                    _process: process,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if last.is_empty() {
            last = format!("extra Envoy not ready in 30 s: {}", log_tail(&log, 20));
        }
    }
    Err(last)
}

/// Runs one case under [`CASE_TIMEOUT`], then checks the filter survived it.
fn case<F>(name: &str, body: impl FnOnce(&'static Topology) -> F)
where
    F: Future<Output = ()>,
{
    let topo = topology();
    let fut = body(topo);
    topo.rt.block_on(async {
        if tokio::time::timeout(CASE_TIMEOUT, fut).await.is_err() {
            panic!("case {name} did not finish within {CASE_TIMEOUT:?}");
        }
    });
    topo.assert_filter_healthy(name);
}

// ------------------------------------------------------------------------------------------
// A raw HTTP/1.1 client: exact bytes out, a parsed response back.

/// A complete response.
#[derive(Debug, Clone)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A replica answered (the simulator stamps every response).
    fn answered_by_replica(&self) -> bool {
        self.header(REPLICA_HEADER).is_some()
    }

    fn describe(&self) -> String {
        let mut text = self.text();
        if text.len() > 400 {
            let mut end = 400;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        format!(
            "status {} from {} body {text:?}",
            self.status,
            self.header(REPLICA_HEADER).unwrap_or("envoy")
        )
    }
}

/// Builds an HTTP/1.1 request. `content-length` is added unless `headers` already frame the
/// body (`content-length` or `transfer-encoding`); `connection: close` ends every exchange.
fn http1(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out =
        format!("{method} {path} HTTP/1.1\r\nhost: kvroute.test\r\nconnection: close\r\n");
    let framed = headers.iter().any(|(k, _)| {
        k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("transfer-encoding")
    });
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if !framed && (!body.is_empty() || method == "POST" || method == "PUT") {
        out.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// `body` in chunked transfer encoding, `chunk` bytes per chunk.
fn chunked(body: &[u8], chunk: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + body.len() / chunk.max(1) * 8 + 8);
    for piece in body.chunks(chunk.max(1)) {
        out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        out.extend_from_slice(piece);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// Sends `parts` (with `gap` between them) and reads the response until Envoy closes. Writing
/// runs beside reading, so an early answer (413) is read even while the body is still going.
async fn exchange(addr: &str, parts: Vec<Vec<u8>>, gap: Duration) -> Result<Reply, String> {
    let fut = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream.set_nodelay(true).ok();
        let (mut rd, mut wr) = stream.into_split();
        let writer = tokio::spawn(async move {
            for (i, part) in parts.iter().enumerate() {
                if i > 0 && !gap.is_zero() {
                    tokio::time::sleep(gap).await;
                }
                if wr.write_all(part).await.is_err() {
                    return;
                }
            }
            let _ = wr.flush().await;
            // Keep the write half open: closing it would look like an aborted request.
            tokio::time::sleep(REQUEST_TIMEOUT).await;
        });
        let mut raw = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        let read_result = loop {
            match rd.read(&mut buf).await {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    raw.extend_from_slice(&buf[..n]);
                    if response_complete(&raw) {
                        break Ok(());
                    }
                }
                Err(e) => break Err(e),
            }
        };
        writer.abort();
        match (parse_response(&raw), read_result) {
            (Some(reply), _) => Ok(reply),
            (None, Err(e)) => Err(format!(
                "connection error before a full response: {e}; got {:?}",
                String::from_utf8_lossy(&raw)
            )),
            (None, Ok(())) => Err(format!(
                "connection closed without a full response; got {:?}",
                String::from_utf8_lossy(&raw)
            )),
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .map_err(|_| format!("no complete answer within {REQUEST_TIMEOUT:?} (a hang)"))?
}

async fn send(addr: &str, request: Vec<u8>) -> Reply {
    exchange(addr, vec![request], Duration::ZERO)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Splits off the head of the first final (non-1xx) response: (status, headers, body bytes).
/// A response head: status, lower-case headers, and the bytes after the head.
type Head<'a> = (u16, Vec<(String, String)>, &'a [u8]);

fn split_head(raw: &[u8]) -> Option<Head<'_>> {
    let mut rest = raw;
    loop {
        let end = rest.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&rest[..end]).ok()?;
        let mut lines = head.split("\r\n");
        let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        rest = &rest[end + 4..];
        if !(100..200).contains(&status) {
            return Some((status, headers, rest));
        }
    }
}

/// Decodes a chunked body; `None` until the last chunk has arrived.
fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&raw[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        if raw.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

fn response_complete(raw: &[u8]) -> bool {
    let Some((_, headers, body)) = split_head(raw) else {
        return false;
    };
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(body).is_some()
    } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.len() >= len
    } else {
        false
    }
}

fn parse_response(raw: &[u8]) -> Option<Reply> {
    let (status, headers, body) = split_head(raw)?;
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k == n)
            .map(|(_, v)| v.as_str())
    };
    let body = if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(body)?
    } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.get(..len)?.to_vec()
    } else {
        body.to_vec()
    };
    Some(Reply {
        status,
        headers,
        body,
    })
}

// ------------------------------------------------------------------------------------------
// HTTP/2 (h2c with prior knowledge, what `curl --http2-prior-knowledge` does)

type H2Body =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// One HTTP/2 request whose body is sent as the given frames (data and/or trailers).
async fn h2(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    frames: Vec<Frame<Bytes>>,
) -> Result<Reply, String> {
    let fut = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http2::handshake::<_, _, H2Body>(
            TokioExecutor::new(),
            TokioIo::new(tcp),
        )
        .await
        .map_err(|e| format!("h2 handshake: {e}"))?;
        let driver = tokio::spawn(conn);
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"));
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let body = StreamBody::new(futures_util::stream::iter(
            frames.into_iter().map(Ok).collect::<Vec<_>>(),
        ));
        let req = builder.body(body).map_err(|e| e.to_string())?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("h2 request: {e}"))?;
        let status = resp.status().as_u16();
        let headers = kvroute_harness::header_pairs(resp.headers());
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("h2 body: {e}"))?
            .to_bytes()
            .to_vec();
        driver.abort();
        Ok(Reply {
            status,
            headers,
            body,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .map_err(|_| format!("no complete HTTP/2 answer within {REQUEST_TIMEOUT:?} (a hang)"))?
}

fn data(bytes: impl Into<Bytes>) -> Frame<Bytes> {
    Frame::data(bytes.into())
}

// ------------------------------------------------------------------------------------------
// Bodies and expectations

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const JSON_CT: (&str, &str) = ("content-type", "application/json");

fn chat(content: &str) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
    })
}

fn bytes_of(v: &Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

/// A POST of `body` to `path` with exactly `headers` (no content type added): for the cases
/// whose headers are the point.
async fn post(addr: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    send(addr, http1("POST", path, headers, body)).await
}

async fn post_json(addr: &str, path: &str, body: &[u8]) -> Reply {
    post(addr, path, &[JSON_CT], body).await
}

/// Not a server error: the filter never turns a request into a 5xx.
fn assert_no_5xx(case: &str, r: &Reply) {
    assert!(r.status < 500, "{case}: {}", r.describe());
}

/// 200 from a replica with a chat/completion JSON object.
fn expect_completion(case: &str, r: &Reply) {
    assert_eq!(r.status, 200, "{case}: {}", r.describe());
    assert!(r.answered_by_replica(), "{case}: {}", r.describe());
    let v: Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{case}: answer is not JSON ({e}): {}", r.describe()));
    assert!(
        v["choices"].as_array().is_some_and(|c| !c.is_empty()),
        "{case}: no choices: {}",
        r.describe()
    );
}

/// 200 from a replica with an SSE stream that ends in `data: [DONE]`.
fn expect_stream(case: &str, r: &Reply) {
    assert_eq!(r.status, 200, "{case}: {}", r.describe());
    assert!(r.answered_by_replica(), "{case}: {}", r.describe());
    let text = r.text();
    assert!(
        text.contains("data: {") && text.trim_end().ends_with("data: [DONE]"),
        "{case}: not a complete SSE stream: {}",
        r.describe()
    );
}

/// A 4xx from a replica with an OpenAI-style error body, status among `statuses`.
fn expect_openai_error(case: &str, r: &Reply, statuses: &[u16]) {
    expect_replica_status(case, r, statuses);
    expect_error_body(case, r);
}

/// A JSON body with a non-empty `error.message`: OpenAI's error shape (and Anthropic's,
/// `{"type":"error","error":{...}}`).
fn expect_error_body(case: &str, r: &Reply) {
    let v: Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{case}: error is not JSON ({e}): {}", r.describe()));
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{case}: not an OpenAI-style error: {}",
        r.describe()
    );
}

/// Either a completion or a clean OpenAI-style 4xx: the filter let it through either way.
fn expect_served_or_rejected(case: &str, r: &Reply) {
    assert_no_5xx(case, r);
    if r.status == 200 {
        expect_completion(case, r);
    } else {
        expect_openai_error(case, r, &[400, 404, 413, 415, 422]);
    }
}

/// A plain status from a replica (the simulator's 404/405 carry no body).
fn expect_replica_status(case: &str, r: &Reply, statuses: &[u16]) {
    assert!(
        statuses.contains(&r.status),
        "{case}: expected one of {statuses:?}: {}",
        r.describe()
    );
    assert!(r.answered_by_replica(), "{case}: {}", r.describe());
}

/// A 10 MB body the filter does not buffer (the shipped configuration). Envoy streams it to a
/// replica, which reads it all (vllm-sim, like vLLM, has no small body limit) and serves it
/// (the simulator counts one 10 MB word as one token) or refuses the prompt as too long with
/// an OpenAI-style 400. When Envoy's own buffer limit is hit first, Envoy answers 413 in the
/// OpenAI error shape (`local_reply_config`). Should a replica close before reading the whole
/// upload, Envoy reports the reset (503) or that it could not keep the body for a retry (507),
/// also as JSON. None of them is the filter's answer.
fn expect_big_body_handled(case: &str, r: &Reply) {
    let clean = match r.status {
        200 => {
            expect_completion(case, r);
            true
        }
        400 | 413 if r.answered_by_replica() => {
            expect_openai_error(case, r, &[400, 413]);
            true
        }
        413 | 503 | 507 => {
            expect_envoy_json_error(case, r, r.status);
            true
        }
        _ => false,
    };
    assert!(clean, "{case}: {}", r.describe());
    eprintln!("{case}: {}", r.describe());
}

/// A reply Envoy generated itself, in the OpenAI error shape of the shipped
/// `local_reply_config`: `{"error": {"message", "type", "code"}}` as `application/json`.
fn expect_envoy_json_error(case: &str, r: &Reply, status: u16) {
    assert_eq!(r.status, status, "{case}: {}", r.describe());
    assert!(!r.answered_by_replica(), "{case}: {}", r.describe());
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{case}: Envoy's reply is not JSON: {}",
        r.describe()
    );
    let v: Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{case}: Envoy's reply is not JSON ({e}): {}", r.describe()));
    let error = &v["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty())
            && error["type"].as_str().is_some_and(|t| !t.is_empty())
            && error["code"].as_u64() == Some(u64::from(status)),
        "{case}: not an OpenAI-style error with code {status}: {}",
        r.describe()
    );
}

/// [`chat`] with `fields` set on top: the one field (or few) a case is about.
fn chat_with(content: &str, fields: Value) -> Value {
    let mut body = chat(content);
    for (k, v) in fields.as_object().expect("fields is a JSON object") {
        body[k] = v.clone();
    }
    body
}

/// A case's body as the bytes sent: a JSON value serialised, bytes as they are. Lets a
/// [`post_cases!`] row write its body in whichever form the case is about.
trait IntoBody {
    /// The bytes sent.
    fn into_body(self) -> Vec<u8>;
}

impl IntoBody for Value {
    fn into_body(self) -> Vec<u8> {
        bytes_of(&self)
    }
}

impl IntoBody for Vec<u8> {
    fn into_body(self) -> Vec<u8> {
        self
    }
}

impl IntoBody for &[u8] {
    fn into_body(self) -> Vec<u8> {
        self.to_vec()
    }
}

impl<const N: usize> IntoBody for &[u8; N] {
    fn into_body(self) -> Vec<u8> {
        self.to_vec()
    }
}

impl IntoBody for &str {
    fn into_body(self) -> Vec<u8> {
        self.as_bytes().to_vec()
    }
}

impl IntoBody for String {
    fn into_body(self) -> Vec<u8> {
        self.into_bytes()
    }
}

/// What a [`post_cases!`] row's reply must be: which of the `expect_*` checks it meets.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// [`expect_completion`].
    Completion,
    /// [`expect_served_or_rejected`].
    ServedOrRejected,
    /// [`expect_openai_error`] with one of these statuses.
    Error(&'static [u16]),
}

impl Expect {
    /// Runs this expectation's check on `r`; failures name `case`.
    fn check(self, case: &str, r: &Reply) {
        match self {
            Expect::Completion => expect_completion(case, r),
            Expect::ServedOrRejected => expect_served_or_rejected(case, r),
            Expect::Error(statuses) => expect_openai_error(case, r, statuses),
        }
    }
}

/// The whole of most cases: one POST of `body` to `path` with `headers` through the shared
/// Envoy, its reply checked by `expect` (failures name the case). One copy of those steps for
/// every row of [`post_cases!`].
fn post_case(name: &str, path: &str, headers: &[(&str, &str)], body: Vec<u8>, expect: Expect) {
    case(name, async move |t| {
        let r = post(t.envoy_addr(), path, headers, &body).await;
        expect.check(name, &r);
    });
}

/// One `#[test]` a row, for the cases that are one request and one check:
/// `test_name: path, headers, body => expect;`, the body anything [`IntoBody`]. The test's
/// name is the case's name in its failures.
macro_rules! post_cases {
    ($($name:ident: $path:expr, $headers:expr, $body:expr => $expect:expr;)+) => {$(
        #[test]
        fn $name() {
            post_case(
                stringify!($name),
                $path,
                $headers,
                IntoBody::into_body($body),
                $expect,
            );
        }
    )+};
}

/// A plain chat through `addr` still gets a completion: what the cases that abuse a connection
/// or an Envoy check afterwards. `label` names the check in a failure.
async fn expect_still_serving(addr: &str, label: &str) {
    let r = post_json(addr, CHAT, &bytes_of(&chat(label))).await;
    expect_completion(label, &r);
}

// ------------------------------------------------------------------------------------------
// Well-formed requests: routed and served

#[test]
fn chat_json_is_routed_and_served() {
    case("chat_json_is_routed_and_served", async |t| {
        // A route call slower than the 50 ms timeout (a loaded CI machine) fails open, which is
        // correct too: allow a few attempts to see one routed.
        let mut routed = false;
        for attempt in 0..5 {
            let before = t.stat("wasmcustom.kvroute_requests_routed").await;
            let body = chat(&format!("hello routing {attempt}"));
            let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
            expect_completion("chat json", &r);
            if t.stat("wasmcustom.kvroute_requests_routed").await > before {
                routed = true;
                break;
            }
        }
        assert!(
            routed,
            "the filter did not route a valid chat request in 5 attempts"
        );
    });
}

#[test]
fn chat_stream_true_is_served_as_sse() {
    case("chat_stream_true", async |t| {
        let body = chat_with(
            "stream me",
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        );
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_stream("stream true", &r);
        assert!(r.text().contains("\"usage\""), "{}", r.describe());
    });
}

post_cases! {
    chat_stream_false_is_served_as_json: CHAT, &[JSON_CT],
        chat_with("no stream", json!({"stream": false})) => Expect::Completion;
    completion_with_string_prompt: COMPLETIONS, &[JSON_CT],
        json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 3})
        => Expect::Completion;
    completion_with_token_id_prompt: COMPLETIONS, &[JSON_CT],
        json!({"model": MODEL, "prompt": [101, 2023, 2003, 1037], "max_tokens": 3})
        => Expect::ServedOrRejected;
    completion_with_batched_prompts: COMPLETIONS, &[JSON_CT],
        json!({"model": MODEL, "prompt": ["first", "second"], "max_tokens": 3})
        => Expect::ServedOrRejected;
    missing_model_is_served_by_the_default_model: CHAT, &[JSON_CT],
        json!({"messages": [{"role": "user", "content": "who am I"}], "max_tokens": 3})
        => Expect::Completion;
    unknown_model_gets_a_404_error: CHAT, &[JSON_CT],
        chat_with("x", json!({"model": "no-such-model"})) => Expect::Error(&[404]);
    // 100 kB model name: the control plane refuses the route call (400), the filter fails open
    // and the replica answers that the model does not exist.
    very_long_model_name_fails_open: CHAT, &[JSON_CT],
        chat_with("x", json!({"model": "m".repeat(100_000)})) => Expect::Error(&[404]);
    query_string_on_the_inference_path:
        "/v1/chat/completions?api-version=2024-01-01&x=%00", &[JSON_CT],
        chat("query") => Expect::Completion;
    unknown_fields_are_passed_through: CHAT, &[JSON_CT],
        chat_with("extra fields", json!({
            "frobnicate": {"deep": [1, 2, {"x": null}]},
            "logit_bias": {"50256": -100},
            "seed": 7,
        })) => Expect::Completion;
    // The simulator serves text only and answers a clear 400; what matters is that the filter
    // canonicalises the parts, routes, and Envoy delivers the body intact.
    multimodal_content_with_image_parts: CHAT, &[JSON_CT], json!({
        "model": MODEL,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png", "detail": "high"}},
            {"type": "text", "text": "Answer briefly."}
        ]}]
    }) => Expect::ServedOrRejected;
    multimodal_inline_base64_image_of_1_mb: CHAT, &[JSON_CT], json!({
        "model": MODEL,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!(
                "data:image/png;base64,{}",
                "iVBORw0KGgo".repeat(1024 * 1024 / 11)
            )}},
            {"type": "text", "text": "describe"}
        ]}]
    }) => Expect::ServedOrRejected;
    text_only_content_parts_are_served: CHAT, &[JSON_CT], json!({
        "model": MODEL, "max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}
        ]}]
    }) => Expect::Completion;
    tool_definitions_tool_calls_and_tool_messages: CHAT, &[JSON_CT], json!({
        "model": MODEL,
        "max_tokens": 3,
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
        ]
    }) => Expect::Completion;
    ten_thousand_messages: CHAT, &[JSON_CT], json!({
        "model": MODEL,
        "messages": (0..10_000)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": format!("m{i}")})
            })
            .collect::<Vec<Value>>(),
        "max_tokens": 2,
    }) => Expect::ServedOrRejected;
    // 1.5 MB of words (~250k tokens > max_model_len): thousands of block hashes in one route
    // call, then the replica's own length check.
    prompt_longer_than_the_context_window: CHAT, &[JSON_CT],
        chat(&"lorem ipsum dolor ".repeat(1_500_000 / 18)) => Expect::ServedOrRejected;
    escaped_control_characters_and_nul: CHAT, &[JSON_CT],
        chat("nul:\u{0} bell:\u{7} esc:\u{1b} del:\u{7f} tab:\t line:\u{2028}")
        => Expect::Completion;
    unicode_and_emoji_prompt: CHAT, &[JSON_CT],
        chat("日本語のテキスト 🦀🚀 عربى Ελληνικά e\u{301}") => Expect::Completion;
}

// ------------------------------------------------------------------------------------------
// Malformed bodies: the filter fails open, the replica explains

#[test]
fn malformed_json() {
    case("malformed_json", async |t| {
        let before = t.stat("wasmcustom.kvroute_fail_open").await;
        let r = post_json(t.envoy_addr(), CHAT, b"{\"model\": \"m\", \"messages\": [}").await;
        expect_openai_error("malformed", &r, &[400]);
        assert!(
            t.stat("wasmcustom.kvroute_fail_open").await > before,
            "a malformed body did not take the fail-open path"
        );
    });
}

/// The first half of a well-formed chat body.
fn truncated_chat() -> Vec<u8> {
    let full = bytes_of(&chat(&"truncate me ".repeat(200)));
    full[..full.len() / 2].to_vec()
}

/// `head`, then `bytes`, then `tail`: a body with bytes no JSON string may hold.
fn spliced(head: &[u8], bytes: &[u8], tail: &[u8]) -> Vec<u8> {
    [head, bytes, tail].concat()
}

post_cases! {
    truncated_json: CHAT, &[JSON_CT], truncated_chat() => Expect::Error(&[400]);
    empty_body: CHAT, &[JSON_CT], b"" => Expect::Error(&[400]);
    json_null_body: CHAT, &[JSON_CT], b"null" => Expect::Error(&[400]);
    json_array_body: CHAT, &[JSON_CT], b"[{\"model\":\"m\"}]" => Expect::Error(&[400]);
    json_string_body: CHAT, &[JSON_CT], b"\"just a string\"" => Expect::Error(&[400]);
    trailing_garbage_after_the_object: CHAT, &[JSON_CT],
        spliced(&bytes_of(&chat("x")), b" }{ trailing", b"") => Expect::Error(&[400]);
    json_with_comments: CHAT, &[JSON_CT],
        br#"{"model": "m", /* comment */ "messages": [{"role":"user","content":"x"}]}"#
        => Expect::Error(&[400]);
    invalid_utf8_inside_a_string: CHAT, &[JSON_CT], spliced(
        br#"{"model":"kvroute-bad-input-model","max_tokens":2,"messages":[{"role":"user","content":"bad "#,
        &[0xff, 0xfe, 0xc3, 0x28, 0xa0, 0xa1, 0xf0, 0x28, 0x8c, 0xbc],
        br#""}]}"#,
    ) => Expect::Error(&[400]);
    latin1_body_declared_as_latin1:
        CHAT, &[("content-type", "application/json; charset=iso-8859-1")], spliced(
        br#"{"model":"kvroute-bad-input-model","max_tokens":2,"messages":[{"role":"user","content":"caf"#,
        &[0xe9],
        br#""}]}"#,
    ) => Expect::Error(&[400]);
    utf8_byte_order_mark: CHAT, &[JSON_CT],
        spliced(&[0xef, 0xbb, 0xbf], &bytes_of(&chat("bom")), b"") => Expect::ServedOrRejected;
    lone_surrogate_escape: CHAT, &[JSON_CT],
        br#"{"model":"kvroute-bad-input-model","max_tokens":2,"messages":[{"role":"user","content":"x\ud800y"}]}"#
        => Expect::ServedOrRejected;
    deeply_nested_arrays: CHAT, &[JSON_CT],
        format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)) => Expect::Error(&[400]);
    deeply_nested_value_inside_a_valid_request: CHAT, &[JSON_CT], format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"x"}}],"metadata":{}1{}}}"#,
        "{\"a\":".repeat(5_000),
        "}".repeat(5_000)
    ) => Expect::ServedOrRejected;
    duplicate_keys: CHAT, &[JSON_CT], format!(
        r#"{{"model":"{MODEL}","model":"other","max_tokens":2,"messages":[{{"role":"user","content":"a"}}],"messages":[{{"role":"user","content":"b"}}]}}"#
    ) => Expect::ServedOrRejected;
    huge_float_max_tokens: CHAT, &[JSON_CT], format!(
        r#"{{"model":"{MODEL}","max_tokens":1e400,"messages":[{{"role":"user","content":"x"}}]}}"#
    ) => Expect::Error(&[400]);
    huge_integer_max_tokens: CHAT, &[JSON_CT], format!(
        r#"{{"model":"{MODEL}","max_tokens":184467440737095516160000,"messages":[{{"role":"user","content":"x"}}]}}"#
    ) => Expect::Error(&[400]);
    negative_max_tokens: CHAT, &[JSON_CT],
        chat_with("x", json!({"max_tokens": -5})) => Expect::Error(&[400]);
}

// ------------------------------------------------------------------------------------------
// Bodies Python's `json` takes (issue 20, defect 8): vLLM serves them, so they keep their cache
// affinity. Each is sent after the well-formed body vLLM reads it as, through the explaining
// Envoy, and must be routed by prefix to that body's replica with its blocks cached, not fail
// open (`reason=fail_open; error=body_parse`).

/// `key=value; ...` of an `x-kvroute-decision` header.
fn decision_fields(value: &str) -> Vec<(String, String)> {
    value
        .split("; ")
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn decision_field<'a>(fields: &'a [(String, String)], key: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Sends `body` through the explaining Envoy until a decision is not a route-call timeout (a
/// loaded machine misses the filter's 50 ms budget now and then); returns the reply and the
/// decision's fields.
async fn explained_decision(
    t: &'static Topology,
    case: &str,
    body: &[u8],
) -> (Reply, Vec<(String, String)>) {
    let addr = t.explain_envoy().to_string();
    let mut last = None;
    for _ in 0..5 {
        let r = post(&addr, CHAT, &[JSON_CT, ("x-kvroute-explain", "1")], body).await;
        assert_no_5xx(case, &r);
        assert!(r.answered_by_replica(), "{case}: {}", r.describe());
        let fields = r
            .header("x-kvroute-decision")
            .map(decision_fields)
            .unwrap_or_else(|| panic!("{case}: no decision header: {:?}", r.headers));
        if decision_field(&fields, "error") == Some("timeout") {
            last = Some((r, fields));
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        return (r, fields);
    }
    let (r, fields) = last.unwrap_or_else(|| panic!("{case}: no attempt"));
    panic!(
        "{case}: every route call timed out: {fields:?} {}",
        r.describe()
    );
}

/// `odd` is `plain` (a chat body with a prompt of its own) in a shape only Python's `json`
/// reads: routed after `plain`, it goes by prefix to `plain`'s replica with `plain`'s blocks
/// cached, as the same prompt does.
async fn expect_routed_like(t: &'static Topology, case: &str, plain: &Value, odd: &[u8]) {
    let plain = bytes_of(plain);
    let blocks = scorer_core::canon::canonicalize(scorer_core::protocol::ApiKind::Chat, &plain)
        .unwrap_or_else(|e| panic!("{case}: {e}"))
        .bytes
        .len()
        / scorer_core::hash::DEFAULT_BLOCK_BYTES;
    assert!(
        blocks >= 8,
        "{case}: make the prompt longer ({blocks} blocks)"
    );
    let (first, fields) = explained_decision(t, case, &plain).await;
    let endpoint = decision_field(&fields, "endpoint")
        .unwrap_or_else(|| panic!("{case}: the well-formed body was not routed: {fields:?}"))
        .to_string();
    assert_eq!(first.status, 200, "{case}: {}", first.describe());
    // The other cases share this fleet and load its replicas at the same time: a decision may
    // spill to a less loaded replica by load (`reason=load`), which is the router doing its job,
    // not the body losing its affinity. Ask again after a pause, a few times.
    let mut attempt = 0;
    let (r, fields) = loop {
        attempt += 1;
        let (r, fields) = explained_decision(t, case, odd).await;
        eprintln!("{case} (attempt {attempt}): {fields:?} {}", r.describe());
        if decision_field(&fields, "reason") != Some("load") || attempt == 5 {
            break (r, fields);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(
        decision_field(&fields, "reason"),
        Some("prefix"),
        "{case}: not routed by its prefix: {fields:?}"
    );
    assert_eq!(
        decision_field(&fields, "endpoint"),
        Some(endpoint.as_str()),
        "{case}: not sent where its prompt is cached: {fields:?}"
    );
    assert_eq!(r.header(REPLICA_HEADER), Some(endpoint.as_str()), "{case}");
    let cached: usize = decision_field(&fields, "cached_blocks")
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{case}: no cached_blocks in {fields:?}"));
    // All of the prompt's blocks, bar the last one the engine always recomputes.
    assert!(
        cached + 1 >= blocks,
        "{case}: {cached} of {blocks} blocks cached"
    );
}

/// A prompt of its own for each case, long enough for a dozen blocks.
fn affinity_prompt(case: &str) -> String {
    format!("{case}: {}", crate::common::words(0x20_08, 500))
}

/// The whole of an affinity case: the well-formed chat of the case's own prompt (`label`'s,
/// then `suffix`), and `odd(plain, prompt)`, the same request in a shape only Python's `json`
/// reads, which must be routed like it ([`expect_routed_like`]). The cases differ only in
/// `odd`.
fn affinity_case(name: &str, label: &str, suffix: &str, odd: impl FnOnce(&Value, &str) -> String) {
    case(name, async move |t| {
        let text = affinity_prompt(label);
        let plain = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("{text}{suffix}")}]});
        let odd = odd(&plain, &text);
        expect_routed_like(t, label, &plain, odd.as_bytes()).await;
    });
}

#[test]
fn duplicate_keys_are_routed_by_their_last_values() {
    affinity_case(
        "duplicate_keys_affinity",
        "duplicate keys",
        "",
        |_, text| {
            format!(
                r#"{{"model":"other","max_tokens":"x","messages":[{{"role":"user","content":"first"}}],
                "model":"{MODEL}","max_tokens":2,"messages":[{{"role":"system","role":"user",
                "content":"draft","content":{}}}]}}"#,
                json!(text)
            )
        },
    );
}

#[test]
fn lone_surrogate_escape_is_routed_by_its_prefix() {
    // Python keeps `\ud800`; the filter reads it as U+FFFD, as it reads every lone surrogate.
    affinity_case(
        "lone_surrogate_affinity",
        "lone surrogate",
        " \u{fffd}",
        |plain, _| {
            let odd = plain.to_string().replace('\u{fffd}', r"\ud800");
            assert!(odd.contains(r"\ud800"), "{odd}");
            odd
        },
    );
}

#[test]
fn nan_temperature_is_routed_by_its_prefix() {
    affinity_case(
        "nan_temperature_affinity",
        "NaN temperature",
        "",
        |plain, _| {
            format!(
                r#"{{"temperature":NaN,"top_p":Infinity,"presence_penalty":-Infinity,{}"#,
                &plain.to_string()[1..]
            )
        },
    );
}

// A `max_tokens` above every replica's context (`max_model_len` in `/v1/models`) is refused
// by whichever engine gets it, so the router routes it by load and credits its prompt to no
// replica, even one holding that prompt; the engine's 400 passes through.
#[test]
fn max_tokens_of_2_pow_40_is_refused_by_the_engine_and_credited_nowhere() {
    case("max_tokens_2_pow_40", async |t| {
        let label = "max_tokens 2^40";
        let plain = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": affinity_prompt(label)}]});
        let odd = plain
            .to_string()
            .replace(r#""max_tokens":2"#, r#""max_tokens":1099511627776"#);
        assert!(odd.contains("1099511627776"), "{odd}");
        let (first, _) = explained_decision(t, label, &bytes_of(&plain)).await;
        assert_eq!(first.status, 200, "{label}: {}", first.describe());
        // The control plane learns the contexts from its `/v1/models` polls: ask until it has.
        let mut attempt = 0;
        let (r, fields) = loop {
            attempt += 1;
            let (r, fields) = explained_decision(t, label, odd.as_bytes()).await;
            eprintln!("{label} (attempt {attempt}): {fields:?} {}", r.describe());
            if decision_field(&fields, "cached_blocks") == Some("0") || attempt == 20 {
                break (r, fields);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert_eq!(
            r.status,
            400,
            "{label}: the engine's answer: {}",
            r.describe()
        );
        assert_eq!(
            decision_field(&fields, "cached_blocks"),
            Some("0"),
            "{label}: a request no context holds is routed with no prompt: {fields:?}"
        );
    });
}

post_cases! {
    messages_is_a_string: CHAT, &[JSON_CT],
        json!({"model": MODEL, "messages": "hello", "max_tokens": 2}) => Expect::Error(&[400]);
    model_is_a_number: CHAT, &[JSON_CT],
        json!({"model": 42, "messages": [{"role": "user", "content": "x"}]})
        => Expect::Error(&[400]);
    stream_is_a_string: CHAT, &[JSON_CT],
        chat_with("x", json!({"stream": "yes"})) => Expect::Error(&[400]);
    empty_messages_array: CHAT, &[JSON_CT],
        json!({"model": MODEL, "messages": [], "max_tokens": 2}) => Expect::Error(&[400]);
    message_without_content_and_with_null_content: CHAT, &[JSON_CT],
        json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system"}, {"role": "user", "content": null}, {"role": "user", "content": "hi"}
        ]}) => Expect::ServedOrRejected;
    unknown_role_and_non_string_role: CHAT, &[JSON_CT],
        json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "wizard", "content": "abracadabra"}, {"role": 7, "content": "x"}
        ]}) => Expect::ServedOrRejected;
}

// ------------------------------------------------------------------------------------------
// Headers, encodings and content types

post_cases! {
    // The filter does not route non-JSON content types; the replica (like vLLM's FastAPI
    // handlers) reads the body anyway.
    wrong_content_type_text_plain: CHAT, &[("content-type", "text/plain")],
        chat("plain") => Expect::ServedOrRejected;
    form_urlencoded_body: CHAT, &[("content-type", "application/x-www-form-urlencoded")],
        b"model=m&messages=hello" => Expect::Error(&[400, 415]);
    multipart_form_body: CHAT, &[("content-type", "multipart/form-data; boundary=XyZ")],
        "--XyZ\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.json\"\r\n\
         content-type: application/json\r\n\r\n{\"model\":\"m\"}\r\n--XyZ--\r\n"
        => Expect::Error(&[400, 415]);
    missing_content_type: CHAT, &[], chat("no content type") => Expect::Completion;
    unknown_content_encoding_with_garbage: CHAT, &[JSON_CT, ("content-encoding", "br")],
        &[0x1b, 0x03, 0x00, 0xf8, 0xa5, 0x40, 0x02] => Expect::Error(&[400, 415]);
    huge_session_header: CHAT, &[JSON_CT, ("x-session-id", &"s".repeat(16 * 1024))],
        chat("session") => Expect::Completion;
    binary_session_header_and_user_field: CHAT, &[JSON_CT, ("x-session-id", "café-ünï\tsession")],
        chat_with("user field", json!({"user": "\u{0}\u{ffff}ünïcødé-user".repeat(100)}))
        => Expect::Completion;
    expect_100_continue: CHAT, &[JSON_CT, ("expect", "100-continue")],
        chat("continue") => Expect::Completion;
}

#[test]
fn content_type_with_parameters_and_vendor_json() {
    case("json_content_types", async |t| {
        for ct in [
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.kvroute+json",
        ] {
            let r = post(
                t.envoy_addr(),
                CHAT,
                &[("content-type", ct)],
                &bytes_of(&chat("content type")),
            )
            .await;
            expect_completion(ct, &r);
        }
    });
}

#[test]
fn gzip_encoded_body() {
    // The filter cannot read compressed bodies and lets them through unrouted; vLLM does not
    // decompress request bodies either, so the replica refuses it with a clear 400.
    case("gzip", async |t| {
        let before = t.stat("wasmcustom.kvroute_requests_skipped").await;
        let r = post(
            t.envoy_addr(),
            CHAT,
            &[JSON_CT, ("content-encoding", "gzip")],
            &gzip_stored(&bytes_of(&chat("compressed"))),
        )
        .await;
        expect_openai_error("gzip", &r, &[400, 415]);
        assert!(t.stat("wasmcustom.kvroute_requests_skipped").await > before);
    });
}

#[test]
fn spoofed_routing_headers_with_garbage_values() {
    case("spoofed_headers", async |t| {
        let r = post(
            t.envoy_addr(),
            CHAT,
            &[
                JSON_CT,
                (
                    DESTINATION_HEADER,
                    ",,,;;; not-an-endpoint, 999.1.1.1:99999",
                ),
                (DESTINATION_HEADER, "10.255.255.1:9"),
                ("x-prefiller-host-port", "127.0.0.1:1"),
                // Explain is off in this configuration: asking for it, or forging its
                // answer, must not produce a decision header.
                ("x-kvroute-explain", "1"),
                ("x-kvroute-decision", "endpoint=forged"),
            ],
            &bytes_of(&chat("spoof")),
        )
        .await;
        expect_completion("spoofed headers", &r);
        assert_eq!(r.header("x-kvroute-decision"), None, "{}", r.describe());
    });
}

#[test]
fn invalid_header_bytes_are_refused_by_envoys_codec() {
    // A DEL or NUL inside a header value is not HTTP: Envoy's codec answers 400 before any
    // filter runs. Not a routing matter, but it must be a clean 4xx.
    case("invalid_header_bytes", async |t| {
        for value in ["a\u{7f}b", "a\u{0}b"] {
            let r = post(
                t.envoy_addr(),
                CHAT,
                &[JSON_CT, ("x-session-id", value)],
                &bytes_of(&chat("bad header")),
            )
            .await;
            assert_eq!(r.status, 400, "{value:?}: {}", r.describe());
            assert!(!r.answered_by_replica(), "{}", r.describe());
        }
    });
}

#[test]
fn ninety_extra_headers_pass_and_too_many_get_431() {
    // Envoy allows 100 request headers by default (`max_headers_count`); past that its codec
    // answers 431 before any filter runs.
    case("many_headers", async |t| {
        for (extra, want) in [(90, 200), (150, 431)] {
            let names: Vec<String> = (0..extra).map(|i| format!("x-extra-{i}")).collect();
            let mut headers = vec![JSON_CT];
            headers.extend(names.iter().map(|n| (n.as_str(), "v")));
            let r = post(t.envoy_addr(), CHAT, &headers, &bytes_of(&chat("headers"))).await;
            if want == 200 {
                expect_completion("90 extra headers", &r);
            } else {
                assert_eq!(r.status, want, "{extra} extra headers: {}", r.describe());
                assert!(!r.answered_by_replica(), "{}", r.describe());
            }
        }
    });
}

// ------------------------------------------------------------------------------------------
// Methods, paths and framing

#[test]
fn unknown_path() {
    case("unknown_path", async |t| {
        let r = post_json(t.envoy_addr(), "/v1/frobnicate", &bytes_of(&chat("x"))).await;
        expect_replica_status("unknown path", &r, &[404]);
        let r = post_json(
            t.envoy_addr(),
            "/V1/CHAT/COMPLETIONS",
            &bytes_of(&chat("x")),
        )
        .await;
        expect_replica_status("upper-case path", &r, &[404]);
    });
}

#[test]
fn get_models_passes_through() {
    case("get_models", async |t| {
        let r = send(t.envoy_addr(), http1("GET", "/v1/models", &[], b"")).await;
        assert_eq!(r.status, 200, "{}", r.describe());
        assert!(r.text().contains(MODEL), "{}", r.describe());
    });
}

#[test]
fn wrong_methods_on_the_chat_path() {
    case("wrong_methods", async |t| {
        for method in ["GET", "PUT", "DELETE", "PATCH"] {
            let r = send(t.envoy_addr(), http1(method, CHAT, &[JSON_CT], b"{}")).await;
            expect_replica_status(method, &r, &[405]);
        }
        let r = send(t.envoy_addr(), http1("HEAD", CHAT, &[], b"")).await;
        assert!(r.status == 405 || r.status == 404, "{}", r.describe());
        let r = send(t.envoy_addr(), http1("OPTIONS", CHAT, &[], b"")).await;
        assert_no_5xx("OPTIONS", &r);
    });
}

#[test]
fn chunked_body_in_slow_pieces() {
    case("chunked_slow", async |t| {
        let body = bytes_of(&chat(&"slowly ".repeat(400)));
        let mut head = http1(
            "POST",
            CHAT,
            &[JSON_CT, ("transfer-encoding", "chunked")],
            b"",
        );
        let encoded = chunked(&body, body.len() / 20 + 1);
        let mut parts: Vec<Vec<u8>> = encoded
            .chunks(encoded.len() / 20 + 1)
            .map(<[u8]>::to_vec)
            .collect();
        head.extend(parts.remove(0));
        parts.insert(0, head);
        let r = exchange(t.envoy_addr(), parts, Duration::from_millis(20))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        expect_completion("chunked slow", &r);
    });
}

#[test]
fn client_aborts_in_the_middle_of_the_body() {
    case("client_abort", async |t| {
        for _ in 0..5 {
            let body = bytes_of(&chat(&"abort ".repeat(2_000)));
            let mut req = http1("POST", CHAT, &[JSON_CT], &body);
            req.truncate(req.len() - body.len() / 2);
            let mut s = TcpStream::connect(t.envoy_addr()).await.expect("connect");
            s.write_all(&req).await.expect("write");
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(s);
        }
        // The next request is served normally.
        expect_still_serving(t.envoy_addr(), "after aborts").await;
    });
}

#[test]
fn content_length_longer_than_the_body_then_half_close() {
    case("short_body_half_close", async |t| {
        let body = bytes_of(&chat("short"));
        let mut req = http1(
            "POST",
            CHAT,
            &[JSON_CT, ("content-length", &(body.len() + 500).to_string())],
            b"",
        );
        req.extend_from_slice(&body);
        let mut s = TcpStream::connect(t.envoy_addr()).await.expect("connect");
        s.write_all(&req).await.expect("write");
        s.shutdown().await.expect("half close");
        let mut raw = Vec::new();
        let read = tokio::time::timeout(REQUEST_TIMEOUT, s.read_to_end(&mut raw)).await;
        assert!(read.is_ok(), "Envoy kept a half-closed, short request open");
        if let Some(r) = parse_response(&raw) {
            assert_no_5xx("short body", &r);
        }
        expect_still_serving(t.envoy_addr(), "after short body").await;
    });
}

#[test]
fn conflicting_content_length_and_chunked() {
    // Request smuggling shape: Envoy must refuse it (400) rather than pass it on.
    case("cl_and_te", async |t| {
        let body = chunked(&bytes_of(&chat("smuggle")), 64);
        let r = post(
            t.envoy_addr(),
            CHAT,
            &[
                JSON_CT,
                ("content-length", "5"),
                ("transfer-encoding", "chunked"),
            ],
            &body,
        )
        .await;
        assert_no_5xx("CL+TE", &r);
        eprintln!("CL+TE: {}", r.describe());
    });
}

// ------------------------------------------------------------------------------------------
// HTTP/2

/// A chat POST over HTTP/2 through the shared Envoy, its body sent as `frames`; a transport
/// failure fails the case. What the HTTP/2 cases differ in is only the frames.
async fn h2_chat(t: &Topology, frames: Vec<Frame<Bytes>>) -> Reply {
    h2(t.envoy_addr(), "POST", CHAT, &[JSON_CT], frames)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn http2_chat_json() {
    case("h2_json", async |t| {
        let r = h2_chat(t, vec![data(bytes_of(&chat("over h2")))]).await;
        expect_completion("h2 json", &r);
    });
}

#[test]
fn http2_chat_stream() {
    case("h2_stream", async |t| {
        let body = chat_with("stream over h2", json!({"stream": true}));
        let r = h2_chat(t, vec![data(bytes_of(&body))]).await;
        expect_stream("h2 stream", &r);
    });
}

#[test]
fn http2_body_in_many_data_frames() {
    case("h2_many_frames", async |t| {
        let body = bytes_of(&chat(&"frame ".repeat(3_000)));
        let frames = body.chunks(97).map(|c| data(c.to_vec())).collect();
        let r = h2_chat(t, frames).await;
        expect_completion("h2 frames", &r);
    });
}

#[test]
fn http2_request_trailers_end_the_body() {
    case("h2_trailers", async |t| {
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("x-checksum", hyper::header::HeaderValue::from_static("abc"));
        let frames = vec![
            data(bytes_of(&chat("with trailers"))),
            Frame::trailers(trailers),
        ];
        let r = h2_chat(t, frames).await;
        expect_completion("h2 trailers", &r);
    });
}

#[test]
fn http2_malformed_json_and_empty_body() {
    case("h2_malformed", async |t| {
        let r = h2_chat(t, vec![data(&b"{\"model\": [[["[..])]).await;
        expect_openai_error("h2 malformed", &r, &[400]);
        let r = h2_chat(t, vec![]).await;
        expect_openai_error("h2 empty", &r, &[400]);
    });
}

#[test]
fn http2_concurrent_streams_on_one_connection() {
    case("h2_multiplexed", async |t| {
        let tcp = TcpStream::connect(t.envoy_addr()).await.expect("connect");
        let (sender, conn) = hyper::client::conn::http2::handshake::<_, _, H2Body>(
            TokioExecutor::new(),
            TokioIo::new(tcp),
        )
        .await
        .expect("h2 handshake");
        let driver = tokio::spawn(conn);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..12 {
            let mut sender = sender.clone();
            let addr = t.envoy_addr().to_string();
            // Good and bad bodies interleaved on one connection.
            let body = if i % 3 == 2 {
                b"{not json".to_vec()
            } else {
                bytes_of(&chat(&format!("multiplexed {i}")))
            };
            tasks.spawn(async move {
                let req = hyper::Request::builder()
                    .method("POST")
                    .uri(format!("http://{addr}{CHAT}"))
                    .header("content-type", "application/json")
                    .body(StreamBody::new(futures_util::stream::iter(vec![Ok(data(
                        body,
                    ))])))
                    .expect("request");
                let resp = sender.send_request(req).await.expect("h2 response");
                let status = resp.status().as_u16();
                let body = resp.into_body().collect().await.expect("body").to_bytes();
                (i, status, body)
            });
        }
        while let Some(joined) = tasks.join_next().await {
            let (i, status, body) = joined.expect("task");
            let want = if i % 3 == 2 { 400 } else { 200 };
            assert_eq!(
                status,
                want,
                "stream {i}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        driver.abort();
    });
}

// ------------------------------------------------------------------------------------------
// Bodies over the limits

#[test]
fn body_of_10_mb_with_content_length() {
    // Declared above `max_body_bytes`: the filter does not even buffer it (skipped, fail open).
    case("10mb_content_length", async |t| {
        let before = t.stat("wasmcustom.kvroute_requests_skipped").await;
        let body = bytes_of(&chat(&"a".repeat(TEN_MB)));
        let r = post_json(t.envoy_addr(), CHAT, &body).await;
        expect_big_body_handled("10 MB with content-length", &r);
        assert!(t.stat("wasmcustom.kvroute_requests_skipped").await > before);
        expect_still_serving(t.envoy_addr(), "after 10 MB").await;
    });
}

#[test]
fn body_of_10_mb_chunked() {
    // No length up front: the filter buffers up to `max_body_bytes` (4 MiB), then fails open
    // and Envoy streams the rest.
    case("10mb_chunked", async |t| {
        let body = bytes_of(&chat(&"b".repeat(TEN_MB)));
        let r = post(
            t.envoy_addr(),
            CHAT,
            &[JSON_CT, ("transfer-encoding", "chunked")],
            &chunked(&body, 256 * 1024),
        )
        .await;
        expect_big_body_handled("10 MB chunked", &r);
        expect_still_serving(t.envoy_addr(), "after 10 MB chunked").await;
    });
}

#[test]
fn body_over_envoys_buffer_limit_gets_a_413_from_envoy() {
    // When the filter may buffer more than Envoy allows (`max_body_bytes` 16 MiB above the
    // listener's 8 MiB `per_connection_buffer_limit_bytes`), Envoy itself answers 413 as soon
    // as the buffered body passes its limit: a clean, immediate refusal. Raise
    // `per_connection_buffer_limit_bytes` on the listener and the `vllm` cluster (and
    // `max_body_bytes`) to accept bigger prompts; see docs/RELIABILITY.md.
    case("over_envoy_buffer_limit", async |t| {
        let addr = t.big_buffer_envoy().to_string();
        let body = bytes_of(&chat(&"c".repeat(TEN_MB)));
        for (label, request) in [
            ("content-length", http1("POST", CHAT, &[JSON_CT], &body)),
            (
                "chunked",
                http1(
                    "POST",
                    CHAT,
                    &[JSON_CT, ("transfer-encoding", "chunked")],
                    &chunked(&body, 256 * 1024),
                ),
            ),
        ] {
            let r = send(&addr, request).await;
            // Envoy's own 413, as OpenAI-style JSON (`local_reply_config`).
            expect_envoy_json_error(label, &r, 413);
            assert!(
                r.text().contains("Payload Too Large"),
                "{label}: {}",
                r.describe()
            );
        }
        // A normal request through the same Envoy still works.
        expect_still_serving(&addr, "after 413").await;
    });
}

post_cases! {
    // 1.9 MB: buffered, canonicalised and hashed (about 7,400 blocks) by the filter; the
    // replica refuses it for length or serves it, but never a 5xx.
    body_just_under_the_filter_limit_is_routed: CHAT, &[JSON_CT],
        chat(&"near the limit ".repeat(1_900_000 / 15)) => Expect::ServedOrRejected;
}

// ------------------------------------------------------------------------------------------
// gzip without a compression crate: "stored" deflate blocks are valid gzip.

fn gzip_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    let mut blocks = data.chunks(65_535).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(block) = blocks.next() {
        let last = u8::from(blocks.peek().is_none());
        let len = block.len() as u16;
        out.push(last);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

// ------------------------------------------------------------------------------------------
// The agent APIs and the other paths: odd shapes reach a replica, never a 5xx of the filter's

/// Answered by a replica, 2xx or an OpenAI/Anthropic-style 4xx error: the filter let it through.
fn expect_replica_answer(case: &str, r: &Reply) {
    assert_no_5xx(case, r);
    assert!(r.answered_by_replica(), "{case}: {}", r.describe());
    if r.status >= 400 {
        expect_error_body(case, r);
    }
}

#[test]
fn odd_responses_bodies_reach_a_replica() {
    case("odd_responses_bodies_reach_a_replica", async |t| {
        for (what, body) in [
            ("number input", r#"{"model":"m","input":5}"#),
            ("number item", r#"{"model":"m","input":[5]}"#),
            (
                "object tool output",
                r#"{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":{}}]}"#,
            ),
            (
                "unknown item",
                r#"{"model":"m","input":[{"type":"from_the_future","x":1}]}"#,
            ),
            ("no input", r#"{"model":"m","instructions":"x"}"#),
            (
                "empty previous id",
                r#"{"model":"m","input":"x","previous_response_id":""}"#,
            ),
            (
                "unknown previous id",
                r#"{"model":"m","input":"x","previous_response_id":"resp_nobody"}"#,
            ),
            ("cut", r#"{"model":"m","input":[{"role":"user","content":"#),
            (
                "namespace tool without tools",
                r#"{"model":"m","input":"x","tools":[{"type":"namespace","name":"ns","tools":7}]}"#,
            ),
            (
                "custom tool call with object input",
                r#"{"model":"m","input":[{"type":"custom_tool_call","call_id":"c","name":"t","input":{}}]}"#,
            ),
            (
                "template kwargs not an object",
                r#"{"model":"m","input":"x","chat_template_kwargs":[1]}"#,
            ),
            (
                "reasoning effort a number",
                r#"{"model":"m","input":"x","reasoning":{"effort":3}}"#,
            ),
            (
                "incomplete last item",
                r#"{"model":"m","input":[{"type":"message","role":"assistant","status":"incomplete","content":[]}]}"#,
            ),
        ] {
            let r = post_json(t.envoy_addr(), "/v1/responses", body.as_bytes()).await;
            expect_replica_answer(&format!("responses {what}"), &r);
        }
    })
}

#[test]
fn odd_messages_bodies_reach_a_replica() {
    case("odd_messages_bodies_reach_a_replica", async |t| {
        for (what, body) in [
            (
                "number block",
                r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[5]}]}"#,
            ),
            (
                "number system",
                r#"{"model":"m","max_tokens":4,"system":5,"messages":[]}"#,
            ),
            (
                "no max_tokens",
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            ),
            (
                "bad metadata",
                r#"{"model":"m","max_tokens":4,"metadata":{"user_id":7},"messages":[{"role":"user","content":"hi"}]}"#,
            ),
            (
                "tool_addition outside system",
                r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[{"type":"tool_addition","tools":5}]}]}"#,
            ),
            (
                "tool_removal of an unknown tool",
                r#"{"model":"m","max_tokens":4,"system":[{"type":"tool_removal","tool_names":["nope"]}],"messages":[{"role":"user","content":"hi"}]}"#,
            ),
            (
                "tool without schema",
                r#"{"model":"m","max_tokens":4,"tools":[{"name":"t","input_schema":null,"extra":1}],"messages":[{"role":"user","content":"hi"}]}"#,
            ),
            (
                "cache_control everywhere",
                r#"{"model":"m","max_tokens":4,"cache_control":{"type":"ephemeral"},"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":null}]}]}"#,
            ),
        ] {
            let r = post_json(t.envoy_addr(), "/v1/messages", body.as_bytes()).await;
            expect_replica_answer(&format!("messages {what}"), &r);
        }
        let r = post_json(t.envoy_addr(), "/v1/messages/count_tokens", b"not json").await;
        expect_replica_answer("count_tokens not json", &r);
    })
}

#[test]
fn odd_stored_response_paths_reach_a_replica() {
    case("odd_stored_response_paths_reach_a_replica", async |t| {
        let long = format!("/v1/responses/resp_{}", "a".repeat(4000));
        for path in [
            "/v1/responses/resp_unknown",
            "/v1/responses/resp_unknown/cancel",
            "/v1/responses/",
            "/v1/responses/resp_%2F..%2F",
            "/v1/responses/resp_x/cancel/more",
            long.as_str(),
        ] {
            let method = if path.ends_with("/cancel") {
                "POST"
            } else {
                "GET"
            };
            let r = send(t.envoy_addr(), http1(method, path, &[JSON_CT], b"")).await;
            assert_no_5xx(path, &r);
            assert!(r.answered_by_replica(), "{path}: {}", r.describe());
        }
    })
}

#[test]
fn load_routes_take_any_body() {
    case("load_routes_take_any_body", async |t| {
        for (path, body) in [
            ("/v1/embeddings", b"plain text".as_slice()),
            ("/v1/embeddings", b"[1,2,3]".as_slice()),
            ("/rerank", br#"{"model":5}"#.as_slice()),
            ("/score", b"".as_slice()),
        ] {
            let r = post_json(t.envoy_addr(), path, body).await;
            assert_no_5xx(path, &r);
            assert!(r.answered_by_replica(), "{path}: {}", r.describe());
        }
    })
}

#[test]
fn gzip_helper_matches_the_reference_crc() {
    assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    let gz = gzip_stored(b"hello");
    assert_eq!(&gz[..3], &[0x1f, 0x8b, 8]);
    assert_eq!(gz.len(), 10 + 5 + 5 + 8);
}
