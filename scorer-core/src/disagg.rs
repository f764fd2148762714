//! Prefill/decode disaggregation: endpoint roles and the choice of a prefill endpoint.
//!
//! llm-d's P/D flow (its routing sidecar on the decode pod runs the prefill remotely first): the
//! router picks a decode endpoint as usual; when the prompt's uncached part on that endpoint is large, it also picks
//! a prefill endpoint and names it in `x-prefiller-host-port`. The decode replica's sidecar
//! runs the prefill there, pulls the KV over the network and decodes. Long prefills then stop
//! stalling the decode batches of running streams, at the price of a KV transfer.

use serde::{Deserialize, Serialize};

use crate::index::EndpointId;
use crate::router::CandidateScore;

/// What an endpoint does in a disaggregated fleet (llm-d's pod label `llm-d.ai/role`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointRole {
    /// Runs remote prefills only: never a decode target.
    Prefill,
    /// Decodes; prefills locally unless the router names a prefill endpoint.
    Decode,
    /// An ordinary replica: prefills and decodes (today's behaviour).
    #[default]
    Both,
}

impl EndpointRole {
    /// Reads a role label value: `prefill`, `decode`, `both` (or llm-d's `prefill-decode`).
    pub fn from_label(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            "both" | "prefill-decode" | "prefill_decode" => Some(Self::Both),
            _ => None,
        }
    }

    /// Whether the endpoint may be the decode target of a request.
    pub fn decodes(self) -> bool {
        self != Self::Prefill
    }
}

/// Tunables of disaggregated serving (`pd:` in the router configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    /// Disaggregate when the prompt's uncached tokens on the chosen decode endpoint exceed
    /// this (and some endpoint has the `prefill` role). 0 disables disaggregation.
    pub threshold_tokens: u32,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            threshold_tokens: 1024,
        }
    }
}

impl PdConfig {
    /// Whether a request with `uncached_tokens` left on its decode endpoint is disaggregated.
    pub fn wants_remote_prefill(&self, uncached_tokens: u32) -> bool {
        self.threshold_tokens > 0 && uncached_tokens > self.threshold_tokens
    }
}

/// The cost of running this request's prefill on a prefill candidate: the same cost model as
/// a decode choice, restricted to its prefill terms (queue ahead, own uncached prefill, KV
/// pressure).
pub fn prefill_cost_ms(c: &CandidateScore, prefill_weight: f64) -> f64 {
    c.queue_ms + prefill_weight * c.prefill_ms + c.kv_ms
}

/// Moves prefill-only candidates out of `candidates` (they are never decode targets) and
/// returns them, cheapest prefill first.
pub fn split_prefill_only(
    candidates: &mut Vec<(EndpointId, CandidateScore)>,
    prefill_weight: f64,
) -> Vec<(EndpointId, CandidateScore)> {
    if candidates.iter().all(|(_, c)| c.role.decodes()) {
        return Vec::new();
    }
    let mut prefill = Vec::new();
    candidates.retain(|(id, c)| {
        if c.role.decodes() {
            true
        } else {
            prefill.push((*id, c.clone()));
            false
        }
    });
    prefill.sort_by(|a, b| {
        prefill_cost_ms(&a.1, prefill_weight).total_cmp(&prefill_cost_ms(&b.1, prefill_weight))
    });
    for (_, c) in prefill.iter_mut() {
        c.total_ms = prefill_cost_ms(c, prefill_weight);
    }
    prefill
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(
        endpoint: &str,
        role: EndpointRole,
        queue_ms: f64,
        prefill_ms: f64,
    ) -> CandidateScore {
        CandidateScore {
            endpoint: endpoint.into(),
            queue_ms,
            prefill_ms,
            decode_ms: 50.0,
            role,
            ..CandidateScore::default()
        }
    }

    #[test]
    fn labels_parse_and_unknown_ones_do_not() {
        assert_eq!(
            EndpointRole::from_label("Prefill"),
            Some(EndpointRole::Prefill)
        );
        assert_eq!(
            EndpointRole::from_label("decode"),
            Some(EndpointRole::Decode)
        );
        assert_eq!(
            EndpointRole::from_label("prefill-decode"),
            Some(EndpointRole::Both)
        );
        assert_eq!(EndpointRole::from_label("encode"), None);
        assert!(!EndpointRole::Prefill.decodes());
        assert!(EndpointRole::Both.decodes() && EndpointRole::Decode.decodes());
    }

    #[test]
    fn prefill_only_candidates_leave_the_decode_list_cheapest_first() {
        let mut all = vec![
            (
                EndpointId(0),
                candidate("d", EndpointRole::Decode, 0.0, 10.0),
            ),
            (
                EndpointId(1),
                candidate("p-busy", EndpointRole::Prefill, 90.0, 10.0),
            ),
            (
                EndpointId(2),
                candidate("p-cached", EndpointRole::Prefill, 0.0, 1.0),
            ),
        ];
        let prefill = split_prefill_only(&mut all, 2.0);
        assert_eq!(all.len(), 1);
        let names: Vec<&str> = prefill.iter().map(|(_, c)| c.endpoint.as_str()).collect();
        assert_eq!(names, ["p-cached", "p-busy"]);
        assert_eq!(prefill[0].1.total_ms, 2.0, "prefill terms only");
        let mut none = vec![(EndpointId(0), candidate("b", EndpointRole::Both, 0.0, 1.0))];
        assert!(split_prefill_only(&mut none, 2.0).is_empty());
    }

    #[test]
    fn threshold_zero_disables() {
        let off = PdConfig {
            threshold_tokens: 0,
        };
        assert!(!off.wants_remote_prefill(1_000_000));
        let on = PdConfig::default();
        assert!(on.wants_remote_prefill(1025) && !on.wants_remote_prefill(1024));
    }
}
