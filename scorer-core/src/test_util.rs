//! Builders for tests (feature `test-util`): the requests the admission tests of this crate and
//! of the control plane describe by tenant, criticality and size alone.

use crate::protocol::{Outcome, RouteRequest};
use crate::sync::SyncEvent;

/// A request of `tenant` at `criticality` with a prompt of `prompt_tokens` tokens (4 bytes
/// each) and 10 output tokens.
pub fn tenant_request(tenant: &str, criticality: &str, prompt_tokens: u32) -> RouteRequest {
    RouteRequest {
        model: "m".into(),
        prompt_bytes: u64::from(prompt_tokens) * 4,
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
