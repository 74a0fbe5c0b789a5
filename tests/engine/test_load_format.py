"""`--load-format dummy` and `--tokenizer DIR` (vLLM's flags): a model folder holding only its
config.json is served with seeded random weights and the tokenizer of another folder. The
weights are the same on every load and on every tensor-parallel rank; the tokenizer, its special
tokens and its chat template come from the folder `--tokenizer` names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.errors import ConfigError
from hybridserve.model.demo import ensure_demo_model
from hybridserve.model.loader import load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model's config.json alone: no weights, no tokenizer."""
    d = tmp_path_factory.mktemp("config_only")
    shutil.copy(Path(ensure_demo_model()) / "config.json", d / "config.json")
    return str(d)


def test_a_config_alone_serves_with_dummy_weights(config_only: str) -> None:
    demo = ensure_demo_model()
    llm = LLM(config_only, load_format="dummy", tokenizer=demo, dtype="float32", cpu_threads=1)
    weights = list(llm.engine.em.model.parameters())
    assert max(float(p.abs().max()) for p in weights) <= 1.001e-3  # (1e-3 in float32)
    assert min(float(p.abs().max()) for p in weights) > 0  # (every tensor drawn, none left empty)
    first = [o.outputs[0].token_ids for o in llm.generate(["Hello", "Once upon a time"], GREEDY)]
    assert all(len(t) == 6 for t in first)
    # the same weights, so the same tokens, on another load
    again = LLM(config_only, load_format="dummy", tokenizer=demo, dtype="float32", cpu_threads=1)
    assert [o.outputs[0].token_ids for o in again.generate(["Hello", "Once upon a time"], GREEDY)] == first
    # the tokenizer's folder gives the chat template too
    assert llm.engine.chat_template.source == LLM("demo", cpu_threads=1).engine.chat_template.source
    assert llm.chat([{"role": "user", "content": "Hi"}], GREEDY)[0].outputs[0].token_ids


def test_every_load_draws_the_same_weights(config_only: str) -> None:
    """What tensor parallelism relies on: each rank draws the full weights and cuts its shard
    from them, so every load must draw the same numbers, in any dtype (bfloat16 rounds them)."""
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (load_model(config_only, dtype=dtype, load_format="dummy") for _ in range(2))
        pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
        assert pa.keys() == pb.keys()
        assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_without_dummy_or_a_tokenizer_it_says_what_is_missing(config_only: str) -> None:
    with pytest.raises(ConfigError, match="no \\*.safetensors files"):
        LLM(config_only, tokenizer=ensure_demo_model(), cpu_threads=1)
    with pytest.raises(ConfigError, match="tokenizer.json: missing .*needs --tokenizer DIR"):
        LLM(config_only, load_format="dummy", cpu_threads=1)
    with pytest.raises(ConfigError, match="^--tokenizer nowhere: .*tokenizer.json: missing"):
        LLM("demo", tokenizer="nowhere", cpu_threads=1)
    with pytest.raises(ConfigError, match="--load-format must be one of"):
        LLM("demo", load_format="pt")


def test_serve_exits_2_when_a_flag_names_what_is_not_there(tmp_path: Path) -> None:
    """The model loads after the server listens; a ConfigError found there (a --tokenizer folder
    without tokenizer.json) is still the user's error: exit 2, as `generate` exits, not 1."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "python"))
    argv = [sys.executable, "-m", "hybridserve", "serve", "demo", "--port", "0", "--tokenizer", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--tokenizer {tmp_path}" in done.stderr and "Traceback" not in done.stderr
