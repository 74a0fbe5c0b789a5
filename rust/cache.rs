//! Hybrid cache coordinator: longest hit over the KV pool and the Mamba checkpoints, allocation,
//! freeing (stub; real implementation follows).

use std::collections::HashMap;

pub use crate::block_hash::BlockHash;
use crate::config::ResolvedConfig;

/// KV block id; 0 = null block, never handed out.
pub type BlockId = u32;
/// Mamba state slot id; 0 = null slot, never handed out.
pub type SlotId = u32;
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

/// Usage figures and counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_cached_free: usize,
    pub mamba_slots_total: usize,
    pub mamba_slots_used: usize,
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
}

/// The hybrid cache manager (see contracts §2).
#[derive(Debug)]
pub struct HybridCacheManager {
    block_size: usize,
    window_len: usize,
    next_block: BlockId,
    next_slot: SlotId,
    reqs: HashMap<ReqKey, ReqState>,
    stats: CacheStats,
}

impl HybridCacheManager {
    pub fn new(cfg: &ResolvedConfig, num_kv_blocks: usize, num_mamba_slots: usize) -> Self {
        HybridCacheManager {
            block_size: cfg.block_size.max(1),
            window_len: cfg.state_window_len(),
            next_block: 1,
            next_slot: 1,
            reqs: HashMap::new(),
            stats: CacheStats {
                kv_blocks_total: num_kv_blocks,
                mamba_slots_total: num_mamba_slots,
                ..CacheStats::default()
            },
        }
    }

    /// Per-slot state size in bytes (all Mamba layers), for the `checkpoint_bytes` figure.
    pub fn set_state_bytes_per_slot(&mut self, _n: usize) {}

    pub fn find_longest_cache_hit(
        &mut self,
        _block_hashes: &[BlockHash],
        num_tokens: usize,
    ) -> CacheHit {
        self.stats.queried_tokens += num_tokens as u64;
        CacheHit::default()
    }

    pub fn allocate_new(
        &mut self,
        req: ReqKey,
        hit: &CacheHit,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Option<Vec<StateOp>> {
        let mut st = ReqState::default();
        for _ in 0..self.window_len {
            st.window.push(self.next_slot);
            self.next_slot += 1;
        }
        self.reqs.insert(req, st);
        self.allocate_more(req, hit.num_tokens, num_new_tokens, num_lookahead_tokens)?;
        Some(Vec::new())
    }

    pub fn allocate_more(
        &mut self,
        req: ReqKey,
        num_computed_tokens: usize,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Option<()> {
        let total = num_computed_tokens + num_new_tokens + num_lookahead_tokens;
        let need = total.div_ceil(self.block_size);
        let st = self.reqs.get_mut(&req)?;
        while st.blocks.len() < need {
            st.blocks.push(self.next_block);
            self.next_block += 1;
        }
        Some(())
    }

    pub fn block_table(&self, req: ReqKey) -> &[BlockId] {
        self.reqs.get(&req).map_or(&[], |s| &s.blocks)
    }

    pub fn state_window(&self, req: ReqKey) -> &[SlotId] {
        self.reqs.get(&req).map_or(&[], |s| &s.window)
    }

    pub fn cache_full_blocks(
        &mut self,
        _req: ReqKey,
        _block_hashes: &[BlockHash],
        _num_accepted_tokens: usize,
    ) {
    }

    pub fn reserve_checkpoint(&mut self, _hash: BlockHash, _position: usize) -> Option<SlotId> {
        None
    }

    pub fn commit_checkpoint(&mut self, _slot: SlotId) {}

    pub fn cancel_checkpoint(&mut self, _slot: SlotId) {}

    pub fn free(&mut self, req: ReqKey) {
        self.reqs.remove(&req);
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.reqs.is_empty()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats.clone()
    }

    pub fn debug_tag(&self, _slot: SlotId) -> Option<(BlockHash, usize)> {
        None
    }
}
