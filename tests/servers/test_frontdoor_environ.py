"""The engine's environ builder and response fields (``_engine_c``) agree with their Python specs.

The front door's workers build each request's PEP 3333 environ in C from the
engine's parsed head; ``runner.head_environ_py`` is the readable
rule. For any head - methods, absolute-form and percent-encoded targets,
queries, header names with underscores, dashes, any case or bytes beyond
ASCII, repeated headers, latin-1 values - both give the same dict, keys in the
same order. Then the same through a live front door, where the head comes
straight from the engine's buffer.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from _helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.servers.frontdoor import compiled_engine, create_server
from prazo.bindings.servers.frontdoor.runner import head_environ_py
from prazo.bindings.servers.frontdoor.runner import response_fields_py as head_fields_py

# compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = pytest.mark.compiled


class _Head:
    def __init__(self, method: bytes, target: bytes, minor: int, headers: list[tuple[bytes, bytes]], peer: Any):
        self.method, self.target, self.minor_version, self.headers, self.peer = method, target, minor, headers, peer


_BYTE_TEXT = st.binary(max_size=12)
_PIECES = st.sampled_from(
    [b"/", b"%", b"%4", b"%41", b"%e9", b"%zz", b"?", b"//", b"http://", b"https://", b"a", b"\xe9"]
)
_TARGETS = st.one_of(_BYTE_TEXT, st.lists(_PIECES, max_size=8).map(b"".join))
_NAMES = st.one_of(
    st.sampled_from([b"Host", b"X-A", b"x-a", b"X_A", b"Content-Type", b"content-length", b"CONTENT-TYPE", b"X-\xdf"]),
    st.binary(min_size=1, max_size=10),
    st.binary(min_size=250, max_size=300),
)
_HEADERS = st.lists(st.tuples(_NAMES, _BYTE_TEXT), max_size=8)
_PEERS = st.one_of(st.none(), st.tuples(st.sampled_from(["127.0.0.1", "::1"]), st.integers(0, 65535)))


@settings(max_examples=examples(500), deadline=None)
@given(
    method=st.sampled_from([b"GET", b"HEAD", b"POST", b"M\xe9"]),
    target=_TARGETS,
    minor=st.integers(0, 9),
    headers=_HEADERS,
    peer=_PEERS,
    base=st.sampled_from([{}, {"wsgi.version": (1, 0), "HTTP_X_A": "base", "SERVER_NAME": "s"}]),
)
def test_the_compiled_environ_is_the_spec_s(
    method: bytes, target: bytes, minor: int, headers: list[tuple[bytes, bytes]], peer: Any, base: dict[str, Any]
) -> None:
    head = _Head(method, target, minor, headers, peer)
    built = compiled_engine().head_environ(dict(base), head)
    assert list(built.items()) == list(head_environ_py(dict(base), head).items())


def test_a_live_request_s_environ_is_the_spec_s() -> None:
    seen: list[dict[str, Any]] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append(environ)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server = create_server(app, host="127.0.0.1", port=0, threads=1)
    server.start()
    try:
        head = (
            b"GET http://example.com/a%2Fb%zz/%e9?q=%41&r HTTP/1.1\r\nHost: x\r\nX-Dup: 1\r\nx-dup: 2\r\n"
            b"X_Sneaky: 3\r\nContent-Type: text/plain\r\nX-Latin: \xe9\xff\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            for _ in range(2):  # the second rides the same connection, from a buffer the first one left
                client.sendall(head)
                answer = b""
                while not answer.endswith(b"ok"):
                    chunk = client.recv(4096)
                    assert chunk
                    answer += chunk
    finally:
        server.shutdown()
    assert len(seen) == 2
    for environ in seen:
        assert environ["PATH_INFO"] == "/a/b%zz/\xe9"
        assert environ["QUERY_STRING"] == "q=%41&r"
        assert environ["REQUEST_URI"] == environ["RAW_URI"] == "http://example.com/a%2Fb%zz/%e9?q=%41&r"
        assert environ["HTTP_X_DUP"] == "1,2" and environ["HTTP_X_LATIN"] == "\xe9\xff"
        assert environ["CONTENT_TYPE"] == "text/plain" and "HTTP_X_SNEAKY" not in environ
        assert environ["REMOTE_ADDR"] == "127.0.0.1" and environ["REMOTE_PORT"].isdigit()
        assert environ["SERVER_PROTOCOL"] == "HTTP/1.1" and environ["REQUEST_METHOD"] == "GET"


_FIELD_NAMES = st.sampled_from(
    [
        "Content-Length",
        "content-length",
        "Date",
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "X-A",
        "Upgrade",
    ]
)
_FIELD_VALUES = st.one_of(
    st.sampled_from(["13", " 7 ", "close", "Keep-Alive, Close", "x", "", "\u0661", "1 2"]), st.text(max_size=6)
)


@settings(max_examples=examples(500), deadline=None)
@given(
    status=st.sampled_from(["200 OK", "204 No Content", "304 Not Modified", "500 \xe9"]),
    headers=st.lists(st.tuples(_FIELD_NAMES, _FIELD_VALUES), max_size=6),
)
def test_the_compiled_response_fields_are_the_spec_s(status: str, headers: list[tuple[str, str]]) -> None:
    """The app's part of a response head: the same text, Content-Length and close, or the same ValueError."""
    engine = compiled_engine()

    def outcome(fields: Any) -> object:
        try:
            return fields(status, list(headers))
        except ValueError as exc:
            return ("ValueError", str(exc))

    # The server's Date line is the second's: the compiled call, between two calls of the
    # spec, gives the text of one of them (the same unless a second began in between).
    before = outcome(head_fields_py)
    built = outcome(engine.response_fields)
    assert built in (before, outcome(head_fields_py))


def test_remote_addr_is_the_client_s_dotted_quad() -> None:
    """The engine formats an IPv4 peer itself (not with inet_ntop): one-, two- and three-digit parts."""
    seen: list[tuple[str, str]] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append((environ["REMOTE_ADDR"], environ["REMOTE_PORT"]))
        start_response("200 OK", [("Content-Length", "0")])
        return [b""]

    server = create_server(app, host="127.0.0.1", port=0, threads=1)
    server.start()
    try:
        for source in ["127.0.0.1", "127.10.200.3", "127.0.100.255", "127.99.9.10"]:
            with socket.socket() as client:
                client.bind((source, 0))
                client.connect(("127.0.0.1", server.port))
                client.sendall(b"GET / HTTP/1.0\r\n\r\n")
                while client.recv(4096):
                    pass
                host, port = client.getsockname()
            assert seen[-1] == (host, str(port))
    finally:
        server.shutdown()
