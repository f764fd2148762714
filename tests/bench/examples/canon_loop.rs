//! Canonicalises the bench's chat bodies in a loop, for profilers (`perf record`,
//! `valgrind --tool=callgrind`): the hand reader of plain bodies and serde's reading side by
//! side in one binary, so the two compare on the same bodies.
//!
//! `cargo run --release -p kvroute-bench --example canon_loop -- [bodies] [prompt_bytes]
//! [hand|serde]`. Prints µs a body. Under callgrind, the instructions a body are the difference
//! of two runs' totals over the difference of their `bodies` (setup cancels out).

use std::hint::black_box;
use std::time::Instant;

use scorer_core::canon::{canonicalize, canonicalize_with_serde};
use scorer_core::protocol::ApiKind;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let bodies: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(100_000);
    let prompt_bytes: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1_024);
    let read = match args.next().as_deref() {
        None | Some("hand") => canonicalize,
        Some("serde") => canonicalize_with_serde,
        Some(other) => anyhow::bail!("reader {other:?}: hand or serde"),
    };
    let texts: Vec<String> = (0..64)
        .map(|s| kvroute_bench::chat_body(prompt_bytes, s, 16, false))
        .collect();
    let started = Instant::now();
    let mut canonical_bytes = 0usize;
    for i in 0..bodies {
        let prompt = read(ApiKind::Chat, black_box(texts[i % texts.len()].as_bytes()))?;
        canonical_bytes += prompt.bytes.len();
    }
    let elapsed = started.elapsed();
    println!(
        "{bodies} bodies of {prompt_bytes} B ({canonical_bytes} canonical bytes): {:.2} µs a body",
        elapsed.as_secs_f64() * 1e6 / bodies.max(1) as f64
    );
    Ok(())
}
