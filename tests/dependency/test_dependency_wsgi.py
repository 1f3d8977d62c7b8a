"""``Dependency`` on a real server: an honest 503 naming its reason, and HTTP clients inside it.

A view behind the real ``AdmissionMiddleware``, served by werkzeug's
threaded server and called with ``requests``, calls a ``Dependency``; a
refused or timed-out call becomes a 503 with ``X-Prazo-Reason``
(bulkhead-full, dependency-timeout), a caller deadline that ran out a 504,
and a stale value a 200 the view marks as stale. Then the recipes of docs/how-to/slow-dependency.md:
``requests`` and ``httpx`` inside a ``Dependency`` against a slow server cap
their own socket timeouts at the call's budget, so the dependency's thread
comes back at the budget, not when the slow server finally answers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import requests
from _helpers import JOIN_TIMEOUT_S, spawn, wait_until
from _required import require
from prazo.bindings.dependency import Dependency, DependencyUnavailable
from prazo.bindings.headers import BUDGET_ENVIRON_KEY, BUDGET_HEADER, REASON_HEADER_NAME
from prazo.bindings.wsgi import AdmissionMiddleware
from werkzeug.serving import WSGIRequestHandler, make_server

CLIENT_TIMEOUT_S = 10
# serve_forever looks for a shutdown request every poll_interval (0.5 s by default):
# a shorter one lets shutdown() return at once instead of waiting out the poll.
_POLL = {"poll_interval": 0.05}
WSGIApp = Callable[..., Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        """Tests read records, not access logs."""


class Client:
    """``requests`` against one started server: ``client.get("/path")``."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def get(self, path: str, headers: dict[str, str] | None = None) -> requests.Response:
        return requests.get(self.url + path, headers=headers, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture
def serve() -> Iterator[Callable[[WSGIApp], Client]]:
    servers = []

    def start(app: WSGIApp) -> Client:
        server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, kwargs=_POLL, daemon=True)
        thread.start()
        servers.append((server, thread))
        return Client(f"http://127.0.0.1:{server.server_port}")

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def make_app(dep: Dependency, fetch: Callable[[str], Any]) -> AdmissionMiddleware:
    def view(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        user = environ["PATH_INFO"].rsplit("/", 1)[-1]
        result = dep.call_detailed(fetch, user, key=("recs", user), idempotent=True)
        headers = [("Content-Type", "application/json")]
        if result.stale:
            headers.append(("X-Stale-Age-S", f"{result.age_s:.3f}"))
        start_response("200 OK", headers)
        return [json.dumps(result.value).encode()]

    return AdmissionMiddleware(view, max_concurrency=8, max_queue=8, default_budget_ms=2000)


def test_a_refused_dependency_call_is_a_503_with_its_reason(serve: Callable[[WSGIApp], Client]) -> None:
    release = threading.Event()
    dep = Dependency("recs", max_concurrent=1, timeout_ms=100)
    client = serve(make_app(dep, lambda user: release.wait(JOIN_TIMEOUT_S) and [user]))
    try:
        timed_out = client.get("/recs/1")
        assert timed_out.status_code == 503
        assert timed_out.headers[REASON_HEADER_NAME] == "dependency-timeout"
        assert "Retry-After" in timed_out.headers
        full = client.get("/recs/2")  # the timed-out call still holds the only place
        assert full.status_code == 503
        assert full.headers[REASON_HEADER_NAME] == "bulkhead-full"
    finally:
        release.set()
    assert dep.wait_idle(JOIN_TIMEOUT_S)
    ok = client.get("/recs/3")
    assert ok.status_code == 200 and ok.json() == ["3"]


def test_the_callers_budget_running_out_is_a_504(serve: Callable[[WSGIApp], Client]) -> None:
    release = threading.Event()
    dep = Dependency("recs", max_concurrent=2, timeout_ms=10_000)
    client = serve(make_app(dep, lambda user: release.wait(JOIN_TIMEOUT_S) and [user]))
    try:
        response = client.get("/recs/1", headers={BUDGET_HEADER: "100"})
        assert response.status_code == 504
        assert response.headers[REASON_HEADER_NAME] == "deadline-exceeded"
    finally:
        release.set()


def test_a_stale_value_is_a_200_the_view_can_mark(serve: Callable[[WSGIApp], Client]) -> None:
    down = threading.Event()

    def fetch(user: str) -> list[str]:
        if down.is_set():
            raise ConnectionError("recs is down")
        return [f"item for {user}"]

    dep = Dependency("recs", max_concurrent=4, timeout_ms=500, stale_for_s=600)
    client = serve(make_app(dep, fetch))
    fresh = client.get("/recs/7")
    assert fresh.status_code == 200 and "X-Stale-Age-S" not in fresh.headers
    down.set()
    stale = client.get("/recs/7")
    assert stale.status_code == 200 and stale.json() == ["item for 7"]
    assert float(stale.headers["X-Stale-Age-S"]) >= 0
    assert dep.stats()["stale_served"] == 1


def test_a_full_bulkhead_fails_only_its_own_requests(serve: Callable[[WSGIApp], Client]) -> None:
    release = threading.Event()
    dep = Dependency("recs", max_concurrent=2, timeout_ms=10_000)
    recs = make_app(dep, lambda user: release.wait(JOIN_TIMEOUT_S) and [user])

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        return recs(environ, start_response)

    client = serve(app)
    hung = [spawn(client.get, f"/recs/{n}") for n in range(2)]
    try:
        wait_until(lambda: dep.stats()["in_flight"] == 2, "the bulkhead to fill")
        for n in range(5):
            refused = client.get(f"/recs/x{n}")
            assert refused.status_code == 503 and refused.headers[REASON_HEADER_NAME] == "bulkhead-full"
            assert client.get("/healthz").status_code == 200
    finally:
        release.set()
    assert [future.result(JOIN_TIMEOUT_S).status_code for future in hung] == [200, 200]


def slow_backend(seconds: float, seen: list[Any]) -> WSGIApp:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        seen.append(environ.get(BUDGET_ENVIRON_KEY))
        time.sleep(seconds)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'["late"]']

    return app


def test_requests_inside_a_dependency_stops_at_the_budget(serve: Callable[[WSGIApp], Client]) -> None:
    from prazo.bindings.clients.requests import DeadlineSession

    seen: list[Any] = []
    backend = serve(slow_backend(3.0, seen))
    session = DeadlineSession(margin_ms=20)
    recs = Dependency("recs", max_concurrent=4, timeout_ms=300)

    def fetch(user_id: int) -> Any:
        return session.get(f"{backend.url}/recs/{user_id}", timeout=5).json()

    began = time.monotonic()
    with pytest.raises(DependencyUnavailable) as caught:
        recs.call(fetch, 7, key=("recs", 7))
    assert caught.value.reason == "dependency-timeout"
    # The socket timeout was capped at the budget too: the thread is back long before the 3 s answer.
    assert recs.wait_idle(2.0)
    assert time.monotonic() - began < 2.0
    assert seen and seen[0] is not None and 0 < float(seen[0]) <= 300


def test_httpx_inside_a_dependency_stops_at_the_budget(serve: Callable[[WSGIApp], Client]) -> None:
    httpx = require("httpx")
    from prazo.bindings.clients.httpx import DeadlineTransport

    seen: list[Any] = []
    backend = serve(slow_backend(3.0, seen))
    client = httpx.Client(transport=DeadlineTransport(margin_ms=20))
    recs = Dependency("recs", max_concurrent=4, timeout_ms=300)

    def fetch(user_id: int) -> Any:
        return client.get(f"{backend.url}/recs/{user_id}").json()

    began = time.monotonic()
    with pytest.raises(DependencyUnavailable) as caught:
        recs.call(fetch, 7)
    assert caught.value.reason == "dependency-timeout"
    assert recs.wait_idle(2.0)
    assert time.monotonic() - began < 2.0
    assert seen and float(seen[0]) <= 300
    client.close()
