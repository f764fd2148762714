//! What the unit tests of several modules build the same way: a state over a few endpoints
//! and the checks of a `/metrics` text.

use std::sync::Arc;

use scorer_core::router::RouterConfig;

use crate::state::State;

/// A state routing to `endpoints` with the default router configuration (4 history samples).
pub(crate) fn state_of(endpoints: &[&str]) -> Arc<State> {
    let endpoints: Vec<String> = endpoints.iter().map(|e| (*e).to_string()).collect();
    Arc::new(State::new(RouterConfig::default(), &endpoints, 4, 1).unwrap())
}

/// Asserts that the exposition `text` holds every needle and that our own parser reads it.
pub(crate) fn assert_exposes(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(crate::prom::samples(text).all(|s| s.is_ok()));
}
