"""prazo inside cheroot: a ``ThreadPool`` replacement that refuses instead of blocking.

cheroot hands every readable connection to ``server.requests.put(conn)``. Its
own ``ThreadPool`` either grows without bound or, when bounded, *blocks* the
accepting thread until a worker frees up (then answers a bare 503). Here
``server.requests`` is an ``AdmissionThreadPool``::

    from prazo.bindings.servers.cheroot import create_server

    server = create_server(app, ("127.0.0.1", 8080), threads=4, max_queue=16)
    server.safe_start()             # server.stop() from another thread

Effects:

- a connection that has not sent anything yet goes back to cheroot's
  connection manager until it does (it holds no worker and no place in line);
- a request head still arriving waits in prazo's watcher thread, again
  without a worker or a place in line, and is answered 408
  (``header-timeout``) if it is not complete ``header_timeout_ms`` (5 s)
  after its first byte;
- the complete head is peeked at (not consumed) to compute the deadline;
- ``threads`` requests run at once and ``max_queue`` wait; beyond that the
  answer is an immediate 503 from the accepting thread, never a blocked
  ``put``; a request whose deadline passes while it waits gets 504 at its
  deadline; the app runs for neither;
- the app runs in ``deadline_scope`` with ``prazo.deadline`` and
  ``prazo.queue_wait_ms`` in its environ;
- a refusal closes the connection (its body was not read) with a lingering
  close, so a client still uploading reads the answer; served requests keep
  cheroot's keep-alive;
- ``server.stop()`` closes the listening socket (new connections are
  refused) and the idle kept-alive connections, closes connections whose
  head is still arriving, lets every admitted request finish (within
  cheroot's ``shutdown_timeout``) and answers 503 to whatever still waits
  after it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from cheroot import server as cheroot_server
from cheroot import wsgi as cheroot_wsgi

from ..headers import is_ambiguous_header_name
from ..wsgi import WSGIApp
from .plumbing.connection import ConnectionAdmission
from .plumbing.dispatcher import Ticket
from .plumbing.heads import peek_bytes, peekable
from .settings import ServerSettings, resolve_settings

__all__ = ["AdmissionThreadPool", "create_server"]

_log = logging.getLogger("prazo.cheroot")


def _socket_of(conn: Any) -> Any:
    return conn.socket


def _release_files(conn: Any) -> None:
    # The refusal is written on the socket itself; the connection's buffered
    # files only hold references that would keep the socket from closing.
    for stream in (conn.rfile, conn.wfile):
        try:
            stream.close()
        except OSError:
            pass


class _HeaderReader(cheroot_server.HeaderReader):
    # cheroot's default maps X_Request_Budget_Ms onto the same environ key as
    # X-Request-Budget-Ms; prazo's servers drop such names. (cheroot's own
    # DropUnderscoreHeaderReader raises TypeError on every header in 11.x.)
    def _allow_header(self, key_name: bytes) -> bool:
        if is_ambiguous_header_name(key_name.decode("latin-1")):
            return False
        # The hook every cheroot reader has, absent from cheroot's type stubs.
        return bool(super()._allow_header(key_name))  # type: ignore[misc]


class _DropUnderscoreRequest(cheroot_server.HTTPRequest):
    header_reader = _HeaderReader()


class _Connection(cheroot_server.HTTPConnection):
    RequestHandlerClass = _DropUnderscoreRequest


class AdmissionThreadPool:
    """cheroot's ``server.requests`` interface backed by prazo's admission queue.

    It has what ``cheroot.server.HTTPServer`` uses: ``start()``,
    ``put(conn)`` (never blocks, never raises ``queue.Full``), ``stop(timeout)``,
    and ``qsize`` / ``idle`` / ``min`` / ``max`` for cheroot's statistics.
    The number of threads is fixed.
    """

    def __init__(self, server: Any, settings: ServerSettings) -> None:
        self.server = server
        self.admission = ConnectionAdmission(
            settings,
            serve=self._serve_ticket,
            socket_of=_socket_of,
            on_closed=_release_files,
            name="prazo-cheroot",
        )
        self.min = self.max = settings.threads

    @property
    def _threads(self) -> list[threading.Thread]:
        # cheroot's statistics count the pool's threads through this name.
        return list(self.admission.dispatcher.workers)

    @property
    def qsize(self) -> int:
        """Connections waiting in line."""
        return self.admission.dispatcher.queue.qsize()

    @property
    def idle(self) -> int:
        """Worker slots not holding a connection."""
        stats = self.admission.dispatcher.stats()
        return max(stats["max_concurrency"] - stats["in_flight"], 0)

    def start(self) -> None:
        """Start the worker threads."""
        self.admission.start()

    def put(self, conn: Any) -> None:
        """Offer a readable connection: admitted, refused (answered here) or sent back to wait."""
        sock = conn.socket
        has_data = getattr(conn.rfile, "has_data", None)
        buffered = conn.rfile.peek() if has_data is not None and has_data() else b""
        if peekable(sock) and not buffered:
            peeked = peek_bytes(sock)
            if peeked is None:
                # Accepted but silent: cheroot's connection manager calls put()
                # again once it is readable.
                self.server.put_conn(conn)
                return
            if peeked == b"":
                conn.close()  # the client left without sending anything
                return
        self.admission.admit(conn, sock, conn.remote_addr, buffered=buffered)

    def _serve_ticket(self, ticket: Ticket) -> None:
        conn = ticket.item
        keep_open = False
        try:
            keep_open = conn.communicate()
        except ConnectionError as exc:
            _log.info("prazo: connection error from %s: %s", conn.remote_addr, exc)
        except (KeyboardInterrupt, SystemExit) as exc:
            # cheroot's contract: these from a worker stop the whole server.
            self.server.interrupt = exc
        finally:
            if keep_open:
                self.server.put_conn(conn)
            else:
                conn.close()

    def stop(self, timeout: float | None = 5) -> None:
        """Stop admitting; let admitted requests finish within ``timeout`` seconds; answer the rest 503."""
        if timeout is not None and timeout < 0:
            timeout = None
        self.admission.close(timeout)

    def stats(self) -> dict[str, int]:
        """The admission queue's counters and the refusals sent."""
        return self.admission.stats()


def create_server(
    app: WSGIApp,
    bind_addr: Any = ("127.0.0.1", 8080),
    *,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    header_timeout_ms: float | None = None,
    settings: ServerSettings | None = None,
    **cheroot_options: Any,
) -> Any:
    """A ``cheroot.wsgi.Server`` whose ``requests`` is an ``AdmissionThreadPool``.

    Every limit not given comes from the environment (``PRAZO_MAX_QUEUE``,
    ...) or its default, or all of them from ``settings``; see
    ``prazo.bindings.servers.settings.resolve_settings``. ``cheroot_options`` are
    cheroot's own (``timeout``, ``shutdown_timeout``, ``server_name``, ...),
    except the thread counts. Over TLS the head cannot be peeked at, so
    ``header_timeout_ms`` does not apply (cheroot's ``timeout`` does). After ``prepare()`` (or in ``start()``),
    ``server.bind_addr`` holds the bound address.
    """
    settings = resolve_settings(
        threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms,
        header_timeout_ms=header_timeout_ms, settings=settings,
    )  # fmt: skip
    server = cheroot_wsgi.Server(bind_addr, app, numthreads=settings.threads, max=settings.threads, **cheroot_options)
    pool = AdmissionThreadPool(server, settings)
    server.requests = pool
    server.ConnectionClass = _Connection
    server.wsgi_app = pool.admission.wrap(app)
    return server
