//! Scanning text for a delimiter that may also stand inside double-quoted strings with
//! backslash escapes: JSON strings in the filter's usage scanner, Prometheus label values in
//! the `/metrics` parser. One state machine, so both skip quoted text the same way.

/// Where a byte-by-byte scan is relative to double-quoted strings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuoteState {
    in_quotes: bool,
    escaped: bool,
}

impl QuoteState {
    /// Feeds the next byte; true when it stands outside every quoted string (the quotes
    /// themselves and everything between them, escapes included, count as inside).
    pub fn outside(&mut self, b: u8) -> bool {
        if self.in_quotes {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.in_quotes = false,
                _ => {}
            }
            false
        } else if b == b'"' {
            self.in_quotes = true;
            false
        } else {
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_bytes_and_escaped_quotes_are_inside() {
        let mut q = QuoteState::default();
        let outside: String =
            br#"a"b\"}"c}"#.iter().filter(|&&b| q.outside(b)).map(|&b| char::from(b)).collect();
        assert_eq!(outside, "ac}");
    }
}
