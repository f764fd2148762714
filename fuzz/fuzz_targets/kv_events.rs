//! The KV-event decoder the control plane and vllm-sim share (`vllm_wire::kv_events`, a sans-IO
//! crate: no tokio or zeromq under ASan) on arbitrary ZMQ frames, and on well-formed
//! vLLM `KVEventBatch`es (map and tagged-array encodings) built from arbitrary values, whose
//! events are then applied to a precise-mode `Router`. A publisher can send anything: decoding
//! and applying must end in a value or an error, never a panic, a batch we encoded must
//! decode to the same number of events, and the encoder must round-trip what the decoder read.
//!
//! The check is `kvroute_fuzz_checks::kv_events` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::kv_events::check(data));
