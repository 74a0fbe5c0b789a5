//! Unit tests of the hybrid cache manager: one test per rule of docs/prefix-caching.md ("Rules
//! that make caching exact", "Eviction") and per cache mode (docs/cache-modes.md, "Modes").
//! `ResolvedConfig::for_tests`: B = 4, M = 8, max_num_seqs = 16.

use super::*;
use crate::block_hash::BlockHasher;
use crate::config::{CheckpointPlacement, EvictionPolicy, MambaCacheMode, ResolvedConfig};

const B: usize = 4;

fn cfg(mode: MambaCacheMode, k: usize, max_num_seqs: usize) -> ResolvedConfig {
    let mut c = ResolvedConfig::for_tests(mode, k);
    c.max_num_seqs = max_num_seqs;
    c
}

fn attention_only() -> ResolvedConfig {
    let mut c = cfg(MambaCacheMode::None, 0, 2);
    c.has_mamba_layers = false;
    c.enable_prefix_caching = true;
    c
}

fn hashes(tokens: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
    let mut h = Vec::new();
    BlockHasher::new(0).extend(&mut h, tokens, B, salt);
    h
}

fn toks(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + i).collect()
}

/// Runs request `req` (no hit) over all of `tokens`, caches its blocks and commits checkpoints at
/// the given positions. Returns the checkpoint slots.
fn run_and_publish(
    m: &mut HybridCacheManager,
    req: ReqKey,
    tokens: &[u32],
    salt: Option<&str>,
    ckpts: &[usize],
) -> Vec<SlotId> {
    let h = hashes(tokens, salt);
    let ops = m
        .allocate_new(req, &CacheHit::default(), tokens.len(), 0)
        .unwrap();
    assert!(ops.is_empty());
    m.cache_full_blocks(req, Prefix::of_hashes(&h), tokens.len());
    ckpts
        .iter()
        .map(|&p| {
            let s = m
                .reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Grid)
                .unwrap();
            m.commit_checkpoint(s);
            s
        })
        .collect()
}

#[test]
fn checkpoint_published_only_after_commit() {
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::Align, 0, 2), 32, 16);
    let t = toks(17);
    let h = hashes(&t, None);
    m.allocate_new(1, &CacheHit::default(), 17, 0).unwrap();
    m.cache_full_blocks(1, Prefix::of_hashes(&h), 17);
    let s = m.reserve_checkpoint(h[1], 8, CheckpointKind::Grid).unwrap();
    assert_eq!(m.debug_tag(s), Some((h[1], 8)));
    // Pending: KV prefix is there but the checkpoint is not a hit.
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(hit.num_tokens, 0);
    assert_eq!(hit.checkpoint, None);
    assert_eq!(hit.kv_hit_tokens, 16);
    assert_eq!(m.stats().lost_tokens, 16);
    assert_eq!(m.stats().checkpoints_pending, 1);
    // A second reservation for the same prefix is refused (nothing to write).
    assert_eq!(m.reserve_checkpoint(h[1], 8, CheckpointKind::Grid), None);
    m.commit_checkpoint(s);
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(hit.num_tokens, 8);
    assert_eq!(hit.checkpoint, Some(s));
    assert_eq!(hit.kv_blocks, m.block_table(1)[..2].to_vec());
    // Committed: still refused, and a cancelled reservation is never published.
    assert_eq!(m.reserve_checkpoint(h[1], 8, CheckpointKind::Grid), None);
    let s2 = m
        .reserve_checkpoint(h[3], 16, CheckpointKind::Grid)
        .unwrap();
    m.cancel_checkpoint(s2);
    assert_eq!(m.debug_tag(s2), None);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 17)
            .num_tokens,
        8
    );
    // Misaligned positions are refused.
    assert_eq!(m.reserve_checkpoint(h[2], 12, CheckpointKind::Grid), None);
    assert_eq!(m.reserve_checkpoint(h[0], 0, CheckpointKind::Grid), None);
}

#[test]
fn hit_is_at_most_num_tokens_minus_one_exact_boundary() {
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::All, 0, 2), 32, 16);
    let t = toks(24);
    run_and_publish(&mut m, 1, &t, None, &[8, 16, 24]);
    let h = hashes(&t, None);
    // A 16-token prompt: the checkpoint at 16 would leave nothing to compute -> 8.
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h[..4]), 16)
            .num_tokens,
        8
    );
    // 17 tokens: exactly the boundary at 16.
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h[..4]), 17);
    assert_eq!(hit.num_tokens, 16);
    assert_eq!(m.debug_tag(hit.checkpoint.unwrap()), Some((h[3], 16)));
    // 23 tokens: 20 is KV-cached but not a checkpoint boundary -> still 16.
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h[..5]), 23);
    assert_eq!(hit.num_tokens, 16);
    assert_eq!(hit.kv_hit_tokens, 20);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 24)
            .num_tokens,
        16
    );
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 25)
            .num_tokens,
        24
    );
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 1)
            .num_tokens,
        0
    );
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&[]), 0)
            .num_tokens,
        0
    );

    // KV-only model: multiples of B up to num_tokens - 1.
    let mut a = HybridCacheManager::new(&attention_only(), 32, 0);
    run_and_publish(&mut a, 1, &t, None, &[]);
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h[..4]), 16)
            .num_tokens,
        12
    );
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h[..4]), 17)
            .num_tokens,
        16
    );
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h), 23)
            .num_tokens,
        20
    );
}

#[test]
fn hit_needs_kv_and_checkpoint() {
    let c = cfg(MambaCacheMode::Align, 0, 1);
    // 7 usable KV blocks.
    let mut m = HybridCacheManager::new(&c, 8, 16);
    let t = toks(24);
    let h = hashes(&t, None);
    // Checkpoint at 16 only; KV for all 24.
    run_and_publish(&mut m, 1, &t, None, &[16]);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 25)
            .num_tokens,
        16
    );
    // KV all cached, checkpoint at 24 missing: 16, and 8 tokens counted as lost.
    let before = m.stats().lost_tokens;
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 25);
    assert_eq!((hit.num_tokens, hit.kv_hit_tokens), (16, 24));
    assert_eq!(m.stats().lost_tokens - before, 8);
    m.free(1);
    // Evict one cached block: the tail block (tokens 20..24) goes first, the hit stays 16.
    m.allocate_new(2, &CacheHit::default(), 4, 0).unwrap();
    assert_eq!(
        m.stats().kv_evictions,
        0,
        "the uncached free block is used first"
    );
    m.allocate_more(2, 0, 8, 0).unwrap();
    assert_eq!(m.stats().kv_evictions, 1);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 25)
            .kv_hit_tokens,
        20
    );
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 25)
            .num_tokens,
        16
    );
    // Evict the next one (tokens 16..20): [0, 16) is still cached, the hit stays 16.
    m.allocate_more(2, 0, 12, 0).unwrap();
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 25);
    assert_eq!(hit.kv_hit_tokens, 16);
    assert_eq!(hit.num_tokens, 16, "blocks 0..4 cover [0,16)");
    m.allocate_more(2, 0, 16, 0).unwrap();
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 25);
    assert_eq!(hit.kv_hit_tokens, 12);
    assert_eq!(hit.num_tokens, 0, "checkpoint at 16 without KV for [12,16)");
    assert_eq!(m.stats().checkpoints_committed, 1);
}

#[test]
fn copy_on_write_and_pin_until_copied() {
    let c = cfg(MambaCacheMode::Align, 2, 1); // window 3, reserve 3
                                              // 1 null + 3 window reserve + 1 checkpoint slot.
    let mut m = HybridCacheManager::new(&c, 32, 5);
    let t = toks(17);
    let h = hashes(&t, None);
    let ck = run_and_publish(&mut m, 1, &t, None, &[16])[0];
    m.free(1);
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(hit.checkpoint, Some(ck));
    let ops = m.allocate_new(2, &hit, 1, 0).unwrap();
    let w = m.state_window(2).to_vec();
    assert_eq!(w.len(), 3);
    assert!(
        !w.contains(&ck),
        "the running state never lives in the checkpoint"
    );
    assert_eq!(ops, vec![StateOp::Copy { src: ck, dst: w[0] }]);
    assert_eq!(m.debug_tag(ck), Some((h[3], 16)), "checkpoint unchanged");
    // The hit blocks are referenced by request 2 and keep their hashes.
    for &b in &m.block_table(2)[..4] {
        assert_eq!(m.kv_pool().ref_count(b), 1);
        assert!(m.kv_pool().block_hash(b).is_some());
    }
    // A second request hitting the same checkpoint gets its own window; the pool is full, and
    // the pinned checkpoint is not evicted for it.
    let hit3 = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(m.allocate_new(3, &hit3, 1, 0), None);
    assert_eq!(m.stats().checkpoint_evictions, 0);
    // After the copy has run (next allocation of request 2), the checkpoint is evictable again.
    m.allocate_more(2, 16, 1, 0).unwrap();
    m.free(2);
    m.allocate_new(4, &CacheHit::default(), 4, 0).unwrap();
    assert_eq!(m.stats().checkpoints_committed, 1);
    // 4 usable slots: request 4's window holds 3, the checkpoint 1; a 3-slot window for a
    // request beyond max_num_seqs does not fit even by evicting it, and nothing is evicted.
    assert_eq!(m.allocate_new(5, &CacheHit::default(), 4, 0), None);
    assert_eq!(m.stats().checkpoint_evictions, 0);
    m.free(4);
}

#[test]
fn cache_salt_isolates_tenants() {
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::All, 0, 2), 64, 16);
    let t = toks(17);
    run_and_publish(&mut m, 1, &t, Some("tenant-a"), &[8, 16]);
    let ha = hashes(&t, Some("tenant-a"));
    let hb = hashes(&t, Some("tenant-b"));
    let hn = hashes(&t, None);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&ha), 17)
            .num_tokens,
        16
    );
    let hit_b = m.find_longest_cache_hit(Prefix::of_hashes(&hb), 17);
    assert_eq!((hit_b.num_tokens, hit_b.kv_hit_tokens), (0, 0));
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&hn), 17)
            .kv_hit_tokens,
        0
    );
}

#[test]
fn kv_eviction_order_is_lru_tail_first() {
    let mut a = HybridCacheManager::new(&attention_only(), 9, 0); // 8 usable
    let t1 = toks(8);
    let t2: Vec<u32> = (0..8).map(|i| 5000 + i).collect();
    run_and_publish(&mut a, 1, &t1, None, &[]);
    run_and_publish(&mut a, 2, &t2, None, &[]);
    let (h1, h2) = (hashes(&t1, None), hashes(&t2, None));
    a.free(1); // freed first = least recently used
    a.free(2);
    assert_eq!(a.stats().kv_blocks_cached_free, 4);
    // 4 uncached free blocks are used before any eviction.
    a.allocate_new(3, &CacheHit::default(), 16, 0).unwrap();
    assert_eq!(a.stats().kv_evictions, 0);
    // Next: request 1's tail block, then its head, then request 2's tail.
    a.allocate_more(3, 0, 20, 0).unwrap();
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h1), 9)
            .num_tokens,
        4
    );
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h2), 9)
            .num_tokens,
        8
    );
    a.allocate_more(3, 0, 24, 0).unwrap();
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h1), 9)
            .num_tokens,
        0
    );
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h2), 9)
            .num_tokens,
        8
    );
    a.allocate_more(3, 0, 28, 0).unwrap();
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h2), 9)
            .num_tokens,
        4
    );
    assert_eq!(a.stats().kv_evictions, 3);
    // Full pool: more does not fit and nothing is taken.
    a.allocate_more(3, 0, 32, 0).unwrap();
    let before = a.stats();
    assert_eq!(a.allocate_more(3, 0, 36, 0), None);
    assert_eq!(a.allocate_new(4, &CacheHit::default(), 1, 0), None);
    assert_eq!(a.stats(), before);
    assert_eq!(a.block_table(4), &[] as &[BlockId]);
}

fn seq(base: u32) -> Vec<u32> {
    (0..8).map(|i| base + i).collect()
}

#[test]
fn checkpoint_eviction_lru() {
    // max_num_seqs 1, K 0: reserve 1 window slot; 1 null + 1 + cap 3 checkpoints.
    let c = cfg(MambaCacheMode::Align, 0, 1);
    let mut m = HybridCacheManager::new(&c, 64, 5);
    let (ta, tb, tc, td) = (seq(100), seq(200), seq(300), seq(400));
    let sa = run_and_publish(&mut m, 1, &ta, None, &[8])[0];
    m.free(1);
    let sb = run_and_publish(&mut m, 2, &tb, None, &[8])[0];
    m.free(2);
    run_and_publish(&mut m, 3, &tc, None, &[8]);
    m.free(3);
    // Touch a: LRU order b, c, a.
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&hashes(&ta, None)), 9)
            .checkpoint,
        Some(sa)
    );
    let sd = run_and_publish(&mut m, 4, &td, None, &[8])[0];
    assert_eq!(sd, sb, "b (least recently used) was evicted for d");
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&hashes(&tb, None)), 9)
            .num_tokens,
        0
    );
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&hashes(&ta, None)), 9)
            .num_tokens,
        8
    );
    assert_eq!(m.stats().checkpoint_evictions, 1);
}

#[test]
fn checkpoint_without_kv_prefix_is_evicted_first() {
    let c = cfg(MambaCacheMode::Align, 0, 1);
    let mut m = HybridCacheManager::new(&c, 7, 5); // 6 usable KV blocks, cap 3 checkpoints
    let (ta, tb, tc, td) = (seq(100), seq(200), seq(300), seq(400));
    let s1 = run_and_publish(&mut m, 1, &ta, None, &[8])[0];
    m.free(1);
    let s2 = run_and_publish(&mut m, 2, &tb, None, &[8])[0];
    m.free(2);
    // Touch a: by LRU alone b would be evicted first.
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&hashes(&ta, None)), 9)
            .checkpoint,
        Some(s1)
    );
    // 4 blocks: the 2 never-used ones, then a's (LRU) cached blocks are evicted.
    m.allocate_new(3, &CacheHit::default(), 16, 0).unwrap();
    assert_eq!(m.stats().kv_evictions, 2);
    assert!(m.mamba_pool().is_stale(s1));
    assert!(!m.mamba_pool().is_stale(s2));
    m.free(3);
    run_and_publish(&mut m, 4, &tc, None, &[8]);
    m.free(4);
    let s4 = run_and_publish(&mut m, 5, &td, None, &[8])[0];
    assert_eq!(m.stats().kv_evictions, 2);
    assert_eq!(s4, s1, "the stale checkpoint went first");
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&hashes(&tb, None)), 9)
            .checkpoint,
        Some(s2)
    );
    // Re-caching the KV prefix makes a checkpoint live again.
    m.free(5);
    let te = seq(500);
    let s5 = run_and_publish(&mut m, 6, &te, None, &[8])[0];
    m.free(6);
    assert!(!m.mamba_pool().is_stale(s5));
}

#[test]
fn mode_none_on_mamba_model_never_hits() {
    let mut c = cfg(MambaCacheMode::None, 1, 2);
    c.enable_prefix_caching = true;
    let mut m = HybridCacheManager::new(&c, 32, 16);
    let t = toks(17);
    let h = hashes(&t, None);
    m.allocate_new(1, &CacheHit::default(), 17, 0).unwrap();
    assert_eq!(m.state_window(1).len(), 2);
    m.cache_full_blocks(1, Prefix::of_hashes(&h), 17);
    assert_eq!(m.stats().kv_blocks_cached, 0);
    assert_eq!(m.reserve_checkpoint(h[1], 8, CheckpointKind::Grid), None);
    m.free(1);
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(hit, CacheHit::default());
}

#[test]
fn attention_only_model_gets_kv_hits_and_null_windows() {
    let mut c = attention_only();
    c.speculative = ResolvedConfig::for_tests(MambaCacheMode::Align, 2).speculative;
    let mut a = HybridCacheManager::new(&c, 32, 0);
    let t = toks(13);
    let h = hashes(&t, None);
    a.allocate_new(1, &CacheHit::default(), 13, 2).unwrap();
    assert_eq!(a.block_table(1).len(), 4, "13 + 2 lookahead tokens");
    assert_eq!(a.state_window(1), &[NULL_SLOT; 3]);
    // Only accepted tokens are cached: 9 accepted -> 2 blocks.
    a.cache_full_blocks(1, Prefix::of_hashes(&h), 9);
    assert_eq!(a.stats().kv_blocks_cached, 2);
    a.cache_full_blocks(1, Prefix::of_hashes(&h), 13);
    assert_eq!(a.stats().kv_blocks_cached, 3);
    assert_eq!(a.reserve_checkpoint(h[1], 8, CheckpointKind::Grid), None);
    let hit = a.find_longest_cache_hit(Prefix::of_hashes(&h), 13);
    assert_eq!((hit.num_tokens, hit.checkpoint), (12, None));
    let ops = a.allocate_new(2, &hit, 1, 0).unwrap();
    assert!(ops.is_empty());
    assert_eq!(&a.block_table(2)[..3], &a.block_table(1)[..3]);
    assert_eq!(a.kv_pool().ref_count(a.block_table(1)[0]), 2);
    a.free(1);
    a.free(2);
    let s = a.stats();
    assert_eq!(s.kv_blocks_used, 0);
    assert_eq!(
        s.kv_blocks_free + s.kv_blocks_cached_free,
        s.kv_blocks_total
    );
}

#[test]
fn prefix_caching_off_never_caches() {
    let mut c = attention_only();
    c.enable_prefix_caching = false;
    let mut a = HybridCacheManager::new(&c, 32, 0);
    let t = toks(13);
    let h = hashes(&t, None);
    a.allocate_new(1, &CacheHit::default(), 13, 0).unwrap();
    a.cache_full_blocks(1, Prefix::of_hashes(&h), 13);
    assert_eq!(
        a.find_longest_cache_hit(Prefix::of_hashes(&h), 13)
            .num_tokens,
        0
    );
    assert_eq!(a.stats().kv_blocks_cached, 0);
}

#[test]
fn windows_always_fit_for_max_num_seqs() {
    let c = cfg(MambaCacheMode::All, 4, 3); // window 5, reserve 15
    let mut m = HybridCacheManager::new(&c, 256, 1 + 15 + 4);
    // Fill the checkpoint budget (4) and try for more.
    let mut n = 0;
    for r in 0..8u64 {
        let t: Vec<u32> = (0..9).map(|i| 100 * r as u32 + i).collect();
        m.allocate_new(100 + r, &CacheHit::default(), 9, 0).unwrap();
        m.cache_full_blocks(100 + r, Prefix::of_hashes(&hashes(&t, None)), 9);
        if let Some(s) = m.reserve_checkpoint(hashes(&t, None)[1], 8, CheckpointKind::Grid) {
            n += 1;
            if r % 2 == 0 {
                m.commit_checkpoint(s); // half stay pending (not evictable)
            }
        }
        m.free(100 + r);
    }
    assert_eq!(n, 8, "committed ones are evicted LRU for new ones");
    assert!(m.stats().checkpoints_committed + m.stats().checkpoints_pending <= 4);
    for r in 0..3 {
        m.allocate_new(r, &CacheHit::default(), 1, 0).unwrap();
        assert_eq!(m.state_window(r).len(), 5);
    }
    assert_eq!(m.stats().mamba_slots_window, 15);
}

#[test]
fn reset_prefix_cache_refused_while_in_use() {
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::Align, 0, 2), 32, 16);
    m.set_state_bytes_per_slot(1000);
    let t = toks(17);
    let h = hashes(&t, None);
    run_and_publish(&mut m, 1, &t, None, &[8, 16]);
    assert_eq!(m.stats().checkpoint_bytes, 2000);
    assert!(!m.reset_prefix_cache());
    m.free(1);
    let p = m
        .reserve_checkpoint(hashes(&toks(9), Some("x"))[1], 8, CheckpointKind::Grid)
        .unwrap();
    assert!(!m.reset_prefix_cache(), "a checkpoint is pending");
    m.cancel_checkpoint(p);
    assert!(m.reset_prefix_cache());
    let s = m.stats();
    assert_eq!(
        (
            s.kv_blocks_cached,
            s.checkpoints_committed,
            s.mamba_slots_used
        ),
        (0, 0, 0)
    );
    assert_eq!(s.checkpoint_bytes, 0);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), 17)
            .kv_hit_tokens,
        0
    );
}

#[test]
fn stale_hit_is_refused_by_allocate_new() {
    let c = cfg(MambaCacheMode::Align, 0, 1);
    let mut m = HybridCacheManager::new(&c, 6, 8); // 5 usable blocks
    let t = toks(17);
    let h = hashes(&t, None);
    run_and_publish(&mut m, 1, &t, None, &[16]);
    m.free(1);
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(hit.num_tokens, 16);
    // Another request takes every block in between (evicting the hit's blocks).
    m.allocate_new(2, &CacheHit::default(), 20, 0).unwrap();
    assert_eq!(m.allocate_new(3, &hit, 1, 0), None);
    assert_eq!(
        m.allocate_new(2, &CacheHit::default(), 1, 0),
        None,
        "already allocated"
    );
}

#[test]
fn malformed_hits_are_refused_without_taking_anything() {
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::All, 0, 2), 32, 16);
    let t = toks(17);
    let h = hashes(&t, None);
    let ck = run_and_publish(&mut m, 1, &t, None, &[8, 16]);
    m.free(1);
    let good = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(good.num_tokens, 16);
    let before = m.stats();
    let bad = [
        CacheHit {
            num_tokens: 16,
            kv_blocks: vec![0, 0, 0, 0],
            ..good.clone()
        },
        CacheHit {
            num_tokens: 12,
            ..good.clone()
        },
        CacheHit {
            checkpoint: Some(ck[0]),
            ..good.clone()
        },
        CacheHit {
            checkpoint: None,
            ..good.clone()
        },
        CacheHit {
            checkpoint: Some(999),
            ..good.clone()
        },
        CacheHit {
            kv_blocks: good.kv_blocks[..2].to_vec(),
            num_tokens: 8,
            ..good.clone()
        },
    ];
    for (i, hit) in bad.iter().enumerate() {
        assert_eq!(m.allocate_new(2, hit, 1, 0), None, "case {i}");
        assert_eq!(m.stats(), before, "case {i}");
    }
    // The consistent 8-token hit (checkpoint at 8) is fine.
    let eight = CacheHit {
        kv_blocks: good.kv_blocks[..2].to_vec(),
        num_tokens: 8,
        checkpoint: Some(ck[0]),
        kv_hit_tokens: 16,
        ..CacheHit::default()
    };
    let ops = m.allocate_new(2, &eight, 1, 0).unwrap();
    let w0 = m.state_window(2)[0];
    assert_eq!(
        ops,
        vec![StateOp::Copy {
            src: ck[0],
            dst: w0
        }]
    );
}

// ------------------------------------------------------------------ branch placement, tails,
// eviction policies

fn cfg_with(
    mode: MambaCacheMode,
    max_num_seqs: usize,
    placement: CheckpointPlacement,
    eviction: EvictionPolicy,
) -> ResolvedConfig {
    let mut c = cfg(mode, 0, max_num_seqs);
    c.checkpoint_placement = placement;
    c.eviction = eviction;
    c
}

fn prefix<'a>(h: &'a [BlockHash], t: &'a [u32]) -> Prefix<'a> {
    Prefix {
        hashes: h,
        tokens: t,
        root: BlockHasher::new(0).root(None),
    }
}

/// Runs `req` over `tokens` (no hit), caches its blocks and keeps its state after all of them.
fn run_and_keep(m: &mut HybridCacheManager, req: ReqKey, tokens: &[u32]) -> bool {
    resume_and_keep(m, req, tokens, &CacheHit::default())
}

/// Runs `req` over `tokens` starting from `hit` (already queried), caches its blocks and keeps
/// its state after all of them; returns whether it was kept.
fn resume_and_keep(
    m: &mut HybridCacheManager,
    req: ReqKey,
    tokens: &[u32],
    hit: &CacheHit,
) -> bool {
    let h = hashes(tokens, None);
    m.allocate_new(req, hit, tokens.len() - hit.num_tokens, 0)
        .unwrap();
    m.cache_full_blocks(req, Prefix::of_hashes(&h), tokens.len());
    let kept = m.keep_last_state(req, prefix(&h, tokens), tokens.len(), 0);
    m.free(req);
    kept
}

#[test]
fn last_state_with_a_tail_is_hit_exactly_and_copied() {
    for mode in [MambaCacheMode::Align, MambaCacheMode::All] {
        let c = cfg_with(mode, 2, CheckpointPlacement::Branch, EvictionPolicy::Flops);
        let mut m = HybridCacheManager::new(&c, 32, 16);
        let t1 = toks(10); // 2 full blocks + a tail of 2 tokens
        assert!(run_and_keep(&mut m, 1, &t1));
        let tail_blk = m.kv_pool().get_cached(hashes(&t1, None)[1]).unwrap() + 1;
        assert!(m.kv_pool().is_tail(tail_blk));
        assert_eq!(m.stats().checkpoints_by_kind, [0, 0, 1, 0]);
        // A continuation hits all 10 tokens; without tokens (no tail lookup) nothing.
        let mut t2 = t1.clone();
        t2.extend([7, 8, 9]);
        let h2 = hashes(&t2, None);
        assert_eq!(
            m.find_longest_cache_hit(Prefix::of_hashes(&h2), 13)
                .num_tokens,
            0
        );
        let hit = m.find_longest_cache_hit(prefix(&h2, &t2), 13);
        assert_eq!((hit.num_tokens, hit.tail), (10, Some(tail_blk)));
        assert_eq!(hit.kind, Some(CheckpointKind::LastToken));
        assert_eq!(hit.kv_blocks.len(), 2);
        let ops = m.allocate_new(2, &hit, 3, 0).unwrap();
        let table = m.block_table(2).to_vec();
        assert_eq!(&table[..2], &hit.kv_blocks[..]);
        assert_eq!(
            ops,
            vec![
                StateOp::CopyBlock {
                    src: tail_blk,
                    dst: table[2]
                },
                StateOp::Copy {
                    src: hit.checkpoint.unwrap(),
                    dst: m.state_window(2)[0]
                }
            ]
        );
        assert_ne!(table[2], tail_blk, "the tail is copied, never shared");
        assert_eq!(
            m.kv_pool().ref_count(tail_blk),
            1,
            "pinned until the copy ran"
        );
        m.allocate_more(2, 10, 3, 0).unwrap();
        assert_eq!(m.kv_pool().ref_count(tail_blk), 0);
        // Other tail tokens, or a prompt that ends inside the tail, do not hit it.
        let mut t3 = t1[..9].to_vec();
        t3.extend([5, 5, 5]);
        let h3 = hashes(&t3, None);
        assert_eq!(m.find_longest_cache_hit(prefix(&h3, &t3), 12).num_tokens, 0);
        let h4 = hashes(&t1, None);
        assert_eq!(m.find_longest_cache_hit(prefix(&h4, &t1), 10).num_tokens, 0);
        m.free(2);
    }
}

#[test]
fn last_state_needs_the_branch_placement_and_a_checkpoint_mode() {
    let t = toks(10);
    for (mode, placement) in [
        (MambaCacheMode::Align, CheckpointPlacement::Grid),
        (MambaCacheMode::None, CheckpointPlacement::Branch),
    ] {
        let c = cfg_with(mode, 2, placement, EvictionPolicy::Lru);
        let mut m = HybridCacheManager::new(&c, 32, 16);
        assert!(!run_and_keep(&mut m, 1, &t), "{mode:?} {placement:?}");
        assert_eq!(m.stats().checkpoints_committed, 0);
    }
    // One checkpoint per prefix: the same sequence again keeps nothing new.
    let c = cfg_with(
        MambaCacheMode::All,
        2,
        CheckpointPlacement::BranchAndGrid,
        EvictionPolicy::Lru,
    );
    let mut m = HybridCacheManager::new(&c, 32, 16);
    assert!(run_and_keep(&mut m, 1, &t));
    assert!(!run_and_keep(&mut m, 2, &t));
    assert!(run_and_keep(&mut m, 3, &toks(12)), "a block-aligned end");
    assert_eq!(m.stats().checkpoints_committed, 2);
}

#[test]
fn fallback_positions_follow_checkpoints_above() {
    let c = cfg_with(
        MambaCacheMode::All,
        2,
        CheckpointPlacement::Branch,
        EvictionPolicy::Flops,
    );
    let mut m = HybridCacheManager::new(&c, 64, 32);
    let t = toks(24);
    let h = hashes(&t, None);
    m.allocate_new(1, &CacheHit::default(), 24, 0).unwrap();
    m.cache_full_blocks(1, Prefix::of_hashes(&h), 24);
    let at = |m: &mut HybridCacheManager, p: usize| {
        let s = m
            .reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Branch)
            .unwrap();
        m.commit_checkpoint(s);
        s
    };
    let s8 = at(&mut m, 8);
    let s24 = at(&mut m, 24);
    assert_eq!(m.debug_parent_position(s8), 0);
    assert_eq!(m.debug_parent_position(s24), 8);
    // A checkpoint between them becomes s24's fallback...
    let s16 = at(&mut m, 16);
    assert_eq!(m.debug_parent_position(s16), 8);
    assert_eq!(m.debug_parent_position(s24), 16);
    m.free(1);
    // ... and when it goes (the least recently used), s24 falls back to 8 again.
    m.mamba.touch(s8);
    m.mamba.touch(s24);
    let mut all = Vec::new();
    m.mamba.alloc_window(m.mamba.num_free(), &mut all);
    let mut w = Vec::new();
    assert!(m.make_free_slots(1, EvictionCause::ForWindow));
    m.mamba.alloc_window(1, &mut w);
    assert_eq!(m.mamba.kind(s16), Some(SlotKind::Window), "s16 went first");
    assert_eq!(m.debug_parent_position(s24), 8);
}

/// A manager with two finished sequences that share nothing: "short" (8 tokens, committed
/// first) and "long" (40 tokens), each with its state kept at its end, and a pool with room for
/// exactly two checkpoints.
fn two_paths(eviction: EvictionPolicy) -> (HybridCacheManager, SlotId, SlotId) {
    let c = cfg_with(
        MambaCacheMode::All,
        1,
        CheckpointPlacement::Branch,
        eviction,
    );
    let mut m = HybridCacheManager::new(&c, 64, 4); // 3 usable, 1 reserved for a window
    m.set_cost_model(CostModel {
        state_bytes: 1000,
        kv_bytes_per_block: 10,
        flops_per_token: 100.0,
        attn_flops_per_context_token: 1.0,
    });
    let short: Vec<u32> = (500..508).collect();
    assert!(run_and_keep(&mut m, 1, &short));
    let long = toks(40);
    assert!(run_and_keep(&mut m, 2, &long));
    let s_short = m.mamba.lookup(hashes(&short, None)[1]).unwrap();
    let s_long = m.mamba.lookup(hashes(&long, None)[9]).unwrap();
    (m, s_short, s_long)
}

#[test]
fn flops_eviction_keeps_the_checkpoint_that_saves_more_per_byte() {
    // The long checkpoint is also the more recent one; touch the short one last so that LRU
    // and the FLOP score disagree.
    for (eviction, survivor_is_long) in
        [(EvictionPolicy::Lru, false), (EvictionPolicy::Flops, true)]
    {
        let (mut m, s_short, s_long) = two_paths(eviction);
        // With two candidates the normalised scores are (1, 0) against (0, w): the FLOP term
        // wins for a weight above 1.
        m.set_flop_weight(2.0);
        m.mamba.touch(s_short);
        let third: Vec<u32> = (900..912).collect();
        assert!(run_and_keep(&mut m, 3, &third));
        let alive = |s| m.mamba.kind(s) == Some(SlotKind::Committed);
        assert_eq!(
            (alive(s_long), alive(s_short)),
            (survivor_is_long, !survivor_is_long)
        );
        assert_eq!(m.stats().checkpoint_evictions_for_checkpoint, 1);
    }
}

#[test]
fn flops_eviction_spends_useless_kv_first_then_the_cheapest_path() {
    let (mut m, s_short, s_long) = two_paths(EvictionPolicy::Flops);
    let s = m.stats();
    // 2 + 10 cached blocks, all useful: a checkpoint sits at the end of each path.
    assert_eq!(
        (s.kv_blocks_cached, m.kv_pool().num_useful_free()),
        (12, 12)
    );
    let free = m.kv_pool().num_free();
    // Take every block nobody can use, then one more: the short path (cheapest per byte) goes
    // with its checkpoint, the long one stays.
    m.allocate_new(9, &CacheHit::default(), (free - 12) * B, 0)
        .unwrap();
    assert_eq!(m.stats().kv_evictions, 0);
    m.allocate_more(9, (free - 12) * B, B, 0).unwrap();
    let st = m.stats();
    assert_eq!((st.kv_evictions, st.kv_evictions_useless), (1, 1));
    assert_eq!(st.checkpoint_evictions_for_kv, 1);
    assert_eq!(m.mamba.kind(s_short), Some(SlotKind::Free));
    assert_eq!(m.mamba.kind(s_long), Some(SlotKind::Committed));
    // The short path's other block is now useless and goes before any of the long path's.
    m.allocate_more(9, (free - 11) * B, B, 0).unwrap();
    assert_eq!(m.stats().kv_evictions_useless, 2);
    assert_eq!(m.mamba.kind(s_long), Some(SlotKind::Committed));
    let long = toks(40);
    let h = hashes(&long, None);
    let mut more = long.clone();
    more.push(1);
    assert_eq!(
        m.find_longest_cache_hit(prefix(&h, &more), 41).num_tokens,
        40
    );
}

#[test]
fn lru_path_refreshes_every_checkpoint_on_the_hit_path() {
    for (eviction, refreshed) in [
        (EvictionPolicy::Lru, false),
        (EvictionPolicy::LruPath, true),
    ] {
        let c = cfg_with(
            MambaCacheMode::All,
            2,
            CheckpointPlacement::Branch,
            eviction,
        );
        let mut m = HybridCacheManager::new(&c, 64, 32);
        let t = toks(24);
        let h = hashes(&t, None);
        m.allocate_new(1, &CacheHit::default(), 24, 0).unwrap();
        m.cache_full_blocks(1, Prefix::of_hashes(&h), 24);
        let mut slots = Vec::new();
        for p in [8, 24] {
            let s = m
                .reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Branch)
                .unwrap();
            m.commit_checkpoint(s);
            slots.push(s);
        }
        m.free(1);
        let other: Vec<u32> = (700..712).collect();
        assert!(run_and_keep(&mut m, 2, &other));
        let s_other = m.mamba.lookup(hashes(&other, None)[2]).unwrap();
        let mut t2 = t.clone();
        t2.push(3);
        assert_eq!(m.find_longest_cache_hit(prefix(&h, &t2), 25).num_tokens, 24);
        let (u8, u_other) = (m.mamba.last_use(slots[0]), m.mamba.last_use(s_other));
        assert_eq!(u8 > u_other, refreshed, "{eviction:?}");
    }
}

#[test]
fn a_resumed_last_state_is_superseded_by_the_next_one() {
    for (eviction, first_goes) in [(EvictionPolicy::Flops, true), (EvictionPolicy::Lru, false)] {
        let c = cfg_with(
            MambaCacheMode::All,
            1,
            CheckpointPlacement::Branch,
            eviction,
        );
        let mut m = HybridCacheManager::new(&c, 128, 4); // room for two checkpoints
        let other: Vec<u32> = (900..911).collect();
        assert!(run_and_keep(&mut m, 1, &other)); // the older live checkpoint
        let turn1 = toks(10);
        assert!(run_and_keep(&mut m, 2, &turn1));
        // turn 1's state (after 10 tokens: a tail entry)
        let mut probe = turn1.clone();
        probe.push(1);
        let hp = hashes(&probe, None);
        let s1 = m
            .find_longest_cache_hit(prefix(&hp, &probe), 11)
            .checkpoint
            .unwrap();
        // The next turn resumes from turn 1's state and keeps its own: turn 1's state is replaced.
        let mut turn2 = turn1.clone();
        turn2.extend([7, 8, 9, 10, 11]);
        let h2 = hashes(&turn2, None);
        let hit = m.find_longest_cache_hit(prefix(&h2, &turn2), turn2.len());
        assert_eq!((hit.num_tokens, hit.checkpoint), (10, Some(s1)));
        assert!(resume_and_keep(&mut m, 3, &turn2, &hit));
        assert_eq!(m.mamba.is_superseded(s1), first_goes, "{eviction:?}");
        // A third sequence needs a slot: flops takes the superseded state, LRU the oldest one.
        let third: Vec<u32> = (500..509).collect();
        assert!(run_and_keep(&mut m, 4, &third));
        let alive = m.mamba.kind(s1) == Some(SlotKind::Committed);
        assert_eq!(alive, !first_goes, "{eviction:?}");
    }
}

#[test]
fn last_states_that_nobody_resumes_stop_being_kept() {
    let c = cfg_with(
        MambaCacheMode::All,
        1,
        CheckpointPlacement::Branch,
        EvictionPolicy::Flops,
    );
    let mut m = HybridCacheManager::new(&c, 512, 4);
    let mut kept = Vec::new();
    for i in 0..400u32 {
        let t: Vec<u32> = (0..9).map(|j| 10_000 + i * 16 + j).collect();
        kept.push(run_and_keep(&mut m, 100 + i as u64, &t));
    }
    // No admission resumed one: the share of admissions that do fell below 5% after about 36.
    assert!(m.resume_rate < 0.05, "{}", m.resume_rate);
    // At first every state is kept; once the rate has dropped, only one in 16 (to keep learning).
    assert!(kept[..30].iter().all(|&k| k));
    assert!(!kept[40..56].iter().all(|&k| k));
    let late = kept[300..].iter().filter(|&&k| k).count();
    assert!((5..=8).contains(&late), "{late} of 100 kept");
    // LRU keeps them all (the gate is part of the FLOP-aware policy).
    let c = cfg_with(
        MambaCacheMode::All,
        1,
        CheckpointPlacement::Branch,
        EvictionPolicy::Lru,
    );
    let mut m = HybridCacheManager::new(&c, 512, 4);
    for i in 0..100u32 {
        let t: Vec<u32> = (0..9).map(|j| 10_000 + i * 16 + j).collect();
        assert!(run_and_keep(&mut m, 100 + i as u64, &t));
    }
}

#[test]
fn grid_points_take_the_places_of_last_states_that_admissions_do_not_resume() {
    let c = cfg_with(
        MambaCacheMode::All,
        1,
        CheckpointPlacement::BranchAndGrid,
        EvictionPolicy::Flops,
    );
    let m_grid = c.mamba_block_size;
    let mut m = HybridCacheManager::new(&c, 512, 5);
    let cap = m.mamba.checkpoint_cap();
    for i in 0..cap as u32 {
        let t: Vec<u32> = (0..9).map(|j| 20_000 + i * 16 + j).collect();
        assert!(run_and_keep(&mut m, 10 + u64::from(i), &t));
    }
    assert_eq!(m.stats().checkpoints_by_kind, [0, 0, cap, 0]);
    let grid_hash = |n: u32| {
        hashes(
            &(0..(m_grid as u32))
                .map(|j| 30_000 + n * 1000 + j)
                .collect::<Vec<_>>(),
            None,
        )
    };
    // While admissions may still resume them, a grid point does not push a last-token state out.
    let h = grid_hash(0);
    assert_eq!(
        m.reserve_checkpoint(h[m_grid / B - 1], m_grid, CheckpointKind::Grid),
        None
    );
    // Single-turn traffic: admissions that resume nothing (and keep nothing).
    for i in 0..60u64 {
        m.allocate_new(100 + i, &CacheHit::default(), 8, 0).unwrap();
        m.free(100 + i);
    }
    assert!(m.resume_rate < 0.05, "{}", m.resume_rate);
    let h = grid_hash(1);
    let s = m
        .reserve_checkpoint(h[m_grid / B - 1], m_grid, CheckpointKind::Grid)
        .expect("a grid point takes a last-token state's place");
    m.commit_checkpoint(s);
    assert_eq!(m.stats().checkpoints_by_kind, [1, 0, cap - 1, 0]);
    // The LRU baseline keeps its rule: grid points only in spare room or in another grid point's.
    let c = cfg_with(
        MambaCacheMode::All,
        1,
        CheckpointPlacement::BranchAndGrid,
        EvictionPolicy::Lru,
    );
    let mut m = HybridCacheManager::new(&c, 512, 5);
    for i in 0..m.mamba.checkpoint_cap() as u32 {
        let t: Vec<u32> = (0..9).map(|j| 20_000 + i * 16 + j).collect();
        assert!(run_and_keep(&mut m, 10 + u64::from(i), &t));
    }
    for i in 0..60u64 {
        m.allocate_new(100 + i, &CacheHit::default(), 8, 0).unwrap();
        m.free(100 + i);
    }
    let h = grid_hash(1);
    assert_eq!(
        m.reserve_checkpoint(h[m_grid / B - 1], m_grid, CheckpointKind::Grid),
        None
    );
}

/// The prefix of `tokens` under hash seed 0 (the seed `HybridCacheManager::new` uses).
fn prefix_of<'a>(tokens: &'a [u32], h: &'a [BlockHash], salt: Option<&str>) -> Prefix<'a> {
    Prefix {
        hashes: h,
        tokens,
        root: BlockHasher::new(0).root(salt),
    }
}

#[test]
fn events_announce_blocks_only_with_a_checkpoint_at_or_below() {
    use crate::kv_events::{CacheGroup, KvEvent};
    let mut c = cfg(MambaCacheMode::Align, 0, 2);
    c.checkpoint_placement = CheckpointPlacement::Branch;
    let mut m = HybridCacheManager::new(&c, 32, 16);
    m.enable_events();
    let t = toks(13);
    let h = hashes(&t, None);
    m.allocate_new(1, &CacheHit::default(), 13, 0).unwrap();
    m.cache_full_blocks(1, prefix_of(&t, &h, None), 13);
    // Three cached blocks, no checkpoint: nothing a hit could use, nothing announced.
    assert_eq!(m.take_events(), vec![]);
    let s = m
        .reserve_checkpoint(h[1], 8, CheckpointKind::Branch)
        .unwrap();
    assert_eq!(m.take_events(), vec![], "a pending checkpoint is not a hit");
    m.commit_checkpoint(s);
    let stored = |group, i: usize, parent: Option<BlockHash>| KvEvent::Stored {
        group,
        hash: h[i],
        parent,
        tokens: t[i * B..(i + 1) * B].to_vec(),
    };
    // Blocks 0 and 1 (at or above the checkpoint at 8) in order, then the checkpoint; block 2
    // stays unannounced.
    assert_eq!(
        m.take_events(),
        vec![
            stored(CacheGroup::Attention, 0, None),
            stored(CacheGroup::Attention, 1, Some(h[0])),
            stored(CacheGroup::Mamba, 1, Some(h[0])),
        ]
    );
    // The request ends: its last state (13 tokens: a tail of 1 token below block 2) is kept,
    // which makes block 2 usable.
    assert!(m.keep_last_state(1, prefix_of(&t, &h, None), 13, 0));
    let ev = m.take_events();
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert_eq!(ev[0], stored(CacheGroup::Attention, 2, Some(h[1])));
    match &ev[1] {
        KvEvent::Stored {
            group: CacheGroup::Mamba,
            parent,
            tokens,
            ..
        } => assert_eq!((*parent, tokens.as_slice()), (Some(h[2]), &t[12..13])),
        e => panic!("expected the tail checkpoint, got {e:?}"),
    }
    m.free(1);
    // A reset clears everything at once.
    assert!(m.reset_prefix_cache());
    assert_eq!(m.take_events(), vec![KvEvent::AllCleared]);
    assert_eq!(m.num_events(), 6);
}

#[test]
fn events_never_announce_salted_chains() {
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::All, 0, 2), 32, 16);
    m.enable_events();
    let t = toks(9);
    let h = hashes(&t, Some("tenant"));
    m.allocate_new(1, &CacheHit::default(), 9, 0).unwrap();
    m.cache_full_blocks(1, prefix_of(&t, &h, Some("tenant")), 9);
    let s = m
        .reserve_checkpoint(h[1], 8, CheckpointKind::Branch)
        .unwrap();
    m.commit_checkpoint(s);
    assert_eq!(m.take_events(), vec![]);
    // The tenant itself still hits.
    let hit = m.peek_longest_cache_hit(prefix_of(&t, &h, Some("tenant")), 9);
    assert_eq!(hit.num_tokens, 8);
}

#[test]
fn a_hit_whose_blocks_the_whole_pool_cannot_hold_at_once_does_not_fit() {
    // 7 blocks with the null block: 6 usable of B = 4 tokens. A 17-token prompt cached, its
    // blocks free again: a hit of 16 tokens (4 blocks) plus 7 new tokens needs 6 blocks.
    let mut m = HybridCacheManager::new(&cfg(MambaCacheMode::All, 0, 2), 7, 16);
    let t = toks(17);
    let h = hashes(&t, None);
    run_and_publish(&mut m, 1, &t, None, &[8, 16]);
    m.free(1);
    let hit = m.find_longest_cache_hit(Prefix::of_hashes(&h), 17);
    assert_eq!(
        (hit.num_tokens, hit.kv_blocks.len(), hit.tail),
        (16, 4, None)
    );
    assert!(m.hit_fits_pool(&hit, 8)); // 24 tokens: 6 blocks, the pool
    assert!(!m.hit_fits_pool(&hit, 9)); // 25 tokens: 7 blocks

    // a tail block is held (and copied from) beside the new block it is copied into
    let with_tail = CacheHit {
        tail: Some(hit.kv_blocks[3]),
        ..hit.clone()
    };
    assert!(!m.hit_fits_pool(&with_tail, 8));
    assert!(m.hit_fits_pool(&with_tail, 4));
    // what fits is what allocate_new can take with everything else evictable
    assert!(m.allocate_new(2, &hit, 8, 0).is_some());
}

#[test]
fn a_resumed_slot_that_now_holds_another_sequence_is_not_superseded() {
    let c = cfg_with(
        MambaCacheMode::All,
        2,
        CheckpointPlacement::Branch,
        EvictionPolicy::Flops,
    );
    let mut m = HybridCacheManager::new(&c, 64, 5); // two windows, three checkpoints
    let turn1: Vec<u32> = (100..108).collect();
    assert!(run_and_keep(&mut m, 1, &turn1));
    let mut turn2 = turn1.clone();
    turn2.extend([1, 2, 3]);
    let h2 = hashes(&turn2, None);
    let hit = m.find_longest_cache_hit(prefix(&h2, &turn2), turn2.len());
    let s = hit.checkpoint.unwrap();
    assert_eq!(hit.num_tokens, 8);
    m.allocate_new(2, &hit, 3, 0).unwrap();
    m.allocate_more(2, 11, 1, 0).unwrap(); // the copy ran: the checkpoint is unpinned
                                           // other conversations come and go: s is evicted, and its slot comes to hold another one's
                                           // last state
    let mut last = Vec::new();
    for first in [200u32, 300, 400] {
        last = (first..first + 4).collect();
        assert!(run_and_keep(&mut m, u64::from(first), &last));
    }
    let tag = m.mamba.checkpoint_tag(s).unwrap();
    assert_eq!(tag.hash, hashes(&last, None)[0], "the slot was not reused");
    // the conversation that resumed from s ends and keeps its own last state
    m.cache_full_blocks(2, prefix(&h2, &turn2), 11);
    assert!(m.keep_last_state(2, prefix(&h2, &turn2), 11, 0));
    m.free(2);
    assert!(!m.mamba.is_superseded(s));
}

#[test]
fn a_declared_prefix_takes_the_place_of_an_unused_declared_one_and_a_grid_point_does_not() {
    let c = cfg_with(
        MambaCacheMode::All,
        2,
        CheckpointPlacement::BranchAndGrid,
        EvictionPolicy::Flops,
    );
    let mut m = HybridCacheManager::new(&c, 256, 5); // room for two checkpoints
    assert_eq!(m.mamba.checkpoint_cap(), 2);
    let prompt = |i: u32| -> Vec<u32> { (0..17).map(|j| 1000 * (i + 1) + j).collect() };
    let mut declared = Vec::new();
    for i in 0..4u32 {
        let t = prompt(i);
        let h = hashes(&t, None);
        let req = u64::from(i) + 1;
        m.allocate_new(req, &CacheHit::default(), t.len(), 0)
            .unwrap();
        m.cache_full_blocks(req, Prefix::of_hashes(&h), t.len());
        if i == 2 {
            // the checkpoints are all declared ones: a grid point finds no place
            assert_eq!(m.reserve_checkpoint(h[3], 16, CheckpointKind::Grid), None);
        }
        let s = m.reserve_checkpoint(h[1], 8, CheckpointKind::Declared);
        let s = s.unwrap_or_else(|| panic!("declared prefix {i} found no place"));
        m.commit_checkpoint(s);
        declared.push(h[1]);
        m.free(req);
        if i == 0 {
            // a second user shares the first prompt's declared prefix: it was worth keeping
            let mut t2 = t[..8].to_vec();
            t2.extend([5, 6, 7]);
            let h2 = hashes(&t2, None);
            let hit = m.find_longest_cache_hit(prefix(&h2, &t2), t2.len());
            assert_eq!(hit.num_tokens, 8);
            m.allocate_new(90, &hit, t2.len() - 8, 0).unwrap();
            m.free(90);
        }
    }
    // prompts 1 and 2, whose declared prefixes nobody shared, gave their places in turn
    let kept: Vec<bool> = declared
        .iter()
        .map(|&h| m.mamba.has_checkpoint(h))
        .collect();
    assert_eq!(kept, [true, false, false, true]);
}
