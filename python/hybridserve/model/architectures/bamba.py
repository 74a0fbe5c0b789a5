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

from hybridserve.errors import ConfigError
from hybridserve.model.architectures.base import CausalLM, mamba_or_attention, register
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import GatedMLP
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import (
    MAMBA,
    SCAN_CHUNK_DEFAULTS,
    ModelConfig,
    get_field,
    get_flag,
    get_float,
    get_int,
    integral,
    layer_kinds,
    scan_chunk_size,
    time_step_limit,
    token_ids,
)


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


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([BambaLayer(cfg, k) for k in cfg.layer_types])
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


@register("BambaForCausalLM")
class BambaForCausalLM(CausalLM):
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = _Inner(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.final_layernorm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        n = get_int(raw, "num_hidden_layers")
        kinds = layer_kinds(raw, source, "bamba")
        hidden = get_int(raw, "hidden_size")
        expand = get_float(raw, "mamba_expand", default=2)
        d_inner = integral(expand * hidden, "expand * hidden_size")
        nheads = get_int(raw, "mamba_n_heads", default=128)
        d_head = raw.get("mamba_d_head", "auto")
        headdim = d_inner // nheads if d_head in (None, "auto") else integral(d_head, "mamba_d_head")
        num_heads = get_int(raw, "num_attention_heads")
        rp = raw.get("rope_parameters") or {}
        if not isinstance(rp, dict):
            raise ConfigError(f"{source}: rope_parameters must be an object")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: unsupported rope_type {rope_type!r}")
        theta = get_float(rp, "rope_theta", default=get_field(raw, "rope_theta", default=10000.0))
        partial = get_float(rp, "partial_rotary_factor", default=0.5)
        dt_min, dt_max = time_step_limit(raw, "time_step_limit")
        bos, _ = token_ids(raw, "bos_token_id")
        eos, eos_all = token_ids(raw, "eos_token_id")
        pad, _ = token_ids(raw, "pad_token_id")
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
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=eos_all,
            pad_token_id=pad,
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=262144),
            nheads=nheads,
            headdim=headdim,
            dstate=get_int(raw, "mamba_d_state", default=256),
            ngroups=get_int(raw, "mamba_n_groups", default=1),
            d_conv=get_int(raw, "mamba_d_conv", default=4),
            chunk_size=scan_chunk_size(raw, source, "bamba") or SCAN_CHUNK_DEFAULTS["bamba"],
            d_inner=d_inner,
            mamba_conv_bias=get_flag(raw, "mamba_conv_bias", default=True),
            mamba_proj_bias=get_flag(raw, "mamba_proj_bias", default=False),
            mamba_act=str(raw.get("hidden_act", "silu")),
            mamba_norm_eps=eps,
            dt_min=dt_min,
            dt_max=dt_max,
            num_heads=num_heads,
            num_kv_heads=get_int(raw, "num_key_value_heads", default=num_heads),
            head_dim=get_int(raw, "head_dim", default=hidden // num_heads),
            attention_bias=get_flag(raw, "attention_bias", default=False),
            rope_theta=theta,
            partial_rotary_factor=partial,
            intermediate_size=get_int(raw, "intermediate_size"),
            mlp_act=str(raw.get("hidden_act", "silu")),
            mlp_bias=get_flag(raw, "mlp_bias", default=False),
            mlp_gated=True,
            raw=raw,
        )
        cfg.validate(source)
        return cfg
