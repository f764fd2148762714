//! The plugin configuration parser (`FilterConfig::from_json`): Envoy hands it whatever an
//! operator wrote. Accepted configurations must be self-consistent, and every route rule's path
//! (with or without a query string) must find a rule of that path (the first, if it is listed
//! twice) with its API; a load-only rule has none.

use kvroute_filter::config::FilterConfig;

/// The target's body: what one fuzz input must satisfy.
pub fn check(input: &[u8]) {
    let Ok(config) = FilterConfig::from_json(input) else {
        return;
    };
    assert!(config.validate().is_ok());
    assert!(config.route_timeout_ms > 0 && config.block_bytes > 0 && config.max_body_bytes > 0);
    for rule in &config.routes {
        let first = config.routes.iter().find(|r| r.path == rule.path);
        for path in [rule.path.clone(), format!("{}?q=1", rule.path)] {
            assert_eq!(config.route_for_path(&path), first);
            assert_eq!(config.api_for_path(&path), first.and_then(|r| r.api));
        }
    }
}
