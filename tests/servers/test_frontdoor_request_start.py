"""The front door's C thread takes a trusted proxy's queue time (``X-Request-Start``) off the deadline.

Real loopback sockets. Linux routes all of 127.0.0.0/8 to loopback, so a
client bound to 127.0.0.3 is a peer that is not the trusted proxy (127.0.0.1).
The stamps are seconds in the past on the wall clock; assertions on the
remaining budget leave a second or more of margin for a loaded machine.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import wait_until
from _server_harness import CLIENT_TIMEOUT_S
from prazo.bindings.servers.frontdoor import FrontDoorServer, create_server
from prazo.bindings.servers.settings import resolve_settings

# slow: real time; compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = [pytest.mark.slow, pytest.mark.compiled]

PROXY = "127.0.0.1"
OTHER_PEER = "127.0.0.3"
BUDGET = "X-Request-Budget-Ms"


class App:
    """Says the budget it was given; ``/hold`` blocks until ``release`` is set. Counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.holding = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self._lock:
            self.calls += 1
        if environ["PATH_INFO"] == "/hold":
            self.holding.set()
            self.release.wait(CLIENT_TIMEOUT_S)
        body = f"{environ['prazo.deadline'].remaining_ms():.0f}".encode()
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]


@pytest.fixture
def served() -> Iterator[Any]:
    servers: list[tuple[FrontDoorServer, App]] = []

    def start(threads: int = 2, max_queue: int = 8, **front_proxy: Any) -> tuple[FrontDoorServer, App]:
        front_proxy.setdefault("trust_request_start", True)
        front_proxy.setdefault("trusted_proxies", [PROXY])
        settings = resolve_settings(threads=threads, max_queue=max_queue, environ={}, **front_proxy)
        app = App()
        server = create_server(app, port=0, settings=settings)
        server.start()
        servers.append((server, app))
        return server, app

    yield start
    for server, app in servers:
        app.release.set()
        server.shutdown(5.0)


def call(port: int, headers: dict[str, str], *, source: str = PROXY, path: str = "/") -> tuple[int, str, str | None]:
    """(status, body, X-Prazo-Reason) of one request from ``source`` on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S, source_address=(source, 0))
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode(), response.getheader("X-Prazo-Reason")
    finally:
        conn.close()


def hold_the_only_worker(server: FrontDoorServer, app: App) -> threading.Thread:
    """A request that keeps the server's one worker busy until ``app.release`` is set (join the thread after)."""
    holder = threading.Thread(target=call, args=(server.port, {BUDGET: "30000"}), kwargs={"path": "/hold"})
    holder.start()
    assert app.holding.wait(CLIENT_TIMEOUT_S)
    return holder


def stamp(seconds_ago: float) -> str:
    """An nginx-style ``t=seconds.millis`` stamp of ``seconds_ago`` on the wall clock."""
    return f"t={time.time() - seconds_ago:.3f}"


def test_a_trusted_stamp_takes_the_proxy_wait_off_the_budget(served: Any) -> None:
    server, _app = served()
    status, body, _ = call(server.port, {BUDGET: "10000", "X-Request-Start": stamp(3.0)})
    assert status == 200
    assert 1000 < int(body) <= 7000 + 50  # 10 s minus the 3 s in the proxy (and whatever the call took)
    assert server.stats()["upstream_stamps"] == 1
    # Every format of proxy_headers: ms (Heroku), µs in X-Queue-Start (Apache), ns.
    now_ns = time.time_ns()
    for header, value in (
        ("X-Request-Start", f"t={(now_ns - 3 * 10**9) // 10**6}"),
        ("X-Queue-Start", f"{(now_ns - 3 * 10**9) // 10**3}"),
        ("X-Request-Start", f"{now_ns - 3 * 10**9}"),
    ):
        status, body, _ = call(server.port, {BUDGET: "10000", header: value})
        assert status == 200 and int(body) <= 7000 + 50, (header, body)
    assert server.stats()["upstream_stamps"] == 4


def test_the_correction_is_capped_at_max_upstream_ms(served: Any) -> None:
    server, _app = served(max_upstream_ms=1000.0)
    status, body, _ = call(server.port, {BUDGET: "10000", "X-Request-Start": stamp(60.0)})
    assert status == 200 and 5000 < int(body) <= 9000 + 50


def test_a_stamp_from_a_peer_that_is_not_the_trusted_proxy_is_ignored(served: Any) -> None:
    server, _app = served()
    status, body, _ = call(server.port, {BUDGET: "10000", "X-Request-Start": stamp(3.0)}, source=OTHER_PEER)
    assert status == 200 and int(body) > 8000
    # ... and a budget it pretends was used up in a proxy still runs.
    status, body, _ = call(server.port, {BUDGET: "2000", "X-Request-Start": stamp(3.0)}, source=OTHER_PEER)
    assert status == 200
    assert server.stats()["upstream_stamps"] == 0


def test_without_trust_request_start_no_stamp_counts(served: Any) -> None:
    server, _app = served(trust_request_start=False, trusted_proxies=None)
    status, body, _ = call(server.port, {BUDGET: "2000", "X-Request-Start": stamp(3.0)})
    assert status == 200 and int(body) > 1000


@pytest.mark.parametrize(
    ("budget", "spent_s", "reason", "answered_within_s"),
    [
        # Used up in the proxy: 504 at once from the C thread, while the only worker is held.
        ("2000", 3.0, "expired-on-arrival", (0.0, 2.0)),
        # 6 s of budget, 5 s spent in the proxy: the line answers it when the last second ends
        # (by the header budget alone it would wait 6 s), the worker still held all along.
        ("6000", 5.0, "expired-in-queue", (0.5, 4.0)),
    ],
)
def test_a_budget_used_up_in_the_proxy_never_reaches_a_worker_or_the_app(
    served: Any, budget: str, spent_s: float, reason: str, answered_within_s: tuple[float, float]
) -> None:
    server, app = served(threads=1, max_queue=4)
    holder = hold_the_only_worker(server, app)
    started = time.monotonic()
    status, _body, got_reason = call(server.port, {BUDGET: budget, "X-Request-Start": stamp(spent_s)})
    answered_s = time.monotonic() - started
    assert (status, got_reason) == (504, reason)
    low, high = answered_within_s
    assert low < answered_s < high
    assert app.calls == 1  # only the holder
    stats = server.stats()
    assert stats[reason.replace("-", "_")] == 1 and stats["started"] == 1 and stats["upstream_stamps"] == 1
    app.release.set()
    holder.join(CLIENT_TIMEOUT_S)
    assert app.calls == 1


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Request-Start": "soon"},
        {"X-Request-Start": "t=-3"},
        {"X-Request-Start": "1.7e9"},
        {"X-Request-Start": "1"},  # 1970: not a clock
        {"X-Request-Start": "t=1700000000.1234567890"},  # a tenth fraction digit
        {"X-Request-Start": "t=1700000000, t=1700000001"},
        {"X-Request-Start": "T=1700000000"},
        {"X-Queue-Start": "99999999999999999999"},
        {"X-Request-Start": "1" * 41},
    ],
)
def test_malformed_stamps_are_ignored(served: Any, headers: dict[str, str]) -> None:
    server, _app = served()
    status, body, _ = call(server.port, {BUDGET: "10000", **headers})
    assert status == 200 and int(body) > 8000, headers
    assert server.stats()["upstream_stamps"] == 0


def test_a_repeated_stamp_header_is_ignored_as_python_joins_it(served: Any) -> None:
    server, _app = served()
    old = stamp(3.0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.putrequest("GET", "/")
        conn.putheader(BUDGET, "10000")
        conn.putheader("X-Request-Start", old)
        conn.putheader("X-Request-Start", old)
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 200 and int(response.read()) > 8000
    finally:
        conn.close()
    assert server.stats()["upstream_stamps"] == 0


def test_a_future_stamp_never_extends_the_deadline(served: Any) -> None:
    server, _app = served()
    status, body, _ = call(server.port, {BUDGET: "2000", "X-Request-Start": stamp(-60.0)})
    assert status == 200 and int(body) <= 2000
    # The earliest valid stamp of both headers counts, however far the other is in the future.
    status, body, _ = call(server.port, {BUDGET: "10000", "X-Request-Start": stamp(-60.0), "X-Queue-Start": stamp(3.0)})
    assert status == 200 and int(body) <= 7000 + 50


def test_kept_alive_requests_each_get_their_own_correction(served: Any) -> None:
    server, _app = served()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    remaining = []
    try:
        for headers in ({"X-Request-Start": stamp(3.0)}, {}, {"X-Request-Start": stamp(3.0)}):
            conn.request("GET", "/", headers={BUDGET: "10000", **headers})
            response = conn.getresponse()
            assert response.status == 200
            remaining.append(int(response.read()))
    finally:
        conn.close()
    assert remaining[0] <= 7050 and remaining[1] > 8000 and remaining[2] <= 7050
    wait_until(lambda: server.stats()["completed"] == 3, "the three requests to complete")
    assert server.stats()["upstream_stamps"] == 2


def test_an_ipv6_proxy() -> None:
    settings = resolve_settings(threads=1, max_queue=2, trust_request_start=True, trusted_proxies=["::1"], environ={})
    app = App()
    try:
        server = create_server(app, host="::1", port=0, settings=settings)
    except OSError as exc:  # pragma: no cover - a host without IPv6
        pytest.skip(f"no IPv6 loopback here: {exc}")
    server.start()
    try:
        conn = http.client.HTTPConnection("::1", server.port, timeout=CLIENT_TIMEOUT_S)
        try:
            conn.request("GET", "/", headers={BUDGET: "10000", "X-Request-Start": stamp(3.0)})
            response = conn.getresponse()
            assert response.status == 200 and int(response.read()) <= 7050
        finally:
            conn.close()
        assert server.stats()["upstream_stamps"] == 1
    finally:
        server.shutdown(5.0)
