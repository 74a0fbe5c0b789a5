"""Output processing: the scheduler's per-request deltas become `RequestOutput`s — tokens through
the incremental detokenizer, stop strings watched for, logprobs given their text, finish reasons
set. Holds the Python-side state of every request (`RequestState`): what the Rust scheduler does
not keep (sampling parameters, text).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.input_processor import EngineRequest
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.request_state import RequestState
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.sampling.grammar import GrammarError
from hybridserve.sampling.logprobs import TokenLogprobs


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.requests: dict[str, RequestState] = {}
        # False (the offline LLM API): only finished requests get an output, and their text is
        # decoded once at the end unless stop strings need watching. Streaming callers keep True.
        self.stream_outputs = True
        self.num_generation_tokens = 0

    def add_request(self, req: EngineRequest) -> RequestState:
        params = req.params
        state = RequestState(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            params=params,
            seed=req.seed,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                stop=list(params.stop),
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
                min_tokens=req.min_tokens,
                deferred=not self.stream_outputs,
                context=req.prompt_token_ids,
            ),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(req.prompt_token_ids),
            score_only=req.max_tokens == 0,
            bad_word_ids=req.bad_word_ids,
        )
        self.requests[req.request_id] = state
        return state

    def add_prompt_logprobs(
        self, request_id: str, first: int, entries: Sequence[TokenLogprobs | None]
    ) -> None:
        """Logprobs of prompt tokens `first`, `first + 1`, ... computed by one step (a recomputed
        chunk writes the same positions again)."""
        st = self.requests.get(request_id)
        if st is None or st.prompt_logprobs is None:
            return
        for k, entry in enumerate(entries):
            if entry is not None:
                for tid, lp in entry.items():
                    lp.decoded_token = lp.decoded_token or self.tokenizer.token_to_text(tid)
            st.prompt_logprobs[first + k] = entry

    def process(
        self,
        deltas: Sequence[Any],
        req_ids: Sequence[str],
        row_logprobs: Sequence[list[TokenLogprobs] | None],
        finish_in_scheduler: Callable[[str], object],
    ) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of one step, and the ids of the requests that finished in it.

        `deltas` are the scheduler's `RequestDelta`s; `row_logprobs[r]` the logprobs of the tokens
        sampled for row r of the step (`req_ids[r]`). A request that a stop string ends while the
        scheduler still runs it is ended there through `finish_in_scheduler`. Finished requests
        stay in `requests` until the caller forgets them, so that after a failure half-way every
        request of the step can still be reported to.
        """
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
            if st.score_only:
                # the prompt is scored; the token sampled after it is not part of the answer
                new_ids, d_finished, d_reason = [], True, "length"
            else:
                d_finished, d_reason = bool(d.finished), d.finish_reason
            r = row_of.get(d.request_id)
            lps = row_logprobs[r] if r is not None else None
            finished = d_finished
            reason = d_reason
            stop_reason: int | str | None = None
            if reason == "stop" and not (d.stop_token_id == self.eos_token_id and not st.params.ignore_eos):
                stop_reason = d.stop_token_id  # a stop_token_ids match; EOS is no stop reason (vLLM)
            if new_ids:
                if st.first_token_time is None:
                    st.first_token_time = now
                st.last_token_time = now
            grammar_error: str | None = None
            if st.grammar is not None and new_ids:
                # Structured outputs: the grammar advances over what the scheduler accepted, token by
                # token; once it allows nothing more the output is complete and the request ends
                # there (as if the EOS that alone could follow had been sampled). A verify row can
                # carry tokens past that point (the correction token after a draft that completed
                # the grammar is the EOS its mask left): they are dropped, so the output is the one
                # plain steps give. The scheduler's own stop token ending a finished row (an EOS where
                # the grammar may end) is not fed to it; the last token before the length limit
                # is, as it may complete the grammar (then the output ended because it was complete).
                for i, tok in enumerate(new_ids):
                    if st.grammar.is_terminated():
                        new_ids = new_ids[:i]
                        break
                    if d_finished and i == len(new_ids) - 1 and tok == d.stop_token_id:
                        break
                    try:
                        st.grammar.accept([tok])
                    except GrammarError as exc:
                        grammar_error = str(exc)
                        break
                if grammar_error is not None or st.grammar.is_terminated():
                    if not finished:
                        finish_in_scheduler(d.request_id)
                    finished, reason = True, "stop" if grammar_error is None else "error"
                    if grammar_error is None:
                        stop_reason = None
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
                    finish_in_scheduler(d.request_id)
                finished, reason, stop_reason = True, "stop", st.detokenizer.stopped_by
            elif finished and (reason != "abort" or st.detokenizer.deferred):
                # (a deferred text has not been decoded at all yet: an aborted one gets it too)
                delta_text += st.detokenizer.add_tokens([], final=True)
            new_ids = kept
            st.output_token_ids.extend(new_ids)
            self.num_generation_tokens += len(new_ids)
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
                outputs[-1].error = grammar_error
                if grammar_error is not None and (refusal := st.grammar_refusal()):
                    outputs[-1].error, outputs[-1].invalid = refusal, True
        return outputs, done

    def forget(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)
