"""How a front-door host's processes start and talk: what the supervisor, the triage and the workers share.

The supervisor (``supervisor.py``) forks the triage (``triage.py``) and the
worker processes (``worker.py``) with a ``Plan``. ``run_child`` is how every
forked child starts and ends: it never returns into the parent's code.
Messages are one JSON object per ``SOCK_SEQPACKET`` datagram, descriptors
passed by ``SCM_RIGHTS`` (``send_message`` / ``receive_message``): the
supervisor's control requests to the triage (``add`` a worker's channels,
``retire``, ``gone`` (a worker exited), ``stats``, ``drain``), and a worker's
questions on its stats socket (``HostStats``). A worker tells the supervisor
on its pipe when it serves (``READY``), why it could not start
(``BOOT_ERROR``) and when it served its ``max_requests`` (``RETIRE``: the
supervisor replaces it as a reload does).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...wsgi import WSGIApp
from ..settings import ServerSettings

__all__ = [
    "BOOT_ERROR",
    "BOOT_FAILED",
    "CONTROL_TIMEOUT_S",
    "MAX_REPORT_BYTES",
    "READY",
    "RETIRE",
    "HostStats",
    "Plan",
    "ask",
    "host_stats_of",
    "receive_message",
    "run_child",
    "send_message",
]

# A worker exits with this when it could not start (its app did not import).
BOOT_FAILED = 3
# What a worker writes on its pipe to the supervisor: READY once it serves, or BOOT_ERROR
# and then why it could not start. The supervisor reports that once for the
# host, rather than every worker printing the same traceback. RETIRE (after READY)
# once it served its max_requests: it serves on until its successor does, since a
# worker that stopped first would leave its places empty for the whole of the
# successor's app import, and every worker reaches the limit at about the same time.
READY = b"r"
BOOT_ERROR = b"e"
RETIRE = b"m"
# Under a pipe's capacity (64 KiB on Linux): the report never waits for the supervisor to read it.
MAX_REPORT_BYTES = 60000
_MESSAGE_BYTES = 1 << 20
# How long a question to the triage may wait for its answer. The triage answers from
# memory in microseconds; one silent this long is wedged, and a caller that waited on it
# for ever would wedge too (the supervisor could then neither replace a worker nor drain).
CONTROL_TIMEOUT_S = 30.0


def send_message(sock: socket.socket, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
    data = json.dumps(message).encode()
    fd_list = list(fds)
    if fd_list:
        socket.send_fds(sock, [data], fd_list)
    else:
        sock.send(data)


def receive_message(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors it carried; (None, []) once the peer is gone."""
    try:
        data, fds, _flags, _address = socket.recv_fds(sock, _MESSAGE_BYTES, 64)
    except (ConnectionError, OSError):
        return None, []
    return _decoded(data, fds)


def _decoded(data: bytes, fds: list[int]) -> tuple[dict[str, Any] | None, list[int]]:
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        for fd in fds:
            os.close(fd)
        return None, []
    return message, fds


def ask(
    sock: socket.socket, message: dict[str, Any], fds: Iterable[int] = (), timeout: float = CONTROL_TIMEOUT_S
) -> tuple[dict[str, Any] | None, list[int]]:
    """Send ``message`` and wait up to ``timeout`` for the reply: (reply, descriptors), (None, []) once the peer is gone.

    ``TimeoutError`` when the peer is there but silent: its reply may still come, so the
    caller must not ask on ``sock`` again (it would read the stale answer).
    """
    sock.settimeout(timeout)
    try:
        send_message(sock, message, fds)
    except TimeoutError:
        raise
    except OSError:
        return None, []
    try:
        data, got, _flags, _address = socket.recv_fds(sock, _MESSAGE_BYTES, 64)
    except TimeoutError:
        raise
    except OSError:
        return None, []
    return _decoded(data, got)


class HostStats:
    """A worker process's view of the host: ``stats()`` asks the triage (one round trip on a socket of its own)."""

    def __init__(self, sock: socket.socket, worker: int) -> None:
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()
        self.worker = worker

    def stats(self) -> dict[str, Any]:
        """The host's counters, as ``FrontDoorHost.stats()``; ``{}`` once the triage is gone (the host is stopping)."""
        with self._lock:
            if self._sock is None:
                return {}
            try:
                reply, _ = ask(self._sock, {"op": "stats"})
            except TimeoutError:
                # A wedged triage (the supervisor kills it): a request that reads the figures
                # is answered without them, and none asks again on a socket a stale reply may reach.
                self._sock.close()
                self._sock = None
                return {}
        return host_stats_of(reply["stats"]) if reply and "stats" in reply else {}

    __call__ = stats

    def report(self, **counts: int) -> None:
        """Tell the triage this worker's own counters (cumulative): the host's stats add them up."""
        with self._lock:
            if self._sock is None:
                return
            try:
                send_message(self._sock, {"op": "count", **counts})
            except OSError:
                pass


def host_stats_of(raw: dict[str, Any]) -> dict[str, Any]:
    stats = dict(raw)
    stats["worker_in_flight"] = {int(worker): n for worker, n in raw.get("worker_in_flight", {}).items()}
    return stats


@dataclass
class Plan:
    """Everything a child process needs, decided in the supervisor before it forks."""

    app: WSGIApp | None
    app_spec: str | None
    host: str
    port: int
    threads: int
    workers: int
    max_requests: int | None
    max_requests_jitter: int
    shutdown_timeout: float
    triage_engine: dict[str, Any]
    worker_engine: dict[str, Any]
    max_concurrency: int
    max_queue: int
    reserved: int
    #: The workers' ``endpoint-load-metrics`` format (``ServerSettings.load_report``), None when off.
    load_report: str | None = None
    #: Observe-only: the settings the triage's shadow line decides by; None when enforcing.
    observed: ServerSettings | None = None


def run_child(main: Callable[[], int], inherited: Iterable[int], keep: Iterable[int]) -> None:
    """Run a forked child's ``main`` and leave with its status, never returning into the parent's code."""
    status = 1
    try:
        for fd in inherited:
            try:
                os.close(fd)
            except OSError:
                pass
        _close_inherited_sockets(set(keep))
        # The supervisor decides: a terminal's Ctrl-C or a group-wide SIGTERM
        # reaching a child directly must not kill it mid-request.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        status = main()
    except BaseException:  # noqa: BLE001 - a child reports and exits; it never unwinds into the parent's stack
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _close_inherited_sockets(keep: set[int]) -> None:
    """Close every socket the fork copied from the supervisor's process but ``keep``.

    A copy of a client or server socket left in a child keeps that connection
    open after its owner closed it (the peer sees no end), and a connection a
    preloaded app opened at import would be shared by every worker, which no
    protocol survives. Files and pipes stay: an app may hold those across a fork.
    """
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3 or fd in keep:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass  # the descriptor of the listing itself, already gone
