"""Every test's shared set-up, for all folders (one per domain: config, scheduler, kernels, model,
sampling, engine, server, bench, repo, gpu). The helpers beside this file (model_fixtures,
server_fixtures, openapi_cases, sampling_stats, cuda_emu) are importable from every folder:
pytest puts this folder on sys.path.

GPU tests (tests/gpu/) are skipped when no CUDA device is present. ``HYBRIDSERVE_GPU_TESTS_ON_CPU=1``
runs them on the CPU instead, where dispatch picks the pure-torch twins: a self-check of the test
harness (inputs, oracles, tolerances), not of the kernels. ``HYBRIDSERVE_GPU_TESTS_EMULATED=1``
(implies the former) routes dispatch to the CPU emulation of the CUDA kernels (tests/cuda_emu):
the real kernel code on the test plan, slowly (use -k to pick the small shapes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridserve.kernels import backend

GPU_TESTS = Path(__file__).resolve().parent / "gpu"
EMULATED = os.environ.get("HYBRIDSERVE_GPU_TESTS_EMULATED") == "1"
ON_CPU = os.environ.get("HYBRIDSERVE_GPU_TESTS_ON_CPU") == "1" or EMULATED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() or ON_CPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if GPU_TESTS in item.path.resolve().parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kernel_backend_per_test() -> Iterator[None]:
    """An engine pins its kernel backend for the process (kernels/backend.py): each test starts
    from the backend its own engines choose, not from the one a previous test's engine pinned."""
    before = backend.pinned()
    yield
    backend.pin(before)


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """fp32 references must not silently use TF32 (docs/kernel-design.md, "Pitfalls")."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="session", autouse=True)
def _emulated_kernels() -> Iterator[None]:
    """HYBRIDSERVE_GPU_TESTS_EMULATED=1: dispatch runs the emulated kernels for CPU tensors."""
    if not EMULATED or torch.cuda.is_available():
        yield
        return
    from cuda_emu.build import build_emulated_ops
    from hybridserve.kernels import dispatch

    ops = build_emulated_ops()
    saved = (dispatch._use_cuda, dispatch._ops)
    dispatch._use_cuda = lambda device_tensor, supported: True  # type: ignore[assignment]
    dispatch._ops = lambda: ops  # type: ignore[assignment]
    yield
    dispatch._use_cuda, dispatch._ops = saved  # type: ignore[assignment]
