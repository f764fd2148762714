//! The one decoder of vLLM's `KVEventBatch` payloads, into the wire-level types.
//!
//! Unknown fields are ignored and unknown event types kept by their tag, so newer vLLM releases
//! keep decoding. Of duplicate map keys the last one wins, as in a Python dict.

use rmpv::Value;

use super::scan::{self, Shape};
use super::{BlockHash, BlockRemoved, BlockStored, WireBatch, WireEvent};

/// Most nested msgpack levels accepted (real batches use four).
const MAX_DEPTH: usize = 16;

/// Where a value sits in the batch (`events[2].token_ids[5]`), written out only when it is
/// wrong: formatting the place of every value read was most of the decoder's time.
type At<'a> = &'a dyn Fn() -> String;

/// Field order of the tagged-array encoding of `BlockStored` (after the tag).
pub(super) const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// Field order of the tagged-array encoding of `BlockRemoved` (after the tag).
const REMOVED_FIELDS: &[&str] = &[
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// Why a message could not be decoded. The control plane counts it and drops the endpoint's
/// precise state rather than keep a view that may have missed what the message said.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// A KV-event message has three frames.
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame has {0} bytes, expected 8")]
    SeqLength(usize),
    /// The payload is not one msgpack value.
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// Bytes follow the batch.
    #[error("{0} unexpected bytes after the msgpack batch")]
    TrailingBytes(usize),
    /// A value has the wrong msgpack type.
    #[error("{at}: expected {expected}, found {found}")]
    Type {
        /// Where, e.g. `events[2].token_ids[5]`.
        at: String,
        /// What was expected.
        expected: &'static str,
        /// The msgpack type found.
        found: &'static str,
    },
    /// A required field is absent.
    #[error("{at}: missing field `{field}`")]
    Missing {
        /// Where, e.g. `events[0]`.
        at: String,
        /// The field name.
        field: &'static str,
    },
    /// A number does not fit its field.
    #[error("{at}: {value} is out of range ({range})")]
    Range {
        /// Where.
        at: String,
        /// The value as found.
        value: String,
        /// The accepted range.
        range: &'static str,
    },
}

/// Decodes an 8-byte big-endian sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| DecodeError::SeqLength(frame.len()))
}

/// Decodes a msgpack `KVEventBatch` payload, as published by any vLLM version.
///
/// The payload is checked whole first ([`scan::skip`]), so a malformed one fails as not
/// msgpack before any field is read. Containers are then walked as byte slices and only the
/// small fields become `rmpv::Value`s; token ids and integer block hashes are read straight
/// from the bytes ([`scan::u32s`], [`scan::hashes`]), falling back to the `Value` path (and its
/// errors) for anything else.
pub fn decode_batch(payload: &[u8]) -> Result<WireBatch, DecodeError> {
    let end = scan::skip(payload, 0, MAX_DEPTH)?;
    if end != payload.len() {
        return Err(DecodeError::TrailingBytes(payload.len() - end));
    }
    let (ts, events, rank) = match scan::shape(payload)? {
        Shape::Array(a) => (a.first().copied(), a.get(1).copied(), a.get(2).copied()),
        Shape::Map(m) => (
            map_get(&m, "ts"),
            map_get(&m, "events"),
            map_get(&m, "data_parallel_rank"),
        ),
        Shape::Other => return Err(type_error("batch", "array", &value(payload)?)),
    };
    let ts = match ts {
        Some(v) => as_f64(&value(v)?, &|| "batch.ts".into())?,
        None => return Err(missing("batch", "ts")),
    };
    let events = match events {
        Some(v) => match scan::shape(v)? {
            Shape::Array(a) => a,
            _ => return Err(type_error("batch.events", "array", &value(v)?)),
        },
        None => return Err(missing("batch", "events")),
    };
    let data_parallel_rank = match rank.filter(|v| !scan::is_nil(v)) {
        Some(v) => Some(as_u32(&value(v)?, &|| "batch.data_parallel_rank".into())?),
        None => None,
    };
    Ok(WireBatch {
        ts,
        events: events
            .iter()
            .enumerate()
            .map(|(i, e)| decode_event(e, i))
            .collect::<Result<_, _>>()?,
        data_parallel_rank,
    })
}

/// The `rmpv::Value` of a slice [`scan::skip`] accepted.
fn value(mut v: &[u8]) -> Result<Value, DecodeError> {
    rmpv::decode::read_value_with_max_depth(&mut v, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))
}

/// An event's fields as byte slices, whichever encoding it came in.
enum Fields<'a> {
    Map(Vec<(&'a [u8], &'a [u8])>),
    /// The elements after the tag, and their names in order.
    Array(Vec<&'a [u8]>, &'static [&'static str]),
}

impl<'a> Fields<'a> {
    /// The field's value; `None` when absent or nil.
    fn get(&self, name: &str) -> Option<&'a [u8]> {
        let v = match self {
            Fields::Map(m) => map_get(m, name),
            Fields::Array(a, names) => names
                .iter()
                .position(|n| *n == name)
                .and_then(|i| a.get(i + 1).copied()),
        };
        v.filter(|v| !scan::is_nil(v))
    }
}

fn decode_event(event: &[u8], index: usize) -> Result<WireEvent, DecodeError> {
    let at = |field: &str| format!("events[{index}].{field}");
    let tag_of = |v: Option<&[u8]>| -> Result<String, DecodeError> {
        match v.map(value).transpose()? {
            Some(v @ Value::String(_)) => as_str(&v, &|| at("type")).map(str::to_owned),
            Some(other) => Err(type_error(&at("type"), "string", &other)),
            None => Err(missing(&format!("events[{index}]"), "type")),
        }
    };
    let (tag, fields) = match scan::shape(event)? {
        Shape::Map(m) => (tag_of(map_get(&m, "type"))?, Fields::Map(m)),
        Shape::Array(a) => {
            let tag = tag_of(a.first().copied())?;
            let names = match tag.as_str() {
                "BlockStored" => STORED_FIELDS,
                "BlockRemoved" => REMOVED_FIELDS,
                _ => &[],
            };
            (tag, Fields::Array(a, names))
        }
        Shape::Other => {
            return Err(type_error(
                &format!("events[{index}]"),
                "map or array",
                &value(event)?,
            ));
        }
    };
    let required = |field: &'static str| {
        fields
            .get(field)
            .ok_or_else(|| missing(&format!("events[{index}]"), field))
    };
    let opt_str = |field: &str| match fields.get(field) {
        Some(v) => as_str(&value(v)?, &|| at(field)).map(|s| Some(s.to_owned())),
        None => Ok(None),
    };
    let group_idx = match fields.get("group_idx") {
        Some(v) => Some(as_u32(&value(v)?, &|| at("group_idx"))?),
        None => None,
    };
    let block_hashes = |v: &[u8]| match scan::hashes(v) {
        Some(h) => Ok(h.into_iter().map(BlockHash::Int).collect()),
        None => hashes(&value(v)?, &|| at("block_hashes")),
    };
    match tag.as_str() {
        "BlockStored" => Ok(WireEvent::BlockStored(BlockStored {
            block_hashes: block_hashes(required("block_hashes")?)?,
            parent_block_hash: match fields.get("parent_block_hash") {
                Some(v) => Some(block_hash(&value(v)?, &|| at("parent_block_hash"))?),
                None => None,
            },
            token_ids: {
                let v = required("token_ids")?;
                match scan::u32s(v) {
                    Some(ids) => ids,
                    None => match value(v)? {
                        Value::Array(a) => token_ids(&a, index)?,
                        other => return Err(type_error(&at("token_ids"), "array", &other)),
                    },
                }
            },
            block_size: as_u32(&value(required("block_size")?)?, &|| at("block_size"))?,
            lora_id: match fields.get("lora_id") {
                Some(v) => Some(as_u64(&value(v)?, &|| at("lora_id"))?),
                None => None,
            },
            medium: opt_str("medium")?,
            lora_name: opt_str("lora_name")?,
            extra_keys: fields.get("extra_keys").map(value).transpose()?,
            group_idx,
            kv_cache_spec_kind: opt_str("kv_cache_spec_kind")?,
        })),
        "BlockRemoved" => Ok(WireEvent::BlockRemoved(BlockRemoved {
            block_hashes: block_hashes(required("block_hashes")?)?,
            medium: opt_str("medium")?,
            group_idx,
        })),
        "AllBlocksCleared" => Ok(WireEvent::AllBlocksCleared),
        _ => Ok(WireEvent::Unknown(tag)),
    }
}

/// A `token_ids` array. Every id is read on the fast path; an element's location is only
/// formatted for the error when one is not a u32 (formatting it for every id was most of the
/// decoder's time).
fn token_ids(a: &[Value], index: usize) -> Result<Vec<u32>, DecodeError> {
    let mut ids = Vec::with_capacity(a.len());
    for (i, t) in a.iter().enumerate() {
        match t.as_u64().and_then(|x| u32::try_from(x).ok()) {
            Some(id) => ids.push(id),
            None => ids.push(as_u32(t, &|| format!("events[{index}].token_ids[{i}]"))?),
        }
    }
    Ok(ids)
}

fn hashes(v: &Value, at: At<'_>) -> Result<Vec<BlockHash>, DecodeError> {
    match v {
        Value::Array(a) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, h) in a.iter().enumerate() {
                // The common case, an integer hash, without formatting a location.
                match h {
                    Value::Integer(n) if let Some(x) = int_hash(n) => out.push(BlockHash::Int(x)),
                    _ => out.push(block_hash(h, &|| format!("{}[{i}]", at()))?),
                }
            }
            Ok(out)
        }
        other => Err(type_error(&at(), "array", other)),
    }
}

/// An integer block hash as 64 bits: a u64 as is, an i64 (vLLM before 0.10.2) as its two's
/// complement; `None` when it fits neither.
fn int_hash(n: &rmpv::Integer) -> Option<u64> {
    n.as_u64().or_else(|| n.as_i64().map(|x| x as u64))
}

/// A block hash: a u64 as is, an i64 as its two's complement, non-empty bytes as they are.
fn block_hash(v: &Value, at: At<'_>) -> Result<BlockHash, DecodeError> {
    match v {
        Value::Integer(i) => int_hash(i)
            .map(BlockHash::Int)
            .ok_or_else(|| DecodeError::Range {
                at: at(),
                value: i.to_string(),
                range: "64-bit integer",
            }),
        Value::Binary(b) if !b.is_empty() => Ok(BlockHash::Bytes(b.clone())),
        Value::Binary(_) => Err(DecodeError::Range {
            at: at(),
            value: "empty bytes".into(),
            range: "1 or more bytes",
        }),
        other => Err(type_error(&at(), "integer or bytes", other)),
    }
}

fn as_u64(v: &Value, at: At<'_>) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i.as_u64().ok_or_else(|| DecodeError::Range {
            at: at(),
            value: i.to_string(),
            range: "0..=2^64-1",
        }),
        other => Err(type_error(&at(), "integer", other)),
    }
}

fn as_u32(v: &Value, at: At<'_>) -> Result<u32, DecodeError> {
    let x = as_u64(v, at).map_err(|e| match e {
        DecodeError::Range { at, value, .. } => DecodeError::Range {
            at,
            value,
            range: "0..=4294967295",
        },
        e => e,
    })?;
    u32::try_from(x).map_err(|_| DecodeError::Range {
        at: at(),
        value: x.to_string(),
        range: "0..=4294967295",
    })
}

fn as_f64(v: &Value, at: At<'_>) -> Result<f64, DecodeError> {
    match v {
        Value::F64(x) => Ok(*x),
        Value::F32(x) => Ok(f64::from(*x)),
        Value::Integer(i) => i.as_f64().ok_or_else(|| type_error(&at(), "number", v)),
        other => Err(type_error(&at(), "number", other)),
    }
}

fn as_str<'a>(v: &'a Value, at: At<'_>) -> Result<&'a str, DecodeError> {
    match v {
        Value::String(s) => s.as_str().ok_or_else(|| DecodeError::Type {
            at: at(),
            expected: "UTF-8 string",
            found: "invalid UTF-8",
        }),
        other => Err(type_error(&at(), "string", other)),
    }
}

/// The value of `key`; of duplicate keys the last one wins, as in a Python dict. A key matches
/// when it is a msgpack string of the same bytes.
fn map_get<'a>(m: &[(&[u8], &'a [u8])], key: &str) -> Option<&'a [u8]> {
    m.iter()
        .rev()
        .find(|(k, _)| scan::str_bytes(k) == Some(key.as_bytes()))
        .map(|(_, v)| *v)
}

fn missing(at: &str, field: &'static str) -> DecodeError {
    DecodeError::Missing {
        at: at.into(),
        field,
    }
}

fn type_error(at: &str, expected: &'static str, found: &Value) -> DecodeError {
    DecodeError::Type {
        at: at.into(),
        expected,
        found: type_name(found),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "boolean",
        Value::Integer(_) => "integer",
        Value::F32(_) | Value::F64(_) => "float",
        Value::String(_) => "string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "extension",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::test_util::{batch, encode, s, stored_map};

    #[test]
    fn hash_shapes() {
        let at: At<'_> = &|| "h".into();
        assert_eq!(
            block_hash(&Value::from(u64::MAX), at).map(|h| h.to_u64()),
            Ok(u64::MAX)
        );
        assert_eq!(
            block_hash(&Value::from(-1i64), at).map(|h| h.to_u64()),
            Ok(u64::MAX)
        );
        assert_eq!(
            block_hash(&Value::from(-(1i64 << 62)), at).map(|h| h.to_u64()),
            Ok(3 << 62)
        );
        let digest: Vec<u8> = (0..32).collect();
        assert_eq!(
            block_hash(&Value::Binary(digest), at).map(|h| h.to_u64()),
            Ok(u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31]))
        );
        assert_eq!(
            block_hash(&Value::Binary(vec![1, 2]), at).map(|h| h.to_u64()),
            Ok(0x102)
        );
        assert!(block_hash(&Value::Binary(vec![]), at).is_err());
        assert!(block_hash(&s("12"), at).is_err());
    }
    #[test]
    fn malformed_inputs_are_errors_not_panics() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "not msgpack"),
            // 0xc1 is msgpack's "never used" byte, which rmpv reads as nil.
            (vec![0xc1], "batch: expected array, found nil"),
            (vec![0x93, 0x01], "not msgpack"),
            (
                {
                    let mut b = batch(vec![]);
                    b.push(0);
                    b
                },
                "unexpected bytes",
            ),
            (encode(&Value::from(3)), "expected array"),
            (encode(&Value::Array(vec![])), "missing field `ts`"),
            (
                encode(&Value::Array(vec![Value::F64(1.0)])),
                "missing field `events`",
            ),
            (
                encode(&Value::Array(vec![s("x"), Value::Array(vec![])])),
                "batch.ts",
            ),
            (
                encode(&Value::Array(vec![Value::F64(1.0), Value::from(1)])),
                "batch.events",
            ),
            (
                encode(&Value::Array(vec![
                    Value::F64(1.0),
                    Value::Array(vec![]),
                    Value::from(-1),
                ])),
                "data_parallel_rank",
            ),
            (
                batch(vec![Value::from(1)]),
                "events[0]: expected map or array",
            ),
            (batch(vec![Value::Map(vec![])]), "missing field `type`"),
            (batch(vec![Value::Array(vec![])]), "missing field `type`"),
            (
                batch(vec![Value::Array(vec![Value::from(1)])]),
                "events[0].type",
            ),
            (
                batch(vec![Value::Array(vec![s("BlockStored")])]),
                "missing field `block_hashes`",
            ),
            (
                batch(vec![stored_map(vec![(s("block_size"), Value::from(-4))])]),
                "block_size",
            ),
            (
                batch(vec![stored_map(vec![(
                    s("token_ids"),
                    Value::Array(vec![Value::from(1u64 << 40)]),
                )])]),
                "token_ids[0]",
            ),
            (
                batch(vec![stored_map(vec![(s("token_ids"), Value::from(1))])]),
                "token_ids: expected array",
            ),
            (
                batch(vec![stored_map(vec![(
                    s("block_hashes"),
                    Value::Array(vec![Value::F64(1.0)]),
                )])]),
                "block_hashes[0]",
            ),
            (
                batch(vec![stored_map(vec![(s("parent_block_hash"), s("p"))])]),
                "parent_block_hash",
            ),
            (
                batch(vec![stored_map(vec![(s("lora_name"), Value::from(1))])]),
                "lora_name",
            ),
            (
                batch(vec![stored_map(vec![(s("medium"), Value::from(1))])]),
                "medium",
            ),
            (
                batch(vec![stored_map(vec![(s("group_idx"), s("0"))])]),
                "group_idx",
            ),
        ];
        for (bytes, needle) in cases {
            let e = decode_batch(&bytes).unwrap_err().to_string();
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
        // Deep nesting is refused, not recursed into.
        let mut deep = Value::Nil;
        for _ in 0..100 {
            deep = Value::Array(vec![deep]);
        }
        assert!(matches!(
            decode_batch(&encode(&deep)),
            Err(DecodeError::Msgpack(_))
        ));
        // A huge declared length with no data behind it fails fast.
        let huge = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(decode_batch(&huge), Err(DecodeError::Msgpack(_))));
    }

    #[test]
    fn every_prefix_of_a_valid_payload_fails_cleanly() {
        let payload = batch(vec![
            stored_map(vec![(s("medium"), s("GPU"))]),
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        ]);
        for n in 0..payload.len() {
            assert!(decode_batch(&payload[..n]).is_err(), "prefix {n}");
        }
        assert!(decode_batch(&payload).is_ok());
    }

    #[test]
    fn the_wire_view_keeps_what_vllm_sent() {
        let digest: Vec<u8> = (0..32).collect();
        let e = stored_map(vec![
            (
                s("block_hashes"),
                Value::Array(vec![Value::Binary(digest.clone()), Value::from(-5)]),
            ),
            (s("medium"), s("cpu")),
            (s("group_idx"), Value::from(2)),
            (s("kv_cache_spec_kind"), s("sliding_window")),
            (s("extra_keys"), Value::Array(vec![Value::Nil])),
        ]);
        let unknown = Value::Map(vec![(s("type"), s("BlocksMoved"))]);
        let b = decode_batch(&batch(vec![e, unknown])).unwrap();
        assert_eq!(b.data_parallel_rank, Some(0));
        let WireEvent::BlockStored(stored) = &b.events[0] else {
            panic!("{:?}", b.events[0]);
        };
        assert_eq!(
            stored.block_hashes,
            vec![BlockHash::Bytes(digest), BlockHash::Int((-5i64) as u64)]
        );
        assert_eq!(stored.medium.as_deref(), Some("cpu"));
        assert_eq!(stored.group_idx, Some(2));
        assert_eq!(stored.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
        assert_eq!(stored.extra_keys, Some(Value::Array(vec![Value::Nil])));
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(b.events[1], WireEvent::Unknown("BlocksMoved".into()));
    }
}
