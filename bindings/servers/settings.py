"""``ServerSettings`` / ``resolve_settings``: the limits of a server embedding, each declared once.

``SETTINGS`` is the table: one ``Setting`` per field of ``ServerSettings``,
with its ``prazo serve`` flag, its ``PRAZO_*`` environment variable, how a
flag's or a variable's text becomes a value, the check every value passes
(whichever way it came in), and its help. Everything else is read from it:
``resolve_settings`` (arguments, then variables, then the defaults),
``ServerSettings``' own checks, ``prazo serve``'s parser
(``add_setting_arguments``, ``settings_from_arguments``), the environment a
parent hands its worker processes (``settings_environment``) and the
configuration reference (docs/_ext). A new setting is one field and one row.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prazo.core import IMPLEMENTATION, AdmissionQueue
from prazo.core.arguments import checked_count, checked_ms, parse_flag

from ..headers import DEFAULT_BUDGET_MS, BudgetPolicy, budget_limits
from ..plumbing.load_report import LOAD_REPORT_FORMATS, checked_load_report_format
from ..policies import (
    DEFAULT_CODEL_INTERVAL_MS,
    DEFAULT_CODEL_TARGET_MS,
    EXPECTED_SERVICE_QUANTILES,
    LIMITS,
    ORDERS,
    POLICY_DEFAULTS,
    CriticalClassifier,
    checked_choice,
    checked_expected_service_ms,
    checked_header_name,
    checked_paths,
    parse_expected_service_ms,
)
from ..proxy_headers import DEFAULT_MAX_UPSTREAM_MS, FrontProxyBudgetPolicy, checked_max_upstream_ms, trusted_networks
from ..wsgi import DEFAULT_RETRY_AFTER_S

__all__ = [
    "DEFAULT_BUDGET_MS",
    "DEFAULT_HEADER_TIMEOUT_MS",
    "DEFAULT_MAX_BUDGET_MS",
    "DEFAULT_QUEUE_PER_THREAD",
    "DEFAULT_THREADS",
    "SETTINGS",
    "ServerSettings",
    "Setting",
    "add_setting_arguments",
    "default_text",
    "resolve_settings",
    "setting",
    "settings_environment",
    "settings_from_arguments",
]

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
# A Retry-After longer than a day is a maintenance notice, not a wait.
MAX_FIXED_RETRY_AFTER_S = 86_400

_log = logging.getLogger("prazo.settings")

# -- how a flag's or a variable's text becomes a value (the check comes after) --------------------


def _integer(text: str, name: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _milliseconds(text: str, name: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{name} must be a number of milliseconds, got {text!r}") from None


def _word(text: str, name: str) -> str:
    return text.strip().lower()


def _name(text: str, name: str) -> str:
    return text.strip()


def _comma_list(text: str, name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# -- the checks every value passes, whichever way it came in (errors name ``name``) ----------------


def _count(minimum: int) -> Callable[[Any, str], int]:
    return lambda value, name: checked_count(value, name, minimum)


def _positive_ms(value: Any, name: str) -> float:
    return checked_ms(value, name, positive=True)


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    return lambda value, name: checked_choice(value, name, choices)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return value


def _proxies(value: Any, name: str) -> tuple[str, ...] | None:
    trusted_networks(value, name)
    return None if value is None else tuple(value)


def _optional_header_name(value: Any, name: str) -> str | None:
    return None if value is None else checked_header_name(value, name)


def _paths(value: Any, name: str) -> tuple[str, ...]:
    return checked_paths(value, name)


def _optional_port(value: Any, name: str) -> int | None:
    if value is None:
        return None
    port = checked_count(value, name, 0)
    if port > 65535:
        raise ValueError(f"{name} must be a port (0 to 65535), got {port}")
    return port


def _optional_seconds(value: Any, name: str) -> int | None:
    # None: the wait is measured from the line; an int: the fixed Retry-After of every overload 503.
    if value is None:
        return None
    seconds = checked_count(value, name, 0)
    if seconds > MAX_FIXED_RETRY_AFTER_S:
        raise ValueError(f"{name} must be at most {MAX_FIXED_RETRY_AFTER_S} seconds, got {seconds}")
    return seconds


def _seconds_or_measured(text: str, name: str) -> int | None:
    if text.strip().lower() == "measured":
        return None
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of seconds or 'measured', got {text!r}") from None


def _optional_load_report(value: Any, name: str) -> str | None:
    return None if value is None else checked_load_report_format(value, name)


@dataclass(frozen=True)
class Setting:
    """One setting of ``ServerSettings``, declared once: everything that reads or writes it uses this row.

    ``check(value, name)`` returns the value checked (``TypeError``/``ValueError``
    naming ``name``): a field, an argument, a flag or a variable, named as the
    user wrote it. ``parse(text, name)`` turns a flag's or a variable's text
    into a value for ``check``. ``kind``: ``"value"``, ``"list"`` (a repeatable
    flag; a comma-separated variable), ``"on"`` (a flag that switches it on)
    or ``"off"`` (a flag that switches it off; both variables say 1/0).
    """

    field: str
    check: Callable[[Any, str], Any]
    help: str
    flag: str | None = None
    env: str | None = None
    parse: Callable[[str, str], Any] = _name
    kind: str = "value"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    #: What the configuration reference says of a default computed at resolve time, or absent.
    default_text: str | None = None
    #: Only with ``order="adaptive"``: a variable is then ignored (with a warning) under another order.
    adaptive_only: bool = False

    @property
    def label(self) -> str:
        """The field, its flag and its variable: how an error about several settings names this one."""
        where = ", ".join(part for part in (self.flag, None if self.env is None else f"${self.env}") if part)
        return f"{self.field} ({where})" if where else self.field

    def from_text(self, text: str, name: str) -> Any:
        """The value a flag's or a variable's ``text`` says, checked; errors name ``name``."""
        if self.kind in ("on", "off"):
            return parse_flag(text, name)
        if self.kind == "list":
            return self.check(_comma_list(text, name), name)
        return self.check(self.parse(text, name), name)

    def from_environment(self, environ: Mapping[str, str]) -> Any:
        """The value of this setting's variable in ``environ``; None when it has none or it is blank."""
        raw = None if self.env is None else environ.get(self.env)
        if raw is None or raw.strip() == "":
            return None
        return self.from_text(raw, self.env or self.field)

    def environment_text(self, value: Any) -> str:
        """``value`` as this setting's variable spells it (blank for None: the variable then says nothing)."""
        if value is None:
            return ""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, tuple):
            return ",".join(value)
        return repr(value) if isinstance(value, float) else str(value)


SETTINGS: tuple[Setting, ...] = (
    Setting("threads", _count(1), "worker threads", flag="--threads", parse=_integer, metavar="N",
            default_text=str(DEFAULT_THREADS)),
    Setting("max_queue", _count(0),
            f"requests waiting for a thread (default {DEFAULT_QUEUE_PER_THREAD} x threads: per worker with gunicorn, "
            "x workers in the prazo host's one line)",
            flag="--max-queue", env="PRAZO_MAX_QUEUE", parse=_integer, metavar="M",
            default_text=f"{DEFAULT_QUEUE_PER_THREAD} × threads"),
    Setting("default_budget_ms", _positive_ms,
            "budget of a request without a budget header, at most --max-budget-ms",
            flag="--default-budget-ms", env="PRAZO_DEFAULT_BUDGET_MS", parse=_milliseconds, metavar="B",
            default_text="1000, or --max-budget-ms when lower"),
    Setting("max_budget_ms", _positive_ms, "the most any request may ask for",
            flag="--max-budget-ms", env="PRAZO_MAX_BUDGET_MS", parse=_milliseconds, metavar="C"),
    Setting("trust_request_start", _bool,
            "take the time queued in a front proxy (X-Request-Start) off the budget",
            flag="--trust-request-start", env="PRAZO_TRUST_REQUEST_START", kind="on"),
    Setting("max_upstream_ms", checked_max_upstream_ms,
            "cap of that correction", flag="--max-upstream-ms", env="PRAZO_MAX_UPSTREAM_MS",
            parse=_milliseconds, metavar="MS"),
    Setting("trusted_proxies", _proxies, "only from this proxy address or network",
            flag="--trusted-proxy", env="PRAZO_TRUSTED_PROXIES", kind="list", metavar="ADDR",
            default_text="any peer"),
    Setting("header_timeout_ms", _positive_ms,
            "a request head not complete this long after its first byte is answered 408 (not waitress, "
            "which reads heads in its I/O thread)",
            flag="--header-timeout-ms", env="PRAZO_HEADER_TIMEOUT_MS", parse=_milliseconds, metavar="T"),
    Setting("yield_when_full", _bool, "gunicorn -w N: a full worker keeps accepting even while a sibling has room",
            flag="--no-yield-when-full", env="PRAZO_YIELD_WHEN_FULL", kind="off"),
    Setting("order", _choice(ORDERS), "who waits: fifo, lifo, or adaptive (LIFO + CoDel shedding)",
            flag="--order", env="PRAZO_ORDER", parse=_word, choices=ORDERS),
    Setting("codel_target_ms", _positive_ms, "--order adaptive: the longest wait while the line stands",
            flag="--codel-target-ms", env="PRAZO_CODEL_TARGET_MS", parse=_milliseconds, metavar="MS",
            adaptive_only=True),
    Setting("codel_interval_ms", _positive_ms, "--order adaptive: how long a non-empty line counts as standing",
            flag="--codel-interval-ms", env="PRAZO_CODEL_INTERVAL_MS", parse=_milliseconds, metavar="MS",
            adaptive_only=True),
    Setting("expected_service_ms", checked_expected_service_ms,
            f"refuse (504) requests with less budget left than this; a number, or one of "
            f"{'/'.join(EXPECTED_SERVICE_QUANTILES)} learned live",
            flag="--expected-service-ms", env="PRAZO_EXPECTED_SERVICE_MS", parse=parse_expected_service_ms,
            metavar="MS|PNN", default_text="off"),
    Setting("limit", _choice(LIMITS), "fixed (--threads) or vegas (adaptive, between --min-concurrency and --threads)",
            flag="--limit", env="PRAZO_LIMIT", parse=_word, choices=LIMITS),
    Setting("min_concurrency", _count(1), "floor of the vegas limit",
            flag="--min-concurrency", env="PRAZO_MIN_CONCURRENCY", parse=_integer, metavar="N"),
    Setting("reserved", _count(0), "threads only critical requests use",
            flag="--reserved", env="PRAZO_RESERVED", parse=_integer, metavar="N"),
    Setting("critical_header", _optional_header_name,
            "a request is critical when this header says 'critical'; clients can send it, so only behind a proxy "
            "that strips it",
            flag="--critical-header", env="PRAZO_CRITICAL_HEADER", metavar="NAME", default_text="none"),
    Setting("critical_paths", _paths, "a path whose requests are critical, e.g. /healthz",
            flag="--critical-path", env="PRAZO_CRITICAL_PATHS", kind="list", metavar="PATH", default_text="none"),
    Setting("agent_port", _optional_port,
            "answer HAProxy's agent-check on this port: the free share of the line as a weight, drain on SIGTERM "
            "(prazo serve, not gunicorn; 0: any free port)",
            flag="--agent-port", env="PRAZO_AGENT_PORT", parse=_integer, metavar="P", default_text="none"),
    Setting("retry_after_s", _optional_seconds,
            "a fixed Retry-After (seconds) on every overload 503 instead of the line's measured wait; "
            "'measured' in the variable is the default",
            flag="--retry-after-s", env="PRAZO_RETRY_AFTER_S", parse=_seconds_or_measured, metavar="S",
            default_text="measured"),
    Setting("load_report", _optional_load_report,
            "add the ORCA endpoint-load-metrics header, text or json, to the app's responses: the line's "
            "utilization, answers and refusals per second, CPU, queue (Envoy's client-side weighted round robin)",
            flag="--load-report", env="PRAZO_LOAD_REPORT", parse=_word, choices=LOAD_REPORT_FORMATS,
            default_text="none"),
    Setting("observe_only", _bool,
            "serve every request as the stock server would and only count what these limits would have refused "
            "(the dry run before enforcing; not the front door yet)",
            flag="--observe-only", env="PRAZO_OBSERVE_ONLY", kind="on"),
    Setting("host_workers", _count(1),
            "a front-door host's worker processes, each of threads threads behind its one line "
            "(prazo serve --server prazo --workers N)"),
)  # fmt: skip

_BY_FIELD = {row.field: row for row in SETTINGS}


def setting(field: str) -> Setting:
    """The row of ``field`` in ``SETTINGS``."""
    return _BY_FIELD[field]


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
    ``prazo serve`` answers HAProxy's agent check on ``agent_port`` (None:
    not at all; ``prazo.bindings.servers.plumbing.agent_check``). An
    overload 503 asks for the line's measured wait (``retry_after_s`` None)
    or a fixed ``Retry-After`` of ``retry_after_s`` seconds. With
    ``load_report`` (``"text"`` or ``"json"``; None: off) the app's responses
    carry the ORCA ``endpoint-load-metrics`` header
    (``prazo.bindings.plumbing.load_report``). With ``observe_only`` every
    request is served as the stock server would serve it, and the line only
    counts what it would have refused (``prazo.core.shadow``).
    Each field's flag, variable and check are its row in ``SETTINGS``.
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
    agent_port: int | None = None
    retry_after_s: int | None = None
    load_report: str | None = None
    observe_only: bool = False
    host_workers: int = 1

    def __post_init__(self) -> None:
        for row in SETTINGS:
            row.check(getattr(self, row.field), row.field)
        if not isinstance(self.critical_paths, tuple):
            raise TypeError(f"critical_paths must be a tuple of paths, not {type(self.critical_paths).__name__}")
        # What depends on another field names each one's flag and variable: either may be the mistake.
        budget_limits(
            self.default_budget_ms,
            self.max_budget_ms,
            (setting("default_budget_ms").label, setting("max_budget_ms").label),
        )
        for row in SETTINGS:
            if (
                row.adaptive_only
                and self.order != "adaptive"
                and getattr(self, row.field) != POLICY_DEFAULTS[row.field]
            ):
                # The queue refuses a CoDel setting that would do nothing: say so at start-up.
                raise ValueError(f"{row.label} only applies with order 'adaptive' (--order adaptive)")
        # Both count the places behind the line: a front-door host's are all its workers' threads.
        places = "threads" if self.host_workers == 1 else "threads x workers"
        if self.min_concurrency > self.places:
            raise ValueError(
                f"{setting('min_concurrency').label} must be <= {places} ({self.places}), got {self.min_concurrency}"
            )
        if self.reserved >= self.places:
            raise ValueError(f"{setting('reserved').label} must be < {places} ({self.places}), got {self.reserved}")

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

    def policies(self) -> dict[str, Any]:
        """Every queue-policy option (``POLICY_DEFAULTS``' keys) with this configuration's value."""
        return {name: getattr(self, name) for name in POLICY_DEFAULTS}

    def queue_options(self) -> dict[str, Any]:
        """The queue-policy keywords for ``AdmissionQueue`` that differ from its defaults."""
        return {
            name: value
            for name, value in self.policies().items()
            if name not in ("critical_header", "critical_paths") and value != POLICY_DEFAULTS[name]
        }

    def fixed_retry_after_s(self) -> int:
        """The ``Retry-After`` of a 503 whose wait is not measured: ``retry_after_s``, else the default second."""
        return DEFAULT_RETRY_AFTER_S if self.retry_after_s is None else self.retry_after_s

    def measured_wait_ns(self, queue: AdmissionQueue) -> int:
        """The wait an overload 503 asks for now: ``queue``'s measured one, or 0 when ``retry_after_s`` fixes it."""
        return queue.retry_after_ns if self.retry_after_s is None else 0

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
        if self.load_report is not None:
            text += f" load_report={self.load_report}"
        if self.observe_only:
            text += " OBSERVE-ONLY (nothing is refused; the counters say what would have been)"
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
    agent_port: int | None = None,
    retry_after_s: int | None = None,
    load_report: str | None = None,
    observe_only: bool | None = None,
    host_workers: int | None = None,
) -> ServerSettings:
    """The settings of an embedding: each argument, else its environment variable, else the default.

    ``settings``, when given, is returned as it is (the embeddings take either
    a complete ``ServerSettings`` or the individual limits, not both).

    Each setting's variable (``PRAZO_MAX_QUEUE``, ``PRAZO_ORDER``, ...; the
    table ``SETTINGS``) is read from ``environ`` (default ``os.environ``); a
    malformed one raises ``ValueError`` naming it. ``PRAZO_CODEL_*`` are
    ignored, with a warning, unless the order is ``adaptive`` (one
    environment file often serves several services). A default budget given
    nowhere is 1000 ms, or the maximum budget when that is lower; one above
    the maximum raises ``ValueError`` naming both. ``max_queue`` defaults to
    four per thread (of every worker, on a front-door host: ``host_workers``
    processes of ``threads`` threads behind one line).

    >>> resolve_settings(threads=2, environ={"PRAZO_MAX_QUEUE": "5"}).capacity
    7
    """
    # The keyword arguments that are settings, by field (all but environ and settings): one per row of SETTINGS.
    passed = dict(locals())
    arguments = {name: value for name, value in passed.items() if name in _BY_FIELD}
    if settings is not None:
        if not isinstance(settings, ServerSettings):
            raise TypeError(f"settings must be a ServerSettings, not {type(settings).__name__}")
        if any(value is not None for value in arguments.values()):
            raise TypeError("pass either settings or the individual limits, not both")
        return settings
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for row in SETTINGS:
        given = arguments[row.field]
        if given is not None:
            values[row.field] = row.check(given, row.field)
            continue
        from_env = row.from_environment(env)
        if from_env is not None and row.adaptive_only and values.get("order") != "adaptive":
            # A variable that does not apply must not stop a service that shares the file; a flag or
            # an argument stays strict (ServerSettings refuses it).
            _log.warning(
                "%s=%s ignored: it only applies with order 'adaptive' (--order adaptive)",
                row.env,
                env.get(row.env or ""),
            )
            continue
        if from_env is not None:
            values[row.field] = from_env
    values.setdefault("threads", DEFAULT_THREADS)
    places = values["threads"] * values.get("host_workers", 1)
    values.setdefault("max_queue", DEFAULT_QUEUE_PER_THREAD * places)
    if "default_budget_ms" not in values and "max_budget_ms" in values:
        # Only a maximum given: the default comes down to it (what the policy would grant anyway).
        values["default_budget_ms"], _ = budget_limits(None, values["max_budget_ms"])
    return ServerSettings(**values)


def settings_environment(settings: ServerSettings) -> dict[str, str]:
    """The ``PRAZO_*`` variables that make ``resolve_settings`` in another process give ``settings`` again.

    Settings with no variable (``threads``, ``host_workers``) are passed another way (gunicorn's ``--threads``).
    """
    return {row.env: row.environment_text(getattr(settings, row.field)) for row in SETTINGS if row.env is not None}


def default_text(row: Setting) -> str | None:
    """What a reader is told of ``row``'s default: its ``default_text``, else the field's default; None if none."""
    if row.default_text is not None:
        return row.default_text
    default = _FIELD_DEFAULTS.get(row.field, dataclasses.MISSING)
    if default is dataclasses.MISSING:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare each setting's flag on ``parser`` (``prazo serve``); ``settings_from_arguments`` checks the values."""
    for row in SETTINGS:
        if row.flag is None:
            continue
        notes = [f"${row.env}"] if row.env is not None else []
        if row.kind == "list":
            notes.append("repeatable" + (", the variable comma-separated" if row.env else ""))
        shown = default_text(row)
        if shown is not None and row.kind not in ("on", "off"):
            notes.append(f"default {shown}")
        options: dict[str, Any] = {"dest": row.field, "default": None, "help": f"{row.help} ({'; '.join(notes)})"}
        if row.kind in ("on", "off"):
            options["action"] = "store_true" if row.kind == "on" else "store_false"
        else:
            options.update(metavar=row.metavar, choices=row.choices)
            if row.kind == "list":
                options["action"] = "append"
        parser.add_argument(row.flag, **options)


_FIELD_DEFAULTS = {
    field.name: field.default
    for field in dataclasses.fields(ServerSettings)
    if field.default is not dataclasses.MISSING
}


def settings_from_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The settings ``prazo serve``'s flags gave (``add_setting_arguments``), checked, each error naming its flag."""
    values = {}
    for row in SETTINGS:
        given = None if row.flag is None else getattr(args, row.field)
        if given is None:
            continue
        # A value flag's text is parsed; a switch's bool and a repeatable flag's list are checked as they are.
        flag = row.flag or row.field
        values[row.field] = row.from_text(given, flag) if isinstance(given, str) else row.check(given, flag)
    return values
