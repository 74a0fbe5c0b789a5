"""SamplingParams: how one request is sampled and when it stops (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.errors import InvalidRequestError

# Beyond this, a top-n logprobs request costs more than it is worth to anyone.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    `temperature == 0` means greedy. Limits enforced by the Rust scheduler (by token):
    `max_tokens`, EOS, `stop_token_ids`, `ignore_eos`, `min_tokens`. Stop strings are checked in
    Python after detokenization.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the chosen token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the parameter when a value is out of range."""

        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}: {msg}")

        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= float(self.min_p) <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not (0 <= self.seed < 2**63)):
            raise bad("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if not (-2.0 <= float(self.presence_penalty) <= 2.0):
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2.0 <= float(self.frequency_penalty) <= 2.0):
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not (0.0 < float(self.repetition_penalty) <= 10.0):
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
