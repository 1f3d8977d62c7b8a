"""The configuration table of ``docs/reference/configuration.md`` is held to the code's signatures.

The server settings' table is generated when the site is built (``docs/_ext``,
checked in ``test_reasons.py``); the table of the classes an application
configures is prose about each keyword, so it is written by hand, and checked
here: for each class, the keywords its rows name (a row "the queue's policies"
names the ones its meaning lists, ``codel_*`` being both CoDel keywords, or all of
them when it says "as for AdmissionQueue") are
exactly the keywords of its signature, and a row of one keyword with one plain
default (a number, None, True/False, a quoted string) gives the signature's default.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
from _docs import section
from prazo.bindings.dependency import Dependency
from prazo.bindings.integrations.flask import init_app
from prazo.bindings.pool import AdmissionPool
from prazo.bindings.wsgi import AdmissionMiddleware
from prazo.core import load_twin

PAGE = "docs/reference/configuration.md"
# The table's "where" cell -> the callable it describes, and its positional arguments the table leaves out.
CLASSES: dict[str, tuple[Callable[..., Any], set[str]]] = {
    "`AdmissionQueue`": (load_twin("py"), set()),
    "`AdmissionMiddleware`": (AdmissionMiddleware, {"app"}),
    "`AdmissionPool`": (AdmissionPool, set()),
    "`Dependency`": (Dependency, set()),
    "`init_app` (Flask)": (init_app, {"app"}),
}
QUEUE_POLICIES = ["order", "codel_target_ms", "codel_interval_ms", "expected_service_ms", "limit", "min_concurrency"]


def _rows() -> dict[str, list[list[str]]]:
    """The table's rows by their "where" cell (a row with an empty one continues the one above)."""
    table = section("# Configuration reference", PAGE).split("\n## ", 1)[0]
    rows: dict[str, list[list[str]]] = {}
    where = ""
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| where |"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        where = cells[0] or where
        rows.setdefault(where, []).append(cells)
    return rows


def _named(cells: list[str]) -> list[str]:
    if cells[1] == "the queue's policies":
        names = re.findall(r"`([a-z_*]+)`", cells[3])
        if cells[3].startswith("as for `AdmissionQueue`"):
            names = ["codel_*", *QUEUE_POLICIES[3:]]
        return [n for name in names for n in (QUEUE_POLICIES[1:3] if name == "codel_*" else [name])] + ["reserved"]
    return re.findall(r"`([a-z_]+)`", cells[1])


@pytest.mark.parametrize("where", list(CLASSES))
def test_the_table_names_exactly_the_keywords_of_the_signature(where: str) -> None:
    function, positional = CLASSES[where]
    keywords = set(inspect.signature(function).parameters) - positional
    named = {name for cells in _rows()[where] for name in _named(cells)}
    assert named == keywords, f"{where}: missing {sorted(keywords - named)}, not a keyword {sorted(named - keywords)}"


def _plain(cell: str) -> object:
    cell = cell.strip("`")
    if cell in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[cell]
    if re.fullmatch(r"-?\d+(\.\d+)?", cell):
        return float(cell)
    if re.fullmatch(r'"[^"]*"', cell):
        return cell.strip('"')
    return inspect.Parameter.empty  # prose: not compared


@pytest.mark.parametrize("where", list(CLASSES))
def test_a_single_plain_default_is_the_signatures(where: str) -> None:
    function, _ = CLASSES[where]
    parameters = inspect.signature(function).parameters
    for cells in _rows()[where]:
        names = _named(cells)
        expected = _plain(cells[2])
        if len(names) != 1 or expected is inspect.Parameter.empty or names[0] not in parameters:
            continue
        default = parameters[names[0]].default
        if isinstance(expected, float) and not isinstance(default, bool) and isinstance(default, (int, float)):
            default = float(default)
        assert default == expected, f"{where} {names[0]}: the table says {cells[2]}, the code {default!r}"
