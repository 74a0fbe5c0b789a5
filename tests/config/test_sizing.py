"""Cache sizing from budgets (config/sizing.py): the two per-pool budgets, one total split between
them (--cache-memory), explicit counts, and the errors naming the flags."""

from __future__ import annotations

from typing import Any

import pytest

from hybridserve.config.sizing import compute_cache_sizes
from hybridserve.engine.llm import LLM
from hybridserve.errors import ConfigError
from hybridserve.sampling.params import SamplingParams

KV_PER_TOKEN = 1024  # bytes over all attention layers
SLOT = 100_000  # bytes of one Mamba state slot over all layers
MIB = 1 << 20


def sizes(**kw: Any):  # noqa: ANN201
    base: dict[str, Any] = dict(
        block_size=16,
        max_model_len=1024,
        max_num_seqs=8,
        num_speculative_tokens=0,
        prefix_caching_can_hit=True,
        kv_bytes_per_token=KV_PER_TOKEN,
        mamba_bytes_per_slot=SLOT,
        has_mamba_layers=True,
    )
    return compute_cache_sizes(**{**base, **kw})


def test_total_budget_gives_mamba_its_default_wish_then_kv_the_rest() -> None:
    # default wish: 1 + 8 windows + a reserve of max(64, 32) = 73 slots
    s = sizes(cache_memory=64 * MIB)
    assert s.num_mamba_slots == 73
    assert s.num_kv_blocks == (64 * MIB - 73 * SLOT) // (16 * KV_PER_TOKEN)
    used = s.num_mamba_slots * SLOT + s.num_kv_blocks * s.kv_bytes_per_block
    assert used <= 64 * MIB


def test_total_budget_caps_mamba_at_half_unless_its_windows_need_more() -> None:
    assert sizes(cache_memory=16 * MIB).num_mamba_slots == 73  # half holds 83 slots: the wish (73) fits
    small = 6 * MIB  # half holds 31 slots: fewer than the 73 wished, more than the 9 needed
    assert sizes(cache_memory=small, max_model_len=256).num_mamba_slots == small // 2 // SLOT
    # 64 sequences need 65 slots; half of 9 MB holds 47: the windows get what they need
    s = sizes(cache_memory=9 * MIB, max_num_seqs=64, max_model_len=16, prefix_caching_can_hit=False)
    assert s.num_mamba_slots == 65


def test_total_with_one_pool_budget_gives_the_other_the_rest() -> None:
    s = sizes(cache_memory=64 * MIB, mamba_cache_memory=10 * SLOT)
    assert s.num_mamba_slots == 10
    assert s.num_kv_blocks == (64 * MIB - 10 * SLOT) // (16 * KV_PER_TOKEN)
    s = sizes(cache_memory=64 * MIB, kv_cache_memory=32 * MIB)
    assert s.num_kv_blocks == 32 * MIB // (16 * KV_PER_TOKEN)
    assert s.num_mamba_slots == 32 * MIB // SLOT
    # explicit counts still win over bytes
    assert sizes(cache_memory=64 * MIB, num_mamba_slots=20).num_mamba_slots == 20


def test_total_budget_errors_name_the_flags() -> None:
    with pytest.raises(ConfigError, match="--cache-memory"):
        sizes(cache_memory=64 * MIB, kv_cache_memory=MIB, mamba_cache_memory=MIB)
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        sizes(cache_memory=MIB, kv_cache_memory=MIB)
    with pytest.raises(ConfigError, match="--cache-memory"):  # too small for one sequence's KV
        sizes(cache_memory=2 * MIB)


def test_models_with_one_kind_of_layer_give_the_total_to_it() -> None:
    s = sizes(cache_memory=16 * MIB, has_mamba_layers=False)
    assert s.num_mamba_slots == 1 and s.num_kv_blocks == 16 * MIB // (16 * KV_PER_TOKEN)
    s = sizes(cache_memory=16 * MIB, kv_bytes_per_token=0)
    assert s.num_mamba_slots == 16 * MIB // SLOT


def test_engine_takes_the_total_budget() -> None:
    llm = LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=4, cache_memory=24 * MIB)
    em = llm.engine.em
    s = em.sizes
    assert s.num_kv_blocks * s.kv_bytes_per_block + s.num_mamba_slots * s.mamba_bytes_per_slot <= 24 * MIB
    assert em.caches.nbytes() <= 24 * MIB
    out = llm.generate("Hello there", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ConfigError, match="--cache-memory"):
        LLM("demo", cache_memory=1 << 30, kv_cache_memory=1 << 20, mamba_cache_memory=1 << 20)
