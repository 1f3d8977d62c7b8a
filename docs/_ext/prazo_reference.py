"""The reference tables that are read from the code when the site is built, never copied by hand.

``prazo-settings``
    Every row of ``prazo.bindings.servers.settings.SETTINGS``, the one table
    that declares each field of ``ServerSettings`` (what the server embeddings
    and ``prazo serve`` take): its argument, its ``prazo serve`` flag, its
    environment variable, its default and what it does. A field without a row
    fails the build (``ServerSettings`` checks every field through its row).

``prazo-serve-flags``
    The ``prazo serve`` options that are no setting (which server, where, how
    many processes), from the command's own argparse parser.

``prazo-reasons``
    Every reason of ``prazo.core.REASONS`` with its HTTP and gRPC status, from the
    registry, and the outcome, exception and fate of the work from ``OUTCOMES``
    below. A reason without a row here, or a row whose reason is not registered,
    fails the build.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

# The prose of the reasons table, by reason: (outcome, exception, what happens to the work).
# The statuses come from the registry; this only says in words when each reason is given.
OUTCOMES: dict[str, tuple[str, str, str]] = {
    "queue-full": ("every slot busy and the queue full", "QueueFull (a queue.Full)", "never starts"),
    "expired-on-arrival": (
        "the deadline had passed on arrival (budget ≤ 0)",
        "DeadlineExceeded (a TimeoutError)",
        "never starts",
    ),
    "expired-in-queue": ("the deadline passed while waiting for a slot", "DeadlineExceeded", "never starts"),
    "deadline-exceeded": (
        "the app ran out of time (Deadline.check(), a DB call — sqlite3, PostgreSQL — a client timeout)",
        "DeadlineExceeded",
        "was cut short",
    ),
    "no-budget-for-downstream": (
        "nothing left to give a downstream call",
        "DeadlineExceeded",
        "the call is not made",
    ),
    "downstream-overloaded": ("a downstream answered 503", "DownstreamOverloaded", "stays a 503 up the chain"),
    "throttled-locally": (
        "the caller's adaptive throttle refused the attempt (its destination has been refusing)",
        "Throttled (a DownstreamOverloaded)",
        "is never sent; a 503 up the chain",
    ),
    "shutting-down": (
        "the queue or the server was shut down",
        "ShutDown (a queue.ShutDown on 3.13+)",
        "never starts",
    ),
    "bulkhead-full": (
        "a Dependency's bulkhead is full (no stale value)",
        "DependencyUnavailable (a DownstreamOverloaded)",
        "fn never starts",
    ),
    "breaker-open": ("a Dependency's breaker is open (no stale value)", "DependencyUnavailable", "fn never starts"),
    "dependency-timeout": (
        "a Dependency did not answer within its timeout (no stale value)",
        "DependencyUnavailable",
        "fn runs on, on the dependency's thread, until it returns",
    ),
    "dependency-unavailable": (
        "no thread could be started for a Dependency call",
        "DependencyUnavailable",
        "fn never starts",
    ),
    "insufficient-budget": (
        "less budget left than the expected service time (expected_service_ms), on arrival or while waiting",
        "DeadlineExceeded",
        "never starts",
    ),
    "shed-standing-queue": (
        'order="adaptive": waited longer than CoDel allows in a standing line',
        "QueueFull",
        "never starts",
    ),
    "evicted-by-critical": (
        "a critical request took its place in a full line (reserved, critical)",
        "QueueFull",
        "never starts",
    ),
    "header-timeout": ("a server's request head not complete within its header timeout", "—", "never starts"),
    "bad-request": ("the front door read a malformed or ambiguous request head", "—", "never starts"),
    "head-too-large": ("the front door read a request head larger than 64 KiB", "—", "never starts"),
}

# Statuses that tell the client to come back later carry Retry-After.
RETRY_AFTER_REASONS = {
    "queue-full",
    "bulkhead-full",
    "breaker-open",
    "dependency-timeout",
    "dependency-unavailable",
    "shed-standing-queue",
    "evicted-by-critical",
}


def _table(header: list[str], rows: list[list[str]], literal_columns: set[int]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    body = nodes.tbody()
    group += body

    def row(cells: list[str], literal: bool) -> nodes.row:
        out = nodes.row()
        for index, text in enumerate(cells):
            entry = nodes.entry()
            if literal and index in literal_columns and text not in ("", "—"):
                paragraph = nodes.paragraph()
                for position, part in enumerate(text.split(" / ")):
                    if position:
                        paragraph += nodes.Text(" / ")
                    paragraph += nodes.literal(text=part)
                entry += paragraph
            else:
                entry += nodes.paragraph(text=text)
            out += entry
        return out

    head += row(header, False)
    for cells in rows:
        body += row(cells, True)
    return table


def settings_rows() -> list[list[str]]:
    """One row per setting: argument, flag, variable, default, meaning."""
    from prazo.bindings.servers import settings

    rows = []
    fields = [field.name for field in dataclasses.fields(settings.ServerSettings)]
    if [row.field for row in settings.SETTINGS] != fields:
        raise ExtensionError("settings.SETTINGS is out of step with ServerSettings' fields")
    for row in settings.SETTINGS:
        flag = row.flag or "—"
        if row.kind == "off":
            flag += " (off)"
        if row.kind == "list":
            flag += " (repeatable)"
        rows.append([row.field, flag, row.env or "—", settings.default_text(row) or "—", row.help])
    return rows


def command_only_rows() -> list[list[str]]:
    """The ``prazo serve`` flags that are no setting (where to listen, which server, ...)."""
    from prazo.bindings.servers import settings
    from prazo.bindings.servers.serve import build_serve_parser

    flags = {row.flag for row in settings.SETTINGS}
    rows = []
    for action in build_serve_parser()._actions:
        if not action.option_strings or action.dest == "help" or action.option_strings[0] in flags:
            continue
        default = "—" if action.default is None else _plain(action.default)
        rows.append([" / ".join(action.option_strings), default, action.help or ""])
    return rows


def _plain(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def reason_rows() -> list[list[str]]:
    from prazo.core import REASONS

    missing = set(REASONS) - set(OUTCOMES)
    unknown = set(OUTCOMES) - set(REASONS)
    if missing or unknown:
        raise ExtensionError(
            f"OUTCOMES is out of step with REASONS: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    rows = []
    for reason in REASONS.values():
        outcome, exception, work = OUTCOMES[reason.name]
        status = f"{reason.status}" + (" + Retry-After" if reason.name in RETRY_AFTER_REASONS else "")
        rows.append([outcome, exception, status, reason.grpc_code or "—", reason.name, work])
    return rows


class SettingsDirective(Directive):
    def run(self) -> list[nodes.Node]:
        return [
            _table(
                ["argument", "prazo serve flag", "environment", "default", "meaning"],
                settings_rows(),
                {0, 1, 2},
            )
        ]


class ServeFlagsDirective(Directive):
    def run(self) -> list[nodes.Node]:
        return [_table(["prazo serve flag", "default", "meaning"], command_only_rows(), {0})]


class ReasonsDirective(Directive):
    def run(self) -> list[nodes.Node]:
        return [
            _table(
                ["outcome", "exception", "status", "gRPC status", "reason / X-Prazo-Reason", "the work…"],
                reason_rows(),
                {3, 4},
            )
        ]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("prazo-settings", SettingsDirective)
    app.add_directive("prazo-serve-flags", ServeFlagsDirective)
    app.add_directive("prazo-reasons", ReasonsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
