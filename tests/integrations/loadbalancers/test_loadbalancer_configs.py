"""The shipped load-balancer configs (``examples/loadbalancers/``) are valid and say what prazo relies on.

HAProxy and nginx are run for real in ``test_loadbalancers.py``; here HAProxy's
own check (``haproxy -c``) and nginx's (``nginx -t``, when nginx is installed)
accept the files, and Envoy's — not packaged in Debian, so never run here — is
parsed and checked field by field: the stamp, the budget it sends, which
statuses it retries and where.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from _docs import fenced_blocks, section
from _services import (
    LOADBALANCER_EXAMPLES,
    SHIPPED_HAPROXY_CONFIG,
    SHIPPED_NGINX_CONFIG,
    free_port,
    haproxy_binary,
    nginx_binary,
)
from prazo.bench.loadbalancers import haproxy_environment, nginx_config_for
from prazo.bindings.headers import ENVOY_TIMEOUT_HEADER
from prazo.bindings.proxy_headers import REQUEST_START_HEADER, parse_request_start_ns
from prazo.bindings.servers.settings import DEFAULT_MAX_BUDGET_MS

ENVOY_CONFIG = LOADBALANCER_EXAMPLES / "envoy.yaml"


def test_haproxy_accepts_the_shipped_config() -> None:
    env = {**os.environ, **haproxy_environment("127.0.0.1:8080", ["127.0.0.1:8001", "127.0.0.1:8002"], 20)}
    check = subprocess.run(
        [haproxy_binary(), "-c", "-f", str(SHIPPED_HAPROXY_CONFIG)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_haproxy_retries_503_never_504() -> None:
    lines = [line.split("#")[0].split() for line in SHIPPED_HAPROXY_CONFIG.read_text().splitlines()]
    retry_on = [words[1:] for words in lines if words[:1] == ["retry-on"]]
    assert retry_on == [["conn-failure", "503"]]
    assert ["option", "redispatch", "1"] in lines


def test_nginx_accepts_the_shipped_config(tmp_path: Path) -> None:
    binary = nginx_binary()
    config = nginx_config_for(free_port(), ["127.0.0.1:8001", "127.0.0.1:8002"], tmp_path, SHIPPED_NGINX_CONFIG)
    check = subprocess.run(
        [binary, "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    # The file the docs include is the shipped one, not the rendered one: only the addresses differ.
    assert config.read_text().count("\n") == SHIPPED_NGINX_CONFIG.read_text().count("\n")


def _route(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    assert manager["name"] == "envoy.filters.network.http_connection_manager"
    (host,) = manager["typed_config"]["route_config"]["virtual_hosts"]
    (route,) = host["routes"]
    assert isinstance(route, dict)
    return route


def test_envoy_config_retries_503_on_another_host_and_never_504() -> None:
    route = _route(yaml.safe_load(ENVOY_CONFIG.read_text()))["route"]
    policy = route["retry_policy"]
    retry_on = set(policy["retry_on"].split(","))
    assert retry_on == {"connect-failure", "retriable-status-codes"}
    assert policy["retriable_status_codes"] == [503]
    # Nothing that would retry a 504 or a request that may have run.
    assert not retry_on & {"5xx", "gateway-error", "reset", "retriable-4xx"}
    assert [p["name"] for p in policy["retry_host_predicate"]] == ["envoy.retry_host_predicates.previous_hosts"]
    (method,) = policy["retriable_request_headers"]
    assert method["name"] == ":method" and method["string_match"]["safe_regex"]["regex"] == "GET|HEAD"


def test_envoy_route_timeout_is_a_budget_prazo_accepts() -> None:
    # Envoy sends the route timeout upstream as x-envoy-expected-rq-timeout-ms, which prazo reads.
    timeout = _route(yaml.safe_load(ENVOY_CONFIG.read_text()))["route"]["timeout"]
    assert timeout.endswith("s")
    assert 0 < float(timeout[:-1]) * 1000 <= DEFAULT_MAX_BUDGET_MS
    assert ENVOY_TIMEOUT_HEADER in ENVOY_CONFIG.read_text()  # the comment explains it


def test_envoy_stamps_request_start_in_a_format_prazo_parses() -> None:
    (added,) = _route(yaml.safe_load(ENVOY_CONFIG.read_text()))["request_headers_to_add"]
    assert added["header"]["key"] == REQUEST_START_HEADER
    assert added["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
    # %START_TIME(%s.%3f)% renders as seconds with milliseconds, e.g. t=1700000000.123.
    assert added["header"]["value"] == "t=%START_TIME(%s.%3f)%"
    assert parse_request_start_ns("t=1700000000.123") == 1_700_000_000_123_000_000


def test_envoy_weighted_round_robin_snippet_reads_the_load_report() -> None:
    """The page's cluster policy: client-side weighted round robin, which reads ``endpoint-load-metrics``."""
    page = section("## Load reports in the response (ORCA)", "docs/how-to/load-balancers.md")
    (snippet,) = fenced_blocks(page, "yaml")
    cluster = {**yaml.safe_load(ENVOY_CONFIG.read_text())["static_resources"]["clusters"][0]}
    # In place of the shipped cluster's lb_policy: Envoy takes one policy per cluster.
    del cluster["lb_policy"]
    cluster.update(yaml.safe_load(snippet))
    (policy,) = cluster["load_balancing_policy"]["policies"]
    extension = policy["typed_extension_config"]
    assert extension["name"] == "envoy.load_balancing_policies.client_side_weighted_round_robin"
    config = extension["typed_config"]
    assert config["@type"] == (
        "type.googleapis.com/envoy.extensions.load_balancing_policies."
        "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin"
    )
    # Per-request reports (the header), not the out-of-band stream prazo does not serve.
    assert not config.get("enable_oob_load_report", False)
    # Weights follow prazo's report, renewed once a second, and a refusing server's eps weighs it down.
    assert config["weight_update_period"] == "1s"
    assert float(config["error_utilization_penalty"]) > 0
    assert cluster["name"] == "prazo"
