"""AsyncEngine: LLMEngine in a thread of its own, bridged to asyncio.

Commands (add, abort) reach the engine thread through a thread-safe queue; each request's outputs
reach its stream through an asyncio queue on the caller's loop. Statistics are snapshotted by the
engine thread after every step, so readers never touch the engine while it runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from hybridserve.config import EngineArgs
from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.engine.input_processor import Prompt
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.output_sink import OutputSink
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import ConfigError, EngineDeadError, HybridServeError, InvalidRequestError, StepError
from hybridserve.sampling.params import SamplingParams

logger = logging.getLogger("hybridserve.engine")

__all__ = ["AsyncEngine", "EngineDeadError"]


class _Stream:
    """One request's outputs on their way to its reader, on the reader's event loop (an
    OutputSink of one key: a reader MERGE_BEHIND outputs behind has the next ones merged)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._sink: OutputSink[None] = OutputSink()
        # Set when the consumer's event loop has closed: nobody can read this stream any more.
        self.dead = False

    def put(self, item: RequestOutput | BaseException) -> None:
        _deliver([(self, item)])

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """On the reader's loop."""
        self._sink.put_nowait((None, item))

    async def get(self) -> RequestOutput | BaseException:
        item: RequestOutput | BaseException = (await self._sink.get())[1]
        return item


def _put_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


def _deliver(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Hands items to their streams in order, with one thread-safe call per event loop, not one per
    item: each call writes to the loop's wake-up pipe (a system call) and may wake the loop, which
    then takes the GIL from the engine thread."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed; the engine thread must not die of it
            for stream, _ in batch:
                stream.dead = True


class AsyncEngine:
    """An `EngineClient` (engine/protocol.py): the model loads and the steps run in the engine
    thread; `generate` streams each request's outputs to the caller's event loop."""

    def __init__(self, args: EngineArgs, *, start: bool = True) -> None:
        self.args = args
        self.engine: LLMEngine | None = None
        self._ready = False
        self.load_error: BaseException | None = None
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loaded = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Engine thread only: the stream whose add command created each request in the engine. A
        # request id can be reused as soon as its stream is gone, while the old request's abort is
        # still queued: outputs and aborts go to the stream that owns the request, never to a
        # newer stream under the same id.
        self._owner: dict[str, _Stream] = {}
        # Set (under _lock) by the engine thread before its final sweep: a stream registered after
        # it would never be ended, so generate() refuses instead.
        self._closed = False
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def ready(self) -> bool:
        """Loaded and its thread still running (False again once the thread has died)."""
        return self._ready and self._thread.is_alive() and not self._stop.is_set()

    def _loaded_engine(self) -> LLMEngine:
        if self.engine is None or not self._loaded.is_set():
            raise EngineDeadError("the engine has not loaded a model")
        return self.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded_engine().tokenizer

    @property
    def vocab_size(self) -> int:
        return self._loaded_engine().vocab_size

    @property
    def max_logprobs(self) -> int:
        return self._loaded_engine().max_logprobs

    @property
    def max_model_len(self) -> int:
        return self._loaded_engine().max_model_len

    @property
    def model_dir(self) -> str:
        return self._loaded_engine().model_dir

    @property
    def tokenizer_dir(self) -> str:
        return self._loaded_engine().tokenizer_dir

    @property
    def eos_token_id(self) -> int | None:
        return self._loaded_engine().eos_token_id

    @property
    def extra_eos_token_ids(self) -> tuple[int, ...]:
        return self._loaded_engine().extra_eos_token_ids

    @property
    def default_sampling(self) -> Mapping[str, Any]:
        return self._loaded_engine().default_sampling

    @property
    def chat_template(self) -> ChatTemplate:
        return self._loaded_engine().chat_template

    def start(self) -> None:
        self._thread.start()

    async def wait_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._loaded.wait)
        if self.load_error is not None:
            raise EngineDeadError(f"the engine failed to load: {self.load_error}") from self.load_error

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread and waits up to `timeout` seconds for it to end (its last act,
        LLMEngine.shutdown, may wait for a grammar compilation)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if not self.ready or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine is shutting down")
            if request_id in self._streams:
                raise HybridServeError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._cmds.put(("add", request_id, prompt, params, cache_salt, priority, stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                # The consumer went away (client disconnect, cancellation): free it at once.
                self._cmds.put(("abort", request_id, stream))
                self._wake.set()

    def abort_nowait(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            engine = self.engine = LLMEngine(self.args)
        except BaseException as exc:  # reported to every waiter; the thread ends
            if isinstance(exc, ConfigError):  # the user's setting, said in its message
                logger.error("engine failed to load: %s", exc)
            else:
                logger.exception("engine failed to load")
            self.load_error = exc
            self._loaded.set()
            return
        # a step that runs a long forward in this thread hands over what it already has first
        # (a stream whose loop is gone is found at its request's next output)
        engine.early_outputs = self._publish
        self._snapshot_stats()
        self._ready = True
        self._loaded.set()
        try:
            self._serve(engine)
        finally:
            engine.stop_workers()
            # Shutdown (or an unexpected error in the loop): end every stream, including those
            # whose add command is still queued.
            with self._lock:
                self._closed = True
            self._drain_commands(engine)
            self._fail_all(engine, None)
            engine.shutdown()

    def _serve(self, engine: LLMEngine) -> None:
        while not self._stop.is_set():
            dead = engine.dead_reason
            if dead is not None:
                # a tensor-parallel worker died: every open request gets the error, and the engine
                # thread ends (the server then exits non-zero)
                logger.error("the engine is dead: %s", dead)
                self._drain_commands(engine)
                self._fail_all(engine, EngineDeadError(dead))
                return
            self._drain_commands(engine)
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except StepError as exc:
                for rid in exc.request_ids:
                    stream = self._live_owner(rid)
                    self._owner.pop(rid, None)
                    if stream is not None:
                        stream.put(HybridServeError(f"the engine failed while running this request: {exc}"))
                self._snapshot_stats()
                continue
            except Exception as exc:  # outside the forward: fail what is in flight, keep serving
                logger.exception("engine step failed; aborting the requests in flight")
                # The requests the engine holds (running or waiting), and those it forgot without an
                # output to hand over; not a request whose add is still queued (it runs next), nor
                # one that finished before the failure (its last output comes with the next step).
                self._fail_in_flight(engine, exc)
                self._fail_forgotten(engine)
                continue
            items = self._publish(outputs)
            # streams whose event loop has closed: nobody reads them, their requests end here
            aborted = False
            for stream, item in items:
                if stream.dead and isinstance(item, RequestOutput) and not item.finished:
                    self._abort(engine, item.request_id)
                    aborted = True
            if aborted:
                self._snapshot_stats()

    def _publish(self, outputs: list[RequestOutput]) -> list[tuple[_Stream, RequestOutput | BaseException]]:
        """Hands `outputs` to their streams (each as an output or the error it carries); what was
        handed to which stream."""
        # the stats of the step first: a client that has its answer and reads /metrics at once
        # must see the tokens it was given counted
        self._snapshot_stats()
        items: list[tuple[_Stream, RequestOutput | BaseException]] = []
        for out in outputs:
            stream = self._live_owner(out.request_id)
            if out.finished:
                self._owner.pop(out.request_id, None)
            if stream is not None and out.error is not None and out.invalid:
                items.append((stream, InvalidRequestError(out.error)))  # refused after it was accepted
            elif stream is not None and out.error is not None:
                err = HybridServeError(f"the engine failed while running this request: {out.error}")
                items.append((stream, err))
            elif stream is not None:
                items.append((stream, out))
        _deliver(items)
        return items

    def _live_owner(self, rid: str) -> _Stream | None:
        """The stream that owns request `rid` in the engine, if its consumer still reads it."""
        owner = self._owner.get(rid)
        with self._lock:
            live = owner is not None and self._streams.get(rid) is owner
        return owner if live else None

    def _drain_commands(self, engine: LLMEngine) -> None:
        handled = 0
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            handled += 1
            if cmd[0] == "add":
                _, rid, prompt, params, salt, priority, stream = cmd
                with self._lock:
                    live = self._streams.get(rid) is stream
                if not live:
                    continue  # its consumer left before the add ran (its abort follows)
                try:
                    engine.add_request(rid, prompt, params, cache_salt=salt, priority=priority)
                except Exception as exc:
                    stream.put(exc)
                    continue
                self._owner[rid] = stream
            elif cmd[0] == "abort":
                _, rid, stream = cmd
                if stream is None or self._owner.get(rid) is stream:
                    self._abort(engine, rid)
        if handled:
            self._snapshot_stats()

    def _abort(self, engine: LLMEngine, rid: str, exc: BaseException | None = None) -> None:
        """Aborts `rid` in the engine and ends its stream, if anyone still reads it."""
        st = engine.requests.get(rid)
        engine.abort_request(rid)
        stream = self._live_owner(rid)
        self._owner.pop(rid, None)
        if stream is None or st is None:
            return
        if exc is not None:
            stream.put(HybridServeError(f"the engine failed while running this request: {exc}"))
            return
        st.finish_reason, st.stop_reason = "abort", None
        stream.put(st.to_output(finished=True))

    def _fail_in_flight(self, engine: LLMEngine, exc: BaseException | None) -> None:
        """Aborts every request the engine holds (running or waiting), its stream ended with `exc`
        (or as aborted)."""
        for rid in list(engine.requests):
            self._abort(engine, rid, exc)
        self._snapshot_stats()

    def _fail_forgotten(self, engine: LLMEngine) -> None:
        """Ends the streams of requests the engine no longer knows and has no output for (it
        failed between finishing them and returning their outputs): they would wait forever."""
        for rid in [r for r in self._owner if r not in engine.requests and not engine.holds_output_for(r)]:
            stream = self._live_owner(rid)
            self._owner.pop(rid, None)
            if stream is not None:
                stream.put(HybridServeError("the engine failed before this request's last output"))
        self._snapshot_stats()

    def _fail_all(self, engine: LLMEngine, exc: BaseException | None) -> None:
        """When the engine stops serving: every request and every stream ends."""
        self._fail_in_flight(engine, exc)
        # Streams whose request the engine no longer knows (it stopped between finishing them and
        # handing out their output, or their add never ran) must end too.
        with self._lock:
            orphans = [(rid, st) for rid, st in self._streams.items() if rid not in engine.requests]
        for rid, stream in orphans:
            engine.abort_request(rid)
            self._owner.pop(rid, None)
            stream.put(HybridServeError("the engine stopped before this request finished"))
        self._snapshot_stats()

    def _snapshot_stats(self) -> None:
        if self.engine is None:
            return
        s = self.engine.stats()
        with self._lock:
            self._stats = s
