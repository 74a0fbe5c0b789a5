"""The server's log lines without an engine (server/request_log.py, app.py): the access line and
its levels, the 4xx line, `--no-access-log`, values a client chose escaped, the engine line's
arithmetic."""

from __future__ import annotations

import logging

from hybridserve.server.app import create_app
from hybridserve.server.request_log import EngineStatsLine, printable


def test_printable_escapes_what_a_client_chose():
    assert printable("/v1/models") == "/v1/models"
    assert printable("a\nb\r\x1b[31m\u2028") == "a\\nb\\r\\x1b[31m\\u2028"
    assert printable("x" * 500, 10) == "x" * 10 + "..."


async def test_access_lines_levels_and_the_switch(aiohttp_client, caplog):
    caplog.set_level(logging.DEBUG)
    client = await aiohttp_client(create_app(None, served_model_name="demo", log_stats_interval_s=0))
    assert (await client.get("/v1/models")).status == 200
    assert (await client.get("/health")).status == 503  # (no engine)
    assert (await client.get("/v1/models/other")).status == 404
    access = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "hybridserve.access"]
    assert [lvl for lvl, _ in access] == [logging.INFO, logging.DEBUG, logging.INFO]  # probes: debug
    assert '"GET /v1/models" 200 e2e=' in access[0][1]
    errors = [r.getMessage() for r in caplog.records if r.name == "hybridserve.server"]
    assert any('"GET /v1/models/other" 404: param=model code=model_not_found' in m for m in errors), errors

    caplog.clear()
    quiet = await aiohttp_client(create_app(None, served_model_name="demo", access_log=False))
    assert (await quiet.get("/v1/models")).status == 200
    assert (await quiet.get("/nowhere%0Aforged")).status == 404
    assert not [r for r in caplog.records if r.name == "hybridserve.access"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "hybridserve.server"]
    assert "/nowhere%0Aforged" in line and "\n" not in line  # (the 4xx line stays)


def test_engine_line_rates_and_silence_when_idle():
    line = EngineStatsLine()
    idle = {"num_running": 0, "num_waiting": 0, "prompt_tokens": 0, "generation_tokens": 0}
    busy = {
        "num_running": 2,  # (the scheduler's name of num_requests_running)
        "num_requests_waiting": 1,
        "prompt_tokens": 1000,
        "generation_tokens": 50,
        "prefix_cache_queried_tokens": 800,
        "prefix_cache_hit_tokens": 200,
        "kv_blocks_used": 10,
        "kv_blocks_total": 40,
        "mamba_slots_used": 3,
        "mamba_slots_total": 12,
    }
    # the first snapshot, busy or not, has no interval to give rates over: no line
    assert EngineStatsLine().update(busy, 0.0) is None
    assert line.update(idle, 0.0) is None
    text = line.update(busy, 10.0)
    assert text == (
        "engine: 2 running, 1 waiting; prompt 100.0 tok/s, generation 5.0 tok/s; prefix cache hit rate "
        "25.0% (since start 25.0%); KV cache 25.0% used, Mamba state slots 25.0% used"
    )
    done = {**busy, "num_running": 0, "num_requests_waiting": 0, "generation_tokens": 70, "kv_blocks_used": 0}
    assert "generation 2.0 tok/s" in (line.update(done, 20.0) or "")  # the interval the work ended in
    assert line.update(done, 30.0) is None
