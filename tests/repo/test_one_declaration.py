"""Each ``prazo serve`` flag and each server setting's variable is written in one source file.

The settings' table (``prazo.bindings.servers.settings.SETTINGS``) declares
each setting's flag and ``PRAZO_*`` variable once; ``prazo serve``'s own
options are declared by ``serve.py``. A second quoted copy of one anywhere in
``core/`` or ``bindings/`` is a second place that can drift. Reads the source
tree, so it is a check of the repository (``tests/repo``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prazo.bindings.servers.serve import build_serve_parser
from prazo.bindings.servers.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(path for folder in ("core", "bindings") for pattern in ("*.py", "*.pyx")
                 for path in (ROOT / folder).rglob(pattern))  # fmt: skip
FLAGS = [option for action in build_serve_parser()._actions for option in action.option_strings
         if option.startswith("--") and option != "--help"]  # fmt: skip


def files_holding(literal: str) -> list[str]:
    quoted = re.compile(rf"""["']{re.escape(literal)}["']""")
    return [str(path.relative_to(ROOT)) for path in SOURCES if quoted.search(path.read_text("utf-8"))]


def test_the_sources_are_found() -> None:
    assert len(SOURCES) > 50 and len(FLAGS) > 20


@pytest.mark.parametrize("flag", FLAGS)
def test_every_flag_of_prazo_serve_is_written_in_one_source_file(flag: str) -> None:
    assert len(files_holding(flag)) == 1, files_holding(flag)


@pytest.mark.parametrize("variable", [row.env for row in SETTINGS if row.env is not None])
def test_every_variable_is_written_in_one_source_file(variable: str) -> None:
    # Django's settings module names two of its settings as the variables are named (PRAZO_*_BUDGET_MS):
    # a Django setting, read from django.conf.settings, not from the environment.
    holders = [path for path in files_holding(variable) if not path.startswith("bindings/integrations/")]
    assert holders == ["bindings/servers/settings.py"]
