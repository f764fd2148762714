//! Finds the token `usage` object in a response body that arrives in chunks.
//!
//! vLLM reports usage once: at the end of a JSON body, or in the last SSE event of a stream
//! (with `stream_options.include_usage`). The scanner looks for the last complete
//! `"usage":{...}` object and keeps only a small tail between chunks, so memory stays bounded
//! whatever the response size. The agent APIs spell it their own way and are read too:
//! Responses (`input_tokens`, `input_tokens_details.cached_tokens`, `output_tokens`) and
//! Anthropic Messages (`input_tokens` without the cache read, `cache_read_input_tokens`;
//! a stream reports input in `message_start` and output in `message_delta`, so later
//! objects only fill in what they carry).

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
    #[serde(default)]
    input_tokens: Option<u32>,
    #[serde(default)]
    output_tokens: Option<u32>,
    #[serde(default)]
    input_tokens_details: Option<RawDetails>,
    #[serde(default)]
    cache_read_input_tokens: Option<u32>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u32>,
}

impl RawUsage {
    /// One usage object in vLLM's OpenAI terms, whichever API spelled it.
    fn into_usage(self) -> Usage {
        // Anthropic's `input_tokens` leaves out the cached and newly cached parts.
        let anthropic =
            self.cache_read_input_tokens.is_some() || self.cache_creation_input_tokens.is_some();
        let input = self.input_tokens.map(|t| {
            if anthropic {
                t.saturating_add(self.cache_read_input_tokens.unwrap_or(0))
                    .saturating_add(self.cache_creation_input_tokens.unwrap_or(0))
            } else {
                t
            }
        });
        let details = self.prompt_tokens_details.or(self.input_tokens_details);
        Usage {
            prompt_tokens: self.prompt_tokens.or(input),
            completion_tokens: self.completion_tokens.or(self.output_tokens),
            cached_tokens: details
                .and_then(|d| d.cached_tokens)
                .or(self.cache_read_input_tokens),
        }
    }
}

impl Usage {
    /// `self` with the fields `later` carries replaced (a stream's later usage objects may
    /// carry only some counts).
    fn updated(self, later: Usage) -> Usage {
        Usage {
            prompt_tokens: later.prompt_tokens.or(self.prompt_tokens),
            completion_tokens: later.completion_tokens.or(self.completion_tokens),
            cached_tokens: later.cached_tokens.or(self.cached_tokens),
        }
    }
}

#[derive(Deserialize)]
struct RawDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// Streaming scanner; feed it every response body chunk in order.
#[derive(Debug)]
pub struct UsageScanner {
    keys: KeyScanner,
    latest: Option<Usage>,
}

impl Default for UsageScanner {
    fn default() -> Self {
        UsageScanner {
            keys: KeyScanner::new(KEY),
            latest: None,
        }
    }
}

/// What a value parser made of the bytes after a key.
pub(crate) enum Parse<T> {
    /// A complete value was seen after the key (`found` when it was one the caller wants);
    /// `consumed` bytes follow the key.
    Complete {
        /// The value, when it is one the caller wants.
        found: Option<T>,
        /// Bytes of the value (and what led to it) after the key.
        consumed: usize,
    },
    /// The value continues in a later chunk.
    Incomplete,
}

impl UsageScanner {
    /// The usage seen so far (later objects fill in what they carry).
    pub fn usage(&self) -> Option<Usage> {
        self.latest
    }

    /// Scans one more chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let latest = &mut self.latest;
        self.keys
            .feed(chunk, MAX_CARRY_BYTES, parse_value, |usage| {
                *latest = Some(latest.unwrap_or_default().updated(usage));
                true
            });
    }
}

/// Finds every occurrence of one JSON key in a body that arrives in chunks and hands the bytes
/// after it to a value parser, keeping only a bounded tail between chunks.
#[derive(Debug)]
pub(crate) struct KeyScanner {
    key: &'static [u8],
    carry: Vec<u8>,
}

impl KeyScanner {
    /// A scanner for `key` (with its quotes, e.g. `"usage"`).
    pub(crate) fn new(key: &'static [u8]) -> Self {
        KeyScanner {
            key,
            carry: Vec::new(),
        }
    }

    /// Scans `chunk`: `parse` reads the bytes after each key (a value split across chunks is
    /// kept up to `max_carry` bytes, then skipped); `found` takes each wanted value and returns
    /// whether to keep scanning.
    pub(crate) fn feed<T>(
        &mut self,
        chunk: &[u8],
        max_carry: usize,
        parse: impl Fn(&[u8]) -> Parse<T>,
        mut found: impl FnMut(T) -> bool,
    ) {
        if chunk.is_empty() {
            return;
        }
        let key = self.key;
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let mut pos = 0;
        let mut keep_from = None;
        while let Some(offset) = find(&buf[pos..], key) {
            let start = pos + offset;
            let after_key = start + key.len();
            if start > 0 && buf[start - 1] == b'\\' {
                // An escaped quote: the key text is inside a JSON string, not a key.
                pos = after_key;
                continue;
            }
            match parse(&buf[after_key..]) {
                Parse::Complete {
                    found: value,
                    consumed,
                } => {
                    pos = after_key + consumed;
                    if let Some(value) = value
                        && !found(value)
                    {
                        return;
                    }
                }
                Parse::Incomplete => {
                    keep_from = Some(start);
                    break;
                }
            }
        }
        self.carry = match keep_from {
            Some(start) if buf.len() - start <= max_carry => buf[start..].to_vec(),
            Some(_) => Vec::new(),
            // Keep enough to recognise a key split across two chunks.
            None => buf[buf
                .len()
                .saturating_sub(key.len() - 1)
                .max(pos.min(buf.len()))..]
                .to_vec(),
        };
    }
}

/// Where `needle` first occurs in `haystack`: a token stream's every chunk is scanned, so this
/// is memchr's vectorised search rather than a compare at every offset.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

pub(crate) fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// Where a key's value starts: after `ws : ws`. `Err` is what to answer when there is none
/// (not a key, or not complete yet).
pub(crate) fn value_start<T>(rest: &[u8]) -> Result<usize, Parse<T>> {
    let i = skip_ws(rest, 0);
    match rest.get(i) {
        None => return Err(Parse::Incomplete),
        Some(b':') => {}
        Some(_) => {
            return Err(Parse::Complete {
                found: None,
                consumed: i,
            });
        }
    }
    let i = skip_ws(rest, i + 1);
    if i == rest.len() {
        return Err(Parse::Incomplete);
    }
    Ok(i)
}

/// Parses `: <value>` right after the key. Only an object value yields usage; `null` and
/// other values complete without it.
fn parse_value(rest: &[u8]) -> Parse<Usage> {
    let i = match value_start(rest) {
        Ok(i) => i,
        Err(parse) => return parse,
    };
    match rest[i] {
        b'{' => match object_end(&rest[i..]) {
            Some(len) => Parse::Complete {
                found: serde_json::from_slice::<RawUsage>(&rest[i..i + len])
                    .ok()
                    .map(RawUsage::into_usage),
                consumed: i + len,
            },
            None if rest.len() - i > MAX_CARRY_BYTES => Parse::Complete {
                found: None,
                consumed: i,
            },
            None => Parse::Incomplete,
        },
        _ => Parse::Complete {
            found: None,
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
    fn agent_apis_are_read_in_openai_terms() {
        let responses = br#"{"id":"resp_1","usage":{"input_tokens":90,"input_tokens_details":{"cached_tokens":64},"output_tokens":4,"total_tokens":94}}"#;
        let want = Usage {
            prompt_tokens: Some(90),
            completion_tokens: Some(4),
            cached_tokens: Some(64),
        };
        assert_eq!(scan(&[responses]), Some(want));
        // Anthropic's input_tokens leaves the cache read out; a stream splits the counts.
        let messages: [&[u8]; 3] = [
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":26,\"output_tokens\":0,\"cache_read_input_tokens\":64}}}\n\n",
            b"event: content_block_delta\ndata: {\"delta\":{\"text\":\"hi\"}}\n\n",
            b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":4}}\n\n",
        ];
        assert_eq!(scan(&messages), Some(want));
        let plain = br#"{"usage":{"input_tokens":90,"output_tokens":4}}"#;
        assert_eq!(scan(&[plain]).unwrap().prompt_tokens, Some(90));
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
            assert!(s.keys.carry.len() <= MAX_CARRY_BYTES + 1024);
        }
        s.feed(b"\"}, \"usage\":{\"prompt_tokens\":5}");
        assert_eq!(s.usage().unwrap().prompt_tokens, Some(5));
        assert!(s.keys.carry.len() < 16);
    }
}
