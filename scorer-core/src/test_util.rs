//! Builders for tests (feature `test-util`): the requests the admission tests of this crate and
//! of the control plane describe by tenant, criticality and size alone.

use crate::protocol::{Outcome, RouteRequest};
use crate::sync::SyncEvent;

/// A request of `tenant` at `criticality` with a prompt of `prompt_tokens` tokens (4 bytes
/// each) and 10 output tokens.
pub fn tenant_request(tenant: &str, criticality: &str, prompt_tokens: u32) -> RouteRequest {
    // Hashes of blocks no other request shares, as many as the prompt's bytes fill (the
    // router prices no more bytes than a request hashed).
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let prompt_bytes = u64::from(prompt_tokens) * 4;
    let blocks = prompt_bytes / crate::hash::DEFAULT_BLOCK_BYTES as u64;
    let first = NEXT.fetch_add(blocks, std::sync::atomic::Ordering::Relaxed);
    RouteRequest {
        model: "m".into(),
        block_hashes: (first..first + blocks)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect(),
        prompt_bytes,
        prompt_tokens,
        max_output_tokens: Some(10),
        tenant: Some(tenant.into()),
        criticality: Some(criticality.into()),
        ..RouteRequest::default()
    }
}

/// A log entry: the outcome of decision `decision_id`, reported by `origin`, nothing else set.
pub fn outcome_event(origin: u32, decision_id: u64) -> SyncEvent {
    SyncEvent::Outcome {
        origin,
        outcome: Outcome {
            decision_id,
            ..Outcome::default()
        },
    }
}
