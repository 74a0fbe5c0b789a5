//! KV cache events: what a request can hit, told to subscribers outside the engine (routers that
//! place requests where their prefix is cached).
//!
//! Two groups, as a hybrid model has two caches:
//! - group 0 (`Attention`): cached full KV blocks. On a model with Mamba layers a block is
//!   announced only while a hit can use it, that is while a committed checkpoint sits at or below
//!   it in the prefix tree; a block whose every checkpoint below went is announced as removed
//!   although its KV is still in memory. On a model without Mamba layers every cached block is.
//! - group 1 (`Mamba`): committed checkpoints whose KV prefix is cached (not stale), one event per
//!   checkpoint, keyed by the hash of the prefix that ends at its position. A checkpoint at a block
//!   boundary carries that block's tokens; one inside a block (a finished sequence's last state)
//!   carries the tokens of its partial block, whose KV tail entry lives and goes with it.
//!
//! A hit of L tokens needs the group-0 blocks below L and a group-1 checkpoint at exactly L, so a
//! subscriber that mirrors both groups predicts each hit exactly (docs/kv-events.md).
//!
//! The log does not follow every operation of the caches. The pools report the hashes whose state
//! may have changed (`mark`); `flush` compares the current truth of each with what was announced
//! and emits the difference. What is announced is therefore always a function of the cache's
//! state at the flush, whatever path led there.

use std::collections::{HashMap, HashSet};

use crate::block_hash::{BlockHash, PassThroughBuild};

/// A cache group of the events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheGroup {
    Attention = 0,
    Mamba = 1,
}

impl CacheGroup {
    pub fn index(self) -> u32 {
        self as u32
    }
}

/// One event. `hash` and `parent` are the engine's block hashes (`external_id` turns them into
/// the opaque ids a subscriber sees).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored {
        group: CacheGroup,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: Vec<u32>,
    },
    Removed {
        group: CacheGroup,
        hash: BlockHash,
    },
    AllCleared,
}

/// The opaque 64-bit id under which a block hash is published. A fold of both 64-bit lanes:
/// unique per prefix as far as the hash is, and not the hash itself, whose seed stays private.
pub fn external_id(h: BlockHash) -> u64 {
    let (a, b) = (h.0 as u64, (h.0 >> 64) as u64);
    let mut z = a ^ b.rotate_left(29) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a stored event says about a cached prefix: its parent, its tokens past the parent and
/// the position it ends at (stores are emitted shallowest first, so a parent precedes its
/// children).
#[derive(Clone, Debug)]
struct BlockInfo {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    position: usize,
}

/// The current truth of one hash, as the cache manager reads it at a flush.
#[derive(Clone, Copy, Debug, Default)]
pub struct Truth {
    /// Announce it in group 0.
    pub kv: bool,
    /// Announce it in group 1.
    pub checkpoint: bool,
    /// The caches still know the hash (a cached block or a checkpoint, stale ones included): its
    /// tokens are kept for a later store.
    pub known: bool,
}

#[derive(Debug, Clone, Default)]
pub struct EventLog {
    info: HashMap<BlockHash, BlockInfo, PassThroughBuild>,
    dirty: Vec<BlockHash>,
    cleared: bool,
    announced: [HashSet<BlockHash, PassThroughBuild>; 2],
    /// Events emitted so far (stores + removals + clears), for the metrics.
    emitted: u64,
}

impl EventLog {
    /// Remembers what a newly cached prefix holds (a full block or a tail entry).
    pub fn describe(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        position: usize,
    ) {
        self.info.insert(
            hash,
            BlockInfo {
                parent,
                tokens: tokens.to_vec(),
                position,
            },
        );
        self.dirty.push(hash);
    }

    /// `hash` may have changed state.
    pub fn mark(&mut self, hash: BlockHash) {
        self.dirty.push(hash);
    }

    /// Every cache entry was dropped.
    pub fn clear(&mut self) {
        self.cleared = true;
        self.info.clear();
        self.dirty.clear();
    }

    /// Events emitted since the start.
    pub fn num_emitted(&self) -> u64 {
        self.emitted
    }

    /// The events that bring a subscriber from what was announced to the truth of every hash
    /// marked since the last flush: removals first, then stores shallowest first, group 0 before
    /// group 1 at equal depth (a checkpoint's KV block precedes it).
    pub fn flush(&mut self, truth: impl Fn(BlockHash) -> Truth) -> Vec<KvEvent> {
        let mut out = Vec::new();
        if std::mem::take(&mut self.cleared) {
            out.push(KvEvent::AllCleared);
            for a in &mut self.announced {
                a.clear();
            }
        }
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        let mut stores: Vec<(usize, CacheGroup, BlockHash)> = Vec::new();
        for &h in &dirty {
            let t = truth(h);
            for (group, now) in [
                (CacheGroup::Attention, t.kv),
                (CacheGroup::Mamba, t.checkpoint),
            ] {
                let announced = &mut self.announced[group as usize];
                match (now, announced.contains(&h)) {
                    (true, false) => {
                        if let Some(info) = self.info.get(&h) {
                            announced.insert(h);
                            stores.push((info.position, group, h));
                        }
                    }
                    (false, true) => {
                        announced.remove(&h);
                        out.push(KvEvent::Removed { group, hash: h });
                    }
                    _ => {}
                }
            }
            if !t.known {
                self.info.remove(&h);
            }
        }
        stores.sort_unstable_by_key(|&(pos, group, _)| (pos, group as u8));
        for (_, group, h) in stores {
            if let Some(info) = self.info.get(&h) {
                out.push(KvEvent::Stored {
                    group,
                    hash: h,
                    parent: info.parent,
                    tokens: info.tokens.clone(),
                });
            }
        }
        dirty.clear();
        self.dirty = dirty;
        self.emitted += out.len() as u64;
        out
    }
}
