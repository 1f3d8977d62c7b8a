"""prazo's own server, the front door: triage in C, without the GIL; only admitted requests reach Python.

Every Python server reads and parses requests in Python, so under a CPU-bound
app its I/O loop waits for the GIL and requests wait in the kernel's listen
backlog, where nothing can refuse or expire them. Here one C thread (started
from the compiled ``_engine_c``, it never takes the GIL) owns the
listening socket and an epoll loop: it accepts, reads each request head under
the header timeout (408 on expiry), stamps its arrival with the kernel's
receive time of its first bytes (``SO_TIMESTAMPNS``; the read time when the
kernel gives none), parses it with the vendored picohttpparser (400 for what
it rejects or what is ambiguous: Content-Length with Transfer-Encoding,
differing Content-Lengths, a Transfer-Encoding other than ``chunked``, line
folding), reads the budget headers with the rules of ``prazo.bindings.headers``
and decides: at most ``threads`` requests run and ``max_queue`` wait; a full
line is answered ``503 queue-full`` at once, an expired deadline ``504
expired-on-arrival``, and a request still waiting at its deadline ``504
expired-in-queue`` at that moment — all written by the C thread::

    from prazo.bindings.servers.frontdoor import create_server

    server = create_server(app, host="0.0.0.0", port=8080, threads=4, max_queue=16)
    server.serve_forever()          # server.shutdown(timeout=5.0) from another thread

``threads`` Python workers wait (GIL released) for the next admitted
connection, run the app inside ``deadline_scope`` with a PEP 3333 environ
(``wsgi.input`` streams Content-Length and chunked bodies; ``prazo.deadline``,
``prazo.queue_wait_ms``, ``prazo.budget_source``, ``prazo.server_stats``),
write the response themselves (chunked when HTTP/1.1 and no Content-Length),
and hand a kept-alive connection back to the C thread, so its next request is
triaged too. Every wait on the client is bounded: a body read by the request's
deadline (``wsgi.input`` raises ``RequestBodyError``; 408 or 400 if the app
lets it out), a response write by the deadline, or the response's start if
later, plus ``write_grace_ms``, all of a request's waits together by
``max_io_wait_ms``, and each by ``io_timeout_ms`` without progress.
Shutdown: the listening socket closes (new connections are refused),
admitted requests — running and waiting — finish within the timeout, a
request arriving on an open connection meanwhile gets ``503 shutting-down``,
and what still waits at the end gets ``503 shutting-down``.
Linux only (epoll); TLS is not supported (terminate it in front). With
``trust_request_start`` the C thread also reads ``X-Request-Start`` /
``X-Queue-Start`` (the formats and rules of ``prazo.bindings.proxy_headers``)
from peers in ``trusted_proxies`` and takes the time the request queued in
that proxy (at most ``max_upstream_ms``) off its deadline as it parses the
head: a budget used up in the proxy is answered ``504 expired-on-arrival``
by the C thread, and the line expires and orders by the corrected deadline.

The queue policies of ``AdmissionQueue`` (docs/design.md) run in the same C
thread and in the workers' pickup, with the same semantics and reasons:
``expected_service_ms`` (a fixed number of ms, or ``"p50"``/``"p90"``/
``"p95"``/``"p99"`` learned from the engine's own service times) answers a
request whose remaining budget is smaller ``504 insufficient-budget``, on
arrival or when it would start; ``order="lifo"`` or ``"adaptive"`` (LIFO while
the line stands, and CoDel sheds stale waiters ``503 shed-standing-queue``);
``limit="vegas"`` moves the concurrency limit between ``min_concurrency`` and
``threads`` (the workers above the limit stay parked); ``reserved`` places
are kept for critical requests (``critical_paths``, or ``critical_header``
saying ``critical``), which are served first and push the newest normal
waiter out (``503 evicted-by-critical``) rather than be refused::

    server = create_server(app, threads=8, order="adaptive", expected_service_ms="p95",
                           limit="vegas", min_concurrency=2, reserved=1, critical_paths=["/healthz"])

``create_server`` returns either shape behind one protocol, ``FrontDoor``:
``FrontDoorServer`` (``server.py``: one process, its worker threads) or, with
``workers=N``, ``FrontDoorHost`` (``supervisor.py``: a triage process and N
worker processes, ``triage.py`` and ``worker.py``, which talk as
``protocol.py`` says). The request runner every worker thread runs is
``runner.py``; the C engine is ``engine/`` behind its Cython face ``_engine_c``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

from ...wsgi import WSGIApp
from ..settings import ServerSettings, resolve_settings
from .protocol import HostStats
from .runner import RequestBodyError
from .server import (
    DEFAULT_IO_TIMEOUT_MS,
    DEFAULT_MAX_IO_WAIT_MS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_WRITE_GRACE_MS,
    FrontDoorServer,
    canned_answers,
    compiled_engine,
    with_policies,
)
from .supervisor import FrontDoorHost, checked_workers
from .worker import current_host

__all__ = [
    "DEFAULT_IO_TIMEOUT_MS",
    "DEFAULT_MAX_IO_WAIT_MS",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_WRITE_GRACE_MS",
    "FrontDoor",
    "FrontDoorHost",
    "FrontDoorServer",
    "HostStats",
    "RequestBodyError",
    "canned_answers",
    "compiled_engine",
    "create_server",
    "current_host",
]


class FrontDoor(Protocol):
    """What ``create_server`` returns, one process or a host: serve, stop, count.

    ``shutdown(timeout=None)`` stops gracefully within ``timeout`` seconds
    (None: the ``shutdown_timeout`` it was built with) and says whether
    everything admitted finished in time.
    """

    settings: ServerSettings
    shutdown_timeout: float

    @property
    def server_address(self) -> Any: ...

    @property
    def port(self) -> int: ...

    def start(self) -> None: ...

    def serve_forever(self) -> None: ...

    def shutdown(self, timeout: float | None = None) -> bool: ...

    @property
    def draining(self) -> bool: ...

    def server_close(self, timeout: float | None = None) -> bool: ...

    def stats(self) -> dict[str, Any]: ...


def create_server(
    app: WSGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    header_timeout_ms: float | None = None,
    settings: ServerSettings | None = None,
    backlog: int = 2048,
    io_timeout_ms: float = DEFAULT_IO_TIMEOUT_MS,
    write_grace_ms: float = DEFAULT_WRITE_GRACE_MS,
    max_io_wait_ms: float = DEFAULT_MAX_IO_WAIT_MS,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    reuse_port: bool = False,
    workers: int = 1,
    max_requests: int | None = None,
    max_requests_jitter: int = 0,
    order: str | None = None,
    codel_target_ms: float | None = None,
    codel_interval_ms: float | None = None,
    expected_service_ms: float | str | None = None,
    limit: str | None = None,
    min_concurrency: int | None = None,
    reserved: int | None = None,
    critical_header: str | None = None,
    critical_paths: Iterable[str] | None = None,
    load_report: str | None = None,
    observe_only: bool | None = None,
) -> FrontDoor:
    """A front door serving ``app`` on ``host:port`` (``port=0``: any free port; see ``server_address``).

    Every limit not given comes from the environment (``PRAZO_MAX_QUEUE``,
    ...) or its default, or all of them from ``settings``; see
    ``prazo.bindings.servers.settings.resolve_settings``. The queue-policy
    options (``order`` ... ``critical_paths``, as ``AdmissionQueue``'s; see
    the module docstring) not given come from ``settings`` when it has them,
    else their defaults (``POLICY_DEFAULTS``). ``reuse_port=True`` sets
    ``SO_REUSEPORT`` so that several front doors can listen on one port; each
    still admits on its own (one host-wide line is what ``prazo serve --workers``
    gives).

    ``workers=N`` (N > 1) returns a ``FrontDoorHost``
    instead: one triage process and N worker processes of ``threads`` threads
    each, one line for the host (``max_queue`` places) and ``N x threads``
    running places; the same ``serve_forever()``/``shutdown()``/``stats()``.
    ``max_requests`` (hosts only) retires a worker after that many requests,
    plus a random number of at most ``max_requests_jitter``.

    ``load_report="text"`` or ``"json"`` adds the ORCA ``endpoint-load-metrics``
    header to the app's responses (``prazo.bindings.plumbing.load_report``; the
    engine's own refusals are written in C and carry none); not given, it
    comes from ``settings``, else ``PRAZO_LOAD_REPORT``, else off.

    ``observe_only=True`` (one process or a host) refuses nothing an enforcing front
    door would: the line serves in arrival order, as a stock server's backlog, and
    ``stats()`` says what the enforcing line would have decided
    (``prazo.bindings.servers.frontdoor.observer``); not given, it comes from
    ``settings``, else ``PRAZO_OBSERVE_ONLY``, else off.
    """
    policies: dict[str, Any] = {
        "order": order, "codel_target_ms": codel_target_ms, "codel_interval_ms": codel_interval_ms,
        "expected_service_ms": expected_service_ms, "limit": limit, "min_concurrency": min_concurrency,
        "reserved": reserved, "critical_header": critical_header,
        "critical_paths": critical_paths,
    }  # fmt: skip
    checked_workers(workers)
    # Policies given beside complete settings win over its fields; without settings they are
    # arguments like the limits (and read from the environment when not given).
    settings = with_policies(settings, policies)
    if settings is not None and load_report is not None:
        settings = dataclasses.replace(settings, load_report=load_report)
    if settings is not None and observe_only is not None:
        settings = dataclasses.replace(settings, observe_only=observe_only)
    settings = resolve_settings(
        threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms,
        header_timeout_ms=header_timeout_ms, settings=settings,
        load_report=None if settings is not None else load_report,
        observe_only=None if settings is not None else observe_only,
        host_workers=None if settings is not None else workers,
        **({} if settings is not None else policies),
    )  # fmt: skip
    if workers != 1 or max_requests is not None or max_requests_jitter != 0:
        if reuse_port:
            raise ValueError("reuse_port is for one front door per process; workers=N shares one port already")
        return FrontDoorHost(
            app, host=host, port=port, settings=settings, workers=workers, backlog=backlog,
            io_timeout_ms=io_timeout_ms, write_grace_ms=write_grace_ms, max_io_wait_ms=max_io_wait_ms,
            shutdown_timeout=shutdown_timeout, max_requests=max_requests,
            max_requests_jitter=max_requests_jitter,
        )  # fmt: skip
    return FrontDoorServer(
        app,
        host=host,
        port=port,
        settings=settings,
        backlog=backlog,
        io_timeout_ms=io_timeout_ms,
        write_grace_ms=write_grace_ms,
        max_io_wait_ms=max_io_wait_ms,
        shutdown_timeout=shutdown_timeout,
        reuse_port=reuse_port,
    )
