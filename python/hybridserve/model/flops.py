"""Prefill FLOPs of a model, from its shapes: what a prefix-cache hit saves.

The eviction score of the prefix cache weighs each Mamba checkpoint by the prefill compute it
saves per byte it holds (`rust/cache.rs`). Prefilling positions [a, b) costs

    (b - a) * per_token + attn_per_context_token * sum(a .. b - 1)

where `per_token` counts every matrix product a token goes through (projections, MLPs and MoE
experts it is routed to, the Mamba conv and state update) and `attn_per_context_token` the
attention score and value products per token of context before it. A multiply-add counts as two
FLOPs. The LM head is left out: a prefill computes logits for its last token only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.model.model_config import ATTENTION, HYBRID, MAMBA, MLP, MOE, ModelConfig


@dataclass(frozen=True)
class PrefillCost:
    per_token: float
    attn_per_context_token: float

    def flops(self, start: int, end: int) -> float:
        """FLOPs to prefill positions [start, end)."""
        if end <= start:
            return 0.0
        n = end - start
        return n * self.per_token + self.attn_per_context_token * n * (start + end - 1) / 2


def _mlp(cfg: ModelConfig, hidden: int, inner: int) -> int:
    return (3 if cfg.mlp_gated else 2) * hidden * inner


def _zamba2_shared_block(cfg: ModelConfig) -> int:
    """MACs per token of one use of a Zamba2 shared block: attention over 2 * hidden_size channels,
    the gated MLP, this use's adapters and its projection back into the backbone."""
    h, w, inter = cfg.hidden_size, 2 * cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    rank = int(getattr(cfg, "adapter_rank", 0))
    macs = w * (q + 2 * kv) + q * h + _mlp(cfg, h, inter) + h * h
    macs += rank * (h + 2 * inter)  # the MLP's gate_up adapter
    if getattr(cfg, "use_shared_attention_adapter", False):
        macs += 3 * rank * 2 * w  # q, k, v adapters
    return macs


def _mamba1(cfg: ModelConfig) -> int:
    """MACs per token of a Mamba1 mixer (Jamba's): in_proj (x | z), x_proj (dt | B | C), dt_proj,
    out_proj, the conv and the per-channel state."""
    rank = int(getattr(cfg, "dt_rank", 0))
    d, n = cfg.d_inner, cfg.dstate
    return (
        cfg.hidden_size * 2 * d
        + d * (rank + 2 * n)
        + rank * d
        + d * cfg.hidden_size
        + d * cfg.d_conv
        + 3 * d * n
    )


def prefill_cost(cfg: ModelConfig) -> PrefillCost:
    h = cfg.hidden_size
    mamba = (
        h * (2 * cfg.d_inner + 2 * cfg.ngroups * cfg.dstate + cfg.nheads)  # in_proj
        + cfg.d_inner * h  # out_proj
        + cfg.conv_dim * cfg.d_conv  # causal conv
        + 3 * cfg.nheads * cfg.headdim * cfg.dstate  # decay, input and output of the state
    )
    if cfg.mamba_version == 1:
        mamba = _mamba1(cfg)
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h
    moe = 0
    if cfg.n_routed_experts:
        moe = (
            h * cfg.n_routed_experts  # router
            + cfg.num_experts_per_tok * (3 if cfg.mlp_gated else 2) * h * cfg.moe_intermediate_size
            + 2 * h * cfg.moe_shared_expert_intermediate_size
        )
    kinds = cfg.layer_types
    # Bamba-style layers carry their feed-forward inside every mixer layer (Granite's: a shared MLP
    # and the routed experts); NemotronH lists it as layers of its own.
    ffn_in_every_layer = MLP not in kinds and MOE not in kinds
    if cfg.architecture == "Zamba2ForCausalLM":  # hybrid: a shared block's use, then Mamba
        attention = _zamba2_shared_block(cfg)
        ffn_in_every_layer = False
    # Jamba: an MoE in the layers it lists, a gated MLP in the others
    moe_layers: list[bool] | None = getattr(cfg, "moe_layers", None)
    if moe_layers is not None:
        ffn_in_every_layer = False
    macs = 0
    for i, kind in enumerate(kinds):
        if moe_layers is not None:
            macs += moe if moe_layers[i] else _mlp(cfg, h, cfg.intermediate_size)
        if kind == MAMBA:
            macs += mamba
        elif kind == ATTENTION:
            macs += attention
        elif kind == MLP:
            macs += _mlp(cfg, h, cfg.intermediate_size)
        elif kind == MOE:
            macs += moe
        elif kind == HYBRID:  # Falcon-H1: both mixers on the same input; Zamba2: one after the other
            macs += mamba + attention
        if ffn_in_every_layer and kind in (MAMBA, ATTENTION, HYBRID):
            macs += _mlp(cfg, h, cfg.intermediate_size) + moe
    # QK^T and PV: two products of head_dim per query head and key
    attn_ctx = 2 * cfg.num_heads * cfg.head_dim * cfg.num_attention_layers
    return PrefillCost(per_token=2.0 * macs, attn_per_context_token=2.0 * attn_ctx)
