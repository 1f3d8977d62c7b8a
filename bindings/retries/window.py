"""``SlidingSums``: running sums over the last window of time, in generations that expire whole.

The window is cut into ``GENERATIONS`` generations of ``window_ns /
GENERATIONS``; an amount added now counts until its generation leaves the
window (exact to one generation), and moving the window clears at most
``GENERATIONS`` slots, so every operation is O(1). The retry budget keeps its
tokens in one (``budget.py``), the adaptive throttle its requests and accepts
in another (``throttle.py``). Not thread-safe: its owner holds a lock.
"""

from __future__ import annotations

__all__ = ["GENERATIONS", "SlidingSums"]

# Generations per window: a window's figures are exact to one generation, and
# moving it costs at most this many slot resets.
GENERATIONS = 10


class SlidingSums:
    """``width`` running sums over the last ``window_ns``; ``sums[i]`` is the window's total of sum ``i``."""

    __slots__ = ("_generation", "_generation_ns", "_slots", "sums")

    def __init__(self, width: int, window_ns: int, now_ns: int) -> None:
        self._generation_ns = max(1, window_ns // GENERATIONS)
        self._slots = [[0] * width for _ in range(GENERATIONS)]
        self.sums = [0] * width
        self._generation = now_ns // self._generation_ns

    def advance(self, now_ns: int) -> list[int]:
        """Move the window to ``now_ns``, expiring what left it; the current generation's slot."""
        generation = now_ns // self._generation_ns
        passed = generation - self._generation
        # A clock that went back (a fake one) keeps the current generation.
        if passed > 0:
            for step in range(1, min(passed, GENERATIONS) + 1):
                slot = self._slots[(self._generation + step) % GENERATIONS]
                for index, amount in enumerate(slot):
                    self.sums[index] -= amount
                    slot[index] = 0
            self._generation = generation
        return self._slots[self._generation % GENERATIONS]

    def add(self, now_ns: int, index: int, amount: int) -> None:
        """Add ``amount`` to sum ``index`` in the generation of ``now_ns``."""
        self.advance(now_ns)[index] += amount
        self.sums[index] += amount
