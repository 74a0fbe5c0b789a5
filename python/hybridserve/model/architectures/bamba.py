"""BambaForCausalLM: decoder layers of (Mamba2 mixer | rotary attention) + gated MLP, each
``x + mixer(input_layernorm(x))`` then ``x + ffn(pre_ff_layernorm(x))``. Rotary embedding on the
first half of each head (`partial_rotary_factor` 0.5, hard-coded by transformers).

Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.{mamba.*|self_attn.*}`,
`model.layers.{i}.feed_forward.{gate,up,down}_proj.weight`, `input_layernorm`, `pre_ff_layernorm`,
`model.final_layernorm.weight`, `lm_head.weight`. dt clamp: `time_step_limit`, in both paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.model.architectures import shared_fields
from hybridserve.model.architectures.base import DecoderStack, StackedCausalLM, mamba_or_attention, register
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import GatedMLP
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import MAMBA, ModelConfig, get_flag, get_float, get_int, layer_kinds


class BambaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg)
        else:
            self.self_attn = PagedAttention(cfg, bias=cfg.attention_bias)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, cfg.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, h = mamba_or_attention(self, self.input_layernorm(hidden), hidden, ctx, caches, idx, keep)
        hidden = hidden + h
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


@register("BambaForCausalLM")
class BambaForCausalLM(StackedCausalLM):
    def build_stack(self) -> DecoderStack:
        return DecoderStack(self.config, [BambaLayer(self.config, k) for k in self.config.layer_types])

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        n = get_int(raw, "num_hidden_layers")
        kinds = layer_kinds(raw, source, "bamba")
        hidden = get_int(raw, "hidden_size")
        # (transformers reads a legacy `rope_scaling` for Bamba too: a scaled rotary embedding is
        # refused, not run unscaled)
        rp = shared_fields.rope_parameters(raw, source)
        eps = get_float(raw, "rms_norm_eps", default=1e-5)
        cfg = ModelConfig(
            architecture="BambaForCausalLM",
            model_type=str(raw.get("model_type", "bamba")),
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=n,
            layer_types=kinds,
            norm_eps=eps,
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=False),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=262144),
            **shared_fields.mamba_fields(raw, source, "bamba", hidden),
            mamba_act=str(raw.get("hidden_act", "silu")),
            mamba_norm_eps=eps,
            **shared_fields.attention_fields(raw, hidden, kv_heads=shared_fields.TRANSFORMERS_KV_HEADS),
            rope_theta=shared_fields.rope_theta(raw, rp),
            partial_rotary_factor=get_float(rp, "partial_rotary_factor", default=0.5),
            intermediate_size=get_int(raw, "intermediate_size"),
            mlp_act=str(raw.get("hidden_act", "silu")),
            mlp_bias=get_flag(raw, "mlp_bias", default=False),
            mlp_gated=True,
            raw=raw,
        )
        cfg.validate(source)
        return cfg
