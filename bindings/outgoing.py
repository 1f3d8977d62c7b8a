"""Outgoing budget propagation: every hop passes on what is left of its deadline.

Inside a ``deadline_scope`` (the middleware opens one per request), a call to
a dependency should

* carry the *remaining* budget minus a safety margin in ``X-Request-Budget-Ms``
  (relative milliseconds, so no clock synchronisation is needed) — and, on
  request, in ``grpc-timeout``;
* use that same budget as its client timeout (the smaller of it and the
  caller's own timeout);
* not be made at all when nothing is left: ``DeadlineExceeded`` with reason
  ``no-budget-for-downstream``, before any network traffic;
* report a downstream ``503`` as ``DownstreamOverloaded`` (it stays a 503 up
  the chain: overloaded, retry elsewhere) and a timeout as
  ``DeadlineExceeded`` with reason ``deadline-exceeded`` (a 504).

``outgoing_budget()`` computes "remaining minus margin -> (headers, timeout)"
once; a hand-written call uses ``outgoing_headers()``, and each adapter in
``prazo.bindings.clients``, one module per client it wraps, builds on it:

=======================  ===================================  ==========================
``DeadlineSession``      a ``requests.Session``               ``clients.requests``
``DeadlineTransport``    an ``httpx`` transport               ``clients.httpx``
``DeadlinePoolManager``  a ``urllib3.PoolManager``            ``clients.urllib3``
``deadline_urlopen``     ``urllib.request.urlopen``           ``clients.urllib``
=======================  ===================================  ==========================

This module knows none of them (an adapter imports it, never the reverse),
so it needs no third-party client. Outside any deadline scope every adapter
behaves exactly like the client it wraps.

A budget below one millisecond counts as nothing left: the header carries
whole milliseconds and ``0`` would only tell the next hop to answer 504.

Under a deadline prazo owns the budget headers of the request. A budget
header the caller already put on it — ``X-Request-Budget-Ms``,
``grpc-timeout`` or ``x-envoy-expected-rq-timeout-ms``, in any letter case —
is removed, so exactly one of each goes out and a receiver never sees two
values (which it would call invalid, falling back to its default budget).
The caller's smallest valid value still counts: it can shorten the budget
sent and the timeout, never lengthen them. The budget goes out as
``X-Request-Budget-Ms``, and as ``grpc-timeout`` too with ``grpc=True`` or
when the caller had set one.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

from prazo.core import (
    REASON_DEADLINE_EXCEEDED,
    REASON_DOWNSTREAM_OVERLOADED,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    DeadlineExceeded,
    DownstreamOverloaded,
    current_deadline,
)
from prazo.core.arguments import checked_ms

from .headers import (
    BUDGET_HEADER,
    ENVOY_TIMEOUT_HEADER,
    GRPC_TIMEOUT_HEADER,
    budget_from_headers,
    outgoing_headers_for,
)

__all__ = [
    "DEFAULT_MARGIN_MS",
    "DownstreamOverloadedResponse",
    "OutgoingBudget",
    "downstream_timed_out",
    "drop_budget_headers",
    "outgoing_budget",
    "outgoing_headers",
    "replace_budget_headers",
    "validate_margin_ms",
]

# Time kept back for this hop's own work after the downstream answers
# (reading the reply, building its own response).
DEFAULT_MARGIN_MS = 20.0

# The smallest budget worth sending: the wire carries whole milliseconds.
_MIN_BUDGET_MS = 1.0

# Every wire format a receiver reads a budget from (see ``headers``), lower-cased.
_BUDGET_NAMES = frozenset(name.lower() for name in (BUDGET_HEADER, GRPC_TIMEOUT_HEADER, ENVOY_TIMEOUT_HEADER))
_GRPC_NAME = GRPC_TIMEOUT_HEADER.lower()


class OutgoingBudget(NamedTuple):
    """What one downstream call may use: the headers to send and a timeout in seconds."""

    headers: dict[str, str]
    timeout_s: float

    def cap(self, timeout_s: float | None) -> float:
        """The smaller of a caller's timeout (None = no limit) and the budget."""
        return self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)


class DownstreamOverloadedResponse(DownstreamOverloaded):
    """A downstream answered ``503``; ``.response`` is the client library's response object.

    Caught as ``prazo.core.DownstreamOverloaded``; the middleware answers 503,
    never 504, because the dependency was overloaded, not late.
    """

    def __init__(self, response: Any, url: str) -> None:
        super().__init__(REASON_DOWNSTREAM_OVERLOADED, f"{url} answered 503 Service Unavailable")
        self.response = response
        self.url = url

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # The response (sockets, pools) does not pickle; the reason does.
        return (DownstreamOverloaded, (self.reason, str(self)))


def validate_margin_ms(margin_ms: object) -> float:
    """Check a ``margin_ms`` argument: a finite real number >= 0."""
    return checked_ms(margin_ms, "margin_ms")


def outgoing_budget(
    margin_ms: float = DEFAULT_MARGIN_MS, *, grpc: bool = False, headers: Mapping[str, Any] | None = None
) -> OutgoingBudget | None:
    """The budget of one downstream call under the current deadline, or None without one.

    ``headers`` are the request's own (any mapping of name to value): a
    budget header among them can shorten the budget, never lengthen it, and
    a ``grpc-timeout`` among them asks for one in the result (see the module
    docstring; ``replace_budget_headers`` then puts the result on the request).

    Raises ``DeadlineExceeded("no-budget-for-downstream")`` when the remaining
    time minus ``margin_ms`` is under one millisecond; the caller must then
    not make the call.
    """
    margin = validate_margin_ms(margin_ms)
    deadline = current_deadline()
    if deadline is None:
        return None
    budget_ms = deadline.remaining_ms() - margin
    if headers:
        # The receiver's own rules (case-insensitive, smallest valid value
        # wins, repeated fields are invalid) judge what the caller set.
        callers = budget_from_headers(headers).budget_ms
        if callers is not None and callers < budget_ms:
            budget_ms = callers
        grpc = grpc or any(isinstance(name, str) and name.lower() == _GRPC_NAME for name in headers)
    if budget_ms < _MIN_BUDGET_MS:
        raise DeadlineExceeded(
            REASON_NO_BUDGET_FOR_DOWNSTREAM,
            f"no budget left for a downstream call ({budget_ms:.1f} ms after a {margin:g} ms margin)",
        )
    return OutgoingBudget(outgoing_headers_for(budget_ms, grpc=grpc), budget_ms / 1000.0)


def drop_budget_headers(headers: MutableMapping[str, Any]) -> None:
    """Remove every budget header from a request's ``headers``, whatever its letter case.

    Names are matched case-insensitively whatever the mapping (a plain
    ``dict`` too).
    """
    for name in [name for name in headers if isinstance(name, str) and name.lower() in _BUDGET_NAMES]:
        del headers[name]


def replace_budget_headers(headers: MutableMapping[str, Any], budget: OutgoingBudget) -> None:
    """Put ``budget``'s headers on a request's ``headers`` in place of any budget header already there.

    Exactly one of each budget header is left, the ones prazo sends.
    """
    drop_budget_headers(headers)
    headers.update(budget.headers)


def outgoing_headers(margin_ms: float = DEFAULT_MARGIN_MS, *, grpc: bool = False) -> dict[str, str]:
    """The headers passing the remaining budget (minus ``margin_ms``) downstream.

    ``{}`` outside any deadline scope; ``DeadlineExceeded`` (reason
    ``no-budget-for-downstream``) when nothing is left, so a hand-written
    call is never made::

        with deadline_scope(Deadline.after(2.0)):
            requests.get(url, headers=outgoing_headers(), timeout=...)
    """
    budget = outgoing_budget(margin_ms, grpc=grpc)
    return {} if budget is None else budget.headers


def downstream_timed_out(url: str) -> DeadlineExceeded:
    """The error for a client timeout under a deadline (raise it ``from`` the client's)."""
    return DeadlineExceeded(REASON_DEADLINE_EXCEEDED, f"{url} did not answer within the deadline")
