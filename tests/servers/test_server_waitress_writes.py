"""The waitress embedding's write path: the I/O loop skips a channel while its worker sends, and loses nothing.

``AdmissionChannel`` reports a channel not writable while a worker is inside
``write_soon``, so the I/O thread does not turn its loop on a lock it cannot
take. These tests check the three ways that could lose output on real
waitress on loopback:

- output a worker's send leaves behind (the client reads slowly) while the
  app has not finished: the I/O thread must still flush it;
- a worker waiting inside ``write_soon`` for the I/O thread to flush below
  ``outbuf_high_watermark``: the channel must stay writable for it;
- a streamed answer whose chunks come with pauses.

Every server runs with ``asyncore_loop_timeout=60``: an I/O thread left asleep
would not wake by itself within the clients' timeouts, so a lost wake-up fails
the test instead of costing a second.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from _helpers import wait_until
from _required import require

require("waitress")

from prazo.bindings.servers.waitress import AdmissionChannel, create_server, shutdown  # noqa: E402

WAIT_S = 20.0  # generous bound for a loopback exchange on a loaded machine
MIB = 1024 * 1024


@contextmanager
def _serving(app: Callable[..., Any], **waitress_options: Any) -> Iterator[Any]:
    server = create_server(
        app, host="127.0.0.1", port=0, threads=2, max_queue=2, asyncore_loop_timeout=60, **waitress_options
    )
    thread = threading.Thread(target=server.run, name="waitress-io", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        shutdown(server, WAIT_S)
        thread.join(WAIT_S)
        assert not thread.is_alive(), "run() did not return after shutdown"


def _send_request(port: int, *, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        # Before connect: the window the client offers is what makes the server's send partial.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    return sock


def _read_until(sock: socket.socket, received: bytearray, size: int) -> None:
    """Read until ``received`` holds ``size`` bytes; a stall raises ``socket.timeout`` after ``WAIT_S``."""
    while len(received) < size:
        chunk = sock.recv(1 << 20)
        assert chunk, f"the server closed after {len(received)} of {size} bytes"
        received += chunk


def _read_head(sock: socket.socket, received: bytearray) -> int:
    """Read until the response head is complete; the offset of the body in ``received``."""
    while b"\r\n\r\n" not in received:
        _read_until(sock, received, len(received) + 1)
    return received.index(b"\r\n\r\n") + 4


def _channels(server: Any) -> list[AdmissionChannel]:
    return [entry for entry in list(server._map.values()) if isinstance(entry, AdmissionChannel)]


def test_output_a_partial_send_leaves_reaches_a_slow_client_while_the_app_still_runs() -> None:
    """12 MiB in one chunk to a client that reads nothing at first, then the app waits for the client.

    waitress's ``write_soon`` wakes the I/O loop after a partial send, while
    the worker is still inside it (the channel not writable then). The
    server's ``pull_trigger`` is made to wait, that once, until the loop has
    turned twice: the loop has then looked at the channel while it was not
    writable and gone back to sleep, which is the moment the wake-up at the
    end of ``AdmissionChannel.write_soon`` exists for.
    """
    body = bytes(range(256)) * (12 * MIB // 256)
    all_read = threading.Event()
    sent = threading.Event()
    loop_looked = threading.Event()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Length", str(len(body) + 4))])
        yield body
        sent.set()
        # The app stays inside the request, longer than the client waits for
        # a byte: no end-of-request wake-up may flush the rest.
        all_read.wait(3 * WAIT_S)
        yield b"done"

    with _serving(app) as server:
        pull_trigger = server.pull_trigger

        def pull_then_let_the_loop_look() -> None:
            pull_trigger()
            in_write = [channel for channel in _channels(server) if channel._writing and channel.total_outbufs_len]
            if in_write and threading.current_thread().name != "waitress-io" and not loop_looked.is_set():
                for _ in range(2):
                    turned = threading.Event()
                    server.trigger.pull_trigger(turned.set)
                    assert turned.wait(WAIT_S), "the I/O loop did not turn"
                loop_looked.set()

        server.pull_trigger = pull_then_let_the_loop_look
        sock = _send_request(int(server.effective_port), receive_buffer=64 * 1024)
        with sock:
            assert sent.wait(WAIT_S), "the app never got past its first chunk"
            assert loop_looked.is_set(), "the send was not partial: the test proves nothing"
            [channel] = _channels(server)
            assert channel.total_outbufs_len > 0, "the send was not partial: the test proves nothing"
            received = bytearray()
            head = _read_head(sock, received)
            _read_until(sock, received, head + len(body))
            assert bytes(received[head : head + len(body)]) == body
            all_read.set()
            _read_until(sock, received, head + len(body) + 4)
            assert bytes(received[head + len(body) :]) == b"done"


def test_a_worker_waiting_for_the_high_watermark_is_flushed_for() -> None:
    """Chunks beyond ``outbuf_high_watermark``: the worker waits inside write_soon until the I/O thread flushes."""
    chunk = b"w" * (2 * MIB)
    chunks = 6
    waited = threading.Event()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Length", str(len(chunk) * chunks))])
        for _ in range(chunks):
            yield chunk

    with _serving(app, outbuf_high_watermark=MIB) as server:
        sock = _send_request(int(server.effective_port), receive_buffer=64 * 1024)
        with sock:
            # Nothing is read until the worker has had to wait for the I/O thread.
            def worker_waits() -> bool:
                channels = _channels(server)
                if channels and channels[0]._writing and channels[0].total_outbufs_len > MIB:
                    waited.set()
                return waited.is_set()

            wait_until(worker_waits, "the worker to wait for the high watermark")
            received = bytearray()
            head = _read_head(sock, received)
            _read_until(sock, received, head + len(chunk) * chunks)
            assert bytes(received[head:]) == chunk * chunks
        wait_until(lambda: server.task_dispatcher.stats()["in_flight"] == 0, "the slot to be given back")


def test_a_streamed_answer_arrives_chunk_by_chunk_while_the_app_pauses() -> None:
    """Each chunk reaches the client before the app makes the next one (the app waits for the client to say so)."""
    pieces = [b"first\n", b"second\n", b"third\n"]
    next_piece = [threading.Event() for _ in pieces]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])  # chunked: no length
        for piece, go in zip(pieces, next_piece):
            assert go.wait(WAIT_S), "the client never asked for the next piece"
            yield piece

    with _serving(app) as server:
        sock = _send_request(int(server.effective_port))
        with sock:
            received = bytearray()
            for piece, go in zip(pieces, next_piece):
                go.set()
                started = time.monotonic()
                while piece not in received:
                    _read_until(sock, received, len(received) + 1)
                # Far below the loop's 60 s timeout: the piece came with the write, not with a loop timeout.
                assert time.monotonic() - started < WAIT_S
            while not received.endswith(b"0\r\n\r\n"):
                _read_until(sock, received, len(received) + 1)
