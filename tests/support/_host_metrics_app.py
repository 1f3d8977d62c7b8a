"""What each worker of a front-door host imports in the host metrics test: an app whose ``/metrics`` is the host's.

``current_host()`` is set before a worker imports its app, so the module can
register it; the collector's registry is this module's own, so the test
scrapes exactly what was registered here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from prazo.bindings.integrations import prometheus
from prazo.bindings.servers.host import current_host
from prometheus_client import CollectorRegistry

registry = CollectorRegistry()
host = current_host()
if host is not None:
    prometheus.register(registry=registry, web=host)


def service(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """Answers the worker's process id: the test learns which worker served."""
    body = str(os.getpid()).encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


app = prometheus.mount_metrics(service, registry=registry)
