"""A real headless Chromium against a real `hybridserve serve demo`: a page of another origin tries
the requests a browser sends without a CORS preflight (`fetch` with a Blob body, `fetch` with
`mode: "no-cors"`, `navigator.sendBeacon`) and one that needs a preflight, and none of them reaches
the engine: the engine's counters in /metrics stay at 0 while the 403s are counted. The page
reports to its own server which attempts it ran, so the test cannot pass because nothing ran; a
page of the one allowed origin then generates through the same server, so the counters are seen
to move when a request does get through. A navigation under a foreign name (what a page sees after
DNS rebinding) gets the Host check's 403 instead of the model list.

Needs the Debian package `chromium` (`make test` installs it when run as root); skipped without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, free_port, parse_metrics, running_server

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (Debian package chromium: apt-get install --no-install-recommends "
    "chromium; make test installs it when run as root)",
)
REPORT_TIMEOUT_S = 90.0
MODEL = "demo"
REBIND_NAME = "rebind.evil.test"

# The attempts of the page of another origin. Each is awaited (a beacon is only queued), and the
# page reports what each did: it must have run them all for the test to mean anything.
ATTACK_SCRIPT = """
const json = JSON.stringify({model: "demo", prompt: "Hello", max_tokens: 4});
const results = {};
async function attempt(name, run) {
  try { results[name] = await run(); } catch (e) { results[name] = "rejected: " + e.name; }
}
await attempt("fetch_blob", async () => {  // no Content-Type: a simple request, sent at once
  const r = await fetch(API, {method: "POST", body: new Blob([json])});
  return "read status " + r.status;  // not reached: the answer has no CORS header
});
await attempt("fetch_no_cors", async () => {
  const r = await fetch(API, {method: "POST", mode: "no-cors", body: new Blob([json])});
  return "sent, response " + r.type;
});
await attempt("fetch_no_cors_text", async () => {  // a string body: text/plain
  const r = await fetch(API, {method: "POST", mode: "no-cors", body: json});
  return "sent, response " + r.type;
});
await attempt("beacon", async () => navigator.sendBeacon(API, new Blob([json])) ? "queued" : "not queued");
await attempt("fetch_json", async () => {  // application/json: the preflight is refused
  const r = await fetch(API, {method: "POST", headers: {"Content-Type": "application/json"}, body: json});
  return "read status " + r.status;
});
"""
# The page of the allowed origin: a JSON POST as a browser application sends it, answer read.
ALLOWED_SCRIPT = """
const results = {};
try {
  const r = await fetch(API, {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model: "demo", prompt: "Hello", max_tokens: 4, temperature: 0})});
  const body = await r.json();
  results.fetch_json = "status " + r.status + ", completion_tokens " + body.usage.completion_tokens;
} catch (e) { results.fetch_json = "rejected: " + e.name; }
"""
# Both pages end by telling their own server (same-origin) what ran.
PAGE = """<!doctype html><meta charset="utf-8"><title>page</title><script type="module">
const API = %s;
%s
await fetch("/report", {method: "POST", headers: {"Content-Type": "application/json"},
  body: JSON.stringify({origin: location.origin, results})});
</script>"""


@pytest.fixture(scope="module")
def allowed_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(allowed_port: int) -> Iterator[ServerProcess]:
    ensure_demo_model()
    with running_server(
        "--max-model-len", "256", "--allowed-origins", f"http://127.0.0.1:{allowed_port}"
    ) as srv:
        yield srv


class Pages:
    """The web server of the pages: the attack page on one port (one origin), the allowed page on
    another; each page posts its report to /report of its own origin."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.app = web.Application()
        self.app.router.add_get("/attack.html", self._page(ATTACK_SCRIPT))
        self.app.router.add_get("/allowed.html", self._page(ALLOWED_SCRIPT))
        self.app.router.add_post("/report", self._report)
        self.runner = web.AppRunner(self.app, access_log=None)

    def _page(self, script: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text=PAGE % (json.dumps(self.api), script), content_type="text/html")

        return handler

    async def _report(self, request: web.Request) -> web.Response:
        self.reports.put_nowait(await request.json())
        return web.Response(status=204)

    async def start(self, *ports: int) -> None:
        await self.runner.setup()
        for port in ports:
            await web.TCPSite(self.runner, "127.0.0.1", port).start()

    async def report(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.reports.get(), REPORT_TIMEOUT_S)


class Chromium:
    """One headless Chromium showing `url` until closed (a fresh profile each time). It runs in a
    session of its own, so that closing it also ends the renderer and helper processes it started."""

    def __init__(self, url: str, *extra: str) -> None:
        assert CHROMIUM is not None
        self.profile = tempfile.TemporaryDirectory(prefix="hybridserve-chromium-")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [CHROMIUM, *chromium_flags(self.profile.name), *extra, url],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:  # helpers of this browser that outlived it (its own process group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        self.profile.cleanup()


def chromium_flags(profile: str) -> list[str]:
    # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start; nothing
    # but the test's own pages is loaded. The rest keeps it off the network and quiet.
    return [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]


async def engine_counters(server: ServerProcess) -> tuple[dict[str, float], float]:
    """(what a request that reached the engine moves, the 403s counted)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base + "/metrics") as r:
            m = parse_metrics(await r.text())
    engine = {
        "prompt_tokens": m["hybridserve_prompt_tokens_total"],
        "generation_tokens": m["hybridserve_generation_tokens_total"],
        "requests_finished": sum(
            v for k, v in m.items() if k.startswith("hybridserve_requests_finished_total")
        ),
        "inflight": m["hybridserve_server_inflight_requests"],
    }
    return engine, m.get('hybridserve_http_errors_total{status="403"}', 0.0)


async def run_page(pages: Pages, url: str) -> dict[str, Any]:
    browser = Chromium(url)
    try:
        try:
            return await pages.report()
        except TimeoutError:
            pytest.fail(f"the page {url} did not report within {REPORT_TIMEOUT_S} s:\n{browser.output()}")
    finally:
        await asyncio.to_thread(browser.close)


async def test_pages_of_other_origins_cannot_use_the_server_through_a_browser(
    server: ServerProcess, allowed_port: int
) -> None:
    attack_port = free_port()
    api = server.base + "/v1/completions"
    pages = Pages(api)
    await pages.start(attack_port, allowed_port)
    try:
        engine0, refused0 = await engine_counters(server)
        assert set(engine0.values()) == {0.0} and refused0 == 0.0, engine0

        report = await run_page(pages, f"http://127.0.0.1:{attack_port}/attack.html")
        assert report["origin"] == f"http://127.0.0.1:{attack_port}"
        r = report["results"]
        # every attempt ran: the two no-cors requests were sent (their answer is opaque), the
        # beacon was queued, the CORS-mode fetches were refused by the browser for want of CORS
        # headers (the Blob POST after reaching the server, the JSON POST at its preflight)
        assert r == {
            "fetch_blob": "rejected: TypeError",
            "fetch_no_cors": "sent, response opaque",
            "fetch_no_cors_text": "sent, response opaque",
            "beacon": "queued",
            "fetch_json": "rejected: TypeError",
        }, r
        # none reached the engine, and each reached the server and was answered 403 (the beacon
        # may arrive after the report)
        attempts = len(r)
        for _ in range(200):
            engine, refused = await engine_counters(server)
            if refused - refused0 >= attempts or engine != engine0:
                break
            await asyncio.sleep(0.05)
        assert engine == engine0, f"a request of the attack page reached the engine: {engine}"
        assert refused - refused0 == attempts, (
            f"{refused - refused0} requests refused",
            server.output()[-2000:],
        )

        # DNS rebinding: the browser reaches the server under the attacker's name (here mapped to
        # 127.0.0.1); what it would read is the Host check's 403, not the model list
        dom, log = await asyncio.to_thread(dump_dom, f"http://{REBIND_NAME}:{server.port}/v1/models")
        assert "host_not_allowed" in dom and '"object": "list"' not in dom, (dom[-2000:], log)

        # the allowed origin's page does get through, and the counters show it: they would have
        # shown the attack page's requests had any reached the engine
        report = await run_page(pages, f"http://127.0.0.1:{allowed_port}/allowed.html")
        assert report["results"] == {"fetch_json": "status 200, completion_tokens 4"}, report
        engine, _ = await engine_counters(server)
        assert engine["prompt_tokens"] > 0 and engine["requests_finished"] == 1, engine
    finally:
        await pages.runner.cleanup()


def dump_dom(url: str) -> tuple[str, str]:
    """(the page's DOM once loaded, the end of Chromium's log)."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="hybridserve-chromium-") as profile:
        flags = [*chromium_flags(profile), f"--host-resolver-rules=MAP {REBIND_NAME} 127.0.0.1", "--dump-dom"]
        done = subprocess.run(
            [CHROMIUM, *flags, url], capture_output=True, timeout=120, start_new_session=True
        )
    return done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")[-2000:]
