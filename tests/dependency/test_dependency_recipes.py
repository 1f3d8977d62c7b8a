"""The "Slow dependencies" page's recipes run as written (``docs/how-to/slow-dependency.md``).

Its ``python`` blocks run in order in one namespace (later recipes use names
from earlier ones). Nothing is sent over the
network: the recipes only define clients and functions. Then the view recipe
is exercised with a stand-in for the HTTP call, fresh and then stale.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from _required import require

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "slow-dependency.md"
TEXT = PAGE.read_text(encoding="utf-8")
# The breaker's and last-known-good's own examples follow (## sections);
# tests/dependency/test_dependency_breaker_docs.py runs those, from the same page.
SECTION = TEXT[: TEXT.index("## Circuit breaker\n")]
BLOCKS = re.findall(r"^```python\n(.*?)^```$", SECTION, re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def namespace() -> dict[str, Any]:
    require("requests")
    require("httpx")
    names: dict[str, Any] = {"__name__": "__recipe__"}
    for index, source in enumerate(BLOCKS):
        exec(compile(source, f"{PAGE.name}[{index}]", "exec"), names)  # noqa: S102 - the recipe is what is tested
    return names


def test_the_section_has_its_recipes() -> None:
    assert len(BLOCKS) >= 4
    for name in ("DeadlineSession", "DeadlineTransport", "call_detailed", "current_attempt", "AdaptiveTimeout"):
        assert name in SECTION


def test_the_recipes_build_what_they_say(namespace: dict[str, Any]) -> None:
    recommendations = namespace["recommendations"]
    assert recommendations.max_concurrent == 20 and recommendations.stale_for_s == 600
    assert recommendations.breaker is not None
    assert namespace["prices"].critical
    assert namespace["catalog"].endpoints == ("http://catalog-1:8080", "http://catalog-2:8080", "http://catalog-3:8080")


def test_the_view_recipe_marks_stale_values(namespace: dict[str, Any]) -> None:
    up = {"ok": True}

    def fake_fetch(user_id: int) -> list[str]:
        if not up["ok"]:
            raise ConnectionError("recs is down")
        return [f"item for {user_id}"]

    namespace["fetch_recommendations"] = fake_fetch
    view = namespace["recommendations_view"]
    body, status, headers = view(7)
    assert (body, status, headers) == ({"items": ["item for 7"], "stale": False}, 200, {})
    up["ok"] = False
    body, status, headers = view(7)
    assert body == {"items": ["item for 7"], "stale": True} and status == 200
    assert headers["Warning"].startswith("110") and int(headers["X-Stale-Age-S"]) >= 0
