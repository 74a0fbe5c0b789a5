"""Granite-4.0-H (GraniteMoeHybridForCausalLM) beyond the shared parity matrix of
test_model_parity.py (whose full-prompt logits, greedy and batched-greedy tests, and
test_model_tail_rows.py's, run on the `gr_*` configs of model_fixtures.GRANITE_CONFIGS): float64
logits against transformers, batched greedy equal to transformers' `generate`, the config parser,
`hybridserve config --explain`, and the engine (prefix hits in every cache mode, n-gram
speculation) lossless in float64.

float64 against transformers: transformers' Granite computes its RMSNorms, the gated norm of the
Mamba mixer, the SSD scan, the rotary cos/sin and the router softmax in float32 even in a float64
model, so the two agree to float32 rounding (max |diff| / max |logit| about 3e-7 here) and are
compared at the parity tests' 1e-4, not at float64 precision; float64 self-consistency is held to
1e-10 below and in test_model_parity.py.
"""

from __future__ import annotations

import json

import pytest
import torch

import family_engine
from hybridserve.errors import ConfigError
from hybridserve.model.architectures import get_architecture
from hybridserve.model.loader import load_model
from hybridserve.model.model_config import model_capabilities
from model_fixtures import GRANITE_CONFIGS, Driver, hf_greedy, random_prompts

torch.set_num_threads(1)

VOCAB = family_engine.VOCAB
NAMES = list(GRANITE_CONFIGS)
ARCH = "GraniteMoeHybridForCausalLM"


checkpoints = family_engine.checkpoints_fixture("granitemoehybrid", GRANITE_CONFIGS, seed=100)


@pytest.mark.parametrize("name", NAMES)
def test_float64_batched_logits_match_transformers(checkpoints, name: str) -> None:
    """family_engine.check_float64_logits (see the module docstring for what limits the
    tolerance)."""
    family_engine.check_float64_logits(checkpoints(name), 12)


@pytest.mark.parametrize("name", ["gr_moe_rope", "gr_dense_odd"])
def test_greedy_batched_matches_transformers_generate(checkpoints, name: str) -> None:
    hf, d = checkpoints(name)
    lm = load_model(str(d), torch.float32)
    lengths = family_engine.LENGTHS
    prompts = random_prompts(len(lengths), VOCAB, lengths, seed=37)
    ours, _ = Driver(lm, max_seq=64, max_reqs=len(prompts)).generate(
        prompts, 16, chunks=family_engine.CHUNKS, arrivals=family_engine.ARRIVALS
    )
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 16)


def test_config_fields_and_variants(checkpoints) -> None:
    _, d = checkpoints("gr_moe_rope")
    c = load_model(str(d), torch.float32).config
    assert c.architecture == ARCH and c.model_type == "granitemoehybrid"
    assert c.layer_types == ["mamba", "attention", "mamba"]
    assert (c.nheads, c.headdim, c.dstate, c.ngroups, c.d_conv, c.chunk_size) == (4, 16, 8, 2, 4, 8)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (4, 2, 8, 8)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size) == (
        4,
        2,
        16,
        24,
    )
    caps = c.capabilities()
    assert (caps["scan_chunk_size"], caps["num_mamba_layers"], caps["num_attention_layers"]) == (8, 2, 1)
    raw = json.loads((d / "config.json").read_text())
    assert caps == {**model_capabilities(raw, "config.json"), "torch_dtype": caps["torch_dtype"]}

    _, d = checkpoints("gr_dense_odd")
    lm = load_model(str(d), torch.float32)
    assert (lm.config.head_dim, lm.config.headdim, lm.config.rotary_dim) == (9, 9, 0)
    assert all(layer.block_sparse_moe is None for layer in lm.model.model.layers)
    assert lm.model.model.layers[0].self_attn.scale == 0.25  # attention_multiplier, not 9 ** -0.5

    _, d = checkpoints("gr_top1_noshared")
    lm = load_model(str(d), torch.float32)
    assert all(layer.shared_mlp is None for layer in lm.model.model.layers)
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert lm.config.rope_theta == 500.0


def _raw(**kw: object) -> dict:
    base: dict = {
        "model_type": "granitemoehybrid", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "layers_block_type": ["mamba", "attention"], "num_attention_heads": 4, "mamba_n_heads": 4,
        "mamba_d_state": 8, "mamba_chunk_size": 64, "intermediate_size": 16, "shared_intermediate_size": 8,
        "num_local_experts": 2, "num_experts_per_tok": 1, "position_embedding_type": "nope",
    }  # fmt: skip
    base.update(kw)
    return base


def test_parse_legacy_fields_and_errors() -> None:
    cls = get_architecture(ARCH)
    # transformers 4.x naming: `layers_block_type` with "mamba" / "attention", rope_theta on top
    c = cls.parse_config(_raw(rope_theta=1e6), "g/config.json")
    assert c.layer_types == ["mamba", "attention"] and c.rotary_dim == 0 and c.chunk_size == 64
    assert (c.headdim, c.d_inner, c.dt_min) == (16, 64, 0.0)
    c = cls.parse_config(_raw(position_embedding_type="rope", rope_theta=1e6), "g/config.json")
    assert (c.rotary_dim, c.rope_theta) == (8, 1e6)
    # no layer list: every layer is Mamba (transformers' default)
    raw = _raw()
    del raw["layers_block_type"]
    assert cls.parse_config(raw, "g/config.json").layer_types == ["mamba", "mamba"]
    caps = model_capabilities(_raw(), "g/config.json")
    assert (caps["num_mamba_layers"], caps["num_attention_layers"], caps["scan_chunk_size"]) == (1, 1, 64)
    bad = [
        (_raw(position_embedding_type="alibi"), "position_embedding_type"),
        (_raw(position_embedding_type="rope", rope_parameters={"rope_type": "yarn"}), "rope_type"),
        (_raw(num_experts_per_tok=3), "expert counts"),
        (_raw(num_local_experts=0, shared_intermediate_size=0), "no feed-forward"),
        (_raw(logits_scaling=0), "logits_scaling"),
        (_raw(mamba_n_heads=3), "g/config.json"),
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            cls.parse_config(raw, "g/config.json")


def test_config_explain_shows_capabilities(checkpoints) -> None:
    _, d = checkpoints("gr_moe_rope")
    out = family_engine.explain(d)
    assert (
        "capabilities: type granitemoehybrid, Mamba layers 2, attention layers 1, boundary states on, "
        "scan chunk size 8, max_position_embeddings 2048"
    ) in out, out
    assert "mamba_cache_mode        all" in out
    assert "scan_chunk_size         8" in out


# ------------------------------------------------------------------------------------------------
# the engine, float64: caching and speculation change nothing (tests/family_engine.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """The MoE + RoPE checkpoint with its LM head set to the embeddings (n-gram drafts are partly
    accepted: accepted and rejected drafts both roll back the Mamba states), its reference outputs."""
    _, src = checkpoints("gr_moe_rope")
    return family_engine.echo_model(src, tmp_path_factory.mktemp("engine") / "gr_echo", 1.0)


@family_engine.engine_matrix
def test_engine_cache_modes_and_ngram_speculation_are_lossless(
    engine_model, mode: str, spec: int | None
) -> None:
    family_engine.check_lossless(engine_model, mode, spec)


def test_bfloat16_runs_and_is_close(checkpoints) -> None:
    _, d = checkpoints("gr_moe_rope")
    prompt = random_prompts(1, VOCAB, [19], seed=3)[0]

    def logits(dtype: torch.dtype | str) -> torch.Tensor:
        lm = load_model(str(d), dtype)
        drv = Driver(lm, max_seq=32, max_reqs=1)
        req = drv._new_req(0, prompt, 0, None, 0)
        return drv.step([(req, prompt, False)], all_logits=True)

    lm16 = load_model(str(d), "bfloat16")
    layer = lm16.model.model.layers[0]
    assert layer.mamba.A_log.dtype == torch.float32
    assert layer.block_sparse_moe.input_linear.weight.dtype == torch.bfloat16
    a, b = logits(torch.float32), logits("bfloat16")
    assert b.dtype == torch.float32
    assert ((a - b).abs().max() / a.abs().max()) < 0.1


@pytest.mark.parametrize("name", ["gr_moe_rope", "gr_dense_odd"])
def test_prefill_flops_count_the_experts_a_token_meets(checkpoints, name: str) -> None:
    from hybridserve.model.flops import prefill_cost

    _, d = checkpoints(name)
    lm = load_model(str(d), torch.float32)
    cfg = lm.config
    linear = sum(
        m.weight.numel()
        for n, m in lm.model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    for layer in lm.model.model.layers:
        moe = layer.block_sparse_moe
        if moe is not None:  # each token meets top_k of the experts
            per_expert = (
                moe.input_linear.weight.numel() + moe.output_linear.weight.numel()
            ) // cfg.n_routed_experts
            linear += cfg.num_experts_per_tok * per_expert
    scan = cfg.conv_dim * cfg.d_conv + 3 * cfg.nheads * cfg.headdim * cfg.dstate
    assert prefill_cost(cfg).per_token == 2 * linear + 2 * cfg.num_mamba_layers * scan
