"""Fixtures every test shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridserve.kernels import backend


@pytest.fixture(autouse=True)
def _kernel_backend_per_test() -> Iterator[None]:
    """An engine pins its kernel backend for the process (kernels/backend.py): each test starts
    from the backend its own engines choose, not from the one a previous test's engine pinned."""
    before = backend.pinned()
    yield
    backend.pin(before)
