"""``AdmissionDispatcher``: the server's queue and workers, replaced by prazo's admission queue.

A threaded WSGI server has its own queue between the thread that accepts and
reads requests and the worker threads that run the app. That queue is where a
request really waits, where its true arrival time is known, and where a
request that will be refused has not yet cost a worker anything. Every
embedding in ``prazo.bindings.servers`` puts these in its place:

``Ticket``
    one request (or connection) offered to the queue, released exactly once;
    ``admission_ticket`` makes one from the request's headers (its deadline
    and, with ``critical_paths`` / ``critical_header``, its class).
``AdmissionDispatcher``
    a fixed set of worker threads pulling ``Ticket`` s from the work-queue face
    of ``prazo.core.AdmissionQueue``: ``submit`` admits or refuses at once,
    a ticket whose deadline passes while it waits is refused (504) at its own
    deadline, every ticket the queue's policies drop (503/504 with their
    reason) is refused the same way, and every refusal goes to one callback.
``AdmittedApp``
    wraps the app: it runs the request that the current worker holds through
    ``prazo.bindings.wsgi.run_admitted`` (deadline scope, environ keys, slot
    released exactly once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prazo.core import (
    REASON_EXPIRED_IN_QUEUE,
    REASON_EXPIRED_ON_ARRIVAL,
    AdmissionQueue,
    Deadline,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
)
from prazo.core.shadow import OBSERVE_SETTLE_NS, OBSERVED_STOCK_QUEUE, ShadowLine

from ... import wsgi as _wsgi
from ...headers import BudgetPolicy, IncomingBudget
from ...plumbing.load_report import optional_load_report
from ...plumbing.reaper import DeadlineReaper
from ...policies import CriticalClassifier
from ...wsgi import (
    BUDGET_SOURCE_KEY,
    OUTCOME_ADMITTED,
    OUTCOME_REFUSED,
    MiddlewareCounters,
    StartResponse,
    WSGIApp,
    admission_observer,
    run_admitted,
    send_rejection,
)

__all__ = [
    "SERVER_STATS_KEY",
    "AdmissionDispatcher",
    "AdmittedApp",
    "Ticket",
    "admission_ticket",
]

# One logger for the machinery every embedding shares (dispatcher, watchers,
# connection admission), so a service configures it under one name.
_log = logging.getLogger("prazo.servers")

_get_ident = threading.get_ident

# environ key of a callable returning the server queue's counters, so an app
# (or its metrics endpoint) can read the state of the queue it sits behind.
SERVER_STATS_KEY = "prazo.server_stats"


class Ticket:
    """One request (or connection) offered to the server's admission queue.

    ``item`` is whatever the server hands its workers (a waitress channel, a
    socket, a gunicorn ``TConn``, a cheroot ``HTTPConnection``). ``deadline``
    was computed at ``arrival_ns``; a *provisional* ticket was admitted before
    its headers could be read (its deadline is ``arrival + max_budget_ms``) and
    gets its real deadline from the parsed request, before the app runs.
    A ``critical`` ticket is served first and may use the reserved slots.
    ``environ`` is what the server read of the request before admission (its
    ``HTTP_*`` keys, ``REQUEST_METHOD``, ``PATH_INFO``, the budget's source),
    handed to the admission observer with a refusal; None while unparsed.
    ``release()`` gives the slot back, once, however many times it is called,
    with the time since the worker took it as a service-time sample.
    """

    __slots__ = (
        "_app_called",
        "_once",
        "_queue",
        "arrival_ns",
        "claimed",
        "critical",
        "deadline",
        "environ",
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
        critical: bool = False,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.item = item
        self.environ = environ
        self.critical = critical
        self.deadline = deadline
        self.arrival_ns = arrival_ns
        self.incoming = incoming
        self.provisional = provisional
        self.started_ns = 0
        # True once the ticket left the line (started, expired, refused); the
        # expiry reaper (shared with AdmissionPool) skips claimed entries.
        self.claimed = False
        self._queue: AdmissionQueue | None = None
        # The release guard: one pop() takes it, exactly once (list.pop is
        # atomic with or without the GIL). A one-element list costs a fraction
        # of a threading.Lock and its acquire(), on every request.
        self._once: list[None] = [None]
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

    def release(self, *, sample: bool = True) -> None:
        """Give the slot back to the queue; later calls do nothing.

        ``sample=False`` for a ticket whose app never ran: its near-zero
        "service time" would drag the learned estimate down.
        """
        queue = self._queue
        if queue is None:
            return
        try:
            self._once.pop()
        except IndexError:
            return  # released already
        started_ns = self.started_ns if sample else None
        # critical= only for a critical ticket: a normal one needs only the plain keywords.
        if self.critical:
            queue.task_done(critical=True, started_ns=started_ns)
        else:
            queue.task_done(started_ns=started_ns)

    def __repr__(self) -> str:
        kind = (" provisional" if self.provisional else "") + (" critical" if self.critical else "")
        return f"<Ticket{kind} item={self.item!r} {self.deadline!r}>"


def admission_ticket(
    item: Any,
    environ: dict[str, str],
    arrival_ns: int,
    policy: BudgetPolicy,
    counters: MiddlewareCounters,
    classifier: CriticalClassifier | None,
) -> Ticket:
    """The ticket of a request whose headers (``HTTP_*`` keys, ``PATH_INFO``) are known before admission.

    ``environ`` is the server's own dict for this request: the ticket keeps it
    (``Ticket.environ``), with the budget's source added.

    Its deadline comes from ``policy`` (invalid budget headers are counted in
    ``counters``) and its class from ``classifier`` (None: every request is normal).
    """
    deadline, incoming = policy.deadline_for(environ, arrival_ns)
    if incoming.invalid:
        counters.add("invalid_budget_header", incoming.invalid)
    critical = classifier is not None and classifier(environ)
    if incoming.source is not None:
        # For an observer of a refusal (its span's budget source), as the app's environ would say.
        environ[BUDGET_SOURCE_KEY] = incoming.source
    return Ticket(item, deadline, arrival_ns, incoming, critical=critical, environ=environ)


class AdmissionDispatcher:
    """Fixed worker threads behind the work-queue face of an ``AdmissionQueue``.

    Effects: ``submit(ticket)`` never blocks. It admits the ticket (a free
    slot is assigned at once, otherwise it waits in line) or refuses it at
    once with ``QueueFull`` (503), ``DeadlineExceeded("expired-on-arrival")``
    (504) or, after ``shutdown``, ``ShutDown`` (503 ``shutting-down``). A
    waiting ticket whose deadline passes is refused with
    ``DeadlineExceeded("expired-in-queue")`` at that deadline, without a
    worker. ``queue_options`` are the queue's policies (``AdmissionQueue``'s
    keywords, e.g. ``ServerSettings.queue_options()``); a ticket they drop is
    refused with the queue's error (504 ``insufficient-budget``, 503
    ``shed-standing-queue`` / ``evicted-by-critical``). A ``critical`` ticket
    is offered as such. Every refusal goes to ``reject(ticket, exc)``; every admitted
    ticket goes to ``serve(ticket)`` in one of ``threads`` worker threads,
    after which its slot is released (if ``serve`` did not already).
    ``on_change()``, when given, is called after every change of the queue's
    occupancy (an arrival admitted or refused, a release, an expiry; for a
    refusal, before its answer is sent; not a start, which moves no figure
    of ``stats()`` but ``assigned`` and ``started``), in the thread that made it, so a server can publish the occupancy
    elsewhere (``prazo.bindings.servers.plumbing.occupancy``).

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
        on_change: Callable[[], object] | None = None,
        queue_options: Mapping[str, Any] | None = None,
        observe_only: bool = False,
    ) -> None:
        if not callable(serve) or not callable(reject):
            raise TypeError("serve and reject must be callables")
        if not isinstance(observe_only, bool):
            raise TypeError(f"observe_only must be True or False, not {type(observe_only).__name__}")
        if on_change is not None and not callable(on_change):
            raise TypeError(f"on_change must be a callable or None, not {type(on_change).__name__}")
        self._on_change = on_change
        self._serve = serve
        self._reject_callback = reject
        self._name = name
        # Observe-only: the line that decides is a shadow fed with what really happens, and the
        # tickets run as a stock server runs them: in arrival order, without deadlines or policies.
        self._shadow = (
            ShadowLine(AdmissionQueue, threads, max_queue, settle_ns=OBSERVE_SETTLE_NS, **dict(queue_options or {}))
            if observe_only
            else None
        )
        self._queue = (
            AdmissionQueue(threads, OBSERVED_STOCK_QUEUE, on_dropped=self._dropped)
            if observe_only
            else AdmissionQueue(threads, max_queue, on_dropped=self._dropped, **dict(queue_options or {}))
        )
        self._reaper_cond = threading.Condition()
        self._reaper = DeadlineReaper(self._queue, self._reaper_cond, f"{name}-expiry")
        # The ticket each worker thread serves, by thread id: a dict lookup
        # costs a fraction of a threading.local attribute, on every request.
        self._serving: dict[int, Ticket | None] = {}
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
        """The admission queue (its counters are in ``stats()``; observe-only: the stock line the tickets wait in)."""
        return self._queue

    @property
    def shadow(self) -> ShadowLine | None:
        """Observe-only: the shadow line that decides what the line would have done (None when enforcing)."""
        return self._shadow

    @property
    def observe_only(self) -> bool:
        """True when every ticket is served and the shadow line only counts what it would have refused."""
        return self._shadow is not None

    @property
    def workers(self) -> tuple[threading.Thread, ...]:
        """The worker threads (empty until ``start``)."""
        return tuple(self._workers)

    def is_worker_thread(self) -> bool:
        """True when called from one of this dispatcher's worker threads."""
        return threading.get_ident() in self._serving

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
        if self._shadow is not None:
            return self._submit_observed(ticket, self._shadow)
        try:
            if ticket.critical:
                self._queue.put(ticket, ticket.deadline, critical=True)
            else:
                self._queue.put(ticket, ticket.deadline)
        except (QueueFull, DeadlineExceeded, ShutDown) as exc:
            # Observed before the answer goes out: what the observer reads
            # (e.g. the siblings' room) is the state the refusal was made in.
            self._changed()
            self._refuse(ticket, exc)
            return False
        if self._queue.qsize():
            # It may be waiting: make sure it is refused at its own deadline.
            with self._reaper_cond:
                if not ticket.claimed:
                    self._reaper.watch_locked(ticket.deadline.ns, ticket)
        if self._on_change is not None:
            self._changed()
        return True

    def _submit_observed(self, ticket: Ticket, shadow: ShadowLine) -> bool:
        """Observe-only: the shadow hears of the arrival; the ticket waits its turn in the stock line."""
        shadow.arrive(ticket, ticket.arrival_ns, ticket.deadline.ns, ticket.critical, runs_now=False)
        try:
            self._queue.put(ticket)
        except (QueueFull, ShutDown) as exc:  # shut down, or a stock backlog overflowed
            shadow.finished(ticket, time.monotonic_ns())
            self._changed()
            self._refuse(ticket, exc)
            return False
        if self._on_change is not None:
            self._changed()
        return True

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # noqa: BLE001 - an observer must never cost a request its answer
                _log.exception("prazo: on_change failed")

    def current_ticket(self) -> Ticket | None:
        """The ticket the calling worker thread is serving, or None."""
        return self._serving.get(threading.get_ident())

    def stats(self) -> dict[str, int]:
        """The admission queue's counters (observe-only: the shadow line's, as of now, and ``observe_only``)."""
        if self._shadow is not None:
            self._shadow.catch_up(time.monotonic_ns())
            return {**self._shadow.queue.stats(), "observe_only": 1}
        return self._queue.stats()

    def _dropped(self, ticket: Ticket, exc: BaseException) -> None:
        # The queue let it go (expired, doomed, shed, evicted): its place is free.
        self._changed()
        self._refuse(ticket, exc)

    def _refuse(self, ticket: Ticket, exc: BaseException) -> None:
        ticket.claimed = True
        observer = admission_observer()
        if observer is not None:
            try:
                # ticket.environ: what the server read of the request (None before its head was parsed).
                queue_wait_ns = time.monotonic_ns() - ticket.arrival_ns
                observer(ticket.environ, OUTCOME_REFUSED, ticket.arrival_ns, ticket.deadline.ns, queue_wait_ns, exc)
            except Exception:  # noqa: BLE001 - an observer must never cost a request its answer
                _log.exception("prazo: the admission observer failed")
        try:
            self._reject_callback(ticket, exc)
        except Exception:  # noqa: BLE001 - one failed answer must not stop the others
            _log.exception("prazo: refusing %r failed", ticket)

    def _work(self) -> None:
        me = threading.get_ident()
        serving = self._serving
        serving[me] = None
        # The queue's get() sleeps with the GIL released, and a put() or a
        # release that makes a ticket ready wakes a sleeper only when one is
        # asleep, after the queue's mutex is let go (a worker that gives a
        # slot back takes the next ticket itself, without a wake).
        queue = self._queue
        get = queue.get
        monotonic_ns = time.monotonic_ns
        shadow = self._shadow
        while True:
            try:
                ticket: Ticket = get()
            except ShutDown:
                # A thread id is reused once its thread ends.
                del serving[me]
                return
            # Ticket._start, inlined: it runs on every request.
            ticket.claimed = True
            ticket.started_ns = monotonic_ns()
            ticket._queue = queue
            serving[me] = ticket
            if shadow is not None:
                shadow.started(ticket, ticket.started_ns)
            try:
                self._serve(ticket)
            except BaseException:  # noqa: BLE001 - see below
                # Even SystemExit from an app must not kill a worker: the pool
                # is fixed, and a dead worker would shrink capacity for good.
                _log.exception("prazo: serving %r failed", ticket)
            finally:
                serving[me] = None
                # Its body usually gave the slot back already (the guard is then
                # taken): skip the call that would do nothing.
                if ticket._once:
                    ticket.release()
                if shadow is not None:
                    shadow.finished(ticket, monotonic_ns())
                if self._on_change is not None:
                    self._changed()
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

    ``release_at_close=False`` leaves the slot to the dispatcher's worker,
    which gives it back when ``serve`` returns: for a server whose worker
    still has the request's own bookkeeping to do once the body is closed
    (waitress's worker queues the answer, then pops the request and wakes
    its I/O thread to send it). Given back at the close, the slot lets the
    next request's worker wake and take the GIL inside that tail, while the
    I/O thread turns on an answer it may not send yet.

    ``load_report`` (``"text"``/``"json"``; None: off) adds the ORCA
    ``endpoint-load-metrics`` header, computed from the dispatcher's
    ``stats()``, to every response started here (the app's, and the 504 of a
    deadline that passed before it started); the server's own refusals of a
    full line are written before any app call and carry none.
    """

    def __init__(
        self,
        app: WSGIApp,
        dispatcher: AdmissionDispatcher,
        policy: BudgetPolicy,
        counters: MiddlewareCounters,
        *,
        release_at_close: bool = True,
        load_report: str | None = None,
    ) -> None:
        if not isinstance(release_at_close, bool):
            raise TypeError(f"release_at_close must be a bool, not {type(release_at_close).__name__}")
        self._release_at_close = release_at_close
        if not callable(app):
            raise TypeError(f"app must be a WSGI callable, not {type(app).__name__}")
        self.app = app
        self._dispatcher = dispatcher
        # Observe-only: a request past its deadline still runs (the shadow counted what it would not have).
        self._enforce = not dispatcher.observe_only
        # The dispatcher's ticket of each worker thread (what current_ticket() reads).
        self._serving = dispatcher._serving
        self._stats = dispatcher.stats
        self._policy = policy
        self._counters = counters
        self.load_report = optional_load_report(load_report, dispatcher.stats)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        # dispatcher.current_ticket() and ticket.claim_app_call(), inlined:
        # two Python calls fewer on every request, the same steps.
        ticket = self._serving.get(_get_ident())
        if ticket is None or ticket._app_called:
            raise RuntimeError("prazo: the application was called outside a request admitted by the server's queue")
        ticket._app_called = True
        if self.load_report is not None:
            start_response = self.load_report.start_response(start_response)
        deadline, incoming = ticket.deadline, ticket.incoming
        if ticket.provisional:
            deadline, incoming = self._policy.deadline_for(environ, ticket.arrival_ns)
        if incoming is not None:
            environ[BUDGET_SOURCE_KEY] = incoming.source
            if incoming.invalid and ticket.provisional:
                self._counters.add("invalid_budget_header", incoming.invalid)
        environ[SERVER_STATS_KEY] = self._stats
        # Checked again here, not only when the worker took the ticket: the
        # server parsed the request in between, and the app must never start
        # at or after the deadline.
        if self._enforce and time.monotonic_ns() >= deadline.ns:
            reason = REASON_EXPIRED_ON_ARRIVAL if deadline.ns <= ticket.arrival_ns else REASON_EXPIRED_IN_QUEUE
            exc = DeadlineExceeded(reason)
            ticket.release(sample=False)
            observer = admission_observer()
            if observer is not None:
                observer(environ, OUTCOME_REFUSED, ticket.arrival_ns, deadline.ns, ticket.queue_wait_ns, exc)
            self._counters.count_response(exc)
            return send_rejection(start_response, exc)
        # Ticket.queue_wait_ns, inlined (the worker stamped started_ns before serving).
        started_ns = ticket.started_ns
        # A comparison, not max(): the builtin parses keywords on every call.
        arrival_ns = ticket.arrival_ns
        queue_wait_ns = (started_ns - arrival_ns if started_ns > arrival_ns else 0) if started_ns else 0
        # Not at the close: the dispatcher's worker gives it back once serve() returns.
        release = ticket.release if self._release_at_close else _slot_kept
        compiled = _wsgi._COMPILED_PATH
        if compiled is not None and type(environ) is dict and type(deadline) is Deadline:
            # run_admitted's own compiled branch, called directly: one Python
            # call (with keywords) fewer on every request.
            return compiled.call_admitted(  # type: ignore[no-any-return]
                self.app, environ, start_response, deadline, release, queue_wait_ns, self._counters, 1,
                arrival_ns, OUTCOME_ADMITTED,
            )  # fmt: skip
        return run_admitted(
            self.app,
            environ,
            start_response,
            deadline,
            release,
            queue_wait_ns,
            counters=self._counters,
            arrival_ns=ticket.arrival_ns,
        )


def _slot_kept() -> None:
    """The release ``run_admitted`` calls at the close when the worker gives the slot back itself."""
