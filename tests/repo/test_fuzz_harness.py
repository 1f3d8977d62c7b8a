"""The fuzz harness itself: what ``python -m fuzz`` does on a finding, and the middleware target's timing rule.

Without atheris (``tests/fuzz/_runner.py`` needs none): a finding must leave
its input where libFuzzer would, and the middleware target must not call a
difference between paths a bug when only timing made it.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import load_twin
from fuzz import _runner, fuzz_middleware


def test_artifact_path_is_libfuzzers() -> None:
    data = b"GET /\n"
    sha1 = hashlib.sha1(data).hexdigest()
    assert _runner.artifact_path(["prog"], data) == Path(f"./crash-{sha1}")
    assert _runner.artifact_path(["prog", "-artifact_prefix=out/mw-"], data) == Path(f"out/mw-crash-{sha1}")
    assert _runner.artifact_path(["prog", "-artifact_prefix=out/", "-exact_artifact_path=x"], data) == Path("x")


def test_a_finding_saves_its_input_then_aborts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    aborted: list[bool] = []

    def target(data: bytes) -> None:
        if data == b"bad":
            raise AssertionError("paths differ")

    run = _runner.crash_at_once(target, ["prog", f"-artifact_prefix={tmp_path}/mw-"], lambda: aborted.append(True))
    run(b"good")
    assert not aborted and not list(tmp_path.iterdir())
    # The stand-in abort returns, so the exception goes on; os.abort never returns.
    with pytest.raises(AssertionError, match="paths differ"):
        run(b"bad")
    assert aborted == [True]
    saved = tmp_path / f"mw-crash-{hashlib.sha1(b'bad').hexdigest()}"
    assert saved.read_bytes() == b"bad"
    err = capsys.readouterr().err
    assert "Uncaught Python exception" in err and "AssertionError: paths differ" in err and str(saved) in err


def test_keyboard_interrupt_is_not_a_finding(tmp_path: Path) -> None:
    def target(data: bytes) -> None:
        raise KeyboardInterrupt

    run = _runner.crash_at_once(target, ["prog", f"-artifact_prefix={tmp_path}/"], lambda: pytest.fail("aborted"))
    with pytest.raises(KeyboardInterrupt):
        run(b"x")
    assert not list(tmp_path.iterdir())


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
