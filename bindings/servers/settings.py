"""``ServerSettings`` / ``resolve_settings``: the limits of a server embedding.

Threads, queue size, budgets, the header timeout and the queue policies, from
arguments or the environment (``PRAZO_MAX_QUEUE``, ``PRAZO_DEFAULT_BUDGET_MS``,
``PRAZO_MAX_BUDGET_MS``, ``PRAZO_HEADER_TIMEOUT_MS``,
``PRAZO_TRUST_REQUEST_START``, ``PRAZO_TRUSTED_PROXIES``,
``PRAZO_MAX_UPSTREAM_MS``, ``PRAZO_YIELD_WHEN_FULL``, ``PRAZO_ORDER``, ``PRAZO_CODEL_TARGET_MS``,
``PRAZO_CODEL_INTERVAL_MS``, ``PRAZO_EXPECTED_SERVICE_MS``, ``PRAZO_LIMIT``,
``PRAZO_MIN_CONCURRENCY``, ``PRAZO_RESERVED``, ``PRAZO_CRITICAL_HEADER``,
``PRAZO_CRITICAL_PATHS``); explicit arguments win over the environment.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prazo.core import IMPLEMENTATION
from prazo.core.arguments import checked_count, env_flag

from ..headers import DEFAULT_BUDGET_MS, BudgetPolicy, budget_limits
from ..policies import (
    DEFAULT_CODEL_INTERVAL_MS,
    DEFAULT_CODEL_TARGET_MS,
    LIMITS,
    ORDERS,
    POLICY_DEFAULTS,
    CriticalClassifier,
    checked_choice,
    checked_expected_service_ms,
    checked_header_name,
    checked_paths,
    checked_policy_ms,
    parse_expected_service_ms,
)
from ..proxy_headers import (
    DEFAULT_MAX_UPSTREAM_MS,
    FrontProxyBudgetPolicy,
    checked_max_upstream_ms,
    trusted_networks,
)

__all__ = [
    "DEFAULT_BUDGET_MS",
    "DEFAULT_HEADER_TIMEOUT_MS",
    "DEFAULT_MAX_BUDGET_MS",
    "DEFAULT_QUEUE_PER_THREAD",
    "DEFAULT_THREADS",
    "ENV_CODEL_INTERVAL_MS",
    "ENV_CODEL_TARGET_MS",
    "ENV_CRITICAL_HEADER",
    "ENV_CRITICAL_PATHS",
    "ENV_DEFAULT_BUDGET_MS",
    "ENV_EXPECTED_SERVICE_MS",
    "ENV_HEADER_TIMEOUT_MS",
    "ENV_LIMIT",
    "ENV_MAX_BUDGET_MS",
    "ENV_MAX_QUEUE",
    "ENV_MAX_UPSTREAM_MS",
    "ENV_MIN_CONCURRENCY",
    "ENV_ORDER",
    "ENV_RESERVED",
    "ENV_TRUSTED_PROXIES",
    "ENV_TRUST_REQUEST_START",
    "ENV_YIELD_WHEN_FULL",
    "POLICY_FLAGS",
    "ServerSettings",
    "checked_count",
    "checked_header_timeout_ms",
    "resolve_settings",
]

ENV_MAX_QUEUE = "PRAZO_MAX_QUEUE"
ENV_DEFAULT_BUDGET_MS = "PRAZO_DEFAULT_BUDGET_MS"
ENV_MAX_BUDGET_MS = "PRAZO_MAX_BUDGET_MS"
ENV_TRUST_REQUEST_START = "PRAZO_TRUST_REQUEST_START"
ENV_TRUSTED_PROXIES = "PRAZO_TRUSTED_PROXIES"
ENV_MAX_UPSTREAM_MS = "PRAZO_MAX_UPSTREAM_MS"
ENV_HEADER_TIMEOUT_MS = "PRAZO_HEADER_TIMEOUT_MS"
ENV_YIELD_WHEN_FULL = "PRAZO_YIELD_WHEN_FULL"
ENV_ORDER = "PRAZO_ORDER"
ENV_CODEL_TARGET_MS = "PRAZO_CODEL_TARGET_MS"
ENV_CODEL_INTERVAL_MS = "PRAZO_CODEL_INTERVAL_MS"
ENV_EXPECTED_SERVICE_MS = "PRAZO_EXPECTED_SERVICE_MS"
ENV_LIMIT = "PRAZO_LIMIT"
ENV_MIN_CONCURRENCY = "PRAZO_MIN_CONCURRENCY"
ENV_RESERVED = "PRAZO_RESERVED"
ENV_CRITICAL_HEADER = "PRAZO_CRITICAL_HEADER"
ENV_CRITICAL_PATHS = "PRAZO_CRITICAL_PATHS"

#: Each queue-policy field of ``ServerSettings``: its ``prazo serve`` flag and
#: its environment variable. Errors name all three, so whichever way a value
#: came in, the message says where to fix it.
POLICY_FLAGS: dict[str, tuple[str, str]] = {
    "order": ("--order", ENV_ORDER),
    "codel_target_ms": ("--codel-target-ms", ENV_CODEL_TARGET_MS),
    "codel_interval_ms": ("--codel-interval-ms", ENV_CODEL_INTERVAL_MS),
    "expected_service_ms": ("--expected-service-ms", ENV_EXPECTED_SERVICE_MS),
    "limit": ("--limit", ENV_LIMIT),
    "min_concurrency": ("--min-concurrency", ENV_MIN_CONCURRENCY),
    "reserved": ("--reserved", ENV_RESERVED),
    "critical_header": ("--critical-header", ENV_CRITICAL_HEADER),
    "critical_paths": ("--critical-path", ENV_CRITICAL_PATHS),
}

DEFAULT_THREADS = 4
# Without an explicit size the line holds four requests per worker: with a
# typical service time well under the default 1 s budget, the last in line
# still starts in time, and a burst of four times the workers is absorbed.
DEFAULT_QUEUE_PER_THREAD = 4
DEFAULT_MAX_BUDGET_MS = 30000.0
# nginx's client_header_timeout is 60 s; a head from a healthy client takes
# one round trip, and every second a slow one is allowed is a connection a
# slow-loris client keeps open for free.
DEFAULT_HEADER_TIMEOUT_MS = 5000.0


def _env_int(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


_log = logging.getLogger("prazo.settings")


def _env_ms(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be a number of milliseconds, got {raw!r}") from None
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of milliseconds > 0, got {raw!r}")
    return value


def _env_codel_ms(env: Mapping[str, str], name: str, order: str | None) -> float | None:
    """A CoDel variable, or None when the order is not adaptive: then it is ignored, with a warning.

    One environment file is often shared by several services, some without
    ``--order adaptive``; a variable that does not apply must not stop them.
    The flags stay strict (``ServerSettings`` refuses them without adaptive
    order), and a malformed value is an error whatever the order.
    """
    value = _env_ms(env, name)
    if value is not None and order != "adaptive":
        _log.warning("%s=%s ignored: it only applies with order 'adaptive' (--order adaptive)", name, env[name])
        return None
    return value


def _env_list(environ: Mapping[str, str], name: str) -> tuple[str, ...] | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


# The other fields whose errors name their flag and variable: those checked against another field.
_LABELLED = {
    **POLICY_FLAGS,
    "default_budget_ms": ("--default-budget-ms", ENV_DEFAULT_BUDGET_MS),
    "max_budget_ms": ("--max-budget-ms", ENV_MAX_BUDGET_MS),
}


def _label(field: str) -> str:
    flag, env = _LABELLED[field]
    return f"{field} ({flag}, ${env})"


def checked_header_timeout_ms(value: object, name: str = "header_timeout_ms") -> float:
    """A header timeout: a finite number of milliseconds > 0; ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of milliseconds > 0, got {value!r}")
    return float(value)


def _env_choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return checked_choice(raw.strip().lower(), name, choices)


@dataclass(frozen=True)
class ServerSettings:
    """The limits of one server embedding; build it with ``resolve_settings``.

    ``threads`` requests run at once and ``max_queue`` more wait, so the
    capacity is ``threads + max_queue``; every request's deadline comes from
    ``policy()``. With ``trust_request_start`` the time a request spent queued
    in a front proxy (``X-Request-Start``) is taken off its budget, at most
    ``max_upstream_ms``, for peers in ``trusted_proxies`` (all when None). On
    the socket-level servers a request head must be complete within
    ``header_timeout_ms`` of its first byte, or it is answered 408. With
    several worker processes (gunicorn ``-w N``), ``yield_when_full`` makes a
    full worker leave new connections to a sibling with room (see
    ``prazo.bindings.servers.gunicorn``).

    The queue policies (``order``, ``codel_target_ms``, ``codel_interval_ms``,
    ``expected_service_ms``, ``limit``, ``min_concurrency``, ``reserved``) are
    ``prazo.core.AdmissionQueue``'s, with its defaults; ``queue_options()``
    gives those that differ. A request is critical (served first, may use the
    ``reserved`` slots) when its path is one of ``critical_paths`` or its
    ``critical_header`` says ``critical``; ``classifier()`` decides it.
    """

    threads: int
    max_queue: int
    default_budget_ms: float = DEFAULT_BUDGET_MS
    max_budget_ms: float = DEFAULT_MAX_BUDGET_MS
    trust_request_start: bool = False
    max_upstream_ms: float = DEFAULT_MAX_UPSTREAM_MS
    trusted_proxies: tuple[str, ...] | None = None
    header_timeout_ms: float = DEFAULT_HEADER_TIMEOUT_MS
    yield_when_full: bool = True
    order: str = "fifo"
    codel_target_ms: float = DEFAULT_CODEL_TARGET_MS
    codel_interval_ms: float = DEFAULT_CODEL_INTERVAL_MS
    expected_service_ms: float | str | None = None
    limit: str = "fixed"
    min_concurrency: int = 1
    reserved: int = 0
    critical_header: str | None = None
    critical_paths: tuple[str, ...] = ()
    host_workers: int = 1

    def __post_init__(self) -> None:
        checked_count(self.threads, "threads", 1)
        checked_count(self.host_workers, "host_workers", 1)
        checked_count(self.max_queue, "max_queue", 0)
        checked_header_timeout_ms(self.header_timeout_ms)
        if not isinstance(self.trust_request_start, bool):
            raise TypeError(f"trust_request_start must be a bool, not {type(self.trust_request_start).__name__}")
        if not isinstance(self.yield_when_full, bool):
            raise TypeError(f"yield_when_full must be a bool, not {type(self.yield_when_full).__name__}")
        # Building the policy validates the budgets; the front-proxy options are
        # checked even while trust is off, so a bad value fails at start-up.
        self.policy()
        # The policy would cap such a default silently: whichever way the two came in, name both.
        budget_limits(
            self.default_budget_ms, self.max_budget_ms, (_label("default_budget_ms"), _label("max_budget_ms"))
        )
        checked_max_upstream_ms(self.max_upstream_ms)
        trusted_networks(self.trusted_proxies)
        self._check_policies()

    def _check_policies(self) -> None:
        """The queue-policy fields, each error naming the field, its flag and its variable."""
        checked_choice(self.order, _label("order"), ORDERS)
        for field in ("codel_target_ms", "codel_interval_ms"):
            value = checked_policy_ms(getattr(self, field), _label(field))
            # The queue refuses a CoDel setting that would do nothing: say so at start-up.
            if self.order != "adaptive" and value != POLICY_DEFAULTS[field]:
                raise ValueError(f"{_label(field)} only applies with order 'adaptive' (--order adaptive)")
        checked_expected_service_ms(self.expected_service_ms, _label("expected_service_ms"))
        checked_choice(self.limit, _label("limit"), LIMITS)
        # Both count the places behind the line: a front-door host's are all its workers' threads.
        places = "threads" if self.host_workers == 1 else "threads x workers"
        checked_count(self.min_concurrency, _label("min_concurrency"), 1)
        if self.min_concurrency > self.places:
            raise ValueError(
                f"{_label('min_concurrency')} must be <= {places} ({self.places}), got {self.min_concurrency}"
            )
        checked_count(self.reserved, _label("reserved"), 0)
        if self.reserved >= self.places:
            raise ValueError(f"{_label('reserved')} must be < {places} ({self.places}), got {self.reserved}")
        if self.critical_header is not None:
            checked_header_name(self.critical_header, _label("critical_header"))
        if not isinstance(self.critical_paths, tuple):
            raise TypeError(f"{_label('critical_paths')} must be a tuple of paths")
        checked_paths(self.critical_paths, _label("critical_paths"))

    @property
    def places(self) -> int:
        """Requests that may run at once behind the one line: ``threads`` times ``host_workers``."""
        return self.threads * self.host_workers

    @property
    def capacity(self) -> int:
        """Requests the server holds at most: running plus waiting."""
        return self.places + self.max_queue

    def policy(self) -> BudgetPolicy:
        """A fresh ``BudgetPolicy`` (``FrontProxyBudgetPolicy`` when trusting proxies)."""
        if self.trust_request_start:
            return FrontProxyBudgetPolicy(
                self.default_budget_ms,
                self.max_budget_ms,
                max_upstream_ms=self.max_upstream_ms,
                trusted_proxies=self.trusted_proxies,
            )
        return BudgetPolicy(self.default_budget_ms, self.max_budget_ms)

    def queue_options(self) -> dict[str, Any]:
        """The queue-policy keywords for ``AdmissionQueue`` that differ from its defaults."""
        return {
            name: getattr(self, name)
            for name, default in POLICY_DEFAULTS.items()
            if name not in ("critical_header", "critical_paths") and getattr(self, name) != default
        }

    def classifier(self) -> CriticalClassifier | None:
        """What says a request is critical (``critical_paths``, ``critical_header``); None when none is."""
        if self.critical_header is None and not self.critical_paths:
            return None
        return CriticalClassifier(header=self.critical_header, paths=self.critical_paths)

    def describe(self) -> str:
        """One line naming the limits (and every policy not at its default), for a startup log."""
        text = (
            f"threads={self.threads} max_queue={self.max_queue} (capacity {self.capacity}) "
            f"default_budget_ms={self.default_budget_ms:g} max_budget_ms={self.max_budget_ms:g} "
            f"core={IMPLEMENTATION}"
        )
        if self.trust_request_start:
            proxies = "any" if self.trusted_proxies is None else ",".join(self.trusted_proxies)
            text += f" X-Request-Start from {proxies} (cap {self.max_upstream_ms:g} ms)"
        for name, value in self.queue_options().items():
            text += f" {name}={value:g}" if isinstance(value, float) else f" {name}={value}"
        if self.critical_paths:
            text += f" critical_paths={','.join(self.critical_paths)}"
        if self.critical_header is not None:
            text += f" critical_header={self.critical_header}"
        return text


def resolve_settings(
    *,
    threads: int | None = None,
    max_queue: int | None = None,
    default_budget_ms: float | None = None,
    max_budget_ms: float | None = None,
    trust_request_start: bool | None = None,
    trusted_proxies: Iterable[str] | None = None,
    max_upstream_ms: float | None = None,
    header_timeout_ms: float | None = None,
    yield_when_full: bool | None = None,
    environ: Mapping[str, str] | None = None,
    settings: ServerSettings | None = None,
    order: str | None = None,
    codel_target_ms: float | None = None,
    codel_interval_ms: float | None = None,
    expected_service_ms: float | str | None = None,
    limit: str | None = None,
    min_concurrency: int | None = None,
    reserved: int | None = None,
    critical_header: str | None = None,
    critical_paths: Iterable[str] | None = None,
    host_workers: int | None = None,
) -> ServerSettings:
    """The settings of an embedding: each argument, else its environment variable, else the default.

    ``settings``, when given, is returned as it is (the embeddings take either
    a complete ``ServerSettings`` or the individual limits, not both).

    Reads ``PRAZO_MAX_QUEUE``, ``PRAZO_DEFAULT_BUDGET_MS``,
    ``PRAZO_MAX_BUDGET_MS``, ``PRAZO_HEADER_TIMEOUT_MS``, ``PRAZO_TRUST_REQUEST_START``,
    ``PRAZO_TRUSTED_PROXIES`` (comma-separated), ``PRAZO_MAX_UPSTREAM_MS``
    and ``PRAZO_YIELD_WHEN_FULL``
    from ``environ`` (default ``os.environ``), and the queue policies from
    ``PRAZO_ORDER``, ``PRAZO_CODEL_TARGET_MS``, ``PRAZO_CODEL_INTERVAL_MS``,
    ``PRAZO_EXPECTED_SERVICE_MS`` (ms or ``p50``/``p90``/``p95``/``p99``),
    ``PRAZO_LIMIT``, ``PRAZO_MIN_CONCURRENCY``, ``PRAZO_RESERVED``,
    ``PRAZO_CRITICAL_HEADER`` and ``PRAZO_CRITICAL_PATHS`` (comma-separated).
    A malformed variable raises ``ValueError`` naming it. A default budget
    given nowhere is 1000 ms, or the maximum budget when that is lower; one
    above the maximum raises ``ValueError`` naming both. ``max_queue``
    defaults to four per thread (of every worker, on a front-door host:
    ``host_workers`` processes of ``threads`` threads behind one line).

    >>> resolve_settings(threads=2, environ={"PRAZO_MAX_QUEUE": "5"}).capacity
    7
    """
    if settings is not None:
        if not isinstance(settings, ServerSettings):
            raise TypeError(f"settings must be a ServerSettings, not {type(settings).__name__}")
        given = (threads, max_queue, default_budget_ms, max_budget_ms, trust_request_start, trusted_proxies)
        policies = (order, codel_target_ms, codel_interval_ms, expected_service_ms, limit, min_concurrency, reserved)
        more = (*policies, critical_header, critical_paths, max_upstream_ms, header_timeout_ms, yield_when_full)
        if any(value is not None for value in (*given, *more, host_workers)):
            raise TypeError("pass either settings or the individual limits, not both")
        return settings
    env = os.environ if environ is None else environ
    threads = DEFAULT_THREADS if threads is None else checked_count(threads, "threads", 1)
    host_workers = 1 if host_workers is None else checked_count(host_workers, "host_workers", 1)
    if max_queue is None:
        max_queue = _env_int(env, ENV_MAX_QUEUE, 0)
    if max_queue is None:
        max_queue = DEFAULT_QUEUE_PER_THREAD * threads * host_workers
    if default_budget_ms is None:
        default_budget_ms = _env_ms(env, ENV_DEFAULT_BUDGET_MS)
    if max_budget_ms is None:
        max_budget_ms = _env_ms(env, ENV_MAX_BUDGET_MS)
    if default_budget_ms is None and max_budget_ms is not None:
        # Only a maximum given: the default comes down to it (what the policy would grant anyway).
        default_budget_ms, _ = budget_limits(None, max_budget_ms)
    if trust_request_start is None:
        trust_request_start = env_flag(env, ENV_TRUST_REQUEST_START)
    if max_upstream_ms is None:
        max_upstream_ms = _env_ms(env, ENV_MAX_UPSTREAM_MS)
    if header_timeout_ms is None:
        header_timeout_ms = _env_ms(env, ENV_HEADER_TIMEOUT_MS)
    if yield_when_full is None:
        yield_when_full = env_flag(env, ENV_YIELD_WHEN_FULL)
    if order is None:
        order = _env_choice(env, ENV_ORDER, ORDERS)
    if codel_target_ms is None:
        codel_target_ms = _env_codel_ms(env, ENV_CODEL_TARGET_MS, order)
    if codel_interval_ms is None:
        codel_interval_ms = _env_codel_ms(env, ENV_CODEL_INTERVAL_MS, order)
    if expected_service_ms is None:
        raw = env.get(ENV_EXPECTED_SERVICE_MS, "")
        expected_service_ms = parse_expected_service_ms(raw, ENV_EXPECTED_SERVICE_MS) if raw.strip() else None
    if limit is None:
        limit = _env_choice(env, ENV_LIMIT, LIMITS)
    if min_concurrency is None:
        min_concurrency = _env_int(env, ENV_MIN_CONCURRENCY, 1)
    if reserved is None:
        reserved = _env_int(env, ENV_RESERVED, 0)
    if critical_header is None:
        critical_header = (env.get(ENV_CRITICAL_HEADER) or "").strip() or None
        if critical_header is not None:
            checked_header_name(critical_header, ENV_CRITICAL_HEADER)
    paths: tuple[str, ...]
    if critical_paths is None:
        paths = checked_paths(_env_list(env, ENV_CRITICAL_PATHS) or (), ENV_CRITICAL_PATHS)
    else:
        paths = checked_paths(critical_paths, "critical_paths")
    # The policies not given anywhere keep ServerSettings' defaults.
    policies_given: dict[str, Any] = {
        name: value
        for name, value in (
            ("order", order),
            ("codel_target_ms", codel_target_ms),
            ("codel_interval_ms", codel_interval_ms),
            ("expected_service_ms", expected_service_ms),
            ("limit", limit),
            ("min_concurrency", min_concurrency),
            ("reserved", reserved),
        )
        if value is not None
    }
    proxies: tuple[str, ...] | None
    if trusted_proxies is None:
        proxies = _env_list(env, ENV_TRUSTED_PROXIES)
        trusted_networks(proxies, ENV_TRUSTED_PROXIES)
    elif isinstance(trusted_proxies, (str, bytes)):
        raise TypeError("trusted_proxies must be an iterable of addresses or networks, not a single string")
    else:
        proxies = tuple(trusted_proxies)
    return ServerSettings(
        threads=threads,
        max_queue=max_queue,
        default_budget_ms=DEFAULT_BUDGET_MS if default_budget_ms is None else default_budget_ms,
        max_budget_ms=DEFAULT_MAX_BUDGET_MS if max_budget_ms is None else max_budget_ms,
        trust_request_start=False if trust_request_start is None else trust_request_start,
        max_upstream_ms=DEFAULT_MAX_UPSTREAM_MS if max_upstream_ms is None else max_upstream_ms,
        trusted_proxies=proxies,
        header_timeout_ms=DEFAULT_HEADER_TIMEOUT_MS if header_timeout_ms is None else header_timeout_ms,
        yield_when_full=True if yield_when_full is None else yield_when_full,
        critical_header=critical_header,
        critical_paths=paths,
        host_workers=host_workers,
        **policies_given,
    )
