"""torch.compile'd Mamba2 mixer decode and verify for the CPU (``--compile-cpu-kernels``).

Almost every step of a CPU engine is a decode step (one token per row) or, with speculative
decoding, a verify step (1 + k tokens per row); there the eager twins of ``reference.py`` spend
their time in a dozen small ops per layer and token, each reading and writing the whole batch's
state, and every op call costs its dispatch. ``mamba_mixer_rows`` is the part of the mixer between
in_proj and out_proj (conv update, state update, gated RMSNorm) for rows of L tokens each, as one
inductor graph: the state gathers, the per-token updates, the output reductions and the scatters
into the window slots become a few loops. It is the same arithmetic as
``reference.causal_conv1d_update`` and ``reference.selective_state_update`` (tests/
test_kernels_compiled.py holds it to them). Anything else (rows of different lengths, null write
slots, CUDA tensors) goes through kernels/dispatch.py.

Compilation happens on the first call (seconds; inductor keeps its cache on disk), once per dtype,
layer shape and L, and once more for a batch of one row. Only the batch dimension is dynamic
(marked on every call): with every dimension symbolic, inductor's loops over the small fixed
dimensions (heads, state size, conv width) are not vectorised and the kernels run 1.3-2x slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hybridserve.model.layers.norm import gated_rms_norm_torch

logger = logging.getLogger("hybridserve.kernels")


class MixerShape(NamedTuple):
    """The constants of one Mamba2 mixer (compiled into its graph)."""

    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    norm_group_size: int
    norm_eps: float
    dt_min: float
    dt_max: float
    silu: bool


def _mixer_rows(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    z: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    norm_weight: torch.Tensor,
    read_slot: torch.Tensor,
    write_slots: torch.Tensor,
    valid: torch.Tensor,
    s: MixerShape,
) -> torch.Tensor:
    R, L = xbc.shape[0], xbc.shape[1]
    H, P, G, N = s.nheads, s.headdim, s.ngroups, s.dstate
    hpg, d_inner, gn = H // G, H * P, G * N
    # both states are gathered before the first write (a row's write slot may be another's read)
    conv_dt = torch.promote_types(xbc.dtype, conv_state.dtype)
    win = conv_state[read_slot].to(conv_dt)  # [R, conv_dim, W - 1]
    cdt = ssm_state.dtype
    h = ssm_state[read_slot].view(R, G, hpg, P, N)
    w = conv_weight.to(conv_dt)
    Ah = A.to(cdt).view(G, hpg)
    Dh = D.to(cdt).view(G, hpg, 1)
    dtp = F.softplus(dt.to(cdt) + dt_bias.to(cdt), beta=1.0, threshold=20.0)
    dtp = dtp.clamp(min=s.dt_min, max=s.dt_max).view(R, L, G, hpg)
    ys = []
    for t in range(L):
        # causal conv1d update (reference.causal_conv1d_update, one token)
        full = torch.cat([win, xbc[:, t].to(conv_dt)[:, :, None]], dim=2)  # [R, conv_dim, W]
        out = full[:, :, 0] * w[:, 0]
        for k in range(1, w.shape[1]):
            out = out + full[:, :, k] * w[:, k]
        if conv_bias is not None:
            out = out + conv_bias.to(conv_dt)
        if s.silu:
            out = F.silu(out)
        win = full[:, :, 1:]
        # a padding token (t >= the row's length) writes zeros to the null slot 0, which stays zero
        keep = valid[:, t]
        conv_state.index_copy_(
            0, write_slots[:, t], torch.where(keep[:, None, None], win, 0.0).to(conv_state.dtype)
        )
        # selective state update (reference.selective_state_update, one token)
        x, B, C = out.to(xbc.dtype).split([d_inner, gn, gn], dim=-1)
        xs = x.to(cdt).view(R, G, hpg, P)
        dtt = dtp[:, t]
        h = h * torch.exp(dtt * Ah)[..., None, None] + (dtt[..., None] * xs)[..., None] * B.to(cdt).view(
            R, G, 1, 1, N
        )
        ys.append((h * C.to(cdt).view(R, G, 1, 1, N)).sum(-1) + Dh * xs)
        ssm_state.index_copy_(
            0, write_slots[:, t], torch.where(keep[:, None, None, None], h.view(R, H, P, N), 0.0)
        )
    y = torch.stack(ys, dim=1).to(xbc.dtype)  # [R, L, G, hpg, P]
    return gated_rms_norm_torch(
        y.reshape(R, L, d_inner), z, norm_weight, s.norm_group_size, s.norm_eps, xbc.dtype
    )


_compiled: Callable[..., Any] | None = None

# Graphs per process: dtypes x mixer shapes x tokens per row (1 .. 1 + K) x {one row, dynamic}.
_RECOMPILE_LIMIT = 64


def _get() -> Callable[..., Any]:
    global _compiled
    if _compiled is None:
        logger.info(
            "compiling the CPU Mamba2 decode kernels with torch.compile (the first steps take seconds)"
        )
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(cfg, name, max(int(getattr(cfg, name)), _RECOMPILE_LIMIT))
        _compiled = torch.compile(_mixer_rows, dynamic=False, fullgraph=True)
    return _compiled


def _batch_dynamic(*tensors: torch.Tensor) -> None:
    # A batch of one row keeps its own static graph (torch cannot mark a size-1 dim dynamic).
    if tensors[0].shape[0] > 1:
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)


class Rows(NamedTuple):
    """Decode / verify rows padded to L tokens each."""

    token_index: torch.Tensor | None  # int64 [R, L] into the packed tokens (None: rows are packed as is)
    valid: torch.Tensor  # bool [R, L]: t < the row's length
    write_slots: torch.Tensor  # int64 [R, L], 0 (the null slot) at padding positions


def padded_rows(query_start_loc: torch.Tensor, write_slots: torch.Tensor, num_tokens: int) -> Rows | None:
    """The rows of a decode / verify batch padded to its longest row, or None when the compiled
    path cannot take it: no rows, more tokens in a row than write slots, or a real token whose
    state goes to the null slot (the twins skip that write; the graph would not)."""
    R = int(query_start_loc.numel()) - 1
    if R < 1 or num_tokens < R:
        return None
    qsl = query_start_loc.to("cpu", torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    L = int(lengths.max())
    if L > write_slots.shape[1] or int(qsl[-1]) != num_tokens or bool((lengths < 1).any()):
        return None
    t = torch.arange(L, dtype=torch.int64)
    valid = t[None, :] < lengths[:, None]
    ws = write_slots[:, :L].to("cpu", torch.int64)
    if bool((ws[valid] == 0).any()):
        return None
    if bool(valid.all()):
        return Rows(None, valid, ws)
    index = torch.where(valid, qsl[:-1, None] + t[None, :], qsl[:-1, None])  # padding: the row's first token
    return Rows(index, valid, torch.where(valid, ws, 0))


def mamba_mixer_rows(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    z: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    norm_weight: torch.Tensor,
    read_slot: torch.Tensor,
    rows: Rows,
    shape: MixerShape,
) -> torch.Tensor:
    """The Mamba2 mixer between in_proj and out_proj for decode / verify rows (packed row after
    row: ``xbc`` ``[T, conv_dim]``, ``dt`` ``[T, H]``, ``z`` ``[T, d_inner]``), as one compiled
    graph: ``reference.causal_conv1d_update`` on xBC, then ``reference.selective_state_update``
    on its x, B, C, then the grouped gated RMSNorm with z. Row r starts from the states in
    ``read_slot[r]``; the states after its token t go to ``rows.write_slots[r, t]``. Returns the
    normed ``[T, d_inner]`` in ``xbc.dtype``."""
    R, L = int(rows.valid.shape[0]), int(rows.valid.shape[1])
    T = int(xbc.shape[0])
    dev = ssm_state.device
    rs = read_slot.to(dev, torch.int64)
    ws = rows.write_slots.to(dev).contiguous()
    valid = rows.valid.to(dev)
    if rows.token_index is None:
        x3, dt3, z3 = xbc.view(R, L, -1), dt.view(R, L, -1), z.view(R, L, -1)
    else:
        idx = rows.token_index.to(dev)
        x3, dt3, z3 = xbc[idx], dt[idx], z[idx]
    _batch_dynamic(x3, dt3, z3, rs, ws, valid)
    args = (conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state, norm_weight, rs, ws, valid, shape)
    out = _get()(x3, dt3, z3, *args)  # [R, L, d_inner]
    if rows.token_index is None:
        return out.reshape(T, -1)
    packed = out.new_empty((T, out.shape[-1]))
    packed[rows.token_index[rows.valid].to(dev)] = out[valid]
    return packed
