"""What every subcommand of ``prazo`` shares: the handler's shape, its error, the ``--impl`` option.

``prazo serve`` (``prazo.bindings.cli``) and ``prazo demo`` / ``prazo bench``
(``prazo.bench.cli``, wired in by the command only when asked for) both build
on this module, so the measuring code never imports the command that loads it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TextIO, TypeAlias

from prazo.core import TWINS

__all__ = ["CommandError", "Commands", "Handler", "impl_options"]

#: Every handler: ``handler(args, out) -> exit status``.
Handler = Callable[[argparse.Namespace, TextIO], int]
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandError(Exception):
    """A failure the person at the terminal can fix: printed as ``prazo: error: ...``, exit status 1."""


def impl_options() -> argparse.ArgumentParser:
    """``--impl``, accepted at every level (SUPPRESS keeps an outer value from being reset)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--impl",
        choices=TWINS,
        default=argparse.SUPPRESS,
        help="force the C or the Python twin of the admission queue",
    )
    return options
