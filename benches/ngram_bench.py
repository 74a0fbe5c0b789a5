"""The n-gram proposer's cost per engine step: microseconds to propose for a batch of requests
whose histories grow by one token a step, as the engine calls it.

    .venv/bin/python benches/ngram_bench.py [--batch 64] [--history 300,1500,6000] [--steps 20]

Each request has a prompt of `history` random token ids from a 795-token vocabulary (the demo
model's) and 50 output tokens; every step proposes 3 drafts for each, then appends one token to
each output. The engine's call is used when the proposer has it (`propose_histories`, the
request's own lists plus the step's token), else the whole history as one list per row
(`propose`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))


def run(length: int, batch: int, steps: int) -> float:
    """Microseconds per step for `batch` requests of `length` prompt tokens."""
    from hybridserve.spec_decode.ngram import NgramProposer

    rng = random.Random(length)
    proposer = NgramProposer(1, 4)
    ids = [f"r{i}" for i in range(batch)]
    prompts = [[rng.randrange(795) for _ in range(length)] for _ in range(batch)]
    outputs = [[rng.randrange(795) for _ in range(50)] for _ in range(batch)]
    kept = hasattr(proposer, "propose_histories")
    elapsed = 0.0
    for s in range(steps + 1):  # (the first step, which reads each history whole, is not timed)
        new = [[rng.randrange(795)] for _ in ids]
        t = time.perf_counter()
        if kept:
            from hybridserve.spec_decode.base import History

            histories = [History(p, o, n) for p, o, n in zip(prompts, outputs, new)]
            proposer.propose_histories(ids, histories, 3)
        else:
            proposer.propose([[*p, *o, *n] for p, o, n in zip(prompts, outputs, new)], 3)
        if s > 0:
            elapsed += time.perf_counter() - t
        for o, n in zip(outputs, new):
            o.extend(n)
    return elapsed / steps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--history", default="300,1500,6000")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    print("| history tokens | batch | µs per step |")
    print("|---|---|---|")
    for length in (int(h) for h in a.history.split(",")):
        print(f"| {length} | {a.batch} | {run(length, a.batch, a.steps):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
