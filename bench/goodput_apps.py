"""The two apps of ``prazo bench goodput``: ``cpu`` (10 ms of Python CPU) and ``io`` (a 50 ms sleep).

Plain WSGI callables, usable by any server::

    prazo serve prazo.bench.goodput_apps:cpu --server waitress --threads 4 --max-queue 20
    waitress-serve --threads 4 prazo.bench.goodput_apps:io
    gunicorn -k gthread --threads 4 prazo.bench.goodput_apps:cpu

``GET /ping`` answers at once without working or counting (the bench's
readiness probe); every other path works and is counted.

**What each app run records.** With ``PRAZO_GOODPUT_STATS_DIR`` set, each
process keeps its counters in a small memory-mapped file
``<dir>/<pid>.stats`` (``STATS_FIELDS``, int64 each), so the bench reads the
counts of a subprocess server — or of a server's several worker processes —
without sending it a request that admission might refuse. Per run:

* ``late_client``: finished after the *client's* deadline. The load generator
  sends its own give-up time as ``X-Bench-Give-Up-At-Ns`` (CLOCK_MONOTONIC
  nanoseconds; the same clock in every process of this machine), so this is
  exact for every server: work whose answer nobody read;
* ``late_server``: finished after the deadline *the server could know*:
  ``environ["prazo.deadline"]`` on a prazo server; on a stock server the time
  the server handed the request to the app plus ``X-Request-Budget-Ms`` —
  which under-counts, since the app cannot see how long the request waited
  in the kernel's backlog or the server's own queue;
* ``started_late``: started after the client's deadline (the client was
  already gone before the work began);
* ``slowed``: ran inside a slowdown window (below).

Without the variable nothing is recorded.

**A capacity drop on a schedule** (the ``drop`` workload of ``prazo bench
goodput``). The bench writes a window into ``<dir>/slowdown.bin``
(``write_slowdown``: start and end on CLOCK_MONOTONIC, shared by every
process of the machine, and a factor); a run that *starts* inside it does
``factor`` times its work (30 ms of CPU instead of 10, a 150 ms sleep instead
of 50). Every process maps the file, so one write reaches every worker of
every server at once, including a server the bench did not start (``--target``
with ``--stats-dir``); the window is absolute, so the bench can set it when it
knows its load's time zero, after the server started.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_WORK_MS",
    "ENV_STATS_DIR",
    "GIVE_UP_HEADER",
    "IO_WORK_MS",
    "SLOWDOWN_FILE",
    "STATS_FIELDS",
    "AppStats",
    "burn_cpu",
    "cpu",
    "io",
    "read_stats",
    "slowdown_factor",
    "write_slowdown",
]

ENV_STATS_DIR = "PRAZO_GOODPUT_STATS_DIR"
GIVE_UP_HEADER = "X-Bench-Give-Up-At-Ns"
_GIVE_UP_KEY = "HTTP_" + GIVE_UP_HEADER.upper().replace("-", "_")
_BUDGET_KEY = "HTTP_X_REQUEST_BUDGET_MS"
CPU_WORK_MS = 10.0
IO_WORK_MS = 50.0
STATS_FIELDS = ("runs", "late_client", "late_server", "started_late", "work_ns", "late_work_ns", "slowed")
_LAYOUT = struct.Struct(f"<{len(STATS_FIELDS)}q")
SLOWDOWN_FILE = "slowdown.bin"
# start_ns, end_ns (CLOCK_MONOTONIC), factor in thousandths; start 0 = no window.
_SLOWDOWN = struct.Struct("<3q")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class AppStats:
    """This process's counters, in a memory-mapped file of ``directory`` (or only in memory)."""

    def __init__(self, directory: str | None) -> None:
        self._lock = threading.Lock()
        self._values = [0] * len(STATS_FIELDS)
        self._map: mmap.mmap | None = None
        if directory:
            path = Path(directory) / f"{os.getpid()}.stats"
            with open(path, "w+b") as file:
                file.write(bytes(_LAYOUT.size))
                file.flush()
                self._map = mmap.mmap(file.fileno(), _LAYOUT.size)

    def record(
        self,
        started_ns: int,
        finished_ns: int,
        give_up_ns: int | None,
        server_deadline_ns: int | None,
        slowed: bool = False,
    ) -> None:
        late_client = give_up_ns is not None and finished_ns > give_up_ns
        with self._lock:
            values = self._values
            values[0] += 1
            values[1] += late_client
            values[2] += server_deadline_ns is not None and finished_ns > server_deadline_ns
            values[3] += give_up_ns is not None and started_ns > give_up_ns
            values[4] += finished_ns - started_ns
            values[5] += (finished_ns - started_ns) if late_client else 0
            values[6] += slowed
            if self._map is not None:
                _LAYOUT.pack_into(self._map, 0, *values)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(zip(STATS_FIELDS, self._values))


def read_stats(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The counters of every process that recorded into ``directory``, summed."""
    total = dict.fromkeys(STATS_FIELDS, 0)
    for path in Path(directory).glob("*.stats"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) == _LAYOUT.size:
            for name, value in zip(STATS_FIELDS, _LAYOUT.unpack(data)):
                total[name] += value
    return total


_stats: AppStats | None = None
_stats_pid = -1
_stats_lock = threading.Lock()


def _process_stats() -> AppStats:
    # Created on the first request of each process: a forking server (gunicorn)
    # imports this module in its master, and every worker must count apart.
    global _stats, _stats_pid
    if _stats is None or _stats_pid != os.getpid():
        with _stats_lock:
            if _stats is None or _stats_pid != os.getpid():
                _stats = AppStats(os.environ.get(ENV_STATS_DIR))
                _stats_pid = os.getpid()
    return _stats


def write_slowdown(directory: str | os.PathLike[str], start_ns: int, end_ns: int, factor: float) -> None:
    """From ``start_ns`` to ``end_ns`` (CLOCK_MONOTONIC) every app run of ``directory``'s servers works ``factor`` x.

    ``start_ns == end_ns == 0`` clears the window. Written in place (never
    replaced): the apps keep the file mapped.
    """
    for name, value in (("start_ns", start_ns), ("end_ns", end_ns)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{name} must be an int >= 0 (monotonic ns), got {value!r}")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    if end_ns < start_ns:
        raise ValueError(f"end_ns must be >= start_ns, got {start_ns} .. {end_ns}")
    path = Path(directory) / SLOWDOWN_FILE
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # One write of the whole record: a reader sees the old window or the new one.
        os.pwrite(descriptor, _SLOWDOWN.pack(start_ns, end_ns, round(factor * 1000)), 0)
    finally:
        os.close(descriptor)


_slowdown_map: mmap.mmap | None = None
_slowdown_pid = -1


def _mapped_slowdown() -> mmap.mmap | None:
    # Mapped once per process when the file exists; looked for again at every
    # run until then (a server measured with --target may start first).
    global _slowdown_map, _slowdown_pid
    if _slowdown_pid == os.getpid():
        return _slowdown_map
    directory = os.environ.get(ENV_STATS_DIR)
    if not directory:
        return None
    try:
        with open(Path(directory) / SLOWDOWN_FILE, "rb") as file:
            mapped = mmap.mmap(file.fileno(), _SLOWDOWN.size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # missing, or not yet written to its full size
        return None
    with _stats_lock:
        if _slowdown_pid != os.getpid():
            _slowdown_map, _slowdown_pid = mapped, os.getpid()
    return _slowdown_map


def slowdown_factor(now_ns: int) -> float:
    """How many times its normal work a run starting at ``now_ns`` does (1.0 outside any window)."""
    mapped = _mapped_slowdown()
    if mapped is None:
        return 1.0
    start_ns, end_ns, milli = _SLOWDOWN.unpack_from(mapped, 0)
    return milli / 1000 if start_ns and start_ns <= now_ns < end_ns and milli > 0 else 1.0


def burn_cpu(ms: float) -> int:
    """Spin ``ms`` of this thread's CPU time in pure Python (holding the GIL, as templates and ORMs do)."""
    end = time.thread_time_ns() + int(ms * 1_000_000)
    x = 0
    while time.thread_time_ns() < end:
        for i in range(500):
            x += i
    return x


def _server_deadline_ns(environ: dict[str, Any], handed_ns: int) -> int | None:
    deadline = environ.get("prazo.deadline")
    if deadline is not None:
        return int(deadline.ns)
    try:
        return handed_ns + int(float(environ.get(_BUDGET_KEY, "")) * 1_000_000)
    except ValueError:
        return None


def _make_app(work: Callable[[float], object]) -> WSGIApp:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        handed_ns = time.monotonic_ns()
        if environ.get("PATH_INFO") == "/ping":
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "4")])
            return [b"pong"]
        raw = environ.get(_GIVE_UP_KEY, "")
        give_up_ns = int(raw) if raw.isdigit() else None
        server_deadline_ns = _server_deadline_ns(environ, handed_ns)
        factor = slowdown_factor(handed_ns)
        work(factor)
        _process_stats().record(handed_ns, time.monotonic_ns(), give_up_ns, server_deadline_ns, factor != 1.0)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    return app


cpu = _make_app(lambda factor: burn_cpu(CPU_WORK_MS * factor))
io = _make_app(lambda factor: time.sleep(IO_WORK_MS * factor / 1000))
