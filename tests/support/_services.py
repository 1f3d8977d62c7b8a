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

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _required import unavailable

# initdb + a first start on a loaded 2-core machine take a few seconds; far more is a broken install.
_START_TIMEOUT_S = 60.0


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


def _postgres_bin_dir() -> Path | None:
    """Debian keeps initdb/pg_ctl in /usr/lib/postgresql/N/bin (newest N wins); elsewhere they are on PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    if candidates:
        return Path(candidates[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


@dataclass
class PostgresServer:
    """A running cluster of the suite's own: connect with ``dsn`` (user ``postgres``, database ``postgres``)."""

    host: str
    port: int
    data_dir: Path
    bin_dir: Path
    run_as: list[str]

    @property
    def dsn(self) -> str:
        return f"host={self.host} port={self.port} user=postgres dbname=postgres connect_timeout=10"

    def stop(self) -> None:
        subprocess.run(
            [*self.run_as, str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            check=False,
            timeout=_START_TIMEOUT_S,
        )


def start_postgres() -> PostgresServer:
    """initdb + start a cluster on a free loopback port; fails (CI) or skips (elsewhere) when it cannot."""
    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        unavailable("PostgreSQL (initdb/pg_ctl) is not installed")
    assert bin_dir is not None
    # PostgreSQL refuses to run as root: as root, the cluster belongs to Debian's `postgres` user.
    run_as: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="prazo-pg-"))
    if os.geteuid() == 0:
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, user="postgres")
    data_dir = root / "data"
    port = free_port()
    try:
        subprocess.run(
            [
                *run_as,
                str(bin_dir / "initdb"),
                "-D",
                str(data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            capture_output=True,
            check=True,
            timeout=_START_TIMEOUT_S,
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=100"
        subprocess.run(
            [
                *run_as,
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data_dir),
                "-l",
                str(root / "server.log"),
                "-o",
                options,
                "-w",
                "-t",
                str(int(_START_TIMEOUT_S)),
                "start",
            ],
            capture_output=True,
            check=True,
            timeout=_START_TIMEOUT_S + 10,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log = root / "server.log"
        detail = getattr(exc, "stderr", b"") or b""
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        unavailable(f"PostgreSQL would not start: {exc}; {detail.decode(errors='replace')[-2000:]} {tail}")
    server = PostgresServer("127.0.0.1", port, data_dir, bin_dir, run_as)
    _wait_accepting(server)
    return server


def _wait_accepting(server: PostgresServer) -> None:
    end = time.monotonic() + _START_TIMEOUT_S
    while True:
        try:
            with socket.create_connection((server.host, server.port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > end:
                server.stop()
                unavailable(f"PostgreSQL did not accept connections on port {server.port}")
            time.sleep(0.05)
