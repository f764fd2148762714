//! A replica's `GET /v1/models` answer (`vllm_wire::models`), whatever it returns: parsing ends
//! without a panic, and an accepted list yields usable cards (no empty parent, no context of 0),
//! which the router's catalogue then answers context questions about without a panic.
//!
//! The check is `kvroute_fuzz_checks::models_list` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::models_list::check(data));
