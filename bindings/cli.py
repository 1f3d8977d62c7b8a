"""The ``prazo`` command.

::

    prazo serve MODULE:APP [--server waitress|gunicorn|werkzeug|wsgiref|cheroot|prazo] [limits]
    prazo demo ...             the demonstrations (``prazo.bench.cli``)
    prazo bench ...            the benchmarks (``prazo.bench.cli``)
    prazo --version

``prazo serve`` is what a service runs, so the command lives here, in what a
service imports. ``demo`` and ``bench`` run what measures prazo; the arrows
point down (bench -> bindings), so they come from ``prazo.bench.cli``, which
is imported only when the command line is not ``serve`` or ``--version``: a
server never loads the measuring code.

Every handler has the signature ``handler(args, out) -> exit status``; a
``CommandError`` it raises is printed as ``prazo: error: ...`` with exit
status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from prazo.core import IMPLEMENTATION, __version__

from .command import CommandError, Commands, Handler, impl_options

__all__ = ["build_parser", "main"]

# The commands that need the measuring code (prazo.bench.cli).
_MEASURING = ("demo", "bench")


def _version() -> str:
    return f"prazo {__version__} (core implementation: {IMPLEMENTATION})"


def _add_serve(commands: Commands) -> None:
    from prazo.bindings.servers.serve import SERVERS, add_serve_arguments, run_serve

    # From SERVERS itself, so a server added there is never missing here.
    names = [f"{name} (prazo's own front door)" if name == "prazo" else name for name in SERVERS]
    serve = commands.add_parser(
        "serve",
        help="serve a WSGI app with admission at the server's own queue",
        description=f"Serve MODULE:APP on {', '.join(names[:-1])} or {names[-1]} with prazo's bounded queue "
        "and deadlines at the server's own queue (the PRAZO_* variables named below are honoured; flags win).",
    )
    add_serve_arguments(serve)
    serve.set_defaults(handler=run_serve)


def build_parser(measuring: bool = True) -> argparse.ArgumentParser:
    """The parser of the ``prazo`` command; ``measuring=False`` leaves ``demo`` and ``bench`` out."""
    parser = argparse.ArgumentParser(
        prog="prazo",
        parents=[impl_options()],
        description="Admission control and deadline handling for threaded Python services.",
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    if measuring:
        from prazo.bench.cli import add_commands

        add_commands(commands)
    _add_serve(commands)
    return parser


def _needs_measuring(argv: Sequence[str]) -> bool:
    """Whether the command line may reach ``demo`` or ``bench`` (or lists them, in the help)."""
    words = iter(argv)
    for word in words:
        if word == "--impl":
            next(words, None)
        elif word == "--version":
            return False
        elif not word.startswith("-"):
            return word != "serve"
    return True


# Which optional extra of pyproject.toml brings each package a command may need.
_EXTRA_OF_PACKAGE = {
    **dict.fromkeys(("werkzeug", "waitress", "gunicorn", "cheroot"), "servers"),
    **dict.fromkeys(("requests", "httpx", "urllib3"), "clients"),
    "matplotlib": "plot",
}


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command; returns the exit status (argparse exits 2 on bad flags)."""
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(measuring=_needs_measuring(words))
    args = parser.parse_args(words)
    if args.command is None:
        parser.print_help(out or sys.stdout)
        return 2
    handler: Handler = args.handler
    try:
        return handler(args, out or sys.stdout)
    except CommandError as exc:
        print(f"prazo: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        # The servers and clients are optional extras: name the one to install
        # instead of a traceback from deep inside a demo or a server embedding.
        package = (exc.name or "").partition(".")[0]
        extra = _EXTRA_OF_PACKAGE.get(package)
        if extra is None:
            raise
        print(f"prazo: error: this command needs {package!r}: pip install 'prazo[{extra}]'", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
