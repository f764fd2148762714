//! The KV-event decoder the control plane and vllm-sim share (`vllm_wire::kv_events`, a sans-IO
//! crate: no tokio or zeromq under ASan) on arbitrary ZMQ frames, and on well-formed
//! vLLM `KVEventBatch`es (map and tagged-array encodings) built from arbitrary values, whose
//! events are then applied to a precise-mode `Router`. A publisher can send anything: decoding
//! and applying must end in a value or an error, never a panic, a batch we encoded must
//! decode to the same number of events, and the encoder must round-trip what the decoder read.

use arbitrary::Arbitrary;
use rmpv::Value;
use scorer_core::protocol::RouteRequest;
use scorer_core::router::{Router, RouterConfig};
use vllm_wire::kv_events as decode;

#[derive(Arbitrary, Debug)]
enum Ev {
    Stored {
        hashes: Vec<u8>,
        parent: Option<u8>,
        tokens_per_block: u8,
        block_size: u8,
        lora: Option<String>,
        medium: Option<u8>,
        group: Option<u8>,
        extra_keys: Option<Vec<Option<Vec<Key>>>>,
    },
    Removed {
        hashes: Vec<u8>,
        medium: Option<u8>,
    },
    Cleared,
    Unknown(String),
}

/// One untagged extra key as vLLM publishes them (LoRA name or cache salt, a multimodal pair,
/// a prompt-embeds digest), or a shape it never sends.
#[derive(Arbitrary, Debug)]
enum Key {
    Text(String),
    Mm(String, u8),
    Digest(Vec<u8>),
    Int(i64),
    Nil,
}

fn key(k: &Key) -> Value {
    match k {
        Key::Text(s) => Value::from(s.as_str()),
        Key::Mm(id, offset) => Value::Array(vec![Value::from(id.as_str()), Value::from(*offset)]),
        Key::Digest(b) => Value::Binary(b.clone()),
        Key::Int(i) => Value::from(*i),
        Key::Nil => Value::Nil,
    }
}

#[derive(Arbitrary, Debug)]
enum Input {
    Frames(Vec<Vec<u8>>),
    Payload(Vec<u8>),
    Batch {
        as_maps: bool,
        negative_hashes: bool,
        ts: f64,
        rank: Option<u8>,
        events: Vec<Ev>,
    },
}

fn medium(m: Option<u8>) -> Value {
    match m {
        None => Value::Nil,
        Some(0) => "GPU".into(),
        Some(1) => "CPU".into(),
        Some(2) => "DISK".into(),
        Some(n) => Value::from(u64::from(n)),
    }
}

fn hash(h: u8, negative: bool) -> Value {
    let v = u64::from(h).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    if negative {
        Value::from(v as i64)
    } else {
        Value::from(v)
    }
}

fn event(e: &Ev, maps: bool, neg: bool) -> Value {
    let tagged = |tag: &str, fields: Vec<(&str, Value)>| {
        if maps {
            let mut m = vec![(Value::from("type"), Value::from(tag))];
            m.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
            Value::Map(m)
        } else {
            let mut a = vec![Value::from(tag)];
            a.extend(fields.into_iter().map(|(_, v)| v));
            Value::Array(a)
        }
    };
    match e {
        Ev::Stored {
            hashes,
            parent,
            tokens_per_block,
            block_size,
            lora,
            medium: m,
            group,
            extra_keys,
        } => {
            let tokens: Vec<Value> = (0..hashes.len() * usize::from(*tokens_per_block % 17))
                .map(|t| Value::from(t as u64))
                .collect();
            let mut fields = vec![
                (
                    "block_hashes",
                    Value::Array(hashes.iter().map(|h| hash(*h, neg)).collect()),
                ),
                (
                    "parent_block_hash",
                    parent.map_or(Value::Nil, |p| hash(p, neg)),
                ),
                ("token_ids", Value::Array(tokens)),
                ("block_size", Value::from(u64::from(*block_size % 17))),
                ("lora_id", Value::Nil),
                ("medium", medium(*m)),
                ("lora_name", lora.clone().map_or(Value::Nil, Value::from)),
            ];
            let extra = extra_keys.as_ref().map_or(Value::Nil, |blocks| {
                Value::Array(
                    blocks
                        .iter()
                        .map(|b| {
                            b.as_ref()
                                .map_or(Value::Nil, |ks| Value::Array(ks.iter().map(key).collect()))
                        })
                        .collect(),
                )
            });
            if let Some(g) = group {
                fields.push(("extra_keys", extra));
                fields.push(("group_idx", Value::from(u64::from(*g % 3))));
            } else if !extra.is_nil() {
                fields.push(("extra_keys", extra));
            }
            tagged("BlockStored", fields)
        }
        Ev::Removed { hashes, medium: m } => tagged(
            "BlockRemoved",
            vec![
                (
                    "block_hashes",
                    Value::Array(hashes.iter().map(|h| hash(*h, neg)).collect()),
                ),
                ("medium", medium(*m)),
            ],
        ),
        Ev::Cleared => tagged("AllBlocksCleared", vec![]),
        Ev::Unknown(tag) => tagged(tag, vec![("x", Value::from(1))]),
    }
}

fn apply(batch: &decode::EventBatch) {
    let mut router = Router::new(RouterConfig::default(), 1);
    let address = "10.0.0.1:8000";
    router.upsert_endpoint(address).expect("one endpoint");
    router.set_event_stream(address, true);
    let mut token_hashes = Vec::new();
    for (i, e) in batch.events.iter().enumerate() {
        let _ = if i % 2 == 0 {
            router.apply_kv_event(address, "m", e, i as u64)
        } else {
            router.apply_kv_event_partial(address, "m", e, i as u64)
        };
        if let scorer_core::precise::KvEvent::BlockStored { block_hashes, .. } = e {
            token_hashes.extend(block_hashes.iter().copied());
        }
    }
    let request = RouteRequest {
        model: "m".into(),
        token_block_hashes: token_hashes,
        ..RouteRequest::default()
    };
    let decision = router.route(&request, 100, 7);
    assert!(decision.response.endpoints.len() <= 1);
}

/// The target's body: the input its bytes build (`crate::structured`), and what it must satisfy.
pub fn check(data: &[u8]) {
    crate::structured(data, check_input);
}

fn check_input(input: Input) {
    match input {
        Input::Frames(frames) => {
            if let Ok(m) = decode::decode_message(&frames) {
                apply(&m.batch);
            }
        }
        Input::Payload(bytes) => {
            if let Ok(wire) = decode::decode_batch(&bytes) {
                // vllm-sim's encoder writes any decoded batch in vLLM's canonical form: once
                // canonical, decoding and encoding again changes no byte.
                let canonical = decode::encode_batch(&wire);
                let again = decode::decode_batch(&canonical).expect("re-decode");
                assert_eq!(
                    decode::encode_batch(&again),
                    canonical,
                    "encoder round trip"
                );
                apply(&decode::EventBatch::from(wire));
            }
        }
        Input::Batch {
            as_maps,
            negative_hashes,
            ts,
            rank,
            events,
        } => {
            let values: Vec<Value> = events
                .iter()
                .map(|e| event(e, as_maps, negative_hashes))
                .collect();
            let mut batch = vec![Value::from(ts), Value::Array(values)];
            if let Some(r) = rank {
                batch.push(Value::from(u64::from(r)));
            }
            let mut bytes = Vec::new();
            rmpv::encode::write_value(&mut bytes, &Value::Array(batch)).expect("encode");
            let seq = 7u64.to_be_bytes().to_vec();
            match decode::decode_message(&[b"kv".to_vec(), seq, bytes]) {
                Ok(m) => {
                    let kept = m.batch.events.len()
                        + m.batch.skipped.other_groups as usize
                        + m.batch.skipped.unknown_types as usize;
                    assert_eq!(kept, events.len(), "events lost in decoding");
                    apply(&m.batch);
                }
                Err(e) => {
                    // Only values we chose to make invalid may fail.
                    let _ = e.to_string();
                }
            }
        }
    }
}
