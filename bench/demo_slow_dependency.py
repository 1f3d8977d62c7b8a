"""``prazo demo slow-dependency``: the seed's slow-dependency incident on a real server, without and with prazo.

The second seed article's incident: an API answers 200 requests per second
and calls a recommendations service that normally answers in 20 ms. The
service degrades to 2 s. Everything that calls it through one shared pool
of 50 waits; the pool fills, the server's threads fill waiting for the
pool, and the health check — which never touches recommendations — cannot
get a thread and fails. With a bulkhead of 20 on recommendations, "20
requests suffer, the other 180 per second keep flowing".

Three processes on 127.0.0.1, over real sockets:

* **the remote** (``prazo.bench.slow_remote``): an HTTP server with the
  ``recommendations`` (20 ms) and ``cart`` (5 ms) dependencies; the demo
  switches recommendations to 2 s for the *during* phase and back;
* **the API** (this process): a waitress server with a fixed number of
  worker threads and four endpoints — ``/product`` (local work),
  ``/cart`` (calls cart), ``/recommendations`` (calls recommendations)
  and ``/health`` (calls nothing);
* **the clients** (``prazo.bench.loadgen``, the load generator of ``prazo
  bench goodput``, with ``--mix``): open-loop Poisson arrivals at a fixed
  total rate, the same seeded schedule for both setups, each request on its
  own connection with a client timeout (1 s for the health probe, like a
  Kubernetes probe's default, 5 s otherwise) sent as its budget.

The same app runs twice, one setup after the other:

*without prazo*
    stock waitress; the handlers call both dependencies through one shared
    ``ThreadPoolExecutor(50)`` and wait for the answer with a plain 30 s
    timeout (the seed's "formality").
*with prazo*
    prazo's waitress embedding (same thread count; a bounded queue and the
    clients' budgets); recommendations behind
    ``Dependency("recommendations", max_concurrent=20, timeout_ms=200,
    stale_for_s=600)`` with last-known-good per product, cart behind its
    own ``Dependency(..., critical=True)`` (a cart from ten minutes ago is
    not an answer). The dependency client code is the same plain 30 s
    client in both setups: the isolation comes from the ``Dependency``
    alone.

For each setup the report gives, per endpoint and phase (before / during /
after): requests, p50 and p99 latency (from the scheduled send time to the
answer, or to the client giving up), error rate (anything but a 200) and
the share answered stale. ``run_demo(params)`` returns it all as data
(``DemoResult``; ``.to_json()``), ``render_report`` as text, and
``plot_timeline`` draws latency over time (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from prazo.bench.loadgen import LoadGenerator, LoadResult
from prazo.bench.slow_remote import SlowRemote

__all__ = [
    "ENDPOINTS",
    "MIX",
    "PHASES",
    "QUICK_PARAMS",
    "SETUPS",
    "DemoResult",
    "PhaseStats",
    "Record",
    "SetupResult",
    "SlowDependencyParams",
    "load_argv",
    "make_api",
    "plot_timeline",
    "render_report",
    "run_demo",
    "run_setup",
    "to_records",
]

ENDPOINTS = ("/product", "/cart", "/recommendations", "/health")
PHASES = ("before", "during", "after")
SETUPS = ("without", "with")
SETUP_TITLES = {"without": "without prazo", "with": "with prazo"}
# Share of the arrivals per endpoint.
MIX = {"/product": 0.30, "/cart": 0.15, "/recommendations": 0.50, "/health": 0.05}
_SAMPLE_INTERVAL_S = 0.25
# The counters of dep.stats() the report prints (the JSON has them all).
_DEPENDENCY_STATS_SHOWN = ("outcomes", "rejected", "stale_served", "p99_ms")
_STOP_TIMEOUT_S = 10.0
_STARTUP_TIMEOUT_S = 20.0
# Set by the API when it answered from last-known-good: how old that answer is.
STALE_HEADER = "X-Stale-Age-S"
_LOADGEN_WAIT_SLACK_S = 60.0


@dataclass(frozen=True)
class SlowDependencyParams:
    """The scenario; the defaults are the seed's numbers (see ``scaled_notes`` for what a run changed)."""

    rate_per_s: float = 200.0
    before_s: float = 10.0
    during_s: float = 20.0
    after_s: float = 15.0
    normal_ms: float = 20.0
    slow_ms: float = 2000.0
    cart_ms: float = 5.0
    server_threads: int = 64
    shared_pool: int = 50
    bulkhead: int = 20
    timeout_ms: float = 200.0
    naive_timeout_s: float = 30.0
    stale_for_s: float = 600.0
    health_timeout_s: float = 1.0
    client_timeout_s: float = 5.0
    keys: int = 50
    seed: int = 9

    def __post_init__(self) -> None:
        for name in ("server_threads", "shared_pool", "bulkhead", "keys"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("rate_per_s", "during_s", "slow_ms", "timeout_ms", "naive_timeout_s", "stale_for_s",
                     "health_timeout_s", "client_timeout_s"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("before_s", "after_s", "normal_ms", "cart_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def duration_s(self) -> float:
        return self.before_s + self.during_s + self.after_s


# A short run for the tests and a first look: the same rates and pools, shorter phases.
QUICK_PARAMS = SlowDependencyParams(before_s=3.0, during_s=6.0, after_s=4.0)


# -- the dependencies, as the app calls them ------------------------------------------


class RemoteClient:
    """A plain blocking HTTP client for the remote, one keep-alive connection per thread.

    The same code in both setups, with the same long socket timeout: it knows
    nothing of deadlines, like most client code a service already has.
    """

    def __init__(self, port: int, timeout_s: float) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._local = threading.local()

    def get(self, path: str) -> bytes:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise
        if response.status != 200:
            raise OSError(f"remote answered {response.status}")
        return body


class SharedPool:
    """The setup without prazo: every dependency call through one ``ThreadPoolExecutor``, waited for at length."""

    def __init__(self, client: RemoteClient, size: int, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.executor = ThreadPoolExecutor(size, thread_name_prefix="shared-pool")
        self._lock = threading.Lock()
        self.submitted = 0
        self.started = 0
        self.finished = 0

    def _run(self, path: str) -> bytes:
        with self._lock:
            self.started += 1
        try:
            return self.client.get(path)
        finally:
            with self._lock:
                self.finished += 1

    def fetch(self, path: str) -> bytes:
        with self._lock:
            self.submitted += 1
        return self.executor.submit(self._run, path).result(timeout=self.timeout_s)

    def recommendations(self, key: str) -> tuple[bytes, float | None]:
        return self.fetch(f"/recommendations?id={key}"), None

    def cart(self, key: str) -> bytes:
        return self.fetch(f"/cart?id={key}")

    def sample(self) -> dict[str, float]:
        with self._lock:
            return {"pool_running": self.started - self.finished, "pool_queued": self.submitted - self.started}

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Bulkheads:
    """The setup with prazo: one ``Dependency`` per remote dependency."""

    def __init__(self, client: RemoteClient, params: SlowDependencyParams) -> None:
        from prazo.bindings.dependency import Dependency

        self.client = client
        self.recs = Dependency(
            "recommendations",
            max_concurrent=params.bulkhead,
            timeout_ms=params.timeout_ms,
            stale_for_s=params.stale_for_s,
        )
        self.carts = Dependency("cart", max_concurrent=params.bulkhead, timeout_ms=params.timeout_ms, critical=True)

    def recommendations(self, key: str) -> tuple[bytes, float | None]:
        result = self.recs.call_detailed(self.client.get, f"/recommendations?id={key}", key=key, idempotent=True)
        return result.value, (result.age_s if result.stale else None)

    def cart(self, key: str) -> bytes:
        value: bytes = self.carts.call(self.client.get, f"/cart?id={key}", key=key, idempotent=True)
        return value

    def sample(self) -> dict[str, float]:
        stats = self.recs.stats()
        sample = {"bulkhead_in_flight": stats["in_flight"], "bulkhead_saturation": stats["saturation"]}
        if stats.get("p99_ms") is not None:
            # The live p99 of the calls that returned: the signal to alert on, with saturation.
            sample["recommendations_p99_ms"] = stats["p99_ms"]
        return sample

    def stats(self) -> dict[str, Any]:
        return {"recommendations": self.recs.stats(), "cart": self.carts.stats()}

    def close(self) -> None:
        """The Dependency's threads end with the calls they are running."""


# -- the API --------------------------------------------------------------------------


def make_api(backends: Any, *, catch_errors: bool) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """The service: ``/product``, ``/cart``, ``/recommendations``, ``/health``.

    ``backends`` has ``recommendations(key) -> (body, stale_age_s | None)``
    and ``cart(key) -> body``. With ``catch_errors`` (the setup without
    prazo, on stock waitress) a dependency timeout is answered 504 and any
    other dependency error 502; otherwise the errors propagate, and prazo's
    server answers ``DependencyUnavailable`` 503 and a missed deadline 504.
    """

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        key = environ.get("QUERY_STRING", "").partition("id=")[2] or "0"
        headers = [("Content-Type", "application/json")]
        try:
            if path == "/health":
                body = b'{"status": "ok"}'
            elif path == "/product":
                # Local work: a catalogue entry built in process.
                price = sum(ord(c) for c in key * 50) / 100
                body = json.dumps({"id": key, "name": f"product {key}", "price": price}).encode()
            elif path == "/cart":
                body = backends.cart(key)
            elif path == "/recommendations":
                body, stale_age = backends.recommendations(key)
                if stale_age is not None:
                    headers.append((STALE_HEADER, f"{stale_age:.3f}"))
            else:
                start_response("404 Not Found", [("Content-Length", "0")])
                return []
        except FutureTimeout:
            if not catch_errors:
                raise
            start_response("504 Gateway Timeout", [("Content-Length", "0")])
            return []
        except (OSError, http.client.HTTPException):
            if not catch_errors:
                raise
            start_response("502 Bad Gateway", [("Content-Length", "0")])
            return []
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [body]

    return app


# -- the servers ------------------------------------------------------------------------


@dataclass
class _Api:
    port: int
    sample: Callable[[], dict[str, float]]
    stop: Callable[[], object]


class _ConnectionLimitNotices(logging.Filter):
    """Keeps waitress's "reached the connection limit" notices (one per pause) off the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "the connection limit" not in record.getMessage()


@contextmanager
def _quiet_waitress() -> Iterator[None]:
    """The report says when waitress stopped accepting; its own log lines would drown it."""
    notices = _ConnectionLimitNotices()
    waitress_log, queue_log = logging.getLogger("waitress"), logging.getLogger("waitress.queue")
    queue_level = queue_log.level
    waitress_log.addFilter(notices)
    queue_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        waitress_log.removeFilter(notices)
        queue_log.setLevel(queue_level)


@contextmanager
def _api_server(setup: str, app: Any, params: SlowDependencyParams) -> Iterator[_Api]:
    if setup == "with":
        from prazo.bindings.servers.waitress import create_server, shutdown

        server = create_server(
            app, host="127.0.0.1", port=0, threads=params.server_threads, max_queue=params.server_threads,
            default_budget_ms=params.client_timeout_s * 1000, max_budget_ms=params.client_timeout_s * 1000,
        )  # fmt: skip

        def sample() -> dict[str, float]:
            stats = server.task_dispatcher.stats()
            return {"server_busy": stats["in_flight"], "server_queued": stats["queued"]}

        def stop() -> object:
            return shutdown(server, _STOP_TIMEOUT_S)
    else:
        from waitress.server import create_server as stock_create_server

        server = stock_create_server(app, host="127.0.0.1", port=0, threads=params.server_threads)
        dispatcher = server.task_dispatcher

        def sample() -> dict[str, float]:
            return {"server_busy": dispatcher.active_count, "server_queued": len(dispatcher.queue)}

        def stop() -> object:
            dispatcher.shutdown(timeout=_STOP_TIMEOUT_S)
            return server.close()

    def sample_with_listener() -> dict[str, float]:
        # waitress stops accepting at its connection limit: new connections then wait in the kernel's backlog.
        return {**sample(), "not_accepting": float(bool(getattr(server, "in_connection_overflow", False)))}

    runner = threading.Thread(target=server.run, name="slow-dependency-api", daemon=True)
    runner.start()
    try:
        yield _Api(server.effective_port, sample_with_listener, stop)
    finally:
        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        stopper.join(_STOP_TIMEOUT_S + 5)


def _wait_until_up(port: int) -> None:
    end = time.monotonic() + _STARTUP_TIMEOUT_S
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
        finally:
            conn.close()


# -- results ----------------------------------------------------------------------------


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least ``q`` % of the values at or below it."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))]


@dataclass
class Record:
    """One request as the demo counts it: times are ``time.monotonic_ns()`` values (shared by all processes on Linux)."""

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


def to_records(load: LoadResult, start_ns: int) -> list[Record]:
    """The load generator's records as the demo's, in schedule order (``start_ns``: the schedule's time zero)."""
    records = []
    for scheduled, sent, status, reason, latency, outcome, target, stale in sorted(load.records, key=lambda r: r[0]):
        answered = outcome in ("ok", "refused", "status")
        records.append(
            Record(
                endpoint=target.partition("?")[0],
                scheduled_ns=start_ns + scheduled,
                sent_ns=start_ns + sent,
                done_ns=start_ns + sent + latency,
                status=status if answered else 0,
                error=None if answered else reason or outcome,
                stale_age_s=None if stale is None else float(stale),
            )
        )
    return records


def load_argv(params: SlowDependencyParams, port: int) -> list[str]:
    """The load generator's command line for ``params`` against the API on ``port``."""
    return [
        "--port", str(port), "--rate", repr(params.rate_per_s), "--seconds", repr(params.duration_s),
        "--seed", str(params.seed), "--mix", ",".join(f"{path}={weight!r}" for path, weight in MIX.items()),
        "--keys", str(params.keys), "--budget-ms", repr(params.client_timeout_s * 1000),
        "--path-budget", f"/health={params.health_timeout_s * 1000!r}", "--capture", STALE_HEADER,
    ]  # fmt: skip


@dataclass(frozen=True)
class PhaseStats:
    """One endpoint in one phase, as its clients saw it."""

    requests: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    errors: int
    stale: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def stale_share(self) -> float:
        return self.stale / self.requests if self.requests else 0.0

    @classmethod
    def of(cls, records: Sequence[Record]) -> PhaseStats:
        latencies = sorted(r.latency_ms for r in records)
        return cls(
            requests=len(records),
            p50_ms=_percentile(latencies, 50),
            p99_ms=_percentile(latencies, 99),
            max_ms=latencies[-1] if latencies else None,
            errors=sum(1 for r in records if r.status != 200),
            stale=sum(1 for r in records if r.status == 200 and r.stale_age_s is not None),
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "error_rate": self.error_rate, "stale_share": self.stale_share}


@dataclass
class SetupResult:
    """Everything one setup observed."""

    setup: str
    params: SlowDependencyParams
    start_ns: int
    slow_at_ns: int
    normal_at_ns: int
    records: list[Record]
    samples: list[dict[str, float]] = field(default_factory=list)
    dependency_stats: dict[str, Any] = field(default_factory=dict)

    def phase_of(self, record: Record) -> str:
        if record.scheduled_ns < self.slow_at_ns:
            return "before"
        if record.scheduled_ns < self.normal_at_ns:
            return "during"
        return "after"

    def stats(self, endpoint: str, phase: str) -> PhaseStats:
        return PhaseStats.of([r for r in self.records if r.endpoint == endpoint and self.phase_of(r) == phase])

    def table(self) -> dict[str, dict[str, PhaseStats]]:
        return {e: {p: self.stats(e, p) for p in PHASES} for e in ENDPOINTS}

    def lag_ms(self) -> dict[str, float | None]:
        """How late the load generator sent its requests (it must keep its schedule)."""
        lags = sorted(r.lag_ms for r in self.records)
        return {"p50": _percentile(lags, 50), "p99": _percentile(lags, 99), "max": lags[-1] if lags else None}

    def achieved_rate(self) -> float:
        return len(self.records) / self.params.duration_s

    def not_accepting_s(self) -> float:
        """For how long waitress had stopped accepting connections (its connection limit), sampled."""
        return sum(_SAMPLE_INTERVAL_S for s in self.samples if s.get("not_accepting"))

    def peak(self, key: str) -> float | None:
        values = [s[key] for s in self.samples if key in s]
        return max(values) if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "setup": self.setup,
            "title": SETUP_TITLES[self.setup],
            "incident_s": [(self.slow_at_ns - self.start_ns) / 1e9, (self.normal_at_ns - self.start_ns) / 1e9],
            "requests": len(self.records),
            "achieved_rate_per_s": self.achieved_rate(),
            "generator_lag_ms": self.lag_ms(),
            "table": {e: {p: s.to_json() for p, s in row.items()} for e, row in self.table().items()},
            "peaks": {
                key: self.peak(key) for key in sorted({k for s in self.samples for k in s} - {"t_s", "not_accepting"})
            },
            "not_accepting_s": self.not_accepting_s(),
            "dependency_stats": self.dependency_stats,
        }


@dataclass
class DemoResult:
    params: SlowDependencyParams
    setups: dict[str, SetupResult]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "params": asdict(self.params),
            "mix": MIX,
            "notes": self.notes,
            "setups": {name: result.to_json() for name, result in self.setups.items()},
        }


# -- running ----------------------------------------------------------------------------


def _sleep_until(ns: int) -> None:
    while (left := ns - time.monotonic_ns()) > 0:
        time.sleep(min(left / 1e9, 0.1))


def run_setup(params: SlowDependencyParams, setup: str) -> SetupResult:
    """One setup (``"without"`` or ``"with"``) end to end: remote, API, clients, the incident."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    with SlowRemote({"recommendations": params.normal_ms, "cart": params.cart_ms}) as remote:
        client = RemoteClient(remote.port, params.naive_timeout_s)
        backends: SharedPool | Bulkheads
        if setup == "with":
            backends = Bulkheads(client, params)
        else:
            backends = SharedPool(client, params.shared_pool, params.naive_timeout_s)
        app = make_api(backends, catch_errors=setup == "without")
        samples: list[dict[str, float]] = []
        try:
            with _quiet_waitress(), _api_server(setup, app, params) as api:
                _wait_until_up(api.port)
                generator = LoadGenerator(load_argv(params, api.port)).start()
                try:
                    start_ns = generator.begin()
                    stop_sampling = threading.Event()

                    def sampler() -> None:
                        while not stop_sampling.wait(_SAMPLE_INTERVAL_S):
                            sample = {"t_s": (time.monotonic_ns() - start_ns) / 1e9, **api.sample()}
                            samples.append({**sample, **backends.sample()})

                    sampling = threading.Thread(target=sampler, name="slow-dependency-sampler", daemon=True)
                    sampling.start()
                    _sleep_until(start_ns + int(params.before_s * 1e9))
                    slow_at_ns = remote.set_latency("recommendations", params.slow_ms)
                    _sleep_until(start_ns + int((params.before_s + params.during_s) * 1e9))
                    normal_at_ns = remote.set_latency("recommendations", params.normal_ms)
                    longest_s = max(params.client_timeout_s, params.health_timeout_s)
                    load = generator.wait(params.duration_s + longest_s + _LOADGEN_WAIT_SLACK_S)
                    records = to_records(load, start_ns)
                    stop_sampling.set()
                    sampling.join()
                finally:
                    generator.kill()
                dependency_stats = backends.stats() if isinstance(backends, Bulkheads) else {}
        finally:
            backends.close()
    return SetupResult(setup, params, start_ns, slow_at_ns, normal_at_ns, records, samples, dependency_stats)


def scaled_notes(params: SlowDependencyParams) -> list[str]:
    """What this run kept from the seed's numbers, what it changed, and what the seed leaves open."""
    seed = SlowDependencyParams()
    kept = {
        "rate_per_s": "{:g} requests/s",
        "normal_ms": "recommendations at {:g} ms",
        "slow_ms": "then {:g} ms",
        "shared_pool": "a shared pool of {}",
        "bulkhead": "a bulkhead of {}",
    }
    same = [
        text.format(getattr(params, name))
        for name, text in kept.items()
        if getattr(params, name) == getattr(seed, name)
    ]
    changed = [
        f"{name} {getattr(params, name):g} (seed {getattr(seed, name):g})"
        for name in kept
        if getattr(params, name) != getattr(seed, name)
    ]
    notes = [f"{os.cpu_count()} CPUs; the clients, the API and the remote run as three processes on 127.0.0.1"]
    if same:
        notes.append("the seed's numbers, not scaled: " + ", ".join(same))
    if changed:
        notes.append("scaled: " + ", ".join(changed))
    notes.append(
        f"not in the seed, chosen here: the endpoint mix, {params.server_threads} server threads, "
        f"a {params.timeout_ms:g} ms timeout on recommendations (10x their normal latency)"
    )
    if params.duration_s != seed.duration_s:
        notes.append(
            f"phases {params.before_s:g} s / {params.during_s:g} s / {params.after_s:g} s "
            f"(the full run: {seed.before_s:g} / {seed.during_s:g} / {seed.after_s:g})"
        )
    return notes


def run_demo(params: SlowDependencyParams = SlowDependencyParams()) -> DemoResult:
    """Both setups, one after the other, with the same traffic."""
    setups = {setup: run_setup(params, setup) for setup in SETUPS}
    return DemoResult(params, setups, scaled_notes(params))


# -- the report -------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %" if value else "0"


def _stat(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} {count}" for key, count in value.items() if count) + "}"
    if isinstance(value, float):
        return _ms(value)
    return str(value)


def _setup_description(setup: str, p: SlowDependencyParams) -> str:
    if setup == "without":
        return (
            f"stock waitress, {p.server_threads} threads; /cart and /recommendations call their dependency through "
            f"one shared ThreadPoolExecutor({p.shared_pool}), waiting up to {p.naive_timeout_s:g} s"
        )
    return (
        f"prazo's waitress embedding, {p.server_threads} threads, queue {p.server_threads}; "
        f'Dependency("recommendations", max_concurrent={p.bulkhead}, timeout_ms={p.timeout_ms:g}, '
        f'stale_for_s={p.stale_for_s:g}); Dependency("cart", critical=True)'
    )


def _render_table(result: SetupResult) -> list[str]:
    lines = [
        f"{'endpoint':<17} {'phase':<7} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>8} {'stale':>8}",
    ]
    for endpoint, row in result.table().items():
        for index, (phase, s) in enumerate(row.items()):
            lines.append(
                f"{endpoint if index == 0 else '':<17} {phase:<7} {s.requests:>8} {_ms(s.p50_ms):>8} "
                f"{_ms(s.p99_ms):>8} {_pct(s.error_rate):>8} {_pct(s.stale_share):>8}"
            )
    return lines


def render_report(result: DemoResult) -> str:
    """The two setups' tables, then the incident side by side."""
    p = result.params
    out = [
        "prazo demo slow-dependency — the seed's incident on a real server",
        f"  {p.rate_per_s:g} requests/s (Poisson, open loop) over "
        + ", ".join(f"{e} {100 * w:.0f} %" for e, w in MIX.items())
        + f"; client timeout {p.client_timeout_s:g} s, health probe {p.health_timeout_s:g} s",
        (
            f"  recommendations answer in {p.normal_ms:g} ms, then {p.slow_ms:g} ms for {p.during_s:g} s "
            f"(phases {p.before_s:g} / {p.during_s:g} / {p.after_s:g} s); cart in {p.cart_ms:g} ms throughout"
        ),
        *(f"  note: {note}" for note in result.notes),
        "",
    ]
    for name, setup in result.setups.items():
        lag = setup.lag_ms()
        out.append(f"{SETUP_TITLES[name]} — {_setup_description(name, p)}")
        out.extend("  " + line for line in _render_table(setup))
        peaks = ", ".join(f"{key} {value:g}" for key, value in setup.to_json()["peaks"].items() if value is not None)
        out.append(f"  peaks: {peaks}")
        if setup.not_accepting_s():
            out.append(
                f"  waitress stopped accepting connections (its connection limit) for about "
                f"{setup.not_accepting_s():.1f} s: new connections waited in the kernel's backlog"
            )
        for dependency, stats in setup.dependency_stats.items():
            shown = {key: _stat(stats[key]) for key in _DEPENDENCY_STATS_SHOWN if key in stats}
            out.append(f"  Dependency {dependency!r}: " + ", ".join(f"{key} {value}" for key, value in shown.items()))
        out.append(
            f"  load generator: {len(setup.records)} requests ({setup.achieved_rate():.0f}/s), "
            f"sent late by p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms, max {_ms(lag['max'])} ms"
        )
        out.append("")
    if set(SETUPS) <= set(result.setups):
        without, with_ = result.setups["without"], result.setups["with"]
        out.append("during the incident — p99 ms / errors / stale")
        out.append(f"  {'endpoint':<17} {'without prazo':>26} {'with prazo':>26}")
        for endpoint in ENDPOINTS:
            cells = []
            for setup in (without, with_):
                s = setup.stats(endpoint, "during")
                cells.append(f"{_ms(s.p99_ms)} / {_pct(s.error_rate)} / {_pct(s.stale_share)}")
            out.append(f"  {endpoint:<17} {cells[0]:>26} {cells[1]:>26}")
    return "\n".join(out).rstrip()


# -- the plot ---------------------------------------------------------------------------

_COLOURS = {"/product": "tab:blue", "/cart": "tab:green", "/recommendations": "tab:orange", "/health": "tab:red"}


def plot_timeline(result: DemoResult, path: str) -> None:
    """Latency over time per endpoint, one panel per setup, the incident shaded; failures marked ``x``.

    Needs matplotlib (``pip install 'prazo[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(result.setups.values())
    figure, axes = plt.subplots(
        2, len(setups), figsize=(7 * len(setups), 7), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": [3, 1]},
    )  # fmt: skip
    top = max(result.params.client_timeout_s * 1000 * 1.5, 10.0)
    for column, setup in enumerate(setups):
        ax, saturation = axes[0][column], axes[1][column]
        for endpoint in ENDPOINTS:
            mine = [r for r in setup.records if r.endpoint == endpoint]
            ok = [r for r in mine if r.status == 200]
            failed = [r for r in mine if r.status != 200]
            colour = _COLOURS[endpoint]
            ax.scatter(
                [(r.scheduled_ns - setup.start_ns) / 1e9 for r in ok], [max(r.latency_ms, 0.1) for r in ok],
                s=3, alpha=0.35, color=colour, label=endpoint, linewidths=0,
            )  # fmt: skip
            ax.scatter(
                [(r.scheduled_ns - setup.start_ns) / 1e9 for r in failed], [max(r.latency_ms, 0.1) for r in failed],
                s=12, alpha=0.6, color=colour, marker="x", linewidths=0.8,
            )  # fmt: skip
        for axis in (ax, saturation):
            axis.axvspan(
                (setup.slow_at_ns - setup.start_ns) / 1e9, (setup.normal_at_ns - setup.start_ns) / 1e9,
                color="0.9", zorder=0,
            )  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylim(0.3, top)
        ax.set_title(f"{SETUP_TITLES[setup.setup]}: latency per request (x = error or gave up)")
        ax.set_ylabel("latency, ms (log)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left", markerscale=4, fontsize="small")
        times = [s["t_s"] for s in setup.samples]
        if setup.setup == "with":
            series = {"recommendations bulkhead in flight": "bulkhead_in_flight", "server threads busy": "server_busy"}
        else:
            series = {"shared pool: running": "pool_running", "shared pool: waiting": "pool_queued",
                      "server threads busy": "server_busy"}  # fmt: skip
        for label, key in series.items():
            saturation.plot(times, [s.get(key, 0) for s in setup.samples], label=label, linewidth=1.2)
        saturation.set_xlabel("seconds since the traffic started (the incident shaded)")
        saturation.set_ylabel("threads / calls")
        saturation.grid(True, alpha=0.3)
        saturation.legend(loc="upper left", fontsize="small")
    p = result.params
    figure.suptitle(
        f"prazo demo slow-dependency: {p.rate_per_s:g} req/s, recommendations {p.normal_ms:g} ms → "
        f"{p.slow_ms:g} ms; shared pool of {p.shared_pool} vs bulkhead of {p.bulkhead}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
