"""prazo.bindings.dependency — the slow-dependency kit (docs/design.md, failure mode 2).

``Dependency`` runs calls to one dependency on its own bounded threads, behind
a bulkhead without a queue, a fixed or adaptive (``AdaptiveTimeout``) timeout,
last-known-good values, hedging of idempotent calls and a breaker;
``DependencyUnavailable`` is its honest 503 and ``current_attempt()`` tells
``fn`` which attempt (and endpoint) it is running as. ``Breaker`` is a circuit
breaker that opens on slow calls as well as on failed ones; ``LastKnownGood``
keeps the last successful value per key, with its age, in a bounded LRU.
"""

from .breaker import Breaker
from .dependency import (
    OUTCOMES,
    REASON_BREAKER_OPEN,
    REASON_BULKHEAD_FULL,
    REASON_DEPENDENCY_TIMEOUT,
    REASON_DEPENDENCY_UNAVAILABLE,
    Attempt,
    CallResult,
    Dependency,
    DependencyUnavailable,
    current_attempt,
)
from .last_known_good import LastKnownGood
from .threads import BoundedThreads
from .timeouts import AdaptiveTimeout

__all__ = [
    "OUTCOMES",
    "REASON_BREAKER_OPEN",
    "REASON_BULKHEAD_FULL",
    "REASON_DEPENDENCY_TIMEOUT",
    "REASON_DEPENDENCY_UNAVAILABLE",
    "AdaptiveTimeout",
    "Attempt",
    "BoundedThreads",
    "Breaker",
    "CallResult",
    "Dependency",
    "DependencyUnavailable",
    "LastKnownGood",
    "current_attempt",
]
