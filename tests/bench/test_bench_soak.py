"""``prazo bench soak``: a short soak end to end, and a checker that catches what it must.

The soak runs in a subprocess under a timeout: it sends signals to its main
thread, and a queue that deadlocks must fail this test, not hang the suite.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prazo.bench.soak import HANG_GRACE_S, SoakObservation, SoakSettings, check_soak, rss_kib, settings_from
from prazo.bindings.cli import build_parser, main
from prazo.core import IMPLEMENTATION

_SOAK_SECONDS = 5


def _balanced_stats(**changes: int) -> dict[str, int]:
    stats = {
        "offered": 100, "started": 60, "completed": 60, "rejected_full": 20, "expired_on_arrival": 5,
        "expired_in_queue": 10, "cancelled": 5, "queued": 0, "assigned": 0, "in_flight": 0,
    }  # fmt: skip
    stats.update(changes)
    return stats


def _healthy() -> SoakObservation:
    return SoakObservation(
        queues={"gate": _balanced_stats(), "work-queue": _balanced_stats()},
        expired_reported={"work-queue": 10},
        threads_baseline=1,
        threads_after=1,
        thread_exceptions=[],
        unraisable=[],
        rss_samples=[(0.0, 30_000), (1.0, 31_000), (2.0, 31_500), (3.0, 31_200)],
        warmup_sample=1,
        rss_limit_kib=1024,
    )


def _with_gate(**changes: int) -> SoakObservation:
    healthy = _healthy()
    return dataclasses.replace(healthy, queues={**healthy.queues, "gate": _balanced_stats(**changes)})


def _failed(observation: SoakObservation) -> list[str]:
    return [check.name for check in check_soak(observation) if not check.ok]


def test_a_healthy_observation_passes_every_check() -> None:
    checks = check_soak(_healthy())
    assert _failed(_healthy()) == []
    assert {"gate: at rest", "gate: counters balanced", "no thread leak", "resident memory flat"} <= {
        check.name for check in checks
    }


def test_the_checker_catches_a_leaked_slot() -> None:
    # A slot never given back: still in flight, started once more than completed.
    assert _failed(_with_gate(in_flight=1, completed=59)) == ["gate: at rest", "gate: completed == started"]


def test_the_checker_catches_unbalanced_counters_and_a_stranded_waiter() -> None:
    assert _failed(_with_gate(offered=101)) == ["gate: counters balanced"]
    assert _failed(_with_gate(offered=101, queued=1)) == ["gate: at rest"]
    assert _failed(_with_gate(offered=101, assigned=1)) == ["gate: at rest"]


def test_the_checker_catches_an_unreported_expiry() -> None:
    unreported = dataclasses.replace(_healthy(), expired_reported={"work-queue": 9})
    assert _failed(unreported) == ["work-queue: every expired item reported"]


def test_the_checker_catches_leaked_and_dead_threads() -> None:
    assert _failed(dataclasses.replace(_healthy(), threads_after=2)) == ["no thread leak"]
    died = dataclasses.replace(_healthy(), thread_exceptions=["prazo-worker-0: RuntimeError"])
    assert _failed(died) == ["no unhandled exception in a thread"]
    unraisable = dataclasses.replace(_healthy(), unraisable=["ValueError in <AdmittedResponse>"])
    assert _failed(unraisable) == ["no unraisable exception"]


def test_the_checker_catches_memory_growth_over_the_limit() -> None:
    healthy = _healthy()
    assert healthy.rss_growth_kib == 200
    grown = dataclasses.replace(healthy, rss_samples=[*healthy.rss_samples, (4.0, 31_000 + 1025)])
    assert grown.rss_growth_kib == 1025
    assert _failed(grown) == ["resident memory flat"]
    # Growth before the end of the warm-up does not count.
    warming = dataclasses.replace(healthy, rss_samples=[(0.0, 10_000), (1.0, 31_000), (2.0, 31_000)])
    assert _failed(warming) == []


def test_rss_is_read_from_proc_status(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  99999 kB\nVmRSS:\t   12345 kB\nThreads:\t1\n")
    assert rss_kib(str(status)) == 12345
    assert rss_kib(str(tmp_path / "missing")) == 0
    if Path("/proc/self/status").exists():
        assert rss_kib() > 0


def test_minutes_and_seconds_set_the_length_and_a_seed_is_always_chosen() -> None:
    def settings(*argv: str) -> SoakSettings:
        return settings_from(build_parser().parse_args(["bench", "soak", *argv]))

    assert settings("--minutes", "0.5", "--seed", "3").seconds == 30
    assert settings("--seconds", "4").seconds == 4
    default = settings()
    assert default.seconds == SoakSettings().seconds and isinstance(default.seed, int)
    assert settings("--rss-limit-kib", "100").rss_limit_kib == 100


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--minutes", "0"], "--minutes"),
        (["--minutes", "nan"], "--minutes"),
        (["--minutes", "soon"], "--minutes"),
        (["--seconds", "-3"], "--seconds"),
        (["--seconds", "5", "--minutes", "1"], "--minutes"),
        (["--seed", "-1"], "--seed"),
        (["--rss-limit-kib", "lots"], "--rss-limit-kib"),
    ],
)
def test_bad_options_are_usage_errors_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "soak", *argv])
    assert exited.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_a_short_soak_through_the_cli_is_balanced_and_exits_0() -> None:
    # The twin prazo.core picks, as a user runs it: the C twin in `make test`,
    # the Python twin under PRAZO_NO_EXTENSIONS=1 (the pool and waitress
    # always follow that pick, so one run per process).
    command = [
        sys.executable, "-c", "import sys; from prazo.bindings.cli import main; sys.exit(main())",
        "bench", "soak", "--seconds", str(_SOAK_SECONDS), "--seed", "7", "--json",
    ]  # fmt: skip
    # The soak's own hang watchdog ends it HANG_GRACE_S after the load; this bound is the backstop.
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=_SOAK_SECONDS + HANG_GRACE_S + 60, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["twin"] == IMPLEMENTATION
    assert all(check["ok"] for check in report["checks"])
    assert set(report["queues"]) == {"waitress", "middleware", "pool", "work-queue", "gate"}
    for name, stats in report["queues"].items():
        assert stats["offered"] > 0, name
        assert stats["in_flight"] == stats["queued"] == stats["assigned"] == 0, name
    # The faults really happened.
    assert report["loads"]["gate"]["signals_delivered"] > 0
    assert report["loads"]["middleware"]["outcomes"]["app-raised"] > 0
    assert report["loads"]["work-queue"]["outcomes"]["on_expired-called"] > 0
    assert report["threads"]["after"] <= report["threads"]["baseline"]
    assert report["rss"]["samples_kib"]
