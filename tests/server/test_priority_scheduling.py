"""vLLM's `priority` request field against real servers: with --scheduling-policy priority a
waiting request of a lower value is scheduled before one that arrived earlier; with the default
(fcfs) a non-zero priority is a 400 and 0 is accepted."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any

from server_fixtures import ServerProcess, assert_idle, call, get_metrics, running_server

ARGS = ("--max-model-len", "2048", "--max-num-seqs", "1")
SEAT_ARGS = ("--max-model-len", "4096", "--max-num-seqs", "1")


def post(server: ServerProcess, body: dict[str, Any]) -> tuple[int, Any]:
    return call(server, "/v1/completions", {"prompt": "The fox", "temperature": 0, **body})


def wait_for(server: ServerProcess, gauge: str, count: int, unless: threading.Event | None = None) -> bool:
    """Waits until `count` requests are `gauge` (True), or `unless` is set first (False)."""
    deadline = time.monotonic() + 30
    while get_metrics(server)[f"hybridserve_num_requests_{gauge}"] < count:
        if unless is not None and unless.is_set():
            return False
        assert time.monotonic() < deadline, f"never {count} requests {gauge}"
        time.sleep(0.01)
    return True


def test_a_lower_priority_value_is_scheduled_first() -> None:
    with running_server(*SEAT_ARGS, "--scheduling-policy", "priority") as server:
        for _ in range(3):
            if _priority_round(server):
                break
        else:
            raise AssertionError("the seat's answer ended before two requests waited, three times")
        assert_idle(server)


def _priority_round(server: ServerProcess) -> bool:
    """One sequence runs at a time: a streamed answer as long as the context allows holds the seat
    while two more requests queue behind it, and leaves (its client hangs up) once both wait; the
    one of the lower priority value must then finish first. False where the seat's answer ended
    before both waited (the native decode step takes well under a millisecond per token: a busy
    client can be that late), so that the order tells nothing."""
    finished: dict[str, float] = {}
    answers: dict[str, tuple[int, Any]] = {}

    def run(name: str, body: dict[str, Any]) -> None:
        answers[name] = post(server, body)
        finished[name] = time.monotonic()

    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    seat = http.client.HTTPConnection(host, int(port), timeout=120)
    seat.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "The fox", "max_tokens": 4000, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"},
    )
    reply = seat.getresponse()
    assert reply.status == 200
    seat_ended = threading.Event()

    def read_seat() -> None:
        try:
            while reply.read(65536):
                pass
        except (OSError, ValueError, http.client.HTTPException):
            pass  # (hung up below)
        seat_ended.set()

    reader = threading.Thread(target=read_seat)
    reader.start()
    wait_for(server, "running", 1)
    # each queued request decodes long enough that the order of the finishes cannot be
    # swapped by when the client's threads happen to wake on a loaded machine
    late = {"max_tokens": 200, "ignore_eos": True}
    first = threading.Thread(target=run, args=("first", {**late, "priority": 5}))
    first.start()
    both_waited = wait_for(server, "waiting", 1, unless=seat_ended)
    second = threading.Thread(target=run, args=("second", {**late, "priority": -5}))
    second.start()
    # (two waiting with one seat: the seat's answer was running while both queued)
    both_waited = both_waited and wait_for(server, "waiting", 2, unless=seat_ended)
    assert seat.sock is not None
    seat.sock.shutdown(socket.SHUT_RDWR)  # the client hangs up; the reader sees the end
    for t in (first, second, reader):
        t.join(timeout=120)
    seat.close()
    assert all(status == 200 for status, _ in answers.values()), answers
    if not both_waited:
        return False
    assert finished["second"] < finished["first"]
    return True


def test_the_default_policy_refuses_a_priority_other_than_zero() -> None:
    with running_server(*ARGS) as server:
        status, err = post(server, {"max_tokens": 2, "priority": 1})
        assert status == 400 and err["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in err["error"]["message"]
        assert post(server, {"max_tokens": 2, "priority": 0})[0] == 200
        status, err = post(server, {"max_tokens": 2, "priority": 2**63})
        assert status == 400 and err["error"]["param"] == "priority"
        assert_idle(server)
