"""``DeadlineTransport``: an ``httpx`` transport that passes the budget downstream.

Built on ``prazo.bindings.outgoing``; needs ``httpx`` (the
``clients`` extra).
"""

from __future__ import annotations

import httpx

from ..outgoing import (
    DEFAULT_MARGIN_MS,
    DownstreamOverloadedResponse,
    downstream_timed_out,
    outgoing_budget,
    replace_budget_headers,
    validate_margin_ms,
)
from ..retries import Failure, RetryPolicy, connection_failure, idempotent_request, response_failure, returned_failure

__all__ = ["IDEMPOTENT_EXTENSION", "DeadlineTransport"]

_TIMEOUT_KEYS = ("connect", "read", "write", "pool")

#: The request extension saying a POST/PATCH may be retried:
#: ``client.post(url, json=..., extensions={IDEMPOTENT_EXTENSION: True})``.
IDEMPOTENT_EXTENSION = "prazo.idempotent"


def _replayable(request: httpx.Request) -> bool:
    try:
        _ = request.content
    except httpx.RequestNotRead:  # a generator or file body: it can be sent once
        return False
    return True


def _moved(request: httpx.Request, url: str) -> httpx.Request:
    """A copy of ``request`` for ``url``; httpx sets the new Host."""
    if url == str(request.url):
        return request
    headers = [(name, value) for name, value in request.headers.raw if name.lower() != b"host"]
    return httpx.Request(request.method, url, headers=headers, content=request.content, extensions=request.extensions)


class DeadlineTransport(httpx.BaseTransport):
    """Wraps an httpx transport so requests carry the remaining budget and stop at the deadline.

    A transport (rather than event hooks) because it sees every request the
    client sends, redirects included, and can refuse one before any
    connection is touched. Under a ``deadline_scope`` each request:

    * carries ``X-Request-Budget-Ms`` = remaining − ``margin_ms`` (also
      ``grpc-timeout`` with ``grpc=True``);
      a budget header already on the request (any letter case) is replaced,
      and its value can only shorten the budget (see ``prazo.bindings.outgoing``);
    * has each of its connect/read/write/pool timeouts capped at that budget;
    * is not sent when nothing is left (``DeadlineExceeded``, reason
      ``no-budget-for-downstream``);
    * raises ``DownstreamOverloaded`` on a 503 (``.response``, body read) and
      ``DeadlineExceeded`` (reason ``deadline-exceeded``) on an
      ``httpx.TimeoutException``.

    ::

        client = httpx.Client(transport=DeadlineTransport(margin_ms=20))
        with deadline_scope(Deadline.after(2.0)):
            items = client.get("http://b.internal/items").json()

    ``transport`` defaults to ``httpx.HTTPTransport()``; pass your own to
    keep its settings. Outside any deadline scope requests pass unchanged.

    ``retry=RetryPolicy(...)`` retries what is safe to retry (see
    ``prazo.bindings.retries``), each attempt with what is left of the
    budget; a POST or PATCH only with the request extension
    ``IDEMPOTENT_EXTENSION`` set to True, a streamed body never. Keep the
    wrapped transport's own ``retries`` at 0.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        margin_ms: float = DEFAULT_MARGIN_MS,
        grpc: bool = False,
        retry: RetryPolicy | None = None,
    ) -> None:
        if transport is not None and not isinstance(transport, httpx.BaseTransport):
            raise TypeError(f"transport must be an httpx.BaseTransport or None, not {type(transport).__name__}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a prazo RetryPolicy or None, not {type(retry).__name__}")
        self.margin_ms = validate_margin_ms(margin_ms)
        self.grpc = grpc
        self.retry = retry
        self._transport = httpx.HTTPTransport() if transport is None else transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        policy = self.retry
        if policy is None:
            return self._send_once(request)
        url = str(request.url)
        retryable_reasons = policy.retryable_reasons

        def attempt(number: int) -> httpx.Response:
            return self._send_once(_moved(request, policy.url_for_attempt(url, number)))

        def classify(exc: BaseException) -> Failure | None:
            failure = response_failure(exc, retryable_reasons=retryable_reasons)
            if failure is not None:
                return failure
            # Everything the transport raises comes before the response head.
            if isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc):
                return Failure("reset")
            if isinstance(exc, (httpx.ConnectError, httpx.ReadError, httpx.WriteError)):
                return connection_failure(exc)
            return None

        def judge(response: httpx.Response) -> Failure | None:
            if response.status_code != 503:
                return returned_failure(response.status_code, response.headers)
            try:
                response.read()
            finally:
                response.close()
            return response_failure(DownstreamOverloadedResponse(response, url), retryable_reasons=retryable_reasons)

        override = request.extensions.get(IDEMPOTENT_EXTENSION)
        return policy.call(
            attempt,
            classify,
            destination=policy.destination_of(url),
            idempotent=idempotent_request(request.method, override),
            replayable=_replayable(request),
            judge=judge,
        )

    def _send_once(self, request: httpx.Request) -> httpx.Response:
        budget = outgoing_budget(self.margin_ms, grpc=self.grpc, headers=request.headers)
        if budget is None:
            return self._transport.handle_request(request)
        replace_budget_headers(request.headers, budget)
        timeouts: dict[str, float | None] = dict(request.extensions.get("timeout", {}))
        request.extensions["timeout"] = {key: budget.cap(timeouts.get(key)) for key in _TIMEOUT_KEYS}
        url = str(request.url)
        try:
            response = self._transport.handle_request(request)
        except httpx.TimeoutException as exc:
            raise downstream_timed_out(url) from exc
        if response.status_code == 503:
            # Read and close here: the client never sees this response, so
            # nobody else would release its connection.
            try:
                response.read()
            finally:
                response.close()
            raise DownstreamOverloadedResponse(response, url)
        return response

    def close(self) -> None:
        self._transport.close()
