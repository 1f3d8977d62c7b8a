"""Names for a host's processes, as ``ps`` and ``top`` show them: ``prazo: supervisor``, ``prazo: triage``, ``prazo: worker 1``.

Every process of a ``--workers N`` host starts from the same command line, so
without names an operator cannot tell the triage from a worker in ``ps``, nor
which pid to look at. With ``setproctitle`` (a well-kept library, in the
``servers`` extra; gunicorn names its processes with it) the whole command line
``ps`` shows becomes ``prazo: worker 1 [prazo serve app:app ...]``. Without it,
``prctl(PR_SET_NAME)`` names the process as ``top`` and ``ps -o comm`` show it,
cut to the kernel's 15 bytes (``prazo: worker 1`` fits). Naming is a courtesy:
where neither is possible, nothing happens.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["name_process", "process_title"]

# prctl's option that names the calling thread (the process, when called from its main thread).
_PR_SET_NAME = 15
# What the kernel keeps of a name, less its terminating NUL.
_COMM_BYTES = 15


def process_title(role: str) -> str:
    """``prazo: ROLE``, the name of a host's process in the role ``role`` (``supervisor``, ``worker 1``)."""
    return f"prazo: {role}"


def name_process(role: str) -> None:
    """Name this process ``prazo: ROLE`` (call it from the main thread)."""
    title = process_title(role)
    try:
        import setproctitle
    except ImportError:
        _set_kernel_name(title)
        return
    # The command line stays readable after the role, as gunicorn's "gunicorn: worker [app]".
    setproctitle.setproctitle(f"{title} [{' '.join(sys.argv)}]")


def _set_kernel_name(title: str) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, title.encode()[:_COMM_BYTES], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux (no prctl): the name is a courtesy, never a failure
        pass
