//! kvroute test support: simulator, harness, workloads.
pub mod harness;
pub mod loadgen;
pub mod fleet;
pub mod sim;
