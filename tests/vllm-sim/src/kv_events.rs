//! KV events over ZMQ, byte-compatible with vLLM 0.33's `ZmqEventPublisher`.
//!
//! - PUB socket: multipart `[topic, seq (8 bytes big-endian, from 0), payload]`, one message per
//!   engine step that produced events;
//! - payload: msgpack `[ts: f64, [event, ...], data_parallel_rank]`, events as tagged maps
//!   (`{"type": "BlockStored", "block_hashes": [...], ...}`) with exactly the fields vLLM 0.33's
//!   GPU block pool sets (msgspec `omit_defaults` drops the rest), in its field order;
//! - ROUTER replay socket: a DEALER sends `["", start_seq (8 bytes BE)]` and gets
//!   `["", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, then the end
//!   marker `["", "", 0xFF x 8, ""]`.
//!
//! [`encode_batch`] is pure; [`Publisher`] owns the sockets. [`decode_batch`] reads what any
//! vLLM version publishes (tagged maps, or the tagged arrays of vLLM before ~0.23; integer or
//! byte-string hashes), for tests and tools. `tests/vllm-sim/fixtures/vllm/` holds payloads made by
//! vLLM 0.33's own event classes that pin both directions (`scripts/check_vllm_compat.py`).

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use rmpv::Value;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::SimError;
use super::engine::KvEvent;

/// Batches kept for replay (vLLM `buffer_steps` default).
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// The replay end marker's sequence frame: `-1` as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xFF; 8];

fn event_value(ev: &KvEvent) -> Value {
    let s = |x: &str| Value::from(x);
    let opt_u64 = |x: Option<u64>| x.map_or(Value::Nil, Value::from);
    // The CPU offload tier publishes the same events with medium `CPU`.
    let medium = match ev {
        KvEvent::OffloadStored { .. } | KvEvent::OffloadRemoved { .. } => "CPU",
        _ => "GPU",
    };
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            cache_salt,
        }
        | KvEvent::OffloadStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            cache_salt,
        } => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect()),
            ),
            (s("parent_block_hash"), opt_u64(*parent_block_hash)),
            (
                s("token_ids"),
                Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
            ),
            (s("block_size"), Value::from(*block_size)),
            (s("lora_id"), opt_u64(lora_id.map(u64::from))),
            (s("medium"), s(medium)),
            (s("lora_name"), lora_name.as_deref().map_or(Value::Nil, s)),
            (
                s("extra_keys"),
                extra_keys(block_hashes.len(), lora_name, cache_salt),
            ),
            (s("group_idx"), Value::from(0)),
        ]),
        KvEvent::BlockRemoved { block_hashes } | KvEvent::OffloadRemoved { block_hashes } => {
            Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (
                    s("block_hashes"),
                    Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect()),
                ),
                (s("medium"), s(medium)),
                (s("group_idx"), Value::from(0)),
            ])
        }
        KvEvent::AllBlocksCleared => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
    }
}

/// A store's `extra_keys` as vLLM publishes them: one entry per block, each the block's extra
/// hash keys untagged, in vLLM's order (LoRA name, multimodal keys, cache salt, prompt-embeds
/// digest), or nil for a block without any. The salt is on block 0 only, so it is present only
/// when the run starts there (`cache_salt` is then `Some`): `[[lora?, salt], [lora]|nil, ...]`.
fn extra_keys(blocks: usize, lora_name: &Option<String>, cache_salt: &Option<String>) -> Value {
    let s = |x: &str| Value::from(x);
    Value::Array(
        (0..blocks)
            .map(|i| {
                let keys: Vec<Value> = lora_name
                    .as_deref()
                    .map(s)
                    .into_iter()
                    .chain(cache_salt.as_deref().filter(|_| i == 0).map(s))
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

/// Msgpack payload of one batch: `[ts, [events...], data_parallel_rank]`, byte for byte what
/// vLLM's `msgspec` encoder writes for the same events.
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: u32) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    write_array_len(&mut buf, 3);
    write(&mut buf, &Value::F64(ts));
    write_array_len(&mut buf, events.len());
    for ev in events {
        let Value::Map(fields) = event_value(ev) else {
            continue;
        };
        // msgspec sizes a struct's map header for all its fields plus the tag, then fills in
        // the count it wrote: `BlockStored` (15 fields) gets a map16 header even when fewer
        // fields are set; the smaller events get a fixmap.
        if matches!(ev, KvEvent::BlockStored { .. }) {
            buf.push(0xde);
            buf.extend_from_slice(&(fields.len() as u16).to_be_bytes());
        } else {
            buf.push(0x80 | fields.len() as u8);
        }
        for (k, v) in &fields {
            write(&mut buf, k);
            write(&mut buf, v);
        }
    }
    write(&mut buf, &Value::from(data_parallel_rank));
    buf
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

/// A block hash as published: an integer (vLLM's default 64-bit projection; older versions'
/// signed values are kept as their two's-complement bits) or the raw digest bytes
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EventHash {
    /// An integer hash.
    Int(u64),
    /// A byte-string hash.
    Bytes(Vec<u8>),
}

/// One decoded KV event, with every field a router may use.
#[derive(Debug, Clone, PartialEq)]
pub enum DecodedEvent {
    /// Blocks became cached.
    BlockStored {
        /// Hashes of the stored blocks.
        block_hashes: Vec<EventHash>,
        /// Hash of the block before them, if any.
        parent_block_hash: Option<EventHash>,
        /// Their tokens, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter id (deprecated in vLLM).
        lora_id: Option<u64>,
        /// `GPU`, `CPU`, ...; absent before vLLM ~0.10.
        medium: Option<String>,
        /// LoRA adapter name.
        lora_name: Option<String>,
        /// Per-block extra hash keys, as published.
        extra_keys: Option<Value>,
        /// KV cache group.
        group_idx: Option<u32>,
        /// `full_attention`, `sliding_window`, ... when published.
        kv_cache_spec_kind: Option<String>,
    },
    /// Cached blocks were evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<EventHash>,
        /// Medium, when published.
        medium: Option<String>,
        /// KV cache group.
        group_idx: Option<u32>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// Publisher's wall-clock time, Unix seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<DecodedEvent>,
    /// The publisher's data-parallel rank; absent when vLLM left it unset.
    pub data_parallel_rank: Option<u32>,
}

/// Why a payload is not a KV event batch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid kv event batch: {0}")]
pub struct DecodeError(String);

/// Field order of vLLM's `BlockStored`, for the positional (array) encoding.
const STORED_FIELDS: [&str; 15] = [
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
/// Field order of vLLM's `BlockRemoved`.
const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// Decodes one msgpack payload as published by any vLLM version (see the module docs).
/// Unknown fields are ignored; missing optional fields read as `None`.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let bad = |m: String| DecodeError(m);
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| bad(format!("not msgpack: {e}")))?;
    if !rd.is_empty() {
        return Err(bad(format!("{} trailing bytes", rd.len())));
    }
    let Value::Array(items) = v else {
        return Err(bad("a batch is an array [ts, events, rank]".into()));
    };
    if !(2..=3).contains(&items.len()) {
        return Err(bad(format!(
            "a batch has 2 or 3 items, not {}",
            items.len()
        )));
    }
    let ts = match &items[0] {
        Value::F32(f) => f64::from(*f),
        Value::F64(f) => *f,
        Value::Integer(i) => i.as_f64().unwrap_or(f64::NAN),
        other => return Err(bad(format!("ts must be a number, not {other}"))),
    };
    let Value::Array(raw_events) = &items[1] else {
        return Err(bad("events must be an array".into()));
    };
    let data_parallel_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(r) => Some(as_u32(r).ok_or_else(|| bad(format!("bad data_parallel_rank {r}")))?),
    };
    let events = raw_events
        .iter()
        .enumerate()
        .map(|(i, e)| decode_event(e).map_err(|m| bad(format!("event {i}: {m}"))))
        .collect::<Result<_, _>>()?;
    Ok(DecodedBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn as_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

fn decode_hash(v: &Value) -> Result<EventHash, String> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(EventHash::Int(u)),
            (None, Some(s)) => Ok(EventHash::Int(s as u64)),
            _ => Err(format!("bad hash {v}")),
        },
        Value::Binary(b) => Ok(EventHash::Bytes(b.clone())),
        other => Err(format!("a hash is an integer or bytes, not {other}")),
    }
}

fn decode_hashes(v: Option<&Value>) -> Result<Vec<EventHash>, String> {
    match v {
        Some(Value::Array(a)) => a.iter().map(decode_hash).collect(),
        _ => Err("block_hashes must be an array".into()),
    }
}

fn opt_str(v: Option<&Value>, name: &str) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => Ok(s.as_str().map(str::to_owned)),
        Some(other) => Err(format!("{name} must be a string, not {other}")),
    }
}

fn opt_num(v: Option<&Value>, name: &str) -> Result<Option<u64>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(n) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{name} must be a non-negative integer, not {n}")),
    }
}

fn decode_event(v: &Value) -> Result<DecodedEvent, String> {
    // Normalise both encodings to (field name, value) pairs.
    let (tag, fields): (&str, Vec<(&str, &Value)>) = match v {
        Value::Map(m) => {
            let mut tag = None;
            let mut fields = Vec::with_capacity(m.len());
            for (k, val) in m {
                let k = k.as_str().ok_or("event keys must be strings")?;
                if k == "type" {
                    tag = val.as_str();
                } else {
                    fields.push((k, val));
                }
            }
            (tag.ok_or("event has no type tag")?, fields)
        }
        Value::Array(a) => {
            let tag = a
                .first()
                .and_then(Value::as_str)
                .ok_or("an array event starts with its type tag")?;
            let names: &[&str] = match tag {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            (tag, names.iter().copied().zip(a[1..].iter()).collect())
        }
        other => return Err(format!("an event is a map or an array, not {other}")),
    };
    let get = |name: &str| fields.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    match tag {
        "BlockStored" => {
            let token_ids = match get("token_ids") {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| as_u32(t).ok_or_else(|| format!("bad token id {t}")))
                    .collect::<Result<Vec<_>, _>>()?,
                _ => return Err("token_ids must be an array".into()),
            };
            let block_size = get("block_size")
                .and_then(as_u32)
                .ok_or("block_size must be a u32")?;
            let parent_block_hash = match get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(h) => Some(decode_hash(h)?),
            };
            Ok(DecodedEvent::BlockStored {
                block_hashes: decode_hashes(get("block_hashes"))?,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id: opt_num(get("lora_id"), "lora_id")?,
                medium: opt_str(get("medium"), "medium")?,
                lora_name: opt_str(get("lora_name"), "lora_name")?,
                extra_keys: get("extra_keys").filter(|v| !v.is_nil()).cloned(),
                group_idx: opt_num(get("group_idx"), "group_idx")?
                    .map(|g| u32::try_from(g).map_err(|_| "group_idx too large"))
                    .transpose()?,
                kv_cache_spec_kind: opt_str(get("kv_cache_spec_kind"), "kv_cache_spec_kind")?,
            })
        }
        "BlockRemoved" => Ok(DecodedEvent::BlockRemoved {
            block_hashes: decode_hashes(get("block_hashes"))?,
            medium: opt_str(get("medium"), "medium")?,
            group_idx: opt_num(get("group_idx"), "group_idx")?
                .map(|g| u32::try_from(g).map_err(|_| "group_idx too large"))
                .transpose()?,
        }),
        "AllBlocksCleared" => Ok(DecodedEvent::AllBlocksCleared),
        other => Err(format!("unknown event type {other:?}")),
    }
}

/// `tcp://*:P` (vLLM's bind-all spelling) becomes `tcp://0.0.0.0:P` for the zeromq crate.
fn bind_spelling(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// What the publishing task is asked to do.
#[derive(Debug)]
enum Command {
    /// Publish one engine step's events.
    Batch(f64, Vec<KvEvent>),
    /// Fault injection: keep the next `n` batches in the replay buffer but do not send them
    /// on the PUB socket (a subscriber sees a sequence gap it can replay).
    DropNext(u32),
    /// Fault injection: behave like a restarted engine's new publisher: sequence numbers start
    /// again at 0 and the replay buffer is empty.
    Restart,
}

/// A running publisher: send batches into [`Publisher::sender`].
pub struct Publisher {
    /// Where the PUB socket is bound (port resolved when 0 was asked).
    pub endpoint: String,
    /// Where the replay ROUTER socket is bound, if any.
    pub replay_endpoint: Option<String>,
    sender: mpsc::UnboundedSender<Command>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Publisher {
    /// Binds the sockets and starts the publishing tasks.
    pub async fn start(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
        buffer_steps: usize,
    ) -> Result<Self, SimError> {
        let mut pub_socket = PubSocket::new();
        let bound = pub_socket
            .bind(&bind_spelling(endpoint))
            .await
            .map_err(|e| SimError::Io(format!("cannot bind kv events socket {endpoint}: {e}")))?;
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        let topic = Bytes::from(topic.as_bytes().to_vec());
        let mut tasks = Vec::new();

        let mut replay_bound = None;
        if let Some(replay) = replay_endpoint {
            let mut router = RouterSocket::new();
            let b = router.bind(&bind_spelling(replay)).await.map_err(|e| {
                SimError::Io(format!("cannot bind kv events replay socket {replay}: {e}"))
            })?;
            replay_bound = Some(b.to_string());
            tasks.push(tokio::spawn(serve_replay(
                router,
                buffer.clone(),
                topic.clone(),
            )));
        }

        let (sender, mut rx) = mpsc::unbounded_channel::<Command>();
        tasks.push(tokio::spawn(async move {
            let mut seq: u64 = 0;
            let mut drop_next: u32 = 0;
            while let Some(command) = rx.recv().await {
                let (ts, events) = match command {
                    Command::Batch(ts, events) => (ts, events),
                    Command::DropNext(n) => {
                        drop_next = n;
                        continue;
                    }
                    Command::Restart => {
                        seq = 0;
                        drop_next = 0;
                        buffer.lock().clear();
                        continue;
                    }
                };
                let payload = Bytes::from(encode_batch(ts, &events, 0));
                let seq_bytes = Bytes::copy_from_slice(&seq.to_be_bytes());
                {
                    let mut buf = buffer.lock();
                    if buf.len() >= buffer_steps.max(1) {
                        buf.pop_front();
                    }
                    buf.push_back((seq, payload.clone()));
                }
                if drop_next > 0 {
                    drop_next -= 1;
                    tracing::info!(
                        seq,
                        "kv events: batch kept for replay but not published (fault)"
                    );
                    seq += 1;
                    continue;
                }
                let msg = ZmqMessage::try_from(vec![topic.clone(), seq_bytes, payload]);
                if let Ok(msg) = msg
                    && let Err(e) = pub_socket.send(msg).await
                {
                    tracing::warn!("kv events publish failed: {e}");
                }
                seq += 1;
            }
        }));
        Ok(Self {
            endpoint: bound.to_string(),
            replay_endpoint: replay_bound,
            sender,
            tasks,
        })
    }

    /// Queues one batch (the events of one engine step) for publishing.
    pub fn publish(&self, ts: f64, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // The receiver lives as long as `self`; a send error means we are shutting down.
            let _ = self.sender.send(Command::Batch(ts, events));
        }
    }

    /// Fault injection: the next `n` batches go to the replay buffer only, not to subscribers.
    pub fn drop_next(&self, n: u32) {
        let _ = self.sender.send(Command::DropNext(n));
    }

    /// Fault injection: restart the sequence at 0 with an empty replay buffer, as a restarted
    /// engine's publisher does (the sockets stay bound, so subscribers stay connected).
    pub fn restart(&self) {
        let _ = self.sender.send(Command::Restart);
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, topic: Bytes) {
    loop {
        let msg = match router.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::warn!("kv events replay socket closed: {e}");
                return;
            }
        };
        // [identity, "", start_seq]
        let [id, _, start] = msg.as_slice() else {
            tracing::warn!("invalid kv events replay request ({} frames)", msg.len());
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            tracing::warn!("invalid kv events replay start sequence");
            continue;
        };
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let empty = Bytes::new();
        for (seq, payload) in batches {
            let frames = vec![
                id.clone(),
                empty.clone(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(m) = ZmqMessage::try_from(frames)
                && router.send(m).await.is_err()
            {
                break;
            }
        }
        let end = vec![
            id.clone(),
            empty.clone(),
            empty.clone(),
            Bytes::copy_from_slice(&END_SEQ),
            empty.clone(),
        ];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = router.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_shape_matches_vllm() {
        let ev = KvEvent::BlockStored {
            block_hashes: vec![u64::MAX, 7],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3],
            block_size: 16,
            lora_id: None,
            lora_name: None,
            cache_salt: None,
        };
        let bytes = encode_batch(1.5, &[ev, KvEvent::AllBlocksCleared], 0);
        let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 3);
        assert_eq!(arr[0].as_f64(), Some(1.5));
        assert_eq!(arr[2].as_u64(), Some(0));
        let events = arr[1].as_array().unwrap();
        let stored = events[0].as_map().unwrap();
        let get = |k: &str| {
            stored
                .iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(get("type").as_str(), Some("BlockStored"));
        assert_eq!(
            get("block_hashes").as_array().unwrap()[0].as_u64(),
            Some(u64::MAX)
        );
        assert!(get("parent_block_hash").is_nil());
        assert_eq!(get("block_size").as_u64(), Some(16));
        assert_eq!(get("medium").as_str(), Some("GPU"));
        assert!(get("lora_name").is_nil());
        assert_eq!(
            get("extra_keys"),
            Value::Array(vec![Value::Nil, Value::Nil])
        );
        assert_eq!(get("group_idx").as_u64(), Some(0));
        assert!(
            stored
                .iter()
                .all(|(k, _)| k.as_str() != Some("kv_cache_spec_kind"))
        );
        assert_eq!(
            events[1].as_map().unwrap()[0].1.as_str(),
            Some("AllBlocksCleared")
        );
    }

    #[test]
    fn decodes_what_it_encodes() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: Some(9),
                token_ids: (0..32).collect(),
                block_size: 16,
                lora_id: Some(2),
                lora_name: Some("sql".into()),
                cache_salt: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![u64::MAX],
            },
            KvEvent::AllBlocksCleared,
        ];
        let b = decode_batch(&encode_batch(2.5, &events, 1)).unwrap();
        assert_eq!(b.ts, 2.5);
        assert_eq!(b.data_parallel_rank, Some(1));
        let lora = Value::Array(vec![Value::from("sql")]);
        assert_eq!(
            b.events,
            vec![
                DecodedEvent::BlockStored {
                    block_hashes: vec![EventHash::Int(1), EventHash::Int(u64::MAX)],
                    parent_block_hash: Some(EventHash::Int(9)),
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    lora_id: Some(2),
                    medium: Some("GPU".into()),
                    lora_name: Some("sql".into()),
                    extra_keys: Some(Value::Array(vec![lora.clone(), lora])),
                    group_idx: Some(0),
                    kv_cache_spec_kind: None,
                },
                DecodedEvent::BlockRemoved {
                    block_hashes: vec![EventHash::Int(u64::MAX)],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                },
                DecodedEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn the_cache_salt_is_in_block_zeros_extra_keys_only() {
        let stored = |lora: Option<&str>, salt: Option<&str>| {
            let ev = KvEvent::BlockStored {
                block_hashes: vec![1, 2, 3],
                parent_block_hash: None,
                token_ids: (0..48).collect(),
                block_size: 16,
                lora_id: lora.map(|_| 1),
                lora_name: lora.map(str::to_owned),
                cache_salt: salt.map(str::to_owned),
            };
            match &decode_batch(&encode_batch(1.0, &[ev], 0)).unwrap().events[0] {
                DecodedEvent::BlockStored { extra_keys, .. } => extra_keys.clone().unwrap(),
                other => panic!("not a store: {other:?}"),
            }
        };
        let s = |x: &str| Value::from(x);
        let arr = Value::Array;
        assert_eq!(
            stored(None, Some("t1")),
            arr(vec![arr(vec![s("t1")]), Value::Nil, Value::Nil])
        );
        let lora = arr(vec![s("sql")]);
        assert_eq!(
            stored(Some("sql"), Some("t1")),
            arr(vec![arr(vec![s("sql"), s("t1")]), lora.clone(), lora])
        );
    }

    #[test]
    fn rejects_malformed_payloads() {
        let enc = |v: Value| {
            let mut buf = Vec::new();
            rmpv::encode::write_value(&mut buf, &v).unwrap();
            buf
        };
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&enc(Value::from(1))).is_err());
        assert!(decode_batch(&enc(Value::Array(vec![Value::F64(1.0)]))).is_err());
        let batch = |ev: Value| enc(Value::Array(vec![Value::F64(1.0), Value::Array(vec![ev])]));
        let err = decode_batch(&batch(Value::Map(vec![(
            Value::from("type"),
            Value::from("Mystery"),
        )])))
        .unwrap_err();
        assert!(err.to_string().contains("unknown event type"), "{err}");
        let no_tokens = Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (Value::from("block_hashes"), Value::Array(vec![])),
        ]);
        assert!(decode_batch(&batch(no_tokens)).is_err());
        let bad_hash = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![Value::from("nope")]),
        ]);
        assert!(decode_batch(&batch(bad_hash)).is_err());
        let mut trailing = batch(Value::Array(vec![Value::from("AllBlocksCleared")]));
        assert_eq!(
            decode_batch(&trailing).unwrap().events,
            vec![DecodedEvent::AllBlocksCleared]
        );
        trailing.push(0);
        assert!(decode_batch(&trailing).is_err());
    }
}
