//! Online calibration: each endpoint's prefill rate and decode step time, learned from the
//! engine's own counters instead of hardware constants.
//!
//! The analytic cost in [`crate::router`] turns tokens into milliseconds with a prefill rate
//! and a time per output token. One constant for a whole fleet is wrong as soon as the fleet
//! is not the machine the constant was measured on (another GPU, another model, tensor
//! parallelism, a mixed pool). vLLM already counts what is needed on `/metrics`, so every
//! scrape is an observation:
//!
//! - **Prefill rate.** Per scrape interval, the mean prefill time of the requests that
//!   finished (`vllm:request_prefill_time_seconds`, scheduled to first token) against their
//!   mean computed prompt tokens (`vllm:request_prefill_kv_computed_tokens`, cached tokens
//!   excluded). The last 32 such points get a Theil-Sen line (the median of pairwise slopes),
//!   whose intercept is the step overhead every prefill pays (a ratio of sums would read that
//!   overhead as a slow prefill). The cost per token is then the fast quartile of each point's
//!   own cost above that intercept: a request whose prefill shared its engine steps with
//!   other prompts took longer than its own tokens explain, never shorter, so on a busy
//!   replica the median (and any least-squares slope) reads slow while the fast end stays the
//!   engine's rate (points under 256 tokens, whose cost is mostly noise, do not vote, and the
//!   quartile is never taken below half the median). Both histograms are observed when a request
//!   finishes, so each interval's two sums describe the same requests
//!   (`vllm:prompt_tokens_total` counts at the first token instead).
//! - **Decode step time.** The mean inter-token latency over the interval
//!   (`vllm:inter_token_latency_seconds` sum over count) against the interval's mean KV usage,
//!   fitted as a line `itl = idle + (full - idle) * kv_usage` by weighted least squares. With
//!   chunked prefill a decode token waits for the prefill chunks in its step, so the observed
//!   latency first loses the share of the interval the engine spent prefilling: the prompt
//!   tokens it computed meanwhile (`vllm:prompt_tokens_total` less
//!   `vllm:prefix_cache_hits_total`) at the learned rate.
//!   A line no engine could have (an idle step at or below zero, or steps that shorten as the
//!   cache fills) is the prefill the correction missed, most of it at high KV usage on a busy
//!   replica; the prior's shape scaled to the data's mean stands in for it. The correction
//!   cannot be exact: vLLM counts a prompt's tokens only when its first token comes out
//!   (`IterationStats::update_from_output` in `vllm/v1/metrics/stats.py`;
//!   `vllm:iteration_tokens_total` observes the same count), so the intervals in which a long
//!   prompt is prefilled chunk by chunk show its cost in their step times but not in their
//!   counters, and a replica that prefills long prompts all the time reads slow to decode.
//!
//! Both start from a prior (the [`crate::router::ScoringConfig`] values, deliberately generic),
//! so a replica predicts sensibly before its first scrape, and the data take over once the
//! replica has done real work (eight intervals with finished requests for prefill, 200 output
//! tokens for decode). Old observations leave (the prefill window,
//! the decode line's half-life), so a replica that slows down is followed. Each endpoint is
//! learned on its own: a pool of two GPU types gets two rates (the router passes a replica
//! without data of its own its peers' average as the prior).
//!
//! Invariant: memory per endpoint is fixed, every step is deterministic, and counters that go
//! backwards (an engine restarted) restart the baseline instead of producing a sample.

use serde::{Deserialize, Serialize};

/// The fastest prefill a measurement may claim, tokens per ms (an engine whose prefill takes no
/// measurable time, such as a simulator, reads as this rather than as infinity).
const MAX_TOKENS_PER_MS: f64 = 1e6;

/// The cumulative engine counters one scrape reads (summed over DP engines and models).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCounters {
    /// `vllm:prompt_tokens_total`: prompt tokens prefilled, cached or not (counted at the
    /// first token).
    pub prompt_tokens: f64,
    /// `vllm:prefix_cache_hits_total`: prompt tokens found in the prefix cache.
    pub prefix_cache_hit_tokens: f64,
    /// `vllm:request_prefill_kv_computed_tokens_sum`: prompt tokens finished requests computed
    /// (not found in the prefix cache).
    pub prefill_computed_tokens: f64,
    /// `vllm:request_prefill_time_seconds_sum`: seconds finished requests spent in prefill.
    pub prefill_seconds: f64,
    /// `vllm:request_prefill_time_seconds_count`: how many requests those are.
    pub prefill_count: f64,
    /// `vllm:inter_token_latency_seconds_sum`: seconds between consecutive output tokens.
    pub itl_seconds: f64,
    /// `vllm:inter_token_latency_seconds_count`: the number of those gaps.
    pub itl_count: f64,
}

impl EngineCounters {
    /// Whether every counter is at or above `earlier`'s (false: the engine restarted).
    fn not_below(&self, earlier: &Self) -> bool {
        self.prompt_tokens >= earlier.prompt_tokens
            && self.prefix_cache_hit_tokens >= earlier.prefix_cache_hit_tokens
            && self.prefill_computed_tokens >= earlier.prefill_computed_tokens
            && self.prefill_seconds >= earlier.prefill_seconds
            && self.prefill_count >= earlier.prefill_count
            && self.itl_seconds >= earlier.itl_seconds
            && self.itl_count >= earlier.itl_count
    }

    fn is_usable(&self) -> bool {
        [
            self.prompt_tokens,
            self.prefix_cache_hit_tokens,
            self.prefill_computed_tokens,
            self.prefill_seconds,
            self.prefill_count,
            self.itl_seconds,
            self.itl_count,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
    }
}

/// Tunables of online calibration (`calibration:` in the router configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibrationConfig {
    /// Whether scoring uses the learned rates. Off by default: the rates are always learned
    /// and shown, but in fleet-sim's matrix scoring with them still loses to the generic
    /// prior on TTFT p99 (README, "Online calibration"), so they steer only when asked to.
    pub enabled: bool,
    /// Output tokens after which the decode line is the data's alone (fewer: blended with the
    /// prior).
    pub prior_decode_tokens: f64,
    /// Half-life of an observation, in ms.
    pub half_life_ms: u64,
    /// Whether an endpoint whose streamed first tokens show its prefill a GPU generation
    /// slower than its pool's typical one is priced slower ([`ShownPrefill`]), whether or not
    /// `enabled` is. On by default: it changes nothing in a pool of one kind of replica, and
    /// on fleet-sim's tuning split it cut the loss cells from 4 to 3 and the TTFT p99 geomean
    /// against the best peer from 1.14 to 1.10, all of it on the pool of two GPU generations
    /// (README, "Online calibration"). Left out of the serialized form at its default, so a
    /// filter built before it still accepts the copy's configuration (it rejects unknown
    /// fields, and a copy that cannot read its configuration never syncs).
    #[serde(skip_serializing_if = "is_default_first_tokens")]
    pub first_tokens: bool,
}

/// The default of [`CalibrationConfig::first_tokens`].
const FIRST_TOKENS: bool = true;

fn is_default_first_tokens(on: &bool) -> bool {
    *on == FIRST_TOKENS
}

impl Default for CalibrationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            prior_decode_tokens: 200.0,
            half_life_ms: 120_000,
            first_tokens: FIRST_TOKENS,
        }
    }
}

/// The prior an endpoint starts from (the configured scoring values).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prior {
    /// Prefill tokens per ms.
    pub prefill_tokens_per_ms: f64,
    /// Time per output token on an idle replica, ms.
    pub itl_ms_idle: f64,
    /// Time per output token with a full KV cache, ms.
    pub itl_ms_full: f64,
}

/// What calibration currently believes about one endpoint (shown on `/debug` and `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Calibrated {
    /// Prefill throughput, tokens per ms.
    pub prefill_tokens_per_ms: f64,
    /// Time per output token on an idle replica, ms.
    pub itl_ms_idle: f64,
    /// Time per output token with a full KV cache, ms.
    pub itl_ms_full: f64,
    /// Scrape intervals with finished requests behind the prefill estimate (0: the prior
    /// alone; at most 32).
    pub prefill_evidence_points: u32,
    /// Output tokens behind the decode estimate (decayed; 0: the prior alone).
    pub decode_evidence_tokens: f64,
}

/// A line `y = intercept + slope * x` fitted by weighted least squares over decayed sums.
#[derive(Debug, Clone, Copy, Default)]
struct LineFit {
    w: f64,
    wx: f64,
    wy: f64,
    wxx: f64,
    wxy: f64,
}

impl LineFit {
    fn decay(&mut self, keep: f64) {
        for s in [
            &mut self.w,
            &mut self.wx,
            &mut self.wy,
            &mut self.wxx,
            &mut self.wxy,
        ] {
            *s *= keep;
        }
    }

    fn add(&mut self, x: f64, y: f64, weight: f64) {
        self.w += weight;
        self.wx += weight * x;
        self.wy += weight * y;
        self.wxx += weight * x * x;
        self.wxy += weight * x * y;
    }

    /// `(intercept, slope)`: the data's line blended with the prior line until the data weigh
    /// `prior_weight`, then the data's alone. Where the data's `x` barely varies, the
    /// data cannot tell slope from intercept, and the prior line is scaled through the data's
    /// mean instead; so too where the data's line is not one an engine could have (an
    /// intercept at or below zero, or a falling slope). The slope is never negative.
    fn solve(&self, prior: (f64, f64), prior_weight: f64, min_x_spread: f64) -> (f64, f64) {
        let (a0, b0) = prior;
        if self.w <= 1e-9 {
            return (a0, b0.max(0.0));
        }
        let (mx, my) = (self.wx / self.w, self.wy / self.w);
        let var_x = (self.wxx / self.w - mx * mx).max(0.0);
        let fitted = (var_x > min_x_spread * min_x_spread).then(|| {
            let b = (self.wxy / self.w - mx * my) / var_x;
            (my - b * mx, b)
        });
        // On a busy replica the samples at high `x` are also the ones most slowed by what the
        // line does not model (prefill sharing the steps), and least squares can then put
        // the intercept at or below zero under a slope many times too steep: an idle step of
        // 0 ms and a full one of seconds (seen in fleet-sim under load). Only the prior's
        // shape, scaled to the data, is left to trust there.
        let (a, b) = match fitted {
            Some((a, b)) if a > 0.0 && b >= 0.0 => (a, b),
            _ => {
                let at_mean = a0 + b0 * mx;
                let f = if at_mean > 1e-9 { my / at_mean } else { 1.0 };
                (f * a0, f * b0)
            }
        };
        // The prior fades linearly: the data alone once they weigh `prior_weight`.
        let data = (self.w / prior_weight.max(1e-9)).min(1.0);
        let slope = (data * b + (1.0 - data) * b0).max(0.0);
        ((data * a + (1.0 - data) * a0).max(0.0), slope)
    }
}

/// Computed tokens per request two prefill points must differ by for their slope to count.
const MIN_TOKEN_SPREAD: f64 = 50.0;
/// The largest share of an interval a decode sample may lose to prefill (beyond it, the
/// sample says more about the prefill estimate than about decoding).
const MAX_PREFILL_SHARE: f64 = 0.9;
/// Mean computed tokens a prefill point needs for its own cost per token to count.
const MIN_RATE_TOKENS: f64 = 256.0;
/// How much faster than the plain mean of its points (time over tokens, overhead and
/// contention included) a prefill rate may be read: contention slows a saturated replica's
/// prefills a few times over, not by orders of magnitude, and a rate read far beyond that is
/// the fit failing (an intercept that ate the points' time), not a faster engine.
const MAX_SPEEDUP_OVER_MEAN: f64 = 4.0;
/// Prefill points kept for the robust fit.
const PREFILL_POINTS: usize = 32;
/// Prefill points after which the data alone set the rate (fewer: blended with the prior).
const PREFILL_POINTS_TRUSTED: f64 = 8.0;

/// The last [`PREFILL_POINTS`] prefill points `(mean computed tokens, mean prefill ms)` and
/// their Theil-Sen line.
#[derive(Debug, Clone, Default)]
struct PrefillFit {
    points: Vec<(f64, f64)>,
    next: usize,
    /// `(intercept, slope)` of the latest fit with enough spread.
    line: Option<(f64, f64)>,
}

impl PrefillFit {
    fn add(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite() && x >= 0.0 && y >= 0.0) {
            return;
        }
        if self.points.len() < PREFILL_POINTS {
            self.points.push((x, y));
        } else {
            self.points[self.next] = (x, y);
        }
        self.next = (self.next + 1) % PREFILL_POINTS;
        if let Some((intercept, median_slope)) = theil_sen(&self.points) {
            // Each point's own cost per token above that intercept; the fast quartile of
            // them. A request whose prefill shared its steps with others' took longer than its
            // own tokens explain, never shorter, so the fast end is the engine's own rate and
            // the median reads slow whenever prefills overlap (a saturated replica).
            //
            // On a saturated replica contention, not prompt size, sets the prefill times, and
            // the pairwise slopes can come out flat or negative. That line's intercept is then
            // most of every point's time, which would leave each point a cost near zero and
            // read the engine as arbitrarily fast. Without a rising line, no overhead is
            // subtracted.
            let intercept = if median_slope > 0.0 {
                intercept.max(0.0)
            } else {
                0.0
            };
            let mut per_token = [0.0; PREFILL_POINTS];
            let mut n = 0;
            let (mut sum_x, mut sum_y) = (0.0, 0.0);
            // Only points with enough computed tokens that the step overhead's noise does not
            // swamp their cost per token, and never below half their median: the fast end of
            // noise is not a faster engine.
            for &(x, y) in self.points.iter().filter(|(x, _)| *x >= MIN_RATE_TOKENS) {
                per_token[n] = ((y - intercept) / x).max(0.0);
                n += 1;
                sum_x += x;
                sum_y += y;
            }
            // Nor faster than MAX_SPEEDUP_OVER_MEAN times the points' plain mean (all their
            // time over all their tokens, overhead and contention included).
            let slope = if n >= 4 {
                let (_, mid, _) = per_token[..n].select_nth_unstable_by(n / 2, f64::total_cmp);
                let mid = *mid;
                let (_, fast, _) = per_token[..n].select_nth_unstable_by(n / 4, f64::total_cmp);
                fast.max(mid / 2.0)
                    .max(sum_y / sum_x / MAX_SPEEDUP_OVER_MEAN)
            } else {
                // Too few large points for quartiles: the pairwise slope when it rises, else
                // the plain mean of every point (slow, but never a free prefill).
                let (all_x, all_y) = self
                    .points
                    .iter()
                    .fold((0.0, 0.0), |(sx, sy), &(x, y)| (sx + x, sy + y));
                let mean = if all_x > 0.0 { all_y / all_x } else { 0.0 };
                if median_slope > 0.0 {
                    median_slope.max(mean / MAX_SPEEDUP_OVER_MEAN)
                } else {
                    mean
                }
            };
            self.line = Some((intercept, slope));
        } else if self.line.is_none() {
            // No spread yet: a line through the origin and the points' median ratio.
            let mut ratios = [0.0; PREFILL_POINTS];
            let mut n = 0;
            for &(x, y) in self.points.iter().filter(|(x, _)| *x > 0.0) {
                ratios[n] = y / x;
                n += 1;
            }
            if n > 0 {
                self.line = Some((0.0, median(&mut ratios[..n])));
            }
        }
    }
}

/// The Theil-Sen line `(intercept, slope)` of `points`: the median slope over pairs whose `x`
/// differ by [`MIN_TOKEN_SPREAD`], and the median intercept at that slope. `None` with fewer
/// than three such pairs.
fn theil_sen(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let mut slopes = [0.0; PREFILL_POINTS * (PREFILL_POINTS - 1) / 2];
    let mut n = 0;
    for (i, &(x1, y1)) in points.iter().enumerate() {
        for &(x2, y2) in &points[i + 1..] {
            if (x2 - x1).abs() > MIN_TOKEN_SPREAD && n < slopes.len() {
                slopes[n] = (y2 - y1) / (x2 - x1);
                n += 1;
            }
        }
    }
    if n < 3 {
        return None;
    }
    let slope = median(&mut slopes[..n]);
    let mut intercepts = [0.0; PREFILL_POINTS];
    for (k, &(x, y)) in points.iter().enumerate() {
        intercepts[k] = y - slope * x;
    }
    Some((median(&mut intercepts[..points.len()]), slope))
}

fn median(values: &mut [f64]) -> f64 {
    let mid = values.len() / 2;
    let (_, m, _) = values.select_nth_unstable_by(mid, f64::total_cmp);
    *m
}
/// KV usage spread below which the decode fit cannot tell slope from intercept.
const MIN_KV_SPREAD: f64 = 0.05;

impl Calibrated {
    /// `prior` alone: what an endpoint with no data of its own, or with calibration off, is
    /// scored at.
    pub fn from_prior(prior: Prior) -> Self {
        let idle = prior.itl_ms_idle.max(0.01);
        Self {
            prefill_tokens_per_ms: prior.prefill_tokens_per_ms.max(1.0 / MAX_TOKENS_PER_MS),
            itl_ms_idle: idle,
            itl_ms_full: idle + (prior.itl_ms_full - prior.itl_ms_idle).max(0.0),
            prefill_evidence_points: 0,
            decode_evidence_tokens: 0.0,
        }
    }

    /// Whether the prefill rate rests on the endpoint's own data alone (no prior left in it).
    pub fn is_learned(&self) -> bool {
        f64::from(self.prefill_evidence_points) >= PREFILL_POINTS_TRUSTED
    }

    /// These rates as the prior of an endpoint that has not shown its own yet.
    pub fn as_prior(&self) -> Prior {
        Prior {
            prefill_tokens_per_ms: self.prefill_tokens_per_ms,
            itl_ms_idle: self.itl_ms_idle,
            itl_ms_full: self.itl_ms_full,
        }
    }
}

/// One endpoint's learned rates.
#[derive(Debug, Clone, Default)]
pub struct EndpointCalibration {
    /// The previous scrape: counters, when, and its KV usage.
    last: Option<(EngineCounters, u64, f64)>,
    /// Per-request prefill time (ms) against computed tokens: the slope is the time a token
    /// costs, the intercept the step overhead every prefill pays.
    prefill: PrefillFit,
    /// Time per output token (ms) against KV usage, weighted by output tokens.
    decode: LineFit,
}

impl EndpointCalibration {
    /// Takes one scrape's counters and KV usage at `now_ms`.
    pub fn observe(
        &mut self,
        counters: EngineCounters,
        kv_usage: f64,
        now_ms: u64,
        prior: Prior,
        config: &CalibrationConfig,
    ) {
        if !counters.is_usable() {
            return;
        }
        let kv_usage = if kv_usage.is_finite() {
            kv_usage.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let Some((prev, prev_ms, prev_kv)) = self.last else {
            self.last = Some((counters, now_ms, kv_usage));
            return;
        };
        if !counters.not_below(&prev) {
            // The engine restarted: a new baseline, no sample.
            self.last = Some((counters, now_ms, kv_usage));
            return;
        }
        if counters == prev || now_ms <= prev_ms {
            // Nothing new (an idle engine, or the same scrape relayed again): keep the baseline
            // so the next change is measured over its whole interval.
            return;
        }
        let interval_ms = (now_ms - prev_ms) as f64;
        let keep = 0.5f64.powf(interval_ms / config.half_life_ms.max(1) as f64);
        self.decode.decay(keep);

        let requests = counters.prefill_count - prev.prefill_count;
        if requests > 0.0 {
            let tokens = counters.prefill_computed_tokens - prev.prefill_computed_tokens;
            let ms = (counters.prefill_seconds - prev.prefill_seconds) * 1000.0;
            self.prefill.add(tokens / requests, ms / requests);
        }
        let gaps = counters.itl_count - prev.itl_count;
        let prefilled = ((counters.prompt_tokens - prev.prompt_tokens)
            - (counters.prefix_cache_hit_tokens - prev.prefix_cache_hit_tokens))
            .max(0.0);
        let rate = self.prefill_tokens_per_ms(prior);
        if gaps > 0.0 {
            let ms = (counters.itl_seconds - prev.itl_seconds) * 1000.0;
            let prefill_share = (prefilled / rate / interval_ms).min(MAX_PREFILL_SHARE);
            // A sample mostly made of prefill says little about decoding: it weighs less.
            self.decode.add(
                (prev_kv + kv_usage) / 2.0,
                ms / gaps * (1.0 - prefill_share),
                gaps * (1.0 - prefill_share),
            );
        }
        self.last = Some((counters, now_ms, kv_usage));
    }

    /// The prefill rate alone: the learned line's slope blended with the prior's until eight
    /// points, then the line's.
    fn prefill_tokens_per_ms(&self, prior: Prior) -> f64 {
        let ms_per_token = 1.0 / prior.prefill_tokens_per_ms.max(1e-6);
        let points = self.prefill.points.len() as f64;
        let slope = match self.prefill.line {
            Some((_, slope)) => {
                let data = (points / PREFILL_POINTS_TRUSTED).min(1.0);
                data * slope + (1.0 - data) * ms_per_token
            }
            None => ms_per_token,
        };
        1.0 / slope.max(1.0 / MAX_TOKENS_PER_MS)
    }

    /// The rates in force: the prior blended with what the counters showed.
    pub fn calibrated(&self, prior: Prior, config: &CalibrationConfig) -> Calibrated {
        let (idle, rise) = self.decode.solve(
            (prior.itl_ms_idle, prior.itl_ms_full - prior.itl_ms_idle),
            config.prior_decode_tokens,
            MIN_KV_SPREAD,
        );
        let idle = idle.max(0.01);
        Calibrated {
            prefill_tokens_per_ms: self.prefill_tokens_per_ms(prior),
            itl_ms_idle: idle,
            itl_ms_full: idle + rise,
            prefill_evidence_points: self.prefill.points.len() as u32,
            decode_evidence_tokens: self.decode.w,
        }
    }
}

/// Prompt tokens a first token must have prefilled to say anything about the rate: below it
/// the time is mostly the request's trip and the engine's step, not its prefill.
const SHOWN_MIN_TOKENS: f64 = 1024.0;
/// First tokens an endpoint's shown rate is the fastest of.
const SHOWN_SAMPLES: usize = 8;
/// Half-life of a slowdown since its endpoint last showed a rate. An endpoint priced slower
/// gets few long prompts, so evidence that never aged would keep a replica that was slow once
/// (its first requests after start, a stall) priced slow for good; decaying, its price comes
/// back toward its peers' until it is competitive again and shows its rate anew, while a
/// replica that really is a generation behind stays priced well above them for minutes.
pub const SLOWDOWN_HALF_LIFE_MS: f64 = 60_000.0;
/// How many times slower than its pool's typical endpoint an endpoint must show its prefill
/// before it is scored slower: about the gap between two GPU generations. A smaller gap is
/// as likely a busy replica or a short prompt's overhead as other hardware.
pub const SLOWER_HARDWARE: f64 = 2.0;

/// The prefill rates an endpoint's streamed first tokens showed lately, in tokens per ms: the
/// prompt tokens a request had to wait for there (the router's belief of the queue ahead plus
/// its own uncached tokens) over the time to its first token (the proxy's own, from routing,
/// when its report carries it; else the router's, from its decision to the report).
///
/// Why: counters-based calibration learns from *finished* requests, and on a slow replica a
/// request with a long answer finishes a minute after it was sent. A pool of fast and slow
/// GPUs scored at one prior rate sends the slow ones fresh misses all that time, each waiting
/// seconds for its first token. A first token comes as soon as the prefill is done, so the
/// first long prompt an endpoint serves already shows how fast it prefills.
///
/// The time also holds the trip and work the router did not know of, so a sample reads slower
/// than the engine, never faster unless the believed queue was already done or the engine had
/// cached what the router believed it must prefill: the estimate is the fastest of the last
/// [`SHOWN_SAMPLES`], and a busy replica's slow samples do not make it read slow while it has
/// lately shown its speed. Memory is fixed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShownPrefill {
    /// (tokens per ms, when shown, the decision that showed it), oldest first; the first
    /// `len` are held.
    samples: [(f64, u64, u64); SHOWN_SAMPLES],
    len: usize,
}

impl ShownPrefill {
    /// A first token at `now_ms`, `elapsed_ms` after decision `decision_id`, of a request that
    /// waited for `tokens` of prefill there. Short prefills and nonsense are ignored; returns
    /// whether it was a sample.
    pub fn observe(&mut self, tokens: f64, elapsed_ms: f64, now_ms: u64, decision_id: u64) -> bool {
        let Some(rate) = shown_rate(tokens, elapsed_ms) else {
            return false;
        };
        if self.len == SHOWN_SAMPLES {
            self.forget(0);
        }
        self.samples[self.len] = (rate, now_ms, decision_id);
        self.len += 1;
        true
    }

    /// Drops the sample at `at`, keeping the others oldest first.
    fn forget(&mut self, at: usize) {
        self.samples.copy_within(at + 1..self.len, at);
        self.len -= 1;
    }

    /// Decision `decision_id`'s outcome said how many tokens its prefill really was (`tokens`,
    /// `None`: it was no sample after all, such as a prompt the engine had cached that the
    /// router believed it must prefill, which read the replica many times faster than it is).
    /// Its sample, if still held, is read again or forgotten. Returns whether it changed.
    pub fn correct(&mut self, decision_id: u64, tokens: Option<f64>, elapsed_ms: f64) -> bool {
        let Some(at) = self.samples[..self.len]
            .iter()
            .position(|(_, _, id)| *id == decision_id)
        else {
            return false;
        };
        if let Some(rate) = tokens.and_then(|t| shown_rate(t, elapsed_ms)) {
            let changed = self.samples[at].0 != rate;
            self.samples[at].0 = rate;
            return changed;
        }
        self.forget(at);
        true
    }

    /// The fastest rate shown lately (`None`: none shown yet).
    pub fn fastest(&self) -> Option<f64> {
        self.samples[..self.len]
            .iter()
            .map(|(rate, _, _)| *rate)
            .reduce(f64::max)
    }

    /// When the last rate was shown (0 before any).
    pub fn last_shown_ms(&self) -> u64 {
        self.samples[..self.len]
            .iter()
            .map(|(_, at, _)| *at)
            .max()
            .unwrap_or(0)
    }
}

/// The rate `tokens` of prefill in `elapsed_ms` shows, if they are a sample at all.
fn shown_rate(tokens: f64, elapsed_ms: f64) -> Option<f64> {
    if tokens.is_nan() || tokens < SHOWN_MIN_TOKENS || !elapsed_ms.is_finite() {
        return None;
    }
    Some((tokens / elapsed_ms.max(1.0)).min(MAX_TOKENS_PER_MS))
}

/// `slowdown`, judged `age_ms` ago, as it counts now: its excess over 1 halves every
/// [`SLOWDOWN_HALF_LIFE_MS`].
pub fn decayed_slowdown(slowdown: f64, age_ms: u64) -> f64 {
    1.0 + (slowdown - 1.0) * 0.5f64.powf(age_ms as f64 / SLOWDOWN_HALF_LIFE_MS)
}

/// How many times slower than `typical` (the pool's median shown rate) an endpoint that showed
/// `fastest` is to be scored: the ratio when it is at least [`SLOWER_HARDWARE`], else 1.
pub fn slowdown(fastest: f64, typical: f64) -> f64 {
    let ratio = typical / fastest.max(f64::MIN_POSITIVE);
    if ratio.is_finite() && ratio >= SLOWER_HARDWARE {
        ratio
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Off, the rule is sent (a filter built before it rejects the field: it was asked for);
    // at its default it is not, and a copy reads its absence as the default.
    #[test]
    fn first_tokens_is_sent_only_when_turned_off() {
        let on = serde_json::to_string(&CalibrationConfig::default()).unwrap();
        assert!(!on.contains("first_tokens"), "{on}");
        assert_eq!(
            serde_json::from_str::<CalibrationConfig>(&on).unwrap(),
            CalibrationConfig::default()
        );
        let off = CalibrationConfig {
            first_tokens: false,
            ..CalibrationConfig::default()
        };
        let text = serde_json::to_string(&off).unwrap();
        assert_eq!(
            serde_json::from_str::<CalibrationConfig>(&text).unwrap(),
            off
        );
    }

    const PRIOR: Prior = Prior {
        prefill_tokens_per_ms: 4.0,
        itl_ms_idle: 10.0,
        itl_ms_full: 40.0,
    };

    /// Feeds a replica that prefills at `rate` tokens/ms after a 5 ms step overhead and
    /// decodes at `idle + slope*kv`.
    fn replica(rate: f64, idle_ms: f64, slope_ms: f64) -> EndpointCalibration {
        let config = CalibrationConfig::default();
        let mut cal = EndpointCalibration::default();
        let mut c = EngineCounters::default();
        for step in 0..200u64 {
            let kv = (step % 10) as f64 / 10.0;
            // Every 100 ms: one or two requests finish, of 100 to 1,300 computed tokens each,
            // and 50 output tokens come out.
            let (requests, tokens) = (1.0 + (step % 2) as f64, 100.0 + (step % 7) as f64 * 200.0);
            c.prefill_count += requests;
            c.prefill_computed_tokens += requests * tokens;
            c.prefill_seconds += requests * (5.0 + tokens / rate) / 1000.0;
            c.itl_count += 50.0;
            c.itl_seconds += 50.0 * (idle_ms + slope_ms * kv) / 1000.0;
            cal.observe(c, kv, step * 100, PRIOR, &config);
        }
        cal
    }

    #[test]
    fn learns_a_replica_s_rates_from_its_counters() {
        let config = CalibrationConfig::default();
        let got = replica(25.0, 6.0, 30.0).calibrated(PRIOR, &config);
        assert!(
            (got.prefill_tokens_per_ms - 25.0).abs() < 25.0 * 0.1,
            "{got:?}"
        );
        assert!((got.itl_ms_idle - 6.0).abs() < 1.0, "{got:?}");
        assert!((got.itl_ms_full - 36.0).abs() < 3.0, "{got:?}");
    }

    #[test]
    fn two_replicas_of_one_pool_are_learned_apart() {
        let config = CalibrationConfig::default();
        let fast = replica(30.0, 5.0, 10.0).calibrated(PRIOR, &config);
        let slow = replica(3.0, 20.0, 40.0).calibrated(PRIOR, &config);
        assert!(fast.prefill_tokens_per_ms > 5.0 * slow.prefill_tokens_per_ms);
        assert!(slow.itl_ms_idle > 3.0 * fast.itl_ms_idle);
    }

    #[test]
    fn a_cold_endpoint_uses_the_prior_and_a_restart_gives_no_sample() {
        let config = CalibrationConfig::default();
        let mut cal = EndpointCalibration::default();
        let cold = cal.calibrated(PRIOR, &config);
        assert!((cold.prefill_tokens_per_ms - 4.0).abs() < 1e-9);
        assert!((cold.itl_ms_idle - 10.0).abs() < 1e-9);
        assert!((cold.itl_ms_full - 40.0).abs() < 1e-9);
        let busy = EngineCounters {
            prompt_tokens: 2e6,
            prefix_cache_hit_tokens: 1e6,
            prefill_computed_tokens: 1e6,
            prefill_count: 100.0,
            prefill_seconds: 10.0,
            itl_seconds: 100.0,
            itl_count: 1e4,
        };
        cal.observe(busy, 0.5, 0, PRIOR, &config);
        // Counters back near zero: the engine restarted, which is not a sample.
        cal.observe(EngineCounters::default(), 0.0, 100, PRIOR, &config);
        assert_eq!(cal.calibrated(PRIOR, &config), cold);
    }

    #[test]
    fn a_prefill_that_shared_its_step_barely_moves_the_rate() {
        let config = CalibrationConfig::default();
        let mut cal = replica(10.0, 5.0, 10.0);
        let mut c = cal.last.map(|(c, ..)| c).unwrap();
        // One interval whose request waited behind another's 10,000-token prefill.
        c.prefill_count += 1.0;
        c.prefill_computed_tokens += 1_200.0;
        c.prefill_seconds += 1.2;
        c.itl_count += 1.0;
        c.itl_seconds += 0.01;
        cal.observe(c, 0.5, 20_100, PRIOR, &config);
        let rate = cal.calibrated(PRIOR, &config).prefill_tokens_per_ms;
        assert!((rate - 10.0).abs() < 0.5, "{rate}");
    }

    // A saturated replica: every interval's requests waited about as long whatever their size,
    // so the prefill times do not rise with the tokens. The fit cannot separate overhead from
    // rate there; it must not read the engine as arbitrarily fast (an intercept that eats
    // every point's time once read 1,000,000 tokens/ms in fleet-sim and sent every moved
    // request to that replica).
    #[test]
    fn prefill_times_flat_in_the_tokens_never_read_as_a_free_prefill() {
        let config = CalibrationConfig::default();
        for points in [3u64, 40] {
            let mut cal = EndpointCalibration::default();
            let mut c = EngineCounters::default();
            let (mut tokens_sum, mut ms_sum) = (0.0, 0.0);
            for step in 0..=points {
                let tokens = 300.0 + (step % 7) as f64 * 200.0;
                // Flat, slightly falling: contention, not size, sets the time.
                let ms = 900.0 - (step % 7) as f64 * 10.0;
                c.prefill_count += 1.0;
                c.prefill_computed_tokens += tokens;
                c.prefill_seconds += ms / 1000.0;
                c.itl_count += 10.0;
                c.itl_seconds += 0.2;
                cal.observe(c, 0.5, step * 100, PRIOR, &config);
                if step > 0 {
                    tokens_sum += tokens;
                    ms_sum += ms;
                }
            }
            let rate = cal.calibrated(PRIOR, &config).prefill_tokens_per_ms;
            let mean_rate = tokens_sum / ms_sum;
            assert!(
                rate <= mean_rate * MAX_SPEEDUP_OVER_MEAN * 1.01 && rate > 0.0,
                "{points} points: {rate} tokens/ms against a plain mean of {mean_rate}"
            );
        }
    }

    // A busy replica: the intervals with more KV in use are also the ones whose decode steps
    // carried the most prefill, so the time per output token climbs far faster than KV usage
    // explains. Least squares puts that line's intercept below zero; fleet-sim once showed an
    // idle step of 0 ms and a full one of 3.4 s. The prior's shape, scaled to the data, stands.
    #[test]
    fn a_decode_line_no_engine_could_have_falls_back_to_the_prior_s_shape() {
        let config = CalibrationConfig::default();
        let mut cal = EndpointCalibration::default();
        let mut c = EngineCounters::default();
        for step in 0..100u64 {
            // Ten intervals at half the KV in use, ten at 90 %, and so on.
            let busy = (step / 10) % 2 == 1;
            let (kv, itl_ms) = if busy { (0.9, 80.0) } else { (0.5, 20.0) };
            c.itl_count += 100.0;
            c.itl_seconds += 100.0 * itl_ms / 1000.0;
            cal.observe(c, kv, step * 100, PRIOR, &config);
        }
        let got = cal.calibrated(PRIOR, &config);
        assert!(got.itl_ms_idle > 1.0, "{got:?}");
        let ratio = got.itl_ms_full / got.itl_ms_idle;
        assert!(
            (ratio - PRIOR.itl_ms_full / PRIOR.itl_ms_idle).abs() < 1e-6,
            "{got:?}"
        );
        // Through the data's mean: 50 ms at a mean KV usage of 0.7.
        let at_mean = got.itl_ms_idle + (got.itl_ms_full - got.itl_ms_idle) * 0.7;
        assert!((at_mean - 50.0).abs() < 5.0, "{got:?}");
    }

    #[test]
    fn a_cold_endpoint_is_scored_at_the_prior() {
        let cold = EndpointCalibration::default().calibrated(PRIOR, &CalibrationConfig::default());
        assert_eq!(cold, Calibrated::from_prior(PRIOR));
    }

    #[test]
    fn garbage_counters_change_nothing() {
        let config = CalibrationConfig::default();
        let mut cal = EndpointCalibration::default();
        let before = cal.calibrated(PRIOR, &config);
        for (i, v) in [f64::NAN, f64::INFINITY, -1.0].into_iter().enumerate() {
            let c = EngineCounters {
                prefill_computed_tokens: v,
                itl_count: v,
                ..Default::default()
            };
            cal.observe(c, f64::NAN, i as u64 * 100, PRIOR, &config);
        }
        assert_eq!(cal.calibrated(PRIOR, &config), before);
    }
    // Short prefills say nothing (their time is the trip); the estimate is the fastest of the
    // last eight long ones, so one slow sample on a busy replica does not move it, and the
    // ninth pushes the first out.
    #[test]
    fn shown_prefill_is_the_fastest_of_the_last_long_prefills() {
        let mut shown = ShownPrefill::default();
        assert_eq!(shown.fastest(), None);
        assert!(!shown.observe(500.0, 10.0, 0, 1));
        shown.observe(f64::NAN, 10.0, 0, 2);
        shown.observe(4_000.0, f64::INFINITY, 0, 3);
        assert_eq!(shown.fastest(), None);
        assert!(shown.observe(4_000.0, 400.0, 5, 4));
        shown.observe(4_000.0, 4_000.0, 6, 5);
        assert_eq!(shown.fastest(), Some(10.0));
        assert_eq!(shown.last_shown_ms(), 6);
        for id in 0..7 {
            shown.observe(2_000.0, 1_000.0, 7, 10 + id);
        }
        assert_eq!(shown.fastest(), Some(2.0));
        // A first token reported at the decision's own millisecond reads as 1 ms, not zero.
        shown.observe(2_000.0, 0.0, 8, 20);
        assert_eq!(shown.fastest(), Some(2_000.0));
    }

    // An outcome that says the prefill was not what the router believed reads its sample
    // again, or forgets it; a new sample then still pushes out the oldest.
    #[test]
    fn an_outcome_corrects_or_forgets_its_sample() {
        let mut shown = ShownPrefill::default();
        shown.observe(2_000.0, 1_000.0, 1, 1);
        // Believed a 2,000-token miss, served from cache in 10 ms: 200 tokens/ms for now.
        shown.observe(2_000.0, 10.0, 2, 2);
        assert_eq!(shown.fastest(), Some(200.0));
        // The engine had 1,950 of them cached: no sample.
        assert!(shown.correct(2, None, 10.0));
        assert_eq!(shown.fastest(), Some(2.0));
        assert!(!shown.correct(2, None, 10.0), "already forgotten");
        // A larger prefill than believed reads faster.
        assert!(shown.correct(1, Some(3_000.0), 1_000.0));
        assert_eq!(shown.fastest(), Some(3.0));
        // Read again as too short: forgotten as well.
        shown.observe(2_000.0, 1_000.0, 3, 3);
        assert!(shown.correct(3, Some(500.0), 1_000.0));
        assert_eq!(shown.fastest(), Some(3.0));
        // Eight held less one forgotten, then two more: the oldest (decision 1) goes first.
        for id in 10..17 {
            shown.observe(1_024.0, 1_024.0, 4, id);
        }
        assert_eq!(shown.fastest(), Some(3.0));
        assert!(shown.correct(12, None, 1.0));
        shown.observe(1_024.0, 1_024.0, 5, 17);
        assert_eq!(shown.fastest(), Some(3.0));
        shown.observe(1_024.0, 1_024.0, 5, 18);
        assert_eq!(shown.fastest(), Some(1.0));
    }

    #[test]
    fn a_slowdown_halves_its_excess_every_half_life() {
        assert_eq!(decayed_slowdown(5.0, 0), 5.0);
        assert_eq!(decayed_slowdown(5.0, SLOWDOWN_HALF_LIFE_MS as u64), 3.0);
        assert_eq!(decayed_slowdown(5.0, 2 * SLOWDOWN_HALF_LIFE_MS as u64), 2.0);
        assert_eq!(decayed_slowdown(1.0, 7), 1.0);
    }

    #[test]
    fn slowdown_counts_from_a_generation_apart() {
        assert_eq!(slowdown(10.0, 10.0), 1.0);
        assert_eq!(slowdown(6.0, 10.0), 1.0);
        assert_eq!(slowdown(5.0, 10.0), 2.0);
        assert_eq!(slowdown(1.25, 10.0), 8.0);
        assert_eq!(slowdown(20.0, 10.0), 1.0);
        assert_eq!(slowdown(0.0, 10.0), 1.0);
    }
}
