//! The encoder: a [`WireBatch`] as vLLM 0.33's `msgspec` encoder writes it, byte for byte.
//!
//! msgspec writes a struct's fields in declaration order and, with `omit_defaults`, leaves out
//! the optional ones that hold their default (`None`). vLLM 0.33's required fields are always
//! written (nil when `None`): for `BlockStored` `block_hashes`, `parent_block_hash`,
//! `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`; for `BlockRemoved`
//! `block_hashes`, `medium`. `extra_keys`, `group_idx` and `kv_cache_spec_kind` are written only
//! when set. Integers take their shortest msgpack form, as msgspec's do; an [`BlockHash::Int`]
//! is written unsigned (vLLM 0.33 publishes no negative hashes).
//!
//! Also what a publisher's replay socket answers ([`replay_messages`], [`replay_end`]).

use rmpv::Value;

use super::{BlockHash, BlockRemoved, BlockStored, END_SEQ, WireBatch, WireEvent};

/// Msgpack payload of one batch: `[ts, [events...], data_parallel_rank]`, byte for byte what
/// vLLM 0.33's `msgspec` encoder writes for the same events (an unset rank is written as nil).
pub fn encode_batch(batch: &WireBatch) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + batch.events.len() * 96);
    write_array_len(&mut buf, 3);
    write(&mut buf, &Value::F64(batch.ts));
    write_array_len(&mut buf, batch.events.len());
    for event in &batch.events {
        let (fields, map16) = event_fields(event);
        // msgspec sizes a struct's map header for all its fields plus the tag, then fills in
        // the count it wrote: `BlockStored` (15 fields) gets a map16 header even when fewer
        // fields are set; the smaller events get a fixmap.
        if map16 {
            buf.push(0xde);
            buf.extend_from_slice(&(fields.len() as u16).to_be_bytes());
        } else {
            buf.push(0x80 | fields.len() as u8);
        }
        for (k, v) in &fields {
            write(&mut buf, &Value::from(*k));
            write(&mut buf, v);
        }
    }
    write(
        &mut buf,
        &batch.data_parallel_rank.map_or(Value::Nil, Value::from),
    );
    buf
}

/// An event's `(name, value)` pairs in vLLM's field order, tag first, and whether its struct
/// needs a map16 header.
fn event_fields(event: &WireEvent) -> (Vec<(&'static str, Value)>, bool) {
    let s = |x: &str| Value::from(x);
    let opt_str = |x: &Option<String>| x.as_deref().map_or(Value::Nil, s);
    match event {
        WireEvent::BlockStored(BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
        }) => {
            let mut f = vec![
                ("type", s("BlockStored")),
                ("block_hashes", hashes(block_hashes)),
                (
                    "parent_block_hash",
                    parent_block_hash.as_ref().map_or(Value::Nil, hash),
                ),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", lora_id.map_or(Value::Nil, Value::from)),
                ("medium", opt_str(medium)),
                ("lora_name", opt_str(lora_name)),
            ];
            if let Some(k) = extra_keys {
                f.push(("extra_keys", k.clone()));
            }
            if let Some(g) = group_idx {
                f.push(("group_idx", Value::from(*g)));
            }
            if let Some(k) = kv_cache_spec_kind {
                f.push(("kv_cache_spec_kind", s(k)));
            }
            (f, true)
        }
        WireEvent::BlockRemoved(BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        }) => {
            let mut f = vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", hashes(block_hashes)),
                ("medium", opt_str(medium)),
            ];
            if let Some(g) = group_idx {
                f.push(("group_idx", Value::from(*g)));
            }
            (f, false)
        }
        WireEvent::AllBlocksCleared => (vec![("type", s("AllBlocksCleared"))], false),
        WireEvent::Unknown(tag) => (vec![("type", s(tag))], false),
    }
}

fn hash(h: &BlockHash) -> Value {
    match h {
        BlockHash::Int(n) => Value::from(*n),
        BlockHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn hashes(hs: &[BlockHash]) -> Value {
    Value::Array(hs.iter().map(hash).collect())
}

/// A store's `extra_keys` as vLLM publishes them: one entry per block, each the block's extra
/// hash keys untagged, in vLLM's order (LoRA name, multimodal keys, cache salt, prompt-embeds
/// digest), or nil for a block without any. The salt belongs to block 0 only, so pass it only
/// when the run starts there: `[[lora?, salt], [lora]|nil, ...]`. [`super::cache_salt`] reads
/// it back.
pub fn block_extra_keys(blocks: usize, lora_name: Option<&str>, cache_salt: Option<&str>) -> Value {
    Value::Array(
        (0..blocks)
            .map(|i| {
                let keys: Vec<Value> = lora_name
                    .into_iter()
                    .chain(cache_salt.filter(|_| i == 0))
                    .map(Value::from)
                    .collect();
                if keys.is_empty() {
                    Value::Nil
                } else {
                    Value::Array(keys)
                }
            })
            .collect(),
    )
}

fn write(buf: &mut Vec<u8>, v: &Value) {
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(buf, v);
}

fn write_array_len(buf: &mut Vec<u8>, n: usize) {
    if n < 16 {
        buf.push(0x90 | n as u8);
    } else if let Ok(n) = u16::try_from(n) {
        buf.push(0xdc);
        buf.extend_from_slice(&n.to_be_bytes());
    } else {
        buf.push(0xdd);
        buf.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

/// The messages a replay socket answers a request `[identity, "", start_seq]` with, before the
/// end marker: every buffered `(seq, payload)` with `seq >= start`, as
/// `[identity, "", topic, seq, payload]`, as vLLM's `ZmqEventPublisher` replays. Generic over
/// the frame type (`bytes::Bytes` for zeromq) so that this crate stays sans-IO while vllm-sim and
/// the control plane's fake publisher share one replay answer.
pub fn replay_messages<F>(
    identity: &F,
    topic: &F,
    start: u64,
    buffer: impl IntoIterator<Item = (u64, F)>,
) -> Vec<Vec<F>>
where
    F: Clone + Default + From<Vec<u8>>,
{
    buffer
        .into_iter()
        .filter(|(seq, _)| *seq >= start)
        .map(|(seq, payload)| {
            let seq = F::from(seq.to_be_bytes().to_vec());
            vec![identity.clone(), F::default(), topic.clone(), seq, payload]
        })
        .collect()
}

/// The replay socket's end marker for `identity`: `[identity, "", "", END_SEQ, ""]`.
pub fn replay_end<F>(identity: &F) -> Vec<F>
where
    F: Clone + Default + From<Vec<u8>>,
{
    let end = F::from(END_SEQ.to_be_bytes().to_vec());
    vec![
        identity.clone(),
        F::default(),
        F::default(),
        end,
        F::default(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::decode::STORED_FIELDS;
    use crate::kv_events::{cache_salt, decode_batch};

    fn stored(hashes: &[u64], parent: Option<u64>, blocks_of: u32) -> BlockStored {
        BlockStored {
            extra_keys: Some(block_extra_keys(hashes.len(), None, None)),
            group_idx: Some(0),
            ..BlockStored::on_gpu(
                hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
                parent.map(BlockHash::Int),
                (0..blocks_of * hashes.len() as u32).collect(),
                blocks_of,
            )
        }
    }

    #[test]
    fn batch_shape_matches_vllm() {
        let batch = WireBatch {
            ts: 1.5,
            events: vec![
                WireEvent::BlockStored(stored(&[u64::MAX, 7], None, 16)),
                WireEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        let bytes = encode_batch(&batch);
        let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 3);
        assert_eq!(arr[0].as_f64(), Some(1.5));
        assert_eq!(arr[2].as_u64(), Some(0));
        let events = arr[1].as_array().unwrap();
        let stored = events[0].as_map().unwrap();
        let keys: Vec<&str> = stored.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        // The tag, then vLLM's fields in declaration order up to `group_idx`.
        let mut want = vec!["type"];
        want.extend(&STORED_FIELDS[..9]);
        assert_eq!(keys, want);
        // The map16 header msgspec gives a 15-field struct, then a fixmap.
        let tagged = bytes.windows(3).position(|w| w == [0xde, 0, 10]);
        assert!(tagged.is_some(), "map16 header for BlockStored");
        assert_eq!(
            events[1].as_map().unwrap()[0].1.as_str(),
            Some("AllBlocksCleared")
        );
        assert_eq!(decode_batch(&bytes).unwrap(), batch);
    }

    #[test]
    fn decodes_what_it_encodes() {
        let mut lora = stored(&[1, u64::MAX], Some(9), 16);
        lora.lora_id = Some(2);
        lora.lora_name = Some("sql".into());
        lora.extra_keys = Some(block_extra_keys(2, Some("sql"), None));
        lora.kv_cache_spec_kind = Some("full_attention".into());
        let mut bare = stored(&[3], None, 4);
        (bare.medium, bare.extra_keys, bare.group_idx) = (None, None, None);
        bare.block_hashes = vec![BlockHash::Bytes((0..32).collect())];
        let batch = WireBatch {
            ts: 2.5,
            events: vec![
                WireEvent::BlockStored(lora),
                WireEvent::BlockStored(bare),
                WireEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![BlockHash::Int(u64::MAX)],
                    medium: Some("CPU".into()),
                    group_idx: Some(0),
                }),
                WireEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![],
                    medium: None,
                    group_idx: None,
                }),
                WireEvent::AllBlocksCleared,
                WireEvent::Unknown("BlocksMoved".into()),
            ],
            data_parallel_rank: Some(1),
        };
        let bytes = encode_batch(&batch);
        assert_eq!(decode_batch(&bytes).unwrap(), batch);
        let unranked = WireBatch {
            data_parallel_rank: None,
            ..batch
        };
        assert_eq!(decode_batch(&encode_batch(&unranked)).unwrap(), unranked);
    }

    #[test]
    fn the_cache_salt_is_in_block_zeros_extra_keys_only() {
        let s = |x: &str| Value::from(x);
        let arr = Value::Array;
        assert_eq!(
            block_extra_keys(3, None, Some("t1")),
            arr(vec![arr(vec![s("t1")]), Value::Nil, Value::Nil])
        );
        let lora = arr(vec![s("sql")]);
        let keys = block_extra_keys(3, Some("sql"), Some("t1"));
        assert_eq!(
            keys,
            arr(vec![arr(vec![s("sql"), s("t1")]), lora.clone(), lora])
        );
        assert_eq!(block_extra_keys(0, Some("sql"), Some("t1")), arr(vec![]));
        // What the encoder side writes, the router side reads back.
        assert_eq!(cache_salt(Some(&keys), Some("sql")).as_deref(), Some("t1"));
        let no_salt = block_extra_keys(2, Some("sql"), None);
        assert_eq!(cache_salt(Some(&no_salt), Some("sql")), None);
    }

    #[test]
    fn a_replay_answers_from_the_start_seq_and_ends_with_the_marker() {
        let f = |b: &[u8]| b.to_vec();
        let buffer = [(3, f(b"c")), (4, f(b"d")), (5, f(b"e"))];
        let answer = replay_messages(&f(b"id"), &f(b"kv"), 4, buffer.iter().cloned());
        let seq = |n: u64| n.to_be_bytes().to_vec();
        assert_eq!(
            answer,
            [
                vec![f(b"id"), f(b""), f(b"kv"), seq(4), f(b"d")],
                vec![f(b"id"), f(b""), f(b"kv"), seq(5), f(b"e")],
            ]
        );
        assert_eq!(
            replay_end(&f(b"id")),
            [f(b"id"), f(b""), f(b""), vec![0xff; 8], f(b"")]
        );
    }
}
