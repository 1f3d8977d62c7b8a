"""A small WSGI app to try prazo with: ``prazo serve examples.slow_app:app``.

``GET /work?ms=300`` works for 300 ms, checking its deadline as it goes (the
cooperative cancellation point); ``GET /healthz`` answers at once. Run it behind
any server embedding, then send more requests than it has threads::

    .venv/bin/prazo serve examples.slow_app:app --threads 4 --max-queue 20 &
    for i in $(seq 40); do curl -s -o /dev/null -w "%{http_code}\\n" \\
        -H 'X-Request-Budget-Ms: 2000' 'localhost:8000/work?ms=300' & done; wait
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from prazo.core import current_deadline

_STEP_S = 0.01
_MAX_WORK_MS = 10_000


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    if environ.get("PATH_INFO") == "/healthz":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]
    query = parse_qs(environ.get("QUERY_STRING", ""))
    try:
        work_ms = min(float(query.get("ms", ["100"])[0]), _MAX_WORK_MS)
    except ValueError:
        start_response("400 Bad Request", [("Content-Type", "text/plain"), ("Content-Length", "11")])
        return [b"bad ms=...\n"]
    deadline = current_deadline()
    end = time.monotonic() + work_ms / 1000
    while (left := end - time.monotonic()) > 0:
        if deadline is not None:
            deadline.check()  # DeadlineExceeded -> 504: nobody waits for this answer any more
        time.sleep(min(left, _STEP_S))
    body = f"worked {work_ms:g} ms\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
