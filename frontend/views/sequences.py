"""The sequences of one request as text rows: n > 1 siblings, or beams with their log-probabilities.

Built from RunHistory's per-sequence tokens and totals and RunState's forks and ends; the engine
emits no running total, so a beam's cumulative log-probability and score are rebuilt here with the
engine's formula (backend/engine/beam_search.py: total / length ** length_penalty).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from kvscope.backend.events.history import RunHistory, SeqToken
from kvscope.backend.events.state import RunState

ROW_TOKENS = 48  # most recent tokens shown per row


@dataclass
class SeqLine:
    seq_id: int
    tokens: list[SeqToken]  # its whole output on record: inherited at forks, then its own
    inherited: int  # how many of `tokens` came from its parent(s)
    cumulative: float | None  # total log-probability of its output (None: not all of it on record)
    score: float | None  # beam search only
    end_reason: str | None  # eos | stop | length | abort | pruned
    end_step: int | None


def is_beam(state: RunState, request_id: str) -> bool:
    view = state.requests.get(request_id)
    return bool(view and view.sampling.get("beam_width"))


def seq_line(state: RunState, history: RunHistory, seq: int) -> SeqLine:
    """One sequence's output, total log-probability, score (beams) and end."""
    rid = state.seq_request.get(seq, "")
    request = state.requests.get(rid)
    tokens = history.seq_output(state, seq)
    own = len(history.seq_tokens.get(seq, ()))
    view = state.sequences.get(seq)
    cumulative = history.seq_logprob.get(seq, 0.0 if not tokens else None)
    score = None
    if request is not None and is_beam(state, rid) and cumulative is not None:
        length = _output_length(tokens, view.position if view else request.prompt_len, request.prompt_len)
        score = cumulative / max(1, length) ** request.sampling.get("length_penalty", 1.0)
    return SeqLine(seq, tokens, len(tokens) - own, cumulative, score,
                   view.end_reason if view else None, view.end_step if view else None)


def _output_length(tokens: list[SeqToken], fork_position: int, prompt_len: int) -> int:
    """Output tokens so far (all of them, even those no longer on record)."""
    last = tokens[-1].event["position"] + 1 if tokens else fork_position
    return last - prompt_len


def seq_lines(state: RunState, history: RunHistory, request_id: str) -> list[SeqLine]:
    """Every sequence of the request: those still going or finished first, pruned beams last."""
    view = state.requests.get(request_id)
    if view is None:
        return []
    lines = [seq_line(state, history, seq) for seq in view.seq_ids]
    return sorted(lines, key=lambda line: line.end_reason == "pruned")


def token_label(text: str) -> str:
    if text == "":
        return "∅"
    return text.replace("\n", "⏎").replace(" ", "␣")[:14]


def line_head(line: SeqLine) -> str:
    """seq 5 · Σ log p −12.31 · score −0.77 · pruned at step 3"""
    parts = [f"seq {line.seq_id}"]
    if line.cumulative is not None:
        parts.append(f"Σ log p {line.cumulative:.2f}")
    if line.score is not None:
        parts.append(f"score {line.score:.2f}")
    if line.end_reason == "pruned":
        parts.append(f"pruned at step {line.end_step}")
    elif line.end_reason:
        parts.append(f"ended ({line.end_reason})")
    return " · ".join(parts)


def tokens_html(line: SeqLine, picked: int | None, labelled: bool, current: bool = False) -> str:
    """A row of clickable tokens (data-s: the sequence, data-i: the index in its output); `labelled`:
    headed by the sequence's line_head, struck through when pruned; `current`: the selected sequence."""
    first = max(0, len(line.tokens) - ROW_TOKENS)
    spans = []
    for i in range(first, len(line.tokens)):
        cls = "kv-tok" + (" kv-tok-inh" if i < line.inherited else "") + (" kv-tok-selected" if i == picked else "")
        text = html.escape(token_label(line.tokens[i].event["text"]))
        spans.append(f'<span class="{cls}" data-s="{line.seq_id}" data-i="{i}">{text}</span>')
    if not labelled:
        return "".join(spans)
    cls = "kv-seq-line" + (" kv-seq-pruned" if line.end_reason == "pruned" else "") + (" kv-seq-current" if current else "")
    head = f'<span class="kv-seq-label">{html.escape(line_head(line))}</span>'
    return f'<div class="{cls}" data-seq="{line.seq_id}">{head}{"".join(spans)}</div>'
