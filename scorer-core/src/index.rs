//! Approximate prefix index: which blocks were routed to (or reported by) which endpoint.
//!
//! One global map answers "which endpoints hold block h" as a bitset, so a lookup costs one
//! probe a block whatever the fleet size. Each endpoint also keeps an LRU of its blocks bounded by
//! its KV capacity, and every entry has a TTL, so the index forgets what the replica has most
//! likely evicted. A block's entry carries one holder's LRU stamp beside the bitset, so a
//! decision that matches a prompt and then re-stamps it for the chosen endpoint touches each
//! block's memory once. Time is passed in; nothing here reads a clock.

use std::collections::VecDeque;

use hashbrown::HashMap;

/// Most endpoints one index tracks (the bitset width). Adding more is refused, not a panic.
pub const MAX_ENDPOINTS: usize = 256;
const WORDS: usize = MAX_ENDPOINTS / 64;

/// Dense id of an endpoint inside one index/router (`0..MAX_ENDPOINTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u16);

/// One optional value per endpoint slot (LoRA state, served models, ...): the router's
/// per-endpoint tables share this "set, forget, look up by [`EndpointId`]" vector so that
/// none of them grows or indexes it its own way.
#[derive(Debug, Clone)]
pub struct EndpointSlots<T> {
    slots: Vec<Option<T>>,
}

impl<T> Default for EndpointSlots<T> {
    fn default() -> Self {
        Self { slots: Vec::new() }
    }
}

impl<T> EndpointSlots<T> {
    /// Replaces `id`'s value, growing the table as needed.
    pub fn set(&mut self, id: EndpointId, value: T) {
        let i = usize::from(id.0);
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(value);
    }

    /// Forgets `id`'s value.
    pub fn clear(&mut self, id: EndpointId) {
        if let Some(s) = self.slots.get_mut(usize::from(id.0)) {
            *s = None;
        }
    }

    /// `id`'s value, when known.
    pub fn get(&self, id: EndpointId) -> Option<&T> {
        self.slot(usize::from(id.0))
    }

    /// The value of slot `i`, when known.
    pub fn slot(&self, i: usize) -> Option<&T> {
        self.slots.get(i)?.as_ref()
    }

    /// Every known value, in slot order.
    pub fn known(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }
}

/// A set of endpoints as a fixed-width bitset: 32 bytes, no allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointSet([u64; WORDS]);

impl EndpointSet {
    /// Adds `id` to the set.
    pub fn insert(&mut self, id: EndpointId) {
        let i = usize::from(id.0);
        self.0[i / 64] |= 1 << (i % 64);
    }
    /// Removes `id` from the set.
    pub fn remove(&mut self, id: EndpointId) {
        let i = usize::from(id.0);
        self.0[i / 64] &= !(1 << (i % 64));
    }
    /// Whether `id` is in the set.
    pub fn contains(&self, id: EndpointId) -> bool {
        let i = usize::from(id.0);
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
    fn and(&self, other: &Self) -> Self {
        let mut out = *self;
        for (a, b) in out.0.iter_mut().zip(other.0) {
            *a &= b;
        }
        out
    }
    fn and_not(&self, other: &Self) -> Self {
        let mut out = *self;
        for (a, b) in out.0.iter_mut().zip(other.0) {
            *a &= !b;
        }
        out
    }
    /// Iterates the ids in the set in increasing order, visiting only the set bits (this runs
    /// once a prompt block on the routing hot path).
    pub fn iter(&self) -> impl Iterator<Item = EndpointId> + '_ {
        self.0.iter().enumerate().flat_map(|(w, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros() as u16;
                rest &= rest - 1;
                Some(EndpointId(w as u16 * 64 + bit))
            })
        })
    }
}

/// The consecutive touches one [`PrefixIndex::insert`] stamped its blocks with (the last block
/// the first touch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Touches {
    first: u64,
    len: u64,
}

impl Touches {
    /// A claim on the blocks after the first `held` (those the endpoint held already are not
    /// this insert's to take back); `None` when there are none.
    pub fn claim_after(self, held: usize) -> Option<Claim> {
        let held = held as u64;
        // The blocks after `held` are the prompt's tail: its first touches.
        (held < self.len).then_some(Claim {
            seq: self.first,
            blocks: self.len - held,
        })
    }
}

/// The blocks one insert credited to one endpoint, as its touches stamped them
/// ([`Touches::claim_after`]), to take back with [`PrefixIndex::unclaim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The first block's touch.
    seq: u64,
    /// How many consecutive touches from it.
    blocks: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    seq: u64,
    /// At most [`MAX_AT_MS`], so a [`Block`] can pack it.
    at_ms: u64,
}

impl Stamp {
    /// Touch `seq` at `now_ms` (clamped to what a [`Block`] packs).
    fn new(seq: u64, now_ms: u64) -> Self {
        Self {
            seq,
            at_ms: now_ms.min(MAX_AT_MS),
        }
    }
}

/// No endpoint: a [`Block`] whose stamp slot is free.
const NO_OWNER: u16 = u16::MAX;

/// One block of the index: who holds it, and one holder's LRU stamp kept beside that. A
/// decision reads a prompt's blocks (the prefix match) and then re-stamps them for the endpoint
/// it chose: with the stamp in the same entry, the second pass finds each block's memory
/// already in cache, where a separate LRU map would cost a second random access a block (a
/// 200 KB prompt has 800). Most blocks have one holder; the others' stamps live in their
/// endpoint's `shared` map.
#[derive(Debug, Clone, Copy)]
struct Block {
    holders: EndpointSet,
    /// The owner's touch.
    seq: u64,
    /// The owner's touch time (ms, the high 48 bits) and whose stamp this is (the low 16
    /// bits; `NO_OWNER`: nobody's, every holder's is in its `shared`). Packed, the entry is 48
    /// bytes and the table holding every block of the index an eighth smaller.
    at_and_owner: u64,
}

/// The latest touch time a stamp keeps (48 bits of milliseconds: the year 10889 since the
/// Unix epoch); later times count as this.
const MAX_AT_MS: u64 = (1 << 48) - 1;

impl Block {
    /// A block first held by `id`, touched at `stamp`.
    fn new(id: EndpointId, stamp: Stamp) -> Self {
        let mut holders = EndpointSet::default();
        holders.insert(id);
        let mut block = Self {
            holders,
            seq: 0,
            at_and_owner: 0,
        };
        block.own(id.0, stamp);
        block
    }

    /// Whose stamp the block keeps.
    fn owner(&self) -> u16 {
        (self.at_and_owner & 0xFFFF) as u16
    }

    /// The owner's stamp.
    fn stamp(&self) -> Stamp {
        Stamp {
            seq: self.seq,
            at_ms: self.at_and_owner >> 16,
        }
    }

    /// Keeps `stamp` as `owner`'s.
    fn own(&mut self, owner: u16, stamp: Stamp) {
        self.seq = stamp.seq;
        self.at_and_owner = (stamp.at_ms << 16) | u64::from(owner);
    }

    /// Keeps nobody's stamp.
    fn disown(&mut self) {
        self.at_and_owner = (self.at_and_owner & !0xFFFF) | u64::from(NO_OWNER);
    }
}

/// Shards of the block table.
const SHARDS: usize = 16;

/// Every block of the index, in [`SHARDS`] hash maps chosen by bits of the block's hash. A
/// hash map grows by doubling and holds the old table and the new one while it moves them; one
/// table of all blocks would hold half as much again as itself at that moment (a wasm VM keeps
/// that high-water mark as its memory) and move every block in one call (a pause on the request
/// that triggers it). Sharded, each move is a sixteenth of that.
#[derive(Debug, Default)]
struct BlockTable {
    shards: [HashMap<u64, Block>; SHARDS],
}

impl BlockTable {
    /// A block's shard: the top bits of its hash, mixed first so that keys that are not
    /// uniform hashes (tests, sequential ids) spread too.
    fn shard(hash: u64) -> usize {
        (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % SHARDS
    }

    fn get(&self, hash: &u64) -> Option<&Block> {
        self.shards[Self::shard(*hash)].get(hash)
    }

    fn get_mut(&mut self, hash: &u64) -> Option<&mut Block> {
        self.shards[Self::shard(*hash)].get_mut(hash)
    }

    fn entry(
        &mut self,
        hash: u64,
    ) -> hashbrown::hash_map::Entry<'_, u64, Block, hashbrown::DefaultHashBuilder> {
        self.shards[Self::shard(hash)].entry(hash)
    }

    fn remove(&mut self, hash: &u64) {
        self.shards[Self::shard(*hash)].remove(hash);
    }

    fn len(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }

    fn capacity(&self) -> usize {
        self.shards.iter().map(HashMap::capacity).sum()
    }

    /// Room for `additional` more blocks, spread evenly over the shards.
    fn reserve(&mut self, additional: usize) {
        let each = additional.div_ceil(SHARDS);
        for shard in &mut self.shards {
            shard.reserve(each);
        }
    }

    #[cfg(test)]
    fn allocation_size(&self) -> usize {
        self.shards.iter().map(HashMap::allocation_size).sum()
    }

    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = &Block> + Clone {
        self.shards.iter().flat_map(HashMap::values)
    }
}

/// One endpoint's blocks in LRU order (a lazily compacted queue of touches).
#[derive(Debug, Default)]
struct EndpointBlocks {
    capacity: usize,
    /// Blocks it holds.
    len: usize,
    /// Its stamps of the blocks whose [`Block`] keeps another holder's.
    shared: HashMap<u64, Stamp>,
    /// Every stamp it gave, oldest first; a touch is stale once its block was stamped again.
    order: VecDeque<(u64, u64)>,
    /// Touches in `order` whose block was forgotten while they were its newest (`unclaim`,
    /// `remove`): until the next compaction, a hash's newest touch is current unless it is
    /// one of these.
    orphans: usize,
}

/// Approximate prefix index over chained block hashes.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: BlockTable,
    endpoints: Vec<EndpointBlocks>,
    ttl_ms: u64,
    seq: u64,
}

/// `id`'s stamp of `block` (its own, or looked up in its `shared` map), when it holds it.
fn stamp_of(block: &Block, id: EndpointId, hash: u64, slot: &EndpointBlocks) -> Option<Stamp> {
    if block.owner() == id.0 {
        Some(block.stamp())
    } else if block.holders.contains(id) {
        slot.shared.get(&hash).copied()
    } else {
        None
    }
}

/// Whether `touch` is `id`'s current stamp of `hash` (not superseded, still held).
fn is_current(
    blocks: &BlockTable,
    slot: &EndpointBlocks,
    id: EndpointId,
    (hash, seq): (u64, u64),
) -> Option<Stamp> {
    let block = blocks.get(&hash)?;
    stamp_of(block, id, hash, slot).filter(|s| s.seq == seq)
}

/// Forgets that `id` holds `hash`; whether it did.
fn unset(blocks: &mut BlockTable, slot: &mut EndpointBlocks, id: EndpointId, hash: u64) -> bool {
    let Some(block) = blocks.get_mut(&hash) else {
        return false;
    };
    if !block.holders.contains(id) {
        return false;
    }
    block.holders.remove(id);
    if block.owner() == id.0 {
        block.disown();
    } else {
        slot.shared.remove(&hash);
    }
    if block.holders.is_empty() {
        blocks.remove(&hash);
    }
    slot.len -= 1;
    true
}

/// Forgets `touch`'s block for `id` when `touch` is its current stamp: [`is_current`] and then
/// [`unset`] with one probe of the table instead of up to three. An insert over capacity pops
/// a touch for every block it adds (800 for a 200 KB prompt) and comes here for each.
fn unset_if_current(
    blocks: &mut BlockTable,
    slot: &mut EndpointBlocks,
    id: EndpointId,
    (hash, seq): (u64, u64),
) -> bool {
    let hashbrown::hash_map::Entry::Occupied(mut entry) = blocks.entry(hash) else {
        return false;
    };
    let block = entry.get_mut();
    if block.owner() == id.0 {
        if block.seq != seq {
            return false;
        }
        block.disown();
    } else if block.holders.contains(id) {
        match slot.shared.entry(hash) {
            hashbrown::hash_map::Entry::Occupied(stamp) if stamp.get().seq == seq => {
                stamp.remove();
            }
            _ => return false,
        }
    } else {
        return false;
    }
    block.holders.remove(id);
    if block.holders.is_empty() {
        entry.remove();
    }
    slot.len -= 1;
    true
}

/// Forgets that `id` holds `hash` while its touch stays queued (not popped from the front):
/// that touch is counted as an orphan, which [`PrefixIndex::compact`] must look up.
fn forget(blocks: &mut BlockTable, slot: &mut EndpointBlocks, id: EndpointId, hash: u64) {
    if unset(blocks, slot, id, hash) {
        slot.orphans += 1;
    }
}

impl PrefixIndex {
    /// An empty index whose entries live at most `ttl_ms` after their last touch.
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            blocks: BlockTable::default(),
            endpoints: Vec::new(),
            ttl_ms,
            seq: 0,
        }
    }

    /// Sizes the table of blocks for `blocks` distinct blocks and the churn of an index at its
    /// bound: twice that, because hashbrown rehashes its tombstones in place only while the
    /// table is at most half full, and grows otherwise.
    pub fn reserve_blocks(&mut self, blocks: usize) {
        let want = blocks.saturating_mul(2);
        self.blocks.reserve(want.saturating_sub(self.blocks.len()));
    }

    /// Bounds `id`'s share of the index to `capacity_blocks` (its KV capacity), evicting LRU.
    pub fn set_capacity(&mut self, id: EndpointId, capacity_blocks: usize) {
        self.slot(id).capacity = capacity_blocks;
        self.evict_over_capacity(id);
    }

    fn slot(&mut self, id: EndpointId) -> &mut EndpointBlocks {
        let i = usize::from(id.0);
        if self.endpoints.len() <= i {
            self.endpoints.resize_with(i + 1, || EndpointBlocks {
                capacity: usize::MAX,
                ..Default::default()
            });
        }
        &mut self.endpoints[i]
    }

    /// The block table and `id`'s blocks (made if new), borrowed apart: what every operation
    /// that forgets or checks `id`'s touches needs at once.
    fn split(&mut self, id: EndpointId) -> (&mut BlockTable, &mut EndpointBlocks) {
        self.slot(id);
        (&mut self.blocks, &mut self.endpoints[usize::from(id.0)])
    }

    /// Records that `id` now holds `hashes` (touching them as most recently used). Returns the
    /// touches it stamped them with, from which a [`Claim`] on a tail of them can be made.
    ///
    /// The tail is stamped first, so it is evicted before the head: vLLM frees a request's
    /// blocks in reverse (`free_blocks(reversed(...))` in vLLM 0.33's
    /// `v1/core/single_type_kv_cache_manager.py`, "the first block will be evicted first"),
    /// so its LRU drops a prompt's last blocks and keeps the prefix others share. Stamped head
    /// first, an index at its bound would drop the first block and with it the whole match.
    pub fn insert(&mut self, id: EndpointId, hashes: &[u64], now_ms: u64) -> Touches {
        self.slot(id);
        let Self {
            blocks,
            endpoints,
            seq: last,
            ..
        } = self;
        let slot = &mut endpoints[usize::from(id.0)];
        let first_seq = *last + 1;
        let mut seq = *last;
        for &h in hashes.iter().rev() {
            seq += 1;
            let stamp = Stamp::new(seq, now_ms);
            match blocks.entry(h) {
                hashbrown::hash_map::Entry::Occupied(mut e) => {
                    let block = e.get_mut();
                    if block.owner() == id.0 {
                        block.own(id.0, stamp);
                    } else if block.holders.contains(id) {
                        // Held, its stamp in `shared`: moved into the block when that is free.
                        if block.owner() == NO_OWNER {
                            slot.shared.remove(&h);
                            block.own(id.0, stamp);
                        } else {
                            slot.shared.insert(h, stamp);
                        }
                    } else {
                        block.holders.insert(id);
                        slot.len += 1;
                        if block.owner() == NO_OWNER {
                            block.own(id.0, stamp);
                        } else {
                            slot.shared.insert(h, stamp);
                        }
                    }
                }
                hashbrown::hash_map::Entry::Vacant(e) => {
                    e.insert(Block::new(id, stamp));
                    slot.len += 1;
                }
            }
        }
        *last = seq;
        // The touches in order, appended in one go (pushing them one by one showed at ~40
        // instructions a block in profiles).
        slot.order.extend(
            (first_seq..)
                .zip(hashes.iter().rev())
                .map(|(seq, &h)| (h, seq)),
        );
        self.compact(id);
        self.evict_over_capacity(id);
        Touches {
            first: first_seq,
            len: hashes.len() as u64,
        }
    }

    /// Takes back the blocks credited to `id` for a request its engine then refused
    /// unprefilled (a 400, a 5xx before any token), except those a later request touched
    /// since. All of them go, not only the first: they would keep their share of `id`'s
    /// capacity bound and evict blocks the engine does hold (a refused prompt longer than the
    /// model's context is the common case, and the longest). One insert stamps its blocks
    /// with consecutive touches, so they are found in the touch queue by one binary search.
    pub fn unclaim(&mut self, id: EndpointId, claim: Claim) {
        let Self {
            blocks, endpoints, ..
        } = self;
        let Some(slot) = endpoints.get_mut(usize::from(id.0)) else {
            return;
        };
        let end = claim.seq.saturating_add(claim.blocks);
        let from = slot.order.partition_point(|&(_, seq)| seq < claim.seq);
        let taken: Vec<u64> = slot
            .order
            .range(from..)
            .take_while(|&&(_, seq)| seq < end)
            .filter(|&&touch| is_current(blocks, slot, id, touch).is_some())
            .map(|&(h, _)| h)
            .collect();
        for h in taken {
            forget(blocks, slot, id, h);
        }
        self.compact(id);
    }

    /// Marks the leading `hashes` that `id` already holds as just used, adding nothing: a cache
    /// hit refreshes a block's place in the engine's LRU order without any event saying so.
    /// Tail first, as [`PrefixIndex::insert`] stamps.
    pub fn touch(&mut self, id: EndpointId, hashes: &[u64], now_ms: u64) {
        let held = hashes.iter().take_while(|&&h| self.holds(id, h)).count();
        let Self {
            blocks,
            endpoints,
            seq,
            ..
        } = self;
        let Some(slot) = endpoints.get_mut(usize::from(id.0)) else {
            return;
        };
        for &h in hashes[..held].iter().rev() {
            let Some(block) = blocks.get_mut(&h) else {
                break;
            };
            *seq += 1;
            let stamp = Stamp::new(*seq, now_ms);
            if block.owner() == id.0 {
                block.own(id.0, stamp);
            } else if let Some(s) = slot.shared.get_mut(&h) {
                *s = stamp;
            }
            slot.order.push_back((h, *seq));
        }
        self.compact(id);
    }

    /// Forgets that `id` holds `hash` (a `BlockRemoved` event in precise mode).
    pub fn remove(&mut self, id: EndpointId, hash: u64) {
        let (blocks, slot) = self.split(id);
        forget(blocks, slot, id, hash);
    }

    /// Forgets everything about `id` (endpoint removed, cache cleared, event stream lost).
    pub fn clear_endpoint(&mut self, id: EndpointId) {
        let (blocks, slot) = self.split(id);
        // Every block it holds has its current touch in the queue.
        for touch in std::mem::take(&mut slot.order) {
            unset_if_current(blocks, slot, id, touch);
        }
        slot.shared.clear();
        slot.len = 0;
        slot.orphans = 0;
    }

    fn evict_over_capacity(&mut self, id: EndpointId) {
        let (blocks, slot) = self.split(id);
        while slot.len > slot.capacity {
            let Some(touch) = slot.order.pop_front() else {
                return;
            };
            unset_if_current(blocks, slot, id, touch);
        }
    }

    /// Drops the stale touches that pile up in an endpoint's queue when hot blocks are re-touched.
    ///
    /// A touch is stale when its block was stamped again (a newer touch of the same hash is
    /// queued) or forgotten. Without forgotten ones (`orphans`), the newest touch of each hash
    /// is the current one, found from the back of the queue in a set of this endpoint's blocks
    /// alone, which stays in cache; looking each touch up in the table of every block (tens of
    /// MB at a million blocks) cost a cache miss a touch, and compaction was a tenth of the
    /// control plane's time serving route calls. With orphans, every touch is checked there.
    fn compact(&mut self, id: EndpointId) {
        let (blocks, slot) = self.split(id);
        if slot.order.len() <= 2 * slot.len + 64 {
            return;
        }
        let mut order = std::mem::take(&mut slot.order);
        if slot.orphans == 0 {
            let mut newest = hashbrown::HashSet::with_capacity(slot.len);
            // Back to front: a hash's first touch seen is its newest.
            let mut current: Vec<bool> =
                order.iter().rev().map(|&(h, _)| newest.insert(h)).collect();
            // Every test that compacts checks the shortcut against the table.
            #[cfg(test)]
            for (&touch, &kept) in order.iter().zip(current.iter().rev()) {
                assert_eq!(
                    kept,
                    is_current(blocks, slot, id, touch).is_some(),
                    "{touch:?}"
                );
            }
            order.retain(|_| current.pop().unwrap_or(false));
        } else {
            order.retain(|&touch| is_current(blocks, slot, id, touch).is_some());
            slot.orphans = 0;
        }
        slot.order = order;
    }

    /// Drops entries whose TTL ran out. Cheap when nothing expired: one look at each queue head.
    pub fn expire(&mut self, now_ms: u64) {
        self.expire_before(now_ms, |_| u64::MAX);
    }

    /// [`PrefixIndex::expire`], except that an endpoint's entries stamped at or after
    /// `keep_from(id)` stay whatever their age: the speculative index keeps the blocks of
    /// requests whose prefill has not been seen to run, however long their queue. `keep_from`
    /// is asked only for an endpoint whose oldest entry outlived the TTL, at most once.
    pub fn expire_before(&mut self, now_ms: u64, mut keep_from: impl FnMut(EndpointId) -> u64) {
        let ttl = self.ttl_ms;
        for (i, slot) in self.endpoints.iter_mut().enumerate() {
            let id = EndpointId(i as u16);
            let mut kept_from = None;
            while let Some(&touch) = slot.order.front() {
                match is_current(&self.blocks, slot, id, touch) {
                    Some(s) if s.at_ms.saturating_add(ttl) > now_ms => break,
                    // The queue is in touch order, and touches are stamped in time order:
                    // everything behind a kept entry is kept too.
                    Some(s) if s.at_ms >= *kept_from.get_or_insert_with(|| keep_from(id)) => {
                        break;
                    }
                    current => {
                        slot.order.pop_front();
                        // Current (and expired): forget it; stale: the pop was all.
                        if current.is_some() {
                            unset(&mut self.blocks, slot, id, touch.0);
                        }
                    }
                }
            }
        }
    }

    /// For each endpoint holding at least the first block, how many leading blocks of `hashes`
    /// it holds (contiguous prefix only, as a prefix cache reuses). Calls `found(id, depth)`.
    pub fn matched_prefix(&self, hashes: &[u64], mut found: impl FnMut(EndpointId, usize)) {
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(h)) else {
            return;
        };
        let mut alive = first.holders;
        // Probe a chunk of blocks before walking it: the probes are independent cache misses
        // into a large map, and issuing them together lets the CPU overlap them (this loop is
        // memory-bound). At most one chunk of probes is wasted after the last match.
        const CHUNK: usize = 8;
        let mut depth = 1;
        for chunk in hashes[1..].chunks(CHUNK) {
            let mut sets = [EndpointSet::default(); CHUNK];
            for (slot, h) in sets.iter_mut().zip(chunk) {
                if let Some(b) = self.blocks.get(h) {
                    *slot = b.holders;
                }
            }
            for set in &sets[..chunk.len()] {
                let next = alive.and(set);
                // Most blocks drop no endpoint: skip walking an empty difference.
                if next != alive {
                    for id in alive.and_not(&next).iter() {
                        found(id, depth);
                    }
                }
                alive = next;
                if alive.is_empty() {
                    return;
                }
                depth += 1;
            }
        }
        for id in alive.iter() {
            found(id, hashes.len());
        }
    }

    /// Whether `id` holds the block `hash`.
    pub fn holds(&self, id: EndpointId, hash: u64) -> bool {
        self.blocks
            .get(&hash)
            .is_some_and(|b| b.holders.contains(id))
    }

    /// Blocks indexed for `id`.
    pub fn len_for(&self, id: EndpointId) -> usize {
        self.endpoints.get(usize::from(id.0)).map_or(0, |s| s.len)
    }

    /// How many of `id`'s blocks were last touched before `hash` was: its rank from the
    /// least recently used end, which says how much a full cache evicts before it reaches
    /// `hash`. Counted from the touch queue by one binary search, less every stale touch in the
    /// queue: a stale touch was superseded by a newer one, so stale touches gather at the old
    /// end. This is a lower bound, exact when they all come before `hash`'s touch; it never
    /// counts a block as protecting `hash` when it may not. `None` when `id` does not hold
    /// `hash`.
    pub fn older_than(&self, id: EndpointId, hash: u64) -> Option<usize> {
        let slot = self.endpoints.get(usize::from(id.0))?;
        let seq = stamp_of(self.blocks.get(&hash)?, id, hash, slot)?.seq;
        let position = slot.order.partition_point(|&(_, touched)| touched < seq);
        let stale = slot.order.len().saturating_sub(slot.len);
        Some(position.saturating_sub(stale))
    }

    /// Distinct blocks in the index.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Approximate heap bytes used, for the index-memory metric.
    pub fn approx_bytes(&self) -> usize {
        let blocks = self.blocks.capacity() * (8 + std::mem::size_of::<Block>() + 1);
        let per: usize = self
            .endpoints
            .iter()
            .map(|s| {
                s.shared.capacity() * (8 + std::mem::size_of::<Stamp>() + 1)
                    + s.order.capacity() * 16
            })
            .sum();
        blocks + per
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // An index sized for its bound keeps one holders table through churn at the bound: it never
    // grows in steps, which a wasm VM would keep as its memory's high-water mark.
    #[test]
    fn a_reserved_index_does_not_grow_under_churn() {
        let mut index = PrefixIndex::new(u64::MAX);
        index.reserve_blocks(1_000);
        assert!(index.blocks.capacity() >= 2_000);
        let table = index.blocks.allocation_size();
        for e in 0..4 {
            index.set_capacity(EndpointId(e), 250);
        }
        for (i, chunk) in (0..40_000u64).collect::<Vec<_>>().chunks(16).enumerate() {
            index.insert(EndpointId((i % 4) as u16), chunk, i as u64);
        }
        assert_eq!(index.blocks.len(), 1_000);
        assert_eq!(index.blocks.allocation_size(), table);
    }

    fn depths(index: &PrefixIndex, hashes: &[u64]) -> Vec<(u16, usize)> {
        let mut out = Vec::new();
        index.matched_prefix(hashes, |id, d| out.push((id.0, d)));
        out.sort();
        out
    }

    #[test]
    fn contiguous_prefix_per_endpoint() {
        let mut idx = PrefixIndex::new(10_000);
        idx.insert(EndpointId(0), &[1, 2, 3], 0);
        idx.insert(EndpointId(1), &[1, 2], 0);
        idx.insert(EndpointId(2), &[2, 3], 0);
        assert_eq!(depths(&idx, &[1, 2, 3, 4]), vec![(0, 3), (1, 2)]);
        assert!(depths(&idx, &[9, 1]).is_empty());
    }

    #[test]
    fn capacity_evicts_least_recently_used_a_prompts_tail_first() {
        let mut idx = PrefixIndex::new(10_000);
        idx.set_capacity(EndpointId(3), 3);
        idx.insert(EndpointId(3), &[1, 2, 3], 0);
        idx.insert(EndpointId(3), &[4], 1);
        // The prompt's last block goes, as vLLM evicts it; its prefix still matches.
        assert_eq!(idx.len_for(EndpointId(3)), 3);
        assert_eq!(depths(&idx, &[1, 2, 3]), vec![(3, 2)]);
        idx.insert(EndpointId(3), &[2], 2); // touch 2: 1 is now the oldest
        idx.insert(EndpointId(3), &[5], 3);
        assert!(depths(&idx, &[1]).is_empty());
        assert_eq!(depths(&idx, &[2]), vec![(3, 1)]);
    }

    #[test]
    fn ttl_expires_untouched_blocks() {
        let mut idx = PrefixIndex::new(100);
        idx.insert(EndpointId(0), &[1], 0);
        idx.insert(EndpointId(0), &[2], 50);
        idx.expire(120);
        assert!(depths(&idx, &[1]).is_empty());
        assert_eq!(depths(&idx, &[2]), vec![(0, 1)]);
        assert_eq!(idx.distinct_blocks(), 1);
    }

    #[test]
    fn remove_and_clear() {
        let mut idx = PrefixIndex::new(1000);
        idx.insert(EndpointId(200), &[1, 2], 0);
        idx.remove(EndpointId(200), 2);
        assert_eq!(depths(&idx, &[1, 2]), vec![(200, 1)]);
        idx.clear_endpoint(EndpointId(200));
        assert_eq!(idx.distinct_blocks(), 0);
    }

    #[test]
    fn unclaimed_blocks_leave_unless_touched_since() {
        let mut idx = PrefixIndex::new(u64::MAX / 2);
        let (a, b) = (EndpointId(0), EndpointId(1));
        idx.insert(b, &[1, 2, 3, 4], 0);
        idx.insert(a, &[1], 0);
        // `a` already held block 1; the insert credits 2, 3 and 4.
        let claim = idx.insert(a, &[1, 2, 3, 4], 1).claim_after(1).unwrap();
        assert_eq!(idx.insert(a, &[1], 1).claim_after(1), None);
        // A later request touches block 3: its credit stays.
        idx.insert(a, &[1, 2, 3], 2);
        idx.unclaim(a, claim);
        assert_eq!(depths(&idx, &[1, 2, 3, 4]), vec![(0, 3), (1, 4)]);
        assert!(!idx.holds(a, 4) && idx.holds(b, 4));
        assert_eq!(idx.len_for(a), 3);
        // Again: a stale claim changes nothing.
        idx.unclaim(a, claim);
        assert_eq!(idx.len_for(a), 3);
        // Untouched, every credited block goes, and its share of the capacity with it.
        let claim = idx.insert(b, &[1, 2, 3, 4], 3).claim_after(0).unwrap();
        idx.unclaim(b, claim);
        assert_eq!(idx.len_for(b), 0);
        assert_eq!(depths(&idx, &[1, 2, 3, 4]), vec![(0, 3)]);
    }

    #[test]
    fn a_claim_outlives_the_eviction_of_some_of_its_blocks() {
        // A prompt longer than the endpoint's capacity evicts its own last blocks; the rest
        // are still taken back.
        let mut idx = PrefixIndex::new(u64::MAX / 2);
        let a = EndpointId(0);
        idx.set_capacity(a, 3);
        let claim = idx.insert(a, &[1, 2, 3, 4, 5], 0).claim_after(0).unwrap();
        assert_eq!(idx.len_for(a), 3);
        idx.unclaim(a, claim);
        assert_eq!(idx.len_for(a), 0);
    }

    #[test]
    fn repeated_touches_stay_bounded() {
        let mut idx = PrefixIndex::new(u64::MAX / 2);
        for t in 0..10_000 {
            idx.insert(EndpointId(0), &[1, 2], t);
        }
        assert!(idx.endpoints[0].order.len() < 200);
    }

    #[test]
    fn older_than_ranks_a_block_from_the_least_recently_used_end() {
        let mut index = PrefixIndex::new(u64::MAX / 4);
        let e = EndpointId(0);
        // A prompt's tail is its oldest block (vLLM frees tail first).
        index.insert(e, &[1, 2, 3], 0);
        index.insert(e, &[4, 5], 1);
        assert_eq!(index.older_than(e, 3), Some(0));
        assert_eq!(index.older_than(e, 1), Some(2));
        assert_eq!(index.older_than(e, 4), Some(4));
        // Touching the first prompt again makes it the newest; its old touches are stale.
        index.insert(e, &[1, 2, 3], 2);
        assert_eq!(index.older_than(e, 3), Some(2));
        assert_eq!(index.older_than(e, 4), Some(1));
        assert_eq!(index.older_than(e, 9), None);
        assert_eq!(index.older_than(EndpointId(7), 1), None);
        // A touch refreshes held blocks only, up to the first it does not hold.
        index.touch(e, &[4, 8, 5], 3);
        assert_eq!(index.older_than(e, 4), Some(4));
        assert_eq!(index.len_for(e), 5);
    }

    /// What the index promises, kept the plainest way: every (endpoint, block) with its
    /// stamp; LRU and TTL eviction take the lowest stamps.
    #[derive(Default)]
    struct Model {
        seq: u64,
        capacity: HashMap<u16, usize>,
        live: HashMap<(u16, u64), (u64, u64)>,
    }

    impl Model {
        fn len_for(&self, id: u16) -> usize {
            self.live.keys().filter(|(e, _)| *e == id).count()
        }
        fn oldest(&self, id: u16) -> Option<((u16, u64), (u64, u64))> {
            self.live
                .iter()
                .filter(|((e, _), _)| *e == id)
                .min_by_key(|(_, (seq, _))| *seq)
                .map(|(k, v)| (*k, *v))
        }
        fn evict(&mut self, id: u16) {
            while self.len_for(id) > self.capacity.get(&id).copied().unwrap_or(usize::MAX) {
                let (key, _) = self.oldest(id).unwrap();
                self.live.remove(&key);
            }
        }
        fn insert(&mut self, id: u16, hashes: &[u64], now: u64) -> (u64, u64) {
            let first = self.seq + 1;
            for &h in hashes.iter().rev() {
                self.seq += 1;
                self.live.insert((id, h), (self.seq, now));
            }
            self.evict(id);
            (first, hashes.len() as u64)
        }
        fn touch(&mut self, id: u16, hashes: &[u64], now: u64) {
            let held = hashes
                .iter()
                .take_while(|h| self.live.contains_key(&(id, **h)))
                .count();
            for &h in hashes[..held].iter().rev() {
                self.seq += 1;
                self.live.insert((id, h), (self.seq, now));
            }
        }
        fn expire(&mut self, ttl: u64, now: u64) {
            for id in 0..ENDPOINTS {
                while let Some((key, (_, at))) = self.oldest(id) {
                    if at.saturating_add(ttl) > now {
                        break;
                    }
                    self.live.remove(&key);
                }
            }
        }
    }

    const ENDPOINTS: u16 = 4;

    // Random operations on the index and on the model, compared after each: which endpoints
    // hold which prefix, how many blocks each holds, and the LRU rank (a lower bound of the
    // exact one). A few endpoints over a few dozen blocks, so blocks are shared, stamps move
    // between a block's entry and an endpoint's map, and claims, eviction and TTL all bite.
    #[test]
    fn the_index_agrees_with_a_plain_model_under_random_operations() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for round in 0..20 {
            let ttl = 50 + round * 10;
            // Odd rounds forget nothing (no unclaim, removal, clearing or bound), so their
            // compactions find the current touches without the block table.
            let forgetting = round % 2 == 0;
            let mut index = PrefixIndex::new(ttl);
            let mut model = Model::default();
            let mut claims: Vec<(u16, Claim, (u64, u64))> = Vec::new();
            let mut now = 0;
            for _ in 0..400 {
                now += next(4);
                let id = next(u64::from(ENDPOINTS)) as u16;
                let start = next(40);
                let hashes: Vec<u64> = (start..start + 1 + next(12)).collect();
                match next(20) {
                    0..=9 => {
                        let touches = index.insert(EndpointId(id), &hashes, now);
                        let (first, len) = model.insert(id, &hashes, now);
                        assert_eq!((touches.first, touches.len), (first, len));
                        let held = next(len + 1) as usize;
                        if let Some(claim) = touches.claim_after(held) {
                            claims.push((id, claim, (first, len - held as u64)));
                        }
                    }
                    10..=12 => {
                        index.touch(EndpointId(id), &hashes, now);
                        model.touch(id, &hashes, now);
                    }
                    13..=16 if !forgetting => {
                        index.touch(EndpointId(id), &hashes, now);
                        model.touch(id, &hashes, now);
                    }
                    13 if !claims.is_empty() => {
                        let (id, claim, (seq, n)) =
                            claims.remove(next(claims.len() as u64) as usize);
                        index.unclaim(EndpointId(id), claim);
                        model
                            .live
                            .retain(|&(e, _), &mut (s, _)| e != id || s < seq || s >= seq + n);
                    }
                    14 => {
                        index.remove(EndpointId(id), hashes[0]);
                        model.live.remove(&(id, hashes[0]));
                    }
                    15 if next(8) == 0 => {
                        index.clear_endpoint(EndpointId(id));
                        model.live.retain(|&(e, _), _| e != id);
                    }
                    16 => {
                        let capacity = 5 + next(30) as usize;
                        index.set_capacity(EndpointId(id), capacity);
                        model.capacity.insert(id, capacity);
                        model.evict(id);
                    }
                    _ => {
                        index.expire(now);
                        model.expire(ttl, now);
                    }
                }
                let probe: Vec<u64> = (next(40)..60).collect();
                let mut want = Vec::new();
                for e in 0..ENDPOINTS {
                    let depth = probe
                        .iter()
                        .take_while(|h| model.live.contains_key(&(e, **h)))
                        .count();
                    if depth > 0 {
                        want.push((e, depth));
                    }
                    assert_eq!(index.len_for(EndpointId(e)), model.len_for(e));
                }
                assert_eq!(depths(&index, &probe), want);
                let distinct: std::collections::HashSet<u64> =
                    model.live.keys().map(|(_, h)| *h).collect();
                assert_eq!(index.distinct_blocks(), distinct.len());
                for (&(e, h), &(seq, _)) in &model.live {
                    assert!(index.holds(EndpointId(e), h));
                    let exact = model
                        .live
                        .iter()
                        .filter(|((o, _), (s, _))| *o == e && *s < seq)
                        .count();
                    let rank = index.older_than(EndpointId(e), h).unwrap();
                    assert!(rank <= exact, "rank {rank} above the exact {exact}");
                }
                assert_eq!(index.older_than(EndpointId(0), 1_000), None);
                // Each holder's stamp is in exactly one place.
                for (i, slot) in index.endpoints.iter().enumerate() {
                    let id = EndpointId(i as u16);
                    let held = index.blocks.values().filter(|b| b.holders.contains(id));
                    let elsewhere = held.clone().filter(|b| b.owner() != id.0).count();
                    assert_eq!(slot.len, held.count());
                    assert_eq!(slot.shared.len(), elsewhere);
                }
            }
        }
    }
}
