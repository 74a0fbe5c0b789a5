"""`hybridserve serve MODEL [engine flags] [--host --port --api-key --allowed-origins --allowed-hosts
--served-model-name --max-queue-len ...]`.

The server listens before the model is loaded (/health answers 503 until it is), loads the engine
in a background thread, and shuts down gracefully on SIGINT/SIGTERM: it stops admitting (new
requests get 503 and /health "shutting_down" while it drains), lets in-flight requests finish for
`--shutdown-timeout` seconds, aborts the rest, stops listening and exits 0.
No torch import at module level: this module builds the CLI parser.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any

from hybridserve.arg_types import int_in, not_empty, only_one, role_name, seconds
from hybridserve.server.access import parse_allowed_hosts, parse_allowed_origins
from hybridserve.server.reasoning import REASONING_PARSERS
from hybridserve.server.request_log import printable
from hybridserve.server.responses import DEFAULT_STORE_BYTES
from hybridserve.server.tools import TOOL_PARSERS

logger = logging.getLogger("hybridserve.server")

# --uvicorn-log-level (vLLM's names): the levels of the loggers of the HTTP layer
HTTP_LOG_LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}
HTTP_LOGGERS = ("hybridserve.access", "aiohttp")
# After the drain, how long the handlers still running (never admitted) may take before they are
# cancelled and the server stops listening
CLEANUP_TIMEOUT_S = 2.0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from hybridserve.config import DEFAULT_MAX_QUEUE_LEN, add_engine_args

    add_engine_args(p)  # MODEL and every engine flag
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        # (an empty host would listen on every interface: that is asked for by name)
        type=not_empty("give an address, or 0.0.0.0 / :: for every interface"),
        help="address to listen on (default 127.0.0.1; 0.0.0.0 or :: for every interface)",
    )
    g.add_argument(
        "--port",
        type=int_in(0, 65535),
        default=8000,
        help="port to listen on (default 8000; 0 picks a free one)",
    )
    g.add_argument(
        "--uds",
        metavar="PATH",
        default=None,
        type=not_empty("give the socket's path"),
        help="listen on this Unix domain socket instead of --host/--port (a stale socket file left "
        "there is replaced; the socket is removed when the server stops)",
    )
    g.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        default=None,
        help="serve HTTPS with this PEM certificate (chain); needs --ssl-keyfile (default: plain HTTP)",
    )
    g.add_argument(
        "--ssl-keyfile", metavar="FILE", default=None, help="the private key of --ssl-certfile (PEM)"
    )
    g.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        default=None,
        help="PEM certificates of the authorities whose client certificates --ssl-cert-reqs accepts",
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        metavar="{0,1,2}",
        help="client certificates: 0 not asked for (default), 1 checked when a client shows one, 2 "
        "required (each against --ssl-ca-certs)",
    )
    g.add_argument(
        "--api-key",
        # An empty key (`--api-key "$KEY"` with KEY unset) served every route without one, silently:
        # refused, as an empty --host is. An empty $HYBRIDSERVE_API_KEY is no key, as before.
        default=os.environ.get("HYBRIDSERVE_API_KEY") or None,
        type=not_empty("give the key, or leave the flag out to serve without one"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $HYBRIDSERVE_API_KEY, else none)",
    )
    g.add_argument(
        "--allowed-origins",
        type=parse_allowed_origins,
        default=(),
        metavar="ORIGINS",
        help="comma-separated origins (scheme://host[:port], e.g. http://localhost:3000) whose web pages may "
        "call the server through a browser; '*' allows every site (then use --api-key). Requests from "
        "other sites' pages get 403 (default: none)",
    )
    g.add_argument(
        "--allowed-hosts",
        type=parse_allowed_hosts,
        default=(),
        metavar="NAMES",
        help="comma-separated names the Host header may carry besides localhost, 127.0.0.1, [::1] and the "
        "--host address (any port); '*' accepts any. Others get 403. Bound to 0.0.0.0 or ::, the Host "
        "is checked only when this is given",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        type=not_empty("give the name requests use, or leave the flag out to serve the MODEL argument's"),
        default=None,
        metavar="NAME",
        help="model name in the API (default: the MODEL argument as given, as vLLM; 'demo' for the demo); "
        "with more names, requests may give any of them and answers carry the first",
    )
    g.add_argument(
        "--max-queue-len",
        type=int_in(1, 2**31 - 1),
        default=DEFAULT_MAX_QUEUE_LEN,
        help="engine requests admitted at once (running + waiting); beyond it requests get 503 + Retry-After",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int_in(1, 1 << 40),
        default=4 * 1024 * 1024,
        help="largest request body accepted (413 beyond)",
    )
    g.add_argument(
        "--responses-store-bytes",
        type=int_in(0, 1 << 40),
        default=DEFAULT_STORE_BYTES,
        help="memory for the responses /v1/responses keeps for GET and previous_response_id, the oldest "
        f"dropped first (default {DEFAULT_STORE_BYTES >> 20} MiB; 0 keeps none)",
    )
    g.add_argument(
        "--body-read-timeout",
        type=seconds(),
        default=60.0,
        help="seconds a client has to send a request body once its headers arrived (408 beyond)",
    )
    g.add_argument(
        "--stream-write-timeout",
        type=seconds(allow_zero=True),
        default=60.0,
        help="seconds a streamed answer waits for a client that takes nothing of it before the "
        "request is aborted and the connection dropped (0: no limit)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=seconds(),
        default=15.0,
        help="seconds an idle connection is kept open; also how long a client may take to send its "
        "request headers",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=seconds(allow_zero=True),
        default=5.0,
        help="seconds in-flight requests may run on after SIGINT/SIGTERM before they are aborted",
    )
    g.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="answer a request field this server does not know with a 400 (default: ignore it and log a "
        "warning naming it, as vLLM)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        default=None,
        help="split chat answers of a thinking model into `reasoning` (also `reasoning_content`) and "
        "`content`: deepseek_r1, the <think> ... </think> form, or nano_v2 / nano_v3, NVIDIA's names "
        "for the same split (docs/serving.md, Reasoning outputs; default: answers are whole)",
    )
    g.add_argument(
        "--reasoning-parser-plugin",
        metavar="FILE",
        default=None,
        help="accepted for vLLM's command lines: the file is not run (a warning says so); "
        "--reasoning-parser names a parser built in here",
    )
    g.add_argument(
        "--tool-parser-plugin",
        metavar="FILE",
        default=None,
        help="accepted for vLLM's command lines: the file is not run (a warning says so); "
        "--tool-call-parser names a parser built in here",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default="hermes",
        help="how tool calls are written and read (vLLM's flag): hermes, <tool_call>{...}</tool_call> "
        "(the default); nemotron_json, <TOOLCALL>[{...}, ...]</TOOLCALL> (NVIDIA Nemotron-H instruct "
        "models); qwen3_coder, <tool_call><function=NAME><parameter=P>...</tool_call> (Qwen3-Coder, "
        "NVIDIA Nemotron 3)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice auto is always on here",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own `chat_template` in place of the served one (vLLM's flag; "
        "default: refused with a 400). A template is code the server runs, in a sandbox but "
        "without a time limit: for clients you trust",
    )
    g.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="fcfs: first come, first served, and a request's `priority` field other than 0 is a 400; "
        "priority: requests are scheduled by their `priority` (lower first, then by arrival), and "
        "when KV blocks run out the running request of the largest value is preempted first "
        "(vLLM's flag)",
    )
    g.add_argument(
        "--no-access-log",
        "--disable-uvicorn-access-log",
        dest="access_log",
        action="store_false",
        help="no log line per request (method, path, status, tokens, TTFT, E2E); vLLM's name too",
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=list(HTTP_LOG_LEVELS),
        default=None,
        help="vLLM's flag: the level of the HTTP layer's loggers (the access lines and aiohttp's), as "
        "uvicorn's there (warning and above: no access lines; default: --log-level)",
    )
    g.add_argument(
        "--response-role",
        type=role_name,
        default="assistant",
        metavar="ROLE",
        help="the role of a chat answer's message (vLLM's flag; default assistant); a request with "
        "add_generation_prompt false answers in the role of its last message, as vLLM's",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed completion and chat answer ends with a usage chunk, as if its "
        "stream_options asked for one (vLLM's flag)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="accepted for vLLM's command lines: usage.prompt_tokens_details.cached_tokens is always given",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="accepted for vLLM's command lines: answers always carry X-Request-Id",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=only_one("data-parallel replicas are served by `hybridserve replicas --num-replicas N`"),
        default=1,
        metavar="1",
        help="accepted for vLLM's command lines with 1 (replicas: `hybridserve replicas`)",
    )
    g.add_argument(
        "--log-stats-interval",
        type=seconds(),
        default=10.0,
        help="seconds between the engine lines (running, waiting, token rates, prefix-cache hit rate, "
        "cache usage) logged while there is work (default 10)",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine line (vLLM's flag)")
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name each token 'token_id:N' instead of its text (vLLM's flag; a request's "
        "return_tokens_as_token_ids says otherwise for itself)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log every generation request's prompt and sampling parameters (vLLM's flag; off by default: "
        "prompts are the users' data)",
    )
    g.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="log every finished choice's text, token count and finish reason (vLLM's flag; off by "
        "default: answers are the users' data)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for older vLLM command lines: requests are not logged unless --enable-log-requests",
    )
    g.add_argument(
        "--max-log-len",
        type=int_in(0, 2**31 - 1),
        default=None,
        metavar="N",
        help="with --enable-log-requests, the first N characters (or token ids) of each prompt (default: all)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _served_name(args: argparse.Namespace) -> str:
    # vLLM's default: the MODEL argument exactly as given (a path stays a path), so that a client
    # configured for a vLLM server of the same model sends the name this one serves
    return str(args.served_model_name[0] if args.served_model_name else args.model)


def _build_engine(engine_args: Any) -> Any:
    """Construct the AsyncEngine (it loads the model in its own thread). Runs in a helper thread,
    so that importing torch does not hold up the event loop."""
    from hybridserve.engine.async_engine import AsyncEngine

    return AsyncEngine(engine_args)


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from hybridserve.config import EngineArgs
    from hybridserve.errors import ConfigError
    from hybridserve.server.access import AccessPolicy
    from hybridserve.server.app import create_app, drain, set_engine, set_load_error
    from hybridserve.server.listen import ListenError, listen
    from hybridserve.server.tls import TLSConfigError, server_context

    try:
        engine_args = EngineArgs.from_cli(args)  # bad flags fail here, before anything listens
        # and so do flags that do not fit the model (config.json only: no weights are read)
        await asyncio.to_thread(engine_args.resolve)
        tls = server_context(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    except (ConfigError, TLSConfigError) as e:
        print(f"hybridserve serve: {e}", file=sys.stderr)
        return 2

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    for flag, plugin, parser in (
        ("--reasoning-parser-plugin", args.reasoning_parser_plugin, args.reasoning_parser),
        ("--tool-parser-plugin", args.tool_parser_plugin, args.tool_call_parser),
    ):
        if plugin is not None:
            logger.warning(
                "%s %s: not run (hybridserve runs no code from files); %s",
                flag,
                printable(plugin),
                f"the built-in parser {parser!r} is used" if parser is not None else "no parser is used",
            )
    # (a browser cannot reach a Unix socket, so no DNS rebinding: on --uds the Host is checked
    # only against --allowed-hosts, and a proxy may forward its clients' Host as it is)
    access = AccessPolicy.for_bind(
        None if args.uds is not None else args.host, args.allowed_hosts, args.allowed_origins
    )
    if access.allowed_hosts is None:
        why = (
            "on a Unix socket" if args.uds is not None else "bound to all interfaces, or --allowed-hosts '*'"
        )
        logger.info("the Host header is not checked (%s)", why)
    if access.any_origin and not args.api_key:
        logger.warning(
            "--allowed-origins '*' without --api-key: any web page a user of this machine visits can "
            "use the server"
        )
    app = create_app(
        None,
        served_model_name=_served_name(args),
        model_aliases=tuple(args.served_model_name or ())[1:],
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_body_bytes,
        responses_store_bytes=args.responses_store_bytes,
        shutdown_grace_s=args.shutdown_timeout,
        body_read_timeout_s=args.body_read_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        access=access,
        strict_request_fields=args.strict_request_fields,
        scheduling_policy=args.scheduling_policy,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        access_log=args.access_log,
        log_stats_interval_s=0.0 if args.disable_log_stats else args.log_stats_interval,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        response_role=args.response_role,
        force_include_usage=args.enable_force_include_usage,
        log_outputs=args.enable_log_outputs,
    )
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        # the requests in flight had --shutdown-timeout in the drain before this bound counts
        # (`drain`): what is left then was never admitted (a body still arriving at a byte a
        # second), which this bound cuts short, not the drain's grace and then fifteen seconds more
        shutdown_timeout=CLEANUP_TIMEOUT_S,
        access_log=None,
        # aiohttp has no header-read timeout of its own; its keep-alive timer also closes a
        # connection whose headers never complete
        keepalive_timeout=args.keep_alive_timeout,
    )
    await runner.setup()
    try:
        listening = await listen(runner, args.host, args.port, args.uds, tls)
    except ListenError as e:
        await runner.cleanup()
        print(f"hybridserve serve: {e}", file=sys.stderr)
        return 1
    logger.info("listening on %s (loading the model...)", listening.where)

    # The engine loads in a daemon thread, so a signal during loading need not wait for it.
    loaded: asyncio.Future[Any] = loop.create_future()

    def report(fn: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is gone: the server was stopped while loading
            pass

    def load() -> None:
        try:
            engine = _build_engine(engine_args)
        except BaseException as e:  # reported on the event loop
            err = e

            def fail() -> None:
                if not loaded.done():
                    loaded.set_exception(err)

            report(fail)
            return

        def succeed() -> None:
            if not loaded.done():
                loaded.set_result(engine)

        report(succeed)

    threading.Thread(target=load, name="hybridserve-load", daemon=True).start()

    engine: Any = None
    rc = 0
    stop_wait = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({loaded, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if loaded in done:
        exc = loaded.exception()
        if exc is None:
            engine = loaded.result()
            # AsyncEngine loads the model in its own thread; `ready` turns True when it is loaded.
            while not stop.is_set() and not getattr(engine, "ready", True):
                if getattr(engine, "load_error", None) is not None:
                    exc = engine.load_error
                    break
                await asyncio.sleep(0.05)
        if exc is not None:
            logger.error("loading the model failed: %s", exc)
            set_load_error(app, str(exc))
            # a flag that names what is not there (--tokenizer, a draft model) is a usage error,
            # as `generate` says it
            rc = 2 if isinstance(exc, ConfigError) else 1
        elif not stop.is_set():
            # the engine's own (read once, as the engine loaded): --chat-template and
            # --chat-template-content-format are in it
            set_engine(app, engine, chat_template=engine.chat_template)
            logger.info("ready: serving %r on %s", _served_name(args), listening.where)
            rc = await _serve_until_stopped(engine, stop_wait)
    stop_wait.cancel()
    logger.info("shutting down")
    # drain first, still listening: new connections get 503 and /health says "shutting_down"
    await drain(app)
    await runner.cleanup()  # stops listening
    listening.remove_socket()
    if engine is not None:
        try:
            res = engine.shutdown()
            if asyncio.iscoroutine(res):
                await res
        except Exception:
            logger.exception("engine shutdown failed")
    logger.info("stopped")
    return rc


async def _serve_until_stopped(engine: Any, stop_wait: asyncio.Future[Any]) -> int:
    """0 once a signal stops the server; 1 when the engine dies while serving (its thread ended:
    a tensor-parallel worker died), after it has failed every open request."""
    while not stop_wait.done():
        if not getattr(engine, "ready", True):
            logger.error("the engine stopped while serving; shutting down")
            return 1
        await asyncio.wait({stop_wait}, timeout=0.5)
    return 0


class _MalformedHttpFilter(logging.Filter):
    """aiohttp logs a traceback at ERROR for every malformed HTTP message a client sends (it has
    already answered 400), and for a body that does not decode as its Content-Encoding says
    (answered 400 by the handler): any client could fill the log. Keep one line, at debug level
    only."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError | RequestPayloadError):
            return True
        if not logger.isEnabledFor(logging.DEBUG):
            return False
        record.msg, record.args = f"malformed HTTP from a client: {exc!r}", ()
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def serve_main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.server").addFilter(_MalformedHttpFilter())
    if getattr(args, "uvicorn_log_level", None) is not None:
        for name in HTTP_LOGGERS:
            logging.getLogger(name).setLevel(HTTP_LOG_LEVELS[args.uvicorn_log_level])
    from hybridserve.distributed.torchrun import check_torchrun, run_worker
    from hybridserve.errors import ConfigError

    try:
        env = check_torchrun(int(getattr(args, "tensor_parallel_size", None) or 1))
    except ConfigError as e:
        print(f"hybridserve serve: {e}", file=sys.stderr)
        return 2
    if env is not None and env.rank > 0:  # started by torchrun: rank 0 serves, the others compute
        return run_worker(env, args.device)
    return asyncio.run(_serve(args))
