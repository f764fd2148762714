//! kvroute's control plane: scrapes vLLM replicas, owns the routing state, answers the filter.
//!
//! - [`config`] reads and validates the YAML configuration;
//! - [`prom`] turns a vLLM `/metrics` body into load numbers (pure, no I/O);
//! - [`scrape`] polls every replica's `/metrics` and feeds the router;
//! - [`kv_events`] subscribes to replicas' KV events (precise mode) and feeds the router;
//! - [`tokenize`] turns precise routes' prompts into token ids and token-block hashes;
//! - [`state`] owns the `scorer_core::router::Router`, the clock and the seed;
//! - [`api`] serves `POST /v1/route`, `POST /v1/feedback` and `POST /v1/sync` to the filter;
//! - [`picker`] serves Envoy's ext_proc protocol as an InferencePool's Endpoint Picker;
//! - [`admin`] serves `/metrics`, `/healthz` and `/debug/*` on a separate port;
//! - [`telemetry`] defines what `/metrics` reports.
//!
//! Invariant: routing logic lives in `scorer-core`; this crate only moves bytes, time and
//! metrics in and out of it. [`ControlPlane`] wires the pieces for the binary and for tests.

pub mod admin;
pub mod admission;
pub mod api;
pub mod config;
pub mod discovery;
pub mod kv_events;
pub mod picker;
pub mod pools;
pub mod replication;
/// The Prometheus text parser; it lives in `vllm-wire` so the fuzz targets build it without tokio.
pub use vllm_wire::prom;
pub mod scrape;
pub mod slo;
pub mod state;
pub mod telemetry;
#[cfg(test)]
mod test_util;
pub mod tokenize;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::serve::ListenerExt as _;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::state::State;

/// How long shutdown waits for open connections before giving up on them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often expired index and in-flight entries are swept when traffic is idle.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(1);

/// Why the control plane could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The configuration does not validate.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// A listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address from the config.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The endpoint list does not fit the router.
    #[error("endpoints: {0}")]
    Router(#[from] scorer_core::router::RouterError),
    /// The precise-mode tokenizer could not be set up.
    #[error("precise: {0}")]
    Tokenizer(#[from] tokenize::TokenizeError),
    /// A server loop failed.
    #[error("{which} server failed: {source}")]
    Serve {
        /// `api` or `admin`.
        which: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A bound, not yet running control plane (binding first lets tests use port 0).
#[derive(Debug)]
pub struct ControlPlane {
    config: Config,
    state: Arc<State>,
    precise: Arc<tokenize::Precise>,
    api: TcpListener,
    admin: TcpListener,
    /// The Endpoint Picker's listener (`picker:`).
    picker: Option<TcpListener>,
    /// The other end of the state's outbox, when replicas share state (`replication:`).
    outbox: Option<tokio::sync::mpsc::Receiver<Vec<scorer_core::sync::SyncEvent>>>,
}

impl ControlPlane {
    /// Validates `config`, builds the state and binds both listeners.
    pub async fn bind(config: Config) -> Result<Self, ServiceError> {
        config.validate()?;
        // Decision ids start from wall-clock microseconds so a restart does not reuse ids.
        let first_id = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1);
        // No `rand` in this crate: the start time in nanoseconds and the pid pick the first
        // replica tag (only distinctness across generations matters, not secrecy).
        let (outbox_tx, outbox) = match config.replication {
            Some(_) => {
                let (tx, rx) = replication::outbox();
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let entropy = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ (u64::from(std::process::id()) << 32);
        let state = Arc::new(
            State::new(
                config.router.clone(),
                &config.endpoint_addresses(),
                config.decision_history,
                first_id,
            )?
            .with_admission(config.admission.clone().map(admission::Gate::new))
            .with_slo(config.slo.clone().map(|c| {
                let pools = config
                    .engines()
                    .into_iter()
                    .filter_map(|e| Some((e.address, e.model?)))
                    .collect();
                slo::SloWindow::new(c, pools)
            }))
            .with_sync(config.sync.log_entries, state::first_replica_tag(entropy))
            .with_replication(outbox_tx),
        );
        let engines = config.engines();
        for e in &engines {
            state.set_configured_models(&e.address, e.served_model_names());
        }
        for e in &engines {
            if let Some(role) = e.role {
                state.set_role(&e.address, role);
            }
        }
        let precise = Arc::new(tokenize::Precise::from_config(&config)?);
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServiceError::Bind { addr, source })
        };
        let api = bind(config.listen).await?;
        let admin = bind(config.admin_listen).await?;
        let picker = match &config.picker {
            Some(p) => Some(bind(p.listen).await?),
            None => None,
        };
        Ok(Self {
            config,
            state,
            precise,
            api,
            admin,
            picker,
            outbox,
        })
    }

    /// Where the route API actually listens.
    pub fn api_addr(&self) -> SocketAddr {
        self.api.local_addr().unwrap_or(self.config.listen)
    }

    /// Where the admin API actually listens.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or(self.config.admin_listen)
    }

    /// Where the Endpoint Picker actually listens, when configured.
    pub fn picker_addr(&self) -> Option<SocketAddr> {
        self.picker.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The shared state (for tests and embedding).
    pub fn state(&self) -> Arc<State> {
        self.state.clone()
    }

    /// Serves until `shutdown` completes, then drains connections for at most a few seconds.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServiceError> {
        let (config, state, precise) = (self.config, self.state, self.precise);
        let (api, admin, outbox) = (self.api, self.admin, self.outbox);
        let picker_listener = self.picker;
        let (stop_tx, stop_rx) = watch::channel(false);

        let settings = scrape::ScrapeSettings {
            interval: Duration::from_millis(config.scrape_interval_ms),
            timeout: Duration::from_millis(config.scrape_timeout_ms),
            unreachable_after: config.unreachable_after_failures,
            max_body_bytes: config.max_metrics_bytes,
            models_interval: Duration::from_millis(config.models_interval_ms),
        };
        let mut background = scrape::spawn(
            state.clone(),
            config.endpoint_addresses(),
            settings.clone(),
            stop_rx.clone(),
        );
        background.push(tokio::spawn(housekeeping(state.clone(), stop_rx.clone())));
        if let (Some(settings), Some(outbox)) = (config.replication.clone(), outbox) {
            background.push(tokio::spawn(replication::run(
                state.clone(),
                settings,
                outbox,
                stop_rx.clone(),
            )));
        }
        let p = &config.precise;
        let subscriber = kv_events::SubscriberSettings {
            connect_timeout: Duration::from_millis(p.kv_connect_timeout_ms),
            replay_timeout: Duration::from_millis(p.kv_replay_timeout_ms),
            reconnect_min: Duration::from_millis(p.kv_reconnect_min_ms),
            reconnect_max: Duration::from_millis(p.kv_reconnect_max_ms),
        };
        background.extend(kv_events::subscriber::spawn(
            state.clone(),
            config.event_sources(),
            subscriber.clone(),
            stop_rx.clone(),
        ));
        background.extend(kv_events::sources::spawn(
            state.clone(),
            config.auto_event_servers(),
            (settings.clone(), subscriber),
            stop_rx.clone(),
        ));

        let api_router = api::router(
            state.clone(),
            api::ApiSettings {
                auth_token: config.auth_token.clone(),
                max_body_bytes: config.max_body_bytes,
                max_block_hashes: config.max_block_hashes,
                max_feedback_outcomes: config.max_feedback_outcomes,
                body_timeout: Duration::from_millis(config.body_timeout_ms),
                stored_response_wait: Duration::from_millis(config.stored_response_wait_ms),
                precise: precise.clone(),
            },
        );
        if let (Some(listener), Some(p)) = (picker_listener, &config.picker) {
            // Validated in bind(): the configuration parses.
            let filter = p.filter_config().unwrap_or_default();
            let serving = picker::Picker::new(
                state.clone(),
                precise.clone(),
                filter,
                Duration::from_millis(config.stored_response_wait_ms),
            );
            let stop = stop_rx.clone();
            let listen = p.listen;
            background.push(tokio::spawn(async move {
                if let Err(e) = serving.serve(listener, stop).await {
                    tracing::error!(%listen, error = %e, "endpoint picker stopped");
                }
            }));
        }
        let admin_router = admin::router(
            state.clone(),
            config.admin_token.clone(),
            Some(precise.clone()),
        );
        let mut api_task = tokio::spawn(serve(api, api_router, stop_rx.clone()));
        let mut admin_task = tokio::spawn(serve(admin, admin_router, stop_rx));
        tracing::info!(
            listen = %config.listen, admin_listen = %config.admin_listen,
            endpoints = config.endpoints.len(), "kvroute control plane running"
        );

        let failed = tokio::select! {
            () = shutdown => None,
            r = &mut api_task => Some(("api", r)),
            r = &mut admin_task => Some(("admin", r)),
        };
        let _ = stop_tx.send(true);
        for task in &background {
            task.abort();
        }
        if let Some((which, result)) = failed {
            admin_task.abort();
            api_task.abort();
            let source = match result {
                Ok(Err(e)) => e,
                Ok(Ok(())) => std::io::Error::other("stopped unexpectedly"),
                Err(join) => std::io::Error::other(join.to_string()),
            };
            return Err(ServiceError::Serve { which, source });
        }
        tracing::info!("shutting down");
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            let _ = (&mut api_task).await;
            let _ = (&mut admin_task).await;
        })
        .await;
        if drained.is_err() {
            tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}; closing them");
            api_task.abort();
            admin_task.abort();
        }
        Ok(())
    }
}

async fn serve(
    listener: TcpListener,
    router: axum::Router,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    // Answers are small and written whole: send them at once rather than let Nagle hold a
    // segment back for an acknowledgement.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    // With each connection's peer address: decision tags bind ids to the proxy that asked.
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(async move {
        let _ = stop.wait_for(|s| *s).await;
    })
    .await
}

async fn housekeeping(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(HOUSEKEEPING_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => state.expire(),
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
