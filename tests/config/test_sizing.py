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


def test_total_budget_keeps_one_sequence_of_kv_when_max_num_seqs_can_be_lowered() -> None:
    # 64 sequences with windows of 1 + 5 need 385 slots (38.5 MB), more than the whole 20 MiB
    budget = 20 * MIB
    kw: dict[str, Any] = dict(cache_memory=budget, max_num_seqs=64, num_speculative_tokens=5)
    s = sizes(**kw, max_num_seqs_auto=True)
    one_sequence = -(-(1024 + 5) // 16) + 1  # one sequence of max_model_len + K, and the null block
    assert s.num_kv_blocks == one_sequence
    assert s.num_mamba_slots == (budget - one_sequence * 16 * KV_PER_TOKEN) // SLOT
    assert s.max_num_seqs == s.state_pool_capacity == (s.num_mamba_slots - 1) // 7
    assert s.num_mamba_slots * SLOT + s.num_kv_blocks * s.kv_bytes_per_block <= budget
    # a given --max-num-seqs is not lowered: the error names the count that fits
    with pytest.raises(ConfigError, match=r"--max-num-seqs 64 .*lower --max-num-seqs to \d+"):
        sizes(**kw)


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


def test_a_model_without_attention_gets_no_more_blocks_than_the_scheduler_tracks() -> None:
    from hybridserve import _core

    s = sizes(
        kv_bytes_per_token=0, block_size=1, max_model_len=4096, max_num_seqs=10_000, num_mamba_slots=10_001
    )
    assert s.num_kv_blocks == _core.MAX_KV_BLOCKS
    _core.resolve_policy(
        has_mamba_layers=True,
        supports_boundary_states=True,
        scan_chunk_size=64,
        max_position_embeddings=4096,
        block_size=1,
        max_num_seqs=10_000,
        max_model_len=4096,
    ).validate_pool_sizes(s.num_kv_blocks, s.num_mamba_slots)


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


# ---- state pool capacity: sequences the Mamba pool can run (config/sizing.py, config/plan.py)


def test_capacity_counts_windows_and_one_checkpoint_slot_per_sequence() -> None:
    from hybridserve.config.sizing import state_pool_capacity

    assert state_pool_capacity(65, 0, False, True) == 64  # windows of 1
    assert state_pool_capacity(65, 0, True, True) == 32  # + a checkpoint slot each
    assert state_pool_capacity(65, 3, True, True) == 12  # windows of 4 + 1
    assert state_pool_capacity(5, 3, True, True) == 0
    assert state_pool_capacity(1, 3, True, False) >= 64  # no Mamba layers: no bound from states


def test_auto_max_num_seqs_is_lowered_to_the_capacity_and_a_given_one_is_refused() -> None:
    s = sizes(max_num_seqs=64, num_mamba_slots=41, max_num_seqs_auto=True)
    assert (s.max_num_seqs, s.state_pool_capacity) == (20, 20)
    # the KV pool is sized for the lowered count
    assert s.num_kv_blocks == 20 * (1024 // 16) + 1
    with pytest.raises(ConfigError, match=r"--max-num-seqs 64 .* it can run 40 \(lower --max-num-seqs to 40"):
        sizes(max_num_seqs=64, num_mamba_slots=41)
    # given, windows fit but not the checkpoint slots: runs as asked, capacity says less
    s = sizes(max_num_seqs=30, num_mamba_slots=41)
    assert (s.max_num_seqs, s.state_pool_capacity) == (30, 20)
    # auto, not even one sequence fits
    with pytest.raises(ConfigError, match="fewer than one sequence needs"):
        sizes(max_num_seqs=64, num_mamba_slots=2, max_num_seqs_auto=True)


def test_engine_lowers_max_num_seqs_says_why_and_runs_more_requests_than_it() -> None:
    slot = LLM("demo", dtype="float32", max_model_len=256).engine.em.sizes.mamba_bytes_per_slot
    llm = LLM("demo", dtype="float32", max_model_len=256, mamba_cache_memory=9 * slot)
    eng = llm.engine
    assert eng.em.sizes.num_mamba_slots == 9
    stats = eng.stats()
    assert stats["max_num_seqs"] == 4 == stats["mamba_state_capacity_seqs"]  # (9 - 1) // (1 + 1)
    assert int(eng.config.max_num_seqs) == 4
    # 10 requests: all finish, never more than 4 running, same tokens as a roomy engine
    prompts = [f"Request number {i} says" for i in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0)
    running: list[int] = []
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        running.append(int(eng.stats()["num_requests_running"]))
    assert max(running) <= 4 and len(outs) == 10
    roomy = LLM("demo", dtype="float32", max_model_len=256).generate(prompts, params)
    assert [outs[str(i)] for i in range(10)] == [list(r.outputs[0].token_ids) for r in roomy]


def test_config_explain_shows_the_capacity_and_a_given_count_is_refused_with_the_fix() -> None:
    import subprocess

    from cli_fixtures import run_cli

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return run_cli("config", "demo", "--explain", *flags)

    out = run("--num-mamba-slots", "21")
    assert out.returncode == 0, out.stderr
    assert "max_num_seqs_lowered" in out.stdout and "run 10 sequences" in out.stdout
    assert "state_pool_capacity" in out.stdout
    bad = run("--num-mamba-slots", "21", "--max-num-seqs", "64")
    assert bad.returncode == 2 and "lower --max-num-seqs to 20" in bad.stderr


def test_the_checkpoint_reserve_warning_names_only_fixes_that_exist() -> None:
    from hybridserve.config import EngineArgs
    from hybridserve.config.plan import plan_engine
    from hybridserve.model.demo import resolve_model_path

    demo = resolve_model_path("demo")

    def warning(**kw: Any) -> str:
        args = EngineArgs(model="demo", max_model_len=256, mamba_cache_mode="all", **kw)
        plan = plan_engine(args, demo)
        (d,) = [d for d in plan.resolved.decisions if d.code == "state_pool_below_checkpoint_reserve"]
        return d.message

    # room for 2 sequences with a checkpoint slot each: lowering --max-num-seqs to 2 is a fix
    assert "lower --max-num-seqs to 2 or give the state pool more memory" in warning(
        max_num_seqs=3, num_mamba_slots=6
    )
    # the window of one sequence fits, not its checkpoint slot: no count of sequences is a fix
    few = warning(max_num_seqs=1, num_mamba_slots=2)
    assert few.endswith("give the state pool more memory") and "--max-num-seqs to" not in few


def test_lowering_max_num_seqs_keeps_the_other_decisions(tmp_path: Any) -> None:
    """The plan resolves the policy again with the lowered count; the decisions that read the
    model folder (its generation config's sampling defaults) stay in the plan."""
    import json
    import shutil

    from hybridserve.config import EngineArgs
    from hybridserve.config.plan import plan_engine
    from hybridserve.model.demo import resolve_model_path

    model = tmp_path / "demo"
    shutil.copytree(resolve_model_path("demo"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6}), encoding="utf-8")
    for slots in (None, 9):  # 9 slots: max_num_seqs lowered to 4
        plan = plan_engine(EngineArgs(model=str(model), num_mamba_slots=slots), str(model))
        codes = {d.code for d in plan.resolved.decisions}
        assert "generation_config_defaults" in codes, (slots, codes)
        assert ("max_num_seqs_lowered" in codes) == (slots is not None)
