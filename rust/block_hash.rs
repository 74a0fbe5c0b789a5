//! Chained prefix hashes of full KV blocks.
//!
//! The hash of block `i` covers the hash of block `i - 1` (its parent), the `B` token ids of block
//! `i`, and, for block 0, the request's cache salt. Equal hashes therefore mean "same salt and
//! same first `(i + 1) * B` tokens", which is what both the KV pool and the Mamba checkpoints are
//! keyed by.
//!
//! # Construction
//! Two independent 64-bit lanes, each a wyhash-style chain of folded 64×64→128-bit multiplies over
//! 16-byte words (four token ids), with its own secrets derived from the seed by splitmix64. The
//! parent hash enters both lanes before the tokens; the token count and a final avalanche close
//! each lane. No crate is needed and a 16-token block costs about 10 multiplies.
//!
//! # Why hits are not confirmed against the tokens
//! The lookup API takes hashes only, so a hit is trusted on its 128-bit hash. For hash outputs
//! that behave like random values, the probability that *any* two of `n` distinct prefixes ever
//! hashed collide is about `n² / 2¹²⁹`: for `n = 10¹²` blocks (years of traffic of a busy server)
//! that is below `10⁻¹⁴`, far below the rate of hardware memory errors. The construction is not
//! cryptographic; resistance against a tenant who crafts colliding prompts rests on the seed being
//! secret (`hash_seed`: the engine draws it from the OS at every start unless one is given) and on
//! the per-tenant `cache_salt`, which puts tenants on disjoint hash chains.

/// The chained 128-bit hash of a full block and all blocks before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Seeded, salt-aware hasher of token blocks.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    /// Per-lane secrets: lane a uses `ka`, lane b uses `kb`.
    ka: [u64; 4],
    kb: [u64; 4],
    /// Parent of block 0 when no salt is given.
    root: u128,
}

#[inline]
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64×64 → 128-bit multiply, folded to 64 bits (the wyhash / xxh3 mixing step).
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Makes a secret odd with a balanced bit pattern (never 0, which would kill a multiply).
#[inline]
fn secret(state: &mut u64) -> u64 {
    splitmix64(state) | 0x0101_0101_0101_0101
}

impl BlockHasher {
    /// A hasher whose every hash depends on `seed`.
    pub fn new(seed: u64) -> Self {
        let mut s = seed ^ 0x6A09_E667_F3BC_C908;
        let ka = [
            secret(&mut s),
            secret(&mut s),
            secret(&mut s),
            secret(&mut s),
        ];
        let kb = [
            secret(&mut s),
            secret(&mut s),
            secret(&mut s),
            secret(&mut s),
        ];
        let mut h = BlockHasher { ka, kb, root: 0 };
        h.root = h.hash_bytes(0x5EED_0000_0000_0001, &seed.to_le_bytes());
        h
    }

    /// One lane over `words` (16-byte groups) with parent mixed in.
    #[inline(always)]
    fn lane(k: &[u64; 4], parent: u128, tokens: &[u32]) -> u64 {
        let p0 = parent as u64;
        let p1 = (parent >> 64) as u64;
        let mut acc = fold_mul(p0 ^ k[0], p1 ^ k[1]);
        let mut chunks = tokens.chunks_exact(4);
        for c in &mut chunks {
            let w0 = c[0] as u64 | ((c[1] as u64) << 32);
            let w1 = c[2] as u64 | ((c[3] as u64) << 32);
            acc = fold_mul(w0 ^ k[2], w1 ^ acc);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u64; 2];
            for (i, &t) in rest.iter().enumerate() {
                w[i / 2] |= (t as u64) << (32 * (i % 2));
            }
            acc = fold_mul(w[0] ^ k[2], w[1] ^ acc);
        }
        let len = tokens.len() as u64;
        let x = fold_mul(acc ^ k[3], len ^ k[1]);
        // Final avalanche (splitmix64 finaliser).
        let x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    /// The chained hash of one block of `tokens` under `parent`.
    #[inline]
    pub fn hash_block(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        let a = Self::lane(&self.ka, parent.0, tokens);
        let b = Self::lane(&self.kb, parent.0, tokens);
        BlockHash(((b as u128) << 64) | a as u128)
    }

    /// Hash of arbitrary bytes under a domain tag (used for the salt root).
    fn hash_bytes(&self, domain: u128, bytes: &[u8]) -> u128 {
        // Pack bytes into u32 "tokens" with the length mixed in by `lane`.
        let mut words: Vec<u32> = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect();
        words.push(bytes.len() as u32);
        let a = Self::lane(&self.ka, domain, &words);
        let b = Self::lane(&self.kb, domain ^ (1 << 127), &words);
        ((b as u128) << 64) | a as u128
    }

    /// The parent hash of block 0 for a request with this salt.
    pub fn root(&self, salt: Option<&str>) -> BlockHash {
        match salt {
            None => BlockHash(self.root),
            Some(s) => BlockHash(self.hash_bytes(self.root ^ 0x5A17, s.as_bytes())),
        }
    }

    /// Extends `hashes` (the chained hashes of the full blocks of `tokens` so far) with the hashes
    /// of every newly full block of `tokens`. `salt` (cache_salt) is mixed into the first block.
    /// `block_size == 0` does nothing.
    pub fn extend(
        &self,
        hashes: &mut Vec<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        salt: Option<&str>,
    ) {
        if block_size == 0 {
            return;
        }
        let full = tokens.len() / block_size;
        if hashes.len() >= full {
            return;
        }
        let mut parent = match hashes.last() {
            Some(h) => *h,
            None => self.root(salt),
        };
        hashes.reserve(full - hashes.len());
        for i in hashes.len()..full {
            parent = self.hash_block(parent, &tokens[i * block_size..(i + 1) * block_size]);
            hashes.push(parent);
        }
    }
}

impl Default for BlockHasher {
    fn default() -> Self {
        BlockHasher::new(0)
    }
}

/// A `Hasher` for maps keyed by `BlockHash` (already uniformly distributed) or small integers:
/// keys are folded, not rehashed.
#[derive(Clone, Copy, Default, Debug)]
pub struct PassThroughHasher(u64);

impl std::hash::Hasher for PassThroughHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    #[inline]
    fn write_u128(&mut self, n: u128) {
        self.0 ^= (n as u64) ^ ((n >> 64) as u64);
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        // Integer keys (request ids) are not random: one multiply spreads them.
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
}

/// `BuildHasher` for `PassThroughHasher`.
pub type PassThroughBuild = std::hash::BuildHasherDefault<PassThroughHasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn chained_and_incremental() {
        let h = BlockHasher::new(7);
        let toks: Vec<u32> = (0..37).collect();
        let mut all = Vec::new();
        h.extend(&mut all, &toks, 4, None);
        assert_eq!(all.len(), 9);
        let mut inc = Vec::new();
        for n in 0..=toks.len() {
            h.extend(&mut inc, &toks[..n], 4, None);
        }
        assert_eq!(all, inc);
        // Changing one token of block 1 changes the hashes of blocks 1.. but not block 0.
        let mut t2 = toks.clone();
        t2[5] = 999;
        let mut other = Vec::new();
        h.extend(&mut other, &t2, 4, None);
        assert_eq!(other[0], all[0]);
        for i in 1..all.len() {
            assert_ne!(other[i], all[i]);
        }
    }

    #[test]
    fn salt_and_seed_isolate() {
        let toks: Vec<u32> = (100..116).collect();
        let h = BlockHasher::new(1);
        let mut a = Vec::new();
        let mut b = Vec::new();
        let mut c = Vec::new();
        let mut d = Vec::new();
        h.extend(&mut a, &toks, 4, None);
        h.extend(&mut b, &toks, 4, Some("tenant-a"));
        h.extend(&mut c, &toks, 4, Some("tenant-b"));
        BlockHasher::new(2).extend(&mut d, &toks, 4, None);
        for i in 0..4 {
            let s: HashSet<_> = [a[i], b[i], c[i], d[i]].into_iter().collect();
            assert_eq!(s.len(), 4);
        }
    }

    #[test]
    fn single_bit_flips_avalanche() {
        // Flipping one bit of one token (or of the parent) flips about half of the 128 output
        // bits, in both lanes.
        let h = BlockHasher::new(11);
        let base: Vec<u32> = (0..16).map(|i| i * 7919 + 3).collect();
        let root = h.root(None);
        let h0 = h.hash_block(root, &base).0;
        let (mut total, mut n) = (0u32, 0u32);
        let (mut lo_min, mut hi_min) = (64u32, 64u32);
        for t in 0..16 {
            for bit in 0..32 {
                let mut v = base.clone();
                v[t] ^= 1 << bit;
                let d = h.hash_block(root, &v).0 ^ h0;
                lo_min = lo_min.min((d as u64).count_ones());
                hi_min = hi_min.min(((d >> 64) as u64).count_ones());
                total += d.count_ones();
                n += 1;
            }
        }
        for bit in 0..128 {
            let d = h.hash_block(BlockHash(root.0 ^ (1 << bit)), &base).0 ^ h0;
            total += d.count_ones();
            n += 1;
        }
        let mean = total as f64 / n as f64;
        assert!((60.0..68.0).contains(&mean), "mean flipped bits {mean}");
        assert!(lo_min >= 12 && hi_min >= 12, "weak lane: {lo_min} {hi_min}");
    }

    #[test]
    fn no_collisions_on_many_similar_blocks() {
        let h = BlockHasher::new(0);
        let mut seen = HashSet::new();
        let root = h.root(None);
        for a in 0..200u32 {
            for b in 0..200u32 {
                let blk = [a, b, 0, 0, 0, 0, 0];
                assert!(seen.insert(h.hash_block(root, &blk)));
            }
        }
        // Token order matters, zero tokens are not ignored.
        assert_ne!(h.hash_block(root, &[1, 2]), h.hash_block(root, &[2, 1]));
        assert_ne!(h.hash_block(root, &[0]), h.hash_block(root, &[0, 0]));
    }
}
