"""`hybridserve replicas` command line: the router's command it builds and the arguments it refuses,
without starting anything (the processes are in test_router.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybridserve.cli import build_parser, main
from hybridserve.deploy.replicas import _serve_args, parse_worker_urls, router_command
from hybridserve.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["replicas", *argv])


def _executable(folder: Path, name: str) -> str:
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_the_router_gets_the_workers_the_policy_and_the_health_interval(tmp_path: Path) -> None:
    router = _executable(tmp_path, "vllm-router")
    a = _args("--port", "9000", "--policy", "round_robin", "--router-bin", router)
    a.router_metrics_port, a.router_args = 29001, "--cache-threshold 0.5"
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert router_command(a, urls) == [
        router, "--host", "127.0.0.1", "--port", "9000", "--policy", "round_robin",
        "--worker-urls", *urls, "--health-check-interval-secs", "5", "--prometheus-port", "29001",
        "--cache-threshold", "0.5",
    ]  # fmt: skip


def test_sglangs_gateway_gets_its_launch_subcommand(tmp_path: Path) -> None:
    smg = _executable(tmp_path, "smg")
    assert router_command(_args("--router-bin", smg), ["http://h:1"])[:2] == [smg, "launch"]


def test_serve_args_come_after_the_double_dash() -> None:
    assert _serve_args(_args("--num-replicas", "3", "--", "demo", "--max-num-seqs", "8")) == [
        "demo",
        "--max-num-seqs",
        "8",
    ]
    assert _serve_args(_args("--worker-urls", "http://a:1")) == []


def test_a_config_file_s_flags_are_checked_and_passed_written_out(tmp_path: Path) -> None:
    """The replicas get the file's flags as arguments, and the ones a replica may not take are
    refused as if the command line gave them."""
    good = tmp_path / "good.yaml"
    good.write_text("model: demo\nmax-num-seqs: 8\n")
    assert _serve_args(_args("--", "--config", str(good))) == ["--max-num-seqs=8", "--model=demo"]
    assert _serve_args(_args("--", "mine", "--config", str(good))) == ["mine", "--max-num-seqs=8"]
    # a flag the command line gives in vLLM's underscore spelling wins over the file's too
    assert _serve_args(_args("--", "mine", "--max_num_seqs", "4", "--config", str(good))) == [
        "mine",
        "--max-num-seqs",
        "4",
    ]
    for text, message in (
        ("port: 9\n", "--port is set"),
        ("ssl-certfile: c.pem\n", "--ssl-certfile: the router"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            _serve_args(_args("--", "demo", "--config", str(bad)))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give the replicas' model after `--`"),
        (["--", "demo", "--port", "9"], "--port is set for each replica"),
        (["--", "demo", "--host=0.0.0.0"], "--host is set for each replica"),
        (["--", "demo", "--uds", "hs.sock"], "--uds is set for each replica"),
        (
            ["--", "demo", "--ssl-certfile=c.pem", "--ssl-keyfile", "k.pem"],
            "--ssl-certfile: the router reaches",
        ),
        (["--worker-urls", "http://a:1", "--", "demo"], "--worker-urls starts no replica"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _serve_args(_args(*argv))


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        ("foo", "'foo': expected http://HOST:PORT"),
        ("ftp://h:1", "'ftp://h:1': expected http://HOST:PORT"),
        ("http://:8000", "'http://:8000': expected"),
        ("http://h:port", "'http://h:port': the port is not a number"),
        ("http://h:70000", "'http://h:70000': the port"),
        ("http://h:0", "'http://h:0': the port"),
        ("http://h:", "'http://h:': the port"),
        ("http://h :1", "'http://h :1': expected"),
        (
            "http://h:1/v1",
            "'http://h:1/v1': expected http://HOST:PORT or https://HOST:PORT, a server's base URL",
        ),
        ("http://h:1?x=1", "a server's base URL"),
        ("http://u:p@h:1", "a server's base URL"),
        ("http://h:1,http://H:1/", "'http://h:1' and 'http://H:1' are one server"),
        (" , ", "no URL"),
    ],
)
def test_worker_urls_that_are_not_servers_base_urls_are_one_line_errors(
    urls: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # (refused before the router is looked for: the router would end with a traceback)
    assert main(["replicas", "--router-bin", "/nonexistent/router", "--worker-urls", urls]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert parse_worker_urls("http://a:1, https://b/ ,http://[::1]:8000") == [
        "http://a:1",
        "https://b",
        "http://[::1]:8000",
    ]


def test_a_missing_router_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["replicas", "--", "demo"]) == 2
    assert "vllm-router is not on PATH" in capsys.readouterr().err


def test_a_router_that_cannot_run_and_bad_router_args_are_usage_errors_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_executable = tmp_path / "router"
    not_executable.write_text("")
    for router in ("/nonexistent/vllm-router", str(not_executable), str(tmp_path)):
        assert main(["replicas", "--router-bin", router, "--", "demo"]) == 2
        assert f"--router-bin {router}: no such executable" in capsys.readouterr().err
    # executable but no program (a text file without an interpreter line): refused when it is
    # run, as the command's error, with no traceback
    not_a_program = tmp_path / "not-a-program"
    not_a_program.write_text("not a program\n")
    not_a_program.chmod(0o755)
    assert main(["replicas", "--router-bin", str(not_a_program), "--worker-urls", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert f"router: cannot run {not_a_program}: Exec format error" in err and "Traceback" not in err
    # an empty router address: refused, not every interface
    with pytest.raises(SystemExit) as exc:
        main(["replicas", "--host", "", "--", "demo"])
    assert exc.value.code == 2 and "--host: empty" in capsys.readouterr().err
    router = _executable(tmp_path, "vllm-router")
    assert main(["replicas", "--router-bin", router, "--router-args", "'unclosed", "--", "demo"]) == 2
    assert "--router-args: No closing quotation" in capsys.readouterr().err


def test_ports_that_clash_or_are_taken_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    router = _executable(tmp_path, "vllm-router")
    base = ["replicas", "--router-bin", router]
    assert main([*base, "--port", "18400", "--first-replica-port", "18400", "--", "demo"]) == 2
    assert "replica0's port 18400 is also --port" in capsys.readouterr().err
    assert main([*base, "--port", "18400", "--router-metrics-port", "18402", "--", "demo"]) == 2
    assert "replica1's port 18402 is also --router-metrics-port" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as free:  # (a free router port: the one next to `port` may be taken)
            free.bind(("127.0.0.1", 0))
            router_port = free.getsockname()[1]
        argv = [*base, "--num-replicas", "1", "--port", str(router_port)]
        assert main([*argv, "--first-replica-port", str(port), "--", "demo"]) == 2
        assert f"replica0's port {port}: the port is already in use" in capsys.readouterr().err
        assert main([*base, "--port", str(port), "--worker-urls", "http://127.0.0.1:9"]) == 2
        assert f"--port {port}: the port is already in use" in capsys.readouterr().err


def test_a_replica_may_drain_for_its_own_shutdown_timeout(tmp_path: Path) -> None:
    from hybridserve.deploy.replicas import STOP_MARGIN_S, replica_stop_timeout

    assert replica_stop_timeout(["demo", "--shutdown-timeout", "300"]) == 300 + STOP_MARGIN_S
    assert replica_stop_timeout(["demo"]) == 5 + STOP_MARGIN_S  # (serve's default)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("shutdown-timeout: 90\n")
    serve = _serve_args(_args("--", "demo", "--config", str(cfg)))
    assert replica_stop_timeout(serve) == 90 + STOP_MARGIN_S


def test_each_replica_publishes_kv_events_on_addresses_of_its_own(tmp_path: Path) -> None:
    """As vLLM's data-parallel ranks: replica i's tcp:// ports + i, its ipc:// paths + `_dp{i}`
    (the same addresses in every replica would stop all but the first from starting). Ports that
    the offsets make clash are refused before anything starts."""
    import json

    from hybridserve.deploy.replicas import check_kv_event_ports, replica_serve_args

    on = {"enable_kv_cache_events": True}
    serve = _serve_args(
        _args("--", "demo", "--kv-events-config", json.dumps({**on, "replay_endpoint": "tcp://*:5560"}))
    )
    assert replica_serve_args(serve, 0) == serve
    assert json.loads(replica_serve_args(serve, 2)[2]) == {
        **on, "replay_endpoint": "tcp://*:5562", "endpoint": "tcp://*:5559",
    }  # fmt: skip
    ipc = f"--kv-events-config={json.dumps({**on, 'endpoint': f'ipc://{tmp_path}/kv'})}"
    assert replica_serve_args(["demo", ipc], 1)[1].endswith(f'"endpoint": "ipc://{tmp_path}/kv_dp1"}}')
    off = ["demo", "--kv-events-config", '{"endpoint": "tcp://*:5557"}']
    assert replica_serve_args(off, 1) == off
    check_kv_event_ports(serve, [8001, 8002, 8003])
    # vLLM's example, endpoint 5557 and replay_endpoint 5558: replica 1 would publish on replica 0's replay port
    close = _serve_args(
        _args("--", "demo", "--kv-events-config", json.dumps({**on, "replay_endpoint": "tcp://*:5558"}))
    )
    with pytest.raises(
        ConfigError, match="replica1's --kv-events-config endpoint tcp://\\*:5558 is also replica0's"
    ):
        check_kv_event_ports(close, [8001, 8002])
    # a port the offset takes past 65535: refused before replica 0 loads
    last = _serve_args(
        _args("--", "demo", "--kv-events-config", json.dumps({**on, "endpoint": "tcp://*:65535"}))
    )
    with pytest.raises(ConfigError, match="replica1's --kv-events-config, its ports \\+ 1: .*65536"):
        check_kv_event_ports(last, [8001, 8002])


def test_kv_event_ports_are_checked_against_the_router_s_and_ports_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KV-event port that is the router's port or its metrics port (the router then failed
    after the replicas had loaded), or one already in use (replica 0 exited), is refused before
    anything starts, naming --kv-events-config."""
    import json
    import socket

    router = _executable(tmp_path, "vllm-router")
    on = {"enable_kv_cache_events": True}

    def run(endpoint: str, *extra: str) -> str:
        cfg = json.dumps({**on, "endpoint": endpoint})
        argv = [
            "replicas",
            "--router-bin",
            router,
            "--port",
            "9100",
            *extra,
            "--",
            "demo",
            "--kv-events-config",
            cfg,
        ]
        assert main(argv) == 2
        return capsys.readouterr().err

    assert "replica0's --kv-events-config endpoint tcp://*:9100 is also --port" in run("tcp://*:9100")
    err = run("tcp://*:9090", "--router-metrics-port", "9091", "--num-replicas", "2")
    assert "replica1's --kv-events-config endpoint tcp://*:9091 is also --router-metrics-port" in err
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = run(f"tcp://*:{port}", "--router-metrics-port", "9091")
        assert f"replica0's --kv-events-config endpoint tcp://*:{port}: the port is already in use" in err
        # an endpoint the replicas connect to is a subscriber's, which binds it: not refused
        from hybridserve.deploy.replicas import check_kv_event_ports

        cfg = json.dumps({**on, "endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": None})
        check_kv_event_ports(["demo", "--kv-events-config", cfg], [8001])


def test_the_router_s_default_metrics_port_is_checked_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --router-metrics-port the router serves its metrics on 29000 and panics when that
    is taken (a second router on the machine), after the replicas have loaded: refused first."""
    import socket

    from hybridserve.deploy import replicas

    router = _executable(tmp_path, "vllm-router")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(replicas, "ROUTER_METRICS_PORT", port)
        assert main(["replicas", "--router-bin", router, "--worker-urls", "http://127.0.0.1:9"]) == 2
        assert (
            f"the router's metrics port (its default; give --router-metrics-port) {port}: the port is already in use"
            in capsys.readouterr().err
        )
    # (the router's own flag in --router-args is left to it)
    checked: list[int] = []
    monkeypatch.setattr(replicas, "_in_use", lambda host, p: checked.append(p) or False)
    replicas.check_ports(_args("--router-args", f"--prometheus-port {port}", "--port", "9000"), [])
    assert checked == [9000]
