"""Settings of the server embeddings: arguments, ``PRAZO_*`` variables, defaults and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _server_harness import TESTS_DIR
from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.proxy_headers import FrontProxyBudgetPolicy
from prazo.bindings.servers.settings import ServerSettings, resolve_settings


def test_defaults_without_arguments_or_environment() -> None:
    settings = resolve_settings(environ={})
    assert (settings.threads, settings.max_queue, settings.capacity) == (4, 16, 20)
    assert (settings.default_budget_ms, settings.max_budget_ms) == (1000, 30000)
    assert settings.header_timeout_ms == 5000
    assert type(settings.policy()) is BudgetPolicy


def test_environment_fills_what_the_arguments_leave_out() -> None:
    environ = {
        "PRAZO_MAX_QUEUE": " 7 ",
        "PRAZO_DEFAULT_BUDGET_MS": "250.5",
        "PRAZO_MAX_BUDGET_MS": "9000",
        "PRAZO_TRUST_REQUEST_START": "yes",
        "PRAZO_TRUSTED_PROXIES": "10.0.0.0/8, 127.0.0.1",
        "PRAZO_MAX_UPSTREAM_MS": "1500",
        "PRAZO_HEADER_TIMEOUT_MS": "2500",
    }
    settings = resolve_settings(threads=3, environ=environ)
    assert settings.header_timeout_ms == 2500
    assert (settings.threads, settings.max_queue, settings.capacity) == (3, 7, 10)
    assert (settings.default_budget_ms, settings.max_budget_ms) == (250.5, 9000)
    assert settings.trusted_proxies == ("10.0.0.0/8", "127.0.0.1")
    policy = settings.policy()
    assert isinstance(policy, FrontProxyBudgetPolicy)
    assert policy.max_upstream_ms == 1500
    assert "capacity 10" in settings.describe() and "X-Request-Start from 10.0.0.0/8,127.0.0.1" in settings.describe()


def test_arguments_win_over_the_environment() -> None:
    environ = {"PRAZO_MAX_QUEUE": "7", "PRAZO_DEFAULT_BUDGET_MS": "250", "PRAZO_TRUST_REQUEST_START": "1"}
    environ["PRAZO_HEADER_TIMEOUT_MS"] = "2500"
    settings = resolve_settings(
        max_queue=0, default_budget_ms=600, trust_request_start=False, header_timeout_ms=800, environ=environ
    )
    assert (settings.max_queue, settings.default_budget_ms, settings.trust_request_start) == (0, 600, False)
    assert settings.header_timeout_ms == 800


def test_a_complete_settings_object_is_taken_as_it_is() -> None:
    settings = ServerSettings(threads=2, max_queue=1)
    assert resolve_settings(settings=settings, environ={"PRAZO_MAX_QUEUE": "9"}) is settings
    with pytest.raises(TypeError, match="either settings or the individual limits"):
        resolve_settings(settings=settings, max_queue=3)
    with pytest.raises(TypeError, match="settings must be a ServerSettings"):
        resolve_settings(settings={"threads": 2})  # type: ignore[arg-type]


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRAZO_MAX_QUEUE", "11")
    assert resolve_settings(threads=1).capacity == 12


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PRAZO_MAX_QUEUE", "many", "PRAZO_MAX_QUEUE must be an integer, got 'many'"),
        ("PRAZO_MAX_QUEUE", "-1", "PRAZO_MAX_QUEUE must be >= 0, got -1"),
        ("PRAZO_MAX_QUEUE", "1.5", "PRAZO_MAX_QUEUE must be an integer"),
        ("PRAZO_DEFAULT_BUDGET_MS", "fast", "PRAZO_DEFAULT_BUDGET_MS must be a number of milliseconds"),
        ("PRAZO_DEFAULT_BUDGET_MS", "nan", "PRAZO_DEFAULT_BUDGET_MS must not be NaN"),
        ("PRAZO_DEFAULT_BUDGET_MS", "0", "PRAZO_DEFAULT_BUDGET_MS must be > 0"),
        ("PRAZO_MAX_BUDGET_MS", "inf", "PRAZO_MAX_BUDGET_MS must be finite"),
        ("PRAZO_TRUST_REQUEST_START", "maybe", "PRAZO_TRUST_REQUEST_START must be 1/0"),
        ("PRAZO_MAX_UPSTREAM_MS", "-5", "PRAZO_MAX_UPSTREAM_MS must be >= 0"),
        ("PRAZO_HEADER_TIMEOUT_MS", "0", "PRAZO_HEADER_TIMEOUT_MS must be > 0, got 0.0"),
        ("PRAZO_HEADER_TIMEOUT_MS", "slow", "PRAZO_HEADER_TIMEOUT_MS must be a number of milliseconds"),
    ],
)
def test_malformed_variables_are_named_in_the_error(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_settings(environ={name: value})


def test_trusting_the_proxy_takes_a_real_bool() -> None:
    with pytest.raises(TypeError, match="trust_request_start must be a bool"):
        resolve_settings(trust_request_start="no", environ={})  # type: ignore[arg-type]


@pytest.mark.parametrize("trust", ["1", "0"])
def test_the_proxy_list_variable_is_validated_and_named_whether_or_not_trusting(trust: str) -> None:
    with pytest.raises(ValueError, match="PRAZO_TRUSTED_PROXIES: 'bogus'"):
        resolve_settings(environ={"PRAZO_TRUST_REQUEST_START": trust, "PRAZO_TRUSTED_PROXIES": "10.0.0.1,bogus"})


@pytest.mark.parametrize("trust", [True, False])
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"trusted_proxies": ("10.0.0.1", "bogus")}, ValueError, "trusted_proxies: 'bogus'"),
        ({"trusted_proxies": (10,)}, TypeError, "trusted_proxies entries must be strings"),
        ({"max_upstream_ms": -5.0}, ValueError, "max_upstream_ms must be >= 0"),
        ({"max_upstream_ms": float("nan")}, ValueError, "max_upstream_ms must not be NaN"),
    ],
)
def test_front_proxy_settings_are_validated_even_when_trust_is_off(
    trust: bool, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        ServerSettings(threads=1, max_queue=0, trust_request_start=trust, **kwargs)


def test_untrusted_proxy_list_argument_is_validated() -> None:
    with pytest.raises(TypeError, match="trusted_proxies"):
        resolve_settings(trusted_proxies="10.0.0.1", environ={})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"threads": 0, "max_queue": 1}, ValueError, "threads must be >= 1"),
        ({"threads": "4", "max_queue": 1}, TypeError, "threads must be an int"),
        ({"threads": True, "max_queue": 1}, TypeError, "threads must be an int"),
        ({"threads": 1, "max_queue": -1}, ValueError, "max_queue must be >= 0"),
        ({"threads": 1, "max_queue": 1, "default_budget_ms": float("nan")}, ValueError, "default_budget_ms"),
        ({"threads": 1, "max_queue": 1, "trust_request_start": "yes"}, TypeError, "trust_request_start"),
        ({"threads": 1, "max_queue": 1, "header_timeout_ms": 0}, ValueError, "header_timeout_ms must be > 0, got 0"),
        ({"threads": 1, "max_queue": 1, "header_timeout_ms": float("inf")}, ValueError, "header_timeout_ms"),
        (
            {"threads": 1, "max_queue": 1, "header_timeout_ms": "5s"},
            TypeError,
            "header_timeout_ms must be a real number",
        ),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        ServerSettings(**kwargs)


def test_gunicorn_settings_come_from_threads_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from prazo.bindings.servers.gunicorn import settings_for

    cfg = SimpleNamespace(threads=3, is_ssl=False, http_protocols=["h1"])
    monkeypatch.setenv("PRAZO_MAX_QUEUE", "5")
    assert settings_for(cfg).capacity == 8
    monkeypatch.setenv("PRAZO_MAX_QUEUE", "five")
    with pytest.raises(RuntimeError, match="prazo: PRAZO_MAX_QUEUE"):
        settings_for(cfg)
    monkeypatch.setenv("PRAZO_MAX_QUEUE", "5")
    with pytest.raises(RuntimeError, match="TLS"):
        settings_for(SimpleNamespace(threads=3, is_ssl=True, http_protocols=["h1"]))
    with pytest.raises(RuntimeError, match="HTTP/1"):
        settings_for(SimpleNamespace(threads=3, is_ssl=False, http_protocols=["h2", "h1"]))


def test_gunicorn_refuses_to_start_with_a_malformed_variable() -> None:
    env = {**os.environ, "PRAZO_MAX_QUEUE": "lots", "PYTHONPATH": str(TESTS_DIR)}
    command = [
        sys.executable, "-m", "gunicorn", "-k", "prazo.bindings.servers.gunicorn.AdmissionWorker",
        "--bind", "127.0.0.1:0", "--no-control-socket", "_server_harness:app",
    ]  # fmt: skip
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "PRAZO_MAX_QUEUE must be an integer, got 'lots'" in result.stderr


def test_a_front_door_hosts_reserved_places_and_default_queue_count_every_workers_threads() -> None:
    host = resolve_settings(threads=2, host_workers=3, reserved=5, min_concurrency=6, environ={})
    assert (host.places, host.max_queue, host.capacity) == (6, 24, 30)
    with pytest.raises(ValueError, match=r"reserved .*must be < threads x workers \(6\), got 6"):
        resolve_settings(threads=2, host_workers=3, reserved=6, environ={})
    with pytest.raises(ValueError, match=r"min_concurrency .*must be <= threads x workers \(6\), got 7"):
        resolve_settings(threads=2, host_workers=3, min_concurrency=7, environ={})
    with pytest.raises(ValueError, match=r"reserved .*must be < threads \(2\)"):
        resolve_settings(threads=2, reserved=2, environ={})
    with pytest.raises(ValueError, match="host_workers"):
        resolve_settings(threads=2, host_workers=0, environ={})


BOTH_BUDGETS = (
    r"default_budget_ms \(--default-budget-ms, \$PRAZO_DEFAULT_BUDGET_MS\) must be <= max_budget_ms \(--max-budget-ms"
)


@pytest.mark.parametrize(
    "how",
    [
        {"default_budget_ms": 100, "max_budget_ms": 10},
        {"environ": {"PRAZO_DEFAULT_BUDGET_MS": "100", "PRAZO_MAX_BUDGET_MS": "10"}},
        {"default_budget_ms": 100, "environ": {"PRAZO_MAX_BUDGET_MS": "10"}},
        {"default_budget_ms": 50000, "environ": {}},  # above the default maximum (30000)
    ],
)
def test_a_default_budget_above_the_maximum_is_refused_naming_both(how: dict) -> None:
    """Issue 33: accepted before, and every request then got the maximum instead."""
    with pytest.raises(ValueError, match=BOTH_BUDGETS):
        resolve_settings(**{"environ": {}, **how})
    with pytest.raises(ValueError, match=BOTH_BUDGETS):
        ServerSettings(threads=1, max_queue=0, default_budget_ms=100, max_budget_ms=10)


def test_a_maximum_alone_below_the_default_budget_brings_the_default_down() -> None:
    settings = resolve_settings(max_budget_ms=300, environ={})
    assert (settings.default_budget_ms, settings.max_budget_ms) == (300, 300)
    assert resolve_settings(environ={"PRAZO_MAX_BUDGET_MS": "5000"}).default_budget_ms == 1000


def test_create_server_refuses_a_default_budget_above_the_maximum() -> None:
    from prazo.bindings.servers.waitress import create_server

    with pytest.raises(ValueError, match=BOTH_BUDGETS):
        create_server(lambda environ, start_response: [], port=0, default_budget_ms=100, max_budget_ms=10)
