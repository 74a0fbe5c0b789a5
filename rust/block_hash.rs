//! Chained prefix hashes of full KV blocks (stub; real implementation follows).

/// The chained 128-bit hash of a full block and all blocks before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Seeded, salt-aware hasher of token blocks.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    seed: u64,
}

impl BlockHasher {
    pub fn new(seed: u64) -> Self {
        BlockHasher { seed }
    }

    /// Extends `hashes` (the chained hashes of the full blocks of `tokens` so far) with the hashes
    /// of every newly full block of `tokens`. `salt` (cache_salt) is mixed into the first block.
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
        let mut parent: u128 = match salt {
            Some(s) => s
                .bytes()
                .fold(self.seed as u128 ^ 1, |h, b| h.wrapping_mul(31) ^ b as u128),
            None => self.seed as u128,
        };
        if let Some(last) = hashes.last() {
            parent = last.0;
        }
        for i in hashes.len()..tokens.len() / block_size {
            for &t in &tokens[i * block_size..(i + 1) * block_size] {
                parent = parent
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    .wrapping_add(t as u128 + 1);
            }
            hashes.push(BlockHash(parent));
        }
    }
}
