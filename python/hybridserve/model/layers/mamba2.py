"""The Mamba2 mixer over a varlen batch: in_proj -> z | xBC | dt, causal conv1d, SSD scan (dt bias,
softplus, clamp, D skip), grouped gated RMSNorm, out_proj. Parameter names follow the HF checkpoints
(`in_proj.weight`, `conv1d.weight`, `conv1d.bias`, `A_log`, `D`, `dt_bias`, `norm.weight`,
`out_proj.weight`).

State-window semantics (model/batch.py): decode rows read `state_read_slot` and write the state
after token t to `state_write_slots[r, t]`; prefill rows start from `state_read_slot` when
`has_initial_state` else from zeros, write their final state to `state_write_slots[r, 0]` and the
emitted boundary states to `emit_slot`. The same dt clamp applies in both paths.

On the CPU (float32 / float64) decode, verify and prefill tokens take the C++ recurrence of
kernels/native.py (conv + state update token by token, one pass per row) when it is built; the
reference twins (conv update / state update, conv prefill / chunked SSD scan) otherwise; on a
CUDA device the twins dispatch to the CUDA kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import dispatch as K
from hybridserve.kernels import native
from hybridserve.kernels.reference import state_compute_dtype
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.norm import GatedRMSNorm
from hybridserve.model.model_config import ModelConfig


class Conv1dParams(nn.Module):
    """Holds `weight` [conv_dim, 1, W] and `bias` [conv_dim] under the HF names."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nheads = cfg.nheads
        self.headdim = cfg.headdim
        self.dstate = cfg.dstate
        self.ngroups = cfg.ngroups
        self.d_inner = cfg.d_inner
        self.conv_dim = cfg.conv_dim
        self.chunk_size = cfg.chunk_size
        self.dt_min = cfg.dt_min
        self.dt_max = cfg.dt_max
        self.activation = cfg.mamba_act
        proj = self.d_inner + self.conv_dim + self.nheads
        self.in_proj = nn.Linear(cfg.hidden_size, proj, bias=cfg.mamba_proj_bias)
        self.conv1d = Conv1dParams(self.conv_dim, cfg.d_conv, cfg.mamba_conv_bias)
        self.A_log = nn.Parameter(torch.empty(self.nheads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.nheads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads), requires_grad=False)
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.ngroups, cfg.mamba_norm_eps)
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(
        self, hidden: torch.Tensor, ctx: ForwardContext, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        y, z = self.scan(self.in_proj(hidden), ctx, conv_state, ssm_state)
        return self.out_proj(self.norm(y, z, hidden.dtype))

    def scan(
        self, proj: torch.Tensor, ctx: ForwardContext, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y ``[T, d_inner]`` before the gate and norm, the gate z) of the in_proj output `proj`:
        the conv and SSD scan of every token, writing the states per the ForwardContext."""
        T = proj.shape[0]
        z, xbc, dt = proj.split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
        w, A = self._constants(state_compute_dtype(ssm_state.dtype))
        b = self.conv1d.bias
        ndt = ctx.num_decode_tokens

        parts = []
        if ndt == T:  # decode rows only: no slicing
            parts.append(self._decode_tokens(xbc, dt, w, b, A, conv_state, ssm_state, ctx))
        elif ndt > 0:
            parts.append(self._decode_tokens(xbc[:ndt], dt[:ndt], w, b, A, conv_state, ssm_state, ctx))
        if ndt < T:
            parts.append(self._prefill_tokens(xbc[ndt:], dt[ndt:], w, b, A, conv_state, ssm_state, ctx))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.reshape(T, self.d_inner), z

    def _constants(self, state_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the conv weight as [conv_dim, W], A = -exp(A_log) in the state dtype), derived from the
        weights once rather than in every forward; derived again when a weight changes (its
        tensor or its version counter)."""
        weight, a_log = self.conv1d.weight, self.A_log
        key = (weight.data_ptr(), weight._version, a_log.data_ptr(), a_log._version, state_dtype)
        cached = self.__dict__.get("_constants_cache")
        if cached is None or cached[0] != key:
            cached = (key, weight[:, 0, :], -torch.exp(a_log.to(state_dtype)))
            self.__dict__["_constants_cache"] = cached
        return cached[1], cached[2]

    def _split_conv_out(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        G, N = self.ngroups, self.dstate
        n = conv_out.shape[0]
        x, B, C = conv_out.split([self.d_inner, G * N, G * N], dim=-1)
        return x.view(n, self.nheads, self.headdim), B.view(n, G, N), C.view(n, G, N)

    def _decode_tokens(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        A: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """y ``[n, H, P]`` of the decode / verify rows (the first n tokens of the batch)."""
        fused = native.mamba_decode(
            xbc, dt, w, b, conv_state, A, self.D, self.dt_bias, ssm_state, ctx.dec_qsl, ctx.dec_read_slot,
            ctx.dec_write_slots, self.ngroups, self.activation is not None, self.dt_min, self.dt_max,
        )  # fmt: skip
        if fused is not None:
            return fused
        conv_out = K.causal_conv1d_update(
            xbc, w, b, conv_state, ctx.dec_qsl, ctx.dec_read_slot, ctx.dec_write_slots, self.activation
        )
        x, B, C = self._split_conv_out(conv_out)
        return K.selective_state_update(
            x, dt, A, B, C, self.D, self.dt_bias, ssm_state, ctx.dec_qsl, ctx.dec_read_slot,
            ctx.dec_write_slots, self.dt_min, self.dt_max,
        )  # fmt: skip

    def _prefill_tokens(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        A: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """y ``[n, H, P]`` of the prefill rows (the batch's tokens after the decode rows')."""
        fused = native.mamba_prefill(
            xbc, dt, w, b, conv_state, A, self.D, self.dt_bias, ssm_state, ctx.pre_qsl, ctx.pre_num_computed,
            ctx.pre_read_slot, ctx.pre_has_initial_state, ctx.pre_write_slot, ctx.emit_row, ctx.emit_token,
            ctx.emit_slot, self.chunk_size, self.ngroups, self.activation is not None, self.dt_min, self.dt_max,
        )  # fmt: skip
        if fused is not None:
            return fused
        conv_out = K.causal_conv1d_prefill(
            xbc, w, b, conv_state, ctx.pre_qsl, ctx.pre_read_slot, ctx.pre_has_initial_state,
            ctx.pre_write_slot, ctx.emit_row, ctx.emit_token, ctx.emit_slot, self.activation,
        )  # fmt: skip
        x, B, C = self._split_conv_out(conv_out)
        return K.ssd_prefill(
            x, dt, A, B, C, self.D, self.dt_bias, ssm_state, ctx.pre_qsl, ctx.pre_num_computed,
            ctx.pre_read_slot, ctx.pre_has_initial_state, ctx.pre_write_slot, ctx.emit_row,
            ctx.emit_token, ctx.emit_slot, self.chunk_size, self.dt_min, self.dt_max,
        )  # fmt: skip
