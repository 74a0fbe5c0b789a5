"""The model runner: owns the model, its caches, the kernels they run on, the sampler, the
rejection sampler and the draft proposer, and turns one `SchedulerOutput` into sampled tokens.

It holds no request state of its own: what it needs about each row (sampling parameters, seed,
history) comes with the call, so a worker process that owns a shard of the model can run it from
the scheduler's output alone. The engine keeps the scheduler and the requests.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridserve import _core
from hybridserve.distributed.worker import StepInputs
from hybridserve.engine.model_setup import EngineModel
from hybridserve.engine.persistent_batch import PersistentBatch
from hybridserve.errors import ConfigError
from hybridserve.kernels import backend
from hybridserve.model.batch import (
    DEVICE_ARRAYS,
    HOST_ARRAYS,
    ForwardBatch,
    HostStaging,
    forward_batch_from_arrays,
)
from hybridserve.model.cuda_graphs import DecodeGraphs, SchedulerArrays
from hybridserve.model.decode_step import DecodeOutput, DecodeStep, NativeCall, PendingDecode
from hybridserve.sampling.logprobs import TokenLogprobs
from hybridserve.sampling.sampler import RowSampling, Sampler, compute_logprobs
from hybridserve.spec_decode.base import History

logger = logging.getLogger("hybridserve.engine")


@dataclass
class _PromptScoring:
    """The extra logits a step computes for prompt logprobs. `logits_indices`: every flat token
    index whose logits the forward returns, increasing (the scheduler's sampling indices and the
    prompt positions of scoring rows), so the model keeps its tail-rows path; `sampling_rows`: the
    rows of those logits that are the scheduler's, in its order; `spans`: per scoring row, (row,
    its first target position, the logits rows predicting its targets in order)."""

    logits_indices: torch.Tensor
    sampling_rows: torch.Tensor
    spans: list[tuple[int, int, list[int]]]

    def logprobs(
        self, logits: torch.Tensor, rows: Sequence[RowSampling | None]
    ) -> dict[int, tuple[int, list[TokenLogprobs | None]]]:
        out: dict[int, tuple[int, list[TokenLogprobs | None]]] = {}
        for r, first, idx in self.spans:
            row = _known(rows[r])
            targets = torch.as_tensor(row.prompt_token_ids[first : first + len(idx)], dtype=torch.int64)
            source = torch.log_softmax(logits[idx], dim=-1)
            top = row.params.prompt_logprobs
            out[r] = (first, compute_logprobs(source, targets, [top] * len(idx)))
        return out


def _prompt_scoring(out: _core.SchedulerOutput, rows: Sequence[RowSampling | None]) -> _PromptScoring | None:
    """The logits a step needs beyond the scheduler's when a prefill row asks for prompt
    logprobs: the logits at prompt position p give the log-probability of prompt token p + 1."""
    num_decodes = int(out.num_decodes)
    wanted = [
        r
        for r in range(num_decodes, len(rows))
        if (row := rows[r]) is not None and row.params.prompt_logprobs is not None
    ]
    if not wanted:
        return None
    qsl = np.asarray(out.query_start_loc, dtype=np.int64)
    positions = np.asarray(out.positions, dtype=np.int64)
    extra: list[int] = []
    extra_spans: list[tuple[int, int, list[int]]] = []
    for r in wanted:
        num_prompt = len(_known(rows[r]).prompt_token_ids)
        flat = [i for i in range(int(qsl[r]), int(qsl[r + 1])) if positions[i] + 1 < num_prompt]
        if flat:
            extra.extend(flat)
            extra_spans.append((r, int(positions[flat[0]]) + 1, flat))
    if not extra:
        return None
    sampling = np.asarray(out.logits_indices, dtype=np.int64)
    union = np.union1d(sampling, np.asarray(extra, dtype=np.int64))  # sorted, unique
    where = {int(i): k for k, i in enumerate(union.tolist())}
    return _PromptScoring(
        logits_indices=torch.from_numpy(union),
        sampling_rows=torch.as_tensor([where[int(i)] for i in sampling.tolist()], dtype=torch.int64),
        spans=[(r, first, [where[i] for i in flat]) for r, first, flat in extra_spans],
    )


_grammar_of = operator.attrgetter("grammar")

_NOT_FINITE = "the model's logits for this request are not finite (NaN or inf)"

# What sampling produced for one row: its tokens, their logprobs (when asked for), and
# (drafts verified, drafts accepted) for a verify row.
_RowResult = tuple[list[int], list[TokenLogprobs] | None, tuple[int, int] | None]


@dataclass
class ModelRunnerOutput:
    """What one step produced, row by row in the order of the scheduler output's `req_ids`."""

    sampled: list[list[int]]  # tokens emitted by each row (none for a partial prefill chunk)
    logprobs: list[list[TokenLogprobs] | None]  # per row, when the request asked for logprobs
    draft_token_ids: np.ndarray  # int32, the next step's drafts of every row back to back
    num_draft_tokens: np.ndarray  # int32, per row
    # (drafts verified, drafts accepted) of each row that verified drafts this step
    verified: list[tuple[int, int]] = field(default_factory=list)
    # Rows whose request failed alone this step (row -> why): non-finite logits or an error while
    # sampling it. Nothing was sampled for them; the engine ends their requests with the error.
    failed: dict[int, str] = field(default_factory=dict)
    # Prompt logprobs computed this step: row -> (first prompt position, entries for it and on),
    # one entry per prompt token whose predicting position the row's chunk holds.
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs | None]]] = field(default_factory=dict)
    # `sampled_arrays()` already made, when sampling produced the tokens as an array (a step of
    # plain greedy rows takes the native step's argmaxes): no loop over the rows to make them
    flat: tuple[np.ndarray, np.ndarray] | None = None

    def sampled_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(every sampled token back to back, the count of each row) as the scheduler takes them."""
        if self.flat is not None:
            return self.flat
        flat = [t for row in self.sampled for t in row]
        counts = [len(r) for r in self.sampled]
        return np.asarray(flat, dtype=np.int32), np.asarray(counts, dtype=np.int32)


@dataclass
class StartedStep:
    """A step `ModelRunner.start` has begun: its copies are applied; `running` is its native
    decode step when that runs on the background thread (until `finish` waits for it)."""

    out: _core.SchedulerOutput
    scoring: _PromptScoring | None
    running: PendingDecode | None = None

    def abandon(self) -> None:
        """Waits for the background step, if any, dropping what it computed: a step that
        failed must not go on writing the caches while the engine recovers."""
        running, self.running = self.running, None
        if running is not None:
            try:
                running.wait()
            except Exception:  # (its own failure: the step fails anyway)
                pass


@dataclass
class PreparedStep:
    """A step planned ahead (`Scheduler.schedule_ahead`) with its native decode step prepared
    while the step before computes (`ModelRunner.prepare`); `start_prepared` posts it once its
    input tokens are written."""

    out: _core.SchedulerOutput
    call: NativeCall


def to_forward_batch(
    out: _core.SchedulerOutput, device: torch.device, staging: HostStaging | None = None
) -> ForwardBatch:
    """The scheduler's numpy arrays as the tensors the model reads (moved in one copy with
    `staging`)."""
    arrays = {name: getattr(out, name) for name in (*DEVICE_ARRAYS, *HOST_ARRAYS)}
    return forward_batch_from_arrays(arrays, int(out.num_decodes), device, staging)


def _step_inputs(out: _core.SchedulerOutput, scoring: _PromptScoring | None) -> StepInputs:
    """What the tensor-parallel workers need of this step: its copies and its forward's arrays,
    with the logits rows this process computes (every rank keeps the same rows)."""
    batch: dict[str, np.ndarray] | None = None
    if out.num_scheduled_tokens > 0:
        batch = {name: np.asarray(getattr(out, name)) for name in (*DEVICE_ARRAYS, *HOST_ARRAYS)}
        if scoring is not None:
            batch["logits_indices"] = scoring.logits_indices.numpy()
    return StepInputs(
        kv_copies=np.asarray(out.kv_copies),
        state_copies=np.asarray(out.state_copies),
        batch=batch,
        num_decodes=int(out.num_decodes),
    )


class ModelRunner:
    def __init__(self, em: EngineModel, num_speculative_tokens: int, cuda_graphs: bool = False) -> None:
        self.em = em
        # the kernels are chosen (and built) once, here, and every step uses them
        try:
            self.kernels = backend.resolve(em.device)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"kernels: {e}") from e
        backend.pin(self.kernels)
        logger.info("kernels: %s: %s", self.kernels, backend.describe(self.kernels))
        self.num_speculative_tokens = num_speculative_tokens
        self.sampler = Sampler()
        # each request's sampling settings, kept across steps (gathered per step as arrays)
        self.batch = PersistentBatch()
        # on an accelerator a step's input arrays move in one copy from a buffer kept here
        self.staging = HostStaging(em.device) if em.device.type != "cpu" else None
        # tensor parallelism: the workers that run every step's forward with this process
        self.executor: Any = em.executor
        self.proposer: Any = em.proposer
        self.decode_step = (
            DecodeStep.for_model(em.model, em.caches)
            if em.device.type == "cpu" and self.executor is None
            else None
        )
        # with `cuda_graphs` (--no-enforce-eager), on a GPU with the CUDA kernels, steps of decode /
        # verify rows replay CUDA graphs (model/cuda_graphs.py)
        self.graphs: DecodeGraphs | None = None
        if (
            cuda_graphs
            and em.device.type == "cuda"
            and self.kernels is backend.Backend.CUDA
            and self.executor is None
        ):
            block_size = int(em.resolved.block_size)
            self.graphs = DecodeGraphs(
                em.model,
                em.caches,
                max_rows=int(em.resolved.max_num_seqs),
                max_tokens_per_row=1 + num_speculative_tokens,
                max_blocks_per_row=-(-int(em.resolved.max_model_len) // block_size),
            )
        self.rejection_sampler: Any = None
        if num_speculative_tokens > 0:
            from hybridserve.sampling.rejection import RejectionSampler

            self.rejection_sampler = RejectionSampler()

    def stop_workers(self) -> None:
        """Ends the tensor-parallel workers (nothing without them)."""
        if self.executor is not None:
            self.executor.shutdown()

    def free_request(self, request_id: str) -> None:
        """The request is gone: its persistent batch slot is freed, and a proposer that keeps
        state per request drops it."""
        self.batch.free(request_id)
        free = getattr(self.proposer, "free", None)
        if free is not None:
            free(request_id)

    def start(
        self,
        out: _core.SchedulerOutput,
        rows: Sequence[RowSampling | None],
        background: bool = False,
        weights_checked: bool = False,
    ) -> StartedStep:
        """The first half of a step: the copies the scheduler asked for, and with `background` a
        step of decode rows that the native decode step runs is started on its background thread
        and left running (`StartedStep.running`); `finish` waits for it. Every other step's
        forward runs in `finish`, so that nothing of it has run when this returns. Only the
        prefill rows of `rows` are read here (whether they ask for prompt logprobs).
        `weights_checked`: `decode_weights_unchanged()` was true since the weights could last
        have been written."""
        scoring = _prompt_scoring(out, rows) if out.num_scheduled_tokens > 0 else None
        if self.executor is not None:
            self.executor.send_step(_step_inputs(out, scoring))
        caches = self.em.caches
        if len(out.kv_copies):
            caches.apply_kv_copies(torch.from_numpy(np.ascontiguousarray(out.kv_copies)))
        if len(out.state_copies):
            caches.apply_state_copies(torch.from_numpy(np.ascontiguousarray(out.state_copies)))
        started = StartedStep(out, scoring)
        if background and self.decode_step is not None and scoring is None and out.num_scheduled_tokens > 0:
            started.running = self.decode_step.launch(out, weights_checked)
        return started

    def prepare(self, out: _core.SchedulerOutput) -> PreparedStep | None:
        """The native decode step of a step planned ahead, prepared (its layout checked, its
        arguments and output buffer ready) while the step before it computes; None where the
        native decode step does not run it. The caller has checked the weights
        (`decode_weights_unchanged`) and checks them again before `start_prepared`. A planned
        step has no copies."""
        if self.decode_step is None or len(out.state_copies) or len(out.kv_copies):
            return None
        call = self.decode_step.prepare(out, weights_checked=True)
        return None if call is None else PreparedStep(out, call)

    def start_prepared(self, prepared: PreparedStep) -> StartedStep:
        """`start` of a prepared step: posted to the background thread (or, if it will not run
        there, left for `finish` to run as any step)."""
        assert self.decode_step is not None
        started = StartedStep(prepared.out, None)
        started.running = self.decode_step.post(prepared.call)
        return started

    def drop_prepared(self, prepared: PreparedStep) -> None:
        """A prepared step that will not run gives back its output buffer."""
        if self.decode_step is not None:
            self.decode_step.recycle(prepared.call.output)

    def decode_weights_unchanged(self) -> bool:
        """Whether the native decode step may run on the weights as they are now (none written in
        place since it was built); False without one."""
        return self.decode_step is not None and self.decode_step.weights_unchanged()

    def finish(self, started: StartedStep, rows: Sequence[RowSampling | None]) -> ModelRunnerOutput:
        """The second half of a step: the forward (or the wait for the one `start` left running),
        sampling (or verification of drafts), and the next drafts. `rows[r]` describes request
        `out.req_ids[r]`; None for a request that is gone (its row is computed and nothing is
        sampled for it)."""
        out, scoring = started.out, started.scoring
        req_ids: list[str] = list(out.req_ids)
        num_rows = len(req_ids)
        result = ModelRunnerOutput(
            sampled=[[] for _ in range(num_rows)],
            logprobs=[None] * num_rows,
            draft_token_ids=np.zeros(0, dtype=np.int32),
            num_draft_tokens=np.zeros(num_rows, dtype=np.int32),
        )
        if out.num_scheduled_tokens > 0:
            slots = self.batch.slots(req_ids, rows)  # (while a background step computes)
            # a step of decode rows (one token, or a token with its drafts) runs in one native
            # call when the model allows (model/decode_step.py); None: the model's forward runs it
            if started.running is not None:
                running, started.running = started.running, None
                greedy = _plain_greedy(self.batch, slots, rows)
                fused: DecodeOutput | None = running.wait()
            elif self.decode_step is not None and scoring is None:
                fused = self.decode_step.run(out)
                greedy = fused is not None and _plain_greedy(self.batch, slots, rows)
            else:
                fused, greedy = None, False
            if fused is not None:
                if not (greedy and _take_greedy(fused, result, out.num_logits)):
                    self._sample(out, slots, rows, fused.logits, result, fused.finite)
                assert self.decode_step is not None
                self.decode_step.recycle(fused)  # (nothing read from it is a view of it)
            else:
                graphed = None
                if self.graphs is not None and scoring is None:
                    graphed = self.graphs.run(SchedulerArrays(out), int(out.num_decodes))
                if graphed is not None:
                    logits = graphed
                else:
                    batch = to_forward_batch(out, self.em.device, self.staging)
                    if scoring is not None:
                        batch.logits_indices = scoring.logits_indices
                    with torch.inference_mode():
                        logits = self.em.model.forward(batch, self.em.caches)
                if scoring is not None:
                    result.prompt_logprobs = scoring.logprobs(logits, rows)
                    logits = logits[scoring.sampling_rows]
                self._sample(out, slots, rows, logits, result)
        result.draft_token_ids, result.num_draft_tokens = self._propose(req_ids, rows, result.sampled)
        return result

    def _sample(
        self,
        out: _core.SchedulerOutput,
        slots: np.ndarray,
        rows: Sequence[RowSampling | None],
        logits: torch.Tensor,
        result: ModelRunnerOutput,
        finite: np.ndarray | None = None,
    ) -> None:
        """Samples (or verifies) every row of a step from its `logits`. `finite`: whether each
        logits row is finite, where the native decode step has found it already."""
        logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
        num_logits = np.asarray(out.num_logits, dtype=np.int64)
        num_drafts = np.asarray(out.num_draft_tokens, dtype=np.int64)
        # Where each row's logits and drafts start in the flat arrays, and which rows sample
        # (array operations: at batch 64 a loop over the rows cost more than the argmax).
        logit_ends = np.cumsum(num_logits)
        logit_starts = logit_ends - num_logits
        draft_starts = np.cumsum(num_drafts) - num_drafts
        known = np.fromiter((r is not None for r in rows), dtype=bool, count=len(rows))
        samples = known & (num_logits > 0)
        plain_rows: list[int] = np.flatnonzero(samples & (num_drafts == 0)).tolist()
        spec_rows: list[int] = np.flatnonzero(samples & (num_drafts > 0)).tolist()

        # A row's failure is its own: logits that are not finite (NaN or inf: an overflow in
        # this sequence) or an error while sampling it end that request alone, and the other
        # rows sample exactly as they would have (sampling draws are keyed per request).
        if finite is None:
            finite = _finite_rows(logits)
        if not finite.all():
            bad_plain = ~finite[logit_ends[plain_rows] - 1] if plain_rows else np.zeros(0, dtype=bool)
            bad_spec = [not finite[logit_starts[r] : logit_ends[r]].all() for r in spec_rows]
            for rows_of_kind, bad in ((plain_rows, bad_plain), (spec_rows, bad_spec)):
                for r in [r for r, b in zip(list(rows_of_kind), bad) if b]:
                    result.failed[r] = _NOT_FINITE
                    rows_of_kind.remove(r)
        if plain_rows:
            self._isolating(
                plain_rows,
                lambda rs: self._sample_plain(rs, slots, rows, logits, logit_starts, num_logits),
                result,
            )
        if spec_rows:
            self._isolating(
                spec_rows,
                lambda rs: self._verify(
                    rs, out, slots, rows, logits, logit_starts, draft_starts, num_logits, num_drafts
                ),
                result,
            )

    def _isolating(
        self,
        batch_rows: list[int],
        run: Callable[[list[int]], dict[int, _RowResult]],
        result: ModelRunnerOutput,
    ) -> None:
        """Runs `run` on all of `batch_rows` at once; if that raises, on each row alone, so that
        only the rows that fail by themselves fail (recorded in `result.failed`)."""
        try:
            done = run(batch_rows)
        except Exception as exc:
            if len(batch_rows) == 1:
                done = {}
                result.failed[batch_rows[0]] = f"sampling failed: {exc}"
            else:
                logger.warning(
                    "sampling a batch of %d rows failed (%s); sampling row by row", len(batch_rows), exc
                )
                done = {}
                for r in batch_rows:
                    try:
                        done.update(run([r]))
                    except Exception as row_exc:
                        result.failed[r] = f"sampling failed: {row_exc}"
        for r, (tokens, lps, verified) in done.items():
            result.sampled[r] = tokens
            result.logprobs[r] = lps
            if verified is not None:
                result.verified.append(verified)

    def _sample_plain(
        self,
        plain_rows: list[int],
        slots: np.ndarray,
        rows: Sequence[RowSampling | None],
        logits: torch.Tensor,
        logit_starts: np.ndarray,
        num_logits: np.ndarray,
    ) -> dict[int, _RowResult]:
        plain = [_known(rows[r]) for r in plain_rows]
        # (every row, in order: the step's own slots, whose gathered settings the batch keeps)
        params = self.batch.params(slots if len(plain_rows) == len(slots) else slots[plain_rows], plain)
        idx = logit_starts[plain_rows] + num_logits[plain_rows] - 1
        # (a decode step's rows sample every logits row, in order: no gathered copy of them)
        every = len(idx) == logits.shape[0] and bool((idx == np.arange(len(idx))).all())
        res = self.sampler.sample(logits if every else logits[idx.tolist()], plain, params=params)
        token_ids = res.token_ids.tolist()  # one conversion, not one per row
        done: dict[int, _RowResult] = {}
        for i, r in enumerate(plain_rows):
            entry = res.logprobs[i] if res.logprobs is not None else None
            done[r] = ([int(token_ids[i])], None if entry is None else [entry], None)
        return done

    def _verify(
        self,
        spec_rows: list[int],
        out: _core.SchedulerOutput,
        slots: np.ndarray,
        rows: Sequence[RowSampling | None],
        logits: torch.Tensor,
        logit_starts: np.ndarray,
        draft_starts: np.ndarray,
        num_logits: np.ndarray,
        num_drafts: np.ndarray,
    ) -> dict[int, _RowResult]:
        spec = [_known(rows[r]) for r in spec_rows]
        ks = [int(num_drafts[r]) for r in spec_rows]
        for r, k in zip(spec_rows, ks):
            if int(num_logits[r]) != k + 1:
                raise ValueError(f"row {r}: {int(num_logits[r])} logits for {k} drafts (need {k + 1})")
        # the flat form: the rows' logits and drafts back to back (one index, no per-row slices)
        logit_idx = [
            i for r, k in zip(spec_rows, ks) for i in range(logit_starts[r], logit_starts[r] + k + 1)
        ]
        target = logits if logit_idx == list(range(logits.shape[0])) else logits[logit_idx]
        all_drafts = np.asarray(out.draft_token_ids, dtype=np.int64).tolist()
        flat_drafts = [
            t for r, k in zip(spec_rows, ks) for t in all_drafts[draft_starts[r] : draft_starts[r] + k]
        ]
        params = self.batch.params(slots[spec_rows], spec)
        emitted = self.rejection_sampler.sample(target, flat_drafts, spec, ks, params=params)
        done: dict[int, _RowResult] = {}
        for i, r in enumerate(spec_rows):
            tokens = [int(t) for t in emitted[i]]
            lps: list[TokenLogprobs] | None = None
            top_n = spec[i].params.logprobs
            if top_n is not None:
                start = logit_starts[r]
                source = torch.log_softmax(logits[start : start + len(tokens)], dim=-1)
                entries = compute_logprobs(source, torch.tensor(tokens), [top_n] * len(tokens))
                lps = [e for e in entries if e is not None]
            done[r] = (tokens, lps, (ks[i], len(tokens) - 1))
        return done

    def _propose(
        self, req_ids: list[str], rows: Sequence[RowSampling | None], sampled: list[list[int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        num_rows = len(req_ids)
        counts = np.zeros(num_rows, dtype=np.int32)
        if self.proposer is None or self.num_speculative_tokens == 0:
            return np.zeros(0, dtype=np.int32), counts
        histories: list[History] = []
        proposing: list[int] = []
        for r in range(num_rows):
            row = rows[r]
            if row is None or not sampled[r]:
                continue
            proposing.append(r)
            # (the request's own lists: a proposer that keeps its history adds what is new)
            histories.append(History(row.prompt_token_ids, row.output_token_ids, sampled[r]))
        flat: list[int] = []
        if proposing:
            k = self.num_speculative_tokens
            proposals = self.proposer.propose_histories([req_ids[r] for r in proposing], histories, k)
            per_row = {r: list(p)[:k] for r, p in zip(proposing, proposals)}
            for r in range(num_rows):
                p = per_row.get(r, [])
                counts[r] = len(p)
                flat.extend(int(t) for t in p)
        return np.asarray(flat, dtype=np.int32), counts


def _finite_rows(logits: torch.Tensor) -> np.ndarray:
    """Whether every logit of each row is finite (bool [rows]). On the CPU with numpy: torch's
    isfinite took 39 ms for 64 rows of a 131k vocabulary on one core, numpy's 1.7 ms."""
    if logits.device.type == "cpu":
        finite: np.ndarray = np.isfinite(logits.detach().numpy()).all(axis=-1)
        return finite
    return torch.isfinite(logits).all(dim=-1).cpu().numpy()


def _plain_greedy(batch: PersistentBatch, slots: np.ndarray, rows: Sequence[RowSampling | None]) -> bool:
    """Whether every row is plain greedy (no logprobs, penalties, logit bias or grammar), so that
    its token is the argmax the decode step computed, as the sampler's would be."""
    if not batch.all_plain_greedy(slots):  # (false too where a row is None)
        return False
    return all(map(operator.is_, map(_grammar_of, rows), itertools.repeat(None)))


def _take_greedy(fused: DecodeOutput, result: ModelRunnerOutput, num_logits: Any) -> bool:
    """Sampling of a native step of plain greedy rows (`_plain_greedy`): each row's token is
    the argmax the step computed; a row with a non-finite logit fails alone, as in `_sample`.
    False (nothing recorded) unless every row has one logits row (`num_logits`, the step's):
    verify rows are the rejection sampler's, a prompt's partial chunk samples nothing."""
    greedy = fused.greedy
    if len(greedy) != len(result.sampled) or not (np.asarray(num_logits) == 1).all():
        return False
    if fused.finite.all():  # (the rule: array operations, no loop over the rows)
        result.sampled = greedy.reshape(-1, 1).tolist()  # one list per row, made in C
        result.flat = (greedy.astype(np.int32), np.ones(len(greedy), dtype=np.int32))
        return True
    finite = fused.finite.tolist()
    result.sampled = [[token] if ok else [] for token, ok in zip(greedy.tolist(), finite)]
    result.failed.update((r, _NOT_FINITE) for r, ok in enumerate(finite) if not ok)
    return True


def _known(row: RowSampling | None) -> RowSampling:
    assert row is not None  # the callers only pass rows of known requests
    return row
