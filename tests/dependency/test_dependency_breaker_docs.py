"""The breaker and last-known-good examples run as written and print what they say.

The section of ``docs/how-to/slow-dependency.md`` runs from "## Circuit breaker"
up to the first heading after "## Last-known-good". Each ``python`` block
runs in a fresh namespace: one with ``>>>`` prompts as a doctest (its outputs
are checked), one without as a script.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST, LAST = "## Circuit breaker", "## Last-known-good"


def section() -> tuple[Path, str]:
    path = ROOT / "docs" / "how-to" / "slow-dependency.md"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == FIRST]
    if not starts:
        pytest.fail(f"no {FIRST!r} section in {path}")
    taken, fenced, seen_last = [], False, False
    for line in lines[starts[0] :]:
        if line.startswith("```"):
            fenced = not fenced
        elif seen_last and not fenced and re.match(r"#{1,2} ", line) and line.strip() not in (FIRST, LAST):
            break
        seen_last = seen_last or line.strip() == LAST
        taken.append(line)
    return path, "".join(taken)


DOC, TEXT = section()
BLOCKS = re.findall(r"^```python\n(.*?)^```$", TEXT, re.MULTILINE | re.DOTALL)


def test_the_doc_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    source = BLOCKS[index]
    if ">>>" in source:
        test = doctest.DocTestParser().get_doctest(source, {}, f"{DOC.name}[{index}]", str(DOC), 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        assert runner.failures == 0, capsys.readouterr().out
    else:
        exec(compile(source, f"{DOC.name}[{index}]", "exec"), {"__name__": "__doc_example__"})  # noqa: S102 - the example is what is tested
        printed = capsys.readouterr().out
        for expected in re.findall(r"print\(.*\)\s+# (.+)$", source, re.MULTILINE):
            assert expected in printed
