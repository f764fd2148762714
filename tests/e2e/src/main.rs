//! kvroute's end-to-end tests, in one binary built once.
//!
//! Each module is one area. Most start a real topology on 127.0.0.1 through
//! [`kvroute_harness`]: Envoy 1.40 loading the release `kvroute_filter.wasm`, the control plane
//! and `vllm-sim` replicas. The binaries they run are built by `make test-artifacts` before the
//! tests start (`make test` does both); a missing one fails the tests with the reason.
//!
//! Run one area with `cargo test -p kvroute-e2e -- precise::`.

mod common;

mod agent_apis;
mod bad_input;
mod calibration;
mod data_parallel;
mod demo;
mod disagg;
mod envoy;
mod envoy_validate;
mod explain;
mod fairness;
mod faults;
mod fleet_page;
mod hostile;
mod hostile_envoy;
mod kv_events_faults;
mod local_decisions;
mod manifests;
mod offload;
mod picker;
mod pools;
mod precise;
mod predicted_latency;
mod replication;
mod scaling;
mod self_check;
mod slo;
mod token_ratio;
mod wasm_filter;
