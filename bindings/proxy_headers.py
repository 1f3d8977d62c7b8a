"""Front-proxy queue time: the ``X-Request-Start`` / ``X-Queue-Start`` wire format.

A front proxy (nginx, Heroku's router, HAProxy, an ALB sidecar) can stamp the
wall-clock moment it received a request::

    X-Request-Start: t=1700000000.123       # seconds with a fraction (nginx ``t=${msec}``)
    X-Request-Start: t=1700000000123        # milliseconds (Heroku)
    X-Queue-Start: 1700000000123456         # microseconds (Apache ``%t``)
    X-Request-Start: 1700000000123456789    # nanoseconds

Whatever the request then spent queued in front of this process already came
out of the caller's budget, so ``FrontProxyBudgetPolicy`` takes it off the
deadline. The unit is detected by magnitude (an epoch stamp in seconds has 10
integer digits today, in ms 13, in µs 16, in ns 19), and a stamp whose moment
falls outside 2000-01-01 .. 2100-01-01 UTC in its unit is rejected: such a
value is a broken or forged header, not a clock. The stamp is wall-clock
time, so the elapsed time is measured on the wall clock and then moved onto
the monotonic deadline; a stamp in the future (clock skew) is ignored, and the
correction is capped, so a proxy with a wrong clock can cost at most the cap.

This is opt-in and meant for trusted proxies only: a client that forges the
header can only shorten its own deadline (never extend it), but a proxy that
does not overwrite the header would let clients misreport their queue time.
``trusted_proxies`` restricts the correction to requests whose peer
(``REMOTE_ADDR``) is one of the given addresses or networks.

>>> parse_request_start_ns("t=1700000000.5")
1700000000500000000
>>> parse_request_start_ns("1700000000123")
1700000000123000000
>>> parse_request_start_ns("soon") is None
True
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prazo.core import NS_PER_MS
from prazo.core.arguments import checked_ms

from .headers import BudgetPolicy, environ_key

__all__ = [
    "DEFAULT_MAX_UPSTREAM_MS",
    "EARLIEST_STAMP_NS",
    "LATEST_STAMP_NS",
    "QUEUE_START_HEADER",
    "REQUEST_START_HEADER",
    "FrontProxyBudgetPolicy",
    "checked_max_upstream_ms",
    "parse_request_start_ns",
    "trusted_networks",
    "upstream_wait_ns",
]

REQUEST_START_HEADER = "X-Request-Start"
QUEUE_START_HEADER = "X-Queue-Start"
_START_ENVIRON_KEYS = (environ_key(REQUEST_START_HEADER), environ_key(QUEUE_START_HEADER))

# A correction larger than this is far more likely a skewed proxy clock than a
# real queue; the cap bounds what such a clock can cost every request.
DEFAULT_MAX_UPSTREAM_MS = 5_000.0

# 1-20 integer digits (ns since the epoch have 19 today), an optional fraction
# of at most 9 digits (nanosecond precision of a seconds stamp); ASCII only.
_STAMP_RE = re.compile(r"(?:t=)?([0-9]{1,20})(?:\.([0-9]{1,9}))?", re.ASCII)
_MAX_STAMP_CHARS = 40
_HTTP_OWS = " \t"

# (exclusive upper bound of the integer part, ns per unit): the first row whose
# bound exceeds the value names its unit. Seconds stay below 1e11 until the
# year 5138, so the ranges cannot be confused for any plausible clock.
_UNITS_BY_MAGNITUDE: tuple[tuple[int, int], ...] = (
    (10**11, 1_000_000_000),
    (10**14, 1_000_000),
    (10**17, 1_000),
    (10**20, 1),
)

# The plausible moments of a stamp, in ns since the epoch: 2000-01-01 (inclusive)
# to 2100-01-01 (exclusive) UTC. Without them "1" would read as one second after
# 1970 and a correction would always be taken, up to the cap.
EARLIEST_STAMP_NS = 946_684_800 * 1_000_000_000
LATEST_STAMP_NS = 4_102_444_800 * 1_000_000_000

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_request_start_ns(value: object) -> int | None:
    """Parse an ``X-Request-Start`` value into integer nanoseconds since the epoch.

    Accepts an optional ``t=`` prefix and a number in seconds (optionally with
    a fraction), milliseconds, microseconds or nanoseconds, told apart by
    magnitude. Returns None for anything else (text, signs, exponents, several
    values, non-ASCII digits) and for a moment before 2000-01-01 or from
    2100-01-01 UTC on (``EARLIEST_STAMP_NS`` / ``LATEST_STAMP_NS``), whatever
    the unit. Never raises.
    """
    if not isinstance(value, str) or len(value) > _MAX_STAMP_CHARS:
        return None
    match = _STAMP_RE.fullmatch(value.strip(_HTTP_OWS))
    if match is None:
        return None
    integer_text, fraction_text = match.group(1), match.group(2) or ""
    integer = int(integer_text)
    for bound, unit_ns in _UNITS_BY_MAGNITUDE:
        if integer < bound:
            break
    else:
        return None
    if fraction_text and unit_ns == 1:
        return None  # a fraction of a nanosecond is not a real stamp
    # Exact integer arithmetic: a float would lose the nanoseconds of a
    # 19-digit stamp.
    scale = 10 ** len(fraction_text)
    stamp_ns = (integer * scale + int(fraction_text or "0")) * unit_ns // scale
    return stamp_ns if EARLIEST_STAMP_NS <= stamp_ns < LATEST_STAMP_NS else None


def upstream_wait_ns(start_ns: int, arrival_wall_ns: int, max_wait_ns: int) -> int:
    """Nanoseconds between the proxy's stamp and our arrival, within ``[0, max_wait_ns]``.

    A stamp after the arrival (the proxy's clock runs ahead of ours) counts as
    no wait at all rather than as negative time.
    """
    return min(max(arrival_wall_ns - start_ns, 0), max(max_wait_ns, 0))


def checked_max_upstream_ms(value: object, name: str = "max_upstream_ms") -> float:
    """Check a cap on the front-proxy correction: a finite number of ms >= 0 (errors name ``name``)."""
    return checked_ms(value, name)


def trusted_networks(
    trusted_proxies: Iterable[str] | None, name: str = "trusted_proxies"
) -> tuple[_Network, ...] | None:
    """Parse addresses or networks (``"10.0.0.0/8"``, ``"::1"``); None stays None (any peer).

    Raises ``TypeError``/``ValueError`` naming ``name`` and the bad entry.
    """
    if trusted_proxies is None:
        return None
    if isinstance(trusted_proxies, (str, bytes)):
        raise TypeError(f"{name} must be an iterable of addresses or networks, not a single string")
    networks = []
    for entry in trusted_proxies:
        if not isinstance(entry, str):
            raise TypeError(f"{name} entries must be strings, not {type(entry).__name__}")
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{name}: {entry!r} is not an IP address or network") from None
    return tuple(networks)


class FrontProxyBudgetPolicy(BudgetPolicy):
    """A ``BudgetPolicy`` that also counts the time queued in a front proxy.

    Effects: on top of ``BudgetPolicy`` (budget from the request headers,
    capped at ``max_budget_ms``), the time between the earliest valid
    ``X-Request-Start`` / ``X-Queue-Start`` stamp and the request's arrival
    here is taken off the deadline, at most ``max_upstream_ms``. Invalid or
    future stamps are ignored; a request whose peer is not in
    ``trusted_proxies`` (when given) gets no correction. The correction can
    only shorten a deadline.

    >>> policy = FrontProxyBudgetPolicy(default_budget_ms=1000, max_budget_ms=30000,
    ...                                 wall_clock_ns=lambda: 1_700_000_000 * 10**9, monotonic_ns=lambda: 0)
    >>> env = {"HTTP_X_REQUEST_START": "t=1699999999.75"}   # stamped 250 ms before arrival
    >>> policy.deadline_for(env, arrival_ns=0)[0].ns // 1_000_000
    750

    ``wall_clock_ns`` and ``monotonic_ns`` exist for tests (fake clocks).
    """

    __slots__ = ("_max_upstream_ns", "_monotonic_ns", "_trusted_networks", "_wall_clock_ns")

    def __init__(
        self,
        default_budget_ms: float = 1000,
        max_budget_ms: float = 30000,
        *,
        max_upstream_ms: float = DEFAULT_MAX_UPSTREAM_MS,
        trusted_proxies: Iterable[str] | None = None,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        super().__init__(default_budget_ms, max_budget_ms)
        if not callable(wall_clock_ns) or not callable(monotonic_ns):
            raise TypeError("wall_clock_ns and monotonic_ns must be callables returning int nanoseconds")
        self._max_upstream_ns = int(checked_max_upstream_ms(max_upstream_ms) * NS_PER_MS)
        self._trusted_networks = trusted_networks(trusted_proxies)
        self._wall_clock_ns = wall_clock_ns
        self._monotonic_ns = monotonic_ns

    @property
    def max_upstream_ms(self) -> float:
        return self._max_upstream_ns / NS_PER_MS

    def _peer_trusted(self, environ: Mapping[str, Any]) -> bool:
        if self._trusted_networks is None:
            return True
        peer = environ.get("REMOTE_ADDR")
        if not isinstance(peer, str):
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        # A dual-stack listener reports IPv4 peers as ::ffff:a.b.c.d; they are
        # the same proxy as the IPv4 network the operator listed.
        mapped = getattr(address, "ipv4_mapped", None)
        return any(
            address in network or (mapped is not None and mapped in network) for network in self._trusted_networks
        )

    def upstream_queue_ns(self, environ: Mapping[str, Any], arrival_ns: int) -> int:
        """Time queued in front of us: from the earliest valid stamp to ``arrival_ns``."""
        if not self._peer_trusted(environ):
            return 0
        stamps = [parse_request_start_ns(environ.get(key)) for key in _START_ENVIRON_KEYS]
        valid = [stamp for stamp in stamps if stamp is not None]
        if not valid:
            return 0
        # The wall-clock moment of ``arrival_ns``: now on the wall clock, minus
        # how long ago the arrival was on the monotonic clock.
        arrival_wall_ns = self._wall_clock_ns() - (self._monotonic_ns() - arrival_ns)
        return upstream_wait_ns(min(valid), arrival_wall_ns, self._max_upstream_ns)

    def __repr__(self) -> str:
        return (
            f"FrontProxyBudgetPolicy(default_budget_ms={self.default_budget_ms!r}, "
            f"max_budget_ms={self.max_budget_ms!r}, max_upstream_ms={self.max_upstream_ms!r})"
        )
