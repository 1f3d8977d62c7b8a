"""The app the front-door host tests serve: the harness's test app, plus what says which worker answered.

``/pid`` answers the worker process's id (after ``ms`` milliseconds, as
``/work`` sleeps), ``/host-stats`` the host's figures as that worker reads
them, ``environ["prazo.server_stats"]()`` as JSON (after waiting for ``gate``
when given, like ``/work``), and ``/critical-work`` is ``/work`` on a path a
test may make critical. Everything else is the harness's ``app``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from _server_harness import APP_WAIT_S
from _server_harness import app as harness_app


def _wait_for_file(path: str) -> None:
    end = time.monotonic() + APP_WAIT_S
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.002)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    path = environ.get("PATH_INFO", "")
    query = {key: values[0] for key, values in parse_qs(environ.get("QUERY_STRING", "")).items()}
    if path == "/pid":
        time.sleep(int(query.get("ms", "0")) / 1000)
        body = str(os.getpid()).encode()
    elif path == "/host-stats":
        if "mark" in query:
            Path(query["mark"]).touch()
        if "gate" in query:
            _wait_for_file(query["gate"])
        body = json.dumps({"pid": os.getpid(), "stats": environ["prazo.server_stats"]()}).encode()
    elif path == "/critical-work":
        return harness_app({**environ, "PATH_INFO": "/work"}, start_response)
    else:
        return harness_app(environ, start_response)
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
