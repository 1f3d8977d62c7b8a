"""``DeadlinePoolManager``: a ``urllib3.PoolManager`` that passes the budget downstream.

Built on ``prazo.bindings.outgoing``; needs ``urllib3`` (the
``clients`` extra).
"""

from __future__ import annotations

from typing import Any

from urllib3 import HTTPHeaderDict, PoolManager
from urllib3.exceptions import MaxRetryError
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

__all__ = ["DeadlinePoolManager", "capped_urllib3_timeout"]

# Under a deadline each hop is sent once: urllib3 gives every retry the full
# timeout again, so a retry after a timeout would spend time the caller no
# longer has (and resend work downstream). Redirects are still followed.
_SEND_ONCE = Retry(total=None, connect=0, read=0, other=0, status=0, redirect=3)


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
    """

    def __init__(
        self,
        num_pools: int = 10,
        headers: Any | None = None,
        *,
        margin_ms: float = DEFAULT_MARGIN_MS,
        grpc: bool = False,
        **connection_pool_kw: Any,
    ) -> None:
        self.margin_ms = validate_margin_ms(margin_ms)
        self.grpc = grpc
        super().__init__(num_pools, headers, **connection_pool_kw)

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> BaseHTTPResponse:  # type: ignore[override]
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
        except Urllib3TimeoutError as exc:
            raise downstream_timed_out(url) from exc
        except MaxRetryError as exc:
            if isinstance(exc.reason, Urllib3TimeoutError):
                raise downstream_timed_out(url) from exc
            raise
        if response.status == 503:
            # Read the body so the connection goes back to the pool and the
            # caller can still inspect what the dependency said.
            response.read()
            response.release_conn()
            raise DownstreamOverloadedResponse(response, url)
        return response
