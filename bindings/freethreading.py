"""Whether the GIL is off, and which module turned it on.

On a free-threaded CPython (PEP 703, a build configured ``--disable-gil``)
threads run Python in parallel until an extension module that does not
declare itself safe without the GIL is imported: the interpreter then turns
the GIL on for the whole process, for good, and says so with one
``RuntimeWarning`` naming the module. A server that checks only before
loading the app (or never) cannot tell its operator that one import of the
app's put every thread back behind one lock. ``watch_imports`` records those
warnings while code imports; ``prazo serve`` logs the outcome once the app is
loaded (``log_gil_state``), and ``python -m prazo.bindings.freethreading
--check-imports`` imports every prazo module and fails if the GIL came on
(``make test-freethreaded``).

On an interpreter with a GIL nothing here changes anything: the GIL is on and
no module turned it on.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = [
    "GIL_LOGGER",
    "GilState",
    "free_threaded_build",
    "gil_enabled",
    "gil_state",
    "import_every_module",
    "log_gil_state",
    "main",
    "watch_imports",
]

GIL_LOGGER = "prazo.freethreading"

# CPython's words (Python/import.c, 3.13 and 3.14), the module's name quoted.
_ENABLED_BY = re.compile(r"The global interpreter lock \(GIL\) has been enabled to load module '([^']+)'")


def free_threaded_build() -> bool:
    """True on a CPython built with ``--disable-gil`` (whether or not the GIL is on now)."""
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def gil_enabled() -> bool:
    """True while the GIL is on: always on a default build."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


@dataclass(frozen=True)
class GilState:
    """The GIL as a process sees it after an import: on or off, and why it is on."""

    free_threaded_build: bool
    enabled: bool
    # Modules whose import turned the GIL on while watched, in import order.
    enabled_by: tuple[str, ...] = field(default=())
    # PYTHON_GIL as set in the environment (``"0"`` forces it off, ``"1"`` on), or None.
    forced: str | None = None

    def describe(self) -> str:
        """One line for an operator."""
        if not self.free_threaded_build:
            return "the GIL is on (not a free-threaded build of CPython): one thread runs Python at a time"
        if not self.enabled:
            forced = " (forced off by PYTHON_GIL=0)" if self.forced == "0" else ""
            return f"free-threaded: the GIL is off{forced}: threads run Python in parallel"
        if self.enabled_by:
            names = ", ".join(self.enabled_by)
            return (
                f"free-threaded build, but the GIL is on: importing {names} turned it on "
                "(an extension not declared safe without the GIL; PYTHON_GIL=0 forces it off, at that module's risk)"
            )
        if self.forced == "1":
            return "free-threaded build, the GIL forced on by PYTHON_GIL=1"
        return "free-threaded build, but the GIL is on (turned on before prazo watched the imports)"


def gil_state(enabled_by: tuple[str, ...] = ()) -> GilState:
    """The GIL now, with the modules a watch saw turn it on."""
    return GilState(free_threaded_build(), gil_enabled(), enabled_by, os.environ.get("PYTHON_GIL"))


@contextmanager
def watch_imports() -> Iterator[list[str]]:
    """Collect, into the list it yields, the modules whose import turns the GIL on inside the block.

    Every other warning raised in the block is shown (or raised, under ``-W
    error``) exactly as it would have been, once the block ends; the GIL's own
    warning is recorded, and shown too when the filters ask for it.
    """
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield seen
        finally:
            # Read before the filters come back: re-issuing happens outside the record.
            recorded = list(caught)
    for message in recorded:
        match = _ENABLED_BY.search(str(message.message))
        if match:
            seen.append(match.group(1))
        warnings.warn_explicit(
            message.message, message.category, message.filename, message.lineno, source=message.source
        )


def log_gil_state(state: GilState, what: str) -> None:
    """Log ``state`` after ``what`` was loaded: INFO when the GIL is off, WARNING when a module turned it on."""
    if not state.free_threaded_build:
        return
    level = logging.WARNING if state.enabled and state.enabled_by else logging.INFO
    logging.getLogger(GIL_LOGGER).log(level, "%s loaded; %s", what, state.describe())


# prazo's three layers (tests/repo/test_layout.py): "prazo" itself is a namespace, which an
# editable install serves through a path hook that pkgutil cannot walk.
_LAYERS = ("prazo.core", "prazo.bindings", "prazo.bench")


def _missing_dependency(exc: BaseException | None) -> bool:
    """True when ``exc`` (or what it was raised from) says a package other than prazo is not installed."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith("prazo"):
            return True
        exc = exc.__cause__
    return False


def import_every_module(layers: tuple[str, ...] = _LAYERS) -> list[str]:
    """Import each of prazo's modules; their names (modules whose optional dependency is missing left out)."""
    names = []
    for layer in layers:
        package = importlib.import_module(layer)
        names.append(layer)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{layer}."):
            if info.name.rpartition(".")[2].startswith(("test_", "conftest")):
                continue  # bench/'s pytest-benchmark files: run by pytest, not imported by users
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                # An optional dependency this interpreter lacks (grpcio has no free-threaded wheel):
                # nothing of prazo's own was imported past it, so it cannot have turned the GIL on.
                if not _missing_dependency(exc):
                    raise
                continue
            names.append(info.name)
    return names


def main(argv: list[str] | None = None) -> int:
    """``--check-imports``: import every prazo module; status 1 if the GIL came on, naming the modules."""
    parser = argparse.ArgumentParser(
        prog="python -m prazo.bindings.freethreading", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check-imports", action="store_true", help="import every prazo module and fail if that turned the GIL on"
    )
    args = parser.parse_args(argv)
    if not args.check_imports:
        print(gil_state().describe())
        return 0
    if not free_threaded_build():
        print("not a free-threaded build of CPython: nothing to check", file=sys.stderr)
        return 2
    with watch_imports() as enabled_by:
        imported = import_every_module()
    state = gil_state(tuple(enabled_by))
    print(f"{len(imported)} prazo modules imported; {state.describe()}")
    return 1 if state.enabled else 0


if __name__ == "__main__":
    sys.exit(main())
