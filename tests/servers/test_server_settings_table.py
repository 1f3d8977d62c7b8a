"""Each server setting is declared once, in ``settings.SETTINGS``, and everything reads that row.

The flag, the variable and the check of a setting used to be written in up to
eight places (the settings, the command, the front door); a value checked in
one and not another went through. Here: every row's check names whatever the
user wrote (the argument, the flag or the variable), and the variables a
parent writes for its workers read back as the same settings. That each flag
and variable is written in one source file is ``tests/repo/test_one_declaration.py``
(it reads the source tree).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from prazo.bindings.servers.serve import build_serve_parser, main_serve
from prazo.bindings.servers.settings import (
    SETTINGS,
    ServerSettings,
    resolve_settings,
    settings_environment,
    settings_from_arguments,
)

# A text each setting's parser or check refuses, for the rows a flag or a variable can bring in.
BAD_TEXT = {
    "threads": "four",
    "max_queue": "-1",
    "default_budget_ms": "0",
    "max_budget_ms": "nan",
    "trust_request_start": "maybe",
    "max_upstream_ms": "-5",
    "trusted_proxies": "10.0.0.1,bogus",
    "header_timeout_ms": "soon",
    "yield_when_full": "perhaps",
    "order": "random",
    "codel_target_ms": "0",
    "codel_interval_ms": "-1",
    "expected_service_ms": "p42",
    "limit": "aimd",
    "min_concurrency": "0",
    "reserved": "-1",
    "critical_header": "X_Priority",
    "critical_paths": "healthz",
    "agent_port": "70000",
    "retry_after_s": "soon",
    "load_report": "xml",
    "observe_only": "sometimes",
}


def test_every_field_has_one_row_in_field_order() -> None:
    assert [row.field for row in SETTINGS] == [field.name for field in dataclasses.fields(ServerSettings)]


def test_every_row_a_flag_or_variable_brings_in_has_a_bad_example() -> None:
    assert {row.field for row in SETTINGS if row.flag or row.env} - {"threads"} <= set(BAD_TEXT)


@pytest.mark.parametrize("row", [row for row in SETTINGS if row.env is not None], ids=lambda row: row.field)
def test_a_bad_variable_is_refused_naming_the_variable(row: Any) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(row.env)):
        # CoDel's variables apply with adaptive order only (else ignored): the order comes first, the bad one last.
        resolve_settings(environ={"PRAZO_ORDER": "adaptive", row.env: BAD_TEXT[row.field]})


@pytest.mark.parametrize(
    "row",
    [row for row in SETTINGS if row.flag is not None and row.kind not in ("on", "off")],
    ids=lambda row: row.field,
)
def test_a_bad_flag_is_refused_naming_the_flag(
    row: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [row.env for row in SETTINGS if row.env]:
        monkeypatch.delenv(name, raising=False)
    bad = BAD_TEXT[row.field].split(",")[-1]
    try:
        status = main_serve(["os.path:join", "--port", "0", row.flag, bad])
    except SystemExit as exc:  # argparse's own refusal of a choice
        status = exc.code
    assert status == 2
    assert row.flag in capsys.readouterr().err


@hypothesis_settings(max_examples=60, deadline=None)
@given(
    threads=st.integers(1, 8),
    queue=st.integers(0, 50),
    budget=st.floats(1, 30000, allow_nan=False),
    order=st.sampled_from(["fifo", "lifo", "adaptive"]),
    target=st.floats(0.5, 50, allow_nan=False),
    expected=st.one_of(st.none(), st.sampled_from(["p50", "p99"]), st.floats(0.5, 900, allow_nan=False)),
    paths=st.lists(st.sampled_from(["/healthz", "/readyz", "/a"]), max_size=3, unique=True),
    proxies=st.one_of(
        st.none(), st.lists(st.sampled_from(["10.0.0.0/8", "::1", "127.0.0.1"]), min_size=1, unique=True)
    ),
    trust=st.booleans(),
    yield_when_full=st.booleans(),
    header=st.one_of(st.none(), st.sampled_from(["X-Priority", "X-Class"])),
    load_report=st.sampled_from([None, "text", "json"]),
)
def test_the_variables_written_for_workers_read_back_as_the_same_settings(
    threads: int, queue: int, budget: float, order: str, target: float, expected: Any, paths: list[str],
    proxies: Any, trust: bool, yield_when_full: bool, header: Any, load_report: Any,
) -> None:  # fmt: skip
    original = resolve_settings(
        threads=threads, max_queue=queue, default_budget_ms=budget, order=order,
        codel_target_ms=target if order == "adaptive" else None, expected_service_ms=expected,
        critical_paths=paths, trusted_proxies=proxies, trust_request_start=trust,
        yield_when_full=yield_when_full, critical_header=header, load_report=load_report, environ={},
    )  # fmt: skip
    again = resolve_settings(threads=threads, environ=settings_environment(original))
    assert again == original


def test_the_flags_give_the_arguments_resolve_settings_takes() -> None:
    args = build_serve_parser().parse_args(
        ["m:a", "--threads", "3", "--critical-path", "/a", "--critical-path", "/b", "--no-yield-when-full",
         "--expected-service-ms", "P95", "--order", "adaptive", "--codel-target-ms", "7"]
    )  # fmt: skip
    given_values = settings_from_arguments(args)
    assert given_values == {
        "threads": 3, "critical_paths": ("/a", "/b"), "yield_when_full": False, "expected_service_ms": "p95",
        "order": "adaptive", "codel_target_ms": 7.0,
    }  # fmt: skip
    assert resolve_settings(**given_values, environ={}).critical_paths == ("/a", "/b")
