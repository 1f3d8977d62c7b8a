"""``python -m prazo.bench.retry_after``: the measured Retry-After against a fixed one, a short point.

Which wait leaves fewer retries refused again depends on the profile and is
only reported (bench/RESULTS.md); what must hold anywhere: at twice the
capacity the line refuses first attempts, every refused call is either
retried once or gave up, a retry is refused again at most once, and the
command refuses a profile it does not know.
"""

from __future__ import annotations

import io

import pytest
from prazo.bench.retry_after import main, run_point


def test_each_refused_call_is_retried_once_or_gives_up() -> None:
    point = run_point("fast", fixed=False, load=2.0, seconds=4.5)
    assert point.calls > 40
    assert point.first_refused > 0, "at twice the capacity the line refuses"
    assert point.retries + point.gave_up <= point.first_refused
    assert point.refused_again <= point.retries
    assert point.good_per_s > 0


def test_an_unknown_profile_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--profiles", "medium"], io.StringIO())
    assert "--profiles: unknown medium" in capsys.readouterr().err
