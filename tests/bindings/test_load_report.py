"""``LoadReport``: the ORCA ``endpoint-load-metrics`` header, its arithmetic on a fake clock, its cache, its formats.

The header is parsed back as a balancer reads it (``tests/support/_load_reports.py``):
the ``JSON`` form with ``json.loads``, the ``TEXT`` form as comma-separated
``name=value`` pairs after ``TEXT ``, each value a finite number.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import pytest
from _load_reports import parse, parse_text
from hypothesis import given
from hypothesis import strategies as st
from prazo.bindings.plumbing.load_report import (
    HEADER_NAME,
    REFUSAL_COUNTERS,
    LoadReport,
    LoadReportingStartResponse,
    optional_load_report,
)


class FakeClocks:
    """The wall clock and the CPU clock a test moves by hand."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0

    def report(self, stats: Any, format: str = "text", **options: Any) -> LoadReport:
        options.setdefault("cpus", 2)
        return LoadReport(stats, format, clock=lambda: self.wall, cpu_time=lambda: self.cpu, **options)


class Counters:
    """A ``stats()`` whose values a test sets, counting how often it was read."""

    def __init__(self, **values: int) -> None:
        self.values = {"in_flight": 0, "queued": 0, "completed": 0, "max_concurrency": 4, **values}
        self.reads = 0

    def __call__(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.values)


@pytest.mark.parametrize("format", ["text", "json"])
def test_the_first_report_has_no_rates_and_the_second_has_the_rates_over_the_interval(format: str) -> None:
    clocks, counters = FakeClocks(), Counters(in_flight=3, queued=5)
    report = clocks.report(counters, format)
    value = report.value()
    assert value is not None
    # One sample cannot make a rate: only what is true now.
    assert parse(value) == {"application_utilization": 0.75, "named_metrics.queue": 5}
    clocks.wall += 2.0
    clocks.cpu += 1.0
    counters.values.update(completed=40, rejected_full=6, expired_in_queue=2, in_flight=1, queued=0)
    value = report.value()
    assert value is not None
    assert parse(value) == {
        "application_utilization": 0.25,
        # 1 CPU second in 2 s of wall time, on 2 CPUs.
        "cpu_utilization": 0.25,
        # Every request answered per second: 40 completed and 8 refused, in 2 s.
        "rps_fractional": 24.0,
        "eps": 4.0,
        "named_metrics.queue": 0,
    }


def test_the_text_form_is_the_prefix_and_comma_separated_pairs_in_a_fixed_order() -> None:
    clocks, counters = FakeClocks(), Counters(in_flight=1)
    report = clocks.report(counters)
    report.value()
    clocks.wall += 1.0
    counters.values.update(completed=3, shed=1)
    assert report.value() == (
        "TEXT application_utilization=0.25, cpu_utilization=0, rps_fractional=4, eps=1, named_metrics.queue=0"
    )
    assert report.header() == (HEADER_NAME, report.value())


def test_the_json_form_nests_the_named_metrics() -> None:
    clocks = FakeClocks()
    value = clocks.report(Counters(in_flight=2, queued=7), "json").value()
    assert value is not None
    assert json.loads(value.removeprefix("JSON ")) == {"application_utilization": 0.5, "named_metrics": {"queue": 7}}


def test_every_refusal_reason_counts_as_an_error_and_expired_is_not_counted_twice() -> None:
    clocks, counters = FakeClocks(), Counters()
    report = clocks.report(counters)
    report.value()
    clocks.wall += 1.0
    counters.values.update(dict.fromkeys(REFUSAL_COUNTERS, 1))
    # The sum of expired_on_arrival and expired_in_queue, as the queue's stats() has it beside them.
    counters.values["expired"] = 2
    fields = parse_text(report.value() or "")
    assert fields["eps"] == len(REFUSAL_COUNTERS)
    assert fields["rps_fractional"] == len(REFUSAL_COUNTERS)


def test_the_value_is_computed_once_per_interval_and_reused_in_between() -> None:
    clocks, counters = FakeClocks(), Counters(in_flight=1)
    report = clocks.report(counters, interval_s=0.5)
    first = report.value()
    counters.values["in_flight"] = 4
    clocks.wall += 0.49
    assert report.value() == first
    assert counters.reads == 1
    clocks.wall += 0.01
    assert parse_text(report.value() or "")["application_utilization"] == 1.0
    assert counters.reads == 2
    # The rates cover the time since the previous refresh, however long it was.
    clocks.wall += 10.0
    counters.values["completed"] = 50
    assert parse_text(report.value() or "")["rps_fractional"] == 5.0


def test_the_limit_in_force_is_the_divisor_and_the_share_is_not_capped() -> None:
    clocks = FakeClocks()
    # A vegas limit lowered to 2 while 3 requests still run: the line is over its limit, and says so.
    value = clocks.report(Counters(in_flight=3, limit=2, max_concurrency=8)).value()
    assert parse_text(value or "")["application_utilization"] == 1.5
    # No limit to divide by: no utilization (a balancer then reads the CPU's).
    value = clocks.report(Counters(in_flight=3, max_concurrency=0)).value()
    assert "application_utilization" not in parse_text(value or "")


def test_counters_that_go_backwards_count_as_no_change_and_the_cpu_share_is_at_most_one() -> None:
    clocks, counters = FakeClocks(), Counters(completed=100, rejected_full=10)
    report = clocks.report(counters, cpus=1)
    report.value()
    clocks.wall += 1.0
    clocks.cpu += 3.0  # more CPU than one CPU has in a second: a coarse process clock
    counters.values.update(completed=5, rejected_full=0)
    fields = parse_text(report.value() or "")
    assert fields["rps_fractional"] == 0 and fields["eps"] == 0
    assert fields["cpu_utilization"] == 1.0


def test_a_failing_stats_keeps_the_last_value_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    clocks = FakeClocks()
    failing = [True]
    counters = Counters(in_flight=2)

    def stats() -> dict[str, int]:
        if failing[0]:
            raise RuntimeError("the host is not serving yet")
        return counters()

    report = clocks.report(stats)
    assert report.value() is None
    assert report.header() is None
    failing[0] = False
    clocks.wall += 1.0
    good = report.value()
    assert good is not None
    failing[0] = True
    clocks.wall += 1.0
    assert report.value() == good
    assert caplog.text.count("cannot read the counters") == 1


def test_start_response_adds_the_header_to_a_copy_and_passes_exc_info_on() -> None:
    clocks = FakeClocks()
    report = clocks.report(Counters(in_flight=1))
    calls: list[tuple[Any, ...]] = []
    shared_headers = [("Content-Type", "text/plain")]
    start_response = report.start_response(lambda *args: calls.append(args))
    assert isinstance(start_response, LoadReportingStartResponse)
    start_response("200 OK", shared_headers)
    start_response("500 Internal Server Error", shared_headers, ("exc", "info", None))
    assert shared_headers == [("Content-Type", "text/plain")]
    assert calls[0] == ("200 OK", [("Content-Type", "text/plain"), (HEADER_NAME, report.value())])
    assert calls[1][2] == ("exc", "info", None) and len(calls[1]) == 3
    # A response that reports its own load keeps its report: one per response.
    start_response("200 OK", [("Endpoint-Load-Metrics", "TEXT eps=0")])
    assert calls[2][1] == [("Endpoint-Load-Metrics", "TEXT eps=0")]


def test_wrong_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match="stats"):
        LoadReport(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="format"):
        LoadReport(dict, "xml")
    with pytest.raises(TypeError, match="format"):
        LoadReport(dict, 1)  # type: ignore[arg-type]
    for interval in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="interval_s"):
            LoadReport(dict, interval_s=interval)
    with pytest.raises(TypeError, match="interval_s"):
        LoadReport(dict, interval_s="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="interval_s"):
        LoadReport(dict, interval_s=True)
    with pytest.raises(TypeError, match="clock"):
        LoadReport(dict, clock=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpus"):
        LoadReport(dict, cpus=0)
    with pytest.raises(ValueError, match="load_report"):
        optional_load_report("TEXT", dict)
    assert optional_load_report(None, dict) is None


def test_concurrent_responses_refresh_once_per_interval_and_all_get_a_value() -> None:
    clocks, counters = FakeClocks(), Counters(in_flight=1)
    report = clocks.report(counters)
    report.value()
    clocks.wall += 1.0
    values: list[str | None] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def respond() -> None:
        start.wait(10)
        for _ in range(200):
            value = report.value()
            with lock:
                values.append(value)

    threads = [threading.Thread(target=respond) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # The clock stood still: one refresh at most after the first, however many threads raced to it.
    assert counters.reads == 2
    assert len(values) == 1600 and None not in values


counter = st.one_of(st.integers(-(2**63), 2**63), st.none(), st.booleans(), st.floats(), st.text(max_size=3))


@given(
    before=st.dictionaries(st.sampled_from(["in_flight", "queued", "completed", "limit", "max_concurrency",
                                            *REFUSAL_COUNTERS]), counter),
    after=st.dictionaries(st.sampled_from(["in_flight", "queued", "completed", "limit", "max_concurrency",
                                           *REFUSAL_COUNTERS]), counter),
    elapsed=st.floats(0, 1e6, allow_nan=False),
    cpu_elapsed=st.floats(-10, 1e6, allow_nan=False),
    format=st.sampled_from(["text", "json"]),
)  # fmt: skip
def test_whatever_the_stats_say_the_header_parses_and_every_value_is_finite_and_not_negative(
    before: dict[str, Any], after: dict[str, Any], elapsed: float, cpu_elapsed: float, format: str
) -> None:
    clocks = FakeClocks()
    seen = iter([before, after])
    report = clocks.report(lambda: next(seen), format, interval_s=1e-9)
    for moment in range(2):
        value = report.value()
        assert value is not None
        fields = parse(value)
        assert fields.keys() <= {
            "application_utilization", "cpu_utilization", "rps_fractional", "eps", "named_metrics.queue"
        }  # fmt: skip
        assert all(math.isfinite(number) and number >= 0 for number in fields.values()), value
        assert "named_metrics.queue" in fields
        assert fields.get("cpu_utilization", 0) <= 1
        if moment == 0:
            clocks.wall += elapsed + 1e-6
            clocks.cpu += cpu_elapsed
