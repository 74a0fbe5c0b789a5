"""NemotronHForCausalLM: a pattern of Mamba2 (`M`), attention (`*`, no rotary embedding), relu2 MLP
(`-`) and MoE (`E`) layers, each ``x + mixer(norm(x))``.

Checkpoint names: `backbone.embeddings.weight`, `backbone.layers.{i}.norm.weight`,
`backbone.layers.{i}.mixer.*`, `backbone.norm_f.weight`, `lm_head.weight`.

dt limits: `time_step_limit`, default ``(0, inf)``, as transformers' mixer and vLLM's apply them
(released configs say ``[0.0, Infinity]``). `time_step_min` (0.001 in every released config) only
shapes the initialisation of `dt_bias`: clamping by it would change every head whose dt falls
below it. The limits apply in prefill and decode alike, so that every chunking gives the same
states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.errors import ConfigError
from hybridserve.model.architectures import shared_fields
from hybridserve.model.architectures.base import DecoderStack, StackedCausalLM, register
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import MLP, MoE
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import (
    ATTENTION,
    MAMBA,
    MOE,
    ModelConfig,
    get_field,
    get_flag,
    get_float,
    get_int,
    integral,
    layer_kinds,
    time_step_limit,
)
from hybridserve.model.model_config import (
    MLP as MLP_KIND,
)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(cfg)
        elif kind == ATTENTION:
            self.mixer = PagedAttention(cfg, bias=cfg.attention_bias)
        elif kind == MLP_KIND:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, cfg.mlp_bias)
        else:
            self.mixer = MoE(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.norm(hidden)
        if self.kind == ATTENTION:
            # with `keep`, the queries of the kept tokens only (K / V of every token are written)
            h = self.mixer(h, ctx, caches.kv[idx], keep=keep)
            return (hidden if keep is None else hidden[keep]) + h
        if self.kind == MAMBA:
            h = self.mixer(h, ctx, caches.conv[idx], caches.ssm[idx])
        else:
            h = self.mixer(h)
        out = hidden + h
        return out if keep is None else out[keep]


@register("NemotronHForCausalLM")
class NemotronHForCausalLM(StackedCausalLM):
    stack_name = "backbone"
    # transformers' NemotronHForCausalLM ties nothing (its _tied_weights_keys is empty): with
    # tie_word_embeddings true it still saves lm_head.weight and computes the logits with it
    honours_tie_word_embeddings = False

    def build_stack(self) -> DecoderStack:
        layers = [NemotronHBlock(self.config, k) for k in self.config.layer_types]
        return DecoderStack(self.config, layers, embedding="embeddings", norm="norm_f")

    def last_cache_layer(self) -> int:
        # the MLP / MoE layers after the last Mamba or attention layer write no cache
        kinds = self.config.layer_types
        return max((i for i, k in enumerate(kinds) if k in (MAMBA, ATTENTION)), default=len(kinds) - 1)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        kinds = layer_kinds(raw, source, "nemotron_h")
        # (sizes a config leaves out take transformers' NemotronHConfig defaults; the MoE ones
        # only matter with MoE layers)
        moe = MOE in kinds
        hidden = get_int(raw, "hidden_size", default=0)
        nheads = get_int(raw, "mamba_num_heads", default=0)
        headdim = get_int(raw, "mamba_head_dim", default=0)
        num_heads = get_int(raw, "num_attention_heads", default=0)
        head_dim = get_field(raw, "head_dim", "attention_head_dim")
        if head_dim is None and num_heads > 0:
            head_dim = hidden // num_heads
        # transformers' NemotronHConfig takes the legacy `mamba_*` names (`mamba_dt_limit`,
        # `mamba_conv_bias`, `mamba_n_groups`, `mamba_d_conv`, `mamba_chunk_size`) over the current
        # ones where both are given
        dt_min, dt_max = time_step_limit(raw, "mamba_dt_limit", "time_step_limit")
        cfg = ModelConfig(
            architecture="NemotronHForCausalLM",
            model_type=str(raw.get("model_type", "nemotron_h")),
            vocab_size=get_int(raw, "vocab_size", default=0),
            hidden_size=hidden,
            num_layers=len(kinds),
            layer_types=kinds,
            norm_eps=get_float(raw, "layer_norm_epsilon", "rms_norm_eps", default=1e-5),
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=False),
            residual_in_fp32=get_flag(raw, "residual_in_fp32", default=False),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=4096),
            nheads=nheads,
            headdim=headdim,
            dstate=get_int(raw, "ssm_state_size", "mamba_d_state", default=128),
            ngroups=get_int(raw, "mamba_n_groups", "n_groups", default=8),
            d_conv=get_int(raw, "mamba_d_conv", "conv_kernel", default=4),
            chunk_size=shared_fields.chunk_size(raw, source, "nemotron_h"),
            d_inner=nheads * headdim,
            mamba_conv_bias=get_flag(raw, "mamba_conv_bias", "use_conv_bias", default=True),
            # the in/out projections' bias is use_bias (transformers' NemotronH and NVIDIA's own
            # code read it; transformers writes mamba_proj_bias too, always false, and never reads it)
            mamba_proj_bias=get_flag(raw, "use_bias", default=False),
            mamba_act=str(raw.get("mamba_hidden_act", "silu")),
            mamba_norm_eps=get_float(raw, "layer_norm_epsilon", "rms_norm_eps", default=1e-5),
            dt_min=dt_min,
            dt_max=dt_max,
            mamba_ssm_cache_dtype=str(raw.get("mamba_ssm_cache_dtype", "float32")),
            num_heads=num_heads,
            num_kv_heads=shared_fields.kv_heads_field(raw, num_heads, shared_fields.TRANSFORMERS_KV_HEADS),
            head_dim=integral(head_dim or 0, "head_dim"),
            # (transformers' NemotronHAttention has no biases whatever this says, NVIDIA's own code
            # has them when it says true: a checkpoint saying true without bias tensors is refused
            # as missing them, rather than one with them run without)
            attention_bias=get_flag(raw, "attention_bias", default=False),
            partial_rotary_factor=0.0,
            intermediate_size=get_int(raw, "intermediate_size", default=21504),
            mlp_act=str(raw.get("mlp_hidden_act", "relu2")),
            mlp_bias=get_flag(raw, "mlp_bias", default=False),
            mlp_gated=False,
            n_routed_experts=get_int(raw, "n_routed_experts", "num_local_experts", default=8) if moe else 0,
            num_experts_per_tok=get_int(raw, "num_experts_per_tok", default=2) if moe else 0,
            moe_intermediate_size=get_int(raw, "moe_intermediate_size", default=7688) if moe else 0,
            moe_shared_expert_intermediate_size=(
                get_int(raw, "moe_shared_expert_intermediate_size", default=7688) if moe else 0
            ),
            moe_latent_size=raw.get("moe_latent_size"),
            n_group=(get_int(raw, "n_group", default=1) or 1),
            topk_group=(get_int(raw, "topk_group", default=1) or 1),
            norm_topk_prob=get_flag(raw, "norm_topk_prob", default=True),
            routed_scaling_factor=get_float(raw, "routed_scaling_factor", default=1.0),
            raw=raw,
        )
        cfg.validate(source)
        if moe and cfg.moe_shared_expert_intermediate_size <= 0:
            raise ConfigError(f"{source}: MoE layers need moe_shared_expert_intermediate_size")
        return cfg
