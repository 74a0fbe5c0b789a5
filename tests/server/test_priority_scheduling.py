"""vLLM's `priority` request field against real servers: with --scheduling-policy priority a
waiting request of a lower value is scheduled before one that arrived earlier; with the default
(fcfs) a non-zero priority is a 400 and 0 is accepted."""

from __future__ import annotations

import threading
import time
from typing import Any

from server_fixtures import ServerProcess, assert_idle, call, get_metrics, running_server

ARGS = ("--max-model-len", "2048", "--max-num-seqs", "1")


def post(server: ServerProcess, body: dict[str, Any]) -> tuple[int, Any]:
    return call(server, "/v1/completions", {"prompt": "The fox", "temperature": 0, **body})


def wait_for(server: ServerProcess, gauge: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while get_metrics(server)[f"hybridserve_num_requests_{gauge}"] < count:
        assert time.monotonic() < deadline, f"never {count} requests {gauge}"
        time.sleep(0.01)


def test_a_lower_priority_value_is_scheduled_first() -> None:
    with running_server(*ARGS, "--scheduling-policy", "priority") as server:
        finished: dict[str, float] = {}
        answers: dict[str, tuple[int, Any]] = {}

        def run(name: str, body: dict[str, Any]) -> None:
            answers[name] = post(server, body)
            finished[name] = time.monotonic()

        # one sequence runs at a time: a long one holds the seat while two more queue behind it
        long = threading.Thread(target=run, args=("long", {"max_tokens": 1500, "ignore_eos": True}))
        long.start()
        wait_for(server, "running", 1)
        # each queued request decodes long enough that the order of the finishes cannot be
        # swapped by when the client's threads happen to wake on a loaded machine
        late = {"max_tokens": 200, "ignore_eos": True}
        first = threading.Thread(target=run, args=("first", {**late, "priority": 5}))
        first.start()
        wait_for(server, "waiting", 1)
        second = threading.Thread(target=run, args=("second", {**late, "priority": -5}))
        second.start()
        wait_for(server, "waiting", 2)
        for t in (long, first, second):
            t.join(timeout=120)
        assert all(status == 200 for status, _ in answers.values()), answers
        assert "long" in finished and finished["long"] < finished["second"] < finished["first"]
        assert_idle(server)


def test_the_default_policy_refuses_a_priority_other_than_zero() -> None:
    with running_server(*ARGS) as server:
        status, err = post(server, {"max_tokens": 2, "priority": 1})
        assert status == 400 and err["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in err["error"]["message"]
        assert post(server, {"max_tokens": 2, "priority": 0})[0] == 200
        status, err = post(server, {"max_tokens": 2, "priority": 2**63})
        assert status == 400 and err["error"]["param"] == "priority"
        assert_idle(server)
