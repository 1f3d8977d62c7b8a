"""prazo inside werkzeug's development server: fixed workers behind the admission queue.

``werkzeug.serving.make_server(..., threaded=True)`` starts one thread per
connection and has no queue at all. ``make_server`` here returns a werkzeug
``BaseWSGIServer`` whose accept loop feeds prazo's admission queue and whose
``threads`` fixed workers serve (see ``prazo.bindings.servers.wsgiref.AdmissionServerMixin``)::

    from prazo.bindings.servers.werkzeug import make_server

    server = make_server("127.0.0.1", 8080, app, threads=4, max_queue=16)
    server.serve_forever()          # server.shutdown() from another thread

The deadline starts when the request head has arrived (a connection that has
not sent anything yet waits without a worker); full → 503 written by the
accepting side, expired while waiting → 504 at its deadline, in both cases
without running the app. werkzeug closes every connection after one response
(it does not implement keep-alive), so a refusal closes too — politely, with
a lingering close, so a client still uploading its body reads the 503.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler

from ..wsgi import WSGIApp
from .settings import ServerSettings, resolve_settings
from .wsgiref import AdmissionServerMixin

__all__ = ["AdmissionWSGIServer", "make_server"]


class _NotListening(Exception):
    """Carries the OSError of binding or listening past werkzeug's handler of it (which prints it and exits)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


def _carrying_os_error(step: Callable[[], None]) -> None:
    try:
        step()
    except OSError as exc:
        raise _NotListening(exc) from None


class AdmissionWSGIServer(AdmissionServerMixin, BaseWSGIServer):
    """werkzeug's ``BaseWSGIServer`` with fixed workers behind prazo's queue.

    An address it cannot listen on (a port in use, ...) raises the
    ``OSError``, as ``wsgiref``'s server does, where werkzeug's own prints it
    and calls ``sys.exit(1)``: a library call must not end the process.

    >>> server = make_server("127.0.0.1", 0, lambda e, s: [], threads=2, max_queue=6)
    >>> server.settings.capacity, server.multithread
    (8, True)
    >>> server.server_close()
    """

    multithread = True

    def __init__(
        self,
        host: str,
        port: int,
        app: WSGIApp,
        *,
        settings: ServerSettings,
        handler: type[WSGIRequestHandler] | None = None,
        passthrough_errors: bool = False,
        ssl_context: Any = None,
        fd: int | None = None,
    ) -> None:
        self._init_admission(settings, "prazo-werkzeug")
        try:
            super().__init__(host, port, self.admission.wrap(app), handler, passthrough_errors, ssl_context, fd)
        except _NotListening as failed:
            raise failed.error from None

    def server_bind(self) -> None:
        _carrying_os_error(super().server_bind)

    def server_activate(self) -> None:
        _carrying_os_error(super().server_activate)


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
    request_handler: type[WSGIRequestHandler] | None = None,
    passthrough_errors: bool = False,
    ssl_context: Any = None,
    fd: int | None = None,
) -> AdmissionWSGIServer:
    """Like ``werkzeug.serving.make_server``, with prazo's admission queue instead of a thread per connection.

    Every limit not given comes from the environment (``PRAZO_MAX_QUEUE``,
    ...) or its default, or all of them from ``settings``; see
    ``prazo.bindings.servers.settings.resolve_settings``. The rest are werkzeug's.
    """
    settings = resolve_settings(
        threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms,
        header_timeout_ms=header_timeout_ms, settings=settings,
    )  # fmt: skip
    return AdmissionWSGIServer(
        host,
        port,
        app,
        settings=settings,
        handler=request_handler,
        passthrough_errors=passthrough_errors,
        ssl_context=ssl_context,
        fd=fd,
    )
