"""The waitress embedding's write path: one send per small answer, no loop turns on a sending channel, nothing lost.

``AdmissionChannel`` reports a channel not writable while a worker is inside
``write_soon``, so the I/O thread does not turn its loop on a lock it cannot
take. These tests check the three ways that could lose output on real
waitress on loopback:

- output a worker's send leaves behind (the client reads slowly) while the
  app has not finished: the I/O thread must still flush it;
- a worker waiting inside ``write_soon`` for the I/O thread to flush below
  ``outbuf_high_watermark``: the channel must stay writable for it;
- a streamed answer whose chunks come with pauses.

The head of an answer goes out with its first body chunk in one send
(``_HeadWithFirstChunk``); the tests count the sends, and check the answers
that have no chunk to carry their head.

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
        app,
        host="127.0.0.1",
        port=0,
        threads=2,
        max_queue=2,
        default_budget_ms=60000,  # a request held in line outlives every test
        max_budget_ms=60000,
        asyncore_loop_timeout=60,
        **waitress_options,
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


class _CountingChannel(AdmissionChannel):
    """An ``AdmissionChannel`` that records the size of every send."""

    sends: list[int]

    def send(self, data: bytes, do_close: bool = True) -> int:
        sent = super().send(data, do_close=do_close)
        self.sends.append(sent)
        return sent  # type: ignore[no-any-return]


@contextmanager
def _counting_sends(app: Callable[..., Any], **limits: Any) -> Iterator[tuple[Any, list[int]]]:
    sends: list[int] = []
    channel_class = type("Counting", (_CountingChannel,), {"sends": sends})
    with _serving(app, **limits) as server:
        server.channel_class = channel_class
        yield server, sends


def _exchange(port: int, requests: bytes, answers: int, *, bodies: bool = True) -> list[bytes]:
    """Send ``requests`` on one connection and read ``answers`` responses, each with its Content-Length.

    ``bodies=False``: the answers have none, whatever their length says (answers to HEAD).
    """
    responses = []
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(requests)
        received = bytearray()
        for _ in range(answers):
            head = _read_head(sock, received)
            fields = bytes(received[:head]).lower()
            length = 0
            if bodies and b"content-length:" in fields:
                length = int(fields.split(b"content-length:")[1].split(b"\r\n")[0])
            _read_until(sock, received, head + length)
            responses.append(bytes(received[: head + length]))
            del received[: head + length]
    return responses


def test_the_head_and_a_small_first_chunk_go_out_in_one_send() -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Length", "5")])
        return [b"hello"]

    with _counting_sends(app) as (server, sends):
        [answer] = _exchange(int(server.effective_port), b"GET / HTTP/1.1\r\nHost: test\r\n\r\n", 1)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nhello")
        wait_until(lambda: sum(sends) == len(answer), "the answer to be sent")
        assert sends == [len(answer)]


def test_a_first_chunk_too_large_to_copy_goes_out_after_the_head() -> None:
    body = b"b" * (256 * 1024)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]

    with _counting_sends(app) as (server, sends):
        [answer] = _exchange(int(server.effective_port), b"GET / HTTP/1.1\r\nHost: test\r\n\r\n", 1)
        assert answer.endswith(b"\r\n\r\n" + body)
        wait_until(lambda: sum(sends) == len(answer), "the answer to be sent")
        assert sends[0] == len(answer) - len(body), "the head was not sent on its own"


def test_answers_without_a_body_chunk_still_send_their_head_and_keep_the_connection() -> None:
    """HEAD, a 204, a body cut at Content-Length: 0, an empty body: each head goes out alone; keep-alive holds."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ["PATH_INFO"]
        if path == "/no-content":
            start_response("204 No Content", [])
            return [b"ignored"]
        if path == "/zero":
            start_response("200 OK", [("Content-Length", "0")])
            return [b"past the length"]
        if path == "/empty":
            start_response("200 OK", [("Content-Length", "0")])
            return []
        start_response("200 OK", [("Content-Length", "4")])
        return [b"body"]

    with _counting_sends(app) as (server, _):
        port = int(server.effective_port)
        [head_answer] = _exchange(port, b"HEAD / HTTP/1.1\r\nHost: test\r\n\r\n", 1, bodies=False)
        assert head_answer.startswith(b"HTTP/1.1 200 OK\r\n") and head_answer.endswith(b"\r\n\r\n")
        # waitress closes after a 204 without a length, as it does without prazo.
        [no_content] = _exchange(port, b"GET /no-content HTTP/1.1\r\nHost: test\r\n\r\n", 1)
        assert no_content.startswith(b"HTTP/1.1 204 No Content\r\n") and no_content.endswith(b"\r\n\r\n")
        requests = b"".join(b"GET %s HTTP/1.1\r\nHost: test\r\n\r\n" % path for path in (b"/zero", b"/empty", b"/"))
        answers = _exchange(port, requests, 3)
        assert [answer.split(b"\r\n", 1)[0] for answer in answers] == [b"HTTP/1.1 200 OK"] * 3
        assert [answer.partition(b"\r\n\r\n")[2] for answer in answers] == [b"", b"", b"body"]


def test_a_refusal_goes_out_in_one_send() -> None:
    """The 503 written by the I/O thread: head and body together, and the connection stays open."""
    release = threading.Event()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        release.wait(WAIT_S)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    with _counting_sends(app) as (server, sends):
        port = int(server.effective_port)
        holders = [
            threading.Thread(target=_exchange, args=(port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", 1)) for _ in range(4)
        ]
        for holder in holders:
            holder.start()
        try:
            # threads=2, max_queue=2: four requests fill the server.
            wait_until(lambda: server.task_dispatcher.stats()["offered"] == 4, "the four requests to be admitted")
            assert server.task_dispatcher.stats()["rejected_full"] == 0
            before = len(sends)
            refused, again = _exchange(port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n" * 2, 2)
            assert refused.startswith(b"HTTP/1.1 503") and again.startswith(b"HTTP/1.1 503")
            wait_until(lambda: len(sends) >= before + 2, "both refusals to be sent")
            assert sends[before:] == [len(refused), len(again)]
        finally:
            release.set()
            for holder in holders:
                holder.join(WAIT_S)
