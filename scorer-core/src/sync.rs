//! Routing state replicated to every router: the control plane's log, and a proxy's local copy.
//!
//! A proxy that decides locally runs its own [`Router`] and must see the fleet as the control
//! plane does: every other proxy's decisions (their in-flight load and the prompt blocks they
//! sent where), every outcome (which releases that load and teaches the latency model), and the
//! scraped endpoint state. The control plane keeps one append-only [`SyncLog`] of decisions and
//! outcomes from every source; each copy pulls the entries after the last sequence number it
//! has seen and applies them through the same `Router` calls that produced the control plane's
//! own state ([`Router::record_decision`], [`Router::feedback`]). Endpoint state (the scrapes)
//! is versioned by the control plane's router ([`Router::endpoint_changes`]): a copy names the
//! table and version it holds, and gets only the endpoints that changed since, or the whole
//! table when it names none or one that cannot be patched. So every copy is the same state
//! machine fed the same inputs, a little later: staleness is the pull interval plus one round
//! trip.
//!
//! Sans-IO like the rest of the crate: the proxy's tick and the HTTP call live in the filter,
//! the log's owner in the control plane; fleet-sim drives both in virtual time.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::pools::ServedModel;
use crate::protocol::{FirstToken, Outcome, RouteRequest, is_zero, is_zero_u32};
use crate::router::{Decision, EndpointMetrics, Router, RouterConfig};

/// Path of the sync call a locally deciding proxy makes on its tick.
pub const SYNC_PATH: &str = "/v1/sync";

/// Bits of a decision id that count decisions within one replica; the bits above name the
/// replica ([`SyncResponse::replica`]), so ids from different proxies never collide.
pub const REPLICA_SHIFT: u32 = 40;

/// How long after it last saw another router a copy still counts as deciding beside others
/// ([`LocalConfig::defer_above_ms`]): one of their decisions applied, or the control plane
/// naming other copies syncing with it ([`SyncResponse::others`]). A copy alone decides
/// everything itself. Also how long the control plane counts a copy as syncing after its last
/// call.
pub const OTHERS_DECIDING_WINDOW_MS: u64 = 60_000;

/// How often a proxy's copy syncs by default (the filter's `sync_interval_ms`, and fleet-sim's
/// `kvroute-local`). Between syncs a copy cannot see the other copies' decisions, and what it
/// misses grows with the interval: on fleet-sim's tuning seeds (101-110, 16 copies) the
/// Mooncake trace's TTFT p50 was 8 % above the single router's at 50 ms, 2.5 % at 25 ms and
/// 2 % at 10 ms. Each halving doubles the sync calls and, on a busy fleet, their bytes, so
/// large fleets may want more (docs/BENCHMARKS.md has the cost per interval).
pub const DEFAULT_SYNC_INTERVAL_MS: u64 = 25;

/// The `router.local` section: what a copy deciding in a proxy ([`LocalRouter`]) leaves to the
/// control plane. Served to every copy with the rest of the router configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalConfig {
    /// A request a copy would place by load (a miss, or a spill off the replica holding its
    /// prefix) whose own prefill it predicts to take at least this long, in ms, is decided by
    /// the control plane instead ([`Router::route_or_defer`]), while other routers decide
    /// beside this copy. Copies between syncs all see the same loads and would send such
    /// misses to the same replica; the control plane sees every one of them, and a route call
    /// costs well under a millisecond against a prefill this long. A session's first request
    /// goes to the control plane as well, whatever its prefill: it places the whole session,
    /// and copies cannot see each other's new sessions between syncs. 0: every approximate
    /// request is decided locally.
    pub defer_above_ms: f64,
    /// The prefill contention's weight
    /// ([`crate::router::ScoringConfig::prefill_contention_weight`]) for a request scored to
    /// its first token (chat, completions) that a copy decides while other routers decide
    /// beside it; a request scored to its last token (the agent APIs) keeps the scoring's
    /// weight, as does everything the control plane decides. The term prices the prefill the
    /// other routers sent to each replica over the last second, which a copy sees up to one
    /// sync late, and for a first-token request it is a second-order price (its decode, not
    /// its wait): on fleet-sim's local tuning seeds (101-120, 16 copies, 25 ms sync) the
    /// multi-turn TTFT p99 ratio to the single router was 1.115 ± 0.048 at the scoring's 0.5
    /// and 0.969 ± 0.029 at 0, shared-prefix and Mooncake unchanged (docs/BENCHMARKS.md).
    /// Left out of the serialized form at its default, so a filter built before it still
    /// accepts the copy's configuration.
    #[serde(skip_serializing_if = "is_zero_weight")]
    pub first_token_contention_weight: f64,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            defer_above_ms: 50.0,
            first_token_contention_weight: 0.0,
        }
    }
}

fn is_zero_weight(w: &f64) -> bool {
    *w == 0.0
}

/// One decision a router took, reported so that every other copy accounts for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// The deciding router's id; the outcome report names it.
    pub decision_id: u64,
    /// The chosen endpoint (`ip:port`).
    pub endpoint: String,
    /// What the decision was made on (hashes and numbers only, as in a route call).
    pub request: RouteRequest,
    /// How long ago the decision was taken, ms, as of when this record was sent: a log
    /// replayed to a new copy (or a control plane replaying the shared stream) holds old
    /// decisions whose prefill is long done, and must not count it as queued now.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub age_ms: u64,
}

/// What a locally deciding proxy sends on its tick.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncRequest {
    /// The replica tag the control plane gave this copy; `None` until it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<u32>,
    /// The log sequence number after the last entry this copy applied (0: none yet).
    #[serde(default)]
    pub since: u64,
    /// The log `since` counts in ([`SyncResponse::log`]; 0: none yet). Control-plane replicas
    /// sharing one stream share one log id, so a copy may sync with any of them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub log: u64,
    /// Decisions taken locally since the last sync.
    #[serde(default)]
    pub decisions: Vec<DecisionRecord>,
    /// Outcomes of local decisions since the last sync.
    #[serde(default)]
    pub outcomes: Vec<Outcome>,
    /// First tokens of local decisions' responses since the last sync.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first_tokens: Vec<FirstToken>,
    /// The endpoint table this copy holds ([`SyncResponse::table`]; 0: none, or from a control
    /// plane that does not version it): with `table_version`, what a delta is taken against.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub table: u64,
    /// The version of that table the copy holds ([`SyncResponse::table_version`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub table_version: u64,
    /// The copy reads block-hash lists as base64 ([`crate::protocol::hash_list`]): the answer
    /// may carry them so. Absent (an older copy): arrays only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compact_hashes: bool,
}

/// One entry of the replicated log. On the wire an object tagged by `kind` (`decision`,
/// `outcome`, `first_token`) beside the variant's fields; read by a hand-written
/// [`Deserialize`] (see `SyncEventVisitor`) rather than serde's internally tagged one, which
/// buffers every entry into a generic tree before reading it again.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SyncEvent {
    /// A decision some router took.
    Decision {
        /// The replica that took it (0: the control plane itself, on a route call).
        origin: u32,
        /// The decision (boxed: it is three times an outcome's size, and half the log's
        /// entries are outcomes).
        record: Box<DecisionRecord>,
    },
    /// The outcome of a decision.
    Outcome {
        /// The replica that reported it.
        origin: u32,
        /// The outcome.
        outcome: Outcome,
    },
    /// A decision's response streamed its first token ([`Router::first_token`]).
    FirstToken {
        /// The replica that reported it.
        origin: u32,
        /// The decision.
        decision_id: u64,
        /// The proxy's time from routing to the first token ([`FirstToken::ttft_ms`]).
        #[serde(skip_serializing_if = "Option::is_none")]
        ttft_ms: Option<u64>,
    },
}

/// The three kinds of [`SyncEvent`], as `kind` spells them.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum SyncEventKind {
    Decision,
    Outcome,
    FirstToken,
}

/// The fields of every kind of [`SyncEvent`]; each kind's own fields are distinct, so each value
/// is read straight into its type whatever the order, and unknown fields (a newer writer's) are
/// skipped.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum SyncEventField {
    Kind,
    Origin,
    Record,
    Outcome,
    DecisionId,
    TtftMs,
    #[serde(other)]
    Unknown,
}

/// Reads a [`SyncEvent`] in one pass: a log answer holds thousands of them, and a proxy's VM
/// reads every other router's entries on every tick.
struct SyncEventVisitor;

impl<'de> serde::de::Visitor<'de> for SyncEventVisitor {
    type Value = SyncEvent;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sync event (an object with `kind`)")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<SyncEvent, A::Error> {
        use serde::de::Error;
        let mut kind = None;
        let mut origin = None;
        let mut record: Option<Box<DecisionRecord>> = None;
        let mut outcome = None;
        let mut decision_id = None;
        let mut ttft_ms: Option<Option<u64>> = None;
        fn once<T, E: Error>(slot: &mut Option<T>, value: T, name: &'static str) -> Result<(), E> {
            match slot.replace(value) {
                Some(_) => Err(E::duplicate_field(name)),
                None => Ok(()),
            }
        }
        while let Some(field) = map.next_key::<SyncEventField>()? {
            match field {
                SyncEventField::Kind => once(&mut kind, map.next_value()?, "kind")?,
                SyncEventField::Origin => once(&mut origin, map.next_value()?, "origin")?,
                SyncEventField::Record => once(&mut record, map.next_value()?, "record")?,
                SyncEventField::Outcome => once(&mut outcome, map.next_value()?, "outcome")?,
                SyncEventField::DecisionId => {
                    once(&mut decision_id, map.next_value()?, "decision_id")?;
                }
                SyncEventField::TtftMs => once(&mut ttft_ms, map.next_value()?, "ttft_ms")?,
                SyncEventField::Unknown => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        let origin = origin.ok_or_else(|| A::Error::missing_field("origin"))?;
        match kind.ok_or_else(|| A::Error::missing_field("kind"))? {
            SyncEventKind::Decision => Ok(SyncEvent::Decision {
                origin,
                record: record.ok_or_else(|| A::Error::missing_field("record"))?,
            }),
            SyncEventKind::Outcome => Ok(SyncEvent::Outcome {
                origin,
                outcome: outcome.ok_or_else(|| A::Error::missing_field("outcome"))?,
            }),
            SyncEventKind::FirstToken => Ok(SyncEvent::FirstToken {
                origin,
                decision_id: decision_id.ok_or_else(|| A::Error::missing_field("decision_id"))?,
                ttft_ms: ttft_ms.flatten(),
            }),
        }
    }
}

impl<'de> Deserialize<'de> for SyncEvent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(SyncEventVisitor)
    }
}

impl SyncEvent {
    /// Accounts for this entry in `router` as the router that logged it did: a decision through
    /// [`Router::record_decision`], an outcome through [`Router::feedback`]. Every copy and every
    /// control-plane replica applies entries through here, so they stay the same state machine.
    pub fn apply_to(&self, router: &mut Router, now_ms: u64) {
        match self {
            SyncEvent::Decision { record, .. } => {
                router.record_decision(
                    &record.request,
                    &record.endpoint,
                    record.decision_id,
                    now_ms,
                    record.age_ms,
                );
            }
            SyncEvent::Outcome { outcome, .. } => router.feedback(outcome, now_ms),
            SyncEvent::FirstToken {
                decision_id,
                ttft_ms,
                ..
            } => router.first_token(*decision_id, now_ms, *ttft_ms),
        }
    }

    /// This entry `ms` older (a decision's `age_ms` grows; an outcome has no age).
    pub fn aged(mut self, ms: u64) -> SyncEvent {
        if let SyncEvent::Decision { record, .. } = &mut self {
            record.age_ms = record.age_ms.saturating_add(ms);
        }
        self
    }

    fn origin(&self) -> u32 {
        match self {
            SyncEvent::Decision { origin, .. }
            | SyncEvent::Outcome { origin, .. }
            | SyncEvent::FirstToken { origin, .. } => *origin,
        }
    }
}

/// The control plane's view of one endpoint, sent when it changes (or whole tables).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointSnapshot {
    /// `ip:port`.
    pub address: String,
    /// Whether the control plane routes to it: false once its metrics stop answering. An
    /// endpoint just added and not yet scraped is usable, as it is on the control plane.
    #[serde(default = "usable_by_default")]
    pub usable: bool,
    /// The last scrape, if there is one and the endpoint is usable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<EndpointMetrics>,
    /// How old that scrape is, in milliseconds (clocks differ between proxy and control plane,
    /// ages do not).
    #[serde(default)]
    pub metrics_age_ms: u64,
    /// The models it serves (`/v1/models` and configuration), once known: a copy routes each
    /// request within its model's pool and within the context the endpoint serves it with.
    /// Absent: not known, and a copy forgets what it held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<ServedModel>>,
}

fn usable_by_default() -> bool {
    true
}

/// The control plane's answer to a [`SyncRequest`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncResponse {
    /// This copy's replica tag (assigned on its first sync, then echoed).
    pub replica: u32,
    /// The sequence number to send as `since` next time.
    pub next: u64,
    /// Which log `next` counts in: one control plane's own log, or the stream that
    /// control-plane replicas share. A copy whose log changed starts over.
    #[serde(default)]
    pub log: u64,
    /// The requested `since` had left the log: the copy's state is too old to patch, so it
    /// starts over from `events` (the whole log) on a fresh router.
    #[serde(default)]
    pub reset: bool,
    /// Log entries after `since`, oldest first, other origins only.
    #[serde(default)]
    pub events: Vec<SyncEvent>,
    /// Without `delta`, every endpoint the control plane routes to (a copy drops the ones
    /// missing here); with it, those whose snapshot changed after the copy's `table_version`.
    #[serde(default)]
    pub endpoints: Vec<EndpointSnapshot>,
    /// `endpoints` and `removed` patch the table the copy named ([`SyncRequest::table`]).
    /// False (and so from a control plane that never sends deltas): they replace it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delta: bool,
    /// With `delta`: endpoints removed after the copy's version, applied before `endpoints`
    /// (an endpoint removed and added again is in both).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<String>,
    /// Names the table `endpoints` come from (one control-plane process's scrapes; 0: not
    /// versioned), for the copy to send back.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub table: u64,
    /// The table's version these endpoints bring the copy to, for it to send back.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub table_version: u64,
    /// The control plane's router configuration, so local decisions score as it does: in every
    /// whole-table answer (fixed for a table's lifetime, so deltas leave it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<RouterConfig>,
    /// Other copies that synced with this control plane within [`OTHERS_DECIDING_WINDOW_MS`].
    /// They decide beside the caller before any of their decisions reach it: without this, a
    /// cold fleet's first burst (every copy fresh, none yet seeing another's decisions) was
    /// decided by each copy as if alone, and its long misses piled up.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub others: u32,
    /// The control plane reads block-hash lists as base64 ([`crate::protocol::hash_list`]):
    /// the copy may send its next decisions so. Absent (an older control plane): arrays only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compact_hashes: bool,
}

/// The control plane's replicated log: a bounded ring of decisions and outcomes.
///
/// Its bound is what a copy may lag before it must [`SyncResponse::reset`]; a fresh copy
/// replays the whole ring, which is also how it warms its prefix index without a snapshot
/// format of its own.
///
/// A lone control plane numbers its entries itself. Control-plane replicas sharing state
/// ([`SyncLog::replicate`]) number them by their place in the shared stream instead: an entry
/// pushed locally waits in an outbox until the stream hands it back with its sequence number
/// ([`SyncLog::push_replicated`]), so every replica's log is the same sequence under the same
/// numbers and a copy may sync with any replica.
#[derive(Debug, Clone)]
pub struct SyncLog {
    /// Entries with their sequence numbers, increasing (contiguous unless replicated), and
    /// when they were logged (the caller's clock), so decisions are handed out with their age.
    entries: VecDeque<(u64, u64, SyncEvent)>,
    /// The latest time a caller passed in.
    clock_ms: u64,
    /// Lowest sequence number this log answers from; a `since` below it is a reset.
    first: u64,
    /// The sequence number after the newest entry.
    next: u64,
    capacity: usize,
    next_replica: u32,
    id: u64,
    /// Names the endpoint table this log's owner serves ([`SyncResponse::table`]): fixed at
    /// creation, so it differs between control-plane processes (replicas and generations),
    /// whose scrapes and table versions are their own, even when they share one stream.
    table: u64,
    /// Replicated: entries pushed here, on their way to the shared stream.
    outbox: Option<Vec<SyncEvent>>,
    /// When each copy last synced here (by replica tag), for [`SyncResponse::others`]; tags
    /// silent for [`OTHERS_DECIDING_WINDOW_MS`] are dropped, so it holds the live copies only.
    synced_at_ms: hashbrown::HashMap<u32, u64>,
}

impl SyncLog {
    /// An empty log holding at most `capacity` entries; replica tags start at `first_replica`
    /// (a random start keeps two control-plane generations from handing out the same tags),
    /// which also names the log ([`SyncLog::id`]).
    pub fn new(capacity: usize, first_replica: u32) -> Self {
        SyncLog {
            entries: VecDeque::new(),
            clock_ms: 0,
            first: 1,
            next: 1,
            capacity: capacity.max(1),
            next_replica: first_replica.max(1),
            id: (u64::from(first_replica) << 1) | 1,
            table: (u64::from(first_replica) << 1) | 1,
            outbox: None,
            synced_at_ms: hashbrown::HashMap::new(),
        }
    }

    /// Switches to numbering by a shared stream named `id`, whose entries from `first` on
    /// this log will receive. Entries this log numbered itself move to the outbox, so they
    /// reach the stream too; entries of an earlier stream (one that was lost and set up again)
    /// are dropped instead, since every replica holds them and republishing would duplicate them.
    pub fn replicate(&mut self, id: u64, first: u64) {
        let was_replicated = self.outbox.is_some();
        let mut outbox: Vec<SyncEvent> = self.outbox.take().unwrap_or_default();
        if was_replicated {
            self.entries.clear();
        } else {
            let now = self.clock_ms;
            outbox.extend(
                self.entries
                    .drain(..)
                    .map(|(_, logged, event)| event.aged(now.saturating_sub(logged))),
            );
        }
        self.outbox = Some(outbox);
        self.id = id.max(1);
        self.first = first.max(1);
        self.next = self.first;
    }

    /// Back to numbering its own entries, as log `id`, when the shared stream is out of reach:
    /// the proxies of this replica keep seeing each other's decisions. The stream's entries are
    /// dropped (every other replica holds them); what waited in the outbox is logged here, and
    /// so is published when the stream is back ([`SyncLog::replicate`]). Copies start over once.
    pub fn go_local(&mut self, id: u64) {
        let Some(outbox) = self.outbox.take() else {
            return;
        };
        self.entries.clear();
        self.id = id.max(1);
        self.first = self.next;
        for event in outbox {
            let seq = self.next;
            self.append(seq, self.clock_ms, event);
        }
    }

    /// Whether entries are numbered by a shared stream.
    pub fn is_replicated(&self) -> bool {
        self.outbox.is_some()
    }

    /// The log's name, echoed by copies ([`SyncResponse::log`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The endpoint table's name, echoed by copies ([`SyncResponse::table`]; never 0).
    pub fn table(&self) -> u64 {
        self.table
    }

    /// Appends one entry logged at `now_ms`, dropping the oldest past the bound; replicated, it
    /// goes to the outbox instead (see [`SyncLog::take_outbox`]).
    pub fn push(&mut self, event: SyncEvent, now_ms: u64) {
        self.clock_ms = self.clock_ms.max(now_ms);
        if let Some(outbox) = self.outbox.as_mut() {
            outbox.push(event);
            return;
        }
        let seq = self.next;
        self.append(seq, now_ms, event);
    }

    /// Appends an entry the shared stream numbered `seq`, as of `now_ms` (a decision's age
    /// already counts its time in the stream). Returns false, changing nothing, for a number
    /// this log already passed (a redelivery).
    pub fn push_replicated(&mut self, seq: u64, event: SyncEvent, now_ms: u64) -> bool {
        if seq < self.next {
            return false;
        }
        self.clock_ms = self.clock_ms.max(now_ms);
        self.append(seq, now_ms, event);
        true
    }

    /// Entries pushed since the last call, for the shared stream (empty unless replicated).
    pub fn take_outbox(&mut self) -> Vec<SyncEvent> {
        self.outbox.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn append(&mut self, seq: u64, logged_ms: u64, event: SyncEvent) {
        if self.entries.len() == self.capacity
            && let Some((oldest, _, _)) = self.entries.pop_front()
        {
            self.first = oldest.saturating_add(1);
        }
        self.entries.push_back((seq, logged_ms, event));
        self.next = seq.saturating_add(1);
    }

    /// The sequence number after the newest entry.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the log holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Notes that copy `replica` synced at `now_ms` and returns how many other copies synced
    /// within [`OTHERS_DECIDING_WINDOW_MS`] (forgetting the ones silent longer).
    pub fn note_sync(&mut self, replica: u32, now_ms: u64) -> u32 {
        self.synced_at_ms
            .retain(|_, at| now_ms.saturating_sub(*at) <= OTHERS_DECIDING_WINDOW_MS);
        let others = self
            .synced_at_ms
            .keys()
            .filter(|&&tag| tag != replica)
            .count();
        self.synced_at_ms.insert(replica, now_ms);
        u32::try_from(others).unwrap_or(u32::MAX)
    }

    /// A replica tag never handed out before by this log.
    pub fn assign_replica(&mut self) -> u32 {
        let tag = self.next_replica;
        self.next_replica = self.next_replica.wrapping_add(1).max(1);
        tag
    }

    /// The entries from `since` on (0: from the start) not originated by `replica`, at most
    /// `limit` of them, the sequence number to ask for next, and whether `since` had already
    /// left the log (then everything held is returned and the copy must start over).
    ///
    /// A `since` past the newest entry (another replica of the same stream is ahead of this
    /// one) gets nothing and is handed back unchanged, never moved backwards: moving it back
    /// would replay entries the copy already applied. Decisions are handed out aged by their
    /// time in the log, as of `now_ms`.
    pub fn since(
        &self,
        since: u64,
        replica: u32,
        limit: usize,
        now_ms: u64,
    ) -> (Vec<SyncEvent>, u64, bool) {
        let reset = since != 0 && since < self.first;
        let start = if reset || since == 0 {
            0
        } else {
            self.entries.partition_point(|(seq, _, _)| *seq < since)
        };
        let mut out = Vec::new();
        let mut next = if reset {
            self.next
        } else {
            self.next.max(since)
        };
        for (seq, logged, event) in self.entries.iter().skip(start) {
            if out.len() == limit {
                next = *seq;
                break;
            }
            if event.origin() != replica {
                out.push(event.clone().aged(now_ms.saturating_sub(*logged)));
            }
        }
        (out, next, reset)
    }
}

/// Most log entries one sync answer carries; a copy further behind catches up over several
/// ticks (and decides on the state it has meanwhile).
pub const MAX_EVENTS_PER_SYNC: usize = 4096;

/// The control plane's side of a sync call: accounts for the caller's decisions and outcomes
/// in `router` (the control plane's own state) and in the log, then answers with what the
/// caller has not seen. A caller without a replica tag gets one and the whole log; a caller
/// naming no endpoint table, another one, or a version the router cannot patch gets the whole
/// table and the configuration.
pub fn serve_sync(
    log: &mut SyncLog,
    router: &mut Router,
    request: SyncRequest,
    now_ms: u64,
) -> SyncResponse {
    let (table, table_version) = (request.table, request.table_version);
    let (replica, since) = match request.replica {
        Some(replica) => (replica, request.since),
        None => (log.assign_replica(), 0),
    };
    let others = log.note_sync(replica, now_ms);
    let decisions = request
        .decisions
        .into_iter()
        .map(|record| SyncEvent::Decision {
            origin: replica,
            record: Box::new(record),
        });
    let outcomes = request
        .outcomes
        .into_iter()
        .map(|outcome| SyncEvent::Outcome {
            origin: replica,
            outcome,
        });
    let first_tokens = request
        .first_tokens
        .into_iter()
        .map(|first| SyncEvent::FirstToken {
            origin: replica,
            decision_id: first.decision_id,
            ttft_ms: first.ttft_ms,
        });
    // Decisions first, as the copy took them before their first tokens and outcomes.
    for event in decisions.chain(first_tokens).chain(outcomes) {
        event.apply_to(router, now_ms);
        log.push(event, now_ms);
    }
    let (events, next, reset) = log.since(since, replica, MAX_EVENTS_PER_SYNC, now_ms);
    let changes = (table == log.table())
        .then(|| router.endpoint_changes(table_version, now_ms))
        .flatten();
    let (endpoints, removed, delta) = match changes {
        Some((changed, removed)) => (changed, removed, true),
        None => (router.endpoint_snapshots(now_ms), Vec::new(), false),
    };
    SyncResponse {
        replica,
        next,
        log: log.id(),
        reset,
        events,
        endpoints,
        delta,
        removed,
        table: log.table(),
        table_version: router.table_version(),
        config: (!delta).then(|| router.config().clone()),
        others,
        compact_hashes: true,
    }
}

/// Writes a sync message (either way) as JSON, its block-hash lists in base64 when the peer
/// said it reads them ([`SyncRequest::compact_hashes`], [`SyncResponse::compact_hashes`]).
pub fn to_json<T: Serialize>(message: &T, compact: bool) -> serde_json::Result<Vec<u8>> {
    if compact {
        crate::protocol::hash_list::compact(|| serde_json::to_vec(message))
    } else {
        serde_json::to_vec(message)
    }
}

/// A proxy's local copy of the routing state: a [`Router`] kept current from the control
/// plane's log, that decides without any call on the request path.
#[derive(Debug)]
pub struct LocalRouter {
    router: Option<Router>,
    replica: Option<u32>,
    since: u64,
    log: u64,
    /// The endpoint table held and its version ([`SyncRequest::table`]; 0: none).
    table: u64,
    table_version: u64,
    synced_at_ms: Option<u64>,
    pending_decisions: VecDeque<DecisionRecord>,
    pending_outcomes: VecDeque<Outcome>,
    pending_first_tokens: VecDeque<FirstToken>,
    max_pending: usize,
    local_decisions: u64,
    /// When this copy last saw another router deciding beside it: applied one of their
    /// decisions, or was told of other copies syncing ([`SyncResponse::others`]).
    others_seen_at_ms: Option<u64>,
    /// Until when it defers nothing ([`LocalRouter::pause_deferral`]).
    deferral_paused_until_ms: u64,
    /// The bound on its prefix index ([`LocalRouter::with_max_index_blocks`]).
    max_index_blocks: Option<usize>,
    /// The last answer came from a control plane that reads base64 hash lists
    /// ([`SyncResponse::compact_hashes`]); forgotten when a sync fails, so a rolling upgrade
    /// that puts an older replica behind the next call still reads it.
    peer_reads_compact: bool,
}

impl LocalRouter {
    /// A copy that knows nothing yet; it decides once its first sync has landed. At most
    /// `max_pending` decisions (and as many outcomes) wait for the next sync; past that the
    /// oldest are dropped (the control plane then expires their in-flight entries).
    pub fn new(max_pending: usize) -> Self {
        LocalRouter {
            router: None,
            replica: None,
            since: 0,
            log: 0,
            table: 0,
            table_version: 0,
            synced_at_ms: None,
            pending_decisions: VecDeque::new(),
            pending_outcomes: VecDeque::new(),
            pending_first_tokens: VecDeque::new(),
            max_pending: max_pending.max(1),
            local_decisions: 0,
            others_seen_at_ms: None,
            deferral_paused_until_ms: 0,
            max_index_blocks: None,
            peer_reads_compact: false,
        }
    }

    /// Bounds the copy's prefix index to `max` blocks over all endpoints
    /// ([`Router::set_max_index_blocks`]): a proxy's memory then has a configured bound
    /// whatever KV capacity the fleet reports. `None`: each endpoint's KV capacity alone.
    pub fn with_max_index_blocks(mut self, max: Option<usize>) -> Self {
        self.max_index_blocks = max;
        if let Some(router) = self.router.as_mut() {
            router.set_max_index_blocks(max);
        }
        self
    }

    /// Whether a local decision would be made on state no older than `max_age_ms`: the copy has
    /// synced that recently and knows at least one endpoint. When it is not, the caller asks
    /// the control plane instead.
    pub fn ready(&self, now_ms: u64, max_age_ms: u64) -> bool {
        let fresh = self
            .synced_at_ms
            .is_some_and(|at| now_ms.saturating_sub(at) <= max_age_ms);
        fresh && self.router.as_ref().is_some_and(|r| r.endpoint_count() > 0)
    }

    /// Decides locally and queues the decision for the next sync. `None`: no copy yet, or a
    /// request the configuration leaves to the control plane ([`LocalConfig::defer_above_ms`]);
    /// the caller makes the route call (its decision reaches this copy with the next sync).
    pub fn route(&mut self, request: &RouteRequest, now_ms: u64, seed: u64) -> Option<Decision> {
        let others_deciding = self
            .others_seen_at_ms
            .is_some_and(|at| now_ms.saturating_sub(at) <= OTHERS_DECIDING_WINDOW_MS);
        let router = self.router.as_mut()?;
        let decision = if others_deciding {
            let defer_above_ms = if now_ms >= self.deferral_paused_until_ms {
                router.config().local.defer_above_ms
            } else {
                0.0
            };
            router.route_or_defer(request, now_ms, seed, defer_above_ms)?
        } else {
            router.route(request, now_ms, seed)
        };
        if let Some(endpoint) = decision.response.endpoints.first() {
            self.local_decisions += 1;
            push_bounded(
                &mut self.pending_decisions,
                DecisionRecord {
                    decision_id: decision.response.decision_id,
                    endpoint: endpoint.clone(),
                    request: request.clone(),
                    // Sent within a sync interval; the control plane's log ages it from there.
                    age_ms: 0,
                },
                self.max_pending,
            );
        }
        Some(decision)
    }

    /// The control plane's answer to a route call this copy made (a deferred or unready
    /// decision): applied at once, as the sync would apply it one interval later, so this
    /// copy's next decisions see the endpoint's new in-flight load and the prompt's blocks
    /// there. The sync's copy of the same decision is then a repeat and is ignored (one
    /// in-flight entry per decision id). No-op before the first sync.
    pub fn adopt(&mut self, request: &RouteRequest, endpoint: &str, decision_id: u64, now_ms: u64) {
        if let Some(router) = self.router.as_mut() {
            router.record_decision(request, endpoint, decision_id, now_ms, 0);
        }
    }

    /// Decides everything locally until `until_ms`: the caller saw a route call fail, and a
    /// request left to an unreachable control plane would be placed by no one (it fails
    /// open), where this copy's decision, however stale, still follows the cache.
    pub fn pause_deferral(&mut self, until_ms: u64) {
        self.deferral_paused_until_ms = self.deferral_paused_until_ms.max(until_ms);
    }

    /// The outcome of a local decision: applied here at once, and queued for the next sync.
    pub fn outcome(&mut self, outcome: Outcome, now_ms: u64) {
        if let Some(router) = self.router.as_mut() {
            router.feedback(&outcome, now_ms);
        }
        push_bounded(&mut self.pending_outcomes, outcome, self.max_pending);
    }

    /// A local decision's response streamed its first token: applied here at once, and queued
    /// for the next sync.
    pub fn first_token(&mut self, first: FirstToken, now_ms: u64) {
        if let Some(router) = self.router.as_mut() {
            router.first_token(first.decision_id, now_ms, first.ttft_ms);
        }
        push_bounded(&mut self.pending_first_tokens, first, self.max_pending);
    }

    /// The next sync call's body; takes the queued decisions and outcomes with it.
    pub fn sync_request(&mut self) -> SyncRequest {
        SyncRequest {
            replica: self.replica,
            since: self.since,
            log: self.log,
            decisions: self.pending_decisions.drain(..).collect(),
            outcomes: self.pending_outcomes.drain(..).collect(),
            first_tokens: self.pending_first_tokens.drain(..).collect(),
            table: self.table,
            table_version: self.table_version,
            compact_hashes: true,
        }
    }

    /// Whether the copy holds reports (decisions, outcomes, first tokens) the next sync call
    /// would carry.
    pub fn has_pending(&self) -> bool {
        !self.pending_decisions.is_empty()
            || !self.pending_outcomes.is_empty()
            || !self.pending_first_tokens.is_empty()
    }

    /// Whether the next sync call may carry its decisions' hash lists in base64
    /// ([`to_json`]): the last answer said the control plane reads them.
    pub fn peer_reads_compact(&self) -> bool {
        self.peer_reads_compact
    }

    /// A sync call failed: until an answer says otherwise, the next one is written so that
    /// any control plane reads it.
    pub fn sync_failed(&mut self) {
        self.peer_reads_compact = false;
    }

    /// Puts the reports of a sync call that reached no control plane back in front of the
    /// queues, so the next call carries them; past `max_pending` the oldest are dropped. A
    /// call that was processed after all and is sent again does little harm: a decision
    /// still in flight is recorded once per id, and a second outcome finds nothing to release
    /// (only a decision whose outcome already arrived comes back, until its in-flight TTL).
    pub fn requeue(&mut self, request: SyncRequest) {
        let max = self.max_pending;
        put_back(&mut self.pending_decisions, request.decisions, max);
        put_back(&mut self.pending_outcomes, request.outcomes, max);
        put_back(&mut self.pending_first_tokens, request.first_tokens, max);
    }

    /// Applies the control plane's answer: the endpoint table (replaced, or patched by a
    /// delta), then other routers' decisions and outcomes. A new replica tag, a new log, a
    /// reset or a new configuration starts a fresh router (so decision ids carry the tag, and
    /// no log state from before the gap survives); the endpoint table, which is the control
    /// plane's scrapes and not the log's, carries over into it for the answer to patch.
    pub fn apply(&mut self, response: SyncResponse, now_ms: u64) {
        let Some(config) = response
            .config
            .as_ref()
            .or(self.router.as_ref().map(Router::config))
        else {
            // A delta for a copy with no table (it cannot have asked for one): nothing to
            // patch; the next sync names no table and gets the whole one.
            self.table = 0;
            self.table_version = 0;
            return;
        };
        let fresh_router = response.reset
            || self.replica != Some(response.replica)
            || self.log != response.log
            || self.router.as_ref().is_none_or(|r| r.config() != config);
        if fresh_router {
            let first_id = (u64::from(response.replica) << REPLICA_SHIFT) + 1;
            let mut router = Router::new(config.clone(), first_id);
            router.set_max_index_blocks(self.max_index_blocks);
            // The fleet numbers are the control plane's to export: a VM keeps no window.
            router.set_reuse_window(0);
            if let Some(old) = &self.router {
                for endpoint in old.endpoint_snapshots(now_ms) {
                    apply_snapshot(&mut router, &endpoint, now_ms);
                }
            }
            self.router = Some(router);
        }
        self.replica = Some(response.replica);
        self.since = response.next;
        self.log = response.log;
        self.table = response.table;
        self.table_version = response.table_version;
        self.synced_at_ms = Some(now_ms);
        self.peer_reads_compact = response.compact_hashes;
        let Some(router) = self.router.as_mut() else {
            return;
        };
        // Endpoints first: a decision on an endpoint this copy has not seen yet still counts.
        if response.delta {
            for address in &response.removed {
                router.remove_endpoint(address);
            }
        } else {
            let keep: hashbrown::HashSet<&str> = response
                .endpoints
                .iter()
                .map(|e| e.address.as_str())
                .collect();
            let gone: Vec<String> = router
                .endpoints(now_ms)
                .into_iter()
                .map(|view| view.address.to_string())
                .filter(|a| !keep.contains(a.as_str()))
                .collect();
            for address in gone {
                router.remove_endpoint(&address);
            }
        }
        for endpoint in &response.endpoints {
            apply_snapshot(router, endpoint, now_ms);
        }
        if response.others > 0 {
            self.others_seen_at_ms = Some(now_ms);
        }
        let mine = response.replica;
        for event in &response.events {
            if matches!(event, SyncEvent::Decision { origin, .. } if *origin != mine) {
                self.others_seen_at_ms = Some(now_ms);
            }
            event.apply_to(router, now_ms);
        }
    }

    /// The router behind the copy, once the first sync has landed.
    pub fn router(&self) -> Option<&Router> {
        self.router.as_ref()
    }

    /// Decisions this copy has taken locally.
    pub fn local_decisions(&self) -> u64 {
        self.local_decisions
    }

    /// This copy's replica tag, once assigned.
    pub fn replica(&self) -> Option<u32> {
        self.replica
    }
}

/// Makes `router`'s view of one endpoint the control plane's (an endpoint past the router's
/// bound is left out, as on the control plane).
fn apply_snapshot(router: &mut Router, endpoint: &EndpointSnapshot, now_ms: u64) {
    if router.upsert_endpoint(&endpoint.address).is_err() {
        return;
    }
    match &endpoint.models {
        Some(models) => router.set_served_models(&endpoint.address, models.clone()),
        None => router.forget_served_models(&endpoint.address),
    }
    if !endpoint.usable {
        router.mark_unreachable(&endpoint.address);
    } else if let Some(metrics) = endpoint.metrics {
        let scraped_at = now_ms.saturating_sub(endpoint.metrics_age_ms);
        router.update_metrics(&endpoint.address, metrics, scraped_at);
    }
}

/// Puts `items` (oldest first) back in front of `queue`; past `max` the oldest are dropped.
fn put_back<T>(queue: &mut VecDeque<T>, items: Vec<T>, max: usize) {
    for item in items.into_iter().rev() {
        queue.push_front(item);
    }
    while queue.len() > max {
        queue.pop_front();
    }
}

/// Appends `item` to a queue of at most `max` entries, dropping the oldest when full (newer
/// reports describe the fleet better); returns whether one was dropped. Every bounded report
/// queue (the copies' pending reports, the filter's outcome and first-token queues) uses it.
pub fn push_bounded<T>(queue: &mut VecDeque<T>, item: T, max: usize) -> bool {
    let dropped = queue.len() >= max && queue.pop_front().is_some();
    queue.push_back(item);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{DEFAULT_BLOCK_BYTES, block_hashes, model_seed};
    use crate::router::Health;
    use crate::test_util::outcome_event;

    /// A control plane whose copies score as it does. Its turns follow each other by
    /// milliseconds, still in flight, as no client's do: the prefill contention (which prices
    /// the prefill a replica took in the last second) is off, so what moves a turn here is the
    /// replicated state alone.
    fn central(n: usize) -> Router {
        let mut config = RouterConfig::default();
        config.scoring.prefill_contention_weight = 0.0;
        let mut router = Router::new(config, 1);
        for i in 0..n {
            let address = format!("10.0.0.{}:8000", i + 1);
            router.upsert_endpoint(&address).unwrap();
            let metrics = EndpointMetrics {
                capacity_tokens: Some(100_000),
                counters: None,
                ..EndpointMetrics::default()
            };
            router.update_metrics(&address, metrics, 0);
        }
        router
    }

    fn chat(conversation: u64, turns: usize) -> RouteRequest {
        // Turn N+1's text extends turn N's, as a chat's canonical prompt does.
        let text: String = (0..turns)
            .map(|t| format!("conversation {conversation} turn {t} says something. ").repeat(20))
            .collect();
        RouteRequest {
            model: "m".into(),
            block_hashes: block_hashes(model_seed("m"), text.as_bytes(), DEFAULT_BLOCK_BYTES),
            prompt_bytes: text.len() as u64,
            prompt_tokens: (text.len() / 4) as u32,
            ..RouteRequest::default()
        }
    }

    // The hand-written reader takes what the derived writer writes, in any field order, skips
    // fields it does not know, and refuses an entry without its kind or its variant's fields.
    #[test]
    fn sync_events_read_in_any_order() {
        let events = vec![
            SyncEvent::Decision {
                origin: 3,
                record: Box::new(DecisionRecord {
                    decision_id: 7,
                    endpoint: "10.0.0.1:8000".into(),
                    request: chat(1, 2),
                    age_ms: 5,
                }),
            },
            SyncEvent::Outcome {
                origin: 4,
                outcome: Outcome {
                    decision_id: 7,
                    endpoint: "10.0.0.1:8000".into(),
                    status: 200,
                    ..Outcome::default()
                },
            },
            SyncEvent::FirstToken {
                origin: 5,
                decision_id: 7,
                ttft_ms: None,
            },
            SyncEvent::FirstToken {
                origin: 5,
                decision_id: 8,
                ttft_ms: Some(950),
            },
        ];
        let json = serde_json::to_string(&events).unwrap();
        assert_eq!(
            serde_json::from_str::<Vec<SyncEvent>>(&json).unwrap(),
            events
        );
        let reordered =
            r#"{"origin":5,"newer_field":[1,{"a":2}],"decision_id":7,"kind":"first_token"}"#;
        assert_eq!(
            serde_json::from_str::<SyncEvent>(reordered).unwrap(),
            events[2]
        );
        for bad in [
            r#"{"origin":5,"decision_id":7}"#,
            r#"{"kind":"decision","origin":5,"decision_id":7}"#,
            r#"{"kind":"outcome","decision_id":7}"#,
            r#"{"kind":"first_token","origin":1,"origin":2,"decision_id":7}"#,
            r#"{"kind":"sideways","origin":5,"decision_id":7}"#,
            r#"[1,2]"#,
        ] {
            assert!(serde_json::from_str::<SyncEvent>(bad).is_err(), "{bad}");
        }
    }

    fn sync(log: &mut SyncLog, hub: &mut Router, copy: &mut LocalRouter, now_ms: u64) {
        let request = copy.sync_request();
        // Through JSON, as on the wire.
        let request: SyncRequest =
            serde_json::from_slice(&serde_json::to_vec(&request).unwrap()).unwrap();
        let response = serve_sync(log, hub, request, now_ms);
        let response: SyncResponse =
            serde_json::from_slice(&serde_json::to_vec(&response).unwrap()).unwrap();
        copy.apply(response, now_ms);
    }

    /// A log of `capacity` entries, a control plane over `endpoints` endpoints and two copies,
    /// each synced once at time 0.
    fn two_synced_copies(
        capacity: usize,
        endpoints: usize,
    ) -> (SyncLog, Router, LocalRouter, LocalRouter) {
        let mut log = SyncLog::new(capacity, 1);
        let mut hub = central(endpoints);
        let (mut a, mut b) = (LocalRouter::new(64), LocalRouter::new(64));
        sync(&mut log, &mut hub, &mut a, 0);
        sync(&mut log, &mut hub, &mut b, 0);
        (log, hub, a, b)
    }

    // A first token seen by one proxy reaches the control plane and every other copy.
    #[test]
    fn a_first_token_travels_to_every_copy() {
        let (mut log, mut hub, mut a, mut b) = two_synced_copies(1_000, 4);
        let request = RouteRequest {
            stream: true,
            ..chat(1, 1)
        };
        let decision = a.route(&request, 1, 1).unwrap();
        a.first_token(
            FirstToken {
                decision_id: decision.response.decision_id,
                decision_tag: 0,
                ttft_ms: Some(1),
            },
            2,
        );
        sync(&mut log, &mut hub, &mut a, 3);
        sync(&mut log, &mut hub, &mut b, 3);
        let firsts = |r: &Router| r.stats().first_tokens;
        assert_eq!(firsts(a.router().unwrap()), 1);
        assert_eq!(firsts(&hub), 1);
        assert_eq!(firsts(b.router().unwrap()), 1);
    }

    // Once another router decides beside it, a copy leaves long misses to the control plane (the
    // copies would all send them to the replica that looks idlest) and keeps the rest; alone,
    // or with the threshold at 0, it decides everything.
    #[test]
    fn a_long_miss_is_left_to_the_control_plane_once_others_decide() {
        // About 1,300 tokens: over 250 ms of prefill at the generic prior; one turn is 40 ms.
        let long = |n: u64| chat(n, 8);
        let (mut log, mut hub, mut a, mut b) = two_synced_copies(1_000, 4);
        assert!(a.route(&long(1), 1, 1).is_some(), "nobody else decides yet");
        sync(&mut log, &mut hub, &mut a, 2);
        sync(&mut log, &mut hub, &mut b, 2);
        assert!(
            b.route(&long(2), 3, 2).is_none(),
            "a long miss goes to the control plane"
        );
        assert!(b.route(&chat(3, 1), 3, 3).is_some(), "a short one does not");
        assert_eq!(b.local_decisions(), 1);
        b.pause_deferral(10);
        assert!(b.route(&long(6), 4, 6).is_some(), "paused: decided here");
        assert!(b.route(&long(7), 10, 7).is_none(), "the pause is over");
        let mut hub_config = hub.config().clone();
        hub_config.local.defer_above_ms = 0.0;
        let mut hub = Router::new(hub_config, 1);
        for i in 0..4 {
            hub.upsert_endpoint(&format!("10.0.0.{}:8000", i + 1))
                .unwrap();
        }
        let mut log = SyncLog::new(1_000, 1);
        let mut c = LocalRouter::new(64);
        sync(&mut log, &mut hub, &mut a, 4);
        sync(&mut log, &mut hub, &mut c, 4);
        a.route(&long(4), 5, 4).unwrap();
        sync(&mut log, &mut hub, &mut c, 6);
        assert!(
            c.route(&long(5), 7, 5).is_some(),
            "threshold 0: every request local"
        );
    }

    // A cold fleet: two copies synced, neither has seen the other decide. The control plane
    // names the other copy, so a long miss goes to it at once (the first burst's misses would
    // otherwise all go where each copy alone thinks idlest); a copy alone keeps deciding, and
    // one whose fellow went silent for the window decides alone again.
    #[test]
    fn a_copy_told_of_others_syncing_defers_before_any_of_their_decisions() {
        let long = |n: u64| chat(n, 8);
        let mut log = SyncLog::new(1_000, 1);
        let mut hub = central(4);
        let (mut a, mut b) = (LocalRouter::new(64), LocalRouter::new(64));
        sync(&mut log, &mut hub, &mut a, 0);
        assert!(a.route(&long(1), 1, 1).is_some(), "alone: decided here");
        sync(&mut log, &mut hub, &mut b, 2);
        sync(&mut log, &mut hub, &mut a, 2);
        assert_eq!(hub.stats().recorded_decisions, 1);
        assert!(b.route(&long(2), 3, 2).is_none(), "b was told of a");
        assert!(
            b.route(&chat(3, 1), 3, 3).is_some(),
            "a short one stays local"
        );
        // a saw b's sync only: no decision of b's had reached it.
        assert!(a.route(&long(4), 3, 4).is_none(), "a was told of b");
        // b stops syncing; after the window a decides alone again.
        let later = 3 + OTHERS_DECIDING_WINDOW_MS + 1;
        sync(&mut log, &mut hub, &mut a, later);
        let after = later + OTHERS_DECIDING_WINDOW_MS + 1;
        sync(&mut log, &mut hub, &mut a, after);
        assert!(a.route(&long(5), after, 5).is_some(), "b went silent");
    }

    // A turn decided on one proxy pulls the next turn, decided on another proxy after one sync,
    // to the same endpoint: the whole point of replicating the state.
    #[test]
    fn a_decision_on_one_proxy_steers_the_next_turn_on_another() {
        let mut log = SyncLog::new(1_000, 7);
        let mut hub = central(4);
        let (mut a, mut b) = (LocalRouter::new(64), LocalRouter::new(64));
        assert!(!a.ready(0, 100), "nothing synced yet");
        sync(&mut log, &mut hub, &mut a, 0);
        sync(&mut log, &mut hub, &mut b, 0);
        assert!(a.ready(10, 100) && b.ready(10, 100));
        assert_ne!(a.replica(), b.replica());

        let first = a.route(&chat(1, 1), 10, 1).unwrap();
        let home = first.response.endpoints[0].clone();
        assert_eq!(first.response.decision_id >> REPLICA_SHIFT, 7);
        sync(&mut log, &mut hub, &mut a, 20);
        sync(&mut log, &mut hub, &mut b, 30);
        let second = b.route(&chat(1, 2), 40, 2).unwrap();
        assert_eq!(second.response.endpoints[0], home);
        assert!(second.response.cached_blocks > 0);
        assert_eq!(hub.stats().recorded_decisions, 1);
        assert_eq!(b.router().unwrap().stats().recorded_decisions, 1);
    }

    // In-flight load taken on one proxy is seen by the others, and its outcome releases it
    // everywhere.
    #[test]
    fn load_and_its_release_reach_every_copy() {
        let (mut log, mut hub, mut a, mut b) = two_synced_copies(1_000, 2);
        let decision = a.route(&chat(2, 1), 5, 1).unwrap();
        sync(&mut log, &mut hub, &mut a, 10);
        sync(&mut log, &mut hub, &mut b, 10);
        assert_eq!(b.router().unwrap().inflight_len(), 1);
        assert_eq!(hub.inflight_len(), 1);
        a.outcome(
            Outcome {
                decision_id: decision.response.decision_id,
                endpoint: decision.response.endpoints[0].clone(),
                status: 200,
                ..Outcome::default()
            },
            20,
        );
        assert_eq!(a.router().unwrap().inflight_len(), 0);
        sync(&mut log, &mut hub, &mut a, 30);
        sync(&mut log, &mut hub, &mut b, 30);
        assert_eq!(hub.inflight_len(), 0);
        assert_eq!(b.router().unwrap().inflight_len(), 0);
    }

    // A copy that first syncs long after a decision was logged counts it as the old decision
    // it is: its prefill is done, so none of it is queued; one just taken still is.
    #[test]
    fn replayed_decisions_arrive_with_their_age() {
        let mut log = SyncLog::new(100, 1);
        let mut hub = central(2);
        let mut a = LocalRouter::new(64);
        sync(&mut log, &mut hub, &mut a, 0);
        let old = a.route(&chat(1, 40), 1, 1).unwrap();
        sync(&mut log, &mut hub, &mut a, 2);
        let backlog = |r: &Router| -> f64 { r.endpoints(0).iter().map(|e| e.backlog_tokens).sum() };
        let (mut late, mut fresh) = (LocalRouter::new(64), LocalRouter::new(64));
        sync(&mut log, &mut hub, &mut fresh, 3);
        assert!(
            backlog(fresh.router().unwrap()) > 0.0,
            "a decision 1 ms old is queued"
        );
        sync(&mut log, &mut hub, &mut late, 60_000);
        let copy = late.router().unwrap();
        assert_eq!(copy.stats().recorded_decisions, 1);
        assert_eq!(copy.inflight_len(), 1, "still in flight: no outcome yet");
        assert_eq!(backlog(copy), 0.0, "its prefill ended long ago");
        let (events, _, _) = log.since(0, 99, 10, 60_000);
        let SyncEvent::Decision { record, .. } = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(record.decision_id, old.response.decision_id);
        assert_eq!(record.age_ms, 59_998);
        // Past the in-flight TTL there is nothing left to account for.
        let mut ancient = LocalRouter::new(64);
        sync(&mut log, &mut hub, &mut ancient, 400_000);
        assert_eq!(ancient.router().unwrap().stats().recorded_decisions, 0);
    }

    // A copy that fell behind the log's bound starts over instead of patching a gap.
    #[test]
    fn a_copy_behind_the_log_resets() {
        let (mut log, mut hub, mut a, mut b) = two_synced_copies(2, 2);
        for c in 0..3 {
            a.route(&chat(10 + c, 1), 1, c).unwrap();
        }
        sync(&mut log, &mut hub, &mut a, 2);
        let (events, next, reset) = log.since(1, b.replica().unwrap(), 100, 0);
        assert!(reset);
        assert_eq!(events.len(), 2);
        assert_eq!(next, log.next_seq());
        sync(&mut log, &mut hub, &mut b, 3);
        assert_eq!(b.router().unwrap().stats().recorded_decisions, 2);
    }

    // Endpoints the control plane no longer routes to leave every copy; unreachable ones stay
    // known but unusable.
    #[test]
    fn the_endpoint_table_is_mirrored() {
        let mut log = SyncLog::new(10, 1);
        let mut hub = central(3);
        let mut a = LocalRouter::new(8);
        sync(&mut log, &mut hub, &mut a, 0);
        assert_eq!(a.router().unwrap().endpoint_count(), 3);
        hub.remove_endpoint("10.0.0.3:8000");
        hub.mark_unreachable("10.0.0.2:8000");
        sync(&mut log, &mut hub, &mut a, 5);
        let copy = a.router().unwrap();
        assert_eq!(copy.endpoint_count(), 2);
        for _ in 0..5 {
            let d = a.route(&chat(3, 1), 6, 9).unwrap();
            assert_eq!(d.response.endpoints[0], "10.0.0.1:8000");
        }
    }

    // A copy routes within model pools and contexts as the control plane does: what each
    // endpoint serves reaches it with the endpoint's snapshot, in a whole table and as a change.
    #[test]
    fn the_model_catalogue_is_mirrored() {
        let (mut log, mut hub, mut a, _) = two_synced_copies(100, 2);
        let card = |id: &str, max_model_len| ServedModel {
            id: id.into(),
            parent: None,
            max_model_len,
        };
        hub.set_served_models("10.0.0.1:8000", vec![card("m", Some(1_000))]);
        hub.set_served_models("10.0.0.2:8000", vec![card("other", None)]);
        sync(&mut log, &mut hub, &mut a, 5);
        let routed = |a: &mut LocalRouter, request: &RouteRequest, now: u64| {
            a.route(request, now, now).unwrap().response.endpoints
        };
        for now in 6..10 {
            assert_eq!(routed(&mut a, &chat(now, 1), now), ["10.0.0.1:8000"]);
        }
        // The other endpoint now serves `m` too, with a longer context: a prompt too long
        // for the first goes there alone.
        hub.set_served_models("10.0.0.2:8000", vec![card("m", Some(100_000))]);
        sync(&mut log, &mut hub, &mut a, 20);
        let long = chat(1, 8);
        assert!(long.prompt_tokens > 1_000);
        assert_eq!(routed(&mut a, &long, 21), ["10.0.0.2:8000"]);
        let copy = a.router().unwrap();
        assert_eq!(copy.pool_stats().context_narrowed, 1);
        // A copy that starts now gets the whole table, catalogues included.
        let mut late = LocalRouter::new(8);
        sync(&mut log, &mut hub, &mut late, 30);
        assert_eq!(
            late.router().unwrap().served_models("10.0.0.2:8000"),
            Some(&[card("m", Some(100_000))][..])
        );
    }

    // An endpoint the control plane has added but not scraped yet is usable there, and so in
    // every copy.
    #[test]
    fn an_endpoint_not_yet_scraped_is_usable_in_the_copy_too() {
        let mut log = SyncLog::new(10, 1);
        let mut hub = Router::new(RouterConfig::default(), 1);
        hub.upsert_endpoint("10.0.0.9:8000").unwrap();
        let mut a = LocalRouter::new(8);
        sync(&mut log, &mut hub, &mut a, 0);
        let central = hub.route(&chat(4, 1), 1, 1);
        let local = a.route(&chat(4, 1), 1, 1).unwrap();
        assert_eq!(central.response.endpoints, local.response.endpoints);
        assert_eq!(local.response.endpoints, ["10.0.0.9:8000"]);
    }

    /// Two control-plane replicas sharing one stream, which is a plain vector here: what each
    /// replica logs goes to the stream, and each reads the stream back in order (applying only
    /// what the other published), as the control plane's replication task does over NATS.
    struct Replica {
        log: SyncLog,
        router: Router,
        read: usize,
    }

    impl Replica {
        fn new(tag: u32) -> Replica {
            let mut log = SyncLog::new(1_000, tag);
            log.replicate(42, 1);
            Replica {
                log,
                router: central(4),
                read: 0,
            }
        }
        /// Publishes its outbox to `stream` (entry, publisher) and reads what it has not.
        fn pump(&mut self, me: usize, stream: &mut Vec<(SyncEvent, usize)>) {
            stream.extend(self.log.take_outbox().into_iter().map(|e| (e, me)));
            while self.read < stream.len() {
                let (event, from) = stream[self.read].clone();
                self.read += 1;
                if from != me {
                    event.apply_to(&mut self.router, 0);
                }
                assert!(self.log.push_replicated(self.read as u64, event, 0));
            }
        }
    }

    // A proxy syncing with whichever replica it reaches, alternately, never starts over and
    // never applies an entry twice; another proxy on the other replica sees its decisions.
    #[test]
    fn copies_sync_with_any_replica_of_a_shared_stream() {
        let mut stream = Vec::new();
        let mut replicas = [Replica::new(100), Replica::new(200)];
        let (mut a, mut b) = (LocalRouter::new(64), LocalRouter::new(64));
        let mut tick = |copy: &mut LocalRouter, at: usize, stream: &mut Vec<_>, now| {
            let r = &mut replicas[at];
            let request = copy.sync_request();
            let response = serve_sync(&mut r.log, &mut r.router, request, now);
            assert!(!response.reset || copy.replica().is_none(), "a reset");
            assert_eq!(response.log, 42);
            copy.apply(response, now);
            r.pump(at, stream);
            let other = &mut replicas[1 - at];
            other.pump(1 - at, stream);
        };
        tick(&mut a, 0, &mut stream, 0);
        tick(&mut b, 1, &mut stream, 0);
        let first = a.route(&chat(5, 1), 1, 1).unwrap();
        let home = first.response.endpoints[0].clone();
        for (n, at) in [1, 0, 1, 0].into_iter().enumerate() {
            tick(&mut a, at, &mut stream, 10 + n as u64);
            tick(&mut b, 1 - at, &mut stream, 10 + n as u64);
        }
        assert_eq!(
            a.router().unwrap().stats().recorded_decisions,
            0,
            "own entry replayed"
        );
        assert_eq!(b.router().unwrap().stats().recorded_decisions, 1);
        let second = b.route(&chat(5, 2), 20, 2).unwrap();
        assert_eq!(second.response.endpoints[0], home);
        for r in &replicas {
            assert_eq!(r.router.stats().recorded_decisions, 1);
        }
    }

    // A replica behind the one a copy last synced with hands its `since` back unchanged, and
    // a copy of another log starts over.
    #[test]
    fn since_never_moves_back_and_a_new_log_resets() {
        let mut log = SyncLog::new(10, 1);
        log.replicate(9, 1);
        assert!(log.push_replicated(4, outcome_event(0, 1), 0));
        assert!(
            !log.push_replicated(3, outcome_event(0, 2), 0),
            "went backwards"
        );
        let (events, next, reset) = log.since(8, 99, 100, 0);
        assert!(events.is_empty() && !reset);
        assert_eq!(next, 8);
        let (events, next, _) = log.since(1, 99, 100, 0);
        assert_eq!((events.len(), next), (1, 5));
        let mut copy = LocalRouter::new(4);
        let mut hub = central(1);
        let request = copy.sync_request();
        copy.apply(serve_sync(&mut log, &mut hub, request, 0), 0);
        let request = copy.sync_request();
        assert_eq!(request.log, 9);
        let mut other = SyncLog::new(10, 5);
        let answer = serve_sync(&mut other, &mut hub, request, 1);
        assert_ne!(answer.log, 9);
        // A stream lost and set up again: its entries are not published a second time.
        log.replicate(10, 1);
        assert!(log.take_outbox().is_empty() && log.is_empty());
        // A stream out of reach: back to local numbering under a new name, the stream's entries
        // dropped, the unpublished ones kept; they are published when a stream is back.
        assert!(log.push_replicated(100, outcome_event(0, 4), 0));
        log.push(outcome_event(0, 5), 0);
        log.go_local(12);
        assert!(!log.is_replicated());
        assert_eq!((log.id(), log.len()), (12, 1));
        let (events, _, reset) = log.since(0, 99, 10, 0);
        assert_eq!((events, reset), (vec![outcome_event(0, 5)], false));
        log.replicate(13, 1);
        assert_eq!(log.take_outbox(), vec![outcome_event(0, 5)]);
        // A lone log joining a stream publishes what it logged alone.
        other.push(outcome_event(0, 3), 0);
        other.replicate(11, 1);
        assert_eq!(other.take_outbox().len(), 1);
    }

    /// `load` running requests on `address`, scraped into `hub` at `now_ms`.
    fn scrape(hub: &mut Router, address: &str, load: u32, now_ms: u64) {
        let metrics = EndpointMetrics {
            running: load,
            capacity_tokens: Some(100_000),
            ..EndpointMetrics::default()
        };
        hub.update_metrics(address, metrics, now_ms);
    }

    /// The answer a synced copy gets, through JSON, and the copy after applying it.
    fn tick(log: &mut SyncLog, hub: &mut Router, copy: &mut LocalRouter, now: u64) -> SyncResponse {
        let request = copy.sync_request();
        let response = serve_sync(log, hub, request, now);
        let wire = serde_json::to_vec(&response).unwrap();
        copy.apply(serde_json::from_slice(&wire).unwrap(), now);
        response
    }

    fn running(copy: &LocalRouter, address: &str) -> Option<u32> {
        let views = copy.router().unwrap().endpoints(0);
        let view = views.iter().find(|v| v.address == address)?;
        Some(view.metrics.map_or(0, |m| m.running))
    }

    // A synced copy is sent only the endpoints whose snapshot changed since its last pull, and
    // the removals; a copy naming no table gets the whole table and the configuration.
    #[test]
    fn a_synced_copy_gets_only_what_changed() {
        let mut log = SyncLog::new(100, 1);
        let mut hub = central(4);
        let mut a = LocalRouter::new(8);
        let first = tick(&mut log, &mut hub, &mut a, 0);
        assert!(!first.delta && first.config.is_some());
        assert_eq!((first.endpoints.len(), first.table), (4, log.table()));
        let idle = tick(&mut log, &mut hub, &mut a, 10);
        assert!(idle.delta && idle.endpoints.is_empty() && idle.removed.is_empty());
        assert_eq!(idle.config, None, "a delta leaves the configuration out");
        assert!(serde_json::to_string(&idle).unwrap().len() < 150);

        scrape(&mut hub, "10.0.0.2:8000", 5, 20);
        hub.remove_endpoint("10.0.0.3:8000");
        hub.upsert_endpoint("10.0.0.9:8000").unwrap();
        hub.mark_unreachable("10.0.0.4:8000");
        let delta = tick(&mut log, &mut hub, &mut a, 30);
        assert!(delta.delta);
        let mut sent: Vec<&str> = delta.endpoints.iter().map(|e| e.address.as_str()).collect();
        sent.sort_unstable();
        assert_eq!(sent, ["10.0.0.2:8000", "10.0.0.4:8000", "10.0.0.9:8000"]);
        assert_eq!(delta.removed, ["10.0.0.3:8000"]);
        assert_eq!(running(&a, "10.0.0.2:8000"), Some(5));
        assert_eq!(running(&a, "10.0.0.3:8000"), None, "removed from the copy");
        let copy = a.router().unwrap();
        assert_eq!(copy.endpoint_count(), hub.endpoint_count());
        let health = |r: &Router, at: &str| {
            r.endpoints(30)
                .into_iter()
                .find(|v| v.address == at)
                .map(|v| v.health)
        };
        assert_eq!(health(copy, "10.0.0.4:8000"), Some(Health::Unreachable));
        // Unreachable again: nothing new. Back with a scrape: sent again, usable.
        hub.mark_unreachable("10.0.0.4:8000");
        assert!(tick(&mut log, &mut hub, &mut a, 40).endpoints.is_empty());
        scrape(&mut hub, "10.0.0.4:8000", 1, 45);
        assert_eq!(tick(&mut log, &mut hub, &mut a, 50).endpoints.len(), 1);
        assert_eq!(
            health(a.router().unwrap(), "10.0.0.4:8000"),
            Some(Health::Ready)
        );
        // Removed and added again between two pulls: both, the removal first.
        hub.remove_endpoint("10.0.0.9:8000");
        hub.upsert_endpoint("10.0.0.9:8000").unwrap();
        let again = tick(&mut log, &mut hub, &mut a, 60);
        assert_eq!((again.removed.len(), again.endpoints.len()), (1, 1));
        assert_eq!(a.router().unwrap().endpoint_count(), 4);
    }

    // The same numbers scraped again are re-sent only once the copy's scrape has aged a quarter
    // of `stale_after_ms`: a copy never counts stale an endpoint its control plane scrapes.
    #[test]
    fn unchanged_scrapes_are_resent_before_a_copy_would_count_them_stale() {
        let mut log = SyncLog::new(100, 1);
        let mut hub = central(2);
        let mut a = LocalRouter::new(8);
        tick(&mut log, &mut hub, &mut a, 0);
        let stale_after = hub.config().stale_after_ms;
        let mut sent = 0;
        for now in (50..10 * stale_after).step_by(50) {
            if now % 100 == 0 {
                for i in 1..=2 {
                    scrape(&mut hub, &format!("10.0.0.{i}:8000"), 0, now);
                }
            }
            sent += tick(&mut log, &mut hub, &mut a, now).endpoints.len();
            let views = a.router().unwrap().endpoints(now);
            assert!(views.iter().all(|v| !v.stale), "stale at {now}: {views:?}");
        }
        // Two endpoints, each re-sent at most every quarter of `stale_after_ms`, where whole
        // tables would have carried 2 a tick.
        let resends = 2 * 10 * stale_after / (stale_after / 4);
        assert!(sent <= resends as usize + 2, "{sent} snapshots sent");
        assert!(sent > 0, "re-sent at all");
    }

    // The whole table goes to a copy naming another table (another control-plane process, or
    // one that does not version it) or a version behind a removal no longer kept.
    #[test]
    fn a_table_that_cannot_be_patched_is_sent_whole() {
        let mut log = SyncLog::new(100, 1);
        let mut hub = central(2);
        let mut a = LocalRouter::new(8);
        tick(&mut log, &mut hub, &mut a, 0);
        // Another control plane: its own table.
        let mut other_log = SyncLog::new(100, 9);
        let mut other = central(3);
        let answer = tick(&mut other_log, &mut other, &mut a, 10);
        assert!(!answer.delta && answer.config.is_some());
        assert_eq!(a.router().unwrap().endpoint_count(), 3);
        // Far behind: more removals than the router keeps.
        let synced = a.sync_request();
        for _ in 0..=crate::router::MAX_REMOVALS_KEPT {
            other.remove_endpoint("10.0.0.3:8000");
            other.upsert_endpoint("10.0.0.3:8000").unwrap();
        }
        let answer = serve_sync(&mut other_log, &mut other, synced, 20);
        assert!(!answer.delta && answer.endpoints.len() == 3);
        // Just behind: a delta.
        let request = SyncRequest {
            table: answer.table,
            table_version: answer.table_version,
            ..a.sync_request()
        };
        other.remove_endpoint("10.0.0.3:8000");
        let answer = serve_sync(&mut other_log, &mut other, request, 30);
        assert!(answer.delta && answer.removed.len() == 1);
    }

    // Rollouts mix versions. A copy that names no table (an older filter) gets the whole table
    // and the configuration, as before; a copy talking to an older control plane (no table
    // fields, configuration always there) replaces its table on every answer.
    #[test]
    fn old_copies_and_old_control_planes_still_sync() {
        let mut log = SyncLog::new(100, 1);
        let mut hub = central(3);
        let old_request: SyncRequest =
            serde_json::from_str(r#"{"since":0,"decisions":[],"outcomes":[]}"#).unwrap();
        let answer = serve_sync(&mut log, &mut hub, old_request, 0);
        assert!(!answer.delta && answer.config.is_some() && answer.endpoints.len() == 3);
        let json = serde_json::to_value(&answer).unwrap();
        for field in ["replica", "next", "events", "endpoints", "config"] {
            assert!(json.get(field).is_some(), "{field} missing for an old copy");
        }
        // The older control plane's answer: no table, no delta, the configuration.
        let mut a = LocalRouter::new(8);
        let old_answer = |endpoints: &[&str]| -> SyncResponse {
            let endpoints: Vec<serde_json::Value> = endpoints
                .iter()
                .map(|a| serde_json::json!({"address": a, "usable": true, "metrics_age_ms": 0}))
                .collect();
            let config = serde_json::to_value(RouterConfig::default()).unwrap();
            serde_json::from_value(serde_json::json!({
                "replica": 4, "next": 1, "log": 9, "reset": false, "events": [],
                "endpoints": endpoints, "config": config,
            }))
            .unwrap()
        };
        a.apply(old_answer(&["10.0.0.1:8000", "10.0.0.2:8000"]), 0);
        assert_eq!(a.router().unwrap().endpoint_count(), 2);
        let request = a.sync_request();
        assert_eq!((request.table, request.table_version), (0, 0));
        assert!(!serde_json::to_string(&request).unwrap().contains("table"));
        a.apply(old_answer(&["10.0.0.2:8000"]), 10);
        assert_eq!(a.router().unwrap().endpoint_count(), 1);
        assert!(a.ready(10, 100));
    }

    // Hash lists travel in base64 only between a copy and a control plane that both said they
    // read it; an older peer on either side gets (and sends) arrays, and both forms apply alike.
    #[test]
    fn hash_lists_are_compact_only_between_peers_that_read_them() {
        let (mut log, mut hub, mut a, mut b) = two_synced_copies(100, 3);
        assert!(
            a.peer_reads_compact(),
            "a control plane answering says it reads base64"
        );
        a.route(&chat(40, 3), 1, 1).unwrap();
        let request = a.sync_request();
        assert!(request.compact_hashes);
        let wire = to_json(&request, a.peer_reads_compact()).unwrap();
        assert!(String::from_utf8_lossy(&wire).contains(r#""block_hashes":""#));
        let read: SyncRequest = serde_json::from_slice(&wire).unwrap();
        assert_eq!(read, request);
        serve_sync(&mut log, &mut hub, read, 1);
        // b is an older copy: its request says nothing, so its answer carries arrays.
        let mut old = b.sync_request();
        old.compact_hashes = false;
        let answer = serve_sync(&mut log, &mut hub, old.clone(), 2);
        let wire = to_json(&answer, old.compact_hashes).unwrap();
        assert!(String::from_utf8_lossy(&wire).contains(r#""block_hashes":["#));
        let compact = to_json(&answer, true).unwrap();
        assert!(compact.len() < wire.len());
        for bytes in [wire, compact] {
            assert_eq!(
                serde_json::from_slice::<SyncResponse>(&bytes).unwrap(),
                answer
            );
        }
        b.apply(answer, 2);
        assert_eq!(b.router().unwrap().stats().recorded_decisions, 1);
        b.sync_failed();
        assert!(
            !b.peer_reads_compact(),
            "after a failure, arrays until an answer says so"
        );
    }

    // A copy that must start a fresh router (its `since` left the log) while its table is
    // patched keeps the table: it is the control plane's scrapes, not the log.
    #[test]
    fn a_reset_copy_keeps_its_table_under_a_delta() {
        let (mut log, mut hub, mut a, mut b) = two_synced_copies(2, 3);
        scrape(&mut hub, "10.0.0.1:8000", 7, 1);
        tick(&mut log, &mut hub, &mut b, 1);
        for c in 0..3 {
            a.route(&chat(20 + c, 1), 2, c).unwrap();
        }
        sync(&mut log, &mut hub, &mut a, 3);
        let answer = tick(&mut log, &mut hub, &mut b, 4);
        assert!(answer.reset && answer.delta && answer.endpoints.is_empty());
        let copy = b.router().unwrap();
        assert_eq!(copy.endpoint_count(), 3);
        assert_eq!(running(&b, "10.0.0.1:8000"), Some(7));
        assert_eq!(copy.stats().recorded_decisions, 2);
    }

    // A copy's index is bounded by its configuration whatever the fleet reports: each endpoint
    // keeps its share of the bound, its least recently used blocks evicted first.
    #[test]
    fn a_copys_index_keeps_its_configured_bound() {
        let mut log = SyncLog::new(1_000, 1);
        let mut hub = central(4);
        let mut a = LocalRouter::new(64).with_max_index_blocks(Some(400));
        let mut b = LocalRouter::new(64);
        // b first: it has not heard of a when it decides, so it defers nothing.
        sync(&mut log, &mut hub, &mut b, 0);
        sync(&mut log, &mut hub, &mut a, 0);
        // 100,000 tokens of KV each: 1,562 blocks of 64 tokens, more than a's share of 100.
        for c in 0..40 {
            b.route(&chat(100 + c, 4), 1, c).unwrap();
        }
        sync(&mut log, &mut hub, &mut b, 2);
        sync(&mut log, &mut hub, &mut a, 2);
        let indexed = |copy: &LocalRouter| copy.router().unwrap().index().distinct_blocks();
        assert!(indexed(&b) > 400, "{} blocks without a bound", indexed(&b));
        assert!(indexed(&a) <= 400, "{} blocks past the bound", indexed(&a));
        // The newest decision's blocks are the ones kept.
        let newest = chat(139, 4).block_hashes;
        let mut deepest = 0;
        let index = a.router().unwrap().index();
        index.matched_prefix(&newest, |_, depth| deepest = deepest.max(depth));
        assert_eq!(deepest, newest.len());
        // One endpoint fewer: the others' shares grow, and nothing is evicted for it.
        hub.remove_endpoint("10.0.0.4:8000");
        sync(&mut log, &mut hub, &mut a, 4);
        assert!(indexed(&a) <= 400);
    }

    // The pending queues are bounded: a proxy that cannot reach the control plane does not
    // grow without limit.
    #[test]
    fn pending_reports_are_bounded() {
        let mut log = SyncLog::new(10, 1);
        let mut hub = central(1);
        let mut a = LocalRouter::new(3);
        sync(&mut log, &mut hub, &mut a, 0);
        for c in 0..10 {
            a.route(&chat(c, 1), 1, c).unwrap();
        }
        let request = a.sync_request();
        assert_eq!(request.decisions.len(), 3);
        assert_eq!(a.local_decisions(), 10);
    }
}
