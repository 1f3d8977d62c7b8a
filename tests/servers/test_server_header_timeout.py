"""Slow request heads (slow loris) on the socket-level embeddings: no worker, no slot, a 408 in bounded time.

Each server runs with ``threads=2, max_queue=2`` — a capacity the four
trickling connections would fill if their heads were admitted before they
were complete. waitress is not here: its I/O thread reads every head before
admission, without a worker.
"""

from __future__ import annotations

import http.client
import socket
import time

import pytest
from _helpers import assert_conservation, wait_until
from _server_harness import CLIENT_TIMEOUT_S, SOCKET_KINDS, RunningServer, Trickler, request, start_server

HEADER_TIMEOUT_S = 1.5
# The 408 is due at the header timeout; the watcher looks at a pending head
# at least every 0.1 s, and a loaded machine adds scheduling delay.
LATE_MARGIN_S = 8.0


@pytest.mark.parametrize("kind", SOCKET_KINDS)
def test_slow_heads_hold_no_worker_nor_slot_and_are_answered_408(kind: str, servers: list[RunningServer]) -> None:
    server = start_server(kind, threads=2, max_queue=2, header_timeout_ms=HEADER_TIMEOUT_S * 1000)
    servers.append(server)
    offered_before = server.stats()["offered"] if server.stats else 0
    lorises = [Trickler(server.port, interval_s=0.5) for _ in range(4)]
    for loris in lorises:
        assert loris.started.wait(CLIENT_TIMEOUT_S)
    if server.stats is not None:
        stats = server.stats
        wait_until(lambda: stats()["pending_heads"] == 4, "the four slow heads to be watched")
    else:
        time.sleep(1.0)  # gunicorn runs in another process: a generous pause instead

    # While the heads trickle in, legitimate requests find every worker free.
    answered: list[int] = []
    while not answered or (any(loris.answer is None for loris in lorises) and len(answered) < 50):
        answered.append(request(server.port, "/work?ms=20").status)
    assert answered and set(answered) == {200}, answered

    for loris in lorises:
        loris.join()
        assert loris.answer is not None and loris.ended_after_s is not None
        assert loris.answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), loris.answer
        assert b"\r\nX-Prazo-Reason: header-timeout\r\n" in loris.answer
        # Never before the timeout, and within it plus a margin.
        assert HEADER_TIMEOUT_S - 0.1 <= loris.ended_after_s <= HEADER_TIMEOUT_S + LATE_MARGIN_S

    if server.stats is not None:
        server.settle()
        # A kept-alive connection the last client just closed is watched for
        # its next head until the watcher's next look (at most 100 ms) sees it gone.
        live_stats = server.stats
        wait_until(lambda: live_stats()["pending_heads"] == 0, "the watcher to let go of closed connections")
        stats = server.stats()
        # The slow heads were never offered to the queue: only the legitimate requests were.
        assert stats["offered"] - offered_before == len(answered)
        assert (stats["in_flight"], stats["queued"], stats["pending_heads"]) == (0, 0, 0)
        assert stats["header_timeouts"] == 4
        assert_conservation(stats)


@pytest.mark.parametrize("kind", SOCKET_KINDS)
def test_a_head_that_stops_halfway_is_answered_408_and_the_server_keeps_serving(
    kind: str, servers: list[RunningServer]
) -> None:
    """A client that sends part of a head and then nothing at all must not hold a worker forever."""
    server = start_server(kind, threads=1, max_queue=0, header_timeout_ms=HEADER_TIMEOUT_S * 1000)
    servers.append(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as stalled:
        stalled.sendall(b"GET /work HTTP/1.1\r\nHost: te")
        start = time.monotonic()
        assert request(server.port, "/work").status == 200
        response = http.client.HTTPResponse(stalled)
        response.begin()
        response.read()
        elapsed = time.monotonic() - start
    assert (response.status, response.getheader("X-Prazo-Reason")) == (408, "header-timeout")
    assert response.getheader("Connection") == "close"
    assert HEADER_TIMEOUT_S - 0.1 <= elapsed <= HEADER_TIMEOUT_S + LATE_MARGIN_S


@pytest.mark.parametrize("kind", ("werkzeug", "wsgiref", "cheroot"))
def test_clients_leaving_halfway_through_their_heads_are_forgotten_at_the_timeout_never_offered(
    kind: str, servers: list[RunningServer]
) -> None:
    """Their bytes stay readable (a peek cannot see the end of stream behind them): the timeout ends them."""
    server = start_server(kind, threads=1, max_queue=0, header_timeout_ms=HEADER_TIMEOUT_S * 1000)
    servers.append(server)
    assert server.stats is not None
    stats = server.stats
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as leaving:
            leaving.sendall(b"GET /work HTTP/1.1\r\nHost: te")
    # The timeout is counted a moment before the watcher lets go of the connection.
    wait_until(lambda: (stats()["header_timeouts"], stats()["pending_heads"]) == (3, 0), "the three heads to time out")
    assert stats()["offered"] == 0
    assert request(server.port, "/work").status == 200
