"""A prefill step through the model's per-op forward against the native step (model/decode_step.py),
and which of the two the engine takes (`MAX_PREFILL_MACS`).

    .venv/bin/python benches/native_prefill.py [--cached 0,1500,2600] [--new 16,32,64,96,128,192]
        [--repeats 9] [--model demo] [--result-file F]

One request on the model (float32, one thread): for each number of cached tokens, that many
random tokens (seeded) are prefilled first; then a prefill row of `--new` tokens after them is
timed `--repeats` times through each path, taking turns (each run rewrites the same K / V and
state slots). Printed: the median wall time of each path (ms), their difference, the row's work
as the native step counts it (projection and attention multiply-adds) and the path the engine
takes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from hybridserve.kernels import backend  # noqa: E402
from hybridserve.kernels.backend import Backend  # noqa: E402
from hybridserve.model.batch import ForwardBatch  # noqa: E402
from hybridserve.model.cache_tensors import ModelCaches  # noqa: E402
from hybridserve.model.decode_step import MAX_PREFILL_MACS, DecodeStep  # noqa: E402
from hybridserve.model.demo import resolve_model_path  # noqa: E402
from hybridserve.model.loader import load_model  # noqa: E402

BLOCK = 16


def _batch(ids: list[int], start: int, blocks: int) -> tuple[ForwardBatch, Any]:
    """One prefill row of `ids` after `start` cached tokens (blocks 1.., state slot 1), as a
    ForwardBatch and as the scheduler output's numpy arrays."""
    n = len(ids)
    pos = list(range(start, start + n))
    table = [list(range(1, 1 + blocks))]

    def t(v: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(v, dtype=dtype)

    batch = ForwardBatch(
        input_ids=t(ids),
        positions=t(pos),
        query_start_loc=t([0, n]),
        num_computed_tokens=t([start]),
        seq_lens=t([start + n]),
        num_decodes=0,
        slot_mapping=t([table[0][p // BLOCK] * BLOCK + p % BLOCK for p in pos]),
        block_table=t(table),
        state_read_slot=t([1]),
        has_initial_state=t([start > 0], torch.bool),
        state_write_slots=t([[1]]),
        emit_row=t([]),
        emit_token=t([]),
        emit_slot=t([]),
        logits_indices=t([n - 1]),
    )
    names = (
        "input_ids", "positions", "slot_mapping", "block_table", "state_read_slot", "state_write_slots",
        "query_start_loc", "logits_indices", "has_initial_state", "emit_row", "emit_token", "emit_slot",
    )  # fmt: skip
    arrays = {k: np.ascontiguousarray(getattr(batch, k).numpy()) for k in names}
    return batch, type("Out", (), {"num_decodes": 0, **arrays})()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", default="0,1500,2600")
    ap.add_argument("--new", default="16,32,64,96,128,192")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend.pin(Backend.CPU_NATIVE)
    lm = load_model(resolve_model_path(args.model), torch.float32)
    cached = [int(x) for x in args.cached.split(",")]
    new = [int(x) for x in args.new.split(",")]
    longest = max(cached) + max(new)
    blocks = (longest + BLOCK - 1) // BLOCK
    caches = ModelCaches.for_model(lm.config, lm.dtype, 1 + blocks, BLOCK, 2, device=lm.device)
    unbounded = DecodeStep.for_model(lm.model, caches, max_tokens=longest, max_prefill_macs=None)
    engine = DecodeStep.for_model(lm.model, caches)
    if unbounded is None or engine is None:
        sys.exit("this model has no native step here")
    rng = np.random.default_rng(0)
    vocab = int(lm.config.vocab_size)
    rows = []
    print(f"native step's prefill limit: {MAX_PREFILL_MACS} multiply-adds")
    print("cached  new  work (M MACs)  forward ms  native ms  native - forward  engine takes")
    for c in cached:
        ids = rng.integers(3, vocab, c + max(new)).tolist()
        if c:
            with torch.inference_mode():
                lm.model(_batch(ids[:c], 0, blocks)[0], caches)
        for n in new:
            batch, out = _batch(ids[c : c + n], c, blocks)
            times: dict[str, list[float]] = {"forward": [], "native": []}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    lm.model(batch, caches)
                times["forward"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = unbounded.run(out)
                times["native"].append(time.perf_counter() - t0)
                assert got is not None
                unbounded.recycle(got)
            fwd, nat = (statistics.median(times[k]) * 1e3 for k in ("forward", "native"))
            pairs = n * c + n * (n + 1) // 2
            work = n * unbounded.macs_per_token + pairs * unbounded.macs_per_pair
            call = engine.prepare(out)
            takes = "forward" if call is None else "native"
            if call is not None:
                engine.recycle(call.output)
            print(
                f"{c:6d} {n:4d} {work / 1e6:14.1f} {fwd:11.2f} {nat:10.2f} {nat - fwd:+16.2f}  {takes}",
                flush=True,
            )
            rows.append(
                {
                    "cached": c,
                    "new": n,
                    "work_macs": work,
                    "forward_ms": fwd,
                    "native_ms": nat,
                    "takes": takes,
                }
            )
    if args.result_file:
        Path(args.result_file).write_text(
            json.dumps({"rows": rows, "limit": MAX_PREFILL_MACS}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
