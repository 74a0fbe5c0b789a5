"""JambaForCausalLM (AI21's Jamba): decoder layers of (Mamba1 mixer | attention), each
``x + mixer(input_layernorm(x))`` then ``x + ffn(pre_ff_layernorm(x))``, where the FFN is a
top-k MoE every `expert_layer_period`-th layer from `expert_layer_offset` and a gated MLP in the
others. Attention every `attn_layer_period`-th layer from `attn_layer_offset`, without a rotary
embedding (the Mamba layers carry the positions).

The Mamba1 mixer (layers/mamba1.py) keeps a state per channel, ``[d_inner, d_state]``, with RMS
norms on its dt, B and C (Jamba's addition to Mamba1); the engine's Mamba pool holds it as
``[d_inner, 1, d_state]``. Its scan is a plain recurrence, so the model declares a scan chunk of
1 token: the state after any token can be kept.

The router: softmax over all experts (float32, float64 for float64 models), the top k taken with
their probabilities as weights, not renormalised.

Checkpoint names (as AI21 ships them and transformers writes them): `model.embed_tokens.weight`,
`model.layers.{i}.{mamba.*|self_attn.{q,k,v,o}_proj.weight}`, `input_layernorm`,
`pre_ff_layernorm`, `feed_forward.{gate,up,down}_proj.weight` (MLP layers),
`feed_forward.router.weight` and `feed_forward.experts.{e}.{gate,up,down}_proj.weight` (MoE
layers), `model.final_layernorm.weight`, `lm_head.weight`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
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
from hybridserve.model.layers.mamba1 import Mamba1Mixer
from hybridserve.model.layers.mlp import GatedMLP
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import (
    MAMBA,
    ModelConfig,
    get_field,
    get_flag,
    get_float,
    get_int,
    integral,
    layer_kinds,
    on_period,
)

MODEL_TYPE = "jamba"


@dataclass
class JambaConfig(ModelConfig):
    """ModelConfig plus the rank of the mixer's dt projection and which layers are MoE layers
    (the others have a gated MLP of `intermediate_size`; the experts are of that size too)."""

    dt_rank: int = 0
    moe_layers: list[bool] = field(default_factory=list)


class JambaMoE(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(
            [
                GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.mlp_act, False)
                for _ in range(cfg.n_routed_experts)
            ]
        )
        # Tensor parallelism: the experts' partial sums are summed over the ranks here, once per
        # layer (distributed/sharding.py); None in a single process.
        self.routed_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        probs = torch.softmax(F.linear(x.to(cdt), self.router.weight.to(cdt)), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        w = top.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out if self.routed_reduce is None else self.routed_reduce(out)


class JambaLayer(nn.Module):
    def __init__(self, cfg: JambaConfig, kind: str, moe: bool) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == MAMBA:
            self.mamba = Mamba1Mixer(cfg, cfg.dt_rank, bc_dt_norms=True)
        else:
            self.self_attn = PagedAttention(cfg, bias=False)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward: nn.Module = (
            JambaMoE(cfg) if moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, False)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        if self.kind == MAMBA:  # with `keep`, its out_proj runs the kept rows only
            h = self.mamba(h, ctx, caches.conv[idx], caches.ssm[idx], keep=keep)
            hidden = hidden if keep is None else hidden[keep]
        else:
            hidden, h = mamba_or_attention(self, h, hidden, ctx, caches, idx, keep)
        hidden = hidden + h
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


@register("JambaForCausalLM")
class JambaForCausalLM(StackedCausalLM):
    config: JambaConfig
    config_class = JambaConfig
    # dt_proj's bias joins dt before the softplus, as the other families' dt_bias
    fp32_param_suffixes = (*StackedCausalLM.fp32_param_suffixes, "dt_proj.bias", "router.weight")

    def build_stack(self) -> DecoderStack:
        c = self.config
        layers = [JambaLayer(c, k, moe) for k, moe in zip(c.layer_types, c.moe_layers)]
        return DecoderStack(c, layers, norm="final_layernorm")

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        kinds = layer_kinds(raw, source, MODEL_TYPE)
        n = get_int(raw, "num_hidden_layers", default=len(kinds))
        hidden = get_int(raw, "hidden_size")
        d_inner = shared_fields.mamba_expand_channels(raw, hidden)
        rank = get_field(raw, "mamba_dt_rank", default="auto")
        dt_rank = math.ceil(hidden / 16) if rank == "auto" else integral(rank, "mamba_dt_rank")
        experts = get_int(raw, "num_experts", "num_local_experts", default=16)
        moe = [experts > 1 and on_period(raw, source, "expert_layer", i, (2, 1)) for i in range(n)]
        eps = get_float(raw, "rms_norm_eps", default=1e-6)
        act = str(raw.get("hidden_act", "silu"))
        inter = get_int(raw, "intermediate_size", default=14336)
        cfg = JambaConfig(
            architecture="JambaForCausalLM",
            model_type=str(raw.get("model_type", MODEL_TYPE)),
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=n,
            layer_types=kinds,
            norm_eps=eps,
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=False),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=262144),
            mamba_version=1,
            nheads=d_inner,
            headdim=1,
            dstate=get_int(raw, "mamba_d_state", default=16),
            ngroups=1,
            d_conv=get_int(raw, "mamba_d_conv", default=4),
            chunk_size=shared_fields.chunk_size(raw, source, MODEL_TYPE),  # 1 unless config.json says
            d_inner=d_inner,
            mamba_conv_bias=get_flag(raw, "mamba_conv_bias", default=True),
            mamba_proj_bias=get_flag(raw, "mamba_proj_bias", default=False),
            mamba_act=act,
            mamba_norm_eps=eps,
            **shared_fields.attention_fields(raw, hidden, kv_heads=shared_fields.TRANSFORMERS_KV_HEADS),
            partial_rotary_factor=0.0,
            intermediate_size=inter,
            mlp_act=act,
            mlp_bias=False,
            mlp_gated=True,
            n_routed_experts=experts if any(moe) else 0,
            num_experts_per_tok=get_int(raw, "num_experts_per_tok", default=2) if any(moe) else 0,
            moe_intermediate_size=inter if any(moe) else 0,
            norm_topk_prob=False,
            dt_rank=dt_rank,
            moe_layers=moe,
            raw=raw,
        )
        cfg.validate(source)
        if dt_rank <= 0 or inter <= 0:
            raise ConfigError(f"{source}: mamba_dt_rank and intermediate_size must be positive")
        if any(moe) and not 0 < cfg.num_experts_per_tok <= experts:
            raise ConfigError(
                f"{source}: bad MoE expert counts (num_experts {experts}, "
                f"num_experts_per_tok {cfg.num_experts_per_tok})"
            )
        return cfg
