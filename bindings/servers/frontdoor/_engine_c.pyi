"""Type stubs for the front door's compiled engine (bindings/servers/frontdoor/_engine_c.pyx)."""

from collections.abc import Callable, Iterable
from ipaddress import IPv4Network, IPv6Network
from typing import Any, final

from typing_extensions import disjoint_base

ROLES: frozenset[str]
CHANNEL_MESSAGE_SIZE: int
BUDGET_SOURCES: tuple[str, str, str]
ANSWERS: dict[str, int]
KEEPABLE: frozenset[str]
ORDERS: dict[str, int]
NOTE_KINDS: dict[int, str]

def head_environ(base: dict[str, Any], conn: Any) -> dict[str, Any]: ...
def date_line() -> str: ...
def response_fields(status: str, headers: list[tuple[str, str]]) -> tuple[str, int | None, bool]: ...
def parse_budget_ms(value: bytes) -> float | None: ...
def parse_grpc_timeout(value: bytes) -> float | None: ...
def parse_envoy_timeout_ms(value: bytes) -> float | None: ...
def incoming_budget(headers: Iterable[tuple[bytes, bytes]]) -> tuple[float | None, int, str | None]: ...
def deadline_ns_for(
    headers: Iterable[tuple[bytes, bytes]],
    arrival_ns: int,
    default_budget_ms: float,
    max_budget_ms: float,
    upstream_ns: int = 0,
) -> int: ...
def parse_request_start_ns(value: bytes) -> int | None: ...
def request_start_ns(headers: Iterable[tuple[bytes, bytes]]) -> int | None: ...
def upstream_wait_ns(stamp_ns: int, arrival_wall_ns: int, max_wait_ns: int) -> int: ...
def engine_networks(
    networks: Iterable[IPv4Network | IPv6Network] | None,
) -> list[tuple[int, bytes, int]] | None: ...
def address_trusted(networks: Iterable[tuple[int, bytes, int]] | None, packed: bytes) -> bool: ...
def check_head(data: bytes) -> str: ...
def is_critical(head: bytes, critical_header: bytes | None = None, critical_paths: Iterable[bytes] = ()) -> bool: ...
def split_requests(data: bytes, max_head: int = 65536) -> tuple[list[tuple[int, bytes, bytes, bytes, bool]], str]: ...

LINE_COUNTERS: tuple[str, ...]

@disjoint_base
class EngineLine:
    def __init__(
        self,
        threads: int,
        max_queue: int,
        *,
        order: str = "fifo",
        reserved: int = 0,
        expected_service_ns: int = 0,
        codel_target_ns: int = 5_000_000,
        codel_interval_ns: int = 100_000_000,
        now_ns: int = 0,
    ) -> None: ...
    def admit(
        self, token: int, deadline_ns: int, now_ns: int, critical: bool = False
    ) -> tuple[str | None, list[tuple[int, str]]]: ...
    def next(self, now_ns: int) -> tuple[int | None, list[tuple[int, str]]]: ...
    def release(self, critical: bool = False, service_ns: int = -1) -> None: ...
    def sweep(self, now_ns: int) -> tuple[int, list[tuple[int, str]]]: ...
    def stats(self) -> dict[str, int]: ...

class Connection:
    finished: bool
    body_failure: str | None
    method: bytes
    target: bytes
    minor_version: int
    headers: list[tuple[bytes, bytes]]
    peer: tuple[str, int] | None
    arrival_ns: int
    deadline_ns: int
    serial: int
    upstream_ns: int
    queue_wait_ns: int
    budget_source: str | None
    budget_invalid: int
    client_keep_alive: bool
    content_length: int
    chunked: bool
    arrival_from_kernel: bool
    def read_body(self, size: int) -> bytes: ...
    def discard_body(self) -> bool: ...
    def body_arrived(self) -> bool: ...
    def write(self, data: bytes | bytearray | memoryview) -> None: ...
    def finish(self, keep_alive: bool) -> None: ...

@final
class BodyInput:
    def __new__(cls, conn: Connection, error: type[BaseException]) -> BodyInput: ...
    def read(self, size: int | None = -1) -> bytes: ...
    def readline(self, size: int | None = -1) -> bytes: ...
    def readlines(self, hint: int = -1) -> list[bytes]: ...
    def __iter__(self) -> BodyInput: ...
    def __next__(self) -> bytes: ...

@final
class Response:
    head_only: bool
    keep_alive: bool
    status: str | None
    headers: list[tuple[str, str]]
    sent_headers: bool
    chunked: bool
    length: int | None
    sent: int
    def __new__(cls, conn: Connection, head_only: bool, may_keep_alive: bool) -> Response: ...
    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], None]: ...
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

@final
class RequestLoop:
    def __new__(
        cls,
        runner: Any,
        *,
        call_admitted: Callable[..., Any],
        body_error: type[BaseException],
        deadline_at: Callable[[int], Any],
        budget_source_key: str,
        outcome: str,
    ) -> RequestLoop: ...
    def work(self, next_connection: Callable[[], Any]) -> None: ...

@disjoint_base
class Channel:
    def ask(self) -> None: ...
    def next_connection(self) -> Connection | None: ...

class Engine:
    threads: int
    role: str
    draining: bool
    def is_draining(self) -> bool: ...
    def __init__(
        self,
        listen_fds: Iterable[int],
        *,
        threads: int,
        max_queue: int,
        default_budget_ms: float,
        max_budget_ms: float,
        header_timeout_ms: float,
        io_timeout_ms: float,
        write_grace_ms: float,
        max_io_wait_ms: float,
        linger_ms: float,
        max_drain_bytes: int,
        max_head: int,
        answers: dict[str, tuple[bytes, bytes | None]],
        max_lingering: int = 512,
        order: str = "fifo",
        codel_target_ns: int = 5000000,
        codel_interval_ns: int = 100000000,
        expected_service_ns: int = 0,
        expected_quantile_permille: int = 0,
        vegas: bool = False,
        min_concurrency: int = 1,
        reserved: int = 0,
        critical_header: bytes | None = None,
        critical_paths: Iterable[bytes] = (),
        trust_request_start: bool = False,
        max_upstream_ns: int = 0,
        trusted_networks: Iterable[tuple[int, bytes, int]] | None = None,
        role: str = "single",
        measured_retry_after: bool = True,
        observe: bool = False,
    ) -> None: ...
    def start(self) -> None: ...
    def add_channel(self, fd: int, worker: int) -> None: ...
    def retire_worker(self, worker: int) -> None: ...
    def worker_gone(self, worker: int) -> None: ...
    def worker_loads(self) -> dict[int, int]: ...
    def channel(self, fd: int) -> Channel: ...
    def next_connection(self) -> Connection | None: ...
    def drain(self) -> None: ...
    def wait_idle(self, timeout_s: float) -> bool: ...
    def stop(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def observed(self) -> list[tuple[str, int, int, int, bool]]: ...
