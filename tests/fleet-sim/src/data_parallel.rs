//! Data-parallel servers (issue #18 point 4): `fleet-sim compare --data-parallel-size N`
//! groups the fleet's replicas into servers of `N` consecutive engines, as vLLM runs
//! `--data-parallel-size N` behind one API server.
//!
//! A router that knows ranks picks an engine (and sends `X-data-parallel-rank`); one that does
//! not sees each server as a single endpoint, and the server's own load balancer picks the
//! rank ([`RankBlind`]). Which peers know ranks, as their upstreams stand (December 2026):
//! kvroute (an endpoint per rank), Dynamo (its KV router's workers are `(worker_id,
//! dp_rank)` pairs, `lib/kv-router`), the SGLang gateway (its DP-aware routing) and the
//! oracle do; llm-d's scorers key their state by pod (gateway-api-inference-extension issue
//! #2699: the approximate index is keyed by pod name; llm-d-kv-cache issue #357: the
//! KV-event indexer ignores the rank) and plain load balancers (round robin, least request)
//! pick servers.

use crate::policy::{Policy, PolicyRequest, ReplicaSnapshot, Served};
use scorer_core::calibration::EngineCounters;
use scorer_core::precise::KvEvent;
use vllm_sim::server::dp::balance_score;

/// The policies whose real routers pick a data-parallel rank themselves.
pub const RANK_AWARE: &[&str] = &[
    "kvroute",
    "kvroute-precise",
    "kvroute-local",
    "dynamo",
    "sglang-cache-aware",
    "sglang-legacy",
    "oracle",
];

/// Whether the policy spec `spec` (`name` or `name:options`) picks ranks itself.
pub fn is_rank_aware(spec: &str) -> bool {
    let name = spec.split_once(':').map_or(spec, |(name, _)| name);
    RANK_AWARE.contains(&name)
}

/// A rank-blind router in front of data-parallel servers: `inner` routes over servers (built
/// for `replicas / ranks` endpoints, fed each server's summed metrics and every rank's KV
/// events under the server's index), then the server picks the rank as vLLM's DP client does
/// (the lowest [`balance_score`], the first rank on ties), with the engines' counts as of the
/// last scrape.
pub struct RankBlind {
    inner: Box<dyn Policy>,
    ranks: usize,
    /// Requests each engine's server sent it that have not finished.
    in_flight: Vec<u32>,
    /// Each engine's last scraped state.
    snapshots: Vec<Option<ReplicaSnapshot>>,
}

impl RankBlind {
    /// `inner` built for `replicas / ranks` servers of `ranks` engines each.
    pub fn new(inner: Box<dyn Policy>, replicas: usize, ranks: usize) -> Self {
        Self {
            inner,
            ranks: ranks.max(1),
            in_flight: vec![0; replicas],
            snapshots: vec![None; replicas],
        }
    }

    /// The engine of `server` vLLM's balancer picks.
    fn pick_rank(&self, server: usize) -> usize {
        let first = server * self.ranks;
        let score = |engine: usize| {
            let in_flight = self.in_flight.get(engine).copied().unwrap_or(0);
            let s = self
                .snapshots
                .get(engine)
                .copied()
                .flatten()
                .unwrap_or_default();
            balance_score(in_flight, s.waiting, s.running, s.kv_usage)
        };
        (first..first + self.ranks)
            .min_by(|&a, &b| score(a).total_cmp(&score(b)).then(a.cmp(&b)))
            .unwrap_or(first)
    }
}

/// One server's metrics from its engines': counts and capacity summed, cache usage weighted
/// by capacity (what a scrape summing the page's `engine` series reads).
fn server_snapshot(engines: &[ReplicaSnapshot]) -> Option<ReplicaSnapshot> {
    let first = engines.first()?;
    let capacity: u64 = engines.iter().map(|e| e.capacity_tokens).sum();
    let used: f64 = engines
        .iter()
        .map(|e| e.kv_usage * e.capacity_tokens as f64)
        .sum();
    let sum = |f: fn(&EngineCounters) -> f64| engines.iter().map(|e| f(&e.counters)).sum();
    Some(ReplicaSnapshot {
        running: engines.iter().map(|e| e.running).sum(),
        waiting: engines.iter().map(|e| e.waiting).sum(),
        kv_usage: if capacity > 0 {
            used / capacity as f64
        } else {
            first.kv_usage
        },
        capacity_tokens: capacity,
        block_size: first.block_size,
        max_batched_tokens: first.max_batched_tokens,
        max_model_len: first.max_model_len,
        counters: EngineCounters {
            prompt_tokens: sum(|c| c.prompt_tokens),
            prefix_cache_hit_tokens: sum(|c| c.prefix_cache_hit_tokens),
            prefill_computed_tokens: sum(|c| c.prefill_computed_tokens),
            prefill_seconds: sum(|c| c.prefill_seconds),
            prefill_count: sum(|c| c.prefill_count),
            itl_seconds: sum(|c| c.itl_seconds),
            itl_count: sum(|c| c.itl_count),
        },
    })
}

impl Policy for RankBlind {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn route(&mut self, request: &PolicyRequest<'_>, now_ms: f64) -> usize {
        let server = self.inner.route(request, now_ms);
        let engine = self.pick_rank(server);
        if let Some(n) = self.in_flight.get_mut(engine) {
            *n += 1;
        }
        engine
    }

    fn on_metrics(&mut self, replicas: &[ReplicaSnapshot], now_ms: f64) {
        for (slot, s) in self.snapshots.iter_mut().zip(replicas) {
            *slot = Some(*s);
        }
        let servers: Vec<ReplicaSnapshot> = replicas
            .chunks(self.ranks)
            .filter_map(server_snapshot)
            .collect();
        self.inner.on_metrics(&servers, now_ms);
    }

    fn on_first_token(&mut self, id: usize, replica: usize, now_ms: f64) {
        self.inner.on_first_token(id, replica / self.ranks, now_ms);
    }

    fn on_finish(&mut self, id: usize, replica: usize, now_ms: f64, served: Served) {
        if let Some(n) = self.in_flight.get_mut(replica) {
            *n = n.saturating_sub(1);
        }
        self.inner
            .on_finish(id, replica / self.ranks, now_ms, served);
    }

    fn on_refused(&mut self, id: usize, replica: usize, now_ms: f64) {
        if let Some(n) = self.in_flight.get_mut(replica) {
            *n = n.saturating_sub(1);
        }
        self.inner.on_refused(id, replica / self.ranks, now_ms);
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_ms: f64) {
        self.inner
            .on_kv_events(replica / self.ranks, events, now_ms);
    }

    fn wants_kv_events(&self) -> bool {
        self.inner.wants_kv_events()
    }

    fn metrics_interval_ms(&self) -> Option<f64> {
        self.inner.metrics_interval_ms()
    }

    fn holds_in_queue(&mut self, request: &PolicyRequest<'_>, now_ms: f64) -> bool {
        self.inner.holds_in_queue(request, now_ms)
    }

    fn predicted_cached_tokens(&self, id: usize) -> Option<u32> {
        self.inner.predicted_cached_tokens(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::build;

    fn snapshot(running: u32, waiting: u32) -> ReplicaSnapshot {
        ReplicaSnapshot {
            running,
            waiting,
            kv_usage: 0.1,
            capacity_tokens: 1000,
            block_size: 16,
            max_batched_tokens: 8192,
            counters: EngineCounters::default(),
            max_model_len: 0,
        }
    }

    #[test]
    fn a_blind_router_picks_the_server_and_the_server_picks_its_least_loaded_rank() {
        // Round robin over 2 servers of 4 ranks: servers alternate, and within a server the
        // ranks fill lowest first as in-flight requests count against them.
        let inner = build("round-robin", 2, 1).unwrap();
        let mut p = RankBlind::new(inner, 8, 4);
        let tokens = [1u32, 2, 3];
        let r = PolicyRequest {
            id: 0,
            tokens: &tokens,
            max_tokens: None,
            session: None,
            marked_tokens: 0,
            api: scorer_core::protocol::ApiKind::Chat,
        };
        let picks: Vec<usize> = (0..6).map(|_| p.route(&r, 0.0)).collect();
        assert_eq!(picks, vec![0, 4, 1, 5, 2, 6]);
        // A scrape showing rank 0 busy moves the next pick of server 0 past it.
        p.on_finish(0, 0, 1.0, Served::default());
        p.on_finish(0, 1, 1.0, Served::default());
        p.on_finish(0, 2, 1.0, Served::default());
        let mut scraped = vec![snapshot(0, 0); 8];
        scraped[0] = snapshot(3, 0);
        p.on_metrics(&scraped, 2.0);
        assert_eq!(p.route(&r, 3.0), 1, "server 0: rank 0 runs three");
        assert_eq!(p.route(&r, 3.0), 7, "server 1: only its rank 3 is free");
    }

    #[test]
    fn rank_awareness_follows_the_routers_sources() {
        assert!(is_rank_aware("kvroute-local:proxies=2"));
        assert!(is_rank_aware("dynamo"));
        assert!(!is_rank_aware("llmd-optimized"));
        assert!(!is_rank_aware("round-robin"));
    }
}
