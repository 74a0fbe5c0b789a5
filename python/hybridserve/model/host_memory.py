"""Zeroed CPU tensors backed by transparent huge pages, for the cache pools.

The KV and Mamba-state pools are large (hundreds of MB) and read scattered: a decode step touches
one 4 KiB page per KV block of every running sequence, so with 4 KiB pages the paged-attention
kernel spent most of its time in TLB misses (measured: 2.0 ms against 0.7 ms per call for 64 rows
of 320 keys in a 134 MB pool). Linux hands out 2 MiB pages for anonymous memory marked with
``madvise(MADV_HUGEPAGE)`` before it is first touched (`transparent_hugepage` set to ``madvise``
or ``always``), so the pools are allocated untouched, marked, and only then zeroed.

Not Linux, not the CPU or a small tensor: plain ``torch.zeros``. Where madvise is refused, or the
kernel has no free huge page, the tensor is the same aligned view on ordinary pages: huge pages
change speed, never values.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux, every architecture
#: Below this a tensor is left on ordinary pages (it spans few pages; the padding would dominate).
MIN_BYTES = 8 * HUGE_PAGE


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, on huge pages where it can be."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise() if device.type == "cpu" else None
    if madvise is None or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # one extra huge page of room, so the tensor can start on a 2 MiB boundary (glibc serves
    # blocks this large from fresh, untouched mmap memory, except below its dynamic threshold,
    # which can grow to 32 MiB: then the pages may already be small ones)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    base = raw.data_ptr()
    start = (base + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (base + raw.numel()) // HUGE_PAGE * HUGE_PAGE  # whole huge pages inside `raw` only
    madvise(start, end - start, MADV_HUGEPAGE)  # a hint: a refusal leaves ordinary pages
    offset = start - base
    # the view keeps `raw`'s storage alive; zeroing it is its first touch
    return raw[offset : offset + nbytes].view(dtype).view(shape).zero_()
