//! `kvroute-control-plane --config FILE`: the routing service the kvroute filter calls.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use control_plane::ControlPlane;
use control_plane::config::Config;
use control_plane::discovery;
use tracing_subscriber::EnvFilter;

/// Cache-aware, load-aware routing for vLLM fleets: the control plane.
#[derive(Debug, Parser)]
#[command(name = "kvroute-control-plane", version)]
struct Cli {
    /// YAML configuration file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Log filter, e.g. `info` or `control_plane=debug,info` (RUST_LOG syntax).
    /// Defaults to `$RUST_LOG`, else `info`.
    #[arg(long, value_name = "LEVEL")]
    log: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let directives = cli
        .log
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "info".into());
    let filter = EnvFilter::try_new(&directives)
        .with_context(|| format!("invalid log filter {directives:?}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    let config = Config::load(&cli.config)?;
    // Open surfaces beyond loopback are allowed (a lab, a NetworkPolicy in front) but said.
    if config.auth_token.is_none() && !config.listen.ip().is_loopback() {
        tracing::warn!(listen = %config.listen, "the route API is open to anyone who reaches it: set auth_token (or auth_token_file)");
    }
    if config.admin_token.is_none() && !config.admin_listen.ip().is_loopback() {
        tracing::warn!(admin_listen = %config.admin_listen, "the admin pages are open to anyone who reaches them: set admin_token (or admin_token_file)");
    }
    let runtime = match config.worker_threads {
        // One thread polls the sockets and runs the handlers: no wake-up of a second thread
        // between a route call's arrival and its answer.
        0 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(n);
            builder
        }
    }
    .enable_all()
    .build()
    .context("cannot start the tokio runtime")?;
    runtime.block_on(serve(config))
}

/// Runs the service (and discovery, if configured) until SIGINT or SIGTERM.
async fn serve(config: Config) -> anyhow::Result<()> {
    // Kubernetes, DNS or file discovery adds and removes endpoints next to the configured ones.
    let discovery = config
        .discovery
        .clone()
        .map(|d| (d, discovery::apply::Settings::from_config(&config)));
    let service = ControlPlane::bind(config).await?;
    let discovery =
        discovery.map(|(d, settings)| discovery::apply::spawn(service.state(), d, settings));
    let result = service.run(shutdown_signal()).await;
    if let Some(task) = discovery {
        task.abort();
    }
    result?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM (Ctrl-C only where SIGTERM does not exist).
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}
