"""prazo inside gunicorn: a ``gthread`` worker whose thread pool is the admission queue.

::

    PRAZO_MAX_QUEUE=16 PRAZO_DEFAULT_BUDGET_MS=1000 PRAZO_MAX_BUDGET_MS=30000 \\
        gunicorn -k prazo.bindings.servers.gunicorn.AdmissionWorker --threads 4 app:app

gunicorn's ``gthread`` worker accepts connections in its main loop and
submits each to an unbounded ``ThreadPoolExecutor``: under overload requests
pile up there, late, with nothing to refuse them. ``AdmissionWorker`` keeps
gthread's main loop, keep-alive handling and request parsing, and changes
where a connection waits:

- a new connection waits in the main loop's poller for its first bytes, not
  in a worker thread (so a silent client holds no capacity);
- once a request is arriving, its head is read off the socket until it is
  complete (on the main loop, then in prazo's watcher thread for a head that
  arrives in pieces; still no worker, no place in line;
  408 ``header-timeout`` when it is not complete ``PRAZO_HEADER_TIMEOUT_MS``
  after its first byte), and then gives the deadline; what was read goes
  to gunicorn's parser (nothing is read twice), and the connection is
  offered to prazo's admission queue: capacity is exactly ``--threads``
  running plus ``PRAZO_MAX_QUEUE`` waiting;
- full → 503 written by the main loop at once; the deadline passing while it
  waits → 504 at its deadline; the app never runs for either, and the
  connection closes with a lingering close (a client still uploading its
  body reads the answer instead of a reset);
- the app runs in one of ``--threads`` fixed workers, in ``deadline_scope``
  with ``prazo.deadline`` and ``prazo.queue_wait_ms`` in its environ.

Several worker processes (``-w N``). Each worker has its own queue, and
the kernel gives a new connection to whichever worker accepts first, so a
worker could refuse (503 ``queue-full``) while a sibling has free places.
The arbiter creates a shared-memory occupancy table before forking
(``prazo.bindings.servers.plumbing.occupancy``); every worker publishes its running,
waiting and arriving requests in its row. With ``PRAZO_YIELD_WHEN_FULL``
(on by default) a full worker takes its listening sockets out of its poller
while some sibling has room — new connections go to that sibling — and takes
them back as soon as it has room again or every sibling is full, when it
accepts and refuses honestly: a 503 ``queue-full`` then means the host is
full. A request on a kept-alive connection stays with its worker; with
``--reuse-port`` (a listening socket per worker) workers never yield. The table
is in each request's environ as ``prazo.host_occupancy`` (an
``OccupancyTable``: ``snapshot()``, ``totals()``; ``refused_sibling_room``
counts the 503s sent while a sibling had room).

Settings come from the environment (``PRAZO_MAX_QUEUE``,
``PRAZO_DEFAULT_BUDGET_MS``, ``PRAZO_MAX_BUDGET_MS``,
``PRAZO_TRUST_REQUEST_START``, ...); malformed values stop gunicorn at
startup with a message naming the variable. TLS (``--certfile``) and HTTP/2
are refused: terminate them in front of gunicorn.

Shutdown. SIGTERM (graceful): the worker closes its listening sockets at
once (new connections are refused rather than left in the backlog for the
whole drain), and admitted requests — running and queued — finish within
``--graceful-timeout``; what still waits after it is answered 503
``shutting-down``. SIGINT/SIGQUIT (gunicorn's quick shutdown): queued
requests are answered 503 ``shutting-down`` at once and running ones are cut
when the process exits.

Tested with gunicorn 27.0 (the worker relies on gthread internals of the 27
series and refuses to import with an older gthread).
"""

from __future__ import annotations

import errno
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar

from gunicorn import http
from gunicorn.workers.gthread import DEFAULT_WORKER_DATA_TIMEOUT, TConn, ThreadWorker

from .plumbing.connection import ConnectionAdmission
from .plumbing.dispatcher import Ticket
from .plumbing.occupancy import (
    STATE_SERVING,
    STATE_STOPPING,
    STATE_YIELDING,
    OccupancyRow,
    OccupancyTable,
    child_alive,
)
from .settings import ServerSettings, resolve_settings

__all__ = ["HOST_OCCUPANCY_KEY", "AdmissionWorker", "settings_for"]

# environ key of the host's OccupancyTable (every worker's row), for an app or its metrics endpoint.
HOST_OCCUPANCY_KEY = "prazo.host_occupancy"
# Rows for a reload (new workers boot before the old ones leave) and a few TTINs.
_ROWS_PER_WORKER = 4
_MIN_ROWS = 16
# How often a yielding worker looks at its siblings again: a host that has
# just become full waits this long at most for its workers to accept again.
_YIELD_RECHECK_S = 0.01

if not all(hasattr(ThreadWorker, name) for name in ("finish_request", "murder_pending", "_cap_keepalive")):
    raise ImportError(
        "prazo.bindings.servers.gunicorn needs the gthread worker of gunicorn 27 "
        "(ThreadWorker.finish_request, murder_pending, _cap_keepalive); upgrade gunicorn"
    )


def settings_for(cfg: Any) -> ServerSettings:
    """The admission settings of a gunicorn config: ``--threads`` and the ``PRAZO_*`` variables.

    Raises ``RuntimeError`` (which gunicorn prints as a startup error) for a
    malformed variable, TLS or HTTP/2.
    """
    try:
        settings = resolve_settings(threads=cfg.threads)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"prazo: {exc}") from exc
    if cfg.is_ssl:
        raise RuntimeError(
            "prazo: AdmissionWorker does not serve TLS (it reads request heads before gunicorn would "
            "wrap the socket); terminate TLS in a proxy in front of gunicorn"
        )
    if "h2" in getattr(cfg, "http_protocols", ()):
        raise RuntimeError("prazo: AdmissionWorker serves HTTP/1.x only; drop h2 from --http-protocols")
    return settings


def _socket_of(conn: TConn) -> Any:
    return conn.sock


class _AdmissionPool:
    """What gthread keeps as ``self.tpool``: only ``shutdown`` is used; work goes through the queue."""

    def __init__(self, admission: ConnectionAdmission) -> None:
        self._admission = admission

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        # gthread calls shutdown(wait=False) on its way out, after its graceful
        # timeout: nobody will serve what still waits, so it is answered 503.
        self._admission.close(timeout=None if wait else 0, cancel_waiting=cancel_futures or not wait)


class AdmissionWorker(ThreadWorker):
    """gunicorn's ``gthread`` worker with prazo's admission queue in place of its thread pool.

    Use it with ``gunicorn -k prazo.bindings.servers.gunicorn.AdmissionWorker --threads N``;
    see the module docstring for the effects.
    """

    wsgi: Any  # set by gunicorn's load_wsgi(); wrapped by ours
    # Set in the arbiter by check_config, before any fork: every worker inherits the same mapping.
    host_table: ClassVar[OccupancyTable | None] = None
    # Arbiter side: the worker objects owning a row, by age (the arbiter sets each one's pid after the fork).
    row_owners: ClassVar[dict[int, AdmissionWorker]] = {}

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """In the arbiter, before the workers are forked: check the settings, create the occupancy table."""
        super().check_config(cfg, log)
        settings = settings_for(cfg)
        yielding = "off (--reuse-port)" if settings.yield_when_full and cfg.reuse_port else settings.yield_when_full
        log.info("prazo admission: %s yield_when_full=%s", settings.describe(), yielding)
        cls.host_table = OccupancyTable(max(_MIN_ROWS, _ROWS_PER_WORKER * cfg.workers))
        cls.row_owners = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings_for(self.cfg)
        self.admission = ConnectionAdmission(
            self.settings,
            serve=self._serve_ticket,
            socket_of=_socket_of,
            on_closed=self._closed_by_prazo,
            name="prazo-gunicorn",
            on_change=self._queue_changed,
            take_bytes=self._hand_to_parser,
        )
        self._line = self.admission.dispatcher.queue
        # New connections waiting for their first bytes, oldest first.
        self.fresh_conns: deque[TConn] = deque()
        # With --reuse-port each worker has its own listening socket and the
        # kernel keeps hashing connections to it: leaving them there would only
        # make them wait unseen, so such a worker never yields.
        # A stock gunicorn worker never leaves a connection to a sibling: nor does an observing one.
        self._may_yield = (
            self.settings.yield_when_full
            and not self.settings.observe_only
            and not getattr(self.cfg, "reuse_port", False)
        )
        self._yielding = False
        self._seen_offered = 0
        self._seen_refused = 0
        # The row is written by the main loop only: at once while the line is
        # full, else once at the end of a turn that changed it (see _queue_changed).
        self._publish_due = False
        self._loop_thread: int | None = None
        # gunicorn builds the worker in the arbiter, just before forking it:
        # the row is claimed there, so two workers never take the same one.
        self.host_row = self._claim_row()

    def _claim_row(self) -> OccupancyRow | None:
        table = type(self).host_table
        if table is None:  # not started by an arbiter that ran check_config
            return None
        owners = type(self).row_owners
        for age, worker in list(owners.items()):
            # A worker whose pid is not set was never forked (the fork failed).
            if not (isinstance(worker.pid, int) and child_alive(worker.pid)):
                del owners[age]
        row = table.claim(
            self.age,
            threads=self.settings.threads,
            max_queue=self.settings.max_queue,
            live=owners.__contains__,
        )
        if row is None:
            self.log.warning("prazo: the occupancy table is full; this worker neither yields nor is yielded to")
        else:
            owners[self.age] = self
        return row

    def get_thread_pool(self) -> Any:
        # init_process runs in the thread that will run the main loop.
        self._loop_thread = threading.get_ident()
        if self.host_row is not None:
            self.host_row.booted(os.getpid())
        self.admission.start()
        return _AdmissionPool(self.admission)

    def load_wsgi(self) -> None:
        super().load_wsgi()
        app = self.wsgi
        table = type(self).host_table
        if table is not None:
            app = partial(_with_host_occupancy, app, table)
        self.wsgi = self.admission.wrap(app)

    def notify(self) -> None:
        super().notify()
        if self.host_row is not None:
            self.host_row.beat()

    def _occupancy(self) -> tuple[dict[str, int], int]:
        # fresh_conns is the main loop's; reading its length from another thread is safe under the GIL.
        return self.admission.dispatcher.stats(), len(self.fresh_conns) + self.admission.pending_heads

    def _full(self) -> bool:
        stats, arriving = self._occupancy()
        return stats["in_flight"] + stats["queued"] + arriving >= self.settings.capacity

    def _queue_changed(self) -> None:
        """The queue's ``on_change``: have the row published by the main loop.

        Publishing on every change cost about a tenth of a request (three
        changes a request, each reading every counter), so while the worker
        has room, changes are coalesced: one made on the main loop (an arrival
        admitted) is published at the end of that turn (``murder_pending``).
        Once its line is full, each is published at once, as the change
        happens: siblings must see a full worker before they count on it,
        and a refusal is counted (and its siblings' room judged) before its
        answer goes out. A worker thread's change (its slot given back) needs
        nothing: the thread gives its slot back before it defers
        ``finish_request`` to the main loop, whose turn publishes it. Any
        other thread (an expiry, a head completed in the watcher) has the
        main loop publish at its next turn.
        """
        if threading.get_ident() == self._loop_thread:
            if self._line.full():
                self._publish()
            else:
                self._publish_due = True
        elif not self.admission.dispatcher.is_worker_thread():
            self.method_queue.defer(self._publish)

    def _publish(self) -> None:
        """Write this worker's occupancy into its row; count its 503 queue-full, and those a sibling could have served."""
        self._publish_due = False
        row = self.host_row
        if row is None:
            return
        with row.lock:
            # Read inside the lock: the last thread to write has read the freshest figures.
            stats, arriving = self._occupancy()
            row.publish(in_flight=stats["in_flight"], queued=stats["queued"], arriving=arriving)
            offered, self._seen_offered = stats["offered"] - self._seen_offered, stats["offered"]
            refused, self._seen_refused = stats["rejected_full"] - self._seen_refused, stats["rejected_full"]
            if offered:
                row.add("offered", offered)
            if refused:
                row.add("refused_full", refused)
                if row.sibling_has_room():
                    row.add("refused_sibling_room", refused)
            room = stats["in_flight"] + stats["queued"] + arriving < self.settings.capacity
        if room and self._yielding and self.alive:
            # Wake the main loop now rather than at its next look at the siblings.
            self.method_queue.defer(_nothing)

    def _should_yield(self) -> bool:
        # Never every worker at once for long: a yielding row is not "serving",
        # so it never counts as room; if all yield (stale rows), none sees room
        # at its next look, 10 ms later, and all accept again.
        row = self.host_row
        return row is not None and self._may_yield and self.alive and self._full() and row.sibling_has_room()

    def _start_yielding(self) -> None:
        self._yielding = True
        self.set_accept_enabled(False)
        row = self.host_row
        if row is not None:
            with row.lock:
                row.add("yields", 1)

    def _stop_yielding(self) -> None:
        self._yielding = False
        if self.alive:
            self.set_accept_enabled(self.nr_conns < self.worker_connections)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        if self._yielding:
            if self._should_yield():
                timeout = min(timeout, _YIELD_RECHECK_S)
            else:
                self._stop_yielding()
        super().wait_for_and_dispatch_events(timeout)

    def accept(self, listener: Any) -> None:
        """Accept a connection and wait in the poller (not in a worker) for its first bytes.

        A full worker leaves the connection in the backlog for a sibling with room (see the module docstring).
        """
        if self._should_yield():
            self._start_yielding()
            return
        try:
            client_sock, client_addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = TConn(self.cfg, client_sock, client_addr, listener.getsockname())
        # gthread's own patience with a silent new client: the wait in a
        # worker plus the wait in the poller.
        conn.timeout = time.monotonic() + DEFAULT_WORKER_DATA_TIMEOUT + self.cfg.keepalive
        self.fresh_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_fresh_readable, conn))
        # At once (a new connection, not a request): siblings count it as arriving here.
        self._publish()

    def _on_fresh_readable(self, conn: TConn, client: Any) -> None:
        self.poller.unregister(client)
        self.fresh_conns.remove(conn)
        conn.data_ready = True
        self.enqueue_req(conn)

    def _hand_to_parser(self, conn: TConn, data: bytes) -> None:
        """What the admission read of the next request goes to gunicorn's parser, after what it holds already.

        The worker then parses the head from memory instead of reading the
        socket again. The parser is the one ``TConn.init`` would make (TLS and
        HTTP/2, its other cases, are refused at start-up).
        """
        if conn.parser is None:
            conn.parser = http.get_parser(conn.cfg, conn.sock, conn.client)
        held = conn.parser.unreader.buf
        held.seek(0, os.SEEK_END)
        held.write(data)

    def enqueue_req(self, conn: TConn) -> None:
        """Offer the request arriving on ``conn`` to the admission queue (never blocks)."""
        buffered = conn.parser.unreader.buf.getvalue() if conn.parser is not None else b""
        peer = conn.client[0] if isinstance(conn.client, tuple) else None
        if self.admission.admit(conn, conn.sock, peer, buffered=buffered):
            # Its head is still arriving: it counts as arriving now (a head
            # that completes in the watcher thread is published when it is
            # offered to the queue); a complete head changed the queue.
            self._publish_due = True

    def _serve_ticket(self, ticket: Ticket) -> None:
        conn = ticket.item
        keep_alive: Any = False
        try:
            keep_alive = self.handle(conn)
        finally:
            # Before the main loop hears of it: its turn publishes the freed place (see _queue_changed).
            ticket.release()
            self.method_queue.defer(self.finish_request, conn, _Handled(keep_alive))

    def finish_request(self, conn: TConn, fs: Any) -> None:
        super().finish_request(conn, fs)
        self._publish_due = True

    def _closed_by_prazo(self, conn: TConn) -> None:
        # Any thread may refuse or time out a head; the connection count belongs to the main loop.
        self.method_queue.defer(self._forget_connection)

    def _forget_connection(self) -> None:
        self.nr_conns -= 1

    def murder_pending(self) -> None:
        super().murder_pending()
        now = time.monotonic()
        while self.fresh_conns and self.fresh_conns[0].timeout <= now:
            conn = self.fresh_conns.popleft()
            try:
                self.poller.unregister(conn.sock)
            except (OSError, KeyError, ValueError):
                pass
            self.nr_conns -= 1
            conn.close()
            self._publish_due = True
        # The end of a turn of the main loop: publish what it changed.
        if self._publish_due:
            self._publish()

    def set_accept_enabled(self, enabled: bool) -> None:
        # gthread's loop asks to accept again on every turn; a yielding
        # worker stays out until its own look at the siblings says so.
        super().set_accept_enabled(enabled and not self._yielding)
        row = self.host_row
        if row is not None:
            if self._accepting:
                row.set_state(STATE_SERVING)
            else:
                row.set_state(STATE_YIELDING if self.alive else STATE_STOPPING)
        # Stopping: this worker will never accept again. gthread keeps its
        # copy of the listening sockets open until the drain ends, so new
        # connections would wait in the listen backlog for the whole drain
        # and then be reset. Closing it now makes them refused at once when
        # gunicorn is stopping as a whole (the arbiter has closed its copy
        # already); on a reload the new workers still hold theirs. Only on a
        # disabling call, once out of the poller: a signal can end the
        # worker's life between gthread's check of `alive` and a call
        # enabling accepts.
        if not enabled and not self.alive:
            for listener in self.sockets:
                listener.close()

    def _cap_keepalive(self, deadline: float) -> None:
        super()._cap_keepalive(deadline)
        # A stopping worker does not wait long for silent new clients either.
        for conn in self.fresh_conns:
            conn.timeout = min(conn.timeout, deadline)


def _nothing() -> None:
    pass


class _Handled:
    """What gthread's ``finish_request`` reads of a finished request: its ``handle()`` result.

    gthread hands it a ``concurrent.futures.Future``; one costs a condition and
    a lock per request, and nothing here waits on it.
    """

    __slots__ = ("_keep_alive",)

    def __init__(self, keep_alive: Any) -> None:
        self._keep_alive = keep_alive

    def cancelled(self) -> bool:
        return False

    def result(self) -> Any:
        return self._keep_alive


def _with_host_occupancy(
    app: Any, table: OccupancyTable, environ: dict[str, Any], start_response: Any
) -> Iterable[bytes]:
    environ[HOST_OCCUPANCY_KEY] = table
    result: Iterable[bytes] = app(environ, start_response)
    return result
