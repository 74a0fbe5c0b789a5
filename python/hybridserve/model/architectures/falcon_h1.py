"""FalconH1ForCausalLM (TII Falcon-H1): a parallel hybrid. Every decoder layer runs a Mamba2 mixer
and attention side by side on the same normed input and adds both to the residual stream, then a
gated MLP:

    h = input_layernorm(x)
    x = x + ssm_out * mamba(ssm_in * h) + attn_out * self_attn(attn_in * h)
    x = x + feed_forward(pre_ff_layernorm(x))

so every layer has a KV cache and a Mamba state (its layer kind is `HYBRID`, which counts as an
attention and as a Mamba layer in model_config).

Falcon-H1's muP multipliers: the embeddings times `embedding_multiplier`, the logits times
`lm_head_multiplier`; the keys times `key_multiplier` (folded into the score scale here: the keys
only meet the queries in the scores, so the KV cache holds the unscaled keys);
`attention_in_multiplier` / `attention_out_multiplier` on the attention's input / output,
`ssm_in_multiplier` / `ssm_out_multiplier` on the mixer's; the mixer's in_proj output times the muP
vector of `ssm_multipliers` (z, x, B, C, dt: five sections); the MLP ``down(up(x) *
act(gate(x) * m0)) * m1`` with `mlp_multipliers` (m0, m1). Rotary embedding on the whole head
(`rope_parameters`, or a top-level `rope_theta`; default type only).

The mixer: `mamba_d_ssm` (null: `mamba_expand * hidden_size`; left out: 1024, as transformers)
channels; ``y * silu(z)`` when
`mamba_rms_norm` is off (no norm weight in the checkpoint), the grouped RMSNorm otherwise, before
the gate (`mamba_norm_before_gate`, the default: ``norm(y) * silu(z)``) or after it
(``norm(y * silu(z))``); in_proj bias `mamba_proj_bias`, out_proj bias `projectors_bias`.

Checkpoint names (as transformers writes them): `model.embed_tokens.weight`,
`model.layers.{i}.{mamba.*|self_attn.*}`, `input_layernorm`, `pre_ff_layernorm`,
`feed_forward.{gate_proj,up_proj,down_proj}`, `model.final_layernorm.weight`, `lm_head.weight`
(absent when tied).

dt limits: as in granitemoehybrid.py, `time_step_limit` applies in prefill and decode alike (the
default (0, inf) never fires).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.errors import ConfigError
from hybridserve.model.architectures import shared_fields
from hybridserve.model.architectures.base import DecoderStack, StackedCausalLM, register
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import activation
from hybridserve.model.layers.norm import GatedRMSNorm, RMSNorm, gated_rms_norm
from hybridserve.model.model_config import (
    HYBRID,
    ModelConfig,
    get_flag,
    get_float,
    get_int,
    integral,
    layer_kinds,
)

MODEL_TYPE = "falcon_h1"


@dataclass
class FalconH1Config(ModelConfig):
    """ModelConfig plus Falcon-H1's muP multipliers and mixer options."""

    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: list[float] = field(default_factory=lambda: [1.0] * 5)  # z, x, B, C, dt
    mlp_multipliers: list[float] = field(default_factory=lambda: [1.0, 1.0])  # gate, down
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    projectors_bias: bool = False


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba2 mixer with Falcon-H1's input multiplier, muP vector, optional norm and
    `projectors_bias` on out_proj."""

    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__(cfg)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.hidden_size, bias=cfg.projectors_bias)
        self.rms_norm = cfg.mamba_rms_norm
        self.norm_before_gate = cfg.mamba_norm_before_gate
        if not self.rms_norm:
            del self.norm  # no norm: the checkpoint has no `mamba.norm.weight`
        self.ssm_in_multiplier = cfg.ssm_in_multiplier
        self.mup = list(cfg.ssm_multipliers)
        gn = cfg.ngroups * cfg.dstate
        self.mup_sizes = [cfg.d_inner, cfg.d_inner, gn, gn, cfg.nheads]
        self._mup_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _mup_vector(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        v = self._mup_cache.get(key)
        if v is None:
            v = torch.cat([torch.full((n,), m, dtype=like.dtype) for n, m in zip(self.mup_sizes, self.mup)])
            v = v.to(like.device)
            self._mup_cache[key] = v
        return v

    def forward(
        self, hidden: torch.Tensor, ctx: ForwardContext, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        dtype = hidden.dtype
        if self.ssm_in_multiplier != 1.0:
            hidden = hidden * self.ssm_in_multiplier
        proj = self.in_proj(hidden)
        if any(m != 1.0 for m in self.mup):
            proj = proj * self._mup_vector(proj)
        y, z = self.scan(proj, ctx, conv_state, ssm_state)
        if not self.rms_norm:
            cdt = _compute_dtype(dtype)
            out = (y.to(cdt) * F.silu(z.to(cdt))).to(dtype)
        elif type(self.norm) is not GatedRMSNorm:  # a norm group split over tensor-parallel ranks
            out = self.norm(y, z, dtype)
        elif not self.norm_before_gate:
            out = gated_rms_norm(y, z, self.norm.weight, self.norm.group_size, self.norm.eps, dtype)
        else:
            out = _norm_then_gate(y, z, self.norm.weight, self.norm.group_size, self.norm.eps, dtype)
        return self.out_proj(out)


def _norm_then_gate(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``weight * rmsnorm_grouped(y) * silu(z)`` (norm_before_gate=True), in fp32 (fp64)."""
    cdt = _compute_dtype(out_dtype)
    h = y.to(cdt)
    T, d = h.shape
    g = h.view(T, d // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(cdt) * g.view(T, d) * F.silu(z.to(cdt))).to(out_dtype)


class FalconH1MLP(nn.Module):
    """``down(up(x) * act(gate(x) * m0)) * m1``."""

    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, h, bias=cfg.mlp_bias)
        self.act = activation(cfg.mlp_act)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1Layer(nn.Module):
    kind = HYBRID

    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mamba = FalconH1Mixer(cfg)
        self.self_attn = PagedAttention(cfg, bias=cfg.attention_bias)
        # the keys times key_multiplier: the same scores as a scale times key_multiplier
        self.self_attn.scale = cfg.head_dim**-0.5 * cfg.key_multiplier
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FalconH1MLP(cfg)
        self.attention_in_multiplier = cfg.attention_in_multiplier
        self.attention_out_multiplier = cfg.attention_out_multiplier
        self.ssm_out_multiplier = cfg.ssm_out_multiplier

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        # the Mamba mixer runs every token (its state needs them all); attention computes the
        # queries of the kept rows only (K / V of every token are written)
        m = self.mamba(h, ctx, caches.conv[idx], caches.ssm[idx])
        a_in = h if self.attention_in_multiplier == 1.0 else h * self.attention_in_multiplier
        a = self.self_attn(a_in, ctx, caches.kv[idx], keep=keep)
        if keep is not None:
            hidden, m = hidden[keep], m[keep]
        hidden = hidden + (m * self.ssm_out_multiplier + a * self.attention_out_multiplier)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


def _floats(raw: dict[str, Any], name: str, n: int, source: str) -> list[float]:
    v = raw.get(name)
    if v is None:
        return [1.0] * n
    if (
        not isinstance(v, list)
        or len(v) != n
        or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)
    ):
        raise ConfigError(f"{source}: {name} must be a list of {n} numbers, got {v!r}")
    return [float(x) for x in v]


@register("FalconH1ForCausalLM")
class FalconH1ForCausalLM(StackedCausalLM):
    config: FalconH1Config
    config_class = FalconH1Config

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embedding_multiplier = self.config.embedding_multiplier
        self.lm_head_multiplier = self.config.lm_head_multiplier

    def build_stack(self) -> DecoderStack:
        return DecoderStack(self.config, [FalconH1Layer(self.config) for _ in range(self.config.num_layers)])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.lm_head_multiplier

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        kinds = layer_kinds(raw, source, MODEL_TYPE)
        if any(k != HYBRID for k in kinds):
            raise ConfigError(f"{source}: every Falcon-H1 layer is a hybrid (attention + Mamba) layer")
        n = get_int(raw, "num_hidden_layers", default=len(kinds))
        if len(kinds) != n:
            kinds = [HYBRID] * n
        hidden = get_int(raw, "hidden_size")
        # the mixer's channels: null is mamba_expand * hidden_size; left out, transformers'
        # FalconH1Config default
        d_ssm = raw.get("mamba_d_ssm", 1024)
        d_inner = None if d_ssm is None else integral(d_ssm, "mamba_d_ssm")
        eps = get_float(raw, "rms_norm_eps", default=1e-5)
        act = str(raw.get("hidden_act", "silu"))
        mlp_mult = _floats(raw, "mlp_multipliers", 2, source)
        cfg = FalconH1Config(
            architecture="FalconH1ForCausalLM",
            model_type=str(raw.get("model_type", MODEL_TYPE)),
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=n,
            layer_types=kinds,
            norm_eps=eps,
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=False),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=get_int(raw, "max_position_embeddings", default=8192),
            **shared_fields.mamba_fields(raw, source, MODEL_TYPE, hidden, d_inner),
            mamba_act=act,
            mamba_norm_eps=eps,
            **shared_fields.attention_fields(raw, hidden, kv_heads=shared_fields.TRANSFORMERS_KV_HEADS),
            rope_theta=shared_fields.rope_theta(raw, shared_fields.rope_parameters(raw, source)),
            partial_rotary_factor=1.0,
            intermediate_size=get_int(raw, "intermediate_size", default=14336),
            mlp_act=act,
            mlp_bias=get_flag(raw, "mlp_bias", default=False),
            mlp_gated=True,
            embedding_multiplier=get_float(raw, "embedding_multiplier", default=1.0),
            lm_head_multiplier=get_float(raw, "lm_head_multiplier", default=1.0),
            key_multiplier=get_float(raw, "key_multiplier", default=1.0),
            attention_in_multiplier=get_float(raw, "attention_in_multiplier", default=1.0),
            attention_out_multiplier=get_float(raw, "attention_out_multiplier", default=1.0),
            ssm_in_multiplier=get_float(raw, "ssm_in_multiplier", default=1.0),
            ssm_out_multiplier=get_float(raw, "ssm_out_multiplier", default=1.0),
            ssm_multipliers=_floats(raw, "ssm_multipliers", 5, source),
            mlp_multipliers=mlp_mult,
            mamba_rms_norm=get_flag(raw, "mamba_rms_norm", default=False),
            mamba_norm_before_gate=get_flag(raw, "mamba_norm_before_gate", default=True),
            projectors_bias=get_flag(raw, "projectors_bias", default=False),
            raw=raw,
        )
        cfg.validate(source)
        if cfg.intermediate_size <= 0:
            raise ConfigError(f"{source}: intermediate_size must be positive")
        return cfg
