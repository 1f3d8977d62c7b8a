"""Prometheus metrics (``prazo.bindings.integrations.prometheus``): what a scrape shows after driving real objects.

Every test scrapes through ``prometheus_client`` itself (``generate_latest``,
or ``make_wsgi_app`` over a real socket) and parses the text back with
``prometheus_client.parser``, so the checks are on the exposition a
Prometheus server would read.
"""

from __future__ import annotations

import gc
import http.client
import math
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import prazo.core
import pytest
import yaml
from _helpers import FakeClock, QueueClass, wait_until
from prazo.bindings.dependency import Breaker, Dependency, DependencyUnavailable
from prazo.bindings.integrations import prometheus
from prazo.bindings.integrations.prometheus import BUCKETS_S, METRIC_NAMES, PrazoCollector, mount_metrics, register
from prazo.bindings.pool import AdmissionPool
from prazo.bindings.wsgi import AdmissionMiddleware
from prazo.core import Deadline, DeadlineExceeded, QueueFull, extension_wanted
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.serving import make_server
from werkzeug.test import Client

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "examples" / "prometheus" / "alerts.yml"
MS = 1_000_000
# serve_forever looks for a shutdown request every poll_interval (0.5 s by default):
# a shorter one lets shutdown() return at once instead of waiting out the poll.
_POLL = {"poll_interval": 0.05}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition as ``{(sample name, labels): value}``."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def label_values(samples: Samples, label: str) -> set[str]:
    return {dict(labels)[label] for _, labels in samples if label in dict(labels)}


def buckets(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    """``{le: cumulative count}`` of histogram ``name``."""
    found: dict[str, float] = {}
    for (sample, sample_labels), count in samples.items():
        as_dict = dict(sample_labels)
        le = as_dict.pop("le", "")
        if sample == f"{name}_bucket" and as_dict == labels:
            found[le] = count
    return found


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(params=[False, True], ids=["python-path", "compiled-path"])
def fast_path(request: pytest.FixtureRequest) -> bool:
    """The middleware's Python path, then its compiled one (required unless PRAZO_NO_EXTENSIONS=1)."""
    if request.param and not extension_wanted():
        pytest.skip("PRAZO_NO_EXTENSIONS is set: there is no compiled WSGI path")
    return bool(request.param)


# -- the admission queue, both twins -------------------------------------------------


def test_queue_counters_and_gauges_are_exact(impl: QueueClass, clock: FakeClock, registry: CollectorRegistry) -> None:
    q = impl(2, 2)
    PrazoCollector(registry).add_queue("jobs", q)
    start = clock.ns
    q.put("a", clock.deadline_in(1000), now_ns=start)  # a slot at once
    q.put("b", clock.deadline_in(1000), now_ns=start)  # a slot at once
    q.put("c", clock.deadline_in(1000), now_ns=start)  # waits
    q.put("d", clock.deadline_in(20), now_ns=start)  # waits, and will expire
    with pytest.raises(QueueFull):
        q.put("e", clock.deadline_in(1000), now_ns=start)
    with pytest.raises(DeadlineExceeded):
        q.put("f", clock.deadline_in(-1), now_ns=start)
    assert [q.get(now_ns=start), q.get(now_ns=start)] == ["a", "b"]

    samples = scrape(registry)
    assert value(samples, "prazo_queue_in_flight", queue="jobs") == 2
    assert value(samples, "prazo_queue_queued", queue="jobs") == 2
    assert value(samples, "prazo_queue_saturation", queue="jobs") == 1.0

    q.task_done(now_ns=clock.advance(30))  # a's slot goes to c (30 ms in line); d is past its deadline
    assert q.get(now_ns=clock.ns) == "c"
    q.task_done(now_ns=clock.ns)  # b done: d has expired, the slot stays free
    samples = scrape(registry)
    stats = q.stats()
    expected = {
        "prazo_queue_offered_total": 6,
        "prazo_queue_started_total": 3,
        "prazo_queue_completed_total": 2,
        "prazo_queue_cancelled_total": 0,
        "prazo_queue_in_flight": 1,
        "prazo_queue_assigned": 0,
        "prazo_queue_queued": 0,
        "prazo_queue_peak_in_flight": 2,
        "prazo_queue_peak_queued": 2,
        "prazo_queue_max_concurrency": 2,
        "prazo_queue_max_queue": 2,
        "prazo_queue_saturation": 0.5,
    }
    assert {name: value(samples, name, queue="jobs") for name in expected} == expected
    refused = {
        reason: value(samples, "prazo_queue_refused_total", queue="jobs", reason=reason)
        for reason in ("queue-full", "expired-on-arrival", "expired-in-queue")
    }
    assert refused == {"queue-full": 1, "expired-on-arrival": 1, "expired-in-queue": 1}
    assert stats["queue_wait_ns_total"] == 30 * MS
    assert value(samples, "prazo_queue_wait_seconds_total", queue="jobs") == pytest.approx(0.030, abs=1e-12)
    # A bare queue has none of the middleware's or pool's families.
    assert not [name for name, _ in samples if name.startswith(("prazo_wsgi_", "prazo_pool_", "prazo_request_"))]


def test_queue_policy_refusals_and_gauges(impl: QueueClass, clock: FakeClock, registry: CollectorRegistry) -> None:
    q = impl(1, 4, order="adaptive", expected_service_ms=50)
    PrazoCollector(registry).add_queue("policies", q)
    start = clock.ns
    q.put("a", clock.deadline_in(1000), now_ns=start)  # takes the slot
    with pytest.raises(DeadlineExceeded) as doomed:
        q.put("b", clock.deadline_in(40), now_ns=start)  # 40 ms left, 50 ms expected
    assert doomed.value.reason == "insufficient-budget"
    q.put("c", clock.deadline_in(5000), now_ns=start)  # waits
    assert q.get(now_ns=start) == "a"
    # c has waited 150 ms, beyond CoDel's interval (100 ms): shed, not started.
    q.task_done(now_ns=clock.advance(150))
    assert q.stats()["shed"] == 1

    samples = scrape(registry)
    refused = {
        reason: value(samples, "prazo_queue_refused_total", queue="policies", reason=reason)
        for reason in ("queue-full", "insufficient-budget", "shed-standing-queue")
    }
    assert refused == {"queue-full": 0, "insufficient-budget": 1, "shed-standing-queue": 1}
    assert value(samples, "prazo_queue_expected_service_seconds", queue="policies") == pytest.approx(0.050)
    assert value(samples, "prazo_queue_limit", queue="policies") == 1


def test_queue_policy_families_follow_the_stats_they_read(registry: CollectorRegistry) -> None:
    """A ``stats()`` without the policy keys (an older or foreign admission point) exports none of their series."""

    class Legacy:
        def stats(self) -> dict[str, int]:
            keys = ("offered", "started", "completed", "cancelled", "in_flight", "assigned", "queued")
            more = ("peak_in_flight", "peak_queued", "rejected_full", "expired_on_arrival", "expired_in_queue")
            return {**dict.fromkeys((*keys, *more, "queue_wait_ns_total"), 0), "max_concurrency": 2, "max_queue": 1}

    legacy = Legacy()
    PrazoCollector(registry).add_queue("legacy", legacy)
    samples = scrape(registry)
    reasons = {dict(labels).get("reason") for name, labels in samples if name == "prazo_queue_refused_total"}
    assert reasons == {"queue-full", "expired-on-arrival", "expired-in-queue"}
    assert not [name for name, _ in samples if name in ("prazo_queue_limit", "prazo_queue_expected_service_seconds")]


# -- the middleware, on both paths ---------------------------------------------------


def service(environ: dict[str, Any], start_response: Any) -> Any:
    path = environ["PATH_INFO"]
    if path == "/deadline":
        raise DeadlineExceeded("deadline-exceeded")
    if path == "/slow":
        time.sleep(0.12)
    start_response("200 OK", [("Content-Type", "text/plain")])
    if path == "/stream":
        return iter([b"a", b"b"])
    return [b"ok"]


def test_middleware_counters_and_latency_histograms(fast_path: bool, registry: CollectorRegistry) -> None:
    mw = AdmissionMiddleware(
        service, max_concurrency=2, max_queue=2, bypass={"/healthz"}, fast_path=fast_path, record_latency=True
    )
    assert mw.fast_path is fast_path
    register(api=mw, registry=registry)
    client = Client(mw)
    statuses = [client.get(path).status_code for path in ("/", "/", "/stream", "/slow", "/slow")]
    statuses.append(client.get("/", headers={"X-Request-Budget-Ms": "0"}).status_code)
    statuses.append(client.get("/", headers={"X-Request-Budget-Ms": "soon"}).status_code)
    statuses.append(client.get("/healthz").status_code)
    # werkzeug's test client re-raises any exc_info given to start_response, so
    # the app's DeadlineExceeded goes through a plain WSGI call instead.
    environ: dict[str, Any] = {"PATH_INFO": "/deadline"}
    setup_testing_defaults(environ)
    answered: list[str] = []
    b"".join(mw(environ, lambda status, headers, exc_info=None: answered.append(status)))
    assert statuses == [200, 200, 200, 200, 200, 504, 200, 200]
    assert answered == ["504 Gateway Timeout"]

    samples = scrape(registry)
    admitted = 7  # everything but the expired arrival and the bypassed health check
    assert value(samples, "prazo_queue_offered_total", queue="api") == admitted + 1
    assert value(samples, "prazo_queue_started_total", queue="api") == admitted
    assert value(samples, "prazo_queue_completed_total", queue="api") == admitted
    assert value(samples, "prazo_queue_refused_total", queue="api", reason="expired-on-arrival") == 1
    assert value(samples, "prazo_wsgi_refusals_total", queue="api", code="504") == 2
    assert value(samples, "prazo_wsgi_refusals_total", queue="api", code="503") == 0
    assert value(samples, "prazo_wsgi_bypassed_total", queue="api") == 1
    assert value(samples, "prazo_wsgi_invalid_budget_headers_total", queue="api") == 1
    assert value(samples, "prazo_wsgi_app_deadline_exceeded_total", queue="api") == 1
    assert value(samples, "prazo_wsgi_app_downstream_overloaded_total", queue="api") == 0

    # Every admitted request is in both histograms, the app that raised too.
    duration = buckets(samples, "prazo_request_duration_seconds", queue="api")
    assert list(duration) == [*(prometheus.floatToGoString(bound) for bound in BUCKETS_S), "+Inf"]
    assert duration["+Inf"] == admitted == value(samples, "prazo_request_duration_seconds_count", queue="api")
    # The two slow requests slept 120 ms: never in the 100 ms bucket or below.
    assert duration["0.1"] <= admitted - 2
    assert duration["0.25"] >= duration["0.1"]
    assert value(samples, "prazo_request_duration_seconds_sum", queue="api") >= 0.24
    wait = buckets(samples, "prazo_request_queue_wait_seconds", queue="api")
    assert wait["+Inf"] == admitted
    counts = list(wait.values())
    assert counts == sorted(counts)


def test_middleware_without_record_latency_has_no_histograms(fast_path: bool, registry: CollectorRegistry) -> None:
    mw = AdmissionMiddleware(service, max_concurrency=1, max_queue=0, fast_path=fast_path)
    assert mw.request_duration is None and mw.queue_wait is None
    register(api=mw, registry=registry)
    assert Client(mw).get("/").status_code == 200
    samples = scrape(registry)
    assert value(samples, "prazo_queue_completed_total", queue="api") == 1
    assert not [name for name, _ in samples if name.startswith("prazo_request_")]


def test_histogram_buckets_are_the_core_histograms_counts(registry: CollectorRegistry) -> None:
    """Exact le buckets, sum and count for known values (the bound itself counts as <= it)."""
    mw = AdmissionMiddleware(service, max_concurrency=1, max_queue=0, record_latency=True)
    PrazoCollector(registry).add_middleware("api", mw)
    assert mw.request_duration is not None
    recorded_ms = [0.5, 1.0, 3.0, 3.0, 99.0, 7_000.0, 11_000.0, 200_000.0]
    for ms in recorded_ms:
        mw.request_duration.record(round(ms * MS))
    samples = scrape(registry)
    expected_le = {bound: sum(ms <= bound * 1000 for ms in recorded_ms) for bound in BUCKETS_S}
    got = buckets(samples, "prazo_request_duration_seconds", queue="api")
    assert {float(le): count for le, count in got.items() if le != "+Inf"} == expected_le
    assert got["+Inf"] == len(recorded_ms)
    assert value(samples, "prazo_request_duration_seconds_sum", queue="api") == pytest.approx(
        sum(recorded_ms) / 1000, rel=1e-12
    )
    assert buckets(samples, "prazo_request_queue_wait_seconds", queue="api")["+Inf"] == 0


# -- the pool -------------------------------------------------------------------------


def test_pool_counters_and_histograms(registry: CollectorRegistry) -> None:
    pool = AdmissionPool(1, 1, record_latency=True)
    try:
        register(thumbnails=pool, registry=registry)
        gate = threading.Event()
        running = pool.submit(gate.wait, 10)
        wait_until(lambda: pool.stats()["started"] == 1, "the first task to start")
        waiting = pool.submit(lambda: 1 / 0)
        with pytest.raises(QueueFull):
            pool.submit(print)
        expired = pool.submit_until(Deadline.after(-1), print)
        samples = scrape(registry)
        assert value(samples, "prazo_queue_in_flight", queue="thumbnails") == 1
        assert value(samples, "prazo_queue_queued", queue="thumbnails") == 1
        assert value(samples, "prazo_pool_workers", queue="thumbnails") == 1
        gate.set()
        assert running.result(10) is True
        with pytest.raises(ZeroDivisionError):
            waiting.result(10)
        with pytest.raises(DeadlineExceeded):
            expired.result(10)
        wait_until(lambda: pool.stats()["completed"] == 2, "both tasks to finish")
        wait_until(lambda: pool.request_duration is not None and pool.request_duration.count == 2, "the records")
        samples = scrape(registry)
    finally:
        pool.shutdown()
    assert value(samples, "prazo_queue_offered_total", queue="thumbnails") == 4
    assert value(samples, "prazo_queue_started_total", queue="thumbnails") == 2
    assert value(samples, "prazo_queue_completed_total", queue="thumbnails") == 2
    assert value(samples, "prazo_queue_refused_total", queue="thumbnails", reason="queue-full") == 1
    assert value(samples, "prazo_queue_refused_total", queue="thumbnails", reason="expired-on-arrival") == 1
    assert value(samples, "prazo_pool_fn_raised_total", queue="thumbnails") == 1
    assert value(samples, "prazo_pool_futures_cancelled_total", queue="thumbnails") == 0
    assert value(samples, "prazo_queue_in_flight", queue="thumbnails") == 0
    assert buckets(samples, "prazo_request_duration_seconds", queue="thumbnails")["+Inf"] == 2
    assert buckets(samples, "prazo_request_queue_wait_seconds", queue="thumbnails")["+Inf"] == 2
    # The second task waited for the gate: its wait is in the queue-wait total as well.
    assert value(samples, "prazo_queue_wait_seconds_total", queue="thumbnails") > 0


# -- dependencies -----------------------------------------------------------------------


def test_dependency_counters_gauges_and_histogram_are_exact(clock: FakeClock, registry: CollectorRegistry) -> None:
    """A real Dependency on a fake clock: every call's duration is what ``fn`` advanced the clock by."""
    recommendations = Dependency(
        "recommendations",
        max_concurrent=2,
        timeout_ms=500,  # far above what the quick calls need, even on a loaded machine
        stale_for_s=600,
        breaker=Breaker(),
        clock=lambda: clock.ns,
    )
    payments = Dependency(
        "payments",
        max_concurrent=1,
        timeout_ms=1000,
        critical=True,
        breaker=Breaker(window=2, min_calls=1, failure_rate=0.5, open_for_s=60),
        clock=lambda: clock.ns,
    )
    register(recommendations, payments, registry=registry)

    def work(ms: float, fail: bool = False) -> str:
        clock.advance(ms)
        if fail:
            raise ValueError("broken")
        return f"{ms} ms"

    assert recommendations.call(work, 5, key="u1") == "5 ms"
    assert recommendations.call(work, 30, key="u2") == "30 ms"
    assert recommendations.call(work, 700, key="u3") == "700 ms"
    with pytest.raises(ValueError):
        recommendations.call(work, 2, True)
    # Two calls hang: each times out for its caller and keeps its place until it returns.
    gate = threading.Event()
    for _ in range(2):
        with pytest.raises(DependencyUnavailable):
            recommendations.call(gate.wait, 20)
    # The bulkhead is full: the next call is refused at once and served stale.
    result = recommendations.call_detailed(work, 1, key="u2")
    assert (result.value, result.stale, result.outcome) == ("30 ms", True, "bulkhead_full")
    with pytest.raises(ValueError):
        payments.call(work, 3, True)
    with pytest.raises(DependencyUnavailable):
        payments.call(work, 3)  # the breaker is open now

    samples = scrape(registry)
    outcomes = {
        outcome: value(samples, "prazo_dependency_calls_total", dependency="recommendations", outcome=outcome)
        for outcome in ("ok", "error", "timeout", "bulkhead_full", "breaker_open", "no_budget")
    }
    assert outcomes == {"ok": 3, "error": 1, "timeout": 2, "bulkhead_full": 1, "breaker_open": 0, "no_budget": 0}
    assert value(samples, "prazo_dependency_calls_total", dependency="payments", outcome="breaker_open") == 1
    expected = {
        "prazo_dependency_rejected_total": 1,
        "prazo_dependency_stale_served_total": 1,
        "prazo_dependency_unavailable_total": 2,  # the two timed-out calls had no stale value
        "prazo_dependency_hedges_sent_total": 0,
        "prazo_dependency_hedges_won_total": 0,
        "prazo_dependency_in_flight": 2,
        "prazo_dependency_max_concurrent": 2,
        "prazo_dependency_saturation": 1.0,
        "prazo_dependency_lkg_entries": 3,
        "prazo_dependency_timeout_seconds": 0.5,
    }
    assert {name: value(samples, name, dependency="recommendations") for name in expected} == expected
    assert value(samples, "prazo_dependency_unavailable_total", dependency="payments") == 1
    states = {
        (name, state): value(samples, "prazo_dependency_breaker_state", dependency=name, state=state)
        for name in ("recommendations", "payments")
        for state in ("closed", "open", "half-open", "disabled")
    }
    assert {key for key, flag in states.items() if flag == 1} == {("recommendations", "closed"), ("payments", "open")}
    assert sum(states.values()) == 2
    # Live quantiles over the window: 5, 30, 700 and 2 ms so far (the hung calls have not returned).
    p99 = value(samples, "prazo_dependency_latency_seconds", dependency="recommendations", quantile="0.99")
    assert p99 == pytest.approx(0.7, rel=0.01)

    gate.set()
    assert recommendations.wait_idle(10)
    samples = scrape(registry)
    assert value(samples, "prazo_dependency_in_flight", dependency="recommendations") == 0
    assert value(samples, "prazo_dependency_saturation", dependency="recommendations") == 0
    assert value(samples, "prazo_dependency_late_results_total", dependency="recommendations") == 2
    # Durations on the fake clock: 5, 30, 700, 2 ms, then the two hung calls, which
    # saw the clock move by payments' 3 ms while they waited.
    durations_ms = [5, 30, 700, 2, 3, 3]
    got = buckets(samples, "prazo_dependency_call_duration_seconds", dependency="recommendations")
    assert {float(le): count for le, count in got.items() if le != "+Inf"} == {
        bound: sum(ms <= bound * 1000 for ms in durations_ms) for bound in BUCKETS_S
    }
    assert got["+Inf"] == 6
    assert value(samples, "prazo_dependency_call_duration_seconds_sum", dependency="recommendations") == (
        pytest.approx(0.743, rel=1e-9)
    )
    assert buckets(samples, "prazo_dependency_call_duration_seconds", dependency="payments")["+Inf"] == 1


def test_a_dependency_before_any_call_exports_nan_quantiles(registry: CollectorRegistry) -> None:
    idle = Dependency("idle", max_concurrent=3, timeout_ms=50)
    register(idle, registry=registry)
    samples = scrape(registry)
    for quantile in ("0.5", "0.95", "0.99"):
        assert math.isnan(value(samples, "prazo_dependency_latency_seconds", dependency="idle", quantile=quantile))
    assert value(samples, "prazo_dependency_breaker_state", dependency="idle", state="disabled") == 1
    assert buckets(samples, "prazo_dependency_call_duration_seconds", dependency="idle")["+Inf"] == 0
    assert value(samples, "prazo_dependency_saturation", dependency="idle") == 0


# -- registration ---------------------------------------------------------------------


def test_odd_names_are_escaped_and_read_back_exactly(impl: QueueClass, registry: CollectorRegistry) -> None:
    names = ['say "hi"', "back\\slash", "new\nline", "prazo é ótimo ☂", "{queue}", "a,b=c"]
    queues = [impl(1, 0) for _ in names]
    collector = PrazoCollector(registry)
    for name, q in zip(names, queues):
        collector.add_queue(name, q)
    text = generate_latest(registry).decode()
    assert "\nnew\nline" not in text  # the newline is escaped, never a line break in the exposition
    assert label_values(parse(text), "queue") == set(names)


def test_a_collected_object_leaves_the_output(impl: QueueClass, fast_path: bool, registry: CollectorRegistry) -> None:
    collector = PrazoCollector(registry)
    q = impl(1, 0)
    mw = AdmissionMiddleware(service, max_concurrency=1, max_queue=0, fast_path=fast_path, record_latency=True)
    pool = AdmissionPool(1, 0)
    collector.add_queue("q", q)
    collector.add_middleware("mw", mw)
    collector.add_pool("pool", pool)
    assert Client(mw).get("/").status_code == 200
    assert pool.submit(int).result(10) == 0
    assert label_values(scrape(registry), "queue") == {"q", "mw", "pool"}
    del q, mw
    gc.collect()
    assert label_values(scrape(registry), "queue") == {"pool"}
    pool.shutdown()
    del pool
    gc.collect()
    assert scrape(registry) == {}
    assert collector.names() == {"queue": [], "dependency": []}


def test_a_collected_dependency_leaves_the_output(registry: CollectorRegistry) -> None:
    kept = Dependency("kept", max_concurrent=1, timeout_ms=100)
    dropped = Dependency("dropped", max_concurrent=1, timeout_ms=100)
    assert dropped.call(int) == 0  # its thread started, and now waits idle for the next call
    collector = register(kept, dropped, registry=registry)
    assert label_values(scrape(registry), "dependency") == {"kept", "dropped"}
    assert dropped.wait_idle(10)
    del dropped
    gc.collect()
    assert label_values(scrape(registry), "dependency") == {"kept"}
    assert collector.names()["dependency"] == ["kept"]
    with pytest.raises(TypeError):
        register(object(), registry=registry)  # type: ignore[arg-type]


def test_names_are_unique_among_live_objects(impl: QueueClass, registry: CollectorRegistry) -> None:
    collector = PrazoCollector(registry)
    first, second = impl(1, 0), impl(1, 0)
    collector.add_queue("jobs", first)
    collector.add_queue("jobs", first)  # the same object again: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        collector.add_queue("jobs", second)
    del first
    gc.collect()
    collector.add_queue("jobs", second)  # the name of a dead object is free again
    collector.remove("jobs")
    with pytest.raises(KeyError):
        collector.remove("jobs")
    with pytest.raises(TypeError):
        collector.add_queue("", second)
    with pytest.raises(TypeError):
        collector.add_queue("x", object())


def test_register_shares_one_collector_per_registry(impl: QueueClass, registry: CollectorRegistry) -> None:
    a, b = impl(1, 0), impl(1, 0)
    collector = register(a=a, registry=registry)
    assert register(b=b, registry=registry) is collector
    assert label_values(scrape(registry), "queue") == {"a", "b"}
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrazoCollector(registry)  # a second collector would export the same families


def test_server_embeddings_are_read_through_their_queue(registry: CollectorRegistry) -> None:
    """What each embedding's factory returns is registered as it is (waitress, werkzeug, cheroot)."""
    from _server_harness import app, request
    from prazo.bindings.servers import cheroot as prazo_cheroot
    from prazo.bindings.servers import waitress as prazo_waitress
    from prazo.bindings.servers import werkzeug as prazo_werkzeug

    limits = {"threads": 2, "max_queue": 2}
    waitress_server = prazo_waitress.create_server(app, host="127.0.0.1", port=0, **limits)
    werkzeug_server = prazo_werkzeug.make_server("127.0.0.1", 0, app, **limits)
    cheroot_server = prazo_cheroot.create_server(app, ("127.0.0.1", 0), **limits)
    cheroot_server.prepare()
    runs = [waitress_server.run, partial(werkzeug_server.serve_forever, **_POLL), cheroot_server.serve]
    threads = [threading.Thread(target=run, daemon=True) for run in runs]
    for thread in threads:
        thread.start()
    ports = {
        "waitress": waitress_server.effective_port,
        "werkzeug": werkzeug_server.server_address[1],
        "cheroot": cheroot_server.bind_addr[1],
    }
    servers = {"waitress": waitress_server, "werkzeug": werkzeug_server, "cheroot": cheroot_server}
    collector = PrazoCollector(registry)
    try:
        for name, server in servers.items():
            collector.add_server(name, server)
            assert request(ports[name], "/work").status == 200
        wait_until(
            lambda: all(value(scrape(registry), "prazo_queue_completed_total", queue=n) == 1 for n in servers),
            "every server to finish its request",
        )
        samples = scrape(registry)
    finally:
        prazo_waitress.shutdown(waitress_server, 10.0)
        werkzeug_server.shutdown()
        cheroot_server.stop()
        for thread in threads:
            thread.join(20)
    for name in servers:
        assert value(samples, "prazo_queue_offered_total", queue=name) == 1
        assert value(samples, "prazo_queue_max_concurrency", queue=name) == 2
        assert value(samples, "prazo_wsgi_refusals_total", queue=name, code="503") == 0
    assert value(samples, "prazo_server_pending_heads", queue="werkzeug") == 0
    assert value(samples, "prazo_server_header_timeouts_total", queue="cheroot") == 0
    assert ("prazo_server_pending_heads", frozenset({("queue", "waitress")})) not in samples


def test_the_front_door_is_read_like_any_admission_point(registry: CollectorRegistry) -> None:
    """``add_server`` takes the front door too: its stats carry every key of the queue's."""
    from _server_harness import app, request
    from prazo.bindings.servers.frontdoor import create_server

    server = create_server(app, host="127.0.0.1", port=0, threads=2, max_queue=3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    collector = PrazoCollector(registry)
    try:
        collector.add_server("front", server)
        assert request(server.port, "/work").status == 200
        wait_until(lambda: value(scrape(registry), "prazo_queue_completed_total", queue="front") == 1, "the request")
        samples = scrape(registry)
    finally:
        server.shutdown(10.0)
        thread.join(20)
    assert value(samples, "prazo_queue_offered_total", queue="front") == 1
    assert value(samples, "prazo_queue_peak_in_flight", queue="front") == 1
    assert value(samples, "prazo_queue_max_concurrency", queue="front") == 2
    assert value(samples, "prazo_queue_max_queue", queue="front") == 3
    assert value(samples, "prazo_queue_cancelled_total", queue="front") == 0
    # A kept-alive connection may be waiting for its next head: present, not necessarily 0.
    assert ("prazo_server_pending_heads", frozenset({("queue", "front")})) in samples


# -- concurrency ----------------------------------------------------------------------


def test_concurrent_scrapes_while_threads_hammer_the_queue(impl: QueueClass, registry: CollectorRegistry) -> None:
    q = impl(3, 4)
    collector = PrazoCollector(registry)
    collector.add_queue("hot", q)
    stop = threading.Event()
    errors: list[BaseException] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                with q.slot(Deadline.after(0.002)):
                    time.sleep(0.0005)
            except (QueueFull, DeadlineExceeded):
                pass
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    def churn() -> None:
        # Objects registered and dropped while scrapes run.
        number = 0
        while not stop.is_set():
            number += 1
            collector.add_queue(f"short-lived-{number % 5}", impl(1, 0))
            gc.collect()

    monotone = ("prazo_queue_offered_total", "prazo_queue_started_total", "prazo_queue_completed_total")
    scrapes: list[int] = []

    def scraper() -> None:
        previous: dict[str, float] = {}
        count = 0
        try:
            while not stop.is_set():
                samples = scrape(registry)
                for name in monotone:
                    now = value(samples, name, queue="hot")
                    assert now >= previous.get(name, 0), (name, previous.get(name), now)
                    previous[name] = now
                for reason in ("queue-full", "expired-on-arrival", "expired-in-queue"):
                    key = f"refused-{reason}"
                    now = value(samples, "prazo_queue_refused_total", queue="hot", reason=reason)
                    assert now >= previous.get(key, 0)
                    previous[key] = now
                in_flight = value(samples, "prazo_queue_in_flight", queue="hot")
                assert 0 <= in_flight <= 3
                assert 0 <= value(samples, "prazo_queue_queued", queue="hot") <= 4
                count += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        scrapes.append(count)

    threads = [threading.Thread(target=hammer) for _ in range(12)]
    threads += [threading.Thread(target=scraper) for _ in range(3)]
    threads.append(threading.Thread(target=churn))
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert not errors, errors
    assert all(count > 0 for count in scrapes), scrapes
    stats = q.stats()
    assert stats["offered"] > 100 and stats["rejected_full"] + stats["expired"] > 0, stats
    final = scrape(registry)
    assert value(final, "prazo_queue_offered_total", queue="hot") == stats["offered"]


# -- /metrics over a real socket, beside the admission queue ----------------------------


@pytest.fixture
def served() -> Iterator[Any]:
    servers: list[Any] = []

    def serve(app: Any) -> int:
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, kwargs=_POLL, daemon=True).start()
        servers.append(server)
        return int(server.server_port)

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_metrics_answer_while_every_slot_is_busy_and_the_queue_is_full(
    served: Any, fast_path: bool, registry: CollectorRegistry
) -> None:
    gate = threading.Event()

    def blocking(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        gate.wait(20)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done"]

    mw = AdmissionMiddleware(blocking, max_concurrency=2, max_queue=2, fast_path=fast_path, record_latency=True)
    register(api=mw, registry=registry)
    port = served(mount_metrics(mw, registry=registry))
    results: list[int] = []
    clients = [
        threading.Thread(target=lambda: results.append(get(port, "/work", {"X-Request-Budget-Ms": "20000"})[0]))
        for _ in range(4)
    ]
    for client in clients:
        client.start()
    wait_until(lambda: mw.stats()["in_flight"] == 2 and mw.stats()["queued"] == 2, "2 running and 2 waiting")
    assert get(port, "/work")[0] == 503  # the service itself is full

    status, body = get(port, "/metrics")
    assert status == 200
    samples = parse(body.decode())
    assert value(samples, "prazo_queue_in_flight", queue="api") == 2
    assert value(samples, "prazo_queue_queued", queue="api") == 2
    assert value(samples, "prazo_queue_saturation", queue="api") == 1.0
    assert value(samples, "prazo_queue_refused_total", queue="api", reason="queue-full") == 1
    assert value(samples, "prazo_wsgi_refusals_total", queue="api", code="503") == 1
    assert ("prazo_request_duration_seconds_count", frozenset({("queue", "api")})) in samples

    gate.set()
    for client in clients:
        client.join(20)
    assert results == [200] * 4
    samples = parse(get(port, "/metrics")[1].decode())
    assert value(samples, "prazo_request_duration_seconds_count", queue="api") == 4
    assert value(samples, "prazo_queue_offered_total", queue="api") == 5  # /metrics was never offered


def test_metrics_app_serves_openmetrics_too(served: Any, impl: QueueClass, registry: CollectorRegistry) -> None:
    q = impl(1, 0)
    register(jobs=q, registry=registry)
    port = served(prometheus.metrics_app(registry))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        response = conn.getresponse()
        body = response.read().decode()
    finally:
        conn.close()
    assert response.status == 200
    assert response.getheader("Content-Type", "").startswith("application/openmetrics-text")
    assert 'prazo_queue_max_concurrency{queue="jobs"} 1.0' in body
    assert body.endswith("# EOF\n")


def test_mount_metrics_passes_everything_else_through() -> None:
    calls: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        calls.append(environ["PATH_INFO"])
        start_response("200 OK", [])
        return [b"app"]

    mounted = mount_metrics(app, "/internal/metrics", registry=CollectorRegistry())
    client = Client(mounted)
    assert client.get("/internal/metrics").status_code == 200
    assert client.get("/metrics").get_data() == b"app"
    assert client.get("/internal/metrics/").get_data() == b"app"
    assert calls == ["/metrics", "/internal/metrics/"]
    with pytest.raises(ValueError):
        mount_metrics(app, "metrics")


# -- the optional dependency -----------------------------------------------------------


def test_without_prometheus_client_the_import_error_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "prometheus_client" or name.startswith("prometheus_client."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Block())
        import prazo.core, prazo.bindings.wsgi, prazo.bindings.pool  # none of them needs it
        try:
            import prazo.bindings.integrations.prometheus
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install 'prazo[metrics]'" in result.stdout, result.stdout + result.stderr


def test_the_core_and_other_bindings_never_import_prometheus_client() -> None:
    script = (
        "import sys, prazo.core, prazo.bindings.wsgi, prazo.bindings.pool, prazo.bindings.outgoing; "
        "print('prometheus_client' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"
    # prazo.core's own files, in the tree or in an installed wheel (which has no core/ folder beside the tests).
    sources = sorted(Path(prazo.core.__file__).parent.glob("*.py*"))
    assert any(path.name == "deadline.py" for path in sources), sources
    assert not [path.name for path in sources if "prometheus" in path.read_text()]


# -- the example alerting rules ----------------------------------------------------------


def exported_names(registry: CollectorRegistry) -> dict[str, str]:
    """Every sample name a scrape can show, mapped to its family's type."""
    return {
        sample.name: family.type
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def family_of(identifier: str, names: dict[str, str]) -> str:
    """The family behind a sample name: ``_bucket``/``_sum``/``_count`` only belong to histograms."""
    for suffix in ("_bucket", "_sum", "_count"):
        if identifier.endswith(suffix) and names.get(identifier) == "histogram":
            return identifier[: -len(suffix)]
    return identifier.removesuffix("_total") if names.get(identifier) == "counter" else identifier


def test_alert_rules_parse_and_use_only_exported_names(registry: CollectorRegistry) -> None:
    mw = AdmissionMiddleware(service, max_concurrency=1, max_queue=0, record_latency=True)
    pool = AdmissionPool(1, 0, record_latency=True)
    dependency = Dependency("recommendations", max_concurrent=2, timeout_ms=100, breaker=Breaker())
    try:
        register(dependency, api=mw, pool=pool, registry=registry)
        names = exported_names(registry)
    finally:
        pool.shutdown()
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in alerts} == {
        "PrazoServiceTailLatencyHigh",
        "PrazoDependencyTailLatencyHigh",
        "PrazoDependencySaturated",
    }
    for rule in alerts:
        expr = rule["expr"]
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert "for" in rule and rule["annotations"]["summary"]
        # Tail latency and saturation, never an average.
        assert not re.search(r"\bavg\w*\(", expr), expr
        assert "_sum" not in expr, expr
        identifiers = set(re.findall(r"\bprazo_[A-Za-z0-9_]+", expr))
        assert identifiers, expr
        for identifier in identifiers:
            assert identifier in names, f"{identifier} (in {rule['alert']}) is not exported"
            assert family_of(identifier, names) in METRIC_NAMES
        if "histogram_quantile" in expr:
            assert re.search(r"histogram_quantile\(\s*0\.99\s*,", expr), expr
            assert all(names.get(i) == "histogram" for i in identifiers if i.endswith("_bucket") and i in names), expr


# -- the docs' page (docs/how-to/metrics.md) ---------------------------------------------


def metrics_section() -> str:
    return (ROOT / "docs" / "how-to" / "metrics.md").read_text()


def test_the_recipe_runs_and_serves_metrics_beside_the_service() -> None:
    recipe = re.search(r"```python\n(.*?)```", metrics_section(), re.DOTALL)
    assert recipe is not None
    check = textwrap.dedent(
        """
        from werkzeug.test import Client
        client = Client(app)
        assert client.get("/").get_data() == b"hello\\n"
        assert recommendations.call(lambda: "recs") == "recs"
        assert thumbnails.submit(int).result(10) == 0
        response = client.get("/metrics")
        assert response.status_code == 200, response.status
        body = response.get_data(as_text=True)
        for line in (
            'prazo_queue_completed_total{queue="api"} 1.0',
            'prazo_request_duration_seconds_count{queue="api"} 1.0',
            'prazo_dependency_calls_total{dependency="recommendations",outcome="ok"} 1.0',
            'prazo_queue_offered_total{queue="thumbnails"} 1.0',
        ):
            assert line in body, line
        assert api.stats()["offered"] == 1  # the scrape never went through the admission queue
        thumbnails.shutdown()
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", recipe.group(1) + check],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.stdout.strip() == "ok", result.stdout + result.stderr


def retries_metrics_table() -> str:
    """The metrics table of the retries guide, which lists the retry families the metrics page does not."""
    guide = (ROOT / "docs" / "how-to" / "retries.md").read_text()
    start = guide.index("| metric | type |")
    return guide[start : guide.index("\n\n", start)]


def test_the_docs_tables_name_every_family() -> None:
    section = metrics_section()
    table = section[section.index("| metric | type |") : section.index("## Alerting")]
    rows = table.strip().splitlines()[2:] + retries_metrics_table().strip().splitlines()[2:]
    listed: set[str] = set()
    for row in rows:
        # "`prazo_queue_in_flight`, `_assigned`, ...": the short names continue the first one's prefix.
        names = re.findall(r"`([a-z_]+)`", row.split("|")[1])
        prefix = "_".join(names[0].split("_")[:2])
        listed.update(name if name.startswith("prazo_") else prefix + name for name in names)
    families = {name.removesuffix("_total") for name in listed}
    assert families == set(METRIC_NAMES), families ^ set(METRIC_NAMES)


def test_an_observing_middleware_exports_what_it_would_have_refused(registry: CollectorRegistry) -> None:
    gate = threading.Event()

    def held(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        gate.wait(10)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    middleware = AdmissionMiddleware(held, max_concurrency=1, max_queue=1, observe_only=True)
    PrazoCollector(registry).add_queue("api", middleware)
    statuses: list[str] = []

    def one() -> None:
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        b"".join(middleware(environ, lambda status, headers, exc_info=None: statuses.append(status)))

    clients = [threading.Thread(target=one) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        wait_until(lambda: middleware.stats()["offered"] == 4, "the shadow to decide the four arrivals")
        samples = scrape(registry)
    finally:
        gate.set()
        for client in clients:
            client.join(10)
    assert statuses == ["200 OK"] * 4
    assert value(samples, "prazo_queue_observe_only", queue="api") == 1.0
    assert value(samples, "prazo_queue_refused_total", queue="api", reason="queue-full") == 2.0
    assert value(samples, "prazo_wsgi_refusals_total", queue="api", code="503") == 0.0
