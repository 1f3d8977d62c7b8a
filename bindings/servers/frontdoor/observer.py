"""Observe-only on a one-process front door: the shadow line, fed by the engine and the workers.

With ``observe_only`` the engine's line is a stock server's backlog (FIFO, no
deadline, no policy, ``OBSERVED_STOCK_QUEUE`` long) and refuses nothing an
enforcing front door would have. What the enforcing line would have decided
comes from a ``ShadowLine`` (``prazo.core.shadow``) with the settings' own
limits and policies: the C I/O thread notes each admission (serial, when the
line took it, deadline, class) under its mutex, without Python; the workers
hand those notes to the shadow, oldest first, before they tell it that a
request started or finished. One lock keeps the handing over and the telling
in order, so the shadow never hears of an arrival after it decided past it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prazo.core import AdmissionQueue
from prazo.core.shadow import DECISIONS, OBSERVE_SETTLE_NS, ShadowLine

from ..settings import ServerSettings

__all__ = ["EngineObserver"]


class EngineObserver:
    """The shadow line of an observing front door (``FrontDoorServer.observer``)."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self._engine = engine
        self.shadow = ShadowLine(
            AdmissionQueue,
            settings.threads,
            settings.max_queue,
            settle_ns=OBSERVE_SETTLE_NS,
            **settings.queue_options(),
        )
        self._lock = threading.Lock()

    def _take_admissions(self) -> None:
        """Hand the engine's notes to the shadow (lock held)."""
        for serial, at_ns, deadline_ns, critical in self._engine.observed():
            self.shadow.arrive(serial, at_ns, deadline_ns, critical, runs_now=False)

    def started(self, serial: int, now_ns: int) -> None:
        """A worker began the request the engine noted as ``serial``."""
        with self._lock:
            self._take_admissions()
            self.shadow.started(serial, now_ns)

    def finished(self, serial: int, now_ns: int) -> None:
        """That request ended (answered, failed or its client gone): its service time is known."""
        with self._lock:
            self._take_admissions()
            self.shadow.finished(serial, now_ns)

    def decisions(self) -> dict[str, int]:
        """What an enforcing line would have decided by now (``DECISIONS``)."""
        with self._lock:
            self._take_admissions()
            self.shadow.catch_up(time.monotonic_ns())
        return {name: value for name, value in self.shadow.stats().items() if name in DECISIONS}
