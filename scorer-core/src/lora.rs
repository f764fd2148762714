//! LoRA awareness: prefer replicas that already hold a request's adapter, and avoid replicas
//! whose adapter slots (`max_lora`) are all taken by other adapters.
//!
//! The per-replica view comes from vLLM's `vllm:lora_requests_info` gauge (labels
//! `running_lora_adapters`, `waiting_lora_adapters`, `max_lora`), which the control plane
//! scrapes. The adapter name also seeds the request's prefix hashes (vLLM names the adapter in
//! `model`), so blocks of different adapters never look shared.

use serde::{Deserialize, Serialize};

use crate::index::{EndpointId, EndpointSlots};

/// The `router.lora` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Cost (ms) of a replica that must load the adapter first (it holds it in no running or
    /// waiting request).
    pub load_ms: f64,
    /// Extra cost (ms) of a replica whose adapter slots are all held by other adapters: the
    /// request waits there until one frees.
    pub full_penalty_ms: f64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            load_ms: 200.0,
            full_penalty_ms: 5_000.0,
        }
    }
}

/// One replica's adapters, as its last `vllm:lora_requests_info` sample says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoraState {
    /// Adapters of running requests (loaded in a GPU slot).
    pub running: Vec<String>,
    /// Adapters of waiting requests.
    pub waiting: Vec<String>,
    /// Adapter slots of the engine (vLLM `--max-loras`).
    pub max_lora: u32,
}

impl LoraState {
    /// Whether the adapter is loaded or about to be (a request for it runs or waits).
    pub fn holds(&self, adapter: &str) -> bool {
        self.running
            .iter()
            .chain(&self.waiting)
            .any(|a| a == adapter)
    }

    /// Whether every slot is taken by an adapter other than `adapter`.
    pub fn full_of_others(&self, adapter: &str) -> bool {
        self.max_lora > 0
            && self.running.len() >= self.max_lora as usize
            && !self.running.iter().any(|a| a == adapter)
    }
}

/// Per-replica LoRA state.
#[derive(Debug, Clone, Default)]
pub struct LoraTable {
    states: EndpointSlots<LoraState>,
}

impl LoraTable {
    /// Replaces `id`'s state with a fresh sample.
    pub fn set(&mut self, id: EndpointId, state: LoraState) {
        self.states.set(id, state);
    }

    /// Forgets `id`'s state.
    pub fn clear(&mut self, id: EndpointId) {
        self.states.clear(id);
    }

    /// `id`'s state, when known.
    pub fn get(&self, id: EndpointId) -> Option<&LoraState> {
        self.states.get(id)
    }

    /// Whether any replica reports `model` as a running or waiting adapter.
    pub fn mentions(&self, model: &str) -> bool {
        self.states.known().any(|s| s.holds(model))
    }

    /// The LoRA cost term of sending a request for `adapter` to `id` (0 for a base model).
    pub fn cost_ms(&self, id: EndpointId, adapter: &str, config: &LoraConfig) -> f64 {
        let Some(state) = self.get(id) else {
            // Nothing known: assume a load, so replicas known to hold it win.
            return config.load_ms;
        };
        if state.holds(adapter) {
            return 0.0;
        }
        let full = if state.full_of_others(adapter) {
            config.full_penalty_ms
        } else {
            0.0
        };
        config.load_ms + full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(running: &[&str], waiting: &[&str], max_lora: u32) -> LoraState {
        LoraState {
            running: running.iter().map(|s| s.to_string()).collect(),
            waiting: waiting.iter().map(|s| s.to_string()).collect(),
            max_lora,
        }
    }

    #[test]
    fn holding_is_free_loading_costs_and_full_slots_cost_more() {
        let c = LoraConfig::default();
        let mut t = LoraTable::default();
        t.set(EndpointId(0), state(&["sql"], &[], 2));
        t.set(EndpointId(1), state(&[], &["sql"], 2));
        t.set(EndpointId(2), state(&["a"], &[], 2));
        t.set(EndpointId(3), state(&["a", "b"], &["sql"], 2));
        t.set(EndpointId(4), state(&["a", "b"], &[], 2));
        assert_eq!(t.cost_ms(EndpointId(0), "sql", &c), 0.0);
        assert_eq!(t.cost_ms(EndpointId(1), "sql", &c), 0.0);
        assert_eq!(t.cost_ms(EndpointId(2), "sql", &c), c.load_ms);
        // Already queued there: the load is under way.
        assert_eq!(t.cost_ms(EndpointId(3), "sql", &c), 0.0);
        assert_eq!(
            t.cost_ms(EndpointId(4), "sql", &c),
            c.load_ms + c.full_penalty_ms
        );
        // Unknown state: a load is assumed.
        assert_eq!(t.cost_ms(EndpointId(9), "sql", &c), c.load_ms);
        assert!(t.mentions("sql"));
        assert!(!t.mentions("zzz"));
        t.clear(EndpointId(0));
        assert!(t.get(EndpointId(0)).is_none());
    }

    #[test]
    fn zero_max_lora_never_counts_as_full() {
        assert!(!state(&["a"], &[], 0).full_of_others("b"));
        assert!(state(&["a"], &[], 1).full_of_others("b"));
        assert!(!state(&["b"], &[], 1).full_of_others("b"));
    }
}
