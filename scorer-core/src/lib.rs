//! kvroute's routing core: pure logic, no I/O, for wasm32 and native alike.
//!
//! - [`canon`] turns an OpenAI request body into canonical prompt bytes;
//! - [`hash`] hashes them in chained blocks;
//! - [`index`] remembers which endpoint holds which blocks;
//! - [`router`] scores endpoints and keeps load accounting ([`address`]: its shared addresses);
//! - [`token_ratio`] turns approximate mode's byte blocks into tokens (configured or learned);
//! - [`calibration`] learns each endpoint's prefill rate and decode step time from its counters;
//! - [`latency`] learns each endpoint's TTFT and time per output token from outcomes;
//! - [`disagg`] gives endpoints prefill/decode roles and picks a prefill endpoint;
//! - [`pools`], [`affinity`] and [`lora`] keep model pools, session affinity and LoRA
//!   adapter state for the router;
//! - [`fairness`] admits or sheds requests by criticality, tenant limits and fair share;
//! - [`self_check`] compares the hits the index believed in with those the engines delivered,
//!   and names each endpoint's state (exact, degraded, load-only);
//! - [`reuse`] counts the fleet numbers: reuse the traffic offers, the router aims for, the
//!   engines deliver, and the gap by reason;
//! - [`protocol`] is the JSON the filter and the control plane exchange;
//! - [`sync`] replicates the routing state: the control plane's log of decisions and outcomes,
//!   and a proxy's local copy that decides without a call;
//! - [`quotes`] skips double-quoted strings in byte scans (the filter's and `/metrics`' parsers).
//!
//! Invariant: nothing here reads a clock, draws ambient randomness, spawns a thread or does
//! I/O. Time (`now_ms`) and seeds are arguments, so fleet-sim can replay it in virtual time.

pub mod address;
pub mod affinity;
pub mod calibration;
pub mod canon;
pub mod disagg;
pub mod fairness;
pub mod hash;
pub mod index;
pub mod latency;
pub mod lora;
pub mod plain_json;
pub mod pools;
pub mod precise;
pub mod protocol;
pub mod quotes;
pub mod reuse;
pub mod router;
pub mod self_check;
pub mod sync;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
pub mod token_ratio;
