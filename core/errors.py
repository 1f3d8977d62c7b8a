"""The two ways admission says no, each carrying an HTTP status and a reason.

``QueueFull`` means "overloaded, try elsewhere" (503); ``DeadlineExceeded``
means "the caller's time ran out" (504). They subclass the stdlib exceptions a
caller would already catch (``queue.Full``, ``TimeoutError``) so prazo can be
dropped in where a bounded ``queue.Queue`` or a timeout was used before.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class Reason(NamedTuple):
    """One reason prazo refuses or cuts short a request, as every wire says it.

    ``name`` is the ``reason`` of the exception, the ``X-Prazo-Reason`` header
    and the ``x-prazo-reason`` gRPC trailer; ``status`` the HTTP status it is
    answered with; ``grpc_code`` the name of the ``grpc.StatusCode`` the gRPC
    server answers it with, or None where no RPC can meet it (the front door's
    answers to a malformed or late request head).
    """

    name: str
    status: int
    grpc_code: str | None


REASON_QUEUE_FULL = "queue-full"
REASON_EXPIRED_ON_ARRIVAL = "expired-on-arrival"
REASON_EXPIRED_IN_QUEUE = "expired-in-queue"
REASON_DEADLINE_EXCEEDED = "deadline-exceeded"
REASON_NO_BUDGET_FOR_DOWNSTREAM = "no-budget-for-downstream"
REASON_DOWNSTREAM_OVERLOADED = "downstream-overloaded"
# A caller's adaptive throttle refused an attempt itself (prazo.bindings.retries.throttle): a 503.
REASON_THROTTLED_LOCALLY = "throttled-locally"
# ShutDown has no reason of its own (it mirrors queue.ShutDown); this is the one its 503 carries.
REASON_SHUTTING_DOWN = "shutting-down"
# The queue policies (docs/design.md): a doomed entry, whose remaining budget is
# shorter than the expected service time, is a 504; a shed one a 503.
REASON_INSUFFICIENT_BUDGET = "insufficient-budget"
REASON_SHED = "shed-standing-queue"
# A normal waiter pushed out of a full line by a critical arrival: a 503.
REASON_EVICTED = "evicted-by-critical"
# A Dependency's refusals (prazo.bindings.dependency): DependencyUnavailable, a DownstreamOverloaded.
REASON_BULKHEAD_FULL = "bulkhead-full"
REASON_BREAKER_OPEN = "breaker-open"
REASON_DEPENDENCY_TIMEOUT = "dependency-timeout"
REASON_DEPENDENCY_UNAVAILABLE = "dependency-unavailable"
# The front door's answers to a request head: not complete within the header
# timeout (408), malformed or ambiguous (400), too large (431).
REASON_HEADER_TIMEOUT = "header-timeout"
REASON_BAD_REQUEST = "bad-request"
REASON_HEAD_TOO_LARGE = "head-too-large"

# Every reason prazo itself gives, by name. The docs' table of statuses and reasons
# is built from it (docs/_ext/prazo_reference.py), and the front door's C engine
# spells its own the same (tests/docs/test_reasons.py).
REASONS: Mapping[str, Reason] = MappingProxyType(
    {
        reason.name: reason
        for reason in (
            Reason(REASON_QUEUE_FULL, 503, "RESOURCE_EXHAUSTED"),
            Reason(REASON_EXPIRED_ON_ARRIVAL, 504, "DEADLINE_EXCEEDED"),
            Reason(REASON_EXPIRED_IN_QUEUE, 504, "DEADLINE_EXCEEDED"),
            Reason(REASON_DEADLINE_EXCEEDED, 504, "DEADLINE_EXCEEDED"),
            Reason(REASON_NO_BUDGET_FOR_DOWNSTREAM, 504, "DEADLINE_EXCEEDED"),
            Reason(REASON_DOWNSTREAM_OVERLOADED, 503, "UNAVAILABLE"),
            Reason(REASON_THROTTLED_LOCALLY, 503, "UNAVAILABLE"),
            Reason(REASON_SHUTTING_DOWN, 503, "UNAVAILABLE"),
            Reason(REASON_BULKHEAD_FULL, 503, "UNAVAILABLE"),
            Reason(REASON_BREAKER_OPEN, 503, "UNAVAILABLE"),
            Reason(REASON_DEPENDENCY_TIMEOUT, 503, "UNAVAILABLE"),
            Reason(REASON_DEPENDENCY_UNAVAILABLE, 503, "UNAVAILABLE"),
            Reason(REASON_INSUFFICIENT_BUDGET, 504, "DEADLINE_EXCEEDED"),
            Reason(REASON_SHED, 503, "RESOURCE_EXHAUSTED"),
            Reason(REASON_EVICTED, 503, "RESOURCE_EXHAUSTED"),
            Reason(REASON_HEADER_TIMEOUT, 408, None),
            Reason(REASON_BAD_REQUEST, 400, None),
            Reason(REASON_HEAD_TOO_LARGE, 431, None),
        )
    }
)


class QueueFull(queue.Full):
    """Admission refused at once: every slot is busy and the queue is full.

    ``status`` is 503 (retry elsewhere or later); ``reason`` names the cause.
    """

    status = 503

    def __init__(self, reason: str = REASON_QUEUE_FULL, message: str | None = None) -> None:
        self.reason = reason
        super().__init__(message or reason)

    def __reduce__(
        self,
    ) -> tuple[type[QueueFull], tuple[str, str]]:  # keep reason across pickling (process pools, logging)
        return (type(self), (self.reason, str(self)))


class DeadlineExceeded(TimeoutError):
    """The deadline passed before the work could start or finish.

    ``status`` is 504; ``reason`` says where it was detected
    (``expired-on-arrival``, ``expired-in-queue``, ``deadline-exceeded``,
    ``no-budget-for-downstream``, ...).
    """

    status = 504

    def __init__(self, reason: str = REASON_DEADLINE_EXCEEDED, message: str | None = None) -> None:
        self.reason = reason
        super().__init__(message or reason)

    def __reduce__(self) -> tuple[type[DeadlineExceeded], tuple[str, str]]:
        return (type(self), (self.reason, str(self)))


class DownstreamOverloaded(Exception):
    """A dependency answered 503: it is overloaded, not late.

    ``status`` stays 503 all the way up the chain, so callers retry elsewhere
    instead of treating it as a missed deadline (504).
    """

    status = 503

    def __init__(self, reason: str = REASON_DOWNSTREAM_OVERLOADED, message: str | None = None) -> None:
        self.reason = reason
        super().__init__(message or reason)

    def __reduce__(self) -> tuple[type[DownstreamOverloaded], tuple[str, str]]:
        return (type(self), (self.reason, str(self)))


_StdShutDown: type[Exception] = getattr(queue, "ShutDown", Exception)


class ShutDown(_StdShutDown):  # type: ignore[misc,valid-type]
    """Raised by ``put``/``get``/``acquire`` once the queue has been shut down.

    A subclass of ``queue.ShutDown`` on Python 3.13+, which it mirrors.
    """
