"""The README's copies of shipped files are those files, byte for byte.

The load-balancer configs (``examples/loadbalancers/``) are what the tests
run (HAProxy, nginx) or check (Envoy), and the OpenTelemetry example is run by
``tests/integrations/opentelemetry/test_opentelemetry.py``; the README shows them in full so they can be
copied. A copy edited on one side only would be a recipe nobody tested, so
each README section must hold exactly one fenced block that starts like the
file, and that block must be the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _readme import fenced_blocks, section

ROOT = Path(__file__).resolve().parents[2]

# (shipped file, the README section that shows it, the block's info string)
COPIES = [
    ("examples/loadbalancers/haproxy.cfg", "### Behind a load balancer: HAProxy, nginx, Envoy", "haproxy"),
    ("examples/loadbalancers/nginx.conf", "### Behind a load balancer: HAProxy, nginx, Envoy", "nginx"),
    ("examples/loadbalancers/envoy.yaml", "### Behind a load balancer: HAProxy, nginx, Envoy", "yaml"),
    ("examples/opentelemetry/console.py", "### OpenTelemetry", "python"),
]


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
