"""``DeadlineSession``: a ``requests.Session`` that passes the budget downstream.

Built on ``prazo.bindings.outgoing``; needs ``requests`` (the
``clients`` extra).
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import requests
from urllib3.util import Timeout

from ..outgoing import (
    DEFAULT_MARGIN_MS,
    DownstreamOverloadedResponse,
    OutgoingBudget,
    downstream_timed_out,
    outgoing_budget,
    replace_budget_headers,
    validate_margin_ms,
)
from .urllib3 import capped_urllib3_timeout

__all__ = ["DeadlineSession"]


def _capped_requests_timeout(timeout: Any, budget: OutgoingBudget) -> Any:
    """Cap a requests timeout: None, a number, a ``(connect, read)`` pair or a urllib3 ``Timeout``."""
    if isinstance(timeout, tuple):
        connect, read = timeout
        return (budget.cap(connect), budget.cap(read))
    if isinstance(timeout, Timeout):
        return capped_urllib3_timeout(timeout, budget)
    if timeout is None:
        return budget.timeout_s
    if isinstance(timeout, Real) and not isinstance(timeout, bool):
        return budget.cap(float(timeout))
    raise TypeError(f"timeout must be a number, a (connect, read) tuple or None, not {type(timeout).__name__}")


class DeadlineSession(requests.Session):
    """A ``requests.Session`` whose requests carry the remaining budget and stop at the deadline.

    Under a ``deadline_scope`` every request sent (and every redirect hop,
    with what is left by then):

    * carries ``X-Request-Budget-Ms`` = remaining − ``margin_ms`` (also
      ``grpc-timeout`` with ``grpc=True``);
      a budget header already on the request (any letter case) is replaced,
      and its value can only shorten the budget (see ``prazo.bindings.outgoing``);
    * uses the smaller of your ``timeout`` (number or ``(connect, read)``)
      and that budget — requests applies it to connecting and to each read;
    * is not sent when nothing is left (``DeadlineExceeded``, reason
      ``no-budget-for-downstream``);
    * raises ``DownstreamOverloaded`` on a 503 (the response is on
      ``.response``) and ``DeadlineExceeded`` (reason ``deadline-exceeded``)
      on a ``requests.Timeout``.

    ::

        session = DeadlineSession(margin_ms=20)
        with deadline_scope(Deadline.after(2.0)):
            items = session.get("http://b.internal/items", timeout=5).json()

    Outside any deadline scope it is a plain ``requests.Session``.
    """

    def __init__(self, *, margin_ms: float = DEFAULT_MARGIN_MS, grpc: bool = False) -> None:
        self.margin_ms = validate_margin_ms(margin_ms)
        self.grpc = grpc
        super().__init__()

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        budget = outgoing_budget(self.margin_ms, grpc=self.grpc, headers=request.headers)
        if budget is None:
            return super().send(request, **kwargs)
        replace_budget_headers(request.headers, budget)
        kwargs["timeout"] = _capped_requests_timeout(kwargs.get("timeout"), budget)
        url = request.url or ""
        try:
            response = super().send(request, **kwargs)
        except requests.Timeout as exc:
            raise downstream_timed_out(url) from exc
        if response.status_code == 503:
            # Reading the body frees a streamed response's connection and
            # keeps what the dependency said on the exception.
            _ = response.content
            raise DownstreamOverloadedResponse(response, url)
        return response
