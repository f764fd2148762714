//! How many canonical prompt bytes a token takes: what turns approximate mode's byte blocks into
//! tokens.
//!
//! The filter hashes text, but KV capacity and prefill time are counted in tokens. A fixed
//! `router.bytes_per_token` is right only for the traffic it was measured on: English prose is
//! about 4, code less, Cyrillic in UTF-8 more. When learning is on, every outcome that reports
//! `usage.prompt_tokens` teaches the ratio from the request's canonical bytes; the configured
//! value is only the starting point.

/// Weight an observation keeps after each newer one: the ratio follows about the last 50
/// requests, so a shift in the traffic's language moves it within a minute of traffic.
const DECAY: f64 = 0.98;

/// A sample outside these bounds is a request the text does not describe (images counted as
/// prompt tokens, an empty canonical prompt) and is ignored.
const MIN_SAMPLE: f64 = 0.5;
const MAX_SAMPLE: f64 = 64.0;

/// The bytes-per-token ratio in force: configured, or learned from outcomes.
#[derive(Debug, Clone)]
pub struct TokenRatio {
    configured: f64,
    learn: bool,
    /// Decayed sums of the observed requests' canonical bytes and prompt tokens.
    bytes: f64,
    tokens: f64,
    /// Requests observed (saturating).
    samples: u32,
}

impl TokenRatio {
    /// A ratio that starts at `configured` and, when `learn`, follows observed requests.
    pub fn new(configured: f64, learn: bool) -> Self {
        Self {
            configured,
            learn,
            bytes: 0.0,
            tokens: 0.0,
            samples: 0,
        }
    }

    /// Canonical bytes per token to use now.
    pub fn bytes_per_token(&self) -> f64 {
        self.observed().unwrap_or(self.configured)
    }

    /// The ratio the observed requests show, `None` before any (or with learning off).
    pub fn observed(&self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.bytes / self.tokens)
    }

    /// Requests observed so far (saturating).
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// Records that a request of `prompt_bytes` canonical bytes counted `prompt_tokens` tokens
    /// at the engine. Weighted by tokens, so long prompts, which dominate KV, dominate the ratio.
    pub fn observe(&mut self, prompt_bytes: u64, prompt_tokens: u32) {
        if !self.learn || prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let sample = prompt_bytes as f64 / f64::from(prompt_tokens);
        if !(MIN_SAMPLE..=MAX_SAMPLE).contains(&sample) {
            return;
        }
        self.bytes = self.bytes * DECAY + prompt_bytes as f64;
        self.tokens = self.tokens * DECAY + f64::from(prompt_tokens);
        self.samples = self.samples.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_it_keeps_the_configured_ratio() {
        let mut r = TokenRatio::new(4.0, false);
        r.observe(6_500, 1_000);
        assert_eq!(r.bytes_per_token(), 4.0);
    }

    #[test]
    fn on_it_follows_the_traffic_and_moves_when_the_traffic_does() {
        let mut r = TokenRatio::new(4.0, true);
        assert_eq!(r.bytes_per_token(), 4.0);
        r.observe(6_500, 1_000);
        assert!((r.bytes_per_token() - 6.5).abs() < 1e-9);
        for _ in 0..300 {
            r.observe(3_000, 1_000);
        }
        assert!(
            (r.bytes_per_token() - 3.0).abs() < 0.01,
            "{}",
            r.bytes_per_token()
        );
    }

    #[test]
    fn samples_the_text_cannot_explain_are_ignored() {
        let mut r = TokenRatio::new(4.0, true);
        // An image-heavy prompt: 20 bytes of text, 1,500 tokens.
        r.observe(20, 1_500);
        r.observe(0, 10);
        r.observe(10, 0);
        assert_eq!(r.bytes_per_token(), 4.0);
    }
}
