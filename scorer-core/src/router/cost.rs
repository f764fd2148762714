//! The cost of one candidate (stage 3 of a decision): the prefix it holds, the analytic
//! estimate of wait, prefill and decode there, the learned correction, and the order the
//! candidates are then tried in.

use super::*;

/// The learned model's adjustment of a candidate's cost: `blend × (learned − analytic)` for
/// the wait-and-prefill part (the endpoint-invariant overhead left out, so warm and cold
/// endpoints stay comparable) and for the weighted decode part. Zero while the endpoint has
/// fewer than `min_samples` outcomes or the model is disabled.
pub(super) fn learned_correction(
    config: &LatencyConfig,
    samples: u32,
    predicted: &LatencyPrediction,
    analytic_ttft_ms: f64,
    weighted_output_tokens: f64,
    analytic_tpot_ms: f64,
) -> f64 {
    if !config.enabled || samples < config.min_samples {
        return 0.0;
    }
    let blend = config.blend.clamp(0.0, 1.0);
    let ttft = predicted.ttft_variable_ms - analytic_ttft_ms;
    let decode = weighted_output_tokens * (predicted.tpot_ms - analytic_tpot_ms);
    let correction = blend * (ttft + decode);
    if correction.is_finite() {
        correction
    } else {
        0.0
    }
}

/// Stage 3e: a candidate whose latency model is still cold (fewer than `min_samples`
/// outcomes) is scored with the warm candidates' median correction instead of none. Without
/// it, warm models that predict faster than the analytic prior beat every cold replica, the
/// cold one never gets the outcomes that would warm it, and a replica that joins an idle pool
/// stays unused (a rich-get-richer loop). The median stands for the pool's typical hardware; a
/// cold replica that differs learns its own correction once it is served.
pub(super) fn cold_latency_from_warm(
    candidates: &mut [(EndpointId, CandidateScore)],
    min_samples: u32,
) {
    let mut warm: Vec<f64> = candidates
        .iter()
        .filter(|(_, c)| c.latency_samples >= min_samples)
        .map(|(_, c)| c.latency_ms)
        .collect();
    if warm.len() == candidates.len() {
        return;
    }
    let Some(median) = crate::self_check::median(&mut warm) else {
        return;
    };
    for (_, c) in candidates
        .iter_mut()
        .filter(|(_, c)| c.latency_samples < min_samples)
    {
        c.latency_ms = median;
        c.total_ms += median;
    }
}

/// Stage 3a: writes each index's matched prefix depth per endpoint slot into `buffers` (the
/// event-fed ones only for a precise request) and returns them as a view.
pub(super) fn look_up_prefixes<'s>(
    buffers: &'s mut DepthBuffers,
    index: &PrefixIndex,
    precise: &PreciseIndexes,
    request: &RouteRequest,
    n: usize,
    events_usable: impl Fn(usize) -> bool,
) -> PrefixDepths<'s> {
    let DepthBuffers {
        matched,
        gpu,
        spec,
        offload,
    } = buffers;
    let matched = zeroed(matched, n);
    record_depths(index, &request.block_hashes, matched);
    let is_precise = !request.token_block_hashes.is_empty();
    // Only precise requests read these (through `cached_prefix`).
    let per_endpoint = if is_precise { n } else { 0 };
    let gpu = zeroed(gpu, per_endpoint);
    let spec = zeroed(spec, per_endpoint);
    let offload = zeroed(offload, per_endpoint);
    if is_precise {
        record_depths(&precise.gpu, &request.token_block_hashes, gpu);
        record_depths(&precise.speculative, &request.token_block_hashes, spec);
        record_depths(&precise.offload, &request.token_block_hashes, offload);
    }
    let held = |depths: &[usize]| depths.iter().any(|&d| d > 0);
    // Read only for a precise request the events place nowhere (an approximate one, most of
    // them, pays nothing); the history of an endpoint whose events are not used is read for it
    // anyway, so only the others' counts.
    let history_only = is_precise
        && !(held(gpu) || held(spec) || held(offload))
        && matched
            .iter()
            .enumerate()
            .any(|(i, &d)| d > 0 && events_usable(i));
    PrefixDepths {
        approximate: matched,
        gpu,
        speculative: spec,
        offload,
        history_only,
    }
}

/// Stage 3b, per candidate: the prompt prefix `c` is believed to hold. A precise request on an
/// endpoint with a live event stream reads the event-fed indexes (GPU or speculative, then
/// offload tiers at their weight); any other reads the approximate index. The approximate index
/// evicts at decision time, as the queued prefills will; the event-fed one learns of evictions
/// only when they happen, after this request would be admitted, so its cached prefix is
/// discounted for the queue ahead ([`lost_before_admission`]).
///
/// A precise request that the events place nowhere (every block evicted from every replica)
/// while the routing history places it on a replica whose events are used is scored on the
/// approximate index (a replica whose events are not used is scored on it anyway, so its
/// history alone changes nothing for the others): the history says where
/// this prefix's requests have been going, and a miss sent there is prefilled where its
/// group's next requests will look. Placed by load instead, the misses of caches that thrash
/// spread each group over every replica and its later requests hit less (fleet-sim's
/// shared-prefix on L4s at load 1.2, tuning split: hit rate 0.136 against approximate mode's
/// 0.242; 0.232 with this).
pub(super) fn cached_prefix(
    c: Candidate<'_>,
    depths: &PrefixDepths<'_>,
    shape: &RequestShape<'_>,
    indexes: &PreciseIndexes,
    config: &PreciseConfig,
) -> CachedPrefix {
    let i = usize::from(c.id.0);
    let (slot, block_tokens, hittable) = (c.slot, shape.block_tokens, shape.hittable_blocks);
    let precise = shape.precise && slot.precise_usable() && !depths.history_only;
    if !precise {
        let tokens = (depths.approximate[i] as f64 * shape.tokens_per_block)
            .min(shape.prompt_tokens - 1.0)
            .max(0.0);
        return CachedPrefix {
            // The engine blocks the hit covers: the unit precise mode counts in.
            blocks: (tokens / block_tokens.max(1) as f64) as usize,
            tokens,
            precise,
        };
    }
    let gpu = depths.gpu[i];
    let on_gpu = gpu.max(depths.speculative[i]).min(hittable);
    let offloaded = depths.offload[i].min(hittable).saturating_sub(on_gpu);
    let tokens =
        (on_gpu * block_tokens) as f64 + config.offload_weight * (offloaded * block_tokens) as f64;
    let tokens = tokens.min(shape.prompt_tokens - 1.0).max(0.0);
    let tokens = if slot.backlog_tokens > 0.0 && gpu > 0 {
        let gpu_index = &indexes.gpu;
        let prefix = &shape.token_blocks[..gpu];
        // Sampled, as the in-flight KV is: every `KV_SAMPLE_STEP`th block and the last, each
        // with how many blocks were touched before it here.
        let ages = prefix
            .iter()
            .enumerate()
            .skip(KV_SAMPLE_STEP - 1)
            .step_by(KV_SAMPLE_STEP)
            .chain(prefix.iter().enumerate().next_back())
            .filter_map(|(at, &h)| gpu_index.older_than(c.id, h).map(|older| (at, older)));
        let cache = CacheView {
            indexed_tokens: (gpu_index.len_for(c.id) * block_tokens) as f64,
            block_tokens: block_tokens.max(1),
            full: indexes.evicting.contains(c.id),
        };
        // Only the GPU tier is evicted to make room; offloaded blocks stay.
        let at_risk = ((on_gpu * block_tokens) as f64).min(tokens);
        tokens - lost_before_admission(slot, cache, at_risk, ages, shape.kv_blocks)
    } else {
        tokens
    };
    CachedPrefix {
        blocks: on_gpu,
        tokens,
        precise,
    }
}

/// Stage 3c, per candidate: the analytic estimate of how long the request would wait and
/// prefill on `c` with `cached_tokens` of it cached (see the module doc).
pub(super) fn cost_terms(
    c: Candidate<'_>,
    cached_tokens: f64,
    shape: &RequestShape<'_>,
    s: &ScoringConfig,
) -> CostTerms {
    let slot = c.slot;
    let prompt_tokens = shape.prompt_tokens;
    let output_tokens = shape.output_tokens;
    let uncached = prompt_tokens - cached_tokens;
    let (unknown_waiting, active) = slot.unseen_waiting_and_active(c.fresh);
    let kv_usage = c.fresh.map_or(0.0, |m| m.kv_usage);
    let rates = &slot.rates;
    let queue_ms = (slot.backlog_tokens + f64::from(unknown_waiting) * s.unknown_request_tokens)
        / rates.prefill_tokens_per_ms;
    let prefill_ms = uncached / rates.prefill_tokens_per_ms;
    let capacity = slot.kv_capacity_tokens();
    // Time per output token with the cache `fill` full: the rates' line.
    let itl_at = |fill: f64| {
        rates.itl_ms_idle + (rates.itl_ms_full - rates.itl_ms_idle) * fill.clamp(0.0, 1.0)
    };
    // At the scraped usage: what the learned latency model's features see, so its correction
    // (`steering`) is taken against this step.
    let itl_ms = itl_at(kv_usage);
    // The decode estimate's step time: a decode step reads every running sequence's whole
    // context, a prefix they share once per sequence, which the scraped usage (shared blocks
    // once, and a scrape behind a burst) leaves out. The learned model cannot see it either,
    // so it stays on top of that model's correction.
    let read_fill = capacity.map_or(0.0, |c| {
        (slot.inflight_kv.context_tokens() + prompt_tokens) / c
    });
    let decode_itl_ms = itl_at(kv_usage.max(read_fill));
    // This request's own prefill counts as prefill flowing in, except for a request scored to
    // its last token on an idle replica (nothing running there): its prefill is done before
    // its decode starts, and no one else's decode runs beside it. Counted anyway, a miss on
    // an idle replica read as seconds of contention (a 4,300-token tool prompt at the prior
    // rate: 13.8 s), and an agent fleet left the replicas its shared prompt had not reached
    // idle for good. For a request scored to its first token the own-prefill part stays:
    // there it stands for the work a miss adds (fleet-sim's tuning split: without it on idle
    // replicas, shared-prefix at load 1.2 scattered its groups, TTFT p50 x 1.2-1.4).
    let own_prefill = if active == 0 && shape.scored_to_last_token() {
        0.0
    } else {
        uncached
    };
    let contention_ms = prefill_contention_ms(
        c,
        own_prefill,
        shape.expected_output_tokens,
        shape.contention_weight,
        s,
    );
    let decode_ms = f64::from(active) * (s.decode_ms_per_seq + s.prefill_stall_weight * prefill_ms)
        + kv_usage * s.kv_decode_ms
        + shape.decode_weight * shape.expected_output_tokens * decode_itl_ms
        + contention_ms
        + s.decode_occupancy_weight
            * if s.decode_occupancy_per_request {
                slot.inflight_kv.context_tokens()
            } else {
                slot.inflight_kv.prompt_tokens()
            }
            / rates.prefill_tokens_per_ms;
    // KV pressure from the scrape, or predicted from what the router itself has in flight
    // here plus this request (the scrape lags a burst; past 1.0 the request would wait for
    // memory, and the penalty keeps growing).
    let predicted_kv = match capacity {
        Some(capacity) => {
            let upper = slot.inflight_kv.tokens + prompt_tokens + f64::from(output_tokens);
            if upper / capacity > s.kv_pressure_threshold {
                // Only near the limit is it worth the walk: the prompt's prefix that in-flight
                // requests already hold here takes no new memory.
                let KvBlocks {
                    hashes,
                    block_tokens,
                } = shape.kv_blocks;
                (upper - slot.inflight_kv.held_prefix_tokens(hashes, block_tokens)) / capacity
            } else {
                upper / capacity
            }
        }
        None => 0.0,
    };
    let kv_pressure = kv_usage.max(predicted_kv);
    let kv_ms = if kv_pressure > s.kv_pressure_threshold && s.kv_pressure_threshold < 1.0 {
        s.kv_pressure_ms * (kv_pressure - s.kv_pressure_threshold) / (1.0 - s.kv_pressure_threshold)
    } else {
        0.0
    };
    CostTerms {
        uncached_tokens: uncached,
        active,
        kv_usage,
        itl_ms,
        queue_ms,
        prefill_ms,
        decode_ms,
        contention_ms,
        kv_ms,
    }
}

/// Stage 3c for a session's first request: what placing the session on `c` costs its later
/// turns, `start_turns` of them (the configured turns times the share of sessions that came
/// back soon). A later turn finds its history cached where this one runs, so it pays no
/// prefill to speak of there, but it does pay for the sessions decoding beside it: the
/// running sequences and the contexts they read, priced as they are now. That is the load
/// that stays between turns (the sessions placed there); a queue and the prefill flowing
/// in come and go within a turn, and near saturation their steep terms would make every
/// start chase whichever replica reads a little lighter that instant, so they are left
/// out, as is the request's own prefill (`cost_terms` with the whole prompt cached).
/// Without this, the replica that holds a prefix every session shares (a system prompt,
/// tool definitions) takes every new session while the others idle.
///
/// Only for a request scored to its first token (chat, completions): one scored to its last
/// token (the agent APIs, `decode_weight` > 0) already pays for the decode it will run beside
/// the others in `cost_terms`, turn by turn, and an agent on an idle replica no longer pays
/// for its own prefill there, which is what kept new agents on the holder. Charged as well,
/// the decode counted twice and sent the subagents a fork starts off the replica that holds
/// their parent's context: fleet-sim's fan-out on the tuning seeds prefilled that context
/// 0.57 / 1.43 / 1.41 times per burst of three / eight / eight within milliseconds with the
/// charge, 0.24 / 0.72 / 0.95 without (dynamo 0.69 / 1.30 / 0.97), with the forks still
/// finishing first; docs/BENCHMARKS.md.
pub(super) fn session_start_ms(
    c: Candidate<'_>,
    shape: &RequestShape<'_>,
    start_turns: f64,
    s: &ScoringConfig,
) -> f64 {
    if start_turns <= 0.0 || shape.scored_to_last_token() {
        return 0.0;
    }
    let later = cost_terms(c, (shape.prompt_tokens - 1.0).max(0.0), shape, s);
    start_turns * (later.decode_ms - later.contention_ms)
}

/// The decode time `c`'s prefill contention would cost this request, times `weight` (see
/// [`ScoringConfig::prefill_contention_weight`]), with `own_tokens` of this request's prefill
/// counted into the inflow.
pub(super) fn prefill_contention_ms(
    c: Candidate<'_>,
    own_tokens: f64,
    expected_output_tokens: f64,
    weight: f64,
    s: &ScoringConfig,
) -> f64 {
    if weight <= 0.0 {
        return 0.0;
    }
    let slot = c.slot;
    let window = s.prefill_contention_window_ms.max(1.0);
    // With `own_tokens` of this request's prefill: what its decode and every sequence there
    // will run beside once it is placed (a long miss costs most where prefill already flows).
    let inflow = slot.prefill_inflow.at(c.now_ms, window) + own_tokens;
    // The learned rate starts at the prior (`Calibrated::from_prior`), so it always has one.
    let rate = slot.learned.prefill_tokens_per_ms;
    // Past 0.9 the replica is saturated with prefill: the factor stops at 9.
    let rho = (inflow / window / rate.max(1e-9)).min(0.9);
    // The configured idle step, never the learned one: the learned step time of a replica
    // under prefill load already includes the prefill sharing its steps (vLLM counts prompt
    // tokens only at the first token, so calibration cannot take it out), which is what this
    // term prices; reading it would count the contention twice.
    weight * expected_output_tokens * s.itl_ms_idle * rho / (1.0 - rho)
}

/// A token count that decays exponentially with time: what was added `t` ms ago counts
/// `exp(-t / window)`.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct DecayedTokens {
    tokens: f64,
    at_ms: u64,
}

impl DecayedTokens {
    /// What one token added at `from_ms` counts at `now_ms`.
    fn decay(from_ms: u64, now_ms: u64, window_ms: f64) -> f64 {
        let elapsed = now_ms.saturating_sub(from_ms) as f64;
        (-elapsed / window_ms.max(1.0)).exp()
    }

    /// The count as of `now_ms`.
    pub(super) fn at(&self, now_ms: u64, window_ms: f64) -> f64 {
        self.tokens * Self::decay(self.at_ms, now_ms, window_ms)
    }

    /// Adds `tokens` at `now_ms` (an earlier time counts as the last one: clocks of copies may
    /// step back).
    pub(super) fn add(&mut self, tokens: f64, now_ms: u64, window_ms: f64) {
        self.tokens = self.at(now_ms, window_ms) + tokens;
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// Takes back `tokens` added at `added_ms`: what they still count at `now_ms`.
    pub(super) fn remove(&mut self, tokens: f64, added_ms: u64, now_ms: u64, window_ms: f64) {
        let left = tokens * Self::decay(added_ms, now_ms, window_ms);
        self.tokens = (self.at(now_ms, window_ms) - left).max(0.0);
        self.at_ms = self.at_ms.max(now_ms);
    }
}

/// Stage 3d, per candidate: what moves `c`'s cost off its analytic terms: the session's
/// remembered replica (while healthy), the `cache_control`-marked prefix held there, a LoRA
/// adapter's cost, and the learned latency model's correction once it is warm.
pub(super) fn steering(
    c: Candidate<'_>,
    terms: &CostTerms,
    shape: &RequestShape<'_>,
    pool: &CandidatePool<'_>,
    model: &str,
    fleet: &FleetState,
    config: &RouterConfig,
) -> Steering {
    let (s, sessions) = (&config.scoring, &config.sessions);
    let session_ms = if pool.session.remembered == Some(c.id)
        && sessions.healthy(c.fresh.map(|m| (m.kv_usage, m.waiting)))
    {
        -sessions.bonus_ms
    } else {
        0.0
    };
    let lora_ms = if pool.adapter {
        fleet.loras.cost_ms(c.id, model, &config.lora)
    } else {
        0.0
    };
    // The marked part of what is cached here: its prefill would be paid again by the turns
    // that follow it elsewhere.
    let held_marked = (shape.prompt_tokens - terms.uncached_tokens)
        .min(shape.marked_tokens)
        .max(0.0);
    let cache_control_ms = match config.cache_control.reuse_weight {
        w if w > 0.0 && held_marked > 0.0 => -w * held_marked / c.slot.rates.prefill_tokens_per_ms,
        _ => 0.0,
    };
    let features = LatencyFeatures {
        queue_tokens: terms.queue_ms * c.slot.rates.prefill_tokens_per_ms,
        uncached_tokens: terms.uncached_tokens,
        active: f64::from(terms.active),
        kv_usage: terms.kv_usage,
    };
    let predicted = c.slot.latency.predict(&features);
    let latency_ms = learned_correction(
        &config.latency,
        c.slot.latency.samples(),
        &predicted,
        terms.queue_ms + terms.prefill_ms + f64::from(terms.active) * s.decode_ms_per_seq,
        shape.decode_weight * shape.expected_output_tokens,
        terms.itl_ms,
    );
    Steering {
        session_ms,
        cache_control_ms,
        lora_ms,
        latency_ms,
        predicted,
        features,
    }
}

/// Stage 4a: marks the candidates the guard skips (far more in flight than the least loaded
/// one, absolutely and relatively); a session's replica or a marked prefix's holder that the
/// guard skips is overloaded, so it loses its bonus.
pub(super) fn apply_guard(candidates: &mut [(EndpointId, CandidateScore)], s: &ScoringConfig) {
    let min_inflight = candidates
        .iter()
        .map(|(_, c)| c.inflight)
        .min()
        .unwrap_or(0);
    for (_, c) in candidates.iter_mut() {
        c.guarded = c.inflight >= min_inflight + s.guard_abs
            && f64::from(c.inflight) >= s.guard_rel * f64::from(min_inflight.max(1));
        if c.guarded {
            c.total_ms -= c.session_ms + c.cache_control_ms;
            c.session_ms = 0.0;
            c.cache_control_ms = 0.0;
        }
    }
}

/// Stage 4b, for a request scored to its first token: marks the candidates whose own wait
/// (queue plus prefill) is past `scoring.wait_cap` times the soonest start any candidate
/// offers ([`ScoringConfig::wait_cap`]). They keep their cost and bonuses; the order puts
/// them after the rest.
pub(super) fn apply_wait_cap(candidates: &mut [(EndpointId, CandidateScore)], s: &ScoringConfig) {
    if s.wait_cap <= 0.0 {
        return;
    }
    let soonest = candidates
        .iter()
        .map(|(_, c)| c.wait_ms())
        .fold(f64::INFINITY, f64::min);
    for (_, c) in candidates.iter_mut() {
        c.capped = c.wait_ms() > s.wait_cap * soonest;
    }
}

/// Writes each endpoint's matched prefix depth into `out` (ids beyond `out` are ignored).
pub(super) fn record_depths(index: &PrefixIndex, hashes: &[u64], out: &mut [usize]) {
    index.matched_prefix(hashes, |id, depth| {
        if let Some(m) = out.get_mut(usize::from(id.0)) {
            *m = depth;
        }
    });
}

/// Writes into `keys` the candidates' order: unguarded first, then by total cost, stable, as
/// keys `key_position` reads a position from. The full key of a candidate is one integer
/// (guarded flag, cost in `f64::total_cmp` order, then the position, so an unstable sort gives
/// the stable order). Sorting 64 of those was a tenth of a decision in profiles, so they are
/// first sorted as `u64` (flag, top 55 bits of the cost, position), which is exact unless two
/// candidates share those 55 bits and differ below them; that is checked, and only then are
/// the full keys sorted. Candidates are large: they are moved once, after this.
pub(super) fn cost_order(
    candidates: &[(EndpointId, CandidateScore)],
    keys: &mut Vec<u128>,
    short: &mut Vec<u64>,
) {
    keys.clear();
    keys.extend(candidates.iter().enumerate().map(|(i, (_, c))| {
        let bits = c.total_ms.to_bits();
        let ordered = if bits >> 63 == 1 {
            !bits
        } else {
            bits | 1 << 63
        };
        u128::from(c.set_aside()) << 127 | u128::from(ordered) << 63 | i as u128
    }));
    if keys.len() <= 256 {
        short.clear();
        short.extend(
            keys.iter()
                .enumerate()
                .map(|(i, k)| ((k >> 64) as u64 & !0xff) | i as u64),
        );
        short.sort_unstable();
        let position = |s: u64| (s & 0xff) as usize;
        let exact = short
            .windows(2)
            .all(|w| w[0] >> 8 != w[1] >> 8 || keys[position(w[0])] < keys[position(w[1])]);
        if exact {
            for (k, s) in keys.iter_mut().zip(short.iter()) {
                *k = position(*s) as u128;
            }
            return;
        }
    }
    keys.sort_unstable();
}

/// The candidate position a `cost_order` key carries.
pub(super) fn key_position(key: u128) -> usize {
    (key & ((1 << 63) - 1)) as usize
}

#[cfg(test)]
mod cost_order_tests {
    use super::*;

    /// The order of the full keys, sorted directly.
    fn reference(candidates: &[(EndpointId, CandidateScore)]) -> Vec<usize> {
        let mut keys = Vec::new();
        let mut short = Vec::new();
        cost_order(candidates, &mut keys, &mut short);
        let mut full: Vec<(bool, u64, usize)> = candidates
            .iter()
            .enumerate()
            .map(|(i, (_, c))| {
                let bits = c.total_ms.to_bits();
                let ordered = if bits >> 63 == 1 {
                    !bits
                } else {
                    bits | 1 << 63
                };
                (c.set_aside(), ordered, i)
            })
            .collect();
        full.sort();
        let got: Vec<usize> = keys.iter().map(|&k| key_position(k)).collect();
        assert_eq!(
            got,
            full.iter().map(|f| f.2).collect::<Vec<_>>(),
            "{candidates:?}"
        );
        got
    }

    fn candidate(total_ms: f64, guarded: bool) -> (EndpointId, CandidateScore) {
        (
            EndpointId(0),
            CandidateScore {
                total_ms,
                guarded,
                ..CandidateScore::default()
            },
        )
    }

    // A candidate whose wait is past the cap times the soonest start is set aside, whatever
    // its cost; one within the bound, or any with the cap off, is not.
    #[test]
    fn the_wait_cap_sets_aside_waits_past_the_bound() {
        let with = |queue_ms: f64, prefill_ms: f64, total_ms: f64| {
            (
                EndpointId(0),
                CandidateScore {
                    queue_ms,
                    prefill_ms,
                    total_ms,
                    ..CandidateScore::default()
                },
            )
        };
        let mut s = ScoringConfig {
            wait_cap: 4.0,
            ..ScoringConfig::default()
        };
        let mut candidates = vec![
            with(0.0, 100.0, 900.0),
            with(300.0, 100.0, 800.0),
            with(350.0, 100.0, 10.0),
        ];
        apply_wait_cap(&mut candidates, &s);
        let capped: Vec<bool> = candidates.iter().map(|(_, c)| c.capped).collect();
        assert_eq!(capped, vec![false, false, true]);
        assert_eq!(reference(&candidates), vec![1, 0, 2]);
        s.wait_cap = 0.0;
        let mut fresh = vec![with(0.0, 100.0, 900.0), with(350.0, 100.0, 10.0)];
        apply_wait_cap(&mut fresh, &s);
        assert!(fresh.iter().all(|(_, c)| !c.capped));
    }

    #[test]
    fn short_keys_give_the_full_order_ties_and_near_ties_included() {
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for round in 0..500 {
            let n = 1 + round % 80;
            let candidates: Vec<_> = (0..n)
                .map(|_| {
                    x = splitmix64(x);
                    let base: f64 = [0.5, 12.0, -3.0, 1e9, 0.0][(x % 5) as usize];
                    // Exact ties, ties below the short key's 55 cost bits, and ordinary spread.
                    let cost = match (x >> 8) % 4 {
                        0 => base,
                        1 => f64::from_bits(base.to_bits() ^ ((x >> 20) & 0x1ff)),
                        2 => base + (x >> 40) as f64 / 1e3,
                        _ => -base,
                    };
                    candidate(cost, (x >> 4).is_multiple_of(7))
                })
                .collect();
            reference(&candidates);
        }
        assert_eq!(
            reference(&[
                candidate(2.0, true),
                candidate(2.0, false),
                candidate(1.0, false)
            ]),
            vec![2, 1, 0]
        );
    }
}

/// The candidates' scores in `keys` order (a permutation of their positions), then the
/// prefill-only ones: each score moves once into the returned vector.
pub(super) fn in_cost_order(
    candidates: Vec<(EndpointId, CandidateScore)>,
    keys: &[u128],
    prefill_only: Vec<(EndpointId, CandidateScore)>,
) -> Vec<CandidateScore> {
    // Same element size as `candidates` (the option uses a niche), so this reuses its buffer.
    let mut taken: Vec<Option<(EndpointId, CandidateScore)>> =
        candidates.into_iter().map(Some).collect();
    let mut ordered = Vec::with_capacity(keys.len() + prefill_only.len());
    ordered.extend(
        keys.iter()
            .filter_map(|&k| taken[key_position(k)].take().map(|(_, c)| c)),
    );
    ordered.extend(prefill_only.into_iter().map(|(_, c)| c));
    ordered
}

/// What the router's indexes say about one endpoint's cache, for [`lost_before_admission`].
#[derive(Debug, Clone, Copy)]
pub(super) struct CacheView {
    /// Tokens the index believes the endpoint caches.
    indexed_tokens: f64,
    /// Tokens of one engine block.
    block_tokens: usize,
    /// The engine has been evicting: no free blocks are left, whatever the index counts (it
    /// misses partly filled blocks and duplicates).
    full: bool,
}

/// Blocks between two of a prefix's blocks that [`lost_before_admission`] samples.
pub(super) const KV_SAMPLE_STEP: usize = 8;

/// Cached prompt tokens on `slot`'s GPU that the prefill queued ahead of this request will
/// evict before the engine admits it. A full cache makes room by evicting its least recently
/// used blocks that no running request pins: the queued prefills allocate `backlog_tokens`,
/// which first take free blocks, then the blocks touched before this prompt's oldest block,
/// then the prefix from its oldest blocks on (a prompt is stamped tail first, so its tail
/// goes first). `ages` are the prefix's sampled blocks in prompt order (index in the prompt,
/// blocks touched before it here). The prefix's leading blocks that the eviction does not
/// reach stay whatever the amount: the system prompt every request refreshes outlives the
/// history behind it (counting the amount from the prefix's total evicted that too, and
/// moved the L4 multi-turn conversations off their history). What in-flight requests pin
/// is safe. Without this the router promises a conversation's history on a replica whose
/// queue will evict it, and the request pays the queue and the full prefill: precise mode's
/// live tail under contention.
pub(super) fn lost_before_admission(
    slot: &Slot,
    cache: CacheView,
    gpu_cached_tokens: f64,
    ages: impl Iterator<Item = (usize, usize)>,
    kv_blocks: KvBlocks<'_>,
) -> f64 {
    let Some(capacity) = slot.kv_capacity_tokens() else {
        return 0.0;
    };
    let ahead = slot.backlog_tokens;
    // Pinned now: what in-flight requests hold, less what the queue has yet to allocate.
    let pinned = (slot.inflight_kv.tokens - ahead).max(0.0);
    let free = if cache.full {
        0.0
    } else {
        capacity - cache.indexed_tokens.max(pinned).min(capacity)
    };
    let block = cache.block_tokens as f64;
    // Blocks the queue takes from the least recently used end.
    let evicted = (ahead - free) / block;
    if evicted <= 0.0 {
        return 0.0;
    }
    let held = slot
        .inflight_kv
        .held_prefix_tokens(kv_blocks.hashes, kv_blocks.block_tokens);
    // The prefix's leading blocks the eviction does not reach (pinned, or touched after the
    // blocks it takes), and the oldest of its sampled blocks.
    let mut safe = 0;
    let mut leading = true;
    let mut oldest = usize::MAX;
    for (at, older) in ages {
        oldest = oldest.min(older);
        leading &= (at + 1) as f64 * block <= held || older as f64 >= evicted;
        if leading {
            safe = at + 1;
        }
    }
    if oldest == usize::MAX {
        return 0.0;
    }
    // What the eviction takes past the blocks older than the prefix, from the prefix's own
    // oldest blocks on, but never its leading blocks it does not reach.
    let reaching = (evicted - oldest as f64) * block;
    let kept = (safe as f64 * block).max(held);
    (gpu_cached_tokens - kept).max(0.0).min(reaching.max(0.0))
}

/// How far (as a ratio) an endpoint's learned prefill rate may sit from the fleet's average and
/// still count as the same hardware, scored at the average.
pub(super) const SAME_HARDWARE: f64 = 1.3;

/// The prior calibration starts each endpoint from: the configured scoring rates.
pub(super) fn prior(s: &ScoringConfig) -> Prior {
    Prior {
        prefill_tokens_per_ms: s.prefill_tokens_per_ms,
        itl_ms_idle: s.itl_ms_idle,
        itl_ms_full: s.itl_ms_full,
    }
}

/// The replica drains queued prefill at its prefill rate: forget what it has done since.
pub(super) fn drain_backlog(slot: &mut Slot, now_ms: u64, tokens_per_ms: f64) {
    let elapsed = now_ms.saturating_sub(slot.backlog_at_ms) as f64;
    slot.buffered_tokens = (slot.buffered_tokens - elapsed * tokens_per_ms).max(0.0);
    slot.backlog_tokens = slot.backlog_at(now_ms, tokens_per_ms);
    slot.backlog_at_ms = now_ms.max(slot.backlog_at_ms);
}
