"""Both twins in lockstep on one fake clock, checked against a model after every step.

A Hypothesis ``RuleBasedStateMachine`` puts work items (normal or critical)
with random relative deadlines (already passed, short, long, none), takes
them with ``get(block=False)``, finishes them (with or without a service-time
sample), moves the clock, sweeps with ``expire_overdue``, makes non-blocking
gate arrivals, serves bursts that feed the learned estimate and the Vegas
limit, and sometimes shuts the queue down. Every step is applied to the C twin
and the Python twin and to a small model of the slots and the waiting line;
after every step the invariants of docs/design.md hold, under every policy and
their combinations:

1. no item is returned by ``get`` at a time >= its deadline (nor its
   effective deadline, ``deadline - expected service``, under the doomed-work skip);
2. ``0 <= in_flight <= max_concurrency`` and ``0 <= queued <= max_queue``;
3. conservation: ``offered == started + rejected_full + expired + insufficient_budget
   + shed + evicted + cancelled + queued + assigned``;
4. work conservation: never a slot free *for an entry's class* (under the
   current limit, outside the reserved share for a normal entry while the
   critical class is active) while that entry waits;
5. start order per policy: critical entries first (FIFO among them), then
   the normal ones FIFO, LIFO, or as CoDel decides for ``order="adaptive"``
   (LIFO while the line is standing); the model serves its line the same
   way, and every returned item must be the model's;
6. both twins give the same outcome, the same ``on_expired`` / ``on_dropped``
   reports and the same ``stats()`` (the Vegas ``limit`` and the expected
   service time included) for every step.

Every run draws ``reserved`` slots (0 included), so each configuration below
also runs with critical arrivals and evictions; the configurations combine
the orders with the doomed-work skip (fixed and learned) and the Vegas limit.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from _helpers import COUNTER_NAMES, FakeClock, QueueClass, assert_conservation, examples
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from prazo.core import (
    NS_PER_MS,
    REASON_EVICTED,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_INSUFFICIENT_BUDGET,
    REASON_QUEUE_FULL,
    REASON_SHED,
    Deadline,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
)
from prazo.core._histogram_py import bucket_bounds, bucket_index
from prazo.core._policy_py import Vegas
from prazo.core._queue_py import NO_DEADLINE_NS, AdmissionQueue

# Its subject is a compiled path: `make sanitize` runs it (`-m compiled`).
pytestmark = pytest.mark.compiled

# What a step answered: ("returned", value) or ("raised", exception name, reason).
Outcome = tuple[Any, ...]

# Relative budgets in ms: zero and negatives are already passed on arrival.
# Budgets and clock steps share a coarse grid so that "now == deadline", the
# edge where off-by-one bugs live, happens often.
GRID_MS = (1, 5, 10, 20)
BUDGETS_MS = st.one_of(st.none(), st.sampled_from((-5, 0, *GRID_MS)), st.integers(min_value=-5, max_value=60))
CLOCK_STEPS_MS = st.one_of(st.sampled_from(GRID_MS), st.integers(min_value=0, max_value=40))

# Service times reported on release (ms): around the grid, so the learned
# estimate moves through the budgets in play.
SERVICE_MS = st.one_of(st.none(), st.sampled_from(GRID_MS), st.integers(min_value=0, max_value=30))

# CoDel target and interval for order="adaptive", on the grid: both the
# standing (LIFO, shed beyond the target) and the draining state happen.
CODEL_MS = (5, 20)

# Shutdown is terminal, so it is only allowed late in a run.
SHUTDOWN_AFTER_STEPS = 30

# Why an entry left the line without a slot -> its counter.
DROP_COUNTERS = {
    REASON_EXPIRED_IN_QUEUE: "expired_in_queue",
    REASON_INSUFFICIENT_BUDGET: "insufficient_budget",
    REASON_SHED: "shed",
    REASON_EVICTED: "evicted",
}


def returned(value: Any) -> Outcome:
    return ("returned", value)


def raised(error: type, reason: str | None = None) -> Outcome:
    return ("raised", error.__name__, reason)


def outcome_of(call: Callable[[], Any]) -> Outcome:
    """Run one operation and describe its result the way the model does."""
    try:
        return returned(call())
    except (QueueFull, DeadlineExceeded) as exc:
        return raised(type(exc), exc.reason)
    except (ShutDown, queue.Empty, ValueError) as exc:
        return raised(type(exc))


class StepRefused(Exception):
    """The model's answer for a step that raises instead of returning."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome)
        self.outcome = outcome


@dataclass
class Entry:
    item: int
    deadline_ns: int
    enqueued_ns: int
    critical: bool = False


@dataclass
class Held:
    """A slot the machine holds: its class and when it started."""

    critical: bool
    started_ns: int


class ServiceModel:
    """The expected service time of docs/design.md, from the whole list of samples.

    Fixed: the constant. Learned ("pNN"): every 16th sample, once there are
    32, the nearest-rank quantile (at the histogram's bucket precision) of the
    samples since the start of the previous generation of 256.
    """

    def __init__(self, expected_service_ms: float | str | None) -> None:
        self.fixed_ns = round(expected_service_ms * NS_PER_MS) if isinstance(expected_service_ms, float) else 0
        self.permille = {"p50": 500, "p90": 900, "p95": 950, "p99": 990}.get(str(expected_service_ms), 0)
        self.samples: list[int] = []
        self.learned_ns = 0

    @property
    def ns(self) -> int:
        return self.fixed_ns or self.learned_ns

    def sample(self, service_ns: int) -> None:
        if not self.permille:
            return
        self.samples.append(service_ns)
        k = len(self.samples)
        if k % 16 or k < 32:
            return
        in_current = k % 256 or 256
        window = sorted(self.samples[-(in_current + 256) :])
        n = len(window)
        rank = min(max(-(-self.permille * n // 1000), 1), n)
        if rank == n:
            self.learned_ns = window[-1]
        elif rank == 1:
            self.learned_ns = window[0]
        else:
            lo, hi = bucket_bounds(bucket_index(window[rank - 1]))
            self.learned_ns = min(max(lo + (hi - lo) // 2, window[0]), window[-1])


class QueueModel:
    """The admission queue of ``_queue_py``'s docstring, written as plainly as possible.

    Each method returns what the operation returns, or raises
    ``StepRefused`` with the outcome the real queue must raise; work items
    leaving the line without a slot are appended to ``reports`` as
    ``(item, reason)`` in the order the callbacks must see them. The Vegas
    arithmetic itself is ``_policy_py.Vegas`` (tested on its own); the model
    checks that the queue feeds it the right samples and obeys its limit.
    """

    def __init__(
        self,
        max_concurrency: int,
        max_queue: int,
        order: str,
        *,
        expected_service_ms: float | str | None = None,
        codel_ms: tuple[int, int] = (5, 100),
        vegas: bool = False,
        min_concurrency: int = 1,
        reserved: int = 0,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.lifo = order == "lifo"
        self.adaptive = order == "adaptive"
        self.target_ns, self.interval_ns = (ms * NS_PER_MS for ms in codel_ms)
        self.last_empty_ns = 0
        self.service = ServiceModel(expected_service_ms)
        self.vegas = Vegas(min_concurrency, max_concurrency) if vegas else None
        self.limit = self.vegas.limit if self.vegas is not None else max_concurrency
        self.reserved = reserved
        self.critical_in_flight = 0
        self.waiting: list[Entry] = []
        self.ready: list[Entry] = []
        self.shut = False
        self.reports: list[tuple[int, str]] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    def _count(self, name: str, delta: int = 1) -> None:
        self.counters[name] += delta
        for level, peak in (("in_flight", "peak_in_flight"), ("queued", "peak_queued")):
            self.counters[peak] = max(self.counters[peak], self.counters[level])

    @property
    def held(self) -> int:
        """Slots taken by a started gate arrival or an item returned by get."""
        return self.counters["in_flight"] - self.counters["assigned"]

    def may_start(self, critical: bool) -> bool:
        """docs/design.md, priority classes: critical up to the limit; normal below limit - reserved, or up to it while borrowing."""
        in_flight = self.counters["in_flight"]
        if in_flight >= self.limit:
            return False
        critical_active = self.critical_in_flight + sum(entry.critical for entry in self.waiting)
        return critical or critical_active == 0 or in_flight < self.limit - self.reserved

    def would_wait(self, deadline_ns: int, now: int, critical: bool) -> bool:
        """True when a gate arrival now would block (so the machine must not make it)."""
        try:
            return not copy.deepcopy(self)._admit(deadline_ns, now, critical)
        except StepRefused:
            return False

    def dropped_as(self, entry: Entry, now: int) -> str | None:
        """Why ``entry`` must not start at ``now`` (its reason), or None: it may."""
        if now >= entry.deadline_ns:
            return REASON_EXPIRED_IN_QUEUE
        if self.service.ns and now >= entry.deadline_ns - self.service.ns:
            return REASON_INSUFFICIENT_BUDGET
        return None

    def _drop(self, entry: Entry, reason: str) -> None:
        self._count(DROP_COUNTERS[reason])
        self.reports.append((entry.item, reason))

    def _leave(self, entry: Entry) -> None:
        self.waiting.remove(entry)
        self._count("queued", -1)

    def standing(self, now: int) -> bool:
        return now - self.last_empty_ns > self.interval_ns

    def _shed_stale(self, now: int) -> None:
        """CoDel, from the old end and whatever the class: stale entries leave (a 504 stays a 504)."""
        limit = self.target_ns if self.standing(now) else self.interval_ns
        while self.waiting and now - self.waiting[0].enqueued_ns > limit:
            entry = self.waiting[0]
            self._leave(entry)
            self._drop(entry, self.dropped_as(entry, now) or REASON_SHED)

    def _admit(self, deadline_ns: int, now: int, critical: bool) -> bool:
        if self.shut:
            raise StepRefused(raised(ShutDown))
        if self.adaptive and not self.waiting:
            self.last_empty_ns = now
        self._count("offered")
        if now >= deadline_ns:
            self._count("expired_on_arrival")
            raise StepRefused(raised(DeadlineExceeded, REASON_EXPIRED_ON_ARRIVAL))
        if self.service.ns and now >= deadline_ns - self.service.ns:
            self._count("insufficient_budget")
            raise StepRefused(raised(DeadlineExceeded, REASON_INSUFFICIENT_BUDGET))
        if self.may_start(critical):
            self._count("in_flight")
            self.critical_in_flight += critical
            return True
        if self.adaptive and self.counters["queued"] >= self.max_queue:
            self._shed_stale(now)
        if self.counters["queued"] >= self.max_queue:
            normal = [entry for entry in self.waiting if not entry.critical]
            if not (critical and normal):
                self._count("rejected_full")
                raise StepRefused(raised(QueueFull, REASON_QUEUE_FULL))
            # The newest normal waiter makes room for the critical arrival.
            self._leave(normal[-1])
            self._drop(normal[-1], REASON_EVICTED)
        return False

    def _next(self, now: int) -> Entry:
        critical = [entry for entry in self.waiting if entry.critical]
        if critical:
            return critical[0]
        newest = self.lifo or (self.adaptive and self.standing(now))
        return self.waiting[-1] if newest else self.waiting[0]

    def _free_slot(self, critical: bool, now: int) -> None:
        """A slot comes back: hand free slots to the next waiting entries while they may start."""
        self.critical_in_flight -= critical
        self._count("in_flight", -1)
        if self.adaptive:
            self._shed_stale(now)
        while self.waiting:
            entry = self._next(now)
            if not self.may_start(entry.critical):
                return
            self._leave(entry)
            reason = self.dropped_as(entry, now)
            if reason:
                self._drop(entry, reason)
                continue
            self._count("in_flight")
            self.critical_in_flight += entry.critical
            self._count("assigned")
            self.ready.append(entry)

    def put(self, entry: Entry, now: int) -> None:
        if self._admit(entry.deadline_ns, now, entry.critical):
            self._count("assigned")
            self.ready.append(entry)
        else:
            self.waiting.append(entry)
            self._count("queued")

    def acquire(self, deadline_ns: int, now: int, critical: bool) -> int:
        if self._admit(deadline_ns, now, critical):
            self._count("started")
            self._count("critical_started", critical)
            return now
        raise AssertionError("the machine must never make a gate arrival that waits")

    def get(self, now: int) -> int:
        while self.ready:
            entry = self.ready.pop(0)
            self._count("assigned", -1)
            reason = self.dropped_as(entry, now)
            if reason:
                self._drop(entry, reason)
                self._free_slot(entry.critical, now)
                continue
            self._count("started")
            self._count("critical_started", entry.critical)
            self._count("queue_wait_ns_total", now - entry.enqueued_ns)
            return entry.item
        if self.shut and not self.waiting:
            raise StepRefused(raised(ShutDown))
        raise StepRefused(raised(queue.Empty))

    def release(self, now: int, held: Held | None, service_ns: int | None) -> None:
        if self.held <= 0:
            raise StepRefused(raised(ValueError))
        assert held is not None
        self._count("completed")
        if service_ns is not None:
            self.service.sample(service_ns)
            if self.vegas is not None:
                # The in_flight the sample sees includes the slot being released.
                self.limit = self.vegas.sample(service_ns, self.counters["in_flight"])
        self._free_slot(held.critical, now)

    def expire_overdue(self, now: int) -> int:
        overdue = [entry for entry in self.waiting if self.dropped_as(entry, now)]
        for entry in overdue:
            self._leave(entry)
            self._drop(entry, self.dropped_as(entry, now) or REASON_SHED)
        return len(overdue)

    def cancel(self, item: int) -> bool:
        for entry in self.waiting:
            if entry.item == item:
                self._leave(entry)
                self._count("cancelled")
                return True
        return False

    def shutdown(self, cancel_waiting: bool) -> list[int]:
        self.shut = True
        if not cancel_waiting:
            return []
        cancelled = [entry.item for entry in self.waiting]
        self._count("cancelled", len(cancelled))
        self._count("queued", -len(cancelled))
        self.waiting = []
        return cancelled

    def answer(self, step: Callable[[], Any]) -> Outcome:
        try:
            return returned(step())
        except StepRefused as refused:
            return refused.outcome


class LockstepMachine(RuleBasedStateMachine):
    """Drives two twins and the model with the same steps on one fake clock.

    Subclassed per run by ``lockstep_machine`` to set the twins, the order,
    the doomed-work skip, the limit policy and the callback (``on_expired``
    or ``on_dropped``).
    """

    twin_classes: tuple[QueueClass, QueueClass]
    order: str
    expected_service_ms: float | str | None
    limit: str
    callback: str

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.steps = 0
        self.next_item = 0
        self.deadlines: dict[int, int] = {}
        # The very objects put, so cancel() can find them by identity.
        self.items: list[int] = []
        self.critical_items: set[int] = set()
        # Slots started (gate) or taken (get) and not yet given back.
        self.held: list[Held] = []

    @initialize(data=st.data(), max_queue=st.integers(0, 4))
    def create(self, data: st.DataObject, max_queue: int) -> None:
        vegas = self.limit == "vegas"
        # Above 4 under Vegas, so the limit (starting at 4) has room to grow.
        max_concurrency = data.draw(st.integers(1, 7 if vegas else 4), label="max_concurrency")
        reserved = data.draw(st.integers(0, max_concurrency - 1), label="reserved")
        floor = data.draw(st.integers(1, max_concurrency), label="min_concurrency") if vegas else 1
        codel = (
            {"codel_target_ms": float(CODEL_MS[0]), "codel_interval_ms": float(CODEL_MS[1])}
            if self.order == "adaptive"
            else {}
        )
        self.reports: tuple[list[Any], list[Any]] = ([], [])
        self.queues: list[AdmissionQueue] = []
        for twin, reports in zip(self.twin_classes, self.reports):
            callbacks: dict[str, Any] = (
                {"on_expired": reports.append}
                if self.callback == "on_expired"
                else {"on_dropped": lambda item, error, reports=reports: reports.append((item, error.reason))}
            )
            self.queues.append(
                twin(
                    max_concurrency,
                    max_queue,
                    order=self.order,
                    expected_service_ms=self.expected_service_ms,
                    limit=self.limit,
                    min_concurrency=floor,
                    reserved=reserved,
                    **codel,
                    **callbacks,
                )
            )
        self.model = QueueModel(
            max_concurrency,
            max_queue,
            self.order,
            expected_service_ms=self.expected_service_ms,
            codel_ms=CODEL_MS,
            vegas=vegas,
            min_concurrency=floor,
            reserved=reserved,
        )

    def expected_reports(self) -> list[Any]:
        if self.callback == "on_dropped":
            return list(self.model.reports)
        # on_expired hears about every dropped item but the evicted ones.
        return [item for item, reason in self.model.reports if reason != REASON_EVICTED]

    def step(self, operation: Callable[[AdmissionQueue], Any], model_step: Callable[[], Any]) -> Outcome:
        """Apply one operation to both twins and the model; all three must agree."""
        self.steps += 1
        self.model.reports.clear()
        expected = self.model.answer(model_step)
        for q, reports in zip(self.queues, self.reports):
            reports.clear()
            assert outcome_of(partial(operation, q)) == expected, f"{q!r} disagrees with the model"
            assert reports == self.expected_reports(), f"{q!r} reported other dropped items"
        return expected

    def deadline(self, budget_ms: int | None) -> tuple[Deadline | None, int]:
        if budget_ms is None:
            return None, NO_DEADLINE_NS
        deadline = Deadline.at_ns(self.clock.ns + budget_ms * NS_PER_MS)
        return deadline, deadline.ns

    # -- work-queue face ---------------------------------------------------------

    @rule(budget_ms=BUDGETS_MS, critical=st.booleans())
    def put(self, budget_ms: int | None, critical: bool) -> None:
        deadline, deadline_ns = self.deadline(budget_ms)
        item, now = self.next_item, self.clock.ns
        self.next_item += 1
        self.items.append(item)
        self.deadlines[item] = deadline_ns
        if critical:
            self.critical_items.add(item)
        self.step(
            lambda q: q.put(item, deadline, critical=critical, now_ns=now),
            lambda: self.model.put(Entry(item, deadline_ns, now, critical), now),
        )

    @rule(nowait=st.booleans())
    def get(self, nowait: bool) -> None:
        now = self.clock.ns
        outcome = self.step(
            (lambda q: q.get_nowait(now_ns=now)) if nowait else (lambda q: q.get(block=False, now_ns=now)),
            lambda: self.model.get(now),
        )
        if outcome[0] == "returned":
            # Invariant 1: a returned item starts strictly before its deadline,
            # and before its effective deadline under the doomed-work skip.
            assert now < self.deadlines[outcome[1]] - self.model.service.ns
            self.held.append(Held(outcome[1] in self.critical_items, now))

    @rule(data=st.data(), as_task_done=st.booleans(), service_ms=SERVICE_MS)
    def finish(self, data: st.DataObject, as_task_done: bool, service_ms: int | None) -> None:
        """Give back a held slot (or none: a release too many), with a sample of ``service_ms`` or none."""
        now = self.clock.ns
        held = self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="slot")) if self.held else None
        service_ns = None if service_ms is None else service_ms * NS_PER_MS
        keywords: dict[str, Any] = {"now_ns": now}
        if held is not None:
            keywords["critical"] = held.critical
        if service_ns is not None:
            # Any start is a valid sample for the queue: it trusts started_ns.
            keywords["started_ns"] = now - service_ns
        self.step(
            (lambda q: q.task_done(**keywords)) if as_task_done else (lambda q: q.release(**keywords)),
            lambda: self.model.release(now, held, service_ns),
        )

    @precondition(lambda self: self.items)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(self.items), label="item")
        self.step(lambda q: q.cancel(item), lambda: self.model.cancel(item))

    @rule()
    def expire_overdue(self) -> None:
        now = self.clock.ns
        self.step(lambda q: q.expire_overdue(now_ns=now), lambda: self.model.expire_overdue(now))

    # -- gate face, only where it cannot block ----------------------------------------

    @rule(budget_ms=BUDGETS_MS, critical=st.booleans())
    def acquire(self, budget_ms: int | None, critical: bool) -> None:
        deadline, deadline_ns = self.deadline(budget_ms)
        now = self.clock.ns
        if self.model.would_wait(deadline_ns, now, critical):
            return
        outcome = self.step(
            lambda q: q.acquire(deadline, critical=critical, now_ns=now),
            lambda: self.model.acquire(deadline_ns, now, critical),
        )
        if outcome[0] == "returned":
            assert outcome[1] == now, "acquire() returns the start time"
            self.held.append(Held(critical, now))

    @rule(cycles=st.integers(1, 40), service_ms=SERVICE_MS.filter(lambda ms: ms is not None))
    def serve(self, cycles: int, service_ms: int) -> None:
        """Gate arrivals that start at once and finish after ``service_ms``: many samples, fast."""
        for _ in range(cycles):
            if not self.serve_once(service_ms):
                return

    def serve_once(self, service_ms: int) -> bool:
        now = self.clock.ns
        if not self.model.may_start(False) or self.model.would_wait(NO_DEADLINE_NS, now, False):
            return False
        outcome = self.step(
            lambda q: q.acquire(None, now_ns=now), lambda: self.model.acquire(NO_DEADLINE_NS, now, False)
        )
        if outcome[0] != "returned":
            return False
        done = self.clock.advance(service_ms)
        self.step(
            lambda q: q.release(now_ns=done, started_ns=now),
            lambda: self.model.release(done, Held(False, now), service_ms * NS_PER_MS),
        )
        return True

    @precondition(lambda self: self.limit == "vegas")
    @rule(slots=st.integers(1, 7), service_ms=st.lists(st.integers(0, 40), min_size=1, max_size=4))
    def serve_burst(self, slots: int, service_ms: list[int]) -> None:
        """Take up to ``slots`` slots at once, then give them back with service-time samples.

        The Vegas limit moves once per 16 samples and only grows when the
        demand reaches half of it: bursts get there within a run.
        """
        started: list[Held] = []
        for _ in range(slots):
            now = self.clock.ns
            if self.model.would_wait(NO_DEADLINE_NS, now, False):
                break
            outcome = self.step(
                partial(lambda q, now: q.acquire(now_ns=now), now=now),
                partial(self.model.acquire, NO_DEADLINE_NS, now, False),
            )
            if outcome[0] != "returned":
                break
            started.append(Held(False, now))
        for index, held in enumerate(started):
            self.clock.advance(service_ms[index % len(service_ms)])
            now = self.clock.ns
            self.step(
                partial(lambda q, now, start: q.release(started_ns=start, now_ns=now), now=now, start=held.started_ns),
                partial(self.model.release, now, held, now - held.started_ns),
            )

    # -- time and lifecycle -------------------------------------------------------------

    @rule(ms=CLOCK_STEPS_MS)
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @precondition(lambda self: self.steps >= SHUTDOWN_AFTER_STEPS and not self.model.shut)
    @rule(cancel_waiting=st.booleans())
    def shutdown(self, cancel_waiting: bool) -> None:
        self.step(
            lambda q: q.shutdown(cancel_waiting=cancel_waiting),
            lambda: self.model.shutdown(cancel_waiting),
        )

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def twins_and_model_agree_on_every_counter(self) -> None:
        reference, candidate = (q.stats() for q in self.queues)
        assert reference == candidate
        assert {name: reference[name] for name in COUNTER_NAMES} == self.model.counters
        assert reference["expected_service_ns"] == self.model.service.ns
        assert reference["limit"] == self.model.limit
        for q in self.queues:
            assert q.qsize() == self.model.counters["queued"]
            assert q.is_shutdown == self.model.shut
            assert q.limit == self.model.limit

    @invariant()
    def bounds_conservation_and_no_stranded_waiter(self) -> None:
        stats = self.queues[0].stats()
        assert 0 <= stats["in_flight"] <= stats["max_concurrency"]
        assert 0 <= stats["queued"] <= stats["max_queue"]
        assert 0 <= stats["assigned"] <= stats["in_flight"]
        assert self.model.vegas is None or self.model.vegas.min_limit <= stats["limit"] <= stats["max_concurrency"]
        assert_conservation(stats)
        # Work conservation w.r.t. the current limit and the reservation.
        for entry in self.model.waiting:
            assert not self.model.may_start(entry.critical), f"a waiter that may start is stranded: {stats}"
        if stats["in_flight"] < stats["limit"] - self.model.reserved:
            assert stats["queued"] == 0, f"an idle slot while entries wait: {stats}"

    def teardown(self) -> None:
        # What a run reached, for --hypothesis-show-statistics.
        stats = self.queues[0].stats() if hasattr(self, "queues") else {}
        for key in ("shed", "insufficient_budget", "evicted", "critical_started", "expected_service_ns"):
            if stats.get(key):
                event(f"{key} > 0")
        if stats and stats["limit"] != stats["max_concurrency"]:
            event("limit moved below max_concurrency")


def lockstep_machine(
    twins: tuple[QueueClass, QueueClass],
    line_order: str,
    expected_service: float | str | None = None,
    limit_policy: str = "fixed",
    reporting: str = "on_dropped",
) -> type[LockstepMachine]:
    class Lockstep(LockstepMachine):
        twin_classes = twins
        order = line_order
        expected_service_ms = expected_service
        limit = limit_policy
        callback = reporting

    return Lockstep


# Every configuration also draws reserved slots and critical arrivals.
@pytest.mark.parametrize(
    ("order", "expected_service_ms", "callback"),
    [
        ("fifo", None, "on_expired"),
        ("lifo", None, "on_dropped"),
        ("adaptive", None, "on_dropped"),
        ("fifo", 3.0, "on_dropped"),
        ("adaptive", 3.0, "on_expired"),
        ("lifo", "p50", "on_dropped"),
        ("adaptive", "p90", "on_dropped"),
    ],
)
def test_twins_agree_with_each_other_and_the_model(
    twin_pair: tuple[QueueClass, QueueClass], order: str, expected_service_ms: float | str | None, callback: str
) -> None:
    # 50 runs of 60 steps per configuration (of 18) in the default profile; make test-deep
    # (HYPOTHESIS_PROFILE=deep) runs DEEP_FACTOR times as many.
    run_state_machine_as_test(
        lockstep_machine(twin_pair, order, expected_service_ms, reporting=callback),
        settings=settings(max_examples=examples(50), stateful_step_count=60, deadline=None),
    )


@pytest.mark.parametrize(
    ("order", "expected_service_ms"),
    [("fifo", None), ("lifo", None), ("adaptive", None), ("fifo", "p90"), ("adaptive", 3.0)],
)
def test_twins_agree_under_the_vegas_limit(
    twin_pair: tuple[QueueClass, QueueClass], order: str, expected_service_ms: float | str | None
) -> None:
    # Longer runs: the limit moves once per window of 16 service-time samples.
    # 25 runs of 200 steps (5,000 steps) per configuration in the default profile;
    # make test-deep runs DEEP_FACTOR times as many.
    run_state_machine_as_test(
        lockstep_machine(twin_pair, order, expected_service_ms, limit_policy="vegas"),
        settings=settings(max_examples=examples(25), stateful_step_count=200, deadline=None),
    )
