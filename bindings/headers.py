"""Every wire format of a time budget, in one place.

A budget crosses a hop as a *relative* duration, so no clock synchronisation
is needed: the receiver turns it into an absolute ``Deadline`` on its own
monotonic clock at the moment the request arrives. Three incoming headers are
understood:

=====================================  =======================================
``X-Request-Budget-Ms: 1500``          prazo's own: integer or decimal ms
``grpc-timeout: 1500m``                gRPC: 1–8 ASCII digits and one unit of
                                       ``H M S m u n``
``x-envoy-expected-rq-timeout-ms``     Envoy: integer ms
=====================================  =======================================

When several are present the smallest valid one wins, and so does the
smallest valid element of a header sent more than once (joined with commas,
as HTTP and WSGI join repeated fields). A value that does not
parse (text, NaN, inf, empty, a unit where none is allowed, too many digits,
stray characters, non-ASCII digits) is ignored and counted as invalid; it can
never extend a deadline. A value ``<= 0`` is valid and means "no time left".
Leading and trailing spaces/tabs are stripped, as HTTP allows around a field
value; any other whitespace makes the value invalid.

The server side applies a ``BudgetPolicy``::

    policy = BudgetPolicy(default_budget_ms=1000, max_budget_ms=30000)
    deadline, incoming = policy.deadline_for(environ, time.monotonic_ns())

A client may shorten its deadline, never extend the server's policy: the
deadline is ``arrival + min(incoming or default, max_budget_ms)``.

The outgoing side formats what is left, always rounding *down* so a hop never
passes on more time than it has::

    outgoing_headers_for(1234.9)              # {'X-Request-Budget-Ms': '1234'}
    outgoing_headers_for(1234.9, grpc=True)   # ... and 'grpc-timeout': '1234900u'
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any, NamedTuple

from prazo.core import NS_PER_MS, Deadline
from prazo.core.arguments import MAX_MS, checked_ms

__all__ = [
    "BUDGET_ENVIRON_KEY",
    "BUDGET_HEADER",
    "DEFAULT_BUDGET_MS",
    "ENVOY_TIMEOUT_ENVIRON_KEY",
    "ENVOY_TIMEOUT_HEADER",
    "GRPC_TIMEOUT_ENVIRON_KEY",
    "GRPC_TIMEOUT_HEADER",
    "MAX_WIRE_MS",
    "REASON_HEADER_NAME",
    "RETRY_AFTER_MS_HEADER_NAME",
    "BudgetPolicy",
    "IncomingBudget",
    "budget_from_environ",
    "budget_from_headers",
    "budget_limits",
    "environ_key",
    "format_budget_ms",
    "format_grpc_timeout",
    "is_ambiguous_header_name",
    "outgoing_headers_for",
    "parse_budget_ms",
    "parse_envoy_timeout_ms",
    "parse_grpc_timeout",
]

BUDGET_HEADER = "X-Request-Budget-Ms"
GRPC_TIMEOUT_HEADER = "grpc-timeout"
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
# Names the cause of a 503/504 produced by prazo (queue-full, expired-in-queue, ...).
REASON_HEADER_NAME = "X-Prazo-Reason"
# Beside an overload 503's Retry-After (whole seconds, as HTTP has them): the
# same measured wait in ms, which prazo's own callers prefer.
RETRY_AFTER_MS_HEADER_NAME = "X-Prazo-Retry-After-Ms"


def environ_key(header: str) -> str:
    """The WSGI environ key (CGI style) under which a request header arrives."""
    return "HTTP_" + header.upper().replace("-", "_")


def is_ambiguous_header_name(name: str) -> bool:
    """True for a header name prazo's server embeddings drop: one containing an underscore.

    ``X_Request_Budget_Ms`` and ``X-Request-Budget-Ms`` both become
    ``HTTP_X_REQUEST_BUDGET_MS``, so a client (or a proxy passing names it
    does not understand) could slip a value past a proxy that checks only the
    dash spelling. waitress, werkzeug, gunicorn (``header_map="drop"``) and
    nginx drop such names; prazo applies the same rule wherever it maps
    headers itself, so every embedding sees the same request.
    """
    return "_" in name


BUDGET_ENVIRON_KEY = environ_key(BUDGET_HEADER)  # HTTP_X_REQUEST_BUDGET_MS
GRPC_TIMEOUT_ENVIRON_KEY = environ_key(GRPC_TIMEOUT_HEADER)  # HTTP_GRPC_TIMEOUT
ENVOY_TIMEOUT_ENVIRON_KEY = environ_key(ENVOY_TIMEOUT_HEADER)  # HTTP_X_ENVOY_EXPECTED_RQ_TIMEOUT_MS

# The largest budget X-Request-Budget-Ms and the Envoy header accept: what a
# signed 64-bit count of nanoseconds can hold (about 292 years). Anything beyond
# is "overflow" and invalid rather than silently clamped, because a sender
# producing it is broken. grpc-timeout has its own grammar, whose largest value
# (99999999H, about 11 400 years) is above this bound and is taken as it is:
# like any budget, it is capped at the policy's max_budget_ms.
_INT64_MAX = 2**63 - 1
MAX_WIRE_MS = MAX_MS

# The same bound as a float (exact: it is below 2**53), so the range check of
# a parsed value compares two floats.
_MAX_WIRE_MS_FLOAT = float(MAX_WIRE_MS)

# Generous for any honest value (MAX_WIRE_MS has 13 digits); refusing longer
# strings up front keeps parsing O(1) whatever a client sends.
_MAX_VALUE_CHARS = 40

# re.ASCII and explicit [0-9] so Unicode digits ("١٢٣") never match;
# fullmatch so a trailing newline is not accepted the way "$" would.
_BUDGET_MS_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?", re.ASCII)
_GRPC_TIMEOUT_RE = re.compile(r"([0-9]{1,8})([HMSmun])", re.ASCII)
_HTTP_OWS = " \t"

# gRPC units as (numerator, denominator) of milliseconds, so parsing is one
# exact integer operation and one correctly rounded division.
_GRPC_UNIT_MS: dict[str, tuple[int, int]] = {
    "H": (3_600_000, 1),
    "M": (60_000, 1),
    "S": (1_000, 1),
    "m": (1, 1),
    "u": (1, 1_000),
    "n": (1, 1_000_000),
}
# Most precise first: formatting picks the first unit whose count fits.
_GRPC_UNIT_NS: tuple[tuple[str, int], ...] = (
    ("n", 1),
    ("u", 1_000),
    ("m", 1_000_000),
    ("S", 1_000_000_000),
    ("M", 60_000_000_000),
    ("H", 3_600_000_000_000),
)
_GRPC_MAX_DIGITS_VALUE = 99_999_999


def _field_value(value: str) -> str | None:
    if not isinstance(value, str) or len(value) > _MAX_VALUE_CHARS:
        return None
    return value.strip(_HTTP_OWS)


def _ascii_digits(text: str) -> bool:
    """True for one or more ASCII digits: ``[0-9]+``, without a regex (isdigit alone takes "١٢٣")."""
    return text.isascii() and text.isdigit()


def _within_wire_range(ms: float) -> float | None:
    return ms if -_MAX_WIRE_MS_FLOAT <= ms <= _MAX_WIRE_MS_FLOAT else None


def parse_budget_ms(value: str) -> float | None:
    """Parse ``X-Request-Budget-Ms``: integer or decimal ms, optionally negative.

    Returns the budget in ms, or None when the value is invalid. Never raises.

    >>> parse_budget_ms("250"), parse_budget_ms("12.5"), parse_budget_ms("-3")
    (250.0, 12.5, -3.0)
    >>> parse_budget_ms("1e3") is None and parse_budget_ms("250ms") is None
    True
    """
    text = _field_value(value)
    if text is None:
        return None
    if _ascii_digits(text):
        # Whole milliseconds, what prazo itself sends: no regex, and int()
        # parses digits faster than float() does (same correctly rounded value).
        return _within_wire_range(float(int(text)))
    if _BUDGET_MS_RE.fullmatch(text) is None:
        return None
    return _within_wire_range(float(text))


def parse_envoy_timeout_ms(value: str) -> float | None:
    """Parse ``x-envoy-expected-rq-timeout-ms``: a non-negative integer of ms.

    Returns the budget in ms, or None when the value is invalid. Never raises.
    """
    text = _field_value(value)
    if text is None or not _ascii_digits(text):
        return None
    return _within_wire_range(float(int(text)))


def parse_grpc_timeout(value: str) -> float | None:
    """Parse ``grpc-timeout`` (1–8 ASCII digits, then one of ``H M S m u n``).

    Returns the budget in ms, or None when the value is invalid. Never raises.

    >>> parse_grpc_timeout("2S"), parse_grpc_timeout("1500u")
    (2000.0, 1.5)
    """
    text = _field_value(value)
    if text is None:
        return None
    match = _GRPC_TIMEOUT_RE.fullmatch(text)
    if match is None:
        return None
    numerator, denominator = _GRPC_UNIT_MS[match.group(2)]
    return int(match.group(1)) * numerator / denominator


class IncomingBudget(NamedTuple):
    """What the request headers said about the caller's budget.

    ``budget_ms`` is the smallest valid value among the headers present (None
    when none was valid), ``invalid`` how many present headers did not parse,
    and ``source`` the name of the header that won (None when none did).
    """

    budget_ms: float | None
    invalid: int
    source: str | None


class _IncomingHeader(NamedTuple):
    name: str
    lower_name: str
    environ_key: str
    parse: Callable[[str], float | None]


# The single table both lookups walk; they differ only in the key they use.
_INCOMING: tuple[_IncomingHeader, ...] = tuple(
    _IncomingHeader(name, name.lower(), environ_key(name), parse)
    for name, parse in (
        (BUDGET_HEADER, parse_budget_ms),
        (GRPC_TIMEOUT_HEADER, parse_grpc_timeout),
        (ENVOY_TIMEOUT_HEADER, parse_envoy_timeout_ms),
    )
)
_NO_BUDGET = IncomingBudget(None, 0, None)
_ENVIRON_KEYS = tuple(header.environ_key for header in _INCOMING)
# The same three keys one by one, for deadline_for's check without a budget header.
_ENVIRON_KEY_1, _ENVIRON_KEY_2, _ENVIRON_KEY_3 = _ENVIRON_KEYS
_LOWER_NAMES = tuple(header.lower_name for header in _INCOMING)


def _incoming_budget(mapping: Mapping[str, Any], keys: tuple[str, ...]) -> IncomingBudget:
    """Judge the values ``mapping`` holds under ``keys`` (one per ``_INCOMING`` header)."""
    # The common case (no budget header at all) runs on every request: three
    # plain lookups cost half of ``keys().isdisjoint``. The unpacking fails
    # loudly if the table ever gets a fourth wire format.
    first, second, third = keys
    if first not in mapping and second not in mapping and third not in mapping:
        return _NO_BUDGET
    best: float | None = None
    source: str | None = None
    invalid = 0
    for header, key in zip(_INCOMING, keys):
        raw = mapping.get(key)
        if raw is None:
            continue
        ms, bad = _parse_field(header.parse, raw)
        invalid += bad
        if ms is not None and (best is None or ms < best):
            best, source = ms, header.name
    return IncomingBudget(best, invalid, source)


def _parse_field(parse: Callable[[str], float | None], raw: object) -> tuple[float | None, int]:
    """Judge one header's value: ``(smallest valid budget or None, 1 if any part was invalid)``.

    A header sent twice arrives joined with commas (by the WSGI server, or by
    ``budget_from_headers``). Its smallest valid element still bounds the
    budget: falling back to the default would let a duplicate *extend* the
    caller's deadline.
    """
    if not isinstance(raw, str):
        return None, 1
    if "," not in raw:
        ms = parse(raw)
        return ms, ms is None
    parsed = [parse(element) for element in raw.split(",")]
    valid = [ms for ms in parsed if ms is not None]
    return (min(valid) if valid else None), len(valid) < len(parsed)


def budget_from_environ(environ: Mapping[str, Any]) -> IncomingBudget:
    """Read the incoming budget from a WSGI environ."""
    return _incoming_budget(environ, _ENVIRON_KEYS)


def budget_from_headers(headers: Mapping[str, Any]) -> IncomingBudget:
    """Read the incoming budget from a mapping of header name to value.

    Names match case-insensitively whatever the mapping (a plain ``dict``,
    ``http.client.HTTPMessage``, werkzeug ``Headers``, ...). A header present
    several times is joined with ``", "``, as a WSGI server would join it, so
    both lookups see the same value (its smallest valid element counts).
    """
    folded: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str):
            continue
        key = name.lower()
        folded[key] = f"{folded[key]}, {value}" if key in folded else value
    return _incoming_budget(folded, _LOWER_NAMES)


# The budget of a request that says none, where a server or middleware is not told another.
DEFAULT_BUDGET_MS = 1000.0


def budget_limits(
    default_budget_ms: float | None,
    max_budget_ms: float,
    names: tuple[str, str] = ("default_budget_ms", "max_budget_ms"),
) -> tuple[float, float]:
    """The default and the maximum budget of a server or middleware, checked (``checked_ms``, > 0).

    A default not given (None) is ``DEFAULT_BUDGET_MS``, or the maximum when
    that is lower. A default given above the maximum raises ``ValueError``
    naming both (``names``): every budget is capped at the maximum, so that
    default could never be granted and one of the two is a mistake.

    >>> budget_limits(None, 300)
    (300.0, 300.0)
    >>> budget_limits(100, 10)
    Traceback (most recent call last):
    ...
    ValueError: default_budget_ms must be <= max_budget_ms, got 100 > 10
    """
    default_name, max_name = names
    max_ms = checked_ms(max_budget_ms, max_name, positive=True)
    if default_budget_ms is None:
        return min(DEFAULT_BUDGET_MS, max_ms), max_ms
    default_ms = checked_ms(default_budget_ms, default_name, positive=True)
    if default_ms > max_ms:
        raise ValueError(f"{default_name} must be <= {max_name}, got {default_ms:g} > {max_ms:g}")
    return default_ms, max_ms


class BudgetPolicy:
    """Turns a request's headers into its deadline, within the server's limits.

    Effects: the deadline is ``arrival + min(budget, max_budget_ms)`` where
    ``budget`` is the smallest valid incoming header, or ``default_budget_ms``
    when none is valid (so a default above the maximum is capped too). An
    incoming budget ``<= 0`` gives a deadline that has already passed; an
    invalid header is ignored (and counted), so it can never extend the
    deadline.

    >>> policy = BudgetPolicy(default_budget_ms=1000, max_budget_ms=30000)
    >>> env = {"HTTP_X_REQUEST_BUDGET_MS": "250"}
    >>> deadline, incoming = policy.deadline_for(env, arrival_ns=0)
    >>> deadline.ns, incoming.source
    (250000000, 'X-Request-Budget-Ms')

    Subclasses may override ``upstream_queue_ns`` to count time the request
    already spent queued in front of this process (for example behind a
    proxy that stamps ``X-Request-Start``).
    """

    __slots__ = ("_default_budget_ms", "_default_budget_ns", "_has_upstream_hook", "_max_budget_ms")

    def __init__(self, default_budget_ms: float = 1000, max_budget_ms: float = 30000) -> None:
        self._default_budget_ms = checked_ms(default_budget_ms, "default_budget_ms", positive=True)
        self._max_budget_ms = checked_ms(max_budget_ms, "max_budget_ms", positive=True)
        # Per-request work is on every request's path: precompute the common
        # case (no header) and skip the hook unless a subclass provides one.
        self._default_budget_ns = int(self.budget_ms_for(_NO_BUDGET) * NS_PER_MS)
        self._has_upstream_hook = type(self).upstream_queue_ns is not BudgetPolicy.upstream_queue_ns

    @property
    def default_budget_ms(self) -> float:
        return self._default_budget_ms

    @property
    def max_budget_ms(self) -> float:
        return self._max_budget_ms

    def upstream_queue_ns(self, environ: Mapping[str, Any], arrival_ns: int) -> int:
        """Nanoseconds the request waited before ``arrival_ns``; 0 here.

        The hook for front-proxy queue time: whatever it returns is taken off
        the budget (negative values are ignored, so it can only shorten).
        """
        return 0

    def budget_ms_for(self, incoming: IncomingBudget) -> float:
        """The budget granted for ``incoming``, in ms: in ``[0, max_budget_ms]``."""
        budget = self._default_budget_ms if incoming.budget_ms is None else incoming.budget_ms
        # Comparisons, not min(max()): every request with a budget header runs this.
        if budget > self._max_budget_ms:
            return self._max_budget_ms
        if budget < 0.0:
            return 0.0
        return budget

    def deadline_for(self, environ: Mapping[str, Any], arrival_ns: int) -> tuple[Deadline, IncomingBudget]:
        """The deadline of a request that arrived at ``arrival_ns`` (monotonic).

        Returns the ``Deadline`` and the ``IncomingBudget`` it came from.
        """
        if type(arrival_ns) is not int:
            raise TypeError(f"arrival_ns must be an int of monotonic nanoseconds, not {type(arrival_ns).__name__}")
        if _ENVIRON_KEY_1 not in environ and _ENVIRON_KEY_2 not in environ and _ENVIRON_KEY_3 not in environ:
            # _incoming_budget's first step, inlined: no budget header, the common case.
            incoming = _NO_BUDGET
        else:
            incoming = _incoming_budget(environ, _ENVIRON_KEYS)
        if incoming.budget_ms is None:
            budget_ns = self._default_budget_ns
        else:
            # Truncation rounds the budget down: never a nanosecond more than granted.
            budget_ns = int(self.budget_ms_for(incoming) * NS_PER_MS)
        if self._has_upstream_hook:
            # Clamped so the hook can only shorten the budget, down to "already passed".
            budget_ns -= min(max(0, self.upstream_queue_ns(environ, arrival_ns)), budget_ns)
        # Saturate: a budget of centuries is "no practical deadline", never a 500.
        # A comparison, not min(): the builtin parses its keywords on every request.
        deadline_ns = arrival_ns + budget_ns
        if deadline_ns > _INT64_MAX:
            return Deadline.at_ns(_INT64_MAX), incoming
        return Deadline.at_ns(deadline_ns), incoming

    def deadline_now(self, environ: Mapping[str, Any]) -> tuple[Deadline, IncomingBudget]:
        """``deadline_for(environ, time.monotonic_ns())``."""
        return self.deadline_for(environ, time.monotonic_ns())

    def __repr__(self) -> str:
        return f"BudgetPolicy(default_budget_ms={self._default_budget_ms!r}, max_budget_ms={self._max_budget_ms!r})"


def _outgoing_ms(ms: object) -> float:
    if isinstance(ms, bool) or not isinstance(ms, Real):
        raise TypeError(f"ms must be a real number of milliseconds, not {type(ms).__name__}")
    value = float(ms)
    if math.isnan(value):
        raise ValueError("ms must not be NaN")
    if math.isinf(value) and value > 0:
        raise ValueError("ms must be finite, got inf")
    return value


def format_budget_ms(ms: float) -> str:
    """Format a remaining budget for ``X-Request-Budget-Ms``.

    An integer, rounded down (a hop never passes on more than it has), at
    least 0 and at most ``MAX_WIRE_MS``. NaN and +inf raise ``ValueError``.
    """
    value = _outgoing_ms(ms)
    if value <= 0:
        return "0"
    return str(min(math.floor(value), MAX_WIRE_MS))


def format_grpc_timeout(ms: float) -> str:
    """Format a remaining budget for ``grpc-timeout``.

    Uses the most precise unit whose count fits in 8 digits, rounded down
    (``1.5`` -> ``"1500000n"``, ``1234.9`` -> ``"1234900u"``); at least
    ``"0n"``, at most ``"99999999H"``. NaN and +inf raise ``ValueError``.
    """
    value = _outgoing_ms(ms)
    if value <= 0:
        return "0n"
    # Exact integer arithmetic on the float's ratio: a float product could
    # round up and hand on a nanosecond more than we have.
    numerator, denominator = value.as_integer_ratio()
    total_ns = numerator * NS_PER_MS // denominator
    for unit, unit_ns in _GRPC_UNIT_NS:
        count = total_ns // unit_ns
        if count <= _GRPC_MAX_DIGITS_VALUE:
            return f"{count}{unit}"
    return f"{_GRPC_MAX_DIGITS_VALUE}H"


def outgoing_headers_for(remaining_ms: float, *, grpc: bool = False) -> dict[str, str]:
    """The headers that pass ``remaining_ms`` to the next hop.

    Always ``X-Request-Budget-Ms``; with ``grpc=True`` also ``grpc-timeout``
    (a receiver that reads both takes the smaller, so sending both is safe).
    Subtracting margins and refusing to call when nothing is left is the
    caller's job (see ``prazo.bindings.outgoing``).
    """
    headers = {BUDGET_HEADER: format_budget_ms(remaining_ms)}
    if grpc:
        headers[GRPC_TIMEOUT_HEADER] = format_grpc_timeout(remaining_ms)
    return headers
