"""What the engine hands back for each request (shaped like vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.sampling.logprobs import Logprob, TokenLogprobs

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "TokenLogprobs"]


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
