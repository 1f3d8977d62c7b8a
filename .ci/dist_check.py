"""Check what a user gets from a package index: `make dist-check` runs this.

1. `python -m build` makes the sdist, then the wheel *from that sdist* (so a file
   missing from the sdist breaks the wheel build), and their contents are checked.
2. Each of them is installed into a fresh virtualenv with no extras, next to
   pytest and hypothesis only, as a user would: `pip install prazo-*.tar.gz`
   builds the C twin again through pip's own isolated build.
3. There the import of both compiled modules and the `prazo` command are
   checked, and the core suite (tests/core) runs on both twins (the `impl` fixture), from a
   copy of the tests in a directory of their own, where nothing of the
   repository is on sys.path to stand in for the installed package.
4. A third virtualenv installs the sdist with PRAZO_NO_EXTENSIONS=1 (no
   compiler involved) and runs the core suite on the Python twin alone.

Usage: python .ci/dist_check.py OUT_DIR   (OUT_DIR is wiped first)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The core suite is the folder tests/core (queue, histogram, deadline, errors, the seed
# scenario): a new core test file is in it by being there. It needs the one conftest
# and the support modules (tests/support), copied with it in the repository's layout so
# pytest's `pythonpath` setting (pyproject.toml) finds them.
CORE_SUITE = "tests/core"
TEST_SUPPORT = ["tests/conftest.py", "tests/support"]
TEST_REQUIREMENTS = ["pytest>=8", "hypothesis>=6.100"]

# Paths inside the sdist (below prazo-<version>/) and the wheel that must be there.
SDIST_REQUIRED = [
    "README.md",
    "pyproject.toml",
    "setup.py",
    "core/_queue_c.pyx",
    "core/_queue_c.pxd",
    "core/_queue_c.pyi",
    "core/prazo_sync.h",
    "core/prazo_slots.h",
    "core/prazo_budget.h",
    "core/prazo_policy.h",
    "core/prazo_line.h",
    "core/prazo_line.pxd",
    "core/_histogram_c.pyx",
    "core/_histogram_c.pxd",
    "core/_histogram_c.pyi",
    "core/prazo_histogram.h",
    "core/py.typed",
    "bindings/_wsgi_c.pyx",
    "bindings/_wsgi_c.pyi",
    "bindings/_pool_c.pyx",
    "bindings/_pool_c.pyi",
    "bindings/py.typed",
    "bindings/servers/_frontdoor_c.pyx",
    "bindings/servers/_frontdoor_c.pyi",
    "bindings/servers/_frontdoor/pfd.h",
    "bindings/servers/_frontdoor/pfd_internal.h",
    "bindings/servers/_frontdoor/pfd_head.c",
    "bindings/servers/_frontdoor/pfd_chunked.c",
    "bindings/servers/_frontdoor/pfd_conn.c",
    "bindings/servers/_frontdoor/pfd_line.c",
    "bindings/servers/_frontdoor/pfd_io.c",
    "bindings/servers/_frontdoor/pfd_server.c",
    "bindings/servers/_frontdoor/pfd_worker.c",
    "bindings/servers/_frontdoor/pfd_host.c",
    "bindings/servers/_frontdoor/pfd_channel.c",
    "bindings/vendor/picohttpparser/picohttpparser.c",
    "bindings/vendor/picohttpparser/picohttpparser.h",
    "bench/RESULTS.md",
    "bench/py.typed",
    "tests/conftest.py",
    "tests/support/_helpers.py",
    "tests/support/_required.py",
]
WHEEL_REQUIRED = [
    "prazo/core/_queue_c.pyi",
    "prazo/core/_queue_c.pxd",
    # _queue_c.pxd cimports the line's declarations, which name its header.
    "prazo/core/prazo_line.pxd",
    "prazo/core/prazo_line.h",
    "prazo/core/_histogram_c.pyi",
    "prazo/core/_histogram_c.pxd",
    "prazo/core/prazo_histogram.h",
    "prazo/core/py.typed",
    "prazo/bindings/_wsgi_c.pyi",
    "prazo/bindings/_pool_c.pyi",
    "prazo/bindings/py.typed",
    "prazo/bindings/servers/_frontdoor_c.pyi",
    # One module of each subpackage, so a package left out of setup.py shows here;
    # prazo.bench holds the `prazo` command itself.
    "prazo/bindings/servers/dispatcher.py",
    "prazo/bindings/clients/requests.py",
    "prazo/bindings/dependency/breaker.py",
    "prazo/bench/cli.py",
    "prazo/bindings/cli.py",
    "prazo/bindings/integrations/grpc/server.py",
    "prazo/bindings/plumbing/reaper.py",
    "prazo/bench/RESULTS.md",
    "prazo/bench/py.typed",
]
WHEEL_EXTENSIONS = [
    "prazo/core/_queue_c.",
    "prazo/core/_histogram_c.",
    "prazo/bindings/_wsgi_c.",
    "prazo/bindings/_pool_c.",
    "prazo/bindings/servers/_frontdoor_c.",
]

# prazo comes from the virtualenv, both compiled modules load, the C twin is the one
# prazo.core picked, and the fallback warning (a RuntimeWarning) is an error here.
CHECK_INSTALLED = "import sys, prazo.core; assert prazo.core.__file__.startswith(sys.prefix), prazo.core.__file__;"
CHECK_COMPILED = CHECK_INSTALLED + (
    "import prazo.core._histogram_c, prazo.bindings._wsgi_c, prazo.bindings.wsgi, prazo.bindings.pool,"
    " prazo.bindings.servers._frontdoor_c, prazo.bindings._pool_c;"
    "assert prazo.core.IMPLEMENTATION == 'c', prazo.core.IMPLEMENTATION;"
    "assert prazo.bindings.pool.compiled_path(), 'the pool did not pick its compiled path'"
)
CHECK_PYTHON_TWIN = CHECK_INSTALLED + "import prazo.bindings.wsgi; assert prazo.core.IMPLEMENTATION == 'py'"


def step(title: str) -> None:
    print(f"\n=== dist-check: {title}", flush=True)


def run(*cmd: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    started = time.monotonic()
    subprocess.run([str(c) for c in cmd], check=True, cwd=cwd, env={**os.environ, **(env or {})})
    print(f"    ({time.monotonic() - started:.0f} s)", flush=True)


def check_contents(dist: Path) -> tuple[Path, Path]:
    (sdist,) = dist.glob("prazo-*.tar.gz")
    (wheel,) = dist.glob("prazo-*.whl")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    problems = [f"sdist lacks {name}" for name in SDIST_REQUIRED if name not in names]
    # Generated C is rebuilt from the .pyx; a shipped copy could be stale. Any
    # other C (the front door's engine, the vendored parser, the fuzz harness)
    # is a source and must ship.
    problems += [
        f"sdist ships generated {name}"
        for name in sorted(names)
        if name.endswith(".so") or (name.endswith(".c") and f"{name[:-2]}.pyx" in names)
    ]
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    problems += [f"wheel lacks {name}" for name in WHEEL_REQUIRED if name not in names]
    for stem in WHEEL_EXTENSIONS:
        if not any(name.startswith(stem) and name.endswith(".so") for name in names):
            problems.append(f"wheel lacks the compiled {stem}*.so")
    if problems:
        sys.exit("dist-check: " + "; ".join(problems))
    print(f"    {sdist.name} and {wheel.name} hold the sources, stubs and compiled modules")
    return sdist, wheel


def install(out: Path, name: str, artifact: Path, env: dict[str, str] | None = None) -> Path:
    """A fresh virtualenv holding the artifact (no extras) and the test tools; its python."""
    home = out / f"venv-{name}"
    venv.create(home, with_pip=True)
    python = home / "bin" / "python"
    pip: list[str | Path] = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(*pip, *TEST_REQUIREMENTS)
    # No wheel cache: pip would key a wheel built from the sdist on its path alone, and
    # hand the next run (or the PRAZO_NO_EXTENSIONS=1 install) a stale build.
    run(*pip, "--no-cache-dir", artifact, env=env)
    return python


def core_suite(out: Path, name: str, python: Path, env: dict[str, str] | None = None) -> None:
    """The core suite, from a copy of the tests in a directory of its own."""
    where = out / f"tests-{name}"
    for part in (*TEST_SUPPORT, CORE_SUITE):
        source, target = REPO / part, where / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    # The pytest settings (markers, warnings as errors, pythonpath) without the rest of the repository.
    shutil.copy2(REPO / "pyproject.toml", where)
    run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", CORE_SUITE, cwd=where, env=env)


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    shutil.rmtree(out, ignore_errors=True)
    dist = out / "dist"

    step("build the sdist, then the wheel from it")
    run(sys.executable, "-m", "build", "--outdir", dist, REPO)
    sdist, wheel = check_contents(dist)

    for name, artifact in (("wheel", wheel), ("sdist", sdist)):
        step(f"install the {name} without extras, check it, run the core suite on both twins")
        python = install(out, name, artifact)
        run(python, "-W", "error", "-c", CHECK_COMPILED, cwd=out)
        run(python, "-c", CHECK_PYTHON_TWIN, cwd=out, env={"PRAZO_NO_EXTENSIONS": "1"})
        run(python.parent / "prazo", "--help", cwd=out)
        core_suite(out, name, python)

    step("install the sdist with PRAZO_NO_EXTENSIONS=1, run the core suite on the Python twin")
    pure = {"PRAZO_NO_EXTENSIONS": "1"}
    python = install(out, "pure", sdist, env=pure)
    run(python, "-W", "error", "-c", CHECK_PYTHON_TWIN, cwd=out, env=pure)
    core_suite(out, "pure", python, env=pure)
    print("\ndist-check: passed")


if __name__ == "__main__":
    main()
