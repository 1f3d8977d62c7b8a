"""``prazo bench goodput``: goodput under overload, CPU-bound and I/O-bound apps, every server in one run (issue 10).

Usage::

    prazo bench goodput [--quick] [--json] [--plot FILE.png]
        [--servers waitress,prazo-waitress,...] [--apps cpu,io] [--loads 0.5,1,2,3,5,10] [--seconds 4]
        [--workload steady,mixed,drop] [--drop-seconds 30]
    prazo bench goodput --workers [N] [--servers frontdoor,gunicorn,...] [...]
    prazo bench goodput --target 127.0.0.1:8000 --app cpu [--stats-dir DIR] [--name mine]

**Multi-process hosts** (issue 21): ``--workers N`` compares servers that
each run N processes (``WORKER_SERVERS``): the front door's own ``--workers``
(one C triage process, one host-wide line), stock gunicorn gthread and prazo's
gunicorn worker ``-w N``, granian ``--workers N``, the tuned HAProxy (maxconn
N x threads) in front of gunicorn ``-w N``, and ``frontdoor-reuseport``, N
independent front doors on one ``SO_REUSEPORT`` port (the issue's prototype B,
``prazo.bench.reuseport_frontdoors``). ``--threads`` stays per process (4),
``max_queue`` (20) is the host's: a server with a line per process gets
``max_queue / N`` each. ``--workers`` alone is N = the number of CPUs; without
``--workers`` the run is the single-process comparison below, unchanged
(``SERVERS``). Its default loads add 0.9x, where issue 21 wants fewer than
``REFUSAL_TARGET_PCT`` % refused (the ``ref%`` column; a miss below capacity
is flagged on its row). A server that cannot run on this machine (waitress,
gunicorn or granian not installed, no haproxy binary) is left out with the
reason, or is an error when named in ``--servers``.

**Workloads** (issue 11; ``prazo.bench.goodput_workloads`` says exactly how
each is cut and what its goodput % is of): ``steady`` (the default: one 1 s
budget), ``mixed`` (half the clients 200 ms, half 2 s; figures per class),
``drop`` (the app 3x slower in the middle third of a 30 s window; figures per
third). **Policies**: ``<server>+<policy>`` runs a prazo server with one of
``POLICIES`` (``prazo-waitress+adaptive``, ``frontdoor+best``, ...); those are
not in the default run, name them with ``--servers``.

**Measuring a server that is already running** (a front-door prototype, say):
start it on any port with one of the two apps, ``prazo.bench.goodput_apps:cpu``
(10 ms of Python CPU) or ``prazo.bench.goodput_apps:io`` (50 ms sleep), 4
worker threads, and ``PRAZO_GOODPUT_STATS_DIR=/tmp/somewhere`` in its
environment (an empty directory: the apps count their late runs there, in
every process); then ``prazo bench goodput --target HOST:PORT --app cpu
--stats-dir /tmp/somewhere``. It measures the capacity (closed loop) and then
runs the offered loads against the same process, waiting for it to go quiet
between points (it is not restarted, unlike the servers the bench starts
itself). Without ``--stats-dir`` the late-runs column is ``-``. To add a
server to the comparison for good, add one ``ServerSpec`` to ``SERVERS``.

**What one point is.** A fresh server (a subprocess; ``SERVERS``) with one
app, 4 worker threads, 1 s client budgets, and (prazo variants) a queue of
20. First its capacity: a closed-loop run with ``3 x threads`` clients and
10 s budgets, answers per second, best of three. Then, each on a freshly started server,
open-loop Poisson loads at ``--loads`` times that capacity from the load
generator's own process (``prazo.bench.loadgen``: one new connection per
request, the client gives up and closes the connection at its 1 s budget):
1 s of warm-up (the first arrivals meet an empty queue), then ``--seconds``
measured. Only requests scheduled in the measured window count, and the
app's counters are read when it opens and when it closes (the steady state;
not the backlog a stock server works off after the load stops).

Columns: ``goodput/s`` = complete 200s within the client's budget per second
of the window; ``good%`` = that as a share of the capacity measured in the
same run (it can pass 100 by the noise of the capacity run); ``late`` = the
count of app runs finished in the window after their client's deadline, and ``late%`` = app
runs finished in the window after their client's deadline — wasted work,
exact for every server (the client's give-up time travels in a bench-only
header, on the machine's shared monotonic clock); ``late(srv)%`` = finished
after the deadline the server itself knew (``prazo.deadline``; on a stock
server the time it handed the request to the app plus the budget header —
this UNDER-counts, the app cannot see the time spent in the kernel's backlog
or the server's queue); ``p99`` = 99th percentile latency of the good
answers, and ``p99x`` = that / the unloaded p99 (one client, one request at a
time, on the same server); then what the others got: ``503``, ``504``, ``408`` (refusals, by
reason in the JSON), ``ref%`` (all three as a share of the requests sent),
``t/o`` (no answer within the budget: the client gave
up), ``err`` (connection refused/reset or closed without an answer); ``lag``
= the load generator's p99 lateness in sending, and ``gen cpu`` its CPU use
(of one core; the report's last lines say how much of the host that is). A
point whose generator fell behind its schedule (lag p99 > 10 ms) is run once
more, then flagged ``!!``: it does not count, and the exit status is 1.

**The code.** This module is the command (its options, ``run_bench_goodput``,
``bench_goodput``); the run's parameters are ``prazo.bench.goodput_settings``,
the servers (``SERVERS``, ``WORKER_SERVERS``, ``POLICIES``) and starting them
``prazo.bench.goodput_servers``, the measurement (capacity, points,
``REFUSAL_TARGET_PCT``) ``prazo.bench.goodput_measure``, and the table and
plots ``prazo.bench.goodput_report``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from prazo.bench.goodput_apps import ENV_STATS_DIR
from prazo.bench.goodput_measure import NoCapacity, PointResult, run_server_app, run_target
from prazo.bench.goodput_report import TABLE_HEADER, plot, plot_paths, render_row, render_table
from prazo.bench.goodput_servers import APPS, SERVERS, WORKER_SERVERS, ServerSpec, Target, servers_for
from prazo.bench.goodput_settings import QUICK, QUICK_LOADS, WORKER_LOADS, WORKER_QUICK_LOADS, GoodputSettings
from prazo.bench.goodput_workloads import WORKLOADS
from prazo.bench.harness import run_standalone

__all__ = ["add_bench_goodput_arguments", "bench_goodput", "load_points", "run_bench_goodput"]


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be numbers > 0, got {text!r}")
    return values


def add_bench_goodput_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``prazo bench goodput`` on ``parser``."""
    default_servers = ",".join(name for name, spec in SERVERS.items() if spec.default)
    parser.add_argument(
        "--quick", action="store_true", default=False, help=f"loads {','.join(map(str, QUICK_LOADS))} of 2.5 s each"
    )
    parser.add_argument("--json", action="store_true", default=False, help="one JSON object per point on stdout")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="goodput and p99 ratio vs offered load (needs matplotlib); several workloads: FILE-<workload>.png each",
    )
    parser.add_argument(
        "--servers",
        default=None,
        help=f"comma-separated, of {','.join(SERVERS)} (default: those installed of {default_servers}); "
        f"with --workers, of {','.join(WORKER_SERVERS)} (default: those available)",
    )
    parser.add_argument(
        "--workers",
        nargs="?",
        const=str(os.cpu_count() or 1),
        default=None,
        metavar="N",
        help="compare multi-process hosts, every server N processes (N omitted: the number of CPUs, "
        f"{os.cpu_count()} here); absent: the single-process comparison",
    )
    parser.add_argument("--apps", default="cpu,io", help="cpu, io or both (default cpu,io)")
    parser.add_argument(
        "--workload",
        default="steady",
        help=f"comma-separated, of {','.join(WORKLOADS)} (default steady; see prazo.bench.goodput_workloads)",
    )
    parser.add_argument(
        "--drop-seconds",
        type=float,
        default=None,
        help="seconds measured per drop point, the app slowed in the middle third (default 30)",
    )
    parser.add_argument(
        "--drop-loads", type=_float_list, default=None, help="the drop workload's loads (default: --loads)"
    )
    parser.add_argument(
        "--loads", type=_float_list, default=None, help="multiples of capacity (default 0.5,1,2,3,5,10)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="seconds measured per point, after 1 s of warm-up (default 4)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"worker threads per server process (default {GoodputSettings.threads}; on a free-threaded CPython one "
        "process with N threads can use N cores)",
    )
    parser.add_argument(
        "--from-json",
        metavar="FILE,...",
        default=None,
        help="measure nothing: the table and --plot from the points of earlier --json runs (one JSON object a line)",
    )
    parser.add_argument("--target", metavar="HOST:PORT", default=None, help="measure a server already running")
    parser.add_argument("--app", choices=tuple(APPS), default=None, help="with --target: the app it serves")
    parser.add_argument("--stats-dir", default=None, help=f"with --target: the server's ${ENV_STATS_DIR}")
    parser.add_argument("--name", default="target", help="with --target: its name in the table")


def _settings_from(args: argparse.Namespace) -> tuple[GoodputSettings, list[str]]:
    """The settings and the notes on servers left out; ValueError for bad options."""
    settings = QUICK if args.quick else GoodputSettings()
    workers = _workers_from(args.workers)
    registry = servers_for(workers)
    notes = []
    if args.servers is None:
        servers = []
        for name, spec in registry.items():
            if not spec.default:
                continue
            why = spec.unavailable()
            if why is None:
                servers.append(name)
            else:
                notes.append(f"{name} left out: {why}")
    else:
        servers = [name.strip() for name in args.servers.split(",") if name.strip()]
        unknown = [name for name in servers if name not in registry]
        if unknown or not servers:
            with_workers = "" if workers is None else " with --workers"
            raise ValueError(f"--servers must name some of {','.join(registry)}{with_workers}, got {args.servers!r}")
        for name in servers:
            why = registry[name].unavailable()
            if why is not None:
                raise ValueError(f"{name}: {why}")
    apps = tuple(name.strip() for name in args.apps.split(",") if name.strip())
    if not apps or any(app not in APPS for app in apps):
        raise ValueError(f"--apps must name some of {','.join(APPS)}, got {args.apps!r}")
    if args.seconds is not None and not (math.isfinite(args.seconds) and args.seconds > 0):
        raise ValueError(f"--seconds must be a finite number > 0, got {args.seconds}")
    if args.threads is not None and not 1 <= args.threads <= 256:
        raise ValueError(f"--threads must be between 1 and 256, got {args.threads}")
    if args.drop_seconds is not None and not (math.isfinite(args.drop_seconds) and args.drop_seconds > 0):
        raise ValueError(f"--drop-seconds must be a finite number > 0, got {args.drop_seconds}")
    workloads = tuple(dict.fromkeys(name.strip() for name in args.workload.split(",") if name.strip()))
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise ValueError(f"--workload must name some of {','.join(WORKLOADS)}, got {args.workload!r}")
    default_loads = settings.loads
    if workers is not None:
        default_loads = WORKER_QUICK_LOADS if args.quick else WORKER_LOADS
    settings = replace(
        settings,
        servers=tuple(servers),
        apps=apps,
        loads=args.loads or default_loads,
        workers=workers,
        seconds=args.seconds or settings.seconds,
        workloads=workloads,
        drop_seconds=args.drop_seconds or settings.drop_seconds,
        drop_loads=args.drop_loads,
        threads=args.threads or settings.threads,
    )
    return settings, notes


def _workers_from(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        workers = int(text)
    except ValueError:
        workers = 0
    if workers < 1:
        raise ValueError(f"--workers must be an integer >= 1 (processes per server), got {text!r}")
    return workers


def _parse_target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--target must be HOST:PORT, got {text!r}")
    return host, int(port)


def load_points(paths: Sequence[str]) -> list[PointResult]:
    """The points of earlier ``--json`` runs (lines that are not a JSON object are skipped); ValueError when none."""
    points = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for line in file:
                if line.lstrip().startswith("{"):
                    points.append(PointResult(**json.loads(line)))
    if not points:
        raise ValueError(f"--from-json: no point in {', '.join(paths)}")
    return points


def _report(
    results: list[PointResult], settings: GoodputSettings, labels: dict[str, str], args: argparse.Namespace, out: TextIO
) -> None:
    if not args.json:
        print(render_table(results, settings, labels), file=out)
    if args.plot:
        workloads = [w for w in WORKLOADS if any(r.workload == w for r in results)]
        for workload, path in plot_paths(args.plot, workloads).items():
            plot(results, path, labels, workload)
            print(f"plot written to {path}", file=sys.stderr)


def _label_of(spec: ServerSpec, workers: int | None) -> str:
    # The worker servers' labels say N; the table's legend and the plot's say how many.
    return spec.label() if workers is None else f"{spec.label()} [N = {workers}]"


def run_bench_goodput(args: argparse.Namespace, out: TextIO) -> int:
    """Run the benchmark as ``args`` (from ``add_bench_goodput_arguments``) say; print the table or JSON."""
    if args.from_json:
        try:
            points = load_points([path for path in args.from_json.split(",") if path])
        except (OSError, ValueError, TypeError) as exc:
            print(f"prazo bench goodput: error: {exc}", file=sys.stderr)
            return 2
        workers = points[0].workers
        registry = servers_for(workers)
        known = {
            name: _label_of(registry[name], workers) if name in registry else name
            for name in (r.server for r in points)
        }
        seconds = {r.workload: r.seconds for r in points}
        loaded = replace(
            GoodputSettings(),
            workers=workers,
            seconds=seconds.get("steady", seconds.get("mixed", GoodputSettings.seconds)),
            drop_seconds=seconds.get("drop", GoodputSettings.drop_seconds),
        )
        _report(points, loaded, known, argparse.Namespace(json=False, plot=args.plot), out)
        return 0
    try:
        settings, notes = _settings_from(args)
        target = None if args.target is None else _parse_target(args.target)
        if target is not None and args.app is None:
            raise ValueError("--target needs --app cpu|io (the app that server runs)")
        if target is not None and "drop" in settings.workloads and args.stats_dir is None:
            raise ValueError("--workload drop with --target needs --stats-dir (the slowdown schedule is written there)")
    except ValueError as exc:
        print(f"prazo bench goodput: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        import matplotlib  # noqa: F401 - fail before the run, not after it

    def progress(result: PointResult) -> None:
        if args.json:
            print(json.dumps(result.to_json()), file=out, flush=True)
        print(render_row(result), file=sys.stderr, flush=True)

    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(TABLE_HEADER, file=sys.stderr)
    results: list[PointResult] = []
    labels: dict[str, str] = {}
    try:
        if target is not None:
            labels[args.name] = f"{args.name} at {args.target} (started outside the bench)"
            running = Target(target[0], target[1], args.stats_dir)
            results.extend(run_target(running, args.name, args.app, settings, progress))
        else:
            registry = servers_for(settings.workers)
            for name in settings.servers:
                labels[name] = _label_of(registry[name], settings.workers)
                for app in settings.apps:
                    results.extend(run_server_app(registry[name], app, settings, progress))
    except NoCapacity as exc:
        print(f"prazo bench goodput: error: {exc}", file=sys.stderr)
        return 1
    _report(results, settings, labels, args, out)
    return 0 if all(r.loadgen_kept_schedule for r in results) else 1


def bench_goodput(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``prazo bench goodput`` as a standalone program; returns the exit status."""
    return run_standalone("prazo bench goodput", __doc__, add_bench_goodput_arguments, run_bench_goodput, argv, out)


if __name__ == "__main__":
    sys.exit(bench_goodput())
