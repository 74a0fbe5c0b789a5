"""Build and load the hybridserve CUDA extension (``torch.ops.hybridserve.*``) on first use.

The sources live in ``kernels/csrc/cuda/``, inside the package, so an installed wheel carries them
(``HYBRIDSERVE_CUDA_SRC`` overrides the folder). The
extension is compiled with ``torch.utils.cpp_extension.load`` into a build folder keyed by a hash
of the sources, the torch version and the target architectures, under
``$HYBRIDSERVE_CACHE`` (default ``~/.cache/hybridserve``)``/torch_extensions``, so a second
process reuses the built library. nvcc comes from ``CUDA_HOME``, from ``PATH``, or from the
``nvidia-cuda-nvcc`` wheel installed beside torch (the ``test`` extra installs it).

Nothing here imports torch at module level.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path

from hybridserve.cache_root import cache_root

__all__ = [
    "CUDA_SOURCES",
    "SOURCE_FILES",
    "cuda_source_dir",
    "find_cuda_home",
    "is_available",
    "load_extension",
    "source_hash",
]

CUDA_SOURCES = ("ops.cpp", "ssd.cu", "ssu.cu", "conv1d.cu", "slot_copy.cu", "rejection.cu", "mamba1.cu")
_HEADERS = ("kernels.h", "common.cuh")
SOURCE_FILES = (*CUDA_SOURCES, *_HEADERS)  # everything in cuda_source_dir() the build reads

_lock = threading.Lock()
_loaded: str | None = None
_load_error: BaseException | None = None


def cuda_source_dir() -> Path:
    """The folder with the .cu/.cpp sources."""
    env = os.environ.get("HYBRIDSERVE_CUDA_SRC")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "csrc" / "cuda"


def source_hash(src_dir: Path | None = None) -> str:
    """Hash of every source and header (the build folder key)."""
    d = src_dir or cuda_source_dir()
    h = hashlib.sha256()
    for name in (*CUDA_SOURCES, *_HEADERS):
        h.update(name.encode())
        h.update((d / name).read_bytes())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    return cache_root() / "torch_extensions"


def find_cuda_home() -> str | None:
    """A CUDA toolkit folder with ``bin/nvcc``: $CUDA_HOME, nvcc on PATH, /usr/local/cuda, or the
    nvidia-cuda-nvcc wheel (``site-packages/nvidia/cu<major>``)."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env and (Path(env) / "bin" / "nvcc").exists():
        return env
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    if (Path("/usr/local/cuda") / "bin" / "nvcc").exists():
        return "/usr/local/cuda"
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            for cand in sorted(Path(loc).glob("cu*"), reverse=True):
                if (cand / "bin" / "nvcc").exists():
                    return str(cand)
    return None


def _cudart_link_dir(cuda_home: str, build_dir: Path) -> Path | None:
    """A folder with an unversioned ``libcudart.so`` (the wheels ship only ``libcudart.so.<major>``)."""
    for sub in ("lib64", "lib"):
        if (Path(cuda_home) / sub / "libcudart.so").exists():
            return None
    for sub in ("lib64", "lib"):
        cands = sorted((Path(cuda_home) / sub).glob("libcudart.so.*"))
        if cands:
            link_dir = build_dir / "cudart_link"
            link_dir.mkdir(parents=True, exist_ok=True)
            link = link_dir / "libcudart.so"
            if not link.exists():
                link.symlink_to(cands[0])
            return link_dir
    return None


def loaded_cxx_runtime() -> str | None:
    """The path of the C++ runtime (libstdc++) this process has loaded, from /proc/self/maps.

    The extension is linked against it by path: a compiler whose default is to link libstdc++
    statically (a toolchain set as $CXX can be one) otherwise leaves the extension with a second
    C++ runtime of its own beside the process's, which can crash when it formats an error message
    instead of raising it."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
        if "/libstdc++.so" in path and Path(path).exists():
            return path
    return None


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the ninja wheel's binary may not be on it (a venv
    used without activation)."""
    if shutil.which("ninja"):
        return
    cands = [Path(os.path.realpath(sys.executable)).parent, Path(sys.executable).parent]
    try:
        import ninja

        cands.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for c in cands:
        if (c / "ninja").exists():
            os.environ["PATH"] = f"{c}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def load_extension(verbose: bool = False) -> str:
    """Build (first time) and load the extension; returns the path of the loaded library.
    Raises RuntimeError when it cannot be built (no nvcc, no CUDA torch)."""
    global _loaded, _load_error
    with _lock:
        if _loaded is not None:
            return _loaded
        if _load_error is not None:
            raise RuntimeError(f"hybridserve CUDA extension unavailable: {_load_error}") from _load_error
        try:
            _loaded = _build_and_load(verbose)
        except Exception as e:  # noqa: BLE001 - remembered and re-raised with context
            _load_error = e
            raise RuntimeError(f"hybridserve CUDA extension unavailable: {e}") from e
        return _loaded


def _build_and_load(verbose: bool) -> str:
    import torch

    if torch.version.cuda is None:
        raise RuntimeError("this torch build has no CUDA support")
    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or install nvidia-cuda-nvcc)")
    os.environ.setdefault("CUDA_HOME", cuda_home)
    _ensure_ninja_on_path()
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    from torch.utils import cpp_extension

    if not cpp_extension.CUDA_HOME:
        cpp_extension.CUDA_HOME = cuda_home  # imported before CUDA_HOME was set
    src = cuda_source_dir()
    cxx_runtime = loaded_cxx_runtime()
    key = hashlib.sha256(
        f"{source_hash(src)}|{torch.__version__}|{torch.version.cuda}|{os.environ.get('TORCH_CUDA_ARCH_LIST', '')}"
        f"|{cxx_runtime}".encode()
    ).hexdigest()[:16]
    name = f"hybridserve_cuda_{key}"
    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    ldflags: list[str] = []
    link_dir = _cudart_link_dir(cpp_extension.CUDA_HOME or cuda_home, build_dir)
    if link_dir is not None:
        ldflags.append(f"-L{link_dir}")
    if cxx_runtime is not None:
        ldflags.append(cxx_runtime)
    cpp_extension.load(
        name=name,
        sources=[str(src / s) for s in CUDA_SOURCES],
        extra_cflags=["-O3", "-std=c++20"],
        extra_cuda_cflags=["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"],
        extra_include_paths=[str(src)],
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    return str(build_dir / f"{name}.so")


def is_available() -> bool:
    """True when a CUDA device is present and the extension builds and loads."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        load_extension()
        return True
    except RuntimeError:
        return False
