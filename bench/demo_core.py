"""``prazo demo core``: the seed scenario, played on the admission queue with real threads.

A burst of arrivals hits an ``AdmissionQueue`` at the same instant (a
``threading.Barrier`` releases them together). Each one asks for a slot with
its own deadline, ``with q.slot(Deadline.after_ms(budget_ms))``, and sleeps
``work_ms`` inside. With the defaults (40 arrivals, 4 slots, 20 places in line,
300 ms of work, a 2 s budget) the outcome is the one the seed article asks
for: 16 are refused at once with 503 instead of queueing behind work they
could never see finished, the other 24 complete within their budget, and
nothing starts after its deadline.

The scenario is a function returning data (``run_seed_scenario`` →
``SeedResult``); ``render_seed_result`` turns it into the terminal report::

    result = run_seed_scenario(SeedParams(arrivals=6, concurrency=2, queue=2, work_ms=50))
    assert result.counts[OUTCOME_QUEUE_FULL] == 2
    print(render_seed_result(result))
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prazo.bench.harness import Paint, plain
from prazo.core import (
    NS_PER_MS,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    REASON_QUEUE_FULL,
    AdmissionQueue,
    Deadline,
    DeadlineExceeded,
    QueueFull,
)
from prazo.core.arguments import checked_ms

__all__ = [
    "MAX_ARRIVALS",
    "OUTCOMES",
    "OUTCOME_COMPLETED",
    "OUTCOME_EXPIRED_IN_QUEUE",
    "OUTCOME_EXPIRED_ON_ARRIVAL",
    "OUTCOME_QUEUE_FULL",
    "Arrival",
    "LatencySummary",
    "SeedParams",
    "SeedResult",
    "TimelineLine",
    "render_seed_result",
    "run_seed_scenario",
]

# The C twin mirrors the Python twin's API, so the class prazo.core picked is
# the static type of both.
QueueClass = type[AdmissionQueue]

OUTCOME_COMPLETED = "completed"
OUTCOME_QUEUE_FULL = REASON_QUEUE_FULL
OUTCOME_EXPIRED_ON_ARRIVAL = REASON_EXPIRED_ON_ARRIVAL
OUTCOME_EXPIRED_IN_QUEUE = REASON_EXPIRED_IN_QUEUE
OUTCOMES = (OUTCOME_COMPLETED, OUTCOME_QUEUE_FULL, OUTCOME_EXPIRED_ON_ARRIVAL, OUTCOME_EXPIRED_IN_QUEUE)

# One thread per arrival: beyond this the demo measures thread creation, not admission.
MAX_ARRIVALS = 5000

# A thread that has not finished this long after the slowest possible schedule
# is stuck; the demo fails instead of hanging.
_JOIN_SLACK_S = 30.0

# Timeline lines beyond which moments are merged across longer gaps.
_TIMELINE_MAX_LINES = 40
_MOMENT_GAPS_MS = (5, 20, 100, 500, 2000, 10_000)


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_ms(name: str, value: object, *, allow_negative: bool) -> None:
    checked_ms(value, name, allow_negative=allow_negative)


@dataclass(frozen=True)
class SeedParams:
    """The knobs of the scenario; defaults are the seed article's numbers.

    A negative ``budget_ms`` is allowed: it is a deadline already passed, and
    every arrival is answered 504 ``expired-on-arrival``. Bad values raise
    ``ValueError``/``TypeError`` naming the field::

        SeedParams(budget_ms=500)      # the variant whose tail expires in the queue
        SeedParams(queue=-1)           # ValueError: queue must be >= 0, got -1
    """

    arrivals: int = 40
    concurrency: int = 4
    queue: int = 20
    work_ms: float = 300.0
    budget_ms: float = 2000.0
    order: str = "fifo"

    def __post_init__(self) -> None:
        _check_int("arrivals", self.arrivals, 1, MAX_ARRIVALS)
        _check_int("concurrency", self.concurrency, 1)
        _check_int("queue", self.queue, 0)
        _check_ms("work_ms", self.work_ms, allow_negative=False)
        _check_ms("budget_ms", self.budget_ms, allow_negative=True)
        if self.order not in ("fifo", "lifo"):
            raise ValueError(f"order must be 'fifo' or 'lifo', got {self.order!r}")


@dataclass
class Arrival:
    """What happened to one arrival; times are ``time.monotonic_ns()`` values.

    ``started_ns`` is read inside the body (None when it never ran);
    ``ended_ns`` is when the arrival got its answer (done, 503 or 504).
    ``queued`` says it waited in line before its outcome (for a started
    arrival this is inferred from the release windows, see ``_Bodies``).
    """

    index: int
    arrived_ns: int
    deadline_ns: int
    outcome: str = ""
    started_ns: int | None = None
    ended_ns: int = 0
    queued: bool = False

    @property
    def latency_ns(self) -> int:
        return self.ended_ns - self.arrived_ns

    @property
    def started_after_deadline(self) -> bool:
        return self.started_ns is not None and self.started_ns >= self.deadline_ns


@dataclass(frozen=True)
class LatencySummary:
    """Median and 99th percentile of one outcome's latency, in milliseconds."""

    count: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class TimelineLine:
    """``count`` events of one ``kind`` between ``from_ms`` and ``to_ms`` (ms since the burst)."""

    from_ms: int
    to_ms: int
    kind: str
    count: int


@dataclass
class SeedResult:
    """Everything the scenario observed, for assertions and for the report.

    ``counts`` has one entry per outcome in ``OUTCOMES``; ``stats`` is
    ``q.stats()`` after the last thread finished; ``peak_in_flight`` is
    counted inside the bodies, independently of the queue's own counters::

        result = run_seed_scenario()
        assert result.counts[OUTCOME_QUEUE_FULL] == 16 and result.started_after_deadline == 0
    """

    params: SeedParams
    implementation: str
    start_ns: int
    arrivals: list[Arrival]
    stats: dict[str, int]
    peak_in_flight: int
    counts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = dict.fromkeys(OUTCOMES, 0)
        for arrival in self.arrivals:
            self.counts[arrival.outcome] += 1

    @property
    def started_after_deadline(self) -> int:
        """Bodies that began at or after their deadline; the admission queue promises 0."""
        return sum(arrival.started_after_deadline for arrival in self.arrivals)

    @property
    def peak_queued(self) -> int:
        return self.stats["peak_queued"]

    def latency(self, outcome: str) -> LatencySummary | None:
        """p50/p99 latency (arrival → answer) of one outcome; None when it never happened."""
        latencies = sorted(a.latency_ns / NS_PER_MS for a in self.arrivals if a.outcome == outcome)
        if not latencies:
            return None
        if len(latencies) == 1:
            return LatencySummary(1, latencies[0], latencies[0])
        p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
        return LatencySummary(len(latencies), statistics.median(latencies), p99)

    def events(self) -> list[tuple[int, str]]:
        """Every event as (ns since the burst, kind), in time order."""
        found: list[tuple[int, str]] = []
        for a in self.arrivals:
            if a.queued:
                found.append((a.arrived_ns, "queued"))
            if a.started_ns is not None:
                found.append((a.started_ns, "started"))
            found.append((a.ended_ns, _EVENT_OF_OUTCOME[a.outcome]))
        return sorted((ns - self.start_ns, kind) for ns, kind in found)

    def timeline(self, max_lines: int = _TIMELINE_MAX_LINES) -> list[TimelineLine]:
        """Events grouped into moments, one line per kind of event in each moment.

        A moment is a run of events with no gap longer than a few ms between
        them (thread wake-ups jitter by about a millisecond); when that gives
        more than ``max_lines`` lines, longer gaps are allowed.
        """
        events = self.events()
        lines: list[TimelineLine] = []
        for gap_ms in _MOMENT_GAPS_MS:
            lines = []
            moment: list[tuple[int, str]] = []
            for ns, kind in events:
                if moment and ns - moment[-1][0] > gap_ms * NS_PER_MS:
                    lines += _summarize_moment(moment)
                    moment = []
                moment.append((ns, kind))
            lines += _summarize_moment(moment)
            if len(lines) <= max_lines:
                break
        return lines


def _summarize_moment(moment: Sequence[tuple[int, str]]) -> list[TimelineLine]:
    """One line per kind of event, in the order the kinds first appear."""
    spans: dict[str, list[int]] = {}
    for ns, kind in moment:
        first_last_count = spans.setdefault(kind, [ns, ns, 0])
        first_last_count[1] = ns
        first_last_count[2] += 1
    return [
        TimelineLine(first // NS_PER_MS, last // NS_PER_MS, kind, count) for kind, (first, last, count) in spans.items()
    ]


_EVENT_OF_OUTCOME = {
    OUTCOME_COMPLETED: "done",
    OUTCOME_QUEUE_FULL: "503 queue-full",
    OUTCOME_EXPIRED_ON_ARRIVAL: "504 expired-on-arrival",
    OUTCOME_EXPIRED_IN_QUEUE: "504 expired-in-queue",
}
_ROLE_OF_EVENT = {
    "started": "ok",
    "done": "ok",
    "queued": "info",
    "503 queue-full": "warn",
    "504 expired-on-arrival": "bad",
    "504 expired-in-queue": "bad",
}


class _Bodies:
    """Counts the bodies running at once and remembers each release window.

    A release window is (just before ``release()``, just after it). The gate
    does not say whether an ``acquire`` waited, but a waiter only gets a slot
    handed over by a release, so a started arrival whose ``acquire`` overlaps
    a release window is taken to have waited in line. (One that stalled
    inside ``acquire`` across a release would be counted too; with bodies
    that work for more than a scheduling hiccup that does not happen.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self.releases: list[tuple[int, int]] = []

    def enter(self) -> None:
        with self._lock:
            self.current += 1
            self.peak = max(self.peak, self.current)

    def leave(self) -> None:
        with self._lock:
            self.current -= 1

    def record_release(self, before_ns: int, after_ns: int) -> None:
        with self._lock:
            self.releases.append((before_ns, after_ns))

    def waited_for_handover(self, started: Sequence[Arrival]) -> None:
        """Mark each started arrival whose acquire overlapped a release window."""
        windows = sorted(self.releases)
        starts = [before for before, _ in windows]
        latest_end = list(itertools.accumulate((after for _, after in windows), max))
        for arrival in started:
            assert arrival.started_ns is not None
            opened = bisect.bisect_left(starts, arrival.started_ns)
            arrival.queued = opened > 0 and latest_end[opened - 1] > arrival.arrived_ns


def run_seed_scenario(params: SeedParams = SeedParams(), queue_class: QueueClass | None = None) -> SeedResult:
    """Run the burst with real threads and return what every arrival saw.

    ``queue_class`` picks the twin (``prazo.core.AdmissionQueue`` by default).
    Raises whatever unexpected exception an arrival thread hit, and
    ``RuntimeError`` if a thread never finishes.
    """
    queue_class = AdmissionQueue if queue_class is None else queue_class
    q = queue_class(params.concurrency, params.queue, order=params.order)
    work_s = params.work_ms / 1000
    bodies = _Bodies()
    arrivals: list[Arrival | None] = [None] * params.arrivals
    failures: list[BaseException] = []
    start_ns: list[int] = []
    burst = threading.Barrier(params.arrivals, action=lambda: start_ns.append(time.monotonic_ns()))

    def arrive(index: int) -> None:
        try:
            burst.wait()
            arrived = time.monotonic_ns()
            deadline = Deadline.after_ms(params.budget_ms, now_ns=arrived)
            arrival = Arrival(index, arrived, deadline.ns)
            arrivals[index] = arrival
            try:
                with q.slot(deadline):
                    arrival.started_ns = time.monotonic_ns()
                    bodies.enter()
                    time.sleep(work_s)
                    bodies.leave()
                    released = time.monotonic_ns()
                arrival.ended_ns = time.monotonic_ns()
                bodies.record_release(released, arrival.ended_ns)
                arrival.outcome = OUTCOME_COMPLETED
            except (QueueFull, DeadlineExceeded) as refused:
                arrival.ended_ns = time.monotonic_ns()
                arrival.outcome = refused.reason
                arrival.queued = refused.reason == OUTCOME_EXPIRED_IN_QUEUE
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread, never swallowed
            failures.append(exc)

    threads = [
        threading.Thread(target=arrive, args=(i,), name=f"prazo-demo-arrival-{i}", daemon=True)
        for i in range(params.arrivals)
    ]
    for thread in threads:
        thread.start()
    waves = math.ceil(params.arrivals / params.concurrency)
    give_up_at = time.monotonic() + waves * work_s + max(params.budget_ms, 0) / 1000 + _JOIN_SLACK_S
    for thread in threads:
        thread.join(max(give_up_at - time.monotonic(), 0))
        if thread.is_alive():
            raise RuntimeError(f"{thread.name} did not finish; the admission queue may be stuck: {q!r}")
    if failures:
        raise failures[0]
    finished = [a for a in arrivals if a is not None]
    bodies.waited_for_handover([a for a in finished if a.started_ns is not None])
    return SeedResult(
        params=params,
        implementation=_implementation_of(queue_class),
        start_ns=start_ns[0],
        arrivals=finished,
        stats=q.stats(),
        peak_in_flight=bodies.peak,
    )


def _implementation_of(queue_class: QueueClass) -> str:
    return "c" if queue_class.__module__.endswith("_queue_c") else "py"


def _format_ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def render_seed_result(result: SeedResult, paint: Paint = plain) -> str:
    """The terminal report: parameters, timeline, summary table and verdict."""
    p = result.params
    out: list[str] = [
        paint("prazo demo core", "bold")
        + f" — the seed scenario on the admission queue (implementation: {paint(result.implementation, 'bold')})",
        (
            f"{p.arrivals} arrivals at once · max_concurrency={p.concurrency} · max_queue={p.queue} · "
            f"work {p.work_ms:g} ms · budget {p.budget_ms:g} ms · {p.order}"
        ),
        "",
        paint("timeline", "bold") + " (ms since the burst)",
    ]
    for line in result.timeline():
        span = f"{line.from_ms}" if line.to_ms == line.from_ms else f"{line.from_ms}–{line.to_ms}"
        out.append(f"  {span:>11} ms  {paint(f'{line.kind:<24}', _ROLE_OF_EVENT[line.kind])}{line.count:>5}")

    out += ["", paint("summary", "bold"), f"  {'outcome':<26}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}"]
    for outcome in OUTCOMES:
        event = _EVENT_OF_OUTCOME[outcome]
        label = "200 completed" if outcome == OUTCOME_COMPLETED else event
        role = _ROLE_OF_EVENT[event]
        latency = result.latency(outcome)
        count = result.counts[outcome]
        p50, p99 = (None, None) if latency is None else (latency.p50_ms, latency.p99_ms)
        row = f"{label:<26}{count:>7}{_format_ms(p50):>10}{_format_ms(p99):>10}"
        out.append("  " + (paint(row, role) if count else paint(row, "dim")))
    late = result.started_after_deadline
    out += [
        f"  {'started after deadline':<26}{late:>7}   "
        + (paint("ok, must be 0", "ok") if late == 0 else paint("BUG: must be 0", "bad")),
        f"  {'peak in-flight':<26}{result.peak_in_flight:>7}   of max_concurrency {p.concurrency}",
        f"  {'peak queued':<26}{result.peak_queued:>7}   of max_queue {p.queue} (q.stats())",
        f"  {'offered':<26}{result.stats['offered']:>7}   = {' + '.join(str(result.counts[o]) for o in OUTCOMES)}",
    ]
    return "\n".join(out)
