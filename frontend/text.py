"""Small text helpers shared by the page and the panels."""

from __future__ import annotations

import re

from kvscope.backend.events.state import RequestView
from kvscope.frontend.grammar_position import KIND_LABELS, constraint


def md_escape(text: str) -> str:
    """Scenario text shown as Markdown literally (`engine.prefix_caching=false` is not emphasis).

    Markdown's own escapes for its syntax; entities for <, > and | (a backslash before them is no
    escape to markdown2, and showed: `<\\|im_start\\|>`)."""
    text = re.sub(r"([\\`*_{}\[\]#])", r"\\\1", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")


def request_text(view: RequestView) -> str:
    """A request as a lesson reads it: how it stands, its prompt and its reply so far, as plain text
    (a chat's template tokens stay visible: they are part of the prompt the model read)."""
    status = f"finished ({view.finish_reason})" if view.finish_reason else view.status
    grammar = constraint(view.sampling)
    if grammar is not None:
        status += f" · structured output: {KIND_LABELS[grammar[0]]}"
    prompt = "(it arrived before this trace began)" if view.joined else view.prompt_text
    return (f"{view.id} · {status} · reply, {len(view.output_token_ids)} tokens: {view.output_text}\n"
            f"prompt, {view.prompt_len} tokens: {prompt}")  # the reply first: a long prompt scrolls
