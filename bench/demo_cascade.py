"""``prazo demo``: the seed article's A → B cascade, on real HTTP servers on loopback.

Two setups run one after the other with the same load, and their tables are
printed side by side:

*prazo*
    B is a werkzeug threaded server behind ``AdmissionMiddleware`` (4 at once,
    20 waiting, 300 ms of work). A (and every extra hop of ``--chain``) reads
    the caller's budget from ``X-Request-Budget-Ms`` and calls the next hop
    through ``DeadlineSession`` with a 20 ms margin, so the budget shrinks as
    it travels and a hop with nothing left does not call at all. B's work
    uses the deadline it received: it does not start work it cannot finish
    in time, and checks the deadline while it works (``Deadline.check()``).

*naive* (the code the seed article starts from)
    A calls B with a fixed 2 s timeout and sends no budget; B has a plain
    bounded queue (503 when full) and no check when a request leaves it.

40 clients hit A at once, each with 2 s to get an answer. Like real clients,
one refused with 503 tries again after ``--retry-ms`` while its budget lasts
(the seed: "when the client retries, λ rises exactly when the queue is
already full of dead work"). For each setup the report shows the final
status each client saw, latency percentiles, how much of B's work started
after its caller's deadline, and B's *wasted work*: milliseconds of work
whose answer nobody used, because the caller had given up (or gave up
before it could arrive).

Everything runs in one process, so the monotonic clock is shared and each
request is followed from the client to B by an ``X-Demo-Id`` header.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prazo.bindings.headers import BUDGET_HEADER, format_budget_ms
from prazo.bindings.wsgi import DEADLINE_KEY, AdmissionMiddleware
from prazo.core import NS_PER_MS, Deadline, DeadlineExceeded

__all__ = ["CascadeParams", "CascadeResult", "LoopbackServers", "render_comparison", "run_cascade"]

DEMO_ID_HEADER = "X-Demo-Id"
_DEMO_ID_ENVIRON_KEY = "HTTP_X_DEMO_ID"
# B's work is a loop of short steps so a deadline-aware B can stop between them.
_WORK_STEP_MS = 10
# Upper bound on how long B may still be busy after the last client gave up
# (the naive B keeps working through its queue); the demo waits for it so the
# wasted work is counted, and gives up past this.
_DRAIN_LIMIT_S = 30.0
# Hops in front of B forward with this much room; they never limit the demo.
_HOP_CONCURRENCY = 256


@dataclass(frozen=True)
class CascadeParams:
    """The scenario; defaults are the seed article's numbers."""

    clients: int = 40
    budget_ms: float = 2000
    concurrency: int = 4
    queue: int = 20
    work_ms: float = 300
    margin_ms: float = 20
    chain: int = 1
    retry_ms: float = 100

    def __post_init__(self) -> None:
        for name in ("clients", "concurrency", "chain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.queue, bool) or not isinstance(self.queue, int) or self.queue < 0:
            raise ValueError(f"queue must be an int >= 0, got {self.queue!r}")
        for name in ("budget_ms", "work_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("margin_ms", "retry_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.clients > 1000:
            raise ValueError("clients must be <= 1000 (one thread per client)")


@dataclass
class WorkRecord:
    """One execution of B's work for one client attempt."""

    request_id: str
    start_ns: int
    # B's own deadline as B saw it (None when B had none): relative budgets
    # lose the transit time of each hop, so this, not the client's give-up
    # time, is what B can promise to respect.
    deadline_ns: int | None = None
    end_ns: int = 0
    finished: bool = False


@dataclass
class _Attempt:
    """One HTTP attempt by a client."""

    request_id: str
    client: int
    sent_ns: int
    status: int = 0
    answered_ns: int = 0


@dataclass
class CascadeResult:
    """What one setup observed: every client attempt and every piece of B's work."""

    setup: str
    params: CascadeParams
    start_ns: int
    attempts: list[_Attempt]
    work: list[WorkRecord]
    give_up_ns: dict[int, int]
    final_status: dict[int, int]
    b_statuses: Counter[int] = field(default_factory=Counter)

    def _client_of(self, request_id: str) -> int:
        return int(request_id.split("-", 1)[0])

    @property
    def status_counts(self) -> Counter[int]:
        return Counter(self.final_status.values())

    def started_after_deadline(self) -> int:
        """B's work that started at or after its client's deadline."""
        return sum(1 for w in self.work if w.start_ns >= self.give_up_ns[self._client_of(w.request_id)])

    def started_after_own_deadline(self) -> int:
        """B's work that started at or after B's own deadline (what admission promises to prevent)."""
        return sum(1 for w in self.work if w.deadline_ns is not None and w.start_ns >= w.deadline_ns)

    def wasted_work_ms(self) -> float:
        """B's work whose answer nobody used (the client had given up or got no 200 from it)."""
        useful = {a.request_id for a in self.attempts if a.status == 200}
        wasted_ns = sum(w.end_ns - w.start_ns for w in self.work if w.request_id not in useful)
        return wasted_ns / NS_PER_MS

    def late_answers(self) -> int:
        """B answers that completed after the client had already given up."""
        return sum(1 for w in self.work if w.finished and w.end_ns > self.give_up_ns[self._client_of(w.request_id)])

    def latency_ms(self, status: int) -> list[float]:
        """Per client: time from its first attempt to its final answer, for one final status."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for a in self.attempts:
            first[a.client] = min(first.get(a.client, a.sent_ns), a.sent_ns)
            last[a.client] = max(last.get(a.client, 0), a.answered_ns)
        return sorted((last[c] - first[c]) / NS_PER_MS for c, s in self.final_status.items() if s == status)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class _Recorder:
    """Thread-safe log of B's work and of the statuses B answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.work: list[WorkRecord] = []
        self.b_statuses: Counter[int] = Counter()

    def begin(self, request_id: str, deadline: Deadline | None) -> WorkRecord:
        work = WorkRecord(request_id, time.monotonic_ns(), None if deadline is None else deadline.ns)
        with self._lock:
            self.work.append(work)
        return work

    def b_status(self, status: int) -> None:
        with self._lock:
            self.b_statuses[status] += 1


def _b_app(recorder: _Recorder, work_ms: float, deadline_aware: bool) -> Callable[..., Iterable[bytes]]:
    """B's application: ``work_ms`` of work in short steps."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        deadline: Deadline | None = environ.get(DEADLINE_KEY)
        if deadline_aware and deadline is not None and deadline.remaining_ms() < work_ms:
            # Not enough budget left to finish: starting would only make dead work.
            raise DeadlineExceeded("not-enough-budget")
        work = recorder.begin(environ.get(_DEMO_ID_ENVIRON_KEY, "?"), deadline)
        try:
            end = time.monotonic() + work_ms / 1000
            while (left := end - time.monotonic()) > 0:
                if deadline_aware and deadline is not None:
                    deadline.check()
                time.sleep(min(left, _WORK_STEP_MS / 1000))
            work.finished = True
        finally:
            work.end_ns = time.monotonic_ns()
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    return app


def _observing(app: Callable[..., Iterable[bytes]], recorder: _Recorder) -> Callable[..., Iterable[bytes]]:
    """Record the status B answers, whoever produced it (the app or admission)."""

    def observed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        def recording_start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            recorder.b_status(int(status.split(" ", 1)[0]))
            return start_response(status, headers, exc_info)

        return app(environ, recording_start_response)

    return observed


class _NaiveQueue:
    """The seed's starting point: bounded concurrency and a bounded queue, no deadlines."""

    def __init__(self, app: Callable[..., Iterable[bytes]], concurrency: int, queue: int) -> None:
        self._app = app
        self._slots = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._inside = 0
        self._capacity = concurrency + queue

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with self._lock:
            if self._inside >= self._capacity:
                start_response("503 Service Unavailable", [("Content-Length", "10")])
                return [b"queue full"]
            self._inside += 1
        try:
            with self._slots:
                return list(self._app(environ, start_response))
        finally:
            with self._lock:
                self._inside -= 1


def _forwarder(next_url: str, params: CascadeParams, propagate: bool) -> Callable[..., Iterable[bytes]]:
    """A hop that calls the next one: with the budget (prazo) or a fixed timeout (naive)."""
    import requests
    from prazo.bindings.clients.requests import DeadlineSession

    local = threading.local()

    def session() -> Any:
        if not hasattr(local, "session"):
            local.session = DeadlineSession(margin_ms=params.margin_ms) if propagate else requests.Session()
        return local.session

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        headers = {DEMO_ID_HEADER: environ.get(_DEMO_ID_ENVIRON_KEY, "?")}
        if propagate:
            # DeadlineSession adds the remaining budget, caps the timeout and
            # raises DownstreamOverloaded (503) / DeadlineExceeded (504).
            response = session().get(next_url, headers=headers)
        else:
            try:
                response = session().get(next_url, headers=headers, timeout=params.budget_ms / 1000)
            except requests.Timeout:
                start_response("504 Gateway Timeout", [("Content-Length", "7")])
                return [b"timeout"]
        start_response(f"{response.status_code} {response.reason}", [("Content-Length", str(len(response.content)))])
        return [response.content]

    return app


class LoopbackServers:
    """Start WSGI apps on loopback in threads and stop them all afterwards."""

    def __init__(self) -> None:
        self._servers: list[Any] = []
        self._threads: list[threading.Thread] = []

    def start(self, app: Callable[..., Iterable[bytes]]) -> str:
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                """The demo prints its own report; one log line per request would drown it."""

        server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietHandler)
        # A 50 ms poll (the default is 0.5 s): stop() waits out one poll per server.
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="prazo-demo-server", daemon=True
        )
        thread.start()
        self._servers.append(server)
        self._threads.append(thread)
        return f"http://127.0.0.1:{server.server_port}/"

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)


def _client(
    index: int,
    url: str,
    params: CascadeParams,
    barrier: threading.Barrier,
    attempts: list[_Attempt],
    lock: threading.Lock,
) -> tuple[int, int]:
    """One impatient client: ``budget_ms`` to get an answer, retrying 503s. Returns (final status, give-up ns)."""
    import requests

    barrier.wait()
    give_up = Deadline.after_ms(params.budget_ms)
    status = 504
    with requests.Session() as session:
        attempt_no = 0
        while (remaining_ms := give_up.remaining_ms()) > 0:
            attempt = _Attempt(f"{index}-{attempt_no}", index, time.monotonic_ns())
            attempt_no += 1
            try:
                response = session.get(
                    url,
                    headers={BUDGET_HEADER: format_budget_ms(remaining_ms), DEMO_ID_HEADER: attempt.request_id},
                    timeout=remaining_ms / 1000,
                )
                status = response.status_code
            except requests.RequestException:
                status = 504  # the client's own timeout: it gives up
            attempt.status = status
            attempt.answered_ns = time.monotonic_ns()
            with lock:
                attempts.append(attempt)
            if status != 503:
                break
            time.sleep(max(0.0, min(params.retry_ms / 1000, give_up.remaining())))
    return status, give_up.ns


def run_cascade(params: CascadeParams, *, setup: str) -> CascadeResult:
    """Run one setup (``"prazo"`` or ``"naive"``) end to end and return what it observed."""
    if setup not in ("prazo", "naive"):
        raise ValueError(f"setup must be 'prazo' or 'naive', got {setup!r}")
    propagate = setup == "prazo"
    recorder = _Recorder()
    servers = LoopbackServers()
    try:
        b_app = _b_app(recorder, params.work_ms, deadline_aware=propagate)
        b: Callable[..., Iterable[bytes]]
        if propagate:
            b = AdmissionMiddleware(
                b_app,
                max_concurrency=params.concurrency,
                max_queue=params.queue,
                max_budget_ms=params.budget_ms,
                default_budget_ms=params.budget_ms,
            )
        else:
            b = _NaiveQueue(b_app, params.concurrency, params.queue)
        url = servers.start(_observing(b, recorder))
        for _ in range(params.chain):
            hop = _forwarder(url, params, propagate)
            if propagate:
                hop = AdmissionMiddleware(
                    hop, max_concurrency=_HOP_CONCURRENCY, max_queue=0, max_budget_ms=params.budget_ms
                )
            url = servers.start(hop)
        attempts: list[_Attempt] = []
        lock = threading.Lock()
        outcomes: dict[int, tuple[int, int]] = {}
        barrier = threading.Barrier(params.clients + 1)

        def run_client(index: int) -> None:
            outcomes[index] = _client(index, url, params, barrier, attempts, lock)

        threads = [threading.Thread(target=run_client, args=(i,), daemon=True) for i in range(params.clients)]
        for thread in threads:
            thread.start()
        barrier.wait()
        start_ns = time.monotonic_ns()
        for thread in threads:
            thread.join(timeout=params.budget_ms / 1000 + _DRAIN_LIMIT_S)
        _wait_for_b_to_drain(recorder)
    finally:
        servers.stop()
    return CascadeResult(
        setup=setup,
        params=params,
        start_ns=start_ns,
        attempts=sorted(attempts, key=lambda a: a.sent_ns),
        work=list(recorder.work),
        give_up_ns={i: give_up for i, (_, give_up) in outcomes.items()},
        final_status={i: status for i, (status, _) in outcomes.items()},
        b_statuses=recorder.b_statuses,
    )


def _wait_for_b_to_drain(recorder: _Recorder) -> None:
    """B may still be working for clients that left; wait so its waste is counted."""
    limit = time.monotonic() + _DRAIN_LIMIT_S
    while time.monotonic() < limit:
        if all(w.end_ns for w in recorder.work):
            time.sleep(0.05)
            if all(w.end_ns for w in recorder.work):
                return
        time.sleep(0.05)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _rows(result: CascadeResult) -> list[tuple[str, str]]:
    counts = result.status_counts
    ok = result.latency_ms(200)
    every = sorted(lat for status in counts for lat in result.latency_ms(status))
    return [
        ("clients answered 200", str(counts.get(200, 0))),
        ("clients answered 503", str(counts.get(503, 0))),
        ("clients answered 504 / gave up", str(counts.get(504, 0))),
        ("HTTP attempts (with retries)", str(len(result.attempts))),
        ("B: work started", str(len(result.work))),
        ("B: work started after deadline", str(result.started_after_deadline())),
        ("B: answers after caller gave up", str(result.late_answers())),
        ("B: wasted work (ms)", _fmt(result.wasted_work_ms())),
        ("B: answered 503 / 504", f"{result.b_statuses.get(503, 0)} / {result.b_statuses.get(504, 0)}"),
        ("latency p50 / p99, 200s (ms)", f"{_fmt(_percentile(ok, 50))} / {_fmt(_percentile(ok, 99))}"),
        ("latency p50 / p99, all (ms)", f"{_fmt(_percentile(every, 50))} / {_fmt(_percentile(every, 99))}"),
    ]


def _timeline(result: CascadeResult, bucket_ms: int = 250) -> list[str]:
    """Per time bucket: what the clients got back, and how much work B started."""
    buckets: dict[int, Counter[str]] = {}
    for a in result.attempts:
        at = (a.answered_ns - result.start_ns) // NS_PER_MS // bucket_ms
        buckets.setdefault(at, Counter())[f"{a.status}"] += 1
    for w in result.work:
        at = (w.start_ns - result.start_ns) // NS_PER_MS // bucket_ms
        buckets.setdefault(at, Counter())["B-start"] += 1
    lines = []
    for at in sorted(buckets):
        c = buckets[at]
        lines.append(
            f"  {at * bucket_ms:>5}–{(at + 1) * bucket_ms:<5} ms  "
            f"200:{c.get('200', 0):>3}  503:{c.get('503', 0):>3}  504:{c.get('504', 0):>3}   "
            f"B started:{c.get('B-start', 0):>3}"
        )
    return lines


def render_comparison(prazo: CascadeResult, naive: CascadeResult) -> str:
    """The two setups' tables side by side, with each one's timeline."""
    p = prazo.params
    hops = " → ".join(["client"] + [f"A{i + 1}" if p.chain > 1 else "A" for i in range(p.chain)] + ["B"])
    out = [
        f"prazo demo — the seed cascade on real HTTP ({hops})",
        f"  {p.clients} clients at once, {p.budget_ms:g} ms budget each, retry 503 after {p.retry_ms:g} ms;",
        f"  B: {p.concurrency} at once, queue {p.queue}, {p.work_ms:g} ms of work; margin per hop {p.margin_ms:g} ms",
        "",
    ]
    for result in (prazo, naive):
        label = "prazo (budget propagated, deadline-checked queue)" if result is prazo else "naive (fixed 2 s timeout)"
        out.append(f"timeline — {label}")
        out.extend(_timeline(result))
        out.append("")
    width = max(len(name) for name, _ in _rows(prazo))
    out.append(f"{'':<{width}}  {'prazo':>12}  {'naive':>12}")
    for (name, value_p), (_, value_n) in zip(_rows(prazo), _rows(naive)):
        out.append(f"{name:<{width}}  {value_p:>12}  {value_n:>12}")
    return "\n".join(out)
