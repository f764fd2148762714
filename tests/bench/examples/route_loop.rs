//! Drives `Router::route` + `Router::feedback` in a loop over a filled index, for profilers
//! (`perf record`, `valgrind --tool=callgrind`): 64 endpoints, ~1M indexed blocks, 16 KB prompts
//! of 64 blocks, half of them sharing a prefix with an indexed chain. Prints decisions/s.
//!
//! The loop is [`kvroute_bench::router_inprocess`], the one `kvroute-bench` reports, so the
//! profiled mix and the benchmarked one cannot drift apart.
//!
//! `cargo run --release -p kvroute-bench --example route_loop -- [decisions] [blocks] [endpoints]
//! [recorded]`: with `recorded`, then the same loop recording another router's decisions
//! (`kvroute_bench::router_recorded`) on a second router filled alike.

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let decisions = args.next().and_then(Result::ok).unwrap_or(200_000);
    let blocks = args.next().and_then(Result::ok).unwrap_or(1_000_000);
    let endpoints = args.next().and_then(Result::ok).unwrap_or(64);
    let run = kvroute_bench::router_inprocess(endpoints, blocks, decisions);
    println!(
        "{decisions} decisions over {} blocks, {endpoints} endpoints: {:.0} decisions/s ({:.2} us each)",
        run.blocks,
        run.decisions_per_s,
        1e6 / run.decisions_per_s
    );
    if std::env::args().nth(4).as_deref() == Some("recorded") {
        let run = kvroute_bench::router_recorded(endpoints, blocks, decisions);
        println!(
            "{decisions} recorded decisions over {} blocks, {endpoints} endpoints: {:.0}/s ({:.2} us each)",
            run.blocks,
            run.decisions_per_s,
            1e6 / run.decisions_per_s
        );
    }
}
