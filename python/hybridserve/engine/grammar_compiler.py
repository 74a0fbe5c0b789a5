"""Grammar compilation off the engine thread, with a cache and a time limit.

The engine submits a request's `StructuredOutputsParams` (`GrammarCompiler.submit`) and holds the
request back from the scheduler until its grammar is compiled (engine/llm_engine.py); the steps of
the other requests go on meanwhile. Compilation runs on a few worker threads of its own:

- llguidance builds a grammar with the GIL released, so the engine's steps keep running;
- it recurses along chains of grammar rules, so the workers get a large stack (`STACK_BYTES`,
  reserved address space, touched only as deep as a grammar goes); with the source size limit
  (`MAX_GRAMMAR_CHARS`) no grammar reaches its end;
- same source, same compiled grammar: the cache (`cache_size` entries, least recently used out)
  keeps the compiled matcher in its initial state, and every request gets a copy of it
  (`LLMatcher.deep_copy`, which shares the compiled grammar). Requests that arrive while their
  grammar is being compiled wait for that one compilation. Errors are cached too;
- a compilation that runs longer than `timeout_s` fails its requests (InvalidRequestError, a 400)
  and its grammar is remembered as too slow: a thread cannot be stopped, so it runs on to its end in
  the background, but the same grammar is refused at once from then on. The time counts from when
  a worker starts on it, not from the submission;
- a compilation every request of which has gone (aborted, a client that left) before a worker
  took it is dropped, not compiled: abandoned grammars would otherwise hold the workers for
  minutes, and later grammars would wait behind them. The engine gives a request's ticket back
  (`GrammarTicket.release`) once it no longer waits for it. At shutdown the queued compilations
  are dropped too; the running ones are waited for (see `shutdown`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.grammar import EosAliases, GrammarMatcher
from hybridserve.sampling.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger("hybridserve.engine")

STACK_BYTES = 256 * 1024 * 1024
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
DEFAULT_NUM_THREADS = 2
_MAX_ERROR_CHARS = 1000


def _error_text(kind: str, raw: str) -> str:
    """One readable message from llguidance's error (which may carry its parser state)."""
    text = raw.split("\n<state>", 1)[0].strip()
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + " ..."
    what = {
        "json": "invalid JSON schema",
        "json_object": "invalid JSON grammar",
        "regex": "invalid regex",
        "choice": "invalid choice",
        "grammar": "invalid grammar",
    }[kind]
    return f"{what}: {text}"


# How long a grammar may wait for a free worker, in compile timeouts (see GrammarTicket.poll).
QUEUE_WAIT_FACTOR = 3

# Workers of every compiler inside a compilation now (see `compilations_running`)
_running = 0
_running_lock = threading.Lock()


def compilations_running() -> int:
    """Grammar compilations running now, in every compiler of the process. A process must not end
    through the interpreter's finalization while one runs (see `GrammarCompiler.shutdown`): the
    command line then ends it at once (`hybridserve.cli.run`)."""
    with _running_lock:
        return _running


def _count_running(delta: int) -> None:
    global _running
    with _running_lock:
        _running += delta


@dataclass
class CompiledGrammar:
    """One grammar source: its compilation's state and result."""

    key: tuple[str, str]
    kind: str
    started: float | None = None  # when a worker started on it (time.monotonic)
    finished: threading.Event = field(default_factory=threading.Event)
    matcher: llguidance.LLMatcher | None = None  # the compiled grammar in its initial state
    error: str | None = None
    compile_s: float | None = None
    holders: int = 0  # tickets not given back (under the compiler's lock)

    def done(self) -> bool:
        return self.finished.is_set()


class GrammarTicket:
    """A request's claim on a compilation: ready, failed or still pending."""

    def __init__(
        self,
        compiled: CompiledGrammar,
        timeout_s: float,
        vocab_size: int,
        param: str,
        eos_aliases: EosAliases | None = None,
        release: Callable[[CompiledGrammar], None] | None = None,
        added_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._c = compiled
        self._added_token_ids = added_token_ids
        self.param = param  # the request field errors name
        self._timeout_s = timeout_s
        self._vocab_size = vocab_size
        self._eos_aliases = eos_aliases
        self._submitted = time.monotonic()
        self._release = release

    def release(self) -> None:
        """Gives the claim back: the request no longer waits for this grammar (it has it, it was
        refused, or it ended). A compilation whose claims are all given back before a worker
        takes it is dropped. Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release(self._c)

    @property
    def compiled(self) -> CompiledGrammar:
        return self._c

    def poll(self, now: float | None = None) -> GrammarMatcher | InvalidRequestError | None:
        """The request's own matcher once compiled, the error that refuses the request, or None
        while it is still compiling within its time."""
        c = self._c
        if c.done():
            if c.error is not None or c.matcher is None:
                return InvalidRequestError(f"{self.param}: {c.error or 'the grammar did not compile'}")
            return GrammarMatcher(
                c.matcher.deep_copy(), self._vocab_size, self._eos_aliases, self._added_token_ids
            )
        started = c.started
        now = time.monotonic() if now is None else now
        if started is not None and now - started > self._timeout_s:
            return InvalidRequestError(
                f"{self.param}: the {c.kind} grammar took longer than {self._timeout_s:g} s to compile; "
                "simplify it"
            )
        # A grammar still queued: the workers are busy with others (slow ones run on after their
        # own time is up), so the wait in the queue is bounded too, at the queue limit below.
        if started is None and now - self._submitted > QUEUE_WAIT_FACTOR * self._timeout_s:
            return InvalidRequestError(
                f"{self.param}: no grammar compiler was free for {QUEUE_WAIT_FACTOR * self._timeout_s:g} s "
                "(other grammars are compiling); retry later"
            )
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return self._c.finished.wait(timeout)


def _added_token_ids(tokenizer_json: str) -> frozenset[int]:
    """The ids of tokenizer.json's added tokens (none for a file that lists none)."""
    try:
        added = json.loads(tokenizer_json).get("added_tokens") or []
        return frozenset(int(t["id"]) for t in added if isinstance(t, dict) and "id" in t)
    except (ValueError, TypeError, AttributeError):
        return frozenset()


class GrammarCompiler:
    """Compiles grammars for one tokenizer (see the module docstring)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_id: int | None,
        *,
        extra_eos_token_ids: tuple[int, ...] = (),
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_threads: int = DEFAULT_NUM_THREADS,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        # (a grammar whose text spells an added token's is refused by the matcher mid-output:
        # GrammarMatcher.refused_added_token)
        self.added_token_ids = _added_token_ids(tokenizer_json)
        self.eos_token_id = eos_token_id
        # the model's other EOS ids: allowed wherever the grammar allows its EOS (they end a
        # request as the EOS does, engine/input_processor.py)
        self.eos_aliases: EosAliases | None = (
            (eos_token_id, tuple(extra_eos_token_ids))
            if eos_token_id is not None and extra_eos_token_ids
            else None
        )
        self.timeout_s = float(timeout_s)
        self.cache_size = int(cache_size)
        self._num_threads = int(num_threads)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # (building it takes long: not under _lock)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._jobs: queue.SimpleQueue[tuple[CompiledGrammar, StructuredOutputsParams] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._num_stopping = 0  # workers told to end (by shutdown) and not yet ended
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.num_dropped = 0  # compilations dropped: nobody waited for them any more
        # for tests: runs in the worker before each compilation
        self.before_compile: Callable[[CompiledGrammar], None] | None = None

    # ------------------------------------------------------------------ threads
    def _start(self) -> None:
        if self._threads:
            return
        previous = threading.stack_size()
        threading.stack_size(STACK_BYTES)
        try:
            for i in range(self._num_threads):
                t = threading.Thread(target=self._work, name=f"hybridserve-grammar-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        finally:
            threading.stack_size(previous)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Ends the workers once the compilations they run are done, waiting up to `timeout`
        seconds (None: as long as they take); True when none is left running. The queued ones
        are dropped first (their requests fail: nothing is served after a shutdown). A process
        must not exit while a worker compiles: the interpreter ends a thread that returns from
        native code after its finalization has begun by unwinding the thread's stack, through
        llguidance's frames, which crashes the process (SIGSEGV) at the end of a clean shutdown."""
        markers = 0  # (an earlier shutdown's, for workers still compiling: put back)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                markers += 1
                continue
            with self._lock:
                self._drop(job[0], "the engine is shutting down")
        for _ in range(markers + len(self._threads) - self._num_stopping):
            self._jobs.put(None)
        self._num_stopping = len(self._threads)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        self._num_stopping = len(self._threads)
        if self._threads:
            logger.warning("%d grammar compilation(s) still running at shutdown", len(self._threads))
        return not self._threads

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._tokenizer

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            c, spec = job
            with self._lock:  # (a submit that finds it in the cache takes a claim under it)
                if c.holders <= 0:
                    self._drop(c, "every request that asked for the grammar has ended")
                    continue
                c.started = time.monotonic()
            _count_running(1)
            try:
                if self.before_compile is not None:
                    self.before_compile(c)
                c.matcher, c.error = self._compile(spec)
            # never lose a waiter or the worker: every job ends with a result (BaseException: a
            # panic inside the Rust compiler reaches Python as pyo3's PanicException, which is no
            # Exception, and would end this thread for good)
            except BaseException as exc:  # noqa: BLE001
                logger.exception("grammar compilation failed")
                c.error = f"the grammar could not be compiled: {exc}"
            finally:
                _count_running(-1)
            c.compile_s = time.monotonic() - c.started
            if c.compile_s > self.timeout_s:
                logger.warning(
                    "a %s grammar took %.1f s to compile (limit %.1f s); refused from now on",
                    c.kind,
                    c.compile_s,
                    self.timeout_s,
                )
                c.matcher = None
                c.error = (
                    f"the {c.kind} grammar took longer than {self.timeout_s:g} s to compile; simplify it"
                )
            c.finished.set()

    def _drop(self, c: CompiledGrammar, why: str) -> None:
        """Ends a compilation no worker started: out of the cache (a later request compiles it
        anew), its waiters told `why`. Under the lock."""
        if self._cache.get(c.key) is c:
            del self._cache[c.key]
        self.num_dropped += 1
        c.error = why
        c.finished.set()

    def _release(self, c: CompiledGrammar) -> None:
        with self._lock:
            c.holders -= 1

    def _ticket(self, c: CompiledGrammar, spec: StructuredOutputsParams) -> GrammarTicket:
        """A claim on `c` (under the lock)."""
        c.holders += 1
        return GrammarTicket(
            c,
            self.timeout_s,
            self.vocab_size,
            spec.param,
            self.eos_aliases,
            self._release,
            self.added_token_ids,
        )

    def _compile(self, spec: StructuredOutputsParams) -> tuple[llguidance.LLMatcher | None, str | None]:
        import llguidance

        try:
            grammar = spec.to_grammar()
        except InvalidRequestError as e:
            return None, str(e).split(": ", 1)[-1]
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # some errors (lexer limits) show only at the first mask
        if matcher.is_error():
            return None, _error_text(spec.kind, matcher.get_error())
        with self._lock:  # (two workers count)
            self.num_compiled += 1
        return matcher, None

    # ------------------------------------------------------------------ requests
    def submit(self, spec: StructuredOutputsParams) -> GrammarTicket:
        """A ticket for `spec`'s compiled grammar: from the cache, or from a compilation started
        (or already running) for it."""
        key = spec.cache_key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return self._ticket(cached, spec)
            c = CompiledGrammar(key=key, kind=spec.kind)
            self._cache[key] = c
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._start()
            ticket = self._ticket(c, spec)
        self._jobs.put((c, spec))
        return ticket

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "grammar_cache_entries": len(self._cache),
                "grammar_compilations": self.num_compiled,
                "grammar_cache_hits": self.num_cache_hits,
                "grammar_compilations_dropped": self.num_dropped,
            }
