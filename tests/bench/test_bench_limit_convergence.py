"""``python -m prazo.bench.limit_convergence``: a short real run draws its plot and reports the settled limit."""

from __future__ import annotations

from pathlib import Path

import pytest
from _required import require
from prazo.bench import limit_convergence


def test_a_short_io_run_traces_the_limit_within_its_bounds() -> None:
    trace = limit_convergence.run_workload("io", seconds=0.5, clients=6, max_concurrency=4)
    assert trace.times_s and len(trace.times_s) == len(trace.limits) == len(trace.in_flight)
    assert all(1 <= limit <= 4 for limit in trace.limits)
    assert all(0 <= in_flight <= 4 for in_flight in trace.in_flight)
    assert trace.completed > 0
    assert "settled limit median" in trace.summary()


def test_the_command_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require("matplotlib")
    target = tmp_path / "limit.png"
    assert (
        limit_convergence.main(["--seconds", "0.3", "--clients", "3", "--workloads", "io", "--plot", str(target)]) == 0
    )
    assert target.stat().st_size > 0
    assert "io: settled limit median" in capsys.readouterr().out


def test_unknown_workloads_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        limit_convergence.main(["--workloads", "disk"])
    assert "--workloads" in capsys.readouterr().err
