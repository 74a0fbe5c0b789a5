//! Continuous batching: running requests first (decodes, then unfinished chunked prefills), then
//! waiting ones with their prefix hits; chunked prefill under a token budget; checkpoint
//! placement; speculative bookkeeping; preemption by recompute; aborts. The design:
//! docs/architecture.md ("One engine step"), docs/prefix-caching.md, docs/cache-modes.md,
//! docs/speculative-decoding.md.
//!
//! Checkpoint placement (`CheckpointPlacement`):
//! - branch points: when a prompt's cached KV prefix reaches past its state hit (a prefix an
//!   earlier request computed, with no state kept at its end), the state at the deepest cached
//!   block is kept for the next sharer: mode `all` emits it from inside the prefill row, mode
//!   `align` ends a chunk there;
//! - declared shared prefixes: a request that declares how much of its prompt others will share
//!   (`NewRequest::shared_prefix_len`: a chat's system message) keeps the state at that prefix's
//!   last whole block when its hit ends before it, so the second sharer already hits it;
//! - last tokens: a finished (or preempted, or stop-string-finished) request keeps the state after
//!   its last computed token, so a prompt extending the sequence (the next turn of a chat) hits
//!   all of it;
//! - grid: every multiple of `mamba_block_size` (`all`: emitted inside chunks; `align`: chunks end
//!   on it) and decode steps whose accepted tokens cross one (published by a copy next step).

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::block_hash::BlockHasher;
use crate::cache::{
    CacheHit, CacheStats, CheckpointKind, HybridCacheManager, ReqKey, SlotId, StateOp,
};
use crate::config::{
    CheckpointPlacement, MambaCacheMode, ResolvedConfig, MAX_KV_BLOCKS, MAX_MAMBA_SLOTS,
};
use crate::error::{HsError, HsResult};
use crate::output::{RowInfo, SchedulerOutput};
use crate::request::{FinishReason, NewRequest, Request, RequestStatus};

/// A fast hasher for the scheduler's own sequential numeric keys (never user input).
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

type KeyMap<V> = HashMap<ReqKey, V, BuildHasherDefault<KeyHasher>>;

/// What one step changed for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestDelta {
    pub request_id: Arc<str>,
    pub new_token_ids: Vec<u32>,
    pub finished: bool,
    pub finish_reason: Option<FinishReason>,
    /// The EOS/stop token that ended the request (it is the last of `new_token_ids`).
    pub stop_token_id: Option<u32>,
    pub num_cached_tokens: usize,
}

/// Figures for metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Requests now waiting after a preemption.
    pub num_preempted: usize,
    pub num_preemptions_total: u64,
    pub num_steps: u64,
    pub num_scheduled_tokens_last: usize,
    pub num_scheduled_tokens_total: u64,
    pub num_finished_total: u64,
    pub num_aborted_total: u64,
    /// Prefix cache, counted once per admission that may read the cache (not a request for
    /// prompt logprobs, none with prefix caching off): tokens looked up, served, and lost (the KV
    /// pool alone had more than the hybrid hit).
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_lost_tokens: u64,
    /// The part of the two above from admissions of preempted requests (vLLM counts a
    /// preempted request's lookup apart: a victim that finds its own blocks again is no hit of
    /// sharing).
    pub prefix_preempted_queried_tokens: u64,
    pub prefix_preempted_hit_tokens: u64,
    /// Hits and hit tokens by where the checkpoint came from (`CheckpointKind::index`).
    pub prefix_hits_by_kind: [u64; CheckpointKind::COUNT],
    pub prefix_hit_tokens_by_kind: [u64; CheckpointKind::COUNT],
    /// Prefill FLOPs of all admitted prompts, those that made no query too, and those their hits
    /// saved (the cost model's).
    pub prefill_flops_queried: f64,
    pub prefill_flops_saved: f64,
    /// Last-token checkpoints kept by finished and preempted requests.
    pub checkpoints_kept: u64,
    pub spec_drafted_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub checkpoints_emitted: u64,
    pub checkpoints_published: u64,
    pub cache: CacheStats,
}

#[derive(Debug, Clone, Copy)]
struct Planned {
    key: ReqKey,
    num_new: usize,
    num_drafts: usize,
    is_decode: bool,
}

/// How many requests at the head of the waiting queue a step looks at for prompts short enough to
/// finish their prefill in it (each costs a prefix-cache lookup).
const SHORT_PROMPT_LOOKAHEAD: usize = 8;

/// The scheduler. Synchronous and deterministic: the same calls give the same schedule.
#[derive(Debug)]
pub struct Scheduler {
    cfg: ResolvedConfig,
    cache: HybridCacheManager,
    requests: KeyMap<Request>,
    ids: HashMap<String, ReqKey>,
    /// (priority, arrival, key): lower priority values first, then FCFS.
    waiting: BTreeSet<(i64, u64, ReqKey)>,
    /// Admission order.
    running: Vec<ReqKey>,
    next_key: ReqKey,
    next_arrival: u64,
    next_step: u64,
    in_flight: Option<u64>,
    /// (window slot, checkpoint) publishes found in the last update; the next step copies them
    /// first thing.
    pending_publishes: Vec<(SlotId, SlotId)>,
    finished_ids: Vec<String>,
    /// Deltas of requests finished inside `schedule()` (cannot fit), returned by the next update.
    pending_deltas: Vec<RequestDelta>,
    prefix_caching: bool,
    checkpoints: bool,
    align: bool,
    placement: CheckpointPlacement,
    usable_kv_blocks: usize,
    /// The id of the step planned while the one in flight runs (`schedule_ahead`), until
    /// confirmed; its output carries its rows.
    ahead: Option<u64>,
    stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(
        cfg: &ResolvedConfig,
        num_kv_blocks: usize,
        num_mamba_slots: usize,
        hash_seed: u64,
    ) -> HsResult<Self> {
        let bad = |m: String| Err(HsError::Config(m));
        if cfg.block_size == 0 {
            return bad("block_size must be positive".into());
        }
        if cfg.max_num_batched_tokens == 0 || cfg.max_num_seqs == 0 || cfg.max_model_len < 2 {
            return bad(
                "max_num_batched_tokens, max_num_seqs must be positive and max_model_len >= 2"
                    .into(),
            );
        }
        if num_kv_blocks < 2 {
            return bad(format!("num_kv_blocks is {num_kv_blocks}; at least 2 are needed (block 0 is the null block)"));
        }
        if num_kv_blocks > MAX_KV_BLOCKS || num_mamba_slots > MAX_MAMBA_SLOTS {
            return bad(format!(
                "{num_kv_blocks} KV blocks and {num_mamba_slots} Mamba slots: at most \
                 {MAX_KV_BLOCKS} blocks and {MAX_MAMBA_SLOTS} slots"
            ));
        }
        let checkpoints = cfg.has_mamba_layers
            && cfg.enable_prefix_caching
            && cfg.mamba_cache_mode != MambaCacheMode::None;
        if checkpoints && (cfg.mamba_block_size == 0 || cfg.mamba_block_size % cfg.block_size != 0)
        {
            return bad(format!(
                "mamba_block_size ({}) must be a positive multiple of block_size ({})",
                cfg.mamba_block_size, cfg.block_size
            ));
        }
        if cfg.has_mamba_layers && num_mamba_slots < 1 + cfg.state_window_len() {
            return bad(format!(
                "num_mamba_slots is {num_mamba_slots}; a request's state window needs {} slots plus the null slot",
                cfg.state_window_len()
            ));
        }
        let align = checkpoints && cfg.mamba_cache_mode == MambaCacheMode::Align;
        if align && cfg.mamba_block_size > cfg.max_num_batched_tokens {
            return bad(format!(
                "align mode needs mamba_block_size ({}) <= max_num_batched_tokens ({})",
                cfg.mamba_block_size, cfg.max_num_batched_tokens
            ));
        }
        Ok(Scheduler {
            cfg: cfg.clone(),
            cache: HybridCacheManager::with_hasher(
                cfg,
                num_kv_blocks,
                num_mamba_slots,
                BlockHasher::new(hash_seed),
            ),
            requests: KeyMap::default(),
            ids: HashMap::new(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            next_key: 1,
            next_arrival: 0,
            next_step: 1,
            in_flight: None,
            pending_publishes: Vec::new(),
            finished_ids: Vec::new(),
            pending_deltas: Vec::new(),
            prefix_caching: cfg.enable_prefix_caching,
            checkpoints,
            align,
            placement: cfg.checkpoint_placement,
            usable_kv_blocks: num_kv_blocks - 1,
            ahead: None,
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    pub fn cache(&self) -> &HybridCacheManager {
        &self.cache
    }

    /// Adds a request to the waiting queue.
    pub fn add_request(&mut self, new: NewRequest) -> HsResult<()> {
        Request::validate(&new, self.cfg.max_model_len)?;
        // (an id whose finish is decided but not yet reported is still in use: the next
        // update would report the new request as finished)
        if self.ids.contains_key(&new.request_id)
            || self
                .pending_deltas
                .iter()
                .any(|d| &*d.request_id == new.request_id.as_str())
        {
            return Err(HsError::InvalidRequest(format!(
                "request id {:?} is already in use",
                new.request_id
            )));
        }
        let need = (new.prompt_token_ids.len() + 1).div_ceil(self.cfg.block_size);
        if need > self.usable_kv_blocks {
            return Err(HsError::InvalidRequest(format!(
                "request {:?}: the prompt needs {need} KV blocks; the cache has {}",
                new.request_id, self.usable_kv_blocks
            )));
        }
        if !self.cfg.enable_chunked_prefill
            && new.prompt_token_ids.len() > self.cfg.max_num_batched_tokens
        {
            return Err(HsError::InvalidRequest(format!(
                "request {:?}: the prompt has {} tokens, more than max_num_batched_tokens ({}) with chunked prefill off",
                new.request_id,
                new.prompt_token_ids.len(),
                self.cfg.max_num_batched_tokens
            )));
        }
        let key = self.next_key;
        self.next_key += 1;
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let mut req = Request::new(key, arrival, new);
        if self.prefix_caching {
            let hasher = self.cache.hasher();
            req.root_hash = hasher.root(req.cache_salt.as_deref());
            req.update_hashes(hasher, self.cfg.block_size);
        }
        self.ids.insert(req.id.to_string(), key);
        self.waiting.insert((req.priority, req.arrival, key));
        self.requests.insert(key, req);
        Ok(())
    }

    /// Aborts a request in any state, freeing everything it holds. False if the id is unknown
    /// (never added, or already finished).
    pub fn abort_request(&mut self, request_id: &str) -> bool {
        let found = self.remove_request(request_id, false);
        if found {
            self.stats.num_aborted_total += 1;
        }
        found
    }

    /// Ends a request that finished outside the scheduler (the engine matched a stop string in
    /// its text): frees it like an abort, but counts it as finished. False if the id is unknown.
    pub fn finish_request(&mut self, request_id: &str) -> bool {
        let found = self.remove_request(request_id, true);
        if found {
            self.stats.num_finished_total += 1;
        }
        found
    }

    /// Removes a request in any state. `finished`: it ended normally (its last state is worth
    /// keeping for a continuation); otherwise it was aborted.
    fn remove_request(&mut self, request_id: &str, finished: bool) -> bool {
        let Some(key) = self.ids.remove(request_id) else {
            return false;
        };
        let Some(req) = self.requests.remove(&key) else {
            return false;
        };
        match req.status {
            RequestStatus::Waiting | RequestStatus::Preempted => {
                self.waiting.remove(&(req.priority, req.arrival, key));
                if req.status == RequestStatus::Preempted {
                    self.stats.num_preempted = self.stats.num_preempted.saturating_sub(1);
                }
            }
            RequestStatus::Running => {
                // Between steps the live window slot holds the state after exactly the computed
                // tokens (with a step in flight it may be half written).
                let between_steps = self.in_flight.is_none();
                let live = self
                    .cache
                    .state_window(key)
                    .get(req.live_window_index)
                    .copied();
                // (a publish of the live slot itself, the last computed token being a grid point,
                // gives way to the last-token state, as when the scheduler ends a request there)
                let keep_live = if finished && between_steps {
                    live
                } else {
                    None
                };
                let live_was_published = self.settle_publishes_of(key, between_steps, keep_live);
                if live_was_published {
                    // (its publish, counted when it was reserved, is given back: what keeps the
                    // slot below counts it again, as the one kind it becomes)
                    self.stats.checkpoints_published =
                        self.stats.checkpoints_published.saturating_sub(1);
                }
                if keep_live.is_some() && !self.keep_last_state(key, &req) && live_was_published {
                    self.keep_last_boundary(key, &req);
                }
                self.cache.free(key);
                self.running.retain(|&k| k != key);
            }
            RequestStatus::Finished(_) => {}
        }
        self.finished_ids.push(req.id.to_string());
        true
    }

    /// The publishes of the last update that copy from `key`'s window, which is about to be
    /// freed (a stop string or an abort ended the request after the update that reached a grid
    /// point): waiting for the next step, they would hold their checkpoints pending while the
    /// engine is idle, and the next turn, admitted before that step, would miss them. Between
    /// steps (`adopt`) each window slot, written by the committed step, becomes its checkpoint,
    /// but for `keep_back` (the live slot, kept by the caller as the request's last state),
    /// whose reserved checkpoint is given back: true if it had one. (With a step in flight there
    /// are no publishes: `schedule()` takes them, and a step is planned ahead only without any;
    /// were there one, its checkpoint would be given back.)
    fn settle_publishes_of(&mut self, key: ReqKey, adopt: bool, keep_back: Option<SlotId>) -> bool {
        let window = self.cache.state_window(key).to_vec();
        let mut kept = Vec::with_capacity(self.pending_publishes.len());
        let mut kept_back = false;
        for (src, dst) in std::mem::take(&mut self.pending_publishes) {
            if !window.contains(&src) {
                kept.push((src, dst));
            } else if adopt && Some(src) != keep_back {
                self.cache.adopt_pending_publish(key, src, dst);
            } else {
                kept_back |= Some(src) == keep_back;
                self.cache.cancel_checkpoint(dst);
            }
        }
        self.pending_publishes = kept;
        kept_back
    }

    /// True while any request is waiting or running, or a finish decided inside `schedule()`
    /// has not been returned by `update_from_output` yet.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty() || !self.pending_deltas.is_empty()
    }

    /// Per-slot state size in bytes (all Mamba layers), for the checkpoint_bytes figure.
    pub fn set_state_bytes_per_slot(&mut self, n: usize) {
        self.cache.set_state_bytes_per_slot(n);
    }

    /// The model's sizes and FLOPs for eviction and the FLOP counters; `flop_weight` overrides the
    /// weight of FLOP efficiency against recency in the `flops` eviction score.
    pub fn set_cost_model(&mut self, cost: crate::cache::CostModel, flop_weight: Option<f64>) {
        self.cache.set_cost_model(cost);
        if let Some(w) = flop_weight {
            self.cache.set_flop_weight(w);
        }
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn get_request(&self, request_id: &str) -> Option<&Request> {
        self.ids.get(request_id).and_then(|k| self.requests.get(k))
    }

    /// Prompt + output so far.
    pub fn get_token_ids(&self, request_id: &str) -> Option<&[u32]> {
        self.get_request(request_id)
            .map(|r| r.all_token_ids.as_slice())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.in_flight.is_some() || self.cache.holds_requests() {
            return false;
        }
        self.ahead = None;
        // The publishes of the last update (a request that finished on a checkpoint boundary)
        // would copy into their reserved checkpoints at the start of the next step: with every
        // checkpoint dropped they are moot. Kept, they would make a reset of an idle engine fail.
        for (_, dst) in self.pending_publishes.drain(..) {
            self.cache.cancel_checkpoint(dst);
        }
        self.cache.reset_prefix_cache()
    }

    /// Starts recording KV cache events (`take_kv_events`; docs/kv-events.md).
    pub fn enable_kv_events(&mut self) {
        self.cache.enable_events();
    }

    /// The KV cache events since the last call (empty unless enabled).
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        self.cache.take_events()
    }

    pub fn stats(&self) -> SchedulerStats {
        let mut s = self.stats.clone();
        s.num_running = self.running.len();
        s.num_waiting = self.waiting.len();
        s.cache = self.cache.stats();
        s
    }

    /// Keeps the running request's state after its computed tokens as a last-token checkpoint
    /// (placement permitting). Call before freeing its cache. Whether it was kept.
    fn keep_last_state(&mut self, key: ReqKey, req: &Request) -> bool {
        if !self.checkpoints || !self.placement.branch() {
            return false;
        }
        let kept = self.cache.keep_last_state(
            key,
            req.prefix(),
            req.num_computed_tokens,
            req.live_window_index,
        );
        if kept {
            self.stats.checkpoints_kept += 1;
        }
        kept
    }

    /// Keeps a finished request's live window slot as the grid checkpoint at its last computed
    /// token (a boundary), for a request whose last state was not kept. Call before freeing its
    /// cache.
    fn keep_last_boundary(&mut self, key: ReqKey, req: &Request) {
        let (b, pos) = (self.cfg.block_size, req.num_computed_tokens);
        let Some(&hash) = (pos / b)
            .checked_sub(1)
            .and_then(|i| req.block_hashes.get(i))
        else {
            return;
        };
        if self.cache.adopt_window_checkpoint(
            key,
            req.live_window_index,
            hash,
            pos,
            CheckpointKind::Grid,
        ) {
            self.stats.checkpoints_published += 1;
        }
    }

    // ---------------------------------------------------------------- schedule

    /// Ends a prefill chunk [start, start + n) of a request with `known` tokens on a multiple of M
    /// (align mode with grid checkpoints): the chunk that reaches `known` is cut at the last
    /// boundary before it, so that the state there is captured. 0 = cannot advance this step.
    fn align_chunk(&self, start: usize, n: usize, known: usize) -> usize {
        if !self.align || !self.placement.grid() || n == 0 {
            return n;
        }
        let m = self.cfg.mamba_block_size;
        let end = start + n;
        if end >= known {
            let last = known / m * m;
            if last > start && last < known {
                return last - start;
            }
            return n;
        }
        (end / m * m).saturating_sub(start)
    }

    /// Where a newly admitted request keeps a checkpoint for later sharers, from its hit: when the
    /// cached KV prefix reaches past the state hit (an earlier request computed the prefix and no
    /// state was kept at its end), at the deepest cached block (branch placement), or, with grid
    /// checkpoints only and mode `align`, at the deepest M boundary inside it (mode `all` emits
    /// every boundary anyway).
    /// Else, with branch placement, at the last full block of the prefix the request declares
    /// shared (`NewRequest::shared_prefix_len`) when the hit ends before it and the prompt goes on
    /// past it.
    fn branch_target(&self, hit: &CacheHit, req: &Request) -> Option<(usize, CheckpointKind)> {
        if !self.checkpoints {
            return None;
        }
        if hit.kv_hit_tokens <= hit.num_tokens {
            let b = self.cfg.block_size;
            let declared = req.shared_prefix_len.map_or(0, |n| n / b * b);
            let wanted = self.placement.branch()
                && declared > hit.num_tokens
                && declared < req.num_prompt_tokens;
            return wanted.then_some((declared, CheckpointKind::Declared));
        }
        if self.placement.branch() {
            return Some((hit.kv_hit_tokens, CheckpointKind::Branch));
        }
        let m = self.cfg.mamba_block_size;
        let boundary = hit.kv_hit_tokens / m * m;
        (self.align && boundary > hit.num_tokens).then_some((boundary, CheckpointKind::Grid))
    }

    /// Align mode: a chunk [start, start + n) that would run past the request's branch target ends
    /// on it, so that the state there is captured at the chunk end.
    fn branch_cut(&self, start: usize, n: usize, target: Option<(usize, CheckpointKind)>) -> usize {
        match target {
            Some((p, _)) if self.align && p > start && p < start + n => p - start,
            _ => n,
        }
    }

    /// Prefill chunk length for a request at `start` of `known` tokens under `budget`.
    fn prefill_chunk(
        &self,
        start: usize,
        known: usize,
        budget: usize,
        target: Option<(usize, CheckpointKind)>,
    ) -> usize {
        let remaining = known - start;
        let n = remaining.min(budget);
        if !self.cfg.enable_chunked_prefill
            && n < remaining
            && remaining <= self.cfg.max_num_batched_tokens
        {
            return 0;
        }
        let n = self.align_chunk(start, n, known);
        self.branch_cut(start, n, target)
    }

    /// (tokens, drafts, is_decode) for a running request.
    fn plan_running(&self, req: &Request, budget: usize) -> (usize, usize, bool) {
        let known = req.num_tokens();
        let nc = req.num_computed_tokens;
        if nc > 0 && nc + 1 >= known {
            let k = req
                .drafts
                .len()
                .min(self.cfg.num_speculative_tokens())
                .min(
                    req.remaining_output(self.cfg.max_model_len)
                        .saturating_sub(1),
                )
                .min(budget.saturating_sub(1));
            (if budget == 0 { 0 } else { 1 + k }, k, true)
        } else {
            (
                self.prefill_chunk(nc, known, budget, req.branch_at),
                0,
                false,
            )
        }
    }

    /// Plans the row of running request `key` under `budget` (at most `cap` of its tokens),
    /// preempting lower-priority requests while its blocks cannot be allocated.
    fn plan_running_row(
        &mut self,
        key: ReqKey,
        budget: &mut usize,
        cap: usize,
        plan: &mut Vec<Planned>,
    ) {
        let Some(req) = self.requests.get(&key) else {
            return;
        };
        if req.status != RequestStatus::Running {
            return; // preempted earlier in this step
        }
        let (num_new, num_drafts, is_decode) = self.plan_running(req, (*budget).min(cap));
        if num_new == 0 {
            // deferred (align split rounds to zero, or a whole prompt does not fit): held back
            // where the rows planned before it left it too little (a cap that keeps tokens for
            // short waiting prompts has set that already)
            if !is_decode && cap >= *budget {
                if let Some(req) = self.requests.get_mut(&key) {
                    req.held_back = true;
                }
            }
            return;
        }
        let nc = req.num_computed_tokens;
        loop {
            if self.cache.allocate_more(key, nc, num_new, 0).is_some() {
                plan.push(Planned {
                    key,
                    num_new,
                    num_drafts,
                    is_decode,
                });
                *budget -= num_new;
                return;
            }
            match self.pick_victim() {
                Some(v) if v != key => {
                    if let Some(pos) = plan.iter().position(|p| p.key == v) {
                        *budget += plan[pos].num_new;
                        plan.remove(pos);
                    }
                    self.preempt(v);
                }
                _ => {
                    if self.running.len() <= 1 {
                        self.finish_capacity(key);
                    } else {
                        self.preempt(key);
                    }
                    return;
                }
            }
        }
    }

    /// Whether admitting `req` may resume it from a prefix hit: with prefix caching on, unless it
    /// asked to skip hits (prompt logprobs), which a resumed request past its prompt no longer does.
    fn may_hit(&self, req: &Request) -> bool {
        let prompt_done = req.all_token_ids.len() > req.num_prompt_tokens;
        self.prefix_caching && (!req.skip_prefix_hit || prompt_done)
    }

    /// The tokens that the requests at the head of the waiting queue need to finish their prefill
    /// in this step: consecutive requests, in queue order, each of whose whole prefill after its
    /// prefix hit (as it stands now) fits in what `budget` has left, up to the free running places.
    fn short_waiting_tokens(&self, budget: usize) -> usize {
        let places = self.cfg.max_num_seqs.saturating_sub(self.running.len());
        let mut need = 0;
        for &(_, _, key) in self.waiting.iter().take(places.min(SHORT_PROMPT_LOOKAHEAD)) {
            let Some(req) = self.requests.get(&key) else {
                continue;
            };
            let known = req.num_tokens();
            let hit = if self.may_hit(req) {
                self.cache
                    .peek_longest_cache_hit(req.prefix(), known)
                    .num_tokens
            } else {
                0
            };
            let rest = known.saturating_sub(hit);
            if need + rest > budget {
                break;
            }
            need += rest;
        }
        need
    }

    /// The running request to preempt: the lowest priority (largest value), then the newest.
    fn pick_victim(&self) -> Option<ReqKey> {
        self.running
            .iter()
            .filter_map(|k| self.requests.get(k).map(|r| (r.priority, r.arrival, *k)))
            .max()
            .map(|t| t.2)
    }

    fn preempt(&mut self, key: ReqKey) {
        if let Some(req) = self.requests.remove(&key) {
            // Resuming then costs no recompute while the checkpoint survives.
            self.keep_last_state(key, &req);
            self.requests.insert(key, req);
        }
        self.evict_to_waiting(key);
    }

    /// Frees a running request's cache and puts it back in the waiting queue (recompute on resume).
    fn evict_to_waiting(&mut self, key: ReqKey) {
        self.cache.free(key);
        self.running.retain(|&k| k != key);
        if let Some(req) = self.requests.get_mut(&key) {
            req.status = RequestStatus::Preempted;
            req.num_computed_tokens = 0;
            req.drafts.clear();
            req.live_window_index = 0;
            req.held_back = false;
            req.num_preemptions += 1;
            self.waiting.insert((req.priority, req.arrival, key));
            self.stats.num_preempted += 1;
            self.stats.num_preemptions_total += 1;
        }
    }

    /// Finishes a running request that cannot fit in the cache even alone.
    fn finish_capacity(&mut self, key: ReqKey) {
        self.cache.free(key);
        self.running.retain(|&k| k != key);
        if let Some(req) = self.requests.remove(&key) {
            self.ids.remove(&*req.id);
            self.stats.num_finished_total += 1;
            self.pending_deltas.push(RequestDelta {
                request_id: req.id.clone(),
                new_token_ids: Vec::new(),
                finished: true,
                finish_reason: Some(FinishReason::Length),
                stop_token_id: None,
                num_cached_tokens: req.num_cached_tokens,
            });
            self.finished_ids.push(req.id.to_string());
        }
    }

    /// The id of the step scheduled and not yet updated, if any.
    pub fn in_flight_step(&self) -> Option<u64> {
        self.in_flight
    }

    /// Picks the next batch. Call `update_from_output` with the result before the next call
    /// (required for an output with rows; for one without rows it returns pending finishes).
    pub fn schedule(&mut self) -> HsResult<SchedulerOutput> {
        if self.in_flight.is_some() {
            return Err(HsError::Internal(
                "schedule() called before update_from_output() of the previous step".into(),
            ));
        }
        self.ahead = None;
        let mut budget = self.cfg.max_num_batched_tokens;
        let preemptions_before = self.stats.num_preemptions_total;
        let mut plan: Vec<Planned> = Vec::with_capacity(self.running.len() + 8);

        // 1. Running requests: decodes first, then unfinished prefills. A prompt whose prefix hit
        // leaves it a few tokens to compute does not wait for a long prefill's every chunk (below);
        // a prefill that gave way, or that the decode rows left too few tokens to advance, goes
        // first in its next step with the tokens that advance it kept from the decode rows, so
        // none is ever starved (the short requests that keep arriving become decode rows).
        let mut decodes: Vec<ReqKey> = Vec::with_capacity(self.running.len());
        let mut prefills: Vec<ReqKey> = Vec::new();
        let mut held = 0usize;
        for &k in &self.running {
            let Some(r) = self.requests.get(&k) else {
                continue;
            };
            if r.num_computed_tokens > 0 && r.num_computed_tokens + 1 >= r.num_tokens() {
                decodes.push(k);
            } else {
                if r.held_back {
                    // the least that advances it: up to its next multiple of M (align), or
                    // without chunked prefill its whole rest
                    let rest = r.num_tokens().saturating_sub(r.num_computed_tokens);
                    let least = if self.cfg.enable_chunked_prefill {
                        self.cfg.mamba_block_size.max(1)
                    } else {
                        rest
                    };
                    held = held.saturating_add(least.min(rest));
                }
                prefills.push(k);
            }
        }
        let held = held.min(budget);
        budget -= held;
        for key in decodes {
            if budget == 0 {
                break;
            }
            self.plan_running_row(key, &mut budget, usize::MAX, &mut plan);
        }
        budget += held;
        // Running prefills that can finish in this step, and those that gave way in the last one,
        // first (in running order); then the prompts waiting at the head of the queue that can
        // finish theirs keep those tokens out of the share of the longer prefills.
        let mut longer: Vec<ReqKey> = Vec::new();
        for key in prefills {
            let Some(req) = self.requests.get_mut(&key) else {
                continue;
            };
            let rest = req.num_tokens().saturating_sub(req.num_computed_tokens);
            if req.held_back || rest <= budget {
                req.held_back = false;
                if budget > 0 {
                    self.plan_running_row(key, &mut budget, usize::MAX, &mut plan);
                }
            } else {
                longer.push(key);
            }
        }
        // (a step that had to preempt admits no one: nothing to keep tokens for)
        let admits = self.stats.num_preemptions_total == preemptions_before;
        let reserve = if longer.is_empty() || budget == 0 || !admits {
            0
        } else {
            self.short_waiting_tokens(budget)
        };
        for key in longer {
            if let Some(req) = self.requests.get_mut(&key) {
                req.held_back = reserve > 0;
            }
            let cap = budget.saturating_sub(reserve);
            if cap > 0 {
                self.plan_running_row(key, &mut budget, cap, &mut plan);
            }
        }

        // 2. Waiting requests (new and preempted), with their prefix hits; none in a step that
        // had to preempt (memory is short: admitting now would only thrash).
        let mut hit_copies: Vec<StateOp> = Vec::new();
        while budget > 0
            && self.running.len() < self.cfg.max_num_seqs
            && self.stats.num_preemptions_total == preemptions_before
        {
            let Some(&(_, _, key)) = self.waiting.first() else {
                break;
            };
            if !self.requests.contains_key(&key) {
                self.waiting.pop_first();
                continue;
            }
            // A hit can go stale when an earlier allocation of this step evicted its blocks:
            // allocate_new then takes nothing and the hit is queried once more. A hit can also
            // need more blocks at once than the pool holds (its blocks, the tail it copies from
            // and the new blocks the copy goes to): it is given up and the prompt computed
            // again; and should a hit still fail with nothing running (no block will ever be
            // freed for it), the third attempt gives it up too.
            let mut admitted = None;
            for attempt in 0..3 {
                let Some(req) = self.requests.get(&key) else {
                    break;
                };
                let known = req.num_tokens();
                let mut hit = if attempt < 2 && self.may_hit(req) {
                    self.cache.find_longest_cache_hit(req.prefix(), known)
                } else {
                    CacheHit::default()
                };
                if hit.num_tokens >= known {
                    hit = CacheHit::default(); // never expected (L <= num_tokens - 1)
                }
                let mut target = self.branch_target(&hit, req);
                let mut num_new = self.prefill_chunk(hit.num_tokens, known, budget, target);
                if hit.num_tokens > 0 && !self.cache.hit_fits_pool(&hit, num_new) {
                    hit = CacheHit::default();
                    target = self.branch_target(&hit, req);
                    num_new = self.prefill_chunk(0, known, budget, target);
                }
                if num_new == 0 {
                    break;
                }
                match self.cache.allocate_new(key, &hit, num_new, 0) {
                    Some(ops) => {
                        admitted = Some((hit, known, num_new, ops, target));
                        break;
                    }
                    None if attempt == 0 && hit.num_tokens > 0 => continue,
                    None if attempt == 1 && hit.num_tokens > 0 && self.running.is_empty() => {
                        continue
                    }
                    None => break,
                }
            }
            let Some((hit, known, num_new, ops, target)) = admitted else {
                break;
            };
            // (a request that may not read the cache, one asking for prompt logprobs or any with
            // prefix caching off, made no query: counted, it lowered the hit rate, as vLLM's
            // counters do not)
            let queried = self.requests.get(&key).is_some_and(|r| self.may_hit(r));
            let start = hit.num_tokens;
            hit_copies.extend(ops);
            self.waiting.pop_first();
            self.running.push(key);
            let Some(req) = self.requests.get_mut(&key) else {
                continue;
            };
            if req.status == RequestStatus::Preempted {
                self.stats.num_preempted = self.stats.num_preempted.saturating_sub(1);
            }
            req.status = RequestStatus::Running;
            req.num_computed_tokens = start;
            req.live_window_index = 0;
            req.drafts.clear();
            req.branch_at = target;
            if !req.was_admitted {
                req.was_admitted = true;
                req.num_cached_tokens = start;
            }
            if queried {
                self.stats.prefix_queried_tokens += known as u64;
                self.stats.prefix_hit_tokens += start as u64;
                if req.num_preemptions > 0 {
                    self.stats.prefix_preempted_queried_tokens += known as u64;
                    self.stats.prefix_preempted_hit_tokens += start as u64;
                }
            }
            self.stats.prefix_lost_tokens += hit.kv_hit_tokens.saturating_sub(start) as u64;
            if let Some(kind) = hit.kind {
                self.stats.prefix_hits_by_kind[kind.index()] += 1;
                self.stats.prefix_hit_tokens_by_kind[kind.index()] += start as u64;
            }
            let cost = self.cache.cost_model();
            self.stats.prefill_flops_queried += cost.prefill_flops(0, known);
            self.stats.prefill_flops_saved += cost.prefill_flops(0, start);
            plan.push(Planned {
                key,
                num_new,
                num_drafts: 0,
                is_decode: false,
            });
            budget -= num_new;
        }

        let finished_req_ids = std::mem::take(&mut self.finished_ids);
        if plan.is_empty() {
            // Nothing runs: keep the publishes for the next step that does.
            self.stats.num_scheduled_tokens_last = 0;
            return Ok(SchedulerOutput {
                window_len: self.cfg.state_window_len(),
                query_start_loc: vec![0],
                finished_req_ids,
                ..SchedulerOutput::default()
            });
        }
        let step_id = self.next_step;
        self.next_step += 1;
        let mut out = self.build_output(step_id, &plan, hit_copies)?;
        out.finished_req_ids = finished_req_ids;
        self.in_flight = Some(step_id);
        self.stats.num_steps += 1;
        self.stats.num_scheduled_tokens_last = out.num_scheduled_tokens;
        self.stats.num_scheduled_tokens_total += out.num_scheduled_tokens as u64;
        Ok(out)
    }

    fn build_output(
        &mut self,
        step_id: u64,
        plan: &[Planned],
        hit_copies: Vec<StateOp>,
    ) -> HsResult<SchedulerOutput> {
        let nrows = plan.len();
        let num_tokens: usize = plan.iter().map(|p| p.num_new).sum();
        let w = self.cfg.state_window_len();
        let b = self.cfg.block_size;
        let m = self.cfg.mamba_block_size.max(1);
        let max_blocks = plan
            .iter()
            .map(|p| self.cache.block_table(p.key).len())
            .max()
            .unwrap_or(0);
        let total_drafts: usize = plan.iter().map(|p| p.num_drafts).sum();
        let num_decodes = plan.iter().take_while(|p| p.is_decode).count();
        if plan[num_decodes..].iter().any(|p| p.is_decode) {
            return Err(HsError::Internal(
                "decode rows are not first in the batch".into(),
            ));
        }
        let mut out = SchedulerOutput {
            step_id,
            req_ids: Vec::with_capacity(nrows),
            num_decodes,
            input_ids: Vec::with_capacity(num_tokens),
            positions: Vec::with_capacity(num_tokens),
            query_start_loc: Vec::with_capacity(nrows + 1),
            num_computed_tokens: Vec::with_capacity(nrows),
            seq_lens: Vec::with_capacity(nrows),
            slot_mapping: Vec::with_capacity(num_tokens),
            block_table: Vec::with_capacity(nrows * max_blocks),
            max_blocks,
            state_read_slot: Vec::with_capacity(nrows),
            has_initial_state: Vec::with_capacity(nrows),
            state_write_slots: vec![0; nrows * w],
            window_len: w,
            logits_indices: Vec::with_capacity(num_decodes + total_drafts + (nrows - num_decodes)),
            num_logits: Vec::with_capacity(nrows),
            num_draft_tokens: Vec::with_capacity(nrows),
            draft_token_ids: Vec::with_capacity(total_drafts),
            num_scheduled_tokens: num_tokens,
            rows: Vec::with_capacity(nrows),
            ..SchedulerOutput::default()
        };
        // Publishes of the last update first, then the hit copies of this step.
        for (src, dst) in self.pending_publishes.drain(..) {
            out.state_copies.push(src as i64);
            out.state_copies.push(dst as i64);
            out.pending_checkpoints.push(dst);
            out.pending_checkpoint_owners.push(None);
        }
        for op in hit_copies {
            match op {
                StateOp::Copy { src, dst } => {
                    out.state_copies.push(src as i64);
                    out.state_copies.push(dst as i64);
                }
                StateOp::CopyBlock { src, dst } => {
                    out.kv_copies.push(src as i64);
                    out.kv_copies.push(dst as i64);
                }
            }
        }
        let grid = self.placement.grid();
        let mut passed_targets: Vec<ReqKey> = Vec::new();
        out.query_start_loc.push(0);
        for (r, p) in plan.iter().enumerate() {
            let p_key = p.key;
            let Some(req) = self.requests.get(&p.key) else {
                return Err(HsError::Internal("a scheduled request vanished".into()));
            };
            let table = self.cache.block_table(p.key);
            let window = self.cache.state_window(p.key);
            let nc = req.num_computed_tokens;
            let end = nc + p.num_new;
            let qs = out.input_ids.len();
            if p.is_decode {
                out.input_ids
                    .push(req.all_token_ids[req.num_tokens() - 1] as i64);
                out.input_ids
                    .extend(req.drafts[..p.num_drafts].iter().map(|&t| t as i64));
                out.draft_token_ids
                    .extend(req.drafts[..p.num_drafts].iter().map(|&t| t as i32));
            } else {
                out.input_ids
                    .extend(req.all_token_ids[nc..end].iter().map(|&t| t as i64));
            }
            for pos in nc..end {
                let Some(&blk) = table.get(pos / b) else {
                    return Err(HsError::Internal(format!(
                        "block table of request {:?} does not cover position {pos}",
                        req.id
                    )));
                };
                out.positions.push(pos as i64);
                out.slot_mapping.push((blk as usize * b + pos % b) as i64);
            }
            out.query_start_loc.push(out.input_ids.len() as i64);
            out.num_computed_tokens.push(nc as i64);
            out.seq_lens.push(end as i64);
            out.block_table.extend(table.iter().map(|&blk| blk as i64));
            out.block_table.resize((r + 1) * max_blocks, 0);
            if window.len() < w && self.cfg.has_mamba_layers {
                return Err(HsError::Internal(format!(
                    "state window of request {:?} is short",
                    req.id
                )));
            }
            let slot = |i: usize| window.get(i).copied().unwrap_or(0) as i64;
            out.has_initial_state.push(nc > 0);
            out.state_read_slot.push(if nc > 0 {
                slot(req.live_window_index)
            } else {
                0
            });
            let num_logits;
            if p.is_decode {
                for t in 0..p.num_new {
                    out.state_write_slots[r * w + t] = slot(t);
                }
                out.logits_indices
                    .extend((qs..qs + p.num_new).map(|i| i as i64));
                num_logits = p.num_new;
            } else {
                out.state_write_slots[r * w] = slot(0);
                if end == req.num_tokens() {
                    out.logits_indices.push((qs + p.num_new - 1) as i64);
                    num_logits = 1;
                } else {
                    num_logits = 0;
                }
                if self.checkpoints {
                    // (position, kind) of the states this row keeps: its branch target, then
                    // the grid boundaries inside the chunk (only the chunk end in align mode,
                    // every multiple of M in all mode). A position kept twice is reserved once.
                    let mut keep: Vec<(usize, CheckpointKind)> = Vec::new();
                    if let Some((p, kind)) = req.branch_at {
                        if p <= end {
                            passed_targets.push(p_key);
                            if p > nc {
                                keep.push((p, kind));
                            }
                        }
                    }
                    if grid {
                        let first = if self.align { end } else { (nc / m + 1) * m };
                        let mut bnd = first;
                        while bnd <= end {
                            if bnd % m == 0 && bnd > nc {
                                keep.push((bnd, CheckpointKind::Grid));
                            }
                            bnd += m;
                        }
                    }
                    for (pos, kind) in keep {
                        let Some(&hash) = req.block_hashes.get(pos / b - 1) else {
                            continue;
                        };
                        if let Some(ck) = self.cache.reserve_checkpoint(hash, pos, kind) {
                            out.emit_row.push(r as i64);
                            out.emit_token.push((pos - nc - 1) as i64);
                            out.emit_slot.push(ck as i64);
                            out.pending_checkpoints.push(ck);
                            out.pending_checkpoint_owners.push(Some(p_key));
                            self.stats.checkpoints_emitted += 1;
                        }
                    }
                }
            }
            out.num_logits.push(num_logits as i32);
            out.num_draft_tokens.push(p.num_drafts as i32);
            out.req_ids.push(req.id.clone());
            out.rows.push(RowInfo {
                key: p_key,
                num_computed_before: nc,
                num_new_tokens: p.num_new,
                is_decode: p.is_decode,
                num_drafts: p.num_drafts,
                num_logits,
            });
        }
        for key in passed_targets {
            if let Some(req) = self.requests.get_mut(&key) {
                req.branch_at = None;
            }
        }
        Ok(out)
    }

    // ---------------------------------------------------------------- update

    fn validate_update(
        &self,
        out: &SchedulerOutput,
        sampled: &[i32],
        num_sampled: &[i32],
        drafts: Option<(&[i32], &[i32])>,
    ) -> HsResult<()> {
        let bad = |m: String| Err(HsError::InvalidRequest(m));
        if self.in_flight != Some(out.step_id) {
            return bad(
                "update_from_output() got an output that is not the last scheduled step".into(),
            );
        }
        let nrows = out.rows.len();
        if num_sampled.len() != nrows {
            return bad(format!(
                "num_sampled has {} entries for {nrows} rows",
                num_sampled.len()
            ));
        }
        let mut total = 0usize;
        for (r, (&ns, row)) in num_sampled.iter().zip(&out.rows).enumerate() {
            let alive = self
                .requests
                .get(&row.key)
                .is_some_and(|q| q.status == RequestStatus::Running);
            let ok = if !alive {
                // Aborted after schedule(): its tokens, if any, are dropped.
                ns >= 0 && ns as usize <= row.num_logits
            } else if row.is_decode {
                ns >= 1 && ns as usize <= row.num_logits
            } else {
                ns as usize == row.num_logits && ns >= 0
            };
            if !ok {
                return bad(format!(
                    "row {r}: num_sampled is {ns}, the row has {} logits",
                    row.num_logits
                ));
            }
            total += ns as usize;
        }
        if total != sampled.len() {
            return bad(format!(
                "sampled_token_ids has {} tokens, num_sampled sums to {total}",
                sampled.len()
            ));
        }
        if sampled.iter().any(|&t| t < 0) {
            return bad("negative token id in sampled_token_ids".into());
        }
        if let Some((ids, nd)) = drafts {
            if nd.len() != nrows {
                return bad(format!(
                    "num_drafts has {} entries for {nrows} rows",
                    nd.len()
                ));
            }
            if nd.iter().any(|&n| n < 0) {
                return bad("negative entry in num_drafts".into());
            }
            let s: usize = nd.iter().map(|&n| n as usize).sum();
            if s != ids.len() {
                return bad(format!(
                    "draft_token_ids has {} tokens, num_drafts sums to {s}",
                    ids.len()
                ));
            }
            if ids.iter().any(|&t| t < 0) {
                return bad("negative token id in draft_token_ids".into());
            }
        }
        Ok(())
    }

    /// Closes the step of `out` whose forward did not complete (it failed or was interrupted):
    /// nothing it would have written is trusted. Its pending checkpoints (emits and publish copies)
    /// are cancelled instead of committed, and its requests that are still running are preempted
    /// without keeping their state (their windows may be half written): they recompute from their
    /// prefix hits. Returns the finishes decided inside `schedule()` that were pending.
    pub fn cancel_step(&mut self, out: &SchedulerOutput) -> HsResult<Vec<RequestDelta>> {
        let deltas = std::mem::take(&mut self.pending_deltas);
        if out.rows.is_empty() {
            return Ok(deltas);
        }
        if self.in_flight != Some(out.step_id) {
            self.pending_deltas = deltas;
            return Err(HsError::InvalidRequest(
                "cancel_step() got an output that is not the last scheduled step".into(),
            ));
        }
        self.in_flight = None;
        self.ahead = None;
        for &slot in &out.pending_checkpoints {
            self.cache.cancel_checkpoint(slot);
        }
        for row in &out.rows {
            let running = self
                .requests
                .get(&row.key)
                .is_some_and(|r| r.status == RequestStatus::Running);
            if running {
                self.evict_to_waiting(row.key);
            }
        }
        Ok(deltas)
    }

    /// Applies a step's results: tokens (with stop conditions token by token), accepted counts,
    /// live state slots, KV caching of accepted blocks, checkpoint publishes and commits, frees.
    pub fn update_from_output(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[i32],
        num_sampled: &[i32],
        drafts: Option<(&[i32], &[i32])>,
    ) -> HsResult<Vec<RequestDelta>> {
        let mut deltas = std::mem::take(&mut self.pending_deltas);
        if out.rows.is_empty() {
            return Ok(deltas);
        }
        if let Err(e) = self.validate_update(out, sampled, num_sampled, drafts) {
            self.pending_deltas = deltas;
            return Err(e);
        }
        self.in_flight = None;
        deltas.reserve(out.rows.len());
        let max_len = self.cfg.max_model_len;
        let k_max = self.cfg.num_speculative_tokens();
        let b = self.cfg.block_size;
        let m = self.cfg.mamba_block_size.max(1);
        let mut finished: Vec<ReqKey> = Vec::new();
        // finished decode rows whose last computed token is a grid boundary
        let mut final_boundary: Vec<ReqKey> = Vec::new();
        let mut s_off = 0usize;
        let mut d_off = 0usize;
        for (r, row) in out.rows.iter().enumerate() {
            let ns = num_sampled[r] as usize;
            let toks = &sampled[s_off..s_off + ns];
            s_off += ns;
            let row_drafts: &[i32] = match drafts {
                Some((ids, nd)) => {
                    let n = nd[r] as usize;
                    let d = &ids[d_off..d_off + n];
                    d_off += n;
                    d
                }
                None => &[],
            };
            let Some(req) = self.requests.get_mut(&row.key) else {
                continue; // aborted after schedule()
            };
            if req.status != RequestStatus::Running {
                continue;
            }
            let before = row.num_computed_before;
            let mut new_tokens: Vec<u32> = Vec::with_capacity(ns);
            let mut finish = None;
            for &t in toks {
                new_tokens.push(t as u32);
                if let Some(f) = req.append_token(t as u32, max_len) {
                    finish = Some(f);
                    break;
                }
            }
            let after = if row.is_decode {
                self.stats.spec_drafted_tokens += row.num_drafts as u64;
                self.stats.spec_accepted_tokens += (ns - 1) as u64;
                // The state after the last accepted token (fewer than ns when a stop token among
                // the drafts ended the request).
                req.live_window_index = new_tokens.len().max(1) - 1;
                before + new_tokens.len()
            } else {
                req.live_window_index = 0;
                before + row.num_new_tokens
            };
            req.num_computed_tokens = after;
            if self.prefix_caching {
                req.update_hashes(self.cache.hasher(), b);
                self.cache.cache_full_blocks(row.key, req.prefix(), after);
            }
            if row.is_decode && self.checkpoints && self.placement.grid() {
                // Accepted tokens crossed or reached boundaries: the state after p·M tokens is in
                // window[p·M - before - 1]; copy it out first thing next step.
                // A request that ends on a boundary keeps its last state there as a last-token
                // state (branch placement), or, if that is not kept, as a grid checkpoint
                // (`keep_last_boundary`), once it is known which.
                let last = if finish.is_some() && self.placement.branch() {
                    if after % m == 0 {
                        final_boundary.push(row.key);
                    }
                    after - 1
                } else {
                    after
                };
                // A request that ends here keeps the window slot itself as the checkpoint: a
                // copy would wait for a next step, which an idle engine does not run, and the
                // next turn, admitted before it, would miss the state.
                let mut bnd = (before / m + 1) * m;
                while bnd <= last {
                    let idx = bnd - before - 1;
                    let Some(&hash) = req.block_hashes.get(bnd / b - 1) else {
                        break;
                    };
                    if finish.is_some() {
                        if self.cache.adopt_window_checkpoint(
                            row.key,
                            idx,
                            hash,
                            bnd,
                            CheckpointKind::Grid,
                        ) {
                            self.stats.checkpoints_published += 1;
                        }
                    } else if let Some(&src) = self.cache.state_window(row.key).get(idx) {
                        if let Some(dst) =
                            self.cache
                                .reserve_checkpoint(hash, bnd, CheckpointKind::Grid)
                        {
                            self.pending_publishes.push((src, dst));
                            self.stats.checkpoints_published += 1;
                        }
                    }
                    bnd += m;
                }
            }
            req.drafts.clear();
            if finish.is_none() {
                req.drafts
                    .extend(row_drafts.iter().take(k_max).map(|&t| t as u32));
            }
            if !new_tokens.is_empty() || finish.is_some() {
                deltas.push(RequestDelta {
                    request_id: req.id.clone(),
                    new_token_ids: new_tokens,
                    finished: finish.is_some(),
                    finish_reason: finish,
                    stop_token_id: if finish == Some(FinishReason::Stop) {
                        req.stop_token_id
                    } else {
                        None
                    },
                    num_cached_tokens: req.num_cached_tokens,
                });
            }
            if finish.is_some() {
                finished.push(row.key);
            }
        }
        // A checkpoint emitted by a row whose request was aborted during the step is dropped:
        // the engine aborts a request mid-step when its row failed (non-finite logits, a
        // sampling error), and a state written by that row must never be served to anyone.
        for (i, &slot) in out.pending_checkpoints.iter().enumerate() {
            let owner = out.pending_checkpoint_owners.get(i).copied().flatten();
            // (a request that finished in this step is still here: only an abort removes it)
            let owner_gone = owner.is_some_and(|key| !self.requests.contains_key(&key));
            if owner_gone {
                self.cache.cancel_checkpoint(slot);
            } else {
                self.cache.commit_checkpoint(slot);
            }
        }
        if !finished.is_empty() {
            for &key in &finished {
                if let Some(req) = self.requests.remove(&key) {
                    if !self.keep_last_state(key, &req) && final_boundary.contains(&key) {
                        self.keep_last_boundary(key, &req);
                    }
                    self.requests.insert(key, req);
                }
                self.cache.free(key);
                if let Some(req) = self.requests.remove(&key) {
                    self.ids.remove(&*req.id);
                    self.finished_ids.push(req.id.to_string());
                }
                self.stats.num_finished_total += 1;
            }
            self.running.retain(|k| !finished.contains(k));
        }
        Ok(deltas)
    }
}

#[path = "plan_ahead.rs"]
mod plan_ahead;
pub use plan_ahead::AheadPatch;

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
