"""Python-side state of one request: what the Rust scheduler does not hold (sampling, text)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from hybridserve.sampling.grammar import GrammarMatcher
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.sampler import RowSampling


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # keys every sampling draw of this request (sampler.keyed_noise)
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    # One entry per prompt token (None for the first, which nothing predicts), when asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # max_tokens 0: the prompt is scored, the one token the engine samples is dropped.
    score_only: bool = False
    prompt_logprobs_sent: bool = False
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # the start of the first step with a row of it
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Structured outputs: the request's state in its grammar, advanced over every accepted token
    # (None without a grammar, and while the grammar is still being compiled)
    grammar: GrammarMatcher | None = None
    # params.bad_words as token sequences (input_processor.bad_word_sequences)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # What the sampler reads of the request, made at its first step and kept: it holds the
    # request's lists (the output grows in place), so it is current at every step, and a step
    # does not build one object per row
    sampling_row: RowSampling | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def _take_prompt_logprobs(self) -> list[TokenLogprobs | None]:
        self.prompt_logprobs_sent = True
        return list(self.prompt_logprobs or [])

    def grammar_refusal(self) -> str | None:
        """Where the request failed because of its grammar (the client's input, not an engine
        fault: it hit a limit of the grammar library, too large to follow, or its text spells an
        added token's), the error of the field that gave the grammar; else None."""
        so = self.params.structured_outputs
        if so is None or self.grammar is None:
            return None
        why = self.grammar.limit_hit()
        if why is not None:
            return f"{so.param}: the grammar is too large to follow: {why}"
        token = self.grammar.refused_added_token
        if token is not None:
            return (
                f"{so.param}: the grammar's text spells the added token {token} "
                f"({self.detokenizer.tokenizer.decode([token], skip_special_tokens=False)!r}), which the tokenizer writes only as that "
                "one token and the grammar library does not match inside its text: leave it out of the grammar"
            )
        return None

    def _metrics(self) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=time.monotonic(),
        )

    def to_output(
        self,
        *,
        finished: bool,
        delta_text: str = "",
        delta_token_ids: list[int] | None = None,
    ) -> RequestOutput:
        """A snapshot of the request for its caller (lists are copies: the state keeps growing)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=self.detokenizer.text,
                    token_ids=list(self.output_token_ids),
                    finish_reason=self.finish_reason if finished else None,
                    stop_reason=self.stop_reason if finished else None,
                    logprobs=None if self.logprobs is None else list(self.logprobs),
                    delta_text=delta_text,
                    delta_token_ids=list(delta_token_ids or []),
                )
            ],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self._metrics() if finished else None,
            # the prompt's logprobs go with the first output and the last (a reader of a stream
            # takes them once; a copy per streamed token would cost a prompt's length each time)
            prompt_logprobs=None
            if self.prompt_logprobs is None or not (finished or not self.prompt_logprobs_sent)
            else self._take_prompt_logprobs(),
        )
