"""The gRPC, PostgreSQL and Django recipes of ``docs/how-to/`` run as written, against the real thing.

Each section's ``python`` blocks run in order as one script in a fresh
interpreter (the PostgreSQL blocks continue one another), as a reader pasting
them would: gRPC on loopback, PostgreSQL on the session's own cluster through
``DATABASE_URL``, which the recipe reads; Django's ``StatementDeadline`` block runs
in ``manage.py shell`` of the example project, where the page runs it. These need a
server, a database or another interpreter's set-up, so each block carries a
``tested-by`` marker naming its test here, and ``test_examples.py`` (which runs every
other block with Sybil) leaves it to this file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from _docs import fenced_blocks, section
from _required import require
from _services import PostgresServer

ROOT = Path(__file__).resolve().parents[2]


def run_script(command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> list[str]:
    """``command``'s stdout lines; it must succeed. ``env`` adds to (an empty value unsets) the environment."""
    environ = {name: value for name, value in {**os.environ, **(env or {})}.items() if value}
    result = subprocess.run(
        command,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def run_recipe(heading: str, page: str, env: dict[str, str] | None = None, then: str = "") -> list[str]:
    """The section's ``python`` blocks as one script; a ``DeprecationWarning`` it triggers fails it.

    A reader pasting a recipe should not be told it is out of date (psycopg_pool 3.3
    deprecates a pool opened without ``open=`` or a ``with`` block, for one).
    """
    script = "\n".join(fenced_blocks(section(heading, page), "python"))
    return run_script([sys.executable, "-W", "error::DeprecationWarning", "-c", script + then], env)


def test_the_grpc_recipe_runs_and_the_handler_sees_the_callers_budget_less_the_margin() -> None:
    require("grpc")
    (line,) = run_recipe("# gRPC servers and clients (grpcio, sync)", "docs/how-to/grpc.md")
    match = re.fullmatch(r"hello \((\d+) ms left\)", line)
    assert match is not None, line
    # 500 ms at the caller, 20 ms kept back by the client interceptor; loopback takes the rest.
    assert 0 < int(match.group(1)) <= 480, line


def test_the_postgresql_recipes_run_and_answer_504(postgres: PostgresServer) -> None:
    require("psycopg_pool")
    lines = run_recipe(
        "## Deadline as cancellation: PostgreSQL (psycopg 3, psycopg2)",
        "docs/how-to/databases.md",
        {"DATABASE_URL": postgres.dsn},
    )
    # The bounded pg_sleep, the explicit deadline's SELECT 1, the pooled pg_sleep.
    assert lines == ["504 deadline-exceeded", "(1,)", "504 deadline-exceeded"], lines


def test_the_django_statement_deadline_recipe_runs_in_the_example_projects_shell(tmp_path: Path) -> None:
    require("django")
    (block,) = [
        b
        for b in fenced_blocks(section("## Django: `DeadlineMiddleware`", "docs/how-to/frameworks.md"), "python")
        if "StatementDeadline(" in b
    ]
    project = ROOT / "examples" / "django_project"
    # manage.py picks the example's settings unless the environment names others.
    env = {"SEEDSITE_SQLITE_PATH": str(tmp_path / "db.sqlite3"), "DJANGO_SETTINGS_MODULE": ""}
    run_script([sys.executable, "manage.py", "migrate", "--verbosity", "0"], env, project)
    lines = run_script([sys.executable, "manage.py", "shell", "--command", block], env, project)
    # The count of Hit rows in a fresh database (Django's shell may first say what it imported).
    assert lines[-1] == "0", lines
