//! Tokenisation by a replica: vLLM's render API (`/v1/chat/completions/render`,
//! `/v1/completions/render` -> `token_ids`) or its `/tokenize` API (-> `tokens`).
//!
//! The replica applies its own chat template and tokenizer, so the ids are exactly what it will
//! compute for the request. Each call goes to the next healthy endpoint in turn, within a short
//! deadline; whole prompts are cached by content hash (a retried or repeated prompt costs
//! nothing; a new chat turn is a new prompt, which only the in-process backend can split).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use scorer_core::protocol::ApiKind;
use scorer_core::router::Health;
use serde_json::{Map, Value};

use super::TokenizeError;
use super::kept::KeptPrompt;
use crate::config::RemoteApi;
use crate::state::State;

/// Largest tokenisation answer read (4 MiB of JSON is about a million token ids).
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// A client of the replicas' tokenisation API.
#[derive(Debug)]
pub struct RemoteTokenizer {
    api: RemoteApi,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
    next: AtomicUsize,
}

impl RemoteTokenizer {
    /// A client calling `api` with `timeout` per call.
    pub fn new(api: RemoteApi, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Self {
            api,
            timeout,
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector),
            next: AtomicUsize::new(0),
        }
    }

    /// Token ids of `prompt` (the request's prompt fields) as a healthy replica computes them.
    pub async fn tokenize(
        &self,
        state: &State,
        api: ApiKind,
        prompt: &Map<String, Value>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let ready: Vec<String> = state
            .endpoints()
            .into_iter()
            .filter(|e| e.health == Health::Ready)
            .map(|e| e.address)
            .collect();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        self.ask(&ready, first, api, prompt).await
    }

    /// Token ids of a kept prompt as the replica at `address` renders it (whatever this
    /// client's API: the diagnosis of `/debug/mismatch` asks the replica that served).
    pub async fn render_at(
        &self,
        address: &str,
        kept: &KeptPrompt,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.ask(&[address.to_owned()], 0, kept.api, &kept.prompt)
            .await
    }

    /// Asks `addresses` in turn from the `first`th, at most two of them (a replica that refuses
    /// or fails is not the prompt's fault: one more is tried), all within the timeout.
    async fn ask(
        &self,
        addresses: &[String],
        first: usize,
        api: ApiKind,
        prompt: &Map<String, Value>,
    ) -> Result<Vec<u32>, TokenizeError> {
        if addresses.is_empty() {
            return Err(TokenizeError::NoEndpoint);
        }
        let (path, body) = self.encoded_request(api, prompt)?;
        let attempts = async {
            let mut last = TokenizeError::NoEndpoint;
            for i in 0..addresses.len().min(2) {
                let address = &addresses[(first + i) % addresses.len()];
                match self.call(address, path, body.clone()).await {
                    Ok(ids) => return Ok(ids),
                    Err(e) => last = e,
                }
            }
            Err(last)
        };
        tokio::time::timeout(self.timeout, attempts)
            .await
            .map_err(|_| TokenizeError::Timeout(self.timeout))?
    }

    /// One tokenisation call to `address` (a data-parallel rank's server answers for it: the
    /// tokenizer is the API server's).
    async fn call(
        &self,
        address: &str,
        path: &str,
        body: Bytes,
    ) -> Result<Vec<u32>, TokenizeError> {
        let address = scorer_core::address::split_rank(address).0;
        let request = Request::post(format!("http://{address}{path}"))
            .header(HOST, address)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| TokenizeError::Http(e.to_string()))?;
        let response = self.client.request(request).await.map_err(|e| {
            TokenizeError::Http(format!("{address}: {}", crate::scrape::error_chain(&e)))
        })?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| TokenizeError::Http(format!("{address}: reading body: {e}")))?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            return Err(TokenizeError::Status {
                endpoint: address.to_string(),
                status: status.as_u16(),
                body: text,
            });
        }
        parse_ids(&bytes)
    }

    /// [`RemoteTokenizer::request`] with the body encoded, as every call sends it.
    fn encoded_request(
        &self,
        api: ApiKind,
        prompt: &Map<String, Value>,
    ) -> Result<(&'static str, Bytes), TokenizeError> {
        let (path, body) = self.request(api, prompt);
        let body =
            serde_json::to_vec(&body).map_err(|e| TokenizeError::BadPrompt(e.to_string()))?;
        Ok((path, Bytes::from(body)))
    }

    /// Path and body of the call for `api`.
    fn request(&self, api: ApiKind, prompt: &Map<String, Value>) -> (&'static str, Value) {
        let mut body = Map::new();
        for f in api.prompt_fields() {
            if let Some(v) = prompt.get(*f) {
                body.insert((*f).to_string(), v.clone());
            }
        }
        let path = match (self.api, api) {
            (RemoteApi::Render, ApiKind::Chat) => "/v1/chat/completions/render",
            (RemoteApi::Render, ApiKind::Completion) => "/v1/completions/render",
            // vLLM 0.33's own render paths; not called: `Precise::tokenize` sends these APIs as
            // the chat request vLLM makes of them (`vllm_wire::agent_chat`).
            (RemoteApi::Render, ApiKind::Responses) => "/v1/responses/render",
            (RemoteApi::Render, ApiKind::Messages) => "/v1/messages/render",
            (RemoteApi::Tokenize, _) => "/tokenize",
        };
        (path, Value::Object(body))
    }
}

/// Token ids from a render answer (`{"token_ids"}` or a list of them, vLLM renders completion
/// prompts as a list) or a tokenize answer (`{"tokens"}`).
pub fn parse_ids(bytes: &[u8]) -> Result<Vec<u32>, TokenizeError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| TokenizeError::BadResponse(format!("not JSON: {e}")))?;
    let obj = match &v {
        Value::Array(items) => match items.as_slice() {
            [one] => one,
            _ => {
                return Err(TokenizeError::BadResponse(format!(
                    "expected one rendered prompt, got {}",
                    items.len()
                )));
            }
        },
        other => other,
    };
    let ids = obj
        .get("token_ids")
        .or_else(|| obj.get("tokens"))
        .and_then(Value::as_array)
        .ok_or_else(|| TokenizeError::BadResponse("no token_ids or tokens array".into()))?;
    ids.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| TokenizeError::BadResponse(format!("token id {t} is not a u32")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_of_every_shape() {
        assert_eq!(
            parse_ids(br#"{"token_ids":[1,2,3],"model":"m"}"#).unwrap(),
            vec![1, 2, 3]
        );
        assert_eq!(parse_ids(br#"[{"token_ids":[4]}]"#).unwrap(), vec![4]);
        assert_eq!(parse_ids(br#"{"count":1,"tokens":[5]}"#).unwrap(), vec![5]);
        for bad in [
            &b"nope"[..],
            br#"{"tokens":"x"}"#,
            br#"{"token_ids":[-1]}"#,
            br#"{"token_ids":[4294967296]}"#,
            br#"[]"#,
            br#"[{"token_ids":[1]},{"token_ids":[2]}]"#,
            br#"{}"#,
        ] {
            assert!(parse_ids(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// Serves `answer` to every POST on 127.0.0.1 (port chosen by the OS).
    async fn fake_replica(status: u16, answer: &'static str, delay: Duration) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let app = axum::Router::new().fallback(move || async move {
            tokio::time::sleep(delay).await;
            (axum::http::StatusCode::from_u16(status).unwrap(), answer)
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        address
    }

    #[tokio::test]
    async fn a_failing_replica_is_skipped_and_a_hung_one_times_out() {
        let bad = fake_replica(404, r#"{"error":"no such model"}"#, Duration::ZERO).await;
        let good = fake_replica(200, r#"{"token_ids":[7,8,9]}"#, Duration::ZERO).await;
        let state = State::new(Default::default(), &[bad.clone(), good], 4, 1).unwrap();
        let t = RemoteTokenizer::new(RemoteApi::Render, Duration::from_secs(5));
        let prompt: Map<String, Value> =
            serde_json::from_str(r#"{"model":"m","messages":[]}"#).unwrap();
        for _ in 0..3 {
            assert_eq!(
                t.tokenize(&state, ApiKind::Chat, &prompt).await.unwrap(),
                vec![7, 8, 9]
            );
        }
        let only_bad = State::new(Default::default(), &[bad], 4, 1).unwrap();
        let e = t
            .tokenize(&only_bad, ApiKind::Chat, &prompt)
            .await
            .unwrap_err();
        assert!(
            matches!(e, TokenizeError::Status { status: 404, .. }),
            "{e}"
        );

        let hung = fake_replica(200, "{}", Duration::from_secs(30)).await;
        let state = State::new(Default::default(), &[hung], 4, 1).unwrap();
        let t = RemoteTokenizer::new(RemoteApi::Render, Duration::from_millis(100));
        let started = std::time::Instant::now();
        let e = t
            .tokenize(&state, ApiKind::Chat, &prompt)
            .await
            .unwrap_err();
        assert!(matches!(e, TokenizeError::Timeout(_)), "{e}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn request_keeps_only_prompt_fields() {
        let t = RemoteTokenizer::new(RemoteApi::Render, Duration::from_millis(10));
        let prompt: Map<String, Value> = serde_json::from_str(
            r#"{"model":"m","messages":[],"tools":[],"temperature":1,"chat_template_kwargs":{"a":1}}"#,
        )
        .unwrap();
        let (path, body) = t.request(ApiKind::Chat, &prompt);
        assert_eq!(path, "/v1/chat/completions/render");
        assert_eq!(body.as_object().unwrap().len(), 4);
        assert!(body.get("temperature").is_none());
        let t = RemoteTokenizer::new(RemoteApi::Tokenize, Duration::from_millis(10));
        let (path, body) = t.request(ApiKind::Completion, &prompt);
        assert_eq!((path, body.as_object().unwrap().len()), ("/tokenize", 1));
    }
}
