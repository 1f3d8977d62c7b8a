"""What runs in a front-door host's child processes, and how they talk (``prazo.bindings.servers.host``).

``triage_main`` is the triage process: the engine in its triage role, and a
loop on the supervisor's control socket (``add`` a worker's channels,
``retire``, ``gone`` (a worker exited), ``stats``, ``drain``) and on each worker's stats socket.
A worker tells the supervisor on its pipe when it serves (``READY``), why it
could not start (``BOOT_ERROR``) and when it served its ``max_requests``
(``RETIRE``: the supervisor replaces it as a reload does).
``worker_main`` is a worker process: the app, the engine in its worker role
and one thread per channel running ``RequestRunner.work``. Messages are one
JSON object per ``SOCK_SEQPACKET`` datagram, descriptors passed by
``SCM_RIGHTS`` (``send_message`` / ``receive_message``). ``run_child`` is how
every forked child starts and ends: it never returns into the parent's code.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..wsgi import WSGIApp
from .frontdoor import base_environ, compiled_engine
from .frontdoor_worker import RequestRunner
from .process_names import name_process

__all__ = [
    "BOOT_ERROR",
    "BOOT_FAILED",
    "READY",
    "RETIRE",
    "HostStats",
    "Plan",
    "current_host",
    "host_stats_of",
    "receive_message",
    "run_child",
    "send_message",
    "triage_main",
    "worker_main",
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
_MAX_REPORT_BYTES = 60000
_MESSAGE_BYTES = 1 << 20
# While it drains, the triage looks this often for the workers' questions (and each
# question waits at most this long for its answer).
_DRAIN_POLL_S = 0.02

_current: HostStats | None = None


def current_host() -> HostStats | None:
    """In a worker process of a host: the host's figures (``stats()``); None anywhere else."""
    return _current


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


class HostStats:
    """A worker process's view of the host: ``stats()`` asks the triage (one round trip on a socket of its own)."""

    def __init__(self, sock: socket.socket, worker: int) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.worker = worker

    def stats(self) -> dict[str, Any]:
        """The host's counters, as ``FrontDoorHost.stats()``; ``{}`` once the triage is gone (the host is stopping)."""
        with self._lock:
            try:
                send_message(self._sock, {"op": "stats"})
            except OSError:
                return {}
            reply, _ = receive_message(self._sock)
        return host_stats_of(reply["stats"]) if reply and "stats" in reply else {}

    __call__ = stats

    def report(self, **counts: int) -> None:
        """Tell the triage this worker's own counters (cumulative): the host's stats add them up."""
        with self._lock:
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


# ------------------------------------------------------------ the triage process


def triage_main(plan: Plan, listener_fd: int, ctl: socket.socket) -> int:
    name_process("triage")
    engine = compiled_engine().Engine([listener_fd], role="triage", **plan.triage_engine)
    engine.start()
    selector = selectors.DefaultSelector()
    selector.register(ctl, selectors.EVENT_READ, None)
    counts: dict[int, dict[str, int]] = {}

    def host_stats() -> dict[str, Any]:
        stats: dict[str, Any] = engine.stats()
        stats["cancelled"] = stats["shutting_down"]
        stats["expired"] = stats["expired_on_arrival"] + stats["expired_in_queue"]
        stats["reserved"] = plan.reserved
        stats["max_concurrency"] = plan.max_concurrency
        stats["max_queue"] = plan.max_queue
        stats["expired_at_start"] = sum(c.get("expired_at_start", 0) for c in counts.values())
        stats["app_errors"] = sum(c.get("app_errors", 0) for c in counts.values())
        stats["worker_in_flight"] = engine.worker_loads()
        return stats

    def from_worker(sock: socket.socket, worker: int) -> None:
        """One message on a worker's stats socket."""
        message, _ = receive_message(sock)
        if message is None:  # the worker exited; the supervisor tells the engine ("gone")
            selector.unregister(sock)
            sock.close()
            return
        op = message.get("op")
        if op == "stats":
            try:
                send_message(sock, {"stats": host_stats()})
            except OSError:
                pass
        elif op == "count":
            counts[worker] = {k: int(v) for k, v in message.items() if k != "op"}

    def drain(timeout: float) -> bool:
        engine.drain()
        # The workers' questions are answered while they finish: a request admitted before the
        # drain may ask for the host's figures (a metrics scrape), and the drain waits for it.
        end = time.monotonic() + timeout
        while not (idle := bool(engine.wait_idle(min(max(end - time.monotonic(), 0.0), _DRAIN_POLL_S)))):
            if time.monotonic() >= end:
                break
            for key, _ in selector.select(0):
                if key.data is not None:
                    from_worker(key.fileobj, key.data)  # type: ignore[arg-type]
        engine.stop()
        return idle

    failed_adds = [0]

    def add_worker(worker: int, fds: list[int]) -> dict[str, Any]:
        """A new worker's channels and stats socket, or an error when they did not all arrive."""
        expected = plan.threads + 1
        if len(fds) != expected:
            # The kernel drops what a process at its descriptor limit cannot take (slow heads
            # can hold every descriptor until their timeout). A worker with a thread missing
            # would never be whole: what came is closed, and the supervisor tries again later.
            for fd in fds:
                os.close(fd)
            failed_adds[0] += 1
            why = (
                f"the triage (pid {os.getpid()}) did not receive worker {worker}'s descriptors "
                f"({len(fds)} of {expected} arrived; at its descriptor limit?)"
            )
            print(f"prazo host: {why}; {failed_adds[0]} worker start(s) failed so far", file=sys.stderr, flush=True)
            return {"error": why}
        *channels, stats_fd = fds
        for fd in channels:
            engine.add_channel(fd, worker)
        selector.register(socket.socket(fileno=stats_fd), selectors.EVENT_READ, worker)
        return {"ok": True}

    def answer(reply: dict[str, Any]) -> bool:
        try:
            send_message(ctl, reply)
        except OSError:
            return False  # the supervisor is gone
        return True

    while True:
        for key, _ in selector.select():
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if key.data is not None:
                from_worker(sock, key.data)
                continue
            message, fds = receive_message(sock)  # the supervisor
            request: dict[str, Any] = message or {}
            op = request.get("op")
            if op == "add":
                reply: dict[str, Any] = add_worker(int(request["worker"]), fds)
            elif op == "retire":
                engine.retire_worker(int(request["worker"]))
                reply = {"ok": True}
            elif op == "gone":
                engine.worker_gone(int(request["worker"]))
                reply = {"ok": True}
            elif op == "stats":
                reply = {"stats": host_stats()}
            elif op == "drain":
                idle = drain(float(request.get("timeout", plan.shutdown_timeout)))
                answer({"idle": idle})
                return 0
            else:
                reply = {"error": f"unknown op {op!r}"}
            if message is None or not answer(reply):
                # The supervisor died: drain on our own (the workers end when their channels close) and leave.
                drain(plan.shutdown_timeout)
                return 0


# ------------------------------------------------------------ a worker process


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
        from .app_loader import load_app

        assert plan.app_spec is not None
        try:
            app = load_app(plan.app_spec)
        except BaseException as exc:  # noqa: BLE001 - a SystemExit at import too: it must not look like a crash
            report = _boot_failure(exc).encode("utf-8", "replace")
            os.write(ready_fd, BOOT_ERROR + report[-_MAX_REPORT_BYTES:])
            return BOOT_FAILED
    engine = compiled_engine().Engine([], role="worker", **plan.worker_engine)
    runner = RequestRunner(app, base_environ(plan.host, plan.port, host.stats, multiprocess=True), lambda: False)
    reported = {"expired_at_start": 0, "app_errors": 0}
    served = [0]
    lock = threading.Lock()

    def next_from(channel: Any) -> Callable[[], Any]:
        def next_connection() -> Any:
            counts = {"expired_at_start": runner.expired_at_start, "app_errors": runner.app_errors}
            with lock:
                changed = counts != reported
                reported.update(counts)
            if changed:
                host.report(**counts)
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
