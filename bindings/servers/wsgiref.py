"""prazo inside ``socketserver`` servers: fixed workers behind the admission queue.

``socketserver.ThreadingMixIn`` starts a thread per connection, so nothing
ever waits in a queue: overload shows up as thousands of threads all late.
``AdmissionServerMixin`` replaces it. The accept loop hands each new
connection to one watcher thread that waits (without a thread per
connection) for its first bytes; the connection is then offered to prazo's
admission queue — deadline from the request head, 503 at once when
``threads + max_queue`` are taken — and one of ``threads`` fixed workers
serves it. This module applies it to the standard library's
``wsgiref.simple_server``; ``prazo.bindings.servers.werkzeug`` applies it to
werkzeug's server::

    from prazo.bindings.servers.wsgiref import make_server

    server = make_server("127.0.0.1", 8080, app, threads=4, max_queue=16)
    server.serve_forever()          # server.shutdown() from another thread

``wsgiref`` answers one request per connection (HTTP/1.0), so there is no
keep-alive to preserve after a refusal; refusals close politely (lingering
close), so a client still uploading its body reads the 503.
"""

from __future__ import annotations

import socket
import socketserver
import ssl
import threading
from typing import Any
from wsgiref import simple_server
from wsgiref.simple_server import WSGIServer

from ..headers import is_ambiguous_header_name
from ..wsgi import WSGIApp
from .plumbing.connection import ConnectionAdmission
from .plumbing.dispatcher import Ticket
from .plumbing.sockets import ReadinessWatcher
from .settings import ServerSettings, resolve_settings

__all__ = ["AdmissionServerMixin", "AdmissionWSGIRefServer", "WSGIRequestHandler", "make_server"]

# A connection that sends nothing for this long is closed; it never held a
# worker or a place in the queue meanwhile.
DEFAULT_IDLE_TIMEOUT_S = 30.0
# How long shutdown() waits for admitted requests before answering the rest 503.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def _peer(client_address: Any) -> str | None:
    if isinstance(client_address, tuple) and client_address and isinstance(client_address[0], str):
        return client_address[0]
    return None


def _socket_of(item: tuple[socket.socket, Any]) -> socket.socket:
    return item[0]


class WSGIRequestHandler(simple_server.WSGIRequestHandler):
    """wsgiref's handler, dropping header names with an underscore as prazo's other servers do.

    The stock handler maps ``X_Request_Budget_Ms`` onto the same environ key
    as ``X-Request-Budget-Ms`` (see ``prazo.bindings.headers.is_ambiguous_header_name``).
    A ``handler_class`` of your own should derive from this one.
    """

    def get_environ(self) -> dict[str, str]:
        for name in {name for name in self.headers if is_ambiguous_header_name(name)}:
            del self.headers[name]
        return super().get_environ()


class AdmissionServerMixin:
    """Fixed worker threads behind prazo's queue for a ``socketserver.TCPServer``.

    Mix in before the server class and call ``_init_admission(settings, name)``
    before the server's ``__init__``. Effects:

    - ``process_request`` (the accept loop) never blocks and starts no
      thread: the connection waits in a ``ReadinessWatcher`` until its first
      bytes arrive (closed after ``idle_timeout`` seconds of silence), then
      in the ``ConnectionAdmission`` until its request head is complete (408
      after ``header_timeout_ms``), is admitted (503/504 written at once when
      refused, lingering close) and served by ``finish_request`` in a worker;
    - ``shutdown()`` (which also closes the listening socket) and
      ``server_close()`` stop accepting (new connections are refused), close
      the connections that have not delivered a complete request head, and
      let every admitted request finish, waiting at most
      ``shutdown_timeout`` seconds before answering the rest 503
      ``shutting-down``.

    The app must be wrapped with ``self.admission.wrap(app)``.
    """

    admission: ConnectionAdmission
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S

    def _init_admission(self, settings: ServerSettings, name: str) -> None:
        self.admission = ConnectionAdmission(settings, serve=self._serve_ticket, socket_of=_socket_of, name=name)
        self._readiness = ReadinessWatcher(self._connection_ready, name=f"{name}-readiness")
        self._stop_lock = threading.Lock()
        self._admission_stopped = False

    @property
    def settings(self) -> ServerSettings:
        return self.admission.settings

    def stats(self) -> dict[str, int]:
        """The admission queue's counters and the refusals sent."""
        return self.admission.stats()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.admission.start()
        # TLS may hold decrypted bytes the selector cannot see: admit at once.
        if isinstance(request, ssl.SSLSocket) or not self._readiness.watch(request, self.idle_timeout, client_address):
            self._connection_ready(request, client_address)

    def _connection_ready(self, sock: socket.socket, client_address: Any) -> None:
        self.admission.admit((sock, client_address), sock, _peer(client_address))

    def _serve_ticket(self, ticket: Ticket) -> None:
        sock, client_address = ticket.item
        server: Any = self
        try:
            server.finish_request(sock, client_address)
        except Exception:  # noqa: BLE001 - socketserver's own contract: report through handle_error
            server.handle_error(sock, client_address)
        finally:
            server.shutdown_request(sock)

    def _stop_admission(self) -> None:
        # Both shutdown() and the serve_forever() thread's server_close() come
        # here; the second caller waits until the first has drained.
        with self._stop_lock:
            if self._admission_stopped:
                return
            self._admission_stopped = True
            self._readiness.stop()
            self.admission.close(self.shutdown_timeout)

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[misc]
        # Also stop listening: a connection the kernel would still accept
        # now could never be served.
        self.server_close()

    def server_close(self) -> None:
        super().server_close()  # type: ignore[misc]
        self._stop_admission()


class AdmissionWSGIRefServer(AdmissionServerMixin, WSGIServer):
    """``wsgiref.simple_server.WSGIServer`` with fixed workers behind prazo's queue.

    >>> server = make_server("127.0.0.1", 0, lambda e, s: [], threads=2, max_queue=2)
    >>> server.settings.capacity
    4
    >>> server.server_close()
    """

    def __init__(
        self,
        server_address: tuple[str, int],
        RequestHandlerClass: type[socketserver.BaseRequestHandler] = WSGIRequestHandler,
        bind_and_activate: bool = True,
        *,
        settings: ServerSettings,
    ) -> None:
        self._init_admission(settings, "prazo-wsgiref")
        super().__init__(server_address, RequestHandlerClass, bind_and_activate)

    def set_app(self, application: Any) -> None:
        super().set_app(None if application is None else self.admission.wrap(application))


def make_server(
    host: str,
    port: int,
    app: WSGIApp,
    *,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    header_timeout_ms: float | None = None,
    settings: ServerSettings | None = None,
    handler_class: type[WSGIRequestHandler] = WSGIRequestHandler,
) -> AdmissionWSGIRefServer:
    """Like ``wsgiref.simple_server.make_server``, with prazo's admission queue.

    Every limit not given comes from the environment (``PRAZO_MAX_QUEUE``,
    ...) or its default, or all of them from ``settings``; see
    ``prazo.bindings.servers.settings.resolve_settings``.
    """
    settings = resolve_settings(
        threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms,
        header_timeout_ms=header_timeout_ms, settings=settings,
    )  # fmt: skip
    server = AdmissionWSGIRefServer((host, port), handler_class, settings=settings)
    server.set_app(app)
    return server
