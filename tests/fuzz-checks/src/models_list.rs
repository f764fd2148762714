//! A replica's `GET /v1/models` answer (`vllm_wire::models`), whatever it returns: parsing ends
//! without a panic, and an accepted list yields usable cards (no empty parent, no context of 0),
//! which the router's catalogue then answers context questions about without a panic.

use scorer_core::index::EndpointId;
use scorer_core::pools::ModelCatalog;
use vllm_wire::models::parse_models;

/// The target's body: what one fuzz input must satisfy.
pub fn check(input: &[u8]) {
    let Ok(models) = parse_models(input) else {
        return;
    };
    for m in &models {
        assert_ne!(
            m.parent.as_deref(),
            Some(""),
            "an empty parent is no parent"
        );
        assert_ne!(m.max_model_len, Some(0), "a context of 0 is no context");
    }
    let ids: Vec<String> = models.iter().map(|m| m.id.clone()).collect();
    let mut catalog = ModelCatalog::default();
    catalog.set(EndpointId(0), models);
    for id in ids.iter().map(String::as_str).chain(["", "absent"]) {
        // An adapter naming itself or another adapter as parent must not loop.
        let _ = catalog.context_limit(EndpointId(0), id);
    }
}
