"""The head reader: its compiled twin against its Python specification, and an admission that takes the head off the socket.

``prazo.bindings.servers.plumbing._heads_c`` runs ``find_head``, ``request_environ``
and ``waiting_bytes`` for the socket-level embeddings; ``heads`` holds the
readable rules (``*_py``). For any bytes both find the same head and give the
same environ (the compiled one may decline, returning None, and the Python
rule then runs: the public ``request_environ`` always equals the spec), and
both read a socket alike. Then ``ConnectionAdmission(take_bytes=...)``, the
mode gunicorn's worker uses: the head is read off the socket, every byte read
reaches the server once, before the request is served, and the timeouts and
departures of a peeked head still hold.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from _helpers import JOIN_TIMEOUT_S, examples, wait_until
from _required import require_compiled
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.servers.plumbing import heads
from prazo.bindings.servers.plumbing.connection import ConnectionAdmission
from prazo.bindings.servers.plumbing.dispatcher import Ticket
from prazo.bindings.servers.settings import ServerSettings

# compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = pytest.mark.compiled


@pytest.fixture(scope="module")
def compiled() -> Any:
    return require_compiled("prazo.bindings.servers.plumbing._heads_c")


_METHODS = st.sampled_from([b"GET", b"POST", b"", b"g\xe9t", b"M-SEARCH"])
_TARGET_PIECES = st.sampled_from(
    [b"/", b"%", b"%41", b"%e9", b"%zz", b"?", b"#", b"//", b"http://", b"h", b"a", b"\xe9", b" ", b"\t", b"_"]
)
_TARGETS = st.one_of(st.binary(max_size=10), st.lists(_TARGET_PIECES, max_size=8).map(b"".join))
_NAMES = st.one_of(
    st.sampled_from(
        [b"Host", b"X-A", b"x-a", b"X_A", b"X-Request-Budget-Ms", b"grpc-timeout", b"X-\xdf", b"\xff", b"a b", b""]
    ),
    st.binary(max_size=8),
)
_VALUES = st.one_of(st.sampled_from([b"", b" 250 ", b"\t1\t", b"a,b", b"\xe9\xff"]), st.binary(max_size=10))
_ENDINGS = st.sampled_from([b"\r\n", b"\n", b"\r\r\n"])
_LINES = st.one_of(
    st.tuples(_NAMES, st.sampled_from([b":", b": ", b" :", b":\t"]), _VALUES).map(b"".join),
    st.sampled_from([b" folded", b"no colon", b":", b"\x0bX:1", b"X\x0c:1", b"X\r:1"]),
)
_REQUEST_LINES = st.one_of(
    # Well-formed lines half the time, so the compiled rule does not decline and the header rules are compared.
    st.tuples(st.sampled_from([b"GET", b"POST"]), st.sampled_from([b"/", b"/a/b?x=1", b"/p#f", b"/?"])).map(
        lambda p: p[0] + b" " + p[1] + b" HTTP/1.1"
    ),
    st.tuples(
        _METHODS,
        st.sampled_from([b" ", b"  ", b"\t"]),
        _TARGETS,
        st.sampled_from([b" HTTP/1.1", b" HTTP/1.0", b"", b" HTTP/1.1 x"]),
    ).map(b"".join),
)
HEADS = st.tuples(_REQUEST_LINES, _ENDINGS, st.lists(st.tuples(_LINES, _ENDINGS), max_size=6)).map(
    lambda p: p[0] + p[1] + b"".join(line + end for line, end in p[2])
)
# What arrives on a socket: optional empty lines, a head, its end, maybe more.
DATA = st.one_of(
    st.binary(max_size=200),
    st.tuples(
        st.sampled_from([b"", b"\r\n", b"\n\r\n", b"\r"]),
        HEADS,
        st.sampled_from([b"\r\n", b"\n", b"", b"\r"]),
        st.binary(max_size=20),
    ).map(b"".join),
)


@settings(max_examples=examples(400))
@given(DATA)
def test_the_compiled_head_finder_agrees_with_its_specification(compiled: Any, data: bytes) -> None:
    assert compiled.find_head(data) == heads.find_head_py(data)


@settings(max_examples=examples(600))
@given(HEADS, st.sampled_from([None, "10.0.0.1", 7]))
def test_the_compiled_environ_is_the_specification_or_declines(compiled: Any, head: bytes, peer: object) -> None:
    spec = heads.request_environ_py(head, peer)
    environ = compiled.request_environ(head, peer)
    if environ is not None:
        assert environ == spec
        assert list(environ) == list(spec)
    # What the admission calls: the compiled rule or, where it declined, the Python one.
    assert heads.request_environ(head, peer) == spec


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\n",
        b"POST /x/y?q=%20#f HTTP/1.1\r\nX-Request-Budget-Ms:  250 \r\nx-request-budget-ms: 300\r\nX_Request_Budget_Ms: 1\r\n",
        b"GET /a HTTP/1.0\nHost:\n no colon\nBad Name: v\n",
    ],
)
def test_the_compiled_environ_covers_ordinary_heads(compiled: Any, head: bytes) -> None:
    # The fast path is taken for what clients really send (it declines only the unusual).
    environ = compiled.request_environ(head, "127.0.0.1")
    assert environ == heads.request_environ_py(head, "127.0.0.1")
    assert environ["REMOTE_ADDR"] == "127.0.0.1" and "PATH_INFO" in environ and "REQUEST_METHOD" in environ


@pytest.mark.parametrize(
    "head", [b"GET /%41 HTTP/1.1\r\n", b"GET http://h/p HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nX-\xdf: 1\r\n", b"GET /\r\n"]
)
def test_the_compiled_environ_declines_what_needs_python(compiled: Any, head: bytes) -> None:
    assert compiled.request_environ(head, None) is None
    assert heads.request_environ(head, None) == heads.request_environ_py(head, None)


@pytest.mark.parametrize("reader", ["compiled", "python"])
def test_waiting_bytes_peeks_or_takes_and_never_blocks(compiled: Any, reader: str) -> None:
    def compiled_look(sock: socket.socket, limit: int = heads.MAX_HEAD_BYTES, *, take: bool = False) -> bytes | None:
        result: bytes | None = compiled.recv_nowait(sock.fileno(), limit, not take)
        return result

    look = heads.waiting_bytes_py if reader == "python" else compiled_look
    server, client = socket.socketpair()
    with server, client:
        server.settimeout(5.0)  # a timeout must not make the look wait
        started = time.monotonic()
        assert look(server) is None and look(server, take=True) is None
        assert time.monotonic() - started < 1.0
        client.sendall(b"GET / HTTP/1.1\r\n\r\nrest")
        wait_until(lambda: look(server) is not None, "the bytes to arrive")
        assert look(server, 5) == b"GET /"
        assert look(server, take=True) == b"GET / HTTP/1.1\r\n\r\nrest"
        assert look(server) is None and server.gettimeout() == 5.0
        client.close()
        assert look(server) == b"" and look(server, take=True) == b""
    # A closed socket (fileno -1) is a failure, never an exception.
    assert look(server) == b""
    with pytest.raises(ValueError, match="limit"):
        compiled.recv_nowait(0, 0)


@contextmanager
def _taking(header_timeout_s: float) -> Iterator[tuple[ConnectionAdmission, list[Ticket], list[tuple[Any, bytes]]]]:
    """A started admission in the take mode, what it served and what it handed over; closed at the end."""
    served: list[Ticket] = []
    taken: list[tuple[Any, bytes]] = []
    admission = ConnectionAdmission(
        ServerSettings(threads=1, max_queue=1, header_timeout_ms=header_timeout_s * 1000),
        serve=served.append,
        socket_of=lambda item: item,
        name="test-take",
        take_bytes=lambda item, data: taken.append((item, data)),
    )
    admission.start()
    try:
        yield admission, served, taken
    finally:
        assert admission.close(timeout=JOIN_TIMEOUT_S)


def test_a_head_taken_off_the_socket_reaches_the_server_whole_before_it_is_served() -> None:
    server_side, client = socket.socketpair()
    with server_side, client, _taking(JOIN_TIMEOUT_S) as (admission, served, taken):
        client.sendall(b"POST / HTTP/1.1\r\nContent-Length: 4\r\nX-Request-Budget-Ms: 60")
        assert admission.admit(server_side, server_side, None, buffered=b"")
        time.sleep(0.05)
        assert (served, taken) == ([], [])
        client.sendall(b"00\r\n\r\nbodyGET /next")
        wait_until(lambda: served, "the completed head to be served")
        ticket = served[0]
        assert ticket.deadline.ns - ticket.arrival_ns == 6000 * 1_000_000
        assert ticket.environ is not None and ticket.environ["REQUEST_METHOD"] == "POST"
        # Once, all of it (head, body, the next request's start), and nothing left on the socket.
        assert taken == [
            (server_side, b"POST / HTTP/1.1\r\nContent-Length: 4\r\nX-Request-Budget-Ms: 6000\r\n\r\nbodyGET /next")
        ]
        assert heads.waiting_bytes(server_side) is None


def test_a_taken_head_counts_what_the_server_held_already() -> None:
    server_side, client = socket.socketpair()
    with server_side, client, _taking(JOIN_TIMEOUT_S) as (admission, served, taken):
        # The server read the request line itself (a pipelined request behind a body, say).
        client.sendall(b"X-Request-Budget-Ms: 700\r\n\r\n")
        wait_until(lambda: heads.waiting_bytes(server_side) is not None, "the bytes to arrive")
        assert not admission.admit(server_side, server_side, None, buffered=b"GET / HTTP/1.1\r\n")
        wait_until(lambda: served, "the head to be served")
        assert served[0].deadline.ns - served[0].arrival_ns == 700 * 1_000_000
        assert taken == [(server_side, b"X-Request-Budget-Ms: 700\r\n\r\n")]


def test_a_taken_head_still_times_out_with_408_and_a_departed_client_is_dropped() -> None:
    slow_side, slow_client = socket.socketpair()
    gone_side, gone_client = socket.socketpair()
    with slow_side, slow_client, gone_side, gone_client, _taking(0.2) as (admission, served, taken):
        slow_client.settimeout(JOIN_TIMEOUT_S)
        slow_client.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n")
        assert admission.admit(slow_side, slow_side, None)
        response = http.client.HTTPResponse(slow_client)  # type: ignore[arg-type]
        response.begin()
        assert (response.status, response.getheader("X-Prazo-Reason")) == (408, "header-timeout")
        gone_client.sendall(b"GET / HTTP/1.1\r\n")
        assert admission.admit(gone_side, gone_side, None)
        gone_client.close()
        # Taken off the socket, the end of the stream is seen at once (a peek could not see it).
        wait_until(lambda: gone_side.fileno() == -1, "the departed client's connection to be closed")
        assert served == [] and taken == []
        # The count follows the close: the watcher thread closes, then forgets the head.
        wait_until(lambda: admission.stats()["pending_heads"] == 0, "the departed client's head forgotten")
        assert admission.stats()["header_timeouts"] == 1


def test_take_bytes_must_be_callable() -> None:
    with pytest.raises(TypeError, match="take_bytes"):
        ConnectionAdmission(
            ServerSettings(threads=1, max_queue=1),
            serve=lambda ticket: None,
            socket_of=lambda item: item,
            take_bytes=42,  # type: ignore[arg-type]
        )
