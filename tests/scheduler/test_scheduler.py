"""The Rust scheduler through its Python wrapper (hybridserve._core.Scheduler).

The tests play the model: they read each SchedulerOutput, return deterministic tokens for the rows
that have logits, and check the arrays against the ForwardBatch contract (model/batch.py).
Config: ResolvedConfig.for_tests -> B = 4, M = 8, budget 64 tokens, 16 seqs, window 1 + K.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve import _core as core

B, M, BUDGET = 4, 8, 64


def make(mode: str = "align", k: int = 0, blocks: int = 256, slots: int = 128) -> core.Scheduler:
    return core.Scheduler(core.ResolvedConfig.for_tests(mode, k), blocks, slots)


def check_arrays(o: core.SchedulerOutput) -> None:
    """Structural invariants of one output."""
    r = o.num_rows
    qsl = o.query_start_loc
    assert qsl.dtype == np.int64 and qsl.shape == (r + 1,) and qsl[0] == 0
    t = int(qsl[-1])
    assert t == o.num_scheduled_tokens == o.input_ids.shape[0] == o.positions.shape[0]
    assert o.slot_mapping.shape == (t,)
    nc, sl = o.num_computed_tokens, o.seq_lens
    assert np.array_equal(sl - nc, np.diff(qsl))
    bt = o.block_table
    assert bt.shape[0] == r
    for i in range(r):
        pos = o.positions[qsl[i] : qsl[i + 1]]
        assert np.array_equal(pos, np.arange(nc[i], sl[i]))
        blk = bt[i, pos // B]
        assert (blk > 0).all()
        assert np.array_equal(o.slot_mapping[qsl[i] : qsl[i + 1]], blk * B + pos % B)
    assert o.state_write_slots.shape[0] == r
    assert o.has_initial_state.dtype == np.bool_
    assert np.array_equal(o.has_initial_state, nc > 0)
    assert (o.state_read_slot[~o.has_initial_state] == 0).all()
    assert (o.state_read_slot[o.has_initial_state] > 0).all()
    nl = o.num_logits
    assert nl.dtype == np.int32 and o.logits_indices.shape == (int(nl.sum()),)
    assert o.state_copies.shape[1] == 2
    assert o.emit_row.shape == o.emit_token.shape == o.emit_slot.shape


def drive(
    s: core.Scheduler,
    token_of: dict[str, int] | None = None,
    accept: int | None = None,
    drafts: int = 0,
    max_steps: int = 500,
) -> tuple[dict[str, list[int]], dict[str, str], list[core.SchedulerOutput]]:
    """Runs until nothing is unfinished. Token for a row = 1000 + position (deterministic)."""
    out_tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    outputs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        o = s.schedule()
        if o.num_rows == 0:
            continue
        check_arrays(o)
        outputs.append(o)
        nl, sl = o.num_logits, o.seq_lens
        toks, ns = [], []
        for i in range(o.num_rows):
            n = int(nl[i])
            if n == 0:
                ns.append(0)
                continue
            a = n if accept is None else min(n, accept)
            ns.append(a)
            for j in range(a):
                toks.append(1000 + int(sl[i]) - n + j + 1)
        nd = np.full(o.num_rows, drafts, dtype=np.int32)
        dr = np.arange(int(nd.sum()), dtype=np.int32) % 7 + 1
        deltas = s.update_from_output(o, np.array(toks, dtype=np.int32), np.array(ns, dtype=np.int32), dr, nd)
        for d in deltas:
            out_tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    return out_tokens, reasons, outputs


def test_prefill_then_decode_arrays_and_length_finish() -> None:
    s = make("none")
    s.add_request("a", list(range(1, 31)), max_tokens=3)
    o = s.schedule()
    check_arrays(o)
    assert o.req_ids == ["a"] and o.num_decodes == 0
    assert np.array_equal(o.input_ids, np.arange(1, 31))
    assert list(o.num_logits) == [1] and list(o.logits_indices) == [29]
    assert o.input_ids is o.input_ids  # cached, zero-copy after the first access
    d = s.update_from_output(o, np.array([77], dtype=np.int32), np.array([1], dtype=np.int32))
    assert [(x.request_id, x.new_token_ids, x.finished) for x in d] == [("a", [77], False)]
    o = s.schedule()
    assert o.num_decodes == 1 and list(o.input_ids) == [77] and list(o.positions) == [30]
    assert bool(o.has_initial_state[0])
    assert o.state_read_slot[0] == o.state_write_slots[0, 0]
    s.update_from_output(o, np.array([78], dtype=np.int32), np.array([1], dtype=np.int32))
    o = s.schedule()
    d = s.update_from_output(o, np.array([79], dtype=np.int32), np.array([1], dtype=np.int32))
    assert d[0].finished and d[0].finish_reason == "length" and d[0].stop_token_id is None
    assert not s.has_unfinished_requests()
    o = s.schedule()
    assert o.num_rows == 0 and o.finished_req_ids == ["a"]
    st = s.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0


_LAYOUT_ARRAYS = [
    "input_ids", "positions", "slot_mapping", "block_table", "state_read_slot", "state_write_slots",
    "query_start_loc", "logits_indices", "has_initial_state", "emit_row", "emit_token", "emit_slot",
]  # fmt: skip


def _check_step_layout(o: core.SchedulerOutput) -> None:
    got = o.step_layout()
    assert got is not None
    sizes = [len(o.input_ids), o.num_rows, o.num_decodes, len(o.logits_indices), len(o.emit_row)]
    assert got[:7] == [*sizes, o.block_table.shape[1], o.state_write_slots.shape[1]]
    assert got[7:] == [getattr(o, n).ctypes.data for n in _LAYOUT_ARRAYS]


def test_step_layout_is_that_of_the_getters_arrays_for_prefill_and_decode_steps() -> None:
    s = make("align")
    s.add_request("a", list(range(1, 31)), max_tokens=3)
    s.add_request("b", list(range(1, 12)), max_tokens=3)
    o = s.schedule()
    prefills = 0
    while o.num_decodes < o.num_rows:
        _check_step_layout(o)  # prefill rows
        prefills += 1
        done = (np.asarray(o.num_logits) > 0).astype(np.int32)
        s.update_from_output(o, np.full(int(done.sum()), 7, dtype=np.int32), done)
        o = s.schedule()
    assert prefills > 0 and o.num_decodes == o.num_rows == 2
    _check_step_layout(o)
    s.update_from_output(o, np.full(2, 7, dtype=np.int32), np.ones(2, dtype=np.int32))
    while s.has_unfinished_requests():
        o = s.schedule()
        if o.num_rows == 0:
            assert o.step_layout() is None
        s.update_from_output(o, np.full(o.num_rows, 7, dtype=np.int32), np.ones(o.num_rows, dtype=np.int32))
    assert s.schedule().step_layout() is None  # a step without rows


def test_chunked_prefill_under_budget_and_decodes_first() -> None:
    s = make("none")
    s.add_request("long", list(range(1, 151)), max_tokens=4)
    s.add_request("short", [5, 6, 7], max_tokens=4)
    o = s.schedule()
    assert o.req_ids == ["long"] and o.num_scheduled_tokens == BUDGET
    assert list(o.num_logits) == [0]
    s.update_from_output(o, np.array([], dtype=np.int32), np.array([0], dtype=np.int32))
    toks, reasons, outs = drive(s)
    assert reasons == {"long": "length", "short": "length"}
    for o in outs:
        assert o.num_scheduled_tokens <= BUDGET
        # decode rows first
        nl = o.num_logits
        qlen = np.diff(o.query_start_loc)
        assert (o.num_computed_tokens[: o.num_decodes] > 0).all()
        assert (qlen[: o.num_decodes] == nl[: o.num_decodes]).all()


def test_align_chunks_end_on_boundaries_and_emit_checkpoints() -> None:
    s = make("align")
    s.add_request("a", list(range(1, 101)), max_tokens=2)
    s.add_request("b", list(range(1, 41)), max_tokens=2)
    _, _, outs = drive(s)
    saw_emit = False
    for o in outs:
        nc, sl, nl = o.num_computed_tokens, o.seq_lens, o.num_logits
        for i in range(o.num_decodes, o.num_rows):
            if nl[i] == 0:  # not the last chunk of the known tokens
                assert sl[i] % M == 0, (nc[i], sl[i])
        for e in range(o.emit_row.shape[0]):
            r, t = int(o.emit_row[e]), int(o.emit_token[e])
            assert r >= o.num_decodes
            assert (nc[r] + t + 1) % M == 0
            saw_emit = True
    assert saw_emit


def test_prefix_hit_copies_checkpoint_into_window() -> None:
    s = make("align")
    prompt = list(range(1, 41))
    s.add_request("a", prompt, max_tokens=1)
    drive(s)
    s.add_request("b", prompt + [9, 9], max_tokens=1)
    o = s.schedule()
    check_arrays(o)
    assert int(o.num_computed_tokens[0]) == 40  # 40 is a multiple of M
    assert o.state_copies.shape == (1, 2)
    assert o.state_copies[0, 1] == o.state_write_slots[0, 0] == o.state_read_slot[0]
    d = s.update_from_output(o, np.array([5], dtype=np.int32), np.array([1], dtype=np.int32))
    assert d[0].num_cached_tokens == 40 and d[0].finished
    assert s.stats()["prefix_hit_tokens"] == 40


def test_spec_verify_rows_and_partial_acceptance() -> None:
    k = 3
    s = make("align", k)
    s.add_request("a", list(range(1, 17)), max_tokens=50)  # 16 = 2 M: one chunk
    o = s.schedule()
    s.update_from_output(
        o,
        np.array([11], dtype=np.int32),
        np.array([1], dtype=np.int32),
        np.array([21, 22, 23], dtype=np.int32),
        np.array([3], dtype=np.int32),
    )
    o = s.schedule()
    check_arrays(o)
    assert o.num_decodes == 1 and list(o.input_ids) == [11, 21, 22, 23]
    assert list(o.draft_token_ids) == [21, 22, 23] and list(o.num_draft_tokens) == [3]
    assert list(o.num_logits) == [4] and list(o.logits_indices) == [0, 1, 2, 3]
    window = o.state_write_slots[0].copy()
    assert (window > 0).all() and len(set(window)) == 4
    # accept 1 draft + correction token: live state is window[1]
    s.update_from_output(o, np.array([21, 30], dtype=np.int32), np.array([2], dtype=np.int32))
    assert s.get_token_ids("a") == list(range(1, 17)) + [11, 21, 30]
    assert s.get_num_computed_tokens("a") == 18
    o = s.schedule()
    assert list(o.input_ids) == [30] and list(o.positions) == [18]
    assert o.state_read_slot[0] == window[1]
    st = s.stats()
    assert st["spec_drafted_tokens"] == 3 and st["spec_accepted_tokens"] == 1


def test_stop_token_discards_later_tokens() -> None:
    s = make("none", 3)
    s.add_request("a", [1, 2, 3], max_tokens=20, eos_token_id=2, stop_token_ids=[99])
    o = s.schedule()
    s.update_from_output(
        o,
        np.array([5], dtype=np.int32),
        np.array([1], dtype=np.int32),
        np.array([6, 99, 7], dtype=np.int32),
        np.array([3], dtype=np.int32),
    )
    o = s.schedule()
    d = s.update_from_output(o, np.array([6, 99, 7, 8], dtype=np.int32), np.array([4], dtype=np.int32))
    assert d[0].new_token_ids == [6, 99] and d[0].finish_reason == "stop" and d[0].stop_token_id == 99
    assert s.stats()["kv_blocks_used"] == 0


def test_max_tokens_caps_drafts() -> None:
    s = make("none", 4)
    s.add_request("a", [1, 2, 3], max_tokens=3)
    o = s.schedule()
    s.update_from_output(
        o,
        np.array([5], dtype=np.int32),
        np.array([1], dtype=np.int32),
        np.array([6, 7, 8, 9], dtype=np.int32),
        np.array([4], dtype=np.int32),
    )
    o = s.schedule()
    assert list(o.num_draft_tokens) == [1]  # 2 tokens left: 1 draft + bonus
    d = s.update_from_output(o, np.array([6, 7], dtype=np.int32), np.array([2], dtype=np.int32))
    assert d[0].new_token_ids == [6, 7] and d[0].finish_reason == "length"


def test_abort_frees_everything_and_is_reported() -> None:
    s = make("align", 2)
    s.add_request("a", list(range(1, 50)), max_tokens=10)
    s.add_request("b", list(range(1, 20)), max_tokens=10)
    o = s.schedule()
    assert s.abort_request("a")
    assert not s.abort_request("a") and not s.abort_request("zzz")
    ns = np.array([0 if x == 0 else 1 for x in o.num_logits], dtype=np.int32)
    d = s.update_from_output(o, np.full(int(ns.sum()), 3, dtype=np.int32), ns)
    assert all(x.request_id != "a" for x in d)
    assert s.abort_request("b")
    o = s.schedule()
    assert sorted(o.finished_req_ids) == ["a", "b"]
    st = s.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == st["num_waiting"] == 0
    assert st["mamba_slots_used"] == st["checkpoints_committed"] + st["checkpoints_pending"]


def test_preemption_with_tiny_pool_completes_everything() -> None:
    # 20 usable blocks of 4 tokens: three 30-token requests cannot all grow at once.
    s = make("none", 0, blocks=21, slots=64)
    for i in range(3):
        s.add_request(f"r{i}", [i + 1] * 30, max_tokens=20)
    toks, reasons, _ = drive(s)
    assert reasons == {f"r{i}": "length" for i in range(3)}
    assert all(len(toks[f"r{i}"]) == 20 for i in range(3))
    st = s.stats()
    assert st["num_preemptions_total"] > 0
    assert st["kv_blocks_used"] == 0


def test_invalid_input_raises() -> None:
    s = make("none")
    with pytest.raises(core.InvalidRequestError):
        s.add_request("a", [], max_tokens=3)
    with pytest.raises(core.InvalidRequestError):
        s.add_request("a", [1, -2], max_tokens=3)
    with pytest.raises(core.InvalidRequestError):
        s.add_request("a", [1], max_tokens=0)
    s.add_request("a", [1, 2], max_tokens=3)
    with pytest.raises(core.InvalidRequestError):
        s.add_request("a", [1, 2], max_tokens=3)
    o = s.schedule()
    with pytest.raises(core.InvalidRequestError):
        s.update_from_output(o, np.array([1, 2], dtype=np.int32), np.array([2], dtype=np.int32))
    with pytest.raises(core.InternalError):
        s.schedule()  # the previous step has not been updated
    # int64 input is accepted as well
    d = s.update_from_output(o, np.array([4], dtype=np.int64), np.array([1], dtype=np.int64))
    assert d[0].new_token_ids == [4]
    with pytest.raises(core.InvalidRequestError):
        s.get_token_ids("nope")
    with pytest.raises(core.ConfigError):
        core.Scheduler(core.ResolvedConfig.for_tests("align", 0), 1, 16)


def test_stats_keys() -> None:
    st = make("align", 2).stats()
    expected = {
        "num_running", "num_waiting", "num_preempted", "num_preemptions_total", "num_steps",
        "num_scheduled_tokens", "num_scheduled_tokens_total", "num_finished_total",
        "num_aborted_total", "prefix_queried_tokens", "prefix_hit_tokens", "prefix_lost_tokens",
        "prefix_preempted_queried_tokens", "prefix_preempted_hit_tokens",
        "spec_drafted_tokens", "spec_accepted_tokens", "checkpoints_emitted",
        "checkpoints_published", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached_free",
        "mamba_slots_total", "mamba_slots_used", "checkpoints_committed", "checkpoints_pending",
        "checkpoint_bytes", "cache_queried_tokens", "cache_hit_tokens", "cache_kv_hit_tokens",
        "cache_lost_tokens", "kv_evictions", "checkpoint_evictions", "max_num_batched_tokens",
        "max_num_seqs", "num_speculative_tokens", "prefix_hits_grid", "prefix_hits_branch",
        "prefix_hits_last_token", "prefix_hit_tokens_grid", "prefix_hit_tokens_branch",
        "prefix_hit_tokens_last_token", "checkpoints_kept", "checkpoints_grid", "checkpoints_branch",
        "checkpoints_last_token", "prefix_hits_declared", "prefix_hit_tokens_declared",
        "checkpoints_declared", "kv_evictions_useless", "checkpoint_evictions_stale",
        "checkpoint_evictions_for_checkpoint", "checkpoint_evictions_for_window",
        "checkpoint_evictions_for_kv", "kv_blocks_cached", "mamba_slots_window", "kv_events_emitted",
    }  # fmt: skip
    flops = {"prefill_flops_queried", "prefill_flops_saved"} | {
        f"checkpoint_reuse_rate_{kind}" for kind in ("grid", "branch", "last_token", "declared")
    }
    assert set(st) == expected | flops
    assert all(isinstance(st[k], int) for k in expected)
    assert all(isinstance(st[k], float) for k in flops)
    assert st["num_speculative_tokens"] == 2 and st["kv_blocks_total"] == 255


def test_capacity_finish_is_returned_by_an_empty_update() -> None:
    # 4 usable blocks = 16 tokens: a 14-token prompt cannot grow past 16 tokens even alone.
    s = make("none", blocks=5)
    s.add_request("a", np.arange(1, 15, dtype=np.int32), max_tokens=10)  # numpy prompt accepted
    got = []
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        o = s.schedule()
        nl = o.num_logits
        got += s.update_from_output(o, np.full(int(nl.sum()), 3, dtype=np.int32), nl)
    assert [(d.request_id, d.finish_reason) for d in got if d.finished] == [("a", "length")]
    assert not s.has_unfinished_requests()
    assert s.stats()["kv_blocks_used"] == 0


def test_hash_seed_takes_any_int() -> None:
    cfg = core.ResolvedConfig.for_tests("align", 0)
    for seed in (0, -5, 2**64 - 1):
        s = core.Scheduler(cfg, 64, 32, seed)
        s.add_request("a", list(range(1, 21)), max_tokens=1)
        o = s.schedule()
        assert o.num_scheduled_tokens == 16
    with pytest.raises(TypeError):
        core.Scheduler(cfg, 64, 32, "x")


def test_an_output_of_another_scheduler_cannot_close_this_ones_step() -> None:
    a, b = make(), make()
    a.add_request("x", list(range(5, 50)), max_tokens=4)
    b.add_request("y", [5, 6, 7, 8, 9], max_tokens=4)
    oa, ob = a.schedule(), b.schedule()
    assert oa.step_id == ob.step_id  # step ids count from 0 in every scheduler
    with pytest.raises(core.InvalidRequestError, match="not returned by this scheduler"):
        b.update_from_output(oa, np.zeros(0, np.int32), np.zeros(oa.num_rows, np.int32))
    # b's own step is still open and closes normally
    assert b.open_step_output() is ob
    d = b.update_from_output(ob, np.array([11], np.int32), np.array([1], np.int32))
    assert [x.request_id for x in d] == ["y"] and list(d[0].new_token_ids) == [11]


@pytest.mark.parametrize(
    "blocks, slots", [(2**63, 64), (core.MAX_KV_BLOCKS + 1, 64), (256, core.MAX_MAMBA_SLOTS + 1)]
)
def test_pools_beyond_what_the_scheduler_tracks_are_config_errors(blocks: int, slots: int) -> None:
    with pytest.raises(core.ConfigError, match="at most"):
        core.Scheduler(core.ResolvedConfig.for_tests(), blocks, slots)


def _planned_ahead() -> tuple[core.Scheduler, core.SchedulerOutput, core.SchedulerOutput]:
    """A decode step updated, with the step after it planned while it was in flight."""
    s = make("none")
    s.add_request("a", [1, 2, 3], max_tokens=50)
    o = s.schedule()
    s.update_from_output(o, np.array([7], np.int32), np.array([1], np.int32))
    o = s.schedule()
    planned = s.schedule_ahead()
    assert planned is not None
    s.update_from_output(o, np.array([8], np.int32), np.array([1], np.int32))
    return s, o, planned


def test_a_refused_cancel_or_a_stray_plan_leaves_the_step_planned_ahead() -> None:
    """Calls that change nothing keep the plan confirmable: a cancel_step of a step already
    updated (refused) and a schedule_ahead with no step in flight (None) both dropped it, and
    confirm_ahead then refused the plan."""
    s, o, planned = _planned_ahead()
    with pytest.raises(core.InvalidRequestError):
        s.cancel_step(o)
    assert s.confirm_ahead(planned) is True
    s, o, planned = _planned_ahead()
    assert s.schedule_ahead() is None
    assert s.confirm_ahead(planned) is True
