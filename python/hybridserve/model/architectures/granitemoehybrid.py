"""GraniteMoeHybridForCausalLM (IBM Granite-4.0-H): decoder layers of (Mamba2 mixer | attention),
each ``x + m * mixer(input_layernorm(x))`` then ``x + m * ffn(post_attention_layernorm(x))``, where
`m` is `residual_multiplier` and the FFN is a top-k softmax-routed MoE of gated experts plus a
gated shared MLP (the shared MLP alone when `num_local_experts` is 0, the dense Granite-4.0-H
models; a `shared_intermediate_size` of 0 leaves the MoE alone).

Granite's multipliers: the embeddings are scaled by `embedding_multiplier`, the attention scores
by `attention_multiplier` (instead of head_dim ** -0.5), the logits divided by `logits_scaling`.
Rotary embedding on the whole head when `position_embedding_type` is "rope", none otherwise
("nope", or absent: the Granite-4.0-H checkpoints).

Checkpoint names (as IBM ships them and transformers writes them): `model.embed_tokens.weight`,
`model.layers.{i}.{mamba.*|self_attn.*}`, `input_layernorm`, `post_attention_layernorm`,
`model.layers.{i}.block_sparse_moe.input_linear.weight` ``[E, 2 * I, hidden]`` (gate | up of each
expert), `block_sparse_moe.output_linear.weight` ``[E, hidden, I]``,
`block_sparse_moe.router.layer.weight` ``[E, hidden]``, `shared_mlp.input_linear.weight`
``[2 * S, hidden]`` (gate | up), `shared_mlp.output_linear.weight`, `model.norm.weight`,
`lm_head.weight` (absent when tied).

dt limits: transformers clamps dt to `time_step_limit` in its chunked (prefill) path only; we apply
it in both paths so that prefill and decode agree exactly. The default limit (0, inf), which the
released checkpoints use, never fires, and then both are identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.errors import ConfigError
from hybridserve.model.architectures import shared_fields
from hybridserve.model.architectures.base import DecoderStack, StackedCausalLM, mamba_or_attention, register
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import activation
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import MAMBA, ModelConfig, get_flag, get_float, get_int, layer_kinds

MODEL_TYPE = "granitemoehybrid"


@dataclass
class GraniteMoeHybridConfig(ModelConfig):
    """ModelConfig plus Granite's multipliers. The shared MLP is `intermediate_size` (gated, in
    every layer), the routed experts `moe_intermediate_size` (gated, `n_routed_experts` of them,
    `num_experts_per_tok` per token; 0 experts: a dense model)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


class _ExpertWeights(nn.Module):
    """`weight` ``[E, out, in]``: every expert's matrix in one tensor, as the checkpoint stores it."""

    def __init__(self, experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features), requires_grad=False)


class _Router(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, experts, bias=False)


class GraniteMoE(nn.Module):
    """Top-k of the router logits, softmax over those k (in fp32, fp64 for fp64 models), each
    chosen expert ``down(act(gate(x)) * up(x))`` weighted by its probability."""

    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        E, inter, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.inter = inter
        self.router = _Router(h, E)
        self.input_linear = _ExpertWeights(E, 2 * inter, h)
        self.output_linear = _ExpertWeights(E, h, inter)
        self.act = activation(cfg.mlp_act)
        # Tensor parallelism: the experts' partial sums are summed over the ranks here, once per
        # layer (distributed/sharding.py); None in a single process.
        self.routed_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        logits = self.router.layer(x).to(cdt)
        top, idx = logits.topk(self.top_k, dim=-1)
        w = torch.softmax(top, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        w_in, w_out = self.input_linear.weight, self.output_linear.weight
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            gate, up = F.linear(x[tok], w_in[e]).split(self.inter, dim=-1)
            y = F.linear(self.act(gate) * up, w_out[e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out if self.routed_reduce is None else self.routed_reduce(out)


class GraniteSharedMLP(nn.Module):
    """``output_linear(act(gate) * up)`` with ``gate | up = input_linear(x)``."""

    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.inter = inter
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).split(self.inter, dim=-1)
        return self.output_linear(self.act(gate) * up)


class GraniteMoeHybridLayer(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = PagedAttention(cfg, bias=cfg.attention_bias)
            self.self_attn.scale = cfg.attention_multiplier  # Granite's score scale
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.block_sparse_moe = GraniteMoE(cfg) if cfg.n_routed_experts > 0 else None
        # a shared_intermediate_size of 0 is no shared MLP (its empty tensors are left unused)
        self.shared_mlp = (
            GraniteSharedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act)
            if cfg.intermediate_size > 0
            else None
        )

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, h = mamba_or_attention(self, self.input_layernorm(hidden), hidden, ctx, caches, idx, keep)
        hidden = hidden + h * self.residual_multiplier
        h = self.post_attention_layernorm(hidden)
        if self.block_sparse_moe is None:
            assert self.shared_mlp is not None  # parse_config: a dense model has a shared MLP
            f = self.shared_mlp(h)
        elif self.shared_mlp is None:
            f = self.block_sparse_moe(h)
        else:
            f = self.block_sparse_moe(h) + self.shared_mlp(h)
        return hidden + f * self.residual_multiplier


def _rope(raw: dict[str, Any], source: str) -> tuple[float, float]:
    """(partial_rotary_factor, rope_theta): rotary embedding on the whole head for
    `position_embedding_type` "rope", none for "nope" or null."""
    pet = raw.get("position_embedding_type")
    if pet not in (None, "nope", "rope"):
        raise ConfigError(f"{source}: unsupported position_embedding_type {pet!r} (known: 'rope', 'nope')")
    rp = shared_fields.rope_parameters(raw, source, check_type=pet == "rope")
    return (1.0 if pet == "rope" else 0.0), shared_fields.rope_theta(raw, rp)


@register("GraniteMoeHybridForCausalLM")
class GraniteMoeHybridForCausalLM(StackedCausalLM):
    config: GraniteMoeHybridConfig
    config_class = GraniteMoeHybridConfig

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embedding_multiplier = self.config.embedding_multiplier
        self.logits_scaling = self.config.logits_scaling

    def build_stack(self) -> DecoderStack:
        layers = [GraniteMoeHybridLayer(self.config, k) for k in self.config.layer_types]
        return DecoderStack(self.config, layers, norm="norm")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        kinds = layer_kinds(raw, source, MODEL_TYPE)
        n = get_int(raw, "num_hidden_layers", default=len(kinds))
        hidden = get_int(raw, "hidden_size")
        partial, theta = _rope(raw, source)
        eps = get_float(raw, "rms_norm_eps", default=1e-6)
        act = str(raw.get("hidden_act", "silu"))
        experts = get_int(raw, "num_local_experts", default=8)
        cfg = GraniteMoeHybridConfig(
            architecture="GraniteMoeHybridForCausalLM",
            model_type=str(raw.get("model_type", MODEL_TYPE)),
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=n,
            layer_types=kinds,
            norm_eps=eps,
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=False),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=2048),
            **shared_fields.mamba_fields(raw, source, MODEL_TYPE, hidden),
            mamba_act=act,
            mamba_norm_eps=eps,
            **shared_fields.attention_fields(raw, hidden),
            rope_theta=theta,
            partial_rotary_factor=partial,
            intermediate_size=get_int(raw, "shared_intermediate_size", default=1024),
            mlp_act=act,
            mlp_bias=False,
            mlp_gated=True,
            n_routed_experts=experts,
            num_experts_per_tok=get_int(raw, "num_experts_per_tok", default=2) if experts > 0 else 0,
            moe_intermediate_size=get_int(raw, "intermediate_size", default=11008) if experts > 0 else 0,
            norm_topk_prob=True,
            embedding_multiplier=get_float(raw, "embedding_multiplier", default=1.0),
            residual_multiplier=get_float(raw, "residual_multiplier", default=1.0),
            attention_multiplier=get_float(raw, "attention_multiplier", default=1.0),
            logits_scaling=get_float(raw, "logits_scaling", default=1.0),
            raw=raw,
        )
        cfg.validate(source)
        if experts < 0 or (experts > 0 and not 0 < cfg.num_experts_per_tok <= experts):
            raise ConfigError(
                f"{source}: bad MoE expert counts (num_local_experts {experts}, "
                f"num_experts_per_tok {cfg.num_experts_per_tok})"
            )
        if cfg.intermediate_size < 0 or cfg.moe_intermediate_size < 0:
            raise ConfigError(f"{source}: bad MLP sizes (shared_intermediate_size, intermediate_size)")
        if cfg.intermediate_size == 0 and (experts == 0 or cfg.moe_intermediate_size == 0):
            raise ConfigError(
                f"{source}: no feed-forward: shared_intermediate_size and intermediate_size are 0"
            )
        if cfg.logits_scaling == 0:
            raise ConfigError(f"{source}: logits_scaling must not be 0")
        return cfg
