//! The plugin configuration parser (`FilterConfig::from_json`): Envoy hands it whatever an
//! operator wrote. Accepted configurations must be self-consistent, and every route rule's path
//! (with or without a query string) must find a rule of that path (the first, if it is listed
//! twice) with its API; a load-only rule has none.
//!
//! The check is `kvroute_fuzz_checks::filter_config` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::filter_config::check(data));
