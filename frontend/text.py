"""Small text helpers shared by the page and the panels."""

from __future__ import annotations

import re


def md_escape(text: str) -> str:
    """Scenario text shown as Markdown literally (`engine.prefix_caching=false` is not emphasis)."""
    return re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text)
