"""A worker process of a front-door host: the app, the engine in its worker role, one thread per channel.

Each thread runs ``RequestRunner.work`` on the connections the triage hands
its channel; the process tells the triage its counters and asks it for the
host's figures (``current_host()``), and tells the supervisor on its pipe when
it serves, why it could not start, or that it served its ``max_requests``
(``protocol.py``).
"""

from __future__ import annotations

import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any

from ...plumbing.load_report import optional_load_report
from ..plumbing.app_loader import load_app
from ..plumbing.process_names import name_process
from .protocol import BOOT_ERROR, BOOT_FAILED, MAX_REPORT_BYTES, READY, RETIRE, HostStats, Plan
from .runner import RequestRunner
from .server import base_environ, compiled_engine

__all__ = ["current_host", "worker_main"]

_current: HostStats | None = None


def current_host() -> HostStats | None:
    """In a worker process of a host: the host's figures (``stats()``); None anywhere else."""
    return _current


def _boot_failure(exc: BaseException) -> str:
    """Why a worker could not load its app, as ``prazo serve`` says it in one process.

    ``load_app``'s own errors (cannot import, no such attribute, not callable)
    say everything in one line; when the app's own code raised at import, its
    traceback is where to look.
    """
    if isinstance(exc, (TypeError, ValueError)):
        return str(exc)
    return "".join(traceback.format_exception(exc)).rstrip()


def worker_main(plan: Plan, worker_id: int, ends: list[socket.socket], ready_fd: int, max_requests: int | None) -> int:
    """Worker ``worker_id``: its threads serve what ``ends`` bring; ``max_requests`` is its own limit (jitter added)."""
    global _current
    name_process(f"worker {worker_id}")
    *channel_socks, stats_sock = ends
    host = HostStats(stats_sock, worker_id)
    _current = host  # before the app's import: its module may register current_host() for metrics
    app = plan.app
    if app is None:
        assert plan.app_spec is not None
        try:
            app = load_app(plan.app_spec)
        except BaseException as exc:  # noqa: BLE001 - a SystemExit at import too: it must not look like a crash
            report = _boot_failure(exc).encode("utf-8", "replace")
            os.write(ready_fd, BOOT_ERROR + report[-MAX_REPORT_BYTES:])
            return BOOT_FAILED
    engine = compiled_engine().Engine([], role="worker", **plan.worker_engine)
    # The host's figures (one round trip to the triage, at most once per report interval).
    load_report = optional_load_report(plan.load_report, host.stats)
    runner = RequestRunner(
        app,
        base_environ(plan.host, plan.port, host.stats, multiprocess=True),
        lambda: False,
        load_report,
        observe_only=plan.observed is not None,
    )
    reported = [0, 0]  # expired_at_start, app_errors: the runner's counts the triage was last told
    served = [0]
    lock = threading.Lock()

    def next_from(channel: Any) -> Callable[[], Any]:
        def next_connection() -> Any:
            counts = [runner.expired_at_start, runner.app_errors]
            if counts != reported:  # nearly never: no lock taken on every request for nothing
                with lock:
                    changed = counts != reported
                    reported[:] = counts
                if changed:
                    host.report(expired_at_start=counts[0], app_errors=counts[1])
            conn = channel.next_connection()
            if conn is not None and max_requests is not None:
                with lock:
                    served[0] += 1
                    last = served[0] == max_requests
                if last:
                    try:
                        os.write(ready_fd, RETIRE)  # and serve on: retired once its successor serves
                    except OSError:
                        pass  # the supervisor is gone: the triage drains, and the channels' end ends this worker
            return conn

        return next_connection

    threads = []
    for index, sock in enumerate(channel_socks):
        channel = engine.channel(sock.detach())
        channel.ask()  # before "ready": the triage may hand this thread a connection from now on
        thread = threading.Thread(
            target=runner.work, args=(next_from(channel),), name=f"prazo-host-worker-{worker_id}-{index}", daemon=True
        )
        thread.start()
        threads.append(thread)
    os.write(ready_fd, READY)
    for thread in threads:
        thread.join()
    return 0
