"""Observe-only on the front door: the shadow line, fed with what the engine noted.

With ``observe_only`` the engine's line is a stock server's backlog (FIFO, no
deadline, no policy, no class, ``OBSERVED_STOCK_QUEUE`` long) and refuses
nothing an enforcing front door would have. What the enforcing line would
have decided comes from a ``ShadowLine`` (``prazo.core.shadow``) with the
settings' own limits and policies. The engine notes, under its mutex and in
C, each admission (when the line took it, its deadline and class), each start
(a worker took it: a thread of this process, or a host's worker process the
triage sent it to) and each end (its place came back); ``take()`` hands the
notes to the shadow in the order they were made. The notes are stamped under
the mutex, in order (an admission a few microseconds before it, by the I/O
thread that never waits for Python), so the shadow hears everything in time
order, and decides what is ``OBSERVE_SETTLE_NS`` old.

A one-process front door takes the notes after each request and on
``stats()``; a host's triage on every turn of its loop and on each question
for its figures. Taking them is cheap, and they are the shadow's only input:
when nothing is taken, they wait in the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from prazo.core import AdmissionQueue
from prazo.core.shadow import DECISIONS, OBSERVE_SETTLE_NS, ShadowLine

from ..settings import ServerSettings

__all__ = ["EngineObserver"]

_log = logging.getLogger(__name__)


class EngineObserver:
    """The shadow line of an observing front door or host (``FrontDoorServer.observer``).

    ``places`` is the enforcing line's: a one-process front door's threads, a host's
    workers x threads.
    """

    def __init__(self, engine: Any, settings: ServerSettings, places: int) -> None:
        self._engine = engine
        self.shadow = ShadowLine(
            AdmissionQueue, places, settings.max_queue, settle_ns=OBSERVE_SETTLE_NS, **settings.queue_options()
        )
        self._lock = threading.Lock()

    def take(self) -> None:
        """Hand what the engine noted since the last call to the shadow, in order.

        Never raises: its callers are a worker's request loop and the triage's, and a dry
        run's bookkeeping must not cost a thread or the host (a failure is logged).
        """
        try:
            with self._lock:
                self._take()
        except Exception:  # noqa: BLE001 - see the docstring
            _log.exception("prazo: observe-only could not hand the engine's notes to the shadow line")

    def decisions(self) -> dict[str, int]:
        """What an enforcing line would have decided by now (``DECISIONS``); ``{}`` if that failed (logged).

        A triage's answer to a worker's question for the figures calls it: it never raises either.
        """
        self.take()
        try:
            self.shadow.catch_up(time.monotonic_ns())
            return {name: value for name, value in self.shadow.stats().items() if name in DECISIONS}
        except Exception:  # noqa: BLE001 - see the docstring
            _log.exception("prazo: observe-only could not read the shadow line's decisions")
            return {}

    def _take(self) -> None:
        shadow = self.shadow
        for kind, serial, at_ns, deadline_ns, critical in self._engine.observed():
            if kind == "admitted":
                shadow.arrive(serial, at_ns, deadline_ns, critical, runs_now=False)
            elif kind == "started":
                shadow.started(serial, at_ns)
            else:
                shadow.finished(serial, at_ns)
