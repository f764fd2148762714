//! Scrapes each endpoint's `/metrics` on a fixed tick and feeds the router.
//!
//! A scrape asks for only the series the router reads (`/metrics/?name[]=…`, which vLLM's
//! `prometheus_client` honours), and falls back to the whole page for an endpoint that does
//! not serve it ([`MetricsPage`]).
//!
//! One task per endpoint, each with its own deadline, so one slow replica never delays the
//! others. A success updates the endpoint's load and makes it a candidate again; after
//! `unreachable_after_failures` consecutive failures (refused, timed out, non-200, unparsable)
//! it stops being a candidate until a scrape succeeds.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Request;
use hyper::header::{ACCEPT, HOST};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use scorer_core::lora::LoraState;
use scorer_core::pools::ServedModel;
use scorer_core::router::EndpointMetrics;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::pools::{parse_lora_info, parse_models};
use crate::prom::{
    PromError, SCRAPED_SERIES, restricted_metrics_path, scrape_vllm_engine_metrics,
    scrape_vllm_metrics,
};
use crate::state::State;
use scorer_core::address::split_rank;

/// How and how often endpoints are scraped.
#[derive(Debug, Clone)]
pub struct ScrapeSettings {
    /// Tick between scrape starts of one endpoint.
    pub interval: Duration,
    /// Deadline for one scrape, connect to last body byte.
    pub timeout: Duration,
    /// Consecutive failures that make an endpoint unreachable.
    pub unreachable_after: u32,
    /// Largest body accepted.
    pub max_body_bytes: usize,
    /// Tick between polls of the endpoint's `/v1/models` (its model pool membership);
    /// zero never polls.
    pub models_interval: Duration,
}

/// Why one scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The whole scrape took longer than the timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Connecting or sending the request failed (the message includes the cause chain).
    #[error("request failed: {0}")]
    Request(String),
    /// The endpoint answered with something other than 200.
    #[error("HTTP status {0}")]
    Status(u16),
    /// Reading the body failed or it exceeded the size limit.
    #[error("reading body: {0}")]
    Body(String),
    /// The body is not usable vLLM metrics.
    #[error("bad metrics: {0}")]
    Parse(#[from] PromError),
    /// The `/v1/models` body is not an OpenAI model list.
    #[error("bad model list: {0}")]
    Models(#[from] crate::pools::ModelsError),
    /// The address does not form a valid request URI.
    #[error("bad request: {0}")]
    BadRequest(#[from] hyper::http::Error),
}

impl ScrapeError {
    /// Short label for the `kvroute_scrapes_total{result}` counter.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Request(_) => "connect",
            Self::Status(_) => "status",
            Self::Body(_) => "body",
            Self::Parse(_) => "parse",
            Self::Models(_) => "models",
            Self::BadRequest(_) => "bad_request",
        }
    }
}

/// `e: cause: cause...`: hyper's client errors say little without their sources. The one
/// wording for the control plane's HTTP clients (scrapes, remote tokenizers, the Kubernetes API).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A pooled HTTP/1 client for scraping (keep-alive, so a scrape is one round trip).
pub fn client(settings: &ScrapeSettings) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(settings.timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// The newest `/metrics` page (and `/v1/models` list) of each data-parallel server: its ranks
/// are endpoints with scrape loops of their own, and one fetch a tick serves them all. The first rank to ask in a
/// tick fetches (the others wait for it) and the page serves whoever asks within half a scrape
/// interval. A failed fetch is not kept: each rank tries again.
#[derive(Debug, Default)]
pub struct SharedPages {
    pages: parking_lot::Mutex<HashMap<String, Arc<PageSlot>>>,
}

/// One server's newest page and when it was fetched; the lock makes the other ranks of a tick
/// wait for the fetch in flight.
type PageSlot = tokio::sync::Mutex<Option<(Instant, Bytes)>>;

impl SharedPages {
    /// The page kept under `key` (a server and path) no older than `max_age`,
    /// from `fetch` when there is none.
    async fn get(
        &self,
        key: &str,
        max_age: Duration,
        fetch: impl Future<Output = Result<Bytes, ScrapeError>>,
    ) -> Result<Bytes, ScrapeError> {
        let slot = self.pages.lock().entry(key.to_owned()).or_default().clone();
        let mut page = slot.lock().await;
        if let Some((at, body)) = page.as_ref()
            && at.elapsed() < max_age
        {
            return Ok(body.clone());
        }
        let body = fetch.await?;
        *page = Some((Instant::now(), body.clone()));
        Ok(body)
    }
}

/// `/metrics/?name[]=…` for [`SCRAPED_SERIES`], built once.
static RESTRICTED_PATH: LazyLock<String> =
    LazyLock::new(|| restricted_metrics_path(&SCRAPED_SERIES));

/// Which page an endpoint's scrapes ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsPage {
    /// `/metrics/?name[]=…`, only the series the router reads: about 3 KB of a vLLM 0.33 page's
    /// 58, so both the replica (which renders it in Python) and the control plane do a
    /// twentieth of the work. Every scrape starts here.
    #[default]
    Restricted,
    /// `/metrics`, the whole page: for an endpoint whose restricted page failed (not found, not
    /// metrics, missing a series) while its whole page worked.
    Whole,
}

impl MetricsPage {
    fn path(self) -> &'static str {
        match self {
            Self::Restricted => RESTRICTED_PATH.as_str(),
            Self::Whole => "/metrics",
        }
    }
}

/// Scrapes `address` as `page` says, falling back for good to the whole page when the
/// restricted one fails where the whole one works (a server that does not serve `/metrics/`,
/// or answers it with something else); when both fail, the whole page's error is returned. A
/// timeout or refused connection is the endpoint's failure, not the page's, and is returned as
/// it is.
pub async fn scrape(
    client: &HttpClient,
    address: &str,
    settings: &ScrapeSettings,
    pages: &SharedPages,
    page: &mut MetricsPage,
) -> Result<(EndpointMetrics, Option<LoraState>), ScrapeError> {
    let first = scrape_once(client, address, settings, pages, *page).await;
    match first {
        Err(ScrapeError::Status(_) | ScrapeError::Body(_) | ScrapeError::Parse(_))
            if *page == MetricsPage::Restricted =>
        {
            let whole = scrape_once(client, address, settings, pages, MetricsPage::Whole).await;
            if whole.is_ok() {
                tracing::info!(
                    endpoint = %address,
                    error = %first.as_ref().err().map(|e| e.to_string()).unwrap_or_default(),
                    "the restricted /metrics/ page failed; scraping the whole /metrics page"
                );
                *page = MetricsPage::Whole;
            }
            // When both fail, the whole page's failure is the endpoint's (a server without
            // `/metrics/` answers it 404 at once, whatever is wrong with its metrics).
            whole
        }
        other => other,
    }
}

/// Fetches and parses `page` of `address` once, within `settings.timeout`: the load metrics,
/// and the LoRA adapters when the page has `vllm:lora_requests_info`. For a data-parallel rank
/// (`ip:port#dp<rank>`) the server's page (shared with its other ranks through `pages`) is
/// read for that engine's series.
pub async fn scrape_once(
    client: &HttpClient,
    address: &str,
    settings: &ScrapeSettings,
    pages: &SharedPages,
    page: MetricsPage,
) -> Result<(EndpointMetrics, Option<LoraState>), ScrapeError> {
    let rank = split_rank(address).1;
    let max_age = settings.interval / 2;
    let body = fetch_server(
        client,
        address,
        page.path(),
        "text/plain",
        settings,
        pages,
        max_age,
    )
    .await?;
    let text = std::str::from_utf8(&body).map_err(|e| PromError::NotUtf8(e.valid_up_to()))?;
    // Both read only their own series' lines: a vLLM page is 500+ lines, they need about 13.
    let metrics = match rank {
        Some(rank) => scrape_vllm_engine_metrics(text, rank)?,
        None => scrape_vllm_metrics(text)?,
    };
    let lora = parse_lora_info(text);
    Ok((metrics, lora))
}

/// Fetches and parses `http://{address}/v1/models` once: the models the endpoint serves. A
/// data-parallel rank reads its server's list, shared with the other ranks through `pages`
/// for half a models interval.
pub async fn models_once(
    client: &HttpClient,
    address: &str,
    settings: &ScrapeSettings,
    pages: &SharedPages,
) -> Result<Vec<ServedModel>, ScrapeError> {
    let max_age = settings.models_interval / 2;
    let json = "application/json";
    let body = fetch_server(client, address, MODELS_PATH, json, settings, pages, max_age).await?;
    Ok(parse_models(&body)?)
}

/// GETs `path` of the server `address` names. A data-parallel rank (`ip:port#dp<rank>`)
/// shares the server's answer with its other ranks through `pages` for `max_age`, so one
/// fetch a tick serves them all.
async fn fetch_server(
    client: &HttpClient,
    address: &str,
    path: &str,
    accept: &'static str,
    settings: &ScrapeSettings,
    pages: &SharedPages,
    max_age: Duration,
) -> Result<Bytes, ScrapeError> {
    let (server, rank) = split_rank(address);
    let fetched = fetch(client, server, path, accept, settings);
    match rank {
        Some(_) => {
            pages
                .get(&format!("{server}{path}"), max_age, fetched)
                .await
        }
        None => fetched.await,
    }
}

/// vLLM's model list.
const MODELS_PATH: &str = "/v1/models";

/// GETs `path` of the server at `address` (JSON) within `settings.timeout` and returns the
/// 200 body: the scrape client's way of asking a replica anything else.
pub async fn get(
    client: &HttpClient,
    address: &str,
    path: &str,
    settings: &ScrapeSettings,
) -> Result<Bytes, ScrapeError> {
    fetch(client, address, path, "application/json", settings).await
}

/// GETs `path` of `address` within `settings.timeout` and returns the 200 body.
async fn fetch(
    client: &HttpClient,
    address: &str,
    path: &str,
    accept: &'static str,
    settings: &ScrapeSettings,
) -> Result<Bytes, ScrapeError> {
    let fetch = async {
        let request = Request::get(format!("http://{address}{path}"))
            .header(HOST, address)
            .header(ACCEPT, accept)
            .body(Empty::<Bytes>::new())?;
        let response = client
            .request(request)
            .await
            .map_err(|e| ScrapeError::Request(error_chain(&e)))?;
        if response.status() != hyper::StatusCode::OK {
            return Err(ScrapeError::Status(response.status().as_u16()));
        }
        let body = Limited::new(response.into_body(), settings.max_body_bytes)
            .collect()
            .await
            .map_err(|e| ScrapeError::Body(e.to_string()))?
            .to_bytes();
        Ok(body)
    };
    tokio::time::timeout(settings.timeout, fetch)
        .await
        .map_err(|_| ScrapeError::Timeout(settings.timeout))?
}

/// Starts one scrape loop per endpoint; they stop when `shutdown` turns true or is dropped.
pub fn spawn(
    state: Arc<State>,
    endpoints: Vec<String>,
    settings: ScrapeSettings,
    shutdown: watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let client = client(&settings);
    endpoints
        .into_iter()
        .map(|address| {
            let (state, client, settings, shutdown) = (
                state.clone(),
                client.clone(),
                settings.clone(),
                shutdown.clone(),
            );
            tokio::spawn(scrape_loop(state, client, address, settings, shutdown))
        })
        .collect()
}

async fn scrape_loop(
    state: Arc<State>,
    client: HttpClient,
    address: String,
    settings: ScrapeSettings,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(settings.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut failures: u32 = 0;
    let mut down = false;
    // When `/v1/models` was last asked (None: never); polled after a successful scrape.
    let mut models_polled: Option<Instant> = None;
    let mut page = MetricsPage::default();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    return;
                }
                continue;
            }
        }
        let started = Instant::now();
        let result = tokio::select! {
            r = scrape(&client, &address, &settings, state.shared_pages(), &mut page) => r,
            _ = shutdown.changed() => return,
        };
        let elapsed = started.elapsed();
        match result {
            Ok((metrics, lora)) => {
                state.telemetry().count_scrape(&address, "ok", elapsed);
                state.record_scrape(&address, None, elapsed);
                state.update_metrics(&address, metrics);
                state.update_lora(&address, lora);
                let due = !settings.models_interval.is_zero()
                    && models_polled.is_none_or(|t| t.elapsed() >= settings.models_interval);
                if due {
                    models_polled = Some(Instant::now());
                    let polled = tokio::select! {
                        r = models_once(&client, &address, &settings, state.shared_pages()) => r,
                        _ = shutdown.changed() => return,
                    };
                    match polled {
                        Ok(models) => state.set_polled_models(&address, models),
                        Err(e) => {
                            tracing::debug!(endpoint = %address, error = %e, "/v1/models failed");
                        }
                    }
                }
                if down {
                    tracing::info!(endpoint = %address, "endpoint reachable again");
                }
                failures = 0;
                down = false;
            }
            Err(e) => {
                state.telemetry().count_scrape(&address, e.kind(), elapsed);
                state.record_scrape(&address, Some(e.to_string()), elapsed);
                failures = failures.saturating_add(1);
                if failures >= settings.unreachable_after {
                    if !down {
                        tracing::warn!(endpoint = %address, failures, error = %e, "endpoint unreachable");
                    }
                    state.mark_unreachable(&address);
                    down = true;
                } else {
                    tracing::debug!(endpoint = %address, failures, error = %e, "scrape failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    // Four ranks of one server ask for its page in the same tick: one fetch serves them all,
    // until the page is older than the age allowed; a failed fetch is not kept.
    #[tokio::test]
    async fn the_ranks_of_a_server_share_one_fetch_a_tick() {
        let pages = SharedPages::default();
        let fetches = AtomicU32::new(0);
        let fetch = || async {
            fetches.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, ScrapeError>(Bytes::from_static(b"page"))
        };
        let age = Duration::from_millis(200);
        let asks = (0..4).map(|_| pages.get("10.0.0.5:8000", age, fetch()));
        for page in futures_util::future::join_all(asks).await {
            assert_eq!(page.unwrap(), Bytes::from_static(b"page"));
        }
        assert_eq!(fetches.load(Ordering::Relaxed), 1);
        // Another server has its own page.
        pages.get("10.0.0.6:8000", age, fetch()).await.unwrap();
        assert_eq!(fetches.load(Ordering::Relaxed), 2);
        // Too old: fetched again.
        tokio::time::sleep(age).await;
        pages.get("10.0.0.5:8000", age, fetch()).await.unwrap();
        assert_eq!(fetches.load(Ordering::Relaxed), 3);
        let failed = pages.get("10.0.0.7:8000", age, async {
            Err::<Bytes, _>(ScrapeError::Status(503))
        });
        assert!(failed.await.is_err());
        pages.get("10.0.0.7:8000", age, fetch()).await.unwrap();
        assert_eq!(fetches.load(Ordering::Relaxed), 4);
    }

    /// A page with the series routing needs and one it does not.
    const PAGE: &str = "# TYPE vllm:num_requests_running gauge\n\
                        vllm:num_requests_running 2\n\
                        vllm:num_requests_waiting 1\n\
                        vllm:kv_cache_usage_perc 0.5\n\
                        vllm:iteration_tokens_total_bucket{le=\"1.0\"} 7\n";

    /// A server answering `/metrics` with [`PAGE`] and `/metrics/` as `restricted` says
    /// (`None`: as vLLM does, with the `name[]` samples only); it counts the requests per path.
    async fn server(
        restricted: Option<(u16, &'static str)>,
    ) -> (String, Arc<parking_lot::Mutex<Vec<String>>>) {
        use axum::extract::Request;
        let asked = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let log = asked.clone();
        let app = axum::Router::new().fallback(move |req: Request| {
            let log = log.clone();
            async move {
                let uri = req.uri().clone();
                log.lock().push(uri.path().to_owned());
                match (uri.path(), restricted) {
                    ("/metrics", _) => (hyper::StatusCode::OK, PAGE.to_owned()),
                    ("/metrics/", Some((status, body))) => (
                        hyper::StatusCode::from_u16(status).unwrap(),
                        body.to_owned(),
                    ),
                    ("/metrics/", None) => {
                        let page = vllm_wire::prom::vllm_metrics_answer(
                            "/metrics/",
                            uri.query(),
                            PAGE.into(),
                        );
                        (hyper::StatusCode::OK, page)
                    }
                    _ => (hyper::StatusCode::NOT_FOUND, String::new()),
                }
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (address, asked)
    }

    // A scrape asks for the series the router reads; an endpoint that does not serve them at
    // `/metrics/` is scraped through its whole page from then on, and one that is down is not
    // moved off the restricted page.
    #[tokio::test]
    async fn scrapes_ask_for_the_read_series_and_fall_back_to_the_whole_page() {
        let settings = ScrapeSettings {
            interval: Duration::from_millis(100),
            timeout: Duration::from_secs(5),
            unreachable_after: 3,
            max_body_bytes: 1 << 20,
            models_interval: Duration::ZERO,
        };
        let client = client(&settings);
        let pages = SharedPages::default();
        let cases = [
            (
                None,
                MetricsPage::Restricted,
                ["/metrics/", "/metrics/"].as_slice(),
            ),
            (
                Some((404, "Not Found")),
                MetricsPage::Whole,
                &["/metrics/", "/metrics", "/metrics"],
            ),
            (
                Some((200, "<html></html>")),
                MetricsPage::Whole,
                &["/metrics/", "/metrics", "/metrics"],
            ),
        ];
        for (restricted, after, paths) in cases {
            let (address, asked) = server(restricted).await;
            let mut page = MetricsPage::default();
            for _ in 0..2 {
                let (m, _) = scrape(&client, &address, &settings, &pages, &mut page)
                    .await
                    .unwrap();
                assert_eq!((m.running, m.waiting, m.kv_usage), (2, 1, 0.5));
            }
            assert_eq!(page, after, "{restricted:?}");
            assert_eq!(*asked.lock(), paths, "{restricted:?}");
        }
        // An endpoint that is down stays on the restricted page.
        let mut page = MetricsPage::default();
        let refused = scrape(&client, "127.0.0.1:1", &settings, &pages, &mut page).await;
        assert!(
            matches!(refused, Err(ScrapeError::Request(_))),
            "{refused:?}"
        );
        assert_eq!(page, MetricsPage::Restricted);
    }
}
