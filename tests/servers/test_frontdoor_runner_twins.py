"""The compiled request loop against its specification, byte for byte, on two live front doors.

``_engine_c.RequestLoop`` (the loop, ``start_response``, the framing, the
body's iteration and writes in Cython) and ``runner.RequestRunner``'s Python
methods must put the same bytes on the wire for whatever an app does. One
front door serves on each; Hypothesis draws what the app does (its status and
fields, good and bad; its body as a list, a generator or ``write()`` calls,
with empty chunks, ``str`` and other buffers; an exception at the call, in the
body or in ``close()``) and what the client asks (GET or HEAD, HTTP/1.0 or
1.1, keep-alive or not, a request body the app reads or leaves). Each request
is sent with a second one pipelined behind it and the client's side shut, so
the bytes read until the server closes say everything either loop decided:
the head, the body it framed, and whether the connection carried the next
request. Only the server's own ``Date`` differs (a second may turn between
the two), and it is masked.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _helpers import examples
from _server_harness import CLIENT_TIMEOUT_S, FrontDoors, read_to_eof
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

# slow: real sockets; compiled: its subject is the compiled loop, so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]

_SERVER_DATE = re.compile(rb"Date: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT")
_APP_DATE = ("Date", "Sat, 01 Jan 2000 00:00:00 GMT")
_SECOND = b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass(frozen=True)
class Scenario:
    """What the app does for one request."""

    status: Any
    headers: list[Any]
    chunks: list[Any]
    body: str  # list, tuple, generator, write
    fails: str | None  # call, body, close
    reads: str | None  # how the app reads wsgi.input: a key of _READS


_READS: dict[str, Callable[[Any], object]] = {
    "all": lambda body: body.read(),
    "none-size": lambda body: body.read(None),
    "by-2": lambda body: [body.read(2), body.read(2), body.read(5), body.read(0)],
    "line": lambda body: [body.readline(), body.readline(2), body.readline()],
    "lines": lambda body: body.readlines(),
    "lines-hint": lambda body: body.readlines(3),
    "iterate": list,
}


class Boom(Exception):
    """What the app raises where the scenario says."""


class ScenarioApp:
    """Answers ``/second`` with 200 ``ok``; any other path with what ``scenario`` says."""

    def __init__(self) -> None:
        self.scenario: Scenario | None = None

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ["PATH_INFO"] == "/second":
            start_response("200 OK", [("Content-Length", "2")])
            return [b"ok"]
        scenario = self.scenario
        assert scenario is not None
        headers = list(scenario.headers)
        if scenario.reads is not None:
            # What wsgi.input gave, where the client sees it.
            headers.append(("X-Read", repr(_READS[scenario.reads](environ["wsgi.input"])).encode().hex()))
        if scenario.fails == "call":
            raise Boom("at the call")
        write = start_response(scenario.status, headers)
        if scenario.body == "write":
            for chunk in scenario.chunks:
                write(chunk)
            return []
        if scenario.body == "list":
            return list(scenario.chunks)
        if scenario.body == "tuple":
            return tuple(scenario.chunks)
        return Body(scenario)


class Body:
    """A streamed body: its chunks one by one, raising where the scenario says; ``close()`` may raise too."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario

    def __iter__(self) -> Iterator[Any]:
        for index, chunk in enumerate(self.scenario.chunks):
            if self.scenario.fails == "body" and index == 1:
                raise Boom("in the body")
            yield chunk

    def close(self) -> None:
        if self.scenario.fails == "close":
            raise Boom("in close()")


_STATUSES = ["200 OK", "204 No Content", "304 Not Modified", "404 Not Found", "103 Early Hints", "500 \xe9t\xe9"]
_BAD_STATUSES = ["200 ", "200", "20 OK", "2000 OK", "200 OK\r\nX-Injected: 1", "200 \x01", b"200 OK", "\u0662\u0660\u0660 OK"]  # fmt: skip
_FIELDS = [
    ("Content-Type", "text/plain"),
    ("Content-Length", "5"),
    ("Content-Length", "0"),
    ("Content-Length", "100"),
    ("Content-Length", " 5 "),
    ("Connection", "close"),
    ("Connection", "keep-alive"),
    ("Transfer-Encoding", "chunked"),
    ("Keep-Alive", "timeout=5"),
    _APP_DATE,
    ("X-Tab", "a\tb"),
    ("X-Latin", "\xe9t\xe9"),
    ("X-Empty", ""),
]
_BAD_FIELDS = [
    ("Content-Length", "5x"),
    ("Bad Name", "v"),
    ("", "v"),
    ("X-Line", "a\r\nX-Injected: 1"),
    ("X-Wide", "\u20ac"),
    (b"X-Bytes", "v"),
    ("X-Three", "v", "w"),
]
_CHUNKS = [b"hello", b"", b"x" * 70_000, bytearray(b"array"), memoryview(b"view"), "text"]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    return Scenario(
        # Mostly what an app may send, so that the framing's decisions are reached; now and then a fault.
        status=draw(st.sampled_from(_STATUSES * 4 + _BAD_STATUSES)),
        headers=draw(st.lists(st.sampled_from(_FIELDS * 4 + _BAD_FIELDS), max_size=4)),
        chunks=draw(st.lists(st.sampled_from(_CHUNKS), max_size=4)),
        body=draw(st.sampled_from(["list", "tuple", "generator", "write"])),
        fails=draw(st.sampled_from([None, None, "call", "body", "close"])),
        reads=draw(st.none() | st.sampled_from(sorted(_READS))),
    )


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["GET", "HEAD", "POST"]))
    version = draw(st.sampled_from(["1.0", "1.1"]))
    lines = [f"{method} /app HTTP/{version}", "Host: x"]
    connection = draw(st.sampled_from([None, "keep-alive", "close"]))
    if connection is not None:
        lines.append(f"Connection: {connection}")
    body = b""
    if method == "POST":
        text = draw(st.sampled_from([b"abc", b"ab\ncd\n\nlonger line\n", b"no newline at the end", b""]))
        if draw(st.booleans()):
            lines.append(f"Content-Length: {len(text)}")
            body = text
        else:
            lines.append("Transfer-Encoding: chunked")
            body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in text.split(b"\n") if part) + b"0\r\n\r\n"
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def front_doors() -> Iterator[tuple[ScenarioApp, int, int]]:
    """The app and the ports of two front doors serving it: the compiled loop's, then the specification's."""
    from prazo.bindings.servers.frontdoor import runner

    app = ScenarioApp()
    with FrontDoors(threads=2, max_queue=8) as start:
        previous = runner.use_compiled_path(True)
        try:
            compiled = start(app)
            runner.use_compiled_path(False)
            python = start(app)
        finally:
            runner.use_compiled_path(previous)
        yield app, compiled.port, python.port


def _exchange(port: int, request: bytes) -> bytes:
    """``request`` and a second one pipelined behind it, the client's side shut; all the server sends, Date masked."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(request + _SECOND)
        sock.shutdown(socket.SHUT_WR)
        return _SERVER_DATE.sub(b"Date: (the server's)", read_to_eof(sock))


_GET_11 = b"GET /app HTTP/1.1\r\nHost: x\r\n\r\n"


def _streamed(*fields: tuple[str, str], fails: str | None = None) -> Scenario:
    return Scenario("200 OK", list(fields), [b"hello", b"x"], "generator", fails, None)


_LINES = b"ab\ncd\n\nlonger line\n"
_POST_LINES = b"POST /app HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(_LINES), _LINES)
_POST_LINES_CHUNKED = b"POST /app HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab\ncd\r\n10\r\n\n\nlonger line\n\r\n0\r\n\r\n"


def _reading(reads: str) -> Scenario:
    return Scenario("200 OK", [], [b"ok"], "list", None, reads)


# Each framing decision, and each way of reading the body, at least once, whatever Hypothesis draws besides.
@example(scenario=_streamed(("Content-Length", "100")), request=_GET_11)  # shorter than declared: closes
@example(scenario=_streamed(("Content-Length", "3")), request=_GET_11)  # longer: cut, closes
@example(scenario=_streamed(("Content-Length", "6")), request=_GET_11)  # exact: kept
@example(scenario=_streamed(), request=_GET_11)  # chunked
@example(scenario=_streamed(), request=b"GET /app HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")  # 1.0: closes
@example(scenario=_streamed(), request=b"HEAD /app HTTP/1.1\r\nHost: x\r\n\r\n")
@example(scenario=_streamed(fails="body"), request=_GET_11)  # after the head: the connection closes
@example(scenario=_streamed(fails="close"), request=_GET_11)
@example(scenario=Scenario("204 No Content", [], [b"body"], "list", None, None), request=_GET_11)
@example(scenario=Scenario("200 OK", [], ["text"], "list", None, None), request=_GET_11)  # a str body: 500
@example(
    scenario=Scenario("200 OK", [], [b"a", b"b"], "write", None, "all"),
    request=b"POST /app HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
)
@example(
    scenario=Scenario("200 OK", [], [b"left"], "list", None, None),
    request=b"POST /app HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
)
@example(scenario=_reading("line"), request=_POST_LINES)
@example(scenario=_reading("by-2"), request=_POST_LINES)
@example(scenario=_reading("lines-hint"), request=_POST_LINES)
@example(scenario=_reading("iterate"), request=_POST_LINES_CHUNKED)
@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios(), request=requests())
def test_both_loops_put_the_same_bytes_on_the_wire(
    front_doors: tuple[ScenarioApp, int, int], scenario: Scenario, request: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    app, compiled_port, python_port = front_doors
    app.scenario = scenario
    with caplog.at_level(logging.CRITICAL, logger="prazo.servers.frontdoor"):
        compiled = _exchange(compiled_port, request)
        python = _exchange(python_port, request)
    assert compiled == python
    assert compiled.startswith(b"HTTP/1.1 "), compiled[:200]


def test_the_loops_differ_in_nothing_but_their_path(front_doors: tuple[ScenarioApp, int, int]) -> None:
    """The comparison can fail: a pipelined request is answered on a kept connection, and not after a close."""
    app, compiled_port, _ = front_doors
    app.scenario = Scenario("200 OK", [("Content-Length", "2")], [b"hi"], "list", None, None)
    kept = _exchange(compiled_port, b"GET /app HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.count(b"HTTP/1.1 200 OK") == 2 and kept.endswith(b"ok")
    app.scenario = Scenario("200 OK", [("Connection", "close")], [b"hi"], "list", None, None)
    closed = _exchange(compiled_port, b"GET /app HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed.count(b"HTTP/1.1 200 OK") == 1 and closed.endswith(b"hi")
