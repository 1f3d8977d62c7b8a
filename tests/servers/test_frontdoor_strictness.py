"""The front door's strictness on real loopback sockets (issue 19, defects 6-9, and the lenient cases).

Each defect has its own test: what the app returns never becomes a header of
its own (6), the head limit holds however the head is split (7), lingering
closes are capped (8), and two Host fields are a 400 (9). Then a sample of the
framing the front door now refuses, each on a live server: what reaches the
app is what the the strictness list of docs/how-to/server-front-door.md says. No timing is asserted: the
pauses only give the server the chance to read a head in two pieces.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import wait_until
from _server_harness import CLIENT_TIMEOUT_S, FrontDoors, exchange, read_to_eof
from prazo.bindings.servers.frontdoor import server as frontdoor
from prazo.bindings.servers.plumbing.heads import MAX_HEAD_BYTES
from prazo.bindings.servers.plumbing.refusals import DEFAULT_MAX_LINGERING

# slow: real time; compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]


class Recorder:
    """A WSGI app that records every request it sees and answers 200 (reading the body when asked)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        body = environ["wsgi.input"].read() if environ["PATH_INFO"] == "/read" else b""
        self.seen.append({**environ, "body": body})
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    @property
    def paths(self) -> list[str]:
        return [environ["PATH_INFO"] for environ in self.seen]


@pytest.fixture
def start() -> Iterator[FrontDoors]:
    with FrontDoors(threads=2, max_queue=20) as start_server:
        yield start_server


# ------------------------------------------------------ defect 6: the app's status and headers


def _answering(status: str, headers: list[tuple[str, str]]) -> Any:
    def application(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response(status, headers)
        return [b"body"]

    return application


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        ("200 OK\r\nSet-Cookie: injected=1", [("Content-Length", "4")]),
        ("200 OK\nSet-Cookie: injected=1", [("Content-Length", "4")]),
        ("200 OK\rSet-Cookie: injected=1", [("Content-Length", "4")]),
        ("200 OK\x00injected", [("Content-Length", "4")]),
        ("200 OK\x1binjected", [("Content-Length", "4")]),
        ("200 OK", [("Set-Cookie: injected", "1")]),
        ("200 OK", [("X-A b", "injected")]),
        ("200 OK", [("X-A", "1\x0binjected")]),
        ("200 OK", [("X-A", "1\r\nSet-Cookie: injected=1")]),
    ],
    ids=[
        "crlf-status",
        "lf-status",
        "cr-status",
        "nul-status",
        "esc-status",
        "colon-name",
        "space-name",
        "control-value",
        "crlf-value",
    ],
)
@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_control_characters_from_the_app_are_500_and_nothing_is_injected(
    start: Any, caplog: pytest.LogCaptureFixture, status: str, headers: list[tuple[str, str]]
) -> None:
    server = start(_answering(status, headers))
    with caplog.at_level(logging.ERROR, logger="prazo.servers.frontdoor"):
        # Keep-alive asked for: the 500 must close the connection all the same (the EOF ends the read).
        answer = exchange(server.port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        wait_until(lambda: server.stats()["app_errors"] == 1, "the app error to be counted")
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n"), answer
    assert b"injected" not in answer and answer.count(b"HTTP/1.1 ") == 1, answer
    assert b"Connection: close" in answer
    assert any(record.levelno == logging.ERROR for record in caplog.records), caplog.records


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_a_well_formed_status_and_headers_pass(start: Any) -> None:
    server = start(_answering("299 Odd \t reason \xe9", [("X-A", "tab\tand latin-1 \xe9"), ("Content-Length", "4")]))
    answer = exchange(server.port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert answer.startswith("HTTP/1.1 299 Odd \t reason \xe9\r\n".encode("latin-1")), answer
    assert "X-A: tab\tand latin-1 \xe9\r\n".encode("latin-1") in answer and answer.endswith(b"body")


# ------------------------------------------------------ defect 7: the head limit, split heads


@pytest.mark.parametrize("size", [70_000, 80_000])
def test_a_head_too_large_is_431_even_when_it_arrives_in_two_pieces(start: Any, size: int) -> None:
    recorder = Recorder()
    server = start(recorder)
    start_line = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: "
    head = start_line + b"a" * (size - len(start_line) - 4) + b"\r\n\r\n"
    assert len(head) == size
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(head[:65_000])
        # Below the limit, and incomplete: the server reads it and waits for the rest.
        time.sleep(0.5)
        sock.sendall(head[65_000:])
        answer = read_to_eof(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert not recorder.seen
    assert server.stats()["heads_too_large"] == 1


def test_a_head_at_the_limit_in_two_pieces_is_served(start: Any) -> None:
    recorder = Recorder()
    server = start(recorder)
    start_line = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\nX-Big: "
    head = start_line + b"a" * (MAX_HEAD_BYTES - len(start_line) - 4) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(head[:60_000])
        time.sleep(0.2)
        sock.sendall(head[60_000:])
        answer = read_to_eof(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert recorder.paths == ["/"]


# ------------------------------------------------------ defect 8: lingering closes are capped


def test_lingering_refused_connections_are_capped(start: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A long linger: without the cap all 700 would still linger when they are counted.
    monkeypatch.setattr(frontdoor, "DEFAULT_LINGER_S", 120.0)
    server = start(Recorder())
    count = DEFAULT_MAX_LINGERING + 188
    clients: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
            clients.append(sock)
            sock.sendall(b"NOT HTTP\r\n\r\n")
            # Each reads its whole 400 (the server shuts its write side), and keeps its socket open.
            assert read_to_eof(sock).startswith(b"HTTP/1.1 400 ")
        wait_until(lambda: server.stats()["bad_requests"] == count, "every malformed head to be answered")
        # The engine publishes the count at the top of its loop, right after its last answer.
        wait_until(lambda: server.stats()["lingering"] >= DEFAULT_MAX_LINGERING, "the lingering count to be published")
        time.sleep(0.3)
        stats = server.stats()
        assert stats["lingering"] == DEFAULT_MAX_LINGERING, stats
        assert stats["open_connections"] == DEFAULT_MAX_LINGERING, stats
    finally:
        for sock in clients:
            sock.close()


# ------------------------------------------------------ defect 9: Host


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a.example\r\nhost: a.example\r\n\r\n",
        b"GET / HTTP/1.0\r\nHost: a.example\r\nHost: b.example\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a.example, b.example\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: user@a.example\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a.example/path\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",
    ],
    ids=["two", "two-same", "two-http10", "comma", "userinfo", "path", "missing-http11"],
)
def test_host_must_be_one_authority(start: Any, head: bytes) -> None:
    recorder = Recorder()
    server = start(recorder)
    answer = exchange(server.port, head)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer
    assert not recorder.seen


@pytest.mark.parametrize(
    ("head", "host"),
    [
        (b"GET / HTTP/1.1\r\nHost: a.example:8080\r\nConnection: close\r\n\r\n", "a.example:8080"),
        (b"GET / HTTP/1.1\r\nHost: [::1]:80\r\nConnection: close\r\n\r\n", "[::1]:80"),
        (b"GET / HTTP/1.1\r\nHost:\r\nConnection: close\r\n\r\n", ""),
        (b"GET / HTTP/1.0\r\n\r\n", None),
    ],
)
def test_one_host_or_none_in_http10_reaches_the_app(start: Any, head: bytes, host: str | None) -> None:
    recorder = Recorder()
    server = start(recorder)
    answer = exchange(server.port, head)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert recorder.seen[0].get("HTTP_HOST") == host


# ------------------------------------------------------ the lenient cases, now refused


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\nHost: a\n\n",
        b"GET / HTTP/1.1\r\nHost: a\n\r\n",
        b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET /  HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.9\r\nHost: a\r\n\r\n",
        b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n",
        b"TRACE / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET a/b HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET * HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET /\xe9 HTTP/1.1\r\nHost: a\r\n\r\n",
    ],
    ids=[
        "bare-lf",
        "bare-lf-header",
        "two-spaces-before-target",
        "two-spaces-after-target",
        "http-1.2",
        "http-1.9",
        "connect",
        "trace",
        "relative-target",
        "asterisk-not-options",
        "non-ascii-target",
    ],
)
def test_lenient_heads_are_400(start: Any, data: bytes) -> None:
    recorder = Recorder()
    server = start(recorder)
    answer = exchange(server.port, data)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer
    assert not recorder.seen


@pytest.mark.parametrize(
    "chunks",
    [
        b"5\nhello\r\n0\r\n\r\n",
        b"5\r\nhello\n0\r\n\r\n",
        b"5 junk\r\nhello\r\n0\r\n\r\n",
        b"5;a=b c\r\nhello\r\n0\r\n\r\n",
        b"5;\x01\r\nhello\r\n0\r\n\r\n",
        b"5\r\nhello\r\n0\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n",
        b"5\r\nhello\r\n0\r\n folded: trailer\r\n\r\n",
        b"ffffffffffffffff1\r\nhello\r\n0\r\n\r\n",
    ],
    ids=[
        "bare-lf-size",
        "bare-lf-data",
        "junk-after-size",
        "junk-in-extension",
        "control-in-extension",
        "request-line-as-trailer",
        "folded-trailer",
        "size-overflow",
    ],
)
@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_a_broken_chunked_body_never_reaches_the_app_whole(start: Any, chunks: bytes) -> None:
    recorder = Recorder()
    server = start(recorder)
    head = b"POST /read HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = exchange(server.port, head + chunks + b"GET /after HTTP/1.1\r\nHost: a\r\n\r\n")
    # The app's read raises RequestBodyError and the app lets it out before its
    # response began: a 400, and what follows is never served.
    assert not recorder.seen, recorder.seen
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 400 "), answer


@pytest.mark.usefixtures("runner_path")  # the response's path: on both loops
def test_a_strict_chunked_body_with_extensions_and_trailers_is_read_and_the_next_request_served(start: Any) -> None:
    recorder = Recorder()
    server = start(recorder)
    head = b"POST /read HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b'5 ; a = b ;c;d="q\\"uoted"\r\nhello\r\n0\r\nX-Trailer: yes\r\n\r\n'
    answer = exchange(server.port, head + chunks + b"GET /after HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer
    assert recorder.paths == ["/read", "/after"] and recorder.seen[0]["body"] == b"hello"


def test_the_cap_holds_while_lingering_clients_leave_and_new_ones_are_refused(
    start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cap closes the oldest lingering connection while the engine handles an
    # epoll batch that may also hold that connection's own event (its client
    # leaving): under `make sanitize` a use of the closed connection would abort.
    monkeypatch.setattr(frontdoor, "DEFAULT_LINGER_S", 120.0)
    server = start(Recorder())
    # As many as the cap: from here on each refusal pushes the oldest out.
    first = [
        socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
        for _ in range(DEFAULT_MAX_LINGERING)
    ]
    for sock in first:
        sock.sendall(b"NOT HTTP\r\n\r\n")
    for sock in first:
        assert read_to_eof(sock).startswith(b"HTTP/1.1 400 ")
    later: list[socket.socket] = []
    try:
        for index, sock in enumerate(first):
            sock.close()  # the oldest lingering connection's own event ...
            if index % 2 == 0:  # ... beside a new refusal that pushes the oldest out
                fresh = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
                later.append(fresh)
                fresh.sendall(b"NOT HTTP\r\n\r\n")
        for sock in later:
            assert read_to_eof(sock).startswith(b"HTTP/1.1 400 ")
        wait_until(
            lambda: server.stats()["bad_requests"] == DEFAULT_MAX_LINGERING + len(later),
            "every malformed head to be answered",
        )
        wait_until(lambda: server.stats()["lingering"] == len(later), "the first clients' lingering to end")
        assert server.stats()["lingering"] <= DEFAULT_MAX_LINGERING
    finally:
        for sock in later:
            sock.close()
