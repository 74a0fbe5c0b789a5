"""CPU throughput on the demo model: hybridserve vs transformers' `generate`, in one run.

    .venv/bin/python benches/cpu_throughput.py [--num-prompts 64 --prompt-len 256 --output-len 128]
        [--profile benches/results/cpu_throughput_profile.txt] [--result-file F]

Both run the same checkpoint (the built-in demo model, float32) on the same prompts (random token
ids, seeded), greedy, exactly `output-len` new tokens each:

- hybridserve: `LLM("demo", dtype="float32", max_num_seqs=num_prompts, async_scheduling=False)
  .generate(...)` (synchronous steps; defaults otherwise: prefix caching on, chunked prefill, mode `all`; the C++ CPU kernels of
  kernels/native.py for attention decode and the Mamba recurrence);
- hybridserve_ngram3: the same plus n-gram speculative decoding with K = 3 (mode `align`; greedy
  outputs are identical with and without speculation, which the run checks);
- hybridserve_bf16: the plain setting in bfloat16 (the checkpoint's float32 weights cast at
  load; the Mamba states stay float32): bfloat16 GEMMs and K/V, the C++ kernels computing in
  float32. Its greedy outputs differ from the float32 ones where bfloat16 rounding decides;
- hybridserve_bf16_block128: the same with `block_size=128` (KV blocks of 128 tokens instead of
  16: the attention kernel reads each row's K and V in 16 KiB runs instead of 2 KiB ones, which
  this CPU's memory system serves faster; prefix caching then shares prompts in 128-token
  blocks). Its greedy outputs equal hybridserve_bf16's (the block size changes no arithmetic);
- hybridserve_bf16_block128_ngram3: that plus n-gram speculation with K = 3 (the fastest
  setting); the run counts its greedy outputs equal to hybridserve_bf16's (verification runs
  GEMMs of other shapes, which in bfloat16 can round a near-tie the other way);
- transformers: one batch of all prompts, left padding with an attention mask, KV/SSM cache on,
  `min_new_tokens = max_new_tokens` (its best setting on CPU: one batched call);
- transformers_bf16: the same in bfloat16 (slower than float32 for it on this CPU).

The ratios are taken against the faster of the two transformers runs (its best setting).

Both engines are built and warmed up first; then the timed generate runs --repeats times for each,
interleaved (hybridserve, hybridserve_ngram3, transformers, ...) so that all see the same
machine load;
the fastest run of each counts. Reports tokens/s (output tokens over wall time) of both and the
ratio (target >= 3x), process CPU seconds (the machine is shared: wall time is noisy), and how
many of the greedy outputs are identical. `--profile FILE` then runs hybridserve once more under cProfile and writes
the top functions by cumulative and by own time to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3}
BLOCK128 = 128  # KV block size of the _block128 contestant
HYBRIDSERVE_CONTESTANTS = (
    "hybridserve",
    "hybridserve_ngram3",
    "hybridserve_bf16",
    "hybridserve_bf16_block128",
    "hybridserve_bf16_block128_ngram3",
)


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


Timed = tuple[float, float, list[list[int]]]  # wall s, process CPU s, output tokens per prompt


def _timed(fn: Callable[[], list[list[int]]]) -> Timed:
    c0, t0 = time.process_time(), time.perf_counter()
    toks = fn()
    return time.perf_counter() - t0, time.process_time() - c0, toks


def _native_kernels(on: bool) -> None:
    # read when an engine chooses its kernels (kernels/backend.py)
    os.environ["HYBRIDSERVE_NATIVE_CPU"] = "1" if on else "0"


def make_hybridserve(
    prompts: list[list[int]],
    output_len: int,
    speculative_config: dict[str, Any] | None = None,
    native: bool = True,
    dtype: str = "float32",
    block_size: int | None = None,
) -> tuple[Callable[[], Timed], dict[str, Any]]:
    """Builds the engine and warms it up; returns a function that runs the timed generate once.
    native=False runs the pure-torch path (no C++ CPU kernels)."""
    from hybridserve.engine.llm import LLM
    from hybridserve.kernels import backend
    from hybridserve.sampling.params import SamplingParams

    _native_kernels(native)

    llm = LLM(
        "demo",
        dtype=dtype,
        max_num_seqs=max(64, len(prompts)),
        speculative_config=speculative_config,
        async_scheduling=False,  # synchronous steps: no core beyond the contestant's
        **({} if block_size is None else {"block_size": block_size}),
    )
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, temperature=0.0))
    # warm-up on the whole workload: compiles every graph it needs (one row, several rows, every
    # verify length), so the timed runs measure steady state
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    info: dict[str, Any] = {"config": llm.engine.config.to_dict(), "steps": []}

    def once() -> Timed:
        # the kernels this engine chose at start (another contestant's engine pinned its own since)
        backend.pin(llm.engine.runner.kernels)
        steps0 = llm.engine.stats()["num_steps"]
        r = _timed(
            lambda: [
                list(o.outputs[0].token_ids)
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            ]
        )
        info["steps"].append(llm.engine.stats()["num_steps"] - steps0)
        return r

    return once, info


def make_transformers(
    prompts: list[list[int]], output_len: int, dtype: str = "float32"
) -> tuple[Callable[[], Timed], dict[str, Any]]:
    """transformers on the same checkpoint: one left-padded batch with an attention mask."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from hybridserve.model.demo import ensure_demo_model

    model = AutoModelForCausalLM.from_pretrained(str(ensure_demo_model()), dtype=getattr(torch, dtype)).eval()
    pad = 0

    def gen(ps: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad, use_cache=True)  # fmt: skip
        return [row[width:].tolist() for row in out]

    gen(prompts, output_len)  # warm-up on the whole workload, as for hybridserve
    return (lambda: _timed(lambda: gen(prompts, output_len))), {"version": transformers.__version__}


def _summary(runs: list[Timed], info: dict[str, Any]) -> dict[str, Any]:
    best = min(runs, key=lambda r: r[0])
    n = sum(len(t) for t in best[2])
    return {
        "wall_s": best[0],
        "cpu_s": best[1],
        "output_tokens": n,
        "tok_per_s": n / best[0],
        "tok_per_cpu_s": n / best[1],
        "all_wall_s": [r[0] for r in runs],
        "all_cpu_s": [r[1] for r in runs],
        **info,
    }


def profile_hybridserve(prompts: list[list[int]], output_len: int, path: Path) -> None:
    once, _ = make_hybridserve(prompts, output_len)
    prof = cProfile.Profile()
    prof.enable()
    once()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).strip_dirs()
    buf.write("=== by cumulative time\n")
    st.sort_stats("cumulative").print_stats(40)
    buf.write("=== by own time\n")
    st.sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())
    print(f"profile: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=2, help="interleaved timed runs of each; the fastest counts"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument(
        "--profile", type=Path, default=None, help="also profile hybridserve (cProfile) into FILE"
    )
    ap.add_argument("--result-file", type=Path, default=ROOT / "benches" / "results" / "cpu_throughput.json")
    a = ap.parse_args()
    import torch

    prompts = make_prompts(a.num_prompts, a.prompt_len, a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    print(f"{a.num_prompts} prompts x {a.prompt_len} tokens, {a.output_len} output tokens; {a.repeats} "
          "interleaved runs each, the fastest counts", flush=True)  # fmt: skip
    contestants: list[tuple[str, Callable[[], Timed], dict[str, Any]]] = [
        ("hybridserve", *make_hybridserve(prompts, a.output_len)),
        ("hybridserve_ngram3", *make_hybridserve(prompts, a.output_len, speculative_config=NGRAM3)),
        ("hybridserve_bf16", *make_hybridserve(prompts, a.output_len, dtype="bfloat16")),
        (
            "hybridserve_bf16_block128",
            *make_hybridserve(prompts, a.output_len, dtype="bfloat16", block_size=BLOCK128),
        ),
        (
            "hybridserve_bf16_block128_ngram3",
            *make_hybridserve(
                prompts, a.output_len, dtype="bfloat16", block_size=BLOCK128, speculative_config=NGRAM3
            ),
        ),
        ("transformers", *make_transformers(prompts, a.output_len)),
        ("transformers_bf16", *make_transformers(prompts, a.output_len, dtype="bfloat16")),
    ]
    runs: dict[str, list[Timed]] = {name: [] for name, _, _ in contestants}
    for i in range(a.repeats):
        for name, once, _ in contestants:
            runs[name].append(once())
            w, c, t = runs[name][-1]
            n = sum(len(x) for x in t)
            print(f"  run {i + 1} {name:20s} {n / w:7.1f} tok/s ({w:.1f} s wall, {c:.1f} s CPU)", flush=True)
    summary = {name: _summary(runs[name], info) for name, _, info in contestants}
    hf_name = min(("transformers", "transformers_bf16"), key=lambda n: summary[n]["wall_s"])
    # greedy outputs are compared with float32 transformers' (the bfloat16 ones differ by rounding)
    hf, hf_toks = summary[hf_name], runs["transformers"][0][2]
    load1 = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": "cpu_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before": load0,
            "load_average_after": load1,
        },
        "setup": {
            "num_prompts": a.num_prompts,
            "prompt_len": a.prompt_len,
            "output_len": a.output_len,
            "dtype": "float32 (the _bf16 contestants: bfloat16)",
            "model": "demo",
            "seed": a.seed,
        },  # fmt: skip
        "transformers_best": hf_name,
        **summary,
    }
    print(f"transformers' best setting: {hf_name}")
    for name in HYBRIDSERVE_CONTESTANTS:
        hs, hs_toks = summary[name], runs[name][0][2]
        same = sum(x == y for x, y in zip(hs_toks, hf_toks))
        first_diff = [
            next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
            for x, y in zip(hs_toks, hf_toks)
        ]
        ratio = hs["tok_per_s"] / hf["tok_per_s"]
        cpu_ratio = hf["cpu_s"] / hs["cpu_s"] if hs["cpu_s"] > 0 else float("nan")
        hs.update(
            identical_to_hybridserve=sum(x == y for x, y in zip(hs_toks, runs["hybridserve"][0][2])),
            ratio_tok_per_s=ratio,
            ratio_cpu_s=cpu_ratio,
            identical_outputs=same,
            mean_identical_prefix_tokens=sum(first_diff) / len(first_diff),
        )
        if name.startswith("hybridserve_bf16_block128"):  # how many outputs the setting leaves unchanged
            hs["identical_to_hybridserve_bf16"] = sum(
                x == y for x, y in zip(hs_toks, runs["hybridserve_bf16"][0][2])
            )
            print(
                f"{name}: identical to hybridserve_bf16 {hs['identical_to_hybridserve_bf16']}/{len(prompts)}"
            )
        print(
            f"ratio {name} / {hf_name}: {ratio:.2f}x tok/s (target >= 3x), CPU-time ratio {cpu_ratio:.2f}x; "
            f"identical greedy outputs to float32 transformers' {same}/{len(prompts)} (to hybridserve: "
            f"{hs['identical_to_hybridserve']}/{len(prompts)})"
        )
    print(f"load {load0[0]:.1f} -> {load1[0]:.1f}")
    a.result_file.parent.mkdir(parents=True, exist_ok=True)
    a.result_file.write_text(json.dumps(result, indent=1) + "\n")
    print(f"result: {a.result_file}")
    if a.profile is not None:
        profile_hybridserve(prompts, a.output_len, a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
