"""Every ``pip install 'prazo[...]'`` the README and the docs show brings what their examples import.

A reader installs what a page names and runs its examples: the README's install
block is the baseline every page assumes (it is the entry page), and a page adds
the extras it names itself (``prazo[django]`` in its prose or its blocks). What the
page's examples import, its ``python`` blocks and the files of ``examples/`` it runs
or includes, must then be importable: the standard library, prazo itself, or a
distribution that those extras bring, directly or through what they depend on.

The extras are read from the installed package's metadata, so the same test holds
the wheel's extras to the docs when ``make dist-check`` runs it from the wheel.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from _docs import ROOT, blocks, pages
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

README_INSTALL = "README.md"
NAMED_EXTRAS = re.compile(r"prazo\[([\w,\s-]+)\]")
# A reference to a file of examples/: a module path (examples.flask_app) or a file or folder path.
EXAMPLE = re.compile(r"\bexamples[./]([\w./]*\w)")


def named_extras(page: Path) -> set[str]:
    """The extras a page names in ``prazo[...]``, in its prose or its blocks."""
    text = page.read_text(encoding="utf-8")
    return {extra.strip() for group in NAMED_EXTRAS.findall(text) for extra in group.split(",") if extra.strip()}


def _requirements(distribution: str, extras: set[str] = frozenset()) -> set[str]:
    """What ``distribution`` installs with ``extras``: the canonical names of its requirements."""
    wanted = set()
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
        if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
            wanted.add(canonicalize_name(requirement.name))
    return wanted


def installed_by(extras: set[str]) -> set[str]:
    """Every distribution ``pip install 'prazo[extras]'`` brings, dependencies of dependencies included."""
    found, todo = set(), _requirements("prazo", extras)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            todo |= _requirements(name)
        except metadata.PackageNotFoundError:  # a requirement of this platform's markers, not installed here
            continue
    return found


def _imports(source: str) -> set[str]:
    """The top-level names a piece of Python imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _example_files(text: str) -> set[Path]:
    """The files of examples/ a text runs or includes (a folder: every .py in it)."""
    files = set()
    for reference in EXAMPLE.findall(text):
        for candidate in (
            (ROOT / "examples" / reference.replace(".", "/")).with_suffix(".py"),
            ROOT / "examples" / reference,
        ):
            if candidate.is_file() and candidate.suffix == ".py":
                files.add(candidate)
            elif candidate.is_dir():
                files |= set(candidate.rglob("*.py"))
    return files


def _code(source: str) -> str:
    """A block's Python: a doctest's statements without its prompts and outputs, else the block."""
    source = textwrap.dedent(source)  # a block in a list item is indented
    if not source.startswith(">>>"):
        return source
    return "".join(line[4:] for line in source.splitlines(keepends=True) if line.startswith((">>> ", "... ")))


def page_imports(page: Path) -> dict[str, str]:
    """Each top-level name the page's examples import, with where (a block's line or an example's file)."""
    where: dict[str, str] = {}
    text = page.read_text(encoding="utf-8")
    for block in blocks(page):
        if block.info == "python":
            for name in _imports(_code(block.source)):
                where.setdefault(name, f"{page.relative_to(ROOT)}:{block.line}")
    for path in sorted(_example_files(text)):
        for name in _imports(path.read_text(encoding="utf-8")):
            where.setdefault(name, str(path.relative_to(ROOT)))
    return where


# The examples' own modules (the Django example project's seedsite, ...): modules of examples/, not installed.
EXAMPLE_MODULES = {path.stem for path in (ROOT / "examples").rglob("*.py")} | {
    path.parent.name for path in (ROOT / "examples").rglob("__init__.py")
}


def _third_party(name: str) -> bool:
    return name not in sys.stdlib_module_names and name not in {"prazo", "examples", "__future__", *EXAMPLE_MODULES}


def _providers() -> dict[str, set[str]]:
    """Each importable top-level name with the distributions that install it.

    importlib.metadata.packages_distributions() reads only top_level.txt on Python 3.10,
    which the wheels of flit or hatchling (flask, werkzeug, httpx) do not have; what a
    distribution installs is in its RECORD on every version.
    """
    providers: dict[str, set[str]] = {}
    for distribution in metadata.distributions():
        names = set((distribution.read_text("top_level.txt") or "").split())
        for path in distribution.files or []:
            top = path.parts[0]
            if len(path.parts) > 1 and top.isidentifier():
                names.add(top)  # a package's folder
            elif len(path.parts) == 1 and path.suffix in (".py", ".so"):
                names.add(top.split(".", 1)[0])  # a module of its own (an extension's name ends at its first dot)
        for name in names:
            providers.setdefault(name, set()).add(canonicalize_name(distribution.metadata["Name"]))
    return providers


PROVIDERS = _providers()
BASELINE = named_extras(ROOT / README_INSTALL)


def test_the_readme_install_block_names_extras():
    # The baseline the rest leans on: if the README named none, every page would have to.
    assert {"servers", "clients", "metrics"} <= BASELINE


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_the_extras_a_page_names_install_what_its_examples_import(page: Path):
    extras = BASELINE | named_extras(page)
    unknown = extras - set(metadata.metadata("prazo").get_all("Provides-Extra") or [])
    assert not unknown, f"{page.relative_to(ROOT)} names extras prazo does not have: {sorted(unknown)}"
    brought = installed_by(extras)
    gaps = []
    for name, where in sorted(page_imports(page).items()):
        if not _third_party(name):
            continue
        providers = PROVIDERS.get(name, set())
        if not providers:
            gaps.append(f"{where} imports {name}, which no installed distribution provides")
        elif not providers & brought:
            gaps.append(
                f"{where} imports {name} ({', '.join(sorted(providers))}), which prazo[{','.join(sorted(extras))}] "
                "does not install: name the extra on the page (or in the README's install block)"
            )
    assert not gaps, "\n".join(gaps)


def test_the_check_sees_a_gap():
    # Flask's example under the README's extras alone, with flask taken out: the test above must see it.
    without_flask = installed_by(BASELINE - {"flask"})
    assert "flask" not in without_flask
    assert "flask" in page_imports(ROOT / README_INSTALL)
    assert "werkzeug" in without_flask  # and what the servers extra brings is seen as brought
