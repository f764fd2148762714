//! kvroute's filter as an Envoy dynamic module (`libkvroute_envoy_module.so`).
//!
//! The proxy-wasm filter (`filter/`) is the portable build: Istio's `WasmPlugin`, Envoy
//! Gateway, any Envoy with V8. It pays for V8: each host call that returns data costs a trip
//! back into the VM to allocate, and every worker's VM keeps its own copy of the routing state
//! and applies every other worker's decisions. This crate runs the same sans-IO core
//! (`kvroute_filter::machine`, `kvroute_filter::root`) natively inside Envoy through its
//! dynamic-module ABI (Envoy >= 1.40; the module must be built for the Envoy it is loaded
//! into), with one routing copy per Envoy process shared by its workers.
//!
//! Configuration is the wasm filter's JSON, passed as the filter's `filter_config` string, and
//! the Envoy configuration around it (the control-plane cluster, the `override_host` load
//! balancer reading `x-gateway-destination-endpoint`) is the same: see
//! `envoy-config/envoy-dynamic-module.yaml`.
//!
//! Layout: [`abi`] declares the C ABI and wraps it in handles; `hooks` exports the
//! `envoy_dynamic_module_on_*` functions; [`module`] is the glue, in safe Rust.

pub mod abi;
mod hooks;
pub mod module;
