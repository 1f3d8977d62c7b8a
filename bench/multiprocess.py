"""Refusals by a full worker while a sibling had room, with gunicorn ``-w N`` (issue 11, item 5).

::

    python -m prazo.bench.multiprocess [--workers 4] [--threads 4] [--max-queue 4] [--loads 0.8,1.2]
        [--seconds 10] [--repeat 2] [--yield both|on|off] [--json]

Starts ``gunicorn -w WORKERS -k prazo.bindings.servers.gunicorn.AdmissionWorker``
serving this module's ``app`` (the I/O-bound app of ``prazo bench goodput``,
a 50 ms sleep: the figure is about where requests land, not about CPU), with
``PRAZO_YIELD_WHEN_FULL`` off (each worker on its own: gunicorn's behaviour)
and on (a full worker leaves new connections to a sibling with room). The
host's capacity is ``workers x threads / 50 ms`` requests per second; each
load is an open-loop Poisson run of ``prazo.bench.loadgen`` (a new connection
per request, 1 s budgets) at that multiple of it, against a fresh server.

Columns: ``sent``; ``ok`` (200 within the budget); ``503`` (queue-full
refusals the clients got); ``sibling-room`` = those 503s sent while another
serving worker had a free place (read, at each refusal, from the host's
shared occupancy table: ``prazo.host_occupancy``), as a count and as a share
of all requests sent; ``yields`` = times a full worker stopped accepting for
a sibling; ``lag`` = the generator's p99 lateness (a point whose generator
fell behind, > 10 ms, is marked ``!!``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from prazo.bench.goodput_apps import IO_WORK_MS, io
from prazo.bench.goodput_workloads import percentile
from prazo.bench.loadgen import run_in_subprocess

__all__ = ["HOST_PATH", "Point", "app", "host_totals", "main", "run", "with_host_endpoint"]

HOST_PATH = "/_prazo/host"
_BUDGET_MS = 1000.0
_LAG_LIMIT_MS = 10.0
_STARTUP_TIMEOUT_S = 30.0
_QUIET_S = 1.5  # between loads: every request of the last one answered or given up on


def with_host_endpoint(inner: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``inner`` plus ``GET /_prazo/host``: the host's occupancy table as JSON (``null`` without one).

    The JSON has ``totals``, ``rows`` and ``answered_by`` (the pid of the
    worker that answered: its own row counts this request in flight).
    """

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HOST_PATH:
            return inner(environ, start_response)
        table = environ.get("prazo.host_occupancy")
        answer = {"totals": table.totals(), "rows": table.snapshot(), "answered_by": os.getpid()} if table else None
        body = json.dumps(answer).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return wrapped


# The bench's I/O-bound app (a 50 ms sleep), plus the host endpoint.
app = with_host_endpoint(io)


@dataclass
class Point:
    """One load against one server."""

    yield_when_full: bool
    load_x: float
    rate_per_s: float
    repeat: int
    sent: int
    ok: int
    refused_full: int  # 503 queue-full seen by the clients
    refused_full_host: int  # ... counted by the workers
    refused_sibling_room: int
    yields: int
    other: int
    lag_p99_ms: float

    @property
    def sibling_room_pct(self) -> float:
        return 100 * self.refused_sibling_room / self.sent if self.sent else 0.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path, headers={"X-Request-Budget-Ms": "5000"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def host_totals(port: int) -> dict[str, int]:
    """The summed counters of the host's occupancy table, asked of whichever worker answers."""
    end = time.monotonic() + _STARTUP_TIMEOUT_S
    while True:
        try:
            status, body = _get(port, HOST_PATH)
            if status == 200:
                totals: dict[str, int] = json.loads(body)["totals"]
                return totals
        except OSError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"no occupancy table from port {port}")
        time.sleep(0.1)


@contextmanager
def gunicorn(workers: int, threads: int, max_queue: int, yield_when_full: bool) -> Iterator[int]:
    """``gunicorn -w workers`` with prazo's worker serving ``app`` on a free port; killed after."""
    port = _free_port()
    env = {
        **os.environ,
        "PRAZO_MAX_QUEUE": str(max_queue),
        "PRAZO_YIELD_WHEN_FULL": "1" if yield_when_full else "0",
    }
    argv = [
        sys.executable, "-m", "gunicorn", "-k", "prazo.bindings.servers.gunicorn.AdmissionWorker",
        "--workers", str(workers), "--threads", str(threads), "--bind", f"127.0.0.1:{port}",
        "--graceful-timeout", "1", "--no-control-socket", "--log-level", "warning", "prazo.bench.multiprocess:app",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            end = time.monotonic() + _STARTUP_TIMEOUT_S
            while True:
                totals = None
                try:
                    totals = host_totals(port) if process.poll() is None else None
                except RuntimeError:
                    pass
                if totals is not None and totals["workers"] >= workers:
                    break
                if process.poll() is not None or time.monotonic() > end:
                    log.seek(0)
                    raise RuntimeError("gunicorn did not start:\n" + log.read().decode(errors="replace")[-2000:])
                time.sleep(0.1)
            yield port
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def run_point(
    port: int, yield_when_full: bool, load_x: float, capacity: float, seconds: float, repeat: int, seed: int
) -> Point:
    before = host_totals(port)
    argv = [
        "--host", "127.0.0.1", "--port", str(port), "--rate", repr(load_x * capacity), "--seconds", repr(seconds),
        "--budget-ms", repr(_BUDGET_MS), "--seed", str(seed), "--max-requests", str(10 * int(capacity * seconds) + 100),
    ]  # fmt: skip
    load = run_in_subprocess(argv, seconds + 30)
    time.sleep(_QUIET_S)
    after = host_totals(port)
    records = load.records
    lags = [(r[1] - r[0]) / 1e6 for r in records]
    return Point(
        yield_when_full=yield_when_full,
        load_x=load_x,
        rate_per_s=load_x * capacity,
        repeat=repeat,
        sent=len(records),
        ok=sum(1 for r in records if r[5] == "ok"),
        refused_full=sum(1 for r in records if r[2] == 503 and r[3] == "queue-full"),
        refused_full_host=after["refused_full"] - before["refused_full"],
        refused_sibling_room=after["refused_sibling_room"] - before["refused_sibling_room"],
        yields=after["yields"] - before["yields"],
        other=sum(1 for r in records if r[5] != "ok" and not (r[2] == 503 and r[3] == "queue-full")),
        lag_p99_ms=percentile(lags, 0.99) or 0.0,
    )


def run(
    *,
    workers: int,
    threads: int,
    max_queue: int,
    loads: Sequence[float],
    seconds: float,
    repeat: int,
    modes: Sequence[bool],
    progress: Callable[[Point], object] = lambda point: None,
) -> list[Point]:
    """Every (mode, repeat, load) point, each load on a fresh server."""
    capacity = workers * threads * 1000 / IO_WORK_MS
    points = []
    for number in range(repeat):
        for mode in modes:
            for load_x in loads:
                with gunicorn(workers, threads, max_queue, mode) as port:
                    point = run_point(port, mode, load_x, capacity, seconds, number, seed=1 + number)
                progress(point)
                points.append(point)
    return points


def render_row(p: Point) -> str:
    flag = " !!" if p.lag_p99_ms > _LAG_LIMIT_MS else ""
    return (
        f"{'on' if p.yield_when_full else 'off':>5} {p.load_x:>5.1f}x {p.rate_per_s:>6.0f}/s {p.repeat:>3} "
        f"{p.sent:>6} {p.ok:>6} {p.refused_full:>6} {p.refused_sibling_room:>6} {p.sibling_room_pct:>7.2f}% "
        f"{p.yields:>6} {p.other:>5} {p.lag_p99_ms:>6.1f}{flag}"
    )


HEADER = (
    f"{'yield':>5} {'load':>6} {'rate':>8} {'run':>3} {'sent':>6} {'ok':>6} {'503':>6} "
    f"{'sib-rm':>6} {'sib-rm%':>8} {'yields':>6} {'other':>5} {'lag99':>6}"
)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    stream = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.multiprocess", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=4, help="per worker")
    parser.add_argument("--loads", default="0.8,1.2", help="multiples of the host's capacity")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--yield", dest="mode", choices=("both", "on", "off"), default="both")
    parser.add_argument("--json", action="store_true", help="one JSON object per point instead of a table")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.threads < 1 or args.max_queue < 0 or args.repeat < 1 or not args.seconds > 0:
        parser.error("--workers, --threads and --repeat must be >= 1, --max-queue >= 0, --seconds > 0")
    try:
        loads = [float(part) for part in args.loads.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--loads must be comma-separated numbers, got {args.loads!r}")
    if not loads or any(not load > 0 for load in loads):
        parser.error(f"--loads must be numbers > 0, got {args.loads!r}")
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.mode]
    capacity = args.workers * args.threads * 1000 / IO_WORK_MS
    if not args.json:
        print(
            f"gunicorn -w {args.workers} --threads {args.threads}, PRAZO_MAX_QUEUE={args.max_queue}, "
            f"io app ({IO_WORK_MS:g} ms): capacity {capacity:g}/s; {args.seconds:g} s per point",
            file=stream,
        )
        print(HEADER, file=stream, flush=True)

    def progress(point: Point) -> None:
        if args.json:
            print(json.dumps({**asdict(point), "sibling_room_pct": point.sibling_room_pct}), file=stream, flush=True)
        else:
            print(render_row(point), file=stream, flush=True)

    points = run(
        workers=args.workers,
        threads=args.threads,
        max_queue=args.max_queue,
        loads=loads,
        seconds=args.seconds,
        repeat=args.repeat,
        modes=modes,
        progress=progress,
    )
    return 1 if any(p.lag_p99_ms > _LAG_LIMIT_MS for p in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
