//! The response scanners (`UsageScanner`, `ResponseIdScanner`) over a body cut into chunks
//! anywhere: the first byte says how many cuts, the next that many bytes where (as fractions
//! of the body), the rest is the body. Besides "never panics": below the scanners' carry
//! limits, the chunked body reads exactly as the whole one (what they keep between chunks is
//! bounded by their own unit tests, which see it). And the hand reader of a `usage` object
//! answers what serde does for the same bytes (the input read as one object).

use kvroute_filter::response_id::ResponseIdScanner;
use kvroute_filter::usage::{UsageScanner, read_usage, read_usage_with_serde};

/// At most this many cuts (a stream's events are many small chunks).
const MAX_CUTS: usize = 16;
/// Bodies up to this size read the same chunked as whole: a value cut across chunks is kept
/// up to the usage scanner's 8 KiB carry (and the id scanner's first 64 KiB).
const EXACT_UP_TO: usize = 8 * 1024;

/// See the module documentation.
pub fn check(data: &[u8]) {
    assert_eq!(
        read_usage(data),
        read_usage_with_serde(data),
        "usage object"
    );
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n) % (MAX_CUTS + 1);
    if rest.len() < n {
        return;
    }
    let (cuts, body) = rest.split_at(n);
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&c| usize::from(c) * body.len() / 255)
        .collect();
    at.sort_unstable();
    let mut usage = UsageScanner::default();
    let mut id = ResponseIdScanner::default();
    let mut from = 0;
    for to in at.into_iter().chain([body.len()]) {
        usage.feed(&body[from..to]);
        id.feed(&body[from..to]);
        from = to;
    }
    if body.len() <= EXACT_UP_TO {
        let mut whole_usage = UsageScanner::default();
        whole_usage.feed(body);
        assert_eq!(usage.usage(), whole_usage.usage(), "usage differs chunked");
        let mut whole_id = ResponseIdScanner::default();
        whole_id.feed(body);
        assert_eq!(id.id(), whole_id.id(), "response id differs chunked");
    }
}
