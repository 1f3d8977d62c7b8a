"""Real servers for the integration tests: a PostgreSQL instance of the suite's own, HAProxy's and nginx's binaries.

``make test`` runs ``.ci/ensure-services`` first, which installs Debian's
``postgresql``, ``haproxy`` and ``nginx-light`` when missing. Each test session then starts
its own PostgreSQL cluster (``initdb`` into a temporary directory, listening
on a free loopback port, trust authentication, no other connections), so no
system cluster, password or port is assumed, and stops it at the end.

A server that cannot start fails the tests that need it under ``CI=true``
(never a silent skip there); elsewhere, e.g. ``pytest tests/x.py`` on a
machine without the packages, it skips them with the command that installs
them.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from _required import unavailable
from prazo.bench.postgres import PostgresServer, PostgresUnavailable
from prazo.bench.postgres import start_postgres as start_own_postgres

__all__ = [
    "LOADBALANCER_EXAMPLES",
    "SHIPPED_HAPROXY_CONFIG",
    "SHIPPED_NGINX_CONFIG",
    "PostgresServer",
    "free_port",
    "haproxy_binary",
    "nginx_binary",
    "start_postgres",
]

LOADBALANCER_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "loadbalancers"
# The configs the docs include (examples/loadbalancers), which the tests run (prazo.bench.loadbalancers launches them).
SHIPPED_HAPROXY_CONFIG = LOADBALANCER_EXAMPLES / "haproxy.cfg"
SHIPPED_NGINX_CONFIG = LOADBALANCER_EXAMPLES / "nginx.conf"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def haproxy_binary() -> str:
    """The path of ``haproxy``, or the test fails (CI) / skips (elsewhere)."""
    path = shutil.which("haproxy")
    if path is None:
        unavailable("haproxy is not installed")
    assert path is not None
    return path


def nginx_binary() -> str:
    """The path of ``nginx``, or the test fails (CI) / skips (elsewhere)."""
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path is None:
        unavailable("nginx is not installed")
    assert path is not None
    return path


def start_postgres() -> PostgresServer:
    """A cluster of the session's own (``prazo.bench.postgres``); fails (CI) or skips (elsewhere) when it cannot."""
    try:
        return start_own_postgres()
    except PostgresUnavailable as exc:
        unavailable(str(exc))
