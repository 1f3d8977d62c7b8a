"""An app that leaves by a ``BaseException`` must not take the front door's worker thread with it (issue 33, defect 5).

``sys.exit()`` in a view (or argparse's ``error()``, or an app's own
``BaseException`` subclass) used to pass the worker's ``except Exception``:
the connection closed without an answer and the thread ended after it had
given its place back, so with one thread the next request waited forever.
Each test runs a real ``prazo serve --server prazo --threads 1`` (one process,
or a host of two workers with one thread each) on ``_exiting_app`` and talks
to it over loopback. Every answer is awaited for ``ANSWER_S``, far more than
a healthy server needs on a loaded machine; nothing asserts on speed.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _exiting_app import CLOSING_BODY, FIRST_CHUNK
from _helpers import wait_until
from _server_harness import TEST_DEFAULT_BUDGET_MS, TESTS_DIR, read_to_eof

# slow: real processes and real time; compiled: the subject is the front door's worker over its engine.
pytestmark = [pytest.mark.slow, pytest.mark.compiled, pytest.mark.usefixtures("runner_path")]

# How long a client waits for one answer: a hang (no thread left to serve) fails on it.
ANSWER_S = 10.0
# Starting, draining and exiting a server (a host boots three processes).
WAIT_S = 30.0
# `prazo serve` as a deployment runs it.
_SERVE = (sys.executable, "-m", "prazo.bindings.servers.serve")
# The good requests after each failed one: more than there are threads in the whole server.
_AFTER = 4
MODES = {"one-process": (), "host": ("--workers", "2")}


class Served:
    """A ``prazo serve --server prazo --threads 1`` of ``_exiting_app`` in its own session."""

    def __init__(self, *options: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        command = [
            *_SERVE, "_exiting_app:app", "--server", "prazo", "--port", "0", "--threads", "1",
            "--default-budget-ms", str(TEST_DEFAULT_BUDGET_MS), "--shutdown-timeout", str(WAIT_S), *options,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self._stderr: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        assert self.process.stdout is not None
        # The startup line: printed once the server (every worker of a host) serves.
        line = self.process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
        assert match, line + self.stderr()
        self.port = int(match.group(1))

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._stderr.append(line)

    def stderr(self) -> str:
        return "".join(self._stderr)

    def get(self, path: str) -> tuple[int, bytes]:
        """One request on a fresh connection: (status, body); a dropped connection or a hang raises."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_S)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def stats(self) -> dict[str, Any]:
        status, body = self.get("/stats")
        assert status == 200, body
        stats: dict[str, Any] = json.loads(body)
        return stats

    def children(self) -> set[int]:
        """The supervisor's child processes (a host's triage and workers)."""
        pid = self.process.pid
        return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}

    def wait(self) -> int:
        try:
            code = self.process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError("prazo serve did not exit:\n" + self.stderr()) from None
        self._reader.join(WAIT_S)
        return code

    def stop(self) -> int:
        """SIGTERM (a graceful drain), then the exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        """Everything of its session, by its process group (the test's own processes only)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(WAIT_S)


@pytest.fixture(params=list(MODES))
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    server = Served(*MODES[request.param])
    try:
        yield server
    finally:
        server.kill()


def serves_on(served: Served) -> None:
    """More good requests than the server has threads: each is answered, so no thread was lost."""
    for _ in range(_AFTER):
        assert served.get("/ok")[0] == 200


@pytest.mark.parametrize("path", ["/exit", "/argparse", "/abort"])
def test_a_view_that_leaves_by_a_base_exception_is_a_500_and_its_thread_serves_on(served: Served, path: str) -> None:
    workers = served.children()
    for attempt in range(1, 4):
        status, body = served.get(path)
        assert status == 500, body
        serves_on(served)
        # Logged with its traceback and counted (a host's workers report their counts to the triage as they go on).
        wait_until(lambda n=attempt: served.stats()["app_errors"] == n, f"{attempt} app errors counted", WAIT_S)
    assert served.children() == workers  # no worker process was lost and replaced either
    assert served.stop() == 0
    logged = served.stderr()
    assert logged.count("front door: the app raised") == 3, logged
    assert {"/exit": "SystemExit: 3", "/argparse": "SystemExit: 2", "/abort": "_exiting_app.Abort"}[path] in logged


def test_a_body_that_exits_after_its_first_chunk_closes_the_connection_and_its_thread_serves_on(
    served: Served,
) -> None:
    workers = served.children()
    for attempt in range(1, 4):
        with socket.create_connection(("127.0.0.1", served.port), timeout=ANSWER_S) as sock:
            sock.sendall(b"GET /exit-in-body HTTP/1.1\r\nHost: test\r\n\r\n")
            received = read_to_eof(sock)  # the server closes: a hang fails on the socket's timeout
        assert received.startswith(b"HTTP/1.1 200 "), received
        assert b"Transfer-Encoding: chunked" in received
        assert FIRST_CHUNK in received
        assert not received.endswith(b"0\r\n\r\n")  # cut, never ended as if complete
        serves_on(served)
        wait_until(lambda n=attempt: served.stats()["app_errors"] == n, f"{attempt} app errors counted", WAIT_S)
    assert served.children() == workers
    assert served.stop() == 0
    logged = served.stderr()
    assert logged.count("front door: the response body raised") == 3, logged
    assert "SystemExit: 4" in logged


def test_a_body_whose_close_exits_is_answered_whole_and_its_thread_serves_on(served: Served) -> None:
    workers = served.children()
    for attempt in range(1, 4):
        # The answer was sent before close(); the connection then closes, as after any app error.
        assert served.get("/exit-in-close") == (200, CLOSING_BODY)
        serves_on(served)
        wait_until(lambda n=attempt: served.stats()["app_errors"] == n, f"{attempt} app errors counted", WAIT_S)
    assert served.children() == workers
    assert served.stop() == 0
    logged = served.stderr()
    assert logged.count("front door: the response's close() raised") == 3, logged
    assert "SystemExit: 5" in logged


def test_keyboard_interrupt_from_a_view_of_one_process_is_a_ctrl_c_a_graceful_stop() -> None:
    # serve_forever() stops gracefully on Ctrl-C (docs/how-to/server-front-door.md): a
    # KeyboardInterrupt raised in a worker thread is handed to the main thread as one.
    served = Served()
    try:
        status, body = served.get("/interrupt")
        assert status == 500, body  # the request itself is answered, as it finishes within the drain
        assert served.wait() == 0
        assert "KeyboardInterrupt" in served.stderr()
    finally:
        served.kill()


def test_keyboard_interrupt_from_a_view_of_a_host_worker_is_a_500_and_the_worker_serves_on() -> None:
    # A host's worker ignores Ctrl-C (the supervisor decides when the host stops): a
    # KeyboardInterrupt its app raises is an app error like any other.
    served = Served(*MODES["host"])
    try:
        workers = served.children()
        for attempt in range(1, 4):
            status, body = served.get("/interrupt")
            assert status == 500, body
            serves_on(served)
            wait_until(lambda n=attempt: served.stats()["app_errors"] == n, f"{attempt} app errors counted", WAIT_S)
        assert served.children() == workers
        assert served.stop() == 0
    finally:
        served.kill()
