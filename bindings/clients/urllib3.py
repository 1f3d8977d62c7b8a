"""``DeadlinePoolManager``: a ``urllib3.PoolManager`` that passes the budget downstream.

Built on ``prazo.bindings.outgoing``; needs ``urllib3`` (the
``clients`` extra).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from urllib3 import HTTPHeaderDict, PoolManager
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError
from urllib3.exceptions import TimeoutError as Urllib3TimeoutError
from urllib3.response import BaseHTTPResponse
from urllib3.util import Retry, Timeout

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

__all__ = ["DeadlinePoolManager", "capped_urllib3_timeout"]

# Under a deadline each hop is sent once: urllib3 gives every retry the full
# timeout again, so a retry after a timeout would spend time the caller no
# longer has (and resend work downstream). Redirects are still followed.
_SEND_ONCE = Retry(total=None, connect=0, read=0, other=0, status=0, redirect=3)


# Set while an attempt runs: PoolManager follows a redirect by calling
# urlopen again (with its Retry), and that hop belongs to the same attempt.
_in_attempt: ContextVar[bool] = ContextVar("prazo.clients.urllib3.in_attempt", default=False)


def capped_urllib3_timeout(timeout: Any, budget: OutgoingBudget) -> Timeout:
    """A ``urllib3.Timeout`` no longer than the budget, in total and per phase.

    ``timeout`` is what urllib3 (or requests) accepts: None, a number (for
    connect and read each), or a ``Timeout``.
    """
    if isinstance(timeout, Timeout):
        capped = timeout.clone()
        total = capped.total if isinstance(capped.total, (int, float)) else None
        capped.total = budget.cap(total)
        return capped
    if timeout is None or timeout is Timeout.DEFAULT_TIMEOUT:
        return Timeout(total=budget.timeout_s)
    per_phase = budget.cap(timeout)
    return Timeout(total=budget.timeout_s, connect=per_phase, read=per_phase)


class DeadlinePoolManager(PoolManager):
    """A ``PoolManager`` whose requests carry the remaining budget and stop at the deadline.

    Under a ``deadline_scope`` every request (and every redirect hop, with
    what is left by then):

    * sends ``X-Request-Budget-Ms`` (remaining minus ``margin_ms``; also
      ``grpc-timeout`` with ``grpc=True``);
      a budget header already on the request (any letter case) is replaced,
      and its value can only shorten the budget (see ``prazo.bindings.outgoing``);
    * has a ``Timeout`` whose total is at most that budget;
    * is not sent when nothing is left (``DeadlineExceeded``, reason
      ``no-budget-for-downstream``);
    * is sent once unless you pass ``retries=`` (see below);
    * raises ``DownstreamOverloaded`` on a 503 (``.response`` holds it,
      body read) and ``DeadlineExceeded`` on a timeout.

    ::

        http = DeadlinePoolManager(margin_ms=20)
        with deadline_scope(Deadline.after(2.0)):
            response = http.request("GET", "http://b.internal/items")

    Outside any deadline scope it is a plain ``PoolManager``. Retries: urllib3
    restarts every retry with the full timeout, so under a deadline the
    default becomes "no resend, follow up to 3 redirects"; a ``retries``
    given to the manager or to the call is kept as given.

    ``retry=RetryPolicy(...)`` is the replacement for urllib3's ``Retry``:
    it retries what is safe (see ``prazo.bindings.retries``) within the
    deadline and the destination's retry budget, each attempt with what is
    left of the budget; a POST or PATCH only with ``idempotent=True`` on the
    call, a streamed body never. urllib3's own retries then stay off (each
    attempt is sent once, redirects followed): passing ``retries`` as well
    is a ``ValueError``.
    """

    def __init__(
        self,
        num_pools: int = 10,
        headers: Any | None = None,
        *,
        margin_ms: float = DEFAULT_MARGIN_MS,
        grpc: bool = False,
        retry: RetryPolicy | None = None,
        **connection_pool_kw: Any,
    ) -> None:
        self.margin_ms = validate_margin_ms(margin_ms)
        self.grpc = grpc
        if retry is not None:
            if not isinstance(retry, RetryPolicy):
                raise TypeError(f"retry must be a prazo RetryPolicy or None, not {type(retry).__name__}")
            if "retries" in connection_pool_kw:
                raise ValueError("retries must not be given with retry=: a RetryPolicy replaces urllib3's Retry")
        self.retry = retry
        super().__init__(num_pools, headers, **connection_pool_kw)

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> BaseHTTPResponse:  # type: ignore[override]
        policy = self.retry
        idempotent = kw.pop("idempotent", None)
        if policy is None or _in_attempt.get():
            return self._urlopen_once(method, url, redirect, **kw)
        if "retries" in kw:
            raise ValueError("retries must not be given with retry=: a RetryPolicy replaces urllib3's Retry")
        kw["retries"] = _SEND_ONCE
        retryable_reasons = policy.retryable_reasons

        def attempt(number: int) -> BaseHTTPResponse:
            token = _in_attempt.set(True)
            try:
                return self._urlopen_once(method, policy.url_for_attempt(url, number), redirect, **kw)
            finally:
                _in_attempt.reset(token)

        def classify(exc: BaseException) -> Failure | None:
            failure = response_failure(exc, retryable_reasons=retryable_reasons)
            if failure is not None:
                return failure
            # Sent once, a failure to connect or to read the response head
            # comes wrapped in MaxRetryError; a ProtocolError raised as it is
            # broke in the body, after the response started.
            if isinstance(exc, MaxRetryError) and isinstance(exc.reason, (NewConnectionError, ProtocolError)):
                return connection_failure(exc)
            return None

        def judge(response: BaseHTTPResponse) -> Failure | None:
            if response.status != 503:
                return returned_failure(response.status, response.headers)
            response.read()
            response.release_conn()
            return response_failure(DownstreamOverloadedResponse(response, url), retryable_reasons=retryable_reasons)

        return policy.call(
            attempt,
            classify,
            destination=policy.destination_of(url),
            idempotent=idempotent_request(method, idempotent),
            replayable=replayable_body(kw.get("body")),
            judge=judge,
        )

    def _urlopen_once(self, method: str, url: str, redirect: bool, **kw: Any) -> BaseHTTPResponse:
        # A copy: the caller's mapping (or the manager's own headers) stays as it was.
        headers = HTTPHeaderDict(kw.get("headers") or self.headers)
        budget = outgoing_budget(self.margin_ms, grpc=self.grpc, headers=headers)
        if budget is None:
            return super().urlopen(method, url, redirect, **kw)
        replace_budget_headers(headers, budget)
        kw["headers"] = headers
        kw["timeout"] = capped_urllib3_timeout(kw.get("timeout", self.connection_pool_kw.get("timeout")), budget)
        if "retries" not in kw and "retries" not in self.connection_pool_kw:
            kw["retries"] = _SEND_ONCE
        try:
            response = super().urlopen(method, url, redirect, **kw)
        except NewConnectionError:
            raise
        except Urllib3TimeoutError as exc:
            raise downstream_timed_out(url) from exc
        except MaxRetryError as exc:
            # urllib3 makes a refused connection a ConnectTimeoutError too; it is no timeout.
            if isinstance(exc.reason, Urllib3TimeoutError) and not isinstance(exc.reason, NewConnectionError):
                raise downstream_timed_out(url) from exc
            raise
        if response.status == 503:
            # Read the body so the connection goes back to the pool and the
            # caller can still inspect what the dependency said.
            response.read()
            response.release_conn()
            raise DownstreamOverloadedResponse(response, url)
        return response
