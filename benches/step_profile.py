"""Where one engine step's time goes: the phases of `LLMEngine.step` timed on every step.

    .venv/bin/python benches/step_profile.py [--batch 1,64] [--prompt-len 256] [--output-len 128]
        [--model demo] [--repeats 3] [--result-file F] [--overlapped] [--temperature 0] [--top-p 1]
        [--repetition-penalty 1]

For each batch size: `LLM(model, dtype="float32", cpu_threads=1, async_scheduling=False)`
generates `batch` prompts of
random token ids (seeded), greedy (or with `--temperature`, `--top-p`, `--repetition-penalty`, every request seeded as
the engine seeds them), exactly `output-len` tokens each; the run is warmed up, then
repeated. Every step is split into phases, each timed in thread CPU time (the machine may be
shared: CPU time of the engine's thread is what the code costs) and in wall time:

- schedule: the Rust scheduler's `schedule()`;
- inputs: the runner's copies and the forward batch built from the scheduler's arrays
  (`to_forward_batch`);
- forward: the model (`model.forward`, or for a step of one-token decode rows the native decode
  step, `DecodeStep.run`, when it applies);
- sample: sampling and the proposer (`ModelRunner._sample`, `_propose`);
- update: the scheduler's `update_from_output`;
- outputs: detokenizing and request outputs (`OutputProcessor.process`);
- rest: everything else of `step()` and of the `generate` loop around it.

Printed per batch size: microseconds per step per phase (median over steps of the best repeat),
the share outside the forward, and tokens/s of the whole run (prompt + output tokens over wall).

`--overlapped`: the same run with `async_scheduling=True`, where a decode step computes on the
native library's background thread while the engine thread builds the previous step's outputs
and plans the next step. The phases are then wall time on the engine thread, and "forward" is
the part of the forward the engine thread waits for (`PendingDecode.wait`, or the forward run in
the engine thread); what it does while the forward runs is off the step's critical path. The
plan of a step made ahead counts as "schedule" (`schedule_ahead`), its confirmation as "update"
(`confirm_ahead`), its prepared native call as "inputs". Also printed: "between forwards", the
median wall time from the end of one background forward's wait to the return of the next one's
post (the critical path the overlap leaves). `HYBRIDSERVE_PLAN_AHEAD=0` measures the same without
steps planned ahead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

PHASES = ("schedule", "inputs", "forward", "sample", "update", "outputs", "rest")


class PhaseClock:
    """Per-step sums of thread CPU and wall nanoseconds, by phase."""

    def __init__(self) -> None:
        self.steps: list[dict[str, tuple[int, int]]] = []
        self.current: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        cur = self.current

        def timed(*a: Any, **k: Any) -> Any:
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                acc = cur[phase]
                acc[0] += time.thread_time_ns() - c0
                acc[1] += time.perf_counter_ns() - w0

        setattr(obj, name, timed)

    def wrap_step(self, engine: Any) -> None:
        step = engine.step

        def timed_step() -> Any:
            self.current.clear()
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            out = step()
            cpu, wall = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
            phases = {p: (v[0], v[1]) for p, v in self.current.items()}
            # the runner's execute contains the forward and sampling: its own part is "inputs"
            ex = phases.pop("execute", (0, 0))
            inner = [phases.get(p, (0, 0)) for p in ("forward", "sample")]
            phases["inputs"] = (ex[0] - sum(i[0] for i in inner), ex[1] - sum(i[1] for i in inner))
            phases["rest"] = (
                cpu - sum(v[0] for v in phases.values()),
                wall - sum(v[1] for v in phases.values()),
            )
            self.steps.append(phases)
            return out

        engine.step = timed_step


class TimedScheduler:
    """The Rust scheduler (an extension object, whose methods cannot be replaced) behind a proxy
    that times `schedule` and `update_from_output`."""

    def __init__(self, inner: Any, clock: PhaseClock) -> None:
        self._inner = inner
        clock.wrap(self, "_schedule", "schedule")
        clock.wrap(self, "_update", "update")
        clock.wrap(self, "_schedule_ahead", "schedule")
        clock.wrap(self, "_confirm_ahead", "update")

    def _schedule(self) -> Any:
        return self._inner.schedule()

    def _update(self, *a: Any) -> Any:
        return self._inner.update_from_output(*a)

    def _schedule_ahead(self) -> Any:
        return self._inner.schedule_ahead()

    def _confirm_ahead(self, *a: Any) -> Any:
        return self._inner.confirm_ahead(*a)

    def schedule(self) -> Any:
        return self._schedule()

    def update_from_output(self, *a: Any) -> Any:
        return self._update(*a)

    def schedule_ahead(self) -> Any:
        return self._schedule_ahead()

    def confirm_ahead(self, *a: Any) -> Any:
        return self._confirm_ahead(*a)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BetweenForwards:
    """The wall time from the end of each background forward's wait to the return of the next
    post (overlapped steps): what of a step the overlap leaves between two forwards."""

    def __init__(self, decode_step: Any) -> None:
        from hybridserve.model.decode_step import PendingDecode

        self.gaps: list[int] = []
        self._waited: int | None = None
        if decode_step is None:
            return
        wait, post = PendingDecode.wait, decode_step.post

        def timed_wait(pending: Any) -> Any:
            got = wait(pending)
            self._waited = time.perf_counter_ns()
            return got

        def timed_post(call: Any) -> Any:
            got = post(call)
            if got is not None and self._waited is not None:
                self.gaps.append(time.perf_counter_ns() - self._waited)
            self._waited = None
            return got

        PendingDecode.wait = timed_wait  # type: ignore[method-assign]
        decode_step.post = timed_post


def run(
    model: str,
    batch: int,
    prompt_len: int,
    output_len: int,
    repeats: int,
    overlapped: bool,
    temperature: float = 0.0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
) -> dict[str, Any]:
    from hybridserve import LLM, SamplingParams
    from hybridserve.model.decode_step import PendingDecode

    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 700) for _ in range(prompt_len)] for _ in range(batch)]
    llm = LLM(
        model=model, dtype="float32", cpu_threads=1, max_num_seqs=max(batch, 1), async_scheduling=overlapped
    )
    params = SamplingParams(
        max_tokens=output_len,
        temperature=temperature,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        ignore_eos=True,
    )
    engine = llm.engine
    real_wait = PendingDecode.wait  # (wrapped below for this run only)
    try:
        return _profile(llm, engine, prompts, params, batch, prompt_len, output_len, repeats)
    finally:
        PendingDecode.wait = real_wait  # type: ignore[method-assign]


def _profile(
    llm: Any,
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    batch: int,
    prompt_len: int,
    output_len: int,
    repeats: int,
) -> dict[str, Any]:
    from hybridserve.model.decode_step import PendingDecode

    generate: Callable[[], Any] = lambda: llm.generate(prompts, params)  # noqa: E731
    generate()
    generate()
    clock = PhaseClock()
    runner = engine.runner
    engine.scheduler = TimedScheduler(engine.scheduler, clock)
    clock.wrap(runner, "start", "execute")
    clock.wrap(runner, "finish", "execute")
    clock.wrap(runner, "prepare", "execute")
    clock.wrap(runner, "start_prepared", "execute")
    gaps = BetweenForwards(runner.decode_step)
    clock.wrap(runner.em.model, "forward", "forward")
    if runner.decode_step is not None:  # the whole forward of a decode step in one native call
        clock.wrap(runner.decode_step, "run", "forward")
        clock.wrap(PendingDecode, "wait", "forward")  # (overlapped: the wait for it)
    clock.wrap(runner, "_sample", "sample")
    clock.wrap(runner, "_propose", "sample")
    clock.wrap(engine.outputs, "process", "outputs")
    clock.wrap_step(engine)
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        clock.steps.clear()
        gaps.gaps.clear()
        planned_before = engine.stats()["num_planned_steps"]
        t0 = time.perf_counter()
        outs = generate()
        wall = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        per_phase = {
            p: (
                statistics.median(s.get(p, (0, 0))[0] for s in clock.steps) / 1e3,
                statistics.median(s.get(p, (0, 0))[1] for s in clock.steps) / 1e3,
            )
            for p in PHASES
        }
        r = {
            "batch": batch,
            "steps": len(clock.steps),
            "wall_s": wall,
            "tok_per_s": batch * (prompt_len + output_len) / wall,
            "us_per_step_cpu": {p: v[0] for p, v in per_phase.items()},
            "us_per_step_wall": {p: v[1] for p, v in per_phase.items()},
            "num_planned_steps": engine.stats()["num_planned_steps"] - planned_before,
            "us_between_forwards": statistics.median(gaps.gaps) / 1e3 if gaps.gaps else None,
        }
        if best is None or wall < best["wall_s"]:
            best = r
    assert best is not None
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--overlapped", action="store_true", help="async_scheduling=True; phases in wall time")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    a = ap.parse_args()
    results = [
        run(
            a.model,
            int(b),
            a.prompt_len,
            a.output_len,
            a.repeats,
            a.overlapped,
            a.temperature,
            a.top_p,
            a.repetition_penalty,
        )
        for b in a.batch.split(",")
    ]
    print(
        "| batch | tok/s | " + " | ".join(PHASES) + " | outside forward | step | between forwards | planned |"
    )
    print("|---|---|" + "---|" * (len(PHASES) + 4))
    for r in results:
        cpu = r["us_per_step_wall" if a.overlapped else "us_per_step_cpu"]
        total = sum(cpu.values())
        row = " | ".join(f"{cpu[p]:.0f}" for p in PHASES)
        gap = "" if r["us_between_forwards"] is None else f"{r['us_between_forwards']:.0f}"
        print(
            f"| {r['batch']} | {r['tok_per_s']:.0f} | {row} | {total - cpu['forward']:.0f} | {total:.0f} "
            f"| {gap} | {r['num_planned_steps']} of {r['steps']} |"
        )
    print(f"(median microseconds of {'wall' if a.overlapped else 'thread CPU'} time per step)")
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
