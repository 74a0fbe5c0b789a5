"""Stop strings: what the detokenizer costs per token as the output grows.

    .venv/bin/python benches/bench_stop_strings.py [--lengths 1000,5000,20000] [--tokens 500]
        [--num-stop 16] [--stop-len 2048] [--repeats 3] [--baseline-rev REV] [--result-file F]

Each case streams one sequence through `IncrementalDetokenizer.add_tokens` one token at a time,
as the output processor does, with `--num-stop` stop strings of `--stop-len` characters (default:
16 at `MAX_STOP_STR_LEN`, the most a request may send). The output is first brought to each
length of `--lengths` (characters) in one call, then `--tokens` single-token calls are timed one
by one; the table gives the median, the 90th percentile and the largest per token, in CPU time of
the thread (the machines this runs on are shared: a wall-clock maximum is mostly the time the
process waited for a core). Each case runs `--repeats` times; the run with the lowest median counts
(the others were slowed down by neighbours). The decoder is a fixed
table of 4-character pieces, so the figures are the detokenizer's own work (windowed decode,
stop search, hold-back), not a tokenizer's.

Two outputs:
- `random`: random text over 9 characters, stop strings random over the same ones (they never
  occur): nothing is held back for long.
- `periodic`: the output repeats "abcd"; each stop string is that period up to its last
  character, which differs, so the output always ends in a long prefix of every stop string:
  about `--stop-len` characters are held back at every token and the prefix keeps changing.
- `breaking`: the same, but one token in 100 (at random) is "abcZ", which breaks the partial
  match: the automaton walks back down its failure links at that token, and the held-back text
  is released.

`--baseline-rev REV` also runs the detokenizer of git revision REV
(`git show REV:python/hybridserve/engine/detokenizer.py`) on the same cases, to compare.
The setup column is the construction of the detokenizer and its first call (what a request costs
once).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.sampling.params import MAX_STOP_STR_LEN

DETOKENIZER_PATH = "python/hybridserve/engine/detokenizer.py"
PIECE = 4  # characters per token
ALPHABET = "abcdefgh "


class Pieces:
    """Token id i decodes to PIECES[i]: fixed-width pieces, no byte-level subtleties."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join([self.pieces[i] for i in ids])


def case(kind: str, num_stop: int, stop_len: int, seed: int) -> tuple[Pieces, list[str], Callable[[], int]]:
    """(decoder, stop strings, next token id) for one kind of output."""
    rng = random.Random(seed)
    if kind == "random":
        pieces = ["".join(rng.choice(ALPHABET) for _ in range(PIECE)) for _ in range(256)]
        stop = ["".join(rng.choice(ALPHABET) for _ in range(stop_len)) for _ in range(num_stop)]
        return Pieces(pieces), stop, lambda: rng.randrange(len(pieces))
    period = "abcd"
    body = (period * (stop_len // len(period) + 1))[: stop_len - 1]
    # distinct last characters that never occur in the output: the strings never complete
    stop = [body + chr(0x4E00 + i) for i in range(num_stop)]
    if kind == "periodic":
        return Pieces([period]), stop, lambda: 0
    return Pieces([period, "abcZ"]), stop, lambda: int(rng.random() < 0.01)


def load_detokenizer(rev: str) -> type[Any]:
    """IncrementalDetokenizer as it was at git revision `rev`."""
    src = subprocess.run(
        ["git", "show", f"{rev}:{DETOKENIZER_PATH}"], check=True, capture_output=True, text=True
    ).stdout
    mod = types.ModuleType(f"detokenizer_at_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses looks the module up
    exec(compile(src, f"{rev}:{DETOKENIZER_PATH}", "exec"), mod.__dict__)
    cls: type[Any] = mod.IncrementalDetokenizer
    return cls


def measure(
    cls: type[Any], kind: str, length: int, tokens: int, num_stop: int, stop_len: int
) -> dict[str, float]:
    dec, stop, next_id = case(kind, num_stop, stop_len, seed=length)
    t0 = time.thread_time_ns()
    d = cls(dec, stop=stop)
    d.add_tokens([next_id()])
    setup = (time.thread_time_ns() - t0) / 1e9
    d.add_tokens([next_id() for _ in range(length // PIECE)])
    d.add_tokens([next_id()])  # the first call after a long one decodes its whole window
    times = []
    for _ in range(tokens):
        t = next_id()
        t0 = time.thread_time_ns()
        d.add_tokens([t])
        times.append((time.thread_time_ns() - t0) / 1e9)
    assert d.stopped_by is None, "a stop string matched: the case measures nothing"
    times.sort()
    return {
        "setup_us": setup * 1e6,
        "median_us": statistics.median(times) * 1e6,
        "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6,
        "max_us": times[-1] * 1e6,
        "text_chars": float(len(d.text)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1000,5000,20000", help="output lengths in characters")
    ap.add_argument("--tokens", type=int, default=500, help="timed single-token calls per case")
    ap.add_argument("--num-stop", type=int, default=16)
    ap.add_argument("--stop-len", type=int, default=MAX_STOP_STR_LEN)
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the lowest median counts")
    ap.add_argument("--kinds", default="random,periodic,breaking")
    ap.add_argument("--baseline-rev", default=None, help="also run the detokenizer of this git revision")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    impls: dict[str, type[Any]] = {"current": IncrementalDetokenizer}
    if args.baseline_rev:
        impls[args.baseline_rev] = load_detokenizer(args.baseline_rev)
    rows = []
    print(f"{args.num_stop} stop strings of {args.stop_len} characters, {PIECE} characters per token")
    print("| output | chars | implementation | per token, median | p90 | max | setup |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for length in lengths:
            for name, cls in impls.items():
                runs = [
                    measure(cls, kind, length, args.tokens, args.num_stop, args.stop_len)
                    for _ in range(args.repeats)
                ]
                r = min(runs, key=lambda run: run["median_us"])
                rows.append({"kind": kind, "length": length, "impl": name, **r})
                print(
                    f"| {kind} | {length} | {name} | {r['median_us']:.1f} µs | {r['p90_us']:.1f} µs "
                    f"| {r['max_us']:.0f} µs | {r['setup_us']:.0f} µs |",
                    flush=True,
                )
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
