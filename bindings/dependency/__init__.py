"""prazo.bindings.dependency — the slow-dependency kit (DESIGN.md, failure mode 2).

``Breaker`` is a circuit breaker that opens on slow calls as well as on failed
ones; ``LastKnownGood`` keeps the last successful value per key, with its age,
in a bounded LRU.
"""

from .breaker import Breaker
from .last_known_good import LastKnownGood

__all__ = ["Breaker", "LastKnownGood"]
