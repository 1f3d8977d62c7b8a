"""``prazo demo slow-dependency``: the second seed's incident, without and with prazo.

One ``--quick --json`` run through the command (both setups, about 30 s on
a loaded 2-core machine) and checks of what must hold on any machine: the
arithmetic leaves no doubt, whatever the speed. Recommendations arrive at
100/s and take 2 s during the incident, so 200 calls want to be in flight:

* without prazo the shared pool of 50 fills, the 64 server threads fill
  waiting for it, and the health probe (1 s timeout) waits in the server's
  queue behind them;
* with prazo at most 20 recommendation calls are in flight and no caller
  waits more than 200 ms for one, so health and product are answered at
  once and recommendations come back stale (or as a fast 503).

Latency bounds are generous (a second where the normal answer is a few ms);
nothing asserts on raw speed. The tables, JSON and plot are checked on
made-up records, which is instant.
"""

from __future__ import annotations

import builtins
import io
import json
from pathlib import Path
from typing import Any

import pytest
from _required import require
from prazo.bench.demo_slow_dependency import (
    ENDPOINTS,
    MIX,
    PHASES,
    QUICK_PARAMS,
    DemoResult,
    PhaseStats,
    Record,
    SetupResult,
    SlowDependencyParams,
    load_argv,
    plot_timeline,
    render_report,
)
from prazo.bench.loadgen import build_parser, build_schedule
from prazo.bindings.cli import main


@pytest.fixture(scope="module")
def quick_run() -> dict[str, Any]:
    out = io.StringIO()
    assert main(["demo", "slow-dependency", "--quick", "--json"], out) == 0
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def _during(run: dict[str, Any], setup: str, endpoint: str) -> dict[str, Any]:
    cell: dict[str, Any] = run["setups"][setup]["table"][endpoint]["during"]
    return cell


@pytest.mark.slow
def test_with_prazo_health_and_product_keep_answering_during_the_incident(quick_run: dict[str, Any]) -> None:
    for endpoint in ("/health", "/product", "/cart"):
        cell = _during(quick_run, "with", endpoint)
        assert cell["requests"] > 0
        assert cell["error_rate"] <= 0.05, (endpoint, cell)
        assert cell["p99_ms"] < 1000, (endpoint, cell)


@pytest.mark.slow
def test_with_prazo_recommendations_are_answered_stale_or_refused_fast(quick_run: dict[str, Any]) -> None:
    cell = _during(quick_run, "with", "/recommendations")
    # A stale answer is a 200; a key never seen before gets a fast 503.
    assert cell["stale_share"] + cell["error_rate"] >= 0.9, cell
    assert cell["stale_share"] >= 0.5, cell
    # The remote takes 2 s; the caller waited at most the 200 ms timeout.
    assert cell["p99_ms"] < 1500, cell
    peaks = quick_run["setups"]["with"]["peaks"]
    assert peaks["bulkhead_in_flight"] <= QUICK_PARAMS.bulkhead
    # The alerting signals saw the incident: the calls that did run took 2 s.
    assert peaks["bulkhead_saturation"] == 1.0
    assert peaks["recommendations_p99_ms"] >= 1000


@pytest.mark.slow
def test_without_prazo_the_shared_pool_fills_and_takes_health_down(quick_run: dict[str, Any]) -> None:
    without = quick_run["setups"]["without"]
    assert without["peaks"]["pool_running"] == QUICK_PARAMS.shared_pool
    assert without["peaks"]["server_busy"] == QUICK_PARAMS.server_threads
    health = _during(quick_run, "without", "/health")
    assert health["error_rate"] >= 0.25, health
    product_without = _during(quick_run, "without", "/product")
    product_with = _during(quick_run, "with", "/product")
    assert product_without["p99_ms"] > 1000, product_without
    assert product_without["p99_ms"] > 5 * product_with["p99_ms"]


@pytest.mark.slow
def test_both_setups_got_the_same_traffic_and_the_generator_reports_its_lag(quick_run: dict[str, Any]) -> None:
    sent = {name: setup["requests"] for name, setup in quick_run["setups"].items()}
    p = QUICK_PARAMS
    planned = build_schedule(build_parser().parse_args(load_argv(p, port=1)))
    assert sent == {"without": len(planned), "with": len(planned)}
    assert {arrival.target.partition("?")[0] for arrival in planned} == set(MIX)
    assert {a.budget_ms for a in planned if a.target.startswith("/health?")} == {p.health_timeout_s * 1000}
    for setup in quick_run["setups"].values():
        assert set(setup["generator_lag_ms"]) == {"p50", "p99", "max"}
        assert set(setup["table"]) == set(ENDPOINTS)
    assert any("phases 3 s / 6 s / 4 s" in note for note in quick_run["notes"])


# -- the pieces, on made-up records (instant) -----------------------------------------------


def _record(endpoint: str, at_s: float, latency_ms: float, status: int = 200, stale: float | None = None) -> Record:
    scheduled = int(at_s * 1e9)
    return Record(endpoint, scheduled, scheduled, scheduled + int(latency_ms * 1e6), status, None, stale)


def _made_up(setup: str) -> SetupResult:
    params = SlowDependencyParams(before_s=1, during_s=1, after_s=1)
    records = [_record(e, t, 5.0) for e in ENDPOINTS for t in (0.5, 1.5, 2.5)]
    records += [_record("/recommendations", 1.6, 2.0, stale=12.5), _record("/health", 1.7, 1000.0, status=0)]
    return SetupResult(setup, params, 0, 1_000_000_000, 2_000_000_000, records, [{"t_s": 1.0, "pool_running": 3}])


def test_phases_percentiles_errors_and_stale_shares() -> None:
    result = _made_up("without")
    table = result.table()
    assert set(table) == set(ENDPOINTS) and all(set(row) == set(PHASES) for row in table.values())
    health = table["/health"]["during"]
    assert (health.requests, health.errors, health.error_rate) == (2, 1, 0.5)
    assert health.p50_ms == pytest.approx(5.0) and health.p99_ms == pytest.approx(1000.0)
    recs = table["/recommendations"]["during"]
    assert (recs.stale, recs.stale_share) == (1, 0.5)
    assert table["/product"]["before"] == PhaseStats(1, 5.0, 5.0, 5.0, 0, 0)
    assert PhaseStats.of([]).error_rate == 0.0


def test_the_report_prints_both_tables_and_the_incident_side_by_side() -> None:
    result = DemoResult(SlowDependencyParams(), {s: _made_up(s) for s in ("without", "with")}, ["note one"])
    report = render_report(result)
    assert "without prazo — stock waitress" in report
    assert 'with prazo — prazo\'s waitress embedding, 64 threads, queue 64; Dependency("recommendations"' in report
    assert "during the incident — p99 ms / errors / stale" in report
    assert "note: note one" in report
    assert json.loads(json.dumps(result.to_json()))["setups"]["with"]["table"]["/health"]["during"]["errors"] == 1


def test_the_plot_is_written(tmp_path: Path) -> None:
    require("matplotlib")
    result = DemoResult(SlowDependencyParams(), {s: _made_up(s) for s in ("without", "with")}, [])
    path = tmp_path / "timeline.png"
    plot_timeline(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    # Refused before any server starts: the check comes first.
    assert main(["demo", "slow-dependency", "--plot", "x.png"], io.StringIO()) == 1
    assert "pip install 'prazo[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"bulkhead": 0}, {"rate_per_s": 0}, {"before_s": -1}, {"slow_ms": float("nan")}])
def test_bad_parameters_are_refused_by_name(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SlowDependencyParams(**bad)
