"""The engine matrix every model family passes, in float64: a checkpoint whose LM head leans
towards its embeddings (so n-gram drafts are partly accepted), its reference outputs (one request
at a time, no prefix caching, whole prompts in one step), and the check that cache modes none /
align / all, with and without n-gram speculation, give exactly those outputs."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from hybridserve import LLM, SamplingParams

VOCAB = 256
MAX_TOKENS = 12
BLOCK = 8
MAMBA_BLOCK = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


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
