"""Scheduler through the Python wrapper: one schedule() + update_from_output() step with 256 running
decode requests (plain and K = 3 verify), and a burst of 64 new 2k-token prompts with shared
prefixes. Target: < 100 us per decode step at 256 requests.

    .venv/bin/python benches/bench_scheduler.py [--steps 2000] [--arrays]

--arrays also reads every array of each output (what the engine does to build a ForwardBatch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hybridserve import _core as core

ARRAYS = (
    "input_ids",
    "positions",
    "query_start_loc",
    "num_computed_tokens",
    "seq_lens",
    "slot_mapping",
    "block_table",
    "state_read_slot",
    "has_initial_state",
    "state_write_slots",
    "emit_row",
    "emit_token",
    "emit_slot",
    "state_copies",
    "logits_indices",
    "num_logits",
    "num_draft_tokens",
    "draft_token_ids",
)


def config(k: int, max_num_seqs: int) -> core.ResolvedConfig:
    return core.resolve_policy(
        has_mamba_layers=True,
        supports_boundary_states=True,
        scan_chunk_size=128,
        max_position_embeddings=1 << 16,
        mamba_cache_mode="align",
        speculative_method="ngram" if k else None,
        num_speculative_tokens=k,
        max_num_batched_tokens=8192,
        max_num_seqs=max_num_seqs,
        max_model_len=1 << 16,
    )


def fake_update(s: core.Scheduler, o: core.SchedulerOutput, k: int, arrays: bool) -> None:
    if arrays:
        for name in ARRAYS:
            getattr(o, name)
        o.req_ids  # noqa: B018
    nl = o.num_logits
    total = int(nl.sum())
    sampled = (np.arange(total, dtype=np.int32) % 997) + 3
    if k:
        nd = np.full(o.num_rows, k, dtype=np.int32)
        drafts = (np.arange(o.num_rows * k, dtype=np.int32) % 991) + 3
        s.update_from_output(o, sampled, nl, drafts, nd)
    else:
        s.update_from_output(o, sampled, nl)


def decode_scheduler(k: int) -> core.Scheduler:
    s = core.Scheduler(config(k, 256), 40000, 256 * (1 + k) + 4096)
    for i in range(256):
        prompt = [(i * 131 + j) % 30000 + 1 for j in range(1024)]
        s.add_request(f"req-{i}", prompt, max_tokens=1 << 15)
    while True:
        o = s.schedule()
        decoding = o.num_decodes == 256
        fake_update(s, o, k, False)
        if decoding:
            return s


def bench_decode(k: int, steps: int, arrays: bool) -> list[float]:
    s = decode_scheduler(k)
    for _ in range(20):  # warm-up
        fake_update(s, s.schedule(), k, arrays)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        o = s.schedule()
        fake_update(s, o, k, arrays)
        times.append(time.perf_counter() - t)
    return times


def bench_burst(reps: int) -> tuple[list[float], int]:
    prompts = []
    for i in range(64):
        g = i % 4
        p = [(g * 7919 + j * 13) % 30000 + 1 for j in range(1536)]
        p += [(i * 104729 + j * 31) % 30000 + 1 for j in range(512)]
        prompts.append(p)
    times = []
    steps = 0
    for _ in range(reps):
        s = core.Scheduler(config(0, 64), 16384, 4096)
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            s.add_request(f"b{i}", p, max_tokens=1)
        steps = 0
        while s.has_unfinished_requests():
            fake_update(s, s.schedule(), 0, True)
            steps += 1
        times.append(time.perf_counter() - t)
    return times, steps


def report(name: str, times: list[float]) -> None:
    us = sorted(t * 1e6 for t in times)
    print(
        f"{name:34s} median {statistics.median(us):8.1f} us   mean {statistics.fmean(us):8.1f}   "
        f"p10 {us[len(us) // 10]:8.1f}   p90 {us[len(us) * 9 // 10]:8.1f}   (n={len(us)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--arrays", action="store_true")
    ap.add_argument("--burst-reps", type=int, default=5)
    a = ap.parse_args()
    report("decode step, 256 reqs", bench_decode(0, a.steps, a.arrays))
    report("verify step, 256 reqs, K=3", bench_decode(3, a.steps, a.arrays))
    times, steps = bench_burst(a.burst_reps)
    report(f"burst 64 x 2k ({steps} steps)", times)


if __name__ == "__main__":
    main()
