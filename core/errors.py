"""The two ways admission says no, each carrying an HTTP status and a reason.

``QueueFull`` means "overloaded, try elsewhere" (503); ``DeadlineExceeded``
means "the caller's time ran out" (504). They subclass the stdlib exceptions a
caller would already catch (``queue.Full``, ``TimeoutError``) so prazo can be
dropped in where a bounded ``queue.Queue`` or a timeout was used before.
"""

from __future__ import annotations

import queue

__all__ = [
    "REASON_DEADLINE_EXCEEDED",
    "REASON_DOWNSTREAM_OVERLOADED",
    "REASON_EVICTED",
    "REASON_EXPIRED_IN_QUEUE",
    "REASON_EXPIRED_ON_ARRIVAL",
    "REASON_INSUFFICIENT_BUDGET",
    "REASON_NO_BUDGET_FOR_DOWNSTREAM",
    "REASON_QUEUE_FULL",
    "REASON_SHED",
    "DeadlineExceeded",
    "DownstreamOverloaded",
    "QueueFull",
    "ShutDown",
]

REASON_QUEUE_FULL = "queue-full"
REASON_EXPIRED_ON_ARRIVAL = "expired-on-arrival"
REASON_EXPIRED_IN_QUEUE = "expired-in-queue"
REASON_DEADLINE_EXCEEDED = "deadline-exceeded"
REASON_NO_BUDGET_FOR_DOWNSTREAM = "no-budget-for-downstream"
REASON_DOWNSTREAM_OVERLOADED = "downstream-overloaded"
# The queue policies (docs/design.md): a doomed entry, whose remaining budget is
# shorter than the expected service time, is a 504; a shed one a 503.
REASON_INSUFFICIENT_BUDGET = "insufficient-budget"
REASON_SHED = "shed-standing-queue"
# A normal waiter pushed out of a full line by a critical arrival: a 503.
REASON_EVICTED = "evicted-by-critical"


class QueueFull(queue.Full):
    """Admission refused at once: every slot is busy and the queue is full.

    ``status`` is 503 (retry elsewhere or later); ``reason`` names the cause.
    """

    status = 503

    def __init__(self, reason: str = REASON_QUEUE_FULL, message: str | None = None) -> None:
        self.reason = reason
        super().__init__(message or reason)

    def __reduce__(self):  # keep reason across pickling (process pools, logging)
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

    def __reduce__(self):
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

    def __reduce__(self):
        return (type(self), (self.reason, str(self)))


_StdShutDown: type[Exception] = getattr(queue, "ShutDown", Exception)


class ShutDown(_StdShutDown):  # type: ignore[misc,valid-type]
    """Raised by ``put``/``get``/``acquire`` once the queue has been shut down.

    A subclass of ``queue.ShutDown`` on Python 3.13+, which it mirrors.
    """
