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
- once a request is arriving, its head is peeked at (not consumed) until it
  is complete, in prazo's watcher thread (still no worker, no place in line;
  408 ``header-timeout`` when it is not complete ``PRAZO_HEADER_TIMEOUT_MS``
  after its first byte), and then gives the deadline; the connection is
  offered to prazo's admission queue: capacity is exactly ``--threads``
  running plus ``PRAZO_MAX_QUEUE`` waiting;
- full → 503 written by the main loop at once; the deadline passing while it
  waits → 504 at its deadline; the app never runs for either, and the
  connection closes with a lingering close (a client still uploading its
  body reads the answer instead of a reset);
- the app runs in one of ``--threads`` fixed workers, in ``deadline_scope``
  with ``prazo.deadline`` and ``prazo.queue_wait_ms`` in its environ.

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
import selectors
import time
from collections import deque
from concurrent.futures import Future
from functools import partial
from typing import Any

from gunicorn.workers.gthread import DEFAULT_WORKER_DATA_TIMEOUT, TConn, ThreadWorker

from .connection import ConnectionAdmission
from .dispatcher import Ticket
from .settings import ServerSettings, resolve_settings

__all__ = ["AdmissionWorker", "settings_for"]

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

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        super().check_config(cfg, log)
        log.info("prazo admission: %s", settings_for(cfg).describe())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admission = ConnectionAdmission(
            settings_for(self.cfg),
            serve=self._serve_ticket,
            socket_of=_socket_of,
            on_closed=self._closed_by_prazo,
            name="prazo-gunicorn",
        )
        # New connections waiting for their first bytes, oldest first.
        self.fresh_conns: deque[TConn] = deque()

    def get_thread_pool(self) -> Any:
        self.admission.start()
        return _AdmissionPool(self.admission)

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = self.admission.wrap(self.wsgi)

    def accept(self, listener: Any) -> None:
        """Accept a connection and wait in the poller (not in a worker) for its first bytes."""
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

    def _on_fresh_readable(self, conn: TConn, client: Any) -> None:
        self.poller.unregister(client)
        self.fresh_conns.remove(conn)
        conn.data_ready = True
        self.enqueue_req(conn)

    def enqueue_req(self, conn: TConn) -> None:
        """Offer the request arriving on ``conn`` to the admission queue (never blocks)."""
        buffered = conn.parser.unreader.buf.getvalue() if conn.parser is not None else b""
        peer = conn.client[0] if isinstance(conn.client, tuple) else None
        self.admission.admit(conn, conn.sock, peer, buffered=buffered)

    def _serve_ticket(self, ticket: Ticket) -> None:
        conn = ticket.item
        done: Future[Any] = Future()
        try:
            done.set_result(self.handle(conn))
        finally:
            if not done.done():
                done.set_result(False)
            self.method_queue.defer(self.finish_request, conn, done)

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

    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
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
