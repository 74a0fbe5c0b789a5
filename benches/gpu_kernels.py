"""GPU kernel benchmark at Nemotron-H-8B layer shapes: median time, achieved bytes/s
and FLOP/s, and the fraction of the H200 floor, for each CUDA op beside its pure-torch twin.

    python benches/gpu_kernels.py [--iters 20] [--markdown out.md] [--skip-reference]
    python benches/gpu_kernels.py --smoke      # tiny shapes on the CPU: checks the script only
    python benches/gpu_kernels.py --profile    # also each launch's device time for the SSD scan
                                               # and the rejection sampler (torch profiler)

Floors use the measured H200 constants (HBM 4.3 TB/s, dense bf16 790 TFLOP/s;
docs/kernel-design.md, "H200 floors"): "floor" = max(bytes / BW, FLOP / F) for the byte count the
op must move at minimum (for the SSD scan: the fused floor, inputs + outputs + final state).
Working sets are far above the 50 MB L2.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

BW = 4.3e12  # B/s
FLOPS = 790e12  # FLOP/s (bf16 tensor cores; the SSD floor)

# Nemotron-H-8B layer shapes
H, P, N, G, W, Q = 128, 64, 128, 8, 4, 128
CONV_DIM = H * P + 2 * G * N  # 10240
VOCAB = 131072


@dataclass
class Row:
    name: str
    impl: str
    ms: float
    bytes: float
    flops: float
    target: str

    @property
    def floor_ms(self) -> float:
        return max(self.bytes / BW, self.flops / FLOPS) * 1e3


DEV = torch.device("cuda")
PROFILE = False


def _profile(label: str, fn: Callable[[], object], calls: int = 5) -> None:
    """Print each kernel's time per call of `fn` (device time on CUDA, CPU time in a smoke run)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEV.type == "cuda"
    with profile(
        activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU], acc_events=True
    ) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    print(f"{label}: per call")
    events = [
        e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0
    ]
    events.sort(key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))
    for e in events[:8]:
        us = (e.self_device_time_total if cuda else e.self_cpu_time_total) / calls
        print(f"  {us:9.1f} us  {e.key[:90]}")


def _time(fn: Callable[[], object], iters: int, warmup: int = 3, label: str | None = None) -> float:
    """Median milliseconds per call (CUDA events around each call: host work included); with
    --profile and a label, also each launch's share."""
    for _ in range(warmup):
        fn()
    if PROFILE and label:
        _profile(label, fn)
    if DEV.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _ssm_inputs(T: int, dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    return dict(
        x=torch.randn((T, H, P), device=dev, generator=g).to(bf),
        dt=torch.randn((T, H), device=dev, generator=g).to(bf),
        B=(torch.randn((T, G, N), device=dev, generator=g) * 0.2).to(bf),
        C=(torch.randn((T, G, N), device=dev, generator=g) * 0.2).to(bf),
        A=-(torch.rand(H, device=dev, generator=g) + 1),
        D=torch.randn(H, device=dev, generator=g),
        dt_bias=torch.rand(H, device=dev, generator=g) - 4,
    )


def bench_ssu(R: int, T: int, iters: int, with_ref: bool) -> list[Row]:
    from hybridserve.kernels import dispatch, reference

    dev = DEV
    c = _ssm_inputs(R * T, dev)
    slots = 1 + R * T
    pool = torch.zeros((slots, H, P, N), device=dev)
    qsl = torch.arange(0, R * T + 1, T, dtype=torch.int64, device=dev)
    ws = (torch.arange(R * T, dtype=torch.int64, device=dev) + 1).view(R, T)
    rs = ws[:, 0].clone()
    S = H * P * N * 4
    nbytes = R * (1 + T) * S + R * T * (2 * H * P * 2 + 2 * G * N * 2 + H * 2)
    flops = 5.0 * H * P * N * R * T
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], pool, qsl, rs, ws)
    name = f"selective_state_update {R}x{T} tok"
    target = "verify 64x6: >= 70% of BW" if T > 1 else ""
    rows = [
        Row(name, "cuda", _time(lambda: dispatch.selective_state_update(*args), iters), nbytes, flops, target)
    ]
    if with_ref:
        qc, rc, wc = qsl.cpu(), rs.cpu(), ws.cpu()
        argsr = (*args[:8], qc, rc, wc)
        rows.append(
            Row(
                name,
                "torch",
                _time(lambda: reference.selective_state_update(*argsr), 3, 1),
                nbytes,
                flops,
                "",
            )
        )
    return rows


def bench_ssd(L: int, iters: int, with_ref: bool) -> list[Row]:
    from hybridserve.kernels import dispatch, reference

    dev = DEV
    c = _ssm_inputs(L, dev)
    pool = torch.zeros((3, H, P, N), device=dev)
    z = torch.zeros(0, dtype=torch.int64)
    args = (
        c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], pool,
        torch.tensor([0, L]), torch.tensor([0]), torch.tensor([1]), torch.tensor([False]), torch.tensor([2]),
        z, z, z, Q,
    )  # fmt: skip
    nbytes = L * (H * P * 2 * 2 + 2 * G * N * 2 + H * 2) + H * P * N * 4
    flops = 2.0 * L * H * P * (Q + 2 * N) + 2.0 * L * Q * N * G
    name = f"ssd_prefill {L} tok (fused floor)"
    rows = [
        Row(
            name,
            "cuda",
            _time(lambda: dispatch.ssd_prefill(*args), iters, label=name),
            nbytes,
            flops,
            "within 2x of floor",
        )
    ]
    if with_ref:
        rows.append(Row(name, "torch", _time(lambda: reference.ssd_prefill(*args), 3, 1), nbytes, flops, ""))
    return rows


def bench_conv_prefill(L: int, iters: int, with_ref: bool) -> list[Row]:
    from hybridserve.kernels import dispatch, reference

    dev = DEV
    x = torch.randn((L, CONV_DIM), device=dev).to(torch.bfloat16)
    w = torch.randn((CONV_DIM, W), device=dev)
    b = torch.randn(CONV_DIM, device=dev)
    cs = torch.zeros((3, CONV_DIM, W - 1), device=dev, dtype=torch.bfloat16)
    z = torch.zeros(0, dtype=torch.int64)
    args = (
        x,
        w,
        b,
        cs,
        torch.tensor([0, L]),
        torch.tensor([1]),
        torch.tensor([False]),
        torch.tensor([2]),
        z,
        z,
        z,
    )
    nbytes = 2 * L * CONV_DIM * 2
    flops = 2.0 * L * CONV_DIM * W
    name = f"causal_conv1d_prefill {L} tok"
    rows = [Row(name, "cuda", _time(lambda: dispatch.causal_conv1d_prefill(*args), iters), nbytes, flops, "")]
    if with_ref:
        rows.append(
            Row(name, "torch", _time(lambda: reference.causal_conv1d_prefill(*args), 3, 1), nbytes, flops, "")
        )
    return rows


def bench_conv_update(R: int, T: int, iters: int, with_ref: bool) -> list[Row]:
    from hybridserve.kernels import dispatch, reference

    dev = DEV
    x = torch.randn((R * T, CONV_DIM), device=dev).to(torch.bfloat16)
    w = torch.randn((CONV_DIM, W), device=dev)
    b = torch.randn(CONV_DIM, device=dev)
    cs = torch.zeros((1 + R * T, CONV_DIM, W - 1), device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, R * T + 1, T, dtype=torch.int64, device=dev)
    ws = (torch.arange(R * T, dtype=torch.int64, device=dev) + 1).view(R, T)
    rs = ws[:, 0].clone()
    nbytes = R * (1 + T) * CONV_DIM * (W - 1) * 2 + 2 * R * T * CONV_DIM * 2
    flops = 2.0 * R * T * CONV_DIM * W
    name = f"causal_conv1d_update {R}x{T} tok"
    rows = [Row(name, "cuda", _time(lambda: dispatch.causal_conv1d_update(x, w, b, cs, qsl, rs, ws), iters),
                nbytes, flops, "")]  # fmt: skip
    if with_ref:
        qc, rc, wc = qsl.cpu(), rs.cpu(), ws.cpu()
        rows.append(Row(name, "torch", _time(lambda: reference.causal_conv1d_update(x, w, b, cs, qc, rc, wc), 3, 1),
                        nbytes, flops, ""))  # fmt: skip
    return rows


def bench_copy(n: int, iters: int, with_ref: bool) -> list[Row]:
    from hybridserve.kernels import dispatch, reference

    dev = DEV
    pool = torch.zeros((2 * n + 1, H, P, N), device=dev)
    src = torch.arange(1, n + 1)
    dst = torch.arange(n + 1, 2 * n + 1)
    nbytes = 2.0 * n * H * P * N * 4
    name = f"copy_slots {n} x {H * P * N * 4 / 2**20:.0f} MiB"
    rows = [Row(name, "cuda", _time(lambda: dispatch.copy_slots(pool, src, dst), iters), nbytes, 0.0, "")]
    if with_ref:
        rows.append(
            Row(name, "torch", _time(lambda: reference.copy_slots(pool, src, dst), iters), nbytes, 0.0, "")
        )
    return rows


def bench_rejection(R: int, K: int, iters: int, with_ref: bool) -> list[Row]:
    from hybridserve.kernels import dispatch

    dev = DEV
    g = torch.Generator(device=dev).manual_seed(0)
    p = torch.softmax(torch.randn((R * (K + 1), VOCAB), device=dev, generator=g), -1)
    q = torch.softmax(torch.randn((R * K, VOCAB), device=dev, generator=g), -1)
    drafts = torch.multinomial(q, 1, generator=g).flatten()
    ks = torch.full((R,), K, dtype=torch.int64, device=dev)
    greedy = torch.zeros(R, dtype=torch.bool, device=dev)
    seeds = torch.arange(R, device=dev)
    offs = torch.zeros(R, dtype=torch.int64, device=dev)
    nbytes = 2.0 * R * VOCAB * 4  # lazy floor: one p row + one q row per request
    name = f"rejection_sample {R}x{K} drafts, V={VOCAB}"
    args = (p, None, drafts, ks, greedy, q)

    def run() -> object:
        return dispatch.rejection_sample(*args, seeds=seeds, offsets=offs)

    rows = [Row(name, "cuda", _time(run, iters, label=name), nbytes, 0.0, "< 100 us")]
    # the engine's path: explicit uniforms and noise from its keyed draws (the noise row is read too)
    u = torch.rand(R * K, device=dev, generator=g)
    noise = -torch.log(torch.rand((R, VOCAB), device=dev, generator=g))
    rows.append(
        Row(
            f"{name}, noise given",
            "cuda",
            _time(
                lambda: dispatch.rejection_sample(*args, u, noise, seeds=seeds, offsets=offs),
                iters,
                label=f"{name}, noise given",
            ),
            3.0 * R * VOCAB * 4,
            0.0,
            "",
        )
    )
    # greedy rows read every target row of the request
    gargs = (p, torch.log(p), drafts, ks, torch.ones(R, dtype=torch.bool, device=dev), q)
    rows.append(
        Row(
            f"{name}, greedy",
            "cuda",
            _time(
                lambda: dispatch.rejection_sample(*gargs, seeds=seeds, offsets=offs),
                iters,
                label=f"{name}, greedy",
            ),
            1.0 * R * (K + 1) * VOCAB * 4,
            0.0,
            "",
        )
    )
    if with_ref:
        rows.append(Row(name, "torch", _time(lambda: dispatch.rejection_sample_reference(*args, seeds=seeds,
                                                                                         offsets=offs), 2, 1),
                        nbytes, 0.0, ""))  # fmt: skip
    return rows


def _fmt(rows: list[Row]) -> str:
    head = "| kernel | impl | median | achieved B/s | achieved FLOP/s | floor | of floor | target |\n"
    head += "|---|---|---|---|---|---|---|---|\n"
    out = []
    for r in rows:
        t = r.ms * 1e-3
        out.append(
            f"| {r.name} | {r.impl} | {r.ms * 1e3:.1f} us | {r.bytes / t / 1e9:.1f} GB/s | "
            f"{r.flops / t / 1e12:.2f} TF/s | {r.floor_ms * 1e3:.1f} us | {r.floor_ms / r.ms:.1%} | {r.target} |"
        )
    return head + "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--skip-reference", action="store_true", help="do not time the pure-torch twins")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script only)")
    ap.add_argument(
        "--profile", action="store_true", help="print each launch's time for the SSD and rejection rows"
    )
    a = ap.parse_args(argv)
    global DEV, H, P, N, G, Q, CONV_DIM, VOCAB, PROFILE
    PROFILE = a.profile
    if a.smoke:
        DEV = torch.device("cpu")
        H, P, N, G, Q = 4, 16, 16, 2, 16
        CONV_DIM, VOCAB = H * P + 2 * G * N, 512
        R, L = 4, 40
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to benchmark", file=sys.stderr)
            return 0
        from hybridserve.kernels import cuda

        cuda.load_extension()
        torch.backends.cuda.matmul.allow_tf32 = False
        R, L = 64, 8192
    ref = not a.skip_reference
    rows: list[Row] = []
    rows += bench_ssu(R, 6, a.iters, ref)
    rows += bench_ssu(R, 1, a.iters, ref)
    rows += bench_ssd(L, a.iters, ref)
    rows += bench_conv_prefill(L, a.iters, ref)
    rows += bench_conv_update(R, 6, a.iters, ref)
    rows += bench_copy(R, a.iters, ref)
    rows += bench_rejection(R, 5, a.iters, ref)
    table = _fmt(rows)
    dev = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (smoke run: twins only)"
    header = (
        f"Device: {dev}; torch {torch.__version__} (CUDA {torch.version.cuda}); median of {a.iters} runs.\n\n"
    )
    print(header + table)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(header + table)
    assert all(math.isfinite(r.ms) for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
