"""``ConnectionAdmission``: admission of a raw connection, for the socket-level servers.

It waits, without a worker, until the request head is complete (408 after the
header timeout), computes the exact deadline from it, offers the connection
to the ``AdmissionDispatcher``, writes refusals itself and closes them
politely through a ``LingeringCloser`` (so a client still uploading its body
reads the 503 instead of a reset). The cheroot, werkzeug, wsgiref and
gunicorn embeddings are built on it.
"""

from __future__ import annotations

import heapq
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from prazo.core import NS_PER_MS, Deadline, ShutDown

from ...wsgi import MiddlewareCounters, WSGIApp
from ..settings import ServerSettings
from .dispatcher import AdmissionDispatcher, AdmittedApp, Ticket, admission_ticket
from .heads import MAX_HEAD_BYTES, find_head, peekable, request_environ, waiting_bytes
from .refusals import HEADER_TIMEOUT_ANSWER, LingeringCloser, rejection_bytes
from .sockets import hard_close, send_all

__all__ = ["ConnectionAdmission"]

_log = logging.getLogger("prazo.servers")  # one name for all the shared machinery, see dispatcher

# A head still arriving is peeked at again after 1 ms, then after twice as
# long each time, up to 0.1 s: a head split across packets is seen a moment
# after its end arrives, and a slow-loris client costs at most ten peeks a
# second. (Peeking leaves the bytes for the server, so the socket stays
# readable and readiness cannot tell when more arrive.)
_HEAD_FIRST_LOOK_NS = 1_000_000
_HEAD_MAX_LOOK_NS = 100_000_000


class _PendingHead:
    """A connection whose request head is still arriving, and what admitting it will need."""

    __slots__ = (
        "arrival_ns",
        "buffered",
        "give_up_ns",
        "item",
        "look_ns",
        "next_look_ns",
        "remote_addr",
        "sock",
        "taken",
    )

    def __init__(
        self, item: Any, sock: socket.socket, remote_addr: object, buffered: bytes, arrival_ns: int, give_up_ns: int
    ) -> None:
        self.item = item
        self.sock = sock
        self.remote_addr = remote_addr
        # What the server had read already, and what this admission took off the socket since.
        self.buffered = buffered
        self.taken = b""
        self.arrival_ns = arrival_ns
        self.give_up_ns = give_up_ns
        self.look_ns = _HEAD_FIRST_LOOK_NS
        self.next_look_ns = arrival_ns

    def __lt__(self, other: _PendingHead) -> bool:
        return self.next_look_ns < other.next_look_ns


class _HeadWatcher:
    """Holds connections whose request head is incomplete, in one thread, until it is complete.

    ``offer(pending)`` looks at the head at once, in the caller's thread; when
    it is incomplete the connection waits here, looked at again on a doubling
    interval (see ``_HEAD_FIRST_LOOK_NS``), until its head is complete, its
    peer closes, or ``pending.give_up_ns`` passes. Each outcome goes to the
    ``ConnectionAdmission``. ``stop()`` drops every connection still waiting;
    ``offer`` returns False once stopped. ``pending`` counts the connections
    waiting here (a head complete at the first look never is), and ``offer``
    says whether this one does.
    """

    def __init__(self, admission: ConnectionAdmission, name: str) -> None:
        self._admission = admission
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[_PendingHead] = []
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.pending = 0

    def offer(self, pending: _PendingHead) -> bool | None:
        """None once stopped; else True when the head waits here, False when it was dealt with at once."""
        # Read without the lock: a stop() right after this finds a complete
        # head refused by the stopped queue, and an incomplete one is dropped
        # by _look, which checks again under the lock.
        if self._stopped:
            return None
        # Not counted as arriving while it is looked at: a complete head is
        # offered to the queue from here, and what the queue's observer
        # publishes then must not count it twice.
        return self._look(pending, counted=False)

    def _look(self, pending: _PendingHead, *, counted: bool = True) -> bool:
        try:
            waiting = self._admission._look_at_head(pending)
        except Exception:  # noqa: BLE001 - the watcher serves every other pending head too
            _log.exception("prazo: %s failed on %r", self._name, pending.sock)
            self._admission._drop(pending)
            waiting = False
        if not waiting and not counted:
            return False  # dealt with at its first look: it never counted here
        with self._cond:
            if not waiting:
                self.pending -= 1
                return False
            if not counted:
                self.pending += 1
            now = time.monotonic_ns()
            pending.next_look_ns = min(now + pending.look_ns, pending.give_up_ns)
            pending.look_ns = min(2 * pending.look_ns, _HEAD_MAX_LOOK_NS)
            if self._stopped:
                self.pending -= 1
                stopped = True
            else:
                stopped = False
                heapq.heappush(self._heap, pending)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify()
        if stopped:
            self._admission._drop(pending)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    wait_ns = self._heap[0].next_look_ns - time.monotonic_ns() if self._heap else None
                    if wait_ns is not None and wait_ns <= 0:
                        break
                    self._cond.wait(None if wait_ns is None else wait_ns / 1e9)
                if self._stopped:
                    return
                pending = heapq.heappop(self._heap)
            self._look(pending)

    def stop(self) -> None:
        """Stop watching; every connection still waiting for its head is dropped."""
        with self._cond:
            self._stopped = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cond:
            leftovers, self._heap = self._heap, []
            self.pending -= len(leftovers)
        for pending in leftovers:
            self._admission._drop(pending)


class ConnectionAdmission:
    """Admission of raw connections: the shared core of the socket-level embeddings.

    Effects: ``admit(item, sock, remote_addr)`` stamps the arrival (the first
    bytes of the request have arrived) and waits, without a worker and without
    a place in line, until the request head is complete: it peeks at the head
    without consuming it, and while it is incomplete the connection waits in a
    watcher thread. A head not complete within ``header_timeout_ms`` of the
    arrival is answered 408 (``X-Prazo-Reason: header-timeout``) and closed
    (also when its client has left: a peek cannot see the end of the stream
    behind the bytes it sent); one reset by its peer is closed at once;
    neither was ever offered to the queue. A complete head gives the deadline (``X-Request-Budget-Ms``,
    ``grpc-timeout``, ... and, when trusted, ``X-Request-Start``, counted from
    the arrival) and the connection is offered to the queue. When the head
    cannot be seen (TLS, or larger than ``MAX_HEAD_BYTES``) the ticket is
    provisional and ``AdmittedApp`` finishes the job. A refused connection is
    answered here — 503 or 504 with ``Connection: close`` — and closed through
    the ``LingeringCloser``. The head also gives the request's class (critical
    on ``critical_paths`` or by ``critical_header``); a provisional ticket is
    normal. ``on_closed(item)`` lets the server drop its own
    bookkeeping for every connection closed here (before the socket is closed
    or handed to the closer). ``serve(ticket)`` runs in the dispatcher's
    workers; ``on_change()`` goes to the dispatcher (see ``AdmissionDispatcher``).

    ``take_bytes(item, data)``, for a server whose reader can be handed bytes
    (gunicorn's ``Unreader``): the head is then read off the socket rather
    than peeked at, and every byte read is handed over, once, before the
    connection is offered to the queue. The server reads nothing twice, and
    a worker finds the head it will parse already there.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        serve: Callable[[Ticket], object],
        socket_of: Callable[[Any], socket.socket],
        on_closed: Callable[[Any], object] | None = None,
        name: str = "prazo",
        closer: LingeringCloser | None = None,
        on_change: Callable[[], object] | None = None,
        take_bytes: Callable[[Any, bytes], object] | None = None,
    ) -> None:
        if take_bytes is not None and not callable(take_bytes):
            raise TypeError(f"take_bytes must be a callable or None, not {type(take_bytes).__name__}")
        self._take_bytes = take_bytes
        self.settings = settings
        self.policy = settings.policy()
        self.counters = MiddlewareCounters()
        self.closer = LingeringCloser(name=f"{name}-linger") if closer is None else closer
        self._socket_of = socket_of
        self._on_closed = on_closed
        self._provisional_ns = int(self.policy.max_budget_ms * NS_PER_MS)
        self._header_timeout_ns = int(settings.header_timeout_ms * NS_PER_MS)
        self._heads = _HeadWatcher(self, f"{name}-heads")
        # admit() and the watcher thread both look at heads.
        self._header_timeouts_lock = threading.Lock()
        self._header_timeouts = 0
        self.classifier = settings.classifier()
        self.dispatcher = AdmissionDispatcher(
            settings.threads,
            settings.max_queue,
            serve=serve,
            reject=self._reject,
            name=name,
            queue_options=settings.queue_options(),
            observe_only=settings.observe_only,
            on_change=on_change,
        )

    def wrap(self, app: WSGIApp) -> AdmittedApp:
        """The app as the server must call it (see ``AdmittedApp``)."""
        return AdmittedApp(app, self.dispatcher, self.policy, self.counters, load_report=self.settings.load_report)

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        self.dispatcher.start()

    def admit(self, item: Any, sock: socket.socket, remote_addr: object, *, buffered: bytes = b"") -> bool:
        """Offer the connection whose next request is arriving; ``buffered``: its bytes the server already read.

        True when its head is still arriving (it now counts in ``pending_heads``).
        """
        arrival_ns = time.monotonic_ns()
        if not peekable(sock):
            self._submit(item, None, arrival_ns, remote_addr)
            return False
        pending = _PendingHead(item, sock, remote_addr, buffered, arrival_ns, arrival_ns + self._header_timeout_ns)
        waiting = self._heads.offer(pending)
        if waiting is None:
            self._answer_and_close(item, sock, rejection_bytes(ShutDown("the server is shutting down")))
            return False
        return waiting

    def _look_at_head(self, pending: _PendingHead) -> bool:
        """Admit, answer or drop ``pending`` if its head is complete or will never be; True to keep waiting."""
        take = self._take_bytes is not None
        data = pending.buffered + pending.taken
        seen = (
            waiting_bytes(pending.sock, MAX_HEAD_BYTES - len(data), take=take) if len(data) < MAX_HEAD_BYTES else None
        )
        if seen:
            data += seen
            if take:
                pending.taken += seen
        head = find_head(data)
        if head is not None or len(data) >= MAX_HEAD_BYTES:
            if take and pending.taken:
                self._take_bytes(pending.item, pending.taken)  # type: ignore[misc]
            self._submit(pending.item, head, pending.arrival_ns, pending.remote_addr)
        elif seen == b"":
            self._drop(pending)  # reset, or closed after the server read what it sent
        elif time.monotonic_ns() >= pending.give_up_ns:
            with self._header_timeouts_lock:
                self._header_timeouts += 1
            self._answer_and_close(pending.item, pending.sock, HEADER_TIMEOUT_ANSWER)
        else:
            return True
        return False

    def _submit(self, item: Any, head: bytes | None, arrival_ns: int, remote_addr: object) -> None:
        if head is None:
            ticket = Ticket(item, Deadline.at_ns(arrival_ns + self._provisional_ns), arrival_ns, provisional=True)
        else:
            environ = request_environ(head, remote_addr)
            ticket = admission_ticket(item, environ, arrival_ns, self.policy, self.counters, self.classifier)
        self.dispatcher.submit(ticket)

    def _reject(self, ticket: Ticket, exc: BaseException) -> None:
        self.counters.count_response(exc)
        answer = rejection_bytes(
            exc,
            retry_after_s=self.settings.fixed_retry_after_s(),
            retry_after_ns=self.settings.measured_wait_ns(self.dispatcher.queue),
        )
        self._answer_and_close(ticket.item, self._socket_of(ticket.item), answer)

    def _answer_and_close(self, item: Any, sock: socket.socket, answer: bytes) -> None:
        send_all(sock, answer)
        if self._on_closed is not None:
            self._on_closed(item)
        self.closer.close(sock)

    def _drop(self, pending: _PendingHead) -> None:
        if self._on_closed is not None:
            self._on_closed(pending.item)
        hard_close(pending.sock)

    @property
    def pending_heads(self) -> int:
        """Connections whose request head is still arriving (not yet offered to the queue)."""
        return self._heads.pending

    def stats(self) -> dict[str, int]:
        """The queue's counters, the refusals sent and the heads still arriving or timed out."""
        return {
            **self.dispatcher.stats(),
            **self.counters.snapshot(),
            "lingering": self.closer.lingering,
            "pending_heads": self._heads.pending,
            "header_timeouts": self._header_timeouts,
        }

    def close(self, timeout: float | None = None, *, cancel_waiting: bool = False) -> bool:
        """Stop admitting, let the admitted finish (see ``AdmissionDispatcher.shutdown``).

        Connections whose request head has not arrived completely are closed
        at once; a request arriving on a connection after this is answered
        503 ``shutting-down``.
        """
        self._heads.stop()
        finished = self.dispatcher.shutdown(timeout, cancel_waiting=cancel_waiting)
        self.closer.stop()
        return finished
