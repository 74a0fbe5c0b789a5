//! Criterion benches of the cache manager. Run:
//! `cargo bench --bench cache -- --warm-up-time 1 --measurement-time 3`
//! Configuration: B = 16, M = 256, mode `all`, K = 0 (a Nemotron-H-like setup).

// A bench drives a fixed, valid workload: an unwrap here can only fail on a bug, never on input.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use hybridserve::block_hash::{BlockHash, BlockHasher};
use hybridserve::cache::{CacheHit, CheckpointKind, HybridCacheManager, Prefix};
use hybridserve::config::{MambaCacheMode, ResolvedConfig};

const B: usize = 16;
const M: usize = 256;

fn cfg() -> ResolvedConfig {
    let mut c = ResolvedConfig::for_tests(MambaCacheMode::All, 0);
    c.block_size = B;
    c.mamba_block_size = M;
    c.scan_chunk_size = 128;
    c.max_num_seqs = 256;
    c.max_num_batched_tokens = 8192;
    c.max_model_len = 131072;
    c
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 128_000)
        .collect()
}

fn synthetic_hash(x: u64) -> BlockHash {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let lo = z ^ (z >> 31);
    BlockHash(((lo as u128) << 64) | (lo.rotate_left(17) ^ x) as u128)
}

/// allocate_new + free of a 2k-token request without a hit (128 blocks + a window).
fn alloc_free(c: &mut Criterion) {
    let mut m = HybridCacheManager::new(&cfg(), 16_384, 1024);
    let hit = CacheHit::default();
    c.bench_function("allocate_free_2k_tokens", |b| {
        b.iter(|| {
            let ops = m.allocate_new(1, black_box(&hit), 2048, 0);
            black_box(&ops);
            m.free(1);
        })
    });
}

/// find_longest_cache_hit on a 32k-token prompt whose blocks (2048) and checkpoints (128) are
/// all cached (warm cache, blocks free in the LRU list).
fn lookup(c: &mut Criterion) {
    let n = 32 * 1024;
    let toks = tokens(n, 7);
    let hasher = BlockHasher::new(0);
    let mut h = Vec::new();
    hasher.extend(&mut h, &toks, B, None);
    let mut m = HybridCacheManager::new(&cfg(), 8192, 1024);
    m.allocate_new(1, &CacheHit::default(), n, 0).unwrap();
    m.cache_full_blocks(1, Prefix::of_hashes(&h), n);
    for p in (M..=n).step_by(M) {
        let s = m
            .reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Grid)
            .unwrap();
        m.commit_checkpoint(s);
    }
    m.free(1);
    assert_eq!(
        m.find_longest_cache_hit(Prefix::of_hashes(&h), n + 1)
            .num_tokens,
        n
    );
    c.bench_function("lookup_32k_tokens_warm", |b| {
        b.iter(|| black_box(m.find_longest_cache_hit(Prefix::of_hashes(black_box(&h)), n + 1)))
    });
    // Same prompt, but the checkpoints past 1/4 of it are missing: the scan walks back.
    let mut m2 = HybridCacheManager::new(&cfg(), 8192, 1024);
    m2.allocate_new(1, &CacheHit::default(), n, 0).unwrap();
    m2.cache_full_blocks(1, Prefix::of_hashes(&h), n);
    for p in (M..=n / 4).step_by(M) {
        let s = m2
            .reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Grid)
            .unwrap();
        m2.commit_checkpoint(s);
    }
    m2.free(1);
    assert_eq!(
        m2.find_longest_cache_hit(Prefix::of_hashes(&h), n + 1)
            .num_tokens,
        n / 4
    );
    c.bench_function("lookup_32k_tokens_checkpoint_at_8k", |b| {
        b.iter(|| black_box(m2.find_longest_cache_hit(Prefix::of_hashes(black_box(&h)), n + 1)))
    });
    c.bench_function("hash_32k_tokens", |b| {
        b.iter(|| {
            let mut v = Vec::new();
            hasher.extend(&mut v, black_box(&toks), B, None);
            black_box(v)
        })
    });
}

/// A 2k-token request on a pool whose every free block is a cached prefix block and whose
/// checkpoint budget is full: allocate (128 KV evictions), register 128 new blocks and 8 new
/// checkpoints (8 checkpoint evictions), free.
fn eviction(c: &mut Criterion) {
    let blocks = 4096;
    let mut m = HybridCacheManager::new(&cfg(), blocks + 1, 256 + 64 + 1);
    let mut ctr = 0u64;
    let fill = |ctr: &mut u64| -> Vec<BlockHash> {
        let h = (0..128).map(|i| synthetic_hash(*ctr * 128 + i)).collect();
        *ctr += 1;
        h
    };
    // Warm up to a full pool: every block cached, 64 checkpoints.
    for _ in 0..blocks / 128 + 1 {
        let h = fill(&mut ctr);
        m.allocate_new(1, &CacheHit::default(), 2048, 0).unwrap();
        m.cache_full_blocks(1, Prefix::of_hashes(&h), 2048);
        for p in (M..=2048).step_by(M) {
            if let Some(s) = m.reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Grid) {
                m.commit_checkpoint(s);
            }
        }
        m.free(1);
    }
    assert_eq!(m.stats().kv_blocks_cached_free, blocks);
    let ev0 = m.stats().kv_evictions;
    c.bench_function("evict_full_pool_2k_tokens", |b| {
        b.iter_batched(
            || fill(&mut ctr),
            |h| {
                m.allocate_new(1, &CacheHit::default(), 2048, 0).unwrap();
                m.cache_full_blocks(1, Prefix::of_hashes(&h), 2048);
                for p in (M..=2048).step_by(M) {
                    if let Some(s) = m.reserve_checkpoint(h[p / B - 1], p, CheckpointKind::Grid) {
                        m.commit_checkpoint(s);
                    }
                }
                m.free(1);
            },
            BatchSize::SmallInput,
        )
    });
    assert!(m.stats().kv_evictions > ev0);
}

criterion_group!(benches, alloc_free, lookup, eviction);
criterion_main!(benches);
