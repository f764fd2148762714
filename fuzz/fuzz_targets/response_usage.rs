//! What this target feeds and checks: `kvroute_fuzz_checks::response_usage` (tests/fuzz-checks).
//! `cargo test` runs the target's seed corpus through the same check.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::response_usage::check(data));
