//! Model pools: which endpoints serve which model, so a request goes only where its `model`
//! (a base model or a LoRA adapter, as vLLM's `/v1/models` lists them) is served.
//!
//! The catalogue is per endpoint and filled from outside (the control plane polls
//! `/v1/models` and adds the models its YAML names). An endpoint whose catalogue is not known
//! yet is a candidate only for models no known endpoint serves, so a fleet keeps routing while
//! its catalogues load, and a fleet with no catalogue at all routes exactly as before.

use serde::{Deserialize, Serialize};

use crate::affinity::SessionTable;
use crate::index::{EndpointId, EndpointSlots};
use crate::lora::LoraTable;
use crate::protocol::{Reject, RejectType};

/// What to do with a request whose model no endpoint serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownModelPolicy {
    /// Route it among all endpoints as if no catalogue were known (the engine then answers,
    /// typically with its own 404); this keeps the behaviour of a fleet without pools.
    #[default]
    PassThrough,
    /// Answer 404 `model_not_found` from the filter, without touching any replica.
    Reject,
}

/// The `router.models` section: how the model catalogue is used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelsConfig {
    /// Policy for a model that no endpoint serves.
    pub unknown_model: UnknownModelPolicy,
}

/// One model an endpoint serves, as an entry of vLLM's `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedModel {
    /// The name a request puts in `model` (a base model or an adapter).
    pub id: String,
    /// For a LoRA adapter, the base model it applies to (`parent`); `None` for a base model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The context length in the card (`max_model_len`; vLLM gives it for base models, an
    /// adapter shares its parent's): the engine refuses a prompt that fills it, so the router
    /// sends such a prompt where the context is longer and credits no endpoint with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
}

/// Which endpoints may serve one request, as decided by its model.
#[derive(Debug, Clone, PartialEq)]
pub enum Eligibility {
    /// Every endpoint (no catalogue known, or an unknown model under `pass_through`).
    Any,
    /// Only endpoints whose flag is set (indexed by endpoint slot).
    Only(Vec<bool>),
    /// No endpoint serves it and the policy is `reject`: answer with this.
    Rejected(Reject),
}

impl Eligibility {
    /// Whether the endpoint in slot `i` may serve the request.
    pub fn allows(&self, i: usize) -> bool {
        match self {
            Self::Any => true,
            Self::Only(flags) => flags.get(i).copied().unwrap_or(false),
            Self::Rejected(_) => false,
        }
    }
}

/// Per-endpoint served models; the router's view of the fleet's model pools.
#[derive(Debug, Clone, Default)]
pub struct ModelCatalog {
    /// Indexed by endpoint slot: the models it serves, when known.
    served: EndpointSlots<Vec<ServedModel>>,
}

impl ModelCatalog {
    /// Replaces what `id` serves (an empty list means "known to serve nothing").
    pub fn set(&mut self, id: EndpointId, models: Vec<ServedModel>) {
        self.served.set(id, models);
    }

    /// Forgets what `id` serves (the endpoint went away or its slot is reused).
    pub fn clear(&mut self, id: EndpointId) {
        self.served.clear(id);
    }

    /// What `id` serves, when known.
    pub fn models(&self, id: EndpointId) -> Option<&[ServedModel]> {
        self.served.get(id).map(Vec::as_slice)
    }

    /// Whether no endpoint's catalogue is known.
    pub fn is_empty(&self) -> bool {
        self.served.known().next().is_none()
    }

    /// Whether some endpoint lists `model`.
    pub fn lists(&self, model: &str) -> bool {
        self.served.known().flatten().any(|m| m.id == model)
    }

    /// The context length `id` serves `model` with, when its card says (an adapter's is its
    /// parent's; no model named: the endpoint's first base model, which vLLM serves then).
    pub fn context_limit(&self, id: EndpointId, model: &str) -> Option<u32> {
        let models = self.served.get(id)?;
        let card = if model.is_empty() {
            models.iter().find(|m| m.parent.is_none())?
        } else {
            models.iter().find(|m| m.id == model)?
        };
        card.max_model_len.or_else(|| {
            let parent = card.parent.as_deref()?;
            models.iter().find(|m| m.id == parent)?.max_model_len
        })
    }

    /// Whether some endpoint lists `model` as a LoRA adapter (it has a parent).
    pub fn is_adapter(&self, model: &str) -> bool {
        self.served
            .known()
            .flatten()
            .any(|m| m.id == model && m.parent.is_some())
    }

    /// Which of `slots` endpoints may serve `model`, under `policy`.
    ///
    /// Endpoints that list the model win; failing that, endpoints whose catalogue is not known
    /// yet; failing that (every catalogue known, none lists it), the policy decides.
    pub fn eligibility(
        &self,
        model: &str,
        slots: usize,
        policy: UnknownModelPolicy,
    ) -> Eligibility {
        // No model named (vLLM serves its default one; a `GET /v1/responses/{id}` names none):
        // any replica may answer.
        if self.is_empty() || model.is_empty() {
            return Eligibility::Any;
        }
        let serves = |i: usize| {
            self.served
                .slot(i)
                .map(|models| models.iter().any(|m| m.id == model))
        };
        let listed: Vec<bool> = (0..slots).map(|i| serves(i) == Some(true)).collect();
        if listed.iter().any(|&b| b) {
            return Eligibility::Only(listed);
        }
        let unknown: Vec<bool> = (0..slots).map(|i| serves(i).is_none()).collect();
        if unknown.iter().any(|&b| b) {
            return Eligibility::Only(unknown);
        }
        match policy {
            UnknownModelPolicy::PassThrough => Eligibility::Any,
            UnknownModelPolicy::Reject => Eligibility::Rejected(model_not_found(model)),
        }
    }
}

/// Counters of model-pool decisions: the `kvroute_unknown_model_total` counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Requests for a model no endpoint serves, answered 404 (`unknown_model: reject`).
    pub unknown_model_rejected: u64,
    /// Requests for a model no endpoint serves, routed anyway (`unknown_model: pass_through`).
    pub unknown_model_passed: u64,
    /// Requests too long for some of their pool's contexts, sent only where they fit.
    #[serde(default)]
    pub context_narrowed: u64,
    /// Requests too long for every context of their pool: routed by load and credited to no
    /// endpoint's index, since the engine refuses them wherever they go.
    #[serde(default)]
    pub context_exceeded: u64,
}

/// The router's per-endpoint fleet features in one place: served models, sessions, adapters.
#[derive(Debug, Clone, Default)]
pub struct FleetState {
    /// Which endpoint serves which model.
    pub catalog: ModelCatalog,
    /// Session key → replica.
    pub sessions: SessionTable,
    /// Stored response id → the replica that stored it (the same bounded table).
    pub responses: SessionTable,
    /// Adapters each replica holds.
    pub loras: LoraTable,
    /// Model-pool counters.
    pub stats: PoolStats,
}

impl FleetState {
    /// Which endpoints serve `model` (its pool), without counting anything: what checks that
    /// compare an endpoint with the rest of its pool read.
    pub fn eligible(&self, model: &str, slots: usize, policy: UnknownModelPolicy) -> Eligibility {
        self.catalog.eligibility(model, slots, policy)
    }

    /// Which endpoints may serve `model`, counting unknown models; `Err` is the refusal the
    /// filter sends back.
    pub fn admit(
        &mut self,
        model: &str,
        slots: usize,
        policy: UnknownModelPolicy,
    ) -> Result<Eligibility, Reject> {
        let eligibility = self.catalog.eligibility(model, slots, policy);
        match eligibility {
            Eligibility::Rejected(reject) => {
                self.stats.unknown_model_rejected += 1;
                Err(reject)
            }
            Eligibility::Any
                if policy == UnknownModelPolicy::PassThrough
                    && !self.catalog.is_empty()
                    && !self.catalog.lists(model) =>
            {
                self.stats.unknown_model_passed += 1;
                Ok(Eligibility::Any)
            }
            other => Ok(other),
        }
    }

    /// Whether `model` is a LoRA adapter (listed with a parent, or reported running/waiting).
    pub fn is_adapter(&self, model: &str) -> bool {
        self.catalog.is_adapter(model) || self.loras.mentions(model)
    }

    /// Forgets everything about `id` (removed, or its slot handed to a new endpoint).
    pub fn clear_endpoint(&mut self, id: EndpointId) {
        self.catalog.clear(id);
        self.loras.clear(id);
        self.sessions.forget_endpoint(id);
        self.responses.forget_endpoint(id);
    }
}

/// The OpenAI-style 404 for a model nobody serves (the wording of OpenAI's and vLLM's error).
pub fn model_not_found(model: &str) -> Reject {
    Reject {
        status: 404,
        message: format!("The model `{model}` does not exist."),
        error_type: RejectType::ModelNotFound,
        retry_after_s: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(id: &str) -> ServedModel {
        ServedModel {
            id: id.into(),
            parent: None,
            max_model_len: None,
        }
    }

    fn adapter(id: &str, parent: &str) -> ServedModel {
        ServedModel {
            id: id.into(),
            parent: Some(parent.into()),
            max_model_len: None,
        }
    }

    #[test]
    fn an_adapter_has_its_parents_context_and_no_model_the_first_base_models() {
        let mut c = ModelCatalog::default();
        let long = ServedModel {
            max_model_len: Some(32_768),
            ..base("b")
        };
        c.set(EndpointId(0), vec![long, adapter("b-sql", "b"), base("c")]);
        assert_eq!(c.context_limit(EndpointId(0), "b-sql"), Some(32_768));
        assert_eq!(c.context_limit(EndpointId(0), ""), Some(32_768));
        assert_eq!(
            c.context_limit(EndpointId(0), "c"),
            None,
            "the card gives none"
        );
        assert_eq!(c.context_limit(EndpointId(0), "zzz"), None);
        assert_eq!(
            c.context_limit(EndpointId(1), "b"),
            None,
            "catalogue unknown"
        );
    }

    #[test]
    fn no_catalogue_means_any_endpoint() {
        let c = ModelCatalog::default();
        assert_eq!(
            c.eligibility("m", 3, UnknownModelPolicy::Reject),
            Eligibility::Any
        );
    }

    #[test]
    fn only_endpoints_listing_the_model_are_eligible() {
        let mut c = ModelCatalog::default();
        c.set(EndpointId(0), vec![base("a")]);
        c.set(EndpointId(1), vec![base("b"), adapter("b-sql", "b")]);
        // Slot 2's catalogue is not known yet.
        let e = c.eligibility("b-sql", 3, UnknownModelPolicy::Reject);
        assert_eq!(e, Eligibility::Only(vec![false, true, false]));
        assert!(c.is_adapter("b-sql"));
        assert!(!c.is_adapter("b"));
        // A model nobody lists goes to the endpoints whose catalogue is unknown.
        let e = c.eligibility("c", 3, UnknownModelPolicy::Reject);
        assert_eq!(e, Eligibility::Only(vec![false, false, true]));
    }

    #[test]
    fn unknown_model_follows_the_policy_once_every_catalogue_is_known() {
        let mut c = ModelCatalog::default();
        c.set(EndpointId(0), vec![base("a")]);
        c.set(EndpointId(1), vec![base("b")]);
        assert_eq!(
            c.eligibility("zzz", 2, UnknownModelPolicy::PassThrough),
            Eligibility::Any
        );
        match c.eligibility("zzz", 2, UnknownModelPolicy::Reject) {
            Eligibility::Rejected(r) => {
                assert_eq!(r.status, 404);
                assert_eq!(r.error_type.as_str(), "model_not_found");
                assert!(r.message.contains("zzz"), "{}", r.message);
            }
            other => panic!("expected a reject, got {other:?}"),
        }
        c.clear(EndpointId(1));
        assert_eq!(
            c.eligibility("zzz", 2, UnknownModelPolicy::Reject),
            Eligibility::Only(vec![false, true])
        );
    }
}

/// The router with pools, sessions and adapters: candidates, terms and counters.
#[cfg(test)]
mod router_tests {
    use super::*;
    use crate::lora::LoraState;
    use crate::protocol::RouteRequest;
    use crate::router::{EndpointMetrics, Router, RouterConfig};

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";

    fn router(config: RouterConfig) -> Router {
        let mut r = Router::new(config, 1);
        for a in [A, B] {
            r.upsert_endpoint(a).unwrap();
            r.update_metrics(a, idle(), 0);
        }
        r
    }

    fn idle() -> EndpointMetrics {
        EndpointMetrics {
            kv_usage: 0.1,
            ..Default::default()
        }
    }

    fn request(model: &str, session: Option<&str>) -> RouteRequest {
        RouteRequest {
            model: model.into(),
            prompt_tokens: 100,
            session: session.map(str::to_owned),
            ..Default::default()
        }
    }

    fn models(ids: &[(&str, Option<&str>)]) -> Vec<ServedModel> {
        ids.iter()
            .map(|(id, parent)| ServedModel {
                id: (*id).into(),
                parent: parent.map(str::to_owned),
                max_model_len: None,
            })
            .collect()
    }

    #[test]
    fn requests_go_only_to_their_models_pool() {
        let mut r = router(RouterConfig::default());
        r.set_served_models(A, models(&[("llama", None)]));
        r.set_served_models(B, models(&[("qwen", None), ("qwen-sql", Some("qwen"))]));
        for t in 0..20 {
            let d = r.route(&request("qwen-sql", None), t, t);
            assert_eq!(d.response.endpoints, vec![B.to_string()]);
            let d = r.route(&request("llama", None), t, t);
            assert_eq!(d.response.endpoints, vec![A.to_string()]);
        }
        assert_eq!(r.served_models(B).map(<[_]>::len), Some(2));
    }

    fn with_context(id: &str, max_model_len: u32) -> Vec<ServedModel> {
        vec![ServedModel {
            id: id.into(),
            parent: None,
            max_model_len: Some(max_model_len),
        }]
    }

    // A mixed pool: a prompt (or an output budget) too long for one replica's context goes
    // only to the replica whose context holds it; a short one may go to either.
    #[test]
    fn a_request_goes_only_where_its_context_holds_it() {
        let mut r = router(RouterConfig::default());
        r.set_served_models(A, with_context("llama", 8_192));
        r.set_served_models(B, with_context("llama", 32_768));
        let long = RouteRequest {
            prompt_tokens: 10_000,
            ..request("llama", None)
        };
        let budget = RouteRequest {
            max_output_tokens: Some(16_000),
            ..request("llama", None)
        };
        for t in 0..10 {
            let d = r.route(&long, t * 1_000, t);
            assert_eq!(d.response.endpoints, vec![B.to_string()]);
            let d = r.route(&budget, t * 1_000, t);
            assert_eq!(d.response.endpoints, vec![B.to_string()]);
            let d = r.route(&request("llama", None), t * 1_000, t);
            assert_eq!(d.response.endpoints.len(), 2, "a short prompt fits both");
        }
        assert_eq!(r.pool_stats().context_narrowed, 20);
        assert_eq!(r.pool_stats().context_exceeded, 0);
    }

    #[test]
    fn unknown_model_is_rejected_or_passed_by_config() {
        let mut config = RouterConfig::default();
        config.models.unknown_model = UnknownModelPolicy::Reject;
        let mut r = router(config);
        r.set_served_models(A, models(&[("llama", None)]));
        r.set_served_models(B, models(&[("llama", None)]));
        let d = r.route(&request("gpt-9", None), 0, 0);
        let reject = d.response.reject.expect("a reject");
        assert_eq!(reject.status, 404);
        assert_eq!(d.response.reason.as_str(), "model_not_found");
        assert!(d.response.endpoints.is_empty());
        assert_eq!(r.pool_stats().unknown_model_rejected, 1);

        let mut r = router(RouterConfig::default());
        r.set_served_models(A, models(&[("llama", None)]));
        r.set_served_models(B, models(&[("llama", None)]));
        let d = r.route(&request("gpt-9", None), 0, 0);
        assert!(d.response.reject.is_none());
        assert_eq!(d.response.endpoints.len(), 2);
        assert_eq!(r.pool_stats().unknown_model_passed, 1);
    }

    #[test]
    fn a_session_stays_on_its_replica_while_it_is_healthy() {
        let mut config = RouterConfig::default();
        config.sessions.bonus_ms = 1_000.0;
        // The bonus alone: the wait cap would move these tiny requests once the home's queue
        // is four times their prefill elsewhere (its own test, in `router::tests`).
        config.scoring.wait_cap = 0.0;
        let mut r = router(config);
        let first = r.route(&request("m", Some("s1")), 0, 0);
        let home = first.response.endpoints[0].clone();
        let other = if home == A { B } else { A };
        // The home replica is busier than the other, yet the session stays.
        for t in 1..5 {
            let d = r.route(&request("m", Some("s1")), t, t);
            assert_eq!(d.response.endpoints[0], home, "{:?}", d.candidates);
            let c = d.candidates.iter().find(|c| c.endpoint == home).unwrap();
            assert_eq!(c.session_ms, -1_000.0);
        }
        // Overloaded (KV nearly full): the session moves.
        r.update_metrics(
            &home,
            EndpointMetrics {
                kv_usage: 0.99,
                ..Default::default()
            },
            5,
        );
        r.update_metrics(other, idle(), 5);
        let d = r.route(&request("m", Some("s1")), 6, 6);
        assert_eq!(d.response.endpoints[0], other);
        let (stats, len) = r.session_stats();
        assert_eq!((stats.misses, stats.hits, stats.broken, len), (1, 4, 1, 1));
        // Without a bonus the session is still remembered (a later request is not a start,
        // see `sessions.start_turns`), but no replica gets a bonus.
        let mut r = router(RouterConfig::default());
        r.route(&request("m", Some("s1")), 0, 0);
        let d = r.route(&request("m", Some("s1")), 1, 1);
        assert_eq!(r.session_stats().1, 1);
        assert!(d.candidates.iter().all(|c| c.session_ms == 0.0));
    }

    #[test]
    fn removing_the_replica_breaks_its_sessions() {
        let mut config = RouterConfig::default();
        config.sessions.bonus_ms = 1_000.0;
        let mut r = router(config);
        let home = r.route(&request("m", Some("s")), 0, 0).response.endpoints[0].clone();
        r.remove_endpoint(&home);
        let d = r.route(&request("m", Some("s")), 1, 1);
        assert_ne!(d.response.endpoints[0], home);
        assert!(d.candidates.iter().all(|c| c.session_ms == 0.0));
    }

    #[test]
    fn adapters_prefer_replicas_that_hold_them_and_avoid_full_ones() {
        let mut r = router(RouterConfig::default());
        r.set_served_models(
            A,
            models(&[
                ("base", None),
                ("sql", Some("base")),
                ("chat", Some("base")),
            ]),
        );
        r.set_served_models(
            B,
            models(&[
                ("base", None),
                ("sql", Some("base")),
                ("chat", Some("base")),
            ]),
        );
        let holds = |running: &[&str], max_lora| LoraState {
            running: running.iter().map(|s| s.to_string()).collect(),
            waiting: Vec::new(),
            max_lora,
        };
        r.set_lora_state(A, holds(&["chat"], 1));
        r.set_lora_state(B, holds(&["sql"], 4));
        // A holds chat; B holds sql: each adapter goes where it is loaded.
        for t in 0..10 {
            let d = r.route(&request("chat", None), t, t);
            assert_eq!(d.response.endpoints[0], A, "{:?}", d.candidates);
            let d = r.route(&request("sql", None), t, t);
            assert_eq!(d.response.endpoints[0], B, "{:?}", d.candidates);
        }
        // A new adapter: A's only slot is taken by another adapter, B has room.
        let d = r.route(&request("sql", None), 20, 20);
        let a = d.candidates.iter().find(|c| c.endpoint == A).unwrap();
        assert!(a.lora_ms >= RouterConfig::default().lora.full_penalty_ms);
        // The base model pays no adapter cost.
        let d = r.route(&request("base", None), 21, 21);
        assert!(d.candidates.iter().all(|c| c.lora_ms == 0.0));
        assert_eq!(r.lora_state(A).map(|s| s.max_lora), Some(1));
    }
}
