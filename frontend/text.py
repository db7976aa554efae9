"""Small text helpers shared by the page and the panels."""

from __future__ import annotations

import re


def md_escape(text: str) -> str:
    """Scenario text shown as Markdown literally (`engine.prefix_caching=false` is not emphasis).

    Markdown's own escapes for its syntax; entities for <, > and | (a backslash before them is no
    escape to markdown2, and showed: `<\\|im_start\\|>`)."""
    text = re.sub(r"([\\`*_{}\[\]#])", r"\\\1", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
