//! `vllm-sim`: a simulated vLLM server (OpenAI API, Prometheus metrics, ZMQ KV events).
//!
//! Wiring only; the simulator lives in `vllm_sim`.

use anyhow::Context;
use clap::Parser;
use vllm_sim::server::{self, SimArgs};

fn main() -> std::process::ExitCode {
    match run(SimArgs::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The whole cause chain on one line, without a backtrace.
            eprintln!("vllm-sim: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: SimArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // One worker thread: eight replicas must share two cores.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(async move {
        let sim = server::start(args).await.context("cannot start vllm-sim")?;
        tracing::info!(
            addr = %sim.addr,
            kv_events = ?sim.kv_events_endpoint,
            kv_events_replay = ?sim.kv_events_replay_endpoint,
            "vllm-sim listening"
        );
        wait_for_signal().await?;
        tracing::info!("vllm-sim shutting down");
        sim.shutdown().await;
        anyhow::Ok(())
    })
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("cannot wait for ctrl-c")?,
        _ = term.recv() => {}
    }
    Ok(())
}
