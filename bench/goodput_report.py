"""The report of ``prazo bench goodput``: its points as a table (``render_table``) and as plots (``plot``).

A line per point (``render_row``, and one more per budget class or drop
phase), the parameters above and the servers' labels and caveats below; the
plots draw each workload's goodput and p99 ratio against offered load, or a
drop point's over time (``plot_timelines``; matplotlib, ``prazo[plot]``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prazo.bench.goodput_measure import (
    CAPACITY_RUNS,
    MAX_LAG_P99_MS,
    REFUSAL_TARGET_PCT,
    PointResult,
    misses_refusal_target,
    refused_pct,
)
from prazo.bench.goodput_settings import GoodputSettings
from prazo.bench.goodput_workloads import DROP_FACTOR, MIXED, drop_phases

__all__ = [
    "APP_TITLES",
    "PLOT_SLICE",
    "TABLE_HEADER",
    "plot",
    "plot_paths",
    "plot_timelines",
    "render_row",
    "render_slice",
    "render_table",
]

# The plots' titles of the apps (``prazo.bench.goodput_servers.APPS``).
APP_TITLES = {"cpu": "CPU-bound app (10 ms of Python CPU)", "io": "I/O-bound app (50 ms sleep)"}


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _refusals_of(result: PointResult, status: str) -> int:
    return sum(count for key, count in result.refusals.items() if key.split(" ", 1)[0] == status)


_SERVER_WIDTH = 23  # "prazo-gunicorn+adaptive"
TABLE_HEADER = (
    f"{'server':<{_SERVER_WIDTH}} {'work':<6} {'app':<4} {'load':>5} {'offer/s':>8} {'cap/s':>6} {'goodput/s':>9} "
    f"{'good%':>6} {'late':>5} {'late%':>6} {'late(srv)%':>10} {'p99 ms':>7} {'p99x':>5} {'503':>5} {'504':>5} "
    f"{'408':>4} {'ref%':>5} {'t/o':>5} {'err':>5} {'lag p99':>8} {'gen cpu':>7}"
)


def render_row(r: PointResult) -> str:
    """One table line (and one more per class or phase); a point whose load generator fell behind is flagged ``!!``."""
    flag = "" if r.loadgen_kept_schedule else "  !! LOAD GENERATOR FELL BEHIND: point invalid"
    if misses_refusal_target(r):
        flag += f"  <- refused >= {REFUSAL_TARGET_PCT:g} % below capacity"
    late = "-" if r.late_runs is None else str(r.late_runs)
    line = (
        f"{r.server:<{_SERVER_WIDTH}} {r.workload:<6} {r.app:<4} {r.offered_x:>4g}x {r.offered_per_s:>8.1f} "
        f"{r.capacity_per_s:>6.1f} {r.goodput_per_s:>9.1f} {_num(r.goodput_pct):>6} {late:>5} "
        f"{_num(r.late_runs_pct):>6} {_num(r.late_server_view_pct):>10} {_num(r.p99_ms):>7} "
        f"{_num(r.p99_ratio):>5} {_refusals_of(r, '503'):>5} {_refusals_of(r, '504'):>5} "
        f"{_refusals_of(r, '408'):>4} {_num(refused_pct(r), 2):>5} {r.outcomes['timeout']:>5} "
        f"{r.outcomes['error'] + r.outcomes['status']:>5} "
        f"{_num(r.loadgen_lag_p99_ms, 2):>6}ms {r.loadgen_cpu_pct:>6.0f}%{flag}"
    )
    return "\n".join([line, *(render_slice(name, figures) for name, figures in r.slices.items())])


def render_slice(name: str, f: dict[str, Any]) -> str:
    """A class's (mixed) or a phase's (drop) figures, under its point's line."""
    budget = f" {f['budget_ms']:g} ms" if "budget_ms" in f else f" {f['seconds']:g} s"
    late = "" if f.get("late_runs") is None else f", late runs {f['late_runs']} of {f['app_runs']}"
    return (
        f"{'':>{_SERVER_WIDTH}}   {name}{budget}: goodput {f['goodput_per_s']:.1f}/s = {_num(f['goodput_pct'])} % of "
        f"{f['capacity_per_s']:.1f}/s, p99 {_num(f['p99_ms'])} ms ({_num(f['p99_ratio'])}x), "
        f"refused {f['refused']}, t/o {f['timeout']}, err {f['error']}{late}"
    )


def render_table(results: Sequence[PointResult], settings: GoodputSettings, labels: dict[str, str]) -> str:
    """The whole report: parameters, one line per point, the servers' names, and the caveats."""
    classes = ", ".join(f"{c.share:.0%} {c.budget_ms:g} ms" for c in MIXED)
    hosts = (
        f"{settings.threads} worker threads, prazo queue {settings.max_queue}"
        if settings.workers is None
        else f"--workers {settings.workers}: every server {settings.workers} processes of {settings.threads} worker "
        f"threads ({settings.workers * settings.threads} in all), a host queue of {settings.max_queue} "
        f"({settings.queue_per_process} per process where each has a line of its own)"
    )
    lines = [
        f"prazo bench goodput: {hosts}, client budget "
        f"{settings.budget_ms:g} ms (mixed: {classes}), {settings.seconds:g} s of Poisson arrivals per point "
        f"(drop: {settings.drop_seconds:g} s, the app {DROP_FACTOR:g}x slower in the middle third) after "
        f"{settings.warmup_s:g} s of warm-up, capacity: best of {CAPACITY_RUNS} "
        f"{settings.capacity_seconds:g} s closed-loop runs; {os.cpu_count()} CPUs, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "",
        TABLE_HEADER,
    ]
    previous = None
    for r in results:
        if previous is not None and (r.workload, r.server, r.app) != previous:
            lines.append("")
        previous = (r.workload, r.server, r.app)
        lines.append(render_row(r))
    lines.append("")
    lines.extend(f"  {name:<{_SERVER_WIDTH}} {label}" for name, label in labels.items())
    lines.append(
        "late = app runs finished after the client's deadline (count), late% = their share of the runs (exact); "
        "late(srv)% = after the deadline the server knew — on stock servers it UNDER-counts (the app cannot see "
        "time spent in the kernel backlog). p99x = p99 of the good answers / the unloaded p99 (one client at a time)."
    )
    lines.append(
        "good% is of the closed-loop capacity; a mixed class's of its share of it; drop: the drop third's of the "
        "capacity measured slowed down, the whole window's of the time-weighted mean."
    )
    lines.append(
        f"ref% = the requests the server refused (503, 504, 408) as a share of those sent; below capacity (load < 1x) "
        f"{REFUSAL_TARGET_PCT:g} % or more is flagged: issue 21's target at 0.9x is under {REFUSAL_TARGET_PCT:g} %."
    )
    lines.append(_generator_share(results))
    behind = [r for r in results if not r.loadgen_kept_schedule]
    if behind:
        lines.append(
            f"!! the load generator fell behind its schedule (lag p99 > {MAX_LAG_P99_MS:g} ms) at {len(behind)} "
            "point(s): those points measure the generator, not the server."
        )
    return "\n".join(lines)


def _generator_share(results: Sequence[PointResult]) -> str:
    # The generator shares the machine with the servers it measures: say how
    # much of it, as a share of one core and of the whole host.
    cpus = os.cpu_count() or 1
    used = sorted(r.loadgen_cpu_pct for r in results)
    if not used:
        return f"load generator: its own process on this {cpus}-CPU host; no point was measured."
    return (
        f"load generator: its own process, {used[len(used) // 2]:.0f} % of one core at the median point and "
        f"{used[-1]:.0f} % at most, i.e. up to {used[-1] / cpus:.0f} % of this {cpus}-CPU host that the servers had too."
    )


# What the dashed line of each workload's goodput panel is: one slice per point.
PLOT_SLICE = {"mixed": "short", "drop": "drop"}
PLOT_SLICE_TITLE = {
    "mixed": "dashed: the 200 ms class, % of its share",
    "drop": "dashed: inside the drop, % of the slowed capacity",
}


def plot_paths(path: str, workloads: Sequence[str]) -> dict[str, str]:
    """One PNG per workload: ``path`` itself for one, ``STEM-<workload>.png`` beside it for several."""
    if len(workloads) == 1:
        return {workloads[0]: path}
    target = Path(path)
    return {w: str(target.with_name(f"{target.stem}-{w}{target.suffix or '.png'}")) for w in workloads}


def plot(results: Sequence[PointResult], path: str, labels: dict[str, str], workload: str = "steady") -> None:
    """``workload``'s points: goodput (% of capacity) and p99 / unloaded p99 against offered load.

    One column per app, a line per server. Goodput: the dashed grey line is
    the ideal (every answer good up to the capacity, then the capacity); for
    mixed and drop a dashed line per server is the short class / the drop
    third (``PLOT_SLICE``). Hollow markers are points whose load generator
    fell behind.
    """
    results = [r for r in results if r.workload == workload]
    if workload == "drop" and all(r.timeline for r in results):
        plot_timelines(results, path, labels)
        return
    from matplotlib.ticker import NullFormatter

    apps = list(dict.fromkeys(r.app for r in results))
    figure, axes = _figure(len(apps))
    top = max([110.0, *(r.goodput_pct + 5 for r in results if r.goodput_pct is not None)])
    part = PLOT_SLICE.get(workload)
    for column, app in enumerate(apps):
        axis, ratio_axis = axes[0][column], axes[1][column]
        loads = sorted({r.offered_x for r in results if r.app == app})
        axis.plot(loads, [100 * min(1.0, x) for x in loads], linestyle="--", color="grey", linewidth=1, label="ideal")
        for server in dict.fromkeys(r.server for r in results if r.app == app):
            points = [r for r in results if r.app == app and r.server == server and r.goodput_pct is not None]
            (line,) = axis.plot(
                [r.offered_x for r in points],
                [r.goodput_pct for r in points],
                marker="o",
                label=labels.get(server, server),
            )
            color = line.get_color()
            void = [r for r in points if not r.loadgen_kept_schedule]
            axis.plot(
                [r.offered_x for r in void],
                [r.goodput_pct for r in void],
                linestyle="none",
                marker="o",
                markersize=10,
                markerfacecolor="white",
                color=color,
                markeredgecolor=color,
            )
            if part is not None:
                sliced = [(r.offered_x, r.slices[part]["goodput_pct"]) for r in points if part in r.slices]
                if sliced:
                    axis.plot(*zip(*sliced), linestyle="--", marker=".", color=color, linewidth=1)
            ratios = [(r.offered_x, r.p99_ratio) for r in points if r.p99_ratio is not None]
            if ratios:
                ratio_axis.plot(*zip(*ratios), marker="o", color=color)
        for each in (axis, ratio_axis):
            each.set_xscale("log")
            each.set_xticks(loads, [f"{x:g}x" for x in loads])
            each.xaxis.set_minor_formatter(NullFormatter())
        axis.set_ylabel("goodput (% of capacity, answers within their budget)")
        axis.set_title(f"{APP_TITLES.get(app, app)}, {workload}" + (f"\n{PLOT_SLICE_TITLE[workload]}" if part else ""))
        axis.set_ylim(0, top)
        axis.grid(True, alpha=0.3)
        _ratio_panel(ratio_axis, "offered load (x capacity measured in the same run)")
    _save(figure, axes, len(apps), path)


def _figure(panels: int) -> tuple[Any, Any]:
    # Two rows of ``panels`` columns: goodput above, the p99 ratio below
    # (drawn off screen: the Agg backend needs no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(2, panels, figsize=(6.5 * panels, 8.4), squeeze=False, sharex="col")


def _save(figure: Any, axes: Any, panels: int, path: str) -> None:
    # One legend under the panels: inside, it would hide the lines at 0 %.
    # Three columns fit the short labels of one process per server; the
    # longer --workers labels would run off the figure's edges, so two.
    import matplotlib.pyplot as plt

    handles, names = axes[0][0].get_legend_handles_labels()
    columns = 1 if panels == 1 else 3 if max(map(len, names), default=0) <= 60 else 2
    figure.legend(handles, names, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.01 + 0.022 * math.ceil(len(names) / columns), 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _ratio_panel(axis: Any, xlabel: str) -> None:
    # The p99 ratio against ``xlabel``, 1.5 dashed. The ratios span 1-50:
    # log scale, plain numbers at 1, 2, 5, 10, 20, 50.
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    axis.axhline(1.5, linestyle="--", color="grey", linewidth=1)
    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel(xlabel)
    axis.set_ylabel("p99 of good answers / unloaded p99 (dashed: 1.5)")
    axis.grid(True, alpha=0.3, which="both")


def plot_timelines(results: Sequence[PointResult], path: str, labels: dict[str, str]) -> None:
    """Drop points over time: goodput (% of each server's normal capacity) and p99 / unloaded p99, per second.

    One column per app and load, a line per server; the drop third is
    shaded, the dashed grey line is the ideal (the capacity, slowed in the
    drop: the first server's measured ratio).
    """
    columns = list(dict.fromkeys((r.app, r.offered_x) for r in results))
    figure, axes = _figure(len(columns))
    for column, (app, offered_x) in enumerate(columns):
        axis, ratio_axis = axes[0][column], axes[1][column]
        points = [r for r in results if r.app == app and r.offered_x == offered_x]
        phases = drop_phases(points[0].seconds)
        for each in (axis, ratio_axis):
            for phase in phases:
                if phase.slow:
                    each.axvspan(phase.start_s, phase.end_s, color="grey", alpha=0.12)
        first = points[0]
        slowed = 100 * (first.slow_capacity_per_s or 0) / first.capacity_per_s if first.capacity_per_s else 0
        axis.step(
            [0.0, *(ph.start_s for ph in phases[1:]), first.seconds],
            [100.0, *(slowed if ph.slow else 100.0 for ph in phases[1:]), 100.0],
            where="post",
            linestyle="--",
            color="grey",
            linewidth=1,
            label="ideal",
        )
        for r in points:
            width = r.timeline["bin_s"][0]
            centres = [width * (i + 0.5) for i in range(len(r.timeline["good_per_s"]))]
            share = [100 * g / r.capacity_per_s if r.capacity_per_s else 0 for g in r.timeline["good_per_s"]]
            (line,) = axis.plot(centres, share, marker=".", label=labels.get(r.server, r.server))
            ratios = [
                (t, p / r.unloaded_p99_ms)
                for t, p in zip(centres, r.timeline["p99_ms"])
                if p is not None and r.unloaded_p99_ms
            ]
            if ratios:
                ratio_axis.plot(*zip(*ratios), marker=".", color=line.get_color())
        axis.set_ylabel("goodput (% of the normal capacity, answers within 1 s)")
        axis.set_title(f"{APP_TITLES.get(app, app)}, drop at {offered_x:g}x\nshaded: the app {DROP_FACTOR:g}x slower")
        axis.set_ylim(0, max(130.0, *(100 * max(r.timeline["good_per_s"]) / r.capacity_per_s + 5 for r in points)))
        axis.grid(True, alpha=0.3)
        _ratio_panel(ratio_axis, "seconds into the measured window (scheduled time of the request)")
    _save(figure, axes, len(columns), path)
