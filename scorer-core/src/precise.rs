//! Precise mode: turning an engine's KV events into index entries keyed by kvroute's own hash.
//!
//! vLLM names blocks by its own hash (sha256 of pickle or CBOR, seeded per process or not,
//! truncated to 64 bits or not). We never reproduce it: a `BlockStored` event carries the
//! blocks' `token_ids`, so we recompute our chained xxh3 hash over them (seeded by the model or
//! LoRA name) and remember, per endpoint, which engine hash maps to which of ours, for parents
//! of later stores and for removals. This is Dynamo's and llm-d's approach.

use hashbrown::HashMap;

use crate::hash::{request_seed, token_block_hashes};
use crate::index::{EndpointId, PrefixIndex};

/// Which tier a block lives in (vLLM's `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// GPU memory: reusable at no cost.
    Gpu,
    /// CPU offload: cheaper than recompute, dearer than GPU.
    Cpu,
    /// Disk or remote storage.
    Storage,
}

impl Medium {
    /// This tier's bit in a block's set of tiers.
    fn bit(self) -> u8 {
        match self {
            Medium::Gpu => 1,
            Medium::Cpu => 2,
            Medium::Storage => 4,
        }
    }

    /// Parses vLLM's medium string; `None` (absent) means GPU.
    pub fn parse(s: Option<&str>) -> Medium {
        match s.map(str::to_ascii_uppercase).as_deref() {
            Some("CPU") => Medium::Cpu,
            Some("STORAGE") | Some("DISK") => Medium::Storage,
            _ => Medium::Gpu,
        }
    }
}

/// One KV-cache event, decoded from whatever wire encoding the engine used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks were stored (computed or loaded).
    BlockStored {
        /// Engine hashes of the new blocks, in order.
        block_hashes: Vec<u64>,
        /// Engine hash of the block before the first new one (`None` at the prompt start).
        parent_block_hash: Option<u64>,
        /// Tokens of all new blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens a block holds.
        block_size: u32,
        /// LoRA adapter the blocks belong to.
        lora_name: Option<String>,
        /// The request's vLLM `cache_salt`, as found in block 0's extra keys. vLLM adds it to
        /// block 0 only, so it counts only for a run that starts there (`parent_block_hash`
        /// `None`); later blocks inherit it through their parent's hash.
        cache_salt: Option<String>,
        /// Tier the blocks are in.
        medium: Medium,
    },
    /// Blocks were evicted from a tier.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<u64>,
        /// Tier they left.
        medium: Medium,
    },
    /// The engine dropped its whole prefix cache.
    AllBlocksCleared,
}

/// Why an event could not be applied. The caller drops the endpoint's state rather than keep a
/// possibly corrupt view.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// A stored run's parent was never seen: an event was missed.
    #[error("unknown parent block {0:#x}: an event was missed")]
    UnknownParent(u64),
    /// `token_ids` does not hold `block_size` tokens for every block hash.
    #[error("{tokens} tokens do not fill {blocks} blocks of {block_size}")]
    TokenCountMismatch {
        /// Tokens in the event.
        tokens: usize,
        /// Block hashes in the event.
        blocks: usize,
        /// Declared block size.
        block_size: u32,
    },
}

/// Per-endpoint mapping from engine hashes to our hashes, feeding two indexes (GPU, offload).
/// A block may sit in several tiers at once (an offloading engine writes GPU blocks through to
/// CPU), so each engine hash keeps the set of tiers holding it, as `Medium::bit`s, and leaves
/// the map only when the last one drops it.
#[derive(Debug, Default)]
pub struct PreciseTracker {
    maps: HashMap<EndpointId, HashMap<u64, (u64, u8)>>,
}

/// Tier bits of the offload index (CPU and storage).
const OFFLOAD_BITS: u8 = 2 | 4;

impl PreciseTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies `event` from endpoint `id` serving `model`, updating `gpu` (GPU tier) and
    /// `offload` (CPU and storage tiers). On error nothing was changed for that event.
    pub fn apply(
        &mut self,
        id: EndpointId,
        model: &str,
        event: &KvEvent,
        gpu: &mut PrefixIndex,
        offload: &mut PrefixIndex,
        now_ms: u64,
    ) -> Result<(), ApplyError> {
        let map = self.maps.entry(id).or_default();
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                medium,
            } => {
                let bs = *block_size as usize;
                if bs == 0 || token_ids.len() != block_hashes.len() * bs {
                    return Err(ApplyError::TokenCountMismatch {
                        tokens: token_ids.len(),
                        blocks: block_hashes.len(),
                        block_size: *block_size,
                    });
                }
                let seed = match parent_block_hash {
                    None => {
                        request_seed(lora_name.as_deref().unwrap_or(model), cache_salt.as_deref())
                    }
                    Some(p) => map
                        .get(p)
                        .map(|(ours, _)| *ours)
                        .ok_or(ApplyError::UnknownParent(*p))?,
                };
                let ours = token_block_hashes(seed, token_ids, bs);
                let target = if *medium == Medium::Gpu { gpu } else { offload };
                target.insert(id, &ours, now_ms);
                for (engine, our) in block_hashes.iter().zip(ours) {
                    let entry = map.entry(*engine).or_insert((our, 0));
                    if entry.0 != our {
                        // The engine reused a hash for other content: only the new one holds.
                        *entry = (our, 0);
                    }
                    entry.1 |= medium.bit();
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                for engine in block_hashes {
                    let Some(entry) = map.get_mut(engine) else {
                        continue;
                    };
                    let our = entry.0;
                    entry.1 &= !medium.bit();
                    if *medium == Medium::Gpu {
                        gpu.remove(id, our);
                    } else if entry.1 & OFFLOAD_BITS == 0 {
                        offload.remove(id, our);
                    }
                    if entry.1 == 0 {
                        map.remove(engine);
                    }
                }
            }
            KvEvent::AllBlocksCleared => self.clear(id, gpu, offload),
        }
        Ok(())
    }

    /// Forgets everything about endpoint `id` (cleared cache, publisher restart, lost events).
    pub fn clear(&mut self, id: EndpointId, gpu: &mut PrefixIndex, offload: &mut PrefixIndex) {
        self.maps.remove(&id);
        gpu.clear_endpoint(id);
        offload.clear_endpoint(id);
    }

    /// Our hashes of the blocks a `BlockRemoved` event from `id` takes out of its GPU tier (empty
    /// for other events), looked up before the event is applied. The router drops them from
    /// its speculative entries too: an eviction is newer news than a routing decision.
    pub fn removed_from_gpu(&self, id: EndpointId, event: &KvEvent) -> Vec<u64> {
        let (
            KvEvent::BlockRemoved {
                block_hashes,
                medium: Medium::Gpu,
            },
            Some(map),
        ) = (event, self.maps.get(&id))
        else {
            return Vec::new();
        };
        block_hashes
            .iter()
            .filter_map(|engine| {
                map.get(engine)
                    .filter(|(_, tiers)| tiers & Medium::Gpu.bit() != 0)
                    .map(|(our, _)| *our)
            })
            .collect()
    }

    /// Engine blocks tracked for `id`.
    pub fn tracked(&self, id: EndpointId) -> usize {
        self.maps.get(&id).map_or(0, HashMap::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::model_seed;

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: std::ops::Range<u32>,
        medium: Medium,
    ) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.collect(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium,
        }
    }

    /// A tracker with the GPU and offload indexes it writes to.
    struct Tiers {
        t: PreciseTracker,
        gpu: PrefixIndex,
        off: PrefixIndex,
    }

    impl Tiers {
        /// Applies `event` from `id`, whose blocks are model `m`'s.
        fn apply(
            &mut self,
            id: EndpointId,
            event: &KvEvent,
            now_ms: u64,
        ) -> Result<(), ApplyError> {
            self.t
                .apply(id, "m", event, &mut self.gpu, &mut self.off, now_ms)
        }

        /// Applies `event` from `id` at time 0; it must apply.
        fn apply_ok(&mut self, id: EndpointId, event: &KvEvent) {
            self.apply(id, event, 0).unwrap();
        }
    }

    /// A tracker with empty GPU and offload indexes whose entries never expire.
    fn fresh() -> Tiers {
        Tiers {
            t: PreciseTracker::new(),
            gpu: PrefixIndex::new(u64::MAX / 2),
            off: PrefixIndex::new(u64::MAX / 2),
        }
    }

    fn depth(index: &PrefixIndex, hashes: &[u64]) -> usize {
        let mut d = 0;
        index.matched_prefix(hashes, |_, x| d = d.max(x));
        d
    }

    #[test]
    fn chained_stores_match_request_hashes() {
        let mut f = fresh();
        let id = EndpointId(1);
        f.apply_ok(id, &stored(&[100, 101], None, 0..8, Medium::Gpu));
        f.apply_ok(id, &stored(&[102], Some(101), 8..12, Medium::Gpu));
        let tokens: Vec<u32> = (0..14).collect();
        let request = token_block_hashes(model_seed("m"), &tokens, 4);
        assert_eq!(depth(&f.gpu, &request), 3);
        f.apply_ok(
            id,
            &KvEvent::BlockRemoved {
                block_hashes: vec![101],
                medium: Medium::Gpu,
            },
        );
        assert_eq!(depth(&f.gpu, &request), 1);
        f.apply_ok(id, &KvEvent::AllBlocksCleared);
        assert_eq!(depth(&f.gpu, &request), 0);
        assert_eq!(f.t.tracked(id), 0);
    }

    #[test]
    fn removed_blocks_are_named_by_our_hashes_before_the_event_applies() {
        let mut f = fresh();
        let id = EndpointId(0);
        f.apply_ok(id, &stored(&[7, 8], None, 0..8, Medium::Gpu));
        let ours = token_block_hashes(model_seed("m"), &(0..8).collect::<Vec<u32>>(), 4);
        let gone = |medium| KvEvent::BlockRemoved {
            block_hashes: vec![8, 99],
            medium,
        };
        assert_eq!(f.t.removed_from_gpu(id, &gone(Medium::Gpu)), vec![ours[1]]);
        assert!(f.t.removed_from_gpu(id, &gone(Medium::Cpu)).is_empty());
        assert!(
            f.t.removed_from_gpu(EndpointId(3), &gone(Medium::Gpu))
                .is_empty()
        );
        assert!(
            f.t.removed_from_gpu(id, &KvEvent::AllBlocksCleared)
                .is_empty()
        );
    }

    #[test]
    fn a_block_in_gpu_and_cpu_leaves_each_index_with_its_own_removal() {
        let mut f = fresh();
        let id = EndpointId(0);
        let request = token_block_hashes(model_seed("m"), &[0, 1, 2, 3], 4);
        // Written through: stored on the GPU, then in the CPU tier, under one engine hash.
        let write_through = |f: &mut Tiers, now_ms| {
            for medium in [Medium::Gpu, Medium::Cpu] {
                f.apply(id, &stored(&[1], None, 0..4, medium), now_ms)
                    .unwrap();
            }
        };
        write_through(&mut f, 0);
        let removed = |medium| KvEvent::BlockRemoved {
            block_hashes: vec![1],
            medium,
        };
        // The CPU tier drops it first: the GPU copy stays known, and its removal still lands.
        f.apply(id, &removed(Medium::Cpu), 1).unwrap();
        assert_eq!((depth(&f.gpu, &request), depth(&f.off, &request)), (1, 0));
        assert_eq!(f.t.removed_from_gpu(id, &removed(Medium::Gpu)).len(), 1);
        f.apply(id, &removed(Medium::Gpu), 2).unwrap();
        assert_eq!((depth(&f.gpu, &request), depth(&f.off, &request)), (0, 0));
        assert_eq!(f.t.tracked(id), 0);
        // The other order: GPU eviction keeps the CPU copy.
        write_through(&mut f, 3);
        f.apply(id, &removed(Medium::Gpu), 4).unwrap();
        assert_eq!((depth(&f.gpu, &request), depth(&f.off, &request)), (0, 1));
        assert!(f.t.removed_from_gpu(id, &removed(Medium::Gpu)).is_empty());
        assert_eq!(f.t.tracked(id), 1);
    }

    #[test]
    fn offload_tier_goes_to_its_own_index() {
        let mut f = fresh();
        f.apply_ok(EndpointId(0), &stored(&[1], None, 0..4, Medium::Cpu));
        let request = token_block_hashes(model_seed("m"), &[0, 1, 2, 3], 4);
        assert_eq!(depth(&f.gpu, &request), 0);
        assert_eq!(depth(&f.off, &request), 1);
    }

    #[test]
    fn missed_parent_and_bad_counts_are_errors() {
        let mut f = fresh();
        let e = f.apply(EndpointId(0), &stored(&[5], Some(4), 0..4, Medium::Gpu), 0);
        assert_eq!(e, Err(ApplyError::UnknownParent(4)));
        let e = f.apply(EndpointId(0), &stored(&[5], None, 0..3, Medium::Gpu), 0);
        assert!(matches!(e, Err(ApplyError::TokenCountMismatch { .. })));
        assert_eq!(f.gpu.distinct_blocks(), 0);
    }

    #[test]
    fn lora_blocks_use_the_adapter_seed() {
        let mut f = fresh();
        let mut e = stored(&[1], None, 0..4, Medium::Gpu);
        if let KvEvent::BlockStored { lora_name, .. } = &mut e {
            *lora_name = Some("sql".into());
        }
        f.apply_ok(EndpointId(0), &e);
        assert_eq!(
            depth(
                &f.gpu,
                &token_block_hashes(model_seed("m"), &[0, 1, 2, 3], 4)
            ),
            0
        );
        assert_eq!(
            depth(
                &f.gpu,
                &token_block_hashes(model_seed("sql"), &[0, 1, 2, 3], 4)
            ),
            1
        );
    }

    #[test]
    fn a_salted_run_is_seeded_with_its_salt_and_children_inherit_it() {
        let mut f = fresh();
        let salted = |mut e: KvEvent, salt: &str| {
            if let KvEvent::BlockStored { cache_salt, .. } = &mut e {
                *cache_salt = Some(salt.into());
            }
            e
        };
        let id = EndpointId(0);
        f.apply_ok(id, &salted(stored(&[1], None, 0..4, Medium::Gpu), "a"));
        // The child run names a (different) salt: it is ignored, the parent's chain holds.
        f.apply_ok(id, &salted(stored(&[2], Some(1), 4..8, Medium::Gpu), "zz"));
        let tokens: Vec<u32> = (0..8).collect();
        let request = |salt| token_block_hashes(request_seed("m", salt), &tokens, 4);
        assert_eq!(depth(&f.gpu, &request(Some("a"))), 2);
        assert_eq!(
            depth(&f.gpu, &request(None)),
            0,
            "unsalted requests do not hit"
        );
        assert_eq!(depth(&f.gpu, &request(Some("b"))), 0, "nor do other salts");

        // A LoRA's salted run: seeded with the adapter name and the salt.
        let mut e = salted(stored(&[3], None, 0..4, Medium::Gpu), "a");
        if let KvEvent::BlockStored { lora_name, .. } = &mut e {
            *lora_name = Some("sql".into());
        }
        f.apply_ok(id, &e);
        let lora = token_block_hashes(request_seed("sql", Some("a")), &[0, 1, 2, 3], 4);
        assert_eq!(depth(&f.gpu, &lora), 1);
    }
}
