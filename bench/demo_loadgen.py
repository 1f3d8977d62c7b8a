"""An open-loop HTTP load generator in its own process: Poisson arrivals on a fixed schedule.

A closed-loop client (send, wait for the answer, send the next) slows down
with the server it measures, and so hides exactly the queueing a slow
dependency causes ("coordinated omission"). This one decides every arrival
time in advance from a seeded Poisson process and sends each request at its
time whatever happened to the earlier ones; each request's latency counts
from its *scheduled* time, so a generator that falls behind cannot flatter
the server. How far behind it fell is measured and reported (``lag``).

It runs in a separate process (``python -m prazo.bench.demo_loadgen``) so the
service under test does not share its GIL with its clients. Each request is
one HTTP/1.1 exchange on its own TCP connection to 127.0.0.1 (asyncio
streams): no client-side pool that could itself fill up and queue, and
thousands of requests can be open at once while a server stalls.

``LoadGenerator(plan)`` drives the process from the demo::

    generator = LoadGenerator(plan).start()     # spawned, imports done, waiting
    start_ns = generator.begin()                # the schedule's time zero
    records = generator.wait()                  # one Record per request

``Record.stale_age_s`` is read from the ``X-Stale-Age-S`` response header
(the demo's service sets it when it answered from last-known-good).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

__all__ = ["STALE_HEADER", "LoadGenerator", "LoadPlan", "Record", "main", "schedule"]

STALE_HEADER = "X-Stale-Age-S"
_READY = "ready"
_START_SLACK_NS = 200_000_000  # time zero is this far after the generator said it was ready
_WAIT_SLACK_S = 60.0


@dataclass(frozen=True)
class LoadPlan:
    """What to send: ``rate_per_s`` arrivals per second for ``duration_s``, split over ``mix``.

    ``mix`` maps an endpoint path to its weight; each arrival asks for
    ``path?id=K`` with ``K`` uniform in ``[1, keys]``. ``timeout_s`` maps a
    path to how long its client waits for the whole answer (default
    ``default_timeout_s``); each request also sends its timeout as its budget
    (``X-Request-Budget-Ms``), as a deadline-aware client would.
    """

    port: int
    rate_per_s: float
    duration_s: float
    mix: Mapping[str, float]
    timeout_s: Mapping[str, float] = field(default_factory=dict)
    default_timeout_s: float = 5.0
    keys: int = 50
    seed: int = 9

    def timeout_for(self, path: str) -> float:
        return self.timeout_s.get(path, self.default_timeout_s)


@dataclass
class Record:
    """One request: times are ``time.monotonic_ns()`` values (the clock all processes share on Linux)."""

    endpoint: str
    scheduled_ns: int
    sent_ns: int
    done_ns: int
    status: int  # 0 when no answer came (timeout or connection error)
    error: str | None = None
    stale_age_s: float | None = None

    @property
    def latency_ms(self) -> float:
        """From the scheduled send time to the answer (or to giving up)."""
        return (self.done_ns - self.scheduled_ns) / 1e6

    @property
    def lag_ms(self) -> float:
        """How late the generator sent it."""
        return (self.sent_ns - self.scheduled_ns) / 1e6


def schedule(plan: LoadPlan) -> list[tuple[int, str, int]]:
    """The arrivals ``(offset_ns, path, key)``, the same for every run of the same plan."""
    rng = random.Random(plan.seed)
    paths = list(plan.mix)
    weights = [plan.mix[p] for p in paths]
    arrivals: list[tuple[int, str, int]] = []
    at = 0.0
    while True:
        at += rng.expovariate(plan.rate_per_s)
        if at >= plan.duration_s:
            return arrivals
        arrivals.append((int(at * 1e9), rng.choices(paths, weights)[0], rng.randint(1, plan.keys)))


async def _one(plan: LoadPlan, path: str, key: int, scheduled_ns: int) -> Record:
    timeout = plan.timeout_for(path)
    sent_ns = time.monotonic_ns()
    record = Record(path, scheduled_ns, sent_ns, 0, 0)
    request = (
        f"GET {path}?id={key} HTTP/1.1\r\nHost: 127.0.0.1:{plan.port}\r\n"
        f"X-Request-Budget-Ms: {int(timeout * 1000)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    writer: asyncio.StreamWriter | None = None

    async def exchange() -> None:
        nonlocal writer
        reader, writer = await asyncio.open_connection("127.0.0.1", plan.port)
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *lines = head.split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length")
        if length is not None:
            await reader.readexactly(int(length))
        else:
            await reader.read()
        record.status = int(status_line.split(" ", 2)[1])
        stale = headers.get(STALE_HEADER.lower())
        if stale is not None:
            record.stale_age_s = float(stale)

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        record.error = "timeout"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as exc:
        record.error = type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
    if record.error is not None:
        record.status = 0
    record.done_ns = time.monotonic_ns()
    return record


async def _run(plan: LoadPlan, start_ns: int) -> list[Record]:
    tasks = []
    for offset_ns, path, key in schedule(plan):
        scheduled_ns = start_ns + offset_ns
        delay = (scheduled_ns - time.monotonic_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_one(plan, path, key, scheduled_ns)))
    return list(await asyncio.gather(*tasks))


def main() -> int:
    """The generator process: plan (JSON) as argv[1]; says ``ready``; reads time zero; prints the records."""
    plan = LoadPlan(**json.loads(sys.argv[1]))
    print(_READY, flush=True)
    start_ns = int(sys.stdin.readline())
    records = asyncio.run(_run(plan, start_ns))
    json.dump([list(asdict(r).values()) for r in records], sys.stdout)
    return 0


class LoadGenerator:
    """The generator process, from the demo's side."""

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        self._process: subprocess.Popen[str] | None = None
        self.start_ns = 0

    def start(self) -> Self:
        """Spawn the process and wait until it is ready to send."""
        plan = json.dumps(asdict(self.plan))
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, plan], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if line != _READY:
            self._process.kill()
            raise RuntimeError(f"the load generator did not start (said {line!r})")
        return self

    def begin(self) -> int:
        """Start the schedule; returns its time zero (``time.monotonic_ns()``)."""
        assert self._process is not None and self._process.stdin is not None
        self.start_ns = time.monotonic_ns() + _START_SLACK_NS
        self._process.stdin.write(f"{self.start_ns}\n")
        self._process.stdin.flush()
        return self.start_ns

    def wait(self) -> list[Record]:
        """Every request's record, once the last one was answered or timed out."""
        assert self._process is not None
        limit = self.plan.duration_s + max([self.plan.default_timeout_s, *self.plan.timeout_s.values()]) + _WAIT_SLACK_S
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.append(self._process.stdout.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(limit)
        if self._process.wait(timeout=5) != 0 or not output:
            raise RuntimeError("the load generator failed")
        rows: list[list[Any]] = json.loads(output[0])
        return [Record(*row) for row in rows]

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


if __name__ == "__main__":
    sys.exit(main())
