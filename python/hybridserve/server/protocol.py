"""OpenAI protocol: strict request parsing into SamplingParams + prompts, and response builders.

Everything a client sends is checked here, before anything reaches the engine: unknown fields,
wrong JSON types (a bool is not an int), non-finite or out-of-range numbers, empty prompts, prompts
that do not fit in `max_model_len`, token ids outside the vocabulary. A bad request raises
`APIError`, which the app turns into an OpenAI-style error body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from hybridserve.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams, widest_beam
from hybridserve.engine.chat_template import TEXT_PART_KEYS, ChatTemplate, ContinuationError, TextParts
from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.logprobs import TokenLogprobs
from hybridserve.sampling.params import (
    LOGIT_BIAS_MAX,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_TOP_K,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    stop_length_error,
)
from hybridserve.sampling.seeds import choice_seed
from hybridserve.server import structured_outputs as constraints
from hybridserve.server import tools as T
from hybridserve.server.reasoning import ReasoningFormat

# A request may ask for at most this many sequences in all (prompts x n).
MAX_SEQUENCES_PER_REQUEST = 128
MAX_STOP_SEQUENCES = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default)
MAX_PROMPTS_PER_REQUEST = 64
MAX_CACHE_SALT_LEN = 1024
# A request's priority: what the scheduler's int64 holds
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """A request that is answered with an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = cut_message(message)
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


# An error message names the values it refuses: one a client sent of megabytes (a model name, a
# role, an id) must not come back whole (or be logged whole).
MAX_ERROR_MESSAGE_CHARS = 2000


def cut_message(message: str) -> str:
    """At most MAX_ERROR_MESSAGE_CHARS characters (the same message again: unchanged)."""
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    tail = f"... (cut: {len(message)} characters in all)"
    return message[: MAX_ERROR_MESSAGE_CHARS - len(tail)] + tail


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": cut_message(message), "type": type, "param": param, "code": code}}


def _bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(f"{param}: {message}" if param else message, param=param, code=code)


# ---------------------------------------------------------------------------------------------
# Body decoding


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body: strict UTF-8, strict JSON (no NaN/Infinity), a top-level object."""
    if not raw:
        raise APIError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_json"
        ) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body


# ---------------------------------------------------------------------------------------------
# Typed field readers. JSON null means "not given" for every optional field.


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool)


def get_int(
    body: dict[str, Any], name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(name, f"must be an integer, got {type(v).__name__}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        shown = v if abs(v) < 10**30 else f"a {len(str(abs(v)))}-digit number"
        raise _bad(name, f"must be in {rng}, got {shown}")
    return int(v)


def get_float(
    body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    """A finite number in [lo, hi] ((lo, hi] with `lo_open`), `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise _bad(name, f"must be a number, got {type(v).__name__}", "invalid_type")
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    try:
        f = float(v)
    except OverflowError:
        raise _bad(name, f"must be in {rng}, got a huge number") from None
    if not math.isfinite(f) or not (lo < f <= hi if lo_open else lo <= f <= hi):
        raise _bad(name, f"must be in {rng}, got {v!r}")
    return f


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {type(v).__name__}", "invalid_type")
    return v


def get_str(
    body: dict[str, Any], name: str, *, max_len: int | None = None, allow_empty: bool = True
) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad(name, f"must be a string, got {type(v).__name__}", "invalid_type")
    if not allow_empty and not v:
        raise _bad(name, "must not be empty")
    if max_len is not None and len(v) > max_len:
        raise _bad(name, f"must be at most {max_len} characters long")
    return v


def _check_surrogates(param: str, s: str) -> None:
    # JSON "\ud800" escapes decode to lone surrogates, which no tokenizer can encode.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, "contains an unpaired UTF-16 surrogate") from None


# ---------------------------------------------------------------------------------------------
# What the server knows about the model


class ModelInfo(Protocol):
    """The model facts request parsing needs (built from the engine by the app)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def max_logprobs(self) -> int:
        """Most log-probabilities per token a request may ask for (--max-logprobs)."""
        ...

    @property
    def response_role(self) -> str:
        """The role chat answers are given in (--response-role): a message in it is an assistant's."""
        ...

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """SamplingParams fields a request that leaves them out takes (the model's generation
        config, --generation-config); the fields' own defaults otherwise."""
        ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text (a request's list of prompts), in one call: the engine's
        tokenizer encodes a long list without holding Python's global lock."""
        ...

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, found without encoding it (0: unknown)."""
        ...

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        *,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        refuse: Callable[[str], None] | None = None,
        continue_final_message: bool = False,
        template: ChatTemplate | None = None,
    ) -> list[int]:
        """The rendered conversation's ids. `refuse` is given the rendered text before it is
        tokenized, to refuse one too long from its length (`refuse_longer_than_context`) rather
        than after seconds of tokenizing megabytes. `continue_final_message`: as
        `ChatTemplate.render`. `template`: a request's own template, rendered in place of the
        served one (a ModelInfo whose `trust_request_chat_template` attribute is true allows it)."""
        ...

    def text_offsets(self, text: str, token_ids: list[int]) -> list[int] | None:
        """Where each of `token_ids` (`text` encoded, maybe with the tokens the tokenizer adds,
        such as BOS) starts in `text`, for the echoed prompt's logprobs; None when unknown."""
        ...


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None  # the prompt as text, when the client sent text (for echo)
    # where each token starts in `text` (echo + logprobs of a text prompt; ModelInfo.text_offsets)
    text_offsets: list[int] | None = None


@dataclass
class GenerateRequest:
    """A validated completion or chat request, ready for the engine."""

    kind: Literal["completion", "chat"]
    model: str
    prompts: list[PromptInput]
    params: SamplingParams  # params.n choices per prompt
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    cache_salt: str | None = None
    # completion: top-n of the `logprobs` field; chat: top_logprobs (None: no logprobs)
    logprobs: int | None = None
    user: str | None = None
    # vLLM's `return_token_ids`: the prompt's and each choice's output token ids in the response.
    # The output ids are all the engine generated, as vLLM's: an EOS / stop token included, and up
    # to and including the token that completed a stop string, where the text is cut before it.
    return_token_ids: bool = False
    # vLLM's `use_beam_search`: the choices are the n best beams (None: sampled as usual)
    beam: BeamSearchParams | None = None
    # vLLM's `return_tokens_as_token_ids`: logprobs name tokens "token_id:N", not by their text
    # (None: the server's --return-tokens-as-token-ids)
    tokens_as_ids: bool | None = None
    # vLLM's `prompt_logprobs`: top-n of the prompt's logprobs (completions: in each choice; chat,
    # not streamed: on the response, whose choices share their prompt)
    prompt_logprobs: int | None = None
    # vLLM's `stream_options.continuous_usage_stats`: usage in every chunk, where usage is
    # included (include_usage)
    continuous_usage: bool = False
    # unknown fields the request carried, ignored (not --strict-request-fields); the app logs them
    ignored_fields: list[str] = dataclasses.field(default_factory=list)
    # vLLM's `priority`: lower values are scheduled first (the server refuses a non-zero one
    # unless it runs with --scheduling-policy priority)
    priority: int = 0
    # chat: `chat_template_kwargs` turn the model's thinking off (enable_thinking or thinking
    # false), so a reasoning parser leaves the answer whole
    thinking_disabled: bool = False
    # chat: how the answer is split into reasoning and content (server/reasoning.py); the app sets
    # it from --reasoning-parser
    reasoning: ReasoningFormat | None = None
    # chat with continue_final_message: the content of the message the answer continues
    continued: str | None = None
    # chat: the role of the answer's message: with add_generation_prompt false, the last
    # message's (as vLLM's); None: the server's (--response-role)
    role: str | None = None

    @property
    def answer_role(self) -> str:
        """The role a chat answer's message is given in."""
        return self.role or "assistant"

    # tool calls (chat with tools, tool_choice not "none"): the parser that finds them in the output
    tool_parser: T.ToolParser | None = None
    # a completion of several prompts without `max_tokens`: each prompt's own default (16, within
    # the room that prompt leaves), where `params.max_tokens` is the least of them (None: every
    # prompt takes `params.max_tokens`)
    prompt_max_tokens: list[int] | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.params.n

    def choice_params(self, choice_index: int) -> SamplingParams:
        """SamplingParams of one engine request (n = 1; seeded choices get distinct seeds, as in `LLM`;
        the max_tokens of its prompt, `prompt_max_tokens`)."""
        seed = choice_seed(self.params.seed, choice_index % self.params.n)
        # a copy with the two fields set, not `dataclasses.replace`: that would check every field
        # again for every choice, on the event loop (a vocabulary's worth of allowed_token_ids
        # costs milliseconds each time); n = 1 and a derived seed are valid by construction
        params = copy.copy(self.params)
        params.n, params.seed = 1, seed
        if self.prompt_max_tokens is not None:
            params.max_tokens = self.prompt_max_tokens[choice_index // self.params.n]
        return params


_SAMPLING_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "user",
    # vLLM's extra sampling parameters
    "top_k",
    "min_p",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "stop_token_ids",
    # OpenAI's: token id (a decimal string) -> bias in [-100, 100] added to its logit
    "logit_bias",
    # vLLM's: the only tokens the output may hold; words it must not hold
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "include_stop_str_in_output",
    # vLLM's extra response field: the prompt and output token ids of each choice
    "return_token_ids",
    # vLLM's: logprobs name tokens "token_id:N"
    "return_tokens_as_token_ids",
    # hybridserve extension: isolates a tenant's prefix cache
    "cache_salt",
    # vLLM's: lower values are scheduled first (--scheduling-policy priority)
    "priority",
    # vLLM's beam search: the n best beams as the choices (engine/beam_search.py)
    "use_beam_search",
    "length_penalty",
    # vLLM's: keep only the prompt's last N tokens (-1: the context length)
    "truncate_prompt_tokens",
    # the grammar the output must match (server/structured_outputs.py): OpenAI's and vLLM's field
    "response_format",
    "structured_outputs",
    # vLLM's older names of structured_outputs' grammars, and their options (ignored)
    *constraints.GUIDED_FIELDS,
    *constraints.GUIDED_OPTIONS,
    # vLLM's: whether a text prompt gets the tokenizer's special tokens (BOS); completions default
    # true, chat false (the template writes them), as vLLM
    "add_special_tokens",
    # OpenAI fields that mean nothing to this server (a stored completion's tags, storing it for
    # OpenAI's evals, the billing tier): type-checked, then ignored, as vLLM ignores them
    "metadata",
    "store",
    "service_tier",
}
# OpenAI fields we know but do not implement: accepted only when absent, null or empty.
_UNSUPPORTED_COMMON: set[str] = set()
_COMPLETION_FIELDS = (
    _SAMPLING_FIELDS
    | {"prompt", "echo", "logprobs", "prompt_logprobs", "best_of", "suffix"}
    | _UNSUPPORTED_COMMON
)
_CHAT_FIELDS = (
    _SAMPLING_FIELDS
    | {
        "messages",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "max_completion_tokens",
        "add_generation_prompt",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "parallel_tool_calls",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
    }
    | _UNSUPPORTED_COMMON
)
_CHAT_UNSUPPORTED = {
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
}
_MESSAGE_ROLES = {"system", "developer", "user", "assistant", "tool"}
_MESSAGE_FIELDS = {"role", "content", "name", "tool_call_id", "tool_calls"}
_ASSISTANT_FIELDS = _MESSAGE_FIELDS | {"reasoning", "reasoning_content"}
# vLLM's chat fields: keyword arguments for the chat template, continuing the final message, and a
# request's own template (refused unless the server trusts its clients' templates)
_CHAT_FIELDS = _CHAT_FIELDS | {"chat_template", "chat_template_kwargs", "continue_final_message"}
# Names a chat template is rendered with (chat.py): chat_template_kwargs may not replace them.
_TEMPLATE_RESERVED = {
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
}
MAX_UNKNOWN_FIELDS_LOGGED = 16  # of one request (names only)


class UnknownFields:
    """What happens to a field this server does not know. Strict (`--strict-request-fields`):
    a 400 `unknown_field` naming it. Otherwise, as vLLM: it is ignored, and its name kept here for
    the server to log (clients written for other servers send fields of their own)."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.names: list[str] = []

    def found(self, name: str) -> None:
        if self.strict:
            raise APIError(f"unknown field {name!r}", param=name, code="unknown_field")
        if len(self.names) < MAX_UNKNOWN_FIELDS_LOGGED:
            self.names.append(name[:64])


def _check_fields(
    body: dict[str, Any], allowed: set[str], unsupported: set[str], unknown: UnknownFields | None = None
) -> None:
    unknown = unknown if unknown is not None else UnknownFields(strict=True)
    for key in body:
        if key not in allowed:
            unknown.found(key)
    for key in unsupported:
        v = body.get(key)
        if v is not None and v != {} and v != [] and v is not False:
            raise APIError(f"{key}: not supported by this server", param=key, code="unsupported_parameter")


def not_found(message: str, param: str, code: str) -> APIError:
    """OpenAI's 404 for something a request names that is not here."""
    return APIError(message, status=404, type="not_found_error", param=param, code=code)


def _parse_model(body: dict[str, Any], served_model_name: str) -> str:
    model = get_str(body, "model")
    if model is None:
        return served_model_name
    if model != served_model_name:
        raise not_found(
            f"the model {model!r} does not exist; this server serves {served_model_name!r}",
            "model",
            "model_not_found",
        )
    return model


# OpenAI's limits on `metadata`: 16 pairs, keys of at most 64 characters, string values of at most
# 512 (a response repeats it, and the Responses store keeps it)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise _bad("metadata", f"must be an object, got {type(metadata).__name__}", "invalid_type")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise _bad("metadata", f"at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise _bad(
                "metadata", f"keys of at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}"
            )
        if not isinstance(value, str):
            raise _bad("metadata", f"values must be strings, got {type(value).__name__}", "invalid_type")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise _bad(
                "metadata",
                f"values of at most {MAX_METADATA_VALUE_CHARS} characters, got one of {len(value)}",
            )


def _parse_stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise _bad("stop", f"must be a string or a list of strings, got {type(v).__name__}", "invalid_type")
    if len(v) > MAX_STOP_SEQUENCES:
        raise _bad("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences")
    for s in v:
        if not isinstance(s, str):
            raise _bad(
                "stop",
                f"must be a string or a list of strings, got a list holding {type(s).__name__}",
                "invalid_type",
            )
        if not s:
            raise _bad("stop", "stop sequences must not be empty")
    # The length limits are shared with the offline API (sampling/params.py).
    if (why := stop_length_error(v)) is not None:
        raise _bad("stop", why)
    for s in v:
        _check_surrogates("stop", s)
    return list(v)


def _parse_bad_words(body: dict[str, Any]) -> list[str] | None:
    """vLLM's `bad_words`: a list of strings (their count and length are SamplingParams')."""
    v = body.get("bad_words")
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
        raise _bad("bad_words", "must be a list of strings", "invalid_type")
    for w in v:
        _check_surrogates("bad_words", w)
    return list(v)


def _all_ints(v: list[Any]) -> bool:
    """Whether every item is an int and none a bool (JSON gives exactly int for an integer). One
    pass in C: a prompt of thousands of ids is checked on the event loop for every request."""
    return set(map(type, v)) <= {int}


def _parse_token_list(param: str, v: Any, vocab_size: int | None, *, allow_empty: bool) -> list[int]:
    if not isinstance(v, list):
        raise _bad(param, f"must be a list of integers, got {type(v).__name__}", "invalid_type")
    if not v:
        if not allow_empty:
            raise _bad(param, "must not be empty")
        return []
    if _all_ints(v) and min(v) >= 0 and (vocab_size is None or max(v) < vocab_size):
        return list(v)
    for t in v:  # the first bad item, for the message
        if not _is_int(t):
            raise _bad(
                param, f"must be a list of integers, got a list holding {type(t).__name__}", "invalid_type"
            )
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            shown = t if abs(t) < 10**30 else "a huge number"
            raise _bad(param, f"token id {shown} is outside the vocabulary [0, {vocab_size})")
    return list(v)


# A logit_bias key: a token id in decimal, without sign, spaces or leading zeros; at most 18
# digits, so that an id is below 2^63 while the vocabulary size is not known.
_LOGIT_BIAS_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


def _parse_logit_bias(v: Any, vocab_size: int | None) -> dict[int, float] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(
            "logit_bias", f"must be an object of token ids to biases, got {type(v).__name__}", "invalid_type"
        )
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(v)}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not _LOGIT_BIAS_KEY.fullmatch(key):
            shown = repr(key) if len(key) <= 32 else repr(key[:32]) + "..."
            raise _bad("logit_bias", f"keys must be token ids in decimal, got {shown}")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise _bad("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise _bad(
                "logit_bias", f"biases must be numbers, got {type(bias).__name__} for {key}", "invalid_type"
            )
        if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            shown_b = bias if abs(bias) < 10**30 else "a huge number"
            raise _bad("logit_bias", f"biases must be in [-100, 100], got {shown_b} for {key}")
        out[token] = float(bias)
    return out or None


_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _parse_stream(body: dict[str, Any], unknown: UnknownFields) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise _bad("stream_options", "only allowed when stream is true")
        if not isinstance(opts, dict):
            raise _bad("stream_options", f"must be an object, got {type(opts).__name__}", "invalid_type")
        for key in opts:
            if key not in _STREAM_OPTIONS:
                unknown.found(f"stream_options.{key}")
        for key in _STREAM_OPTIONS:
            v = opts.get(key)
            if v is not None and not isinstance(v, bool):
                raise _bad(
                    f"stream_options.{key}", f"must be a boolean, got {type(v).__name__}", "invalid_type"
                )
        include_usage = bool(opts.get("include_usage"))
    return stream, include_usage


def _continuous_usage(body: dict[str, Any]) -> bool:
    """vLLM's `stream_options.continuous_usage_stats` asked for: usage in every chunk, where usage
    is included (include_usage, or the server's --enable-force-include-usage), as vLLM (the
    options are checked by _parse_stream)."""
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("continuous_usage_stats"))


def _ignored_common(body: dict[str, Any]) -> None:
    """The OpenAI fields that are accepted and ignored: their types are still checked, so that a
    client's mistake is not silently passed over."""
    check_metadata(body.get("metadata"))
    get_bool(body, "store", False)
    get_str(body, "service_tier", max_len=64)


def _sampling_params(
    body: dict[str, Any],
    info: ModelInfo,
    *,
    n: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The body's sampling fields, checked against the model's vocabulary; a field the body leaves
    out takes `info.sampling_defaults` (the model's generation config), else its own default."""
    vocab_size = info.vocab_size
    d = info.sampling_defaults
    stop_token_ids_raw = body.get("stop_token_ids")
    stop_token_ids = (
        []
        if stop_token_ids_raw is None
        else _parse_token_list("stop_token_ids", stop_token_ids_raw, vocab_size, allow_empty=True)
    )
    top_k = get_int(body, "top_k", d.get("top_k", 0), -1, MAX_TOP_K)
    min_tokens = get_int(body, "min_tokens", 0, 0, 2**31 - 1)
    logit_bias = _parse_logit_bias(body.get("logit_bias"), vocab_size)
    allowed_raw = body.get("allowed_token_ids")
    allowed = (
        None
        if allowed_raw is None
        # (without repeats, in order: at most the vocabulary, however long the list sent)
        else sorted(set(_parse_token_list("allowed_token_ids", allowed_raw, vocab_size, allow_empty=False)))
    )
    try:
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=get_float(body, "temperature", d.get("temperature", 1.0), 0.0, 2.0),
            top_p=get_float(body, "top_p", d.get("top_p", 1.0), 0.0, 1.0, lo_open=True),
            top_k=top_k if top_k is not None else 0,
            min_p=get_float(body, "min_p", d.get("min_p", 0.0), 0.0, 1.0),
            seed=get_int(body, "seed", None, SEED_MIN, SEED_MAX),
            stop=_parse_stop(body),
            stop_token_ids=stop_token_ids,
            ignore_eos=get_bool(body, "ignore_eos", False),
            min_tokens=min_tokens if min_tokens is not None else 0,
            presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=get_float(
                body, "repetition_penalty", d.get("repetition_penalty", 1.0), 0.0, 10.0, lo_open=True
            ),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            logit_bias=logit_bias,
            allowed_token_ids=allowed,
            bad_words=_parse_bad_words(body),
        )
    except InvalidRequestError as e:
        msg = str(e)
        param = msg.split(":", 1)[0] if ":" in msg else None
        raise APIError(msg, param=param, code="invalid_value") from None


def refuse_longer_than_context(info: ModelInfo, text: str, limit: int, param: str) -> None:
    """A text that has `limit` tokens or more by `info.min_tokens` is refused as the full count
    would be, before seconds of tokenizing a text of megabytes."""
    if len(text) < limit:  # the bound is at most the text's length, and the full count decides
        return
    at_least = info.min_tokens(text)
    if at_least >= limit:
        raise APIError(
            f"{param}: the prompt has at least {at_least} tokens, but this model's maximum context length is "
            f"{limit} tokens (prompt plus at least one generated token)",
            param=param,
            code="context_length_exceeded",
        )


def _generation_config_cap(max_tokens: int, info: ModelInfo) -> int:
    """The model's generation config `max_new_tokens` caps the tokens to generate, given or
    defaulted, as vLLM takes it (the least of the request's, the room left and the model's)."""
    cap = info.sampling_defaults.get("max_tokens")
    return max_tokens if cap is None else min(max_tokens, int(cap))


def _resolve_max_tokens(
    requested: int | None,
    prompts: Sequence[PromptInput],
    max_model_len: int,
    prompt_param: str,
    max_param: str,
) -> int:
    longest = max(len(p.token_ids) for p in prompts)
    if longest >= max_model_len:
        raise APIError(
            f"{prompt_param}: the prompt has {longest} tokens, but this model's maximum context length is "
            f"{max_model_len} tokens (prompt plus at least one generated token)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - longest
    if longest + requested > max_model_len:
        raise APIError(
            f"{max_param}: this model's maximum context length is {max_model_len} tokens, but {longest + requested} "
            f"were requested ({longest} in the prompt, {requested} to generate)",
            param=max_param,
            code="context_length_exceeded",
        )
    return requested


def _parse_priority(body: dict[str, Any]) -> int:
    priority = get_int(body, "priority", 0, PRIORITY_MIN, PRIORITY_MAX)
    return 0 if priority is None else priority


def _check_sequences(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
        raise _bad(
            "n", f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences in all (prompts x n)"
        )


def _common(
    body: dict[str, Any], served_model_name: str, unknown: UnknownFields
) -> tuple[str, int, bool, bool, str | None, str | None]:
    model = _parse_model(body, served_model_name)
    n = get_int(body, "n", 1, 1, MAX_SEQUENCES_PER_REQUEST)
    assert n is not None
    stream, include_usage = _parse_stream(body, unknown)
    _ignored_common(body)
    cache_salt = get_str(body, "cache_salt", max_len=MAX_CACHE_SALT_LEN, allow_empty=False)
    if cache_salt is not None:
        _check_surrogates("cache_salt", cache_salt)
    user = get_str(body, "user", max_len=1024)
    return model, n, stream, include_usage, cache_salt, user


def parse_completion_request(
    body: dict[str, Any], info: ModelInfo, served_model_name: str, *, strict: bool = True
) -> GenerateRequest:
    """Validate a /v1/completions body. Raises APIError. `strict`: an unknown field is a 400;
    otherwise it is ignored and named in the result's `ignored_fields`."""
    unknown = UnknownFields(strict)
    _check_fields(body, _COMPLETION_FIELDS, _UNSUPPORTED_COMMON, unknown)
    if body.get("suffix") not in (None, ""):
        raise APIError("suffix: not supported by this server", param="suffix", code="unsupported_parameter")
    model, n, stream, include_usage, cache_salt, user = _common(body, served_model_name, unknown)
    best_of = get_int(body, "best_of", None, 1, MAX_SEQUENCES_PER_REQUEST)
    if best_of is not None and best_of != n:
        raise APIError(
            "best_of: only best_of == n is supported", param="best_of", code="unsupported_parameter"
        )
    echo = get_bool(body, "echo", False)
    return_token_ids = get_bool(body, "return_token_ids", False)
    tokens_as_ids = body.get("return_tokens_as_token_ids")
    if tokens_as_ids is not None:
        tokens_as_ids = get_bool(body, "return_tokens_as_token_ids", False)
    logprobs = get_int(body, "logprobs", None, 0, info.max_logprobs)
    # vLLM's prompt_logprobs: the prompt's own log-probabilities in the choice's `prompt_logprobs`
    prompt_logprobs = get_int(body, "prompt_logprobs", None, 0, info.max_logprobs)
    # max_tokens 0 scores the prompt and generates nothing (echo: the evaluation harnesses' form)
    scoring = echo or prompt_logprobs is not None
    requested_max = get_int(body, "max_tokens", None, 0 if scoring else 1, None)

    if "prompt" not in body or body["prompt"] is None:
        raise APIError("prompt: a prompt is required", param="prompt", code="missing_field")
    add_special_tokens = get_bool(body, "add_special_tokens", True)
    keep = _parse_truncation(body, info.max_model_len)
    prompts = _parse_prompts(body["prompt"], info, add_special_tokens, keep)
    _check_sequences(len(prompts), n)
    max_tokens = _resolve_max_tokens(requested_max, prompts, info.max_model_len, "prompt", "max_tokens")
    prompt_max_tokens: list[int] | None = None
    if requested_max is None:
        # OpenAI's default of 16 completion tokens, within the room each prompt leaves (as vLLM
        # resolves it prompt by prompt: a short prompt is not cut to what a long one leaves)
        prompt_max_tokens = [
            _generation_config_cap(
                min(COMPLETION_DEFAULT_MAX_TOKENS, info.max_model_len - len(p.token_ids)), info
            )
            for p in prompts
        ]
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, max_tokens)
    max_tokens = _generation_config_cap(max_tokens, info)
    # the engine computes the prompt's logprobs for echo + logprobs (the echoed tokens' logprobs),
    # for prompt_logprobs, and for max_tokens 0 (which needs them to have anything to do)
    wanted = [v for v in (prompt_logprobs, logprobs if echo else None) if v is not None]
    engine_prompt_logprobs = max(wanted, default=0) if wanted or max_tokens == 0 else None
    params = _sampling_params(
        body,
        info,
        n=n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=engine_prompt_logprobs,
    )
    params = _constrained(params, body, unknown)
    beam = _beam_search(
        body,
        params,
        info,
        echo=echo,
        logprobs=logprobs is not None,
        prompt_logprobs=prompt_logprobs is not None,
        stop=bool(params.stop),
        stop_token_ids=bool(params.stop_token_ids),
        max_tokens=max_tokens == 0,
        **{_grammar_field(params): params.structured_outputs is not None},
    )
    if beam is not None and prompt_max_tokens is not None:
        # the search runs for the longest default; each prompt's beams end at the context's end
        beam = dataclasses.replace(beam, max_tokens=max(prompt_max_tokens))
    if echo and logprobs is not None:
        # the echoed prompt's text_offset index the client's own text (here, off the event loop
        # for a large body)
        for p in prompts:
            if p.text is not None:
                p.text_offsets = info.text_offsets(p.text, p.token_ids)
    return GenerateRequest(
        kind="completion",
        model=model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        cache_salt=cache_salt,
        logprobs=logprobs,
        user=user,
        return_token_ids=return_token_ids,
        tokens_as_ids=tokens_as_ids,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=_continuous_usage(body),
        ignored_fields=unknown.names,
        priority=_parse_priority(body),
        beam=beam,
        prompt_max_tokens=prompt_max_tokens,
    )


def _grammar_field(params: SamplingParams) -> str:
    """The field a request's grammar came in (for an error that names it)."""
    so = params.structured_outputs
    return so.param if so is not None and so.param else "structured_outputs"


def _beam_search(
    body: dict[str, Any], params: SamplingParams, info: ModelInfo, **asked: bool
) -> BeamSearchParams | None:
    """vLLM's `use_beam_search` (with `n` the beam width, `length_penalty`): the search's
    parameters, or None. `asked`: fields given that a beam search does not serve (their names)."""
    length_penalty = get_float(body, "length_penalty", 1.0, -1e6, 1e6)
    if not get_bool(body, "use_beam_search", False):
        return None
    # The search ranks beams by the model's own log-probabilities: a field of the request that
    # would change them or the tokens allowed is refused, not silently dropped (a default of the
    # model's generation config is not the client's asking, and is left unused, as vLLM does).
    changes_tokens = {
        "allowed_token_ids": params.allowed_token_ids is not None,
        "bad_words": bool(params.bad_words),
        "logit_bias": any(v != 0 for v in (params.logit_bias or {}).values()),
        "min_tokens": params.min_tokens > 0,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
    }
    asked.update({name: body.get(name) is not None and on for name, on in changes_tokens.items()})
    for name, given in asked.items():
        if given:
            raise APIError(
                f"{name}: not served with use_beam_search", param=name, code="unsupported_parameter"
            )
    if params.n > (widest := widest_beam(info.max_logprobs)):
        why = (
            ""
            if widest == MAX_BEAM_WIDTH
            else f" (each step asks for 2 x n log-probabilities: --max-logprobs {info.max_logprobs})"
        )
        raise _bad("n", f"with use_beam_search n is the beam width: at most {widest}{why}, got {params.n}")
    assert params.max_tokens is not None  # (resolved by the parser)
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        length_penalty=length_penalty,
    )


def _parse_truncation(body: dict[str, Any], max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of a prompt's last tokens are kept (-1: the
    context length), or None (the prompt is whole)."""
    keep = get_int(body, "truncate_prompt_tokens", None, -1, None)
    if keep is None:
        return None
    if keep == 0:
        raise _bad("truncate_prompt_tokens", "must be -1 (the context length) or a positive number of tokens")
    if keep > max_model_len:
        raise _bad(
            "truncate_prompt_tokens",
            f"must be at most this model's maximum context length {max_model_len}, got {keep}",
        )
    return max_model_len if keep == -1 else keep


def _truncated(prompts: list[PromptInput], keep: int | None) -> list[PromptInput]:
    """Each prompt's last `keep` tokens; a prompt that was cut loses its text (an echo then shows
    the tokens it kept)."""
    if keep is None:
        return prompts
    return [
        p if len(p.token_ids) <= keep else PromptInput(token_ids=p.token_ids[-keep:], text=None)
        for p in prompts
    ]


def _parse_prompts(
    v: Any, info: ModelInfo, add_special_tokens: bool = False, keep: int | None = None
) -> list[PromptInput]:
    """`keep`: `truncate_prompt_tokens` (`_parse_truncation`); a text that would be refused as
    too long is then tokenized and cut instead."""

    def text_prompts(texts: list[str]) -> list[PromptInput]:
        for s in texts:
            if not s:
                raise _bad("prompt", "must not be empty")
            _check_surrogates("prompt", s)
            if keep is None or keep >= info.max_model_len:  # (cut to the context, still too long)
                refuse_longer_than_context(info, s, info.max_model_len, "prompt")
        encoded = info.encode_many(texts, add_special_tokens=add_special_tokens)
        if not all(encoded):
            raise _bad("prompt", "encodes to no tokens")
        return _truncated([PromptInput(token_ids=ids, text=s) for s, ids in zip(texts, encoded)], keep)

    if isinstance(v, str):
        return text_prompts([v])
    if not isinstance(v, list):
        raise _bad(
            "prompt",
            f"must be a string, a list of strings or a list of token ids, got {type(v).__name__}",
            "invalid_type",
        )
    if not v:
        raise _bad("prompt", "must not be empty")
    if _all_ints(v):
        ids = _parse_token_list("prompt", v, info.vocab_size, allow_empty=False)
        return _truncated([PromptInput(token_ids=ids, text=None)], keep)
    if len(v) > MAX_PROMPTS_PER_REQUEST:
        raise _bad("prompt", f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request")
    if all(isinstance(s, str) for s in v):
        return text_prompts(v)
    if all(isinstance(t, list) for t in v):
        lists = [_parse_token_list("prompt", t, info.vocab_size, allow_empty=False) for t in v]
        return _truncated([PromptInput(token_ids=ids, text=None) for ids in lists], keep)
    raise _bad(
        "prompt",
        "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        "invalid_type",
    )


def _parse_messages(
    v: Any, unknown: UnknownFields | None = None, answer_role: str = "assistant"
) -> list[dict[str, Any]]:
    """The chat messages, checked. `answer_role`: the role the server answers in
    (--response-role); a message in it is an earlier answer sent back, an assistant message."""
    unknown = unknown if unknown is not None else UnknownFields(strict=True)
    roles = _MESSAGE_ROLES | {answer_role}
    if v is None:
        raise APIError("messages: required", param="messages", code="missing_field")
    if not isinstance(v, list):
        raise _bad("messages", f"must be a list of message objects, got {type(v).__name__}", "invalid_type")
    if not v:
        raise _bad("messages", "must not be empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(p, f"must be an object, got {type(m).__name__}", "invalid_type")
        known = _ASSISTANT_FIELDS if m.get("role") in ("assistant", answer_role) else _MESSAGE_FIELDS
        for key in m:
            if key not in known:
                unknown.found(f"{p}.{key}")
        role = m.get("role")
        if not isinstance(role, str) or role not in roles:
            raise _bad(f"{p}.role", f"must be one of {sorted(roles)}, got {role!r}")
        if role == answer_role and role not in _MESSAGE_ROLES:
            role = "assistant"
        calls = None
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise _bad(f"{p}.tool_calls", "only an assistant message carries tool_calls")
            calls = _parse_tool_calls(f"{p}.tool_calls", m["tool_calls"], unknown)
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise _bad(f"{p}.content", "required", "missing_field")
            text: str = TextParts(())  # ("" as a string; no parts for a template taking them)
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pp = f"{p}.content[{j}]"
                if not isinstance(part, dict):
                    raise _bad(pp, f"must be an object, got {type(part).__name__}", "invalid_type")
                key = TEXT_PART_KEYS.get(str(part.get("type")))
                if key is None:
                    raise APIError(
                        f"{pp}.type: only text content parts are supported ({', '.join(TEXT_PART_KEYS)})",
                        param=f"{pp}.type",
                        code="unsupported_parameter",
                    )
                for extra in sorted(set(part) - {"type", key}):
                    unknown.found(f"{pp}.{extra}")
                t = part.get(key)
                if not isinstance(t, str):
                    raise _bad(f"{pp}.{key}", "must be a string", "invalid_type")
                parts.append(t)
            text = TextParts(parts)
        else:
            raise _bad(
                f"{p}.content",
                f"must be a string or a list of content parts, got {type(content).__name__}",
                "invalid_type",
            )
        _check_surrogates(f"{p}.content", text)
        msg: dict[str, Any] = {"role": role, "content": text}
        # an assistant's earlier reasoning (as this server answers it: `reasoning`, and its older
        # name `reasoning_content`) reaches the template as vLLM and transformers hand it over, for
        # thinking models whose templates render it (Qwen3's, in the turns after the last query)
        reasoning_keys = ("reasoning", "reasoning_content") if role == "assistant" else ()
        for key in ("name", "tool_call_id", *reasoning_keys):
            if m.get(key) is not None:
                val = m[key]
                if not isinstance(val, str):
                    raise _bad(f"{p}.{key}", "must be a string", "invalid_type")
                _check_surrogates(f"{p}.{key}", val)
                msg[key] = val
        if role == "tool" and "tool_call_id" not in msg:
            raise _bad(f"{p}.tool_call_id", "required in a tool message", "missing_field")
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _parse_tool_calls(p: str, v: Any, unknown: UnknownFields) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls` (OpenAI's shape: [{"id", "type": "function",
    "function": {"name", "arguments" (JSON text)}}]), for the chat template. As vLLM hands them to
    templates, `arguments` becomes the parsed object when it is JSON (templates write it with
    `tojson`); otherwise it stays the text."""
    if not isinstance(v, list):
        raise _bad(p, f"must be a list of tool calls, got {type(v).__name__}", "invalid_type")
    out: list[dict[str, Any]] = []
    for i, c in enumerate(v):
        pc = f"{p}[{i}]"
        if not isinstance(c, dict):
            raise _bad(pc, f"must be an object, got {type(c).__name__}", "invalid_type")
        for key in sorted(set(c) - {"id", "type", "function"}):
            unknown.found(f"{pc}.{key}")
        if c.get("type", "function") != "function":
            raise _bad(f"{pc}.type", f"must be 'function', got {c.get('type')!r}")
        call_id = c.get("id")
        if call_id is None:
            raise _bad(f"{pc}.id", "required", "missing_field")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"{pc}.id", "must be a non-empty string", "invalid_type")
        fn = c.get("function")
        if fn is None:
            raise _bad(f"{pc}.function", "required", "missing_field")
        if not isinstance(fn, dict):
            raise _bad(f"{pc}.function", f"must be an object, got {type(fn).__name__}", "invalid_type")
        for key in sorted(set(fn) - {"name", "arguments"}):
            unknown.found(f"{pc}.function.{key}")
        name, args = fn.get("name"), fn.get("arguments")
        if name is None:
            raise _bad(f"{pc}.function.name", "required", "missing_field")
        if not isinstance(name, str) or not name:
            raise _bad(f"{pc}.function.name", "must be a non-empty string", "invalid_type")
        if args is None:
            raise _bad(f"{pc}.function.arguments", "required", "missing_field")
        if not isinstance(args, str):
            raise _bad(
                f"{pc}.function.arguments",
                f"must be a string (the JSON text of the arguments), got {type(args).__name__}",
                "invalid_type",
            )
        for key, val in (("id", call_id), ("function.name", name), ("function.arguments", args)):
            _check_surrogates(f"{pc}.{key}", val)
        try:  # (empty: {}, as vLLM)
            parsed: Any = json.loads(args) if args else {}
        except (ValueError, RecursionError):  # (not JSON, or nested past the parser's depth)
            parsed = args
        else:  # (the JSON text's own escapes may decode to lone surrogates)
            _check_surrogates(f"{pc}.function.arguments", json.dumps(parsed, ensure_ascii=False))
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
    return out


def _chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs`: more variables for the chat template (e.g. a model's
    `enable_thinking`); not the ones the server sets itself."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("chat_template_kwargs", f"must be an object, got {type(v).__name__}", "invalid_type")
    taken = sorted(set(v) & _TEMPLATE_RESERVED)
    if taken:
        raise _bad("chat_template_kwargs", f"may not set {taken[0]!r} (the server sets it)")
    return dict(v)


def _thinking_disabled(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and (
        kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False
    )


def _field_error(e: ValueError) -> APIError:
    """A tools / response_format / structured_outputs error as the 400 that names its field."""
    param = getattr(e, "param", None)
    return APIError(str(e), param=param, code=getattr(e, "code", "invalid_value"))


def _tool_parser(info: ModelInfo) -> T.ToolParser:
    """The server's tool-call format (`--tool-call-parser`; a ModelInfo without the attribute:
    hermes)."""
    return T.TOOL_PARSERS[getattr(info, "tool_call_parser", "hermes")]


def _special_tags(info: ModelInfo, parser: T.ToolParser, added: Mapping[str, int]) -> bool:
    """Whether a tag of the tool-call format is one of the tokenizer's special tokens."""
    tags = (getattr(parser, "START", ""), getattr(parser, "END", ""))
    is_special = getattr(info, "is_special", None)
    return is_special is not None and any(t in added and is_special(added[t]) for t in tags)


def _constrained(
    params: SamplingParams,
    body: dict[str, Any],
    unknown: UnknownFields,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str = "none",
    parser: T.ToolParser | None = None,
    added_tokens: Mapping[str, int] = {},
) -> SamplingParams:
    """`params` with the grammar the request's fields ask for (server/structured_outputs.py)."""
    try:
        so = constraints.constraint(
            body,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=get_bool(body, "parallel_tool_calls", True),
            parser=parser or T.TOOL_PARSERS["hermes"],
            on_unknown=unknown.found,
            added_tokens=added_tokens,
        )
    except ValueError as e:
        raise _field_error(e) from None
    return params if so is None else dataclasses.replace(params, structured_outputs=so)


def _parse_tool_fields(
    body: dict[str, Any], unknown: UnknownFields
) -> tuple[list[dict[str, Any]], str, list[dict[str, Any]] | None]:
    """(tools, tool_choice, the tools the prompt renders: None with tool_choice "none") of a chat
    body (tools.py); the chat route's and /tokenize's."""
    try:
        tools = T.parse_tools(body["tools"], unknown.found) if body.get("tools") is not None else []
        tool_choice = T.parse_tool_choice(body.get("tool_choice"), tools, unknown.found)
    except T.ToolError as e:
        raise _field_error(e) from None
    return tools, tool_choice, tools if tool_choice != "none" else None


def _served_template(info: ModelInfo) -> ChatTemplate | None:
    template = getattr(info, "chat_template", None) or getattr(info, "template", None)
    return template if isinstance(template, ChatTemplate) else None


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str, served: ChatTemplate | None) -> ChatTemplate:
    return ChatTemplate(source) if served is None else served.with_source(source)


def _request_template(body: dict[str, Any], info: ModelInfo) -> ChatTemplate | None:
    """vLLM's `chat_template`: a request's own template (or the name of one of the model's named
    templates), rendered in place of the served one with the model's special tokens. Refused unless the server trusts its clients' templates
    (`--trust-request-chat-template`, as vLLM): a template is code that runs on the server."""
    source = body.get("chat_template")
    if source is None:
        return None
    if not getattr(info, "trust_request_chat_template", False):
        if source is False or source == {} or source == []:  # (as any refused field: empty is absent)
            return None
        raise APIError(
            "chat_template: a request's own chat template is refused; the server allows it with "
            "--trust-request-chat-template",
            param="chat_template",
            code="unsupported_parameter",
        )
    if not isinstance(source, str) or not source.strip():
        raise _bad("chat_template", "must be a non-empty string (a Jinja template)", "invalid_type")
    _check_surrogates("chat_template", source)
    import jinja2

    served = _served_template(info)
    try:
        return _compiled_template(source, served)
    except (jinja2.TemplateError, SyntaxError, RecursionError, MemoryError) as e:
        # (Python's own compiler refuses what nests too deep: SyntaxError, RecursionError)
        raise _bad("chat_template", f"is not a valid Jinja template: {type(e).__name__}: {e}") from None


def _template_renders_tools(template: ChatTemplate | None) -> bool:
    """Whether the chat template a conversation with tools renders with (the model's `tool_use`
    one, where it names one) renders `tools` itself (it mentions them)."""
    return template is not None and "tools" in template.source_for(tools=True)


def _render_tool_history(
    template: ChatTemplate | None, messages: list[dict[str, Any]], parser: T.ToolParser, tools: bool
) -> list[dict[str, Any]]:
    """The messages with the assistants' `tool_calls` and the `tool` results as a template that
    does not render them needs them: a template that mentions `tool_calls` (or the "tool" role)
    gets them as message fields; otherwise they are written as Hermes text (tools.py). `tools`:
    the conversation has tools (the model's `tool_use` template then renders it)."""
    source = template.source_for(tools) if template is not None else ""
    calls_as_text = "tool_calls" not in source
    results_as_text = re.search(r"""['"]tool['"]""", source) is None
    return T.with_tool_history_as_text(messages, parser, calls=calls_as_text, results=results_as_text)


def _adds_generation_prompt(body: dict[str, Any]) -> bool:
    """`add_generation_prompt`: default true, false with `continue_final_message`."""
    return bool(get_bool(body, "add_generation_prompt", not get_bool(body, "continue_final_message", False)))


def _render_chat(
    body: dict[str, Any],
    info: ModelInfo,
    unknown: UnknownFields,
    tools: list[dict[str, Any]] | None = None,
    refuse: Callable[[str], None] | None = None,
) -> tuple[list[int], str | None]:
    """The token ids of a chat body's `messages` through the chat template (the chat route's and
    /tokenize's), and with `continue_final_message` the content of the message they continue: `add_generation_prompt` (default true, false with `continue_final_message`),
    `continue_final_message` (the prompt ends inside the final message, which the model continues),
    `add_special_tokens` (default false, as vLLM: the template writes BOS itself),
    `chat_template_kwargs`. `refuse`: given the rendered text before it is tokenized (the chat
    route refuses a conversation that cannot fit, /tokenize one beyond what it counts)."""
    continue_final = get_bool(body, "continue_final_message", False)
    add_generation_prompt = _adds_generation_prompt(body)
    if continue_final and add_generation_prompt:
        raise _bad(
            "continue_final_message",
            "cannot be combined with add_generation_prompt true: the final message is continued, not followed by a new turn",
        )
    add_special_tokens = get_bool(body, "add_special_tokens", False)
    template_kwargs = _chat_template_kwargs(body)
    own = _request_template(body, info)
    template = own or _served_template(info)
    parser = _tool_parser(info)
    messages = _parse_messages(body.get("messages"), unknown, info.response_role)
    messages = _render_tool_history(template, messages, parser, bool(tools))
    if tools:  # the template renders them, or they go into the system prompt (tools.py)
        if _template_renders_tools(template):
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        else:
            messages = T.with_tools_in_system_prompt(messages, parser, tools)
    try:
        ids = info.encode_chat(
            messages,
            add_generation_prompt,
            add_special_tokens=add_special_tokens,
            template_kwargs=template_kwargs,
            refuse=refuse,
            continue_final_message=continue_final,
            template=own,
        )
    except APIError:
        raise
    except ContinuationError as e:
        raise _bad("continue_final_message", str(e)) from None
    except Exception as e:  # a template that raises on these messages (raise_exception, ...)
        param = "messages" if own is None else "chat_template"
        raise APIError(
            f"{param}: the chat template rejected the messages: {e}", param=param, code="invalid_value"
        ) from None
    return ids, str(messages[-1]["content"]) if continue_final else None


def parse_chat_request(
    body: dict[str, Any], info: ModelInfo, served_model_name: str, *, strict: bool = True
) -> GenerateRequest:
    """Validate a /v1/chat/completions body. Raises APIError. `strict`: an unknown field is a 400;
    otherwise it is ignored and named in the result's `ignored_fields`."""
    unknown = UnknownFields(strict)
    _check_fields(body, _CHAT_FIELDS, _UNSUPPORTED_COMMON | _CHAT_UNSUPPORTED, unknown)
    model, n, stream, include_usage, cache_salt, user = _common(body, served_model_name, unknown)
    want_logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", None, 0, info.max_logprobs)
    if top_logprobs is not None and not want_logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    max_tokens = get_int(body, "max_tokens", None, 1, None)
    max_completion = get_int(body, "max_completion_tokens", None, 1, None)
    max_param = "max_tokens"
    if max_completion is not None:
        if max_tokens is not None and max_tokens != max_completion:
            raise _bad("max_completion_tokens", "conflicts with max_tokens")
        max_tokens, max_param = max_completion, "max_completion_tokens"
    return_token_ids = get_bool(body, "return_token_ids", False)
    tokens_as_ids = body.get("return_tokens_as_token_ids")
    if tokens_as_ids is not None:
        tokens_as_ids = get_bool(body, "return_tokens_as_token_ids", False)
    _check_sequences(1, n)
    tools, tool_choice, rendered_tools = _parse_tool_fields(body, unknown)
    keep = _parse_truncation(body, info.max_model_len)
    # (a conversation that will be cut below the context is not refused for its length before
    # it is tokenized)
    cut = keep is not None and keep < info.max_model_len
    ids, continued = _render_chat(
        body,
        info,
        unknown,
        rendered_tools,
        None if cut else lambda text: refuse_longer_than_context(info, text, info.max_model_len, "messages"),
    )
    if not ids:
        raise _bad("messages", "the rendered conversation encodes to no tokens")
    prompts = _truncated([PromptInput(token_ids=ids, text=None)], keep)
    resolved = _generation_config_cap(
        _resolve_max_tokens(max_tokens, prompts, info.max_model_len, "messages", max_param), info
    )
    prompt_logprobs = get_int(body, "prompt_logprobs", None, 0, info.max_logprobs)
    if prompt_logprobs is not None and stream:
        raise _bad("prompt_logprobs", "not available with stream: true on chat (as vLLM)")
    params = _sampling_params(
        body,
        info,
        n=n,
        max_tokens=resolved,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    added: Mapping[str, int] = getattr(info, "added_tokens", {})
    parser = _tool_parser(info)
    params = _constrained(params, body, unknown, tools, tool_choice, parser, added)
    if rendered_tools and "skip_special_tokens" not in body and _special_tags(info, parser, added):
        # the tags are special tokens, which the text leaves out by default: the calls could not
        # be found in it (vLLM keeps special tokens whenever tools are given)
        params = dataclasses.replace(params, skip_special_tokens=False)
    beam = _beam_search(
        body,
        params,
        info,
        logprobs=logprobs is not None,
        prompt_logprobs=prompt_logprobs is not None,
        stop=bool(params.stop),
        stop_token_ids=bool(params.stop_token_ids),
        tools=bool(tools),
        **{_grammar_field(params): params.structured_outputs is not None and not tools},
    )
    req = GenerateRequest(
        kind="chat",
        model=model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        cache_salt=cache_salt,
        logprobs=logprobs,
        user=user,
        return_token_ids=return_token_ids,
        tokens_as_ids=tokens_as_ids,
        continuous_usage=_continuous_usage(body),
        ignored_fields=unknown.names,
        priority=_parse_priority(body),
        thinking_disabled=_thinking_disabled(body),
        prompt_logprobs=prompt_logprobs,
        continued=continued,
        beam=beam,
        # (the messages are valid here: they were rendered)
        role=None if _adds_generation_prompt(body) else str(body["messages"][-1]["role"]),
    )
    if rendered_tools:
        parser = parser.for_tools(rendered_tools)
        one = not get_bool(body, "parallel_tool_calls", True)
        req.tool_parser = T.FirstCallOnly(parser) if one else parser
    return req


# ---------------------------------------------------------------------------------------------
# /tokenize and /detokenize: vLLM's request and response shapes (its TokenizeCompletionRequest,
# TokenizeChatRequest, DetokenizeRequest), so that clients written for vLLM (lm-evaluation-harness's
# remote tokenizer, token counters) work unchanged.

TOKENIZE_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {
    "model",
    "messages",
    "add_generation_prompt",
    "add_special_tokens",
    "return_token_strs",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "tools",
    "tool_choice",
}
DETOKENIZE_FIELDS = {"model", "tokens"}


@dataclass
class TokenizeRequest:
    token_ids: list[int]
    return_token_strs: bool = False
    ignored_fields: list[str] = dataclasses.field(default_factory=list)


@dataclass
class DetokenizeRequest:
    token_ids: list[int]
    ignored_fields: list[str] = dataclasses.field(default_factory=list)


# /tokenize counts texts longer than the context (it does not generate: lm-evaluation-harness
# tokenizes whole documents through it), up to this many contexts, and at least TOKENIZE_MIN_TOKENS:
# a body of megabytes is millions of tokens, and their ids and pieces as Python objects and JSON
# took hundreds of megabytes per request, on a route that needs no API key.
TOKENIZE_CONTEXTS = 4
TOKENIZE_MIN_TOKENS = 1 << 17


def tokenize_limit(max_model_len: int) -> int:
    """The most tokens /tokenize counts."""
    return max(TOKENIZE_CONTEXTS * max_model_len, TOKENIZE_MIN_TOKENS)


def _refuse_long_text_before_tokenizing(info: ModelInfo, param: str, text: str) -> None:
    """A text with more tokens than /tokenize counts by `min_tokens` is refused before it is
    tokenized (no text has more tokens than characters)."""
    if len(text) > tokenize_limit(info.max_model_len):
        _refuse_beyond_tokenize_limit(info, param, info.min_tokens(text), at_least=True)


def _refuse_beyond_tokenize_limit(info: ModelInfo, param: str, count: int, at_least: bool = False) -> None:
    limit = tokenize_limit(info.max_model_len)
    if count > limit:
        raise APIError(
            f"{param}: {'at least ' if at_least else ''}{count} tokens, more than /tokenize counts "
            f"({limit}: the larger of {TOKENIZE_CONTEXTS} contexts of {info.max_model_len} and {TOKENIZE_MIN_TOKENS})",
            param=param,
            code="invalid_value",
        )


def parse_tokenize_request(
    body: dict[str, Any], info: ModelInfo, served_model_name: str, *, strict: bool = True
) -> TokenizeRequest:
    """A /tokenize body: `prompt` (a string, tokenized as the completions route tokenizes it:
    `add_special_tokens` default true) or `messages` (rendered as the chat route renders them:
    `add_generation_prompt` default true, `continue_final_message`, `add_special_tokens` default false,
    `chat_template_kwargs`, `tools` and `tool_choice`). No context-length check: it counts, it does
    not generate; but at most `tokenize_limit` tokens."""
    unknown = UnknownFields(strict)
    if "messages" in body:  # (vLLM's TokenizeChatRequest)
        if body.get("prompt") is not None:
            raise _bad("prompt", "give either prompt or messages, not both")
        _check_fields(body, TOKENIZE_CHAT_FIELDS, set(), unknown)
        _parse_model(body, served_model_name)
        # (the rendered text, too long from its length, is refused before it is tokenized, as a
        # prompt is: a body of megabytes took seconds and hundreds of MB to count)
        ids, _ = _render_chat(
            body,
            info,
            unknown,
            _parse_tool_fields(body, unknown)[2],
            lambda text: _refuse_long_text_before_tokenizing(info, "messages", text),
        )
    else:
        _check_fields(body, TOKENIZE_PROMPT_FIELDS, set(), unknown)
        _parse_model(body, served_model_name)
        prompt = get_str(body, "prompt")
        if prompt is None:
            raise APIError("prompt: a prompt (or messages) is required", param="prompt", code="missing_field")
        _check_surrogates("prompt", prompt)
        _refuse_long_text_before_tokenizing(info, "prompt", prompt)
        ids = info.encode(prompt, add_special_tokens=get_bool(body, "add_special_tokens", True))
    _refuse_beyond_tokenize_limit(info, "messages" if "messages" in body else "prompt", len(ids))
    return TokenizeRequest(
        token_ids=ids,
        return_token_strs=get_bool(body, "return_token_strs", False),
        ignored_fields=unknown.names,
    )


def parse_detokenize_request(
    body: dict[str, Any], info: ModelInfo, served_model_name: str, *, strict: bool = True
) -> DetokenizeRequest:
    """A /detokenize body: `tokens`, ids in the vocabulary (may be empty)."""
    unknown = UnknownFields(strict)
    _check_fields(body, DETOKENIZE_FIELDS, set(), unknown)
    _parse_model(body, served_model_name)
    if body.get("tokens") is None:
        raise APIError("tokens: required", param="tokens", code="missing_field")
    ids = _parse_token_list("tokens", body["tokens"], info.vocab_size, allow_empty=True)
    return DetokenizeRequest(token_ids=ids, ignored_fields=unknown.names)


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    """vLLM's TokenizeResponse (`token_strs` null unless asked for)."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


# ---------------------------------------------------------------------------------------------
# Response builders


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _finite(x: float) -> float:
    # JSON has no -Infinity; a token with probability 0 gets the most negative finite float.
    return x if math.isfinite(x) else -9999.0


class TextOffsets:
    """Where each token of a completion starts in its text (completions logprobs' `text_offset`),
    carried across the deltas of a stream: the characters that the tokens so far completed, so a
    character made of several byte tokens is counted once (its pieces share its offset)."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset of a token that adds `raw` to the text; moves past it."""
        at = self.offset
        pending = self._utf8.getstate()[0]
        if pending and raw and not 0x80 <= raw[0] <= 0xBF:
            at += 1  # the unfinished character before it becomes one U+FFFD: the token starts after
        self.offset += len(self._utf8.decode(raw))
        return at


def completion_logprobs(
    entries: Sequence[TokenLogprobs],
    token_ids: Sequence[int],
    token_text: Callable[[int], str],
    offsets: TextOffsets,
    text_bytes: Callable[[int], bytes] | None = None,
    as_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.

    `text_bytes(t)` is what token t adds to the text (nothing for a skipped special token;
    default: its label's UTF-8 bytes); `offsets` is advanced past these tokens. `as_ids`: tokens
    are named "token_id:N" (the offsets still count the text).
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    text_offset: list[int] = []
    for tid, entry in zip(token_ids, entries):
        text = _entry_text(tid, entry, token_text)
        tokens.append(_id_label(tid) if as_ids else text)
        chosen = entry.get(tid)
        token_logprobs.append(_finite(chosen.logprob) if chosen is not None else -9999.0)
        top_d: dict[str, float] = {}
        for other_id, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
            key = _id_label(other_id) if as_ids else _entry_text(other_id, entry, token_text)
            top_d.setdefault(key, _finite(lp.logprob))
        top.append(top_d)
        text_offset.append(
            offsets.advance(text_bytes(tid) if text_bytes is not None else text.encode("utf-8"))
        )
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def chat_logprobs(
    entries: Sequence[TokenLogprobs],
    token_ids: Sequence[int],
    token_text: Callable[[int], str],
    top_n: int,
    token_bytes: Callable[[int], bytes] | None = None,
    as_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.
    `token_bytes(t)` is the token's own bytes (default: its label's UTF-8), so that a piece of a
    multi-byte character reports the bytes it really stands for. `as_ids`: tokens are named
    "token_id:N"; their bytes stay the text's."""

    def item(tid: int, entry: TokenLogprobs, logprob: float) -> dict[str, Any]:
        text = _entry_text(tid, entry, token_text)
        raw = token_bytes(tid) if token_bytes is not None else text.encode("utf-8")
        return {"token": _id_label(tid) if as_ids else text, "logprob": _finite(logprob), "bytes": list(raw)}

    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append(
            {
                **item(tid, entry, chosen.logprob if chosen is not None else -9999.0),
                "top_logprobs": [item(oid, entry, lp.logprob) for oid, lp in ranked],
            }
        )
    return {"content": content}


def _id_label(tid: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` names it: text that no tokenizer's pieces
    (partial characters, or several tokens of one text) can make ambiguous."""
    return f"token_id:{tid}"


def _entry_text(tid: int, entry: TokenLogprobs, token_text: Callable[[int], str]) -> str:
    lp = entry.get(tid)
    if lp is not None and lp.decoded_token:
        return lp.decoded_token
    return token_text(tid)


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    stop_reason: int | str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    token_ids: Sequence[int] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """A completions choice (also a streamed one). `prompt_token_ids` / `token_ids` (vLLM's
    `return_token_ids` fields) and `prompt_logprobs` (vLLM's) are added only when given."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def top_n_entry(entry: TokenLogprobs, token_id: int, n: int) -> TokenLogprobs:
    """`entry` cut to `token_id` and the `n` best-ranked alternatives. The engine computes one
    top-n of a prompt's logprobs, the largest any field of the request asks for (echo with
    `logprobs`, `prompt_logprobs`); each field shows its own."""
    return {tid: lp for tid, lp in entry.items() if tid == token_id or lp.rank <= n}


def vllm_prompt_logprobs(
    entries: Sequence[TokenLogprobs | None], token_text: Callable[[int], str], as_ids: bool = False
) -> list[Any]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token None (the first) or {token id as a
    string: {logprob, rank, decoded_token}} for the prompt token and its top alternatives
    (`decoded_token` "token_id:N" with `as_ids`)."""
    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {
                    "logprob": _finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": _id_label(tid) if as_ids else (lp.decoded_token or token_text(tid)),
                }
                for tid, lp in entry.items()
            }
        )
    return out


def chat_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    stop_reason: int | str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    reasoning: str | None = None,
    role: str = "assistant",
) -> dict[str, Any]:
    """A chat choice (its message in `role`); `token_ids` (vLLM's `return_token_ids`) is added only when given (the
    prompt's ids go on the response: `chat_response(prompt_token_ids=...)`). `reasoning`: the
    answer's reasoning (server/reasoning.py), in `reasoning` and its older name
    `reasoning_content`; `text` is then its content. Either is null when empty, as a stream's deltas
    add up to it (an answer that closes its reasoning at once sends no reasoning delta)."""
    message: dict[str, Any] = {"role": role, "content": text}
    if reasoning is not None:
        shown = reasoning or None
        message.update(content=text or None, reasoning=shown, reasoning_content=shown)
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def _response(
    obj: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    resp: dict[str, Any] = {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    if prompt_token_ids is not None:
        resp["prompt_token_ids"] = list(prompt_token_ids)
    return resp


def completion_response(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    return _response("text_completion", request_id, created, model, choices, usage)


def chat_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    prompt_token_ids: Sequence[int] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """A chat response; with `prompt_token_ids` (vLLM's `return_token_ids`: a chat request has one
    prompt, so its ids go on the response, not on each choice), and so `prompt_logprobs` (vLLM's)."""
    resp = _response("chat.completion", request_id, created, model, choices, usage, prompt_token_ids)
    if prompt_logprobs is not None:
        resp["prompt_logprobs"] = prompt_logprobs
    return resp


def _stream_chunk(
    object_name: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    include_usage: bool,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = usage
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = list(prompt_token_ids)
    return chunk


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    return _stream_chunk("text_completion", request_id, created, model, choices, usage, include_usage)


def chat_chunk_choice(
    index: int,
    *,
    role: str | None = None,
    content: str | None = None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
    token_ids: Sequence[int] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if reasoning is not None:  # (both names, as `chat_choice`)
        delta["reasoning"] = delta["reasoning_content"] = reasoning
    if content is not None:
        delta["content"] = content
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A chat stream chunk; `prompt_token_ids` (vLLM's `return_token_ids`) goes on the chunk itself,
    as on a chat response."""
    return _stream_chunk(
        "chat.completion.chunk", request_id, created, model, choices, usage, include_usage, prompt_token_ids
    )
