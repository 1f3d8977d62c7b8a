"""The fuzz harness itself, without atheris: the middleware target's timing rule.

The middleware target must not call a difference between paths a bug when
only timing made it, and must still compare them when timing cannot matter.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _helpers import load_twin
from fuzz import fuzz_middleware


def test_a_stall_under_a_short_outer_deadline_is_no_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CI run failed once so: the default budget (1 s, "stable") but an outer
    # deadline of a few ms, and the first path stalled past it (a busy
    # machine): 504 expired-on-arrival there, 200 on the other paths. The
    # stall is made here, on the first path only.
    real_context = fuzz_middleware.deadline_context
    calls: list[int] = []

    def stalling_context(deadline: Any) -> Any:
        context = real_context(deadline)
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.05)
        return context

    monkeypatch.setattr(fuzz_middleware, "deadline_context", stalling_context)
    fuzz_middleware.test_one_input(b"GET /\n\nouter=20\napp=str\n")
    assert len(calls) == len(fuzz_middleware._PATHS)


def test_a_long_outer_deadline_is_still_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    # outer=5000 leaves the request its whole default budget of 1 s: the paths
    # must agree, so a path answering differently is still a finding.
    real_run_path = fuzz_middleware._run_path
    runs: list[int] = []

    def one_path_differs(*args: Any) -> Any:
        outcome = real_run_path(*args)
        runs.append(1)
        return outcome._replace(status="418 I'm a teapot") if len(runs) == 2 else outcome

    load_twin("c")  # one path alone (no C twin) has nothing to compare: skipped or failed as the suite says
    monkeypatch.setattr(fuzz_middleware, "_run_path", one_path_differs)
    with pytest.raises(AssertionError):
        fuzz_middleware.test_one_input(b"GET /\n\nouter=5000\napp=str\n")
