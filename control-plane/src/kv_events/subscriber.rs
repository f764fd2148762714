//! One task per endpoint with a configured publisher: SUB to its KV events, DEALER to its
//! replay socket, and the router kept in step with what the engine holds.
//!
//! A session is one connection:
//! 1. connect the SUB socket and subscribe to the topic;
//! 2. ask the replay socket for everything it buffered (from sequence 0), apply it: the history
//!    is complete when the replay starts at 0 (or is empty: nothing was ever published),
//!    partial otherwise;
//! 3. mark the stream live, then apply live batches in sequence order. A jump forward is
//!    replayed; a batch also received through a replay is dropped; a sequence that goes
//!    backwards (a restarted publisher), a gap the replay cannot fill or an undecodable message
//!    drops the endpoint's state and continues with a partial view.
//!    A gap the replay cannot fill also names the endpoint `degraded` (reason `kv_event_gap`,
//!    scored from the approximate index) until enough batches in a row arrive in sequence
//!    (`router.self_check.clean_batches_after_gap`).
//!
//! A disconnect ends the session: the stream goes down (the router drops the state and scores
//! the endpoint approximately) and the task reconnects with exponential backoff. vLLM publishes
//! only on activity, so silence is not a failure; the connection state is what counts.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::seq::{SeqTracker, Verdict};
use crate::state::State;
use vllm_wire::kv_events::{DecodeError, END_SEQ, EventBatch, decode_event_batch, decode_seq};

/// Most batches accepted from one replay (vLLM buffers 10 000 by default).
const MAX_REPLAY_BATCHES: usize = 200_000;
/// A session that stayed up this long resets the reconnect backoff.
const STABLE_SESSION: Duration = Duration::from_secs(10);

/// Where one endpoint's KV events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// `ip:port` of the endpoint (as the router knows it).
    pub address: String,
    /// The engine's PUB socket, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The engine's ROUTER replay socket, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (vLLM's `topic`, empty for all).
    pub topic: String,
    /// Model name that seeds the hashes of blocks stored without a LoRA adapter.
    pub model: String,
}

/// Timeouts and backoff of the subscriber.
#[derive(Debug, Clone)]
pub struct SubscriberSettings {
    /// Deadline for one connection attempt (SUB or DEALER).
    pub connect_timeout: Duration,
    /// Deadline for a whole replay, request to end marker.
    pub replay_timeout: Duration,
    /// First reconnect delay.
    pub reconnect_min: Duration,
    /// Largest reconnect delay.
    pub reconnect_max: Duration,
}

impl Default for SubscriberSettings {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            replay_timeout: Duration::from_secs(2),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
        }
    }
}

/// Why a session ended or a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A ZMQ operation failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    /// The publisher went away.
    #[error("publisher disconnected")]
    Disconnected,
    /// A replay did not finish in time.
    #[error("replay timed out after {0:?}")]
    ReplayTimeout(Duration),
    /// A replay message did not have the expected frames or sequence.
    #[error("bad replay message: {0}")]
    BadReplay(String),
    /// A replay sent more batches than accepted.
    #[error("replay exceeds {MAX_REPLAY_BATCHES} batches")]
    ReplayTooLong,
}

/// Starts one subscriber per source; they stop when `shutdown` turns true or is dropped.
pub fn spawn(
    state: Arc<State>,
    sources: Vec<EventSource>,
    settings: SubscriberSettings,
    shutdown: watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    super::spawn_each(&state, sources, &settings, &shutdown, run)
}

/// Reconnect loop of one source.
pub async fn run(
    state: Arc<State>,
    source: EventSource,
    settings: SubscriberSettings,
    mut shutdown: watch::Receiver<bool>,
) {
    state.kv_stream(&source.address, |s| {
        s.endpoint = source.endpoint.clone();
        s.partial = true;
    });
    // Expected and not live yet: the endpoint is `degraded` until its first session is, so a
    // publisher that never answers (never enabled, wrong port) is named, not silently
    // approximate.
    state.set_event_stream(&source.address, false);
    let mut backoff = settings.reconnect_min;
    loop {
        let started = Instant::now();
        let mut stream = Stream::new(state.clone(), source.clone(), settings.clone());
        let ended = tokio::select! {
            e = stream.session() => e,
            _ = stopped(&mut shutdown) => {
                state.set_event_stream(&source.address, false);
                return;
            }
        };
        let was_live = stream.live;
        state.set_event_stream(&source.address, false);
        state.kv_stream(&source.address, |s| {
            s.connected = false;
            s.partial = true;
            s.last_error = Some(ended.to_string());
            if was_live {
                s.resets += 1;
            }
        });
        if was_live {
            state
                .telemetry()
                .count_kv_reset(&source.address, "disconnect");
            tracing::warn!(endpoint = %source.address, publisher = %source.endpoint, error = %ended,
                "KV-event stream down; scoring the endpoint approximately until it is back");
        } else {
            tracing::debug!(endpoint = %source.address, error = %ended, "KV-event connect failed");
        }
        if started.elapsed() >= STABLE_SESSION {
            backoff = settings.reconnect_min;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stopped(&mut shutdown) => return,
        }
        backoff = (backoff * 2).min(settings.reconnect_max);
    }
}

async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    // A dropped sender also means stop.
    let _ = shutdown.wait_for(|s| *s).await;
}

/// One session's state.
struct Stream {
    state: Arc<State>,
    source: EventSource,
    settings: SubscriberSettings,
    seq: SeqTracker,
    partial: bool,
    live: bool,
}

impl Stream {
    fn new(state: Arc<State>, source: EventSource, settings: SubscriberSettings) -> Self {
        Self {
            state,
            source,
            settings,
            seq: SeqTracker::new(),
            partial: true,
            live: false,
        }
    }

    fn address(&self) -> &str {
        &self.source.address
    }

    /// Connects, rebuilds the history, then follows the live stream until it breaks.
    async fn session(&mut self) -> StreamError {
        match self.session_inner().await {
            Ok(never) => match never {},
            Err(e) => e,
        }
    }

    async fn session_inner(&mut self) -> Result<std::convert::Infallible, StreamError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.settings.connect_timeout);
        let mut sub = SubSocket::with_options(options);
        let mut monitor = sub.monitor();
        sub.connect(&self.source.endpoint).await?;
        sub.subscribe(&self.source.topic).await?;
        self.state.kv_stream(self.address(), |s| s.sessions += 1);

        // The engine may have stored blocks before we listened: rebuild from its buffer.
        self.partial = true;
        if self.source.replay_endpoint.is_some() {
            match self.replay_from(0).await {
                Ok(batches) => {
                    self.partial = batches.first().is_some_and(|(seq, _)| *seq != 0);
                    for (seq, payload) in batches {
                        self.apply_replayed(seq, payload);
                    }
                    self.count_replay(true, None);
                }
                Err(e) => self.count_replay(false, Some(&e)),
            }
        }
        self.live = true;
        self.state.set_event_stream(self.address(), true);
        let partial = self.partial;
        self.state.kv_stream(self.address(), |s| {
            s.connected = true;
            s.partial = partial;
        });
        tracing::info!(endpoint = %self.source.address, publisher = %self.source.endpoint,
            partial, "KV-event stream live");

        loop {
            tokio::select! {
                message = sub.recv() => {
                    let frames = message?.into_vec();
                    self.on_live(frames).await;
                }
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => {
                        return Err(StreamError::Disconnected);
                    }
                    Some(_) => {}
                },
            }
        }
    }

    /// One live message `[topic, seq, payload]`.
    async fn on_live(&mut self, frames: Vec<Bytes>) {
        let [_topic, seq, payload] = frames.as_slice() else {
            self.decode_failed(&DecodeError::Frames(frames.len()));
            return;
        };
        let seq = match decode_seq(seq) {
            Ok(s) => s,
            Err(e) => return self.decode_failed(&e),
        };
        let batch = match decode_event_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.decode_failed(&e);
                // Its rank is unreadable; count it as rank 0's (one publisher per socket), so
                // the next batch continues the sequence instead of replaying the bad one again.
                self.seq.applied(0, seq);
                return;
            }
        };
        self.observe_lag(batch.ts);
        let rank = batch.data_parallel_rank.unwrap_or(0);
        let mut verdict = self.seq.classify(rank, seq, payload);
        if verdict == Verdict::Restart {
            tracing::warn!(endpoint = %self.source.address, seq, last = ?self.seq.last(rank),
                "KV-event sequence went backwards: publisher restarted, dropping state");
            self.reset("restart", "publisher restarted (sequence went backwards)");
            verdict = self.seq.classify(rank, seq, payload);
            if verdict == Verdict::Apply {
                // Batch 0 of a new publisher: its history is all ahead of us.
                self.partial = false;
            }
        }
        match verdict {
            Verdict::Apply => {
                self.apply_batch(rank, seq, &batch);
                self.seq.applied(rank, seq);
                self.state.note_event_batch_in_sequence(self.address());
            }
            Verdict::Restart => {
                self.apply_batch(rank, seq, &batch);
                self.seq.applied(rank, seq);
            }
            Verdict::Duplicate => {}
            Verdict::Gap { from } => self.fill_gap(rank, from, seq, batch).await,
        }
        self.publish_status();
    }

    /// Batches `from..seq` of `rank` are missing: replay them, or drop the state.
    async fn fill_gap(&mut self, rank: u32, from: u64, seq: u64, batch: EventBatch) {
        let first_contact = self.seq.last(rank).is_none();
        if !first_contact {
            self.state.telemetry().count_kv_gap(&self.source.address);
            self.state.kv_stream(self.address(), |s| s.gaps += 1);
            tracing::info!(endpoint = %self.source.address, from, seq, "KV-event gap, replaying");
        }
        let mut batches: Vec<(u64, Bytes, EventBatch)> = Vec::new();
        let mut covered = false;
        if self.source.replay_endpoint.is_some() {
            let decoded = match self.replay_from(from).await {
                Ok(raw) => raw
                    .into_iter()
                    .map(|(s, p)| {
                        decode_event_batch(&p)
                            .map(|b| (s, p, b))
                            .map_err(|e| StreamError::BadReplay(format!("batch {s}: {e}")))
                    })
                    .collect::<Result<Vec<_>, _>>(),
                Err(e) => Err(e),
            };
            match decoded {
                Ok(all) => {
                    batches = all
                        .into_iter()
                        .filter(|(_, _, b)| b.data_parallel_rank.unwrap_or(0) == rank)
                        .collect();
                    // The replay fills the gap when it starts exactly where we stopped and runs
                    // without holes up to the live batch.
                    covered = batches.first().is_some_and(|(s, ..)| *s == from)
                        && batches.windows(2).all(|w| w[1].0 == w[0].0 + 1)
                        && batches.last().is_some_and(|(s, ..)| *s + 1 >= seq);
                    let why = (!covered).then(|| {
                        StreamError::BadReplay(format!(
                            "replay holds {:?}..={:?}, the gap is {from}..{seq}",
                            batches.first().map(|b| b.0),
                            batches.last().map(|b| b.0)
                        ))
                    });
                    self.count_replay(covered, why.as_ref());
                }
                Err(e) => self.count_replay(false, Some(&e)),
            }
        }
        if covered && first_contact && from == 0 {
            // The whole history from the publisher's first batch: exact again.
            self.partial = false;
        }
        if !covered {
            if first_contact {
                // Joined mid-stream without a usable replay: nothing to drop, the view is partial.
                self.partial = true;
            } else {
                tracing::warn!(endpoint = %self.source.address, from, seq,
                    "KV-event gap cannot be replayed: dropping the endpoint's state");
                self.reset("unreplayable_gap", "gap could not be replayed");
                // What the lost batches said is unknown: degraded until the stream runs clean.
                self.state.note_event_gap(self.address());
            }
            // Whatever the replay did return is still the newest history: keep its tail.
            batches.retain(|(s, ..)| *s >= from);
            let contiguous_from = batches
                .windows(2)
                .rposition(|w| w[1].0 != w[0].0 + 1)
                .map_or(0, |i| i + 1);
            batches.drain(..contiguous_from);
        }
        let mut applied_live = false;
        for (s, p, b) in batches {
            if s == seq {
                applied_live = true;
            }
            self.apply_batch(rank, s, &b);
            self.seq.replayed(rank, s, p);
        }
        if !applied_live && self.seq.last(rank).is_none_or(|l| seq > l) {
            self.apply_batch(rank, seq, &batch);
            self.seq.applied(rank, seq);
        }
    }

    /// Applies a replayed payload of the initial history.
    fn apply_replayed(&mut self, seq: u64, payload: Bytes) {
        match decode_event_batch(&payload) {
            Ok(batch) => {
                let rank = batch.data_parallel_rank.unwrap_or(0);
                if self.seq.last(rank).is_some_and(|l| seq <= l) {
                    return;
                }
                if self.seq.last(rank).is_some_and(|l| seq != l + 1) {
                    // A hole inside the replay itself: what came before it may be incomplete.
                    self.partial = true;
                }
                self.apply_batch(rank, seq, &batch);
                self.seq.replayed(rank, seq, payload);
            }
            Err(e) => self.decode_failed(&e),
        }
    }

    fn apply_batch(&mut self, rank: u32, seq: u64, batch: &EventBatch) {
        let address = self.source.address.as_str();
        let t = self.state.telemetry();
        let result = self.state.apply_kv_batch(
            address,
            &self.source.model,
            &batch.events,
            batch.skipped.other_group_stores,
            &mut self.partial,
        );
        t.count_kv_batch(
            address,
            result.applied,
            result.unknown_parents,
            &batch.skipped,
        );
        if let Some(e) = &result.dropped {
            t.count_kv_reset(address, "apply_error");
            tracing::warn!(endpoint = %address, seq, rank, error = %e,
                "KV event could not be applied: dropped the endpoint's state");
        }
        let (applied, error) = (result.applied as u64, result.dropped.map(|e| e.to_string()));
        self.state.kv_stream(address, |s| {
            s.batches += 1;
            s.events += applied;
            s.last_seq.insert(rank, seq);
            if let Some(e) = error {
                s.resets += 1;
                s.last_error = Some(e);
            }
        });
    }

    /// An undecodable message: what it said is unknown, so the view cannot be trusted.
    fn decode_failed(&mut self, e: &DecodeError) {
        tracing::warn!(endpoint = %self.source.address, error = %e,
            "undecodable KV-event message: dropping the endpoint's state");
        self.state
            .telemetry()
            .count_kv_decode_error(&self.source.address);
        self.state
            .kv_stream(self.address(), |s| s.decode_errors += 1);
        self.reset("decode_error", &e.to_string());
    }

    /// Drops the endpoint's state and sequence history; the view is partial from here.
    fn reset(&mut self, reason: &'static str, message: &str) {
        self.state.clear_precise(&self.source.address);
        self.seq.reset();
        self.partial = true;
        self.state
            .telemetry()
            .count_kv_reset(&self.source.address, reason);
        self.state.kv_stream(&self.source.address, |s| {
            s.resets += 1;
            s.last_seq.clear();
            s.last_error = Some(message.to_string());
        });
    }

    fn count_replay(&self, ok: bool, error: Option<&StreamError>) {
        self.state
            .telemetry()
            .count_kv_replay(&self.source.address, if ok { "ok" } else { "failed" });
        let message = error.map(|e| format!("replay: {e}"));
        if let Some(m) = &message {
            tracing::warn!(endpoint = %self.source.address, error = %m, "KV-event replay failed");
        }
        self.state.kv_stream(self.address(), |s| {
            if ok {
                s.replays += 1;
            } else {
                s.replay_failures += 1;
            }
            if message.is_some() {
                s.last_error = message;
            }
        });
    }

    fn observe_lag(&self, ts: f64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let lag_ms = (now - ts) * 1e3;
        if lag_ms.is_finite() {
            self.state
                .telemetry()
                .observe_kv_lag(&self.source.address, lag_ms / 1e3);
            self.state
                .kv_stream(self.address(), |s| s.lag_ms = Some(lag_ms));
        }
    }

    fn publish_status(&self) {
        let partial = self.partial;
        self.state
            .kv_stream(self.address(), |s| s.partial = partial);
    }

    /// Asks the replay socket for every buffered batch with `seq >= from`.
    async fn replay_from(&self, from: u64) -> Result<Vec<(u64, Bytes)>, StreamError> {
        let Some(endpoint) = &self.source.replay_endpoint else {
            return Ok(Vec::new());
        };
        let timeout = self.settings.replay_timeout;
        tokio::time::timeout(
            timeout,
            replay(endpoint, from, self.settings.connect_timeout),
        )
        .await
        .map_err(|_| StreamError::ReplayTimeout(timeout))?
    }
}

/// One replay request on a fresh DEALER socket: `["", from]` out, then
/// `["", topic, seq, payload]` per batch until the end marker `["", "", -1, ""]`.
pub async fn replay(
    endpoint: &str,
    from: u64,
    connect_timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, StreamError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(connect_timeout);
    let mut dealer = DealerSocket::with_options(options);
    dealer.connect(endpoint).await?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|e| StreamError::BadReplay(e.to_string()))?;
    dealer.send(request).await?;
    let mut out = Vec::new();
    loop {
        let mut frames = dealer.recv().await?.into_vec();
        // The ROUTER's empty delimiter frame comes first.
        if frames.len() == 4 && frames[0].is_empty() {
            frames.remove(0);
        }
        let [_topic, seq, payload] = frames.as_slice() else {
            return Err(StreamError::BadReplay(format!("{} frames", frames.len())));
        };
        let seq = decode_seq(seq).map_err(|e| StreamError::BadReplay(e.to_string()))?;
        if seq == END_SEQ {
            return Ok(out);
        }
        if out.len() >= MAX_REPLAY_BATCHES {
            return Err(StreamError::ReplayTooLong);
        }
        out.push((seq, payload.clone()));
    }
}
