"""Fuzz target: front-proxy queue time, ``prazo.bindings.proxy_headers``.

Input: the text format of ``_common`` — header lines (``X-Request-Start``,
``X-Queue-Start``, budget headers, ...), then the options ``default``/``max``
(budgets, ms), ``upstream`` (``max_upstream_ms``), ``peer`` (``REMOTE_ADDR``),
``trusted`` (a comma-separated ``trusted_proxies`` list), ``wall`` (the wall
clock, ns) and ``arrival`` (monotonic ns).

Properties, for any input:

* ``parse_request_start_ns`` never raises; it returns None or a positive int
  (of at most 20 digits), None for any non-ASCII value and for a non-``str``;
* ``FrontProxyBudgetPolicy`` refuses a malformed ``trusted_proxies`` entry with
  ``ValueError`` (its documented error) and nothing else;
* its deadline keeps every ``BudgetPolicy`` promise (see
  ``_common.check_deadline``), is never later than the plain policy's and
  never earlier than that minus ``max_upstream_ms``; an untrusted peer gets
  exactly the plain policy's deadline;
* the front door's C engine (``--server prazo``, when compiled) agrees: its
  stamp parser gives what ``parse_request_start_ns`` gives for every value as
  it arrives on the wire (latin-1 bytes), and its trusted-peer check, earliest
  stamp of the head (repeated fields judged as the Python side joins them) and
  capped wait give exactly ``upstream_queue_ns``.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from prazo.bindings.headers import BudgetPolicy, is_ambiguous_header_name
from prazo.bindings.proxy_headers import FrontProxyBudgetPolicy, parse_request_start_ns, trusted_networks
from prazo.core import NS_PER_MS

from ._common import INT64_MAX, cgi_environ, check_deadline, option_int, parse_spec, policy_from


def _compiled_engine() -> Any:
    """The front door's engine module, or None when this build has no compiled extensions."""
    try:
        from prazo.bindings.servers.frontdoor import compiled_engine

        return compiled_engine()
    except (ImportError, RuntimeError):
        return None


_ENGINE = _compiled_engine()


def _may_be_trusted(peer: str, trusted: tuple[str, ...] | None) -> bool:
    """Whether ``peer`` may be one of ``trusted``, decided independently of the policy's own code.

    An IPv4-mapped IPv6 peer (``::ffff:10.0.0.1``, how a dual-stack socket
    reports an IPv4 client) counts under its IPv4 form too: whether the policy
    should trust it is open, so neither answer fails the target.
    """
    if trusted is None:
        return True
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    forms = {address, getattr(address, "ipv4_mapped", None)} - {None}
    networks = [ipaddress.ip_network(entry.strip(), strict=False) for entry in trusted]
    return any(form in network for form in forms for network in networks)


def _wire(text: str) -> bytes | None:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return None


def _check_engine(policy: FrontProxyBudgetPolicy, spec: Any, peer: str | None, trusted: Any, arrival_ns: int,
                  wall_ns: int, upstream_ms: int) -> None:  # fmt: skip
    """The engine's pfd_upstream_ns, step by step, against ``policy.upstream_queue_ns``."""
    if _ENGINE is None:
        return
    # The front door's environ drops ambiguous names and joins repeats; the engine sees the raw fields.
    fields = [(name, value) for name, value in spec.headers if not is_ambiguous_header_name(name)]
    wire = [(_wire(name), _wire(value)) for name, value in fields]
    if any(name is None or value is None for name, value in wire) or len(wire) > 100:
        return
    if trusted is None:
        packed = ipaddress.ip_address("127.0.0.1").packed  # any peer is trusted
    else:
        try:
            packed = ipaddress.ip_address(peer or "").packed
        except ValueError:
            return  # the engine's peers are always IP addresses
        if "%" in (peer or ""):
            return
    environ: dict[str, object] = dict(cgi_environ(fields))
    if peer is not None:
        environ["REMOTE_ADDR"] = peer
    expected = policy.upstream_queue_ns(environ, arrival_ns)
    networks = _ENGINE.engine_networks(trusted_networks(trusted))
    got = 0
    if _ENGINE.address_trusted(networks, packed):
        stamp = _ENGINE.request_start_ns(wire)
        if stamp is not None:
            got = _ENGINE.upstream_wait_ns(stamp, wall_ns, int(upstream_ms * NS_PER_MS))
    assert got == expected, (fields, peer, trusted, got, expected)


def test_one_input(data: bytes) -> None:
    spec = parse_spec(data)
    for _, value in spec.headers:
        stamp = parse_request_start_ns(value)
        assert parse_request_start_ns(value.encode("utf-8", "surrogateescape")) is None, value
        if stamp is not None:
            assert type(stamp) is int and 0 < stamp < 10**20, (value, stamp)
            assert value.isascii(), (value, stamp)
        wire = _wire(value)
        if _ENGINE is not None and wire is not None:
            assert _ENGINE.parse_request_start_ns(wire) == stamp, value

    options = spec.options
    trusted = tuple(options["trusted"].split(",")) if "trusted" in options else None
    upstream_ms = option_int(options, "upstream", 5000, 0, 10**9)
    wall_ns = option_int(options, "wall", 1_700_000_000 * 10**9, 0, INT64_MAX)
    arrival_ns = option_int(options, "arrival", 10**15, 0, INT64_MAX)
    try:
        policy = policy_from(
            options,
            FrontProxyBudgetPolicy,
            max_upstream_ms=upstream_ms,
            trusted_proxies=trusted,
            wall_clock_ns=lambda: wall_ns,
            monotonic_ns=lambda: arrival_ns,
        )
    except ValueError:
        assert trusted is not None, "only a trusted_proxies entry can be malformed here"
        return

    environ: dict[str, object] = dict(cgi_environ(spec.headers))
    if "peer" in options:
        environ["REMOTE_ADDR"] = options["peer"]
    deadline, incoming = policy.deadline_for(environ, arrival_ns)
    check_deadline(policy, deadline, incoming, arrival_ns)

    plain = BudgetPolicy(policy.default_budget_ms, policy.max_budget_ms).deadline_for(environ, arrival_ns)[0]
    assert plain.ns - int(upstream_ms * NS_PER_MS) <= deadline.ns <= plain.ns, (deadline.ns, plain.ns)
    peer = options.get("peer")
    if trusted is not None and (peer is None or not _may_be_trusted(peer, trusted)):
        assert deadline.ns == plain.ns, (deadline.ns, plain.ns, peer, trusted)
    _check_engine(policy, spec, peer, trusted, arrival_ns, wall_ns, upstream_ms)
