"""Build prazo: map core/, bindings/ and bench/ into the prazo namespace, cythonize the C twins.

Environment:
  PRAZO_NO_EXTENSIONS=1  skip the C extensions entirely (the Python twins run)
  PRAZO_DEBUG_BUILD=1    -O0 -g3, no NDEBUG (for gdb / valgrind)
  PRAZO_SANITIZE=1       add AddressSanitizer + UndefinedBehaviorSanitizer
A compile failure never fails the install: it falls back to the Python twin
and says so loudly.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The three audiences of DESIGN.md's "Layout"; subpackages live in their folders.
PACKAGES = [
    "prazo.core",
    "prazo.bindings",
    "prazo.bindings.clients",
    "prazo.bindings.servers",
    "prazo.bench",
]
PACKAGE_DIR = {"prazo.core": "core", "prazo.bindings": "bindings", "prazo.bench": "bench"}
BANNER = "!" * 72


def _flag(name):
    return os.environ.get(name, "") in ("1", "true", "yes")


class OptionalBuildExt(build_ext):
    """Build the C twin if we can; otherwise warn loudly and go on without it."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing, Cython missing, ...
            self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._warn(exc)

    def copy_file(self, infile, outfile, *args, **kwargs):
        """Replace an in-place .so atomically.

        Overwriting it in place would change the pages of a library that a
        running process (a test run, a server) has mapped, and crash it.
        """
        if not str(outfile).endswith((".so", ".pyd")):
            return super().copy_file(infile, outfile, *args, **kwargs)
        if not os.path.exists(infile):
            # Its build failed and was already reported; the twin takes over.
            return (outfile, 0)
        tmp = f"{outfile}.tmp-{os.getpid()}"
        result = super().copy_file(infile, tmp, *args, **kwargs)
        os.replace(tmp, outfile)
        return (outfile, result[1])

    @staticmethod
    def _warn(exc):
        sys.stderr.write(
            f"\n{BANNER}\nprazo: building the C extension failed: {exc}\n"
            f"prazo will run on its pure-Python twin (slower, same behaviour).\n{BANNER}\n\n"
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
    if _flag("PRAZO_NO_EXTENSIONS"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError as exc:
        OptionalBuildExt._warn(exc)
        return []
    from setuptools import Extension

    compile_args = ["-std=c11", "-Wall", "-Wno-unused-function"]
    link_args = []
    macros = []
    if _flag("PRAZO_DEBUG_BUILD"):
        compile_args += ["-O0", "-g3", "-UNDEBUG"]
    else:
        compile_args += ["-O2"]
    if _flag("PRAZO_SANITIZE"):
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
        compile_args += sanitize
        link_args += sanitize
    options = {"extra_compile_args": compile_args, "extra_link_args": link_args, "define_macros": macros}
    extensions = [
        Extension("prazo.core._queue_c", ["core/_queue_c.pyx"], include_dirs=["core"], **options),
        # The compiled common path of the WSGI middleware; it cimports the C twin's .pxd.
        Extension("prazo.bindings._wsgi_c", ["bindings/_wsgi_c.pyx"], include_dirs=["core", "bindings"], **options),
    ]
    cythonized = []
    for ext in extensions:
        # One at a time, so a Cython error leaves out that extension only.
        try:
            cythonized += cythonize(
                [ext],
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
            OptionalBuildExt._warn(exc)
    return cythonized


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={
        "prazo.core": ["py.typed", "*.pyi", "*.pxd", "*.h"],
        "prazo.bindings": ["py.typed", "*.pyi"],
        "prazo.bench": ["py.typed", "RESULTS.md"],
    },
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    zip_safe=False,
)
