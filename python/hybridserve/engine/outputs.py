"""What the engine hands back for each request (shaped like vLLM's RequestOutput)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybridserve.sampling.logprobs import Logprob, TokenLogprobs

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "TokenLogprobs", "coalesce"]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    # Set on streamed outputs: what arrived since the previous output of this request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the summed log-probability of the tokens made, when logprobs were asked for
        (each position's entries hold its token), else None."""
        if self.logprobs is None:
            return None
        return float(sum(entry[t].logprob for t, entry in zip(self.token_ids, self.logprobs) if t in entry))

    def finished(self) -> bool:
        """vLLM's: whether this sequence has ended (it has a finish reason)."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """When a request passed each phase, in `time.monotonic()` seconds of the engine's process
    (as vLLM's request stats): a phase it never reached is None (a request aborted while waiting
    was never scheduled; one that ended before its first token has none)."""

    arrival_time: float  # the engine accepted it
    first_scheduled_time: float | None  # its first row was in a step
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float

    @staticmethod
    def combined(parts: list[RequestMetrics | None]) -> RequestMetrics | None:
        """One request's phases from those of its sequences (n > 1): the first of each start,
        the last of each end."""
        known = [m for m in parts if m is not None]
        if not known:
            return None

        def first(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return min(present) if present else None

        lasts = [m.last_token_time for m in known if m.last_token_time is not None]
        return RequestMetrics(
            arrival_time=min(m.arrival_time for m in known),
            first_scheduled_time=first([m.first_scheduled_time for m in known]),
            first_token_time=first([m.first_token_time for m in known]),
            last_token_time=max(lasts) if lasts else None,
            finished_time=max(m.finished_time for m in known),
        )

    @property
    def queue_time(self) -> float | None:
        """Waiting before its first step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """From its first step to its first token (the prompt's chunks, and any step it waited
        between them)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """From its first token to its last."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        """From its first step to its end."""
        return None if self.first_scheduled_time is None else self.finished_time - self.first_scheduled_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Why the request failed (finish_reason "error"): a failure of its own, such as non-finite
    # logits in its row; the other requests of the step went on.
    error: str | None = None
    # The engine refused the request after accepting it (its grammar did not compile, or not in
    # time): `error` is the client's mistake (InvalidRequestError, a 400), not a failure.
    invalid: bool = False
    # The prompt's own log-probabilities (SamplingParams.prompt_logprobs): None for the first
    # token, then one entry per prompt token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # The request's phase times, on its finished output only
    metrics: RequestMetrics | None = None


def coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput | None:
    """One output standing for two successive outputs of a request that its reader has not taken
    yet: the newer's snapshot with both deltas joined (a reader that fell behind reads them as
    one step's), so that a slow reader holds one pending output per request, not one per step
    (each a copy of the tokens and logprobs so far). None where they cannot be one: the older
    ended the request, either carries an error, or their choices differ."""
    if (
        older.finished
        or older.error is not None
        or newer.error is not None
        or older.request_id != newer.request_id
        or [o.index for o in older.outputs] != [o.index for o in newer.outputs]
    ):
        return None
    outputs = [
        dataclasses.replace(
            n, delta_text=o.delta_text + n.delta_text, delta_token_ids=o.delta_token_ids + n.delta_token_ids
        )
        for o, n in zip(older.outputs, newer.outputs)
    ]
    # (the prompt's logprobs come with a request's first output: kept until it is read)
    prompt_logprobs = newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs
    return dataclasses.replace(newer, outputs=outputs, prompt_logprobs=prompt_logprobs)
