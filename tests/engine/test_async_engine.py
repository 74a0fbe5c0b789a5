"""AsyncEngine: streams end on every path (finish, shutdown mid-request, a request racing shutdown)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from hybridserve.config import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.output_sink import MERGE_BEHIND
from hybridserve.errors import EngineDeadError
from hybridserve.sampling.params import SamplingParams

ARGS = EngineArgs(model="demo", dtype="float32", max_model_len=512, max_num_seqs=4)


async def _collect(engine: AsyncEngine, rid: str, params: SamplingParams) -> list:
    return [o async for o in engine.generate("The quick brown fox", params, rid)]


def test_stream_finishes_then_shutdown_refuses_new_requests() -> None:
    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        outs = await asyncio.wait_for(
            _collect(engine, "a", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)), 60
        )
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "b", SamplingParams(max_tokens=5))

    asyncio.run(main())


def test_shutdown_ends_a_running_stream() -> None:
    async def main() -> None:
        # (a long answer: the shutdown from another thread must land before it ends on its own)
        engine = AsyncEngine(dataclasses.replace(ARGS, max_model_len=4096))
        await engine.wait_ready()
        params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        gen = engine.generate("The quick brown fox", params, "long")
        first = await asyncio.wait_for(gen.__anext__(), 60)
        assert not first.finished
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        rest = await asyncio.wait_for(_drain(gen), 30)  # ends instead of waiting forever
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(rest[-1].outputs[0].token_ids) < 4000

    asyncio.run(main())


async def _drain(gen) -> list:  # noqa: ANN001
    return [o async for o in gen]


def test_a_request_racing_shutdown_is_refused_not_left_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    # generate() checked `ready` just before the engine thread began its final sweep: the sweep
    # has already run when the stream would be registered. Without the closed flag it would wait
    # forever for an engine that is gone.
    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        engine.shutdown()
        assert not engine._thread.is_alive()
        monkeypatch.setattr(AsyncEngine, "ready", property(lambda self: True))
        monkeypatch.setattr(engine._thread, "is_alive", lambda: True)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(_collect(engine, "late", SamplingParams(max_tokens=3)), 10)
        assert not engine._streams

    asyncio.run(main())


def test_a_request_id_reused_right_after_a_cancel_gets_its_own_outputs() -> None:
    # The first consumer leaves mid-stream; its abort is still queued when the id is used again.
    # The old request's abort (and outputs) must not reach the new stream, and the new request
    # must not be left running with nobody reading it.
    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        try:
            for _ in range(5):
                old = engine.generate("old prompt", SamplingParams(max_tokens=100, ignore_eos=True), "rid")
                await asyncio.wait_for(old.__anext__(), 60)
                await old.aclose()
                params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
                outs = await asyncio.wait_for(
                    _drain(engine.generate("a brand new prompt", params, "rid")), 60
                )
                assert outs[-1].prompt == "a brand new prompt"
                assert outs[-1].outputs[0].finish_reason == "length"
                assert len(outs[-1].outputs[0].token_ids) == 5
            await asyncio.sleep(0.2)
            assert engine.stats()["num_running"] == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_consumer_whose_loop_closed_does_not_stop_the_engine() -> None:
    engine = AsyncEngine(ARGS)

    def abandon() -> None:
        loop = asyncio.new_event_loop()

        async def first() -> None:
            await engine.wait_ready()
            gen = engine.generate("abandoned", SamplingParams(max_tokens=200, ignore_eos=True), "gone")
            await gen.__anext__()

        loop.run_until_complete(first())
        loop.close()  # without closing the generator: its stream stays registered

    abandon()

    async def main() -> None:
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        outs = await asyncio.wait_for(_drain(engine.generate("innocent", params, "innocent")), 60)
        assert outs[-1].outputs[0].finish_reason == "length"
        assert engine.ready
        await asyncio.sleep(0.2)
        assert engine.stats()["num_running"] == 0  # the abandoned request was aborted too

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_request_whose_row_fails_ends_with_an_error_and_the_others_finish() -> None:
    from hybridserve.errors import HybridServeError

    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        assert engine.engine is not None
        runner = engine.engine.runner
        original = runner.sampler.sample

        def sample(logits, rows, **kw):  # noqa: ANN001, ANN003, ANN202 - the sampler's own signature
            if any(r.params.seed == 4242 for r in rows):
                raise ValueError("injected sampling fault")
            return original(logits, rows, **kw)

        runner.sampler.sample = sample  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        bad = SamplingParams(max_tokens=6, temperature=0.7, seed=4242, ignore_eos=True)
        results = await asyncio.wait_for(
            asyncio.gather(
                _collect(engine, "ok-1", params),
                _collect(engine, "bad", bad),
                _collect(engine, "ok-2", params),
                return_exceptions=True,
            ),
            60,
        )
        engine.shutdown()
        ok1, failed, ok2 = results
        assert isinstance(failed, HybridServeError) and "injected sampling fault" in str(failed)
        for outs in (ok1, ok2):
            assert isinstance(outs, list) and outs[-1].finished
            assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 6

    asyncio.run(main())


def _fail_the_step_that_ends_short(
    llm: Any, message: str, before_raise: Callable[[list], None] = lambda outputs: None
) -> threading.Event:
    """Wraps the engine's step: the first step whose outputs end request "short" calls
    `before_raise` with them and raises RuntimeError(message) instead of returning them (a failure
    outside the forward). The event is set once it has."""
    original = llm.step
    failed = threading.Event()

    def step():  # noqa: ANN202
        outputs = original()
        if failed.is_set() or not any(o.request_id == "short" and o.finished for o in outputs):
            return outputs
        failed.set()
        before_raise(outputs)
        raise RuntimeError(message)

    llm.step = step
    return failed


def test_a_failed_step_fails_only_what_it_ran() -> None:
    """A step that fails outside the forward (the engine keeps serving) ends the requests it ran
    with the error, and no other: a request that finished just before gets its last output (the
    engine carried it), and a request whose add was queued while the step failed runs in full."""
    from hybridserve.errors import HybridServeError

    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        llm = engine.engine
        assert llm is not None
        loop = asyncio.get_running_loop()
        late: list[asyncio.Task[list]] = []

        def before_raise(outputs: list) -> None:
            # a request arrives while this step fails: its stream is registered, its add queued
            loop.call_soon_threadsafe(
                lambda: late.append(asyncio.ensure_future(_collect(engine, "late", params(4))))
            )
            deadline = time.monotonic() + 30
            while "late" not in engine._streams and time.monotonic() < deadline:
                time.sleep(0.001)
            # as the engine does when it fails after building its outputs: they are carried
            llm._carried = outputs + llm._carried

        failed = _fail_the_step_that_ends_short(
            llm, "injected failure after the outputs were built", before_raise
        )

        def params(n: int) -> SamplingParams:
            return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

        short, long = await asyncio.wait_for(
            asyncio.gather(
                _collect(engine, "short", params(3)),
                _collect(engine, "long", params(400)),
                return_exceptions=True,
            ),
            60,
        )
        assert failed.is_set() and late
        late_outs = await asyncio.wait_for(late[0], 60)
        engine.shutdown()
        assert isinstance(short, list) and short[-1].finished
        assert short[-1].outputs[0].finish_reason == "length" and len(short[-1].outputs[0].token_ids) == 3
        assert isinstance(long, HybridServeError) and "injected failure" in str(long)
        assert late_outs[-1].finished and late_outs[-1].outputs[0].finish_reason == "length"
        assert len(late_outs[-1].outputs[0].token_ids) == 4

    asyncio.run(main())


def test_a_request_whose_last_output_a_failed_step_lost_ends_with_an_error() -> None:
    """A step that fails after the engine forgot a finished request, without its last output to
    hand over: the request's stream ends with an error instead of waiting forever."""
    from hybridserve.errors import HybridServeError

    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        llm = engine.engine
        assert llm is not None
        failed = _fail_the_step_that_ends_short(llm, "injected failure that loses the outputs (not carried)")
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        result = await asyncio.wait_for(
            asyncio.gather(_collect(engine, "short", params), return_exceptions=True), 30
        )
        engine.shutdown()
        assert failed.is_set()
        assert isinstance(result[0], HybridServeError), result

    asyncio.run(main())


def test_a_reader_that_falls_behind_gets_the_outputs_merged() -> None:
    """A stream's reader MERGE_BEHIND outputs behind has the next ones merged into the last (their
    deltas joined): a reader that takes nothing until its request is done gets a few outputs, not
    one per step (each a copy of the tokens so far), and the joined deltas are the whole answer."""

    async def main() -> None:
        engine = AsyncEngine(dataclasses.replace(ARGS, max_model_len=1024))
        await engine.wait_ready()
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True, logprobs=2)
        gen = engine.generate("The quick brown fox", params, "slow")
        first = await asyncio.wait_for(gen.__anext__(), 60)  # the request runs
        deadline = time.monotonic() + 60
        while engine.stats().get("num_requests_running", 1) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # nothing read meanwhile
        rest = await asyncio.wait_for(_drain(gen), 60)
        engine.shutdown()
        outs = [first, *rest]
        assert len(outs) <= MERGE_BEHIND + 2, len(outs)
        final = outs[-1].outputs[0]
        assert final.finish_reason == "length" and len(final.token_ids) == 300
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == final.text
        assert final.logprobs is not None and len(final.logprobs) == 300

    asyncio.run(main())


def test_a_step_wakes_each_event_loop_once_for_all_its_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four streams on one loop: each step's outputs arrive in one thread-safe call (one write to
    the loop's wake-up pipe), in order, not one call per request."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def main() -> None:
        engine = AsyncEngine(ARGS)
        await engine.wait_ready()
        loop = asyncio.get_running_loop()
        calls = {"engine": 0}
        real = loop.call_soon_threadsafe

        def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if threading.current_thread() is engine._thread:
                calls["engine"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        try:
            before = engine.stats()["num_steps"]
            outs = await asyncio.wait_for(
                asyncio.gather(*(_collect(engine, f"r{i}", params) for i in range(4))), 60
            )
            steps = engine.stats()["num_steps"] - before
        finally:
            engine.shutdown()
        for got in outs:
            assert got[-1].finished and len(got[-1].outputs[0].token_ids) == 12
            assert len(got) == 12  # one output per token, none lost or merged
        assert 12 <= calls["engine"] <= steps  # 48 outputs

    asyncio.run(main())


def test_tokens_reach_their_streams_before_a_long_forward_in_the_engine_thread() -> None:
    """A step whose forward runs in the engine thread (a long prompt's chunk, too big for the
    native step) after one that ran in the background: the tokens the background step made are
    in their stream's hands before that forward runs (the engine's `early_outputs`), not after."""

    async def main() -> None:
        engine = AsyncEngine(dataclasses.replace(ARGS, max_model_len=4096, async_scheduling=True))
        await engine.wait_ready()
        llm = engine.engine
        assert llm is not None and llm.async_scheduling
        received = {"d": 0}
        checks: list[bool] = []
        finish = llm.runner.finish

        def spy(started, rows):  # noqa: ANN001, ANN202
            if started.running is None and "long" in started.out.req_ids and "d" in llm.requests:
                # everything the engine has made for "d" so far must be in the stream already
                made = len(llm.requests["d"].output_token_ids)
                deadline = time.monotonic() + 5
                while received["d"] < made and time.monotonic() < deadline:
                    time.sleep(0.005)
                checks.append(received["d"] >= made)
            return finish(started, rows)

        llm.runner.finish = spy  # type: ignore[method-assign]
        # "d" must still decode when "long" arrives: thousands of tokens (about 0.2 ms each), cut
        # short once "long" is done
        decode = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
        decoding = asyncio.Event()

        async def consume() -> None:
            async for o in engine.generate("The quick brown fox", decode, "d"):
                received["d"] = len(o.outputs[0].token_ids)
                if received["d"] >= 3:  # decoding, its steps in the background
                    decoding.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(decoding.wait(), 60)
        long_prompt = {"prompt_token_ids": [3 + i % 200 for i in range(600)]}
        outs = [o async for o in engine.generate(long_prompt, SamplingParams(max_tokens=2), "long")]
        assert outs[-1].finished
        assert not task.done(), "d ended before long came"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.shutdown()
        assert checks and all(checks), checks

    asyncio.run(main())
