"""``prazo serve`` refuses what it cannot do in one line on stderr, through the installed command (issue 33).

Before these fixes a port in use or a bad ``--host`` ended in a traceback of 15
to 33 lines (werkzeug alone printed its own two lines), and contradictory
budgets were accepted. Every case here runs the real ``prazo`` command in a
subprocess, with a timeout that only a hang reaches.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _server_harness import SERVER_KINDS, TESTS_DIR
from prazo.bindings.servers.serve import SERVERS

PRAZO = str(Path(sys.executable).with_name("prazo"))
# Generous: a refusal comes before anything serves, in about the time an import takes.
TIMEOUT_S = 120.0
# Every server, and the front door's host of worker processes (which binds in its supervisor).
SERVER_OPTIONS = [*(["--server", kind] for kind in (*SERVER_KINDS, "prazo")), ["--server", "prazo", "--workers", "2"]]
SERVER_IDS = [*SERVER_KINDS, "prazo", "prazo-workers"]


def prazo_serve(*options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PRAZO, "serve", "_server_harness:app", *options],
        check=False,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


GIL_REPORT = re.compile(r"^\S+ loaded; free-threaded")


def assert_one_line(result: subprocess.CompletedProcess[str], status: int, message: str) -> None:
    """Exit ``status``, nothing served (no start-up line), and ``message`` as the only line on stderr."""
    assert "Traceback" not in result.stderr, result.stderr
    # On a free-threaded CPython the GIL's state is logged once the app is loaded (before
    # the port is tried): information, not part of the error.
    lines = [line for line in result.stderr.splitlines() if not GIL_REPORT.match(line)]
    assert lines == [f"prazo serve: error: {message}"], result.stderr
    assert result.returncode == status, result.stderr
    assert result.stdout == ""


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 another program listens on."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        yield holder.getsockname()[1]


@pytest.mark.parametrize("server", SERVER_OPTIONS, ids=SERVER_IDS)
def test_a_port_in_use_is_one_line_naming_the_address(server: list[str], held_port: int) -> None:
    result = prazo_serve(*server, "--port", str(held_port))
    assert_one_line(result, 2, f"cannot listen on 127.0.0.1:{held_port}: address already in use")


@pytest.mark.parametrize("host", ["256.1.1.1", "no-such-host.invalid"])
@pytest.mark.parametrize("server", SERVER_OPTIONS, ids=SERVER_IDS)
def test_a_bad_host_is_one_line_naming_the_address(server: list[str], host: str) -> None:
    result = prazo_serve(*server, "--host", host, "--port", "8000")
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    # The resolver's words vary ("Name or service not known", "Temporary failure ..."): the address is what counts.
    assert result.stderr.startswith(f"prazo serve: error: cannot listen on {host}:8000: "), result.stderr
    assert (result.returncode, result.stdout) == (2, "")


def test_the_werkzeug_embedding_raises_for_a_port_in_use_where_werkzeug_exits(held_port: int) -> None:
    """``make_server`` is a library call: an OSError, as from wsgiref's, not werkzeug's print and ``sys.exit(1)``."""
    from prazo.bindings.servers.werkzeug import make_server

    with pytest.raises(OSError) as raised:
        make_server("127.0.0.1", held_port, lambda environ, start_response: [], threads=1, max_queue=0)
    assert raised.value.errno == errno.EADDRINUSE


def test_a_default_budget_above_the_maximum_is_refused_naming_both_flags() -> None:
    result = prazo_serve("--port", "0", "--default-budget-ms", "100", "--max-budget-ms", "10")
    assert_one_line(
        result,
        2,
        "default_budget_ms (--default-budget-ms, $PRAZO_DEFAULT_BUDGET_MS) must be <= "
        "max_budget_ms (--max-budget-ms, $PRAZO_MAX_BUDGET_MS), got 100 > 10",
    )


def test_a_default_budget_above_the_maximum_is_refused_from_the_environment() -> None:
    env = {**os.environ, "PRAZO_DEFAULT_BUDGET_MS": "100", "PRAZO_MAX_BUDGET_MS": "10"}
    result = prazo_serve("--port", "0", env=env)
    assert result.returncode == 2, result.stderr
    assert "$PRAZO_DEFAULT_BUDGET_MS) must be <= max_budget_ms" in result.stderr
    assert "$PRAZO_MAX_BUDGET_MS), got 100 > 10" in result.stderr


def test_the_help_lists_every_server_and_the_default_of_max_queue() -> None:
    result = subprocess.run([PRAZO, "serve", "--help"], check=True, capture_output=True, text=True, timeout=TIMEOUT_S)
    help_text = " ".join(result.stdout.split())  # argparse wraps lines
    description = help_text.split("Serve MODULE:APP on ", 1)[1].split(" with prazo's", 1)[0]
    assert all(name in description for name in SERVERS), description
    max_queue = help_text.split("--max-queue M ", 1)[1].split(" --default-budget-ms", 1)[0]
    assert "default 4 x threads" in max_queue, max_queue
