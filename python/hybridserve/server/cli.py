"""`hybridserve serve` (placeholder until the server lands: answers /health only)."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder, or 'demo' for the built-in demo model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def serve_main(args: argparse.Namespace) -> int:
    from aiohttp import web

    app = web.Application()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    web.run_app(app, host=args.host, port=args.port)
    return 0
