"""``AdmissionPool(observe_only=True)``: every task runs, as in a ThreadPoolExecutor; the counters say what it would have refused.

Real threads: one worker and one place in line, five tasks held on an event:
enforcing, one would run, one would wait and three would raise ``QueueFull``
from ``submit``. Observing, ``submit`` never raises, all five run in
submission order, and ``stats()`` (the shadow line's counters) has the three
refusals. A task whose deadline has passed still runs, counted
``expired_on_arrival``.
"""

from __future__ import annotations

import threading

import pytest
from _helpers import wait_until
from prazo.bindings.pool import AdmissionPool
from prazo.core import Deadline, current_deadline

WAIT_S = 10.0


def test_an_observing_pool_runs_every_task_and_counts_what_it_would_have_refused() -> None:
    pool = AdmissionPool(1, 1, observe_only=True)
    gate = threading.Event()
    ran: list[int] = []
    try:
        futures = [pool.submit(lambda n=n: (gate.wait(WAIT_S), ran.append(n))) for n in range(5)]
        wait_until(lambda: pool.stats()["offered"] == 5, "the shadow to decide the five")
        stats = pool.stats()
        assert (stats["observe_only"], stats["started"], stats["queued"], stats["rejected_full"]) == (1, 1, 1, 3)
        gate.set()
        for future in futures:
            future.result(WAIT_S)
        assert ran == [0, 1, 2, 3, 4], "in submission order, as a ThreadPoolExecutor"
    finally:
        gate.set()
        pool.shutdown(wait=True)


def test_a_task_past_its_deadline_still_runs_inside_it_and_is_counted_expired() -> None:
    pool = AdmissionPool(2, 2, observe_only=True)
    try:
        spent = Deadline.after_ms(-5)
        future = pool.submit_until(spent, current_deadline)
        assert future.result(WAIT_S) == spent, "it runs, in its own deadline's scope"
        wait_until(lambda: pool.stats()["expired_on_arrival"] == 1, "the shadow to count the expiry")
    finally:
        pool.shutdown(wait=True)


def test_observe_only_is_a_bool() -> None:
    with pytest.raises(TypeError, match="observe_only"):
        AdmissionPool(1, 1, observe_only=1)  # type: ignore[arg-type]
