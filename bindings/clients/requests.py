"""``DeadlineSession``: a ``requests.Session`` that passes the budget downstream.

Built on ``prazo.bindings.outgoing``; needs ``requests`` (the
``clients`` extra).
"""

from __future__ import annotations

from contextvars import ContextVar
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
from ..retries import (
    Failure,
    RetryPolicy,
    connection_failure,
    idempotent_request,
    replayable_body,
    response_failure,
    returned_failure,
)
from .urllib3 import capped_urllib3_timeout

__all__ = ["DeadlineSession"]

# The ``idempotent=`` of the request() call being sent, for send() to read:
# requests gives send() the prepared request only.
_idempotent: ContextVar[bool | None] = ContextVar("prazo.clients.requests.idempotent", default=None)


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

    ``retry=RetryPolicy(...)`` retries what is safe to retry (see
    ``prazo.bindings.retries``): a 503 that did no work, a refused
    connection, a reset before the response, within the deadline and the
    destination's retry budget; each attempt carries what is left of the
    budget. A POST or PATCH is retried only with ``idempotent=True`` on the
    call (``session.post(url, json=..., idempotent=True)``), a streamed body
    never. It replaces urllib3's ``Retry``: leave the transport adapter's
    ``max_retries`` at its default of 0.
    """

    def __init__(
        self, *, margin_ms: float = DEFAULT_MARGIN_MS, grpc: bool = False, retry: RetryPolicy | None = None
    ) -> None:
        self.margin_ms = validate_margin_ms(margin_ms)
        self.grpc = grpc
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a prazo RetryPolicy or None, not {type(retry).__name__}")
        self.retry = retry
        super().__init__()

    def request(self, method: str, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        """``requests.Session.request``, plus ``idempotent=`` (None: the method decides) for ``retry``."""
        idempotent = kwargs.pop("idempotent", None)
        if idempotent is not None and not isinstance(idempotent, bool):
            raise TypeError(f"idempotent must be a bool or None, not {type(idempotent).__name__}")
        token = _idempotent.set(idempotent)
        try:
            return super().request(method, url, *args, **kwargs)
        finally:
            _idempotent.reset(token)

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        policy = self.retry
        if policy is None:
            return self._send_once(request, **kwargs)
        url = request.url or ""
        retryable_reasons = policy.retryable_reasons

        def attempt(number: int) -> requests.Response:
            prepared = request.copy()
            prepared.url = policy.url_for_attempt(url, number)
            return self._send_once(prepared, **kwargs)

        def classify(exc: BaseException) -> Failure | None:
            failure = response_failure(exc, retryable_reasons=retryable_reasons)
            if failure is not None:
                return failure
            # Raised while connecting or before the status line; a reset in
            # the body is a ChunkedEncodingError, never retried.
            if isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.Timeout):
                return connection_failure(exc)
            return None

        def judge(response: requests.Response) -> Failure | None:
            # Outside a deadline a 503 comes back as a response, not an exception.
            if response.status_code != 503:
                return returned_failure(response.status_code, response.headers)
            _ = response.content
            return response_failure(DownstreamOverloadedResponse(response, url), retryable_reasons=retryable_reasons)

        return policy.call(
            attempt,
            classify,
            destination=policy.destination_of(url),
            idempotent=idempotent_request(request.method or "GET", _idempotent.get()),
            replayable=replayable_body(request.body),
            judge=judge,
        )

    def _send_once(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
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
