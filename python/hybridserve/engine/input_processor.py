"""Input processing: a prompt and its sampling parameters become an `EngineRequest` the scheduler
can admit (token ids checked against the vocabulary and the context, the generation budget, the
sampling seed). Nothing here touches the scheduler or the model: a refused request changes nothing.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.params import DEFAULT_MAX_LOGPROBS, SamplingParams
from hybridserve.sampling.seeds import request_seed

# A prompt: text, token ids, or a dict with "prompt_token_ids" or "prompt" (as vLLM's inputs).
Prompt = str | dict[str, Any] | Sequence[int]


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine runs it: what the scheduler and the output processor need."""

    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the generation budget: the request's own limit within the context
    min_tokens: int  # params.min_tokens, capped at max_tokens
    seed: int  # keys every sampling draw of this request
    cache_salt: str | None = None
    priority: int = 0
    # params.bad_words as token sequences (`bad_word_sequences`)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()


def bad_word_sequences(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` that the output must not end with: each word as written
    (without its leading spaces) and after a space, since a byte-level BPE gives a word inside a
    sentence other tokens than at the start; without repeats."""
    texts = [t for word in words for t in (word.lstrip(), " " + word.lstrip())]
    seen: dict[tuple[int, ...], None] = {}
    for ids in tokenizer.encode_many(texts, add_special_tokens=False):  # (one call for them all)
        if ids:
            seen.setdefault(tuple(ids))
    return tuple(seen)


def token_ids(ids: object) -> list[int]:
    """Token ids as ints; a float, a bool or a string is an error, not a truncated id."""
    if isinstance(ids, str | bytes | bytearray):
        raise TypeError(f"{type(ids).__name__} is not a list of token ids")
    if type(ids) is list and set(map(type, ids)) <= {int}:
        # the common case (a server's parsed JSON, a tokenizer's output), checked in one pass in C:
        # a long prompt is validated on the engine thread, ahead of every running request's step
        return ids.copy()
    out = []
    for t in ids:  # type: ignore[attr-defined]
        if isinstance(t, bool):
            raise TypeError("a bool is not a token id")
        out.append(operator.index(t))
    return out


class InputProcessor:
    """Tokenizes and validates requests, and gives each its sampling seed.

    A request without a seed of its own draws from (engine seed, arrival index); the index advances
    only when the scheduler admitted the request (`admitted`), so a refused request does not shift
    the draws of the requests after it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        engine_seed: int,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        #: the model's EOS ids besides the primary one: stop token ids of every request that does
        #: not ignore EOS (as vLLM adds them)
        self.extra_eos_token_ids = tuple(extra_eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        #: most log-probabilities per token a request may ask for (--max-logprobs; -1 = the
        #: vocabulary), never more than the vocabulary has
        self.max_logprobs = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        self.engine_seed = engine_seed
        self.arrival_index = 0  # index of the next admitted request

    def encode_prompt(self, prompt: Prompt, cut: bool = False) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; a malformed prompt is an InvalidRequestError.
        `cut`: the prompt will be cut to its last tokens (truncate_prompt_tokens), so a text too
        long for the context is tokenized, not refused."""
        try:
            return self._encode_prompt(prompt, cut)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"prompt: token ids must be integers ({exc})") from exc

    def _encode_prompt(self, prompt: Prompt, cut: bool = False) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    "prompt: not valid Unicode (it holds an unpaired surrogate)"
                ) from None
            # (the bound is at most the text's length: a shorter text is always counted in full)
            at_least = (
                self.tokenizer.min_tokens(prompt) if len(prompt) >= self.max_model_len and not cut else 0
            )
            if at_least >= self.max_model_len:  # refused before seconds of tokenizing megabytes
                raise InvalidRequestError(
                    f"prompt: at least {at_least} tokens leave no room to generate within max_model_len "
                    f"{self.max_model_len}"
                )
            # (with the tokenizer's special tokens, a BOS say, as vLLM and the completion route encode)
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, dict):
            unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
            if unknown:  # (vLLM's multi_modal_data, say: not served, so not silently dropped)
                raise InvalidRequestError(
                    f"prompt: a dict prompt takes 'prompt' or 'prompt_token_ids' only, got {unknown[0]!r}"
                )
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):  # (it was the outputs' prompt as given)
                    raise InvalidRequestError("prompt: a dict prompt's 'prompt' must be a str")
                return text, token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise InvalidRequestError("prompt: a dict prompt's 'prompt' must be a str")
                return self._encode_prompt(prompt["prompt"], cut)
            raise InvalidRequestError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, bytes | bytearray) or prompt is None:
            raise InvalidRequestError(
                f"prompt: a str, a list of token ids or a dict, not {type(prompt).__name__}"
            )
        return None, token_ids(prompt)

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        params.validate()
        if params.n != 1:
            raise InvalidRequestError("n: LLMEngine takes one sequence per request; fan out n above it")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name}: at most {self.max_logprobs} log-probabilities per token (--max-logprobs), got {asked}"
                )
        keep = params.truncate_prompt_tokens
        if keep is not None and keep > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens: at most max_model_len ({self.max_model_len}), got {keep}"
            )
        text, ids = self.encode_prompt(prompt, cut=keep is not None and keep != -1)
        if not ids:
            raise InvalidRequestError("prompt: must not be empty")
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep  # (as the completion route cuts)
            if len(ids) > keep:  # (a prompt that was cut keeps no text: it is not the client's)
                text, ids = None, ids[-keep:]
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len {self.max_model_len}"
            )
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise InvalidRequestError(f"allowed_token_ids: token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias: token ids must be in [0, {vocab})")
        banned = bad_word_sequences(self.tokenizer, params.bad_words) if params.bad_words else ()
        extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            # (a copy: the caller's params are its own; the extra ids are valid by construction,
            # so they are set, not checked again, as the scheduler, the min_tokens mask and the
            # outputs all read them from here)
            params = copy.copy(params)
            params.stop_token_ids = [*params.stop_token_ids, *extra]
        return EngineRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            # the context may leave less room than min_tokens asks: the request then ends with
            # `length` when the context is full (as vLLM), it is not refused
            min_tokens=min(params.min_tokens, max_tokens),
            seed=request_seed(params.seed, self.engine_seed, self.arrival_index),
            cache_salt=cache_salt,
            priority=priority,
            bad_word_ids=banned,
        )

    def admitted(self) -> None:
        """The request last processed was admitted: the next one takes the next arrival index."""
        self.arrival_index += 1
