"""Type stubs for the compiled per-task path of AdmissionPool (prazo.bindings.pool is the specification)."""

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextvars import Context
from typing import Any

from prazo.core import Deadline

def layout_supported() -> bool: ...
def set_interpreter_shutting_down() -> None: ...

class Submitter:
    shut_down: bool
    def __init__(
        self,
        queue: Any,
        lock: Any,
        state: Any,
        reaper: Any,
        future_type: type[Future[Any]],
        item_type: type[Any],
        start_worker_locked: Callable[[], None],
        threads: list[Any],
        max_workers: int,
    ) -> None: ...
    def submit_until(self, deadline: Deadline | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]: ...
    def submit_current(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]: ...
    def submit(
        self, deadline: Deadline | None, context: Context, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Future[Any]: ...

def run_worker(queue: Any, state: Any, reaper: Any) -> None: ...
def results_in_order(futures: list[Future[Any]], end_time: float | None) -> Iterator[Any]: ...
