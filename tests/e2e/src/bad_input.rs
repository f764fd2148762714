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

async fn post_json(addr: &str, path: &str, body: &[u8]) -> Reply {
    send(addr, http1("POST", path, &[JSON_CT], body)).await
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
    assert!(
        statuses.contains(&r.status),
        "{case}: expected one of {statuses:?}: {}",
        r.describe()
    );
    assert!(r.answered_by_replica(), "{case}: {}", r.describe());
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
        let mut body = chat("stream me");
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_stream("stream true", &r);
        assert!(r.text().contains("\"usage\""), "{}", r.describe());
    });
}

#[test]
fn chat_stream_false_is_served_as_json() {
    case("chat_stream_false", async |t| {
        let mut body = chat("no stream");
        body["stream"] = json!(false);
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_completion("stream false", &r);
    });
}

#[test]
fn completion_with_string_prompt() {
    case("completion_string", async |t| {
        let body = json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 3});
        let r = post_json(t.envoy_addr(), COMPLETIONS, &bytes_of(&body)).await;
        expect_completion("completion", &r);
    });
}

#[test]
fn completion_with_token_id_prompt() {
    case("completion_token_ids", async |t| {
        let body = json!({"model": MODEL, "prompt": [101, 2023, 2003, 1037], "max_tokens": 3});
        let r = post_json(t.envoy_addr(), COMPLETIONS, &bytes_of(&body)).await;
        expect_served_or_rejected("token id prompt", &r);
    });
}

#[test]
fn completion_with_batched_prompts() {
    case("completion_batch", async |t| {
        let body = json!({"model": MODEL, "prompt": ["first", "second"], "max_tokens": 3});
        let r = post_json(t.envoy_addr(), COMPLETIONS, &bytes_of(&body)).await;
        expect_served_or_rejected("batched prompts", &r);
    });
}

#[test]
fn missing_model_is_served_by_the_default_model() {
    case("missing_model", async |t| {
        let body = json!({"messages": [{"role": "user", "content": "who am I"}], "max_tokens": 3});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_completion("missing model", &r);
    });
}

#[test]
fn unknown_model_gets_a_404_error() {
    case("unknown_model", async |t| {
        let mut body = chat("x");
        body["model"] = json!("no-such-model");
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("unknown model", &r, &[404]);
    });
}

#[test]
fn very_long_model_name_fails_open() {
    // 100 kB model name: the control plane refuses the route call (400), the filter fails open
    // and the replica answers that the model does not exist.
    case("long_model_name", async |t| {
        let mut body = chat("x");
        body["model"] = json!("m".repeat(100_000));
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("long model", &r, &[404]);
    });
}

#[test]
fn query_string_on_the_inference_path() {
    case("query_string", async |t| {
        let r = post_json(
            t.envoy_addr(),
            "/v1/chat/completions?api-version=2024-01-01&x=%00",
            &bytes_of(&chat("query")),
        )
        .await;
        expect_completion("query string", &r);
    });
}

#[test]
fn unknown_fields_are_passed_through() {
    case("unknown_fields", async |t| {
        let mut body = chat("extra fields");
        body["frobnicate"] = json!({"deep": [1, 2, {"x": null}]});
        body["logit_bias"] = json!({"50256": -100});
        body["seed"] = json!(7);
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_completion("unknown fields", &r);
    });
}

#[test]
fn multimodal_content_with_image_parts() {
    // The simulator serves text only and answers a clear 400; what matters is that the filter
    // canonicalises the parts, routes, and Envoy delivers the body intact.
    case("multimodal_image_url", async |t| {
        let body = json!({
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png", "detail": "high"}},
                {"type": "text", "text": "Answer briefly."}
            ]}]
        });
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_served_or_rejected("image parts", &r);
    });
}

#[test]
fn multimodal_inline_base64_image_of_1_mb() {
    case("multimodal_base64_1mb", async |t| {
        let b64 = "iVBORw0KGgo".repeat(1024 * 1024 / 11);
        let body = json!({
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}},
                {"type": "text", "text": "describe"}
            ]}]
        });
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_served_or_rejected("base64 image", &r);
    });
}

#[test]
fn text_only_content_parts_are_served() {
    case("text_parts", async |t| {
        let body = json!({
            "model": MODEL, "max_tokens": 3,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}
            ]}]
        });
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_completion("text parts", &r);
    });
}

#[test]
fn tool_definitions_tool_calls_and_tool_messages() {
    case("tool_calls", async |t| {
        let body = json!({
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
        });
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_completion("tool calls", &r);
    });
}

#[test]
fn ten_thousand_messages() {
    case("many_messages", async |t| {
        let messages: Vec<Value> = (0..10_000)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": format!("m{i}")})
            })
            .collect();
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_served_or_rejected("10k messages", &r);
    });
}

#[test]
fn prompt_longer_than_the_context_window() {
    // 1.5 MB of words (~250k tokens > max_model_len): thousands of block hashes in one route
    // call, then the replica's own length check.
    case("over_context", async |t| {
        let text = "lorem ipsum dolor ".repeat(1_500_000 / 18);
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&chat(&text))).await;
        expect_served_or_rejected("over context", &r);
    });
}

#[test]
fn escaped_control_characters_and_nul() {
    case("control_chars", async |t| {
        let r = post_json(
            t.envoy_addr(),
            CHAT,
            &bytes_of(&chat(
                "nul:\u{0} bell:\u{7} esc:\u{1b} del:\u{7f} tab:\t line:\u{2028}",
            )),
        )
        .await;
        expect_completion("control characters", &r);
    });
}

#[test]
fn unicode_and_emoji_prompt() {
    case("unicode", async |t| {
        let r = post_json(
            t.envoy_addr(),
            CHAT,
            &bytes_of(&chat("日本語のテキスト 🦀🚀 عربى Ελληνικά e\u{301}")),
        )
        .await;
        expect_completion("unicode", &r);
    });
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

#[test]
fn truncated_json() {
    case("truncated_json", async |t| {
        let full = bytes_of(&chat(&"truncate me ".repeat(200)));
        let r = post_json(t.envoy_addr(), CHAT, &full[..full.len() / 2]).await;
        expect_openai_error("truncated", &r, &[400]);
    });
}

#[test]
fn empty_body() {
    case("empty_body", async |t| {
        let r = post_json(t.envoy_addr(), CHAT, b"").await;
        expect_openai_error("empty body", &r, &[400]);
    });
}

#[test]
fn json_null_body() {
    case("null_body", async |t| {
        let r = post_json(t.envoy_addr(), CHAT, b"null").await;
        expect_openai_error("null", &r, &[400]);
    });
}

#[test]
fn json_array_body() {
    case("array_body", async |t| {
        let r = post_json(t.envoy_addr(), CHAT, b"[{\"model\":\"m\"}]").await;
        expect_openai_error("array", &r, &[400]);
    });
}

#[test]
fn json_string_body() {
    case("string_body", async |t| {
        let r = post_json(t.envoy_addr(), CHAT, b"\"just a string\"").await;
        expect_openai_error("string", &r, &[400]);
    });
}

#[test]
fn trailing_garbage_after_the_object() {
    case("trailing_garbage", async |t| {
        let mut body = bytes_of(&chat("x"));
        body.extend_from_slice(b" }{ trailing");
        let r = post_json(t.envoy_addr(), CHAT, &body).await;
        expect_openai_error("trailing garbage", &r, &[400]);
    });
}

#[test]
fn json_with_comments() {
    case("json_comments", async |t| {
        let body = br#"{"model": "m", /* comment */ "messages": [{"role":"user","content":"x"}]}"#;
        let r = post_json(t.envoy_addr(), CHAT, body).await;
        expect_openai_error("comments", &r, &[400]);
    });
}

#[test]
fn invalid_utf8_inside_a_string() {
    case("non_utf8", async |t| {
        let mut body = br#"{"model":"kvroute-bad-input-model","max_tokens":2,"messages":[{"role":"user","content":"bad "#.to_vec();
        body.extend_from_slice(&[0xff, 0xfe, 0xc3, 0x28, 0xa0, 0xa1, 0xf0, 0x28, 0x8c, 0xbc]);
        body.extend_from_slice(br#""}]}"#);
        let r = post_json(t.envoy_addr(), CHAT, &body).await;
        expect_openai_error("non-utf8", &r, &[400]);
    });
}

#[test]
fn latin1_body_declared_as_latin1() {
    case("latin1_charset", async |t| {
        let mut body = br#"{"model":"kvroute-bad-input-model","max_tokens":2,"messages":[{"role":"user","content":"caf"#.to_vec();
        body.push(0xe9);
        body.extend_from_slice(br#""}]}"#);
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[("content-type", "application/json; charset=iso-8859-1")],
                &body,
            ),
        )
        .await;
        expect_openai_error("latin1", &r, &[400]);
    });
}

#[test]
fn utf8_byte_order_mark() {
    case("utf8_bom", async |t| {
        let mut body = vec![0xef, 0xbb, 0xbf];
        body.extend_from_slice(&bytes_of(&chat("bom")));
        let r = post_json(t.envoy_addr(), CHAT, &body).await;
        expect_served_or_rejected("bom", &r);
    });
}

#[test]
fn lone_surrogate_escape() {
    case("lone_surrogate", async |t| {
        let body = br#"{"model":"kvroute-bad-input-model","max_tokens":2,"messages":[{"role":"user","content":"x\ud800y"}]}"#;
        let r = post_json(t.envoy_addr(), CHAT, body).await;
        expect_served_or_rejected("lone surrogate", &r);
    });
}

#[test]
fn deeply_nested_arrays() {
    case("deep_nesting", async |t| {
        let depth = 100_000;
        let mut body = "[".repeat(depth);
        body.push_str(&"]".repeat(depth));
        let r = post_json(t.envoy_addr(), CHAT, body.as_bytes()).await;
        expect_openai_error("deep nesting", &r, &[400]);
    });
}

#[test]
fn deeply_nested_value_inside_a_valid_request() {
    case("deep_field", async |t| {
        let depth = 5_000;
        let body = format!(
            r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"x"}}],"metadata":{}1{}}}"#,
            "{\"a\":".repeat(depth),
            "}".repeat(depth)
        );
        let r = post_json(t.envoy_addr(), CHAT, body.as_bytes()).await;
        expect_served_or_rejected("deep field", &r);
    });
}

#[test]
fn duplicate_keys() {
    case("duplicate_keys", async |t| {
        let body = format!(
            r#"{{"model":"{MODEL}","model":"other","max_tokens":2,"messages":[{{"role":"user","content":"a"}}],"messages":[{{"role":"user","content":"b"}}]}}"#
        );
        let r = post_json(t.envoy_addr(), CHAT, body.as_bytes()).await;
        expect_served_or_rejected("duplicate keys", &r);
    });
}

#[test]
fn huge_float_max_tokens() {
    case("huge_float", async |t| {
        let body = format!(
            r#"{{"model":"{MODEL}","max_tokens":1e400,"messages":[{{"role":"user","content":"x"}}]}}"#
        );
        let r = post_json(t.envoy_addr(), CHAT, body.as_bytes()).await;
        expect_openai_error("1e400", &r, &[400]);
    });
}

#[test]
fn huge_integer_max_tokens() {
    case("huge_integer", async |t| {
        let body = format!(
            r#"{{"model":"{MODEL}","max_tokens":184467440737095516160000,"messages":[{{"role":"user","content":"x"}}]}}"#
        );
        let r = post_json(t.envoy_addr(), CHAT, body.as_bytes()).await;
        expect_openai_error("huge integer", &r, &[400]);
    });
}

#[test]
fn negative_max_tokens() {
    case("negative_max_tokens", async |t| {
        let mut body = chat("x");
        body["max_tokens"] = json!(-5);
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("negative", &r, &[400]);
    });
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
        let r = send(
            &addr,
            http1("POST", CHAT, &[JSON_CT, ("x-kvroute-explain", "1")], body),
        )
        .await;
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

#[test]
fn duplicate_keys_are_routed_by_their_last_values() {
    case("duplicate_keys_affinity", async |t| {
        let text = affinity_prompt("duplicate keys");
        let plain = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]});
        let odd = format!(
            r#"{{"model":"other","max_tokens":"x","messages":[{{"role":"user","content":"first"}}],
                "model":"{MODEL}","max_tokens":2,"messages":[{{"role":"system","role":"user",
                "content":"draft","content":{}}}]}}"#,
            json!(text)
        );
        expect_routed_like(t, "duplicate keys", &plain, odd.as_bytes()).await;
    });
}

#[test]
fn lone_surrogate_escape_is_routed_by_its_prefix() {
    // Python keeps `\ud800`; the filter reads it as U+FFFD, as it reads every lone surrogate.
    case("lone_surrogate_affinity", async |t| {
        let text = affinity_prompt("lone surrogate");
        let plain = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("{text} \u{fffd}")}]});
        let odd = plain.to_string().replace('\u{fffd}', r"\ud800");
        assert!(odd.contains(r"\ud800"), "{odd}");
        expect_routed_like(t, "lone surrogate", &plain, odd.as_bytes()).await;
    });
}

#[test]
fn nan_temperature_is_routed_by_its_prefix() {
    case("nan_temperature_affinity", async |t| {
        let text = affinity_prompt("nan temperature");
        let plain = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]});
        let odd = format!(
            r#"{{"temperature":NaN,"top_p":Infinity,"presence_penalty":-Infinity,{}"#,
            &plain.to_string()[1..]
        );
        expect_routed_like(t, "NaN temperature", &plain, odd.as_bytes()).await;
    });
}

#[test]
fn max_tokens_of_2_pow_40_is_routed_by_its_prefix() {
    case("max_tokens_2_pow_40_affinity", async |t| {
        let text = affinity_prompt("max_tokens 2^40");
        let plain = json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]});
        let odd = plain
            .to_string()
            .replace(r#""max_tokens":2"#, r#""max_tokens":1099511627776"#);
        assert!(odd.contains("1099511627776"), "{odd}");
        expect_routed_like(t, "max_tokens 2^40", &plain, odd.as_bytes()).await;
    });
}

#[test]
fn messages_is_a_string() {
    case("messages_string", async |t| {
        let body = json!({"model": MODEL, "messages": "hello", "max_tokens": 2});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("messages string", &r, &[400]);
    });
}

#[test]
fn model_is_a_number() {
    case("model_number", async |t| {
        let body = json!({"model": 42, "messages": [{"role": "user", "content": "x"}]});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("model number", &r, &[400]);
    });
}

#[test]
fn stream_is_a_string() {
    case("stream_string", async |t| {
        let mut body = chat("x");
        body["stream"] = json!("yes");
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("stream string", &r, &[400]);
    });
}

#[test]
fn empty_messages_array() {
    case("empty_messages", async |t| {
        let body = json!({"model": MODEL, "messages": [], "max_tokens": 2});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_openai_error("empty messages", &r, &[400]);
    });
}

#[test]
fn message_without_content_and_with_null_content() {
    case("null_content", async |t| {
        let body = json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system"}, {"role": "user", "content": null}, {"role": "user", "content": "hi"}
        ]});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_served_or_rejected("null content", &r);
    });
}

#[test]
fn unknown_role_and_non_string_role() {
    case("odd_roles", async |t| {
        let body = json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "wizard", "content": "abracadabra"}, {"role": 7, "content": "x"}
        ]});
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&body)).await;
        expect_served_or_rejected("odd roles", &r);
    });
}

// ------------------------------------------------------------------------------------------
// Headers, encodings and content types

#[test]
fn wrong_content_type_text_plain() {
    // The filter does not route non-JSON content types; the replica (like vLLM's FastAPI
    // handlers) reads the body anyway.
    case("text_plain", async |t| {
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[("content-type", "text/plain")],
                &bytes_of(&chat("plain")),
            ),
        )
        .await;
        expect_served_or_rejected("text/plain", &r);
    });
}

#[test]
fn form_urlencoded_body() {
    case("form_urlencoded", async |t| {
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[("content-type", "application/x-www-form-urlencoded")],
                b"model=m&messages=hello",
            ),
        )
        .await;
        expect_openai_error("form", &r, &[400, 415]);
    });
}

#[test]
fn multipart_form_body() {
    case("multipart", async |t| {
        let body = "--XyZ\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.json\"\r\n\
                    content-type: application/json\r\n\r\n{\"model\":\"m\"}\r\n--XyZ--\r\n";
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[("content-type", "multipart/form-data; boundary=XyZ")],
                body.as_bytes(),
            ),
        )
        .await;
        expect_openai_error("multipart", &r, &[400, 415]);
    });
}

#[test]
fn content_type_with_parameters_and_vendor_json() {
    case("json_content_types", async |t| {
        for ct in [
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.kvroute+json",
        ] {
            let r = send(
                t.envoy_addr(),
                http1(
                    "POST",
                    CHAT,
                    &[("content-type", ct)],
                    &bytes_of(&chat("content type")),
                ),
            )
            .await;
            expect_completion(ct, &r);
        }
    });
}

#[test]
fn missing_content_type() {
    case("no_content_type", async |t| {
        let r = send(
            t.envoy_addr(),
            http1("POST", CHAT, &[], &bytes_of(&chat("no content type"))),
        )
        .await;
        expect_completion("no content-type", &r);
    });
}

#[test]
fn gzip_encoded_body() {
    // The filter cannot read compressed bodies and lets them through unrouted; vLLM does not
    // decompress request bodies either, so the replica refuses it with a clear 400.
    case("gzip", async |t| {
        let before = t.stat("wasmcustom.kvroute_requests_skipped").await;
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[JSON_CT, ("content-encoding", "gzip")],
                &gzip_stored(&bytes_of(&chat("compressed"))),
            ),
        )
        .await;
        expect_openai_error("gzip", &r, &[400, 415]);
        assert!(t.stat("wasmcustom.kvroute_requests_skipped").await > before);
    });
}

#[test]
fn unknown_content_encoding_with_garbage() {
    case("br_garbage", async |t| {
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[JSON_CT, ("content-encoding", "br")],
                &[0x1b, 0x03, 0x00, 0xf8, 0xa5, 0x40, 0x02],
            ),
        )
        .await;
        expect_openai_error("br", &r, &[400, 415]);
    });
}

#[test]
fn spoofed_routing_headers_with_garbage_values() {
    case("spoofed_headers", async |t| {
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
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
            ),
        )
        .await;
        expect_completion("spoofed headers", &r);
        assert_eq!(r.header("x-kvroute-decision"), None, "{}", r.describe());
    });
}

#[test]
fn huge_session_header() {
    case("huge_session_header", async |t| {
        let session = "s".repeat(16 * 1024);
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[JSON_CT, ("x-session-id", &session)],
                &bytes_of(&chat("session")),
            ),
        )
        .await;
        expect_completion("huge session", &r);
    });
}

#[test]
fn binary_session_header_and_user_field() {
    case("binary_session", async |t| {
        let mut body = chat("user field");
        body["user"] = json!("\u{0}\u{ffff}ünïcødé-user".repeat(100));
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[JSON_CT, ("x-session-id", "café-ünï\tsession")],
                &bytes_of(&body),
            ),
        )
        .await;
        expect_completion("binary session", &r);
    });
}

#[test]
fn invalid_header_bytes_are_refused_by_envoys_codec() {
    // A DEL or NUL inside a header value is not HTTP: Envoy's codec answers 400 before any
    // filter runs. Not a routing matter, but it must be a clean 4xx.
    case("invalid_header_bytes", async |t| {
        for value in ["a\u{7f}b", "a\u{0}b"] {
            let r = send(
                t.envoy_addr(),
                http1(
                    "POST",
                    CHAT,
                    &[JSON_CT, ("x-session-id", value)],
                    &bytes_of(&chat("bad header")),
                ),
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
            let r = send(
                t.envoy_addr(),
                http1("POST", CHAT, &headers, &bytes_of(&chat("headers"))),
            )
            .await;
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
fn expect_100_continue() {
    case("expect_continue", async |t| {
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[JSON_CT, ("expect", "100-continue")],
                &bytes_of(&chat("continue")),
            ),
        )
        .await;
        expect_completion("expect 100-continue", &r);
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
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&chat("after aborts"))).await;
        expect_completion("after aborts", &r);
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
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&chat("after short"))).await;
        expect_completion("after short body", &r);
    });
}

#[test]
fn conflicting_content_length_and_chunked() {
    // Request smuggling shape: Envoy must refuse it (400) rather than pass it on.
    case("cl_and_te", async |t| {
        let body = chunked(&bytes_of(&chat("smuggle")), 64);
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[
                    JSON_CT,
                    ("content-length", "5"),
                    ("transfer-encoding", "chunked"),
                ],
                &body,
            ),
        )
        .await;
        assert_no_5xx("CL+TE", &r);
        eprintln!("CL+TE: {}", r.describe());
    });
}

// ------------------------------------------------------------------------------------------
// HTTP/2

#[test]
fn http2_chat_json() {
    case("h2_json", async |t| {
        let r = h2(
            t.envoy_addr(),
            "POST",
            CHAT,
            &[JSON_CT],
            vec![data(bytes_of(&chat("over h2")))],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        expect_completion("h2 json", &r);
    });
}

#[test]
fn http2_chat_stream() {
    case("h2_stream", async |t| {
        let mut body = chat("stream over h2");
        body["stream"] = json!(true);
        let r = h2(
            t.envoy_addr(),
            "POST",
            CHAT,
            &[JSON_CT],
            vec![data(bytes_of(&body))],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        expect_stream("h2 stream", &r);
    });
}

#[test]
fn http2_body_in_many_data_frames() {
    case("h2_many_frames", async |t| {
        let body = bytes_of(&chat(&"frame ".repeat(3_000)));
        let frames = body.chunks(97).map(|c| data(c.to_vec())).collect();
        let r = h2(t.envoy_addr(), "POST", CHAT, &[JSON_CT], frames)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
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
        let r = h2(t.envoy_addr(), "POST", CHAT, &[JSON_CT], frames)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        expect_completion("h2 trailers", &r);
    });
}

#[test]
fn http2_malformed_json_and_empty_body() {
    case("h2_malformed", async |t| {
        let r = h2(
            t.envoy_addr(),
            "POST",
            CHAT,
            &[JSON_CT],
            vec![data(&b"{\"model\": [[["[..])],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        expect_openai_error("h2 malformed", &r, &[400]);
        let r = h2(t.envoy_addr(), "POST", CHAT, &[JSON_CT], vec![])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
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
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&chat("after 10 MB"))).await;
        expect_completion("after 10 MB", &r);
    });
}

#[test]
fn body_of_10_mb_chunked() {
    // No length up front: the filter buffers up to `max_body_bytes` (4 MiB), then fails open
    // and Envoy streams the rest.
    case("10mb_chunked", async |t| {
        let body = bytes_of(&chat(&"b".repeat(TEN_MB)));
        let r = send(
            t.envoy_addr(),
            http1(
                "POST",
                CHAT,
                &[JSON_CT, ("transfer-encoding", "chunked")],
                &chunked(&body, 256 * 1024),
            ),
        )
        .await;
        expect_big_body_handled("10 MB chunked", &r);
        let r = post_json(t.envoy_addr(), CHAT, &bytes_of(&chat("after chunked"))).await;
        expect_completion("after 10 MB chunked", &r);
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
        let r = post_json(&addr, CHAT, &bytes_of(&chat("small again"))).await;
        expect_completion("after 413", &r);
    });
}

#[test]
fn body_just_under_the_filter_limit_is_routed() {
    // 1.9 MB: buffered, canonicalised and hashed (about 7,400 blocks) by the filter; the
    // replica refuses it for length or serves it, but never a 5xx.
    case("under_filter_limit", async |t| {
        let body = bytes_of(&chat(&"near the limit ".repeat(1_900_000 / 15)));
        let r = post_json(t.envoy_addr(), CHAT, &body).await;
        expect_served_or_rejected("1.9 MB", &r);
    });
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
