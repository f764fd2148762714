//! The admission gate in front of routing: wraps `scorer_core::fairness::Admission` (the pure
//! rules) with a lock and the Prometheus counters of what it admitted and refused.

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use scorer_core::fairness::{
    Admission, AdmissionConfig, AdmissionDecision, ReplicaLoad, ShedReason,
};
use scorer_core::protocol::RouteRequest;
use scorer_core::router::EndpointLoad;
use std::sync::atomic::AtomicU64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    criticality: &'static str,
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

/// Admission rules plus their metrics; shared by every route call.
#[derive(Debug)]
pub struct Gate {
    admission: Mutex<Admission>,
    shed: Family<ClassLabels, Counter>,
    over_share: Family<ClassLabels, Counter>,
    admitted: Family<ClassLabels, Counter>,
    too_large: Family<TenantLabels, Counter>,
    ttft_bound: Family<ClassLabels, Counter>,
    saturation: Gauge<f64, AtomicU64>,
    ttft_inflation: Gauge<f64, AtomicU64>,
    max_ttft_inflation: Gauge<f64, AtomicU64>,
    reference_tokens: u32,
}

impl Gate {
    /// A gate with `config` (validated by the caller's config loading).
    pub fn new(config: AdmissionConfig) -> Self {
        let max_ttft_inflation = Gauge::default();
        // 0 = no bound configured, so a dashboard can tell "off" from a value.
        max_ttft_inflation.set(config.max_ttft_inflation.unwrap_or(0.0));
        Self {
            reference_tokens: config.ttft_reference_tokens,
            admission: Mutex::new(Admission::new(config)),
            shed: Family::default(),
            over_share: Family::default(),
            admitted: Family::default(),
            too_large: Family::default(),
            ttft_bound: Family::default(),
            saturation: Gauge::default(),
            ttft_inflation: Gauge::default(),
            max_ttft_inflation,
        }
    }

    /// Prompt tokens of the reference request whose TTFT the bound protects: what the
    /// router's load view must predict for (`Router::endpoint_loads`).
    pub fn reference_tokens(&self) -> u32 {
        self.reference_tokens
    }

    /// Decides on `request` against the router's load view `loads` at `now_ms` and counts
    /// the verdict.
    pub fn decide(
        &self,
        request: &RouteRequest,
        loads: &[EndpointLoad],
        now_ms: u64,
    ) -> AdmissionDecision {
        let loads: Vec<ReplicaLoad> = loads.iter().filter_map(ReplicaLoad::from_load).collect();
        let decision = self.admission.lock().admit(request, &loads, now_ms);
        self.saturation.set(decision.saturation);
        if let Some(inflation) = decision.ttft_inflation {
            // An infinite estimate (no usable replica) would not encode; show it as 0 = unknown.
            self.ttft_inflation.set(if inflation.is_finite() {
                inflation
            } else {
                0.0
            });
        }
        let class = ClassLabels {
            criticality: decision.criticality.as_str(),
            tenant: decision.tenant_label.clone(),
        };
        match decision.shed {
            None => {
                self.admitted.get_or_create(&class).inc();
            }
            Some(ShedReason::PromptTooLarge) => {
                self.too_large
                    .get_or_create(&TenantLabels {
                        tenant: decision.tenant_label.clone(),
                    })
                    .inc();
            }
            Some(reason) => {
                self.shed.get_or_create(&class).inc();
                if reason == ShedReason::OverFairShare {
                    self.over_share.get_or_create(&class).inc();
                }
                if reason == ShedReason::TtftBound {
                    self.ttft_bound.get_or_create(&class).inc();
                }
            }
        }
        decision
    }

    /// Adds the gate's metrics to the control plane's registry (prefix `kvroute_`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "requests_shed",
            "Requests answered 429 because the fleet was saturated, by criticality and tenant \
             (tenants not named in admission.tenants share the label `other`)",
            self.shed.clone(),
        );
        registry.register(
            "requests_shed_over_fair_share",
            "Of the shed requests, those refused because their tenant was over its fair share",
            self.over_share.clone(),
        );
        registry.register(
            "requests_admitted",
            "Requests the admission gate let through to routing, by criticality and tenant",
            self.admitted.clone(),
        );
        registry.register(
            "requests_too_large",
            "Requests answered 413 because the prompt exceeded the tenant's max_prompt_bytes",
            self.too_large.clone(),
        );
        registry.register(
            "requests_shed_ttft_bound",
            "Of the shed requests, those refused because their tenant was over its fair share \
             and admitting them would have raised the others' predicted TTFT above \
             admission.max_ttft_inflation",
            self.ttft_bound.clone(),
        );
        registry.register(
            "admission_ttft_inflation",
            "Fleet TTFT inflation at the last admission decision: the best replica's predicted \
             TTFT for a ttft_reference_tokens prompt over its idle TTFT (0 = unknown or no \
             bound configured)",
            self.ttft_inflation.clone(),
        );
        registry.register(
            "admission_max_ttft_inflation",
            "The configured admission.max_ttft_inflation (0 = no bound)",
            self.max_ttft_inflation.clone(),
        );
        registry.register(
            "fleet_saturation",
            "Fleet saturation at the last admission decision: the least loaded replica's \
             max(waiting/queue_limit, kv_usage/kv_limit); 1 = every replica at a limit",
            self.saturation.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
    use scorer_core::test_util::tenant_request as request;

    fn metrics(gate: &Gate) -> String {
        let mut registry = Registry::with_prefix("kvroute");
        gate.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn a_bad_ttft_bound_is_refused_when_the_config_loads() {
        let base = "endpoints:\n  - address: 10.0.0.1:8000\nadmission:\n";
        for (bad, why) in [
            (
                "  max_ttft_inflation: 0.5\n",
                "admission.max_ttft_inflation",
            ),
            (
                "  max_ttft_inflation: 2\n  fairness: false\n",
                "needs fairness: true",
            ),
            (
                "  ttft_reference_tokens: 0\n",
                "admission.ttft_reference_tokens",
            ),
        ] {
            let e = crate::config::Config::from_yaml(&format!("{base}{bad}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(
            crate::config::Config::from_yaml(&format!("{base}  max_ttft_inflation: 3\n")).is_ok()
        );
    }

    #[test]
    fn the_gate_refuses_and_counts_requests_that_would_break_the_ttft_bound() {
        let gate = Gate::new(AdmissionConfig {
            max_ttft_inflation: Some(2.0),
            ..AdmissionConfig::default()
        });
        let mut router = Router::new(RouterConfig::default(), 1);
        for a in ["10.0.0.1:8000", "10.0.0.2:8000"] {
            router.upsert_endpoint(a).unwrap();
            router.update_metrics(a, EndpointMetrics::default(), 0);
        }
        let mut loads = Vec::new();
        // Alone, the flood is admitted onto both replicas.
        for _ in 0..2 {
            router.endpoint_loads(0, gate.reference_tokens(), &mut loads);
            let flood = request("batch", "standard", 6_000);
            assert_eq!(gate.decide(&flood, &loads, 0).shed, None);
            router.route(&flood, 0, 1);
        }
        // Another tenant appears; now the flood is over its share and no replica is free.
        router.endpoint_loads(0, gate.reference_tokens(), &mut loads);
        assert_eq!(
            gate.decide(&request("chat", "standard", 500), &loads, 0)
                .shed,
            None
        );
        let d = gate.decide(&request("batch", "standard", 6_000), &loads, 0);
        assert_eq!(d.shed, Some(ShedReason::TtftBound), "{d:?}");
        assert_eq!(d.reject.unwrap().status, 429);
        let text = metrics(&gate);
        for line in [
            "kvroute_requests_shed_ttft_bound_total{criticality=\"standard\",tenant=\"other\"} 1",
            "kvroute_requests_shed_total{criticality=\"standard\",tenant=\"other\"} 1",
            "kvroute_admission_max_ttft_inflation 2.0",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        let inflation: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("kvroute_admission_ttft_inflation "))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!(inflation > 2.0, "{text}");
    }
}
