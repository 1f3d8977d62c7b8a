"""The argument rules every layer shares (``prazo.core.arguments``): one count check, one yes/no parser."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prazo.core.arguments import INT32_LIMIT, checked_count, env_flag, parse_flag

YES = ["1", "true", "yes", "on", "TRUE", " Yes ", "On"]
NO = ["0", "false", "no", "off", "FALSE", " No ", "Off"]


@pytest.mark.parametrize("word", YES)
def test_a_yes_word_is_true_in_any_case(word: str) -> None:
    assert parse_flag(word, "PRAZO_X") is True


@pytest.mark.parametrize("word", NO)
def test_a_no_word_is_false_in_any_case(word: str) -> None:
    assert parse_flag(word, "PRAZO_X") is False


@pytest.mark.parametrize("word", ["2", "y", "enabled", "truthy", "o n"])
def test_any_other_word_is_refused_naming_the_variable(word: str) -> None:
    with pytest.raises(ValueError, match="PRAZO_X must be 1/0, true/false, yes/no or on/off"):
        parse_flag(word, "PRAZO_X")


def test_an_unset_or_blank_variable_is_not_given() -> None:
    assert env_flag({}, "PRAZO_X") is None
    assert env_flag({"PRAZO_X": "  "}, "PRAZO_X") is None
    assert env_flag({"PRAZO_X": "on"}, "PRAZO_X") is True


@pytest.mark.parametrize(("word", "implementation"), [("on", "py"), ("OFF", None)])
def test_prazo_core_reads_prazo_no_extensions_with_the_same_words(word: str, implementation: str | None) -> None:
    env = {**os.environ, "PRAZO_NO_EXTENSIONS": word}
    code = "import prazo.core as c; print(c.extension_wanted())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(implementation is None)


def test_prazo_core_refuses_a_word_that_is_neither() -> None:
    env = {**os.environ, "PRAZO_NO_EXTENSIONS": "maybe"}
    command = [sys.executable, "-c", "import prazo.core"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert run.returncode != 0
    assert "PRAZO_NO_EXTENSIONS must be 1/0" in run.stderr


def test_a_count_is_an_int_not_a_bool_within_its_bounds() -> None:
    assert checked_count(3, "n", 1) == 3
    with pytest.raises(TypeError, match="n must be an int, not bool"):
        checked_count(True, "n", 0)
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        checked_count(0, "n", 1)
    with pytest.raises(ValueError, match=r"n must be < 2\*\*31, got 2147483648"):
        checked_count(INT32_LIMIT, "n", 0, below=INT32_LIMIT)
    with pytest.raises(ValueError, match=r"^too few$"):
        checked_count(0, "n", 1, too_small="too few")
