"""SamplingParams: how one request is sampled and when it stops (shaped like vLLM's)."""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.structured_outputs import StructuredOutputsParams

# The most log-probabilities per token a request may ask for unless the engine says otherwise
# (--max-logprobs, vLLM's default): each one is a top-n over the vocabulary on every step.
DEFAULT_MAX_LOGPROBS = 20
# top_k past the vocabulary keeps every token; the bound keeps the value inside the per-row int64
# arrays of the batch (and is the HTTP API's).
MAX_TOP_K = 2**31 - 1
# A request's seed: any 64-bit signed integer, as vLLM takes it (the draws mix a seed's 64
# two's-complement bits, so a negative seed and a positive one never share their draws).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Stop strings are watched for on the engine thread, which every request shares. What the watch
# costs (engine/detokenizer.py: the automaton's memory, and the time to walk back when a long partial
# match breaks) grows with their length, so each one's length and the total are bounded, in
# characters (code points). 16 strings at the longest meet the total (16 is the HTTP count limit).
MAX_STOP_STR_LEN = 2048
# OpenAI's logit_bias: at most this many tokens, each biased by a value in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_MAX = 100.0
MAX_STOP_STRS_TOTAL_LEN = 32768
# vLLM's bad_words: each word is tokenized once per request, and every step compares the end of
# the output with each of its token sequences, so their number and length are bounded.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_LEN = 256


def _plain_ints(v: Sequence[object]) -> bool:
    """Whether every item is a plain int (not a bool, not a numpy integer): one pass in C."""
    return set(map(type, v)) <= {int}


def as_float(v: numbers.Real | float) -> float:
    """`v` as a float; an int too large for one is infinite (float() raised OverflowError on it,
    which escaped validation untyped), so that range checks refuse it by name."""
    try:
        return float(v)
    except OverflowError:
        return -math.inf if v < 0 else math.inf


def stop_length_error(stop: Sequence[str]) -> str | None:
    """Why `stop` (strings) exceeds the length limits, or None. Shared by the offline validation
    and the HTTP protocol, so that both refuse the same lists with the same words."""
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STR_LEN:
        return f"each stop string may be at most {MAX_STOP_STR_LEN} characters long, got one of {longest}"
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_STRS_TOTAL_LEN:
        return (
            f"the stop strings may be at most {MAX_STOP_STRS_TOTAL_LEN} characters long in all, got {total}"
        )
    return None


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    `temperature == 0` means greedy. Limits enforced by the Rust scheduler (by token):
    `max_tokens`, EOS, `stop_token_ids`, `ignore_eos`, `min_tokens`. Stop strings are checked in
    Python after detokenization, in the text of the tokens after the first `min_tokens`; the first
    one completed in the text ends the output.
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
    # Log-probabilities of the prompt's own tokens (every position but the first), with this many
    # top alternatives each; None = none. max_tokens may then be 0: score the prompt only.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The grammar the output must match (JSON schema, regex, choice, grammar): structured outputs
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> value added to that token's logit before any other
    # processing (greedy rows too). None or empty: no bias. Ids are checked against the vocabulary
    # when the request is added (here only id >= 0).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: the only tokens the output may hold (None: any). Checked against
    # the vocabulary when the request is added.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: words the output must not contain. Each is tokenized without its leading
    # spaces and after one space; a word's last token is forbidden wherever the output ends with
    # the tokens before it.
    bad_words: list[str] | None = None
    # vLLM's truncate_prompt_tokens: only the prompt's last that many tokens are kept (-1: as many
    # as the context holds); None keeps the prompt whole
    truncate_prompt_tokens: int | None = None
    # vLLM's fields that change nothing here, taken so that code written for vLLM runs: best_of
    # (None or n only: the n sequences are the answer), spaces_between_special_tokens (decoding
    # with a fast tokenizer, as vLLM's fast path, does not use it) and detokenize (true only: the
    # text and stop strings need it)
    best_of: int | None = None
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.structured_outputs, dict):  # vLLM's form: {"json": schema}, {"regex": ...}
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()
        # numpy scalars pass the checks; store plain Python numbers (seeds are mixed as 64-bit
        # Python ints, and the values travel to JSON and to the Rust core)
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, int(getattr(self, name)))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            setattr(self, name, None if v is None else int(v))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            setattr(self, name, float(getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            setattr(self, name, bool(getattr(self, name)))
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        allowed = self.allowed_token_ids
        if allowed is not None and not (type(allowed) is list and _plain_ints(allowed)):
            self.allowed_token_ids = [int(t) for t in allowed]  # (numpy integers to plain ones)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words) or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        """A copy to change without changing this one (vLLM's)."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's: the fields given, a None among them meaning the field's default."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def validate(self) -> None:
        """Raise InvalidRequestError naming the parameter when a value is out of range."""

        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}: {msg}")

        def is_int(v: object) -> bool:  # numpy integers too; a bool is not a count
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise bad(name, f"must be a number in {rng}, got {v!r}")
            f = as_float(v)
            if not (lo < f <= hi if lo_open else lo <= f <= hi):
                raise bad(name, f"must be in {rng}, got {v!r}")

        if not is_int(self.n) or self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", f"must be a non-negative integer, got {self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt, generate nothing
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < least):
            what = "a non-negative integer (0: score the prompt only)" if least == 0 else "a positive integer"
            raise bad("max_tokens", f"must be {what}, got {self.max_tokens!r}")
        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        if not is_int(self.top_k) or not (-1 <= self.top_k <= MAX_TOP_K):
            raise bad(
                "top_k",
                f"must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}",
            )
        number("min_p", 0.0, 1.0)
        if self.seed is not None and (not is_int(self.seed) or not (SEED_MIN <= self.seed <= SEED_MAX)):
            raise bad("seed", f"must be an integer in [-2^63, 2^63), got {self.seed!r}")
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 10.0, lo_open=True)
        if self.max_tokens is not None and self.max_tokens >= 2**63:
            raise bad("max_tokens", f"must be below 2^63, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not (0 <= self.min_tokens < 2**63):
            raise bad("min_tokens", f"must be a non-negative integer below 2^63, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", f"must be a non-negative integer, got {self.logprobs!r}")
        for flag in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            v = getattr(self, flag)
            if not isinstance(v, bool | np.bool_):
                raise bad(flag, f"must be true or false, got {v!r}")
        if not self.detokenize:
            raise bad("detokenize", "only true is served (the text and stop strings need it)")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of != self.n):
            raise bad("best_of", f"only None or n ({self.n}) is served, got {self.best_of!r}")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not is_int(keep) or not (keep == -1 or keep >= 1)):
            raise bad(
                "truncate_prompt_tokens", f"must be -1 (the context) or a positive integer, got {keep!r}"
            )
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if (why := stop_length_error(self.stop)) is not None:
            raise bad("stop", why)
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            is_int(t) and 0 <= t < 2**63 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        lb = self.logit_bias
        if lb is not None:
            if not isinstance(lb, dict):
                raise bad("logit_bias", f"must be a mapping of token id to bias, got {type(lb).__name__}")
            if len(lb) > MAX_LOGIT_BIAS_ENTRIES:
                raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(lb)}")
            for t, b in lb.items():
                if not is_int(t) or not (0 <= t < 2**63):
                    raise bad("logit_bias", f"token ids must be non-negative integers, got {t!r}")
                if (
                    isinstance(b, bool)
                    or not isinstance(b, numbers.Real)
                    or not (-LOGIT_BIAS_MAX <= as_float(b) <= LOGIT_BIAS_MAX)
                ):
                    raise bad("logit_bias", f"biases must be numbers in [-100, 100], got {b!r} for {t}")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list | tuple)
            or not allowed
            # (checked in C where the ids are plain ints: the list may hold a vocabulary's worth,
            # and a request's params are checked again for each of its choices)
            or not (
                (_plain_ints(allowed) and 0 <= min(allowed) and max(allowed) < 2**63)
                or all(is_int(t) and 0 <= t < 2**63 for t in allowed)
            )
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative integers")
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise bad("bad_words", "must be a list of strings that are not empty or blank")
            if len(words) > MAX_BAD_WORDS:
                raise bad("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
            longest = max((len(w) for w in words), default=0)
            if longest > MAX_BAD_WORD_LEN:
                raise bad(
                    "bad_words",
                    f"each word may be at most {MAX_BAD_WORD_LEN} characters long, got one of {longest}",
                )
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise bad("structured_outputs", f"must be a StructuredOutputsParams, got {type(so).__name__}")
            so.validate()
