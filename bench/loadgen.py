"""The load generator of ``prazo bench goodput``: open-loop Poisson arrivals from a process of its own.

::

    python -m prazo.bench.loadgen --port 8000 --rate 500 --seconds 4 [--budget-ms 1000] [--seed 1]
    python -m prazo.bench.loadgen --port 8000 --closed 8 --seconds 3 --budget-ms 10000

prints one JSON object: per request ``[scheduled_ns, sent_ns, status,
reason, latency_ns, outcome]`` (times relative to the start of the
schedule), its own CPU time and wall time.

**The model.** One new TCP connection per request (``Connection: close``):
the simplest honest open-loop client, since a request never waits for
another one's connection. Arrivals follow a seeded Poisson process at
``--rate`` for ``--seconds`` (at most ``--max-requests``); each request is
sent at its scheduled time whatever happened to the earlier ones. It carries
``X-Request-Budget-Ms`` and, for the bench apps' bookkeeping, its own give-up
time ``X-Bench-Give-Up-At-Ns`` (CLOCK_MONOTONIC, shared by every process of
the machine). At ``budget`` after it was sent the client gives up: the
connection is closed, whatever state it is in (a real client timeout), and
an answer arriving later is never read. ``--closed N`` is the other mode:
N clients each sending the next request as soon as the previous one ended
(for measuring capacity).

**One thread, non-blocking sockets, epoll** (``selectors``): no thread per
request to schedule, so the schedule is kept at a thousand new connections
a second on one core. Whether it was kept is measured, not assumed: ``lag``
is how late each request was sent after its scheduled time, and the CPU
time of this process is reported. A caller should refuse a point whose lag
p99 is large (``prazo.bench.goodput`` flags it loudly).

Outcomes: ``ok`` (a complete 200 within the budget), ``refused`` (503, 504,
408 or 429 within the budget; ``reason`` is the ``X-Prazo-Reason`` header or
empty), ``status`` (any other complete answer), ``timeout`` (no complete
answer within the budget; the client gave up), ``error`` (the connection was
refused, reset or closed before a complete answer). Every request sent ends
in exactly one of them.
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import random
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "OUTCOMES",
    "REFUSAL_STATUSES",
    "LoadResult",
    "parse_head",
    "poisson_schedule",
    "run_closed",
    "run_in_subprocess",
    "run_load",
    "run_open",
]

OUTCOMES = ("ok", "refused", "status", "timeout", "error")
REFUSAL_STATUSES = frozenset({503, 504, 408, 429})
GIVE_UP_HEADER = "X-Bench-Give-Up-At-Ns"
_RECV = 65536


def poisson_schedule(rate: float, seconds: float, max_requests: int, seed: int) -> list[int]:
    """Send times in ns from the start: exponential gaps of mean ``1/rate``, within ``seconds``, at most ``max_requests``."""
    if not rate > 0 or not seconds > 0:
        raise ValueError(f"rate and seconds must be > 0, got {rate!r}, {seconds!r}")
    rng = random.Random(seed)
    times: list[int] = []
    t = 0.0
    while len(times) < max_requests:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        times.append(int(t * 1e9))
    return times


def parse_head(buffer: bytes | bytearray) -> tuple[int, str, int | None, int] | None:
    """``(status, X-Prazo-Reason, Content-Length or None, end of head)`` once the head is complete, else None.

    Raises ValueError for a head that is not HTTP/1.x.
    """
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0]!r}")
    reason = ""
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "x-prazo-reason":
            reason = value.strip()
        elif name == "content-length" and value.strip().isdigit():
            length = int(value.strip())
    return int(parts[1]), reason, length, end + 4


@dataclass
class LoadResult:
    """What the generator measured: one record per request, and its own cost."""

    records: list[list[Any]] = field(
        default_factory=list
    )  # [scheduled_ns, sent_ns, status, reason, latency_ns, outcome]
    wall_s: float = 0.0
    cpu_s: float = 0.0
    schedule_s: float = 0.0
    niceness: int = 0

    @property
    def cpu_pct(self) -> float:
        return 100 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "schedule_s": self.schedule_s,
            "niceness": self.niceness,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadResult:
        return cls(data["records"], data["wall_s"], data["cpu_s"], data["schedule_s"], data.get("niceness", 0))


class _Request:
    __slots__ = ("buffer", "done", "give_up_ns", "head", "index", "out", "scheduled_ns", "sent_ns", "sock")

    def __init__(self, index: int, scheduled_ns: int, sent_ns: int, give_up_ns: int) -> None:
        self.index = index
        self.scheduled_ns = scheduled_ns
        self.sent_ns = sent_ns
        self.give_up_ns = give_up_ns
        self.sock: socket.socket | None = None
        self.out = b""
        self.buffer = bytearray()
        self.head: tuple[int, str, int | None, int] | None = None
        self.done = False


class _Engine:
    """The event loop shared by both modes: connections in flight, and the give-up clock."""

    def __init__(self, host: str, port: int, budget_ms: float, path: str) -> None:
        self.address = (host, port)
        self.budget_ns = int(budget_ms * 1e6)
        self.budget_header = f"{budget_ms:g}"
        self.prefix = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nX-Request-Budget-Ms: {self.budget_header}\r\n"
        self.selector = selectors.DefaultSelector()
        # Every request has the same budget, so give-up times are in send order.
        self.in_flight: deque[_Request] = deque()
        self.open = 0
        self.result = LoadResult()
        self.origin_ns = 0
        self.on_done: Any = None

    def send(self, index: int, scheduled_ns: int) -> None:
        sent_ns = time.monotonic_ns()
        request = _Request(index, scheduled_ns, sent_ns, sent_ns + self.budget_ns)
        request.out = (f"{self.prefix}{GIVE_UP_HEADER}: {request.give_up_ns}\r\nConnection: close\r\n\r\n").encode(
            "ascii"
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        request.sock = sock
        self.open += 1
        self.in_flight.append(request)
        code = sock.connect_ex(self.address)
        if code not in (0, errno.EINPROGRESS):
            self.finish(request, 0, f"connect: {errno.errorcode.get(code, code)}", "error")
            return
        self.selector.register(sock, selectors.EVENT_WRITE, request)

    def finish(self, request: _Request, status: int, reason: str, outcome: str) -> None:
        if request.done:
            return
        request.done = True
        now = time.monotonic_ns()
        sock = request.sock
        if sock is not None:
            try:
                self.selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
            request.sock = None
        self.open -= 1
        self.result.records.append(
            [
                request.scheduled_ns - self.origin_ns,
                request.sent_ns - self.origin_ns,
                status,
                reason,
                now - request.sent_ns,
                outcome,
            ]
        )
        if self.on_done is not None:
            self.on_done(now)

    def expire(self, now: int) -> None:
        while self.in_flight and (self.in_flight[0].done or self.in_flight[0].give_up_ns <= now):
            request = self.in_flight.popleft()
            if not request.done:
                status = request.head[0] if request.head is not None else 0
                self.finish(request, status, "gave up at the budget", "timeout")

    def poll(self, timeout_s: float) -> None:
        for key, mask in self.selector.select(timeout_s):
            request: _Request = key.data
            if request.done:
                continue
            if mask & selectors.EVENT_WRITE:
                self.on_writable(request)
            else:
                self.on_readable(request)

    def on_writable(self, request: _Request) -> None:
        sock = request.sock
        assert sock is not None
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self.finish(request, 0, f"connect: {errno.errorcode.get(code, code)}", "error")
            return
        try:
            sent = sock.send(request.out)
        except BlockingIOError:
            return
        except OSError as exc:
            self.finish(request, 0, f"send: {errno.errorcode.get(exc.errno or 0, exc.errno)}", "error")
            return
        request.out = request.out[sent:]
        if not request.out:
            self.selector.modify(sock, selectors.EVENT_READ, request)

    def on_readable(self, request: _Request) -> None:
        sock = request.sock
        assert sock is not None
        try:
            data = sock.recv(_RECV)
        except BlockingIOError:
            return
        except OSError as exc:
            self.finish(request, 0, f"recv: {errno.errorcode.get(exc.errno or 0, exc.errno)}", "error")
            return
        request.buffer += data
        if request.head is None:
            try:
                request.head = parse_head(request.buffer)
            except ValueError:
                self.finish(request, 0, "malformed answer", "error")
                return
        head = request.head
        if head is not None:
            status, reason, length, body_start = head
            complete = (length is not None and len(request.buffer) - body_start >= length) or (
                length is None and not data
            )
            if complete:
                outcome = "ok" if status == 200 else "refused" if status in REFUSAL_STATUSES else "status"
                self.finish(request, status, reason, outcome)
                return
        if not data:
            self.finish(request, 0, "closed before a complete answer", "error")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_open(host: str, port: int, schedule_ns: list[int], budget_ms: float = 1000.0, path: str = "/") -> LoadResult:
    """Send one request at each time of ``schedule_ns`` (from now), open loop; wait for every outcome."""
    engine = _Engine(host, port, budget_ms, path)
    cpu0, wall0 = _cpu_s(), time.monotonic()
    origin = engine.origin_ns = time.monotonic_ns()
    following = 0
    while following < len(schedule_ns) or engine.open:
        now = time.monotonic_ns()
        while following < len(schedule_ns) and origin + schedule_ns[following] <= now:
            engine.send(following, origin + schedule_ns[following])
            following += 1
            now = time.monotonic_ns()
        engine.expire(now)
        wake = [origin + schedule_ns[following]] if following < len(schedule_ns) else []
        if engine.in_flight:
            wake.append(engine.in_flight[0].give_up_ns)
        timeout = max(0.0, (min(wake) - now) / 1e9) if wake else 0.05
        engine.poll(timeout)
    engine.result.wall_s = time.monotonic() - wall0
    engine.result.cpu_s = _cpu_s() - cpu0
    engine.result.schedule_s = (schedule_ns[-1] / 1e9) if schedule_ns else 0.0
    return engine.result


def run_closed(host: str, port: int, clients: int, seconds: float, budget_ms: float, path: str = "/") -> LoadResult:
    """``clients`` closed-loop clients for ``seconds``: each sends its next request when its last one ended."""
    engine = _Engine(host, port, budget_ms, path)
    cpu0, wall0 = _cpu_s(), time.monotonic()
    origin = engine.origin_ns = time.monotonic_ns()
    stop_ns = origin + int(seconds * 1e9)
    pending = [0]
    count = [0]

    def on_done(now: int) -> None:
        if now < stop_ns:
            pending[0] += 1

    engine.on_done = on_done
    for _ in range(clients):
        engine.send(count[0], time.monotonic_ns())
        count[0] += 1
    while engine.open or pending[0]:
        while pending[0]:
            pending[0] -= 1
            engine.send(count[0], time.monotonic_ns())
            count[0] += 1
        now = time.monotonic_ns()
        engine.expire(now)
        timeout = max(0.0, (engine.in_flight[0].give_up_ns - now) / 1e9) if engine.in_flight else 0.0
        engine.poll(min(timeout, 0.05))
    engine.result.wall_s = time.monotonic() - wall0
    engine.result.cpu_s = _cpu_s() - cpu0
    engine.result.schedule_s = seconds
    return engine.result


def run_load(args: argparse.Namespace) -> LoadResult:
    """A run as the command-line ``args`` say."""
    if args.closed:
        return run_closed(args.host, args.port, args.closed, args.seconds, args.budget_ms, args.path)
    schedule = poisson_schedule(args.rate, args.seconds, args.max_requests, args.seed)
    return run_open(args.host, args.port, schedule, args.budget_ms, args.path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prazo.bench.loadgen", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/")
    parser.add_argument("--rate", type=float, default=100.0, help="open loop: mean arrivals per second")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of the schedule (closed: of the run)")
    parser.add_argument("--max-requests", type=int, default=100_000, help="open loop: at most this many arrivals")
    parser.add_argument("--budget-ms", type=float, default=1000.0, help="each client's budget; it gives up then")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--closed", type=int, default=0, metavar="N", help="closed loop with N clients instead")
    parser.add_argument("--nice", type=int, default=-10, help="scheduling priority to take when allowed (default -10)")
    return parser


def run_in_subprocess(
    argv: list[str], timeout_s: float, at: Sequence[tuple[float, Callable[[], object]]] = ()
) -> LoadResult:
    """Run the generator in its own process with ``argv`` (as on its command line) and read its result.

    Each ``(seconds, callback)`` of ``at`` is called that long after the
    generator started its schedule, in order (e.g. to read a server's
    counters when the measured window opens and when it closes).
    """
    command = [sys.executable, "-m", "prazo.bench.loadgen", *argv]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if at:
            assert process.stderr is not None
            process.stderr.readline()  # "started", or "" if it died first
            origin = time.monotonic()
            for seconds, callback in sorted(at, key=lambda pair: pair[0]):
                time.sleep(max(0.0, origin + seconds - time.monotonic()))
                callback()
        stdout, stderr = process.communicate(timeout=timeout_s)
    except BaseException:
        process.kill()
        process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"the load generator failed ({process.returncode}): {stderr.strip()[-2000:]}")
    return LoadResult.from_json(json.loads(stdout))


def _take_priority(niceness: int) -> int:
    """Run at ``niceness`` when allowed (root): the schedule must not wait for the server's CPU.

    With the kernel's autogroup scheduling (the default on desktop and many
    server kernels) a nice value only counts among the processes of one
    session, and each session gets an equal share of the CPUs: so the
    generator starts a session of its own and gives that session's group the
    niceness too.
    """
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    try:
        Path("/proc/self/autogroup").write_text(str(niceness))
    except OSError:
        pass  # no autogroup here, or not allowed
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    niceness = _take_priority(args.nice)
    # The records hold no cycles: a collection would only pause the schedule.
    gc.disable()
    print("started", file=sys.stderr, flush=True)
    result = run_load(args)
    result.niceness = niceness
    json.dump(result.to_json(), sys.stdout, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
