"""LLMEngine: the offline engine loop. One step:

1. the Rust scheduler picks the rows of the step (`Scheduler.schedule` → `SchedulerOutput`);
2. the model runner copies cache blocks, runs the forward, samples or verifies, and proposes the
   next drafts (`ModelRunner.start`, `ModelRunner.finish` → `ModelRunnerOutput`);
3. the scheduler commits the step (`Scheduler.update_from_output` → one delta per request:
   new tokens, finish, prefix-cache checkpoints published);
4. the output processor turns the deltas into `RequestOutput`s (`OutputProcessor.process`).

Requests come in through the input processor (tokenize, validate, seed). The engine runs in one
thread (`AsyncEngine` gives it a thread of its own). With overlapped steps a step of decode rows
computes on the C++ library's background thread between two calls of `step`, while the engine
builds the previous step's outputs and the caller delivers them (`step`).
"""

from __future__ import annotations

import logging
import operator
import os
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np

from hybridserve import _core
from hybridserve.config import EngineArgs
from hybridserve.config.generation import sampling_defaults
from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.engine.cpu_threads import usable_cores
from hybridserve.engine.grammar_compiler import GrammarCompiler, GrammarTicket
from hybridserve.engine.input_processor import EngineRequest, InputProcessor, Prompt
from hybridserve.engine.kv_events import KVEventPublisher
from hybridserve.engine.model_runner import ModelRunner, ModelRunnerOutput, PreparedStep, StartedStep
from hybridserve.engine.model_setup import EngineModel, build_engine_model
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.request_state import RequestState
from hybridserve.engine.shared_prefix import resolve_markers, shared_prefix_len
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import ConfigError, EngineDeadError, HybridServeError, InvalidRequestError, StepError
from hybridserve.kernels import native
from hybridserve.model.flops import prefill_cost
from hybridserve.sampling.grammar import GrammarMatcher
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.sampler import RowSampling

logger = logging.getLogger("hybridserve.engine")

# How long `shutdown` waits for grammar compilations still running (GrammarCompiler.shutdown says
# why a process must not exit under one); a compilation is refused after its own limit, but runs on.
GRAMMAR_SHUTDOWN_WAIT_S = 20.0

__all__ = ["LLMEngine", "Prompt", "StepError"]


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_verify_rows: int = 0  # rows that verified at least one draft
    num_steps: int = 0
    num_overlapped_steps: int = 0  # steps whose forward ran while the step before was output
    num_planned_steps: int = 0  # overlapped steps planned while the step before computed


@dataclass
class _ClosedStep:
    """A step committed in the scheduler whose outputs are still to be built."""

    out: _core.SchedulerOutput
    ran: ModelRunnerOutput
    deltas: list[Any]
    row_failures: dict[str, str]


@dataclass
class _Running:
    """A started step, and the requests its rows were planned for (by row)."""

    started: StartedStep
    owners: list[RequestState | None]


def _mark_scheduled(owners: list[RequestState | None]) -> None:
    """The first step of each request starts now (its queue time ends here)."""
    now = 0.0
    for st in owners:
        if st is not None and st.first_scheduled_time is None:
            now = now or time.monotonic()
            st.first_scheduled_time = now


@dataclass
class _AwaitingGrammar:
    """A request held back from the scheduler until its grammar is compiled."""

    req: EngineRequest
    ticket: GrammarTicket
    cache_salt: str | None
    priority: int


OverlapMode = Literal["off", "on", "streaming"]
PlanMode = Literal["auto", "on", "off"]


def plan_mode_from_env() -> PlanMode:
    """`HYBRIDSERVE_PLAN_AHEAD`: 1 / on plans every overlapped step it can ahead, 0 / off none;
    unset (auto) plans ahead while outputs are not streamed (`LLMEngine.plans_ahead`)."""
    value = os.environ.get("HYBRIDSERVE_PLAN_AHEAD", "auto").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return "on"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("auto", ""):
        return "auto"
    raise ConfigError(f"HYBRIDSERVE_PLAN_AHEAD={value!r}: expected auto, on (1) or off (0)")


def choose_async_scheduling(requested: bool | None, runner: ModelRunner) -> tuple[OverlapMode, str]:
    """When steps overlap (`LLMEngine.step`): "on", "off", or "streaming" (only while every
    step's outputs are built, as the server streams them); and why.

    Only the native decode step runs in the background, so without one there is nothing to
    overlap. By default steps overlap when a core is left beside the compute threads (on a core
    the step uses, the outputs would only take turns with it) and the outputs are streamed: the
    offline `LLM` API builds an output only when a request finishes, which leaves too little to
    hide to pay for the hand-over (benches/README.md, "Overlapped steps")."""
    if requested is False:
        return "off", "--no-async-scheduling"
    if runner.decode_step is None:
        return "off", "this model, dtype or device has no native decode step to run in the background"
    if requested:
        return "on", "--async-scheduling"
    cores, threads = usable_cores(), native.threads()
    if cores > threads:
        return (
            "streaming",
            f"default: {cores} usable core(s), {threads} compute thread(s); when outputs are streamed",
        )
    return "off", f"default: {cores} usable core(s), all of them compute threads"


def prefix_cache_hash_seed(args: EngineArgs) -> int:
    """The seed of the block hashes: the one given, else 64 bits from the OS. A prefix hit is
    trusted on its hash (rust/block_hash.rs), so a client that could predict the seed could craft
    prompts whose blocks collide with another tenant's; a fresh secret per start rules that out."""
    if args.prefix_cache_hash_seed is not None:
        return int(args.prefix_cache_hash_seed)
    return secrets.randbits(64)


def _check_text(name: str, value: object, what: str = "a str") -> None:
    """InvalidRequestError naming `name` unless `value` is a str that UTF-8 can encode (the Rust
    core takes it as UTF-8: a lone surrogate was a raw UnicodeEncodeError from the binding)."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name}: must be {what}, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{name}: not valid Unicode (it holds an unpaired surrogate)") from None


def _checked_priority(value: Any) -> int:
    """A request's priority: an integer (a numpy one too) that the scheduler's int64 holds."""
    v: int | None
    try:
        v = operator.index(value)
    except TypeError:
        v = None
    if isinstance(value, bool) or v is None or not -(2**63) <= v < 2**63:
        raise InvalidRequestError(f"priority: must be an integer in [-2**63, 2**63), got {value!r}")
    return int(v)


class LLMEngine:
    """The offline engine: add requests, call `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        # whether each overlapped step is planned while the one before computes (`_plan_ahead`),
        # read before the model is loaded: a value it does not know is refused at once
        self.plan_mode: PlanMode = plan_mode_from_env()
        em: EngineModel = build_engine_model(args)
        try:
            self._set_up(args, em)
        except BaseException:
            # a start that fails after the workers started (a KV-events port in use, ...) ends
            # them and leaves the process group: the next engine of this process may start
            events: KVEventPublisher | None = self.__dict__.get("kv_events")
            if events is not None:
                events.shutdown()
            if em.executor is not None:
                em.executor.shutdown()
            raise

    def _set_up(self, args: EngineArgs, em: EngineModel) -> None:
        self.config: _core.ResolvedConfig = em.resolved
        self.max_model_len = int(self.config.max_model_len)
        self.num_speculative_tokens = int(self.config.num_speculative_tokens)
        self.runner = ModelRunner(em, self.num_speculative_tokens, cuda_graphs=args.enforce_eager is False)
        self.scheduler = _core.Scheduler(
            self.config, em.sizes.num_kv_blocks, em.sizes.num_mamba_slots, prefix_cache_hash_seed(args)
        )
        cost = prefill_cost(em.model_config)
        self.scheduler.set_cost_model(
            state_bytes=int(em.sizes.mamba_bytes_per_slot),
            kv_bytes_per_block=int(em.sizes.kv_bytes_per_block),
            flops_per_token=cost.per_token,
            attn_flops_per_context_token=cost.attn_per_context_token,
        )
        self.inputs = InputProcessor(
            em.tokenizer,
            vocab_size=em.vocab_size,
            max_model_len=self.max_model_len,
            engine_seed=int(args.seed),
            max_logprobs=int(args.max_logprobs),
            extra_eos_token_ids=em.extra_eos_token_ids,
        )
        self.outputs = OutputProcessor(em.tokenizer, em.eos_token_id)
        # where a prompt's first message ends, declared shared to the scheduler (shared_prefix.py)
        #: SamplingParams fields a request that does not set them takes (--generation-config)
        self.default_sampling, why = sampling_defaults(
            args.generation_config, args.override_generation_config, em.model_dir
        )
        if self.default_sampling:
            logger.info("%s", why)
        #: the chat template served (--chat-template, else the model's): LLM.chat renders with it
        self.chat_template = ChatTemplate.served(
            em.tokenizer_dir, args.chat_template, args.chat_template_content_format
        )
        self.shared_prefix_markers, why = resolve_markers(
            args.shared_prefix_markers, em.tokenizer_dir, em.tokenizer, self.chat_template
        )
        logger.info("shared-prefix markers: %s (%s)", list(self.shared_prefix_markers) or "none", why)
        # KV cache events for routers (docs/kv-events.md): recorded by the scheduler, sent by a
        # publisher thread after every step.
        self.kv_events: KVEventPublisher | None = None
        self._kv_events_dropped: tuple[int, int] | None = None  # (events, batches) at shutdown
        events_cfg = args.kv_events()
        if events_cfg is not None:
            self.scheduler.enable_kv_events()
            self.kv_events = KVEventPublisher(events_cfg, int(self.config.block_size))
            # an engine that is dropped without `shutdown` (an `LLM` let go of) closes its
            # sockets, as vLLM's: the publisher's thread holds it, not the engine, so its
            # endpoints stayed bound and the next engine of the process with them was refused
            self._close_kv_events = weakref.finalize(self, self.kv_events.shutdown)
        if self.runner.executor is not None:
            from hybridserve.distributed.executor import TPExecutor

            if isinstance(self.runner.executor, TPExecutor):
                # and its spawned tensor-parallel workers end with it (vLLM scripts drop an `LLM`
                # and make the next one, which a process still in the dropped one's group would
                # refuse). Not at exit: the executor's own exit handler ends them
                # then. (A launcher's workers are the launcher's: they run until the process exits.)
                self._stop_workers_on_drop = weakref.finalize(self, self.runner.executor.shutdown)
                self._stop_workers_on_drop.atexit = False
        # overlapped steps (`step`): the step left running on the background thread, and the
        # outputs of a step completed outside `step` (reset_prefix_cache) for the next call
        self.overlap_mode, why = choose_async_scheduling(args.async_scheduling, self.runner)
        logger.info("overlapped steps: %s (%s)", self.overlap_mode, why)
        self._in_flight: _Running | None = None
        # (self.plan_mode, read first thing: whether each overlapped step is planned while the one
        # before computes, `_plan_ahead`)
        self._previous: _ClosedStep | None = None  # committed, outputs not built (inside `step`)
        self._carried: list[RequestOutput] = []
        #: Called by `step` with the outputs it has built before it runs a step's forward in its own
        #: thread (not on the background thread), so that they are not held back for as long as
        #: that forward takes; `step` then returns only what comes after. The server's engine
        #: thread sets it (engine/async_engine.py); it may read the engine (stats), not change it.
        self.early_outputs: Callable[[list[RequestOutput]], object] | None = None
        self.counters = EngineCounters()
        self.acceptance_per_position = [0] * self.num_speculative_tokens
        # structured outputs: requests whose grammar is still being compiled, in arrival order
        self._awaiting_grammar: dict[str, _AwaitingGrammar] = {}

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (structured outputs): its threads start with the first grammar."""
        return GrammarCompiler(
            self.tokenizer.to_json(),
            self.vocab_size,
            self.eos_token_id,
            extra_eos_token_ids=self.em.extra_eos_token_ids,
            timeout_s=float(self.args.grammar_compile_timeout),
        )

    # ------------------------------------------------------------------ what the engine serves
    @property
    def em(self) -> EngineModel:
        """The loaded model, its caches and the policy it runs under (owned by the runner)."""
        return self.runner.em

    @property
    def tokenizer(self) -> Tokenizer:
        return self.runner.em.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's `llm.llm_engine.get_tokenizer()`."""
        return self.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.runner.em.vocab_size

    @property
    def max_logprobs(self) -> int:
        """Most log-probabilities per token a request may ask for (--max-logprobs, resolved)."""
        return self.inputs.max_logprobs

    @property
    def model_dir(self) -> str:
        return self.runner.em.model_dir

    @property
    def tokenizer_dir(self) -> str:
        return self.runner.em.tokenizer_dir

    @property
    def eos_token_id(self) -> int | None:
        return self.runner.em.eos_token_id

    @property
    def extra_eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.em.extra_eos_token_ids

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests the engine runs, by id."""
        return self.outputs.requests

    @property
    def async_scheduling(self) -> bool:
        """Whether the next step may be left running in the background (`step`)."""
        return self.overlap_mode == "on" or (self.overlap_mode == "streaming" and self.stream_outputs)

    @property
    def plans_ahead(self) -> bool:
        """Whether an overlapped step is planned while the one before computes (`step`). By
        default only while outputs are not streamed: a streamed step's outputs are delivered by
        another Python thread (the server's event loop) just when the plan would be made, and
        the plan takes the GIL that thread then needs; through the server on two cores it
        streamed no faster with plans made ahead (benches/README.md, "Per-step overhead")."""
        return self.plan_mode == "on" or (self.plan_mode == "auto" and not self.stream_outputs)

    @property
    def stream_outputs(self) -> bool:
        """True: every step returns an output per request; False: only finished requests."""
        return self.outputs.stream_outputs

    @stream_outputs.setter
    def stream_outputs(self, value: bool) -> None:
        self.outputs.stream_outputs = value

    @property
    def arrival_index(self) -> int:
        """The arrival index the next admitted request takes (keys an unseeded request's draws)."""
        return self.inputs.arrival_index

    @arrival_index.setter
    def arrival_index(self, value: int) -> None:
        self.inputs.arrival_index = value

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.inputs.encode_prompt(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        _check_text("request_id", request_id)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params: must be a SamplingParams, not {type(params).__name__}")
        if cache_salt is not None:
            _check_text("cache_salt", cache_salt, "a str or None")
        priority = _checked_priority(priority)
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already running")
        req = self.inputs.process(request_id, prompt, params, cache_salt=cache_salt, priority=priority)
        grammar: GrammarMatcher | None = None
        if params.structured_outputs is not None:
            ticket = self.grammars.submit(params.structured_outputs)
            ready = ticket.poll()
            if ready is not None:
                ticket.release()  # (compiled, or refused: the request waits for nothing)
            if isinstance(ready, InvalidRequestError):
                raise ready
            if ready is None:
                # Still compiling: the request waits outside the scheduler, and `step` hands it
                # over once its grammar is ready. It takes its arrival index (its seed) now.
                self.inputs.admitted()
                self.outputs.add_request(req)
                self._awaiting_grammar[request_id] = _AwaitingGrammar(req, ticket, cache_salt, priority)
                return
            grammar = ready
        self._schedule(req, cache_salt, priority, grammar)

    def _schedule(
        self,
        req: EngineRequest,
        cache_salt: str | None,
        priority: int,
        grammar: GrammarMatcher | None,
        arrived: bool = False,
    ) -> None:
        """Hands a processed request to the scheduler (`arrived`: it waited for its grammar, and
        already took its arrival index and its place in the output processor)."""
        request_id, params = req.request_id, req.params
        so = params.structured_outputs
        if grammar is not None and so is not None and so.start_after is not None:
            # (an added token such as a thinking model's `</think>` encodes to itself)
            grammar.start_after(self.tokenizer.encode(so.start_after, add_special_tokens=False))
        self.scheduler.add_request(
            request_id,
            req.prompt_token_ids,
            # max_tokens 0 (score the prompt only) still samples one token, which is dropped
            max_tokens=max(1, req.max_tokens),
            eos_token_id=self.eos_token_id,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=bool(params.ignore_eos),
            min_tokens=req.min_tokens,
            priority=priority,
            cache_salt=cache_salt,
            # prompt logprobs need the logits of every prompt position: no prefix hit skips any
            skip_prefix_hit=params.prompt_logprobs is not None,
            shared_prefix_len=shared_prefix_len(req.prompt_token_ids, self.shared_prefix_markers),
        )
        if not arrived:
            self.inputs.admitted()  # only requests that were admitted take an arrival index
            self.outputs.add_request(req)
        if grammar is not None and params.ignore_eos:
            # (the model's other EOS ids end no request that ignores EOS: they are no EOS to its
            # grammar, which allows them nowhere)
            grammar.eos_aliases = None
        self.requests[request_id].grammar = grammar
        self.counters.prompt_tokens += len(req.prompt_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hands the requests whose grammar is now compiled to the scheduler; ends (with an
        error output) those whose grammar failed or ran out of time. When nothing else can run,
        waits briefly for a compilation instead of spinning."""
        waiting = self._awaiting_grammar
        if not waiting:
            return []
        if not self.scheduler.has_unfinished_requests():
            next(iter(waiting.values())).ticket.wait(0.02)
        refused: list[RequestOutput] = []
        for rid, w in list(waiting.items()):
            ready = w.ticket.poll()
            if ready is None:
                continue
            del waiting[rid]
            w.ticket.release()
            if isinstance(ready, GrammarMatcher):
                try:
                    self._schedule(w.req, w.cache_salt, w.priority, ready, arrived=True)
                    continue
                except InvalidRequestError as exc:
                    ready = exc
            st = self.requests.get(rid)
            self._forget(rid)
            if st is None:
                continue
            st.finished, st.finish_reason, st.stop_reason = True, "error", None
            out = st.to_output(finished=True)
            out.error, out.invalid = str(ready), True
            refused.append(out)
        return refused

    def compile_grammars(self, params_list: Sequence[SamplingParams]) -> None:
        """Compiles (or finds cached) every structured output of a batch, all submitted at once
        so that the compiler's workers share them, then waits for them; InvalidRequestError for
        the first that does not compile (or not within its time). The offline API calls it before
        it adds any request of a batch, so that such a grammar refuses the batch whether it is new
        or already in the compiler's cache of errors (`add_request` refuses a cached failure at
        once, but a new one ends its own request with an error output). Adds nothing."""
        tickets = {}
        try:
            for params in params_list:
                so = params.structured_outputs
                if so is not None and so.cache_key not in tickets:
                    tickets[so.cache_key] = self.grammars.submit(so)
            for ticket in tickets.values():
                while (ready := ticket.poll()) is None:
                    ticket.wait(0.05)
                if isinstance(ready, InvalidRequestError):
                    raise ready
        finally:  # (the batch's requests take claims of their own: these found them cached)
            for ticket in tickets.values():
                ticket.release()

    def abort_request(self, request_id: str) -> bool:
        _check_text("request_id", request_id)
        state = self.requests.get(request_id)
        self._forget(request_id)
        # (an output kept for the next step, after a failure, is not delivered either)
        self._carried = [o for o in self._carried if o.request_id != request_id]
        found = self.scheduler.abort_request(request_id)
        self.publish_kv_events()  # its last state may have been kept
        return found or state is not None

    def _forget(self, request_id: str) -> None:
        waiting = self._awaiting_grammar.pop(request_id, None)
        if waiting is not None:  # (an abandoned compilation not started yet is dropped)
            waiting.ticket.release()
        self.outputs.forget(request_id)
        self.runner.free_request(request_id)

    def holds_output_for(self, request_id: str) -> bool:
        """Whether an output of `request_id` built before a failed step waits to be returned by
        the next `step` (its last, for a request the engine has already forgotten)."""
        return any(o.request_id == request_id for o in self._carried)

    def has_unfinished_requests(self) -> bool:
        return (
            self._in_flight is not None
            or bool(self._carried)
            or bool(self.requests)
            or self.scheduler.has_unfinished_requests()
        )

    # ------------------------------------------------------------------ tensor parallelism
    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot run another step (a tensor-parallel worker died, or a step failed
        part way through the ranks), else None. A single-process engine never dies."""
        ex = self.runner.executor
        if ex is None:
            return None
        try:
            ex.check_alive()
        except EngineDeadError as exc:
            return str(exc)
        return None

    def stop_workers(self) -> None:
        """Ends the tensor-parallel worker processes (nothing without them)."""
        self.runner.stop_workers()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced (streaming) or finished.

        With overlapped steps (`async_scheduling`) a step of decode rows that the native decode
        step runs is left running on its background thread when this returns, and the outputs
        returned are the previous step's, built (detokenized, stop strings matched) while it
        runs; the next call plans the step after it while it still computes (where the engine
        `plans_ahead` and that plan cannot depend on its tokens), then waits for it, commits it,
        and starts the planned step with the tokens just sampled, or schedules one as usual. What runs is what a synchronous
        engine runs, except that a request that a stop string, its grammar or an EOS ends may
        have one more row computed, whose token is dropped, and which writes nothing that is read
        (docs/architecture.md, "Overlapped steps")."""
        dead = self.dead_reason
        if dead is not None:
            raise EngineDeadError(dead)
        outputs, self._carried = self._carried, []
        # Checked while the step in flight computes, for the one this call starts: weights are
        # written in place only between calls, never by a step.
        weights_checked = self._in_flight is not None and self.runner.decode_weights_unchanged()
        planned: PreparedStep | None = None
        try:
            if weights_checked:
                planned = self._plan_ahead()
            self._previous = self._close_in_flight()
            outputs += self._admit_compiled()
            if not self.scheduler.has_unfinished_requests():
                # only requests waiting for their grammar, or none: no step to run
                if planned is not None:  # (its every request ended)
                    prepared, planned = planned, None
                    self._drop_plan(prepared)
                return outputs + self._emit_previous()
            started = None
            if planned is not None:
                prepared, planned = planned, None
                started = self._start_planned(prepared)
            if started is None:
                started = self._schedule_and_start(weights_checked)
            out = started.out
            self.counters.num_steps += 1
            running = _Running(started, [self.requests.get(rid) for rid in out.req_ids])
            _mark_scheduled(running.owners)
            if started.running is not None:
                # the forward runs on the background thread while the previous step's outputs
                # are built
                self._in_flight = running
                self.counters.num_overlapped_steps += 1
                return outputs + self._emit_previous()
            outputs += self._emit_previous()
            if outputs and self.early_outputs is not None:
                # the forward below may take long (a prompt's chunk): what the step before made (a
                # first token, every decoding request's next one) goes out before it, not after
                try:
                    self.early_outputs(outputs)
                except Exception:  # (they are returned with this step's instead)
                    logger.exception("handing over a step's outputs before the next forward failed")
                else:
                    outputs = []
            return outputs + self._emit(self._close(running))
        except BaseException:
            if planned is not None:  # (the failure came before it was started)
                self._drop_plan(planned)
            # What was built before the failure is not lost: the next call returns it (a request
            # the previous step finished gets its last output, not the error of this one).
            try:
                outputs += self._emit_previous()
            except Exception:
                logger.exception("building the outputs of the step before the failed one failed")
            self._carried = outputs + self._carried
            raise

    def _schedule_and_start(self, weights_checked: bool) -> StartedStep:
        """A step scheduled from the committed tokens, its copies applied and, with overlapped
        steps, its native decode step started in the background."""
        try:
            out = self.scheduler.schedule()
        except BaseException as exc:
            # An interrupt can land after schedule() returned and before `out` was bound:
            # the step it opened must still be closed, or every later schedule() fails.
            lost = self.scheduler.open_step_output()
            if lost is not None:
                self._recover_from_failed_step(lost, exc)
            raise
        try:
            return self.runner.start(
                out,
                self._prefill_rows(out),
                background=self.async_scheduling,
                weights_checked=weights_checked,
            )
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise self._recover_from_failed_step(out, exc) from exc
            self._recover_from_failed_step(out, exc)
            raise

    def _plan_ahead(self) -> PreparedStep | None:
        """The step after the one in flight, planned and its native decode step prepared while
        that one computes, or None where the scheduler cannot plan it yet (it then schedules
        after the update, as without overlap). Called only with the weights checked."""
        if not self.plans_ahead or self._in_flight is None:
            return None
        try:
            out = self.scheduler.schedule_ahead()
            prepared = None if out is None else self.runner.prepare(out)
        except Exception:
            # a plan is an optimisation: the step is scheduled after the update instead
            logger.exception("planning the next step ahead failed; scheduling it after the update")
            self.scheduler.discard_ahead()
            return None
        if out is not None and prepared is None:
            self.scheduler.discard_ahead()
        return prepared

    def _drop_plan(self, prepared: PreparedStep) -> None:
        """A planned step that will not be started: the scheduler forgets it, its output buffer
        is given back."""
        self.scheduler.discard_ahead()
        self.runner.drop_prepared(prepared)

    def _start_planned(self, prepared: PreparedStep) -> StartedStep | None:
        """Starts the planned step once the step before is committed, when the scheduler
        confirms it is what it would schedule now (the tokens just sampled are then written
        into it); None, with the plan dropped, when it is not."""
        try:
            confirmed = self.scheduler.confirm_ahead(prepared.out)
        except BaseException:
            self.runner.drop_prepared(prepared)
            raise
        if not confirmed:
            self.runner.drop_prepared(prepared)
            return None
        try:
            started = self.runner.start_prepared(prepared)
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise self._recover_from_failed_step(prepared.out, exc) from exc
            self._recover_from_failed_step(prepared.out, exc)
            raise
        self.counters.num_planned_steps += 1
        return started

    def _emit_previous(self) -> list[RequestOutput]:
        """The outputs of the step committed at the start of this one, once."""
        previous, self._previous = self._previous, None
        return [] if previous is None else self._emit(previous)

    def _close_in_flight(self) -> _ClosedStep | None:
        """Waits for the step left running on the background thread, if any, and commits it."""
        running, self._in_flight = self._in_flight, None
        return None if running is None else self._close(running)

    def _close(self, running: _Running) -> _ClosedStep:
        """Finishes a started step (its forward, or the wait for it; sampling) and commits it in
        the scheduler."""
        started = running.started
        out = started.out
        try:
            # The rows are read now. A request that a stop string ended, or that was aborted,
            # since the step was planned has its row computed and nothing sampled for it; so
            # does one aborted and added again under the same id (a new request, not this row's).
            rows = [
                self._row_sampling(rid) if owner is not None and self.requests.get(rid) is owner else None
                for rid, owner in zip(out.req_ids, running.owners)
            ]
            ran = self.runner.finish(started, rows)
            self._count_verified(ran)
            # A row that failed alone (non-finite logits, a sampling error) ends its request: it
            # is aborted before the update, which so drops every state its row wrote this step.
            row_failures = {str(out.req_ids[r]): why for r, why in ran.failed.items()}
            for rid in row_failures:
                self.scheduler.abort_request(rid)
            sampled, num_sampled = ran.sampled_arrays()
            deltas = self.scheduler.update_from_output(
                out, sampled, num_sampled, ran.draft_token_ids, ran.num_draft_tokens
            )
        except Exception as exc:
            started.abandon()
            raise self._recover_from_failed_step(out, exc) from exc
        except BaseException as exc:
            # Ctrl-C (or SystemExit) mid-step: close the step the same way, so that the engine
            # stays usable, and let the interrupt through
            started.abandon()
            self._recover_from_failed_step(out, exc)
            raise
        return _ClosedStep(out, ran, deltas, row_failures)

    def _emit(self, closed: _ClosedStep) -> list[RequestOutput]:
        """The outputs of a committed step: its tokens detokenized, stop strings matched,
        finished requests forgotten, KV events published."""
        out, ran = closed.out, closed.ran
        for r, (first, entries) in ran.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(str(out.req_ids[r]), first, entries)
        outputs, done = self.outputs.process(
            closed.deltas, out.req_ids, ran.logprobs, self.scheduler.finish_request
        )
        for rid, why in closed.row_failures.items():
            st = self.requests.get(rid)
            if st is None:
                continue
            st.finish_reason, st.stop_reason = "error", None
            failed = st.to_output(finished=True)
            refusal = st.grammar_refusal()
            if refusal is None:
                logger.error("request %s failed alone: %s", rid, why)
                failed.error = why
            else:  # (a 400: its grammar is too large to follow)
                logger.info("request %s refused: %s", rid, refusal)
                failed.error, failed.invalid = refusal, True
            outputs.append(failed)
            done.append(rid)
        # Forgotten only once every output of the step exists: after a failure in `process` they
        # are all still in self.requests, where the caller can report to them.
        for rid in done:
            self._forget(rid)
        self.publish_kv_events()
        return outputs

    def _settle(self) -> None:
        """Completes the step left running, if any; its outputs come with the next `step()`."""
        previous = self._close_in_flight()
        if previous is not None:
            self._carried.extend(self._emit(previous))

    def publish_kv_events(self) -> None:
        """Hands the KV cache events recorded since the last call to the publisher."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())

    def shutdown(self) -> None:
        """Ends what the engine started: the tensor-parallel workers, the grammar workers once their
        compilations end, and the KV-events publisher after it has sent what it has. Idempotent."""
        self._settle()
        self.stop_workers()
        if "grammars" in self.__dict__:  # (its threads exist only once a grammar was compiled)
            self.grammars.shutdown(timeout=GRAMMAR_SHUTDOWN_WAIT_S)
        if self.kv_events is not None:
            self.publish_kv_events()
            self._close_kv_events()  # (the publisher's shutdown, run once: not again when collected)
            self._kv_events_dropped = (self.kv_events.events_dropped, self.kv_events.batches_dropped)
            self.kv_events = None

    def _row_sampling(self, request_id: str) -> RowSampling | None:
        st = self.requests.get(request_id)
        if st is None:
            return None
        row = st.sampling_row
        if row is None:  # (after the grammar is known: a request is scheduled once it is)
            row = st.sampling_row = RowSampling(
                params=st.params,
                seed=st.seed,
                prompt_token_ids=st.prompt_token_ids,
                output_token_ids=st.output_token_ids,
                eos_token_id=self.eos_token_id,
                grammar=st.grammar,
                bad_word_ids=st.bad_word_ids,
            )
        return row

    def _prefill_rows(self, out: _core.SchedulerOutput) -> list[RowSampling | None]:
        """What `ModelRunner.start` reads of the rows: the prefill rows' (whether they score the
        prompt); the decode rows (the first `num_decodes`) are left None, their sampling is built
        when the step finishes."""
        req_ids = out.req_ids
        num_decodes = int(out.num_decodes)
        return [None] * num_decodes + [self._row_sampling(rid) for rid in req_ids[num_decodes:]]

    def _count_verified(self, ran: ModelRunnerOutput) -> None:
        for drafted, accepted in ran.verified:
            self.counters.spec_decode_draft_tokens += drafted
            self.counters.spec_decode_verify_rows += 1
            self.counters.spec_decode_accepted_tokens += accepted
            for pos in range(min(accepted, len(self.acceptance_per_position))):
                self.acceptance_per_position[pos] += 1

    def _recover_from_failed_step(self, out: _core.SchedulerOutput, exc: BaseException) -> StepError:
        """A forward that failed half-way may have written some state slots and KV blocks and not
        others. So every request in flight fails, the step is closed without committing any
        checkpoint it would have written (`cancel_step`), and the prefix cache is emptied: nothing
        written by the broken step can ever be read. The engine is then idle and consistent.
        With tensor parallelism the ranks may have stopped at different points of the step: the
        engine is dead (`dead_reason`), and runs no further step."""
        # The step committed before this one still has its outputs to build: built first, while
        # its requests are known, they come with the next call.
        try:
            self._carried.extend(self._emit_previous())
        except Exception:
            logger.exception("building the outputs of the step before the failed one failed")
        executor = self.runner.executor
        if executor is not None:
            # A worker that died is the cause of the failed step (its peers' collectives broke):
            # record that first, if so, rather than the step's own error. A killed worker holding
            # a model takes a while to be torn down on a loaded machine: it is given 3 s.
            try:
                executor.check_alive(grace=3.0)
            except EngineDeadError:
                pass
            executor.fail(f"a step failed under tensor parallelism: {str(exc) or type(exc).__name__}")
        failed = list(self.requests)
        for rid in failed:
            self.scheduler.abort_request(rid)
        empty = np.zeros(0, dtype=np.int32)
        try:
            self.scheduler.cancel_step(out)
        except HybridServeError:
            pass  # the failure came after the update: the step is already closed
        self.scheduler.update_from_output(self.scheduler.schedule(), empty, empty)  # drains the aborts
        for rid in failed:
            self._forget(rid)
        if not self.scheduler.reset_prefix_cache():
            logger.error("could not empty the prefix cache after a failed step")
        # (now: the engine goes idle, and a router must not route by the emptied cache until the
        # next request's step)
        self.publish_kv_events()
        if isinstance(exc, Exception):
            logger.exception("engine step failed; %d requests failed with it", len(failed))
        else:
            logger.warning("engine step interrupted (%r); %d requests aborted", exc, len(failed))
        return StepError(f"the engine step failed: {exc}", failed)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.scheduler.stats())
        # requests whose grammar still compiles wait outside the scheduler: they are waiting too
        awaiting = len(self._awaiting_grammar)
        # The names of the metrics contract, beside the scheduler's own.
        s.update(
            num_requests_running=s.get("num_running", 0),
            num_requests_waiting=s.get("num_waiting", 0) + awaiting,
            num_requests_awaiting_grammar=awaiting,
            prefix_cache_queried_tokens=s.get("prefix_queried_tokens", 0),
            prefix_cache_hit_tokens=s.get("prefix_hit_tokens", 0),
            # vLLM's figures leave out a preempted request's lookup again (counted apart there)
            vllm_prefix_cache_queried_tokens=s.get("prefix_queried_tokens", 0)
            - s.get("prefix_preempted_queried_tokens", 0),
            vllm_prefix_cache_hit_tokens=s.get("prefix_hit_tokens", 0)
            - s.get("prefix_preempted_hit_tokens", 0),
            prefix_cache_lost_tokens=s.get("prefix_lost_tokens", 0),
            # sequences the state pool can run with their windows and a checkpoint slot each
            mamba_state_capacity_seqs=self.em.sizes.state_pool_capacity,
            block_size=int(self.config.block_size),
            enable_prefix_caching=bool(self.config.enable_prefix_caching),
        )
        pub = self.kv_events
        dropped = (pub.events_dropped, pub.batches_dropped) if pub is not None else self._kv_events_dropped
        if dropped is not None:
            # what a subscriber can receive: the events of batches the publisher's queue dropped
            # are not among them (also once the publisher was shut down)
            s["kv_events_emitted"] = s.get("kv_events_emitted", 0) - dropped[0]
            s["kv_event_batches_dropped"] = dropped[1]
        else:
            s["kv_event_batches_dropped"] = 0  # no publisher: nothing to drop
        verify_rows = self.counters.spec_decode_verify_rows
        s.update(
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.outputs.num_generation_tokens,
            spec_decode_draft_tokens=self.counters.spec_decode_draft_tokens,
            spec_decode_accepted_tokens=self.counters.spec_decode_accepted_tokens,
            spec_decode_acceptance_per_position=list(self.acceptance_per_position),
            spec_decode_verify_rows=verify_rows,
            # Tokens a verify row yields on average: accepted drafts + the bonus/correction token.
            spec_decode_mean_accepted_length=(
                1.0 + self.counters.spec_decode_accepted_tokens / verify_rows if verify_rows else 0.0
            ),
            num_steps=self.counters.num_steps,
            num_overlapped_steps=self.counters.num_overlapped_steps,
            num_planned_steps=self.counters.num_planned_steps,
        )
        return s

    def reset_prefix_cache(self) -> bool:
        self._settle()  # the scheduler refuses while a step is open
        done = bool(self.scheduler.reset_prefix_cache())
        self.publish_kv_events()
        return done
