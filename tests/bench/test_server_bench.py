"""``prazo bench servers``: the app's bookkeeping and a short run end to end."""

from __future__ import annotations

import io

import pytest
from prazo.bench.servers import BenchState, ServerBenchSettings, bench_servers, run_server_bench


def test_work_finished_after_the_client_gave_up_is_wasted() -> None:
    state = BenchState(threads=2, work_ms=5)
    state.record(started_ns=100, finished_ns=200, give_up_ns=300)
    state.record(started_ns=100, finished_ns=400, give_up_ns=300)
    state.record(started_ns=100, finished_ns=400, give_up_ns=None)
    assert state.snapshot() == {"worked": 3, "wasted": 1, "wasted_ns": 300}


def test_a_short_run_measures_both_variants() -> None:
    settings = ServerBenchSettings(servers=("wsgiref",), threads=2, max_queue=2, work_ms=10, duration_s=0.4)
    plain = run_server_bench("wsgiref", prazo=False, settings=settings)
    admitted = run_server_bench("wsgiref", prazo=True, settings=settings)
    assert (plain.variant, admitted.variant) == ("plain", "prazo")
    # The stock server never refuses; prazo refuses what is beyond its capacity.
    assert plain.refused == 0
    assert admitted.refused > 0 and admitted.latencies_ok_s
    assert admitted.errors == plain.errors == 0


def test_the_command_prints_a_table_and_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert bench_servers(["--servers", "werkzeug", "--duration", "0.3", "--threads", "2", "--max-queue", "2"], out) == 0
    table = out.getvalue()
    assert "werkzeug   plain" in table and "werkzeug   prazo" in table and "goodput/s" in table
    assert bench_servers(["--servers", "nginx"], io.StringIO()) == 2
    assert "--servers must name some of" in capsys.readouterr().err
    assert bench_servers(["--work-ms", "nan"], io.StringIO()) == 2
