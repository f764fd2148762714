//! A bounded map from a 64-bit content hash to token ids, with two generations.
//!
//! Lookups check the young generation, then the old one (promoting the hit). When the young
//! generation fills up it becomes the old one and the previous old one is dropped, so memory
//! stays under `2 × capacity / 2` entries and recently used entries survive: the classic
//! two-generation approximation of LRU without per-entry bookkeeping.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Shared, cheaply cloned token ids.
pub type Ids = Arc<[u32]>;

/// The cache; `capacity` 0 disables it.
#[derive(Debug)]
pub struct TokenCache {
    half: usize,
    inner: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    young: HashMap<u64, Ids>,
    old: HashMap<u64, Ids>,
}

impl TokenCache {
    /// A cache holding at most about `capacity` entries.
    pub fn new(capacity: usize) -> Self {
        Self {
            half: capacity / 2,
            inner: Mutex::new(Generations::default()),
        }
    }

    /// The ids stored under `key`, if still cached.
    pub fn get(&self, key: u64) -> Option<Ids> {
        if self.half == 0 {
            return None;
        }
        let mut g = self.inner.lock();
        if let Some(ids) = g.young.get(&key) {
            return Some(ids.clone());
        }
        let ids = g.old.remove(&key)?;
        Self::insert_young(&mut g, self.half, key, ids.clone());
        Some(ids)
    }

    /// Stores `ids` under `key`.
    pub fn insert(&self, key: u64, ids: Ids) {
        if self.half == 0 {
            return;
        }
        let mut g = self.inner.lock();
        Self::insert_young(&mut g, self.half, key, ids);
    }

    fn insert_young(g: &mut Generations, half: usize, key: u64, ids: Ids) {
        if g.young.len() >= half && !g.young.contains_key(&key) {
            g.old = std::mem::take(&mut g.young);
        }
        g.young.insert(key, ids);
    }

    /// Entries currently held.
    pub fn len(&self) -> usize {
        let g = self.inner.lock();
        g.young.len() + g.old.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(x: u32) -> Ids {
        Arc::from(vec![x])
    }

    #[test]
    fn bounded_and_keeps_recent_entries() {
        let c = TokenCache::new(4);
        for k in 0..100 {
            c.insert(k, ids(k as u32));
            assert!(c.len() <= 4);
        }
        assert_eq!(c.get(99).as_deref(), Some(&[99][..]));
        assert!(c.get(0).is_none());
        // A hit in the old generation is promoted and survives the next turnover.
        c.insert(200, ids(200));
        assert!(c.get(99).is_some());
        c.insert(201, ids(201));
        c.insert(202, ids(202));
        assert!(c.get(99).is_some());
    }

    #[test]
    fn zero_capacity_disables() {
        let c = TokenCache::new(0);
        c.insert(1, ids(1));
        assert!(c.get(1).is_none());
        assert!(c.is_empty());
    }
}
