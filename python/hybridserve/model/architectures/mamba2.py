"""Mamba2ForCausalLM: pure Mamba2 stack, each layer ``x + mixer(norm(x))`` (residual kept in fp32
when `residual_in_fp32`). Checkpoint names: `backbone.embeddings.weight`,
`backbone.layers.{i}.norm.weight`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f.weight`,
`lm_head.weight` (absent when tied). dt clamp: `time_step_limit`, in both paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.model.architectures import shared_fields
from hybridserve.model.architectures.base import DecoderStack, StackedCausalLM, register
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import (
    MAMBA,
    ModelConfig,
    get_flag,
    get_float,
    get_int,
    integral,
    time_step_limit,
)


class Mamba2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dtype = self.norm.weight.dtype
        h = self.mixer(self.norm(hidden.to(dtype)), ctx, caches.conv[idx], caches.ssm[idx])
        if self.residual_in_fp32 and hidden.dtype in (torch.bfloat16, torch.float16):
            hidden = hidden.to(torch.float32)
        out = hidden + h.to(hidden.dtype)
        return out if keep is None else out[keep]


@register("Mamba2ForCausalLM")
class Mamba2ForCausalLM(StackedCausalLM):
    stack_name = "backbone"
    key_aliases = {"backbone.embeddings.weight": ("backbone.embedding.weight",)}  # state-spaces naming

    def build_stack(self) -> DecoderStack:
        cfg = self.config
        layers = [Mamba2Block(cfg) for _ in range(cfg.num_layers)]
        return DecoderStack(cfg, layers, embedding="embeddings", norm="norm_f")

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        # a residual kept in fp32 (`residual_in_fp32`) meets the norm in the model's dtype
        norm = self.stack().output_norm
        return norm(hidden.to(norm.weight.dtype))

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        hidden = get_int(raw, "hidden_size", "d_model")
        legacy = "hidden_size" not in raw  # (mamba_ssm's own field names: d_model, n_layer)
        n = get_int(raw, "num_hidden_layers", "n_layer")
        expand = get_float(raw, "expand", default=2)
        d_inner = integral(expand * hidden, "expand * hidden_size")
        headdim = get_int(raw, "head_dim", default=64)
        nheads = get_int(raw, "num_heads", default=d_inner // headdim)
        dt_min, dt_max = time_step_limit(raw, "time_step_limit")
        eps = get_float(raw, "layer_norm_epsilon", default=1e-5)
        cfg = ModelConfig(
            architecture="Mamba2ForCausalLM",
            model_type=str(raw.get("model_type", "mamba2")),
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=n,
            layer_types=[MAMBA] * n,
            norm_eps=eps,
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=False),
            residual_in_fp32=get_flag(raw, "residual_in_fp32", default=True),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=1 << 20),
            nheads=nheads,
            headdim=headdim,
            dstate=get_int(raw, "state_size", default=128),
            # left out: transformers' Mamba2Config default, or mamba_ssm's in its own format
            ngroups=get_int(raw, "n_groups", "ngroups", default=1 if legacy else 8),
            d_conv=get_int(raw, "conv_kernel", default=4),
            chunk_size=shared_fields.chunk_size(raw, source, "mamba2"),
            d_inner=d_inner,
            mamba_conv_bias=get_flag(raw, "use_conv_bias", default=True),
            mamba_proj_bias=get_flag(raw, "use_bias", default=False),
            mamba_act=str(raw.get("hidden_act", "silu")),
            mamba_norm_eps=eps,
            dt_min=dt_min,
            dt_max=dt_max,
            raw=raw,
        )
        cfg.validate(source)
        return cfg
