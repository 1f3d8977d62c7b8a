"""The admission errors: stdlib base classes, HTTP status, reason, pickling."""

from __future__ import annotations

import pickle
import queue

import pytest
from prazo.core import (
    REASON_DEADLINE_EXCEEDED,
    REASON_DOWNSTREAM_OVERLOADED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_NO_BUDGET_FOR_DOWNSTREAM,
    REASON_QUEUE_FULL,
    DeadlineExceeded,
    DownstreamOverloaded,
    QueueFull,
    ShutDown,
)


def test_reason_strings_are_the_documented_wire_values() -> None:
    assert REASON_QUEUE_FULL == "queue-full"
    assert REASON_EXPIRED_ON_ARRIVAL == "expired-on-arrival"
    assert REASON_EXPIRED_IN_QUEUE == "expired-in-queue"
    assert REASON_DEADLINE_EXCEEDED == "deadline-exceeded"
    assert REASON_NO_BUDGET_FOR_DOWNSTREAM == "no-budget-for-downstream"
    assert REASON_DOWNSTREAM_OVERLOADED == "downstream-overloaded"


def test_queue_full_is_a_queue_full_with_status_503() -> None:
    assert issubclass(QueueFull, queue.Full)
    exc = QueueFull()
    assert exc.status == 503
    assert exc.reason == "queue-full"
    assert str(exc) == "queue-full"
    with pytest.raises(queue.Full):
        raise exc


def test_deadline_exceeded_is_a_timeout_error_with_status_504() -> None:
    assert issubclass(DeadlineExceeded, TimeoutError)
    exc = DeadlineExceeded(REASON_EXPIRED_IN_QUEUE)
    assert exc.status == 504
    assert exc.reason == "expired-in-queue"
    assert DeadlineExceeded().reason == "deadline-exceeded"
    with pytest.raises(TimeoutError):
        raise exc


def test_downstream_overloaded_stays_503_and_is_not_a_timeout() -> None:
    assert not issubclass(DownstreamOverloaded, TimeoutError)
    exc = DownstreamOverloaded()
    assert exc.status == 503
    assert exc.reason == "downstream-overloaded"


def test_a_custom_message_keeps_the_reason() -> None:
    exc = DeadlineExceeded(REASON_NO_BUDGET_FOR_DOWNSTREAM, "only 3 ms left for the inventory call")
    assert exc.reason == "no-budget-for-downstream"
    assert str(exc) == "only 3 ms left for the inventory call"


@pytest.mark.parametrize(
    "exc",
    [
        QueueFull(),
        DeadlineExceeded(REASON_EXPIRED_ON_ARRIVAL, "budget was -5 ms"),
        DownstreamOverloaded(REASON_DOWNSTREAM_OVERLOADED, "inventory answered 503"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_pickling_keeps_type_reason_message_and_status(exc: Exception) -> None:
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is type(exc)
    assert clone.reason == exc.reason  # type: ignore[attr-defined]
    assert str(clone) == str(exc)
    assert clone.status == exc.status  # type: ignore[attr-defined]


def test_shutdown_mirrors_the_stdlib_where_it_exists() -> None:
    assert issubclass(ShutDown, Exception)
    stdlib_shutdown = getattr(queue, "ShutDown", None)
    if stdlib_shutdown is not None:
        assert issubclass(ShutDown, stdlib_shutdown)
    assert not issubclass(ShutDown, (queue.Full, TimeoutError))
