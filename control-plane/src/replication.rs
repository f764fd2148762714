//! Active-active control planes: every replica's decisions and outcomes go through one NATS
//! JetStream stream, and every replica applies everyone's.
//!
//! A lone control plane needs none of this (no `replication:` section: its [`SyncLog`] numbers
//! its own entries). With the section, each replica publishes the entries it would have
//! appended to its log (its route calls, feedback batches and proxies' sync reports) to one
//! subject that a stream captures, and reads the stream back with an ordered consumer. Each
//! entry then takes its place in every replica's log under the same number (its stream
//! sequence), and every replica's router applies the entries other replicas published. So:
//!
//! - any replica serves any proxy: a proxy's `since` means the same in every replica's log,
//!   and a proxy that reaches a replica a little behind the last one it synced with gets
//!   nothing new rather than a replay (`SyncLog::since`);
//! - a replica that starts or restarts replays the stream from its start (at most `max_age_s`
//!   old) before it reports ready on `/readyz`, so it never serves from a cold index;
//! - NATS itself is the distributed engine: no protocol of ours between replicas, no leader.
//!
//! What each replica still does alone: scraping `/metrics`, the KV-event streams of precise
//! mode (each replica rebuilds the engines' index from the engines), and the learned latency
//! terms, since all of them come from the engines, not from other replicas.
//!
//! [`SyncLog`]: scorer_core::sync::SyncLog

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use scorer_core::sync::SyncEvent;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::state::State;

/// The `replication:` section: where the shared stream lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicationConfig {
    /// NATS server URL, e.g. `nats://nats.kvroute.svc:4222`.
    pub nats_url: String,
    /// JetStream stream name; replicas sharing state use the same one.
    #[serde(default = "default_stream")]
    pub stream: String,
    /// Subject the stream captures; replicas publish their entries here.
    #[serde(default = "default_subject")]
    pub subject: String,
    /// How long the stream keeps entries: how far back a (re)starting replica catches up.
    #[serde(default = "default_max_age_s")]
    pub max_age_s: u64,
    /// Most messages the stream keeps (each carries up to [`MAX_EVENTS_PER_MESSAGE`] entries).
    #[serde(default = "default_max_messages")]
    pub max_messages: i64,
}

fn default_stream() -> String {
    "KVROUTE_SYNC".into()
}
fn default_subject() -> String {
    "kvroute.sync".into()
}
fn default_max_age_s() -> u64 {
    300
}
fn default_max_messages() -> i64 {
    100_000
}

/// Why a `replication:` section is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReplicationConfigError {
    /// The URL is empty or not a `nats://`, `tls://` or `ws(s)://` URL.
    #[error("replication.nats_url {0:?}: need nats://host:port (or tls://, ws://, wss://)")]
    Url(String),
    /// JetStream names may not contain whitespace, `.`, `*`, `>` or path separators.
    #[error("replication.stream {0:?}: need a name without whitespace, '.', '*', '>', '/' or '\\'")]
    Stream(String),
    /// A subject to publish on must be non-empty and without wildcards.
    #[error("replication.subject {0:?}: need a subject without wildcards or whitespace")]
    Subject(String),
    /// Zero keeps nothing to catch up from.
    #[error("replication.max_age_s and replication.max_messages must be positive")]
    Retention,
}

impl ReplicationConfig {
    /// Checks what NATS would refuse later, so a bad section fails at start with its field.
    pub fn validate(&self) -> Result<(), ReplicationConfigError> {
        let url = self.nats_url.trim();
        let scheme_ok = ["nats://", "tls://", "ws://", "wss://"]
            .iter()
            .any(|s| url.starts_with(s) && url.len() > s.len());
        if !scheme_ok {
            return Err(ReplicationConfigError::Url(self.nats_url.clone()));
        }
        let bad_stream = |c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\');
        if self.stream.is_empty() || self.stream.contains(bad_stream) {
            return Err(ReplicationConfigError::Stream(self.stream.clone()));
        }
        let bad_subject = |c: char| c.is_whitespace() || matches!(c, '*' | '>');
        if self.subject.is_empty()
            || self.subject.contains(bad_subject)
            || self.subject.split('.').any(str::is_empty)
        {
            return Err(ReplicationConfigError::Subject(self.subject.clone()));
        }
        if self.max_age_s == 0 || self.max_messages <= 0 {
            return Err(ReplicationConfigError::Retention);
        }
        Ok(())
    }
}

/// Most entries one message carries; an entry's log number is its message's stream sequence
/// times this, plus its place in the message, so numbers increase along the stream.
pub const MAX_EVENTS_PER_MESSAGE: usize = 1 << SEQ_SHIFT;
const SEQ_SHIFT: u32 = 12;
/// Messages are cut below NATS's default 1 MiB payload limit.
const MAX_MESSAGE_BYTES: usize = 768 * 1024;
/// Batches of entries waiting for the publisher; past it, entries are dropped and counted
/// (other replicas then expire those in-flight entries, as they would a lost feedback batch).
pub const OUTBOX_BATCHES: usize = 4096;

/// How long a replica that cannot reach NATS at start waits before it reports ready and
/// serves alone: routing on its own state beats a gateway failing open on every request.
pub const SERVE_ALONE_AFTER: Duration = Duration::from_secs(10);

/// The log number of entry `index` of the message at `stream_seq`.
pub fn log_seq(stream_seq: u64, index: usize) -> u64 {
    (stream_seq << SEQ_SHIFT) | index as u64
}

/// One message on the stream: a batch of entries from one control-plane replica.
#[derive(Debug, Serialize, Deserialize)]
struct Envelope {
    /// The publishing replica, so it does not apply its own entries twice.
    replica: u64,
    events: Vec<SyncEvent>,
}

/// How long a session waits for a lost NATS connection to come back before the replica logs
/// alone: longer than a reconnect to a restarting server, short enough that its proxies do not
/// go long without each other's decisions.
const NATS_LOST_AFTER: Duration = Duration::from_secs(2);

/// How long ago (ms, wall clock) a message published at `published_unix_ns` was published; 0
/// when the clocks disagree (published "in the future").
fn published_age_ms(published_unix_ns: i128) -> u64 {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    u64::try_from((now_ns - published_unix_ns) / 1_000_000).unwrap_or(0)
}

/// Where [`State`] puts the entries it would have logged; the replication task drains it.
pub type Outbox = mpsc::Sender<Vec<SyncEvent>>;

/// The outbox pair for one control plane.
pub fn outbox() -> (Outbox, mpsc::Receiver<Vec<SyncEvent>>) {
    mpsc::channel(OUTBOX_BATCHES)
}

/// Encodes `events` into messages of at most [`MAX_EVENTS_PER_MESSAGE`] entries and about
/// [`MAX_MESSAGE_BYTES`]; an entry too large for any message on its own is dropped and
/// counted in the second value.
fn encode(replica: u64, events: &[SyncEvent]) -> (Vec<Bytes>, usize) {
    let prefix = format!("{{\"replica\":{replica},\"events\":[");
    let mut messages = Vec::new();
    let mut dropped = 0;
    let mut buf = String::new();
    let mut count = 0;
    let finish = |buf: &mut String, count: &mut usize, messages: &mut Vec<Bytes>| {
        if *count > 0 {
            buf.push_str("]}");
            messages.push(Bytes::from(std::mem::take(buf)));
            *count = 0;
        }
    };
    for event in events {
        let Ok(json) = serde_json::to_string(event) else {
            dropped += 1;
            continue;
        };
        if prefix.len() + json.len() + 2 > MAX_MESSAGE_BYTES {
            dropped += 1;
            continue;
        }
        if count == MAX_EVENTS_PER_MESSAGE || buf.len() + json.len() + 3 > MAX_MESSAGE_BYTES {
            finish(&mut buf, &mut count, &mut messages);
        }
        if count == 0 {
            buf.push_str(&prefix);
        } else {
            buf.push(',');
        }
        buf.push_str(&json);
        count += 1;
    }
    finish(&mut buf, &mut count, &mut messages);
    (messages, dropped)
}

/// A name for a stream incarnation: a stream deleted and created again restarts its
/// sequence numbers, so copies numbered by the old one must start over. The creation time's
/// text stands in for it (the same whichever time library async-nats was built with).
fn stream_id(name: &str, created: &impl std::fmt::Debug) -> u64 {
    xxhash_rust::xxh3::xxh3_64(format!("{name}\u{0}{created:?}").as_bytes()).max(2)
}

/// Runs replication until `stop`: connects (retrying), replays the stream, then publishes this
/// replica's entries and applies everyone else's. Survives NATS going away: the client
/// reconnects, and a lost stream is set up again (its copies then start over).
pub async fn run(
    state: Arc<State>,
    config: ReplicationConfig,
    mut outbox: mpsc::Receiver<Vec<SyncEvent>>,
    mut stop: watch::Receiver<bool>,
) {
    let replica = state.replica_id();
    let started = Instant::now();
    let mut backoff = Duration::from_millis(200);
    loop {
        let session = session(&state, &config, replica, &mut outbox);
        tokio::select! {
            result = session => {
                state.telemetry().replication_connected(false);
                let Err(e) = result else {
                    return; // The state is gone: nothing left to replicate.
                };
                tracing::warn!(error = %e, url = %config.nats_url,
                    "replication: NATS session ended; logging alone until it is back");
                state.end_replication();
                if !state.is_ready() && started.elapsed() >= SERVE_ALONE_AFTER {
                    tracing::warn!("replication: NATS unreachable since start; serving alone");
                    state.set_ready_alone();
                }
            }
            _ = stop.changed() => return,
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One connection's worth of replication; returns only on an error.
async fn session(
    state: &State,
    config: &ReplicationConfig,
    replica: u64,
    outbox: &mut mpsc::Receiver<Vec<SyncEvent>>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use async_nats::jetstream::{self, consumer, stream};

    let client = async_nats::ConnectOptions::new()
        .name("kvroute-control-plane")
        .connect(config.nats_url.as_str())
        .await
        .context("connecting")?;
    let js = jetstream::new(client.clone());
    let mut shared = js
        .get_or_create_stream(stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.subject.clone()],
            max_age: Duration::from_secs(config.max_age_s),
            max_messages: config.max_messages,
            storage: stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .context("creating the stream")?;
    let info = shared.info().await.context("reading the stream's info")?;
    let (id, first, last) = (
        stream_id(&config.stream, &info.created),
        info.state.first_sequence,
        info.state.last_sequence,
    );
    let consumer = shared
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .context("creating the consumer")?;
    let mut messages = consumer.messages().await.context("consuming")?;
    // From here on the log is numbered by the stream; what this replica logged alone so far is
    // published like any new entry.
    state.begin_replication(id, log_seq(first.max(1), 0));
    state.telemetry().replication_connected(true);
    let started = Instant::now();
    let mut caught_up = last < first.max(1);
    if caught_up {
        state.set_replication_ready(started.elapsed());
    }
    tracing::info!(stream = %config.stream, first, last, "replication: replaying the stream");
    // The client reconnects on its own and the consumer waits meanwhile, so a NATS that went
    // away would never end the session: watch the connection and give up after a grace period,
    // so this replica logs alone (its proxies keep seeing each other) until NATS is back.
    let mut health = tokio::time::interval(Duration::from_millis(250));
    let mut down_since: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = health.tick() => {
                if client.connection_state() == async_nats::connection::State::Connected {
                    down_since = None;
                } else {
                    let since = *down_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= NATS_LOST_AFTER {
                        anyhow::bail!("disconnected for {:?}", since.elapsed());
                    }
                }
            }
            batch = outbox.recv() => {
                let Some(batch) = batch else { return Ok(()) };
                let (encoded, dropped) = encode(replica, &batch);
                state.telemetry().count_replication_dropped(dropped);
                for message in encoded {
                    client
                        .publish(config.subject.clone(), message)
                        .await
                        .context("publishing")?;
                }
                state.telemetry().count_replication_published(batch.len() - dropped);
            }
            message = messages.next() => {
                let message = match message {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "replication: consumer error");
                        continue;
                    }
                    None => anyhow::bail!("the stream's consumer ended"),
                };
                let Ok(meta) = message.info() else { continue };
                let (seq, pending) = (meta.stream_sequence, meta.pending);
                let age_ms = published_age_ms(meta.published.unix_timestamp_nanos());
                match serde_json::from_slice::<Envelope>(&message.payload) {
                    Ok(envelope) => {
                        let own = envelope.replica == replica;
                        let applied = state.apply_replicated(own, seq, envelope.events, age_ms);
                        state.telemetry().count_replication_applied(applied);
                    }
                    Err(e) => {
                        state.telemetry().count_replication_dropped(1);
                        tracing::warn!(error = %e, seq, "replication: unreadable message skipped");
                    }
                }
                if !caught_up && (pending == 0 || seq >= last) {
                    caught_up = true;
                    state.set_replication_ready(started.elapsed());
                    tracing::info!(
                        seq, elapsed_ms = started.elapsed().as_millis() as u64,
                        "replication: caught up with the stream"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scorer_core::test_util::outcome_event;

    fn config() -> ReplicationConfig {
        serde_yaml_ng::from_str("nats_url: nats://127.0.0.1:4222\n").unwrap()
    }

    #[test]
    fn defaults_and_validation() {
        let c = config();
        assert_eq!(
            (c.stream.as_str(), c.subject.as_str()),
            ("KVROUTE_SYNC", "kvroute.sync")
        );
        assert!(c.validate().is_ok());
        for (field, bad) in [
            ("nats_url", "127.0.0.1:4222"),
            ("nats_url", "nats://"),
            ("stream", "a.b"),
            ("stream", "a b"),
            ("subject", "kvroute.*"),
            ("subject", "kvroute..sync"),
        ] {
            let mut c = config();
            match field {
                "nats_url" => c.nats_url = bad.into(),
                "stream" => c.stream = bad.into(),
                _ => c.subject = bad.into(),
            }
            assert!(c.validate().is_err(), "{field} = {bad:?} passed");
        }
        let mut c = config();
        c.max_age_s = 0;
        assert_eq!(c.validate(), Err(ReplicationConfigError::Retention));
        assert!(serde_yaml_ng::from_str::<ReplicationConfig>("nats: x\n").is_err());
    }

    #[test]
    fn encoding_round_trips_and_cuts_messages() {
        let events: Vec<SyncEvent> = (0..(MAX_EVENTS_PER_MESSAGE as u64 + 5))
            .map(|id| outcome_event(7, id))
            .collect();
        let (messages, dropped) = encode(3, &events);
        assert_eq!((messages.len(), dropped), (2, 0));
        let mut back = Vec::new();
        for m in &messages {
            assert!(m.len() <= MAX_MESSAGE_BYTES);
            let e: Envelope = serde_json::from_slice(m).unwrap();
            assert_eq!(e.replica, 3);
            back.extend(e.events);
        }
        assert_eq!(back, events);
        assert_eq!(encode(3, &[]).0.len(), 0);
    }

    #[test]
    fn log_numbers_increase_along_the_stream() {
        assert!(log_seq(1, MAX_EVENTS_PER_MESSAGE - 1) < log_seq(2, 0));
        assert!(log_seq(2, 0) < log_seq(2, 1));
    }

    #[test]
    fn stream_ids_name_incarnations() {
        assert_ne!(stream_id("S", &1), stream_id("S", &2));
        assert_ne!(stream_id("S", &1), stream_id("T", &1));
        assert!(stream_id("S", &1) > 1);
    }
}
