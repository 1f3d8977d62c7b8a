"""``start_serve``: ``prazo serve`` in a child process, its address read from the line it prints at start-up.

The benchmarks that measure a server from another process (the agent-check
balancing, the measured Retry-After) start it this way, so each gets a real
``prazo serve`` on a free port, exactly as a user runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["start_serve"]


def start_serve(
    app: str, options: Sequence[str], pattern: re.Pattern[str], env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """``prazo serve app *options`` started; ``pattern`` matched against its first line (``RuntimeError`` if not)."""
    command = [sys.executable, "-m", "prazo.bindings.servers.serve", app, *options]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})}
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    found = pattern.search(line)
    if found is None:
        process.kill()
        process.wait(30)
        raise RuntimeError(f"prazo serve did not start: {line!r}")
    return process, found
