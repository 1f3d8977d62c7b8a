"""One vocabulary of reasons: ``prazo.core.REASONS`` is what every wire, the C engine and the README say.

The front door's C engine keeps its reason strings in C (``ANSWERS`` of
``prazo.bindings.servers._frontdoor_c``); this holds them to the registry.
README's table "Outcomes, statuses and reasons" lists exactly the registry's
reasons, each with its HTTP status and gRPC status.
"""

from __future__ import annotations

import re

import pytest
from _readme import section
from _required import require_compiled
from prazo.bindings.headers import REASON_HEADER_NAME
from prazo.bindings.integrations.grpc.metadata import REASON_METADATA_KEY
from prazo.bindings.wsgi import status_and_reason
from prazo.core import REASON_SHUTTING_DOWN, REASONS, DeadlineExceeded, DownstreamOverloaded, QueueFull, ShutDown

grpc = pytest.importorskip("grpc")


def _readme_rows() -> dict[str, tuple[int, str | None]]:
    """``reason -> (HTTP status, gRPC status or None)`` from the README's outcome table."""
    rows = {}
    for line in section("## Outcomes, statuses and reasons").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not re.fullmatch(r"`[a-z-]+`", cells[4]):
            continue
        status = re.match(r"\*{0,2}(\d{3})", cells[2])
        assert status, line
        grpc_code = None if cells[3] == "—" else cells[3].strip("`")
        rows[cells[4].strip("`")] = (int(status.group(1)), grpc_code)
    return rows


def test_the_readme_table_lists_exactly_the_registry_with_its_statuses() -> None:
    assert _readme_rows() == {reason.name: (reason.status, reason.grpc_code) for reason in REASONS.values()}


def test_every_registered_grpc_code_is_a_grpc_status() -> None:
    for reason in REASONS.values():
        if reason.grpc_code is not None:
            assert grpc.StatusCode[reason.grpc_code]


def test_the_front_door_engine_spells_its_reasons_as_the_registry() -> None:
    engine = require_compiled("prazo.bindings.servers._frontdoor_c")
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
