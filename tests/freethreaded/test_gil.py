"""The GIL on a free-threaded CPython: prazo never turns it on, and says who did.

The tests marked ``free_threaded`` need a ``--disable-gil`` interpreter (``make
test-freethreaded`` runs them there); the rest hold on any CPython.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import urllib.request
import warnings
from pathlib import Path

import pytest
from _docs import fenced_blocks, section
from _helpers import JOIN_TIMEOUT_S
from prazo.bindings import freethreading
from prazo.bindings.freethreading import GilState, free_threaded_build, watch_imports

# A subprocess's budget: importing every prazo module, or loading an app and printing a line.
SUBPROCESS_S = 60

free_threaded = pytest.mark.skipif(not free_threaded_build(), reason="needs a free-threaded CPython (--disable-gil)")

GIL_WARNING = (
    "The global interpreter lock (GIL) has been enabled to load module 'legacy_ext', which has not declared "
    "that it can run safely without the GIL. To override this behavior and keep the GIL disabled (at your "
    "own risk), run with PYTHON_GIL=0 or -Xgil=0."
)


def test_watch_imports_names_the_module_from_the_interpreters_warning_and_shows_it_still() -> None:
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with watch_imports() as enabled_by:
            warnings.warn(GIL_WARNING, RuntimeWarning, stacklevel=1)
            warnings.warn("something else", DeprecationWarning, stacklevel=1)
    assert enabled_by == ["legacy_ext"]
    # Nothing is swallowed: both are shown once the block ends, in their order.
    assert [(w.category, str(w.message)) for w in shown] == [
        (RuntimeWarning, GIL_WARNING),
        (DeprecationWarning, "something else"),
    ]


def test_watch_imports_keeps_an_error_filter_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="legacy_ext"), watch_imports():
            warnings.warn(GIL_WARNING, RuntimeWarning, stacklevel=1)


@pytest.mark.parametrize(
    ("state", "words"),
    [
        (GilState(False, True), "not a free-threaded build"),
        (GilState(True, False), "the GIL is off: threads run Python in parallel"),
        (GilState(True, False, forced="0"), "forced off by PYTHON_GIL=0"),
        (GilState(True, True, ("legacy_ext", "other")), "importing legacy_ext, other turned it on"),
        (GilState(True, True, forced="1"), "forced on by PYTHON_GIL=1"),
        (GilState(True, True), "turned on before prazo watched"),
    ],
)
def test_each_state_is_described_in_its_own_words(state: GilState, words: str) -> None:
    assert words in state.describe()


def test_on_an_interpreter_with_a_gil_the_import_check_says_there_is_nothing_to_check() -> None:
    if free_threaded_build():
        pytest.skip("needs the GIL: on a free-threaded build the check runs (the next tests)")
    assert freethreading.main(["--check-imports"]) == 2


def run_python(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=SUBPROCESS_S, env=env, cwd=cwd, check=False
    )


@free_threaded
def test_importing_every_prazo_module_leaves_the_gil_off() -> None:
    # No PYTHON_GIL in the child: the interpreter decides, as a user's would.
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    done = run_python("-W", "error::RuntimeWarning", "-m", "prazo.bindings.freethreading", "--check-imports", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the GIL is off" in done.stdout
    count = int(done.stdout.split()[0])
    assert count >= 80, done.stdout  # every layer walked, not just the namespace


def build_extension_without_the_declaration(directory: Path) -> None:
    """A C module of the old kind (no Py_mod_gil): importing it turns the GIL on for the whole process."""
    source = directory / "legacy_ext.c"
    source.write_text(
        textwrap.dedent(
            """
            #include <Python.h>
            static struct PyModuleDef legacy = {PyModuleDef_HEAD_INIT, "legacy_ext", NULL, -1, NULL};
            PyMODINIT_FUNC PyInit_legacy_ext(void) { return PyModule_Create(&legacy); }
            """
        )
    )
    target = directory / f"legacy_ext{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        ["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(target)],
        check=True,
        timeout=SUBPROCESS_S,
    )


HELLO_APP = (
    "def app(environ, start_response):\n"
    "    start_response('200 OK', [('Content-Type', 'text/plain')])\n"
    "    return [b'ok']\n"
)


def serve_until_loaded(app_dir: Path, env: dict[str, str], command: list[str] | None = None) -> str:
    """``prazo serve`` (by default the front door, 2 threads, on ``app:app``): its stderr once it answered."""
    if command is None:
        command = [sys.executable, "-m", "prazo.bindings.servers.serve", "app:app", "--server", "prazo"]
        command += ["--threads", "2"]
    command = [*command, "--port", "0"]
    process = subprocess.Popen(command, cwd=app_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the startup line: the app is loaded, the log written before it
        match = re.search(r"http://127\.0\.0\.1:(\d+) ", line)
        assert match, line
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/", timeout=JOIN_TIMEOUT_S) as answer:
            assert answer.read() == b"ok"
    finally:
        process.terminate()
        _, err = process.communicate(timeout=JOIN_TIMEOUT_S)
    return err


@free_threaded
def test_the_how_to_serves_one_process_on_every_core(tmp_path: Path) -> None:
    page = "docs/how-to/free-threaded.md"
    part = section("## What `prazo serve` tells you", page)
    (command,) = fenced_blocks(part, "sh")
    logged = fenced_blocks(part, "text")[0].strip()
    # The recipe's .venv-ft/bin/prazo is this interpreter's prazo.
    words = command.split()
    assert words[0] == ".venv-ft/bin/prazo", command
    words[0] = str(Path(sys.executable).parent / "prazo")
    (tmp_path / "app.py").write_text(HELLO_APP)
    err = serve_until_loaded(tmp_path, {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}, words)
    assert logged in err.splitlines(), err


@free_threaded
@pytest.mark.parametrize("legacy", [False, True], ids=["app-keeps-it-off", "app-turns-it-on"])
def test_prazo_serve_says_after_loading_the_app_whether_the_gil_is_off_and_who_turned_it_on(
    tmp_path: Path, legacy: bool
) -> None:
    if legacy:
        build_extension_without_the_declaration(tmp_path)
    imports = "import legacy_ext\n" if legacy else ""
    (tmp_path / "app.py").write_text(imports + HELLO_APP)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    err = serve_until_loaded(tmp_path, env)
    if legacy:
        assert "app:app loaded; free-threaded build, but the GIL is on: importing legacy_ext turned it on" in err, err
    else:
        assert "app:app loaded; free-threaded: the GIL is off: threads run Python in parallel" in err, err
