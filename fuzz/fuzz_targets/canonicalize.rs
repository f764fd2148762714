//! The filter's body parser: `scorer_core::canon::canonicalize` on arbitrary bytes, then block
//! hashing. Beyond "never panics", it checks the properties routing relies on: the result is
//! deterministic, hashes cover exactly the full blocks, and a chat, Messages or Responses body's
//! canonical bytes with its last message (input item) dropped are a byte prefix of the full
//! body's (turn N is a prefix of N+1).
//!
//! The check is `kvroute_fuzz_checks::canonicalize` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::canonicalize::check(data));
