//! Pure decoder of one vLLM KV-event ZMQ message: `[topic, seq, payload]`.
//!
//! - `seq` is an 8-byte big-endian counter per publisher (per data-parallel rank);
//! - `payload` is msgpack of vLLM's `KVEventBatch`: `[ts, [event, ...], data_parallel_rank?]`;
//! - an event is a tagged map `{"type": "BlockStored", "block_hashes": [...], ...}` (current
//!   vLLM) or a tagged array `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]`
//!   (older vLLM), trailing optional fields omitted;
//! - a block hash is a u64, an i64 (vLLM < 0.10.2: two's complement) or bytes (a 32-byte
//!   digest when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: its last 8 bytes, big-endian, exactly
//!   what vLLM's own int conversion keeps).
//!
//! A store that starts at block 0 (`parent_block_hash` nil) may carry the request's
//! `cache_salt` in `extra_keys[0]`; see [`cache_salt`] for how it is recognised.
//!
//! Unknown fields are ignored, so newer vLLM releases keep decoding. Stores and removals of
//! non-full-attention KV groups (`group_idx != 0`, or a sliding-window / mamba / ... spec kind)
//! are skipped and counted: only full attention determines a prefix hit. Every malformed input is
//! a [`DecodeError`] naming where it went wrong; nothing here panics.

use rmpv::Value;
use scorer_core::precise::{KvEvent, Medium};

/// Most nested msgpack levels accepted (real batches use four).
const MAX_DEPTH: usize = 16;

/// The replay socket's end-of-replay sequence frame: `-1` as 8 signed big-endian bytes.
pub const END_SEQ: u64 = u64::MAX;

/// Field order of the tagged-array encoding of `BlockStored` (after the tag).
const STORED_FIELDS: &[&str] = &[
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

/// `kv_cache_spec_kind` values whose blocks are full-attention KV (a prefix hit reuses them).
const FULL_ATTENTION_KINDS: &[&str] = &["full_attention", "mla_attention", "sink_full_attention"];

/// Why a message could not be decoded. The subscriber counts it and drops the endpoint's precise
/// state rather than keep a view that may have missed what the message said.
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

/// Events the decoder dropped on purpose, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Events of a KV group other than full attention (hybrid models).
    pub other_groups: u32,
    /// Events of a type this decoder does not know (a newer vLLM).
    pub unknown_types: u32,
}

/// One decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock time of the step, in Unix seconds.
    pub ts: f64,
    /// The data-parallel rank that published it, when stamped.
    pub data_parallel_rank: Option<u32>,
    /// The events that concern the full-attention prefix cache, in order.
    pub events: Vec<KvEvent>,
    /// What was skipped.
    pub skipped: Skipped,
}

/// One decoded ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventMessage {
    /// The publisher's topic (vLLM's `topic`, often empty).
    pub topic: Vec<u8>,
    /// The publisher's sequence number.
    pub seq: u64,
    /// The batch.
    pub batch: EventBatch,
}

/// Decodes a whole PUB message `[topic, seq, payload]`.
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<EventMessage, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    Ok(EventMessage {
        topic: topic.as_ref().to_vec(),
        seq: decode_seq(seq.as_ref())?,
        batch: decode_batch(payload.as_ref())?,
    })
}

/// Decodes an 8-byte big-endian sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| DecodeError::SeqLength(frame.len()))
}

/// Decodes a msgpack `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rest, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    let (ts, events, rank) = match &value {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => (
            map_get(m, "ts"),
            map_get(m, "events"),
            map_get(m, "data_parallel_rank"),
        ),
        other => return Err(type_error("batch", "array", other)),
    };
    let ts = match ts {
        Some(v) => as_f64(v, "batch.ts")?,
        None => {
            return Err(DecodeError::Missing {
                at: "batch".into(),
                field: "ts",
            });
        }
    };
    let events = match events {
        Some(Value::Array(a)) => a,
        Some(other) => return Err(type_error("batch.events", "array", other)),
        None => {
            return Err(DecodeError::Missing {
                at: "batch".into(),
                field: "events",
            });
        }
    };
    let data_parallel_rank = match rank.filter(|v| !v.is_nil()) {
        Some(v) => Some(as_u32(v, "batch.data_parallel_rank")?),
        None => None,
    };
    let mut batch = EventBatch {
        ts,
        data_parallel_rank,
        events: Vec::with_capacity(events.len()),
        skipped: Skipped::default(),
    };
    for (i, event) in events.iter().enumerate() {
        match decode_event(event, i)? {
            Decoded::Event(e) => batch.events.push(e),
            Decoded::OtherGroup => batch.skipped.other_groups += 1,
            Decoded::UnknownType => batch.skipped.unknown_types += 1,
        }
    }
    Ok(batch)
}

enum Decoded {
    Event(KvEvent),
    OtherGroup,
    UnknownType,
}

/// An event's fields, whichever encoding it came in.
enum Fields<'a> {
    Map(&'a [(Value, Value)]),
    Array(&'a [Value], &'static [&'static str]),
}

impl<'a> Fields<'a> {
    /// The field's value; `None` when absent or nil.
    fn get(&self, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Map(m) => map_get(m, name),
            Fields::Array(a, names) => names.iter().position(|n| *n == name).and_then(|i| a.get(i)),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(event: &Value, index: usize) -> Result<Decoded, DecodeError> {
    let at = |field: &str| format!("events[{index}].{field}");
    let (tag, fields) = match event {
        Value::Map(m) => {
            let tag = match map_get(m, "type") {
                Some(Value::String(s)) => s.as_str(),
                Some(other) => return Err(type_error(&at("type"), "string", other)),
                None => {
                    return Err(DecodeError::Missing {
                        at: format!("events[{index}]"),
                        field: "type",
                    });
                }
            };
            (tag, Fields::Map(m))
        }
        Value::Array(a) => {
            let tag = match a.first() {
                Some(Value::String(s)) => s.as_str(),
                Some(other) => return Err(type_error(&at("type"), "string", other)),
                None => {
                    return Err(DecodeError::Missing {
                        at: format!("events[{index}]"),
                        field: "type",
                    });
                }
            };
            let names = match tag {
                Some("BlockStored") => STORED_FIELDS,
                Some("BlockRemoved") => REMOVED_FIELDS,
                _ => &[],
            };
            (tag, Fields::Array(&a[1..], names))
        }
        other => {
            return Err(type_error(
                &format!("events[{index}]"),
                "map or array",
                other,
            ));
        }
    };
    let Some(tag) = tag else {
        return Err(DecodeError::Type {
            at: at("type"),
            expected: "UTF-8 string",
            found: "invalid UTF-8",
        });
    };
    let required = |field: &'static str| {
        fields.get(field).ok_or_else(|| DecodeError::Missing {
            at: format!("events[{index}]"),
            field,
        })
    };
    let group = match fields.get("group_idx") {
        Some(v) => Some(as_u64(v, &at("group_idx"))?),
        None => None,
    };
    let medium = match fields.get("medium") {
        Some(v) => parse_medium(as_str(v, &at("medium"))?),
        None => Medium::Gpu,
    };
    match tag {
        "BlockStored" => {
            let kind = match fields.get("kv_cache_spec_kind") {
                Some(v) => Some(as_str(v, &at("kv_cache_spec_kind"))?),
                None => None,
            };
            if group.is_some_and(|g| g != 0)
                || kind.is_some_and(|k| !FULL_ATTENTION_KINDS.contains(&k))
            {
                return Ok(Decoded::OtherGroup);
            }
            let block_hashes = hashes(required("block_hashes")?, &at("block_hashes"))?;
            let parent_block_hash = match fields.get("parent_block_hash") {
                Some(v) => Some(block_hash(v, &at("parent_block_hash"))?),
                None => None,
            };
            let token_ids = match required("token_ids")? {
                Value::Array(a) => a
                    .iter()
                    .enumerate()
                    .map(|(i, t)| as_u32(t, &format!("events[{index}].token_ids[{i}]")))
                    .collect::<Result<Vec<u32>, _>>()?,
                other => return Err(type_error(&at("token_ids"), "array", other)),
            };
            let block_size = as_u32(required("block_size")?, &at("block_size"))?;
            let lora_name = match fields.get("lora_name") {
                Some(v) => Some(as_str(v, &at("lora_name"))?.to_owned()),
                None => None,
            };
            let cache_salt = match parent_block_hash {
                None => cache_salt(fields.get("extra_keys"), lora_name.as_deref()),
                Some(_) => None,
            };
            Ok(Decoded::Event(KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                medium,
            }))
        }
        "BlockRemoved" => {
            if group.is_some_and(|g| g != 0) {
                return Ok(Decoded::OtherGroup);
            }
            let block_hashes = hashes(required("block_hashes")?, &at("block_hashes"))?;
            Ok(Decoded::Event(KvEvent::BlockRemoved {
                block_hashes,
                medium,
            }))
        }
        "AllBlocksCleared" => Ok(Decoded::Event(KvEvent::AllBlocksCleared)),
        _ => Ok(Decoded::UnknownType),
    }
}

/// The `cache_salt` in a block-0 store's `extra_keys` (`list[tuple | None]`, one entry per
/// block), or `None`.
///
/// vLLM (0.18 and later) publishes block 0's extra keys *untagged*, in the order it hashes them:
/// the LoRA name (a string), multimodal `(identifier, offset)` pairs (arrays), the cache salt (a
/// string), a prompt-embeds digest (bytes). So the salt is the last string of `extra_keys[0]`
/// once one occurrence of the event's `lora_name` is set aside: `[salt]` without a LoRA,
/// `[lora, salt]` with one (even when the two are equal), `[lora]` is no salt.
///
/// Ambiguities, which the untagged wire format leaves no way to settle:
/// - a LoRA store whose `lora_name` field is nil but whose name is in the extra keys would
///   read the name as a salt (vLLM sets both together, so this does not occur in practice);
/// - a vLLM that published a multimodal key as a bare identifier string would have it read as
///   a salt. The blocks are then keyed by a seed no request uses, which costs a missed hit,
///   never a false one.
///
/// Unknown shapes (not an array, non-string members, invalid UTF-8) carry no salt: the extra
/// keys are advisory, and a store is still worth indexing without them.
fn cache_salt(extra_keys: Option<&Value>, lora_name: Option<&str>) -> Option<String> {
    let Some(Value::Array(per_block)) = extra_keys else {
        return None;
    };
    let Some(Value::Array(keys)) = per_block.first() else {
        return None;
    };
    let mut lora_seen = lora_name.is_none();
    let mut salt = None;
    for key in keys {
        let Value::String(text) = key else { continue };
        let Some(text) = text.as_str() else { continue };
        if !lora_seen && Some(text) == lora_name {
            lora_seen = true;
            continue;
        }
        salt = Some(text);
    }
    salt.filter(|s| !s.is_empty()).map(str::to_owned)
}

/// vLLM's tier names; an unknown tier counts as the slowest one (never as GPU).
fn parse_medium(s: &str) -> Medium {
    if s.eq_ignore_ascii_case("GPU") {
        Medium::Gpu
    } else if s.eq_ignore_ascii_case("CPU") {
        Medium::Cpu
    } else {
        Medium::Storage
    }
}

fn hashes(v: &Value, at: &str) -> Result<Vec<u64>, DecodeError> {
    match v {
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, h)| block_hash(h, &format!("{at}[{i}]")))
            .collect(),
        other => Err(type_error(at, "array", other)),
    }
}

/// A block hash as vLLM's consumers see it: u64 as is, i64 as two's complement, bytes as the
/// low 64 bits of the big-endian integer (`int.from_bytes(b, "big") & (2**64 - 1)`).
fn block_hash(v: &Value, at: &str) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| DecodeError::Range {
                at: at.into(),
                value: i.to_string(),
                range: "64-bit integer",
            }),
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        Value::Binary(_) => Err(DecodeError::Range {
            at: at.into(),
            value: "empty bytes".into(),
            range: "1 or more bytes",
        }),
        other => Err(type_error(at, "integer or bytes", other)),
    }
}

fn as_u64(v: &Value, at: &str) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i.as_u64().ok_or_else(|| DecodeError::Range {
            at: at.into(),
            value: i.to_string(),
            range: "0..=2^64-1",
        }),
        other => Err(type_error(at, "integer", other)),
    }
}

fn as_u32(v: &Value, at: &str) -> Result<u32, DecodeError> {
    let x = as_u64(v, at).map_err(|e| match e {
        DecodeError::Range { at, value, .. } => DecodeError::Range {
            at,
            value,
            range: "0..=4294967295",
        },
        e => e,
    })?;
    u32::try_from(x).map_err(|_| DecodeError::Range {
        at: at.into(),
        value: x.to_string(),
        range: "0..=4294967295",
    })
}

fn as_f64(v: &Value, at: &str) -> Result<f64, DecodeError> {
    match v {
        Value::F64(x) => Ok(*x),
        Value::F32(x) => Ok(f64::from(*x)),
        Value::Integer(i) => i.as_f64().ok_or_else(|| type_error(at, "number", v)),
        other => Err(type_error(at, "number", other)),
    }
}

fn as_str<'a>(v: &'a Value, at: &str) -> Result<&'a str, DecodeError> {
    match v {
        Value::String(s) => s.as_str().ok_or_else(|| DecodeError::Type {
            at: at.into(),
            expected: "UTF-8 string",
            found: "invalid UTF-8",
        }),
        other => Err(type_error(at, "string", other)),
    }
}

/// The value of `key`; of duplicate keys the last one wins, as in a Python dict.
fn map_get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .rev()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
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

    fn encode(v: &Value) -> Vec<u8> {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, v).unwrap();
        buf
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn batch(events: Vec<Value>) -> Vec<u8> {
        encode(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(events),
            Value::from(0),
        ]))
    }

    fn stored_map(extra: Vec<(Value, Value)>) -> Value {
        let mut m = vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::from(1)])),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![Value::from(5); 4])),
            (s("block_size"), Value::from(4)),
        ];
        m.extend(extra);
        Value::Map(m)
    }

    #[test]
    fn seq_and_frames() {
        assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
        assert_eq!(decode_seq(&[0xff; 8]), Ok(END_SEQ));
        assert_eq!(decode_seq(&[1, 2]), Err(DecodeError::SeqLength(2)));
        let frames: [&[u8]; 2] = [b"", b""];
        assert_eq!(decode_message(&frames), Err(DecodeError::Frames(2)));
        let payload = batch(vec![]);
        let m = decode_message(&[&b"kv@x"[..], &7u64.to_be_bytes(), &payload]).unwrap();
        assert_eq!((m.topic.as_slice(), m.seq), (&b"kv@x"[..], 7));
        assert_eq!(m.batch.data_parallel_rank, Some(0));
    }

    #[test]
    fn hash_shapes() {
        let at = "h";
        assert_eq!(block_hash(&Value::from(u64::MAX), at), Ok(u64::MAX));
        assert_eq!(block_hash(&Value::from(-1i64), at), Ok(u64::MAX));
        assert_eq!(block_hash(&Value::from(-(1i64 << 62)), at), Ok(3 << 62));
        let digest: Vec<u8> = (0..32).collect();
        assert_eq!(
            block_hash(&Value::Binary(digest), at),
            Ok(u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31]))
        );
        assert_eq!(block_hash(&Value::Binary(vec![1, 2]), at), Ok(0x102));
        assert!(block_hash(&Value::Binary(vec![]), at).is_err());
        assert!(block_hash(&s("12"), at).is_err());
    }

    #[test]
    fn unknown_fields_and_types_are_tolerated() {
        let e = stored_map(vec![(s("future_field"), Value::Array(vec![s("x")]))]);
        let unknown = Value::Map(vec![
            (s("type"), s("BlocksMoved")),
            (s("x"), Value::from(1)),
        ]);
        let b = decode_batch(&batch(vec![e, unknown, Value::Array(vec![s("Nope")])])).unwrap();
        assert_eq!(b.events.len(), 1);
        assert_eq!(b.skipped.unknown_types, 2);
    }

    fn salt_of(extra: Vec<(Value, Value)>) -> Option<String> {
        let b = decode_batch(&batch(vec![stored_map(extra)])).unwrap();
        match &b.events[0] {
            KvEvent::BlockStored { cache_salt, .. } => cache_salt.clone(),
            other => panic!("not a store: {other:?}"),
        }
    }

    #[test]
    fn the_cache_salt_is_the_last_string_of_block_zero_besides_the_lora() {
        let keys = |k: Vec<Value>| (s("extra_keys"), Value::Array(vec![Value::Array(k)]));
        let lora = |n: &str| (s("lora_name"), s(n));
        assert_eq!(salt_of(vec![]), None);
        assert_eq!(salt_of(vec![keys(vec![s("t1")])]), Some("t1".into()));
        assert_eq!(salt_of(vec![keys(vec![s("sql")]), lora("sql")]), None);
        assert_eq!(
            salt_of(vec![keys(vec![s("sql"), s("t1")]), lora("sql")]),
            Some("t1".into())
        );
        assert_eq!(
            salt_of(vec![keys(vec![s("sql"), s("sql")]), lora("sql")]),
            Some("sql".into()),
            "a salt equal to the adapter name is the second occurrence"
        );
        // LoRA, a multimodal (identifier, offset) pair, the salt, a prompt-embeds digest.
        let mm = Value::Array(vec![s("img-hash"), Value::from(3)]);
        assert_eq!(
            salt_of(vec![
                keys(vec![s("sql"), mm, s("t1"), Value::Binary(vec![1; 32])]),
                lora("sql")
            ]),
            Some("t1".into())
        );
        // vLLM's usual shape: one entry per block, nil after block 0.
        assert_eq!(
            salt_of(vec![(
                s("extra_keys"),
                Value::Array(vec![Value::Array(vec![s("t1")]), Value::Nil])
            )]),
            Some("t1".into())
        );
    }

    #[test]
    fn malformed_extra_keys_carry_no_salt_and_never_fail_the_event() {
        for extra in [
            Value::Nil,
            s("t1"),
            Value::from(7),
            Value::Array(vec![]),
            Value::Array(vec![Value::Nil]),
            Value::Array(vec![s("t1")]),
            Value::Array(vec![Value::Map(vec![(s("salt"), s("t1"))])]),
            Value::Array(vec![Value::Array(vec![
                Value::from(1),
                Value::Binary(vec![]),
            ])]),
            Value::Array(vec![Value::Array(vec![s("")])]),
            // A msgpack str of invalid UTF-8.
            Value::Array(vec![Value::Array(vec![
                rmpv::decode::read_value(&mut &[0xa2, 0xff, 0xfe][..]).unwrap(),
            ])]),
        ] {
            assert_eq!(
                salt_of(vec![(s("extra_keys"), extra.clone())]),
                None,
                "{extra:?}"
            );
        }
    }

    #[test]
    fn only_a_run_from_block_zero_carries_the_salt() {
        let mut e = stored_map(vec![(
            s("extra_keys"),
            Value::Array(vec![Value::Array(vec![s("t1")])]),
        )]);
        if let Value::Map(m) = &mut e {
            m[2].1 = Value::from(9);
        }
        let b = decode_batch(&batch(vec![e])).unwrap();
        let KvEvent::BlockStored {
            cache_salt,
            parent_block_hash,
            ..
        } = &b.events[0]
        else {
            panic!("not a store");
        };
        assert_eq!((*parent_block_hash, cache_salt.as_deref()), (Some(9), None));
    }

    #[test]
    fn medium_spellings() {
        for (m, want) in [
            (Value::Nil, Medium::Gpu),
            (s("gpu"), Medium::Gpu),
            (s("CPU"), Medium::Cpu),
            (s("STORAGE"), Medium::Storage),
            (s("NVME"), Medium::Storage),
        ] {
            let b = decode_batch(&batch(vec![stored_map(vec![(s("medium"), m)])])).unwrap();
            let KvEvent::BlockStored { medium, .. } = &b.events[0] else {
                panic!()
            };
            assert_eq!(*medium, want);
        }
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
}
