"""Overlapped steps (`LLMEngine.step` with `async_scheduling`): a step of decode rows computes on
the native library's background thread while the previous step's outputs are built. What every
request gets (tokens, text, finish and stop reasons, logprobs) is the same with steps overlapped
or not, whatever ends a request (its length, a stop string that is matched while the request's
next row already runs, an abort), and nothing leaks."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine import llm_engine
from hybridserve.engine.llm_engine import LLMEngine, PlanMode, choose_async_scheduling, plan_mode_from_env
from hybridserve.errors import ConfigError, StepError
from hybridserve.model.decode_step import PendingDecode

BASE: dict[str, Any] = dict(dtype="float64", cpu_threads=1, block_size=16, max_model_len=512, seed=0)


def _prompts(n: int = 6, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 780) for _ in range(70)]
    return [
        (shared if i % 2 == 0 else []) + [rng.randrange(3, 780) for _ in range(9 + 13 * i)] for i in range(n)
    ]


def _llm(overlapped: bool, **engine: Any) -> LLM:
    llm = LLM("demo", **{**BASE, **engine, "async_scheduling": overlapped})
    assert llm.engine.async_scheduling is overlapped
    return llm


def _what_requests_get(outs: list[Any]) -> list[tuple[Any, ...]]:
    got = []
    for o in outs:
        c = o.outputs[0]
        lps = None if c.logprobs is None else [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs]
        got.append((list(c.token_ids), c.text, c.finish_reason, c.stop_reason, lps))
    return got


def _both(engine: dict[str, Any], params: Any, prompts: list[list[int]]) -> list[list[tuple[Any, ...]]]:
    """What the requests get with steps overlapped and not; the overlapped engine really
    overlapped steps, and both engines end with nothing held."""
    runs = []
    for overlapped in (False, True):
        llm = _llm(overlapped, **engine)
        runs.append(_what_requests_get(llm.generate([{"prompt_token_ids": p} for p in prompts], params)))
        stats = llm.engine.stats()
        assert (stats["num_overlapped_steps"] > 0) is overlapped
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and not llm.engine.requests
        assert len(llm.engine.runner.batch) == 0  # (every sampling slot freed)
    return runs


def _stop_strings(prompts: list[list[int]]) -> list[str]:
    """For each prompt, a piece of the text its greedy output has half-way: a stop string the
    output reaches."""
    llm = _llm(False)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0)
    )
    stops = []
    for o in outs:
        text = o.outputs[0].text
        mid = len(text) // 2
        stops.append(text[mid : mid + 3] if len(text) >= 6 else "\x00never")
    return stops


def test_stop_strings_end_requests_the_same_way() -> None:
    prompts = _prompts()
    stops = _stop_strings(prompts)
    params = [SamplingParams(max_tokens=24, temperature=0, stop=[s]) for s in stops]
    sync, overlapped = _both({"max_num_seqs": 8}, params, prompts)
    assert sync == overlapped
    assert sum(r[2] == "stop" and isinstance(r[3], str) for r in sync) >= 3  # stop strings did end some


@pytest.mark.parametrize(
    "case",
    ["sampling", "bans", "prefix-cache+ngram", "draft-model", "preempting"],
)
def test_outputs_are_the_same_with_steps_overlapped_or_not(case: str) -> None:
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine: dict[str, Any] = {}
    params: Any = greedy
    if case == "sampling":
        # seeded draws, penalties over the output so far, logprobs: the rows are sampled after the
        # previous step's outputs were built
        params = [
            SamplingParams(
                max_tokens=20,
                temperature=0.9,
                top_p=0.95,
                seed=100 + i,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                repetition_penalty=1.2,
                logprobs=2,
                ignore_eos=True,
            )
            for i in range(len(prompts))
        ]
    elif case == "bans":
        # allowed tokens, and bad words whose masks read the output so far, as the penalties do
        params = [
            SamplingParams(
                max_tokens=20,
                temperature=0.9,
                seed=200 + i,
                allowed_token_ids=list(range(3, 400)),
                bad_words=["the", " and", "of the"],
                ignore_eos=True,
            )
            for i in range(len(prompts))
        ]
    elif case == "prefix-cache+ngram":
        engine = dict(
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )
        prompts = prompts + prompts[:3]  # second users of the same prompts hit the cache
    elif case == "draft-model":
        engine = dict(
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "demo"}
        )
    else:
        engine = dict(max_num_batched_tokens=128, num_kv_blocks=30, max_model_len=256)
    sync, overlapped = _both(engine, params, prompts)
    assert sync == overlapped
    assert all(len(r[0]) == 20 for r in sync)


def _engine(overlapped: bool, plan: PlanMode = "on", **engine: Any) -> LLMEngine:
    e = _llm(overlapped, max_num_seqs=8, **engine).engine
    e.stream_outputs = True  # every step's tokens come out, as in the server
    e.plan_mode = plan  # (by default a streaming engine does not plan ahead: these tests do)
    return e


def _collect(outs: list[Any], into: dict[str, list[int]]) -> None:
    for out in outs:
        got = into.setdefault(out.request_id, [])
        got.extend(out.outputs[0].delta_token_ids)
        if out.finished:
            assert got == list(out.outputs[0].token_ids)


def _drain(engine: LLMEngine, into: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        _collect(engine.step(), into)


def _start_overlapping(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Adds the prompts and steps until a step is left running in the background."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    got: dict[str, list[int]] = {}
    while engine._in_flight is None:
        _collect(engine.step(), got)
    return got


@pytest.mark.parametrize("plan", ["on", "off"])
def test_an_abort_while_a_step_runs_ends_only_that_request(plan: PlanMode) -> None:
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want: dict[str, list[int]] = {}
    ref = _engine(False)
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    _drain(ref, want)

    engine = _engine(True, plan)
    got = _start_overlapping(engine, prompts, params)
    assert engine.abort_request("r1")
    # requests still run: the reset is refused, as it is between synchronous steps, and the step
    # it completed first hands its outputs to the next call
    assert engine.reset_prefix_cache() is False
    assert engine._in_flight is None and engine.has_unfinished_requests()
    _drain(engine, got)
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"] and len(want["r0"]) == 16
    assert len(got.get("r1", [])) < 16
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["num_overlapped_steps"] > 0
    assert (stats["num_planned_steps"] > 0) is (plan == "on")


def test_which_steps_are_planned_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default overlapped steps are planned ahead while outputs are not streamed (the offline
    API); `HYBRIDSERVE_PLAN_AHEAD` forces it on or off."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for env, offline, streaming in (("", True, False), ("1", True, True), ("0", False, False)):
        if env:
            monkeypatch.setenv("HYBRIDSERVE_PLAN_AHEAD", env)
        else:
            monkeypatch.delenv("HYBRIDSERVE_PLAN_AHEAD", raising=False)
        llm = _llm(True)
        engine = llm.engine
        assert engine.plans_ahead is offline
        llm.generate(prompts, params)
        assert (engine.stats()["num_planned_steps"] > 0) is offline
        engine.stream_outputs = True
        assert engine.plans_ahead is streaming


def test_a_plan_ahead_value_not_understood_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, mode in (("ON", "on"), ("0", "off"), ("auto", "auto"), ("", "auto")):
        monkeypatch.setenv("HYBRIDSERVE_PLAN_AHEAD", value)
        assert plan_mode_from_env() == mode
    monkeypatch.setenv("HYBRIDSERVE_PLAN_AHEAD", "onn")  # a typo is not taken for auto
    with pytest.raises(ConfigError, match="HYBRIDSERVE_PLAN_AHEAD='onn'"):
        plan_mode_from_env()


def test_an_id_aborted_and_added_again_while_a_step_runs_is_a_new_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The running step's row of the aborted request is not the new request's: it is finished
    with no sampling (no draws, no drafts proposed for the id), and the new request gets exactly
    what it gets alone."""
    spec = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2, "model": "demo"}}
    old_prompt, new_prompt, other = _prompts(3, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def alone(prompt: list[int]) -> list[int]:
        return list(
            _llm(False, **spec).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        )

    engine = _engine(True, **spec)
    got = _start_overlapping(engine, [other, old_prompt], params)
    running = engine._in_flight
    assert running is not None and list(running.started.out.req_ids) == ["r0", "r1"]
    assert engine.abort_request("r1")
    got.pop("r1", None)
    engine.add_request("r1", {"prompt_token_ids": new_prompt}, params)
    seen: list[list[Any]] = []
    real_finish = engine.runner.finish

    def finish(started: Any, rows: Any) -> Any:
        seen.append(list(rows))
        return real_finish(started, rows)

    monkeypatch.setattr(engine.runner, "finish", finish)
    _drain(engine, got)
    assert seen[0][0] is not None and seen[0][1] is None  # the old r1's row: nothing to sample
    assert got["r1"] == alone(new_prompt) and len(got["r1"]) == 12
    assert got["r0"] == alone(other)
    assert engine.stats()["kv_blocks_used"] == 0


def test_weights_written_between_calls_while_a_step_runs_stop_the_native_step() -> None:
    """Each call checks the weights while the step in flight computes, for the step it starts:
    a write between two calls is seen there, and that step and every later one run through the
    model's forward, which reads the weights as they are (the native step's records would not)."""
    engine = _engine(True)
    got = _start_overlapping(
        engine, _prompts(3), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    before = engine.stats()["num_overlapped_steps"]
    assert before > 0 and engine._in_flight is not None
    with torch.no_grad():
        engine.runner.em.model.lm_head.weight.mul_(-1.0)
    assert not engine.runner.decode_weights_unchanged()
    _drain(engine, got)
    assert engine.stats()["num_overlapped_steps"] == before
    assert all(len(got[f"r{i}"]) == 12 for i in range(3))
    assert engine.stats()["kv_blocks_used"] == 0


def test_the_cache_resets_once_the_running_step_of_aborted_requests_ends() -> None:
    engine = _engine(True)
    _start_overlapping(engine, _prompts(3), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for rid in ("r0", "r1", "r2"):
        assert engine.abort_request(rid)
    assert engine._in_flight is not None  # the step of the aborted rows still runs
    assert engine.reset_prefix_cache()
    assert engine._in_flight is None
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_failed_background_step_fails_its_requests_and_the_engine_recovers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = _llm(True)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(2)]
    want = _what_requests_get(llm.generate(prompts, params))
    real_wait = PendingDecode.wait
    calls = {"n": 0}

    def failing(self: PendingDecode) -> Any:
        got = real_wait(self)  # the step ends before the failure is reported
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("decode step: a kernel failed after the caches were written")
        return got

    monkeypatch.setattr(PendingDecode, "wait", failing)
    with pytest.raises(StepError) as err:
        llm.generate(prompts, params)
    assert len(err.value.request_ids) == 2
    monkeypatch.undo()
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and not llm.engine.requests
    assert llm.engine._in_flight is None and len(llm.engine.runner.batch) == 0
    assert _what_requests_get(llm.generate(prompts, params)) == want


def test_a_request_the_step_before_a_failed_one_finished_gets_its_last_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overlapped, a step's tokens are committed at the start of the next call, before the next
    step starts: when that next step fails, the finished request still gets its output, and only
    the requests still running fail."""
    engine = _engine(True)
    short, long = _prompts(2)
    engine.add_request(
        "short", {"prompt_token_ids": short}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )
    engine.add_request(
        "long", {"prompt_token_ids": long}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    committed = {"short": False}
    real_close = engine._close

    def close(running: Any) -> Any:
        closed = real_close(running)
        committed["short"] |= any(d.request_id == "short" and d.finished for d in closed.deltas)
        return closed

    def failing(real: Any) -> Any:
        def start(*a: Any, **k: Any) -> Any:
            if committed["short"]:
                raise RuntimeError("the step after the short request's last token fails")
            return real(*a, **k)

        return start

    monkeypatch.setattr(engine, "_close", close)
    # (a step is started as scheduled, or as planned while the one before computed)
    monkeypatch.setattr(engine.runner, "start", failing(engine.runner.start))
    monkeypatch.setattr(engine.runner, "start_prepared", failing(engine.runner.start_prepared))
    got: dict[str, list[int]] = {}
    with pytest.raises(StepError) as err:
        _drain(engine, got)
    assert err.value.request_ids == ["long"]
    monkeypatch.undo()
    last = [o for o in engine.step() if o.request_id == "short"]
    assert len(last) == 1 and last[0].finished and len(last[0].outputs[0].token_ids) == 3
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0


def test_when_steps_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    with_step = SimpleNamespace(decode_step=object())
    without = SimpleNamespace(decode_step=None)
    assert choose_async_scheduling(False, with_step)[0] == "off"  # type: ignore[arg-type]
    assert choose_async_scheduling(True, with_step)[0] == "on"  # type: ignore[arg-type]
    # nothing runs in the background without the native decode step, whatever was asked
    assert choose_async_scheduling(True, without)[0] == "off"  # type: ignore[arg-type]
    monkeypatch.setattr(llm_engine, "usable_cores", lambda: 2)
    monkeypatch.setattr(llm_engine.native, "threads", lambda: 1)
    assert choose_async_scheduling(None, with_step)[0] == "streaming"  # type: ignore[arg-type]
    monkeypatch.setattr(llm_engine.native, "threads", lambda: 2)
    mode, why = choose_async_scheduling(None, with_step)  # type: ignore[arg-type]
    assert mode == "off" and "all of them compute threads" in why


def test_by_default_steps_overlap_while_outputs_are_streamed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_engine, "usable_cores", lambda: 2)
    llm = LLM("demo", **{**BASE, "async_scheduling": None})
    engine = llm.engine
    assert engine.overlap_mode == "streaming"
    prompt = {"prompt_token_ids": _prompts(1)[0]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
    # the LLM API builds outputs only when requests finish: no overlap
    assert engine.stats()["num_overlapped_steps"] == 0
    engine.stream_outputs = True  # as the server's engine
    assert engine.async_scheduling
    engine.add_request("s", prompt, params)
    streamed: dict[str, list[int]] = {}
    _drain(engine, streamed)
    assert engine.stats()["num_overlapped_steps"] > 0
    assert streamed["s"] == want


@pytest.mark.parametrize(
    ("argv", "want"), [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)]
)
def test_the_flag(argv: list[str], want: bool | None) -> None:
    import argparse

    from hybridserve.config import EngineArgs
    from hybridserve.config.cli import add_engine_args
    from hybridserve.errors import ConfigError

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineArgs.from_cli(p.parse_args(["demo", *argv])).async_scheduling is want
    with pytest.raises(ConfigError, match="--async-scheduling"):
        EngineArgs(model="demo", async_scheduling="yes").validate()  # type: ignore[arg-type]


def test_steps_planned_ahead_end_requests_by_stop_token_and_leave_the_next_turn_its_hit() -> None:
    """With overlapped steps each step of decode rows is planned while the one before computes,
    before that one's tokens are known. A request its stop token ends then already has a row in
    the planned step: the row runs writing nothing that is read, so the state after the request's
    last computed token, kept for its next turn, is the one that turn hits. Outputs and hits are
    those of synchronous steps."""
    prompts = _prompts(4)
    probe = _llm(False).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0)
    )
    # each request stops at a token its greedy output reaches at a different step
    stops = [list(o.outputs[0].token_ids)[3 + 3 * i] for i, o in enumerate(probe)]
    first = [SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[t]) for t in stops]
    runs = []
    for overlapped in (False, True):
        llm = _llm(overlapped, enable_prefix_caching=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], first)
        got = _what_requests_get(outs)
        # the next turns: each conversation so far and more
        follow = [p + list(o.outputs[0].token_ids) + [5, 6, 7] for p, o in zip(prompts, outs)]
        nexts = llm.generate(
            [{"prompt_token_ids": p} for p in follow], SamplingParams(max_tokens=6, temperature=0)
        )
        hits = [o.num_cached_tokens for o in nexts]
        runs.append((got, _what_requests_get(nexts), hits))
        stats = llm.engine.stats()
        assert (stats["num_planned_steps"] > 0) is overlapped
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
        # each next turn hit everything its request computed: all but the stop token
        assert hits == [len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outs)]
    assert [r[2] == "stop" for r in runs[0][0]] == [True] * len(prompts)
    assert runs[0] == runs[1]


def test_grammar_requests_end_the_same_way_with_steps_planned_ahead() -> None:
    """Requests under a JSON schema end by EOS when their grammar allows nothing else: each such
    end comes while the next step is planned with a row for the request. Seeded draws, the
    grammar's masks and the ends are those of synchronous steps, and nothing leaks."""
    from test_structured_outputs import PROMPTS, SCHEMA

    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA})
        for s in range(8)
    ]
    runs = []
    for overlapped in (False, True):
        llm = _llm(overlapped, dtype="float32", enable_prefix_caching=True, max_model_len=1024)
        outs = llm.generate([PROMPTS[s % 4] for s in range(8)], params)
        runs.append(_what_requests_get(outs))
        stats = llm.engine.stats()
        assert (stats["num_planned_steps"] > 0) is overlapped
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert all(r[2] == "stop" for r in runs[0])
    assert runs[0] == runs[1]


def test_a_plan_whose_every_request_ended_is_dropped() -> None:
    """The last request ends by its stop token while the next step is planned: no step runs, the
    plan is dropped, and its output buffer given back (none stays lent)."""
    prompt = _prompts(1)[0]
    probe = _llm(False).generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0))
    stop = list(probe[0].outputs[0].token_ids)[6]
    llm = _llm(True)
    step = llm.engine.runner.decode_step
    assert step is not None
    for _ in range(3):
        out = llm.generate(
            {"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
        )[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == stop
        assert step._lent == []
    assert llm.engine.stats()["num_planned_steps"] > 0


def _two_decoding_and_a_long_prompt() -> tuple[
    list[list[int]], list[int], SamplingParams, dict[str, list[int]]
]:
    """Two short prompts (r0, r1) and a long one whose chunk is too big for the native step, and
    what each gets without overlap (a request's tokens do not depend on what shares its steps)."""
    prompts = _prompts(2)
    long_prompt = [random.Random(9).randrange(3, 780) for _ in range(400)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = _llm(False).generate([{"prompt_token_ids": p} for p in [*prompts, long_prompt]], params)
    return (
        prompts,
        long_prompt,
        params,
        dict(zip(["r0", "r1", "long"], (list(o.outputs[0].token_ids) for o in outs))),
    )


def test_outputs_built_before_a_forward_in_the_engine_thread_are_handed_over_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step whose forward runs in the engine thread (a long prompt's chunk, too big for the
    native step) after a step that ran in the background: the background step's outputs go to
    `early_outputs` before that forward runs, not after it with its own; together they are
    what the requests get without overlap."""
    prompts, long_prompt, params, want = _two_decoding_and_a_long_prompt()

    engine = _engine(True)
    got = _start_overlapping(engine, prompts, params)
    while any(len(got.get(f"r{i}", [])) < 2 for i in range(2)):
        _collect(engine.step(), got)
    events: list[tuple[str, list[str]]] = []

    def early(outs: list[Any]) -> None:
        events.append(("early", sorted(o.request_id for o in outs)))
        _collect(outs, got)

    engine.early_outputs = early
    finish = engine.runner.finish

    def spy(started: Any, rows: Any) -> Any:
        events.append(("forward" if started.running is None else "wait", sorted(started.out.req_ids)))
        return finish(started, rows)

    monkeypatch.setattr(engine.runner, "finish", spy)
    engine.add_request("long", {"prompt_token_ids": long_prompt}, params)
    assert engine._in_flight is not None  # a decode step of r0, r1 computes in the background
    _collect(engine.step(), got)
    assert events == [
        ("wait", ["r0", "r1"]),
        ("early", ["r0", "r1"]),  # their tokens from the background step ...
        ("forward", ["long", "r0", "r1"]),  # ... before the long prompt's forward
    ]
    _drain(engine, got)
    assert got == want
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.requests


def test_a_hand_over_that_fails_loses_no_output(caplog: pytest.LogCaptureFixture) -> None:
    """`early_outputs` raising: the outputs it was given come back from `step` with the step's own,
    and the requests end as without it."""
    prompts, long_prompt, params, want = _two_decoding_and_a_long_prompt()
    engine = _engine(True)
    got = _start_overlapping(engine, prompts, params)
    calls: list[int] = []

    def broken(outs: list[Any]) -> None:
        calls.append(len(outs))
        raise RuntimeError("the consumer is gone")

    engine.early_outputs = broken
    engine.add_request("long", {"prompt_token_ids": long_prompt}, params)
    _drain(engine, got)
    assert calls and got == want
    assert "handing over a step's outputs before the next forward failed" in caplog.text
