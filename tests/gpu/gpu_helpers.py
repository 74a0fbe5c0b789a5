"""Shared helpers of the GPU kernel tests."""

from __future__ import annotations

import math
from typing import Any

import torch

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"

# Elementwise |out - ref| <= atol * rms(ref) + rtol * |ref|, as (rtol, atol)
# (docs/kernel-design.md, "Tolerances")
OUT_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1.6e-2, 1e-2), torch.bfloat16: (1.6e-2, 1e-2)}
STATE_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-3, 1e-4), torch.bfloat16: (1e-3, 1e-4)}
Tol = tuple[float, float] | float


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / rms(ref) (float64)."""
    o, r = out.double(), ref.double()
    assert o.shape == r.shape, (o.shape, r.shape)
    if r.numel() == 0:
        return 0.0
    assert bool(torch.isfinite(o).all()), "non-finite values in the kernel output (unwritten or overflow)"
    rms = float(r.pow(2).mean().sqrt())
    return float((o - r).abs().max()) / max(rms, 1e-30)


def assert_close(
    out: torch.Tensor,
    ref64: torch.Tensor,
    tol: Tol,
    same_precision: torch.Tensor | None = None,
    what: str = "",
) -> None:
    """Elementwise within (rtol, atol * rms) of the float64 reference (a bare float: rtol = atol),
    or, failing that, a max error (relative to rms) within 2x that of plain torch at the kernel's
    working precision (`same_precision`) + 1e-6 (docs/kernel-design.md, "Tolerances")."""
    rtol, atol = (tol, tol) if isinstance(tol, float) else tol
    o, r = out.double(), ref64.double()
    assert o.shape == r.shape, (what, o.shape, r.shape)
    if r.numel() == 0:
        return
    assert bool(torch.isfinite(o).all()), f"{what}: non-finite values (unwritten element or overflow)"
    rms = max(float(r.pow(2).mean().sqrt()), 1e-30)
    excess = (o - r).abs() - (atol * rms + rtol * r.abs())
    if float(excess.max()) <= 0:
        return
    err = rel_err(o, r)
    if same_precision is not None:
        base = rel_err(same_precision, r)
        if err <= 2 * base + 1e-6:
            return
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} elements out of tolerance (rtol {rtol}, atol {atol} x rms); "
            f"max error {err:.3e} x rms > 2 x torch's {base:.3e}"
        )
    raise AssertionError(
        f"{what}: {int((excess > 0).sum())} elements out of tolerance; max error {err:.3e} x rms"
    )


def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Fill free blocks of the CUDA caching allocator with NaN so an output element that a kernel
    fails to write shows up as NaN (torch.empty reuses these blocks)."""
    if not ON_GPU:
        return
    blocks = [torch.full((nbytes // 4 // 4,), math.nan, device=DEVICE) for _ in range(4)]
    del blocks


def nan_pool(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A state pool poisoned with NaN; slot 0 (the null slot) is zeros."""
    pool = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    pool[0] = 0
    return pool


def gen(seed: int | None = None) -> torch.Generator:
    """A CPU generator; fresh (random) inputs each run unless a seed is given."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def randn(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def ssm_params(H: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A = -(U + 1), D ~ N(0, 1), dt_bias = U - 4 (docs/kernel-design.md, "Test inputs"), float32."""
    A = -(torch.rand(H, generator=g) + 1.0)
    D = torch.randn(H, generator=g)
    dt_bias = torch.rand(H, generator=g) - 4.0
    return A.to(DEVICE), D.to(DEVICE), dt_bias.to(DEVICE)


def qsl_of(lengths: list[int]) -> torch.Tensor:
    q = [0]
    for n in lengths:
        q.append(q[-1] + n)
    return torch.tensor(q, dtype=torch.int64)


def f64(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.double() for t in ts]


def f32(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.float() for t in ts]


def untouched_slots(num_slots: int, touched: set[int]) -> list[int]:
    return [s for s in range(1, num_slots) if s not in touched]


def cuda_demo_llm(**kw: Any) -> Any:
    """The demo model on the GPU with the engine settings the end-to-end tests share; `kw`
    overrides or adds to them."""
    from hybridserve import LLM

    base: dict[str, Any] = dict(
        dtype="float32",
        device="cuda",
        block_size=16,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        max_num_batched_tokens=128,
    )
    return LLM("demo", **{**base, **kw})
