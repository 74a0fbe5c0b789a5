"""The OpenAPI 3.1 document the server serves at GET /openapi.json.

The request schemas state what the validators in protocol.py accept. Which fields a route accepts
is read from protocol.py itself (`_COMPLETION_FIELDS`, `_CHAT_FIELDS`), so a field the validator
learns without a schema here makes `document()` fail at once; the types, bounds and enums are
written here, next to the constants protocol.py uses, and tests/server/test_openapi.py probes the
validator at every bound and enum this document states (and tests/server/test_server_fuzz.py
sends the server thousands of requests the document calls invalid), so the two cannot drift
apart unnoticed. Rules between fields (best_of == n, top_logprobs needs logprobs, ...) are in the
fields' descriptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridserve._core import __version__
from hybridserve.engine.beam_search import MAX_BEAM_WIDTH
from hybridserve.engine.chat_template import TEXT_PART_KEYS
from hybridserve.sampling.params import (
    LOGIT_BIAS_MAX,
    MAX_BAD_WORD_LEN,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STR_LEN,
    MAX_STOP_STRS_TOTAL_LEN,
    SEED_MAX,
    SEED_MIN,
)
from hybridserve.sampling.structured_outputs import MAX_CHOICES, MAX_GRAMMAR_CHARS
from hybridserve.server import protocol as P
from hybridserve.server import responses as R
from hybridserve.server.tools import MAX_NAME_LEN, NAME_CHARS

OPENAPI_VERSION = "3.1.0"
INT32_MAX = 2**31 - 1
USER_MAX_LEN = 1024  # protocol._common's limit on `user`

Schema = dict[str, Any]


def _int(lo: int | None, hi: int | None, description: str) -> Schema:
    s: Schema = {"type": "integer", "description": description}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _num(lo: float, hi: float, description: str, *, lo_open: bool = False) -> Schema:
    bound = "exclusiveMinimum" if lo_open else "minimum"
    return {"type": "number", bound: lo, "maximum": hi, "description": description}


def _bool(description: str) -> Schema:
    return {"type": "boolean", "description": description}


def _unsupported(description: str = "not supported by this server") -> Schema:
    # what protocol._check_fields lets through: absent, null or empty
    return {"enum": [None, False, {}, []], "description": f"{description}: only absent, null or empty"}


def _token_id(vocab_size: int | None) -> Schema:
    s: Schema = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        s["maximum"] = vocab_size - 1
    return s


def _below_pattern(n: int) -> str:
    """A regular expression of the decimal numbers 0 .. n - 1 (n >= 1), without leading zeros."""
    top = str(n - 1)
    width = len(top)
    alts = ["0"]
    if width >= 2:
        alts.append(f"[1-9][0-9]{{0,{width - 2}}}")  # fewer digits than n - 1
    for i, d in enumerate(top):  # as many digits: a smaller digit at i after n - 1's own prefix
        lo = 1 if i == 0 else 0
        if int(d) > lo:
            rest = width - i - 1
            alts.append(f"{top[:i]}[{lo}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    if top != "0":
        alts.append(top)
    return "^(" + "|".join(alts) + ")$"


def _logit_bias(vocab_size: int | None) -> Schema:
    key = (
        _below_pattern(vocab_size) if vocab_size is not None and vocab_size >= 1 else "^(0|[1-9][0-9]{0,17})$"
    )
    return {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
        "propertyNames": {"type": "string", "pattern": key},
        "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_MAX, "maximum": LOGIT_BIAS_MAX},
        "description": "token id (decimal, no leading zeros, below the vocabulary size) -> bias added to "
        "its logit before any other processing, greedy sampling too; -100 in effect forbids a "
        "token, 100 in effect forces it",
    }


def _max_tokens(max_model_len: int | None, default: str) -> Schema:
    # at least one prompt token: a request can never generate more than max_model_len - 1
    hi = max_model_len - 1 if max_model_len is not None else None
    return _int(
        1, hi, f"tokens to generate at most ({default}); prompt plus max_tokens must fit in max_model_len"
    )


def _sampling_fields(
    model_names: list[str], vocab_size: int | None, max_model_len: int | None
) -> dict[str, Schema]:
    """The fields both generation routes share (protocol._SAMPLING_FIELDS and _UNSUPPORTED_COMMON),
    `max_tokens` aside (its default differs)."""
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STR_LEN}
    return {
        "model": {
            "type": "string",
            "enum": list(model_names),
            "description": "the served model (default); another name is a 404 model_not_found",
        },
        "temperature": _num(
            0.0, 2.0, "sampling temperature (default 1, or the model's generation config; 0 is greedy)"
        ),
        "top_p": _num(
            0.0, 1.0, "nucleus sampling mass (default 1, or the model's generation config)", lo_open=True
        ),
        "top_k": _int(
            -1,
            INT32_MAX,
            "sample from the k most likely tokens (default 0, or the model's generation config; 0 and -1: all)",
        ),
        "min_p": _num(
            0.0,
            1.0,
            "drop tokens below min_p times the top probability (default 0, or the model's generation config)",
        ),
        "n": _int(1, P.MAX_SEQUENCES_PER_REQUEST, "choices per prompt (default 1); prompts x n at most 128"),
        "seed": _int(SEED_MIN, SEED_MAX, "seed of choice 0; the others get distinct seeds derived from it"),
        "stream": _bool("answer with Server-Sent Events (default false)"),
        "stream_options": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "include_usage": {"type": ["boolean", "null"]},
                "continuous_usage_stats": {"type": ["boolean", "null"]},
            },
            "description": "only with stream: true; include_usage: a last chunk with the usage; "
            "continuous_usage_stats (vLLM's, with include_usage): every chunk carries the usage so far",
        },
        "stop": {
            "anyOf": [
                {**stop_string},
                {"type": "array", "maxItems": P.MAX_STOP_SEQUENCES, "items": {**stop_string}},
            ],
            "description": f"stop strings, at most {MAX_STOP_STRS_TOTAL_LEN} characters in all (no "
            "unpaired UTF-16 surrogates)",
        },
        "stop_token_ids": {"type": "array", "items": _token_id(vocab_size), "description": "stop tokens"},
        "logit_bias": _logit_bias(vocab_size),
        "allowed_token_ids": {
            "type": "array",
            "minItems": 1,
            "items": _token_id(vocab_size),
            "description": "the only tokens the output may hold (vLLM's)",
        },
        "bad_words": {
            "type": "array",
            "maxItems": MAX_BAD_WORDS,
            "items": {"type": "string", "maxLength": MAX_BAD_WORD_LEN, "pattern": r"\S"},
            "description": "words the output must not hold (vLLM's): each as written and after a space, "
            "a word's last token is forbidden where the output ends with the tokens before it",
        },
        "ignore_eos": _bool("keep generating after EOS (default false)"),
        # (at most max_tokens, so below max_model_len too; the validator's own bound is INT32_MAX)
        "min_tokens": _int(
            0,
            max_model_len - 1 if max_model_len is not None else INT32_MAX,
            "tokens before EOS or a stop may end a choice (default 0; at most max_tokens)",
        ),
        "presence_penalty": _num(-2.0, 2.0, "default 0"),
        "frequency_penalty": _num(-2.0, 2.0, "default 0"),
        "repetition_penalty": _num(0.0, 10.0, "default 1, or the model's generation config", lo_open=True),
        "skip_special_tokens": _bool("leave special tokens out of the text (default true)"),
        "include_stop_str_in_output": _bool("keep the stop string that ended a choice (default false)"),
        "return_token_ids": _bool("return the prompt's and each choice's token ids (vLLM's fields)"),
        "use_beam_search": _bool(
            "the choices are the n best beams of a beam search (n: the beam width, at most "
            f"{MAX_BEAM_WIDTH} and at most half of --max-logprobs; streamed as one chunk per finished "
            "choice; no logprobs, stop, tools or grammars with it)"
        ),
        "length_penalty": _num(
            -1e6,
            1e6,
            "with use_beam_search: beams rank by summed log-probability / length ** this (default 1)",
        ),
        "return_tokens_as_token_ids": _bool(
            "logprobs name each token 'token_id:N' instead of its text (default: the server's "
            "--return-tokens-as-token-ids)"
        ),
        "user": {"type": "string", "maxLength": USER_MAX_LEN, "description": "an end-user id (not used)"},
        "truncate_prompt_tokens": {
            "anyOf": [
                {"type": "integer", "const": -1},
                _int(1, max_model_len, "keep this many of the prompt's last tokens"),
            ],
            "description": "keep only the prompt's last N tokens (vLLM's; -1: the context length); a "
            "prompt that is cut is echoed as its kept tokens",
        },
        "priority": _int(
            P.PRIORITY_MIN,
            P.PRIORITY_MAX,
            "lower values are scheduled first (vLLM's; default 0); a value other than 0 is a 400 "
            "unless the server runs with --scheduling-policy priority",
        ),
        "cache_salt": {
            "type": "string",
            "minLength": 1,
            "maxLength": P.MAX_CACHE_SALT_LEN,
            "description": "isolates a tenant's prefix cache (no unpaired UTF-16 surrogates)",
        },
        "metadata": {
            "type": "object",
            "maxProperties": P.MAX_METADATA_PAIRS,
            "propertyNames": {"type": "string", "maxLength": P.MAX_METADATA_KEY_CHARS},
            "additionalProperties": {"type": "string", "maxLength": P.MAX_METADATA_VALUE_CHARS},
            "description": "accepted and ignored (OpenAI's stored-completion tags)",
        },
        "store": _bool("accepted and ignored (nothing is stored)"),
        "service_tier": {"type": "string", "maxLength": 64, "description": "accepted and ignored"},
        **_grammar_fields(),
        **{name: _unsupported() for name in sorted(P._UNSUPPORTED_COMMON)},
    }


def _grammar_fields() -> dict[str, Schema]:
    """response_format and structured_outputs (server/structured_outputs.py): what the output must
    match. Whether a schema, regex or grammar is valid is known when the engine compiles it."""
    nullable_schema: Schema = {"type": ["object", "null"], "description": "a JSON schema"}
    json_schema: Schema = {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": ["string", "null"]},
            "description": {"type": ["string", "null"]},
            "strict": {"type": ["boolean", "null"]},
            "schema": nullable_schema,
        },
    }
    source: Schema = {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS}
    grammar_text: Schema = {"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS}
    kinds = ("json", "regex", "choice", "grammar", "json_object")

    def given(k: str) -> Schema:
        return {"required": [k], "properties": {k: {"not": {"type": "null"}}}}

    return {
        "response_format": {
            "type": "object",
            "required": ["type"],
            "additionalProperties": False,
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": json_schema,
            },
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
            "else": {"properties": {"json_schema": {"type": "null"}}},
            "description": "OpenAI's: text (no constraint), json_object (any JSON object) or json_schema "
            "(JSON matching json_schema.schema); not with structured_outputs or a forced tool_choice",
        },
        "structured_outputs": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                # (its JSON text, a string, is taken too, as vLLM takes it: not said here, where a
                # string the server refuses would be a value the document accepts)
                "json": nullable_schema,
                "regex": source,
                "choice": {
                    "type": ["array", "null"],
                    "minItems": 1,
                    "maxItems": MAX_CHOICES,
                    "items": {"type": "string", "minLength": 1},
                },
                "grammar": {**source, "description": "a Lark grammar (llguidance's dialect) or GBNF"},
                "json_object": {"enum": [True, None]},
            },
            "anyOf": [
                {"type": "null"},
                *({**given(k), "not": {"anyOf": [given(j) for j in kinds if j != k]}} for k in kinds),
            ],
            "description": "vLLM's: exactly one of json (a JSON schema; its JSON text is taken too), regex, "
            "choice, grammar, "
            f"json_object; at most {MAX_GRAMMAR_CHARS} characters of source",
        },
        # vLLM's older fields, each the structured_outputs key of the same grammar
        "guided_json": {
            "type": "object",
            "description": "vLLM's older structured_outputs.json: a JSON schema (its JSON text, a string, is "
            "taken too, as vLLM took it)",
        },
        "guided_regex": {**grammar_text, "description": "vLLM's older structured_outputs.regex"},
        "guided_choice": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_CHOICES,
            "items": {"type": "string", "minLength": 1},
            "description": "vLLM's older structured_outputs.choice",
        },
        "guided_grammar": {**grammar_text, "description": "vLLM's older structured_outputs.grammar"},
        "guided_decoding_backend": {"type": "string", "description": "accepted and ignored"},
        "guided_whitespace_pattern": {"type": "string", "description": "accepted and ignored"},
    }


def _tool_fields() -> dict[str, Schema]:
    """tools, tool_choice, parallel_tool_calls (server/tools.py)."""
    name: Schema = {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_NAME_LEN,
        "pattern": f"^[{NAME_CHARS}]+$",
    }
    tool: Schema = {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": name,
                    "description": {"type": ["string", "null"]},
                    "parameters": {"type": ["object", "null"], "description": "a JSON schema"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    }
    named: Schema = {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {"name": name},
            },
        },
    }
    return {
        "tools": {
            "type": "array",
            "items": tool,
            "description": "functions the model may call, at most 128, with distinct names",
        },
        "tool_choice": {
            "anyOf": [{"enum": ["none", "auto", "required"]}, named],
            "description": "none (default without tools), auto (default with tools), required, or a "
            "named function (one of tools); all but none need tools",
        },
        "parallel_tool_calls": _bool(
            "more than one call (default true; required: up to 8); false: one, the first valid one the model writes"
        ),
    }


def _completion_fields(
    model_names: list[str], vocab_size: int | None, max_model_len: int | None, max_logprobs: int | None
) -> dict[str, Schema]:
    token = _token_id(vocab_size)
    token_list: Schema = {"type": "array", "minItems": 1, "items": token}
    if max_model_len is not None:  # a prompt leaves room for one generated token
        token_list["maxItems"] = max_model_len - 1
    text: Schema = {"type": "string", "minLength": 1}
    many = {"minItems": 1, "maxItems": P.MAX_PROMPTS_PER_REQUEST}
    return {
        **_sampling_fields(model_names, vocab_size, max_model_len),
        "prompt": {
            "anyOf": [
                text,
                token_list,
                {"type": "array", **many, "items": text},
                {"type": "array", **many, "items": token_list},
            ],
            "description": "a string, a list of token ids, or a list of either (at most "
            f"{P.MAX_PROMPTS_PER_REQUEST} prompts); each must leave room for one generated token",
        },
        "max_tokens": _max_tokens(
            max_model_len,
            f"default {P.COMPLETION_DEFAULT_MAX_TOKENS}; the model's generation config max_new_tokens caps it; "
            "0 (score the prompt only) is also accepted with echo or prompt_logprobs",
        ),
        "echo": _bool(
            "prefix each choice with its prompt (default false); with logprobs, the prompt's tokens "
            "come first in logprobs, the first with a null logprob"
        ),
        "logprobs": _int(0, max_logprobs, "log-probabilities of the top-n tokens"),
        "prompt_logprobs": _int(
            0,
            max_logprobs,
            "the prompt's own log-probabilities with their top-n, in each choice's prompt_logprobs",
        ),
        "best_of": _int(1, P.MAX_SEQUENCES_PER_REQUEST, "only equal to n"),
        "suffix": {"enum": [None, ""], "description": "not supported: only absent, null or empty"},
        "add_special_tokens": _bool(
            "add the tokenizer's special tokens (BOS) to a text prompt (default true, as vLLM)"
        ),
    }


def _chat_fields(
    model_names: list[str],
    vocab_size: int | None,
    max_model_len: int | None,
    max_logprobs: int | None,
    request_templates: bool,
) -> dict[str, Schema]:
    return {
        **_sampling_fields(model_names, vocab_size, max_model_len),
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"$ref": "#/components/schemas/ChatMessage"},
            "description": "the conversation, rendered by the model's chat template",
        },
        "max_tokens": _max_tokens(
            max_model_len,
            "default: the room the prompt leaves; the model's generation config max_new_tokens caps it",
        ),
        "max_completion_tokens": _max_tokens(
            max_model_len, "max_tokens' newer name; equal to it if both are given"
        ),
        "logprobs": _bool("return log-probabilities (default false)"),
        "top_logprobs": _int(0, max_logprobs, "alternatives per token; requires logprobs: true"),
        "prompt_logprobs": _int(
            0,
            max_logprobs,
            "the rendered prompt's own log-probabilities with their top-n, in the response's "
            "prompt_logprobs (vLLM's; not with stream: true)",
        ),
        "add_generation_prompt": _bool(
            "end the prompt with the assistant's turn header (default true; false with continue_final_message)"
        ),
        **_template_fields(request_templates),
        **_tool_fields(),
        **{name: _unsupported() for name in sorted(P._CHAT_UNSUPPORTED)},
    }


def _responses_fields(
    model_names: list[str], vocab_size: int | None, max_model_len: int | None, max_logprobs: int | None
) -> dict[str, Schema]:
    """/v1/responses (responses.py): OpenAI's Responses fields, and vLLM's sampling fields as
    the chat route reads them."""
    sampling = _sampling_fields(model_names, vocab_size, max_model_len)
    shared = ("model", "temperature", "top_p", "stream", "user", "metadata", "service_tier")
    text = {"type": "string", "description": "accepted and ignored"}
    return {
        **{
            name: sampling[name]
            for name in (*shared, *sorted(R.PASSTHROUGH_FIELDS - {"chat_template_kwargs"}))
        },
        "chat_template_kwargs": _template_fields(False)["chat_template_kwargs"],
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "object"}},
            ],
            "description": "a user message, or input items: messages (role user, assistant, system or "
            "developer; text parts), function_call and function_call_output items; reasoning items "
            "are left out",
        },
        "instructions": {
            "type": "string",
            "description": "a system message before the input (not carried over)",
        },
        "previous_response_id": {
            "type": "string",
            "description": "continue a kept response's conversation (its input, then its output)",
        },
        "max_output_tokens": _max_tokens(max_model_len, "default: the room the prompt leaves"),
        "tools": {
            "type": "array",
            "items": {"type": "object"},
            "description": "function tools: {type: function, name, description, parameters, strict}",
        },
        "tool_choice": {
            "anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}],
            "description": 'as chat\'s, a named choice written {"type": "function", "name": ...}',
        },
        "parallel_tool_calls": _bool("more than one call in an answer (default true)"),
        "text": {
            "type": "object",
            "description": "format: {type: text | json_object | json_schema, name, schema, strict}",
        },
        "reasoning": {"type": "object", "description": "accepted and repeated; the model's template decides"},
        "stream_options": {"type": "object", "description": "accepted and ignored"},
        "store": _bool(
            "keep the response for GET /v1/responses/{id} and previous_response_id (default true)"
        ),
        "include": {
            "type": "array",
            "items": {"type": "string"},
            "description": f"{R.LOGPROBS_INCLUDE}: the message's token logprobs; other values are accepted and ignored",
        },
        "truncation": {"enum": ["disabled"], "description": "only disabled (the default)"},
        "top_logprobs": _int(
            0,
            max_logprobs,
            "alternatives per token of the message's logprobs, with include "
            f"[{R.LOGPROBS_INCLUDE!r}] (not with tools or a reasoning parser); alone it changes nothing",
        ),
        "prompt_cache_key": text,
        "safety_identifier": text,
        **{name: _unsupported() for name in R.UNSERVED_FIELDS},
    }


def _template_fields(request_templates: bool) -> dict[str, Schema]:
    """vLLM's chat-template fields (the chat route's and /tokenize's); `request_templates`: a
    request's own `chat_template` is rendered (--trust-request-chat-template), else refused."""
    return {
        "add_special_tokens": _bool(
            "add the tokenizer's special tokens (BOS) besides the template's (default false, as vLLM)"
        ),
        "continue_final_message": _bool(
            "end the prompt inside the final message, which the model continues (no end of turn, "
            "no generation prompt; default false)"
        ),
        "chat_template_kwargs": {
            "type": "object",
            "description": "more variables for the chat template (e.g. enable_thinking); not "
            + ", ".join(sorted(P._TEMPLATE_RESERVED)),
        },
        "chat_template": (
            {
                "type": "string",
                "pattern": r"\S",
                "description": "a Jinja chat template (not blank) rendered in place of the served one",
            }
            if request_templates
            else _unsupported("refused: the server allows it with --trust-request-chat-template")
        ),
    }


def _tokenize_schemas(
    model_names: list[str], vocab_size: int | None, request_templates: bool
) -> dict[str, Schema]:
    """vLLM's /tokenize and /detokenize bodies (protocol.parse_tokenize_request,
    parse_detokenize_request)."""
    model: Schema = {
        "type": "string",
        "enum": list(model_names),
        "description": "the served model (default); another name is a 404 model_not_found",
    }
    token_strs = _bool("also return each token's vocabulary entry (default false)")
    prompt: dict[str, Schema] = {
        "model": model,
        "prompt": {"type": "string", "description": "the text (no unpaired UTF-16 surrogates)"},
        "add_special_tokens": _bool("add the tokenizer's special tokens (BOS) (default true, as vLLM)"),
        "return_token_strs": token_strs,
    }
    chat: dict[str, Schema] = {
        "model": model,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"$ref": "#/components/schemas/ChatMessage"},
            "description": "rendered by the chat template, as the chat route renders them",
        },
        "add_generation_prompt": _bool(
            "end with the assistant's turn header (default true; false with continue_final_message)"
        ),
        "return_token_strs": token_strs,
        **_template_fields(request_templates),
        # the tools the chat route would render for the same body
        **{k: v for k, v in _tool_fields().items() if k in P.TOKENIZE_CHAT_FIELDS},
    }
    detokenize: dict[str, Schema] = {
        "model": model,
        "tokens": {"type": "array", "items": _token_id(vocab_size), "description": "token ids"},
    }
    return {
        "TokenizeCompletionRequest": _request(prompt, P.TOKENIZE_PROMPT_FIELDS, "prompt"),
        "TokenizeChatRequest": _request(chat, P.TOKENIZE_CHAT_FIELDS, "messages"),
        "DetokenizeRequest": _request(detokenize, P.DETOKENIZE_FIELDS, "tokens"),
    }


_CONTENT_PART: Schema = {
    "anyOf": [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["type", key],
            "properties": {
                "type": {"enum": [t for t, k in TEXT_PART_KEYS.items() if k == key]},
                key: {"type": "string"},
            },
        }
        for key in sorted(set(TEXT_PART_KEYS.values()))
    ]
}

_CHAT_MESSAGE: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["role"],
    "properties": {
        "role": {"enum": sorted(P._MESSAGE_ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"$ref": "#/components/schemas/ChatContentPart"}},
                {"type": "null"},
            ],
            "description": "text or text parts (no unpaired UTF-16 surrogates); null only for the assistant",
        },
        "name": {"type": ["string", "null"]},
        "tool_call_id": {"type": ["string", "null"]},
        "reasoning": {
            "type": ["string", "null"],
            "description": "an assistant's earlier reasoning, as the server returned it, for the "
            "template; only in an assistant's message",
        },
        "reasoning_content": {"type": ["string", "null"], "description": "reasoning's older name"},
        "tool_calls": {
            "anyOf": [
                {"type": "array", "items": {"$ref": "#/components/schemas/ChatToolCall"}},
                {"type": "null"},
            ],
            "description": "an assistant's earlier calls, as the server returned them; only in an "
            "assistant's message",
        },
    },
    # content may be left out (or null) only in an assistant's message, and only an assistant's
    # carries tool_calls and reasoning; a tool result names its call
    "if": {"properties": {"role": {"const": "assistant"}}},
    "else": {
        "not": {"anyOf": [{"required": ["reasoning"]}, {"required": ["reasoning_content"]}]},
        "required": ["content"],
        "properties": {"content": {"not": {"type": "null"}}, "tool_calls": {"type": "null"}},
        "if": {"properties": {"role": {"const": "tool"}}},
        "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
    },
}

_CHAT_TOOL_CALL: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "arguments": {"type": "string", "description": "the JSON text of the arguments"},
            },
        },
    },
}

_ERROR: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "additionalProperties": False,
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _chat_message(response_role: str) -> Schema:
    """A chat message; its role may also be the server's --response-role (an earlier answer)."""
    roles = sorted(P._MESSAGE_ROLES | {response_role})
    return {**_CHAT_MESSAGE, "properties": {**_CHAT_MESSAGE["properties"], "role": {"enum": roles}}}


def _optional(schema: Schema) -> Schema:
    """JSON null means "not given" for every optional field (protocol.py's readers)."""
    out = dict(schema)
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    if isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    elif "anyOf" in out:
        out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    elif "type" in out:  # (a list of types without null: no schema here has one)
        raise ValueError(f"cannot make {schema} optional")
    return out


def _request(fields: dict[str, Schema], accepted: set[str], required: str) -> Schema:
    missing = accepted - fields.keys()
    extra = fields.keys() - accepted
    if missing or extra:  # protocol.py changed: describe its fields here
        raise RuntimeError(f"openapi out of date: undocumented {sorted(missing)}, unknown {sorted(extra)}")
    props = {name: s if name == required else _optional(s) for name, s in sorted(fields.items())}
    return {"type": "object", "additionalProperties": False, "required": [required], "properties": props}


def _lax(schema: Any) -> Any:
    """A request schema of a server that ignores unknown fields (not --strict-request-fields):
    every object in it admits other properties."""
    if isinstance(schema, list):
        return [_lax(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _lax(v) for k, v in schema.items()}
    if out.get("additionalProperties") is False:
        out["additionalProperties"] = True
    return out


def _body_op(summary: str, schema: Schema, ok: dict[str, Any]) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": ok, **_error_responses()},
    }


def _error_responses() -> dict[str, Any]:
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {
        "4XX": {"description": "the request is invalid (docs/serving.md, Errors)", "content": err},
        "5XX": {"description": "loading, shutting down, queue full, or an internal error", "content": err},
    }


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def _generation(
    summary: str,
    schema_name: str,
    secured: bool,
    answer: str = "the choices (JSON), or with stream: true Server-Sent Events ending in [DONE]",
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}},
        },
        "responses": {
            "200": {
                "description": answer,
                "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
            },
            **_error_responses(),
        },
    }
    if secured:
        op["security"] = [{"bearer": []}]
    return op


def _get(summary: str, ok: dict[str, Any], *, secured: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **_error_responses()}}
    if secured:
        op["security"] = [{"bearer": []}]
    return op


def document(
    *,
    served_model_name: str,
    model_aliases: Sequence[str] = (),
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    max_logprobs: int | None = None,
    response_role: str = "assistant",
    api_key_required: bool = False,
    strict_request_fields: bool = True,
    trust_request_chat_template: bool = False,
) -> dict[str, Any]:
    """The OpenAPI document of a server serving `served_model_name` (also under `model_aliases`;
    the model's limits when it
    is loaded: None while it loads leaves those bounds out). `strict_request_fields`: whether the
    server refuses unknown fields (`--strict-request-fields`) or ignores them (the default).
    `trust_request_chat_template`: whether a chat request's own `chat_template` is rendered."""
    names = [served_model_name, *model_aliases]
    completion = _request(
        _completion_fields(names, vocab_size, max_model_len, max_logprobs), P._COMPLETION_FIELDS, "prompt"
    )
    chat = _request(
        _chat_fields(names, vocab_size, max_model_len, max_logprobs, trust_request_chat_template),
        P._CHAT_FIELDS,
        "messages",
    )
    responses = _request(
        _responses_fields(names, vocab_size, max_model_len, max_logprobs),
        R.RESPONSES_FIELDS | R.PASSTHROUGH_FIELDS,
        "input",
    )
    sec = api_key_required
    text_ok = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "hybridserve",
            "version": __version__,
            "description": "OpenAI-compatible API of hybridserve (docs/serving.md). Every error "
            'answers {"error": {"message", "type", "param", "code"}}. An integer field takes an '
            "integer written without a fraction or an exponent (3.0 and 1e3 are refused), and "
            "null in an optional field means the field is not given.",
        },
        "paths": {
            "/v1/completions": {"post": _generation("OpenAI completions", "CompletionRequest", sec)},
            "/v1/chat/completions": {
                "post": _generation("OpenAI chat completions", "ChatCompletionRequest", sec)
            },
            "/v1/completions/render": {
                "post": _body_op(
                    "vLLM's render: the token ids of each prompt of a completion request, no generation",
                    {"$ref": "#/components/schemas/CompletionRequest"},
                    _json("[{request_id, model, token_ids}] (one per prompt)"),
                )
            },
            "/v1/chat/completions/render": {
                "post": _body_op(
                    "vLLM's render: the token ids of a chat request's prompt (template applied)",
                    {"$ref": "#/components/schemas/ChatCompletionRequest"},
                    _json("{request_id, model, token_ids}"),
                )
            },
            "/v1/responses": {
                "post": _generation(
                    "OpenAI responses (docs/serving.md)",
                    "ResponsesRequest",
                    sec,
                    "the response (JSON), or with stream: true its typed Server-Sent Events, the last "
                    "response.completed, response.incomplete or response.failed",
                )
            },
            "/v1/responses/{response_id}": {
                method: {
                    **_get(summary, _json(answer), secured=sec),
                    "parameters": [
                        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                }
                for method, summary, answer in (
                    ("get", "a kept response (404 when not kept)", "the response"),
                    ("delete", "delete a kept response (404 when not kept)", "{id, object, deleted}"),
                )
            },
            "/v1/responses/{response_id}/input_items": {
                "get": {
                    **_get(
                        "a kept response's input items, a page at a time (404 when not kept)",
                        _json("{object: list, data, first_id, last_id, has_more}"),
                        secured=sec,
                    ),
                    "parameters": [
                        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": _int(1, 100, "items per page (default 20)"),
                        },
                        {
                            "name": "order",
                            "in": "query",
                            "schema": {"enum": ["asc", "desc"], "description": "default desc (newest first)"},
                        },
                        {
                            "name": "after",
                            "in": "query",
                            "schema": {"type": "string", "description": "an item id"},
                        },
                    ],
                }
            },
            "/v1/models": {"get": _get("the served model", _json("a list of one model card"), secured=sec)},
            "/v1/models/{model_id}": {
                "get": {
                    **_get("one model card (404 for another id)", _json("the model card"), secured=sec),
                    "parameters": [
                        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                }
            },
            "/health": {
                "get": {
                    "summary": "whether the server serves",
                    "responses": {
                        "200": _json('{"status": "ok"}'),
                        "503": _json('{"status": "loading" | "error" | "shutting_down"}'),
                    },
                }
            },
            "/ping": {
                method: {
                    "summary": "vLLM's liveness route: as /health",
                    "responses": {
                        "200": _json('{"status": "ok"}'),
                        "503": _json('{"status": "loading" | "error" | "shutting_down"}'),
                    },
                }
                for method in ("get", "post")
            },
            "/version": {"get": _get("the server's version", _json("{version}"))},
            "/metrics": {"get": _get("Prometheus metrics (docs/serving.md, Metrics)", text_ok)},
            "/openapi.json": {"get": _get("this document", _json("OpenAPI 3.1"))},
            "/tokenize": {
                "post": _body_op(
                    "vLLM's tokenize: a prompt or chat messages to token ids",
                    {
                        "anyOf": [
                            {"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                            {"$ref": "#/components/schemas/TokenizeChatRequest"},
                        ]
                    },
                    _json("{count, max_model_len, tokens, token_strs}"),
                )
            },
            "/detokenize": {
                "post": _body_op(
                    "vLLM's detokenize: token ids to text (special tokens kept)",
                    {"$ref": "#/components/schemas/DetokenizeRequest"},
                    _json("{prompt}"),
                )
            },
            "/tokenizer_info": {
                "get": _get(
                    "vLLM's tokenizer_info: the tokenizer's configuration and the chat template",
                    _json("tokenizer_config.json's fields, tokenizer_class, chat_template"),
                )
            },
        },
        "components": {
            "schemas": {
                "CompletionRequest": completion,
                "ChatCompletionRequest": chat,
                "ResponsesRequest": responses,
                "ChatMessage": _chat_message(response_role),
                "ChatContentPart": _CONTENT_PART,
                "ChatToolCall": _CHAT_TOOL_CALL,
                **_tokenize_schemas(names, vocab_size, trust_request_chat_template),
                "Error": _ERROR,
            },
        },
    }
    if not strict_request_fields:
        schemas = doc["components"]["schemas"]
        for name in schemas:
            if name != "Error":
                schemas[name] = _lax(schemas[name])
    if sec:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
