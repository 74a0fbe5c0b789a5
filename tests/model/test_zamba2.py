"""Zamba2 (Zamba2ForCausalLM) beyond the shared parity matrix of test_model_parity.py (whose
full-prompt logits, greedy and batched-greedy tests, and test_model_tail_rows.py's, run on the
`z2_*` configs of model_fixtures.ZAMBA2_CONFIGS): float64 logits against transformers, the shared
blocks (one module per block, every use with its own adapters and KV cache), the config parser and
what it refuses, tensor-parallel sizes the shapes do not allow refused at start, `hybridserve
config --explain`, and the engine (prefix hits in every cache mode, n-gram speculation) lossless in
float64, at TP 1 and (a subset) at TP 2. The sharded logits are checked in
tests/distributed/test_tp_model.py.

float64 against transformers: transformers' Zamba2 computes its RMSNorms and the gated norm of the
mixer in float32 even in a float64 model, so the two agree to float32 rounding and are compared at
the parity tests' 1e-4, not at float64 precision.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import family_engine
from hybridserve.config.args import EngineArgs
from hybridserve.config.explain import format_resolved
from hybridserve.config.plan import plan_engine
from hybridserve.errors import ConfigError
from hybridserve.model.architectures import get_architecture
from hybridserve.model.cache_tensors import ModelCaches, kv_bytes_per_block, mamba_bytes_per_slot
from hybridserve.model.flops import prefill_cost
from hybridserve.model.loader import load_model
from hybridserve.model.model_config import HYBRID, MAMBA, ZAMBA2_DEFAULT_LAYERS, model_capabilities
from model_fixtures import ZAMBA2_CONFIGS

torch.set_num_threads(1)

VOCAB = family_engine.VOCAB
NAMES = list(ZAMBA2_CONFIGS)
ARCH = "Zamba2ForCausalLM"


checkpoints = family_engine.checkpoints_fixture("zamba2", ZAMBA2_CONFIGS, seed=300)


@pytest.mark.parametrize("name", NAMES)
def test_float64_batched_logits_match_transformers(checkpoints, name: str) -> None:
    """family_engine.check_float64_logits (see the module docstring for what limits the
    tolerance)."""
    family_engine.check_float64_logits(checkpoints(name), 10, padded_batch=True)


def _use_linears(lm, i: int) -> int:
    """Weights of the linear layers one token goes through in decoder layer `i` (a hybrid layer:
    its use's adapters only)."""
    layer = lm.model.model.layers[i]
    total = 0
    for n, m in layer.named_modules(remove_duplicate=False):
        if not isinstance(m, torch.nn.Linear):
            continue
        if "_adapter_list." in n and int(n.split("_adapter_list.")[1].split(".")[0]) != layer.use:
            continue
        total += m.weight.numel()
    return total


def test_shared_blocks_config_caches_and_flops(checkpoints) -> None:
    _, d = checkpoints("z2_two_blocks")
    lm = load_model(str(d), torch.float32)
    c = lm.config
    assert c.architecture == ARCH and c.model_type == "zamba2"
    assert c.layer_types == [MAMBA, HYBRID, MAMBA, HYBRID, HYBRID, MAMBA]
    assert c.mamba_layer_ids == [0, 1, 2, 3, 4, 5] and c.attention_layer_ids == [1, 3, 4]
    assert (c.nheads, c.headdim, c.d_inner, c.dstate, c.ngroups, c.chunk_size) == (4, 16, 64, 8, 2, 8)
    # the attention reads 2 * hidden_size channels: head size 64 / 4
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (4, 4, 16, 16)
    assert (c.num_mem_blocks, c.use_shared_attention_adapter, c.adapter_rank, c.mamba_proj_bias) == (
        2,
        True,
        4,
        True,
    )
    layers = lm.model.model.layers
    # two blocks alternating over the three uses: one module each, stored under its first use
    assert layers[1].shared_transformer is layers[4].shared_transformer
    assert layers[1].shared_transformer is not layers[3].shared_transformer
    assert [layers[i].use for i in (1, 3, 4)] == [0, 1, 2]
    assert layers[1].shared_transformer.self_attn.scale == pytest.approx((16 / 2) ** -0.5)
    names = {n for n, _ in lm.model.named_parameters()}
    assert "model.layers.4.linear.weight" in names
    assert not any(n.startswith("model.layers.4.shared_transformer.") for n in names)
    assert "model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.1.weight" in names
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    caps = c.capabilities()
    assert (caps["scan_chunk_size"], caps["num_mamba_layers"], caps["num_attention_layers"]) == (8, 6, 3)
    raw = json.loads((d / "config.json").read_text())
    assert caps == {**model_capabilities(raw, "config.json"), "torch_dtype": caps["torch_dtype"]}
    # every use of a shared block has a KV cache of its own, every layer a Mamba state
    caches = ModelCaches.for_model(c, torch.float32, 4, 8, 3)
    assert sorted(caches.kv) == [1, 3, 4] and sorted(caches.conv) == sorted(caches.ssm) == list(range(6))
    assert kv_bytes_per_block(c, 8, torch.float32) == 3 * 2 * 8 * 4 * 16 * 4
    assert mamba_bytes_per_slot(c, torch.float32) == 6 * (c.conv_dim * 3 + 4 * 16 * 8) * 4
    # prefill FLOPs: every linear a token goes through (a block once per use, its own adapters),
    # plus the conv and state of each mixer
    linear = sum(_use_linears(lm, i) for i in range(c.num_layers))
    scan = c.conv_dim * c.d_conv + 3 * c.nheads * c.headdim * c.dstate
    cost = prefill_cost(c)
    assert cost.per_token == 2 * linear + 2 * c.num_mamba_layers * scan
    assert cost.attn_per_context_token == 2 * 2 * c.num_heads * c.head_dim * 3


def test_untied_checkpoint_blocks(checkpoints, tmp_path: Path) -> None:
    """Untied embeddings: transformers 5 ties nothing and stores every use's block, which loads as
    it is; a checkpoint storing only the first use's block shares it."""
    from safetensors.torch import load_file, save_file

    _, d = checkpoints("z2_gqa_nope")
    lm = load_model(str(d), torch.float32)
    c = lm.config
    assert c.layer_types == [HYBRID, MAMBA, MAMBA, HYBRID, MAMBA] and not c.tie_word_embeddings
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.ngroups, c.d_conv) == (4, 2, 12, 0, 1, 3)
    layers = lm.model.model.layers
    a0, a3 = layers[0].shared_transformer.self_attn, layers[3].shared_transformer.self_attn
    assert not a0.adapters and not torch.equal(a0.q_proj.weight, a3.q_proj.weight)
    assert lm.model.lm_head.weight is not lm.model.model.embed_tokens.weight
    w = load_file(str(d / "model.safetensors"))
    w = {k: v for k, v in w.items() if not k.startswith("model.layers.3.shared_transformer.")}
    one = tmp_path / "one"
    one.mkdir()
    save_file(w, str(one / "model.safetensors"))
    (one / "config.json").write_text((d / "config.json").read_text())
    layers = load_model(str(one), torch.float32).model.model.layers
    for (n, p), (n3, p3) in zip(
        layers[0].shared_transformer.named_parameters(), layers[3].shared_transformer.named_parameters()
    ):
        assert n == n3 and p is p3, n


def _raw(**kw: object) -> dict:
    base: dict = {
        "model_type": "zamba2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3,
        "layers_block_type": ["mamba", "hybrid", "mamba"], "num_attention_heads": 4,
        "n_mamba_heads": 4, "mamba_d_state": 8, "intermediate_size": 16,
    }  # fmt: skip
    base.update(kw)
    return base


def test_parse_defaults_and_errors() -> None:
    cls = get_architecture(ARCH)
    c = cls.parse_config(_raw(), "z/config.json")
    assert c.layer_types == [MAMBA, HYBRID, MAMBA] and (c.head_dim, c.rotary_dim, c.chunk_size) == (
        16,
        0,
        256,
    )
    assert (c.d_inner, c.headdim, c.dt_min, c.mlp_act, c.tie_word_embeddings) == (64, 16, 0.001, "gelu", True)
    assert (c.num_mem_blocks, c.use_shared_attention_adapter, c.adapter_rank) == (1, False, 128)
    assert not c.mamba_proj_bias and c.mamba_conv_bias
    c = cls.parse_config(_raw(use_mem_rope=True, rope_parameters={"rope_theta": 500.0}), "z/config.json")
    assert (c.rotary_dim, c.rope_theta) == (16, 500.0)
    c = cls.parse_config(_raw(use_long_context=True, mamba_ngroups=2), "z/config.json")
    assert (c.max_position_embeddings, c.ngroups) == (16384, 2)
    # transformers 5's names, and the default layout when config.json has none
    c = cls.parse_config(_raw(layers_block_type=["linear_attention", "hybrid", "hybrid"]), "z/config.json")
    assert c.layer_types == [MAMBA, HYBRID, HYBRID]
    raw = _raw(num_hidden_layers=54)
    del raw["layers_block_type"]
    c = cls.parse_config(raw, "z/config.json")
    assert len(c.layer_types) == len(ZAMBA2_DEFAULT_LAYERS) == 54 and c.layer_types.count(HYBRID) == 9
    caps = model_capabilities(raw, "z/config.json")
    assert (caps["num_mamba_layers"], caps["num_attention_layers"], caps["scan_chunk_size"]) == (54, 9, 256)
    bad = [
        (_raw(use_mem_rope=True, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
        (_raw(use_shared_attention_adapter=True, num_key_value_heads=2), "use_shared_attention_adapter"),
        (_raw(use_shared_attention_adapter=True, num_attention_heads=5), "use_shared_attention_adapter"),
        (_raw(use_shared_mlp_adapter=False), "use_shared_mlp_adapter"),
        (_raw(layers_block_type=["mamba", "attention", "mamba"]), "layers_block_type"),
        (_raw(num_hidden_layers=4), "num_hidden_layers"),
        (_raw(hidden_act="swiglu"), "hidden_act"),
        (_raw(num_mem_blocks=0), "num_mem_blocks"),
        (_raw(adapter_rank=0), "adapter_rank"),
        (_raw(n_mamba_heads=3), "z/config.json"),  # 64 channels in 3 heads
        (_raw(num_attention_heads=3, num_key_value_heads=2), "z/config.json"),
        (_raw(use_mem_rope=True, hidden_size=36, num_attention_heads=8), "rotary"),  # head size 9
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            cls.parse_config(raw, "z/config.json")


def test_plan_explain_and_tensor_parallel_sizes(checkpoints) -> None:
    _, d = checkpoints("z2_two_blocks")
    plan = plan_engine(EngineArgs(model=str(d)), str(d))
    text = format_resolved(plan.resolved, explain=True)
    assert (
        "capabilities: type zamba2, Mamba layers 6, attention layers 3, boundary states on, "
        "scan chunk size 8, max_position_embeddings 4096"
    ) in text, text
    # 4 Mamba heads, 4 attention heads, an MLP of 40: 3 ranks cannot split them
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3: .*the Mamba heads \(4\)"):
        plan_engine(EngineArgs(model=str(d), tensor_parallel_size=3), str(d))


# ------------------------------------------------------------------------------------------------
# the engine, float64: caching and speculation change nothing (tests/family_engine.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """The two-block checkpoint (adapters, RoPE) untied, with an LM head of its own: 0.8 of the
    embeddings (which alone repeat one token for ever here) and 0.2 random, and the Mamba layers'
    out_proj scaled by 0.3 (the residual stream then stays near the token's embedding, so that
    the model often repeats tokens and n-gram drafts are partly accepted). The blocks stay shared
    (the checkpoint stores each block once). Accepted and rejected drafts both roll back the Mamba
    states and the KV of every use of the shared blocks; its reference outputs."""
    from safetensors.torch import load_file, save_file

    _, src = checkpoints("z2_two_blocks")
    root = tmp_path_factory.mktemp("engine")
    untied = root / "z2_untied"
    untied.mkdir()
    w = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    w["lm_head.weight"] = torch.randn(w["model.embed_tokens.weight"].shape, generator=gen) * 0.5
    for k in w:
        if k.endswith("mamba.out_proj.weight"):
            w[k] = w[k] * 0.3
    save_file(w, str(untied / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    return family_engine.echo_model(untied, root / "z2_echo", 0.8)


@family_engine.engine_matrix
def test_engine_cache_modes_and_ngram_speculation_are_lossless(
    engine_model, mode: str, spec: int | None
) -> None:
    family_engine.check_lossless(engine_model, mode, spec)


@family_engine.tensor_parallel_subset
def test_engine_at_tensor_parallel_2_gives_the_tp1_outputs(engine_model, mode: str, spec: int | None) -> None:
    """One spawned gloo worker: the TP 1 reference outputs, prefix hits and n-gram speculation
    included (the shared blocks' attention, MLP and adapters split over the ranks)."""
    family_engine.check_lossless(engine_model, mode, spec, tensor_parallel_size=2)
