"""The gRPC metadata both sides read and write: the refusal reason's key and the budget fields.

gRPC metadata keys are lower case; otherwise they are the HTTP headers of
``prazo.bindings.headers``, judged by the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prazo.bindings.headers import BUDGET_HEADER, ENVOY_TIMEOUT_HEADER, GRPC_TIMEOUT_HEADER, REASON_HEADER_NAME

__all__ = ["BUDGET_KEY", "BUDGET_KEYS", "PUSHBACK_KEY", "REASON_METADATA_KEY", "budget_fields"]

# The reason of a refusal rides in the trailers.
REASON_METADATA_KEY = REASON_HEADER_NAME.lower()

# gRPC's Retry-After: the server's pushback, in ms (negative: do not retry).
# prazo's server sends the line's measured wait with an overload refusal.
PUSHBACK_KEY = "grpc-retry-pushback-ms"

# Budget fields a gRPC peer may put in the metadata (grpc-timeout itself is
# consumed by grpc and arrives as the call's deadline).
BUDGET_KEYS = frozenset(name.lower() for name in (BUDGET_HEADER, GRPC_TIMEOUT_HEADER, ENVOY_TIMEOUT_HEADER))
BUDGET_KEY = BUDGET_HEADER.lower()


def budget_fields(metadata: Sequence[tuple[str, Any]] | None) -> dict[str, str] | None:
    """The budget fields of gRPC metadata as HTTP headers, or None when there are none.

    A field sent twice is joined as an HTTP server joins it, so the header
    rules then take its smallest valid element.
    """
    values: dict[str, list[str]] = {}
    for key, value in metadata or ():
        if isinstance(key, str) and key.lower() in BUDGET_KEYS:
            values.setdefault(key.lower(), []).append(str(value))
    return {key: ", ".join(parts) for key, parts in values.items()} or None
