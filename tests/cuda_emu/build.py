"""Builds the CPU emulation of the CUDA kernels (see tests/kernels/test_cuda_emulated.py):
torch.ops.hybridserve_emu.* for CPU tensors, running the real kernels/csrc/cuda/*.cu code."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from hybridserve.cache_root import cache_root

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "python" / "hybridserve" / "kernels" / "csrc" / "cuda"
EMU_INC = Path(__file__).resolve().parent / "include"
CACHE = cache_root() / "cuda_emu"


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


_LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^;<>]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)


def _to_host(src: str) -> str:
    """kernel<<<grid, block, smem, stream>>>(args); -> hs_emu::launch(&kernel, grid, block, args);"""

    def repl(m: re.Match[str]) -> str:
        cfg = _split_top(m.group(2))
        return f"hs_emu::launch(&{m.group(1)}, dim3({cfg[0]}), dim3({cfg[1]}), {m.group(3)});"

    return _LAUNCH.sub(repl, src)


def build_emulated_ops():  # noqa: ANN201 - the torch.ops namespace
    """Compiles (cached) and loads the emulated ops; returns torch.ops.hybridserve_emu."""
    h = hashlib.sha256()
    files = sorted(
        [*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cpp"), *CUDA_DIR.glob("*.h"), *CUDA_DIR.glob("*.cuh")]
    )
    for p in [*files, *sorted(EMU_INC.glob("*.h"))]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(torch.__version__.encode())
    key = h.hexdigest()[:16]
    src_dir = CACHE / f"src_{key}"
    src_dir.mkdir(parents=True, exist_ok=True)
    sources = []
    for p in files:
        out = src_dir / (p.stem + "_emu.cpp" if p.suffix == ".cu" else p.name)
        text = _to_host(p.read_text()) if p.suffix == ".cu" else p.read_text()
        # written only when new: ninja rebuilds from file times, and rewriting the same text
        # recompiled the whole extension (15-60 s) at every run
        if not out.exists() or out.read_text() != text:
            out.write_text(text)
        if p.suffix in (".cu", ".cpp"):
            sources.append(str(out))
    from torch.utils import cpp_extension

    from hybridserve.kernels.cuda import _ensure_ninja_on_path

    _ensure_ninja_on_path()
    build = CACHE / f"build_{key}"
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=f"hybridserve_emu_{key}",
        sources=sources,
        extra_cflags=[
            "-O2",
            "-std=c++20",
            "-DHS_EMULATE",
            f"-I{EMU_INC}",
            f"-I{src_dir}",
            "-Wno-unknown-pragmas",
        ],
        extra_ldflags=["-lpthread"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.hybridserve_emu
