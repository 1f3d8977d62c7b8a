"""Every server embedding, on loopback with real HTTP: the same scenarios for each server.

waitress, werkzeug, wsgiref and cheroot run in this process; gunicorn runs as
a real ``gunicorn -k prazo.bindings.servers.gunicorn.AdmissionWorker`` subprocess.
All of them serve ``_server_harness.app``. Timing never decides an outcome:
requests are held at a gate file the test opens, and every wait is bounded
generously.
"""

from __future__ import annotations

import http.client
import re
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
    SOCKET_KINDS,
    Burst,
    RunningServer,
    request,
    run_waitress_until,
    start_server,
    statuses,
)


def _start(servers: list[RunningServer], kind: str, **limits: int) -> RunningServer:
    server = start_server(kind, **limits)
    servers.append(server)
    return server


def _hold(server: RunningServer, tmp_path: Path, name: str = "holder") -> tuple[Burst, Path]:
    """One request that occupies a worker until the returned gate file is created.

    A server may release the slot of the request before it (e.g. the start-up
    probe) a moment after the client read its answer; on a loaded machine the
    holder can arrive in that moment and be refused, so it tries again.
    """
    gate, mark = tmp_path / f"{name}.gate", tmp_path / f"{name}.running"
    for _ in range(20):
        holder = Burst(server.port, [f"/work?gate={gate}&mark={mark}"])
        wait_until(lambda h=holder: mark.exists() or h.outcomes or h.errors, f"{name} to run the app")
        if mark.exists():
            return holder, gate
        assert statuses(holder.join()) == {503: 1}, "the holder may only be refused for a slot not yet released"
        time.sleep(0.05)
    raise AssertionError(f"{name} was refused 20 times in a row")


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_burst_beyond_capacity_gets_exactly_the_excess_refused_at_once(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    threads, max_queue, excess = 2, 3, 4
    server = _start(servers, kind, threads=threads, max_queue=max_queue)
    calls_before = server.calls()
    gate = tmp_path / "gate"
    burst = Burst(server.port, [f"/work?gate={gate}"] * (threads + max_queue + excess))

    # Every admitted request is still held in the app: the refusals cannot
    # have waited for a worker.
    early = burst.wait(excess)
    assert statuses(early) == {503: excess}
    assert {outcome.reason for outcome in early} == {"queue-full"}

    gate.touch()
    outcomes = burst.join()
    assert statuses(outcomes) == {200: threads + max_queue, 503: excess}
    assert server.calls() - calls_before == threads + max_queue


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_budget_running_out_in_the_queue_is_a_504_without_the_app(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    server = _start(servers, kind, threads=1, max_queue=4)
    calls_before = server.calls()
    holder, gate = _hold(server, tmp_path)

    waiting = Burst(server.port, ["/work"] * 3, headers={"X-Request-Budget-Ms": "300"})
    outcomes = waiting.wait(3)
    assert statuses(outcomes) == {504: 3}
    assert {outcome.reason for outcome in outcomes} == {"expired-in-queue"}
    # Answered at their own deadline, while the worker is still busy.
    assert all(0.25 <= outcome.elapsed_s < CLIENT_TIMEOUT_S / 2 for outcome in outcomes)

    gate.touch()
    assert statuses(holder.join()) == {200: 1}
    assert server.calls() - calls_before == 1


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_seed_scenario_4_threads_queue_20_gives_24_ok_and_16_refused(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    """The seed article's numbers: 40 simultaneous requests, 300 ms each, a 2 s budget.

    On a quiet machine all 24 admitted requests answer 200 (six waves of four
    end by 1.8 s). The last wave has only 200 ms to spare, though, so on a
    loaded machine it may start after its deadline: then it must be answered
    504 and never run. What admission guarantees is asserted exactly: 16
    refusals at once, no 504 before the budget was really spent, and the app
    ran for the 200s only.
    """
    server = _start(servers, kind, threads=4, max_queue=20)
    calls_before = server.calls()
    gate = tmp_path / "gate"
    burst = Burst(server.port, [f"/work?ms=300&gate={gate}"] * 40, headers={"X-Request-Budget-Ms": "2000"})
    # The first wave waits at the gate until all 16 refusals are out, so the
    # split never depends on how fast the machine reads 40 connections.
    early = burst.wait(16)
    assert statuses(early) == {503: 16}
    gate.touch()
    outcomes = burst.join()
    counts = statuses(outcomes)
    assert counts[503] == 16
    assert counts[200] + counts.get(504, 0) == 24
    assert counts[200] >= 4  # the first wave starts at once
    late = [outcome for outcome in outcomes if outcome.status == 504]
    assert all(outcome.reason == "expired-in-queue" and outcome.elapsed_s >= 2.0 for outcome in late), late
    assert server.calls() - calls_before == counts[200]


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_graceful_shutdown_loses_no_admitted_request(kind: str, servers: list[RunningServer]) -> None:
    server = _start(servers, kind, threads=2, max_queue=4)
    offered_before = server.stats()["offered"] if server.stats else 0
    burst = Burst(server.port, ["/work?ms=300"] * 6)
    server.wait_offered(offered_before + 6)

    result = server.stop()

    outcomes = burst.join()
    assert statuses(outcomes) == {200: 6}
    if kind == "gunicorn":
        assert result == 0
    elif kind == "waitress":
        assert result is True
    with pytest.raises(OSError):
        request(server.port, "/calls")


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_client_uploading_a_large_body_to_a_full_server_reads_the_503(
    kind: str, servers: list[RunningServer], tmp_path: Path
) -> None:
    server = _start(servers, kind, threads=1, max_queue=0)
    holder, gate = _hold(server, tmp_path)
    size = 8 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"POST /work HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % size)
        # A reset would surface here (EPIPE/ECONNRESET) or in the read below.
        sock.sendall(b"x" * size)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = response.read()
    assert response.status == 503, body
    assert response.getheader("X-Prazo-Reason") == "queue-full"
    assert response.getheader("Retry-After") == "1"
    gate.touch()
    assert statuses(holder.join()) == {200: 1}


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_app_runs_with_the_request_budget_and_a_spent_budget_never_runs_it(
    kind: str, servers: list[RunningServer]
) -> None:
    server = _start(servers, kind, threads=2, max_queue=2, default_budget_ms=1000, max_budget_ms=5000)
    calls_before = server.calls()

    asked = request(server.port, "/work", headers={"X-Request-Budget-Ms": "700"})
    assert asked.status == 200
    assert 0 < int(asked.body.split(b"=")[1]) <= 700
    capped = request(server.port, "/work", headers={"X-Request-Budget-Ms": "999999"})
    assert 4000 < int(capped.body.split(b"=")[1]) <= 5000
    default = request(server.port, "/work", headers={"X-Request-Budget-Ms": "soon"})
    assert 0 < int(default.body.split(b"=")[1]) <= 1000

    spent = request(server.port, "/work", headers={"X-Request-Budget-Ms": "0"})
    assert (spent.status, spent.reason) == (504, "expired-on-arrival")
    assert server.calls() - calls_before == 3


@pytest.mark.parametrize("kind", SOCKET_KINDS)
def test_head_arriving_in_pieces_gets_its_deadline_from_the_whole_head(kind: str, servers: list[RunningServer]) -> None:
    """The first bytes arrive without the budget: the deadline counts from them, once the whole head is there."""
    server = _start(servers, kind, threads=1, max_queue=2)
    calls_before = server.calls()

    def send_in_pieces(budget_ms: int) -> http.client.HTTPResponse:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
        sock.sendall(b"GET /work HTTP/1.1\r\nHost: test\r\n")
        time.sleep(0.4)
        sock.sendall(b"X-Request-Budget-Ms: %d\r\nConnection: close\r\n\r\n" % budget_ms)
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.read()
        sock.close()
        return response

    late = send_in_pieces(150)  # its budget ran out while its head was still arriving
    assert (late.status, late.getheader("X-Prazo-Reason")) == (504, "expired-on-arrival")
    assert send_in_pieces(5000).status == 200
    assert server.calls() - calls_before == 1


def test_waitress_keeps_the_connection_after_a_refusal(servers: list[RunningServer], tmp_path: Path) -> None:
    server = _start(servers, "waitress", threads=1, max_queue=0)
    holder, gate = _hold(server, tmp_path)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    conn.request("GET", "/work")
    refused = conn.getresponse()
    refused.read()
    assert refused.status == 503
    assert refused.getheader("Connection") != "close"
    gate.touch()
    assert statuses(holder.join()) == {200: 1}
    # The same connection serves the next request. The holder's slot is freed
    # a moment after its client read the answer, so a request sent in that
    # moment is (rightly) refused again: retry, still on this connection.
    for _ in range(50):
        conn.request("GET", "/calls")
        answer = conn.getresponse()
        answer.read()
        if answer.status != 503:
            break
        time.sleep(0.02)
    assert answer.status == 200
    conn.close()


def test_waitress_refusal_observer_gets_what_waitress_read_of_the_request(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    """The environ of a refusal, built in waitress's I/O thread: headers, path, method, peer, budget source."""
    from prazo.bindings.wsgi import BUDGET_SOURCE_KEY, OUTCOME_REFUSED, set_admission_observer

    server = _start(servers, "waitress", threads=1, max_queue=0)
    holder, gate = _hold(server, tmp_path)
    refusals: list[tuple[dict[str, str], BaseException | None]] = []

    def observer(
        environ: dict[str, Any] | None,
        outcome: str,
        arrival_ns: int | None,
        deadline_ns: int,
        queue_wait_ns: int,
        refusal: BaseException | None,
    ) -> None:
        if outcome == OUTCOME_REFUSED:
            assert environ is not None
            refusals.append((dict(environ), refusal))

    previous = set_admission_observer(observer)
    try:
        headers = {"X-Request-Budget-Ms": "5000", "X-Custom-Thing": "some value"}
        refused = request(server.port, "/refused?x=1", headers, method="POST", body=b"payload")
    finally:
        set_admission_observer(previous)
        gate.touch()
    assert (refused.status, refused.reason) == (503, "queue-full")
    assert statuses(holder.join()) == {200: 1}
    assert len(refusals) == 1
    environ, refusal = refusals[0]
    assert type(refusal).__name__ == "QueueFull"
    assert environ["REQUEST_METHOD"] == "POST"
    assert environ["PATH_INFO"] == "/refused"
    assert environ["REMOTE_ADDR"] == "127.0.0.1"
    assert environ["HTTP_X_CUSTOM_THING"] == "some value"
    assert environ["HTTP_X_REQUEST_BUDGET_MS"] == "5000"
    assert environ["HTTP_HOST"].startswith("127.0.0.1")
    assert environ[BUDGET_SOURCE_KEY] == "X-Request-Budget-Ms"


def test_waitress_answers_pipelined_requests_refused_one_after_another(
    servers: list[RunningServer], tmp_path: Path
) -> None:
    """Each refusal's answer offers the next pipelined request, refused in turn, in the I/O thread."""
    server = _start(servers, "waitress", threads=1, max_queue=0)
    holder, gate = _hold(server, tmp_path)
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"GET /work HTTP/1.1\r\nHost: test\r\n\r\n" * 3)
        received = b""
        while received.count(b"503 Service Unavailable: queue-full\n") < 3:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    answers = [int(status) for status in re.findall(rb"^HTTP/1\.1 (\d{3}) ", received, re.MULTILINE)]
    assert answers == [503, 503, 503]
    gate.touch()
    assert statuses(holder.join()) == {200: 1}


def test_waitress_serves_pipelined_requests_on_one_slot_one_after_another(servers: list[RunningServer]) -> None:
    """A request's slot is held until waitress's worker is done with it, yet the next pipelined request gets it.

    One slot and no waiting place: waitress's worker offers each pipelined
    request itself, at the end of the one before; that one's slot is given
    back first, so none is refused.
    """
    server = _start(servers, "waitress", threads=1, max_queue=0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        reader = sock.makefile("rb")
        sock.sendall(b"GET /work HTTP/1.1\r\nHost: test\r\n\r\n" * 4 + b"GET /calls HTTP/1.1\r\nHost: test\r\n\r\n")
        answers = _read_answers(reader, 5)
        reader.close()
    assert [status for status, _ in answers] == [200] * 5
    assert server.stats is not None
    wait_until(lambda: server.stats()["in_flight"] == 0, "the last slot to be given back")  # type: ignore[misc]
    assert server.stats()["rejected_full"] == 0


def test_waitress_stops_gracefully_on_systemexit_in_run(tmp_path: Path) -> None:
    """``run()`` ending with SystemExit (as Ctrl-C does) drains the queue, turning the I/O loop itself."""
    from _server_harness import app
    from prazo.bindings.servers.waitress import create_server

    server = create_server(app, host="127.0.0.1", port=0, threads=1, max_queue=3)
    dispatcher = server.task_dispatcher
    # Four 200 ms requests one after another: the budget must outlast them on a loaded machine.
    burst = Burst(server.effective_port, ["/work?ms=200"] * 4, headers={"X-Request-Budget-Ms": "30000"})
    stop_requested = threading.Event()

    runner = run_waitress_until(server, stop_requested)
    wait_until(lambda: dispatcher.stats()["offered"] >= 4, "all four requests to be offered")
    stop_requested.set()
    runner.join(CLIENT_TIMEOUT_S)
    assert not runner.is_alive()
    assert statuses(burst.join()) == {200: 4}
    server.close()


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_silent_connections_hold_neither_a_worker_nor_a_place_in_line(kind: str, servers: list[RunningServer]) -> None:
    server = _start(servers, kind, threads=1, max_queue=0)
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) for _ in range(3)]
    try:
        time.sleep(0.3)  # let the server accept them
        # The start-up probe's slot may be freed a moment after its answer was
        # read; a refusal in that moment is retried. Silent connections holding
        # the only slot would make every try fail.
        for _ in range(50):
            outcome = request(server.port, "/work")
            if outcome.status != 503:
                break
            time.sleep(0.02)
        assert (outcome.status, outcome.reason) == (200, None)
    finally:
        for sock in silent:
            sock.close()


def _read_answers(reader: Any, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers (status, body) from one buffered reader of a kept-alive connection, in order."""
    answers = []
    for _ in range(count):
        status = int(reader.readline().split()[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        answers.append((status, reader.read(length)))
    return answers


@pytest.mark.parametrize("kind", ["gunicorn", "cheroot"])
def test_pipelined_requests_and_their_bodies_reach_the_app_whole_and_in_order(
    kind: str, servers: list[RunningServer]
) -> None:
    """What the admission read to find a head (gunicorn: off the socket) is what the app reads, nothing lost or read twice."""
    server = _start(servers, kind, threads=2, max_queue=4)
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        reader = sock.makefile("rb")
        sock.sendall(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        assert _read_answers(reader, 3) == [(200, b"hello"), (200, b"abc"), (200, b"ok")]
        # A head, then its body, in pieces: the admission waits for the head, the app reads the body.
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Le")
        time.sleep(0.2)
        sock.sendall(b"ngth: 10\r\n\r\n01234")
        time.sleep(0.2)
        sock.sendall(b"56789GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert _read_answers(reader, 2) == [(200, b"0123456789"), (200, b"")]
        reader.close()
