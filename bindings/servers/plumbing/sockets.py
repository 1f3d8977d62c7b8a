"""Socket plumbing of the embeddings: one thread watching many sockets, each until a deadline.

``SocketWatcher`` is the base of every background watcher (``ReadinessWatcher``
here, the ``LingeringCloser`` in ``refusals``); ``send_all`` and ``hard_close``
write and close without ever raising, because a peer that left is normal.
"""

from __future__ import annotations

import heapq
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prazo.core.arguments import checked_count

__all__ = ["ReadinessWatcher", "SocketWatcher", "WatchedSocket", "hard_close", "send_all"]

_log = logging.getLogger("prazo.servers")  # one name for all the shared machinery, see dispatcher

# A refusal is a few hundred bytes into an empty send buffer; this bound only
# matters for a peer that stopped reading entirely.
_SEND_TIMEOUT_S = 1.0


def send_all(sock: socket.socket, payload: bytes) -> bool:
    """Write all of ``payload`` within a second; False (never an exception) when the peer is gone or stuck."""
    try:
        sock.settimeout(_SEND_TIMEOUT_S)
        sock.sendall(payload)
    except OSError:
        return False
    return True


def hard_close(sock: socket.socket) -> None:
    """Close ``sock`` now, whatever state it is in."""
    try:
        sock.close()
    except OSError:
        pass


class WatchedSocket:
    """A socket under watch: its deadline and what the watcher keeps about it."""

    __slots__ = ("data", "deadline_ns", "sock")

    def __init__(self, sock: socket.socket, deadline_ns: int, data: Any) -> None:
        self.sock = sock
        self.deadline_ns = deadline_ns
        self.data = data

    def __lt__(self, other: WatchedSocket) -> bool:
        return self.deadline_ns < other.deadline_ns


class SocketWatcher:
    """One background thread waiting for many sockets to become readable, each until a deadline.

    Effects: ``watch(sock, timeout_s, data)`` adds a socket (from any thread;
    the thread starts on first use). When it becomes readable it leaves the
    selector and ``_on_readable(entry)`` runs in the watcher thread; a True
    result puts it back. When its deadline passes first, ``_on_timeout``
    runs (it closes the socket). ``stop()`` closes every socket still
    watched. At most ``max_sockets`` are watched; ``watch`` returns False
    beyond that, or once stopped, and the caller keeps the socket.
    Subclasses define ``_on_readable``.
    """

    def __init__(self, *, name: str, max_sockets: int | None = None) -> None:
        self._name = name
        self._max_sockets = None if max_sockets is None else checked_count(max_sockets, "max_sockets", 0)
        self._lock = threading.Lock()
        self._incoming: deque[WatchedSocket] = deque()
        self._count = 0
        self._thread: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stopped = False

    @property
    def watching(self) -> int:
        """Sockets currently watched."""
        return self._count

    def watch(self, sock: socket.socket, timeout_s: float, data: Any = None) -> bool:
        """Watch ``sock`` for at most ``timeout_s`` seconds; False when refused (full or stopped)."""
        entry = WatchedSocket(sock, time.monotonic_ns() + int(timeout_s * 1e9), data)
        with self._lock:
            if self._stopped or (self._max_sockets is not None and self._count >= self._max_sockets):
                return False
            self._count += 1
            self._incoming.append(entry)
            if self._thread is None:
                self._wake_r, self._wake_w = socket.socketpair()
                self._wake_r.setblocking(False)
                self._wake_w.setblocking(False)
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake()
        return True

    def _on_readable(self, entry: WatchedSocket) -> bool:
        """``entry.sock`` is readable (and out of the selector); True to keep watching it."""
        raise NotImplementedError

    def _on_timeout(self, entry: WatchedSocket) -> None:
        """``entry``'s deadline passed before it was done."""
        hard_close(entry.sock)

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"\0")
            except OSError:
                pass  # the buffer is full (a wake-up is pending anyway) or we are stopping

    def _forget(self) -> None:
        with self._lock:
            self._count -= 1

    def _run(self) -> None:
        assert self._wake_r is not None
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        # Heap of entries by deadline; an entry no longer in the selector
        # (handed on, or re-watched) is skipped when it surfaces.
        deadlines: list[WatchedSocket] = []
        try:
            while True:
                with self._lock:
                    stopped = self._stopped
                    arrivals = list(self._incoming)
                    self._incoming.clear()
                for entry in arrivals:
                    self._register(selector, deadlines, entry)
                if stopped:
                    return
                now = time.monotonic_ns()
                while deadlines and deadlines[0].deadline_ns <= now:
                    entry = heapq.heappop(deadlines)
                    if self._unregister(selector, entry):
                        self._call(self._on_timeout, entry)
                timeout = max(deadlines[0].deadline_ns - now, 0) / 1e9 if deadlines else None
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                        continue
                    entry = key.data
                    self._unregister(selector, entry)
                    if self._call(self._on_readable, entry):
                        # Its deadline is still on the heap: back into the selector only.
                        self._register(selector, None, entry)
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not self._wake_r:
                    selector.unregister(key.fileobj)
                    hard_close(key.data.sock)
                    self._forget()
            selector.close()

    def _register(
        self, selector: selectors.BaseSelector, deadlines: list[WatchedSocket] | None, entry: WatchedSocket
    ) -> None:
        try:
            selector.register(entry.sock, selectors.EVENT_READ, entry)
        except (OSError, ValueError):
            hard_close(entry.sock)  # closed meanwhile: nothing left to watch
            self._forget()
            return
        if deadlines is not None:
            heapq.heappush(deadlines, entry)

    def _unregister(self, selector: selectors.BaseSelector, entry: WatchedSocket) -> bool:
        """Take ``entry`` out of the selector; False when it was not (or no longer) there."""
        try:
            key = selector.get_key(entry.sock)
        except (KeyError, ValueError):
            return False
        if key.data is not entry:
            return False
        selector.unregister(entry.sock)
        return True

    def _call(self, handler: Callable[[WatchedSocket], Any], entry: WatchedSocket) -> bool:
        """Run a handler; the entry stops being counted unless it asks to stay."""
        try:
            keep = bool(handler(entry))
        except Exception:  # noqa: BLE001 - the watcher thread serves every other socket too
            _log.exception("prazo: %s failed on %r", self._name, entry.sock)
            hard_close(entry.sock)
            keep = False
        if not keep:
            self._forget()
        return keep

    def stop(self) -> None:
        """Close every socket still watched and stop the thread."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            leftovers = list(self._incoming)
            self._incoming.clear()
            self._count -= len(leftovers)
        for entry in leftovers:
            hard_close(entry.sock)
        for wake in (self._wake_r, self._wake_w):
            if wake is not None:
                hard_close(wake)


class ReadinessWatcher(SocketWatcher):
    """Holds new connections, without a thread each, until their first bytes arrive.

    Effects: ``watch(sock, timeout_s, data)``; once ``sock`` is readable,
    ``on_ready(sock, data)`` runs in the watcher thread (it must not block:
    admission does a peek and a queue put). A connection silent for
    ``timeout_s`` is closed.
    """

    def __init__(self, on_ready: Callable[[socket.socket, Any], object], *, name: str = "prazo-readiness") -> None:
        super().__init__(name=name)
        self._on_ready = on_ready

    def _on_readable(self, entry: WatchedSocket) -> bool:
        self._on_ready(entry.sock, entry.data)
        return False
