"""``prazo bench instructions``: the callgrind dumps it counts, its client, its errors, and a short real run."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _required import unavailable
from prazo.bench import instructions
from prazo.bench.instructions import (
    MEASURED,
    WARMUP,
    InstructionSettings,
    bench_instructions,
    measured_instructions,
    read_dump,
    render_report,
    send_requests,
)
from prazo.bench.throughput import THROUGHPUT_SERVERS
from prazo.bindings import cli


def _dump(path: Path, pid: int, trigger: str, summary: str | None, totals: str | None, events: str = "Ir") -> None:
    """A callgrind output file as callgrind writes one: the header, cost lines, then the totals."""
    part = path.name.rsplit(".", 1)[1] if path.name.rsplit(".", 1)[1].isdigit() else "1"
    lines = [
        "# callgrind format", "version: 1", "creator: callgrind-3.19.0", f"pid: {pid}",
        "cmd:  python -m server", f"part: {part}", "", "desc: I1 cache: ", "",
        "desc: Timerange: Basic block 0 - 1000", f"desc: Trigger: {trigger}", "", "positions: line",
        f"events: {events}",
        *([f"summary: {summary}"] if summary is not None else []),
        "", "", "fl=(1) server.c", "fn=(1) serve", "12 400", "13 600", "",
        *([f"totals: {totals}"] if totals is not None else []),
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_only_the_measured_dumps_count_never_the_warmup_nor_the_exit_dump(tmp_path: Path) -> None:
    # Process 100: its warm-up dump, the measured one, and the dump written when it exited.
    _dump(tmp_path / "cg.100.out.1", 100, f"dump {WARMUP}", "999", "999")
    # The summary counts: the totals of a first dump after `callgrind_control -z` carry costs
    # from before it (the module's docstring), so where they differ the summary is the span's.
    _dump(tmp_path / "cg.100.out.2", 100, f"dump {MEASURED}", "5000", "5100")
    _dump(tmp_path / "cg.100.out", 100, "Program termination", "77777", "77777")
    # Process 200 (a worker): a dump with totals only, and the empty file callgrind creates at start.
    _dump(tmp_path / "cg.200.out.1", 200, f"dump {MEASURED}", None, "3000")
    (tmp_path / "cg.200.out").write_text("")
    # A file not named as a dump callgrind was asked for never counts, whatever it says.
    _dump(tmp_path / "cg.300.out", 300, f"dump {MEASURED}", "123", "123")
    assert measured_instructions(tmp_path) == {100: 5000, 200: 3000}
    assert measured_instructions(tmp_path, WARMUP) == {100: 999}
    exit_dump = read_dump(tmp_path / "cg.100.out")
    assert (exit_dump.pid, exit_dump.part, exit_dump.trigger) == (100, 1, "Program termination")


def test_a_dump_of_several_events_gives_its_instructions(tmp_path: Path) -> None:
    _dump(tmp_path / "cg.7.out.3", 7, f"dump {MEASURED}", "120 3400 56", "120 3400 56", events="Dr Ir Dw")
    dump = read_dump(tmp_path / "cg.7.out.3")
    assert (dump.pid, dump.part, dump.instructions) == (7, 3, 3400)


def test_a_file_without_an_instruction_count_is_an_error(tmp_path: Path) -> None:
    _dump(tmp_path / "cg.8.out.1", 8, f"dump {MEASURED}", "10", "10", events="Dr")
    with pytest.raises(ValueError, match="Ir count"):
        measured_instructions(tmp_path)
    _dump(tmp_path / "cg.8.out.1", 8, f"dump {MEASURED}", None, None)
    with pytest.raises(ValueError, match="not a callgrind dump"):
        read_dump(tmp_path / "cg.8.out.1")


# -- the client -------------------------------------------------------------------------


@pytest.fixture
def scripted_server() -> Iterator[tuple[int, list[bytes], list[int]]]:
    """A loopback server answering each request with the next of ``answers`` (in two writes), counting requests."""
    answers: list[bytes] = []
    received = [0]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve(conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buffer += chunk
                _, _, buffer = buffer.partition(b"\r\n\r\n")
                received[0] += 1
                answer = answers[min(received[0], len(answers)) - 1]
                conn.sendall(answer[:10])  # the client must wait for the rest of the head and the body
                conn.sendall(answer[10:])

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], answers, received
    finally:
        listener.close()


_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\ncontent-length: 13\r\n\r\nHello, World!"


def test_the_client_sends_exactly_the_requests_asked_over_its_connections(
    scripted_server: tuple[int, list[bytes], list[int]],
) -> None:
    port, answers, received = scripted_server
    answers.append(_OK)
    send_requests(port, 25, 4, timeout_s=10)
    assert received[0] == 25
    received[0] = 0
    send_requests(port, 2, 8, timeout_s=10)  # fewer requests than connections: one each
    assert received[0] == 2


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", "answered 'HTTP/1.1 503"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "without Content-Length"),
    ],
)
def test_an_answer_the_count_cannot_use_is_an_error(
    scripted_server: tuple[int, list[bytes], list[int]], answer: bytes, message: str
) -> None:
    port, answers, _ = scripted_server
    answers.extend([_OK, answer])
    with pytest.raises(RuntimeError, match=message):
        send_requests(port, 5, 1, timeout_s=10)


# -- the command's errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--requests", "0"], "--requests"),
        (["--requests", "many"], "--requests"),
        (["--warmup", "-1"], "--warmup"),
        (["--connections", "0"], "--connections"),
        (["--start-timeout", "0"], "--start-timeout"),
        (["--start-timeout", "inf"], "--start-timeout"),
        (["--servers", "nginx"], "unknown server(s) nginx"),
        (["--servers", ","], "names no server"),
    ],
)
def test_bad_options_are_argparse_errors_naming_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_instructions(argv, io.StringIO())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --" in err and named in err


def test_a_server_not_installed_is_named_even_when_it_is_a_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every other server available, whatever this machine has installed (granian may be missing too).
    for name, spec in list(THROUGHPUT_SERVERS.items()):
        monkeypatch.setitem(THROUGHPUT_SERVERS, name, dataclasses.replace(spec, unavailable=lambda: None))
    missing = dataclasses.replace(THROUGHPUT_SERVERS["bjoern"], unavailable=lambda: "bjoern is not installed (pip)")
    monkeypatch.setitem(THROUGHPUT_SERVERS, "bjoern", missing)
    for argv in (["--servers", "frontdoor,bjoern"], []):
        with pytest.raises(SystemExit):
            bench_instructions(argv, io.StringIO())
        assert "argument --servers: bjoern cannot run here: bjoern is not installed" in capsys.readouterr().err
    assert "bjoern" in InstructionSettings().servers


def test_without_valgrind_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "valgrind" else real_which(name))
    monkeypatch.setattr(instructions, "run_instructions", lambda *a, **k: pytest.fail("ran without valgrind"))
    assert bench_instructions(["--servers", "frontdoor"], io.StringIO()) == 1
    assert "valgrind not found" in capsys.readouterr().err
    assert cli.main(["bench", "instructions", "--servers", "frontdoor"], io.StringIO()) == 1
    err = capsys.readouterr().err
    assert err.startswith("prazo: error: valgrind not found") and "apt-get install valgrind" in err


# -- a real run -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_short_real_run_counts_the_front_door_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (apt-get install valgrind)")
    recorded: dict[str, Any] = {}
    real = instructions.run_instructions

    def recording(settings: InstructionSettings, progress: Any = None) -> Any:
        recorded["settings"] = settings
        recorded["results"] = real(settings, progress)
        return recorded["results"]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(instructions, "run_instructions", recording)
        argv = ["--servers", "frontdoor", "--requests", "100", "--warmup", "20", "--connections", "4", "--json"]
        assert bench_instructions(argv, out) == 0
    document = json.loads(out.getvalue())
    assert document["machine"]["cpu_model"] and document["machine"]["cpus"] == os.cpu_count()
    assert (document["requests"], document["warmup"], document["connections"]) == (100, 20, 4)
    (entry,) = document["servers"]
    assert entry["server"] == "frontdoor" and entry["vs_first"] == 1.0
    # One process, whose measured dump holds the 100 requests: never nothing (an empty span)
    # and not what a whole start-up costs (hundreds of millions), whatever the CPU.
    assert len(entry["processes"]) == 1
    assert entry["instructions"] == sum(entry["processes"].values())
    assert 1_000 < entry["instructions_per_request"] < 10_000_000
    assert entry["instructions_per_request"] == round(entry["instructions"] / 100)
    assert "frontdoor:" in capsys.readouterr().err
    # The table of the same run (not a second one: a run costs seconds under callgrind).
    lines = render_report(recorded["results"], recorded["settings"], document["machine"], "valgrind").splitlines()
    assert lines[0].startswith("instructions per request, callgrind (valgrind)")
    assert lines[1].startswith(f"machine: {document['machine']['cpu_model']}, {os.cpu_count()} CPUs")
    assert lines[2].split()[:4] == ["server", "instr/request", "vs", "frontdoor"]
    assert lines[3].split()[:3] == ["frontdoor", f"{entry['instructions_per_request']:,}", "1.00×"]
