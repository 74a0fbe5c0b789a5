"""The built-in demo checkpoint: offline, deterministic, loadable by transformers, trained on its corpus.

The full checkpoint (about half a minute of training) is the cached one every other test uses
(`ensure_demo_model`); the determinism and file checks build short-trained copies (a few steps run
the same code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hybridserve.model import demo

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


QUICK_STEPS = 2  # training steps of the short-trained copies


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return Path(demo.ensure_demo_model())


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.write_demo_model(tmp_path_factory.mktemp("quick"), steps=QUICK_STEPS)


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_corpus_is_package_data():
    text = resources.files("hybridserve.model").joinpath("demo_corpus.txt").read_text(encoding="utf-8")
    assert 4000 < len(text.encode()) < 20000


def test_files_and_config(demo_dir: Path):
    for name in FILES:
        assert (demo_dir / name).is_file(), name
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h"
    assert cfg["architectures"] == ["NemotronHForCausalLM"]
    pattern = cfg["hybrid_override_pattern"]
    assert set(pattern) == {"M", "*", "-"}
    mapping = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    assert cfg["layers_block_type"] == [mapping[c] for c in pattern]
    assert 256 % cfg["chunk_size"] == 0
    tok = json.loads((demo_dir / "tokenizer.json").read_text())
    assert cfg["vocab_size"] == len(tok["model"]["vocab"])
    assert 512 <= cfg["vocab_size"] <= 1024
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert cfg["eos_token_id"] == special["<|im_end|>"]
    assert cfg["bos_token_id"] == special["<|endoftext|>"]
    shapes = _shapes(demo_dir / "model.safetensors")
    n_params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 100_000 < n_params < 4_000_000


def test_same_seed_same_bytes(tmp_path: Path, quick_dir: Path, demo_dir: Path):
    # The caller's thread count does not matter (training runs in one thread) and is restored.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        again = demo.write_demo_model(tmp_path / "again", steps=QUICK_STEPS)
        assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(threads)
    for name in FILES:
        assert (again / name).read_bytes() == (quick_dir / name).read_bytes(), name
    other = demo.write_demo_model(tmp_path / "other", seed=1, steps=QUICK_STEPS)
    assert (other / "model.safetensors").read_bytes() != (quick_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (quick_dir / "tokenizer.json").read_bytes()
    # Only the weights depend on the training.
    for name in FILES:
        if name != "model.safetensors":
            assert (quick_dir / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_tokenizer_training_is_deterministic_across_processes(demo_dir: Path):
    # A fresh interpreter has a different hash seed; the trained tokenizer must not change.
    code = "from hybridserve.model.demo import build_tokenizer_json; import sys; sys.stdout.write(build_tokenizer_json())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout
    assert out == (demo_dir / "tokenizer.json").read_bytes()


def test_state_dict_matches_transformers(tmp_path: Path, demo_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(demo_dir)
    assert config.layers_block_type == json.loads((demo_dir / "config.json").read_text())["layers_block_type"]
    assert list(config.time_step_limit) == [0.0, float("inf")]
    ref = AutoModelForCausalLM.from_config(config)
    ref.save_pretrained(tmp_path / "ref")
    assert _shapes(tmp_path / "ref" / "model.safetensors") == _shapes(demo_dir / "model.safetensors")


def test_weights_are_trained_and_sane(demo_dir: Path, quick_dir: Path):
    trained = load_file(str(demo_dir / "model.safetensors"))
    init = demo.init_weights(
        trained["lm_head.weight"].shape[0], torch.Generator().manual_seed(demo.DEFAULT_SEED)
    )
    quick = load_file(str(quick_dir / "model.safetensors"))
    assert sorted(trained) == sorted(init)
    for name, w in trained.items():
        assert w.dtype == torch.float32 and w.shape == init[name].shape and torch.isfinite(w).all(), name
        assert not torch.equal(w, init[name]), name  # every tensor took part in training
        assert not torch.equal(w, quick[name]), name  # and more steps moved it further
    for i, kind in enumerate(demo.LAYER_PATTERN):
        if kind != "M":
            continue
        p = f"backbone.layers.{i}.mixer."
        # dt stays far above time_step_min (the prefill clamp never fires) and A stays positive
        dt = torch.nn.functional.softplus(trained[p + "dt_bias"])
        assert dt.min().item() > 1e-4 and dt.max().item() < 1.0
        assert trained[p + "A_log"].min().item() > 0.0
    w = trained["backbone.layers.2.mixer.in_proj.weight"]
    assert 0.015 < w.std().item() < 0.1


def test_loads_and_recites_its_corpus_in_transformers(demo_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    tok = AutoTokenizer.from_pretrained(demo_dir)
    # The engine's tests (tests/engine/test_llm_api.py) check more corpus lines, faster.
    prompt, expected = "The history of the city", " goes back more than two thousand years."
    ids = tok(prompt, return_tensors="pt").input_ids
    want = tok(prompt + expected).input_ids[ids.shape[1] :]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=len(want), do_sample=False)
        logits = model(ids).logits[0, -1]
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    assert tok.decode(out[0, ids.shape[1] :]) == expected
    assert int(out[0, ids.shape[1]]) == int(logits.argmax())
    # Teacher-forced over the whole corpus (read from its start), the argmax is the next token.
    token_ids, _ = demo.corpus_tokens((demo_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        pred = model(ids).logits[0, :-1].argmax(-1)
    assert (pred == ids[0, 1:]).float().mean().item() > 0.98


def test_prefill_and_decode_agree_in_float64(demo_dir: Path):
    # time_step_min ~ 0 keeps transformers' prefill dt clamp from firing: logits of a full forward
    # equal those of token-by-token decoding up to transformers' internal fp32 casts.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float64)
    ids = torch.tensor([[5, 77, 300, 12, 5, 77, 300, 12, 9, 41, 600, 2]])
    with torch.no_grad():
        gen = model.generate(
            ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        decode = torch.stack(gen.logits, 1)[0].double()
        full = model(gen.sequences).logits[0, ids.shape[1] - 1 : -1].double()
    assert (decode - full).abs().max().item() < 1e-4


def test_tokenizer_round_trip_and_chat_template(demo_dir: Path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(demo_dir)
    texts = ["Hello, world!", "The cake is 35 minutes — très bien. 日本語", "  two  spaces\nand a newline\t"]
    for text in texts:
        ids = raw.encode(text).ids
        assert raw.decode(ids) == text
        assert auto.decode(auto(text).input_ids) == text
    assert raw.encode("<|im_start|>user").ids[0] == raw.token_to_id("<|im_start|>")
    assert auto.eos_token == "<|im_end|>"
    chat = auto.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_ensure_demo_model_caches_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quick_dir: Path
):
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "TRAIN_STEPS", QUICK_STEPS)  # part of the cache key, like every setting
    path = Path(demo.ensure_demo_model())
    assert path.parent == tmp_path / "cache" and path.name.startswith("demo-")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo.ensure_demo_model() == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temp dirs left
    assert (path / "model.safetensors").read_bytes() == (quick_dir / "model.safetensors").read_bytes()
    assert demo.resolve_model_path("demo") == str(path)
    assert demo.resolve_model_path("/some/dir") == "/some/dir"
    monkeypatch.setattr(demo, "TRAIN_STEPS", QUICK_STEPS + 1)
    assert demo.demo_model_dir() != path  # another recipe, another folder


def test_cli_writes_model_and_module_has_no_torch(tmp_path: Path, quick_dir: Path):
    from hybridserve.cli import main

    assert main(["demo-model", str(tmp_path / "cli"), "--steps", str(QUICK_STEPS)]) == 0
    for name in FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (quick_dir / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == sorted(demo.CHECKPOINT_FILES)
    # a folder that holds a checkpoint already (maybe another model) is not written over unasked
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "someone-elses"}')
    assert main(["demo-model", str(other), "--steps", str(QUICK_STEPS)]) == 2
    assert (other / "config.json").read_text() == '{"model_type": "someone-elses"}'
    assert not (other / "model.safetensors").exists()
    shards = tmp_path / "shards"  # another model's weights under other names count too
    shards.mkdir()
    (shards / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert main(["demo-model", str(shards), "--steps", str(QUICK_STEPS)]) == 2
    assert not (shards / "config.json").exists()
    assert main(["demo-model", str(other), "--steps", str(QUICK_STEPS), "--force"]) == 0
    assert (other / "config.json").read_bytes() == (quick_dir / "config.json").read_bytes()
    code = "import sys, hybridserve.model.demo; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
