"""The last successful value per key, with its age, in a bounded LRU.

When a dependency times out, fails, or is refused by its bulkhead or an open
breaker, an answer it gave earlier is often better than none — if it is young
enough *for that data*. ``put`` keeps the most recent success per key with the
time it arrived; ``get(key, max_age_s)`` returns ``(value, age_s)`` or None,
and the age limit is the reader's: the same store can serve recommendations
ten minutes old and refuse an exchange rate older than thirty seconds, and a
critical dependency simply never asks. So an entry is never dropped for its
age — stale values are kept precisely for when the dependency is down, which
can last longer than any one reader's limit. Only the size is bounded: past
``max_entries`` the least recently used key (by ``put`` or a successful
``get``) goes.

Why not a library: ``cachetools.TTLCache`` and ``TLRUCache`` fix an item's
expiry when it is inserted (one TTL per cache, or a ``ttu(key, value, now)``
computed at insertion) and make an expired item inaccessible and then remove
it, and neither says how old a value is; ``functools.lru_cache`` memoizes a
function and has no timestamps. Here the age is part of the answer, the limit
is asked per read, and the core must keep no dependencies.

Thread safety: one lock around O(1) dict work. The values themselves are
released after it (an overwritten or evicted value's ``__del__`` never runs
under the lock). Keys are hashed and compared by the dict as usual.

Example::

    lkg = LastKnownGood(max_entries=10_000)
    lkg.put(("recs", user_id), recommendations)
    ...
    hit = lkg.get(("recs", user_id), max_age_s=600)
    if hit is not None:
        value, age_s = hit
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from prazo.core.deadline import NS_PER_SECOND, clock_ns

from ._arguments import check_clock, check_count, check_duration_ns

__all__ = ["LastKnownGood"]


def _check_key(key: object) -> None:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable, not {type(key).__name__}") from None


class LastKnownGood:
    """A thread-safe LRU of ``key -> (value, stored at)`` that never holds more than ``max_entries``.

    Args:
        max_entries: the bound (an int ≥ 1); the least recently used key is evicted beyond it.
        clock: a callable returning monotonic nanoseconds; default ``time.monotonic_ns``.
    """

    def __init__(self, max_entries: int = 1024, *, clock: Callable[[], int] | None = None) -> None:
        self._max_entries = check_count(max_entries, "max_entries")
        self._clock = check_clock(clock) or time.monotonic_ns
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._evictions = 0
        self._hits = 0
        self._misses = 0
        self._too_old = 0

    @property
    def max_entries(self) -> int:
        return self._max_entries

    def _now(self, now_ns: int | None) -> int:
        return self._clock() if now_ns is None else clock_ns(now_ns)

    def put(self, key: Hashable, value: Any, now_ns: int | None = None) -> None:
        """Remember ``value`` as the most recent success for ``key``, stored now (or at ``now_ns``)."""
        _check_key(key)
        now = self._now(now_ns)
        with self._lock:
            entries = self._entries
            replaced = entries.pop(key, None)
            entries[key] = (value, now)
            evicted = entries.popitem(last=False) if len(entries) > self._max_entries else None
            if evicted is not None:
                self._evictions += 1
        # The references dropped here, outside the lock, may be the last ones.
        del replaced, evicted

    def get(self, key: Hashable, max_age_s: float, now_ns: int | None = None) -> tuple[Any, float] | None:
        """``(value, age_s)`` for ``key`` if stored at most ``max_age_s`` ago, else None.

        ``max_age_s`` may be ``math.inf`` (any age); NaN or negative raises
        ``ValueError``. A value too old for this reader stays for the next,
        who may accept more.
        """
        _check_key(key)
        max_age_ns = check_duration_ns(max_age_s, "max_age_s", NS_PER_SECOND, allow_zero=True, allow_inf=True)
        now = self._now(now_ns)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            age_ns = now - entry[1]
            if age_ns > max_age_ns:
                self._too_old += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
        return entry[0], max(age_ns, 0) / NS_PER_SECOND

    def clear(self) -> None:
        """Forget every entry (the counters in ``stats()`` are kept)."""
        with self._lock:
            dropped, self._entries = self._entries, OrderedDict()
        del dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict[str, int]:
        """entries, max_entries, and totals: evictions, hits, misses, too_old."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "max_entries": self._max_entries,
                "evictions": self._evictions,
                "hits": self._hits,
                "misses": self._misses,
                "too_old": self._too_old,
            }

    def __repr__(self) -> str:
        return f"<LastKnownGood {len(self)}/{self._max_entries} entries>"
