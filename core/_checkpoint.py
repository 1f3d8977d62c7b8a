"""A function that runs one line of Python, for the C twin to call after a wait.

The interpreter delivers an exception raised into a thread from outside
(``PyThreadState_SetAsyncExc``) only while that thread runs bytecode, and a C
wait with the GIL released runs none. Calling :func:`checkpoint` right after
such a wait, before the thread takes a slot or an item, makes a pending
exception surface at a point where the queue can still leave everything
untaken; without it the exception would land just after the item was handed
out, and the item would be lost.
"""

from __future__ import annotations

__all__ = ["checkpoint"]


def checkpoint() -> None:
    """Do nothing, in bytecode (so a pending asynchronous exception is raised here)."""
