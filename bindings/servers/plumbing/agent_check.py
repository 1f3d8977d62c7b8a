"""``AgentCheck``: HAProxy's ``agent-check``, answered from the server's own line.

HAProxy's health check says whether a server answers; its agent check
(``server ... agent-check agent-port P agent-inter 1s``) asks the server
itself how much it can take: HAProxy opens a TCP connection to ``agent-port``,
reads one line and applies it. Without it a balancer learns that an instance
is overloaded only from its 503s. ``AgentCheck`` answers, for each
connection, from the admission line's counters (``stats()``: every server and
the front door's host report ``in_flight``, ``queued``, ``max_concurrency`` and
``max_queue``):

* ``ready up N%`` while serving: ``N`` is the share of the line's places
  (running plus waiting) that are free, at least 1 % (0 % would drain it),
  so a server whose line fills gets less new work before it must refuse;
* ``drain`` once it is shutting down (SIGTERM: it finishes what it admitted
  and takes nothing new), or when its counters cannot be read: HAProxy then
  sends it no new connections until it says ``ready`` again.

Then it closes the connection, as the protocol asks. One thread, one
listening socket; each answer is one ``stats()`` call. ``prazo serve
--agent-port P`` starts one (docs/how-to/loadbalancers.md).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["AgentCheck", "agent_line"]

_log = logging.getLogger("prazo.servers.agent_check")
# A connection that has not taken its line within this long is closed (HAProxy reads at once).
_SEND_TIMEOUT_S = 1.0
_BUSY_PAUSE_S = 0.1


def agent_line(stats: Mapping[str, Any] | None, draining: bool) -> str:
    """The line an agent check answers: ``"ready up N%"``, or ``"drain"`` (shutting down, or no counters)."""
    if draining or stats is None:
        return "drain"
    places = int(stats.get("max_concurrency", 0)) + int(stats.get("max_queue", 0))
    busy = int(stats.get("in_flight", 0)) + int(stats.get("queued", 0))
    free = 1.0 if places <= 0 else max(0.0, 1.0 - busy / places)
    return f"ready up {max(1, round(100 * free))}%"


class AgentCheck:
    """An HAProxy agent-check responder on ``host:port`` (``port=0``: any free one; see ``port``).

    ``stats`` is the server's ``stats()``; ``draining()`` says whether it is
    shutting down (``mark_draining()`` sets it for good). ``start()`` listens
    and answers in a daemon thread; ``stop()`` closes the socket.
    """

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        draining: Callable[[], bool] | None = None,
    ) -> None:
        if not callable(stats):
            raise TypeError(f"stats must be callable, not {type(stats).__name__}")
        if draining is not None and not callable(draining):
            raise TypeError(f"draining must be callable or None, not {type(draining).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int between 0 and 65535, got {port!r}")
        self._stats = stats
        self._draining_of = draining
        self._drain = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.setblocking(False)
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="prazo-agent-check", daemon=True)
        self._warned = False
        self.answers = 0

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def mark_draining(self) -> None:
        """From now on the answer is ``drain`` (the server is shutting down)."""
        self._drain.set()

    def line(self) -> str:
        """What a connection would be answered now."""
        draining = self._drain.is_set() or (self._draining_of is not None and bool(self._draining_of()))
        try:
            stats = None if draining else self._stats()
        except Exception:  # noqa: BLE001 - a server that cannot count is one to send nothing new
            # A host not serving yet cannot count either: said once, not at every check.
            if not self._warned:
                self._warned = True
                _log.warning("prazo: the agent check cannot read the server's counters (yet); it answers drain")
            stats = None
        return agent_line(stats, draining)

    def start(self) -> AgentCheck:
        self._thread.start()
        return self

    def stop(self) -> None:
        try:
            self._stop_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for sock in (self._listener, self._stop_r, self._stop_w):
            sock.close()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ, "accept")
            selector.register(self._stop_r, selectors.EVENT_READ, "stop")
            while True:
                for key, _ in selector.select():
                    if key.data == "stop":
                        return
                    self._answer_waiting()

    def _answer_waiting(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of descriptors (EMFILE) or a reset before accept: the next check asks again.
                # The listener stays readable, so pause rather than spin on it.
                time.sleep(_BUSY_PAUSE_S)
                return
            with conn:
                try:
                    conn.settimeout(_SEND_TIMEOUT_S)
                    conn.sendall(self.line().encode("ascii") + b"\n")
                    self.answers += 1
                except OSError:
                    pass
