//! The prefill/decode disaggregation benchmark (`fleet-sim disagg`): the same fleet size run
//! colocated (every replica prefills and decodes) and disaggregated (some replicas have the
//! `prefill` role), both routed by scorer-core's `Router`, in virtual time.
//!
//! Disaggregated requests follow llm-d's flow as vllm-sim models it: the prefill replica runs
//! the prompt (max_tokens 1), the KV moves to the decode replica (prompt tokens × KV bytes per
//! token ÷ link bandwidth) and the decode replica decodes with the blocks present. What the
//! benchmark shows is the trade: a long prefill no longer stalls the decode steps of the
//! streams running beside it (inter-token latency), at the price of fewer replicas to prefill
//! on and a transfer (time to first token).

use crate::des::{arriving, build_engines};
use crate::events::EventQueue;
use crate::policy::ReplicaSnapshot;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use scorer_core::disagg::{EndpointRole, PdConfig};
use scorer_core::hash::{model_seed, token_block_hashes};
use scorer_core::protocol::{Outcome, RouteRequest};
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use serde::Serialize;

use super::report::Latency;
use vllm_sim::{Engine, Profile, RequestEvent, SimError};

/// Model name the simulated fleet serves.
const MODEL: &str = "sim-model";
/// Approximate-mode hash block, in tokens (256 canonical bytes at 4 bytes a token).
const HASH_BLOCK_TOKENS: usize = 64;

/// Which requests a workload sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DisaggWorkload {
    /// Long prompts, short answers (RAG, summarisation).
    LongPrompt,
    /// Short prompts, long answers (chat, generation).
    ShortPrompt,
    /// Both at once: long prompts arrive while long answers stream.
    Mix,
}

impl DisaggWorkload {
    /// Every workload, in table order.
    pub const ALL: [DisaggWorkload; 3] = [Self::LongPrompt, Self::ShortPrompt, Self::Mix];

    /// Parses a CLI name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "long-prompt" => Some(Self::LongPrompt),
            "short-prompt" => Some(Self::ShortPrompt),
            "mix" => Some(Self::Mix),
            _ => None,
        }
    }

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Self::LongPrompt => "long-prompt",
            Self::ShortPrompt => "short-prompt",
            Self::Mix => "mix",
        }
    }

    /// Fraction of requests with a long prompt.
    fn long_fraction(self) -> f64 {
        match self {
            Self::LongPrompt => 1.0,
            Self::ShortPrompt => 0.0,
            Self::Mix => 0.3,
        }
    }
}

/// Settings of one benchmark (both modes use them).
#[derive(Debug, Clone, Serialize)]
pub struct DisaggScenario {
    /// Replicas in the fleet (colocated: all `both`; disaggregated: `prefill_replicas` of
    /// them prefill, the rest decode).
    pub replicas: usize,
    /// Prefill replicas in the disaggregated run.
    pub prefill_replicas: usize,
    /// Requests per workload.
    pub requests: usize,
    /// Mean arrivals per second (Poisson).
    pub rate: f64,
    /// Long prompts' length range, tokens.
    pub long_prompt: (u32, u32),
    /// Long prompts' answer length, tokens.
    pub long_output: u32,
    /// Short prompts' length range, tokens.
    pub short_prompt: (u32, u32),
    /// Short prompts' answer length range, tokens.
    pub short_output: (u32, u32),
    /// The router's disaggregation threshold (uncached tokens on the decode replica).
    pub threshold_tokens: u32,
    /// KV transfer bandwidth, GB/s.
    pub kv_gbps: f64,
    /// Seed of arrivals, prompts and routing.
    pub seed: u64,
    /// Scrape interval of the simulated router, ms.
    pub metrics_interval_ms: f64,
}

impl Default for DisaggScenario {
    fn default() -> Self {
        Self {
            replicas: 4,
            prefill_replicas: 1,
            requests: 400,
            rate: 2.0,
            long_prompt: (6_000, 8_000),
            long_output: 32,
            short_prompt: (200, 400),
            short_output: (256, 512),
            threshold_tokens: PdConfig::default().threshold_tokens,
            kv_gbps: 25.0,
            seed: 1,
            metrics_interval_ms: 100.0,
        }
    }
}

/// The figures of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DisaggRun {
    /// `colocated` or `disaggregated`.
    pub mode: String,
    /// Requests that finished.
    pub requests: usize,
    /// Requests the router disaggregated.
    pub disaggregated: usize,
    /// Time to first token, all requests (ms).
    pub ttft_ms: Latency,
    /// Time to first token of long-prompt requests (ms).
    pub ttft_long_ms: Latency,
    /// Time to first token of short-prompt requests (ms).
    pub ttft_short_ms: Latency,
    /// Inter-token latency of every streamed token after the first (ms): what running
    /// streams feel while prompts arrive.
    pub itl_ms: Latency,
    /// Inter-token latency of short-prompt (long-answer) streams only (ms).
    pub itl_short_ms: Latency,
    /// Each stream's longest gap between two tokens (ms), over streams: the stall a user
    /// watching a running answer sees when a long prompt lands on its replica.
    pub stall_ms: Latency,
    /// Simulated KV transfer time, mean over disaggregated requests (ms).
    pub kv_transfer_ms: f64,
    /// Output tokens over the makespan.
    pub output_tokens_per_s: f64,
    /// How far the router's learned latency model (scorer-core `latency`) was from the
    /// simulated outcome, for requests decided once their endpoint's model was warm.
    pub prediction: PredictionAccuracy,
}

/// Prediction error of the learned TTFT / TPOT model against the simulation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PredictionAccuracy {
    /// Requests scored (served whole by their decode endpoint, model warm at decision).
    pub requests: usize,
    /// Median |predicted − simulated| TTFT, ms.
    pub ttft_median_abs_ms: f64,
    /// Median |predicted − simulated| / simulated TTFT.
    pub ttft_median_abs_ratio: f64,
    /// Mean |predicted − simulated| / simulated TTFT.
    pub ttft_mean_abs_ratio: f64,
    /// Median |predicted − simulated| / simulated time per output token.
    pub tpot_median_abs_ratio: f64,
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Both modes of one workload.
#[derive(Debug, Clone, Serialize)]
pub struct DisaggComparison {
    /// The workload.
    pub workload: DisaggWorkload,
    /// Every replica prefills and decodes.
    pub colocated: DisaggRun,
    /// Prefill replicas prefill long prompts for decode replicas.
    pub disaggregated: DisaggRun,
    /// One sentence on whether disaggregation helped here and at what price.
    pub verdict: String,
}

#[derive(Debug, Clone)]
struct Spec {
    arrival_ms: f64,
    prompt: Vec<u32>,
    output: u32,
    /// The `max_tokens` the client sends (what the router sees).
    max_tokens: u32,
    long: bool,
}

fn generate(workload: DisaggWorkload, sc: &DisaggScenario) -> Vec<Spec> {
    let mut rng = SmallRng::seed_from_u64(sc.seed ^ workload as u64);
    let mut t = 0.0;
    let mut next_token = 1_000u32;
    (0..sc.requests)
        .map(|_| {
            // Exponential inter-arrival times.
            t += -(1.0 - rng.random::<f64>()).ln() / sc.rate.max(1e-6) * 1000.0;
            let long = rng.random::<f64>() < workload.long_fraction();
            let (lo, hi) = if long {
                sc.long_prompt
            } else {
                sc.short_prompt
            };
            let len = rng.random_range(lo..=hi.max(lo));
            // Distinct prompts: no prefix sharing, so every prompt is uncached.
            let prompt: Vec<u32> = (next_token..next_token + len).collect();
            next_token = next_token.wrapping_add(len);
            let output = if long {
                sc.long_output
            } else {
                rng.random_range(sc.short_output.0..=sc.short_output.1.max(sc.short_output.0))
            };
            Spec {
                arrival_ms: t,
                prompt,
                output: output.max(1),
                // A client asks for at most the top of its range.
                max_tokens: if long {
                    sc.long_output
                } else {
                    sc.short_output.1.max(sc.short_output.0)
                }
                .max(1),
                long,
            }
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Event {
    Arrival(usize),
    StepDone(usize),
    TransferDone(usize),
    Scrape,
}

#[derive(Debug, Clone, Default)]
struct Record {
    decision_id: u64,
    decode: usize,
    prefiller: Option<usize>,
    first_token_ms: Option<f64>,
    last_token_ms: Option<f64>,
    finish_ms: Option<f64>,
    output_tokens: u32,
    transfer_ms: f64,
    max_gap_ms: f64,
    /// (predicted TTFT, predicted TPOT) of the decode endpoint, when its model was warm.
    predicted: Option<(f64, f64)>,
}

struct Sim<'a> {
    specs: &'a [Spec],
    engines: Vec<Engine>,
    pending: Vec<Option<vllm_sim::StepOutput>>,
    queue: EventQueue<Event>,
    router: Router,
    addresses: Vec<String>,
    records: Vec<Record>,
    itl: Vec<f64>,
    itl_short: Vec<f64>,
    kv_bytes_per_token: f64,
    kv_bytes_per_s: f64,
    seed: u64,
}

impl Sim<'_> {
    fn push(&mut self, at_ms: f64, event: Event) {
        self.queue.push(at_ms, event);
    }

    fn start_step(&mut self, r: usize, now_ms: f64) {
        if self.pending[r].is_some() || !self.engines[r].has_work() {
            return;
        }
        let out = self.engines[r].step(now_ms / 1000.0);
        if out.num_scheduled == 0 && out.events.is_empty() {
            return;
        }
        let end = (out.end_s * 1000.0).max(now_ms);
        self.pending[r] = Some(out);
        self.push(end, Event::StepDone(r));
    }

    fn arrive(&mut self, i: usize, now: f64) -> Result<(), SimError> {
        let spec = &self.specs[i];
        let request = RouteRequest {
            model: MODEL.into(),
            block_hashes: token_block_hashes(model_seed(MODEL), &spec.prompt, HASH_BLOCK_TOKENS),
            prompt_bytes: spec.prompt.len() as u64 * 4,
            prompt_tokens: spec.prompt.len() as u32,
            // The client's cap, not the answer's length: no router knows that.
            max_output_tokens: Some(spec.max_tokens),
            ..RouteRequest::default()
        };
        self.seed = self.seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let d = self.router.route(&request, now as u64, self.seed);
        let index = |a: &str| self.addresses.iter().position(|x| x == a);
        let decode = d
            .response
            .endpoints
            .first()
            .and_then(|a| index(a))
            .unwrap_or(0);
        let prefiller = d.response.prefiller.as_deref().and_then(index);
        let warm = self.router.config().latency.min_samples;
        let predicted = d
            .candidates
            .first()
            .filter(|c| c.latency_samples >= warm)
            .map(|c| (c.predicted_ttft_ms, c.predicted_tpot_ms));
        self.records[i] = Record {
            decision_id: d.response.decision_id,
            decode,
            prefiller,
            predicted,
            ..Record::default()
        };
        let engine_request = arriving(
            i,
            spec.prompt.clone(),
            if prefiller.is_some() { 1 } else { spec.output },
            now,
        );
        let target = prefiller.unwrap_or(decode);
        self.engines[target].add_request(engine_request)?;
        self.start_step(target, now);
        Ok(())
    }

    fn on_step(&mut self, r: usize, now: f64) -> Result<(), SimError> {
        let Some(out) = self.pending[r].take() else {
            return Ok(());
        };
        for e in &out.events {
            match e {
                RequestEvent::FirstToken { request, .. } | RequestEvent::Token { request, .. } => {
                    let i = *request as usize;
                    let rec = &mut self.records[i];
                    if rec.prefiller == Some(r) {
                        continue; // the prefill's own token is not streamed
                    }
                    if let Some(last) = rec.last_token_ms {
                        rec.max_gap_ms = rec.max_gap_ms.max(now - last);
                        self.itl.push(now - last);
                        if !self.specs[i].long {
                            self.itl_short.push(now - last);
                        }
                    } else {
                        rec.first_token_ms = Some(now);
                    }
                    rec.last_token_ms = Some(now);
                    rec.output_tokens += 1;
                }
                RequestEvent::Preempted { .. } => {}
                RequestEvent::Finished { request, .. } => {
                    let i = *request as usize;
                    if self.records[i].prefiller == Some(r) {
                        let tokens = self.specs[i].prompt.len() as f64;
                        let transfer_ms =
                            tokens * self.kv_bytes_per_token / self.kv_bytes_per_s * 1000.0;
                        self.records[i].transfer_ms = transfer_ms;
                        self.push(now + transfer_ms, Event::TransferDone(i));
                    } else {
                        self.finish(i, r, now);
                    }
                }
            }
        }
        self.start_step(r, now);
        Ok(())
    }

    fn finish(&mut self, i: usize, r: usize, now: f64) {
        let rec = &mut self.records[i];
        rec.finish_ms = Some(now);
        let arrival = self.specs[i].arrival_ms;
        let ttfb = rec.first_token_ms.map(|t| (t - arrival).max(0.0) as u64);
        self.router.feedback(
            &Outcome {
                decision_id: rec.decision_id,
                endpoint: self.addresses[r].clone(),
                status: 200,
                ttfb_ms: ttfb,
                total_ms: (now - arrival).max(0.0) as u64,
                completion_tokens: Some(rec.output_tokens),
                prompt_tokens: Some(self.specs[i].prompt.len() as u32),
                ..Outcome::default()
            },
            now as u64,
        );
    }

    fn transfer_done(&mut self, i: usize, now: f64) -> Result<(), SimError> {
        let spec = &self.specs[i];
        let decode = self.records[i].decode;
        self.engines[decode].add_remote_prefilled(arriving(
            i,
            spec.prompt.clone(),
            spec.output,
            now,
        ))?;
        // The prefiller's copy is done; the decode copy streams from here.
        self.records[i].prefiller = None;
        self.start_step(decode, now);
        Ok(())
    }

    fn scrape(&mut self, now: f64) {
        for (a, e) in self.addresses.iter().zip(&self.engines) {
            let s = ReplicaSnapshot::of(&e.stats(), &e.config().profile);
            let m = EndpointMetrics {
                running: s.running,
                waiting: s.waiting,
                kv_usage: s.kv_usage,
                capacity_tokens: None,
                counters: Some(s.counters),
                ..Default::default()
            };
            self.router.update_metrics(a, m, now as u64);
        }
    }
}

/// Runs `workload` through the fleet, colocated (`prefill_replicas` = 0) or disaggregated.
pub fn run(
    workload: DisaggWorkload,
    sc: &DisaggScenario,
    prefill_replicas: usize,
) -> Result<DisaggRun, SimError> {
    if sc.replicas == 0 || prefill_replicas >= sc.replicas {
        return Err(SimError::Config(
            "need at least one decode replica besides the prefill replicas".into(),
        ));
    }
    let specs = generate(workload, sc);
    let profile = Profile::llama8b_h100();
    let engines = build_engines(&profile, sc.replicas, sc.seed, false)?;
    let config = RouterConfig {
        block_bytes: HASH_BLOCK_TOKENS * 4,
        bytes_per_token: 4.0,
        pd: PdConfig {
            threshold_tokens: sc.threshold_tokens,
        },
        ..RouterConfig::default()
    };
    let mut router = Router::new(config, 1);
    let addresses: Vec<String> = (0..sc.replicas).map(|i| format!("replica-{i}")).collect();
    for (i, a) in addresses.iter().enumerate() {
        router
            .upsert_endpoint(a)
            .map_err(|e| SimError::Config(e.to_string()))?;
        let role = if prefill_replicas == 0 {
            EndpointRole::Both
        } else if i < prefill_replicas {
            EndpointRole::Prefill
        } else {
            EndpointRole::Decode
        };
        router.set_role(a, role);
    }
    let n = specs.len();
    let mut sim = Sim {
        specs: &specs,
        engines,
        pending: vec![None; sc.replicas],
        queue: EventQueue::new(),
        router,
        addresses,
        records: vec![Record::default(); n],
        itl: Vec::new(),
        itl_short: Vec::new(),
        kv_bytes_per_token: profile.kv_bytes_per_token as f64,
        kv_bytes_per_s: (sc.kv_gbps * 1e9).max(1.0),
        seed: sc.seed,
    };
    for (i, spec) in specs.iter().enumerate() {
        sim.push(spec.arrival_ms, Event::Arrival(i));
    }
    sim.push(0.0, Event::Scrape);
    let mut unfinished = n;
    while let Some((now, event)) = sim.queue.pop() {
        match event {
            Event::Arrival(i) => sim.arrive(i, now)?,
            Event::StepDone(r) => sim.on_step(r, now)?,
            Event::TransferDone(i) => sim.transfer_done(i, now)?,
            Event::Scrape => {
                sim.scrape(now);
                unfinished = sim.records.iter().filter(|r| r.finish_ms.is_none()).count();
                if unfinished > 0 {
                    sim.push(now + sc.metrics_interval_ms, Event::Scrape);
                }
            }
        }
    }
    let _ = unfinished;
    Ok(summarise(&specs, &sim, prefill_replicas))
}

fn summarise(specs: &[Spec], sim: &Sim<'_>, prefill_replicas: usize) -> DisaggRun {
    let done: Vec<(usize, &Record)> = sim
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.finish_ms.is_some())
        .collect();
    let ttft = |filter: &dyn Fn(&Spec) -> bool| {
        let mut v: Vec<f64> = done
            .iter()
            .filter(|(i, _)| filter(&specs[*i]))
            .filter_map(|(i, r)| r.first_token_ms.map(|t| t - specs[*i].arrival_ms))
            .collect();
        Latency::of(&mut v)
    };
    let transfers: Vec<f64> = done
        .iter()
        .filter(|(_, r)| r.transfer_ms > 0.0)
        .map(|(_, r)| r.transfer_ms)
        .collect();
    let first = specs.first().map_or(0.0, |s| s.arrival_ms);
    let last = done
        .iter()
        .filter_map(|(_, r)| r.finish_ms)
        .fold(first, f64::max);
    let output: u64 = done.iter().map(|(_, r)| u64::from(r.output_tokens)).sum();
    // Only requests the decode endpoint served whole: its model does not see remote prefills.
    let scored: Vec<(f64, f64, f64, f64)> = done
        .iter()
        .filter(|(_, r)| r.transfer_ms == 0.0 && r.output_tokens >= 2)
        .filter_map(|(i, r)| {
            let (ttft_p, tpot_p) = r.predicted?;
            let first = r.first_token_ms?;
            let ttft = first - specs[*i].arrival_ms;
            let tpot = (r.finish_ms? - first) / f64::from(r.output_tokens - 1);
            Some((ttft_p, ttft.max(1e-3), tpot_p, tpot.max(1e-3)))
        })
        .collect();
    let prediction = PredictionAccuracy {
        requests: scored.len(),
        ttft_median_abs_ms: median(
            &mut scored.iter().map(|s| (s.0 - s.1).abs()).collect::<Vec<_>>(),
        ),
        ttft_median_abs_ratio: median(
            &mut scored
                .iter()
                .map(|s| (s.0 - s.1).abs() / s.1)
                .collect::<Vec<_>>(),
        ),
        ttft_mean_abs_ratio: scored.iter().map(|s| (s.0 - s.1).abs() / s.1).sum::<f64>()
            / scored.len().max(1) as f64,
        tpot_median_abs_ratio: median(
            &mut scored
                .iter()
                .map(|s| (s.2 - s.3).abs() / s.3)
                .collect::<Vec<_>>(),
        ),
    };
    DisaggRun {
        mode: if prefill_replicas == 0 {
            "colocated".into()
        } else {
            format!("disaggregated {prefill_replicas}P")
        },
        requests: done.len(),
        disaggregated: transfers.len(),
        ttft_ms: ttft(&|_| true),
        ttft_long_ms: ttft(&|s| s.long),
        ttft_short_ms: ttft(&|s| !s.long),
        itl_ms: Latency::of(&mut sim.itl.clone()),
        itl_short_ms: Latency::of(&mut sim.itl_short.clone()),
        stall_ms: Latency::of(
            &mut done
                .iter()
                .filter(|(_, r)| r.output_tokens >= 2)
                .map(|(_, r)| r.max_gap_ms)
                .collect::<Vec<_>>(),
        ),
        kv_transfer_ms: if transfers.is_empty() {
            0.0
        } else {
            transfers.iter().sum::<f64>() / transfers.len() as f64
        },
        output_tokens_per_s: output as f64 / ((last - first).max(1.0) / 1000.0),
        prediction,
    }
}

/// Runs `workload` colocated and disaggregated and says which is better for what.
pub fn compare(
    workload: DisaggWorkload,
    sc: &DisaggScenario,
) -> Result<DisaggComparison, SimError> {
    let colocated = run(workload, sc, 0)?;
    let disaggregated = run(workload, sc, sc.prefill_replicas)?;
    let verdict = verdict(&colocated, &disaggregated);
    Ok(DisaggComparison {
        workload,
        colocated,
        disaggregated,
        verdict,
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

fn verdict(c: &DisaggRun, d: &DisaggRun) -> String {
    if d.disaggregated == 0 {
        return format!(
            "no prompt crossed the threshold: disaggregation only took {} replica(s) away from \
             decoding (TTFT p99 {:.2}x, stall p99 {:.2}x of colocated)",
            d.mode
                .trim_start_matches("disaggregated ")
                .trim_end_matches('P'),
            ratio(d.ttft_ms.p99, c.ttft_ms.p99),
            ratio(d.stall_ms.p99, c.stall_ms.p99),
        );
    }
    let itl = ratio(c.stall_ms.p99, d.stall_ms.p99);
    let ttft = ratio(d.ttft_ms.p99, c.ttft_ms.p99);
    let helps = by_ratio(
        itl,
        |x| format!("helps running streams: stall p99 {x:.1}x lower"),
        |x| format!("hurts running streams: stall p99 {x:.1}x higher"),
        "leaves running streams' stalls about the same",
    );
    let cost = by_ratio(
        ttft,
        |x| format!("TTFT p99 {x:.1}x higher (fewer replicas prefill, plus the transfer)"),
        |x| format!("TTFT p99 {x:.1}x lower"),
        "TTFT p99 about the same",
    );
    format!("disaggregation {helps}; {cost}")
}

/// The printed table: one block per workload.
pub fn table(results: &[DisaggComparison]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<13} {:<17} {:>5} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8}\n",
        "workload",
        "mode",
        "disag",
        "TTFT p50",
        "TTFT p99",
        "long p99",
        "short p99",
        "ITL p50",
        "ITL p99",
        "stall p50",
        "stall p99",
        "xfer ms",
        "tok/s"
    ));
    for r in results {
        for run in [&r.colocated, &r.disaggregated] {
            out.push_str(&format!(
                "{:<13} {:<17} {:>5} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>8.1} {:>8.1} {:>9.0} {:>9.0} {:>8.1} {:>8.0}\n",
                r.workload.name(),
                run.mode,
                run.disaggregated,
                run.ttft_ms.p50,
                run.ttft_ms.p99,
                run.ttft_long_ms.p99,
                run.ttft_short_ms.p99,
                run.itl_ms.p50,
                run.itl_ms.p99,
                run.stall_ms.p50,
                run.stall_ms.p99,
                run.kv_transfer_ms,
                run.output_tokens_per_s,
            ));
        }
        out.push_str(&format!("  -> {}\n", r.verdict));
        for run in [&r.colocated, &r.disaggregated] {
            let p = &run.prediction;
            if p.requests > 0 {
                out.push_str(&format!(
                    "  learned latency model, {}: TTFT median |error| {:.1} ms ({:.1}%, mean {:.1}%), \
                     TPOT median |error| {:.1}% over {} requests\n",
                    run.mode,
                    p.ttft_median_abs_ms,
                    100.0 * p.ttft_median_abs_ratio,
                    100.0 * p.ttft_mean_abs_ratio,
                    100.0 * p.tpot_median_abs_ratio,
                    p.requests
                ));
            }
        }
    }
    out
}

/// `above(ratio)` when `ratio` is over 1.2, `below(1 / ratio)` under 0.8, else `same`: one
/// wording for "by how much" in either direction.
fn by_ratio(
    ratio: f64,
    above: impl FnOnce(f64) -> String,
    below: impl FnOnce(f64) -> String,
    same: &str,
) -> String {
    if ratio > 1.2 {
        above(ratio)
    } else if ratio < 0.8 {
        below(1.0 / ratio)
    } else {
        same.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> DisaggScenario {
        DisaggScenario {
            requests: 80,
            rate: 2.0,
            ..DisaggScenario::default()
        }
    }

    #[test]
    fn mix_disaggregates_long_prompts_and_smooths_running_streams() {
        let sc = small();
        let r = compare(DisaggWorkload::Mix, &sc).unwrap();
        assert_eq!(r.colocated.requests, 80);
        assert_eq!(r.disaggregated.requests, 80);
        assert_eq!(r.colocated.disaggregated, 0);
        assert!(r.disaggregated.disaggregated > 0, "{r:?}");
        assert!(r.disaggregated.kv_transfer_ms > 0.0);
        // Colocated streams stall behind 6-8k-token prefills; decode-only replicas do not.
        assert!(
            r.disaggregated.stall_ms.p99 < r.colocated.stall_ms.p99,
            "{}",
            table(std::slice::from_ref(&r))
        );
    }

    #[test]
    fn short_prompts_never_disaggregate_and_runs_are_deterministic() {
        let sc = small();
        let a = run(DisaggWorkload::ShortPrompt, &sc, 1).unwrap();
        let b = run(DisaggWorkload::ShortPrompt, &sc, 1).unwrap();
        assert_eq!(a.disaggregated, 0);
        assert_eq!(a, b);
        assert!(run(DisaggWorkload::Mix, &sc, 4).is_err());
    }
}
