"""HAProxy in front of a fast and a 3×-slower prazo instance: round robin against agent-check weights.

::

    python -m prazo.bench.agent_weights [--loads 0.9,1.5] [--seconds 8] [--json]

Two ``prazo serve --server prazo`` instances on loopback run ``app`` below:
4 threads and a line of 4 each, 50 ms of service (``time.sleep``, so the two
cores are not what limits them) on the fast one and 150 ms on the slow one:
80 and 26.7 requests/s, 106.7/s together. HAProxy balances them round robin,
once with plain ``server`` lines and once with the agent check of
``prazo serve --agent-port`` (``agent-inter 100ms``), nothing else different:
no retries, no ``maxconn``, so what a client sees is what the instance
answered. The load is open-loop Poisson from its own process
(``prazo.bench.loadgen``), one connection per request, a 2000 ms budget, at
each of ``--loads`` times the joint capacity.

Columns: ``503s`` the answers ``503`` a client got (prazo's refusals:
``queue-full``); ``goodput/s`` the ``200``s within the budget per second; and
the share of the ``200``s each instance served (its ``X-Bench-Service-Ms``). Round robin sends each
instance half, so the slow one refuses about two thirds of its half while
the fast one has room below its capacity; with the agent check HAProxy sends
less to the instance whose line is filling.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from prazo.bench.loadgen import run_in_subprocess
from prazo.bench.serve_process import start_serve

__all__ = ["BalancerPoint", "app", "main", "run_point"]

THREADS = 4
QUEUE = 4
FAST_MS = 50.0
SLOW_MS = 150.0
BUDGET_MS = 2000.0
JOINT_CAPACITY = THREADS * 1000 / FAST_MS + THREADS * 1000 / SLOW_MS
_SERVICE_MS = "PRAZO_BENCH_SERVICE_MS"
_INSTANCE_HEADER = "X-Bench-Service-Ms"
_STARTUP = re.compile(r"http://127\.0\.0\.1:(\d+) .* agent-check on port (\d+)")


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """``PRAZO_BENCH_SERVICE_MS`` of sleep; the answer names its instance by that (``X-Bench-Service-Ms``)."""
    service_ms = os.environ.get(_SERVICE_MS, "50")
    time.sleep(float(service_ms) / 1000)
    start_response("200 OK", [("Content-Length", "2"), (_INSTANCE_HEADER, service_ms)])
    return [b"ok"]


@dataclass
class BalancerPoint:
    mode: str
    load: float
    rate_per_s: float
    requests: int
    refused_503: int
    good_per_s: float
    fast_share: float
    slow_share: float


def _serve(service_ms: float) -> tuple[subprocess.Popen[str], int, int]:
    options = [
        "--server", "prazo", "--port", "0", "--agent-port", "0", "--threads", str(THREADS),
        "--max-queue", str(QUEUE), "--max-budget-ms", str(BUDGET_MS),
    ]  # fmt: skip
    process, found = start_serve("prazo.bench.agent_weights:app", options, _STARTUP, {_SERVICE_MS: f"{service_ms:g}"})
    return process, int(found.group(1)), int(found.group(2))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _haproxy(mode: str, bind: int, servers: Sequence[tuple[int, int]], workdir: Path) -> subprocess.Popen[bytes]:
    lines = []
    for index, (port, agent) in enumerate(servers):
        agent_check = f" agent-check agent-port {agent} agent-inter 100ms" if mode == "agent-check" else ""
        lines.append(f"    server s{index} 127.0.0.1:{port} weight 100{agent_check}")
    config = workdir / f"{mode}.cfg"
    config.write_text(
        "defaults\n    mode http\n    timeout connect 1s\n    timeout client 10s\n    timeout server 10s\n"
        f"frontend in\n    bind 127.0.0.1:{bind}\n    default_backend prazo\n"
        "backend prazo\n    balance roundrobin\n" + "\n".join(lines) + "\n"
    )
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    process = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", bind), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("haproxy did not start")


def run_point(mode: str, load: float, seconds: float, workdir: Path, seed: int = 1) -> BalancerPoint:
    """One load against fresh instances behind a fresh HAProxy in ``mode`` (``round-robin`` or ``agent-check``)."""
    fast, fast_port, fast_agent = _serve(FAST_MS)
    slow, slow_port, slow_agent = _serve(SLOW_MS)
    bind = _free_port()
    haproxy = _haproxy(mode, bind, [(fast_port, fast_agent), (slow_port, slow_agent)], workdir)
    try:
        time.sleep(0.5)  # a few agent checks: both at 100 % before the load
        rate = load * JOINT_CAPACITY
        argv = ["--port", str(bind), "--rate", f"{rate:.3f}", "--seconds", str(seconds),
                "--budget-ms", str(BUDGET_MS), "--seed", str(seed), "--capture", _INSTANCE_HEADER]  # fmt: skip
        result = run_in_subprocess(argv, timeout_s=seconds + 60)
    finally:
        for process in (haproxy, fast, slow):
            process.terminate()
        for process in (haproxy, fast, slow):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    records = result.records  # [scheduled_ns, sent_ns, status, reason, latency_ns, outcome, target, captured]
    good = [r for r in records if r[2] == 200 and r[4] <= BUDGET_MS * 1e6]
    served = max(1, sum(1 for r in records if r[2] == 200))
    return BalancerPoint(
        mode=mode,
        load=load,
        rate_per_s=rate,
        requests=len(records),
        refused_503=sum(1 for r in records if r[2] == 503),
        good_per_s=len(good) / seconds,
        fast_share=sum(1 for r in records if r[2] == 200 and r[7] == f"{FAST_MS:g}") / served,
        slow_share=sum(1 for r in records if r[2] == 200 and r[7] == f"{SLOW_MS:g}") / served,
    )


def render(points: Sequence[BalancerPoint]) -> str:
    lines = [
        f"HAProxy round robin over a fast ({THREADS * 1000 / FAST_MS:.0f}/s) and a slow "
        f"({THREADS * 1000 / SLOW_MS:.1f}/s) prazo instance, {JOINT_CAPACITY:.1f}/s together; "
        f"{BUDGET_MS:g} ms budgets",
        "",
        "| load | balancing | requests | client 503s | goodput/s | 200s by the fast / slow one |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for point in points:
        lines.append(
            f"| {point.load:g}× ({point.rate_per_s:.0f}/s) | {point.mode} | {point.requests} | "
            f"{point.refused_503} | {point.good_per_s:.1f} | {100 * point.fast_share:.0f} % / {100 * point.slow_share:.0f} % |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.agent_weights", description=__doc__.split("\n")[0])
    parser.add_argument("--loads", default="0.9,1.5", help="multiples of the joint capacity (default 0.9,1.5)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of load per point (default 8)")
    parser.add_argument("--json", action="store_true", help="print the points as JSON")
    args = parser.parse_args(argv)
    out = out or sys.stdout
    loads = [float(part) for part in args.loads.split(",") if part.strip()]
    points = []
    with tempfile.TemporaryDirectory(prefix="prazo-agent-weights-") as workdir:
        for load in loads:
            for mode in ("round-robin", "agent-check"):
                points.append(run_point(mode, load, args.seconds, Path(workdir)))
    print(json.dumps([asdict(point) for point in points], indent=2) if args.json else render(points), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
