"""The seed article's scenario on the core, with real threads.

Forty requests arrive at once at a service with 4 workers and a queue of 20;
each takes 300 ms. The split is exact: 4 start, 20 wait, 16 are refused at
once with ``QueueFull`` (503), and the 24 admitted run in six waves of four,
the last starting ~1.5 s after the first. The first wave holds its 300 ms
until all forty have arrived, so the split never depends on how quickly a
loaded machine (or ASan at -O0) runs forty threads to the queue.

The seed's 2 s budget leaves that last wave 0.5 s, less than a loaded machine
can promise; where the test is the split, not expiry, the budget outlasts the
waves by far (``LONG_BUDGET_MS``). With a 750 ms budget the waves at 0, 300
and 600 ms start, and the one at 900 ms would be too late: its requests are
answered ``DeadlineExceeded`` (504) and never start. Only the lower bound
needs slack for a loaded machine (a wave can drift late and expire, never
start early).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from _helpers import JOIN_TIMEOUT_S, ConcurrencyMeter, QueueClass, assert_conservation, spawn, wait_until
from prazo.core import Deadline, DeadlineExceeded, QueueFull

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

ARRIVALS = 40
MAX_CONCURRENCY = 4
MAX_QUEUE = 20
WORK_S = 0.3
REFUSED_AT_ONCE = ARRIVALS - MAX_CONCURRENCY - MAX_QUEUE
TIGHT_BUDGET_MS = 750
# Far beyond the ~1.8 s the six waves take: nobody may expire, however loaded the machine.
LONG_BUDGET_MS = 20_000


@dataclass
class Answer:
    """How one arrival ended, with the monotonic times that matter."""

    index: int
    outcome: str
    deadline_ns: int
    answered_ns: int
    started_ns: int | None = None


@dataclass
class SeedRun:
    answers: list[Answer]
    ran: set[int]
    stats: dict
    peak_bodies: int

    def outcomes(self) -> Counter:
        return Counter(answer.outcome for answer in self.answers)

    def with_outcome(self, outcome: str) -> list[Answer]:
        return [answer for answer in self.answers if answer.outcome == outcome]


def run_seed_scenario(impl: QueueClass, budget_ms: float) -> SeedRun:
    """Forty simultaneous arrivals, each with ``budget_ms`` from its own arrival."""
    q = impl(MAX_CONCURRENCY, MAX_QUEUE)
    barrier = threading.Barrier(ARRIVALS)
    meter = ConcurrencyMeter()
    ran: set[int] = set()

    def arrive(index: int) -> Answer:
        barrier.wait(JOIN_TIMEOUT_S)
        deadline = Deadline.after_ms(budget_ms)
        try:
            with q.slot(deadline) as slot:
                started_ns = slot.started_ns
                ran.add(index)
                with meter:
                    # The first wave works only once every arrival has its outcome.
                    wait_until(lambda: q.stats()["offered"] == ARRIVALS, "all forty arrivals")
                    time.sleep(WORK_S)
        except QueueFull as exc:
            return Answer(index, exc.reason, deadline.ns, time.monotonic_ns())
        except DeadlineExceeded as exc:
            return Answer(index, exc.reason, deadline.ns, time.monotonic_ns())
        return Answer(index, "completed", deadline.ns, time.monotonic_ns(), started_ns)

    futures = [spawn(arrive, index) for index in range(ARRIVALS)]
    answers = [future.result(JOIN_TIMEOUT_S) for future in futures]
    return SeedRun(answers, ran, q.stats(), meter.peak)


def assert_common_shape(run: SeedRun) -> None:
    """What both budgets share: 16 refused at once, bounded concurrency, a clean end."""
    completed = run.with_outcome("completed")
    first_done_ns = min(answer.answered_ns for answer in completed)
    refused = run.with_outcome("queue-full")
    assert len(refused) == REFUSED_AT_ONCE
    # "At once": every refusal came before the first body had even finished.
    assert all(answer.answered_ns < first_done_ns for answer in refused)
    assert not any(answer.index in run.ran for answer in refused)
    for answer in completed:
        assert answer.started_ns is not None and answer.started_ns < answer.deadline_ns
    assert run.peak_bodies == MAX_CONCURRENCY
    stats = run.stats
    assert_conservation(stats)
    assert stats["offered"] == ARRIVALS
    assert stats["rejected_full"] == REFUSED_AT_ONCE
    assert stats["peak_in_flight"] == MAX_CONCURRENCY
    assert stats["peak_queued"] == MAX_QUEUE
    assert stats["started"] == stats["completed"] == len(completed) == len(run.ran)
    assert (stats["in_flight"], stats["queued"], stats["assigned"]) == (0, 0, 0)


def test_a_budget_beyond_the_waves_sixteen_refused_twenty_four_complete(impl: QueueClass) -> None:
    run = run_seed_scenario(impl, budget_ms=LONG_BUDGET_MS)
    assert run.outcomes() == {"completed": 24, "queue-full": REFUSED_AT_ONCE}
    assert run.stats["expired"] == 0
    assert_common_shape(run)


def test_a_budget_that_runs_out_mid_queue_expires_the_tail_unstarted(impl: QueueClass) -> None:
    run = run_seed_scenario(impl, budget_ms=TIGHT_BUDGET_MS)
    outcomes = run.outcomes()
    assert set(outcomes) <= {"completed", "queue-full", "expired-in-queue"}
    started = outcomes["completed"]
    # Waves start at 0, 300, 600 ms (at best); the 900 ms wave can never make
    # a TIGHT_BUDGET_MS budget, and a loaded machine may push the 600 ms one past it.
    assert 2 * MAX_CONCURRENCY <= started <= 3 * MAX_CONCURRENCY
    expired = run.with_outcome("expired-in-queue")
    assert len(expired) == ARRIVALS - REFUSED_AT_ONCE - started
    assert not any(answer.index in run.ran for answer in expired)
    # Never answered early: each 504 comes at or after its own deadline.
    assert all(answer.answered_ns >= answer.deadline_ns for answer in expired)
    assert run.stats["expired_in_queue"] == len(expired)
    assert run.stats["expired_on_arrival"] == 0
    assert_common_shape(run)
