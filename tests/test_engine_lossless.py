"""Losslessness of the engine (DESIGN.md §9): greedy outputs of the float64 demo model are identical
whatever the cache mode, prefix hits, chunk budget, batch composition, preemption and speculative
decoding. Any difference is a bug, not rounding."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams

MAX_TOKENS = 20
BLOCK = 16
MAMBA_BLOCK = 64


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 780) for _ in range(150)]
    motif = [rng.randrange(3, 780) for _ in range(7)]
    prompts = [
        shared + [rng.randrange(3, 780) for _ in range(21)],  # share a 150-token prefix
        shared + [rng.randrange(3, 780) for _ in range(40)],
        [rng.randrange(3, 780) for _ in range(97)],
        (motif * 12)[:80],  # repetitive: n-gram lookup finds drafts
        [rng.randrange(3, 780) for _ in range(5)],
        shared[:131],
    ]
    return prompts


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [o.outputs[0].token_ids for o in outs]


def _llm(**kw: object) -> LLM:
    base: dict[str, object] = dict(
        dtype="float64", block_size=BLOCK, max_model_len=512, max_num_seqs=8, seed=0
    )
    base.update(kw)
    return LLM("demo", **base)


# 30 blocks of 16 tokens cannot hold six sequences of ~200 tokens: requests get preempted.
PREEMPTING: dict[str, object] = dict(max_num_batched_tokens=128, num_kv_blocks=30, max_model_len=256)


def mode_args(mode: str) -> dict[str, object]:
    """Engine arguments of a cache mode ("none": prefix caching off)."""
    return dict(
        mamba_cache_mode=mode,
        enable_prefix_caching=mode != "none",
        mamba_block_size=MAMBA_BLOCK if mode != "none" else None,
    )


@cache
def reference() -> tuple[tuple[int, ...], ...]:
    """One request at a time, no prefix caching, whole prompts in one step."""
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=1024, max_num_seqs=1)
    return tuple(tuple(t) for t in _run(llm, _prompts()))


def _assert_same(got: list[list[int]]) -> None:
    ref = reference()
    for i, (g, r) in enumerate(zip(got, ref)):
        assert tuple(g) == r, f"prompt {i}: {g} != {r}"
    assert len(got) == len(ref)


def test_reference_generates_full_length() -> None:
    ref = reference()
    assert all(len(r) == MAX_TOKENS for r in ref)
    assert len({r for r in ref}) > 1  # the prompts lead to different outputs


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("budget", [64, 128, 1024])
def test_cache_modes_and_chunking_are_lossless(mode: str, budget: int) -> None:
    llm = _llm(
        enable_prefix_caching=True,
        mamba_cache_mode=mode,
        mamba_block_size=MAMBA_BLOCK if mode != "none" else None,
        max_num_batched_tokens=budget,
    )
    prompts = _prompts()
    _assert_same(_run(llm, prompts))
    # Second pass: prefix hits (align/all) must not change anything.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    _assert_same([o.outputs[0].token_ids for o in outs])
    cached = [o.num_cached_tokens for o in outs]
    if mode == "none":
        assert cached == [0] * len(prompts)
    else:
        # Every prompt of >= 65 tokens has a checkpoint at 64 from the first pass.
        for p, c in zip(prompts, cached):
            if len(p) > MAMBA_BLOCK:
                assert c > 0 and c % MAMBA_BLOCK == 0 and c <= len(p) - 1, (len(p), c)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_shared_prefix_hit_within_one_batch_run(mode: str) -> None:
    llm = _llm(mamba_cache_mode=mode, mamba_block_size=MAMBA_BLOCK, max_num_batched_tokens=256)
    prompts = _prompts()
    first = llm.generate({"prompt_token_ids": prompts[0]}, PARAMS)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate({"prompt_token_ids": prompts[1]}, PARAMS)[0]
    # prompts 0 and 1 share 150 tokens: a hit at 128 (two checkpoints of 64).
    assert second.num_cached_tokens == 128
    assert tuple(second.outputs[0].token_ids) == reference()[1]


@pytest.mark.parametrize("mode", ["none", "align", "all"])
def test_preemption_is_lossless(mode: str) -> None:
    llm = _llm(**mode_args(mode), **PREEMPTING)
    _assert_same(_run(llm, _prompts()))
    assert llm.engine.stats()["num_preemptions_total"] > 0


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_speculation_is_lossless(mode: str, k: int) -> None:
    llm = _llm(
        **mode_args(mode),
        max_num_batched_tokens=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
    )
    prompts = _prompts()
    _assert_same(_run(llm, prompts))
    _assert_same(_run(llm, prompts))  # again, with prefix hits
    stats = llm.engine.stats()
    assert stats["spec_decode_draft_tokens"] > 0  # drafts were verified (and, here, rejected)


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_speculation_is_lossless(mode: str, k: int) -> None:
    llm = _llm(
        **mode_args(mode),
        max_num_batched_tokens=128,
        speculative_config={"method": "draft_model", "num_speculative_tokens": k, "model": "demo"},
    )
    _assert_same(_run(llm, _prompts()))
    stats = llm.engine.stats()
    # The draft is the target itself: under greedy sampling every draft is accepted.
    assert stats["spec_decode_draft_tokens"] > 0
    assert stats["spec_decode_accepted_tokens"] == stats["spec_decode_draft_tokens"]
    per_position = stats["spec_decode_acceptance_per_position"]
    assert len(per_position) == k and per_position[0] == stats["spec_decode_verify_rows"]
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # later drafts need the earlier
    assert sum(per_position) == stats["spec_decode_accepted_tokens"]
    mean = stats["spec_decode_mean_accepted_length"]
    assert mean == 1 + stats["spec_decode_accepted_tokens"] / stats["spec_decode_verify_rows"] and mean > 1


def test_speculation_with_preemption_is_lossless() -> None:
    llm = _llm(
        **mode_args("align"),
        **PREEMPTING,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    _assert_same(_run(llm, _prompts()))
    assert llm.engine.stats()["num_preemptions_total"] > 0


@pytest.mark.parametrize("mode", ["align", "all"])
def test_prefix_hit_rate_is_the_same_with_speculation(mode: str) -> None:
    """Other engines lose their hybrid prefix hits under speculative decoding; we must not."""

    def hit_tokens(spec: dict[str, object] | None) -> list[int]:
        llm = _llm(
            mamba_cache_mode=mode,
            mamba_block_size=MAMBA_BLOCK,
            max_num_batched_tokens=128,
            speculative_config=spec,
        )
        prompts = _prompts()
        _run(llm, prompts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        return [o.num_cached_tokens for o in outs]

    without = hit_tokens(None)
    with_spec = hit_tokens({"method": "ngram", "num_speculative_tokens": 3})
    assert sum(without) > 0
    assert with_spec == without


def _write_repeating_model(path: Path) -> str:
    """The demo checkpoint with every mixer's output projection zeroed and the LM head tied to the
    embeddings: each position predicts its own input token, so greedy output repeats the last
    prompt token forever and n-gram drafts get accepted."""
    import torch
    from safetensors.torch import load_file, save_file

    from hybridserve.model.demo import write_demo_model

    out = write_demo_model(path)
    weights = load_file(str(out / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(w)
    weights["lm_head.weight"] = weights["backbone.embeddings.weight"].clone()
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_ngram_drafts_are_accepted_and_lossless(tmp_path: Path, mode: str) -> None:
    model = _write_repeating_model(tmp_path / "repeat")
    prompts = [[5, 9, 11, 13, 17], [100, 200, 300, 400, 500, 600, 700, 100, 200]]

    def run(spec: dict[str, object] | None) -> tuple[list[list[int]], dict[str, object]]:
        llm = LLM(
            model,
            dtype="float64",
            max_model_len=256,
            block_size=BLOCK,
            mamba_cache_mode=mode,
            mamba_block_size=MAMBA_BLOCK,
            speculative_config=spec,
        )
        return _run(llm, prompts), llm.engine.stats()

    plain, _ = run(None)
    assert plain[0] == [17] * MAX_TOKENS  # the model repeats its last token
    spec_out, stats = run({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert spec_out == plain
    assert stats["spec_decode_accepted_tokens"] > 0
    # Fewer forward steps than tokens: accepted drafts skip steps.
    assert stats["num_steps"] < MAX_TOKENS
