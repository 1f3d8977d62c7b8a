"""How ``python -m fuzz`` ends on a finding: the input saved and the process gone at once.

Left to itself, atheris answers an uncaught exception with ``sys.exit``, and
libFuzzer writes the crashing input from an ``atexit`` hook, after the whole
interpreter has been finalised. Meanwhile the timeout's interval timer
(``setitimer``, every ``timeout / 2 + 1`` seconds) keeps running, and CPython's
finalisation puts SIGALRM back to its default action, because atheris had
registered a Python handler for it. A tick in that window (tens of
milliseconds on an idle machine, longer on a busy one) kills the process:
the log says ``Alarm clock`` and no input is saved. That is how a CI run once
lost the one input that failed.

``crash_at_once`` wraps a target so that, instead, an uncaught exception
prints its traceback as atheris does, writes the input where libFuzzer would
(``crash-<sha1>`` under ``-artifact_prefix``, or ``-exact_artifact_path``), and
calls ``abort()``: libFuzzer's SIGABRT handler writes the same file again and
its report and final stats, and ends the process with no finalisation to wait
for. ``KeyboardInterrupt`` still goes to atheris, which stops the run. This
module needs no atheris, so the normal suite tests it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

Target = Callable[[bytes], None]


def artifact_path(args: Sequence[str], data: bytes, kind: str = "crash") -> Path:
    """Where libFuzzer, run with ``args``, writes the input ``data`` of a ``kind`` finding."""
    prefix = "./"
    for arg in args:
        if arg.startswith("-exact_artifact_path="):
            return Path(arg.partition("=")[2])
        if arg.startswith("-artifact_prefix="):
            prefix = arg.partition("=")[2]
    return Path(f"{prefix}{kind}-{hashlib.sha1(data).hexdigest()}")


def crash_at_once(target: Target, args: Sequence[str], abort: Callable[[], object] = os.abort) -> Target:
    """``target``, ending the process through ``abort`` (input saved first) on any exception but ``KeyboardInterrupt``."""

    def run(data: bytes) -> None:
        try:
            target(data)
        except KeyboardInterrupt:
            raise
        except BaseException:
            sys.stdout.flush()
            print("\n === Uncaught Python exception: ===", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            path = artifact_path(args, data)
            try:
                path.write_bytes(data)
                print(f"fuzz: input written to {path}", file=sys.stderr)
            except OSError as exc:
                print(f"fuzz: could not write the input to {path}: {exc}", file=sys.stderr)
            sys.stderr.flush()
            abort()
            raise

    return run
