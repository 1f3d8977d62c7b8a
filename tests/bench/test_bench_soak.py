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
from typing import Any

import pytest
from prazo.bench.soak import (
    DEFAULT_LOADS,
    HANG_GRACE_S,
    LOADS,
    SoakObservation,
    SoakSettings,
    check_soak,
    rss_kib,
    settings_from,
)
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


def test_the_checker_fails_unbalanced_front_door_counters_even_when_a_worker_lost_requests() -> None:
    # The host's stats as read at rest, one arrival missing from the outcomes: worker_lost is no excuse.
    healthy, host = _healthy(), _balanced_stats(worker_lost=3)
    assert _failed(dataclasses.replace(healthy, queues={**healthy.queues, "host": host})) == []
    unbalanced = dataclasses.replace(healthy, queues={**healthy.queues, "host": {**host, "offered": 99}})
    assert _failed(unbalanced) == ["host: counters balanced"]
    detail = next(check.detail for check in check_soak(unbalanced) if check.name == "host: counters balanced")
    assert detail.endswith("(gap -1)")


def test_the_checker_catches_what_a_host_leaves_behind() -> None:
    healthy = dataclasses.replace(
        _healthy(),
        shutdowns={"host": True},
        process_rss={"triage 10": [(1.0, 20_000), (2.0, 20_400)], "worker 11": [(1.5, 25_000)]},
        fds_baseline=6,
        fds_after=6,
    )
    assert _failed(healthy) == []
    assert healthy.process_rss_growth_kib == {"triage 10": 400, "worker 11": 0}
    assert _failed(dataclasses.replace(healthy, shutdowns={"host": False})) == ["host: shut down cleanly"]
    assert _failed(dataclasses.replace(healthy, children_left=[12])) == ["no child process left"]
    assert _failed(dataclasses.replace(healthy, fds_after=8)) == ["no descriptor left"]
    # One process of many grew past the limit (a worker killed meanwhile has its own series).
    grown = {**healthy.process_rss, "worker 13": [(1.0, 25_000), (3.0, 25_000 + 1025)]}
    assert _failed(dataclasses.replace(healthy, process_rss=grown)) == ["resident memory flat in every process"]


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
    assert default.loads == DEFAULT_LOADS
    assert settings("--loads", "host, frontdoor").loads == ("host", "frontdoor")
    assert settings("--loads", "all").loads == LOADS


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
        (["--loads", "frontdoor,nginx"], "--loads"),
        (["--loads", ","], "--loads"),
    ],
)
def test_bad_options_are_usage_errors_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "soak", *argv])
    assert exited.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def _soak_through_the_cli(*options: str) -> dict[str, Any]:
    """A ``_SOAK_SECONDS`` soak in a subprocess, as a user runs it; its JSON report, every check passed."""
    command = [
        sys.executable, "-c", "import sys; from prazo.bindings.cli import main; sys.exit(main())",
        "bench", "soak", "--seconds", str(_SOAK_SECONDS), "--seed", "7", "--json", *options,
    ]  # fmt: skip
    # The soak's own hang watchdog ends it HANG_GRACE_S after the load; this bound is the backstop.
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=_SOAK_SECONDS + HANG_GRACE_S + 60, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report: dict[str, Any] = json.loads(result.stdout)
    assert report["ok"]
    assert all(check["ok"] for check in report["checks"]), report["checks"]
    for name, stats in report["queues"].items():
        assert stats["offered"] > 0, name
        assert stats["in_flight"] == stats["queued"] == stats["assigned"] == 0, name
    return report


def _check_names(report: dict[str, Any]) -> set[str]:
    return {check["name"] for check in report["checks"]}


def test_a_short_soak_through_the_cli_is_balanced_and_exits_0() -> None:
    # The twin prazo.core picks, as a user runs it: the C twin in `make test`,
    # the Python twin under PRAZO_NO_EXTENSIONS=1 (the pool and waitress
    # always follow that pick, so one run per process).
    report = _soak_through_the_cli()
    assert report["twin"] == IMPLEMENTATION
    assert set(report["queues"]) == {"waitress", "middleware", "pool", "work-queue", "gate"}
    # The faults really happened.
    assert report["loads"]["gate"]["signals_delivered"] > 0
    assert report["loads"]["middleware"]["outcomes"]["app-raised"] > 0
    assert report["loads"]["work-queue"]["outcomes"]["on_expired-called"] > 0
    assert report["threads"]["after"] <= report["threads"]["baseline"]
    assert report["rss"]["samples_kib"]


# The front door's loads need its compiled engine, which is their subject (`make sanitize` runs them).
@pytest.mark.slow
@pytest.mark.compiled
def test_a_short_soak_of_the_front_door_with_slow_clients_passes_every_check() -> None:
    report = _soak_through_the_cli("--loads", "frontdoor")
    assert set(report["queues"]) == {"frontdoor"}
    assert {"frontdoor: shut down cleanly", "no child process left", "no descriptor left"} <= _check_names(report)
    outcomes = report["loads"]["frontdoor"]["outcomes"]
    # The faults really happened: the app raised (500), clients went away, slow clients came.
    assert outcomes["500"] > 0 and outcomes["gone-mid-response"] > 0, outcomes
    assert outcomes["slow-reader-left"] > 0, outcomes
    assert sum(count for outcome, count in outcomes.items() if outcome.startswith("slow-head-")) > 0, outcomes


@pytest.mark.slow
@pytest.mark.compiled
def test_a_short_soak_of_the_host_with_kills_reloads_and_retirements_passes_every_check() -> None:
    report = _soak_through_the_cli("--loads", "host")
    assert set(report["queues"]) == {"host"}
    names = _check_names(report)
    assert {"host: shut down cleanly", "resident memory flat in every process", "no child process left"} <= names
    outcomes = report["loads"]["host"]["outcomes"]
    assert outcomes.get("fault-worker-killed", 0) + outcomes.get("fault-no-worker-to-kill", 0) > 0, outcomes
    assert outcomes["fault-reload"] > 0, outcomes
    # Kills and max_requests retirements both replace workers (a reload's are not counted).
    assert outcomes["server-workers-replaced"] > 0, outcomes
    roles = {name.split()[0] for name in report["process_rss"]}
    assert roles == {"supervisor", "triage", "worker"}, report["process_rss"].keys()
