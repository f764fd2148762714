//! vllm-wire's integration tests against the real implementations' fixtures, one binary (built and linked once).

mod kv_events_decode;
mod vllm_compat;
