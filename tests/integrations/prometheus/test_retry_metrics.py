"""The retry counters in Prometheus and OpenTelemetry: a ``RetryPolicy`` registered by name, and a ``Dependency``'s own."""

from __future__ import annotations

import random

from _required import require
from prazo.bindings.dependency import Dependency
from prazo.bindings.integrations.prometheus import PrazoCollector
from prazo.bindings.retries import Failure, RetryBudget, RetryPolicy
from prazo.core import DownstreamOverloaded


def _exercised_policy() -> RetryPolicy:
    policy = RetryPolicy(budget=RetryBudget(percent=0.0, min_per_s=0.1), rng=random.Random(0), sleep=lambda s: None)
    budget = policy.start_call("b")
    assert policy.decide(Failure("overloaded", retry_after_s=0.0), 1, budget, idempotent=True).retry
    assert not policy.decide(Failure("overloaded"), 2, budget, idempotent=True).retry  # the 1-token reserve is spent
    return policy


def _exercised_dependency() -> Dependency:
    failures = [DownstreamOverloaded()]

    def fn() -> str:
        if failures:
            raise failures.pop()
        return "ok"

    dependency = Dependency("recs", max_concurrent=2, timeout_ms=2000, retry=RetryPolicy(sleep=lambda s: None))
    assert dependency.call(fn, idempotent=True) == "ok"
    dependency.wait_idle(10)
    return dependency


def test_prometheus_exports_a_policy_and_a_dependency() -> None:
    prometheus_client = require("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    collector = PrazoCollector(registry)
    policy = _exercised_policy()
    dependency = _exercised_dependency()
    collector.add_retry_policy("b", policy)
    collector.add_dependency(dependency)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }
    assert samples[("prazo_retry_calls_total", (("policy", "b"),))] == 1
    assert samples[("prazo_retry_retries_total", (("policy", "b"),))] == 1
    assert samples[("prazo_retry_retries_refused_by_budget_total", (("policy", "b"),))] == 1
    assert samples[("prazo_retry_retries_refused_by_deadline_total", (("policy", "b"),))] == 0
    assert samples[("prazo_retry_retry_after_honoured_total", (("policy", "b"),))] == 1
    assert samples[("prazo_dependency_retries_total", (("dependency", "recs"),))] == 1
    assert samples[("prazo_dependency_retries_refused_by_budget_total", (("dependency", "recs"),))] == 0
    assert collector.retry_policies() == [("b", policy)]
    collector.remove("b")
    assert collector.retry_policies() == []


def test_opentelemetry_names_them_beside_the_others() -> None:
    require("opentelemetry.sdk.metrics")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prazo.bindings.integrations.opentelemetry import PrazoMetrics

    reader = InMemoryMetricReader()
    otel = PrazoMetrics(meter_provider=MeterProvider(metric_readers=[reader]))
    policy = _exercised_policy()
    otel.add_retry_policy("b", policy)
    points = {
        (metric.name, tuple(sorted(point.attributes.items()))): point.value
        for resource in reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    }
    assert points[("prazo.retry.retries", (("prazo.retry.policy", "b"),))] == 1
    assert points[("prazo.retry.retries_refused_by_budget", (("prazo.retry.policy", "b"),))] == 1
