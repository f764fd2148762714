//! Summaries of runs: percentiles, the printed table, the JSON summary and SVG plots.

use kvroute_harness::TextTable;
use serde::Serialize;

use super::des::{RequestRecord, RunResult};
use super::workload::Workload;

/// Percentiles of a latency distribution (ms).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// Nearest-rank percentile of sorted values (`q` in 0..=1); 0 for no values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Latency {
    /// Summarises `values` (any order).
    pub fn of(values: &mut [f64]) -> Self {
        values.sort_by(f64::total_cmp);
        let mean = if values.is_empty() {
            0.0
        } else {
            values.iter().sum::<f64>() / values.len() as f64
        };
        Self {
            mean,
            p50: percentile(values, 0.5),
            p90: percentile(values, 0.9),
            p99: percentile(values, 0.99),
        }
    }
}

/// One policy's line of `fleet-sim compare` (the JSON summary's `results[]` element).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PolicySummary {
    /// Policy name.
    pub policy: String,
    /// Requests that finished.
    pub requests: usize,
    /// Requests the engines refused.
    pub rejected: usize,
    /// Time to first token from arrival.
    pub ttft_ms: Latency,
    /// Arrival to last token.
    pub e2e_ms: Latency,
    /// Output tokens over the makespan.
    pub output_tokens_per_s: f64,
    /// Prefix-cache hits over queries, in tokens, over all replicas.
    pub prefix_hit_rate: f64,
    /// Preemptions over all replicas.
    pub preemptions: u64,
    /// Largest waiting queue seen on a replica.
    pub max_waiting: u32,
    /// |predicted - actual| cached tokens over actual, summed over requests (policies that predict).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_prediction_error: Option<f64>,
    /// Share of decisions a proxy's copy took without a route call (policies deciding in proxies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_decision_fraction: Option<f64>,
    /// Endpoints kvroute's self-check switched to load-only routing or back (kvroute's
    /// policies): the simulated engines deliver what they hold, so each is a false alarm.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing_state_changes: Option<u64>,
    /// Share of the requests routed to the replica that got the most: a cache-aware router
    /// that draws a fleet onto one prefix holder shows here long before its TTFT does.
    pub busiest_replica_share: f64,
    /// kvroute's fleet numbers, in tokens: reuse the traffic offered (its router's window),
    /// aimed for, delivered, and the gap by reason (kvroute's policies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reuse: Option<scorer_core::reuse::ReuseTotals>,
    /// Placement regret against the greedy oracle (runs with `--regret`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regret: Option<RegretSummary>,
}

/// A run's placement regret: for each routed request, how much later its first token would
/// come where the policy sent it than at the exact best replica, given the fleet's exact state
/// at that moment ([`crate::oracle::regret_ms`]). It separates a tail made by placement (a
/// request sent to a cold or queued replica while another would have served it at once) from
/// a tail made by load (no replica could have served it sooner).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RegretSummary {
    /// Routed requests whose regret was measured.
    pub decisions: usize,
    /// Share of them placed more than [`OFF_BEST_MS`] later than the exact best.
    pub off_best_share: f64,
    /// Mean regret (ms).
    pub mean_ms: f64,
    /// 99th percentile of the regret (ms).
    pub p99_ms: f64,
    /// The largest regret (ms).
    pub max_ms: f64,
    /// Over the requests whose TTFT is at or above the run's TTFT p99: their regret summed
    /// over their TTFT summed. Near 1, the tail is placement; near 0, load.
    pub tail_share: f64,
}

/// Regret below this (ms) counts as placed at the best: a simulated step's rounding.
pub const OFF_BEST_MS: f64 = 1.0;

impl RegretSummary {
    /// Summarises the regret of `done` (finished, routed requests); `None` when none has one.
    fn of(done: &[&RequestRecord], ttft_p99: f64) -> Option<Self> {
        let mut regrets: Vec<f64> = done.iter().filter_map(|r| r.regret_ms).collect();
        if regrets.is_empty() {
            return None;
        }
        let (mut tail_regret, mut tail_ttft) = (0.0, 0.0);
        for r in done {
            let (Some(first), Some(regret)) = (r.first_token_ms, r.regret_ms) else {
                continue;
            };
            let ttft = first - r.arrival_ms;
            if ttft >= ttft_p99 {
                tail_regret += regret;
                tail_ttft += ttft;
            }
        }
        let n = regrets.len();
        let off_best = regrets.iter().filter(|&&r| r > OFF_BEST_MS).count();
        let latency = Latency::of(&mut regrets);
        Some(Self {
            decisions: n,
            off_best_share: off_best as f64 / n as f64,
            mean_ms: latency.mean,
            p99_ms: latency.p99,
            max_ms: regrets.last().copied().unwrap_or(0.0),
            tail_share: if tail_ttft > 0.0 {
                (tail_regret / tail_ttft).min(1.0)
            } else {
                0.0
            },
        })
    }
}

impl PolicySummary {
    /// Summarises one run: the requests the router routed (traffic that bypassed it, when a
    /// run has some, is left out, and the hit rate is then the routed requests' own).
    pub fn of(run: &RunResult) -> Self {
        let done: Vec<_> = run
            .records
            .iter()
            .filter(|r| r.finish_ms.is_some() && !r.unseen)
            .collect();
        let any_unseen = run.records.iter().any(|r| r.unseen);
        let routed_hit_rate = || {
            let prompt: u64 = done.iter().map(|r| u64::from(r.prompt_tokens)).sum();
            let cached: u64 = done.iter().map(|r| u64::from(r.cached_tokens)).sum();
            if prompt > 0 {
                cached as f64 / prompt as f64
            } else {
                0.0
            }
        };
        let mut ttft: Vec<f64> = done
            .iter()
            .filter_map(|r| Some(r.first_token_ms? - r.arrival_ms))
            .collect();
        let mut e2e: Vec<f64> = done
            .iter()
            .filter_map(|r| Some(r.finish_ms? - r.arrival_ms))
            .collect();
        let output: u64 = done.iter().map(|r| u64::from(r.output_tokens)).sum();
        let (mut predicted, mut actual, mut any) = (0f64, 0f64, false);
        for r in &done {
            if let Some(p) = r.predicted_cached_tokens {
                any = true;
                predicted += f64::from(p);
                actual += f64::from(r.cached_tokens);
            }
        }
        let ttft_ms = Latency::of(&mut ttft);
        Self {
            policy: run.policy.clone(),
            requests: done.len(),
            rejected: run
                .records
                .iter()
                .filter(|r| r.rejected && !r.unseen)
                .count(),
            ttft_ms,
            e2e_ms: Latency::of(&mut e2e),
            output_tokens_per_s: if run.makespan_ms > 0.0 {
                output as f64 / (run.makespan_ms / 1000.0)
            } else {
                0.0
            },
            prefix_hit_rate: if any_unseen {
                routed_hit_rate()
            } else if run.prefix_queries > 0 {
                run.prefix_hits as f64 / run.prefix_queries as f64
            } else {
                0.0
            },
            preemptions: run.preemptions,
            max_waiting: run.max_waiting,
            cached_prediction_error: (any && actual > 0.0)
                .then(|| (predicted - actual).abs() / actual),
            local_decision_fraction: run.local_decision_fraction,
            routing_state_changes: run.routing_state_changes,
            busiest_replica_share: busiest_share(run.records.iter().filter(|r| !r.unseen)),
            reuse: run.reuse,
            regret: RegretSummary::of(&done, ttft_ms.p99),
        }
    }
}

/// The share of `records` routed to the replica that got the most of them (0 when empty).
fn busiest_share<'a>(records: impl IntoIterator<Item = &'a RequestRecord>) -> f64 {
    let mut per_replica: Vec<usize> = Vec::new();
    let mut total = 0usize;
    for r in records {
        if per_replica.len() <= r.replica {
            per_replica.resize(r.replica + 1, 0);
        }
        per_replica[r.replica] += 1;
        total += 1;
    }
    let busiest = per_replica.iter().copied().max().unwrap_or(0);
    if total == 0 {
        0.0
    } else {
        busiest as f64 / total as f64
    }
}

/// How a policy placed subagent fan-out (issue #17, point 4): a fork is a request that continues
/// a request of another session (`agentic`'s subagents), and a burst is the forks of one parent
/// request, sent within a tool call's latency of each other. The ideal spends as few prefills of
/// the parent's context as the load allows: no scattering over replicas that do not hold it, no
/// piling that makes the forks wait.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForkSummary {
    /// The policy.
    pub policy: String,
    /// Bursts (parents with at least one fork).
    pub bursts: usize,
    /// Forks in them.
    pub forks: usize,
    /// Mean distinct replicas a burst's forks went to.
    pub replicas_per_burst: f64,
    /// Mean forks per burst that prefilled their parent's context again: served with fewer
    /// cached tokens than the parent's prompt, less one block's worth of slack (16 tokens).
    pub context_prefills_per_burst: f64,
    /// Share of forks that went to their parent's replica.
    pub stayed: f64,
    /// Forks' time to first token (ms).
    pub ttft_ms: Latency,
    /// Forks' end-to-end time (ms).
    pub e2e_ms: Latency,
}

impl ForkSummary {
    /// The forks of `run` (of `workload`); `None` when the workload has none.
    pub fn of(workload: &Workload, run: &RunResult) -> Option<Self> {
        const SLACK_TOKENS: u32 = 16;
        let mut bursts: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for i in 0..run.records.len().min(workload.requests.len()) {
            if let Some(parent) = workload.fork_parent(i) {
                bursts.entry(parent).or_default().push(i);
            }
        }
        if bursts.is_empty() {
            return None;
        }
        let (mut replicas, mut prefills, mut stayed, mut forks) = (0usize, 0usize, 0usize, 0usize);
        let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
        for (&parent, children) in &bursts {
            let p = &run.records[parent];
            let mut used: Vec<usize> = children.iter().map(|&c| run.records[c].replica).collect();
            used.sort_unstable();
            used.dedup();
            replicas += used.len();
            for &c in children {
                let r = &run.records[c];
                forks += 1;
                stayed += usize::from(r.replica == p.replica);
                prefills += usize::from(r.cached_tokens + SLACK_TOKENS < p.prompt_tokens);
                ttft.extend(r.first_token_ms.map(|t| t - r.arrival_ms));
                e2e.extend(r.finish_ms.map(|t| t - r.arrival_ms));
            }
        }
        let n = bursts.len() as f64;
        Some(Self {
            policy: run.policy.clone(),
            bursts: bursts.len(),
            forks,
            replicas_per_burst: replicas as f64 / n,
            context_prefills_per_burst: prefills as f64 / n,
            stayed: stayed as f64 / forks.max(1) as f64,
            ttft_ms: Latency::of(&mut ttft),
            e2e_ms: Latency::of(&mut e2e),
        })
    }
}

/// Renders fork summaries as an aligned text table.
pub fn fork_table(rows: &[ForkSummary]) -> String {
    TextTable::new()
        .left("subagent forks", 20, |r: &ForkSummary| r.policy.clone())
        .right("bursts", 7, |r| r.bursts.to_string())
        .right("forks", 6, |r| r.forks.to_string())
        .right("replicas", 9, |r| format!("{:.2}", r.replicas_per_burst))
        .right("prefills", 9, |r| {
            format!("{:.2}", r.context_prefills_per_burst)
        })
        .right("stayed", 7, |r| format!("{:.0}%", r.stayed * 100.0))
        .right("ttft p50", 9, |r| format!("{:.0}", r.ttft_ms.p50))
        .right("ttft p99", 9, |r| format!("{:.0}", r.ttft_ms.p99))
        .right("e2e p50", 9, |r| format!("{:.0}", r.e2e_ms.p50))
        .render(rows)
}

/// Renders summaries as an aligned text table.
pub fn table(rows: &[PolicySummary]) -> String {
    let whole = |v: f64| format!("{v:.0}");
    TextTable::new()
        .left("policy", 20, |r: &PolicySummary| r.policy.clone())
        .right("requests", 8, |r| r.requests.to_string())
        .right("ttft_mean", 10, |r| whole(r.ttft_ms.mean))
        .right("ttft_p50", 10, |r| whole(r.ttft_ms.p50))
        .right("ttft_p90", 10, |r| whole(r.ttft_ms.p90))
        .right("ttft_p99", 10, |r| whole(r.ttft_ms.p99))
        .right("e2e_p50", 10, |r| whole(r.e2e_ms.p50))
        .right("e2e_p99", 10, |r| whole(r.e2e_ms.p99))
        .right("out_tok/s", 9, |r| whole(r.output_tokens_per_s))
        .right("hit_rate", 8, |r| format!("{:.3}", r.prefix_hit_rate))
        .right("preempt", 8, |r| r.preemptions.to_string())
        .render(rows)
}

/// Renders the placement regret of the summaries that have one as an aligned text table.
pub fn regret_table(rows: &[PolicySummary]) -> String {
    let rows: Vec<(&str, RegretSummary)> = rows
        .iter()
        .filter_map(|r| Some((r.policy.as_str(), r.regret?)))
        .collect();
    TextTable::new()
        .left("placement regret", 20, |r: &(&str, RegretSummary)| {
            r.0.to_string()
        })
        .right("decisions", 9, |r| r.1.decisions.to_string())
        .right("off best", 9, |r| {
            format!("{:.1}%", r.1.off_best_share * 100.0)
        })
        .right("mean ms", 8, |r| format!("{:.1}", r.1.mean_ms))
        .right("p99 ms", 8, |r| format!("{:.0}", r.1.p99_ms))
        .right("max ms", 8, |r| format!("{:.0}", r.1.max_ms))
        .right("of ttft tail", 12, |r| {
            format!("{:.0}%", r.1.tail_share * 100.0)
        })
        .render(&rows)
}

const COLORS: &[&str] = &[
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// A line chart as a standalone SVG: one polyline per series, log-scaled y when asked.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_y: bool,
) -> String {
    line_chart_axes(title, x_label, y_label, series, false, log_y)
}

/// A line chart with either axis log-scaled (latency CDFs span orders of magnitude).
pub fn line_chart_axes(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
) -> String {
    let (w, h, left, right, top, bottom) = (760.0, 460.0, 70.0, 190.0, 40.0, 50.0);
    let ty = |v: f64| if log_y { v.max(1e-3).log10() } else { v };
    let tx = |v: f64| if log_x { v.max(1e-3).log10() } else { v };
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    for &(x, y) in pts {
        x0 = x0.min(tx(x));
        x1 = x1.max(tx(x));
        y0 = y0.min(ty(y));
        y1 = y1.max(ty(y));
    }
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let px = |x: f64| left + (tx(x) - x0) / (x1 - x0) * (w - left - right);
    let py = |y: f64| h - bottom - (ty(y) - y0) / (y1 - y0) * (h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"22\" font-size=\"15\">{}</text>\n",
        left,
        xml(title)
    );
    s.push_str(&format!(
        "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - bottom, w - right, h - bottom, h - bottom
    ));
    for k in 0..=4 {
        let f = f64::from(k) / 4.0;
        let xv_t = x0 + f * (x1 - x0);
        let xv = if log_x { 10f64.powf(xv_t) } else { xv_t };
        let yv_t = y0 + f * (y1 - y0);
        let yv = if log_y { 10f64.powf(yv_t) } else { yv_t };
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            px(xv),
            h - bottom + 16.0,
            fmt_num(xv)
        ));
        let yy = h - bottom - f * (h - top - bottom);
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            left - 6.0,
            yy + 4.0,
            fmt_num(yv)
        ));
        s.push_str(&format!(
            "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\n",
            w - right
        ));
    }
    s.push_str(&format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        (left + w - right) / 2.0,
        h - 12.0,
        xml(x_label)
    ));
    s.push_str(&format!(
        "<text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}{}</text>\n",
        (top + h - bottom) / 2.0,
        (top + h - bottom) / 2.0,
        xml(y_label),
        if log_y { " (log)" } else { "" }
    ));
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let coords: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
            coords.join(" ")
        ));
        let ly = top + 10.0 + 18.0 * i as f64;
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"3\"/><text x=\"{}\" y=\"{}\">{}</text>\n",
            w - right + 10.0,
            w - right + 30.0,
            w - right + 36.0,
            ly + 4.0,
            xml(name)
        ));
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The TTFT CDF of each run as chart series (x = TTFT ms, y = fraction).
pub fn ttft_cdf_series(runs: &[RunResult]) -> Vec<(String, Vec<(f64, f64)>)> {
    runs.iter()
        .map(|run| {
            let mut v: Vec<f64> = run
                .records
                .iter()
                .filter_map(|r| Some(r.first_token_ms? - r.arrival_ms))
                .collect();
            v.sort_by(f64::total_cmp);
            let n = v.len().max(1) as f64;
            let step = (v.len() / 200).max(1);
            let pts = v
                .iter()
                .enumerate()
                .filter(|(i, _)| i % step == 0 || *i + 1 == v.len())
                .map(|(i, x)| (*x, (i + 1) as f64 / n))
                .collect();
            (run.policy.clone(), pts)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forks_count_their_bursts_replicas_and_context_prefills() {
        let spec = "agentic:agents=1,steps=3,fork_every=1,fanout=2,sub_steps=1,system=40,task=5";
        let workload = crate::workload::from_spec(spec, 1).unwrap();
        let record = |prompt_tokens: u32| RequestRecord {
            arrival_ms: 0.0,
            first_token_ms: Some(10.0),
            finish_ms: Some(20.0),
            prompt_tokens,
            cached_tokens: prompt_tokens,
            ..Default::default()
        };
        let mut run = RunResult {
            policy: "p".into(),
            records: workload.requests.iter().map(|_| record(100)).collect(),
            ..Default::default()
        };
        let forks: Vec<usize> = (0..workload.requests.len())
            .filter(|&i| workload.fork_parent(i).is_some())
            .collect();
        // Two bursts of two (after turns 1 and 2 of 3), all on the parent's replica, all hits.
        assert_eq!(forks.len(), 4);
        let all_stay = ForkSummary::of(&workload, &run).unwrap();
        assert_eq!((all_stay.bursts, all_stay.forks), (2, 4));
        assert_eq!(all_stay.replicas_per_burst, 1.0);
        assert_eq!(all_stay.context_prefills_per_burst, 0.0);
        assert_eq!(all_stay.stayed, 1.0);
        // One fork moves to a replica without the context and prefills it.
        run.records[forks[0]].replica = 1;
        run.records[forks[0]].cached_tokens = 0;
        let one_moved = ForkSummary::of(&workload, &run).unwrap();
        assert_eq!(one_moved.replicas_per_burst, 1.5);
        assert_eq!(one_moved.context_prefills_per_burst, 0.5);
        assert_eq!(one_moved.stayed, 0.75);
        let plain = crate::workload::from_spec("multi-turn", 1).unwrap();
        assert_eq!(ForkSummary::of(&plain, &run), None);
    }

    // The regret summary: the share off the best, and how much of the TTFT tail (requests at
    // or above the p99) is regret.
    #[test]
    fn regret_summarises_decisions_and_the_tails_share() {
        let record = |ttft: f64, regret: f64| RequestRecord {
            arrival_ms: 10.0,
            first_token_ms: Some(10.0 + ttft),
            finish_ms: Some(20.0 + ttft),
            regret_ms: Some(regret),
            ..RequestRecord::default()
        };
        let mut records: Vec<RequestRecord> = (0..98).map(|_| record(50.0, 0.0)).collect();
        records.push(record(60.0, 0.5));
        records.push(record(400.0, 300.0));
        let done: Vec<&RequestRecord> = records.iter().collect();
        let r = RegretSummary::of(&done, 400.0).unwrap();
        assert_eq!(r.decisions, 100);
        assert!((r.off_best_share - 0.01).abs() < 1e-12, "{r:?}");
        assert!((r.mean_ms - 3.005).abs() < 1e-9, "{r:?}");
        assert_eq!(r.max_ms, 300.0);
        assert!((r.tail_share - 0.75).abs() < 1e-12, "{r:?}");
        // No regret measured: no summary.
        let plain = RequestRecord::default();
        assert_eq!(RegretSummary::of(&[&plain], 0.0), None);
    }

    #[test]
    fn percentiles_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Latency::of(&mut v);
        assert_eq!((l.p50, l.p90, l.p99), (50.0, 90.0, 99.0));
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn the_busiest_replicas_share_counts_routed_requests() {
        let on = |replica| RequestRecord {
            replica,
            ..RequestRecord::default()
        };
        let records = [on(2), on(2), on(0), on(2)];
        assert_eq!(busiest_share(&records), 0.75);
        assert_eq!(busiest_share(&[] as &[RequestRecord]), 0.0);
    }

    #[test]
    fn chart_is_wellformed_svg() {
        let svg = line_chart(
            "t<",
            "x",
            "y",
            &[("a&b".into(), vec![(0.0, 1.0), (1.0, 10.0)])],
            true,
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&amp;b") && svg.contains("t&lt;"));
    }
}
