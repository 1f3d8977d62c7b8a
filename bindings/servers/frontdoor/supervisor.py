"""The front door on every core: one triage process, N worker processes, one admission decision for the host.

``prazo serve MODULE:APP --server prazo --workers N --threads T`` (or
``create_server(app, workers=N, threads=T)``) runs three kinds of process::

    supervisor   this process: binds the port, starts and replaces the others,
                 turns SIGTERM into a host-wide drain and SIGHUP into a rolling
                 reload; it runs no app and takes no request
    triage       the front door's C engine with no app (accept, head timeout,
                 parse, budget, the line and its policies, every refusal); its
                 I/O thread hands each admitted connection to a free worker
                 thread, descriptor and all, over that thread's channel
    N workers    T threads each, serving what their channels bring (the same
                 ``RequestRunner`` as a one-process front door)

So the host has one line of ``max_queue`` places and ``N x T`` running places:
a request is refused only when every worker thread is busy and the line is
full, it waits in one line whose deadlines, policies and counters are the
host's, and among free threads the triage picks one of the worker process
running the fewest requests (a CPU-bound app spreads over the cores first).
The triage never waits for a GIL: its decisions hold under any app load.

Preload: ``create_server(app, workers=N)`` has the app already (the workers
are forked with it); ``prazo serve`` imports the app in each worker instead
(``--preload`` to import it once, in the supervisor). Not preloading is the
default, as in gunicorn, because an app that starts threads or opens
connections at import (a metrics exporter, a connection pool) would carry
dead ones into every forked worker, and because a reload can then pick up new
code. A worker that dies (SIGKILL, a segfault, ``os._exit``) is replaced at
once; its unfinished requests are counted in ``worker_lost`` and their
connections closed (never left hanging). ``max_requests`` retires a worker
after that many requests, as gunicorn's option does, plus a random number of
at most ``max_requests_jitter`` (so that the workers, which the triage keeps
equally busy, do not all reach it together). A retirement is a reload of one
worker: its successor starts, and only once that one serves does the old one
stop taking connections and finish what it runs; one at a time.

A worker start can fail without the app being at fault: the triage, at its
descriptor limit, may not receive the new worker's channels. That start is
tried again later (with a growing pause), and the host serves on with the
workers it has; a worker being replaced (a reload, ``max_requests``) serves
on until its successor does.

The supervisor talks to the triage over a control socket (JSON messages,
descriptors by ``SCM_RIGHTS``): ``add`` (a worker's channels), ``retire``,
``gone`` (a worker exited), ``stats``, ``drain``. Each worker has a stats
socket to the triage as well, so ``environ["prazo.server_stats"]()`` and
``current_host().stats()`` in a worker are the host's figures, and
``prometheus.register(host=current_host())`` exports the whole host from any
worker in one scrape.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prazo.core.arguments import checked_count

from ...wsgi import WSGIApp
from ..settings import ServerSettings
from .protocol import BOOT_ERROR, CONTROL_TIMEOUT_S, READY, RETIRE, Plan, ask, host_stats_of, run_child
from .server import (
    DEFAULT_IO_TIMEOUT_MS,
    DEFAULT_MAX_IO_WAIT_MS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_WRITE_GRACE_MS,
    bound_listener,
    checked_timeout,
    engine_arguments,
)
from .triage import DUMP_STACKS_SIGNAL, triage_main
from .worker import worker_main

__all__ = ["HOST_LOGGER", "MAX_WORKERS", "FrontDoorHost", "checked_max_requests", "checked_workers"]

# The host's lifecycle (started, replaced, reloaded, drained); `prazo serve` prints it at INFO.
HOST_LOGGER = "prazo.servers.host"
_log = logging.getLogger(HOST_LOGGER)

# A worker that cannot serve within this long of its start (its app import
# hangs, say) is killed and the start counts as failed.
BOOT_TIMEOUT_S = 60.0
# How long a stopped child may take to exit before it is killed.
_EXIT_GRACE_S = 5.0
# How long a wedged triage has to write its threads' stacks before it is killed.
_DUMP_WAIT_S = 0.5
# After a worker start failed (the triage could not take its descriptors), the pause
# before the next try; it doubles on every failure up to the maximum, so a triage
# short of descriptors is not asked every few milliseconds.
_RETRY_FIRST_S = 0.25
_RETRY_MAX_S = 8.0


# The most worker processes one host runs: more on one machine is a typo, not a plan (and the triage's
# worker_loads reports at most 256 live workers, replacements included while they overlap).
MAX_WORKERS = 64


def checked_workers(value: object, name: str = "workers") -> int:
    """A host's worker processes: an int from 1 to ``MAX_WORKERS``; ``TypeError``/``ValueError`` naming ``name``."""
    count = checked_count(value, name, 1)
    if count > MAX_WORKERS:
        raise ValueError(f"{name} must be between 1 and {MAX_WORKERS}, got {count}")
    return count


def checked_max_requests(
    max_requests: object, jitter: object, names: tuple[str, str] = ("max_requests", "max_requests_jitter")
) -> None:
    """A worker's replacement after ``max_requests`` (None: never) plus a random 0..``jitter``; errors name ``names``."""
    requests_name, jitter_name = names
    if max_requests is not None:
        checked_count(max_requests, requests_name, 1)
    checked_count(jitter, jitter_name, 0)
    if jitter and max_requests is None:
        raise ValueError(f"{jitter_name} spreads {requests_name}: give {requests_name} too")


@dataclass
class _Worker:
    slot: int
    id: int
    pid: int
    pidfd: int
    ready_fd: int  # its pipe to the supervisor: READY, BOOT_ERROR, RETIRE
    ready: bool = False
    boot_error: str | None = None  # why it could not start, as it told on its ready pipe
    retiring: bool = False
    served_out: bool = False  # it served its max_requests and waits for its successor
    started: float = field(default_factory=time.monotonic)


class FrontDoorHost:
    """A host of front-door worker processes behind one triage; build it with ``create_server(..., workers=N)``.

    ``serve_forever()`` supervises in the calling thread until SIGTERM/SIGINT
    or ``shutdown()`` (signals are handled when that is the main thread;
    SIGHUP reloads); ``start()`` does the same in a background thread.
    ``stats()`` is the host's (the triage's engine, and the workers' own
    counters added up), ``worker_pids()`` the workers' process ids.
    """

    def __init__(
        self,
        app: WSGIApp | None,
        *,
        app_spec: str | None = None,
        host: str,
        port: int,
        settings: ServerSettings,
        workers: int,
        backlog: int = 2048,
        io_timeout_ms: float = DEFAULT_IO_TIMEOUT_MS,
        write_grace_ms: float = DEFAULT_WRITE_GRACE_MS,
        max_io_wait_ms: float = DEFAULT_MAX_IO_WAIT_MS,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        max_requests: int | None = None,
        max_requests_jitter: int = 0,
    ) -> None:
        checked_workers(workers)
        checked_max_requests(max_requests, max_requests_jitter)
        if (app is None) == (app_spec is None):
            raise TypeError("give the app or its MODULE:APP spec (app_spec), not both")
        self.policies = settings.policies()
        self.settings = settings
        self.workers = workers
        self.shutdown_timeout = checked_timeout(shutdown_timeout, "shutdown_timeout")
        total = workers * settings.threads
        timeouts = {"io_timeout_ms": io_timeout_ms, "write_grace_ms": write_grace_ms, "max_io_wait_ms": max_io_wait_ms}
        # The line's limit is the host's: every worker thread is a place; reserved and
        # min_concurrency are checked against that, as one front door checks them against its threads.
        triage_engine = engine_arguments(settings, threads=total, **timeouts)
        listener = bound_listener(host, port, backlog, False)
        self.server_address: tuple[str, int] = listener.getsockname()[:2]
        self._plan = Plan(
            app=app, app_spec=app_spec, host=host, port=self.server_address[1], threads=settings.threads,
            workers=workers, max_requests=max_requests, max_requests_jitter=max_requests_jitter,
            shutdown_timeout=shutdown_timeout,
            triage_engine=triage_engine, worker_engine=dict(triage_engine), max_concurrency=total,
            max_queue=settings.max_queue, reserved=self.policies["reserved"], load_report=settings.load_report,
            observed=settings if settings.observe_only else None,
        )  # fmt: skip
        self._listener: socket.socket | None = listener
        self._ctl: socket.socket | None = None
        self._ctl_lock = threading.Lock()
        self._triage_pid = 0
        self._triage_pidfd = -1
        self._workers: dict[int, _Worker] = {}  # by pid
        self._next_id = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._commands: collections.deque[bytes] = collections.deque()
        self._state_lock = threading.RLock()
        self._started = False
        self._serving = False  # every first worker served: from then on a start killed early is tried again
        self._stopping = False
        self._stopped = threading.Event()
        self._idle = True
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.replaced = 0  # workers replaced after dying or retiring on max_requests
        self.failed_starts = 0  # worker starts the triage could not take (no descriptor free), tried again later
        # Live workers to replace, one at a time, each serving until its successor does (a reload, max_requests).
        self._replacements: collections.deque[_Worker] = collections.deque()
        self._vacant: set[int] = set()  # slots whose worker died and whose new one could not start yet
        self._retry_at = 0.0  # no worker start before this (monotonic): the last one failed
        self._retry_pause = _RETRY_FIRST_S

    @property
    def port(self) -> int:
        return self.server_address[1]

    # ------------------------------------------------------------ public

    def start(self) -> None:
        """Start the triage and the workers, wait until every worker serves, supervise in a background thread."""
        self._boot()
        self._thread = threading.Thread(target=self._supervise, name="prazo-host-supervisor", daemon=True)
        self._thread.start()

    def serve_forever(self, serving: Callable[[], object] | None = None) -> None:
        """Start, then supervise in this thread until ``shutdown()``, SIGTERM or SIGINT; SIGHUP reloads.

        ``serving()`` is called once every worker takes requests.
        """
        if threading.current_thread() is threading.main_thread():
            # Before the boot: a signal that comes while the workers start waits for the loop.
            for signum, command in ((signal.SIGTERM, b"t"), (signal.SIGINT, b"t"), (signal.SIGHUP, b"h")):
                signal.signal(signum, lambda *_, command=command: self._command(command))
        self._boot()
        if serving is not None:
            serving()
        self._supervise()
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Drain the host: the port closes, everything admitted finishes (up to ``timeout``), the processes exit.

        What still waits after ``timeout`` is answered 503 ``shutting-down``;
        True when everything admitted had finished in time.
        """
        if timeout is not None:
            self.shutdown_timeout = checked_timeout(timeout)
        if not self._started:
            self._close_listener()
            self._stopped.set()
            return True
        self._command(b"t")
        self._stopped.wait()
        return self._idle

    server_close = shutdown

    @property
    def draining(self) -> bool:
        """True once the host drains (SIGTERM, Ctrl-C, ``shutdown()``): it takes nothing new."""
        return self._stopping

    def reload(self) -> None:
        """Replace the workers one at a time (a new one serves before an old one retires): SIGHUP does this."""
        self._command(b"h")

    def stats(self) -> dict[str, Any]:
        """The host's counters: every key of a one-process front door's ``stats()``, plus
        ``worker_lost``, ``worker_processes``, ``worker_threads`` and ``worker_in_flight`` (``{worker id: requests
        running}``)."""
        reply = self._request({"op": "stats"})
        if reply is None or "stats" not in reply:
            raise RuntimeError("the host is not running")
        return host_stats_of(reply["stats"])

    def worker_pids(self) -> list[int]:
        """The process ids of the workers serving now (a retiring one excluded)."""
        with self._state_lock:
            return sorted(w.pid for w in self._workers.values() if not w.retiring)

    @property
    def triage_pid(self) -> int:
        return self._triage_pid

    # ------------------------------------------------------------ the supervisor

    def _command(self, command: bytes) -> None:
        try:
            with self._state_lock:
                if self._wake_w >= 0:  # -1 once the host stopped
                    os.write(self._wake_w, command)
        except OSError:
            pass  # a full pipe already holds a command to wake the loop

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _boot(self) -> None:
        with self._state_lock:
            if self._started:
                raise RuntimeError("the host is already started")
            self._started = True
        ctl_parent, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        assert self._listener is not None
        listener_fd = self._listener.fileno()
        pid = os.fork()
        if pid == 0:  # the triage
            ctl_parent.close()
            run_child(
                lambda: triage_main(self._plan, listener_fd, ctl_child),
                self._supervisor_fds(),
                keep=(listener_fd, ctl_child.fileno()),
            )
        ctl_child.close()
        self._close_listener()  # the triage holds the only copy: a drain closes the port for real
        self._ctl = ctl_parent
        self._triage_pid = pid
        self._triage_pidfd = self._watch(pid, "triage")
        for slot in range(self.workers):
            try:
                self._spawn(slot)
            except RuntimeError as exc:
                self._failure = f"worker {slot} could not start: {exc}"
                break
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        # Every first worker serving: a worker that failed is gone from _workers, so all() alone
        # would take a host whose every worker failed for one that serves.
        while self._failure is not None or not (
            len(self._workers) == self.workers and all(w.ready for w in self._workers.values())
        ):
            if self._failure is not None or time.monotonic() > deadline:
                failure = self._failure or "a worker did not start serving within its boot timeout"
                self._stop_all(0.0)
                self._stopped.set()
                raise RuntimeError(failure)
            self._pump(0.2)
        self._serving = True
        _log.info(
            "prazo host: serving: supervisor pid %d, triage pid %d, %s",
            os.getpid(), self._triage_pid, ", ".join(f"worker {w.id} pid {w.pid}" for w in self._workers.values()),
        )  # fmt: skip

    def _supervisor_fds(self) -> list[int]:
        """What a forked child must not keep of the supervisor's."""
        fds = [self._wake_r, self._wake_w]
        if self._ctl is not None:
            fds.append(self._ctl.fileno())
        if self._triage_pidfd >= 0:
            fds.append(self._triage_pidfd)
        for w in self._workers.values():
            fds.extend(fd for fd in (w.pidfd, w.ready_fd) if fd >= 0)
        return fds

    def _watch(self, pid: int, what: object) -> int:
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # pragma: no cover - Linux < 5.3: exits are found by polling
            return -1
        self._selector.register(pidfd, selectors.EVENT_READ, what)
        return pidfd

    def _spawn(self, slot: int) -> _Worker:
        """A new worker for ``slot``: its channels go to the triage, then it is forked.

        ``RuntimeError`` when the channels could not be made or the triage did not take
        them (it is gone, or it answered an error): nothing is forked then.
        """
        with self._state_lock:
            worker_id = self._next_id
            self._next_id += 1
        pairs: list[tuple[socket.socket, socket.socket]] = []
        try:
            for _ in range(self._plan.threads + 1):
                pairs.append(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            ready_r, ready_w = os.pipe()
        except OSError as exc:  # the supervisor is short of descriptors too: a start that fails alone, the same
            for ends in pairs:
                for end in ends:
                    end.close()
            raise RuntimeError(f"the supervisor cannot open a new worker's channels: {exc}") from exc
        reply = self._request({"op": "add", "worker": worker_id}, [triage_end.fileno() for triage_end, _ in pairs])
        for triage_end, _ in pairs:
            triage_end.close()  # the triage has its own copies now
        if reply is None or "error" in reply:
            for _, worker_end in pairs:
                worker_end.close()
            os.close(ready_r)
            os.close(ready_w)
            raise RuntimeError("the triage is gone" if reply is None else str(reply["error"]))
        worker_ends = [worker_end for _, worker_end in pairs]
        inherited = [*self._supervisor_fds(), ready_r]
        plan = self._plan
        limit = None if plan.max_requests is None else plan.max_requests + random.randint(0, plan.max_requests_jitter)
        pid = os.fork()
        if pid == 0:
            run_child(
                lambda: worker_main(plan, worker_id, worker_ends, ready_w, limit),
                inherited,
                keep=[end.fileno() for end in worker_ends],
            )
        os.close(ready_w)
        for worker_end in worker_ends:
            worker_end.close()
        worker = _Worker(slot=slot, id=worker_id, pid=pid, pidfd=-1, ready_fd=ready_r)
        with self._state_lock:
            self._workers[pid] = worker
        worker.pidfd = self._watch(pid, worker)
        self._selector.register(ready_r, selectors.EVENT_READ, ("ready", worker))
        return worker

    def _request(self, message: dict[str, Any], fds: Iterable[int] = (), extra_s: float = 0.0) -> dict[str, Any] | None:
        """One request to the triage and its reply; None when the triage is gone.

        A triage silent for ``CONTROL_TIMEOUT_S`` (plus ``extra_s``, what the request itself
        may take) is wedged: it is killed (the host cannot serve without it, and stops as
        when it dies), and the request answers None.
        """
        timeout = CONTROL_TIMEOUT_S + extra_s
        with self._ctl_lock:
            if self._ctl is None:
                return None
            try:
                reply, extra = ask(self._ctl, message, fds, timeout)
            except TimeoutError:
                _log.error(
                    "prazo host: the triage (pid %d) did not answer %r within %g s; killing it",
                    self._triage_pid, message.get("op"), timeout,
                )  # fmt: skip
                self._ctl.close()  # its late answer must not reach the next question
                self._ctl = None
                if self._triage_pid:  # never 0: kill(0) would signal the whole process group
                    _dump_stacks_then_kill(self._triage_pid)
                return None
            for fd in extra:
                os.close(fd)
            return reply

    def _pump(self, timeout: float) -> None:
        """Handle what happened (exits, readiness) within ``timeout``; commands wait in ``_commands``."""
        for key, _ in self._selector.select(timeout):
            what = key.data
            if what == "wake":
                try:
                    data = os.read(self._wake_r, 64)
                except BlockingIOError:
                    data = b""
                self._commands.extend(data[i : i + 1] for i in range(len(data)))
            elif what == "triage":
                self._reap_triage()
            elif isinstance(what, tuple):
                # Its exit, earlier in this batch, read and closed the pipe already: the event is stale.
                if what[1].ready_fd >= 0:
                    self._on_pipe(what[1])
            elif what.pidfd >= 0:  # not forgotten already (its pipe's end came first in this batch)
                self._on_exit(what)
        self._poll_exits()

    def _poll_exits(self) -> None:
        """Without pidfds (old kernels): find exited children by waitpid."""
        if self._triage_pidfd >= 0:
            return
        with self._state_lock:
            workers = [w for w in self._workers.values() if w.pidfd < 0]
        for worker in workers:
            if os.waitpid(worker.pid, os.WNOHANG)[0]:
                self._forget(worker, reaped=True)
        if self._triage_pid and os.waitpid(self._triage_pid, os.WNOHANG)[0]:
            self._triage_pid = 0
            self._triage_gone()

    def _on_pipe(self, worker: _Worker) -> None:
        """What ``worker`` wrote on its pipe (one byte each: READY, RETIRE, BOOT_ERROR and its report), or its end."""
        try:
            data = os.read(worker.ready_fd, 1)
            if data == BOOT_ERROR:
                # The report follows, written at once; the worker's exit closes the pipe after it.
                with contextlib.suppress(BlockingIOError):
                    while chunk := os.read(worker.ready_fd, 65536):
                        data += chunk
        except OSError:
            data = b""
        if data == READY:
            worker.ready = True
            self._retry_pause = _RETRY_FIRST_S  # a start went through: the triage has descriptors again
            return
        if data == RETIRE:
            worker.served_out = True
            if not worker.retiring and all(queued is not worker for queued in self._replacements):
                self._replacements.append(worker)
            return
        self._selector.unregister(worker.ready_fd)
        os.close(worker.ready_fd)
        worker.ready_fd = -1
        if data.startswith(BOOT_ERROR):
            worker.boot_error = data[len(BOOT_ERROR) :].decode("utf-8", "replace")

    def _forget(self, worker: _Worker, *, reaped: bool = False) -> int:
        """Reap an exited worker and drop its watches; its exit status."""
        status = 0
        if not reaped:
            try:
                _, status = os.waitpid(worker.pid, 0)
            except ChildProcessError:
                status = 0
        for fd in (worker.pidfd, worker.ready_fd):
            if fd >= 0:
                self._selector.unregister(fd)
                os.close(fd)
        worker.pidfd = worker.ready_fd = -1
        with self._state_lock:
            self._workers.pop(worker.pid, None)
        # The triage cannot count on its channels' end-of-file: a process the app forked
        # (multiprocessing's fork start method) holds copies of them and of the running
        # connections. Without this, the dead worker's threads would go on counting as free.
        self._request({"op": "gone", "worker": worker.id})
        return os.waitstatus_to_exitcode(status) if status else 0

    def _on_exit(self, worker: _Worker) -> None:
        if worker.ready_fd >= 0:
            # What it wrote before exiting (its boot error) may not have been read yet. A process
            # the app forked may hold the pipe's other end: read what is there, never wait for its end.
            os.set_blocking(worker.ready_fd, False)
        while worker.ready_fd >= 0:
            self._on_pipe(worker)
        was_ready = worker.ready
        code = self._forget(worker)
        if self._stopping or worker.retiring or self._failure is not None:
            return  # a reload retired it (its successor serves already), or the host is going down
        if not was_ready and worker.boot_error is None and self._serving:
            # Gone before it served without a word of its app's import (killed by a signal: the
            # OOM killer, an operator's kill -9, a soak's): the app its siblings run imports. The
            # host serves on; a reload's successor leaves its predecessor serving, a replacement
            # is tried again after a pause (which grows, should something end every start).
            why = f"worker {worker.id} (pid {worker.pid}) ended (status {code}) before it served"
            if self._slot_taken(worker.slot):
                _log.warning("prazo host: %s; the worker it was to replace serves on", why)
            else:
                self._vacant.add(worker.slot)
                self._start_failed(worker.slot, RuntimeError(why))
            return
        if not was_ready:
            # A worker that never served would be replaced by one failing the same way, forever
            # (an app that calls sys.exit() or crashes the interpreter at import): the host stops.
            if worker.boot_error is not None:
                self._failure = f"worker {worker.id} failed to start: {worker.boot_error}"
            else:
                self._failure = f"worker {worker.id} exited with status {code} before it served; see its error above"
            self._command(b"t")
            return
        if self._slot_taken(worker.slot):
            return  # a reload started its successor already (or it was that successor, and the old one serves on)
        if code != 0:
            _log.warning(
                "prazo host: worker %d (pid %d) exited with status %s; replacing it", worker.id, worker.pid, code
            )
        self.replaced += 1  # it died
        self._vacant.add(worker.slot)
        self._start_vacant()

    def _slot_taken(self, slot: int) -> bool:
        """Whether a live worker that is not retiring serves ``slot``: each slot has at most one."""
        with self._state_lock:
            return any(w.slot == slot and not w.retiring for w in self._workers.values())

    def _reap_triage(self) -> None:
        if self._triage_pidfd >= 0:
            self._selector.unregister(self._triage_pidfd)
            os.close(self._triage_pidfd)
            self._triage_pidfd = -1
        try:
            os.waitpid(self._triage_pid, 0)
        except ChildProcessError:
            pass
        self._triage_pid = 0
        self._triage_gone()

    def _triage_gone(self) -> None:
        if not self._stopping:
            self._failure = "the triage process exited: the host cannot serve without it"
            self._command(b"t")

    def _supervise(self) -> None:
        try:
            while True:
                self._pump(self._pump_timeout())
                while self._commands:
                    command = self._commands.popleft()
                    if command == b"t":
                        self._drain()
                        return
                    if command == b"h":
                        self._rolling_reload()
                self._start_vacant()
                self._replace_next()
        finally:
            self._stopped.set()

    def _pump_timeout(self) -> float:
        """How long the loop may wait for events: a start to try again (after its pause) wakes it."""
        if not (self._vacant or self._replacements):
            return 1.0
        return min(1.0, max(self._retry_at - time.monotonic(), 0.0))

    def _start_failed(self, slot: int, exc: RuntimeError, replacing: _Worker | None = None) -> None:
        """A worker start the triage refused: try again after a pause that grows with every failure."""
        self.failed_starts += 1
        pause = self._retry_pause
        self._retry_at = time.monotonic() + pause
        self._retry_pause = min(pause * 2, _RETRY_MAX_S)
        instead = "" if replacing is None else f" to replace worker {replacing.id} (pid {replacing.pid}, serving on)"
        _log.error(
            "prazo host: cannot start a worker for slot %d%s: %s; trying again in %.2f s", slot, instead, exc, pause
        )

    def _start_vacant(self) -> None:
        """A worker for each slot left without one (its worker died and no new one could start yet)."""
        for slot in sorted(self._vacant):
            if self._stopping or self._failure is not None or time.monotonic() < self._retry_at:
                return
            self._vacant.discard(slot)
            if self._slot_taken(slot):
                continue
            try:
                self._spawn(slot)
            except RuntimeError as exc:  # the triage is short of descriptors, or gone (its exit stops the host)
                self._vacant.add(slot)
                self._start_failed(slot, exc)

    def _rolling_reload(self) -> None:
        """Every worker serving now is replaced, one at a time (``_replace_next``, as ``max_requests`` does)."""
        with self._state_lock:
            old = sorted((w for w in self._workers.values() if not w.retiring), key=lambda w: w.slot)
        _log.info("prazo host: reload (SIGHUP): %d workers to replace, one at a time", len(old))
        for worker in old:
            if all(queued is not worker for queued in self._replacements):
                self._replacements.append(worker)

    def _replace_next(self) -> None:
        """Replace the workers waiting for it, one at a time: each successor serves before its predecessor retires."""
        while self._replacements and not self._stopping and self._failure is None and b"t" not in self._commands:
            if time.monotonic() < self._retry_at:
                return  # the last start failed: _pump_timeout wakes the loop for the next try
            worker = self._replacements[0]
            if worker.pid not in self._workers or worker.retiring:
                self._replacements.popleft()  # died meanwhile: its replacement runs the new code already
                continue
            try:
                fresh = self._spawn(worker.slot)
            except RuntimeError as exc:  # it stays first in line, serving until a successor can start
                self._start_failed(worker.slot, exc, worker)
                return
            self._replacements.popleft()
            self._wait(partial(_serving_or_gone, fresh, self._workers), BOOT_TIMEOUT_S)
            if not fresh.ready:
                _log.error("prazo host: replacing workers stopped: a new worker did not start serving")
                self._replacements.clear()
                return
            if worker.served_out:
                self.replaced += 1  # before it leaves worker_pids(): whoever sees it gone sees it counted
            worker.retiring = True
            self._request({"op": "retire", "worker": worker.id})
            why = "served its max_requests" if worker.served_out else "reloaded"
            _log.info(
                "prazo host: worker %d (pid %d) %s; worker %d (pid %d) serves in its place",
                worker.id, worker.pid, why, fresh.id, fresh.pid,
            )  # fmt: skip
            gone = partial(_gone, worker, self._workers)
            exited = self._wait(gone, self.shutdown_timeout + _EXIT_GRACE_S)
            if b"t" in self._commands:
                return  # the host drains: the retiring worker finishes there, it is not killed
            if not exited:
                _kill(worker.pid)
                self._wait(gone, _EXIT_GRACE_S)

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """Handle events until ``done()`` or ``timeout``; a stop command that comes meanwhile is kept for later."""
        end = time.monotonic() + timeout
        while not done():
            left = end - time.monotonic()
            if left <= 0 or b"t" in self._commands:  # a stop is handled by the loop once this wait ends
                return done()
            self._pump(min(left, 0.5))
        return True

    def _drain(self) -> None:
        self._stopping = True
        _log.info(
            "prazo host: draining (supervisor pid %d): the port is closed, what was admitted finishes within %g s",
            os.getpid(), self.shutdown_timeout,
        )  # fmt: skip
        reply = self._request({"op": "drain", "timeout": self.shutdown_timeout}, extra_s=self.shutdown_timeout)
        self._idle = bool(reply and reply.get("idle"))
        if self._idle:
            _log.info("prazo host: drained: everything admitted finished; the processes exit")
        else:
            _log.warning("prazo host: the drain timed out: what still waited was answered 503 shutting-down")
        self._stop_all(_EXIT_GRACE_S)

    def _stop_all(self, grace: float) -> None:
        """Every child exits (the triage after its drain, the workers when their channels close), or is killed."""
        self._stopping = True
        with self._ctl_lock:
            if self._ctl is not None:
                self._ctl.close()
                self._ctl = None
        end = time.monotonic() + grace
        while (self._workers or self._triage_pid) and time.monotonic() < end:
            self._pump(0.1)
        for pid in [*self._workers, self._triage_pid]:
            if pid:
                _kill(pid)
        for worker in list(self._workers.values()):
            self._forget(worker)
        if self._triage_pid:
            self._reap_triage()
        self._selector.close()
        with self._state_lock:  # a command after the end must not write to a descriptor reused since
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1


def _gone(worker: _Worker, workers: dict[int, _Worker]) -> bool:
    return worker.pid not in workers


def _serving_or_gone(worker: _Worker, workers: dict[int, _Worker]) -> bool:
    return worker.ready or worker.pid not in workers


def _dump_stacks_then_kill(pid: int) -> None:
    """Kill a wedged triage once it has had a moment to write where each of its threads was."""
    try:
        os.kill(pid, DUMP_STACKS_SIGNAL)
    except ProcessLookupError:
        return
    time.sleep(_DUMP_WAIT_S)
    _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
