"""Observe-only under overload: nothing refused, and what the shadow says against a replay of the same run.

::

    python -m prazo.bench.observe_only [--server waitress|prazo] [--load 3] [--seconds 4] [--json]

The waitress embedding (or the front door, ``--server prazo``) on loopback in this process, 4 threads of 50 ms
(``time.sleep``: 80 requests/s) and a line of 16, serves open-loop Poisson
load from its own process (``prazo.bench.loadgen``) at ``--load`` times its
capacity, with 1000 ms budgets: once with ``--observe-only`` and once
enforcing, nothing else different.

Reported for the observing run: the answers the clients got (every one a
200, or late: nothing refused), the shadow line's decisions, and the same
run's arrivals and service times (the shadow's journal) replayed through an
enforcing line that knows each service time in advance
(``prazo.core.shadow.replay_enforcing``): the two must be equal, counter by
counter. For the enforcing run: what it really refused. The two runs differ
on purpose: refusing frees the threads, so the enforcing server's requests
take less time than the observed ones, and its arrivals after a refusal meet
a shorter line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from prazo.bench.loadgen import run_in_subprocess
from prazo.bindings.servers import waitress as prazo_waitress
from prazo.bindings.servers.settings import resolve_settings
from prazo.core import AdmissionQueue
from prazo.core.shadow import DECISIONS, replay_enforcing

__all__ = ["ObservedRun", "app", "main", "run"]

THREADS = 4
QUEUE = 16
SERVICE_MS = 50.0
BUDGET_MS = 1000.0
CAPACITY = THREADS * 1000 / SERVICE_MS


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """50 ms of sleep, then ``ok``."""
    time.sleep(SERVICE_MS / 1000)
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


@dataclass
class ObservedRun:
    mode: str
    rate_per_s: float
    requests: int
    answers: dict[str, int]
    late_200s: int
    decisions: dict[str, int] = field(default_factory=dict)
    replayed: dict[str, int] = field(default_factory=dict)


def _answers(records: Sequence[Sequence[Any]]) -> tuple[dict[str, int], int]:
    """Answers by status (``gave-up``: the client's budget ran out first), and the 200s later than the budget."""
    counts: dict[str, int] = {}
    late = 0
    for record in records:
        status = str(record[2]) if record[2] else "gave-up"
        counts[status] = counts.get(status, 0) + 1
        late += record[2] == 200 and record[4] > BUDGET_MS * 1e6
    return counts, late


SERVERS = ("waitress", "prazo")


@dataclass
class _Served:
    """A server started for one run: its port, its shadow line (observing), its stats, its stop."""

    port: int
    shadow: Any
    stats: Callable[[], dict[str, int]]
    stop: Callable[[], object]


def _serve(server_name: str, settings: Any) -> _Served:
    if server_name == "prazo":
        from prazo.bindings.servers.frontdoor import FrontDoorServer, create_server

        front_door = create_server(app, host="127.0.0.1", port=0, settings=settings)
        assert isinstance(front_door, FrontDoorServer)
        front_door.start()
        shadow = None if front_door.observer is None else front_door.observer.shadow
        return _Served(front_door.port, shadow, front_door.stats, lambda: front_door.shutdown(120.0))
    server = prazo_waitress.create_server(app, host="127.0.0.1", port=0, settings=settings)
    thread = threading.Thread(target=server.run, name="observe-only-io", daemon=True)
    thread.start()
    dispatcher = server.task_dispatcher.dispatcher

    def stop() -> None:
        # The stock line drains: every request is served, however late (its client may have left).
        prazo_waitress.shutdown(server, 120.0)
        thread.join(30)

    return _Served(server.effective_port, dispatcher.shadow, dispatcher.stats, stop)


def run(observe_only: bool, load: float, seconds: float, seed: int = 1, server_name: str = "waitress") -> ObservedRun:
    """One run at ``load`` × capacity against a fresh server (``SERVERS``), observing or enforcing."""
    settings = resolve_settings(
        threads=THREADS,
        max_queue=QUEUE,
        max_budget_ms=BUDGET_MS,
        default_budget_ms=BUDGET_MS,
        observe_only=observe_only,
    )
    served = _serve(server_name, settings)
    shadow = served.shadow
    if shadow is not None:
        shadow.keep_journal()
    try:
        rate = load * CAPACITY
        argv = ["--port", str(served.port), "--rate", f"{rate:.3f}", "--seconds", str(seconds),
                "--budget-ms", str(BUDGET_MS), "--seed", str(seed)]  # fmt: skip
        result = run_in_subprocess(argv, timeout_s=seconds + 120)
    finally:
        served.stop()
    answers, late = _answers(result.records)
    point = ObservedRun("observe-only" if observe_only else "enforcing", rate, len(result.records), answers, late)
    if shadow is not None:
        if server_name == "prazo":
            served.stats()  # the front door's last notes into the shadow
        shadow.catch_up(time.monotonic_ns() + 10**12)
        decided = shadow.stats()
        point.decisions = {name: decided[name] for name in DECISIONS}
        point.replayed = replay_enforcing(AdmissionQueue, shadow.journal(), THREADS, QUEUE, **settings.queue_options())
    else:
        stats = served.stats()
        point.decisions = {name: stats[name] for name in DECISIONS}
    return point


def render(points: Sequence[ObservedRun], server_name: str = "waitress") -> str:
    what = "the front door" if server_name == "prazo" else "waitress embedding"
    lines = [
        f"{what}, {THREADS} threads x {SERVICE_MS:g} ms ({CAPACITY:g}/s), a line of {QUEUE}, {BUDGET_MS:g} ms budgets",
        "",
        "| run | arrivals/s | requests | answers | late 200s | line's decisions (offered / full / expired / doomed) "
        "| replayed enforcing line |",
        "| --- | ---: | ---: | --- | ---: | --- | --- |",
    ]
    for point in points:
        answers = ", ".join(f"{status}: {count}" for status, count in sorted(point.answers.items()))

        def decisions(counts: dict[str, int]) -> str:
            if not counts:
                return "—"
            expired = counts["expired_on_arrival"] + counts["expired_in_queue"]
            return f"{counts['offered']} / {counts['rejected_full']} / {expired} / {counts['insufficient_budget']}"

        lines.append(
            f"| {point.mode} | {point.rate_per_s:.0f} | {point.requests} | {answers} | {point.late_200s} | "
            f"{decisions(point.decisions)} | {decisions(point.replayed)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.observe_only", description=__doc__.split("\n")[0])
    parser.add_argument("--server", choices=SERVERS, default="waitress", help="the server (default waitress)")
    parser.add_argument("--load", type=float, default=3.0, help="multiple of the capacity (default 3)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of arrivals per run (default 4)")
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = parser.parse_args(argv)
    out = out or sys.stdout
    points = [run(mode, args.load, args.seconds, server_name=args.server) for mode in (True, False)]
    print(
        json.dumps([asdict(point) for point in points], indent=2) if args.json else render(points, args.server),
        file=out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
