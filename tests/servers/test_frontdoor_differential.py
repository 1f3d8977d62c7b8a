"""The front door's framing against a reference parser, h11: where each request ends, and accept/reject.

Hypothesis builds connections' bytes from parts (request lines, Host, CL/TE
variants, chunked bodies with extensions and trailers, line endings,
pipelining, a cut at any point). The C side is the engine's own path
(``split_requests``: the head verdict, the worker's body read, the put-back of
what follows a body); h11 answers each request and starts the next cycle, as a
server would. Both must find the same requests (method, target, decoded body)
ending at the same offsets and agree on accept/reject, except where a part
carries one of the ``DIFFERENCES`` below: those are deliberate (see the
the strictness list of docs/how-to/server-front-door.md), each with its reason, and from the first request
that has one only the front door's documented side is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prazo.bindings.servers.frontdoor import compiled_engine
from prazo.bindings.servers.plumbing.heads import MAX_HEAD_BYTES

engine = compiled_engine()

# The front door refuses these (400, or a broken body); h11 takes them.
STRICTER = {
    "bare-lf": "a line ended by LF alone: parsers disagree on where such lines end, so RFC 9112's CRLF is required",
    "version": "HTTP/1.2-1.9 (h11 reads any HTTP/d.d): only 1.0 and 1.1 are spoken here",
    "connect-trace": "CONNECT is a tunnel and TRACE echoes credentials back; a WSGI app can do neither safely",
    "target-form": "a target that is neither origin-form, absolute-form nor '*' for OPTIONS (RFC 9112 section 3.2)",
    "host-value": "a Host that is no host[:port] (userinfo, path, spaces): RFC 9112 section 3.2 says 400",
    "cl-list": "Content-Length: 3, 3: the list form is refused, not merged (repeated identical lines are taken)",
    "cl-te": "Content-Length with Transfer-Encoding: h11 lets chunked win, the front door refuses the ambiguity",
    "te-http10": "Transfer-Encoding in HTTP/1.0, which has no chunked coding: h11 reads it chunked",
    "obs-fold": "obsolete line folding: h11 unfolds it, the front door never guesses",
    "ows-after-size": "whitespace after a chunk size with no extension: not in RFC 9112's grammar",
    "ext-junk": "bytes in a chunk extension outside its grammar (h11 skips anything after ';')",
    "trailer-bare-lf": "a trailer line, or the end of the trailers, ended by LF alone",
    "chunk-size-overflow": "a chunk size beyond 64 bits: h11 takes 20 hex digits and waits for 2**68 bytes",
}
# The front door takes these; h11 refuses them or closes.
LENIENT = {
    "leading-crlf": "one empty line before a request line is skipped, as RFC 9112 section 2.2 says servers should",
    "bws-before-ext": "BWS before ';' in a chunk extension is in RFC 9112's grammar; h11 refuses it",
    "http10-keep-alive": "HTTP/1.0 with Connection: keep-alive stays open; h11 closes every HTTP/1.0 connection",
}
DIFFERENCES = {**STRICTER, **LENIENT}

HOST = b"Host: a.example\r\n"
TE = b"Transfer-Encoding: chunked\r\n"


@dataclass
class Part:
    """One request's bytes and the documented differences it carries."""

    data: bytes
    tags: set[str] = field(default_factory=set)


@st.composite
def chunked_bodies(draw: st.DrawFn) -> Part:
    tags: set[str] = set()
    out = b""
    for data in [*draw(st.lists(st.binary(min_size=1, max_size=12), max_size=3)), b""]:
        size = f"{len(data):x}".encode()
        size = draw(st.sampled_from([size, size.upper(), b"00" + size]))
        ext = draw(st.sampled_from([b"", b"", b";a", b";a=b", b';a="q\\"x"', b";a;b=c", b" ;a", b";a b", b" "]))
        if ext == b" ;a":
            tags.add("bws-before-ext")
        elif ext == b";a b":
            tags.add("ext-junk")
        elif ext == b" ":
            tags.add("ows-after-size")
        eol = draw(st.sampled_from([b"\r\n"] * 6 + [b"\n"]))  # a bare LF here: both refuse it
        out += size + ext + eol + data
        if data:
            out += draw(st.sampled_from([b"\r\n"] * 6 + [b"\n", b""]))
    previous = None
    for trailer in draw(st.lists(st.sampled_from([b"X-T: 1", b"Y:", b"GET /x HTTP/1.1", b" folded"]), max_size=2)):
        if trailer == b" folded" and previous in (b"X-T: 1", b"Y:"):
            tags.add("obs-fold")  # h11 unfolds it into the field before, as in a head
        previous = trailer
        eol = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n"]))
        if eol == b"\n":
            tags.add("trailer-bare-lf")
        out += trailer + eol
    end = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n"]))
    if end == b"\n":
        tags.add("trailer-bare-lf")
    return Part(out + end, tags)


@st.composite
def requests(draw: st.DrawFn) -> Part:
    tags: set[str] = set()
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"OPTIONS", b"CONNECT", b"TRACE"]))
    if method in (b"CONNECT", b"TRACE"):
        tags.add("connect-trace")
    target = draw(st.sampled_from([b"/", b"/a?b=c", b"/%41", b"http://h.example/x", b"*", b"a/b"]))
    if target == b"a/b" or (target == b"*" and method != b"OPTIONS"):
        tags.add("target-form")
    version = draw(st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0", b"HTTP/1.2"]))
    if version == b"HTTP/1.2":
        tags.add("version")
    head = [method + b" " + target + b" " + version + b"\r\n"]
    hosts = draw(st.sampled_from([1, 1, 1, 0, 2]))
    for _ in range(hosts):
        value = draw(st.sampled_from([b"a.example", b"a.example:8080", b"[::1]", b"u@a"]))
        if value == b"u@a" and hosts == 1:
            tags.add("host-value")
        head.append(b"Host: " + value + b"\r\n")
    framing = draw(st.sampled_from(["none", "cl", "cl", "cl-twice", "cl-diff", "cl-list", "te", "te", "cl-te"]))
    body = b""
    if framing.startswith("cl"):
        body = draw(st.binary(max_size=12))
        n = str(len(body)).encode()
        head.append(
            {
                "cl": b"Content-Length: " + n + b"\r\n",
                "cl-twice": b"Content-Length: " + n + b"\r\nContent-Length: " + n + b"\r\n",
                "cl-diff": b"Content-Length: " + n + b"\r\nContent-Length: 99\r\n",
                "cl-list": b"Content-Length: " + n + b", " + n + b"\r\n",
                "cl-te": b"Content-Length: " + n + b"\r\n" + TE,
            }[framing]
        )
        if framing == "cl-list":
            tags.add("cl-list")
        if framing == "cl-te":
            tags.add("cl-te")
            chunked = draw(chunked_bodies())
            body = chunked.data
    elif framing == "te":
        head.append(TE)
        chunked = draw(chunked_bodies())
        body, tags = chunked.data, tags | chunked.tags
        if version == b"HTTP/1.0":
            tags.add("te-http10")
    connection = draw(st.sampled_from([None, None, b"close", b"keep-alive"]))
    if connection is not None:
        head.append(b"Connection: " + connection + b"\r\n")
        if connection == b"keep-alive" and version == b"HTTP/1.0":
            tags.add("http10-keep-alive")
    if draw(st.booleans()):
        head.append(
            draw(st.sampled_from([b"X-A: 1\r\n", b"X-B: a b\t\r\n", b"X-C: \xe9\r\n", b"X-D: 1\r\n  folded\r\n"]))
        )
        if head[-1].endswith(b"folded\r\n"):
            tags.add("obs-fold")
    if draw(st.integers(0, 9)) == 0:
        head = [line[:-2] + b"\n" for line in head]
        tags.add("bare-lf")
    end = b"\r\n"
    data = b"".join(head) + end + body
    if draw(st.integers(0, 9)) == 0:
        data = b"\r\n" + data
        tags.add("leading-crlf")
    return Part(data, tags)


def h11_frame(data: bytes) -> tuple[list[tuple[int, bytes, bytes, bytes]], str]:
    """h11's reading of ``data``: ``(end, method, target, body)`` per request, and how it stops.

    "end" (the bytes ended with a request), "closed" (a request closed the
    connection), "partial", "error", or "tunnel" (after a CONNECT).
    """
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    if data:  # b"" would tell h11 the client closed
        conn.receive_data(data)
    found: list[tuple[int, bytes, bytes, bytes]] = []
    request: h11.Request | None = None
    body = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return found, "error"
        if event is h11.NEED_DATA:
            idle = conn.their_state is h11.IDLE and not conn.trailing_data[0]
            return found, "end" if idle else "partial"
        if event is h11.PAUSED:
            return found, "closed" if conn.their_state is h11.MUST_CLOSE else "error"
        if isinstance(event, h11.Request):
            request, body = event, b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            found.append((len(data) - len(conn.trailing_data[0]), request.method, request.target, body))
            if request.method == b"CONNECT":
                return found, "tunnel"  # what follows is no longer HTTP
            conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE:
                return found, "closed"
            conn.start_next_cycle()


def front_door_frame(data: bytes) -> tuple[list[tuple[int, bytes, bytes, bytes]], str]:
    found, outcome = engine.split_requests(data, MAX_HEAD_BYTES)
    refused = outcome in ("bad", "bad-body", "too-large")
    return [request[:4] for request in found], "error" if refused else outcome


@given(st.lists(requests(), min_size=1, max_size=3), st.integers(0, 100), st.booleans())
@example(  # a folded trailer line: found by the search, once; h11 unfolds it, the front door refuses the body
    [Part(b"POST / HTTP/1.1\r\nHost: a.example\r\n" + TE + b"\r\n0\r\nX-T: 1\r\n folded\r\n\r\n", {"obs-fold"})],
    100,
    False,
)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_front_door_frames_requests_as_h11_does(parts: list[Part], cut_percent: int, cut: bool) -> None:
    data = b"".join(part.data for part in parts)
    if cut:
        data = data[: len(data) * cut_percent // 100]
    ours, our_outcome = front_door_frame(data)
    theirs, their_outcome = h11_frame(data)
    # Requests up to the first one with a documented difference must agree exactly.
    tagged = next((i for i, part in enumerate(parts) if part.tags), len(parts))
    assert ours[:tagged] == theirs[:tagged], (data, ours, theirs)
    start = sum(len(part.data) for part in parts[:tagged])
    if tagged < len(parts) and start < len(data):
        tags = parts[tagged].tags
        assert tags <= set(DIFFERENCES), tags
        # Did h11 reach that request (no earlier close or refusal)?
        reached = len(theirs) > tagged or (len(theirs) == tagged and their_outcome not in ("closed", "end"))
        if tags & set(STRICTER) and not tags & set(LENIENT) and reached:
            # The front door's side of it: refused (or still waiting, when the cut fell inside the request).
            assert len(ours) == tagged and our_outcome in ("error", "partial"), (data, ours, our_outcome)
        return
    if cut and our_outcome != their_outcome:
        # A cut head with a bad byte in it: the front door refuses at once, h11 waits for the whole line.
        assert {our_outcome, their_outcome} == {"error", "partial"}, (data, our_outcome, their_outcome)
        return
    assert our_outcome == their_outcome, (data, ours, our_outcome, theirs, their_outcome)


# Each documented difference, once, as a plain example: which side takes what.
EXAMPLES = {
    "bare-lf": b"GET / HTTP/1.1\nHost: a\n\n",
    "version": b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
    "connect-trace": b"TRACE / HTTP/1.1\r\nHost: a\r\n\r\n",
    "target-form": b"GET a/b HTTP/1.1\r\nHost: a\r\n\r\n",
    "host-value": b"GET / HTTP/1.1\r\nHost: u@a\r\n\r\n",
    "cl-list": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1, 1\r\n\r\nx",
    "cl-te": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n" + TE + b"\r\n0\r\n\r\n",
    "te-http10": b"POST / HTTP/1.0\r\n" + TE + b"\r\n0\r\n\r\n",
    "obs-fold": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n folded\r\n\r\n",
    "ows-after-size": b"POST / HTTP/1.1\r\nHost: a\r\n" + TE + b"\r\n1 \r\nx\r\n0\r\n\r\n",
    "ext-junk": b"POST / HTTP/1.1\r\nHost: a\r\n" + TE + b"\r\n1;a b\r\nx\r\n0\r\n\r\n",
    "trailer-bare-lf": b"POST / HTTP/1.1\r\nHost: a\r\n" + TE + b"\r\n1\r\nx\r\n0\r\nX-T: 1\n\r\n",
    "chunk-size-overflow": b"POST / HTTP/1.1\r\nHost: a\r\n" + TE + b"\r\nffffffffffffffff1\r\n",
    "leading-crlf": b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    "bws-before-ext": b"POST / HTTP/1.1\r\nHost: a\r\n" + TE + b"\r\n1 ;a\r\nx\r\n0\r\n\r\n",
    "http10-keep-alive": b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n",
}


def test_every_difference_has_an_example() -> None:
    assert set(EXAMPLES) == set(DIFFERENCES)


@pytest.mark.parametrize("tag", sorted(STRICTER))
def test_the_front_door_refuses_what_h11_takes(tag: str) -> None:
    ours, our_outcome = front_door_frame(EXAMPLES[tag])
    theirs, their_outcome = h11_frame(EXAMPLES[tag])
    assert (ours, our_outcome) == ([], "error"), DIFFERENCES[tag]
    assert their_outcome != "error", (theirs, their_outcome)


@pytest.mark.parametrize("tag", sorted(LENIENT))
def test_the_front_door_takes_what_h11_refuses_or_closes(tag: str) -> None:
    ours, our_outcome = front_door_frame(EXAMPLES[tag])
    theirs, their_outcome = h11_frame(EXAMPLES[tag])
    assert our_outcome in ("end", "closed") and len(ours) > len(theirs), (ours, our_outcome, DIFFERENCES[tag])
    assert their_outcome in ("error", "closed"), (theirs, their_outcome)


@pytest.mark.parametrize(
    "data",
    [
        b"POST / HTTP/1.1\r\nHost: a\r\n" + TE + b"\r\n5\r\nhello\r\n0\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",
        b"GET /\xe9 HTTP/1.1\r\nHost: a\r\n\r\n",
    ],
    ids=["request-line-as-trailer", "differing-cl", "two-hosts", "no-host", "non-ascii-target"],
)
def test_both_refuse(data: bytes) -> None:
    ours, our_outcome = front_door_frame(data)
    theirs, their_outcome = h11_frame(data)
    assert their_outcome == "error", (theirs, their_outcome)
    assert our_outcome == "error" and not ours, (ours, our_outcome)
