"""The built-in demo checkpoint: offline, deterministic, loadable by transformers."""

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

from hybridserve.model import demo

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.write_demo_model(tmp_path_factory.mktemp("demo"))


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


def test_same_seed_same_bytes(tmp_path: Path, demo_dir: Path):
    again = demo.write_demo_model(tmp_path / "again")
    for name in FILES:
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name
    other = demo.write_demo_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (demo_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (demo_dir / "tokenizer.json").read_bytes()


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


def test_weights_are_not_degenerate(demo_dir: Path):
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        a_log = f.get_tensor("backbone.layers.0.mixer.A_log")
        dt_bias = f.get_tensor("backbone.layers.0.mixer.dt_bias")
        d = f.get_tensor("backbone.layers.0.mixer.D")
        norm = f.get_tensor("backbone.norm_f.weight")
        w = f.get_tensor("backbone.layers.2.mixer.in_proj.weight")
    assert torch.all((a_log >= 0.0) & (a_log <= torch.log(torch.tensor(16.0)) + 1e-6))
    dt = torch.nn.functional.softplus(dt_bias)
    assert torch.all((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7))
    assert torch.equal(d, torch.ones_like(d)) and torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < w.std().item() < 0.025


def test_loads_and_generates_in_transformers(demo_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    tok = AutoTokenizer.from_pretrained(demo_dir)
    ids = tok("The history of the city", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        logits = model(ids).logits[0, -1]
    assert out.shape == (1, ids.shape[1] + 6)
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    assert int(out[0, ids.shape[1]]) == int(logits.argmax())
    # Not degenerate: a real spread of next-token probabilities.
    p = logits.softmax(-1)
    assert 0.01 < p.max().item() < 0.9


def test_greedy_continues_repeated_patterns(demo_dir: Path):
    # The planted induction head: like a real LM, the model continues a repeated motif (this is
    # what makes n-gram speculation get accepted drafts), and does not loop on novel text.
    import random

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    hits = 0
    for s in range(6):
        rng = random.Random(s)
        motif = [rng.randrange(3, 780) for _ in range(rng.randrange(3, 12))]
        prompt = motif * 4
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        got = out[0, len(prompt) :].tolist()
        hits += sum(g == motif[i % len(motif)] for i, g in enumerate(got))
    assert hits >= 0.9 * 36
    rng = random.Random(100)
    prompt = [rng.randrange(3, 780) for _ in range(60)]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert len(set(out[0, len(prompt) :].tolist())) >= 8


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


def test_ensure_demo_model_caches_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_dir: Path):
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path / "cache"))
    path = Path(demo.ensure_demo_model())
    assert path.parent == tmp_path / "cache" and path.name.startswith("demo-")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo.ensure_demo_model() == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temp dirs left
    assert (path / "model.safetensors").read_bytes() == (demo_dir / "model.safetensors").read_bytes()
    assert demo.resolve_model_path("demo") == str(path)
    assert demo.resolve_model_path("/some/dir") == "/some/dir"


def test_cli_writes_model_and_module_has_no_torch(tmp_path: Path, demo_dir: Path):
    from hybridserve.cli import main

    assert main(["demo-model", str(tmp_path / "cli")]) == 0
    for name in FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (demo_dir / name).read_bytes()
    code = "import sys, hybridserve.model.demo; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
