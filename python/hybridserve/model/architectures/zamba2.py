"""Zamba2ForCausalLM (Zyphra Zamba2): a Mamba2 backbone with a few *shared* transformer blocks
(attention + gated MLP) whose weights are reused at several depths.

`layers_block_type` lists "mamba" (transformers 5: "linear_attention") and "hybrid" layers. A
Mamba layer is ``x + mamba(input_layernorm(x))``. A hybrid layer is one *use* of a shared block
followed by a Mamba layer of its own:

    s = shared_block(cat(x, e))                 # e: the token embeddings, as the model's input
    t = linear(s)                               # this use's own projection, hidden -> hidden
    x = x + mamba(input_layernorm(x + t))

    shared_block(u) = feed_forward(pre_ff_layernorm(self_attn(input_layernorm(u))))

(no residual inside the shared block). The attention reads ``2 * hidden_size`` channels: its head
size is ``2 * hidden_size // num_attention_heads`` and its score scale ``(head_dim / 2) ** -0.5``;
o_proj returns to ``hidden_size``. RoPE on the whole head when `use_mem_rope`. The MLP is
``down(act(gate) * up)`` with gate | up from one `gate_up_proj`.

`num_mem_blocks` shared blocks alternate: the i-th hybrid layer (in layer order) uses block
``i % num_mem_blocks``. Each use has its own LoRA-style adapters, ``W x + B(A(x))``, inside its
block: `gate_up_proj_adapter_list.{i}` on the MLP's gate_up (always, as in transformers) and, with
`use_shared_attention_adapter`, `linear_{q,k,v}_adapter_list.{i}` on the attention's projections
(rank `adapter_rank`).

Caching: every hybrid layer is a layer of kind `HYBRID` (model_config): it has a KV cache (its use
of the shared attention: a separate attention layer for the KV pool) and a Mamba state; the Mamba
layers a Mamba state. Weight sharing is the model's own matter: the block is one module that every
hybrid layer using it holds. With untied word embeddings (`tie_word_embeddings` false) transformers
5 ties nothing, not even the blocks, and writes every use's block weights: each use then has its
own copy, tied to the first use's only when the checkpoint lacks it (`tied_weight_map`).

Checkpoint names (as transformers writes them): `model.embed_tokens.weight`,
`model.layers.{i}.{input_layernorm,mamba.*}` (Mamba layers), `model.layers.{i}.linear.weight`,
`model.layers.{i}.mamba_decoder.{input_layernorm,mamba.*}` and, for the first use of each shared
block only, `model.layers.{i}.shared_transformer.{input_layernorm,pre_ff_layernorm,self_attn.*,
feed_forward.*}`; `model.final_layernorm.weight`, `lm_head.weight` (absent when tied, the default).
`add_bias_linear` puts biases on the Mamba in/out projections and the MLP; the conv always has a
bias (transformers ignores `use_conv_bias`); the mixer's gated norm uses eps 1e-5.

dt limits: transformers' Zamba2 mixer uses ``(time_step_min, inf)`` and clamps only in its chunked
(prefill) path, not in single-token decode. We apply it in both paths so that prefill and decode
agree exactly (as for Nemotron-H); against transformers it is identical whenever the clamp does not
fire (the parity tests use time_step_min 0).

Refused at load, naming the field: a rope type other than "default", GQA or a head size that does
not split ``2 * hidden_size`` together with the attention adapters (transformers cannot build
those either), `use_shared_mlp_adapter` false (transformers' Zamba2 always has the MLP adapters),
a layer type other than mamba / hybrid, an activation the engine lacks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
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
from hybridserve.model.layers.mlp import activation
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import (
    HYBRID,
    MAMBA,
    ModelConfig,
    get_flag,
    get_float,
    get_int,
    layer_kinds,
)

MODEL_TYPE = "zamba2"
ARCHITECTURE = "Zamba2ForCausalLM"
_EMBEDS_KEY = ("zamba2_embeds",)


@dataclass
class Zamba2Config(ModelConfig):
    """ModelConfig plus the shared blocks' layout and adapters. `hidden_size` is the backbone's;
    the shared attention reads twice as many channels (`head_dim` is already its own)."""

    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    add_bias_linear: bool = False

    @property
    def hybrid_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_types) if k == HYBRID]


class _Adapter(nn.Sequential):
    """``up(down(x))``, no biases: transformers' adapter (checkpoint names `.0.weight`, `.1.weight`)."""

    def __init__(self, d_in: int, rank: int, d_out: int) -> None:
        super().__init__(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))


def _adapter_list(
    n_uses: int, block: int, num_blocks: int, d_in: int, rank: int, d_out: int
) -> nn.ModuleList:
    """Adapters indexed by use (hybrid layer order); the block owns the uses ``i % num_blocks ==
    block`` and holds a placeholder (no weights) at the others, as transformers does."""
    return nn.ModuleList(
        [_Adapter(d_in, rank, d_out) if i % num_blocks == block else nn.Identity() for i in range(n_uses)]
    )


class Zamba2Attention(PagedAttention):
    """Paged attention over ``2 * hidden_size`` input channels, with the per-use adapters on q, k, v."""

    def __init__(self, cfg: Zamba2Config, block: int) -> None:
        wide = 2 * cfg.hidden_size
        super().__init__(dataclasses.replace(cfg, hidden_size=wide), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = (cfg.head_dim / 2) ** -0.5
        self.adapters = cfg.use_shared_attention_adapter
        if self.adapters:
            n, nb, r = len(cfg.hybrid_layer_ids), cfg.num_mem_blocks, cfg.adapter_rank
            self.linear_q_adapter_list = _adapter_list(n, block, nb, wide, r, wide)
            self.linear_k_adapter_list = _adapter_list(n, block, nb, wide, r, wide)
            self.linear_v_adapter_list = _adapter_list(n, block, nb, wide, r, wide)

    def forward_use(
        self,
        x: torch.Tensor,
        use: int,
        ctx: ForwardContext,
        kv_cache: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        xq = x if keep is None else x[keep]
        q, k, v = self.q_proj(xq), self.k_proj(x), self.v_proj(x)
        if self.adapters:
            q = q + self.linear_q_adapter_list[use](xq)
            k = k + self.linear_k_adapter_list[use](x)
            v = v + self.linear_v_adapter_list[use](x)
        return self.attend(q, k, v, ctx, kv_cache, keep)


class Zamba2MLP(nn.Module):
    """``down(act(gate) * up)``, gate | up = ``gate_up_proj(x) + adapter_use(x)``."""

    def __init__(self, cfg: Zamba2Config, block: int) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=cfg.add_bias_linear)
        self.down_proj = nn.Linear(inter, h, bias=cfg.add_bias_linear)
        self.act = activation(cfg.mlp_act)
        n, nb, r = len(cfg.hybrid_layer_ids), cfg.num_mem_blocks, cfg.adapter_rank
        self.gate_up_proj_adapter_list = _adapter_list(n, block, nb, h, r, 2 * inter)

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[use](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block (transformers' Zamba2AttentionDecoderLayer)."""

    def __init__(self, cfg: Zamba2Config, block: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(2 * cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Zamba2Attention(cfg, block)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = Zamba2MLP(cfg, block)

    def forward(
        self, x: torch.Tensor, embeds: torch.Tensor, use: int, ctx: ForwardContext, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        h = self.input_layernorm(torch.cat([x, embeds], dim=-1))
        h = self.self_attn.forward_use(h, use, ctx, kv_cache)
        return self.feed_forward(self.pre_ff_layernorm(h), use)


class Zamba2MambaLayer(nn.Module):
    """``x + mamba(input_layernorm(x + extra))`` (the residual without `extra`)."""

    kind = MAMBA

    def __init__(self, cfg: Zamba2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mamba = Mamba2Mixer(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(hidden if extra is None else hidden + extra)
        if keep is None:
            return hidden + self.mamba(h, ctx, caches.conv[idx], caches.ssm[idx])
        # the scan runs every token (the state needs them all); the norm and out_proj only the
        # kept rows
        y, z = self.mamba.scan(self.mamba.in_proj(h), ctx, caches.conv[idx], caches.ssm[idx])
        return hidden[keep] + self.mamba.out_proj(self.mamba.norm(y[keep], z[keep], h.dtype))


class Zamba2HybridLayer(nn.Module):
    """One use of a shared block (its KV cache at this layer's index), its own `linear`, then its
    own Mamba layer (`mamba_decoder`). The shared block is registered under the first layer that
    uses it (where the checkpoint stores it); later users hold the same module."""

    kind = HYBRID

    def __init__(self, cfg: Zamba2Config, shared: Zamba2SharedBlock, use: int, embed: nn.Embedding) -> None:
        super().__init__()
        self.shared_transformer = shared
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaLayer(cfg)
        self.use = use
        self._embed = (embed,)  # a tuple: not registered again as a submodule

    def _embeds(self, ctx: ForwardContext) -> torch.Tensor:
        """The batch's token embeddings (the model's input), looked up once per forward."""
        e = ctx.scratch.get(_EMBEDS_KEY)
        if e is None:
            w = self._embed[0].weight
            e = self._embed[0](ctx.batch.input_ids.to(w.device, torch.int64))
            ctx.scratch[_EMBEDS_KEY] = e
        return e  # type: ignore[return-value]

    def forward(
        self,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        caches: ModelCaches,
        idx: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # every token: the Mamba layer after the attention needs them all
        s = self.shared_transformer(hidden, self._embeds(ctx), self.use, ctx, caches.kv[idx])
        return self.mamba_decoder(hidden, ctx, caches, idx, keep, extra=self.linear(s))


class _Inner(DecoderStack):
    """The stack; every hybrid layer holds the embedding module (its shared block reads the
    token embeddings)."""

    def __init__(self, cfg: Zamba2Config) -> None:
        super().__init__(cfg)
        blocks: list[Zamba2SharedBlock] = []
        # layer index of each hybrid layer -> that of the first layer using the same block
        self.first_use: dict[int, int] = {}
        hybrid = cfg.hybrid_layer_ids
        for i, kind in enumerate(cfg.layer_types):
            if kind == HYBRID:
                use = hybrid.index(i)
                b = use % cfg.num_mem_blocks
                self.first_use[i] = hybrid[b]
                if not cfg.tie_word_embeddings:  # see Zamba2ForCausalLM.tied_weight_map
                    block = Zamba2SharedBlock(cfg, b)
                elif b == len(blocks):
                    block = Zamba2SharedBlock(cfg, b)
                    blocks.append(block)
                else:
                    block = blocks[b]
                self.layers.append(Zamba2HybridLayer(cfg, block, use, self.token_embedding))
            else:
                self.layers.append(Zamba2MambaLayer(cfg))


@register(ARCHITECTURE)
class Zamba2ForCausalLM(StackedCausalLM):
    config: Zamba2Config
    config_class = Zamba2Config
    model: _Inner

    def build_stack(self) -> DecoderStack:
        return _Inner(self.config)

    def tied_weight_map(self) -> dict[str, str]:
        """The LM head, and with untied embeddings every later use's block weights -> the first
        use's, for a checkpoint that stores only the first (they are then shared; a checkpoint
        that stores every use's, as transformers 5 writes an untied Zamba2, loads them as they
        are: transformers ties the blocks only together with the embeddings)."""
        ties = super().tied_weight_map()
        if self.config.tie_word_embeddings:
            return ties  # one module per shared block
        layers = self.model.layers
        for i, first in self.model.first_use.items():
            if i != first:
                block = layers[i].get_submodule("shared_transformer")
                for n, _ in block.named_parameters():
                    ties[f"model.layers.{i}.shared_transformer.{n}"] = (
                        f"model.layers.{first}.shared_transformer.{n}"
                    )
        return ties

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        kinds = layer_kinds(raw, source, MODEL_TYPE)
        n = get_int(raw, "num_hidden_layers", default=len(kinds))
        if n != len(kinds):  # (a list given was checked with it: this is transformers' default layout)
            raise bad(
                f"num_hidden_layers is {n} but config.json lists no layers_block_type, and the default "
                f"layout has {len(kinds)} layers"
            )
        hidden = get_int(raw, "hidden_size")
        num_heads = get_int(raw, "num_attention_heads")
        num_kv_heads = get_int(raw, "num_key_value_heads", default=num_heads)
        if num_heads <= 0 or hidden <= 0:
            raise bad("hidden_size and num_attention_heads must be positive")
        head_dim = 2 * hidden // num_heads  # transformers derives it (attention_head_dim)
        d_inner = shared_fields.mamba_expand_channels(raw, hidden)
        nheads = get_int(raw, "n_mamba_heads", default=8)
        if nheads <= 0:
            raise bad("n_mamba_heads must be positive")
        num_mem_blocks = get_int(raw, "num_mem_blocks", default=1)
        if num_mem_blocks < 1:
            raise bad(f"num_mem_blocks must be at least 1, got {num_mem_blocks}")
        attn_adapters = get_flag(raw, "use_shared_attention_adapter", default=False)
        if not get_flag(raw, "use_shared_mlp_adapter", default=True):
            raise bad(
                "use_shared_mlp_adapter false is not supported (transformers' Zamba2 always has the "
                "MLP adapters)"
            )
        rank = get_int(raw, "adapter_rank", default=128)
        if rank <= 0:
            raise bad(f"adapter_rank must be positive, got {rank}")
        if attn_adapters and (num_kv_heads != num_heads or num_heads * head_dim != 2 * hidden):
            raise bad(
                "use_shared_attention_adapter needs num_key_value_heads == num_attention_heads and "
                f"num_attention_heads ({num_heads}) dividing 2 * hidden_size ({2 * hidden}): the "
                "adapters are 2 * hidden_size wide"
            )
        act = str(raw.get("hidden_act", "gelu"))
        try:
            activation(act)
        except ConfigError:
            raise bad(f"hidden_act: unsupported activation {act!r}") from None
        use_rope = get_flag(raw, "use_mem_rope", default=False)
        theta = (
            shared_fields.rope_theta(raw, shared_fields.rope_parameters(raw, source)) if use_rope else 10000.0
        )
        max_pos = get_int(raw, "max_position_embeddings", default=4096)
        if get_flag(raw, "use_long_context", default=False):
            max_pos = 16384  # what transformers' config sets
        bias = get_flag(raw, "add_bias_linear", default=False)
        intermediate = get_int(raw, "intermediate_size", default=4 * hidden)
        cfg = Zamba2Config(
            architecture=ARCHITECTURE,
            model_type=str(raw.get("model_type", MODEL_TYPE)),
            vocab_size=get_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=n,
            layer_types=kinds,
            norm_eps=get_float(raw, "rms_norm_eps", default=1e-5),
            tie_word_embeddings=get_flag(raw, "tie_word_embeddings", default=True),
            **shared_fields.special_tokens(raw),
            max_position_embeddings=max_pos,
            nheads=nheads,
            headdim=d_inner // nheads,
            **shared_fields.mamba_state_fields(raw, source, MODEL_TYPE, d_state=64, n_groups="mamba_ngroups"),
            d_inner=d_inner,
            mamba_conv_bias=True,
            mamba_proj_bias=bias,
            mamba_act="silu",
            mamba_norm_eps=1e-5,
            dt_min=get_float(raw, "time_step_min", default=0.001),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            attention_bias=False,
            rope_theta=theta,
            partial_rotary_factor=1.0 if use_rope else 0.0,
            intermediate_size=intermediate,
            mlp_act=act,
            mlp_bias=bias,
            mlp_gated=True,
            num_mem_blocks=num_mem_blocks,
            use_shared_attention_adapter=attn_adapters,
            adapter_rank=rank,
            add_bias_linear=bias,
            raw=raw,
        )
        cfg.validate(source)
        if intermediate <= 0:
            raise bad("intermediate_size must be positive")
        return cfg
