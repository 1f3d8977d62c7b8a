"""Every ``>>>`` example in a docstring of ``prazo.core`` and ``prazo.bindings`` runs and prints what it says.

The modules are imported as an application imports them (``prazo.core``, not
``core``: ``setup.py`` maps the folders into the namespace), the compiled twins
included, and their doctests found by the standard library's ``doctest``, with
``ELLIPSIS``. An example that truly cannot run carries ``# doctest: +SKIP`` and a
comment saying why. The finder cannot walk a module whose members refuse to be
looked at (Django's lazy ``settings``, unconfigured in a test process, raises on
any attribute): such a module must then have no ``>>>`` in its source at all.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

_PACKAGES = ("prazo.core", "prazo.bindings")


def _modules() -> list[str]:
    names = []
    for package_name in _PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, package_name + ".")]
    return sorted(names)


MODULES = _modules()


def _doctests(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    try:
        found = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    except Exception:  # noqa: BLE001 - a member that refuses inspection (see the module docstring)
        source = inspect.getsource(module)
        assert ">>>" not in source, f"{name} has examples the finder cannot reach"
        return []
    return [test for test in found if test.name == name or test.name.startswith(name + ".")]


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_run(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in _doctests(name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_the_docstrings_have_examples() -> None:
    """The finder sees them (an import that went wrong would find none and pass)."""
    count = sum(len(test.examples) for name in MODULES for test in _doctests(name))
    assert count >= 90, count
