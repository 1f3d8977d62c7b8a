"""The README's copies of shipped files are those files, byte for byte.

The load-balancer configs (``examples/loadbalancers/``) are what the tests
run (HAProxy, nginx) or check (Envoy), and the OpenTelemetry example is run by
``tests/test_opentelemetry.py``; the README shows them in full so they can be
copied. A copy edited on one side only would be a recipe nobody tested, so
each README section must hold exactly one fenced block that starts like the
file, and that block must be the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# (shipped file, the README section that shows it, the block's info string)
COPIES = [
    ("examples/loadbalancers/haproxy.cfg", "### Behind a load balancer: HAProxy, nginx, Envoy", "haproxy"),
    ("examples/loadbalancers/nginx.conf", "### Behind a load balancer: HAProxy, nginx, Envoy", "nginx"),
    ("examples/loadbalancers/envoy.yaml", "### Behind a load balancer: HAProxy, nginx, Envoy", "yaml"),
    ("examples/opentelemetry/console.py", "### OpenTelemetry", "python"),
]


def section(heading: str) -> str:
    """The README from ``heading`` to the next heading of the same or a higher level.

    Lines inside fenced blocks are not headings: the configs' own comments start with ``#``.
    """
    lines = README.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line == heading + "\n"]
    assert len(starts) == 1, f"README.md has no single {heading!r} section"
    level = len(heading.split(" ", 1)[0])
    in_fence = False
    for end in range(starts[0] + 1, len(lines)):
        line = lines[end]
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(rf"#{{1,{level}}} ", line):
            break
    else:
        end = len(lines)
    return "".join(lines[starts[0] : end])


def fenced_blocks(text: str, info: str) -> list[str]:
    """Each ```info block's text, with the newline that ends its last line (as in a file)."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?\n)```$", text, re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize(("path", "heading", "info"), COPIES, ids=[path for path, _, _ in COPIES])
def test_the_readme_copy_is_the_shipped_file(path: str, heading: str, info: str) -> None:
    shipped = (ROOT / path).read_bytes()
    first_line = shipped.decode("utf-8").splitlines(keepends=True)[0]
    copies = [block for block in fenced_blocks(section(heading), info) if block.startswith(first_line)]
    assert len(copies) == 1, f"{heading!r} must show {path} once, starting with {first_line!r}"
    assert copies[0].encode("utf-8") == shipped, f"README.md's copy of {path} differs from the file: copy it again"


def test_every_shipped_config_is_in_the_readme() -> None:
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "loadbalancers").iterdir() if p.is_file()}
    assert shipped <= {path for path, _, _ in COPIES}, shipped
