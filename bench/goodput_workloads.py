"""The workloads of ``prazo bench goodput`` (issue 11): what the clients send, and how a point's records are cut.

* ``steady`` — every client has the same budget (1 s): issue 10's experiment.
* ``mixed`` — half the arrivals are clients with a 200 ms budget, half with
  2 s (``MIXED``): each sends ``X-Request-Budget-Ms`` with its own budget and
  gives up at it. A server with one fixed queue timeout cannot fit both.
  Figures per class and in total.
* ``drop`` — one budget (1 s), but the app's capacity drops: it works
  ``DROP_FACTOR`` x as long during the middle third of the measured window
  (``drop_phases``; 10 s of a 30 s window by default), through the apps'
  slowdown schedule (``prazo.bench.goodput_apps.write_slowdown``). Figures for
  the whole window and for each third (before, drop, after).

**What goodput % is of** (the "capacity" each figure is divided by):

* total, ``steady`` and ``mixed``: the closed-loop capacity of the same
  server and app measured in the same run (answers per second with every
  thread busy and generous budgets). A 200 ms client can be answered in time
  at that rate (the work takes 10–50 ms), so it is what a perfect server
  would deliver at any load ≥ 1x, whatever the mix;
* a ``mixed`` class: its *fair share* of that capacity (capacity x the
  class's share of arrivals). Its % can pass 100 when the server favours that
  class at the other's expense; the total cannot (beyond noise);
* ``drop``, the drop third: the capacity measured the same way with the
  slowdown on (``slow_capacity_per_s``); before and after: the normal one;
  the whole window: the time-weighted mean of the two.

``p99_ratio`` is the p99 latency of the good answers divided by the
*unloaded* p99: the p99 of one client sending one request at a time to the
same server (no queueing at all), measured after the capacity: the lowest
p99 of three runs, since other work on the machine only ever raises it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DROP_FACTOR",
    "MIXED",
    "WORKLOADS",
    "BudgetClass",
    "Phase",
    "class_of",
    "drop_phases",
    "loadgen_arguments",
    "percentile",
    "slice_figures",
    "timeline",
]

WORKLOADS = ("steady", "mixed", "drop")
DROP_FACTOR = 3.0


@dataclass(frozen=True)
class BudgetClass:
    """Clients of one kind in the ``mixed`` workload: the path they ask for, their budget, their share of arrivals."""

    name: str
    path: str
    budget_ms: float
    share: float


MIXED = (BudgetClass("short", "/short", 200.0, 0.5), BudgetClass("long", "/long", 2000.0, 0.5))


@dataclass(frozen=True)
class Phase:
    """A part of the measured window, in seconds from its start; ``slow``: the app works ``DROP_FACTOR`` x in it."""

    name: str
    start_s: float
    end_s: float
    slow: bool


def drop_phases(seconds: float) -> tuple[Phase, Phase, Phase]:
    """The ``drop`` workload's window cut in thirds: before, the drop, after (recovery)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
    third = seconds / 3
    return (
        Phase("before", 0.0, third, False),
        Phase("drop", third, 2 * third, True),
        Phase("after", 2 * third, seconds, False),
    )


def loadgen_arguments(workload: str, budget_ms: float) -> list[str]:
    """The load generator's options for ``workload`` (``budget_ms``: the one budget of ``steady`` and ``drop``)."""
    if workload in ("steady", "drop"):
        return ["--budget-ms", repr(budget_ms)]
    if workload == "mixed":
        return [
            "--mix", ",".join(f"{c.path}={c.share!r}" for c in MIXED), "--keys", "1",
            "--path-budget", ",".join(f"{c.path}={c.budget_ms!r}" for c in MIXED),
            "--budget-ms", repr(max(c.budget_ms for c in MIXED)),
        ]  # fmt: skip
    raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")


def class_of(target: str) -> BudgetClass | None:
    """The ``mixed`` class a request's target (``PATH?id=K``) belongs to, None when it is none of them."""
    path = target.partition("?")[0]
    return next((c for c in MIXED if c.path == path), None)


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile (``fraction`` in 0..1) of ``values``, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def _ratio(value: float | None, of: float | None) -> float | None:
    return None if value is None or not of else round(value / of, 2)


def slice_figures(
    records: Iterable[Sequence[Any]],
    seconds: float,
    capacity_per_s: float,
    budget_ns_of: Callable[[Sequence[Any]], float],
    unloaded_p99_ms: float | None,
    app_stats: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Figures of some of a point's load-generator records (a class, a phase, or all of them).

    A record is good when it is an ``ok`` within its own budget
    (``budget_ns_of(record)``). ``app_stats``: the app's counters over the
    same time (None: not measured; a class has none — the app counts runs,
    not clients).
    """
    chosen = list(records)
    good = [r[4] / 1e6 for r in chosen if r[5] == "ok" and r[4] <= budget_ns_of(r)]
    outcomes = Counter(r[5] for r in chosen)
    p99 = percentile(good, 0.99)
    runs = None if app_stats is None else app_stats["runs"]
    return {
        "seconds": round(seconds, 3),
        "requests": len(chosen),
        "offered_per_s": round(len(chosen) / seconds, 2),
        "capacity_per_s": round(capacity_per_s, 2),
        "good": len(good),
        "goodput_per_s": round(len(good) / seconds, 2),
        "goodput_pct": None if capacity_per_s <= 0 else round(100 * len(good) / seconds / capacity_per_s, 1),
        "p99_ms": None if p99 is None else round(p99, 1),
        "p99_ratio": _ratio(p99, unloaded_p99_ms),
        "refused": outcomes.get("refused", 0),
        "timeout": outcomes.get("timeout", 0),
        "error": outcomes.get("error", 0) + outcomes.get("status", 0),
        "app_runs": runs,
        "late_runs": None if app_stats is None else app_stats["late_client"],
        "slowed_runs": None if app_stats is None else app_stats.get("slowed", 0),
    }


def timeline(
    records: Iterable[Sequence[Any]],
    start_ns: int,
    seconds: float,
    budget_ns_of: Callable[[Sequence[Any]], float],
    bin_s: float = 1.0,
) -> dict[str, list[Any]]:
    """Good answers per second and their p99 (ms, None when none) in ``bin_s`` bins of scheduled time from ``start_ns``.

    The drop workload's plot: the goodput falling with the capacity and
    coming back, which a figure per third cannot show.
    """
    if not (math.isfinite(bin_s) and bin_s > 0):
        raise ValueError(f"bin_s must be a finite number > 0, got {bin_s!r}")
    count = max(1, math.ceil(seconds / bin_s - 1e-9))
    good: list[list[float]] = [[] for _ in range(count)]
    for r in records:
        index = int((r[0] - start_ns) // int(bin_s * 1e9))
        if 0 <= index < count and r[5] == "ok" and r[4] <= budget_ns_of(r):
            good[index].append(r[4] / 1e6)
    p99s = [percentile(latencies, 0.99) for latencies in good]
    return {
        "bin_s": [bin_s],
        "good_per_s": [round(len(latencies) / bin_s, 2) for latencies in good],
        "p99_ms": [None if value is None else round(value, 1) for value in p99s],
    }
