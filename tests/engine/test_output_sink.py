"""The server's per-request sink: a handler that keeps up gets every output as it came; one that
falls MERGE_BEHIND items behind on a choice has that choice's next outputs merged into its last,
in order with its other items, and never across choices."""

from __future__ import annotations

import asyncio

from hybridserve.engine.output_sink import MERGE_BEHIND, OutputSink
from hybridserve.engine.outputs import CompletionOutput, RequestOutput


def output(rid: str, tokens: list[int], new: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[1, 2],
        outputs=[
            CompletionOutput(
                index=0,
                text="".join(f"<{t}>" for t in tokens),
                token_ids=list(tokens),
                delta_text="".join(f"<{t}>" for t in tokens[-new:]),
                delta_token_ids=tokens[-new:],
            )
        ],
        finished=finished,
    )


def test_a_handler_that_keeps_up_gets_every_output() -> None:
    async def main() -> list[tuple[str, object]]:
        sink: OutputSink[str] = OutputSink()
        got = []
        for t in range(3 * MERGE_BEHIND):
            sink.put_nowait(("a", output("a", list(range(t + 1)), 1)))
            got.append(await sink.get())
        return got

    got = asyncio.run(main())
    assert [item.outputs[0].delta_token_ids for _, item in got] == [[t] for t in range(3 * MERGE_BEHIND)]


def test_outputs_of_a_choice_behind_are_merged_into_its_last() -> None:
    async def main() -> list[tuple[str, object]]:
        sink: OutputSink[str] = OutputSink()
        tokens: list[int] = []
        for t in range(MERGE_BEHIND + 5):  # the handler takes nothing meanwhile
            tokens.append(t)
            sink.put_nowait(("a", output("a", list(tokens), 1)))
            if t == 2:
                sink.put_nowait(("b", output("b", [7], 1)))  # (another choice, never merged)
        err = RuntimeError("failed")
        sink.put_nowait(("b", err))
        sink.put_nowait(("b", output("b", [7, 3], 1)))  # (after its error: not merged across it)
        got = [await sink.get() for _ in range(MERGE_BEHIND + 3)]
        # taken items are not merged into: the next output of "a" comes on its own
        sink.put_nowait(("a", output("a", [*tokens, 99], 1, finished=True)))
        sink.put_nowait(("a", None))
        got += [await sink.get(), await sink.get()]
        return got

    got = asyncio.run(main())
    a = [item for c, item in got if c == "a"]
    b = [item for c, item in got if c == "b"]
    assert len(a) == MERGE_BEHIND + 2
    deltas = [o.outputs[0].delta_token_ids for o in a[:MERGE_BEHIND]]
    # the first MERGE_BEHIND - 1 one token each, the last of them all the rest, joined
    assert deltas[:-1] == [[t] for t in range(MERGE_BEHIND - 1)]
    assert deltas[-1] == list(range(MERGE_BEHIND - 1, MERGE_BEHIND + 5))
    last = a[MERGE_BEHIND - 1]
    assert last.outputs[0].token_ids == list(range(MERGE_BEHIND + 5))
    assert last.outputs[0].delta_text == "".join(f"<{t}>" for t in range(MERGE_BEHIND - 1, MERGE_BEHIND + 5))
    assert a[MERGE_BEHIND].finished and a[MERGE_BEHIND].outputs[0].delta_token_ids == [99]
    assert a[-1] is None
    assert [type(x).__name__ for x in b] == ["RequestOutput", "RuntimeError", "RequestOutput"]
    assert b[0].outputs[0].delta_token_ids == [7] and b[2].outputs[0].delta_token_ids == [3]


def test_a_finished_output_is_never_merged_into() -> None:
    async def main() -> list[object]:
        sink: OutputSink[str] = OutputSink()
        for t in range(MERGE_BEHIND - 1):
            sink.put_nowait(("a", output("a", list(range(t + 1)), 1)))
        sink.put_nowait(("a", output("a", list(range(MERGE_BEHIND)), 1, finished=True)))
        sink.put_nowait(("a", output("a", list(range(MERGE_BEHIND + 1)), 1)))
        return [(await sink.get())[1] for _ in range(MERGE_BEHIND + 1)]

    got = asyncio.run(main())
    assert isinstance(got[-2], RequestOutput) and got[-2].finished
    assert isinstance(got[-1], RequestOutput) and got[-1].outputs[0].delta_token_ids == [MERGE_BEHIND]
