"""The ```py blocks of docs/integrations.md that need a framework of this virtualenv: each check file runs its
framework's block as written (tests/test_doc_examples.py checks that every block has a runner)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def snippet(marker: str) -> str:
    """The one ```py block of docs/integrations.md that names ``marker``."""
    blocks = re.findall(r"```py\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    (code,) = [b for b in blocks if marker in b]
    return code
