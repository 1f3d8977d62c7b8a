"""The recipes that serve until stopped, or call a host of the reader's, run as written.

A page's server recipe (``server.run()``, ``serve_forever()``, ``prazo serve``,
``gunicorn ...``) never returns, and a client recipe calls
``http://b.internal``, which does not exist here. Each block whose marker names
a test of this file is run in a process of its own with only these changes:
its fixed ports (8080, 8000, 9100) become free ones on 127.0.0.1, a command
without a port gets one, ``http://b.internal`` becomes a loopback server
answering ``{"items": []}``. A server recipe must then answer a real request
200 through the server it built, and stop when the signal its comment names
(Ctrl-C, SIGTERM) arrives; a client recipe must exit 0.
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
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _docs import Block, blocks, pages

ROOT = Path(__file__).resolve().parents[2]
SERVES = "tests/docs/test_serving_recipes.py::test_the_recipe_serves_a_request_and_stops"
CALLS = "tests/docs/test_serving_recipes.py::test_the_client_recipe_runs_against_a_loopback_b_internal"
START_TIMEOUT_S = 60.0  # a loaded 2-core machine starting gunicorn and its worker
STOP_TIMEOUT_S = 30.0

APP_SOURCE = """
def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "3")])
    return [b"ok\\n"]
"""


def _marked(test: str) -> list[Block]:
    return [block for page in pages() for block in blocks(page) if block.marker == ("tested-by", test)]


def _id(block: Block) -> str:
    return str(block).split(" ")[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _on_loopback(source: str, port: int) -> str:
    """The recipe with its ports made free ones and every address loopback."""
    source = source.replace("0.0.0.0", "127.0.0.1")
    source = re.sub(r"\b(8080|8000)\b", str(port), source)
    source = re.sub(r"\b9100\b", str(_free_port()), source)
    if re.search(r"^\s*prazo serve ", source, re.MULTILINE) and "--port" not in source:
        source = re.sub(r"(prazo serve \S+)", rf"\1 --port {port}", source)
    if re.search(r"^\s*gunicorn ", source, re.MULTILINE) and "--bind" not in source:
        source = re.sub(r"\bgunicorn ", f"gunicorn --bind 127.0.0.1:{port} ", source)
    return source


def _command(block: Block, source: str, folder: Path) -> list[str]:
    if block.info == "python":
        return [sys.executable, "-c", APP_SOURCE + source]
    (folder / "app.py").write_text(APP_SOURCE)
    return ["bash", "-e", "-c", source]


def _environment(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The commands a reader runs (prazo, gunicorn) are the ones of this interpreter's virtualenv.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    return env


def _get(port: int, deadline: float, process: subprocess.Popen[str]) -> tuple[int, bytes]:
    while True:
        if process.poll() is not None:
            output = process.communicate()[0]
            pytest.fail(f"the recipe exited ({process.returncode}) before serving:\n{output}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/")
            response = connection.getresponse()
            answer = response.status, response.read()
            connection.close()
            return answer
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _stop_signal(block: Block) -> signal.Signals:
    # gunicorn stops gracefully on SIGTERM; the others say Ctrl-C (SIGINT) is graceful.
    return signal.SIGTERM if "gunicorn" in block.source else signal.SIGINT


@pytest.mark.slow
@pytest.mark.parametrize("block", _marked(SERVES), ids=_id)
def test_the_recipe_serves_a_request_and_stops(block: Block, tmp_path: Path) -> None:
    port = _free_port()
    source = _on_loopback(block.source, port)
    process = subprocess.Popen(
        _command(block, source, tmp_path),
        cwd=tmp_path,
        env=_environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the signal reaches bash's child too
    )
    try:
        status, body = _get(port, time.monotonic() + START_TIMEOUT_S, process)
        # A recipe that defines its own app (the front door's first) is answered by it, else by APP_SOURCE's.
        own_app = block.info == "python" and re.search(r"^def app\(", block.source, re.MULTILINE)
        assert status == 200 and (own_app or body == b"ok\n"), (status, body, source)
        assert body, source
        os.killpg(process.pid, _stop_signal(block))
        output = process.communicate(timeout=STOP_TIMEOUT_S)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert "Traceback" not in output or "KeyboardInterrupt" in output, output


class _Items(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = json.dumps({"items": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def b_internal() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Items)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("block", _marked(CALLS), ids=_id)
def test_the_client_recipe_runs_against_a_loopback_b_internal(block: Block, b_internal: str) -> None:
    source = block.source.replace("http://b.internal", b_internal)
    assert source != block.source, "a client recipe calls http://b.internal"
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, source + result.stdout + result.stderr


def test_every_recipe_this_file_runs_is_found() -> None:
    # A marker with a typo would leave its block to nobody: test_examples.py checks the
    # test exists, and this checks that both tests have blocks to run.
    assert len(_marked(SERVES)) >= 6
    assert len(_marked(CALLS)) >= 3
