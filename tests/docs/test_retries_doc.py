"""Every ``python`` block of ``docs/how-to/retries.md`` runs as written, each in a fresh interpreter.

The recipes call ``http://b.internal:8080`` (and ``http://b-2.internal:8080``);
the test starts two servers on 127.0.0.1 that behave as the guide says — the
first request to each path answered ``503`` with ``X-Prazo-Reason:
queue-full`` (``/drain``'s with a measured wait of 150 ms), the next ones ``200`` — and runs each block with those
addresses in place of the names. The gRPC block only builds a channel; the
retrying interceptor itself is ``tests/integrations/grpc/test_grpc_retries.py``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _docs import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "how-to" / "retries.md"
NAMES = ("http://b.internal:8080", "http://b-2.internal:8080")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        with self.server.lock:
            seen = self.server.seen[self.path] = self.server.seen.get(self.path, 0) + 1
        # What the guide says of both instances: each path's first request is refused.
        refuse = seen == 1
        body = b"{}"
        self.send_response(503 if refuse else 200)
        if refuse:
            self.send_header("X-Prazo-Reason", "queue-full")
            if self.path == "/drain":  # the guide's measured wait: 150 ms, beside the whole second
                self.send_header("Retry-After", "1")
                self.send_header("X-Prazo-Retry-After-Ms", "150")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _start() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    server.seen = {}  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def addresses() -> Iterator[dict[str, str]]:
    servers = [_start(), _start()]
    yield {name: f"http://127.0.0.1:{server.server_address[1]}" for name, server in zip(NAMES, servers)}
    for server in servers:
        server.shutdown()
        server.server_close()


BLOCKS = fenced_blocks(GUIDE.read_text(encoding="utf-8"), "python")
EXPECTED = [
    ["10"],  # the budget's arithmetic
    ["200", "200", "2"],  # requests
    ["200", "200"],  # httpx
    ["200", "200"],  # urllib3
    ["200"],  # urllib
    ["200", "2"],  # several instances: each refuses its first /report
    ["200", "2"],  # Dependency: each instance refuses its first /recs/42
    [],  # gRPC: builds the channel
    ["200", "0.8"],  # the adaptive throttle's arithmetic: 2 x what the destination takes
    ["200", "0"],  # a throttled session: one refusal in a quiet window throttles nothing
    ["503 Service Unavailable 2 1500"],  # a measured wait as the two headers
    ["200", "1"],  # the retry waited the 150 ms
]


def test_the_guide_has_the_blocks_this_test_expects() -> None:
    assert len(BLOCKS) == len(EXPECTED)


@pytest.mark.parametrize(("index", "expected"), list(enumerate(EXPECTED)))
def test_each_block_runs_and_prints_what_the_guide_says(
    addresses: dict[str, str], index: int, expected: list[str]
) -> None:
    script = BLOCKS[index]
    for name, address in addresses.items():
        script = script.replace(name, address)
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == expected, result.stdout + result.stderr
