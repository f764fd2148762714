//! A hand reader for the plain JSON that nearly every request and response body is: the
//! filter reads one body per request and one `usage` object per response, and serde's general
//! path (UTF-8 checks on every key, a visitor per value) costs several times what these shapes
//! need.
//!
//! The reader is certain or silent: every method answers `None` for "not certain, ask serde",
//! which covers everything serde refuses and whatever this reader leaves to it (a `\u` escape,
//! bytes outside ASCII or below the space, containers nested deeper than [`MAX_DEPTH`]). What it
//! accepts, serde reads the same way; its callers fall back to serde on `None`, and their tests
//! and fuzz targets compare the two readings.

use std::borrow::Cow;

/// Containers deeper than this inside a skipped value are left to serde.
pub const MAX_DEPTH: u32 = 8;

/// Where the JSON whitespace (space, tab, CR, LF) that starts at `from` in `bytes` ends.
pub fn skip_ws(bytes: &[u8], mut from: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\r' | b'\n') = bytes.get(from) {
        from += 1;
    }
    from
}

/// The keys of one object a hand reader has read, by the bit its caller gives each. serde
/// refuses a field twice, or (the canonicaliser's lenient readers) keeps its last occurrence;
/// a hand reader leaves either to serde.
#[derive(Debug, Default)]
pub struct Seen(u32);

impl Seen {
    /// `Some` the first time `key` (a bit number below 32) is read, `None` after.
    pub fn first(&mut self, key: u32) -> Option<()> {
        let first = self.0 & (1 << key) == 0;
        self.0 |= 1 << key;
        first.then_some(())
    }
}

/// A cursor over one JSON text.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    /// Bytes read so far.
    pub fn position(&self) -> usize {
        self.at
    }

    /// Whether only whitespace is left.
    pub fn at_end(&mut self) -> bool {
        self.ws();
        self.at == self.bytes.len()
    }

    /// Skips JSON whitespace.
    pub fn ws(&mut self) {
        self.at = skip_ws(self.bytes, self.at);
    }

    /// The next byte after whitespace, not consumed.
    pub fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.bytes.get(self.at).copied()
    }

    /// Consumes `byte` after whitespace.
    pub fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// Consumes `null` after whitespace, when it is next.
    pub fn null(&mut self) -> bool {
        self.peek() == Some(b'n') && self.literal(b"null").is_some()
    }

    /// `{ "key": value, ... }`: `member` gets each key (plain, see [`Reader::key`]) with the
    /// reader before its value, and must consume the value.
    pub fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>,
    ) -> Option<()> {
        self.eat(b'{')?;
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            let key = self.key()?;
            self.eat(b':')?;
            self.ws();
            member(self, key)?;
            if !self.another(b'}')? {
                return Some(());
            }
        }
    }

    /// `[ value, ... ]`: `element` must consume each value (the reader is before it).
    pub fn array(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        if self.eat(b']').is_some() {
            return Some(());
        }
        loop {
            self.ws();
            element(self)?;
            if !self.another(b']')? {
                return Some(());
            }
        }
    }

    /// After a member or an element: consumes a `,` (`true`: another follows) or `close`
    /// (`false`: the container ends).
    fn another(&mut self, close: u8) -> Option<bool> {
        let next = self.peek()?;
        self.at += 1;
        match next {
            b',' => Some(true),
            b if b == close => Some(false),
            _ => None,
        }
    }

    /// A key: plain ASCII (no escapes, nothing below the space), its bytes between the quotes.
    pub fn key(&mut self) -> Option<&'a [u8]> {
        match self.text()? {
            Cow::Borrowed(key) => Some(key),
            Cow::Owned(_) => None,
        }
    }

    /// A string of ASCII at or above the space (borrowed), or with the short escapes (`\"`,
    /// `\\`, `\/`, `\b`, `\f`, `\n`, `\r`, `\t`, decoded into an owned copy). A `\u` escape or
    /// any other byte is left to serde.
    pub fn text(&mut self) -> Option<Cow<'a, [u8]>> {
        self.eat(b'"')?;
        let start = self.at;
        let rest = &self.bytes[start..];
        let end = memchr::memchr2(b'"', b'\\', rest)?;
        if !plain_ascii(&rest[..end]) {
            return None;
        }
        if rest[end] == b'"' {
            self.at = start + end + 1;
            return Some(Cow::Borrowed(&rest[..end]));
        }
        let mut out = Vec::with_capacity(rest.len().min(end + 64));
        out.extend_from_slice(&rest[..end]);
        let mut i = end;
        loop {
            // `rest[i]` is a quote or a backslash.
            if rest[i] == b'"' {
                self.at = start + i + 1;
                return Some(Cow::Owned(out));
            }
            out.push(match *rest.get(i + 1)? {
                b'"' => b'"',
                b'\\' => b'\\',
                b'/' => b'/',
                b'b' => 0x08,
                b'f' => 0x0c,
                b'n' => b'\n',
                b'r' => b'\r',
                b't' => b'\t',
                _ => return None,
            });
            i += 2;
            let run = memchr::memchr2(b'"', b'\\', &rest[i..])?;
            if !plain_ascii(&rest[i..i + run]) {
                return None;
            }
            out.extend_from_slice(&rest[i..i + run]);
            i += run;
        }
    }

    /// A string as [`Reader::text`] reads it, as text.
    pub fn str(&mut self) -> Option<Cow<'a, str>> {
        // ASCII, raw or escaped: always UTF-8, checked anyway (cheap for short strings).
        match self.text()? {
            Cow::Borrowed(b) => std::str::from_utf8(b).ok().map(Cow::Borrowed),
            Cow::Owned(b) => String::from_utf8(b).ok().map(Cow::Owned),
        }
    }

    /// `true` or `false`.
    pub fn bool(&mut self) -> Option<bool> {
        match self.peek()? {
            b't' => self.literal(b"true").map(|()| true),
            b'f' => self.literal(b"false").map(|()| false),
            _ => None,
        }
    }

    /// A count: an unsigned JSON integer (no sign, fraction or exponent) that fits `u64`.
    pub fn unsigned(&mut self) -> Option<u64> {
        self.ws();
        let start = self.at;
        self.number()?;
        let digits = &self.bytes[start..self.at];
        if digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        Some(
            digits
                .iter()
                .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')),
        )
    }

    /// A number in JSON's grammar, consumed: `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`.
    pub fn number(&mut self) -> Option<()> {
        let b = self.bytes;
        let mut i = self.at;
        let digits = |i: &mut usize| {
            let from = *i;
            while b.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i > from
        };
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i)? {
            b'0' => i += 1,
            b'1'..=b'9' => {
                digits(&mut i);
            }
            _ => return None,
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                return None;
            }
        }
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            if !digits(&mut i) {
                return None;
            }
        }
        // A digit right after the number (`01`) is not JSON.
        if b.get(i).is_some_and(u8::is_ascii_digit) {
            return None;
        }
        self.at = i;
        Some(())
    }

    /// Any value (at most [`MAX_DEPTH`] containers deep), consumed unread.
    pub fn skip(&mut self) -> Option<()> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.text().map(drop),
            b'n' => self.literal(b"null"),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'{' if depth < MAX_DEPTH => self.object(|r, _| r.skip_at(depth + 1)),
            b'[' if depth < MAX_DEPTH => self.array(|r| r.skip_at(depth + 1)),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at + word.len();
        (self.bytes.get(self.at..end) == Some(word)).then(|| self.at = end)
    }
}

/// Whether every byte is ASCII at or above the space (what JSON takes raw in a string).
///
/// Eight bytes at a time: a byte below the space has its top bit set once the space is taken
/// off (wrapping), and a byte at or above 0x80 has it already, so the OR of `x | (x - spaces)`
/// has a top bit set exactly when some byte is neither. A borrow out of a byte below the space
/// may flag the byte above it too, but only when that byte is flagged already: the answer is
/// exact. (A per-byte range test was about 1.3 instructions a byte.)
fn plain_ascii(bytes: &[u8]) -> bool {
    const TOP: u64 = 0x8080_8080_8080_8080;
    const SPACES: u64 = 0x2020_2020_2020_2020;
    let mut words = bytes.chunks_exact(8);
    let mut flags = 0u64;
    for word in &mut words {
        let mut le = [0u8; 8];
        le.copy_from_slice(word);
        let x = u64::from_le_bytes(le);
        flags |= x | x.wrapping_sub(SPACES);
    }
    let tail = words
        .remainder()
        .iter()
        .fold(0u8, |acc, &b| acc | b | b.wrapping_sub(0x20));
    flags & TOP == 0 && tail & 0x80 == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skip_all(text: &[u8]) -> Option<usize> {
        let mut r = Reader::new(text);
        r.skip()?;
        r.at_end().then(|| r.position())
    }

    #[test]
    fn plain_values_are_read_and_the_rest_left_to_serde() {
        for ok in [
            &b"{}"[..],
            b" [1, -2, 0.5, 1e3, -0.25E-2, true, false, null, \"a\\n\\\"b\\\\\"] ",
            b"{\"a\": {\"b\": [[]]}, \"c\": \"\"}",
        ] {
            assert!(skip_all(ok).is_some(), "{}", String::from_utf8_lossy(ok));
            serde_json::from_slice::<serde::de::IgnoredAny>(ok).unwrap();
        }
        for unsure in [
            &b"01"[..],
            b"1.",
            b".5",
            b"1e",
            b"+1",
            b"\"\\u0041\"",
            b"\"caf\xc3\xa9\"",
            b"\"tab\there\"",
            b"\"\\x\"",
            b"[1,]",
            b"{\"a\":1,}",
            b"[[[[[[[[[[]]]]]]]]]]",
            b"\"open",
            b"nul",
        ] {
            assert_eq!(
                skip_all(unsure),
                None,
                "{}",
                String::from_utf8_lossy(unsure)
            );
        }
    }

    #[test]
    fn escapes_are_decoded_as_serde_does() {
        let body = br#""a\"b\\c\/d\be\ff\ng\rh\ti""#;
        let mut r = Reader::new(body);
        let read = r.text().unwrap();
        let serde: String = serde_json::from_slice(body).unwrap();
        assert_eq!(&*read, serde.as_bytes());
        assert!(matches!(
            Reader::new(b"\"plain\"").text(),
            Some(Cow::Borrowed(b"plain"))
        ));
    }

    #[test]
    fn plain_ascii_is_the_space_to_del() {
        // 100 bytes are twelve words and a four-byte tail: 77 is in a word, 98 in the tail,
        // and a byte below the space at 77 borrows from the byte above it.
        for b in 0..=255u8 {
            for at in [0, 77, 98, 99] {
                let mut text = vec![b' '; 100];
                text[at] = b;
                assert_eq!(
                    plain_ascii(&text),
                    (0x20..0x80).contains(&b),
                    "{b:#x} at {at}"
                );
            }
        }
        assert!(plain_ascii(b""));
    }

    #[test]
    fn counts_fit_u64() {
        assert_eq!(Reader::new(b" 0").unsigned(), Some(0));
        assert_eq!(
            Reader::new(b"9999999999999999999").unsigned(),
            Some(9_999_999_999_999_999_999)
        );
        assert_eq!(Reader::new(b"99999999999999999999").unsigned(), None);
        assert_eq!(Reader::new(b"-1").unsigned(), None);
        assert_eq!(Reader::new(b"1.0").unsigned(), None);
    }
}
