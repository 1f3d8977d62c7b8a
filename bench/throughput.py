"""``prazo bench throughput``: answers per second of a hello-world app on every server, one CPU each.

::

    prazo bench throughput [--servers waitress,prazo-waitress,...] [--rounds 2] [--duration 8]
                           [--connections 32] [--loadgen auto|wrk|prazo] [--json] [--plot FILE.png]

The per-request cost of each server, measured the way issue 22 measured it:
the app answers every request with a 13-byte body and a ``Content-Length``;
each server runs with its worker threads (``--threads``) on one CPU (CPU 0,
with ``taskset`` when the machine has one and more than one CPU) and the load
generator on another (CPU 1), so a server's answers per second are the
inverse of what a request costs it on one core. The load is closed loop:
``--connections`` clients, each sending its next request as soon as the
previous one was answered.

The load generator is ``wrk`` (keep-alive connections, ``-t1``) when it is
installed (``apt-get install wrk``) and otherwise prazo's own
(``prazo.bench.loadgen --closed``, a new connection per request, so its
figures are lower and include the cost of accepting a connection: compare
servers of one run, never with a run of the other generator).

Rounds are interleaved (every server once, then every server again) so a
burst of load from elsewhere on the machine hits all of them alike; each
server's figure is the best of its rounds. The prazo servers get a line of
``--max-queue`` places, more than the connections, so they never refuse: the
point is the cost of an admitted request. Ratios: each prazo embedding
against the stock server it embeds in, and every server against the fastest.

The report names the machine it ran on (a ``machine:`` line; ``"machine"``
in the JSON: the CPU model, the CPUs, the system and kernel, the
interpreter): the ratios between servers move with the CPU, so figures from
two machines are two runs, never one. ``prazo bench instructions`` counts
what a request costs each server in instructions, which the CPU does not
change.

Servers (those not installed are skipped with a note): bjoern, granian, uWSGI
(the ``peers`` extra: ``pip install 'prazo[peers]'``; bjoern needs libev),
the prazo front door, stock and prazo waitress, stock and prazo gunicorn
gthread (one worker process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from prazo.bench.goodput_servers import SERVERS as GOODPUT_SERVERS
from prazo.bench.goodput_servers import Process, ServerSpec, missing_module, package_version, started
from prazo.bench.goodput_settings import GoodputSettings
from prazo.bench.harness import describe_machine, render_machine, run_standalone, seconds_argument
from prazo.bench.loadgen import LoadResult

__all__ = [
    "HELLO_APP",
    "STOCK_OF",
    "THROUGHPUT_SERVERS",
    "RoundResult",
    "ServerResult",
    "ThroughputSettings",
    "add_bench_throughput_arguments",
    "hello",
    "pinning",
    "prefixed",
    "render_table",
    "run_bench_throughput",
    "run_throughput",
]

HELLO_APP = "prazo.bench.throughput:hello"
_BODY = b"Hello, World!"
_HEADERS = [("Content-Type", "text/plain"), ("Content-Length", str(len(_BODY)))]
# The server's CPU and the load generator's, when the machine has two.
SERVER_CPU = 0
CLIENT_CPU = 1
# wrk's own patience with one answer; a server slower than this is broken, not slow.
_WRK_TIMEOUT_S = 5
_WARMUP_S = 1.0
# The fallback generator's budget: long enough never to give up on a loaded machine.
_LOADGEN_BUDGET_MS = 10_000.0


def hello(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """The app under test: 200, 13 bytes, ``Content-Length``."""
    start_response("200 OK", _HEADERS)
    return [_BODY]


def _bjoern(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
    module, _, name = app.partition(":")
    code = (
        f"import bjoern, importlib; bjoern.run(getattr(importlib.import_module({module!r}), {name!r}), "
        f"'127.0.0.1', {port})"
    )
    return [Process([sys.executable, "-c", code])]


def _uwsgi(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
    module, _, name = app.partition(":")
    uwsgi = shutil.which("uwsgi") or str(Path(sys.executable).with_name("uwsgi"))
    argv = [
        uwsgi, "--http11-socket", f"127.0.0.1:{port}", "--module", f"{module}:{name}", "--processes", "1",
        "--threads", str(s.threads), "--disable-logging", "--die-on-term", "--need-app",
        "--home", sys.prefix,
    ]  # fmt: skip
    return [Process(argv)]


def _uwsgi_missing() -> str | None:
    if shutil.which("uwsgi") or Path(sys.executable).with_name("uwsgi").exists():
        return None
    return "uwsgi is not installed (pip install 'prazo[peers]')"


def _peer(name: str, label: str) -> ServerSpec:
    spec = GOODPUT_SERVERS[name]
    return dataclasses.replace(spec, label=lambda: label)


# The table's servers, in its order; a new one is one entry here.
THROUGHPUT_SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(
            "bjoern",
            lambda: f"bjoern {package_version('bjoern')}",
            _bjoern,
            missing_module("bjoern", "pip install 'prazo[peers]'; it needs libev"),
        ),
        _peer("granian", f"granian {package_version('granian')} (1 worker)"),
        _peer("frontdoor", "prazo front door"),
        ServerSpec("uwsgi", lambda: f"uWSGI {package_version('uwsgi')} (1 process)", _uwsgi, _uwsgi_missing),
        _peer("waitress", f"stock waitress {package_version('waitress')}"),
        _peer("prazo-waitress", "prazo waitress embedding"),
        _peer("gunicorn", f"stock gunicorn {package_version('gunicorn')} gthread"),
        _peer("prazo-gunicorn", "prazo gunicorn AdmissionWorker"),
    )
}
# Each prazo embedding and the stock server it is measured against.
STOCK_OF = {"prazo-waitress": "waitress", "prazo-gunicorn": "gunicorn"}


@dataclass(frozen=True)
class ThroughputSettings:
    """Parameters of ``prazo bench throughput``."""

    servers: tuple[str, ...] = tuple(THROUGHPUT_SERVERS)
    rounds: int = 2
    duration_s: float = 8.0
    connections: int = 32
    threads: int = 4
    max_queue: int = 64
    loadgen: str = "auto"  # "wrk", "prazo" or "auto" (wrk when installed)
    pin: bool = True


@dataclass
class RoundResult:
    """One round of one server: what the load generator counted."""

    answers: int
    other: int
    errors: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.answers / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ServerResult:
    """One server over every round: its best answers per second and the ratios."""

    name: str
    label: str
    rounds: list[RoundResult] = field(default_factory=list)
    vs_stock: float | None = None
    vs_fastest: float | None = None
    stock: str | None = None

    @property
    def best(self) -> float:
        return max((r.per_second for r in self.rounds), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.name,
            "label": self.label,
            "best_per_s": round(self.best, 1),
            "rounds_per_s": [round(r.per_second, 1) for r in self.rounds],
            "answers": [r.answers for r in self.rounds],
            "other_statuses": sum(r.other for r in self.rounds),
            "errors": sum(r.errors for r in self.rounds),
            "stock": self.stock,
            "vs_stock": None if self.vs_stock is None else round(self.vs_stock, 3),
            "vs_fastest": None if self.vs_fastest is None else round(self.vs_fastest, 3),
        }


def pinning(settings: ThroughputSettings) -> tuple[list[str], list[str]]:
    """The command prefixes that pin a server and the load generator, or nothing when they cannot be pinned."""
    if not settings.pin or shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return [], []
    return ["taskset", "-c", str(SERVER_CPU)], ["taskset", "-c", str(CLIENT_CPU)]


def prefixed(spec: ServerSpec, prefix: list[str]) -> ServerSpec:
    """``spec`` with every process's command line run behind ``prefix`` (``taskset``, ``valgrind``)."""

    def processes(app: str, port: int, s: GoodputSettings, workdir: Path) -> list[Process]:
        return [Process([*prefix, *p.argv], p.env) for p in spec.processes(app, port, s, workdir)]

    return dataclasses.replace(spec, processes=processes)


def _use_wrk(settings: ThroughputSettings) -> bool:
    if settings.loadgen == "wrk":
        if shutil.which("wrk") is None:
            raise ValueError("--loadgen wrk: wrk is not installed (apt-get install wrk)")
        return True
    return settings.loadgen == "auto" and shutil.which("wrk") is not None


_WRK_TOTAL = re.compile(r"(\d+) requests in ([\d.]+)(us|ms|s|m)\b")
_WRK_OTHER = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_WRK_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_wrk(output: str) -> RoundResult:
    """What ``wrk`` printed, as a ``RoundResult`` (answers are the 2xx/3xx ones)."""
    total = _WRK_TOTAL.search(output)
    if total is None:
        raise RuntimeError(f"wrk printed no total: {output.strip()[-500:]}")
    requests, seconds = int(total.group(1)), float(total.group(2)) * _UNIT_S[total.group(3)]
    other_match = _WRK_OTHER.search(output)
    other = int(other_match.group(1)) if other_match else 0
    errors_match = _WRK_ERRORS.search(output)
    errors = sum(int(n) for n in errors_match.groups()) if errors_match else 0
    return RoundResult(requests - other, other, errors, seconds)


def _run_wrk(port: int, seconds: float, settings: ThroughputSettings, prefix: list[str]) -> RoundResult:
    argv = [
        *prefix, "wrk", "-t1", f"-c{settings.connections}", f"-d{max(1, round(seconds))}s",
        "--timeout", f"{_WRK_TIMEOUT_S}s", f"http://127.0.0.1:{port}/",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return parse_wrk(done.stdout)


def _run_loadgen(port: int, seconds: float, settings: ThroughputSettings, prefix: list[str]) -> RoundResult:
    argv = [
        *prefix, sys.executable, "-m", "prazo.bench.loadgen", "--port", str(port),
        "--closed", str(settings.connections), "--seconds", str(seconds), "--budget-ms", str(_LOADGEN_BUDGET_MS),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    result = LoadResult.from_json(json.loads(done.stdout))
    outcomes = [record[5] for record in result.records]
    answers = sum(1 for record in result.records if record[5] == "ok")
    errors = outcomes.count("error") + outcomes.count("timeout")
    return RoundResult(answers, len(outcomes) - answers - errors, errors, seconds)


def run_throughput(
    settings: ThroughputSettings, progress: Callable[[str, int, RoundResult], object] | None = None
) -> list[ServerResult]:
    """Every server of ``settings``, round after round, interleaved; the best round of each and the ratios."""
    server_prefix, client_prefix = pinning(settings)
    measure = _run_wrk if _use_wrk(settings) else _run_loadgen
    server_settings = GoodputSettings(threads=settings.threads, max_queue=settings.max_queue)
    results = {name: ServerResult(name, THROUGHPUT_SERVERS[name].label()) for name in settings.servers}
    for round_index in range(settings.rounds):
        for name in settings.servers:
            spec = prefixed(THROUGHPUT_SERVERS[name], server_prefix)
            with started(spec, HELLO_APP, server_settings) as target:
                measure(target.port, _WARMUP_S, settings, client_prefix)
                measured = measure(target.port, settings.duration_s, settings, client_prefix)
            results[name].rounds.append(measured)
            if progress is not None:
                progress(name, round_index, measured)
    fastest = max((r.best for r in results.values()), default=0.0)
    for result in results.values():
        result.vs_fastest = result.best / fastest if fastest > 0 else None
        stock = STOCK_OF.get(result.name)
        if stock in results:
            result.stock = stock
            stock_best = results[stock].best
            result.vs_stock = result.best / stock_best if stock_best > 0 else None
    return list(results.values())


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def render_table(
    results: Sequence[ServerResult], settings: ThroughputSettings, generator: str, machine: Mapping[str, object]
) -> str:
    """The results as a text table, fastest first, with the run's parameters and the machine it ran on."""
    lines = [
        f"hello world (13-byte body), {settings.connections} connections, {generator}, "
        f"best of {settings.rounds} interleaved round(s) of {settings.duration_s:g} s",
        render_machine(machine),
        f"{'server':<16} {'answers/s':>10} {'rounds':>20} {'vs stock':>9} {'vs fastest':>10} {'other':>6} "
        f"{'errors':>6}  label",
    ]
    for r in sorted(results, key=lambda r: -r.best):
        rounds = " ".join(f"{x.per_second:.0f}" for x in r.rounds)
        other = sum(x.other for x in r.rounds)
        errors = sum(x.errors for x in r.rounds)
        lines.append(
            f"{r.name:<16} {r.best:>10.0f} {rounds:>20} {_ratio(r.vs_stock):>9} {_ratio(r.vs_fastest):>10} "
            f"{other:>6} {errors:>6}  {r.label}"
        )
    return "\n".join(lines)


def plot(results: Sequence[ServerResult], path: str, title: str) -> None:
    """A bar per server (best answers/s), each embedding's ratio to its stock server written on its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(results, key=lambda r: -r.best)
    figure, axis = plt.subplots(figsize=(9, 4.5))
    colours = ["tab:orange" if r.name in STOCK_OF or r.name == "frontdoor" else "tab:blue" for r in ordered]
    bars = axis.bar([r.name for r in ordered], [r.best for r in ordered], color=colours)
    for bar, r in zip(bars, ordered, strict=True):
        note = f"{r.best:.0f}" + (f"\n{r.vs_stock:.2f}× {r.stock}" if r.vs_stock is not None else "")
        axis.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    axis.set_ylabel("answers/s (best round)")
    axis.set_title(title, fontsize=10)
    axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bench_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``prazo bench throughput``."""
    defaults = ThroughputSettings()
    parser.add_argument(
        "--servers",
        metavar="A,B",
        default=None,
        help=f"servers to run, in order (default: every one installed: {','.join(THROUGHPUT_SERVERS)})",
    )
    parser.add_argument(
        "--rounds", type=_positive_int, default=defaults.rounds, metavar="N", help="interleaved rounds (best counts)"
    )
    parser.add_argument(
        "--duration", type=seconds_argument, default=defaults.duration_s, metavar="S", help="seconds per round"
    )
    parser.add_argument(
        "--connections", type=_positive_int, default=defaults.connections, metavar="N", help="closed-loop clients"
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=defaults.threads, metavar="N", help="worker threads per server"
    )
    parser.add_argument(
        "--loadgen",
        choices=("auto", "wrk", "prazo"),
        default=defaults.loadgen,
        help="wrk (keep-alive) or prazo's own closed-loop generator; auto: wrk when installed",
    )
    # Explicit defaults: ``prazo bench`` topics suppress the options not given.
    parser.add_argument(
        "--no-pin", action="store_true", default=False, help="do not pin the server and the generator to CPUs"
    )
    parser.add_argument("--json", action="store_true", default=False, help="print the results as one JSON object")
    parser.add_argument(
        "--plot", metavar="FILE.png", default=None, help="draw the answers/s of every server (matplotlib)"
    )


def _settings_from(args: argparse.Namespace) -> tuple[ThroughputSettings, list[str]]:
    notes: list[str] = []
    if args.servers:
        names = tuple(name for name in args.servers.split(",") if name)
        unknown = [name for name in names if name not in THROUGHPUT_SERVERS]
        if unknown:
            raise ValueError(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(THROUGHPUT_SERVERS)}")
    else:
        names = tuple(THROUGHPUT_SERVERS)
    available = []
    for name in names:
        why = THROUGHPUT_SERVERS[name].unavailable()
        if why is None:
            available.append(name)
        else:
            notes.append(f"skipping {name}: {why}")
    if not available:
        raise ValueError("none of the servers asked for is installed")
    settings = ThroughputSettings(
        servers=tuple(available),
        rounds=args.rounds,
        duration_s=args.duration,
        connections=args.connections,
        threads=args.threads,
        max_queue=max(ThroughputSettings.max_queue, 2 * args.connections),
        loadgen=args.loadgen,
        pin=not args.no_pin,
    )
    if pinning(settings) == ([], []):
        notes.append("not pinned to CPUs (taskset missing, one CPU, or --no-pin)")
    return settings, notes


def run_bench_throughput(args: argparse.Namespace, out: TextIO) -> int:
    """Run the benchmark as ``args`` (from ``add_bench_throughput_arguments``) say; print the table or JSON."""
    try:
        settings, notes = _settings_from(args)
        generator = "wrk -t1 (keep-alive)" if _use_wrk(settings) else "prazo.bench.loadgen --closed (no keep-alive)"
    except ValueError as exc:
        print(f"prazo bench throughput: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        import matplotlib  # noqa: F401 - fail before the run, not after it
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    def progress(name: str, round_index: int, result: RoundResult) -> None:
        print(f"round {round_index + 1} {name}: {result.per_second:.0f} answers/s", file=sys.stderr, flush=True)

    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    machine = describe_machine()
    results = run_throughput(settings, progress)
    if args.json:
        document = {
            "started": started_at,
            "machine": machine,
            "load_average_at_start": load,
            "generator": generator,
            "pinned": pinning(settings) != ([], []),
            "rounds": settings.rounds,
            "duration_s": settings.duration_s,
            "connections": settings.connections,
            "threads": settings.threads,
            "servers": [r.to_json() for r in results],
        }
        print(json.dumps(document, indent=2), file=out)
    else:
        print(render_table(results, settings, generator, machine), file=out)
    if args.plot:
        title = f"hello world, one CPU per server, {generator} ({started_at})\n{render_machine(machine)}"
        plot(results, args.plot, title)
    failed = [r.name for r in results if not any(x.answers for x in r.rounds)]
    if failed:
        print(f"prazo bench throughput: no answer from {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def bench_throughput(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``prazo bench throughput`` as a standalone program; returns the exit status."""
    return run_standalone(
        "prazo bench throughput", __doc__, add_bench_throughput_arguments, run_bench_throughput, argv, out
    )


if __name__ == "__main__":
    sys.exit(bench_throughput())
