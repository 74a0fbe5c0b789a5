"""Python-side state of one request: what the Rust scheduler does not hold (sampling, text)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.outputs import TokenLogprobs
from hybridserve.sampling.params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
