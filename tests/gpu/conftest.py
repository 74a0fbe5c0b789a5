"""GPU tests of the CUDA kernels (torch.ops.hybridserve.*) against float64 references.

Skipped when no CUDA device is present. ``HYBRIDSERVE_GPU_TESTS_ON_CPU=1`` runs them on the CPU
instead, where dispatch picks the pure-torch twins: a self-check of the test harness (inputs,
oracles, tolerances), not of the kernels. ``HYBRIDSERVE_GPU_TESTS_EMULATED=1`` (implies the
former) routes dispatch to the CPU emulation of the CUDA kernels (tests/cuda_emu): the real
kernel code on the test plan, slowly (use -k to pick the small shapes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EMULATED = os.environ.get("HYBRIDSERVE_GPU_TESTS_EMULATED") == "1"
ON_CPU = os.environ.get("HYBRIDSERVE_GPU_TESTS_ON_CPU") == "1" or EMULATED


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or ON_CPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 references must not silently use TF32 (docs/kernel-design.md, "Pitfalls")."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="session", autouse=True)
def _emulated_kernels():
    """HYBRIDSERVE_GPU_TESTS_EMULATED=1: dispatch runs the emulated kernels for CPU tensors."""
    if not EMULATED or torch.cuda.is_available():
        yield
        return
    from cuda_emu.build import build_emulated_ops
    from hybridserve.kernels import dispatch

    ops = build_emulated_ops()
    saved = (dispatch._use_cuda, dispatch._ops)
    dispatch._use_cuda = lambda device_tensor, supported: True
    dispatch._ops = lambda: ops
    yield
    dispatch._use_cuda, dispatch._ops = saved
