//! The paged KV block pool with automatic prefix caching, shaped like vLLM V1's `BlockPool`.
//!
//! Every block has a reference count and, once full and computed, the chained hash of the
//! tokens it holds. Blocks with no references sit in a free queue (an intrusive doubly linked
//! list, so touching a cached block is O(1)). A freed block that is cached goes to the tail and
//! keeps its hash, so it can be reused by a later request; a freed block without a hash goes to
//! the head, as it is worth nothing. Allocation pops the head, so a cached block is evicted only
//! when no empty block is left, and then in least-recently-freed order.
//!
//! (vLLM appends all freed blocks to the tail; putting hashless blocks first keeps strictly
//! more cache and makes "evict only under pressure" exact.)

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
    cached: HashMap<u64, BlockId>,
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

    /// Blocks that hold a cached hash (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of blocks referenced by requests: vLLM's `kv_cache_usage_perc`.
    pub fn usage(&self) -> f64 {
        let n = self.num_blocks();
        if n == 0 {
            return 0.0;
        }
        f64::from(n - self.free_len) / f64::from(n)
    }

    /// The cached block holding `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
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

    /// Takes a free block, evicting its cached hash (pushed to `evicted`) if it has one.
    pub fn allocate(&mut self, evicted: &mut Vec<u64>) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.hash[b as usize].take() {
            self.cached.remove(&h);
            evicted.push(h);
        }
        self.ref_cnt[b as usize] = 1;
        Some(b)
    }

    /// Drops one reference on each block, releasing the last block of a sequence first so a
    /// prefix outlives its tail in the LRU order.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let rc = &mut self.ref_cnt[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                if self.hash[b as usize].is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }

    /// Marks a full, computed block as holding `hash`. Returns false (and leaves the block
    /// hashless) when another block already caches the same hash.
    pub fn register(&mut self, block: BlockId, hash: u64) -> bool {
        if self.hash[block as usize].is_some() || self.cached.contains_key(&hash) {
            return false;
        }
        self.cached.insert(hash, block);
        self.hash[block as usize] = Some(hash);
        true
    }

    /// Forgets every cached hash (vLLM `reset_prefix_cache`).
    pub fn clear_cache(&mut self) {
        for h in self.hash.iter_mut() {
            *h = None;
        }
        self.cached.clear();
    }

    fn push_back(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.in_free[i] = true;
        self.free_len += 1;
    }

    fn push_front(&mut self, b: BlockId) {
        let i = b as usize;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.in_free[i] = true;
        self.free_len += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        if !self.in_free[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_free[i] = false;
        self.free_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn touch_pins_a_cached_block() {
        let mut pool = BlockPool::new(2);
        let mut ev = Vec::new();
        let a = pool.allocate(&mut ev).unwrap();
        assert!(pool.register(a, 5));
        assert!(!pool.register(a, 6), "a block holds one hash");
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
