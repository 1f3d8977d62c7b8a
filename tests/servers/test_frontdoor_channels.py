"""The triage's side of a host's channels, with this test playing the worker thread byte by byte.

A triage engine (``Engine(role="triage")``) runs in this process on a real
listening socket; the test holds the worker's end of one channel and speaks
the protocol of ``pfd.h`` (``struct pfd_msg``) itself: it asks (HELLO), gets
a real client's connection (DISPATCH, the descriptor by ``SCM_RIGHTS``),
answers on that descriptor and gives it back (FINISH, DONE after RELEASE).
Then it breaks the protocol (a token it was never given, a short message, a
channel closed while it holds a connection) and checks what the triage owes
the clients: the connection is closed (never left hanging), counted
``worker_lost`` when it was running, and the engine keeps serving through
another channel.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from _helpers import wait_until
from prazo.bindings.servers.frontdoor.server import bound_listener, compiled_engine, engine_arguments
from prazo.bindings.servers.settings import resolve_settings

pytestmark = pytest.mark.compiled

# struct pfd_msg: kind, verdict, token, deadline/arrival/started/upstream/last_read ns,
# critical, budget_source, budget_invalid, arrival_from_kernel, draining, peer_len, len, peer.
MESSAGE = struct.Struct("=IiQqqqqqiiiiiII4x128s")
HELLO, DISPATCH, STOP, RELEASE, DONE, FINISH = range(1, 7)
WAIT_S = 20.0
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"


@dataclass
class Dispatch:
    token: int
    deadline_ns: int
    arrival_ns: int
    last_read_ns: int
    draining: int
    data: bytes
    conn: socket.socket


class Triage:
    """A triage engine on a loopback port, with ``channel()`` making a worker's end for the test."""

    def __init__(self, threads: int = 2, max_queue: int = 4) -> None:
        settings = resolve_settings(threads=threads, max_queue=max_queue, default_budget_ms=10000)
        arguments = engine_arguments(
            settings, threads=threads, io_timeout_ms=5000.0,
            write_grace_ms=1000.0, max_io_wait_ms=10000.0,
        )  # fmt: skip
        listener = bound_listener("127.0.0.1", 0, 64, False)
        self.port = listener.getsockname()[1]
        self.engine = compiled_engine().Engine([listener.detach()], role="triage", **arguments)
        self.engine.start()

    def channel(self, worker: int) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.engine.add_channel(theirs.detach(), worker)
        ours.settimeout(WAIT_S)
        return ours

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.engine.stats()
        return stats


@pytest.fixture
def triage() -> Iterator[Triage]:
    running = Triage()
    yield running
    running.engine.stop()


def send(
    channel: socket.socket, kind: int, token: int = 0, verdict: int = 0, data: bytes = b"", last_read_ns: int = 0
) -> None:
    """A message as a worker sends it (``last_read_ns``: when the bytes in ``data`` were read)."""
    fields = (kind, verdict, token, 0, 0, 0, 0, last_read_ns, 0, 0, 0, 0, 0, 0, len(data), b"")
    channel.send(MESSAGE.pack(*fields) + data)


def receive(channel: socket.socket) -> Dispatch | int:
    """The next message: a ``Dispatch``, or the kind of any other message."""
    data, fds, _flags, _address = socket.recv_fds(channel, MESSAGE.size + 200000, 4)
    fields = MESSAGE.unpack(data[: MESSAGE.size])
    if fields[0] != DISPATCH:
        return int(fields[0])
    assert len(fds) == 1
    token, deadline, arrival, last_read = fields[2], fields[3], fields[4], fields[7]
    draining, length = fields[12], fields[14]
    assert length == len(data) - MESSAGE.size
    return Dispatch(token, deadline, arrival, last_read, draining, data[MESSAGE.size :], socket.socket(fileno=fds[0]))


def after_loss(stats: dict[str, int]) -> tuple[int, int, int, int]:
    return stats["worker_lost"], stats["in_flight"], stats["worker_threads"], stats["worker_processes"]


def client(port: int, request: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    conn.sendall(request)
    return conn


def dispatched(channel: socket.socket) -> Dispatch:
    message = receive(channel)
    assert isinstance(message, Dispatch), message
    return message


def test_a_connection_goes_to_the_asking_thread_and_comes_back_for_its_next_request(triage: Triage) -> None:
    worker = triage.channel(0)
    send(worker, HELLO)
    first = b"GET /one HTTP/1.1\r\nHost: x\r\nX-Request-Budget-Ms: 5000\r\n\r\n"
    browser = client(triage.port, first + b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n")  # the second one pipelined
    one = dispatched(worker)
    assert one.data.startswith(first)  # the bytes already read travel with it, the head and what follows
    assert 4e9 < one.deadline_ns - one.arrival_ns <= 5e9
    assert one.draining == 0
    one.conn.sendall(RESPONSE)
    # The bytes after this request's head are the next head: they go back with the connection.
    # (Sent as never read: the triage takes its own clock then, it never trusts a 0 or a future time.)
    send(worker, FINISH, one.token, verdict=1, data=one.data[len(first) :])
    one.conn.close()
    two = dispatched(worker)  # FINISH gave the place back: the thread asks again without a HELLO
    assert two.data == b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n"
    two.conn.sendall(RESPONSE)
    send(worker, RELEASE, two.token)  # the place first, the connection later (another app thread was writing)
    send(worker, DONE, two.token, verdict=0)
    two.conn.close()
    received = b""
    while received.count(b"ok") < 2 or not received.endswith(b"ok"):
        chunk = browser.recv(4096)
        assert chunk, received
        received += chunk
    assert received == RESPONSE * 2
    assert browser.recv(4096) == b""  # verdict 0: a polite close once the response is out
    wait_until(lambda: triage.stats()["completed"] == 2, "both releases")
    stats = triage.stats()
    assert (stats["started"], stats["in_flight"], stats["worker_lost"]) == (2, 0, 0)
    assert (stats["worker_processes"], stats["worker_threads"]) == (1, 1)


@pytest.mark.parametrize(
    "breakage",
    ["unknown token", "short message", "unknown kind", "channel closed"],
)
def test_a_worker_that_breaks_the_protocol_loses_its_channel_and_only_its_request(
    triage: Triage, breakage: str
) -> None:
    broken, healthy = triage.channel(0), triage.channel(1)
    send(broken, HELLO)
    wait_until(lambda: triage.stats()["worker_threads"] == 2, "both channels")
    victim = client(triage.port, b"GET /victim HTTP/1.1\r\nHost: x\r\n\r\n")
    held = dispatched(broken)
    if breakage == "unknown token":
        send(broken, FINISH, held.token ^ 0x10, verdict=1)
    elif breakage == "short message":
        broken.send(b"\x05\x00")
    elif breakage == "unknown kind":
        send(broken, 99, held.token)
    else:
        broken.close()
    held.conn.close()  # the worker's copy goes (as it would when its process dies)
    victim.settimeout(WAIT_S)
    assert victim.recv(4096) == b""  # closed, never left hanging
    # The request counted lost, its place back, the channel and its worker gone (the other stays).
    wait_until(lambda: after_loss(triage.stats()) == (1, 0, 1, 1), "the channel dropped")
    # The host goes on with the other worker.
    send(healthy, HELLO)
    survivor = client(triage.port, b"GET /survivor HTTP/1.1\r\nHost: x\r\n\r\n")
    served = dispatched(healthy)
    assert served.data.startswith(b"GET /survivor ")
    served.conn.sendall(RESPONSE)
    send(healthy, FINISH, served.token, verdict=0)
    served.conn.close()
    assert survivor.recv(4096).startswith(b"HTTP/1.1 200 OK")


def test_a_retired_worker_gets_stop_when_it_asks_and_no_connection(triage: Triage) -> None:
    old, new = triage.channel(0), triage.channel(1)
    wait_until(lambda: triage.stats()["worker_threads"] == 2, "both channels")
    triage.engine.retire_worker(0)
    send(old, HELLO)
    assert receive(old) == STOP
    send(new, HELLO)
    conn = client(triage.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    served = dispatched(new)  # the only asking thread that may take it
    served.conn.sendall(RESPONSE)
    send(new, FINISH, served.token, verdict=0)
    served.conn.close()
    assert conn.recv(4096).startswith(b"HTTP/1.1 200 OK")
    assert triage.stats()["worker_lost"] == 0


def test_the_least_loaded_worker_gets_the_next_connection(triage: Triage) -> None:
    a0, a1, b0 = triage.channel(0), triage.channel(0), triage.channel(1)
    for channel in (a0, a1, b0):
        send(channel, HELLO)
    wait_until(lambda: triage.stats()["worker_threads"] == 3, "three channels")
    clients = [client(triage.port, f"GET /{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode()) for i in range(2)]
    # Two requests, three free threads: one goes to each worker, never both to worker 0.
    got_b = dispatched(b0)
    assert triage.engine.worker_loads() in ({0: 1, 1: 1}, {0: 0, 1: 1})
    wait_until(lambda: triage.engine.worker_loads() == {0: 1, 1: 1}, "one request on each worker")
    a0.settimeout(0.2)
    a1.settimeout(0.2)
    got_a: list[tuple[Dispatch, socket.socket]] = []
    deadline = time.monotonic() + WAIT_S
    while not got_a and time.monotonic() < deadline:
        for channel in (a0, a1):
            try:
                got_a.append((dispatched(channel), channel))
            except TimeoutError:
                pass
    assert len(got_a) == 1, got_a
    for served, channel in ((got_b, b0), got_a[0]):
        served.conn.sendall(RESPONSE)
        served.conn.close()
        send(channel, FINISH, served.token, verdict=0)
    for conn in clients:
        assert conn.recv(4096).startswith(b"HTTP/1.1 200 OK")
