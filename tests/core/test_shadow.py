"""``ShadowLine`` against an enforcing line, replayed on the same arrivals and service times.

The reference is an enforcing line simulated directly, knowing every service
time in advance (``replay_enforcing``): the same queue class and policies,
driven in time order, each admitted request taking its service time from its
virtual start. The shadow is fed what an observe-only face
sees: the arrivals as they come and each request's real finish (at once for
a face that runs every request at its arrival; after a stock FIFO queue of
its own for one that queues), never the service time in advance. Their
decisions must be the same, counter by counter.
"""

from __future__ import annotations

import heapq
from typing import Any

import pytest
from _helpers import QueueClass, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.core import NS_PER_MS
from prazo.core.shadow import DECISIONS, Arrival, ShadowLine, replay_enforcing

START_NS = 10**12


def enforcing(queue_class: QueueClass, arrivals: list[Arrival], **options: Any) -> dict[str, int]:
    """The reference: an enforcing line that knows every service time in advance (``replay_enforcing``)."""
    return replay_enforcing(queue_class, arrivals, **options)


def stock_starts(arrivals: list[Arrival], threads: int) -> list[int]:
    """When a stock server with ``threads`` threads and an unbounded FIFO queue starts each request."""
    free = [START_NS] * threads
    starts = []
    for arrival in sorted(range(len(arrivals)), key=lambda i: (arrivals[i].at_ns, i)):
        soonest = heapq.heappop(free)
        start = max(soonest, arrivals[arrival].at_ns)
        starts.append((arrival, start))
        heapq.heappush(free, start + arrivals[arrival].service_ns)
    return [start for _, start in sorted(starts)]


def observed(
    queue_class: QueueClass, arrivals: list[Arrival], stock_threads: int | None, **options: Any
) -> dict[str, int]:
    """The shadow's counters, fed as an observe-only face feeds it (stock_threads None: every request at once)."""
    shadow = ShadowLine(queue_class, **options)
    shadow.keep_journal()
    starts = [arrival.at_ns for arrival in arrivals] if stock_threads is None else stock_starts(arrivals, stock_threads)
    # At the same moment, requests in arrival order, each one's own events in their order: a
    # finish at t is told before a later request's arrival at t (the line's own order).
    events: list[tuple[int, int, int]] = []  # (time, index, 2 arrive / 1 start / 0 finish)
    for index, arrival in enumerate(arrivals):
        events.append((arrival.at_ns, index, 2))
        if stock_threads is not None:
            events.append((starts[index], index, 1))
        events.append((starts[index] + arrival.service_ns, index, 0))
    phase = {2: 0, 1: 1, 0: 2}
    for at, index, kind in sorted(events, key=lambda event: (event[0], event[1], phase[event[2]])):
        arrival = arrivals[index]
        if kind == 2:
            shadow.arrive(index, at, arrival.deadline_ns, arrival.critical, runs_now=stock_threads is None)
        elif kind == 1:
            shadow.started(index, at)
        else:
            shadow.finished(index, at)
    shadow.catch_up(2**62)
    stats = shadow.stats()
    assert stats["undecided"] == 0
    decided = {name: stats[name] for name in DECISIONS}
    # The journal is what the shadow was told: replayed, it decides the same.
    assert sorted(shadow.journal()) == sorted(arrivals)
    assert replay_enforcing(queue_class, shadow.journal(), **options) == decided
    return decided


ARRIVALS = st.lists(
    st.tuples(
        st.integers(0, 40),  # ms since the previous arrival
        st.integers(1, 300),  # budget, ms
        st.integers(0, 120),  # service, ms
        st.booleans(),  # critical
    ),
    min_size=1,
    max_size=60,
)

OPTIONS = st.fixed_dictionaries(
    {
        "max_concurrency": st.integers(1, 3),
        "max_queue": st.integers(0, 4),
        "order": st.sampled_from(["fifo", "lifo", "adaptive"]),
        "expected_service_ms": st.sampled_from([None, 20.0]),
    }
)


def _arrivals(drawn: list[tuple[int, int, int, bool]], critical: bool) -> list[Arrival]:
    at, result = START_NS, []
    for gap_ms, budget_ms, service_ms, is_critical in drawn:
        at += gap_ms * NS_PER_MS
        result.append(Arrival(at, at + budget_ms * NS_PER_MS, service_ms * NS_PER_MS, critical and is_critical))
    return result


@given(drawn=ARRIVALS, options=OPTIONS, critical=st.booleans(), stock=st.sampled_from([None, 1, 2, 4]))
@settings(max_examples=examples(150), deadline=None)
def test_the_shadow_decides_as_the_enforcing_line_would(
    impl: QueueClass, drawn: list, options: dict[str, Any], critical: bool, stock: int | None
) -> None:
    if critical and options["max_concurrency"] > 1:
        options = {**options, "reserved": 1}
    arrivals = _arrivals(drawn, critical)
    assert observed(impl, arrivals, stock, **options) == enforcing(impl, arrivals, **options)


def test_a_slow_request_holds_a_virtual_place_until_its_real_service_is_known(impl: QueueClass) -> None:
    ms = NS_PER_MS
    shadow = ShadowLine(impl, max_concurrency=1, max_queue=0)
    shadow.arrive("slow", START_NS, START_NS + 1000 * ms)
    # The second arrives while the first still runs for real: it has run 50 ms, and may end at this very moment.
    shadow.arrive("second", START_NS + 50 * ms, START_NS + 1000 * ms)
    shadow.arrive("third", START_NS + 80 * ms, START_NS + 1000 * ms)
    assert shadow.stats()["undecided"] == 1, "the second waits; by 80 ms it is known the first ran past 50"
    assert shadow.stats()["rejected_full"] == 1
    shadow.finished("slow", START_NS + 100 * ms)
    shadow.finished("second", START_NS + 60 * ms)
    assert shadow.stats()["rejected_full"] == 2, "the place was taken at 50 and at 80 ms"
    shadow.arrive("fourth", START_NS + 150 * ms, START_NS + 1000 * ms)
    shadow.catch_up(START_NS + 200 * ms)
    assert shadow.stats() == {
        "offered": 4,
        "rejected_full": 2,
        "expired_on_arrival": 0,
        "insufficient_budget": 0,
        "expired_in_queue": 0,
        "shed": 0,
        "evicted": 0,
        "undecided": 0,
    }


def test_an_arrival_waits_undecided_while_a_queued_request_may_still_free_its_place(impl: QueueClass) -> None:
    ms = NS_PER_MS
    shadow = ShadowLine(impl, max_concurrency=1, max_queue=0)
    # A face whose stock queue holds requests: the first has not really started yet.
    shadow.arrive("first", START_NS, START_NS + 1000 * ms, runs_now=False)
    shadow.arrive("second", START_NS + 10 * ms, START_NS + 1000 * ms, runs_now=False)
    # The first's virtual run might take no time at all: whether the second finds the place free is not known.
    assert shadow.stats()["undecided"] == 1
    shadow.started("first", START_NS + 20 * ms)
    shadow.finished("first", START_NS + 25 * ms)  # 5 ms of service: virtually over at 5 ms, before the second
    assert shadow.stats()["undecided"] == 0
    assert shadow.stats()["rejected_full"] == 0


def test_the_shadow_keeps_its_callbacks() -> None:
    from prazo.core import AdmissionQueue

    with pytest.raises(TypeError, match="on_dropped"):
        ShadowLine(AdmissionQueue, 1, 0, on_dropped=print)
