//! The filter's per-request state machine (`RequestMachine`) and root outcome queue
//! (`RootState`) fed arbitrary sequences of host callbacks: headers, body sizes, bodies,
//! trailers, route answers (well-formed, garbage, reset), response chunks and stream ends, in
//! any order and any number of times. The host glue executes whatever comes back, so besides
//! "never panics" every effect must make sense:
//! - only the routing headers are removed, only the destination header is set, once, with a
//!   plausible `ip:port` list, and only after a route call;
//! - at most one route call per request, whose body is a `RouteRequest` without the prompt;
//! - a resume only after a route call, at most once; routed and failed open never both;
//! - at most one outcome per request, only for routed requests;
//! - the outcome queue stays bounded and every feedback batch is a valid `FeedbackBatch`.
//!
//! The check is `kvroute_fuzz_checks::filter_machine` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::filter_machine::check(data));
