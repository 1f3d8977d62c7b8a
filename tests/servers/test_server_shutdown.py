"""What each embedding does when it stops, as the shutdown table of docs/how-to/servers.md promises.

Admitted requests (running and queued) are held at a gate while the server
stops, so "during the drain" never depends on timing: the server cannot
finish stopping before the test opens the gate. gunicorn runs as a real
``gunicorn -k prazo.bindings.servers.gunicorn.AdmissionWorker`` subprocess and is
stopped with signals.
"""

from __future__ import annotations

import http.client
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import wait_until
from _server_harness import (
    CLIENT_TIMEOUT_S,
    SERVER_KINDS,
    Burst,
    RunningServer,
    connection_refused,
    request,
    run_waitress_until,
    start_server,
    statuses,
)

# Held requests wait at the gate for as long as a test needs: far beyond the
# budget of the default.
BUDGET_MS = 30000


def _held_running_and_queued(server: RunningServer, tmp_path: Path) -> tuple[Burst, Path]:
    """One request running and two queued (threads=1, max_queue=2), all held until the gate opens."""
    gate, mark = tmp_path / "gate", tmp_path / "running"
    offered_before = server.stats()["offered"] if server.stats else 0
    burst = Burst(server.port, [f"/work?gate={gate}&mark={mark}"] * 3)
    wait_until(mark.exists, "the first request to run the app")
    server.wait_offered(offered_before + 3)
    if server.stats is None:
        # gunicorn: the two others must have been accepted before it stops;
        # a longer pause than the harness's, as nothing can be observed.
        time.sleep(1.0)
    assert not burst.outcomes and not burst.errors
    return burst, gate


def _stop_in_background(server: RunningServer, *how: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    stopper = threading.Thread(target=lambda: result.append(server.stop(*how)), name="stopper", daemon=True)
    stopper.start()
    return stopper, result


def _wait_refused(port: int) -> bool:
    end = time.monotonic() + CLIENT_TIMEOUT_S
    while time.monotonic() < end:
        if connection_refused(port):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_graceful_stop_finishes_running_and_queued_requests_and_refuses_new_connections(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    """waitress ``shutdown(server)``, werkzeug/wsgiref ``shutdown()``, cheroot ``stop()``, gunicorn SIGTERM."""
    server = start_server(kind, threads=1, max_queue=2, default_budget_ms=BUDGET_MS)
    servers.append(server)
    burst, gate = _held_running_and_queued(server, tmp_path)

    stopper, result = _stop_in_background(server)
    # The listening socket closes when the drain starts, not when it ends:
    # every admitted request is still held at the gate.
    assert _wait_refused(server.port), "new connections were never refused during the drain"
    assert not burst.outcomes and not burst.errors

    gate.touch()
    assert statuses(burst.join()) == {200: 3}
    stopper.join(CLIENT_TIMEOUT_S)
    assert not stopper.is_alive()
    if kind == "gunicorn":
        assert result == [0]
    elif kind == "waitress":
        assert result == [True]


def test_gunicorn_sigint_is_a_quick_stop_queued_requests_get_503_running_ones_are_cut(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    server = start_server("gunicorn", threads=1, max_queue=2, default_budget_ms=BUDGET_MS)
    servers.append(server)
    burst, gate = _held_running_and_queued(server, tmp_path)

    stopper, result = _stop_in_background(server, signal.SIGINT)
    stopper.join(CLIENT_TIMEOUT_S)
    assert result == [0]
    outcomes = burst.wait(3)
    assert [(outcome.status, outcome.reason) for outcome in outcomes] == [(503, "shutting-down")] * 2
    # The running request never finished: its connection closed without an answer.
    assert len(burst.errors) == 1 and isinstance(burst.errors[0], (http.client.HTTPException, OSError))
    assert connection_refused(server.port)
    gate.touch()


def test_waitress_ctrl_c_drain_answers_new_connections_503_shutting_down(tmp_path: Path) -> None:
    """``run()`` ending on SystemExit (Ctrl-C, SIGTERM under ``prazo serve``) keeps the listener open to refuse politely."""
    from _server_harness import app
    from prazo.bindings.servers.waitress import create_server

    server = create_server(app, host="127.0.0.1", port=0, threads=1, max_queue=2, default_budget_ms=BUDGET_MS)
    port = server.effective_port
    dispatcher = server.task_dispatcher
    gate, mark = tmp_path / "gate", tmp_path / "running"
    burst = Burst(port, [f"/work?gate={gate}&mark={mark}"] * 3)
    stop_requested = threading.Event()

    runner = run_waitress_until(server, stop_requested)
    try:
        wait_until(lambda: mark.exists() and dispatcher.stats()["offered"] >= 3, "three requests admitted")
        stop_requested.set()
        wait_until(lambda: dispatcher.dispatcher.queue.is_shutdown, "the drain to start")
        late = request(port, "/work")
        assert (late.status, late.reason) == (503, "shutting-down")
        assert not burst.outcomes
    finally:
        gate.touch()
    assert statuses(burst.join()) == {200: 3}
    runner.join(CLIENT_TIMEOUT_S)
    assert not runner.is_alive()
    server.close()


def test_waitress_shutdown_answers_a_kept_alive_connection_503_shutting_down(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    server = start_server("waitress", threads=1, max_queue=2, default_budget_ms=BUDGET_MS)
    servers.append(server)
    kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    kept.request("GET", "/calls")
    kept.getresponse().read()
    server.settle()
    burst, gate = _held_running_and_queued(server, tmp_path)

    stopper, _ = _stop_in_background(server)
    try:
        assert _wait_refused(server.port)
        kept.request("GET", "/work")
        answer = kept.getresponse()
        answer.read()
        assert (answer.status, answer.getheader("X-Prazo-Reason")) == (503, "shutting-down")
    finally:
        kept.close()
        gate.touch()
    assert statuses(burst.join()) == {200: 3}
    stopper.join(CLIENT_TIMEOUT_S)
    assert not stopper.is_alive()


@pytest.mark.parametrize("kind", ("werkzeug", "wsgiref", "cheroot"))
def test_a_connection_open_but_without_a_request_is_closed_when_the_drain_starts(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    server = start_server(kind, threads=1, max_queue=2, default_budget_ms=BUDGET_MS)
    servers.append(server)
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
    partial = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
    partial.sendall(b"GET /work HTTP/1.1\r\nHost: te")
    burst, gate = _held_running_and_queued(server, tmp_path)

    stopper, _ = _stop_in_background(server)
    try:
        for sock in (idle, partial):
            try:
                assert sock.recv(65536) == b""
            except ConnectionResetError:
                pass
        assert not burst.outcomes
    finally:
        idle.close()
        partial.close()
        gate.touch()
    assert statuses(burst.join()) == {200: 3}
    stopper.join(CLIENT_TIMEOUT_S)
    assert not stopper.is_alive()
