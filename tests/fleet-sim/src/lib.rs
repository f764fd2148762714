//! fleet-sim: a deterministic discrete-event simulation of a vLLM fleet behind a routing policy.
//!
//! - [`workload`] reads Mooncake traces and generates synthetic workloads;
//! - [`policy`] holds the routing policies compared (peers and kvroute's own `Router`);
//! - [`data_parallel`] groups replicas into data-parallel servers for rank-blind routers;
//! - [`des`] replays a workload through the engines of [`vllm_sim`] in virtual time;
//! - [`fairness`] runs the two-tenant fairness benchmark (admission in front of the router);
//! - [`disagg`] runs the prefill/decode disaggregation benchmark (colocated vs disaggregated);
//! - [`oracle`] is the routing limit (exact engine state, greedy per request);
//! - [`matrix`] runs workloads x profiles x loads x seeds x policies with intervals;
//! - [`report`] turns runs into tables, JSON and SVG.

pub mod data_parallel;
pub mod des;
pub mod disagg;
pub mod events;
pub mod fairness;
pub mod matrix;
pub mod oracle;
pub mod policy;
pub mod report;
pub mod workload;
