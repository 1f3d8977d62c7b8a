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
is flagged on its row). A server ``--workers`` cannot run yet (the front
door's, before it lands) is left out with the reason, or is an error when
named in ``--servers``.

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
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import inspect
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from prazo.bench.goodput_apps import ENV_STATS_DIR, read_stats, write_slowdown
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
from prazo.bench.harness import run_standalone
from prazo.bench.loadgen import OUTCOMES, LoadResult, run_in_subprocess

__all__ = [
    "APPS",
    "DRAIN_S",
    "POLICIES",
    "REFUSAL_TARGET_PCT",
    "SERVERS",
    "WORKER_LOADS",
    "WORKER_QUICK_LOADS",
    "WORKER_SERVERS",
    "GoodputSettings",
    "NoCapacity",
    "PointResult",
    "ServerSpec",
    "add_bench_goodput_arguments",
    "bench_goodput",
    "load_points",
    "misses_refusal_target",
    "missing_module",
    "package_version",
    "percentile",
    "plot",
    "plot_paths",
    "policy_environment",
    "refused_pct",
    "render_table",
    "run_bench_goodput",
    "servers_for",
    "summarize",
]

APPS = {"cpu": "prazo.bench.goodput_apps:cpu", "io": "prazo.bench.goodput_apps:io"}
APP_TITLES = {"cpu": "CPU-bound app (10 ms of Python CPU)", "io": "I/O-bound app (50 ms sleep)"}
DEFAULT_LOADS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
QUICK_LOADS = (0.5, 3.0, 10.0)
# --workers adds issue 21's refusal check just below capacity (REFUSAL_TARGET_PCT at 0.9x).
WORKER_LOADS = (0.5, 0.9, 1.0, 2.0, 3.0, 5.0, 10.0)
WORKER_QUICK_LOADS = (0.5, 0.9, 3.0, 10.0)
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
_STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GoodputSettings:
    """Parameters of one ``prazo bench goodput`` run."""

    servers: tuple[str, ...] = ()
    apps: tuple[str, ...] = ("cpu", "io")
    loads: tuple[float, ...] = DEFAULT_LOADS
    seconds: float = 4.0
    warmup_s: float = 1.0
    capacity_seconds: float = 2.0
    threads: int = 4
    max_queue: int = 20
    budget_ms: float = 1000.0
    capacity_budget_ms: float = 10_000.0
    max_requests: int = 50_000
    seed: int = 1
    workloads: tuple[str, ...] = ("steady",)
    # The drop workload's measured window: a third at full speed, a third with
    # the app DROP_FACTOR x slower, a third to recover; and its loads (None: ``loads``).
    drop_seconds: float = 30.0
    drop_loads: tuple[float, ...] | None = None
    # None: today's comparison, every server one process (``SERVERS``). N: the
    # multi-process hosts of issue 21 (``WORKER_SERVERS``), N processes each,
    # ``threads`` per process and ``max_queue`` for the whole host.
    workers: int | None = None

    @property
    def processes(self) -> int:
        """Processes per server: ``workers``, or 1 for the single-process comparison."""
        return self.workers or 1

    @property
    def queue_per_process(self) -> int:
        """Each process's share of ``max_queue`` where every process has a line of its own (rounded up).

        So a host of N independent lines (prazo's gunicorn worker, granian's
        backpressure, the SO_REUSEPORT doors) waits for at least as many as the
        front door's one line, and the comparison is of the sharing, not the sizes.
        """
        return -(-self.max_queue // self.processes)

    def loads_of(self, workload: str) -> tuple[float, ...]:
        """The offered loads of ``workload`` (drop points are long: they may have loads of their own)."""
        return self.drop_loads if workload == "drop" and self.drop_loads else self.loads


QUICK = GoodputSettings(loads=QUICK_LOADS, seconds=2.5, capacity_seconds=1.0, drop_seconds=9.0)


# -- the servers ------------------------------------------------------------------


@dataclass(frozen=True)
class Process:
    """One process of a server setup: its command line and extra environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server of the comparison.

    ``processes(app, port, settings, workdir)`` returns the processes to start,
    in order; the last one must answer HTTP on ``port``. ``unavailable()``
    says why it cannot run here (None when it can).
    """

    name: str
    label: Callable[[], str]
    processes: Callable[[str, int, GoodputSettings, Path], list[Process]]
    unavailable: Callable[[], str | None]
    default: bool = True


def package_version(package: str) -> str:
    """The installed version of ``package``, or ``?``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def missing_module(name: str, install: str) -> Callable[[], str | None]:
    """A check that says why module ``name`` cannot run (not installed: ``install`` it), or None."""
    return lambda: None if importlib.util.find_spec(name) is not None else f"{name} is not installed ({install})"


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _stock_waitress(app: str, port: int, s: GoodputSettings) -> Process:
    return Process(_python("-m", "waitress", f"--listen=127.0.0.1:{port}", f"--threads={s.threads}", app))


def _prazo_serve(server: str, policy: str = "") -> Callable[[str, int, GoodputSettings, Path], list[Process]]:
    def processes(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
        argv = _python(
            "-m", "prazo.bindings.servers.serve", app, "--server", server, "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(s.threads), "--max-queue", str(s.max_queue),
            "--shutdown-timeout", "1", *POLICIES.get(policy, ()),
            # The front door's own --workers: one host-wide line of max_queue.
            *(() if s.workers is None else ("--workers", str(s.workers))),
        )  # fmt: skip
        return [Process(argv)]

    return processes


def _gunicorn_process(worker: str, app: str, port: int, s: GoodputSettings, policy: str = "") -> Process:
    argv = _python(
        "-m", "gunicorn", "-k", worker, "--threads", str(s.threads), "--workers", str(s.processes),
        "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "1", "--no-control-socket",
        "--log-level", "warning", app,
    )  # fmt: skip
    # PRAZO_MAX_QUEUE is each worker process's line (stock gthread ignores it).
    return Process(argv, {"PRAZO_MAX_QUEUE": str(s.queue_per_process), **policy_environment(policy)})


def _gunicorn(worker: str, policy: str = "") -> Callable[[str, int, GoodputSettings, Path], list[Process]]:
    return lambda app, port, s, workdir: [_gunicorn_process(worker, app, port, s, policy)]


def _stock_gunicorn(app: str, port: int, s: GoodputSettings) -> Process:
    return _gunicorn_process("gthread", app, port, s)


# The queue policies of issue 11 as `prazo serve` options, one configuration
# each, measured beside the plain fixed FIFO queue: `<server>+<policy>`.
POLICIES: dict[str, tuple[str, ...]] = {
    # Doomed-work skip: answer 504 at once a request whose remaining budget is
    # under the live p90 of this queue's service times.
    "doomed": ("--expected-service-ms", "p90"),
    # Adaptive LIFO + CoDel (Fail at Scale), at the contract's defaults
    # (target 5 ms, interval 100 ms).
    "adaptive": ("--order", "adaptive"),
    # The Vegas adaptive concurrency limit, between 1 and --threads.
    "vegas": ("--limit", "vegas", "--min-concurrency", "1"),
    # The pick, from the preliminary pass (NOTES-bench-policies.md): adaptive
    # LIFO is what holds goodput and p99 on mixed budgets and through a drop;
    # a CoDel target near the service time (50 ms, not 5) sheds less at 1x;
    # the doomed skip costs nothing and stops starting dead work. Not Vegas:
    # it read the app's 3x slowdown as queueing and cut the limit, 13 % goodput in the drop.
    "best": ("--order", "adaptive", "--codel-target-ms", "50", "--expected-service-ms", "p90"),
}
POLICY_TITLES = {
    "doomed": "doomed-work skip, learned p90",
    "adaptive": "adaptive LIFO + CoDel",
    "vegas": "Vegas adaptive limit",
    "best": "adaptive LIFO + CoDel (target 50 ms) + doomed-work skip (p90)",
}


def policy_environment(policy: str) -> dict[str, str]:
    """``POLICIES[policy]`` as the ``PRAZO_*`` environment variables (for servers started without ``prazo serve``)."""
    options = POLICIES.get(policy, ())
    return {
        "PRAZO_" + flag.removeprefix("--").replace("-", "_").upper(): value
        for flag, value in zip(options[::2], options[1::2])
    }


def _serve_knows(policy: str) -> Callable[[], str | None]:
    def unavailable() -> str | None:
        from prazo.bindings.servers.serve import build_serve_parser

        try:
            _, unknown = build_serve_parser().parse_known_args([*POLICIES[policy], "m:app"])
        except SystemExit:
            unknown = list(POLICIES[policy])
        return None if not unknown else f"`prazo serve` has no {' '.join(POLICIES[policy])} on this branch"

    return unavailable


def _front_door_policies() -> str | None:
    # `prazo serve` may know the flags while the front door does not read them
    # (it would silently measure the plain FIFO queue under a policy's name).
    from prazo.bindings.servers.frontdoor import create_server

    if "order" in inspect.signature(create_server).parameters:
        return None
    return "the front door takes no queue policies on this branch"


def _both(*checks: Callable[[], str | None]) -> Callable[[], str | None]:
    return lambda: next((why for why in (check() for check in checks) if why is not None), None)


def _granian(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
    argv = _python(
        "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(s.processes), "--blocking-threads", str(s.threads),
        # Per worker process: the host's max_queue shared out.
        "--backpressure", str(s.queue_per_process), "--log-level", "warning", app,
    )  # fmt: skip
    return [Process(argv)]


def _haproxy(
    queue_timeout_ms: int, backend: Callable[[str, int, GoodputSettings], Process] = _stock_waitress
) -> Callable[[str, int, GoodputSettings, Path], list[Process]]:
    def processes(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
        backend_port = _free_port()
        config = workdir / "haproxy.cfg"
        # The tuned setup of issue 10: at most one request per worker thread
        # of the backend (every process's), the rest wait in HAProxy's queue
        # for at most the timeout and are answered 503 after it. One thread:
        # it shares 2 CPUs with the app and the load generator.
        config.write_text(
            "global\n    maxconn 8000\n    nbthread 1\n"
            "defaults\n    mode http\n    timeout connect 1s\n    timeout client 10s\n    timeout server 10s\n"
            f"    timeout queue {queue_timeout_ms}ms\n"
            f"frontend front\n    bind 127.0.0.1:{port}\n    default_backend app\n"
            f"backend app\n    server backend 127.0.0.1:{backend_port} maxconn {s.threads * s.processes}\n"
        )
        return [backend(app, backend_port, s), Process(["haproxy", "-db", "-f", str(config)])]

    return processes


def _no_haproxy() -> str | None:
    return None if shutil.which("haproxy") else "haproxy is not installed (apt-get install haproxy)"


def _no_front_door() -> str | None:
    from prazo.bindings.servers.serve import SERVERS as SERVE_SERVERS

    return None if "prazo" in SERVE_SERVERS else "`prazo serve --server prazo` does not exist on this branch"


def _haproxy_label(queue_timeout: str, maxconn: str = "4", backend: str = "waitress") -> Callable[[], str]:
    def label() -> str:
        version = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, check=False).stdout.split()
        return (
            f"HAProxy {version[2] if len(version) > 2 else '?'} (maxconn {maxconn}, timeout queue {queue_timeout}) "
            f"+ {backend}"
        )

    return label


_waitress_ok = missing_module("waitress", "pip install 'prazo[servers]'")
_gunicorn_ok = missing_module("gunicorn", "pip install 'prazo[servers]'")
_granian_ok = missing_module("granian", "pip install granian")
_PRAZO_WORKER = "prazo.bindings.servers.gunicorn.AdmissionWorker"


def _policy_specs() -> list[ServerSpec]:
    """``<server>+<policy>`` for each prazo server and each of ``POLICIES`` (not in the default run)."""
    bases: list[tuple[str, str, Callable[[str], Callable[[str, int, GoodputSettings, Path], list[Process]]], Any]] = [
        ("prazo-waitress", "prazo waitress embedding", lambda p: _prazo_serve("waitress", p), _waitress_ok),
        ("prazo-gunicorn", "prazo gunicorn AdmissionWorker", lambda p: _gunicorn(_PRAZO_WORKER, p), _gunicorn_ok),
        (
            "frontdoor",
            "prazo front door",
            lambda p: _prazo_serve("prazo", p),
            _both(_no_front_door, _front_door_policies),
        ),
    ]
    return [
        ServerSpec(
            f"{base}+{policy}",
            _fixed(f"{title} + {POLICY_TITLES[policy]}"),
            processes(policy),
            _both(installed, _serve_knows(policy)),
            default=False,
        )
        for base, title, processes, installed in bases
        for policy in POLICIES
    ]


def _fixed(text: str) -> Callable[[], str]:
    return lambda: text


# The comparison, in table order. Adding a server is one entry here.
SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(
            "waitress",
            lambda: f"stock waitress {package_version('waitress')}",
            lambda app, port, s, workdir: [_stock_waitress(app, port, s)],
            _waitress_ok,
        ),
        ServerSpec("prazo-waitress", lambda: "prazo waitress embedding", _prazo_serve("waitress"), _waitress_ok),
        ServerSpec(
            "gunicorn",
            lambda: f"stock gunicorn {package_version('gunicorn')} gthread",
            _gunicorn("gthread"),
            _gunicorn_ok,
        ),
        ServerSpec(
            "prazo-gunicorn",
            lambda: "prazo gunicorn AdmissionWorker",
            _gunicorn(_PRAZO_WORKER),
            _gunicorn_ok,
        ),
        ServerSpec("frontdoor", lambda: "prazo front door", _prazo_serve("prazo"), _no_front_door),
        ServerSpec(
            "granian",
            lambda: f"granian {package_version('granian')} (--backpressure 20)",
            _granian,
            _granian_ok,
        ),
        ServerSpec("haproxy", _haproxy_label("200ms"), _haproxy(200), _no_haproxy),
        ServerSpec("haproxy-1s", _haproxy_label("1s"), _haproxy(1000), _no_haproxy, default=False),
        *_policy_specs(),
    )
}


def _front_door_workers() -> str | None:
    # Asked of `prazo serve` itself, not of a version: its option checks say
    # whether the front door takes --workers. The probe can never serve: its
    # app is no MODULE:APP and its shutdown timeout is negative, so it ends in
    # an option error either way; the question is only which one.
    from prazo.bindings.servers.serve import build_serve_parser, run_serve

    probe = ["no-app", "--server", "prazo", "--workers", "2", "--shutdown-timeout", "-1"]
    errors = io.StringIO()
    with redirect_stderr(errors):
        run_serve(build_serve_parser().parse_args(probe), io.StringIO())
    said = errors.getvalue().strip()
    if "--workers" not in said:
        return None
    return f"the front door has no --workers on this branch (`prazo serve --server prazo --workers 2`: {said})"


def _no_reuse_port() -> str | None:
    from prazo.bindings.servers.frontdoor import create_server

    if "reuse_port" in inspect.signature(create_server).parameters:
        return None
    return "the front door's create_server takes no reuse_port on this branch"


def _reuseport_frontdoors(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
    argv = _python(
        "-m", "prazo.bench.reuseport_frontdoors", app, "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(s.processes), "--threads", str(s.threads), "--max-queue", str(s.queue_per_process),
    )  # fmt: skip
    return [Process(argv)]


# `--workers N` (issue 21): every server N processes, in table order. Their
# labels say N; the report's first line says what N was.
WORKER_SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(
            "frontdoor",
            _fixed("prazo front door --workers N (one C triage process, one host-wide line of max_queue)"),
            _prazo_serve("prazo"),
            _both(_no_front_door, _front_door_workers),
        ),
        ServerSpec(
            "gunicorn",
            lambda: f"stock gunicorn {package_version('gunicorn')} gthread -w N",
            _gunicorn("gthread"),
            _gunicorn_ok,
        ),
        ServerSpec(
            "prazo-gunicorn",
            _fixed("prazo gunicorn AdmissionWorker -w N (a line of max_queue/N each)"),
            _gunicorn(_PRAZO_WORKER),
            _gunicorn_ok,
        ),
        ServerSpec(
            "granian",
            lambda: f"granian {package_version('granian')} --workers N (--backpressure max_queue/N each)",
            _granian,
            _granian_ok,
        ),
        ServerSpec(
            "haproxy",
            _haproxy_label("200ms", "N x threads", "stock gunicorn gthread -w N"),
            _haproxy(200, _stock_gunicorn),
            _both(_no_haproxy, _gunicorn_ok),
        ),
        ServerSpec(
            "frontdoor-reuseport",
            _fixed("N front doors on one SO_REUSEPORT port, a line of max_queue/N each (issue 21's prototype B)"),
            _reuseport_frontdoors,
            _both(_no_front_door, _no_reuse_port),
        ),
    )
}


def servers_for(workers: int | None) -> dict[str, ServerSpec]:
    """The comparison a run chooses its servers from: ``SERVERS`` without ``--workers``, else ``WORKER_SERVERS``."""
    return SERVERS if workers is None else WORKER_SERVERS


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _ping(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=2)
    try:
        connection.request("GET", "/ping", headers={"X-Request-Budget-Ms": "5000"})
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


@dataclass
class _Target:
    host: str
    port: int
    stats_dir: str | None


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    # Each server runs in its own process group (gunicorn's and granian's
    # workers with it), so one signal reaches them all. Killed, not stopped
    # gracefully: the point is measured, and a stock server would otherwise
    # work off its backlog of dead requests first.
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


@contextmanager
def started(spec: ServerSpec, app: str, settings: GoodputSettings) -> Iterator[_Target]:
    """``spec`` serving ``app`` on a free loopback port, with a fresh stats directory; stopped after."""
    with tempfile.TemporaryDirectory(prefix="prazo-goodput-") as directory:
        workdir = Path(directory)
        stats_dir = workdir / "stats"
        stats_dir.mkdir()
        port = _free_port()
        running: list[subprocess.Popen[bytes]] = []
        try:
            # ``app`` names one of APPS, or is itself a module:callable path.
            for index, process in enumerate(spec.processes(APPS.get(app, app), port, settings, workdir)):
                log = open(workdir / f"server-{index}.log", "wb")  # noqa: SIM115 - closed with the process
                env = {**os.environ, **process.env, ENV_STATS_DIR: str(stats_dir)}
                running.append(
                    subprocess.Popen(
                        process.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
                log.close()
            end = time.monotonic() + _STARTUP_TIMEOUT_S
            while not _ping("127.0.0.1", port):
                dead = [p for p in running if p.poll() is not None]
                if dead or time.monotonic() > end:
                    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(workdir.glob("*.log")))
                    raise RuntimeError(f"{spec.name} did not start serving {app} on port {port}:\n{logs}")
                time.sleep(0.1)
            yield _Target("127.0.0.1", port, str(stats_dir))
        finally:
            _stop(running)


# -- one point --------------------------------------------------------------------


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


def _stats(target: _Target) -> dict[str, int] | None:
    return None if target.stats_dir is None else read_stats(target.stats_dir)


def _delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if after is None or before is None:
        return None
    return {name: after[name] - before[name] for name in after}


def _drain(target: _Target) -> None:
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


def measure_capacity(target: _Target, settings: GoodputSettings, clients: int | None = None) -> float:
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


def measure_unloaded_p99(target: _Target, settings: GoodputSettings) -> float | None:
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


def measure_slow_capacity(target: _Target, settings: GoodputSettings) -> float:
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


def measure_baseline(target: _Target, settings: GoodputSettings) -> Baseline:
    """The capacity, then the unloaded p99, then (when the drop workload is asked for) the slowed capacity.

    Each the best of ``CAPACITY_RUNS`` runs of ``capacity_seconds``.
    """
    capacity = measure_capacity(target, settings)
    unloaded = measure_unloaded_p99(target, settings)
    slow = measure_slow_capacity(target, settings) if "drop" in settings.workloads else None
    return Baseline(capacity, unloaded, slow)


def run_point(
    target: _Target,
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
    """The baseline, then every workload at every load, each point on a fresh server.

    A point whose generator fell behind its schedule is run once more
    (``ATTEMPTS``), then reported as it is.
    """
    with started(spec, app, settings) as target:
        baseline = measure_baseline(target, settings)
    results = []
    for workload in settings.workloads:
        for offered_x in settings.loads_of(workload):
            for _attempt in range(ATTEMPTS):
                with started(spec, app, settings) as target:
                    result = run_point(target, spec.name, app, offered_x, baseline, settings, workload)
                if result.loadgen_kept_schedule:
                    break
            progress(result)
            results.append(result)
    return results


def run_target(
    target: _Target, name: str, app: str, settings: GoodputSettings, progress: Callable[[PointResult], None]
) -> list[PointResult]:
    """The same on a server started by someone else (never restarted: the bench waits between points)."""
    baseline = measure_baseline(target, settings)
    _drain(target)
    results = []
    for workload in settings.workloads:
        for offered_x in settings.loads_of(workload):
            for _attempt in range(ATTEMPTS):
                result = run_point(target, name, app, offered_x, baseline, settings, workload)
                _drain(target)
                if result.loadgen_kept_schedule:
                    break
            progress(result)
            results.append(result)
    return results


# -- report -----------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _refusals_of(result: PointResult, status: str) -> int:
    return sum(count for key, count in result.refusals.items() if key.split(" ", 1)[0] == status)


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    results = [r for r in results if r.workload == workload]
    if workload == "drop" and all(r.timeline for r in results):
        plot_timelines(results, path, labels)
        return
    apps = list(dict.fromkeys(r.app for r in results))
    figure, axes = plt.subplots(2, len(apps), figsize=(6.5 * len(apps), 8.4), squeeze=False, sharex="col")
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
        ratio_axis.axhline(1.5, linestyle="--", color="grey", linewidth=1)
        _ratio_scale(ratio_axis)
        ratio_axis.set_xlabel("offered load (x capacity measured in the same run)")
        ratio_axis.set_ylabel("p99 of good answers / unloaded p99 (dashed: 1.5)")
        ratio_axis.grid(True, alpha=0.3, which="both")
    _legend_below(figure, axes, len(apps))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _legend_below(figure: Any, axes: Any, panels: int) -> None:
    # One legend under the panels: inside, it would hide the lines at 0 %.
    # Three columns fit the short labels of one process per server; the
    # longer --workers labels would run off the figure's edges, so two.
    handles, names = axes[0][0].get_legend_handles_labels()
    columns = 1 if panels == 1 else 3 if max(map(len, names), default=0) <= 60 else 2
    figure.legend(handles, names, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.01 + 0.022 * math.ceil(len(names) / columns), 1, 1))


def _ratio_scale(axis: Any) -> None:
    # p99 ratios span 1-50: log scale, plain numbers at 1, 2, 5, 10, 20, 50.
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_formatter(NullFormatter())


def plot_timelines(results: Sequence[PointResult], path: str, labels: dict[str, str]) -> None:
    """Drop points over time: goodput (% of each server's normal capacity) and p99 / unloaded p99, per second.

    One column per app and load, a line per server; the drop third is
    shaded, the dashed grey line is the ideal (the capacity, slowed in the
    drop: the first server's measured ratio).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(dict.fromkeys((r.app, r.offered_x) for r in results))
    figure, axes = plt.subplots(2, len(columns), figsize=(6.5 * len(columns), 8.4), squeeze=False, sharex="col")
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
        ratio_axis.axhline(1.5, linestyle="--", color="grey", linewidth=1)
        _ratio_scale(ratio_axis)
        ratio_axis.set_xlabel("seconds into the measured window (scheduled time of the request)")
        ratio_axis.set_ylabel("p99 of good answers / unloaded p99 (dashed: 1.5)")
        ratio_axis.grid(True, alpha=0.3, which="both")
    _legend_below(figure, axes, len(columns))
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- command line -----------------------------------------------------------------


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
            running = _Target(target[0], target[1], args.stats_dir)
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
