"""Outgoing budget propagation, each client against a real HTTP server on 127.0.0.1.

The same behaviour is asserted for every adapter (requests, httpx, urllib3,
urllib): the header carries the remaining budget minus the margin, nothing
reaches the server when the budget is gone, a 503 becomes
``DownstreamOverloaded``, a slow server becomes ``DeadlineExceeded`` well
before it would have answered, and without a deadline nothing changes.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import Message
from typing import Any

import httpx
import pytest
import urllib3
from _loopback import LoopbackServer
from prazo.bindings.clients.httpx import DeadlineTransport
from prazo.bindings.clients.requests import DeadlineSession
from prazo.bindings.clients.urllib import deadline_urlopen
from prazo.bindings.clients.urllib3 import DeadlinePoolManager
from prazo.bindings.headers import (
    BUDGET_HEADER,
    ENVOY_TIMEOUT_HEADER,
    GRPC_TIMEOUT_HEADER,
    budget_from_headers,
    parse_grpc_timeout,
)
from prazo.bindings.outgoing import (
    DownstreamOverloadedResponse,
    outgoing_budget,
    outgoing_headers,
    replace_budget_headers,
)
from prazo.bindings.pool import AdmissionPool
from prazo.core import (
    REASON_DEADLINE_EXCEEDED,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    Deadline,
    DeadlineExceeded,
    DownstreamOverloaded,
    deadline_scope,
)

MARGIN_MS = 20
# How far below "budget - margin" the header may fall: the time spent between
# entering the scope and sending, on a loaded machine. Generous on purpose.
SLACK_MS = 1500
SLOW_SERVER_S = 10.0  # what a "slow" server would take; every test gives up long before


@dataclass
class Adapter:
    """One client library behind the same three operations."""

    name: str
    call: Callable[..., tuple[int, dict[str, Any]]]  # (url, timeout=None, headers=None) -> (status, echoed JSON)
    status_of: Callable[[Any], int]  # the status of the response kept on DownstreamOverloaded
    close: Callable[[], None]
    fresh_budget_per_redirect: bool


def _requests_adapter() -> Adapter:
    session = DeadlineSession(margin_ms=MARGIN_MS)

    def call(url: str, timeout: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        response = session.get(url, timeout=timeout, headers=headers)
        return response.status_code, response.json()

    return Adapter("requests", call, lambda r: r.status_code, session.close, True)


def _httpx_adapter() -> Adapter:
    client = httpx.Client(transport=DeadlineTransport(margin_ms=MARGIN_MS), follow_redirects=True)

    def call(url: str, timeout: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        response = client.get(url, timeout=timeout, headers=headers)
        return response.status_code, response.json()

    return Adapter("httpx", call, lambda r: r.status_code, client.close, True)


def _urllib3_adapter() -> Adapter:
    http = DeadlinePoolManager(margin_ms=MARGIN_MS)

    def call(url: str, timeout: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        response = http.request("GET", url, timeout=timeout, headers=headers)
        return response.status, json.loads(response.data)

    return Adapter("urllib3", call, lambda r: r.status, http.clear, True)


def _urllib_adapter() -> Adapter:
    def call(url: str, timeout: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        try:
            request = urllib.request.Request(url, headers=headers or {})
            with deadline_urlopen(request, margin_ms=MARGIN_MS, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:  # urllib raises for every 4xx/5xx
            with exc:
                return exc.code, json.loads(exc.read())

    # urllib's opener follows redirects itself, re-sending the headers of the
    # first request: the budget is computed once per call.
    return Adapter("urllib", call, lambda r: r.code, lambda: None, False)


ADAPTERS = [_requests_adapter, _httpx_adapter, _urllib3_adapter, _urllib_adapter]


@pytest.fixture(params=ADAPTERS, ids=["requests", "httpx", "urllib3", "urllib"])
def client(request: pytest.FixtureRequest) -> Iterator[Adapter]:
    adapter = request.param()
    yield adapter
    adapter.close()


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as running:
        yield running


# -- every adapter --------------------------------------------------------------------


def test_header_carries_the_remaining_budget_minus_the_margin(client: Adapter, server: LoopbackServer) -> None:
    with deadline_scope(Deadline.after_ms(2000)):
        status, body = client.call(server.url("/echo"))
    assert status == 200
    sent = int(body["budget_ms"])
    assert 2000 - MARGIN_MS - SLACK_MS <= sent <= 2000 - MARGIN_MS
    assert server.requests[0].budget_ms == body["budget_ms"]


@pytest.mark.parametrize("budget_ms", [-50, 0, 5, MARGIN_MS])
def test_no_request_is_sent_when_the_budget_is_gone(client: Adapter, server: LoopbackServer, budget_ms: float) -> None:
    with deadline_scope(Deadline.after_ms(budget_ms)), pytest.raises(DeadlineExceeded) as info:
        client.call(server.url("/echo"))
    assert info.value.reason == REASON_NO_BUDGET_FOR_DOWNSTREAM and info.value.status == 504
    assert server.count == 0


def test_a_503_answer_raises_downstream_overloaded(client: Adapter, server: LoopbackServer) -> None:
    # With Retry-After, which plain urllib3 would honour by sleeping and
    # resending; under a deadline the 503 goes straight back up.
    with deadline_scope(Deadline.after(5.0)), pytest.raises(DownstreamOverloaded) as info:
        client.call(server.url("/busy?status=503&retry_after=1"))
    exc = info.value
    assert exc.status == 503 and exc.reason == "downstream-overloaded"
    assert isinstance(exc, DownstreamOverloadedResponse)
    assert client.status_of(exc.response) == 503
    assert exc.url.endswith("/busy?status=503&retry_after=1")
    assert server.count == 1


def test_a_server_slower_than_the_budget_raises_deadline_exceeded(client: Adapter, server: LoopbackServer) -> None:
    started = time.monotonic()
    with deadline_scope(Deadline.after(0.3)), pytest.raises(DeadlineExceeded) as info:
        client.call(server.url(f"/slow?sleep={SLOW_SERVER_S}"))
    assert time.monotonic() - started < SLOW_SERVER_S / 2
    assert info.value.reason == REASON_DEADLINE_EXCEEDED
    # Sent once: a timeout is never retried with time the caller no longer has.
    assert server.count == 1


def test_a_shorter_caller_timeout_still_wins(client: Adapter, server: LoopbackServer) -> None:
    started = time.monotonic()
    with deadline_scope(Deadline.after(60.0)), pytest.raises(DeadlineExceeded):
        client.call(server.url(f"/slow?sleep={SLOW_SERVER_S}"), timeout=0.2)
    assert time.monotonic() - started < SLOW_SERVER_S / 2


def test_without_a_deadline_nothing_changes(client: Adapter, server: LoopbackServer) -> None:
    # No header, no timeout imposed (the server takes a while and still
    # answers), and a 503 is just a response.
    status, body = client.call(server.url("/slow?sleep=0.3"))
    assert status == 200 and body["budget_ms"] is None
    status, _ = client.call(server.url("/busy?status=503"))
    assert status == 503
    assert [r.budget_ms for r in server.requests] == [None, None]


def test_each_redirect_hop_gets_what_is_left(client: Adapter, server: LoopbackServer) -> None:
    with deadline_scope(Deadline.after(5.0)):
        status, body = client.call(server.url("/first?sleep=0.2&redirect=/second"))
    assert status == 200 and body["path"] == "/second"
    first, second = (int(r.budget_ms or "-1") for r in server.requests)
    if client.fresh_budget_per_redirect:
        assert second <= first - 150  # the first hop slept 200 ms
    else:
        assert second == first


# A budget the caller already put on the request, larger than the deadline's,
# in every letter case and wire format a receiver reads (and an invalid one).
_CALLERS_BUDGET_HEADERS = [
    {"X-Request-Budget-Ms": "60000"},
    {"x-request-budget-ms": "60000"},
    {"X-REQUEST-BUDGET-MS": "60000"},
    {"x-Request-BUDGET-ms": "60000"},
    {"x-request-budget-ms": "soon"},
    {"Grpc-Timeout": "99S"},
    {"X-Envoy-Expected-Rq-Timeout-Ms": "60000"},
    {"x-request-budget-ms": "60000", "GRPC-TIMEOUT": "1H", "x-envoy-expected-rq-timeout-ms": "60000"},
]


def _as_receiver_sees_it(fields: tuple[tuple[str, str], ...]) -> Message:
    message = Message()
    for name, value in fields:
        message[name] = value  # appends: a repeated field stays repeated
    return message


@pytest.mark.parametrize(
    "callers", _CALLERS_BUDGET_HEADERS, ids=lambda headers: ",".join(f"{k}={v}" for k, v in headers.items())
)
def test_a_budget_header_the_caller_set_is_replaced_by_exactly_one_of_prazos(
    client: Adapter, server: LoopbackServer, callers: dict[str, str]
) -> None:
    """Two values ("60000, 1979") are invalid to the receiver, which then applies its own default."""
    with deadline_scope(Deadline.after_ms(2000)):
        status, _ = client.call(server.url("/echo"), headers=callers)
    assert status == 200
    (received,) = server.requests
    (budget,) = received.values(BUDGET_HEADER)
    assert 2000 - MARGIN_MS - SLACK_MS <= int(budget) <= 2000 - MARGIN_MS
    # A format the caller used goes out once more only if prazo re-sends it, with prazo's value.
    assert received.values(ENVOY_TIMEOUT_HEADER) == []
    grpc_values = received.values(GRPC_TIMEOUT_HEADER)
    if any(name.lower() == GRPC_TIMEOUT_HEADER for name in callers):
        (grpc_timeout,) = grpc_values
        assert (parse_grpc_timeout(grpc_timeout) or 0) <= int(budget) + 1
    else:
        assert grpc_values == []
    judged = budget_from_headers(_as_receiver_sees_it(received.headers))  # type: ignore[arg-type]
    assert judged.invalid == 0
    assert judged.budget_ms is not None and judged.budget_ms <= 2000 - MARGIN_MS


@pytest.mark.parametrize("name", ["X-Request-Budget-Ms", "x-request-budget-ms", "grpc-timeout"])
def test_a_smaller_budget_the_caller_set_still_counts(client: Adapter, server: LoopbackServer, name: str) -> None:
    """The caller's own header may shorten the budget sent, and the timeout with it, never lengthen it."""
    value = "300" if name.lower() == BUDGET_HEADER.lower() else "300m"
    with deadline_scope(Deadline.after(60.0)):
        status, _ = client.call(server.url("/echo"), headers={name: value})
        assert status == 200
        assert server.requests[0].values(BUDGET_HEADER) == ["300"]
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            client.call(server.url(f"/slow?sleep={SLOW_SERVER_S}"), headers={name: value})
    assert info.value.reason == REASON_DEADLINE_EXCEEDED
    assert time.monotonic() - started < SLOW_SERVER_S / 2


def test_by_hand_a_plain_dict_gets_exactly_prazos_budget_headers() -> None:
    headers = {
        "x-request-budget-ms": "60000",
        "GRPC-Timeout": "1H",
        "X-ENVOY-EXPECTED-RQ-TIMEOUT-MS": "9",
        "Accept": "*/*",
    }
    with deadline_scope(Deadline.after_ms(2000)):
        budget = outgoing_budget(MARGIN_MS, headers=headers)
    assert budget is not None
    replace_budget_headers(headers, budget)
    # The envoy value (9 ms) was the smallest: it shortens, in prazo's formats.
    assert headers == {"Accept": "*/*", BUDGET_HEADER: "9", GRPC_TIMEOUT_HEADER: "9000000n"}
    assert budget.timeout_s == 0.009


def test_a_callers_spent_budget_means_no_call() -> None:
    with deadline_scope(Deadline.after(60.0)), pytest.raises(DeadlineExceeded) as info:
        outgoing_budget(MARGIN_MS, headers={"x-request-budget-ms": "0"})
    assert info.value.reason == REASON_NO_BUDGET_FOR_DOWNSTREAM


def test_urllib_replaces_an_unredirected_budget_header_too(server: LoopbackServer) -> None:
    """urllib sends an unredirected header in place of a plain one of the same name."""
    request = urllib.request.Request(server.url("/echo"))
    request.add_unredirected_header("X-Request-Budget-Ms", "60000")
    with deadline_scope(Deadline.after_ms(2000)), deadline_urlopen(request, margin_ms=MARGIN_MS) as response:
        assert response.status == 200
    (budget,) = server.requests[0].values(BUDGET_HEADER)
    assert int(budget) <= 2000 - MARGIN_MS
    assert request.unredirected_hdrs == {"X-request-budget-ms": "60000"}  # the caller's Request is untouched


def test_work_in_an_admission_pool_propagates_the_submitters_deadline(server: LoopbackServer) -> None:
    session = DeadlineSession(margin_ms=MARGIN_MS)
    with AdmissionPool(2, 4) as pool:
        with deadline_scope(Deadline.after_ms(3000)):
            future = pool.submit(session.get, server.url("/echo"))
        body = future.result(10).json()
    session.close()
    assert 3000 - MARGIN_MS - SLACK_MS <= int(body["budget_ms"]) <= 3000 - MARGIN_MS


# -- client-specific timeout forms -------------------------------------------------------


@pytest.mark.parametrize("timeout", [(5.0, SLOW_SERVER_S), (None, None), urllib3.Timeout(connect=5, read=30)])
def test_requests_timeout_forms_are_capped(server: LoopbackServer, timeout: Any) -> None:
    started = time.monotonic()
    with DeadlineSession() as session, deadline_scope(Deadline.after(0.3)), pytest.raises(DeadlineExceeded):
        session.get(server.url(f"/slow?sleep={SLOW_SERVER_S}"), timeout=timeout)
    assert time.monotonic() - started < SLOW_SERVER_S / 2


def test_requests_rejects_an_unknown_timeout_type(server: LoopbackServer) -> None:
    with DeadlineSession() as session, deadline_scope(Deadline.after(5.0)), pytest.raises(TypeError, match="timeout"):
        session.get(server.url("/echo"), timeout="5")
    assert server.count == 0


def test_urllib3_timeout_object_and_pool_default_are_capped(server: LoopbackServer) -> None:
    http = DeadlinePoolManager(timeout=urllib3.Timeout(connect=5, read=30))
    for timeout in (urllib3.Timeout(total=30), None):
        started = time.monotonic()
        with deadline_scope(Deadline.after(0.3)), pytest.raises(DeadlineExceeded):
            if timeout is None:
                http.request("GET", server.url(f"/slow?sleep={SLOW_SERVER_S}"))
            else:
                http.request("GET", server.url(f"/slow?sleep={SLOW_SERVER_S}"), timeout=timeout)
        assert time.monotonic() - started < SLOW_SERVER_S / 2
    http.clear()


def test_urllib3_keeps_retries_the_caller_chose(server: LoopbackServer) -> None:
    http = DeadlinePoolManager()
    retries = urllib3.Retry(total=2, status=2, status_forcelist=[502], backoff_factor=0, raise_on_status=False)
    with deadline_scope(Deadline.after(5.0)):
        response = http.request("GET", server.url("/flaky?status=502"), retries=retries)
    assert response.status == 502
    assert server.count == 3
    http.clear()


class _RecordingTransport(httpx.HTTPTransport):
    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


def test_httpx_wraps_a_given_transport_and_closes_it(server: LoopbackServer) -> None:
    inner = _RecordingTransport(retries=1)
    with httpx.Client(transport=DeadlineTransport(inner)) as http, deadline_scope(Deadline.after(2.0)):
        assert http.get(server.url("/echo")).json()["budget_ms"] is not None
    assert inner.closed


def test_urllib_does_not_modify_the_callers_request(server: LoopbackServer) -> None:
    request = urllib.request.Request(server.url("/echo"), headers={"X-Trace": "t1"})
    with deadline_scope(Deadline.after(2.0)), deadline_urlopen(request) as response:
        assert json.loads(response.read())["budget_ms"] is not None
    assert request.headers == {"X-trace": "t1"}


def test_grpc_timeout_is_sent_on_request(server: LoopbackServer) -> None:
    with DeadlineSession(grpc=True) as session, deadline_scope(Deadline.after_ms(1500)):
        body = session.get(server.url("/echo")).json()
    assert body["grpc_timeout"] is not None and body["grpc_timeout"][-1] in "Mmun"


# -- outgoing_headers / outgoing_budget -------------------------------------------------


def test_outgoing_headers_without_a_deadline_is_empty() -> None:
    assert outgoing_headers() == {}
    assert outgoing_budget() is None


def test_outgoing_headers_under_a_deadline() -> None:
    with deadline_scope(Deadline.after_ms(1000)):
        headers = outgoing_headers(margin_ms=100)
        budget = outgoing_budget(margin_ms=100)
    assert list(headers) == ["X-Request-Budget-Ms"]
    assert 900 - SLACK_MS <= int(headers["X-Request-Budget-Ms"]) <= 900
    assert budget is not None and 0 < budget.timeout_s <= 0.9
    assert budget.cap(None) == budget.timeout_s and budget.cap(0.01) == 0.01 and budget.cap(60) == budget.timeout_s


def test_outgoing_headers_with_grpc() -> None:
    with deadline_scope(Deadline.after(5.0)):
        headers = outgoing_headers(grpc=True)
    assert set(headers) == {"X-Request-Budget-Ms", "grpc-timeout"}


def test_less_than_a_millisecond_left_is_nothing_left() -> None:
    # The wire carries whole milliseconds; "0" would only earn a 504 downstream.
    with deadline_scope(Deadline.after_ms(MARGIN_MS + 0.9)), pytest.raises(DeadlineExceeded) as info:
        outgoing_headers(margin_ms=MARGIN_MS)
    assert info.value.reason == REASON_NO_BUDGET_FOR_DOWNSTREAM


@pytest.mark.parametrize(
    "margin, error",
    [(-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("20", TypeError), (True, TypeError)],
)
def test_bad_margin_is_refused_by_name(margin: Any, error: type) -> None:
    with pytest.raises(error, match="margin_ms"):
        outgoing_headers(margin_ms=margin)
    for make in (
        lambda: DeadlineSession(margin_ms=margin),
        lambda: DeadlineTransport(margin_ms=margin),
        lambda: DeadlinePoolManager(margin_ms=margin),
    ):
        with pytest.raises(error, match="margin_ms"):
            make()
    with pytest.raises(error, match="margin_ms"):
        deadline_urlopen("http://127.0.0.1:9/never", margin_ms=margin)


def test_bad_transport_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="transport"):
        DeadlineTransport(object())  # type: ignore[arg-type]


def test_overloaded_error_pickles_without_the_response() -> None:
    exc = DownstreamOverloadedResponse(object(), "http://b/x")
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is DownstreamOverloaded and copy.reason == exc.reason and str(copy) == str(exc)


def test_the_budget_and_the_stdlib_adapter_need_none_of_the_optional_clients() -> None:
    script = textwrap.dedent(
        """
        import sys
        for name in ("requests", "httpx", "urllib3"):
            sys.modules[name] = None  # makes any import of it fail
        from prazo.bindings import outgoing
        from prazo.bindings.clients.urllib import deadline_urlopen
        from prazo.core import Deadline, deadline_scope
        with deadline_scope(Deadline.after(1.0)):
            assert "X-Request-Budget-Ms" in outgoing.outgoing_headers()
        assert callable(deadline_urlopen)
        try:
            from prazo.bindings.clients import requests
        except ImportError:
            print("needs requests")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "needs requests\n"
