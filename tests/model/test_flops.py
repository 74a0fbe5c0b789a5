"""The prefill FLOP model (model/flops.py) that the prefix cache's eviction score uses."""

from __future__ import annotations

import pytest
import torch

from hybridserve.benchmarks.cache_replay import NEMOTRON_H_8B, nemotron_h_8b
from hybridserve.config import resolve_model_dir
from hybridserve.model.flops import PrefillCost, prefill_cost
from hybridserve.model.loader import load_model


def test_per_token_flops_count_every_weight_a_token_meets() -> None:
    loaded = load_model(resolve_model_dir("demo"), dtype=torch.float32, device="cpu")
    cfg = loaded.config
    linear = sum(
        m.weight.numel()
        for name, m in loaded.model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    )
    # each weight of every projection and MLP once (a multiply-add is 2 FLOPs), plus the conv and
    # the state update of each Mamba layer
    scan = cfg.conv_dim * cfg.d_conv + 3 * cfg.nheads * cfg.headdim * cfg.dstate
    cost = prefill_cost(cfg)
    assert cost.per_token == 2 * linear + 2 * cfg.num_mamba_layers * scan
    # QK^T and PV over each earlier token, in every attention layer
    assert cost.attn_per_context_token == 4 * cfg.num_heads * cfg.head_dim * cfg.num_attention_layers


def test_prefill_flops_add_up_and_grow_with_the_context() -> None:
    c = PrefillCost(per_token=10.0, attn_per_context_token=2.0)
    assert c.flops(5, 5) == 0.0 and c.flops(7, 3) == 0.0
    assert c.flops(0, 100) == pytest.approx(c.flops(0, 37) + c.flops(37, 100))
    # the same number of tokens costs more deeper in the context
    assert c.flops(1000, 1010) > c.flops(0, 10)
    assert c.flops(3, 4) == 10.0 + 2.0 * 3


def test_nemotron_h_8b_shape_is_an_8b_hybrid() -> None:
    shape = nemotron_h_8b()
    # about 7B weights outside the embeddings and the LM head: ~14 GFLOPs per prefilled token
    assert 13e9 < shape.prefill.per_token < 16e9
    # a state slot (24 Mamba layers, float32) holds as many bytes as thousands of tokens of KV
    tokens_per_state = shape.state_bytes / (shape.kv_bytes_per_block / 16)
    assert 3000 < tokens_per_state < 10000
    assert NEMOTRON_H_8B["hybrid_override_pattern"].count("*") == 4
    # vLLM pads an attention page to one Mamba layer's state (conv in bf16, SSM in fp32: 4.26 MB),
    # 4 KiB of K and V per token and layer: blocks of 16 * ceil(4255744 / 65536) tokens
    assert shape.vllm_block_size == 1040
