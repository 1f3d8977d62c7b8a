"""The front door (``--server prazo``) on real loopback sockets and real threads.

Triage happens in the engine's C thread without the GIL: refusals must be
written while every worker burns CPU in Python, and only admitted requests
ever reach the app. Timing assertions only say "stays low", with big margins.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import CheckedThread, wait_until
from _server_harness import (
    CLIENT_TIMEOUT_S,
    Burst,
    FrontDoors,
    Trickler,
    exchange,
    read_to_eof,
    request,
    statuses,
)

# slow: real time; compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]


@pytest.fixture
def start() -> Iterator[FrontDoors]:
    with FrontDoors(threads=4, max_queue=20) as start_server:
        yield start_server


def _balanced(stats: dict[str, int]) -> None:
    """Every head had one outcome, every admitted request one fate (no shutdown in between)."""
    assert stats["offered"] == stats["admitted"] + stats["rejected_full"] + stats["expired_on_arrival"], stats
    assert stats["admitted"] == (stats["started"] + stats["expired_in_queue"] + stats["queued"] + stats["assigned"]), (
        stats
    )
    assert stats["started"] - stats["completed"] == stats["in_flight"], stats


def test_seed_scenario_24_served_16_refused_at_once(start: Any, tmp_path: Path) -> None:
    server = start(threads=4, max_queue=20)
    gate = tmp_path / "gate"
    # The first wave holds at the gate until all 16 refusals are out, so the
    # split never depends on how fast a loaded machine reads 40 connections;
    # the budget outlasts the six 300 ms waves by far (the split is the subject, not expiry).
    burst = Burst(server.port, [f"/work?ms=300&gate={gate}"] * 40, {"X-Request-Budget-Ms": "20000"})
    early = burst.wait(16)
    assert statuses(early) == {503: 16}
    assert {outcome.reason for outcome in early} == {"queue-full"}
    # Refused at once: while every admitted request was still held at the gate.
    assert server.stats()["started"] == 4
    gate.touch()
    outcomes = burst.join()
    assert statuses(outcomes) == {200: 24, 503: 16}
    stats = server.stats()
    assert stats["rejected_full"] == 16 and stats["started"] == 24 and stats["peak_queued"] <= 20
    wait_until(lambda: server.stats()["in_flight"] == 0, "every slot to be free")
    _balanced(server.stats())


def test_the_tail_expires_in_queue_and_never_starts(start: Any) -> None:
    calls: list[str] = []

    def counting(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        calls.append(environ["PATH_INFO"])
        time.sleep(0.3)
        start_response("200 OK", [("Content-Length", "0")])
        return []

    server = start(counting, threads=2, max_queue=10)
    outcomes = Burst(server.port, ["/w"] * 8, {"X-Request-Budget-Ms": "500"}).join()
    counts = statuses(outcomes)
    assert counts[504] >= 4 and counts[200] + counts[504] == 8, counts
    assert {o.reason for o in outcomes if o.status == 504} == {"expired-in-queue"}
    assert len(calls) == counts[200]
    wait_until(lambda: server.stats()["in_flight"] == 0, "every slot to be free")
    _balanced(server.stats())


def test_expired_on_arrival_and_keep_alive_after_a_refusal(start: Any) -> None:
    server = start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    conn.request("GET", "/work", headers={"X-Request-Budget-Ms": "0"})
    response = conn.getresponse()
    assert (response.status, response.getheader("X-Prazo-Reason")) == (504, "expired-on-arrival")
    assert response.getheader("Connection") == "keep-alive"
    response.read()
    # The same connection serves the next request.
    conn.request("GET", "/budget-header", headers={"X-Request-Budget-Ms": "700"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.read().startswith(b"header=700 remaining_ms=")
    conn.close()


def test_queue_full_keeps_the_connection_alive(start: Any) -> None:
    gate = threading.Event()

    def blocking(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        gate.wait(CLIENT_TIMEOUT_S)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server = start(blocking, threads=1, max_queue=0)
    holder = threading.Thread(target=request, args=(server.port, "/"), daemon=True)
    holder.start()
    wait_until(lambda: server.stats()["in_flight"] == 1, "the only worker to be busy")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    conn.request("GET", "/")
    response = conn.getresponse()
    assert (response.status, response.getheader("X-Prazo-Reason")) == (503, "queue-full")
    assert response.getheader("Retry-After") == "1"
    response.read()
    gate.set()
    holder.join(CLIENT_TIMEOUT_S)
    wait_until(lambda: server.stats()["in_flight"] == 0, "the worker to be free")
    conn.request("GET", "/")
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"ok")
    conn.close()


def test_refusals_are_written_while_every_worker_burns_cpu_in_python(start: Any) -> None:
    calls = []
    stop = threading.Event()

    def burn(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        calls.append(environ.get("HTTP_X_ID"))
        end = time.monotonic() + CLIENT_TIMEOUT_S
        x = 0
        while time.monotonic() < end and not stop.is_set():
            x += 1  # pure Python: holds the GIL
        start_response("200 OK", [("Content-Length", "0")])
        return []

    server = start(burn, threads=2, max_queue=1)
    # The queued request must outlive the test: were it to expire, the line
    # would have room and the next request would wait instead of being refused.
    long_budget = {"X-Request-Budget-Ms": "30000"}
    busy = [threading.Thread(target=request, args=(server.port, "/", {"X-Id": f"busy{i}", **long_budget}), daemon=True)
            for i in range(3)]  # fmt: skip
    for thread in busy:
        thread.start()
    wait_until(lambda: server.stats()["in_flight"] == 2 and server.stats()["queued"] == 1, "workers busy, line full")
    try:
        for i in range(10):
            outcome = request(server.port, "/", {"X-Id": f"refused{i}"})
            assert (outcome.status, outcome.reason) == (503, "queue-full")
        expired = request(server.port, "/", {"X-Id": "expired", "X-Request-Budget-Ms": "-1"})
        assert (expired.status, expired.reason) == (504, "expired-on-arrival")
        # Still burning: every refusal was written while both workers held the GIL by turns.
        assert not stop.is_set() and server.stats()["in_flight"] == 2
        assert all(call.startswith("busy") for call in calls), calls
    finally:
        stop.set()
        for thread in busy:
            thread.join(CLIENT_TIMEOUT_S)


# A client in another process: it needs no GIL of this one, so what it measures
# is the server alone. It reads one byte (the worker's "I now hold the GIL"),
# then sends the refused and the expired request and prints each answer's
# status, reason and CLOCK_MONOTONIC time (the same clock in both processes).
_OUTSIDE_CLIENT = """
import http.client, json, sys, time
port = int(sys.argv[1])
sys.stdin.buffer.read(1)
answers = []
for headers in [{}] * 5 + [{"X-Request-Budget-Ms": "-1"}]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("GET", "/", headers=headers)
    response = conn.getresponse()
    response.read()
    answers.append([response.status, response.getheader("X-Prazo-Reason"), time.monotonic()])
    conn.close()
print(json.dumps(answers))
"""


def test_refusals_are_written_while_a_worker_holds_the_gil_without_a_break(start: Any) -> None:
    """Triage needs no GIL at all: every refusal is answered inside one uninterrupted GIL hold of the app.

    The worker calls libc's ``sleep`` through ``ctypes.PyDLL``, which keeps the
    GIL for the whole call (no eval-loop switch can take it away), so no
    Python code of this process runs until it returns. Every answer the
    outside client received before that moment was written by C alone.
    """
    hold_s = 4
    libc = ctypes.PyDLL(None)
    line_full = threading.Event()
    held: dict[str, float] = {}
    reader, writer = os.pipe()

    def hold(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ.get("HTTP_X_ID") == "holder":
            # The line fills first (one waiter, its budget far beyond the test); then the GIL is taken.
            line_full.wait(CLIENT_TIMEOUT_S)
            held["from"] = time.monotonic()
            os.write(writer, b"g")
            libc.sleep(hold_s)
            held["until"] = time.monotonic()
        start_response("200 OK", [("Content-Length", "0")])
        return []

    server = start(hold, threads=1, max_queue=1)
    client = subprocess.Popen(
        [sys.executable, "-c", _OUTSIDE_CLIENT, str(server.port)], stdin=reader, stdout=subprocess.PIPE, text=True
    )
    os.close(reader)
    holder = CheckedThread(target=request, args=(server.port, "/", {"X-Id": "holder"}))
    queued = CheckedThread(target=request, args=(server.port, "/", {"X-Id": "queued", "X-Request-Budget-Ms": "30000"}))
    try:
        holder.start()
        wait_until(lambda: server.stats()["in_flight"] == 1, "the holder to run")
        queued.start()
        wait_until(lambda: server.stats()["queued"] == 1, "the line to be full")
        line_full.set()
        out, _ = client.communicate(timeout=CLIENT_TIMEOUT_S + hold_s)
    finally:
        line_full.set()
        os.close(writer)
        if client.poll() is None:
            client.kill()
    holder.join(CLIENT_TIMEOUT_S + hold_s)
    queued.join(CLIENT_TIMEOUT_S + hold_s)
    answers = json.loads(out)
    expected = [(503, "queue-full")] * 5 + [(504, "expired-on-arrival")]
    assert [(status, reason) for status, reason, _ in answers] == expected
    assert all(held["from"] < at < held["until"] for _, _, at in answers), (held, answers)


def test_header_timeout_answers_408_and_holds_no_worker(start: Any) -> None:
    server = start(threads=1, max_queue=0, header_timeout_ms=800)
    lorises = [Trickler(server.port, interval_s=0.2) for _ in range(3)]
    for loris in lorises:
        assert loris.started.wait(CLIENT_TIMEOUT_S)
    wait_until(lambda: server.stats()["pending_heads"] == 3, "the three slow heads to be read")
    # The only worker is free for a real request while the heads trickle.
    assert request(server.port, "/work").status == 200
    for loris in lorises:
        loris.join()
        assert loris.answer is not None and loris.answer.startswith(b"HTTP/1.1 408 "), loris.answer
        assert b"X-Prazo-Reason: header-timeout" in loris.answer
        assert loris.ended_after_s is not None and loris.ended_after_s < 0.8 + 5.0
    assert server.stats()["header_timeouts"] == 3


def _echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    return [environ["REQUEST_METHOD"].encode() + b" " + body]


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_request_bodies_content_length_and_chunked(start: Any) -> None:
    server = start(_echo)
    payload = bytes(range(256)) * 1000
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    conn.request("POST", "/", body=payload)
    response = conn.getresponse()
    assert response.read() == b"POST " + payload
    chunks = [payload[i : i + 7000] for i in range(0, len(payload), 7000)]
    conn.request("PUT", "/", body=iter(chunks), encode_chunked=True)
    response = conn.getresponse()
    assert response.read() == b"PUT " + payload
    # Pipelined: a chunked body and the next request in one write.
    raw = (
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
    )
    answer = exchange(server.port, raw)
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert b"POST abc" in answer and answer.endswith(b"POST hi")
    conn.close()


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_readline_and_iteration_of_the_body(start: Any) -> None:
    def lines(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        stream = environ["wsgi.input"]
        first = stream.readline()
        rest = list(stream)
        start_response("200 OK", [("Content-Length", str(len(first) + sum(map(len, rest)) + 2))])
        return [b"%d|" % len(rest), first, *rest]

    server = start(lines)
    outcome = request(server.port, "/", method="POST", body=b"one\ntwo\nthree")
    assert outcome.body == b"2|one\ntwo\nthree"


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_streaming_response_is_chunked_and_close_is_called(start: Any) -> None:
    closed = threading.Event()

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            for i in range(5):
                yield b"part%d;" % i

        def close(self) -> None:
            closed.set()

    def streaming(environ: dict[str, Any], start_response: Any) -> Body:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return Body()

    server = start(streaming)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    conn.request("GET", "/")
    response = conn.getresponse()
    assert response.getheader("Transfer-Encoding") == "chunked"
    assert response.read() == b"part0;part1;part2;part3;part4;"
    assert closed.wait(CLIENT_TIMEOUT_S)
    # HTTP/1.0 gets the body up to the close instead.
    answer = exchange(server.port, b"GET / HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in answer
    assert answer.endswith(b"part0;part1;part2;part3;part4;")
    conn.close()


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_app_errors_are_500_and_the_worker_survives(start: Any) -> None:
    def broken(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] == "/boom":
            raise RuntimeError("boom")
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server = start(broken, threads=1)
    for _ in range(3):
        assert request(server.port, "/boom").status == 500
    assert request(server.port, "/").body == b"ok"
    wait_until(lambda: server.stats()["in_flight"] == 0, "the slot to be free")
    assert server.stats()["app_errors"] == 3


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_environ_is_pep_3333(start: Any) -> None:
    seen: dict[str, Any] = {}

    def capture(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.update(environ)
        start_response("200 OK", [("Content-Length", "0")])
        return []

    server = start(capture)
    request(server.port, "/a%20b/c?x=1&y=2", {"X-Request-Budget-Ms": "900", "X_Request_Budget_Ms": "1", "X-A": "1"})
    assert seen["REQUEST_METHOD"] == "GET" and seen["PATH_INFO"] == "/a b/c" and seen["QUERY_STRING"] == "x=1&y=2"
    assert seen["SERVER_PROTOCOL"] == "HTTP/1.1" and seen["REMOTE_ADDR"] == "127.0.0.1"
    assert seen["SERVER_PORT"] == str(server.port) and seen["wsgi.url_scheme"] == "http"
    assert seen["HTTP_X_REQUEST_BUDGET_MS"] == "900" and seen["HTTP_X_A"] == "1"
    assert seen["prazo.budget_source"] == "X-Request-Budget-Ms"
    assert 0 < seen["prazo.deadline"].remaining_ms() < 900
    assert seen["prazo.queue_wait_ms"] >= 0
    assert callable(seen["prazo.server_stats"])
    # The arrival is the kernel's receive stamp of the first bytes (SO_TIMESTAMPNS, inherited from the listener).
    assert server.stats()["kernel_arrival_stamps"] >= 1


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\r\n: empty-name\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x00\x01\x02 / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header: 1\r\n\r\n",
        b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
    ],
)
def test_malformed_or_ambiguous_heads_are_400(start: Any, head: bytes) -> None:
    calls: list[int] = []

    def counting(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        calls.append(1)
        start_response("200 OK", [("Content-Length", "0")])
        return []

    server = start(counting)
    answer = exchange(server.port, head)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer
    assert b"X-Prazo-Reason: bad-request" in answer
    assert not calls


def test_a_head_too_large_is_431(start: Any) -> None:
    server = start()
    answer = exchange(server.port, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_graceful_shutdown_loses_nothing(start: Any) -> None:
    server = start(threads=2, max_queue=6)
    burst = Burst(server.port, ["/work?ms=200"] * 8, {"X-Request-Budget-Ms": "10000"})
    wait_until(lambda: server.stats()["offered"] == 8, "every request to arrive")
    assert server.shutdown(10.0) is True
    outcomes = burst.join()
    assert statuses(outcomes) == {200: 8}
    # Closed for new connections.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_shutdown_timeout_answers_the_still_waiting_503(start: Any) -> None:
    server = start(threads=1, max_queue=4)
    burst = Burst(server.port, ["/work?ms=700"] * 4, {"X-Request-Budget-Ms": "10000"})
    wait_until(lambda: server.stats()["offered"] == 4, "every request to arrive")
    assert server.shutdown(0.3) is False
    outcomes = burst.join()
    counts = statuses(outcomes)
    assert counts.get(200, 0) >= 1 and counts.get(200, 0) + counts.get(503, 0) == 4, counts
    assert {o.reason for o in outcomes if o.status == 503} <= {"shutting-down"}


@pytest.mark.parametrize("failure", ["call", "iterate", "close", "no-start-response", "deadline"])
@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_every_slot_comes_back_exactly_once_whatever_the_app_does(start: Any, failure: str) -> None:
    from prazo.core import DeadlineExceeded

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            yield b"a"
            if failure == "iterate":
                raise RuntimeError("iterate")
            yield b"b"

        def close(self) -> None:
            if failure == "close":
                raise RuntimeError("close")

    def misbehaving(environ: dict[str, Any], start_response: Any) -> Any:
        if failure == "call":
            raise RuntimeError("call")
        if failure == "deadline":
            raise DeadlineExceeded()
        if failure != "no-start-response":
            start_response("200 OK", [])
        return Body()

    server = start(misbehaving, threads=2, max_queue=2)
    for _ in range(4):
        try:
            request(server.port, "/")
        except (http.client.HTTPException, OSError):
            pass  # a response cut short is what a failing body gives
    wait_until(lambda: server.stats()["in_flight"] == 0, "every slot to come back")
    stats = server.stats()
    assert stats["started"] == stats["completed"] == 4, stats
    if failure == "deadline":
        assert request(server.port, "/").status == 504


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_expect_100_continue_and_pipelined_requests(start: Any) -> None:
    server = start(_echo)
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"hello")
        answer = b""
        while not answer.endswith(b"POST hello"):
            answer += sock.recv(1000)
        # Ten requests in one write, the last one closing: ten answers, in order.
        heads = b"".join(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n%s\r\n%d"
            % (b"Connection: close\r\n" if i == 9 else b"", i)
            for i in range(10)
        )
        sock.sendall(heads)
        answer = read_to_eof(sock)
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in answer.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"POST %d" % i for i in range(10)]


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_head_and_204_carry_no_body_and_keep_the_connection(start: Any) -> None:
    def app204(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("204 No Content" if environ["PATH_INFO"] == "/204" else "200 OK", [])
        return [b"body"]

    server = start(app204)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    for method, path in [("GET", "/204"), ("HEAD", "/"), ("GET", "/")]:
        conn.request(method, path)
        response = conn.getresponse()
        assert response.read() == (b"body" if method == "GET" and path == "/" else b"")
        assert response.getheader("Connection") == "keep-alive"
        assert response.getheader("Date")
    conn.close()


def test_a_thousand_pipelined_refusals_are_all_answered_in_order(start: Any) -> None:
    server = start()
    count = 1000
    heads = b"GET /%d HTTP/1.1\r\nHost: x\r\nX-Request-Budget-Ms: 0\r\n\r\n"
    data = b"".join(heads % i for i in range(count)) + b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
        sender.start()
        answer = read_to_eof(sock)
        sender.join(CLIENT_TIMEOUT_S)
    assert answer.count(b"X-Prazo-Reason: expired-on-arrival") == count
    assert answer.count(b"HTTP/1.1 504 ") == count and answer.count(b"HTTP/1.1 404 ") == 1
