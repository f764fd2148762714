//! The plugin configuration parser (`FilterConfig::from_json`): Envoy hands it whatever an
//! operator wrote. Accepted configurations must be self-consistent and survive a round trip
//! through `api_for_path`.
#![no_main]

use kvroute_filter::config::FilterConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Ok(config) = FilterConfig::from_json(input) else {
        return;
    };
    assert!(config.validate().is_ok());
    assert!(config.route_timeout_ms > 0 && config.block_bytes > 0 && config.max_body_bytes > 0);
    for rule in &config.routes {
        assert!(config.api_for_path(&rule.path).is_some());
        assert!(config.api_for_path(&format!("{}?q=1", rule.path)).is_some());
    }
});
