"""prazo.bindings.retries — retries that cannot storm: deadline-aware, budgeted, on every outgoing path.

``RetryBudget`` (``budget``) bounds retries to a destination across all its
calls (a share of the calls plus a small floor, expiring after a ttl);
``RetryPolicy`` (``policy``) decides per failed attempt whether to try again
and after how long, within the caller's deadline; ``AdaptiveThrottle``
(``throttle``, ``RetryPolicy(throttle=...)``) makes the caller refuse attempts
itself while the destination refuses them; ``failures`` says what a
failed attempt was; ``retry_after`` reads a ``Retry-After``. The client
adapters (``prazo.bindings.clients``), the gRPC client interceptor and
``Dependency`` take ``retry=RetryPolicy(...)``; see docs/how-to/retries.md.
"""

from .budget import RetryBudget, RetryBudgets
from .failures import Failure, connection_failure, overloaded_failure, response_failure, returned_failure
from .policy import IDEMPOTENT_METHODS, RETRY_COUNTERS, RetryDecision, RetryPolicy, idempotent_request, replayable_body
from .retry_after import retry_after_ms_seconds, retry_after_seconds
from .throttle import AdaptiveThrottle, AdaptiveThrottles, Throttled

__all__ = [
    "IDEMPOTENT_METHODS",
    "RETRY_COUNTERS",
    "AdaptiveThrottle",
    "AdaptiveThrottles",
    "Failure",
    "RetryBudget",
    "RetryBudgets",
    "RetryDecision",
    "RetryPolicy",
    "Throttled",
    "connection_failure",
    "idempotent_request",
    "overloaded_failure",
    "replayable_body",
    "response_failure",
    "retry_after_ms_seconds",
    "retry_after_seconds",
    "returned_failure",
]
