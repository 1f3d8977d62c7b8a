"""``prazo bench soak``: mixed load with random faults at about 1.5x capacity, then every queue must be at rest.

The loads ``--loads`` names (by default the first five below) run at once
for ``--minutes`` (or ``--seconds``), each offered Poisson arrivals at
``load`` (1.5) times the capacity of its queue:

* **waitress** — a real server (``prazo.bindings.servers.waitress``) on 127.0.0.1,
  real HTTP from client threads. Faults: the app raises before its answer or
  in the middle of a streamed body; clients disconnect mid-request (half a
  body sent), right after sending (never read the answer) or mid-response;
  budgets of 0 ms (expired on arrival) and shorter than the queue's wait.
* **middleware** — ``AdmissionMiddleware`` called in-process by caller
  threads, as a threaded server calls it. Faults: the app raises (before the
  answer, or from its body); response bodies closed early, dropped
  half-read without ``close()``, dropped unread.
* **pool** — ``AdmissionPool.submit_until`` with random deadlines (some
  already passed, some none). Faults: tasks raise; futures cancelled right
  after submission.
* **gate** — helper threads loop ``with q.slot(deadline)`` on a small
  queue, and the *main thread* waits in ``q.slot()`` too while a signaller
  thread sends it SIGUSR1 (handler raises an ``Exception``) and SIGUSR2
  (handler raises a ``BaseException``, as a SIGTERM handler raising
  ``SystemExit`` does) every few milliseconds.
* **work-queue** — the work-queue face with an ``on_expired`` callback that
  returns, raises an ``Exception`` or raises a ``BaseException``; a producer
  puts items with short deadlines and sweeps with ``expire_overdue()``,
  consumers ``get()``/``task_done()``.
* **frontdoor** (not by default) — the front door
  (``prazo.bindings.servers.frontdoor.create_server``) in this process under
  the waitress load's clients and faults, plus slow clients: one sends its
  head a byte at a time over about the header timeout (408, or expired on
  arrival), one asks for a large answer and never reads it (the worker's
  write stalls until its write timeout).
* **host** (not by default) — the same with ``workers=2`` (a supervisor
  thread here, a triage process, two worker processes) and ``max_requests``
  retiring workers as they serve; through the run, SIGKILL of a random
  worker and rolling reloads, in turn.

At the end everything is shut down and checked; the exit status is 1 if any
check fails:

* every queue at rest: ``in_flight == queued == assigned == 0``;
* counters balanced: ``offered == started + rejected_full +
  expired_on_arrival + expired_in_queue + cancelled + queued + assigned``,
  and ``completed == started``;
* every work item that expired in line was reported to ``on_expired`` once;
* no thread left: ``threading.active_count()`` back to its value before the
  soak within ``THREAD_SETTLE_S``; no thread died of an unhandled exception;
* resident memory flat: ``VmRSS`` (``/proc/self/status``) sampled all along;
  its growth from the end of the warm-up (the first quarter) to the end of
  the load must stay within ``--rss-limit-kib``;
* for the front door's loads: ``shutdown()`` says everything admitted
  finished; the host's counters are read at rest before it shuts down
  (requests cut by a kill are ``worker_lost``, an outcome: they count as
  started and completed); every process of the host (supervisor, triage,
  each worker, whose pids change with kills, reloads and retirements) grows
  at most ``--rss-limit-kib`` from its first sample after the warm-up to its last;
* no child process left (``/proc/self/task/*/children``) and no descriptor
  left (``/proc/self/fd`` back to its count before the soak within
  ``THREAD_SETTLE_S``).

A hang (a deadlock in the queue, say) cannot report itself: if the process
is still running ``HANG_GRACE_S`` after the load should have ended, it exits
with status 1 after printing every thread's traceback (``faulthandler``).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import http.client
import itertools
import json
import logging
import math
import os
import queue
import random
import signal
import socket
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from prazo.bench.harness import Paint, plain, render_heading
from prazo.bench.wsgi import middleware_for, minimal_environ
from prazo.bindings.pool import AdmissionPool
from prazo.bindings.wsgi import Environ, StartResponse
from prazo.core import IMPLEMENTATION, AdmissionQueue, Deadline, DeadlineExceeded, QueueFull, ShutDown

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

__all__ = [
    "HANG_GRACE_S",
    "THREAD_SETTLE_S",
    "AppFault",
    "CallbackInterrupt",
    "Check",
    "SignalFault",
    "SignalInterrupt",
    "SoakApp",
    "SoakObservation",
    "SoakReport",
    "SoakSettings",
    "add_bench_soak_arguments",
    "balance_gap",
    "check_soak",
    "render_soak_report",
    "rss_kib",
    "run_bench_soak",
    "run_soak",
    "settings_from",
]

QueueClass = type[AdmissionQueue]

# How long the threads of a finished soak get to exit before they count as leaked.
THREAD_SETTLE_S = 10.0
# Past the end of the load, a process still running is hung: shutdown waits are all bounded well below this.
HANG_GRACE_S = 120.0
# The bound on every socket operation of a client: no load loop can block for longer.
_CLIENT_TIMEOUT_S = 5.0
# Refused callers of the gate back off this long, so a full queue is not a busy loop.
_BACKOFF_S = 0.001
_STREAM_CHUNKS = 4
_STREAM_CHUNK = b"x" * 1024
# 16 MiB: more than loopback's socket buffers (a few MiB at most) take, in chunks of one shared object.
_LARGE_CHUNKS = 256
_LARGE_CHUNK = b"z" * 65536
_MAX_MINUTES = 24 * 60.0

BALANCE_TERMS = (
    "started",
    "rejected_full",
    "expired_on_arrival",
    "expired_in_queue",
    "cancelled",
    "queued",
    "assigned",
)
AT_REST = ("in_flight", "queued", "assigned")
# Every load, in the order they start (the gate last: its part in the main thread runs until the end).
LOADS = ("waitress", "middleware", "pool", "work-queue", "frontdoor", "host", "gate")
# What runs without --loads: the front door's loads need the compiled engine and fork processes.
DEFAULT_LOADS = ("waitress", "middleware", "pool", "work-queue", "gate")


@dataclass(frozen=True)
class SoakSettings:
    """Parameters of ``prazo bench soak``; every load gets ``concurrency`` slots and ``max_queue`` places."""

    seconds: float = 60.0
    seed: int = 0
    concurrency: int = 4
    max_queue: int = 8
    work_ms: float = 40.0
    load: float = 1.5
    warmup_fraction: float = 0.25
    rss_limit_kib: int = 8192
    loads: tuple[str, ...] = DEFAULT_LOADS

    @property
    def work_s(self) -> float:
        return self.work_ms / 1000

    @property
    def warmup_s(self) -> float:
        return self.seconds * self.warmup_fraction

    @property
    def sample_interval_s(self) -> float:
        """About 60 RSS samples per run, never more than 10 per second."""
        return min(max(self.seconds / 60, 0.1), 10.0)

    def budget_ms(self, rng: random.Random) -> float:
        """A request budget: 3 % already spent, the rest from half the work to six times it."""
        if rng.random() < 0.03:
            return 0.0
        return rng.uniform(self.work_ms / 2, 6 * self.work_ms)


# -- the app behind the middleware and waitress ---------------------------------------


class AppFault(Exception):
    """What the soak's app raises on purpose."""


class SoakApp:
    """A WSGI app that works ``work_s`` and fails as its path asks.

    ``/ok`` a list body; ``/stream`` a generator of four chunks with the work
    spread between them; ``/raise`` raises before answering; ``/raise-mid``
    streams, then raises after the first chunk; ``/large`` (asked only by the
    front door's slow readers, not in ``PATHS``) streams more than the
    loopback socket buffers hold, so a client that never reads it stalls the write.
    """

    PATHS = ("/ok", "/stream", "/raise", "/raise-mid")
    WEIGHTS = (60, 20, 10, 10)

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/ok")
        if path == "/raise":
            time.sleep(self.work_s / 2)
            raise AppFault("the app raised before answering")
        if path in ("/stream", "/raise-mid"):
            return self._stream(start_response, fail=path == "/raise-mid")
        if path == "/large":
            start_response("200 OK", [("Content-Type", "application/octet-stream")])
            return itertools.repeat(_LARGE_CHUNK, _LARGE_CHUNKS)
        time.sleep(self.work_s)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    def _stream(self, start_response: StartResponse, *, fail: bool) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        for index in range(_STREAM_CHUNKS):
            time.sleep(self.work_s / _STREAM_CHUNKS)
            if fail and index == 1:
                raise AppFault("the app raised in the middle of its body")
            yield _STREAM_CHUNK


# -- shared pieces of the loads -------------------------------------------------------


class _Tally:
    """A thread-safe ``Counter`` of outcomes and faults."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, key: str, count: int = 1) -> None:
        with self._lock:
            self._counts[key] += count

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))


class _Pacer:
    """Poisson arrivals at ``rate`` per second, shared by a load's threads, until ``end`` (monotonic).

    An arrival that finds every thread of its load busy waits for one: the
    offered rate is what the threads managed, counted in ``offered``.
    """

    def __init__(self, rate: float, end: float, rng: random.Random) -> None:
        self._rate = rate
        self._end = end
        self._rng = rng
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self.offered = 0

    def next_arrival(self) -> bool:
        """Sleep until this thread's next arrival; False once the load is over."""
        with self._lock:
            at = max(self._next, time.monotonic())
            if at >= self._end:
                return False
            self._next = at + self._rng.expovariate(self._rate)
            self.offered += 1
        time.sleep(max(at - time.monotonic(), 0.0))
        return True


class _Load:
    """One load: its threads, its tally, and the queues whose counters are checked."""

    name = ""

    def __init__(self, settings: SoakSettings, seed: int) -> None:
        self.settings = settings
        self.seed = seed
        self.tally = _Tally()
        self.pacer: _Pacer | None = None
        self._threads: list[threading.Thread] = []

    @property
    def capacity_per_s(self) -> float:
        return self.settings.concurrency / self.settings.work_s

    def _rng(self, index: int) -> random.Random:
        """An independent stream per thread, reproducible from the seed."""
        return random.Random(f"{self.seed}:{self.name}:{index}")

    def _paced(self, end: float, threads: int, loop: Callable[[random.Random], None]) -> list[threading.Thread]:
        """Start ``threads`` threads, each running ``loop(rng)`` once per arrival of a shared pacer; return them."""
        self.pacer = _Pacer(self.settings.load * self.capacity_per_s, end, self._rng(-1))
        pacer = self.pacer

        def run(rng: random.Random) -> None:
            while pacer.next_arrival():
                loop(rng)

        return [self._spawn(run, self._rng(index)) for index in range(threads)]

    def _spawn(self, target: Callable[..., None], *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=f"prazo-soak-{self.name}-{len(self._threads)}")
        thread.start()
        self._threads.append(thread)
        return thread

    def _join(self, threads: list[threading.Thread] | None = None) -> None:
        # Every loop ends by itself at ``end``; a thread still alive after a
        # bounded wait is reported by the thread check, never waited on forever.
        for thread in self._threads if threads is None else threads:
            thread.join(_CLIENT_TIMEOUT_S * 2)

    def start(self, end: float) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def queues(self) -> dict[str, dict[str, int]]:
        raise NotImplementedError

    def expired_reported(self) -> dict[str, int]:
        """``{queue name: on_expired calls}`` for the queues whose callback the soak owns."""
        return {}

    def shutdowns(self) -> dict[str, bool]:
        """``{server name: shutdown() said everything admitted finished}`` for the servers that say so."""
        return {}

    def processes(self) -> dict[int, str]:
        """``{pid: role}`` of the processes serving this load now, whose memory is sampled (none but this one)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """The load as offered (arrivals per second against the queue's capacity) and its outcomes."""
        assert self.pacer is not None
        offered_per_s = self.pacer.offered / self.settings.seconds
        return {
            "offered_per_s": round(offered_per_s, 1),
            "capacity_per_s": round(self.capacity_per_s, 1),
            "load": round(offered_per_s / self.capacity_per_s, 2),
            "outcomes": self.tally.snapshot(),
        }


def _body_status(status: str) -> str:
    return status.split(" ", 1)[0]


# -- real HTTP on loopback: waitress, the front door, the front door's host ----------


class _HttpLoad(_Load):
    """Client threads sending real HTTP to a server on 127.0.0.1; subclasses start and stop the server.

    ``CLIENTS`` are the ways a client behaves: the answer read in full, or
    one of the ways of going away (``_go_away``), or one of the slow clients
    (``_slow``) when a subclass adds them.
    """

    CLIENTS: tuple[str, ...] = ("read", "gone-mid-request", "gone-before-answer", "gone-mid-response")
    CLIENT_WEIGHTS: tuple[int, ...] = (70, 8, 10, 12)
    _port = 0

    def _request(self, rng: random.Random) -> None:
        client = rng.choices(self.CLIENTS, self.CLIENT_WEIGHTS)[0]
        path = "/stream" if client == "gone-mid-response" else rng.choices(SoakApp.PATHS, SoakApp.WEIGHTS)[0]
        headers = {"X-Request-Budget-Ms": f"{self.settings.budget_ms(rng):.0f}"}
        try:
            if client == "read":
                self.tally.add(self._read(path, headers))
            elif client.startswith("slow-"):
                self.tally.add(f"{client}-{self._slow(client, path, headers, rng)}")
            else:
                self._go_away(client, path, headers, rng)
                self.tally.add(client)
        except TimeoutError:
            self.tally.add(f"client-timeout-{client}-{path}")
        except (http.client.HTTPException, OSError):
            # A body cut off by the app raising mid-stream, or a connection
            # the server closed after an error: the client sees a broken answer.
            self.tally.add("cut-off")

    def _read(self, path: str, headers: dict[str, str]) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=_CLIENT_TIMEOUT_S)
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            response.read()
            return str(response.status)
        finally:
            conn.close()

    @staticmethod
    def _head(method: str, path: str, headers: dict[str, str], *extra: str) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items()), *extra]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")

    def _go_away(self, client: str, path: str, headers: dict[str, str], rng: random.Random) -> None:
        if client == "gone-mid-request":
            # Announce 1000 bytes, send a few: the server is left waiting for the rest.
            data = self._head("POST", path, headers, "Content-Length: 1000") + b"y" * rng.randrange(1, 1000)
        else:
            data = self._head("GET", path, headers)
        with socket.create_connection(("127.0.0.1", self._port), timeout=_CLIENT_TIMEOUT_S) as sock:
            sock.sendall(data)
            if client == "gone-mid-response":
                sock.recv(rng.randrange(1, 2048))

    def _slow(self, client: str, path: str, headers: dict[str, str], rng: random.Random) -> str:
        raise NotImplementedError(client)

    def queues(self) -> dict[str, dict[str, int]]:
        # Only the counters: a host's stats carry a per-worker mapping besides.
        return {self.name: {key: value for key, value in self._stats().items() if isinstance(value, int)}}

    def _stats(self) -> Mapping[str, Any]:
        raise NotImplementedError


class _WaitressLoad(_HttpLoad):
    name = "waitress"

    def start(self, end: float) -> None:
        from prazo.bindings.servers.waitress import create_server

        s = self.settings
        self._server = create_server(
            SoakApp(s.work_s), host="127.0.0.1", port=0, threads=s.concurrency, max_queue=s.max_queue,
            default_budget_ms=6 * s.work_ms, max_budget_ms=60_000,
        )  # fmt: skip
        self._port = self._server.effective_port
        self._server_thread = threading.Thread(target=self._server.run, name="prazo-soak-waitress-run")
        self._server_thread.start()
        self._paced(end, 2 * (s.concurrency + s.max_queue), self._request)

    def stop(self) -> None:
        from prazo.bindings.servers.waitress import shutdown

        self._join()
        shutdown(self._server, timeout=_CLIENT_TIMEOUT_S)
        self._server_thread.join(_CLIENT_TIMEOUT_S)

    def _stats(self) -> Mapping[str, Any]:
        stats: Mapping[str, Any] = self._server.task_dispatcher.stats()
        return stats


class _FrontDoorLoad(_HttpLoad):
    """The front door (``create_server``) in this process: the waitress load's clients, plus two slow ones.

    ``slow-head`` sends its head one byte at a time over about the header
    timeout (half of them get 408, the rest are expired on arrival: their
    budget counts from the first byte); ``slow-reader`` asks for ``/large``
    and never reads it, so the worker's write stalls until its write timeout.
    """

    name = "frontdoor"
    CLIENTS = (*_HttpLoad.CLIENTS, "slow-head", "slow-reader")
    CLIENT_WEIGHTS = (62, 8, 10, 12, 4, 4)
    # Short enough that a slow client is cut off within a second, so the
    # load keeps its pace; each longer than a healthy exchange on a loaded machine.
    HEADER_TIMEOUT_MS = 500.0
    WRITE_GRACE_MS = 250.0
    IO_TIMEOUT_MS = 1000.0
    # The slow clients hold a client thread for up to about two seconds each.
    SLOW_CLIENT_THREADS = 16

    def __init__(self, settings: SoakSettings, seed: int) -> None:
        super().__init__(settings, seed)
        from prazo.bindings.servers.frontdoor import compiled_engine

        compiled_engine()  # before anything starts: the front door needs its C engine
        self._server: Any = None
        self._final: dict[str, Any] = {}
        self.shut_down_clean: bool | None = None

    def _options(self) -> dict[str, Any]:
        s = self.settings
        return {
            "threads": s.concurrency, "max_queue": s.max_queue, "default_budget_ms": 6 * s.work_ms,
            "max_budget_ms": 60_000, "header_timeout_ms": self.HEADER_TIMEOUT_MS,
            "write_grace_ms": self.WRITE_GRACE_MS, "io_timeout_ms": self.IO_TIMEOUT_MS,
            "shutdown_timeout": _CLIENT_TIMEOUT_S,
        }  # fmt: skip

    def start(self, end: float) -> None:
        from prazo.bindings.servers.frontdoor import create_server

        s = self.settings
        self._server = create_server(SoakApp(s.work_s), host="127.0.0.1", port=0, **self._options())
        self._server.start()
        self._port = self._server.port
        self._paced(end, 2 * (s.concurrency + s.max_queue) + self.SLOW_CLIENT_THREADS, self._request)

    def _slow(self, client: str, path: str, headers: dict[str, str], rng: random.Random) -> str:
        with socket.create_connection(("127.0.0.1", self._port), timeout=_CLIENT_TIMEOUT_S) as sock:
            if client == "slow-reader":
                sock.sendall(self._head("GET", "/large", headers))
                time.sleep(rng.uniform(0.5, 2.0))
                return "left"
            head = self._head("GET", path, headers)
            pause = rng.uniform(0.5, 1.5) * self.HEADER_TIMEOUT_MS / 1000 / len(head)
            try:
                for index in range(len(head)):
                    sock.sendall(head[index : index + 1])
                    time.sleep(pause)
            except OSError:
                pass  # answered 408 and closed while the head was still coming: read that answer
            return _status_of(sock.recv(64))

    def _at_rest_stats(self) -> dict[str, Any]:
        """The server's stats once nothing runs or waits (its last requests end after the clients' threads do)."""
        _settled(lambda: _busy(self._server.stats()), 0, THREAD_SETTLE_S)
        return dict(self._server.stats())

    def stop(self) -> None:
        self._join()
        self._final = self._at_rest_stats()
        self.shut_down_clean = self._server.shutdown(_CLIENT_TIMEOUT_S)
        self._summarise(self._server)
        # A shut-down front door keeps its engine's epoll and eventfd descriptors
        # until it is freed (stats() still reads the engine): let it go, so the
        # descriptor check sees what a caller that drops its server gets.
        self._server = None

    def _summarise(self, server: Any) -> None:
        """Keep what the summary reports of ``server`` before it goes."""

    def _stats(self) -> Mapping[str, Any]:
        return self._final

    def shutdowns(self) -> dict[str, bool]:
        return {} if self.shut_down_clean is None else {self.name: self.shut_down_clean}


def _status_of(answer: bytes) -> str:
    """The status code of an HTTP answer's first bytes; ``closed`` when there were none."""
    parts = answer.split(b" ", 2)
    return parts[1].decode("ascii", "replace") if len(parts) > 1 else "closed"


def _busy(stats: Mapping[str, Any]) -> int:
    return sum(int(stats[counter]) for counter in AT_REST)


class _HostLoad(_FrontDoorLoad):
    """The front door's host (``create_server(..., workers=2)``) under the front door's load, with process faults.

    Through the run, a fault thread alternates a SIGKILL of a random worker
    and a rolling reload of every worker; ``max_requests`` retires workers
    as they serve. The pids change all along: ``processes()`` is what runs now.
    """

    name = "host"
    WORKERS = 2
    # Faults per run, spread evenly, at most one every half second.
    FAULTS = 20
    # Fewer and a worker's memory is sampled too few times to compare (the
    # run's samples are a second apart in a 60-second run).
    MIN_MAX_REQUESTS = 30

    @property
    def threads(self) -> int:
        return max(self.settings.concurrency // self.WORKERS, 1)

    @property
    def capacity_per_s(self) -> float:
        return self.WORKERS * self.threads / self.settings.work_s

    @property
    def fault_interval_s(self) -> float:
        return max(self.settings.seconds / self.FAULTS, 0.5)

    @property
    def max_requests(self) -> int:
        """What a worker serves in about one fault interval at capacity.

        A reload every other interval replaces every worker, so a worker that
        is neither killed nor reloaded first retires on ``max_requests`` about
        once between two reloads: all three ways a worker ends keep happening.
        """
        return max(self.MIN_MAX_REQUESTS, round(self.threads / self.settings.work_s * self.fault_interval_s))

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "workers": self.WORKERS, "threads": self.threads,
                "max_requests": self.max_requests}  # fmt: skip

    def start(self, end: float) -> None:
        super().start(end)
        self._spawn(self._faults, self._rng(-3), end)

    def _faults(self, rng: random.Random, end: float) -> None:
        interval = self.fault_interval_s
        for fault in itertools.cycle(("kill", "reload")):
            # The last fault comes an interval before the end, so the host has settled when the load stops.
            if time.monotonic() + 2 * interval > end:
                return
            time.sleep(interval)
            if fault == "reload":
                self._server.reload()
                self.tally.add("fault-reload")
                continue
            pids = self._server.worker_pids()
            try:
                os.kill(rng.choice(pids), signal.SIGKILL)
                self.tally.add("fault-worker-killed")
            except (IndexError, ProcessLookupError):
                self.tally.add("fault-no-worker-to-kill")  # none serving (all being replaced), or it just exited

    def processes(self) -> dict[int, str]:
        server = self._server
        if server is None or not server.triage_pid:
            return {}
        return {os.getpid(): "supervisor", server.triage_pid: "triage", **dict.fromkeys(server.worker_pids(), "worker")}

    def _summarise(self, server: Any) -> None:
        self._replaced = server.replaced

    def summary(self) -> dict[str, Any]:
        # Requests cut by a kill and workers replaced (after a kill or max_requests) are outcomes too.
        summary = super().summary()
        outcomes = summary["outcomes"] | {
            "server-worker_lost": self._final.get("worker_lost", 0),
            "server-workers-replaced": self._replaced,
        }
        return dict(summary, outcomes=dict(sorted(outcomes.items())))


# -- the middleware, called in-process ------------------------------------------------


class _MiddlewareLoad(_Load):
    name = "middleware"
    # What the "server" does with the response body.
    BODIES = ("consumed", "closed-early", "dropped-half-read", "dropped-unread")
    BODY_WEIGHTS = (70, 10, 10, 10)

    def __init__(self, settings: SoakSettings, seed: int, queue_class: QueueClass) -> None:
        super().__init__(settings, seed)
        self.middleware = middleware_for(
            SoakApp(settings.work_s), queue_class, max_concurrency=settings.concurrency, max_queue=settings.max_queue,
            default_budget_ms=6 * settings.work_ms,
        )  # fmt: skip

    def start(self, end: float) -> None:
        s = self.settings
        self._paced(end, 2 * (s.concurrency + s.max_queue), self._request)

    def _request(self, rng: random.Random) -> None:
        environ = minimal_environ(budget_ms=f"{self.settings.budget_ms(rng):.0f}")
        environ["PATH_INFO"] = rng.choices(SoakApp.PATHS, SoakApp.WEIGHTS)[0]
        handling = rng.choices(self.BODIES, self.BODY_WEIGHTS)[0]
        statuses: list[str] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> Any:
            statuses.append(_body_status(status))
            return _discard

        try:
            body = self.middleware(environ, start_response)
            self._serve_body(body, handling)
        except AppFault:
            self.tally.add("app-raised")
            return
        # A streamed body dropped unread never started the response.
        self.tally.add(statuses[-1] if statuses else "never-started")
        self.tally.add(f"body-{handling}")

    @staticmethod
    def _serve_body(body: Iterable[bytes], handling: str) -> None:
        if handling == "dropped-unread":
            return  # the last reference goes with this frame
        chunks = iter(body)
        if handling == "consumed":
            try:
                for _chunk in chunks:
                    pass
            finally:
                _close(body)
            return
        next(chunks, None)
        if handling == "closed-early":
            _close(body)

    def stop(self) -> None:
        self._join()

    def queues(self) -> dict[str, dict[str, int]]:
        return {"middleware": self.middleware.queue.stats()}


def _close(body: Iterable[bytes]) -> None:
    close = getattr(body, "close", None)
    if close is not None:
        close()


def _discard(data: bytes) -> None:
    """The ``write()`` callable of the in-process server: the bytes go nowhere."""


# -- the pool ---------------------------------------------------------------------------


def _pool_task(work_s: float, fail: bool) -> None:
    time.sleep(work_s)
    if fail:
        raise AppFault("the task raised")


class _PoolLoad(_Load):
    name = "pool"

    def start(self, end: float) -> None:
        s = self.settings
        self.pool = AdmissionPool(s.concurrency, s.max_queue, thread_name_prefix="prazo-soak-pool")
        self._paced(end, 2, self._submit)

    def _submit(self, rng: random.Random) -> None:
        draw = rng.random()
        deadline = None if draw < 0.05 else Deadline.after_ms(self.settings.budget_ms(rng))
        try:
            future = self.pool.submit_until(deadline, _pool_task, self.settings.work_s, rng.random() < 0.1)
        except QueueFull:
            self.tally.add("queue-full")
            return
        future.add_done_callback(self._done)
        if rng.random() < 0.1:
            future.cancel()

    def _done(self, future: Future[None]) -> None:
        # exception(), not result(): re-raising the future's exception here would
        # add this frame (which holds the future) to its traceback, a cycle per
        # failed task that only a full collection frees, which the RSS check would count.
        if future.cancelled():
            self.tally.add("cancelled")
            return
        exc = future.exception()
        if isinstance(exc, DeadlineExceeded):
            self.tally.add(exc.reason)
        elif isinstance(exc, AppFault):
            self.tally.add("task-raised")
        elif exc is not None:
            raise exc
        else:
            self.tally.add("ok")

    def stop(self) -> None:
        self._join()
        self.pool.shutdown(wait=True)

    def queues(self) -> dict[str, dict[str, int]]:
        return {"pool": self.pool.stats()}


# -- the gate, with signals delivered to the main thread while it waits -----------------


class SignalFault(Exception):
    """Raised by the soak's SIGUSR1 handler."""


class SignalInterrupt(BaseException):
    """Raised by the soak's SIGUSR2 handler, as ``SystemExit`` is by a SIGTERM handler that exits."""


class _GateLoad(_Load):
    """Helper threads and the main thread contend for a small gate; the main thread gets signals.

    Signal handlers run in the main thread at any bytecode boundary, so the
    handler only raises while the main thread is *armed* — from just before
    ``q.slot()`` is entered until the ``with`` body starts, i.e. while it
    waits — and disarms itself when it raises: a signal can never escape into
    the soak's own bookkeeping, only into the queue's wait. (Not into
    ``Slot.__exit__`` either: a Python-level ``__exit__`` can be interrupted
    before it releases, which is no queue's fault — the C twin's is C.)
    """

    name = "gate"
    HELPERS = 8
    SLOTS = 2
    PLACES = 4

    def __init__(self, settings: SoakSettings, seed: int, queue_class: QueueClass) -> None:
        super().__init__(settings, seed)
        self.queue = queue_class(self.SLOTS, self.PLACES)
        self._armed = False
        self.signals_sent = 0
        self.signals_delivered = 0
        self._previous: dict[signal.Signals, Any] = {}

    def start(self, end: float) -> None:
        # The handlers first: a signal reaching the default SIGUSR1 action would end the process.
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            self._previous[signum] = signal.signal(signum, self._handler)
        for index in range(self.HELPERS):
            self._spawn(self._helper, self._rng(index), end)
        self._spawn(self._signaller, self._rng(self.HELPERS), end, threading.main_thread().ident)

    def _helper(self, rng: random.Random, end: float) -> None:
        while time.monotonic() < end:
            self.tally.add(self._attempt(rng, rng.uniform(0, 5)))

    def _attempt(self, rng: random.Random, budget_ms: float, *, main: bool = False) -> str:
        try:
            with self.queue.slot(Deadline.after_ms(budget_ms)):
                if main:
                    self._armed = False
                time.sleep(rng.uniform(0, 0.002))
            return "ran"
        except QueueFull:
            time.sleep(_BACKOFF_S)
            return "queue-full"
        except DeadlineExceeded as exc:
            return exc.reason

    def _main_attempt(self, rng: random.Random) -> str:
        try:
            self._armed = True
            return self._attempt(rng, rng.uniform(0, 20), main=True)
        finally:
            self._armed = False

    def _signaller(self, rng: random.Random, end: float, main_ident: int | None) -> None:
        assert main_ident is not None
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.001, 0.010))
            signal.pthread_kill(main_ident, signal.SIGUSR1 if rng.random() < 0.7 else signal.SIGUSR2)
            self.signals_sent += 1

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # No lock here: the handler may run while the main thread holds one.
        self.signals_delivered += 1
        if not self._armed:
            return
        self._armed = False
        raise SignalFault() if signum == signal.SIGUSR1 else SignalInterrupt()

    def run_main_thread(self, end: float) -> None:
        """The main thread's part: wait in ``slot()`` again and again while signals arrive."""
        rng = self._rng(-2)
        while time.monotonic() < end:
            try:
                outcome = self._main_attempt(rng)
            except SignalFault:
                outcome = "interrupted-exception"
            except SignalInterrupt:
                outcome = "interrupted-baseexception"
            self.tally.add(f"main-{outcome}")

    def stop(self) -> None:
        self._join()
        # The signaller has ended, so every signal it sent has been delivered
        # (its disarmed handler ran); only now go back to the previous handlers.
        while self._previous:
            signum, previous = self._previous.popitem()
            signal.signal(signum, previous)

    def queues(self) -> dict[str, dict[str, int]]:
        return {"gate": self.queue.stats()}

    def summary(self) -> dict[str, Any]:
        """A closed loop, not paced: what contends, the signals, the outcomes."""
        return {
            "threads": self.HELPERS + 1,
            "slots": self.SLOTS,
            "max_queue": self.PLACES,
            "signals_sent": self.signals_sent,
            "signals_delivered": self.signals_delivered,
            "outcomes": self.tally.snapshot(),
        }


# -- the work-queue face with raising on_expired callbacks ------------------------------


class CallbackInterrupt(BaseException):
    """What a soak ``on_expired`` callback raises when it plays KeyboardInterrupt."""


class _WorkQueueLoad(_Load):
    name = "work-queue"
    FATES = ("returns", "raises-exception", "raises-baseexception")
    FATE_WEIGHTS = (45, 45, 10)
    CONSUMERS = 2

    def __init__(self, settings: SoakSettings, seed: int, queue_class: QueueClass) -> None:
        super().__init__(settings, seed)
        self.queue = queue_class(self.CONSUMERS, settings.max_queue, on_expired=self._expired)

    @property
    def capacity_per_s(self) -> float:
        return self.CONSUMERS / self.settings.work_s

    def start(self, end: float) -> None:
        self._last_sweep = time.monotonic()
        self._producers = self._paced(end, 1, self._produce)
        for _ in range(self.CONSUMERS):
            self._spawn(self._consume)

    def _expired(self, fate: str) -> None:
        self.tally.add("on_expired-called")
        if fate == "raises-exception":
            raise AppFault("on_expired raised")
        if fate == "raises-baseexception":
            raise CallbackInterrupt()

    def _produce(self, rng: random.Random) -> None:
        fate = rng.choices(self.FATES, self.FATE_WEIGHTS)[0]
        deadline = Deadline.after_ms(rng.uniform(self.settings.work_ms / 4, 3 * self.settings.work_ms))
        try:
            self.queue.put(fate, deadline)
            if time.monotonic() - self._last_sweep > 0.005:
                self._last_sweep = time.monotonic()
                self.queue.expire_overdue()
        except QueueFull:
            self.tally.add("queue-full")
        except DeadlineExceeded:
            # The producer was descheduled past its (>= work_ms / 4) deadline before put(): a busy machine.
            self.tally.add("expired-on-arrival")
        except CallbackInterrupt:
            self.tally.add("interrupt-reached-producer")

    def _consume(self) -> None:
        while True:
            try:
                self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            except ShutDown:
                return
            except CallbackInterrupt:
                self.tally.add("interrupt-reached-get")
                continue
            time.sleep(self.settings.work_s)
            self.tally.add("done")
            try:
                self.queue.task_done()
            except CallbackInterrupt:
                self.tally.add("interrupt-reached-task_done")

    def stop(self) -> None:
        # The producer ends at ``end``; consumers drain the line, then see ShutDown.
        self._join(self._producers)
        self.queue.shutdown()
        self._join()

    def queues(self) -> dict[str, dict[str, int]]:
        return {"work-queue": self.queue.stats()}

    def expired_reported(self) -> dict[str, int]:
        return {"work-queue": self.tally.snapshot().get("on_expired-called", 0)}


# -- what is measured besides the loads -------------------------------------------------


def rss_kib(status_path: str = "/proc/self/status") -> int:
    """This process's resident set size in KiB (``VmRSS``); 0 where /proc is not available."""
    try:
        for line in Path(status_path).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class _RssSampler:
    """Samples ``VmRSS`` every ``interval_s`` until ``end``; a full collection before the two that are compared.

    After the warm-up it samples the processes ``watched()`` names too
    (``{pid: role}``, which may change between samples), in ``processes``:
    ``{"role pid": samples}``.
    """

    def __init__(
        self, interval_s: float, warmup_at: float, end: float, started: float,
        watched: Callable[[], Mapping[int, str]] = dict,
    ) -> None:  # fmt: skip
        self.samples: list[tuple[float, int]] = []
        self.processes: dict[str, list[tuple[float, int]]] = {}
        self._watched = watched
        self._interval_s = interval_s
        self._warmup_at = warmup_at
        self._end = end
        self._started = started
        self.warmup_sample = -1
        self.thread = threading.Thread(target=self._run, name="prazo-soak-rss")

    def _sample(self) -> None:
        at = round(time.monotonic() - self._started, 2)
        self.samples.append((at, rss_kib()))
        if self.warmup_sample < 0:
            return
        for pid, role in self._watched().items():
            kib = rss_kib(f"/proc/{pid}/status")
            if kib:  # 0: it exited since it was listed
                self.processes.setdefault(f"{role} {pid}", []).append((at, kib))

    def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= self._end:
                break
            if self.warmup_sample < 0 and now >= self._warmup_at:
                # Garbage still owed a collection would count as growth.
                gc.collect()
                self.warmup_sample = len(self.samples)
            self._sample()
            next_at += self._interval_s
            time.sleep(max(min(next_at, self._end) - time.monotonic(), 0.0))

    def finish(self) -> None:
        """The last sample, at the end of the load, after a full collection."""
        self.thread.join()
        gc.collect()
        if self.warmup_sample < 0:
            self.warmup_sample = len(self.samples)
        self._sample()


class _Incidents:
    """Unhandled exceptions in threads and unraisable ones (``__del__``, finalisers) while the soak runs."""

    def __init__(self) -> None:
        self.thread_exceptions: list[str] = []
        self.unraisable: list[str] = []
        self._previous_thread_hook = threading.excepthook
        self._previous_unraisable_hook = sys.unraisablehook

    def __enter__(self) -> Self:
        def thread_hook(args: Any) -> None:
            self.thread_exceptions.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}")
            self._previous_thread_hook(args)

        def unraisable_hook(args: Any) -> None:
            self.unraisable.append(f"{args.exc_type.__name__} in {args.object!r}")
            self._previous_unraisable_hook(args)

        threading.excepthook = thread_hook
        sys.unraisablehook = unraisable_hook
        return self

    def __exit__(self, *exc_info: object) -> None:
        threading.excepthook = self._previous_thread_hook
        sys.unraisablehook = self._previous_unraisable_hook


class _LogCounter(logging.Handler):
    """Counts the records of prazo's and waitress's loggers (tracebacks of faults the soak provokes on purpose)."""

    LOGGERS = ("prazo", "waitress")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter[str] = Counter()
        self._saved: list[tuple[logging.Logger, bool, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name} {record.levelname}"] += 1

    def __enter__(self) -> Self:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.propagate, logger.level))
            logger.addHandler(self)
            logger.propagate = False
            logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for logger, propagate, level in self._saved:
            logger.removeHandler(self)
            logger.propagate = propagate
            logger.setLevel(level)


# -- the checks -------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakObservation:
    """What the checks look at; ``check_soak`` is a pure function of it."""

    queues: dict[str, dict[str, int]]
    expired_reported: dict[str, int]
    threads_baseline: int
    threads_after: int
    thread_exceptions: list[str]
    unraisable: list[str]
    rss_samples: list[tuple[float, int]]
    warmup_sample: int
    rss_limit_kib: int
    # What the front door's loads add: their shutdown()'s verdict, and the host's processes.
    shutdowns: dict[str, bool] = field(default_factory=dict)
    process_rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    children_left: list[int] = field(default_factory=list)
    fds_baseline: int = 0
    fds_after: int = 0

    @property
    def rss_growth_kib(self) -> int | None:
        """Growth from the warm-up sample to the last one; None without samples (no /proc)."""
        if not self.rss_samples or not 0 <= self.warmup_sample < len(self.rss_samples):
            return None
        if self.rss_samples[self.warmup_sample][1] == 0:
            return None
        return self.rss_samples[-1][1] - self.rss_samples[self.warmup_sample][1]

    @property
    def process_rss_growth_kib(self) -> dict[str, int]:
        """Each sampled process's growth from its first sample after the warm-up to its last."""
        return {name: samples[-1][1] - samples[0][1] for name, samples in self.process_rss.items() if samples}


def balance_gap(stats: Mapping[str, int]) -> int:
    """``offered`` minus the sum of where the arrivals went (0 when the counters balance)."""
    return stats["offered"] - sum(stats[term] for term in BALANCE_TERMS)


def check_soak(observation: SoakObservation) -> list[Check]:
    """Every check of the module docstring, in order; a failed one has ``ok`` False."""
    checks = []
    for name, stats in observation.queues.items():
        busy = {counter: stats[counter] for counter in AT_REST if stats[counter]}
        checks.append(Check(f"{name}: at rest", not busy, ", ".join(f"{k}={v}" for k, v in busy.items()) or "0/0/0"))
        gap = balance_gap(stats)
        terms = " + ".join(f"{stats[term]}" for term in BALANCE_TERMS)
        checks.append(
            Check(f"{name}: counters balanced", gap == 0, f"offered {stats['offered']} = {terms} (gap {gap})")
        )
        checks.append(
            Check(
                f"{name}: completed == started",
                stats["completed"] == stats["started"],
                f"completed {stats['completed']}, started {stats['started']}",
            )
        )
    for name, reported in observation.expired_reported.items():
        expired = observation.queues[name]["expired_in_queue"]
        checks.append(
            Check(
                f"{name}: every expired item reported", reported == expired, f"on_expired {reported}, expired {expired}"
            )
        )
    leaked = observation.threads_after - observation.threads_baseline
    checks.append(
        Check(
            "no thread leak",
            leaked <= 0,
            f"{observation.threads_after} threads after shutdown, {observation.threads_baseline} before",
        )
    )
    died = observation.thread_exceptions
    checks.append(Check("no unhandled exception in a thread", not died, "; ".join(died[:5]) or "none"))
    unraisable = observation.unraisable
    checks.append(Check("no unraisable exception", not unraisable, "; ".join(unraisable[:5]) or "none"))
    growth = observation.rss_growth_kib
    if growth is None:
        checks.append(Check("resident memory flat", True, "not measured (no /proc/self/status)"))
    else:
        checks.append(
            Check(
                "resident memory flat",
                growth <= observation.rss_limit_kib,
                f"{growth:+d} KiB after warm-up (limit {observation.rss_limit_kib} KiB)",
            )
        )
    return checks + _server_checks(observation)


def _server_checks(observation: SoakObservation) -> list[Check]:
    """The checks of the front door's loads: clean shutdowns, every host process flat, nothing left behind."""
    checks = [
        Check(f"{name}: shut down cleanly", clean, "everything admitted finished" if clean else "shutdown() False")
        for name, clean in observation.shutdowns.items()
    ]
    grown = observation.process_rss_growth_kib
    if grown:
        worst = max(grown, key=lambda name: grown[name])
        checks.append(
            Check(
                "resident memory flat in every process",
                grown[worst] <= observation.rss_limit_kib,
                f"{len(grown)} processes, most growth {grown[worst]:+d} KiB ({worst}; limit "
                f"{observation.rss_limit_kib} KiB)",
            )
        )
    left = observation.children_left
    checks.append(Check("no child process left", not left, ", ".join(map(str, left)) or "none"))
    if observation.fds_baseline:
        leaked = observation.fds_after - observation.fds_baseline
        checks.append(
            Check(
                "no descriptor left",
                leaked <= 0,
                f"{observation.fds_after} open after shutdown, {observation.fds_baseline} before",
            )
        )
    return checks


# -- the run ----------------------------------------------------------------------------


@dataclass
class SoakReport:
    settings: SoakSettings
    twin: str
    observation: SoakObservation
    checks: list[Check]
    loads: dict[str, dict[str, Any]]
    logs: dict[str, int]
    threads_settled_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        observation = asdict(self.observation)
        return {
            "settings": asdict(self.settings),
            "twin": self.twin,
            "ok": self.ok,
            "loads": self.loads,
            "queues": observation.pop("queues"),
            "rss": {
                "samples_kib": observation.pop("rss_samples"),
                "warmup_sample": observation.pop("warmup_sample"),
                "growth_kib": self.observation.rss_growth_kib,
                "limit_kib": observation.pop("rss_limit_kib"),
            },
            "threads": {
                "baseline": observation.pop("threads_baseline"),
                "after": observation.pop("threads_after"),
                "settled_s": self.threads_settled_s,
            },
            **observation,
            "logs": self.logs,
            "checks": [asdict(check) for check in self.checks],
            "notes": self.notes,
        }


def _settled(measure: Callable[[], int], baseline: int, timeout: float) -> tuple[int, float]:
    """Wait until ``measure()`` is back to ``baseline`` (at most ``timeout``); its value then and the wait."""
    started = time.monotonic()
    while (value := measure()) > baseline and time.monotonic() - started < timeout:
        time.sleep(0.05)
    return value, round(time.monotonic() - started, 2)


def _open_fds() -> int:
    """This process's open descriptors; 0 where /proc is not available."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _children() -> set[int]:
    """This process's live (or unreaped) child processes, from every thread's ``children`` list in /proc."""
    pids: set[int] = set()
    for path in Path("/proc/self/task").glob("*/children"):
        try:
            pids.update(int(pid) for pid in path.read_text().split())
        except OSError:
            pass  # the thread ended while listed
    return pids


def _make_loads(settings: SoakSettings, queue_class: QueueClass) -> list[_Load]:
    """The loads ``settings.loads`` names, in the order of ``LOADS``."""
    seed = settings.seed
    makers: dict[str, Callable[[], _Load]] = {
        "waitress": lambda: _WaitressLoad(settings, seed),
        "middleware": lambda: _MiddlewareLoad(settings, seed, queue_class),
        "pool": lambda: _PoolLoad(settings, seed),
        "work-queue": lambda: _WorkQueueLoad(settings, seed, queue_class),
        "frontdoor": lambda: _FrontDoorLoad(settings, seed),
        "host": lambda: _HostLoad(settings, seed),
        "gate": lambda: _GateLoad(settings, seed, queue_class),
    }
    unknown = set(settings.loads) - set(makers)
    if unknown or not settings.loads:
        raise ValueError(f"loads must be some of {', '.join(LOADS)}, got {', '.join(settings.loads) or 'none'}")
    return [makers[name]() for name in LOADS if name in settings.loads]


def run_soak(
    settings: SoakSettings, queue_class: QueueClass = AdmissionQueue, *, twin: str = IMPLEMENTATION
) -> SoakReport:
    """Run the soak in this process (from the main thread: it receives the signals); see the module docstring.

    ``queue_class`` is the twin of the gate, the work queue and the
    middleware; the pool and waitress use the one ``prazo.core`` picked.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the soak delivers signals to the thread waiting in slot(): run it in the main thread")
    notes = []
    if twin != IMPLEMENTATION:
        notes.append(
            f"the gate, work queue and middleware run on the {twin} twin; the pool and waitress on the one "
            f"prazo.core picked ({IMPLEMENTATION})"
        )
    threads_baseline = threading.active_count()
    fds_baseline, children_before = _open_fds(), _children()
    loads = _make_loads(settings, queue_class)
    gate = next((load for load in loads if isinstance(load, _GateLoad)), None)
    faulthandler.dump_traceback_later(settings.seconds + HANG_GRACE_S, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        with _Incidents() as incidents, _LogCounter() as logs:
            started = time.monotonic()
            end = started + settings.seconds
            running: list[_Load] = []
            sampler = _RssSampler(
                settings.sample_interval_s, started + settings.warmup_s, end, started,
                lambda: {pid: role for load in running for pid, role in load.processes().items()},
            )  # fmt: skip
            sampler.thread.start()
            try:
                for load in loads:
                    load.start(end)
                    running.append(load)
                if gate is None:
                    time.sleep(max(end - time.monotonic(), 0.0))
                else:
                    gate.run_main_thread(end)
            finally:
                sampler.finish()
                for load in running:
                    load.stop()
            gc.collect()
            threads_after, settled_s = _settled(threading.active_count, threads_baseline, THREAD_SETTLE_S)
            # Descriptors close as the servers' last threads and processes end: the same settle time.
            fds_after, _ = _settled(_open_fds, fds_baseline, THREAD_SETTLE_S)
    finally:
        faulthandler.cancel_dump_traceback_later()
    observation = SoakObservation(
        queues={name: stats for load in loads for name, stats in load.queues().items()},
        expired_reported={name: count for load in loads for name, count in load.expired_reported().items()},
        threads_baseline=threads_baseline,
        threads_after=threads_after,
        thread_exceptions=incidents.thread_exceptions,
        unraisable=incidents.unraisable,
        rss_samples=sampler.samples,
        warmup_sample=sampler.warmup_sample,
        rss_limit_kib=settings.rss_limit_kib,
        shutdowns={name: clean for load in loads for name, clean in load.shutdowns().items()},
        process_rss=sampler.processes,
        children_left=sorted(_children() - children_before),
        fds_baseline=fds_baseline,
        fds_after=fds_after,
    )
    summaries = {load.name: load.summary() for load in loads}
    return SoakReport(
        settings, twin, observation, check_soak(observation), summaries, dict(sorted(logs.counts.items())),
        settled_s, notes,
    )  # fmt: skip


# -- report and command line --------------------------------------------------------------


def render_soak_report(report: SoakReport, paint: Paint = plain) -> str:
    """The report: loads and their outcomes, every queue's counters at rest, memory, threads, the checks."""
    s, o = report.settings, report.observation
    out = render_heading(
        "prazo bench soak",
        f"{s.seconds:g} s, warm-up {s.warmup_s:g} s, seed {s.seed}, {s.load:g}x capacity, core twin {report.twin}",
        report.notes,
        paint,
    )
    out += ["", paint("loads", "bold")]
    for name, load in report.loads.items():
        if "offered_per_s" in load:
            out.append(
                f"  {name:<11} {load['offered_per_s']:g}/s offered = {load['load']:g}x its capacity "
                f"({load['capacity_per_s']:g}/s)"
            )
        else:
            out.append(
                f"  {name:<11} {load['threads']} threads (the main one too) in a closed loop on {load['slots']} "
                f"slots and {load['max_queue']} places"
            )
            out.append(
                f"{'':<14}signals to the main thread: {load['signals_sent']} sent, {load['signals_delivered']} handled"
            )
        outcomes = ", ".join(f"{key} {count}" for key, count in load["outcomes"].items())
        out += textwrap.wrap(
            outcomes,
            100,
            initial_indent=" " * 14,
            subsequent_indent=" " * 14,
            break_on_hyphens=False,
            break_long_words=False,
        )
    columns = ("offered", *BALANCE_TERMS, "completed", "in_flight")
    out += ["", paint("queues at rest", "bold"), f"  {'':<11}" + "".join(f"{c:>{len(c) + 1}}" for c in columns)]
    for name, stats in o.queues.items():
        out.append(f"  {name:<11}" + "".join(f"{stats[c]:>{len(c) + 1}}" for c in columns))
    growth = o.rss_growth_kib
    out += [
        "",
        paint("resident memory (KiB)", "bold"),
        *textwrap.wrap(
            " ".join(f"{kib}" for _, kib in o.rss_samples),
            100,
            initial_indent="  samples: ",
            subsequent_indent=" " * 11,
        ),
        f"  warm-up ends at sample {o.warmup_sample}; growth after warm-up: "
        + ("n/a" if growth is None else f"{growth:+d} KiB"),
        *_render_process_growth(o.process_rss_growth_kib),
        "",
        paint("threads", "bold") + f"  {o.threads_baseline} before, {o.threads_after} after shutdown "
        f"(settled in {report.threads_settled_s:g} s)",
        paint("descriptors", "bold") + f"  {o.fds_baseline} before, {o.fds_after} after shutdown; "
        f"child processes left: {len(o.children_left)}",
        paint("log records", "bold") + "  " + (", ".join(f"{k} {v}" for k, v in report.logs.items()) or "none"),
        "",
        paint("checks", "bold"),
    ]
    for check in report.checks:
        verdict = paint("[pass]", "ok") if check.ok else paint("[FAIL]", "bad")
        out.append(f"  {verdict} {check.name:<40} {check.detail}")
    out += ["", paint("soak passed", "ok") if report.ok else paint("soak FAILED", "bad")]
    return "\n".join(out)


def _render_process_growth(growth: Mapping[str, int]) -> list[str]:
    """Each sampled process's growth after the warm-up by role (``"role pid"`` keys): the largest of each role."""
    roles: dict[str, list[tuple[int, str]]] = {}
    for name, kib in growth.items():
        role, _, pid = name.partition(" ")
        roles.setdefault(role, []).append((kib, pid))
    return [
        f"  {role}: {len(grown)} process{'es' if len(grown) > 1 else ''}, most growth {kib:+d} KiB (pid {pid})"
        for role, grown in roles.items()
        for kib, pid in [max(grown)]
    ]


def _positive(unit: str, maximum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= maximum):
            raise argparse.ArgumentTypeError(f"must be a number of {unit} > 0 and <= {maximum:g}, got {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _load_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if names == ("all",):
        return LOADS
    unknown = [name for name in names if name not in LOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"must be names from {', '.join(LOADS)} or all, got {text!r}")
    return names


def add_bench_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``prazo bench soak`` on ``parser``."""
    defaults = SoakSettings()
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--minutes",
        type=_positive("minutes", _MAX_MINUTES),
        metavar="N",
        help=f"how long the load runs (default {defaults.seconds / 60:g})",
    )
    length.add_argument(
        "--seconds",
        type=_positive("seconds", _MAX_MINUTES * 60),
        metavar="N",
        help="the same in seconds, for short runs",
    )
    parser.add_argument("--seed", type=_count, metavar="N", help="seed of every random choice (default: a random one)")
    parser.add_argument(
        "--rss-limit-kib",
        type=_count,
        metavar="KIB",
        help=f"most resident-memory growth after warm-up that passes (default {defaults.rss_limit_kib})",
    )
    parser.add_argument(
        "--loads",
        type=_load_names,
        metavar="NAME,...",
        help=f"comma-separated, from {', '.join(LOADS)}, or all (default {','.join(DEFAULT_LOADS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def settings_from(args: argparse.Namespace) -> SoakSettings:
    """The settings ``args`` (from ``add_bench_soak_arguments``) ask for; options left out keep their defaults."""
    defaults = SoakSettings()
    minutes, seconds = getattr(args, "minutes", None), getattr(args, "seconds", None)
    seed = getattr(args, "seed", None)
    rss_limit_kib = getattr(args, "rss_limit_kib", None)
    loads = getattr(args, "loads", None)
    if seconds is None:
        seconds = defaults.seconds if minutes is None else minutes * 60
    return SoakSettings(
        seconds=seconds,
        seed=random.randrange(2**32) if seed is None else seed,
        rss_limit_kib=defaults.rss_limit_kib if rss_limit_kib is None else rss_limit_kib,
        loads=defaults.loads if loads is None else loads,
    )


def run_bench_soak(args: argparse.Namespace, out: TextIO, queue_class: QueueClass, twin: str, paint: Paint) -> int:
    """Run the soak as ``args`` ask; print the report (JSON with ``--json``); 0 when every check passed, else 1."""
    report = run_soak(settings_from(args), queue_class, twin=twin)
    if getattr(args, "json", False):
        print(json.dumps(report.to_json(), indent=2), file=out)
    else:
        print(render_soak_report(report, paint), file=out)
    return 0 if report.ok else 1
