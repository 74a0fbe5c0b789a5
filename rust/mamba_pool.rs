//! The Mamba state slot pool: a fixed number of slots (slot 0 the null/pad slot), running windows
//! of `1 + K` slots per request, and checkpoints keyed by the chained prefix hash of the position
//! whose state they hold (a block boundary, or the exact end of a finished sequence's tail).
//!
//! A checkpoint is *pending* from `reserve` until its forward has finished (`commit`), and it is
//! never a hit while pending. Committed checkpoints are read-only (a hit copies them into the
//! request's window) and evictable; a checkpoint that is the source of a not-yet-executed hit copy
//! is *pinned* and not evictable. `adopt` turns a window slot whose state is already written (the
//! live state of a finished request) into a committed checkpoint without a copy.
//!
//! Budgets: `window_reserve` slots are kept for running windows; checkpoints (pending + committed)
//! never take more than `checkpoint_cap = usable - window_reserve` slots (0 when the pool holds
//! exactly the reserve; half the usable slots if the pool is smaller than the reserve, which then
//! cannot be guaranteed anyway). So windows for up to `window_reserve / (1 + K)` requests
//! are always allocatable without evicting anything.
//!
//! The pool does not choose what to evict: it keeps committed, unpinned checkpoints in two LRU
//! lists, *stale* ones (their KV prefix left the cache, so they can never hit again) and live ones,
//! and a use clock per checkpoint; the cache manager picks the victim (`cache.rs`) and calls
//! `evict`. Allocations take free slots only.

use std::collections::HashMap;

use crate::block_hash::{BlockHash, PassThroughBuild};

/// Mamba state slot id; 0 = null slot, never handed out.
pub type SlotId = u32;

/// The null slot.
pub const NULL_SLOT: SlotId = 0;

/// What a slot is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    Free,
    Window,
    Pending,
    Committed,
}

/// Why a checkpoint was placed where it is (hits are counted by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CheckpointKind {
    /// A multiple of `mamba_block_size` (the grid placement).
    Grid,
    /// The end of a prefix that an earlier request shared (the deepest cached KV block of a hit).
    Branch,
    /// The last computed token of a finished (or preempted) sequence.
    LastToken,
    /// The end of a prompt's leading part that other prompts are expected to share, as its caller
    /// declared it (`NewRequest::shared_prefix_len`: e.g. where a chat's system message ends),
    /// kept by its first user so that the second one already hits it.
    Declared,
}

impl CheckpointKind {
    pub const ALL: [CheckpointKind; 4] = [
        CheckpointKind::Grid,
        CheckpointKind::Branch,
        CheckpointKind::LastToken,
        CheckpointKind::Declared,
    ];
    /// How many kinds there are (the length of per-kind arrays).
    pub const COUNT: usize = Self::ALL.len();

    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointKind::Grid => "grid",
            CheckpointKind::Branch => "branch",
            CheckpointKind::LastToken => "last_token",
            CheckpointKind::Declared => "declared",
        }
    }

    pub fn index(self) -> usize {
        match self {
            CheckpointKind::Grid => 0,
            CheckpointKind::Branch => 1,
            CheckpointKind::LastToken => 2,
            CheckpointKind::Declared => 3,
        }
    }
}

/// `(hash, position, kind)` of a pending or committed checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointTag {
    pub hash: BlockHash,
    pub position: usize,
    pub kind: CheckpointKind,
}

const NONE: u8 = 0;
const LIVE: u8 = 1;
const STALE: u8 = 2;
const SUPERSEDED: u8 = 3;

#[derive(Debug, Clone)]
pub struct MambaPool {
    kind: Vec<SlotKind>,
    tag: Vec<Option<CheckpointTag>>,
    pins: Vec<u32>,
    stale: Vec<bool>,
    last_use: Vec<u64>,
    clock: u64,
    free: Vec<SlotId>,
    /// Checkpoints that a deeper checkpoint on the same sequence replaced (a conversation moved on).
    superseded: Vec<bool>,
    /// LRU links over `n + 3` nodes: node `n` is the LIVE sentinel, `n + 1` the STALE sentinel,
    /// `n + 2` the SUPERSEDED sentinel.
    prev: Vec<u32>,
    next: Vec<u32>,
    list: Vec<u8>,
    num_evictable: usize,
    by_hash: HashMap<BlockHash, SlotId, PassThroughBuild>,
    checkpoint_cap: usize,
    num_window: usize,
    num_pending: usize,
    num_committed: usize,
    evictions: u64,
}

impl MambaPool {
    /// `num_slots` includes the null slot; `window_reserve` slots are kept for running windows.
    pub fn new(num_slots: usize, window_reserve: usize) -> Self {
        let n = num_slots.clamp(1, u32::MAX as usize - 2);
        let usable = n - 1;
        let checkpoint_cap = if usable >= window_reserve {
            usable - window_reserve
        } else {
            usable / 2
        };
        let mut prev = vec![0u32; n + 3];
        let mut next = vec![0u32; n + 3];
        for s in [n, n + 1, n + 2] {
            prev[s] = s as u32;
            next[s] = s as u32;
        }
        MambaPool {
            kind: vec![SlotKind::Free; n],
            tag: vec![None; n],
            pins: vec![0; n],
            stale: vec![false; n],
            superseded: vec![false; n],
            last_use: vec![0; n],
            clock: 0,
            // Popped from the back: lowest ids first.
            free: (1..n as u32).rev().collect(),
            prev,
            next,
            list: vec![NONE; n],
            num_evictable: 0,
            by_hash: HashMap::with_hasher(PassThroughBuild::default()),
            checkpoint_cap,
            num_window: 0,
            num_pending: 0,
            num_committed: 0,
            evictions: 0,
        }
    }

    pub fn num_slots(&self) -> usize {
        self.kind.len()
    }
    pub fn num_usable(&self) -> usize {
        self.kind.len() - 1
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_used(&self) -> usize {
        self.num_usable() - self.free.len()
    }
    pub fn num_window(&self) -> usize {
        self.num_window
    }
    pub fn num_pending(&self) -> usize {
        self.num_pending
    }
    pub fn num_committed(&self) -> usize {
        self.num_committed
    }
    /// Pending + committed checkpoints.
    pub fn num_checkpoints(&self) -> usize {
        self.num_pending + self.num_committed
    }
    /// Committed checkpoints that are not pinned.
    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }
    pub fn checkpoint_cap(&self) -> usize {
        self.checkpoint_cap
    }
    /// Whether one more checkpoint would exceed the checkpoint budget.
    pub fn at_checkpoint_cap(&self) -> bool {
        self.num_checkpoints() >= self.checkpoint_cap
    }
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
    pub fn kind(&self, s: SlotId) -> Option<SlotKind> {
        self.kind.get(s as usize).copied()
    }
    /// `(hash, position)` of a pending or committed checkpoint slot.
    pub fn tag(&self, s: SlotId) -> Option<(BlockHash, usize)> {
        self.tag
            .get(s as usize)
            .copied()
            .flatten()
            .map(|t| (t.hash, t.position))
    }
    /// The full tag (with the kind) of a pending or committed checkpoint slot.
    pub fn checkpoint_tag(&self, s: SlotId) -> Option<CheckpointTag> {
        self.tag.get(s as usize).copied().flatten()
    }
    pub fn is_stale(&self, s: SlotId) -> bool {
        self.stale.get(s as usize).copied().unwrap_or(false)
    }
    /// The use clock value of the last commit or touch of a checkpoint.
    pub fn last_use(&self, s: SlotId) -> u64 {
        self.last_use.get(s as usize).copied().unwrap_or(0)
    }

    #[inline]
    fn valid(&self, s: SlotId) -> bool {
        s != NULL_SLOT && (s as usize) < self.kind.len()
    }

    fn sentinel(&self, which: u8) -> usize {
        self.kind.len()
            + match which {
                STALE => 1,
                SUPERSEDED => 2,
                _ => 0,
            }
    }

    /// The list an evictable committed checkpoint belongs on.
    fn home(&self, s: SlotId) -> u8 {
        if self.stale[s as usize] {
            STALE
        } else if self.superseded[s as usize] {
            SUPERSEDED
        } else {
            LIVE
        }
    }

    fn link_back(&mut self, s: SlotId, which: u8) {
        let head = self.sentinel(which);
        let last = self.prev[head];
        self.prev[s as usize] = last;
        self.next[s as usize] = head as u32;
        self.next[last as usize] = s;
        self.prev[head] = s;
        self.list[s as usize] = which;
        self.num_evictable += 1;
    }

    fn unlink(&mut self, s: SlotId) {
        if self.list[s as usize] == NONE {
            return;
        }
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.list[s as usize] = NONE;
        self.num_evictable -= 1;
    }

    fn front(&self, which: u8) -> Option<SlotId> {
        let head = self.sentinel(which);
        let f = self.next[head] as usize;
        (f != head).then_some(f as SlotId)
    }

    fn tick(&mut self, s: SlotId) {
        self.clock += 1;
        self.last_use[s as usize] = self.clock;
    }

    /// The least recently used stale evictable checkpoint.
    pub fn stale_victim(&self) -> Option<SlotId> {
        self.front(STALE)
    }

    /// The least recently used superseded evictable checkpoint.
    pub fn superseded_victim(&self) -> Option<SlotId> {
        self.front(SUPERSEDED)
    }

    /// The least recently used live evictable checkpoint.
    pub fn lru_victim(&self) -> Option<SlotId> {
        self.front(LIVE)
    }

    /// The live evictable checkpoints, least recently used first.
    pub fn live_evictable(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.evictable_on(LIVE)
    }

    /// The superseded evictable checkpoints, least recently used first.
    pub fn superseded_evictable(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.evictable_on(SUPERSEDED)
    }

    fn evictable_on(&self, which: u8) -> impl Iterator<Item = SlotId> + '_ {
        let head = self.sentinel(which) as u32;
        let mut s = self.next[head as usize];
        std::iter::from_fn(move || {
            if s == head {
                return None;
            }
            let cur = s;
            s = self.next[s as usize];
            Some(cur)
        })
    }

    /// Drops an evictable (committed, unpinned) checkpoint. False for any other slot.
    pub fn evict(&mut self, s: SlotId) -> bool {
        if !self.valid(s) || self.list[s as usize] == NONE {
            return false;
        }
        self.unlink(s);
        self.drop_checkpoint(s);
        self.num_committed -= 1;
        self.evictions += 1;
        true
    }

    fn drop_checkpoint(&mut self, s: SlotId) {
        if let Some(t) = self.tag[s as usize].take() {
            self.by_hash.remove(&t.hash);
        }
        self.stale[s as usize] = false;
        self.superseded[s as usize] = false;
        self.kind[s as usize] = SlotKind::Free;
        self.free.push(s);
    }

    /// Appends `n` free slots to `out` as window slots. False (nothing taken) if fewer are free:
    /// the caller evicts first.
    pub fn alloc_window(&mut self, n: usize, out: &mut Vec<SlotId>) -> bool {
        if self.free.len() < n {
            return false;
        }
        for _ in 0..n {
            let Some(s) = self.free.pop() else {
                return false;
            };
            self.kind[s as usize] = SlotKind::Window;
            self.num_window += 1;
            out.push(s);
        }
        true
    }

    /// Returns window slots to the free list (non-window ids are ignored).
    pub fn free_window(&mut self, slots: &[SlotId]) {
        for &s in slots {
            if self.valid(s) && self.kind[s as usize] == SlotKind::Window {
                self.kind[s as usize] = SlotKind::Free;
                self.num_window -= 1;
                self.free.push(s);
            }
        }
    }

    /// A pending checkpoint for `tag` in a free slot. None if one exists for the hash, the
    /// checkpoint budget is used up, or no slot is free (the caller evicts first).
    pub fn reserve(&mut self, tag: CheckpointTag) -> Option<SlotId> {
        if self.by_hash.contains_key(&tag.hash) || self.at_checkpoint_cap() {
            return None;
        }
        let s = self.free.pop()?;
        self.kind[s as usize] = SlotKind::Pending;
        self.tag[s as usize] = Some(tag);
        self.stale[s as usize] = false;
        self.by_hash.insert(tag.hash, s);
        self.num_pending += 1;
        Some(s)
    }

    /// Turns the window slot `s` (its state already written) into a committed checkpoint for
    /// `tag`, stale until `set_live`. False (nothing changed) if `s` is not a window slot, a
    /// checkpoint for the hash exists, or the checkpoint budget is used up.
    pub fn adopt(&mut self, s: SlotId, tag: CheckpointTag) -> bool {
        if !self.valid(s)
            || self.kind[s as usize] != SlotKind::Window
            || self.by_hash.contains_key(&tag.hash)
            || self.at_checkpoint_cap()
        {
            return false;
        }
        self.num_window -= 1;
        self.kind[s as usize] = SlotKind::Committed;
        self.tag[s as usize] = Some(tag);
        self.by_hash.insert(tag.hash, s);
        self.num_committed += 1;
        self.stale[s as usize] = true;
        self.tick(s);
        self.link_back(s, STALE);
        true
    }

    /// Pending -> committed (most recently used), stale until `set_live`. Other slots are ignored.
    pub fn commit(&mut self, s: SlotId) {
        if !self.valid(s) || self.kind[s as usize] != SlotKind::Pending {
            return;
        }
        self.kind[s as usize] = SlotKind::Committed;
        self.num_pending -= 1;
        self.num_committed += 1;
        self.stale[s as usize] = true;
        self.tick(s);
        self.link_back(s, STALE);
    }

    /// Frees a pending checkpoint that was never written. Other slots are ignored.
    pub fn cancel(&mut self, s: SlotId) {
        if !self.valid(s) || self.kind[s as usize] != SlotKind::Pending {
            return;
        }
        self.num_pending -= 1;
        self.drop_checkpoint(s);
    }

    /// The committed checkpoint for `hash`.
    #[inline]
    pub fn lookup(&self, hash: BlockHash) -> Option<SlotId> {
        let s = *self.by_hash.get(&hash)?;
        (self.kind[s as usize] == SlotKind::Committed).then_some(s)
    }

    /// The checkpoint (pending or committed) for `hash`.
    pub fn checkpoint_for(&self, hash: BlockHash) -> Option<SlotId> {
        self.by_hash.get(&hash).copied()
    }

    /// Whether a checkpoint (pending or committed) exists for `hash`.
    pub fn has_checkpoint(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Marks a committed checkpoint most recently used.
    pub fn touch(&mut self, s: SlotId) {
        if !self.valid(s) || self.kind[s as usize] != SlotKind::Committed {
            return;
        }
        self.tick(s);
        if self.list[s as usize] != NONE {
            let which = self.list[s as usize];
            self.unlink(s);
            self.link_back(s, which);
        }
    }

    /// Pins a committed checkpoint (not evictable until unpinned). False if not committed.
    pub fn pin(&mut self, s: SlotId) -> bool {
        if !self.valid(s) || self.kind[s as usize] != SlotKind::Committed {
            return false;
        }
        self.unlink(s);
        self.pins[s as usize] += 1;
        true
    }

    pub fn unpin(&mut self, s: SlotId) {
        if !self.valid(s) || self.pins[s as usize] == 0 {
            return;
        }
        self.pins[s as usize] -= 1;
        if self.pins[s as usize] == 0 && self.kind[s as usize] == SlotKind::Committed {
            self.link_back(s, self.home(s));
        }
    }

    pub fn pin_count(&self, s: SlotId) -> u32 {
        self.pins.get(s as usize).copied().unwrap_or(0)
    }

    /// A committed checkpoint can (no longer) be reached through the KV prefix cache.
    pub fn set_stale(&mut self, s: SlotId, stale: bool) {
        if !self.valid(s)
            || self.kind[s as usize] != SlotKind::Committed
            || self.stale[s as usize] == stale
        {
            return;
        }
        self.stale[s as usize] = stale;
        if self.list[s as usize] != NONE {
            self.unlink(s);
            self.link_back(s, self.home(s));
        }
    }

    /// A deeper checkpoint on the same sequence replaced committed checkpoint `s` (the request that
    /// resumed from it kept its own last state): it goes before the live ones.
    pub fn set_superseded(&mut self, s: SlotId) {
        if !self.valid(s)
            || self.kind[s as usize] != SlotKind::Committed
            || self.superseded[s as usize]
        {
            return;
        }
        self.superseded[s as usize] = true;
        if self.list[s as usize] != NONE {
            self.unlink(s);
            self.link_back(s, self.home(s));
        }
    }

    pub fn is_superseded(&self, s: SlotId) -> bool {
        self.superseded.get(s as usize).copied().unwrap_or(false)
    }

    /// Drops every committed checkpoint. Refused (false) while any checkpoint is pending or pinned.
    pub fn clear_checkpoints(&mut self) -> bool {
        if self.num_pending > 0 || self.num_committed > self.num_evictable {
            return false;
        }
        while let Some(s) = self
            .stale_victim()
            .or_else(|| self.superseded_victim())
            .or_else(|| self.lru_victim())
        {
            self.evict(s);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(x: u128, position: usize) -> CheckpointTag {
        CheckpointTag {
            hash: BlockHash(x),
            position,
            kind: CheckpointKind::Grid,
        }
    }

    fn committed(p: &mut MambaPool, x: u128, pos: usize) -> SlotId {
        let s = p.reserve(t(x, pos)).unwrap();
        p.commit(s);
        p.set_stale(s, false);
        s
    }

    #[test]
    fn windows_keep_their_reserve() {
        // 1 null + 6 usable, reserve 4 for windows -> 2 checkpoints at most.
        let mut p = MambaPool::new(7, 4);
        assert_eq!(p.checkpoint_cap(), 2);
        let a = committed(&mut p, 1, 8);
        committed(&mut p, 2, 16);
        assert!(p.at_checkpoint_cap());
        assert_eq!(p.reserve(t(3, 24)), None, "the budget is used up");
        assert_eq!(p.lru_victim(), Some(a));
        assert!(p.evict(a));
        assert_eq!(p.lookup(BlockHash(1)), None);
        assert_eq!(p.evictions(), 1);
        let c = p.reserve(t(3, 24)).unwrap();
        p.commit(c);
        let mut w = Vec::new();
        assert!(p.alloc_window(4, &mut w));
        assert!(!w.contains(&NULL_SLOT));
        assert!(
            !p.alloc_window(1, &mut w),
            "allocations take free slots only"
        );
        p.free_window(&w);
        assert_eq!(p.num_window(), 0);
    }

    #[test]
    fn pending_is_not_a_hit_and_cancel_frees() {
        let mut p = MambaPool::new(4, 0);
        let a = p.reserve(t(5, 8)).unwrap();
        assert_eq!(p.lookup(BlockHash(5)), None);
        assert_eq!(p.reserve(t(5, 8)), None, "duplicate");
        assert!(!p.evict(a), "pending is not evictable");
        p.cancel(a);
        assert_eq!(p.num_pending(), 0);
        assert_eq!(p.tag(a), None);
        let b = p.reserve(t(5, 8)).unwrap();
        p.commit(b);
        assert_eq!(p.lookup(BlockHash(5)), Some(b));
        assert_eq!(p.tag(b), Some((BlockHash(5), 8)));
        assert!(
            p.is_stale(b),
            "stale until its KV block is known to be cached"
        );
    }

    #[test]
    fn stale_first_then_lru_and_pins() {
        let mut p = MambaPool::new(10, 0);
        let s: Vec<SlotId> = (1..=4)
            .map(|i| committed(&mut p, i, i as usize * 8))
            .collect();
        p.touch(s[0]); // order now 2,3,4,1
        assert!(p.last_use(s[0]) > p.last_use(s[3]));
        p.set_stale(s[2], true);
        assert!(p.pin(s[1])); // 2 pinned
        assert_eq!(p.stale_victim(), Some(s[2]));
        assert_eq!(p.live_evictable().collect::<Vec<_>>(), vec![s[3], s[0]]);
        assert!(p.evict(s[2]));
        assert_eq!(p.lru_victim(), Some(s[3]), "LRU, skipping the pinned one");
        assert!(!p.evict(s[1]), "pinned is not evictable");
        assert!(!p.clear_checkpoints());
        p.unpin(s[1]);
        assert!(p.clear_checkpoints());
        assert_eq!(p.num_used(), 0);
    }

    #[test]
    fn adopt_turns_a_window_slot_into_a_checkpoint() {
        let mut p = MambaPool::new(6, 2);
        let mut w = Vec::new();
        assert!(p.alloc_window(2, &mut w));
        let mut tag = t(9, 13);
        tag.kind = CheckpointKind::LastToken;
        assert!(!p.adopt(NULL_SLOT, tag));
        assert!(p.adopt(w[1], tag));
        assert_eq!(p.kind(w[1]), Some(SlotKind::Committed));
        assert_eq!(p.checkpoint_tag(w[1]), Some(tag));
        assert_eq!((p.num_window(), p.num_committed()), (1, 1));
        assert!(!p.adopt(w[0], tag), "one checkpoint per hash");
        p.free_window(&w); // the adopted slot is not a window slot any more
        assert_eq!(p.num_window(), 0);
        assert_eq!(p.kind(w[1]), Some(SlotKind::Committed));
        assert_eq!(p.num_free(), 4);
    }
}
