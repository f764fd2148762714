//! Finds the token `usage` object in a response body that arrives in chunks.
//!
//! vLLM reports usage once: at the end of a JSON body, or in the last SSE event of a stream
//! (with `stream_options.include_usage`). The scanner looks for the last complete
//! `"usage":{...}` object and keeps only a small tail between chunks, so memory stays bounded
//! whatever the response size.

use serde::Deserialize;

/// Longest partial `"usage":{...}` object kept between chunks; larger ones are skipped.
const MAX_CARRY_BYTES: usize = 8 * 1024;
const KEY: &[u8] = b"\"usage\"";

/// Token counts from a response's `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u32>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`: the prefix cache hit the server reports.
    pub cached_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<RawDetails>,
}

#[derive(Deserialize)]
struct RawDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// Streaming scanner; feed it every response body chunk in order.
#[derive(Debug, Default)]
pub struct UsageScanner {
    carry: Vec<u8>,
    latest: Option<Usage>,
}

enum Parse {
    /// A complete value was seen after the key; `consumed` bytes follow the key.
    Complete {
        usage: Option<Usage>,
        consumed: usize,
    },
    /// The value continues in a later chunk.
    Incomplete,
}

impl UsageScanner {
    /// The last complete usage object seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.latest
    }

    /// Scans one more chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if chunk.is_empty() {
            return;
        }
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let mut pos = 0;
        let mut keep_from = None;
        while let Some(offset) = find(&buf[pos..], KEY) {
            let start = pos + offset;
            let after_key = start + KEY.len();
            if start > 0 && buf[start - 1] == b'\\' {
                // An escaped quote: the key text is inside a JSON string, not a key.
                pos = after_key;
                continue;
            }
            match parse_value(&buf[after_key..]) {
                Parse::Complete { usage, consumed } => {
                    if usage.is_some() {
                        self.latest = usage;
                    }
                    pos = after_key + consumed;
                }
                Parse::Incomplete => {
                    keep_from = Some(start);
                    break;
                }
            }
        }
        self.carry = match keep_from {
            Some(start) if buf.len() - start <= MAX_CARRY_BYTES => buf[start..].to_vec(),
            Some(_) => Vec::new(),
            // Keep enough to recognise a key split across two chunks.
            None => buf[buf
                .len()
                .saturating_sub(KEY.len() - 1)
                .max(pos.min(buf.len()))..]
                .to_vec(),
        };
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// Parses `: <value>` right after the key. Only an object value yields usage; `null` and
/// other values complete without it.
fn parse_value(rest: &[u8]) -> Parse {
    let i = skip_ws(rest, 0);
    match rest.get(i) {
        None => return Parse::Incomplete,
        Some(b':') => {}
        Some(_) => {
            return Parse::Complete {
                usage: None,
                consumed: i,
            };
        }
    }
    let i = skip_ws(rest, i + 1);
    match rest.get(i) {
        None => Parse::Incomplete,
        Some(b'{') => match object_end(&rest[i..]) {
            Some(len) => {
                let usage = serde_json::from_slice::<RawUsage>(&rest[i..i + len])
                    .ok()
                    .map(|raw| Usage {
                        prompt_tokens: raw.prompt_tokens,
                        completion_tokens: raw.completion_tokens,
                        cached_tokens: raw.prompt_tokens_details.and_then(|d| d.cached_tokens),
                    });
                Parse::Complete {
                    usage,
                    consumed: i + len,
                }
            }
            None if rest.len() - i > MAX_CARRY_BYTES => Parse::Complete {
                usage: None,
                consumed: i,
            },
            None => Parse::Incomplete,
        },
        Some(_) => Parse::Complete {
            usage: None,
            consumed: i,
        },
    }
}

/// Length of the JSON object starting at `bytes[0] == b'{'`, or `None` if it is not closed yet.
fn object_end(bytes: &[u8]) -> Option<usize> {
    let mut depth = 0usize;
    let mut quotes = scorer_core::quotes::QuoteState::default();
    for (i, &b) in bytes.iter().enumerate() {
        if !quotes.outside(b) {
            continue;
        }
        match b {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> Option<Usage> {
        let mut s = UsageScanner::default();
        for c in chunks {
            s.feed(c);
        }
        s.usage()
    }

    const JSON: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"the \"usage\": {} text"}}],
        "usage":{"prompt_tokens":120,"completion_tokens":7,"total_tokens":127,
        "prompt_tokens_details":{"cached_tokens":96}}}"#;

    #[test]
    fn non_streaming_json_whole_and_byte_by_byte() {
        let want = Usage {
            prompt_tokens: Some(120),
            completion_tokens: Some(7),
            cached_tokens: Some(96),
        };
        assert_eq!(scan(&[JSON]), Some(want));
        let bytes: Vec<&[u8]> = JSON.chunks(1).collect();
        assert_eq!(scan(&bytes), Some(want));
        for split in 0..JSON.len() {
            assert_eq!(
                scan(&[&JSON[..split], &JSON[split..]]),
                Some(want),
                "split at {split}"
            );
        }
    }

    #[test]
    fn sse_stream_takes_the_last_usage() {
        let events: [&[u8]; 4] = [
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1}}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":null}}\n\n",
            b"data: [DONE]\n\n",
        ];
        let got = scan(&events).unwrap();
        assert_eq!(got.prompt_tokens, Some(10));
        assert_eq!(got.completion_tokens, Some(2));
        assert_eq!(got.cached_tokens, None);
    }

    #[test]
    fn no_usage_and_garbage() {
        assert_eq!(scan(&[b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"]), None);
        assert_eq!(scan(&[b"\"usage\":{\"prompt_tokens\":\"many\"}"]), None);
        assert_eq!(
            scan(&[b"\"usage\"", b":", b"{", b"\"prompt_tokens\":3", b"}"])
                .unwrap()
                .prompt_tokens,
            Some(3)
        );
        assert_eq!(scan(&[b"\xff\xfe\"usage\":{]]]]"]), None);
    }

    #[test]
    fn memory_stays_bounded() {
        let mut s = UsageScanner::default();
        s.feed(b"\"usage\":{\"prompt_tokens\":1,\"x\":\"");
        for _ in 0..1000 {
            s.feed(&[b'a'; 1024]);
            assert!(s.carry.len() <= MAX_CARRY_BYTES + 1024);
        }
        s.feed(b"\"}, \"usage\":{\"prompt_tokens\":5}");
        assert_eq!(s.usage().unwrap().prompt_tokens, Some(5));
        assert!(s.carry.len() < 16);
    }
}
