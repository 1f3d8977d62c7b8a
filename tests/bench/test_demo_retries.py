"""``prazo demo retries``: the amplification experiment, on a short run through the command.

What must hold on any machine, whatever its speed: with the budget
(``percent=0.1``, ``min_per_s=0``) B never receives more than 1.1 arrivals
per client request, since every call deposits a tenth of a token before
its first attempt and each retry spends a whole one; no retry arrives after
its client's deadline; no request B answered 504 is sent again; and the
command's exit status says so. Naive's amplification depends on how
overloaded B gets on this machine and is only reported, never asserted.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from _required import require
from prazo.bench.demo_retries import QUICK_PARAMS, plot_experiment, render_report, run_experiment
from prazo.bindings.cli import main

SHORT = dataclasses.replace(QUICK_PARAMS, rate_per_s=30.0, duration_s=1.0, light_rate_per_s=8.0, light_duration_s=1.0)


@pytest.fixture(scope="module")
def short_run() -> Any:
    return run_experiment(SHORT)


def test_the_budget_bounds_the_load_at_b(short_run: Any) -> None:
    prazo = short_run.prazo
    assert len(prazo.requests) == int(SHORT.rate_per_s * SHORT.duration_s)
    assert len(prazo.arrivals) <= len(prazo.requests) * (1 + SHORT.percent)
    assert prazo.notes["policy"]["retries"] <= SHORT.percent * prazo.notes["policy"]["calls"]


def test_no_retry_after_a_deadline_and_none_of_a_504(short_run: Any) -> None:
    assert short_run.prazo.retries_after_deadline() == 0
    assert short_run.prazo.retries_of_a_504() == 0
    assert short_run.light.retries_after_deadline() == 0


def test_a_throttled_a_sends_b_no_more_first_attempts_than_it_did_not_refuse(short_run: Any) -> None:
    # Without the throttle every client request reaches B; with it, a request A refused itself never does,
    # and each such refusal is counted. How many it refuses depends on how overloaded B gets here: not asserted.
    unthrottled, throttled = short_run.unthrottled, short_run.throttled
    assert len({a.request_id for a in unthrottled.arrivals}) == len(unthrottled.requests)
    never_sent = len(throttled.requests) - len({a.request_id for a in throttled.arrivals})
    assert 0 <= never_sent <= throttled.notes["policy"]["throttled_locally"]
    assert unthrottled.notes["policy"]["throttled_locally"] == 0
    assert len(throttled.arrivals) <= len(throttled.requests) * (1 + SHORT.percent)


def test_the_report_and_the_plot(short_run: Any, tmp_path: Path) -> None:
    report = render_report(short_run)
    assert "offered load at B (× client requests)" in report and "light faults" in report
    assert "callers that throttle themselves" in report
    summary = short_run.to_json()
    assert set(summary) >= {"params", "naive", "prazo", "light", "unthrottled", "throttled"}
    assert summary["prazo"]["buckets"][0]["sent"] > 0
    json.dumps(summary)
    require("matplotlib")
    path = tmp_path / "retries.png"
    plot_experiment(short_run, str(path))
    assert path.stat().st_size > 0


def test_the_command_prints_the_experiment_as_json(short_run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The command's wiring (flags, JSON, exit status) on the run above, not a second run.
    import prazo.bench.demo_retries as demo

    asked: list[Any] = []

    def run(params: Any) -> Any:
        asked.append(params)
        return short_run

    monkeypatch.setattr(demo, "run_experiment", run)
    out = io.StringIO()
    status = main(["demo", "retries", "--quick", "--json", "--rate", "20", "--seed", "3"], out=out)
    summary = json.loads(out.getvalue())
    assert status == 0
    assert summary["prazo"]["retries_after_deadline"] == 0 and summary["prazo"]["retries_of_a_504"] == 0
    (params,) = asked
    assert params.rate_per_s == 20.0 and params.seed == 3 and params.duration_s == QUICK_PARAMS.duration_s
