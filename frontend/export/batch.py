"""The batch picture: tokens per iteration stacked by request, the budget, slots and the queue."""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from kvscope.frontend.export.figure import Size, engine_facts, frame, legend_outside, request_colors, request_handles
from kvscope.frontend.export.options import SLIDE_SIZE
from kvscope.frontend.export.replayed import ExportedRun
from kvscope.frontend.palette import BUDGET_COLOR, RECOMPUTE_COLOR, SLOT_COLORS

IDLE_COLOR = "#f1f1f1"  # idle while nobody waits; idle while requests wait is SLOT_COLORS["idle"], as on the page
QUEUE_COLOR = "#374151"  # the waiting-queue line
# Decode bars are plain; a prefill chunk is hatched (in its request's colour), a recompute (no KV
# cache) cross-hatched in the recompute colour.
PHASE_STYLE = {"prefill": {"alpha": 0.55, "hatch": "////", "linewidth": 0},
               "recompute": {"hatch": "xx", "edgecolor": RECOMPUTE_COLOR, "linewidth": 0}}
PLAIN_STYLE = {"edgecolor": "none", "linewidth": 0}


def draw_batch(run: ExportedRun, seconds: bool = False, size: Size = SLIDE_SIZE) -> Figure:
    subtitle = f"{len(run.batches)} iterations · {engine_facts(run)}"
    fig, (tok_ax, seq_ax) = frame(run, "Batch composition", subtitle, size, rows=2, sharex=True,
                                  height_ratios=[3, 1.3])
    steps = sorted(run.batches)
    width = 0.8 if len(steps) <= 150 else 1.0
    colors = request_colors(run)
    for (rid, phase), (xs, hs, bs) in _token_stacks(run).items():
        style = {**PHASE_STYLE.get(phase, PLAIN_STYLE), **({"edgecolor": colors[rid]} if phase == "prefill" else {})}
        tok_ax.bar(xs, hs, bottom=bs, width=width, color=colors[rid], **style)
    budgets = [it["token_budget"] for it in run.state.iterations]
    tok_ax.plot([it["step"] for it in run.state.iterations], budgets, drawstyle="steps-mid", color=BUDGET_COLOR,
                linestyle="--", linewidth=2)
    tok_ax.set_ylabel("tokens in the iteration")
    tok_ax.set_ylim(0, max(budgets) * 1.08)
    scheduled = [r for r in run.order if r in run.ran]
    computed = Patch(color="#555555", label="decode tokens") if run.state.kv_cache else \
        Patch(facecolor="#555555", hatch="xx", edgecolor=RECOMPUTE_COLOR, label="recompute tokens (no KV cache)")
    handles = [Patch(facecolor="#bbbbbb", hatch="////", edgecolor="#555555", label="prefill tokens"), computed,
               Line2D([], [], color=BUDGET_COLOR, linestyle="--", label="token budget")]
    legend_outside(tok_ax, handles + request_handles(colors, scheduled), title="tokens by request", gap=0.05)
    _slots(seq_ax, run)
    return fig


def _token_stacks(run: ExportedRun) -> dict[tuple[str, str], tuple[list[int], list[int], list[int]]]:
    """(request, phase) -> the x, height and bottom of its bars, stacked in arrival order per iteration."""
    rank = {rid: i for i, rid in enumerate(run.order)}
    stacks: dict[tuple[str, str], tuple[list[int], list[int], list[int]]] = {}
    for step, per in run.batches.items():
        bottom = 0
        for rid in sorted(per, key=lambda r: rank.get(r, len(rank))):
            phase, tokens = per[rid]
            xs, hs, bs = stacks.setdefault((rid, phase), ([], [], []))
            xs.append(step), hs.append(tokens), bs.append(bottom)
            bottom += tokens
    return stacks


def _slots(ax: Axes, run: ExportedRun) -> None:
    """Sequences in the batch, the idle slots up to max_num_seqs, and the waiting queue."""
    its = list(run.state.iterations)
    steps = [it["step"] for it in its]
    sizes = [len(it["batch"]) for it in its]
    cap = run.state.config.get("max_num_seqs") or max(sizes)
    idle = [max(0, cap - s) for s in sizes]
    idle_colors = [SLOT_COLORS["idle"] if it["num_waiting"] else IDLE_COLOR for it in its]
    width = 0.8 if len(steps) <= 150 else 1.0
    ax.bar(steps, sizes, width=width, color=SLOT_COLORS["used"])
    ax.bar(steps, idle, bottom=sizes, width=width, color=idle_colors, hatch="..", edgecolor="#c8c8c8", linewidth=0)
    ax.set_ylabel("sequences")
    ax.set_xlabel("engine iteration (step)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    ax.set_xlim(min(steps) - 0.6, max(steps) + 0.6)
    _waiting_line(ax, steps, [it["num_waiting"] for it in its])
    legend_outside(ax, [Patch(color=SLOT_COLORS["used"], label="sequences in the batch"),
                        Patch(facecolor=IDLE_COLOR, hatch="..", edgecolor="#c8c8c8", label=f"idle slots (of {cap})"),
                        Patch(facecolor=SLOT_COLORS["idle"], hatch="..", edgecolor="#c8c8c8",
                              label="idle while requests wait"),
                        Line2D([], [], color=QUEUE_COLOR, label="waiting requests (right axis)")], gap=0.05)


def _waiting_line(ax: Axes, steps: list[int], waiting: list[int]) -> None:
    """The queue on its own (right) axis: it can be far longer than max_num_seqs."""
    twin = ax.twinx()
    twin.plot(steps, waiting, drawstyle="steps-mid", color=QUEUE_COLOR, linewidth=2.5)
    twin.set_ylim(0, max(1, max(waiting)) * 1.1)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    twin.set_ylabel("waiting", color=QUEUE_COLOR)
    twin.tick_params(axis="y", colors=QUEUE_COLOR)
