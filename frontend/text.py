"""Small text helpers shared by the page and the panels."""

from __future__ import annotations

import re

from kvscope.backend.events.history import RunHistory
from kvscope.backend.events.state import RequestView, RunState
from kvscope.frontend.grammar_position import KIND_LABELS, constraint


def md_escape(text: str) -> str:
    """Scenario text shown as Markdown literally (`engine.prefix_caching=false` is not emphasis).

    Markdown's own escapes for its syntax; entities for <, > and | (a backslash before them is no
    escape to markdown2, and showed: `<\\|im_start\\|>`)."""
    text = re.sub(r"([\\`*_{}\[\]#])", r"\\\1", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")


def request_text(view: RequestView, state: RunState, history: RunHistory) -> str:
    """A request as a lesson reads it: how it stands, its prompt and its reply so far, as plain text
    (a chat's template tokens stay visible: they are part of the prompt the model read). A request of
    several sequences (n > 1, beams) has a reply per sequence, never their tokens mixed into one."""
    status = f"finished ({view.finish_reason})" if view.finish_reason else view.status
    grammar = constraint(view.sampling)
    if grammar is not None:
        status += f" · structured output: {KIND_LABELS[grammar[0]]}"
    if view.transfer is not None:
        status += f" · {moved_text(view)}"
    prompt = "(it arrived before this trace began)" if view.joined else view.prompt_text
    return (f"{view.id} · {status} · {replies(view, state, history)}\n"
            f"prompt, {view.prompt_len} tokens: {prompt}")  # the reply first: a long prompt scrolls


def moved_text(view: RequestView) -> str:
    """A disaggregated request's move, and once it finished its TTFT split into queue, prefill and transfer."""
    t = view.transfer
    text = (f"moved at iteration {t['step']} from instance {t['src_instance']} to {t['dst_instance']}: "
            f"{len(t['src_blocks'])} blocks, {t['bytes'] / 1024:,.1f} KiB in {1000 * t['link_s']:.2f} ms")
    if view.ttft_s is not None and view.queue_s is not None and view.transfer_s is not None:
        prefill = view.ttft_s - view.queue_s - view.transfer_s
        text += (f" · TTFT {1000 * view.ttft_s:.1f} ms = queue {1000 * view.queue_s:.1f} + prefill "
                 f"{1000 * prefill:.1f} + transfer {1000 * view.transfer_s:.1f}")
    return text


def replies(view: RequestView, state: RunState, history: RunHistory) -> str:
    """The reply, or one line per sequence: the returned ones once it finished (best first), else each so far."""
    if view.outputs:
        return "replies, best first:" + "".join(f"\n  sequence {o['seq_id']}, {len(o['output_token_ids'])} tokens: "
                                                f"{o['output_text']}" for o in view.outputs)
    if len(view.seq_ids) < 2:
        return f"reply, {len(view.output_token_ids)} tokens: {view.output_text}"
    lines = []
    for seq in view.seq_ids:
        ended = state.sequences.get(seq)
        how = f" ({ended.end_reason})" if ended is not None and ended.end_reason else ""
        text = "".join(t.event["text"] for t in history.seq_output(state, seq))
        lines.append(f"\n  sequence {seq}{how}: {text}")
    return f"{len(view.seq_ids)} sequences:" + "".join(lines)
