//! Scheduler benches: one schedule() + update_from_output() step with 256 running decode
//! requests (plain decode and K = 3 verify), and a burst of 64 new 2k-token prompts with shared
//! prefixes (add + every step until each has its first token).
//!
//! `cargo bench --bench scheduler` (numbers in benches/README.md).

// A bench drives a fixed, valid workload: an unwrap here can only fail on a bug, never on input.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use hybridserve::config::{MambaCacheMode, ResolvedConfig};
use hybridserve::output::SchedulerOutput;
use hybridserve::request::NewRequest;
use hybridserve::scheduler::Scheduler;

fn config(k: usize) -> ResolvedConfig {
    let mut c = ResolvedConfig::for_tests(MambaCacheMode::Align, k);
    c.block_size = 16;
    c.mamba_block_size = 256;
    c.scan_chunk_size = 128;
    c.max_num_batched_tokens = 8192;
    c.max_num_seqs = 256;
    c.max_model_len = 1 << 20;
    c
}

/// Samples one token per logit; every draft is accepted (so a verify row advances 1 + k).
fn fake_update(s: &mut Scheduler, o: &SchedulerOutput, k: usize, buf: &mut Vec<i32>) {
    buf.clear();
    for (r, &n) in o.num_logits.iter().enumerate() {
        for j in 0..n {
            buf.push(((r as i32) * 7 + j) % 1000 + 3);
        }
    }
    let ns = &o.num_logits;
    let nd: Vec<i32> = vec![k as i32; o.rows.len()];
    let drafts: Vec<i32> = (0..o.rows.len() * k)
        .map(|i| (i % 997) as i32 + 3)
        .collect();
    s.update_from_output(o, buf, ns, Some((&drafts, &nd)))
        .unwrap();
}

/// Steps measured on one scheduler before it is rebuilt, so that contexts stay ~1k tokens.
const STEPS_PER_BUILD: u64 = 256;
const PROMPT_LEN: u32 = 1024;

fn decode_scheduler(k: usize) -> Scheduler {
    let c = config(k);
    let mut s = Scheduler::new(&c, 32768, 256 * (1 + k) + 4096, 0).unwrap();
    for i in 0..256u32 {
        let prompt: Vec<u32> = (0..PROMPT_LEN).map(|j| (i * 131 + j) % 30000 + 1).collect();
        s.add_request(NewRequest::new(format!("req-{i}"), prompt, usize::MAX / 2))
            .unwrap();
    }
    let mut buf = Vec::new();
    while s.num_waiting() > 0 || s.stats().num_scheduled_tokens_last != 256 * (1 + k) {
        let o = s.schedule().unwrap();
        fake_update(&mut s, &o, k, &mut buf);
    }
    s
}

fn bench_decode(c: &mut Criterion) {
    for k in [0usize, 3] {
        let mut buf = Vec::new();
        let name = if k == 0 {
            "decode_step_256".to_string()
        } else {
            format!("verify_step_256_k{k}")
        };
        c.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let mut s = decode_scheduler(k);
                    let n = STEPS_PER_BUILD.min(iters - done);
                    let t = Instant::now();
                    for _ in 0..n {
                        let o = s.schedule().unwrap();
                        black_box(o.num_scheduled_tokens);
                        fake_update(&mut s, &o, k, &mut buf);
                    }
                    total += t.elapsed();
                    done += n;
                }
                total
            })
        });
    }
}

fn burst_prompts() -> Vec<Vec<u32>> {
    // 4 groups of 16 prompts; each group shares a 1536-token prefix; 512 unique tokens each.
    (0..64u32)
        .map(|i| {
            let g = i % 4;
            let mut p: Vec<u32> = (0..1536).map(|j| (g * 7919 + j * 13) % 30000 + 1).collect();
            p.extend((0..512).map(|j| (i * 104729 + j * 31) % 30000 + 1));
            p
        })
        .collect()
}

fn bench_burst(c: &mut Criterion) {
    let prompts = burst_prompts();
    c.bench_function("burst_64x2k_shared_prefix", |b| {
        b.iter_batched(
            || {
                let mut cfg = config(0);
                cfg.max_num_seqs = 64;
                Scheduler::new(&cfg, 16384, 4096, 0).unwrap()
            },
            |mut s| {
                for (i, p) in prompts.iter().enumerate() {
                    s.add_request(NewRequest::new(format!("b{i}"), p.clone(), 1))
                        .unwrap();
                }
                let mut buf = Vec::new();
                let mut steps = 0;
                while s.has_unfinished_requests() {
                    let o = s.schedule().unwrap();
                    fake_update(&mut s, &o, 0, &mut buf);
                    steps += 1;
                }
                black_box(steps)
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_decode, bench_burst
}
criterion_main!(benches);
