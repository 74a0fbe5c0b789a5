"""MLPs: NemotronH's non-gated relu2 MLP, the gated (SwiGLU-style) MLP of Bamba, and NemotronH's
MoE (sigmoid group-limited top-k router with score-correction bias, non-gated experts, shared
expert, optional latent projections)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.errors import ConfigError
from hybridserve.model.model_config import ModelConfig


def activation(name: str) -> nn.Module:
    if name == "relu2":
        return _ReLU2()
    if name in ("silu", "swish"):
        return nn.SiLU()
    if name == "relu":
        return nn.ReLU()
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        return nn.GELU(approximate="none" if name == "gelu" else "tanh")
    raise ConfigError(f"unsupported activation {name!r}")  # (ModelConfig.validate names the file first)


class _ReLU2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = F.relu(x)
        return r.mul_(r)  # squared in place: relu's output is a fresh tensor (one pass, no copy)


class MLP(nn.Module):
    """``down(act(up(x)))`` (NemotronH)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (Bamba)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    """`gate.weight` [E, hidden] and `gate.e_score_correction_bias` [E] (kept in fp32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        E = self.weight.shape[0]
        logits = F.linear(x.to(cdt), self.weight.to(cdt))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(cdt)
        if self.n_group > 1:
            per = E // self.n_group
            group_scores = choice.view(-1, self.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
            gidx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            gmask = torch.zeros_like(group_scores).scatter_(1, gidx, 1.0)
            smask = gmask[:, :, None].expand(-1, self.n_group, per).reshape(-1, E)
            choice = choice.masked_fill(smask == 0, float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inner = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopkRouter(cfg)
        self.experts = nn.ModuleList(
            [MLP(inner, cfg.moe_intermediate_size, cfg.mlp_act, False) for _ in range(cfg.n_routed_experts)]
        )
        self.shared_experts = MLP(
            cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_act, cfg.mlp_bias
        )
        self.fc1_latent_proj: nn.Linear | None
        self.fc2_latent_proj: nn.Linear | None
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = None
            self.fc2_latent_proj = None
        # Tensor parallelism: the experts' partial sums are summed over the ranks here, once per
        # layer (distributed/sharding.py); None in a single process.
        self.routed_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        acc = torch.zeros(h.shape, dtype=w.dtype, device=h.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            out = self.experts[e](h[tok])
            acc.index_add_(0, tok, (out * w[tok, slot, None].to(out.dtype)).to(acc.dtype))
        if self.routed_reduce is not None:
            acc = self.routed_reduce(acc)
        routed = acc.to(x.dtype)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)
