"""``prazo bench soak``: mixed load with random faults at about 1.5x capacity, then every queue must be at rest.

Five loads run at once for ``--minutes`` (or ``--seconds``), each offered
Poisson arrivals at ``load`` (1.5) times the capacity of its queue:

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
  the load must stay within ``--rss-limit-kib``.

A hang (a deadlock in the queue, say) cannot report itself: if the process
is still running ``HANG_GRACE_S`` after the load should have ended, it exits
with status 1 after printing every thread's traceback (``faulthandler``).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import http.client
import json
import logging
import math
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
    streams, then raises after the first chunk.
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


# -- waitress: real HTTP on loopback --------------------------------------------------


class _WaitressLoad(_Load):
    name = "waitress"
    # Client behaviour: answer read in full, or one of three ways of going away.
    CLIENTS = ("read", "gone-mid-request", "gone-before-answer", "gone-mid-response")
    CLIENT_WEIGHTS = (70, 8, 10, 12)

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

    def _request(self, rng: random.Random) -> None:
        client = rng.choices(self.CLIENTS, self.CLIENT_WEIGHTS)[0]
        path = "/stream" if client == "gone-mid-response" else rng.choices(SoakApp.PATHS, SoakApp.WEIGHTS)[0]
        headers = {"X-Request-Budget-Ms": f"{self.settings.budget_ms(rng):.0f}"}
        try:
            if client == "read":
                self.tally.add(self._read(path, headers))
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

    def _go_away(self, client: str, path: str, headers: dict[str, str], rng: random.Random) -> None:
        lines = [f"{'POST' if client == 'gone-mid-request' else 'GET'} {path} HTTP/1.1", "Host: 127.0.0.1"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        body = b""
        if client == "gone-mid-request":
            # Announce 1000 bytes, send a few: waitress is left waiting for the rest.
            lines.append("Content-Length: 1000")
            body = b"y" * rng.randrange(1, 1000)
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
        with socket.create_connection(("127.0.0.1", self._port), timeout=_CLIENT_TIMEOUT_S) as sock:
            sock.sendall(head + body)
            if client == "gone-mid-response":
                sock.recv(rng.randrange(1, 2048))

    def stop(self) -> None:
        from prazo.bindings.servers.waitress import shutdown

        self._join()
        shutdown(self._server, timeout=_CLIENT_TIMEOUT_S)
        self._server_thread.join(_CLIENT_TIMEOUT_S)

    def queues(self) -> dict[str, dict[str, int]]:
        return {"waitress": self._server.task_dispatcher.stats()}


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
    """Samples ``VmRSS`` every ``interval_s`` until ``end``; a full collection before the two that are compared."""

    def __init__(self, interval_s: float, warmup_at: float, end: float, started: float) -> None:
        self.samples: list[tuple[float, int]] = []
        self._interval_s = interval_s
        self._warmup_at = warmup_at
        self._end = end
        self._started = started
        self.warmup_sample = -1
        self.thread = threading.Thread(target=self._run, name="prazo-soak-rss")

    def _sample(self) -> None:
        self.samples.append((round(time.monotonic() - self._started, 2), rss_kib()))

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

    @property
    def rss_growth_kib(self) -> int | None:
        """Growth from the warm-up sample to the last one; None without samples (no /proc)."""
        if not self.rss_samples or not 0 <= self.warmup_sample < len(self.rss_samples):
            return None
        if self.rss_samples[self.warmup_sample][1] == 0:
            return None
        return self.rss_samples[-1][1] - self.rss_samples[self.warmup_sample][1]


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


def _wait_for_threads(baseline: int, timeout: float) -> tuple[int, float]:
    started = time.monotonic()
    while threading.active_count() > baseline and time.monotonic() - started < timeout:
        time.sleep(0.05)
    return threading.active_count(), round(time.monotonic() - started, 2)


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
    gate = _GateLoad(settings, settings.seed, queue_class)
    loads: list[_Load] = [
        _WaitressLoad(settings, settings.seed),
        _MiddlewareLoad(settings, settings.seed, queue_class),
        _PoolLoad(settings, settings.seed),
        _WorkQueueLoad(settings, settings.seed, queue_class),
        gate,
    ]
    faulthandler.dump_traceback_later(settings.seconds + HANG_GRACE_S, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        with _Incidents() as incidents, _LogCounter() as logs:
            started = time.monotonic()
            end = started + settings.seconds
            sampler = _RssSampler(settings.sample_interval_s, started + settings.warmup_s, end, started)
            sampler.thread.start()
            running: list[_Load] = []
            try:
                for load in loads:
                    load.start(end)
                    running.append(load)
                gate.run_main_thread(end)
            finally:
                sampler.finish()
                for load in running:
                    load.stop()
            gc.collect()
            threads_after, settled_s = _wait_for_threads(threads_baseline, THREAD_SETTLE_S)
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
        "",
        paint("threads", "bold") + f"  {o.threads_baseline} before, {o.threads_after} after shutdown "
        f"(settled in {report.threads_settled_s:g} s)",
        paint("log records", "bold") + "  " + (", ".join(f"{k} {v}" for k, v in report.logs.items()) or "none"),
        "",
        paint("checks", "bold"),
    ]
    for check in report.checks:
        verdict = paint("[pass]", "ok") if check.ok else paint("[FAIL]", "bad")
        out.append(f"  {verdict} {check.name:<40} {check.detail}")
    out += ["", paint("soak passed", "ok") if report.ok else paint("soak FAILED", "bad")]
    return "\n".join(out)


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
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def settings_from(args: argparse.Namespace) -> SoakSettings:
    """The settings ``args`` (from ``add_bench_soak_arguments``) ask for; options left out keep their defaults."""
    defaults = SoakSettings()
    minutes, seconds = getattr(args, "minutes", None), getattr(args, "seconds", None)
    seed = getattr(args, "seed", None)
    rss_limit_kib = getattr(args, "rss_limit_kib", None)
    if seconds is None:
        seconds = defaults.seconds if minutes is None else minutes * 60
    return SoakSettings(
        seconds=seconds,
        seed=random.randrange(2**32) if seed is None else seed,
        rss_limit_kib=defaults.rss_limit_kib if rss_limit_kib is None else rss_limit_kib,
    )


def run_bench_soak(args: argparse.Namespace, out: TextIO, queue_class: QueueClass, twin: str, paint: Paint) -> int:
    """Run the soak as ``args`` ask; print the report (JSON with ``--json``); 0 when every check passed, else 1."""
    report = run_soak(settings_from(args), queue_class, twin=twin)
    if getattr(args, "json", False):
        print(json.dumps(report.to_json(), indent=2), file=out)
    else:
        print(render_soak_report(report, paint), file=out)
    return 0 if report.ok else 1
