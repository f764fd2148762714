//! KV events over ZMQ, byte-compatible with vLLM 0.33's `ZmqEventPublisher`.
//!
//! - PUB socket: multipart `[topic, seq (8 bytes big-endian, from 0), payload]`, one message per
//!   engine step that produced events;
//! - payload: vllm-wire's encoding of a `KVEventBatch`, byte for byte what vLLM 0.33 writes
//!   (`vllm_wire::kv_events::encode_batch`, checked there against vLLM's own classes);
//! - ROUTER replay socket: a DEALER sends `["", start_seq (8 bytes BE)]` and gets
//!   `["", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, then the end
//!   marker `["", "", 0xFF x 8, ""]`.
//!
//! [`wire_batch`] is pure: it fills the fields as vLLM 0.33's GPU block pool does. [`Publisher`]
//! owns the sockets. Tests and tools read payloads with `vllm_wire::kv_events::decode_batch`,
//! the decoder the control plane uses too.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use vllm_wire::kv_events::{
    BlockHash, BlockRemoved, BlockStored, WireBatch, WireEvent, encode_batch, replay_end,
    replay_messages,
};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::SimError;
use super::engine::{KvEvent, SLIDING_WINDOW_GROUP};

/// Batches kept for replay (vLLM `buffer_steps` default).
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// One engine event as vLLM 0.33's GPU block pool publishes it: medium `GPU` (`CPU` for the
/// offload tier), KV group 0 (a hybrid model's sliding-window layers: group
/// [`SLIDING_WINDOW_GROUP`]), no spec kind; a stored run as the engine filled it otherwise
/// (with the extra keys of every block: LoRA name, and the cache salt on block 0).
pub fn wire_event(ev: &KvEvent) -> WireEvent {
    let ints = |hs: &[u64]| hs.iter().copied().map(BlockHash::Int).collect();
    // The CPU offload tier publishes the same events with medium `CPU`.
    let medium = match ev {
        KvEvent::OffloadStored(_) | KvEvent::OffloadRemoved { .. } => "CPU",
        _ => "GPU",
    };
    let group = match ev {
        KvEvent::WindowStored(_) | KvEvent::WindowRemoved { .. } => SLIDING_WINDOW_GROUP,
        _ => 0,
    };
    match ev {
        KvEvent::BlockStored(s) | KvEvent::OffloadStored(s) | KvEvent::WindowStored(s) => {
            WireEvent::BlockStored(BlockStored {
                medium: Some(medium.into()),
                group_idx: Some(group),
                kv_cache_spec_kind: None,
                ..s.clone()
            })
        }
        KvEvent::BlockRemoved { block_hashes }
        | KvEvent::OffloadRemoved { block_hashes }
        | KvEvent::WindowRemoved { block_hashes } => WireEvent::BlockRemoved(BlockRemoved {
            block_hashes: ints(block_hashes),
            medium: Some(medium.into()),
            group_idx: Some(group),
        }),
        KvEvent::AllBlocksCleared => WireEvent::AllBlocksCleared,
    }
}

/// One engine step's events as the batch vLLM 0.33 publishes for them.
pub fn wire_batch(ts: f64, events: &[KvEvent], data_parallel_rank: u32) -> WireBatch {
    WireBatch {
        ts,
        events: events.iter().map(wire_event).collect(),
        data_parallel_rank: Some(data_parallel_rank),
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
    /// Fault injection: from now on one batch in `n` (0: none) is lost: neither sent on the PUB
    /// socket nor kept for replay (a gap no subscriber can fill).
    LoseEvery(u32),
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
    /// The topic frame of its messages.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    sender: mpsc::UnboundedSender<Command>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Publisher {
    /// Binds the sockets and starts the publishing tasks. Every batch carries
    /// `data_parallel_rank` (vLLM stamps each engine's rank, 0 without data parallelism).
    pub async fn start(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
        buffer_steps: usize,
        data_parallel_rank: u32,
    ) -> Result<Self, SimError> {
        let mut pub_socket = PubSocket::new();
        let bound = pub_socket
            .bind(&bind_spelling(endpoint))
            .await
            .map_err(|e| SimError::Io(format!("cannot bind kv events socket {endpoint}: {e}")))?;
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        let topic_name = topic.to_owned();
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
            let (mut lose_every, mut since_loss): (u32, u32) = (0, 0);
            while let Some(command) = rx.recv().await {
                let (ts, events) = match command {
                    Command::Batch(ts, events) => (ts, events),
                    Command::DropNext(n) => {
                        drop_next = n;
                        continue;
                    }
                    Command::LoseEvery(n) => {
                        (lose_every, since_loss) = (n, 0);
                        continue;
                    }
                    Command::Restart => {
                        seq = 0;
                        drop_next = 0;
                        buffer.lock().clear();
                        continue;
                    }
                };
                if lose_every > 0 {
                    since_loss += 1;
                    if since_loss >= lose_every {
                        since_loss = 0;
                        tracing::info!(
                            seq,
                            "kv events: batch lost, not even kept for replay (fault)"
                        );
                        seq += 1;
                        continue;
                    }
                }
                let payload =
                    Bytes::from(encode_batch(&wire_batch(ts, &events, data_parallel_rank)));
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
            topic: topic_name,
            buffer_steps,
            sender,
            tasks,
        })
    }

    /// What vLLM's `GET /kv_event_sources` lists for this publisher (its resolved
    /// `KVEventsConfig`; vLLM's default high-water mark and queue size, which the simulator
    /// does not enforce).
    pub fn config(&self) -> vllm_wire::kv_events::PublisherConfig {
        vllm_wire::kv_events::PublisherConfig {
            enable_kv_cache_events: true,
            publisher: Some("zmq".into()),
            endpoint: self.endpoint.clone(),
            replay_endpoint: self.replay_endpoint.clone(),
            buffer_steps: self.buffer_steps as u64,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: self.topic.clone(),
        }
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

    /// Fault injection: from now on one batch in `n` is lost, not published and not kept for
    /// replay, as when a PUB socket's high-water mark drops batches the replay buffer no
    /// longer holds; 0 stops losing them.
    pub fn lose_every(&self, n: u32) {
        let _ = self.sender.send(Command::LoseEvery(n));
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
        let batches = replay_messages(id, &topic, start, buffer.lock().iter().cloned());
        for frames in batches {
            if let Ok(m) = ZmqMessage::try_from(frames)
                && router.send(m).await.is_err()
            {
                break;
            }
        }
        if let Ok(m) = ZmqMessage::try_from(replay_end(id)) {
            let _ = router.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_wire::kv_events::{BlockHash, block_extra_keys};
    use vllm_wire::kv_events::{EventBatch, decode_batch};
    use vllm_wire::rmpv::Value;

    #[test]
    fn engine_events_are_published_as_a_gpu_block_pool_does() {
        let events = vec![
            KvEvent::BlockStored(BlockStored {
                lora_id: Some(2),
                lora_name: Some("sql".into()),
                extra_keys: Some(block_extra_keys(2, Some("sql"), Some("t1"))),
                ..BlockStored::on_gpu(
                    vec![BlockHash::Int(1), BlockHash::Int(u64::MAX)],
                    None,
                    (0..32).collect(),
                    16,
                )
            }),
            KvEvent::OffloadRemoved {
                block_hashes: vec![u64::MAX],
            },
            KvEvent::AllBlocksCleared,
        ];
        let b = decode_batch(&encode_batch(&wire_batch(2.5, &events, 1))).unwrap();
        assert_eq!((b.ts, b.data_parallel_rank), (2.5, Some(1)));
        let WireEvent::BlockStored(stored) = &b.events[0] else {
            panic!("{:?}", b.events[0]);
        };
        assert_eq!(
            (stored.medium.as_deref(), stored.group_idx, stored.lora_id),
            (Some("GPU"), Some(0), Some(2))
        );
        let s = |x: &str| Value::from(x);
        assert_eq!(
            stored.extra_keys,
            Some(Value::Array(vec![
                Value::Array(vec![s("sql"), s("t1")]),
                Value::Array(vec![s("sql")]),
            ]))
        );
        assert_eq!(
            b.events[1],
            WireEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int(u64::MAX)],
                medium: Some("CPU".into()),
                group_idx: Some(0),
            })
        );
        // The router reads back the salt the engine hashed block 0 with.
        let routed = EventBatch::from(b);
        assert!(matches!(
            &routed.events[0],
            scorer_core::precise::KvEvent::BlockStored { cache_salt: Some(salt), .. } if salt == "t1"
        ));
    }
}
