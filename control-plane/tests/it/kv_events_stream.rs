//! The KV-event subscriber over real ZMQ sockets against a fake vLLM publisher (PUB + ROUTER
//! replay, wire-compatible with vLLM's `ZmqEventPublisher`): initial history, live batches, a
//! replayed gap, a gap the replay cannot fill, an undecodable message, a cache reset and a
//! publisher restart. Everything binds 127.0.0.1 on OS-chosen ports; every wait is bounded.

// An integration test: its helpers may unwrap (the product's ban is for product code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use control_plane::kv_events::subscriber::{self, EventSource, SubscriberSettings};
use control_plane::state::{KvStreamStatus, State};
use parking_lot::Mutex;
use scorer_core::router::RouterConfig;
use scorer_core::self_check::StateReason;
use tokio::sync::watch;
use vllm_wire::kv_events::{
    BlockHash, BlockStored, WireBatch, WireEvent, encode_batch, replay_end, replay_messages,
};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const ADDRESS: &str = "10.0.0.1:8000";
const BLOCK: u32 = 16;

type Buffer = Arc<Mutex<Vec<(u64, Bytes)>>>;

/// Binds, retrying for up to 5 s while the address is in use: a restarted publisher takes its
/// old ports back, which the kernel (or another test's ephemeral bind, in the moment they were
/// free) may still hold.
async fn bind_retrying<S: Socket>(socket: &mut S, endpoint: &str) -> String {
    for _ in 0..100 {
        match socket.bind(endpoint).await {
            Ok(bound) => return bound.to_string(),
            Err(zeromq::ZmqError::Network(e)) if e.kind() == std::io::ErrorKind::AddrInUse => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("binding {endpoint}: {e}"),
        }
    }
    panic!("{endpoint} still in use after 5 s")
}

/// A vLLM-like publisher whose buffer and live sends the test controls.
struct FakePublisher {
    pub_socket: PubSocket,
    buffer: Buffer,
    replay_task: tokio::task::JoinHandle<()>,
    endpoint: String,
    replay_endpoint: String,
    next_seq: u64,
}

impl FakePublisher {
    /// A publisher on ports the OS picks.
    async fn ephemeral() -> Self {
        Self::bind("tcp://127.0.0.1:0", "tcp://127.0.0.1:0").await
    }

    async fn bind(endpoint: &str, replay_endpoint: &str) -> Self {
        let mut pub_socket = PubSocket::new();
        let endpoint = bind_retrying(&mut pub_socket, endpoint).await;
        let mut router = RouterSocket::new();
        let replay_endpoint = bind_retrying(&mut router, replay_endpoint).await;
        let buffer: Buffer = Arc::default();
        let replay_task = tokio::spawn(serve_replay(router, buffer.clone()));
        Self {
            pub_socket,
            buffer,
            replay_task,
            endpoint,
            replay_endpoint,
            next_seq: 0,
        }
    }

    /// Buffers the next batch for replay without sending it live (a lost message).
    fn record(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer.lock().push((seq, Bytes::from(payload)));
        seq
    }

    async fn send_live(&mut self, seq: u64, payload: Bytes) {
        let msg = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ])
        .unwrap();
        self.pub_socket.send(msg).await.unwrap();
    }

    /// Buffers and sends the next batch.
    async fn publish(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.record(payload.clone());
        self.send_live(seq, Bytes::from(payload)).await;
        seq
    }

    /// Drops buffered batches before `seq` (the replay buffer wrapped).
    fn forget_before(&self, seq: u64) {
        self.buffer.lock().retain(|(s, _)| *s >= seq);
    }

    async fn close(self) {
        self.replay_task.abort();
        let _ = self.replay_task.await;
        drop(self.pub_socket);
    }
}

/// Stops the subscriber, then its publisher.
async fn stop(h: Harness, p: FakePublisher) {
    h.stop().await;
    p.close().await;
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer) {
    while let Ok(msg) = router.recv().await {
        let frames = msg.into_vec();
        let [id, _, start] = frames.as_slice() else {
            continue;
        };
        let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
        // The fake publishes replayed batches under an empty topic.
        let batches = replay_messages(id, &Bytes::new(), start, buffer.lock().iter().cloned());
        for frames in batches {
            let m = ZmqMessage::try_from(frames).unwrap();
            if router.send(m).await.is_err() {
                break;
            }
        }
        let _ = router
            .send(ZmqMessage::try_from(replay_end(id)).unwrap())
            .await;
    }
}

/// A `BlockStored` of `n` blocks with hashes `first..first+n`, tokens derived from the hashes.
fn stored(first: u64, n: u64, parent: Option<u64>) -> WireEvent {
    WireEvent::BlockStored(BlockStored::on_gpu(
        (first..first + n).map(BlockHash::Int).collect(),
        parent.map(BlockHash::Int),
        (first..first + n)
            .flat_map(|h| (0..BLOCK).map(move |i| h as u32 * 100 + i))
            .collect(),
        BLOCK,
    ))
}

fn cleared() -> WireEvent {
    WireEvent::AllBlocksCleared
}

/// The payload vLLM would publish for `events` (vllm-wire's encoder, as vllm-sim uses).
fn batch(events: Vec<WireEvent>) -> Vec<u8> {
    encode_batch(&WireBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
    })
}

struct Harness {
    state: Arc<State>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Harness {
    fn start(publisher: &FakePublisher, replay: bool) -> Self {
        let state =
            Arc::new(State::new(RouterConfig::default(), &[ADDRESS.to_string()], 16, 1).unwrap());
        let (stop, stop_rx) = watch::channel(false);
        let source = EventSource {
            address: ADDRESS.into(),
            endpoint: publisher.endpoint.clone(),
            replay_endpoint: replay.then(|| publisher.replay_endpoint.clone()),
            topic: String::new(),
            model: "m".into(),
        };
        let settings = SubscriberSettings {
            connect_timeout: Duration::from_millis(500),
            replay_timeout: Duration::from_millis(1000),
            reconnect_min: Duration::from_millis(50),
            reconnect_max: Duration::from_millis(200),
        };
        let task = tokio::spawn(subscriber::run(state.clone(), source, settings, stop_rx));
        Self { state, stop, task }
    }

    fn status(&self) -> KvStreamStatus {
        self.state
            .kv_streams()
            .into_iter()
            .next()
            .unwrap_or_default()
    }

    fn precise_blocks(&self) -> usize {
        self.state.endpoints()[0].precise_blocks
    }

    fn live(&self) -> bool {
        self.state.endpoints()[0].events_live
    }

    /// Polls `cond` for up to 5 s.
    async fn wait(&self, what: &str, cond: impl Fn(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !cond(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: {:?}, precise_blocks {}",
                self.status(),
                self.precise_blocks()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("subscriber stops")
            .unwrap();
        assert!(!self.state.endpoints()[0].events_live);
    }
}

/// Publishes live batches until `cond` holds (a SUB only receives once the PUB has processed
/// its subscription, so the first live sends may be lost; the gap logic then replays them).
async fn publish_until(
    publisher: &mut FakePublisher,
    h: &Harness,
    payload: impl Fn() -> Vec<u8>,
    cond: impl Fn(&Harness) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond(h) {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", h.status());
        publisher.publish(payload()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_live_gap_and_unreplayable_gap() {
    let mut p = FakePublisher::ephemeral().await;
    // Seq 0, before anyone listens: only the replay has it.
    p.publish(batch(vec![stored(1, 2, None)])).await;
    let h = Harness::start(&p, true);
    h.wait("live", |h| h.live()).await;
    assert_eq!(h.precise_blocks(), 2, "the initial replay rebuilt seq 0");
    let st = h.status();
    assert!(!st.partial, "history from seq 0 is complete: {st:?}");
    assert_eq!(st.replays, 1);

    // Live batches extend the chain (the parent is known). Empty batches get the SUB's
    // subscription through without changing state.
    publish_until(&mut p, &h, || batch(vec![]), |h| h.status().batches >= 2).await;
    p.publish(batch(vec![stored(3, 1, Some(2))])).await;
    h.wait("live store", |h| h.precise_blocks() == 3).await;

    // A lost message: seq k only in the buffer, seq k+1 live -> gap -> replay fills it.
    p.record(batch(vec![stored(4, 1, Some(3))]));
    p.publish(batch(vec![stored(5, 1, Some(4))])).await;
    h.wait("gap replayed", |h| h.precise_blocks() == 5).await;
    let st = h.status();
    assert_eq!(st.gaps, 1, "{st:?}");
    assert_eq!(st.resets, 0, "{st:?}");
    assert!(!st.partial);

    // A gap the replay buffer no longer covers: the state is dropped, the view is partial and
    // later stores extending forgotten blocks are skipped instead of resetting again.
    let lost = p.record(batch(vec![stored(6, 1, Some(5))]));
    p.forget_before(lost + 1);
    p.publish(batch(vec![stored(100, 2, None)])).await;
    h.wait("unreplayable gap", |h| h.status().resets == 1).await;
    h.wait("tail kept", |h| h.precise_blocks() == 2).await;
    assert!(h.status().partial);
    p.publish(batch(vec![
        stored(7, 1, Some(6)),
        stored(102, 1, Some(101)),
    ]))
    .await;
    h.wait("partial view grows", |h| h.precise_blocks() == 3)
        .await;
    assert_eq!(h.status().resets, 1);

    // AllBlocksCleared: empty and exactly known again.
    p.publish(batch(vec![cleared(), stored(200, 1, None)]))
        .await;
    h.wait("cleared", |h| {
        h.precise_blocks() == 1 && !h.status().partial
    })
    .await;

    stop(h, p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_message_drops_state_and_recovers() {
    let mut p = FakePublisher::ephemeral().await;
    let h = Harness::start(&p, true);
    h.wait("live", |h| h.live()).await;
    publish_until(
        &mut p,
        &h,
        || batch(vec![stored(1, 1, None)]),
        |h| h.precise_blocks() == 1,
    )
    .await;
    // Garbage where a batch should be: clear, never a panic.
    let seq = p.next_seq;
    p.next_seq += 1;
    p.send_live(seq, Bytes::from_static(b"\xc1 not msgpack"))
        .await;
    h.wait("decode error", |h| h.status().decode_errors == 1)
        .await;
    assert_eq!(h.precise_blocks(), 0);
    assert!(h.live(), "a bad message does not take the stream down");
    p.publish(batch(vec![stored(9, 2, None)])).await;
    h.wait("recovered", |h| h.precise_blocks() == 2).await;
    stop(h, p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_and_no_replay_socket() {
    let mut p = FakePublisher::ephemeral().await;
    let (pub_ep, replay_ep) = (p.endpoint.clone(), p.replay_endpoint.clone());
    for i in 0..3 {
        p.publish(batch(vec![stored(10 * (i + 1), 1, None)])).await;
    }
    let h = Harness::start(&p, true);
    h.wait("history", |h| h.precise_blocks() == 3).await;

    // The engine restarts: its sockets go away, its cache is empty, its seq starts at 0.
    p.close().await;
    h.wait("down", |h| !h.live()).await;
    assert_eq!(h.precise_blocks(), 0, "a down stream drops its state");
    let mut p = FakePublisher::bind(&pub_ep, &replay_ep).await;
    p.publish(batch(vec![stored(500, 1, None)])).await;
    h.wait("back with the new history", |h| {
        h.live() && h.precise_blocks() == 1 && !h.status().partial
    })
    .await;
    assert!(h.status().sessions >= 2);
    stop(h, p).await;

    // Without a replay socket a late joiner is partial, and a gap drops the state.
    let mut p = FakePublisher::ephemeral().await;
    p.publish(batch(vec![])).await;
    let h = Harness::start(&p, false);
    h.wait("live", |h| h.live()).await;
    publish_until(
        &mut p,
        &h,
        || batch(vec![stored(1, 1, None)]),
        |h| h.precise_blocks() >= 1,
    )
    .await;
    assert!(h.status().partial);
    let resets = h.status().resets;
    p.record(batch(vec![]));
    p.publish(batch(vec![stored(50, 1, None)])).await;
    h.wait("gap without replay", |h| h.status().resets == resets + 1)
        .await;
    stop(h, p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_going_backwards_on_one_connection_is_a_restart() {
    let mut p = FakePublisher::ephemeral().await;
    for i in 0..3 {
        p.publish(batch(vec![stored(10 * (i + 1), 1, None)])).await;
    }
    let h = Harness::start(&p, true);
    h.wait("history", |h| h.precise_blocks() == 3).await;
    publish_until(&mut p, &h, || batch(vec![]), |h| h.status().batches >= 4).await;
    // A forwarder in front of a restarted engine: same connection, numbering from 0 again.
    p.buffer.lock().clear();
    p.next_seq = 0;
    p.publish(batch(vec![stored(900, 2, None)])).await;
    h.wait("restart handled", |h| {
        h.precise_blocks() == 2 && h.status().resets == 1 && !h.status().partial
    })
    .await;
    assert!(h.live());
    let replays = h.status().replays;
    p.publish(batch(vec![stored(902, 1, Some(901))])).await;
    h.wait("in order after the restart", |h| h.precise_blocks() == 3)
        .await;
    assert_eq!(h.status().replays, replays, "no replay was needed");
    stop(h, p).await;
}

// A stream whose every store names another KV-cache group (a hybrid model whose full-attention
// group is not group 0) leaves the event index empty while it looks healthy: after
// `unusable_group_batches` such batches the endpoint is degraded (event_groups); the first
// usable store ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_other_kv_groups_only_is_named_and_a_usable_store_ends_it() {
    let mut p = FakePublisher::ephemeral().await;
    let h = Harness::start(&p, true);
    h.wait("live", |h| h.live()).await;
    let reason = |h: &Harness| h.state.endpoints()[0].state_reason;
    let other_group = || {
        let WireEvent::BlockStored(mut s) = stored(1_000, 1, None) else {
            unreachable!()
        };
        s.group_idx = Some(1);
        batch(vec![WireEvent::BlockStored(s)])
    };
    publish_until(&mut p, &h, other_group, |h| {
        reason(h) == Some(StateReason::EventGroups)
    })
    .await;
    assert_eq!(h.precise_blocks(), 0, "nothing the index can use");
    p.publish(batch(vec![stored(1, 1, None)])).await;
    h.wait("a usable store", |h| reason(h).is_none()).await;
    assert_eq!(h.precise_blocks(), 1);
    stop(h, p).await;
}
