"""Build prazo: map core/, bindings/ and bench/ into the prazo namespace, cythonize the C twins.

Environment:
  PRAZO_NO_EXTENSIONS=1  skip the C extensions entirely (the Python twins run)
  PRAZO_DEBUG_BUILD=1    -O0 -g3, no NDEBUG (for gdb / valgrind)
  PRAZO_SANITIZE=1       add AddressSanitizer + UndefinedBehaviorSanitizer
  PRAZO_TSAN=1           add ThreadSanitizer (make tsan, with an interpreter built with it)
On CPython a missing Cython or a compile failure fails the build, with a banner
naming PRAZO_NO_EXTENSIONS=1 as the way to install the pure-Python twin on
purpose: pip hides the output of a build that succeeds, so a warning would let
a slow install pass unnoticed. The sdist ships the .pyx sources, not generated
C, and Cython (a build requirement) translates them at build time.
"""

import importlib.util
import os
import platform
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The three audiences of docs/design.md's "Layout", each folder mapped into the prazo namespace.
PACKAGE_DIR = {"prazo.core": "core", "prazo.bindings": "bindings", "prazo.bench": "bench"}
# What a package carries beside its modules: the type information (PEP 561 marker and stubs)
# and the Cython declarations with the headers they name, so another extension can cimport
# the C twin. Plots, recorded runs and notes stay in the repository and the sdist.
PACKAGE_DATA = ["py.typed", "*.pyi", "*.pxd", "*.h"]
BANNER = "!" * 72
PICOHTTPPARSER = "bindings/vendor/picohttpparser/picohttpparser"
# The front door's engine, one file per concern; pfd.h is its interface.
FRONTDOOR = "bindings/servers/frontdoor/engine"
FRONTDOOR_SOURCES = [
    f"{FRONTDOOR}/pfd_{name}.c"
    for name in ("head", "chunked", "conn", "line", "io", "server", "worker", "host", "channel")
]


def _packages():
    """Every folder below a mapped root that holds a Python module (.py, or .pyx built into one).

    Derived from the tree, never listed by hand, so a new subpackage ships by existing.
    A folder of C sources or data alone (the front door's engine/, the vendored parser,
    bench/results/) is not a package and stays out of the wheel.
    """
    packages = []
    for package, root in PACKAGE_DIR.items():
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
            if any(name.endswith((".py", ".pyx")) for name in files):
                relative = os.path.relpath(folder, root)
                packages.append(package if relative == "." else f"{package}.{relative.replace(os.sep, '.')}")
    return packages


def _load_arguments():
    """core/arguments.py by its path: prazo.core itself cannot be imported before it is built."""
    spec = importlib.util.spec_from_file_location("_prazo_arguments", os.path.join("core", "arguments.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ARGUMENTS = _load_arguments()


def _flag(name):
    """The yes/no variable ``name`` as prazo.core reads it (``1/true/yes/on``, ``0/false/no/off``)."""
    return bool(_ARGUMENTS.env_flag(os.environ, name))


class BuildExt(build_ext):
    """build_ext that fails with a banner and replaces an in-place .so atomically."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing, compile error, ...
            _fail_banner(exc)
            raise

    def copy_file(self, infile, outfile, *args, **kwargs):
        """Replace an in-place .so atomically.

        Overwriting it in place would change the pages of a library that a
        running process (a test run, a server) has mapped, and crash it.
        """
        if not str(outfile).endswith((".so", ".pyd")):
            return super().copy_file(infile, outfile, *args, **kwargs)
        tmp = f"{outfile}.tmp-{os.getpid()}"
        result = super().copy_file(infile, tmp, *args, **kwargs)
        os.replace(tmp, outfile)
        return (outfile, result[1])


def _fail_banner(exc):
    sys.stderr.write(
        f"\n{BANNER}\nprazo: building the C extensions failed: {exc}\n"
        "Install a C compiler and the Python headers (Debian: gcc python3-dev), or set\n"
        "PRAZO_NO_EXTENSIONS=1 to install the pure-Python twin (slower, same behaviour).\n"
        f"{BANNER}\n\n"
    )


def _pxd_include_dir():
    """Make core/_queue_c.pxd findable under its real module name.

    Cython looks a module's .pxd up by its qualified name (prazo/core/_queue_c.pxd),
    but core/ is only mapped to prazo.core by setuptools, so we give Cython an
    include directory where prazo/core is a link to core/ (bindings/_wsgi_c.pyx
    cimports it from there too).
    """
    include_dir = os.path.join("build", "cython-include")
    os.makedirs(os.path.join(include_dir, "prazo"), exist_ok=True)
    link = os.path.join(include_dir, "prazo", "core")
    if not os.path.islink(link):
        os.symlink(os.path.abspath("core"), link)
    return include_dir


def _extensions():
    # prazo.core never loads the C twin outside CPython, so there it is not built.
    if _flag("PRAZO_NO_EXTENSIONS") or platform.python_implementation() != "CPython":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError as exc:  # only without build isolation: pyproject.toml requires Cython
        _fail_banner(exc)
        raise
    from setuptools import Extension

    compile_args = ["-std=c11", "-Wall", "-Wno-unused-function"]
    link_args = []
    macros = []
    if _flag("PRAZO_DEBUG_BUILD"):
        compile_args += ["-O0", "-g3", "-UNDEBUG"]
    else:
        compile_args += ["-O2"]
    if _flag("PRAZO_SANITIZE"):
        # No recovery: a build meant to find memory errors and UB must stop at the first one.
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
        compile_args += sanitize
        link_args += sanitize
    if _flag("PRAZO_TSAN"):
        # The races of the compiled paths, on a free-threaded interpreter built with TSan too.
        tsan = ["-fsanitize=thread", "-fno-omit-frame-pointer", "-g"]
        compile_args += tsan
        link_args += tsan
    options = {"extra_compile_args": compile_args, "extra_link_args": link_args, "define_macros": macros}
    extensions = [
        Extension("prazo.core._queue_c", ["core/_queue_c.pyx"], include_dirs=["core"], **options),
        Extension("prazo.core._histogram_c", ["core/_histogram_c.pyx"], include_dirs=["core"], **options),
        # The compiled common path of the WSGI middleware; it cimports the C twin's .pxd.
        Extension("prazo.bindings._wsgi_c", ["bindings/_wsgi_c.pyx"], include_dirs=["core", "bindings"], **options),
        # The compiled per-task path of AdmissionPool (submission and the worker loop).
        Extension("prazo.bindings._pool_c", ["bindings/_pool_c.pyx"], include_dirs=["core"], **options),
        # The head reader of the socket-level embeddings (gunicorn, cheroot, werkzeug, wsgiref).
        Extension("prazo.bindings.servers.plumbing._heads_c", ["bindings/servers/plumbing/_heads_c.pyx"], **options),
        # The front door (--server prazo): its engine and the vendored, unmodified picohttpparser.
        Extension(
            "prazo.bindings.servers.frontdoor._engine_c",
            ["bindings/servers/frontdoor/_engine_c.pyx", *FRONTDOOR_SOURCES, PICOHTTPPARSER + ".c"],
            # core/: prazo_policy.h, the queue policies' arithmetic the engine shares with the C twin.
            include_dirs=[FRONTDOOR, "core", os.path.dirname(PICOHTTPPARSER)],
            **options,
        ),
    ]
    try:
        return cythonize(
            extensions,
            include_path=[_pxd_include_dir()],
            language_level=3,
            compiler_directives={
                "boundscheck": False,
                "wraparound": False,
                "cdivision": True,
                "embedsignature": True,
            },
        )
    except Exception as exc:  # Cython's CompileError, ...
        _fail_banner(exc)
        raise


PACKAGES = _packages()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data=dict.fromkeys(PACKAGES, PACKAGE_DATA),
    # Only what package_data names goes into the wheel: MANIFEST.in fills the sdist
    # (tests, docs, the .pyx and C sources, the results), not the installed package.
    include_package_data=False,
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
