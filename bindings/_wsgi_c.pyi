"""Type stubs for the compiled common path of ``prazo.bindings.wsgi.AdmissionMiddleware``."""

from collections.abc import Callable, Iterable, Iterator
from typing import Any, final

from prazo.bindings.headers import BudgetPolicy
from prazo.bindings.plumbing.load_report import LoadReport
from prazo.bindings.policies import CriticalClassifier
from prazo.bindings.wsgi import AdmissionMiddleware, Environ, MiddlewareCounters, StartResponse, WSGIApp
from prazo.core import Deadline, LatencyHistogram

__all__ = ["CompiledPath", "ListBody", "QueueRelease", "call_admitted", "serve", "set_observer", "supports"]

def supports(queue: object) -> bool: ...
def set_observer(observer: Any) -> None: ...
def serve(middleware: AdmissionMiddleware, environ: Environ, start_response: StartResponse) -> Iterable[bytes]: ...
def call_admitted(
    app: WSGIApp,
    environ: dict[str, Any],
    start_response: StartResponse,
    deadline: Deadline,
    release: Callable[[], object],
    queue_wait_ns: int,
    counters: MiddlewareCounters | None,
    retry_after_s: int,
    arrival_ns: int | None,
    outcome: str,
) -> Iterable[bytes]: ...

@final
class ListBody:
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def __next__(self) -> bytes: ...
    def close(self) -> None: ...

@final
class QueueRelease:
    def __call__(self) -> None: ...

@final
class CompiledPath:
    def __init__(
        self,
        app: WSGIApp,
        queue: Any,
        policy: BudgetPolicy,
        bypass: Iterable[str],
        counters: MiddlewareCounters,
        retry_after_s: int,
        critical: CriticalClassifier | None = None,
        measured_retry_after: bool = False,
    ) -> None: ...
    def record_latency(self, request_duration: LatencyHistogram, queue_wait: LatencyHistogram) -> None: ...
    def report_load(self, load_report: LoadReport) -> None: ...
