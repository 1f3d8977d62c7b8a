"""The front door's connection, body and response lifecycle, on real loopback sockets.

A request body and a response are bounded by the request's deadline (a body
read never waits past it; a response write gets ``write_grace_ms`` more), the
response's framing is the server's to keep (a body that does not match its
Content-Length closes the connection), ``100 Continue`` never lands inside a
response, keep-alive is announced only when the request body was all read,
and an app thread still reading ``wsgi.input`` after the app returned never
touches a connection the engine has freed. Where a deadline is the subject,
the assertions only say "ended well before the 30 s I/O timeout".
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import wait_until
from _server_harness import APP_WAIT_S, CLIENT_TIMEOUT_S, FrontDoors, request
from prazo.bindings.servers.frontdoor import RequestBodyError
from prazo.bindings.servers.frontdoor import server as frontdoor

# slow: real time; compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]

# Far below DEFAULT_IO_TIMEOUT_MS (30 s, the only bound these waits had) and
# far above the few seconds of budget each test gives: "bounded by the deadline".
WELL_BEFORE_IO_TIMEOUT_S = 20.0


# A request without a budget header outlives the test: only the tests about a
# deadline send a short one.
@pytest.fixture
def start() -> Iterator[FrontDoors]:
    with FrontDoors(threads=2, max_queue=8) as start_server:
        yield start_server


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S)


def _read_until(sock: socket.socket, done: Any, limit_s: float = CLIENT_TIMEOUT_S) -> bytes:
    """Read until ``done(received)`` holds or the server closes; fails after ``limit_s``."""
    received = b""
    end = time.monotonic() + limit_s
    while not done(received):
        left = end - time.monotonic()
        assert left > 0, f"no end after {limit_s} s: {received[:300]!r}"
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            continue
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received


def _read_all(sock: socket.socket) -> bytes:
    return _read_until(sock, lambda _received: False)


def _health(environ: dict[str, Any], start_response: Any) -> list[bytes] | None:
    if environ["PATH_INFO"] != "/healthz":
        return None
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


def _echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


def _echo_or_health(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    return _health(environ, start_response) or _echo(environ, start_response)


def _health_check(port: int) -> int:
    """A health check with a budget long enough to wait for the only worker, as a status."""
    return request(port, "/healthz", {"X-Request-Budget-Ms": "15000"}).status


# ------------------------------------------------- 1: bounded by the deadline


def test_a_trickled_body_holds_the_worker_only_until_the_deadline(start: Any) -> None:
    server = start(_echo_or_health, threads=1)
    outcome: dict[str, Any] = {}

    def trickle() -> None:
        began = time.monotonic()
        try:
            with _connect(server.port) as sock:
                sock.sendall(
                    b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nX-Request-Budget-Ms: 2000\r\n\r\n"
                )
                # 5 bytes/s for up to 25 s: never a stall, always within the I/O timeout.
                while time.monotonic() - began < 25.0:
                    if select.select([sock], [], [], 0.2)[0]:
                        outcome["answer"] = _read_all(sock)
                        break
                    sock.sendall(b"a")
        except BaseException as exc:  # noqa: BLE001 - checked by the test's thread
            outcome["error"] = exc
        outcome["after_s"] = time.monotonic() - began

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    wait_until(lambda: server.stats()["in_flight"] == 1, "the only worker to read the trickle")
    # Old behaviour: the trickle kept the worker for all 25 s, and this check expired in line.
    assert _health_check(server.port) == 200
    trickler.join(CLIENT_TIMEOUT_S + 10)
    assert "error" not in outcome, outcome
    answer = outcome.get("answer", b"")
    assert answer.startswith(b"HTTP/1.1 408 ") and b"X-Prazo-Reason: body-timeout" in answer, answer
    assert outcome["after_s"] < WELL_BEFORE_IO_TIMEOUT_S
    assert server.stats()["app_errors"] == 0


def test_all_waits_on_the_client_together_stay_under_max_io_wait_whatever_the_budget(start: Any) -> None:
    server = start(_echo_or_health, threads=1, max_io_wait_ms=1500)
    with _connect(server.port) as sock:
        began = time.monotonic()
        # A budget far longer than the test: only the cap on waiting can end the read.
        sock.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nX-Request-Budget-Ms: 30000\r\n\r\n")
        while time.monotonic() - began < 25.0 and not select.select([sock], [], [], 0.2)[0]:
            sock.sendall(b"a")  # progress every 0.2 s: never the I/O timeout
        answer = _read_all(sock)
        assert time.monotonic() - began < WELL_BEFORE_IO_TIMEOUT_S
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body-timeout" in answer, answer


def test_expect_100_continue_and_no_body_holds_the_worker_only_until_the_deadline(start: Any) -> None:
    server = start(_echo_or_health, threads=1)
    with _connect(server.port) as sock:
        began = time.monotonic()
        sock.sendall(
            b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n"
            b"X-Request-Budget-Ms: 2000\r\n\r\n"
        )
        first = _read_until(sock, lambda received: b"\r\n\r\n" in received)
        assert first.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), first
        # The body never comes. Old behaviour: the worker waited the whole 30 s I/O timeout.
        answer = _read_until(sock, lambda received: False, limit_s=25.0)
        assert time.monotonic() - began < WELL_BEFORE_IO_TIMEOUT_S
    final = first[len(b"HTTP/1.1 100 Continue\r\n\r\n") :] + answer
    assert final.startswith(b"HTTP/1.1 408 ") and b"body-timeout" in final, final
    assert _health_check(server.port) == 200


def test_a_slow_reader_of_a_large_response_is_cut_after_the_write_grace(start: Any) -> None:
    size = 16 * 1024 * 1024

    def large(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if (answer := _health(environ, start_response)) is not None:
            return answer
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return [b"x" * size]

    server = start(large, threads=1, write_grace_ms=1000)
    fast = threading.Event()
    outcome: dict[str, Any] = {}

    def slow_reader() -> None:
        received = 0
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.settimeout(CLIENT_TIMEOUT_S)
            with sock:
                sock.connect(("127.0.0.1", server.port))
                sock.sendall(b"GET /large HTTP/1.1\r\nHost: x\r\nX-Request-Budget-Ms: 2000\r\n\r\n")
                try:
                    while chunk := sock.recv(65536):
                        received += len(chunk)
                        if not fast.is_set():
                            time.sleep(0.25)  # 256 KiB/s: progress all the time, so never an I/O timeout
                except ConnectionResetError:
                    pass
        except BaseException as exc:  # noqa: BLE001 - checked by the test's thread
            outcome["error"] = exc
        outcome["received"] = received

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    wait_until(lambda: server.stats()["in_flight"] == 1, "the worker to write the large response")
    try:
        # Old behaviour: the worker wrote for as long as the client read (64 s), and this check expired in line.
        assert _health_check(server.port) == 200
    finally:
        fast.set()
    reader.join(CLIENT_TIMEOUT_S + 10)
    assert "error" not in outcome, outcome
    assert 0 < outcome["received"] < size  # cut: the client sees a short body and the close


# ------------------------------------------------------ 2: response framing


@pytest.mark.parametrize(
    ("declared", "parts", "sent"),
    [
        (20, [b"0123456789"], b"0123456789"),  # one piece, short
        (5, [b"0123456789"], b"01234"),  # one piece, long: cut at the declared length
        (5, [b"0123", b"456789"], b"01234"),  # streamed, long
        (20, [b"01234", b"56789"], b"0123456789"),  # streamed, short
    ],
)
def test_a_body_that_does_not_match_its_content_length_ends_the_connection(
    start: Any, declared: int, parts: list[bytes], sent: bytes
) -> None:
    def mismatched(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Length", str(declared))])
        return list(parts)

    server = start(mismatched)
    with _connect(server.port) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: %d" % declared in head, answer
    # Nothing after the body: no second response spliced into it or read from its tail.
    assert body == sent, answer
    if len(parts) == 1:
        assert b"Connection: close" in head  # all known before the head went: it says so


def test_a_bad_content_length_from_the_app_is_a_500(start: Any) -> None:
    def bad(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Length", "-5")])
        return [b"body"]

    server = start(bad)
    assert request(server.port, "/").status == 500


# ------------------------------------------------------ 3: 100 Continue


def test_no_100_continue_once_the_response_has_begun(start: Any) -> None:
    def late_reader(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        write = start_response("200 OK", [])
        write(b"part1")
        return [b"|" + environ["wsgi.input"].read()]

    server = start(late_reader)
    with _connect(server.port) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n"
            b"X-Request-Budget-Ms: 10000\r\n\r\n"
        )
        answer = _read_until(sock, lambda received: b"part1" in received)
        # The response has begun: a client may send its body now without waiting for 100.
        sock.sendall(b"hello")
        answer += _read_until(sock, lambda received: received.endswith(b"0\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer
    assert b"100 Continue" not in answer, answer
    assert answer.endswith(b"5\r\npart1\r\n6\r\n|hello\r\n0\r\n\r\n"), answer


# --------------------------------------------- 4: a late read from a thread


def test_a_thread_reading_the_body_after_the_app_returned_never_uses_a_freed_connection(
    start: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A short lingering close: the engine would free the connection long before the thread's read ends.
    monkeypatch.setattr(frontdoor, "DEFAULT_LINGER_S", 0.2)
    inside = threading.Event()
    done = threading.Event()
    got: dict[str, Any] = {}

    def misusing(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] == "/echo":
            return _echo(environ, start_response)
        stream = environ["wsgi.input"]

        def stray() -> None:
            try:
                first = stream.read(2)
                inside.set()
                got["body"] = first + stream.read(8)
            except Exception as exc:  # noqa: BLE001 - what the read raised is the result
                got["error"] = exc
            finally:
                inside.set()
                done.set()

        threading.Thread(target=stray, daemon=True).start()
        assert inside.wait(APP_WAIT_S)
        time.sleep(1.0)  # the thread is in the engine's read by now, waiting without the GIL
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server = start(misusing)
    with _connect(server.port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nX-Request-Budget-Ms: 15000\r\n\r\nab")
        answer = _read_until(sock, lambda received: received.endswith(b"\r\n\r\nok"))
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        wait_until(lambda: server.stats()["in_flight"] == 0, "the worker to finish")
        time.sleep(1.0)  # old behaviour: the lingering close had ended and freed the connection by now
        sock.sendall(b"cdefghij")
        assert done.wait(CLIENT_TIMEOUT_S)
        assert got == {"body": b"abcdefghij"}, got
        assert b"Connection: close" in answer, answer  # the body was being read: where it ends was unknown
        assert _read_all(sock) == b""  # handed back once the read returned: closed politely
    # Another client is served normally: nothing of the first connection reached it.
    outcome = request(server.port, "/echo", method="POST", body=b"next")
    assert (outcome.status, outcome.body) == (200, b"next")
    wait_until(lambda: server.stats()["open_connections"] == 0, "every connection to close")


# -------------------------------- 5: keep-alive only when the body was read


def _ignoring(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


def test_an_unread_body_already_here_is_dropped_and_the_connection_kept(start: Any) -> None:
    server = start(_ignoring)
    with _connect(server.port) as sock:
        sock.sendall(
            b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
            b"GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        answer = _read_all(sock)
    assert answer.count(b"HTTP/1.1 200 OK") == 2, answer
    first, _, _ = answer.partition(b"\r\n\r\nok")
    assert b"Connection: keep-alive" in first, answer


def test_an_unread_body_that_arrived_after_the_head_is_dropped_and_the_connection_kept(start: Any) -> None:
    gate = threading.Event()

    def gated(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        gate.wait(APP_WAIT_S)
        return _ignoring(environ, start_response)

    server = start(gated)
    with _connect(server.port) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        wait_until(lambda: server.stats()["in_flight"] == 1, "the app to run")
        sock.sendall(b"hello" + b"GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(0.5)  # in the server's socket buffer by now, before the app answers
        gate.set()
        answer = _read_all(sock)
    assert answer.count(b"HTTP/1.1 200 OK") == 2, answer


def test_an_unread_body_not_yet_here_is_answered_with_connection_close(start: Any) -> None:
    server = start(_ignoring)
    with _connect(server.port) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhe")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nok"), answer
    # Old behaviour: "Connection: keep-alive", then the connection closed anyway.
    assert b"Connection: close" in answer, answer


def test_an_app_reading_the_body_after_its_response_began_gets_all_of_it(start: Any) -> None:
    def streaming_echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        write = start_response("200 OK", [])
        write(b"got:")
        return [environ["wsgi.input"].read()]

    server = start(streaming_echo)
    with _connect(server.port) as sock:
        sock.sendall(
            b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbye"
        )
        answer = _read_all(sock)
    first, _, second = answer.partition(b"0\r\n\r\n")
    # The body had all arrived when the head went: keep-alive, and nothing of it dropped under the app.
    assert b"Connection: keep-alive" in first and first.endswith(b"4\r\ngot:\r\n5\r\nhello\r\n"), answer
    assert second.startswith(b"HTTP/1.1 200 OK") and second.endswith(b"4\r\ngot:\r\n3\r\nbye\r\n0\r\n\r\n"), answer


def test_a_streamed_response_with_the_body_not_yet_here_says_close_and_the_app_still_reads_it(start: Any) -> None:
    def streaming_echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        write = start_response("200 OK", [])
        write(b"got:")
        return [environ["wsgi.input"].read()]

    server = start(streaming_echo)
    with _connect(server.port) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nX-Request-Budget-Ms: 10000\r\n\r\nhe")
        head = _read_until(sock, lambda received: b"got:" in received)
        sock.sendall(b"llo")
        answer = head + _read_all(sock)
    assert b"Connection: close" in head, answer
    assert answer.endswith(b"4\r\ngot:\r\n5\r\nhello\r\n0\r\n\r\n"), answer


# ------------------------------------------------- a broken chunked body


def test_a_broken_chunked_body_is_a_400_and_the_app_sees_request_body_error(start: Any) -> None:
    seen: list[BaseException] = []

    def reading(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        try:
            environ["wsgi.input"].read()
        except Exception as exc:
            seen.append(exc)
            raise
        start_response("200 OK", [("Content-Length", "0")])
        return []

    server = start(reading)
    with _connect(server.port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"X-Prazo-Reason: bad-request" in answer, answer
    assert len(seen) == 1 and isinstance(seen[0], RequestBodyError) and seen[0].failure == "malformed"
    assert server.stats()["app_errors"] == 0
