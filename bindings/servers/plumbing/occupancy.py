"""``OccupancyTable``: each worker process's admission occupancy, in memory shared by the host's processes.

A pre-fork server (gunicorn ``-w N``) runs one admission queue per worker
process, and the kernel hands a new connection to whichever worker accepts
first: a worker can refuse a request (503 ``queue-full``) while a sibling has
free places. To see that — and to avoid it — each worker publishes its
occupancy in a table every worker can read:

* the arbiter creates the table *before* forking (an anonymous ``MAP_SHARED``
  mapping, inherited by every child: no file, no name, gone with the last
  process), and gives each new worker a row (``claim``), resetting the rows of
  workers that died;
* a worker writes only its own row (``OccupancyRow.publish``) on every change
  of its queue, and reads the others (``sibling_has_room``) when it is full.

**Why plain stores are enough.** Every field is an aligned 8-byte integer
written with one store, which x86-64 and ARM64 make single-copy atomic: a
reader sees the old or the new value of a field, never a torn one. Each row
has one writer at a time (the arbiter before the fork or after the worker
died, the worker in between; within the worker, a lock orders its threads),
so no update is lost. A reader may see a row half-way through an update
(fields from two nearby moments); every decision read from the table is a
hint re-checked within milliseconds, never a count that must balance. Rows
are 128 bytes, a multiple of the cache line, so two workers never write the
same line.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prazo.core import NS_PER_MS

__all__ = [
    "ROW_BYTES",
    "ROW_FIELDS",
    "STALE_HEARTBEAT_NS",
    "STATE_BOOTING",
    "STATE_FREE",
    "STATE_NAMES",
    "STATE_SERVING",
    "STATE_STOPPING",
    "STATE_YIELDING",
    "OccupancyRow",
    "OccupancyTable",
    "child_alive",
]

ROW_FIELDS = (
    "generation",  # who claimed the row (gunicorn: the worker's age, unique per arbiter); 0 = free
    "pid",
    "state",
    "threads",
    "max_queue",
    "in_flight",  # running or handed to a thread
    "queued",  # waiting in line
    "arriving",  # accepted connections whose request is not yet offered to the queue
    "heartbeat_ns",  # CLOCK_MONOTONIC of the worker's last sign of life (shared by every process)
    "offered",
    "refused_full",  # 503 queue-full
    "refused_sibling_room",  # ... while another serving worker had room
    "yields",  # times the worker stopped accepting because it was full and a sibling had room
)
ROW_BYTES = 128
_WORDS_PER_ROW = ROW_BYTES // 8
assert len(ROW_FIELDS) <= _WORDS_PER_ROW
_F = {name: index for index, name in enumerate(ROW_FIELDS)}

STATE_FREE = 0
STATE_BOOTING = 1
STATE_SERVING = 2  # accepting new connections
STATE_YIELDING = 3  # full, its listeners out of its poller while a sibling has room
STATE_STOPPING = 4
STATE_NAMES = ("free", "booting", "serving", "yielding", "stopping")

# A worker's main loop wakes at least once a second (gthread's poll timeout);
# a row not refreshed for this long belongs to a worker that is hung or dead
# and not yet replaced: its room is not counted on.
STALE_HEARTBEAT_NS = 5_000 * NS_PER_MS


def child_alive(pid: int) -> bool:
    """True when ``pid`` is a live (not zombie) child of this process; where ``/proc`` is missing, when it exists."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # The command name may hold spaces and parentheses: the fields follow the last ")".
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state != "Z" and int(ppid) == os.getpid()


class OccupancyTable:
    """``rows`` rows of ``ROW_FIELDS`` in anonymous shared memory; create it before forking.

    >>> table = OccupancyTable(4)
    >>> row = table.claim(1, threads=2, max_queue=1, live=lambda generation: True)
    >>> row.publish(in_flight=2, queued=1, arriving=0)
    >>> table.snapshot()[0]["in_flight"], table.has_room(row.index)
    (2, False)
    """

    def __init__(self, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int):
            raise TypeError(f"rows must be an int, not {type(rows).__name__}")
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.rows = rows
        # fileno -1: anonymous, and MAP_SHARED by default, so children see the parent's writes and each other's.
        self._map = mmap.mmap(-1, rows * ROW_BYTES)
        self._words = memoryview(self._map).cast("q")

    def _get(self, index: int, field: str) -> int:
        value: int = self._words[index * _WORDS_PER_ROW + _F[field]]
        return value

    def claim(
        self, generation: int, *, threads: int, max_queue: int, live: Callable[[int], bool]
    ) -> OccupancyRow | None:
        """Arbiter side, before the fork: reset the rows whose owner is gone, take a free one (None if none).

        ``live(generation)`` says whether the worker that claimed a row is
        still alive; a dead worker's row is reset here, so its stale figures
        stop counting once the arbiter replaces it.
        """
        if generation < 1:
            raise ValueError(f"generation must be >= 1, got {generation}")
        free = None
        for index in range(self.rows):
            owner = self._get(index, "generation")
            if owner and not live(owner):
                self._reset(index)
                owner = 0
            if not owner and free is None:
                free = index
        if free is None:
            return None
        base = free * _WORDS_PER_ROW
        self._words[base + _F["threads"]] = threads
        self._words[base + _F["max_queue"]] = max_queue
        self._words[base + _F["heartbeat_ns"]] = time.monotonic_ns()
        self._words[base + _F["state"]] = STATE_BOOTING
        self._words[base + _F["generation"]] = generation
        return OccupancyRow(self, free)

    def _reset(self, index: int) -> None:
        base = index * _WORDS_PER_ROW
        for offset in range(_WORDS_PER_ROW):
            self._words[base + offset] = 0

    def has_room(self, index: int, now_ns: int | None = None) -> bool:
        """True when row ``index`` is a serving worker, alive lately, whose line has a free place."""
        base = index * _WORDS_PER_ROW
        w = self._words
        if w[base + _F["state"]] != STATE_SERVING:
            return False
        now = time.monotonic_ns() if now_ns is None else now_ns
        if now - w[base + _F["heartbeat_ns"]] > STALE_HEARTBEAT_NS:
            return False
        committed = w[base + _F["in_flight"]] + w[base + _F["queued"]] + w[base + _F["arriving"]]
        return committed < w[base + _F["threads"]] + w[base + _F["max_queue"]]

    def sibling_has_room(self, index: int, now_ns: int | None = None) -> bool:
        """True when some row other than ``index`` ``has_room``."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        return any(other != index and self.has_room(other, now) for other in range(self.rows))

    def snapshot(self) -> list[dict[str, int | str]]:
        """Every claimed row as a dict of ``ROW_FIELDS`` plus ``row`` and the state's name."""
        rows: list[dict[str, int | str]] = []
        for index in range(self.rows):
            if not self._get(index, "generation"):
                continue
            base = index * _WORDS_PER_ROW
            row: dict[str, int | str] = {"row": index}
            row.update({name: self._words[base + offset] for offset, name in enumerate(ROW_FIELDS)})
            row["state_name"] = STATE_NAMES[int(row["state"])] if 0 <= int(row["state"]) < len(STATE_NAMES) else "?"
            rows.append(row)
        return rows

    def totals(self) -> dict[str, int]:
        """The counters summed over every claimed row, and ``workers`` serving or yielding.

        A stopped or dead worker's row counts until the arbiter resets it (at
        its next spawn of a worker).
        """
        names = ("in_flight", "queued", "arriving", "offered", "refused_full", "refused_sibling_room", "yields")
        total = dict.fromkeys(names, 0)
        total["workers"] = 0
        for row in self.snapshot():
            for name in names:
                total[name] += int(row[name])
            total["workers"] += row["state"] in (STATE_SERVING, STATE_YIELDING)
        return total


class OccupancyRow:
    """One worker's row: written by that worker only (its threads take turns through a lock)."""

    def __init__(self, table: OccupancyTable, index: int) -> None:
        self.table = table
        self.index = index
        self._base = index * _WORDS_PER_ROW
        self.lock = threading.Lock()

    def _set(self, field: str, value: int) -> None:
        self.table._words[self._base + _F[field]] = value

    def get(self, field: str) -> int:
        """The current value of ``field`` (one of ``ROW_FIELDS``)."""
        return self.table._get(self.index, field)

    def booted(self, pid: int) -> None:
        """In the worker, once forked: its pid, and a first heartbeat."""
        self._set("pid", pid)
        self.beat()

    def beat(self, now_ns: int | None = None) -> None:
        """A sign of life (see ``STALE_HEARTBEAT_NS``)."""
        self._set("heartbeat_ns", time.monotonic_ns() if now_ns is None else now_ns)

    def set_state(self, state: int) -> None:
        if state not in (STATE_BOOTING, STATE_SERVING, STATE_YIELDING, STATE_STOPPING):
            raise ValueError(f"state must be one of the worker states, got {state!r}")
        self._set("state", state)

    def publish(self, *, in_flight: int, queued: int, arriving: int) -> None:
        """The worker's current occupancy (call it holding ``lock`` when several threads publish)."""
        self._set("in_flight", in_flight)
        self._set("queued", queued)
        self._set("arriving", arriving)

    def add(self, field: str, amount: int) -> None:
        """Add to one of the row's counters (``offered``, ``refused_full``, ...), holding ``lock``."""
        if field not in ("offered", "refused_full", "refused_sibling_room", "yields"):
            raise ValueError(f"field must be one of the row's counters, got {field!r}")
        self._set(field, self.get(field) + amount)

    def has_room(self) -> bool:
        return self.table.has_room(self.index)

    def sibling_has_room(self) -> bool:
        return self.table.sibling_has_room(self.index)
