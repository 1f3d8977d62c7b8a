"""Reading the README and the pages of ``docs/``: their sections, fenced blocks and test markers.

Every fenced block of ``README.md`` and ``docs/**/*.md`` is run by the test suite, one way
(``tests/docs/test_examples.py``, with Sybil), unless the HTML comment right above it says
who runs it instead:

``<!-- tested-by: tests/FOLDER/test_FILE.py::test_NAME -->``
    a test that needs more than the page gives (a PostgreSQL server, a Django project's
    shell, a check of what the block built) reads the block from the page with
    ``section`` / ``fenced_blocks`` below and runs it as written;
``<!-- not-run: REASON -->``
    a block no test can run as written (it installs packages, runs for minutes,
    reaches hosts that do not exist here); ``tests/docs/test_examples.py`` keeps the
    list of these, so a new one is a decision, not an accident.

A fence of a MyST directive (`` ```{literalinclude} ``, `` ```{toctree} ``, ...) is no code
block: what it includes is a file that its own tests run. A `` ```text `` block is output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_MARKER = re.compile(r"<!--\s*(tested-by|not-run):\s*(.*?)\s*-->")
_FENCE = re.compile(r"^( *`{3,})(.*)$")  # a fence in a list item is indented


def pages() -> list[Path]:
    """The README and every Markdown page of the site (what the site and its tests see)."""
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]


def text(page: str | Path = "README.md") -> str:
    return (ROOT / page).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Block:
    """One fenced block: its first and last lines (1-based, the fences), its info string, its text."""

    page: Path
    line: int
    end: int
    info: str
    source: str
    marker: tuple[str, str] | None  # ("tested-by", "tests/...::test_x") or ("not-run", reason)

    @property
    def directive(self) -> bool:
        return self.info.startswith("{")

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.info or 'no language'})"


def blocks(page: str | Path) -> list[Block]:
    """Every fenced block of ``page``, in order, with the marker comment right above it."""
    path = ROOT / page
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    found: list[Block] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index].rstrip("\n"))
        if not match:
            index += 1
            continue
        ticks, info = match.group(1), match.group(2).strip()
        end = index + 1
        while end < len(lines) and lines[end].rstrip("\n") != ticks:
            end += 1
        above = index - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = _MARKER.fullmatch(lines[above].strip()) if above >= 0 else None
        found.append(
            Block(
                path,
                index + 1,
                end + 1,
                info,
                "".join(lines[index + 1 : end]),
                (marker.group(1), marker.group(2)) if marker else None,
            )
        )
        index = end + 1
    return found


def section(heading: str, page: str | Path = "README.md") -> str:
    """The page from ``heading`` to the next heading of the same or a higher level.

    Lines inside fenced blocks are not headings: configs' and scripts' own comments start with ``#``.
    """
    lines = text(page).splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line == heading + "\n"]
    assert len(starts) == 1, f"{page} has no single {heading!r} section"
    level = len(heading.split(" ", 1)[0])
    in_fence = False
    for end in range(starts[0] + 1, len(lines)):
        line = lines[end]
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(rf"#{{1,{level}}} ", line):
            break
    else:
        end = len(lines)
    return "".join(lines[starts[0] : end])


def fenced_blocks(text: str, info: str) -> list[str]:
    """Each ```info block's text, with the newline that ends its last line (as in a file)."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?\n)```$", text, re.MULTILINE | re.DOTALL)
