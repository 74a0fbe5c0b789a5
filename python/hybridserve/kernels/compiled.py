"""torch.compile'd Mamba2 mixer decode for the CPU (``--compile-cpu-kernels``).

A plain decode batch (every row has exactly one token, and writes its states to one real slot) is
what almost every step of a CPU engine runs; there, the eager twins of ``reference.py`` spend their
time in a dozen small ops per layer, each reading and writing the whole batch's state, and every
op call costs its dispatch. ``mamba_mixer_decode`` is the part of the mixer between in_proj and
out_proj (conv update, state update, gated RMSNorm) as one inductor graph: the state gathers, the
update, the output reduction and the scatters into the slots become a few loops. It is the same
arithmetic as ``reference.causal_conv1d_update`` and ``reference.selective_state_update``
restricted to one token per row (tests/test_kernels_compiled.py holds it to them). Anything else
(verify rows with several tokens, null write slots, CUDA tensors) goes through kernels/dispatch.py.

Compilation happens on the first call (seconds; inductor keeps its cache on disk), once per dtype
and layer shape, and once more for a batch of one row. Only the batch dimension is dynamic (marked
on every call): with every dimension symbolic, inductor's loops over the small fixed dimensions
(heads, state size, conv width) are not vectorised and the kernels run 1.3-2x slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hybridserve.model.layers.norm import gated_rms_norm


def _ssu_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    R, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    cdt = ssm_state.dtype
    dtp = F.softplus(dt.to(cdt) + dt_bias.to(cdt), beta=1.0, threshold=20.0)
    dtp = dtp.clamp(min=dt_min, max=dt_max).view(R, G, hpg)
    xs = x.to(cdt).view(R, G, hpg, P)
    h = ssm_state[read_slot].view(R, G, hpg, P, N)
    decay = torch.exp(dtp * A.to(cdt).view(G, hpg))[..., None, None]
    h = h * decay + (dtp[..., None] * xs)[..., None] * B.to(cdt)[:, :, None, None, :]
    y = (h * C.to(cdt)[:, :, None, None, :]).sum(-1) + D.to(cdt).view(G, hpg, 1) * xs
    ssm_state.index_copy_(0, write_slot, h.view(R, H, P, N))
    return y.view(R, H, P).to(x.dtype)


def _conv_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    silu: bool,
) -> torch.Tensor:
    cdt = torch.promote_types(x.dtype, conv_state.dtype)
    w = weight.to(cdt)
    full = torch.cat([conv_state[read_slot].to(cdt), x.to(cdt)[:, :, None]], dim=2)  # [R, Dc, W]
    out = full[:, :, 0] * w[:, 0]
    for k in range(1, w.shape[1]):
        out = out + full[:, :, k] * w[:, k]
    if bias is not None:
        out = out + bias.to(cdt)
    if silu:
        out = F.silu(out)
    conv_state.index_copy_(0, write_slot, full[:, :, 1:].to(conv_state.dtype))
    return out.to(x.dtype)


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


def _mixer_decode(
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
    write_slot: torch.Tensor,
    s: MixerShape,
) -> torch.Tensor:
    R = xbc.shape[0]
    d_inner, gn = s.nheads * s.headdim, s.ngroups * s.dstate
    conv = _conv_decode(xbc, conv_weight, conv_bias, conv_state, read_slot, write_slot, s.silu)
    x, B, C = conv.split([d_inner, gn, gn], dim=-1)
    y = _ssu_decode(
        x.reshape(R, s.nheads, s.headdim), dt, A, B.reshape(R, s.ngroups, s.dstate),
        C.reshape(R, s.ngroups, s.dstate), D, dt_bias, ssm_state, read_slot, write_slot, s.dt_min, s.dt_max,
    )  # fmt: skip
    return gated_rms_norm(y.reshape(R, d_inner), z, norm_weight, s.norm_group_size, s.norm_eps, xbc.dtype)


logger = logging.getLogger("hybridserve.kernels")

_compiled: dict[str, Callable[..., Any]] = {}


def _get(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    f = _compiled.get(name)
    if f is None:
        logger.info(
            "compiling the CPU %s decode kernel with torch.compile (the first decode steps take seconds)",
            name,
        )
        f = torch.compile(fn, dynamic=False, fullgraph=True)
        _compiled[name] = f
    return f


def _batch_dynamic(*tensors: torch.Tensor) -> None:
    # A batch of one row keeps its own static graph (torch cannot mark a size-1 dim dynamic).
    if tensors[0].shape[0] > 1:
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)


def plain_decode_slots(
    query_start_loc: torch.Tensor, write_slots: torch.Tensor, num_tokens: int
) -> torch.Tensor | None:
    """The write slot of each row if the batch is plain decode (one token per row, no null write
    slot), else None."""
    R = int(query_start_loc.numel()) - 1
    if R < 1 or num_tokens != R or int(query_start_loc[-1]) != R:
        return None
    ws = write_slots[:, 0]
    if bool((ws == 0).any()):
        return None
    return ws


def mamba_mixer_decode(
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
    write_slot: torch.Tensor,
    shape: MixerShape,
) -> torch.Tensor:
    """The Mamba2 mixer between in_proj and out_proj for one token per row, as one compiled graph:
    ``reference.causal_conv1d_update`` on xBC, ``reference.selective_state_update`` on its x, B, C,
    then the grouped gated RMSNorm with z. Row r reads its conv and SSM states from
    ``read_slot[r]`` and writes them to ``write_slot[r]`` (no null slots: see plain_decode_slots).
    Returns the normed ``[R, d_inner]`` in ``xbc.dtype``."""
    dev = ssm_state.device
    rs, ws = read_slot.to(dev, torch.int64), write_slot.to(dev, torch.int64)
    _batch_dynamic(xbc, dt, z, rs, ws)
    fn = _get("mixer", _mixer_decode)
    return fn(
        xbc, dt, z, conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state, norm_weight, rs, ws, shape
    )
