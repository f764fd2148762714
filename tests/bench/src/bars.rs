//! Issue #15's bars as the bench judges them: a figure against the most a bar allows, with
//! its interval ([`verdict`]), and the local path against the route call on the aiperf
//! workloads, pooled over the seeds both ran ([`quality_bars`]). Pure functions over the
//! bench's rows, tested here; `kvroute-bench` prints them.

use serde::Serialize;

use crate::QualityRow;

/// Bootstrap resamples behind every interval a bar prints ([`crate::median_difference_interval`]).
pub const BOOTSTRAP_ROUNDS: usize = 2_000;

/// A figure against the most a bar allows, with the figure's 95 % interval when it has one:
/// met or missed outright when the whole interval is on one side, else the point's side and
/// that the bar is inside the interval.
pub fn verdict(value: f64, ci95: Option<[f64; 2]>, at_most: f64) -> &'static str {
    match ci95 {
        Some([_, hi]) if hi <= at_most => "met",
        Some([lo, _]) if lo > at_most => "missed",
        Some(_) if value <= at_most => "met (the bar is inside the interval)",
        Some(_) => "missed (the bar is inside the interval)",
        None if value <= at_most => "met",
        None => "missed",
    }
}

/// The quality section's runs: every router once on each workload (the table), and the local
/// path and the route call `--quality-runs` times in all (issue #15's quality bars pool them).
#[derive(Debug, Default)]
pub struct QualityRuns {
    /// Each router's first run of each workload.
    pub table: Vec<QualityRow>,
    /// The local path's and the route call's further runs, next seeds, order alternated.
    pub repeats: Vec<QualityRow>,
}

/// One of issue #15's quality bars in this run: on one aiperf workload, `kvroute-local`'s
/// TTFT p50 or p99 over the route call's (at most 1.05), or the route call's prefix hit rate
/// over the local path's (at most 1.05: the local path's at least 95 % of it), each over every
/// seed both ran (`--quality-runs`).
#[derive(Debug, Clone, Serialize)]
pub struct QualityBar {
    /// The aiperf workload (`shared-prefix`, `multi-turn`).
    pub workload: String,
    /// `ttft_ms_p50`, `ttft_ms_p99` or `prefix_hit_rate`.
    pub figure: &'static str,
    /// The local path's figure: a TTFT percentile over every run's requests pooled (nearest
    /// rank), the mean of the runs' hit rates.
    pub local: f64,
    /// The route call's figure, pooled the same way.
    pub route_call: f64,
    /// The ratio judged: local over route call for TTFT, route call over local for hit rate.
    pub ratio: f64,
    /// Its 95 % interval: bootstrap over the runs and, for TTFT, their requests; none for a
    /// hit rate with one run (the replicas' counters give no per-request samples).
    pub ci95: Option<[f64; 2]>,
    /// The aiperf seeds both paths ran.
    pub seeds: Vec<u64>,
    /// The ratio in each run alone, in seed order.
    pub per_run: Vec<f64>,
    /// The most the bar allows.
    pub at_most: f64,
}

/// The local path against the route call on every workload both ran, pooled over the seeds
/// both ran.
pub fn quality_bars(runs: &QualityRuns) -> Vec<QualityBar> {
    const AT_MOST: f64 = 1.05;
    let all: Vec<&QualityRow> = runs.table.iter().chain(&runs.repeats).collect();
    let mut bars = Vec::new();
    let mut workloads: Vec<&str> = Vec::new();
    // In the table's order; a workload whose seed-7 runs both failed still has its repeats.
    for q in &all {
        if !workloads.contains(&q.workload.as_str()) {
            workloads.push(&q.workload);
        }
    }
    for workload in workloads {
        let of = |router: &'static str| {
            all.iter()
                .copied()
                .filter(move |q| q.router == router && q.workload == workload)
        };
        // Each local run with the route call's run on the same seed, in seed order.
        let mut pairs: Vec<(u64, &QualityRow, &QualityRow)> = of("kvroute-local")
            .filter_map(|l| {
                let call = of("kvroute").find(|c| c.aiperf_seed == l.aiperf_seed)?;
                Some((l.aiperf_seed, l, call))
            })
            .filter(|(_, l, c)| !l.ttft_samples_ms.is_empty() && !c.ttft_samples_ms.is_empty())
            .collect();
        pairs.sort_by_key(|p| p.0);
        if pairs.is_empty() {
            continue;
        }
        let seeds: Vec<u64> = pairs.iter().map(|p| p.0).collect();
        let samples: Vec<(&[f64], &[f64])> = pairs
            .iter()
            .map(|(_, l, c)| (&l.ttft_samples_ms[..], &c.ttft_samples_ms[..]))
            .collect();
        for (figure, q) in [("ttft_ms_p50", 50.0), ("ttft_ms_p99", 99.0)] {
            let Some([local, route_call]) = crate::pooled_percentiles(&samples, q) else {
                continue;
            };
            bars.push(QualityBar {
                workload: workload.to_string(),
                figure,
                local,
                route_call,
                ratio: local / route_call,
                ci95: crate::percentile_ratio_interval(&samples, q, BOOTSTRAP_ROUNDS, 11),
                seeds: seeds.clone(),
                per_run: samples
                    .iter()
                    .filter_map(|run| crate::pooled_percentile_ratio(&[*run], q))
                    .collect(),
                at_most: AT_MOST,
            });
        }
        let hits: Vec<(f64, f64)> = pairs
            .iter()
            .map(|(_, l, c)| (c.prefix_hit_rate, l.prefix_hit_rate))
            .collect();
        let n = hits.len() as f64;
        let (route_call, local) = (
            hits.iter().map(|h| h.0).sum::<f64>() / n,
            hits.iter().map(|h| h.1).sum::<f64>() / n,
        );
        bars.push(QualityBar {
            workload: workload.to_string(),
            figure: "prefix_hit_rate",
            local,
            route_call,
            ratio: route_call / local,
            ci95: crate::runs_mean_ratio_interval(&hits, BOOTSTRAP_ROUNDS, 11),
            per_run: hits.iter().map(|(c, l)| c / l).collect(),
            seeds,
            at_most: AT_MOST,
        });
    }
    bars
}

/// The median of the known values (the upper one of an even count); `None` when none is known.
pub fn median(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut known: Vec<f64> = values.flatten().collect();
    known.sort_by(f64::total_cmp);
    known.get(known.len() / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{P50P99, P99};

    fn row(router: &str, workload: &str, seed: u64, scale: f64, hit: f64) -> QualityRow {
        QualityRow {
            router: router.into(),
            workload: workload.into(),
            ttft_ms: P50P99 { p50: 0.0, p99: 0.0 },
            itl_ms: P99 { p99: 0.0 },
            output_tokens_per_s: 0.0,
            prefix_hit_rate: hit,
            requests: 100,
            errors: 0,
            load_generator: "aiperf 0.13.0".into(),
            aiperf_seed: seed,
            ttft_samples_ms: (1..=100).map(|i| f64::from(i) * scale).collect(),
        }
    }

    #[test]
    fn quality_bars_pair_the_two_paths_seed_by_seed() {
        let runs = QualityRuns {
            table: vec![
                row("kvroute", "chat", 7, 1.0, 0.8),
                row("kvroute-local", "chat", 7, 1.1, 0.8),
                row("round-robin", "chat", 7, 3.0, 0.2),
            ],
            repeats: vec![
                row("kvroute-local", "chat", 8, 0.9, 0.9),
                row("kvroute", "chat", 8, 1.0, 0.8),
                // The route call failed on seed 9: the local run there is left out.
                row("kvroute-local", "chat", 9, 5.0, 0.1),
                // Both seed-7 runs of this workload failed: its later seeds still count.
                row("kvroute-local", "agent", 8, 1.0, 0.5),
                row("kvroute", "agent", 8, 1.0, 0.5),
            ],
        };
        let bars = quality_bars(&runs);
        assert_eq!(bars.len(), 6, "p50, p99 and hit rate for each workload");
        assert_eq!(bars[3].workload, "agent");
        assert_eq!(bars[3].seeds, vec![8]);
        let p50 = &bars[0];
        assert_eq!(p50.figure, "ttft_ms_p50");
        assert_eq!(p50.seeds, vec![7, 8]);
        assert_eq!(p50.per_run.len(), 2);
        assert!((p50.per_run[0] - 1.1).abs() < 1e-9 && (p50.per_run[1] - 0.9).abs() < 1e-9);
        assert!((p50.ratio - 1.0).abs() < 0.06, "pooled: {}", p50.ratio);
        let [lo, hi] = p50.ci95.expect("an interval");
        assert!(lo < 1.0 && hi > 1.0, "{lo}..{hi}");
        let hit = &bars[2];
        assert_eq!(hit.figure, "prefix_hit_rate");
        assert!((hit.local - 0.85).abs() < 1e-9 && (hit.route_call - 0.8).abs() < 1e-9);
        assert!(
            hit.ci95.is_some(),
            "two seeds give the hit rate an interval"
        );
        assert_eq!(verdict(hit.ratio, hit.ci95, hit.at_most), "met");
    }

    #[test]
    fn the_median_round_skips_unknown_values_and_takes_the_upper_middle() {
        assert_eq!(
            median([Some(3.0), None, Some(1.0), Some(2.0)].into_iter()),
            Some(2.0)
        );
        assert_eq!(median([Some(4.0), Some(1.0)].into_iter()), Some(4.0));
        assert_eq!(median([None, None].into_iter()), None);
        assert_eq!(median(std::iter::empty()), None);
    }
}
