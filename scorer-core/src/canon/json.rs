//! Reading request bodies as vLLM's server does (Python's `json.loads`, then pydantic), so that
//! a body vLLM serves is not one the filter gives up on (and routes without affinity).
//!
//! - Duplicate keys: the last one wins, as in a Python dict, in every object read.
//! - A field of the wrong type is kept as [`Field::Bad`] rather than failing the parse: a later
//!   duplicate may replace it. Only the value that survives is checked. The exception is a
//!   `content` that is a number, a boolean or an object: it is read on serde_json's bytes path
//!   ([`Content`]), which refuses those at once.
//! - `NaN`, `Infinity`, `-Infinity`, lone UTF-16 surrogates and UTF-16/32 bodies, which
//!   serde_json refuses, are rewritten by [`python_compat`] when a body fails to parse; valid
//!   bodies never pay for it.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::CanonError;

/// One field as read: the last occurrence of its key.
#[derive(Default)]
pub(crate) enum Field<T> {
    /// Absent, or `null` (pydantic's default for an optional field).
    #[default]
    Absent,
    Value(T),
    /// Present with a type the canonicaliser cannot use.
    Bad,
}

impl<T> From<Option<T>> for Field<T> {
    fn from(value: Option<T>) -> Self {
        value.map_or(Self::Bad, Self::Value)
    }
}

impl<T> Field<T> {
    /// The value, `None` when absent; a wrong type makes the body invalid, as vLLM finds it.
    pub(crate) fn get(self, name: &str) -> Result<Option<T>, CanonError> {
        match self {
            Self::Absent => Ok(None),
            Self::Value(v) => Ok(Some(v)),
            Self::Bad => Err(CanonError::InvalidBody(format!(
                "{name} has the wrong type"
            ))),
        }
    }
}

/// A type read from whichever JSON value comes: the shapes it takes give `Some`, any other
/// is consumed and gives `None` ([`Field::Bad`]).
pub(crate) trait Lenient<'de>: Sized {
    fn read<D: Deserializer<'de>>(d: D) -> Result<Field<Self>, D::Error> {
        d.deserialize_any(FieldVisitor(PhantomData))
    }
    fn from_str(_: Cow<'de, str>) -> Option<Self> {
        None
    }
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
    fn from_seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Option<Self>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<Option<Self>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

impl<'de, T: Lenient<'de>> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::read(d)
    }
}

struct FieldVisitor<T>(PhantomData<T>);

impl<'de, T: Lenient<'de>> Visitor<'de> for FieldVisitor<T> {
    type Value = Field<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Field<T>, E> {
        Ok(Field::Absent)
    }
    fn visit_none<E>(self) -> Result<Field<T>, E> {
        Ok(Field::Absent)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Field<T>, E> {
        Ok(T::from_bool(b).into())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Field<T>, E> {
        Ok(Field::Bad)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Field<T>, E> {
        Ok(Field::Bad)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Field<T>, E> {
        Ok(Field::Bad)
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Field<T>, E> {
        Ok(T::from_str(Cow::Borrowed(s)).into())
    }
    fn visit_str<E>(self, s: &str) -> Result<Field<T>, E> {
        Ok(T::from_str(Cow::Owned(s.to_owned())).into())
    }
    fn visit_string<E>(self, s: String) -> Result<Field<T>, E> {
        Ok(T::from_str(Cow::Owned(s)).into())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Field<T>, A::Error> {
        Ok(T::from_seq(seq)?.into())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Field<T>, A::Error> {
        Ok(T::from_map(map)?.into())
    }
}

impl<'de> Lenient<'de> for Cow<'de, str> {
    fn from_str(s: Cow<'de, str>) -> Option<Self> {
        Some(s)
    }
}

impl Lenient<'_> for bool {
    fn from_bool(b: bool) -> Option<Self> {
        Some(b)
    }
}

impl<'de> Lenient<'de> for &'de RawValue {
    fn read<D: Deserializer<'de>>(d: D) -> Result<Field<Self>, D::Error> {
        let raw = <&RawValue>::deserialize(d)?;
        Ok(if raw.get() == "null" {
            Field::Absent
        } else {
            Field::Value(raw)
        })
    }
}

/// A list whose every element has the element's type (pydantic refuses the list otherwise).
impl<'de, T: Lenient<'de>> Lenient<'de> for Vec<T> {
    fn from_seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Option<Self>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        let mut bad = false;
        while let Some(element) = seq.next_element::<Field<T>>()? {
            match element {
                Field::Value(v) if !bad => out.push(v),
                _ => bad = true,
            }
        }
        Ok((!bad).then_some(out))
    }
}

/// A `content` (a chat or Anthropic message's, a Responses item's or a tool result's, or a
/// Responses `output` or Anthropic `system`), read in one pass: its text when it is a string
/// (not kept raw to be parsed a second time; a long prompt's text is most of the body), its
/// parts' raw text when it is an array. Any other type is [`Field::Bad`].
pub(crate) enum Content<'de> {
    /// The string's bytes, unescaped: UTF-8, as [`check_text`] makes sure.
    Text(Cow<'de, [u8]>),
    Parts(Vec<&'de RawValue>),
}

impl<'de> Lenient<'de> for Content<'de> {
    /// Read as bytes, not as a string: serde_json then finds a string's end with memchr (SIMD
    /// in the filter's WebAssembly) instead of checking every byte's class a word at a time,
    /// and skips its own UTF-8 pass, which [`check_text`] does faster for the usual plain text.
    /// Parse and hash of a 200 KB chat body in Envoy's V8 (`kvroute-bench`'s `v8_hash` example):
    /// 84-90 µs the other way, 55-56 this one.
    fn read<D: Deserializer<'de>>(d: D) -> Result<Field<Self>, D::Error> {
        d.deserialize_option(ContentVisitor)
    }
}

/// `null` is absent; anything else is read as bytes ([`ContentValueVisitor`]).
struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = Field<Content<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, an array of parts or null")
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Field::Absent)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Field::Absent)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_bytes(ContentValueVisitor)
    }
}

/// A content's value. serde_json hands a string here unchecked, so this checks it; other
/// deserializers may hand a `str`, or (for the types serde_json refuses on this path, which
/// then fail the body) a number, a boolean or a map.
struct ContentValueVisitor;

impl<'de> Visitor<'de> for ContentValueVisitor {
    type Value = Field<Content<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or an array of parts")
    }
    fn visit_borrowed_bytes<E: serde::de::Error>(self, b: &'de [u8]) -> Result<Self::Value, E> {
        check_text(b, true)?;
        Ok(Field::Value(Content::Text(Cow::Borrowed(b))))
    }
    fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<Self::Value, E> {
        check_text(b, false)?;
        Ok(Field::Value(Content::Text(Cow::Owned(b.to_vec()))))
    }
    fn visit_byte_buf<E: serde::de::Error>(self, b: Vec<u8>) -> Result<Self::Value, E> {
        check_text(&b, false)?;
        Ok(Field::Value(Content::Text(Cow::Owned(b))))
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Field::Value(Content::Text(Cow::Borrowed(s.as_bytes()))))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Field::Value(Content::Text(Cow::Owned(
            s.as_bytes().to_vec(),
        ))))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(part) = seq.next_element::<&'de RawValue>()? {
            parts.push(part);
        }
        Ok(Field::Value(Content::Parts(parts)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Field::Bad)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Field::Bad)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Field::Absent)
    }
}

/// What serde_json's checked string path refuses and its bytes path does not: text that is
/// not UTF-8 (a lone surrogate, escaped or raw, comes out as bytes that are not either, so
/// [`python_compat`] still rewrites it as before), and, in a string read without escapes
/// (`raw`), a raw control character. A string with escapes comes unescaped, so its raw control
/// characters cannot be told from escaped ones: such a body, which Python's `json` refuses, is
/// read instead (the engine refuses it). Plain printable ASCII, the usual prompt, is settled
/// by one pass LLVM vectorises.
fn check_text<E: serde::de::Error>(bytes: &[u8], raw: bool) -> Result<(), E> {
    let plain = bytes
        .chunks(64)
        .all(|c| c.iter().fold(true, |ok, &b| ok & (0x20..0x80).contains(&b)));
    if plain {
        return Ok(());
    }
    if raw && bytes.iter().any(|&b| b < 0x20) {
        return Err(E::custom("control character in a string"));
    }
    std::str::from_utf8(bytes)
        .map(drop)
        .map_err(|_| E::custom("a string that is not UTF-8"))
}

/// An output-token limit (`max_tokens` and kin) as the router's length hint: a number of any
/// size or form (`1e3`, `5.0`, `2^70`, or a numeric string, which pydantic also takes)
/// saturates to `0..=u32::MAX` (huge still says "long"); anything else is no hint. It never
/// fails a body: vLLM judges the limit, and the request still deserves its affinity.
#[derive(Clone, Copy, Default)]
pub(crate) struct Limit(pub(crate) Option<u32>);

impl<'de> Lenient<'de> for Limit {
    fn read<D: Deserializer<'de>>(d: D) -> Result<Field<Self>, D::Error> {
        let raw = <&RawValue>::deserialize(d)?;
        let raw = raw.get();
        let text = match raw.as_bytes().first() {
            Some(b'"') => str_of(raw).ok(),
            Some(b'-' | b'0'..=b'9') => Some(Cow::Borrowed(raw)),
            _ => None,
        };
        let n = text.and_then(|t| t.trim().parse::<f64>().ok());
        // `as` saturates: -5 -> 0, 1e400 (inf) -> u32::MAX, 5.9 -> 5.
        Ok(Field::Value(Limit(
            n.filter(|n| !n.is_nan()).map(|n| n as u32),
        )))
    }
}

/// An object key, borrowed unless it has escapes.
pub(crate) struct Key<'de>(Cow<'de, str>);

impl Key<'_> {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// Declares a struct read from a JSON object, each field from its key's last occurrence;
/// other keys are skipped (at any depth: serde_json skips without recursion).
macro_rules! json_object {
    (
        $(#[$meta:meta])*
        struct $name:ident<$lt:lifetime> {
            $($(#[$fmeta:meta])* $key:literal => $field:ident: $ty:ty,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Default)]
        struct $name<$lt> {
            $($(#[$fmeta])* $field: $crate::canon::json::Field<$ty>,)*
        }

        impl<$lt> $crate::canon::json::Lenient<$lt> for $name<$lt> {
            fn from_map<A: serde::de::MapAccess<$lt>>(
                mut map: A,
            ) -> Result<Option<Self>, A::Error> {
                let mut out = Self::default();
                while let Some(key) = map.next_key::<$crate::canon::json::Key<$lt>>()? {
                    match key.as_str() {
                        $($key => out.$field = map.next_value()?,)*
                        _ => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(Some(out))
            }
        }
    };
}
pub(crate) use json_object;

/// Reads a whole body as `T`, which must be there.
pub(crate) fn parse<'a, T: Lenient<'a>>(body: &'a [u8], what: &str) -> Result<T, CanonError> {
    required(serde_json::from_slice::<Field<T>>(body), what)
}

/// Reads a fragment of a body (a raw value: UTF-8 already checked) as `T`.
pub(crate) fn fragment<'a, T: Lenient<'a>>(raw: &'a str, what: &str) -> Result<T, CanonError> {
    required(serde_json::from_str::<Field<T>>(raw), what)
}

fn required<T>(read: serde_json::Result<Field<T>>, what: &str) -> Result<T, CanonError> {
    match read.map_err(invalid)? {
        Field::Value(v) => Ok(v),
        _ => Err(CanonError::InvalidBody(format!(
            "{what} has the wrong type"
        ))),
    }
}

/// A JSON string's text, borrowed unless it has escapes.
pub(crate) fn str_of(raw: &str) -> Result<Cow<'_, str>, CanonError> {
    fragment(raw, "a string")
}

pub(crate) fn invalid(e: serde_json::Error) -> CanonError {
    CanonError::InvalidBody(e.to_string())
}

/// The members of an object, in order, each with its value's raw text.
pub(crate) struct Members<'de>(pub(crate) Vec<(Key<'de>, &'de RawValue)>);

impl<'de> Lenient<'de> for Members<'de> {
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<Option<Self>, A::Error> {
        let mut members = Vec::new();
        while let Some(entry) = map.next_entry::<Key<'de>, &'de RawValue>()? {
            members.push(entry);
        }
        Ok(Some(Members(members)))
    }
}

/// Where `part`, a slice of `whole`, ends in it.
pub(crate) fn end_in(whole: &str, part: &str) -> Result<usize, CanonError> {
    let end = (part.as_ptr() as usize)
        .wrapping_sub(whole.as_ptr() as usize)
        .wrapping_add(part.len());
    if end <= whole.len() {
        Ok(end)
    } else {
        Err(CanonError::InvalidBody(
            "raw value outside its object".into(),
        ))
    }
}

// ------------------------------------------------------------------------------------------
// What Python's `json` accepts and serde_json does not

const REPLACEMENT_ESCAPE: &[u8] = b"\\ufffd";
const REPLACEMENT_UTF8: &[u8] = "\u{fffd}".as_bytes();

/// `body` rewritten to strict JSON that reads as `json.loads(body)` does: a UTF-16 or UTF-32
/// body decoded (`json.loads` detects them), each lone surrogate, escaped or raw (its
/// `surrogatepass`), as U+FFFD (deterministic; a surrogate pair stays), and `NaN`,
/// `Infinity`, `-Infinity` outside strings as `null` (only ignored fields take them, or a
/// length hint, which then is absent). `None` when nothing needed rewriting. Nothing else in a
/// string is touched; whatever else is wrong stays wrong for the second parse to report.
pub(crate) fn python_compat(body: &[u8]) -> Option<Vec<u8>> {
    let wide = decode_wide(body);
    let src = wide.as_deref().unwrap_or(body);
    let mut out = Rewrite {
        src,
        out: Vec::new(),
        copied: 0,
        changed: wide.is_some(),
    };
    let mut i = 0;
    while let Some(&b) = src.get(i) {
        i = match b {
            b'"' => out.string(i + 1),
            b'N' if src[i..].starts_with(b"NaN") => out.replace(i, 3, b"null"),
            b'I' if src[i..].starts_with(b"Infinity") => out.replace(i, 8, b"null"),
            b'-' if src[i..].starts_with(b"-Infinity") => out.replace(i, 9, b"null"),
            _ => i + 1,
        };
    }
    out.finish()
}

struct Rewrite<'a> {
    src: &'a [u8],
    out: Vec<u8>,
    /// `src[..copied]` is in `out`.
    copied: usize,
    changed: bool,
}

impl Rewrite<'_> {
    /// Puts `with` in place of `src[at..at + len]`; returns where scanning resumes.
    fn replace(&mut self, at: usize, len: usize, with: &[u8]) -> usize {
        if self.out.capacity() == 0 {
            self.out.reserve(self.src.len() + 16);
        }
        self.out
            .extend_from_slice(self.src.get(self.copied..at).unwrap_or_default());
        self.out.extend_from_slice(with);
        self.copied = at + len;
        self.changed = true;
        self.copied
    }

    /// Scans a string from `i` (after its opening quote); returns the index after its closing
    /// quote (or the end).
    fn string(&mut self, mut i: usize) -> usize {
        let src = self.src;
        while let Some(&b) = src.get(i) {
            match b {
                b'"' => return i + 1,
                b'\\' if src.get(i + 1) == Some(&b'u') => {
                    let Some(n) = hex4(src, i + 2) else {
                        i += 2;
                        continue;
                    };
                    let paired = (0xd800..0xdc00).contains(&n)
                        && src.get(i + 6) == Some(&b'\\')
                        && src.get(i + 7) == Some(&b'u')
                        && hex4(src, i + 8).is_some_and(|m| (0xdc00..0xe000).contains(&m));
                    i = if paired {
                        i + 12
                    } else if (0xd800..0xe000).contains(&n) {
                        self.replace(i, 6, REPLACEMENT_ESCAPE)
                    } else {
                        i + 6
                    };
                }
                b'\\' => i += 2,
                // A surrogate in UTF-8 form (ED A0..BF xx): what Python's `surrogatepass` reads.
                0xed if src.get(i + 1).is_some_and(|c| (0xa0..0xc0).contains(c))
                    && src.get(i + 2).is_some_and(|c| (0x80..0xc0).contains(c)) =>
                {
                    i = self.replace(i, 3, REPLACEMENT_UTF8);
                }
                _ => i += 1,
            }
        }
        i
    }

    fn finish(mut self) -> Option<Vec<u8>> {
        if !self.changed {
            return None;
        }
        self.out
            .extend_from_slice(self.src.get(self.copied..).unwrap_or_default());
        Some(self.out)
    }
}

fn hex4(src: &[u8], at: usize) -> Option<u32> {
    let digits = src.get(at..at + 4)?;
    let text = std::str::from_utf8(digits).ok()?;
    if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(text, 16).ok()
}

/// A UTF-16 or UTF-32 body as UTF-8, told apart as Python's `json.detect_encoding` does (a
/// BOM, else the zero bytes an ASCII first character leaves); lone surrogates become U+FFFD.
/// `None` for UTF-8 or a body that does not decode.
fn decode_wide(b: &[u8]) -> Option<Vec<u8>> {
    let (unit, big_endian, bom) = match b {
        [0, 0, 0xfe, 0xff, ..] => (4, true, 4),
        [0xff, 0xfe, 0, 0, ..] => (4, false, 4),
        [0xfe, 0xff, ..] => (2, true, 2),
        [0xff, 0xfe, ..] => (2, false, 2),
        [0, 0, _, _, ..] => (4, true, 0),
        [0, _, _, _, ..] => (2, true, 0),
        [_, 0, 0, 0, ..] => (4, false, 0),
        [_, 0, _, _, ..] => (2, false, 0),
        _ => return None,
    };
    let data = b.get(bom..)?;
    if data.len() % unit != 0 {
        return None;
    }
    let mut out = String::with_capacity(data.len());
    if unit == 2 {
        let units = data.chunks_exact(2).map(|c| {
            let pair = [c[0], c[1]];
            if big_endian {
                u16::from_be_bytes(pair)
            } else {
                u16::from_le_bytes(pair)
            }
        });
        out.extend(char::decode_utf16(units).map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER)));
    } else {
        for c in data.chunks_exact(4) {
            let quad = [c[0], c[1], c[2], c[3]];
            let n = if big_endian {
                u32::from_be_bytes(quad)
            } else {
                u32::from_le_bytes(quad)
            };
            match n {
                0xd800..=0xdfff => out.push(char::REPLACEMENT_CHARACTER),
                _ => out.push(char::from_u32(n)?),
            }
        }
    }
    Some(out.into_bytes())
}
