"""Transformers parity at TP 2: the sharded model on 2 gloo ranks (one spawned group for the whole
module) against Hugging Face transformers on the tiny random checkpoints of
tests/model/test_model_parity.py (the same configs and seeds): float64 logits of every position of
a 29-token prompt (no chunk size divides it) within the TP 1 parity test's 1e-4 relative of
transformers' float32 logits, and the 32 greedy tokens of one request equal to transformers'
`generate`, on every rank (each of which summed its layers' outputs over the ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_harness import parity_outputs, run_ranks

from model_fixtures import ALL_CONFIGS, build_hf_model, hf_greedy, random_prompts, save_hf_model

TP = 2
VOCAB = 256
NAMES = list(ALL_CONFIGS)  # the seeds of test_model_parity.py: a checkpoint's index here
# every Nemotron-H, Bamba and Mamba2 checkpoint of the parity tests (n_groups 1 and 2, MoE, GQA)
PARITY = ["nh_g2_moe", "nh_g1", "bamba_g1", "bamba_g2", "m2_g2"]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """name -> (transformers' logits, transformers' greedy tokens, every rank's (logits, tokens))."""
    root = tmp_path_factory.mktemp("tp_parity")
    prompt = random_prompts(1, VOCAB, [29], seed=7)[0]
    greedy_prompt = random_prompts(1, VOCAB, [21], seed=11)[0]
    refs, cases = {}, []
    for name in PARITY:
        kind, ov = ALL_CONFIGS[name]
        hf = build_hf_model(kind, ov, vocab_size=VOCAB, seed=NAMES.index(name))
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        refs[name] = (logits, hf_greedy(hf, greedy_prompt, GREEDY_TOKENS))
        d = save_hf_model(hf, root / name)
        cases.append((str(d), prompt, greedy_prompt, GREEDY_TOKENS))
    per_rank = run_ranks(parity_outputs, TP, (cases,), Path(root))
    return {n: (*refs[n], [r[i] for r in per_rank]) for i, n in enumerate(PARITY)}


@pytest.mark.parametrize("name", PARITY)
def test_tp2_logits_and_greedy_tokens_match_transformers(outputs: dict[str, tuple], name: str) -> None:
    ref_logits, ref_tokens, ranks = outputs[name]
    assert len(ranks) == TP
    for rank, (logits, tokens, sums) in enumerate(ranks):
        assert sums > 0, rank  # the model was sharded: its layers summed over the ranks
        assert logits.dtype == torch.float64 and logits.shape == ref_logits.shape
        rel = float((logits.float() - ref_logits).abs().max() / ref_logits.abs().max())
        assert rel < 1e-4, (rank, rel)
        assert tokens == ref_tokens, rank
