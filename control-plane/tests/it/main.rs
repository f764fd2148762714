//! The control plane's integration tests, one binary (built and linked once): a module per area.

mod chat_template_golden;
mod kv_events_stream;
mod service;
