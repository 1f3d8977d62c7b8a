"""HTTP → gRPC → HTTP on real loopback servers: the budget shrinks at every hop.

A: prazo's werkzeug server embedding (``prazo serve --server werkzeug``); its app calls B
   through a channel with ``DeadlineClientInterceptor``.
B: a grpcio server from ``admission_server`` (``AdmissionPool`` executor); its
   handler calls C with prazo's ``requests`` or ``urllib`` binding.
C: prazo's werkzeug server embedding too.

Each hop records the budget it was given when it started. The budget must
strictly decrease, each hop seeing no more than the previous one had minus
the margin; no budget left stops the chain before C with a 504 at A, and a 503 at C
stays a 503 at A.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import requests
from prazo.bindings.clients.requests import DeadlineSession
from prazo.bindings.clients.urllib import deadline_urlopen
from prazo.bindings.headers import BUDGET_ENVIRON_KEY, BUDGET_HEADER, REASON_HEADER_NAME
from prazo.bindings.integrations.grpc.client import DeadlineClientInterceptor
from prazo.bindings.integrations.grpc.server import admission_server
from prazo.bindings.pool import AdmissionPool
from prazo.bindings.servers.werkzeug import make_server
from prazo.core import REASON_NO_BUDGET_FOR_DOWNSTREAM, current_deadline

MARGIN_MS = 20
# serve_forever looks for a shutdown request every poll_interval (0.5 s by default):
# a shorter one lets shutdown() return at once instead of waiting out the poll.
_POLL = {"poll_interval": 0.05}
CLIENT_TIMEOUT_S = 20
METHOD = "/prazo.test.Chain/Forward"


@dataclass
class Hops:
    """Budgets (ms) each hop had when it started, and what C was sent in its header."""

    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)
    c: list[float] = field(default_factory=list)
    c_header: list[float] = field(default_factory=list)


@pytest.fixture
def http_server() -> Iterator[Callable[[Callable[..., Iterable[bytes]]], str]]:
    """Start prazo's werkzeug server embedding (admission at the server's own queue) on ``app``."""
    servers = []

    def start(app: Callable[..., Iterable[bytes]]) -> str:
        server = make_server("127.0.0.1", 0, app, threads=4, max_queue=4, default_budget_ms=5000)
        server.shutdown_timeout = 10.0
        thread = threading.Thread(target=server.serve_forever, kwargs=_POLL, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server, thread in servers:
        server.shutdown()
        thread.join(timeout=10)


def _c_app(hops: Hops, status: str) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        hops.c.append(environ["prazo.deadline"].remaining_ms())
        hops.c_header.append(float(environ.get(BUDGET_ENVIRON_KEY, "nan")))
        start_response(status, [("Content-Type", "text/plain")])
        return [b"from C"]

    return app


@pytest.fixture
def grpc_hop() -> Iterator[Callable[[Hops, str, str], str]]:
    started = []

    def start(hops: Hops, c_url: str, client: str) -> str:
        session = DeadlineSession(margin_ms=MARGIN_MS)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            deadline = current_deadline()
            assert deadline is not None
            hops.b.append(deadline.remaining_ms())
            if client == "requests":
                return b"B+" + session.get(c_url, timeout=CLIENT_TIMEOUT_S).content
            with deadline_urlopen(c_url, margin_ms=MARGIN_MS, timeout=CLIENT_TIMEOUT_S) as response:
                return b"B+" + bytes(response.read())

        pool = AdmissionPool(max_workers=4, max_queue=4)
        server = admission_server(pool)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "prazo.test.Chain", {"Forward": grpc.unary_unary_rpc_method_handler(forward)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, pool, session))
        return f"127.0.0.1:{port}"

    yield start
    for server, pool, session in started:
        server.stop(None).wait(10)
        pool.shutdown()
        session.close()


def _a_app(hops: Hops, target: str) -> tuple[Callable[..., Iterable[bytes]], grpc.Channel]:
    channel = grpc.intercept_channel(grpc.insecure_channel(target), DeadlineClientInterceptor(margin_ms=MARGIN_MS))
    forward = channel.unary_unary(METHOD)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        hops.a.append(environ["prazo.deadline"].remaining_ms())
        body = forward(b"from A", timeout=CLIENT_TIMEOUT_S)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"A+" + body]

    return app, channel


def _chain(
    http_server: Callable[[Callable[..., Iterable[bytes]]], str],
    grpc_hop: Callable[[Hops, str, str], str],
    client: str,
    c_status: str = "200 OK",
) -> tuple[Hops, str]:
    hops = Hops()
    c_url = http_server(_c_app(hops, c_status))
    target = grpc_hop(hops, c_url, client)
    app, _channel = _a_app(hops, target)
    return hops, http_server(app)


@pytest.mark.parametrize("client", ["requests", "urllib"])
def test_budget_shrinks_at_every_hop(http_server: Any, grpc_hop: Any, client: str) -> None:
    hops, a_url = _chain(http_server, grpc_hop, client)
    for _ in range(3):
        response = requests.get(a_url, headers={BUDGET_HEADER: "2000"}, timeout=CLIENT_TIMEOUT_S)
        assert response.status_code == 200
        assert response.content == b"A+B+from C"
    assert len(hops.a) == len(hops.b) == len(hops.c) == 3
    for a, b, c, c_header in zip(hops.a, hops.b, hops.c, hops.c_header):
        assert 0 < c < b < a <= 2000
        # Each hop passes on at most what it had minus its margin.
        assert b <= a - MARGIN_MS
        assert c <= c_header <= b - MARGIN_MS


@pytest.mark.parametrize("client", ["requests", "urllib"])
def test_no_budget_left_stops_before_c_with_504(http_server: Any, grpc_hop: Any, client: str) -> None:
    hops, a_url = _chain(http_server, grpc_hop, client)
    # A passes on less than 40 - 20 ms; B, keeping 20 ms for itself, has
    # nothing left for C (or A has nothing left for B): C is never called.
    response = requests.get(a_url, headers={BUDGET_HEADER: "40"}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 504
    assert hops.c == []
    if hops.b:
        assert response.headers[REASON_HEADER_NAME] in ("deadline-exceeded", REASON_NO_BUDGET_FOR_DOWNSTREAM)


@pytest.mark.parametrize("client", ["requests", "urllib"])
def test_503_at_c_stays_503_at_a(http_server: Any, grpc_hop: Any, client: str) -> None:
    hops, a_url = _chain(http_server, grpc_hop, client, c_status="503 Service Unavailable")
    response = requests.get(a_url, headers={BUDGET_HEADER: "2000"}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 503
    assert len(hops.c) == 1
