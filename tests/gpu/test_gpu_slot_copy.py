"""copy_slots: batched slot copies with the sequential semantics of the reference."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, gen

from hybridserve.kernels import dispatch as K
from hybridserve.kernels import reference as ref


def _pool(shape, dtype, g):
    return (torch.randn(shape, generator=g) * 10).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8], ids=str)
@pytest.mark.parametrize("shape", [(40, 8, 64, 16), (40, 10256, 3), (40, 7)], ids=str)
def test_independent_copies(dtype, shape):
    g = gen()
    pool = _pool(shape, dtype, g)
    perm = (torch.randperm(shape[0] - 1, generator=g) + 1).tolist()
    src = torch.tensor(perm[:10])
    dst = torch.tensor(perm[10:20])
    got, want = pool.clone(), pool.clone()
    K.copy_slots(got, src, dst)
    ref.copy_slots(want, src, dst)
    assert torch.equal(got, want)
    assert not torch.equal(got, pool)


def test_sequential_semantics():
    """Chains (a src that is an earlier dst), write-after-read, duplicate dsts, src == dst and
    copies to the null slot all behave as the in-order loop."""
    g = gen()
    pool = _pool((12, 4, 33), torch.float32, g)
    src = torch.tensor([1, 2, 5, 3, 7, 7, 9, 4])
    dst = torch.tensor([2, 3, 1, 6, 0, 7, 8, 8])
    got, want = pool.clone(), pool.clone()
    K.copy_slots(got, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        if d != 0:
            want[d] = want[s].clone()
    assert torch.equal(got, want)
    assert torch.equal(got[0], pool[0])


def test_index_tensors_on_device_and_empty():
    g = gen()
    pool = _pool((6, 128), torch.float32, g)
    got = pool.clone()
    K.copy_slots(got, torch.tensor([1], device=DEVICE), torch.tensor([4], device=DEVICE))
    assert torch.equal(got[4], pool[1])
    K.copy_slots(got, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(got[4], pool[1])
