//! Finds the id of a Responses API answer in its body as it streams past.
//!
//! vLLM's `ResponsesResponse` starts with its `id` (`resp_...`); a stream's first event,
//! `response.created`, carries the same object. The scanner takes the first `"id"` whose value
//! starts with `resp_` within the first [`MAX_SCANNED_BYTES`] and then stops looking, so it
//! costs nothing on the rest of a long stream.

use crate::usage::{KeyScanner, Parse, value_start};

/// Where the id must appear (it is the first field of the first object).
pub const MAX_SCANNED_BYTES: usize = 64 * 1024;
/// Longest id kept (vLLM's are 37 bytes).
const MAX_ID_BYTES: usize = 128;
const PREFIX: &[u8] = b"resp_";
/// The key, with its quotes.
const KEY: &[u8] = b"\"id\"";
/// The key's finder, built once.
static ID_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(KEY));

/// Streaming scanner; feed it every response body chunk in order.
#[derive(Debug)]
pub struct ResponseIdScanner {
    keys: KeyScanner,
    scanned: usize,
    id: Option<String>,
}

impl Default for ResponseIdScanner {
    fn default() -> Self {
        ResponseIdScanner {
            keys: KeyScanner::new(&ID_KEY),
            scanned: 0,
            id: None,
        }
    }
}

impl ResponseIdScanner {
    /// The response id, once seen.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// Scans one more chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.id.is_some() || self.scanned >= MAX_SCANNED_BYTES {
            return;
        }
        let room = MAX_SCANNED_BYTES - self.scanned;
        let chunk = &chunk[..chunk.len().min(room)];
        self.scanned += chunk.len();
        let id = &mut self.id;
        self.keys.feed(chunk, MAX_CARRY_BYTES, parse_id, |found| {
            *id = Some(found);
            false
        });
    }
}

/// Bytes of the scanner's carry (a key cut by a chunk boundary is kept with what follows it).
const MAX_CARRY_BYTES: usize = MAX_ID_BYTES + 16;
/// Bytes after the `"id"` key within which [`parse_id`] decides: the key and these fit in the
/// carry, so a key a chunk boundary cuts is never dropped and a chunked body reads exactly as
/// the whole one. (Deciding on more, as it once did, let the whole body see a long value's
/// closing quote that the chunked one had given up on: the `response_usage` fuzz target.)
const WINDOW: usize = MAX_CARRY_BYTES - KEY.len();

/// Parses `: "resp_..."` after an `"id"` key; other ids (a message's `msg_...`) complete
/// without one. Decides on the first [`WINDOW`] bytes alone: what does not complete within
/// them is no response id.
fn parse_id(rest: &[u8]) -> Parse<String> {
    let full = rest.len() >= WINDOW;
    let window = &rest[..rest.len().min(WINDOW)];
    let i = match value_start(window) {
        Ok(i) => i,
        Err(Parse::Incomplete) if full => {
            return Parse::Complete {
                found: None,
                consumed: window.len(),
            };
        }
        Err(parse) => return parse,
    };
    if window[i] != b'"' {
        return Parse::Complete {
            found: None,
            consumed: i,
        };
    }
    let value = &window[i + 1..];
    let Some(len) = value.iter().position(|&b| b == b'"') else {
        return if full || value.len() > MAX_ID_BYTES {
            Parse::Complete {
                found: None,
                consumed: i,
            }
        } else {
            Parse::Incomplete
        };
    };
    let id = &value[..len];
    let ok = id.starts_with(PREFIX)
        && id.len() <= MAX_ID_BYTES
        && id
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    Parse::Complete {
        found: ok.then(|| String::from_utf8_lossy(id).into_owned()),
        consumed: i + 1 + len + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> Option<String> {
        let mut s = ResponseIdScanner::default();
        for c in chunks {
            s.feed(c);
        }
        s.id().map(str::to_string)
    }

    const JSON: &[u8] =
        br#"{"id":"resp_0a1b","object":"response","output":[{"id":"msg_2","type":"message"}]}"#;
    const SSE: &[u8] = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\" : \"resp_9f\",\"status\":\"in_progress\"}}\n\n";

    #[test]
    fn json_and_sse_whole_and_byte_by_byte() {
        for (body, want) in [(JSON, "resp_0a1b"), (SSE, "resp_9f")] {
            assert_eq!(scan(&[body]).as_deref(), Some(want));
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            assert_eq!(scan(&bytes).as_deref(), Some(want));
        }
    }

    #[test]
    fn other_ids_escaped_keys_and_garbage_are_not_response_ids() {
        assert_eq!(scan(&[br#"{"id":"msg_1","x":{"id":5}}"#]), None);
        assert_eq!(
            scan(&[br#"{"text":"\"id\":\"resp_fake\"","id":"resp_real"}"#]).as_deref(),
            Some("resp_real")
        );
        assert_eq!(scan(&[br#"{"id":"resp_a\"b"}"#]), None);
        assert_eq!(scan(&[b"\xff\xfe{\"id\":"]), None);
        let long = format!(r#"{{"id":"resp_{}"}}"#, "a".repeat(200));
        assert_eq!(scan(&[long.as_bytes()]), None);
    }

    // Found by the `response_usage` fuzz target: an `"id"` whose string runs past the window
    // and closes only at the next object's first quote. The whole body once saw that quote
    // and skipped the next object's key; the chunked one had given up on the value and found
    // the key. Both now give up within the window and find it.
    #[test]
    fn a_value_longer_than_the_window_reads_alike_whole_and_chunked() {
        let mut body = br#"{"id":"chatcmp"#.to_vec();
        body.extend_from_slice(&[0x0f; 150]);
        body.extend_from_slice(br#"{"id":"resp_a","x":1}"#);
        let whole = scan(&[&body]);
        assert_eq!(whole.as_deref(), Some("resp_a"));
        for cut in 1..body.len() {
            assert_eq!(scan(&[&body[..cut], &body[cut..]]), whole, "cut at {cut}");
        }
        // Whitespace past the window: no id there, whole or chunked.
        let spaced = format!(r#"{{"id"{}:"resp_b"}}"#, " ".repeat(WINDOW));
        let spaced = spaced.as_bytes();
        assert_eq!(scan(&[spaced]), None);
        for cut in 1..spaced.len() {
            assert_eq!(
                scan(&[&spaced[..cut], &spaced[cut..]]),
                None,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn stops_after_the_first_id_and_the_scan_window() {
        let mut s = ResponseIdScanner::default();
        s.feed(br#"{"id":"resp_1"}"#);
        s.feed(br#"{"id":"resp_2"}"#);
        assert_eq!(s.id(), Some("resp_1"));
        let mut late = ResponseIdScanner::default();
        late.feed(&vec![b' '; MAX_SCANNED_BYTES]);
        late.feed(br#"{"id":"resp_3"}"#);
        assert_eq!(late.id(), None);
    }
}
