"""``ShadowLine``: the admission line a face would have run, decided beside requests that all run.

Observe-only mode (docs/design.md, "Observe-only: the line that would have
been") serves every request as the stock server would, and needs to know
what an enforcing line would have decided for the same arrivals. This class
is that line, simulated: an ``AdmissionQueue`` with the face's own policies,
driven on the arrivals' own clock through its work-queue face (``put``,
``get_nowait``, ``task_done``, ``expire_overdue``, all with ``now_ns``, none
of which ever waits).

What it is told, per request (``token`` is any hashable the face picks):

* ``arrive(token, arrival_ns, deadline_ns, critical)``: the arrival, at the
  moment the face saw it;
* ``started(token, now_ns)``: when the request really started, for a face
  whose stock queue may hold it (``arrive(..., runs_now=False)``); a face
  that runs it at once does not call it: it started at its arrival;
* ``finished(token, now_ns)``: when it really finished. Its service time,
  finish − start, is what the virtual run takes.

A request the shadow admits starts *virtually* when a virtual place frees
and ends its service time later; a request it refuses (``queue-full``,
expired or doomed at arrival) or drops from its line (expired in line, shed,
evicted) is counted as the enforcing line would have counted it, and its
real run is ignored. The counters are the shadow queue's own (``stats()``).

Exactness: the virtual completion of a request still running for real is
not known yet. It is at least its virtual start plus the time it has really
run so far, so the shadow advances its clock only up to the earliest such
bound; events past it wait (in arrival order) until the real finish says how
long the service was. For a face that runs requests at once (the
middleware), the virtual start is never before the real one, so the bound is
never behind the present and nothing waits. With the same arrivals and
service times, the counters are exactly an enforcing line's
(``tests/core/test_shadow.py`` replays both).
"""

from __future__ import annotations

import heapq
import queue as stdlib_queue
import threading
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from .deadline import Deadline
from .errors import DeadlineExceeded, QueueFull, ShutDown

__all__ = ["DECISIONS", "OBSERVED_STOCK_QUEUE", "OBSERVE_SETTLE_NS", "Arrival", "ShadowLine", "replay_enforcing"]

# The shadow queue's counters that are decisions an enforcing line would have acted on.
DECISIONS = (
    "offered",
    "rejected_full",
    "expired_on_arrival",
    "insufficient_budget",
    "expired_in_queue",
    "shed",
    "evicted",
)

_NEVER = 2**63 - 1

# What the observing faces share. Threads stamp their events before they take the shadow's
# lock, so it decides only what is at least OBSERVE_SETTLE_NS old (a report that lost the race
# for the lock still lands in time order). A face whose stock server queues requests holds them
# in a FIFO line of OBSERVED_STOCK_QUEUE, with no deadline and no policy (a stock server's own
# backlog overflows long before).
OBSERVE_SETTLE_NS = 2_000_000
OBSERVED_STOCK_QUEUE = 65_536


class Arrival(NamedTuple):
    """One request as a replay sees it: when it arrived, its deadline, how long its service took, its class."""

    at_ns: int
    deadline_ns: int
    service_ns: int
    critical: bool = False


def replay_enforcing(queue_class: Any, arrivals: Sequence[Arrival], *args: Any, **kwargs: Any) -> dict[str, int]:
    """The decisions (``DECISIONS``) of an enforcing line that saw ``arrivals``, each service known in advance.

    The line is ``queue_class(*args, **kwargs)`` driven in time order: an
    admitted request starts when a place frees and ends its service time
    later; a waiting one leaves at its effective deadline (deadline less the
    expected service), as a waiter or a pool's reaper does. At one moment:
    completions, then those departures, then arrivals. What a shadow line
    decides, knowing each service time only at its real end, must equal this.
    """
    q = queue_class(*args, on_dropped=lambda item, error: None, **kwargs)
    events: list[tuple[int, int, int, int]] = []  # (time, 0 completion / 1 sweep / 2 arrival, seq, index)
    for index, arrival in enumerate(arrivals):
        heapq.heappush(events, (arrival.at_ns, 2, index, index))
    seq = len(arrivals)
    while events:
        at, kind, _, index = heapq.heappop(events)
        arrival = arrivals[index]
        if kind == 1:
            q.expire_overdue(now_ns=at)
        elif kind == 0:
            q.task_done(critical=arrival.critical, now_ns=at)
        else:
            try:
                q.put(index, Deadline.at_ns(arrival.deadline_ns), critical=arrival.critical, now_ns=at)
            except (QueueFull, DeadlineExceeded, ShutDown):
                pass
            else:
                seq += 1
                expected = int(q.expected_service_ns)
                heapq.heappush(events, (max(at, arrival.deadline_ns - expected), 1, seq, index))
        while True:
            try:
                started = q.get_nowait(now_ns=at)
            except stdlib_queue.Empty:
                break
            seq += 1
            heapq.heappush(events, (at + arrivals[started].service_ns, 0, seq, started))
    stats = q.stats()
    return {name: stats[name] for name in DECISIONS}


class ShadowLine:
    """The line an enforcing face would have run, fed with what really happened (see the module docstring).

    ``queue`` is a fresh ``AdmissionQueue`` (either twin) built with the
    face's own limits and policies and ``on_dropped=ShadowLine.dropped_hook``
    left to this class: pass the class and its arguments, it builds the queue.
    """

    def __init__(self, queue_class: Any, *args: Any, settle_ns: int = 0, **kwargs: Any) -> None:
        if "on_dropped" in kwargs or "on_expired" in kwargs:
            raise TypeError("the shadow line keeps on_dropped and on_expired for itself")
        if isinstance(settle_ns, bool) or not isinstance(settle_ns, int) or settle_ns < 0:
            raise ValueError(f"settle_ns must be an int >= 0, got {settle_ns!r}")
        # Threads stamp their events before they take the lock, so reports may come a little out
        # of order: the shadow decides only what is at least settle_ns old.
        self._settle_ns = settle_ns
        self._queue = queue_class(*args, on_dropped=self._dropped, **kwargs)
        self._lock = threading.Lock()
        self._seq = 0
        # Arrivals not yet decided (the shadow's clock is behind them): (arrival_ns, seq, token, deadline, critical).
        self._arrivals: list[tuple[int, int, Hashable, int, bool]] = []
        # Virtual completions whose time is known: (done_ns, seq, token).
        self._completions: list[tuple[int, int, Hashable]] = []
        self._critical: dict[Hashable, bool] = {}
        self._pending: set[Hashable] = set()  # in _arrivals
        self._real_start: dict[Hashable, int | None] = {}  # None: waiting in the stock queue
        self._service: dict[Hashable, int] = {}  # finished for real, not yet started virtually
        self._virtual_start: dict[Hashable, int] = {}  # started virtually
        self._waiting: set[Hashable] = set()  # in the shadow's line
        self._deadlines: list[tuple[int, int, Hashable]] = []  # (deadline_ns, seq, token) of entries in line
        self._clock = 0  # what the shadow has decided up to
        # What the shadow was told, per token (keep_journal): arrival, deadline, class, real start, real end.
        self._journal: dict[Hashable, list[Any]] | None = None

    def keep_journal(self) -> None:
        """From now on, remember what each request told (``journal()`` then replays it)."""
        with self._lock:
            if self._journal is None:
                self._journal = {}

    def journal(self) -> list[Arrival]:
        """The requests told since ``keep_journal()`` that have ended, as ``replay_enforcing`` takes them.

        The service time is what the shadow used: the real end less the real
        start (the arrival, for a face that runs requests at once).
        """
        with self._lock:
            kept = list((self._journal or {}).values())
        # In the order they were told (a stable sort by time): two arrivals at one moment stay in theirs.
        return sorted(
            (
                Arrival(at, deadline, max(0, end - start), critical)
                for at, deadline, critical, start, end in kept
                if end is not None
            ),
            key=lambda arrival: arrival.at_ns,
        )

    @property
    def queue(self) -> Any:
        """The shadow ``AdmissionQueue`` (its counters are ``stats()``)."""
        return self._queue

    def stats(self) -> dict[str, int]:
        """The decisions the enforcing line would have made so far (``DECISIONS``), and ``undecided`` arrivals."""
        with self._lock:
            snapshot = self._queue.stats()
            undecided = len(self._arrivals)
        return {**{name: snapshot[name] for name in DECISIONS}, "undecided": undecided}

    def arrive(
        self, token: Hashable, arrival_ns: int, deadline_ns: int, critical: bool = False, *, runs_now: bool = True
    ) -> None:
        """A request arrived; it runs for real whatever the shadow decides (at once unless ``runs_now`` is False)."""
        with self._lock:
            self._seq += 1
            heapq.heappush(self._arrivals, (arrival_ns, self._seq, token, deadline_ns, critical))
            self._pending.add(token)
            self._real_start[token] = arrival_ns if runs_now else None
            self._critical[token] = critical
            if self._journal is not None:
                self._journal[token] = [arrival_ns, deadline_ns, critical, arrival_ns, None]
            self._pump(arrival_ns)

    def started(self, token: Hashable, now_ns: int) -> None:
        """The request really started now (after waiting in the stock server's own queue)."""
        with self._lock:
            self._real_start[token] = now_ns
            if self._journal is not None and token in self._journal:
                self._journal[token][3] = now_ns
            self._pump(now_ns)

    def finished(self, token: Hashable, now_ns: int) -> None:
        """The request really finished now: its service time is known."""
        with self._lock:
            start = self._real_start.pop(token, None)
            service = 0 if start is None else max(0, now_ns - start)
            if self._journal is not None and token in self._journal:
                self._journal[token][3:] = [now_ns if start is None else start, now_ns]
            begun = self._virtual_start.pop(token, None)
            if begun is not None:
                self._seq += 1
                heapq.heappush(self._completions, (begun + service, self._seq, token))
            elif token in self._waiting or token in self._pending:
                self._service[token] = service
            else:
                self._critical.pop(token, None)  # refused or dropped: its run changes nothing
            self._pump(now_ns)

    def catch_up(self, now_ns: int) -> None:
        """Decide whatever can be decided by now (``stats()`` then says as much as it can)."""
        with self._lock:
            self._pump(now_ns)

    # -- the simulation (lock held) -------------------------------------------------

    def _bound(self, horizon_ns: int) -> int:
        """The earliest moment a virtual completion not known yet may fall on."""
        bound = _NEVER
        for token, begun in self._virtual_start.items():
            real = self._real_start.get(token)  # None: still in the stock queue, it may run no time at all
            ran = 0 if real is None else max(0, horizon_ns - real)
            bound = min(bound, begun + ran)
        return bound

    def _next_expiry(self) -> int:
        """When the first entry in the shadow's line may no longer start: its deadline less the expected service."""
        while self._deadlines and self._deadlines[0][2] not in self._waiting:
            heapq.heappop(self._deadlines)  # started or dropped since
        if not self._deadlines:
            return _NEVER
        return self._deadlines[0][0] - int(self._queue.expected_service_ns)

    def _pump(self, now_ns: int) -> None:
        horizon = now_ns - self._settle_ns
        while True:
            next_arrival = self._arrivals[0][0] if self._arrivals else _NEVER
            next_completion = self._completions[0][0] if self._completions else _NEVER
            next_expiry = self._next_expiry()
            at = min(next_arrival, next_completion, next_expiry)
            # At one moment: completions, then expiries (a waiter leaves at its deadline), then arrivals.
            # An unknown completion may fall on the bound, so only a known completion may be at it.
            if at == _NEVER or at > horizon:
                return  # past the horizon nothing is known yet
            bound = self._bound(horizon)
            if at > bound or (at == bound and next_completion != at):
                return
            at = max(at, self._clock)
            self._clock = at
            if next_completion <= min(next_arrival, next_expiry):
                _, _, token = heapq.heappop(self._completions)
                self._queue.task_done(critical=self._critical.pop(token, False), now_ns=at)
            elif next_expiry <= next_arrival:
                self._queue.expire_overdue(now_ns=at)
            else:
                _, _, token, deadline_ns, critical = heapq.heappop(self._arrivals)
                self._pending.discard(token)
                try:
                    self._queue.put(token, Deadline.at_ns(deadline_ns), critical=critical, now_ns=at)
                except (QueueFull, DeadlineExceeded, ShutDown):
                    self._forget(token)
                else:
                    self._waiting.add(token)
                    heapq.heappush(self._deadlines, (deadline_ns, self._seq_next(), token))
            self._start_assigned(at)

    def _seq_next(self) -> int:
        self._seq += 1
        return self._seq

    def _start_assigned(self, at: int) -> None:
        """Every entry the shadow handed a place starts virtually now."""
        while True:
            try:
                token = self._queue.get_nowait(now_ns=at)
            except stdlib_queue.Empty:
                return
            self._waiting.discard(token)
            service = self._service.pop(token, None)
            if service is None:
                self._virtual_start[token] = at
            else:
                self._seq += 1
                heapq.heappush(self._completions, (at + service, self._seq, token))

    def _forget(self, token: Hashable) -> None:
        self._waiting.discard(token)
        self._service.pop(token, None)
        self._critical.pop(token, None)

    def _dropped(self, token: Any, error: BaseException) -> None:
        # Called by the shadow queue, under this class's lock (its calls come from _pump).
        self._forget(token)
