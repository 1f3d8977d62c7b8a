"""The README's gRPC and PostgreSQL recipes run as written, against the real thing.

Each section's ``python`` blocks run in order as one script in a fresh
interpreter (the PostgreSQL blocks continue one another), as a reader pasting
them would: gRPC on loopback, PostgreSQL on the session's own cluster through
``DATABASE_URL``, which the recipe reads. The load-balancer configs and the
OpenTelemetry example are files the README copies (``test_readme_configs.py``)
and their own tests run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _readme import fenced_blocks, section
from _services import PostgresServer

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(heading: str, env: dict[str, str] | None = None) -> list[str]:
    script = "\n".join(fenced_blocks(section(heading), "python"))
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def test_the_grpc_recipe_runs_and_the_handler_sees_the_callers_budget_less_the_margin() -> None:
    pytest.importorskip("grpc")
    (line,) = run_recipe("### gRPC servers and clients (grpcio, sync)")
    match = re.fullmatch(r"hello \((\d+) ms left\)", line)
    assert match is not None, line
    # 500 ms at the caller, 20 ms kept back by the client interceptor; loopback takes the rest.
    assert 0 < int(match.group(1)) <= 480, line


def test_the_postgresql_recipes_run_and_answer_504(postgres: PostgresServer) -> None:
    pytest.importorskip("psycopg_pool")
    lines = run_recipe("### Deadline as cancellation: PostgreSQL (psycopg 3, psycopg2)", {"DATABASE_URL": postgres.dsn})
    # The bounded pg_sleep, the explicit deadline's SELECT 1, the pooled pg_sleep.
    assert lines == ["504 deadline-exceeded", "(1,)", "504 deadline-exceeded"], lines
