"""``prazo bench goodput``: the schedule, the statistics, the report's shape, and one short real run."""

from __future__ import annotations

import io
import itertools
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from prazo.bench.goodput import (
    SERVERS,
    GoodputSettings,
    PointResult,
    bench_goodput,
    percentile,
    render_row,
    render_table,
    started,
    summarize,
)
from prazo.bench.goodput_apps import ENV_STATS_DIR, GIVE_UP_HEADER, AppStats, cpu, read_stats
from prazo.bench.loadgen import (
    OUTCOMES,
    LoadResult,
    mixed_schedule,
    parse_head,
    parse_response_head,
    poisson_schedule,
    run_in_subprocess,
)
from prazo.core import Deadline

MS = 1_000_000


# -- the schedule -----------------------------------------------------------------


def test_the_poisson_schedule_is_seeded_and_keeps_its_mean_rate() -> None:
    schedule = poisson_schedule(rate=1000, seconds=50, max_requests=10**6, seed=7)
    assert schedule == poisson_schedule(rate=1000, seconds=50, max_requests=10**6, seed=7)
    assert schedule != poisson_schedule(rate=1000, seconds=50, max_requests=10**6, seed=8)
    assert schedule == sorted(schedule) and 0 <= schedule[0] and schedule[-1] < 50 * 10**9
    # 50 000 arrivals expected; the standard deviation of a Poisson count is sqrt(50 000) ~ 224.
    assert abs(len(schedule) - 50_000) < 1500
    gaps = [b - a for a, b in itertools.pairwise(schedule)]
    assert statistics.fmean(gaps) == pytest.approx(1e6, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1e6, rel=0.05)


def test_the_schedule_is_bounded_in_count_and_time() -> None:
    assert len(poisson_schedule(rate=1000, seconds=10, max_requests=25, seed=1)) == 25
    assert all(t < 10**8 for t in poisson_schedule(rate=1000, seconds=0.1, max_requests=10**6, seed=1))
    with pytest.raises(ValueError):
        poisson_schedule(rate=0, seconds=1, max_requests=1, seed=1)


def test_answer_heads_are_parsed() -> None:
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n") is None
    head = b"HTTP/1.1 503 Service Unavailable\r\nX-Prazo-Reason: queue-full\r\nContent-Length: 11\r\n\r\nqueue full\n"
    assert parse_head(head) == (503, "queue-full", 11, head.index(b"\r\n\r\n") + 4)
    assert parse_head(b"HTTP/1.0 200 OK\r\n\r\n") == (200, "", None, 19)
    with pytest.raises(ValueError):
        parse_head(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_a_mixed_schedule_keeps_the_poisson_times_and_spreads_paths_keys_and_budgets() -> None:
    mix = {"/a": 0.75, "/b": 0.25}
    arrivals = mixed_schedule(1000, 20, 10**6, 7, mix, keys=5, budget_ms=5000, path_budget_ms={"/b": 1000})
    assert arrivals == mixed_schedule(1000, 20, 10**6, 7, mix, keys=5, budget_ms=5000, path_budget_ms={"/b": 1000})
    assert all(0 <= a.offset_ns < 20 * 10**9 for a in arrivals)
    assert [a.offset_ns for a in arrivals] == sorted(a.offset_ns for a in arrivals)
    paths = [a.target.partition("?")[0] for a in arrivals]
    assert paths.count("/a") / len(paths) == pytest.approx(0.75, abs=0.02)
    assert {a.target.partition("?id=")[2] for a in arrivals} == {"1", "2", "3", "4", "5"}
    assert {(path, a.budget_ms) for path, a in zip(paths, arrivals, strict=True)} == {("/a", 5000), ("/b", 1000)}
    with pytest.raises(ValueError):
        mixed_schedule(10, 1, 10, 1, {}, keys=5, budget_ms=1000)


def test_the_response_head_gives_every_header() -> None:
    head = b"HTTP/1.1 200 OK\r\nX-Stale-Age-S: 12.500\r\nContent-Length: 0\r\n\r\n"
    assert parse_response_head(head) == (200, {"x-stale-age-s": "12.500", "content-length": "0"}, len(head))


# -- the statistics ---------------------------------------------------------------


def _record(scheduled_ms: float, outcome: str, latency_ms: float, status: int = 200, reason: str = "") -> list[Any]:
    return [int(scheduled_ms * MS), int(scheduled_ms * MS) + MS, status, reason, int(latency_ms * MS), outcome]


def _made_up_load() -> LoadResult:
    records = [_record(100, "ok", 5)]  # in the warm-up: not counted
    records += [_record(1000 + i, "ok", latency) for i, latency in enumerate(range(10, 1010, 10))]  # 100 good
    records += [_record(1500, "refused", 1, 503, "queue-full")] * 30
    records += [_record(1600, "refused", 400, 504, "expired-in-queue")] * 10
    records += [_record(1700, "timeout", 1000, 0, "gave up at the budget")] * 5
    records += [_record(1800, "error", 0, 0, "connect: ECONNREFUSED")] * 5
    records += [_record(3000, "ok", 5)]  # after the window: not counted
    return LoadResult(records, wall_s=3.2, cpu_s=0.32, schedule_s=3.0)


def test_goodput_late_runs_p99_and_refusals_from_made_up_records() -> None:
    stats = {"runs": 200, "late_client": 50, "late_server": 10, "started_late": 40, "work_ns": 0, "late_work_ns": 0}
    point = summarize(
        _made_up_load(),
        stats,
        server="s",
        app="io",
        offered_x=3,
        capacity_per_s=80,
        seconds=2,
        budget_ms=1000,
        warmup_s=1,
    )
    assert point.requests == 150 and point.offered_per_s == 75
    assert point.good == 100 and point.goodput_per_s == 50 and point.goodput_pct == 62.5
    assert point.p99_ms == 990.0  # nearest rank: the 99th of 100 latencies 10..1000
    assert point.late_runs_pct == 25.0 and point.late_server_view_pct == 5.0 and point.started_late_pct == 20.0
    assert point.refusals == {"503 queue-full": 30, "504 expired-in-queue": 10}
    assert point.outcomes == {"ok": 100, "refused": 40, "status": 0, "timeout": 5, "error": 5}
    assert point.errors == {"connect: ECONNREFUSED": 5}
    assert point.loadgen_cpu_pct == 10.0 and point.loadgen_lag_p99_ms == 1.0 and point.loadgen_kept_schedule


def test_a_late_answer_is_not_good_and_missing_counters_are_not_zero() -> None:
    load = LoadResult([_record(0, "ok", 1000.5), _record(1, "ok", 20)], wall_s=1, cpu_s=0, schedule_s=1)
    point = summarize(load, None, server="s", app="cpu", offered_x=1, capacity_per_s=0, seconds=1, budget_ms=1000)
    assert point.good == 1 and point.goodput_pct is None
    assert point.late_runs_pct is None and point.app_runs is None


def test_a_generator_behind_its_schedule_voids_the_point() -> None:
    late = [[0, 50 * MS, 200, "", MS, "ok"]] * 10
    point = summarize(
        LoadResult(late, 1, 0, 1), None, server="s", app="cpu", offered_x=1, capacity_per_s=1, seconds=1, budget_ms=1000
    )
    assert not point.loadgen_kept_schedule
    assert "LOAD GENERATOR FELL BEHIND" in render_row(point)
    assert "fell behind its schedule" in render_table([point], GoodputSettings(), {"s": "a server"})


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.99) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([float(v) for v in range(1, 101)], 0.5) == 50.0


def test_the_json_of_a_point_has_the_documented_keys() -> None:
    point = summarize(
        _made_up_load(), None, server="s", app="io", offered_x=3, capacity_per_s=80, seconds=2, budget_ms=1000
    )
    data = json.loads(json.dumps(point.to_json()))
    for key in ("server", "app", "offered_x", "capacity_per_s", "goodput_per_s", "goodput_pct", "late_runs_pct"):
        assert key in data
    assert {"p99_ms", "loadgen_lag_p99_ms", "loadgen_cpu_pct", "refusals", "outcomes"} <= set(data)
    assert PointResult(**data) == point


# -- the app's bookkeeping ----------------------------------------------------------


def test_the_app_counts_late_runs_against_the_client_and_the_server_deadline(tmp_path: Path) -> None:
    stats = AppStats(str(tmp_path))
    stats.record(started_ns=0, finished_ns=10, give_up_ns=20, server_deadline_ns=5)
    stats.record(started_ns=30, finished_ns=40, give_up_ns=20, server_deadline_ns=50)
    stats.record(started_ns=0, finished_ns=40, give_up_ns=None, server_deadline_ns=None)
    expected = {
        "runs": 3, "late_client": 1, "late_server": 1, "started_late": 1, "work_ns": 60, "late_work_ns": 10, "slowed": 0
    }  # fmt: skip
    assert stats.snapshot() == expected
    assert read_stats(tmp_path) == expected


def test_the_cpu_app_reads_prazos_deadline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_STATS_DIR, str(tmp_path))
    monkeypatch.setattr("prazo.bench.goodput_apps._stats", None)
    give_up = time.monotonic_ns() + 10_000 * MS
    environ = {
        "PATH_INFO": "/",
        "prazo.deadline": Deadline.at_ns(time.monotonic_ns()),  # already passed: the run is late for the server
        "HTTP_" + GIVE_UP_HEADER.upper().replace("-", "_"): str(give_up),
    }
    statuses = []
    assert b"".join(cpu(environ, lambda status, headers: statuses.append(status))) == b"ok"
    assert statuses == ["200 OK"]
    counts = read_stats(tmp_path)
    assert (counts["runs"], counts["late_client"], counts["late_server"]) == (1, 0, 1)
    assert counts["work_ns"] >= 10 * MS  # 10 ms of CPU take at least 10 ms


# -- the command line and one real run ----------------------------------------------


def test_a_target_that_does_not_answer_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as bound:  # bound, never listening: every connection is refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        argv = ["--target", f"127.0.0.1:{port}", "--app", "io", "--quick"]
        assert bench_goodput(argv, io.StringIO()) == 1
    err = capsys.readouterr().err
    assert f"error: 127.0.0.1:{port} gave no 200" in err and "ECONNREFUSED" in err
    assert "Traceback" not in err


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_goodput(["--servers", "nginx"], io.StringIO()) == 2
    assert "--servers must name some of" in capsys.readouterr().err
    assert bench_goodput(["--apps", "gpu"], io.StringIO()) == 2
    assert bench_goodput(["--target", "127.0.0.1:8000"], io.StringIO()) == 2
    assert "--target needs --app" in capsys.readouterr().err
    assert bench_goodput(["--target", "nowhere", "--app", "cpu"], io.StringIO()) == 2


def test_every_request_sent_ends_in_exactly_one_recorded_outcome() -> None:
    settings = GoodputSettings(threads=2, max_queue=4)
    counted: list[dict[str, int]] = []
    with started(SERVERS["prazo-waitress"], "io", settings) as target:
        assert target.stats_dir is not None and os.listdir(target.stats_dir) == []
        argv = ["--port", str(target.port), "--rate", "20", "--seconds", "1.5", "--seed", "3"]
        load = run_in_subprocess(argv, timeout_s=60, at=[(0.0, lambda: counted.append(read_stats(target.stats_dir)))])
        # Every answer is in: each good one was counted by the app before it was sent.
        counted.append(read_stats(target.stats_dir))
    schedule = poisson_schedule(rate=20, seconds=1.5, max_requests=100_000, seed=3)
    assert sorted(record[0] for record in load.records) == schedule
    assert all(record[5] in OUTCOMES for record in load.records)
    # At half of what two threads do, answers come back (no timing is asserted: the
    # machine may be busy), and each good answer is one run of the app.
    good = sum(1 for record in load.records if record[5] == "ok")
    assert good > 0
    assert counted[0]["runs"] == 0
    assert good <= counted[1]["runs"] <= len(schedule)
