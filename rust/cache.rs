//! The hybrid cache coordinator: longest usable prefix hit over the KV pool and the Mamba
//! checkpoints, allocation of KV blocks and state windows, checkpoint placement (reservation,
//! commit, adoption of a finished sequence's last state), eviction, freeing.
//!
//! Hit rules: a hit of length L needs
//! - `L <= num_tokens - 1` (the last token is always recomputed to get logits);
//! - cached KV for all of `[0, L)`: the full blocks below L, and when L is not a multiple of B a
//!   *tail* entry holding exactly the tokens of the partial block (registered when a sequence ended
//!   there; the hit copies it into a block of the request's own);
//! - on a Mamba model in mode `align`/`all`: a *committed* checkpoint at exactly L, keyed by the
//!   hash of the prefix that ends at L (a full block's chained hash, or the tail's);
//! - on a model without Mamba layers: KV only (full blocks);
//! - on a Mamba model in mode `none` (or with prefix caching off): no hits, and nothing is cached.
//!
//! Where checkpoints come from is the scheduler's business (the placement); this module keys,
//! commits, adopts and evicts them. Every operation whose behaviour depends on the mode has one
//! `match` on `MambaCacheMode`; `align` and `all` behave alike here.
//!
//! Copy-on-write: a hit's checkpoint and tail block are read-only; `allocate_new` emits copies into
//! the request's own window slot and KV block and pins both until the copies have run (the
//! request's next `allocate_more`, in a later step, or `free`).
//!
//! Eviction (`EvictionPolicy`): stale checkpoints (their KV prefix was evicted) always go first.
//! Then `lru`/`lru-path` take the least recently used. `flops` first takes checkpoints superseded
//! by a deeper one of the same sequence (a request resumed from a last-token state and kept its
//! own: the conversation moved on), then the lowest `recency + weight * efficiency`
//! (`flops_victim`): recency is the rank by last use, efficiency the expected prefill FLOPs the
//! checkpoint saves over the nearest checkpoint above it on its prefix (FLOPs times its kind's
//! running reuse rate) per byte it holds (its state and the KV blocks between the two), on a log
//! scale. A hit refreshes the checkpoint it consumed (`lru-path`: every checkpoint on its path).
//! With `flops`, KV blocks that no checkpoint at or below them can use are evicted before any other
//! cached block, a KV shortage evicts the checkpoint whose path is worth least, and while almost
//! no admission resumes a last-token state (single-turn traffic) they are not kept, but for a
//! probe, and grid points may take the places of those kept.
//!
//! Counters: `find_longest_cache_hit` adds `num_tokens` to `queried_tokens`, L to `hit_tokens`, the
//! KV-only hit to `kv_hit_tokens`, and the difference (KV prefix cached, no checkpoint there) to
//! `lost_tokens` on every call.

use std::collections::HashMap;

pub use crate::block_hash::BlockHash;
use crate::block_hash::{BlockHasher, PassThroughBuild};
use crate::block_pool::BlockPool;
pub use crate::block_pool::{BlockId, NULL_BLOCK};
use crate::config::{CheckpointPlacement, EvictionPolicy, MambaCacheMode, ResolvedConfig};
use crate::kv_events::{EventLog, KvEvent, Truth};
pub use crate::mamba_pool::{CheckpointKind, CheckpointTag, SlotId, NULL_SLOT};
use crate::mamba_pool::{MambaPool, SlotKind};

/// The scheduler's numeric id of a request.
pub type ReqKey = u64;

/// The default weight of FLOP efficiency against recency in the `flops` eviction score (the
/// trace-replay benchmark, `hybridserve bench cache-trace`, sweeps it).
pub const DEFAULT_FLOP_WEIGHT: f64 = 1.0;

/// Weight of the newest outcome in the running reuse rate of each checkpoint kind.
const REUSE_RATE_STEP: f64 = 1.0 / 32.0;

/// Below this share of admissions that resume a last-token state, the FLOP-aware policy keeps
/// only every `LAST_STATE_PROBE`-th of them, and grid points may take their places.
const MIN_LAST_STATE_REUSE: f64 = 0.05;
/// Weight of the newest admission in `resume_rate`.
const RESUME_RATE_STEP: f64 = 1.0 / 16.0;
const LAST_STATE_PROBE: u64 = 16;

/// An operation the runner executes, in order, before the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateOp {
    /// Copy the Mamba state (conv and SSM, every layer) of slot `src` into slot `dst`.
    Copy { src: SlotId, dst: SlotId },
    /// Copy the KV of block `src` into block `dst` (every attention layer).
    CopyBlock { src: BlockId, dst: BlockId },
}

/// The token prefix a lookup or a last-state checkpoint is about: the chained hashes of its full
/// blocks, its tokens (for tail entries; may be empty when tails are not wanted) and the root of
/// its hash chain (the salt's).
#[derive(Clone, Copy, Debug)]
pub struct Prefix<'a> {
    pub hashes: &'a [BlockHash],
    pub tokens: &'a [u32],
    pub root: BlockHash,
}

impl<'a> Prefix<'a> {
    /// Full blocks only (no tail lookups).
    pub fn of_hashes(hashes: &'a [BlockHash]) -> Self {
        Prefix {
            hashes,
            tokens: &[],
            root: BlockHash(0),
        }
    }
}

/// The result of `find_longest_cache_hit`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheHit {
    /// L.
    pub num_tokens: usize,
    /// The L / B (rounded down) cached full blocks.
    pub kv_blocks: Vec<BlockId>,
    /// When L is not a multiple of B: the cached tail block holding tokens [L / B * B, L).
    pub tail: Option<BlockId>,
    /// Committed checkpoint holding the state after exactly L tokens.
    pub checkpoint: Option<SlotId>,
    /// Why that checkpoint was placed.
    pub kind: Option<CheckpointKind>,
    /// Tokens the KV pool alone could have served (full blocks; for the "lost" counter and for
    /// branch-point placement).
    pub kv_hit_tokens: usize,
}

/// What the `flops` eviction score needs to know about the model and its memory.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostModel {
    /// Bytes of one state slot (all Mamba layers, conv + SSM).
    pub state_bytes: u64,
    /// Bytes of one KV block (all attention layers).
    pub kv_bytes_per_block: u64,
    /// Prefill FLOPs per token that do not depend on the context (projections, MLPs, the scan).
    pub flops_per_token: f64,
    /// Attention FLOPs per token per token of context before it.
    pub attn_flops_per_context_token: f64,
}

impl CostModel {
    /// FLOPs to prefill positions [a, b).
    pub fn prefill_flops(&self, a: usize, b: usize) -> f64 {
        if b <= a {
            return 0.0;
        }
        let n = (b - a) as f64;
        // sum of the context lengths a..b-1
        let ctx = n * (a as f64 + b as f64 - 1.0) / 2.0;
        n * self.flops_per_token + ctx * self.attn_flops_per_context_token
    }
}

/// Why a checkpoint was evicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionCause {
    /// A new checkpoint needed its slot or the checkpoint budget.
    ForCheckpoint,
    /// A running request's state window needed its slot.
    ForWindow,
    /// A KV allocation would otherwise have evicted a block that hits can still use: the
    /// checkpoint that keeps the cheapest such path goes, and its blocks with it.
    ForKv,
}

/// Usage figures and counters. Block and slot totals exclude the null block / slot.
/// After every request has finished: `kv_blocks_used == 0` and
/// `kv_blocks_free + kv_blocks_cached_free == kv_blocks_total`.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// Committed checkpoints by kind (`CheckpointKind::index`).
    pub checkpoints_by_kind: [usize; CheckpointKind::COUNT],
    pub checkpoint_bytes: u64,
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    pub kv_hit_tokens: u64,
    pub lost_tokens: u64,
    pub kv_evictions: u64,
    /// Of `kv_evictions`: blocks that no checkpoint could use any more.
    pub kv_evictions_useless: u64,
    pub checkpoint_evictions: u64,
    /// Of `checkpoint_evictions`: stale ones, for a new checkpoint, for a window.
    pub checkpoint_evictions_stale: u64,
    pub checkpoint_evictions_for_checkpoint: u64,
    pub checkpoint_evictions_for_window: u64,
    pub checkpoint_evictions_for_kv: u64,
    /// The running rate at which checkpoints of each kind get used before they go.
    pub checkpoint_reuse_rate: [f64; CheckpointKind::COUNT],
}

#[derive(Clone, Debug, Default)]
struct ReqState {
    blocks: Vec<BlockId>,
    window: Vec<SlotId>,
    /// Leading blocks already registered in (or checked against) the prefix cache.
    num_cached_blocks: usize,
    /// Checkpoint pinned until its hit copy has run.
    pinned: Option<SlotId>,
    /// Tail block referenced until its hit copy has run.
    pinned_tail: Option<BlockId>,
    /// The last-token checkpoint this residency resumed from, with its tag then: superseded once
    /// the request keeps a deeper last state (the conversation it belongs to moved on), if the
    /// slot still holds it (it may have been evicted and hold another sequence's state since).
    resumed_from: Option<(SlotId, CheckpointTag)>,
}

/// The hybrid cache manager.
#[derive(Debug, Clone)]
pub struct HybridCacheManager {
    mode: MambaCacheMode,
    has_mamba: bool,
    prefix_caching: bool,
    placement: CheckpointPlacement,
    eviction: EvictionPolicy,
    block_size: usize,
    mamba_block_size: usize,
    window_len: usize,
    hasher: BlockHasher,
    kv: BlockPool,
    mamba: MambaPool,
    /// Per slot: the KV block its checkpoint is attached to (0 = not attached: pending or stale).
    ck_block: Vec<BlockId>,
    /// Per slot: the position of the nearest checkpoint above it when it was last attached or its
    /// neighbours changed (0 = none: a hit would fall back to recomputing from the start).
    ck_parent_pos: Vec<usize>,
    /// Per slot: a hit has used this checkpoint since it was placed.
    ck_consumed: Vec<bool>,
    /// Per checkpoint kind (`CheckpointKind::index`): a running rate of checkpoints used by a hit
    /// before they were evicted. Shared system prompts make branch points pay; single-turn traffic
    /// makes last-token states useless, chat makes them the most valuable of all. The `flops` score
    /// weighs the FLOPs a checkpoint saves by its kind's rate.
    reuse_rate: [f64; CheckpointKind::COUNT],
    /// Last-token states offered while too few admissions resumed one to keep them.
    declined_last_states: u64,
    /// A running share of admissions that resume a last-token state (FLOP-aware policy). It
    /// decides whether last-token states are kept and whether grid points may take their
    /// places. It is learned from every admission, so it falls within a few dozen requests of
    /// single-turn traffic; a rate learned when kept states are evicted unused fell only where
    /// something evicted them, and in a pool where grid points may not, unused last-token states
    /// of single-turn traffic filled the places that a system prompt's second user needed a grid
    /// point in.
    resume_rate: f64,
    cost: CostModel,
    flop_weight: f64,
    reqs: HashMap<ReqKey, ReqState, PassThroughBuild>,
    queried_tokens: u64,
    hit_tokens: u64,
    kv_hit_tokens: u64,
    lost_tokens: u64,
    evictions_stale: u64,
    evictions_for_checkpoint: u64,
    evictions_for_window: u64,
    evictions_for_kv: u64,
    scratch: Vec<SlotId>,
    /// KV cache events, when a subscriber wants them (`enable_events`).
    events: Option<Box<EventLog>>,
}

impl HybridCacheManager {
    /// `num_kv_blocks` and `num_mamba_slots` include the null block / slot. Windows of
    /// `max_num_seqs` requests are reserved in the Mamba pool; checkpoints use the rest. Block
    /// hashes under hash seed 0.
    pub fn new(cfg: &ResolvedConfig, num_kv_blocks: usize, num_mamba_slots: usize) -> Self {
        Self::with_hasher(cfg, num_kv_blocks, num_mamba_slots, BlockHasher::new(0))
    }

    /// As `new`, with the hasher whose chains the requests' block hashes come from (tail entries
    /// are hashed with it).
    pub fn with_hasher(
        cfg: &ResolvedConfig,
        num_kv_blocks: usize,
        num_mamba_slots: usize,
        hasher: BlockHasher,
    ) -> Self {
        let window_len = cfg.state_window_len();
        let window_reserve = if cfg.has_mamba_layers {
            cfg.max_num_seqs.saturating_mul(window_len)
        } else {
            0
        };
        let mut kv = BlockPool::new(num_kv_blocks);
        let checkpoints = cfg.has_mamba_layers
            && cfg.enable_prefix_caching
            && cfg.mamba_cache_mode != MambaCacheMode::None;
        kv.set_track_usefulness(checkpoints && cfg.eviction == EvictionPolicy::Flops);
        let mamba = MambaPool::new(num_mamba_slots, window_reserve);
        let n_slots = mamba.num_slots();
        HybridCacheManager {
            mode: cfg.mamba_cache_mode,
            has_mamba: cfg.has_mamba_layers,
            prefix_caching: cfg.enable_prefix_caching,
            placement: cfg.checkpoint_placement,
            eviction: cfg.eviction,
            block_size: cfg.block_size.max(1),
            mamba_block_size: cfg.mamba_block_size.max(1),
            window_len,
            hasher,
            kv,
            mamba,
            ck_block: vec![NULL_BLOCK; n_slots],
            ck_parent_pos: vec![0; n_slots],
            ck_consumed: vec![false; n_slots],
            reuse_rate: [0.5; CheckpointKind::COUNT],
            declined_last_states: 0,
            resume_rate: 0.5,
            cost: CostModel::default(),
            flop_weight: DEFAULT_FLOP_WEIGHT,
            reqs: HashMap::with_capacity_and_hasher(cfg.max_num_seqs, PassThroughBuild::default()),
            queried_tokens: 0,
            hit_tokens: 0,
            kv_hit_tokens: 0,
            lost_tokens: 0,
            evictions_stale: 0,
            evictions_for_checkpoint: 0,
            evictions_for_window: 0,
            evictions_for_kv: 0,
            scratch: Vec::new(),
            events: None,
        }
    }

    /// Starts recording KV cache events (`take_events`). Entries cached before are not announced.
    pub fn enable_events(&mut self) {
        if self.events.is_none() {
            self.events = Some(Box::default());
            self.kv.set_record_changes(true);
        }
    }

    /// Whether KV cache events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Events emitted so far (0 when not recording).
    pub fn num_events(&self) -> u64 {
        self.events.as_ref().map_or(0, |e| e.num_emitted())
    }

    /// The events since the last call (docs/kv-events.md): what a subscriber must apply to see
    /// exactly the prefixes a request can hit now. Empty when not recording.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let Some(mut log) = self.events.take() else {
            return Vec::new();
        };
        let (changed, reset) = self.kv.take_changes();
        if reset {
            log.clear();
        }
        for h in changed {
            log.mark(h);
        }
        let out = log.flush(|h| self.truth(h));
        self.events = Some(log);
        out
    }

    /// What the events announce about `h` now: a cached full block a hit can use (group 0), a
    /// committed checkpoint whose KV prefix is cached (group 1).
    fn truth(&self, h: BlockHash) -> Truth {
        let blk = self.kv.get_cached(h);
        let kv = blk.is_some_and(|b| {
            !self.kv.is_tail(b) && (!self.checkpoints() || self.kv.tree().below(b) > 0)
        });
        let slot = self.mamba.lookup(h);
        let checkpoint = slot.is_some_and(|s| self.ck_block[s as usize] != NULL_BLOCK);
        Truth {
            kv,
            checkpoint,
            known: blk.is_some() || self.mamba.has_checkpoint(h),
        }
    }

    /// Marks `h` for the next event flush.
    fn mark_event(&mut self, h: BlockHash) {
        if let Some(log) = self.events.as_mut() {
            log.mark(h);
        }
    }

    /// Tells the event log what the newly cached prefix `h` holds. Chains of requests with a
    /// cache salt (whose `root` is not the unsalted one) are never announced: a subscriber could
    /// not tell them from the same tokens without the salt, and one tenant's cache is not
    /// another's to route by.
    fn describe_event(
        &mut self,
        root: BlockHash,
        h: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        end: usize,
    ) {
        if root != self.hasher.root(None) {
            return;
        }
        if let Some(log) = self.events.as_mut() {
            log.describe(h, parent, tokens, end);
        }
    }

    /// The hasher of the block-hash chains.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Sizes and FLOPs for the `flops` eviction score and the memory figures.
    pub fn set_cost_model(&mut self, cost: CostModel) {
        self.cost = cost;
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// The weight of FLOP efficiency against recency in the `flops` score (finite, >= 0).
    pub fn set_flop_weight(&mut self, w: f64) {
        if w.is_finite() && w >= 0.0 {
            self.flop_weight = w;
        }
    }

    /// Per-slot state size in bytes (all Mamba layers), for the `checkpoint_bytes` figure.
    pub fn set_state_bytes_per_slot(&mut self, n: usize) {
        self.cost.state_bytes = n as u64;
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

    /// Whether this configuration keeps Mamba checkpoints at all.
    fn checkpoints(&self) -> bool {
        match (self.mode, self.has_mamba) {
            (_, false) | (MambaCacheMode::None, true) => false,
            (MambaCacheMode::Align | MambaCacheMode::All, true) => self.prefix_caching,
        }
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

    /// The committed checkpoint at exactly `position` keyed `hash`, if any.
    fn checkpoint_at(&self, hash: BlockHash, position: usize) -> Option<SlotId> {
        let s = self.mamba.lookup(hash)?;
        (self.mamba.tag(s) == Some((hash, position))).then_some(s)
    }

    /// The deepest checkpoint usable by `prefix` within `num_kv_blocks` cached full blocks and
    /// `max_tokens` tokens: `(L, checkpoint, tail block)`.
    fn deepest_checkpoint(
        &self,
        prefix: &Prefix<'_>,
        num_kv_blocks: usize,
        max_tokens: usize,
    ) -> Option<(usize, SlotId, Option<BlockId>)> {
        let b = self.block_size;
        for d in (0..=num_kv_blocks).rev() {
            // Tails right below the first d blocks: positions d*B + t, t in 1..B.
            let parent = if d == 0 {
                prefix.root
            } else {
                prefix.hashes[d - 1]
            };
            let max_t = (b - 1)
                .min(max_tokens.saturating_sub(d * b))
                .min(prefix.tokens.len().saturating_sub(d * b));
            if max_t > 0 && self.kv.has_tails(parent) {
                for t in (1..=max_t).rev() {
                    let h = self
                        .hasher
                        .hash_block(parent, &prefix.tokens[d * b..d * b + t]);
                    let Some(blk) = self.kv.get_cached(h) else {
                        continue;
                    };
                    if !self.kv.is_tail(blk) {
                        continue;
                    }
                    if let Some(s) = self.checkpoint_at(h, d * b + t) {
                        return Some((d * b + t, s, Some(blk)));
                    }
                }
            }
            if d > 0 && d * b <= max_tokens {
                if let Some(s) = self.checkpoint_at(prefix.hashes[d - 1], d * b) {
                    return Some((d * b, s, None));
                }
            }
        }
        None
    }

    /// Longest usable hit for a request whose prefix is `prefix` and whose known tokens number
    /// `num_tokens` (prompt, or prompt + output for a resumed request). L <= num_tokens - 1. A pure
    /// query apart from counters and the checkpoint's recency; takes no references. Call
    /// `allocate_new` with it right away (before other allocations).
    pub fn find_longest_cache_hit(&mut self, prefix: Prefix<'_>, num_tokens: usize) -> CacheHit {
        let mut hit = self.peek_longest_cache_hit(prefix, num_tokens);
        if let Some(s) = hit.checkpoint {
            self.refresh(s);
        }
        let l = hit.num_tokens;
        self.queried_tokens += num_tokens as u64;
        self.hit_tokens += l as u64;
        self.kv_hit_tokens += hit.kv_hit_tokens as u64;
        self.lost_tokens += hit.kv_hit_tokens.saturating_sub(l) as u64;
        hit.kv_blocks.truncate(l / self.block_size);
        hit
    }

    /// The hit `find_longest_cache_hit` would return, without counting it or refreshing its
    /// checkpoint (and with every cached block of the KV prefix in `kv_blocks`).
    pub fn peek_longest_cache_hit(&self, prefix: Prefix<'_>, num_tokens: usize) -> CacheHit {
        let b = self.block_size;
        if !self.prefix_caching {
            return CacheHit::default();
        }
        let max_tokens = num_tokens.saturating_sub(1);
        let max_blocks = (max_tokens / b).min(prefix.hashes.len());
        match (self.mode, self.has_mamba) {
            // No Mamba layers: the mode has no effect, hits are KV only.
            (_, false) => {
                let blocks = self.kv_prefix_blocks(prefix.hashes, max_blocks);
                CacheHit {
                    num_tokens: blocks.len() * b,
                    kv_hit_tokens: blocks.len() * b,
                    kv_blocks: blocks,
                    ..CacheHit::default()
                }
            }
            (MambaCacheMode::None, true) => CacheHit::default(),
            (MambaCacheMode::Align | MambaCacheMode::All, true) => {
                let blocks = self.kv_prefix_blocks(prefix.hashes, max_blocks);
                let kv_tokens = blocks.len() * b;
                match self.deepest_checkpoint(&prefix, blocks.len(), max_tokens) {
                    Some((l, s, tail)) => CacheHit {
                        num_tokens: l,
                        kv_blocks: blocks,
                        tail,
                        checkpoint: Some(s),
                        kind: self.mamba.checkpoint_tag(s).map(|t| t.kind),
                        kv_hit_tokens: kv_tokens,
                    },
                    None => CacheHit {
                        kv_blocks: blocks,
                        kv_hit_tokens: kv_tokens,
                        ..CacheHit::default()
                    },
                }
            }
        }
    }

    /// A hit consumed checkpoint `s`: refresh it (and, with `lru-path`, every checkpoint above it
    /// on its prefix, the shallowest first, so that `s` ends most recent).
    fn refresh(&mut self, s: SlotId) {
        if self.eviction == EvictionPolicy::LruPath {
            let mut path = Vec::new();
            let mut blk = self.ck_block[s as usize];
            while blk != NULL_BLOCK {
                let c = self.kv.tree().checkpoint(blk);
                if c != NULL_SLOT && c != s {
                    path.push(c);
                }
                blk = self.kv.tree().parent(blk).unwrap_or(NULL_BLOCK);
            }
            for &c in path.iter().rev() {
                self.mamba.touch(c);
            }
        }
        self.mamba.touch(s);
    }

    /// Whether `hit` is still valid: its blocks cached, its checkpoint committed, shapes right.
    fn hit_is_valid(&self, hit: &CacheHit) -> bool {
        let b = self.block_size;
        let l = hit.num_tokens;
        if hit.kv_blocks.len() != l / b || hit.tail.is_some() != (l % b != 0) {
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
            (_, false) => hit.checkpoint.is_none() && hit.tail.is_none(),
            (MambaCacheMode::None, true) => {
                l == 0 && hit.checkpoint.is_none() && hit.tail.is_none()
            }
            (MambaCacheMode::Align | MambaCacheMode::All, true) => match hit.checkpoint {
                None => l == 0,
                Some(s) => {
                    // Committed, at L, keyed by the hash of the prefix that ends at L.
                    let key = match hit.tail {
                        Some(t) if self.kv.is_tail(t) => self.kv.block_hash(t),
                        Some(_) => return false,
                        None => hit.kv_blocks.last().and_then(|&x| self.kv.block_hash(x)),
                    };
                    self.mamba.kind(s) == Some(SlotKind::Committed)
                        && self.mamba.tag(s).map(|t| (Some(t.0), t.1)) == Some((key, l))
                }
            },
        }
    }

    // ------------------------------------------------------------------ eviction

    /// The `flops` score's victim among live evictable checkpoints (`for_kv`: only those whose
    /// own KV block is free and holds no other checkpoint below it, so that evicting one frees
    /// at least that block for reuse).
    ///
    /// score = recency + weight * efficiency, lowest evicted, where
    /// - recency is the checkpoint's rank by last use among the candidates, scaled to [0, 1]
    ///   (ranks, not times: the spread of use times says little, their order says a lot);
    /// - efficiency is log(1 + expected FLOPs saved per byte held), scaled to [0, 1] over the
    ///   candidates: the prefill FLOPs from the checkpoint above it on its prefix to it, times its
    ///   kind's reuse rate, per byte of its state and of the KV blocks between the two.
    fn flops_victim(&self, for_kv: bool) -> Option<SlotId> {
        let mut cands: Vec<(SlotId, u64, f64)> = Vec::with_capacity(self.mamba.num_evictable());
        for s in self.mamba.live_evictable() {
            if for_kv {
                let blk = self.ck_block[s as usize];
                if blk == NULL_BLOCK || !self.kv.is_free(blk) || self.kv.tree().below(blk) != 1 {
                    continue;
                }
            }
            let Some(tag) = self.mamba.checkpoint_tag(s) else {
                continue;
            };
            let expected = self.reuse_rate[tag.kind.index()] * self.saved_flops(s);
            // Log scale: savings span orders of magnitude (a few tail tokens to a long context),
            // and a linear scale would let the largest one flatten every other difference.
            let eff = (1.0 + expected / self.bytes_held(s) as f64).ln();
            cands.push((s, self.mamba.last_use(s), eff));
        }
        if cands.is_empty() {
            return None;
        }
        // The live list runs from least to most recently used: a candidate's index is its rank.
        let top = (cands.len().max(2) - 1) as f64;
        let (e_lo, e_hi) = min_max(cands.iter().map(|c| c.2))?;
        let eff_norm = |e: f64| {
            if e_hi > e_lo {
                (e - e_lo) / (e_hi - e_lo)
            } else {
                0.0
            }
        };
        let mut best: Option<(f64, u64, SlotId)> = None;
        for (rank, &(s, used, e)) in cands.iter().enumerate() {
            let score = rank as f64 / top + self.flop_weight * eff_norm(e);
            // Ties: the least recently used.
            if best.is_none_or(|(bs, bu, _)| score < bs || (score == bs && used < bu)) {
                best = Some((score, used, s));
            }
        }
        best.map(|t| t.2)
    }

    /// Prefill FLOPs the committed checkpoint `s` saves a hit over the checkpoint above it.
    fn saved_flops(&self, s: SlotId) -> f64 {
        let Some(tag) = self.mamba.checkpoint_tag(s) else {
            return 0.0;
        };
        let from = self.ck_parent_pos[s as usize].min(tag.position);
        self.cost.prefill_flops(from, tag.position)
    }

    /// Bytes checkpoint `s` keeps: its state and the KV blocks between it and the one above it.
    fn bytes_held(&self, s: SlotId) -> u64 {
        let Some(tag) = self.mamba.checkpoint_tag(s) else {
            return 1;
        };
        let from = self.ck_parent_pos[s as usize].min(tag.position);
        let blocks = ((tag.position - from) as u64).div_ceil(self.block_size as u64);
        (self.cost.state_bytes + blocks * self.cost.kv_bytes_per_block).max(1)
    }

    /// Evicts one committed, unpinned checkpoint (stale first, then by the policy). False if none
    /// is evictable.
    fn evict_checkpoint(&mut self, cause: EvictionCause) -> bool {
        // Stale checkpoints can never hit; superseded ones (FLOP-aware policy) almost never will.
        let (victim, stale) = if let Some(s) = self.mamba.stale_victim() {
            (s, true)
        } else {
            let v = match self.eviction {
                EvictionPolicy::Lru | EvictionPolicy::LruPath => self.mamba.lru_victim(),
                EvictionPolicy::Flops => self
                    .mamba
                    .superseded_victim()
                    .or_else(|| self.flops_victim(false)),
            };
            let Some(v) = v else {
                return false;
            };
            (v, false)
        };
        self.detach(victim);
        self.learn_outcome(victim);
        if !self.mamba.evict(victim) {
            return false;
        }
        if stale {
            self.evictions_stale += 1;
        } else {
            match cause {
                EvictionCause::ForCheckpoint => self.evictions_for_checkpoint += 1,
                EvictionCause::ForWindow => self.evictions_for_window += 1,
                EvictionCause::ForKv => self.evictions_for_kv += 1,
            }
        }
        true
    }

    /// Admission of last-token states (FLOP-aware policy): while fewer than
    /// `MIN_LAST_STATE_REUSE` of the admissions resume one (single-turn traffic: a state after a
    /// unique answer is never resumed), keeping one would only push out checkpoints that do get
    /// hit. Every `LAST_STATE_PROBE`-th is still kept, so that the rate notices when
    /// conversations start.
    fn last_state_worth_keeping(&mut self) -> bool {
        if self.last_states_resumed() {
            return true;
        }
        self.declined_last_states += 1;
        self.declined_last_states % LAST_STATE_PROBE == 0
    }

    /// Whether enough admissions resume a last-token state for keeping them to pay.
    fn last_states_resumed(&self) -> bool {
        self.resume_rate >= MIN_LAST_STATE_REUSE
    }

    /// Checkpoint `s` is about to go: if no hit used it, its kind's reuse rate learns a miss.
    fn learn_outcome(&mut self, s: SlotId) {
        let used = std::mem::take(&mut self.ck_consumed[s as usize]);
        if !used {
            if let Some(t) = self.mamba.checkpoint_tag(s) {
                let r = &mut self.reuse_rate[t.kind.index()];
                *r += REUSE_RATE_STEP * (0.0 - *r);
            }
        }
    }

    /// A hit uses checkpoint `s`: the first use teaches its kind's reuse rate a success.
    fn learn_use(&mut self, s: SlotId) {
        if !std::mem::replace(&mut self.ck_consumed[s as usize], true) {
            if let Some(t) = self.mamba.checkpoint_tag(s) {
                let r = &mut self.reuse_rate[t.kind.index()];
                *r += REUSE_RATE_STEP * (1.0 - *r);
            }
        }
    }

    /// Evicts until `n` slots are free. False (having evicted what it could) if impossible.
    fn make_free_slots(&mut self, n: usize, cause: EvictionCause) -> bool {
        while self.mamba.num_free() < n {
            if !self.evict_checkpoint(cause) {
                return false;
            }
        }
        true
    }

    /// Room for one more checkpoint: below the checkpoint budget and a free slot.
    fn make_checkpoint_room(&mut self) -> bool {
        while self.mamba.at_checkpoint_cap() {
            if !self.evict_checkpoint(EvictionCause::ForCheckpoint) {
                return false;
            }
        }
        self.make_free_slots(1, EvictionCause::ForCheckpoint)
    }

    /// Room for one more grid (or declared) checkpoint next to branch points and last tokens: free
    /// capacity, else the least recently used grid checkpoint goes (or, with the FLOP-aware
    /// policy, the least recently used last-token state while admissions do not resume those),
    /// else, for a declared one, the least recently used declared one that no hit has used.
    fn make_grid_room(&mut self, kind: CheckpointKind) -> bool {
        while self.mamba.at_checkpoint_cap() || self.mamba.num_free() == 0 {
            let grid = self
                .mamba
                .stale_victim()
                .or_else(|| self.mamba.superseded_victim())
                .or_else(|| {
                    // last-token states too while admissions do not resume them: kept as
                    // probes, not for a reason that holds
                    let last_too =
                        self.eviction == EvictionPolicy::Flops && !self.last_states_resumed();
                    self.mamba.live_evictable().find(|&s| {
                        self.mamba.checkpoint_tag(s).is_some_and(|t| {
                            t.kind == CheckpointKind::Grid
                                || (last_too && t.kind == CheckpointKind::LastToken)
                        })
                    })
                })
                .or_else(|| {
                    // a declared prefix takes the place of another that no hit has used yet, the
                    // least recently used (a pool full of declared prefixes that nobody shares
                    // would refuse every new one); one that was hit is a shared prefix, kept. A
                    // grid point, a bet that nothing tells of, never takes a declared one's place.
                    if kind != CheckpointKind::Declared {
                        return None;
                    }
                    self.mamba.live_evictable().find(|&s| {
                        !self.ck_consumed[s as usize]
                            && self
                                .mamba
                                .checkpoint_tag(s)
                                .is_some_and(|t| t.kind == CheckpointKind::Declared)
                    })
                });
            let Some(v) = grid else {
                return false;
            };
            self.detach(v);
            self.learn_outcome(v);
            if !self.mamba.evict(v) {
                return false;
            }
            self.evictions_for_checkpoint += 1;
        }
        true
    }

    /// Links the committed checkpoint `s` to the cached block of its hash (if cached: live, else
    /// stale) and updates the fallback positions of it and of the checkpoints right below it.
    fn attach(&mut self, s: SlotId) {
        let Some(tag) = self.mamba.checkpoint_tag(s) else {
            return;
        };
        self.mark_event(tag.hash);
        let blk = match self.kv.get_cached(tag.hash) {
            Some(blk) if self.kv.attach_checkpoint(blk, s) => blk,
            _ => {
                self.mamba.set_stale(s, true);
                return;
            }
        };
        self.ck_block[s as usize] = blk;
        let tree = self.kv.tree();
        self.ck_parent_pos[s as usize] = tree
            .nearest_checkpoint_above(blk)
            .and_then(|p| self.mamba.tag(p))
            .map_or(0, |t| t.1);
        let mut below = std::mem::take(&mut self.scratch);
        below.clear();
        tree.checkpoints_directly_below(blk, &mut below);
        for &c in &below {
            self.ck_parent_pos[c as usize] = tag.position;
        }
        below.clear();
        self.scratch = below;
        self.mamba.set_stale(s, false);
    }

    /// Unlinks checkpoint `s` from its block (before it goes): the checkpoints right below it fall
    /// back to its own fallback position.
    fn detach(&mut self, s: SlotId) {
        if let Some((h, _)) = self.mamba.tag(s) {
            self.mark_event(h);
        }
        let blk = std::mem::replace(&mut self.ck_block[s as usize], NULL_BLOCK);
        if blk == NULL_BLOCK {
            return;
        }
        let mut below = std::mem::take(&mut self.scratch);
        below.clear();
        self.kv.tree().checkpoints_directly_below(blk, &mut below);
        let up = self.ck_parent_pos[s as usize];
        for &c in &below {
            self.ck_parent_pos[c as usize] = up;
        }
        below.clear();
        self.scratch = below;
        self.kv.detach_checkpoint(blk);
    }

    /// KV allocation that keeps the checkpoints consistent with evicted blocks. With `flops`
    /// eviction, when the free blocks that no hit can use do not suffice, the checkpoints whose
    /// paths are worth least go first (by the same score), instead of the LRU cached block.
    fn allocate_blocks(&mut self, req_blocks: &mut Vec<BlockId>, n: usize) -> bool {
        if self.eviction == EvictionPolicy::Flops && self.checkpoints() {
            while self.kv.num_free() >= n && self.kv.num_free() - self.kv.num_useful_free() < n {
                let frees_a_block = |s: &SlotId| {
                    let blk = self.ck_block[*s as usize];
                    blk != NULL_BLOCK && self.kv.is_free(blk) && self.kv.tree().below(blk) == 1
                };
                let superseded = self.mamba.superseded_evictable().find(frees_a_block);
                let Some(v) = superseded.or_else(|| self.flops_victim(true)) else {
                    break;
                };
                self.detach(v);
                self.learn_outcome(v);
                if !self.mamba.evict(v) {
                    break;
                }
                self.evictions_for_kv += 1;
            }
        }
        let mut gone = Vec::new();
        let ok = self.kv.allocate(n, req_blocks, |h| gone.push(h));
        for h in gone {
            self.mark_event(h);
            // The pool detached the checkpoint from the tree with the block: it is stale now.
            if let Some(s) = self.mamba.checkpoint_for(h) {
                self.ck_block[s as usize] = NULL_BLOCK;
                self.mamba.set_stale(s, true);
            }
        }
        ok
    }

    // ------------------------------------------------------------------ allocation

    /// Whether the KV blocks that admitting with `hit` takes at once (the hit's blocks, the tail
    /// it copies from, and the new blocks for `num_new_tokens`) fit in the whole pool: a hit that
    /// does not can never be admitted, whatever is freed.
    pub fn hit_fits_pool(&self, hit: &CacheHit, num_new_tokens: usize) -> bool {
        self.blocks_needed(hit, num_new_tokens, 0)
            .is_some_and(|need| need + usize::from(hit.tail.is_some()) <= self.kv.num_usable())
    }

    /// The blocks a request admitted with `hit` holds for its hit and new tokens (None on
    /// overflow); the hit's tail, copied into the first new block, comes on top.
    fn blocks_needed(
        &self,
        hit: &CacheHit,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Option<usize> {
        let total = hit
            .num_tokens
            .checked_add(num_new_tokens)?
            .checked_add(num_lookahead_tokens)?;
        Some(total.div_ceil(self.block_size).max(hit.kv_blocks.len()))
    }

    /// First allocation of a (new or resumed) request: takes references on the hit blocks,
    /// allocates its state window (1 + K slots) and the KV blocks for
    /// [L, L + num_new_tokens + num_lookahead_tokens). Emits `StateOp::Copy { src: checkpoint,
    /// dst: window[0] }` on a hit, and `StateOp::CopyBlock { src: tail, dst }` for a tail hit.
    /// None if it does not fit, if the request already has an allocation, or if the hit is no
    /// longer valid (re-query then); in every None case nothing was taken. On a model without
    /// Mamba layers the window is `1 + K` null slots.
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
        let n_hit = hit.kv_blocks.len();
        let need = self.blocks_needed(hit, num_new_tokens, num_lookahead_tokens)?;
        let to_alloc = need - n_hit;
        let hit_free = hit
            .kv_blocks
            .iter()
            .chain(hit.tail.iter())
            .filter(|&&x| self.kv.is_free(x))
            .count();
        if self.kv.num_free() < hit_free + to_alloc {
            return None;
        }
        if self.has_mamba {
            // The hit checkpoint itself must not be evicted to make room for the window.
            let ck_evictable = hit.checkpoint.is_some_and(|s| {
                self.mamba.pin_count(s) == 0 && self.mamba.kind(s) == Some(SlotKind::Committed)
            });
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
            pinned_tail: None,
            resumed_from: hit
                .checkpoint
                .filter(|_| hit.kind == Some(CheckpointKind::LastToken))
                .and_then(|s| Some((s, self.mamba.checkpoint_tag(s)?))),
        };
        for &blk in &hit.kv_blocks {
            self.kv.incref(blk);
            st.blocks.push(blk);
        }
        if let Some(t) = hit.tail {
            // Read by the copy before the next forward: not to be evicted or handed out before.
            self.kv.incref(t);
            st.pinned_tail = Some(t);
        }
        if let Some(c) = hit.checkpoint.filter(|_| self.has_mamba) {
            self.mamba.pin(c);
            st.pinned = Some(c);
            self.learn_use(c);
        }
        let resumed = f64::from(u8::from(hit.kind == Some(CheckpointKind::LastToken)));
        self.resume_rate += RESUME_RATE_STEP * (resumed - self.resume_rate);
        let ok = self.allocate_blocks(&mut st.blocks, to_alloc);
        debug_assert!(ok);
        let mut ops = Vec::new();
        if let (Some(t), Some(&dst)) = (hit.tail, st.blocks.get(n_hit)) {
            ops.push(StateOp::CopyBlock { src: t, dst });
        }
        if self.has_mamba {
            let ok = self.make_free_slots(self.window_len, EvictionCause::ForWindow)
                && self.mamba.alloc_window(self.window_len, &mut st.window);
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

    /// Drops the pins of a request's hit copies (they have run).
    fn unpin(&mut self, st_pinned: Option<SlotId>, st_tail: Option<BlockId>) {
        if let Some(c) = st_pinned {
            self.mamba.unpin(c);
        }
        if let Some(t) = st_tail {
            self.kv.release(&[t]);
        }
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
        // The step that carried the hit copies has run: the sources are no longer read.
        let (pinned, tail) = (st.pinned.take(), st.pinned_tail.take());
        self.unpin(pinned, tail);
        let total = num_computed_tokens
            .checked_add(num_new_tokens)?
            .checked_add(num_lookahead_tokens)?;
        let need = total.div_ceil(self.block_size);
        let st = self.reqs.get_mut(&req)?;
        if need <= st.blocks.len() {
            return Some(());
        }
        let mut blocks = std::mem::take(&mut st.blocks);
        let have = blocks.len();
        let ok = self.allocate_blocks(&mut blocks, need - have);
        if let Some(st) = self.reqs.get_mut(&req) {
            st.blocks = blocks;
        }
        ok.then_some(())
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
    /// `prefix.tokens` are what the KV cache events say the blocks hold.
    pub fn cache_full_blocks(
        &mut self,
        req: ReqKey,
        prefix: Prefix<'_>,
        num_accepted_tokens: usize,
    ) {
        let block_hashes = prefix.hashes;
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
        st.num_cached_blocks = st.num_cached_blocks.max(n);
        let blocks: Vec<BlockId> = st.blocks[start..n].to_vec();
        for (i, blk) in (start..n).zip(blocks) {
            let h = block_hashes[i];
            let parent = i.checked_sub(1).map(|p| block_hashes[p]);
            if self.kv.block_hash(blk).is_none() && self.kv.cache_block(blk, h, parent) {
                let b = self.block_size;
                let tokens = prefix.tokens.get(i * b..(i + 1) * b).unwrap_or(&[]);
                self.describe_event(prefix.root, h, parent, tokens, (i + 1) * b);
                // A checkpoint that went stale when an earlier copy of this block was evicted
                // can hit again.
                if let Some(s) = self.mamba.lookup(h) {
                    if self.ck_block[s as usize] == NULL_BLOCK {
                        self.attach(s);
                    }
                }
            }
        }
    }

    /// A pending checkpoint for the state after `position` tokens (a positive multiple of B),
    /// keyed by `hash` (block_hashes[position / B - 1]), evicting by the policy to make room.
    /// None if a committed/pending checkpoint for that hash already exists, nothing can be
    /// evicted, the position is not a positive multiple of B (of M for a grid checkpoint), or
    /// the mode takes no checkpoints.
    pub fn reserve_checkpoint(
        &mut self,
        hash: BlockHash,
        position: usize,
        kind: CheckpointKind,
    ) -> Option<SlotId> {
        if !self.checkpoint_room(hash, position, kind) {
            return None;
        }
        self.mamba.reserve(CheckpointTag {
            hash,
            position,
            kind,
        })
    }

    /// Turns window slot `index` of request `req`, which its finished forward wrote with the
    /// state after `position` tokens, into a committed checkpoint keyed by `hash`: a hit at once,
    /// with no copy. For a request that ends in this update (call before `free`): a pending copy
    /// would wait for a next step, which an idle engine does not run, and the follow-up admitted
    /// before it would miss the state. False (nothing kept) on the grounds `reserve_checkpoint`
    /// gives None, or if the request has no such window slot.
    pub fn adopt_window_checkpoint(
        &mut self,
        req: ReqKey,
        index: usize,
        hash: BlockHash,
        position: usize,
        kind: CheckpointKind,
    ) -> bool {
        let Some(&slot) = self.reqs.get(&req).and_then(|st| st.window.get(index)) else {
            return false;
        };
        if !self.checkpoint_room(hash, position, kind) {
            return false;
        }
        let tag = CheckpointTag {
            hash,
            position,
            kind,
        };
        if !self.mamba.adopt(slot, tag) {
            return false;
        }
        self.attach(slot);
        true
    }

    /// For a request about to be freed between steps (call before `free`): the pending
    /// checkpoint `dst`, reserved to be copied from its window slot `src` at the start of the
    /// next step, which an idle engine does not run, is kept on `src` itself instead (as
    /// `adopt_window_checkpoint`). `dst` is given back either way; false if nothing was kept.
    pub fn adopt_pending_publish(&mut self, req: ReqKey, src: SlotId, dst: SlotId) -> bool {
        let tag = self.mamba.checkpoint_tag(dst);
        self.cancel_checkpoint(dst);
        let (Some(tag), Some(index)) = (tag, self.state_window(req).iter().position(|&s| s == src))
        else {
            return false;
        };
        self.adopt_window_checkpoint(req, index, tag.hash, tag.position, tag.kind)
    }

    /// Whether a checkpoint of `kind` for the state after `position` tokens may be kept under
    /// `hash`, having evicted by the policy to make room for it (see `reserve_checkpoint`).
    fn checkpoint_room(&mut self, hash: BlockHash, position: usize, kind: CheckpointKind) -> bool {
        let step = match kind {
            CheckpointKind::Grid => self.mamba_block_size,
            CheckpointKind::Branch | CheckpointKind::LastToken | CheckpointKind::Declared => {
                self.block_size
            }
        };
        if !self.checkpoints() || position == 0 || position % step != 0 {
            return false;
        }
        if self.mamba.has_checkpoint(hash) {
            return false;
        }
        // Beside branch points and last tokens, grid checkpoints are a bet on a sharer to come
        // that nothing tells of yet: they take spare room, or the place of another grid
        // checkpoint, never that of a checkpoint placed for a reason (but for last-token states
        // that admissions do not resume). A declared shared prefix is a bet too: a prompt without
        // a system message declares its first user message, which nobody else may send.
        let bet = matches!(kind, CheckpointKind::Grid | CheckpointKind::Declared);
        if bet && self.placement.branch() {
            self.make_grid_room(kind)
        } else {
            self.make_checkpoint_room()
        }
    }

    /// The forward that wrote the pending checkpoint `slot` has finished: it becomes a hit.
    pub fn commit_checkpoint(&mut self, slot: SlotId) {
        if self.mamba.kind(slot) != Some(SlotKind::Pending) {
            return;
        }
        self.mamba.commit(slot);
        self.attach(slot);
    }

    /// The pending checkpoint `slot` was never written (request aborted / rejected).
    pub fn cancel_checkpoint(&mut self, slot: SlotId) {
        self.mamba.cancel(slot);
    }

    /// Keeps the state of a running request after its first `num_computed` tokens (its live
    /// window slot `live_index`, written by a finished forward) as a `LastToken` checkpoint, so
    /// that a later prompt extending this sequence hits all of it. When `num_computed` is not a
    /// multiple of B, the partly filled block is registered as a tail entry keyed by its exact
    /// tokens. Call before `free`. False (nothing kept) when the placement or mode keeps no such
    /// checkpoint, one exists for that prefix, or there is no room.
    pub fn keep_last_state(
        &mut self,
        req: ReqKey,
        prefix: Prefix<'_>,
        num_computed: usize,
        live_index: usize,
    ) -> bool {
        if !self.checkpoints() || !self.placement.branch() || num_computed == 0 {
            return false;
        }
        if self.eviction == EvictionPolicy::Flops && !self.last_state_worth_keeping() {
            return false;
        }
        let b = self.block_size;
        let (f, t) = (num_computed / b, num_computed % b);
        let Some(st) = self.reqs.get(&req) else {
            return false;
        };
        let Some(&slot) = st.window.get(live_index) else {
            return false;
        };
        let hash = if t == 0 {
            match prefix.hashes.get(f - 1) {
                Some(&h) if self.kv.contains(h) => h,
                _ => return false,
            }
        } else {
            if prefix.tokens.len() < num_computed || prefix.hashes.len() < f {
                return false;
            }
            let parent = if f == 0 {
                prefix.root
            } else {
                prefix.hashes[f - 1]
            };
            let h = self
                .hasher
                .hash_block(parent, &prefix.tokens[f * b..num_computed]);
            if self.mamba.has_checkpoint(h) {
                return false;
            }
            if !self.kv.contains(h) {
                let Some(&blk) = st.blocks.get(f) else {
                    return false;
                };
                if !self.kv.cache_tail(blk, h, parent, f == 0) {
                    return false;
                }
                let tokens = &prefix.tokens[f * b..num_computed];
                self.describe_event(
                    prefix.root,
                    h,
                    (f > 0).then_some(parent),
                    tokens,
                    num_computed,
                );
            }
            h
        };
        if self.mamba.has_checkpoint(hash) || !self.make_checkpoint_room() {
            return false;
        }
        let tag = CheckpointTag {
            hash,
            position: num_computed,
            kind: CheckpointKind::LastToken,
        };
        if !self.mamba.adopt(slot, tag) {
            return false;
        }
        self.attach(slot);
        // The state this residency resumed from is the same sequence, shorter: a continuation
        // will want the new one. (Only the FLOP-aware policy acts on it; LRU baselines do not.)
        let resumed = self.reqs.get(&req).and_then(|st| st.resumed_from);
        if let Some((old, old_tag)) = resumed.filter(|_| self.eviction == EvictionPolicy::Flops) {
            if self.mamba.checkpoint_tag(old) == Some(old_tag) && old_tag.position < num_computed {
                self.mamba.set_superseded(old);
            }
        }
        true
    }

    /// Frees the request's window and KV blocks (cached blocks stay cached, ref 0, in LRU; the
    /// tail blocks are evicted first). Its committed checkpoints stay. Unknown ids are ignored.
    pub fn free(&mut self, req: ReqKey) {
        let Some(st) = self.reqs.remove(&req) else {
            return;
        };
        self.kv.release(&st.blocks);
        // An adopted slot is a checkpoint now: free_window skips it.
        self.mamba.free_window(&st.window);
        self.unpin(st.pinned, st.pinned_tail);
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
        self.ck_block.fill(NULL_BLOCK);
        self.ck_parent_pos.fill(0);
        self.ck_consumed.fill(false);
        kv_ok && mamba_ok
    }

    pub fn stats(&self) -> CacheStats {
        let ckpts = self.mamba.num_committed() + self.mamba.num_pending();
        let mut by_kind = [0usize; CheckpointKind::COUNT];
        for s in 1..self.mamba.num_slots() as SlotId {
            if self.mamba.kind(s) == Some(SlotKind::Committed) {
                if let Some(t) = self.mamba.checkpoint_tag(s) {
                    by_kind[t.kind.index()] += 1;
                }
            }
        }
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
            checkpoints_by_kind: by_kind,
            checkpoint_bytes: (ckpts as u64).saturating_mul(self.cost.state_bytes),
            queried_tokens: self.queried_tokens,
            hit_tokens: self.hit_tokens,
            kv_hit_tokens: self.kv_hit_tokens,
            lost_tokens: self.lost_tokens,
            kv_evictions: self.kv.evictions(),
            kv_evictions_useless: self.kv.useless_evictions(),
            checkpoint_evictions: self.mamba.evictions(),
            checkpoint_evictions_stale: self.evictions_stale,
            checkpoint_evictions_for_checkpoint: self.evictions_for_checkpoint,
            checkpoint_evictions_for_window: self.evictions_for_window,
            checkpoint_evictions_for_kv: self.evictions_for_kv,
            checkpoint_reuse_rate: self.reuse_rate,
        }
    }

    /// `(hash, position)` of a pending or committed checkpoint slot (for tests).
    pub fn debug_tag(&self, slot: SlotId) -> Option<(BlockHash, usize)> {
        self.mamba.tag(slot)
    }

    /// The fallback position the `flops` score uses for checkpoint `slot` (for tests).
    pub fn debug_parent_position(&self, slot: SlotId) -> usize {
        self.ck_parent_pos.get(slot as usize).copied().unwrap_or(0)
    }
}

/// (min, max) of a non-empty sequence.
fn min_max(xs: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    xs.fold(None, |acc, x| match acc {
        None => Some((x, x)),
        Some((lo, hi)) => Some((lo.min(x), hi.max(x))),
    })
}

#[cfg(test)]
#[path = "cache_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "cache_proptest.rs"]
mod proptests;
