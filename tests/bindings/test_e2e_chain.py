"""End to end on real loopback servers: client → A → B → C, each hop a werkzeug
threaded server behind ``AdmissionMiddleware`` that forwards through
``DeadlineSession``.

The budget must shrink as it travels (by each hop's own time and margin), a
hop with nothing left must not call at all, a 503 deep in the chain must stay
a 503, and the checker used here must catch a hop that forwards a fixed
timeout instead of the budget.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from prazo.bindings.clients.requests import DeadlineSession
from prazo.bindings.headers import BUDGET_ENVIRON_KEY, BUDGET_HEADER, REASON_HEADER_NAME, parse_budget_ms
from prazo.bindings.wsgi import AdmissionMiddleware
from prazo.core import NS_PER_MS, REASON_NO_BUDGET_FOR_DOWNSTREAM
from werkzeug.serving import WSGIRequestHandler, make_server

MARGIN_MS = 20
# serve_forever looks for a shutdown request every poll_interval (0.5 s by default):
# a shorter one lets shutdown() return at once instead of waiting out the poll.
_POLL = {"poll_interval": 0.05}
# Generous: the machine may be loaded, and nothing here asserts on speed.
CLIENT_TIMEOUT_S = 10


@dataclass
class HopRecord:
    """What one hop saw: the budget it received and how long it took before calling on."""

    name: str
    received_budget_ms: list[float | None] = field(default_factory=list)
    local_ms: list[float] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.received_budget_ms)


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        """Tests read records, not access logs."""


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[..., Iterable[bytes]]], str]]:
    servers = []

    def start(app: Callable[..., Iterable[bytes]]) -> str:
        server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs=_POLL, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_port}/"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _record_arrival(record: HopRecord, environ: dict[str, Any]) -> int:
    raw = environ.get(BUDGET_ENVIRON_KEY)
    record.received_budget_ms.append(None if raw is None else parse_budget_ms(raw))
    return time.monotonic_ns()


def forwarding_hop(record: HopRecord, next_url: str, work_ms: float) -> Callable[..., Iterable[bytes]]:
    """A correct hop: local work, then the next call with what is left."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        arrived = _record_arrival(record, environ)
        time.sleep(work_ms / 1000)
        record.local_ms.append((time.monotonic_ns() - arrived) / NS_PER_MS)
        with DeadlineSession(margin_ms=MARGIN_MS) as session:
            response = session.get(next_url)
        start_response(f"{response.status_code} {response.reason}", [("Content-Type", "text/plain")])
        return [response.content]

    return AdmissionMiddleware(app, max_concurrency=8, max_queue=8)


def broken_hop(record: HopRecord, next_url: str, work_ms: float) -> Callable[..., Iterable[bytes]]:
    """The seed's mistake: a fixed 5 s timeout forwarded instead of the remaining budget."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        arrived = _record_arrival(record, environ)
        time.sleep(work_ms / 1000)
        record.local_ms.append((time.monotonic_ns() - arrived) / NS_PER_MS)
        response = requests.get(next_url, headers={BUDGET_HEADER: "5000"}, timeout=5)
        start_response(f"{response.status_code} {response.reason}", [("Content-Type", "text/plain")])
        return [response.content]

    return AdmissionMiddleware(app, max_concurrency=8, max_queue=8)


def leaf(record: HopRecord, status: int = 200) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        _record_arrival(record, environ)
        start_response(f"{status} Leaf", [("Content-Type", "text/plain")])
        return [b"leaf"]

    return AdmissionMiddleware(app, max_concurrency=8, max_queue=8)


def budget_violations(client_budget_ms: float, hops: list[HopRecord]) -> list[str]:
    """Every hop must receive at most what its caller had, minus the caller's own time and margin."""
    violations = []
    allowed = client_budget_ms
    for caller, callee in itertools.pairwise(hops):
        if not callee.calls:
            continue
        received = callee.received_budget_ms[0]
        allowed = allowed - caller.local_ms[0] - MARGIN_MS
        if received is None or received > allowed:
            violations.append(f"{callee.name} received {received} ms, more than the {allowed:.1f} ms left")
        else:
            allowed = received
    return violations


def _chain(
    serve: Callable[..., str], make_middle: Callable[..., Any], leaf_status: int = 200
) -> tuple[str, list[HopRecord]]:
    a, b, c = HopRecord("A"), HopRecord("B"), HopRecord("C")
    c_url = serve(leaf(c, leaf_status))
    b_url = serve(make_middle(b, c_url, work_ms=50))
    a_url = serve(forwarding_hop(a, b_url, work_ms=50))
    return a_url, [a, b, c]


def test_the_budget_shrinks_by_each_hops_time_and_margin(serve: Callable[..., str]) -> None:
    a_url, hops = _chain(serve, forwarding_hop)
    response = requests.get(a_url, headers={BUDGET_HEADER: "2000"}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200
    a, b, c = hops
    assert a.received_budget_ms == [2000.0]
    assert (b.calls, c.calls) == (1, 1)
    assert budget_violations(2000, hops) == []
    c_budget = c.received_budget_ms[0]
    assert c_budget is not None
    # C gets no more than the client's budget minus A's and B's own time and margins...
    assert c_budget <= 2000 - a.local_ms[0] - b.local_ms[0] - 2 * MARGIN_MS
    # ...and the chain does not lose time it did not spend (generous: a loaded box).
    assert c_budget >= 2000 - 2 * MARGIN_MS - 1500


def test_a_hop_with_no_budget_left_does_not_call_and_the_client_gets_504(serve: Callable[..., str]) -> None:
    a, b = HopRecord("A"), HopRecord("B")
    b_url = serve(leaf(b))
    # A works 100 ms on a 60 ms budget: nothing is left for B.
    a_url = serve(forwarding_hop(a, b_url, work_ms=100))
    response = requests.get(a_url, headers={BUDGET_HEADER: "60"}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 504
    assert response.headers[REASON_HEADER_NAME] == REASON_NO_BUDGET_FOR_DOWNSTREAM
    assert a.calls == 1
    assert b.calls == 0, "B must receive no request at all"


def test_a_503_at_the_end_of_the_chain_reaches_the_client_as_503(serve: Callable[..., str]) -> None:
    a_url, hops = _chain(serve, forwarding_hop, leaf_status=503)
    response = requests.get(a_url, headers={BUDGET_HEADER: "2000"}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 503, "overloaded stays overloaded; it must not become a 504"
    assert [hop.calls for hop in hops] == [1, 1, 1]


def test_a_hop_forwarding_a_fixed_timeout_is_caught(serve: Callable[..., str]) -> None:
    a_url, hops = _chain(serve, broken_hop)
    response = requests.get(a_url, headers={BUDGET_HEADER: "2000"}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200
    violations = budget_violations(2000, hops)
    assert len(violations) == 1
    assert violations[0].startswith("C received 5000")
