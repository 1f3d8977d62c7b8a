"""One rule for what a test run may find missing: fail under CI, skip elsewhere, saying what to install.

``make test`` installs every optional package the suite uses (the extras in
``pyproject.toml``), builds every compiled path and starts every server, so
in CI nothing may be missing: a skip there would hide a broken install or a
compiled path that no longer builds. A developer running one file by hand on
a machine without, say, PostgreSQL gets a skip that names the command that
installs it instead.

The compiled paths follow the twins' rule: missing is a failure unless
``PRAZO_NO_EXTENSIONS=1`` asked for the Python twins on purpose.

``conftest.py`` holds the other half: under ``CI=true`` any skip whose reason
is not in ``ALLOWED_SKIPS`` fails the run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest
from prazo.core import extension_wanted

__all__ = ["ALLOWED_SKIPS", "INSTALL_HINT", "in_ci", "require", "require_compiled", "unavailable"]

INSTALL_HINT = "run `make test` (or `bash .ci/ensure-services` for the servers), which installs it"

# Skips that are right even in CI, each with its reason: they depend on the
# platform or on an explicit request, never on an install step. Matched as a
# substring of the skip's reason.
ALLOWED_SKIPS = {
    "needs os.fork": "the fork-safety tests cannot run where there is no fork (Windows)",
    "reads worker pids from /proc": "gunicorn's worker threads are counted through /proc (Linux only)",
    "no IPv6 loopback here": "a container may have no ::1; the IPv4 tests still run",
    "PRAZO_NO_EXTENSIONS is set": "the Python twins were asked for on purpose: there is no compiled path to test",
    "needs a free-threaded CPython": "make test-freethreaded runs these on a --disable-gil build; make test's 3.11 has a GIL",
    "needs the GIL": "a test that stops other threads by holding the GIL cannot on a free-threaded build (PYTHON_GIL=0)",
}


def in_ci() -> bool:
    """True in CI (``CI`` set to anything but empty, ``0`` or ``false``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(what: str, hint: str = INSTALL_HINT) -> NoReturn:
    """Something the Makefile provides is missing: fail under CI, skip elsewhere with ``hint``."""
    if in_ci():
        pytest.fail(f"{what} (CI=true: tests that need it fail, never skip)", pytrace=False)
    pytest.skip(f"{what}; {hint}")


def require(module: str) -> ModuleType:
    """Import ``module`` (an optional package ``make`` installs), or fail in CI / skip elsewhere."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        unavailable(f"{module} is not importable ({exc})")


def require_compiled(module: str) -> ModuleType:
    """Import a compiled module of prazo's: a failure unless ``PRAZO_NO_EXTENSIONS=1`` was set on purpose."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if not extension_wanted():
            pytest.skip(f"PRAZO_NO_EXTENSIONS is set: {module} is not built ({exc})")
        pytest.fail(
            f"{module} cannot be loaded ({exc}); build it (`make build`) "
            "or set PRAZO_NO_EXTENSIONS=1 to test the Python paths alone",
            pytrace=False,
        )
