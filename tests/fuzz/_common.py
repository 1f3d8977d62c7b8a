"""What the fuzz targets share: the input format and the checks on a deadline.

Every target except ``fuzz_server_head`` (which takes raw request bytes) reads
one text format, so a seed is readable and libFuzzer's mutations of it stay
meaningful::

    GET /orders                      first line: free text (method and path)
    X-Request-Budget-Ms: 250         header lines, "Name: value", in order,
    grpc-timeout: 1S                 duplicates and any letter case allowed
    x-request-budget-ms: 100
                                     an empty line ends the headers
    default=1000                     options, "key=value", read by the target
    app=gen

The input is decoded as UTF-8 with ``surrogateescape``, so any byte string is
a valid input: bytes that are not UTF-8 become lone surrogates, which is the
strangest ``str`` a server could hand over, and UTF-8 gives non-latin-1 text.

The decoding is done here, not with ``atheris.FuzzedDataProvider``, so the
targets' ``test_one_input`` runs without atheris (``tests/repo/test_fuzz_corpus.py``
replays the seed corpus through it in the normal suite).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from prazo.bindings.headers import BudgetPolicy, IncomingBudget, environ_key
from prazo.core import NS_PER_MS, Deadline

INT64_MAX = 2**63 - 1


class Spec(NamedTuple):
    first_line: str
    headers: tuple[tuple[str, str], ...]
    options: dict[str, str]


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def parse_spec(data: bytes) -> Spec:
    """Split an input into its first line, header lines and options (see the module docstring)."""
    head, _, tail = decode(data).partition("\n\n")
    first_line, *lines = head.split("\n")
    headers = []
    for line in lines:
        name, colon, value = line.partition(":")
        if colon:
            # Only the one space after the colon is syntax: any other
            # whitespace (tabs, "\r", more spaces) stays in the value.
            headers.append((name, value.removeprefix(" ")))
    options = {}
    for line in tail.split("\n"):
        key, equals, value = line.partition("=")
        if equals:
            options[key.strip()] = value.strip()
    return Spec(first_line, tuple(headers), options)


def option_int(options: Mapping[str, str], key: str, default: int, low: int, high: int) -> int:
    """``options[key]`` as an int clamped to ``[low, high]``; ``default`` when absent or not a number."""
    try:
        value = int(options[key])
    except (KeyError, ValueError):
        return default
    return min(max(value, low), high)


def cgi_environ(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The ``HTTP_*`` environ keys a WSGI server makes of these header lines.

    Names are upper-cased with ``-`` turned into ``_`` (so ``X_Request_Budget_Ms``
    and ``x-request-budget-ms`` land on one key, as on gunicorn and cheroot), and
    repeated fields are joined with ``","`` as servers do.
    """
    environ: dict[str, str] = {}
    for name, value in headers:
        key = environ_key(name)
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def budget_options(options: Mapping[str, str]) -> dict[str, int]:
    """The options' ``default`` and ``max`` budgets (ms, at least 1), as keyword arguments of a policy.

    The default never exceeds the maximum: a policy, a middleware or a server refuses
    that configuration at construction (a ValueError naming both), which is no input's fault.
    """
    max_budget_ms = option_int(options, "max", 30000, 1, 10**12)
    return {
        "default_budget_ms": min(option_int(options, "default", 1000, 1, 10**12), max_budget_ms),
        "max_budget_ms": max_budget_ms,
    }


def policy_from(
    options: Mapping[str, str], policy_class: type[BudgetPolicy] = BudgetPolicy, **kwargs: Any
) -> BudgetPolicy:
    """A ``policy_class`` with the options' budgets (see ``budget_options``) and ``kwargs``."""
    return policy_class(**budget_options(options), **kwargs)


def check_deadline(policy: BudgetPolicy, deadline: Deadline, incoming: IncomingBudget, arrival_ns: int) -> None:
    """The promises of ``BudgetPolicy.deadline_for``, whatever the headers said.

    The deadline lies in ``[arrival, arrival + max_budget_ms]`` (saturated at
    the int64 limit); a valid incoming budget ``<= 0`` gives a deadline that has
    already passed at arrival.
    """
    max_budget_ns = int(policy.max_budget_ms * NS_PER_MS)
    assert arrival_ns <= deadline.ns <= min(arrival_ns + max_budget_ns, INT64_MAX), (deadline.ns, arrival_ns, policy)
    if incoming.budget_ms is not None and incoming.budget_ms <= 0:
        assert deadline.ns == arrival_ns, (incoming, deadline.ns, arrival_ns)
