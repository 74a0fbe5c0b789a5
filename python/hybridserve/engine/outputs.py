"""What the engine hands back for each request (shaped like vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, with its decoded text."""

    logprob: float
    rank: int
    decoded_token: str = ""


# One entry per generated token: token id -> Logprob (the chosen token plus the top-n).
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
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
