"""benches/wide_demo.py: the demo model with wider layers, which the server benchmarks serve as a
model whose compute outweighs a request's fixed cost. Its checkpoint must be the demo's layer
pattern and tokenizer with only the widths changed, and hybridserve must run it as transformers
does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridserve.model import demo

ROOT = Path(__file__).resolve().parents[2]
WIDENED = (
    "hidden_size",
    "mamba_num_heads",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wide")
    subprocess.run(
        [sys.executable, str(ROOT / "benches/wide_demo.py"), str(out), "--factor", "2", "--seed", "3"],
        check=True,
        capture_output=True,
    )
    return out


def test_config_is_the_demo_widened(wide_dir: Path):
    base_dir = Path(demo.ensure_demo_model())
    base = json.loads((base_dir / "config.json").read_text())
    wide = json.loads((wide_dir / "config.json").read_text())
    for key in WIDENED:
        assert wide[key] == 2 * base[key], key
    for key in (
        "layers_block_type",
        "head_dim",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "vocab_size",
    ):
        assert wide[key] == base[key], key
    assert wide["mamba_num_heads"] * wide["mamba_head_dim"] == wide["expand"] * wide["hidden_size"]
    assert (wide_dir / "tokenizer.json").read_bytes() == (base_dir / "tokenizer.json").read_bytes()


def test_rejects_a_factor_below_one(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benches/wide_demo.py"), str(tmp_path / "m"), "--factor", "0"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--factor must be at least 1" in r.stderr
    assert not (tmp_path / "m").exists()


def test_hybridserve_generates_what_transformers_does(wide_dir: Path):
    from transformers import AutoModelForCausalLM

    from hybridserve import LLM, SamplingParams

    prompt = [5, 77, 300, 12, 5, 77, 300, 12, 9, 41, 600]
    ref = AutoModelForCausalLM.from_pretrained(wide_dir, dtype=torch.float64)
    with torch.no_grad():
        seq = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = seq[0, len(prompt) :].tolist()
    llm = LLM(str(wide_dir), dtype="float64")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
