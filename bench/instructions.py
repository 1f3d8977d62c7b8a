"""``prazo bench instructions``: what one request costs each server in instructions, counted by callgrind.

::

    prazo bench instructions [--servers frontdoor,granian,bjoern] [--requests 2000] [--warmup 200]
                             [--connections 8] [--start-timeout 120] [--json]

Answers per second (``prazo bench throughput``) move with the CPU: one server
can lead on one CPU and trail on another. The instructions a server executes
per request do not, so they compare across machines and tell a change that
does less work from one that met a kinder CPU. The report still names the
machine (the ``machine:`` line, ``"machine"`` in the JSON): it says what ran.

Each server is started as ``prazo bench throughput`` starts it (its
``THROUGHPUT_SERVERS`` command line, the same hello-world app, threads and
line, pinned to CPU 0 where it can be), behind ``valgrind --tool=callgrind
--trace-children=yes``, so a process the server execs is counted too (granian
forks its worker, which valgrind follows anyway). Once it answers, this
process sends it ``--warmup`` requests from a plain-socket client:
``--connections`` keep-alive connections, each sending ``GET /`` as soon as
its previous answer (the head and its ``Content-Length`` body) is read. Then
``callgrind_control -d prazo-warmup`` on every process of the server,
``--requests`` requests, ``callgrind_control -d prazo-measured``, and the
server is killed. A server's figure is the sum over its processes of the
dumps marked ``prazo-measured``, divided by ``--requests``; the ratios are to
the first server named.

Why it is measured that way:

- **A dump starts the measured span, not** ``callgrind_control -z``. Both
  reset the per-thread counters, but ``-z`` leaves alone the cost callgrind
  sets aside for skipped calls (the PLT stubs, ``--skip-plt``): the
  ``totals:`` line of the first dump after it carries all of them since the
  process started (3.7 % more than the span's instructions, the first time
  this was run on the front door). A dump writes out and resets every counter.
- **A dump is picked by its trigger, not only by its name.** callgrind
  names a dump it is asked for ``cg.PID.out.N`` and the one it writes when
  the process exits ``cg.PID.out``; the measured one's header says ``desc:
  Trigger: dump prazo-measured``. Only a numbered file with that trigger
  counts, never the warm-up's dump, nor an exit dump (there is none: the
  server is killed; one would say ``Program termination``).
- **A dump's figure is its** ``summary:`` **line** (callgrind's per-thread
  instruction counters since the last dump), else its ``totals:`` line (the
  sum of its cost lines); after a dump the two agree.
- **The instrumentation is on from the start.** Turning it on for the span
  only (``--instr-atstart=no``, ``callgrind_control -i on``) starts a server
  faster, but callgrind then meets call stacks halfway; a dump of a server
  instrumented throughout reads whole in ``callgrind_annotate``. The price is
  the start: tens of seconds under callgrind, hence ``--start-timeout``.
- **The valgrind processes are this server's and no other's**: valgrind's
  ``--vgdb-prefix`` is in a directory of the run's own, so
  ``callgrind_control`` lists and reaches nothing else, and each server's
  count is checked to come from the same processes before and after the span.

Needs valgrind (``apt-get install valgrind``; ``callgrind_control`` ships with
it) and the servers named (granian and bjoern: ``pip install 'prazo[peers]'``).
"""

from __future__ import annotations

import argparse
import json
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from prazo.bench.goodput_servers import started
from prazo.bench.goodput_settings import GoodputSettings
from prazo.bench.harness import describe_machine, integer_argument, render_machine, run_standalone, seconds_argument
from prazo.bench.throughput import HELLO_APP, THROUGHPUT_SERVERS, ThroughputSettings, pinning, prefixed
from prazo.bindings.command import CommandError

__all__ = [
    "MEASURED",
    "WARMUP",
    "CallgrindDump",
    "InstructionSettings",
    "ServerInstructions",
    "add_bench_instructions_arguments",
    "bench_instructions",
    "count_server",
    "measured_instructions",
    "read_dump",
    "render_report",
    "run_bench_instructions",
    "run_instructions",
    "send_requests",
    "valgrind_version",
]

# The hints the two dumps carry in their ``desc: Trigger:`` line.
WARMUP = "prazo-warmup"
MEASURED = "prazo-measured"
_REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
# Patience with one answer, or with one callgrind_control command: under
# callgrind a first request through new code can take seconds.
_ANSWER_TIMEOUT_S = 60.0
_CONTROL_TIMEOUT_S = 120.0
# What callgrind names the dumps of ``--callgrind-out-file=DIR/cg.%p.out``.
_OUT_FILE = "cg.%p.out"
_DUMP_NAME = re.compile(r"cg\.(\d+)\.out\.(\d+)")


@dataclass(frozen=True)
class InstructionSettings:
    """Parameters of ``prazo bench instructions``."""

    servers: tuple[str, ...] = ("frontdoor", "granian", "bjoern")
    requests: int = 2000
    warmup: int = 200
    connections: int = 8
    start_timeout_s: float = 120.0


@dataclass(frozen=True)
class CallgrindDump:
    """One callgrind output file: whose, which part, why it was written, and its instructions."""

    path: Path
    pid: int
    part: int | None
    trigger: str
    instructions: int


@dataclass
class ServerInstructions:
    """One server's count: the measured dump's instructions of each of its processes, by pid."""

    name: str
    label: str
    requests: int
    by_process: dict[int, int] = field(default_factory=dict)
    vs_first: float | None = None

    @property
    def instructions(self) -> int:
        return sum(self.by_process.values())

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.name,
            "label": self.label,
            "instructions_per_request": round(self.per_request),
            "instructions": self.instructions,
            "requests": self.requests,
            "processes": {str(pid): count for pid, count in sorted(self.by_process.items())},
            "vs_first": None if self.vs_first is None else round(self.vs_first, 3),
        }


# -- the callgrind files ------------------------------------------------------------


def _costs(line: str) -> list[int]:
    return [int(number) for number in line.split(":", 1)[1].split()]


def read_dump(path: Path) -> CallgrindDump:
    """The header and the instructions (``Ir``) of one callgrind output file: ``summary:``, else ``totals:``."""
    pid: int | None = None
    part: int | None = None
    trigger = ""
    events: list[str] = []
    summary: list[int] | None = None
    totals: list[int] | None = None
    with open(path, encoding="utf-8", errors="replace") as dump:
        for line in dump:
            if line.startswith("pid:"):
                pid = int(line.split(":", 1)[1])
            elif line.startswith("part:"):
                part = int(line.split(":", 1)[1])
            elif line.startswith("desc: Trigger:"):
                trigger = line.split(":", 2)[2].strip()
            elif line.startswith("events:"):
                events = line.split(":", 1)[1].split()
            elif line.startswith("summary:"):
                summary = _costs(line)
            elif line.startswith("totals:"):
                totals = _costs(line)
    costs = summary if summary is not None else totals
    if pid is None or "Ir" not in events or costs is None or len(costs) <= events.index("Ir"):
        raise ValueError(f"{path} is not a callgrind dump with an Ir count (pid, events, summary or totals missing)")
    return CallgrindDump(path, pid, part, trigger, costs[events.index("Ir")])


def measured_instructions(directory: Path, hint: str = MEASURED) -> dict[int, int]:
    """The instructions of the dumps asked for with ``hint``, by pid: the files ``cg.PID.out.N`` whose trigger names it.

    The exit dumps (``cg.PID.out``, ``Program termination``) and the dumps
    asked for with another hint are left out.
    """
    counts: dict[int, int] = {}
    for path in sorted(directory.iterdir()):
        if _DUMP_NAME.fullmatch(path.name) is None:
            continue
        dump = read_dump(path)
        if hint in dump.trigger.split():
            counts[dump.pid] = counts.get(dump.pid, 0) + dump.instructions
    return counts


# -- callgrind_control --------------------------------------------------------------


def _control(vgdb_prefix: str, *args: str) -> str:
    argv = ["callgrind_control", f"--vgdb-prefix={vgdb_prefix}", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CONTROL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv)} had no answer within {_CONTROL_TIMEOUT_S:g} s") from None
    if done.returncode != 0 or "Error" in done.stdout:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stdout + done.stderr).strip()}")
    return done.stdout


def _callgrind_pids(vgdb_prefix: str) -> list[int]:
    """The processes running under callgrind with this vgdb prefix: the server's, every one."""
    pids = sorted(int(pid) for pid in re.findall(r"^PID (\d+):", _control(vgdb_prefix), re.MULTILINE))
    if not pids:
        raise RuntimeError("callgrind_control found no process of the server under callgrind")
    return pids


def _dump(vgdb_prefix: str, hint: str) -> list[int]:
    """Ask every process of the server for a dump marked ``hint``; the pids asked."""
    pids = _callgrind_pids(vgdb_prefix)
    _control(vgdb_prefix, f"--dump={hint}", *map(str, pids))
    return pids


# -- the client ---------------------------------------------------------------------


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def answer_end(self) -> int | None:
        """Where the answer at the buffer's start ends, once its head is in; None before."""
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return None
        status, *fields = bytes(self.buffer[:head_end]).decode("latin-1").split("\r\n")
        if status.split(" ", 2)[1:2] != ["200"]:
            raise RuntimeError(f"the server answered {status!r} where every answer should be 200")
        for line in fields:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                return head_end + 4 + int(value)
        raise RuntimeError(f"an answer without Content-Length: {status!r}")


def send_requests(port: int, requests: int, connections: int, timeout_s: float = _ANSWER_TIMEOUT_S) -> None:
    """``requests`` ``GET /`` over ``connections`` keep-alive connections, each sending the next once answered.

    Every answer must be a 200 with a ``Content-Length``, read to its last
    byte; a connection the server closes, or no answer within ``timeout_s``,
    is an error (a count over fewer requests than asked would be wrong).
    """
    count = min(requests, connections)
    sent = answered = 0
    with selectors.DefaultSelector() as selector:
        open_connections: list[socket.socket] = []
        try:
            for _ in range(count):
                sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
                open_connections.append(sock)
                sock.sendall(_REQUEST)
                sent += 1
                selector.register(sock, selectors.EVENT_READ, _Connection(sock))
            while answered < requests:
                ready = selector.select(timeout_s)
                if not ready:
                    raise RuntimeError(f"no answer within {timeout_s:g} s ({answered} of {requests} answered)")
                for key, _ in ready:
                    connection: _Connection = key.data
                    chunk = connection.sock.recv(65536)
                    if not chunk:
                        raise RuntimeError(f"the server closed a keep-alive connection ({answered} answered)")
                    connection.buffer += chunk
                    end = connection.answer_end()
                    if end is not None and len(connection.buffer) >= end:
                        del connection.buffer[:end]
                        answered += 1
                        if sent < requests:
                            connection.sock.sendall(_REQUEST)
                            sent += 1
        finally:
            for sock in open_connections:
                sock.close()


# -- the run ------------------------------------------------------------------------


def _valgrind(directory: Path) -> list[str]:
    return [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={directory / _OUT_FILE}", "--trace-children=yes",
        f"--vgdb-prefix={directory / 'vgdb'}", "--vgdb=yes",
    ]  # fmt: skip


def count_server(name: str, settings: InstructionSettings) -> ServerInstructions:
    """One server under callgrind: started, warmed up, measured over ``settings.requests``, killed."""
    throughput = ThroughputSettings()
    server_prefix, _ = pinning(throughput)
    server_settings = GoodputSettings(threads=throughput.threads, max_queue=throughput.max_queue)
    result = ServerInstructions(name, THROUGHPUT_SERVERS[name].label(), settings.requests)
    with tempfile.TemporaryDirectory(prefix="prazo-callgrind-") as workdir:
        directory = Path(workdir)
        vgdb_prefix = str(directory / "vgdb")
        spec = prefixed(THROUGHPUT_SERVERS[name], [*server_prefix, *_valgrind(directory)])
        with started(spec, HELLO_APP, server_settings, startup_timeout_s=settings.start_timeout_s) as target:
            if settings.warmup:
                send_requests(target.port, settings.warmup, settings.connections)
            before = _dump(vgdb_prefix, WARMUP)
            send_requests(target.port, settings.requests, settings.connections)
            after = _dump(vgdb_prefix, MEASURED)
        if before != after:
            raise RuntimeError(f"{name}'s processes changed during the measured span: {before} then {after}")
        result.by_process = measured_instructions(directory, MEASURED)
    missing = sorted(set(after) - set(result.by_process))
    if missing:
        raise RuntimeError(f"{name}: no {MEASURED} dump from process(es) {missing}")
    return result


def run_instructions(
    settings: InstructionSettings, progress: Callable[[str, ServerInstructions], object] | None = None
) -> list[ServerInstructions]:
    """Every server of ``settings``, one after another; each one's ratio to the first."""
    results = []
    for name in settings.servers:
        result = count_server(name, settings)
        results.append(result)
        if progress is not None:
            progress(name, result)
    first = results[0].per_request if results else 0.0
    for result in results:
        result.vs_first = result.per_request / first if first > 0 else None
    return results


def valgrind_version() -> str:
    """What ``valgrind --version`` says (``valgrind-3.19.0``)."""
    done = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, timeout=30, check=False)
    return done.stdout.strip() or "valgrind"


def render_report(
    results: Sequence[ServerInstructions], settings: InstructionSettings, machine: Mapping[str, object], tool: str
) -> str:
    """The counts as a text table, in the order asked, with the run's parameters and the machine."""
    first = results[0].name if results else "first"
    vs_first = f"vs {first}"
    lines = [
        f"instructions per request, callgrind ({tool}): hello world (13-byte body), {settings.requests} requests "
        f"after {settings.warmup} of warm-up, {settings.connections} keep-alive connections",
        f"{render_machine(machine)} (instructions do not depend on the CPU: this says what ran)",
        f"{'server':<16} {'instr/request':>13} {vs_first:>14} {'processes':>9}  label",
    ]
    for r in results:
        ratio = "—" if r.vs_first is None else f"{r.vs_first:.2f}×"
        lines.append(f"{r.name:<16} {r.per_request:>13,.0f} {ratio:>14} {len(r.by_process):>9}  {r.label}")
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------


def _server_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("names no server")
    unknown = [name for name in names if name not in THROUGHPUT_SERVERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown server(s) {', '.join(unknown)}; known: {', '.join(THROUGHPUT_SERVERS)}"
        )
    for name in names:
        why = THROUGHPUT_SERVERS[name].unavailable()
        if why is not None:
            raise argparse.ArgumentTypeError(f"{name} cannot run here: {why}")
    return names


def add_bench_instructions_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``prazo bench instructions``."""
    defaults = InstructionSettings()
    # Explicit defaults: ``prazo bench`` topics suppress the options not given. The servers' is a
    # string, so argparse checks it like a given one (a default server not installed is named).
    parser.add_argument(
        "--servers",
        type=_server_names,
        metavar="A,B",
        default=",".join(defaults.servers),
        help=f"servers to count, in order; ratios are to the first (default {','.join(defaults.servers)}; "
        f"known: {','.join(THROUGHPUT_SERVERS)})",
    )
    parser.add_argument(
        "--requests",
        type=integer_argument(1),
        metavar="N",
        default=defaults.requests,
        help=f"requests counted (default {defaults.requests})",
    )
    parser.add_argument(
        "--warmup",
        type=integer_argument(0),
        metavar="N",
        default=defaults.warmup,
        help=f"requests sent before counting (default {defaults.warmup})",
    )
    parser.add_argument(
        "--connections",
        type=integer_argument(1, 1000),
        metavar="N",
        default=defaults.connections,
        help=f"keep-alive connections, one request in flight on each (default {defaults.connections})",
    )
    parser.add_argument(
        "--start-timeout",
        dest="start_timeout_s",
        type=seconds_argument,
        metavar="S",
        default=defaults.start_timeout_s,
        help=f"how long a server under callgrind may take to answer (default {defaults.start_timeout_s:g})",
    )
    parser.add_argument("--json", action="store_true", default=False, help="print the results as one JSON object")


def _check_tools(names: Iterable[str] = ("valgrind", "callgrind_control")) -> None:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        raise CommandError(
            f"{' and '.join(missing)} not found: prazo bench instructions counts with valgrind's callgrind "
            "(apt-get install valgrind)"
        )


def run_bench_instructions(args: argparse.Namespace, out: TextIO) -> int:
    """Count as ``args`` (from ``add_bench_instructions_arguments``) say; print the table or JSON."""
    _check_tools()
    settings = InstructionSettings(
        servers=args.servers,
        requests=args.requests,
        warmup=args.warmup,
        connections=args.connections,
        start_timeout_s=args.start_timeout_s,
    )

    def progress(name: str, result: ServerInstructions) -> None:
        print(f"{name}: {result.per_request:,.0f} instructions per request", file=sys.stderr, flush=True)

    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = describe_machine()
    tool = valgrind_version()
    results = run_instructions(settings, progress)
    if args.json:
        document = {
            "started": started_at,
            "machine": machine,
            "tool": f"{tool} callgrind",
            "pinned": pinning(ThroughputSettings()) != ([], []),
            "requests": settings.requests,
            "warmup": settings.warmup,
            "connections": settings.connections,
            "threads": ThroughputSettings.threads,
            "servers": [r.to_json() for r in results],
        }
        print(json.dumps(document, indent=2), file=out)
    else:
        print(render_report(results, settings, machine, tool), file=out)
    return 0


def bench_instructions(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``prazo bench instructions`` as a standalone program; returns the exit status."""
    try:
        return run_standalone(
            "prazo bench instructions", __doc__, add_bench_instructions_arguments, run_bench_instructions, argv, out
        )
    except CommandError as exc:
        print(f"prazo bench instructions: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(bench_instructions())
