"""``SlidingSums``: running sums over the last window of time, in generations that expire whole.

The window is cut into ``GENERATIONS`` generations of ``window_ns /
GENERATIONS``; an amount added now counts until its generation leaves the
window (exact to one generation), and moving the window clears at most
``GENERATIONS`` slots, so every operation is O(1). The retry budget keeps its
tokens in one (``budget.py``), the adaptive throttle its requests and accepts
in another (``throttle.py``). Not thread-safe: its owner holds a lock.

On every call's path (a budget deposit per call, a throttle's admit per
attempt), so the common case, a generation already current, is one
comparison and two additions: the slots are one flat list, and an owner on
the hottest path (the budget) makes that comparison and those additions
itself on ``generation``, ``slots`` and ``sums``, calling ``move`` only when a
generation has passed (a method call costs as much as the rest).
"""

from __future__ import annotations

__all__ = ["GENERATIONS", "SlidingSums"]

# Generations per window: a window's figures are exact to one generation, and
# moving it costs at most this many slot resets.
GENERATIONS = 10


class SlidingSums:
    """``width`` running sums over the last ``window_ns``; ``sums[i]`` is the window's total of sum ``i``."""

    __slots__ = ("generation", "generation_ns", "slots", "sums", "width")

    def __init__(self, width: int, window_ns: int, now_ns: int) -> None:
        self.generation_ns = max(1, window_ns // GENERATIONS)
        self.width = width
        # Generation g's sum i is slots[(g % GENERATIONS) * width + i].
        self.slots = [0] * (GENERATIONS * width)
        self.sums = [0] * width
        self.generation = now_ns // self.generation_ns

    def move(self, generation: int) -> None:
        """Move the window to ``generation``, expiring what left it (a clock that went back keeps it)."""
        passed = generation - self.generation
        if passed <= 0:
            return
        width, slots, sums = self.width, self.slots, self.sums
        for step in range(1, min(passed, GENERATIONS) + 1):
            base = ((self.generation + step) % GENERATIONS) * width
            for index in range(width):
                sums[index] -= slots[base + index]
                slots[base + index] = 0
        self.generation = generation

    def current(self, now_ns: int) -> list[int]:
        """The window's sums at ``now_ns`` (the list itself: read it under the owner's lock)."""
        generation = now_ns // self.generation_ns
        if generation != self.generation:
            self.move(generation)
        return self.sums

    def add(self, now_ns: int, index: int, amount: int) -> None:
        """Add ``amount`` to sum ``index`` in the generation of ``now_ns``."""
        generation = now_ns // self.generation_ns
        if generation != self.generation:
            self.move(generation)
        self.slots[(generation % GENERATIONS) * self.width + index] += amount
        self.sums[index] += amount
