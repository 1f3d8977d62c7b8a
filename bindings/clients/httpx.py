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

__all__ = ["DeadlineTransport"]

_TIMEOUT_KEYS = ("connect", "read", "write", "pool")


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
    """

    def __init__(
        self, transport: httpx.BaseTransport | None = None, *, margin_ms: float = DEFAULT_MARGIN_MS, grpc: bool = False
    ) -> None:
        if transport is not None and not isinstance(transport, httpx.BaseTransport):
            raise TypeError(f"transport must be an httpx.BaseTransport or None, not {type(transport).__name__}")
        self.margin_ms = validate_margin_ms(margin_ms)
        self.grpc = grpc
        self._transport = httpx.HTTPTransport() if transport is None else transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
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
