//! Endpoint Picker mode: the control plane as the picker of a Gateway API Inference Extension
//! `InferencePool` (`endpointPickerRef`), speaking Envoy's `ext_proc` gRPC protocol, for
//! gateways that route an InferencePool through a picker or cannot load wasm.
//!
//! Each `Process` stream is one HTTP request. It is driven by the filter's own request state
//! machine (`kvroute_filter::machine`), so both forms strip the same headers, read the same
//! bodies and make the same decisions: where the wasm host would call `POST /v1/route`, this
//! host calls the same [`State::route`] in process (after the same precise-mode tokenisation),
//! and where it would batch an outcome, this one feeds it back when the stream ends.
//!
//! The answer follows the Endpoint Picker Protocol: the chosen `ip:port` list (primary first,
//! then fallbacks) in the `x-gateway-destination-endpoint` request header and in dynamic
//! metadata `envoy.lb` / `x-gateway-destination-endpoint`, which Envoy's `override_host`
//! load balancer reads; a refused request is answered by the gateway with the picker's status
//! (429, 413, 404) through an `ImmediateResponse`. Body modes: `FULL_DUPLEX_STREAMED` (what
//! conformant gateways use: the picker holds the headers, takes the whole body, then answers
//! headers and body) and `BUFFERED`; with any other mode a request passes unrouted (the
//! gateway's fallback policy picks). When the picker fails or is unreachable, the gateway's
//! `failure_mode_allow` decides, as for any picker.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use futures_util::Stream;
use kvroute_filter::config::FilterConfig;
use kvroute_filter::machine::{Action, BodyStep, Effect, RequestMachine, Step};
use scorer_core::protocol::{FeedbackBatch, RouteRequest};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::state::State;
use crate::tokenize::Precise;

/// The namespace of the dynamic metadata Envoy's `override_host` reads the destination from.
pub const METADATA_NAMESPACE: &str = "envoy.lb";
/// The key of the destination list, in the header and in the metadata alike.
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";

/// The `picker:` section of the control plane's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickerConfig {
    /// Where the ext_proc gRPC service listens (GIE's pickers use 9002; kvroute's API has it,
    /// so 9004 by default).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The filter configuration the picker reads requests with: the same JSON object as the
    /// wasm plugin's (`routes`, `max_body_bytes`, `identity_headers`, `destination_header`, ...);
    /// `{}` is the filter's defaults. Its control-plane keys (cluster, timeouts, token) are
    /// unused here.
    #[serde(default = "empty_object")]
    pub filter: serde_json::Value,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9004))
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

impl PickerConfig {
    /// The filter configuration the picker's request machines share.
    pub fn filter_config(&self) -> Result<FilterConfig, kvroute_filter::config::ConfigError> {
        FilterConfig::from_json(self.filter.to_string().as_bytes())
    }
}

/// The ext_proc service.
#[derive(Debug, Clone)]
pub struct Picker {
    state: Arc<State>,
    precise: Arc<Precise>,
    config: Arc<FilterConfig>,
    stored_response_wait: Duration,
}

impl Picker {
    /// A picker deciding with `state` (and `precise` for precise routes); a request naming a
    /// stored response nobody has reported yet waits up to `stored_response_wait` for it.
    pub fn new(
        state: Arc<State>,
        precise: Arc<Precise>,
        config: FilterConfig,
        stored_response_wait: Duration,
    ) -> Self {
        Picker {
            state,
            precise,
            config: Arc::new(config),
            stored_response_wait,
        }
    }

    /// Serves the picker on `listener` until `stop` turns true.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), tonic::transport::Error> {
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(self))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let exchange = Exchange::new(self.clone(), tx);
        tokio::spawn(exchange.run(inbound));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// How the gateway sends this request's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyMode {
    /// The headers wait for the picker's answer while the body streams in: hold the answer
    /// until the body is complete, then send headers and the body back.
    FullDuplex,
    /// The headers go first (answered at once), then the whole body in one message.
    Buffered,
    /// No body reaches the picker, or it arrives in pieces that must each be answered before
    /// the decision: the request passes unrouted.
    Unrouted,
}

impl BodyMode {
    fn of(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            Ok(BodySendMode::Buffered) => BodyMode::Buffered,
            _ => BodyMode::Unrouted,
        }
    }
}

/// One `Process` stream: one HTTP request through the gateway.
struct Exchange {
    picker: Picker,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    machine: RequestMachine,
    mode: BodyMode,
    response_mode: BodyMode,
    /// The request is held (headers unanswered in full-duplex mode, or the body awaited).
    holding: bool,
    /// Body bytes received so far (full-duplex and buffered modes).
    body: Vec<u8>,
    /// Header mutations decided at the headers (stripped routing headers), sent with the
    /// first answer that can carry them.
    pending_removals: Vec<String>,
}

impl Exchange {
    fn new(picker: Picker, tx: mpsc::Sender<Result<ProcessingResponse, Status>>) -> Self {
        let machine = RequestMachine::new(picker.config.clone());
        Exchange {
            picker,
            tx,
            machine,
            mode: BodyMode::Unrouted,
            response_mode: BodyMode::Unrouted,
            holding: false,
            body: Vec::new(),
            pending_removals: Vec::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.picker.state.now_ms()
    }

    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let message = match inbound.message().await {
                Ok(Some(m)) => m,
                // The gateway closed the stream (the request ended) or it broke: report it.
                Ok(None) | Err(_) => break,
            };
            if let Some(config) = &message.protocol_config {
                self.mode = BodyMode::of(config.request_body_mode);
                self.response_mode = BodyMode::of(config.response_body_mode);
            }
            let Some(request) = message.request else {
                continue;
            };
            let answered = match request {
                processing_request::Request::RequestHeaders(h) => self.request_headers(h).await,
                processing_request::Request::RequestBody(b) => self.request_body(b).await,
                processing_request::Request::RequestTrailers(_) => {
                    // A body that ended with trailers: complete it, then let the trailers pass.
                    let mut ok = true;
                    if self.holding {
                        ok = self.body_complete(false).await;
                    }
                    ok && self
                        .send(processing_response::Response::RequestTrailers(
                            Default::default(),
                        ))
                        .await
                }
                processing_request::Request::ResponseHeaders(h) => {
                    let status = header(&h, ":status").and_then(|s| s.parse().ok());
                    self.machine.on_response_headers(status, None);
                    // The explain header, when the client asked and the configuration allows.
                    let explain = self.machine.decision_header().map(|value| {
                        set_header((
                            kvroute_filter::machine::DECISION_HEADER.to_string(),
                            value.to_string(),
                        ))
                    });
                    let response = CommonResponse {
                        header_mutation: explain.map(|h| HeaderMutation {
                            set_headers: vec![h],
                            ..Default::default()
                        }),
                        ..Default::default()
                    };
                    self.send(processing_response::Response::ResponseHeaders(
                        HeadersResponse {
                            response: Some(response),
                        },
                    ))
                    .await
                }
                processing_request::Request::ResponseBody(b) => self.response_body(b).await,
                processing_request::Request::ResponseTrailers(_) => {
                    self.send(processing_response::Response::ResponseTrailers(
                        Default::default(),
                    ))
                    .await
                }
            };
            if !answered {
                break;
            }
        }
        self.finish();
    }

    /// The request ended: its outcome (or its withdrawal) goes back to the router.
    fn finish(&mut self) {
        let now = self.now_ms();
        if let Some(outcome) = self.machine.on_done(now) {
            self.picker.state.feedback(&FeedbackBatch {
                outcomes: vec![outcome],
                ..FeedbackBatch::default()
            });
        }
    }

    async fn request_headers(&mut self, h: HttpHeaders) -> bool {
        let pairs = header_pairs(&h);
        let now = self.now_ms();
        let step = self.machine.on_request_headers_with(
            pairs.iter().map(|(k, v)| (k.as_str(), v.as_slice())),
            h.end_of_stream,
            now,
            |_| None,
        );
        let step = self.carry_out(step).await;
        match step {
            Carried::Answered => true,
            Carried::Failed => false,
            Carried::Go(answer) => self.send_answer(answer, headers_reply).await,
            Carried::Hold(removals) => {
                if self.mode == BodyMode::Unrouted {
                    // No whole body will come: let the request go on, unrouted.
                    return self
                        .send_answer(Answer::removing(removals), headers_reply)
                        .await;
                }
                self.holding = true;
                if self.mode == BodyMode::Buffered {
                    // The body comes after the headers' answer; the decision rides on the
                    // body's answer.
                    return self
                        .send_answer(Answer::removing(removals), headers_reply)
                        .await;
                }
                self.pending_removals = removals;
                true
            }
        }
    }

    async fn request_body(&mut self, b: HttpBody) -> bool {
        if !self.holding {
            return self.pass_body(b, false).await;
        }
        if self.body.len() + b.body.len() > self.picker.config.max_body_bytes {
            // Too big to route: the machine fails open, the body goes on as it came.
            self.body.extend_from_slice(&b.body);
            self.holding = false;
            let step = match self.machine.on_request_body(self.body.len(), false) {
                BodyStep::Step(step) => step,
                BodyStep::ReadBody(_) => self.machine.on_body_read_failed(),
            };
            let answer = match self.carry_out(step).await.into_answer() {
                Ok(answer) => answer,
                Err(still_open) => return still_open,
            };
            return self.answer_body(answer, b.end_of_stream).await;
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return true;
        }
        self.body_complete(true).await
    }

    /// The whole body is in: decide, then answer (headers and body in full-duplex mode).
    async fn body_complete(&mut self, end_of_stream: bool) -> bool {
        self.holding = false;
        let size = self.body.len();
        let now = self.now_ms();
        let step = match self.machine.on_request_body(size, true) {
            BodyStep::Step(step) => step,
            BodyStep::ReadBody(_) => {
                let body = std::mem::take(&mut self.body);
                let step = self.machine.on_body_complete(&body, now);
                self.body = body;
                step
            }
        };
        let answer = match self.carry_out(step).await.into_answer() {
            Ok(answer) => answer,
            Err(still_open) => return still_open,
        };
        self.answer_body(answer, end_of_stream).await
    }

    /// Answers the held request: in full-duplex mode the headers (with the decision) and then
    /// the body; in buffered mode the body message carries the decision.
    async fn answer_body(&mut self, mut answer: Answer, end_of_stream: bool) -> bool {
        answer
            .removals
            .extend(std::mem::take(&mut self.pending_removals));
        let body = std::mem::take(&mut self.body);
        match self.mode {
            BodyMode::FullDuplex => {
                let metadata = answer.metadata();
                let headers = HeadersResponse {
                    response: Some(answer.common()),
                };
                if !self
                    .send_with(
                        processing_response::Response::RequestHeaders(headers),
                        metadata,
                    )
                    .await
                {
                    return false;
                }
                // The body goes back as it came, in chunks of at most 64 KiB (ext_proc's
                // recommended size; one message of a whole 4-MiB prompt may exceed the
                // gateway's gRPC message limit).
                let mut chunks: Vec<&[u8]> = body.chunks(STREAMED_CHUNK_BYTES).collect();
                if chunks.is_empty() {
                    chunks.push(&[]);
                }
                let last = chunks.len() - 1;
                for (i, chunk) in chunks.into_iter().enumerate() {
                    let streamed = streamed_body(chunk.to_vec(), end_of_stream && i == last);
                    if !self
                        .send(processing_response::Response::RequestBody(streamed))
                        .await
                    {
                        return false;
                    }
                }
                true
            }
            _ => self.send_answer(answer, body_reply).await,
        }
    }

    /// A body chunk of a request not being routed.
    async fn pass_body(&mut self, b: HttpBody, response: bool) -> bool {
        let mode = if response {
            self.response_mode
        } else {
            self.mode
        };
        let body = if mode == BodyMode::FullDuplex {
            // In full-duplex mode the picker must send every chunk back itself.
            streamed_body(b.body, b.end_of_stream)
        } else {
            BodyResponse {
                response: Some(CommonResponse::default()),
            }
        };
        self.send(if response {
            processing_response::Response::ResponseBody(body)
        } else {
            processing_response::Response::RequestBody(body)
        })
        .await
    }

    async fn response_body(&mut self, b: HttpBody) -> bool {
        let now = self.now_ms();
        // The picker decided in process, so it reports in process too: no tag to check.
        if let Some(first) = self.machine.on_response_body(&b.body, now) {
            self.picker.state.first_tokens(&[first]);
        }
        self.pass_body(b, true).await
    }

    /// Carries out a step's effects: header edits are collected for the answer, a route call
    /// is decided in process, a local response is sent as an `ImmediateResponse`.
    async fn carry_out(&mut self, step: Step) -> Carried {
        let mut step = step;
        let mut answer = Answer::default();
        loop {
            let mut dispatch = None;
            for effect in std::mem::take(&mut step.effects) {
                match effect {
                    Effect::RemoveRequestHeader(name) => answer.removals.push(name),
                    Effect::SetRequestHeader { name, value } => {
                        if name == self.picker.config.destination_header {
                            answer.destination = Some(value.clone());
                        }
                        answer.sets.push((name, value));
                    }
                    Effect::DispatchRoute { body } => dispatch = Some(body),
                    Effect::SendLocalResponse {
                        status,
                        headers,
                        body,
                    } => {
                        let immediate = ImmediateResponse {
                            status: Some(HttpStatus {
                                code: i32::from(status),
                            }),
                            headers: Some(HeaderMutation {
                                set_headers: headers.into_iter().map(set_header).collect(),
                                ..Default::default()
                            }),
                            body,
                            ..Default::default()
                        };
                        self.holding = false;
                        return if self
                            .send(processing_response::Response::ImmediateResponse(immediate))
                            .await
                        {
                            Carried::Answered
                        } else {
                            Carried::Failed
                        };
                    }
                    Effect::Withdraw(call_id) => {
                        self.picker.state.withdraw(&[call_id]);
                    }
                    // The picker decides in process: there is no copy to adopt into.
                    Effect::ResumeRequest
                    | Effect::Count(_)
                    | Effect::RouteLatencyMs(_)
                    | Effect::HashMicros(_)
                    | Effect::Adopt { .. } => {}
                }
            }
            if let Some(body) = dispatch {
                self.machine.on_dispatched();
                let decided = self.decide(&body).await;
                let now = self.now_ms();
                step = match decided {
                    Some(json) => self.machine.on_route_response(Some(200), &json, now),
                    None => self
                        .machine
                        .on_route_failure(kvroute_filter::machine::FailKind::BadResponse),
                };
                continue;
            }
            return match step.action {
                Action::Pause => Carried::Hold(answer.removals),
                Action::Continue => Carried::Go(answer),
            };
        }
    }

    /// The route call the wasm host would make, answered in process.
    async fn decide(&self, body: &[u8]) -> Option<Vec<u8>> {
        let mut request: RouteRequest = serde_json::from_slice(body).ok()?;
        let state = &self.picker.state;
        state
            .await_stored_response(&request, self.picker.stored_response_wait)
            .await;
        let response = self
            .picker
            .precise
            .route(state, &mut request, |r| {
                let started = std::time::Instant::now();
                let response = state.route(r);
                state.telemetry().observe_route(started.elapsed());
                response
            })
            .await;
        serde_json::to_vec(&response).ok()
    }

    /// Answers the headers or the body in progress (`reply` says which) with `answer`'s
    /// mutations and its `envoy.lb` metadata.
    async fn send_answer(
        &mut self,
        answer: Answer,
        reply: fn(CommonResponse) -> processing_response::Response,
    ) -> bool {
        let metadata = answer.metadata();
        self.send_with(reply(answer.common()), metadata).await
    }

    async fn send(&self, response: processing_response::Response) -> bool {
        self.send_with(response, None).await
    }

    async fn send_with(
        &self,
        response: processing_response::Response,
        dynamic_metadata: Option<Struct>,
    ) -> bool {
        let message = ProcessingResponse {
            response: Some(response),
            dynamic_metadata,
            ..Default::default()
        };
        // The gateway waits for each answer; one that cannot be sent in a few seconds means the
        // stream is gone.
        tokio::time::timeout(Duration::from_secs(5), self.tx.send(Ok(message)))
            .await
            .is_ok_and(|sent| sent.is_ok())
    }
}

/// What carrying out a step left for the answer (not to be confused with a request's
/// outcome report, which `finish` sends).
enum Carried {
    /// An `ImmediateResponse` was sent: the request is answered by the gateway.
    Answered,
    /// The stream is gone.
    Failed,
    /// Apply these edits and go on: routed when the answer has a destination, else passed
    /// through or failed open.
    Go(Answer),
    /// The machine waits for the body; these headers are stripped when the answer goes out.
    Hold(Vec<String>),
}

impl Carried {
    /// The answer to send once the body is in, or `Err(still_open)` when nothing is left to
    /// send (answered locally: the stream goes on; failed: it is gone).
    fn into_answer(self) -> Result<Answer, bool> {
        match self {
            Carried::Answered => Err(true),
            Carried::Failed => Err(false),
            Carried::Go(answer) => Ok(answer),
            Carried::Hold(removals) => Ok(Answer::removing(removals)),
        }
    }
}

/// Header edits and the destination for one answer.
#[derive(Debug, Default)]
struct Answer {
    removals: Vec<String>,
    sets: Vec<(String, String)>,
    destination: Option<String>,
}

impl Answer {
    fn removing(removals: Vec<String>) -> Self {
        Answer {
            removals,
            ..Answer::default()
        }
    }

    fn common(&self) -> CommonResponse {
        CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: self.sets.iter().cloned().map(set_header).collect(),
                remove_headers: self.removals.clone(),
            }),
            // The destination is read by the cluster's load balancer, but a route chosen on a
            // header must see the new one.
            clear_route_cache: self.destination.is_some(),
            ..Default::default()
        }
    }

    /// `envoy.lb` / `x-gateway-destination-endpoint`: the destination list, as the protocol
    /// requires beside the header.
    fn metadata(&self) -> Option<Struct> {
        let destination = self.destination.as_ref()?;
        let inner = Struct {
            fields: [(
                DESTINATION_KEY.to_string(),
                Value {
                    kind: Some(value::Kind::StringValue(destination.clone())),
                },
            )]
            .into_iter()
            .collect(),
        };
        Some(Struct {
            fields: [(
                METADATA_NAMESPACE.to_string(),
                Value {
                    kind: Some(value::Kind::StructValue(inner)),
                },
            )]
            .into_iter()
            .collect(),
        })
    }
}

/// Largest body chunk the picker sends back in one message.
const STREAMED_CHUNK_BYTES: usize = 64 << 10;

/// The reply to a request-headers message.
fn headers_reply(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestHeaders(HeadersResponse {
        response: Some(common),
    })
}

/// The reply to a request-body message.
fn body_reply(common: CommonResponse) -> processing_response::Response {
    processing_response::Response::RequestBody(BodyResponse {
        response: Some(common),
    })
}

/// A body chunk sent back in full-duplex mode.
fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

fn set_header((name, value): (String, String)) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name,
            raw_value: value.into_bytes(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The request's headers as the filter's machine reads them (Envoy sends values in `raw_value`,
/// or in `value` from older versions).
fn header_pairs(h: &HttpHeaders) -> Vec<(String, Vec<u8>)> {
    h.headers
        .as_ref()
        .map(|m| {
            m.headers
                .iter()
                .map(|v| {
                    let value = if v.raw_value.is_empty() {
                        v.value.clone().into_bytes()
                    } else {
                        v.raw_value.clone()
                    };
                    (v.key.to_ascii_lowercase(), value)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn header(h: &HttpHeaders, name: &str) -> Option<String> {
    header_pairs(h)
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| String::from_utf8_lossy(&v).into_owned())
}
