"""`hybridserve bench offline`: engine throughput through the LLM API, without HTTP.

`num_prompts` random token-id prompts of `prompt_len` tokens, `output_len` greedy tokens each
(`ignore_eos`, so every request generates exactly `output_len`), all submitted at once. A small
warm-up generate runs first (not timed). torch is imported by the engine, inside `run_offline`.
"""

from __future__ import annotations

import json
import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridserve.config import EngineArgs


def make_prompts(num_prompts: int, prompt_len: int, seed: int, lo: int = 3, hi: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(prompt_len)] for _ in range(num_prompts)]


def run_offline(
    args: EngineArgs,
    num_prompts: int,
    prompt_len: int,
    output_len: int,
    seed: int = 0,
    warmup: bool | str = True,
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """`warmup`: "short" (True: two short requests), "full" (the whole workload once, so that the
    timed run meets no shape for the first time: on a GPU the first pass of each attention shape
    can cost more than the run) or False. The prefix cache is emptied after it, so that the timed
    run hits nothing the warm-up left."""
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

    from .serve_client import machine_info

    t_load = time.perf_counter()
    llm = LLM.from_engine_args(args)
    load_s = time.perf_counter() - t_load
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if prompts is None:
        prompts = make_prompts(num_prompts, prompt_len, seed)
    mode = "short" if warmup is True else warmup or "none"
    if mode not in ("short", "full", "none"):
        raise ValueError(f"warmup: short, full or none, not {warmup!r}")
    if mode == "short":
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]],
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
    elif mode == "full":
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if mode != "none":
        llm.engine.reset_prefix_cache()
    before = llm.engine.stats()  # (the warm-up's steps and drafts are not the run's)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t0
    stats = llm.engine.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "benchmark": "offline",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {
            "engine_args": args.to_dict() if hasattr(args, "to_dict") else str(args),
            "num_prompts": len(prompts),
            "prompt_len": prompt_len,
            "output_len": output_len,
            "seed": seed,
            "warmup": mode,
        },
        "max_model_len": llm.engine.max_model_len,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "num_steps": int(stats.get("num_steps", 0)) - int(before.get("num_steps", 0)),
        "total_prompt_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(prompts) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        **{
            k: stats.get(k, 0) - before.get(k, 0)
            for k in ("spec_decode_draft_tokens", "spec_decode_accepted_tokens", "prefix_cache_hit_tokens")
        },
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }


def format_offline(r: dict[str, Any]) -> str:
    c = r["config"]
    text = (
        f"== bench offline: {c['num_prompts']} prompts x {c['prompt_len']} tokens, {c['output_len']} output tokens\n"
        f"elapsed {r['elapsed_s']:.2f} s in {r['num_steps']} steps (model load {r['load_s']:.1f} s)\n"
        f"throughput: {r['request_throughput']:.2f} req/s  {r['output_throughput']:.1f} output tok/s  "
        f"{r['total_token_throughput']:.1f} total tok/s"
    )
    asked = c["num_prompts"] * c["output_len"]
    if r["total_output_tokens"] != asked:
        # the throughput counts the tokens made; say that they are not the ones asked for
        text += (
            f"\nnote: {r['total_output_tokens']} output tokens made of the {asked} asked: a request ends "
            f"where prompt + output reach max_model_len ({r['max_model_len']})"
        )
    return text


def offline_main(
    args: EngineArgs,
    num_prompts: int,
    prompt_len: int,
    output_len: int,
    seed: int,
    result_file: str | None,
    warmup: str = "short",
) -> dict[str, Any]:
    r = run_offline(args, num_prompts, prompt_len, output_len, seed, warmup=warmup)
    print(format_offline(r))
    if result_file:
        Path(result_file).parent.mkdir(parents=True, exist_ok=True)
        slim = {k: v for k, v in r.items() if k != "outputs"}
        Path(result_file).write_text(json.dumps(slim, indent=1, default=str) + "\n")
        print(f"result: {result_file}")
    return r
