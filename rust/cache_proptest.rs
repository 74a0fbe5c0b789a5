//! Property test: a random driver plays scheduler and model runner against the cache manager
//! (add / allocate / step with checkpoints / commit or cancel / hit / preempt / finish, adopting
//! a pending publish's window slot or not / reset,
//! with pools small enough to evict), over all three modes, an attention-only model,
//! K in {0, 1, 4}, the three checkpoint placements (grid points; branch points at any block
//! boundary; last-token states kept at finish and preemption, with tail entries) and the three
//! eviction policies. The driver simulates the state memory: every slot holds the token prefix whose
//! state it contains, so a hit is checked for what it really delivers, not only for its tag.
//!
//! Invariants checked after every operation: reference counts equal the number of block tables
//! holding each block; the null block / slot are never handed out; windows are disjoint window
//! slots; every running request's live state slot holds the state after exactly its computed
//! tokens; usage figures add up; a `None` allocation takes nothing. Every hit: L <= n - 1, on the
//! block (and, grid-only, checkpoint) grid unless it is a tail hit, KV blocks carry the request's
//! hashes and hold exactly its KV (a tail block too, after its copy), the checkpoint's debug tag
//! is (hash of the prefix ending at L, L) and its contents are the state after exactly the
//! request's first L tokens (same salt), and the hit is the longest one available. At the end
//! (all requests finished): used = 0 and free + cached = total, no window slot left.
//!
//! KV cache events: the driver mirrors them as a subscriber would (by id, parent and tokens only)
//! and after every operation predicts, for every request without a salt and for every base
//! prompt, the hit the cache would give it now: the prediction must equal the cache's own.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;
use crate::block_hash::BlockHasher;
use crate::config::{CheckpointPlacement, EvictionPolicy, MambaCacheMode, ResolvedConfig};
use crate::kv_events::{external_id, CacheGroup, KvEvent};
use crate::mamba_pool::SlotKind;

const B: usize = 4;
const M: usize = 8;

#[derive(Clone, Debug)]
enum Op {
    Add {
        base: u8,
        extra: u8,
        salt: bool,
    },
    Step {
        pick: u8,
        chunk: u8,
        accept: u8,
        abort_ckpt: bool,
    },
    Preempt {
        pick: u8,
    },
    Finish {
        pick: u8,
        /// A publish of the last update (a checkpoint reserved to be copied from a window slot at
        /// the next step) is adopted as the slot itself before the free, as the scheduler does
        /// for a request that a stop string or an abort ends between steps.
        adopt: bool,
    },
    Settle {
        cancel: bool,
    },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..20, any::<bool>()).prop_map(|(base, extra, salt)| Op::Add { base, extra, salt }),
        8 => (any::<u8>(), 1u8..24, any::<u8>(), prop::bool::weighted(0.15))
            .prop_map(|(pick, chunk, accept, abort_ckpt)| Op::Step { pick, chunk, accept, abort_ckpt }),
        1 => any::<u8>().prop_map(|pick| Op::Preempt { pick }),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(pick, adopt)| Op::Finish { pick, adopt }),
        4 => prop::bool::weighted(0.2).prop_map(|cancel| Op::Settle { cancel }),
        1 => Just(Op::Reset),
    ]
}

/// What a state slot holds: the state after this token prefix (of this salt), or garbage
/// (a state that includes rejected drafts).
type Content = Option<(Option<String>, Vec<u32>)>;

struct Req {
    tokens: Vec<u32>,
    salt: Option<String>,
    hashes: Vec<BlockHash>,
    computed: usize,
    running: bool,
    /// Window index of the live state (a_prev - 1).
    live: usize,
}

struct Driver {
    mamba: bool,
    hybrid: bool,
    branch: bool,
    k: usize,
    max_num_seqs: usize,
    m: HybridCacheManager,
    hasher: BlockHasher,
    reqs: BTreeMap<ReqKey, Req>,
    next_key: ReqKey,
    mem: HashMap<SlotId, Content>,
    /// Reserved checkpoints whose forward has not "finished" yet (committed by `Settle`).
    pending: Vec<SlotId>,
    /// KV memory: per block and offset, a fingerprint of the (salt, token prefix) whose last
    /// token's KV was written there.
    kv_mem: HashMap<BlockId, [u64; B]>,
    token_ctr: u32,
    /// Tail blocks a hit holds until its copy has run (the request's next allocation or free).
    pinned_tail: HashMap<ReqKey, BlockId>,
    /// Hits by checkpoint kind, and tail hits (for the coverage test).
    hits_by_kind: [usize; CheckpointKind::COUNT],
    tail_hits: usize,
    mirror: Mirror,
    /// Nonzero hits predicted from the events (for the coverage test).
    predicted_hits: usize,
    /// Publishes adopted as window slots (for the coverage test).
    adopted: usize,
}

/// A subscriber of the KV cache events that knows only what they say: per group, the announced
/// ids with their parent id and tokens.
/// Announced ids of one group: id -> (parent id, tokens).
type Announced = HashMap<u64, (Option<u64>, Vec<u32>)>;

#[derive(Default)]
struct Mirror {
    groups: [Announced; 2],
}

impl Mirror {
    fn apply(&mut self, events: Vec<KvEvent>) {
        for e in events {
            match e {
                KvEvent::Stored {
                    group,
                    hash,
                    parent,
                    tokens,
                } => {
                    let g = &mut self.groups[group as usize];
                    let old = g.insert(external_id(hash), (parent.map(external_id), tokens));
                    assert!(old.is_none(), "stored twice without a removal");
                }
                KvEvent::Removed { group, hash } => {
                    let old = self.groups[group as usize].remove(&external_id(hash));
                    assert!(old.is_some(), "removed without a store");
                }
                KvEvent::AllCleared => self.groups.iter_mut().for_each(HashMap::clear),
            }
        }
    }

    /// On a hybrid model, every announced block has an announced checkpoint at or below it (a
    /// hit can use it).
    fn check_blocks_useful(&self) {
        let (kv, ck) = (&self.groups[0], &self.groups[1]);
        let mut useful = std::collections::HashSet::new();
        for (&id, (parent, _)) in ck {
            let mut x = if kv.contains_key(&id) {
                Some(id)
            } else {
                *parent
            };
            while let Some(b) = x {
                if !useful.insert(b) {
                    break;
                }
                x = kv.get(&b).and_then(|e| e.0);
            }
        }
        for id in kv.keys() {
            assert!(
                useful.contains(id),
                "block {id} announced with no checkpoint below it"
            );
        }
    }

    fn child(&self, group: CacheGroup, parent: Option<u64>, tokens: &[u32]) -> Option<u64> {
        self.groups[group as usize]
            .iter()
            .find(|(_, (p, t))| *p == parent && t.as_slice() == tokens)
            .map(|(&id, _)| id)
    }

    /// The hit a request of `tokens` gets: the announced full blocks of its prefix, then the
    /// deepest announced checkpoint on them (or in a tail right below one), at most n - 1 tokens;
    /// without Mamba checkpoints (`hybrid` false), the blocks alone.
    fn predict(&self, tokens: &[u32], hybrid: bool) -> usize {
        let max = tokens.len().saturating_sub(1);
        let mut path: Vec<u64> = Vec::new();
        while path.len() < max / B {
            let d = path.len();
            match self.child(
                CacheGroup::Attention,
                path.last().copied(),
                &tokens[d * B..(d + 1) * B],
            ) {
                Some(id) => path.push(id),
                None => break,
            }
        }
        if !hybrid {
            return path.len() * B;
        }
        for d in (0..=path.len()).rev() {
            let parent = d.checked_sub(1).map(|i| path[i]);
            for t in (1..B).rev() {
                let end = d * B + t;
                if end <= max
                    && self
                        .child(CacheGroup::Mamba, parent, &tokens[d * B..end])
                        .is_some()
                {
                    return end;
                }
            }
            if let Some(id) = parent {
                if self.groups[CacheGroup::Mamba as usize].contains_key(&id) {
                    return d * B;
                }
            }
        }
        0
    }
}

fn base_prompt(base: u8) -> Vec<u32> {
    (0..28).map(|i| 100 * (base as u32 + 1) + i).collect()
}

impl Driver {
    fn new(cfg: &ResolvedConfig, kv: usize, slots: usize) -> Self {
        Driver {
            mamba: cfg.has_mamba_layers,
            hybrid: cfg.has_mamba_layers && cfg.mamba_cache_mode != MambaCacheMode::None,
            branch: cfg.checkpoint_placement.branch(),
            k: cfg.num_speculative_tokens(),
            max_num_seqs: cfg.max_num_seqs,
            m: HybridCacheManager::with_hasher(cfg, kv, slots, BlockHasher::new(3)),
            hasher: BlockHasher::new(3),
            reqs: BTreeMap::new(),
            next_key: 1,
            mem: HashMap::new(),
            pending: Vec::new(),
            kv_mem: HashMap::new(),
            token_ctr: 50_000,
            pinned_tail: HashMap::new(),
            hits_by_kind: [0; CheckpointKind::COUNT],
            tail_hits: 0,
            mirror: Mirror::default(),
            predicted_hits: 0,
            adopted: 0,
        }
    }

    /// Applies the events since the last call to the mirror and checks its predictions.
    fn check_events(&mut self) {
        let events = self.m.take_events();
        self.mirror.apply(events);
        let hybrid = self.hybrid && self.mamba;
        if hybrid {
            self.mirror.check_blocks_useful();
        }
        let mut prompts: Vec<Vec<u32>> = (0..3).map(base_prompt).collect();
        for r in self.reqs.values().filter(|r| r.salt.is_none()) {
            let mut t = r.tokens.clone();
            prompts.push(t.clone());
            // A continuation of the whole sequence (a next turn).
            t.push(7);
            prompts.push(t);
        }
        for tokens in prompts {
            let mut hashes = Vec::new();
            self.hasher.extend(&mut hashes, &tokens, B, None);
            let prefix = Prefix {
                hashes: &hashes,
                tokens: &tokens,
                root: self.hasher.root(None),
            };
            let hit = self.m.peek_longest_cache_hit(prefix, tokens.len());
            let predicted = self.mirror.predict(&tokens, hybrid);
            assert_eq!(predicted, hit.num_tokens, "predicted hit of {tokens:?}");
            self.predicted_hits += usize::from(predicted > 0);
        }
    }

    fn pick(&self, p: u8) -> Option<ReqKey> {
        if self.reqs.is_empty() {
            return None;
        }
        self.reqs.keys().nth(p as usize % self.reqs.len()).copied()
    }

    fn fresh_token(&mut self) -> u32 {
        self.token_ctr += 1;
        self.token_ctr
    }

    fn content(salt: &Option<String>, toks: &[u32]) -> Content {
        Some((salt.clone(), toks.to_vec()))
    }

    fn fingerprint(salt: &Option<String>, prefix: &[u32]) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        salt.hash(&mut h);
        prefix.hash(&mut h);
        h.finish() | 1
    }

    /// Writes the KV of positions [start, start + seq_new) of `seq` into the request's blocks.
    fn write_kv(&mut self, key: ReqKey, salt: &Option<String>, seq: &[u32], start: usize) {
        let table = self.m.block_table(key).to_vec();
        for pos in start..seq.len() {
            let fp = Self::fingerprint(salt, &seq[..pos + 1]);
            self.kv_mem.entry(table[pos / B]).or_insert([0; B])[pos % B] = fp;
        }
    }

    fn snapshot(&self) -> (usize, usize, usize, usize, usize, usize) {
        let s = self.m.stats();
        (
            s.kv_blocks_used,
            s.kv_blocks_cached,
            s.kv_blocks_free,
            s.mamba_slots_used,
            s.checkpoints_committed,
            s.mamba_slots_window,
        )
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add { base, extra, salt } => {
                let mut tokens = base_prompt(base);
                tokens.truncate(4 + (extra as usize * 7) % 25);
                for _ in 0..extra % 5 {
                    let t = self.fresh_token();
                    tokens.push(t);
                }
                let salt = salt.then(|| "tenant".to_string());
                let key = self.next_key;
                self.next_key += 1;
                self.reqs.insert(
                    key,
                    Req {
                        tokens,
                        salt,
                        hashes: Vec::new(),
                        computed: 0,
                        running: false,
                        live: 0,
                    },
                );
            }
            Op::Step {
                pick,
                chunk,
                accept,
                abort_ckpt,
            } => {
                if let Some(key) = self.pick(pick) {
                    self.step(key, chunk as usize, accept as usize, abort_ckpt);
                }
            }
            Op::Preempt { pick } => {
                if let Some(key) = self.pick(pick) {
                    self.keep_last(key);
                    self.m.free(key);
                    self.pinned_tail.remove(&key);
                    let r = self.reqs.get_mut(&key).unwrap();
                    r.running = false;
                    r.computed = 0;
                    r.live = 0;
                }
            }
            Op::Finish { pick, adopt } => {
                if let Some(key) = self.pick(pick) {
                    if adopt {
                        self.adopt_publish(key);
                    }
                    self.keep_last(key);
                    self.m.free(key);
                    self.pinned_tail.remove(&key);
                    self.reqs.remove(&key);
                }
            }
            Op::Settle { cancel } => self.settle(cancel),
            Op::Reset => {
                let any_running = self.reqs.values().any(|r| r.running);
                let ok = self.m.reset_prefix_cache();
                assert_eq!(ok, !any_running && self.pending.is_empty());
                if ok {
                    let s = self.m.stats();
                    assert_eq!(s.kv_blocks_cached, 0);
                    assert_eq!(s.checkpoints_committed, 0);
                    assert_eq!(s.mamba_slots_used, 0);
                }
            }
        }
    }

    fn prefix<'a>(&self, r: &'a Req) -> Prefix<'a> {
        Prefix {
            hashes: &r.hashes,
            tokens: &r.tokens,
            root: self.hasher.root(r.salt.as_deref()),
        }
    }

    /// A running request keeps its state after its computed tokens (as the scheduler does when
    /// it finishes or is preempted).
    fn keep_last(&mut self, key: ReqKey) {
        let Some(r) = self.reqs.get(&key) else {
            return;
        };
        if !r.running || r.computed == 0 {
            return;
        }
        let (computed, live) = (r.computed, r.live);
        let prefix = self.prefix(r);
        let slot = self.m.state_window(key).get(live).copied();
        let kept = self.m.keep_last_state(key, prefix, computed, live);
        if kept {
            assert!(
                self.hybrid && self.branch,
                "a last state only with the branch placement"
            );
            let s = slot.unwrap();
            assert_eq!(self.m.mamba_pool().kind(s), Some(SlotKind::Committed));
            let (_, pos) = self.m.debug_tag(s).unwrap();
            assert_eq!(pos, computed);
            assert_eq!(
                self.mem.get(&s),
                Some(&Self::content(&r.salt, &r.tokens[..computed])),
                "the adopted slot holds the state after exactly the computed tokens"
            );
        }
    }

    /// The scheduler's publish of a verify row's boundary (a window slot other than the live
    /// one, holding the state after an accepted token at a block or grid boundary) for a request
    /// that ends before the next step: the checkpoint reserved for the copy is given back and
    /// the window slot itself is kept in its place.
    fn adopt_publish(&mut self, key: ReqKey) {
        let Some(r) = self.reqs.get(&key) else {
            return;
        };
        if !self.hybrid || !r.running {
            return;
        }
        let window = self.m.state_window(key).to_vec();
        let found = window.iter().enumerate().find_map(|(t, &s)| {
            let (salt, toks) = self.mem.get(&s).cloned().flatten()?;
            let pos = toks.len();
            let step = if self.branch { B } else { M };
            let boundary = pos > 0 && pos % step == 0 && pos <= r.computed;
            (t != r.live && boundary && salt == r.salt && toks[..] == r.tokens[..pos])
                .then_some((s, pos))
        });
        let Some((src, pos)) = found else {
            return;
        };
        let kind = if pos % M == 0 {
            CheckpointKind::Grid
        } else {
            CheckpointKind::Branch
        };
        let h = r.hashes[pos / B - 1];
        let Some(dst) = self.m.reserve_checkpoint(h, pos, kind) else {
            return;
        };
        assert_eq!(self.m.debug_tag(dst), Some((h, pos)));
        let kept = self.m.adopt_pending_publish(key, src, dst);
        assert_eq!(
            self.m.debug_tag(dst),
            None,
            "the reserved checkpoint is given back"
        );
        assert_ne!(self.m.mamba_pool().kind(dst), Some(SlotKind::Pending));
        if kept {
            assert_eq!(self.m.mamba_pool().kind(src), Some(SlotKind::Committed));
            assert_eq!(self.m.debug_tag(src), Some((h, pos)));
            self.adopted += 1;
        }
    }

    fn check_hit(&self, r: &Req, hit: &CacheHit) {
        let n = r.tokens.len();
        let l = hit.num_tokens;
        assert!(l < n.max(1), "L <= n - 1");
        assert_eq!(
            l % B != 0,
            hit.tail.is_some(),
            "a hit inside a block is a tail hit"
        );
        if let Some(t) = hit.tail {
            assert!(self.hybrid && self.branch);
            assert!(self.m.kv_pool().is_tail(t));
            let written = self.kv_mem.get(&t).copied().unwrap_or([0; B]);
            for pos in l / B * B..l {
                assert_eq!(
                    written[pos % B],
                    Self::fingerprint(&r.salt, &r.tokens[..pos + 1]),
                    "the tail block holds the KV of exactly this prefix"
                );
            }
        }
        assert_eq!(hit.kv_blocks.len(), l / B);
        assert!(hit.kv_hit_tokens >= l / B * B);
        for (i, &b) in hit.kv_blocks.iter().enumerate() {
            assert_ne!(b, NULL_BLOCK);
            assert_eq!(self.m.kv_pool().block_hash(b), Some(r.hashes[i]));
            let written = self.kv_mem.get(&b).copied().unwrap_or([0; B]);
            for (o, &fp) in written.iter().enumerate() {
                let pos = i * B + o;
                assert_eq!(
                    fp,
                    Self::fingerprint(&r.salt, &r.tokens[..pos + 1]),
                    "hit block {i} holds the KV of exactly this prefix"
                );
            }
        }
        // KV prefix length is maximal.
        let max_blocks = ((n - 1) / B).min(r.hashes.len());
        let kv_blocks = hit.kv_hit_tokens / B;
        if self.mamba && !self.hybrid {
            assert_eq!(l, 0, "mode none on a Mamba model never hits");
            return;
        }
        assert!(kv_blocks <= max_blocks);
        assert!(r.hashes[..kv_blocks]
            .iter()
            .all(|h| self.m.kv_pool().contains(*h)));
        if kv_blocks < max_blocks {
            assert!(!self.m.kv_pool().contains(r.hashes[kv_blocks]));
        }
        if !self.mamba {
            assert_eq!(l, hit.kv_hit_tokens);
            assert_eq!(hit.checkpoint, None);
            return;
        }
        if !self.branch {
            assert_eq!(l % M, 0);
        }
        let key_at = |p: usize| -> BlockHash {
            if p % B == 0 {
                r.hashes[p / B - 1]
            } else {
                let parent = if p < B {
                    self.hasher.root(r.salt.as_deref())
                } else {
                    r.hashes[p / B - 1]
                };
                self.hasher.hash_block(parent, &r.tokens[p / B * B..p])
            }
        };
        match hit.checkpoint {
            None => assert_eq!(l, 0),
            Some(s) => {
                assert!(l > 0);
                assert_ne!(s, NULL_SLOT);
                assert_eq!(self.m.debug_tag(s), Some((key_at(l), l)));
                assert_eq!(self.m.mamba_pool().kind(s), Some(SlotKind::Committed));
                assert_eq!(
                    self.mem.get(&s),
                    Some(&Self::content(&r.salt, &r.tokens[..l])),
                    "the checkpoint holds the state after exactly L tokens"
                );
            }
        }
        // No longer hit was available: no committed checkpoint deeper than L whose KV prefix is
        // cached (full blocks up to the KV hit, and a cached tail entry for a tail position).
        let last = (n - 1).min(hit.kv_hit_tokens + B - 1);
        for p in l + 1..=last {
            let h = key_at(p);
            if p % B != 0
                && !self
                    .m
                    .kv_pool()
                    .get_cached(h)
                    .is_some_and(|t| self.m.kv_pool().is_tail(t))
            {
                continue;
            }
            if p % B == 0 && p > hit.kv_hit_tokens {
                continue;
            }
            let deeper = self.m.mamba_pool().lookup(h);
            assert!(
                deeper.is_none_or(|s| self.m.debug_tag(s) != Some((h, p))),
                "a longer hit at {p} was available"
            );
        }
    }

    fn step(&mut self, key: ReqKey, chunk: usize, accept: usize, abort_ckpt: bool) {
        let k = self.k;
        let mut r = self.reqs.remove(&key).unwrap();
        self.hasher
            .extend(&mut r.hashes, &r.tokens, B, r.salt.as_deref());
        let n = r.tokens.len();
        if !r.running {
            let hit = self.m.find_longest_cache_hit(
                Prefix {
                    hashes: &r.hashes,
                    tokens: &r.tokens,
                    root: self.hasher.root(r.salt.as_deref()),
                },
                n,
            );
            self.check_hit(&r, &hit);
            let new = chunk.clamp(1, n - hit.num_tokens);
            let before = self.snapshot();
            match self.m.allocate_new(key, &hit, new, 0) {
                None => {
                    assert_eq!(self.snapshot(), before, "a failed allocation takes nothing");
                    // Windows for up to max_num_seqs requests always fit: with fewer running
                    // and enough KV blocks, the allocation must succeed.
                    let running = self.reqs.values().filter(|q| q.running).count();
                    let n_hit = hit.kv_blocks.len();
                    let hit_free = hit
                        .kv_blocks
                        .iter()
                        .chain(hit.tail.iter())
                        .filter(|&&b| self.m.kv_pool().is_free(b))
                        .count();
                    let need = (hit.num_tokens + new).div_ceil(B) - n_hit + hit_free;
                    assert!(
                        running >= self.max_num_seqs || self.m.kv_pool().num_free() < need,
                        "refused although KV fits and fewer than max_num_seqs run"
                    );
                    assert!(self.m.block_table(key).is_empty());
                    self.reqs.insert(key, r);
                    return;
                }
                Some(ops) => {
                    let w = self.m.state_window(key).to_vec();
                    assert_eq!(w.len(), 1 + k);
                    let table = self.m.block_table(key).to_vec();
                    let mut expect = Vec::new();
                    if let Some(t) = hit.tail {
                        let dst = table[hit.num_tokens / B];
                        assert_ne!(dst, t, "a tail is copied, never shared");
                        assert!(self.m.kv_pool().ref_count(t) >= 1, "pinned until copied");
                        expect.push(StateOp::CopyBlock { src: t, dst });
                        self.pinned_tail.insert(key, t);
                    }
                    match hit.checkpoint {
                        Some(c) => {
                            expect.push(StateOp::Copy { src: c, dst: w[0] });
                            assert!(!w.contains(&c), "copy-on-write");
                        }
                        None => assert!(hit.tail.is_none()),
                    }
                    assert_eq!(ops, expect);
                    for op in ops {
                        match op {
                            StateOp::Copy { src, dst } => {
                                let c = self.mem.get(&src).cloned().flatten();
                                self.mem.insert(dst, c);
                            }
                            StateOp::CopyBlock { src, dst } => {
                                let c = self.kv_mem.get(&src).copied().unwrap_or([0; B]);
                                self.kv_mem.insert(dst, c);
                            }
                        }
                    }
                    if let Some(kind) = hit.kind {
                        self.hits_by_kind[kind.index()] += 1;
                    }
                    self.tail_hits += usize::from(hit.tail.is_some());
                    r.running = true;
                    r.computed = hit.num_tokens;
                    r.live = 0;
                    if self.mamba && r.computed > 0 {
                        assert_eq!(
                            self.mem.get(&w[0]),
                            Some(&Self::content(&r.salt, &r.tokens[..r.computed]))
                        );
                    }
                    self.forward(key, &mut r, new, 1, abort_ckpt, false);
                }
            }
        } else if r.computed + 1 < n {
            // Prefill chunk of a running request.
            let new = chunk.clamp(1, n - r.computed);
            self.pinned_tail.remove(&key);
            if self.m.allocate_more(key, r.computed, new, 0).is_none() {
                self.reqs.insert(key, r);
                return;
            }
            self.forward(key, &mut r, new, 1, abort_ckpt, false);
        } else {
            // Decode / verify: the last token plus k drafts (lookahead slots for them).
            let d = if k == 0 { 0 } else { chunk % (k + 1) };
            self.pinned_tail.remove(&key);
            if self.m.allocate_more(key, r.computed, 1, d).is_none() {
                self.reqs.insert(key, r);
                return;
            }
            let a = 1 + accept % (d + 1);
            self.forward(key, &mut r, 1 + d, a, abort_ckpt, true);
        }
        self.reqs.insert(key, r);
    }

    /// Runs `new` tokens (a verify row: the last token and `new - 1` drafts), `accepted` of them accepted
    /// (prefill rows: `accepted == 1`, all tokens count). Then publishes boundary checkpoints of
    /// accepted positions, caches full accepted blocks and commits (or cancels) the checkpoints.
    fn forward(
        &mut self,
        key: ReqKey,
        r: &mut Req,
        new: usize,
        accepted: usize,
        abort_ckpt: bool,
        verify: bool,
    ) {
        let drafts = if verify { new - 1 } else { 0 };
        let window = self.m.state_window(key).to_vec();
        let table_len = self.m.block_table(key).len();
        assert!(
            table_len * B >= r.computed + new,
            "block table covers the scheduled tokens"
        );
        let start = r.computed;
        if self.mamba && start > 0 {
            assert_eq!(
                self.mem.get(&window[r.live]),
                Some(&Self::content(&r.salt, &r.tokens[..start])),
                "the read slot holds the state after the computed tokens"
            );
        }
        let end;
        if !verify {
            // Prefill: final state into window[0].
            end = start + new;
            let seq = r.tokens[..end].to_vec();
            self.write_kv(key, &r.salt, &seq, start);
            if self.mamba {
                self.mem
                    .insert(window[0], Self::content(&r.salt, &r.tokens[..end]));
            }
            r.live = 0;
        } else {
            // Verify row: state after token t into window[t]; drafts beyond `accepted` rejected.
            let mut seq = r.tokens[..start + 1].to_vec();
            for _ in 0..drafts {
                let t = self.fresh_token();
                seq.push(t);
            }
            self.write_kv(key, &r.salt, &seq, start);
            for t in 0..new {
                let c = if t < accepted {
                    Self::content(&r.salt, &seq[..start + t + 1])
                } else {
                    None
                };
                if self.mamba {
                    self.mem.insert(window[t], c);
                }
            }
            // Accepted drafts join the tokens, then the bonus / correction token.
            r.tokens
                .extend_from_slice(&seq[start + 1..start + accepted]);
            end = start + accepted;
            r.live = accepted - 1;
        }
        r.computed = end;
        if r.computed == r.tokens.len() {
            let t = self.fresh_token();
            r.tokens.push(t);
        }
        self.hasher
            .extend(&mut r.hashes, &r.tokens, B, r.salt.as_deref());
        // Boundaries reached by accepted tokens: a branch point at one block boundary of the
        // chunk (picked by the chunk's length), and the grid.
        let mut pending = Vec::new();
        let mut targets: Vec<(usize, CheckpointKind)> = Vec::new();
        if self.branch {
            let first = start / B + 1;
            let last_blk = end / B;
            if last_blk >= first {
                let pos = (first + (new % (last_blk - first + 1))) * B;
                // a found branch point or a declared shared prefix (same granularity, their
                // own reuse rates)
                let kind = if new % 2 == 0 {
                    CheckpointKind::Branch
                } else {
                    CheckpointKind::Declared
                };
                targets.push((pos, kind));
            }
        }
        let mut p = start / M + 1;
        while p * M <= end {
            targets.push((p * M, CheckpointKind::Grid));
            p += 1;
        }
        for (pos, kind) in targets {
            let h = r.hashes[pos / B - 1];
            let got = self.m.reserve_checkpoint(h, pos, kind);
            if let Some(s) = got {
                assert!(self.hybrid, "no checkpoints without a hybrid cache mode");
                assert_ne!(s, NULL_SLOT);
                assert!(!window.contains(&s));
                assert_eq!(self.m.debug_tag(s), Some((h, pos)));
                self.mem.insert(s, Self::content(&r.salt, &r.tokens[..pos]));
                pending.push(s);
            }
        }
        let prefix = self.prefix(r);
        self.m.cache_full_blocks(key, prefix, r.computed);
        // Pending until `Settle` (the update after the forward), or cancelled right away.
        for s in pending {
            if abort_ckpt {
                self.m.cancel_checkpoint(s);
                assert_eq!(self.m.debug_tag(s), None);
            } else {
                self.pending.push(s);
            }
        }
    }

    fn settle(&mut self, cancel: bool) {
        for s in std::mem::take(&mut self.pending) {
            assert_eq!(self.m.mamba_pool().kind(s), Some(SlotKind::Pending));
            if cancel {
                self.m.cancel_checkpoint(s);
                assert_eq!(self.m.debug_tag(s), None);
            } else {
                self.m.commit_checkpoint(s);
                assert_eq!(self.m.mamba_pool().kind(s), Some(SlotKind::Committed));
            }
        }
    }

    fn check_invariants(&self) {
        let s = self.m.stats();
        let total = s.kv_blocks_total;
        assert_eq!(
            s.kv_blocks_used + s.kv_blocks_free + s.kv_blocks_cached_free,
            total
        );
        let mut refs = vec![0u32; total + 1];
        let mut windows = Vec::new();
        for (&key, r) in &self.reqs {
            let table = self.m.block_table(key);
            let window = self.m.state_window(key);
            if !r.running {
                assert!(table.is_empty() && window.is_empty());
                continue;
            }
            assert!(table.len() * B >= r.computed);
            for &b in table {
                assert_ne!(b, NULL_BLOCK, "null block handed out");
                refs[b as usize] += 1;
            }
            assert_eq!(window.len(), 1 + self.k);
            if self.mamba {
                for &w in window {
                    assert_ne!(w, NULL_SLOT, "null slot handed out");
                    assert_eq!(self.m.mamba_pool().kind(w), Some(SlotKind::Window));
                    windows.push(w);
                }
                if r.computed > 0 {
                    assert_eq!(
                        self.mem.get(&window[r.live]),
                        Some(&Self::content(&r.salt, &r.tokens[..r.computed])),
                        "live state clobbered"
                    );
                }
            } else {
                assert!(window.iter().all(|&w| w == NULL_SLOT));
            }
        }
        for &t in self.pinned_tail.values() {
            refs[t as usize] += 1;
        }
        for (b, &n) in refs.iter().enumerate().skip(1) {
            assert_eq!(
                self.m.kv_pool().ref_count(b as BlockId),
                n,
                "ref count of block {b}"
            );
        }
        assert_eq!(refs[0], 0);
        let used = refs.iter().filter(|&&n| n > 0).count();
        assert_eq!(used, s.kv_blocks_used);
        let nw = windows.len();
        windows.sort_unstable();
        windows.dedup();
        assert_eq!(windows.len(), nw, "window slots shared");
        assert_eq!(s.mamba_slots_window, nw);
        assert_eq!(
            s.mamba_slots_used,
            nw + s.checkpoints_committed + s.checkpoints_pending
        );
        assert_eq!(s.checkpoints_pending, self.pending.len());
        for &p in &self.pending {
            assert_eq!(self.m.mamba_pool().kind(p), Some(SlotKind::Pending));
        }
    }

    fn finish_all(&mut self) {
        self.settle(false);
        let keys: Vec<ReqKey> = self.reqs.keys().copied().collect();
        for k in keys {
            self.m.free(k);
            self.pinned_tail.remove(&k);
        }
        self.reqs.clear();
        let s = self.m.stats();
        assert_eq!(s.kv_blocks_used, 0, "KV leak");
        assert_eq!(
            s.kv_blocks_free + s.kv_blocks_cached_free,
            s.kv_blocks_total
        );
        assert_eq!(s.mamba_slots_window, 0, "window leak");
        assert_eq!(s.mamba_slots_used, s.checkpoints_committed);
        assert!(self.m.reset_prefix_cache());
        let s = self.m.stats();
        assert_eq!(s.kv_blocks_free, s.kv_blocks_total);
        assert_eq!(s.mamba_slots_used, 0);
    }
}

fn config(
    variant: u8,
    k: usize,
    max_num_seqs: usize,
    placement: CheckpointPlacement,
    eviction: EvictionPolicy,
) -> ResolvedConfig {
    let mode = match variant {
        0 => MambaCacheMode::None,
        1 => MambaCacheMode::Align,
        _ => MambaCacheMode::All,
    };
    let mut c = ResolvedConfig::for_tests(mode, k);
    c.max_num_seqs = max_num_seqs;
    c.checkpoint_placement = placement;
    c.eviction = eviction;
    c.enable_prefix_caching = true;
    if variant == 3 {
        c.has_mamba_layers = false;
        c.mamba_cache_mode = MambaCacheMode::None;
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 768, ..ProptestConfig::default() })]

    #[test]
    fn cache_state_machine(
        variant in 0u8..4,
        k in prop::sample::select(vec![0usize, 1, 4]),
        kv_blocks in 8usize..40,
        extra_slots in 0usize..8,
        ops in prop::collection::vec(op(), 1..80),
        placement in prop_oneof![
            Just(CheckpointPlacement::Grid),
            Just(CheckpointPlacement::Branch),
            Just(CheckpointPlacement::BranchAndGrid),
        ],
        eviction in prop_oneof![
            Just(EvictionPolicy::Flops),
            Just(EvictionPolicy::Lru),
            Just(EvictionPolicy::LruPath),
        ],
    ) {
        let max_num_seqs = 3;
        let cfg = config(variant, k, max_num_seqs, placement, eviction);
        let slots = if cfg.has_mamba_layers { 1 + max_num_seqs * (1 + k) + extra_slots } else { 0 };
        let mut d = Driver::new(&cfg, kv_blocks, slots);
        d.m.enable_events();
        for op in &ops {
            d.apply(op);
            d.check_invariants();
            d.check_events();
        }
        d.finish_all();
        d.check_events();
        prop_assert!(d.mirror.groups.iter().all(HashMap::is_empty), "a reset leaves nothing announced");
    }
}

/// The random driver does reach every kind of hit (the property test above would pass vacuously
/// otherwise).
#[test]
fn random_operations_reach_every_checkpoint_kind() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha),
    );
    let mut by_kind = [0usize; CheckpointKind::COUNT];
    let mut tails = 0;
    let mut predicted = 0;
    let mut adopted = 0;
    for case in 0..300u64 {
        let placement = [
            CheckpointPlacement::Branch,
            CheckpointPlacement::BranchAndGrid,
        ][case as usize % 2];
        let cfg = config(
            1 + (case % 2) as u8,
            (case % 3) as usize,
            3,
            placement,
            EvictionPolicy::Flops,
        );
        let slots = 1 + 3 * (1 + cfg.num_speculative_tokens()) + 4;
        let mut d = Driver::new(&cfg, 40, slots);
        d.m.enable_events();
        let ops = prop::collection::vec(op(), 40..80)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        for op in &ops {
            d.apply(op);
            d.check_invariants();
            d.check_events();
        }
        predicted += d.predicted_hits;
        adopted += d.adopted;
        d.finish_all();
        for (total, n) in by_kind.iter_mut().zip(d.hits_by_kind) {
            *total += n;
        }
        tails += d.tail_hits;
    }
    assert!(by_kind.iter().all(|&n| n > 0), "{by_kind:?}");
    assert!(tails > 0);
    assert!(predicted > 0, "the events predicted no hit at all");
    assert!(adopted > 0, "no publish was adopted");
}
