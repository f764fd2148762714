//! A msgpack scanner for the KV-event decoder: it walks a payload without building values, so
//! the decoder reads a batch's containers as byte slices and turns into `rmpv::Value`s only the
//! small fields it needs. A block's 16 token ids as `rmpv::Value`s, built and dropped, were most
//! of the decoding time; [`u32s`] and [`hashes`] read the common all-integer arrays straight from
//! the bytes, and say `None` for anything else, which the decoder then reads the slow way.
//!
//! [`skip`] checks a value as `rmpv` would read it (lengths in bounds, at most `MAX_DEPTH`
//! nested containers; `0xc1` is a one-byte value, which `rmpv` reads as nil), so a slice it
//! accepted reads back with `rmpv` without error.

use super::decode::DecodeError;

/// One container's members as byte slices, or another value.
pub(super) enum Shape<'a> {
    /// An array's elements.
    Array(Vec<&'a [u8]>),
    /// A map's key and value pairs, in order.
    Map(Vec<(&'a [u8], &'a [u8])>),
    /// Anything else: the value itself.
    Other,
}

fn truncated() -> DecodeError {
    DecodeError::Msgpack("unexpected end of data".into())
}

/// `n` bytes at `at`.
fn bytes(buf: &[u8], at: usize, n: usize) -> Result<&[u8], DecodeError> {
    at.checked_add(n)
        .and_then(|end| buf.get(at..end))
        .ok_or_else(truncated)
}

/// A big-endian length of `n` bytes at `at`.
fn length(buf: &[u8], at: usize, n: usize) -> Result<usize, DecodeError> {
    let b = bytes(buf, at, n)?;
    Ok(b.iter().fold(0usize, |acc, &x| (acc << 8) | usize::from(x)))
}

/// What a value starts with: its header's length, then the bytes of data after the header, or
/// the members of a container (`Err` of the count, maps counting pairs twice).
fn header(buf: &[u8], at: usize) -> Result<(usize, Result<usize, usize>), DecodeError> {
    let marker = *buf.get(at).ok_or_else(truncated)?;
    let x = at + 1;
    Ok(match marker {
        0x00..=0x7f | 0xc0..=0xc3 | 0xe0..=0xff => (1, Ok(0)),
        0x80..=0x8f => (1, Err(2 * usize::from(marker & 0x0f))),
        0x90..=0x9f => (1, Err(usize::from(marker & 0x0f))),
        0xa0..=0xbf => (1, Ok(usize::from(marker & 0x1f))),
        0xc4 | 0xd9 => (2, Ok(length(buf, x, 1)?)),
        0xc5 | 0xda => (3, Ok(length(buf, x, 2)?)),
        0xc6 | 0xdb => (5, Ok(length(buf, x, 4)?)),
        0xc7 => (3, Ok(length(buf, x, 1)?)),
        0xc8 => (4, Ok(length(buf, x, 2)?)),
        0xc9 => (6, Ok(length(buf, x, 4)?)),
        0xca => (1, Ok(4)),
        0xcb => (1, Ok(8)),
        0xcc | 0xd0 => (1, Ok(1)),
        0xcd | 0xd1 => (1, Ok(2)),
        0xce | 0xd2 => (1, Ok(4)),
        0xcf | 0xd3 => (1, Ok(8)),
        0xd4 => (2, Ok(1)),
        0xd5 => (2, Ok(2)),
        0xd6 => (2, Ok(4)),
        0xd7 => (2, Ok(8)),
        0xd8 => (2, Ok(16)),
        0xdc => (3, Err(length(buf, x, 2)?)),
        0xdd => (5, Err(length(buf, x, 4)?)),
        0xde => (3, Err(2 * length(buf, x, 2)?)),
        0xdf => (5, Err(2 * length(buf, x, 4)?)),
    })
}

/// The end of the value that starts at `at`, within `depth` nested containers.
pub(super) fn skip(buf: &[u8], at: usize, depth: usize) -> Result<usize, DecodeError> {
    let (head, body) = header(buf, at)?;
    let mut end = at.checked_add(head).ok_or_else(truncated)?;
    match body {
        Ok(n) => {
            bytes(buf, end, n)?;
            Ok(end + n)
        }
        Err(members) => {
            if depth == 0 {
                return Err(DecodeError::Msgpack("nested too deeply".into()));
            }
            for _ in 0..members {
                // Numbers, nil and booleans, inline: arrays of token ids are most of a batch.
                end = match buf.get(end).copied().and_then(scalar_len) {
                    Some(len) => end + len,
                    None => skip(buf, end, depth - 1)?,
                };
            }
            // A scalar's bytes were not checked as they were stepped over.
            bytes(buf, 0, end)?;
            Ok(end)
        }
    }
}

/// The whole length of a number, nil or boolean starting with `marker`; `None` for the rest.
fn scalar_len(marker: u8) -> Option<usize> {
    match marker {
        0x00..=0x7f | 0xc0..=0xc3 | 0xe0..=0xff => Some(1),
        0xcc | 0xd0 => Some(2),
        0xcd | 0xd1 => Some(3),
        0xca | 0xce | 0xd2 => Some(5),
        0xcb | 0xcf | 0xd3 => Some(9),
        _ => None,
    }
}

/// The members of the value `v` (a slice [`skip`] accepted).
pub(super) fn shape(v: &[u8]) -> Result<Shape<'_>, DecodeError> {
    let (head, body) = header(v, 0)?;
    let Err(members) = body else {
        return Ok(Shape::Other);
    };
    let is_map = matches!(v[0], 0x80..=0x8f | 0xde | 0xdf);
    // Every member takes a byte at least: a declared count beyond that is not preallocated.
    let mut slices = Vec::with_capacity(members.min(v.len()));
    let mut at = head;
    for _ in 0..members {
        let end = skip(v, at, usize::MAX)?;
        slices.push(&v[at..end]);
        at = end;
    }
    Ok(if is_map {
        Shape::Map(slices.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
    } else {
        Shape::Array(slices)
    })
}

/// The bytes of a msgpack string `v`; `None` when it is not a string.
pub(super) fn str_bytes(v: &[u8]) -> Option<&[u8]> {
    let (head, body) = header(v, 0).ok()?;
    let len = body
        .ok()
        .filter(|_| matches!(v[0], 0xa0..=0xbf | 0xd9..=0xdb))?;
    v.get(head..head.checked_add(len)?)
}

/// Whether `v` is nil (`0xc0`, or the never-used `0xc1`, which `rmpv` reads as nil).
pub(super) fn is_nil(v: &[u8]) -> bool {
    matches!(v.first(), Some(0xc0 | 0xc1))
}

/// The elements of an array of integers, each as `int(element)`; `None` for anything else.
fn ints<T>(v: &[u8], int: impl Fn(u8, &[u8]) -> Option<T>) -> Option<Vec<T>> {
    let (head, body) = header(v, 0).ok()?;
    let count = body
        .err()
        .filter(|_| !matches!(v[0], 0x80..=0x8f | 0xde | 0xdf))?;
    let mut out = Vec::with_capacity(count.min(v.len()));
    let mut at = head;
    for _ in 0..count {
        let marker = *v.get(at)?;
        let width = match marker {
            0x00..=0x7f | 0xe0..=0xff => 0,
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xce | 0xd2 => 4,
            0xcf | 0xd3 => 8,
            _ => return None,
        };
        out.push(int(marker, v.get(at + 1..at + 1 + width)?)?);
        at += 1 + width;
    }
    (at == v.len()).then_some(out)
}

/// An integer's bits as a u64 (two's complement for negative ones), and whether it is signed
/// and negative.
fn int_bits(marker: u8, data: &[u8]) -> (u64, bool) {
    let raw = data.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
    match marker {
        0x00..=0x7f => (u64::from(marker), false),
        0xe0..=0xff => (i64::from(marker as i8) as u64, true),
        0xd0 => (i64::from(raw as u8 as i8) as u64, (raw as u8 as i8) < 0),
        0xd1 => (i64::from(raw as u16 as i16) as u64, (raw as u16 as i16) < 0),
        0xd2 => (i64::from(raw as u32 as i32) as u64, (raw as u32 as i32) < 0),
        0xd3 => (raw, (raw as i64) < 0),
        _ => (raw, false),
    }
}

/// An array of token ids that are all non-negative integers below 2^32, read from the bytes.
pub(super) fn u32s(v: &[u8]) -> Option<Vec<u32>> {
    ints(v, |marker, data| {
        let (bits, negative) = int_bits(marker, data);
        (!negative).then(|| u32::try_from(bits).ok()).flatten()
    })
}

/// An array of integer block hashes as 64 bits (an i64 as its two's complement), read from the
/// bytes.
pub(super) fn hashes(v: &[u8]) -> Option<Vec<u64>> {
    ints(v, |marker, data| Some(int_bits(marker, data).0))
}

#[cfg(test)]
mod tests {
    use rmpv::Value;

    use super::*;
    use crate::kv_events::test_util::encode;

    // The fast readers agree with rmpv on every integer width and sign, and decline the rest.
    #[test]
    fn integer_arrays_read_as_rmpv_reads_them() {
        let ints: Vec<i128> = vec![
            0,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u32::MAX as i128,
            u32::MAX as i128 + 1,
            u64::MAX as i128,
            -1,
            -32,
            -33,
            -128,
            -129,
            -32_768,
            -32_769,
            i32::MIN as i128,
            i32::MIN as i128 - 1,
            i64::MIN as i128,
        ];
        for x in &ints {
            let value = if *x >= 0 {
                Value::from(*x as u64)
            } else {
                Value::from(*x as i64)
            };
            let bytes = encode(&Value::Array(vec![value.clone()]));
            let Value::Integer(n) = value else {
                unreachable!()
            };
            let want_hash = n.as_u64().or_else(|| n.as_i64().map(|i| i as u64));
            assert_eq!(hashes(&bytes), Some(vec![want_hash.unwrap()]), "{x}");
            let want_id = n.as_u64().and_then(|u| u32::try_from(u).ok());
            assert_eq!(u32s(&bytes), want_id.map(|i| vec![i]), "{x}");
        }
        for other in [
            Value::F64(1.0),
            Value::from("1"),
            Value::Nil,
            Value::Binary(vec![1]),
        ] {
            let bytes = encode(&Value::Array(vec![Value::from(1), other]));
            assert_eq!(hashes(&bytes), None);
            assert_eq!(u32s(&bytes), None);
        }
        assert_eq!(u32s(&encode(&Value::Map(vec![]))), None);
        assert_eq!(u32s(&encode(&Value::from(3))), None);
        assert_eq!(u32s(&encode(&Value::Array(vec![]))), Some(vec![]));
        let long: Vec<Value> = (0..70_000u64).map(Value::from).collect();
        let bytes = encode(&Value::Array(long));
        assert_eq!(u32s(&bytes).map(|v| v.len()), Some(70_000));
        // A truncated array is declined, not read past its end.
        assert_eq!(u32s(&bytes[..bytes.len() - 1]), None);
    }

    // `skip` ends every value where rmpv's reader ends it, and refuses what rmpv refuses.
    #[test]
    fn skip_ends_values_where_rmpv_does() {
        let values = vec![
            Value::Nil,
            Value::from(true),
            Value::from(-7),
            Value::from(u64::MAX),
            Value::F32(1.5),
            Value::F64(-2.5),
            Value::from("x".repeat(40)),
            Value::from("y".repeat(300)),
            Value::Binary(vec![7; 70_000]),
            Value::Ext(3, vec![1, 2, 3, 4]),
            Value::Ext(-2, vec![9; 5]),
            Value::Array((0..20).map(Value::from).collect()),
            Value::Map(vec![(Value::from("k"), Value::Array(vec![Value::Nil; 3]))]),
            Value::Map((0..20).map(|i| (Value::from(i), Value::from(i))).collect()),
        ];
        for v in values {
            let mut bytes = encode(&v);
            let len = bytes.len();
            bytes.extend_from_slice(&[0x01, 0x02]);
            assert_eq!(skip(&bytes, 0, 16).unwrap(), len, "{v:?}");
            for cut in 0..len {
                assert!(skip(&bytes[..cut], 0, 16).is_err(), "{v:?} cut at {cut}");
            }
        }
        assert_eq!(skip(&[0xc1], 0, 16).unwrap(), 1);
        let mut deep = Value::Nil;
        for _ in 0..20 {
            deep = Value::Array(vec![deep]);
        }
        assert!(skip(&encode(&deep), 0, 16).is_err());
        assert!(skip(&[0xdd, 0xff, 0xff, 0xff, 0xff], 0, 16).is_err());
    }
}
