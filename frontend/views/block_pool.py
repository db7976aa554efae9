"""Block pool: every physical KV block as one cell of a canvas, coloured by the request owning it."""

from __future__ import annotations

import html
from dataclasses import dataclass

from nicegui import ui
from nicegui.events import GenericEventArguments

from kvscope.backend.events.state import RunState
from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.backend.events.history import RunHistory
from kvscope.frontend.selection import Selection
from kvscope.frontend.palette import BLOCK_COLORS, FLASH_COLORS, FLASH_LABELS, FOCUS_COLOR, REQUEST_COLORS, request_color
from kvscope.frontend.views.base import FeedView, legend, legend_html, view_card
from kvscope.frontend.views.kv_calc import human, span_text
from kvscope.frontend.views.live_text import LiveText

FREE, USED, CACHED = 0, 1, 2
SHARED, DRAFT, PICKED = 1, 2, 4  # bits of a cell's marks (PICKED: held by the selected request)
FLASH_OF = {"block_alloc": "alloc", "block_free": "free", "block_share": "share", "block_evict": "evict"}

EXPLANATION = """
The KV cache is one pool of fixed-size **blocks** (each holds the keys and values of *block size*
tokens, for every layer). A request gets blocks one at a time as its text grows, so memory is never
reserved for tokens that do not exist yet (that is *paged attention*).

- **colour**: the request owning the block (the same colour as in the timeline and batch views)
- **grey**: free; **pale green**: free but still holding a full block of some prefix, reusable by
  a later request with the same prefix until it is evicted
- **dark corner**: shared by more than one sequence (ref count > 1): prefix caching, or a fork
  (parallel sampling with n > 1, beam search) whose sequences read the prompt's blocks once
- **white stripes**: the draft model's own KV blocks (speculative decoding with a draft model)
- rings flash on **allocate** (green), **free** (slate), **share** (purple), **copy-on-write**
  (orange) and **evict** (red)
- a **double ring** (white inside) lasts while a lesson step explains those blocks, in the colour of
  what the moment did to them: orange for a copy-on-write, purple for a share, green for new blocks

Hover a block for its owners and how many of its token slots are filled; click it to select its
request in the other views. While a request is selected its blocks are outlined and the others fade.

With **tensor parallelism** (the model split over ranks, each a process) there is one strip per
rank. One block table drives them all, so the same blocks light up in every strip: block 7 holds
the same tokens on each rank, but each rank keeps only the keys and values of its own KV heads, so
its block is a share of the bytes. Each strip's title says which heads the rank holds and its bytes.

With **disaggregated prefill and decode** there is one strip per instance, each its own pool: a
request's prompt fills blocks in its prefill instance's strip; once its first token is drawn, its
blocks are copied into its decode instance's strip and freed where they were, and both sets ring
**teal** as they move. The block numbers run on across the strips, as the events number them.
"""

STRIPES = f"repeating-linear-gradient(45deg,{request_color(0)} 0 3px,#fff 3px 5px)"
LEGEND = [(BLOCK_COLORS["free"], "free"), (request_color(0), "in use (colour = request)"),
          (BLOCK_COLORS["cached"], "free, cached prefix"), (BLOCK_COLORS["shared"], "corner: shared (ref > 1)"),
          (STRIPES, "stripes: draft model")]
def ring_legend(moves: bool = False) -> list[tuple[str, str]]:
    """The rings' legend: a disaggregated run's blocks also ring as they move between instances."""
    return [(f"transparent;box-shadow:inset 0 0 0 3px {color}", f"ring: {FLASH_LABELS[kind]}")
            for kind, color in FLASH_COLORS.items() if moves or kind != "move"] + \
        [(f"transparent;box-shadow:inset 0 0 0 3px {FOCUS_COLOR},inset 0 0 0 5px #fff", "lesson: look here")]


class BlockPoolCanvas(ui.element, component="block_pool.js"):
    """The canvas component; Python sends `reset` / `apply` and answers `hover` with `tip`."""

    def __init__(self) -> None:
        super().__init__()
        self._props["palette"] = list(REQUEST_COLORS)
        self._props["colors"] = {**BLOCK_COLORS, "flash": FLASH_COLORS, "focus": FOCUS_COLOR}


def blocks_in_use(state: RunState) -> int:
    """Blocks held by a sequence now (RunState.blocks_in_use: the one count of KV usage)."""
    return state.blocks_in_use


def pool_bytes(state: RunState) -> int:
    """The KV cache's bytes: blocks times bytes per block (none without a cache)."""
    return state.num_blocks * state.cache.get("bytes_per_block", 0) if state.kv_cache else 0


def pool_text(state: RunState) -> str:
    """The KV cache's bytes in words: one pool, or one per tensor-parallel rank."""
    ranks = len(state.ranks)
    return f"{ranks} × {human(pool_bytes(state))} (a pool per rank)" if ranks else human(pool_bytes(state))


def rank_title(rank: dict, block_size: int, replicated: bool, hosts: bool = False) -> str:
    """A rank's strip title: the heads it computes, the KV heads its pool holds, and that pool's bytes; with
    `hosts` (the ranks ran on more than one host), where it ran."""
    kv = span_text("KV head", rank["kv_heads"]) + (" (replicated)" if replicated else "")
    where = f" · on {rank['host']}" if hosts and rank.get("host") else ""
    return (f"rank {rank['rank']}{where} · {span_text('query head', rank['heads'])} · {kv} · "
            f"{human(rank['kv_bytes_per_token'] * block_size)} per block, {human(rank['kv_bytes'])} in all")


def on_hosts(state: RunState) -> bool:
    """Whether the run's ranks ran on more than one host (torchrun across machines)."""
    return len({rank.get("host") for rank in state.ranks}) > 1


@dataclass(frozen=True)
class Strip:
    """One canvas of the pool: its title, and the blocks it draws, [first, first + size)."""

    title: str | None
    first: int
    size: int


def instance_title(instance: dict) -> str:
    """A disaggregated instance's strip title: its role, and the blocks of its own pool."""
    first, n = instance["first_block"], instance["num_blocks"]
    return f"{instance['role']} instance {instance['instance']} · its own pool, blocks {first}–{first + n - 1}"


def strips_of(state: RunState) -> list[Strip]:
    """The canvases the pool is drawn in: one; a strip per tensor-parallel rank, each drawing every block (one
    block table drives them all); a strip per disaggregated instance, each drawing its own blocks."""
    if state.instances:
        return [Strip(instance_title(i), i["first_block"], i["num_blocks"]) for i in state.instances]
    replicated = bool((state.tensor_parallel or {}).get("kv_heads_replicated"))
    bs = state.cache.get("block_size", 0)
    return [Strip(rank_title(rank, bs, replicated, on_hosts(state)), 0, state.num_blocks) for rank in state.ranks] \
        or [Strip(None, 0, state.num_blocks)]


def cell_of(state: RunState, history: RunHistory, free: set[int], block: int,
            selected: str | None = None) -> tuple[int, int, int]:
    """(state, colour index, marks: SHARED | DRAFT | PICKED bits) of one block as the reducer knows it."""
    owners = state.block_owner.get(block)
    shared = SHARED if state.ref_counts.get(block, 1) > 1 else 0
    if owners:
        rid = state.seq_request.get(min(owners), "")
        draft = DRAFT if any(seq in state.draft_seqs for seq in owners) else 0
        picked = PICKED if selected is not None and any(state.seq_request.get(s) == selected for s in owners) else 0
        return USED, history.rows.get(rid, 0), shared | draft | picked
    if block in state.cached_blocks:
        return CACHED, 0, 0
    if block in free:
        return FREE, 0, 0
    return USED, 0, shared  # allocated but its owner is not known yet


def describe_block(state: RunState, history: RunHistory, block: int) -> str:
    """The tooltip: id, state, owners with logical index and fill (hashes are not in the events)."""
    bs = state.cache.get("block_size", 0)
    owners = sorted(state.block_owner.get(block, ()))
    if not owners:
        what = "free, still holds a cached prefix (evictable)" if block in state.cached_blocks else "free"
        return f"<b>block {block}</b><br>{what}"
    lines = [f"<b>block {block}</b> · ref count {state.ref_counts.get(block, 1)}"]
    for seq in owners:
        rid = state.seq_request.get(seq, "?")
        role = f", draft model for seq {state.draft_seqs[seq]}" if seq in state.draft_seqs else ""
        table = state.block_tables.get(seq, [])
        logical = table.index(block) if block in table else -1
        filled = min(bs, max(0, history.seq_context.get(seq, 0) - logical * bs)) if logical >= 0 else 0
        lines.append(f"{html.escape(rid)} (seq {seq}{role}) · logical block {logical} · {filled}/{bs} slots filled")
    return "<br>".join(lines)


class BlockPoolView(FeedView):
    name = "blocks"

    def __init__(self, feed: RunFeed, selection: Selection, height: str = "260px") -> None:
        self.selection = selection
        self.height = height
        self.scale_group: str | None = None  # side by side: the pools drawn to one scale (block_pool.js)
        with view_card("Block pool (KV cache)", EXPLANATION, "w-full") as self.card:
            self.caption = LiveText().classes("kv-caption")
            self.strips = ui.column().classes("w-full gap-1")
            legend(LEGEND)
            self.rings = legend(ring_legend())
        self.titles: list[ui.label] = []
        self.strips_drawn: list[Strip] = []
        self.ringed: tuple[list[int], str | None] = ([], None)  # the lesson's lasting rings, and their colour
        self.canvases = self._build_strips([Strip(None, 0, 0)])
        selection.on_change(self.invalidate)  # its blocks outlined, the others dimmed: a full redraw
        super().__init__(feed)
        self.scale_note = ""  # side by side: how this pool's drawn area compares with the other's
        self.changes_sent = 0  # cells sent as deltas, for tests
        self.picked_sent: list[int] = []  # blocks last sent marked as the selected request's, for tests

    def _build_strips(self, strips: list[Strip]) -> list[BlockPoolCanvas]:
        """A canvas per strip, each under its title, sharing the card's height. The first canvas is the
        `block-pool` every test and lesson ring finds."""
        self.strips.clear()
        self.titles, self.strips_drawn = [], strips
        canvases = []
        height = f"calc({self.height} / {len(strips)})" if len(strips) > 1 else self.height
        with self.strips:
            for i, strip in enumerate(strips):
                if strip.title is not None:
                    self.titles.append(ui.label("").classes("kv-caption kv-rank-title").mark("block-pool-rank")
                                       .props("data-kv=block-pool-rank"))
                mark = "block-pool" if i == 0 else f"block-pool-rank-{i}"
                canvas = BlockPoolCanvas().style(f"width:100%;height:{height}").mark(mark) \
                    .props(f"data-kv={mark} :first={strip.first}")
                if self.scale_group:
                    canvas.props(f"scale-group={self.scale_group}")
                canvas.on("hover", lambda e, c=canvas, r=i: self._on_hover(e, c, r), ["block"])
                canvas.on("pick", self._on_pick, ["block"])
                canvases.append(canvas)
        return canvases

    def _show_strips(self, state: RunState) -> None:
        """The run's strips (the canvases built again only when the strips' number or first blocks change: a
        pool's size arrives with each reset), titled with what each holds."""
        strips = strips_of(state)
        if [s.first for s in strips] != [s.first for s in self.strips_drawn]:
            self.canvases = self._build_strips(strips)
            self.rings.set_content(legend_html(ring_legend(bool(state.instances))))
        self.strips_drawn = strips
        for title, strip in zip(self.titles, strips):
            title.set_text(strip.title)

    def _mine(self, blocks) -> list[list[int]]:
        """`blocks` (global numbers) split by canvas: each canvas's own."""
        return [[b for b in blocks if s.first <= b < s.first + s.size] for s in self.strips_drawn]

    def ring(self, blocks: list[int], color: str | None = None) -> None:
        """Lesson mode's lasting rings, on every strip that draws them (a rank's: all; an instance's: its own),
        in `color` (default: the focus colour); drawn again by each full redraw (new strips, their sizes)."""
        self.ringed = (list(blocks), color)
        for canvas, mine in zip(self.canvases, self._mine(blocks)):
            canvas.run_method("ring", mine, color)

    def full(self) -> bool:
        state, history, selected = self.feed.state, self.feed.history, self.selection.request_id
        self._show_strips(state)
        free = set(state.free_blocks)
        cells = [cell_of(state, history, free, b, selected) if state.kv_cache else (FREE, 0, 0)
                 for b in range(state.num_blocks)]
        self.picked_sent = [b for b, c in enumerate(cells) if c[2] & PICKED]
        meta = self.stamp_args()
        for canvas, strip in zip(self.canvases, self.strips_drawn):
            part = cells[strip.first:strip.first + strip.size]
            canvas.run_method("reset", {"state": [c[0] for c in part], "color": [c[1] for c in part],
                                        "marks": [c[2] for c in part], "focus": selected is not None,
                                        "bytes_per_block": pool_bytes(state) and state.cache["bytes_per_block"]}, meta)
        if self.ringed[0]:
            self.ring(*self.ringed)
        self._caption()
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        flashes: dict[int, str] = {}
        moved: dict[int, str] = {}  # a disaggregated run's blocks that left one pool and arrived in another
        for entry in entries:
            e = entry.event
            if e["type"] in FLASH_OF:
                flashes[e["block_id"]] = FLASH_OF[e["type"]]
            elif e["type"] == "block_copy":
                flashes[e["src_block_id"]] = flashes[e["dst_block_id"]] = "copy"
            elif e["type"] == "kv_transfer":  # after its blocks' allocs, before their frees: the move wins
                moved.update(dict.fromkeys([*e["src_blocks"], *e["dst_blocks"]], "move"))
            elif e["type"] == "spec_propose" and e.get("draft_seq_id") is not None:
                # the draft's blocks may predate the proposal that names its sequence: restripe them
                for block in self.feed.state.block_tables.get(e["draft_seq_id"], ()):
                    flashes.setdefault(block, "")
        flashes.update(moved)
        if not flashes or not self.feed.state.kv_cache:
            return False
        state, history = self.feed.state, self.feed.history
        free = set(state.free_blocks)
        selected = self.selection.request_id
        changes = [[b, *cell_of(state, history, free, b, selected), kind] for b, kind in flashes.items()
                   if b < state.num_blocks]
        meta = self.stamp_args()
        for canvas, strip in zip(self.canvases, self.strips_drawn):
            mine = [c for c in changes if strip.first <= c[0] < strip.first + strip.size]
            if mine:
                canvas.run_method("apply", mine, meta)
        self.changes_sent += len(changes)
        self._caption()
        return True

    def draw_to_scale(self, group: str) -> None:
        """Share one scale (bytes per px²) with the other pools of `group` (before the page is sent); a rank's
        strip is one pool of the group, drawn by its own bytes."""
        self.scale_group = group
        for canvas in self.canvases:
            canvas.props(f"scale-group={group}")

    def set_scale_note(self, note: str) -> None:
        if note != self.scale_note:
            self.scale_note = note
            if self.feed.state is not None:
                self._caption()

    def _caption(self) -> None:
        state = self.feed.state
        if not state.kv_cache:
            self.caption.set("KV cache off: no keys or values are kept between iterations, so no block holds "
                             "anything; every iteration recomputes each sequence's whole context")
            return
        n, bs = state.num_blocks, state.cache.get("block_size", 0)
        used = blocks_in_use(state)
        text = (f"{n} blocks × {bs} tokens · in use {used} ({100 * used / max(n, 1):.0f}%) · "
                f"cached {len(state.cached_blocks)} · shared {sum(1 for c in state.ref_counts.values() if c > 1)}")
        selected = self.selection.request_id
        if selected is not None:
            seqs = [seq for seq, rid in state.seq_request.items() if rid == selected]
            text += f" · {selected}: {len({b for s in seqs for b in state.block_tables.get(s, ())})} blocks"
        if state.draft_seqs:
            text += f" · draft model {sum(len(state.block_tables.get(s, ())) for s in state.draft_seqs)}"
        if state.ranks:
            text += f" · one block table for {len(state.ranks)} ranks: the same blocks on each"
        if state.instances:
            text += f" · a pool per instance ({len(state.instances)}): a request's blocks move from its prefill " \
                    "instance's to its decode instance's (ringed teal)"
        self.caption.set(f"{text} · {self.scale_note}" if self.scale_note else text)

    def _on_hover(self, e: GenericEventArguments, canvas: BlockPoolCanvas, rank: int) -> None:
        block, state = int(e.args["block"]), self.feed.state
        if state is None:
            return
        tip = describe_block(state, self.feed.history, block)
        if rank < len(state.instances):
            instance = state.instances[rank]
            tip += f"<br>in the pool of {instance['role']} instance {instance['instance']}"
        elif rank < len(state.ranks):
            held = state.ranks[rank]
            tip += (f"<br>on rank {rank}: {span_text('KV head', held['kv_heads'])} of these tokens, "
                    f"{human(held['kv_bytes_per_token'] * state.cache.get('block_size', 0))}")
        canvas.run_method("tip", block, tip)

    def _on_pick(self, e: GenericEventArguments) -> None:
        state = self.feed.state
        owners = state.block_owner.get(int(e.args["block"])) if state else None
        if owners:
            self.selection.select_request(state.seq_request.get(min(owners)))
