"""``AdmissionPool`` throughput against ``ThreadPoolExecutor``: ``prazo bench pool`` and its pytest-benchmark group.

One *batch* is measured end to end: ``tasks`` no-op callables submitted one
after another, then ``concurrent.futures.wait`` for all of them. Throughput
is tasks per second of the whole batch, so it counts submission, hand-over
to the workers, running and completing the futures.

Competitors, each a pool of ``workers`` threads created once and warmed up
with one untimed batch (the garbage collector is off while a batch is timed):

* ``ThreadPoolExecutor.submit(fn)`` — no deadlines, it has none;
* ``AdmissionPool.submit_until(deadline, fn)`` — every task with a deadline
  (the target is about this one);
* ``AdmissionPool.submit(fn)`` inside ``deadline_scope`` — the deadline taken
  from the caller's context;
* ``AdmissionPool.submit(fn)`` with no deadline at all, to show what the
  deadlines cost;
* ``ThreadPoolExecutor.map(fn, items)`` and ``AdmissionPool.map(fn, items)``
  inside ``deadline_scope`` (one deadline for the whole batch), consumed to
  the end; the map row is compared with ``ThreadPoolExecutor.map``.

``max_queue`` is the batch size, so nothing is refused, and the deadline is
an hour away, so nothing expires: a batch where any task fails is an error,
not a result. Batches of the competitors are interleaved, so a noisy moment
hits all of them. Speed-ups are ratios of median throughputs (issue #13: the
best batch alone rewards one lucky moment on a shared machine); the best
batch is shown beside the median.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from prazo.bench.harness import (
    Paint,
    Target,
    check_counts,
    format_times,
    make_target,
    plain,
    ratio_of,
    render_heading,
    render_targets,
)
from prazo.bindings.pool import AdmissionPool
from prazo.core import Deadline, deadline_scope

__all__ = [
    "GROUP_POOL",
    "POOL_COMPETITORS",
    "POOL_SPEEDUP_TARGET",
    "QUICK_POOL",
    "RECORDING_POOL",
    "PoolBatch",
    "PoolBenchReport",
    "PoolBenchSettings",
    "PoolCompetitor",
    "PoolSummary",
    "collect_garbage",
    "noop",
    "noop_item",
    "open_batch",
    "render_pool_report",
    "run_pool_bench",
]

GROUP_POOL = "pool throughput, no-op tasks: submit all, then wait for all"

# Issue #13: AdmissionPool, deadlines on, at least twice ThreadPoolExecutor's
# median throughput with 4 workers (and 1.5x with 1 or 16), map at least twice.
POOL_SPEEDUP_TARGET = 2.0
POOL_SPEEDUP_TARGET_OTHER_WORKERS = 1.5
POOL_TARGET_WORKERS = 4

# Far enough that no task of a benchmark ever expires.
_BENCH_BUDGET_S = 3600.0


def noop() -> None:
    """The task: nothing, so the pool's own cost is all there is to measure."""


def noop_item(_item: int) -> None:
    """The task of a ``map`` batch: nothing with one item."""


@dataclass(frozen=True)
class PoolBenchSettings:
    """Batch size, timed batches per competitor (the best counts), and worker threads per pool."""

    tasks: int = 10_000
    batches: int = 10
    workers: int = 4

    def __post_init__(self) -> None:
        check_counts(self, tasks=1, batches=1, workers=1)


QUICK_POOL = PoolBenchSettings(batches=3)

# Takes the competitor's own pool: each knows which submit methods it has.
SubmitAll = Callable[[Any, int], "list[Future[None]]"]


def _thread_pool(settings: PoolBenchSettings) -> Executor:
    return ThreadPoolExecutor(settings.workers)


def _admission_pool(settings: PoolBenchSettings) -> Executor:
    return AdmissionPool(settings.workers, settings.tasks)


def _recording_admission_pool(settings: PoolBenchSettings) -> Executor:
    return AdmissionPool(settings.workers, settings.tasks, record_latency=True)


def _submit_plain(pool: Executor, tasks: int) -> list[Future[None]]:
    submit = pool.submit
    return [submit(noop) for _ in range(tasks)]


def _submit_until(pool: AdmissionPool, tasks: int) -> list[Future[None]]:
    submit_until, deadline = pool.submit_until, Deadline.after(_BENCH_BUDGET_S)
    return [submit_until(deadline, noop) for _ in range(tasks)]


def _submit_in_scope(pool: Executor, tasks: int) -> list[Future[None]]:
    submit = pool.submit
    with deadline_scope(Deadline.after(_BENCH_BUDGET_S)):
        return [submit(noop) for _ in range(tasks)]


def _map_plain(pool: Executor, tasks: int) -> list[Future[None]]:
    # map raises the first failure itself while its results are consumed.
    for _ in pool.map(noop_item, range(tasks)):
        pass
    return []


def _map_in_scope(pool: Executor, tasks: int) -> list[Future[None]]:
    with deadline_scope(Deadline.after(_BENCH_BUDGET_S)):
        return _map_plain(pool, tasks)


@dataclass(frozen=True)
class PoolCompetitor:
    """A pool to build and the way each task of a batch is submitted to it."""

    key: str
    label: str
    make_pool: Callable[[PoolBenchSettings], Executor]
    submit_all: SubmitAll
    # The competitor this one's speed-up is measured against.
    baseline: str = "thread-pool"


POOL_COMPETITORS = (
    PoolCompetitor("thread-pool", "ThreadPoolExecutor.submit(fn)", _thread_pool, _submit_plain),
    PoolCompetitor("submit-until", "AdmissionPool.submit_until(d, fn)", _admission_pool, _submit_until),
    PoolCompetitor("deadline-scope", "AdmissionPool.submit(fn) in deadline_scope", _admission_pool, _submit_in_scope),
    PoolCompetitor("no-deadline", "AdmissionPool.submit(fn), no deadline", _admission_pool, _submit_plain),
    PoolCompetitor("thread-pool-map", "ThreadPoolExecutor.map(fn, items)", _thread_pool, _map_plain, "thread-pool-map"),
    PoolCompetitor(
        "map-in-scope",
        "AdmissionPool.map(fn, items) in deadline_scope",
        _admission_pool,
        _map_in_scope,
        "thread-pool-map",
    ),
)
_BASELINES = {competitor.key: competitor.baseline for competitor in POOL_COMPETITORS}

# The submit-until row with latency recording on (pytest-benchmark suite only):
# the difference is what recording each task's duration and queue wait costs.
RECORDING_POOL = PoolCompetitor(
    "submit-until-record-latency",
    "AdmissionPool(record_latency=True).submit_until(d, fn)",
    _recording_admission_pool,
    _submit_until,
)


class PoolBatch:
    """One competitor's pool, ready to time batches: ``seconds = batch()``.

    Each call submits ``settings.tasks`` no-op tasks, waits for all of them
    and returns the elapsed seconds; it raises ``RuntimeError`` if any task
    did not complete successfully, so a refusal or an expiry can never pass
    for speed. Use ``open_batch`` to get one whose pool is shut down after.
    """

    def __init__(self, competitor: PoolCompetitor, pool: Executor, settings: PoolBenchSettings) -> None:
        self.competitor = competitor
        self._pool = pool
        self._tasks = settings.tasks

    def __call__(self) -> float:
        # Like timeit, the garbage collector is off while timing: a batch
        # allocates tens of thousands of objects, and a full collection walks
        # every object of the process, so the harness (pytest holds far more
        # than `prazo bench`) would otherwise decide how long a batch takes.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            started = time.perf_counter()
            futures = self.competitor.submit_all(self._pool, self._tasks)
            wait(futures)
            elapsed = time.perf_counter() - started
        finally:
            if gc_was_enabled:
                gc.enable()
        failed = [future for future in futures if future.exception() is not None]
        if failed:
            raise RuntimeError(
                f"{len(failed)} of {self._tasks} tasks failed in {self.competitor.label}: {failed[0].exception()!r}"
            )
        return elapsed


def collect_garbage() -> None:
    """A full collection, run before each timed batch so that none is owed inside it."""
    gc.collect()


@contextlib.contextmanager
def open_batch(competitor: PoolCompetitor, settings: PoolBenchSettings) -> Iterator[PoolBatch]:
    """A warmed-up ``PoolBatch`` (its threads started by one untimed batch); shuts the pool down on exit."""
    pool = competitor.make_pool(settings)
    try:
        batch = PoolBatch(competitor, pool, settings)
        batch()
        yield batch
    finally:
        pool.shutdown(wait=True)


@dataclass(frozen=True)
class PoolSummary:
    """Throughput of one competitor over its batches, in tasks per second."""

    best: float
    median: float

    @classmethod
    def of(cls, tasks: int, seconds: Sequence[float]) -> PoolSummary:
        return cls(tasks / min(seconds), tasks / statistics.median(seconds))


@dataclass
class PoolBenchReport:
    """Everything ``prazo bench pool`` measured, by competitor key."""

    settings: PoolBenchSettings
    twin: str
    throughput: dict[str, PoolSummary]
    notes: list[str] = field(default_factory=list)

    def speedup(self, key: str) -> float | None:
        """Median throughput of ``key`` over its baseline's (``ThreadPoolExecutor`` doing the same)."""
        mine, theirs = self.throughput.get(key), self.throughput.get(_BASELINES.get(key, "thread-pool"))
        return ratio_of(None if mine is None else mine.median, None if theirs is None else theirs.median)

    def targets(self) -> list[Target]:
        submit_target = (
            POOL_SPEEDUP_TARGET if self.settings.workers == POOL_TARGET_WORKERS else POOL_SPEEDUP_TARGET_OTHER_WORKERS
        )
        return [
            make_target(
                "AdmissionPool (submit_until) throughput vs ThreadPoolExecutor",
                self.speedup("submit-until"),
                f">= {submit_target:g}x",
                lambda r: r >= submit_target,
            ),
            make_target(
                "AdmissionPool.map throughput vs ThreadPoolExecutor.map",
                self.speedup("map-in-scope"),
                f">= {POOL_SPEEDUP_TARGET:g}x",
                lambda r: r >= POOL_SPEEDUP_TARGET,
            ),
        ]


def run_pool_bench(
    settings: PoolBenchSettings = PoolBenchSettings(), *, twin: str, notes: Sequence[str] = ()
) -> PoolBenchReport:
    """Time every competitor, batches interleaved round-robin; ``twin`` names the queue the pool runs on."""
    seconds: dict[str, list[float]] = {competitor.key: [] for competitor in POOL_COMPETITORS}
    with contextlib.ExitStack() as pools:
        batches = [pools.enter_context(open_batch(competitor, settings)) for competitor in POOL_COMPETITORS]
        for _ in range(settings.batches):
            for batch in batches:
                collect_garbage()
                seconds[batch.competitor.key].append(batch())
    throughput = {key: PoolSummary.of(settings.tasks, timed) for key, timed in seconds.items()}
    return PoolBenchReport(settings, twin, throughput, list(notes))


def render_pool_report(report: PoolBenchReport, paint: Paint = plain) -> str:
    """The ``prazo bench pool`` table: tasks/s (best and median) and speed-up over ThreadPoolExecutor."""
    s = report.settings
    out = render_heading(
        "prazo bench pool",
        f"AdmissionPool on the {report.twin} twin · {s.workers} workers · batches of {s.tasks:,} no-op tasks "
        f"· {s.batches} batches, speed-ups of medians",
        report.notes,
        paint,
    )
    targets = report.targets()
    width = max(len(label) for label in [*(c.label for c in POOL_COMPETITORS), *(t.label for t in targets)]) + 2
    out += [
        "",
        paint(f"{GROUP_POOL:<{width}}", "bold") + f"{'best/s':>10}  {'median/s':>10}  {'speed-up':>8}",
    ]
    for competitor in POOL_COMPETITORS:
        summary = report.throughput[competitor.key]
        out.append(
            f"  {competitor.label:<{width - 2}}{summary.best:>10,.0f}  {summary.median:>10,.0f}  "
            f"{format_times(report.speedup(competitor.key)):>8}"
        )
    out += render_targets(targets, width, paint)
    return "\n".join(out)
