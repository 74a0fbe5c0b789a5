"""The server applies the model's generation config to the fields a request leaves out (as vLLM
does), and a request's own values win; on a copy of the demo model that recommends greedy
decoding and three-token answers."""

from __future__ import annotations

import shutil
from pathlib import Path

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import call, running_server

MESSAGES = [{"role": "user", "content": "Tell me about the cake."}]


def test_requests_take_the_generation_config_for_fields_they_leave_out(tmp_path: Path) -> None:
    for f in Path(ensure_demo_model()).iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.0, "max_new_tokens": 3}', encoding="utf-8"
    )
    with running_server("--dtype", "float32", "--served-model-name", "demo", model=str(tmp_path)) as server:
        base = {"model": "demo", "messages": MESSAGES, "ignore_eos": True}
        first = call(server, "/v1/chat/completions", base)
        second = call(server, "/v1/chat/completions", {**base, "seed": 123})
        greedy = call(server, "/v1/chat/completions", {**base, "temperature": 0, "max_tokens": 3})
        for status, out in (first, second, greedy):
            assert status == 200, out
            assert out["usage"]["completion_tokens"] == 3
        # greedy by default: any seed gives the explicit greedy answer
        texts = {out["choices"][0]["message"]["content"] for _, out in (first, second, greedy)}
        assert len(texts) == 1
        # max_new_tokens caps a given max_tokens too, and OpenAI's completion default of 16, as vLLM
        for path, body in (
            ("/v1/completions", {"model": "demo", "prompt": "Once upon", "ignore_eos": True}),
            (
                "/v1/completions",
                {"model": "demo", "prompt": "Once upon", "ignore_eos": True, "max_tokens": 9},
            ),
            ("/v1/chat/completions", {**base, "max_tokens": 9}),
        ):
            status, out = call(server, path, body)
            assert status == 200 and out["usage"]["completion_tokens"] == 3, (path, body, out)
        sampled = {
            call(server, "/v1/chat/completions", {**base, "temperature": 1.5, "seed": s})[1]["choices"][0][
                "message"
            ]["content"]
            for s in range(6)
        }
        assert len(sampled) > 1  # the request's temperature is used, not the default's 0
