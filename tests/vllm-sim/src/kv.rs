//! The paged KV block pool with automatic prefix caching, shaped like vLLM 0.33's `BlockPool`.
//!
//! Every block has a reference count and, once the tokens that fill it are scheduled, the
//! chained hash of the tokens it holds. Blocks with no references sit in a free queue (an intrusive doubly linked
//! list, so touching a cached block is O(1)). Freeing a request's blocks walks them tail first
//! (vLLM frees `reversed(blocks)`) and, as `BlockPool.free_blocks` does, appends the cached ones
//! to the back of the queue (they keep their hash and can still be hit) and prepends the
//! hashless ones to the front, in that order (they are worth nothing). Allocation pops the
//! front, so a cached block is evicted only when no empty block is left, and then the least
//! recently freed first; within one request, its tail before its head.
//!
//! Like vLLM, the pool does not de-duplicate: two requests that compute the same block (one
//! admitted before the other scheduled it) both cache it under the same hash. A lookup returns the copy cached first; each
//! copy's eviction reports the hash once.

use hashbrown::HashMap;

/// Index of a physical block.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// The GPU block pool (see the module docs).
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u64>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    free_len: u32,
    /// Hash -> the copy a lookup returns (the first cached).
    cached: HashMap<u64, BlockId>,
    /// Hash -> further copies, in the order they were cached (rare).
    duplicates: HashMap<u64, Vec<BlockId>>,
    num_hashed: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks, all free.
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        let mut pool = Self {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            in_free: vec![false; n],
            head: NIL,
            tail: NIL,
            free_len: 0,
            cached: HashMap::new(),
            duplicates: HashMap::new(),
            num_hashed: 0,
        };
        for b in 0..num_blocks {
            pool.push_back(b);
        }
        pool
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Blocks no request references (empty or cached).
    pub fn num_free(&self) -> u32 {
        self.free_len
    }

    /// Blocks that hold a cached hash (referenced or not; duplicates counted).
    pub fn num_cached(&self) -> usize {
        self.num_hashed
    }

    /// Fraction of blocks referenced by requests: vLLM's `kv_cache_usage_perc`.
    pub fn usage(&self) -> f64 {
        let n = self.num_blocks();
        if n == 0 {
            return 0.0;
        }
        f64::from(n - self.free_len) / f64::from(n)
    }

    /// The cached block holding `hash` (the copy cached first), if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// The hash `block` holds, if it is cached.
    pub fn block_hash(&self, block: BlockId) -> Option<u64> {
        self.hash[block as usize]
    }

    /// References of `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_cnt[block as usize]
    }

    /// Takes a reference on cached blocks a new request reuses.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.ref_cnt[b as usize] == 0 {
                self.unlink(b);
            }
            self.ref_cnt[b as usize] += 1;
        }
    }

    /// Takes the block at the front of the free queue, evicting its cached hash (pushed to
    /// `evicted`) if it has one.
    pub fn allocate(&mut self, evicted: &mut Vec<u64>) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.uncache(b) {
            evicted.push(h);
        }
        self.ref_cnt[b as usize] = 1;
        Some(b)
    }

    /// Drops one reference on each of a request's blocks (given in sequence order). Blocks
    /// that become unreferenced join the free queue tail first: cached ones at the back,
    /// hashless ones at the front (see the module docs).
    pub fn free(&mut self, blocks: &[BlockId]) {
        let mut hashless: Vec<BlockId> = Vec::new();
        for &b in blocks.iter().rev() {
            let rc = &mut self.ref_cnt[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                if self.hash[b as usize].is_some() {
                    self.push_back(b);
                } else {
                    hashless.push(b);
                }
            }
        }
        // vLLM's prepend_n keeps the list order at the front of the queue.
        for &b in hashless.iter().rev() {
            self.push_front(b);
        }
    }

    /// Marks a full, scheduled block as holding `hash`. Returns false (and changes nothing)
    /// when the block already holds a hash. A hash already cached in another block is cached
    /// again (a duplicate copy), as vLLM does.
    pub fn register(&mut self, block: BlockId, hash: u64) -> bool {
        if self.hash[block as usize].is_some() {
            return false;
        }
        match self.cached.entry(hash) {
            hashbrown::hash_map::Entry::Vacant(slot) => {
                slot.insert(block);
            }
            hashbrown::hash_map::Entry::Occupied(_) => {
                self.duplicates.entry(hash).or_default().push(block);
            }
        }
        self.hash[block as usize] = Some(hash);
        self.num_hashed += 1;
        true
    }

    /// Forgets every cached hash (vLLM `reset_prefix_cache`).
    pub fn clear_cache(&mut self) {
        for h in self.hash.iter_mut() {
            *h = None;
        }
        self.cached.clear();
        self.duplicates.clear();
        self.num_hashed = 0;
    }

    /// Removes `b`'s hash from the cache; returns it.
    fn uncache(&mut self, b: BlockId) -> Option<u64> {
        let h = self.hash[b as usize].take()?;
        self.num_hashed -= 1;
        if self.cached.get(&h) == Some(&b) {
            // The next copy, if any, becomes the one lookups return.
            match self.duplicates.get_mut(&h) {
                Some(copies) => {
                    let next = copies.remove(0);
                    if copies.is_empty() {
                        self.duplicates.remove(&h);
                    }
                    self.cached.insert(h, next);
                }
                None => {
                    self.cached.remove(&h);
                }
            }
        } else if let Some(copies) = self.duplicates.get_mut(&h) {
            copies.retain(|c| *c != b);
            if copies.is_empty() {
                self.duplicates.remove(&h);
            }
        }
        Some(h)
    }

    fn push_back(&mut self, b: BlockId) {
        self.link(b, self.tail, NIL);
    }

    fn push_front(&mut self, b: BlockId) {
        self.link(b, NIL, self.head);
    }

    /// Puts block `b` into the free queue between `p` and `n` (`NIL`: that end of the queue).
    fn link(&mut self, b: BlockId, p: BlockId, n: BlockId) {
        let i = b as usize;
        self.prev[i] = p;
        self.next[i] = n;
        self.set_next(p, b);
        self.set_prev(n, b);
        self.in_free[i] = true;
        self.free_len += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        if !self.in_free[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        self.set_next(p, n);
        self.set_prev(n, p);
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_free[i] = false;
        self.free_len -= 1;
    }

    /// Points `p`'s forward link at `to`; `p` `NIL` means the queue's head.
    fn set_next(&mut self, p: BlockId, to: BlockId) {
        if p == NIL {
            self.head = to;
        } else {
            self.next[p as usize] = to;
        }
    }

    /// Points `n`'s backward link at `to`; `n` `NIL` means the queue's tail.
    fn set_prev(&mut self, n: BlockId, to: BlockId) {
        if n == NIL {
            self.tail = to;
        } else {
            self.prev[n as usize] = to;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The free queue, front (next to allocate) first.
    fn queue(pool: &BlockPool) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut b = pool.head;
        while b != NIL {
            out.push(b);
            b = pool.next[b as usize];
        }
        out
    }

    #[test]
    fn empty_blocks_go_before_cached_ones() {
        let mut pool = BlockPool::new(4);
        let mut ev = Vec::new();
        let a = pool.allocate(&mut ev).unwrap();
        let b = pool.allocate(&mut ev).unwrap();
        assert!(pool.register(a, 11));
        pool.free(&[a, b]);
        assert_eq!(pool.num_free(), 4);
        // Three hashless blocks are handed out before the cached one is evicted.
        let got: Vec<_> = (0..3).map(|_| pool.allocate(&mut ev).unwrap()).collect();
        assert!(!got.contains(&a));
        assert!(ev.is_empty());
        assert_eq!(pool.lookup(11), Some(a));
        assert_eq!(pool.allocate(&mut ev), Some(a));
        assert_eq!(ev, vec![11]);
        assert_eq!(pool.lookup(11), None);
        assert_eq!(pool.allocate(&mut ev), None);
    }

    #[test]
    fn free_order_matches_vllm_free_blocks() {
        let mut pool = BlockPool::new(8);
        let mut ev = Vec::new();
        let blocks: Vec<_> = (0..6).map(|_| pool.allocate(&mut ev).unwrap()).collect();
        assert_eq!(blocks, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(queue(&pool), vec![6, 7]);
        // A request whose first three blocks are full and cached, the rest not.
        for (i, b) in blocks[..3].iter().enumerate() {
            assert!(pool.register(*b, 100 + i as u64));
        }
        pool.free(&blocks);
        // reversed(blocks): hashless [5, 4, 3] prepended as a group, cached [2, 1, 0] appended.
        assert_eq!(queue(&pool), vec![5, 4, 3, 6, 7, 2, 1, 0]);
        // So eviction takes the tail of the cached prefix first.
        let got: Vec<_> = (0..6).map(|_| pool.allocate(&mut ev).unwrap()).collect();
        assert_eq!(got, vec![5, 4, 3, 6, 7, 2]);
        assert_eq!(ev, vec![102]);
        assert_eq!(pool.lookup(100), Some(0));
    }

    #[test]
    fn least_recently_freed_is_evicted_first() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let (a, b, c) = (
            pool.allocate(&mut ev).unwrap(),
            pool.allocate(&mut ev).unwrap(),
            pool.allocate(&mut ev).unwrap(),
        );
        for (blk, h) in [(a, 1), (b, 2), (c, 3)] {
            assert!(pool.register(blk, h));
        }
        pool.free(&[b]);
        pool.free(&[a]);
        pool.free(&[c]);
        // Reusing b moves it out of the queue; freed again, it is the most recent.
        pool.touch(&[b]);
        pool.free(&[b]);
        assert_eq!(queue(&pool), vec![a, c, b]);
        pool.allocate(&mut ev);
        pool.allocate(&mut ev);
        assert_eq!(ev, vec![1, 3]);
        assert_eq!(pool.lookup(2), Some(b));
    }

    #[test]
    fn duplicate_blocks_are_cached_and_evicted_like_vllm() {
        let mut pool = BlockPool::new(2);
        let mut ev = Vec::new();
        let first = pool.allocate(&mut ev).unwrap();
        let second = pool.allocate(&mut ev).unwrap();
        assert!(pool.register(first, 42));
        assert!(
            pool.register(second, 42),
            "the same block computed twice is cached twice"
        );
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(
            pool.lookup(42),
            Some(first),
            "lookups return the first copy"
        );
        pool.free(&[first]);
        pool.free(&[second]);
        // Evicting the first copy reports the hash; the second still serves lookups.
        assert_eq!(pool.allocate(&mut ev), Some(first));
        assert_eq!(ev, vec![42]);
        assert_eq!(pool.lookup(42), Some(second));
        assert_eq!(pool.allocate(&mut ev), Some(second));
        assert_eq!(ev, vec![42, 42], "each copy's eviction is reported");
        assert_eq!(pool.lookup(42), None);
        assert_eq!(pool.num_cached(), 0);
    }

    #[test]
    fn evicting_a_duplicate_keeps_the_first_copy() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate(&mut ev).unwrap()).collect();
        for b in &blocks {
            pool.register(*b, 7);
        }
        pool.free(&[blocks[1]]);
        assert_eq!(pool.allocate(&mut ev), Some(blocks[1]));
        assert_eq!(pool.lookup(7), Some(blocks[0]));
        pool.free(&[blocks[0]]);
        assert_eq!(pool.allocate(&mut ev), Some(blocks[0]));
        assert_eq!(pool.lookup(7), Some(blocks[2]));
        pool.clear_cache();
        assert_eq!(pool.lookup(7), None);
        assert_eq!(pool.num_cached(), 0);
    }

    #[test]
    fn touch_pins_a_cached_block() {
        let mut pool = BlockPool::new(2);
        let mut ev = Vec::new();
        let a = pool.allocate(&mut ev).unwrap();
        assert!(pool.register(a, 5));
        assert!(!pool.register(a, 6), "a block holds one hash");
        assert_eq!(pool.block_hash(a), Some(5));
        pool.free(&[a]);
        pool.touch(&[a]);
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.ref_count(a), 1);
        assert!(pool.allocate(&mut ev).is_some());
        assert!(pool.allocate(&mut ev).is_none());
        assert!(ev.is_empty());
        assert!((pool.usage() - 1.0).abs() < 1e-12);
    }
}
