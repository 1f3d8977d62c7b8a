"""The ORCA ``endpoint-load-metrics`` header read back as a balancer reads it, for the load-report tests.

``TEXT name=value, name=value``: comma-separated pairs after the prefix, each
name once, each value a finite number. ``JSON {...}``: a JSON object whose
``named_metrics`` (and any other map) is flattened to the text form's names
(``named_metrics.queue``).
"""

from __future__ import annotations

import json
import math

__all__ = ["parse", "parse_json", "parse_text"]


def parse_text(value: str) -> dict[str, float]:
    """A ``TEXT`` header value as a balancer reads it; an AssertionError for anything else."""
    assert value.startswith("TEXT "), value
    fields: dict[str, float] = {}
    for pair in value[len("TEXT ") :].split(","):
        name, equals, number = pair.strip().partition("=")
        assert equals and name and name not in fields, value
        fields[name] = float(number)
        assert math.isfinite(fields[name]), value
    return fields


def parse_json(value: str) -> dict[str, float]:
    """A ``JSON`` header value, flattened to the ``TEXT`` form's names (``named_metrics.queue``)."""
    assert value.startswith("JSON "), value
    document = json.loads(value[len("JSON ") :])
    fields: dict[str, float] = {}
    for name, item in document.items():
        if isinstance(item, dict):
            fields.update({f"{name}.{key}": float(number) for key, number in item.items()})
        else:
            fields[name] = float(item)
    return fields


def parse(value: str) -> dict[str, float]:
    return parse_text(value) if value.startswith("TEXT ") else parse_json(value)
