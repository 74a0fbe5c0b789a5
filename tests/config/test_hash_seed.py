"""The prefix cache's hash seed: secret and fresh per start unless given, validated like a flag."""

from __future__ import annotations

import argparse

import pytest

from hybridserve.config import EngineArgs
from hybridserve.config.cli import add_engine_args
from hybridserve.engine.llm_engine import prefix_cache_hash_seed
from hybridserve.errors import ConfigError


def test_seed_is_drawn_fresh_and_independent_of_the_sampling_seed() -> None:
    args = EngineArgs(model="demo", seed=0)
    drawn = {prefix_cache_hash_seed(args) for _ in range(8)}
    # 8 draws of 64 random bits are distinct (a repeat has probability ~2^-59)
    assert len(drawn) == 8
    assert all(0 <= s < 2**64 for s in drawn)
    assert 0 not in drawn  # not the public sampling seed


def test_a_given_seed_is_used_as_is() -> None:
    for seed in (0, 12345, 2**64 - 1):
        assert prefix_cache_hash_seed(EngineArgs(model="demo", prefix_cache_hash_seed=seed)) == seed


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "7", True])
def test_out_of_range_seed_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="--prefix-cache-hash-seed"):
        EngineArgs(model="demo", prefix_cache_hash_seed=bad).validate()  # type: ignore[arg-type]


def test_cli_flag_reaches_engine_args() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineArgs.from_cli(p.parse_args(["demo"])).prefix_cache_hash_seed is None
    ns = p.parse_args(["demo", "--prefix-cache-hash-seed", "99"])
    assert EngineArgs.from_cli(ns).prefix_cache_hash_seed == 99
