"""Reading README.md's sections and fenced blocks, for the tests that hold the README to the code."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def section(heading: str) -> str:
    """The README from ``heading`` to the next heading of the same or a higher level.

    Lines inside fenced blocks are not headings: configs' and scripts' own comments start with ``#``.
    """
    lines = README.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line == heading + "\n"]
    assert len(starts) == 1, f"README.md has no single {heading!r} section"
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
