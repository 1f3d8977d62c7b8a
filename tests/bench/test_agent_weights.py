"""``python -m prazo.bench.agent_weights``: HAProxy round robin over a fast and a slow prazo instance, a short point.

Which mode wins by how much depends on the machine and is only reported
(bench/RESULTS.md); what must hold anywhere: round robin gives each instance
about half the answers at a load both can take, every answer the experiment
counts came through a real HAProxy from one of the two, and the report names
both modes.
"""

from __future__ import annotations

import io
from pathlib import Path

from _services import haproxy_binary
from prazo.bench.agent_weights import main, run_point


def test_round_robin_splits_the_answers_between_the_two_instances(tmp_path: Path) -> None:
    haproxy_binary()  # fails in CI, skips elsewhere, when HAProxy is missing
    point = run_point("round-robin", 0.4, 2.0, tmp_path)
    assert point.requests > 50 and point.refused_503 <= point.requests
    assert 0.3 < point.fast_share < 0.7 and abs(point.fast_share + point.slow_share - 1.0) < 1e-9


def test_the_command_reports_both_modes() -> None:
    haproxy_binary()
    out = io.StringIO()
    assert main(["--loads", "0.3", "--seconds", "1"], out) == 0
    report = out.getvalue()
    assert "| round-robin |" in report and "| agent-check |" in report
