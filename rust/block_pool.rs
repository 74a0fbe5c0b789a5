//! The KV block pool: a fixed number of blocks, block 0 the null block, reference counts, an
//! intrusive doubly linked LRU free list with O(1) removal, and the prefix-cache map
//! `BlockHash -> BlockId`.
//!
//! Free list order: the front is the next block handed out. A freed block that carries a hash
//! (a prefix-cache entry) goes to the back (most recently used); a freed block without a hash goes
//! to the front, so that plain free blocks are used before any cached block is evicted. Taking a
//! cached free block for a new request evicts its hash (counted in `evictions`).

use std::collections::HashMap;

use crate::block_hash::{BlockHash, PassThroughBuild};

/// KV block id; 0 = null block, never handed out.
pub type BlockId = u32;

/// The null block.
pub const NULL_BLOCK: BlockId = 0;

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    /// Free list links; node 0 (the null block, never free) is the sentinel.
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    num_free: usize,
    num_cached_free: usize,
    cached: HashMap<BlockHash, BlockId, PassThroughBuild>,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks including the null block (so `num_blocks - 1` usable).
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.clamp(1, u32::MAX as usize);
        let mut p = BlockPool {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev: vec![0; n],
            next: vec![0; n],
            in_free: vec![false; n],
            num_free: 0,
            num_cached_free: 0,
            cached: HashMap::with_capacity_and_hasher(n, PassThroughBuild::default()),
            evictions: 0,
        };
        for b in 1..n as u32 {
            p.push_back(b);
        }
        p
    }

    /// Blocks including the null block.
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks that can be handed out (total minus the null block).
    pub fn num_usable(&self) -> usize {
        self.ref_cnt.len() - 1
    }

    /// Free blocks (ref 0), cached or not.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Free blocks that still carry a prefix-cache hash.
    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }

    /// Blocks referenced by at least one request.
    pub fn num_used(&self) -> usize {
        self.num_usable() - self.num_free
    }

    /// Blocks registered in the prefix cache (free or used).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_cnt.get(b as usize).copied().unwrap_or(0)
    }

    pub fn block_hash(&self, b: BlockId) -> Option<BlockHash> {
        self.hash.get(b as usize).copied().flatten()
    }

    pub fn is_free(&self, b: BlockId) -> bool {
        self.in_free.get(b as usize).copied().unwrap_or(false)
    }

    /// The cached block for `h`, if any.
    #[inline]
    pub fn get_cached(&self, h: BlockHash) -> Option<BlockId> {
        self.cached.get(&h).copied()
    }

    /// Whether `h` is in the prefix cache.
    #[inline]
    pub fn contains(&self, h: BlockHash) -> bool {
        self.cached.contains_key(&h)
    }

    #[inline]
    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.in_free[b as usize] = false;
        self.num_free -= 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free -= 1;
        }
    }

    #[inline]
    fn push_back(&mut self, b: u32) {
        let last = self.prev[0];
        self.prev[b as usize] = last;
        self.next[b as usize] = 0;
        self.next[last as usize] = b;
        self.prev[0] = b;
        self.in_free[b as usize] = true;
        self.num_free += 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free += 1;
        }
    }

    #[inline]
    fn push_front(&mut self, b: u32) {
        let first = self.next[0];
        self.next[b as usize] = first;
        self.prev[b as usize] = 0;
        self.prev[first as usize] = b;
        self.next[0] = b;
        self.in_free[b as usize] = true;
        self.num_free += 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free += 1;
        }
    }

    /// Moves a free block to the most-recently-used end (used on a cache query).
    pub fn touch_free(&mut self, b: BlockId) {
        if self.is_free(b) {
            self.unlink(b);
            self.push_back(b);
        }
    }

    /// Appends `n` fresh blocks (ref 1) to `out`, evicting cached free blocks from the LRU end as
    /// needed; `on_evict` is called with every evicted hash. Returns false (taking nothing) when
    /// fewer than `n` blocks are free.
    pub fn allocate(
        &mut self,
        n: usize,
        out: &mut Vec<BlockId>,
        mut on_evict: impl FnMut(BlockHash),
    ) -> bool {
        if n > self.num_free {
            return false;
        }
        out.reserve(n);
        for _ in 0..n {
            let b = self.next[0];
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                self.cached.remove(&h);
                self.evictions += 1;
                on_evict(h);
            }
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        true
    }

    /// Takes one more reference on a (cached) block, removing it from the free list if needed.
    /// The null block and out-of-range ids are ignored (returns false).
    pub fn incref(&mut self, b: BlockId) -> bool {
        if b == NULL_BLOCK || b as usize >= self.ref_cnt.len() {
            return false;
        }
        if self.in_free[b as usize] {
            self.unlink(b);
        }
        self.ref_cnt[b as usize] += 1;
        true
    }

    /// Drops one reference of each block, the last block first, so that a request's tail blocks
    /// are evicted before its head. Blocks reaching ref 0 go to the free list (cached ones at the
    /// MRU end, uncached ones at the front). Null/unknown ids and blocks at ref 0 are ignored.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            if b == NULL_BLOCK || b as usize >= self.ref_cnt.len() {
                continue;
            }
            let r = &mut self.ref_cnt[b as usize];
            if *r == 0 {
                continue;
            }
            *r -= 1;
            if *r == 0 {
                if self.hash[b as usize].is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }

    /// Registers a used block under `h`. False (nothing changed) if the block already has a hash,
    /// is free, or `h` already maps to another block (a duplicate computed concurrently: the
    /// existing entry is kept and this block stays uncached).
    pub fn cache_block(&mut self, b: BlockId, h: BlockHash) -> bool {
        let i = b as usize;
        if b == NULL_BLOCK || i >= self.ref_cnt.len() || self.ref_cnt[i] == 0 {
            return false;
        }
        if self.hash[i].is_some() || self.cached.contains_key(&h) {
            return false;
        }
        self.hash[i] = Some(h);
        self.cached.insert(h, b);
        true
    }

    /// Drops every prefix-cache entry. Refused (false) while any block is in use.
    pub fn reset(&mut self, mut on_evict: impl FnMut(BlockHash)) -> bool {
        if self.num_used() != 0 {
            return false;
        }
        for (h, b) in self.cached.drain() {
            self.hash[b as usize] = None;
            on_evict(h);
        }
        self.num_cached_free = 0;
        true
    }

    /// Free list from LRU to MRU (tests and debugging).
    pub fn free_list(&self) -> Vec<BlockId> {
        let mut v = Vec::with_capacity(self.num_free);
        let mut b = self.next[0];
        while b != 0 {
            v.push(b);
            b = self.next[b as usize];
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn null_block_never_handed_out_and_exhaustion_is_none() {
        let mut p = BlockPool::new(5);
        let mut out = Vec::new();
        assert!(!p.allocate(5, &mut out, |_| {}));
        assert!(out.is_empty());
        assert!(p.allocate(4, &mut out, |_| {}));
        assert!(!out.contains(&NULL_BLOCK));
        assert_eq!(p.num_free(), 0);
        assert!(!p.allocate(1, &mut out, |_| {}));
        p.release(&out);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.num_used(), 0);
    }

    #[test]
    fn lru_eviction_order_and_uncached_first() {
        let mut p = BlockPool::new(7);
        let mut a = Vec::new();
        assert!(p.allocate(3, &mut a, |_| {}));
        for (i, &b) in a.iter().enumerate() {
            assert!(p.cache_block(b, h(i as u128 + 1)));
        }
        let mut c = Vec::new();
        assert!(p.allocate(2, &mut c, |_| {}));
        p.release(&a); // cached: tail first -> a[2], a[1], a[0] at the MRU end
        p.release(&c); // uncached: to the front
        assert_eq!(p.num_cached_free(), 3);
        let fl = p.free_list();
        assert_eq!(&fl[fl.len() - 3..], &[a[2], a[1], a[0]]);
        // The 1 never-used block and the 2 uncached ones go first: no eviction.
        let mut d = Vec::new();
        let mut ev = Vec::new();
        assert!(p.allocate(3, &mut d, |x| ev.push(x)));
        assert!(ev.is_empty());
        // Next allocation evicts the tail block of `a` (hash 3) first.
        assert!(p.allocate(1, &mut d, |x| ev.push(x)));
        assert_eq!(ev, vec![h(3)]);
        assert_eq!(p.get_cached(h(3)), None);
        assert_eq!(p.get_cached(h(1)), Some(a[0]));
        assert_eq!(p.evictions(), 1);
    }

    #[test]
    fn incref_takes_cached_block_off_free_list() {
        let mut p = BlockPool::new(3);
        let mut a = Vec::new();
        assert!(p.allocate(1, &mut a, |_| {}));
        assert!(p.cache_block(a[0], h(9)));
        assert!(!p.cache_block(a[0], h(10)), "already hashed");
        p.release(&a);
        assert!(p.is_free(a[0]));
        assert!(p.incref(a[0]));
        assert!(!p.is_free(a[0]));
        assert_eq!(p.ref_count(a[0]), 1);
        assert_eq!(p.num_free(), 1);
        assert!(!p.reset(|_| {}), "in use");
        p.release(&a);
        p.release(&a); // extra release is ignored, never negative
        assert_eq!(p.ref_count(a[0]), 0);
        assert!(p.reset(|_| {}));
        assert_eq!(p.get_cached(h(9)), None);
        assert_eq!(p.num_cached_free(), 0);
    }
}
