"""Hand-written C++ kernels for the CPU path, built with the system C++ compiler on first use.

The sources are in ``kernels/csrc/cpu/``; they use a plain C ABI over raw pointers (no torch headers),
so a build takes a few seconds. The library is compiled with ``-O3 -march=native -ffast-math``
(it runs on the machine that built it; `_FLAGS` says why fast-math is safe here) into ``$HYBRIDSERVE_CACHE`` (default ``~/.cache/hybridserve``)
``/cpu_kernels/<hash of source, flags, compiler and CPU>/``, where later processes find it. When no
compiler is found or the build fails, `build()` returns None with a logged warning and the kernel
backend of the CPU is the pure-torch one (`kernels/backend.py`). ``HYBRIDSERVE_NATIVE_CPU=0`` turns the kernels off. A call
splits its rows over torch's intra-op thread count (`threads()`), on the library's own pool
(``csrc/cpu/cpu_parallel.h``); rows are independent, so the result does not depend on the split.

Kernels:

- `paged_attention`: decode and verify rows over the paged KV cache (float32 / float64, and
  bfloat16 K / V computed in float32), reading K and V through the block table with no gathered
  copy.
- `rms_norm` / `gated_rms_norm`: the model's RMSNorms, one pass per row.
- `mamba_decode` / `mamba_prefill`: the Mamba2 mixer's conv and state recurrence token by token
  (the arithmetic of the reference conv update and state update) in one pass over each row's
  state, written straight into its slots: decode and verify rows, and prefill rows (instead of the
  chunked SSD scan, which on a CPU does the same O(H P N) work per token plus the chunk matrices).

bfloat16 / float16 activations: the norm kernels, and the Mamba kernels where both states are
float32 (the default `mamba_ssm_cache_dtype`), compute in float32 and round the result once.
bfloat16 has entry points that read and write bfloat16 themselves (widening each row or block
into float buffers: the result is the float32 kernel's on the widened inputs); float16 is widened
into float32 copies here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridserve.cache_root import cache_root

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SOURCES = (
    "cpu_paged_attention.cpp",
    "cpu_mamba_scan.cpp",
    "cpu_mamba1_scan.cpp",
    "cpu_norms.cpp",
    "cpu_decode_step.cpp",
)
_HEADERS = ("cpu_parallel.h", "cpu_common.h", "cpu_background.h")
SOURCE_FILES = (*_SOURCES, *_HEADERS)  # everything in source_dir() the build reads
# -ffast-math lets the compiler vectorise the dot-product reductions and call glibc's vector exp
# (3x faster than scalar expf here). Every value the kernels use is finite for finite inputs:
# exp arguments are <= 0 or capped, and the scores of unused key slots (past a row's end, read
# from whatever the pool holds there) are computed but never read.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17", "-pthread")
_LINK_FLAGS = ("-shared", "-pthread")
# every kernel's entry points, by the dtype of the tensors they read and write (str(torch dtype):
# no torch import at module level); bfloat16 ones compute in float32
_SUFFIX = {"torch.float32": "f32", "torch.float64": "f64", "torch.bfloat16": "bf16"}
# The attention kernel's entry points for a KV cache narrower than the model (--kv-cache-dtype):
# (q's dtype, the cache's) -> the name's suffix
_KV_SUFFIX = {
    ("torch.float32", "torch.bfloat16"): "f32_kv_bf16",
    ("torch.float32", "torch.float8_e4m3fn"): "f32_kv_fp8e4m3",
    ("torch.float32", "torch.float8_e5m2"): "f32_kv_fp8e5m2",
    ("torch.bfloat16", "torch.float8_e4m3fn"): "bf16_kv_fp8e4m3",
    ("torch.bfloat16", "torch.float8_e5m2"): "bf16_kv_fp8e5m2",
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
# The norm kernels' entry points by torch dtype (float32, float64), for the calls that need no
# conversion at all: at batch 1 the general path's checks cost three times the kernel.
_NORM_FAST: dict[Any, Any] = {}
_GATED_NORM_FAST: dict[Any, Any] = {}

_I64 = ctypes.c_int64
_P = ctypes.c_void_p


def threads() -> int:
    """The threads a kernel call may use: torch's intra-op thread count (``--cpu-threads``), so
    the kernels use the cores the torch ops use."""
    import torch

    return max(1, int(torch.get_num_threads()))


def source_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc" / "cpu"


def env_switch(name: str) -> bool:
    """Whether the on-by-default switch `name` is on (unset, or anything but 0 / false / no / off)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return env_switch("HYBRIDSERVE_NATIVE_CPU")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update(name.encode())
        h.update((source_dir() / name).read_bytes())
    h.update(" ".join((*_FLAGS, "|", *_LINK_FLAGS)).encode())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h.update(version.encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


def _cpu_identity() -> str:
    """What -march=native compiles for: a library built for another CPU (a cache folder shared
    between machines) could use instructions this one lacks."""
    import platform

    ident = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    ident += "|" + line.strip()
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        pass
    return ident


def _cache_root() -> Path:
    return cache_root() / "cpu_kernels"


def _build(cxx: str) -> Path:
    out_dir = _cache_root() / _build_key(cxx)
    lib_path = out_dir / "libhybridserve_cpu.so"
    if lib_path.exists():
        return lib_path
    out_dir.mkdir(parents=True, exist_ok=True)
    # build in a private folder beside the target and rename: two processes building at once both
    # end with a whole file
    work = Path(tempfile.mkdtemp(dir=out_dir))
    try:
        # one compiler process per source, in parallel; the link has no -ffast-math, which with
        # GCC 12 would add crtfastmath.o and switch the whole process to flush-to-zero
        jobs = []
        for src in _SOURCES:
            obj = work / (Path(src).stem + ".o")
            cmd = [cxx, *_FLAGS, "-c", str(source_dir() / src), "-o", str(obj)]
            jobs.append(
                (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            )
        for cmd, proc in jobs:
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.strip()[-2000:]}")
        tmp = work / "lib.so"
        cmd = [cxx, *_LINK_FLAGS, *(str(work / (Path(s).stem + ".o")) for s in _SOURCES), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib_path


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types of every entry point (ctypes converts and checks each argument by them)."""
    for suffix in (*_SUFFIX.values(), *_KV_SUFFIX.values()):
        fn = getattr(lib, f"hs_paged_attention_{suffix}")
        # q, kv, out, block_table, bt_stride, qsl, positions, rows, tokens, blocks, H, KVH, D,
        # block_size, scale, threads
        fn.argtypes = [_P, _P, _P, _P, _I64, _P, _P] + [_I64] * 7 + [ctypes.c_double, ctypes.c_int]
        fn.restype = ctypes.c_int
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"hs_rms_norm_{suffix}")
        fn.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_double]
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"hs_gated_rms_norm_{suffix}")
        fn.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_double]
        fn.restype = ctypes.c_int
    # the arguments both Mamba entry points share, before and after their own row description
    common = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _I64]
    tail = [_I64] * 6 + [ctypes.c_int, ctypes.c_double, ctypes.c_double, _P, ctypes.c_int]
    for suffix in _SUFFIX.values():
        fn = getattr(lib, f"hs_mamba_decode_{suffix}")
        fn.argtypes = [*common, _P, _I64, _P, _P, _I64, *tail]  # qsl, R, read_slot, write_slots, ws_stride
        fn.restype = ctypes.c_int
        fn = getattr(lib, f"hs_mamba_prefill_{suffix}")
        # qsl, R, read_slot, has_init, write_offsets, write_token, write_slot
        fn.argtypes = [*common, _P, _I64, _P, _P, _P, _P, _P, *tail]
        fn.restype = ctypes.c_int
    for suffix in ("f32", "f64"):
        fn = getattr(lib, f"hs_mamba1_scan_{suffix}")
        # x, x_stride, dt, dt_stride, A, B, b_stride, C, c_stride, Dskip, ssm_state, num_slots,
        # qsl, R, read_slot, has_init, write_offsets, write_token, write_slot, T, Dc, N, y, threads
        fn.argtypes = (
            [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _P, _P, _I64, _P, _I64]
            + [_P] * 5
            + [_I64, _I64, _I64, _P, ctypes.c_int]
        )
        fn.restype = ctypes.c_int
    for suffix in ("f32", "f64"):
        fn = getattr(lib, f"hs_decode_step_{suffix}")
        # layers, doubles, num_layers, hidden, vocab, embed, final_norm, final_eps, lm_head,
        # input_ids, positions, slot_mapping, block_table, bt_stride, read_slot, write_slots,
        # ws_stride, qsl, logits_indices, R, num_decodes, has_init, emit_row, emit_token,
        # emit_slot, num_emits, num_logits, logits, argmax, all_finite, threads
        # (model/decode_step.py)
        fn.argtypes = [_P, _P, _I64, _I64, _I64, _P, _P, ctypes.c_double, _P, _P, _P, _P, _P, _I64]
        fn.argtypes += [_P, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _P, _I64, _I64]
        fn.argtypes += [_P, _P, _P, ctypes.c_int]
        fn.restype = ctypes.c_int
        # the same step on the library's background thread: 0 posted, 6 not (busy), else as above
        launch = getattr(lib, f"hs_decode_step_launch_{suffix}")
        launch.argtypes, launch.restype = fn.argtypes, ctypes.c_int
    lib.hs_decode_step_wait.argtypes = []
    lib.hs_decode_step_wait.restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    """The kernel library when the C++ CPU kernels are the kernel backend of the CPU
    (`kernels/backend.py`), else None: the callers then run their pure-torch twins."""
    from hybridserve.kernels import backend

    if backend.active("cpu") is not backend.Backend.CPU_NATIVE:
        return None
    return build()


def build() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on the first call; None when it is turned off or
    cannot be built (logged once)."""
    global _lib, _tried
    if _tried:  # every kernel call comes here: the answer is settled after the first
        return _lib
    if not enabled():
        return None
    with _lock:
        if _tried:
            return _lib
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            lib = ctypes.CDLL(str(_build(cxx)))
            _declare(lib)
            import torch

            for dtype, suffix in ((torch.float32, "f32"), (torch.float64, "f64")):
                _NORM_FAST[dtype] = getattr(lib, f"hs_rms_norm_{suffix}")
                _GATED_NORM_FAST[dtype] = getattr(lib, f"hs_gated_rms_norm_{suffix}")
            _lib = lib
        except Exception as e:  # any failure leaves the pure-torch path in place
            logger.warning("native CPU kernels unavailable, using the pure-torch path: %s", e)
            _lib = None
        _tried = True
        return _lib


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    qsl: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Attention of every token of rows ``[0, len(qsl) - 1)``: q ``[T, H, D]`` (T = qsl[-1]),
    kv_cache ``[num_blocks, 2, block_size, KVH, D]``, block_table ``[rows, >= blocks needed]``
    int64, positions ``[T]`` int64 (token t sees keys 0..positions[t]). Returns ``[T, H, D]``, or
    None when the kernel does not apply (not on the CPU, another dtype, no library): the caller
    then takes its torch path. Bad block ids or positions raise ValueError before anything is read.
    bfloat16 q and K/V are computed in float32 (the float32 kernel on the widened values) and the
    result rounded to bfloat16. A cache narrower than q (bfloat16 or float8 under float32 q,
    float8 under bfloat16 q: --kv-cache-dtype) is widened exactly as it is read."""
    import torch

    fn_name = _attention_fn(q.dtype, kv_cache.dtype)
    if (
        not _on_cpu(q, kv_cache, block_table, qsl, positions)
        or fn_name is None
        or not kv_cache.is_contiguous()  # not copied here: the torch path reads it in place
    ):
        return None
    lib = library()
    if lib is None:
        return None
    if q.dim() != 3 or kv_cache.dim() != 5:
        return None
    T, H, D = q.shape
    KVH = kv_cache.shape[3]
    if kv_cache.shape[1] != 2 or kv_cache.shape[4] != D or KVH <= 0 or H <= 0 or H % KVH != 0:
        return None
    rows = qsl.numel() - 1
    if rows < 0 or block_table.dim() != 2 or block_table.shape[0] < rows:
        raise ValueError(
            f"paged_attention: {rows} rows but a block table of shape {tuple(block_table.shape)}"
        )
    num_tokens = int(qsl[-1]) if rows > 0 else 0
    if num_tokens != T or positions.numel() < T:
        raise ValueError(
            f"paged_attention: qsl ends at {num_tokens}, q has {T} tokens, {positions.numel()} positions"
        )
    if qsl.dtype != torch.int64 or positions.dtype != torch.int64 or block_table.dtype != torch.int64:
        raise ValueError("paged_attention: qsl, positions and block_table must be int64")
    q = q.contiguous()
    block_table = _dense(block_table)
    qsl = qsl.contiguous()
    positions = positions.contiguous()
    out = torch.empty_like(q)
    fn = getattr(lib, fn_name)
    rc = fn(
        q.data_ptr(),
        kv_cache.data_ptr(),
        out.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[1],  # (its row stride, dense; a table of no columns has stride 1)
        qsl.data_ptr(),
        positions.data_ptr(),
        rows,
        T,
        kv_cache.shape[0],
        H,
        KVH,
        D,
        kv_cache.shape[2],
        scale,
        threads(),
    )
    _check_rc("paged_attention", rc, f"H={H}, KVH={KVH}, D={D}, block_size={kv_cache.shape[2]}, {rows} rows")
    return out


def reads_kv_cache(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the attention kernel takes q of `dtype` over a cache of `kv_dtype`."""
    return _attention_fn(dtype, kv_dtype) is not None


def _attention_fn(dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """The entry point of the attention kernel for q (and out) of `dtype` and K / V of
    `kv_dtype`, or None where there is none."""
    suffix = _SUFFIX.get(str(dtype)) if kv_dtype == dtype else _KV_SUFFIX.get((str(dtype), str(kv_dtype)))
    return None if suffix is None else f"hs_paged_attention_{suffix}"


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, contiguous: t itself when it already is (no torch call: at batch 1 the
    wrappers' conversions cost more than the kernels they feed)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    for t in tensors:  # a loop, not all(<generator>): this runs several times per kernel call
        if t is not None and not t.is_cpu:
            return False
    return True


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with its rows back to back (a one-row slice of a wider table can be "contiguous" with a
    row stride of the wider one, and the kernels index rows by the width)."""
    import torch

    t = t.contiguous()
    if t.dim() >= 2 and t.shape[0] > 0 and t.stride(0) != math.prod(t.shape[1:]):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _check_rc(name: str, rc: int, shapes: str) -> None:
    if rc == 0:
        return
    if rc == 1:
        raise ValueError(f"{name}: bad shapes ({shapes})")
    if rc == 4:
        raise MemoryError(f"{name}: out of memory in the native CPU kernel")
    raise ValueError(f"{name}: a row range, position, block or slot is out of bounds ({shapes})")


def _rows_of(t: torch.Tensor) -> bool:
    """Rows laid out one after the other with unit stride inside a row (a column slice of a
    contiguous [T, F] tensor qualifies)."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


class _MixerArgs(NamedTuple):
    """The checked tensors and sizes shared by the two Mamba entry points."""

    lib: ctypes.CDLL
    common: tuple[Any, ...]  # the leading arguments of both C functions
    tail: tuple[Any, ...]  # conv_dim, W, H, P, G, N, act, dt_min, dt_max, y, threads
    y: torch.Tensor
    keep: tuple[torch.Tensor | None, ...]  # the converted copies the pointers refer to
    suffix: str  # of the entry point: "f32", "f64" or "bf16"
    out_dtype: torch.dtype  # of the result (y is rounded to it, for float16)


def _mixer_args(
    name: str,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    ngroups: int,
    silu: bool,
    dt_min: float,
    dt_max: float,
) -> _MixerArgs | None:
    import torch

    out_dtype = xbc.dtype
    # bfloat16 / float16 activations over float32 states (the engine's layout) run the float32
    # kernel on the widened inputs (the reference computes the conv and the scan in float32 too,
    # but rounds the conv output to the input dtype in between; this does not). bfloat16 has
    # entry points that read xbc and dt and write y in bfloat16 themselves; float16 is widened
    # here.
    narrow_io = (
        out_dtype in (torch.bfloat16, torch.float16)
        and conv_state.dtype == ssm_state.dtype == torch.float32
        and _on_cpu(xbc, dt, conv_weight, conv_state, ssm_state)
        and library() is not None
    )
    if narrow_io and out_dtype == torch.float16:
        xbc, dt = xbc.float(), dt.float()
    if narrow_io:
        conv_weight = conv_weight.float()
    dtype = torch.float32 if narrow_io else xbc.dtype  # the kernel computes in
    if (
        not _on_cpu(
            xbc, dt, conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state, query_start_loc, read_slot
        )
        or dtype not in (torch.float32, torch.float64)
        or any(t.dtype != dtype for t in (conv_state, ssm_state, conv_weight))
        or dt.dtype != xbc.dtype
        or not (_rows_of(xbc) and _rows_of(dt))
        or ssm_state.dim() != 4
        or conv_state.dim() != 3
        or not (conv_state.is_contiguous() and ssm_state.is_contiguous())  # written in place
    ):
        return None
    lib = library()
    if lib is None:
        return None
    n, conv_dim = xbc.shape
    _, H, P, N = ssm_state.shape
    W = conv_weight.shape[1]
    R = query_start_loc.numel() - 1
    if (
        dt.shape != (n, H)
        or conv_weight.shape != (conv_dim, W)
        or conv_state.shape[1:] != (conv_dim, W - 1)
        or (conv_bias is not None and conv_bias.shape != (conv_dim,))
        or read_slot.shape != (R,)
        or R < 0
    ):
        raise ValueError(
            f"{name}: shapes do not fit (xbc {tuple(xbc.shape)}, dt {tuple(dt.shape)}, "
            f"conv_state {tuple(conv_state.shape)}, ssm_state {tuple(ssm_state.shape)}, {R} rows)"
        )
    if A.numel() != H or D.numel() != H or dt_bias.numel() != H:
        return None  # the reference's broadcasting (or its error)
    if not (math.isfinite(dt_min) and dt_min >= 0.0 and (dt_max == math.inf or 0.0 <= dt_max < math.inf)):
        return None  # the clamp the reference applies to odd bounds
    if int(query_start_loc[-1]) != n:
        raise ValueError(f"{name}: query_start_loc ends at {int(query_start_loc[-1])} for {n} tokens")
    w = conv_weight.contiguous()
    b = _as(conv_bias, dtype) if conv_bias is not None else None
    A_, D_, db = (_as(v, dtype) for v in (A, D, dt_bias))
    y = torch.empty((n, H, P), dtype=xbc.dtype)
    common = (
        xbc.data_ptr(), xbc.stride(0), dt.data_ptr(), dt.stride(0), w.data_ptr(),
        b.data_ptr() if b is not None else None, conv_state.data_ptr(), conv_state.shape[0],
        A_.data_ptr(), D_.data_ptr(), db.data_ptr(), ssm_state.data_ptr(), ssm_state.shape[0],
    )  # fmt: skip
    tail = (
        conv_dim, W, H, P, ngroups, N, int(silu), float(dt_min),
        float(dt_max) if math.isfinite(dt_max) else -1.0, y.data_ptr(), threads(),
    )  # fmt: skip
    suffix = _SUFFIX[str(xbc.dtype)]  # float32, float64 or bfloat16 here
    return _MixerArgs(lib, common, tail, y, (xbc, dt, w, b, A_, D_, db), suffix, out_dtype)


def _mixer_result(name: str, rc: int, args: _MixerArgs) -> torch.Tensor | None:
    if rc == 3:
        return None
    conv_dim, W, H, P, G, N = args.tail[:6]
    _check_rc(name, rc, f"conv_dim={conv_dim}, H={H}, P={P}, G={G}, N={N}, W={W}")
    return args.y if args.y.dtype == args.out_dtype else args.y.to(args.out_dtype)


def mamba_decode(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    write_slots: torch.Tensor,
    ngroups: int,
    silu: bool,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
) -> torch.Tensor | None:
    """Conv update then selective state update of decode / verify rows, as
    ``reference.causal_conv1d_update`` followed by ``reference.selective_state_update`` (same
    arguments: xbc ``[n, conv_dim]``, dt ``[n, H]``, conv_state ``[slots, conv_dim, W - 1]``,
    ssm_state ``[slots, H, P, N]``, A = -exp(A_log)). Returns y ``[n, H, P]``, or None when the
    kernel does not apply (not the CPU, mixed dtypes, a row reading a slot that an earlier row
    writes): the caller then runs the reference twins. Out-of-range slots raise ValueError before
    anything is written."""
    import torch

    args = _mixer_args(
        "mamba_decode", xbc, dt, conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state,
        query_start_loc, read_slot, ngroups, silu, dt_min, dt_max,
    )  # fmt: skip
    if args is None:
        return None
    if not _on_cpu(write_slots):
        return None
    R = query_start_loc.numel() - 1
    if write_slots.dim() != 2 or write_slots.shape[0] != R:
        raise ValueError(f"mamba_decode: write_slots of shape {tuple(write_slots.shape)} for {R} rows")
    i64 = torch.int64
    qsl = _as(query_start_loc, i64)
    rs = _as(read_slot, i64)
    ws = _as(write_slots, i64)
    fn = getattr(args.lib, f"hs_mamba_decode_{args.suffix}")
    rc = fn(*args.common, qsl.data_ptr(), R, rs.data_ptr(), ws.data_ptr(), ws.shape[1], *args.tail)
    return _mixer_result("mamba_decode", rc, args)


def mamba_prefill(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    read_slot: torch.Tensor,
    has_initial_state: torch.Tensor,
    write_slot: torch.Tensor,
    emit_row: torch.Tensor,
    emit_token: torch.Tensor,
    emit_slot: torch.Tensor,
    chunk_size: int,
    ngroups: int,
    silu: bool,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
) -> torch.Tensor | None:
    """Conv then state recurrence of prefill rows: ``reference.causal_conv1d_prefill`` followed by
    ``reference.ssd_prefill`` with the same arguments (the final window / state of row r go to
    ``write_slot[r]``, the emitted ones after ``emit_token[e]`` of row ``emit_row[e]`` to
    ``emit_slot[e]``, at any token of the row, as there). Returns y ``[n, H, P]``, or None when the
    kernel does not apply: the caller then runs the reference twins. ``chunk_size`` is the twin's
    and does not matter here: the recurrence has the state after every token at hand."""
    import torch

    from hybridserve.kernels.reference import _check_emits

    args = _mixer_args(
        "mamba_prefill", xbc, dt, conv_weight, conv_bias, conv_state, A, D, dt_bias, ssm_state,
        query_start_loc, read_slot, ngroups, silu, dt_min, dt_max,
    )  # fmt: skip
    if args is None:
        return None
    if not _on_cpu(num_computed_tokens, has_initial_state, write_slot, emit_row, emit_token, emit_slot):
        return None
    R = query_start_loc.numel() - 1
    if has_initial_state.shape != (R,) or write_slot.shape != (R,) or num_computed_tokens.shape != (R,):
        raise ValueError(
            f"mamba_prefill: has_initial_state, write_slot and num_computed_tokens need {R} rows"
        )
    if not (emit_row.shape == emit_token.shape == emit_slot.shape and emit_row.dim() == 1):
        raise ValueError("mamba_prefill: emit_row, emit_token and emit_slot must be 1-D of one length")
    _check_emits(query_start_loc, emit_row, emit_token)
    i64 = torch.int64
    qsl = query_start_loc.to(i64).contiguous()
    last = qsl[1:] - qsl[:-1] - 1
    # every write as (row, token, slot): the emits, then the final states (a row with no
    # tokens writes nothing), sorted by row and token (stable: at one token, emits come first)
    has_tokens = last >= 0
    rows_all = torch.cat([emit_row.to(i64), torch.arange(R, dtype=i64)[has_tokens]])
    toks_all = torch.cat([emit_token.to(i64), last[has_tokens]])
    slots_all = torch.cat([emit_slot.to(i64), write_slot.to(i64)[has_tokens]])
    order = torch.argsort(rows_all * (int(qsl[-1]) + 1) + toks_all, stable=True)
    wtok = toks_all[order].contiguous()
    wslot = slots_all[order].contiguous()
    offsets = torch.zeros(R + 1, dtype=i64)
    offsets[1:] = torch.bincount(rows_all, minlength=R).cumsum(0)
    rs = read_slot.to(i64).contiguous()
    his = (has_initial_state != 0).to(torch.uint8).contiguous()
    fn = getattr(args.lib, f"hs_mamba_prefill_{args.suffix}")
    rc = fn(
        *args.common, qsl.data_ptr(), R, rs.data_ptr(), his.data_ptr(), offsets.data_ptr(), wtok.data_ptr(),
        wslot.data_ptr(), *args.tail,
    )  # fmt: skip
    return _mixer_result("mamba_prefill", rc, args)


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slot: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor | None:
    """The Mamba1 selective scan of `selective_scan.selective_scan_rows` (same arguments: x, dt
    ``[T, Dc]``, A ``[Dc, N]``, B, C ``[T, N]``, D ``[Dc]``, ssm_state ``[slots, Dc, N]``, the
    writes as (row, token, slot) sorted by row and token). Returns y ``[T, Dc]``, or None when
    the kernel does not apply (not the CPU, not float32 / float64 states): the caller then runs
    the twin. Out-of-range rows, tokens or slots raise ValueError before anything is written."""
    import torch

    dtype = ssm_state.dtype
    if (
        dtype not in (torch.float32, torch.float64)
        or not _on_cpu(x, dt, A, B, C, D, ssm_state, query_start_loc, read_slot, has_initial_state, *writes)
        or ssm_state.dim() != 3
        or not ssm_state.is_contiguous()
    ):
        return None
    lib = library()
    if lib is None:
        return None
    T, Dc = x.shape
    N = ssm_state.shape[2]
    R = query_start_loc.numel() - 1
    if (
        dt.shape != (T, Dc)
        or A.shape != (Dc, N)
        or B.shape != (T, N)
        or C.shape != (T, N)
        or D.numel() != Dc
        or ssm_state.shape[1] != Dc
        or read_slot.shape != (R,)
        or (has_initial_state is not None and has_initial_state.shape != (R,))
    ):
        raise ValueError(
            f"mamba1_scan: shapes do not fit (x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}, ssm_state {tuple(ssm_state.shape)}, {R} rows)"
        )
    out_dtype = x.dtype
    xs, dts, Bs, Cs = (_dense(v.to(dtype)) for v in (x, dt, B, C))
    A_, D_ = _as(A, dtype), _as(D.reshape(Dc), dtype)
    i64 = torch.int64
    qsl, rs = _as(query_start_loc, i64), _as(read_slot, i64)
    his = None if has_initial_state is None else (has_initial_state != 0).to(torch.uint8).contiguous()
    w_row, w_tok, w_slot = (_as(w, i64) for w in writes)
    if not (w_row.dim() == w_tok.dim() == w_slot.dim() == 1 and w_row.shape == w_tok.shape == w_slot.shape):
        raise ValueError(
            "mamba1_scan: the writes' rows, tokens and slots must be 1-D and of one length, got "
            f"{tuple(w_row.shape)}, {tuple(w_tok.shape)}, {tuple(w_slot.shape)}"
        )
    if w_row.numel() > 0 and (int(w_row.min()) < 0 or int(w_row.max()) >= R):
        raise ValueError("mamba1_scan: a write names a row out of range")
    if w_row.numel() > 1 and bool((w_row[1:] < w_row[:-1]).any()):
        raise ValueError("mamba1_scan: the writes must be sorted by row")
    offsets = torch.zeros(R + 1, dtype=i64)
    offsets[1:] = torch.bincount(w_row, minlength=R).cumsum(0)
    y = torch.empty((T, Dc), dtype=dtype)
    fn = getattr(lib, f"hs_mamba1_scan_{_SUFFIX[str(dtype)]}")
    rc = fn(
        xs.data_ptr(), xs.stride(0) if T > 0 else Dc, dts.data_ptr(), dts.stride(0) if T > 0 else Dc,
        A_.data_ptr(), Bs.data_ptr(), Bs.stride(0) if T > 0 else N, Cs.data_ptr(), Cs.stride(0) if T > 0 else N,
        D_.data_ptr(), ssm_state.data_ptr(), ssm_state.shape[0], qsl.data_ptr(), R, rs.data_ptr(),
        his.data_ptr() if his is not None else None, offsets.data_ptr(), w_tok.data_ptr(), w_slot.data_ptr(),
        T, Dc, N, y.data_ptr(), threads(),
    )  # fmt: skip
    if rc == 3:
        return None  # a slot written by two rows: the twin's order decides which write lands
    _check_rc("mamba1_scan", rc, f"T={T}, Dc={Dc}, N={N}, {R} rows")
    return y if out_dtype == dtype else y.to(out_dtype)


def _norm_rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and _rows_of(t)


def _norm_fn(dtype: torch.dtype) -> tuple[str, torch.dtype] | None:
    """The entry-point suffix of the norm kernels for rows of `dtype`, and the dtype they compute
    (and take the weights) in."""
    import torch

    suffix = _SUFFIX.get(str(dtype))
    if suffix is None:
        return None
    return suffix, torch.float32 if dtype == torch.bfloat16 else dtype


def _native_cpu() -> bool:
    """Whether the C++ kernels are the kernel backend of the CPU (what `library()` checks)."""
    from hybridserve.kernels import backend

    return backend.active("cpu") is backend.Backend.CPU_NATIVE


def _plain_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x a non-empty contiguous [n, d] CPU tensor and weight its contiguous [d] of the same
    dtype: a norm kernel reads them as they are."""
    return (
        x.dim() == 2
        and x.is_cpu
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_cpu
        and weight.is_contiguous()
        and weight.dim() == 1
        and weight.shape[0] == x.shape[1]
        and x.numel() > 0
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x^2, -1) + eps)`` of a float32 / float64 / bfloat16 ``[..., d]``
    tensor on the CPU (norm.RMSNorm); None when it does not apply. bfloat16 (and float16, widened
    here): computed in float32, as the reference does, and rounded once."""
    import torch

    fast = _NORM_FAST.get(x.dtype)
    if fast is not None and _plain_rows(x, weight) and _native_cpu():
        n, d = x.shape
        normed = torch.empty((n, d), dtype=x.dtype)
        if fast(x.data_ptr(), d, weight.data_ptr(), normed.data_ptr(), d, n, d, eps) == 0:
            return normed

    if x.dtype == torch.float16 and _on_cpu(x, weight) and library() is not None:
        out = rms_norm(x.float(), weight, eps)
        return None if out is None else out.to(x.dtype)
    kind = _norm_fn(x.dtype)
    if kind is None or x.dim() < 1 or x.numel() == 0:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if not (_norm_rows(x2, x.dtype) and weight.shape == (x.shape[-1],) and _on_cpu(weight)):
        return None
    lib = library()
    if lib is None:
        return None
    suffix, compute = kind
    w = _as(weight, compute)
    out = torch.empty(x2.shape, dtype=x.dtype)
    rc = getattr(lib, f"hs_rms_norm_{suffix}")(
        x2.data_ptr(),
        x2.stride(0),
        w.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        x2.shape[0],
        x2.shape[1],
        eps,
    )
    if rc != 0:
        return None
    return out.view(x.shape)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor | None:
    """``weight * rmsnorm_grouped(y * silu(z))`` of float32 / float64 / bfloat16 ``[T, d]`` tensors
    on the CPU (norm.gated_rms_norm with the output in the input dtype); None when it does not
    apply. bfloat16 (and float16, widened here): computed in float32, as the reference does, and
    rounded once."""
    import torch

    fast = _GATED_NORM_FAST.get(y.dtype)
    if (
        fast is not None
        and _plain_rows(y, weight)
        and z.dtype == y.dtype
        and z.is_cpu
        and z.shape == y.shape
        and z.stride(1) == 1
        and (y.shape[0] <= 1 or z.stride(0) >= y.shape[1])
        and 0 < group_size
        and y.shape[1] % group_size == 0
        and _native_cpu()
    ):
        n, d = y.shape
        normed = torch.empty((n, d), dtype=y.dtype)
        rc = fast(
            y.data_ptr(),
            d,
            z.data_ptr(),
            z.stride(0),
            weight.data_ptr(),
            normed.data_ptr(),
            d,
            n,
            d,
            group_size,
            eps,
        )
        if rc == 0:
            return normed
    if y.dtype == torch.float16 and z.dtype == y.dtype and _on_cpu(y, z, weight) and library() is not None:
        out = gated_rms_norm(y.float(), z.float(), weight, group_size, eps)
        return None if out is None else out.to(y.dtype)
    dtype = y.dtype
    kind = _norm_fn(dtype)
    if kind is None or y.dim() != 2 or y.shape != z.shape or y.numel() == 0:
        return None
    d = y.shape[1]
    if (
        not (_norm_rows(y, dtype) and _norm_rows(z, dtype) and _on_cpu(weight))
        or weight.shape != (d,)
        or group_size <= 0
    ):
        return None
    if d % group_size != 0:
        return None
    lib = library()
    if lib is None:
        return None
    suffix, compute = kind
    w = _as(weight, compute)
    out = torch.empty(y.shape, dtype=dtype)
    rc = getattr(lib, f"hs_gated_rms_norm_{suffix}")(
        y.data_ptr(), y.stride(0), z.data_ptr(), z.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0),
        y.shape[0], d, group_size, eps,
    )  # fmt: skip
    return out if rc == 0 else None
