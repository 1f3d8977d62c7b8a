"""The app the multi-process gunicorn tests serve: the harness's test app plus the host's occupancy table."""

from __future__ import annotations

from _server_harness import app as harness_app
from prazo.bench.multiprocess import with_host_endpoint

app = with_host_endpoint(harness_app)
