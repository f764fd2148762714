//! vllm-sim's integration tests, one binary (built and linked once): a module per area.

mod common;

mod agent_apis;
mod chat_template_golden;
mod data_parallel;
mod live;
mod vllm_compat;
