//! KV events over ZMQ, byte-compatible with vLLM 0.33's `ZmqEventPublisher`.
//!
//! - PUB socket: multipart `[topic, seq (8 bytes big-endian, from 0), payload]`, one message per
//!   engine step that produced events;
//! - payload: msgpack `[ts: f64, [event, ...], data_parallel_rank]`, events as tagged maps
//!   (`{"type": "BlockStored", "block_hashes": [...], ...}`);
//! - ROUTER replay socket: a DEALER sends `["", start_seq (8 bytes BE)]` and gets
//!   `["", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, then the end
//!   marker `["", "", 0xFF x 8, ""]`.
//!
//! [`encode_batch`] is pure; [`Publisher`] owns the sockets.

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
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
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
            (s("medium"), s("GPU")),
            (s("lora_name"), lora_name.as_deref().map_or(Value::Nil, s)),
            (s("group_idx"), Value::from(0)),
            (s("kv_cache_spec_kind"), s("full_attention")),
        ]),
        KvEvent::BlockRemoved { block_hashes } => Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (
                s("block_hashes"),
                Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect()),
            ),
            (s("medium"), s("GPU")),
            (s("group_idx"), Value::from(0)),
        ]),
        KvEvent::AllBlocksCleared => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
    }
}

/// Msgpack payload of one batch: `[ts, [events...], data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: u32) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(event_value).collect()),
        Value::from(data_parallel_rank),
    ]);
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, &batch);
    buf
}

/// `tcp://*:P` (vLLM's bind-all spelling) becomes `tcp://0.0.0.0:P` for the zeromq crate.
fn bind_spelling(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A running publisher: send batches into [`Publisher::sender`].
pub struct Publisher {
    /// Where the PUB socket is bound (port resolved when 0 was asked).
    pub endpoint: String,
    /// Where the replay ROUTER socket is bound, if any.
    pub replay_endpoint: Option<String>,
    sender: mpsc::UnboundedSender<(f64, Vec<KvEvent>)>,
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

        let (sender, mut rx) = mpsc::unbounded_channel::<(f64, Vec<KvEvent>)>();
        tasks.push(tokio::spawn(async move {
            let mut seq: u64 = 0;
            while let Some((ts, events)) = rx.recv().await {
                let payload = Bytes::from(encode_batch(ts, &events, 0));
                let seq_bytes = Bytes::copy_from_slice(&seq.to_be_bytes());
                {
                    let mut buf = buffer.lock();
                    if buf.len() >= buffer_steps.max(1) {
                        buf.pop_front();
                    }
                    buf.push_back((seq, payload.clone()));
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
            let _ = self.sender.send((ts, events));
        }
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
            events[1].as_map().unwrap()[0].1.as_str(),
            Some("AllBlocksCleared")
        );
    }
}
