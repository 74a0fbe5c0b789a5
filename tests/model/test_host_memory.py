"""The cache pools' allocation: zeroed tensors on 2 MiB boundaries (transparent huge pages)."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridserve.model import host_memory
from hybridserve.model.cache_tensors import ModelCaches

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_large_pool_is_zero_aligned_and_owns_its_memory(dtype):
    shape = (5001, 2, 16, 2, 32)  # over MIN_BYTES in every dtype; not a whole number of huge pages
    t = host_memory.zeros(shape, dtype, CPU)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert bool((t == 0).all())
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    # the view keeps its buffer alive and is an ordinary writable tensor
    t[-1, 1, -1, -1, -1] = 3
    u = t.clone()
    del t
    assert float(u[-1, 1, -1, -1, -1]) == 3 and float(u.sum()) == 3


def test_a_small_tensor_is_plain_zeros():
    t = host_memory.zeros((3, 4), torch.float32, CPU)
    assert torch.equal(t, torch.zeros(3, 4)) and t.storage_offset() == 0


def test_model_caches_use_it_and_keep_their_values():
    from hybridserve.model.demo import ensure_demo_model
    from hybridserve.model.loader import load_config

    _, cfg = load_config(ensure_demo_model())
    caches = ModelCaches(cfg, num_blocks=4096, block_size=16, num_slots=600)
    big = [t for d in (caches.kv, caches.ssm) for t in d.values()]
    assert big and all(bool((t == 0).all()) for t in big)
    if sys.platform.startswith("linux"):
        assert all(t.data_ptr() % host_memory.HUGE_PAGE == 0 for t in big)
    caches.ssm[cfg.mamba_layer_ids[0]][5].fill_(1.5)
    caches.apply_state_copies([[5, 7]])
    assert bool((caches.ssm[cfg.mamba_layer_ids[0]][7] == 1.5).all())
    caches.reset()
    assert all(bool((t == 0).all()) for t in big)
