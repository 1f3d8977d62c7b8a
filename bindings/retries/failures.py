"""What went wrong with one attempt, in the terms a retry decision needs.

``Failure(kind, retry_after_s, reason)``: ``kind`` is one of

* ``"overloaded"``: a 503 (or gRPC ``RESOURCE_EXHAUSTED``/``UNAVAILABLE``)
  that did no work — no ``X-Prazo-Reason``, or one of ``RETRYABLE_REASONS``:
  the destination refused before starting, so another try, better elsewhere,
  may succeed;
* ``"refused"``: the connection was refused, so nothing was sent;
* ``"reset"``: the connection was reset or closed before any byte of the response;
* ``"deadline"``: a 504 / ``DEADLINE_EXCEEDED`` or a client timeout: the
  caller's time is gone, a retry could only be later still;
* ``"other"``: anything else (a 503 after work was done, such as
  ``dependency-timeout``, an application error): never retried.

Each client adapter knows which of its exceptions come before any response
byte and asks ``connection_failure`` only about those.
"""

from __future__ import annotations

import http.client
from typing import Any, NamedTuple

from prazo.bindings.headers import RETRY_AFTER_MS_HEADER_NAME
from prazo.core import (
    REASON_BULKHEAD_FULL,
    REASON_EVICTED,
    REASON_QUEUE_FULL,
    REASON_SHED,
    REASON_SHUTTING_DOWN,
    DeadlineExceeded,
    DownstreamOverloaded,
)

from .retry_after import retry_after_ms_seconds, retry_after_seconds

__all__ = [
    "KINDS",
    "REASON_HEADER",
    "RETRYABLE_KINDS",
    "RETRYABLE_REASONS",
    "RETRY_AFTER_HEADER",
    "Failure",
    "connection_failure",
    "overloaded_failure",
    "response_failure",
    "returned_failure",
]

KINDS = ("overloaded", "refused", "reset", "deadline", "other")
RETRYABLE_KINDS = frozenset(("overloaded", "refused", "reset"))
# 503 reasons that mean "refused before any work": retrying elsewhere adds no
# load to whatever the destination itself calls.
RETRYABLE_REASONS = frozenset(
    (REASON_QUEUE_FULL, REASON_SHUTTING_DOWN, REASON_BULKHEAD_FULL, REASON_SHED, REASON_EVICTED)
)
REASON_HEADER = "X-Prazo-Reason"
RETRY_AFTER_HEADER = "Retry-After"


class Failure(NamedTuple):
    """One failed attempt: its ``kind`` (see the module docstring), the wait it asked for, and its reason."""

    kind: str
    retry_after_s: float | None = None
    reason: str | None = None


def _header(headers: Any, name: str) -> Any:
    if headers is None:
        return None
    getter = getattr(headers, "get", None)
    return getter(name) if callable(getter) else None


def overloaded_failure(
    reason: str | None, retry_after: object, *, retryable_reasons: frozenset[str], retry_after_ms: object = None
) -> Failure:
    """A 503's ``Failure``: ``"overloaded"`` when its reason says no work was done, else ``"other"``.

    The wait is ``retry_after_ms`` (a prazo server's measured wait in ms)
    when it is a whole number of ms, else the ``Retry-After`` value.
    """
    if isinstance(reason, bytes):
        reason = reason.decode("latin-1")
    reason = reason.strip() if isinstance(reason, str) and reason.strip() else None
    kind = "overloaded" if reason is None or reason in retryable_reasons else "other"
    wait_s = retry_after_ms_seconds(retry_after_ms)
    return Failure(kind, retry_after_seconds(retry_after) if wait_s is None else wait_s, reason)


def _walk(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and what urllib-style errors keep on ``.reason``, without loops."""
    seen: list[BaseException] = []
    pending: list[Any] = [exc]
    while pending and len(seen) < 32:
        current = pending.pop()
        if not isinstance(current, BaseException) or any(current is known for known in seen):
            continue
        seen.append(current)
        pending.extend((current.__cause__, current.__context__, getattr(current, "reason", None)))
        pending.extend(arg for arg in current.args if isinstance(arg, BaseException))
    return seen


def connection_failure(exc: BaseException) -> Failure | None:
    """``"refused"`` or ``"reset"`` when ``exc`` (or what caused it) is one; None otherwise.

    Only for exceptions raised before any byte of the response was read: the
    adapter, which knows its client's exceptions, decides that.
    """
    chain = _walk(exc)
    if any(isinstance(error, ConnectionRefusedError) for error in chain):
        return Failure("refused")
    if any(
        isinstance(error, (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)) for error in chain
    ):
        return Failure("reset")
    return None


def returned_failure(status: int, headers: Any) -> Failure | None:
    """The ``Failure`` of a response an adapter returns as it is (not a 503): a 504 is ``"deadline"``; else None.

    Without it a returned 504 would look like a success to the policy: its time
    taken for a successful attempt's, and no rule's refusal counted in
    ``not_retried`` (rule 1 is "never a 504").
    """
    if status != 504:
        return None
    return Failure("deadline", None, _header(headers, REASON_HEADER))


def response_failure(exc: BaseException, *, retryable_reasons: frozenset[str]) -> Failure | None:
    """The ``Failure`` of a prazo error an adapter raised: a 503 (with its response) or a 504; else None."""
    if isinstance(exc, DeadlineExceeded):
        return Failure("deadline", None, exc.reason)
    if isinstance(exc, DownstreamOverloaded):
        headers = getattr(getattr(exc, "response", None), "headers", None)
        if headers is None:
            return Failure("overloaded", None, None)
        return overloaded_failure(
            _header(headers, REASON_HEADER),
            _header(headers, RETRY_AFTER_HEADER),
            retryable_reasons=retryable_reasons,
            retry_after_ms=_header(headers, RETRY_AFTER_MS_HEADER_NAME),
        )
    return None
