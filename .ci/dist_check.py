"""Check what a user gets from a package index: `make dist-check` and `make test-versions` run this.

`make dist-check` (python .ci/dist_check.py OUT_DIR --extras EXTRAS):

1. The files a fresh clone would hold (git's tracked and not-ignored files of the
   working tree, uncommitted changes included) are copied apart, and `python -m
   build` makes the sdist there, then the wheel *from that sdist* (so a file missing
   from the sdist breaks the wheel build). Any setuptools warning in the build's
   output fails the check.
2. Their contents: the sdist holds the sources and no generated or cached file;
   the wheel holds exactly the tree's modules (every .py under the folders setup.py
   maps, a compiled module for every .pyx), named one by one when one is missing
   or extra, and nothing but modules, stubs, Cython declarations and headers
   (no plots, results or notes).
3. The wheel is installed into a fresh virtualenv with the extras the tests use,
   as a user would (`pip install 'prazo-….whl[…]'`). There every module of the
   installed package imports, the `prazo` command runs (`--version`, `bench
   --help`, `demo`, `serve` on each server answering a real request), and the
   whole suite runs from a copy of the tests, the docs, the README and the
   examples in a directory of their own, where nothing of the repository is on
   sys.path to stand in for the installed package (`.venv` there is the
   virtualenv, so the recipes' `.venv/bin/prazo` is the installed command). Left
   out: `tests/repo` alone, which checks the repository itself (the layout rules
   read the source tree; the file sizes and the fuzz seeds are the repository's).
4. The sdist is installed the same way (pip builds the C twins again, through its
   own isolated build) and runs the core, bindings and docs suites: the wheel ran
   everything, the sdist proves its own build.
5. A third virtualenv installs the sdist with PRAZO_NO_EXTENSIONS=1 (no compiler
   involved) and runs the core suite on the Python twin alone.

`make test-versions` (python .ci/dist_check.py OUT_DIR --extras EXTRAS --pythons 3.10,3.12,3.13):
for every other CPython the project claims (requires-python), found through pyenv,
a wheel is built from the sdist with that interpreter, installed into a virtualenv of
it with the extras, checked as in 3 (compiled modules, every module imports) and runs
the core, bindings and docs suites.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the copied suite needs beside tests/: the pages and examples tests/docs runs,
# and pyproject.toml for pytest's settings (markers, warnings as errors, pythonpath).
SUITE_FILES = ["tests", "docs", "examples", "README.md", "pyproject.toml"]
# Checks of the repository itself, not of the package: the layout rules read the
# source tree, the file sizes and fuzz seeds are the repository's.
SUITE_LEFT_OUT = ["tests/repo"]
# The suites a second build (the sdist's, another CPython's) runs: the queue and its
# twins, the bindings around them, and every example of the README and the docs.
SHORT_SUITE = ["tests/core", "tests/bindings", "tests/docs"]

SDIST_REQUIRED = [
    "README.md",
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "core/_queue_c.pyx",
    "core/_queue_c.pxd",
    "core/prazo_line.h",
    "core/prazo_line.pxd",
    "core/_histogram_c.pyx",
    "core/py.typed",
    "bindings/_wsgi_c.pyx",
    "bindings/_pool_c.pyx",
    "bindings/servers/frontdoor/_engine_c.pyx",
    "bindings/servers/frontdoor/engine/pfd.h",
    "bindings/vendor/picohttpparser/picohttpparser.c",
    "bindings/vendor/picohttpparser/picohttpparser.h",
    "bench/RESULTS.md",
    "tests/conftest.py",
    "tests/fuzz/c/fuzz_frontdoor.c",
    "docs/index.md",
    "examples/flask_app.py",
]
# What a build or a test run leaves in a tree: never in an sdist.
LEFT_BY_RUNS = re.compile(r"(^|/)__pycache__/|\.py[cod]$|\.so$|\.html$|(^|/)build/")
# What the installed package may hold beside its modules (setup.py's PACKAGE_DATA).
WHEEL_DATA = re.compile(r"(\.pyi|\.pxd|\.h|/py\.typed)$")
# A line of setuptools' (or distutils') own warnings in the build's output. pip's
# "WARNING: ..." lines (its index configuration) are the machine's, not the build's.
SETUPTOOLS_WARNING = re.compile(r"^warning: |\b[A-Z]\w*Warning\b|Package would be ignored|^\s*!!\s*$", re.MULTILINE)

# prazo comes from the virtualenv, every compiled module loads, the C twin is the one
# prazo.core picked, and the fallback warning (a RuntimeWarning) is an error here.
CHECK_INSTALLED = "import sys, prazo.core; assert prazo.core.__file__.startswith(sys.prefix), prazo.core.__file__;"
CHECK_COMPILED = CHECK_INSTALLED + (
    "import prazo.core._histogram_c, prazo.bindings._wsgi_c, prazo.bindings.wsgi, prazo.bindings.pool,"
    " prazo.bindings.servers.frontdoor._engine_c, prazo.bindings.servers.plumbing._heads_c, prazo.bindings._pool_c;"
    "assert prazo.core.IMPLEMENTATION == 'c', prazo.core.IMPLEMENTATION;"
    "assert prazo.bindings.pool.compiled_path(), 'the pool did not pick its compiled path'"
)
CHECK_PYTHON_TWIN = CHECK_INSTALLED + "import prazo.bindings.wsgi; assert prazo.core.IMPLEMENTATION == 'py'"

# Run in the installed virtualenv with the expected module names on stdin: every
# module of the installed prazo is found by walking the package and imported; a module
# expected but not found, found but not expected, or failing to import is named.
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys, traceback
import prazo
expected = set(sys.stdin.read().split())
found = {info.name for info in pkgutil.walk_packages(prazo.__path__, "prazo.")}
problems = [f"not installed: {name}" for name in sorted(expected - found)]
problems += [f"installed but not in the tree: {name}" for name in sorted(found - expected)]
for name in sorted(found):
    try:
        module = importlib.import_module(name)
    except BaseException:  # a module that exits or skips on import is a finding too
        problems.append(f"import {name} failed:\\n" + traceback.format_exc())
    else:
        assert module.__file__.startswith(sys.prefix), module.__file__
print(f"    imported {len(found)} modules of the installed prazo")
sys.exit("\\n".join(problems) or None)
"""

# `prazo serve` on every server, each answering one real request on a free port.
SERVERS = ["waitress", "gunicorn", "werkzeug", "wsgiref", "cheroot", "prazo"]
SERVED_APP = """\
def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"served from the wheel\\n"]
"""


def step(title: str) -> None:
    print(f"\n=== dist-check: {title}", flush=True)


def run(*cmd: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None, stdin: str | None = None) -> None:
    started = time.monotonic()
    subprocess.run(
        [str(c) for c in cmd], check=True, cwd=cwd, env={**os.environ, **(env or {})}, input=stdin, text=True
    )
    print(f"    ({time.monotonic() - started:.0f} s)", flush=True)


def mapped_folders() -> dict[str, str]:
    """setup.py's PACKAGE_DIR (package -> folder), read from its source: the one mapping."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets):
            return dict(ast.literal_eval(node.value))
    sys.exit("dist-check: setup.py defines no PACKAGE_DIR")


def tree_modules(source: Path) -> set[str]:
    """Every module the tree defines: each .py and .pyx below a folder setup.py maps."""
    modules = set()
    for package, folder in mapped_folders().items():
        for path in (source / folder).rglob("*"):
            if path.suffix in (".py", ".pyx") and "__pycache__" not in path.parts:
                parts = path.relative_to(source / folder).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules.add(".".join((package, *parts)))
    return modules


def wheel_modules(names: set[str]) -> set[str]:
    """The modules a wheel holds: its .py files and its compiled extensions."""
    modules = set()
    for name in names:
        if name.startswith("prazo/") and name.endswith((".py", ".so")):
            stem = name[: -len(".py")] if name.endswith(".py") else name.split(".", 1)[0]
            parts = stem.split("/")
            modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def export_tree(target: Path) -> Path:
    """The working tree as a fresh clone would hold it: git's tracked and not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def build(out: Path) -> tuple[Path, Path]:
    """The sdist, then the wheel from it; a setuptools warning anywhere in the output fails."""
    source = export_tree(out / "source")
    dist = out / "dist"
    # Byte-compiling on: with PYTHONDONTWRITEBYTECODE set, setuptools says it skips it (a warning of ours to none).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(source)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    (out / "build.log").write_text(result.stdout + result.stderr)
    if result.returncode:
        sys.exit(f"dist-check: python -m build failed:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if SETUPTOOLS_WARNING.search(line)]
    if warnings:
        sys.exit("dist-check: python -m build warned (whole output in build.log):\n  " + "\n  ".join(warnings))
    print(f"    built with no setuptools warning ({time.monotonic() - started:.0f} s)", flush=True)
    (sdist,) = dist.glob("prazo-*.tar.gz")
    (wheel,) = dist.glob("prazo-*.whl")
    return sdist, wheel


def check_contents(sdist: Path, wheel: Path, source: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    problems = [f"sdist lacks {name}" for name in SDIST_REQUIRED if name not in names]
    # Generated C is rebuilt from the .pyx; a shipped copy could be stale. Any other C
    # (the front door's engine, the vendored parser, the fuzz harness) is a source.
    problems += [
        f"sdist ships {name}"
        for name in sorted(names)
        if LEFT_BY_RUNS.search(name) or (name.endswith(".c") and f"{name[:-2]}.pyx" in names)
    ]
    with zipfile.ZipFile(wheel) as whl:
        names = {name for name in whl.namelist() if not name.startswith("prazo-")}  # less the .dist-info
    expected, shipped = tree_modules(source), wheel_modules(names)
    problems += [f"wheel lacks the module {name}" for name in sorted(expected - shipped)]
    problems += [f"wheel has a module the tree has not: {name}" for name in sorted(shipped - expected)]
    problems += [
        f"wheel carries {name}, which the installed package does not need"
        for name in sorted(names)
        if not name.endswith((".py", ".so")) and not WHEEL_DATA.search(name)
    ]
    if problems:
        sys.exit("dist-check: " + "\n  ".join(["the artifacts are wrong:", *problems]))
    print(f"    {sdist.name} holds the sources; {wheel.name} holds the {len(expected)} modules of the tree and no more")


def install(out: Path, name: str, artifact: Path, extras: str, python: str = sys.executable, env=None) -> Path:
    """A fresh virtualenv of ``python`` holding the artifact with ``extras``; its python."""
    home = out / f"venv-{name}"
    if python == sys.executable:
        venv.create(home, with_pip=True)
    else:
        run(python, "-m", "venv", home)
    installed = home / "bin" / "python"
    # No wheel cache: pip would key a wheel built from the sdist on its path alone, and
    # hand the next run (or the PRAZO_NO_EXTENSIONS=1 install) a stale build.
    requirement = f"{artifact}[{extras}]" if extras else str(artifact)
    run(installed, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-cache-dir", requirement, env=env)
    return installed


def import_every_module(python: Path, source: Path, cwd: Path) -> None:
    run(
        python, "-W", "error::RuntimeWarning", "-c", IMPORT_EVERY_MODULE, cwd=cwd, stdin="\n".join(tree_modules(source))
    )


def suite_copy(out: Path, name: str, python: Path) -> Path:
    """The tests, docs, README and examples in a directory of their own, `.venv` being ``python``'s.

    Copied from the exported tree the artifacts were built from, not from the working tree,
    which may have changed since (the suites of a run all test one snapshot).
    """
    where = out / f"tests-{name}"
    for part in SUITE_FILES:
        source, target = out / "source" / part, where / part
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]"))
        else:
            shutil.copy2(source, target)
    for part in SUITE_LEFT_OUT:
        shutil.rmtree(where / part)
    (where / ".venv").symlink_to(python.parent.parent)
    return where


def run_suite(where: Path, python: Path, folders: list[str], workers: int, env=None) -> None:
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers else []
    run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, *folders, cwd=where, env=env)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve_each_server(python: Path, cwd: Path) -> None:
    """`prazo serve` from the installed command, on every server, answers a real request and stops on SIGTERM."""
    import signal
    import urllib.request

    (cwd / "served_app.py").write_text(SERVED_APP)
    prazo = python.parent / "prazo"
    for server in SERVERS:
        port = free_port()
        started = time.monotonic()
        process = subprocess.Popen(
            [prazo, "serve", "served_app:app", "--server", server, "--port", str(port), "--threads", "2"], cwd=cwd
        )
        try:
            body = None
            while body is None and time.monotonic() - started < 60 and process.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                        body = response.read()
                except OSError:
                    time.sleep(0.2)
            if body != b"served from the wheel\n":
                sys.exit(f"dist-check: prazo serve --server {server} did not answer (exit {process.poll()}, {body!r})")
        finally:
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=60)
        if status not in (0, -signal.SIGTERM):
            sys.exit(f"dist-check: prazo serve --server {server} exited {status} on SIGTERM")
        print(f"    prazo serve --server {server}: answered, stopped ({time.monotonic() - started:.1f} s)", flush=True)


def check_wheel(out: Path, wheel: Path, source: Path, extras: str, workers: int) -> None:
    step(f"install the wheel with [{extras}]: every module, the command, the whole suite")
    python = install(out, "wheel", wheel, extras)
    run(python, "-W", "error", "-c", CHECK_COMPILED, cwd=out)
    run(python, "-c", CHECK_PYTHON_TWIN, cwd=out, env={"PRAZO_NO_EXTENSIONS": "1"})
    import_every_module(python, source, out)
    prazo = python.parent / "prazo"
    run(prazo, "--version", cwd=out)
    run(prazo, "bench", "--help", cwd=out)
    run(prazo, "demo", cwd=out)
    serve_each_server(python, out)
    run_suite(suite_copy(out, "wheel", python), python, ["tests"], workers)


def check_sdist(out: Path, sdist: Path, extras: str, workers: int) -> None:
    step(f"install the sdist with [{extras}] (pip builds it), run {', '.join(SHORT_SUITE)}")
    python = install(out, "sdist", sdist, extras)
    run(python, "-W", "error", "-c", CHECK_COMPILED, cwd=out)
    run_suite(suite_copy(out, "sdist", python), python, SHORT_SUITE, workers)

    step("install the sdist with PRAZO_NO_EXTENSIONS=1, run the core suite on the Python twin")
    pure = {"PRAZO_NO_EXTENSIONS": "1"}
    python = install(out, "pure", sdist, "test", env=pure)
    run(python, "-W", "error", "-c", CHECK_PYTHON_TWIN, cwd=out, env=pure)
    run_suite(suite_copy(out, "pure", python), python, ["tests/core"], workers, env=pure)


def pyenv_python(version: str) -> str:
    """The interpreter of CPython ``version`` (3.10, ...) that pyenv holds; a missing one fails."""
    try:
        versions = subprocess.run(["pyenv", "versions", "--bare"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"dist-check: pyenv is needed to find CPython {version} ({exc})")
    matching = sorted(
        (v for v in versions.split() if re.fullmatch(rf"{re.escape(version)}\.\d+", v)),
        key=lambda v: int(v.rsplit(".", 1)[1]),
    )
    if not matching:
        sys.exit(f"dist-check: no CPython {version} in pyenv (`pyenv versions` lists: {' '.join(versions.split())})")
    prefix = subprocess.run(["pyenv", "prefix", matching[-1]], check=True, capture_output=True, text=True).stdout
    return str(Path(prefix.strip()) / "bin" / "python")


def check_versions(out: Path, sdist: Path, source: Path, extras: str, versions: list[str], workers: int) -> None:
    for version in versions:
        python = pyenv_python(version)
        step(f"CPython {version} ({python}): a wheel from the sdist, every module, {', '.join(SHORT_SUITE)}")
        wheels = out / f"wheels-{version}"
        run(python, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", wheels, sdist)
        (wheel,) = wheels.glob("prazo-*.whl")
        installed = install(out, version, wheel, extras, python=python)
        run(installed, "-W", "error", "-c", CHECK_COMPILED, cwd=out)
        import_every_module(installed, source, out)
        run_suite(suite_copy(out, version, installed), installed, SHORT_SUITE, workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the working directory (wiped first)")
    parser.add_argument("--extras", required=True, help="the extras the tests need, comma-separated")
    parser.add_argument("--pythons", help="other CPython versions (3.10,3.12): make test-versions")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers for the suites (0: serially)")
    args = parser.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    step("export the tree, build the sdist, then the wheel from it")
    sdist, wheel = build(out)
    source = out / "source"
    if args.pythons:
        check_versions(out, sdist, source, args.extras, args.pythons.split(","), args.workers)
    else:
        check_contents(sdist, wheel, source)
        check_wheel(out, wheel, source, args.extras, args.workers)
        check_sdist(out, sdist, args.extras, args.workers)
    print("\ndist-check: passed")


if __name__ == "__main__":
    main()
