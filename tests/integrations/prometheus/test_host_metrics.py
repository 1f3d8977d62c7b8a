"""A front-door host's metrics: one scrape of any worker is the whole host's.

The recipe of docs/how-to/metrics.md ("A front-door host") runs as written, in
the module a real ``prazo serve --server prazo --workers 2`` imports in each
worker, after a ``service`` app that answers its worker's process id.
Requests go to both workers; then every scrape, whichever worker answers it,
must count all of them, show both worker processes and each one's running
requests.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _docs import blocks
from prometheus_client.parser import text_string_to_metric_families

WAIT_S = 30.0
THIS_TEST = "tests/integrations/prometheus/test_host_metrics.py::test_one_scrape_of_any_worker_shows_the_whole_host"
SERVICE = """
import os

from prazo.bindings.integrations import prometheus


def service(environ, start_response):
    body = str(os.getpid()).encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
"""

pytestmark = pytest.mark.compiled  # the front door's engine


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_one_scrape_of_any_worker_shows_the_whole_host(tmp_path: Path) -> None:
    (recipe,) = [block for block in blocks("docs/how-to/metrics.md") if block.marker == ("tested-by", THIS_TEST)]
    (tmp_path / "host_metrics_app.py").write_text(SERVICE + textwrap.dedent(recipe.source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable, "-m", "prazo.bindings.servers.serve", "host_metrics_app:app", "--server", "prazo",
        "--workers", "2", "--threads", "2", "--max-queue", "8", "--port", "0",
        "--reserved", "1", "--critical-path", "/metrics",
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        port = int(match.group(1))
        pids = {_get(port, "/")[1] for _ in range(40)}
        served = 40
        assert len(pids) == 2, pids  # one connection at a time: the least-loaded rule alternates
        for scrape in range(4):
            status, body = _get(port, "/metrics")
            assert status == 200
            samples = _samples(body.decode())
            web = frozenset({("queue", "web")})
            # Every request of both workers, the earlier scrapes and this one.
            assert samples[("prazo_queue_offered_total", web)] == served + scrape + 1
            assert samples[("prazo_queue_refused_total", web | {("reason", "queue-full")})] == 0
            assert samples[("prazo_host_worker_processes", web)] == 2
            assert samples[("prazo_host_worker_lost_total", web)] == 0
            running = {
                dict(labels)["worker"]: value
                for (name, labels), value in samples.items()
                if name == "prazo_host_worker_in_flight"
            }
            assert len(running) == 2 and sorted(running.values()) == [0, 1], running  # the scrape itself
            assert samples[("prazo_queue_max_concurrency", web)] == 4
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(WAIT_S) == 0
        finally:
            if process.poll() is None:
                process.kill()
