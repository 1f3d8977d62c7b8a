"""The fuzz seed corpus replayed through each target, without atheris.

Every file under ``tests/fuzz/corpus/TARGET/`` goes through
``fuzz.fuzz_TARGET.test_one_input``, which asserts the target's properties
(see ``tests/fuzz``). So the seeds stay valid inputs, a crash once found stays
fixed, and a target that no longer imports or runs fails the normal suite
rather than only ``make fuzz``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "fuzz" / "corpus"
SEEDS = sorted(path for path in CORPUS.glob("*/*") if path.is_file())


def test_every_target_has_seeds() -> None:
    targets = {path.stem.removeprefix("fuzz_") for path in CORPUS.parent.glob("fuzz_*.py")}
    assert targets and targets == {path.parent.name for path in SEEDS}


@pytest.mark.parametrize("seed", SEEDS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_seed_passes_its_target(seed: Path) -> None:
    target = importlib.import_module(f"fuzz.fuzz_{seed.parent.name}")
    target.test_one_input(seed.read_bytes())
