"""Model runner vs transformers on tiny random checkpoints, and self-consistency in float64.

dt limits: NemotronH clamps dt by `time_step_limit`, (0, inf), not by `time_step_min` (which only
initialises dt_bias): a checkpoint whose dt falls below time_step_min matches transformers.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from hybridserve.errors import ConfigError
from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache_tensors import (
    ModelCaches,
    kv_bytes_per_block,
    mamba_bytes_per_slot,
)
from hybridserve.model.loader import load_model
from hybridserve.model.model_config import decode_tagged_floats
from model_fixtures import ALL_CONFIGS, Driver, build_hf_model, hf_greedy, random_prompts, save_hf_model

torch.set_num_threads(1)  # 2 threads on 2 shared, busy cores is several times slower

VOCAB = 256
NAMES = list(ALL_CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (hf model, checkpoint dir); built lazily, once per module."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            kind, ov = ALL_CONFIGS[name]
            hf = build_hf_model(kind, ov, vocab_size=VOCAB, seed=NAMES.index(name))
            d = save_hf_model(hf, tmp_path_factory.mktemp(name))
            cache[name] = (hf, d)
        return cache[name]

    return get


def _full_prompt_batch(prompt: list[int], block_size: int = 8) -> ForwardBatch:
    T = len(prompt)
    nb = (T + block_size - 1) // block_size
    blocks = list(range(1, nb + 1))
    i64 = torch.int64
    return ForwardBatch(
        input_ids=torch.tensor(prompt),
        positions=torch.arange(T),
        query_start_loc=torch.tensor([0, T]),
        num_computed_tokens=torch.tensor([0]),
        seq_lens=torch.tensor([T]),
        num_decodes=0,
        slot_mapping=torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(T)]),
        block_table=torch.tensor([blocks]),
        state_read_slot=torch.tensor([0]),
        has_initial_state=torch.tensor([False]),
        state_write_slots=torch.tensor([[1]]),
        emit_row=torch.zeros(0, dtype=i64),
        emit_token=torch.zeros(0, dtype=i64),
        emit_slot=torch.zeros(0, dtype=i64),
        logits_indices=torch.arange(T),
    )


@pytest.mark.parametrize("name", NAMES)
def test_full_prompt_logits_match_transformers(checkpoints, name):
    hf, d = checkpoints(name)
    lm = load_model(str(d), torch.float32)
    prompt = random_prompts(1, VOCAB, [29], seed=7)[0]  # 29: no chunk size divides it
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    caches = ModelCaches.for_model(lm.config, lm.dtype, 8, 8, 4)
    ours = lm.model(_full_prompt_batch(prompt), caches)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, float(rel)


def test_nemotron_h_dt_below_time_step_min_is_not_clamped(tmp_path):
    """Every released Nemotron-H config says time_step_min 0.001 and time_step_limit [0, inf]: a
    head whose dt falls below 0.001 is computed with its own dt, as transformers computes it."""
    from model_fixtures import NEMOTRON_H_CONFIGS

    hf = build_hf_model("nemotron_h", NEMOTRON_H_CONFIGS["nh_g1"], vocab_size=VOCAB, seed=3)
    assert hf.config.time_step_min == pytest.approx(0.001)
    small = torch.tensor([1e-4, 3e-4, 5e-4, 0.02, 0.05, 0.1], dtype=torch.float64)
    for m in hf.modules():
        if hasattr(m, "dt_bias"):
            dt = small.repeat(m.dt_bias.numel() // len(small) + 1)[: m.dt_bias.numel()]
            with torch.no_grad():
                m.dt_bias.copy_(torch.log(torch.expm1(dt)))  # softplus(dt_bias) = dt
    d = save_hf_model(hf, tmp_path / "nh")
    lm = load_model(str(d), torch.float32)
    prompt = random_prompts(1, VOCAB, [29], seed=7)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    caches = ModelCaches.for_model(lm.config, lm.dtype, 8, 8, 4)
    ours = lm.model(_full_prompt_batch(prompt), caches)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, float(rel)


def _mamba_dt_limit(c: dict) -> None:  # NemotronHConfig's legacy names, which win over the current
    c["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    c["mamba_dt_limit"] = [0.03, 0.06]
    c["mamba_n_groups"], c["n_groups"] = c["n_groups"], c["n_groups"] + 1  # (a wrong shape if read)


def _rope_scaling_over_rope_parameters(c: dict) -> None:  # the legacy key replaces the new one
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    c["rope_scaling"] = {"rope_type": "default", "rope_theta": 40.0}


@pytest.mark.parametrize(
    "kind, configs, edit",
    [
        ("nemotron_h", "NEMOTRON_H_CONFIGS", _mamba_dt_limit),
        ("bamba", "BAMBA_CONFIGS", _rope_scaling_over_rope_parameters),
    ],
)
def test_config_keys_are_read_as_transformers_reads_them(tmp_path, kind, configs, edit):
    """config.json keys of older checkpoints that transformers still maps onto the current ones
    (and lets win over them): the engine computes what transformers computes from the same file."""
    import transformers

    import model_fixtures

    overrides = next(iter(getattr(model_fixtures, configs).values()))
    d = save_hf_model(build_hf_model(kind, overrides, vocab_size=VOCAB, seed=5), tmp_path / kind)
    raw = json.loads((d / "config.json").read_text())
    edit(raw)
    (d / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    lm = load_model(str(d), torch.float32)
    prompt = random_prompts(1, VOCAB, [29], seed=7)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = lm.model(_full_prompt_batch(prompt), ModelCaches.for_model(lm.config, lm.dtype, 8, 8, 4))
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, float(rel)


def test_a_legacy_scaled_rotary_embedding_is_refused(tmp_path):
    """A Bamba config.json of transformers 4.x with `rope_scaling` (linear): transformers scales
    the rotary embedding; the engine, which has only the default one, refuses the model rather
    than running it unscaled."""
    from model_fixtures import BAMBA_CONFIGS

    overrides = next(iter(BAMBA_CONFIGS.values()))
    d = save_hf_model(build_hf_model("bamba", overrides, vocab_size=VOCAB, seed=5), tmp_path / "b")
    raw = json.loads((d / "config.json").read_text())
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported rope_type 'linear'"):
        load_model(str(d), torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_one_request_matches_transformers(checkpoints, name):
    hf, d = checkpoints(name)
    lm = load_model(str(d), torch.float32)
    prompt = random_prompts(1, VOCAB, [21], seed=11)[0]
    ours, _ = Driver(lm, max_seq=64, max_reqs=1).generate([prompt], 32)
    assert ours[0] == hf_greedy(hf, prompt, 32)


EIGHT_LENGTHS = [5, 21, 1, 13, 30, 9, 17, 3]
# staggered arrivals mix prefill and decode rows in one forward; three prompts arrive in chunks
EIGHT_CHUNKS = [None, [8, 13], None, [3, 10], [16, 7, 7], None, None, None]
EIGHT_ARRIVALS = [0, 0, 1, 2, 2, 5, 0, 3]


def _generate_eight(lm):
    prompts = random_prompts(8, VOCAB, EIGHT_LENGTHS, seed=13)
    drv = Driver(lm, max_seq=64, max_reqs=8)
    ours, _ = drv.generate(prompts, 32, chunks=EIGHT_CHUNKS, arrivals=EIGHT_ARRIVALS)
    return prompts, ours


@pytest.mark.parametrize("name", NAMES)
def test_greedy_eight_requests_batched_matches_transformers(checkpoints, name):
    """8 requests batched (mixed prefill/decode rows, chunked prefills) vs transformers: every
    generated token is transformers' argmax given the preceding tokens (one right-padded batched
    forward over prompt + output; for greedy decoding this is the same condition as identity with
    `generate`, which the test below and the one-request test check directly)."""
    hf, d = checkpoints(name)
    lm = load_model(str(d), torch.float32)
    prompts, ours = _generate_eight(lm)
    seqs = [p + o for p, o in zip(prompts, ours)]
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs])
    with torch.no_grad():
        ref = hf(ids).logits.argmax(-1)
    for i, (p, o) in enumerate(zip(prompts, ours)):
        assert len(o) == 32
        assert ref[i, len(p) - 1 : len(p) - 1 + 32].tolist() == o, i


def test_greedy_eight_requests_batched_matches_transformers_generate(checkpoints):
    hf, d = checkpoints("nh_g2_moe")
    lm = load_model(str(d), torch.float32)
    prompts, ours = _generate_eight(lm)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 32)


@pytest.mark.parametrize(
    "name",
    [
        "nh_g2_moe",
        "nh_g1",
        "bamba_g2",
        "m2_g2",
        "gr_moe_rope",
        "gr_dense_odd",
        "fh_gqa_norm",
        "z2_two_blocks",
        "jb_odd_top1",
    ],
)
def test_float64_chunked_prefill_and_decode_equal_one_shot(checkpoints, name):
    _, d = checkpoints(name)
    lm = load_model(str(d), torch.float64)
    prompt = random_prompts(1, VOCAB, [37], seed=17)[0]
    # one-shot prefill, logits at every position
    caches = ModelCaches.for_model(lm.config, lm.dtype, 8, 8, 4)
    full = lm.model(_full_prompt_batch(prompt), caches)
    assert full.dtype == torch.float64
    drv = Driver(lm, max_seq=64, max_reqs=2, window=4)
    # chunked prefill (3 chunks, not chunk-aligned) then teacher-forced verify-like decode rows of
    # 1..3 tokens through the state window
    n0 = 20
    req = drv._new_req(0, prompt[:n0], 0, [7, 4, 9], 0)
    for c in req.chunks:
        lg = drv.step([(req, req.tokens[req.num_computed : req.num_computed + c], False)])
    torch.testing.assert_close(lg[0], full[n0 - 1], rtol=1e-10, atol=1e-10)
    p = n0
    for n in [1, 3, 2, 1, 3, 2, 3, 2]:
        toks = prompt[p : p + n]
        req.prompt_len = 0  # every later row is a decode row
        lg = drv.step([(req, toks, True)])
        torch.testing.assert_close(lg, full[p : p + n], rtol=1e-10, atol=1e-10)
        p += n
    assert p == len(prompt)


@pytest.mark.parametrize("name", ["nh_g2_moe", "bamba_g1", "gr_dense_odd", "fh_odd_nonorm", "z2_gqa_nope"])
def test_prefill_emits_boundary_states(checkpoints, name):
    """The state emitted at an absolute chunk boundary inside a prefill equals the state of a
    prefill that stops exactly there (conv and ssm, every Mamba layer), float64."""
    _, d = checkpoints(name)
    lm = load_model(str(d), torch.float64)
    Q = lm.config.chunk_size
    prompt = random_prompts(1, VOCAB, [3 * Q + 5], seed=19)[0]
    drv = Driver(lm, max_seq=64, max_reqs=2, window=2)
    a = drv._new_req(0, prompt, 0, None, 0)
    # run first 3 tokens, then the rest with emits at absolute positions Q and 3Q
    drv.step([(a, prompt[:3], False)])
    emit_slots = [drv.caches.num_slots - 1, drv.caches.num_slots - 2]
    drv.step(
        [(a, prompt[3:], False)], emits=[(0, Q - 3 - 1, emit_slots[0]), (0, 3 * Q - 3 - 1, emit_slots[1])]
    )
    for boundary, slot in zip([Q, 3 * Q], emit_slots):
        ref = Driver(lm, max_seq=64, max_reqs=1, window=2)
        b = ref._new_req(0, prompt[:boundary], 0, None, 0)
        ref.step([(b, prompt[:boundary], False)])
        for i in lm.config.mamba_layer_ids:
            torch.testing.assert_close(
                drv.caches.ssm[i][slot], ref.caches.ssm[i][b.window[0]], rtol=1e-10, atol=1e-12
            )
            torch.testing.assert_close(
                drv.caches.conv[i][slot], ref.caches.conv[i][b.window[0]], rtol=1e-12, atol=1e-12
            )


def test_bfloat16_runs_and_is_close(checkpoints):
    _, d = checkpoints("nh_g2_moe")
    lm32 = load_model(str(d), torch.float32)
    lm16 = load_model(str(d), "bfloat16")
    assert lm16.model.backbone.layers[0].mixer.A_log.dtype == torch.float32
    assert lm16.model.backbone.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    prompt = random_prompts(1, VOCAB, [19], seed=3)[0]
    c32 = ModelCaches.for_model(lm32.config, lm32.dtype, 8, 8, 4)
    c16 = ModelCaches.for_model(lm16.config, lm16.dtype, 8, 8, 4)
    assert c16.ssm[0].dtype == torch.float32 and c16.kv[1].dtype == torch.bfloat16
    a = lm32.model(_full_prompt_batch(prompt), c32)
    b = lm16.model(_full_prompt_batch(prompt), c16)
    assert b.dtype == torch.float32
    assert ((a - b).abs().max() / a.abs().max()) < 0.1


# ------------------------------------------------------------------------------------------------
# loader
# ------------------------------------------------------------------------------------------------


def _copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loader_config_fields(checkpoints):
    _, d = checkpoints("nh_g2_moe")
    lm = load_model(str(d), torch.float32)
    c = lm.config
    assert c.architecture == "NemotronHForCausalLM"
    assert c.layer_types == ["mamba", "attention", "mlp", "moe"]
    assert (c.nheads, c.headdim, c.dstate, c.ngroups, c.d_conv, c.chunk_size) == (4, 12, 8, 2, 4, 8)
    assert c.conv_dim == 4 * 12 + 2 * 2 * 8
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 8)
    assert c.has_mamba_layers and c.supports_boundary_states
    assert c.dt_min == 0.0 and c.dt_max == math.inf
    caps = c.capabilities()
    assert caps["scan_chunk_size"] == 8 and caps["num_attention_layers"] == 1
    assert lm.tokenizer is None and lm.model_dir == str(d)
    raw = json.loads((d / "config.json").read_text())
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}  # the trap is really exercised
    assert decode_tagged_floats(raw)["time_step_limit"][1] == math.inf


def test_loader_legacy_pattern_and_sharded_index(checkpoints, tmp_path):
    hf, d = checkpoints("nh_g1")
    dst = _copy_ckpt(d, tmp_path / "legacy")
    raw = json.loads((dst / "config.json").read_text())
    del raw["layers_block_type"]
    raw["hybrid_override_pattern"] = "M-M*"
    raw["mamba_n_groups"] = raw.pop("n_groups")
    raw["mamba_d_conv"] = raw.pop("conv_kernel")
    raw["mamba_chunk_size"] = raw.pop("chunk_size")
    (dst / "config.json").write_text(json.dumps(raw))
    # split the weights into two shards with an index
    from safetensors.torch import load_file, save_file

    w = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    keys = sorted(w)
    half = len(keys) // 2
    save_file({k: w[k] for k in keys[:half]}, str(dst / "model-00001-of-00002.safetensors"))
    save_file({k: w[k] for k in keys[half:]}, str(dst / "model-00002-of-00002.safetensors"))
    wm = {
        k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
        for i, k in enumerate(keys)
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    a = load_model(str(d), torch.float32)
    b = load_model(str(dst), torch.float32)
    assert b.config.layer_types == a.config.layer_types
    assert (b.config.ngroups, b.config.d_conv, b.config.chunk_size) == (1, 3, 16)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loader_errors(checkpoints, tmp_path):
    _, d = checkpoints("nh_g1")
    from safetensors.torch import load_file, save_file

    # a size no layer can be built with, which the family's own reading lets through
    _, b = checkpoints("bamba_g1")
    neg = _copy_ckpt(b, tmp_path / "negative")
    raw = json.loads((neg / "config.json").read_text())
    raw["intermediate_size"] = -1
    (neg / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="config.json: the model cannot be built"):
        load_model(str(neg))

    # unknown architecture
    u = _copy_ckpt(d, tmp_path / "unknown")
    raw = json.loads((u / "config.json").read_text())
    raw["architectures"] = ["FancyForCausalLM"]
    (u / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="FancyForCausalLM"):
        load_model(str(u))
    # missing tensor
    m = _copy_ckpt(d, tmp_path / "missing")
    w = load_file(str(m / "model.safetensors"))
    del w["backbone.layers.0.mixer.dt_bias"]
    save_file(w, str(m / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"backbone\.layers\.0\.mixer\.dt_bias"):
        load_model(str(m))
    # wrong shape
    s = _copy_ckpt(d, tmp_path / "shape")
    w = load_file(str(s / "model.safetensors"))
    w["backbone.layers.1.mixer.up_proj.weight"] = torch.zeros(3, 3)
    save_file(w, str(s / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.safetensors.*up_proj\.weight.*shape"):
        load_model(str(s))
    # unsupported stored dtype
    t = _copy_ckpt(d, tmp_path / "dtype")
    w = load_file(str(t / "model.safetensors"))
    w["backbone.norm_f.weight"] = torch.ones(w["backbone.norm_f.weight"].shape, dtype=torch.int32)
    save_file(w, str(t / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"norm_f\.weight.*dtype"):
        load_model(str(t))
    # unsupported requested dtype, no config
    with pytest.raises(ConfigError, match="dtype"):
        load_model(str(d), "int8")
    with pytest.raises(ConfigError, match="config.json"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "name, field, value, match",
    [
        ("nh_g1", "hidden_size", 48.5, "hidden_size must be an integer, got 48.5"),
        ("nh_g1", "mamba_num_heads", True, "mamba_num_heads must be an integer, got True"),
        ("nh_g1", "n_groups", "1", "n_groups must be an integer"),
        ("nh_g1", "eos_token_id", [2, 2.5], "eos_token_id must be an integer"),
        ("bamba_g1", "attn_layer_indices", [1.5], "attn_layer_indices must be an integer"),
        ("bamba_g1", "num_attention_heads", 0, "a size that another is derived from is 0"),
        ("m2_g2", "expand", 1.3, r"expand \* hidden_size must be an integer, got 46\.8"),
        ("m2_g2", "head_dim", 0, "a size that another is derived from is 0"),
        ("m2_g2", "layer_norm_epsilon", "1e-5", "layer_norm_epsilon must be a number"),
        ("bamba_g1", "mamba_expand", True, "mamba_expand must be a number, got True"),
        ("bamba_g1", "mamba_expand", 10**400, "a size is out of range"),
        # (each loaded, and every request then ended with NaN logits, or failed at build naming no file)
        ("nh_g1", "layer_norm_epsilon", -1.0, "the norm epsilon must be a finite number >= 0, got -1.0"),
        ("m2_g2", "layer_norm_epsilon", {"__float__": "NaN"}, "the norm epsilon must be a finite number"),
        ("nh_g1", "mlp_hidden_act", "gelu_fast", "unsupported MLP activation 'gelu_fast' .hidden_act"),
    ],
)
def test_config_sizes_that_are_not_integers_are_errors(checkpoints, tmp_path, name, field, value, match):
    # a size of 48.5 was silently truncated to 48 before
    _, d = checkpoints(name)
    c = _copy_ckpt(d, tmp_path / "c")
    raw = json.loads((c / "config.json").read_text())
    raw[field] = value
    if field == "head_dim":
        raw.pop("num_heads", None)  # derived from head_dim
    (c / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match):
        load_model(str(c))


def test_config_sizes_written_as_whole_floats_are_accepted(checkpoints, tmp_path):
    _, d = checkpoints("nh_g1")
    c = _copy_ckpt(d, tmp_path / "c")
    raw = json.loads((c / "config.json").read_text())
    raw["hidden_size"] = float(raw["hidden_size"])
    (c / "config.json").write_text(json.dumps(raw))
    assert load_model(str(c)).config.hidden_size == int(raw["hidden_size"])


def test_every_mlp_activation_the_config_takes_is_built() -> None:
    """(ModelConfig.validate refuses the others up front, naming config.json)"""
    from hybridserve.model.layers.mlp import activation
    from hybridserve.model.model_config import MLP_ACTIVATIONS

    for name in MLP_ACTIVATIONS:
        assert activation(name)(torch.ones(2)).shape == (2,), name
    with pytest.raises(ConfigError):
        activation("gelu_fast")


def test_a_negative_token_id_names_no_token(checkpoints, tmp_path):
    """(LLaMA's configs write `pad_token_id: -1` for none; an EOS of -1 kept made every request
    fail for its out-of-range stop token)"""
    _, d = checkpoints("nh_g1")
    c = _copy_ckpt(d, tmp_path / "c")
    raw = json.loads((c / "config.json").read_text())
    (c / "config.json").write_text(json.dumps({**raw, "eos_token_id": [-1, 2], "pad_token_id": -1}))
    cfg = load_model(str(c)).config
    assert (cfg.eos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (2, [2], None)


def test_a_layer_count_that_disagrees_with_the_checkpoint_is_said(checkpoints, tmp_path, caplog):
    """num_hidden_layers against the layer list beside it is an error (a stack of one of the two
    sizes leaves layers unread or missing: transformers' Granite indexes the list by it); against
    NemotronH's pattern (or list) the pattern's layers are built, said (as transformers and vLLM
    build them); a checkpoint whose tensors the model does not read (a layer past the stack)
    loads with a warning naming them, not a debug line."""
    _, d = checkpoints("gr_dense_odd")
    c = _copy_ckpt(d, tmp_path / "gr")
    raw = json.loads((c / "config.json").read_text())
    n = len(raw["layer_types"])
    (c / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": n - 1}))
    with pytest.raises(ConfigError, match=f"num_hidden_layers is {n - 1} but layer_types lists {n} layers"):
        load_model(str(c))
    _, d = checkpoints("nh_g1")
    c = _copy_ckpt(d, tmp_path / "nh")
    raw = json.loads((c / "config.json").read_text())
    raw.pop("layers_block_type")
    stale = {**raw, "hybrid_override_pattern": "M-M", "num_hidden_layers": 4}
    (c / "config.json").write_text(json.dumps(stale))
    with caplog.at_level("WARNING", logger="hybridserve"):
        assert load_model(str(c)).config.num_layers == 3
    assert "num_hidden_layers is 4 but hybrid_override_pattern lists 3 layers" in caplog.text
    assert "tensors are not used by the model config.json describes (e.g. backbone.layers.3." in caplog.text
    caplog.clear()
    whole = {**raw, "hybrid_override_pattern": "M-M*", "num_hidden_layers": 4.0}
    (c / "config.json").write_text(json.dumps(whole))
    assert load_model(str(c)).config.num_layers == 4  # (a whole float, as every size)

    _, d = checkpoints("m2_g2")
    c = _copy_ckpt(d, tmp_path / "m2")
    raw = json.loads((c / "config.json").read_text())
    assert raw["num_hidden_layers"] == 2
    (c / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1}))
    with caplog.at_level("WARNING", logger="hybridserve"):
        load_model(str(c))
    assert "tensors are not used by the model config.json describes (e.g. backbone.layers.1." in caplog.text


def test_loader_errors_of_shards_side_files_and_sizes(checkpoints, tmp_path):
    _, d = checkpoints("nh_g1")
    from safetensors.torch import load_file, save_file

    def sharded(name: str) -> tuple[Path, dict]:
        dst = _copy_ckpt(d, tmp_path / name)
        w = load_file(str(dst / "model.safetensors"))
        (dst / "model.safetensors").unlink()
        keys = sorted(w)
        save_file({k: w[k] for k in keys[:5]}, str(dst / "a.safetensors"))
        save_file({k: w[k] for k in keys[5:]}, str(dst / "b.safetensors"))
        wm = {k: ("a.safetensors" if i < 5 else "b.safetensors") for i, k in enumerate(keys)}
        return dst, wm

    def index(dst: Path, wm: object) -> None:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))

    # the index names a tensor its shard does not hold
    dst, wm = sharded("absent")
    moved = sorted(wm)[0]
    wm[moved] = "b.safetensors"
    index(dst, wm)
    with pytest.raises(ConfigError, match=r"b\.safetensors.*cannot read tensor"):
        load_model(str(dst))
    # a truncated shard behind an index
    dst, wm = sharded("corrupt")
    index(dst, wm)
    raw = (dst / "b.safetensors").read_bytes()
    (dst / "b.safetensors").write_bytes(raw[:40])
    with pytest.raises(ConfigError, match=r"b\.safetensors"):
        load_model(str(dst))
    # weight_map of the wrong type
    dst, wm = sharded("wm_list")
    index(dst, list(wm))
    with pytest.raises(ConfigError, match="weight_map must be an object"):
        load_model(str(dst))
    # a shard outside the model folder
    dst, wm = sharded("outside")
    wm[sorted(wm)[0]] = "../absent/a.safetensors"
    index(dst, wm)
    with pytest.raises(ConfigError, match="outside the model folder"):
        load_model(str(dst))
    # generation_config.json with a token id that is not one
    g = _copy_ckpt(d, tmp_path / "genconf")
    (g / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match=r"generation_config\.json.*eos_token_id"):
        load_model(str(g))
    # a true/false field given as a string is not truthy
    b = _copy_ckpt(d, tmp_path / "boolstr")
    raw_cfg = json.loads((b / "config.json").read_text())
    raw_cfg["tie_word_embeddings"] = "false"
    (b / "config.json").write_text(json.dumps(raw_cfg))
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false"):
        load_model(str(b))
    # sizes whose weights cannot be allocated
    h = _copy_ckpt(d, tmp_path / "huge")
    raw_cfg = json.loads((h / "config.json").read_text())
    raw_cfg["intermediate_size"] = 10**12
    (h / "config.json").write_text(json.dumps(raw_cfg))
    with pytest.raises(ConfigError, match="do not fit"):
        load_model(str(h))


def test_a_corrupt_tokenizer_config_is_a_config_error(tmp_path):
    from hybridserve.engine.tokenizer import Tokenizer as HSTokenizer
    from hybridserve.model.demo import ensure_demo_model

    dst = tmp_path / "tok"
    shutil.copytree(ensure_demo_model(), dst)
    (dst / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json"):
        HSTokenizer(dst)


def _tiny_mamba2(out: Path, *, tie_word_embeddings: bool):  # type: ignore[no-untyped-def]
    """A one-layer Mamba2 of transformers, saved into `out`."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, state_size=8,
        n_groups=1, chunk_size=8, tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    hf.save_pretrained(str(out))
    return hf


def test_loader_tied_embeddings_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = _tiny_mamba2(tmp_path, tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    lm = load_model(str(tmp_path), torch.float32)
    assert lm.model.lm_head.weight is lm.model.backbone.embeddings.weight
    assert lm.tokenizer.encode("a b").ids == [0, 1]
    prompt = [5, 9, 100, 3, 17]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = lm.model(_full_prompt_batch(prompt), ModelCaches.for_model(lm.config, lm.dtype, 2, 8, 4))
    assert ((ours - ref).abs().max() / ref.abs().max()) < 1e-4
    # state-spaces naming of the embedding (`backbone.embedding.weight`) loads too
    from safetensors.torch import load_file, save_file

    w = load_file(str(tmp_path / "model.safetensors"))
    w["backbone.embedding.weight"] = w.pop("backbone.embeddings.weight")
    save_file(w, str(tmp_path / "model.safetensors"))
    old = load_model(str(tmp_path), torch.float32)
    assert torch.equal(old.model.backbone.embeddings.weight, lm.model.backbone.embeddings.weight)


def test_a_head_stored_under_a_tying_config_is_used_where_it_differs(tmp_path, caplog):
    """config.json ties the embeddings but the checkpoint stores a head of its own (a fine-tune
    saved untied, the config left tying): transformers keeps the stored head; so does the loader,
    saying so, and it ties a stored head that holds the embeddings' numbers."""
    import transformers
    from safetensors.torch import load_file, save_file

    _tiny_mamba2(tmp_path, tie_word_embeddings=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompt = [5, 9, 100, 3, 17]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    with caplog.at_level("WARNING", logger="hybridserve"):
        lm = load_model(str(tmp_path), torch.float32)
    assert lm.model.lm_head.weight is not lm.model.backbone.embeddings.weight
    assert "the stored tensor is used" in caplog.text
    ours = lm.model(_full_prompt_batch(prompt), ModelCaches.for_model(lm.config, lm.dtype, 2, 8, 4))
    assert ((ours - ref).abs().max() / ref.abs().max()) < 1e-4
    # a stored head equal to the embeddings is tied (one tensor), without a word
    w = load_file(str(tmp_path / "model.safetensors"))
    w["lm_head.weight"] = w["backbone.embeddings.weight"].clone()
    save_file(w, str(tmp_path / "model.safetensors"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybridserve"):
        same = load_model(str(tmp_path), torch.float32)
    assert same.model.lm_head.weight is same.model.backbone.embeddings.weight
    assert "the stored tensor is used" not in caplog.text


# ------------------------------------------------------------------------------------------------
# ModelCaches
# ------------------------------------------------------------------------------------------------


def test_model_caches_shapes_sizing_and_copies(checkpoints):
    _, d = checkpoints("nh_g2_moe")
    cfg = load_model(str(d), torch.float32).config
    c = ModelCaches.for_model(cfg, torch.float64, num_blocks=5, block_size=4, num_slots=6)
    assert set(c.kv) == {1} and set(c.ssm) == {0} == set(c.conv)
    assert c.kv[1].shape == (5, 2, 4, 2, 8) and c.kv[1].dtype == torch.float64
    assert c.conv[0].shape == (6, cfg.conv_dim, 3) and c.ssm[0].shape == (6, 4, 12, 8)
    assert c.ssm[0].dtype == torch.float64
    per_block = kv_bytes_per_block(cfg, 16, torch.float32)
    assert per_block == 1 * 2 * 16 * 2 * 8 * 4
    per_slot = mamba_bytes_per_slot(cfg, torch.float32)
    assert per_slot == (cfg.conv_dim * 3 + 4 * 12 * 8) * 4
    # state copies: in order, all Mamba tensors
    c.ssm[0].normal_()
    c.conv[0].normal_()
    s1, v1 = c.ssm[0][1].clone(), c.conv[0][1].clone()
    c.apply_state_copies(torch.tensor([[1, 2], [2, 3]]))
    assert torch.equal(c.ssm[0][3], s1) and torch.equal(c.conv[0][3], v1) and torch.equal(c.ssm[0][2], s1)
    with pytest.raises(ValueError):
        c.apply_state_copies([[1, 6]])
    # KV block copies (a tail hit): whole blocks, every attention layer; block 0 is the null block
    c.kv[1].normal_()
    b1 = c.kv[1][1].clone()
    c.apply_kv_copies([[1, 4]])
    assert torch.equal(c.kv[1][4], b1) and not torch.equal(c.kv[1][3], b1)
    for bad in ([[0, 2]], [[1, 0]], [[1, 5]]):
        with pytest.raises(ValueError, match="KV block copy"):
            c.apply_kv_copies(bad)
    c.apply_kv_copies([])


def test_parse_legacy_bamba_and_mamba2_fields():
    from hybridserve.model.architectures import get_architecture, supported_architectures

    assert {"NemotronHForCausalLM", "BambaForCausalLM", "Mamba2ForCausalLM"} <= set(supported_architectures())
    bamba = {
        "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3, "attn_layer_indices": [2],
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "mamba_n_heads": 4,
        "mamba_d_head": "auto", "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_chunk_size": 16,
        "rope_theta": 5000.0, "time_step_limit": [0.001, {"__float__": "Infinity"}], "eos_token_id": [7, 9],
    }  # fmt: skip
    c = get_architecture("BambaForCausalLM").parse_config(decode_tagged_floats(bamba), "bamba/config.json")
    assert c.layer_types == ["mamba", "mamba", "attention"]
    assert (c.headdim, c.d_inner, c.rope_theta, c.partial_rotary_factor, c.rotary_dim) == (
        16,
        64,
        5000.0,
        0.5,
        4,
    )
    assert (c.dt_min, c.dt_max) == (0.001, math.inf)
    assert c.eos_token_id == 7 and c.eos_token_ids == [7, 9]
    m2 = {"vocab_size": 100, "d_model": 32, "n_layer": 2, "head_dim": 16, "expand": 2, "state_size": 8}
    c = get_architecture("Mamba2ForCausalLM").parse_config(m2, "m2/config.json")
    assert (c.nheads, c.headdim, c.num_layers, c.num_attention_layers) == (4, 16, 2, 0)
    bad = dict(bamba, mamba_n_heads=3)
    with pytest.raises(ConfigError, match="bamba/config.json"):
        get_architecture("BambaForCausalLM").parse_config(bad, "bamba/config.json")
    with pytest.raises(ConfigError, match="unknown layer"):
        get_architecture("NemotronHForCausalLM").parse_config(
            {"hidden_size": 8, "vocab_size": 10, "layers_block_type": ["mamba", "conv"]}, "nh/config.json"
        )
