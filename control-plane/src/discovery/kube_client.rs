//! Kubernetes discovery, the I/O half: a minimal API-server client and the list/watch loop.
//!
//! One HTTP/1.1 connection per request (hyper's low-level client over a tokio TCP stream,
//! wrapped in rustls for https): a list or get is one short request, a watch is one long
//! streamed response that the server ends after `timeoutSeconds`. The bearer token is re-read
//! on every request because projected service-account tokens rotate.
//!
//! Loop: (get the InferencePool) → list pods → publish → watch from the list's resourceVersion,
//! applying events and publishing changes → when the watch ends, watch again from the last
//! resourceVersion; after 410 Gone, any error, or (with a pool) every watch period, list again.
//! Errors back off exponentially and never clear the published set.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::TlsConnector;

use super::kube::{
    Applied, InferencePool, KubeError, LabelSelector, LineDecoder, PodList, PodTracker, WatchEvent,
};
use super::{Backoff, DiscoveredEndpoints, InferencePoolRef, KubernetesDiscovery, publish};

/// Largest list/get answer accepted (a PodList of a few thousand pods fits easily).
const MAX_LIST_BYTES: usize = 64 << 20;
/// Largest single watch event line.
const MAX_EVENT_BYTES: usize = 4 << 20;
/// Extra time past `timeoutSeconds` before a silent watch is considered dead.
const WATCH_GRACE: Duration = Duration::from_secs(30);

/// Why talking to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `api_server` is not `http(s)://host[:port]`.
    #[error("bad API server URL {url:?}: {reason}")]
    BadUrl {
        /// As configured.
        url: String,
        /// Why.
        reason: String,
    },
    /// Not configured and not running in a pod.
    #[error(
        "no api_server configured and KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set (not in a pod?)"
    )]
    NotInCluster,
    /// A credential file could not be read.
    #[error("reading {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The CA file has no usable certificate.
    #[error("CA file {path}: {reason}")]
    BadCa {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// TCP, TLS or HTTP failed.
    #[error("{what}: {reason}")]
    Transport {
        /// Which step.
        what: &'static str,
        /// The cause chain.
        reason: String,
    },
    /// No answer in time.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// The server answered with an error status.
    #[error("GET {path}: HTTP {status}: {body}")]
    Status {
        /// Request path.
        path: String,
        /// The status.
        status: u16,
        /// The start of the body (a Kubernetes Status message, usually).
        body: String,
    },
    /// The answer did not parse.
    #[error(transparent)]
    Kube(#[from] KubeError),
}

fn transport(what: &'static str) -> impl FnOnce(&dyn std::error::Error) -> ClientError {
    move |e| ClientError::Transport {
        what,
        reason: crate::scrape::error_chain(e),
    }
}

/// A parsed API server base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiServer {
    /// https?
    pub tls: bool,
    /// Host name or IP (no brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl ApiServer {
    /// Parses `http(s)://host[:port]` (a trailing `/` is allowed, a path is not).
    pub fn parse(url: &str) -> Result<Self, ClientError> {
        let bad = |reason: &str| ClientError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(bad("scheme must be http or https")),
        };
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(bad("must not have a path"));
        }
        let host = uri
            .host()
            .ok_or_else(|| bad("no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        Ok(Self { tls, host, port })
    }

    /// The in-cluster API server from the environment Kubernetes gives every pod.
    pub fn in_cluster() -> Result<Self, ClientError> {
        let host =
            std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| ClientError::NotInCluster)?;
        let port =
            std::env::var("KUBERNETES_SERVICE_PORT").map_err(|_| ClientError::NotInCluster)?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Self::parse(&format!("https://{host}:{port}"))
    }

    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved characters pass through).
pub fn encode_query_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A minimal, read-only Kubernetes API client.
#[derive(Clone)]
pub struct ApiClient {
    server: ApiServer,
    tls: Option<(TlsConnector, ServerName<'static>)>,
    token_file: Option<PathBuf>,
    timeout: Duration,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("server", &self.server)
            .field("tls", &self.tls.is_some())
            .field("token_file", &self.token_file)
            .finish()
    }
}

fn load_roots(path: &Path) -> Result<rustls::RootCertStore, ClientError> {
    let pem = std::fs::read(path).map_err(|source| ClientError::File {
        path: path.to_path_buf(),
        source,
    })?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| ClientError::BadCa {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        roots.add(cert).map_err(|e| ClientError::BadCa {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    }
    if roots.is_empty() {
        return Err(ClientError::BadCa {
            path: path.to_path_buf(),
            reason: "no PEM certificate in it".into(),
        });
    }
    Ok(roots)
}

impl ApiClient {
    /// A client for `server`; https needs `ca_file`. A missing `token_file` means no token
    /// (fine for `kubectl proxy`), an unreadable existing one is an error at request time.
    pub fn new(
        server: ApiServer,
        ca_file: Option<&Path>,
        token_file: Option<PathBuf>,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let tls = if server.tls {
            let ca = ca_file.ok_or_else(|| ClientError::BadCa {
                path: PathBuf::new(),
                reason: "https needs ca_file".into(),
            })?;
            let roots = load_roots(ca)?;
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ClientError::Transport {
                    what: "TLS setup",
                    reason: e.to_string(),
                })?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let name =
                ServerName::try_from(server.host.clone()).map_err(|e| ClientError::BadUrl {
                    url: server.host.clone(),
                    reason: e.to_string(),
                })?;
            Some((TlsConnector::from(Arc::new(config)), name))
        } else {
            None
        };
        Ok(Self {
            server,
            tls,
            token_file,
            timeout,
        })
    }

    /// Builds the client a [`KubernetesDiscovery`] section describes.
    pub fn from_config(config: &KubernetesDiscovery) -> Result<Self, ClientError> {
        let server = match &config.api_server {
            Some(url) => ApiServer::parse(url)?,
            None => ApiServer::in_cluster()?,
        };
        let token_file = config.token_file.clone().filter(|p| p.exists());
        Self::new(
            server,
            config.ca_file.as_deref(),
            token_file,
            Duration::from_millis(config.request_timeout_ms),
        )
    }

    fn token(&self) -> Result<Option<String>, ClientError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let token = std::fs::read_to_string(path).map_err(|source| ClientError::File {
            path: path.clone(),
            source,
        })?;
        Ok(Some(token.trim().to_string()))
    }

    /// Sends `GET path` and returns the response head once it arrives (the body streams).
    pub async fn get(&self, path: &str) -> Result<Response<Incoming>, ClientError> {
        let mut request = Request::get(path)
            .header(hyper::header::HOST, self.server.authority())
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, "kvroute-control-plane");
        if let Some(token) = self.token()? {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| transport("building request")(&e))?;
        let connect = async {
            let tcp = TcpStream::connect((self.server.host.as_str(), self.server.port))
                .await
                .map_err(|e| transport("connect")(&e))?;
            let _ = tcp.set_nodelay(true);
            match &self.tls {
                Some((connector, name)) => {
                    let stream = connector
                        .connect(name.clone(), tcp)
                        .await
                        .map_err(|e| transport("TLS handshake")(&e))?;
                    self.send(TokioIo::new(stream), request).await
                }
                None => self.send(TokioIo::new(tcp), request).await,
            }
        };
        tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| ClientError::Timeout("API request"))?
    }

    async fn send<T>(
        &self,
        io: TokioIo<T>,
        request: Request<Empty<Bytes>>,
    ) -> Result<Response<Incoming>, ClientError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| transport("HTTP handshake")(&e))?;
        // The connection task ends when the response body is finished or dropped.
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "API server connection closed");
            }
        });
        sender
            .send_request(request)
            .await
            .map_err(|e| transport("HTTP request")(&e))
    }

    /// `GET path`, the whole body, which must be 200.
    pub async fn get_bytes(&self, path: &str) -> Result<Bytes, ClientError> {
        let response = self.get(path).await?;
        let status = response.status();
        let body = tokio::time::timeout(
            self.timeout,
            Limited::new(response.into_body(), MAX_LIST_BYTES).collect(),
        )
        .await
        .map_err(|_| ClientError::Timeout("API response body"))?
        .map_err(|e| ClientError::Transport {
            what: "reading body",
            reason: e.to_string(),
        })?
        .to_bytes();
        if status != StatusCode::OK {
            return Err(ClientError::Status {
                path: path.to_string(),
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
            });
        }
        Ok(body)
    }

    /// Lists the pods `selector` selects in `namespace`.
    pub async fn list_pods(
        &self,
        namespace: &str,
        selector: &LabelSelector,
    ) -> Result<PodList, ClientError> {
        let path = format!(
            "/api/v1/namespaces/{}/pods?labelSelector={}",
            encode_query_value(namespace),
            encode_query_value(&selector.to_query())
        );
        Ok(PodList::from_json(&self.get_bytes(&path).await?)?)
    }

    /// Reads an InferencePool.
    pub async fn get_pool(
        &self,
        namespace: &str,
        pool: &InferencePoolRef,
    ) -> Result<InferencePool, ClientError> {
        let path = format!(
            "/apis/{}/namespaces/{}/inferencepools/{}",
            pool.api_version,
            encode_query_value(namespace),
            encode_query_value(&pool.name)
        );
        Ok(InferencePool::from_json(&self.get_bytes(&path).await?)?)
    }

    /// Opens a pod watch from `resource_version`; the server ends it after `timeout_s`.
    pub async fn watch_pods(
        &self,
        namespace: &str,
        selector: &LabelSelector,
        resource_version: &str,
        timeout_s: u64,
    ) -> Result<Incoming, ClientError> {
        let path = format!(
            "/api/v1/namespaces/{}/pods?labelSelector={}&watch=1&allowWatchBookmarks=true&resourceVersion={}&timeoutSeconds={timeout_s}",
            encode_query_value(namespace),
            encode_query_value(&selector.to_query()),
            encode_query_value(resource_version),
        );
        let response = self.get(&path).await?;
        if response.status() != StatusCode::OK {
            let status = response.status().as_u16();
            let body = Limited::new(response.into_body(), 4096)
                .collect()
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            if status == 410 {
                return Err(KubeError::Gone(body).into());
            }
            return Err(ClientError::Status { path, status, body });
        }
        Ok(response.into_body())
    }
}

/// The namespace to watch: configured, else the pod's own, else `default`.
pub fn namespace(config: &KubernetesDiscovery) -> String {
    if let Some(ns) = &config.namespace {
        return ns.clone();
    }
    std::fs::read_to_string(Path::new(super::SERVICE_ACCOUNT_DIR).join("namespace"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into())
}

/// How one watch request ended.
#[derive(Debug)]
enum WatchEnd {
    /// The server closed it normally (timeoutSeconds): watch again from the last version.
    Closed,
}

/// Follows one watch response until it ends, applying events and publishing changes.
async fn follow_watch(
    mut body: Incoming,
    tracker: &mut PodTracker,
    tx: &watch::Sender<Option<DiscoveredEndpoints>>,
    idle_timeout: Duration,
) -> Result<WatchEnd, ClientError> {
    let mut decoder = LineDecoder::new(MAX_EVENT_BYTES);
    let apply = |line: &[u8], tracker: &mut PodTracker| -> Result<(), ClientError> {
        let event = WatchEvent::from_json(line)?;
        if tracker.apply(event)? == Applied::Changed {
            let set = tracker.endpoints();
            let count = set.len();
            if publish(tx, set) {
                tracing::info!(
                    endpoints = count,
                    "Kubernetes discovery: endpoint set changed"
                );
            }
        }
        Ok(())
    };
    loop {
        let frame = tokio::time::timeout(idle_timeout, body.frame())
            .await
            .map_err(|_| ClientError::Timeout("watch (no data)"))?;
        match frame {
            None => {
                if let Some(line) = decoder.finish() {
                    apply(&line, tracker)?;
                }
                return Ok(WatchEnd::Closed);
            }
            Some(Err(e)) => return Err(transport("watch stream")(&e)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    for line in decoder.push(&data)? {
                        apply(&line, tracker)?;
                    }
                }
            }
        }
    }
}

/// One list+watch session: returns when a relist is needed (error, Gone, or pool refresh).
async fn session(
    client: &ApiClient,
    config: &KubernetesDiscovery,
    namespace: &str,
    tx: &watch::Sender<Option<DiscoveredEndpoints>>,
    backoff: &mut Backoff,
) -> Result<(), ClientError> {
    let (selector, port) = match (&config.inference_pool, &config.selector) {
        (Some(pool_ref), _) => {
            let pool = client.get_pool(namespace, pool_ref).await?;
            (pool.selector, config.port.unwrap_or(pool.target_port))
        }
        (None, Some(selector)) => (selector.clone(), config.port.unwrap_or_default()),
        (None, None) => {
            return Err(ClientError::Kube(KubeError::BadSelector(
                "neither selector nor inference_pool".into(),
            )));
        }
    };
    let list = client.list_pods(namespace, &selector).await?;
    let mut tracker = PodTracker::new(selector.clone(), config.template(port));
    tracker.reset(list);
    let set = tracker.endpoints();
    tracing::info!(
        namespace,
        selector = %selector.to_query(),
        pods = tracker.pod_names().len(),
        ready = set.len(),
        resource_version = tracker.resource_version(),
        "Kubernetes discovery: listed pods"
    );
    publish(tx, set);
    backoff.reset();
    let idle = Duration::from_secs(config.watch_timeout_s) + WATCH_GRACE;
    loop {
        let body = client
            .watch_pods(
                namespace,
                &selector,
                tracker.resource_version(),
                config.watch_timeout_s,
            )
            .await?;
        match follow_watch(body, &mut tracker, tx, idle).await? {
            WatchEnd::Closed if config.inference_pool.is_some() => {
                // Re-read the pool now and then: its selector or port may have changed.
                return Ok(());
            }
            WatchEnd::Closed => continue,
        }
    }
}

/// Runs Kubernetes discovery until dropped.
pub async fn run(config: KubernetesDiscovery, tx: watch::Sender<Option<DiscoveredEndpoints>>) {
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    let namespace = namespace(&config);
    let client = loop {
        match ApiClient::from_config(&config) {
            Ok(c) => break c,
            Err(e) => {
                tracing::error!(error = %e, "Kubernetes discovery cannot start; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    };
    loop {
        match session(&client, &config, &namespace, &tx, &mut backoff).await {
            Ok(()) => {}
            Err(ClientError::Kube(KubeError::Gone(why))) => {
                tracing::info!(%why, "Kubernetes watch expired; listing again");
            }
            Err(e) => {
                let wait = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?wait, "Kubernetes discovery failed; keeping the last endpoint set");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    const POD_LIST: &str = include_str!("testdata/podlist.json");
    const WATCH_CHURN: &str = include_str!("testdata/watch-churn.jsonl");
    const POOL_V1: &str = include_str!("testdata/inferencepool-v1.json");

    #[test]
    fn urls_parse_strictly() {
        let s = ApiServer::parse("https://10.96.0.1:443").unwrap();
        assert_eq!((s.tls, s.host.as_str(), s.port), (true, "10.96.0.1", 443));
        let s = ApiServer::parse("http://127.0.0.1:8001/").unwrap();
        assert_eq!((s.tls, s.port), (false, 8001));
        assert_eq!(
            ApiServer::parse("https://kubernetes.default.svc")
                .unwrap()
                .port,
            443
        );
        let v6 = ApiServer::parse("https://[fd00::1]:6443").unwrap();
        assert_eq!(
            (v6.host.as_str(), v6.authority()),
            ("fd00::1", "[fd00::1]:6443".into())
        );
        for bad in ["ftp://x", "x:80", "https://h:1/api", "not a url"] {
            assert!(ApiServer::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            encode_query_value("app=vllm,tier in (a,b),!canary"),
            "app%3Dvllm%2Ctier%20in%20%28a%2Cb%29%2C%21canary"
        );
        assert_eq!(encode_query_value("a-b_c.d~"), "a-b_c.d~");
    }

    #[test]
    fn https_needs_a_readable_ca() {
        let server = ApiServer::parse("https://127.0.0.1:6443").unwrap();
        let t = Duration::from_secs(1);
        let e = ApiClient::new(server.clone(), None, None, t).unwrap_err();
        assert!(e.to_string().contains("ca_file"), "{e}");
        let e = ApiClient::new(
            server.clone(),
            Some(Path::new("/nonexistent/ca.crt")),
            None,
            t,
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
        let dir = std::env::temp_dir().join(format!("kvroute-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let not_pem = dir.join("ca.crt");
        std::fs::write(&not_pem, "hello").unwrap();
        let e = ApiClient::new(server, Some(&not_pem), None, t).unwrap_err();
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tls_fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/discovery/testdata/tls")
            .join(name)
    }

    /// An https API server on 127.0.0.1 with a certificate from the test CA; answers every
    /// request with the recorded PodList and reports the Authorization header it saw.
    async fn tls_api_server() -> (u16, tokio::sync::mpsc::Receiver<Option<String>>) {
        use rustls::pki_types::PrivateKeyDer;
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(tls_fixture("server.crt"))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
        let key = PrivateKeyDer::from_pem_file(tls_fixture("server.key")).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (seen_tx, seen_rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, seen_tx) = (acceptor.clone(), seen_tx.clone());
                tokio::spawn(async move {
                    // A client that rejects the certificate makes this fail: nothing to answer.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Some(head) = read_head(&mut tls).await else {
                        return;
                    };
                    let auth = authorization(&head);
                    let _ = seen_tx.send(auth).await;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{POD_LIST}",
                        POD_LIST.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (port, seen_rx)
    }

    /// The in-cluster path: https with the cluster CA and a bearer token; a server whose
    /// certificate another CA signed is refused.
    #[tokio::test]
    async fn https_with_the_cluster_ca() {
        let (port, mut seen) = tls_api_server().await;
        let dir = std::env::temp_dir().join(format!("kvroute-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "projected-token\n").unwrap();
        let server = ApiServer::parse(&format!("https://127.0.0.1:{port}")).unwrap();
        let client = ApiClient::new(
            server.clone(),
            Some(&tls_fixture("ca.crt")),
            Some(token.clone()),
            Duration::from_secs(5),
        )
        .unwrap();
        let selector =
            LabelSelector::from_labels([("app".to_string(), "vllm-llama3".to_string())].into());
        let list = client.list_pods("llm", &selector).await.unwrap();
        assert_eq!(list.items.len(), 5);
        assert_eq!(
            seen.recv().await.flatten().as_deref(),
            Some("Bearer projected-token")
        );
        // A rotated token is picked up without a restart.
        std::fs::write(&token, "rotated-token").unwrap();
        client.list_pods("llm", &selector).await.unwrap();
        assert_eq!(
            seen.recv().await.flatten().as_deref(),
            Some("Bearer rotated-token")
        );

        let wrong = ApiClient::new(
            server,
            Some(&tls_fixture("other-ca.crt")),
            Some(token),
            Duration::from_secs(5),
        )
        .unwrap();
        let e = wrong.list_pods("llm", &selector).await.unwrap_err();
        assert!(e.to_string().contains("TLS handshake"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// What the fake API server answers, in order, and what it saw.
    #[derive(Default)]
    struct Script {
        /// (path prefix, status, body chunks with a pause before each).
        answers: VecDeque<(String, u16, Vec<String>)>,
        seen: Vec<(String, Option<String>)>,
    }

    /// Reads a request up to the end of its head, as the fake API servers do; `None` when the
    /// client goes away first.
    async fn read_head(conn: &mut (impl tokio::io::AsyncRead + Unpin)) -> Option<String> {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        Some(String::from_utf8_lossy(&head).into_owned())
    }

    /// The `authorization` header of a request head, if sent.
    fn authorization(head: &str) -> Option<String> {
        head.lines()
            .find_map(|l| l.strip_prefix("authorization: "))
            .map(str::to_string)
    }

    /// A fake API server on 127.0.0.1: answers scripted requests (chunked), records requests.
    async fn fake_api_server(script: Arc<Mutex<Script>>) -> (String, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                let script = script.clone();
                tokio::spawn(async move {
                    let Some(head) = read_head(&mut sock).await else {
                        return;
                    };
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    let auth = authorization(&head);
                    let answer = {
                        let mut s = script.lock().unwrap();
                        s.seen.push((path.clone(), auth));
                        match s.answers.front() {
                            Some((prefix, _, _)) if path.starts_with(prefix.as_str()) => {
                                s.answers.pop_front()
                            }
                            _ => None,
                        }
                    };
                    let (status, chunks) = match answer {
                        Some((_, status, chunks)) => (status, chunks),
                        // Unscripted: behave like a server that is going away.
                        None => (503, vec!["{}".to_string()]),
                    };
                    let reason = if status == 200 { "OK" } else { "Error" };
                    let head = format!(
                        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
                    );
                    if sock.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    for chunk in chunks {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
                        if sock.write_all(framed.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    let _ = sock.write_all(b"0\r\n\r\n").await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        (url, task)
    }

    fn watch_chunks(text: &str) -> Vec<String> {
        // Split mid-line too, as a real chunked stream may.
        let bytes = text.as_bytes();
        bytes
            .chunks(1000)
            .map(|c| String::from_utf8(c.to_vec()).unwrap())
            .collect()
    }

    async fn next_set(rx: &mut watch::Receiver<Option<DiscoveredEndpoints>>) -> Vec<String> {
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .expect("discovery published in time")
            .expect("sender alive");
        rx.borrow_and_update()
            .as_ref()
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// List, a watch with churn that ends in 410 Gone, a relist with the new world, and a
    /// bearer token on every request.
    #[tokio::test]
    async fn list_watch_churn_gone_relist() {
        let after_churn = {
            let mut list: serde_json::Value = serde_json::from_str(POD_LIST).unwrap();
            let items = list["items"].as_array_mut().unwrap();
            // Relist: vllm-0 with its new IP, vllm-1 gone from the pool, vllm-2 ready, and
            // vllm-3 (pending before) now running and ready: only the relist can show it.
            items[0]["status"]["podIP"] = "10.244.1.23".into();
            items.remove(1);
            items[1]["status"]["conditions"][2]["status"] = "True".into();
            items[2]["status"]["phase"] = "Running".into();
            items[2]["status"]["podIP"] = "10.244.4.2".into();
            items[2]["status"]["conditions"][2]["status"] = "True".into();
            list["metadata"]["resourceVersion"] = "4800".into();
            list.to_string()
        };
        let script = Arc::new(Mutex::new(Script {
            answers: VecDeque::from(vec![
                (
                    "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm-llama3".to_string(),
                    200,
                    vec![POD_LIST.to_string()],
                ),
                (
                    "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm-llama3&watch=1".into(),
                    200,
                    watch_chunks(WATCH_CHURN),
                ),
                (
                    "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm-llama3".into(),
                    200,
                    vec![after_churn],
                ),
            ]),
            seen: Vec::new(),
        }));
        let (url, server) = fake_api_server(script.clone()).await;
        let dir = std::env::temp_dir().join(format!("kvroute-kube-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "test-token\n").unwrap();
        let config = KubernetesDiscovery {
            namespace: Some("llm".into()),
            selector: Some(LabelSelector::from_labels(
                [("app".to_string(), "vllm-llama3".to_string())].into(),
            )),
            inference_pool: None,
            port: Some(8000),
            kv_events_port: Some(5557),
            kv_events_replay_port: None,
            model: None,
            data_parallel_size: None,
            api_server: Some(url),
            token_file: Some(token),
            ca_file: None,
            watch_timeout_s: 60,
            request_timeout_ms: 2000,
        };
        let (tx, mut rx) = watch::channel(None);
        let task = tokio::spawn(run(config, tx));
        let mut history = Vec::new();
        loop {
            let set = next_set(&mut rx).await;
            let done = set == ["10.244.1.23:8000", "10.244.3.4:8000", "10.244.4.2:8000"];
            history.push(set.join(" "));
            if done {
                break;
            }
        }
        task.abort();
        server.abort();
        // A watch channel only keeps the latest value, so fast changes may coalesce; the first
        // list and the final state are always observed.
        assert_eq!(
            history.first().map(String::as_str),
            Some("10.244.1.17:8000 10.244.2.9:8000")
        );
        let seen = script.lock().unwrap().seen.clone();
        assert!(seen.len() >= 3, "{seen:?}");
        assert!(
            seen[1].0.contains(
                "&watch=1&allowWatchBookmarks=true&resourceVersion=4711&timeoutSeconds=60"
            ),
            "{seen:?}"
        );
        assert!(!seen[2].0.contains("watch=1"), "relist after 410: {seen:?}");
        assert!(
            seen.iter()
                .all(|(_, auth)| auth.as_deref() == Some("Bearer test-token")),
            "{seen:?}"
        );
        let last = rx.borrow().clone().unwrap();
        assert_eq!(
            last["10.244.1.23:8000"].kv_events.as_deref(),
            Some("tcp://10.244.1.23:5557")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The pool's selector and port drive the pod list; API errors keep the last set and retry.
    #[tokio::test]
    async fn inference_pool_and_error_retry() {
        let script = Arc::new(Mutex::new(Script {
            answers: VecDeque::from(vec![
                (
                    "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/vllm-llama3"
                        .to_string(),
                    200,
                    vec![POOL_V1.to_string()],
                ),
                (
                    "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm-llama3".into(),
                    200,
                    vec![POD_LIST.to_string()],
                ),
                (
                    "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm-llama3&watch=1".into(),
                    500,
                    vec![r#"{"kind":"Status","code":500,"message":"etcd unavailable"}"#.into()],
                ),
                (
                    "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/vllm-llama3"
                        .to_string(),
                    200,
                    vec![POOL_V1.replace("8000", "8100")],
                ),
                (
                    "/api/v1/namespaces/llm/pods?labelSelector=app%3Dvllm-llama3".into(),
                    200,
                    vec![POD_LIST.to_string()],
                ),
            ]),
            seen: Vec::new(),
        }));
        let (url, server) = fake_api_server(script.clone()).await;
        let config = KubernetesDiscovery {
            namespace: Some("llm".into()),
            selector: None,
            inference_pool: Some(InferencePoolRef {
                name: "vllm-llama3".into(),
                api_version: "inference.networking.k8s.io/v1".into(),
            }),
            port: None,
            kv_events_port: None,
            kv_events_replay_port: None,
            model: None,
            data_parallel_size: None,
            api_server: Some(url),
            token_file: None,
            ca_file: None,
            watch_timeout_s: 60,
            request_timeout_ms: 2000,
        };
        let (tx, mut rx) = watch::channel(None);
        let task = tokio::spawn(run(config, tx));
        assert_eq!(
            next_set(&mut rx).await,
            vec!["10.244.1.17:8000", "10.244.2.9:8000"]
        );
        // After the failed watch and a backoff, the pool now says port 8100.
        assert_eq!(
            next_set(&mut rx).await,
            vec!["10.244.1.17:8100", "10.244.2.9:8100"]
        );
        task.abort();
        server.abort();
        let seen = script.lock().unwrap().seen.clone();
        assert!(seen.iter().all(|(_, auth)| auth.is_none()), "{seen:?}");
    }
}
