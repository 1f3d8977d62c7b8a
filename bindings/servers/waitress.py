"""prazo inside waitress: admission at waitress's own task queue.

waitress reads every request completely (head and body) in its I/O thread
and then queues the connection for a worker thread. ``create_server``
replaces that queue with prazo's, as waitress's task dispatcher::

    from prazo.bindings.servers.waitress import create_server

    server = create_server(app, host="127.0.0.1", port=8080,
                           threads=4, max_queue=16, default_budget_ms=1000)
    server.run()            # or prazo.bindings.servers.waitress.serve(app, ...)

Effects, per request:

- the deadline starts when waitress has received the whole request, from
  its budget headers (see ``prazo.bindings.headers``) capped at
  ``max_budget_ms``;
- ``threads`` requests run the app at once and ``max_queue`` more wait;
  beyond that the answer is an immediate 503 (``X-Prazo-Reason:
  queue-full``, ``Retry-After``) written by the I/O thread: no worker is used;
- a request whose deadline passes while it waits is answered 504
  (``expired-in-queue``) at its deadline, by the I/O thread, and the app
  never runs;
- the app runs in ``deadline_scope`` with ``prazo.deadline``,
  ``prazo.queue_wait_ms`` in its environ (``prazo.bindings.wsgi.run_admitted``);
- a refused request leaves its connection usable: the body was already read,
  so keep-alive follows the usual HTTP rules.

Graceful shutdown: ``run()`` ending with Ctrl-C / ``SystemExit``, and
``shutdown(server)`` from another thread, stop admitting, let every admitted
request finish and flush its response. New requests get 503
``shutting-down``: ``run()`` keeps accepting connections to answer them;
``shutdown(server)`` closes the listening sockets first (new connections are
refused, requests on connections already open get the 503).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer, MultiSocketServer
from waitress.server import create_server as _waitress_create_server
from waitress.task import ErrorTask, WSGITask
from waitress.utilities import Error

from ..wsgi import MiddlewareCounters, WSGIApp, rejection_response
from .plumbing.dispatcher import AdmissionDispatcher, AdmittedApp, Ticket, admission_ticket
from .settings import ServerSettings, resolve_settings

__all__ = ["AdmissionChannel", "WaitressDispatcher", "create_server", "serve", "shutdown"]

_log = logging.getLogger("prazo.waitress")

# What the worker-ticket map gives for a thread that is not one of the workers.
_NOT_A_WORKER = object()

_get_ident = threading.get_ident
_monotonic_ns = time.monotonic_ns

# How long one turn of the I/O loop may block while shutdown pumps it.
_PUMP_INTERVAL_S = 0.02


class _Refusal(Error):
    """A waitress request error that carries prazo's refusal (503/504)."""

    def __init__(self, exc: BaseException, retry_after_s: int, retry_after_ns: int) -> None:
        status, _, body = rejection_response(exc)
        super().__init__(body.decode("ascii"))
        self.exc = exc
        self.retry_after_s = retry_after_s
        self.retry_after_ns = retry_after_ns
        self.code = int(status[:3])
        self.reason = status[4:]

    def to_response(self, ident: str | None = None) -> tuple[str, list[tuple[str, str]], bytes]:
        return rejection_response(self.exc, retry_after_s=self.retry_after_s, retry_after_ns=self.retry_after_ns)


# The largest first body chunk that is copied behind the response head to go
# out in one send: beyond it, the copy would cost more than the send it saves.
_HEAD_WITH_BODY_MAX = 64 * 1024


class _HeadWithFirstChunk:
    """A waitress task whose response head goes out with the first body chunk, in one send.

    waitress's ``Task.write`` hands the channel the head and then the chunk,
    and each ``write_soon`` sends at once: two sends, two GIL hand-offs. Here
    the channel keeps the head (``AdmissionChannel._held_head``) and sends it
    in front of the chunk; when no chunk follows (a HEAD request, a 204, a
    body past Content-Length), the head is sent alone.
    """

    channel: AdmissionChannel
    wrote_header: bool

    def write(self, data: bytes) -> None:
        if self.wrote_header or not data or len(data) > _HEAD_WITH_BODY_MAX:
            super().write(data)  # type: ignore[misc]
            return
        channel = self.channel
        channel._held_head = b""  # the next write_soon (the head) is kept for the one after it
        try:
            super().write(data)  # type: ignore[misc]
        finally:
            head, channel._held_head = channel._held_head, None
        if head:
            channel.write_soon(head)


class _AdmissionTask(_HeadWithFirstChunk, WSGITask):
    """waitress's ``WSGITask``, its head sent with the first chunk."""


class _RefusalTask(_HeadWithFirstChunk, ErrorTask):
    """Answers a prazo refusal without closing the connection.

    waitress's ``ErrorTask`` always closes, because its errors come from
    requests it could not parse. A refused request was read completely, so
    the connection can serve the next request (the usual keep-alive rules
    of ``Task.build_response_header`` still apply).
    """

    def execute(self) -> None:
        error = self.request.error
        if not isinstance(error, _Refusal):
            super().execute()
            return
        status, headers, body = error.to_response()
        self.status = status
        self.response_headers.extend(headers)
        self.content_length = len(body)
        self.write(body)


class AdmissionChannel(HTTPChannel):
    """waitress's ``HTTPChannel``: refusals keep the connection open, and the I/O loop does not spin on a write.

    waitress's worker sends a response itself, inside ``write_soon`` (its
    ``send_bytes`` is 1), with the channel's output lock held. Stock
    waitress reports the channel writable during that send too. Each send
    lets go of the GIL, so the I/O thread gets it, finds the channel
    writable, turns its loop, and cannot take the lock. Each such turn costs
    a ``readable()`` and a ``writable()`` call on every connection: under
    load this embedding turned the loop 0.6 times per request, and 0.05
    times without the spin (``bench/RESULTS.md``).
    So while a worker is inside ``write_soon`` the channel is not writable,
    unless the worker waits for the I/O thread to flush below
    ``outbuf_high_watermark``, or the channel is to close. Output the worker
    leaves behind (a partial send) wakes the loop when ``write_soon``
    returns, so it is flushed as soon as the socket takes it, as in stock
    waitress.
    """

    task_class = _AdmissionTask
    error_task_class = _RefusalTask
    # The response head waiting for its first body chunk (see _HeadWithFirstChunk); None: none is held.
    _held_head: bytes | None = None
    # True while a thread is inside write_soon (one worker serves a channel at a time).
    _writing = False

    def writable(self) -> bool:
        if self.will_close or self.close_when_flushed:
            return True
        pending = self.total_outbufs_len
        if not pending:
            return False
        # What the waiting worker needs flushed (_flush_outbufs_below_high_watermark).
        return not self._writing or pending > self.adj.outbuf_high_watermark

    def write_soon(self, data: bytes) -> int:
        held = self._held_head
        if held is not None:
            # b"": this is the head, kept for the chunk after it; else it is that chunk.
            if not held:
                self._held_head = data
                return len(data)
            self._held_head = None
            data = held + data
        self._writing = True
        try:
            return super().write_soon(data)  # type: ignore[no-any-return]
        finally:
            self._writing = False
            # The loop may have looked at this channel while it was not
            # writable and gone to sleep: wake it for what the send left.
            if self.total_outbufs_len >= self.adj.send_bytes and self.connected:
                self.server.pull_trigger()


def _request_environ(channel: Any) -> dict[str, str]:
    """The ``HTTP_*`` keys, ``REMOTE_ADDR``, ``PATH_INFO`` and ``REQUEST_METHOD``.

    What a ``BudgetPolicy`` and a ``CriticalClassifier`` read, and what the
    span of a refusal says of the request (``instrument(refusal_spans=True)``).
    ``WaitressDispatcher.add_task`` builds the same dict inline (keep the two alike).
    """
    request = channel.requests[0]
    environ = {"HTTP_" + name: value for name, value in request.headers.items()}
    environ["PATH_INFO"] = request.path
    environ["REQUEST_METHOD"] = request.command
    peer = channel.addr[0] if channel.addr else None
    if isinstance(peer, str):
        environ["REMOTE_ADDR"] = peer
    return environ


class WaitressDispatcher:
    """waitress's task dispatcher, replaced by prazo's admission queue.

    Effects: ``add_task(channel)`` — called by waitress once a request has
    been received completely, with the channel's ``requests_lock`` held —
    stamps the arrival, computes the deadline and submits the channel. A
    worker thread runs ``channel.service()`` for admitted requests. A refused
    request gets its answer by setting ``channel.requests[0].error`` and
    having the I/O thread run ``channel.service()`` through the trigger
    (never inline: ``add_task`` holds ``requests_lock`` and ``service()``
    takes it).

    ``create_server`` wires it in; it is the server's ``task_dispatcher``:

    >>> server = create_server(lambda environ, start_response: [], host="127.0.0.1", port=0, max_queue=8)
    >>> server.task_dispatcher.settings.capacity
    12
    >>> server.task_dispatcher.shutdown(timeout=1)
    True
    >>> server.close()
    """

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.policy = settings.policy()
        self.counters = MiddlewareCounters()
        self.classifier = settings.classifier()
        self.dispatcher = AdmissionDispatcher(
            settings.threads,
            settings.max_queue,
            serve=self._serve,
            reject=self._reject,
            name="prazo-waitress",
            queue_options=settings.queue_options(),
            observe_only=settings.observe_only,
        )
        self._submit = self.dispatcher.submit
        # Each worker thread's id and the ticket it serves (what is_worker_thread() and current_ticket() read).
        self._worker_idents = self.dispatcher._serving
        self._refused: deque[Any] = deque()
        self._refused_lock = threading.Lock()
        self._answering_scheduled = False
        self._io_thread: int | None = None
        self._map: dict[int, Any] | None = None
        #: Seconds admitted requests get to finish when ``run()`` ends on
        #: Ctrl-C / ``SystemExit`` (waitress calls ``shutdown()`` without one).
        self.shutdown_timeout = 5.0

    def wrap(self, app: WSGIApp) -> AdmittedApp:
        """The app as waitress must call it (see ``prazo.bindings.servers.plumbing.dispatcher.AdmittedApp``).

        A request's slot is given back once waitress's ``channel.service()``
        is done with it (``release_at_close=False``), not at the body's close:
        waitress's worker then still queues the answer, pops the request and
        wakes its I/O thread, and a slot given back earlier woke the next
        request's worker into that tail (about a tenth of a request's time on
        one CPU). A pipelined request offered by the worker is the exception:
        the slot of the one before it is given back first (``add_task``).
        """
        return AdmittedApp(
            app,
            self.dispatcher,
            self.policy,
            self.counters,
            release_at_close=False,
            load_report=self.settings.load_report,
        )

    def stats(self) -> dict[str, int]:
        """The queue's counters and the refusals sent."""
        return {**self.dispatcher.stats(), **self.counters.snapshot()}

    # -- waitress's dispatcher interface ---------------------------------------------

    def set_thread_count(self, count: int) -> None:
        """Start the workers; ``count`` must be the configured ``threads`` (the pool is fixed)."""
        if count != self.settings.threads:
            raise ValueError(f"count must be {self.settings.threads} (prazo's worker pool is fixed), got {count}")
        self.dispatcher.start()

    def add_task(self, channel: Any) -> None:
        """Offer the request at the head of ``channel``; never blocks, never serves inline."""
        arrival_ns = _monotonic_ns()
        # dispatcher.is_worker_thread() and _request_environ(channel), inlined:
        # this runs in the I/O thread for every request.
        ident = _get_ident()
        serving: Any = self._worker_idents.get(ident, _NOT_A_WORKER)
        if serving is _NOT_A_WORKER:
            self._io_thread = ident
        elif serving is not None:
            # A pipelined request, offered by the worker that has just served
            # the one before it (waitress's service() popped it): that one's
            # slot is free now, before this one is offered (see wrap()).
            serving.release()
        self._map = channel.server._map
        request = channel.requests[0]
        environ = {"HTTP_" + name: value for name, value in request.headers.items()}
        environ["PATH_INFO"] = request.path
        environ["REQUEST_METHOD"] = request.command
        addr = channel.addr
        peer = addr[0] if addr else None
        if isinstance(peer, str):
            environ["REMOTE_ADDR"] = peer
        self._submit(admission_ticket(channel, environ, arrival_ns, self.policy, self.counters, self.classifier))

    def shutdown(self, cancel_pending: bool = True, timeout: float | None = None) -> bool:
        """Stop admitting; finish every admitted request and flush its answer.

        waitress calls this when ``run()`` ends with Ctrl-C or ``SystemExit``;
        the I/O loop has stopped then, so this thread turns it while it waits
        (answers must still reach the clients). Requests still waiting after
        ``timeout`` seconds (default ``shutdown_timeout``) are answered 503
        ``shutting-down``.
        ``cancel_pending`` is accepted for waitress's interface: prazo always
        answers what it cannot finish. True when every admitted request ran.
        """
        if timeout is None:
            timeout = self.shutdown_timeout
        # Only the I/O thread may turn the loop; elsewhere it is still running.
        pump = self._io_thread == threading.get_ident()
        outcome: list[bool] = []
        drain = threading.Thread(
            target=lambda: outcome.append(self.dispatcher.shutdown(timeout)),
            name="prazo-waitress-drain",
            daemon=True,
        )
        end = time.monotonic() + timeout
        drain.start()
        while drain.is_alive():
            if pump:
                self._pump()
            else:
                drain.join(_PUMP_INTERVAL_S)
        while pump and self._output_pending() and time.monotonic() < end:
            self._pump()
        return bool(outcome and outcome[0])

    # -- internals -------------------------------------------------------------------

    def _pump(self) -> None:
        if self._map:
            wasyncore.loop(timeout=_PUMP_INTERVAL_S, map=self._map, use_poll=True, count=1)
        else:
            time.sleep(_PUMP_INTERVAL_S)

    def _output_pending(self) -> bool:
        channels = list(self._map.values()) if self._map else []
        return any(getattr(channel, "total_outbufs_len", 0) for channel in channels)

    def _serve(self, ticket: Ticket) -> None:
        ticket.item.service()

    def _reject(self, ticket: Ticket, exc: BaseException) -> None:
        channel = ticket.item
        self.counters.count_response(exc)
        requests = channel.requests
        if not requests:
            return  # the channel was cancelled meanwhile: nobody to answer
        requests[0].error = _Refusal(
            exc, self.settings.fixed_retry_after_s(), self.settings.measured_wait_ns(self.dispatcher.queue)
        )
        with self._refused_lock:
            self._refused.append(channel)
            schedule = not self._answering_scheduled
            self._answering_scheduled = True
        if schedule:
            try:
                channel.server.trigger.pull_trigger(self._answer_refused)
            except OSError:
                # The trigger is closed: the server is gone, and its
                # connections with it.
                with self._refused_lock:
                    self._refused.clear()
                    self._answering_scheduled = False

    def _answer_refused(self) -> None:
        """Run in the I/O thread: answer every refused request queued so far.

        One thunk drains the whole backlog, including refusals queued while it
        runs (``service()`` can offer a pipelined request that is refused in
        turn): a thunk must never pull the trigger with another thunk, which
        would deadlock on the trigger's lock.
        """
        while True:
            with self._refused_lock:
                if not self._refused:
                    self._answering_scheduled = False
                    return
                channel = self._refused.popleft()
            try:
                channel.service()
            except Exception:  # noqa: BLE001 - the other refused requests still need their answer
                _log.exception("prazo: answering a refused request on %r failed", channel)


def _listening_servers(server: Any) -> list[BaseWSGIServer]:
    socket_map = server.map if isinstance(server, MultiSocketServer) else server._map
    return [entry for entry in list(socket_map.values()) if isinstance(entry, BaseWSGIServer)]


def create_server(
    app: WSGIApp,
    *,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    settings: ServerSettings | None = None,
    **waitress_options: Any,
) -> Any:
    """A waitress server whose task queue is prazo's admission queue.

    Returns what ``waitress.create_server`` returns (``effective_port``,
    ``run()``, ``close()``, ``print_listen()`` work as usual); its
    ``task_dispatcher`` is a ``WaitressDispatcher``. Every limit not given
    comes from the environment (``PRAZO_MAX_QUEUE``, ...) or its default
    (threads 4, four waiting requests per thread, 1000 ms default budget,
    30000 ms at most); ``settings`` (a ``ServerSettings``, e.g. one that
    trusts ``X-Request-Start``) replaces them all. ``waitress_options`` are
    waitress's own (``host``, ``port``, ``listen``, ...), except ``threads``.
    """
    settings = resolve_settings(
        threads=threads, max_queue=max_queue, default_budget_ms=default_budget_ms, max_budget_ms=max_budget_ms,
        settings=settings,
    )  # fmt: skip
    dispatcher = WaitressDispatcher(settings)
    server = _waitress_create_server(
        dispatcher.wrap(app), _dispatcher=dispatcher, threads=settings.threads, **waitress_options
    )
    for listener in _listening_servers(server):
        listener.channel_class = AdmissionChannel
    # waitress starts the workers itself only for its own dispatcher.
    dispatcher.set_thread_count(settings.threads)
    return server


def shutdown(server: Any, timeout: float = 5.0) -> bool:
    """Stop a server from ``create_server`` gracefully, from any thread, while ``run()`` runs.

    Stops accepting connections (new ones are refused), answers requests on
    connections already open 503 ``shutting-down``, lets every admitted
    request finish and its answer be sent, then closes
    every connection so ``run()`` returns. True when every admitted request
    ran within ``timeout`` seconds.
    """
    dispatcher = server.task_dispatcher
    if not isinstance(dispatcher, WaitressDispatcher):
        raise TypeError("server must come from prazo.bindings.servers.waitress.create_server")
    listeners = _listening_servers(server)
    socket_map = server.map if isinstance(server, MultiSocketServer) else server._map
    trigger = listeners[0].trigger

    def stop_accepting() -> None:
        for listener in listeners:
            listener.accepting = False
            wasyncore.dispatcher.close(listener)

    end = time.monotonic() + timeout
    # Admission stops before the listeners close: once a new connection is
    # refused, a request on a connection already open is answered 503
    # shutting-down, never queue-full.
    dispatcher.dispatcher.queue.shutdown()
    _run_in_io_thread(trigger, stop_accepting)
    finished = dispatcher.shutdown(timeout=timeout)
    while dispatcher._output_pending() and time.monotonic() < end:
        time.sleep(_PUMP_INTERVAL_S)
    _run_in_io_thread(trigger, lambda: wasyncore.close_all(socket_map))
    return finished


def _run_in_io_thread(trigger: Any, thunk: Callable[[], object]) -> None:
    """Have waitress's I/O thread run ``thunk``, unless its loop already closed everything.

    Once the trigger is closed (the server was closed, or a second shutdown
    runs) there is nothing left to stop, and writing to it would raise EBADF.
    """
    if getattr(trigger, "_closed", False):
        return
    try:
        trigger.pull_trigger(thunk)
    except OSError:
        # Closed between the check and the write: the same situation.
        return


def serve(app: WSGIApp, **kw: Any) -> None:
    """Like ``waitress.serve``: build the server with ``create_server(app, **kw)`` and run it."""
    logging.basicConfig()
    server = create_server(app, **kw)
    dispatcher: WaitressDispatcher = server.task_dispatcher
    server.print_listen("Serving on http://{}:{}")
    _log.warning("prazo admission: %s", dispatcher.settings.describe())
    server.run()
