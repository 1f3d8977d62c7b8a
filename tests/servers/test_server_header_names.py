"""One rule for header names on every server embedding: a name with an underscore is dropped.

``X_Request_Budget_Ms`` and ``X-Request-Budget-Ms`` both map to
``HTTP_X_REQUEST_BUDGET_MS``. waitress, werkzeug and gunicorn drop the
underscore spelling; prazo's own head reader (the admission decision of the
socket-level embeddings) and the cheroot and wsgiref parsers used to map it,
so the same request got a different deadline depending on the server. Each
case is sent with its head in one piece (the deadline comes from prazo's
head reader) and in two pieces (it comes from the server's own environ).
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator

import pytest
from _server_harness import CLIENT_TIMEOUT_S, SERVER_KINDS, RunningServer, start_server

DEFAULT_BUDGET_MS = 5000
# Between the two pieces of a head: the first piece is admitted with a
# provisional deadline, the second completes it.
PIECES_PAUSE_S = 0.3


# One server per kind for the module: every case is a request of its own on a
# connection of its own, and none reads the queue's counters.
@pytest.fixture(scope="module", params=SERVER_KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    running = start_server(request.param, threads=2, max_queue=4, default_budget_ms=DEFAULT_BUDGET_MS)
    yield running
    running.stop()


def _in_one_piece(port: int, headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.putrequest("GET", "/budget-header")
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _in_two_pieces(port: int, headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"GET /budget-header HTTP/1.1\r\nHost: test\r\n")
        time.sleep(PIECES_PAUSE_S)
        fields = "".join(f"{name}: {value}\r\n" for name, value in headers)
        sock.sendall(f"{fields}Connection: close\r\n\r\n".encode("latin-1"))
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def _seen_by_the_app(body: bytes) -> tuple[str, int]:
    """(``HTTP_X_REQUEST_BUDGET_MS`` in the app's environ or ``-``, remaining ms)."""
    # The header's value may hold spaces (a repeated header joined with ", ").
    header_field, remaining = body.rsplit(b" remaining_ms=", 1)
    return header_field.split(b"=", 1)[1].decode("latin-1"), int(remaining)


@pytest.mark.parametrize("send", [_in_one_piece, _in_two_pieces], ids=["whole-head", "head-in-pieces"])
def test_an_underscore_budget_header_neither_shortens_nor_extends_and_a_dash_one_counts(
    server: RunningServer, send: object
) -> None:
    assert callable(send)

    # Shorter than the default: ignored, so the default applies.
    status, body = send(server.port, [("X_Request_Budget_Ms", "500")])
    header, remaining = _seen_by_the_app(body)
    assert status == 200 and header == "-"
    assert 500 < remaining <= DEFAULT_BUDGET_MS

    # Longer than the default (within the cap): ignored, never an extension.
    status, body = send(server.port, [("X_Request_Budget_Ms", "20000")])
    header, remaining = _seen_by_the_app(body)
    assert status == 200 and header == "-"
    assert 0 < remaining <= DEFAULT_BUDGET_MS

    # The dash spelling is the budget header.
    status, body = send(server.port, [("X-Request-Budget-Ms", "2000")])
    header, remaining = _seen_by_the_app(body)
    assert status == 200 and header == "2000"
    assert 0 < remaining <= 2000

    # Both: the underscore one is not joined to the real one (joined, "2000,100"
    # would count as 100).
    status, body = send(server.port, [("X-Request-Budget-Ms", "2000"), ("X_Request_Budget_Ms", "100")])
    header, remaining = _seen_by_the_app(body)
    assert status == 200 and header == "2000"
    assert 100 < remaining <= 2000


@pytest.mark.parametrize("send", [_in_one_piece, _in_two_pieces], ids=["whole-head", "head-in-pieces"])
def test_a_budget_header_sent_twice_is_bounded_by_the_smaller_value(server: RunningServer, send: object) -> None:
    # The server joins the two lines with a comma; falling back to the default
    # (5000 ms) would let the duplicate extend the caller's deadline.
    assert callable(send)
    # 3000 ms, not less: the head in pieces spends 0.3 s of it before the app runs, and a
    # loaded machine more; any value under the 4000 and the default 5000 tells the rule.
    status, body = send(server.port, [("X-Request-Budget-Ms", "4000"), ("x-request-budget-ms", "3000")])
    _, remaining = _seen_by_the_app(body)
    assert status == 200
    assert 0 < remaining <= 3000
