"""One palette: the page and the exported pictures colour every phase alike, and no request wears a phase's colour."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.history import KINDS
from kvscope.frontend.export.replayed import replay
from kvscope.frontend.export.timeline import PHASE_LABELS, draw_timeline
from kvscope.frontend.palette import KIND_LABELS, PHASE_COLORS, REQUEST_COLORS, RESERVED, for_js, request_color
from kvscope.frontend.views.timeline import legend_items

FRONTEND = Path(__file__).resolve().parents[1] / "frontend"


def lab(color: str) -> tuple[float, float, float]:
    """sRGB hex -> CIELAB (D65)."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(int(color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x, y, z = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
               (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def distance(a: str, b: str) -> float:
    return sum((p - q) ** 2 for p, q in zip(lab(a), lab(b), strict=True)) ** 0.5


def all_phases_story(kv_cache: bool = True) -> list[dict]:
    """Three requests that between them wait, prefill, decode (recompute without a KV cache), verify and
    sit preempted."""
    bus = EventBus(clock=iter(x / 10 for x in range(10_000)).__next__)
    events: list[dict] = []
    bus.subscribe(events.append)
    bus.emit("header", schema_version=1, run_id="colours", scenario={"name": "colours"},
             config={"max_num_seqs": 2, "max_num_batched_tokens": 16, "kv_cache": kv_cache},
             model={"name": "demo", "n_layers": 1, "n_heads": 1, "n_kv_heads": 1, "head_dim": 4, "attention": "mha",
                    "vocab_size": 32, "dtype": "float32", "kv_bytes_per_token": 32},
             cache={"num_blocks": 8, "block_size": 4, "bytes_per_block": 128})
    for seq, rid in enumerate("abc"):
        bus.emit("request_arrived", request_id=rid, seq_id=seq, prompt_token_ids=[1, 2, 3, 4], prompt_text="abcd",
                 sampling={}, max_tokens=4)
    for step, batch in enumerate(([("a", 0, "prefill", 4, 4)], [("a", 0, "decode", 1, 5), ("b", 1, "prefill", 4, 4)],
                                  [("a", 0, "verify", 3, 8)], [("b", 1, "prefill", 4, 4), ("c", 2, "prefill", 4, 4)])):
        bus.step = step
        if step == 2:
            bus.emit("preempt", request_id="b", seq_id=1, num_blocks_freed=1, mode="recompute")
        bus.emit("iteration", batch=[dict(zip(("request_id", "seq_id", "phase", "num_query_tokens", "context_len"), b))
                                     for b in batch], num_batched_tokens=sum(b[3] for b in batch), token_budget=16,
                 num_running=len(batch), num_waiting=3 - len(batch), kv_blocks_used=2, duration_s=0.1, max_num_seqs=2)
    return events


@pytest.mark.parametrize("kv_cache", [True, False])
def test_the_page_and_the_export_colour_every_phase_alike(kv_cache):
    fig = draw_timeline(replay(all_phases_story(kv_cache)))
    legend = fig.axes[0].get_legend()
    exported = {text.get_text(): to_hex(handle.get_facecolor()) for text, handle in
                zip(legend.get_texts(), legend.legend_handles, strict=True) if hasattr(handle, "get_facecolor")}
    live = dict((label, color) for color, label in legend_items(kv_cache))
    assert set(KIND_LABELS) == set(PHASE_LABELS) == set(KINDS)
    absent = "recompute" if kv_cache else "decode"  # without a KV cache every decode step is a recompute
    for phase in KINDS:
        if phase == absent:
            assert PHASE_LABELS[phase] not in exported and KIND_LABELS[phase] not in live, phase
            continue
        assert exported[PHASE_LABELS[phase]] == live[KIND_LABELS[phase]] == PHASE_COLORS[phase], phase
    assert [for_js()["kinds"][KINDS.index(k)] for k in KINDS] == [PHASE_COLORS[k] for k in KINDS]


@pytest.mark.parametrize("index", range(len(REQUEST_COLORS)))
def test_no_request_looks_like_a_phase_or_a_block_state(index):
    color = request_color(index)
    assert color not in RESERVED
    nearest = min(RESERVED, key=lambda reserved: distance(color, reserved))
    assert distance(color, nearest) >= 25, f"request colour {color} is too close to {nearest}"


def test_the_page_scripts_take_their_colours_from_the_palette():
    hard_coded = set(PHASE_COLORS.values()) | set(REQUEST_COLORS)
    for script in (FRONTEND / "static" / "kvscope.js", *(FRONTEND / "views").glob("*.js")):
        found = {c.lower() for c in re.findall(r"#[0-9a-fA-F]{6}\b", script.read_text(encoding="utf-8"))}
        assert not found & hard_coded, f"{script.name} hard-codes {found & hard_coded}"
