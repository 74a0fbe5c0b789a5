"""The sampler alone: microseconds per `Sampler.sample` call for a batch of random rows.

    .venv/bin/python benches/sampler_bench.py [--batch 1,8,64] [--vocab 795,32000,131072]
        [--spread 1,5] [--repeats 20] [--result-file F]

For each vocabulary size, batch size and logit spread: `batch` rows of logits drawn as
N(0, spread^2) (spread 1: a flat distribution where top-p keeps a large part of the
vocabulary; spread 5: a peaked one, closer to a trained model's), every row seeded (the engine
seeds every request) and sampled with each setting below; one thread, float32. The median of
`repeats` calls after two warm-up calls.

Settings: temperature 0.8 alone; with top_p 0.95; with top_k 50.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

SETTINGS = {
    "temperature 0.8": {"temperature": 0.8},
    "+ top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "+ top_k 50": {"temperature": 0.8, "top_k": 50},
}


def main() -> int:
    import torch

    from hybridserve.sampling.params import SamplingParams
    from hybridserve.sampling.sampler import RowSampling, Sampler

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--vocab", default="795,32000,131072")
    ap.add_argument("--spread", default="1,5")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    sampler = Sampler()
    results = []
    print("| vocab | batch | spread | " + " | ".join(SETTINGS) + " |")
    print("|---|---|---|" + "---|" * len(SETTINGS))
    for vocab in (int(v) for v in a.vocab.split(",")):
        for batch in (int(b) for b in a.batch.split(",")):
            for spread in (float(s) for s in a.spread.split(",")):
                g = torch.Generator().manual_seed(vocab + batch)
                logits = torch.randn(batch, vocab, generator=g) * spread
                cells = []
                for name, kw in SETTINGS.items():
                    params = SamplingParams(max_tokens=16, **kw)
                    rows = [
                        RowSampling(params, seed=1000 + i, output_token_ids=[0] * 7) for i in range(batch)
                    ]
                    for _ in range(2):
                        sampler.sample(logits, rows)
                    times = []
                    for _ in range(a.repeats):
                        t = time.perf_counter()
                        sampler.sample(logits, rows)
                        times.append(time.perf_counter() - t)
                    us = statistics.median(times) * 1e6
                    cells.append(us)
                    results.append(
                        {"vocab": vocab, "batch": batch, "spread": spread, "setting": name, "us": us}
                    )
                print(f"| {vocab} | {batch} | {spread:g} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print("(median microseconds per Sampler.sample call)")
    if a.result_file:
        Path(a.result_file).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
