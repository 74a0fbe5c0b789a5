"""What a prefill step costs when the engine was idle just before it, against one that follows
another step at once: the server's requests arrive after such gaps (one request at a time, or a
conversation's next turn after its think time).

    .venv/bin/python benches/step_after_idle.py [--prompt-lens 4,180] [--gaps 0,0.01] [--steps 200]
        [--model demo]

`LLM(MODEL, dtype="float32", cpu_threads=1)` (MODEL: the demo model, or a checkpoint folder with
the demo's vocabulary, such as benches/wide_demo.py writes). For each prompt length and gap: `--steps` times,
the thread sleeps the gap (seconds; with a gap written `spin:0.01` it runs a Python loop that
long instead, keeping its core), then one prompt of random token ids (seeded) is added and one
engine step (its whole prefill, one sampled token) is timed in wall time, and then a second
prompt of the same length at once ("right after a step"). Gaps take
turns, so a slower spell of a shared machine falls on all of them. Printed: p10 / p50 / p90 of the
step (ms) per prompt length and gap.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from hybridserve import LLM, SamplingParams  # noqa: E402


def wait(gap: str) -> None:
    if gap.startswith("spin:"):
        end = time.perf_counter() + float(gap.removeprefix("spin:"))
        while time.perf_counter() < end:
            pass
    elif float(gap) > 0:
        time.sleep(float(gap))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", default="4,180")
    ap.add_argument("--gaps", default="0.01,spin:0.01")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="demo")
    args = ap.parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    gaps = args.gaps.split(",")
    llm = LLM(args.model, dtype="float32", cpu_threads=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)
    times: dict[tuple[int, str], list[float]] = {}

    def step(key: tuple[int, str], n: int, record: bool) -> None:
        engine.add_request(
            f"{key}-{len(times.get(key, []))}-{rng.random()}",
            [rng.randrange(10, 700) for _ in range(n)],
            params,
        )
        t0 = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - t0
        assert outs and outs[0].finished
        if record:
            times.setdefault(key, []).append(took * 1e3)

    for i in range(args.steps + 10):  # the first 10 rounds warm up
        for n in lens:
            for g in gaps:
                wait(g)
                step((n, f"after {g}"), n, i >= 10)
                step((n, "right after a step"), n, i >= 10)  # the same length, at once
    print("prompt tokens | before the step | step ms p10 / p50 / p90")
    for (n, g), ts in sorted(times.items()):
        ts.sort()
        k = len(ts)
        print(f"{n:13d} | {g:>18s} | {ts[k // 10]:.2f} / {ts[k // 2]:.2f} / {ts[k * 9 // 10]:.2f}")


if __name__ == "__main__":
    main()
