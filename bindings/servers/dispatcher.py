"""The pieces every server embedding shares: settings, the dispatcher, polite refusals.

A threaded WSGI server has its own queue between the thread that accepts and
reads requests and the worker threads that run the app. That queue is where a
request really waits, where its true arrival time is known, and where a
request that will be refused has not yet cost a worker anything. The
embeddings (``prazo.bindings.waitress``, ``.gunicorn``, ``.werkzeug``,
``.wsgiref``, ``.cheroot``) replace it with prazo's admission queue, built from
these parts:

``ServerSettings`` / ``resolve_settings``
    threads, queue size, budgets and the header timeout, from arguments or the
    environment (``PRAZO_MAX_QUEUE``, ``PRAZO_DEFAULT_BUDGET_MS``,
    ``PRAZO_MAX_BUDGET_MS``, ``PRAZO_HEADER_TIMEOUT_MS``,
    ``PRAZO_TRUST_REQUEST_START``, ``PRAZO_TRUSTED_PROXIES``,
    ``PRAZO_MAX_UPSTREAM_MS``); explicit arguments win over the environment.
``AdmissionDispatcher``
    a fixed set of worker threads pulling ``Ticket`` s from the work-queue face
    of ``prazo.core.AdmissionQueue``: ``submit`` admits or refuses at once,
    a ticket whose deadline passes while it waits is refused (504) at its own
    deadline, and every refusal goes to one callback.
``AdmittedApp``
    wraps the app: it runs the request that the current worker holds through
    ``prazo.bindings.wsgi.run_admitted`` (deadline scope, environ keys, slot
    released exactly once).
``ConnectionAdmission``
    admission of a raw connection for the socket-level servers: waits, without
    a worker, until the request head is complete (408 after the header
    timeout), computes the exact deadline from it, writes refusals itself and
    closes them politely through a ``LingeringCloser`` (so a client still
    uploading its body reads the 503 instead of a reset).
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prazo.core import (
    IMPLEMENTATION,
    NS_PER_MS,
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    AdmissionQueue,
    Deadline,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
)

from .headers import REASON_HEADER, BudgetPolicy, IncomingBudget, is_ambiguous_header_name
from .pool import _Reaper
from .proxy_headers import (
    DEFAULT_MAX_UPSTREAM_MS,
    FrontProxyBudgetPolicy,
    checked_max_upstream_ms,
    trusted_networks,
)
from .wsgi import (
    BUDGET_SOURCE_KEY,
    MiddlewareCounters,
    StartResponse,
    WSGIApp,
    rejection_response,
    run_admitted,
    send_rejection,
)

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_MS",
    "DEFAULT_LINGER_S",
    "DEFAULT_MAX_DRAIN_BYTES",
    "DEFAULT_THREADS",
    "ENV_DEFAULT_BUDGET_MS",
    "ENV_HEADER_TIMEOUT_MS",
    "ENV_MAX_BUDGET_MS",
    "ENV_MAX_QUEUE",
    "ENV_MAX_UPSTREAM_MS",
    "ENV_TRUSTED_PROXIES",
    "ENV_TRUST_REQUEST_START",
    "MAX_HEAD_BYTES",
    "REASON_HEADER_TIMEOUT",
    "SERVER_STATS_KEY",
    "AdmissionDispatcher",
    "AdmittedApp",
    "ConnectionAdmission",
    "LingeringCloser",
    "ReadinessWatcher",
    "ServerSettings",
    "SocketWatcher",
    "Ticket",
    "find_head",
    "head_environ",
    "peek_bytes",
    "peekable",
    "rejection_bytes",
    "resolve_settings",
    "send_rejection_bytes",
]

_log = logging.getLogger("prazo.servers")

ENV_MAX_QUEUE = "PRAZO_MAX_QUEUE"
ENV_DEFAULT_BUDGET_MS = "PRAZO_DEFAULT_BUDGET_MS"
ENV_MAX_BUDGET_MS = "PRAZO_MAX_BUDGET_MS"
ENV_TRUST_REQUEST_START = "PRAZO_TRUST_REQUEST_START"
ENV_TRUSTED_PROXIES = "PRAZO_TRUSTED_PROXIES"
ENV_MAX_UPSTREAM_MS = "PRAZO_MAX_UPSTREAM_MS"
ENV_HEADER_TIMEOUT_MS = "PRAZO_HEADER_TIMEOUT_MS"

DEFAULT_THREADS = 4
# Without an explicit size the line holds four requests per worker: with a
# typical service time well under the default 1 s budget, the last in line
# still starts in time, and a burst of four times the workers is absorbed.
DEFAULT_QUEUE_PER_THREAD = 4
DEFAULT_BUDGET_MS = 1000.0
DEFAULT_MAX_BUDGET_MS = 30000.0
# nginx's client_header_timeout is 60 s; a head from a healthy client takes
# one round trip, and every second a slow one is allowed is a connection a
# slow-loris client keeps open for free.
DEFAULT_HEADER_TIMEOUT_MS = 5000.0

# environ key of a callable returning the server queue's counters, so an app
# (or its metrics endpoint) can read the state of the queue it sits behind.
SERVER_STATS_KEY = "prazo.server_stats"

# A request head larger than this is not peeked at; the request is admitted
# with a provisional deadline and its real one is computed once it is parsed.
MAX_HEAD_BYTES = 65536
# X-Prazo-Reason of the 408 answering a head not complete within the header timeout.
REASON_HEADER_TIMEOUT = "header-timeout"
# A head still arriving is peeked at again after 1 ms, then after twice as
# long each time, up to 0.1 s: a head split across packets is seen a moment
# after its end arrives, and a slow-loris client costs at most ten peeks a
# second. (Peeking leaves the bytes for the server, so the socket stays
# readable and readiness cannot tell when more arrive.)
_HEAD_FIRST_LOOK_NS = 1_000_000
_HEAD_MAX_LOOK_NS = 100_000_000

# Polite close: after a refusal the write side is shut and the client's bytes
# are read and dropped for up to DEFAULT_LINGER_S or DEFAULT_MAX_DRAIN_BYTES,
# so a client still sending its body finishes and then reads the answer.
DEFAULT_LINGER_S = 2.0
DEFAULT_MAX_DRAIN_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_LINGERING = 512
# A refusal is a few hundred bytes into an empty send buffer; this bound only
# matters for a peer that stopped reading entirely.
_SEND_TIMEOUT_S = 1.0
_DRAIN_CHUNK = 65536

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})

_MSG_PEEK_DONTWAIT = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
_CAN_PEEK_WITHOUT_BLOCKING = hasattr(socket, "MSG_DONTWAIT")


# -- settings -------------------------------------------------------------------


def _whole_number(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _env_int(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


def _env_ms(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be a number of milliseconds, got {raw!r}") from None
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of milliseconds > 0, got {raw!r}")
    return value


def _env_bool(environ: Mapping[str, str], name: str) -> bool | None:
    raw = environ.get(name)
    if raw is None:
        return None
    word = raw.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"{name} must be 1/0, true/false, yes/no or on/off, got {raw!r}")


def _env_list(environ: Mapping[str, str], name: str) -> tuple[str, ...] | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


@dataclass(frozen=True)
class ServerSettings:
    """The limits of one server embedding; build it with ``resolve_settings``.

    ``threads`` requests run at once and ``max_queue`` more wait, so the
    capacity is ``threads + max_queue``; every request's deadline comes from
    ``policy()``. With ``trust_request_start`` the time a request spent queued
    in a front proxy (``X-Request-Start``) is taken off its budget, at most
    ``max_upstream_ms``, for peers in ``trusted_proxies`` (all when None). On
    the socket-level servers a request head must be complete within
    ``header_timeout_ms`` of its first byte, or it is answered 408.
    """

    threads: int
    max_queue: int
    default_budget_ms: float = DEFAULT_BUDGET_MS
    max_budget_ms: float = DEFAULT_MAX_BUDGET_MS
    trust_request_start: bool = False
    max_upstream_ms: float = DEFAULT_MAX_UPSTREAM_MS
    trusted_proxies: tuple[str, ...] | None = None
    header_timeout_ms: float = DEFAULT_HEADER_TIMEOUT_MS

    def __post_init__(self) -> None:
        _whole_number(self.threads, "threads", 1)
        _whole_number(self.max_queue, "max_queue", 0)
        timeout = self.header_timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"header_timeout_ms must be a number, not {type(timeout).__name__}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"header_timeout_ms must be a finite number of milliseconds > 0, got {timeout!r}")
        if not isinstance(self.trust_request_start, bool):
            raise TypeError(f"trust_request_start must be a bool, not {type(self.trust_request_start).__name__}")
        # Building the policy validates the budgets; the front-proxy options are
        # checked even while trust is off, so a bad value fails at start-up.
        self.policy()
        checked_max_upstream_ms(self.max_upstream_ms)
        trusted_networks(self.trusted_proxies)

    @property
    def capacity(self) -> int:
        """Requests the server holds at most: running plus waiting."""
        return self.threads + self.max_queue

    def policy(self) -> BudgetPolicy:
        """A fresh ``BudgetPolicy`` (``FrontProxyBudgetPolicy`` when trusting proxies)."""
        if self.trust_request_start:
            return FrontProxyBudgetPolicy(
                self.default_budget_ms,
                self.max_budget_ms,
                max_upstream_ms=self.max_upstream_ms,
                trusted_proxies=self.trusted_proxies,
            )
        return BudgetPolicy(self.default_budget_ms, self.max_budget_ms)

    def describe(self) -> str:
        """One line naming the limits, for a startup log."""
        text = (
            f"threads={self.threads} max_queue={self.max_queue} (capacity {self.capacity}) "
            f"default_budget_ms={self.default_budget_ms:g} max_budget_ms={self.max_budget_ms:g} "
            f"core={IMPLEMENTATION}"
        )
        if self.trust_request_start:
            proxies = "any" if self.trusted_proxies is None else ",".join(self.trusted_proxies)
            text += f" X-Request-Start from {proxies} (cap {self.max_upstream_ms:g} ms)"
        return text


def resolve_settings(
    *,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    trust_request_start: bool | None = None,
    trusted_proxies: Iterable[str] | None = None,
    max_upstream_ms: float | None = None,
    header_timeout_ms: float | None = None,
    environ: Mapping[str, str] | None = None,
    settings: ServerSettings | None = None,
) -> ServerSettings:
    """The settings of an embedding: each argument, else its environment variable, else the default.

    ``settings``, when given, is returned as it is (the embeddings take either
    a complete ``ServerSettings`` or the individual limits, not both).

    Reads ``PRAZO_MAX_QUEUE``, ``PRAZO_DEFAULT_BUDGET_MS``,
    ``PRAZO_MAX_BUDGET_MS``, ``PRAZO_HEADER_TIMEOUT_MS``, ``PRAZO_TRUST_REQUEST_START``,
    ``PRAZO_TRUSTED_PROXIES`` (comma-separated) and ``PRAZO_MAX_UPSTREAM_MS``
    from ``environ`` (default ``os.environ``). A malformed variable raises
    ``ValueError`` naming it. ``max_queue`` defaults to four per thread.

    >>> resolve_settings(threads=2, environ={"PRAZO_MAX_QUEUE": "5"}).capacity
    7
    """
    if settings is not None:
        if not isinstance(settings, ServerSettings):
            raise TypeError(f"settings must be a ServerSettings, not {type(settings).__name__}")
        given = (threads, max_queue, default_budget_ms, max_budget_ms, trust_request_start, trusted_proxies)
        if any(value is not None for value in (*given, max_upstream_ms, header_timeout_ms)):
            raise TypeError("pass either settings or the individual limits, not both")
        return settings
    env = os.environ if environ is None else environ
    threads = DEFAULT_THREADS if threads is None else _whole_number(threads, "threads", 1)
    if max_queue is None:
        max_queue = _env_int(env, ENV_MAX_QUEUE, 0)
    if max_queue is None:
        max_queue = DEFAULT_QUEUE_PER_THREAD * threads
    if default_budget_ms is None:
        default_budget_ms = _env_ms(env, ENV_DEFAULT_BUDGET_MS)
    if max_budget_ms is None:
        max_budget_ms = _env_ms(env, ENV_MAX_BUDGET_MS)
    if trust_request_start is None:
        trust_request_start = _env_bool(env, ENV_TRUST_REQUEST_START)
    if max_upstream_ms is None:
        max_upstream_ms = _env_ms(env, ENV_MAX_UPSTREAM_MS)
    if header_timeout_ms is None:
        header_timeout_ms = _env_ms(env, ENV_HEADER_TIMEOUT_MS)
    proxies: tuple[str, ...] | None
    if trusted_proxies is None:
        proxies = _env_list(env, ENV_TRUSTED_PROXIES)
        trusted_networks(proxies, ENV_TRUSTED_PROXIES)
    elif isinstance(trusted_proxies, (str, bytes)):
        raise TypeError("trusted_proxies must be an iterable of addresses or networks, not a single string")
    else:
        proxies = tuple(trusted_proxies)
    return ServerSettings(
        threads=threads,
        max_queue=max_queue,
        default_budget_ms=DEFAULT_BUDGET_MS if default_budget_ms is None else default_budget_ms,
        max_budget_ms=DEFAULT_MAX_BUDGET_MS if max_budget_ms is None else max_budget_ms,
        trust_request_start=False if trust_request_start is None else trust_request_start,
        max_upstream_ms=DEFAULT_MAX_UPSTREAM_MS if max_upstream_ms is None else max_upstream_ms,
        trusted_proxies=proxies,
        header_timeout_ms=DEFAULT_HEADER_TIMEOUT_MS if header_timeout_ms is None else header_timeout_ms,
    )


# -- tickets and the dispatcher ---------------------------------------------------


class Ticket:
    """One request (or connection) offered to the server's admission queue.

    ``item`` is whatever the server hands its workers (a waitress channel, a
    socket, a gunicorn ``TConn``, a cheroot ``HTTPConnection``). ``deadline``
    was computed at ``arrival_ns``; a *provisional* ticket was admitted before
    its headers could be read (its deadline is ``arrival + max_budget_ms``) and
    gets its real deadline from the parsed request, before the app runs.
    ``release()`` gives the slot back, once, however many times it is called.
    """

    __slots__ = (
        "_app_called",
        "_once",
        "_queue",
        "arrival_ns",
        "claimed",
        "deadline",
        "incoming",
        "item",
        "provisional",
        "started_ns",
    )

    def __init__(
        self,
        item: Any,
        deadline: Deadline,
        arrival_ns: int,
        incoming: IncomingBudget | None = None,
        *,
        provisional: bool = False,
    ) -> None:
        self.item = item
        self.deadline = deadline
        self.arrival_ns = arrival_ns
        self.incoming = incoming
        self.provisional = provisional
        self.started_ns = 0
        # True once the ticket left the line (started, expired, refused); the
        # expiry reaper (shared with AdmissionPool) skips claimed entries.
        self.claimed = False
        self._queue: AdmissionQueue | None = None
        self._once = threading.Lock()
        self._app_called = False

    @property
    def queue_wait_ns(self) -> int:
        """Nanoseconds between arrival and the moment a worker took the ticket."""
        return max(self.started_ns - self.arrival_ns, 0) if self.started_ns else 0

    def _start(self, q: AdmissionQueue) -> None:
        self.claimed = True
        self.started_ns = time.monotonic_ns()
        self._queue = q

    def claim_app_call(self) -> bool:
        """True the first time the app is about to run for this ticket, False after."""
        called, self._app_called = self._app_called, True
        return not called

    def release(self) -> None:
        """Give the slot back to the queue; later calls do nothing."""
        if self._queue is not None and self._once.acquire(blocking=False):
            self._queue.task_done()

    def __repr__(self) -> str:
        kind = " provisional" if self.provisional else ""
        return f"<Ticket{kind} item={self.item!r} {self.deadline!r}>"


class AdmissionDispatcher:
    """Fixed worker threads behind the work-queue face of an ``AdmissionQueue``.

    Effects: ``submit(ticket)`` never blocks. It admits the ticket (a free
    slot is assigned at once, otherwise it waits in line) or refuses it at
    once with ``QueueFull`` (503), ``DeadlineExceeded("expired-on-arrival")``
    (504) or, after ``shutdown``, ``ShutDown`` (503 ``shutting-down``). A
    waiting ticket whose deadline passes is refused with
    ``DeadlineExceeded("expired-in-queue")`` at that deadline, without a
    worker. Every refusal goes to ``reject(ticket, exc)``; every admitted
    ticket goes to ``serve(ticket)`` in one of ``threads`` worker threads,
    after which its slot is released (if ``serve`` did not already).

    >>> served = []
    >>> d = AdmissionDispatcher(1, 0, serve=served.append, reject=lambda t, e: None)
    >>> d.start()
    >>> d.submit(Ticket("job", Deadline.after(5), time.monotonic_ns()))
    True
    >>> d.shutdown(timeout=5)
    True
    >>> [t.item for t in served]
    ['job']
    """

    def __init__(
        self,
        threads: int,
        max_queue: int,
        *,
        serve: Callable[[Ticket], object],
        reject: Callable[[Ticket, BaseException], object],
        name: str = "prazo",
    ) -> None:
        if not callable(serve) or not callable(reject):
            raise TypeError("serve and reject must be callables")
        self._serve = serve
        self._reject_callback = reject
        self._name = name
        self._queue = AdmissionQueue(threads, max_queue, on_expired=self._expired)
        self._reaper_cond = threading.Condition()
        self._reaper = _Reaper(self._queue, self._reaper_cond, f"{name}-expiry")
        self._local = threading.local()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._started = False

    @property
    def threads(self) -> int:
        return self._queue.max_concurrency

    @property
    def max_queue(self) -> int:
        return self._queue.max_queue

    @property
    def queue(self) -> AdmissionQueue:
        """The admission queue (its counters are in ``stats()``)."""
        return self._queue

    @property
    def workers(self) -> tuple[threading.Thread, ...]:
        """The worker threads (empty until ``start``)."""
        return tuple(self._workers)

    def is_worker_thread(self) -> bool:
        """True when called from one of this dispatcher's worker threads."""
        return getattr(self._local, "worker", False)

    def start(self) -> None:
        """Start the worker threads; later calls do nothing."""
        with self._lock:
            if self._started:
                return
            self._started = True
            for number in range(self._queue.max_concurrency):
                worker = threading.Thread(target=self._work, name=f"{self._name}-worker-{number}", daemon=True)
                self._workers.append(worker)
                worker.start()

    def submit(self, ticket: Ticket) -> bool:
        """Admit ``ticket`` (True) or refuse it through ``reject`` (False); never blocks."""
        try:
            self._queue.put(ticket, ticket.deadline)
        except (QueueFull, DeadlineExceeded, ShutDown) as exc:
            self._refuse(ticket, exc)
            return False
        if self._queue.qsize():
            # It may be waiting: make sure it is refused at its own deadline.
            with self._reaper_cond:
                if not ticket.claimed:
                    self._reaper.watch_locked(ticket.deadline.ns, ticket)  # type: ignore[arg-type]
        return True

    def current_ticket(self) -> Ticket | None:
        """The ticket the calling worker thread is serving, or None."""
        ticket: Ticket | None = getattr(self._local, "ticket", None)
        return ticket

    def stats(self) -> dict[str, int]:
        """The admission queue's counters."""
        return self._queue.stats()

    def _expired(self, ticket: Ticket) -> None:
        self._refuse(ticket, DeadlineExceeded(REASON_EXPIRED_IN_QUEUE))

    def _refuse(self, ticket: Ticket, exc: BaseException) -> None:
        ticket.claimed = True
        try:
            self._reject_callback(ticket, exc)
        except Exception:  # noqa: BLE001 - one failed answer must not stop the others
            _log.exception("prazo: refusing %r failed", ticket)

    def _work(self) -> None:
        self._local.worker = True
        while True:
            try:
                ticket: Ticket = self._queue.get()
            except ShutDown:
                return
            ticket._start(self._queue)
            self._local.ticket = ticket
            try:
                self._serve(ticket)
            except BaseException:  # noqa: BLE001 - see below
                # Even SystemExit from an app must not kill a worker: the pool
                # is fixed, and a dead worker would shrink capacity for good.
                _log.exception("prazo: serving %r failed", ticket)
            finally:
                self._local.ticket = None
                ticket.release()
            del ticket

    def shutdown(self, timeout: float | None = None, *, cancel_waiting: bool = False) -> bool:
        """Stop admitting; let every admitted ticket finish; stop the workers.

        New tickets are refused with ``ShutDown`` (503 ``shutting-down``).
        Tickets already admitted — running or waiting — are served, unless
        ``cancel_waiting`` refuses the waiting ones at once. Joins the workers
        for at most ``timeout`` seconds (None: as long as it takes); if they
        are still busy then, the tickets still waiting are refused and False
        is returned (running ones cannot be interrupted and finish in the
        background). True when every admitted ticket was served.
        """
        for ticket in self._queue.shutdown(cancel_waiting=cancel_waiting):
            self._refuse(ticket, ShutDown("the server is shutting down"))
        # Tickets already assigned a slot are served by workers only: start
        # them if nobody did, so they drain the queue and exit.
        self.start()
        others = [worker for worker in self._workers if worker is not threading.current_thread()]
        end = None if timeout is None else time.monotonic() + timeout
        for worker in others:
            worker.join(None if end is None else max(end - time.monotonic(), 0))
        finished = not any(worker.is_alive() for worker in others)
        if not finished:
            for ticket in self._queue.shutdown(cancel_waiting=True):
                self._refuse(ticket, ShutDown("the server is shutting down"))
        self._reaper.stop()
        return finished

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name} {self._queue!r}>"


# -- the app side -------------------------------------------------------------------


class AdmittedApp:
    """The WSGI app as a server embedding calls it: only for admitted requests.

    Effects: looks up the ticket the calling worker thread holds and runs the
    app through ``run_admitted`` with the ticket's deadline, its queue wait
    and its ``release`` — so the app runs in ``deadline_scope`` and sees
    ``prazo.deadline``, ``prazo.queue_wait_ms``, ``prazo.budget_source`` and
    ``prazo.server_stats``, and the slot is released when the response ends.
    A provisional ticket first gets its real deadline from the parsed
    request. If the deadline has passed by the time the app would start, the
    answer is 504 and the app does not run. Calling it outside an admitted request raises ``RuntimeError``.
    """

    def __init__(
        self,
        app: WSGIApp,
        dispatcher: AdmissionDispatcher,
        policy: BudgetPolicy,
        counters: MiddlewareCounters,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI callable, not {type(app).__name__}")
        self.app = app
        self._dispatcher = dispatcher
        self._policy = policy
        self._counters = counters

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        ticket = self._dispatcher.current_ticket()
        if ticket is None or not ticket.claim_app_call():
            raise RuntimeError("prazo: the application was called outside a request admitted by the server's queue")
        deadline, incoming = ticket.deadline, ticket.incoming
        if ticket.provisional:
            deadline, incoming = self._policy.deadline_for(environ, ticket.arrival_ns)
        if incoming is not None:
            environ[BUDGET_SOURCE_KEY] = incoming.source
            if incoming.invalid and ticket.provisional:
                self._counters.add("invalid_budget_header", incoming.invalid)
        environ[SERVER_STATS_KEY] = self._dispatcher.stats
        # Checked again here, not only when the worker took the ticket: the
        # server parsed the request in between, and the app must never start
        # at or after the deadline.
        if deadline.expired():
            reason = REASON_EXPIRED_ON_ARRIVAL if deadline.ns <= ticket.arrival_ns else REASON_EXPIRED_IN_QUEUE
            exc = DeadlineExceeded(reason)
            ticket.release()
            self._counters.count_response(exc)
            return send_rejection(start_response, exc)
        return run_admitted(
            self.app, environ, start_response, deadline, ticket.release, ticket.queue_wait_ns, counters=self._counters
        )


# -- request heads --------------------------------------------------------------------


def find_head(data: bytes) -> bytes | None:
    """The request head (request line and header lines) if ``data`` holds all of it.

    Leading empty lines are skipped, as HTTP/1.1 servers must; the head ends
    at the first empty line (CRLF or bare LF).
    """
    start = 0
    while data.startswith(b"\r\n", start) or data.startswith(b"\n", start):
        start += 2 if data.startswith(b"\r\n", start) else 1
    body = data[start:]
    end = body.find(b"\n\r\n")
    bare = body.find(b"\n\n")
    if end < 0 or (0 <= bare < end):
        end = bare
    if end < 0:
        return None
    return body[: end + 1]


def head_environ(head: bytes, remote_addr: object = None) -> dict[str, str]:
    """CGI-style ``HTTP_*`` keys for the header fields of a request head.

    Only what a ``BudgetPolicy`` reads: malformed lines, obsolete line
    folding and names with an underscore (``is_ambiguous_header_name``) are
    skipped, repeated fields are joined with ``","`` as WSGI servers do, and
    ``REMOTE_ADDR`` is set when given.
    """
    environ: dict[str, str] = {}
    if isinstance(remote_addr, str):
        environ["REMOTE_ADDR"] = remote_addr
    for line in head.split(b"\n")[1:]:
        name, colon, value = line.rstrip(b"\r").partition(b":")
        if not colon or not name or name != name.strip() or b" " in name or b"\t" in name:
            continue
        text_name = name.decode("latin-1")
        if is_ambiguous_header_name(text_name):
            continue
        key = "HTTP_" + text_name.upper().replace("-", "_")
        text = value.decode("latin-1").strip(" \t")
        environ[key] = f"{environ[key]},{text}" if key in environ else text
    return environ


def peekable(sock: socket.socket) -> bool:
    """True when ``peek_bytes`` can see what waits on ``sock`` (not TLS, platform support)."""
    return _CAN_PEEK_WITHOUT_BLOCKING and not isinstance(sock, ssl.SSLSocket)


def peek_bytes(sock: socket.socket, limit: int = MAX_HEAD_BYTES) -> bytes | None:
    """Up to ``limit`` bytes waiting on ``sock``, left in place; never blocks.

    Returns None when nothing has arrived yet or the socket cannot be peeked
    at (see ``peekable``), and ``b""`` when the peer has closed its side.
    """
    if not peekable(sock):
        return None
    timeout = sock.gettimeout()
    try:
        # A socket with a timeout would first wait for data (CPython polls
        # before recv), whatever MSG_DONTWAIT says; peek in non-blocking mode.
        if timeout:
            sock.settimeout(0.0)
        return sock.recv(limit, _MSG_PEEK_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""
    finally:
        if timeout:
            try:
                sock.settimeout(timeout)
            except OSError:
                pass


# -- refusals on the wire ---------------------------------------------------------------


def _response_bytes(status: str, headers: list[tuple[str, str]], body: bytes, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def rejection_bytes(exc: BaseException, *, keep_alive: bool = False) -> bytes:
    """A complete HTTP/1.1 response refusing a request, from ``rejection_response``."""
    return _response_bytes(*rejection_response(exc), keep_alive)


_HEADER_TIMEOUT_BODY = f"408 Request Timeout: {REASON_HEADER_TIMEOUT}\n".encode("ascii")
# Shaped like the 503/504 refusals, so clients and logs read the reason alike.
_HEADER_TIMEOUT_ANSWER = _response_bytes(
    "408 Request Timeout",
    [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(_HEADER_TIMEOUT_BODY))),
        ("Cache-Control", "no-store"),
        (REASON_HEADER, REASON_HEADER_TIMEOUT),
    ],
    _HEADER_TIMEOUT_BODY,
    False,
)


def _send_all(sock: socket.socket, payload: bytes) -> bool:
    try:
        sock.settimeout(_SEND_TIMEOUT_S)
        sock.sendall(payload)
    except OSError:
        return False
    return True


def send_rejection_bytes(sock: socket.socket, exc: BaseException, *, keep_alive: bool = False) -> bool:
    """Write the refusal of ``exc`` on ``sock``; True when it was all sent."""
    return _send_all(sock, rejection_bytes(exc, keep_alive=keep_alive))


def _hard_close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class _Watched:
    """A socket under watch: its deadline and what the watcher keeps about it."""

    __slots__ = ("data", "deadline_ns", "sock")

    def __init__(self, sock: socket.socket, deadline_ns: int, data: Any) -> None:
        self.sock = sock
        self.deadline_ns = deadline_ns
        self.data = data

    def __lt__(self, other: _Watched) -> bool:
        return self.deadline_ns < other.deadline_ns


class SocketWatcher:
    """One background thread waiting for many sockets to become readable, each until a deadline.

    Effects: ``watch(sock, timeout_s, data)`` adds a socket (from any thread;
    the thread starts on first use). When it becomes readable it leaves the
    selector and ``_on_readable(entry)`` runs in the watcher thread; a True
    result puts it back. When its deadline passes first, ``_on_timeout``
    runs (it closes the socket). ``stop()`` closes every socket still
    watched. At most ``max_sockets`` are watched; ``watch`` returns False
    beyond that, or once stopped, and the caller keeps the socket.
    Subclasses define ``_on_readable``.
    """

    def __init__(self, *, name: str, max_sockets: int | None = None) -> None:
        self._name = name
        self._max_sockets = None if max_sockets is None else _whole_number(max_sockets, "max_sockets", 0)
        self._lock = threading.Lock()
        self._incoming: deque[_Watched] = deque()
        self._count = 0
        self._thread: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stopped = False

    @property
    def watching(self) -> int:
        """Sockets currently watched."""
        return self._count

    def watch(self, sock: socket.socket, timeout_s: float, data: Any = None) -> bool:
        """Watch ``sock`` for at most ``timeout_s`` seconds; False when refused (full or stopped)."""
        entry = _Watched(sock, time.monotonic_ns() + int(timeout_s * 1e9), data)
        with self._lock:
            if self._stopped or (self._max_sockets is not None and self._count >= self._max_sockets):
                return False
            self._count += 1
            self._incoming.append(entry)
            if self._thread is None:
                self._wake_r, self._wake_w = socket.socketpair()
                self._wake_r.setblocking(False)
                self._wake_w.setblocking(False)
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake()
        return True

    def _on_readable(self, entry: _Watched) -> bool:
        """``entry.sock`` is readable (and out of the selector); True to keep watching it."""
        raise NotImplementedError

    def _on_timeout(self, entry: _Watched) -> None:
        """``entry``'s deadline passed before it was done."""
        _hard_close(entry.sock)

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"\0")
            except OSError:
                pass  # the buffer is full (a wake-up is pending anyway) or we are stopping

    def _forget(self) -> None:
        with self._lock:
            self._count -= 1

    def _run(self) -> None:
        assert self._wake_r is not None
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        # Heap of entries by deadline; an entry no longer in the selector
        # (handed on, or re-watched) is skipped when it surfaces.
        deadlines: list[_Watched] = []
        try:
            while True:
                with self._lock:
                    stopped = self._stopped
                    arrivals = list(self._incoming)
                    self._incoming.clear()
                for entry in arrivals:
                    self._register(selector, deadlines, entry)
                if stopped:
                    return
                now = time.monotonic_ns()
                while deadlines and deadlines[0].deadline_ns <= now:
                    entry = heapq.heappop(deadlines)
                    if self._unregister(selector, entry):
                        self._call(self._on_timeout, entry)
                timeout = max(deadlines[0].deadline_ns - now, 0) / 1e9 if deadlines else None
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                        continue
                    entry = key.data
                    self._unregister(selector, entry)
                    if self._call(self._on_readable, entry):
                        # Its deadline is still on the heap: back into the selector only.
                        self._register(selector, None, entry)
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not self._wake_r:
                    selector.unregister(key.fileobj)
                    _hard_close(key.data.sock)
                    self._forget()
            selector.close()

    def _register(self, selector: selectors.BaseSelector, deadlines: list[_Watched] | None, entry: _Watched) -> None:
        try:
            selector.register(entry.sock, selectors.EVENT_READ, entry)
        except (OSError, ValueError):
            _hard_close(entry.sock)  # closed meanwhile: nothing left to watch
            self._forget()
            return
        if deadlines is not None:
            heapq.heappush(deadlines, entry)

    def _unregister(self, selector: selectors.BaseSelector, entry: _Watched) -> bool:
        """Take ``entry`` out of the selector; False when it was not (or no longer) there."""
        try:
            key = selector.get_key(entry.sock)
        except (KeyError, ValueError):
            return False
        if key.data is not entry:
            return False
        selector.unregister(entry.sock)
        return True

    def _call(self, handler: Callable[[_Watched], Any], entry: _Watched) -> bool:
        """Run a handler; the entry stops being counted unless it asks to stay."""
        try:
            keep = bool(handler(entry))
        except Exception:  # noqa: BLE001 - the watcher thread serves every other socket too
            _log.exception("prazo: %s failed on %r", self._name, entry.sock)
            _hard_close(entry.sock)
            keep = False
        if not keep:
            self._forget()
        return keep

    def stop(self) -> None:
        """Close every socket still watched and stop the thread."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            leftovers = list(self._incoming)
            self._incoming.clear()
            self._count -= len(leftovers)
        for entry in leftovers:
            _hard_close(entry.sock)
        for wake in (self._wake_r, self._wake_w):
            if wake is not None:
                _hard_close(wake)


class LingeringCloser(SocketWatcher):
    """Closes refused connections politely, from one background thread.

    Effects: ``close(sock)`` shuts the write side at once (the client sees the
    end of the response) and then reads and drops whatever the client still
    sends, until it closes its side, or ``linger_s`` seconds or
    ``max_drain_bytes`` bytes have passed; then the socket is closed. Closing
    with unread bytes would make the kernel send a reset, and a client still
    uploading its body would see ``ECONNRESET`` instead of the 503 it was
    sent. At most ``max_sockets`` linger at once; beyond that (a flood of
    refusals) sockets are closed at once.

    >>> closer = LingeringCloser(linger_s=0.5)
    >>> a, b = socket.socketpair()
    >>> closer.close(a)
    >>> b.recv(1)          # the peer sees the end of the stream
    b''
    >>> b.close(); closer.stop()
    """

    def __init__(
        self,
        *,
        linger_s: float = DEFAULT_LINGER_S,
        max_drain_bytes: int = DEFAULT_MAX_DRAIN_BYTES,
        max_sockets: int = DEFAULT_MAX_LINGERING,
        name: str = "prazo-linger",
    ) -> None:
        if isinstance(linger_s, bool) or not isinstance(linger_s, (int, float)) or not linger_s >= 0:
            raise ValueError(f"linger_s must be a number >= 0, got {linger_s!r}")
        super().__init__(name=name, max_sockets=max_sockets)
        self._linger_s = float(linger_s)
        self._max_drain = _whole_number(max_drain_bytes, "max_drain_bytes", 0)

    @property
    def lingering(self) -> int:
        """Sockets currently being drained."""
        return self.watching

    def close(self, sock: socket.socket) -> None:
        """Shut the write side of ``sock`` now and close it once the client is done."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
        except OSError:
            _hard_close(sock)
            return
        if self._linger_s == 0 or not self.watch(sock, self._linger_s, 0):
            _hard_close(sock)

    def _on_readable(self, entry: _Watched) -> bool:
        try:
            data = entry.sock.recv(_DRAIN_CHUNK)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return True
        except OSError:
            data = b""
        entry.data += len(data)
        if data and entry.data < self._max_drain:
            return True
        _hard_close(entry.sock)
        return False


class ReadinessWatcher(SocketWatcher):
    """Holds new connections, without a thread each, until their first bytes arrive.

    Effects: ``watch(sock, timeout_s, data)``; once ``sock`` is readable,
    ``on_ready(sock, data)`` runs in the watcher thread (it must not block:
    admission does a peek and a queue put). A connection silent for
    ``timeout_s`` is closed.
    """

    def __init__(self, on_ready: Callable[[socket.socket, Any], object], *, name: str = "prazo-readiness") -> None:
        super().__init__(name=name)
        self._on_ready = on_ready

    def _on_readable(self, entry: _Watched) -> bool:
        self._on_ready(entry.sock, entry.data)
        return False


# -- connection-level admission ------------------------------------------------------------


class _PendingHead:
    """A connection whose request head is still arriving, and what admitting it will need."""

    __slots__ = ("arrival_ns", "buffered", "give_up_ns", "item", "look_ns", "next_look_ns", "remote_addr", "sock")

    def __init__(
        self, item: Any, sock: socket.socket, remote_addr: object, buffered: bytes, arrival_ns: int, give_up_ns: int
    ) -> None:
        self.item = item
        self.sock = sock
        self.remote_addr = remote_addr
        self.buffered = buffered
        self.arrival_ns = arrival_ns
        self.give_up_ns = give_up_ns
        self.look_ns = _HEAD_FIRST_LOOK_NS
        self.next_look_ns = arrival_ns

    def __lt__(self, other: _PendingHead) -> bool:
        return self.next_look_ns < other.next_look_ns


class _HeadWatcher:
    """Holds connections whose request head is incomplete, in one thread, until it is complete.

    ``offer(pending)`` looks at the head at once, in the caller's thread; when
    it is incomplete the connection waits here, looked at again on a doubling
    interval (see ``_HEAD_FIRST_LOOK_NS``), until its head is complete, its
    peer closes, or ``pending.give_up_ns`` passes. Each outcome goes to the
    ``ConnectionAdmission``. ``stop()`` drops every connection still waiting;
    ``offer`` returns False once stopped.
    """

    def __init__(self, admission: ConnectionAdmission, name: str) -> None:
        self._admission = admission
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[_PendingHead] = []
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.pending = 0

    def offer(self, pending: _PendingHead) -> bool:
        with self._cond:
            if self._stopped:
                return False
            self.pending += 1
        self._look(pending)
        return True

    def _look(self, pending: _PendingHead) -> None:
        try:
            waiting = self._admission._look_at_head(pending)
        except Exception:  # noqa: BLE001 - the watcher serves every other pending head too
            _log.exception("prazo: %s failed on %r", self._name, pending.sock)
            self._admission._drop(pending)
            waiting = False
        with self._cond:
            if not waiting:
                self.pending -= 1
                return
            now = time.monotonic_ns()
            pending.next_look_ns = min(now + pending.look_ns, pending.give_up_ns)
            pending.look_ns = min(2 * pending.look_ns, _HEAD_MAX_LOOK_NS)
            if self._stopped:
                self.pending -= 1
                stopped = True
            else:
                stopped = False
                heapq.heappush(self._heap, pending)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify()
        if stopped:
            self._admission._drop(pending)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    wait_ns = self._heap[0].next_look_ns - time.monotonic_ns() if self._heap else None
                    if wait_ns is not None and wait_ns <= 0:
                        break
                    self._cond.wait(None if wait_ns is None else wait_ns / 1e9)
                if self._stopped:
                    return
                pending = heapq.heappop(self._heap)
            self._look(pending)

    def stop(self) -> None:
        """Stop watching; every connection still waiting for its head is dropped."""
        with self._cond:
            self._stopped = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cond:
            leftovers, self._heap = self._heap, []
            self.pending -= len(leftovers)
        for pending in leftovers:
            self._admission._drop(pending)


class ConnectionAdmission:
    """Admission of raw connections: the shared core of the socket-level embeddings.

    Effects: ``admit(item, sock, remote_addr)`` stamps the arrival (the first
    bytes of the request have arrived) and waits, without a worker and without
    a place in line, until the request head is complete: it peeks at the head
    without consuming it, and while it is incomplete the connection waits in a
    watcher thread. A head not complete within ``header_timeout_ms`` of the
    arrival is answered 408 (``X-Prazo-Reason: header-timeout``) and closed
    (also when its client has left: a peek cannot see the end of the stream
    behind the bytes it sent); one reset by its peer is closed at once;
    neither was ever offered to the queue. A complete head gives the deadline (``X-Request-Budget-Ms``,
    ``grpc-timeout``, ... and, when trusted, ``X-Request-Start``, counted from
    the arrival) and the connection is offered to the queue. When the head
    cannot be seen (TLS, or larger than ``MAX_HEAD_BYTES``) the ticket is
    provisional and ``AdmittedApp`` finishes the job. A refused connection is
    answered here — 503 or 504 with ``Connection: close`` — and closed through
    the ``LingeringCloser``. ``on_closed(item)`` lets the server drop its own
    bookkeeping for every connection closed here (before the socket is closed
    or handed to the closer). ``serve(ticket)`` runs in the dispatcher's
    workers.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        serve: Callable[[Ticket], object],
        socket_of: Callable[[Any], socket.socket],
        on_closed: Callable[[Any], object] | None = None,
        name: str = "prazo",
        closer: LingeringCloser | None = None,
    ) -> None:
        self.settings = settings
        self.policy = settings.policy()
        self.counters = MiddlewareCounters()
        self.closer = LingeringCloser(name=f"{name}-linger") if closer is None else closer
        self._socket_of = socket_of
        self._on_closed = on_closed
        self._provisional_ns = int(self.policy.max_budget_ms * NS_PER_MS)
        self._header_timeout_ns = int(settings.header_timeout_ms * NS_PER_MS)
        self._heads = _HeadWatcher(self, f"{name}-heads")
        # admit() and the watcher thread both look at heads.
        self._header_timeouts_lock = threading.Lock()
        self._header_timeouts = 0
        self.dispatcher = AdmissionDispatcher(
            settings.threads, settings.max_queue, serve=serve, reject=self._reject, name=name
        )

    def wrap(self, app: WSGIApp) -> AdmittedApp:
        """The app as the server must call it (see ``AdmittedApp``)."""
        return AdmittedApp(app, self.dispatcher, self.policy, self.counters)

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        self.dispatcher.start()

    def admit(self, item: Any, sock: socket.socket, remote_addr: object, *, buffered: bytes = b"") -> None:
        """Offer the connection whose next request is arriving; ``buffered``: its bytes the server already read."""
        arrival_ns = time.monotonic_ns()
        if not peekable(sock):
            self._submit(item, None, arrival_ns, remote_addr)
            return
        pending = _PendingHead(item, sock, remote_addr, buffered, arrival_ns, arrival_ns + self._header_timeout_ns)
        if not self._heads.offer(pending):
            self._answer_and_close(item, sock, rejection_bytes(ShutDown("the server is shutting down")))

    def _look_at_head(self, pending: _PendingHead) -> bool:
        """Admit, answer or drop ``pending`` if its head is complete or will never be; True to keep waiting."""
        data = pending.buffered
        peeked = peek_bytes(pending.sock, MAX_HEAD_BYTES - len(data)) if len(data) < MAX_HEAD_BYTES else None
        data += peeked or b""
        head = find_head(data)
        if head is not None or len(data) >= MAX_HEAD_BYTES:
            self._submit(pending.item, head, pending.arrival_ns, pending.remote_addr)
        elif peeked == b"":
            self._drop(pending)  # reset, or closed after the server read what it sent
        elif time.monotonic_ns() >= pending.give_up_ns:
            with self._header_timeouts_lock:
                self._header_timeouts += 1
            self._answer_and_close(pending.item, pending.sock, _HEADER_TIMEOUT_ANSWER)
        else:
            return True
        return False

    def _submit(self, item: Any, head: bytes | None, arrival_ns: int, remote_addr: object) -> None:
        if head is None:
            ticket = Ticket(item, Deadline.at_ns(arrival_ns + self._provisional_ns), arrival_ns, provisional=True)
        else:
            deadline, incoming = self.policy.deadline_for(head_environ(head, remote_addr), arrival_ns)
            if incoming.invalid:
                self.counters.add("invalid_budget_header", incoming.invalid)
            ticket = Ticket(item, deadline, arrival_ns, incoming)
        self.dispatcher.submit(ticket)

    def _reject(self, ticket: Ticket, exc: BaseException) -> None:
        self.counters.count_response(exc)
        self._answer_and_close(ticket.item, self._socket_of(ticket.item), rejection_bytes(exc))

    def _answer_and_close(self, item: Any, sock: socket.socket, answer: bytes) -> None:
        _send_all(sock, answer)
        if self._on_closed is not None:
            self._on_closed(item)
        self.closer.close(sock)

    def _drop(self, pending: _PendingHead) -> None:
        if self._on_closed is not None:
            self._on_closed(pending.item)
        _hard_close(pending.sock)

    def stats(self) -> dict[str, int]:
        """The queue's counters, the refusals sent and the heads still arriving or timed out."""
        return {
            **self.dispatcher.stats(),
            **self.counters.snapshot(),
            "lingering": self.closer.lingering,
            "pending_heads": self._heads.pending,
            "header_timeouts": self._header_timeouts,
        }

    def close(self, timeout: float | None = None, *, cancel_waiting: bool = False) -> bool:
        """Stop admitting, let the admitted finish (see ``AdmissionDispatcher.shutdown``).

        Connections whose request head has not arrived completely are closed
        at once; a request arriving on a connection after this is answered
        503 ``shutting-down``.
        """
        self._heads.stop()
        finished = self.dispatcher.shutdown(timeout, cancel_waiting=cancel_waiting)
        self.closer.stop()
        return finished
