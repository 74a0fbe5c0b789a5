"""Tensor parallelism: throughput and per-step latency at TP 1 and TP N, and the bytes rank 0
all-reduces per step, on the demo model and on a wider random Nemotron-H-shaped checkpoint.

    .venv/bin/python benches/bench_tp.py --tp 2 --result-file benches/results/tp_cpu.json

On a GPU machine with N devices (NCCL):

    .venv/bin/python benches/bench_tp.py --device cuda --dtype bfloat16 --tp 2 --wide-scale 4 \
        --result-file benches/results/tp_gpu.json

Each run: 8 requests of 64-token prompts, 32 greedy output tokens each (ignore_eos), prefix
caching off, after a warm-up run; wall time, output tokens per second, steps, wall time per step,
and (TP > 1) the all-reduces and bytes rank 0 summed per step (`distributed/parallel_state.py`
counters; every rank sums as many)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def wide_checkpoint(root: Path, scale: int) -> str:
    """A random Nemotron-H checkpoint (pattern M-M*-M*-, hidden 256 * scale, 16 * scale Mamba heads
    of 64 in 8 groups, 8 * scale query / 4 KV heads) with the demo model's tokenizer."""
    import torch
    import transformers

    from hybridserve.model.demo import ensure_demo_model

    demo = Path(ensure_demo_model())
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    cfg = transformers.NemotronHConfig(
        vocab_size=vocab,
        hidden_size=256 * scale,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                           "linear_attention", "full_attention", "mlp"],
        mamba_num_heads=16 * scale,
        mamba_head_dim=64,
        ssm_state_size=64,
        n_groups=8,
        chunk_size=64,
        num_attention_heads=8 * scale,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768 * scale,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg)
    out = root / f"wide{scale}"
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / f, out / f)
    return str(out)


def run(model: str, tp: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    from hybridserve import LLM, SamplingParams
    from hybridserve.distributed.parallel_state import get_tp_group

    llm = LLM(
        model, dtype=args.dtype, device=args.device, tensor_parallel_size=tp, cpu_threads=threads,
        enable_prefix_caching=False, mamba_cache_mode="none", max_num_seqs=8, max_model_len=512, seed=0,
    )  # fmt: skip
    try:
        prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 200 + 3 for j in range(64)]} for i in range(8)]
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        group = get_tp_group()
        steps0 = llm.engine.stats()["num_steps"]
        red0 = (group.num_all_reduces, group.all_reduced_bytes) if group else (0, 0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        steps = llm.engine.stats()["num_steps"] - steps0
        red1 = (group.num_all_reduces, group.all_reduced_bytes) if group else (0, 0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "model": Path(model).name if model != "demo" else "demo",
            "tp": tp,
            "cpu_threads_per_rank": threads,
            "output_tokens": tokens,
            "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1),
            "steps": steps,
            "ms_per_step": round(1000 * wall / steps, 2),
            "all_reduces_per_step": round((red1[0] - red0[0]) / steps, 1),
            "all_reduced_bytes_per_step": round((red1[1] - red0[1]) / steps),
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
        }
    finally:
        llm.engine.stop_workers()  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--wide-scale", type=int, default=2, help="width multiplier of the wide checkpoint")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    try:
        models = ["demo", wide_checkpoint(root, args.wide_scale)]
        rows = []
        for model in models:
            # TP 1 with one thread and with as many threads as the TP run uses in all
            configs = [(1, 1), (1, args.tp), (args.tp, max(1, cores // args.tp))]
            for tp, threads in configs:
                r = run(model, tp, threads, args)
                rows.append(r)
                print(
                    f"{r['model']:>8} tp={tp} threads/rank={threads}: {r['output_tokens_per_s']:8.1f} tok/s "
                    f"{r['ms_per_step']:8.2f} ms/step {r['all_reduces_per_step']:5.1f} all-reduces "
                    f"{r['all_reduced_bytes_per_step']:>9} B/step",
                    flush=True,
                )
            same = {json.dumps(r["outputs"]) for r in rows if r["model"] == rows[-1]["model"]}
            print(f"{rows[-1]['model']}: greedy outputs equal across the runs: {len(same) == 1}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    first: dict[str, Any] = {}
    for r in rows:  # the token ids themselves are not kept, only whether they equal TP 1's
        outs = r.pop("outputs")
        r["outputs_equal_first_run"] = first.setdefault(r["model"], outs) == outs
    result = {"cores": cores, "load_avg_1m_after": round(load, 2), "args": vars(args), "runs": rows}
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
