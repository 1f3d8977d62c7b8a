"""Fuzz target: the budget headers of ``prazo.bindings.headers``.

Input: the text format of ``_common`` — header lines, then the options
``default``/``max`` (the policy's budgets, ms) and ``arrival`` (monotonic ns).

Properties, for any input:

* ``parse_budget_ms``, ``parse_grpc_timeout`` and ``parse_envoy_timeout_ms``
  never raise; each returns None or a finite float within ``MAX_WIRE_MS``
  (gRPC: within its own 99999999 hours; never negative for gRPC and Envoy), None for any non-ASCII value and for
  anything that is not a ``str``;
* what the outgoing side formats from a parsed budget parses back to no more
  than that budget (a hop never passes on more time than it has);
* ``budget_from_headers`` (names matched case-insensitively) and
  ``budget_from_environ`` (the CGI keys a server makes) agree on the same header
  lines, and the budget is the smallest valid one (element of a comma list);
* ``BudgetPolicy.deadline_for`` gives exactly ``arrival + min(budget or
  default, max_budget_ms)``, clamped at 0 below and the int64 limit above.
"""

from __future__ import annotations

from prazo.bindings.headers import (
    BUDGET_ENVIRON_KEY,
    ENVOY_TIMEOUT_ENVIRON_KEY,
    GRPC_TIMEOUT_ENVIRON_KEY,
    MAX_WIRE_MS,
    budget_from_environ,
    budget_from_headers,
    format_budget_ms,
    format_grpc_timeout,
    parse_budget_ms,
    parse_envoy_timeout_ms,
    parse_grpc_timeout,
)
from prazo.core import NS_PER_MS

from ._common import INT64_MAX, cgi_environ, check_deadline, option_int, parse_spec, policy_from

PARSERS = (parse_budget_ms, parse_grpc_timeout, parse_envoy_timeout_ms)
# What each parser can return at most: gRPC's own limit (8 digits of hours) is
# far above MAX_WIRE_MS; ``max_budget_ms`` caps it like any other budget.
_LARGEST_MS = {
    parse_budget_ms: float(MAX_WIRE_MS),
    parse_grpc_timeout: 99_999_999 * 3_600_000.0,
    parse_envoy_timeout_ms: float(MAX_WIRE_MS),
}
_PARSER_OF_KEY = {
    BUDGET_ENVIRON_KEY: parse_budget_ms,
    GRPC_TIMEOUT_ENVIRON_KEY: parse_grpc_timeout,
    ENVOY_TIMEOUT_ENVIRON_KEY: parse_envoy_timeout_ms,
}
_NEVER_NEGATIVE = (parse_grpc_timeout, parse_envoy_timeout_ms)


def _check_parsers(value: str) -> list[float]:
    """Run every parser on ``value``; return the budgets they accepted."""
    accepted = []
    for parse in PARSERS:
        ms = parse(value)
        assert parse(value.encode("utf-8", "surrogateescape")) is None, (parse, value)
        if ms is None:
            continue
        assert type(ms) is float and -MAX_WIRE_MS <= ms <= _LARGEST_MS[parse], (parse, value, ms)
        assert value.isascii(), (parse, value, ms)
        assert ms >= 0 or parse not in _NEVER_NEGATIVE, (parse, value, ms)
        accepted.append(ms)
    return accepted


def _check_round_trip(ms: float) -> None:
    granted = max(ms, 0.0)
    sent = parse_budget_ms(format_budget_ms(ms))
    assert sent is not None and sent <= granted, (ms, sent)
    sent = parse_grpc_timeout(format_grpc_timeout(ms))
    assert sent is not None and sent <= granted, (ms, sent)


def test_one_input(data: bytes) -> None:
    spec = parse_spec(data)
    for _, value in spec.headers:
        for ms in _check_parsers(value):
            _check_round_trip(ms)

    # As a header mapping, exact duplicates joined the way a client library
    # would; names that differ in case stay separate keys.
    mapping: dict[str, str] = {}
    for name, value in spec.headers:
        mapping[name] = f"{mapping[name]}, {value}" if name in mapping else value
    from_headers = budget_from_headers(mapping)
    environ = cgi_environ(spec.headers)
    from_environ = budget_from_environ(environ)
    if not any("_" in name for name, _ in spec.headers):
        # An underscore name is one header for a server ("X_Request_Budget_Ms"
        # lands on the CGI key) but another for a mapping: they may differ.
        assert from_headers == from_environ, (from_headers, from_environ)
    # A repeated header arrives comma-joined: each element is judged on its own.
    valid = [
        ms
        for key, parse in _PARSER_OF_KEY.items()
        if key in environ
        for element in environ[key].split(",")
        if (ms := parse(element)) is not None
    ]
    assert from_environ.budget_ms == (min(valid) if valid else None), (from_environ, valid)

    policy = policy_from(spec.options)
    arrival_ns = option_int(spec.options, "arrival", 10**15, 0, INT64_MAX)
    deadline, incoming = policy.deadline_for(environ, arrival_ns)
    assert incoming == from_environ
    check_deadline(policy, deadline, incoming, arrival_ns)
    budget_ms = policy.default_budget_ms if incoming.budget_ms is None else incoming.budget_ms
    budget_ns = int(min(max(budget_ms, 0.0), policy.max_budget_ms) * NS_PER_MS)
    assert deadline.ns == min(arrival_ns + budget_ns, INT64_MAX), (deadline.ns, arrival_ns, budget_ns, incoming)
