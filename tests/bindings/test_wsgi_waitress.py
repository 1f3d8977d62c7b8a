"""A list body behind prazo on real waitress: Content-Length and HTTP/1.0 keep-alive survive.

waitress sets ``Content-Length`` itself only when the app's iterable has
``len() == 1``; without it, an HTTP/1.0 client asking for keep-alive gets
``Connection: close``. prazo wraps the body to release the slot, so the
wrapper must keep the list's length — on the middleware's Python path, its
compiled path, and the waitress embedding.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from _required import require
from prazo.bindings.wsgi import AdmissionMiddleware
from prazo.core import extension_wanted

waitress = require("waitress")
wasyncore = require("waitress.wasyncore")

WAIT_S = 20.0  # generous bound for a loopback exchange on a loaded machine
BODY = b"one chunk, no Content-Length from the app"


def one_chunk_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [BODY]


def _read_response(sock: socket.socket, buffered: bytes) -> tuple[str, dict[str, str], bytes, bytes]:
    """(status line, headers with lower-case names, body, bytes left over) of one response with a length."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed before the end of the head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    assert "content-length" in headers, f"no Content-Length: {head!r}"
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed before the end of the body"
        rest += chunk
    return status, headers, rest[:length], rest[length:]


def _assert_keep_alive_twice(port: int) -> None:
    """Two HTTP/1.0 keep-alive requests on one connection, each answered with its length."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        left = b""
        for _ in range(2):
            sock.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n")
            status, headers, body, left = _read_response(sock, left)
            assert status.startswith("HTTP/1.0 200"), status
            assert headers["content-length"] == str(len(BODY))
            assert headers.get("connection", "").lower() == "keep-alive"
            assert body == BODY


@contextmanager
def _serve(app: Any) -> Iterator[int]:
    server = waitress.create_server(app, host="127.0.0.1", port=0, threads=2)
    thread = threading.Thread(target=server.run, name="waitress-io", daemon=True)
    thread.start()
    try:
        yield server.effective_port
    finally:
        # Closed by the I/O thread itself (closing from here races its
        # select() into EBADF); run() returns once nothing is left to poll.
        try:
            server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        except OSError:  # the trigger is closed already: the I/O loop has ended (EBADF once in CI)
            pass
        thread.join(WAIT_S)
        wasyncore.close_all(server._map)  # whatever is left, now that no select() can race it
        server.task_dispatcher.shutdown()


def _wait_for_no_slot_held(stats: Callable[[], dict[str, int]]) -> dict[str, int]:
    # waitress closes the body a moment after the answer reached the client.
    end = time.monotonic() + WAIT_S
    while stats()["in_flight"] and time.monotonic() < end:
        time.sleep(0.005)
    return stats()


@pytest.mark.parametrize("fast_path", [False, True], ids=["python-path", "compiled-path"])
def test_middleware_keeps_waitress_content_length_for_a_one_element_list(fast_path: bool) -> None:
    if fast_path and not extension_wanted():
        pytest.skip("PRAZO_NO_EXTENSIONS is set: there is no compiled WSGI path")
    middleware = AdmissionMiddleware(one_chunk_app, max_concurrency=2, max_queue=2, fast_path=fast_path)
    with _serve(middleware) as port:
        _assert_keep_alive_twice(port)
        stats = _wait_for_no_slot_held(middleware.stats)
        assert (stats["in_flight"], stats["started"], stats["completed"]) == (0, 2, 2)  # released once each


@pytest.mark.parametrize("body", [(BODY,), [BODY]], ids=["tuple", "list"])
def test_waitress_embedding_keeps_content_length_for_a_one_element_body(body: Any) -> None:
    from prazo.bindings.servers import waitress as prazo_waitress

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return body

    server = prazo_waitress.create_server(app, host="127.0.0.1", port=0, threads=2, max_queue=2)
    thread = threading.Thread(target=server.run, name="waitress-io", daemon=True)
    thread.start()
    try:
        _assert_keep_alive_twice(server.effective_port)
        stats = _wait_for_no_slot_held(server.task_dispatcher.stats)
        assert (stats["in_flight"], stats["started"], stats["completed"]) == (0, 2, 2)
    finally:
        prazo_waitress.shutdown(server, 10.0)
        thread.join(WAIT_S)
