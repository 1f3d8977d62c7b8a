"""``prazo serve``: each server as a real process, its startup line, serving, and a graceful SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _server_harness import CLIENT_TIMEOUT_S, SERVER_KINDS, TESTS_DIR, Burst, request, statuses
from prazo.bindings.servers.plumbing.app_loader import load_app
from prazo.bindings.servers.serve import main_serve

# `prazo serve` as a deployment without prazo.bench runs it.
_SERVE = (sys.executable, "-m", "prazo.bindings.servers.serve")


# "prazo": the front door, which is no embedding of another server but serves the same way.
@pytest.mark.parametrize("kind", [*SERVER_KINDS, "prazo"])
def test_serve_announces_its_limits_serves_and_stops_gracefully_on_sigterm(
    kind: str, processes: list[subprocess.Popen]
) -> None:
    command = [
        *_SERVE, "_server_harness:app", "--server", kind, "--port", "0",
        "--threads", "2", "--max-queue", "3", "--default-budget-ms", "1500", "--shutdown-timeout", "10",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ)
    )
    processes.append(process)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert f"with {kind}" in line
    assert "threads=2 max_queue=3 (capacity 5) default_budget_ms=1500 max_budget_ms=30000" in line
    match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
    assert match, line
    port = int(match.group(1))

    end = time.monotonic() + CLIENT_TIMEOUT_S
    while True:  # gunicorn's worker boots after the line is printed
        try:
            first = request(port, "/work")
            break
        except OSError:
            assert time.monotonic() < end and process.poll() is None, "the server never answered"
            time.sleep(0.05)
    assert first.status == 200 and 1000 < int(first.body.split(b"=")[1]) <= 1500

    burst = Burst(port, ["/work?ms=300"] * 4)
    time.sleep(1.0)  # generous: four loopback requests reach the queue in milliseconds
    process.send_signal(signal.SIGTERM)
    assert statuses(burst.join()) == {200: 4}
    assert process.wait(CLIENT_TIMEOUT_S) == 0


@pytest.mark.parametrize("kind", ["waitress", "prazo"])
def test_serve_starts_with_codel_variables_meant_for_another_service(
    kind: str, processes: list[subprocess.Popen]
) -> None:
    """One environment file for several services: CoDel variables without ``--order adaptive`` only warn."""
    command = [*_SERVE, "_server_harness:app", "--server", kind, "--port", "0", "--threads", "1"]
    env = {**os.environ, "PRAZO_CODEL_TARGET_MS": "7", "PRAZO_CODEL_INTERVAL_MS": "250"}
    env.pop("PRAZO_ORDER", None)
    process = subprocess.Popen(
        command, cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    processes.append(process)
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
    assert match, (line, process.stderr.read() if process.poll() is not None else "")
    assert request(int(match.group(1)), "/calls").status == 200
    process.send_signal(signal.SIGTERM)
    assert process.wait(CLIENT_TIMEOUT_S) == 0
    warnings = process.stderr.read()
    assert "PRAZO_CODEL_TARGET_MS=7 ignored" in warnings and "PRAZO_CODEL_INTERVAL_MS=250 ignored" in warnings


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no_such_module_anywhere:app"], "cannot import 'no_such_module_anywhere'"),
        (["_server_harness"], "app must look like MODULE:APP"),
        (["_server_harness:nothing"], "has no attribute 'nothing'"),
        (["_server_harness:TESTS_DIR"], "is not a WSGI callable"),
        (["_server_harness:app", "--max-queue", "-1"], "--max-queue must be >= 0"),
        (["_server_harness:app", "--threads", "0"], "--threads must be >= 1"),
        (["_server_harness:app", "--default-budget-ms", "nan"], "--default-budget-ms must not be NaN"),
        (["_server_harness:app", "--max-budget-ms", "0"], "--max-budget-ms must be > 0"),
        (["_server_harness:app", "--workers", "0"], "--workers must be >= 1"),
        (
            ["_server_harness:app", "--default-budget-ms", "100", "--max-budget-ms", "10"],
            "default_budget_ms (--default-budget-ms, $PRAZO_DEFAULT_BUDGET_MS) must be <= max_budget_ms",
        ),
        (["_server_harness:app", "--port", "70000"], "--port must be between 0 and 65535"),
        (["_server_harness:app", "--header-timeout-ms", "-1"], "--header-timeout-ms must be > 0, got -1.0"),
        (["_server_harness:app", "--workers", "2"], "--workers is for --server gunicorn or prazo only"),
        (["_server_harness:app", "--preload"], "--preload is for --server prazo --workers N only"),
        (["_server_harness:app", "--server", "prazo", "--preload"], "--preload is for --server prazo --workers N only"),
        (["_server_harness:app", "--max-requests", "5"], "--max-requests is for --server prazo --workers N only"),
        (
            ["_server_harness:app", "--server", "prazo", "--workers", "2", "--max-requests", "0"],
            "--max-requests must be >= 1",
        ),
        (
            ["_server_harness:app", "--server", "prazo", "--workers", "2", "--max-requests-jitter", "5"],
            "--max-requests-jitter spreads --max-requests: give --max-requests too",
        ),
        (
            [
                "_server_harness:app",
                "--server",
                "prazo",
                "--workers",
                "2",
                "--max-requests",
                "5",
                "--max-requests-jitter",
                "-1",
            ],
            "--max-requests-jitter must be >= 0",
        ),
        (["no-colon", "--server", "prazo", "--workers", "2"], "app must look like MODULE:APP"),
        (
            ["_server_harness:app", "--server", "prazo", "--workers", "2", "--threads", "2", "--reserved", "4"],
            "must be < threads x workers (4), got 4",
        ),
        (["_server_harness:app", "--trust-request-start", "--trusted-proxy", "nope"], "--trusted-proxy: 'nope'"),
        (["_server_harness:app", "--trust-request-start", "--max-upstream-ms", "-5"], "--max-upstream-ms must be >= 0"),
    ],
)
def test_bad_options_exit_2_naming_the_problem(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    assert main_serve(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--trusted-proxy", "bogus"], "--trusted-proxy: 'bogus' is not an IP address or network"),
        (["--trusted-proxy", "10.0.0.0/8", "--trusted-proxy", "10.0.0.300"], "--trusted-proxy: '10.0.0.300'"),
        (["--max-upstream-ms", "-5"], "--max-upstream-ms must be >= 0, got -5.0"),
        (["--max-upstream-ms", "nan"], "--max-upstream-ms must not be NaN"),
    ],
)
def test_front_proxy_options_are_refused_without_trust_request_start(options: list[str], message: str) -> None:
    """Through the installed ``prazo`` command: exit 2 and the option named, before anything listens.

    Before the fix these started serving (the options were only checked with
    --trust-request-start), so the timeout is the failure.
    """
    prazo = Path(sys.executable).with_name("prazo")
    command = [str(prazo), "serve", "_server_harness:app", "--port", "0", *options]
    result = subprocess.run(
        command, check=False, cwd=TESTS_DIR, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )
    assert result.returncode == 2
    assert f"prazo serve: error: {message}" in result.stderr
    assert result.stdout == ""  # no start-up line: nothing was served


def test_load_app_follows_dotted_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(TESTS_DIR)
    assert load_app("_server_harness:app").__name__ == "app"
    assert load_app("os.path:join") is os.path.join
