"""What the test module of every model family (test_zamba2.py, test_falcon_h1.py, ...) shares:

- its checkpoints: a module-scoped fixture building each of the family's small transformers models
  once, saved as a checkpoint (`checkpoints_fixture`);
- the float64 comparison with transformers on batched, chunked requests (`check_float64_logits`);
- the engine matrix every family passes, in float64: a checkpoint whose LM head leans towards its
  embeddings (so n-gram drafts are partly accepted), its reference outputs (one request at a time,
  no prefix caching, whole prompts in one step), and the check that cache modes none / align /
  all, with and without n-gram speculation, give exactly those outputs (`engine_matrix`)."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_fixtures import run_cli
from hybridserve import LLM, SamplingParams
from hybridserve.model.loader import load_model
from model_fixtures import Driver, build_hf_model, random_prompts, save_hf_model

VOCAB = 256
MAX_TOKENS = 12
BLOCK = 8
MAMBA_BLOCK = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

# The batched requests of the float64 comparison: prompt lengths, each prompt's prefill chunks
# (None: all in one step) and the step it arrives at, so that prefill and decode rows mix.
LENGTHS = [5, 21, 1, 13, 30, 9]
CHUNKS: list[list[int] | None] = [None, [8, 13], None, [3, 10], [16, 7, 7], None]
ARRIVALS = [0, 0, 1, 2, 2, 4]
# Relative tolerance against transformers, which computes its norms (and, per family, the scan,
# the rotary cos/sin, the router) in float32 even in a float64 model: the two agree to float32
# rounding, not to float64 precision (each family's module docstring says where).
FLOAT64_TOLERANCE = 1e-4

Checkpoint = tuple[torch.nn.Module, Path]


def checkpoints_fixture(model_type: str, configs: dict[str, dict], seed: int) -> Any:
    """A module-scoped fixture, `checkpoints`: a function of a config name of `configs` giving the
    transformers model of that config (random weights, `seed` plus the name's index) and the
    folder it is saved in, each built once. Assign it to a module name `checkpoints`."""
    names = list(configs)

    @cache
    def checkpoint(name: str, root: str) -> Checkpoint:
        hf = build_hf_model(model_type, configs[name], vocab_size=VOCAB, seed=seed + names.index(name))
        return hf, save_hf_model(hf, Path(root) / name)

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
        root = str(tmp_path_factory.mktemp(model_type))
        return lambda name: checkpoint(name, root)

    return checkpoints


def check_float64_logits(checkpoint: Checkpoint, new_tokens: int, *, padded_batch: bool = False) -> None:
    """Six requests batched (mixed prefill / decode rows, chunked prefills), float64: the greedy
    tokens equal transformers' argmax and every logit row equals transformers' within
    FLOAT64_TOLERANCE. Transformers' reference: one forward per request, or with `padded_batch`
    one right-padded forward of them all (causal: the padding comes after every row's tokens)."""
    hf, d = checkpoint
    lm = load_model(str(d), torch.float64)
    prompts = random_prompts(len(LENGTHS), VOCAB, LENGTHS, seed=31)
    ours, logits = Driver(lm, max_seq=64, max_reqs=len(prompts)).generate(
        prompts, new_tokens, chunks=CHUNKS, arrivals=ARRIVALS
    )
    hf64 = hf.to(torch.float64)
    try:
        seqs = [p + o for p, o in zip(prompts, ours)]
        with torch.no_grad():
            if padded_batch:
                L = max(len(s) for s in seqs)
                batched = hf64(torch.tensor([s + [0] * (L - len(s)) for s in seqs])).logits
                full = [batched[i] for i in range(len(seqs))]
            else:
                full = [hf64(torch.tensor([s])).logits[0] for s in seqs]
        worst = 0.0
        for p, o, lg, f in zip(prompts, ours, logits, full):
            ref = f[len(p) - 1 : len(p) - 1 + len(o)]
            assert ref.dtype == torch.float64 and lg.dtype == torch.float64
            assert ref.argmax(-1).tolist() == o
            worst = max(worst, float((lg - ref).abs().max() / ref.abs().max()))
        assert worst < FLOAT64_TOLERANCE, worst
        assert len({tuple(o) for o in ours}) > 1  # not a degenerate model
    finally:
        hf.to(torch.float32)


def explain(model_dir: Path, *flags: str) -> str:
    """What `hybridserve config MODEL_DIR --explain [flags]` prints (it must succeed)."""
    proc = run_cli("config", str(model_dir), "--explain", *flags)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def write_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(37)]
    motif = [rng.randrange(3, VOCAB) for _ in range(5)]
    return [
        shared + [rng.randrange(3, VOCAB) for _ in range(9)],  # share a 37-token prefix
        shared + [rng.randrange(3, VOCAB) for _ in range(20)],
        (motif * 8)[:38],  # repetitive: n-gram lookup finds drafts
        [rng.randrange(3, VOCAB) for _ in range(4)],
        shared[:33],
    ]


def turns(outputs: list[tuple[int, ...]]) -> list[list[int]]:
    """The next turn of each prompt: the prompt, its output, a few new tokens."""
    return [p + list(o) + [7 + i] * (2 + i) for i, (p, o) in enumerate(zip(prompts(), outputs))]


def run(llm: LLM, batch: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS)
    return [tuple(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def make_llm(model: Path, mode: str, **kw: object) -> LLM:
    args: dict[str, object] = dict(
        dtype="float64", block_size=BLOCK, max_model_len=256, max_num_seqs=4, seed=0
    )
    args.update(kw)
    if mode == "none":
        args.update(mamba_cache_mode="none", enable_prefix_caching=False)
    else:
        args.update(mamba_cache_mode=mode, enable_prefix_caching=True, mamba_block_size=MAMBA_BLOCK)
    return LLM(str(model), **args)


def echo_model(
    src: Path, d: Path, embed_share: float
) -> tuple[Path, list[tuple[int, ...]], list[tuple[int, ...]]]:
    """`src` copied to `d` with its LM head set to `embed_share` of the embeddings plus the rest of
    its own (each position leans towards repeating its input token), a tokenizer, and the
    reference outputs of the prompts and of their next turns."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, d)
    w = load_file(str(d / "model.safetensors"))
    embed = w["model.embed_tokens.weight"]
    w["lm_head.weight"] = embed_share * embed + (1 - embed_share) * w.get("lm_head.weight", embed)
    save_file(w, str(d / "model.safetensors"))
    write_tokenizer(d)
    llm = make_llm(d, "none", max_num_batched_tokens=512, max_num_seqs=1)
    ref, _ = run(llm, prompts())
    ref_turns, _ = run(llm, turns(ref))
    assert all(len(r) == MAX_TOKENS for r in ref) and len(set(ref)) > 1
    assert all(len(set(r)) > 1 for r in ref)  # not a constant repetition
    return d, ref, ref_turns


def engine_matrix(test: Callable[..., None]) -> Callable[..., None]:
    """Parametrizes `test(engine_model, mode, spec)` over the engine matrix: cache modes none /
    align / all, each without and with n-gram speculation of 3 drafts."""
    test = pytest.mark.parametrize("spec", [None, 3], ids=["plain", "ngram3"])(test)
    return pytest.mark.parametrize("mode", ["none", "align", "all"])(test)


def tensor_parallel_subset(test: Callable[..., None]) -> Callable[..., None]:
    """Parametrizes `test(engine_model, mode, spec)` over the part of the engine matrix a family
    also runs at tensor-parallel size 2 (each case spawns a worker): align with n-gram speculation
    of 3 drafts, and all without speculation."""
    return pytest.mark.parametrize(("mode", "spec"), [("align", 3), ("all", None)])(test)


def check_lossless(
    engine_model: tuple[Path, list[tuple[int, ...]], list[tuple[int, ...]]],
    mode: str,
    spec: int | None,
    **engine_kw: object,
) -> None:
    """The engine in cache mode `mode`, with n-gram speculation of `spec` drafts or none (and
    `engine_kw`, e.g. a tensor-parallel size): the prompts, the same prompts again and their next
    turns give the reference outputs; prefix hits where the mode caches; drafts both accepted and
    rejected."""
    d, ref, ref_turns = engine_model
    sc = None
    if spec is not None:
        sc = {
            "method": "ngram",
            "num_speculative_tokens": spec,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    llm = make_llm(d, mode, max_num_batched_tokens=24, speculative_config=sc, **engine_kw)
    batch = prompts()
    try:
        first, _ = run(llm, batch)
        again, hits = run(llm, batch)
        nxt, turn_hits = run(llm, turns(ref))
    finally:
        llm.engine.stop_workers()  # type: ignore[attr-defined]
    assert first == ref and again == ref and nxt == ref_turns
    stats = llm.engine.stats()
    if mode == "none":
        assert sum(hits) == 0 and sum(turn_hits) == 0
    else:
        assert sum(hits) > 0
        # every next turn resumes at the last token its first turn computed
        assert turn_hits == [len(p) + MAX_TOKENS - 1 for p in batch]
    if spec is not None:
        # drafts accepted and drafts rejected
        assert 0 < stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]
