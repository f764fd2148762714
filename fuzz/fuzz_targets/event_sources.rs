//! A server's `GET /kv_event_sources` answer (`vllm_wire::kv_events::parse_event_sources`), as
//! `kv_events: auto` reads it, and the endpoint a subscriber connects to for each publisher:
//! whatever a replica returns, parsing ends cleanly and every endpoint it yields keeps its port.
//!
//! The check is `kvroute_fuzz_checks::event_sources` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::event_sources::check(data));
