"""The Mamba1 mixer (Jamba's) over a varlen batch: in_proj -> x | z, causal conv1d over the x
channels, x_proj -> dt | B | C (each RMS-normed in Jamba), dt_proj, the selective scan with a
state per channel (kernels/selective_scan.py), the gate ``silu(z)``, out_proj. Parameter names
follow the HF checkpoints (`in_proj.weight`, `conv1d.weight`, `conv1d.bias`, `x_proj.weight`,
`dt_proj.weight`, `dt_proj.bias`, `A_log` ``[d_inner, d_state]``, `D`, `out_proj.weight`,
`dt_layernorm.weight`, `b_layernorm.weight`, `c_layernorm.weight`).

State layout in the Mamba pool (model/cache_tensors.py): the conv window ``[d_inner, d_conv - 1]``
and the state ``[d_inner, 1, d_state]`` (the pool's [heads, head_dim, d_state] with one channel
per head). Decode / verify and prefill rows follow the state-window semantics of the Mamba2 mixer
(layers/mamba2.py): the conv kernels are the same; the scan writes the state after any token, so
the emitted boundary states of a prefill cost nothing extra.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import dispatch as K
from hybridserve.kernels import selective_scan
from hybridserve.kernels.reference import process_dt, state_compute_dtype
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.mamba2 import Conv1dParams
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import ModelConfig


class Mamba1Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, dt_rank: int, bc_dt_norms: bool) -> None:
        super().__init__()
        self.d_inner = cfg.d_inner
        self.dstate = cfg.dstate
        self.dt_rank = dt_rank
        self.activation = cfg.mamba_act
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.d_inner, bias=cfg.mamba_proj_bias)
        self.conv1d = Conv1dParams(self.d_inner, cfg.d_conv, cfg.mamba_conv_bias)
        self.x_proj = nn.Linear(self.d_inner, dt_rank + 2 * self.dstate, bias=False)
        self.dt_proj = nn.Linear(dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.dstate), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.d_inner), requires_grad=False)
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        self.dt_layernorm: RMSNorm | None = None
        self.b_layernorm: RMSNorm | None = None
        self.c_layernorm: RMSNorm | None = None
        if bc_dt_norms:  # Jamba's (Mamba1 itself has none)
            self.dt_layernorm = RMSNorm(dt_rank, cfg.mamba_norm_eps)
            self.b_layernorm = RMSNorm(self.dstate, cfg.mamba_norm_eps)
            self.c_layernorm = RMSNorm(self.dstate, cfg.mamba_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mixer's output of every token, or with `keep` (flat token indices) of those rows
        only: the scan still runs every token (the states need them all), the gate and out_proj
        only the kept rows."""
        T = hidden.shape[0]
        x, z = self.in_proj(hidden).split([self.d_inner, self.d_inner], dim=-1)
        w = self.conv1d.weight[:, 0, :]
        b = self.conv1d.bias
        ndt = ctx.num_decode_tokens
        conv = []
        if ndt > 0:
            conv.append(
                K.causal_conv1d_update(
                    x[:ndt],
                    w,
                    b,
                    conv_state,
                    ctx.dec_qsl,
                    ctx.dec_read_slot,
                    ctx.dec_write_slots,
                    self.activation,
                )
            )
        if ndt < T:
            conv.append(
                K.causal_conv1d_prefill(
                    x[ndt:],
                    w,
                    b,
                    conv_state,
                    ctx.pre_qsl,
                    ctx.pre_read_slot,
                    ctx.pre_has_initial_state,
                    ctx.pre_write_slot,
                    ctx.emit_row,
                    ctx.emit_token,
                    ctx.emit_slot,
                    self.activation,
                )  # fmt: skip
            )
        xc = conv[0] if len(conv) == 1 else torch.cat(conv)
        dt, B, C = self.x_proj(xc).split([self.dt_rank, self.dstate, self.dstate], dim=-1)
        if self.dt_layernorm is not None:
            assert self.b_layernorm is not None and self.c_layernorm is not None
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        cdt = state_compute_dtype(ssm_state.dtype)
        # dt_proj without its bias, which joins dt in the state dtype before the softplus
        dt = process_dt(
            F.linear(dt, self.dt_proj.weight).to(cdt), self.dt_proj.bias.to(cdt), 0.0, float("inf")
        )
        A = self._A(cdt)
        state = ssm_state.view(ssm_state.shape[0], self.d_inner, self.dstate)
        ys = []
        if ndt > 0:
            ys.append(
                selective_scan.selective_scan_update(
                    xc[:ndt],
                    dt[:ndt],
                    A,
                    B[:ndt],
                    C[:ndt],
                    self.D,
                    state,
                    ctx.dec_qsl,
                    ctx.dec_read_slot,
                    ctx.dec_write_slots,
                )  # fmt: skip
            )
        if ndt < T:
            ys.append(
                selective_scan.selective_scan_prefill(
                    xc[ndt:],
                    dt[ndt:],
                    A,
                    B[ndt:],
                    C[ndt:],
                    self.D,
                    state,
                    ctx.pre_qsl,
                    ctx.pre_read_slot,
                    ctx.pre_has_initial_state,
                    ctx.pre_write_slot,
                    ctx.emit_row,
                    ctx.emit_token,
                    ctx.emit_slot,
                )  # fmt: skip
            )
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        if keep is not None:
            y, z = y[keep], z[keep]
        return self.out_proj((y * F.silu(z)).to(hidden.dtype))

    def _A(self, state_dtype: torch.dtype) -> torch.Tensor:
        """-exp(A_log) in the state dtype, derived once per weight (its tensor and version)."""
        a_log = self.A_log
        key = (a_log.data_ptr(), a_log._version, state_dtype)
        cached = self.__dict__.get("_A_cache")
        if cached is None or cached[0] != key:
            cached = (key, -torch.exp(a_log.to(state_dtype)))
            self.__dict__["_A_cache"] = cached
        return cached[1]
