"""``DeadlineReaper``: refuse a waiting item at its own deadline, not when it reaches the head.

The admission queue expires an item when it reaches the head of the line; a
waiter of the gate face also wakes at its own deadline. The work-queue face
has no waiter of its own, so an owner of that face (``AdmissionPool``, the
servers' ``AdmissionDispatcher``) runs one reaper thread that sleeps until the
earliest deadline in line and then asks the queue to expire what is overdue.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Protocol

from prazo.core import NS_PER_SECOND, AdmissionQueue

__all__ = ["Claimable", "DeadlineReaper"]

# The reaper sweeps the line at most once per this many ns, so thousands of
# items with distinct deadlines cost a bounded number of O(queued) sweeps.
_SWEEP_MIN_INTERVAL_NS = 1_000_000


class Claimable(Protocol):
    """An item in line: ``claimed`` is True once it left the line (its entry is then dropped)."""

    claimed: bool


class DeadlineReaper:
    """Expires waiting items at their own deadline: one thread that sleeps until the earliest one.

    Effects: ``watch_locked(deadline_ns, item)`` (called with ``cond`` held,
    the lock of the line's owner) remembers that ``item`` waits until
    ``deadline_ns``; once a deadline passes and its item is still unclaimed,
    the thread calls ``q.expire_overdue()``, which hands every overdue item to
    the queue's ``on_dropped`` (or ``on_expired``); with the queue's
    doomed-work skip on, it also looks at the item's effective deadline. An item sets ``claimed`` once it left the
    line (started, refused, cancelled). ``stop()`` ends the thread once
    nothing is watched; ``wake()`` makes it look again now.

    Entries of items that already left the line are dropped lazily, and the
    heap is compacted when it grows well beyond the line, so it stays
    O(queued) on average.

    Items that share a deadline (a request fanning out, a ``map`` batch) share
    one entry: when an item arrives with the deadline of the last entry while
    that entry is still in the heap (and the queue has no doomed-work skip,
    whose effective deadlines could differ), the entry is marked *shared*
    instead of adding another. A shared entry is kept until its deadline even
    if its own item left the line, and then the line is swept, so every
    follower is still expired at that deadline. An owner may skip the call
    altogether while ``last_ns`` equals the item's deadline and
    ``last_shared`` is true (the compiled pool does): that is exactly the case
    in which the call would do nothing.
    """

    def __init__(self, q: AdmissionQueue, cond: threading.Condition, thread_name: str) -> None:
        self._queue = q
        self._cond = cond
        self._thread_name = thread_name
        self._heap: list[tuple[int, int, Claimable]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # The deadline of the last entry pushed while it is in the heap, else -1.
        self.last_ns = -1
        self.last_shared = False
        self._last_seq = -1
        # Sequence numbers of shared entries still in the heap.
        self._shared: set[int] = set()

    def watch_locked(self, deadline_ns: int, item: Claimable) -> None:
        expected_ns = self._queue.expected_service_ns
        if deadline_ns == self.last_ns and expected_ns <= 0:
            if not self.last_shared:
                self.last_shared = True
                self._shared.add(self._last_seq)
            return
        seq = next(self._seq)
        heapq.heappush(self._heap, (deadline_ns, seq, item))
        self.last_ns, self.last_shared, self._last_seq = deadline_ns, False, seq
        # With the doomed-work skip the queue drops an item at its effective
        # deadline (deadline - expected service time): look then too. The
        # estimate may move before then, so the deadline itself stays watched.
        if expected_ns > 0:
            self.last_ns = -1
            heapq.heappush(self._heap, (deadline_ns - expected_ns, next(self._seq), item))
        if len(self._heap) > 2 * self._queue.qsize() + 1024:
            self._prune_claimed_locked()
        if self._thread is None:
            self._thread = threading.Thread(name=self._thread_name, target=self._run, daemon=True)
            self._thread.start()
        elif self._heap and self._heap[0][2] is item:
            self._cond.notify()

    def stop_locked(self) -> None:
        self._stopping = True
        self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self.stop_locked()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self.wake()
            thread.join()

    def _run(self) -> None:
        last_sweep_ns = -_SWEEP_MIN_INTERVAL_NS
        sweep_pending = False
        with self._cond:
            while True:
                now = time.monotonic_ns()
                if self._stopping:
                    self._prune_claimed_locked()
                while self._heap and (self._heap[0][0] <= now or self._droppable(self._heap[0])):
                    # No local name for the item: it would stay alive while this thread sleeps.
                    _, seq, claimable = heapq.heappop(self._heap)
                    if not claimable.claimed or seq in self._shared:
                        sweep_pending = True
                    self._forget(seq)
                    del claimable
                if sweep_pending:
                    if now - last_sweep_ns >= _SWEEP_MIN_INTERVAL_NS:
                        sweep_pending = False
                        last_sweep_ns = now
                        self._cond.release()
                        try:
                            self._queue.expire_overdue()
                        finally:
                            self._cond.acquire()
                        continue
                    wake_ns = last_sweep_ns + _SWEEP_MIN_INTERVAL_NS
                elif self._heap:
                    wake_ns = max(self._heap[0][0], last_sweep_ns + _SWEEP_MIN_INTERVAL_NS)
                elif self._stopping:
                    return
                else:
                    self._cond.wait()
                    continue
                self._cond.wait((wake_ns - now) / NS_PER_SECOND)

    def _droppable(self, entry: tuple[int, int, Claimable]) -> bool:
        """An entry that may leave before its deadline: its item left the line, and no other item shares it
        (or nothing waits in line at all, so no item that shared it can still be waiting)."""
        return entry[2].claimed and (entry[1] not in self._shared or not self._queue.qsize())

    def _forget(self, seq: int) -> None:
        """An entry left the heap."""
        self._shared.discard(seq)
        if seq == self._last_seq:
            self.last_ns, self.last_shared, self._last_seq = -1, False, -1

    def _prune_claimed_locked(self) -> None:
        kept = []
        for entry in self._heap:
            if self._droppable(entry):
                self._forget(entry[1])
            else:
                kept.append(entry)
        self._heap = kept
        heapq.heapify(self._heap)
