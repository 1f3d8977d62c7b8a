"""``AgentCheck``: HAProxy's agent check answered from the admission line, alone, in ``prazo serve``, and read by HAProxy.

The line: ``ready up N%`` with N the free share of the line's places (at
least 1), ``drain`` once the server shuts down or cannot count. Each server
``prazo serve`` runs answers it on ``--agent-port``; a real HAProxy reads it
and moves the server's weight, and sets it to DRAIN on SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _docs import fenced_blocks, section
from _helpers import wait_until
from _server_harness import CLIENT_TIMEOUT_S, TESTS_DIR, Burst, statuses
from _services import free_port, haproxy_binary
from prazo.bindings.servers.plumbing.agent_check import AgentCheck, agent_line
from prazo.bindings.servers.serve import main_serve

WAIT_S = 30.0
GUIDE = "docs/how-to/load-balancers.md"
_SERVE = (sys.executable, "-m", "prazo.bindings.servers.serve")


@pytest.mark.parametrize(
    ("stats", "line"),
    [
        ({"in_flight": 0, "queued": 0, "max_concurrency": 4, "max_queue": 4}, "ready up 100%"),
        ({"in_flight": 4, "queued": 0, "max_concurrency": 4, "max_queue": 4}, "ready up 50%"),
        ({"in_flight": 4, "queued": 2, "max_concurrency": 4, "max_queue": 4}, "ready up 25%"),
        ({"in_flight": 4, "queued": 4, "max_concurrency": 4, "max_queue": 4}, "ready up 1%"),
        ({"in_flight": 9, "queued": 9, "max_concurrency": 4, "max_queue": 4}, "ready up 1%"),
        ({}, "ready up 100%"),
        (None, "drain"),
    ],
)
def test_the_line_is_the_free_share_of_the_places(stats: dict[str, int] | None, line: str) -> None:
    assert agent_line(stats, draining=False) == line
    assert agent_line(stats, draining=True) == "drain"


def ask(port: int) -> str:
    """One agent check, as HAProxy makes it: connect, read the line, the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
        data = b""
        while chunk := sock.recv(256):
            data += chunk
    assert data.endswith(b"\n") and data.count(b"\n") == 1, data
    return data.decode("ascii").strip()


def test_a_responder_answers_each_connection_from_the_counters_now() -> None:
    counters = {"in_flight": 0, "queued": 0, "max_concurrency": 2, "max_queue": 2}
    failing = [False]

    def stats() -> dict[str, int]:
        if failing[0]:
            raise RuntimeError("not serving yet")
        return dict(counters)

    agent = AgentCheck(stats, host="127.0.0.1").start()
    try:
        assert ask(agent.port) == "ready up 100%"
        counters.update(in_flight=2, queued=1)
        assert ask(agent.port) == "ready up 25%"
        failing[0] = True
        assert ask(agent.port) == "drain"
        failing[0] = False
        assert ask(agent.port) == "ready up 25%"
        agent.mark_draining()
        assert ask(agent.port) == "drain"
        assert agent.answers == 5
    finally:
        agent.stop()
    with pytest.raises(OSError):
        ask(agent.port)


def test_wrong_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match="stats"):
        AgentCheck(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="draining"):
        AgentCheck(dict, draining=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        AgentCheck(dict, port=70000)


def test_gunicorn_is_refused_the_agent_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_serve(["os.path:join", "--server", "gunicorn", "--agent-port", "0"]) == 2
    assert "--agent-port is not for --server gunicorn" in capsys.readouterr().err


def serve(processes: list[subprocess.Popen[str]], *options: str) -> tuple[subprocess.Popen[str], int, int]:
    """``prazo serve`` with ``--agent-port 0`` and ``options``; the process, its port and its agent's port."""
    command = [*_SERVE, "_server_harness:app", "--port", "0", "--agent-port", "0", *options]
    process = subprocess.Popen(
        command, cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ)
    )
    processes.append(process)
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+) .* agent-check on port (\d+)", line)
    assert found, line
    return process, int(found.group(1)), int(found.group(2))


def test_the_page_runs_the_agent_port_and_the_backend_line_the_test_runs() -> None:
    page = section("## Telling HAProxy how full each server is: the agent check", GUIDE)
    assert "--agent-port 8001" in page and "agent-check agent-port 8001" in BACKEND


@pytest.mark.parametrize(
    "server", ["waitress", "werkzeug", "wsgiref", "cheroot", "prazo", "prazo-host"], ids=lambda name: name
)
def test_every_server_answers_its_weight_and_drains_on_sigterm(
    server: str, processes: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    options = ["--server", "prazo", "--workers", "2", "--threads", "1"] if server == "prazo-host" else [
        "--server", server, "--threads", "2"]  # fmt: skip
    process, port, agent_port = serve(processes, *options, "--max-queue", "2", "--shutdown-timeout", "30")
    assert ask(agent_port) == "ready up 100%"
    # Two requests hold both places until the gate opens: half the line is taken.
    gate = tmp_path / "gate"
    held = Burst(port, [f"/work?gate={gate}"] * 2)
    wait_until(lambda: ask(agent_port) == "ready up 50%", "the agent to count the two held requests", WAIT_S)
    process.send_signal(signal.SIGTERM)
    # The held requests keep the process draining: the balancer is told at once.
    wait_until(lambda: ask(agent_port) == "drain", "the agent to answer drain", WAIT_S)
    gate.touch()
    assert statuses(held.join()) == {200: 2}
    assert process.wait(WAIT_S) == 0


# The page's backend lines (docs/how-to/load-balancers.md), the addresses and the interval replaced.
(BACKEND,) = fenced_blocks(section("## Telling HAProxy how full each server is: the agent check", GUIDE), "cfg")
HAPROXY_CONFIG = """
global
    stats socket {socket} mode 600 level admin
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
frontend prazo_in
    bind 127.0.0.1:{bind}
    default_backend prazo
"""


def haproxy_server_state(control: Path) -> dict[str, str]:
    """HAProxy's ``show stat`` row of the page's server (``app1``), by column."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(CLIENT_TIMEOUT_S)
        sock.connect(str(control))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header, *rows = data.decode().splitlines()
    columns = header.lstrip("# ").split(",")
    for row in rows:
        values = dict(zip(columns, row.split(",")))
        if values.get("svname") == "app1":
            return values
    raise AssertionError(data)


def test_haproxy_moves_the_weight_and_drains_the_server(processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    process, port, agent_port = serve(
        processes, "--server", "prazo", "--threads", "2", "--max-queue", "2", "--shutdown-timeout", "30"
    )
    control = tmp_path / "haproxy.sock"
    config = tmp_path / "haproxy.cfg"
    backend = BACKEND.replace("10.0.0.11:8000", f"127.0.0.1:{port}").replace(
        "agent-port 8001", f"agent-port {agent_port}"
    )
    backend = backend.replace("agent-inter 1s", "agent-inter 100ms")
    config.write_text(HAPROXY_CONFIG.format(socket=control, bind=free_port()) + backend)
    haproxy: Any = subprocess.Popen(
        [haproxy_binary(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(control.exists, "HAProxy's stats socket", WAIT_S)
        wait_until(lambda: haproxy_server_state(control)["weight"] == "100", "the full weight", WAIT_S)
        gate = tmp_path / "gate"
        held = Burst(port, [f"/work?gate={gate}"] * 2)
        wait_until(lambda: haproxy_server_state(control)["weight"] == "50", "HAProxy to read half the line", WAIT_S)
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: haproxy_server_state(control)["status"].startswith("DRAIN"), "HAProxy to drain it", WAIT_S)
        gate.touch()
        assert statuses(held.join()) == {200: 2}
        assert process.wait(WAIT_S) == 0
    finally:
        haproxy.terminate()
        haproxy.wait(CLIENT_TIMEOUT_S)
