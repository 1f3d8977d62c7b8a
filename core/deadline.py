"""Deadlines as absolute points on the monotonic clock, and the current one.

A ``Deadline`` is an integer of nanoseconds on ``time.monotonic_ns()`` (the
same ``CLOCK_MONOTONIC`` the C twin reads), so it never jumps with the wall
clock and crosses freely between the twins. ``deadline_scope`` makes one
current for the code below it through a ``ContextVar`` (so threads, asyncio
tasks and ``contextvars.copy_context()`` each see their own); nested scopes
keep the earlier deadline, because a callee may never extend its caller's.

``Deadline.check()`` is the cooperative cancellation point for long Python
loops: call it once per iteration and the loop stops with
``DeadlineExceeded`` as soon as nobody is waiting for its result any more.
"""

from __future__ import annotations

import math
import time
from contextvars import Context, ContextVar, Token, copy_context
from numbers import Real

from .errors import REASON_DEADLINE_EXCEEDED, DeadlineExceeded

__all__ = [
    "NS_PER_MS",
    "NS_PER_SECOND",
    "Deadline",
    "clock_ns",
    "current_deadline",
    "deadline_context",
    "deadline_scope",
    "deadline_var",
]

NS_PER_SECOND = 1_000_000_000
NS_PER_MS = 1_000_000
# Deadlines live in a signed 64-bit integer in the C twin; refuse anything the
# C side could not hold rather than wrapping around into the past.
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)


def clock_ns(now_ns: int | None) -> int:
    """The clock reading to decide with: ``now_ns`` (a fake clock in tests) or the monotonic clock.

    Shared by every core operation that takes ``now_ns``, with the C twin's
    limits: an int within a signed 64-bit count of nanoseconds.
    """
    if now_ns is None:
        return time.monotonic_ns()
    if type(now_ns) is not int and (isinstance(now_ns, bool) or not isinstance(now_ns, int)):
        raise TypeError(f"now_ns must be an int of monotonic nanoseconds, not {type(now_ns).__name__}")
    if not _INT64_MIN <= now_ns <= _INT64_MAX:
        raise ValueError("now_ns is out of range for a 64-bit monotonic clock")
    return now_ns


def _duration_to_ns(value: object, unit_ns: int, name: str) -> int:
    """Convert a finite real duration (seconds or ms) to integer nanoseconds."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    if isinstance(value, int):
        return value * unit_ns
    as_float = float(value)
    if math.isnan(as_float):
        raise ValueError(f"{name} must not be NaN")
    if math.isinf(as_float):
        raise ValueError(f"{name} must be finite, got {as_float}")
    scaled = as_float * unit_ns
    if not -(2.0**63) <= scaled <= 2.0**63:
        raise ValueError(f"{name} is out of range for a 64-bit monotonic deadline")
    return round(scaled)


def _checked_ns(ns: int, name: str) -> int:
    if not _INT64_MIN <= ns <= _INT64_MAX:
        raise ValueError(f"{name} is out of range for a 64-bit monotonic deadline")
    return ns


class Deadline:
    """An absolute point on the monotonic clock, in integer nanoseconds.

    >>> d = Deadline.after(2.0)        # two seconds from now
    >>> d = Deadline.after_ms(150)     # 150 ms from now
    >>> d.remaining_ms() > 0
    True

    A negative budget is simply a deadline that has already passed. NaN,
    infinities and non-numbers raise ``ValueError``/``TypeError``.
    """

    __slots__ = ("_ns",)

    _ns: int

    def __init__(self, ns: int) -> None:
        if isinstance(ns, bool) or not isinstance(ns, int):
            raise TypeError(f"ns must be an int of monotonic nanoseconds, not {type(ns).__name__}")
        self._ns = _checked_ns(ns, "ns")

    @classmethod
    def after(cls, seconds: float, *, now_ns: int | None = None) -> Deadline:
        """The deadline ``seconds`` from now (or from ``now_ns``)."""
        return cls(_checked_ns(clock_ns(now_ns) + _duration_to_ns(seconds, NS_PER_SECOND, "seconds"), "seconds"))

    @classmethod
    def after_ms(cls, ms: float, *, now_ns: int | None = None) -> Deadline:
        """The deadline ``ms`` milliseconds from now (or from ``now_ns``)."""
        return cls(_checked_ns(clock_ns(now_ns) + _duration_to_ns(ms, NS_PER_MS, "ms"), "ms"))

    @classmethod
    def at_ns(cls, monotonic_ns: int) -> Deadline:
        """The deadline at an absolute ``time.monotonic_ns()`` value."""
        if type(monotonic_ns) is int and _INT64_MIN <= monotonic_ns <= _INT64_MAX:
            # Hot path of every request: skip __init__'s general checks.
            deadline = object.__new__(cls)
            deadline._ns = monotonic_ns
            return deadline
        if isinstance(monotonic_ns, bool) or not isinstance(monotonic_ns, int):
            raise TypeError(f"monotonic_ns must be an int, not {type(monotonic_ns).__name__}")
        return cls(_checked_ns(monotonic_ns, "monotonic_ns"))

    @property
    def ns(self) -> int:
        """The deadline as ``time.monotonic_ns()`` nanoseconds."""
        return self._ns

    def remaining_ns(self, *, now_ns: int | None = None) -> int:
        """Nanoseconds left; negative once the deadline has passed."""
        return self._ns - clock_ns(now_ns)

    def remaining(self, *, now_ns: int | None = None) -> float:
        """Seconds left; negative once the deadline has passed."""
        return (self._ns - clock_ns(now_ns)) / NS_PER_SECOND

    def remaining_ms(self, *, now_ns: int | None = None) -> float:
        """Milliseconds left; negative once the deadline has passed."""
        return (self._ns - clock_ns(now_ns)) / NS_PER_MS

    def expired(self, *, now_ns: int | None = None) -> bool:
        """True once now is at or past the deadline."""
        return clock_ns(now_ns) >= self._ns

    def check(self, *, now_ns: int | None = None) -> None:
        """Raise ``DeadlineExceeded`` if the deadline has passed.

        The cooperative cancellation point: call it inside long loops.
        """
        if clock_ns(now_ns) >= self._ns:
            raise DeadlineExceeded(REASON_DEADLINE_EXCEEDED)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Deadline):
            return self._ns == other._ns
        return NotImplemented

    def __lt__(self, other: Deadline) -> bool:
        if isinstance(other, Deadline):
            return self._ns < other._ns
        return NotImplemented

    def __le__(self, other: Deadline) -> bool:
        if isinstance(other, Deadline):
            return self._ns <= other._ns
        return NotImplemented

    def __gt__(self, other: Deadline) -> bool:
        if isinstance(other, Deadline):
            return self._ns > other._ns
        return NotImplemented

    def __ge__(self, other: Deadline) -> bool:
        if isinstance(other, Deadline):
            return self._ns >= other._ns
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._ns)

    def __repr__(self) -> str:
        return f"Deadline(ns={self._ns}, remaining_ms={self.remaining_ms():.1f})"


_current: ContextVar[Deadline | None] = ContextVar("prazo.deadline", default=None)


def current_deadline() -> Deadline | None:
    """The deadline of the innermost ``deadline_scope``, or None."""
    return _current.get()


def deadline_var() -> ContextVar[Deadline | None]:
    """The ``ContextVar`` behind ``current_deadline()``.

    For compiled code that builds a task's context itself (the C API sets a
    variable in a context without a Python frame); anything else should use
    ``deadline_scope`` or ``deadline_context``, which keep the earlier-wins rule.
    """
    return _current


def _earlier(deadline: Deadline | None, outer: Deadline | None) -> Deadline | None:
    if deadline is None or (outer is not None and outer._ns <= deadline._ns):
        return outer
    return deadline


def deadline_context(deadline: Deadline | None, *, replace: bool = False) -> Context:
    """A copy of the current context in which ``deadline`` is current.

    The same rule as ``deadline_scope`` (the earlier deadline wins), for code
    that runs in pieces, such as a WSGI app and then each chunk of its body::

        ctx = deadline_context(deadline)
        body = ctx.run(app, environ, start_response)
        chunk = ctx.run(next, iterator)

    With ``replace=True`` the copy gets exactly ``deadline`` (None: no
    deadline), even if that is later than the current one: for work handed off
    to run on its own schedule, such as a background task that may outlive
    the request that started it. Cheaper than entering a ``deadline_scope``
    inside ``copy_context().run``.
    """
    if deadline is not None and not isinstance(deadline, Deadline):
        raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")
    ctx = copy_context()
    effective = deadline if replace else _earlier(deadline, _current.get())
    ctx.run(_current.set, effective)
    return ctx


class deadline_scope:
    """Make ``deadline`` current for the block; nested scopes keep the earlier.

    >>> with deadline_scope(Deadline.after(2.0)) as d:
    ...     with deadline_scope(Deadline.after(60.0)) as inner:
    ...         assert inner is d          # a callee cannot extend its caller
    ...         assert current_deadline() is d

    ``deadline_scope(None)`` keeps whatever is current. ``__enter__`` returns
    the effective deadline (which may be None).
    """

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: Deadline | None) -> None:
        if deadline is not None and not isinstance(deadline, Deadline):
            raise TypeError(f"deadline must be a prazo.core.Deadline or None, not {type(deadline).__name__}")
        self._deadline = deadline
        self._token: Token[Deadline | None] | None = None

    def __enter__(self) -> Deadline | None:
        if self._token is not None:
            raise RuntimeError("deadline_scope is not reentrant; create a new one")
        effective = _earlier(self._deadline, _current.get())
        self._token = _current.set(effective)
        return effective

    def __exit__(self, *exc_info: object) -> None:
        token, self._token = self._token, None
        if token is not None:
            _current.reset(token)
