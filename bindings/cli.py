"""The ``prazo`` command: ``prazo demo``, ``prazo bench``, ``prazo serve``."""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print("prazo: commands are being built", args)
    return 0
