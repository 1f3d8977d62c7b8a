"""The front door's C critical-class rule agrees with its Python spec, ``CriticalClassifier``.

The engine decides a request's class in its C thread, from the raw head,
before any Python runs (``pfd_is_critical``). The rule it must follow is the
one every other binding applies: ``CriticalClassifier`` over the environ the
app receives. So for any head, the engine's verdict must equal the
classifier's verdict on the environ the front door's own workers build from
that head (``RequestRunner.environ``) - percent-decoding, absolute-form
targets, queries, a header sent twice, and whitespace that HTTP does or does
not count as optional included.
"""

from __future__ import annotations

from typing import Any

import pytest
from _helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from prazo.bindings.policies import CriticalClassifier
from prazo.bindings.servers.frontdoor.runner import RequestRunner
from prazo.bindings.servers.frontdoor.server import compiled_engine, engine_critical_paths

# compiled: its subject is C code, so `make sanitize` runs it.
pytestmark = pytest.mark.compiled

HEADER = "X-Priority"
PATHS = ["/healthz", "/a/b", "/%", "/ol\xe9", "/"]


class _ParsedHead:
    """What the engine's Connection gives a worker for a head: just the fields ``RequestRunner.environ`` reads."""

    def __init__(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        self.method, self.target, version = lines[0].split(b" ")
        self.minor_version = int(version[-1:])
        self.peer = None
        self.budget_source = None
        # picohttpparser hands values over without their leading and trailing SP/HTAB
        self.headers = [
            (name, value.strip(b" \t")) for name, _, value in (line.partition(b":") for line in lines[1:] if line)
        ]


def _python_verdict(head: bytes, classifier: CriticalClassifier) -> bool:
    runner = RequestRunner(_no_app, {}, lambda: False)
    return classifier(runner.environ(_ParsedHead(head)))


def _no_app(environ: Any, start_response: Any) -> Any:
    raise AssertionError("only the environ is built here")


def _c_verdict(head: bytes) -> bool:
    verdict: bool = compiled_engine().is_critical(head, HEADER.encode("ascii"), engine_critical_paths(PATHS))
    return verdict


_path_piece = st.sampled_from(
    ["/", "healthz", "a", "b", "%2F", "%2f", "%2", "%", "%zz", "%25", "ol", "%E9", "%e9", "?", "?x=1", "%3F", "."]
)
_target = st.builds(
    lambda authority, pieces: authority + "".join(pieces),
    st.sampled_from(["", "http://example.com", "https://example.com:8443", "http://h"]),
    st.lists(_path_piece, max_size=6),
).filter(lambda target: target != "")
_value = st.sampled_from(
    [
        "critical", "Critical", "CRITICAL", " critical", "critical\t", "\tcritical ", "critical,critical",
        "critical, x", "criticals", "", "normal", "\xa0critical", "critical\xa0", "\x85critical", "crit ical",
    ]
)  # fmt: skip
_name = st.sampled_from([HEADER, HEADER.lower(), HEADER.upper(), "X_Priority", "X-Priority-2", "Priority"])


@settings(max_examples=examples(400), deadline=None)
@given(
    target=_target,
    fields=st.lists(st.tuples(_name, _value), max_size=3),
    version=st.sampled_from(["1.0", "1.1"]),
)
def test_the_engine_classifies_every_head_as_the_classifier_does_its_environ(
    target: str, fields: list[tuple[str, str]], version: str
) -> None:
    if not target.startswith(("/", "http")):
        target = "/" + target
    lines = [f"GET {target} HTTP/{version}", "Host: h"] + [f"{name}: {value}" for name, value in fields]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    classifier = CriticalClassifier(header=HEADER, paths=PATHS)
    assert _c_verdict(head) == _python_verdict(head, classifier), head


@pytest.mark.parametrize(
    ("head", "critical"),
    [
        # a header sent twice reaches the app joined by ",": never exactly "critical"
        (b"GET /x HTTP/1.1\r\nHost: h\r\nX-Priority: critical\r\nX-Priority: critical\r\n\r\n", False),
        # NBSP (obs-text) is not optional whitespace: the value is not "critical"
        (b"GET /x HTTP/1.1\r\nHost: h\r\nX-Priority: \xa0critical\r\n\r\n", False),
        (b"GET /x HTTP/1.1\r\nHost: h\r\nX-Priority: \tCritical \r\n\r\n", True),
        # absolute-form without a path: PATH_INFO is "/"
        (b"GET http://example.com HTTP/1.1\r\nHost: example.com\r\n\r\n", True),
        (b"GET http://example.com/healthz?probe=1 HTTP/1.1\r\nHost: example.com\r\n\r\n", True),
        (b"GET /ol%E9 HTTP/1.1\r\nHost: h\r\n\r\n", True),
        (b"GET /healthz%3F HTTP/1.1\r\nHost: h\r\n\r\n", False),
    ],
)
def test_the_edges_where_the_two_rules_once_differed(head: bytes, critical: bool) -> None:
    classifier = CriticalClassifier(header=HEADER, paths=PATHS)
    assert _python_verdict(head, classifier) is critical
    assert _c_verdict(head) is critical


def test_a_malformed_head_is_refused_by_the_hook_not_classified() -> None:
    with pytest.raises(ValueError, match="head"):
        compiled_engine().is_critical(b"GET /healthz HTTP/1.1\r\nHost", b"X-Priority", [b"/healthz"])
