"""Losslessness of the engine (docs/losslessness.md): greedy outputs of the float64 demo model are
identical whatever the cache mode, prefix hits, chunk budget, batch composition, preemption and
speculative decoding. Any difference is a bug, not rounding."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams

MAX_TOKENS = 20
BLOCK = 16
MAMBA_BLOCK = 64


@cache
def corpus_passage_repeated() -> list[int]:
    """60 tokens of the demo model's corpus, then its first 20 again: the model (trained on that
    corpus) recites the passage a second time, and n-gram lookup drafts exactly that from the
    prompt, so drafts get accepted."""
    from hybridserve.model import demo

    tok_json = (Path(demo.ensure_demo_model()) / "tokenizer.json").read_text(encoding="utf-8")
    ids, _ = demo.corpus_tokens(tok_json)
    return ids[:60] + ids[:20]


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 780) for _ in range(150)]
    prompts = [
        shared + [rng.randrange(3, 780) for _ in range(21)],  # share a 150-token prefix
        shared + [rng.randrange(3, 780) for _ in range(40)],
        [rng.randrange(3, 780) for _ in range(97)],
        corpus_passage_repeated(),  # repetitive: n-gram lookup finds drafts the model accepts
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


def mode_args(mode: str, placement: str | None = None) -> dict[str, object]:
    """Engine arguments of a cache mode ("none": prefix caching off) and checkpoint placement
    (None: the engine's default, branch+grid in mode all, branch in align)."""
    if mode == "none":
        return dict(mamba_cache_mode=mode, enable_prefix_caching=False)
    return dict(
        mamba_cache_mode=mode,
        enable_prefix_caching=True,
        mamba_block_size=MAMBA_BLOCK,
        mamba_checkpoint_placement=placement,
    )


def _continuations(outputs: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """The next turn of each prompt: the prompt, its output, and a few new tokens. Its prefix hit
    can reach the last token the first turn computed (prompt + output - 1), inside a block."""
    rng = random.Random(77)
    return [
        p + list(o) + [rng.randrange(3, 780) for _ in range(3 + i)]
        for i, (p, o) in enumerate(zip(_prompts(), outputs))
    ]


@cache
def reference() -> tuple[tuple[int, ...], ...]:
    """One request at a time, no prefix caching, whole prompts in one step."""
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=1024, max_num_seqs=1)
    return tuple(tuple(t) for t in _run(llm, _prompts()))


@cache
def reference_next_turn() -> tuple[tuple[int, ...], ...]:
    """The same for the continuations of the prompts."""
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=1024, max_num_seqs=1)
    return tuple(tuple(t) for t in _run(llm, _continuations(reference())))


def _assert_same(got: list[list[int]], ref: tuple[tuple[int, ...], ...] | None = None) -> None:
    ref = reference() if ref is None else ref
    for i, (g, r) in enumerate(zip(got, ref)):
        assert tuple(g) == r, f"prompt {i}: {g} != {r}"
    assert len(got) == len(ref)


def _three_passes(llm: LLM) -> tuple[list[int], list[int]]:
    """The prompts, the same prompts again (hits on branch points or grid checkpoints), then their
    next turns (hits on the first pass's last tokens); every output equals the reference.
    Returns the hit lengths of the second and third passes."""
    prompts = _prompts()
    _assert_same(_run(llm, prompts))
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    _assert_same([o.outputs[0].token_ids for o in again])
    turns = llm.generate([{"prompt_token_ids": p} for p in _continuations(reference())], PARAMS)
    _assert_same([o.outputs[0].token_ids for o in turns], reference_next_turn())
    return [o.num_cached_tokens for o in again], [o.num_cached_tokens for o in turns]


def test_reference_generates_full_length() -> None:
    ref = reference()
    assert all(len(r) == MAX_TOKENS for r in ref)
    assert len({r for r in ref}) > 1  # the prompts lead to different outputs


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("budget", [64, 128, 1024])
def test_cache_modes_and_chunking_are_lossless(mode: str, budget: int) -> None:
    llm = _llm(**mode_args(mode), max_num_batched_tokens=budget)
    again, turns = _three_passes(llm)
    prompts = _prompts()
    if mode == "none":
        assert again == [0] * len(prompts) and turns == [0] * len(prompts)
        return
    if budget < 1024:
        # prompts 0, 1 and 5 share 131..150 tokens, and are prefilled over several steps: the
        # later ones found the first one's KV without a state and kept one at their deepest cached
        # block, on the 16-token block grid (not the 64-token one), which the second pass hits
        shared_hits = [again[i] for i in (0, 1, 5)]
        assert all(h in (128, 144) for h in shared_hits), shared_hits
        stats = llm.engine.stats()
        assert stats["prefix_hits_branch"] + stats["prefix_hits_grid"] >= 3
    elif mode == "align":
        # one step prefills every prompt: nobody saw another's KV, and the first pass kept states
        # only after each sequence's last token, deeper than any repeated prompt can hit
        assert again == [0] * len(prompts)
    else:
        # ... and in mode all the grid points every 64 tokens, in spare room
        assert again == [len(p) - 1 - (len(p) - 1) % MAMBA_BLOCK for p in prompts]
    # every next turn resumes at the last token its first turn computed
    for p, t in zip(prompts, turns):
        assert t == len(p) + MAX_TOKENS - 1, (len(p), t)
    assert llm.engine.stats()["prefix_hits_last_token"] == len(prompts)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_grid_placement_is_lossless(mode: str) -> None:
    llm = _llm(**mode_args(mode, "grid"), max_num_batched_tokens=64)
    again, _ = _three_passes(llm)
    # Every prompt of >= 65 tokens has a checkpoint at 64 from the first pass.
    for p, c in zip(_prompts(), again):
        if len(p) > MAMBA_BLOCK:
            assert c > 0 and c % MAMBA_BLOCK == 0 and c <= len(p) - 1, (len(p), c)
    assert llm.engine.stats()["prefix_hits_last_token"] == 0


@pytest.mark.parametrize("mode", ["align", "all"])
def test_shared_prefix_hit_within_one_batch_run(mode: str) -> None:
    def hits(placement: str) -> list[int]:
        llm = _llm(**mode_args(mode, placement), max_num_batched_tokens=256)
        got = []
        for i in (0, 1, 0):
            out = llm.generate({"prompt_token_ids": _prompts()[i]}, PARAMS)[0]
            assert tuple(out.outputs[0].token_ids) == reference()[i]
            got.append(out.num_cached_tokens)
        return got

    # prompts 0 and 1 share 150 tokens; prompt 0 comes back third. Grid: the 2nd and 3rd requests
    # hit 128 (two checkpoints of 64). Branch: the 2nd misses (no state was kept in the shared
    # part) and keeps one at the end of the shared blocks, 144, which the 3rd hits.
    assert hits("grid") == [0, 128, 128]
    assert hits("branch") == [0, 0, 144]


def _declaring_marker() -> int:
    """A token that first occurs in prompts 0 and 1 at position 143..149 of their 150 shared ones:
    as a shared-prefix marker it declares 144 tokens shared (9 whole blocks)."""
    shared = _prompts()[0][:150]
    return next(shared[j] for j in range(143, 150) if shared[j] not in shared[:j])


SPECS: dict[str, dict[str, object] | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    "draft": {"method": "draft_model", "num_speculative_tokens": 3, "model": "demo"},
}


@pytest.mark.parametrize("mode", ["align", "all"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_declared_shared_prefixes_are_lossless(mode: str, spec: str) -> None:
    """Prompts 0 and 1 declare their first 144 tokens shared: the first pass keeps the state
    there (one step prefills both, so neither saw the other's KV and no branch point exists), and
    the second pass hits it. Outputs are the reference's throughout."""
    llm = _llm(
        **mode_args(mode),
        max_num_batched_tokens=1024,
        shared_prefix_markers=[_declaring_marker()],
        speculative_config=SPECS[spec],
    )
    again, _ = _three_passes(llm)
    assert again[0] == again[1] == 144, again
    assert llm.engine.stats()["prefix_hits_declared"] >= 2


@pytest.mark.parametrize("mode", ["align", "all"])
def test_declared_shared_prefixes_with_preemption_are_lossless(mode: str) -> None:
    llm = _llm(**mode_args(mode), **PREEMPTING, shared_prefix_markers=[_declaring_marker()])
    _assert_same(_run(llm, _prompts()))
    _assert_same(_run(llm, _prompts()))
    stats = llm.engine.stats()
    assert stats["num_preemptions_total"] > 0
    if mode == "all":  # (in align the 30-block KV pool evicts the declared prefix's blocks first)
        assert stats["prefix_hits_declared"] > 0


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("placement", [None, "branch", "grid"])
def test_preemption_is_lossless(mode: str, placement: str | None) -> None:
    if mode == "none" and placement is not None:
        pytest.skip("the placement has no effect without prefix caching")
    llm = _llm(**mode_args(mode, placement), **PREEMPTING)
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
    again, turns = _three_passes(llm)
    stats = llm.engine.stats()
    assert stats["spec_decode_draft_tokens"] > 0  # drafts were verified (and, here, rejected)
    if mode != "none":
        assert sum(again) > 0 and stats["prefix_hits_last_token"] > 0
    assert not llm.engine.runner.proposer._kept  # every finished request's history was dropped


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_speculation_is_lossless(mode: str, k: int) -> None:
    llm = _llm(
        **mode_args(mode),
        max_num_batched_tokens=128,
        speculative_config={"method": "draft_model", "num_speculative_tokens": k, "model": "demo"},
    )
    _, turns = _three_passes(llm)
    stats = llm.engine.stats()
    if mode != "none":
        assert stats["prefix_hits_last_token"] > 0
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
@pytest.mark.parametrize("placement", ["branch+grid", "branch", "grid"])
def test_prefix_hit_rate_is_the_same_with_speculation(mode: str, placement: str) -> None:
    """Other engines lose their hybrid prefix hits under speculative decoding; we must not."""

    def hit_tokens(spec: dict[str, object] | None) -> list[int]:
        llm = _llm(**mode_args(mode, placement), max_num_batched_tokens=128, speculative_config=spec)
        again, turns = _three_passes(llm)
        return again + turns

    without = hit_tokens(None)
    with_spec = hit_tokens({"method": "ngram", "num_speculative_tokens": 3})
    assert sum(without) > 0
    assert with_spec == without


@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_boundary_crossed_in_the_last_verify_step_is_hit_by_the_next_turn(mode: str) -> None:
    """The draft is the target itself, so every draft is accepted: a 45-token prompt computes
    45 -> 49 -> ... -> 65 in verify steps of four, the last one, which ends the request (21
    tokens), crossing the grid point at 64. The engine is idle afterwards; the next turn, admitted
    at once, must hit 64 as it does without speculation, and both turns match the reference."""
    rng = random.Random(45)
    prompt = [rng.randrange(3, 780) for _ in range(45)]
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    ref = _llm(enable_prefix_caching=False, max_num_seqs=1)
    first = ref.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    turn = prompt + list(first) + [5, 6, 7]
    ref_turn = ref.generate([{"prompt_token_ids": turn}], params)[0].outputs[0].token_ids

    for spec in (None, SPECS["draft"]):
        llm = _llm(**mode_args(mode, "grid"), speculative_config=spec)
        got = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        assert got.outputs[0].token_ids == first
        stats = llm.engine.stats()
        assert stats["checkpoints_pending"] == 0, spec
        got = llm.generate([{"prompt_token_ids": turn}], params)[0]
        assert got.outputs[0].token_ids == ref_turn
        assert got.num_cached_tokens == 64, spec
    assert stats["spec_decode_accepted_tokens"] == stats["spec_decode_draft_tokens"] > 0


@pytest.mark.parametrize("placement", ["grid", "branch+grid"])
@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_grid_point_reached_by_the_step_a_stop_string_ends_is_hit_by_the_next_turn(
    mode: str, placement: str
) -> None:
    """A 45-token prompt decodes one token a step; the step that computes position 64 (a grid
    point) samples the 20th token, whose text is the stop string. The scheduler's update
    queued the checkpoint's copy for the next step, and the stop string, matched after the
    update, ends the request: the idle engine holds nothing pending, and the next turn, admitted
    at once, hits 64 and matches the reference. (64 is also the last computed token: with branch
    points the state there is kept as the last-token state, with the grid alone as the grid's.)"""
    rng = random.Random(45)
    prompt = [rng.randrange(3, 780) for _ in range(45)]
    ref = _llm(enable_prefix_caching=False, max_num_seqs=1)
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first = ref.generate([{"prompt_token_ids": prompt}], plain)[0].outputs[0].token_ids
    tok = ref.get_tokenizer()
    stop = tok.decode(first[19:20])
    assert stop.strip() and stop not in tok.decode(first[:19])  # (the stop string ends it there)
    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    turn = prompt + list(first) + [5, 6, 7]
    ref_turn = ref.generate([{"prompt_token_ids": turn}], plain)[0]

    llm = _llm(**mode_args(mode, placement))
    got = llm.generate([{"prompt_token_ids": prompt}], stopped)[0].outputs[0]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (first, "stop", stop)
    stats = llm.engine.stats()
    assert stats["checkpoints_pending"] == 0
    assert stats["checkpoints_last_token"] == (placement == "branch+grid")
    again = llm.generate([{"prompt_token_ids": turn}], plain)[0]
    assert again.outputs[0].token_ids == ref_turn.outputs[0].token_ids
    assert again.num_cached_tokens == 64


def _write_repeating_model(path: Path) -> str:
    """The demo checkpoint's random init (no training) with every mixer's output projection zeroed
    and the LM head tied to the embeddings: each position predicts its own input token, so greedy
    output repeats the last prompt token forever and n-gram drafts get accepted."""
    import torch
    from safetensors.torch import load_file, save_file

    from hybridserve.model.demo import write_demo_model

    out = write_demo_model(path, steps=0)
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


@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_preempted_prompt_whose_hit_needs_more_blocks_than_the_pool_runs_again(mode: str) -> None:
    """A pool of 6 blocks, a 94-token prompt preempted part way through its prefill: its hit (its
    cached blocks, plus the tail block it copies from) needs 7 blocks at once. With nothing else
    running it gives the hit up and computes the prompt again, instead of waiting forever."""
    rng = random.Random(0)
    short = [rng.randrange(3, 795) for _ in range(2)]
    long = [rng.randrange(3, 795) for _ in range(94)]
    llm = LLM(
        "demo", dtype="float64", max_model_len=96, mamba_cache_mode=mode, num_kv_blocks=7,
        max_num_batched_tokens=32, mamba_block_size=16,
    )  # fmt: skip
    engine = llm.engine
    engine.add_request("short", short, SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True))
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=1))
    done: dict[str, list[int]] = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    stats = engine.stats()
    assert set(done) == {"short", "long"}, stats
    assert stats["num_preemptions_total"] > 0  # the case under test happened
    plain = LLM("demo", dtype="float64", enable_prefix_caching=False)
    ref = plain.generate(
        [{"prompt_token_ids": short}, {"prompt_token_ids": long}],
        [
            SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=1),
        ],
    )
    assert [done["short"], done["long"]] == [list(o.outputs[0].token_ids) for o in ref]
    assert stats["kv_blocks_used"] == 0
