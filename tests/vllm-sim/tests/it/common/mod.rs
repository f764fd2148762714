//! What the live-server test files share: a vllm-sim in-process, the built binary on a free
//! port, a KV-event replay, and the JSON of an answer.

use std::process::{Output, Stdio};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use kvroute_harness::{HttpClient, HttpResponse};
use serde_json::Value;
use tokio::process::{Child, Command};
use vllm_sim::server::{self, SimArgs, SimServer};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The bound of every wait.
pub const T: Duration = Duration::from_secs(10);
/// The model an in-process server serves.
pub const MODEL: &str = "sim-llama";

/// An in-process server on an OS-picked port of 127.0.0.1 serving [`MODEL`] at 20x speed,
/// with `extra` arguments.
pub async fn start(extra: &[&str]) -> SimServer {
    let mut argv = vec![
        "vllm-sim",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--model",
        MODEL,
        "--speed",
        "20",
    ];
    argv.extend_from_slice(extra);
    server::start(SimArgs::try_parse_from(argv).expect("args"))
        .await
        .expect("server starts")
}

/// The body of `r` as JSON (a panic showing it when it is not).
pub fn json_body(r: &HttpResponse) -> Value {
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not json ({e}): {}", r.body))
}

/// The `[empty, topic, seq, payload]` frames of every batch the replay socket at `endpoint`
/// sends for a replay from sequence 0, up to its end marker (no topic, seq all `0xFF`, no
/// payload).
pub async fn replay_from_zero(endpoint: &str) -> Vec<Vec<Bytes>> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.expect("connect replay");
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.expect("send replay request");
    let mut batches = Vec::new();
    loop {
        let m = tokio::time::timeout(T, dealer.recv())
            .await
            .expect("replay in time")
            .expect("recv");
        let f: Vec<Bytes> = m.into_vec();
        assert_eq!(f.len(), 4, "[empty, topic, seq, payload]");
        assert!(f[0].is_empty());
        if f[2].as_ref() == [0xFF; 8] {
            assert!(f[1].is_empty() && f[3].is_empty());
            return batches;
        }
        batches.push(f);
    }
}

/// The built binary run with `args` and `env`.
fn binary(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vllm-sim"));
    cmd.args(args).envs(env.iter().copied());
    cmd
}

/// The built binary serving on a free port with `args` and `env`, its output discarded and
/// killed on drop, once `/health` answers; with its base URL.
pub async fn spawn_binary(args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let port = kvroute_harness::free_port().expect("free port");
    let child = binary(&["--port", &port.to_string()], env)
        .args(args)
        .kill_on_drop(true)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn vllm-sim");
    let c = HttpClient::new();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + T;
    while c
        .get(&format!("{base}/health"), Duration::from_millis(500))
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "vllm-sim did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (child, base)
}

/// How the built binary run with `args` and `env` exits (within [`T`]).
pub async fn run_binary(args: &[&str], env: &[(&str, &str)]) -> Output {
    tokio::time::timeout(T, binary(args, env).output())
        .await
        .unwrap()
        .unwrap()
}
