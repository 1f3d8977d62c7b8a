"""Every code block of the README and of ``docs/`` runs, one way: Sybil, page by page, in order.

A page's ``python`` blocks share one namespace, as a reader going down the page
would (a ``>>>`` block is a doctest: its outputs are checked; in a plain block,
``print(...)  # what it prints`` must print that, one of its `` / ``-separated
alternatives, quotes aside, whenever the block prints at all). HTML comments with ``invisible-code-block: python``
set up the names a sketch assumes or check what a recipe built; a reader of the
site does not see them. Its ``sh`` blocks
run in bash from the repository root and must exit 0; a line whose comment is a
bare HTTP status (``# 504``) must have printed it. A recipe that starts
``prazo serve`` on port 8000 runs on a free port instead (``--port`` added,
``localhost:8000`` rewritten), so the suite never binds a fixed port.

Blocks that need more than the page gives are run by the test their marker names
(``<!-- tested-by: ... -->``); the few no test can run as written carry
``<!-- not-run: reason -->`` and are listed in ``NOT_RUN`` below
(``tests/support/_docs.py`` has the rules). ``test_no_block_goes_untested``
holds every block of every page to one of these.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _docs import ROOT, Block, blocks, pages
from _required import require

sybil = require("sybil")
from sybil.parsers.myst import CodeBlockParser, PythonCodeBlockParser  # noqa: E402

# Blocks no test runs as written, by page and first line, with the gist of why (the marker says it in full).
# This list only shrinks: make a block runnable, or give it to a test with tested-by.
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make demo    # creates .venv, builds the C extension, runs the seed scenario end to end"): "set-up",
    (
        "docs/install.md",
        "make demo    # creates .venv, builds the C extension, runs the seed scenario end to end",
    ): "set-up",
    (
        "README.md",
        "pip install prazo                                   # the core, the middleware, the pool; no dependencies",
    ): "an index",
    ("docs/tutorial.md", "pip install 'prazo[servers,flask]'"): "an index",
    (
        "docs/benchmarks/demos.md",
        ".venv/bin/prazo demo slow-dependency --plot bench/slow_dependency.png   # ≈ 100 s; --quick ≈ 30 s; --json",
    ): "minutes",
    (
        "docs/benchmarks/goodput.md",
        ".venv/bin/prazo bench goodput [--quick] [--json] [--plot bench/goodput.png] \\",
    ): "minutes",
    (
        "docs/benchmarks/index.md",
        ".venv/bin/prazo bench              # core, wsgi and pool, one after another (≈ 15 s; --quick ≈ 4 s)",
    ): "minutes",
    ("docs/how-to/metrics.md", "  from prometheus_client import start_http_server"): "serves until stopped",
    ("docs/how-to/free-threaded.md", "python3.13t -m venv .venv-ft"): "another interpreter",
    (
        "docs/how-to/tracing.md",
        "OpenTelemetryMiddleware(app, request_hook=prazo_otel.request_hook)                 # opentelemetry-instrumentation-wsgi",
    ): "another package",
}

RUN_BY_SYBIL = {"python", "sh"}
OUTPUT = {"text"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_sh(example: Any) -> None:
    script = example.parsed
    if "prazo serve" in script and "8000" in script:
        port = _free_port()
        script = re.sub(r"(prazo serve \S+)", rf"\1 --port {port}", script).replace(
            "localhost:8000", f"localhost:{port}"
        )
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{script}\nexit {result.returncode}\n{result.stdout}{result.stderr}"
    for status in re.findall(r"#\s*(\d{3})\s*$", example.parsed, re.MULTILINE):
        assert re.search(rf"^{status}\b", result.stdout, re.MULTILINE), (status, result.stdout)


def _setup(namespace: dict[str, Any]) -> None:
    namespace["__name__"] = "__main__"  # as a reader running the page as a script (Flask finds its root by it)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the examples import as ``examples.*`` from the repository root


SYBIL = sybil.Sybil(
    parsers=[PythonCodeBlockParser(), CodeBlockParser("sh", run_sh)],
    setup=_setup,
    patterns=["*.md"],
)


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _to_run(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.marker is None and b.info in RUN_BY_SYBIL]


PAGES = [_relative(page) for page in pages()]


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_written(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A recipe that writes a file (``sqlite3.connect("app.db")``) writes it here, not in the checkout.
    monkeypatch.chdir(tmp_path)
    document = SYBIL.parse(ROOT / page)
    SYBIL.setup(document.namespace)  # parse() alone does not: Sybil's pytest plugin would
    every = blocks(ROOT / page)
    marked = [block for block in every if block.marker is not None]
    wanted = _to_run(ROOT / page)
    ran: set[int] = set()

    def block_of(line: int, among: list[Block]) -> Block | None:
        return next((block for block in among if block.line <= line <= block.end), None)

    def run_the_page() -> None:
        for example in document:
            if block_of(example.line, marked) is not None:
                continue  # its marker names the test that runs it
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                example.evaluate()  # a visible block, or an invisible set-up block (an HTML comment)
            # A code block (not a doctest example) that printed: every commented print says what
            # it printed. A block that printed nothing took none of them (a print in an except
            # clause shows what the error path would say).
            if isinstance(example.parsed, str) and printed.getvalue():
                source = document.text[example.region.start : example.region.end]
                for comment in re.findall(r"^\s*print\(.*\)\s+# (.+)$", source, re.MULTILINE):
                    alternatives = [part.strip().strip('"') for part in comment.split(" / ")]
                    assert any(a in printed.getvalue() for a in alternatives), (comment, printed.getvalue())
            block = block_of(example.line, wanted)
            if block is not None:
                ran.add(block.line)

    try:
        # A fresh context: a deadline scope a page opens (and a reader would close) ends with the page.
        contextvars.Context().run(run_the_page)
    finally:
        if SYBIL.teardown is not None:
            SYBIL.teardown(document.namespace)
    missed = sorted({block.line for block in wanted} - ran)
    assert not missed, f"Sybil did not run the blocks at lines {missed} of {page}"


def _is_tested_by(target: str) -> bool:
    path, _, name = target.partition("::")
    file = ROOT / path
    return path.startswith("tests/") and file.is_file() and f"def {name.split('[')[0]}(" in file.read_text()


@pytest.mark.parametrize("page", PAGES)
def test_no_block_goes_untested(page: str) -> None:
    untested = []
    for block in blocks(ROOT / page):
        if block.directive or block.info in OUTPUT:
            continue
        if block.marker is None:
            if block.info not in RUN_BY_SYBIL:
                untested.append(f"{block}: no runner for this language; mark it or make it python/sh")
            continue
        kind, what = block.marker
        if kind == "tested-by" and not _is_tested_by(what):
            untested.append(f"{block}: tested-by names no test: {what}")
        if kind == "not-run" and (page, block.source.splitlines()[0]) not in NOT_RUN:
            untested.append(f"{block}: not-run, and not in NOT_RUN")
    assert not untested, "\n".join(untested)


def test_every_not_run_block_is_still_there() -> None:
    """``NOT_RUN`` only shrinks: an entry whose block is gone or now runs must go."""
    marked = {
        (_relative(block.page), block.source.splitlines()[0])
        for page in pages()
        for block in blocks(page)
        if block.marker is not None and block.marker[0] == "not-run"
    }
    assert set(NOT_RUN) == marked, set(NOT_RUN) ^ marked
