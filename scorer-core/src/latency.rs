//! Predicted latency: an online, per-endpoint model of time to first token (TTFT) and time per
//! output token (TPOT), learned from the filter's outcome reports, with no extra service.
//!
//! The analytic cost in [`crate::router`] assumes one prefill rate and one decode slow-down for
//! every replica. Real replicas differ (GPU type, tensor parallelism, noisy neighbours, the
//! network hop), so each endpoint gets a small linear model fitted by recursive least squares
//! with exponential forgetting:
//!
//! - `ttft ≈ a0 + a1·queue_ktok + a2·uncached_ktok + a3·active/16`
//! - `tpot ≈ b0 + b1·active/16 + b2·kv_usage`
//!
//! where the features are what the router knew at decision time (kept in the in-flight entry).
//! A streamed outcome gives one TTFT and one TPOT observation; an unstreamed one (first byte at
//! the end) gives `total ≈ ttft + (n-1)·tpot`, which is linear in the same seven parameters.
//! The prior comes from [`ScoringConfig`], so an endpoint predicts sensibly before its first
//! report. Memory is fixed (a 7×7 covariance per endpoint) and every step is deterministic.

use serde::{Deserialize, Serialize};

use crate::router::ScoringConfig;

/// Number of model parameters: four for TTFT, three for TPOT.
const PARAMS: usize = 7;
/// TTFT parameters occupy `0..TTFT_PARAMS`, TPOT parameters the rest.
const TTFT_PARAMS: usize = 4;
/// Tokens per queue/uncached feature unit (keeps features near 1 for conditioning).
const TOKENS_PER_UNIT: f64 = 1000.0;
/// Active sequences per batch feature unit.
const SEQS_PER_UNIT: f64 = 16.0;
/// Observations above this (10 minutes) are not latencies of a served request: ignored.
const MAX_OBSERVED_MS: f64 = 600_000.0;

/// Tunables of the learned latency model (`latency:` in the router configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LatencyConfig {
    /// Whether the scorer uses the learned model (predictions are always made and explained).
    pub enabled: bool,
    /// Weight of the learned estimate against the analytic one once an endpoint is warm
    /// (0: analytic only, 1: learned only).
    pub blend: f64,
    /// Outcomes an endpoint must have reported before its model affects scoring.
    pub min_samples: u32,
    /// Forgetting factor of recursive least squares per observation (closer to 1: longer
    /// memory; 0.99 weighs roughly the last hundred observations).
    pub forgetting: f64,
    /// Prior fixed overhead of TTFT (network hop, tokenisation, scheduling), in ms.
    pub overhead_ms: f64,
    /// Smoothing of the per-endpoint prediction-error average (weight of the newest error).
    pub error_smoothing: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            blend: 0.5,
            min_samples: 32,
            forgetting: 0.99,
            overhead_ms: 5.0,
            error_smoothing: 0.05,
        }
    }
}

/// What the router knew about an endpoint when it scored a request: the model's inputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyFeatures {
    /// Prefill tokens queued ahead (router backlog plus unknown waiting requests).
    pub queue_tokens: f64,
    /// This request's prompt tokens not in the endpoint's prefix cache.
    pub uncached_tokens: f64,
    /// Sequences running or waiting there (the decode batch this request joins).
    pub active: f64,
    /// KV-cache usage there (0..=1).
    pub kv_usage: f64,
}

impl LatencyFeatures {
    fn ttft_vector(&self) -> [f64; TTFT_PARAMS] {
        [
            1.0,
            finite(self.queue_tokens) / TOKENS_PER_UNIT,
            finite(self.uncached_tokens) / TOKENS_PER_UNIT,
            finite(self.active) / SEQS_PER_UNIT,
        ]
    }

    fn tpot_vector(&self) -> [f64; PARAMS - TTFT_PARAMS] {
        [
            1.0,
            finite(self.active) / SEQS_PER_UNIT,
            finite(self.kv_usage).clamp(0.0, 1.0),
        ]
    }
}

fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x.clamp(-1e9, 1e9)
    } else {
        0.0
    }
}

/// A model's prediction for one request on one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyPrediction {
    /// Predicted time to first token, ms.
    pub ttft_ms: f64,
    /// Predicted time per output token after the first, ms.
    pub tpot_ms: f64,
    /// The TTFT prediction without its fixed overhead: the part that differs between endpoints.
    pub ttft_variable_ms: f64,
}

/// What one outcome report says about latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Observation {
    /// A streamed response: first token and the pace of the rest are both visible.
    Streamed {
        /// Time to first token, ms.
        ttft_ms: f64,
        /// Mean time per output token after the first, ms (absent for one-token answers).
        tpot_ms: Option<f64>,
    },
    /// First byte at the end (not streamed): only `ttft + (n-1)·tpot` is visible.
    Whole {
        /// Time to the last byte, ms.
        total_ms: f64,
        /// Output tokens.
        output_tokens: u32,
    },
}

impl Observation {
    /// Reads an outcome's timings: `None` when they say nothing usable (failed request, no
    /// first byte, absurd values). A response whose last byte came more than 2 ms after its
    /// first counts as streamed.
    pub fn from_outcome(
        status: u16,
        ttfb_ms: Option<u64>,
        total_ms: u64,
        completion_tokens: Option<u32>,
    ) -> Option<Self> {
        if status != 200 {
            return None;
        }
        let ttfb = ttfb_ms? as f64;
        let total = (total_ms as f64).max(ttfb);
        if total > MAX_OBSERVED_MS {
            return None;
        }
        if total - ttfb > 2.0 {
            let tpot_ms = completion_tokens
                .filter(|&n| n >= 2)
                .map(|n| (total - ttfb) / f64::from(n - 1));
            return Some(Self::Streamed {
                ttft_ms: ttfb,
                tpot_ms,
            });
        }
        match completion_tokens {
            Some(n) if n >= 1 => Some(Self::Whole {
                total_ms: total,
                output_tokens: n,
            }),
            _ => None,
        }
    }
}

/// Running prediction-error figures of one endpoint's model, measured before each update.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PredictionErrors {
    /// TTFT observations scored (streamed, or whole answers of one token).
    pub ttft_samples: u64,
    /// Smoothed |predicted − observed| / observed of TTFT.
    pub ttft_error_ratio: f64,
    /// Smoothed |predicted − observed| of TTFT, ms.
    pub ttft_abs_error_ms: f64,
    /// TPOT observations scored.
    pub tpot_samples: u64,
    /// Smoothed |predicted − observed| / observed of TPOT.
    pub tpot_error_ratio: f64,
}

/// One endpoint's learned TTFT/TPOT model.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointLatencyModel {
    theta: [f64; PARAMS],
    covariance: [[f64; PARAMS]; PARAMS],
    prior_variance: [f64; PARAMS],
    samples: u32,
    errors: PredictionErrors,
}

impl EndpointLatencyModel {
    /// A model at its prior: the analytic cost model's own constants.
    pub fn new(scoring: &ScoringConfig, latency: &LatencyConfig) -> Self {
        let ms_per_ktok = TOKENS_PER_UNIT / scoring.prefill_tokens_per_ms.max(1e-3);
        let theta = [
            latency.overhead_ms,
            ms_per_ktok,
            ms_per_ktok,
            scoring.decode_ms_per_seq * SEQS_PER_UNIT,
            scoring.itl_ms_idle,
            0.0,
            (scoring.itl_ms_full - scoring.itl_ms_idle).max(0.0),
        ];
        // Prior standard deviations: ~20 ms overhead, ~100 ms per unit of the TTFT slopes,
        // ~5 ms per unit of TPOT terms.
        let prior_variance = [400.0, 1e4, 1e4, 1e4, 25.0, 25.0, 25.0];
        let mut covariance = [[0.0; PARAMS]; PARAMS];
        for (i, row) in covariance.iter_mut().enumerate() {
            row[i] = prior_variance[i];
        }
        Self {
            theta,
            covariance,
            prior_variance,
            samples: 0,
            errors: PredictionErrors::default(),
        }
    }

    /// Outcomes that have updated this model.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Prediction-error figures so far.
    pub fn errors(&self) -> PredictionErrors {
        self.errors
    }

    /// Predicts TTFT and TPOT for a request with `features` (never negative).
    pub fn predict(&self, features: &LatencyFeatures) -> LatencyPrediction {
        let x = features.ttft_vector();
        let z = features.tpot_vector();
        let variable: f64 = (1..TTFT_PARAMS).map(|i| self.theta[i] * x[i]).sum();
        let ttft = self.theta[0] + variable;
        let tpot: f64 = (0..z.len())
            .map(|i| self.theta[TTFT_PARAMS + i] * z[i])
            .sum();
        LatencyPrediction {
            ttft_ms: ttft.max(0.0),
            tpot_ms: tpot.max(0.0),
            ttft_variable_ms: variable.max(0.0),
        }
    }

    /// Learns from one outcome of a request scored with `features`, after scoring the
    /// prediction made for it (errors are measured before the update).
    pub fn observe(
        &mut self,
        features: &LatencyFeatures,
        observation: Observation,
        config: &LatencyConfig,
    ) {
        let predicted = self.predict(features);
        let x = features.ttft_vector();
        let z = features.tpot_vector();
        let alpha = config.error_smoothing.clamp(1e-3, 1.0);
        let lambda = config.forgetting.clamp(0.5, 1.0);
        match observation {
            Observation::Streamed { ttft_ms, tpot_ms } => {
                self.score_ttft(predicted.ttft_ms, ttft_ms, alpha);
                let mut h = [0.0; PARAMS];
                h[..TTFT_PARAMS].copy_from_slice(&x);
                self.update(&h, ttft_ms, lambda);
                if let Some(tpot) = tpot_ms {
                    self.score_tpot(predicted.tpot_ms, tpot, alpha);
                    let mut h = [0.0; PARAMS];
                    h[TTFT_PARAMS..].copy_from_slice(&z);
                    self.update(&h, tpot, lambda);
                }
            }
            Observation::Whole {
                total_ms,
                output_tokens,
            } => {
                let later = f64::from(output_tokens.saturating_sub(1));
                if later == 0.0 {
                    self.score_ttft(predicted.ttft_ms, total_ms, alpha);
                }
                let mut h = [0.0; PARAMS];
                h[..TTFT_PARAMS].copy_from_slice(&x);
                for (slot, zi) in h[TTFT_PARAMS..].iter_mut().zip(z) {
                    *slot = later * zi;
                }
                self.update(&h, total_ms, lambda);
            }
        }
        self.samples = self.samples.saturating_add(1);
    }

    fn score_ttft(&mut self, predicted: f64, observed: f64, alpha: f64) {
        let e = &mut self.errors;
        let abs = (predicted - observed).abs();
        let ratio = abs / observed.max(1.0);
        if e.ttft_samples == 0 {
            e.ttft_error_ratio = ratio;
            e.ttft_abs_error_ms = abs;
        } else {
            e.ttft_error_ratio += alpha * (ratio - e.ttft_error_ratio);
            e.ttft_abs_error_ms += alpha * (abs - e.ttft_abs_error_ms);
        }
        e.ttft_samples += 1;
    }

    fn score_tpot(&mut self, predicted: f64, observed: f64, alpha: f64) {
        let e = &mut self.errors;
        let ratio = (predicted - observed).abs() / observed.max(0.1);
        if e.tpot_samples == 0 {
            e.tpot_error_ratio = ratio;
        } else {
            e.tpot_error_ratio += alpha * (ratio - e.tpot_error_ratio);
        }
        e.tpot_samples += 1;
    }

    /// One recursive-least-squares step with forgetting `lambda`, then a cap that keeps every
    /// variance at or below its prior (no covariance wind-up for parameters that a workload
    /// does not excite, e.g. TPOT terms under unstreamed one-token answers).
    fn update(&mut self, h: &[f64; PARAMS], y: f64, lambda: f64) {
        if !y.is_finite() {
            return;
        }
        let p = &self.covariance;
        let mut ph = [0.0; PARAMS];
        for (i, out) in ph.iter_mut().enumerate() {
            *out = (0..PARAMS).map(|j| p[i][j] * h[j]).sum();
        }
        let denominator = lambda + (0..PARAMS).map(|i| h[i] * ph[i]).sum::<f64>();
        if !denominator.is_finite() || denominator <= 0.0 {
            return;
        }
        let gain: [f64; PARAMS] = std::array::from_fn(|i| ph[i] / denominator);
        let residual = y - (0..PARAMS).map(|i| self.theta[i] * h[i]).sum::<f64>();
        let mut theta = self.theta;
        for (t, g) in theta.iter_mut().zip(gain) {
            *t += g * residual;
        }
        // P' = (P − k·(P·h)ᵀ) / λ (P is symmetric, so hᵀP = (P·h)ᵀ).
        let mut next = [[0.0; PARAMS]; PARAMS];
        for i in 0..PARAMS {
            for j in 0..PARAMS {
                next[i][j] = (p[i][j] - gain[i] * ph[j]) / lambda;
            }
        }
        // Re-symmetrise and cap variances at the prior (D·P·D keeps P positive semi-definite).
        let scale: [f64; PARAMS] = std::array::from_fn(|i| {
            let v = next[i][i];
            if v > self.prior_variance[i] {
                (self.prior_variance[i] / v).sqrt()
            } else {
                1.0
            }
        });
        for i in 0..PARAMS {
            for j in i..PARAMS {
                let v = 0.5 * (next[i][j] + next[j][i]) * scale[i] * scale[j];
                next[i][j] = v;
                next[j][i] = v;
            }
        }
        if theta.iter().all(|t| t.is_finite()) && next.iter().flatten().all(|v| v.is_finite()) {
            self.theta = theta;
            self.covariance = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(queue: f64, uncached: f64, active: f64) -> LatencyFeatures {
        LatencyFeatures {
            queue_tokens: queue,
            uncached_tokens: uncached,
            active,
            kv_usage: active / 64.0,
        }
    }

    /// A replica three times slower at prefill than the prior assumes, 30 ms network overhead.
    fn true_ttft(f: &LatencyFeatures) -> f64 {
        30.0 + (f.queue_tokens + f.uncached_tokens) / 3.0 + 2.0 * f.active
    }

    fn true_tpot(f: &LatencyFeatures) -> f64 {
        8.0 + 0.5 * f.active
    }

    #[test]
    fn prior_matches_the_analytic_model() {
        let (s, l) = (ScoringConfig::default(), LatencyConfig::default());
        let m = EndpointLatencyModel::new(&s, &l);
        let p = m.predict(&features(0.0, 1000.0, 0.0));
        let ttft = l.overhead_ms + 1000.0 / s.prefill_tokens_per_ms;
        assert!((p.ttft_ms - ttft).abs() < 1e-9, "{p:?}");
        assert!((p.tpot_ms - s.itl_ms_idle).abs() < 1e-9, "{p:?}");
        assert_eq!(m.samples(), 0);
    }

    #[test]
    fn streamed_outcomes_converge_to_the_replica_truth() {
        let config = LatencyConfig::default();
        let mut m = EndpointLatencyModel::new(&ScoringConfig::default(), &config);
        // Deterministic, varied inputs (a small LCG), with ±5% multiplicative noise.
        let mut s = 12345u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as f64 / (1u64 << 31) as f64
        };
        for _ in 0..400 {
            let f = features(next() * 4000.0, next() * 3000.0, (next() * 48.0).floor());
            let noise = 0.95 + 0.1 * next();
            m.observe(
                &f,
                Observation::Streamed {
                    ttft_ms: true_ttft(&f) * noise,
                    tpot_ms: Some(true_tpot(&f) * noise),
                },
                &config,
            );
        }
        for f in [features(0.0, 2000.0, 4.0), features(3000.0, 500.0, 32.0)] {
            let p = m.predict(&f);
            let (t, d) = (true_ttft(&f), true_tpot(&f));
            assert!((p.ttft_ms - t).abs() / t < 0.1, "{p:?} vs {t}");
            assert!((p.tpot_ms - d).abs() / d < 0.1, "{p:?} vs {d}");
        }
        assert!(m.errors().ttft_error_ratio < 0.15, "{:?}", m.errors());
        assert_eq!(m.samples(), 400);
    }

    #[test]
    fn whole_answers_teach_ttft_and_tpot_jointly() {
        let config = LatencyConfig::default();
        let mut m = EndpointLatencyModel::new(&ScoringConfig::default(), &config);
        for i in 0..300u32 {
            let f = features(f64::from(i % 7) * 500.0, f64::from(i % 11) * 300.0, 0.0);
            let n = 1 + (i % 5) * 40;
            let total = true_ttft(&f) + f64::from(n - 1) * true_tpot(&f);
            m.observe(
                &f,
                Observation::Whole {
                    total_ms: total,
                    output_tokens: n,
                },
                &config,
            );
        }
        let f = features(1000.0, 1000.0, 0.0);
        let p = m.predict(&f);
        assert!((p.ttft_ms - true_ttft(&f)).abs() < 10.0, "{p:?}");
        assert!((p.tpot_ms - true_tpot(&f)).abs() < 0.5, "{p:?}");
    }

    #[test]
    fn outcomes_are_read_conservatively() {
        assert_eq!(Observation::from_outcome(500, Some(5), 9, Some(3)), None);
        assert_eq!(Observation::from_outcome(200, None, 9, Some(3)), None);
        assert_eq!(
            Observation::from_outcome(200, Some(1), 700_000, Some(3)),
            None
        );
        assert_eq!(
            Observation::from_outcome(200, Some(100), 300, Some(21)),
            Some(Observation::Streamed {
                ttft_ms: 100.0,
                tpot_ms: Some(10.0)
            })
        );
        assert_eq!(
            Observation::from_outcome(200, Some(250), 251, Some(1)),
            Some(Observation::Whole {
                total_ms: 251.0,
                output_tokens: 1
            })
        );
        assert_eq!(Observation::from_outcome(200, Some(250), 250, None), None);
    }

    #[test]
    fn absurd_inputs_never_poison_the_model() {
        let config = LatencyConfig::default();
        let mut m = EndpointLatencyModel::new(&ScoringConfig::default(), &config);
        let bad = LatencyFeatures {
            queue_tokens: f64::NAN,
            uncached_tokens: f64::INFINITY,
            active: -1e300,
            kv_usage: f64::NAN,
        };
        m.observe(
            &bad,
            Observation::Streamed {
                ttft_ms: 1e12,
                tpot_ms: Some(f64::NAN),
            },
            &config,
        );
        let p = m.predict(&features(100.0, 100.0, 1.0));
        assert!(p.ttft_ms.is_finite() && p.tpot_ms.is_finite(), "{p:?}");
        assert!(p.ttft_ms >= 0.0 && p.tpot_ms >= 0.0);
    }
}
