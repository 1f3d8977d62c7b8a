"""``python -m fuzz TARGET [libFuzzer flags...]``: run one target under atheris.

Run from ``tests/`` on the path (``PYTHONPATH=tests``); ``make fuzz`` and
``make fuzz-ci`` do. ``TARGET`` is the module name without ``fuzz_``.
"""

from __future__ import annotations

import importlib
import sys

import atheris

from ._runner import crash_at_once


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m fuzz TARGET [libFuzzer flags...]")
    # Coverage feedback comes from prazo's own Python code (the compiled parts
    # are exercised, not instrumented); the harness is left out so its
    # branches do not pass for progress in the code under test.
    with atheris.instrument_imports(include=["prazo"]):
        target = importlib.import_module(f"fuzz.fuzz_{sys.argv[1]}")
    args = [sys.argv[0], *sys.argv[2:]]
    # A finding ends the process at once, its input saved (see _runner): left
    # to atheris, a timer tick during the interpreter's finalisation could
    # kill it before libFuzzer writes the input.
    atheris.Setup(args, crash_at_once(target.test_one_input, args))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
