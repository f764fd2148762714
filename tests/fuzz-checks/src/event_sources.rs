//! A server's `GET /kv_event_sources` answer (`vllm_wire::kv_events::parse_event_sources`), as
//! `kv_events: auto` reads it, and the endpoint a subscriber connects to for each publisher:
//! whatever a replica returns, parsing ends cleanly and every endpoint it yields keeps its port.

use vllm_wire::kv_events::{connect_endpoint, parse_event_sources};

/// The target's body: what one fuzz input must satisfy.
pub fn check(input: &[u8]) {
    let Ok(sources) = parse_event_sources(input) else {
        return;
    };
    for publisher in sources.values() {
        let connect = connect_endpoint(&publisher.endpoint, "10.0.0.5");
        if let Some((_, port)) = publisher.endpoint.rsplit_once(':') {
            assert!(
                connect.ends_with(port),
                "{connect} lost the port of {}",
                publisher.endpoint
            );
        }
    }
}
