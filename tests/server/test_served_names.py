"""More than one `--served-model-name` (as vLLM): requests may name the model by any of them, every
answer carries the first, `/v1/models` and the OpenAPI document list them all, and another name is
still a 404."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from server_fixtures import ROOT, ServerProcess, call, openai_client, running_server

NAMES = ["primary", "alias-one", "/models/by/path"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--served-model-name", *NAMES, "--max-num-seqs", "4") as srv:
        yield srv


def test_every_name_is_listed_and_each_has_its_card(server: ServerProcess) -> None:
    status, models = call(server, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == NAMES
    for name in NAMES:
        status, card = call(server, f"/v1/models/{name.lstrip('/')}")
        assert status == 200 and card["id"] == name
    status, err = call(server, "/v1/models/other")
    assert status == 404 and err["error"]["code"] == "model_not_found"
    status, doc = call(server, "/openapi.json")
    schema = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert status == 200 and [e for e in schema["enum"] if e is not None] == NAMES


def test_a_request_may_name_any_and_the_answer_carries_the_first(server: ServerProcess) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    answers = []
    for name in NAMES:
        status, r = call(server, "/v1/completions", {**body, "model": name})
        assert status == 200 and r["model"] == "primary"
        answers.append(r["choices"][0]["text"])
    assert len(set(answers)) == 1
    with openai_client(server) as client:
        chat = client.chat.completions.create(
            model="alias-one", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert chat.model == "primary"
    status, err = call(server, "/v1/completions", {**body, "model": "other"})
    assert status == 404 and err["error"]["param"] == "model"


def test_a_model_after_the_names_is_taken_for_a_name_and_the_error_says_so() -> None:
    """(as vLLM's: --served-model-name takes every word after it)"""
    done = subprocess.run(
        [sys.executable, "-m", "hybridserve", "serve", "--served-model-name", "a", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "python")),
    )
    assert done.returncode == 2 and "give MODEL before it" in done.stderr, done.stderr[-2000:]
