"""hybridserve against llama.cpp on the same checkpoint and shapes, in one run.

    .venv/bin/python benches/llamacpp_compare.py [--batch 1,8,64] [--prompt-len 256] [--output-len 128]
        [--repeats 3] [--threads 1] [--model demo|nemotron-h-100m|DIR] [--work-dir DIR] [--result-file F]
        [--overlapped]

llama.cpp is a peer, never a dependency: everything it needs goes into a throw-away folder
(`--work-dir`, default `~/.cache/hybridserve-peers/llama.cpp-0.3.36`), built once and reused:

1. the source: the llama.cpp tree vendored in the `llama-cpp-python` 0.3.36 sdist from PyPI;
2. cmake and ninja from PyPI in a venv of their own; `llama-batched-bench` built with them
   (Release, GGML_NATIVE; about 20 minutes on 2 cores, once);
3. the checkpoint converted to GGUF f32 with the tree's own `convert_hf_to_gguf.py`, run under the
   transformers it was written for (4.57.6, in a venv of its own that borrows torch from .venv).
   Two metadata-only adjustments for the demo model: its byte-level BPE pre-tokenizer is not in the
   converter's table (it is labelled `gpt-2`, which splits text the same way), and the converter pads
   the token list of Nemotron-H to a multiple of 8 without padding the embedding (the padding entries
   are dropped). The weights are written as they are.

Then, for each batch size B, interleaved and repeated (the fastest run of each counts):

- hybridserve: `LLM(model, dtype="float32", cpu_threads=T, max_num_seqs=B,
  async_scheduling=False)`, B prompts of `prompt-len` random token ids, greedy, exactly
  `output-len` new tokens each (ignore_eos): one core, as llama.cpp with `-t T`;
- hybridserve overlapped (its own row, `--overlapped`): the same with `async_scheduling=True`,
  whose decode steps compute on a background thread while the engine builds the previous step's
  outputs on another core, so it uses T compute threads plus that one;
- llama.cpp: `llama-batched-bench -npp P -ntg G -npl B -t T -tb T -c B*(P+G) -ctk f32 -ctv f32
  -fa off -no-kvu` (f32 KV as hybridserve's; flash attention off: it rounds K/V to f16; a KV
  buffer per sequence, which is faster here than one shared buffer).

Reported: prompt + output tokens per second over the whole run for both (llama-batched-bench's
`S t/s` column: (P + G) * B over its total time) and the ratio hybridserve / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"
SDIST = "llama-cpp-python==0.3.36"
TRANSFORMERS_FOR_CONVERTER = "transformers==4.57.6"
DEFAULT_WORK = Path.home() / ".cache" / "hybridserve-peers" / "llama.cpp-0.3.36"

# Imported by the converter's venv: the two adjustments of the module docstring, then the converter.
CONVERT_RUNNER = r"""
import sys
from pathlib import Path

tree = Path(sys.argv.pop(1))
sys.path[:0] = [str(tree), str(tree / "gguf-py")]
import gguf
from conversion import base

real_vocab = int(sys.argv.pop(1))
_pre = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"  # plain byte-level BPE (the demo tokenizer's split)


base.TextModel.get_vocab_base_pre = get_vocab_base_pre

_add_list = gguf.GGUFWriter.add_token_list
_add_types = gguf.GGUFWriter.add_token_types
_add_scores = gguf.GGUFWriter.add_token_scores


def _cut(fn):
    return lambda self, values: fn(self, list(values)[:real_vocab])


gguf.GGUFWriter.add_token_list = _cut(_add_list)
gguf.GGUFWriter.add_token_types = _cut(_add_types)
gguf.GGUFWriter.add_token_scores = _cut(_add_scores)
_add_vocab_size = gguf.GGUFWriter.add_vocab_size
gguf.GGUFWriter.add_vocab_size = lambda self, n: _add_vocab_size(self, min(int(n), real_vocab))

sys.argv[0] = str(tree / "convert_hf_to_gguf.py")
import convert_hf_to_gguf

convert_hf_to_gguf.main()
"""


# The larger checkpoint (`--model nemotron-h-100m`): the demo model's config and tokenizer with
# wider and more layers, random weights (seed 0) written by transformers: 9 Mamba2, 3 attention and
# 9 MLP layers at hidden size 768, 89M parameters.
BIG_MODEL = "nemotron-h-100m"
BIG_CONFIG = {
    "hidden_size": 768,
    "hybrid_override_pattern": "M-M-M*-M-M-M*-M-M-M*-",
    "num_hidden_layers": 21,
    "intermediate_size": 3584,
    "mamba_num_heads": 24,
    "mamba_head_dim": 64,
    "ssm_state_size": 64,
    "n_groups": 2,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def big_checkpoint(work: Path, demo_dir: Path) -> Path:
    """The random ~100M-parameter Nemotron-H of BIG_CONFIG, written once into `work`."""
    out = work / BIG_MODEL
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = json.loads((demo_dir / "config.json").read_text())
    cfg.update(BIG_CONFIG)
    cfg.pop("layers_block_type", None)  # derived from the pattern
    cfg.pop("time_step_limit", None)  # written as JSON with an infinity the config class refuses
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**cfg)).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The config as the demo model writes it (a hybrid_override_pattern, which llama.cpp's converter
    # reads; transformers writes the per-layer list instead)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (demo_dir / name).exists():
            shutil.copy(demo_dir / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({n / 1e6:.1f}M parameters)", flush=True)
    return out


def _run(cmd: list[str], log: Path, **kw: Any) -> None:
    print(f"$ {' '.join(map(str, cmd))}", flush=True)
    with open(log, "a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, **kw)


def _venv(path: Path, log: Path, *packages: str, borrow: bool = False) -> Path:
    """A venv at `path` with `packages`; with `borrow`, .venv's packages are visible after its own."""
    py = path / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(path)], log)
        if borrow:
            site = next((path / "lib").glob("python3*/site-packages"))
            theirs = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
            (site / "zz_hybridserve_venv.pth").write_text(str(theirs) + "\n")
        _run([str(py), "-m", "pip", "install", "--quiet", *packages], log)
    return py


def llama_tree(work: Path, log: Path) -> Path:
    tree = work / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    if not tree.exists():
        (work / "src").mkdir(parents=True, exist_ok=True)
        _run([str(VENV_PY), "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps", SDIST,
              "-d", str(work / "src")], log)  # fmt: skip
        sdist = next((work / "src").glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(work / "src", filter="data")
    return tree


def build(work: Path, log: Path) -> Path:
    binary = work / "build" / "bin" / "llama-batched-bench"
    if binary.exists():
        return binary
    tree = llama_tree(work, log)
    tools = _venv(work / "tools", log, "cmake", "ninja").parent
    env = dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ['PATH']}")
    _run([str(tools / "cmake"), "-S", str(tree), "-B", str(work / "build"), "-G", "Ninja",
          "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], log, env=env)  # fmt: skip
    _run([str(tools / "ninja"), "-C", str(work / "build"), "llama-batched-bench"], log, env=env)
    return binary


def convert(work: Path, model_dir: Path, log: Path) -> Path:
    out = work / f"{model_dir.name}-f32.gguf"
    if out.exists():
        return out
    tree = llama_tree(work, log)
    py = _venv(work / "convert-env", log, TRANSFORMERS_FOR_CONVERTER, "sentencepiece", borrow=True)
    runner = work / "convert_runner.py"
    runner.write_text(CONVERT_RUNNER)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    _run(
        [
            str(py),
            str(runner),
            str(tree),
            str(vocab),
            str(model_dir),
            "--outtype",
            "f32",
            "--outfile",
            str(out),
        ],
        log,
    )
    return out


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)\|\s*$")


def run_llamacpp(binary: Path, gguf: Path, batch: int, p: int, g: int, threads: int) -> float:
    """llama-batched-bench's `S t/s`: (P + G) * B tokens over the run's total time."""
    cmd = [str(binary), "-m", str(gguf), "-npp", str(p), "-ntg", str(g), "-npl", str(batch),
           "-t", str(threads), "-tb", str(threads), "-c", str(batch * (p + g)),
           "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-no-kvu"]  # fmt: skip
    text = ""
    for _ in range(3):  # on a loaded machine a run has been seen to end before its result row
        text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        for line in text.splitlines():
            m = _ROW.match(line.strip())
            if m and int(m.group(3)) == batch:
                return float(m.group(4).split("|")[-1])
    raise RuntimeError(f"no result row in llama-batched-bench output:\n{text}")


def make_hybridserve(model: str, batch: int, p: int, g: int, threads: int, overlapped: bool = False) -> Any:
    from hybridserve import LLM, SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 700) for _ in range(p)] for _ in range(batch)]
    llm = LLM(
        model=model, dtype="float32", cpu_threads=threads, max_num_seqs=batch, async_scheduling=overlapped
    )
    params = SamplingParams(max_tokens=g, temperature=0, ignore_eos=True)

    def once() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == g for o in outs)
        return batch * (p + g) / wall

    once()  # warm-up
    return once


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--result-file", type=Path, default=None)
    ap.add_argument(
        "--overlapped",
        action="store_true",
        help="also a row of hybridserve with overlapped steps (one more core)",
    )
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "python"))
    from hybridserve.model.demo import resolve_model_path

    a.work_dir.mkdir(parents=True, exist_ok=True)
    log = a.work_dir / "setup.log"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        print("llama.cpp needs a C++ compiler (g++)", file=sys.stderr)
        return 2
    if a.model == BIG_MODEL:
        model_dir = big_checkpoint(a.work_dir, Path(resolve_model_path("demo")))
        a.model = str(model_dir)
    else:
        model_dir = Path(resolve_model_path(a.model))
    binary = build(a.work_dir, log)
    gguf = convert(a.work_dir, model_dir, log)
    batches = [int(b) for b in a.batch.split(",")]
    p, g, t = a.prompt_len, a.output_len, a.threads
    ours = {b: {"hybridserve": make_hybridserve(a.model, b, p, g, t)} for b in batches}
    if a.overlapped:
        for b in batches:
            ours[b]["hybridserve overlapped"] = make_hybridserve(a.model, b, p, g, t, overlapped=True)
    names = [*ours[batches[0]], "llama.cpp"]
    best: dict[int, dict[str, float]] = {b: dict.fromkeys(names, 0.0) for b in batches}
    for r in range(a.repeats):
        for b in batches:
            got = {name: run() for name, run in ours[b].items()}
            got["llama.cpp"] = run_llamacpp(binary, gguf, b, p, g, t)
            shown = ", ".join(f"{name} {v:.0f} tok/s" for name, v in got.items())
            print(f"repeat {r} batch {b}: {shown}", flush=True)
            for name, v in got.items():
                best[b][name] = max(best[b][name], v)
    print(f"\n{p} prompt + {g} output tokens per sequence, {t} thread(s) each, best of {a.repeats}")
    print("| batch | engine | tok/s | llama.cpp tok/s | ratio |")
    print("|---|---|---|---|---|")
    for b in batches:
        lc = best[b]["llama.cpp"]
        for name in names[:-1]:
            print(f"| {b} | {name} | {best[b][name]:.0f} | {lc:.0f} | {best[b][name] / lc:.2f}x |")
    if a.result_file:
        info = {"prompt_len": p, "output_len": g, "threads": t, "repeats": a.repeats, "model": a.model}
        a.result_file.write_text(json.dumps({"config": info, "best_tok_per_s": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
