"""The measurement of ``prazo bench goodput``: a server's baseline, one offered load, and a point's figures.

``measure_baseline`` takes a server's capacity (closed loop, best of
``CAPACITY_RUNS``), its unloaded p99 and, for the drop workload, its capacity
slowed down; ``run_point`` offers a multiple of that capacity open loop
(``prazo.bench.loadgen``) and ``summarize`` turns the generator's records and
the app's counters into a ``PointResult``. ``run_server_app`` does it all on
freshly started servers (``prazo.bench.goodput_servers.started``),
``run_target`` on a server started outside the bench. ``refused_pct`` and
``misses_refusal_target`` judge a point against issue 21's refusal target.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from prazo.bench.goodput_apps import read_stats, write_slowdown
from prazo.bench.goodput_servers import ServerSpec, Target, started
from prazo.bench.goodput_settings import GoodputSettings
from prazo.bench.goodput_workloads import (
    DROP_FACTOR,
    MIXED,
    WORKLOADS,
    Phase,
    class_of,
    drop_phases,
    loadgen_arguments,
    percentile,
    slice_figures,
    timeline,
)
from prazo.bench.loadgen import OUTCOMES, LoadResult, run_in_subprocess

__all__ = [
    "ATTEMPTS",
    "CAPACITY_RUNS",
    "DRAIN_S",
    "MAX_LAG_P99_MS",
    "REFUSAL_TARGET_PCT",
    "Baseline",
    "NoCapacity",
    "PointResult",
    "measure_baseline",
    "measure_capacity",
    "measure_slow_capacity",
    "measure_unloaded_p99",
    "misses_refusal_target",
    "refused_pct",
    "run_point",
    "run_server_app",
    "run_target",
    "summarize",
]

# With --target (a server never restarted): the longest the bench waits after a
# point for the server to finish what it took, before the next point.
DRAIN_S = 3.0
# A generator later than this (p99) in sending has not kept its schedule: the point is void.
MAX_LAG_P99_MS = 10.0
# Closed-loop capacity runs per server and app; the best counts.
CAPACITY_RUNS = 3
# Tries per point: a generator that fell behind (another tenant of the machine
# took its CPU) gets one more chance before the point is reported as void.
ATTEMPTS = 2


@dataclass
class PointResult:
    """One server x app x load: what the clients got and what the app did."""

    server: str
    app: str
    offered_x: float
    capacity_per_s: float
    seconds: float
    requests: int
    offered_per_s: float
    good: int
    goodput_per_s: float
    goodput_pct: float | None
    p99_ms: float | None
    outcomes: dict[str, int]
    refusals: dict[str, int]
    errors: dict[str, int]
    app_runs: int | None
    late_runs_pct: float | None
    late_server_view_pct: float | None
    started_late_pct: float | None
    loadgen_lag_p99_ms: float | None
    loadgen_cpu_pct: float
    loadgen_kept_schedule: bool
    loadgen_niceness: int
    load_avg_1m: float
    workload: str = "steady"
    # p99 of one client at a time on the same server; p99_ms / it.
    unloaded_p99_ms: float | None = None
    p99_ratio: float | None = None
    # App runs that finished after their client had given up (count; late_runs_pct is its share).
    late_runs: int | None = None
    # drop: the capacity with the app slowed down.
    slow_capacity_per_s: float | None = None
    # mixed: one entry per budget class; drop: one per phase (slice_figures).
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    # drop: good answers per second and their p99 in 1 s bins of the window (``timeline``).
    timeline: dict[str, list[Any]] = field(default_factory=dict)
    # --workers N: the processes of every server of the run (None: the single-process comparison).
    workers: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _pct(part: int, whole: int | None) -> float | None:
    return None if not whole else 100.0 * part / whole


def summarize(
    load: LoadResult,
    app_stats: dict[str, int] | None,
    *,
    server: str,
    app: str,
    offered_x: float,
    capacity_per_s: float,
    seconds: float,
    budget_ms: float,
    warmup_s: float = 0.0,
    workload: str = "steady",
    unloaded_p99_ms: float | None = None,
    slow_capacity_per_s: float | None = None,
    phase_stats: dict[str, dict[str, int] | None] | None = None,
) -> PointResult:
    """The point's figures from the generator's records and the app's counters (None: not measured).

    Only requests scheduled in the window ``[warmup_s, warmup_s + seconds)``
    count: the first arrivals meet an empty server, whose queue fills with
    requests that are answered in time for free, once. ``workload="mixed"``:
    a request is good within its class's budget, and ``slices`` has each
    class against its share of the capacity; ``"drop"``: the phases of
    ``drop_phases(seconds)`` by scheduled time, ``phase_stats`` the app's
    counters over each, and the whole window's capacity is the time-weighted
    mean of ``capacity_per_s`` and ``slow_capacity_per_s``.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    start_ns, end_ns = int(warmup_s * 1e9), int((warmup_s + seconds) * 1e9)
    records = [r for r in load.records if start_ns <= r[0] < end_ns]
    budget_ns = budget_ms * 1e6

    def budget_ns_of(record: Sequence[Any]) -> float:
        budget_class = class_of(record[6]) if workload == "mixed" and len(record) > 6 else None
        return budget_ns if budget_class is None else budget_class.budget_ms * 1e6

    slices: dict[str, dict[str, Any]] = {}
    whole_capacity = capacity_per_s
    slow = slow_capacity_per_s if slow_capacity_per_s is not None else capacity_per_s / DROP_FACTOR
    if workload == "mixed":
        for budget_class in MIXED:
            members = [r for r in records if len(r) > 6 and class_of(r[6]) == budget_class]
            slices[budget_class.name] = {
                "budget_ms": budget_class.budget_ms,
                "share": budget_class.share,
                **slice_figures(members, seconds, capacity_per_s * budget_class.share, budget_ns_of, unloaded_p99_ms),
            }
    elif workload == "drop":
        phases = drop_phases(seconds)
        whole_capacity = sum((slow if ph.slow else capacity_per_s) * (ph.end_s - ph.start_s) for ph in phases) / seconds
        for phase in phases:
            lo, hi = start_ns + int(phase.start_s * 1e9), start_ns + int(phase.end_s * 1e9)
            slices[phase.name] = slice_figures(
                [r for r in records if lo <= r[0] < hi],
                phase.end_s - phase.start_s,
                slow if phase.slow else capacity_per_s,
                budget_ns_of,
                unloaded_p99_ms,
                (phase_stats or {}).get(phase.name),
            )
    whole = slice_figures(records, seconds, whole_capacity, budget_ns_of, unloaded_p99_ms, app_stats)
    outcomes = Counter(r[5] for r in records)
    refusals = Counter(f"{r[2]} {r[3]}".strip() for r in records if r[5] == "refused")
    errors = Counter(str(r[3]) for r in records if r[5] == "error")
    lag_p99 = percentile([(r[1] - r[0]) / 1e6 for r in load.records], 0.99)
    runs = app_stats["runs"] if app_stats is not None else None
    return PointResult(
        server=server,
        app=app,
        offered_x=offered_x,
        capacity_per_s=round(capacity_per_s, 2),
        seconds=seconds,
        requests=whole["requests"],
        offered_per_s=whole["offered_per_s"],
        good=whole["good"],
        goodput_per_s=whole["goodput_per_s"],
        goodput_pct=whole["goodput_pct"],
        p99_ms=whole["p99_ms"],
        outcomes={name: outcomes.get(name, 0) for name in OUTCOMES},
        refusals=dict(refusals),
        errors=dict(errors),
        app_runs=runs,
        late_runs_pct=None if app_stats is None else _round(_pct(app_stats["late_client"], runs)),
        late_server_view_pct=None if app_stats is None else _round(_pct(app_stats["late_server"], runs)),
        started_late_pct=None if app_stats is None else _round(_pct(app_stats["started_late"], runs)),
        loadgen_lag_p99_ms=None if lag_p99 is None else round(lag_p99, 2),
        loadgen_cpu_pct=round(load.cpu_pct, 1),
        loadgen_kept_schedule=lag_p99 is None or lag_p99 <= MAX_LAG_P99_MS,
        loadgen_niceness=load.niceness,
        load_avg_1m=round(os.getloadavg()[0], 2),
        workload=workload,
        unloaded_p99_ms=unloaded_p99_ms,
        p99_ratio=whole["p99_ratio"],
        late_runs=whole["late_runs"],
        slow_capacity_per_s=None if workload != "drop" else round(slow, 2),
        slices=slices,
        timeline=timeline(records, start_ns, seconds, budget_ns_of) if workload == "drop" else {},
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# Issue 21's target below capacity (0.9x of the host's): a server that still
# had room must refuse fewer than this share of the requests.
REFUSAL_TARGET_PCT = 0.5


def refused_pct(result: PointResult) -> float | None:
    """The share of the point's requests refused (503, 504, 408 answered by the server), in %; None without requests."""
    return _pct(result.outcomes.get("refused", 0), result.requests)


def misses_refusal_target(result: PointResult) -> bool:
    """Offered less than the capacity, and refused ``REFUSAL_TARGET_PCT`` % or more of the requests."""
    share = refused_pct(result)
    return result.offered_x < 1 and share is not None and share >= REFUSAL_TARGET_PCT


def _stats(target: Target) -> dict[str, int] | None:
    return None if target.stats_dir is None else read_stats(target.stats_dir)


def _delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if after is None or before is None:
        return None
    return {name: after[name] - before[name] for name in after}


def _drain(target: Target) -> None:
    """Wait (at most DRAIN_S) until the app's run count stops moving for half a second."""
    if target.stats_dir is None:
        time.sleep(0.5)
        return
    end = time.monotonic() + DRAIN_S
    last = read_stats(target.stats_dir)["runs"]
    quiet_since = time.monotonic()
    while time.monotonic() < end and time.monotonic() - quiet_since < 0.5:
        time.sleep(0.1)
        runs = read_stats(target.stats_dir)["runs"]
        if runs != last:
            last, quiet_since = runs, time.monotonic()


def _loadgen_timeout(seconds: float, budget_ms: float) -> float:
    return seconds + budget_ms / 1000 + 60


class NoCapacity(RuntimeError):
    """The capacity run got no good answer: there is nothing to offer a multiple of."""


def measure_capacity(target: Target, settings: GoodputSettings, clients: int | None = None) -> float:
    """Answers per second of a closed loop of ``3 x threads x processes`` clients with generous budgets, best of three.

    Three per thread (of every process) keep every thread busy despite a new
    connection per request, and stay within every server's line (prazo's
    queue of 20, HAProxy's 200 ms queue timeout), so nothing is refused; but
    the SO_REUSEPORT doors' lines are apart, and the kernel's hash may give
    one of them more clients than its threads and line hold (a refusal costs
    the figure little: its client sends the next request at once). Another tenant
    of the machine can only lower a run's figure, hence the best of three.
    """
    clients = clients or 3 * settings.threads * settings.processes
    argv = [
        "--host", target.host, "--port", str(target.port), "--closed", str(clients),
        "--seconds", repr(settings.capacity_seconds), "--budget-ms", repr(settings.capacity_budget_ms),
    ]  # fmt: skip
    best = 0.0
    outcomes: Counter[str] = Counter()
    for _run in range(CAPACITY_RUNS):
        load = run_in_subprocess(argv, _loadgen_timeout(settings.capacity_seconds, settings.capacity_budget_ms))
        good = sum(1 for r in load.records if r[5] == "ok")
        best = max(best, good / load.wall_s if load.wall_s > 0 else 0.0)
        outcomes.update(f"{r[5]} ({r[3] or r[2]})" if r[5] != "ok" else "ok" for r in load.records)
    if best <= 0:
        seen = ", ".join(f"{count} {outcome}" for outcome, count in outcomes.most_common(3)) or "no request ended"
        raise NoCapacity(
            f"{target.host}:{target.port} gave no 200 in {CAPACITY_RUNS} capacity runs ({seen}): "
            "is the server up, and serving the app the bench was told?"
        )
    return best


def measure_unloaded_p99(target: Target, settings: GoodputSettings) -> float | None:
    """p99 latency (ms) of one client sending one request at a time: the service time with no queueing at all.

    The lowest of ``CAPACITY_RUNS`` runs' p99s: another tenant of the machine
    can only raise a run's figure (by 100 ms and more for the CPU app on a
    busy 2-CPU machine, measured), as it can only lower a capacity run's.
    """
    argv = [
        "--host", target.host, "--port", str(target.port), "--closed", "1",
        "--seconds", repr(settings.capacity_seconds), "--budget-ms", repr(settings.capacity_budget_ms),
    ]  # fmt: skip
    p99s = []
    for _run in range(CAPACITY_RUNS):
        load = run_in_subprocess(argv, _loadgen_timeout(settings.capacity_seconds, settings.capacity_budget_ms))
        p99 = percentile([r[4] / 1e6 for r in load.records if r[5] == "ok"], 0.99)
        if p99 is not None:
            p99s.append(p99)
    return round(min(p99s), 1) if p99s else None


def measure_slow_capacity(target: Target, settings: GoodputSettings) -> float:
    """The capacity with the app ``DROP_FACTOR`` x slower (the drop workload's middle third)."""
    if target.stats_dir is None:
        raise ValueError("the drop workload needs the server's stats directory (--stats-dir)")
    now = time.monotonic_ns()
    write_slowdown(target.stats_dir, now, now + 3600 * 10**9, DROP_FACTOR)
    try:
        return measure_capacity(target, settings)
    finally:
        write_slowdown(target.stats_dir, 0, 0, 1.0)


@dataclass(frozen=True)
class Baseline:
    """What a server does with one app before any load: capacity, unloaded p99, capacity slowed down (drop)."""

    capacity_per_s: float
    unloaded_p99_ms: float | None
    slow_capacity_per_s: float | None


def measure_baseline(target: Target, settings: GoodputSettings) -> Baseline:
    """The capacity, then the unloaded p99, then (when the drop workload is asked for) the slowed capacity.

    Each the best of ``CAPACITY_RUNS`` runs of ``capacity_seconds``.
    """
    capacity = measure_capacity(target, settings)
    unloaded = measure_unloaded_p99(target, settings)
    slow = measure_slow_capacity(target, settings) if "drop" in settings.workloads else None
    return Baseline(capacity, unloaded, slow)


def run_point(
    target: Target,
    server: str,
    app: str,
    offered_x: float,
    baseline: Baseline,
    s: GoodputSettings,
    workload: str = "steady",
) -> PointResult:
    """Offer ``offered_x`` times the capacity to ``target`` open loop, as ``workload`` says; the point's figures.

    The app's counters are read when the measured window opens (after the
    warm-up), at each phase boundary (drop) and when it closes: the late runs
    are those of the steady state, not of the server's first second or of the
    backlog it works off after the load stops. ``drop``: the slowdown window
    is written once the load's time zero is known.
    """
    seconds = s.drop_seconds if workload == "drop" else s.seconds
    phases: tuple[Phase, ...] = drop_phases(seconds) if workload == "drop" else ()
    # Counter readings at the window's boundaries, in time order.
    bounds = sorted({0.0, seconds, *(b for ph in phases for b in (ph.start_s, ph.end_s))})
    marks: dict[float, dict[str, int] | None] = {}
    argv = [
        "--host", target.host, "--port", str(target.port), "--rate", repr(offered_x * baseline.capacity_per_s),
        "--seconds", repr(s.warmup_s + seconds), "--max-requests", str(s.max_requests), "--seed", str(s.seed),
        *loadgen_arguments(workload, s.budget_ms),
    ]  # fmt: skip

    def on_begin(origin_ns: int) -> None:
        for phase in phases:
            if phase.slow and target.stats_dir is not None:
                at_ns = origin_ns + int((s.warmup_s + phase.start_s) * 1e9)
                write_slowdown(target.stats_dir, at_ns, at_ns + int((phase.end_s - phase.start_s) * 1e9), DROP_FACTOR)

    def mark(bound: float) -> Callable[[], None]:
        return lambda: marks.__setitem__(bound, _stats(target))

    try:
        load = run_in_subprocess(
            argv,
            _loadgen_timeout(s.warmup_s + seconds, 2 * max(s.budget_ms, *(c.budget_ms for c in MIXED))),
            at=[(s.warmup_s + b, mark(b)) for b in bounds],
            on_begin=on_begin,
        )
    finally:
        if phases and target.stats_dir is not None:
            write_slowdown(target.stats_dir, 0, 0, 1.0)
    figures = summarize(
        load,
        _delta(marks.get(seconds), marks.get(0.0)),
        server=server,
        app=app,
        offered_x=offered_x,
        capacity_per_s=baseline.capacity_per_s,
        seconds=seconds,
        budget_ms=s.budget_ms,
        warmup_s=s.warmup_s,
        workload=workload,
        unloaded_p99_ms=baseline.unloaded_p99_ms,
        slow_capacity_per_s=baseline.slow_capacity_per_s,
        phase_stats={ph.name: _delta(marks.get(ph.end_s), marks.get(ph.start_s)) for ph in phases},
    )
    return replace(figures, workers=s.workers)


def run_server_app(
    spec: ServerSpec, app: str, settings: GoodputSettings, progress: Callable[[PointResult], None]
) -> list[PointResult]:
    """The baseline, then every workload at every load, each point on a fresh server."""
    with started(spec, app, settings) as target:
        baseline = measure_baseline(target, settings)

    def point(workload: str, offered_x: float) -> PointResult:
        with started(spec, app, settings) as fresh:
            return run_point(fresh, spec.name, app, offered_x, baseline, settings, workload)

    return _every_point(settings, point, progress)


def run_target(
    target: Target, name: str, app: str, settings: GoodputSettings, progress: Callable[[PointResult], None]
) -> list[PointResult]:
    """The same on a server started by someone else (never restarted: the bench waits between points)."""
    baseline = measure_baseline(target, settings)
    _drain(target)

    def point(workload: str, offered_x: float) -> PointResult:
        result = run_point(target, name, app, offered_x, baseline, settings, workload)
        _drain(target)
        return result

    return _every_point(settings, point, progress)


def _every_point(
    settings: GoodputSettings,
    point: Callable[[str, float], PointResult],
    progress: Callable[[PointResult], None],
) -> list[PointResult]:
    """``point(workload, offered_x)`` for every workload at every load, each passed to ``progress`` as it comes.

    A point whose generator fell behind its schedule is run once more
    (``ATTEMPTS``), then reported as it is.
    """
    results = []
    for workload in settings.workloads:
        for offered_x in settings.loads_of(workload):
            for _attempt in range(ATTEMPTS):
                result = point(workload, offered_x)
                if result.loadgen_kept_schedule:
                    break
            progress(result)
            results.append(result)
    return results
