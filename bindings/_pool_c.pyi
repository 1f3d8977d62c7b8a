"""Type stubs for the compiled per-task path of AdmissionPool (prazo.bindings.pool is the specification)."""

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextvars import Context
from typing import Any, final

from prazo.core import Deadline
from typing_extensions import disjoint_base

__all__ = ["Submitter", "layout_supported", "results_in_order", "run_worker", "set_interpreter_shutting_down"]

def layout_supported() -> bool: ...

@final
class FutureCondition:
    """threading.Condition over an RLock, as one object (the compiled path's futures carry it)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> bool: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> None: ...
    def _is_owned(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any: ...
    def notify(self, n: int = 1) -> None: ...
    def notify_all(self) -> None: ...
    def notifyAll(self) -> None: ...

def set_interpreter_shutting_down() -> None: ...

@disjoint_base
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
    def submit_until(
        self, deadline: Deadline | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> Future[Any]: ...
    def submit_current(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]: ...
    def submit(
        self,
        deadline: Deadline | None,
        context: Context,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Future[Any]: ...

def run_worker(queue: Any, state: Any, reaper: Any) -> None: ...
def results_in_order(futures: list[Future[Any]], end_time: float | None) -> Iterator[Any]: ...
