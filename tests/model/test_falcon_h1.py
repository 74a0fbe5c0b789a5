"""Falcon-H1 (FalconH1ForCausalLM) beyond the shared parity matrix of test_model_parity.py (whose
full-prompt logits, greedy and batched-greedy tests, and test_model_tail_rows.py's, run on the
`fh_*` configs of model_fixtures.FALCON_H1_CONFIGS): float64 logits against transformers, the
config parser (every muP multiplier, the Mamba norm options), the layer kind that has both a KV
cache and a Mamba state, `hybridserve config --explain`, and the engine (prefix hits in every
cache mode, n-gram speculation) lossless in float64.

float64 against transformers: transformers' Falcon-H1 computes its RMSNorms, the gated norm of the
mixer, the SSD scan and the rotary cos/sin in float32 even in a float64 model, so the two agree to
float32 rounding and are compared at the parity tests' 1e-4, not at float64 precision.
"""

from __future__ import annotations

import json

import pytest
import torch

import family_engine
from hybridserve.errors import ConfigError
from hybridserve.model.architectures import get_architecture
from hybridserve.model.cache_tensors import ModelCaches, kv_bytes_per_block, mamba_bytes_per_slot
from hybridserve.model.flops import prefill_cost
from hybridserve.model.loader import load_model
from hybridserve.model.model_config import HYBRID, model_capabilities
from model_fixtures import FALCON_H1_CONFIGS

torch.set_num_threads(1)

VOCAB = family_engine.VOCAB
NAMES = list(FALCON_H1_CONFIGS)
ARCH = "FalconH1ForCausalLM"


checkpoints = family_engine.checkpoints_fixture("falcon_h1", FALCON_H1_CONFIGS, seed=200)


@pytest.mark.parametrize("name", NAMES)
def test_float64_batched_logits_match_transformers(checkpoints, name: str) -> None:
    """family_engine.check_float64_logits (see the module docstring for what limits the
    tolerance)."""
    family_engine.check_float64_logits(checkpoints(name), 12)


def test_config_fields_caches_and_flops(checkpoints) -> None:
    _, d = checkpoints("fh_gqa_norm")
    lm = load_model(str(d), torch.float32)
    c = lm.config
    assert c.architecture == ARCH and c.model_type == "falcon_h1"
    assert c.layer_types == [HYBRID, HYBRID]
    assert c.mamba_layer_ids == c.attention_layer_ids == [0, 1]
    assert (c.nheads, c.headdim, c.d_inner, c.dstate, c.ngroups, c.chunk_size) == (4, 12, 48, 8, 2, 8)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (4, 2, 8, 8)
    assert c.ssm_multipliers == [0.8, 1.25, 0.7, 1.4, 0.9] and c.mlp_multipliers == [1.2, 0.75]
    assert (c.mamba_rms_norm, c.mamba_norm_before_gate, c.projectors_bias, c.mamba_proj_bias) == (
        True,
        True,
        True,
        True,
    )
    layer = lm.model.model.layers[0]
    assert layer.self_attn.scale == pytest.approx(8**-0.5 * 0.6)  # key_multiplier in the scale
    caps = c.capabilities()
    assert (caps["scan_chunk_size"], caps["num_mamba_layers"], caps["num_attention_layers"]) == (8, 2, 2)
    raw = json.loads((d / "config.json").read_text())
    assert caps == {**model_capabilities(raw, "config.json"), "torch_dtype": caps["torch_dtype"]}
    # every layer has a KV cache and a Mamba state
    caches = ModelCaches.for_model(c, torch.float32, 4, 8, 3)
    assert sorted(caches.kv) == sorted(caches.conv) == sorted(caches.ssm) == [0, 1]
    assert kv_bytes_per_block(c, 8, torch.float32) == 2 * 2 * 8 * 2 * 8 * 4
    assert mamba_bytes_per_slot(c, torch.float32) == 2 * (c.conv_dim * 3 + 4 * 12 * 8) * 4
    # prefill FLOPs: every linear layer, plus the conv and state of each mixer
    linear = sum(
        m.weight.numel()
        for n, m in lm.model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    scan = c.conv_dim * c.d_conv + 3 * c.nheads * c.headdim * c.dstate
    cost = prefill_cost(c)
    assert cost.per_token == 2 * linear + 2 * c.num_mamba_layers * scan
    assert cost.attn_per_context_token == 2 * 2 * c.num_heads * c.head_dim * 2

    _, d = checkpoints("fh_odd_nonorm")
    lm = load_model(str(d), torch.float32)
    assert (lm.config.headdim, lm.config.head_dim, lm.config.rope_theta) == (9, 6, 500.0)
    assert not hasattr(lm.model.model.layers[0].mamba, "norm")
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight

    _, d = checkpoints("fh_gate_norm_mha")
    c = load_model(str(d), torch.float32).config
    assert (c.d_inner, c.headdim, c.mamba_norm_before_gate) == (48, 16, False)


def _raw(**kw: object) -> dict:
    base: dict = {
        "model_type": "falcon_h1", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_ssm": 64,
        "mamba_d_state": 8, "intermediate_size": 16,
    }  # fmt: skip
    base.update(kw)
    return base


def test_parse_released_fields_and_errors() -> None:
    cls = get_architecture(ARCH)
    # the released configs: a top-level rope_theta, an explicit head_dim, no layer list
    c = cls.parse_config(_raw(rope_theta=1e11, head_dim=16, rope_scaling=None), "f/config.json")
    assert c.layer_types == [HYBRID, HYBRID] and (c.rope_theta, c.head_dim, c.rotary_dim) == (1e11, 16, 16)
    assert (c.headdim, c.d_inner, c.chunk_size, c.dt_min) == (16, 64, 256, 0.0)
    assert c.ssm_multipliers == [1.0] * 5 and c.mlp_multipliers == [1.0, 1.0]
    caps = model_capabilities(_raw(), "f/config.json")
    assert (caps["num_mamba_layers"], caps["num_attention_layers"], caps["scan_chunk_size"]) == (2, 2, 256)
    # mamba_d_ssm null: mamba_expand 2 x hidden_size; left out: transformers' default, 1024
    assert cls.parse_config(_raw(mamba_d_ssm=None), "f/config.json").d_inner == 64
    raw = _raw(mamba_n_heads=64)
    del raw["mamba_d_ssm"]
    assert cls.parse_config(raw, "f/config.json").d_inner == 1024
    bad = [
        (_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
        (_raw(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
        (_raw(mlp_multipliers="x"), "mlp_multipliers"),
        (_raw(mamba_n_heads=3), "f/config.json"),
        (_raw(layer_types=["mamba", "attention"]), "hybrid"),
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            cls.parse_config(raw, "f/config.json")


def test_config_explain_shows_capabilities(checkpoints) -> None:
    _, d = checkpoints("fh_gqa_norm")
    out = family_engine.explain(d)
    assert (
        "capabilities: type falcon_h1, Mamba layers 2, attention layers 2, boundary states on, "
        "scan chunk size 8, max_position_embeddings 8192"
    ) in out, out
    assert "mamba_cache_mode        all" in out


# ------------------------------------------------------------------------------------------------
# the engine, float64: caching and speculation change nothing (tests/family_engine.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """The GQA checkpoint with its LM head moved towards the embeddings (0.7 of them, 0.3 of its
    own; the embeddings alone repeat one token for ever here): accepted and rejected drafts both
    roll back the Mamba states and the KV of every layer; its reference outputs."""
    _, src = checkpoints("fh_gqa_norm")
    return family_engine.echo_model(src, tmp_path_factory.mktemp("engine") / "fh_echo", 0.7)


@family_engine.engine_matrix
def test_engine_cache_modes_and_ngram_speculation_are_lossless(
    engine_model, mode: str, spec: int | None
) -> None:
    family_engine.check_lossless(engine_model, mode, spec)
