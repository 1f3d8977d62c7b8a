"""The front door's C parsers agree with ``prazo.bindings.headers`` and ``proxy_headers``; no head makes it answer 500.

The budget cases are ``tests/bindings/test_headers.py``'s own, the ``X-Request-Start``
cases ``tests/servers/test_server_proxy_headers.py``'s, run against the C parsers;
Hypothesis then compares the two on arbitrary values (the Python modules stay
the one definition of the formats). Raw heads go to
the C head parser directly and, for a sample, to a live server.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest
import test_server_proxy_headers as stamp_cases
from _helpers import examples, import_test_module
from _server_harness import read_to_eof
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.headers import (
    BUDGET_HEADER,
    ENVOY_TIMEOUT_HEADER,
    GRPC_TIMEOUT_HEADER,
    BudgetPolicy,
    budget_from_headers,
    parse_budget_ms,
    parse_envoy_timeout_ms,
    parse_grpc_timeout,
)
from prazo.bindings.proxy_headers import (
    QUEUE_START_HEADER,
    REQUEST_START_HEADER,
    FrontProxyBudgetPolicy,
    parse_request_start_ns,
    trusted_networks,
    upstream_wait_ns,
)
from prazo.bindings.servers.frontdoor import compiled_engine, create_server

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

# The Python parsers' own cases (tests/bindings sits beside this folder).
cases = import_test_module("bindings", "test_headers")
engine = compiled_engine()
PAIRS = [
    (parse_budget_ms, engine.parse_budget_ms),
    (parse_grpc_timeout, engine.parse_grpc_timeout),
    (parse_envoy_timeout_ms, engine.parse_envoy_timeout_ms),
]
NAMES = (BUDGET_HEADER, GRPC_TIMEOUT_HEADER, ENVOY_TIMEOUT_HEADER)


def _wire(value: str) -> bytes | None:
    """``value`` as it can arrive on the wire (latin-1 bytes), or None when it cannot."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return None


@pytest.mark.parametrize(("python", "c"), PAIRS)
@pytest.mark.parametrize("value", cases.INVALID_EVERYWHERE)
def test_invalid_everywhere(python: Any, c: Any, value: str) -> None:
    wire = _wire(value)
    if wire is not None:
        assert c(wire) is None


def _param_values(test: Any) -> list[tuple[str, Any]]:
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == ("value", "expected"):
            return list(mark.args[1])
    raise AssertionError(f"no cases on {test.__name__}")


@pytest.mark.parametrize(
    ("case_test", "c"),
    [
        (cases.test_parse_budget_ms, engine.parse_budget_ms),
        (cases.test_parse_envoy_timeout_ms, engine.parse_envoy_timeout_ms),
        (cases.test_parse_grpc_timeout, engine.parse_grpc_timeout),
    ],
)
def test_the_header_cases_of_test_headers(case_test: Any, c: Any) -> None:
    for value, expected in _param_values(case_test):
        wire = _wire(value)
        if wire is None:
            continue
        got = c(wire)
        if expected is None:
            assert got is None, value
        else:
            assert got == pytest.approx(float(expected), rel=0, abs=0) or got == float(expected), value


@pytest.mark.parametrize(("values", "expected"), cases.INCOMING_CASES)
def test_incoming_cases(values: tuple[str | None, ...], expected: Any) -> None:
    headers = [(name.lower().encode(), value.encode()) for name, value in zip(NAMES, values) if value is not None]
    assert engine.incoming_budget(headers) == tuple(expected)


@given(st.text(max_size=50), st.sampled_from(range(3)))
@settings(max_examples=examples(500))
def test_each_parser_agrees_on_arbitrary_text(value: str, which: int) -> None:
    wire = _wire(value)
    if wire is None:
        return
    python, c = PAIRS[which]
    assert c(wire) == python(value)


NEAR_MISS = st.text(alphabet="0123456789.-+ \t,eHMSmunx", max_size=45)


@given(st.lists(st.tuples(st.sampled_from(range(3)), NEAR_MISS), max_size=4))
@settings(max_examples=examples(500))
def test_incoming_budget_agrees_with_budget_from_headers(fields: list[tuple[int, str]]) -> None:
    headers = [(NAMES[which], value) for which, value in fields]
    joined: dict[str, str] = {}
    for name, value in headers:
        # budget_from_headers takes a mapping: repeats arrive joined, as a server joins them.
        joined[name] = f"{joined[name]}, {value}" if name in joined else value
    expected = budget_from_headers(joined)
    got = engine.incoming_budget([(name.encode(), value.encode()) for name, value in headers])
    if expected.budget_ms is not None and any(len(v) > 40 for _, v in headers):
        return  # a repeat of a value over 40 characters: joined it is judged whole, element-wise it may pass
    assert got == tuple(expected), (headers, joined)


@given(st.lists(st.tuples(st.sampled_from(range(3)), NEAR_MISS), max_size=3), st.integers(0, 2**62))
@settings(max_examples=examples(300))
def test_deadline_agrees_with_the_policy(fields: list[tuple[int, str]], arrival_ns: int) -> None:
    joined: dict[str, str] = {}
    for which, value in fields:
        name = cases.environ_key(NAMES[which])
        joined[name] = f"{joined[name]},{value}" if name in joined else value
    headers = [(NAMES[which].encode(), value.encode()) for which, value in fields]
    policy = BudgetPolicy(default_budget_ms=1000, max_budget_ms=30000)
    deadline, _incoming = policy.deadline_for(joined, arrival_ns)
    # Joined with "," as a WSGI server (and the front door's environ) joins repeats: exact agreement.
    assert engine.deadline_ns_for(headers, arrival_ns, 1000.0, 30000.0) == deadline.ns


# ------------------------------------------------ X-Request-Start / X-Queue-Start


@pytest.mark.parametrize(
    "case_test",
    [
        stamp_cases.test_parse_request_start_table,
        stamp_cases.test_stamps_outside_2000_to_2100_are_rejected_in_every_unit,
    ],
)
def test_the_stamp_cases_of_test_server_proxy_headers(case_test: Any) -> None:
    for value, expected in _param_values(case_test):
        wire = _wire(value)
        if wire is not None:
            assert engine.parse_request_start_ns(wire) == expected, value


STAMPISH = st.text(alphabet="0123456789.t=T \t,-+e\xa0", max_size=44)
EPOCHISH = st.one_of(
    st.integers(0, 10**21).map(str),
    st.tuples(st.integers(0, 10**12), st.integers(0, 10**10)).map(lambda p: f"{p[0]}.{p[1]}"),
    st.integers(946_684_700, 4_102_444_900).map(lambda s: f"t={s}"),
    st.integers(946_684_700 * 10**9, 4_102_444_900 * 10**9).map(
        lambda ns: [str(ns), str(ns // 1000), str(ns // 10**6), f"t={ns // 10**9}.{ns % 10**9:09d}"][ns % 4]
    ),
)


@given(st.one_of(st.text(max_size=50), STAMPISH, EPOCHISH))
@settings(max_examples=examples(1500))
def test_the_stamp_parser_agrees_on_arbitrary_text(value: str) -> None:
    wire = _wire(value)
    if wire is None:
        return
    assert engine.parse_request_start_ns(wire) == parse_request_start_ns(value), value


@given(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**63 - 1))
def test_the_wait_agrees_with_upstream_wait_ns(stamp: int, arrival_wall: int, cap: int) -> None:
    expected = upstream_wait_ns(stamp, arrival_wall, cap)
    if abs(arrival_wall - stamp) < 2**63:
        assert engine.upstream_wait_ns(stamp, arrival_wall, cap) == expected
    else:  # outside int64: saturates, still within [0, cap]
        assert engine.upstream_wait_ns(stamp, arrival_wall, cap) == (cap if arrival_wall > stamp else 0)


STAMP_NAMES = (REQUEST_START_HEADER, QUEUE_START_HEADER, REQUEST_START_HEADER.lower(), "X-QUEUE-START", "X-Other")
_WALL_NS = 1_700_000_000 * 10**9


@given(
    st.lists(st.tuples(st.sampled_from(STAMP_NAMES), st.one_of(EPOCHISH, STAMPISH)), max_size=4),
    st.sampled_from([None, "1000", "250.5", "-3", "x"]),
    st.integers(0, 2**62),
    st.sampled_from([0.0, 1.0, 1500.0, 5000.0]),
)
@settings(max_examples=examples(500))
def test_the_corrected_deadline_agrees_with_front_proxy_budget_policy(
    fields: list[tuple[str, str]], budget: str | None, arrival_ns: int, cap_ms: float
) -> None:
    # The Python side sees repeats joined with "," (as the front door's environ and every WSGI server joins them).
    environ: dict[str, str] = {}
    for name, value in fields + ([(BUDGET_HEADER, budget)] if budget is not None else []):
        key = cases.environ_key(name)
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    headers = [(name.encode(), value.encode()) for name, value in fields]
    if budget is not None:
        headers.append((BUDGET_HEADER.encode(), budget.encode()))
    policy = FrontProxyBudgetPolicy(
        1000, 30000, max_upstream_ms=cap_ms, wall_clock_ns=lambda: _WALL_NS, monotonic_ns=lambda: arrival_ns
    )
    deadline, _incoming = policy.deadline_for(environ, arrival_ns)
    # The engine's pfd_upstream_ns, step by step: the earliest stamp, the wait up to the arrival on the wall clock.
    stamp = engine.request_start_ns(headers)
    wait = 0 if stamp is None else engine.upstream_wait_ns(stamp, _WALL_NS, int(cap_ms * 1_000_000))
    assert engine.deadline_ns_for(headers, arrival_ns, 1000.0, 30000.0, wait) == deadline.ns, (headers, environ)


ADDRESSES = st.one_of(
    st.ip_addresses(v=4),
    st.ip_addresses(v=6),
    st.ip_addresses(v=4).map(lambda a: ipaddress.IPv6Address(f"::ffff:{a}")),
    st.sampled_from(["127.0.0.1", "10.1.2.3", "::1", "::ffff:10.1.2.3", "fe80::1"]).map(ipaddress.ip_address),
)
NETWORKS = st.lists(
    st.one_of(
        st.tuples(st.ip_addresses(v=4), st.integers(0, 32)).map(lambda p: f"{p[0]}/{p[1]}"),
        st.tuples(st.ip_addresses(v=6), st.integers(0, 128)).map(lambda p: f"{p[0]}/{p[1]}"),
        st.sampled_from(["127.0.0.0/8", "10.0.0.0/8", "::1", "::ffff:0:0/96", "fe80::/10", "0.0.0.0/0"]),
    ),
    max_size=4,
)


@given(ADDRESSES, st.one_of(st.none(), NETWORKS))
@settings(max_examples=examples(500))
def test_the_trusted_peer_check_agrees_with_the_policy(address: Any, proxies: list[str] | None) -> None:
    policy = FrontProxyBudgetPolicy(trusted_proxies=proxies, wall_clock_ns=lambda: _WALL_NS, monotonic_ns=lambda: 0)
    environ = {"REMOTE_ADDR": str(address), "HTTP_X_REQUEST_START": f"t={_WALL_NS // 10**9 - 1}"}
    python_trusts = policy.upstream_queue_ns(environ, 0) > 0
    networks = engine.engine_networks(trusted_networks(proxies))
    assert engine.address_trusted(networks, address.packed) == python_trusts, (address, proxies)


@pytest.mark.parametrize(
    ("head", "verdict"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", "complete"),
        (b"GET / HTTP/1.1\r\nHost: a\r\n", "partial"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", "bad"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", "complete"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "bad"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n", "complete"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", "bad"),
    ],
)
def test_check_head(head: bytes, verdict: str) -> None:
    assert engine.check_head(head) == verdict


@given(st.binary(max_size=300))
@settings(max_examples=examples(2000))
def test_the_head_parser_takes_any_bytes(data: bytes) -> None:
    assert engine.check_head(data) in ("complete", "partial", "bad")


HEADISH = st.lists(
    st.sampled_from(
        [b"GET ", b"POST ", b"/", b"?a", b" HTTP/1.1", b" HTTP/1.0", b"\r\n", b"\n", b": ", b"Content-Length",
         b"Transfer-Encoding", b"chunked", b"5", b"-1", b"X-Request-Budget-Ms", b"grpc-timeout", b"1S", b" ", b"\t",
         b"\x00", b"\xff", b"Connection", b"close", b"abc"]
    ),
    max_size=30,
).map(b"".join)  # fmt: skip


def test_no_head_is_answered_500() -> None:
    def ok(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    server = create_server(ok, port=0, threads=2, max_queue=4, header_timeout_ms=300)
    server.start()
    seen: set[bytes] = set()
    try:

        @given(HEADISH)
        @settings(max_examples=examples(150), deadline=None)
        def feed(data: bytes) -> None:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(data + b"\r\n\r\n")
                sock.shutdown(socket.SHUT_WR)
                received = read_to_eof(sock)
            for line in received.split(b"\r\n"):
                if line.startswith(b"HTTP/1.1 "):
                    seen.add(line[9:12])
                    assert not line.startswith(b"HTTP/1.1 5") or line[9:12] in (b"503", b"504"), received

        feed()
    finally:
        server.shutdown(5.0)
    assert b"400" in seen
