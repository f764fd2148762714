//! The four fleet numbers of issue #18: how much prefix reuse the traffic offers, how much the
//! router aimed for, how much the engines delivered, and why the rest was lost.
//!
//! - **available**: an online estimate of the workload's ceiling. For each request, the leading
//!   prompt blocks that some earlier request in a bounded recent window already had, wherever
//!   it was routed ([`ReuseWindow`]): the hits one LRU cache as large as the whole fleet's KV
//!   capacity ([`ReuseConfig`]), shared by every replica, would have served. The fleet's
//!   caches hold as much but are split over replicas, so a fleet only approaches it: it says
//!   what routing could win at most on this fleet.
//! - **aimed**: the cached tokens the router credited the chosen endpoint with (the decision's
//!   prediction, `RouterStats::predicted_cached_tokens` fleet-wide).
//! - **delivered**: what the engine reported serving from cache,
//!   `usage.prompt_tokens_details.cached_tokens`.
//! - **gap**: available less delivered, split by the reason the router attributes to each part
//!   ([`GapReason`]).
//!
//! All four are counted per outcome that reports prompt and cached tokens, in tokens, so every
//! ratio of two of them is over the same requests (a PromQL `rate` over `rate`).
//!
//! Sans-IO like the rest of the crate; memory is bounded by the window and
//! [`ReuseConfig::max_pools`].

use std::collections::VecDeque;

use hashbrown::HashMap;
use hashbrown::hash_map::Entry;
use serde::{Deserialize, Serialize};

/// The `router.reuse` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReuseConfig {
    /// Estimate the ceiling at all (off: no window, the available reuse counts 0).
    pub enabled: bool,
    /// Prompt blocks the ceiling's window remembers (least recently seen forgotten first); 0
    /// sizes it to the fleet: its endpoints' scraped KV capacity in the index's blocks, or
    /// [`DEFAULT_WINDOW_BLOCKS`] before any capacity is known.
    pub window_blocks: usize,
    /// The most blocks the window may hold however large the fleet: its memory bound (about 60
    /// bytes a block). 262,144 blocks are 16M tokens of approximate mode's 256-byte blocks.
    pub max_window_blocks: usize,
    /// Pools (models) counted apart; requests for further models count under
    /// [`OTHER_POOL`], so a client naming ever new models cannot grow the table.
    pub max_pools: usize,
}

impl ReuseConfig {
    /// Whether these are the defaults (left out of what copies are sent).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl Default for ReuseConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window_blocks: 0,
            max_window_blocks: 262_144,
            max_pools: 32,
        }
    }
}

impl ReuseConfig {
    /// The window's size for a fleet whose known KV capacity is `fleet_blocks` blocks (0: none
    /// known yet).
    pub fn window_for(&self, fleet_blocks: usize) -> usize {
        let wanted = match (self.enabled, self.window_blocks, fleet_blocks) {
            (false, _, _) => 0,
            (true, 0, 0) => DEFAULT_WINDOW_BLOCKS,
            (true, 0, fleet) => fleet,
            (true, fixed, _) => fixed,
        };
        wanted.min(self.max_window_blocks)
    }
}

/// The window of a fleet that has reported no KV capacity yet: about 4M tokens of approximate
/// mode's blocks.
pub const DEFAULT_WINDOW_BLOCKS: usize = 65_536;

/// The pool label of requests beyond [`ReuseConfig::max_pools`] models.
pub const OTHER_POOL: &str = "_other";

/// A bounded LRU set of recently seen prompt blocks (chained hashes: a block names its whole
/// prefix), the ceiling's memory.
#[derive(Debug, Clone, Default)]
pub struct ReuseWindow {
    /// Block hash → the sequence number it was last seen at.
    seen: HashMap<u64, u64>,
    /// `(hash, seq)` in the order seen; an entry whose seq is no longer the hash's in `seen`
    /// is stale and skipped (a block seen again moves to the back without a search).
    order: VecDeque<(u64, u64)>,
    seq: u64,
    capacity: usize,
}

impl ReuseWindow {
    /// A window of at most `capacity` blocks (0: it remembers nothing).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// How many of the first `hittable` of `blocks` (a prompt's chained hashes) were seen
    /// before, as a leading run; then remembers all of `blocks` as seen now.
    pub fn observe(&mut self, blocks: &[u64], hittable: usize) -> usize {
        if self.capacity == 0 {
            return 0;
        }
        // One map operation a block: the leading run of blocks already there is the match.
        let (mut matched, mut leading) = (0, true);
        for (i, &h) in blocks.iter().enumerate() {
            self.seq += 1;
            match self.seen.entry(h) {
                Entry::Occupied(mut seen) => {
                    *seen.get_mut() = self.seq;
                    if leading && i < hittable {
                        matched += 1;
                    }
                }
                Entry::Vacant(new) => {
                    new.insert(self.seq);
                    leading = false;
                }
            }
            self.order.push_back((h, self.seq));
        }
        self.evict();
        // Blocks seen again leave stale entries behind: drop them once they are half the queue.
        if self.order.len() > 2 * self.capacity.max(1) {
            let seen = &self.seen;
            self.order.retain(|(h, s)| seen.get(h) == Some(s));
        }
        matched
    }

    /// Sets the most blocks remembered, forgetting the least recently seen beyond it.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
        self.evict();
        if capacity == 0 {
            self.order.clear();
        }
    }

    fn evict(&mut self) {
        while self.seen.len() > self.capacity {
            let Some((h, s)) = self.order.pop_front() else {
                break;
            };
            if self.seen.get(&h) == Some(&s) {
                self.seen.remove(&h);
            }
        }
    }

    /// The most blocks remembered.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether it remembers nothing.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// Why part of the available reuse was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GapReason {
    /// The router chose an endpoint believed to hold less than another candidate: load, the
    /// guard, a session or a stored response outweighed the cache.
    LoadSpill,
    /// The router aimed at a hit on an exact endpoint and the engine delivered less: it evicted
    /// blocks the index still believed in.
    Eviction,
    /// The endpoint is load-only (its engine does not deliver what the index believes), so its
    /// belief was not credited, or it was credited on a probe and not delivered.
    Mismatch,
    /// Envoy sent the request to a fallback endpoint, not the one the router aimed at.
    Fallback,
    /// No candidate was believed to hold it: the window still had it, but every cache had
    /// evicted it (or the router's index had forgotten it).
    Unheld,
}

impl GapReason {
    /// Every reason, in metric order.
    pub const ALL: [GapReason; 5] = [
        GapReason::LoadSpill,
        GapReason::Eviction,
        GapReason::Mismatch,
        GapReason::Fallback,
        GapReason::Unheld,
    ];

    /// The metric label and the JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            GapReason::LoadSpill => "load_spill",
            GapReason::Eviction => "eviction",
            GapReason::Mismatch => "mismatch",
            GapReason::Fallback => "fallback",
            GapReason::Unheld => "unheld",
        }
    }
}

/// Gap tokens by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GapTokens {
    /// [`GapReason::LoadSpill`].
    pub load_spill: u64,
    /// [`GapReason::Eviction`].
    pub eviction: u64,
    /// [`GapReason::Mismatch`].
    pub mismatch: u64,
    /// [`GapReason::Fallback`].
    pub fallback: u64,
    /// [`GapReason::Unheld`].
    pub unheld: u64,
}

impl GapTokens {
    /// The tokens of one reason.
    pub fn get(&self, reason: GapReason) -> u64 {
        match reason {
            GapReason::LoadSpill => self.load_spill,
            GapReason::Eviction => self.eviction,
            GapReason::Mismatch => self.mismatch,
            GapReason::Fallback => self.fallback,
            GapReason::Unheld => self.unheld,
        }
    }

    fn add(&mut self, reason: GapReason, tokens: u64) {
        let slot = match reason {
            GapReason::LoadSpill => &mut self.load_spill,
            GapReason::Eviction => &mut self.eviction,
            GapReason::Mismatch => &mut self.mismatch,
            GapReason::Fallback => &mut self.fallback,
            GapReason::Unheld => &mut self.unheld,
        };
        *slot += tokens;
    }

    /// Every reason's tokens.
    pub fn total(&self) -> u64 {
        GapReason::ALL.iter().map(|r| self.get(*r)).sum()
    }
}

/// The four numbers summed over outcomes (of one endpoint, one pool or the fleet), in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReuseTotals {
    /// Outcomes counted (those reporting prompt and cached tokens).
    pub outcomes: u64,
    /// Their `usage.prompt_tokens`: the denominator of every share.
    pub prompt_tokens: u64,
    /// Reuse the traffic offered (the window's ceiling).
    pub available_tokens: u64,
    /// Reuse the router aimed for (credited cached tokens of the chosen endpoint).
    pub aimed_tokens: u64,
    /// Reuse the engines delivered (`cached_tokens`).
    pub delivered_tokens: u64,
    /// Available less delivered, by reason.
    pub gap_tokens: GapTokens,
}

impl ReuseTotals {
    /// Adds one outcome's numbers.
    pub fn add(&mut self, o: &ReuseOutcome) {
        self.outcomes += 1;
        self.prompt_tokens += u64::from(o.prompt);
        self.available_tokens += u64::from(o.aim.available);
        self.aimed_tokens += u64::from(o.aim.aimed);
        self.delivered_tokens += u64::from(o.delivered);
        for (reason, tokens) in o.gap() {
            self.gap_tokens.add(reason, u64::from(tokens));
        }
    }

    /// Adds another total (pools into the fleet).
    pub fn merge(&mut self, other: &ReuseTotals) {
        self.outcomes += other.outcomes;
        self.prompt_tokens += other.prompt_tokens;
        self.available_tokens += other.available_tokens;
        self.aimed_tokens += other.aimed_tokens;
        self.delivered_tokens += other.delivered_tokens;
        for r in GapReason::ALL {
            self.gap_tokens.add(r, other.gap_tokens.get(r));
        }
    }
}

/// What the router knew of one request's reuse when it chose its endpoint, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Aim {
    /// Reuse the window offered (the ceiling).
    pub available: u32,
    /// What the chosen endpoint was credited with.
    pub aimed: u32,
    /// What the index believed the chosen endpoint held, credited or not.
    pub believed: u32,
    /// The most any candidate was credited with.
    pub best_credited: u32,
    /// The most any candidate was believed to hold, credited or not.
    pub best_believed: u32,
    /// Whether the chosen endpoint was load-only (its belief not credited, or credited on a
    /// probe).
    pub load_only: bool,
    /// The prompt's tokens as the router counted them (the unit of the numbers above: canonical
    /// bytes at the ratio in force in approximate mode).
    pub prompt_tokens: u32,
}

impl Aim {
    /// The same numbers in the engine's tokens, given the prompt tokens the engine reported:
    /// scaled by `prompt / prompt_tokens` (approximate mode counts bytes at an assumed ratio)
    /// and at most `prompt − 1` (vLLM recomputes the last token), so they compare with what
    /// the engine delivered.
    pub fn in_engine_tokens(self, prompt: u32) -> Aim {
        let cap = prompt.saturating_sub(1);
        let scale = |n: u32| -> u32 {
            let scaled = if self.prompt_tokens == 0 {
                u64::from(n)
            } else {
                u64::from(n) * u64::from(prompt) / u64::from(self.prompt_tokens)
            };
            scaled.min(u64::from(cap)) as u32
        };
        Aim {
            available: scale(self.available),
            aimed: scale(self.aimed),
            believed: scale(self.believed),
            best_credited: scale(self.best_credited),
            best_believed: scale(self.best_believed),
            load_only: self.load_only,
            prompt_tokens: prompt,
        }
    }
}

/// One outcome's numbers: the decision's [`Aim`] and what the engine reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReuseOutcome {
    /// What the router knew when it chose, in the engine's tokens ([`Aim::in_engine_tokens`]).
    pub aim: Aim,
    /// `usage.prompt_tokens`.
    pub prompt: u32,
    /// `cached_tokens`, at most `prompt`.
    pub delivered: u32,
    /// Served by another endpoint than the chosen one.
    pub fallback: bool,
}

impl ReuseOutcome {
    /// The gap (available less delivered, 0 when delivered is more) split in at most two parts:
    /// what was aimed for and not delivered (eviction, mismatch or fallback), and what was
    /// available and not aimed for (load spill, mismatch or unheld).
    pub fn gap(&self) -> impl Iterator<Item = (GapReason, u32)> {
        let a = &self.aim;
        let aimed = a.aimed.min(a.available);
        let delivered = self.delivered.min(a.available);
        let short = aimed.saturating_sub(delivered);
        let short_reason = if self.fallback {
            GapReason::Fallback
        } else if a.load_only {
            GapReason::Mismatch
        } else {
            GapReason::Eviction
        };
        let missed = a.available - aimed.max(delivered);
        let missed_reason = if a.load_only && a.believed > a.aimed {
            GapReason::Mismatch
        } else if a.best_credited > a.aimed {
            GapReason::LoadSpill
        } else if a.best_believed > a.best_credited {
            GapReason::Mismatch
        } else {
            GapReason::Unheld
        };
        [(short_reason, short), (missed_reason, missed)]
            .into_iter()
            .filter(|(_, t)| *t > 0)
    }
}

/// Per-pool totals, bounded: the first [`ReuseConfig::max_pools`] models get their own, the
/// rest share [`OTHER_POOL`]'s.
#[derive(Debug, Clone, Default)]
pub struct PoolTotals {
    pools: Vec<(String, ReuseTotals)>,
    other: ReuseTotals,
}

/// Which of [`PoolTotals`]' entries a request counts under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolKey(Option<u16>);

impl PoolTotals {
    /// The key of `model`'s pool, adding it while there is room.
    pub fn key(&mut self, model: &str, max_pools: usize) -> PoolKey {
        if let Some(i) = self.pools.iter().position(|(m, _)| m == model) {
            return PoolKey(Some(i as u16));
        }
        if self.pools.len() < max_pools.min(usize::from(u16::MAX)) {
            self.pools.push((model.to_string(), ReuseTotals::default()));
            return PoolKey(Some((self.pools.len() - 1) as u16));
        }
        PoolKey(None)
    }

    /// Adds one outcome to its pool.
    pub fn add(&mut self, key: PoolKey, o: &ReuseOutcome) {
        match key.0.and_then(|i| self.pools.get_mut(usize::from(i))) {
            Some((_, t)) => t.add(o),
            None => self.other.add(o),
        }
    }

    /// The model `key` stands for ([`OTHER_POOL`] past the bound).
    pub fn name(&self, key: PoolKey) -> &str {
        key.0
            .and_then(|i| self.pools.get(usize::from(i)))
            .map_or(OTHER_POOL, |(m, _)| m.as_str())
    }

    /// Every pool's totals (by model; [`OTHER_POOL`] last when any request counted there).
    pub fn totals(&self) -> Vec<(String, ReuseTotals)> {
        let mut out = self.pools.clone();
        if self.other.outcomes > 0 {
            out.push((OTHER_POOL.to_string(), self.other));
        }
        out
    }

    /// The fleet's totals: every pool's summed.
    pub fn fleet(&self) -> ReuseTotals {
        let mut all = self.other;
        for (_, t) in &self.pools {
            all.merge(t);
        }
        all
    }
}

/// One outcome whose engine delivered less than the index believed: what `/debug/mismatch`
/// lists, to see where the router's and the engine's view of a prompt part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MismatchRecord {
    /// The decision the outcome answered.
    pub decision_id: u64,
    /// The endpoint the router chose.
    pub endpoint: String,
    /// The request's model (its pool).
    pub model: String,
    /// The chosen endpoint's routing state when it was chosen.
    pub state: crate::self_check::RoutingState,
    /// Whether the KV-event index scored it (false: the approximate index).
    pub precise: bool,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u32,
    /// What the router credited (aimed for).
    pub predicted_tokens: u32,
    /// What the index believed the endpoint held, credited or not.
    pub believed_tokens: u32,
    /// What the engine reported serving from cache.
    pub delivered_tokens: u32,
    /// Tokens of one engine block (`router.precise.block_tokens`), the unit of the next two.
    pub block_tokens: u32,
    /// Engine blocks the index believed the endpoint held.
    pub believed_blocks: u32,
    /// The first block the router believed in and the engine did not serve: where the two
    /// views of the prompt part (the delivered tokens in whole blocks).
    pub parting_block: u32,
    /// `now_ms` of the outcome.
    pub at_ms: u64,
}

impl MismatchRecord {
    /// Believed tokens the engine did not deliver.
    pub fn shortfall(&self) -> u32 {
        self.believed_tokens.saturating_sub(self.delivered_tokens)
    }
}

/// Recent shortfalls kept for `/debug/mismatch`; the worst [`MISMATCHES_SHOWN`] are shown.
pub const MISMATCHES_KEPT: usize = 256;
/// How many of the kept shortfalls [`MismatchLog::worst`] returns.
pub const MISMATCHES_SHOWN: usize = 32;

/// A bounded ring of recent outcomes that delivered less than the index believed.
#[derive(Debug, Clone, Default)]
pub struct MismatchLog {
    recent: VecDeque<MismatchRecord>,
}

impl MismatchLog {
    /// Keeps `record` (the oldest is dropped past [`MISMATCHES_KEPT`]).
    pub fn push(&mut self, record: MismatchRecord) {
        if self.recent.len() >= MISMATCHES_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(record);
    }

    /// The worst kept records (largest shortfall first, the newer first on ties), at most
    /// [`MISMATCHES_SHOWN`].
    pub fn worst(&self) -> Vec<MismatchRecord> {
        let mut all: Vec<&MismatchRecord> = self.recent.iter().rev().collect();
        all.sort_by_key(|r| std::cmp::Reverse(r.shortfall()));
        all.into_iter().take(MISMATCHES_SHOWN).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_finds_a_shared_prefix_wherever_it_went_and_forgets_the_least_recent() {
        let mut w = ReuseWindow::new(6);
        assert_eq!(w.observe(&[1, 2, 3], 3), 0, "nothing seen yet");
        // A second turn: its first three blocks were seen, the fourth is new.
        assert_eq!(w.observe(&[1, 2, 3, 4], 4), 3);
        // Only hittable blocks count (vLLM recomputes the last token).
        assert_eq!(w.observe(&[1, 2, 3, 4], 2), 2);
        // A run stops at the first unseen block.
        assert_eq!(w.observe(&[1, 9, 3], 3), 1);
        assert_eq!(w.len(), 5);
        // Bounded: three new blocks push out the two least recently seen (2, then 4).
        w.observe(&[10, 11, 12], 3);
        assert_eq!(w.len(), 6);
        assert_eq!(w.observe(&[4], 1), 0, "4 was seen least recently");
        // Touches do not grow the queue without bound.
        for _ in 0..100 {
            w.observe(&[1, 9], 2);
        }
        assert!(w.order.len() <= 12 + 2, "{}", w.order.len());
        let mut off = ReuseWindow::new(0);
        off.observe(&[1, 2], 2);
        assert_eq!(off.observe(&[1, 2], 2), 0);
        assert!(off.is_empty());
        // Shrunk, it forgets the least recently seen first.
        w.set_capacity(1);
        assert_eq!(w.len(), 1);
        assert_eq!(w.observe(&[9], 1), 1, "the block seen last stays");
        assert_eq!(w.observe(&[1], 1), 0, "the one before is forgotten");
    }

    #[test]
    fn the_window_is_as_large_as_the_fleets_kv_within_its_bound() {
        let auto = ReuseConfig::default();
        assert_eq!(
            auto.window_for(0),
            DEFAULT_WINDOW_BLOCKS,
            "no capacity known yet"
        );
        assert_eq!(auto.window_for(10_000), 10_000);
        assert_eq!(auto.window_for(10_000_000), auto.max_window_blocks);
        let fixed = ReuseConfig {
            window_blocks: 500,
            ..ReuseConfig::default()
        };
        assert_eq!(fixed.window_for(10_000), 500);
        let off = ReuseConfig {
            enabled: false,
            ..ReuseConfig::default()
        };
        assert_eq!(off.window_for(10_000), 0);
    }

    fn outcome(aim: Aim, delivered: u32, fallback: bool) -> Vec<(GapReason, u32)> {
        ReuseOutcome {
            aim,
            prompt: 2_000,
            delivered,
            fallback,
        }
        .gap()
        .collect()
    }

    #[test]
    fn the_gap_is_split_by_the_reason_the_router_knows() {
        let held = Aim {
            available: 1_000,
            aimed: 1_000,
            believed: 1_000,
            best_credited: 1_000,
            best_believed: 1_000,
            load_only: false,
            prompt_tokens: 2_000,
        };
        assert!(outcome(held, 1_000, false).is_empty(), "all delivered");
        assert_eq!(
            outcome(held, 400, false),
            [(GapReason::Eviction, 600)],
            "aimed on an exact endpoint, less delivered"
        );
        assert_eq!(outcome(held, 400, true), [(GapReason::Fallback, 600)]);
        let spilled = Aim {
            aimed: 0,
            believed: 0,
            ..held
        };
        assert_eq!(outcome(spilled, 0, false), [(GapReason::LoadSpill, 1_000)]);
        let load_only = Aim {
            aimed: 0,
            best_credited: 0,
            load_only: true,
            ..held
        };
        assert_eq!(outcome(load_only, 0, false), [(GapReason::Mismatch, 1_000)]);
        let probed = Aim {
            load_only: true,
            ..held
        };
        assert_eq!(outcome(probed, 0, false), [(GapReason::Mismatch, 1_000)]);
        let unheld = Aim {
            aimed: 0,
            believed: 0,
            best_credited: 0,
            best_believed: 0,
            ..held
        };
        assert_eq!(outcome(unheld, 0, false), [(GapReason::Unheld, 1_000)]);
        // Partly aimed: the index held 600 of the 1,000 the window had; 500 delivered.
        let part = Aim {
            aimed: 600,
            believed: 600,
            best_credited: 600,
            best_believed: 600,
            ..held
        };
        assert_eq!(
            outcome(part, 500, false),
            [(GapReason::Eviction, 100), (GapReason::Unheld, 400)]
        );
        // Delivered beyond the window's ceiling (the engine's cache outlasts it): no gap.
        assert!(outcome(part, 1_500, false).is_empty());
    }

    #[test]
    fn totals_add_up_per_pool_and_for_the_fleet() {
        let mut pools = PoolTotals::default();
        let a = pools.key("a", 2);
        let b = pools.key("b", 2);
        let c = pools.key("c", 2);
        assert_eq!(pools.key("a", 2), a);
        let o = ReuseOutcome {
            aim: Aim {
                available: 100,
                aimed: 80,
                believed: 80,
                best_credited: 80,
                best_believed: 80,
                load_only: false,
                prompt_tokens: 300,
            },
            prompt: 300,
            delivered: 50,
            fallback: false,
        };
        pools.add(a, &o);
        pools.add(b, &o);
        pools.add(c, &o);
        pools.add(c, &o);
        let totals = pools.totals();
        let names: Vec<&str> = totals.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(names, ["a", "b", OTHER_POOL]);
        assert_eq!(totals[2].1.outcomes, 2);
        let fleet = pools.fleet();
        assert_eq!(fleet.outcomes, 4);
        assert_eq!(fleet.prompt_tokens, 1_200);
        assert_eq!(
            (
                fleet.available_tokens,
                fleet.aimed_tokens,
                fleet.delivered_tokens
            ),
            (400, 320, 200)
        );
        assert_eq!(fleet.gap_tokens.eviction, 4 * 30);
        assert_eq!(fleet.gap_tokens.unheld, 4 * 20);
        assert_eq!(
            fleet.gap_tokens.total(),
            fleet.available_tokens - fleet.delivered_tokens
        );
    }

    #[test]
    fn the_routers_token_estimate_is_brought_to_the_engines_count() {
        // Approximate mode counted 1,200 tokens (bytes at 4 a token); the engine counted 1,000.
        let aim = Aim {
            available: 1_200,
            aimed: 600,
            believed: 600,
            best_credited: 900,
            best_believed: 900,
            load_only: false,
            prompt_tokens: 1_200,
        };
        let engine = aim.in_engine_tokens(1_000);
        assert_eq!(
            (engine.available, engine.aimed, engine.best_credited),
            (999, 500, 750),
            "scaled by 1,000 / 1,200, and never the last token"
        );
        assert_eq!(engine.prompt_tokens, 1_000);
        let unknown = Aim {
            prompt_tokens: 0,
            ..aim
        };
        assert_eq!(unknown.in_engine_tokens(1_000).aimed, 600);
    }

    #[test]
    fn the_mismatch_log_is_bounded_and_shows_the_worst_first() {
        let mut log = MismatchLog::default();
        for i in 0..(MISMATCHES_KEPT as u64 + 10) {
            log.push(MismatchRecord {
                decision_id: i,
                endpoint: "e".into(),
                model: "m".into(),
                state: crate::self_check::RoutingState::Exact,
                precise: false,
                prompt_tokens: 1_000,
                predicted_tokens: 900,
                believed_tokens: 900,
                delivered_tokens: i as u32,
                block_tokens: 16,
                believed_blocks: 56,
                parting_block: i as u32 / 16,
                at_ms: i,
            });
        }
        let worst = log.worst();
        assert_eq!(worst.len(), MISMATCHES_SHOWN);
        // Records 0..10 were dropped: the worst kept delivered the least, decision 10.
        assert_eq!(worst[0].decision_id, 10);
        assert!(
            worst
                .windows(2)
                .all(|w| w[0].shortfall() >= w[1].shortfall())
        );
    }

    #[test]
    fn reasons_have_the_wire_spellings() {
        for r in GapReason::ALL {
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.as_str())
            );
        }
    }
}
