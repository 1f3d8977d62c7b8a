"""A PostgreSQL cluster of a run's own, for the psycopg benchmarks and the test suite.

``initdb`` into a temporary directory, listening on a free loopback port,
trust authentication, no other connections: no system cluster, password or
port is assumed. ``.ci/ensure-services`` installs Debian's ``postgresql``.
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

__all__ = ["PostgresServer", "PostgresUnavailable", "start_postgres"]

# initdb + a first start on a loaded 2-core machine take a few seconds; far more is a broken install.
_START_TIMEOUT_S = 60.0


class PostgresUnavailable(RuntimeError):
    """PostgreSQL is not installed, or its cluster would not start or accept connections."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _postgres_bin_dir() -> Path | None:
    """Debian keeps initdb/pg_ctl in /usr/lib/postgresql/N/bin (newest N wins); elsewhere they are on PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    if candidates:
        return Path(candidates[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


@dataclass
class PostgresServer:
    """A running cluster of the caller's own: connect with ``dsn`` (user ``postgres``, database ``postgres``)."""

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
    """initdb + start a cluster on a free loopback port; ``PostgresUnavailable`` when it cannot."""
    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        raise PostgresUnavailable("PostgreSQL (initdb/pg_ctl) is not installed")
    # PostgreSQL refuses to run as root: as root, the cluster belongs to Debian's `postgres` user.
    run_as: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="prazo-pg-"))
    if os.geteuid() == 0:
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, user="postgres")
    data_dir = root / "data"
    port = _free_port()
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
        raise PostgresUnavailable(
            f"PostgreSQL would not start: {exc}; {detail.decode(errors='replace')[-2000:]} {tail}"
        ) from exc
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
                raise PostgresUnavailable(f"PostgreSQL did not accept connections on port {server.port}") from None
            time.sleep(0.05)
