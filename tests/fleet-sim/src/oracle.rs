//! The oracle: a routing limit, not a router. It sees every engine's exact state (cache
//! contents, queue, running batch, even the generated lengths of requests already inside) and
//! sends each request to the replica where its own time to first token is lowest, found by
//! cloning each candidate engine and stepping the clone forward, with this request added, until
//! the request's first token. Later arrivals are ignored.
//!
//! It is a *greedy per-request* limit: it minimises each request's TTFT given the state it
//! arrives to, not the fleet's TTFT distribution. Placing a request where it starts soonest can
//! crowd a replica that a later request would have wanted (or evict a prefix a later request
//! would have hit), so a clairvoyant scheduler that planned the whole trace could do better,
//! and a real router that keeps affinity can beat it, at the tail and on saturated cells even
//! at the median. It bounds what per-request placement on current state can achieve for the
//! request at hand; the gap to it is what better estimates of that could win.
//!
//! Cost: up to one engine clone and a few simulated steps per replica per request (candidates
//! are probed fewest-requests first and a probe stops once it is slower than the best so far).

use vllm_sim::{Engine, RequestEvent};

use crate::des::arriving;
use crate::policy::{ExactFleet, Policy, PolicyRequest, SplitMix};

/// Request id the oracle's probe uses inside a cloned engine (never a workload index).
const PROBE_ID: usize = usize::MAX >> 1;
/// Steps a probe simulates at most before giving up on a candidate.
const MAX_PROBE_STEPS: usize = 200_000;

/// When `tokens` arriving at `now_ms` would get its first token on `engine` (ms after
/// `now_ms`), given the engine's exact state; `busy_until_ms` is the end of its step in flight.
/// `None` when the engine refuses the request, cannot make progress, or the first token would
/// come later than `bound_ms` after arrival (the caller already has a better candidate).
pub fn probe_ttft_ms(
    engine: &Engine,
    busy_until_ms: Option<f64>,
    tokens: &[u32],
    now_ms: f64,
    bound_ms: f64,
) -> Option<f64> {
    let mut clone = engine.clone();
    // The probe's own output length does not change when its first token comes.
    clone
        .add_request(arriving(PROBE_ID, tokens.to_vec(), 1, now_ms))
        .ok()?;
    let mut t = busy_until_ms.unwrap_or(now_ms).max(now_ms);
    for _ in 0..MAX_PROBE_STEPS {
        let out = clone.step(t / 1000.0);
        if out.num_scheduled == 0 && out.events.is_empty() {
            return None;
        }
        let end_ms = (out.end_s * 1000.0).max(t);
        // No first token can come before the end of the step that is running.
        if end_ms - now_ms > bound_ms {
            return None;
        }
        let first = out.events.iter().any(|e| {
            matches!(e, RequestEvent::FirstToken { request, .. } if *request as usize == PROBE_ID)
        });
        if first {
            return Some(end_ms - now_ms);
        }
        t = end_ms;
    }
    None
}

/// The exact-best replica for `tokens` at `now_ms`: lowest probed TTFT; equal TTFTs go to the
/// replica with the fewest requests inside, then at random.
pub fn best_replica(
    fleet: &ExactFleet<'_>,
    tokens: &[u32],
    now_ms: f64,
    rng: &mut SplitMix,
) -> usize {
    let n = fleet.engines.len();
    // Probe the likely best first, so the bound prunes the rest early.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| fleet.engines[i].num_requests());
    let mut best = f64::INFINITY;
    let mut ties: Vec<usize> = Vec::new();
    for &i in &order {
        let Some(ttft) = probe_ttft_ms(
            &fleet.engines[i],
            fleet.busy_until_ms[i],
            tokens,
            now_ms,
            best,
        ) else {
            continue;
        };
        if ttft < best {
            best = ttft;
            ties.clear();
            ties.push(i);
        } else if ttft == best {
            ties.push(i);
        }
    }
    if ties.is_empty() {
        return rng.below(n);
    }
    let fewest = ties
        .iter()
        .map(|&i| fleet.engines[i].num_requests())
        .min()
        .unwrap_or(0);
    ties.retain(|&i| fleet.engines[i].num_requests() == fewest);
    ties[rng.below(ties.len())]
}

/// How much later than the exact best `pick` would give `tokens` its first token, given the
/// fleet's exact state at `now_ms` (ms, 0 when `pick` is the best): a decision's *placement
/// regret* against the greedy oracle. Like the oracle it ignores later arrivals, so it measures
/// the decision, not the request's eventual TTFT. `None` when `pick` refuses the request or
/// cannot make progress.
pub fn regret_ms(fleet: &ExactFleet<'_>, tokens: &[u32], now_ms: f64, pick: usize) -> Option<f64> {
    let picked = probe_ttft_ms(
        fleet.engines.get(pick)?,
        fleet.busy_until_ms.get(pick).copied().flatten(),
        tokens,
        now_ms,
        f64::INFINITY,
    )?;
    // Only candidates faster than the pick matter: it is the bound that prunes the rest.
    let mut best = picked;
    for (i, engine) in fleet.engines.iter().enumerate() {
        if i == pick {
            continue;
        }
        if let Some(t) = probe_ttft_ms(engine, fleet.busy_until_ms[i], tokens, now_ms, best) {
            best = best.min(t);
        }
    }
    Some(picked - best)
}

/// The `oracle` policy (see the module docs).
pub struct Oracle {
    rng: SplitMix,
}

impl Oracle {
    /// An oracle breaking ties with `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix(seed),
        }
    }
}

impl Policy for Oracle {
    fn name(&self) -> &str {
        "oracle"
    }
    fn route(&mut self, _: &PolicyRequest<'_>, _: f64) -> usize {
        // Only reached without exact state (the DES always offers it).
        0
    }
    fn route_exact(
        &mut self,
        request: &PolicyRequest<'_>,
        fleet: &ExactFleet<'_>,
        now_ms: f64,
    ) -> Option<usize> {
        Some(best_replica(fleet, request.tokens, now_ms, &mut self.rng))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_sim::{EngineConfig, Profile};

    fn engine() -> Engine {
        let mut cfg = EngineConfig::new(Profile::llama8b_h100());
        cfg.kv_events = false;
        Engine::new(cfg).unwrap()
    }

    fn run_to_idle(e: &mut Engine) -> f64 {
        let mut t = 0.0;
        while e.has_work() {
            t = e.step(t).end_s;
        }
        t * 1000.0
    }

    /// Three replicas: 0 holds the request's 8,000-token prefix in cache, 1 is idle and cold,
    /// 2 has the prefix too but is busy prefilling a long prompt. The oracle must pick 0, and
    /// the probes must order them as a direct simulation does.
    #[test]
    fn picks_the_exact_best_replica() {
        let prefix: Vec<u32> = (1000..9000).collect();
        let mut request = prefix.clone();
        request.extend(20_000..20_200);
        let mut warm = engine();
        warm.add_request(arriving(1, prefix.clone(), 1, 0.0))
            .unwrap();
        let done = run_to_idle(&mut warm);
        let cold = engine();
        let mut busy = warm.clone();
        busy.add_request(arriving(2, (50_000..90_000).collect(), 4, done))
            .unwrap();
        let out = busy.step(done / 1000.0);
        let engines = vec![warm.clone(), cold.clone(), busy.clone()];
        let busy_until = vec![None, None, Some(out.end_s * 1000.0)];
        let fleet = ExactFleet {
            engines: &engines,
            busy_until_ms: &busy_until,
        };
        let now = done;
        let ttft: Vec<f64> = (0..3)
            .map(|i| {
                probe_ttft_ms(&engines[i], busy_until[i], &request, now, f64::INFINITY).unwrap()
            })
            .collect();
        assert!(ttft[0] < ttft[1] && ttft[0] < ttft[2], "{ttft:?}");
        // A direct run of the warm engine gives the same first-token time as its probe.
        let mut direct = warm.clone();
        direct
            .add_request(arriving(7, request.clone(), 1, now))
            .unwrap();
        let first = direct.step(now / 1000.0).end_s * 1000.0 - now;
        assert!((first - ttft[0]).abs() < 1e-9, "{first} vs {}", ttft[0]);
        let mut rng = SplitMix(1);
        assert_eq!(best_replica(&fleet, &request, now, &mut rng), 0);
        // The regret of each pick is its probe's distance from the best one.
        assert_eq!(regret_ms(&fleet, &request, now, 0), Some(0.0));
        for i in 1..3 {
            let regret = regret_ms(&fleet, &request, now, i).unwrap();
            assert!((regret - (ttft[i] - ttft[0])).abs() < 1e-9, "{i}: {regret}");
        }
        // A bound below the best prunes every candidate.
        assert!(probe_ttft_ms(&engines[0], None, &request, now, ttft[0] / 2.0).is_none());
    }
}
