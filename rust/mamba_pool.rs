//! The Mamba state slot pool: a fixed number of slots (slot 0 the null/pad slot), running windows
//! of `1 + K` slots per request, and checkpoints keyed by the chained prefix hash at multiples of
//! `mamba_block_size`.
//!
//! A checkpoint is *pending* from `reserve` until its forward has finished (`commit`), and it is
//! never a hit while pending. Committed checkpoints are read-only (a hit copies them into the
//! request's window) and evictable; a checkpoint that is the source of a not-yet-executed hit copy
//! is *pinned* and not evictable.
//!
//! Budgets: `window_reserve` slots are kept for running windows; checkpoints (pending + committed)
//! never take more than `checkpoint_cap = usable - window_reserve` slots (0 when the pool holds
//! exactly the reserve; half the usable slots if the pool is smaller than the reserve, which then
//! cannot be guaranteed anyway). So windows for up to `window_reserve / (1 + K)` requests
//! are always allocatable without evicting anything. A window that needs more (the pool was sized
//! for fewer requests) evicts committed checkpoints.
//!
//! Eviction order: LRU among committed, unpinned checkpoints, those marked *stale* (the KV block
//! they are keyed by left the prefix cache, so they can never hit again) first.

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

const NONE: u8 = 0;
const LIVE: u8 = 1;
const STALE: u8 = 2;

#[derive(Debug, Clone)]
pub struct MambaPool {
    kind: Vec<SlotKind>,
    tag: Vec<Option<(BlockHash, usize)>>,
    pins: Vec<u32>,
    stale: Vec<bool>,
    free: Vec<SlotId>,
    /// LRU links over `n + 2` nodes: node `n` is the LIVE sentinel, `n + 1` the STALE sentinel.
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
        let mut prev = vec![0u32; n + 2];
        let mut next = vec![0u32; n + 2];
        for s in [n, n + 1] {
            prev[s] = s as u32;
            next[s] = s as u32;
        }
        MambaPool {
            kind: vec![SlotKind::Free; n],
            tag: vec![None; n],
            pins: vec![0; n],
            stale: vec![false; n],
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
    /// Committed checkpoints that are not pinned.
    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }
    pub fn checkpoint_cap(&self) -> usize {
        self.checkpoint_cap
    }
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
    pub fn kind(&self, s: SlotId) -> Option<SlotKind> {
        self.kind.get(s as usize).copied()
    }
    /// `(hash, position)` of a pending or committed checkpoint slot.
    pub fn tag(&self, s: SlotId) -> Option<(BlockHash, usize)> {
        self.tag.get(s as usize).copied().flatten()
    }
    pub fn is_stale(&self, s: SlotId) -> bool {
        self.stale.get(s as usize).copied().unwrap_or(false)
    }

    #[inline]
    fn valid(&self, s: SlotId) -> bool {
        s != NULL_SLOT && (s as usize) < self.kind.len()
    }

    fn sentinel(&self, which: u8) -> usize {
        self.kind.len() + usize::from(which == STALE)
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

    /// Evicts the LRU evictable checkpoint (stale ones first). False if none is evictable.
    pub fn evict_one(&mut self) -> bool {
        let Some(s) = self.front(STALE).or_else(|| self.front(LIVE)) else {
            return false;
        };
        self.unlink(s);
        self.drop_checkpoint(s);
        self.num_committed -= 1;
        self.evictions += 1;
        true
    }

    fn drop_checkpoint(&mut self, s: SlotId) {
        if let Some((h, _)) = self.tag[s as usize].take() {
            self.by_hash.remove(&h);
        }
        self.stale[s as usize] = false;
        self.kind[s as usize] = SlotKind::Free;
        self.free.push(s);
    }

    /// Appends `n` window slots to `out`, evicting committed checkpoints if the free slots do not
    /// suffice. False (nothing taken, nothing evicted) if even that is not enough.
    pub fn alloc_window(&mut self, n: usize, out: &mut Vec<SlotId>) -> bool {
        if self.free.len() + self.num_evictable < n {
            return false;
        }
        while self.free.len() < n {
            if !self.evict_one() {
                return false;
            }
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

    /// Whether `n` window slots could be allocated now.
    pub fn can_alloc_window(&self, n: usize) -> bool {
        self.free.len() + self.num_evictable >= n
    }

    /// A pending checkpoint for `(hash, position)`, evicting the LRU checkpoint if the checkpoint
    /// budget or the pool is full. None if one exists for `hash` or nothing can be evicted.
    pub fn reserve(&mut self, hash: BlockHash, position: usize) -> Option<SlotId> {
        if self.by_hash.contains_key(&hash) || self.checkpoint_cap == 0 {
            return None;
        }
        if self.num_pending + self.num_committed >= self.checkpoint_cap && !self.evict_one() {
            return None;
        }
        if self.free.is_empty() && !self.evict_one() {
            return None;
        }
        let s = self.free.pop()?;
        self.kind[s as usize] = SlotKind::Pending;
        self.tag[s as usize] = Some((hash, position));
        self.stale[s as usize] = false;
        self.by_hash.insert(hash, s);
        self.num_pending += 1;
        Some(s)
    }

    /// Pending -> committed (most recently used). `kv_present`: whether the KV block the
    /// checkpoint is keyed by is in the prefix cache now (if not, it is stale from the start).
    /// Other slots are ignored.
    pub fn commit(&mut self, s: SlotId, kv_present: bool) {
        if !self.valid(s) || self.kind[s as usize] != SlotKind::Pending {
            return;
        }
        self.kind[s as usize] = SlotKind::Committed;
        self.num_pending -= 1;
        self.num_committed += 1;
        self.stale[s as usize] = !kv_present;
        self.link_back(s, if kv_present { LIVE } else { STALE });
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

    /// Whether a checkpoint (pending or committed) exists for `hash`.
    pub fn has_checkpoint(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Marks a committed checkpoint most recently used.
    pub fn touch(&mut self, s: SlotId) {
        if self.valid(s) && self.list[s as usize] != NONE {
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
            let which = if self.stale[s as usize] { STALE } else { LIVE };
            self.link_back(s, which);
        }
    }

    pub fn pin_count(&self, s: SlotId) -> u32 {
        self.pins.get(s as usize).copied().unwrap_or(0)
    }

    /// The KV block keyed `hash` left the prefix cache: its checkpoint (if any) goes stale.
    pub fn mark_stale(&mut self, hash: BlockHash) {
        let Some(&s) = self.by_hash.get(&hash) else {
            return;
        };
        self.stale[s as usize] = true;
        if self.list[s as usize] == LIVE {
            self.unlink(s);
            self.link_back(s, STALE);
        }
    }

    /// The KV block keyed `hash` is (again) in the prefix cache.
    pub fn mark_live(&mut self, hash: BlockHash) {
        let Some(&s) = self.by_hash.get(&hash) else {
            return;
        };
        self.stale[s as usize] = false;
        if self.list[s as usize] == STALE {
            self.unlink(s);
            self.link_back(s, LIVE);
        }
    }

    /// Drops every committed checkpoint. Refused (false) while any checkpoint is pending or pinned.
    pub fn clear_checkpoints(&mut self) -> bool {
        if self.num_pending > 0 || self.num_committed > self.num_evictable {
            return false;
        }
        while self.evict_one() {}
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn windows_keep_their_reserve() {
        // 1 null + 6 usable, reserve 4 for windows -> 2 checkpoints at most.
        let mut p = MambaPool::new(7, 4);
        assert_eq!(p.checkpoint_cap(), 2);
        let a = p.reserve(h(1), 8).unwrap();
        let b = p.reserve(h(2), 16).unwrap();
        p.commit(a, true);
        p.commit(b, true);
        // Third checkpoint evicts the LRU one (a).
        let c = p.reserve(h(3), 24).unwrap();
        assert_eq!(p.lookup(h(1)), None);
        assert_eq!(p.evictions(), 1);
        p.commit(c, true);
        // Windows of 4 slots fit without eviction.
        let mut w = Vec::new();
        assert!(p.alloc_window(4, &mut w));
        assert_eq!(p.evictions(), 1);
        assert!(!w.contains(&NULL_SLOT));
        // A fifth window slot evicts a checkpoint.
        assert!(p.alloc_window(1, &mut w));
        assert_eq!(p.evictions(), 2);
        assert_eq!(p.num_committed(), 1);
        p.free_window(&w);
        assert_eq!(p.num_window(), 0);
    }

    #[test]
    fn pending_is_not_a_hit_and_cancel_frees() {
        let mut p = MambaPool::new(4, 0);
        let a = p.reserve(h(5), 8).unwrap();
        assert_eq!(p.lookup(h(5)), None);
        assert_eq!(p.reserve(h(5), 8), None, "duplicate");
        assert!(!p.evict_one(), "pending is not evictable");
        p.cancel(a);
        assert_eq!(p.num_pending(), 0);
        assert_eq!(p.tag(a), None);
        let b = p.reserve(h(5), 8).unwrap();
        p.commit(b, true);
        assert_eq!(p.lookup(h(5)), Some(b));
        assert_eq!(p.tag(b), Some((h(5), 8)));
    }

    #[test]
    fn stale_first_then_lru_and_pins() {
        let mut p = MambaPool::new(10, 0);
        let s: Vec<SlotId> = (1..=4)
            .map(|i| {
                let x = p.reserve(h(i), i as usize * 8).unwrap();
                p.commit(x, true);
                x
            })
            .collect();
        p.touch(s[0]); // order now 2,3,4,1
        p.mark_stale(h(3));
        assert!(p.pin(s[1])); // 2 pinned
        assert!(p.evict_one());
        assert_eq!(p.lookup(h(3)), None, "stale goes first");
        assert!(p.evict_one());
        assert_eq!(p.lookup(h(4)), None, "then LRU, skipping the pinned one");
        assert!(p.evict_one());
        assert_eq!(p.lookup(h(1)), None);
        assert!(!p.evict_one(), "pinned is not evictable");
        assert!(!p.clear_checkpoints());
        p.unpin(s[1]);
        assert!(p.clear_checkpoints());
        assert_eq!(p.num_used(), 0);
    }
}
