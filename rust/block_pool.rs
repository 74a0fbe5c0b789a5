//! The KV block pool: a fixed number of blocks, block 0 the null block, reference counts, an
//! intrusive doubly linked free list with O(1) removal, the prefix-cache map `BlockHash -> BlockId`
//! and the tree of cached blocks (`prefix_tree.rs`).
//!
//! Free blocks sit on two lists, and a new block comes from the front of the first non-empty one:
//! - *cheap*: blocks without a hash at the front; with usefulness tracking on, cached blocks that
//!   no hit can use any more (no checkpoint at or below them in the tree) behind them, least
//!   recently freed first. So plain blocks are used first, then the useless cached ones, which
//!   still tell a later prompt that its prefix was shared (where a branch checkpoint belongs);
//! - *valuable*: cached blocks a hit can use (every cached block without tracking), least recently
//!   used first.
//!
//! A free block moves between the lists when a checkpoint below it appears or goes. Taking a cached
//! free block for a new request evicts its hash (counted in `evictions`, and in
//! `useless_evictions` when it was useless) together with every cached block below it, whose prefix
//! can then never be matched.
//!
//! Tail blocks: the partly filled last block of a finished sequence can be registered under the
//! hash of its exact tokens (a chained hash of fewer than B tokens, which never equals a full
//! block's). It is a leaf of the tree; `has_tails(parent)` tells a lookup whether any tail hangs
//! below a prefix, so that tails are only hashed where they can exist.

use std::collections::HashMap;

use crate::block_hash::{BlockHash, PassThroughBuild};
use crate::mamba_pool::SlotId;
use crate::prefix_tree::{PrefixTree, ROOT};

/// KV block id; 0 = null block, never handed out.
pub type BlockId = u32;

/// The null block.
pub const NULL_BLOCK: BlockId = 0;

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    /// Free list links over `n + 1` nodes: node 0 (the null block, never free) is the sentinel of
    /// the cheap list, node `n` the sentinel of the valuable list.
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Per block: NOT_FREE, CHEAP or VALUABLE.
    list: Vec<u8>,
    num_free: usize,
    num_cached_free: usize,
    cached: HashMap<BlockHash, BlockId, PassThroughBuild>,
    tree: PrefixTree,
    track_usefulness: bool,
    /// Tail block -> the hash of the block before it (or of the chain root).
    tail_parent: HashMap<BlockId, BlockHash, PassThroughBuild>,
    /// Prefix hash -> number of cached tails right below it.
    tails_below: HashMap<BlockHash, u32, PassThroughBuild>,
    evictions: u64,
    useless_evictions: u64,
    /// Blocks on the valuable list.
    num_valuable: usize,
    scratch: Vec<u32>,
    /// With `record_changes`: hashes cached, evicted, or whose usefulness flipped since the last
    /// `take_changes` (for KV cache events), and whether the pool was reset.
    record_changes: bool,
    changed: Vec<BlockHash>,
    was_reset: bool,
}

const NOT_FREE: u8 = 0;
const CHEAP: u8 = 1;
const VALUABLE: u8 = 2;

impl BlockPool {
    /// A pool of `num_blocks` blocks including the null block (so `num_blocks - 1` usable).
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks.clamp(1, u32::MAX as usize - 1);
        let mut p = BlockPool {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev: vec![0; n + 1],
            next: vec![0; n + 1],
            list: vec![NOT_FREE; n],
            num_free: 0,
            num_cached_free: 0,
            cached: HashMap::with_capacity_and_hasher(n, PassThroughBuild::default()),
            tree: PrefixTree::new(n),
            track_usefulness: false,
            tail_parent: HashMap::with_hasher(PassThroughBuild::default()),
            tails_below: HashMap::with_hasher(PassThroughBuild::default()),
            evictions: 0,
            useless_evictions: 0,
            num_valuable: 0,
            scratch: Vec::new(),
            record_changes: false,
            changed: Vec::new(),
            was_reset: false,
        };
        p.prev[n] = n as u32;
        p.next[n] = n as u32;
        for b in 1..n as u32 {
            p.link_back(b, CHEAP);
        }
        p
    }

    /// With `on`, a cached block is only worth keeping while a checkpoint sits at or below it
    /// (hybrid models in a caching mode); otherwise every cached block is (KV-only hits).
    pub fn set_track_usefulness(&mut self, on: bool) {
        self.track_usefulness = on;
    }

    /// With `on`, the pool records the hashes whose cache state changes (`take_changes`).
    pub fn set_record_changes(&mut self, on: bool) {
        self.record_changes = on;
        self.changed.clear();
        self.was_reset = false;
    }

    /// The hashes cached, evicted or whose usefulness flipped since the last call, and whether the
    /// pool was reset in between (recorded only with `set_record_changes(true)`).
    pub fn take_changes(&mut self) -> (Vec<BlockHash>, bool) {
        (
            std::mem::take(&mut self.changed),
            std::mem::take(&mut self.was_reset),
        )
    }

    /// Records the hashes of the cached blocks among `blocks` as changed.
    fn record(&mut self, blocks: &[u32]) {
        if self.record_changes {
            let hashes = blocks.iter().filter_map(|&x| self.hash[x as usize]);
            self.changed.extend(hashes);
        }
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

    /// Free cached blocks that a hit can still use (every free cached block without usefulness
    /// tracking). The other free blocks can be handed out without losing anything.
    pub fn num_useful_free(&self) -> usize {
        self.num_valuable
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

    /// Of `evictions`, those of blocks no hit could use any more.
    pub fn useless_evictions(&self) -> u64 {
        self.useless_evictions
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_cnt.get(b as usize).copied().unwrap_or(0)
    }

    pub fn block_hash(&self, b: BlockId) -> Option<BlockHash> {
        self.hash.get(b as usize).copied().flatten()
    }

    pub fn is_free(&self, b: BlockId) -> bool {
        self.list.get(b as usize).is_some_and(|&l| l != NOT_FREE)
    }

    /// Whether `b` is a cached tail block.
    pub fn is_tail(&self, b: BlockId) -> bool {
        self.tail_parent.contains_key(&b)
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

    /// Whether any cached tail hangs right below the prefix whose hash is `parent`.
    #[inline]
    pub fn has_tails(&self, parent: BlockHash) -> bool {
        !self.tails_below.is_empty() && self.tails_below.contains_key(&parent)
    }

    /// The tree of cached blocks.
    pub fn tree(&self) -> &PrefixTree {
        &self.tree
    }

    /// Whether a hit can still use the cached block `b` (see `set_track_usefulness`).
    #[inline]
    fn useful(&self, b: u32) -> bool {
        !self.track_usefulness || self.tree.below(b) > 0
    }

    fn sentinel(&self, which: u8) -> u32 {
        if which == VALUABLE {
            self.ref_cnt.len() as u32
        } else {
            0
        }
    }

    #[inline]
    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        if std::mem::replace(&mut self.list[b as usize], NOT_FREE) == VALUABLE {
            self.num_valuable -= 1;
        }
        self.num_free -= 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free -= 1;
        }
    }

    #[inline]
    fn link_back(&mut self, b: u32, which: u8) {
        let head = self.sentinel(which);
        let last = self.prev[head as usize];
        self.prev[b as usize] = last;
        self.next[b as usize] = head;
        self.next[last as usize] = b;
        self.prev[head as usize] = b;
        self.on_linked(b, which);
    }

    #[inline]
    fn link_front(&mut self, b: u32, which: u8) {
        let head = self.sentinel(which);
        let first = self.next[head as usize];
        self.next[b as usize] = first;
        self.prev[b as usize] = head;
        self.prev[first as usize] = b;
        self.next[head as usize] = b;
        self.on_linked(b, which);
    }

    #[inline]
    fn on_linked(&mut self, b: u32, which: u8) {
        self.list[b as usize] = which;
        if which == VALUABLE {
            self.num_valuable += 1;
        }
        self.num_free += 1;
        if self.hash[b as usize].is_some() {
            self.num_cached_free += 1;
        }
    }

    /// Puts a block that just became free (or changed worth while free) where it belongs: a plain
    /// block at the front of the cheap list, a useless cached one at its back, a useful one at the
    /// back of the valuable list.
    #[inline]
    fn place(&mut self, b: u32) {
        if self.hash[b as usize].is_none() {
            self.link_front(b, CHEAP);
        } else if self.useful(b) {
            self.link_back(b, VALUABLE);
        } else {
            self.link_back(b, CHEAP);
        }
    }

    /// Moves a free block to the most-recently-used end of its list (used on a cache query).
    pub fn touch_free(&mut self, b: BlockId) {
        if self.is_free(b) {
            self.unlink(b);
            self.place(b);
        }
    }

    /// Drops the cache entry of `b` and of every cached block below it (they can never be matched
    /// once `b` is gone). `on_evict` gets each dropped hash; dropped blocks that are free become
    /// plain free blocks at the front.
    fn evict_subtree(&mut self, b: u32, on_evict: &mut impl FnMut(BlockHash)) {
        let mut order = std::mem::take(&mut self.scratch);
        order.clear();
        if self.tree.is_linked(b) {
            self.tree.subtree_post_order(b, &mut order);
        }
        // Whether the subtree could still serve a hit, read before its checkpoints detach.
        let useless = self.track_usefulness && self.tree.is_linked(b) && self.tree.below(b) == 0;
        let mut gone = Vec::new();
        for &x in &order {
            // Children first: x is a leaf now. Its checkpoint (if any) can no longer be hit.
            self.tree.detach(x, &mut gone);
            self.tree.unlink_leaf(x);
            if let Some(ph) = self.tail_parent.remove(&x) {
                if let Some(n) = self.tails_below.get_mut(&ph) {
                    *n -= 1;
                    if *n == 0 {
                        self.tails_below.remove(&ph);
                    }
                }
            }
            let was_free = self.is_free(x);
            if was_free {
                self.unlink(x);
            }
            if let Some(h) = self.hash[x as usize].take() {
                self.cached.remove(&h);
                if self.record_changes {
                    self.changed.push(h);
                }
                self.evictions += 1;
                if useless {
                    self.useless_evictions += 1;
                }
                on_evict(h);
            }
            if was_free {
                self.place(x);
            }
        }
        // Blocks above that became useless: dropped ones are gone already; the rest move to the
        // front if free.
        self.record(&gone);
        self.move_useless_to_front(&gone);
        order.clear();
        self.scratch = order;
    }

    /// `blocks` run from a leaf towards the root (as the tree's walks list them) and no hit can use
    /// them any more: the free ones move to the cheap list, the leaf first, so that it is evicted
    /// before the blocks above it.
    fn move_useless_to_front(&mut self, blocks: &[u32]) {
        if !self.track_usefulness {
            return;
        }
        for &x in blocks {
            if self.is_free(x) && self.hash[x as usize].is_some() {
                self.unlink(x);
                self.place(x);
            }
        }
    }

    /// Appends `n` fresh blocks (ref 1) to `out`, evicting cached free blocks from the front of
    /// the free list as needed; `on_evict` is called with every evicted hash. Returns false
    /// (taking nothing) when fewer than `n` blocks are free.
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
            let mut b = self.next_to_hand_out();
            while self.hash[b as usize].is_some() {
                // Drops b's hash (and its subtree's, which become plain blocks at the front).
                self.evict_subtree(b, &mut on_evict);
                b = self.next_to_hand_out();
            }
            self.unlink(b);
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        true
    }

    /// The front of the cheap list, else of the valuable list (some block is free).
    fn next_to_hand_out(&self) -> u32 {
        let cheap = self.next[0];
        if cheap != 0 {
            cheap
        } else {
            self.next[self.ref_cnt.len()]
        }
    }

    /// Takes one more reference on a (cached) block, removing it from the free list if needed.
    /// The null block and out-of-range ids are ignored (returns false).
    pub fn incref(&mut self, b: BlockId) -> bool {
        if b == NULL_BLOCK || b as usize >= self.ref_cnt.len() {
            return false;
        }
        if self.is_free(b) {
            self.unlink(b);
        }
        self.ref_cnt[b as usize] += 1;
        true
    }

    /// Drops one reference of each block (a request's table, head first). Blocks reaching ref 0
    /// go to the free lists (`place`), the last block first, so that a request's tail is evicted
    /// before its head (evicting a block drops every cached block below it). Null/unknown ids and
    /// blocks at ref 0 are ignored.
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
                self.place(b);
            }
        }
    }

    /// Registers the used block `b` under `h`, as the child of the cached block `parent` (None:
    /// the first block of a chain). False (nothing changed) if the block already has a hash, is
    /// free, `h` already maps to another block (a duplicate computed concurrently: the existing
    /// entry is kept and this block stays uncached), or `parent` is not cached (its chain was
    /// evicted while this request held the block: nothing could match it).
    pub fn cache_block(&mut self, b: BlockId, h: BlockHash, parent: Option<BlockHash>) -> bool {
        let i = b as usize;
        if b == NULL_BLOCK || i >= self.ref_cnt.len() || self.ref_cnt[i] == 0 {
            return false;
        }
        if self.hash[i].is_some() || self.cached.contains_key(&h) {
            return false;
        }
        let p = match parent {
            None => ROOT,
            Some(ph) => match self.cached.get(&ph) {
                Some(&p) if !self.tail_parent.contains_key(&p) => p,
                _ => return false,
            },
        };
        self.hash[i] = Some(h);
        self.cached.insert(h, b);
        self.tree.link(b, p);
        if self.record_changes {
            self.changed.push(h);
        }
        true
    }

    /// Registers the used block `b` as the tail entry `h` below the prefix `parent` (its hash, or
    /// the chain root's for a tail in the first block). Same refusals as `cache_block`.
    pub fn cache_tail(
        &mut self,
        b: BlockId,
        h: BlockHash,
        parent: BlockHash,
        is_root: bool,
    ) -> bool {
        let cached = self.cache_block(b, h, (!is_root).then_some(parent));
        if cached {
            self.tail_parent.insert(b, parent);
            *self.tails_below.entry(parent).or_insert(0) += 1;
        }
        cached
    }

    /// Attaches checkpoint `slot` to the cached block `b` (no-op if `b` is not cached or already
    /// has one). Returns whether it was attached.
    pub fn attach_checkpoint(&mut self, b: BlockId, slot: SlotId) -> bool {
        if !self.tree.is_linked(b) || self.tree.checkpoint(b) != 0 || slot == 0 {
            return false;
        }
        let mut useful = std::mem::take(&mut self.scratch);
        useful.clear();
        self.tree.attach(b, slot, &mut useful);
        self.record(&useful);
        if self.track_usefulness {
            // Blocks that can serve hits again: a free one rejoins the valuable list as just used.
            for &x in &useful {
                if self.is_free(x) {
                    self.unlink(x);
                    self.place(x);
                }
            }
        }
        useful.clear();
        self.scratch = useful;
        true
    }

    /// Detaches the checkpoint of `b` (returns it, 0 if none); blocks that no hit can use any more
    /// move to the front of the free list.
    pub fn detach_checkpoint(&mut self, b: BlockId) -> SlotId {
        if !self.tree.is_linked(b) {
            return 0;
        }
        let mut useless = std::mem::take(&mut self.scratch);
        useless.clear();
        let slot = self.tree.detach(b, &mut useless);
        self.record(&useless);
        self.move_useless_to_front(&useless);
        useless.clear();
        self.scratch = useless;
        slot
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
        if self.record_changes {
            self.changed.clear();
            self.was_reset = true;
        }
        self.tree.clear();
        // Every block is plain now: one cheap list, in its current order.
        let order = self.free_list();
        for &b in &order {
            self.unlink(b);
        }
        for b in order {
            self.link_back(b, CHEAP);
        }
        self.tail_parent.clear();
        self.tails_below.clear();
        self.num_cached_free = 0;
        true
    }

    /// Free blocks in the order they are handed out: the cheap list, then the valuable list from
    /// LRU to MRU (tests and debugging).
    pub fn free_list(&self) -> Vec<BlockId> {
        let mut v = Vec::with_capacity(self.num_free);
        for head in [0, self.ref_cnt.len() as u32] {
            let mut b = self.next[head as usize];
            while b != head {
                v.push(b);
                b = self.next[b as usize];
            }
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
            assert!(p.cache_block(b, h(i as u128 + 1), None));
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
        assert!(p.cache_block(a[0], h(9), None));
        assert!(!p.cache_block(a[0], h(10), None), "already hashed");
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
