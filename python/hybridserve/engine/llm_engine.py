"""LLMEngine: one engine step = schedule (Rust) -> forward (torch) -> sample -> propose -> update (Rust).

The engine is synchronous and single-threaded; AsyncEngine runs it in a thread of its own.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridserve import _core
from hybridserve.config import EngineArgs
from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.model_setup import EngineModel, build_engine_model
from hybridserve.engine.outputs import RequestOutput, TokenLogprobs
from hybridserve.engine.request_state import RequestState
from hybridserve.errors import HybridServeError, InvalidRequestError
from hybridserve.model.batch import ForwardBatch
from hybridserve.model.flops import prefill_cost
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.sampler import RowSampling, Sampler, compute_logprobs
from hybridserve.sampling.seeds import request_seed

logger = logging.getLogger("hybridserve.engine")

Prompt = str | dict[str, Any] | Sequence[int]


class StepError(HybridServeError):
    """An engine step failed; the requests in flight (`request_ids`) failed with it."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_verify_rows: int = 0  # rows that verified at least one draft
    num_steps: int = 0


def _to_batch(out: _core.SchedulerOutput, device: torch.device) -> ForwardBatch:
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return ForwardBatch(
        input_ids=t(out.input_ids),
        positions=t(out.positions),
        query_start_loc=torch.from_numpy(np.ascontiguousarray(out.query_start_loc)),
        num_computed_tokens=torch.from_numpy(np.ascontiguousarray(out.num_computed_tokens)),
        seq_lens=torch.from_numpy(np.ascontiguousarray(out.seq_lens)),
        num_decodes=int(out.num_decodes),
        slot_mapping=t(out.slot_mapping),
        block_table=t(out.block_table),
        state_read_slot=t(out.state_read_slot),
        has_initial_state=t(out.has_initial_state),
        state_write_slots=t(out.state_write_slots),
        emit_row=t(out.emit_row),
        emit_token=t(out.emit_token),
        emit_slot=t(out.emit_slot),
        # on the CPU: the model moves it to the device itself, and reads it on the CPU too
        logits_indices=torch.from_numpy(np.ascontiguousarray(out.logits_indices)),
    )


def _token_ids(ids: object) -> list[int]:
    """Token ids as ints; a float, a bool or a string is an error, not a truncated id."""
    if isinstance(ids, str | bytes | bytearray):
        raise TypeError(f"{type(ids).__name__} is not a list of token ids")
    out = []
    for t in ids:  # type: ignore[attr-defined]
        if isinstance(t, bool):
            raise TypeError("a bool is not a token id")
        out.append(operator.index(t))
    return out


class LLMEngine:
    """The offline engine: add requests, call `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.em: EngineModel = build_engine_model(args)
        self.config = self.em.resolved
        self.tokenizer = self.em.tokenizer
        self.max_model_len = int(self.config.max_model_len)
        self.eos_token_id = self.em.eos_token_id
        self.scheduler = _core.Scheduler(
            self.config, self.em.sizes.num_kv_blocks, self.em.sizes.num_mamba_slots, int(args.seed)
        )
        cost = prefill_cost(self.em.model_config)
        self.scheduler.set_cost_model(
            state_bytes=int(self.em.sizes.mamba_bytes_per_slot),
            kv_bytes_per_block=int(self.em.sizes.kv_bytes_per_block),
            flops_per_token=cost.per_token,
            attn_flops_per_context_token=cost.attn_per_context_token,
        )
        self.sampler = Sampler()
        self.proposer = self.em.proposer
        self.num_speculative_tokens = int(self.config.num_speculative_tokens)
        self.rejection_sampler: Any = None
        if self.num_speculative_tokens > 0:
            from hybridserve.sampling.rejection import RejectionSampler

            self.rejection_sampler = RejectionSampler()
        self.requests: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        # index of the next admitted request: keys the seed of requests without their own
        self.arrival_index = 0
        self.acceptance_per_position = [0] * self.num_speculative_tokens
        # False (the offline LLM API): step() returns only finished requests, and their text is
        # decoded once at the end unless stop strings need watching. Streaming callers keep True.
        self.stream_outputs = True

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        try:
            return self._encode_prompt(prompt)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"prompt: token ids must be integers ({exc})") from exc

    def _encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    "prompt: not valid Unicode (it holds an unpaired surrogate)"
                ) from None
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise InvalidRequestError("prompt: a dict prompt's 'prompt' must be a str")
                return self._encode_prompt(prompt["prompt"])
            raise InvalidRequestError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, bytes | bytearray) or prompt is None:
            raise InvalidRequestError(
                f"prompt: a str, a list of token ids or a dict, not {type(prompt).__name__}"
            )
        return None, _token_ids(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already running")
        params.validate()
        if params.n != 1:
            raise InvalidRequestError("n: LLMEngine takes one sequence per request; fan out n above it")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise InvalidRequestError("prompt: must not be empty")
        vocab = self.em.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len {self.max_model_len}"
            )
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        # the context may leave less room than min_tokens asks: the request then ends with
        # `length` when the context is full (as vLLM), it is not refused
        min_tokens = min(params.min_tokens, max_tokens)
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids: token ids must be in [0, {vocab})")
        seed = request_seed(params.seed, int(self.args.seed), self.arrival_index)
        self.scheduler.add_request(
            request_id,
            ids,
            max_tokens=max_tokens,
            eos_token_id=self.eos_token_id,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=bool(params.ignore_eos),
            min_tokens=min_tokens,
            priority=priority,
            cache_salt=cache_salt,
        )
        self.arrival_index += 1  # only requests that were admitted take an arrival index
        self.requests[request_id] = RequestState(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            seed=seed,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                stop=list(params.stop),
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
                min_tokens=min_tokens,
                deferred=not self.stream_outputs,
            ),
            logprobs=[] if params.logprobs is not None else None,
        )
        self.counters.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        self._forget(request_id)
        found = self.scheduler.abort_request(request_id)
        return found or state is not None

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        free = getattr(self.proposer, "free", None)
        if free is not None:
            free(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        try:
            out = self.scheduler.schedule()
        except BaseException as exc:
            # An interrupt can land after schedule() returned and before `out` was bound: the
            # step it opened must still be closed, or every later schedule() fails.
            lost = self.scheduler.open_step_output()
            if lost is not None:
                self._recover_from_failed_step(lost, exc)
            raise
        self.counters.num_steps += 1
        req_ids: list[str] = list(out.req_ids)
        num_rows = len(req_ids)
        sampled_rows: list[list[int]] = [[] for _ in range(num_rows)]
        row_logprobs: list[list[TokenLogprobs] | None] = [None] * num_rows
        try:
            kv_copies = out.kv_copies
            if len(kv_copies):
                self.em.caches.apply_kv_copies(torch.from_numpy(np.ascontiguousarray(kv_copies)))
            copies = out.state_copies
            if len(copies):
                self.em.caches.apply_state_copies(torch.from_numpy(np.ascontiguousarray(copies)))
            if out.num_scheduled_tokens > 0:
                num_logits = np.asarray(out.num_logits, dtype=np.int64)
                num_drafts = np.asarray(out.num_draft_tokens, dtype=np.int64)
                batch = _to_batch(out, self.em.device)
                with torch.inference_mode():
                    logits = self.em.model.forward(batch, self.em.caches)
                self._sample(req_ids, logits, num_logits, num_drafts, out, sampled_rows, row_logprobs)
            flat = [t for row in sampled_rows for t in row]
            sampled = np.asarray(flat, dtype=np.int32)
            num_sampled = np.asarray([len(r) for r in sampled_rows], dtype=np.int32)
            drafts, n_drafts = self._propose(req_ids, sampled_rows)
            deltas = self.scheduler.update_from_output(out, sampled, num_sampled, drafts, n_drafts)
        except Exception as exc:
            raise self._recover_from_failed_step(out, exc) from exc
        except BaseException as exc:
            # Ctrl-C (or SystemExit) mid-step: close the step the same way, so that the engine
            # stays usable, and let the interrupt through
            self._recover_from_failed_step(out, exc)
            raise
        return self._process_deltas(deltas, req_ids, sampled_rows, row_logprobs)

    def _recover_from_failed_step(self, out: _core.SchedulerOutput, exc: BaseException) -> StepError:
        """A forward that failed half-way may have written some state slots and KV blocks and not
        others. So every request in flight fails, the step is closed without committing any
        checkpoint it would have written (`cancel_step`), and the prefix cache is emptied: nothing
        written by the broken step can ever be read. The engine is then idle and consistent."""
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
        if isinstance(exc, Exception):
            logger.exception("engine step failed; %d requests failed with it", len(failed))
        else:
            logger.warning("engine step interrupted (%r); %d requests aborted", exc, len(failed))
        return StepError(f"the engine step failed: {exc}", failed)

    def _sample(
        self,
        req_ids: list[str],
        logits: torch.Tensor,
        num_logits: np.ndarray,
        num_drafts: np.ndarray,
        out: _core.SchedulerOutput,
        sampled_rows: list[list[int]],
        row_logprobs: list[list[TokenLogprobs] | None],
    ) -> None:
        logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
        draft_flat = np.asarray(out.draft_token_ids, dtype=np.int64)
        plain_rows: list[int] = []
        plain_logit_idx: list[int] = []
        spec_rows: list[int] = []
        offset = 0
        draft_offset = 0
        draft_starts: dict[int, int] = {}
        logit_starts: dict[int, int] = {}
        for r in range(len(req_ids)):
            n = int(num_logits[r])
            k = int(num_drafts[r])
            logit_starts[r] = offset
            draft_starts[r] = draft_offset
            if n > 0 and req_ids[r] in self.requests:
                if k > 0:
                    spec_rows.append(r)
                else:
                    plain_rows.append(r)
                    plain_logit_idx.append(offset + n - 1)
            offset += n
            draft_offset += k

        if plain_rows:
            rows = [self._row_sampling(req_ids[r]) for r in plain_rows]
            res = self.sampler.sample(logits[plain_logit_idx], rows)
            token_ids = res.token_ids.tolist()  # one conversion, not one per row
            for i, r in enumerate(plain_rows):
                sampled_rows[r] = [int(token_ids[i])]
                if res.logprobs is not None and res.logprobs[i] is not None:
                    row_logprobs[r] = [res.logprobs[i]]
        if spec_rows:
            rows = [self._row_sampling(req_ids[r]) for r in spec_rows]
            ks = [int(num_drafts[r]) for r in spec_rows]
            for r, k in zip(spec_rows, ks):
                if int(num_logits[r]) != k + 1:
                    raise ValueError(f"row {r}: {int(num_logits[r])} logits for {k} drafts (need {k + 1})")
            # the flat form: the rows' logits and drafts back to back (one index, no per-row slices)
            logit_idx = [
                i for r, k in zip(spec_rows, ks) for i in range(logit_starts[r], logit_starts[r] + k + 1)
            ]
            target = logits if logit_idx == list(range(logits.shape[0])) else logits[logit_idx]
            all_drafts = draft_flat.tolist()
            flat_drafts = [
                t for r, k in zip(spec_rows, ks) for t in all_drafts[draft_starts[r] : draft_starts[r] + k]
            ]
            emitted = self.rejection_sampler.sample(target, flat_drafts, rows, ks)
            for i, r in enumerate(spec_rows):
                tokens = [int(t) for t in emitted[i]]
                sampled_rows[r] = tokens
                k = ks[i]
                accepted = len(tokens) - 1
                self.counters.spec_decode_draft_tokens += k
                self.counters.spec_decode_verify_rows += 1
                self.counters.spec_decode_accepted_tokens += accepted
                for pos in range(min(accepted, len(self.acceptance_per_position))):
                    self.acceptance_per_position[pos] += 1
                top_n = self.requests[req_ids[r]].params.logprobs
                if top_n is not None:
                    start = logit_starts[r]
                    source = torch.log_softmax(logits[start : start + len(tokens)], dim=-1)
                    entries = compute_logprobs(source, torch.tensor(tokens), [top_n] * len(tokens))
                    row_logprobs[r] = [e for e in entries if e is not None]

    def _row_sampling(self, request_id: str) -> RowSampling:
        st = self.requests[request_id]
        return RowSampling(
            params=st.params,
            seed=st.seed,
            prompt_token_ids=st.prompt_token_ids,
            output_token_ids=st.output_token_ids,
            eos_token_id=self.eos_token_id,
        )

    def _propose(self, req_ids: list[str], sampled_rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        num_rows = len(req_ids)
        if self.proposer is None or self.num_speculative_tokens == 0:
            return np.zeros(0, dtype=np.int32), np.zeros(num_rows, dtype=np.int32)
        histories: list[list[int]] = []
        rows: list[int] = []
        for r, rid in enumerate(req_ids):
            st = self.requests.get(rid)
            if st is None or not sampled_rows[r]:
                continue
            rows.append(r)
            histories.append(st.all_token_ids + sampled_rows[r])
        counts = np.zeros(num_rows, dtype=np.int32)
        flat: list[int] = []
        if rows:
            ids = [req_ids[r] for r in rows]
            if hasattr(self.proposer, "propose_for"):
                proposals = self.proposer.propose_for(ids, histories, self.num_speculative_tokens)
            else:
                proposals = self.proposer.propose(histories, self.num_speculative_tokens)
            per_row: dict[int, list[int]] = {
                r: list(p)[: self.num_speculative_tokens] for r, p in zip(rows, proposals)
            }
            for r in range(num_rows):
                p = per_row.get(r, [])
                counts[r] = len(p)
                flat.extend(int(t) for t in p)
        return np.asarray(flat, dtype=np.int32), counts

    def _process_deltas(
        self,
        deltas: Sequence[Any],
        req_ids: list[str],
        sampled_rows: list[list[int]],
        row_logprobs: list[list[TokenLogprobs] | None],
    ) -> list[RequestOutput]:
        row_of = {rid: r for r, rid in enumerate(req_ids)}
        outputs: list[RequestOutput] = []
        done: list[str] = []
        now = time.monotonic()
        for d in deltas:
            st = self.requests.get(d.request_id)
            if st is None:
                continue
            new_ids = [int(t) for t in d.new_token_ids]
            st.num_cached_tokens = int(d.num_cached_tokens)
            r = row_of.get(d.request_id)
            lps = row_logprobs[r] if r is not None else None
            finished = bool(d.finished)
            reason = d.finish_reason
            stop_reason: int | str | None = None
            if reason == "stop" and not (d.stop_token_id == self.eos_token_id and not st.params.ignore_eos):
                stop_reason = d.stop_token_id  # a stop_token_ids match; EOS is no stop reason (vLLM)
            if new_ids:
                if st.first_token_time is None:
                    st.first_token_time = now
                st.last_token_time = now
            # Tokens go to the detokenizer one at a time so that a stop string ends the output at
            # the token that completed it, however many tokens this step produced.
            delta_text = ""
            kept: list[int] = []
            for i, tok in enumerate(new_ids):
                kept.append(tok)
                is_stop_token = (
                    d.stop_token_id is not None and i == len(new_ids) - 1 and tok == d.stop_token_id
                )
                if is_stop_token and not st.params.include_stop_str_in_output:
                    break  # the EOS/stop token stays in token_ids but not in the text (as vLLM)
                delta_text += st.detokenizer.add_tokens([tok], final=finished and i == len(new_ids) - 1)
                if st.detokenizer.stopped_by is not None:
                    break
            if st.detokenizer.stopped_by is not None:
                # A stop string ended the request: end it in the scheduler if it still runs.
                if not finished:
                    self.scheduler.finish_request(d.request_id)
                finished, reason, stop_reason = True, "stop", st.detokenizer.stopped_by
            elif finished and (reason != "abort" or st.detokenizer.deferred):
                # (a deferred text has not been decoded at all yet: an aborted one gets it too)
                delta_text += st.detokenizer.add_tokens([], final=True)
            new_ids = kept
            st.output_token_ids.extend(new_ids)
            self.counters.generation_tokens += len(new_ids)
            if st.logprobs is not None and lps is not None:
                kept_lps = lps[: len(new_ids)]
                for entry in kept_lps:
                    for tid, lp in entry.items():
                        lp.decoded_token = lp.decoded_token or self.tokenizer.token_to_text(tid)
                st.logprobs.extend(kept_lps)
            if finished:
                st.finished, st.finish_reason, st.stop_reason = True, reason, stop_reason
                done.append(d.request_id)
            if finished or self.stream_outputs:
                outputs.append(
                    st.to_output(finished=finished, delta_text=delta_text, delta_token_ids=new_ids)
                )
        # Forgotten only once every output of the step exists: after a failure above they are all
        # still in self.requests, where the caller can report to them.
        for rid in done:
            self._forget(rid)
        return outputs

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.scheduler.stats())
        # The names of the metrics contract, beside the scheduler's own.
        s.update(
            num_requests_running=s.get("num_running", 0),
            num_requests_waiting=s.get("num_waiting", 0),
            prefix_cache_queried_tokens=s.get("prefix_queried_tokens", 0),
            prefix_cache_hit_tokens=s.get("prefix_hit_tokens", 0),
            prefix_cache_lost_tokens=s.get("prefix_lost_tokens", 0),
        )
        s.update(
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            spec_decode_draft_tokens=self.counters.spec_decode_draft_tokens,
            spec_decode_accepted_tokens=self.counters.spec_decode_accepted_tokens,
            spec_decode_acceptance_per_position=list(self.acceptance_per_position),
            spec_decode_verify_rows=self.counters.spec_decode_verify_rows,
            # Tokens a verify row yields on average: accepted drafts + the bonus/correction token.
            spec_decode_mean_accepted_length=(
                1.0 + self.counters.spec_decode_accepted_tokens / self.counters.spec_decode_verify_rows
                if self.counters.spec_decode_verify_rows
                else 0.0
            ),
            num_steps=self.counters.num_steps,
        )
        return s

    def reset_prefix_cache(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())
