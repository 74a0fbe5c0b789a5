"""OpenAI's Responses API (POST /v1/responses; GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items) over the chat route's machinery.

A Responses body is translated into a chat body (`input` and `instructions` into `messages`,
`max_output_tokens` into `max_tokens`, flat function tools into chat tools, `text.format` into
`response_format`) and validated by the chat validator, so both routes accept and refuse the same
conversations, tools and grammars; its errors name the Responses fields. The answer is split as
a chat answer is (reasoning, content, tool calls) and written as output items: a `reasoning` item,
a `message` item with one `output_text` part, and a `function_call` item per call, in that order.
A stream sends the same items as OpenAI's typed events (`response.created` ...
`response.completed`), so the events add up to the response the same request gets unstreamed.

Responses are kept (`store`, true by default as OpenAI's) in a store bounded by bytes, the oldest
dropped first: `previous_response_id` continues the conversation a kept response ended (its
input, then its output), without its `instructions`, as OpenAI does. Output reasoning is not
sent back to the model in a later turn (a template that renders earlier reasoning, as Qwen3's
does after the last query, gets it over the chat route only).

Not served: hosted tools (web search, file search, computer use, MCP), images and files in the
input, `background`, `truncation: "auto"`, `max_tool_calls`, stored prompts or conversations
(`prompt`, `conversation`), and logprobs of an answer that is split (with tools or a reasoning
parser, whose tokens are not all the message's).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from hybridserve.engine.chat_template import TextParts
from hybridserve.server import protocol as P
from hybridserve.server.tools import ToolCall

# Fields of OpenAI's Responses body this server reads (or type-checks and repeats)
RESPONSES_FIELDS = {
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "stream",
    "stream_options",
    "store",
    "metadata",
    "user",
    "service_tier",
    "include",
    "truncation",
    "prompt_cache_key",
    "safety_identifier",
    "top_logprobs",
    # known, not served: accepted only when absent, null, false or empty
    "background",
    "max_tool_calls",
    "conversation",
    "prompt",
}
# vLLM's extra fields, given to the chat validator as they are (the same meaning there)
PASSTHROUGH_FIELDS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "bad_words",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "cache_salt",
    "priority",
    "chat_template_kwargs",
}
UNSERVED_FIELDS = ("background", "max_tool_calls", "conversation", "prompt")
# `include` of the message's token logprobs (with `top_logprobs` alternatives each)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# A chat validator's field -> the Responses field it came from (its errors name the latter)
_FIELD_NAMES = (
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    # (the chat form nests the schema in `json_schema`; `text.format` holds it directly)
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)
_INPUT_TEXT_PARTS = {"input_text", "output_text", "text"}
DEFAULT_STORE_BYTES = 64 << 20


@dataclass
class ResponsesRequest:
    """A validated Responses body: the chat request that runs it, and what the response repeats."""

    chat: P.GenerateRequest
    # the conversation as chat messages, without `instructions`: what a later turn continues
    history: list[dict[str, Any]]
    echo: dict[str, Any]  # the body's fields the response object repeats
    # `input` as items with ids, for GET /v1/responses/{id}/input_items
    input_items: list[dict[str, Any]] = field(default_factory=list)
    store: bool = True
    ignored_fields: list[str] = field(default_factory=list)  # (the app logs them)
    logprobs: bool = False  # the message's token logprobs were asked for (`LOGPROBS_INCLUDE`)


def _with_parts_kept(message: dict[str, Any]) -> dict[str, Any]:
    """A message as JSON keeps it: content given as text parts as the chat route's list of them
    (read back, the route makes the same parts of it), so that a later turn hands a template
    taking parts the same parts as this one did."""
    content = message.get("content")
    if not isinstance(content, TextParts):
        return message
    return {**message, "content": [{"type": "text", "text": t} for t in content.parts]}


@dataclass(frozen=True)
class KeptResponse:
    """One kept response as the UTF-8 JSON of its parts: the store's bound counts the bytes it
    holds (a parsed body of logprobs takes about five times its JSON's size in Python objects),
    and every read gets objects of its own to change."""

    _body: bytes
    _history: bytes
    _input_items: bytes

    @classmethod
    def of(
        cls, body: dict[str, Any], history: list[dict[str, Any]], input_items: list[dict[str, Any]]
    ) -> KeptResponse:
        def enc(x: Any) -> bytes:
            return json.dumps(x, ensure_ascii=False, separators=(",", ":")).encode()

        return cls(enc(body), enc([_with_parts_kept(m) for m in history]), enc(input_items))

    @property
    def size(self) -> int:
        return len(self._body) + len(self._history) + len(self._input_items)

    @property
    def body(self) -> dict[str, Any]:
        return cast("dict[str, Any]", json.loads(self._body))

    @property
    def history(self) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", json.loads(self._history))

    @property
    def input_items(self) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", json.loads(self._input_items))


@dataclass
class ResponseStore:
    """Kept responses by id, at most `max_bytes` of their JSON and conversations, in UTF-8 (the
    oldest dropped first). Shared by the event loop and the threads that parse large bodies."""

    max_bytes: int = DEFAULT_STORE_BYTES
    _kept: OrderedDict[str, KeptResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(
        self,
        response_id: str,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        input_items: list[dict[str, Any]] | None = None,
    ) -> None:
        kept = KeptResponse.of(body, history, input_items or [])
        size = kept.size
        if size > self.max_bytes:
            return  # (larger than the whole store: not kept, so a later turn gets a clear 400)
        with self._lock:
            old = self._kept.pop(response_id, None)  # (an id kept again replaces its older entry)
            if old is not None:
                self._bytes -= old.size
            self._kept[response_id] = kept
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._kept.popitem(last=False)
                self._bytes -= old.size

    def get(self, response_id: str) -> KeptResponse | None:
        with self._lock:
            return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            old = self._kept.pop(response_id, None)
            if old is not None:
                self._bytes -= old.size
            return old is not None


def _bad(param: str, message: str, code: str = "invalid_value") -> P.APIError:
    return P.APIError(f"{param}: {message}", param=param, code=code)


def _unserved(param: str, what: str) -> P.APIError:
    return P.APIError(
        f"{param}: {what} is not supported by this server", param=param, code="unsupported_parameter"
    )


def _others(obj: dict[str, Any], known: set[str], param: str, unknown: P.UnknownFields) -> None:
    """Report the fields of an item or part this server does not know. A null one is no field:
    clients send the output items of a response back as the SDK dumps them (`"phase": null`)."""
    for key in sorted(set(obj) - known):
        if obj[key] is not None:
            unknown.found(f"{param}.{key}")


def _text_of_parts(param: str, content: Any, unknown: P.UnknownFields) -> str:
    """A message's content: a string, or its text parts joined a part per line (as the chat route
    joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(
            param,
            f"must be a string or a list of content parts, got {type(content).__name__}",
            "invalid_type",
        )
    parts: list[str] = []
    for j, part in enumerate(content):
        pp = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(pp, f"must be an object, got {type(part).__name__}", "invalid_type")
        kind = part.get("type")
        if kind == "refusal":
            text = part.get("refusal")
            _others(part, {"type", "refusal"}, pp, unknown)
        elif isinstance(kind, str) and kind in _INPUT_TEXT_PARTS:
            text = part.get("text")
            _others(part, {"type", "text", "annotations", "logprobs"}, pp, unknown)
        else:
            raise _unserved(f"{pp}.type", f"a content part of type {kind!r} (only text is)")
        if not isinstance(text, str):
            raise _bad(f"{pp}.text", "must be a string", "invalid_type")
        parts.append(text)
    return TextParts(parts)


def _string_field(item: dict[str, Any], param: str, key: str) -> str:
    v = item.get(key)
    if v is None:
        raise _bad(f"{param}.{key}", "required", "missing_field")
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise _bad(f"{param}.{key}", "must be a non-empty string", "invalid_type")
    return v


# Where a chat message came from, for the errors the chat validator raises about it: pairs of (a
# path inside the chat message, the Responses field it was made from), the most specific first.
# A chat error at `messages[k]` + rest names the field of the first pair whose path starts rest.
Origin = list[tuple[str, str]]


def input_messages(v: Any, unknown: P.UnknownFields, origins: list[Origin]) -> list[dict[str, Any]]:
    """`input` (a string, or a list of input items) as chat messages, with each message's origin
    appended to `origins`. Consecutive function calls join one assistant message's `tool_calls`
    (with the assistant text just before them, if any); a `reasoning` item is left out (the chat
    route alone hands an assistant's reasoning to the template), but for an answer that was
    reasoning alone (no assistant message or call after it), which is an empty assistant turn."""
    if isinstance(v, str):
        origins.append([(".content", "input"), ("", "input")])
        return [{"role": "user", "content": v}]
    if not isinstance(v, list):
        raise _bad(
            "input", f"must be a string or a list of input items, got {type(v).__name__}", "invalid_type"
        )
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(p, f"must be an object, got {type(item).__name__}", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            _others(item, {"type", "role", "content", "id", "status"}, p, unknown)
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{p}.role", f"must be one of user, assistant, system, developer; got {role!r}")
            if "content" not in item:
                raise _bad(f"{p}.content", "required", "missing_field")
            out.append({"role": role, "content": _text_of_parts(f"{p}.content", item["content"], unknown)})
            origins.append([("", p)])
        elif kind == "function_call":
            _others(item, {"type", "call_id", "name", "arguments", "id", "status"}, p, unknown)
            call = {
                "id": _string_field(item, p, "call_id"),
                "type": "function",
                "function": {
                    "name": _string_field(item, p, "name"),
                    "arguments": _string_field(item, p, "arguments"),
                },
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": TextParts(())}  # (as the chat route's)
                out.append(last)
                origins.append([("", p)])
            calls = last.setdefault("tool_calls", [])
            at = f".tool_calls[{len(calls)}]"
            calls.append(call)
            origins[-1][:0] = [
                (f"{at}.function.arguments", f"{p}.arguments"),
                (f"{at}.function.name", f"{p}.name"),
                (f"{at}.id", f"{p}.call_id"),
                (at, p),
            ]
        elif kind == "function_call_output":
            _others(item, {"type", "call_id", "output", "id", "status"}, p, unknown)
            if item.get("output") is None:
                raise _bad(f"{p}.output", "required", "missing_field")
            result = _text_of_parts(f"{p}.output", item["output"], unknown)
            out.append({"role": "tool", "tool_call_id": _string_field(item, p, "call_id"), "content": result})
            origins.append([(".content", f"{p}.output"), (".tool_call_id", f"{p}.call_id"), ("", p)])
        elif kind == "reasoning":
            following = v[i + 1] if i + 1 < len(v) else None
            if isinstance(following, dict) and following.get("type") == "reasoning":
                continue  # (the answer's last reasoning item decides)
            answered = isinstance(following, dict) and (
                following.get("type") == "function_call"
                or (following.get("type", "message") == "message" and following.get("role") == "assistant")
            )
            if not answered:  # (an answer of reasoning alone: its turn, empty, as kept)
                out.append({"role": "assistant", "content": ""})
                origins.append([("", p)])
        else:
            raise _unserved(f"{p}.type", f"an input item of type {kind!r}")
    if not out:
        raise _bad("input", "holds no message")
    return out


def listed_input(v: Any) -> list[dict[str, Any]]:
    """`input` (already validated) as OpenAI lists a response's input items: each with an id
    (its own, or a new one), a message's content as typed parts, null fields left out."""
    if isinstance(v, str):
        v = [{"role": "user", "content": v}]
    out: list[dict[str, Any]] = []
    for given in v:
        item = {k: copy.deepcopy(x) for k, x in given.items() if x is not None}
        kind = item.setdefault("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "rs")
        item.setdefault("id", _new_id(prefix))
        if kind == "message" and isinstance(item["content"], str):
            if item["role"] == "assistant":
                item["content"] = [{"type": "output_text", "text": item["content"], "annotations": []}]
            else:
                item["content"] = [{"type": "input_text", "text": item["content"]}]
        if kind != "reasoning":
            item.setdefault("status", "completed")
        out.append(item)
    return out


def page_of_input_items(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of a kept response's input items: OpenAI's `limit` (1 to 100, default 20),
    `order` (`desc`, the default, or `asc`) and `after` (an item id) query parameters."""
    raw_limit = query.get("limit", "20")
    if re.fullmatch(r"[0-9]{1,3}", raw_limit) is None or not 1 <= int(raw_limit) <= 100:
        raise _bad("limit", f"must be an integer from 1 to 100, got {raw_limit[:20]!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad("order", f"must be asc or desc, got {order[:20]!r}")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise _bad("after", f"no input item of this response has the id {after[:80]!r}")
        ordered = ordered[at + 1 :]
    page = ordered[: int(raw_limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > len(page),
    }


def _chat_tools(v: Any) -> list[Any]:
    """Responses' flat function tools as chat tools (the chat validator checks their fields)."""
    if not isinstance(v, list):
        raise _bad("tools", f"must be a list of tools, got {type(v).__name__}", "invalid_type")
    out: list[Any] = []
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}]", f"must be an object, got {type(t).__name__}", "invalid_type")
        if t.get("type") != "function":
            raise _unserved(f"tools[{i}].type", f"a tool of type {t.get('type')!r} (function tools are)")
        out.append({"type": "function", "function": {k: x for k, x in t.items() if k != "type"}})
    return out


def _chat_tool_choice(v: Any) -> Any:
    if isinstance(v, dict):
        if v.get("type") != "function":
            raise _unserved("tool_choice.type", f"a tool choice of type {v.get('type')!r}")
        if not isinstance(v.get("name"), str):
            raise _bad(
                "tool_choice.name", "a named choice is {'type': 'function', 'name': ...}", "invalid_type"
            )
        return {"type": "function", "function": {k: x for k, x in v.items() if k != "type"}}
    return v


def _response_format(text: Any, unknown: P.UnknownFields) -> dict[str, Any] | None:
    """`text.format` as the chat route's `response_format` (None: plain text)."""
    if not isinstance(text, dict):
        raise _bad("text", f"must be an object, got {type(text).__name__}", "invalid_type")
    _others(text, {"format", "verbosity"}, "text", unknown)
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"must be an object, got {type(fmt).__name__}", "invalid_type")
    kind = fmt.get("type")
    if kind == "json_schema":
        if "schema" not in fmt:
            nested = " (the Responses API takes it at text.format.schema, not in json_schema)"
            raise _bad(
                "text.format.schema", "required" + (nested if "json_schema" in fmt else ""), "missing_field"
            )
        _others(fmt, {"type", "name", "schema", "strict", "description"}, "text.format", unknown)
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    if kind in ("text", "json_object"):
        _others(fmt, {"type"}, "text.format", unknown)
        return None if kind == "text" else {"type": "json_object"}
    raise _bad("text.format.type", f"must be one of text, json_object, json_schema; got {kind!r}")


_MENTIONS = re.compile(r"\b(max_tokens|response_format)\b")


def renamed_error(e: P.APIError, origins: list[Origin] | None = None) -> P.APIError:
    """A chat validator's error, naming the Responses field it came from: with `origins` (one per
    chat message), an error about one message names the input item (or `instructions`, or
    `previous_response_id`) it was made from. The chat fields its text mentions besides the one
    it is about (`min_tokens` "must not exceed max_tokens") are named as Responses names them."""
    e = _renamed_param(e, origins)
    names = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
    e.message = _MENTIONS.sub(lambda m: names[m.group(1)], e.message)
    return e


def _renamed_param(e: P.APIError, origins: list[Origin] | None) -> P.APIError:
    param = e.param or ""
    at = re.match(r"messages\[([0-9]+)\]", param)
    if at is not None and origins is not None and int(at.group(1)) < len(origins):
        rest = param[at.end() :]
        for path, name in origins[int(at.group(1))]:
            if rest == path or rest.startswith((f"{path}.", f"{path}[")) or not path:
                # (a field that is one string, or the kept conversation, is named whole)
                whole = name in ("input", "instructions", "previous_response_id")
                new = name if whole else name + rest[len(path) :]
                e.message = e.message.replace(param, new, 1)
                e.param = new
                return e
    for chat_name, name in _FIELD_NAMES:
        if param == chat_name or param.startswith((f"{chat_name}.", f"{chat_name}[")):
            new = name if chat_name == "messages" else name + param[len(chat_name) :]
            e.message = e.message.replace(param, new, 1)
            e.param = new
            return e
    if param.startswith(("tools[", "tool_choice.")) and ".function" in param:
        new = param.replace(".function", "", 1)
        e.message = e.message.replace(param, new, 1)
        e.param = new
    return e


def _check_unserved(body: dict[str, Any]) -> None:
    for key in UNSERVED_FIELDS:
        v = body.get(key)
        if v is not None and v is not False and v != {} and v != []:
            raise _unserved(key, key)
    if body.get("truncation") not in (None, "disabled"):
        raise _unserved("truncation", f"truncation {body['truncation']!r} (only 'disabled' is)")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise _bad("include", "must be a list of strings", "invalid_type")
    for key in ("reasoning", "stream_options"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _bad(key, f"must be an object, got {type(body[key]).__name__}", "invalid_type")
    for key in ("instructions", "previous_response_id", "prompt_cache_key", "safety_identifier"):
        P.get_str(body, key)
    P.check_metadata(body.get("metadata"))


def _check_writable(body: dict[str, Any]) -> None:
    """The fields a response repeats (and keeps) must be writable as UTF-8: a lone surrogate in
    one (JSON allows writing it) is refused here, not found when the answer is written."""
    for key in ("input", "instructions", "metadata", "user", "reasoning", "text", "tools", "tool_choice"):
        try:
            json.dumps(body.get(key), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(key, "holds a lone surrogate (an unpaired \\ud800-\\udfff escape)") from None


def parse_responses_request(
    body: dict[str, Any],
    info: P.ModelInfo,
    served_model_name: str,
    *,
    strict: bool = True,
    store: ResponseStore,
) -> ResponsesRequest:
    """Validate a /v1/responses body (the conversation of `previous_response_id` from `store`).
    Raises APIError naming the Responses field."""
    unknown = P.UnknownFields(strict)
    for key in body:
        if key not in RESPONSES_FIELDS and key not in PASSTHROUGH_FIELDS:
            unknown.found(key)
    _check_unserved(body)
    if "input" not in body or body["input"] is None:
        raise P.APIError("input: required", param="input", code="missing_field")
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        kept = store.get(previous)
        if kept is None:
            raise P.APIError(
                f"previous_response_id: no kept response has the id {previous!r} (it was not stored, "
                "was deleted, or was dropped to make room)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = kept.history
    origins: list[Origin] = [[("", "previous_response_id")] for _ in history]
    history += input_messages(body["input"], unknown, origins)
    instructions = body.get("instructions")
    if instructions:
        origins.insert(0, [(".content", "instructions"), ("", "instructions")])
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat: dict[str, Any] = {k: body[k] for k in PASSTHROUGH_FIELDS if k in body}
    chat["messages"] = messages
    for key in (
        "model",
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "stream",
        "user",
        "metadata",
        "service_tier",
    ):
        if key in body:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _chat_tools(body["tools"])
    # ("auto" without tools: what an agent framework sends for an agent with none; it means
    # no calls, where the chat route would ask for tools)
    if body.get("tool_choice") is not None and (body["tool_choice"] != "auto" or chat.get("tools")):
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        fmt = _response_format(body["text"], unknown)
        if fmt is not None:
            chat["response_format"] = fmt
    top_logprobs = P.get_int(body, "top_logprobs", None, 0, info.max_logprobs)
    logprobs = LOGPROBS_INCLUDE in (body.get("include") or [])
    if logprobs:
        if chat.get("tools") and chat.get("tool_choice") != "none":
            raise _bad(
                "include", f"{LOGPROBS_INCLUDE} is not served with tools (not every token is the message's)"
            )
        chat.update(logprobs=True, top_logprobs=top_logprobs or 0)
    try:
        req = P.parse_chat_request(chat, info, served_model_name, strict=strict)
    except P.APIError as e:
        raise renamed_error(e, origins) from None
    req.ignored_fields = unknown.names + req.ignored_fields
    keep = P.get_bool(body, "store", True)
    _check_writable(body)
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": req.model,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": previous,
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": keep,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "top_logprobs": top_logprobs,
        "truncation": "disabled",
        "user": body.get("user"),
        "background": False,
    }
    return ResponsesRequest(
        chat=req,
        history=history,
        echo=echo,
        input_items=listed_input(body["input"]) if keep else [],  # (read only from the store)
        store=keep,
        ignored_fields=req.ignored_fields,
        logprobs=logprobs,
    )


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items as the answer is settled: reasoning text, content text and
    finished tool calls, fed in the order they come. Each method returns the stream events it
    makes (without their sequence numbers); `items` is the output so far."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item whose text is still growing

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self.close()
        if kind == "reasoning":
            item: dict[str, Any] = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "type": "message",
                "id": _new_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.items)
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": index, "item": _copy(item)})
        item["content"].append(part)
        events.append(
            {"type": "response.content_part.added", "item_id": item["id"], "output_index": index, "content_index": 0,
             "part": _copy(part)}
        )  # fmt: skip
        return events

    def _text(
        self, kind: str, delta: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = self._ensure(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        if logprobs:
            item["content"][0]["logprobs"] += logprobs
        events.append(self._delta_event(kind, delta, logprobs))
        return events

    def _delta_event(self, kind: str, delta: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The open item's delta event (a message's with the logprobs of its tokens)."""
        assert self._open is not None
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        body: dict[str, Any] = {
            "type": event,
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": delta,
        }
        if kind == "message":
            body["logprobs"] = logprobs or []
        return body

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        return self._text("reasoning", delta)

    def content(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """(`logprobs`: of the tokens the delta's text came from)"""
        return self._text("message", delta, logprobs)

    def late_logprobs(self, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Logprobs of tokens that brought no text of their own at the end of a stream (a stop
        string's, the end's): the open message's, sent in a delta of no text, so that the deltas'
        logprobs add up to the part's."""
        item = self._open
        if not logprobs or item is None or item["type"] != "message":
            return []
        item["content"][0]["logprobs"] += logprobs
        return [self._delta_event("message", "", logprobs)]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self.close()
        index = len(self.items)
        item = {
            "type": "function_call",
            "id": _new_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        events.append({"type": "response.output_item.added", "output_index": index, "item": _copy(item)})
        events.append(
            {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
             "delta": call.arguments}
        )  # fmt: skip
        events.append(
            {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
             "name": call.name, "arguments": call.arguments}
        )  # fmt: skip
        item.update(arguments=call.arguments, status="completed")
        self.items.append(item)
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events that finish the open text item (none when no item is open); a message
        gets `status` (the response's: "incomplete" when its answer was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        head = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done: dict[str, Any] = {"type": "response.reasoning_text.done", **head, "text": part["text"]}
        else:
            done = {
                "type": "response.output_text.done",
                **head,
                "text": part["text"],
                "logprobs": part["logprobs"],
            }
            item["status"] = status
        return [
            done,
            {"type": "response.content_part.done", **head, "part": _copy(part)},
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """(an event holds the item as it is now, not the object that goes on growing)"""
    return copy.deepcopy(obj)


def usage(
    prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_body(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    *,
    output: list[dict[str, Any]],
    in_progress: bool = False,
    usage: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    error: P.APIError | None = None,
) -> dict[str, Any]:
    """The response object. Its status is "in_progress" (a stream's first events), else from the
    answer's `finish_reason`: cut by max_output_tokens is "incomplete", ended by the server
    (shutdown) "failed", any other end "completed"; "failed" with `error`."""
    incomplete = None
    status = "in_progress"
    # (OpenAI's codes of a failed response: the engine's failures are the server's)
    failure = None if error is None else {"code": "server_error", "message": error.message}
    if not in_progress and failure is None:
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish_reason == "abort":
            failure = {
                "code": "server_error",
                "message": "the server ended the request before its answer was done",
            }
        else:
            status = "completed"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "failed" if failure is not None else status,
        "error": failure,
        "incomplete_details": incomplete,
        "output": output,
        "usage": usage,
        **req.echo,
    }


def assistant_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The answer as the chat message a later turn's conversation holds."""
    # (an answer that is reasoning alone is an empty turn, as its reasoning item sent back reads)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content is not None or calls else ""}
    if calls:
        msg["tool_calls"] = [c.to_json() for c in calls]
    return msg
