"""Causal self-attention over the paged KV cache.

KV cache of one layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V).
Token t's K/V are written at ``slot_mapping[t] = block * block_size + offset``; row r reads its keys
0 .. seq_len - 1 through ``block_table[r]``. A query at absolute position p attends keys 0..p.
Decode and verify rows run in one call of the C++ kernel on the CPU (kernels/native.py: K/V read
through the block table, nothing gathered), otherwise batched through SDPA (padded to the
longest); prefill rows run one at a time. With `keep` (the last cache-writing layer of a forward
whose other tokens' outputs nobody reads) only the kept tokens get queries: they run as rows of
their own through the same decode path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import native
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.model_config import ModelConfig


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim]; rotates the first rotary_dim channels."""
    rd = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    if rd == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * c + _rotate_half(rot) * s, rest], dim=-1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D], mask [B, 1, Lq, Lk]: bool (True = attend) or
    additive in q's dtype."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class PagedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.rotary_dim = cfg.rotary_dim
        self.rope_theta = cfg.rope_theta
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        kv_cache: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output of every token, or with `keep` (flat token indices, increasing)
        of those tokens only: K and V are still computed and written for every token (later
        tokens read them), the queries, scores and o_proj only for the kept ones."""
        q = self.q_proj(hidden if keep is None else hidden[keep])
        return self.attend(q, self.k_proj(hidden), self.v_proj(hidden), ctx, kv_cache, keep)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        kv_cache: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` after the projections: q ``[T or len(keep), H * D]``, k / v ``[T, KVH * D]``
        (a family with its own projections, such as Zamba2's adapters, calls this)."""
        T = k.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = q.view(-1, H, D)
        k = k.view(T, KVH, D)
        v = v.view(T, KVH, D)
        if self.rotary_dim > 0:
            cos, sin = ctx.rope(self.rotary_dim, self.rope_theta, q.dtype)
            k = apply_rotary(k, cos, sin)
            q = apply_rotary(q, cos, sin) if keep is None else apply_rotary(q, cos[keep], sin[keep])
        bs = kv_cache.shape[2]
        blk, off = _slot_index(ctx, bs)
        kv_cache[blk, 0, off] = k.to(kv_cache.dtype)
        kv_cache[blk, 1, off] = v.to(kv_cache.dtype)
        if keep is not None:
            rows = _kept_rows(ctx, keep)
            out = torch.empty_like(q)
            if rows.num_rows > 0:
                self._decode_rows(q, out, rows, kv_cache)
            return self.o_proj(out.reshape(-1, H * D))

        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
        nd = ctx.num_decodes
        qsl = ctx.qsl
        seq_lens = ctx.seq_lens
        if nd > 0:
            self._decode_rows(q, out, _decode_query_rows(ctx), kv_cache)
        for r in range(nd, ctx.num_rows):
            s, e = int(qsl[r]), int(qsl[r + 1])
            if e == s:
                continue
            L = int(seq_lens[r])
            if L == e - s and int(ctx.num_computed[r]) == 0:
                # a whole prompt from position 0: its keys are this step's own (as the cache
                # holds them), the mask is the plain causal one
                kc = k[s:e].to(kv_cache.dtype).to(q.dtype)
                vc = v[s:e].to(kv_cache.dtype).to(q.dtype)
                o = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1)[None],
                    kc.transpose(0, 1)[None],
                    vc.transpose(0, 1)[None],
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=H != KVH,
                )
                out[s:e] = o[0].transpose(0, 1)
                continue
            nb = (L + bs - 1) // bs
            blocks = ctx.block_table[r, :nb]
            kr = kv_cache[:, 0].index_select(0, blocks).reshape(nb * bs, KVH, D)[:L]
            vr = kv_cache[:, 1].index_select(0, blocks).reshape(nb * bs, KVH, D)[:L]
            o = _attend(
                q[s:e].transpose(0, 1)[None],
                kr.to(q.dtype).transpose(0, 1)[None],
                vr.to(q.dtype).transpose(0, 1)[None],
                _prefill_mask(ctx, r, L, q.dtype, q.device),
                self.scale,
            )
            out[s:e] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(T, H * D))

    def _decode_rows(
        self, q: torch.Tensor, out: torch.Tensor, rows: QueryRows, kv_cache: torch.Tensor
    ) -> None:
        """out[:n] for the query tokens q[:n] of `rows` (each reading its keys through the block
        table: decode and verify rows, or the kept tokens of any row)."""
        nd = rows.num_rows
        ndt = int(rows.qsl[nd])
        fused = native.paged_attention(
            q[:ndt], kv_cache, rows.block_table, rows.qsl, rows.positions, self.scale
        )
        if fused is not None:
            out[:ndt] = fused
            return
        KVH, D = self.num_kv_heads, self.head_dim
        Gq = self.num_heads // KVH
        bs = kv_cache.shape[2]
        blocks, mask, idx_d, vd, nb = _decode_meta(rows, bs, q.device)
        if idx_d is None:
            # plain decode rows (token r is row r): the query heads sharing a KV head are the query
            # positions of one SDPA call per KV head ([nd, KVH, H / KVH, D], no GQA expansion)
            qg = q[:nd].reshape(nd, KVH, Gq, D)
            out[:nd] = self._grouped_sdpa(qg, mask, blocks, nb, kv_cache).view(nd, self.num_heads, D)
            return
        # verify rows (1 + k tokens each, padded to lmax): the query axis of a KV head holds its
        # query heads x the row's tokens, the mask repeated per query head
        lmax = idx_d.shape[1]
        qg = q[idx_d].view(nd, lmax, KVH, Gq, D).permute(0, 2, 3, 1, 4).reshape(nd, KVH, Gq * lmax, D)
        mg = mask[:, :, None].expand(nd, 1, Gq, lmax, mask.shape[-1]).reshape(nd, 1, Gq * lmax, -1)
        og = self._grouped_sdpa(qg, mg, blocks, nb, kv_cache)
        o = og.view(nd, KVH, Gq, lmax, D).permute(0, 3, 1, 2, 4).reshape(nd, lmax, self.num_heads, D)
        if vd is None:  # every row has lmax tokens: they are the first nd * lmax, in order
            out[: nd * lmax] = o.reshape(nd * lmax, self.num_heads, D)
        else:
            out[idx_d[vd]] = o[vd]

    def _grouped_sdpa(
        self, qg: torch.Tensor, mask: torch.Tensor, blocks: torch.Tensor, nb: int, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """SDPA of qg [rows, KVH, q, D] over each row's nb blocks, in groups of rows whose gathered
        K/V are still in the CPU cache when SDPA reads them (gathering every row's context at once
        and then reading it again was memory-bound)."""
        rows, KVH, _, D = qg.shape
        bs = kv_cache.shape[2]
        og = torch.empty_like(qg)
        gather = _GATHER_BYTES_CUDA if kv_cache.is_cuda else _GATHER_BYTES
        step = max(1, gather // max(1, nb * bs * KVH * D * kv_cache.element_size()))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            bl = blocks[r0 * nb : r1 * nb]
            kr = kv_cache[:, 0].index_select(0, bl).view(r1 - r0, nb * bs, KVH, D).to(qg.dtype)
            vr = kv_cache[:, 1].index_select(0, bl).view(r1 - r0, nb * bs, KVH, D).to(qg.dtype)
            og[r0:r1] = F.scaled_dot_product_attention(
                qg[r0:r1], kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=mask[r0:r1], scale=self.scale
            )
        return og


def _prefill_mask(ctx: ForwardContext, r: int, L: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """The additive mask ``[1, 1, tokens, L]`` (0 where a query token of row r may attend, -inf
    past its position) of a prefill row that reads keys from the cache, built once per forward:
    every attention layer of the step shares it. SDPA turns a bool mask into this same tensor on
    every call, so the result is bit-identical; given it ready, the call was faster too (the
    demo's shapes, 180 queries over 2,680 keys, one thread: 4.3 ms against 5.0 ms)."""
    key = ("attn_prefill_mask", r, dtype)
    hit = ctx.scratch.get(key)
    if hit is None:
        s, e = int(ctx.qsl[r]), int(ctx.qsl[r + 1])
        allowed = torch.arange(L, device=dev)[None, :] <= ctx.positions[s:e][:, None]
        hit = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, float("-inf"))[
            None, None
        ]
        ctx.scratch[key] = hit
    return hit  # type: ignore[return-value]


def _slot_index(ctx: ForwardContext, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of every token's KV slot, once per forward."""
    key = ("attn_slots", bs)
    hit = ctx.scratch.get(key)
    if hit is None:
        blk = torch.div(ctx.slot_mapping, bs, rounding_mode="floor")
        hit = (blk, ctx.slot_mapping - blk * bs)
        ctx.scratch[key] = hit
    return hit  # type: ignore[return-value]


# Bytes of K (and of V) gathered per SDPA call of the decode rows: small enough that the gathered
# K/V are still in the CPU cache when SDPA reads them (measured: 0.5-1 MiB best on the demo model).
_GATHER_BYTES = 1 << 20
# On a GPU there is no such cache to stay in: the groups are as large as memory allows (one call
# for every row at short contexts), bounded so that long contexts gather no more than this
_GATHER_BYTES_CUDA = 1 << 28

# (block gather index, mask, padded token index, its valid entries, blocks per row); the token
# index is None for plain decode rows, its valid entries None where every entry is valid
_DecodeMeta = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]


@dataclass
class QueryRows:
    """Query tokens grouped into rows that read their keys through the block table: row r owns
    query tokens qsl[r] .. qsl[r + 1] (CPU, from 0) at `positions` (device) and keys 0 .. its
    largest position (seq_lens[r] bounds it, CPU) through block_table[r] (device). `scratch`
    holds what the row layout's layers share within one forward, under `key`."""

    qsl: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scratch: dict[tuple[object, ...], object]
    key: str

    @property
    def num_rows(self) -> int:
        return int(self.qsl.numel()) - 1


def _decode_query_rows(ctx: ForwardContext) -> QueryRows:
    """The decode / verify rows (the first num_decodes rows of the batch), once per forward."""
    key = ("attn_decode_rows",)
    hit = ctx.scratch.get(key)
    if hit is None:
        nd = ctx.num_decodes
        hit = QueryRows(
            ctx.qsl[: nd + 1], ctx.positions[: ctx.num_decode_tokens], ctx.seq_lens[:nd], ctx.block_table[:nd],
            ctx.scratch, "decode",
        )  # fmt: skip
        ctx.scratch[key] = hit
    return hit  # type: ignore[return-value]


def _kept_rows(ctx: ForwardContext, keep: torch.Tensor) -> QueryRows:
    """The kept tokens (flat indices, increasing) as query rows: the rows of the batch that keep
    at least one token, with their block tables. Built once per forward."""
    key = ("attn_kept_rows",)
    hit = ctx.scratch.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    keep_cpu = keep.to("cpu", torch.int64)  # CPU already as CausalLM.forward passes it: no sync
    row = torch.searchsorted(ctx.qsl[1:], keep_cpu, right=True)  # qsl[row] <= t < qsl[row + 1]
    used, counts = torch.unique_consecutive(row, return_counts=True)
    qsl = torch.zeros(used.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=qsl[1:])
    rows = QueryRows(
        qsl, ctx.positions[keep], ctx.seq_lens[used], ctx.block_table[used.to(ctx.block_table.device)],
        ctx.scratch, "kept",
    )  # fmt: skip
    ctx.scratch[key] = rows
    return rows


def _decode_meta(rows: QueryRows, bs: int, dev: torch.device) -> _DecodeMeta:
    """The rows' block gather index, padded token index and mask, built once per forward (every
    attention layer of the step shares them)."""
    nd = rows.num_rows
    key = ("attn_decode", rows.key, nd, bs)
    hit = rows.scratch.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    qsl = rows.qsl
    lengths = qsl[1:] - qsl[:-1]
    lmax = int(lengths.max())
    Lmax = int(rows.seq_lens.max())
    nb = (Lmax + bs - 1) // bs
    blocks = rows.block_table[:, :nb].reshape(-1)  # [nd * nb]
    keys = torch.arange(nb * bs, device=dev)
    if lmax == 1 and int(qsl[nd]) == nd:
        pos = rows.positions[:nd]
        mask = (keys[None, :] <= pos[:, None])[:, None, None, :]  # [nd, 1, 1, ctx]
        meta: _DecodeMeta = (blocks, mask, None, None, nb)
    else:
        if int(qsl[nd]) == nd * lmax:
            # every row has lmax tokens (verify rows with K drafts each): the index is made on the
            # device, no copy of a host array (a CUDA graph captures this), and every entry is valid
            idx_d = torch.arange(nd * lmax, device=dev).view(nd, lmax)
            valid_d: torch.Tensor | None = None
        else:
            t = torch.arange(lmax, dtype=torch.int64)
            valid = t[None, :] < lengths[:, None]  # [nd, lmax]
            idx = torch.where(valid, qsl[:-1, None] + t[None, :], qsl[:-1, None])  # pad: row's first token
            idx_d = idx.to(dev)
            valid_d = valid.to(dev)
        pos = rows.positions[idx_d]  # [nd, lmax]
        mask = (keys[None, None, :] <= pos[:, :, None])[:, None]
        meta = (blocks, mask, idx_d, valid_d, nb)
    rows.scratch[key] = meta
    return meta
