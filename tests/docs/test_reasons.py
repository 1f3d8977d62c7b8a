"""One vocabulary of reasons: ``prazo.core.REASONS`` is what every wire, the C engine and the docs say.

The front door's C engine keeps its reason strings in C (``ANSWERS`` of
``prazo.bindings.servers.frontdoor._engine_c``); this holds them to the registry.
The docs' table of statuses and reasons (``docs/reference/reasons.md``) is built
from the registry when the site is built (``docs/_ext/prazo_reference.py``); here
its rows are built the same way, and must say in words when each registered
reason is given (a reason added to the registry without its row fails).
"""

from __future__ import annotations

import sys

import pytest
from _docs import DOCS
from _required import require_compiled
from prazo.bindings.headers import REASON_HEADER_NAME
from prazo.bindings.integrations.grpc.metadata import REASON_METADATA_KEY
from prazo.bindings.wsgi import status_and_reason
from prazo.core import REASON_SHUTTING_DOWN, REASONS, DeadlineExceeded, DownstreamOverloaded, QueueFull, ShutDown

grpc = pytest.importorskip("grpc")


sys.path.insert(0, str(DOCS / "_ext"))
import prazo_reference  # noqa: E402 - the docs' own extension, from its folder


def test_the_docs_table_lists_exactly_the_registry_with_its_statuses() -> None:
    rows = {row[4]: (row[2], row[3]) for row in prazo_reference.reason_rows()}
    expected = {
        reason.name: (
            str(reason.status) + (" + Retry-After" if reason.name in prazo_reference.RETRY_AFTER_REASONS else ""),
            reason.grpc_code or "—",
        )
        for reason in REASONS.values()
    }
    assert rows == expected
    assert set(prazo_reference.OUTCOMES) == set(REASONS)


def test_a_retry_after_is_promised_only_for_503s() -> None:
    assert all(REASONS[name].status == 503 for name in prazo_reference.RETRY_AFTER_REASONS)


def test_the_settings_table_has_every_server_setting_and_variable() -> None:
    from dataclasses import fields

    from prazo.bindings.servers import settings

    rows = prazo_reference.settings_rows()
    assert [row[0] for row in rows] == [field.name for field in fields(settings.ServerSettings)]
    variables = {row.env for row in settings.SETTINGS if row.env is not None}
    assert {row[2] for row in rows} - {"—"} == variables


def test_every_registered_grpc_code_is_a_grpc_status() -> None:
    for reason in REASONS.values():
        if reason.grpc_code is not None:
            assert grpc.StatusCode[reason.grpc_code]


def test_the_front_door_engine_spells_its_reasons_as_the_registry() -> None:
    engine = require_compiled("prazo.bindings.servers.frontdoor._engine_c")
    assert set(engine.ANSWERS) <= set(REASONS)


@pytest.mark.parametrize(
    "exc",
    [QueueFull(), DeadlineExceeded(), DownstreamOverloaded(), ShutDown()],
    ids=lambda exc: type(exc).__name__,
)
def test_http_answers_each_error_with_its_registered_status(exc: BaseException) -> None:
    status, reason = status_and_reason(exc)
    assert REASONS[reason].status == status


def test_a_shut_down_queue_is_answered_shutting_down_and_the_trailer_is_the_header_lower_cased() -> None:
    # tests/test_grpc.py checks that a shut-down pool's RPC carries the same reason.
    assert status_and_reason(ShutDown()) == (503, REASON_SHUTTING_DOWN)
    assert REASON_HEADER_NAME.lower() == REASON_METADATA_KEY
