//! The router's view of a batch: what precise routing applies, derived from the wire events.
//!
//! A store that starts at block 0 (`parent_block_hash` nil) may carry the request's
//! `cache_salt` in `extra_keys[0]`; see [`cache_salt`] for how it is recognised. Stores and
//! removals of non-full-attention KV groups (`group_idx != 0`, or a sliding-window / mamba / ...
//! spec kind) are skipped and counted: only full attention determines a prefix hit.

use rmpv::Value;
use scorer_core::precise::{KvEvent, Medium};

use super::{BlockHash, BlockStored, DecodeError, WireBatch, WireEvent, decode_batch, decode_seq};

/// `kv_cache_spec_kind` values whose blocks are full-attention KV (a prefix hit reuses them).
pub const FULL_ATTENTION_KINDS: &[&str] =
    &["full_attention", "mla_attention", "sink_full_attention"];

/// Events left out of the router's view on purpose, by reason, so they can be counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Events of a KV group other than full attention (hybrid models).
    pub other_groups: u32,
    /// Of those, the stores (`BlockStored`): a stream whose every store is one says nothing
    /// the index can use.
    pub other_group_stores: u32,
    /// Events of a type this crate does not know (a newer vLLM).
    pub unknown_types: u32,
}

/// One batch as the router applies it.
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

impl From<WireBatch> for EventBatch {
    fn from(wire: WireBatch) -> Self {
        let mut batch = EventBatch {
            ts: wire.ts,
            data_parallel_rank: wire.data_parallel_rank,
            events: Vec::with_capacity(wire.events.len()),
            skipped: Skipped::default(),
        };
        let u64s = |hs: Vec<BlockHash>| hs.iter().map(BlockHash::to_u64).collect();
        for event in wire.events {
            match event {
                WireEvent::BlockStored(s) if !full_attention(&s) => {
                    batch.skipped.other_groups += 1;
                    batch.skipped.other_group_stores += 1;
                }
                WireEvent::BlockStored(s) => {
                    let cache_salt = match s.parent_block_hash {
                        None => cache_salt(s.extra_keys.as_ref(), s.lora_name.as_deref()),
                        Some(_) => None,
                    };
                    batch.events.push(KvEvent::BlockStored {
                        block_hashes: u64s(s.block_hashes),
                        parent_block_hash: s.parent_block_hash.as_ref().map(BlockHash::to_u64),
                        token_ids: s.token_ids,
                        block_size: s.block_size,
                        lora_name: s.lora_name,
                        cache_salt,
                        medium: parse_medium(s.medium.as_deref()),
                    });
                }
                WireEvent::BlockRemoved(r) if r.group_idx.is_some_and(|g| g != 0) => {
                    batch.skipped.other_groups += 1
                }
                WireEvent::BlockRemoved(r) => batch.events.push(KvEvent::BlockRemoved {
                    block_hashes: u64s(r.block_hashes),
                    medium: parse_medium(r.medium.as_deref()),
                }),
                WireEvent::AllBlocksCleared => batch.events.push(KvEvent::AllBlocksCleared),
                WireEvent::Unknown(_) => batch.skipped.unknown_types += 1,
            }
        }
        batch
    }
}

/// Whether a store is of the full-attention KV group (group 0, and a full-attention spec kind
/// when one is published).
fn full_attention(s: &BlockStored) -> bool {
    s.group_idx.is_none_or(|g| g == 0)
        && s.kv_cache_spec_kind
            .as_deref()
            .is_none_or(|k| FULL_ATTENTION_KINDS.contains(&k))
}

/// One decoded ZMQ message, in the router's view.
#[derive(Debug, Clone, PartialEq)]
pub struct EventMessage {
    /// The publisher's topic (vLLM's `topic`, often empty).
    pub topic: Vec<u8>,
    /// The publisher's sequence number.
    pub seq: u64,
    /// The batch.
    pub batch: EventBatch,
}

/// Decodes a msgpack `KVEventBatch` payload into the router's view.
pub fn decode_event_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    decode_batch(payload).map(EventBatch::from)
}

/// Decodes a whole PUB message `[topic, seq, payload]` into the router's view.
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<EventMessage, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    Ok(EventMessage {
        topic: topic.as_ref().to_vec(),
        seq: decode_seq(seq.as_ref())?,
        batch: decode_event_batch(payload.as_ref())?,
    })
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
pub fn cache_salt(extra_keys: Option<&Value>, lora_name: Option<&str>) -> Option<String> {
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

/// vLLM's tier names (any case); absent means GPU (vLLM before the field existed), and an
/// unknown tier counts as the slowest one, never as GPU.
pub fn parse_medium(medium: Option<&str>) -> Medium {
    match medium {
        None => Medium::Gpu,
        Some(s) if s.eq_ignore_ascii_case("GPU") => Medium::Gpu,
        Some(s) if s.eq_ignore_ascii_case("CPU") => Medium::Cpu,
        Some(_) => Medium::Storage,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::END_SEQ;
    use crate::kv_events::test_util::{batch, s, stored_map};

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
    fn unknown_fields_and_types_are_tolerated() {
        let e = stored_map(vec![(s("future_field"), Value::Array(vec![s("x")]))]);
        let unknown = Value::Map(vec![
            (s("type"), s("BlocksMoved")),
            (s("x"), Value::from(1)),
        ]);
        let b =
            decode_event_batch(&batch(vec![e, unknown, Value::Array(vec![s("Nope")])])).unwrap();
        assert_eq!(b.events.len(), 1);
        assert_eq!(b.skipped.unknown_types, 2);
    }

    fn salt_of(extra: Vec<(Value, Value)>) -> Option<String> {
        let b = decode_event_batch(&batch(vec![stored_map(extra)])).unwrap();
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
        let b = decode_event_batch(&batch(vec![e])).unwrap();
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
            let b = decode_event_batch(&batch(vec![stored_map(vec![(s("medium"), m)])])).unwrap();
            let KvEvent::BlockStored { medium, .. } = &b.events[0] else {
                panic!()
            };
            assert_eq!(*medium, want);
        }
    }
}
