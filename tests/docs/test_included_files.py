"""The docs show the shipped config files and examples by including them, never by copying them.

The load-balancer configs (``examples/loadbalancers/``) are what the tests run
(HAProxy, nginx) or check (Envoy), the OpenTelemetry example is run by
``tests/integrations/opentelemetry/test_opentelemetry.py``, and the Flask example by
``tests/integrations/flask/test_flask.py``; their pages pull them in with
``literalinclude``, so what a reader copies is the file that was tested. This holds
each page to its ``literalinclude`` and every shipped config to a page.
"""

from __future__ import annotations

import re

import pytest
from _docs import ROOT, blocks

# (shipped file, the page that shows it)
INCLUDED = [
    ("examples/loadbalancers/haproxy.cfg", "docs/how-to/load-balancers.md"),
    ("examples/loadbalancers/nginx.conf", "docs/how-to/load-balancers.md"),
    ("examples/loadbalancers/envoy.yaml", "docs/how-to/load-balancers.md"),
    ("examples/opentelemetry/console.py", "docs/how-to/tracing.md"),
    ("examples/flask_app.py", "docs/tutorial.md"),
]


@pytest.mark.parametrize(("path", "page"), INCLUDED, ids=[path for path, _ in INCLUDED])
def test_the_page_includes_the_shipped_file(path: str, page: str) -> None:
    included = [
        (ROOT / page).parent.joinpath(block.info.split(None, 1)[1]).resolve()
        for block in blocks(page)
        if re.match(r"\{literalinclude\}\s", block.info)
    ]
    assert (ROOT / path).resolve() in included, f"{page} must include {path} with literalinclude"


def test_every_shipped_config_is_in_the_docs() -> None:
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "examples" / "loadbalancers").iterdir() if p.is_file()}
    assert shipped <= {path for path, _ in INCLUDED}, shipped


def test_no_page_copies_a_shipped_file() -> None:
    """A fenced block that starts like a shipped file would be a copy that can drift: include it instead."""
    firsts = {path: (ROOT / path).read_text(encoding="utf-8").splitlines()[0] for path, _ in INCLUDED}
    for page in {page for _, page in INCLUDED} | {"README.md"}:
        for block in blocks(page):
            for path, first in firsts.items():
                assert not block.source.startswith(first + "\n"), f"{block} copies {path}: literalinclude it"
