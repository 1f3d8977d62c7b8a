"""``prazo serve --load-report``: every server's responses carry the ORCA ``endpoint-load-metrics`` header.

Each server ``prazo serve`` runs (the embeddings, the front door, a front-door
host of two worker processes, gunicorn's workers) is started as a process
with the option (or ``PRAZO_LOAD_REPORT``), answers with the header, and the
header follows its line: two requests held out of four places, plus the
asking one, read ``application_utilization=0.75``. Without the option no
response carries it; the front door's refusals, written by its C engine,
carry none either.
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _docs import fenced_blocks, section
from _helpers import wait_until
from _load_reports import parse
from _server_harness import CLIENT_TIMEOUT_S, TESTS_DIR, Burst, statuses
from prazo.bindings.servers.serve import main_serve

WAIT_S = 30.0
_SERVE = (sys.executable, "-m", "prazo.bindings.servers.serve")
HEADER = "endpoint-load-metrics"


def serve(
    processes: list[subprocess.Popen[str]], *options: str, environ: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int, str]:
    """``prazo serve _server_harness:app`` with ``options``; the process, its port and its start-up line."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PRAZO_")}
    process = subprocess.Popen(
        [*_SERVE, "_server_harness:app", "--port", "0", *options],
        cwd=TESTS_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**env, "PYTHONPATH": str(TESTS_DIR), **(environ or {})},
    )
    processes.append(process)
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    assert found, line
    return process, int(found.group(1)), line


def get(port: int, path: str = "/healthz") -> tuple[int, str | None, list[str]]:
    """One request: its status, its reason and its load reports (all of them: there must be one at most)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status, response.getheader("X-Prazo-Reason"), response.headers.get_all(HEADER) or []
    finally:
        connection.close()


def report(port: int) -> dict[str, float]:
    status, _, reports = get(port)
    assert status == 200 and len(reports) == 1, reports
    return parse(reports[0])


# Four places each: two held requests and the asking one take three of them.
SERVERS = {
    "waitress": ["--server", "waitress", "--threads", "4"],
    "werkzeug": ["--server", "werkzeug", "--threads", "4"],
    "wsgiref": ["--server", "wsgiref", "--threads", "4"],
    "cheroot": ["--server", "cheroot", "--threads", "4"],
    "prazo": ["--server", "prazo", "--threads", "4"],
    "prazo-host": ["--server", "prazo", "--workers", "2", "--threads", "2"],
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_every_server_reports_its_line_in_each_response(
    server: str, processes: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    process, port, line = serve(processes, *SERVERS[server], "--max-queue", "4", "--load-report", "text")
    assert "load_report=text" in line
    report(port)
    gate = tmp_path / "gate"
    held = Burst(port, [f"/work?gate={gate}"] * 2)
    try:
        wait_until(
            lambda: report(port).get("application_utilization") == 0.75,
            "a report of three of the four places busy",
            WAIT_S,
        )
        # The rates appear once a process made two reports (each worker of a host makes its own).
        wait_until(lambda: "rps_fractional" in report(port), "a report with the rates", WAIT_S)
    finally:
        gate.touch()
    assert statuses(held.join()) == {200: 2}
    process.terminate()
    assert process.wait(WAIT_S) == 0


def test_the_page_s_command_is_the_one_the_test_runs() -> None:
    page = section("## Load reports in the response (ORCA)", "docs/how-to/load-balancers.md")
    (command,) = fenced_blocks(page, "sh")
    assert "--load-report text" in command and "--threads 4" in command


def test_the_variable_turns_it_on_in_json_and_gunicorn_workers_report_too(
    processes: list[subprocess.Popen[str]],
) -> None:
    pytest.importorskip("gunicorn")
    for options in (["--server", "waitress"], ["--server", "gunicorn", "--workers", "1"]):
        _, port, _ = serve(processes, *options, "--threads", "2", environ={"PRAZO_LOAD_REPORT": "json"})
        status, _, reports = get(port)
        assert status == 200 and len(reports) == 1 and reports[0].startswith("JSON "), (options, reports)
        assert parse(reports[0])["named_metrics.queue"] == 0


def test_off_by_default_and_the_engine_s_refusals_carry_none(
    processes: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    _, port, line = serve(processes, "--server", "prazo", "--threads", "1", "--max-queue", "0")
    assert get(port)[2] == [] and "load_report" not in line
    _, port, _ = serve(processes, "--server", "prazo", "--threads", "1", "--max-queue", "0", "--load-report", "text")
    mark, gate = tmp_path / "mark", tmp_path / "gate"
    held = Burst(port, [f"/work?mark={mark}&gate={gate}"])
    try:
        wait_until(mark.exists, "the held request to run", WAIT_S)
        # The one place is taken and nothing may wait: the engine refuses, in C, without the header.
        status, reason, reports = get(port)
        assert (status, reason, reports) == (503, "queue-full", [])
    finally:
        gate.touch()
    assert statuses(held.join()) == {200: 1}


def test_a_bad_flag_or_variable_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main_serve(["os.path:join", "--port", "0", "--load-report", "xml"])
    assert "--load-report" in capsys.readouterr().err
    environ = {name: value for name, value in os.environ.items() if not name.startswith("PRAZO_")}
    result = subprocess.run(
        [*_SERVE, "os.path:join", "--port", "0"],
        env={**environ, "PRAZO_LOAD_REPORT": "orca"},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert result.returncode == 2
    assert "PRAZO_LOAD_REPORT" in result.stderr
