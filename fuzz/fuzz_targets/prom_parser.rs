//! The control plane's Prometheus text parser (`vllm_wire::prom`, a sans-IO crate: no tokio or
//! axum under ASan). Whatever a replica's `/metrics` returns, parsing
//! must end without a panic, in linear time, and an accepted page must yield sane numbers; the
//! scrape path (`scrape_vllm_metrics`) must read what the full parser reads, and one
//! data-parallel engine's view (`scrape_vllm_engine_metrics`) must end as cleanly, and so must
//! the restricted page a scrape asks for (`restrict_page`), which must read as the whole page.
//!
//! The check is `kvroute_fuzz_checks::prom_parser` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::prom_parser::check(data));
