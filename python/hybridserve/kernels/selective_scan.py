"""The Mamba1 selective scan (Jamba's mixer) over packed rows: the pure-torch twin, and the entry
points the mixer calls, which take the CUDA op (`torch.ops.hybridserve.mamba1_scan`,
kernels/csrc/cuda/mamba1.cu) on a GPU, the C++ CPU kernel (kernels/native.py `mamba1_scan`) on a
CPU, and this twin otherwise (no kernels built, a float64 state on a GPU).

Mamba1 keeps a state per channel: ``h [D, N]`` for the D = d_inner channels, with a decay per
(channel, state) pair. Token by token, with ``dt [D]`` (already ``softplus(dt_raw + dt_bias)``),
``x [D]``, ``B, C [N]``:

    h = exp(dt[:, None] * A) * h + (dt * x)[:, None] * B[None, :]
    y = h @ C + Dskip * x

(the gate ``silu(z)`` is the mixer's). Unlike Mamba2's SSD there are no chunks: the state after
every token is at hand, so a state can be written after any token of a row.

Rows and states follow the conventions of kernels/reference.py: tokens packed by
``query_start_loc``; ``ssm_state`` ``[num_slots, D, N]`` (the engine's Mamba pool holds it as
``[num_slots, D, 1, N]``: heads of one channel); slot 0 is the null slot (writes to it skipped);
every initial state is read before any slot is written. Everything computes in the dtype of
``ssm_state`` (float32 for a bfloat16 / float16 state: `reference.state_compute_dtype`); y is
returned in the dtype of ``x``.
"""

from __future__ import annotations

import torch

from hybridserve.kernels import dispatch, native
from hybridserve.kernels.reference import _check_emits, _padded_token_index, _step_index, state_compute_dtype

__all__ = ["selective_scan_prefill", "selective_scan_update", "selective_scan_rows"]

# (row, token within the row, slot) of each state write, sorted by row then token
Writes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def selective_scan_rows(
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
    writes: Writes,
) -> torch.Tensor:
    """The twin: every row's recurrence, vectorised over rows and channels, one token index at a
    time. x, dt ``[T, D]``; A ``[D, N]``; B, C ``[T, N]``; D ``[D]``; read_slot ``[R]``;
    has_initial_state ``[R]`` (None: every row reads its slot; a row without one starts from
    zeros); `writes` as `Writes`. Returns y ``[T, D]``."""
    T, Dc = x.shape
    R = int(query_start_loc.numel()) - 1
    cdt = state_compute_dtype(ssm_state.dtype)
    dev = x.device
    if T == 0 or R == 0:
        return torch.empty_like(x)
    h = ssm_state.index_select(0, read_slot.to(ssm_state.device, torch.int64)).to(device=dev, dtype=cdt)
    if has_initial_state is not None:
        h[~has_initial_state.to(dev, torch.bool)] = 0
    idx, valid, lmax = _padded_token_index(query_start_loc)
    w_row, w_tok, w_slot = (w.to("cpu", torch.int64) for w in writes)
    xs, dts, Bs, Cs = (v.to(cdt) for v in (x, dt, B, C))
    As, Ds = A.to(cdt), D.to(cdt)
    y = torch.empty((T, Dc), dtype=cdt, device=dev)
    for t in range(lmax):
        _, ti, rd = _step_index(valid, idx, t, lmax, T, dev)
        dtt, xt = dts[ti], xs[ti]  # [r, D]
        ht = h if isinstance(rd, slice) else h[rd]
        ht.mul_(torch.exp(dtt[:, :, None] * As))
        ht.add_((dtt * xt)[:, :, None] * Bs[ti][:, None, :])
        if not isinstance(rd, slice):
            h[rd] = ht
        y[ti] = (ht * Cs[ti][:, None, :]).sum(-1) + Ds * xt
        at = torch.nonzero(w_tok == t).flatten()
        if at.numel() > 0:
            slots = w_slot[at]
            keep = slots != 0
            if bool(keep.any()):
                vals = h[w_row[at][keep].to(dev)]
                ssm_state.index_copy_(0, slots[keep].to(ssm_state.device), vals.to(ssm_state.dtype))
    return y.to(x.dtype)


def _sorted_writes(rows: torch.Tensor, toks: torch.Tensor, slots: torch.Tensor, num_tokens: int) -> Writes:
    order = torch.argsort(rows * (num_tokens + 1) + toks, stable=True)
    return rows[order].contiguous(), toks[order].contiguous(), slots[order].contiguous()


def _run(
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
    writes: Writes,
) -> torch.Tensor:
    args = (x, dt, A, B, C, D, ssm_state, query_start_loc, read_slot, has_initial_state, writes)
    out = dispatch.mamba1_scan(*args)  # the CUDA op, on a GPU
    if out is None:
        out = native.mamba1_scan(*args)  # the C++ kernel, on a CPU
    return out if out is not None else selective_scan_rows(*args)


def selective_scan_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    has_initial_state: torch.Tensor,
    write_slot: torch.Tensor,
    emit_row: torch.Tensor,
    emit_token: torch.Tensor,
    emit_slot: torch.Tensor,
) -> torch.Tensor:
    """Prefill rows: each starts from ``ssm_state[read_slot[r]]`` when ``has_initial_state[r]``,
    else from zeros; its final state goes to ``write_slot[r]`` and the state after token
    ``emit_token[e]`` of row ``emit_row[e]`` to ``emit_slot[e]`` (the `ssd_prefill` contract of
    kernels/reference.py). Returns y ``[T, D]``."""
    _check_emits(query_start_loc, emit_row, emit_token)
    qsl = query_start_loc.to("cpu", torch.int64)
    R = int(qsl.numel()) - 1
    last = qsl[1:] - qsl[:-1] - 1
    has_tokens = last >= 0
    i64 = torch.int64
    rows = torch.cat([emit_row.to("cpu", i64), torch.arange(R, dtype=i64)[has_tokens]])
    toks = torch.cat([emit_token.to("cpu", i64), last[has_tokens]])
    slots = torch.cat([emit_slot.to("cpu", i64), write_slot.to("cpu", i64)[has_tokens]])
    writes = _sorted_writes(rows, toks, slots, int(qsl[-1]))
    return _run(x, dt, A, B, C, D, ssm_state, qsl, read_slot, has_initial_state, writes)


def selective_scan_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    write_slots: torch.Tensor,
) -> torch.Tensor:
    """Decode / verify rows: each starts from ``ssm_state[read_slot[r]]``; the state after its
    token t goes to ``write_slots[r, t]`` (the `selective_state_update` contract of
    kernels/reference.py). Returns y ``[T, D]``."""
    qsl = query_start_loc.to("cpu", torch.int64)
    R = int(qsl.numel()) - 1
    lengths = qsl[1:] - qsl[:-1]
    ws = write_slots.to("cpu", torch.int64)
    if R > 0 and int(lengths.max()) > ws.shape[1]:
        raise ValueError(
            f"a row has {int(lengths.max())} tokens but write_slots has only {ws.shape[1]} columns"
        )
    _, valid, _ = _padded_token_index(qsl)
    rows = torch.arange(R, dtype=torch.int64)[:, None].expand_as(valid)[valid]
    toks = torch.arange(valid.shape[1], dtype=torch.int64)[None, :].expand_as(valid)[valid]
    writes = (rows.contiguous(), toks.contiguous(), ws[:, : valid.shape[1]][valid].contiguous())
    return _run(x, dt, A, B, C, D, ssm_state, qsl, read_slot, None, writes)
