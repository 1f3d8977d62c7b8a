"""``prazo bench throughput``: a short run end to end on real servers, the fallback load generator, the JSON shape.

And the machine a run names (``prazo.bench.harness.describe_machine``), which other runners share.
"""

from __future__ import annotations

import io
import json
import os
import platform
from pathlib import Path
from typing import Any

import pytest
from prazo.bench import harness, throughput
from prazo.bench.harness import cpu_model, describe_machine, render_machine
from prazo.bench.throughput import STOCK_OF, THROUGHPUT_SERVERS, bench_throughput, parse_wrk

# Two peers and the embedding measured against it: a short run, never an assertion on speed.
_SUBSET = "waitress,prazo-waitress"
_ARGV = ["--servers", _SUBSET, "--rounds", "2", "--duration", "0.5", "--connections", "4", "--loadgen", "prazo"]


@pytest.fixture(scope="module")
def short_run() -> dict[str, Any]:
    """One real run through the command (``--json``), with what ``run_throughput`` was asked and reported."""
    recorded: dict[str, Any] = {"progress": []}
    real = throughput.run_throughput

    def recording(settings: Any, progress: Any = None) -> Any:
        def tee(*call: Any) -> None:
            recorded["progress"].append(call)
            if progress is not None:
                progress(*call)

        recorded["settings"] = settings
        recorded["results"] = real(settings, tee)
        return recorded["results"]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(throughput, "run_throughput", recording)
        recorded["status"] = bench_throughput([*_ARGV, "--json"], out)
    recorded["document"] = json.loads(out.getvalue())
    return recorded


def test_a_short_run_answers_on_every_server_with_the_fallback_generator(short_run: dict[str, Any]) -> None:
    assert short_run["status"] == 0
    document = short_run["document"]
    assert document["generator"].startswith("prazo.bench.loadgen")
    assert (document["rounds"], document["duration_s"], document["connections"]) == (2, 0.5, 4)
    machine = document["machine"]
    assert machine["cpu_model"] and machine["cpus"] == os.cpu_count()
    assert machine["system"] == f"{platform.system()} {platform.release()}"
    assert machine["python"].startswith(f"{platform.python_implementation()} {platform.python_version()}")
    servers = {entry["server"]: entry for entry in document["servers"]}
    assert list(servers) == _SUBSET.split(",")
    for entry in servers.values():
        assert len(entry["rounds_per_s"]) == len(entry["answers"]) == 2
        assert all(answers > 0 for answers in entry["answers"]), entry
        assert entry["best_per_s"] == max(entry["rounds_per_s"])
        assert entry["errors"] == entry["other_statuses"] == 0
        assert 0 < entry["vs_fastest"] <= 1
    # The embedding's ratio is to its own stock server; a stock server has none.
    embedded = servers["prazo-waitress"]
    assert embedded["stock"] == STOCK_OF["prazo-waitress"] == "waitress"
    assert embedded["vs_stock"] == pytest.approx(embedded["best_per_s"] / servers["waitress"]["best_per_s"], rel=1e-2)
    assert servers["waitress"]["vs_stock"] is None


def test_the_table_has_the_ratio_columns(
    short_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The table's wiring (no --json: the table, the progress lines) on the real run
    # above, not a second one: the same options must ask for the same run.
    def replay(settings: Any, progress: Any = None) -> Any:
        assert settings == short_run["settings"]
        for call in short_run["progress"]:
            progress(*call)
        return short_run["results"]

    monkeypatch.setattr(throughput, "run_throughput", replay)
    out = io.StringIO()
    assert bench_throughput(_ARGV, out) == 0
    title, machine, header, *rows = out.getvalue().splitlines()
    assert title.startswith("hello world (13-byte body), 4 connections")
    assert machine == render_machine(describe_machine())
    assert machine.startswith(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} ")
    assert header.split()[:5] == ["server", "answers/s", "rounds", "vs", "stock"]
    assert "vs fastest" in header
    assert {row.split()[0] for row in rows} == {"waitress", "prazo-waitress"}
    assert "2 interleaved round(s)" in out.getvalue()
    err = capsys.readouterr().err
    assert "round 1 prazo-waitress:" in err and "round 2 prazo-waitress:" in err


def test_unknown_servers_and_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_throughput(["--servers", "nginx"], io.StringIO()) == 2
    assert "unknown server(s) nginx" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_throughput(["--duration", "0"], io.StringIO())
    with pytest.raises(SystemExit):
        bench_throughput(["--rounds", "0"], io.StringIO())


def test_every_server_has_a_label_and_says_whether_it_can_run() -> None:
    for name, spec in THROUGHPUT_SERVERS.items():
        assert spec.name == name and spec.label()
        assert spec.unavailable() is None or "not installed" in str(spec.unavailable())
    assert set(STOCK_OF) | set(STOCK_OF.values()) <= set(THROUGHPUT_SERVERS)


def test_wrk_output_is_read_into_answers_and_errors() -> None:
    output = """Running 8s test @ http://127.0.0.1:8000/
  1 threads and 32 connections
  256000 requests in 8.00s, 30.00MB read
  Socket errors: connect 0, read 3, write 0, timeout 2
  Non-2xx or 3xx responses: 10
Requests/sec:  32000.00
"""
    result = parse_wrk(output)
    assert (result.answers, result.other, result.errors, result.seconds) == (255990, 10, 5, 8.0)
    assert result.per_second == pytest.approx(255990 / 8)
    with pytest.raises(RuntimeError, match="no total"):
        parse_wrk("unable to connect")


def test_the_cpu_model_is_read_from_cpuinfo_and_falls_back_to_platform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\nprocessor\t: 1\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 7B13"
    # Linux on ARM writes no model name; other systems have no /proc at all.
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_model(cpuinfo) == "aarch64"
    assert cpu_model(tmp_path / "absent") == "aarch64"
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert cpu_model(cpuinfo) == "arm"
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "")
    assert cpu_model(cpuinfo) == "unknown CPU"


def test_the_machine_line_says_every_part_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "cpu_model", lambda: "aarch64")
    machine = describe_machine()
    assert machine["cpu_model"] == "aarch64" and machine["cpus"] == os.cpu_count()
    assert (
        render_machine(machine) == f"machine: aarch64, {os.cpu_count()} CPUs, {machine['system']}, {machine['python']}"
    )
