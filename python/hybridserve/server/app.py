"""The aiohttp application: OpenAI-compatible routes over an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (and their /render), POST /v1/responses,
GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items (responses.py), GET
/v1/models[/{id}], GET /health,
GET /metrics, GET /openapi.json (openapi.py), and vLLM's tokenizer routes POST /tokenize, POST
/detokenize, GET /tokenizer_info. Every request is validated (protocol.py) before anything reaches
the engine; each choice of a request is one engine request whose outputs reach
the handler through an asyncio queue; a client that goes away (the handler is cancelled, or a
write fails) aborts its engine requests at once. The engine may be attached after the server
starts listening (`set_engine`), so /health answers 503 while the model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError

from hybridserve.arg_types import role_name
from hybridserve.engine.chat_template import ChatTemplate, encode_rendered
from hybridserve.engine.output_sink import OutputSink
from hybridserve.engine.outputs import RequestMetrics, RequestOutput
from hybridserve.engine.protocol import EngineClient, ServedModel
from hybridserve.errors import EngineDeadError, InvalidRequestError
from hybridserve.server import openapi, sse
from hybridserve.server import protocol as P
from hybridserve.server import responses as R
from hybridserve.server.access import AccessPolicy
from hybridserve.server.beam_route import run_beam_search
from hybridserve.server.metrics import CONTENT_TYPE, ServerMetrics
from hybridserve.server.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_format, split_reasoning
from hybridserve.server.request_log import (
    CLIENT_CLOSED,
    CLIENT_REQUEST_ID_KEY,
    RECORD_KEY,
    REQUEST_ID_KEY,
    REQUESTS_LOGGER,
    RequestRecord,
    access_log_middleware,
    log_engine_stats,
    output_line,
    printable,
    request_line,
)
from hybridserve.server.tools import TOOL_PARSERS, ToolCallStream, split_message, tool_call_deltas

logger = logging.getLogger("hybridserve.server")

DEFAULT_MAX_QUEUE_LEN = 512
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 5.0
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
DEFAULT_STREAM_WRITE_TIMEOUT_S = 60.0
DEFAULT_LOG_STATS_INTERVAL_S = 10.0  # vLLM's
# How the server treats a request's `priority` (`create_app`): vLLM's --scheduling-policy values
SCHEDULING_POLICIES = ("fcfs", "priority")
RETRY_AFTER_S = 1
# vLLM's request id header: a generation answer's id is the client's value after the route's
# prefix, and the answer carries the header back (the client's value, or the new id)
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 256
_ABORTED = object()  # sink marker: the server aborted this choice


class EngineModelInfo:
    """protocol.ModelInfo over the engine: tokenizer, vocabulary size, context length, chat template."""

    def __init__(
        self,
        engine: ServedModel,
        chat_template: ChatTemplate | None = None,
        *,
        trust_request_chat_template: bool = False,
        tool_call_parser: str = "hermes",
        tokens_as_ids: bool = False,
        response_role: str = "assistant",
    ) -> None:
        self.tokenizer = engine.tokenizer
        # --response-role: an earlier answer sent back in a conversation carries it
        self._response_role = response_role
        # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" unless a request says
        self.tokens_as_ids = tokens_as_ids
        # --tool-call-parser: the format tools are described in and calls are read in (tools.py)
        self.tool_call_parser = tool_call_parser
        # a request's own `chat_template` is rendered (protocol._request_template), else refused
        self.trust_request_chat_template = trust_request_chat_template
        self._max_model_len = int(engine.max_model_len)
        self._vocab_size = int(engine.vocab_size)
        self._max_logprobs = int(engine.max_logprobs)
        self._sampling_defaults = dict(engine.default_sampling)
        if chat_template is None:  # (the tokenizer's: its named templates and special tokens too)
            chat_template = ChatTemplate.from_model_dir(engine.tokenizer_dir)
        self.chat_template = chat_template
        self._token_text_cache: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def added_tokens(self) -> Mapping[str, int]:
        """The tokenizer's added tokens by their text (a tool-call format's tags among them)."""
        return self.tokenizer.added_token_ids

    def is_special(self, token_id: int) -> bool:
        """Whether decoding with skip_special_tokens leaves the token out."""
        return bool(self.tokenizer.is_special(token_id))

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @property
    def max_logprobs(self) -> int:
        return self._max_logprobs

    @property
    def response_role(self) -> str:
        return self._response_role

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        return self._sampling_defaults

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return self.tokenizer.encode_many(texts, add_special_tokens=add_special_tokens)

    def min_tokens(self, text: str) -> int:
        return self.tokenizer.min_tokens(text)

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
        text = (template or self.chat_template).render(
            messages,
            add_generation_prompt=add_generation_prompt,
            extra=template_kwargs,
            continue_final_message=continue_final_message,
        )
        if refuse is not None:
            refuse(text)
        return encode_rendered(self.tokenizer, text, add_special_tokens=add_special_tokens)

    def token_text(self, token_id: int) -> str:
        s = self._token_text_cache.get(token_id)
        if s is None:
            try:
                s = self.tokenizer.token_to_text(token_id)
            except Exception:  # an id outside the vocabulary: no label rather than a failed response
                s = ""
            if len(self._token_text_cache) < 200_000:
                self._token_text_cache[token_id] = s
        return s

    def token_bytes(self, token_id: int, first: bool = False) -> bytes:
        """The bytes a token adds to the text (chat logprobs' `bytes`; a piece of a character
        included); `first`: to a text it begins (Tokenizer.token_bytes)."""
        try:
            return self.tokenizer.token_bytes(token_id, first=first)
        except Exception:
            return self.token_text(token_id).encode("utf-8")

    def text_bytes(self, token_id: int, skip_special_tokens: bool, first: bool = False) -> bytes:
        """What a token adds to the decoded text: nothing for a special token that is skipped
        (`first`: a token that begins the text)."""
        if skip_special_tokens and self.tokenizer.is_special(token_id):
            return b""
        return self.token_bytes(token_id, first=first)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def text_offsets(self, text: str, token_ids: list[int]) -> list[int] | None:
        """protocol.ModelInfo.text_offsets: the text's own tokens (`encode` without the
        tokenizer's additions) start where the texts of those before them end, special tokens
        included (the client wrote them); a token the tokenizer added starts at 0 before them and
        at the end after them. None when the tokens' texts do not add up to `text`."""
        own = self.encode(text)
        for k in range(len(token_ids) - len(own) + 1):
            if token_ids[k : k + len(own)] == own:
                offsets = P.TextOffsets(0)
                starts = [offsets.advance(self.token_bytes(t, first=i == 0)) for i, t in enumerate(own)]
                if offsets.offset != len(text):
                    return None
                return [0] * k + starts + [len(text)] * (len(token_ids) - k - len(own))
        return None

    def token_piece(self, token_id: int) -> str:
        """A token's vocabulary entry (e.g. "\u0120world" in byte-level BPE): vLLM's `token_strs`
        (transformers' convert_ids_to_tokens)."""
        return self.tokenizer.id_to_token(token_id) or ""

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json without file
        paths, each special token as its text), its class, and the chat template this server
        renders with. bos_token, eos_token and pad_token are always there (null when the model has
        none): lm-evaluation-harness takes a server without `eos_token` for one without a tokenizer."""
        info = {
            k: _token_texts(v)
            for k, v in self.tokenizer.config.items()
            if k not in ("vocab_file", "merges_file")
        }
        for key in ("bos_token", "eos_token", "pad_token"):
            v = info.get(key)
            info[key] = v if isinstance(v, str) else None
        if not isinstance(info.get("tokenizer_class"), str):
            info["tokenizer_class"] = "PreTrainedTokenizerFast"  # what transformers loads tokenizer.json as
        info["chat_template"] = self.chat_template.source
        return info


_ADDED_TOKEN_KEYS = {"__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"}


def _token_texts(v: Any) -> Any:
    """A tokenizer_config.json value with every AddedToken ({"content": ..., "special": ...}) as its
    text, as vLLM's tokenizer_info writes transformers' AddedToken objects."""
    if isinstance(v, dict):
        if isinstance(v.get("content"), str) and set(v) <= _ADDED_TOKEN_KEYS:
            return v["content"]
        return {k: _token_texts(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_token_texts(x) for x in v]
    return v


@dataclass
class ServerState:
    served_model_name: str  # the name answers carry (the first --served-model-name)
    api_key: str | None
    max_queue_len: int
    shutdown_grace_s: float
    metrics: ServerMetrics
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    # seconds a stream's write may wait for a client that takes nothing (0: no limit)
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S
    access: AccessPolicy = field(default_factory=AccessPolicy)
    # unknown request fields: a 400 (True) or ignored with a logged warning (False, as vLLM)
    strict_request_fields: bool = False
    # "fcfs": a request's non-zero `priority` is refused; "priority": the engine schedules by it
    scheduling_policy: str = "fcfs"
    # --reasoning-parser: chat answers split into reasoning and content (reasoning.py)
    reasoning: ReasoningFormat | None = None
    # --trust-request-chat-template: a request's own `chat_template` is rendered, not refused
    trust_request_chat_template: bool = False
    tool_call_parser: str = "hermes"  # --tool-call-parser, a tools.TOOL_PARSERS name
    log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S  # 0: no periodic engine line
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids
    # the other --served-model-name names: requests may name the model so too (as vLLM)
    model_aliases: tuple[str, ...] = ()
    # --enable-log-requests: a line per generation request's prompt and parameters, the prompt cut
    # to --max-log-len characters (or ids) when that is given
    log_requests: bool = False
    max_log_len: int | None = None
    # --enable-log-outputs: a line per finished choice with its text (cut to --max-log-len)
    log_outputs: bool = False
    # --response-role: the role of a chat answer (one with add_generation_prompt false answers in
    # its last message's, as vLLM's)
    response_role: str = "assistant"
    # --enable-force-include-usage: every streamed completion and chat answer ends with its usage
    force_include_usage: bool = False
    stats_task: asyncio.Task[None] | None = None
    engine: EngineClient | None = None
    info: EngineModelInfo | None = None
    load_error: str | None = None
    draining: bool = False
    drained: bool = False  # drain() has run (it runs once)
    created: int = field(default_factory=lambda: int(time.time()))
    inflight: set[str] = field(default_factory=set)
    # engine request id -> ends its stream with finish_reason "abort" (used at shutdown)
    aborters: dict[str, Callable[[], None]] = field(default_factory=dict)
    idle: asyncio.Event | None = None
    # /v1/responses: the responses kept for `previous_response_id` and GET /v1/responses/{id}
    responses: R.ResponseStore = field(default_factory=R.ResponseStore)

    def engine_stats(self) -> dict[str, Any] | None:
        return self.engine.stats() if self.engine is not None else None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and self.info is not None

    def admit(self, ids: list[str]) -> None:
        self.inflight.update(ids)
        self.metrics.inflight.set(len(self.inflight))
        if self.idle is not None:
            self.idle.clear()

    def release(self, engine_id: str) -> None:
        self.inflight.discard(engine_id)
        self.metrics.inflight.set(len(self.inflight))
        if not self.inflight and self.idle is not None:
            self.idle.set()


STATE = web.AppKey("hybridserve_state", ServerState)


def create_app(
    engine: EngineClient | None,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    chat_template: ChatTemplate | None = None,
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S,
    access: AccessPolicy | None = None,
    strict_request_fields: bool = False,
    access_log: bool = True,
    log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S,
    scheduling_policy: str = "fcfs",
    reasoning_parser: str | None = None,
    trust_request_chat_template: bool = False,
    tool_call_parser: str = "hermes",
    responses_store_bytes: int = R.DEFAULT_STORE_BYTES,
    log_requests: bool = False,
    max_log_len: int | None = None,
    model_aliases: Sequence[str] = (),
    return_tokens_as_token_ids: bool = False,
    response_role: str = "assistant",
    force_include_usage: bool = False,
    log_outputs: bool = False,
) -> web.Application:
    """The OpenAI-compatible app. `engine` may be None while the model loads (then /health is
    503 and generation routes answer 503); attach it later with `set_engine`. `access`: the Host
    and Origin rules (default: no Host check, no origin allowed). `strict_request_fields`: an
    unknown request field is a 400 instead of a logged warning. `access_log`: a line per request
    (request_log.py). `log_stats_interval_s`: seconds between the engine lines (0: none).
    `scheduling_policy`: "priority" passes each request's `priority` to the engine; "fcfs" (as
    vLLM's default) refuses a non-zero one, so that no client moves ahead of the others unless
    the operator allows it. `reasoning_parser`: a `reasoning.REASONING_PARSERS` name, whose split
    chat answers get (None: answers are whole). `trust_request_chat_template`: a request's own
    `chat_template` is rendered (a template is code that runs here: for clients the operator
    trusts), else refused, as vLLM's flag of that name. `tool_call_parser`: a
    `tools.TOOL_PARSERS` name, the format of tool calls. `responses_store_bytes`: the memory of
    the responses /v1/responses keeps (0: none). `log_requests`: a line per generation request
    with its prompt (cut to `max_log_len` characters or ids) and parameters. `model_aliases`: more
    names requests may give the model by; answers carry `served_model_name`.
    `return_tokens_as_token_ids`: logprobs name tokens "token_id:N" unless a request says not.
    `response_role`: the role of chat answers. `force_include_usage`: streamed completion and chat
    answers end with a usage chunk whatever their `stream_options` say. `log_outputs`: a line
    per finished choice with its text (cut to `max_log_len` characters)."""
    try:
        role_name(response_role)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"response_role: {e}") from None
    if tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy: one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
    state_holder: dict[str, ServerState] = {}
    metrics = ServerMetrics(lambda: state_holder["s"].engine_stats(), served_model_name)
    state = ServerState(
        served_model_name=served_model_name,
        api_key=api_key or None,
        max_queue_len=max_queue_len,
        shutdown_grace_s=shutdown_grace_s,
        metrics=metrics,
        body_read_timeout_s=body_read_timeout_s,
        stream_write_timeout_s=stream_write_timeout_s,
        access=access or AccessPolicy(),
        strict_request_fields=strict_request_fields,
        scheduling_policy=scheduling_policy,
        reasoning=None if reasoning_parser is None else reasoning_format(reasoning_parser),
        trust_request_chat_template=trust_request_chat_template,
        tool_call_parser=tool_call_parser,
        log_stats_interval_s=log_stats_interval_s,
        responses=R.ResponseStore(max_bytes=responses_store_bytes),
        log_requests=log_requests,
        max_log_len=max_log_len,
        model_aliases=tuple(a for a in dict.fromkeys(model_aliases) if a != served_model_name),
        tokens_as_ids=return_tokens_as_token_ids,
        response_role=response_role,
        force_include_usage=force_include_usage,
        log_outputs=log_outputs,
    )
    state_holder["s"] = state
    middlewares = [_error_middleware, _access_middleware, _auth_middleware]
    if access_log:  # outermost: it sees the status the error middleware answers with
        middlewares.insert(0, access_log_middleware)
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[STATE] = state
    app.router.add_post("/v1/completions", _completions, expect_handler=_expect_handler)
    app.router.add_post("/v1/chat/completions", _chat_completions, expect_handler=_expect_handler)
    app.router.add_post("/v1/responses", _responses, expect_handler=_expect_handler)
    app.router.add_get("/v1/responses/{response_id}", _get_response)
    app.router.add_delete("/v1/responses/{response_id}", _delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", _response_input_items)
    app.router.add_get("/v1/models", _models)
    # (any characters: the served name defaults to MODEL as given, which may be a path)
    app.router.add_get("/v1/models/{model_id:.+}", _model)
    app.router.add_get("/health", _health)
    # vLLM's other liveness routes: /ping (SageMaker's, GET and POST) answers as /health does
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    # vLLM's tokenizer routes (not under /v1, so without the API key, as vLLM's)
    app.router.add_post("/v1/completions/render", _completions_render, expect_handler=_expect_handler)
    app.router.add_post("/v1/chat/completions/render", _chat_render, expect_handler=_expect_handler)
    app.router.add_post("/tokenize", _tokenize, expect_handler=_expect_handler)
    app.router.add_post("/detokenize", _detokenize, expect_handler=_expect_handler)
    app.router.add_get("/tokenizer_info", _tokenizer_info)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    app.on_response_prepare.append(_response_headers)
    if engine is not None:
        set_engine(app, engine, chat_template=chat_template)
    return app


def set_engine(
    app: web.Application, engine: EngineClient, *, chat_template: ChatTemplate | None = None
) -> None:
    """Attach a loaded engine; from now on /health is 200 (while engine.ready)."""
    state = app[STATE]
    state.info = EngineModelInfo(
        engine,
        chat_template,
        trust_request_chat_template=state.trust_request_chat_template,
        tool_call_parser=state.tool_call_parser,
        tokens_as_ids=state.tokens_as_ids,
        response_role=state.response_role,
    )
    state.engine = engine
    state.metrics.ready.set(1)


def set_load_error(app: web.Application, message: str) -> None:
    app[STATE].load_error = message


async def _on_startup(app: web.Application) -> None:
    state = app[STATE]
    state.idle = asyncio.Event()
    state.idle.set()
    if state.log_stats_interval_s > 0:
        state.stats_task = asyncio.create_task(
            log_engine_stats(state.engine_stats, state.log_stats_interval_s)
        )


async def _on_cleanup(app: web.Application) -> None:
    task = app[STATE].stats_task
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _on_shutdown(app: web.Application) -> None:
    await drain(app)


async def drain(app: web.Application) -> None:
    """Stop admitting, let in-flight requests finish for the grace period, abort the rest. The
    server's CLI calls it while the listener is still open, so that new connections get 503
    (and /health "shutting_down") during the drain; the app's on_shutdown calls it too (a no-op
    after the first time)."""
    state = app[STATE]
    if state.drained:
        return
    state.drained = True
    state.draining = True
    idle = state.idle
    if idle is None or not state.inflight:
        return
    logger.info(
        "shutdown: waiting up to %.1fs for %d in-flight requests", state.shutdown_grace_s, len(state.inflight)
    )
    try:
        await asyncio.wait_for(idle.wait(), timeout=state.shutdown_grace_s)
        return
    except TimeoutError:
        pass
    logger.info("shutdown: aborting %d in-flight requests", len(state.inflight))
    for rid in list(state.inflight):
        end_stream = state.aborters.get(rid)
        if end_stream is not None:
            end_stream()
        await _abort(state, rid)
    try:
        await asyncio.wait_for(idle.wait(), timeout=10.0)
    except TimeoutError:
        logger.warning("shutdown: %d requests did not finish after abort", len(state.inflight))


# ---------------------------------------------------------------------------------------------
# Middlewares


def json_error(err: P.APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


_HTTP_ERROR_TYPES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
}


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    metrics = request.app[STATE].metrics
    error: tuple[str | None, str | None, str] | None = None  # (param, code, message) of an error answer
    try:
        resp = await handler(request)
    except P.APIError as e:
        resp = json_error(e)
        error = (e.param, e.code, e.message)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        etype, code = _HTTP_ERROR_TYPES.get(e.status, ("invalid_request_error", None))
        message = e.text or e.reason
        if e.status == 413:
            message = f"the request body exceeds the limit of {request.app._client_max_size} bytes"
        elif e.status == 404:
            message = f"no route for {request.method} {request.path}"
        resp = web.json_response(P.error_body(message, type=etype, code=code), status=e.status)
        error = (None, code, message)
        if e.status == 405 and "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("internal error on %s %s", request.method, request.path)
        resp = web.json_response(
            P.error_body("internal server error", type="internal_error", code="internal_error"), status=500
        )
    if resp.status == CLIENT_CLOSED:  # nobody is there to answer
        return resp
    if resp.status >= 400 and request.path not in _LIVENESS_PATHS:  # (their 503 is an answer)
        metrics.http_errors.labels(status=str(resp.status)).inc()
    if error is not None and 400 <= resp.status < 500:
        log_client_error(request, resp.status, *error)
    if resp.status >= 400 and request.headers.get("Content-Encoding", "").strip().lower() in _DECODED:
        # aiohttp decodes such a body as it reads it, and also the rest of one it discards after an
        # answer given before reading it; a body that does not decode makes it close the connection
        # after the answer. Say so (Connection: close), or the client sends its next request into
        # a closed connection.
        resp.force_close()
    return resp


def log_client_error(
    request: web.BaseRequest, status: int, param: str | None, code: str | None, message: str
) -> None:
    """One line per 4xx answer, naming the field and the code: why a client's request failed,
    without a packet capture."""
    logger.info(
        '%s "%s %s" %d: param=%s code=%s: %s',
        request.remote or "-",
        request.method,
        printable(request.raw_path),
        status,
        printable(param or "-", 100),
        code or "-",
        printable(message, 300),
    )


@web.middleware
async def _access_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The Host and Origin checks (access.py), before anything else reads the request; and the
    answer to an allowed origin's CORS preflight (no route has OPTIONS)."""
    access = request.app[STATE].access
    refused = access.refusal(request.headers)
    if refused is not None:
        raise refused
    if access.is_preflight(request.method, request.headers):
        return web.Response(status=204, headers=access.preflight_headers(request.headers))
    return await handler(request)


async def _response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Set just before the headers go out, rather than by each handler, so that streamed answers
    and errors get them too: the CORS headers an allowed origin needs to read the answer, and the
    request id (the client's X-Request-Id, or a generation answer's new id)."""
    response.headers.update(request.app[STATE].access.cors_headers(request.headers))
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is not None and _request_id_ok(given):
        response.headers[REQUEST_ID_HEADER] = given
    elif isinstance(request.get(REQUEST_ID_KEY), str):
        response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID_KEY]


def _request_id_ok(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and value.isascii() and value.isprintable()


def _request_id(request: web.Request, prefix: str, *, from_header: bool = True) -> str:
    """A generation answer's id: the route's prefix and the client's X-Request-Id (as vLLM), or
    a new one (always, where not `from_header`). The engine's ids of its choices stay unique
    either way (`_generate`)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is not None and not _request_id_ok(given):
        raise P.APIError(
            f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters",
            param=REQUEST_ID_HEADER,
            code="invalid_value",
        )
    request_id = f"{prefix}{given if given is not None and from_header else uuid.uuid4().hex}"
    request[REQUEST_ID_KEY] = request_id
    if given is not None and not from_header:  # (the access line still names it)
        request[CLIENT_REQUEST_ID_KEY] = given
    return request_id


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key is not None and request.path.startswith("/v1"):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        # aiohttp keeps a header's non-UTF-8 bytes as surrogate escapes: compare the raw bytes
        sent = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, key.encode()):
            raise P.APIError(
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                status=401,
                type="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


# ---------------------------------------------------------------------------------------------
# Simple routes


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "shutting_down"}, status=503)
    if state.load_error is not None:
        return web.json_response({"status": "error", "message": state.load_error}, status=503)
    if not state.ready:
        return web.json_response({"status": "loading"}, status=503, headers={"Retry-After": "5"})
    return web.json_response({"status": "ok"})


_LIVENESS_PATHS = frozenset({"/health", "/ping"})


async def _version(request: web.Request) -> web.Response:
    from hybridserve import __version__

    return web.json_response({"version": __version__})


async def _openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.info  # None while the model loads: its limits are left out until it is loaded
    doc = openapi.document(
        served_model_name=state.served_model_name,
        model_aliases=state.model_aliases,
        max_model_len=info.max_model_len if info is not None else None,
        vocab_size=info.vocab_size if info is not None else None,
        max_logprobs=info.max_logprobs if info is not None else None,
        response_role=state.response_role,
        api_key_required=state.api_key is not None,
        strict_request_fields=state.strict_request_fields,
        trust_request_chat_template=state.trust_request_chat_template,
    )
    return web.json_response(doc)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "hybridserve",
    }
    if state.info is not None:
        card["max_model_len"] = state.info.max_model_len
    return card


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = (state.served_model_name, *state.model_aliases)
    return web.json_response({"object": "list", "data": [_model_card(state, n) for n in names]})


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    # (a served name that is an absolute path: URL libraries merge the "//" of /v1/models//path)
    name = next(
        (
            n
            for n in (state.served_model_name, *state.model_aliases)
            if model_id == n or (n.startswith("/") and model_id == n.lstrip("/"))
        ),
        None,
    )
    if name is None:
        raise P.not_found(f"the model {model_id!r} does not exist", "model", "model_not_found")
    return web.json_response(_model_card(state, name))


# ---------------------------------------------------------------------------------------------
# Generation


def _refuse_if_draining(state: ServerState) -> None:
    if state.draining:
        raise P.APIError(
            "the server is shutting down", status=503, type="service_unavailable", code="shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip


def _require_engine(state: ServerState) -> tuple[Any, EngineModelInfo]:
    _refuse_if_draining(state)
    if not state.ready or state.info is None:
        raise P.APIError(
            "the model is still loading", status=503, type="service_unavailable", code="model_loading",
            headers={"Retry-After": "5"},
        )  # fmt: skip
    return state.engine, state.info


# Bodies larger than this are decoded and tokenized off the event loop, so that one big prompt
# does not stall the other streams.
_INLINE_PARSE_BYTES = 64 * 1024


async def _expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: a body announced larger than the limit gets its 413 instead of the
    invitation to send it (aiohttp's default handler says 100 Continue to any size). This runs
    before the middlewares, so it answers and counts its errors itself."""
    limit = request.app._client_max_size
    declared = request.content_length
    expect = request.headers.get("Expect", "").lower()
    if expect != "100-continue" or request.version != HttpVersion11:
        err = P.APIError(f"unsupported Expect: {expect!r}", status=417, code="expectation_failed")
    elif declared is not None and declared > limit:
        msg = f"the request body exceeds the limit of {limit} bytes"
        err = P.APIError(msg, status=413, code="request_too_large")
    else:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None
    resp = json_error(err)
    resp.force_close()  # the client may send the body anyway: it is not read
    request.app[STATE].metrics.http_errors.labels(status=str(resp.status)).inc()
    log_client_error(request, err.status, err.param, err.code, err.message)
    return resp


# Content-Encodings of a request body that aiohttp decodes here (it passes a body of any other
# coding through undecoded, and refuses br / zstd itself without their optional packages)
_BODY_CODINGS = ("identity", "gzip", "deflate")
_DECODED = ("gzip", "deflate")  # (those aiohttp's HTTP parser decodes as it reads a body)


def _check_content_type(request: web.Request) -> None:
    """A body is read as JSON only when it says it is JSON (application/json or a ``+json`` type).
    A browser form post (``text/plain`` or form-encoded) and a body without a Content-Type (a
    ``fetch`` with a Blob body, ``navigator.sendBeacon``) are what a page may send without a CORS
    preflight: they are refused instead of being run as a request (the Origin check refuses such
    pages too; this does not depend on the browser sending Origin). A body in a content coding
    the server does not decode is refused too (RFC 9110: 415), instead of being read as if it were
    not encoded."""
    coding = request.headers.get("Content-Encoding")
    if coding is not None and coding.strip().lower() not in ("", *_BODY_CODINGS):
        raise P.APIError(
            f"the Content-Encoding {coding!r} is not supported; send the body uncompressed, or "
            "gzip or deflate encoded",
            status=415,
            code="unsupported_media_type",
        )
    if "Content-Type" not in request.headers:
        if request.body_exists:
            raise P.APIError(
                "the request body has no Content-Type; send it as application/json",
                status=415,
                code="unsupported_media_type",
            )
        return  # no body: the JSON decoding says what is missing
    media = request.content_type  # lower-cased, parameters removed
    main, _, sub = media.partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        raise P.APIError(
            f"the Content-Type {media!r} is not supported; send the body as application/json",
            status=415,
            code="unsupported_media_type",
        )
    charset = request.charset
    if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        raise P.APIError(
            f"the charset {charset!r} is not supported; send the body as application/json in UTF-8",
            status=415,
            code="unsupported_media_type",
        )


class _Parsed(Protocol):
    ignored_fields: list[str]


_R = TypeVar("_R", bound=_Parsed)


async def _parse(
    request: web.Request,
    info: EngineModelInfo,
    served_model_name: str,
    parse: Callable[..., _R],
) -> _R:
    _check_content_type(request)
    declared = request.content_length
    if declared is not None and declared > request.app._client_max_size:
        # refused before reading: a client that announces a huge body gets its 413 at once
        raise web.HTTPRequestEntityTooLarge(max_size=request.app._client_max_size, actual_size=declared)
    timeout = request.app[STATE].body_read_timeout_s
    try:
        # raises HTTPRequestEntityTooLarge beyond client_max_size; a client that stops sending
        # its body mid-way must not hold the connection (and its buffer) forever
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout:g} s") from None
    except RequestPayloadError as e:
        # a body that does not decode as its Content-Encoding or Transfer-Encoding says
        reason = " ".join(str(e).split())
        raise P.APIError(f"the request body could not be read: {reason}", code="bad_request_body") from None
    except ConnectionError:
        # the client went away before its body arrived: nobody reads the answer
        raise _client_gone() from None

    strict = request.app[STATE].strict_request_fields
    aliases = request.app[STATE].model_aliases

    def run() -> _R:
        body = P.decode_json_body(raw)
        if (
            aliases
            and isinstance(body, dict)
            and isinstance(body.get("model"), str)
            and body["model"] in aliases
        ):
            body["model"] = served_model_name  # (another of its names: answers carry the first)
        return parse(body, info, served_model_name, strict=strict)

    # a large body, or any with a client's own chat template allowed (its rendering has no time
    # limit), is parsed off the event loop, so other connections are answered meanwhile
    inline = len(raw) <= _INLINE_PARSE_BYTES and not info.trust_request_chat_template
    parsed = run() if inline else await asyncio.to_thread(run)
    if parsed.ignored_fields:
        # as vLLM: fields of other servers' dialects are ignored, and said so
        logger.warning(
            '%s "%s %s": ignored unknown fields: %s (--strict-request-fields refuses them)',
            request.remote or "-",
            request.method,
            printable(request.raw_path),
            ", ".join(printable(f, 64) for f in parsed.ignored_fields),
        )
    return parsed


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine, info = _require_engine(state)
    request_id = _request_id(request, "cmpl-")
    req = await _parse(request, info, state.served_model_name, P.parse_completion_request)
    _apply_server_options(state, req)
    return await _generate(request, state, engine, info, req, request_id)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine, info = _require_engine(state)
    request_id = _request_id(request, "chatcmpl-")
    req = await _parse(request, info, state.served_model_name, P.parse_chat_request)
    _apply_server_options(state, req)
    _split_reasoning(state, info, req)
    return await _generate(request, state, engine, info, req, request_id)


def _apply_server_options(state: ServerState, req: P.GenerateRequest) -> None:
    """What the server's flags add to a parsed completion or chat request: --response-role, and
    --enable-force-include-usage."""
    if req.stream and state.force_include_usage:
        req.include_usage = True
    if req.kind == "chat" and req.role is None:
        req.role = state.response_role


def _split_reasoning(state: ServerState, info: EngineModelInfo, req: P.GenerateRequest) -> None:
    """With --reasoning-parser, a chat answer that begins in its reasoning is split (and a
    grammar applies to the content after it)."""
    if (
        state.reasoning is not None
        and not req.thinking_disabled
        and not _reasoning_closed(info, req, state.reasoning)
    ):
        so = req.params.structured_outputs
        if so is not None:  # the grammar is the answer's, after the reasoning
            so = dataclasses.replace(so, start_after=state.reasoning.end)
            req.params = dataclasses.replace(req.params, structured_outputs=so)
        req.reasoning = state.reasoning


async def _responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API (responses.py): a chat request, answered as output items."""
    state = request.app[STATE]
    engine, info = _require_engine(state)
    # A kept response is read back by its id, so the id is the server's own, never the client's
    # X-Request-Id (as vLLM's): an id two clients both send would let the later one's answer
    # replace the earlier one's, which then reads a conversation not its own.
    response_id = _request_id(request, "resp_", from_header=False)
    parse = functools.partial(R.parse_responses_request, store=state.responses)
    rreq = await _parse(request, info, state.served_model_name, parse)
    req = rreq.chat
    _split_reasoning(state, info, req)
    if rreq.logprobs and req.reasoning is not None:
        raise P.APIError(
            f"include: {R.LOGPROBS_INCLUDE} is not served with --reasoning-parser (not every token is the message's)",
            param="include",
            code="unsupported_parameter",
        )
    answer = _stream_response if req.stream else _response_json

    async def respond(
        created: int, arrival: float, choices: list[_Choice], sink: _Sink
    ) -> web.StreamResponse:
        return await answer(
            _ResponseRun(request, state, info, rreq, response_id, created, arrival, choices, sink)
        )

    try:
        return await _generate(request, state, engine, info, req, response_id, respond=respond)
    except P.APIError as e:  # (the engine's errors name the chat field, such as response_format)
        raise R.renamed_error(e) from None


def _kept_response(request: web.Request) -> R.KeptResponse:
    """The kept response the path names, or a 404."""
    response_id = request.match_info["response_id"]
    kept = request.app[STATE].responses.get(response_id)
    if kept is None:
        raise P.not_found(
            f"no kept response has the id {printable(response_id, 80)!r}", "response_id", "not_found"
        )
    return kept


async def _get_response(request: web.Request) -> web.Response:
    return web.json_response(_kept_response(request).body, dumps=_dumps)


async def _response_input_items(request: web.Request) -> web.Response:
    page = R.page_of_input_items(_kept_response(request).input_items, request.query)
    return web.json_response(page, dumps=_dumps)


async def _delete_response(request: web.Request) -> web.Response:
    response_id = _kept_response(request).body["id"]
    deleted = request.app[STATE].responses.delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": deleted}, dumps=_dumps)


async def _completions_render(request: web.Request) -> web.Response:
    """vLLM's /v1/completions/render: a completion request's fields checked as /v1/completions
    checks them, answered with each prompt's token ids instead of a generation. Cache-aware routers
    tokenize through it, so they see the tokens the engine will run. A grammar is not compiled here
    (the engine compiles it when the request runs, and refuses it there)."""
    state = request.app[STATE]
    _, info = _require_engine(state)
    req = await _parse(request, info, state.served_model_name, P.parse_completion_request)
    rendered = [
        {"request_id": f"cmpl-{uuid.uuid4().hex}", "model": req.model, "token_ids": p.token_ids}
        for p in req.prompts
    ]
    return web.json_response(rendered, dumps=_dumps)


async def _chat_render(request: web.Request) -> web.Response:
    """vLLM's /v1/chat/completions/render: the chat prompt's token ids (template applied)."""
    state = request.app[STATE]
    _, info = _require_engine(state)
    req = await _parse(request, info, state.served_model_name, P.parse_chat_request)
    rendered = {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "model": req.model,
        "token_ids": req.prompts[0].token_ids,
    }
    return web.json_response(rendered, dumps=_dumps)


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
    state = request.app[STATE]
    _, info = _require_engine(state)
    req = await _parse(request, info, state.served_model_name, P.parse_tokenize_request)
    pieces = [info.token_piece(t) for t in req.token_ids] if req.return_token_strs else None
    return web.json_response(P.tokenize_response(req.token_ids, info.max_model_len, pieces), dumps=_dumps)


async def _detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {prompt}, the text of the ids with their special tokens (as vLLM, so
    that it reverses /tokenize)."""
    state = request.app[STATE]
    _, info = _require_engine(state)
    req = await _parse(request, info, state.served_model_name, P.parse_detokenize_request)
    text = info.decode(req.token_ids, skip_special_tokens=False)
    return web.json_response({"prompt": text}, dumps=_dumps)


async def _tokenizer_info(request: web.Request) -> web.Response:
    _, info = _require_engine(request.app[STATE])
    return web.json_response(info.tokenizer_info(), dumps=_dumps)


@dataclass
class _Choice:
    index: int
    engine_id: str
    prompt: P.PromptInput
    request_id: str = ""  # the answer's id (the access and request log lines')
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    done: bool = False
    engine_finished: bool = False
    started_stream: bool = False
    # chat with tools: the content and calls of the stream settled so far (tools.py)
    tools: ToolCallStream | None = None
    # chat with a reasoning parser: the stream's split so far (reasoning.py)
    reasoning: ReasoningSplitter | None = None
    # completions logprobs: where the next token starts in the text, across stream deltas
    offsets: P.TextOffsets = field(default_factory=P.TextOffsets)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # the prompt's logprobs, when the engine computed them (echo + logprobs, prompt_logprobs)
    prompt_logprobs: list[Any] | None = None


@dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None
    finished: bool
    phases: RequestMetrics | None = None  # the engine's times, on the finished output


def _apply_output(choice: _Choice, out: RequestOutput) -> _Delta:
    """Fold one RequestOutput into the choice; returns what is new (the output's delta fields)."""
    co = out.outputs[0]
    new_ids = list(co.delta_token_ids)
    new_text = co.delta_text
    new_lps: list[Any] | None = None
    if co.logprobs is not None:
        # the output's logprobs are cumulative: this delta's are those after the ones already seen
        start = len(choice.logprobs)
        new_lps = list(co.logprobs[start : start + len(new_ids)])
        choice.logprobs.extend(new_lps)
    choice.token_ids.extend(new_ids)
    choice.text += new_text
    choice.num_cached_tokens = out.num_cached_tokens
    if choice.prompt_logprobs is None and out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    finished = out.finished
    if finished:
        choice.finish_reason = co.finish_reason or "stop"
        choice.stop_reason = co.stop_reason
    return _Delta(new_text, new_ids, new_lps, finished, out.metrics)


async def _abort(state: ServerState, engine_id: str) -> None:
    engine = state.engine
    if engine is None:
        return
    try:
        await engine.abort(engine_id)
    except Exception:
        logger.exception("abort of %s failed", engine_id)


# a choice's outputs on their way to the handler: an output, an engine error, _ABORTED, or None
# when its engine stream ended
_Sink = OutputSink["_Choice"]
# how a handler answers from its choices' outputs: (created, arrival, choices, sink) -> response
_Responder = Callable[[int, float, list["_Choice"], _Sink], Awaitable[web.StreamResponse]]


async def _generate(
    request: web.Request,
    state: ServerState,
    engine: EngineClient,
    info: EngineModelInfo,
    req: P.GenerateRequest,
    request_id: str,
    respond: _Responder | None = None,
) -> web.StreamResponse:
    """Run the request's choices on the engine and answer with `respond` (default: the
    completion or chat response, streamed or not); the choices are aborted and released
    however the answer ends."""
    arrival = time.monotonic()
    created = int(time.time())
    if req.priority != 0 and state.scheduling_policy != "priority":
        raise P.APIError(
            f"priority: this server schedules first come, first served; a priority ({req.priority}) "
            "needs --scheduling-policy priority",
            param="priority",
            code="invalid_value",
        )
    n = req.params.n
    # (a client's X-Request-Id may come with more than one request at once: the engine's ids get
    # a part of their own)
    base = (
        request_id
        if request.headers.get(REQUEST_ID_HEADER) is None
        else f"{request_id}-{uuid.uuid4().hex[:12]}"
    )
    choices = [
        _Choice(index=i, engine_id=f"{base}-{i}", prompt=req.prompts[i // n], request_id=request_id)
        for i in range(req.num_sequences)
    ]
    if len(choices) > state.max_queue_len:  # could never be admitted
        raise P.APIError(
            f"n: the request asks for {len(choices)} sequences, more than this server admits at once ({state.max_queue_len})",
            param="n",
            code="invalid_value",
        )
    # Admission: counted synchronously, so concurrent handlers cannot overshoot the limit. A drain
    # may have begun while the body was read (a request's route checked before it): it must not
    # admit a request after it took its count of those in flight.
    _refuse_if_draining(state)
    if len(state.inflight) + len(choices) > state.max_queue_len:
        stats = engine.stats()
        raise P.APIError(
            f"the server queue is full: {len(state.inflight)} sequences in flight, the limit "
            f"(--max-queue-len) is {state.max_queue_len}; the engine runs {stats.get('max_num_seqs', '?')} "
            "at once (its Mamba state pool has room for "
            f"{stats.get('mamba_state_capacity_seqs', '?')}) and the rest wait; retry later",
            status=503,
            type="service_unavailable",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if state.log_requests:
        for i, prompt in enumerate(req.prompts):
            rid = request_id if len(req.prompts) == 1 else f"{request_id}[{i}]"
            REQUESTS_LOGGER.info(
                "%s",
                request_line(
                    rid, prompt.text, prompt.token_ids, req.choice_params(i * req.params.n), state.max_log_len
                ),
            )
    if req.beam is not None and respond is None:  # (the Responses route passes no beam search)
        return await _beam_answer(request, state, engine, info, req, request_id, base, created, arrival)
    state.admit([c.engine_id for c in choices])
    sink: _Sink = OutputSink()

    async def run_one(choice: _Choice) -> None:
        try:
            async for out in engine.generate(
                choice.prompt.token_ids,
                req.choice_params(choice.index),
                choice.engine_id,
                cache_salt=req.cache_salt,
                priority=req.priority,
            ):
                sink.put_nowait((choice, out))
                if out.finished:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:
            sink.put_nowait((choice, e))
        finally:
            sink.put_nowait((choice, None))

    def aborter(choice: _Choice) -> Callable[[], None]:
        return lambda: sink.put_nowait((choice, _ABORTED))

    for c in choices:
        state.aborters[c.engine_id] = aborter(c)
    tasks = [asyncio.create_task(run_one(c)) for c in choices]
    ended_by = "abort"  # the client went away (the handler is cancelled)
    try:
        if req.stream:
            try:
                if respond is not None:
                    return await respond(created, arrival, choices, sink)
                return await _stream(request, state, info, req, request_id, created, arrival, choices, sink)
            except ConnectionError:
                # the client closed the connection before aiohttp cancelled the handler (a write
                # to the closing transport raises first): as a client that leaves at any other
                # moment
                raise _client_gone() from None
        if respond is not None:
            return await respond(created, arrival, choices, sink)
        return await _collect(state, info, req, request_id, created, arrival, choices, sink)
    except P.APIError as e:
        if e.status != CLIENT_CLOSED:
            ended_by = "error"  # the engine failed the request
        raise
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for c in choices:
            state.aborters.pop(c.engine_id, None)
            if not c.engine_finished:
                await _abort(state, c.engine_id)
            if not c.done:  # it ends here, without a finished output
                state.metrics.requests_finished.inc(ended_by)
            state.release(c.engine_id)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        request[RECORD_KEY] = _record(req, choices, arrival)


def _record(req: P.GenerateRequest, choices: list[_Choice], arrival: float) -> RequestRecord:
    """The request's figures for its access line (request_log.py)."""
    usage = _usage(req, choices)
    firsts = [c.first_token_time for c in choices if c.first_token_time is not None]
    return RequestRecord(
        prompt_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        ttft_s=min(firsts) - arrival if firsts else None,
    )


def _error_param(message: str) -> str | None:
    """The field an engine's InvalidRequestError names first ("response_format: ...")."""
    head, sep, _ = message.partition(": ")
    return head if sep and head.replace("_", "").replace(".", "").isalnum() else None


def _engine_error(e: BaseException) -> P.APIError:
    if isinstance(e, InvalidRequestError):
        return P.APIError(str(e), status=400, param=_error_param(str(e)), code="invalid_value")
    if isinstance(e, EngineDeadError):
        return P.APIError(
            f"the engine is not running: {e}", status=503, type="service_unavailable", code="engine_dead"
        )
    logger.error("engine error: %r", e)
    return P.APIError(f"engine error: {e}", status=500, type="internal_error", code="internal_error")


def _observe(state: ServerState, choice: _Choice, delta: _Delta, arrival: float) -> None:
    m = state.metrics
    if delta.token_ids:
        now = time.monotonic()
        if choice.last_token_time is None:
            choice.first_token_time = now
            m.time_to_first_token.observe(now - arrival)
            rest = len(delta.token_ids) - 1
            prev = now
        else:
            rest = len(delta.token_ids)
            prev = choice.last_token_time
        for _ in range(rest):
            m.inter_token_latency.observe((now - prev) / max(rest, 1))
        choice.last_token_time = now
    if delta.finished:
        m.e2e_latency.observe(time.monotonic() - arrival)
        m.requests_finished.inc(choice.finish_reason or "stop")
        m.observe_finished(delta.phases, len(choice.prompt.token_ids), len(choice.token_ids))


def _usage(req: P.GenerateRequest, choices: list[_Choice]) -> dict[str, Any]:
    n = req.params.n
    prompt_tokens = sum(len(p.token_ids) for p in req.prompts)
    cached = sum(choices[i * n].num_cached_tokens for i in range(len(req.prompts)))
    return P.usage_dict(prompt_tokens, sum(len(c.token_ids) for c in choices), cached)


def _choice_usage(choice: _Choice) -> dict[str, Any]:
    return P.usage_dict(len(choice.prompt.token_ids), len(choice.token_ids), choice.num_cached_tokens)


def _as_ids(req: P.GenerateRequest, info: EngineModelInfo) -> bool:
    """Whether the request's logprobs name tokens "token_id:N" (its field, else the server's flag)."""
    return info.tokens_as_ids if req.tokens_as_ids is None else req.tokens_as_ids


def _logprobs_json(
    req: P.GenerateRequest,
    info: EngineModelInfo,
    entries: list[Any],
    ids: list[int],
    offsets: P.TextOffsets,
) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    as_ids = _as_ids(req, info)
    if req.kind == "completion":
        skip = req.params.skip_special_tokens
        return P.completion_logprobs(
            entries,
            ids,
            info.token_text,
            offsets,
            text_bytes=lambda t: info.text_bytes(t, skip),
            as_ids=as_ids,
        )
    return P.chat_logprobs(
        entries, ids, info.token_text, req.logprobs, token_bytes=info.token_bytes, as_ids=as_ids
    )


def _echo_logprobs_json(
    req: P.GenerateRequest, info: EngineModelInfo, choice: _Choice
) -> dict[str, Any] | None:
    """The echoed prompt's part of a completion's logprobs (echo + logprobs), in the shape the
    evaluation harnesses read: the first token has no logprob (`null`), then one per token. The
    offsets index the echoed text (`_echo_text`): a text prompt is echoed as the client wrote it,
    special tokens included, so its offsets are the parser's (`PromptInput.text_offsets`)."""
    if not (req.echo and req.logprobs is not None) or choice.prompt_logprobs is None:
        return None
    skip = req.params.skip_special_tokens
    prompt = choice.prompt
    entries = [
        P.top_n_entry(e, tid, req.logprobs) if e is not None else {}
        for e, tid in zip(choice.prompt_logprobs, prompt.token_ids)
    ]
    began = False

    def echoed_bytes(t: int) -> bytes:
        # (the first token the echoed text is decoded from, a skipped special token not counted,
        # is decoded as a text's first: a decoder that drops a text's first space drops it there)
        nonlocal began
        if skip and info.tokenizer.is_special(t):
            return b""
        out = info.token_bytes(t, first=not began)
        began = True
        return out

    out = P.completion_logprobs(
        entries,
        prompt.token_ids,
        info.token_text,
        P.TextOffsets(0),
        text_bytes=echoed_bytes,
        as_ids=_as_ids(req, info),
    )
    if prompt.text_offsets is not None:
        out["text_offset"] = list(prompt.text_offsets)
    out["token_logprobs"][0] = None
    out["top_logprobs"][0] = None
    return out


def _join_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    if first is None or then is None:
        return first if then is None else then
    return {k: [*first[k], *then[k]] for k in first}


def _vllm_prompt_logprobs(req: P.GenerateRequest, info: EngineModelInfo, choice: _Choice) -> list[Any] | None:
    if req.prompt_logprobs is None or choice.prompt_logprobs is None:
        return None
    n = req.prompt_logprobs
    entries = [
        P.top_n_entry(e, tid, n) if e is not None else None
        for e, tid in zip(choice.prompt_logprobs, choice.prompt.token_ids)
    ]
    return P.vllm_prompt_logprobs(entries, info.token_text, _as_ids(req, info))


async def _deltas(
    state: ServerState, choices: list[_Choice], sink: _Sink, arrival: float
) -> AsyncIterator[tuple[_Choice, _Delta]]:
    """What is new for each choice, in arrival order, until every choice is done. An engine error
    raises APIError; a choice aborted by the server (shutdown) ends with finish_reason "abort"."""
    while not all(c.done for c in choices):
        choice, item = await sink.get()
        if choice.done:
            continue
        if isinstance(item, BaseException):
            raise _engine_error(item)
        if item is None or item is _ABORTED:  # the stream ended without a finished output
            choice.done = True
            choice.finish_reason = "abort"
            delta = _Delta("", [], [] if choice.logprobs is not None else None, True)
        else:
            delta = _apply_output(choice, item)
            if delta.finished:
                choice.done = True
                choice.engine_finished = True
        _observe(state, choice, delta, arrival)
        if choice.done and state.log_outputs:
            REQUESTS_LOGGER.info(
                "%s",
                output_line(
                    choice.request_id,
                    choice.index,
                    choice.text,
                    choice.token_ids,
                    choice.finish_reason,
                    state.max_log_len,
                ),
            )
        yield choice, delta


async def _collect(
    state: ServerState,
    info: EngineModelInfo,
    req: P.GenerateRequest,
    request_id: str,
    created: int,
    arrival: float,
    choices: list[_Choice],
    sink: _Sink,
) -> web.Response:
    async for _choice, _delta in _deltas(state, choices, sink, arrival):
        pass
    out = []
    ids = req.return_token_ids
    for c in choices:
        prefix = ""
        if req.echo:
            prefix = _echo_text(info, req, c.prompt)
        lps = _logprobs_json(req, info, c.logprobs, c.token_ids, P.TextOffsets(len(prefix)))
        if req.kind == "completion":
            lps = _join_logprobs(_echo_logprobs_json(req, info, c), lps)
            out.append(
                P.completion_choice(
                    c.index,
                    prefix + c.text,
                    c.finish_reason,
                    lps,
                    c.stop_reason,
                    prompt_token_ids=c.prompt.token_ids if ids else None,
                    token_ids=c.token_ids if ids else None,
                    prompt_logprobs=_vllm_prompt_logprobs(req, info, c),
                )  # fmt: skip
            )
        else:
            reasoning, content = (
                (None, c.text) if req.reasoning is None else split_reasoning(req.reasoning, c.text)
            )
            out.append(
                P.chat_choice(
                    c.index,
                    content,
                    c.finish_reason,
                    lps,
                    c.stop_reason,
                    token_ids=c.token_ids if ids else None,
                    reasoning=reasoning,
                    role=req.answer_role,
                )
            )
            if req.tool_parser is not None:
                _with_tool_calls(out[-1], req, c, content)
    usage = _usage(req, choices)
    if req.kind == "completion":
        body = P.completion_response(request_id, created, req.model, out, usage)
    else:
        prompt_ids = req.prompts[0].token_ids if ids else None
        body = P.chat_response(
            request_id,
            created,
            req.model,
            out,
            usage,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=_vllm_prompt_logprobs(req, info, choices[0]),
        )
    return web.json_response(body, dumps=_dumps)


async def _beam_answer(
    request: web.Request,
    state: ServerState,
    engine: EngineClient,
    info: EngineModelInfo,
    req: P.GenerateRequest,
    request_id: str,
    engine_ids: str,
    created: int,
    arrival: float,
) -> web.StreamResponse:
    """`use_beam_search`: each prompt's n best beams as its choices (server/beam_route.py). The
    search holds its n x prompts places of the queue (checked by the caller) to its end. With
    `stream` the finished choices go as one chunk each (as vLLM streams a search: its beams are
    known only at the end)."""
    places = [f"{engine_ids}-beams-{i}" for i in range(req.num_sequences)]
    state.admit(places)
    prompt_tokens = sum(len(p.token_ids) for p in req.prompts)
    completion_tokens = 0
    made: list[_BeamChoice] = []
    ended_by = "abort"  # the client went away (the handler is cancelled)
    try:
        try:
            best, steps = await run_beam_search(engine, req, engine_ids, lambda: state.draining)
        except asyncio.CancelledError:
            raise
        except P.APIError as e:
            if e.status != CLIENT_CLOSED:
                ended_by = "error"
            raise
        except Exception as e:
            ended_by = "error"
            raise _engine_error(e) from None
        if steps == 0:  # (the shutdown came before its first step)
            raise P.APIError(
                "the server is shutting down", status=503, type="service_unavailable", code="shutting_down"
            )
        # (an ending EOS is in token_ids but not in the text, as a sampled answer's)
        eos_ids = (engine.eos_token_id, *engine.extra_eos_token_ids)
        for prompt, beams in zip(req.prompts, best):
            for beam in beams:
                added = beam.tokens[len(prompt.token_ids) :]
                completion_tokens += len(added)
                ends_eos = beam.finish_reason == "stop" and bool(added) and added[-1] in eos_ids
                shown = added[:-1] if ends_eos else added
                text = info.decode(shown, skip_special_tokens=req.params.skip_special_tokens)
                made.append(_BeamChoice(len(made), prompt, added, text, beam.finish_reason or "length"))
    finally:
        for place in places:
            state.release(place)
        made_all = len(made) == len(places)  # (none when the search was cut or failed)
        _observe_beams(state, made if made_all else None, len(places), ended_by, arrival)
        # a search's tokens all come with its result: its first token's time is when it ended, and
        # a search cut before it made its choices has none
        request[RECORD_KEY] = RequestRecord(
            prompt_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            ttft_s=time.monotonic() - arrival if made_all else None,
        )
    usage = P.usage_dict(prompt_tokens, completion_tokens, 0)
    if req.stream:
        try:
            return await _stream_beams(request, req, request_id, created, made, usage)
        except ConnectionError:  # (as in _generate: a client that went away, or took nothing)
            raise _client_gone() from None
    ids = req.return_token_ids
    out: list[dict[str, Any]] = []
    for c in made:
        if req.kind == "completion":
            out.append(c.completion_choice(ids))
        else:
            reasoning, content = _beam_reasoning(req, c.text)
            out.append(
                P.chat_choice(
                    c.index,
                    content,
                    c.finish_reason,
                    None,
                    token_ids=c.token_ids if ids else None,
                    reasoning=reasoning,
                    role=req.answer_role,
                )
            )
    if req.kind == "completion":
        body = P.completion_response(request_id, created, req.model, out, usage)
    else:
        body = P.chat_response(
            request_id,
            created,
            req.model,
            out,
            usage,
            prompt_token_ids=req.prompts[0].token_ids if ids else None,
        )
    return web.json_response(body, dumps=_dumps)


def _observe_beams(
    state: ServerState, made: list[_BeamChoice] | None, places: int, ended_by: str, arrival: float
) -> None:
    """A search's choices in the finished-request metrics, as a sampled request's: each by its
    reason and sizes once the search ended (`made`), each by `ended_by` when it ended without
    them. (Its one-token queries are engine requests of its own, not counted there.)"""
    m = state.metrics
    if made is None:
        for _ in range(places):
            m.requests_finished.inc(ended_by)
        return
    latency = time.monotonic() - arrival
    for c in made:
        m.e2e_latency.observe(latency)
        m.requests_finished.inc(c.finish_reason)
        m.observe_finished(None, len(c.prompt.token_ids), len(c.token_ids))


@dataclass
class _BeamChoice:
    """One beam as a choice: what it added to its prompt, and its text."""

    index: int
    prompt: P.PromptInput
    token_ids: list[int]
    text: str
    finish_reason: str

    def completion_choice(self, ids: bool) -> dict[str, Any]:
        """The choice of a completion (a stream's chunk carries the same), with its prompt's and
        its own token ids when `ids` (`return_token_ids`)."""
        return P.completion_choice(
            self.index,
            self.text,
            self.finish_reason,
            None,
            prompt_token_ids=self.prompt.token_ids if ids else None,
            token_ids=self.token_ids if ids else None,
        )


def _beam_reasoning(req: P.GenerateRequest, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a chat beam: all content without a reasoning parser."""
    return (None, text) if req.reasoning is None else split_reasoning(req.reasoning, text)


async def _stream_beams(
    request: web.Request,
    req: P.GenerateRequest,
    request_id: str,
    created: int,
    made: list[_BeamChoice],
    usage: dict[str, Any],
) -> web.StreamResponse:
    """The finished beams as a stream: one chunk per choice with its whole text and its finish
    reason, then the usage chunk (with `include_usage`) and [DONE]."""
    ids = req.return_token_ids
    continuous = req.include_usage and req.continuous_usage
    resp = await _start_stream(request)
    for c in made:
        own = P.usage_dict(len(c.prompt.token_ids), len(c.token_ids), 0) if continuous else None
        if req.kind == "completion":
            event = P.completion_chunk(
                request_id, created, req.model, [c.completion_choice(ids)], own, req.include_usage
            )
        else:
            reasoning, content = _beam_reasoning(req, c.text)
            cj = P.chat_chunk_choice(
                c.index,
                role=req.answer_role,
                content=content if req.reasoning is None or content else None,
                finish_reason=c.finish_reason,
                token_ids=c.token_ids if ids else None,
                reasoning=reasoning or None,
            )
            event = P.chat_chunk(
                request_id,
                created,
                req.model,
                [cj],
                own,
                req.include_usage,
                prompt_token_ids=c.prompt.token_ids if ids else None,
            )
        await sse.send_event(resp, event)
    if req.include_usage:
        chunk = P.completion_chunk if req.kind == "completion" else P.chat_chunk
        await sse.send_event(resp, chunk(request_id, created, req.model, [], usage, True))
    await sse.send_done(resp)
    await sse.end_stream(resp)
    return resp


def _echo_text(info: EngineModelInfo, req: P.GenerateRequest, prompt: P.PromptInput) -> str:
    """The prompt as echoed: the client's own text, or its token ids decoded as the completion is
    (`skip_special_tokens` applies to both)."""
    if prompt.text is not None:
        return prompt.text
    return info.decode(prompt.token_ids, skip_special_tokens=req.params.skip_special_tokens)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


async def _start_stream(request: web.Request) -> sse.EventStream:
    return await sse.start_stream(request, write_timeout_s=request.app[STATE].stream_write_timeout_s)


def _client_gone() -> P.APIError:
    """The error of a client that went away: its access line says 499, and `_error_middleware`
    neither counts nor logs it as an error of the server's answering."""
    return P.APIError("the client closed the connection", status=CLIENT_CLOSED, code="client_gone")


async def _stream(
    request: web.Request,
    state: ServerState,
    info: EngineModelInfo,
    req: P.GenerateRequest,
    request_id: str,
    created: int,
    arrival: float,
    choices: list[_Choice],
    sink: _Sink,
) -> web.StreamResponse:
    chunk = P.completion_chunk if req.kind == "completion" else P.chat_chunk
    resp: sse.EventStream | None = None

    async def send(
        choice_json: dict[str, Any], prompt_token_ids: list[int] | None = None, before_output: bool = False
    ) -> None:
        nonlocal resp
        if resp is None:
            resp = await _start_stream(request)
        # vLLM's continuous_usage_stats: every chunk carries its choice's usage so far (its
        # prompt's tokens, the tokens the choice made), as vLLM's chunks do (a role chunk, sent
        # before any output of its choice is shown, none yet)
        usage = None
        if req.include_usage and req.continuous_usage:
            c = choices[choice_json["index"]]
            usage = P.usage_dict(len(c.prompt.token_ids), 0, 0) if before_output else _choice_usage(c)
        if req.kind == "chat":
            event = P.chat_chunk(request_id, created, req.model, [choice_json], usage, req.include_usage,
                                 prompt_token_ids=prompt_token_ids)  # fmt: skip
        else:  # (a completion choice carries its prompt's ids itself)
            event = P.completion_chunk(
                request_id, created, req.model, [choice_json], usage, req.include_usage
            )
        await sse.send_event(resp, event)

    roles_sent = req.kind != "chat"
    try:
        async for choice, delta in _deltas(state, choices, sink, arrival):
            if not roles_sent:
                roles_sent = True
                await _send_roles(req, choices, send)
            await _send_delta(req, info, choice, delta, send)
    except P.APIError as err:
        if resp is None:  # nothing sent yet: a plain error response
            raise
        await sse.send_event(resp, err.body())
    if resp is None:  # no output at all (cannot normally happen): still a well-formed stream
        resp = await _start_stream(request)
    if req.include_usage:
        await sse.send_event(resp, chunk(request_id, created, req.model, [], _usage(req, choices), True))
    await sse.send_done(resp)
    await sse.end_stream(resp)
    return resp


async def _send_roles(
    req: P.GenerateRequest, choices: list[_Choice], send: Callable[..., Awaitable[None]]
) -> None:
    """A chat stream's first chunks, once the first output came: each choice's role and no text,
    in index order, as vLLM and OpenAI begin one. Clients build their list of choices from them
    (the openai SDK's stream helper indexes it by a chunk's index, and takes a first chunk's
    logprobs twice where it also carries tokens)."""
    # (with tools, or a reasoning parser, no content yet is null, as OpenAI begins a message of
    # calls: an answer of calls or of reasoning alone adds up to null, as unstreamed; content
    # that comes replaces the null)
    content = None if req.tool_parser is not None or req.reasoning is not None else ""
    for c in choices:
        ids: list[int] | None = [] if req.return_token_ids else None
        prompt_ids = c.prompt.token_ids if req.return_token_ids else None
        c.started_stream = True
        chunk = P.chat_chunk_choice(c.index, role=req.answer_role, content=content, token_ids=ids)
        await send(chunk, prompt_ids, before_output=True)


async def _send_delta(
    req: P.GenerateRequest,
    info: EngineModelInfo,
    choice: _Choice,
    delta: _Delta,
    send: Callable[[dict[str, Any], list[int] | None], Awaitable[None]],
) -> None:
    """One chunk of a choice. With `return_token_ids` every chunk carries the ids new in it
    (`token_ids`, maybe empty) and the first chunk of each choice its prompt's ids (as vLLM: in the
    choice for completions, on the chunk for chat), so the chunks' ids add up to the
    non-streamed `token_ids`."""
    if not (delta.text or delta.finished or delta.token_ids or not choice.started_stream):
        return
    if req.kind == "chat" and req.tool_parser is not None:
        await _send_tool_delta(req, info, choice, delta, send)
        return
    lps = None
    first = not choice.started_stream
    echoing = first and req.echo and req.kind == "completion"
    echo = _echo_text(info, req, choice.prompt) if echoing else ""
    echo_lps = None
    if echoing:
        echo_lps = _echo_logprobs_json(req, info, choice)
        choice.offsets = P.TextOffsets(len(echo))  # the output's text follows the echoed prompt
    if req.logprobs is not None and delta.logprobs is not None:
        lps = _logprobs_json(req, info, delta.logprobs, delta.token_ids, choice.offsets)
    lps = _join_logprobs(echo_lps, lps)
    ids = delta.token_ids if req.return_token_ids else None
    prompt_ids = choice.prompt.token_ids if req.return_token_ids and not choice.started_stream else None
    if req.kind == "completion":
        text = echo + delta.text
        cj = P.completion_choice(choice.index, text, choice.finish_reason if delta.finished else None, lps,
                                 choice.stop_reason if delta.finished else None,
                                 prompt_token_ids=prompt_ids, token_ids=ids,
                                 prompt_logprobs=_vllm_prompt_logprobs(req, info, choice) if first else None)  # fmt: skip
        prompt_ids = None  # (in the choice, not on the chunk)
    else:
        reasoning, content = _reasoning_of(req, choice, delta)
        if req.reasoning is not None and not (reasoning or content or delta.finished or lps or ids or first):
            return  # its text is held back (it may begin a tag), and nothing else is new
        cj = P.chat_chunk_choice(
            choice.index,
            role=None if choice.started_stream else req.answer_role,
            # (with a reasoning parser a delta carries only the kinds of text it has)
            content=content if req.reasoning is None or content else None,
            finish_reason=choice.finish_reason if delta.finished else None,
            logprobs=lps,
            stop_reason=choice.stop_reason if delta.finished else None,
            token_ids=ids,
            reasoning=reasoning or None,
        )
    choice.started_stream = True
    await send(cj, prompt_ids)


# ---------------------------------------------------------------------------------------------
# Tool calls (tools.py): the message's content and calls, and their stream deltas


def _tool_finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when the model ended (not cut by a limit) after calling a tool."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


# The prompt tokens read to see whether the prompt itself closed the reasoning: a template's
# empty reasoning part ("<think>\n\n</think>\n\n") is a few tokens long.
_PROMPT_TAIL_TOKENS = 16


def _reasoning_closed(info: EngineModelInfo, req: P.GenerateRequest, fmt: ReasoningFormat) -> bool:
    """Whether the answer starts after the reasoning, so that it is all content: the message it
    continues (continue_final_message) closed its last reasoning part, or the prompt ends with the
    end of one (a template's no-thinking mode)."""
    text = req.continued
    if text is not None and (fmt.start in text or fmt.end in text):
        return text.rfind(fmt.end) > text.rfind(fmt.start)
    tail = info.decode(req.prompts[0].token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(fmt.end)


def _reasoning_of(req: P.GenerateRequest, choice: _Choice, delta: _Delta) -> tuple[str, str]:
    """(reasoning, content) of a chat stream's delta: all content without a reasoning parser."""
    if req.reasoning is None:
        return "", delta.text
    if choice.reasoning is None:
        choice.reasoning = ReasoningSplitter(req.reasoning)
    return choice.reasoning.feed(delta.text, final=delta.finished)


def _with_tool_calls(choice_json: dict[str, Any], req: P.GenerateRequest, c: _Choice, text: str) -> None:
    """A chat choice's message with its `text` (the answer, or its content after the reasoning)
    split into content and `tool_calls`."""
    assert req.tool_parser is not None
    content, calls = split_message(req.tool_parser, text)
    message = choice_json["message"]
    # (no content is null, as OpenAI writes a message of calls alone, and as the stream's chunks
    # add up to)
    message["content"] = content or None
    if calls:
        message["tool_calls"] = [call.to_json() for call in calls]
    choice_json["finish_reason"] = _tool_finish_reason(c.finish_reason, bool(calls))


async def _send_tool_delta(
    req: P.GenerateRequest,
    info: EngineModelInfo,
    choice: _Choice,
    delta: _Delta,
    send: Callable[[dict[str, Any], list[int] | None], Awaitable[None]],
) -> None:
    """The chunks of one delta of a chat stream with tools: the settled content (with the
    delta's logprobs and token ids), each newly completed call as OpenAI streams one (id, type and
    name, then the arguments), and the finish reason in a last chunk of its own."""
    assert req.tool_parser is not None
    if choice.tools is None:
        choice.tools = ToolCallStream(req.tool_parser)
    first_call = len(choice.tools.calls)
    reasoning, text = _reasoning_of(req, choice, delta)
    content, calls = choice.tools.feed(text, final=delta.finished)
    lps = None
    if req.logprobs is not None and delta.logprobs is not None:
        lps = _logprobs_json(req, info, delta.logprobs, delta.token_ids, choice.offsets)
    ids = delta.token_ids if req.return_token_ids else None
    prompt_ids = choice.prompt.token_ids if req.return_token_ids and not choice.started_stream else None
    if content or reasoning or lps is not None or ids or not choice.started_stream:
        cj = P.chat_chunk_choice(
            choice.index,
            role=None if choice.started_stream else req.answer_role,
            # (no content yet is null: a message of calls alone adds up to null, as unstreamed)
            content=content or None,
            logprobs=lps,
            token_ids=ids,
            reasoning=reasoning or None,
        )
        choice.started_stream = True
        await send(cj, prompt_ids)
    for tool_calls in tool_call_deltas(calls, first_call):
        cj = P.chat_chunk_choice(choice.index)
        cj["delta"]["tool_calls"] = tool_calls
        await send(cj, None)
    if delta.finished:
        reason = _tool_finish_reason(choice.finish_reason, bool(choice.tools.calls))
        cj = P.chat_chunk_choice(choice.index, finish_reason=reason, stop_reason=choice.stop_reason)
        await send(cj, None)


# ---------------------------------------------------------------------------------------------
# /v1/responses (responses.py): the answer of its one choice as output items


def _reasoning_tokens(info: EngineModelInfo, ids: list[int], reasoning: str, end_tag: str) -> int:
    """How many of an answer's tokens its reasoning took: those up to the one that completes the
    reasoning's end tag, or all of them where the answer has none (it reasoned to its end). The
    text encoded again would count fewer: a model's own tokens are not the ones its text encodes
    to. The prefix that holds the tag is found by bisection (decoding grows with the prefix)."""
    if not reasoning or not ids:
        return 0
    if end_tag not in info.decode(ids, skip_special_tokens=False):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if end_tag in info.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _response_usage(
    info: EngineModelInfo, req: P.GenerateRequest, choice: _Choice, reasoning: str, end_tag: str
) -> dict[str, Any]:
    u = _usage(req, [choice])
    reasoning_tokens = _reasoning_tokens(info, choice.token_ids, reasoning, end_tag)
    return R.usage(
        u["prompt_tokens"],
        u["completion_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
        reasoning_tokens,
    )


@dataclass
class _ResponseRun:
    """One /v1/responses request running: what its answer is written from."""

    request: web.Request
    state: ServerState
    info: EngineModelInfo
    rreq: R.ResponsesRequest
    response_id: str
    created: int
    arrival: float
    choices: list[_Choice]
    sink: _Sink

    def deltas(self) -> AsyncIterator[tuple[_Choice, _Delta]]:
        return _deltas(self.state, self.choices, self.sink, self.arrival)

    def logprobs(self, entries: list[Any] | None, ids: list[int]) -> list[dict[str, Any]] | None:
        """The tokens' logprobs as an output_text part lists them (None when not asked for)."""
        req = self.rreq.chat
        if not self.rreq.logprobs or entries is None or req.logprobs is None:
            return None
        got = P.chat_logprobs(
            entries, ids, self.info.token_text, req.logprobs, self.info.token_bytes, self.info.tokens_as_ids
        )
        return list(got["content"])

    def _end_tag(self) -> str:
        fmt = self.state.reasoning
        return fmt.end if fmt is not None else ReasoningFormat("").end

    def finished(
        self, items: R.OutputItems, reasoning: str, content: str | None, calls: list[Any]
    ) -> dict[str, Any]:
        """The finished response (kept, with `store`, for GET and a later turn)."""
        c = self.choices[0]
        body = R.response_body(
            self.rreq, self.response_id, self.created, output=items.items,
            usage=_response_usage(self.info, self.rreq.chat, c, reasoning, self._end_tag()),
            finish_reason=c.finish_reason,
        )  # fmt: skip
        if self.rreq.store and body["status"] in ("completed", "incomplete"):
            history = [*self.rreq.history, R.assistant_message(content, calls)]
            self.state.responses.put(body["id"], body, history, self.rreq.input_items)
        return body


async def _response_json(run: _ResponseRun) -> web.StreamResponse:
    req = run.rreq.chat
    async for _choice, _delta in run.deltas():
        pass
    text = run.choices[0].text
    reasoning, text = ("", text) if req.reasoning is None else split_reasoning(req.reasoning, text)
    content: str | None = text
    calls: list[Any] = []
    if req.tool_parser is not None:
        content, calls = split_message(req.tool_parser, text)
    items = R.OutputItems()
    items.reasoning(reasoning)
    c = run.choices[0]
    items.content(content or "", run.logprobs(c.logprobs, c.token_ids))
    items.close(_message_status(c.finish_reason))
    for call in calls:
        items.call(call)
    return web.json_response(run.finished(items, reasoning, content or None, calls), dumps=_dumps)


def _message_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


async def _stream_response(run: _ResponseRun) -> web.StreamResponse:
    """OpenAI's typed events: response.created and response.in_progress before the first output,
    the reasoning's and the message's events as their text settles, each call's when the answer
    is done (so that the items come in the unstreamed response's order: reasoning, the message
    with all the content, then the calls, whatever text the model wrote between them), and
    response.completed (or .incomplete, .failed) with the whole response. An error before any
    output is a plain error response."""
    req = run.rreq.chat
    resp: sse.EventStream | None = None
    sequence = 0
    items = R.OutputItems()
    tools = ToolCallStream(req.tool_parser) if req.tool_parser is not None else None
    splitter = ReasoningSplitter(req.reasoning) if req.reasoning is not None else None
    reasoning_text = ""
    pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is not out yet

    async def send(events: list[dict[str, Any]]) -> None:
        nonlocal resp, sequence
        if resp is None:
            resp = await _start_stream(run.request)
            start = R.response_body(run.rreq, run.response_id, run.created, output=[], in_progress=True)
            events = [{"type": "response.created", "response": start},
                      {"type": "response.in_progress", "response": start}, *events]  # fmt: skip
        for event in events:
            event["sequence_number"] = sequence
            sequence += 1
            await sse.send_typed_event(resp, event)

    try:
        async for _choice, delta in run.deltas():
            reasoning, text = (
                ("", delta.text) if splitter is None else splitter.feed(delta.text, final=delta.finished)
            )
            reasoning_text += reasoning
            events = items.reasoning(reasoning)
            # (the calls ToolCallStream settles are sent at the end, from tools.calls)
            content = text if tools is None else tools.feed(text, final=delta.finished)[0]
            pending += run.logprobs(delta.logprobs, delta.token_ids) or []
            events += items.content(content, pending)
            if content:
                pending = []
            if events or resp is None:
                await send(events)
    except P.APIError as err:
        if resp is None:  # nothing sent yet: a plain error response
            raise
        failed = R.response_body(
            run.rreq, run.response_id, run.created, output=items.items, error=R.renamed_error(err)
        )
        await send([*items.close("incomplete"), {"type": "response.failed", "response": failed}])
    else:
        events = items.late_logprobs(pending)
        events += items.close(_message_status(run.choices[0].finish_reason))
        calls = [] if tools is None else tools.calls
        for call in calls:
            events += items.call(call)
        content = "".join(p["text"] for i in items.items if i["type"] == "message" for p in i["content"])
        body = run.finished(items, reasoning_text, content or None, calls)
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(body["status"])
        await send([*events, {"type": kind or "response.completed", "response": body}])
    assert resp is not None
    await sse.end_stream(resp)
    return resp
