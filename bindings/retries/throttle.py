"""``AdaptiveThrottle``: a caller that backs off by itself when its destination refuses.

A retry budget caps the retries; the first attempts still arrive at full rate
into a service that refuses most of them, and every refusal costs it a
connection, a parse and a write. Client-side adaptive throttling (Google SRE
book, "Handling Overload"; Envoy's ``admission_control``, Finagle's
``NackAdmissionFilter``) lets the caller refuse locally instead, with the
probability

    p = max(0, (requests − K × accepts) / (requests + 1))

over the last ``window_s``: ``requests`` are the attempts the caller made
(those it refused itself included, so a refusing destination drives ``p``
up), ``accepts`` those the destination took. While it accepts everything,
``p`` is 0; when it takes only a share ``a`` of what arrives, the caller sends
about ``K × a`` of its load, so what reaches the destination is about ``K``
times what it can serve (2 by default: a little more than it accepts, so a
recovery is seen at once). ``p`` never exceeds ``max_rejection`` (a
destination that refuses everything still gets a trickle of attempts, which
is how its recovery is seen), and nothing is refused while the window holds
fewer than ``min_requests`` attempts.

Not an accept: a 503 refusal (``X-Prazo-Reason`` or none), gRPC
``UNAVAILABLE``/``RESOURCE_EXHAUSTED``, a refused connection, a connection
reset before any byte of the answer (``failures``: kinds ``overloaded``,
``refused``, ``reset``). Everything else is: a success, an error of the
application, a 504 (the destination took the request and ran out of time).

A refusal raises ``Throttled`` (a ``DownstreamOverloaded``, reason
``throttled-locally``, 503 up the chain) before anything is sent. One
``AdaptiveThrottle`` serves one destination; ``AdaptiveThrottles`` keeps one
per destination (a host, a ``Dependency``'s name), made on first use. A
``RetryPolicy(throttle=...)`` asks it before every attempt, so every outgoing
path that takes ``retry=`` (the client adapters, the gRPC interceptor,
``Dependency``) throttles itself with it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Hashable
from typing import Any

from prazo.core import NS_PER_SECOND, REASON_THROTTLED_LOCALLY, DownstreamOverloaded

from .budget import check_clock
from .destinations import PerDestination
from .window import SlidingSums

__all__ = [
    "DEFAULT_K",
    "DEFAULT_MAX_REJECTION",
    "DEFAULT_MIN_REQUESTS",
    "DEFAULT_WINDOW_S",
    "NOT_ACCEPTED_KINDS",
    "AdaptiveThrottle",
    "AdaptiveThrottles",
    "Throttled",
]

# The SRE book's K: the destination sees about twice what it accepts.
DEFAULT_K = 2.0
# Envoy admission_control's sampling window; the SRE book's is 2 minutes, slower to follow a recovery.
DEFAULT_WINDOW_S = 30.0
DEFAULT_MIN_REQUESTS = 20
# Envoy admission_control's default cap is 80 %; 90 % still lets one attempt in ten probe a dead destination.
DEFAULT_MAX_REJECTION = 0.9
# What an attempt that the destination did not take is, in failures' kinds.
NOT_ACCEPTED_KINDS = frozenset(("overloaded", "refused", "reset"))
_REQUESTS, _ACCEPTS = 0, 1


class Throttled(DownstreamOverloaded):
    """The caller refused an attempt itself: its destination has been refusing (``AdaptiveThrottle``)."""

    def __init__(self, destination: object = None, message: str | None = None) -> None:
        self.destination = destination
        super().__init__(
            REASON_THROTTLED_LOCALLY,
            message or f"throttled locally: {destination!r} has been refusing; the attempt was not sent",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.destination, str(self)))


def _checked_number(value: object, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not low <= value <= high:  # NaN fails this too
        raise ValueError(f"{name} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


class AdaptiveThrottle:
    """Client-side adaptive throttling for one destination (see the module docstring), shared by threads.

    >>> throttle = AdaptiveThrottle(min_requests=0, rng=random.Random(1))
    >>> throttle.rejection_probability()
    0.0

    Args:
        k: how many times what the destination accepts may be sent (> 1; 2 by default).
        window_s: how long an attempt counts (> 0).
        min_requests: attempts the window must hold before anything is refused (≥ 0).
        max_rejection: the largest share refused (0 to 1).
        rng: the ``random.Random`` the draws come from (tests seed one).
        clock: monotonic nanoseconds (tests pass a fake one).
    """

    __slots__ = ("_clock", "_k", "_lock", "_max_rejection", "_min_requests", "_rng", "_stats", "_window", "window_s")

    def __init__(
        self,
        *,
        k: float = DEFAULT_K,
        window_s: float = DEFAULT_WINDOW_S,
        min_requests: int = DEFAULT_MIN_REQUESTS,
        max_rejection: float = DEFAULT_MAX_REJECTION,
        rng: random.Random | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._k = _checked_number(k, "k", 1.0, 1e6)
        if self._k == 1.0:
            raise ValueError("k must be > 1: at 1 the destination gets no more than it accepts, and sees no recovery")
        self.window_s = _checked_number(window_s, "window_s", 1e-3, 86_400.0)
        if isinstance(min_requests, bool) or not isinstance(min_requests, int) or min_requests < 0:
            raise ValueError(f"min_requests must be an int >= 0, got {min_requests!r}")
        self._min_requests = min_requests
        self._max_rejection = _checked_number(max_rejection, "max_rejection", 0.0, 1.0)
        if rng is not None and not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random or None, not {type(rng).__name__}")
        self._rng = random.Random() if rng is None else rng
        self._clock = check_clock(clock)
        self._lock = threading.Lock()
        self._window = SlidingSums(2, round(self.window_s * NS_PER_SECOND), self._clock())
        self._stats = {"requests": 0, "accepts": 0, "throttled": 0}

    @property
    def k(self) -> float:
        return self._k

    def for_destination(self, destination: Hashable) -> AdaptiveThrottle:
        """This throttle, whatever the destination: one shared by everything a policy sends."""
        return self

    def _probability(self, now: int) -> float:
        """``p`` of the window at ``now`` (under the lock)."""
        requests, accepts = self._window.current(now)
        if requests < self._min_requests:
            return 0.0
        return min(self._max_rejection, max(0.0, (requests - self._k * accepts) / (requests + 1)))

    def admit(self) -> bool:
        """Count an attempt and say whether to send it (False: refused here, with probability ``p``)."""
        now = self._clock()
        with self._lock:
            probability = self._probability(now)
            self._window.add(now, _REQUESTS, 1)
            self._stats["requests"] += 1
            if probability > 0.0 and self._rng.random() < probability:
                self._stats["throttled"] += 1
                return False
            return True

    def record(self, accepted: bool) -> None:
        """After an attempt that was sent: whether the destination took it."""
        if not accepted:
            return
        now = self._clock()
        with self._lock:
            self._window.add(now, _ACCEPTS, 1)
            self._stats["accepts"] += 1

    def rejection_probability(self) -> float:
        """``p`` now: the share of attempts this throttle would refuse."""
        now = self._clock()
        with self._lock:
            return self._probability(now)

    def stats(self) -> dict[str, float]:
        """``requests``, ``accepts`` and ``throttled`` since creation, and the ``rejection_probability`` now."""
        probability = self.rejection_probability()
        with self._lock:
            return {**self._stats, "rejection_probability": probability}

    def __repr__(self) -> str:
        return (
            f"AdaptiveThrottle(k={self._k:g}, window_s={self.window_s:g}, min_requests={self._min_requests}, "
            f"max_rejection={self._max_rejection:g})"
        )


class AdaptiveThrottles:
    """One ``AdaptiveThrottle`` per destination, each made on first use with these arguments.

    Keeps the 1024 most recently used destinations; a forgotten one starts
    again with an empty window, as a new destination does.
    """

    def __init__(
        self,
        *,
        k: float = DEFAULT_K,
        window_s: float = DEFAULT_WINDOW_S,
        min_requests: int = DEFAULT_MIN_REQUESTS,
        max_rejection: float = DEFAULT_MAX_REJECTION,
        rng: random.Random | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        # Checked once here, so a bad argument fails at construction, not at the first call.
        arguments: dict[str, Any] = {"k": k, "window_s": window_s, "min_requests": min_requests,
                                     "max_rejection": max_rejection, "rng": rng, "clock": clock}  # fmt: skip
        AdaptiveThrottle(**arguments)
        self._arguments = arguments
        self._throttles = PerDestination(lambda: AdaptiveThrottle(**arguments))

    def for_destination(self, destination: Hashable) -> AdaptiveThrottle:
        """The throttle of ``destination``, made now if it has none yet."""
        return self._throttles.get(destination)

    def stats(self) -> dict[Hashable, dict[str, float]]:
        """Each destination's ``stats()``, least recently used first."""
        return {destination: throttle.stats() for destination, throttle in self._throttles.items()}

    def __repr__(self) -> str:
        shown = {name: value for name, value in self._arguments.items() if name not in ("rng", "clock")}
        return f"AdaptiveThrottles({', '.join(f'{name}={value!r}' for name, value in shown.items())})"
