"""``prazo demo retries``: the retry amplification experiment, naive retries against a retry budget.

A chain client → A → B on real HTTP servers on loopback. B is the seed's
overloaded service: ``AdmissionMiddleware`` with 4 at once, 20 waiting,
300 ms of work that checks its deadline (and is not started with less
budget than that left, as the seed's deadline-aware B); it answers 503 ``queue-full``
(with ``Retry-After: 1``) when its line is full. Clients send requests to A
open-loop, at a fixed rate faster than B can serve (``rate_per_s``), each
with ``budget_ms`` to get an answer; they never retry themselves. A calls B,
and retries, in one of two ways, one setup after the other with the same
schedule and the same B:

*naive*
    a stock ``requests.Session`` with urllib3's ``Retry(total=2,
    status_forcelist=(503, 504))``: 3 attempts, a fixed 2 s timeout, and
    ``Retry-After`` honoured as urllib3 does, whatever the caller has left;
*prazo*
    ``DeadlineSession(retry=RetryPolicy(max_attempts=3,
    budget=RetryBudget(percent=0.1, min_per_s=0)))``: 3 attempts at most,
    within the caller's remaining budget, and never more retries than 10 %
    of the calls.

Measured at B, per time bucket: its offered load (arrivals at B over
client requests sent in the same bucket), its wasted work (ms of work whose
answer no client used); at the clients: goodput (200s within the deadline
per second). Also counted from B's log: retries that arrived after the
client's deadline, and retries of a request B had answered 504.

The *light faults* run checks the other side: B not overloaded
(``light_rate_per_s``), 5 % of its answers a random 503, clients through
prazo's ``RetryPolicy``: nearly every request must succeed.

*Callers that throttle themselves*: two more runs at ``throttle_rate_per_s``
(3× B's capacity), both with prazo's ``RetryPolicy``, the second with
``throttle=AdaptiveThrottles(k=throttle_k)`` at A: the arrivals reaching B
per second, as a multiple of B's capacity, with and without the throttle, and
the clients' goodput in each (B's answers that reached a client in time).

``run_experiment(params)`` returns the data, ``render_report`` the tables,
``plot_experiment`` draws it (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prazo.bench.demo_cascade import DEMO_ID_HEADER, LoopbackServers
from prazo.bindings.headers import BUDGET_HEADER, format_budget_ms
from prazo.bindings.retries import AdaptiveThrottles, RetryBudget, RetryPolicy
from prazo.bindings.wsgi import DEADLINE_KEY, AdmissionMiddleware
from prazo.core import NS_PER_MS, NS_PER_SECOND, Deadline, DeadlineExceeded

__all__ = [
    "QUICK_PARAMS",
    "RetryExperimentParams",
    "RetryExperimentResult",
    "SetupRun",
    "plot_experiment",
    "render_report",
    "run_experiment",
]

_DEMO_ID_ENVIRON_KEY = "HTTP_X_DEMO_ID"
_WORK_STEP_MS = 10
_BUCKET_S = 1.0
_HOP_CONCURRENCY = 512
_DRAIN_LIMIT_S = 30.0


@dataclass(frozen=True)
class RetryExperimentParams:
    """The scenario: the seed's B, clients three times faster than B can serve."""

    rate_per_s: float = 60.0
    duration_s: float = 10.0
    budget_ms: float = 2000.0
    concurrency: int = 4
    queue: int = 20
    work_ms: float = 300.0
    attempts: int = 3
    percent: float = 0.1
    min_per_s: float = 0.0
    naive_timeout_s: float = 2.0
    light_rate_per_s: float = 8.0
    light_duration_s: float = 25.0
    light_fault_rate: float = 0.05
    # 3x B's capacity (4 places x 1000/300 ms = 13.3/s).
    throttle_rate_per_s: float = 40.0
    throttle_k: float = 2.0
    seed: int = 24

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "duration_s", "budget_ms", "work_ms", "light_rate_per_s", "light_duration_s",
                     "throttle_rate_per_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.light_fault_rate <= 1.0:
            raise ValueError(f"light_fault_rate must be between 0 and 1, got {self.light_fault_rate!r}")


QUICK_PARAMS = RetryExperimentParams(duration_s=4.0, light_duration_s=8.0)


@dataclass
class _Arrival:
    """One request arriving at B (an attempt of A's call), as B saw it."""

    request_id: str
    arrived_ns: int
    attempt: int
    status: int = 0
    work_start_ns: int = 0
    work_end_ns: int = 0


@dataclass
class _ClientRequest:
    request_id: str
    sent_ns: int
    deadline_ns: int
    status: int = 0
    answered_ns: int = 0


@dataclass
class SetupRun:
    """What one setup observed: every client request and every arrival at B."""

    setup: str
    start_ns: int
    duration_s: float
    requests: list[_ClientRequest]
    arrivals: list[_Arrival]
    notes: dict[str, Any] = field(default_factory=dict)

    def _deadline_of(self) -> dict[str, int]:
        return {r.request_id: r.deadline_ns for r in self.requests}

    def good(self) -> list[_ClientRequest]:
        return [r for r in self.requests if r.status == 200 and r.answered_ns <= r.deadline_ns]

    def offered_multiple(self) -> float:
        return len(self.arrivals) / max(1, len(self.requests))

    def arrivals_per_s(self) -> float:
        """Attempts that reached B per second of the run (what B had to read, refuse or serve)."""
        return len(self.arrivals) / self.duration_s

    def goodput_per_s(self) -> float:
        return len(self.good()) / self.duration_s

    def success_share(self) -> float:
        return len(self.good()) / max(1, len(self.requests))

    def wasted_work_ms(self) -> float:
        """B's work whose answer no client used: its client got no 200 in time from it."""
        useful = {r.request_id for r in self.good()}
        wasted_ns = 0
        for arrival in self.arrivals:
            if not arrival.work_start_ns:
                continue
            if arrival.request_id not in useful or arrival.status != 200:
                wasted_ns += arrival.work_end_ns - arrival.work_start_ns
        return wasted_ns / NS_PER_MS

    def useful_work_ms(self) -> float:
        return sum(a.work_end_ns - a.work_start_ns for a in self.arrivals if a.work_start_ns) / NS_PER_MS - (
            self.wasted_work_ms()
        )

    def retries_after_deadline(self) -> int:
        deadline = self._deadline_of()
        return sum(1 for a in self.arrivals if a.attempt > 1 and a.arrived_ns >= deadline.get(a.request_id, 0))

    def retries_of_a_504(self) -> int:
        seen_504: dict[str, int] = {}
        retried = 0
        for arrival in sorted(self.arrivals, key=lambda a: a.arrived_ns):
            if arrival.request_id in seen_504 and arrival.arrived_ns > seen_504[arrival.request_id]:
                retried += 1
            if arrival.status == 504:
                seen_504.setdefault(arrival.request_id, arrival.work_end_ns or arrival.arrived_ns)
        return retried

    def buckets(self) -> list[dict[str, float]]:
        """Per second: client requests sent, arrivals at B, their ratio, B's wasted work, goodput."""
        count = max(1, int(self.duration_s / _BUCKET_S + 0.5))
        sent = [0] * count
        arrived = [0] * count
        good = [0] * count
        wasted = [0.0] * count
        useful = {r.request_id for r in self.good()}

        def index(ns: int) -> int | None:
            at = int((ns - self.start_ns) / NS_PER_SECOND / _BUCKET_S)
            return at if 0 <= at < count else None

        for request in self.requests:
            i = index(request.sent_ns)
            if i is not None:
                sent[i] += 1
                good[i] += request.status == 200 and request.answered_ns <= request.deadline_ns
        for arrival in self.arrivals:
            i = index(arrival.arrived_ns)
            if i is None:
                continue
            arrived[i] += 1
            if arrival.work_start_ns and (arrival.request_id not in useful or arrival.status != 200):
                wasted[i] += (arrival.work_end_ns - arrival.work_start_ns) / NS_PER_MS
        return [
            {
                "t_s": i * _BUCKET_S,
                "sent": sent[i],
                "arrivals_at_b": arrived[i],
                "offered_multiple": arrived[i] / sent[i] if sent[i] else 0.0,
                "wasted_work_ms": wasted[i],
                "goodput_per_s": good[i] / _BUCKET_S,
            }
            for i in range(count)
        ]


@dataclass
class RetryExperimentResult:
    params: RetryExperimentParams
    naive: SetupRun
    prazo: SetupRun
    light: SetupRun
    # At 3x B's capacity: the budget alone, then the budget and the adaptive throttle.
    unthrottled: SetupRun
    throttled: SetupRun

    @property
    def capacity_per_s(self) -> float:
        return self.params.concurrency * 1000 / self.params.work_ms

    def to_json(self) -> dict[str, Any]:
        def summary(run: SetupRun) -> dict[str, Any]:
            return {
                "client_requests": len(run.requests),
                "arrivals_at_b": len(run.arrivals),
                "offered_multiple": run.offered_multiple(),
                "goodput_per_s": run.goodput_per_s(),
                "success_share": run.success_share(),
                "wasted_work_ms": run.wasted_work_ms(),
                "retries_after_deadline": run.retries_after_deadline(),
                "retries_of_a_504": run.retries_of_a_504(),
                "statuses": dict(Counter(r.status for r in run.requests)),
                "buckets": run.buckets(),
                **run.notes,
            }

        runs = (self.naive, self.prazo, self.light, self.unthrottled, self.throttled)
        return {
            "params": vars(self.params),
            "capacity_per_s": self.capacity_per_s,
            **{run.setup: {**summary(run), "arrivals_per_s": run.arrivals_per_s()} for run in runs},
        }


class _BLog:
    """B's arrivals, under a lock; the attempt number is the count of arrivals per request id so far."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrivals: list[_Arrival] = []
        self._per_id: Counter[str] = Counter()

    def arrive(self, request_id: str) -> _Arrival:
        with self.lock:
            self._per_id[request_id] += 1
            arrival = _Arrival(request_id, time.monotonic_ns(), self._per_id[request_id])
            self.arrivals.append(arrival)
        return arrival


def _b_app(work_ms: float, fault_rate: float, rng: random.Random, rng_lock: threading.Lock) -> Any:
    """B's work: ``work_ms`` in short steps, checking its deadline; ``fault_rate`` of answers a plain 503."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        arrival: _Arrival = environ["prazo.demo.arrival"]
        if fault_rate:
            with rng_lock:
                fault = rng.random() < fault_rate
            if fault:
                start_response("503 Service Unavailable", [("Content-Length", "5")])
                return [b"fault"]
        deadline: Deadline | None = environ.get(DEADLINE_KEY)
        if deadline is not None and deadline.remaining_ms() < work_ms:
            # Not enough budget left to finish: starting would only make dead work.
            raise DeadlineExceeded("not-enough-budget")
        arrival.work_start_ns = time.monotonic_ns()
        try:
            end = time.monotonic() + work_ms / 1000
            while (left := end - time.monotonic()) > 0:
                if deadline is not None:
                    deadline.check()
                time.sleep(min(left, _WORK_STEP_MS / 1000))
        finally:
            arrival.work_end_ns = time.monotonic_ns()
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    return app


def _logged(app: Any, log: _BLog) -> Any:
    """Log every arrival at B and the status it got, whoever answered (admission or the app)."""

    def logged(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        arrival = log.arrive(environ.get(_DEMO_ID_ENVIRON_KEY, "?"))
        environ["prazo.demo.arrival"] = arrival

        def recording(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            arrival.status = int(status.split(" ", 1)[0])
            return start_response(status, headers, exc_info)

        answer: Iterable[bytes] = app(environ, recording)
        return answer

    return logged


def _a_app(b_url: str, setup: str, params: RetryExperimentParams, policy: RetryPolicy | None) -> Any:
    """A: forwards each request to B, retrying the naive way or prazo's."""
    import requests
    from prazo.bindings.clients.requests import DeadlineSession
    from prazo.core import DownstreamOverloaded
    from requests.adapters import HTTPAdapter
    from urllib3.util import Retry

    local = threading.local()

    def session() -> Any:
        if not hasattr(local, "session"):
            if setup == "naive":
                stock = requests.Session()
                retry = Retry(total=params.attempts - 1, status_forcelist=(503, 504), backoff_factor=0.05)
                stock.mount("http://", HTTPAdapter(max_retries=retry))
                local.session = stock
            else:
                local.session = DeadlineSession(retry=policy)
        return local.session

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        headers = {DEMO_ID_HEADER: environ.get(_DEMO_ID_ENVIRON_KEY, "?")}
        try:
            if setup == "naive":
                response = session().get(b_url, headers=headers, timeout=params.naive_timeout_s)
            else:
                response = session().get(b_url, headers=headers)
            status = response.status_code
        except DownstreamOverloaded:
            status = 503
        except DeadlineExceeded:
            status = 504
        except requests.exceptions.RetryError:
            status = 503
        except requests.RequestException:
            status = 504
        reason = {200: "OK", 503: "Service Unavailable", 504: "Gateway Timeout"}.get(status, "Error")
        start_response(f"{status} {reason}", [("Content-Length", "0")])
        return [b""]

    return app


def _run_setup(
    setup: str, params: RetryExperimentParams, rate_per_s: float, duration_s: float, fault_rate: float
) -> SetupRun:
    import requests

    log = _BLog()
    rng = random.Random(params.seed)
    rng_lock = threading.Lock()
    b = AdmissionMiddleware(
        _b_app(params.work_ms, fault_rate, rng, rng_lock),
        max_concurrency=params.concurrency,
        max_queue=params.queue,
        max_budget_ms=params.budget_ms,
        default_budget_ms=params.budget_ms,
    )
    policy: RetryPolicy | None = None
    if setup != "naive":
        throttle = AdaptiveThrottles(k=params.throttle_k, rng=random.Random(params.seed))
        policy = RetryPolicy(
            max_attempts=params.attempts,
            budget=RetryBudget(percent=params.percent, min_per_s=params.min_per_s),
            rng=random.Random(params.seed),
            throttle=throttle if setup == "throttled" else None,
        )
    servers = LoopbackServers()
    requests_sent: list[_ClientRequest] = []
    lock = threading.Lock()
    local = threading.local()
    try:
        b_url = servers.start(_logged(b, log))
        a: Any = _a_app(b_url, setup, params, policy)
        if setup != "naive":
            a = AdmissionMiddleware(a, max_concurrency=_HOP_CONCURRENCY, max_queue=0, max_budget_ms=params.budget_ms)
        a_url = servers.start(a)

        def client(request: _ClientRequest) -> None:
            if not hasattr(local, "session"):
                local.session = requests.Session()
            remaining_ms = (request.deadline_ns - time.monotonic_ns()) / NS_PER_MS
            try:
                response = local.session.get(
                    a_url,
                    headers={
                        BUDGET_HEADER: format_budget_ms(max(remaining_ms, 1.0)),
                        DEMO_ID_HEADER: request.request_id,
                    },
                    timeout=max(remaining_ms, 1.0) / 1000,
                )
                request.status = response.status_code
            except requests.RequestException:
                request.status = 0  # the client gave up
            request.answered_ns = time.monotonic_ns()

        interval_ns = round(NS_PER_SECOND / rate_per_s)
        total = int(rate_per_s * duration_s)
        start_ns = time.monotonic_ns() + 50 * NS_PER_MS
        with ThreadPoolExecutor(max_workers=min(512, int(rate_per_s * params.budget_ms / 1000 * 2) + 8)) as pool:
            for index in range(total):
                due = start_ns + index * interval_ns
                pause = (due - time.monotonic_ns()) / NS_PER_SECOND
                if pause > 0:
                    time.sleep(pause)
                sent = time.monotonic_ns()
                request = _ClientRequest(f"{setup}-{index}", sent, sent + round(params.budget_ms * NS_PER_MS))
                with lock:
                    requests_sent.append(request)
                pool.submit(client, request)
        _drain(log)
    finally:
        servers.stop()
    notes: dict[str, Any] = {} if policy is None else {"policy": policy.stats()}
    return SetupRun(setup, start_ns, duration_s, requests_sent, list(log.arrivals), notes)


def _drain(log: _BLog) -> None:
    """Wait until B has finished every piece of work it started, so the waste is counted."""
    limit = time.monotonic() + _DRAIN_LIMIT_S
    while time.monotonic() < limit:
        with log.lock:
            busy = any(a.work_start_ns and not a.work_end_ns for a in log.arrivals)
        if not busy:
            return
        time.sleep(0.05)


def run_experiment(params: RetryExperimentParams | None = None) -> RetryExperimentResult:
    """Run naive, prazo (both overloaded), the light-faults run, and 3x without and with the throttle."""
    params = RetryExperimentParams() if params is None else params
    naive = _run_setup("naive", params, params.rate_per_s, params.duration_s, 0.0)
    prazo = _run_setup("prazo", params, params.rate_per_s, params.duration_s, 0.0)
    light = _run_setup("light", params, params.light_rate_per_s, params.light_duration_s, params.light_fault_rate)
    unthrottled = _run_setup("unthrottled", params, params.throttle_rate_per_s, params.duration_s, 0.0)
    throttled = _run_setup("throttled", params, params.throttle_rate_per_s, params.duration_s, 0.0)
    return RetryExperimentResult(params, naive, prazo, light, unthrottled, throttled)


def render_report(result: RetryExperimentResult) -> str:
    """The experiment's table: per setup, offered load at B, goodput, wasted work, and the safety counts."""
    p = result.params
    lines = [
        "prazo demo retries — retry amplification at an overloaded B (client → A → B on real HTTP)",
        f"  clients: {p.rate_per_s:g} requests/s for {p.duration_s:g} s, {p.budget_ms:g} ms budget each, no client retries;",
        f"  B: {p.concurrency} at once, queue {p.queue}, {p.work_ms:g} ms of work (capacity "
        f"{p.concurrency * 1000 / p.work_ms:.1f}/s); A retries B with {p.attempts} attempts:",
        f"  naive = urllib3 Retry(total={p.attempts - 1}, status_forcelist=(503, 504)), {p.naive_timeout_s:g} s timeout;",
        f"  prazo = RetryPolicy(max_attempts={p.attempts}, budget=RetryBudget(percent={p.percent:g}, "
        f"min_per_s={p.min_per_s:g}))",
        "",
    ]
    runs = (result.naive, result.prazo)
    rows: list[tuple[str, Callable[[SetupRun], str]]] = [
        ("client requests", lambda r: str(len(r.requests))),
        ("arrivals at B", lambda r: str(len(r.arrivals))),
        ("offered load at B (× client requests)", lambda r: f"{r.offered_multiple():.2f}"),
        ("client goodput (200 in time, /s)", lambda r: f"{r.goodput_per_s():.1f}"),
        ("clients answered 200 in time", lambda r: f"{100 * r.success_share():.1f} %"),
        ("B: wasted work (ms)", lambda r: f"{r.wasted_work_ms():.0f}"),
        ("B: useful work (ms)", lambda r: f"{r.useful_work_ms():.0f}"),
        ("retries arriving after the deadline", lambda r: str(r.retries_after_deadline())),
        ("retries of a request B answered 504", lambda r: str(r.retries_of_a_504())),
    ]
    width = max(len(name) for name, _ in rows)
    lines.append(f"| {'':<{width}} | {'naive':>8} | {'prazo':>8} |")
    lines.append(f"| {'-' * width} | {'-' * 8}:| {'-' * 8}:|")
    for name, value in rows:
        lines.append(f"| {name:<{width}} | {value(runs[0]):>8} | {value(runs[1]):>8} |")
    lines.append("")
    lines.append("offered load at B over time (× client requests sent in the same second):")
    for naive_bucket, prazo_bucket in zip(result.naive.buckets(), result.prazo.buckets()):
        lines.append(
            f"  {naive_bucket['t_s']:>4.0f} s   naive {naive_bucket['offered_multiple']:>5.2f}   "
            f"prazo {prazo_bucket['offered_multiple']:>5.2f}"
        )
    light = result.light
    lines.append("")
    lines.append(
        f"light faults: {p.light_rate_per_s:g} requests/s for {p.light_duration_s:g} s, "
        f"{100 * p.light_fault_rate:g} % of B's answers a random 503, prazo's RetryPolicy: "
        f"{100 * light.success_share():.1f} % of {len(light.requests)} client requests succeeded "
        f"(offered load at B {light.offered_multiple():.2f}×)"
    )
    lines.append("")
    capacity = result.capacity_per_s
    lines.append(
        f"callers that throttle themselves: {p.throttle_rate_per_s:g} requests/s "
        f"({p.throttle_rate_per_s / capacity:.1f}× B's capacity of {capacity:.1f}/s) for {p.duration_s:g} s, "
        f"A with RetryPolicy (budget as above), without and with throttle=AdaptiveThrottles(k={p.throttle_k:g}):"
    )
    for run in (result.unthrottled, result.throttled):
        refused = (run.notes.get("policy") or {}).get("throttled_locally", 0)
        lines.append(
            f"  {run.setup:<12} arrivals at B {run.arrivals_per_s():5.1f}/s = {run.arrivals_per_s() / capacity:4.2f}× "
            f"capacity; client goodput {run.goodput_per_s():5.1f}/s; refused at A without sending: {refused}"
        )
    return "\n".join(lines)


def plot_experiment(result: RetryExperimentResult, path: str) -> None:
    """Three panels over time: offered load at B (× client requests), B's wasted work, client goodput.

    Needs matplotlib (``pip install 'prazo[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for run, colour in ((result.naive, "tab:red"), (result.prazo, "tab:blue")):
        buckets = run.buckets()
        times = [bucket["t_s"] + _BUCKET_S / 2 for bucket in buckets]
        label = "naive retries (3 attempts)" if run is result.naive else "prazo RetryPolicy, 10 % budget"
        axes[0].plot(times, [b["offered_multiple"] for b in buckets], marker="o", color=colour, label=label)
        axes[1].plot(times, [b["wasted_work_ms"] for b in buckets], marker="o", color=colour, label=label)
        axes[2].plot(times, [b["goodput_per_s"] for b in buckets], marker="o", color=colour, label=label)
    axes[0].axhline(1.0, color="0.5", linestyle="--", linewidth=0.8)
    axes[0].set_ylabel("arrivals at B / client requests")
    axes[0].set_title("offered load at B")
    axes[1].set_ylabel("ms of B's work per second")
    axes[1].set_title("B's wasted work (answers no client used)")
    capacity = result.params.concurrency * 1000 / result.params.work_ms
    axes[2].axhline(capacity, color="0.5", linestyle="--", linewidth=0.8, label=f"B's capacity ({capacity:.1f}/s)")
    axes[2].set_ylabel("200s in time per second")
    axes[2].set_title("client goodput")
    axes[2].set_xlabel("time, s")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
