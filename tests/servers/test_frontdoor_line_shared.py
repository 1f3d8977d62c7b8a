"""The front door and the queue run one admission line (core/prazo_line.h).

The front door's extension compiles the line into its engine; the queue's C
twin compiles it into ``AdmissionQueue``. ``EngineLine`` is the engine's line
on its own (tokens are ints instead of connections). Driven with one sequence
of arrivals, completions, clock steps and sweeps, with a worker that picks up
at once whenever the engine's line would let it, both must start the same
requests in the same order, drop the same ones for the same reasons, refuse
the same arrivals and count the same.

The two take a slot at different moments (the queue at arrival or hand-over,
the engine at pickup), so the sequences stay where that cannot show: fixed
limit, no reserved places (with some, the engine lets more wait while a
normal request may not start), and FIFO or LIFO order (under "adaptive" the
engine sheds stale entries at every pickup, the queue only at a hand-over or
a full arrival).
"""

from __future__ import annotations

import queue as stdlib_queue
from dataclasses import dataclass, field

import pytest
from _helpers import examples
from _required import require_compiled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prazo.core import Deadline, DeadlineExceeded, QueueFull

pytestmark = pytest.mark.compiled

MS = 1_000_000

operations = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 40), st.booleans()),
        st.tuples(st.just("finish"), st.integers(0, 10)),
        st.tuples(st.just("advance"), st.integers(0, 25)),
        st.tuples(st.just("sweep")),
    ),
    max_size=40,
)


@dataclass
class Face:
    """What one face did: who started (in order), who was dropped or refused, and why."""

    started: list[int] = field(default_factory=list)
    dropped: list[tuple[int, str]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    running: list[tuple[int, bool]] = field(default_factory=list)


def _pick_up_queue(q, face: Face, now: int, critical: set[int]) -> None:
    while True:
        try:
            token = q.get_nowait(now_ns=now)
        except stdlib_queue.Empty:
            return
        face.started.append(token)
        face.running.append((token, token in critical))


def _pick_up_engine(line, face: Face, now: int, critical: set[int]) -> None:
    while True:
        token, dropped = line.next(now)
        face.dropped += dropped
        if token is None:
            return
        face.started.append(token)
        face.running.append((token, token in critical))


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    threads=st.integers(1, 3),
    max_queue=st.integers(0, 4),
    order=st.sampled_from(["fifo", "lifo"]),
    expected_ms=st.sampled_from([0, 2, 7]),
    steps=operations,
)
def test_the_front_door_and_the_queue_run_the_same_line(
    threads: int, max_queue: int, order: str, expected_ms: int, steps: list[tuple]
) -> None:
    queue_c = require_compiled("prazo.core._queue_c")
    engine = require_compiled("prazo.bindings.servers.frontdoor._engine_c")
    critical_tokens: set[int] = set()
    now = 1_000 * MS
    queued, served = Face(), Face()
    q = queue_c.AdmissionQueue(
        threads,
        max_queue,
        order=order,
        expected_service_ms=expected_ms or None,
        on_dropped=lambda item, error: queued.dropped.append((item, error.reason)),
    )
    line = engine.EngineLine(threads, max_queue, order=order, expected_service_ns=expected_ms * MS, now_ns=now)
    token = 0
    for step in steps:
        if step[0] == "arrive":
            token += 1
            deadline_ns, critical = now + step[1] * MS, step[2]
            if critical:
                critical_tokens.add(token)
            try:
                q.put(token, Deadline.at_ns(deadline_ns), critical=critical, now_ns=now)
            except (QueueFull, DeadlineExceeded) as refusal:
                queued.refused.append((token, refusal.reason))
            answer, dropped = line.admit(token, deadline_ns, now, critical)
            served.dropped += dropped
            if answer is not None:
                served.refused.append((token, answer))
        elif step[0] == "finish":
            if not queued.running:
                continue
            index = step[1] % len(queued.running)
            done, critical = queued.running.pop(index)
            assert served.running.pop(index) == (done, critical)
            q.task_done(critical=critical, now_ns=now)
            line.release(critical)
        elif step[0] == "advance":
            now += step[1] * MS
        else:
            q.expire_overdue(now_ns=now)
            _next_ns, dropped = line.sweep(now)
            served.dropped += dropped
        _pick_up_queue(q, queued, now, critical_tokens)
        _pick_up_engine(line, served, now, critical_tokens)
        assert served == queued
        # Every counter of the line, under the names both faces give it.
        mine, theirs = q.stats(), line.stats()
        assert {name: theirs[name] for name in engine.LINE_COUNTERS} == {
            name: mine[name] for name in engine.LINE_COUNTERS
        }


def test_the_engine_line_counts_in_the_queue_order() -> None:
    # The two extensions name the line's counters in the one order of prazo_line.h.
    queue_c = require_compiled("prazo.core._queue_c")
    engine = require_compiled("prazo.bindings.servers.frontdoor._engine_c")
    stats = queue_c.AdmissionQueue(1, 1).stats()
    assert [name for name in stats if name in engine.LINE_COUNTERS] == list(engine.LINE_COUNTERS)
