"""Front-proxy queue time: ``X-Request-Start`` / ``X-Queue-Start`` parsing and the deadline it shortens."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.proxy_headers import (
    EARLIEST_STAMP_NS,
    LATEST_STAMP_NS,
    FrontProxyBudgetPolicy,
    parse_request_start_ns,
    upstream_wait_ns,
)
from prazo.core import NS_PER_MS

NOW_WALL_NS = 1_700_000_000_000_000_000  # 2023-11-14T22:13:20Z
NOW_MONO_NS = 5_000 * NS_PER_MS


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("t=1700000000.123", 1_700_000_000_123_000_000),  # nginx t=${msec}: seconds with a fraction
        ("1700000000", 1_700_000_000_000_000_000),  # seconds
        ("t=1700000000123", 1_700_000_000_123_000_000),  # Heroku: milliseconds
        ("1700000000123.5", 1_700_000_000_123_500_000),  # milliseconds with a fraction
        ("1700000000123456", 1_700_000_000_123_456_000),  # Apache %t: microseconds
        ("1700000000123456789", 1_700_000_000_123_456_789),  # nanoseconds
        (" \tt=1700000000.5 ", 1_700_000_000_500_000_000),  # optional whitespace around the value
        ("1700000000.123456789", 1_700_000_000_123_456_789),  # nanosecond precision of seconds
        ("", None),
        ("t=", None),
        ("soon", None),
        ("-1700000000", None),
        ("+1700000000", None),
        ("1.7e9", None),
        ("nan", None),
        ("inf", None),
        ("0", None),
        ("t=0.000", None),
        ("1700000000.1234567891", None),  # finer than a nanosecond
        ("1700000000123456789.5", None),  # a fraction of a nanosecond
        ("123456789012345678901", None),  # beyond any plausible unit
        ("1700000000, 1700000001", None),  # two stamps joined by a proxy chain
        ("t=t=1700000000", None),
        ("T=1700000000", None),
        ("\u0661\u0667\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660", None),  # Arabic-Indic digits
        ("1700000000\n", None),
        ("1" * 41, None),
    ],
)
def test_parse_request_start_table(value: str, expected: int | None) -> None:
    assert parse_request_start_ns(value) == expected


def test_parse_request_start_rejects_non_strings() -> None:
    assert parse_request_start_ns(None) is None
    assert parse_request_start_ns(1700000000) is None
    assert parse_request_start_ns(b"1700000000") is None


_EARLIEST_S = EARLIEST_STAMP_NS // 1_000_000_000  # 2000-01-01T00:00:00Z
_LATEST_S = LATEST_STAMP_NS // 1_000_000_000  # 2100-01-01T00:00:00Z


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", None),  # one second after 1970, not a clock
        ("t=1", None),
        ("999", None),  # milliseconds? seconds? either way 1970
        ("12345678", None),
        (str(_EARLIEST_S - 1), None),
        (str(_EARLIEST_S), EARLIEST_STAMP_NS),
        (f"t={_EARLIEST_S - 1}.999999999", None),
        (f"{_EARLIEST_S * 1000 - 1}", None),  # ms
        (f"{_EARLIEST_S * 1000}", EARLIEST_STAMP_NS),
        (f"{_EARLIEST_S * 10**6 - 1}", None),  # µs
        (f"{_EARLIEST_S * 10**6}", EARLIEST_STAMP_NS),
        (f"{EARLIEST_STAMP_NS - 1}", None),  # ns
        (f"{EARLIEST_STAMP_NS}", EARLIEST_STAMP_NS),
        (str(_LATEST_S - 1), LATEST_STAMP_NS - 1_000_000_000),
        (f"t={_LATEST_S - 1}.999999999", LATEST_STAMP_NS - 1),
        (str(_LATEST_S), None),
        (f"{_LATEST_S * 1000 - 1}", LATEST_STAMP_NS - 1_000_000),
        (f"{_LATEST_S * 1000}", None),
        (f"{_LATEST_S * 10**6 - 1}", LATEST_STAMP_NS - 1_000),
        (f"{_LATEST_S * 10**6}", None),
        (f"{LATEST_STAMP_NS - 1}", LATEST_STAMP_NS - 1),
        (f"{LATEST_STAMP_NS}", None),
        ("99999999999", None),  # the largest "seconds": year 5138
        ("9" * 19, None),  # the largest "nanoseconds": year 2286
    ],
)
def test_stamps_outside_2000_to_2100_are_rejected_in_every_unit(value: str, expected: int | None) -> None:
    assert parse_request_start_ns(value) == expected


def test_an_absurd_stamp_does_not_shorten_a_real_deadline() -> None:
    """With the real clocks, "1" once read as 1970 and cost every request the whole cap."""
    policy = FrontProxyBudgetPolicy(1000, 30000, max_upstream_ms=900)
    arrival = time.monotonic_ns()
    for stamp in ("1", "t=1", "1000", "4102444800"):
        deadline, _ = policy.deadline_for({"HTTP_X_REQUEST_START": stamp}, arrival)
        assert deadline.ns == arrival + 1000 * NS_PER_MS, stamp


@given(st.text(max_size=60))
def test_parsing_arbitrary_text_never_raises(value: str) -> None:
    result = parse_request_start_ns(value)
    assert result is None or EARLIEST_STAMP_NS <= result < LATEST_STAMP_NS


@pytest.mark.parametrize(
    ("start_ns", "arrival_ns", "cap_ns", "expected"),
    [
        (100, 350, 1_000, 250),
        (400, 350, 1_000, 0),  # stamped after our arrival: proxy clock ahead, ignored
        (0, 5_000, 1_000, 1_000),  # capped
        (0, 5_000, 0, 0),
    ],
)
def test_upstream_wait_is_clamped_to_zero_and_the_cap(
    start_ns: int, arrival_ns: int, cap_ns: int, expected: int
) -> None:
    assert upstream_wait_ns(start_ns, arrival_ns, cap_ns) == expected


def _policy(**kwargs: object) -> FrontProxyBudgetPolicy:
    return FrontProxyBudgetPolicy(
        1000,
        30000,
        wall_clock_ns=lambda: NOW_WALL_NS,
        monotonic_ns=lambda: NOW_MONO_NS,
        **kwargs,  # type: ignore[arg-type]
    )


def _stamp_ms_before_now(ms: float) -> str:
    return f"t={(NOW_WALL_NS - int(ms * NS_PER_MS)) // NS_PER_MS}"


def test_time_queued_in_the_proxy_comes_off_the_budget() -> None:
    policy = _policy()
    environ = {"HTTP_X_REQUEST_START": _stamp_ms_before_now(250), "HTTP_X_REQUEST_BUDGET_MS": "800"}
    deadline, _ = policy.deadline_for(environ, NOW_MONO_NS)
    assert deadline.ns == NOW_MONO_NS + 550 * NS_PER_MS


def test_the_wait_is_measured_up_to_the_arrival_not_up_to_now() -> None:
    """Parsed 100 ms after arrival (as a server does after reading the body): those 100 ms are not proxy time."""
    policy = _policy()
    arrival = NOW_MONO_NS - 100 * NS_PER_MS
    environ = {"HTTP_X_QUEUE_START": _stamp_ms_before_now(350)}
    deadline, _ = policy.deadline_for(environ, arrival)
    assert deadline.ns == arrival + (1000 - 250) * NS_PER_MS


def test_future_stamps_invalid_stamps_and_the_cap() -> None:
    policy = _policy(max_upstream_ms=300)
    plain = NOW_MONO_NS + 1000 * NS_PER_MS
    assert policy.deadline_for({"HTTP_X_REQUEST_START": _stamp_ms_before_now(-500)}, NOW_MONO_NS)[0].ns == plain
    assert policy.deadline_for({"HTTP_X_REQUEST_START": "yesterday"}, NOW_MONO_NS)[0].ns == plain
    skewed = policy.deadline_for({"HTTP_X_REQUEST_START": _stamp_ms_before_now(60_000)}, NOW_MONO_NS)[0]
    assert skewed.ns == plain - 300 * NS_PER_MS


def test_the_earliest_of_both_headers_counts() -> None:
    environ = {"HTTP_X_REQUEST_START": _stamp_ms_before_now(100), "HTTP_X_QUEUE_START": _stamp_ms_before_now(400)}
    assert _policy().deadline_for(environ, NOW_MONO_NS)[0].ns == NOW_MONO_NS + 600 * NS_PER_MS


def test_only_trusted_peers_get_the_correction() -> None:
    policy = _policy(trusted_proxies=["10.0.0.0/8", "::1"])
    stamp = {"HTTP_X_REQUEST_START": _stamp_ms_before_now(400)}
    shortened = NOW_MONO_NS + 600 * NS_PER_MS
    plain = NOW_MONO_NS + 1000 * NS_PER_MS
    assert policy.deadline_for({**stamp, "REMOTE_ADDR": "10.1.2.3"}, NOW_MONO_NS)[0].ns == shortened
    assert policy.deadline_for({**stamp, "REMOTE_ADDR": "::1"}, NOW_MONO_NS)[0].ns == shortened
    assert policy.deadline_for({**stamp, "REMOTE_ADDR": "192.0.2.1"}, NOW_MONO_NS)[0].ns == plain
    assert policy.deadline_for({**stamp, "REMOTE_ADDR": "not-an-ip"}, NOW_MONO_NS)[0].ns == plain
    assert policy.deadline_for(stamp, NOW_MONO_NS)[0].ns == plain


def test_an_ipv4_peer_seen_by_a_dual_stack_listener_is_matched_against_ipv4_networks() -> None:
    policy = _policy(trusted_proxies=["10.0.0.0/8"])
    stamp = {"HTTP_X_REQUEST_START": _stamp_ms_before_now(400)}
    shortened = NOW_MONO_NS + 600 * NS_PER_MS
    plain = NOW_MONO_NS + 1000 * NS_PER_MS
    assert policy.deadline_for({**stamp, "REMOTE_ADDR": "::ffff:10.0.0.1"}, NOW_MONO_NS)[0].ns == shortened
    assert policy.deadline_for({**stamp, "REMOTE_ADDR": "::ffff:192.0.2.1"}, NOW_MONO_NS)[0].ns == plain


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"trusted_proxies": "10.0.0.1"}, TypeError),
        ({"trusted_proxies": ["10.0.0.300"]}, ValueError),
        ({"trusted_proxies": [10]}, TypeError),
        ({"max_upstream_ms": -1}, ValueError),
        ({"max_upstream_ms": float("nan")}, ValueError),
        ({"max_upstream_ms": "5"}, TypeError),
        ({"wall_clock_ns": 5}, TypeError),
    ],
)
def test_bad_policy_arguments_name_the_argument(kwargs: dict, error: type) -> None:
    with pytest.raises(error, match=next(iter(kwargs)).split("_ns")[0]):
        FrontProxyBudgetPolicy(1000, 30000, **kwargs)


@given(
    request_start=st.one_of(st.none(), st.text(max_size=30), st.integers(0, 10**20).map(str)),
    queue_start=st.one_of(st.none(), st.text(max_size=30), st.integers(0, 10**20).map(lambda n: f"t={n}")),
    budget=st.one_of(st.none(), st.integers(-10, 100_000).map(str)),
    arrival_offset_ms=st.integers(-10_000, 10_000),
)
def test_the_correction_never_raises_never_extends_and_never_exceeds_the_cap(
    request_start: str | None, queue_start: str | None, budget: str | None, arrival_offset_ms: int
) -> None:
    environ = {
        key: value
        for key, value in (
            ("HTTP_X_REQUEST_START", request_start),
            ("HTTP_X_QUEUE_START", queue_start),
            ("HTTP_X_REQUEST_BUDGET_MS", budget),
        )
        if value is not None
    }
    arrival = NOW_MONO_NS + arrival_offset_ms * NS_PER_MS
    corrected, _ = _policy(max_upstream_ms=2000).deadline_for(environ, arrival)
    plain, _ = BudgetPolicy(1000, 30000).deadline_for(environ, arrival)
    assert plain.ns - 2000 * NS_PER_MS <= corrected.ns <= plain.ns
    assert corrected.ns >= arrival or plain.ns <= arrival


def test_a_real_server_deducts_the_proxy_queue_time(tmp_path: Path) -> None:
    """waitress with ``trust_request_start``: the app sees the budget minus the time stamped by the proxy."""
    import threading

    from _server_harness import request
    from prazo.bindings.servers.settings import resolve_settings
    from prazo.bindings.servers.waitress import create_server, shutdown

    def app(environ: dict, start_response: object) -> list:
        body = f"{environ['prazo.deadline'].remaining_ms():.0f}".encode()
        start_response("200 OK", [("Content-Length", str(len(body)))])  # type: ignore[operator]
        return [body]

    settings = resolve_settings(threads=1, max_queue=1, trust_request_start=True, environ={})
    server = create_server(app, host="127.0.0.1", port=0, settings=settings)
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    try:
        # 3 s in the proxy's queue: with a 10 s budget, the app sees at most 7 s left; without
        # the stamp nothing is taken off, and a loaded machine has 3 s to reach the app.
        stamp = f"t={(time.time_ns() - 3000 * NS_PER_MS) / 1e9:.6f}"
        headers = {"X-Request-Start": stamp, "X-Request-Budget-Ms": "10000"}
        assert 0 < int(request(server.effective_port, "/", headers=headers).body) <= 7000
        assert 7000 < int(request(server.effective_port, "/", headers={"X-Request-Budget-Ms": "10000"}).body) <= 10000
    finally:
        shutdown(server, 5.0)
        runner.join(10)
