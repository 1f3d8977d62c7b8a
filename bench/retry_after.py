"""The measured Retry-After against a fixed ``Retry-After: 1``: how many retries are refused again.

::

    python -m prazo.bench.retry_after [--profiles fast,slow] [--load 2] [--seconds 14] [--json]

One ``prazo serve --server prazo`` instance on loopback runs ``app`` below
(``time.sleep``, so the two cores are not what limits it), once with the
line's measured wait (the default) and once with ``--retry-after-s 1``,
nothing else different. Open-loop Poisson callers at ``--load`` times its
capacity, each under a 3000 ms deadline, call it through prazo's own
``deadline_urlopen`` and ``RetryPolicy(max_attempts=2)`` (a retry budget too
large to say no: the subject is the wait), which waits what the server asked
for (``X-Prazo-Retry-After-Ms`` when it is there, else ``Retry-After``) and
gives up at once when that wait leaves no room in the deadline. Only the
calls that arrive in the steady middle of the run are counted (after the
first second, and no later than one deadline before the arrivals stop).

Profiles: ``fast`` is 4 threads of 50 ms and a line of 4 (80/s; the line
drains in well under a second), ``slow`` 4 threads of 400 ms and a line of 16
(10/s; the line takes about 1.7 s to drain, longer than the fixed second).

Columns: ``retries`` made; ``refused again`` the share of them answered 503
again; ``gave up`` calls refused at first whose Retry-After did not fit
their deadline (no retry sent); ``504s`` answers that missed the deadline in line; ``goodput/s``
the counted calls' 200s per second of the counted stretch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from prazo.bench.serve_process import start_serve
from prazo.bindings.clients.urllib import deadline_urlopen
from prazo.bindings.retries import RetryBudget, RetryPolicy, response_failure
from prazo.bindings.retries.failures import RETRYABLE_REASONS
from prazo.core import Deadline, DeadlineExceeded, DownstreamOverloaded, deadline_scope

__all__ = ["PROFILES", "RetryAfterPoint", "app", "main", "run_point"]

BUDGET_MS = 3000.0
_SERVICE_MS = "PRAZO_BENCH_SERVICE_MS"
_STARTUP = re.compile(r"http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class Profile:
    threads: int
    service_ms: float
    max_queue: int

    @property
    def capacity_per_s(self) -> float:
        return self.threads * 1000 / self.service_ms


PROFILES = {"fast": Profile(4, 50.0, 4), "slow": Profile(4, 400.0, 16)}


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """``PRAZO_BENCH_SERVICE_MS`` of sleep, then ``ok``."""
    time.sleep(float(os.environ.get(_SERVICE_MS, "50")) / 1000)
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


@dataclass
class RetryAfterPoint:
    profile: str
    retry_after: str
    rate_per_s: float
    calls: int
    first_refused: int
    retries: int
    refused_again: int
    gave_up: int
    answers_504: int
    good_per_s: float

    @property
    def refused_again_share(self) -> float:
        return self.refused_again / self.retries if self.retries else 0.0


def _serve(profile: Profile, fixed: bool) -> tuple[subprocess.Popen[str], int]:
    options = [
        "--server", "prazo", "--port", "0", "--threads", str(profile.threads),
        "--max-queue", str(profile.max_queue), "--max-budget-ms", str(BUDGET_MS),
        *(["--retry-after-s", "1"] if fixed else []),
    ]  # fmt: skip
    process, found = start_serve(
        "prazo.bench.retry_after:app", options, _STARTUP, {_SERVICE_MS: f"{profile.service_ms:g}"}
    )
    return process, int(found.group(1))


class _Tally:
    """What every call's attempts met, counted under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = self.first_refused = self.retries = self.refused_again = self.answers_504 = self.good = 0
        self.gave_up = 0

    def attempt(self, number: int, status: int) -> None:
        with self.lock:
            if number == 1:
                self.calls += 1
                self.first_refused += status == 503
            else:
                self.retries += 1
                self.refused_again += status == 503
            self.answers_504 += status == 504
            self.good += status == 200

    def call_ended(self, attempts: int, first_status: int) -> None:
        """A call refused at first and never retried gave up: its Retry-After did not fit its deadline."""
        if attempts == 1 and first_status == 503:
            with self.lock:
                self.gave_up += 1


def _call(url: str, policy: RetryPolicy, tally: _Tally | None) -> None:
    statuses: list[int] = []

    def attempt(number: int) -> int:
        status = 0
        try:
            with deadline_urlopen(url) as response:
                response.read()
                status = int(response.status)
                return status
        except DownstreamOverloaded:
            status = 503
            raise
        except DeadlineExceeded:
            status = 504
            raise
        finally:
            statuses.append(status)
            if tally is not None:
                tally.attempt(number, status)

    def classify(exc: BaseException) -> Any:
        return response_failure(exc, retryable_reasons=RETRYABLE_REASONS)

    with deadline_scope(Deadline.after_ms(BUDGET_MS)):
        try:
            policy.call(attempt, classify, destination=url, idempotent=True)
        except (DownstreamOverloaded, DeadlineExceeded, OSError):
            pass
    if tally is not None and statuses:
        tally.call_ended(len(statuses), statuses[0])


def run_point(name: str, fixed: bool, load: float, seconds: float, seed: int = 1) -> RetryAfterPoint:
    """One profile under ``load`` × its capacity, with the measured (``fixed`` False) or the fixed Retry-After."""
    profile = PROFILES[name]
    server, port = _serve(profile, fixed)
    url = f"http://127.0.0.1:{port}/"
    # A budget too large to refuse: the wait is the subject, not the budget.
    policy = RetryPolicy(max_attempts=2, budget=RetryBudget(percent=1.0, min_per_s=1000.0), max_backoff_ms=BUDGET_MS)
    tally = _Tally()
    rate = load * profile.capacity_per_s
    rng = random.Random(seed)
    callers: list[threading.Thread] = []
    # Only calls arriving in the steady middle count: the first second fills the line, and a
    # retry of a call from the last seconds would land after the load stopped (into an empty line).
    counted = (1.0, seconds - BUDGET_MS / 1000)
    try:
        time.sleep(0.3)
        start = time.monotonic()
        at = start
        while at - start < seconds:
            at += rng.expovariate(rate)
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            steady = counted[0] <= at - start < counted[1]
            caller = threading.Thread(target=_call, args=(url, policy, tally if steady else None), daemon=True)
            caller.start()
            callers.append(caller)
        for caller in callers:
            caller.join(BUDGET_MS / 1000 + 10)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return RetryAfterPoint(
        profile=name,
        retry_after="fixed 1 s" if fixed else "measured",
        rate_per_s=rate,
        calls=tally.calls,
        first_refused=tally.first_refused,
        retries=tally.retries,
        refused_again=tally.refused_again,
        gave_up=tally.gave_up,
        answers_504=tally.answers_504,
        good_per_s=tally.good / (counted[1] - counted[0]),
    )


def render(points: Sequence[RetryAfterPoint], load: float) -> str:
    lines = [
        f"Steady {load:g}x capacity, {BUDGET_MS:g} ms deadlines, RetryPolicy(max_attempts=2) waiting what the server asks",
        "",
        "| profile | Retry-After | calls | first refused | retries | refused again | gave up | 504s | goodput/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for point in points:
        profile = PROFILES[point.profile]
        lines.append(
            f"| {point.profile} ({profile.capacity_per_s:g}/s) | {point.retry_after} | {point.calls} | "
            f"{point.first_refused} | {point.retries} | {point.refused_again} ({100 * point.refused_again_share:.0f} %) | "
            f"{point.gave_up} | {point.answers_504} | {point.good_per_s:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.retry_after", description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", default="fast,slow", help="which of fast, slow (default both)")
    parser.add_argument("--load", type=float, default=2.0, help="multiple of the capacity (default 2)")
    parser.add_argument("--seconds", type=float, default=14.0, help="seconds of arrivals per point (default 14)")
    parser.add_argument("--json", action="store_true", help="print the points as JSON")
    args = parser.parse_args(argv)
    out = out or sys.stdout
    names = [part.strip() for part in args.profiles.split(",") if part.strip()]
    unknown = sorted(set(names) - set(PROFILES))
    if unknown:
        parser.error(f"--profiles: unknown {', '.join(unknown)} (known: {', '.join(PROFILES)})")
    points = [run_point(name, fixed, args.load, args.seconds) for name in names for fixed in (False, True)]
    if args.json:
        print(json.dumps([asdict(point) for point in points], indent=2), file=out)
    else:
        print(render(points, args.load), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
