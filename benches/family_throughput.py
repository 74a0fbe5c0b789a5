"""Throughput of each newer model family on the CPU: hybridserve vs transformers' `generate`.

    .venv/bin/python benches/family_throughput.py [--families jamba zamba2 falcon_h1 granitemoehybrid
        bamba mamba2] [--num-prompts 16 --prompt-len 128 --output-len 64 --threads 1 --repeats 2]
        [--per-op] [--result-file F]

Per family, a random checkpoint of 20M to 50M parameters written by transformers (shapes in
`FAMILIES`: hidden 512, 8 layers, vocabulary 4096, the family's own mixers, MoE and attention layout), float32, and
the same prompts (random token ids, seeded) for both, greedy, exactly `output-len` new tokens each:

- hybridserve: `LLM(checkpoint, dtype="float32", max_num_seqs=num_prompts,
  async_scheduling=False)` (synchronous steps) with its defaults otherwise (prefix caching, chunked prefill), the C++ CPU kernels (and the native decode step for the
  families it runs: Bamba, Mamba2); with `--per-op`, also `hybridserve_per_op`, the same with
  every step through the per-op forward;
- transformers: one left-padded batch with an attention mask, cache on, eager expert loops (the
  default grouped-GEMM experts are no faster here); its Mamba paths are its own pure-torch
  fallbacks (no `mamba_ssm` / `causal_conv1d` on a CPU).

Both are built and warmed up on the whole workload first; then the timed runs alternate
(hybridserve, transformers, ...) `--repeats` times and the fastest of each counts; tok/s = output
tokens / wall time. Also reported: how many greedy outputs are identical between the two (random
models have small logit margins: float32 rounding of two batch layouts can flip a late token).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 4096

# transformers config fields of each family's benchmark checkpoint
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=4,
            attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16,
        ),
    ),
    "zamba2": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
            n_mamba_heads=16, mamba_d_state=64, num_mem_blocks=1, adapter_rank=32,
            layers_block_type=["mamba", "mamba", "hybrid", "mamba", "mamba", "mamba", "hybrid", "mamba"],
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, mamba_n_heads=16, mamba_d_head=64, mamba_d_ssm=1024, mamba_d_state=64,
        ),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            hidden_size=512, intermediate_size=512, shared_intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64,
            layer_types=["mamba", "mamba", "mamba", "attention"] * 2,
        ),
    ),
    # the families the native decode step runs (model/decode_step.py), beside Nemotron-H
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, attn_layer_indices=[3, 7], mamba_n_heads=16, mamba_d_head=64,
            mamba_d_state=64, mamba_n_groups=1,
        ),
    ),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(hidden_size=512, num_hidden_layers=8, num_heads=16, head_dim=64, state_size=64, n_groups=1, expand=2),
    ),
}  # fmt: skip

Timed = tuple[float, list[list[int]]]  # wall s, output tokens per prompt


def write_checkpoint(family: str, root: Path) -> Path:
    import torch
    import transformers

    cfg_name, model_name, fields = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=0, **fields
    )
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # peaked next-token distributions (HF's 0.02 init gives near-uniform ones)
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    d = root / family
    model.save_pretrained(str(d))
    if family == "zamba2":
        # transformers' Zamba2 clamps dt to time_step_min in its prefill path only, hybridserve in
        # both: with no clamp the two compute the same model (make_transformers lifts its clamp)
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, "time_step_min": 0.0}, indent=2))
    from tokenizers import Tokenizer, models, pre_tokenizers

    # the engine needs a tokenizer.json; the prompts are token ids, so any vocabulary will do
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def _timed(fn: Callable[[], list[list[int]]]) -> Timed:
    t0 = time.perf_counter()
    toks = fn()
    return time.perf_counter() - t0, toks


def make_hybridserve(
    model: Path, prompts: list[list[int]], output_len: int, decode_step: bool = True
) -> Callable[[], Timed]:
    import os

    from hybridserve import LLM, SamplingParams

    # `decode_step=False`: every step through the per-op forward (HYBRIDSERVE_DECODE_STEP=0)
    before = os.environ.get("HYBRIDSERVE_DECODE_STEP")
    os.environ["HYBRIDSERVE_DECODE_STEP"] = "1" if decode_step else "0"
    try:
        # synchronous steps: no core beyond the contestant's
        llm = LLM(str(model), dtype="float32", max_num_seqs=len(prompts), seed=0, async_scheduling=False)
    finally:
        if before is None:
            del os.environ["HYBRIDSERVE_DECODE_STEP"]
        else:
            os.environ["HYBRIDSERVE_DECODE_STEP"] = before
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, params)  # warm-up

    def run() -> list[list[int]]:
        # no run hits the prefixes the run before it cached: transformers has no such cache
        llm.engine.reset_prefix_cache()
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]

    return lambda: _timed(run)


def make_transformers(model: Path, prompts: list[list[int]], output_len: int) -> Callable[[], Timed]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model))
    zamba2 = cfg.model_type == "zamba2"
    if zamba2:  # its weight init takes the log of time_step_min: load with the default ...
        cfg.time_step_min = 1e-3
    hf = AutoModelForCausalLM.from_pretrained(str(model), config=cfg, dtype=torch.float32).eval()
    for m in hf.modules():
        if zamba2 and hasattr(m, "time_step_limit"):  # ... then lift the clamp (write_checkpoint)
            m.time_step_limit = (0.0, float("inf"))
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def gen() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=0, use_cache=True)  # fmt: skip
        return [row[width:].tolist() for row in out]

    gen()  # warm-up
    return lambda: _timed(gen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--per-op",
        action="store_true",
        help="also run hybridserve with every step through the per-op forward (no native decode step)",
    )
    ap.add_argument(
        "--result-file", type=Path, default=ROOT / "benches" / "results" / "family_throughput.json"
    )
    a = ap.parse_args()

    import torch
    import transformers
    from safetensors.torch import load_file

    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(a.prompt_len)] for _ in range(a.num_prompts)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in a.families:
            model = write_checkpoint(fam, Path(tmp))
            params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
            runs: dict[str, list[Timed]] = {"hybridserve": [], "transformers": []}
            makers: dict[str, Callable[..., Callable[[], Timed]]] = {
                "hybridserve": make_hybridserve,
                "transformers": make_transformers,
            }
            if a.per_op:
                runs["hybridserve_per_op"] = []
                makers["hybridserve_per_op"] = lambda *x: make_hybridserve(*x, decode_step=False)
            once = {name: make(model, prompts, a.output_len) for name, make in makers.items()}
            for _ in range(a.repeats):
                for name in runs:
                    runs[name].append(once[name]())
            best = {name: min(r, key=lambda t: t[0]) for name, r in runs.items()}
            n = a.num_prompts * a.output_len
            same = sum(x == y for x, y in zip(best["hybridserve"][1], best["transformers"][1]))
            if a.per_op:  # the two hybridserve paths give the same greedy outputs?
                row_extra = {
                    "identical_per_op": sum(
                        x == y for x, y in zip(best["hybridserve"][1], best["hybridserve_per_op"][1])
                    )
                }
            else:
                row_extra = {}
            row = {
                "parameters": params,
                **{f"{name}_tok_per_s": n / b[0] for name, b in best.items()},
                **{f"{name}_all_wall_s": [t[0] for t in r] for name, r in runs.items()},
                "ratio": best["transformers"][0] / best["hybridserve"][0],
                "identical_outputs": same,
                **row_extra,
            }
            results[fam] = row
            print(
                f"{fam:18s} {params / 1e6:5.1f}M params  hybridserve {row['hybridserve_tok_per_s']:7.1f} tok/s  "
                f"transformers {row['transformers_tok_per_s']:7.1f} tok/s  {row['ratio']:.2f}x  "
                f"identical {same}/{a.num_prompts}",
                flush=True,
            )
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "threads": a.threads,
        "transformers": transformers.__version__,
        "workload": {"num_prompts": a.num_prompts, "prompt_len": a.prompt_len, "output_len": a.output_len},
        "results": results,
    }
    a.result_file.parent.mkdir(parents=True, exist_ok=True)
    a.result_file.write_text(json.dumps(out, indent=2) + "\n")
    print(f"results: {a.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
