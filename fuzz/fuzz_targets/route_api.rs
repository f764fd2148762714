//! The route API: JSON bodies of `POST /v1/route` and `POST /v1/feedback` (raw bytes, or
//! well-formed documents with arbitrary values) deserialised into `scorer_core::protocol` types
//! and applied to a `Router`, interleaved with metrics updates, unreachable endpoints,
//! endpoint churn and expiry. Invariants: every answer names only known endpoints, without
//! duplicates, at most `1 + fallbacks` of them; decision ids increase; every candidate cost is
//! a number (never NaN); the in-flight table never holds more than the decisions made.
//!
//! The check is `kvroute_fuzz_checks::route_api` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::route_api::check(data));
