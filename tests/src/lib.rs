//! kvroute test support: simulator, harness, workloads.
pub mod analyze;
pub mod bench;
pub mod fleet;
pub mod harness;
pub mod loadgen;
pub mod precise_compare;
pub mod sim;
pub mod wasm_host;
