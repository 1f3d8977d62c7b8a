"""Fuzz target: the request-head peek of the socket-level server embeddings.

Input: raw bytes as a client sends them, the way ``ConnectionAdmission.admit``
sees them (``prazo.bindings.servers.plumbing.heads``): ``find_head`` finds the head,
``head_environ`` turns it into ``HTTP_*`` keys, the server's policy (plain, and
trusting ``X-Request-Start`` from loopback) turns those into a deadline.

Properties, for any input:

* the compiled head reader (when built) finds the same head and gives the
  same environ as its Python specification (``find_head_py``, ``request_environ_py``);
* ``find_head`` never raises; it returns None or the bytes up to and including
  the line before the first empty line, which hold no empty line themselves; it
  finds a head whenever the data holds an empty line;
* ``head_environ`` never raises and gives ``str`` values under ``HTTP_*`` keys
  (and ``REMOTE_ADDR``);
* the deadline keeps every ``BudgetPolicy`` promise (``_common.check_deadline``).
"""

from __future__ import annotations

import re

from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.proxy_headers import FrontProxyBudgetPolicy
from prazo.bindings.servers.plumbing.heads import (
    find_head,
    find_head_py,
    head_environ,
    request_environ,
    request_environ_py,
)

from ._common import check_deadline

# The empty lines a server skips before a request line (RFC 9112, section 2.2).
_LEADING_EMPTY_LINES = re.compile(rb"\A(?:\r?\n)*")
_ARRIVAL_NS = 10**15
_PEER = "127.0.0.1"
_POLICIES = (
    BudgetPolicy(default_budget_ms=1000, max_budget_ms=30000),
    FrontProxyBudgetPolicy(
        default_budget_ms=1000,
        max_budget_ms=30000,
        trusted_proxies=("127.0.0.0/8",),
        wall_clock_ns=lambda: 1_700_000_000 * 10**9,
        monotonic_ns=lambda: _ARRIVAL_NS,
    ),
)


def test_one_input(data: bytes) -> None:
    head = find_head(data)
    assert head == find_head_py(data), data
    if head is not None:
        assert request_environ(head, _PEER) == request_environ_py(head, _PEER), head
    if head is None:
        rest = _LEADING_EMPTY_LINES.sub(b"", data, count=1)
        assert b"\n\n" not in rest and b"\n\r\n" not in rest, data
        return
    assert head in data and head.endswith(b"\n"), (data, head)
    assert b"\n\n" not in head and b"\n\r\n" not in head, (data, head)

    environ = head_environ(head, _PEER)
    assert environ.pop("REMOTE_ADDR") == _PEER
    for key, value in environ.items():
        assert key.startswith("HTTP_") and type(value) is str, (key, value)
    environ["REMOTE_ADDR"] = _PEER
    for policy in _POLICIES:
        deadline, incoming = policy.deadline_for(environ, _ARRIVAL_NS)
        check_deadline(policy, deadline, incoming, _ARRIVAL_NS)
