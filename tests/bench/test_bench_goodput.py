"""``prazo bench goodput``: the schedule, the statistics, the report's shape, and one short real run."""

from __future__ import annotations

import http.client
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
from _required import unavailable
from prazo.bench import goodput_apps
from prazo.bench.goodput import bench_goodput, load_points
from prazo.bench.goodput_apps import (
    ENV_STATS_DIR,
    GIVE_UP_HEADER,
    AppStats,
    cpu,
    read_stats,
    slowdown_factor,
    write_slowdown,
)
from prazo.bench.goodput_measure import Baseline, PointResult, run_point, summarize
from prazo.bench.goodput_report import plot_paths, render_row, render_table
from prazo.bench.goodput_servers import POLICIES, SERVERS, policy_environment, started
from prazo.bench.goodput_settings import GoodputSettings
from prazo.bench.goodput_workloads import MIXED, class_of, drop_phases, loadgen_arguments, percentile
from prazo.bench.loadgen import (
    OUTCOMES,
    LoadResult,
    build_parser,
    build_schedule,
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
    assert schedule == sorted(schedule) and schedule[0] >= 0 and schedule[-1] < 50 * 10**9
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
    assert bench_goodput(["--threads", "0"], io.StringIO()) == 2
    assert "--threads must be between 1 and 256, got 0" in capsys.readouterr().err


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


# -- issue 11: the mixed and drop workloads, the policy configurations ----------------


def test_the_mixed_workload_sends_both_budgets_half_and_half() -> None:
    args = build_parser().parse_args(
        ["--port", "1", "--rate", "1000", "--seconds", "4", "--seed", "5", *loadgen_arguments("mixed", 1000)]
    )
    arrivals = build_schedule(args)
    budgets = [a.budget_ms for a in arrivals]
    assert set(budgets) == {200.0, 2000.0}
    # ~4000 arrivals: a binomial share's standard deviation is under 1 %.
    assert budgets.count(200.0) / len(budgets) == pytest.approx(0.5, abs=0.04)
    # Each arrival's path names its class, and the class has the arrival's budget.
    for arrival in arrivals:
        budget_class = class_of(arrival.target)
        assert budget_class is not None and budget_class.budget_ms == arrival.budget_ms
    assert loadgen_arguments("steady", 750) == ["--budget-ms", "750"]
    with pytest.raises(ValueError, match="workload"):
        loadgen_arguments("bursty", 1000)


def _classed(scheduled_ms: float, outcome: str, latency_ms: float, path: str, status: int = 200) -> list[Any]:
    return [*_record(scheduled_ms, outcome, latency_ms, status), f"{path}?id=1", None]


def test_mixed_goodput_is_counted_per_class_each_within_its_own_budget() -> None:
    records = [_classed(1000 + i, "ok", 150, "/short") for i in range(10)]  # good: 150 < 200 ms
    records += [_classed(1100 + i, "ok", 300, "/short") for i in range(4)]  # complete, but after 200 ms: not good
    records += [_classed(1200 + i, "timeout", 200, "/short", 0) for i in range(6)]
    records += [_classed(1300 + i, "ok", 300, "/long") for i in range(20)]  # good: 300 < 2000 ms
    records += [_classed(1400 + i, "refused", 1, "/long", 503) for i in range(5)]
    load = LoadResult(records, wall_s=3, cpu_s=0, schedule_s=3)
    point = summarize(
        load, None, server="s", app="io", offered_x=3, capacity_per_s=20, seconds=2, budget_ms=1000,
        warmup_s=1, workload="mixed", unloaded_p99_ms=50,
    )  # fmt: skip
    short, long = point.slices["short"], point.slices["long"]
    assert (short["requests"], short["good"], short["timeout"]) == (20, 10, 6)
    assert (long["requests"], long["good"], long["refused"]) == (25, 20, 5)
    assert point.requests == 45 and point.good == 30
    # Total against the capacity; a class against its share of it (10/s each).
    assert point.goodput_pct == 75.0
    assert short["goodput_pct"] == 50.0 and long["goodput_pct"] == 100.0
    assert short["p99_ms"] == 150.0 and short["p99_ratio"] == 3.0 and point.p99_ratio == 6.0
    assert [c.share for c in MIXED] == [0.5, 0.5]
    assert "short 200 ms: goodput 5.0/s = 50.0 %" in render_row(point)


def test_the_drop_window_is_the_middle_third_and_each_phase_has_its_capacity() -> None:
    phases = drop_phases(30)
    assert [(ph.name, ph.start_s, ph.end_s, ph.slow) for ph in phases] == [
        ("before", 0, 10, False),
        ("drop", 10, 20, True),
        ("after", 20, 30, False),
    ]
    with pytest.raises(ValueError, match="seconds"):
        drop_phases(float("nan"))
    # Window 1..4 s: before 1-2 s, drop 2-3 s, after 3-4 s (scheduled times).
    records = [_record(1500, "ok", 10)] * 9 + [_record(2500, "ok", 10)] * 3 + [_record(2600, "timeout", 1000, 0)]
    records += [_record(3500, "ok", 10)] * 6
    stats = {name: {"runs": 9, "late_client": 0, "slowed": 0} for name in ("before", "after")}
    stats["drop"] = {"runs": 3, "late_client": 1, "slowed": 3}
    point = summarize(
        LoadResult(records, 4, 0, 4), None, server="s", app="io", offered_x=1, capacity_per_s=9, seconds=3,
        budget_ms=1000, warmup_s=1, workload="drop", slow_capacity_per_s=3, phase_stats=stats,
    )  # fmt: skip
    before, drop, after = (point.slices[name] for name in ("before", "drop", "after"))
    assert (before["good"], drop["good"], after["good"]) == (9, 3, 6)
    assert before["goodput_pct"] == 100.0 and drop["goodput_pct"] == 100.0 and after["goodput_pct"] == 66.7
    assert drop["timeout"] == 1 and drop["late_runs"] == 1 and drop["slowed_runs"] == 3
    # The whole window against the time-weighted capacity (9 + 3 + 9) / 3 = 7/s.
    assert point.goodput_pct == pytest.approx(100 * 18 / 3 / 7, abs=0.1)
    assert point.slow_capacity_per_s == 3
    # Per second of the window: 9 good in the first, 3 (and a timeout) in the second, 6 in the third.
    assert point.timeline["good_per_s"] == [9, 3, 6] and point.timeline["p99_ms"] == [10.0, 10.0, 10.0]


def test_a_point_with_slices_survives_json() -> None:
    records = [_classed(1000, "ok", 10, "/short"), _classed(1001, "ok", 10, "/long")]
    point = summarize(
        LoadResult(records, 2, 0, 2), None, server="s", app="cpu", offered_x=1, capacity_per_s=4, seconds=1,
        budget_ms=1000, warmup_s=1, workload="mixed", unloaded_p99_ms=5,
    )  # fmt: skip
    assert PointResult(**json.loads(json.dumps(point.to_json()))) == point
    with pytest.raises(ValueError, match="workload"):
        summarize(
            LoadResult([], 1, 0, 1), None, server="s", app="cpu", offered_x=1, capacity_per_s=1, seconds=1,
            budget_ms=1000, workload="spiky",
        )  # fmt: skip


def test_the_slowdown_schedule_is_read_from_the_stats_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV_STATS_DIR, str(tmp_path))
    monkeypatch.setattr(goodput_apps, "_slowdown_pid", -1)
    assert slowdown_factor(10**12) == 1.0  # no file yet: normal speed, looked for again next time
    write_slowdown(tmp_path, 100, 200, 3.0)
    assert [slowdown_factor(t) for t in (99, 100, 199, 200)] == [1.0, 3.0, 3.0, 1.0]
    write_slowdown(tmp_path, 0, 0, 1.0)  # cleared in place: the mapping sees it
    assert slowdown_factor(150) == 1.0
    with pytest.raises(ValueError, match="factor"):
        write_slowdown(tmp_path, 1, 2, float("inf"))
    with pytest.raises(ValueError, match="end_ns"):
        write_slowdown(tmp_path, 2, 1, 2.0)
    with pytest.raises(TypeError, match="start_ns"):
        write_slowdown(tmp_path, 1.5, 2, 2.0)  # type: ignore[arg-type]


def test_the_cpu_app_works_three_times_as_long_inside_the_window(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV_STATS_DIR, str(tmp_path))
    monkeypatch.setattr(goodput_apps, "_stats", None)
    monkeypatch.setattr(goodput_apps, "_slowdown_pid", -1)
    now = time.monotonic_ns()
    write_slowdown(tmp_path, now, now + 3600 * 10**9, 3.0)
    list(cpu({"PATH_INFO": "/"}, lambda status, headers: None))
    counts = read_stats(tmp_path)
    # 30 ms of this thread's CPU time cannot take less than 30 ms of wall time.
    assert counts["runs"] == 1 and counts["slowed"] == 1 and counts["work_ns"] >= 30 * MS


def test_the_slowdown_reaches_a_forked_worker_and_ends_with_its_window() -> None:
    # Stock gunicorn: the app runs in a worker forked from the master, which
    # maps the schedule on its own.
    settings = GoodputSettings(threads=2)
    with started(SERVERS["gunicorn"], "io", settings) as target:
        assert target.stats_dir is not None

        def get() -> None:
            connection = http.client.HTTPConnection(target.host, target.port, timeout=30)
            try:
                connection.request("GET", "/", headers={"X-Request-Budget-Ms": "30000"})
                assert connection.getresponse().read() == b"ok"
            finally:
                connection.close()

        now = time.monotonic_ns()
        write_slowdown(target.stats_dir, now, now + 3600 * 10**9, 3.0)
        for _ in range(3):
            get()
        slowed = read_stats(target.stats_dir)
        write_slowdown(target.stats_dir, 0, 0, 1.0)
        for _ in range(3):
            get()
        after = read_stats(target.stats_dir)
    assert slowed["runs"] == 3 and slowed["slowed"] == 3
    # A 150 ms sleep never returns early: each slowed run took at least that.
    assert slowed["work_ns"] >= 3 * 150 * MS
    assert after["runs"] == 6 and after["slowed"] == 3


def test_a_drop_point_slows_the_app_in_its_middle_third_only() -> None:
    settings = GoodputSettings(threads=2, max_queue=4, warmup_s=0.5, drop_seconds=3.0, capacity_seconds=0.5)
    baseline = Baseline(capacity_per_s=40.0, unloaded_p99_ms=55.0, slow_capacity_per_s=13.0)
    with started(SERVERS["prazo-waitress"], "io", settings) as target:
        point = run_point(target, "prazo-waitress", "io", 0.5, baseline, settings, "drop")
    assert point.workload == "drop" and set(point.slices) == {"before", "drop", "after"}
    phases = point.slices
    assert sum(phases[name]["requests"] for name in phases) == point.requests
    # The app's own counter: runs slowed inside the drop, and not the runs
    # before it (a slowed run takes 150 ms, so one can only be counted before
    # the drop when the bench read that phase's counters that late; hence no
    # "== 0", which a loaded machine could break).
    assert phases["drop"]["slowed_runs"] >= 1
    assert phases["before"]["slowed_runs"] < phases["before"]["app_runs"]
    assert point.app_runs is not None and point.app_runs >= phases["drop"]["slowed_runs"]
    assert phases["drop"]["capacity_per_s"] == 13.0 and point.slow_capacity_per_s == 13.0


def test_a_mixed_point_counts_both_classes_from_a_real_server() -> None:
    settings = GoodputSettings(threads=2, max_queue=4, warmup_s=0.5, seconds=1.5)
    baseline = Baseline(capacity_per_s=40.0, unloaded_p99_ms=55.0, slow_capacity_per_s=None)
    with started(SERVERS["prazo-waitress"], "io", settings) as target:
        point = run_point(target, "prazo-waitress", "io", 0.5, baseline, settings, "mixed")
    short, long = point.slices["short"], point.slices["long"]
    assert short["requests"] > 0 and long["requests"] > 0
    assert short["requests"] + long["requests"] == point.requests
    assert short["good"] + long["good"] == point.good
    assert short["capacity_per_s"] == long["capacity_per_s"] == 20.0


def test_policy_configurations_are_named_server_plus_policy() -> None:
    for base in ("prazo-waitress", "prazo-gunicorn", "frontdoor"):
        for policy in ("doomed", "adaptive", "vegas", "best"):
            spec = SERVERS[f"{base}+{policy}"]
            assert not spec.default and f"{base}+{policy}" == spec.name
    assert POLICIES["adaptive"] == ("--order", "adaptive")
    assert policy_environment("doomed") == {"PRAZO_EXPECTED_SERVICE_MS": "p90"}
    assert policy_environment("vegas") == {"PRAZO_LIMIT": "vegas", "PRAZO_MIN_CONCURRENCY": "1"}
    settings = GoodputSettings()
    (served,) = SERVERS["frontdoor+vegas"].processes("m:app", 1, settings, Path("."))
    assert served.argv[-4:] == ["--limit", "vegas", "--min-concurrency", "1"]
    (worker,) = SERVERS["prazo-gunicorn+best"].processes("m:app", 1, settings, Path("."))
    assert worker.env["PRAZO_ORDER"] == "adaptive" and worker.env["PRAZO_EXPECTED_SERVICE_MS"] == "p90"


@pytest.mark.parametrize("name", [name for name in SERVERS if "+" in name])
def test_each_policy_configuration_starts_and_answers(name: str) -> None:
    why = SERVERS[name].unavailable()
    if why is not None:
        unavailable(why)
    with started(SERVERS[name], "io", GoodputSettings(threads=2, max_queue=4)) as target:
        connection = http.client.HTTPConnection(target.host, target.port, timeout=30)
        try:
            connection.request("GET", "/", headers={"X-Request-Budget-Ms": "30000"})
            response = connection.getresponse()
            assert (response.status, response.read()) == (200, b"ok")
        finally:
            connection.close()


def test_workload_options_and_plots_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_goodput(["--workload", "bursty"], io.StringIO()) == 2
    assert "--workload must name some of steady,mixed,drop" in capsys.readouterr().err
    assert bench_goodput(["--drop-seconds", "0"], io.StringIO()) == 2
    argv = ["--target", "127.0.0.1:1", "--app", "io", "--workload", "drop"]
    assert bench_goodput(argv, io.StringIO()) == 2
    assert "needs --stats-dir" in capsys.readouterr().err
    assert plot_paths("out/g.png", ["steady"]) == {"steady": "out/g.png"}
    assert plot_paths("out/g.png", ["mixed", "drop"]) == {"mixed": "out/g-mixed.png", "drop": "out/g-drop.png"}
    records = [_classed(1000, "ok", 10, "/short"), _classed(1001, "ok", 10, "/long")]
    point = summarize(
        LoadResult(records, 2, 0, 2), None, server="frontdoor+best", app="io", offered_x=1, capacity_per_s=4,
        seconds=1, budget_ms=1000, warmup_s=1, workload="mixed", unloaded_p99_ms=5,
    )  # fmt: skip
    saved = tmp_path / "points.jsonl"
    saved.write_text("a header line\n" + json.dumps(point.to_json()) + "\n")
    assert load_points([str(saved)]) == [point]
    out = io.StringIO()
    assert bench_goodput(["--from-json", str(saved)], out) == 0
    assert "frontdoor+best" in out.getvalue() and "short 200 ms" in out.getvalue()
