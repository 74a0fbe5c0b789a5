"""Pure-torch reference kernels: the CPU path of the engine and the oracle of the CUDA ops.

The CUDA extension mirrors every public function here as ``torch.ops.hybridserve.<name>`` with the
SAME argument order, shapes, dtypes and semantics. Keep these signatures stable.

Conventions shared by all ops
-----------------------------
* Tokens are packed: row r owns flat tokens ``[query_start_loc[r], query_start_loc[r + 1])``.
  ``query_start_loc`` is int64 ``[R + 1]`` with ``query_start_loc[0] == 0`` (pass a slice rebased
  to 0 when calling on a subset of a batch). Zero-length rows are allowed and do nothing.
* Slots index dim 0 of the state tensors. Slot 0 is the null slot: a write to slot 0 is skipped
  (never performed), so slot 0 keeps whatever it was allocated with (zeros). Reading slot 0 is
  allowed (reads those zeros) but the engine never relies on it.
* Every op reads all the initial states it needs BEFORE it writes any slot, so a read slot may also
  appear among the write slots of the same call (the spec-decode state window relies on this).
* SSM state ``ssm_state``: ``[num_slots, H, P, N]`` (N contiguous), float32 or float64.
  Conv state ``conv_state``: ``[num_slots, conv_dim, W - 1]`` ("DS" layout, state_len contiguous),
  holding the last W - 1 *pre-convolution* inputs, oldest first.
* Compute precision: the SSM ops compute in the dtype of ``ssm_state`` (fp32 or fp64); the conv ops
  in ``torch.promote_types(x.dtype, conv_state.dtype)``. Outputs have the dtype of ``x``.
* dt pipeline (identical in prefill and decode): ``dt = softplus(dt_raw + dt_bias)`` with the
  overflow-safe threshold (``v if v > 20 else log1p(exp(v))``), then ``clamp(dt, dt_min, dt_max)``.
  ``A`` is the per-head negative scalar ``-exp(A_log)``; ``D`` the per-head skip ``[H]``.
* Head h uses group ``h // (H // G)`` of B and C.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "copy_slots",
    "process_dt",
    "selective_state_update",
    "ssd_prefill",
]


# Upper bound of the intra-chunk decay matrix of one ssd_prefill step (chunks are processed in
# groups that fit).
SSD_DECAY_BUDGET_BYTES = 128 << 20


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), dt_min, dt_max)`` with torch's threshold-20 softplus
    (``v`` itself for ``v > 20``: no overflow). ``dt`` is ``[..., H]``, ``dt_bias`` ``[H]``; the
    result has the dtype of ``dt``."""
    v = dt + dt_bias.to(dt.dtype)
    out = F.softplus(v, beta=1.0, threshold=20.0)
    if dt_min > 0.0 or dt_max < math.inf:
        out = out.clamp(min=dt_min, max=dt_max)
    return out


def state_compute_dtype(state_dtype: torch.dtype) -> torch.dtype:
    """What a Mamba recurrence computes in: its states' dtype, but float32 for states kept in
    bfloat16 or float16 (a checkpoint's `mamba_ssm_cache_dtype`), which are widened when read and
    rounded once when written, as vLLM's kernels treat them: a recurrence carried in bfloat16
    would round every token's update."""
    return torch.float32 if state_dtype in (torch.bfloat16, torch.float16) else state_dtype


def _write_slots(state: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """state[slots[i]] = values[i] for every slot != 0 (slot 0 = null, skipped)."""
    if slots.numel() == 0:
        return
    keep = slots != 0
    if not bool(keep.all()):
        slots = slots[keep]
        values = values[keep]
        if slots.numel() == 0:
            return
    state.index_copy_(0, slots.to(device=state.device, dtype=torch.int64), values.to(state.dtype))


def _row_ids(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row index of each packed token, int64 [T] (CPU)."""
    qsl = query_start_loc.to("cpu", torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), dtype=torch.int64), lengths, output_size=num_tokens
    )


def _check_emits(query_start_loc: torch.Tensor, emit_row: torch.Tensor, emit_token: torch.Tensor) -> None:
    """Every emit names a row of the call and a token inside it (ValueError otherwise); any token
    of a row may be emitted."""
    if emit_row.numel() == 0:
        return
    qsl = query_start_loc.to("cpu", torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    er = emit_row.to("cpu", torch.int64)
    et = emit_token.to("cpu", torch.int64)
    if bool((er < 0).any()) or bool((er >= lengths.numel()).any()):
        raise ValueError("emit_row out of range")
    if bool((et < 0).any()) or bool((et >= lengths[er]).any()):
        raise ValueError("emit_token out of range of its row")


# --------------------------------------------------------------------------------------------------
# SSD scan (prefill)
# --------------------------------------------------------------------------------------------------


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
    """Chunked SSD scan over packed variable-length prefill rows.

    Args:
        x: ``[T, H, P]`` (may be a strided view).
        dt: ``[T, H]`` raw dt (before bias / softplus / clamp).
        A: ``[H]`` negative (``-exp(A_log)``).
        B, C: ``[T, G, N]``.
        D: ``[H]`` skip.
        dt_bias: ``[H]``.
        ssm_state: ``[num_slots, H, P, N]`` fp32/fp64 (bf16/fp16: computed in fp32, `state_compute_dtype`), read and written in place.
        query_start_loc: int64 ``[R + 1]``, starting at 0.
        num_computed_tokens: int64 ``[R]``: absolute position of each row's first token. Chunks are
            aligned to ABSOLUTE positions: chunk boundaries sit at multiples of ``chunk_size`` from
            the sequence start, so a row continuing at ``num_computed % Q != 0`` starts with a short
            chunk of ``Q - num_computed % Q`` tokens (capped by its length).
        read_slot: int64 ``[R]``: the initial state of row r is ``ssm_state[read_slot[r]]`` if
            ``has_initial_state[r]`` else zeros.
        has_initial_state: bool ``[R]``.
        write_slot: int64 ``[R]``: the state after the row's last token goes there (0 = skip).
        emit_row, emit_token, emit_slot: int64 ``[E]``: the state after token ``emit_token[e]``
            (index within row ``emit_row[e]``, a row of THIS call) is written to ``emit_slot[e]``
            (0 = skip). Any token of the row may be emitted (a checkpoint may sit on any block
            boundary, not only on a chunk end); a row or token out of range is a ValueError.
        chunk_size: Q.
        dt_min, dt_max: dt clamp after softplus (``(0, inf)`` = no clamp).

    Returns:
        y ``[T, H, P]`` in ``x.dtype``: ``y_t = C_t . h_t + D * x_t`` (no z gating; the gated norm
        is applied by the model).

    Writes happen after all reads: final states, then emits (in index order).
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = int(query_start_loc.numel()) - 1
    cdt = state_compute_dtype(ssm_state.dtype)
    dev = x.device
    Q = int(chunk_size)
    if H % G != 0:
        raise ValueError(f"nheads {H} not divisible by ngroups {G}")
    if T == 0 or R == 0:
        return torch.empty_like(x)
    _check_emits(query_start_loc, emit_row, emit_token)
    hpg = H // G

    qsl = query_start_loc.to("cpu", torch.int64)
    nct = num_computed_tokens.to("cpu", torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    row = _row_ids(qsl, T)  # [T]
    tok = torch.arange(T, dtype=torch.int64) - qsl[row]  # index within row
    abs_pos = nct[row] + tok
    first_chunk = nct // Q  # absolute chunk id of each row's first token
    last_chunk = torch.where(lengths > 0, (nct + lengths - 1) // Q, first_chunk - 1)
    nchunks_row = (last_chunk - first_chunk + 1).clamp(min=0)  # [R]
    chunk_off = torch.zeros(R + 1, dtype=torch.int64)
    chunk_off[1:] = torch.cumsum(nchunks_row, 0)
    NC = int(chunk_off[-1])
    tok_chunk = chunk_off[row] + (abs_pos // Q - first_chunk[row])  # global chunk of each token
    tok_pos = abs_pos % Q  # position inside the chunk (leading padding on a short first chunk)
    flat = (tok_chunk * Q + tok_pos).to(dev)

    # ---- dt pipeline, padded chunk layout [NC, Q, ...] (padding: x = 0, dt = 0 -> no effect) ----
    dtp = process_dt(dt.to(cdt), dt_bias.to(cdt), dt_min, dt_max)  # [T, H]
    # every row starts and ends on a chunk boundary: the padded layout is the packed one
    unpadded = NC * Q == T
    if unpadded:
        xc = x.to(cdt).reshape(T, G, hpg, P)
        dtc = dtp.reshape(T, G, hpg)
        Bc = B.to(cdt).reshape(T, G, N)
        Cc = C.to(cdt).reshape(T, G, N)
    else:
        xc = x.new_zeros((NC * Q, G, hpg, P), dtype=cdt)
        xc[flat] = x.to(cdt).reshape(T, G, hpg, P)
        dtc = dtp.new_zeros((NC * Q, G, hpg))
        dtc[flat] = dtp.reshape(T, G, hpg)
        Bc = x.new_zeros((NC * Q, G, N), dtype=cdt)
        Bc[flat] = B.to(cdt)
        Cc = x.new_zeros((NC * Q, G, N), dtype=cdt)
        Cc[flat] = C.to(cdt)
    xc = xc.view(NC, Q, G, hpg, P)
    dtc = dtc.view(NC, Q, G, hpg)
    Bc = Bc.view(NC, Q, G, N)
    Cc = Cc.view(NC, Q, G, N)
    Ah = A.to(cdt).view(G, hpg)

    dA = dtc * Ah  # [NC, Q, G, hpg], <= 0
    Lam = torch.cumsum(dA, dim=1)  # inclusive cumulative log decay
    # intra-chunk decay exp(Lam_i - Lam_j) for i >= j
    # (in groups of chunks so that the [chunks, H, Q, Q] decay matrix stays within the budget)
    LamT = Lam.permute(0, 2, 3, 1).contiguous()  # [NC, G, hpg, Q]
    causal = torch.ones(Q, Q, dtype=cdt, device=dev).tril()
    dtx = xc * dtc[..., None]  # [NC, Q, G, hpg, P]
    dtxT = dtx.permute(0, 2, 3, 1, 4)  # [NC, G, hpg, Q, P]
    y_diag = torch.empty((NC, Q, G, hpg, P), dtype=cdt, device=dev)
    group = max(1, SSD_DECAY_BUDGET_BYTES // max(1, H * Q * Q * ssm_state.element_size()))
    for c0 in range(0, NC, group):
        c1 = min(NC, c0 + group)
        lt = LamT[c0:c1]
        # exp(Lam_i - Lam_j) for i >= j, where Lam_i - Lam_j <= 0 (dt >= 0, A < 0). Above the
        # diagonal the difference is clamped to 0 (no overflow) and the causal mask, folded into
        # C.B (smaller than M by the heads per group), zeroes it; exp(-inf) would cost twice as much as exp(0).
        M = (lt[..., :, None] - lt[..., None, :]).clamp_(max=0.0).exp_()  # [c, G, hpg, Qi, Qj]
        CB = torch.einsum("cign,cjgn->cgij", Cc[c0:c1], Bc[c0:c1]).mul_(causal)  # [c, G, Qi, Qj]
        M.mul_(CB[:, :, None])
        y_diag[c0:c1] = torch.matmul(M, dtxT[c0:c1]).permute(0, 3, 1, 2, 4)

    # chunk states from zero init: S_c = sum_j exp(Lam_last - Lam_j) dt_j x_j B_j^T
    decay_to_end = torch.exp(Lam[:, -1:] - Lam)  # [NC, Q, G, hpg]
    S = torch.einsum("cjgh,cjghp,cjgn->cghpn", decay_to_end, dtx, Bc)  # [NC, G, hpg, P, N]
    chunk_decay = torch.exp(Lam[:, -1])  # [NC, G, hpg]

    # ---- initial states (gathered before any write) ----
    init = ssm_state.new_zeros((R, H, P, N), dtype=cdt)
    his = has_initial_state.to("cpu", torch.bool)
    if bool(his.any()):
        idx = torch.nonzero(his).flatten()
        src = read_slot.to("cpu", torch.int64)[idx].to(ssm_state.device)
        init.index_copy_(0, idx.to(dev), ssm_state.index_select(0, src).to(cdt))
    init = init.view(R, G, hpg, P, N)

    # ---- state passing: sequential over the local chunk index, vectorised over rows ----
    prev = torch.empty((NC, G, hpg, P, N), dtype=cdt, device=dev)  # state entering chunk c
    end = torch.empty((NC, G, hpg, P, N), dtype=cdt, device=dev)  # state after chunk c
    max_local = int(nchunks_row.max()) if R > 0 else 0
    cur = init.clone()
    for k in range(max_local):
        rows_k = torch.nonzero(nchunks_row > k).flatten()
        cidx = (chunk_off[rows_k] + k).to(dev)
        rk = rows_k.to(dev)
        h_in = cur[rk]
        prev[cidx] = h_in
        h_out = chunk_decay[cidx][..., None, None] * h_in + S[cidx]
        end[cidx] = h_out
        cur[rk] = h_out

    # off-diagonal: exp(Lam_i) * C_i . H_prev
    y_off = torch.einsum("cign,cghpn->cighp", Cc, prev) * torch.exp(Lam)[..., None]
    y = (y_diag + y_off).reshape(NC * Q, H, P)
    if not unpadded:
        y = y[flat]
    y = y + D.to(cdt)[None, :, None] * x.to(cdt)

    # ---- writes: final states then emits ----
    has_chunks = nchunks_row > 0
    final_chunk = (chunk_off[1:] - 1).clamp(min=0)
    ws = write_slot.to("cpu", torch.int64).clone()
    ws[~has_chunks] = 0
    _write_slots(ssm_state, ws.to(ssm_state.device), end[final_chunk.to(dev)].reshape(R, H, P, N))
    if emit_row.numel() > 0:
        er = emit_row.to("cpu", torch.int64)
        et = emit_token.to("cpu", torch.int64)
        ec = chunk_off[er] + ((nct[er] + et) // Q - first_chunk[er])
        ep = (nct[er] + et) % Q  # the emitted token's position in its padded chunk
        vals = end[ec.to(dev)]
        # a token that ends its chunk or its row has the chunk-end state (trailing padding has
        # dt = 0: no decay, no input); a token inside a chunk gets its own state on the side, so
        # the main scan stays as it is
        mid = torch.nonzero((ep != Q - 1) & (et != lengths[er] - 1)).flatten()
        if mid.numel() > 0:
            vals[mid.to(dev)] = _states_inside_chunks(Lam, dtx, Bc, prev, ec[mid], ep[mid])
        _write_slots(ssm_state, emit_slot.to(ssm_state.device, torch.int64), vals.reshape(-1, H, P, N))
    return y.to(x.dtype)


def _states_inside_chunks(
    Lam: torch.Tensor,
    dtx: torch.Tensor,
    Bc: torch.Tensor,
    prev: torch.Tensor,
    chunk: torch.Tensor,
    pos: torch.Tensor,
) -> torch.Tensor:
    """The state after position ``pos[e]`` of padded chunk ``chunk[e]`` (CPU int64 ``[E]``), from
    the chunk's inputs (``Lam`` ``[NC, Q, G, hpg]``, ``dtx`` ``[NC, Q, G, hpg, P]``, ``Bc``
    ``[NC, Q, G, N]``) and the state entering it (``prev`` ``[NC, G, hpg, P, N]``):
    ``h = exp(Lam_i) prev + sum_{j <= i} exp(Lam_i - Lam_j) dt_j x_j B_j^T``. Leading padding has
    ``dt = 0``, so it adds nothing. Returns ``[E, G, hpg, P, N]``."""
    NC, Q, G, hpg, P = dtx.shape
    N = Bc.shape[-1]
    dev = dtx.device
    E = int(chunk.numel())
    out = torch.empty((E, G, hpg, P, N), dtype=dtx.dtype, device=dev)
    j = torch.arange(Q, dtype=torch.int64)
    # a group of emits gathers its chunks' weighted inputs (twice: dt x and w dt x) and forms its
    # states: kept within the decay budget
    per_emit = G * hpg * P * (2 * Q + N) + Q * G * (hpg + N)
    group = max(1, SSD_DECAY_BUDGET_BYTES // max(1, per_emit * dtx.element_size()))
    for e0 in range(0, E, group):
        e1 = min(E, e0 + group)
        c = chunk[e0:e1].to(dev)
        i = pos[e0:e1]
        lam = Lam[c]  # [e, Q, G, hpg]
        lam_i = lam[torch.arange(e1 - e0, device=dev), i.to(dev)]  # [e, G, hpg]
        keep = (j[None, :] <= i[:, None]).to(device=dev, dtype=dtx.dtype)  # [e, Q]
        # Lam_i - Lam_j <= 0 for j <= i; clamped to 0 past i (masked out) so that exp stays finite
        w = (lam_i[:, None] - lam).clamp_(max=0.0).exp_().mul_(keep[:, :, None, None])  # [e, Q, G, hpg]
        S = torch.einsum("ejghp,ejgn->eghpn", w[..., None] * dtx[c], Bc[c])
        out[e0:e1] = torch.exp(lam_i)[..., None, None] * prev[c] + S
    return out


# --------------------------------------------------------------------------------------------------
# Selective state update (decode / speculative verify)
# --------------------------------------------------------------------------------------------------


def _padded_token_index(query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[R, Lmax] flat token index per (row, t) (0 where invalid) and the validity mask (CPU)."""
    qsl = query_start_loc.to("cpu", torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    lmax = int(lengths.max()) if lengths.numel() > 0 else 0
    t = torch.arange(lmax, dtype=torch.int64)
    valid = t[None, :] < lengths[:, None]
    idx = torch.where(valid, qsl[:-1, None] + t[None, :], torch.zeros((), dtype=torch.int64))
    return idx, valid, lmax


def _step_index(
    valid: torch.Tensor, idx: torch.Tensor, t: int, lmax: int, T: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor | slice, torch.Tensor | slice]:
    """(CPU row ids, flat token index, row index) of the rows that have a token t; slices when
    every row has one (no gather needed)."""
    R = valid.shape[0]
    if lmax == 1 and T == R:  # plain decode: token r is row r
        return torch.arange(R), slice(None), slice(None)
    col = valid[:, t]
    if bool(col.all()):
        return torch.arange(R), idx[:, t].to(dev), slice(None)
    rows = torch.nonzero(col).flatten()
    return rows, idx[rows, t].to(dev), rows.to(dev)


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
    """Multi-token selective state update for decode / verify rows (the recurrence of
    docs/kernel-design.md, "Recurrence", token by token within a row, vectorised over rows and
    heads).

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` raw; A, D, dt_bias: ``[H]``; B, C: ``[T, G, N]``.
        ssm_state: ``[num_slots, H, P, N]`` fp32/fp64 (bf16/fp16: computed in fp32, `state_compute_dtype`), in place.
        query_start_loc: int64 ``[R + 1]`` from 0; row r has ``n_r`` tokens (1 for decode, 1 + k for
            a verify row), ``n_r <= W``.
        read_slot: int64 ``[R]``: initial state of the row (read before any write).
        write_slots: int64 ``[R, W]``: the state after token t of row r goes to ``write_slots[r, t]``
            for ``t < n_r``; entries equal to 0 are skipped.
        dt_min, dt_max: same clamp as ``ssd_prefill`` (prefill and decode agree exactly).

    Returns:
        y ``[T, H, P]`` in ``x.dtype``.
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = int(query_start_loc.numel()) - 1
    cdt = state_compute_dtype(ssm_state.dtype)
    dev = x.device
    if T == 0 or R == 0:
        return torch.empty_like(x)
    hpg = H // G
    idx, valid, lmax = _padded_token_index(query_start_loc)
    if lmax > write_slots.shape[1]:
        raise ValueError(f"a row has {lmax} tokens but write_slots has only {write_slots.shape[1]} columns")
    # grouped layout: head h = (g, j) with g = h // hpg, so B/C broadcast instead of repeating
    dtp = process_dt(dt.to(cdt), dt_bias.to(cdt), dt_min, dt_max).view(T, G, hpg)
    Ah = A.to(cdt).view(G, hpg)
    xs = x.to(cdt).view(T, G, hpg, P)
    Bs = B.to(cdt)
    Cs = C.to(cdt)
    Ds = D.to(cdt).view(G, hpg, 1)
    h = ssm_state.index_select(0, read_slot.to(ssm_state.device, torch.int64)).to(cdt).view(R, G, hpg, P, N)
    y = torch.empty((T, G, hpg, P), dtype=cdt, device=dev)
    ws = write_slots.to("cpu", torch.int64)
    for t in range(lmax):
        rows, ti, rd = _step_index(valid, idx, t, lmax, T, dev)
        dtt = dtp[ti]  # [r, G, hpg]
        xt = xs[ti]  # [r, G, hpg, P]
        # h is this call's own copy (index_select) and h[rd] a gathered copy: update in place
        ht = h if isinstance(rd, slice) else h[rd]
        ht.mul_(torch.exp(dtt * Ah)[..., None, None])
        ht.addcmul_((dtt[..., None] * xt)[..., None], Bs[ti][:, :, None, None, :])
        if not isinstance(rd, slice):
            h[rd] = ht
        y[ti] = (ht * Cs[ti][:, :, None, None, :]).sum(-1).add_(Ds * xt)
        _write_slots(ssm_state, ws[rows, t].to(ssm_state.device), ht.reshape(-1, H, P, N))
    return y.view(T, H, P).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Causal conv1d
# --------------------------------------------------------------------------------------------------


def _conv_act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


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
    """Depthwise causal conv1d over packed prefill rows with per-slot initial conv states.

    Args:
        x: ``[T, conv_dim]`` pre-conv inputs (xBC), may be a strided view.
        weight: ``[conv_dim, W]``; bias: ``[conv_dim]`` or None.
        conv_state: ``[num_slots, conv_dim, W - 1]``, in place.
        query_start_loc: int64 ``[R + 1]`` from 0.
        read_slot, has_initial_state: the W - 1 columns preceding row r are
            ``conv_state[read_slot[r]]`` if ``has_initial_state[r]`` else zeros.
        write_slot: int64 ``[R]``: the last W - 1 inputs up to the row's last token (initial state
            columns included when the row is shorter than W - 1) go there (0 = skip).
        emit_row, emit_token, emit_slot: int64 ``[E]``: the W - 1 inputs ending at (and including)
            token ``emit_token[e]`` of row ``emit_row[e]`` go to ``emit_slot[e]`` (0 = skip). Any
            token index is accepted (as by ``ssd_prefill``).
        activation: "silu" or None.

    Returns:
        ``y[t] = act(bias + sum_k weight[:, k] * xpad[t + k])`` ``[T, conv_dim]`` in ``x.dtype``,
        where xpad is the row's initial state columns followed by its inputs.
    """
    T, Dc = x.shape
    W = weight.shape[1]
    R = int(query_start_loc.numel()) - 1
    cdt = torch.promote_types(x.dtype, conv_state.dtype)
    dev = x.device
    if T == 0 or R == 0:
        return torch.empty_like(x)
    _check_emits(query_start_loc, emit_row, emit_token)
    S = W - 1
    qsl = query_start_loc.to("cpu", torch.int64)
    row = _row_ids(qsl, T)
    # extended sequence: per row, S state columns then its tokens
    ext_index_tok = torch.arange(T, dtype=torch.int64) + (row + 1) * S  # position of token t in ext
    ext = torch.zeros((T + R * S, Dc), dtype=cdt, device=dev)
    ext[ext_index_tok.to(dev)] = x.to(cdt)
    if S > 0:
        his = has_initial_state.to("cpu", torch.bool)
        if bool(his.any()):
            rows = torch.nonzero(his).flatten()
            init = conv_state[read_slot.to("cpu", torch.int64)[rows].to(conv_state.device)].to(
                cdt
            )  # [r, Dc, S]
            base = qsl[rows] + rows * S  # ext index of the row's first state column
            pos = (base[:, None] + torch.arange(S, dtype=torch.int64)[None, :]).to(dev)  # [r, S]
            ext[pos.reshape(-1)] = init.transpose(1, 2).reshape(-1, Dc)
    # depthwise conv over the whole extended sequence as W shifted multiply-adds (views, no
    # gathers): out[j] = sum_k w[:, k] * ext[j + k]; token t (at ext index e_t) reads out[e_t - S]
    w = weight.to(cdt)
    n_out = ext.shape[0] - S
    out = ext[0:n_out] * w[:, 0]
    for k in range(1, W):
        out.addcmul_(ext[k : k + n_out], w[:, k])
    acc = out.index_select(0, ext_index_tok.to(dev) - S)
    if bias is not None:
        acc = acc + bias.to(cdt)
    y = _conv_act(acc, activation)

    if S > 0:
        lengths = qsl[1:] - qsl[:-1]
        last_ext = qsl[1:] + torch.arange(R, dtype=torch.int64) * S + S - 1  # ext index of last col
        win = (last_ext[:, None] - S + 1 + torch.arange(S, dtype=torch.int64)[None, :]).to(dev)  # [R, S]
        final = ext[win.reshape(-1)].view(R, S, Dc).transpose(1, 2)
        ws = write_slot.to("cpu", torch.int64).clone()
        ws[lengths == 0] = 0
        _write_slots(conv_state, ws.to(conv_state.device), final)
        if emit_row.numel() > 0:
            er = emit_row.to("cpu", torch.int64)
            et = emit_token.to("cpu", torch.int64)
            last = qsl[er] + et + (er + 1) * S
            win = (last[:, None] - S + 1 + torch.arange(S, dtype=torch.int64)[None, :]).to(dev)
            vals = ext[win.reshape(-1)].view(-1, S, Dc).transpose(1, 2)
            _write_slots(conv_state, emit_slot.to(conv_state.device, torch.int64), vals)
    return y.to(x.dtype)


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
    """Multi-token causal conv1d update for decode / verify rows.

    Args:
        x: ``[T, conv_dim]``; weight ``[conv_dim, W]``; bias ``[conv_dim]`` or None.
        conv_state: ``[num_slots, conv_dim, W - 1]``, in place.
        query_start_loc: int64 ``[R + 1]`` from 0 (``n_r <= write_slots.shape[1]``).
        read_slot: int64 ``[R]``: the W - 1 columns preceding the row's first token.
        write_slots: int64 ``[R, W_slots]``: the W - 1 inputs ending at token t go to
            ``write_slots[r, t]`` (0 = skip).
        activation: "silu" or None.

    Returns:
        y ``[T, conv_dim]`` in ``x.dtype``.
    """
    T, Dc = x.shape
    R = int(query_start_loc.numel()) - 1
    cdt = torch.promote_types(x.dtype, conv_state.dtype)
    dev = x.device
    if T == 0 or R == 0:
        return torch.empty_like(x)
    idx, valid, lmax = _padded_token_index(query_start_loc)
    if lmax > write_slots.shape[1]:
        raise ValueError(f"a row has {lmax} tokens but write_slots has only {write_slots.shape[1]} columns")
    win = conv_state.index_select(0, read_slot.to(conv_state.device, torch.int64)).to(cdt)  # [R, Dc, W-1]
    w = weight.to(cdt)
    b = bias.to(cdt) if bias is not None else None
    xs = x.to(cdt)
    y = torch.empty((T, Dc), dtype=cdt, device=dev)
    ws = write_slots.to("cpu", torch.int64)
    for t in range(lmax):
        rows, ti, rd = _step_index(valid, idx, t, lmax, T, dev)
        full = torch.cat([win if isinstance(rd, slice) else win[rd], xs[ti][:, :, None]], dim=2)  # [r, Dc, W]
        # the multiply-adds of causal_conv1d_prefill, in its order (decode and prefill agree)
        out = full[:, :, 0] * w[:, 0]
        for k in range(1, w.shape[1]):
            out.addcmul_(full[:, :, k], w[:, k])
        if b is not None:
            out = out + b
        y[ti] = _conv_act(out, activation)
        new = full[:, :, 1:]
        if isinstance(rd, slice):
            win = new
        else:
            win[rd] = new
        _write_slots(conv_state, ws[rows, t].to(conv_state.device), new)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Slot copy
# --------------------------------------------------------------------------------------------------


def copy_slots(state: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``state[dst[i]] = state[src[i]]`` for i in order (dim 0 = slots), in place.

    Semantics are those of the sequential loop: a copy whose src is an earlier copy's dst sees the
    copied value. When no src is an earlier dst (the usual case) it runs as one batched gather.
    Copies to slot 0 are skipped; ``src == dst`` is a no-op.
    """
    n = int(src.numel())
    if n == 0:
        return
    s = src.to("cpu", torch.int64)
    d = dst.to("cpu", torch.int64)
    keep = (d != 0) & (d != s)
    s, d = s[keep], d[keep]
    if s.numel() == 0:
        return
    sl, dl = s.tolist(), d.tolist()
    seen: set[int] = set()
    dependent = False
    for a, b in zip(sl, dl):
        if a in seen:
            dependent = True
            break
        seen.add(b)
    if not dependent and len(set(dl)) == len(dl):
        state[d.to(state.device)] = state[s.to(state.device)]
        return
    for a, b in zip(sl, dl):
        state[b].copy_(state[a])
