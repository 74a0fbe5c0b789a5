"""Structured outputs: what the grammar mask costs per decode step.

    .venv/bin/python benches/bench_grammar_mask.py [--batch 64] [--steps 200] [--drafts 3]
        [--result-file F]

A batch of `--batch` requests of the demo model decodes under a JSON schema (the one of
tests/engine/test_structured_outputs.py) one step at a time: each step samples one token per row
with `Sampler.sample` from the logits of real demo-model steps (captured once, so the figures are
the sampler's, not the model's), and advances every row's matcher over its token, as the engine
does. A row whose output is complete starts again from the beginning (a fresh copy of the compiled
grammar), so the batch stays full. Timed per step (wall clock, median and p90 over `--steps`):

- `mask`: computing the 64 bitmasks (llguidance's executor) and unpacking them to a bool tensor;
- `sample`: `Sampler.sample` with the masks applied, greedy and at temperature 1 (seeded rows);
- `sample, no grammar`: the same logits and rows without a grammar (what a step costs without);
- `advance`: the matchers' `accept` of the sampled tokens (the output processor's share);
- `verify mask`: with `--drafts` K, the masks of a verify step (1 + K per row: the matcher walks
  over the drafts and is rolled back), drafts taken from the sampled continuation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hybridserve.engine.grammar_compiler import GrammarCompiler
from hybridserve.engine.llm import LLM
from hybridserve.sampling.grammar import GrammarMatcher, grammar_bitmask, row_masks
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.sampler import RowSampling, Sampler
from hybridserve.sampling.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()

    llm = LLM("demo", dtype="float32")
    engine = llm.engine
    tok = engine.tokenizer  # type: ignore[attr-defined]
    compiler = GrammarCompiler(tok.to_json(), engine.vocab_size, engine.eos_token_id)  # type: ignore[attr-defined]
    ticket = compiler.submit(StructuredOutputsParams(json=SCHEMA))
    ticket.wait(60)

    def fresh() -> GrammarMatcher:
        m = ticket.poll()
        assert isinstance(m, GrammarMatcher)
        return m

    # logits of real decode steps of the demo model (a batch of plain requests), reused in turn
    logits_pool: list[torch.Tensor] = []
    runner = engine.runner  # type: ignore[attr-defined]
    original = runner._sample

    def capture(out, rows, logits, result):  # noqa: ANN001, ANN202
        if logits.shape[0] >= a.batch:
            logits_pool.append(logits[: a.batch].clone())
        return original(out, rows, logits, result)

    runner._sample = capture
    llm.generate(["x"] * a.batch, SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=1))
    runner._sample = original
    # for scale: a whole engine step of the demo model at this batch (decode steps, no grammar)
    steps_before = engine.stats()["num_steps"]
    t0 = time.perf_counter()
    llm.generate(["y"] * a.batch, SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0, seed=2))
    step_ms = (time.perf_counter() - t0) / (engine.stats()["num_steps"] - steps_before) * 1e3
    vocab = logits_pool[0].shape[1]
    sampler = Sampler()
    results: dict[str, dict[str, float]] = {}
    for temperature in (0.0, 1.0):
        matchers = [fresh() for _ in range(a.batch)]
        outputs: list[list[int]] = [[] for _ in range(a.batch)]
        t_mask, t_sample, t_plain, t_adv, t_verify = [], [], [], [], []
        params = SamplingParams(temperature=temperature, max_tokens=1000)
        for step in range(a.steps):
            logits = logits_pool[step % len(logits_pool)]
            rows = [
                RowSampling(params=params, seed=i, output_token_ids=outputs[i], grammar=matchers[i])
                for i in range(a.batch)
            ]
            plain = [RowSampling(params=params, seed=i, output_token_ids=outputs[i]) for i in range(a.batch)]
            t0 = time.perf_counter()
            row_masks(matchers, vocab, logits.device)
            t1 = time.perf_counter()
            tokens = sampler.sample(logits, rows).token_ids.tolist()
            t2 = time.perf_counter()
            sampler.sample(logits, plain)
            t3 = time.perf_counter()
            if a.drafts:
                # drafts: each row's own next tokens from a copy (half of them valid, then anything)
                drafts = [
                    [tokens[i]] + [tokens[(i + j) % a.batch] for j in range(1, a.drafts)]
                    for i in range(a.batch)
                ]
                t4 = time.perf_counter()
                grammar_bitmask(matchers, drafts)
                t_verify.append(time.perf_counter() - t4)
            t5 = time.perf_counter()
            for i, m in enumerate(matchers):
                m.accept([tokens[i]])
                outputs[i].append(tokens[i])
            t6 = time.perf_counter()
            for i, m in enumerate(matchers):
                if m.is_terminated() or tokens[i] == engine.eos_token_id:
                    matchers[i], outputs[i] = fresh(), []
            t_mask.append(t1 - t0)
            t_sample.append(t2 - t1)
            t_plain.append(t3 - t2)
            t_adv.append(t6 - t5)
        name = "greedy" if temperature == 0.0 else "temperature 1"
        results[f"{name}: mask"] = _stats(t_mask)
        results[f"{name}: sample (mask included)"] = _stats(t_sample)
        results[f"{name}: sample, no grammar"] = _stats(t_plain)
        results[f"{name}: advance"] = _stats(t_adv)
        if t_verify:
            results[f"{name}: verify mask (K={a.drafts})"] = _stats(t_verify)
    print(
        f"batch {a.batch}, vocabulary {vocab}, {a.steps} steps; a whole engine step: {step_ms:.2f} ms; per step:"
    )
    for k, v in results.items():
        print(f"  {k:40s} median {v['median_ms']:7.3f} ms   p90 {v['p90_ms']:7.3f} ms")
    if a.result_file:
        Path(a.result_file).write_text(
            json.dumps(
                {"batch": a.batch, "vocab": vocab, "engine_step_ms": step_ms, "results": results}, indent=2
            )
        )
    compiler.shutdown()


if __name__ == "__main__":
    main()
