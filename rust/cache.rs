//! The hybrid cache coordinator (contracts §2): longest usable prefix hit over the KV pool and the
//! Mamba checkpoints, allocation of KV blocks and state windows, checkpoint reservation, freeing.
//!
//! Hit rules (DESIGN.md §4 rule 3): a hit of length L needs
//! - `L <= num_tokens - 1` (the last token is always recomputed to get logits);
//! - cached KV blocks for all of `[0, L)` (so L is a multiple of B);
//! - on a Mamba model in mode `align`/`all`: a *committed* checkpoint at exactly L (so L is a
//!   multiple of M), keyed by the hash of the KV block that ends at L;
//! - on a model without Mamba layers: KV only;
//! - on a Mamba model in mode `none` (or with prefix caching off): no hits, and nothing is cached.
//!
//! Every operation whose behaviour depends on the mode has one `match` on `MambaCacheMode`.
//! `align` and `all` behave alike here: they differ in where the scheduler takes checkpoints from.
//!
//! Copy-on-write: a hit's checkpoint is read-only; `allocate_new` emits a copy into the request's
//! own window and pins the checkpoint until the copy has run (the request's next `allocate_more`,
//! which happens in a later step, or `free`).
//!
//! `checkpoint_bytes` in the stats is `(committed + pending) * state_bytes_per_slot`, with the
//! per-slot size (all Mamba layers, conv + SSM) given by `set_state_bytes_per_slot` (0 until set).
//!
//! Counters: `find_longest_cache_hit` adds `num_tokens` to `queried_tokens`, L to `hit_tokens`,
//! the KV-only hit to `kv_hit_tokens`, and the difference (KV prefix cached, checkpoint missing)
//! to `lost_tokens` on every call.

use std::collections::HashMap;

pub use crate::block_hash::BlockHash;
use crate::block_hash::PassThroughBuild;
use crate::block_pool::BlockPool;
pub use crate::block_pool::{BlockId, NULL_BLOCK};
use crate::config::{MambaCacheMode, ResolvedConfig};
use crate::mamba_pool::{MambaPool, SlotKind};
pub use crate::mamba_pool::{SlotId, NULL_SLOT};

/// The scheduler's numeric id of a request.
pub type ReqKey = u64;

/// A state operation, executed by the runner, in order, before the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateOp {
    Copy { src: SlotId, dst: SlotId },
}

/// The result of `find_longest_cache_hit`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheHit {
    /// L: a multiple of B (and of M when mode != None on a Mamba model).
    pub num_tokens: usize,
    /// The L / B cached blocks.
    pub kv_blocks: Vec<BlockId>,
    /// Committed checkpoint holding the state after exactly L tokens.
    pub checkpoint: Option<SlotId>,
    /// Tokens the KV pool alone could have served (for the "lost" counter).
    pub kv_hit_tokens: usize,
}

/// Usage figures and counters. Block and slot totals exclude the null block / slot.
/// After every request has finished: `kv_blocks_used == 0` and
/// `kv_blocks_free + kv_blocks_cached_free == kv_blocks_total`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_cached_free: usize,
    /// Free blocks without a cache entry.
    pub kv_blocks_free: usize,
    /// Blocks registered in the prefix cache (used or free).
    pub kv_blocks_cached: usize,
    pub mamba_slots_total: usize,
    /// Window + checkpoint slots.
    pub mamba_slots_used: usize,
    pub mamba_slots_window: usize,
    pub checkpoints_committed: usize,
    pub checkpoints_pending: usize,
    pub checkpoint_bytes: u64,
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    pub kv_hit_tokens: u64,
    pub lost_tokens: u64,
    pub kv_evictions: u64,
    pub checkpoint_evictions: u64,
}

#[derive(Clone, Debug, Default)]
struct ReqState {
    blocks: Vec<BlockId>,
    window: Vec<SlotId>,
    /// Leading blocks already registered in (or checked against) the prefix cache.
    num_cached_blocks: usize,
    /// Checkpoint pinned until its hit copy has run.
    pinned: Option<SlotId>,
}

/// The hybrid cache manager (see contracts §2).
#[derive(Debug, Clone)]
pub struct HybridCacheManager {
    mode: MambaCacheMode,
    has_mamba: bool,
    prefix_caching: bool,
    block_size: usize,
    mamba_block_size: usize,
    window_len: usize,
    kv: BlockPool,
    mamba: MambaPool,
    reqs: HashMap<ReqKey, ReqState, PassThroughBuild>,
    state_bytes_per_slot: usize,
    queried_tokens: u64,
    hit_tokens: u64,
    kv_hit_tokens: u64,
    lost_tokens: u64,
}

impl HybridCacheManager {
    /// `num_kv_blocks` and `num_mamba_slots` include the null block / slot. Windows of
    /// `max_num_seqs` requests are reserved in the Mamba pool; checkpoints use the rest.
    pub fn new(cfg: &ResolvedConfig, num_kv_blocks: usize, num_mamba_slots: usize) -> Self {
        let window_len = cfg.state_window_len();
        let window_reserve = if cfg.has_mamba_layers {
            cfg.max_num_seqs.saturating_mul(window_len)
        } else {
            0
        };
        HybridCacheManager {
            mode: cfg.mamba_cache_mode,
            has_mamba: cfg.has_mamba_layers,
            prefix_caching: cfg.enable_prefix_caching,
            block_size: cfg.block_size.max(1),
            mamba_block_size: cfg.mamba_block_size.max(1),
            window_len,
            kv: BlockPool::new(num_kv_blocks),
            mamba: MambaPool::new(num_mamba_slots, window_reserve),
            reqs: HashMap::with_capacity_and_hasher(cfg.max_num_seqs, PassThroughBuild::default()),
            state_bytes_per_slot: 0,
            queried_tokens: 0,
            hit_tokens: 0,
            kv_hit_tokens: 0,
            lost_tokens: 0,
        }
    }

    /// Per-slot state size in bytes (all Mamba layers), for the `checkpoint_bytes` figure.
    pub fn set_state_bytes_per_slot(&mut self, n: usize) {
        self.state_bytes_per_slot = n;
    }

    /// The KV pool (read-only, for tests and metrics).
    pub fn kv_pool(&self) -> &BlockPool {
        &self.kv
    }

    /// The Mamba pool (read-only, for tests and metrics).
    pub fn mamba_pool(&self) -> &MambaPool {
        &self.mamba
    }

    /// Requests currently holding blocks or slots.
    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    pub fn has_request(&self, req: ReqKey) -> bool {
        self.reqs.contains_key(&req)
    }

    /// The cached blocks of the longest prefix of `hashes[..max_blocks]` in the prefix cache
    /// (one map lookup per block).
    fn kv_prefix_blocks(&self, hashes: &[BlockHash], max_blocks: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(max_blocks);
        for h in &hashes[..max_blocks] {
            match self.kv.get_cached(*h) {
                Some(b) => out.push(b),
                None => break,
            }
        }
        out
    }

    /// Longest usable hit for a request whose full-block hashes are `block_hashes` and whose known
    /// tokens number `num_tokens` (prompt, or prompt + output for a resumed request).
    /// L <= num_tokens - 1. Pure query apart from counters and the checkpoint's LRU touch; takes
    /// no references. Call `allocate_new` with it right away (before other allocations).
    pub fn find_longest_cache_hit(
        &mut self,
        block_hashes: &[BlockHash],
        num_tokens: usize,
    ) -> CacheHit {
        let b = self.block_size;
        self.queried_tokens += num_tokens as u64;
        if !self.prefix_caching {
            return CacheHit::default();
        }
        let max_blocks = (num_tokens.saturating_sub(1) / b).min(block_hashes.len());
        let (mut kv_blocks, l, checkpoint) = match (self.mode, self.has_mamba) {
            // No Mamba layers: the mode has no effect, hits are KV only.
            (_, false) => {
                let blocks = self.kv_prefix_blocks(block_hashes, max_blocks);
                let l = blocks.len() * b;
                (blocks, l, None)
            }
            (MambaCacheMode::None, true) => (Vec::new(), 0, None),
            (MambaCacheMode::Align | MambaCacheMode::All, true) => {
                let blocks = self.kv_prefix_blocks(block_hashes, max_blocks);
                let m = self.mamba_block_size;
                let mut found = (0, None);
                let mut p = (blocks.len() * b) / m;
                while p > 0 {
                    let l = p * m;
                    let h = block_hashes[l / b - 1];
                    if let Some(s) = self.mamba.lookup(h) {
                        if self.mamba.tag(s) == Some((h, l)) {
                            found = (l, Some(s));
                            break;
                        }
                    }
                    p -= 1;
                }
                (blocks, found.0, found.1)
            }
        };
        if let Some(s) = checkpoint {
            self.mamba.touch(s);
        }
        let kv_tokens = kv_blocks.len() * b;
        self.hit_tokens += l as u64;
        self.kv_hit_tokens += kv_tokens as u64;
        self.lost_tokens += (kv_tokens - l) as u64;
        kv_blocks.truncate(l / b);
        CacheHit {
            num_tokens: l,
            kv_blocks,
            checkpoint,
            kv_hit_tokens: kv_tokens,
        }
    }

    /// Whether `hit` is still valid: its blocks cached, its checkpoint committed, shapes right.
    fn hit_is_valid(&self, hit: &CacheHit) -> bool {
        let b = self.block_size;
        if hit.kv_blocks.len() * b != hit.num_tokens {
            return false;
        }
        if hit
            .kv_blocks
            .iter()
            .any(|&blk| self.kv.block_hash(blk).is_none())
        {
            return false;
        }
        match (self.mode, self.has_mamba) {
            (_, false) => hit.checkpoint.is_none(),
            (MambaCacheMode::None, true) => hit.num_tokens == 0 && hit.checkpoint.is_none(),
            (MambaCacheMode::Align | MambaCacheMode::All, true) => match hit.checkpoint {
                None => hit.num_tokens == 0,
                Some(s) => {
                    // Committed, at L, and keyed by the hash of the hit's last KV block.
                    let last = hit.kv_blocks.last().and_then(|&x| self.kv.block_hash(x));
                    self.mamba.kind(s) == Some(SlotKind::Committed)
                        && self.mamba.tag(s).map(|t| (Some(t.0), t.1))
                            == Some((last, hit.num_tokens))
                }
            },
        }
    }

    /// First allocation of a (new or resumed) request: takes references on the hit blocks,
    /// allocates its state window (1 + K slots) and the KV blocks for
    /// [L, L + num_new_tokens + num_lookahead_tokens). Emits `StateOp::Copy { src: checkpoint,
    /// dst: window[0] }` on a hit. None if it does not fit, if the request already has an
    /// allocation, or if the hit is no longer valid (re-query then); in every None case nothing
    /// was taken. On a model without Mamba layers the window is `1 + K` null slots.
    pub fn allocate_new(
        &mut self,
        req: ReqKey,
        hit: &CacheHit,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Option<Vec<StateOp>> {
        if self.reqs.contains_key(&req) || !self.hit_is_valid(hit) {
            return None;
        }
        let b = self.block_size;
        let total = hit
            .num_tokens
            .checked_add(num_new_tokens)?
            .checked_add(num_lookahead_tokens)?;
        let n_hit = hit.kv_blocks.len();
        let need = total.div_ceil(b).max(n_hit);
        let to_alloc = need - n_hit;
        let hit_free = hit
            .kv_blocks
            .iter()
            .filter(|&&x| self.kv.is_free(x))
            .count();
        if self.kv.num_free() < hit_free + to_alloc {
            return None;
        }
        if self.has_mamba {
            // The hit checkpoint itself must not be evicted to make room for the window.
            let ck_evictable = hit.checkpoint.is_some_and(|s| self.mamba.pin_count(s) == 0);
            let avail =
                self.mamba.num_free() + self.mamba.num_evictable() - usize::from(ck_evictable);
            if avail < self.window_len {
                return None;
            }
        }
        let mut st = ReqState {
            blocks: Vec::with_capacity(need),
            window: Vec::with_capacity(self.window_len),
            num_cached_blocks: n_hit,
            pinned: None,
        };
        for &blk in &hit.kv_blocks {
            self.kv.incref(blk);
            st.blocks.push(blk);
        }
        let mamba = &mut self.mamba;
        let ok = self
            .kv
            .allocate(to_alloc, &mut st.blocks, |h| mamba.mark_stale(h));
        debug_assert!(ok);
        let mut ops = Vec::new();
        if self.has_mamba {
            if let Some(c) = hit.checkpoint {
                self.mamba.pin(c);
                st.pinned = Some(c);
            }
            let ok = self.mamba.alloc_window(self.window_len, &mut st.window);
            debug_assert!(ok);
            if let (Some(c), Some(&w0)) = (hit.checkpoint, st.window.first()) {
                ops.push(StateOp::Copy { src: c, dst: w0 });
            }
        } else {
            st.window.resize(self.window_len, NULL_SLOT);
        }
        self.reqs.insert(req, st);
        Some(ops)
    }

    /// Later allocations of a running request: KV blocks so that the request's block table
    /// covers num_computed_tokens + num_new_tokens + num_lookahead_tokens (never shrinks).
    /// None if it does not fit or the request is unknown (nothing taken).
    pub fn allocate_more(
        &mut self,
        req: ReqKey,
        num_computed_tokens: usize,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Option<()> {
        let st = self.reqs.get_mut(&req)?;
        // The step that carried the hit copy has run: the checkpoint is no longer read.
        if let Some(c) = st.pinned.take() {
            self.mamba.unpin(c);
        }
        let total = num_computed_tokens
            .checked_add(num_new_tokens)?
            .checked_add(num_lookahead_tokens)?;
        let need = total.div_ceil(self.block_size);
        if need <= st.blocks.len() {
            return Some(());
        }
        let mamba = &mut self.mamba;
        self.kv
            .allocate(need - st.blocks.len(), &mut st.blocks, |h| {
                mamba.mark_stale(h)
            })
            .then_some(())
    }

    /// The request's KV block table (empty for an unknown request).
    pub fn block_table(&self, req: ReqKey) -> &[BlockId] {
        self.reqs.get(&req).map_or(&[], |s| &s.blocks)
    }

    /// The request's state window of 1 + K slots (empty for an unknown request).
    pub fn state_window(&self, req: ReqKey) -> &[SlotId] {
        self.reqs.get(&req).map_or(&[], |s| &s.window)
    }

    /// Registers in the prefix cache the request's full KV blocks among its first
    /// `num_accepted_tokens` tokens (only accepted tokens: never call it with draft positions).
    pub fn cache_full_blocks(
        &mut self,
        req: ReqKey,
        block_hashes: &[BlockHash],
        num_accepted_tokens: usize,
    ) {
        if !self.prefix_caching {
            return;
        }
        let useful = match (self.mode, self.has_mamba) {
            // Nothing could ever hit: do not fill the map.
            (MambaCacheMode::None, true) => false,
            (_, false) | (MambaCacheMode::Align | MambaCacheMode::All, true) => true,
        };
        if !useful {
            return;
        }
        let Some(st) = self.reqs.get_mut(&req) else {
            return;
        };
        let n = (num_accepted_tokens / self.block_size)
            .min(block_hashes.len())
            .min(st.blocks.len());
        let start = st.num_cached_blocks.min(n);
        for (&blk, &h) in st.blocks[start..n].iter().zip(&block_hashes[start..n]) {
            if self.kv.block_hash(blk).is_none() && self.kv.cache_block(blk, h) {
                self.mamba.mark_live(h);
            }
        }
        st.num_cached_blocks = st.num_cached_blocks.max(n);
    }

    /// A pending checkpoint for the state after `position` tokens (position a multiple of M),
    /// keyed by block_hashes[position / B - 1]. None if no slot is free after eviction, if a
    /// committed/pending checkpoint for that hash already exists, if `position` is not a
    /// positive multiple of M, or if the mode takes no checkpoints.
    pub fn reserve_checkpoint(&mut self, hash: BlockHash, position: usize) -> Option<SlotId> {
        match (self.mode, self.has_mamba) {
            (_, false) | (MambaCacheMode::None, true) => None,
            (MambaCacheMode::Align | MambaCacheMode::All, true) => {
                if !self.prefix_caching || position == 0 || position % self.mamba_block_size != 0 {
                    return None;
                }
                self.mamba.reserve(hash, position)
            }
        }
    }

    /// The forward that wrote the pending checkpoint `slot` has finished: it becomes a hit.
    pub fn commit_checkpoint(&mut self, slot: SlotId) {
        let kv_present = self
            .mamba
            .tag(slot)
            .is_some_and(|(h, _)| self.kv.contains(h));
        self.mamba.commit(slot, kv_present);
    }

    /// The pending checkpoint `slot` was never written (request aborted / rejected).
    pub fn cancel_checkpoint(&mut self, slot: SlotId) {
        self.mamba.cancel(slot);
    }

    /// Frees the request's window and KV blocks (cached blocks stay cached, ref 0, in LRU; the
    /// tail blocks are evicted first). Its committed checkpoints stay. Unknown ids are ignored.
    pub fn free(&mut self, req: ReqKey) {
        let Some(st) = self.reqs.remove(&req) else {
            return;
        };
        self.kv.release(&st.blocks);
        self.mamba.free_window(&st.window);
        if let Some(c) = st.pinned {
            self.mamba.unpin(c);
        }
    }

    /// Whether any request holds KV blocks or a state window.
    pub fn holds_requests(&self) -> bool {
        !self.reqs.is_empty() || self.kv.num_used() > 0
    }

    /// Drops every KV prefix-cache entry and every committed checkpoint. False (nothing changed)
    /// while any request holds blocks or a checkpoint is pending.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.reqs.is_empty() || self.mamba.num_pending() > 0 || self.kv.num_used() > 0 {
            return false;
        }
        let kv_ok = self.kv.reset(|_| {});
        let mamba_ok = self.mamba.clear_checkpoints();
        kv_ok && mamba_ok
    }

    pub fn stats(&self) -> CacheStats {
        let ckpts = self.mamba.num_committed() + self.mamba.num_pending();
        CacheStats {
            kv_blocks_total: self.kv.num_usable(),
            kv_blocks_used: self.kv.num_used(),
            kv_blocks_cached_free: self.kv.num_cached_free(),
            kv_blocks_free: self.kv.num_free() - self.kv.num_cached_free(),
            kv_blocks_cached: self.kv.num_cached(),
            mamba_slots_total: self.mamba.num_usable(),
            mamba_slots_used: self.mamba.num_used(),
            mamba_slots_window: self.mamba.num_window(),
            checkpoints_committed: self.mamba.num_committed(),
            checkpoints_pending: self.mamba.num_pending(),
            checkpoint_bytes: (ckpts as u64).saturating_mul(self.state_bytes_per_slot as u64),
            queried_tokens: self.queried_tokens,
            hit_tokens: self.hit_tokens,
            kv_hit_tokens: self.kv_hit_tokens,
            lost_tokens: self.lost_tokens,
            kv_evictions: self.kv.evictions(),
            checkpoint_evictions: self.mamba.evictions(),
        }
    }

    /// `(hash, position)` of a pending or committed checkpoint slot (for tests).
    pub fn debug_tag(&self, slot: SlotId) -> Option<(BlockHash, usize)> {
        self.mamba.tag(slot)
    }
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "cache_proptest.rs"]
mod proptests;
