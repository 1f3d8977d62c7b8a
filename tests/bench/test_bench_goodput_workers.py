"""``prazo bench goodput --workers N``: the multi-process command lines, the option checks, ref%, and the launcher.

What the servers do under load is measured by the bench itself
(``bench/RESULTS.md``), not asserted here: these tests pin what each
server is started with and what the report says.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _required import unavailable
from _server_harness import request
from prazo.bench import reuseport_frontdoors
from prazo.bench.goodput import bench_goodput
from prazo.bench.goodput_measure import REFUSAL_TARGET_PCT, PointResult, misses_refusal_target, refused_pct, summarize
from prazo.bench.goodput_report import render_row, render_table
from prazo.bench.goodput_servers import POLICIES, SERVERS, WORKER_SERVERS, servers_for, started
from prazo.bench.goodput_settings import WORKER_LOADS, WORKER_QUICK_LOADS, GoodputSettings
from prazo.bench.loadgen import LoadResult

MS = 1_000_000
TWO = GoodputSettings(workers=2)


def _argv(name: str, settings: GoodputSettings, workdir: Path = Path(".")) -> list[list[str]]:
    return [process.argv for process in servers_for(settings.workers)[name].processes("m:app", 9, settings, workdir)]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- the command lines ------------------------------------------------------------


def test_without_workers_every_server_is_one_process_with_the_whole_queue(tmp_path: Path) -> None:
    one = GoodputSettings()
    assert one.workers is None and one.processes == 1 and one.queue_per_process == one.max_queue == 20
    assert servers_for(None) is SERVERS
    (gunicorn,) = SERVERS["gunicorn"].processes("m:app", 9, one, tmp_path)
    assert _after(gunicorn.argv, "--workers") == "1" and gunicorn.env["PRAZO_MAX_QUEUE"] == "20"
    (front_door,) = _argv("frontdoor", one)
    assert "--workers" not in front_door
    (granian,) = _argv("granian", one)
    assert _after(granian, "--workers") == "1" and _after(granian, "--backpressure") == "20"
    waitress, _haproxy = _argv("haproxy", one, tmp_path)
    assert "waitress" in waitress
    assert "maxconn 4\n" in (tmp_path / "haproxy.cfg").read_text()


def test_with_workers_every_server_runs_n_processes_and_shares_the_host_queue(tmp_path: Path) -> None:
    assert servers_for(2) is WORKER_SERVERS
    assert list(WORKER_SERVERS) == [
        "frontdoor", "gunicorn", "prazo-gunicorn", "granian", "haproxy", "frontdoor-reuseport",
    ]  # fmt: skip
    (front_door,) = _argv("frontdoor", TWO)
    # The front door's line is the host's: the whole queue, and N workers of its own.
    assert front_door[-2:] == ["--workers", "2"] and _after(front_door, "--max-queue") == "20"
    assert _after(front_door, "--threads") == "4"
    for name in ("gunicorn", "prazo-gunicorn"):
        (process,) = WORKER_SERVERS[name].processes("m:app", 9, TWO, tmp_path)
        assert _after(process.argv, "--workers") == "2" and _after(process.argv, "--threads") == "4"
        assert process.env["PRAZO_MAX_QUEUE"] == "10"
    (granian,) = _argv("granian", TWO)
    assert _after(granian, "--workers") == "2" and _after(granian, "--backpressure") == "10"
    (doors,) = _argv("frontdoor-reuseport", TWO)
    assert doors[1:4] == ["-m", "prazo.bench.reuseport_frontdoors", "m:app"]
    flags = ("--port", "--workers", "--threads", "--max-queue")
    assert [_after(doors, flag) for flag in flags] == ["9", "2", "4", "10"]


def test_haproxy_with_workers_fronts_gunicorn_with_maxconn_of_every_thread(tmp_path: Path) -> None:
    gunicorn, haproxy = _argv("haproxy", TWO, tmp_path)
    assert "gunicorn" in gunicorn and "gthread" in gunicorn and _after(gunicorn, "--workers") == "2"
    config = (tmp_path / "haproxy.cfg").read_text()
    backend_port = _after(gunicorn, "--bind").rsplit(":", 1)[1]
    assert f"server backend 127.0.0.1:{backend_port} maxconn 8\n" in config
    assert "timeout queue 200ms" in config and "bind 127.0.0.1:9" in config
    assert haproxy[:2] == ["haproxy", "-db"]


def test_a_line_per_process_gets_its_share_of_the_host_queue_rounded_up() -> None:
    assert GoodputSettings(workers=3).queue_per_process == 7  # 21 >= 20 in all
    assert GoodputSettings(workers=1).queue_per_process == 20
    assert GoodputSettings(workers=40).queue_per_process == 1


# -- the options --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_wrong_workers_value_is_an_error_naming_the_option(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_goodput(["--workers", value], io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "error: --workers must be an integer >= 1" in err and repr(value) in err
    assert "Traceback" not in err


def test_workers_alone_is_the_number_of_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    # A server of the single-process comparison is unknown with --workers: the
    # error lists the comparison it chose, which proves the flag was read.
    assert bench_goodput(["--workers", "--servers", "waitress"], io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "--servers must name some of frontdoor,gunicorn,prazo-gunicorn" in err and "with --workers" in err
    assert bench_goodput(["--servers", "frontdoor-reuseport"], io.StringIO()) == 2
    assert "--servers must name some of waitress," in capsys.readouterr().err


def test_the_default_loads_with_workers_have_the_refusal_point() -> None:
    assert 0.9 in WORKER_LOADS and 0.9 in WORKER_QUICK_LOADS
    assert WORKER_LOADS[0] == 0.5 and WORKER_LOADS[-1] == 10


def test_the_front_doors_need_nothing_optional() -> None:
    # Built with prazo: queue policies, --workers and reuse_port are always there.
    doors = [SERVERS["frontdoor"], *(SERVERS[f"frontdoor+{p}"] for p in POLICIES), WORKER_SERVERS["frontdoor"]]
    for spec in [*doors, WORKER_SERVERS["frontdoor-reuseport"]]:
        assert spec.unavailable() is None, spec.name


# -- the report ---------------------------------------------------------------------


def _point(offered_x: float, refused: int, ok: int = 199, workers: int | None = 2) -> PointResult:
    records = [[1000 * MS + i, 1000 * MS + i, 200, "", 5 * MS, "ok"] for i in range(ok)]
    records += [[1500 * MS, 1500 * MS, 503, "queue-full", MS, "refused"]] * refused
    point = summarize(
        LoadResult(records, wall_s=2, cpu_s=0.5, schedule_s=2), None, server="frontdoor-reuseport", app="cpu",
        offered_x=offered_x, capacity_per_s=200, seconds=1, budget_ms=1000, warmup_s=1,
    )  # fmt: skip
    return PointResult(**{**point.to_json(), "workers": workers})


def test_refusals_are_a_share_and_flagged_below_capacity_only() -> None:
    below = _point(0.9, refused=1)  # 1 of 200: exactly the target's 0.5 %
    assert refused_pct(below) == REFUSAL_TARGET_PCT == 0.5 and misses_refusal_target(below)
    assert "0.50" in render_row(below) and "refused >= 0.5 % below capacity" in render_row(below)
    under = _point(0.9, refused=0, ok=200)
    assert refused_pct(under) == 0 and not misses_refusal_target(under)
    overload = _point(3, refused=150, ok=50)
    assert refused_pct(overload) == 75 and not misses_refusal_target(overload)
    assert "below capacity" not in render_row(overload)


def test_the_table_says_n_and_how_much_of_the_host_the_generator_took() -> None:
    table = render_table([_point(0.9, 0, 200)], TWO, {"frontdoor-reuseport": "doors [N = 2]"})
    assert "--workers 2: every server 2 processes of 4 worker threads (8 in all), a host queue of 20" in table
    assert " ref% " in table and "doors [N = 2]" in table
    cpus = os.cpu_count() or 1
    host_share = f"up to {25 / cpus:.0f} % of this {cpus}-CPU host"
    assert "25 % of one core at the median point and 25 % at most, i.e. " + host_share in table


def test_points_of_a_workers_run_keep_n_in_json_and_their_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    point = _point(3, refused=10)
    assert json.loads(json.dumps(point.to_json()))["workers"] == 2
    saved = tmp_path / "points.jsonl"
    saved.write_text(json.dumps(point.to_json()) + "\n")
    out = io.StringIO()
    assert bench_goodput(["--from-json", str(saved)], out) == 0
    assert "SO_REUSEPORT" in out.getvalue() and "[N = 2]" in out.getvalue()
    assert "--workers 2: every server 2 processes" in out.getvalue()


# -- the SO_REUSEPORT launcher ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["m:app", "--port", "0"], "--port"),
        (["m:app", "--port", "8000", "--workers", "0"], "--workers"),
        (["m:app", "--port", "8000", "--max-queue", "x"], "--max-queue"),
        (["m:app"], "--port"),
    ],
)
def test_the_launcher_refuses_wrong_options_naming_them(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        reuseport_frontdoors.main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_the_reuseport_doors_answer_on_one_port_and_stop_on_sigterm() -> None:
    why = WORKER_SERVERS["frontdoor-reuseport"].unavailable()
    if why is not None:
        unavailable(why)
    settings = GoodputSettings(workers=2, threads=2, max_queue=4)
    with started(WORKER_SERVERS["frontdoor-reuseport"], "io", settings) as target:
        # A new connection each: the kernel spreads them over both doors' listeners.
        outcomes = [request(target.port, "/", {"X-Request-Budget-Ms": "30000"}) for _request in range(4)]
    assert [(outcome.status, outcome.body) for outcome in outcomes] == [(200, b"ok")] * 4


def test_the_launcher_passes_sigterm_on_and_exits_0(tmp_path: Path) -> None:
    why = WORKER_SERVERS["frontdoor-reuseport"].unavailable()
    if why is not None:
        unavailable(why)
    with started(WORKER_SERVERS["frontdoor-reuseport"], "io", GoodputSettings(workers=2, threads=1)) as target:
        argv = [
            sys.executable, "-m", "prazo.bench.reuseport_frontdoors", "prazo.bench.goodput_apps:io",
            "--port", str(target.port), "--workers", "2", "--threads", "1", "--max-queue", "1",
        ]  # fmt: skip
        # A second launcher joins the first's port (SO_REUSEPORT), then stops on SIGTERM.
        launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = launcher.stdout.readline() if launcher.stdout else ""
            assert "2 front doors (SO_REUSEPORT)" in first
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(30) == 0
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
