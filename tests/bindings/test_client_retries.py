"""``retry=RetryPolicy(...)`` on every HTTP adapter, against real servers on 127.0.0.1.

The same behaviour for requests, httpx, urllib3 and urllib: a 503 then a 200
is retried and succeeds; a 504 is never retried; a POST only with
``idempotent=True``; a streamed body never; a ``Retry-After`` beyond the
budget gives the 503 back at once; each retry carries a smaller budget; a
refused or reset connection moves to the next endpoint; the budget and the
deadline refuse retries they do not cover. Waits between attempts go through
a recording ``sleep`` (really sleeping only where a test needs the budget to
shrink), and the jitter through a seeded ``random.Random``.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import urllib3
from _loopback import LoopbackServer
from prazo.bindings.clients.httpx import IDEMPOTENT_EXTENSION, DeadlineTransport
from prazo.bindings.clients.requests import DeadlineSession
from prazo.bindings.clients.urllib import deadline_urlopen
from prazo.bindings.clients.urllib3 import DeadlinePoolManager
from prazo.bindings.retries import AdaptiveThrottle, RetryBudget, RetryPolicy, Throttled
from prazo.core import Deadline, DownstreamOverloaded, deadline_scope

BODY = b"hello"


@dataclass
class Client:
    """One adapter behind one call: ``call(method, url, idempotent=None, streamed=False) -> (status, json)``."""

    name: str
    call: Callable[..., tuple[int, dict[str, Any]]]
    close: Callable[[], None]


def _stream() -> Iterator[bytes]:
    yield BODY


def _requests(policy: RetryPolicy) -> Client:
    session = DeadlineSession(retry=policy)

    def call(method: str, url: str, idempotent: bool | None = None, streamed: bool = False) -> tuple[int, Any]:
        data = _stream() if streamed else (BODY if method == "POST" else None)
        headers = {"Content-Length": str(len(BODY))} if streamed else None
        response = session.request(method, url, data=data, headers=headers, idempotent=idempotent, timeout=10)
        return response.status_code, response.json()

    return Client("requests", call, session.close)


def _httpx(policy: RetryPolicy) -> Client:
    client = httpx.Client(transport=DeadlineTransport(retry=policy), timeout=10)

    def call(method: str, url: str, idempotent: bool | None = None, streamed: bool = False) -> tuple[int, Any]:
        content: Any = _stream() if streamed else (BODY if method == "POST" else None)
        headers = {"Content-Length": str(len(BODY))} if streamed else None
        extensions = {} if idempotent is None else {IDEMPOTENT_EXTENSION: idempotent}
        response = client.request(method, url, content=content, headers=headers, extensions=extensions)
        return response.status_code, response.json()

    return Client("httpx", call, client.close)


def _urllib3(policy: RetryPolicy) -> Client:
    http = DeadlinePoolManager(retry=policy, timeout=10)

    def call(method: str, url: str, idempotent: bool | None = None, streamed: bool = False) -> tuple[int, Any]:
        body: Any = io.BytesIO(BODY) if streamed else (BODY if method == "POST" else None)
        headers = {"Content-Length": str(len(BODY))} if streamed else None
        response = http.request(method, url, body=body, headers=headers, idempotent=idempotent)
        return response.status, json.loads(response.data)

    return Client("urllib3", call, http.clear)


def _urllib(policy: RetryPolicy) -> Client:
    def call(method: str, url: str, idempotent: bool | None = None, streamed: bool = False) -> tuple[int, Any]:
        data: Any = iter([BODY]) if streamed else (BODY if method == "POST" else None)
        headers = {"Content-Length": str(len(BODY))} if streamed else {}
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with deadline_urlopen(request, retry=policy, idempotent=idempotent, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:  # urllib raises for every 4xx/5xx
            with exc:
                return exc.code, json.loads(exc.read())

    return Client("urllib", call, lambda: None)


MAKERS = {"requests": _requests, "httpx": _httpx, "urllib3": _urllib3, "urllib": _urllib}


class Sleeps:
    """A recording ``sleep``: keeps every delay asked for; really sleeps ``real_s`` each time."""

    def __init__(self, real_s: float = 0.0) -> None:
        self.delays: list[float] = []
        self.real_s = real_s

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        if self.real_s:
            time.sleep(self.real_s)


def policy(sleeps: Sleeps | None = None, **overrides: Any) -> RetryPolicy:
    arguments: dict[str, Any] = {
        "max_attempts": 3,
        "budget": RetryBudget(percent=1.0, min_per_s=10),
        "attempt_ms": 0.0,
        "rng": random.Random(7),
        "sleep": sleeps if sleeps is not None else Sleeps(),
    }
    arguments.update(overrides)
    return RetryPolicy(**arguments)


@pytest.fixture(params=list(MAKERS))
def adapter(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as running:
        yield running


def client_for(name: str, retry: RetryPolicy) -> Client:
    return MAKERS[name](retry)


def test_a_503_then_a_200_is_retried_and_succeeds(adapter: str, server: LoopbackServer) -> None:
    retry = policy()
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(5.0)):
        status, _ = client.call("GET", server.url("/busy?fail=1&reason=queue-full"))
    client.close()
    assert status == 200 and server.count == 2
    assert retry.stats()["retries"] == 1


def test_a_503_then_a_200_is_retried_outside_a_deadline_too(adapter: str, server: LoopbackServer) -> None:
    client = client_for(adapter, policy())
    status, _ = client.call("GET", server.url("/busy?fail=2"))
    client.close()
    assert status == 200 and server.count == 3


@pytest.mark.parametrize("under_a_deadline", [True, False], ids=["deadline", "no-deadline"])
def test_a_504_is_never_retried(adapter: str, server: LoopbackServer, under_a_deadline: bool) -> None:
    retry = policy()
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(5.0)) if under_a_deadline else contextlib.nullcontext():
        status, _ = client.call("GET", server.url("/late?status=504"))
    client.close()
    assert status == 504 and server.count == 1
    # The refusal is counted under rule 1's name, and the 504 is no successful attempt.
    assert retry.stats()["retries"] == 0
    assert retry.stats()["not_retried"] == {"not-retryable": 1}


def test_a_503_that_did_work_is_not_retried(adapter: str, server: LoopbackServer) -> None:
    client = client_for(adapter, policy())
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded):
        client.call("GET", server.url("/busy?fail=1&reason=dependency-timeout"))
    client.close()
    assert server.count == 1


def test_a_post_is_retried_only_when_the_caller_says_it_is_idempotent(adapter: str, server: LoopbackServer) -> None:
    retry = policy()
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded):
        client.call("POST", server.url("/orders?fail=1"))
    assert server.count == 1
    with deadline_scope(Deadline.after(5.0)):
        status, _ = client.call("POST", server.url("/orders?fail=1&again"), idempotent=True)
    client.close()
    assert status == 200 and server.count == 3
    assert retry.stats()["not_retried"] == {"not-idempotent": 1}


def test_a_streamed_body_is_never_retried(adapter: str, server: LoopbackServer) -> None:
    retry = policy()
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded):
        client.call("PUT", server.url("/upload?fail=1"), streamed=True)
    client.close()
    assert server.count == 1
    assert retry.stats()["not_retried"] == {"streamed-body": 1}


def test_a_retry_after_beyond_the_budget_gives_the_503_back_at_once(adapter: str, server: LoopbackServer) -> None:
    sleeps = Sleeps()
    retry = policy(sleeps)
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(2.0)), pytest.raises(DownstreamOverloaded) as info:
        client.call("GET", server.url("/busy?fail=1&retry_after=30"))
    client.close()
    assert info.value.status == 503
    assert server.count == 1 and sleeps.delays == []
    assert retry.stats()["retries_refused_by_deadline"] == 1


def test_a_retry_after_that_fits_is_honoured(adapter: str, server: LoopbackServer) -> None:
    sleeps = Sleeps()
    retry = policy(sleeps)
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(10.0)):
        status, _ = client.call("GET", server.url("/busy?fail=1&retry_after=2"))
    client.close()
    assert status == 200 and sleeps.delays == [2.0]
    assert retry.stats()["retry_after_honoured"] == 1


def test_each_retry_carries_a_smaller_budget(adapter: str, server: LoopbackServer) -> None:
    # Each wait really lasts 30 ms, so each attempt has at least that much less.
    client = client_for(adapter, policy(Sleeps(real_s=0.03)))
    with deadline_scope(Deadline.after(5.0)):
        status, body = client.call("GET", server.url("/busy?fail=2"))
    client.close()
    budgets = [int(received.budget_ms or "-1") for received in server.requests]
    assert status == 200 and len(budgets) == 3
    assert budgets[0] <= 5000 and budgets[0] > budgets[1] > budgets[2] > 0
    assert int(body["budget_ms"]) == budgets[2]


def test_the_budget_refuses_retries_it_does_not_cover(adapter: str, server: LoopbackServer) -> None:
    retry = policy(budget=RetryBudget(percent=0.0, min_per_s=0.0))
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded):
        client.call("GET", server.url("/busy?fail=1"))
    client.close()
    assert server.count == 1 and retry.stats()["retries_refused_by_budget"] == 1


def test_the_deadline_refuses_a_retry_the_expected_attempt_would_not_fit(adapter: str, server: LoopbackServer) -> None:
    retry = policy(attempt_ms=10_000.0)
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(2.0)), pytest.raises(DownstreamOverloaded):
        client.call("GET", server.url("/busy?fail=1"))
    client.close()
    assert server.count == 1 and retry.stats()["retries_refused_by_deadline"] == 1


def _refused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Resetter:
    """A listener that resets every connection before sending a byte (SO_LINGER 0, then close)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.resets = 0
        # accept() is not woken by close() from another thread: poll a stop flag.
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.settimeout(10)
            connection.recv(65536)  # the request arrived: the reset comes after it, before any response
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()
            self.resets += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


def test_a_refused_connection_is_retried_on_the_next_endpoint(adapter: str, server: LoopbackServer) -> None:
    dead = f"http://127.0.0.1:{_refused_port()}"
    retry = policy(endpoints=[dead, server.url("")])
    client = client_for(adapter, retry)
    with deadline_scope(Deadline.after(5.0)):
        status, body = client.call("GET", f"{dead}/items")
    client.close()
    assert status == 200 and body["path"] == "/items" and server.count == 1


def test_a_reset_before_the_response_is_retried_on_the_next_endpoint(adapter: str, server: LoopbackServer) -> None:
    resetter = Resetter()
    try:
        broken = f"http://127.0.0.1:{resetter.port}"
        retry = policy(endpoints=[broken, server.url("")])
        client = client_for(adapter, retry)
        with deadline_scope(Deadline.after(5.0)):
            status, body = client.call("GET", f"{broken}/items")
        client.close()
    finally:
        resetter.close()
    assert status == 200 and body["path"] == "/items" and server.count == 1
    assert resetter.resets == 1


def test_a_503_moves_to_the_next_endpoint(adapter: str) -> None:
    with LoopbackServer() as first, LoopbackServer() as second:
        retry = policy(endpoints=[first.url(""), second.url("")])
        client = client_for(adapter, retry)
        with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded):
            client.call("GET", first.url("/items?status=503"))
        client.close()
        # Both instances answer 503: attempt 2 goes to the second, attempt 3 back to the first.
        assert first.count == 2 and second.count == 1


def test_urllib3_retries_and_retry_do_not_mix() -> None:
    with pytest.raises(ValueError, match="retries"):
        DeadlinePoolManager(retry=policy(), retries=3)
    http = DeadlinePoolManager(retry=policy())
    with pytest.raises(ValueError, match="retries"):
        http.request("GET", "http://127.0.0.1:9/", retries=2)


@pytest.mark.parametrize("make", [DeadlineSession, DeadlineTransport, DeadlinePoolManager])
def test_retry_must_be_a_retry_policy(make: Callable[..., Any]) -> None:
    with pytest.raises(TypeError, match="retry"):
        make(retry=3)
    with pytest.raises(TypeError, match="retry"):
        deadline_urlopen("http://127.0.0.1:9/", retry=3)  # type: ignore[arg-type]


def test_urllib3_a_refused_connection_under_a_deadline_is_no_timeout() -> None:
    # urllib3 makes NewConnectionError a ConnectTimeoutError; without retry=
    # it still comes out as urllib3's error, not as a 504 DeadlineExceeded.
    http = DeadlinePoolManager()
    with deadline_scope(Deadline.after(5.0)), pytest.raises(urllib3.exceptions.MaxRetryError) as info:
        http.request("GET", f"http://127.0.0.1:{_refused_port()}/")
    assert isinstance(info.value.reason, urllib3.exceptions.NewConnectionError)


def test_a_throttled_client_stops_sending_to_a_destination_that_keeps_refusing(
    adapter: str, server: LoopbackServer
) -> None:
    # Every request refused (503 queue-full): a plain client sends all 60. With the throttle, once its
    # window holds min_requests refusals each attempt is refused here with p at its 0.9 cap, never sent.
    retry = policy(max_attempts=1, throttle=AdaptiveThrottle(min_requests=5, rng=random.Random(3)))
    client = client_for(adapter, retry)
    statuses: dict[object, int] = {}
    for _ in range(60):
        try:
            status: object = client.call("GET", server.url("/busy?fail=1000&reason=queue-full"))[0]
        except Throttled as exc:
            status = exc.reason
        statuses[status] = statuses.get(status, 0) + 1
    client.close()
    sent = server.count
    assert statuses == {503: sent, "throttled-locally": 60 - sent}
    assert retry.stats()["throttled_locally"] == 60 - sent
    assert 5 <= sent < 30
