"""The load generator of ``prazo bench goodput`` and ``prazo demo slow-dependency``: open-loop Poisson arrivals from a process of its own.

::

    python -m prazo.bench.loadgen --port 8000 --rate 500 --seconds 4 [--budget-ms 1000] [--seed 1]
    python -m prazo.bench.loadgen --port 8000 --closed 8 --seconds 3 --budget-ms 10000
    python -m prazo.bench.loadgen --port 8000 --rate 100 --seconds 13 --budget-ms 5000 \
        --mix /product=0.3,/health=0.05 --keys 50 --path-budget /health=1000 --capture X-Stale-Age-S

prints one JSON object: per request ``[scheduled_ns, sent_ns, status,
reason, latency_ns, outcome, target, captured]`` (times relative to the
start of the schedule; ``target`` is the request's path and query,
``captured`` the value of the ``--capture`` response header or None), its
own CPU time and wall time.

Both load commands use it: ``prazo bench goodput`` (one path, one budget)
and ``prazo demo slow-dependency`` (``--mix``: each arrival asks for one of
several paths, weighted, as ``PATH?id=K`` with ``K`` uniform in
``[1, --keys]``; ``--path-budget``: a path's own budget, as a client with a
shorter timeout for it would send). ``LoadGenerator`` runs it in a process of
its own and lets the caller choose the schedule's time zero::

    generator = LoadGenerator(argv).start()   # spawned, imports done, waiting
    start_ns = generator.begin()              # time zero, time.monotonic_ns()
    result = generator.wait(timeout_s)        # a LoadResult

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
import heapq
import json
import os
import random
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

__all__ = [
    "OUTCOMES",
    "REFUSAL_STATUSES",
    "Arrival",
    "LoadGenerator",
    "LoadResult",
    "build_parser",
    "build_schedule",
    "mixed_schedule",
    "parse_head",
    "parse_response_head",
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
_START_SLACK_S = 0.2  # LoadGenerator.begin: time zero is this far ahead, for the word to reach the process


class Arrival(NamedTuple):
    """One request of an open-loop schedule: when (ns from time zero), what (path and query), with which budget."""

    offset_ns: int
    target: str
    budget_ms: float


def _poisson(rng: random.Random, rate: float, seconds: float, max_requests: int) -> Iterator[int]:
    if not rate > 0 or not seconds > 0:
        raise ValueError(f"rate and seconds must be > 0, got {rate!r}, {seconds!r}")
    t = 0.0
    for _ in range(max_requests):
        t += rng.expovariate(rate)
        if t >= seconds:
            return
        yield int(t * 1e9)


def poisson_schedule(rate: float, seconds: float, max_requests: int, seed: int) -> list[int]:
    """Send times in ns from the start: exponential gaps of mean ``1/rate``, within ``seconds``, at most ``max_requests``."""
    return list(_poisson(random.Random(seed), rate, seconds, max_requests))


def mixed_schedule(
    rate: float,
    seconds: float,
    max_requests: int,
    seed: int,
    mix: Mapping[str, float],
    keys: int,
    budget_ms: float,
    path_budget_ms: Mapping[str, float] | None = None,
) -> list[Arrival]:
    """Poisson arrivals, each for a path of ``mix`` (by weight) as ``PATH?id=K``, ``K`` uniform in ``[1, keys]``.

    A path's budget is ``path_budget_ms[path]``, else ``budget_ms``.
    """
    if not mix or keys < 1:
        raise ValueError(f"a mix needs paths and keys >= 1, got {dict(mix)!r}, {keys!r}")
    rng = random.Random(seed)
    paths = list(mix)
    weights = [mix[path] for path in paths]
    budgets = path_budget_ms or {}
    arrivals = []
    for offset_ns in _poisson(rng, rate, seconds, max_requests):
        path = rng.choices(paths, weights)[0]
        key = rng.randint(1, keys)
        arrivals.append(Arrival(offset_ns, f"{path}?id={key}", budgets.get(path, budget_ms)))
    return arrivals


def parse_response_head(buffer: bytes | bytearray) -> tuple[int, dict[str, str], int] | None:
    """``(status, headers by lower-case name, end of head)`` once the head is complete, else None.

    Raises ValueError for a head that is not HTTP/1.x.
    """
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers, end + 4


def parse_head(buffer: bytes | bytearray) -> tuple[int, str, int | None, int] | None:
    """``(status, X-Prazo-Reason, Content-Length or None, end of head)`` once the head is complete, else None.

    Raises ValueError for a head that is not HTTP/1.x.
    """
    head = parse_response_head(buffer)
    if head is None:
        return None
    status, headers, end = head
    length = headers.get("content-length", "")
    return status, headers.get("x-prazo-reason", ""), int(length) if length.isdigit() else None, end


@dataclass
class LoadResult:
    """What the generator measured: one record per request, and its own cost."""

    records: list[list[Any]] = field(
        default_factory=list
    )  # [scheduled_ns, sent_ns, status, reason, latency_ns, outcome, target, captured]
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
    __slots__ = (
        "buffer", "done", "give_up_ns", "head", "index", "out", "scheduled_ns", "sent_ns", "sock", "target"
    )  # fmt: skip

    def __init__(self, index: int, scheduled_ns: int, sent_ns: int, give_up_ns: int, target: str) -> None:
        self.index = index
        self.scheduled_ns = scheduled_ns
        self.sent_ns = sent_ns
        self.give_up_ns = give_up_ns
        self.target = target
        self.sock: socket.socket | None = None
        self.out = b""
        self.buffer = bytearray()
        self.head: tuple[int, dict[str, str], int] | None = None
        self.done = False


class _Engine:
    """The event loop shared by both modes: connections in flight, and the give-up clock."""

    def __init__(self, host: str, port: int, capture: str | None = None) -> None:
        self.address = (host, port)
        self.host_header = f"Host: {host}:{port}\r\n"
        self.capture = capture.lower() if capture else None
        self.selector = selectors.DefaultSelector()
        # Give-up times, earliest first (budgets may differ from one request to the next).
        self.in_flight: list[tuple[int, int, _Request]] = []
        self.open = 0
        self.result = LoadResult()
        self.origin_ns = 0
        self.on_done: Any = None

    def next_give_up_ns(self) -> int | None:
        return self.in_flight[0][0] if self.in_flight else None

    def send(self, index: int, scheduled_ns: int, target: str, budget_ms: float) -> None:
        sent_ns = time.monotonic_ns()
        request = _Request(index, scheduled_ns, sent_ns, sent_ns + int(budget_ms * 1e6), target)
        request.out = (
            f"GET {target} HTTP/1.1\r\n{self.host_header}X-Request-Budget-Ms: {budget_ms:g}\r\n"
            f"{GIVE_UP_HEADER}: {request.give_up_ns}\r\nConnection: close\r\n\r\n"
        ).encode("ascii")
        self.open += 1
        heapq.heappush(self.in_flight, (request.give_up_ns, index, request))
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:  # out of descriptors: this request fails, the schedule goes on
            self.finish(request, 0, f"socket: {errno.errorcode.get(exc.errno or 0, exc.errno)}", "error")
            return
        sock.setblocking(False)
        request.sock = sock
        code = sock.connect_ex(self.address)
        if code not in (0, errno.EINPROGRESS):
            self.finish(request, 0, f"connect: {errno.errorcode.get(code, code)}", "error")
            return
        self.selector.register(sock, selectors.EVENT_WRITE, request)

    def finish(self, request: _Request, status: int, reason: str, outcome: str, captured: str | None = None) -> None:
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
                request.target,
                captured,
            ]
        )
        if self.on_done is not None:
            self.on_done(now)

    def expire(self, now: int) -> None:
        while self.in_flight and (self.in_flight[0][2].done or self.in_flight[0][0] <= now):
            request = heapq.heappop(self.in_flight)[2]
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
                request.head = parse_response_head(request.buffer)
            except ValueError:
                self.finish(request, 0, "malformed answer", "error")
                return
        head = request.head
        if head is not None:
            status, headers, body_start = head
            declared = headers.get("content-length", "")
            length = int(declared) if declared.isdigit() else None
            complete = (length is not None and len(request.buffer) - body_start >= length) or (
                length is None and not data
            )
            if complete:
                outcome = "ok" if status == 200 else "refused" if status in REFUSAL_STATUSES else "status"
                captured = headers.get(self.capture) if self.capture else None
                self.finish(request, status, headers.get("x-prazo-reason", ""), outcome, captured)
                return
        if not data:
            self.finish(request, 0, "closed before a complete answer", "error")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _until(origin_ns: int | None) -> int:
    """Sleep until ``origin_ns`` (now when None); returns it."""
    if origin_ns is None:
        return time.monotonic_ns()
    time.sleep(max(0.0, (origin_ns - time.monotonic_ns()) / 1e9))
    return origin_ns


def run_open(
    host: str,
    port: int,
    schedule: Sequence[Arrival],
    capture: str | None = None,
    origin_ns: int | None = None,
) -> LoadResult:
    """Send each arrival of ``schedule`` at its time from ``origin_ns`` (default now), open loop; wait for every outcome.

    ``capture`` names a response header whose value each record keeps.
    """
    engine = _Engine(host, port, capture)
    origin = engine.origin_ns = _until(origin_ns)
    cpu0, wall0 = _cpu_s(), time.monotonic()
    following = 0
    while following < len(schedule) or engine.open:
        now = time.monotonic_ns()
        while following < len(schedule) and origin + schedule[following].offset_ns <= now:
            arrival = schedule[following]
            engine.send(following, origin + arrival.offset_ns, arrival.target, arrival.budget_ms)
            following += 1
            now = time.monotonic_ns()
        engine.expire(now)
        wake = [origin + schedule[following].offset_ns] if following < len(schedule) else []
        give_up = engine.next_give_up_ns()
        if give_up is not None:
            wake.append(give_up)
        timeout = max(0.0, (min(wake) - now) / 1e9) if wake else 0.05
        engine.poll(timeout)
    engine.result.wall_s = time.monotonic() - wall0
    engine.result.cpu_s = _cpu_s() - cpu0
    engine.result.schedule_s = (schedule[-1].offset_ns / 1e9) if schedule else 0.0
    return engine.result


def run_closed(
    host: str,
    port: int,
    clients: int,
    seconds: float,
    budget_ms: float,
    path: str = "/",
    origin_ns: int | None = None,
) -> LoadResult:
    """``clients`` closed-loop clients for ``seconds``: each sends its next request when its last one ended."""
    engine = _Engine(host, port)
    origin = engine.origin_ns = _until(origin_ns)
    cpu0, wall0 = _cpu_s(), time.monotonic()
    stop_ns = origin + int(seconds * 1e9)
    pending = [0]
    count = [0]

    def on_done(now: int) -> None:
        if now < stop_ns:
            pending[0] += 1

    engine.on_done = on_done
    for _ in range(clients):
        engine.send(count[0], time.monotonic_ns(), path, budget_ms)
        count[0] += 1
    while engine.open or pending[0]:
        while pending[0]:
            pending[0] -= 1
            engine.send(count[0], time.monotonic_ns(), path, budget_ms)
            count[0] += 1
        now = time.monotonic_ns()
        engine.expire(now)
        give_up = engine.next_give_up_ns()
        timeout = max(0.0, (give_up - now) / 1e9) if give_up is not None else 0.0
        engine.poll(min(timeout, 0.05))
    engine.result.wall_s = time.monotonic() - wall0
    engine.result.cpu_s = _cpu_s() - cpu0
    engine.result.schedule_s = seconds
    return engine.result


def build_schedule(args: argparse.Namespace) -> list[Arrival]:
    """The open-loop schedule the command-line ``args`` describe (the same for every run of the same ``args``)."""
    if args.mix:
        return mixed_schedule(
            args.rate, args.seconds, args.max_requests, args.seed, args.mix, args.keys, args.budget_ms,
            args.path_budget,
        )  # fmt: skip
    times = poisson_schedule(args.rate, args.seconds, args.max_requests, args.seed)
    return [Arrival(offset_ns, args.path, args.budget_ms) for offset_ns in times]


def run_load(args: argparse.Namespace, origin_ns: int | None = None) -> LoadResult:
    """A run as the command-line ``args`` say, from ``origin_ns`` (default now)."""
    if args.closed:
        return run_closed(args.host, args.port, args.closed, args.seconds, args.budget_ms, args.path, origin_ns)
    return run_open(args.host, args.port, build_schedule(args), args.capture, origin_ns)


def _weights(text: str) -> dict[str, float]:
    """``PATH=NUMBER,...`` as a dict (for ``--mix``)."""
    pairs: dict[str, float] = {}
    for item in text.split(","):
        path, sep, number = item.strip().rpartition("=")
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if not sep or not path.startswith("/") or not value >= 0:
            raise argparse.ArgumentTypeError(f"must be PATH=NUMBER,... with numbers >= 0, got {text!r}")
        pairs[path] = value
    return pairs


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
    parser.add_argument(
        "--mix", type=_weights, default=None, metavar="PATH=W,...", help="open loop: paths by weight, as PATH?id=K"
    )
    parser.add_argument("--keys", type=int, default=50, help="with --mix: K is uniform in [1, KEYS]")
    parser.add_argument(
        "--path-budget", type=_weights, default=None, metavar="PATH=MS,...", help="with --mix: a path's own budget"
    )
    parser.add_argument("--capture", default=None, metavar="HEADER", help="keep this response header's value")
    parser.add_argument(
        "--wait-for-start", action="store_true", help="after 'started', read time zero (monotonic ns) from stdin"
    )
    return parser


class LoadGenerator:
    """The generator in a process of its own, from the caller's side: ``start()``, ``begin()``, ``wait()``.

    ``argv`` is as on its command line. Between ``start`` (the process is
    up and waiting) and ``begin`` (the schedule's time zero) the caller can
    prepare whatever must line up with the schedule.
    """

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.start_ns = 0
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> Self:
        """Spawn the process and wait until it is ready to send."""
        command = [sys.executable, "-m", "prazo.bench.loadgen", *self.argv, "--wait-for-start"]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self._process.stderr is not None
        line = self._process.stderr.readline().strip()
        if line != "started":
            self.kill()
            raise RuntimeError(f"the load generator did not start (said {line!r})")
        return self

    def begin(self, slack_s: float = _START_SLACK_S) -> int:
        """Start the schedule ``slack_s`` from now; returns its time zero (``time.monotonic_ns()``)."""
        assert self._process is not None and self._process.stdin is not None
        self.start_ns = time.monotonic_ns() + int(slack_s * 1e9)
        try:
            self._process.stdin.write(f"{self.start_ns}\n")
            self._process.stdin.flush()  # wait() closes it
        except BrokenPipeError:
            pass  # it died: wait() says how
        return self.start_ns

    def wait(self, timeout_s: float) -> LoadResult:
        """Every request's record, once the last one was answered or given up on."""
        assert self._process is not None
        try:
            stdout, stderr = self._process.communicate(timeout=timeout_s)
        except BaseException:
            self.kill()
            raise
        if self._process.returncode != 0:
            raise RuntimeError(f"the load generator failed ({self._process.returncode}): {stderr.strip()[-2000:]}")
        return LoadResult.from_json(json.loads(stdout))

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def run_in_subprocess(
    argv: list[str],
    timeout_s: float,
    at: Sequence[tuple[float, Callable[[], object]]] = (),
    on_begin: Callable[[int], object] | None = None,
) -> LoadResult:
    """Run the generator in its own process with ``argv`` (as on its command line) and read its result.

    Each ``(seconds, callback)`` of ``at`` is called that long after the
    schedule's time zero, in order (e.g. to read a server's counters when
    the measured window opens and when it closes). ``on_begin(origin_ns)``
    is called as soon as time zero is set (it is ``_START_SLACK_S`` ahead),
    e.g. to schedule something on the same clock.
    """
    generator = LoadGenerator(argv).start()
    try:
        origin_ns = generator.begin()
        if on_begin is not None:
            on_begin(origin_ns)
        for seconds, callback in sorted(at, key=lambda pair: pair[0]):
            time.sleep(max(0.0, (origin_ns + int(seconds * 1e9) - time.monotonic_ns()) / 1e9))
            callback()
        return generator.wait(timeout_s)
    finally:
        generator.kill()


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
    origin_ns = int(sys.stdin.readline()) if args.wait_for_start else None
    result = run_load(args, origin_ns)
    result.niceness = niceness
    json.dump(result.to_json(), sys.stdout, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
