"""RMSNorm and the grouped gated RMSNorm of the Mamba2 mixer (on the CPU in float32 / float64, the C++
kernels of kernels/native.py when they are built; these torch ops otherwise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import native


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 (fp64 for fp64 models), result in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = native.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        cdt = _compute_dtype(x.dtype)
        h = x.to(cdt)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(cdt) * h).to(x.dtype)


def gated_rms_norm(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``weight * rmsnorm_grouped(y * silu(z))`` (Mamba2 ``RMSNormGated``, norm_before_gate=False)."""
    if y.dtype == out_dtype:
        fused = native.gated_rms_norm(y, z, weight, group_size, eps)
        if fused is not None:
            return fused
    return gated_rms_norm_torch(y, z, weight, group_size, eps, out_dtype)


def gated_rms_norm_torch(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`gated_rms_norm` in torch ops only (what torch.compile traces, and the CUDA path)."""
    cdt = _compute_dtype(out_dtype)
    h = y.to(cdt) * F.silu(z.to(cdt))
    *pre, d = h.shape
    g = h.view(*pre, d // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    h = g.view(*pre, d)
    return (weight.to(cdt) * h).to(out_dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2 ``RMSNormGated`` with norm_before_gate=False: ``w * rmsnorm_grouped(y * silu(z))``,
    the RMS taken over groups of ``group_size`` channels."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps, out_dtype)
