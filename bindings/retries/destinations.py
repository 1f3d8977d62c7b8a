"""``PerDestination``: one object per destination, made on first use, the most recently used kept.

The retry budgets (``RetryBudgets``) and the adaptive throttles
(``AdaptiveThrottles``) each keep one of theirs per destination (a host, a
``Dependency``'s name) this way: a forgotten destination starts again as a new
one does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["MAX_DESTINATIONS", "PerDestination"]

T = TypeVar("T")
# Destinations kept before the least recently used is forgotten.
MAX_DESTINATIONS = 1024


class PerDestination(Generic[T]):
    """``get(destination)``: its object, made by ``make()`` the first time; thread-safe."""

    __slots__ = ("_lock", "_made", "_make")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made: dict[Hashable, T] = {}
        self._lock = threading.Lock()

    def get(self, destination: Hashable) -> T:
        with self._lock:
            made = self._made.pop(destination, None)
            if made is None:
                made = self._make()
                if len(self._made) >= MAX_DESTINATIONS:
                    del self._made[next(iter(self._made))]
            self._made[destination] = made  # re-inserted: the dict's order is the LRU order
            return made

    def items(self) -> list[tuple[Hashable, T]]:
        """Every destination and its object, least recently used first."""
        with self._lock:
            return list(self._made.items())
