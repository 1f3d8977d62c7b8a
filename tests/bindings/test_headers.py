"""Wire formats of a time budget: parsing, policy and outgoing formatting."""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prazo.bindings.headers import (
    BUDGET_ENVIRON_KEY,
    BUDGET_HEADER,
    ENVOY_TIMEOUT_ENVIRON_KEY,
    ENVOY_TIMEOUT_HEADER,
    GRPC_TIMEOUT_ENVIRON_KEY,
    GRPC_TIMEOUT_HEADER,
    MAX_WIRE_MS,
    BudgetPolicy,
    IncomingBudget,
    budget_from_environ,
    budget_from_headers,
    environ_key,
    format_budget_ms,
    format_grpc_timeout,
    outgoing_headers_for,
    parse_budget_ms,
    parse_envoy_timeout_ms,
    parse_grpc_timeout,
)
from prazo.core import NS_PER_MS, Deadline

PARSERS = [parse_budget_ms, parse_grpc_timeout, parse_envoy_timeout_ms]
ARRIVAL_NS = 10**12  # an arbitrary monotonic arrival time for the fake clock

# Rejected by every parser.
INVALID_EVERYWHERE = [
    "",
    " ",
    "abc",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "1e3",
    "0x10",
    "1_000",
    "+5",
    "1 0",
    "10\n",
    "\n10",
    "10\r",
    "\u00a010",  # no-break space is not HTTP whitespace
    "\u0661\u0662",  # Arabic-Indic digits
    "\uff11\uff12",  # full-width digits
    "1,2",
    "10;q=1",
    "1" * 41,
    "9" * 30,
]


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("value", INVALID_EVERYWHERE)
def test_invalid_everywhere(parse, value):
    assert parse(value) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0.0),
        ("250", 250.0),
        ("12.5", 12.5),
        ("0.001", 0.001),
        ("-3", -3.0),
        ("-0", 0.0),
        (" 250\t", 250.0),
        ("007", 7.0),
        (str(MAX_WIRE_MS), float(MAX_WIRE_MS)),
        # invalid
        ("250ms", None),
        ("2S", None),
        (".5", None),
        ("5.", None),
        ("--5", None),
        ("5-", None),
        (str(MAX_WIRE_MS + 1), None),
        ("-" + str(MAX_WIRE_MS + 1), None),
    ],
)
def test_parse_budget_ms(value, expected):
    assert parse_budget_ms(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0.0),
        ("30000", 30000.0),
        (" 15000 ", 15000.0),
        # invalid: envoy only ever sends a non-negative integer of ms
        ("-1", None),
        ("1.5", None),
        ("100ms", None),
        (str(MAX_WIRE_MS + 1), None),
    ],
)
def test_parse_envoy_timeout_ms(value, expected):
    assert parse_envoy_timeout_ms(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1H", 3_600_000.0),
        ("2M", 120_000.0),
        ("3S", 3000.0),
        ("250m", 250.0),
        ("1500u", 1.5),
        ("2500000n", 2.5),
        ("0n", 0.0),
        ("0S", 0.0),
        ("99999999H", 99_999_999 * 3_600_000.0),
        ("00000001S", 1000.0),
        (" 5S ", 5000.0),
        # invalid
        ("123456789m", None),  # 9 digits
        ("5", None),  # no unit
        ("S", None),  # no digits
        ("5s", None),  # units are case-sensitive
        ("5ms", None),
        ("5SS", None),
        ("1.5S", None),
        ("-1S", None),
        ("+1S", None),
        ("5 S", None),
        ("5µ", None),
        ("\u0665S", None),
    ],
)
def test_parse_grpc_timeout(value, expected):
    assert parse_grpc_timeout(value) == expected


@given(st.text())
@example("1" * 10_000)
def test_parsing_arbitrary_text_never_raises(value):
    for parse in PARSERS:
        result = parse(value)
        assert result is None or (isinstance(result, float) and math.isfinite(result))


@given(st.text(alphabet="0123456789.-+ \t\neEinfaHMSmun_", max_size=20))
def test_parsing_near_miss_text_never_raises(value):
    for parse in PARSERS:
        result = parse(value)
        assert result is None or abs(result) <= 99_999_999 * 3_600_000


@pytest.mark.parametrize("value", [None, b"100", 100, 1.5])
def test_parsers_return_none_for_non_strings(value):
    for parse in PARSERS:
        assert parse(value) is None


def test_environ_keys():
    assert BUDGET_ENVIRON_KEY == "HTTP_X_REQUEST_BUDGET_MS"
    assert GRPC_TIMEOUT_ENVIRON_KEY == "HTTP_GRPC_TIMEOUT"
    assert ENVOY_TIMEOUT_ENVIRON_KEY == "HTTP_X_ENVOY_EXPECTED_RQ_TIMEOUT_MS"
    assert environ_key("X-Prazo-Reason") == "HTTP_X_PRAZO_REASON"


# (budget header, grpc-timeout, envoy header) -> expected IncomingBudget
INCOMING_CASES = [
    ((None, None, None), IncomingBudget(None, 0, None)),
    (("300", None, None), IncomingBudget(300.0, 0, BUDGET_HEADER)),
    ((None, "2S", None), IncomingBudget(2000.0, 0, GRPC_TIMEOUT_HEADER)),
    ((None, None, "700"), IncomingBudget(700.0, 0, ENVOY_TIMEOUT_HEADER)),
    (("300", "200m", "700"), IncomingBudget(200.0, 0, GRPC_TIMEOUT_HEADER)),
    (("300", "2S", "100"), IncomingBudget(100.0, 0, ENVOY_TIMEOUT_HEADER)),
    (("abc", "2S", None), IncomingBudget(2000.0, 1, GRPC_TIMEOUT_HEADER)),
    (("abc", "2s", "x"), IncomingBudget(None, 3, None)),
    (("", None, None), IncomingBudget(None, 1, None)),
    (("-5", "2S", None), IncomingBudget(-5.0, 0, BUDGET_HEADER)),
    (("0", None, "0"), IncomingBudget(0.0, 0, BUDGET_HEADER)),
]


@pytest.mark.parametrize(("values", "expected"), INCOMING_CASES)
def test_budget_from_environ_and_headers_agree(values, expected):
    names = (BUDGET_HEADER, GRPC_TIMEOUT_HEADER, ENVOY_TIMEOUT_HEADER)
    keys = (BUDGET_ENVIRON_KEY, GRPC_TIMEOUT_ENVIRON_KEY, ENVOY_TIMEOUT_ENVIRON_KEY)
    environ = {key: value for key, value in zip(keys, values) if value is not None}
    headers = {name.upper(): value for name, value in zip(names, values) if value is not None}
    assert budget_from_environ(environ) == expected
    assert budget_from_headers(headers) == expected


def test_budget_from_headers_is_case_insensitive_and_joins_repeats():
    assert budget_from_headers({"x-REQUEST-budget-MS": "40"}) == IncomingBudget(40.0, 0, BUDGET_HEADER)
    # Two spellings of one header: joined like a WSGI server would; the smaller counts.
    repeated = {"X-Request-Budget-Ms": "50", "x-request-budget-ms": "40"}
    assert budget_from_headers(repeated) == IncomingBudget(40.0, 0, BUDGET_HEADER)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("200, 179", IncomingBudget(179.0, 0, BUDGET_HEADER)),
        ("200,179,5000", IncomingBudget(179.0, 0, BUDGET_HEADER)),
        ("junk, 250", IncomingBudget(250.0, 1, BUDGET_HEADER)),
        ("250, ", IncomingBudget(250.0, 1, BUDGET_HEADER)),
        ("junk, nan", IncomingBudget(None, 1, None)),
        (",", IncomingBudget(None, 1, None)),
    ],
)
def test_a_repeated_budget_header_is_bounded_by_its_smallest_valid_element(value, expected):
    # Falling back to the default here would let a duplicate extend the deadline.
    assert budget_from_environ({BUDGET_ENVIRON_KEY: value}) == expected
    policy = BudgetPolicy(default_budget_ms=5000, max_budget_ms=30000)
    assert policy.budget_ms_for(budget_from_environ({BUDGET_ENVIRON_KEY: value})) <= 5000
    if expected.budget_ms is not None:
        assert policy.budget_ms_for(budget_from_environ({BUDGET_ENVIRON_KEY: value})) == expected.budget_ms


def test_budget_from_headers_accepts_http_message():
    import email.message

    message = email.message.Message()
    message["Grpc-Timeout"] = "150m"
    message["Content-Type"] = "text/plain"
    assert budget_from_headers(message) == IncomingBudget(150.0, 0, GRPC_TIMEOUT_HEADER)


def test_non_string_environ_value_counts_as_invalid():
    assert budget_from_environ({BUDGET_ENVIRON_KEY: b"100"}) == IncomingBudget(None, 1, None)


# -- policy ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"default_budget_ms": 0}, ValueError, "default_budget_ms"),
        ({"default_budget_ms": -1}, ValueError, "default_budget_ms"),
        ({"default_budget_ms": float("nan")}, ValueError, "default_budget_ms"),
        ({"default_budget_ms": float("inf")}, ValueError, "default_budget_ms"),
        ({"default_budget_ms": "1000"}, TypeError, "default_budget_ms"),
        ({"default_budget_ms": True}, TypeError, "default_budget_ms"),
        ({"default_budget_ms": None}, TypeError, "default_budget_ms"),
        ({"max_budget_ms": 0}, ValueError, "max_budget_ms"),
        ({"max_budget_ms": float("nan")}, ValueError, "max_budget_ms"),
        ({"max_budget_ms": float("-inf")}, ValueError, "max_budget_ms"),
        ({"max_budget_ms": MAX_WIRE_MS * 2}, ValueError, "max_budget_ms"),
        ({"max_budget_ms": [1]}, TypeError, "max_budget_ms"),
    ],
)
def test_policy_validation(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        BudgetPolicy(**kwargs)


def test_default_above_max_is_capped():
    deadline, _ = BudgetPolicy(default_budget_ms=5000, max_budget_ms=100).deadline_for({}, ARRIVAL_NS)
    assert deadline.ns == ARRIVAL_NS + 100 * NS_PER_MS


def test_policy_accepts_fractions_and_exposes_values():
    policy = BudgetPolicy(default_budget_ms=Fraction(1, 2), max_budget_ms=2)
    assert (policy.default_budget_ms, policy.max_budget_ms) == (0.5, 2.0)
    assert "max_budget_ms=2.0" in repr(policy)


@pytest.mark.parametrize(
    ("environ", "budget_ms", "invalid", "source"),
    [
        ({}, 1000, 0, None),
        ({BUDGET_ENVIRON_KEY: "250"}, 250, 0, BUDGET_HEADER),
        ({BUDGET_ENVIRON_KEY: "250.75"}, 250.75, 0, BUDGET_HEADER),
        # A client may shorten its deadline, never extend the server's policy.
        ({BUDGET_ENVIRON_KEY: "999999"}, 30000, 0, BUDGET_HEADER),
        ({GRPC_TIMEOUT_ENVIRON_KEY: "1H"}, 30000, 0, GRPC_TIMEOUT_HEADER),
        # Invalid headers fall back to the default, never beyond it.
        ({BUDGET_ENVIRON_KEY: "banana"}, 1000, 1, None),
        ({BUDGET_ENVIRON_KEY: "inf", ENVOY_TIMEOUT_ENVIRON_KEY: "nan"}, 1000, 2, None),
        ({BUDGET_ENVIRON_KEY: "banana", ENVOY_TIMEOUT_ENVIRON_KEY: "40"}, 40, 1, ENVOY_TIMEOUT_HEADER),
        # No time left: the deadline is the arrival itself, already passed.
        ({BUDGET_ENVIRON_KEY: "0"}, 0, 0, BUDGET_HEADER),
        ({BUDGET_ENVIRON_KEY: "-500"}, 0, 0, BUDGET_HEADER),
        ({GRPC_TIMEOUT_ENVIRON_KEY: "0n"}, 0, 0, GRPC_TIMEOUT_HEADER),
    ],
)
def test_deadline_for(environ, budget_ms, invalid, source):
    policy = BudgetPolicy(default_budget_ms=1000, max_budget_ms=30000)
    deadline, incoming = policy.deadline_for(environ, ARRIVAL_NS)
    assert isinstance(deadline, Deadline)
    assert deadline.ns == ARRIVAL_NS + int(budget_ms * NS_PER_MS)
    assert (incoming.invalid, incoming.source) == (invalid, source)


def test_zero_budget_is_expired_at_arrival():
    deadline, _ = BudgetPolicy().deadline_for({BUDGET_ENVIRON_KEY: "0"}, ARRIVAL_NS)
    assert deadline.expired(now_ns=ARRIVAL_NS)


def test_deadline_for_validates_arrival():
    policy = BudgetPolicy()
    for bad in (1.5, "1", None, True):
        with pytest.raises(TypeError, match="arrival_ns"):
            policy.deadline_for({}, bad)


def test_deadline_now_uses_the_monotonic_clock():
    import time

    before = time.monotonic_ns()
    deadline, _ = BudgetPolicy(default_budget_ms=500).deadline_now({})
    after = time.monotonic_ns()
    assert before + 500 * NS_PER_MS <= deadline.ns <= after + 500 * NS_PER_MS


class _ProxyQueuedPolicy(BudgetPolicy):
    def __init__(self, waited_ns, **kwargs):
        super().__init__(**kwargs)
        self.waited_ns = waited_ns

    def upstream_queue_ns(self, environ, arrival_ns):
        return self.waited_ns


@pytest.mark.parametrize(
    ("waited_ms", "expected_budget_ms"),
    [(0, 1000), (300, 700), (5000, 0), (-400, 1000)],
)
def test_upstream_queue_hook_only_shortens(waited_ms, expected_budget_ms):
    policy = _ProxyQueuedPolicy(waited_ms * NS_PER_MS, default_budget_ms=1000)
    deadline, _ = policy.deadline_for({}, ARRIVAL_NS)
    assert deadline.ns == ARRIVAL_NS + expected_budget_ms * NS_PER_MS


INCOMING_ENVIRON_KEYS = [BUDGET_ENVIRON_KEY, GRPC_TIMEOUT_ENVIRON_KEY, ENVOY_TIMEOUT_ENVIRON_KEY]
HEADER_VALUES = st.one_of(
    st.text(max_size=30),
    st.from_regex(r"\A-?[0-9]{1,16}(\.[0-9]{1,6})?\Z"),
    st.from_regex(r"\A[0-9]{1,9}[HMSmun]\Z"),
)


@given(
    environ=st.dictionaries(st.sampled_from(INCOMING_ENVIRON_KEYS), HEADER_VALUES),
    default_ms=st.integers(1, 60_000),
    max_ms=st.integers(1, 60_000),
    arrival_ns=st.integers(0, 2**62),
)
def test_policy_never_exceeds_max_budget(environ, default_ms, max_ms, arrival_ns):
    policy = BudgetPolicy(default_budget_ms=default_ms, max_budget_ms=max_ms)
    deadline, incoming = policy.deadline_for(environ, arrival_ns)
    assert arrival_ns <= deadline.ns <= arrival_ns + max_ms * NS_PER_MS
    if incoming.budget_ms is None:
        # Nothing valid: exactly the default, however many headers were junk.
        assert deadline.ns == arrival_ns + min(default_ms, max_ms) * NS_PER_MS
    else:
        # The budget is a float: compare the budget itself, since float(arrival) + budget rounds above 2**53.
        assert deadline.ns - arrival_ns <= max(incoming.budget_ms, 0) * NS_PER_MS
    assert 0 <= incoming.invalid <= len(environ)


# -- outgoing -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ms", "expected"),
    [
        (0, "0"),
        (-5, "0"),
        (float("-inf"), "0"),
        (0.999, "0"),
        (1, "1"),
        (1234.9, "1234"),
        (Fraction(7, 2), "3"),
        (1e300, str(MAX_WIRE_MS)),
    ],
)
def test_format_budget_ms(ms, expected):
    assert format_budget_ms(ms) == expected


@pytest.mark.parametrize(
    ("ms", "expected"),
    [
        (0, "0n"),
        (-1, "0n"),
        (0.0005, "500n"),
        (1.5, "1500000n"),
        (99.999999, "99999999n"),
        (100, "100000u"),
        (1234.9, "1234900u"),
        (99_999.9995, "99999999u"),
        (100_000, "100000m"),
        (99_999_999, "99999999m"),
        (100_000_000, "100000S"),
        (99_999_999_000, "99999999S"),
        (100_000_000_000, "1666666M"),
        (6_000_000_000_000, "1666666H"),
        (1e300, "99999999H"),
    ],
)
def test_format_grpc_timeout(ms, expected):
    assert format_grpc_timeout(ms) == expected


@pytest.mark.parametrize("formatter", [format_budget_ms, format_grpc_timeout])
@pytest.mark.parametrize(
    ("value", "error"),
    [(float("nan"), ValueError), (float("inf"), ValueError), ("10", TypeError), (None, TypeError), (True, TypeError)],
)
def test_format_rejects_bad_input(formatter, value, error):
    with pytest.raises(error, match="ms"):
        formatter(value)


_GRPC_UNIT_MS = {"n": 1e-6, "u": 1e-3, "m": 1.0, "S": 1e3, "M": 6e4, "H": 3.6e6}


@given(st.floats(min_value=0, max_value=99_999_999 * 3_600_000.0, allow_nan=False))
@example(99.999)
@example(0.1)
@example(1e-7)
def test_grpc_format_parse_round_trip(ms):
    text = format_grpc_timeout(ms)
    assert len(text) <= 9
    parsed = parse_grpc_timeout(text)
    assert parsed is not None
    assert parsed <= ms
    # Within one unit of the unit chosen, which is the most precise that fits.
    unit_ms = _GRPC_UNIT_MS[text[-1]]
    assert ms - parsed < unit_ms * (1 + 1e-9)


@given(st.floats(min_value=0, max_value=float(MAX_WIRE_MS), allow_nan=False))
@example(0.999999)
def test_budget_format_parse_round_trip(ms):
    parsed = parse_budget_ms(format_budget_ms(ms))
    assert parsed is not None
    assert parsed <= ms
    assert ms - parsed < 1


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_formatted_values_always_parse(ms):
    assert parse_budget_ms(format_budget_ms(ms)) is not None
    assert parse_grpc_timeout(format_grpc_timeout(ms)) is not None


def test_outgoing_headers_for():
    assert outgoing_headers_for(1234.9) == {BUDGET_HEADER: "1234"}
    assert outgoing_headers_for(1234.9, grpc=True) == {BUDGET_HEADER: "1234", GRPC_TIMEOUT_HEADER: "1234900u"}
    assert outgoing_headers_for(-3, grpc=True) == {BUDGET_HEADER: "0", GRPC_TIMEOUT_HEADER: "0n"}
    with pytest.raises(ValueError, match="NaN"):
        outgoing_headers_for(float("nan"))


def test_outgoing_headers_round_trip_through_a_receiving_policy():
    headers = outgoing_headers_for(480.7, grpc=True)
    incoming = budget_from_headers(headers)
    assert incoming == IncomingBudget(480.0, 0, BUDGET_HEADER)
    deadline, _ = BudgetPolicy().deadline_for({environ_key(name): value for name, value in headers.items()}, ARRIVAL_NS)
    assert deadline.ns == ARRIVAL_NS + 480 * NS_PER_MS


def test_a_budget_of_centuries_saturates_instead_of_failing() -> None:
    policy = BudgetPolicy(default_budget_ms=MAX_WIRE_MS, max_budget_ms=MAX_WIRE_MS)
    arrival = time.monotonic_ns()
    deadline, incoming = policy.deadline_for({BUDGET_ENVIRON_KEY: str(MAX_WIRE_MS)}, arrival)
    assert incoming.budget_ms == MAX_WIRE_MS
    assert deadline.ns == 2**63 - 1
    assert policy.deadline_for({}, arrival)[0].ns == 2**63 - 1
