//! Admission at the gateway: priorities, per-tenant prompt limits and weighted fair sharing.
//!
//! Runs before routing. When every candidate replica is over its queue or KV limit (the fleet
//! is saturated) it sheds `sheddable` requests first, `standard` ones at a higher saturation,
//! and `critical` ones only at an optional hard limit. Among tenants of one priority it keeps a
//! Virtual Token Counter (VTC, Sheng et al. 2024): each tenant's admitted prompt + output
//! tokens, divided by its weight and decayed over a half-life; a saturated fleet sheds the
//! standard requests of a tenant that is far over its weighted share, so one tenant's flood
//! does not queue in front of everyone else's interactive traffic.
//!
//! Shedding at saturation cannot bound what a flood costs the others: the gateway cannot
//! preempt a long prefill already running where an interactive request lands. With
//! `max_ttft_inflation` set, a tenant over its fair share is also refused whenever admitting
//! its request would leave no replica whose predicted time to first token for a reference
//! (interactive-sized) request is within that factor of its idle value; the router then steers
//! the other tenants' requests to the replicas kept free of the flood. The bound is the
//! configured factor, not a side effect of the saturation limits.
//!
//! Sans-IO like the rest of the crate: time is `now_ms`, endpoint loads are arguments.

use std::collections::BTreeMap;

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::protocol::{Reject, RejectType, RequestedCriticality, RouteRequest};
use crate::router::{EndpointLoad, Health};

/// Moved to [`crate::protocol`] (it travels in the route call); re-exported where admission
/// configuration has always named it.
pub use crate::protocol::Criticality;

/// Per-tenant settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantPolicy {
    /// Share of the fleet relative to other tenants (VTC weight); must be positive.
    pub weight: f64,
    /// Largest canonical prompt accepted, in bytes; larger ones get 413. `None`: no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_prompt_bytes: Option<u64>,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        Self {
            weight: 1.0,
            max_prompt_bytes: None,
        }
    }
}

/// Admission settings (`admission:` in the control plane's YAML). Without the section nothing
/// is ever refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Waiting requests per replica that count as full (llm-d's `queueDepthThreshold`).
    pub queue_limit: f64,
    /// KV-cache use per replica that counts as full (llm-d's `kvCacheUtilThreshold`).
    pub kv_limit: f64,
    /// Prompt tokens routed to a replica and not yet prefilled that count as full. vLLM admits
    /// requests into its running batch at once, so a flood of long prompts delays everyone's
    /// first token without ever showing as a waiting queue; this catches it. `None`: unused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_backlog_limit: Option<f64>,
    /// Fleet saturation at which sheddable requests are shed (1.0 = every replica at a limit).
    pub sheddable_at: f64,
    /// Fleet saturation at which standard requests are shed whatever their tenant's share.
    pub standard_at: f64,
    /// Fleet saturation at which even critical requests are shed; `None`: never.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub critical_at: Option<f64>,
    /// Shed a saturated fleet's standard requests from tenants over their fair share.
    pub fairness: bool,
    /// Bound on how much a tenant over its fair share may inflate the others' time to first
    /// token: its standard and sheddable requests are refused (429) when admitting one would
    /// leave no replica whose predicted TTFT for a `ttft_reference_tokens` prompt stays within
    /// this multiple of that replica's idle TTFT. Applies whatever the saturation (a long
    /// prefill hurts before any limit is reached) and only while the tenant is over its share
    /// (`fair_share_slack`), so a lone tenant is never throttled. Needs `fairness`. `None`:
    /// unused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_ttft_inflation: Option<f64>,
    /// Uncached prompt tokens of the request whose TTFT `max_ttft_inflation` protects (a
    /// typical interactive prompt); its idle TTFT is the baseline of the factor.
    pub ttft_reference_tokens: u32,
    /// A tenant is "over its fair share" when its weighted token usage exceeds this multiple
    /// of its weighted share of all recently active tenants' usage.
    pub fair_share_slack: f64,
    /// Half-life of the per-tenant token counters.
    pub usage_half_life_ms: u64,
    /// Output tokens charged for a request without `max_tokens`.
    pub default_output_tokens: u32,
    /// `Retry-After` seconds on a 429.
    pub retry_after_s: u32,
    /// Criticality of a request without (or with an unknown) criticality header.
    pub default_criticality: Criticality,
    /// llm-d objective names (the `x-llm-d-inference-objective` value) mapped to a level.
    pub objectives: BTreeMap<String, Criticality>,
    /// Named tenants; they also keep their own metric label (others share `other`).
    pub tenants: BTreeMap<String, TenantPolicy>,
    /// Settings of tenants not named in `tenants` (and of requests without a tenant).
    pub default_tenant: TenantPolicy,
    /// Most tenants whose counters are kept (idle ones are forgotten first).
    pub max_tracked_tenants: usize,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            queue_limit: 5.0,
            kv_limit: 0.8,
            prefill_backlog_limit: None,
            sheddable_at: 1.0,
            standard_at: 2.0,
            critical_at: None,
            fairness: true,
            max_ttft_inflation: None,
            ttft_reference_tokens: 512,
            fair_share_slack: 1.5,
            usage_half_life_ms: 10_000,
            default_output_tokens: 256,
            retry_after_s: 1,
            default_criticality: Criticality::Standard,
            objectives: BTreeMap::new(),
            tenants: BTreeMap::new(),
            default_tenant: TenantPolicy::default(),
            max_tracked_tenants: 4096,
        }
    }
}

/// Why an admission configuration cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdmissionConfigError {
    /// A field is out of its range.
    #[error("admission.{field}: {reason}")]
    Invalid {
        /// The offending field.
        field: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl AdmissionConfig {
    /// Checks ranges serde cannot: positive limits and weights, ordered shedding levels.
    pub fn validate(&self) -> Result<(), AdmissionConfigError> {
        let bad = |field: &str, reason| {
            Err(AdmissionConfigError::Invalid {
                field: field.to_string(),
                reason,
            })
        };
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.queue_limit) {
            return bad("queue_limit", "must be a positive number");
        }
        if !positive(self.kv_limit) {
            return bad("kv_limit", "must be a positive number");
        }
        if self.prefill_backlog_limit.is_some_and(|b| !positive(b)) {
            return bad("prefill_backlog_limit", "must be a positive number");
        }
        if !positive(self.sheddable_at) {
            return bad("sheddable_at", "must be a positive number");
        }
        if !positive(self.standard_at) || self.standard_at < self.sheddable_at {
            return bad("standard_at", "must be a number >= sheddable_at");
        }
        if self
            .critical_at
            .is_some_and(|c| !positive(c) || c < self.standard_at)
        {
            return bad("critical_at", "must be a number >= standard_at");
        }
        if !positive(self.fair_share_slack) || self.fair_share_slack < 1.0 {
            return bad("fair_share_slack", "must be a number >= 1");
        }
        if self
            .max_ttft_inflation
            .is_some_and(|f| !positive(f) || f < 1.0)
        {
            return bad("max_ttft_inflation", "must be a number >= 1");
        }
        if self.max_ttft_inflation.is_some() && !self.fairness {
            return bad("max_ttft_inflation", "needs fairness: true");
        }
        if self.ttft_reference_tokens == 0 {
            return bad("ttft_reference_tokens", "must be positive");
        }
        if self.usage_half_life_ms == 0 {
            return bad("usage_half_life_ms", "must be positive");
        }
        if self.max_tracked_tenants == 0 {
            return bad("max_tracked_tenants", "must be positive");
        }
        if !positive(self.default_tenant.weight) {
            return bad("default_tenant.weight", "must be a positive number");
        }
        for (name, t) in &self.tenants {
            if !positive(t.weight) {
                return bad(
                    &format!("tenants.{name}.weight"),
                    "must be a positive number",
                );
            }
        }
        Ok(())
    }
}

/// Tenant name used for requests that carry none.
pub const DEFAULT_TENANT: &str = "default";
/// Metric label of tenants not named in the configuration (bounds label cardinality).
pub const OTHER_TENANT_LABEL: &str = "other";

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShedReason {
    /// Its prompt is above its tenant's `max_prompt_bytes` (413).
    PromptTooLarge,
    /// The fleet is saturated past its criticality's level (429).
    Saturated,
    /// The fleet is saturated and its tenant is over its fair share (429).
    OverFairShare,
    /// Its tenant is over its fair share and admitting it would break `max_ttft_inflation`
    /// for the other tenants (429).
    TtftBound,
}

impl ShedReason {
    /// Stable snake_case name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::PromptTooLarge => "prompt_too_large",
            ShedReason::Saturated => "saturated",
            ShedReason::OverFairShare => "over_fair_share",
            ShedReason::TtftBound => "ttft_bound",
        }
    }
}

/// The verdict on one request.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionDecision {
    /// The tenant as read from the request (or [`DEFAULT_TENANT`]).
    pub tenant: String,
    /// Bounded metric label of the tenant (configured name, `default` or `other`).
    pub tenant_label: String,
    /// The request's effective criticality.
    pub criticality: Criticality,
    /// Fleet saturation the verdict was based on.
    pub saturation: f64,
    /// The tenant's usage over its fair share at the time (1.0 = exactly its share).
    pub share_ratio: f64,
    /// The fleet's TTFT inflation before this request (see [`Admission::ttft_inflation`];
    /// infinite when no replica is usable); `None` when `max_ttft_inflation` is unset or the
    /// decision was made from the saturation alone ([`Admission::decide`]).
    pub ttft_inflation: Option<f64>,
    /// Why it was refused, or `None` when admitted.
    pub shed: Option<ShedReason>,
    /// What the filter should answer instead of routing, when refused.
    pub reject: Option<Reject>,
}

/// The fleet's TTFT inflation before and after admitting the request being decided.
#[derive(Debug, Clone, Copy)]
struct TtftLoads {
    before: f64,
    after: f64,
}

#[derive(Debug, Clone, Copy)]
struct Usage {
    tokens: f64,
    at_ms: u64,
}

/// Per-tenant token counters and the admission rules; one per control plane (or fleet-sim run).
#[derive(Debug, Clone)]
pub struct Admission {
    config: AdmissionConfig,
    usage: HashMap<String, Usage>,
}

/// One replica's load as admission sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaLoad {
    /// Waiting requests (scraped, plus routed requests the scrape has not seen yet).
    pub waiting: f64,
    /// KV-cache use, 0..1.
    pub kv_usage: f64,
    /// Prompt tokens sent to it and not yet prefilled (the router's estimate).
    pub prefill_backlog_tokens: f64,
    /// Its metrics are stale or missing: treated as exactly saturated (1.0).
    pub stale: bool,
    /// Prompt tokens queued there ahead of a new request (see [`EndpointLoad::queued_tokens`]).
    pub queued_tokens: f64,
    /// Predicted TTFT of a reference request routed there now (ms; see
    /// [`EndpointLoad::ttft_ms`]).
    pub ttft_ms: f64,
    /// The same request's predicted TTFT on the idle replica (ms); 0 = unknown.
    pub idle_ttft_ms: f64,
    /// Predicted TTFT added per prompt token admitted there ahead of the reference request.
    pub ms_per_queued_token: f64,
}

impl ReplicaLoad {
    /// From the router's load view of an endpoint (`Router::endpoint_loads`); `None` for an
    /// unreachable one (not a candidate). Requests the router sent and the last scrape does
    /// not show yet count as waiting.
    pub fn from_load(view: &EndpointLoad) -> Option<ReplicaLoad> {
        if view.health != Health::Ready {
            return None;
        }
        let (waiting, kv_usage, stale) = match view.metrics {
            Some(m) => {
                let seen = m.running.saturating_add(m.waiting);
                let unseen = view.inflight.saturating_sub(seen);
                (
                    f64::from(m.waiting) + f64::from(unseen),
                    m.kv_usage,
                    view.stale,
                )
            }
            None => (f64::from(view.inflight), 0.0, true),
        };
        Some(ReplicaLoad {
            waiting,
            kv_usage,
            prefill_backlog_tokens: view.backlog_tokens,
            stale,
            queued_tokens: view.queued_tokens,
            ttft_ms: view.ttft_ms,
            idle_ttft_ms: view.idle_ttft_ms,
            ms_per_queued_token: view.ms_per_queued_token,
        })
    }
}

impl Admission {
    /// Admission with `config` (assumed validated) and no usage yet.
    pub fn new(config: AdmissionConfig) -> Self {
        Self {
            config,
            usage: HashMap::new(),
        }
    }

    /// The active settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// One replica's saturation: the largest of queue / `queue_limit`, KV use / `kv_limit` and
    /// (when set) prefill backlog / `prefill_backlog_limit`; at least 1.0 when its metrics are
    /// stale (unknown load counts as full).
    pub fn replica_saturation(&self, load: &ReplicaLoad) -> f64 {
        let backlog = self
            .config
            .prefill_backlog_limit
            .map_or(0.0, |limit| load.prefill_backlog_tokens / limit);
        let s = (load.waiting / self.config.queue_limit)
            .max(load.kv_usage / self.config.kv_limit)
            .max(backlog);
        let s = if s.is_finite() { s.max(0.0) } else { 0.0 };
        if load.stale { s.max(1.0) } else { s }
    }

    /// Fleet saturation: the least saturated candidate's (the fleet is full only when every
    /// candidate is). No candidate at all counts as 1.0.
    pub fn fleet_saturation(&self, loads: &[ReplicaLoad]) -> f64 {
        loads
            .iter()
            .map(|l| self.replica_saturation(l))
            .min_by(f64::total_cmp)
            .unwrap_or(1.0)
    }

    /// The effective criticality of a request's header value: its level, a configured
    /// objective's, or `default_criticality` (no header, or a name nobody configured).
    pub fn criticality_of(&self, requested: Option<&RequestedCriticality>) -> Criticality {
        match requested {
            Some(RequestedCriticality::Level(level)) => Some(*level),
            Some(RequestedCriticality::Named(name)) => self.config.objectives.get(name).copied(),
            None => None,
        }
        .unwrap_or(self.config.default_criticality)
    }

    fn policy(&self, tenant: &str) -> &TenantPolicy {
        self.config
            .tenants
            .get(tenant)
            .unwrap_or(&self.config.default_tenant)
    }

    /// The bounded metric label of `tenant`.
    pub fn tenant_label(&self, tenant: &str) -> String {
        if tenant == DEFAULT_TENANT || self.config.tenants.contains_key(tenant) {
            tenant.to_string()
        } else {
            OTHER_TENANT_LABEL.to_string()
        }
    }

    fn decayed(&self, u: &Usage, now_ms: u64) -> f64 {
        let dt = now_ms.saturating_sub(u.at_ms) as f64;
        u.tokens * 0.5f64.powf(dt / self.config.usage_half_life_ms as f64)
    }

    /// `tenant`'s decayed weighted usage over its weighted share of all active tenants'
    /// usage (1.0 = exactly its share; 0 when it has used nothing).
    pub fn share_ratio(&self, tenant: &str, now_ms: u64) -> f64 {
        let mine = self
            .usage
            .get(tenant)
            .map_or(0.0, |u| self.decayed(u, now_ms));
        if mine <= 0.0 {
            return 0.0;
        }
        let mut total = 0.0;
        let mut weights = 0.0;
        for (name, u) in &self.usage {
            let tokens = self.decayed(u, now_ms);
            // A tenant idle for ~10 half-lives no longer claims a share.
            if tokens >= 1.0 || name == tenant {
                total += tokens;
                weights += self.policy(name).weight;
            }
        }
        let share = total * self.policy(tenant).weight / weights.max(f64::MIN_POSITIVE);
        if share > 0.0 { mine / share } else { 0.0 }
    }

    /// Every tracked tenant's decayed token counter, by tenant (for metrics).
    pub fn usage(&self, now_ms: u64) -> Vec<(String, f64)> {
        let mut v: Vec<(String, f64)> = self
            .usage
            .iter()
            .map(|(t, u)| (t.clone(), self.decayed(u, now_ms)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// One replica's TTFT inflation: the reference request's predicted TTFT there over its
    /// idle TTFT. A request that has to wait behind queued prompts is prefilled in one engine
    /// step with whatever else arrives meanwhile, so while prompts are queued the prediction
    /// counts one more reference-sized prefill (fleet-sim showed the FCFS estimate alone
    /// under-predicting exactly those requests). Infinite when unknown (stale metrics, no
    /// baseline): such a replica cannot count as kept free.
    pub fn replica_ttft_inflation(&self, load: &ReplicaLoad) -> f64 {
        let peer = if load.queued_tokens >= 1.0 {
            f64::from(self.config.ttft_reference_tokens) * load.ms_per_queued_token.max(0.0)
        } else {
            0.0
        };
        let r = (load.ttft_ms + peer) / load.idle_ttft_ms;
        if load.stale || !r.is_finite() || load.idle_ttft_ms <= 0.0 {
            f64::INFINITY
        } else {
            r.max(1.0)
        }
    }

    /// The fleet's TTFT inflation: the best (lowest) candidate's, see
    /// [`Admission::replica_ttft_inflation`]. Infinite with no usable candidate.
    pub fn ttft_inflation(&self, loads: &[ReplicaLoad]) -> f64 {
        loads
            .iter()
            .map(|l| self.replica_ttft_inflation(l))
            .min_by(f64::total_cmp)
            .unwrap_or(f64::INFINITY)
    }

    /// The fleet's TTFT inflation after admitting a prompt of `prompt_tokens`: the router
    /// sends it where a request would wait least (the replica with the lowest predicted
    /// TTFT), whose TTFT grows by its prefill; the others keep theirs. When prompts are still
    /// queued on that replica, the result is at least its own new inflation too: an engine
    /// prefills what is queued in the same steps, so the requests waiting there (possibly
    /// another tenant's) get their first token only after the new prompt's prefill as well.
    /// Every prompt token is assumed uncached (admission cannot see the prefix cache), so the
    /// estimate errs towards protection.
    pub fn ttft_inflation_after(&self, loads: &[ReplicaLoad], prompt_tokens: u32) -> f64 {
        let Some(pick) = (0..loads.len())
            .filter(|&i| self.replica_ttft_inflation(&loads[i]).is_finite())
            .min_by(|&a, &b| loads[a].ttft_ms.total_cmp(&loads[b].ttft_ms))
        else {
            return f64::INFINITY;
        };
        let mut after = loads[pick];
        let added = f64::from(prompt_tokens);
        after.ttft_ms += added * after.ms_per_queued_token.max(0.0);
        let queued_there = if after.queued_tokens >= 1.0 {
            self.replica_ttft_inflation(&after)
        } else {
            0.0
        };
        after.queued_tokens += added;
        let free = loads
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if i == pick {
                    self.replica_ttft_inflation(&after)
                } else {
                    self.replica_ttft_inflation(l)
                }
            })
            .min_by(f64::total_cmp)
            .unwrap_or(f64::INFINITY);
        free.max(queued_there)
    }

    /// Decides whether `request` may be routed now onto the candidate replicas `loads`: their
    /// saturation (see [`Admission::fleet_saturation`]) and, with `max_ttft_inflation` set,
    /// their predicted TTFTs. An admitted request is charged to its tenant.
    pub fn admit(
        &mut self,
        request: &RouteRequest,
        loads: &[ReplicaLoad],
        now_ms: u64,
    ) -> AdmissionDecision {
        let saturation = self.fleet_saturation(loads);
        let bound = self.config.max_ttft_inflation.map(|_| TtftLoads {
            before: self.ttft_inflation(loads),
            after: self.ttft_inflation_after(loads, request.prompt_tokens),
        });
        self.decide_with(request, saturation, bound, now_ms)
    }

    /// Decides whether `request` may be routed now, given the fleet's `saturation` only (see
    /// [`Admission::fleet_saturation`]; the TTFT bound needs [`Admission::admit`]); an admitted
    /// request is charged to its tenant.
    pub fn decide(
        &mut self,
        request: &RouteRequest,
        saturation: f64,
        now_ms: u64,
    ) -> AdmissionDecision {
        self.decide_with(request, saturation, None, now_ms)
    }

    fn decide_with(
        &mut self,
        request: &RouteRequest,
        saturation: f64,
        bound: Option<TtftLoads>,
        now_ms: u64,
    ) -> AdmissionDecision {
        let tenant = request
            .tenant
            .as_deref()
            .filter(|t| !t.is_empty())
            .unwrap_or(DEFAULT_TENANT)
            .to_string();
        let criticality = self.criticality_of(request.criticality.as_ref());
        let share_ratio = self.share_ratio(&tenant, now_ms);
        let mut decision = AdmissionDecision {
            tenant_label: self.tenant_label(&tenant),
            criticality,
            saturation,
            share_ratio,
            ttft_inflation: bound.map(|b| b.before),
            shed: None,
            reject: None,
            tenant,
        };
        let c = &self.config;
        let limit = self.policy(&decision.tenant).max_prompt_bytes;
        if let Some(max) = limit.filter(|max| request.prompt_bytes > *max) {
            decision.shed = Some(ShedReason::PromptTooLarge);
            decision.reject = Some(Reject {
                status: 413,
                message: format!(
                    "prompt of {} bytes exceeds the limit of {max} bytes for tenant {:?}",
                    request.prompt_bytes, decision.tenant
                ),
                error_type: RejectType::RequestTooLarge,
                retry_after_s: None,
            });
            return decision;
        }
        let shed = match criticality {
            Criticality::Critical => c
                .critical_at
                .is_some_and(|at| saturation >= at)
                .then_some(ShedReason::Saturated),
            Criticality::Standard if saturation >= c.standard_at => Some(ShedReason::Saturated),
            Criticality::Standard => {
                (c.fairness && saturation >= c.sheddable_at && share_ratio > c.fair_share_slack)
                    .then_some(ShedReason::OverFairShare)
            }
            Criticality::Sheddable => {
                (saturation >= c.sheddable_at).then_some(ShedReason::Saturated)
            }
        };
        // The TTFT bound: an over-share tenant only gets capacity that leaves a replica within
        // the factor for everyone else. Critical requests are exempt (shed only at
        // `critical_at`).
        let shed = shed.or_else(|| {
            let (max, b) = c.max_ttft_inflation.zip(bound)?;
            (c.fairness
                && criticality != Criticality::Critical
                && share_ratio > c.fair_share_slack
                && b.after > max)
                .then_some(ShedReason::TtftBound)
        });
        if let Some(reason) = shed {
            let message = match reason {
                ShedReason::OverFairShare => format!(
                    "the inference fleet is saturated and tenant {:?} is using {share_ratio:.1}x \
                     its fair share; retry later",
                    decision.tenant
                ),
                ShedReason::TtftBound => format!(
                    "tenant {:?} is using {share_ratio:.1}x its fair share and admitting this \
                     request would raise other tenants' time to first token to {:.1}x its idle \
                     value (limit {:.1}x, admission.max_ttft_inflation); retry later",
                    decision.tenant,
                    bound.map_or(f64::INFINITY, |b| b.after),
                    c.max_ttft_inflation.unwrap_or(f64::INFINITY),
                ),
                _ => format!(
                    "the inference fleet is saturated (saturation {saturation:.2}); {} requests \
                     are shed; retry later",
                    criticality.as_str()
                ),
            };
            decision.shed = Some(reason);
            decision.reject = Some(Reject {
                status: 429,
                message,
                error_type: RejectType::RateLimitExceeded,
                retry_after_s: Some(c.retry_after_s),
            });
            return decision;
        }
        let tokens = f64::from(request.prompt_tokens)
            + f64::from(request.max_output_tokens.unwrap_or(c.default_output_tokens));
        self.charge(&decision.tenant, tokens, now_ms);
        decision
    }

    /// Adds `tokens` to `tenant`'s counter (admission does it for every admitted request).
    pub fn charge(&mut self, tenant: &str, tokens: f64, now_ms: u64) {
        if !self.usage.contains_key(tenant) && self.usage.len() >= self.config.max_tracked_tenants {
            self.forget_idlest(now_ms);
        }
        let current = self
            .usage
            .get(tenant)
            .map_or(0.0, |u| self.decayed(u, now_ms));
        self.usage.insert(
            tenant.to_string(),
            Usage {
                tokens: current + tokens.max(0.0),
                at_ms: now_ms,
            },
        );
    }

    fn forget_idlest(&mut self, now_ms: u64) {
        let idlest = self
            .usage
            .iter()
            .map(|(t, u)| (t, self.decayed(u, now_ms)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(t, _)| t.clone());
        if let Some(t) = idlest {
            self.usage.remove(&t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::tenant_request as request;

    /// Whether `a` lets `r` through at `saturation` (its verdict sheds nothing).
    fn admits(a: &mut Admission, r: RouteRequest, saturation: f64, now_ms: u64) -> bool {
        a.decide(&r, saturation, now_ms).shed.is_none()
    }

    fn load(waiting: f64, kv: f64) -> ReplicaLoad {
        ReplicaLoad {
            waiting,
            kv_usage: kv,
            prefill_backlog_tokens: 0.0,
            stale: false,
            queued_tokens: 0.0,
            ttft_ms: 56.0,
            idle_ttft_ms: 56.0,
            ms_per_queued_token: 0.1,
        }
    }

    #[test]
    fn a_prefill_backlog_limit_counts_unprefilled_tokens() {
        let flood = ReplicaLoad {
            prefill_backlog_tokens: 12_000.0,
            ..load(0.0, 0.1)
        };
        let off = Admission::new(AdmissionConfig::default());
        assert!(off.replica_saturation(&flood) < 1.0);
        let on = Admission::new(AdmissionConfig {
            prefill_backlog_limit: Some(8_000.0),
            ..AdmissionConfig::default()
        });
        assert_eq!(on.replica_saturation(&flood), 1.5);
    }

    #[test]
    fn criticality_names_priorities_and_objectives() {
        for (name, criticality) in [
            ("Sheddable", Some(Criticality::Sheddable)),
            (" CRITICAL ", Some(Criticality::Critical)),
            ("-1", Some(Criticality::Sheddable)),
            ("0", Some(Criticality::Standard)),
            ("10", Some(Criticality::Critical)),
            ("batch", None),
        ] {
            assert_eq!(Criticality::parse(name), criticality, "{name:?}");
        }
        let mut config = AdmissionConfig::default();
        config
            .objectives
            .insert("batch".into(), Criticality::Sheddable);
        let a = Admission::new(config);
        assert_eq!(
            a.criticality_of(Some(&"batch".into())),
            Criticality::Sheddable
        );
        assert_eq!(
            a.criticality_of(Some(&"unknown".into())),
            Criticality::Standard
        );
        assert_eq!(a.criticality_of(None), Criticality::Standard);
    }

    #[test]
    fn saturation_is_the_least_loaded_candidates_and_stale_counts_as_full() {
        let a = Admission::new(AdmissionConfig::default());
        assert_eq!(a.replica_saturation(&load(10.0, 0.1)), 2.0);
        assert_eq!(a.replica_saturation(&load(0.0, 0.4)), 0.5);
        let stale = ReplicaLoad {
            stale: true,
            ..load(0.0, 0.0)
        };
        assert_eq!(a.replica_saturation(&stale), 1.0);
        assert_eq!(a.fleet_saturation(&[load(10.0, 0.0), load(5.0, 0.0)]), 1.0);
        assert_eq!(a.fleet_saturation(&[load(10.0, 0.0), load(0.0, 0.0)]), 0.0);
        assert_eq!(a.fleet_saturation(&[]), 1.0);
        assert_eq!(a.fleet_saturation(&[load(f64::NAN, f64::NAN)]), 0.0);
    }

    #[test]
    fn sheddable_goes_first_standard_later_critical_never_by_default() {
        let mut a = Admission::new(AdmissionConfig::default());
        for (saturation, expect) in [
            (0.5, [false, false, false]),
            (1.0, [false, false, true]),
            (2.0, [false, true, true]),
            (50.0, [false, true, true]),
        ] {
            let shed: Vec<bool> = ["critical", "standard", "sheddable"]
                .iter()
                .map(|c| a.decide(&request("t", c, 10), saturation, 0).shed.is_some())
                .collect();
            assert_eq!(shed, expect, "saturation {saturation}");
        }
        let d = a.decide(&request("t", "sheddable", 10), 1.0, 0);
        let r = d.reject.unwrap();
        assert_eq!(
            (r.status, r.error_type.as_str(), r.retry_after_s),
            (429, "rate_limit_exceeded", Some(1))
        );
        let mut hard = Admission::new(AdmissionConfig {
            critical_at: Some(4.0),
            ..AdmissionConfig::default()
        });
        assert!(admits(&mut hard, request("t", "critical", 10), 3.9, 0));
        assert!(!admits(&mut hard, request("t", "critical", 10), 4.0, 0));
    }

    #[test]
    fn tenant_prompt_limit_answers_413_whatever_the_load() {
        let mut config = AdmissionConfig::default();
        config.tenants.insert(
            "small".into(),
            TenantPolicy {
                weight: 1.0,
                max_prompt_bytes: Some(100),
            },
        );
        let mut a = Admission::new(config);
        let d = a.decide(&request("small", "critical", 26), 0.0, 0);
        assert_eq!(d.shed, Some(ShedReason::PromptTooLarge));
        let r = d.reject.unwrap();
        assert_eq!(
            (r.status, r.error_type.as_str()),
            (413, "request_too_large")
        );
        assert!(r.message.contains("104 bytes") && r.message.contains("small"));
        assert!(admits(&mut a, request("small", "critical", 25), 0.0, 0));
        assert!(admits(&mut a, request("big", "standard", 10_000), 0.0, 0));
    }

    #[test]
    fn a_flooding_tenant_is_shed_before_an_interactive_one() {
        let mut a = Admission::new(AdmissionConfig::default());
        for i in 0..50 {
            assert!(admits(&mut a, request("batch", "standard", 4000), 0.5, i));
            assert!(admits(&mut a, request("chat", "standard", 100), 0.5, i));
        }
        // Saturated: the flood is over its share, the interactive tenant far below it.
        let flood = a.decide(&request("batch", "standard", 4000), 1.2, 60);
        assert_eq!(flood.shed, Some(ShedReason::OverFairShare));
        assert!(flood.share_ratio > 1.5, "{}", flood.share_ratio);
        let chat = a.decide(&request("chat", "standard", 100), 1.2, 60);
        assert_eq!(chat.shed, None);
        assert!(chat.share_ratio < 0.2, "{}", chat.share_ratio);
        // Not saturated: work-conserving, the flood is admitted.
        assert!(admits(&mut a, request("batch", "standard", 4000), 0.9, 61));
    }

    #[test]
    fn weights_scale_the_fair_share_and_a_lone_tenant_is_never_over_it() {
        let mut config = AdmissionConfig::default();
        config.tenants.insert(
            "gold".into(),
            TenantPolicy {
                weight: 4.0,
                max_prompt_bytes: None,
            },
        );
        let mut a = Admission::new(config);
        for i in 0..20 {
            a.decide(&request("lone", "standard", 1000), 0.0, i);
        }
        assert!((a.share_ratio("lone", 20) - 1.0).abs() < 1e-9);
        // gold uses 3x what lone does, but its weight is 4x: under its share.
        for i in 0..60 {
            a.decide(&request("gold", "standard", 1000), 0.0, 20 + i);
        }
        assert!(a.share_ratio("gold", 80) < 1.0);
        assert!(admits(&mut a, request("gold", "standard", 1000), 1.5, 81));
    }

    #[test]
    fn counters_decay_and_are_bounded() {
        let mut a = Admission::new(AdmissionConfig {
            max_tracked_tenants: 3,
            ..AdmissionConfig::default()
        });
        a.charge("x", 1000.0, 0);
        let later = a.usage(10_000);
        assert!((later[0].1 - 500.0).abs() < 1e-6);
        for (i, t) in ["a", "b", "c", "d"].iter().enumerate() {
            a.charge(t, 10.0 + i as f64, 20_000);
        }
        assert_eq!(a.usage(20_000).len(), 3);
        assert_eq!(a.tenant_label("d"), OTHER_TENANT_LABEL);
        assert_eq!(a.tenant_label(DEFAULT_TENANT), DEFAULT_TENANT);
    }

    /// A replica whose reference TTFT is `ttft_ms` (idle 56 ms, 10 prompt tokens a ms).
    fn ttft_load(queued_tokens: f64, ttft_ms: f64) -> ReplicaLoad {
        ReplicaLoad {
            queued_tokens,
            ttft_ms,
            ms_per_queued_token: 0.1,
            ..load(0.0, 0.0)
        }
    }

    fn bounded(max: f64) -> Admission {
        Admission::new(AdmissionConfig {
            max_ttft_inflation: Some(max),
            ..AdmissionConfig::default()
        })
    }

    /// Gives `batch` far more than its share next to a light `chat` tenant.
    fn contend(a: &mut Admission) {
        for i in 0..20 {
            a.charge("batch", 6_000.0, i);
            a.charge("chat", 500.0, i);
        }
    }

    #[test]
    fn the_ttft_bound_keeps_a_replica_free_for_the_other_tenants() {
        let mut a = bounded(3.0);
        contend(&mut a);
        let flooded = ttft_load(5_000.0, 556.0);
        let one_free = [flooded, flooded, flooded, ttft_load(0.0, 56.0)];
        // Admitting the flood would land it on the only free replica: refused, whatever the
        // saturation (none of these replicas is over a saturation limit).
        assert!(a.fleet_saturation(&one_free) < 1.0);
        let d = a.admit(&request("batch", "standard", 6_000), &one_free, 30);
        assert_eq!(d.shed, Some(ShedReason::TtftBound), "{d:?}");
        assert_eq!(d.ttft_inflation, Some(1.0));
        let r = d.reject.unwrap();
        assert_eq!(
            (r.status, r.error_type.as_str(), r.retry_after_s),
            (429, "rate_limit_exceeded", Some(1))
        );
        assert!(
            r.message.contains("batch") && r.message.contains("max_ttft_inflation"),
            "{}",
            r.message
        );
        // The other tenant, and critical requests, are never refused for the bound.
        let chat = a.admit(&request("chat", "standard", 500), &one_free, 30);
        assert_eq!(chat.shed, None);
        assert_eq!(
            a.admit(&request("batch", "critical", 6_000), &one_free, 30)
                .shed,
            None
        );
        // With a second free replica the flood gets one of them.
        let two_free = [flooded, flooded, ttft_load(0.0, 56.0), ttft_load(0.0, 60.0)];
        assert_eq!(
            a.admit(&request("batch", "standard", 6_000), &two_free, 31)
                .shed,
            None
        );
        // A looser bound tolerates some queue on the replica left for the others: 1,000
        // queued tokens is (56 + 100 + 51) / 56 = 3.7x.
        let queued = [
            flooded,
            flooded,
            ttft_load(0.0, 56.0),
            ttft_load(1_000.0, 156.0),
        ];
        let mut tight = bounded(3.0);
        contend(&mut tight);
        let mut loose = bounded(4.0);
        contend(&mut loose);
        let flood = request("batch", "standard", 6_000);
        assert_eq!(
            tight.admit(&flood, &queued, 30).shed,
            Some(ShedReason::TtftBound)
        );
        assert_eq!(loose.admit(&flood, &queued, 30).shed, None);
    }

    #[test]
    fn the_ttft_bound_is_work_conserving_and_off_by_default() {
        let flooded = ttft_load(5_000.0, 556.0);
        let one_free = [flooded, flooded, flooded, ttft_load(0.0, 56.0)];
        // A lone tenant is never over its share: not throttled.
        let mut lone = bounded(2.0);
        for i in 0..20 {
            let d = lone.admit(&request("batch", "standard", 6_000), &one_free, i);
            assert_eq!(d.shed, None, "{d:?}");
        }
        // Without the setting, nothing changes.
        let mut off = Admission::new(AdmissionConfig::default());
        contend(&mut off);
        let d = off.admit(&request("batch", "standard", 6_000), &one_free, 30);
        assert_eq!((d.shed, d.ttft_inflation), (None, None));
    }

    #[test]
    fn queued_prompts_where_the_flood_would_land_count_against_the_bound() {
        let mut a = bounded(3.0);
        contend(&mut a);
        let flooded = ttft_load(5_000.0, 556.0);
        // The cheapest replica holds a queued (maybe interactive) prompt: an engine prefills
        // it in the same step as the flood's, so it would wait for the flood too.
        let busy = [
            flooded,
            flooded,
            ttft_load(100.0, 66.0),
            ttft_load(0.0, 70.0),
        ];
        assert_eq!(
            a.admit(&request("batch", "standard", 6_000), &busy, 30)
                .shed,
            Some(ShedReason::TtftBound)
        );
        let drained = [flooded, flooded, ttft_load(0.0, 66.0), ttft_load(0.0, 70.0)];
        assert_eq!(
            a.admit(&request("batch", "standard", 6_000), &drained, 30)
                .shed,
            None
        );
        // Unknown replicas never count as free.
        let stale = ReplicaLoad {
            stale: true,
            ..ttft_load(0.0, 56.0)
        };
        assert!(a.replica_ttft_inflation(&stale).is_infinite());
        assert!(a.ttft_inflation(&[]).is_infinite());
        assert!(a.ttft_inflation_after(&[stale], 10).is_infinite());
    }

    #[test]
    fn the_routers_load_view_predicts_the_reference_ttft() {
        use crate::router::{EndpointMetrics, Router, RouterConfig};
        let mut router = Router::new(RouterConfig::default(), 1);
        for a in ["10.0.0.1:8000", "10.0.0.2:8000"] {
            router.upsert_endpoint(a).unwrap();
            router.update_metrics(a, EndpointMetrics::default(), 0);
        }
        let mut views = Vec::new();
        router.endpoint_loads(0, 512, &mut views);
        let a = bounded(2.0);
        let loads: Vec<ReplicaLoad> = views.iter().filter_map(ReplicaLoad::from_load).collect();
        assert_eq!(loads.len(), 2);
        assert_eq!(a.ttft_inflation(&loads), 1.0);
        assert_eq!(loads[0].ttft_ms, loads[0].idle_ttft_ms);
        assert!(loads[0].idle_ttft_ms > 0.0 && loads[0].ms_per_queued_token > 0.0);
        // A routed 6,000-token prompt queues on one endpoint and raises its predicted TTFT
        // by its prefill; the other stays idle.
        let flood = RouteRequest {
            prompt_tokens: 6_000,
            ..request("batch", "standard", 6_000)
        };
        router.route(&flood, 0, 1);
        router.endpoint_loads(0, 512, &mut views);
        let loads: Vec<ReplicaLoad> = views.iter().filter_map(ReplicaLoad::from_load).collect();
        let mut queued: Vec<f64> = loads.iter().map(|l| l.queued_tokens).collect();
        queued.sort_by(f64::total_cmp);
        assert_eq!(queued, [0.0, 6_000.0]);
        let busy = loads.iter().find(|l| l.queued_tokens > 0.0).unwrap();
        let added = busy.ttft_ms - busy.idle_ttft_ms;
        // (plus the decode batch term of the one sequence now there)
        assert!(
            (added - 6_000.0 * busy.ms_per_queued_token).abs() <= 2.0,
            "{busy:?}"
        );
        assert_eq!(a.ttft_inflation(&loads), 1.0);
        // The backlog drains with time; an unreachable endpoint is no candidate.
        router.endpoint_loads(10_000, 512, &mut views);
        assert!(views.iter().all(|v| v.queued_tokens == 0.0));
        router.mark_unreachable("10.0.0.1:8000");
        router.endpoint_loads(10_000, 512, &mut views);
        assert_eq!(views.iter().filter_map(ReplicaLoad::from_load).count(), 1);
    }

    #[test]
    fn validation_catches_unusable_settings() {
        assert!(AdmissionConfig::default().validate().is_ok());
        // Each spoils one setting of an otherwise valid configuration.
        let bad: [fn(&mut AdmissionConfig); 8] = [
            |c| c.queue_limit = 0.0,
            |c| c.standard_at = 0.5,
            |c| c.critical_at = Some(1.5),
            |c| c.fair_share_slack = 0.9,
            |c| c.max_ttft_inflation = Some(0.5),
            |c| c.max_ttft_inflation = Some(f64::NAN),
            |c| {
                c.max_ttft_inflation = Some(3.0);
                c.fairness = false;
            },
            |c| c.ttft_reference_tokens = 0,
        ];
        for spoil in bad {
            let mut c = AdmissionConfig::default();
            spoil(&mut c);
            assert!(c.validate().is_err(), "{c:?}");
        }
        let mut c = AdmissionConfig::default();
        c.tenants.insert(
            "t".into(),
            TenantPolicy {
                weight: -1.0,
                max_prompt_bytes: None,
            },
        );
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("tenants.t.weight")
        );
    }
}
