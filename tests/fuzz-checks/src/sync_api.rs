//! The sync protocol, from both ends: `POST /v1/sync` bodies a proxy sends (raw bytes, or
//! well-formed reports with arbitrary decisions and outcomes, written as the copy would: hash
//! lists in base64 once its control plane said it reads them) served by the control plane's
//! side (`serve_sync` on a `Router` and a small `SyncLog`), and the answers a proxy applies
//! (`LocalRouter::apply`, raw bytes or the control plane's own answers), and the shared
//! stream of active-active control planes (the log switched to stream numbering, raw bytes as a
//! message's entries at an arbitrary stream position). Invariants: nothing
//! panics; the log never holds more than its bound; an answer's `next` never goes backwards
//! for a replica; a local copy only ever routes to endpoints the control plane named, and a
//! copy fed only the control plane's answers (whole tables or deltas) holds exactly its
//! endpoints, and their model catalogues, after each.

use arbitrary::Arbitrary;
use scorer_core::pools::ServedModel;
use scorer_core::protocol::{Outcome, RouteRequest};
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use scorer_core::sync::{
    DecisionRecord, LocalRouter, SyncEvent, SyncLog, SyncRequest, SyncResponse, serve_sync, to_json,
};

#[derive(Arbitrary, Debug)]
enum Step {
    /// Raw bytes as a proxy's sync body.
    RawRequest(Vec<u8>),
    /// A well-formed report from copy `copy`.
    Report {
        copy: u8,
        decisions: Vec<(u8, u8, Vec<u8>)>,
        outcomes: Vec<(u8, u16)>,
    },
    /// Raw bytes as a sync answer applied to copy `copy`.
    RawAnswer { copy: u8, bytes: Vec<u8> },
    /// Copy `copy` routes a request over a small hash domain.
    Route { copy: u8, hashes: Vec<u8> },
    /// The control plane loses or regains an endpoint.
    Churn { endpoint: u8, up: bool },
    /// The log starts numbering by a shared stream.
    Replicate { id: u64, first: u64 },
    /// Raw bytes as a stream message's entries, at stream position `seq`.
    StreamEntries { seq: u64, bytes: Vec<u8> },
    /// The control plane polls an endpoint's `/v1/models`: serving `m` or another model, with
    /// a context of this many tokens or none in the card.
    Catalogue {
        endpoint: u8,
        serves_m: bool,
        max_model_len: Option<u16>,
    },
}

const LOG_BOUND: usize = 16;
const ENDPOINTS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

/// The target's body: the input its bytes build (`crate::structured`), and what it must satisfy.
pub fn check(data: &[u8]) {
    crate::structured(data, check_input);
}

fn check_input(steps: Vec<Step>) {
    let mut log = SyncLog::new(LOG_BOUND, 1);
    let mut hub = Router::new(RouterConfig::default(), 1);
    for address in ENDPOINTS {
        let _ = hub.upsert_endpoint(address);
        hub.update_metrics(address, EndpointMetrics::default(), 0);
    }
    let mut copies = [LocalRouter::new(8), LocalRouter::new(8)];
    let mut last_next = [0u64; 2];
    // Copies that applied a raw answer: their table is whatever it said, not the hub's.
    let mut raw_fed = [false; 2];
    for (now_ms, step) in (1u64..).zip(steps.into_iter().take(64)) {
        match step {
            Step::RawRequest(bytes) => {
                if let Ok(request) = serde_json::from_slice::<SyncRequest>(&bytes) {
                    let _ = serve_sync(&mut log, &mut hub, request, now_ms);
                }
            }
            Step::Report {
                copy,
                decisions,
                outcomes,
            } => {
                let i = usize::from(copy) % copies.len();
                let mut request = copies[i].sync_request();
                for (id, endpoint, hashes) in decisions.into_iter().take(8) {
                    request.decisions.push(DecisionRecord {
                        decision_id: u64::from(id),
                        endpoint: ENDPOINTS[usize::from(endpoint) % ENDPOINTS.len()].into(),
                        request: request_of(&hashes),
                        age_ms: u64::from(id) * 1_000,
                    });
                }
                for (id, status) in outcomes.into_iter().take(8) {
                    request.outcomes.push(Outcome {
                        decision_id: u64::from(id),
                        status,
                        ..Outcome::default()
                    });
                }
                // On the wire in the form the copy would use (base64 hash lists once its control
                // plane said it reads them): it reads back as it was.
                let bytes =
                    to_json(&request, copies[i].peer_reads_compact()).expect("a report serialises");
                let read: SyncRequest = serde_json::from_slice(&bytes).expect("and parses");
                assert_eq!(read, request, "a report survives the wire");
                let (replica, compact) = (request.replica, request.compact_hashes);
                let answer = serve_sync(&mut log, &mut hub, request, now_ms);
                assert!(log.len() <= LOG_BOUND);
                if replica == Some(answer.replica) && !answer.reset {
                    assert!(answer.next >= last_next[i], "next went backwards");
                }
                last_next[i] = answer.next;
                let bytes = to_json(&answer, compact).expect("an answer serialises");
                let answer: SyncResponse = serde_json::from_slice(&bytes).expect("and parses");
                copies[i].apply(answer, now_ms);
                if !raw_fed[i] {
                    let addresses = |r: &Router| {
                        let mut a: Vec<String> =
                            r.endpoints(now_ms).into_iter().map(|e| e.address).collect();
                        a.sort();
                        a
                    };
                    let copy = copies[i].router().map(addresses);
                    assert_eq!(copy, Some(addresses(&hub)), "the copy's table is the hub's");
                    let copy = copies[i].router().expect("a copy after an answer");
                    for address in ENDPOINTS {
                        assert_eq!(
                            copy.served_models(address),
                            hub.served_models(address),
                            "the copy's catalogue is the hub's"
                        );
                    }
                }
            }
            Step::RawAnswer { copy, bytes } => {
                if let Ok(answer) = serde_json::from_slice::<SyncResponse>(&bytes) {
                    let i = usize::from(copy) % copies.len();
                    raw_fed[i] = true;
                    copies[i].apply(answer, now_ms);
                }
            }
            Step::Route { copy, hashes } => {
                let copy = &mut copies[usize::from(copy) % 2];
                if let Some(decision) = copy.route(&request_of(&hashes), now_ms, now_ms) {
                    let known: Vec<String> = copy
                        .router()
                        .map(|r| r.endpoints(now_ms).into_iter().map(|e| e.address).collect())
                        .unwrap_or_default();
                    for endpoint in &decision.response.endpoints {
                        assert!(known.contains(endpoint), "routed to an unknown endpoint");
                    }
                }
            }
            Step::Replicate { id, first } => {
                log.replicate(id, first);
                assert!(log.is_replicated());
            }
            Step::StreamEntries { seq, bytes } => {
                let before = log.next_seq();
                if let Ok(events) = serde_json::from_slice::<Vec<SyncEvent>>(&bytes) {
                    for (i, event) in events.into_iter().take(16).enumerate() {
                        let _ = log.push_replicated(seq.saturating_add(i as u64), event, now_ms);
                    }
                }
                let _ = log.take_outbox();
                assert!(log.len() <= LOG_BOUND);
                assert!(log.next_seq() >= before, "the log's numbers went backwards");
            }
            Step::Catalogue {
                endpoint,
                serves_m,
                max_model_len,
            } => {
                let address = ENDPOINTS[usize::from(endpoint) % ENDPOINTS.len()];
                let card = ServedModel {
                    id: if serves_m { "m" } else { "other" }.into(),
                    parent: None,
                    max_model_len: max_model_len.map(u32::from),
                };
                hub.set_served_models(address, vec![card]);
            }
            Step::Churn { endpoint, up } => {
                let address = ENDPOINTS[usize::from(endpoint) % ENDPOINTS.len()];
                if up {
                    let _ = hub.upsert_endpoint(address);
                    hub.update_metrics(address, EndpointMetrics::default(), now_ms);
                } else {
                    hub.remove_endpoint(address);
                }
            }
        }
    }
}

fn request_of(hashes: &[u8]) -> RouteRequest {
    RouteRequest {
        model: "m".into(),
        block_hashes: hashes.iter().take(32).map(|h| u64::from(*h % 8)).collect(),
        prompt_bytes: 256 * hashes.len().min(32) as u64,
        prompt_tokens: 64 * hashes.len().min(32) as u32,
        ..RouteRequest::default()
    }
}
