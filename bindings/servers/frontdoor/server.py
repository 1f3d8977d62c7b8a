"""The one-process front door, ``FrontDoorServer``, and what a host's processes share with it.

``create_server`` (``prazo.bindings.servers.frontdoor``) builds one. Here:
the server's life cycle (its C engine, its worker threads running
``RequestRunner``), and the pieces the host's triage and worker processes
build theirs from: the engine's arguments (``engine_arguments``, the canned
refusals, the policies in the engine's units), the listening socket
(``bound_listener``) and the environ every request shares (``base_environ``).
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prazo.core import (
    DEFAULT_CODEL_INTERVAL_MS,
    DEFAULT_CODEL_TARGET_MS,
    NS_PER_MS,
    REASON_EVICTED,
    REASON_INSUFFICIENT_BUDGET,
    REASON_SHED,
    DeadlineExceeded,
    QueueFull,
    ShutDown,
    codel_option_ns,
    expected_service_option,
)
from prazo.core.shadow import OBSERVED_STOCK_QUEUE

from ...plumbing.load_report import optional_load_report
from ...policies import checked_paths
from ...proxy_headers import trusted_networks
from ...wsgi import DEFAULT_RETRY_AFTER_S, WSGIApp
from ..plumbing.dispatcher import SERVER_STATS_KEY
from ..plumbing.heads import MAX_HEAD_BYTES
from ..plumbing.refusals import (
    BAD_REQUEST_ANSWER,
    DEFAULT_LINGER_S,
    DEFAULT_MAX_DRAIN_BYTES,
    DEFAULT_MAX_LINGERING,
    HEAD_TOO_LARGE_ANSWER,
    HEADER_TIMEOUT_ANSWER,
    REASON_BAD_REQUEST,
    REASON_HEAD_TOO_LARGE,
    REASON_HEADER_TIMEOUT,
    rejection_bytes,
)
from ..settings import ServerSettings, setting
from .observer import EngineObserver
from .runner import RequestRunner

__all__ = [
    "DEFAULT_IO_TIMEOUT_MS",
    "DEFAULT_MAX_IO_WAIT_MS",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_WRITE_GRACE_MS",
    "FrontDoorServer",
    "base_environ",
    "bound_listener",
    "canned_answers",
    "checked_timeout",
    "compiled_engine",
    "engine_arguments",
    "engine_critical_paths",
    "with_policies",
]

# A worker's body read or response write that makes no progress this long fails
# (the client stalled); the worker is then free again.
DEFAULT_IO_TIMEOUT_MS = 30000.0
# A body read never waits past the request's deadline. A response write may wait
# this much longer (from the deadline, or from when the response began if that
# was later): an answer already computed is worth handing to a slow reader for
# a while, not for as long as it keeps reading.
DEFAULT_WRITE_GRACE_MS = 10000.0
# What admitted requests get to finish when a front door stops, unless told otherwise.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# All of one request's waits on its client (body reads and response writes)
# together never exceed this, whatever its budget.
DEFAULT_MAX_IO_WAIT_MS = 60000.0


def canned_answers(retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> dict[str, tuple[bytes, bytes | None]]:
    """The front door's refusals as bytes, ``reason -> (close variant, keep-alive variant or None)``.

    The same statuses, headers and bodies as every embedding's refusals
    (``prazo.bindings.wsgi.rejection_response`` and ``refusals``), with
    ``Retry-After: retry_after_s``; the engine puts the line's measured wait
    in the overload refusals' place when it measures.
    """
    refusals: dict[str, BaseException] = {
        "queue-full": QueueFull(),
        "expired-on-arrival": DeadlineExceeded("expired-on-arrival"),
        "expired-in-queue": DeadlineExceeded("expired-in-queue"),
        "shutting-down": ShutDown(),
        REASON_INSUFFICIENT_BUDGET: DeadlineExceeded(REASON_INSUFFICIENT_BUDGET),
        REASON_SHED: QueueFull(REASON_SHED),
        REASON_EVICTED: QueueFull(REASON_EVICTED),
    }
    answers: dict[str, tuple[bytes, bytes | None]] = {
        reason: (
            rejection_bytes(exc, retry_after_s=retry_after_s),
            rejection_bytes(exc, keep_alive=True, retry_after_s=retry_after_s),
        )
        for reason, exc in refusals.items()
    }
    answers[REASON_HEADER_TIMEOUT] = (HEADER_TIMEOUT_ANSWER, None)
    answers[REASON_BAD_REQUEST] = (BAD_REQUEST_ANSWER, None)
    answers[REASON_HEAD_TOO_LARGE] = (HEAD_TOO_LARGE_ANSWER, None)
    return answers


def engine_critical_paths(value: object) -> list[bytes]:
    """The ``critical_paths`` option as the engine takes it (latin-1 bytes, as PATH_INFO decodes), checked."""
    # The engine compares the raw request target's path: a space, a control
    # character or a query could never match one.
    paths = checked_paths(value, "critical_paths")
    for path in paths:
        if any(ch in path for ch in " \t\r\n\0?"):
            raise ValueError(f"a critical path has no spaces, controls or query, got {path!r}")
    return [path.encode("latin-1") for path in paths]


def _engine_policy_args(settings: ServerSettings) -> dict[str, Any]:
    """The engine's arguments for the settings' queue policies (checked by ``ServerSettings``), in its units.

    The ms values are converted by the core's own helpers, so the front door
    reads them exactly as ``AdmissionQueue`` does.
    """
    adaptive = settings.order == "adaptive"
    fixed_ns, permille = expected_service_option(settings.expected_service_ms)
    header = settings.critical_header
    return {
        "order": settings.order,
        "codel_target_ns": codel_option_ns(
            settings.codel_target_ms, "codel_target_ms", DEFAULT_CODEL_TARGET_MS, adaptive
        ),
        "codel_interval_ns": codel_option_ns(
            settings.codel_interval_ms, "codel_interval_ms", DEFAULT_CODEL_INTERVAL_MS, adaptive
        ),
        "expected_service_ns": fixed_ns,
        "expected_quantile_permille": permille,
        "vegas": settings.limit == "vegas",
        "min_concurrency": settings.min_concurrency,
        "reserved": settings.reserved,
        "critical_header": None if header is None else header.encode("ascii"),
        "critical_paths": engine_critical_paths(settings.critical_paths),
    }


def compiled_engine() -> Any:
    """``prazo.bindings.servers.frontdoor._engine_c``: the engine, and its C budget and head parsers (for tests)."""
    try:
        # By its full name: "from . import" would import this package's __init__, which imports this module.
        import prazo.bindings.servers.frontdoor._engine_c as _engine_c
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise RuntimeError(
            f"the front door needs its compiled engine prazo.bindings.servers.frontdoor._engine_c ({exc}); "
            "rebuild with `make build` (it is not available with PRAZO_NO_EXTENSIONS=1)"
        ) from exc
    return _engine_c


def with_policies(settings: ServerSettings | None, policies: dict[str, Any]) -> ServerSettings | None:
    """``settings`` with the queue-policy arguments given (not None) in place of its own, each checked."""
    given = {name: setting(name).check(value, name) for name, value in policies.items() if value is not None}
    return dataclasses.replace(settings, **given) if settings is not None and given else settings


def checked_timeout(value: object, name: str = "timeout") -> float:
    """Seconds admitted requests get to finish: a number >= 0; ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def bound_listener(host: str, port: int, backlog: int, reuse_port: bool) -> socket.socket:
    """The listening socket of a front door (Linux only: the engine runs on epoll)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the front door runs on Linux only (epoll)")
    if not isinstance(reuse_port, bool):
        raise TypeError(f"reuse_port must be a bool, got {type(reuse_port).__name__}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # reuse_port: several independent front doors may share the port (the
    # kernel spreads connections); each admits on its own, with no view of
    # the others' room - what `--workers N` exists to avoid.
    return socket.create_server((host, port), family=family, backlog=backlog, reuse_port=reuse_port)


def base_environ(
    host: str, port: int, stats: Callable[[], dict[str, Any]], *, multiprocess: bool = False
) -> dict[str, Any]:
    """The environ keys every request of a front door shares; ``stats`` is ``prazo.server_stats``."""
    return {
        "SERVER_NAME": host,
        "SERVER_PORT": str(port),
        "SERVER_SOFTWARE": "prazo-frontdoor",
        "SCRIPT_NAME": "",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": multiprocess,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
        SERVER_STATS_KEY: stats,
    }


def engine_arguments(
    settings: ServerSettings,
    *,
    threads: int,
    io_timeout_ms: float,
    write_grace_ms: float,
    max_io_wait_ms: float,
) -> dict[str, Any]:
    """The engine's keyword arguments (all but the listeners and the role) for ``threads`` places, checked.

    Observe-only: the line is a stock server's backlog, FIFO and
    ``OBSERVED_STOCK_QUEUE`` long, with no policy; the class is still read, for the shadow line.
    """
    engine_module = compiled_engine()
    if settings.observe_only:
        # The stock line has none of the policies; the class is still read, for the shadow.
        settings = dataclasses.replace(
            settings, order="fifo", codel_target_ms=DEFAULT_CODEL_TARGET_MS,
            codel_interval_ms=DEFAULT_CODEL_INTERVAL_MS, expected_service_ms=None, limit="fixed",
            min_concurrency=1, reserved=0,
        )  # fmt: skip
    return {
        "threads": threads,
        "max_queue": OBSERVED_STOCK_QUEUE if settings.observe_only else settings.max_queue,
        "default_budget_ms": settings.default_budget_ms,
        "max_budget_ms": settings.max_budget_ms,
        "header_timeout_ms": settings.header_timeout_ms,
        "io_timeout_ms": io_timeout_ms,
        "write_grace_ms": write_grace_ms,
        "max_io_wait_ms": max_io_wait_ms,
        "linger_ms": DEFAULT_LINGER_S * 1000.0,
        "max_drain_bytes": DEFAULT_MAX_DRAIN_BYTES,
        "max_lingering": DEFAULT_MAX_LINGERING,
        "max_head": MAX_HEAD_BYTES,
        "answers": canned_answers(settings.fixed_retry_after_s()),
        "measured_retry_after": settings.retry_after_s is None,
        # The front-proxy correction is the engine's: it needs the peer and
        # the arrival stamp, both C-side, and must act before the line does.
        "trust_request_start": settings.trust_request_start,
        "max_upstream_ns": int(settings.max_upstream_ms * NS_PER_MS),
        "trusted_networks": engine_module.engine_networks(trusted_networks(settings.trusted_proxies)),
        "observe": settings.observe_only,
        **_engine_policy_args(settings),
    }


class FrontDoorServer:
    """The front door: one C I/O thread for the triage, ``threads`` Python workers for the app.

    Build it with ``create_server``; ``serve_forever()`` runs it until
    ``shutdown()`` (from another thread) or Ctrl-C. ``server_address`` is the
    bound address, ``stats()`` the engine's counters. The queue policies are
    the settings' (``policies`` maps each to its value).
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        host: str,
        port: int,
        settings: ServerSettings,
        backlog: int = 2048,
        io_timeout_ms: float = DEFAULT_IO_TIMEOUT_MS,
        write_grace_ms: float = DEFAULT_WRITE_GRACE_MS,
        max_io_wait_ms: float = DEFAULT_MAX_IO_WAIT_MS,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        reuse_port: bool = False,
    ) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError("the front door runs on Linux only (epoll)")
        self.policies = settings.policies()
        self.app = app
        self.settings = settings
        self.shutdown_timeout = checked_timeout(shutdown_timeout, "shutdown_timeout")
        listener = bound_listener(host, port, backlog, reuse_port)
        self.server_address: tuple[str, int] = listener.getsockname()[:2]
        self._base_environ = base_environ(host, self.server_address[1], self.stats)
        # The engine owns the listening descriptor from here on and closes it itself.
        self._engine = compiled_engine().Engine(
            [listener.detach()],
            **engine_arguments(
                settings, threads=settings.threads, io_timeout_ms=io_timeout_ms,
                write_grace_ms=write_grace_ms, max_io_wait_ms=max_io_wait_ms,
            ),
        )  # fmt: skip
        # Observe-only: what an enforcing line would have decided (None when enforcing).
        self.observer = EngineObserver(self._engine, settings, settings.threads) if settings.observe_only else None
        self._runner = RequestRunner(
            app,
            self._base_environ,
            self._engine.is_draining,
            optional_load_report(settings.load_report, self.stats),
            settings.observe_only,
            self.observer,
        )
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._started = False
        self._shut_down = False
        self._stopped = threading.Event()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> None:
        """Start serving in the background (``serve_forever`` calls this)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._engine.start()
            for index in range(self.settings.threads):
                worker = threading.Thread(
                    target=self._runner.work,
                    args=(self._engine.next_connection,),
                    name=f"prazo-frontdoor-{index}",
                    daemon=True,
                )
                worker.start()
                self._workers.append(worker)

    def serve_forever(self) -> None:
        """Serve until ``shutdown()``; Ctrl-C (``KeyboardInterrupt``) shuts down gracefully."""
        try:
            # Inside the try: a worker serves as soon as it starts, and a
            # KeyboardInterrupt its app raises reaches this thread as a Ctrl-C,
            # possibly before start() has returned.
            self.start()
            while not self._stopped.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.shutdown()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop gracefully: refuse new connections, let admitted requests finish within ``timeout``.

        ``timeout`` defaults to ``shutdown_timeout``. What still waits after it
        is answered 503 ``shutting-down``; returns True when everything admitted
        had finished in time.
        """
        timeout = self.shutdown_timeout if timeout is None else checked_timeout(timeout)
        with self._lock:
            if self._shut_down:
                self._stopped.wait()
                return True
            self._shut_down = True
        end = time.monotonic() + max(timeout, 0.0)
        self._engine.drain()
        idle = bool(self._engine.wait_idle(timeout)) if self._started else True
        self._engine.stop()
        for worker in self._workers:
            worker.join(max(0.0, end - time.monotonic()))
        self._stopped.set()
        return idle

    server_close = shutdown

    @property
    def draining(self) -> bool:
        """True once the server drains (``shutdown()``): it takes nothing new."""
        return bool(self._engine.draining)

    def stats(self) -> dict[str, int]:
        """The engine's counters (``offered``, ``rejected_full``, ``expired_in_queue``, ...) and the workers'.

        Every key of ``AdmissionQueue.stats()`` is there too, so metrics and
        tools read the front door like any admission point: ``cancelled`` is
        ``shutting_down`` (answered 503 by a shutdown, never started).
        Observe-only: the decisions (``offered``, ``rejected_full``, ``expired_*``,
        ``insufficient_budget``, ``shed``, ``evicted``) are the shadow line's, what an
        enforcing front door would have done, and ``observe_only`` is 1.
        """
        stats: dict[str, int] = self._engine.stats()
        if self.observer is not None:
            stats.update(self.observer.decisions(), observe_only=1)
        stats["cancelled"] = stats["shutting_down"]
        stats["expired"] = stats["expired_on_arrival"] + stats["expired_in_queue"]
        stats["reserved"] = self.policies["reserved"]
        stats["max_concurrency"] = self.settings.threads
        stats["max_queue"] = self.settings.max_queue
        stats["expired_at_start"] = self._runner.expired_at_start
        stats["app_errors"] = self._runner.app_errors
        return stats

    # ---------------------------------------------------------------- workers
