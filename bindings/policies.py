"""The queue policies as the bindings take them: option checks, and which requests are critical.

``prazo.core.AdmissionQueue`` takes the policies (``order``,
``codel_target_ms``, ``codel_interval_ms``, ``expected_service_ms``, ``limit``,
``min_concurrency``, ``reserved``) and checks them itself. The bindings pass
them through (``queue_options``), and what they add lives here:

* checks of the values a configuration brings (flags, ``PRAZO_*`` variables,
  ``ServerSettings`` fields) that fail at start-up naming the flag or variable,
  and the ``"pNN"`` / number spelling of ``expected_service_ms`` on a command
  line (``parse_expected_service_ms``);
* ``CriticalClassifier``: which requests belong to the critical class (the
  ``reserved`` slots, served first, evicting a normal waiter from a full line).
  A request is critical when its path is one of ``paths``, when the header
  ``header`` says ``critical`` (case-insensitive), or when ``function(environ)``
  returns true. The header is set by clients: trust it only behind a proxy that
  strips it from outside traffic, or anyone can jump the line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prazo.core import DEFAULT_CODEL_INTERVAL_MS, DEFAULT_CODEL_TARGET_MS
from prazo.core.arguments import checked_ms

from .headers import environ_key, is_ambiguous_header_name

__all__ = [
    "CRITICAL_VALUE",
    "DEFAULT_CODEL_INTERVAL_MS",
    "DEFAULT_CODEL_TARGET_MS",
    "EXPECTED_SERVICE_QUANTILES",
    "LIMITS",
    "ORDERS",
    "POLICY_DEFAULTS",
    "QUEUE_OPTION_NAMES",
    "CriticalClassifier",
    "checked_choice",
    "checked_expected_service_ms",
    "checked_header_name",
    "checked_paths",
    "parse_expected_service_ms",
    "queue_options",
]

_log = logging.getLogger("prazo.policies")


ORDERS = ("fifo", "lifo", "adaptive")
LIMITS = ("fixed", "vegas")
EXPECTED_SERVICE_QUANTILES = ("p50", "p90", "p95", "p99")
#: The header value that makes a request critical (compared case-insensitively).
CRITICAL_VALUE = "critical"
#: The ``AdmissionQueue`` policy keywords every binding passes through when given (besides ``order``).
QUEUE_OPTION_NAMES = (
    "codel_target_ms",
    "codel_interval_ms",
    "expected_service_ms",
    "limit",
    "min_concurrency",
    "reserved",
)
#: Every queue-policy option a server configuration spells out (``ServerSettings``'
#: fields, the front door's options) with ``AdmissionQueue``'s default: a value
#: that differs is a policy in force.
POLICY_DEFAULTS: dict[str, Any] = {
    "order": "fifo",
    "codel_target_ms": DEFAULT_CODEL_TARGET_MS,
    "codel_interval_ms": DEFAULT_CODEL_INTERVAL_MS,
    "expected_service_ms": None,
    "limit": "fixed",
    "min_concurrency": 1,
    "reserved": 0,
    "critical_header": None,
    "critical_paths": (),
}
_TOKEN_RE = re.compile(r"[!#$%&'*+.^`|~0-9A-Za-z-]+", re.ASCII)


def queue_options(**options: Any) -> dict[str, Any]:
    """The policy keywords for ``AdmissionQueue``: those given (not None); the queue checks them.

    ``order`` has a real default (``"fifo"``) and is passed as it is.

    Leaving the others out keeps the queue's own defaults in one place, the
    queue's signature.
    """
    unknown = set(options) - set(QUEUE_OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown queue options: {', '.join(sorted(unknown))}")
    return {name: value for name, value in options.items() if value is not None}


def checked_choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; ``ValueError`` / ``TypeError`` naming ``name``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {', '.join(choices)}; not {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def checked_expected_service_ms(value: object, name: str) -> float | str | None:
    """None, a number of ms > 0, or one of ``EXPECTED_SERVICE_QUANTILES``; errors name ``name``."""
    if value is None or isinstance(value, str):
        return None if value is None else checked_choice(value, name, EXPECTED_SERVICE_QUANTILES)
    return checked_ms(value, name, positive=True)


def parse_expected_service_ms(text: str, name: str) -> float | str:
    """``expected_service_ms`` as a command line or an environment variable spells it: ``"p95"`` or ``"40"``."""
    word = text.strip().lower()
    if word in EXPECTED_SERVICE_QUANTILES:
        return word
    try:
        number = float(word)
    except ValueError:
        raise ValueError(
            f"{name} must be a number of milliseconds > 0 or one of {', '.join(EXPECTED_SERVICE_QUANTILES)}, "
            f"got {text!r}"
        ) from None
    return checked_ms(number, name, positive=True)


def checked_header_name(value: object, name: str) -> str:
    """An HTTP header name a WSGI environ can carry unambiguously (a token without ``_``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a header name (str), not {type(value).__name__}")
    if not _TOKEN_RE.fullmatch(value) or is_ambiguous_header_name(value):
        # An underscore is dropped by the servers (see is_ambiguous_header_name):
        # such a header would never reach the classifier.
        raise ValueError(f"{name} must be an HTTP header name (letters, digits, '-'; no '_'), got {value!r}")
    return value


def checked_paths(value: object, name: str) -> tuple[str, ...]:
    """An iterable of paths starting with ``/`` (not one bare string, which would match "/", "h", ...), as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of path strings, not {type(value).__name__}")
    paths = tuple(value)
    for path in paths:
        if not isinstance(path, str):
            raise TypeError(f"{name} paths must be str, not {type(path).__name__}")
        if not path.startswith("/"):
            raise ValueError(f"{name} paths must start with '/', got {path!r}")
    return paths


class CriticalClassifier:
    """Says whether a request (its WSGI environ) belongs to the critical class.

    Effects: ``classifier(environ)`` is True when ``environ["PATH_INFO"]`` is
    one of ``paths``, or the ``header`` field's value is ``critical``
    (case-insensitive, surrounding spaces and tabs ignored), or ``function(environ)``
    returns true. It never raises: a ``function`` that raises makes the
    request normal, and the exception is logged (logger ``prazo.policies``),
    so a broken classifier can neither answer 500 nor leak a slot.

    >>> classify = CriticalClassifier(header="X-Priority", paths=["/healthz"])
    >>> classify({"PATH_INFO": "/healthz"}), classify({"HTTP_X_PRIORITY": " Critical"}), classify({})
    (True, True, False)
    """

    __slots__ = ("function", "header", "header_key", "paths")

    def __init__(
        self,
        *,
        header: str | None = None,
        paths: Iterable[str] = (),
        function: Callable[[Mapping[str, Any]], object] | None = None,
    ) -> None:
        if function is not None and not callable(function):
            raise TypeError(f"function must be callable, not {type(function).__name__}")
        self.header = None if header is None else checked_header_name(header, "header")
        self.header_key = None if header is None else environ_key(header)
        self.paths = frozenset(checked_paths(paths, "paths"))
        self.function = function

    @classmethod
    def from_option(cls, critical: object, name: str = "critical") -> CriticalClassifier | None:
        """The classifier of the middleware's ``critical=`` option: None, a callable, or a header name."""
        if critical is None:
            return None
        if isinstance(critical, str):
            return cls(header=checked_header_name(critical, name))
        if callable(critical):
            return cls(function=critical)
        raise TypeError(
            f"{name} must be None, a callable(environ) -> bool or a header name, not {type(critical).__name__}"
        )

    def __call__(self, environ: Mapping[str, Any]) -> bool:
        if self.paths and environ.get("PATH_INFO", "") in self.paths:
            return True
        if self.header_key is not None:
            value = environ.get(self.header_key)
            # Only SP and HTAB are the field's optional whitespace (RFC 9110 5.6.3): str.strip()
            # would also take NBSP or \x85 from a latin-1 value, which the front door's C rule keeps.
            if isinstance(value, str) and value.strip(" \t").lower() == CRITICAL_VALUE:
                return True
        if self.function is not None:
            try:
                return bool(self.function(environ))
            except Exception:  # noqa: BLE001 - a broken classifier makes the request normal, never a 500
                _log.exception(
                    "prazo: the critical classifier %r raised; the request is served as normal", self.function
                )
        return False

    def __repr__(self) -> str:
        parts = []
        if self.header is not None:
            parts.append(f"header={self.header!r}")
        if self.paths:
            parts.append(f"paths={sorted(self.paths)!r}")
        if self.function is not None:
            parts.append(f"function={self.function!r}")
        return f"<CriticalClassifier {' '.join(parts)}>"
