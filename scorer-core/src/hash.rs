//! Chained block hashing of canonical prompt bytes.
//!
//! Block `i`'s hash covers bytes `0..(i+1)*block_bytes`: it is xxh3-64 of the block seeded with
//! block `i-1`'s hash, and block 0 is seeded with the model seed. Equal hashes therefore mean
//! equal prefixes (up to collisions), which is what a prefix cache reuses. Only full blocks are
//! hashed, as vLLM only caches full blocks.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Default block size in canonical bytes: about 64 tokens of English text.
pub const DEFAULT_BLOCK_BYTES: usize = 256;

/// Seed for a model's hash chain: the model name (which names the LoRA adapter in vLLM), so two
/// models never share cached blocks.
pub fn model_seed(model: &str) -> u64 {
    xxh3_64(model.as_bytes())
}

/// Domain tag mixed into a salted seed, so a salt's bytes never collide with a model name's.
const SALT_TAG: &[u8] = b"kvroute.cache_salt\x1f";

/// Seed for one request's hash chain: the model (or LoRA) name and the request's vLLM
/// `cache_salt`. vLLM adds the salt to block 0's extra keys only, and since hashes chain, a
/// salted prompt shares no cached block with the same prompt unsalted or under another salt;
/// seeding our chain with it reproduces exactly that. `None` is [`model_seed`], so unsalted
/// hashes stay what they were.
pub fn request_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let base = model_seed(model);
    match cache_salt {
        None => base,
        Some(salt) => {
            let mut buf = Vec::with_capacity(SALT_TAG.len() + salt.len());
            buf.extend_from_slice(SALT_TAG);
            buf.extend_from_slice(salt.as_bytes());
            xxh3_64_with_seed(&buf, base)
        }
    }
}

/// Chained hashes of every full `block_bytes`-sized block of `bytes`.
///
/// `block_bytes == 0` yields no hashes rather than a panic.
pub fn block_hashes(seed: u64, bytes: &[u8], block_bytes: usize) -> Vec<u64> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut parent = seed;
    bytes
        .chunks_exact(block_bytes)
        .map(|block| {
            parent = xxh3_64_with_seed(block, parent);
            parent
        })
        .collect()
}

/// Chained hashes over token ids, `block_tokens` tokens a block (precise mode and the simulator).
pub fn token_block_hashes(seed: u64, tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut parent = seed;
    let mut buf = Vec::with_capacity(block_tokens * 4);
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            buf.clear();
            for t in block {
                buf.extend_from_slice(&t.to_le_bytes());
            }
            parent = xxh3_64_with_seed(&buf, parent);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_shares_leading_hashes() {
        let a = vec![7u8; 1000];
        let mut b = a.clone();
        b[700] = 1;
        let ha = block_hashes(1, &a, 256);
        let hb = block_hashes(1, &b, 256);
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
    }

    #[test]
    fn chain_depends_on_position_and_seed() {
        let a = vec![7u8; 512];
        let h = block_hashes(1, &a, 256);
        assert_ne!(h[0], h[1], "same bytes at another depth hash differently");
        assert_ne!(block_hashes(2, &a, 256), h);
        assert_ne!(model_seed("a"), model_seed("b"));
    }

    #[test]
    fn salt_changes_the_seed_and_none_keeps_the_model_seed() {
        assert_eq!(request_seed("m", None), model_seed("m"));
        let a = request_seed("m", Some("tenant-a"));
        let b = request_seed("m", Some("tenant-b"));
        assert_ne!(a, model_seed("m"));
        assert_ne!(a, b);
        assert_ne!(
            a,
            request_seed("n", Some("tenant-a")),
            "the model still counts"
        );
        assert_ne!(request_seed("ab", Some("c")), request_seed("a", Some("bc")));
        // An empty salt (which vLLM refuses) would still differ from no salt.
        assert_ne!(request_seed("m", Some("")), model_seed("m"));
        let tokens: Vec<u32> = (0..64).collect();
        let salted = token_block_hashes(a, &tokens, 16);
        let plain = token_block_hashes(model_seed("m"), &tokens, 16);
        assert!(
            salted.iter().all(|h| !plain.contains(h)),
            "no block is shared"
        );
    }

    #[test]
    fn partial_blocks_and_zero_size() {
        assert!(block_hashes(0, &[1; 255], 256).is_empty());
        assert!(block_hashes(0, &[1; 255], 0).is_empty());
        assert_eq!(token_block_hashes(0, &[1; 33], 16).len(), 2);
    }
}
