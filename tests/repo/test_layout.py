"""The package's layout rules, checked by reading the source (nothing is imported).

Every ``.py`` and ``.pyx`` file under ``core/``, ``bindings/`` and ``bench/`` is
a module of ``prazo.core``, ``prazo.bindings`` or ``prazo.bench``. Their import
statements — anywhere in the file, function bodies and ``if TYPE_CHECKING:``
blocks included, relative ones resolved against the importing package — must
keep these rules (docs/design.md, "Layout"):

1. **The arrows point down** (bench -> bindings -> core): nothing in
   ``prazo.core`` imports ``prazo.bindings`` or ``prazo.bench``, and nothing in
   ``prazo.bindings`` imports ``prazo.bench``, with one exception: the
   ``prazo`` command (``prazo.bindings.cli``) imports ``prazo.bench.cli`` in a
   function body, when the command line asks for a demo or a benchmark, never
   at module level.
   Inside ``prazo.bindings`` the integrations (``prazo.bindings.integrations``,
   the modules named after a library they plug into) may import the
   primitives and the plumbing (``prazo.bindings.plumbing``); nothing else in
   ``prazo.bindings`` or ``prazo.core`` imports an integration.
2. **No private name crosses a module boundary.** A *private* name starts with
   one underscore (dunders such as ``__version__`` are not private).
   ``from M import _x`` where ``M._x`` is not a module is always refused: make
   ``_x`` public or move the code. A *private module* (``prazo.core._queue_c``,
   a module whose dotted path has a ``_``-component) may be imported only by
   its own package: the package's ``__init__`` and the sibling modules next to
   it (that is how a package reaches its C twin, e.g. ``prazo.core`` ->
   ``prazo.core._queue_c``, ``prazo.bindings.wsgi`` -> ``prazo.bindings._wsgi_c``).
   A Cython ``cimport`` is exempt from this rule only: it reads the ``.pxd``,
   the C-level interface a twin ships (as package data) for other extensions
   to compile against, not a Python import.
   The test suite (``tests/``) is held to the first half: it imports no
   private *name* of a prazo module. It reaches the two twin modules by path,
   which is what the suite is for.
3. **No import cycles** among prazo modules, whatever the import's place:
   module level, under ``if TYPE_CHECKING:`` (a base module that names its
   adapters for the type checker still knows them) or in a function body (a
   lazy import hides a circle from Python, not from a reader following the
   code: two modules that need each other are one concern in two files).
   ``from P import n`` counts as an import of ``P`` and, when ``P.n`` is a
   module, of ``P.n``.

4. **Nothing reaches out of the package**: no module builds a path from its
   own file up into ``tests/`` or ``examples/`` (a wheel has neither); what
   the bench needs ships in it, or its caller passes it in.

5. **One admission line** (docs/design.md, "Queue policies"): the queue's C
   twin and the front door's face cimport its declarations from
   ``core/prazo_line.pxd``, the front door's engine includes it from
   ``pfd.h``, so both extensions compile ``core/prazo_line.h``; no C or Cython source
   but that line (and ``core/prazo_policy.h``, which defines them) applies the
   policies' state changes (CoDel, the priority rule, Vegas, the learned
   estimate): a second copy of the line would need them.

Run it alone with ``pytest tests/repo/test_layout.py``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_OF_FOLDER = {"core": "prazo.core", "bindings": "prazo.bindings", "bench": "prazo.bench"}

# An import statement in Cython source, which the ast module cannot parse as
# a whole: a (c)import line, or a from-(c)import with a parenthesized list.
_PYX_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)(?P<stmt>from[ \t]+\.*[\w.]*[ \t]+c?import[ \t]+(?:\([^)]*\)|[^\n]*)|c?import[ \t]+[^\n]*)",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Import:
    """One imported thing: ``target`` is a dotted module, ``name`` an attribute of it (or None)."""

    importer: str
    target: str
    name: str | None
    line: int
    module_level: bool
    cimport: bool = False

    def __str__(self) -> str:
        what = self.target if self.name is None else f"{self.name} from {self.target}"
        return f"{self.importer}:{self.line} imports {what}"


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGE_OF_FOLDER[relative.parts[0]], *relative.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> list[Path]:
    return sorted(
        path for folder in PACKAGE_OF_FOLDER for pattern in ("*.py", "*.pyx") for path in (ROOT / folder).rglob(pattern)
    )


MODULES = {module_name(path): path for path in project_files()}


def _statements(tree: ast.AST, module_level: bool = True) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement under ``tree``, and whether it is at module level (not in a function)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, module_level
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _statements(node, False)
        else:
            yield from _statements(node, module_level)


def _resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _imports_of_tree(importer: str, is_package: bool, tree: ast.AST, cimport: bool, line_offset: int) -> list[Import]:
    found = []
    for node, module_level in _statements(tree):
        line = node.lineno + line_offset
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, alias.name, None, line, module_level, cimport))
        else:
            assert isinstance(node, ast.ImportFrom)
            target = _resolve(importer, is_package, node.module, node.level)
            for alias in node.names:
                found.append(Import(importer, target, alias.name, line, module_level, cimport))
    return found


def imports_of(path: Path, importer: str) -> list[Import]:
    is_package = path.stem == "__init__"
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return _imports_of_tree(importer, is_package, ast.parse(source, str(path)), False, 0)
    found = []
    for match in _PYX_IMPORT.finditer(source):
        statement = match["stmt"]
        cimport = re.search(r"\bcimport\b", statement) is not None
        tree = ast.parse(re.sub(r"\bcimport\b", "import", statement))
        if match["indent"]:
            # Indented: inside a def (Cython keeps imports at the top otherwise).
            tree = ast.parse("def _():\n    " + re.sub(r"\bcimport\b", "import", statement))
        offset = source.count("\n", 0, match.start())
        found += _imports_of_tree(importer, is_package, tree, cimport, offset - (1 if match["indent"] else 0))
    return found


ALL_IMPORTS = [found for name, path in MODULES.items() for found in imports_of(path, name)]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _package_of(module: str) -> str:
    return module if MODULES.get(module, Path()).stem == "__init__" else module.rpartition(".")[0]


def _imported_modules(found: Import) -> list[str]:
    """The prazo modules ``found`` makes Python import (the target, and ``target.name`` if a module)."""
    modules = [found.target]
    if found.name is not None and f"{found.target}.{found.name}" in MODULES:
        modules.append(f"{found.target}.{found.name}")
    return [module for module in modules if module == "prazo" or module.startswith("prazo.")]


INTEGRATIONS = "prazo.bindings.integrations"
# (importer, imported): an upward import allowed in a function body only.
LAZY_UPWARD = {("prazo.bindings.cli", "prazo.bench.cli")}


def _within(dotted: str, package: str) -> bool:
    return dotted == package or dotted.startswith(package + ".")


def arrow_violations(imports: list[Import]) -> list[str]:
    forbidden = {"prazo.core": ("prazo.bindings", "prazo.bench"), "prazo.bindings": ("prazo.bench",)}
    problems = []
    for found in imports:
        layer = ".".join(found.importer.split(".")[:2])
        for module in _imported_modules(found):
            dotted = module if found.name is None else f"{module}.{found.name}"
            for above in forbidden.get(layer, ()):
                lazy = not found.module_level and (found.importer, module) in LAZY_UPWARD
                if _within(dotted, above) and not lazy:
                    problems.append(f"{found} (arrow {layer} -> {above} points up)")
            if layer != "prazo.bench" and _within(dotted, INTEGRATIONS) and not _within(found.importer, INTEGRATIONS):
                problems.append(f"{found} (only an integration or the bench imports an integration)")
    return problems


def private_violations(imports: list[Import]) -> list[str]:
    problems = []
    for found in imports:
        if not found.target.startswith("prazo"):
            continue
        if found.name is not None and _private(found.name) and f"{found.target}.{found.name}" not in MODULES:
            problems.append(f"{found} (a private name of another module)")
        if found.cimport:
            continue
        for module in _imported_modules(found):
            parts = module.split(".")
            for depth, part in enumerate(parts):
                if _private(part):
                    owner = ".".join(parts[:depth])
                    if _package_of(found.importer) != owner:
                        problems.append(f"{found} (the private module {'.'.join(parts[: depth + 1])} of {owner})")
                    break
    return problems


def cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components (Tarjan) of more than one module, or with a self-loop."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for found in imports:
        graph[found.importer].update(m for m in _imported_modules(found) if m in MODULES and m != found.importer)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_every_folder_is_found() -> None:
    assert {"prazo.core", "prazo.bindings", "prazo.bench"} <= set(MODULES)


def test_arrows_point_down() -> None:
    assert arrow_violations(ALL_IMPORTS) == []


def test_no_private_name_is_imported_from_another_module() -> None:
    assert private_violations(ALL_IMPORTS) == []


def test_the_tests_import_no_private_name() -> None:
    test_imports = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        test_imports += _imports_of_tree(".".join(relative.parts), False, ast.parse(path.read_text("utf-8")), False, 0)
    private_names = [
        str(found)
        for found in test_imports
        if found.target.startswith("prazo.")
        and found.name is not None
        and _private(found.name)
        and f"{found.target}.{found.name}" not in MODULES
    ]
    assert private_names == []


def test_no_import_cycles() -> None:
    assert cycles(ALL_IMPORTS) == []


def test_a_lazy_import_closes_a_circle_too() -> None:
    # The pool imports the middleware at module level, the middleware the pool in a function body.
    real = [Import("prazo.bindings.wsgi", "prazo.bindings.pool", None, 1, True),
            Import("prazo.bindings.pool", "prazo.bindings.wsgi", None, 9, False)]  # fmt: skip
    assert cycles(real) == [["prazo.bindings.pool", "prazo.bindings.wsgi"]]


@pytest.mark.parametrize(
    ("imports", "rule"),
    [
        ([Import("prazo.core.deadline", "prazo.bindings.wsgi", "X", 1, True)], arrow_violations),
        ([Import("prazo.bindings.pool", "prazo.bench", "cli", 1, False)], arrow_violations),
        ([Import("prazo.bindings.cli", "prazo.bench.cli", "add_commands", 1, True)], arrow_violations),
        ([Import("prazo.bindings.wsgi", "prazo.bindings.integrations.flask", "init_app", 1, False)], arrow_violations),
        (
            [Import("prazo.bindings.plumbing.frameworks", "prazo.bindings.integrations", "django", 1, True)],
            arrow_violations,
        ),
        ([Import("prazo.core", "prazo.bindings.integrations.grpc.server", None, 1, False)], arrow_violations),
        ([Import("prazo.bindings.pool", "prazo.core.deadline", "_now", 1, True)], private_violations),
        ([Import("prazo.bindings.wsgi", "prazo.core._queue_py", "AdmissionQueue", 1, True)], private_violations),
    ],
)
def test_the_rules_catch_what_they_forbid(imports: list[Import], rule: object) -> None:
    assert callable(rule) and rule(imports)


# A path that climbs from the module's own file out of the package's folders.
_REACHING_OUT = re.compile(r"__file__\)[^\n]*(\.parent\.parent|parents\[[1-9]\])")


def test_no_module_reaches_into_the_tests_or_the_examples() -> None:
    # What the package needs ships in it: a wheel has no tests/ or examples/ beside it.
    reaching = [f"{name}: {match.group(0)}" for name, path in MODULES.items()
                for match in _REACHING_OUT.finditer(path.read_text("utf-8"))]  # fmt: skip
    assert reaching == []


def test_the_command_reaches_the_bench_lazily_and_integrations_reach_down() -> None:
    assert arrow_violations([Import("prazo.bindings.cli", "prazo.bench.cli", "add_commands", 1, False)]) == []
    assert arrow_violations([Import("prazo.bindings.integrations.flask", "prazo.bindings.wsgi", "X", 1, True)]) == []
    assert arrow_violations([Import("prazo.bench.servers", "prazo.bindings.integrations.django", "X", 1, True)]) == []


def test_a_package_may_import_its_own_twin_and_a_cimport_reads_a_pxd() -> None:
    assert private_violations([Import("prazo.core", "prazo.core._queue_c", "AdmissionQueue", 1, True)]) == []
    assert private_violations([Import("prazo.bindings._wsgi_c", "prazo.core._queue_c", "X", 1, True, True)]) == []


# -- the documentation site (docs/) -------------------------------------------------------------

# Every page of the site lives where a reader looks for its kind (docs/index.md's tables of
# contents): the entry pages at the top, then one folder per kind. docs/_ext holds the Sphinx
# extension that builds the reference tables from the code; it is no module of prazo.
DOCS = ROOT / "docs"
DOCS_TOP_PAGES = {"index.md", "install.md", "tutorial.md", "design.md"}
DOCS_FOLDERS = {"how-to", "explanation", "reference", "benchmarks", "development"}


def test_every_page_of_the_site_is_in_its_place() -> None:
    misplaced = []
    for page in sorted(DOCS.rglob("*.md")):
        parts = page.relative_to(DOCS).parts
        if "_build" in parts:
            continue
        if (len(parts) == 1 and parts[0] not in DOCS_TOP_PAGES) or (len(parts) > 1 and parts[0] not in DOCS_FOLDERS):
            misplaced.append(str(page.relative_to(ROOT)))
    assert misplaced == [], f"pages outside docs/{{{','.join(sorted(DOCS_FOLDERS))}}}/: {misplaced}"


def test_the_package_never_reaches_into_the_docs() -> None:
    # The site reads the package (autodoc, the reference tables), never the other way round:
    # a wheel has no docs/ beside it.
    reaching = [
        name
        for name, path in MODULES.items()
        if re.search(r"(import|from) prazo_reference\b|[\"']docs/", path.read_text("utf-8"))
    ]
    assert reaching == []


def test_the_docs_extension_imports_only_the_public_package() -> None:
    extension = DOCS / "_ext" / "prazo_reference.py"
    found = _imports_of_tree("prazo_reference", False, ast.parse(extension.read_text("utf-8")), False, 0)
    private = [str(i) for i in found if i.target.startswith("prazo") and (i.name or "").startswith("_")]
    assert private == []


# The calls that move or read a policy's state: only the line makes them.
_POLICY_CALL = re.compile(
    r"\bprazo_(priority_may_start|codel_standing|codel_max_sojourn|codel_note_empty|vegas_sample"
    r"|service_estimate_sample)\s*\("
)
_LINE_ITSELF = {"core/prazo_line.h", "core/prazo_policy.h"}


def test_every_admission_path_runs_the_one_line() -> None:
    # The C that Cython generates from a .pyx is left out: it is the .pyx again.
    # The declarations once (core/prazo_line.pxd), cimported by the queue's twin and the front door's face;
    # the engine's C includes the header itself.
    assert 'cdef extern from "prazo_line.h"' in (ROOT / "core" / "prazo_line.pxd").read_text("utf-8")
    for face in (ROOT / "core" / "_queue_c.pxd", ROOT / "bindings" / "servers" / "frontdoor" / "_engine_c.pyx"):
        assert "from prazo.core.prazo_line cimport *" in face.read_text("utf-8"), face
    assert '#include "prazo_line.h"' in (ROOT / "bindings" / "servers" / "frontdoor" / "engine" / "pfd.h").read_text(
        "utf-8"
    )
    sources = [path for folder in ("core", "bindings") for pattern in ("*.c", "*.h", "*.pyx", "*.pxi", "*.pxd")
               for path in (ROOT / folder).rglob(pattern)
               if "vendor" not in path.parts and not (path.suffix == ".c" and path.with_suffix(".pyx").exists())]  # fmt: skip
    offenders = sorted(str(path.relative_to(ROOT)) for path in sources
                       if str(path.relative_to(ROOT)) not in _LINE_ITSELF and _POLICY_CALL.search(path.read_text("utf-8")))  # fmt: skip
    assert offenders == []


def test_the_one_line_rule_catches_a_second_line() -> None:
    assert _POLICY_CALL.search("if (prazo_priority_may_start(a, b, c, 1, d))")
    assert _POLICY_CALL.search("        limit = prazo_vegas_sample(&v, s, n)")
    assert not _POLICY_CALL.search("prazo_line_may_start(line, 0)")


# -- the map: docs/development/layout.md ----------------------------------------------------------

LAYOUT_MAP = ROOT / "docs" / "development" / "layout.md"
# A line of the map: names (comma-separated, each a file, a glob, ".ext" for the previous file's
# stem, or a folder ending in "/"), then two spaces or more and what they hold. A line whose
# first part is not such a list goes on the description above it.
_MAP_NAME = re.compile(r"[\w*-]*(\.[\w*]+)*/?|\.[\w]+")


def map_entries(text: str) -> tuple[set[str], set[str]]:
    """The files and the folders the map's tree names, as paths from the repository's root."""
    block = text.split("```text", 1)[1].split("```", 1)[0]
    files: set[str] = set()
    folders: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = [name.strip() for name in re.split(r"\s{2,}", line.strip())[0].split(",")]
        if not all(name and _MAP_NAME.fullmatch(name) for name in names):
            continue  # a description going on
        while stack and stack[-1][0] >= indent:
            stack.pop()
        base = "/".join(folder.rstrip("/") for _, folder in stack)
        stem = ""
        for name in names:
            if name.endswith("/"):
                folders.add(f"{base}/{name.rstrip('/')}".lstrip("/"))
                stack.append((indent, name))
            elif name.startswith("."):
                files.add(f"{base}/{stem}{name}".lstrip("/"))
            else:
                stem = name.rsplit(".", 1)[0]
                files.add(f"{base}/{name}".lstrip("/"))
    return files, folders


def _mapped(path: str, files: set[str]) -> bool:
    return any(Path(path).match(pattern) and path.count("/") == pattern.count("/") for pattern in files)


def test_the_map_parses_names_folders_and_descriptions() -> None:
    text = "```text\ncore/  the core\n  a.py, .pyi  one\n  sub/  more\n    b_*.c  globbed\n                the a.py line goes on\n  c.py  two\n```"
    assert map_entries(text) == ({"core/a.py", "core/a.pyi", "core/sub/b_*.c", "core/c.py"}, {"core", "core/sub"})


def test_the_map_names_every_module_and_only_what_exists() -> None:
    files, folders = map_entries(LAYOUT_MAP.read_text("utf-8"))
    modules = sorted(str(path.relative_to(ROOT)) for path in project_files() if path.name != "__init__.py"
                     and "vendor" not in path.parts)  # fmt: skip
    missing = [module for module in modules if not _mapped(module, files)]
    assert missing == [], f"modules the map (docs/development/layout.md) does not name: {missing}"
    gone = sorted(pattern for pattern in files if not list(ROOT.glob(pattern)))
    assert gone == [], f"files the map names that do not exist: {gone}"
    assert sorted(folder for folder in folders if not (ROOT / folder).is_dir()) == []


# "Why one file of about N lines" (or "1 250", "1,300") in a module's header: a claim the file keeps.
_SIZE_CLAIM = re.compile(r"Why one (?:file|module) of about ([\d][\d ,]*) lines")


def test_a_size_claim_is_within_a_quarter_of_the_file() -> None:
    wrong = []
    for path in sorted(p for folder in PACKAGE_OF_FOLDER for pattern in ("*.py", "*.pyx", "*.h")
                       for p in (ROOT / folder).rglob(pattern)):  # fmt: skip
        text = path.read_text("utf-8")
        for match in _SIZE_CLAIM.finditer(text):
            claimed = int(re.sub(r"[ ,]", "", match.group(1)))
            actual = text.count("\n")
            if not 0.75 * actual <= claimed <= 1.25 * actual:
                wrong.append(f"{path.relative_to(ROOT)}: says about {claimed} lines, has {actual}")
    assert wrong == []


# Inside prazo.bindings.servers the imports go down this list (docs/development/layout.md):
# the settings, what every server shares, prazo's own server, the embeddings, the command.
SERVERS = "prazo.bindings.servers"
_SERVER_RANKS = {
    f"{SERVERS}.settings": 0,
    f"{SERVERS}.plumbing": 1,
    f"{SERVERS}.frontdoor": 2,
    **{f"{SERVERS}.{name}": 3 for name in ("waitress", "gunicorn", "cheroot", "werkzeug", "wsgiref")},
    f"{SERVERS}.serve": 4,
}


def _server_rank(module: str) -> int | None:
    for prefix, rank in _SERVER_RANKS.items():
        if _within(module, prefix):
            return rank
    return None


def upward_server_imports(imports: list[Import]) -> list[str]:
    problems = []
    for found in imports:
        rank = _server_rank(found.importer)
        for module in _imported_modules(found):
            target = _server_rank(module)
            if rank is not None and target is not None and target > rank:
                problems.append(f"{found} (servers: rank {rank} imports rank {target})")
    return problems


def test_every_servers_module_has_a_rank() -> None:
    unranked = [name for name in MODULES if _within(name, SERVERS) and name != SERVERS and _server_rank(name) is None]
    assert unranked == []


def test_inside_servers_imports_go_down_the_list() -> None:
    assert upward_server_imports(ALL_IMPORTS) == []
    assert upward_server_imports([Import(f"{SERVERS}.plumbing.heads", f"{SERVERS}.frontdoor", "server", 1, False)])
