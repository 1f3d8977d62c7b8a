"""No source file grows past what a reader can hold in the head without saying why.

A module of ``core/`` or ``bindings/`` longer than ``LONG_FILE_LINES`` lines
must give, near its top, the reason it stays one file ("Why one file ...").
Vendored code (``bindings/vendor/``) is somebody else's layout, and the
``.c`` files Cython generates are not sources.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONG_FILE_LINES = 800
REASON_WITHIN_LINES = 80
SOURCE_SUFFIXES = {".py", ".pyx", ".pxd", ".pyi", ".h", ".c"}


def _sources() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "core", "bindings"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [
        ROOT / name
        for name in listed
        if Path(name).suffix in SOURCE_SUFFIXES and not name.startswith("bindings/vendor/")
    ]


def test_the_sources_are_found() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in _sources()}
    assert {"core/_queue_py.py", "bindings/wsgi.py", "core/prazo_policy.h"} <= names


def test_every_long_source_says_why_it_is_one_file() -> None:
    unexplained = []
    for path in _sources():
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > LONG_FILE_LINES and not any("Why one file" in line for line in lines[:REASON_WITHIN_LINES]):
            unexplained.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not unexplained, f"over {LONG_FILE_LINES} lines with no 'Why one file' near the top: {unexplained}"
