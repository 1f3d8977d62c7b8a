"""The examples in docs/dependency-breaker.md run as written and print what they say.

Each ``python`` block runs in a fresh namespace: one with ``>>>`` prompts as a
doctest (its outputs are checked), one without as a script.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "dependency-breaker.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


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
