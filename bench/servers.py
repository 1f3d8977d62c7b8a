"""``prazo bench servers``: each server at twice its capacity, with and without prazo, in one run.

For every server the same app runs twice on 127.0.0.1 — once on the stock
server with ``--threads`` worker threads, once with prazo's admission at the
server's queue (``--threads`` running, ``--max-queue`` waiting) — under the
same closed-loop load: ``2 × (threads + max_queue)`` clients, each sending a
request with ``X-Request-Budget-Ms: budget`` and giving up after ``budget``
ms, then sending the next (after a refusal it waits ``work`` ms first).

The app holds one of ``--threads`` tokens (its own capacity, like a database
pool) for ``--work-ms``. Reported per run:

* **goodput**: answers with status 200 received within the budget, per second;
* **p99 ok**: the 99th percentile latency of those answers;
* **wasted**: ms of app work on requests whose client had already given up
  when the work finished (counted until the clients stop), and how many;
* the count of refusals (503/504) and of clients that gave up.

The stock werkzeug and wsgiref servers start a thread per connection, so
there the app's token pool is where requests wait.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, TextIO

from prazo.core import NS_PER_MS

__all__ = [
    "BENCH_SERVERS",
    "BenchState",
    "ServerBenchSettings",
    "add_bench_servers_arguments",
    "bench_app",
    "bench_servers",
    "make_bench_app",
    "run_bench_servers",
    "run_server_bench",
]

BENCH_SERVERS = ("waitress", "gunicorn", "cheroot", "werkzeug", "wsgiref")
GIVE_UP_HEADER = "X-Bench-Give-Up-At-Ns"
_GIVE_UP_KEY = "HTTP_X_BENCH_GIVE_UP_AT_NS"
# The gunicorn app process learns its settings and where to report from these.
_ENV_THREADS = "PRAZO_BENCH_THREADS"
_ENV_WORK_MS = "PRAZO_BENCH_WORK_MS"
_ENV_STATS_FILE = "PRAZO_BENCH_STATS_FILE"
_STARTUP_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerBenchSettings:
    """Parameters of ``prazo bench servers`` (defaults: a run of about 30 s in all)."""

    servers: tuple[str, ...] = BENCH_SERVERS
    threads: int = 4
    max_queue: int = 16
    work_ms: float = 20.0
    budget_ms: float = 150.0
    duration_s: float = 2.0

    @property
    def clients(self) -> int:
        """Twice the capacity of the prazo variant."""
        return 2 * (self.threads + self.max_queue)


class BenchState:
    """What the bench app measures: its token pool, the work done, the work wasted.

    Thread-safe. With ``stats_file`` set, every finished request rewrites it
    (so a gunicorn worker process can report without a request).
    """

    def __init__(self, threads: int, work_ms: float, stats_file: str | None = None) -> None:
        self.tokens = threading.BoundedSemaphore(threads)
        self.work_s = work_ms / 1000
        self._stats_file = stats_file
        self._lock = threading.Lock()
        self.worked = 0
        self.wasted = 0
        self.wasted_ns = 0

    def record(self, started_ns: int, finished_ns: int, give_up_ns: int | None) -> None:
        with self._lock:
            self.worked += 1
            if give_up_ns is not None and finished_ns > give_up_ns:
                self.wasted += 1
                self.wasted_ns += finished_ns - started_ns
            snapshot = self.snapshot()
        if self._stats_file is not None:
            temporary = f"{self._stats_file}.{threading.get_ident()}"
            Path(temporary).write_text(json.dumps(snapshot))
            os.replace(temporary, self._stats_file)

    def snapshot(self) -> dict[str, int]:
        return {"worked": self.worked, "wasted": self.wasted, "wasted_ns": self.wasted_ns}


def make_bench_app(state: BenchState) -> Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]:
    """The app under test, reporting to ``state``: hold a token for the work time, note wasted work."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        raw_give_up = environ.get(_GIVE_UP_KEY, "")
        give_up_ns = int(raw_give_up) if raw_give_up.isdigit() else None
        with state.tokens:
            started_ns = time.monotonic_ns()
            time.sleep(state.work_s)
            finished_ns = time.monotonic_ns()
        state.record(started_ns, finished_ns, give_up_ns)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    return app


_environment_app: Callable[[dict[str, Any], Callable[..., Any]], list[bytes]] | None = None


def bench_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """The app as a gunicorn worker loads it: configured by ``PRAZO_BENCH_*`` variables."""
    global _environment_app
    if _environment_app is None:
        state = BenchState(
            int(os.environ[_ENV_THREADS]), float(os.environ[_ENV_WORK_MS]), os.environ.get(_ENV_STATS_FILE)
        )
        _environment_app = make_bench_app(state)
    return _environment_app(environ, start_response)


# -- the load ---------------------------------------------------------------------


@dataclass
class RunResult:
    """What the clients of one run saw, and the app's waste."""

    server: str
    variant: str
    duration_s: float
    latencies_ok_s: list[float] = field(default_factory=list)
    refused: int = 0
    gave_up: int = 0
    errors: int = 0
    wasted: int = 0
    wasted_ms: float = 0.0

    @property
    def goodput(self) -> float:
        return len(self.latencies_ok_s) / self.duration_s

    @property
    def p99_ok_ms(self) -> float | None:
        if not self.latencies_ok_s:
            return None
        ordered = sorted(self.latencies_ok_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1000


def _client_loop(
    port: int, settings: ServerBenchSettings, stop_at: float, result: RunResult, lock: threading.Lock
) -> None:
    budget_s = settings.budget_ms / 1000
    while time.monotonic() < stop_at:
        started = time.monotonic()
        give_up_ns = time.monotonic_ns() + int(settings.budget_ms * NS_PER_MS)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=budget_s)
        outcome = "error"
        try:
            conn.request(
                "GET",
                "/",
                headers={"X-Request-Budget-Ms": f"{settings.budget_ms:g}", GIVE_UP_HEADER: str(give_up_ns)},
            )
            response = conn.getresponse()
            response.read()
            elapsed = time.monotonic() - started
            if response.status == 200 and elapsed <= budget_s:
                outcome = "ok"
            elif response.status in (503, 504):
                outcome = "refused"
            else:
                outcome = "gave_up" if elapsed > budget_s else "error"
        except TimeoutError:
            outcome = "gave_up"
        except OSError:
            outcome = "error"
        finally:
            conn.close()
        with lock:
            if outcome == "ok":
                result.latencies_ok_s.append(time.monotonic() - started)
            else:
                setattr(result, outcome, getattr(result, outcome) + 1)
        if outcome in ("refused", "error"):
            time.sleep(settings.work_ms / 1000)


def _apply_load(port: int, settings: ServerBenchSettings, result: RunResult) -> None:
    lock = threading.Lock()
    stop_at = time.monotonic() + settings.duration_s
    clients = [
        threading.Thread(target=_client_loop, args=(port, settings, stop_at, result, lock), daemon=True)
        for _ in range(settings.clients)
    ]
    for client in clients:
        client.start()
    for client in clients:
        client.join(settings.duration_s + settings.budget_ms / 1000 + _STARTUP_TIMEOUT_S)


# -- the servers ------------------------------------------------------------------


@dataclass
class _Running:
    port: int
    stats: Callable[[], dict[str, int]]


def _in_thread(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


@contextmanager
def _quiet_server_logs() -> Iterator[None]:
    """Silence per-request and queue-depth logging (stock werkzeug and waitress) during a run."""
    loggers = [logging.getLogger(name) for name in ("werkzeug", "waitress", "waitress.queue")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def _in_process_server(kind: str, prazo: bool, settings: ServerBenchSettings) -> Iterator[_Running]:
    # A fresh state per run: a stock server still chewing on the previous
    # run's dead requests must not report into (or share tokens with) this one.
    state = BenchState(settings.threads, settings.work_ms)
    app = make_bench_app(state)
    limits: dict[str, Any] = {"threads": settings.threads, "max_queue": settings.max_queue, "max_budget_ms": 60_000}
    stop: Callable[[], object]
    if kind == "waitress":
        if prazo:
            from prazo.bindings.servers.waitress import create_server, shutdown

            server = create_server(app, host="127.0.0.1", port=0, **limits)
            stop = lambda: shutdown(server, 0)
        else:
            from waitress.server import create_server as plain_waitress

            server = plain_waitress(app, host="127.0.0.1", port=0, threads=settings.threads)
            # Its workers finish their current task before the trigger closes.
            stop = lambda: (server.task_dispatcher.shutdown(timeout=_STOP_TIMEOUT_S), server.close())
        _in_thread(server.run)
        port = server.effective_port
    elif kind == "cheroot":
        if prazo:
            from prazo.bindings.servers.cheroot import create_server as prazo_cheroot

            server = prazo_cheroot(app, ("127.0.0.1", 0), shutdown_timeout=0, **limits)
        else:
            from cheroot.wsgi import Server

            server = Server(("127.0.0.1", 0), app, numthreads=settings.threads, shutdown_timeout=0)
        server.prepare()
        _in_thread(server.serve)
        port, stop = server.bind_addr[1], server.stop
    else:
        server = _socketserver(kind, prazo, app, limits)
        _in_thread(server.serve_forever)
        port = server.server_address[1]
        stop = lambda: (server.shutdown(), server.server_close())
    try:
        yield _Running(port, state.snapshot)
    finally:
        # Bounded: a stock server may keep working through its backlog of
        # dead requests; the next run must not compete with it for long.
        _in_thread(stop).join(_STOP_TIMEOUT_S)


def _socketserver(kind: str, prazo: bool, app: Callable[..., Any], limits: dict[str, Any]) -> Any:
    if kind == "werkzeug":
        if prazo:
            from prazo.bindings.servers.werkzeug import make_server

            return make_server("127.0.0.1", 0, app, **limits)
        from werkzeug.serving import make_server as plain_werkzeug

        return plain_werkzeug("127.0.0.1", 0, app, threaded=True)
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    if prazo:
        from prazo.bindings.servers.wsgiref import make_server as prazo_wsgiref

        # The stock handler, quieted, as the stock server below gets it.
        return prazo_wsgiref("127.0.0.1", 0, app, handler_class=QuietHandler, **limits)  # type: ignore[arg-type]

    class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    server = ThreadingWSGIServer(("127.0.0.1", 0), QuietHandler)
    server.set_app(app)
    return server


@contextmanager
def _gunicorn_server(prazo: bool, settings: ServerBenchSettings) -> Iterator[_Running]:
    with tempfile.TemporaryDirectory(prefix="prazo-bench-") as directory:
        stats_file = os.path.join(directory, "stats.json")
        env = {
            **os.environ,
            _ENV_THREADS: str(settings.threads),
            _ENV_WORK_MS: repr(settings.work_ms),
            _ENV_STATS_FILE: stats_file,
            "PRAZO_MAX_QUEUE": str(settings.max_queue),
            "PRAZO_MAX_BUDGET_MS": "60000",
        }
        worker = "prazo.bindings.servers.gunicorn.AdmissionWorker" if prazo else "gthread"
        command = [
            sys.executable, "-m", "gunicorn", "-k", worker, "--threads", str(settings.threads),
            "--workers", "1", "--bind", "127.0.0.1:0", "--graceful-timeout", "1", "--no-control-socket",
            "--error-logfile", "-", "--log-level", "info", f"{__name__}:bench_app",
        ]  # fmt: skip
        process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        try:
            port = _gunicorn_port(process)

            def stats() -> dict[str, int]:
                try:
                    data: dict[str, int] = json.loads(Path(stats_file).read_text())
                    return data
                except (OSError, ValueError):
                    return {"worked": 0, "wasted": 0, "wasted_ns": 0}

            yield _Running(port, stats)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _gunicorn_port(process: subprocess.Popen[str]) -> int:
    """The port gunicorn bound, once its worker answers connections."""
    assert process.stderr is not None
    end = time.monotonic() + _STARTUP_TIMEOUT_S
    port = None
    for line in process.stderr:
        match = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", line)
        if match:
            port = int(match.group(1))
        if "Booting worker" in line or time.monotonic() > end:
            break
    if port is None:
        raise RuntimeError("gunicorn did not start")
    # Keep reading its log, or gunicorn would block once the pipe is full.
    threading.Thread(target=process.stderr.read, daemon=True).start()
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("gunicorn never accepted a connection")


def run_server_bench(kind: str, prazo: bool, settings: ServerBenchSettings) -> RunResult:
    """One run: server ``kind`` with or without prazo under the load described in the module docstring."""
    if kind not in BENCH_SERVERS:
        raise ValueError(f"kind must be one of {BENCH_SERVERS}, got {kind!r}")
    result = RunResult(kind, "prazo" if prazo else "plain", settings.duration_s)
    server = _gunicorn_server(prazo, settings) if kind == "gunicorn" else _in_process_server(kind, prazo, settings)
    with _quiet_server_logs(), server as running:
        _apply_load(running.port, settings, result)
        stats = running.stats()
    result.wasted = stats["wasted"]
    result.wasted_ms = stats["wasted_ns"] / NS_PER_MS
    return result


# -- report and command line --------------------------------------------------------


def render(results: list[RunResult], settings: ServerBenchSettings) -> str:
    """The results as a table, with the parameters on top."""
    lines = [
        (
            f"prazo bench servers: {settings.clients} clients (2 x capacity {settings.threads}+{settings.max_queue}), "
            f"budget {settings.budget_ms:g} ms, app work {settings.work_ms:g} ms on {settings.threads} threads, "
            f"{settings.duration_s:g} s per run"
        ),
        "",
        (
            f"{'server':<10} {'variant':<7} {'goodput/s':>10} {'p99 ok ms':>10} {'ok':>6} {'refused':>8} "
            f"{'gave up':>8} {'errors':>7} {'wasted ms':>10} {'wasted':>7}"
        ),
    ]
    for result in results:
        p99 = "-" if result.p99_ok_ms is None else f"{result.p99_ok_ms:.1f}"
        lines.append(
            f"{result.server:<10} {result.variant:<7} {result.goodput:>10.1f} {p99:>10} "
            f"{len(result.latencies_ok_s):>6} {result.refused:>8} {result.gave_up:>8} {result.errors:>7} "
            f"{result.wasted_ms:>10.0f} {result.wasted:>7}"
        )
    return "\n".join(lines)


def add_bench_servers_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``prazo bench servers`` on ``parser``."""
    defaults = ServerBenchSettings()
    parser.add_argument(
        "--servers", default=",".join(defaults.servers), help=f"comma-separated subset of {','.join(BENCH_SERVERS)}"
    )
    parser.add_argument("--threads", type=int, default=defaults.threads, help=f"default {defaults.threads}")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue, help=f"default {defaults.max_queue}")
    parser.add_argument("--work-ms", type=float, default=defaults.work_ms, help=f"default {defaults.work_ms:g}")
    parser.add_argument("--budget-ms", type=float, default=defaults.budget_ms, help=f"default {defaults.budget_ms:g}")
    parser.add_argument(
        "--duration", type=float, default=defaults.duration_s, help=f"seconds per run (default {defaults.duration_s:g})"
    )


def _settings_from(args: argparse.Namespace) -> ServerBenchSettings:
    servers = tuple(name.strip() for name in args.servers.split(",") if name.strip())
    unknown = [name for name in servers if name not in BENCH_SERVERS]
    if unknown or not servers:
        raise ValueError(f"--servers must name some of {','.join(BENCH_SERVERS)}, got {args.servers!r}")
    if args.threads < 1 or args.max_queue < 0:
        raise ValueError("--threads must be >= 1 and --max-queue >= 0")
    for name in ("work_ms", "budget_ms", "duration"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    return ServerBenchSettings(servers, args.threads, args.max_queue, args.work_ms, args.budget_ms, args.duration)


def run_bench_servers(args: argparse.Namespace, out: TextIO) -> int:
    """Run the benchmark as ``args`` (from ``add_bench_servers_arguments``) say; print the table."""
    try:
        settings = _settings_from(args)
    except ValueError as exc:
        print(f"prazo bench servers: error: {exc}", file=sys.stderr)
        return 2
    results = []
    for kind in settings.servers:
        for prazo in (False, True):
            results.append(run_server_bench(kind, prazo, settings))
    print(render(results, settings), file=out)
    return 0


def bench_servers(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``prazo bench servers`` as a standalone program; returns the exit status."""
    parser = argparse.ArgumentParser(prog="prazo bench servers", description=__doc__.split("\n", 1)[0])
    add_bench_servers_arguments(parser)
    return run_bench_servers(parser.parse_args(argv), out or sys.stdout)
