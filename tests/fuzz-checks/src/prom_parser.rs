//! The control plane's Prometheus text parser (`vllm_wire::prom`, a sans-IO crate: no tokio or
//! axum under ASan). Whatever a replica's `/metrics` returns, parsing
//! must end without a panic, in linear time, and an accepted page must yield sane numbers; the
//! scrape path (`scrape_vllm_metrics`) must read what the full parser reads, and one
//! data-parallel engine's view (`scrape_vllm_engine_metrics`) must end as cleanly, and so must
//! the restricted page a scrape asks for (`restrict_page`), which must read as the whole page.

use vllm_wire::prom;

/// The target's body: what one fuzz input must satisfy.
pub fn check(input: &[u8]) {
    if let Ok(m) = prom::parse_vllm_metrics_bytes(input) {
        assert!(m.kv_usage.is_finite(), "kv_usage {}", m.kv_usage);
        assert!((0.0..=1.0).contains(&m.kv_usage), "kv_usage {}", m.kv_usage);
    }
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    // The scrape path parses only the lines it reads: a page the full parser accepts gives the
    // same metrics there, and any page ends cleanly.
    let scraped = prom::scrape_vllm_metrics(text);
    if let Ok(m) = prom::parse_vllm_metrics(text) {
        assert_eq!(scraped, Ok(m));
    }
    if let Ok(m) = scraped {
        assert!((0.0..=1.0).contains(&m.kv_usage), "kv_usage {}", m.kv_usage);
    }
    // The page a scrape asks for (`/metrics/?name[]=`, as vllm-sim and prometheus_client
    // restrict it) reads as the whole page did; a query string of any bytes decodes cleanly.
    if let Ok(m) = prom::parse_vllm_metrics(text) {
        let restricted = prom::restrict_page(text, &prom::SCRAPED_SERIES);
        assert_eq!(prom::parse_vllm_metrics(&restricted), Ok(m));
    }
    let _ = prom::requested_names(text);
    // One data-parallel engine's view of the page ends cleanly and is sane too.
    for engine in 0..3 {
        if let Ok(m) = prom::scrape_vllm_engine_metrics(text, engine) {
            assert!((0.0..=1.0).contains(&m.kv_usage), "kv_usage {}", m.kv_usage);
        }
    }
    for sample in prom::samples(text).take(10_000) {
        let Ok(sample) = sample else {
            continue;
        };
        let _ = sample.labels(|_, _| {});
        let _ = sample.label("engine");
    }
}
