"""The server's per-request sink: a choice's outputs not taken yet are merged, in order with its
other items, and never across choices."""

from __future__ import annotations

import asyncio

from hybridserve.engine.outputs import CompletionOutput, RequestOutput
from hybridserve.server.output_sink import OutputSink


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


def test_outputs_not_taken_are_merged_per_choice() -> None:
    async def main() -> list[tuple[str, object]]:
        sink: OutputSink[str] = OutputSink()
        sink.put_nowait(("a", output("a", [5], 1)))
        sink.put_nowait(("b", output("b", [7], 1)))
        sink.put_nowait(("a", output("a", [5, 6], 1)))
        sink.put_nowait(("a", output("a", [5, 6, 8, 9], 2)))
        err = RuntimeError("failed")
        sink.put_nowait(("b", err))
        sink.put_nowait(("b", output("b", [7, 3], 1)))  # (after its error: not merged across it)
        got = [await sink.get() for _ in range(4)]
        # taken items are not merged into: the next output of "a" comes on its own
        sink.put_nowait(("a", output("a", [5, 6, 8, 9, 4], 1, finished=True)))
        sink.put_nowait(("a", None))
        got += [await sink.get(), await sink.get()]
        return got

    got = asyncio.run(main())
    assert [c for c, _ in got] == ["a", "b", "b", "b", "a", "a"]
    a1, b1, err, b2, a2, end = (item for _, item in got)
    assert isinstance(a1, RequestOutput)
    assert a1.outputs[0].token_ids == [5, 6, 8, 9] and a1.outputs[0].delta_token_ids == [5, 6, 8, 9]
    assert a1.outputs[0].delta_text == "<5><6><8><9>"
    assert isinstance(b1, RequestOutput) and b1.outputs[0].delta_token_ids == [7]
    assert isinstance(err, RuntimeError)
    assert isinstance(b2, RequestOutput) and b2.outputs[0].delta_token_ids == [3]
    assert isinstance(a2, RequestOutput) and a2.finished and a2.outputs[0].delta_token_ids == [4]
    assert end is None


def test_a_finished_output_is_never_merged_into() -> None:
    async def main() -> list[object]:
        sink: OutputSink[str] = OutputSink()
        sink.put_nowait(("a", output("a", [5], 1, finished=True)))
        sink.put_nowait(("a", output("a", [5, 6], 1)))
        return [(await sink.get())[1] for _ in range(2)]

    first, second = asyncio.run(main())
    assert isinstance(first, RequestOutput) and first.finished and first.outputs[0].token_ids == [5]
    assert isinstance(second, RequestOutput) and second.outputs[0].token_ids == [5, 6]
