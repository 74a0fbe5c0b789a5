"""Kernel dispatch: the CUDA op (``torch.ops.hybridserve.*``) for CUDA tensors, the pure-torch
twin of ``kernels/reference.py`` otherwise.

Every function has the signature of its twin in ``reference.py`` (same argument order, defaults
and semantics), so callers write ``from hybridserve.kernels import dispatch as K`` and call
``K.ssd_prefill(...)`` etc. The CUDA op runs when the kernel backend (``kernels/backend.py``,
chosen once by the model runner) is CUDA and the op supports the tensors (float32 SSM state;
float32/float16/bfloat16 activations and conv state; float32 probabilities for rejection
sampling); the twin runs otherwise (the CPU, a float64 model, ``HYBRIDSERVE_KERNELS=reference``).

``rejection_sample`` is the device core of speculative verification (after logits processing):
its torch twin is defined here.
"""

from __future__ import annotations

import math

import torch

from hybridserve.kernels import backend
from hybridserve.kernels import reference as ref

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "copy_slots",
    "mamba1_scan",
    "rejection_sample",
    "rejection_sample_reference",
    "selective_state_update",
    "ssd_prefill",
]

_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_cuda(device_tensor: torch.Tensor, supported: bool) -> bool:
    """The CUDA op runs when the kernel backend is CUDA and it supports these tensors; when
    ``HYBRIDSERVE_KERNELS=cuda`` asks for it, always (an unsupported call errors)."""
    if backend.active(device_tensor.device.type) is not backend.Backend.CUDA:
        return False
    return supported or backend.requested() == "cuda"


def _ops():  # noqa: ANN202 - torch.ops namespace object
    from hybridserve.kernels import cuda

    cuda.load_extension()
    return torch.ops.hybridserve


def _ssm_supported(x: torch.Tensor, ssm_state: torch.Tensor, n: int) -> bool:
    return ssm_state.dtype == torch.float32 and x.dtype in _ACT_DTYPES and ssm_state.is_cuda and n <= 256


def _conv_supported(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> bool:
    return (
        x.dtype in _ACT_DTYPES
        and conv_state.dtype in _ACT_DTYPES
        and conv_state.is_cuda
        and 2 <= int(weight.shape[-1]) <= 8
    )


def ssd_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    read_slot: torch.Tensor,
    has_initial_state: torch.Tensor,
    write_slot: torch.Tensor,
    emit_row: torch.Tensor,
    emit_token: torch.Tensor,
    emit_slot: torch.Tensor,
    chunk_size: int,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
) -> torch.Tensor:
    """See ``reference.ssd_prefill``."""
    args = (x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, num_computed_tokens, read_slot)
    args2 = (has_initial_state, write_slot, emit_row, emit_token, emit_slot, int(chunk_size))
    if _use_cuda(x, _ssm_supported(x, ssm_state, int(B.shape[-1]))):
        return _ops().ssd_prefill(*args, *args2, float(dt_min), float(dt_max))
    return ref.ssd_prefill(*args, *args2, dt_min=dt_min, dt_max=dt_max)


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    write_slots: torch.Tensor,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
) -> torch.Tensor:
    """See ``reference.selective_state_update``."""
    args = (x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, read_slot, write_slots)
    if _use_cuda(x, _ssm_supported(x, ssm_state, int(B.shape[-1]))):
        return _ops().selective_state_update(*args, float(dt_min), float(dt_max))
    return ref.selective_state_update(*args, dt_min=dt_min, dt_max=dt_max)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    has_initial_state: torch.Tensor,
    write_slot: torch.Tensor,
    emit_row: torch.Tensor,
    emit_token: torch.Tensor,
    emit_slot: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See ``reference.causal_conv1d_prefill``."""
    args = (x, weight, bias, conv_state, query_start_loc, read_slot, has_initial_state, write_slot)
    args2 = (emit_row, emit_token, emit_slot, activation)
    if _use_cuda(x, _conv_supported(x, weight, conv_state)):
        return _ops().causal_conv1d_prefill(*args, *args2)
    return ref.causal_conv1d_prefill(*args, *args2)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    write_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See ``reference.causal_conv1d_update``."""
    args = (x, weight, bias, conv_state, query_start_loc, read_slot, write_slots, activation)
    if _use_cuda(x, _conv_supported(x, weight, conv_state)):
        return _ops().causal_conv1d_update(*args)
    return ref.causal_conv1d_update(*args)


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor | None:
    """The CUDA op of ``selective_scan.selective_scan_rows`` (same arguments) for CUDA tensors
    with a float32 state of at most 128 per channel; None otherwise: the caller then runs the C++
    CPU kernel or the twin (which, unlike the others here, lives in kernels/selective_scan.py)."""
    supported = ssm_state.dtype == torch.float32 and ssm_state.is_cuda and int(A.shape[-1]) <= 128
    if not _use_cuda(x, supported):
        return None
    return _ops().mamba1_scan(
        x, dt, A, B, C, D, ssm_state, query_start_loc, read_slot, has_initial_state, *writes
    )


def copy_slots(state: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """See ``reference.copy_slots`` (any dtype; the CUDA op copies raw bytes)."""
    if _use_cuda(state, state.is_cuda and state.is_contiguous()):
        _ops().copy_slots(state, src, dst)
        return
    ref.copy_slots(state, src, dst)


# --------------------------------------------------------------------------------------------------
# Rejection sampling core
# --------------------------------------------------------------------------------------------------


def _row_generator(seed: int, offset: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def rejection_sample_reference(
    target_probs: torch.Tensor,
    target_logits: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``torch.ops.hybridserve.rejection_sample`` (see ``rejection_sample``)."""
    dev = target_probs.device
    M, V = target_probs.shape
    ks = [int(k) for k in num_draft_tokens.to("cpu", torch.int64).tolist()]
    R = len(ks)
    greedy = is_greedy.to("cpu", torch.bool).tolist()
    drafts = draft_token_ids.to("cpu", torch.int64).tolist()
    out = torch.full((M,), -1, dtype=torch.int64)
    acc_out = torch.zeros(R, dtype=torch.int64)
    sd = seeds.to("cpu", torch.int64).tolist() if seeds is not None else [0] * R
    of = offsets.to("cpu", torch.int64).tolist() if offsets is not None else [0] * R
    tiny = torch.finfo(torch.float32).tiny
    s = ds = 0
    for r in range(R):
        k = ks[r]
        if greedy[r]:
            src = target_logits if target_logits is not None else target_probs
            am = src[s : s + k + 1].argmax(dim=-1).tolist()
            acc = 0
            while acc < k and am[acc] == drafts[ds + acc]:
                acc += 1
            final = am[acc]
        else:
            gen = None
            if uniforms is None or noise is None:
                gen = _row_generator(sd[r], of[r], dev)
            if uniforms is not None:
                u = uniforms[ds : ds + k].to(dev, torch.float32)
            else:
                u = torch.rand(k, dtype=torch.float32, device=dev, generator=gen)
            acc = 0
            while acc < k:
                d = drafts[ds + acc]
                pd = target_probs[s + acc, d].float()
                qd = (
                    draft_probs[ds + acc, d].float()
                    if draft_probs is not None
                    else torch.ones((), device=dev)
                )
                if bool(u[acc] * qd < pd):
                    acc += 1
                else:
                    break
            p = target_probs[s + acc].float()
            if acc < k:
                d = drafts[ds + acc]
                if draft_probs is None:
                    rec = p.clone()
                    rec[d] = 0.0
                else:
                    rec = (p - draft_probs[ds + acc].float()).clamp_min(0.0)
                dist = rec if bool((rec > 0).any()) else p
            else:
                dist = p
            if noise is not None:
                e = noise[r].to(dev, torch.float32)
            else:
                e = torch.empty(V, dtype=torch.float32, device=dev).exponential_(generator=gen)
            final = int((dist / e.clamp_min(tiny)).argmax())
        out[s : s + acc] = torch.tensor(drafts[ds : ds + acc], dtype=torch.int64)
        out[s + acc] = final
        acc_out[r] = acc
        s += k + 1
        ds += k
    return out.to(dev), acc_out.to(dev)


def rejection_sample(
    target_probs: torch.Tensor,
    target_logits: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts for a whole batch in one launch (docs/kernel-design.md, "Rejection sampling
    kernel").

    Layout as in ``sampling/rejection.py``: request r has ``k_r = num_draft_tokens[r]`` drafts and
    owns the ``k_r + 1`` consecutive rows ``start[r] .. start[r] + k_r`` of ``target_probs``
    ``[M, V]`` (float32, after every logits processor; ``start`` = exclusive cumsum of ``k + 1``);
    its drafts are ``draft_token_ids[dstart[r] : dstart[r] + k_r]`` (``dstart`` = exclusive cumsum
    of k). ``target_logits`` (same shape, e.g. the penalized logits) is the argmax source of greedy
    rows (None: argmax of ``target_probs``); argmax ties pick the first index.
    ``draft_probs`` ``[sum k, V]`` is q (None: one-hot at the draft, n-gram proposers).

    Random rows accept draft j when ``u_j * q_j(d_j) < p_j(d_j)``; at the first rejection the
    emitted token is ``argmax_x r(x) / E_x`` with ``r = max(p - q, 0)`` (no draft probs: p with the
    draft removed; an all-zero r falls back to p), after all accepted the bonus token is
    ``argmax_x p(x) / E_x``. ``uniforms`` ``[sum k]`` (aligned with the drafts; greedy rows'
    entries unused) and ``noise`` ``[R, V]`` Exp(1) make the result deterministic (bit-exact between
    the CUDA op and the twin); without them the CUDA op draws from a Philox stream keyed by
    ``seeds[r]`` at ``offsets[r]`` (advance the offset every step) and the twin from a torch
    generator seeded by (seed, offset): same distribution, different streams.

    Returns ``(tokens [M] int64, num_accepted [R] int64)``: row r's emitted tokens (accepted drafts
    then the recovered/bonus token) are ``tokens[start[r] : start[r] + num_accepted[r] + 1]``;
    every other entry is -1.
    """
    R = int(num_draft_tokens.numel())
    if seeds is None:
        seeds = torch.zeros(R, dtype=torch.int64)
    if offsets is None:
        offsets = torch.zeros(R, dtype=torch.int64)
    supported = target_probs.dtype == torch.float32 and target_probs.is_cuda
    if _use_cuda(target_probs, supported):
        out = _ops().rejection_sample(
            target_probs,
            target_logits,
            draft_token_ids,
            num_draft_tokens,
            is_greedy,
            draft_probs,
            uniforms,
            noise,
            seeds,
            offsets,
        )
        return out[0], out[1]
    return rejection_sample_reference(
        target_probs,
        target_logits,
        draft_token_ids,
        num_draft_tokens,
        is_greedy,
        draft_probs,
        uniforms,
        noise,
        seeds,
        offsets,
    )
