"""The run as an animated GIF for slides: the block pool above the timeline at 1920×1080, one frame
per iteration (or every `stride`-th, sampled to at most AUTO_FRAMES when no stride is asked for).

Drawn once, shown many times: the figure, its axes, legends and text are laid out and drawn a single
time; each frame restores that background and redraws only what moves (the pool's cells, the
timeline's bars and marks, the step in the title), as matplotlib's blitting does. The pool of each
frame comes from one pass over the events (RunState applied in order), not a replay per frame.
Frames are mapped onto a fixed palette (Pillow, no dithering) made of frontend/palette.py's colours
plus greys for text, so every colour in the GIF is exactly the page's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from PIL import Image

from kvscope.backend.events.state import RunState
from kvscope.frontend import palette
from kvscope.frontend.export.blocks import PoolCells, PoolGrid, pool_cells, pool_facts, pool_layout, pool_legend, \
    shown_rows_note, used_blocks
from kvscope.frontend.export.figure import SUBTITLE_PT, TITLE_PT, Size, request_colors, slide_figure, slide_style, \
    step_label
from kvscope.frontend.export.options import SLIDE_SIZE, ExportError
from kvscope.frontend.export.replayed import Event, ExportedRun, replay
from kvscope.frontend.export.timeline import TimelineArtists

MAX_FRAMES = 400  # an asked-for stride may go this far; a slide, not a film
AUTO_FRAMES = 80  # without a stride: every iteration up to this many, then every n-th (4 frames/s: 20 s)
FRAME_MS = 250  # 4 iterations a second, the page's default speed
LAST_FRAME_MS = 2500  # the end holds before the loop starts again
POOL_SHARE = 0.42  # of the height, for the block pool (the timeline takes the rest)

Progress = Callable[[float], None]


def palette_colors() -> list[str]:
    """Every colour the page means something by, then greys and white for text and edges."""
    named = [*palette.PHASE_COLORS.values(), palette.RECOMPUTE_COLOR, palette.BUDGET_COLOR,
             *palette.REQUEST_COLORS, palette.MANY_REQUESTS_COLOR, *palette.BLOCK_COLORS.values(),
             *palette.FLASH_COLORS.values(), *palette.SLOT_COLORS.values(), palette.FOCUS_COLOR]
    greys = [f"#{v:02x}{v:02x}{v:02x}" for v in range(0, 256, 8)] + ["#ffffff"]
    return list(dict.fromkeys(c.lower() for c in [*named, *greys]))


def _palette_image() -> Image.Image:
    rgb = [round(255 * v) for c in palette_colors() for v in to_rgb(c)]
    image = Image.new("P", (1, 1))
    image.putpalette(rgb + rgb[:3] * (256 - len(rgb) // 3))  # pad with the first colour
    return image


def auto_stride(first: int, last: int) -> int:
    """The smallest stride that keeps a run within AUTO_FRAMES frames."""
    return max(1, -(-(last - first + 1) // AUTO_FRAMES))


def frame_steps(first: int, last: int, stride: int) -> list[int]:
    """The iterations shown: every stride-th from the first, and always the last; ExportError past
    MAX_FRAMES, counted before any list is made (a trace's steps may lie far apart)."""
    shown = range(first, last + 1, stride)
    count = len(shown) + (shown[-1] != last)
    if count > MAX_FRAMES:
        raise ExportError("stride", f"{count} frames; use a stride of at least {-(-(last - first + 1) // MAX_FRAMES)}")
    return list(shown) if shown[-1] == last else [*shown, last]


def pool_moments(events: list[Event], steps: list[int], run: ExportedRun) -> dict[int, PoolCells]:
    """The pool after each of `steps` (ascending), from one pass over the events."""
    colors, state, out = request_colors(run), RunState(max_iterations=2), {}
    pending = iter(steps)
    target = next(pending, None)
    for event in events:
        while target is not None and event["step"] > target:
            out[target] = pool_cells(state, colors, run.order)
            target = next(pending, None)
        state.apply(event)
    while target is not None:
        out[target] = pool_cells(state, colors, run.order)
        target = next(pending, None)
    return out


class Slide:
    """The GIF's one figure: title, block pool (top) and timeline (bottom), with what moves set apart."""

    def __init__(self, run: ExportedRun, size: Size) -> None:
        self.run, self.fig = run, slide_figure(size)
        pool_ax, timeline_ax = self.fig.subplots(2, 1, height_ratios=[POOL_SHARE, 1 - POOL_SHARE])
        self.fig.suptitle(f"{run.scenario} · model {run.model_name}", fontsize=TITLE_PT, fontweight="bold",
                          x=0.01, ha="left")
        # What changes per frame is short text of its own: a text costs per glyph, in every frame.
        self.step = self.fig.text(0.99, 0.995, "", fontsize=TITLE_PT, fontweight="bold", ha="right", va="top")
        area = (0.7 * size[0], 0.36 * size[1])
        layout = pool_layout(run.state.num_blocks, used_blocks(run.events), area)
        # the title's second line is left blank for the counts, which change
        pool_ax.set_title(f"KV block pool: {shown_rows_note(layout)} × {run.state.cache.get('block_size', '?')} "
                          "tokens\n", fontsize=SUBTITLE_PT, loc="left", color="#444444")
        self.facts = pool_ax.text(0.0, 1.0, "", transform=pool_ax.transAxes, fontsize=SUBTITLE_PT, ha="left",
                                  va="bottom", color="#111111")
        self.pool = PoolGrid(pool_ax, layout, area, ids=False)
        pool_legend(pool_ax, request_colors(run), run.order, None, max_rows=max(4, int(0.36 * size[1] / 27)))
        timeline_ax.set_title("Timeline", fontsize=SUBTITLE_PT, loc="left", color="#444444")
        self.timeline = TimelineArtists(timeline_ax, run, axis_px=0.45 * size[1])
        self.now = timeline_ax.axvline(run.first, color=palette.FOCUS_COLOR, linewidth=1.5, linestyle=(0, (2, 2)))
        self.moving = [self.step, self.facts, *self.pool.artists, *self.timeline.artists, self.now]

    def show(self, step: int, cells: PoolCells) -> None:
        self.step.set_text(step_label(step, self.run))
        self.facts.set_text(pool_facts(cells))
        self.pool.show(cells)
        self.timeline.show(step)
        self.now.set_xdata([step + 1, step + 1])


def render_frames(events: list[Event], run: ExportedRun, steps: list[int], size: Size,
                  progress: Progress | None) -> list[Image.Image]:
    """Every frame, quantized onto the fixed palette: the static part drawn once, what moves per frame."""
    slide, fixed = Slide(run, size), _palette_image()
    canvas = FigureCanvasAgg(slide.fig)
    for artist in slide.moving:
        artist.set_animated(True)  # left out of the background
    canvas.draw()
    background = canvas.copy_from_bbox(slide.fig.bbox)
    moments = pool_moments(events, steps, run)
    frames = []
    for index, step in enumerate(steps):
        canvas.restore_region(background)
        slide.show(step, moments[step])
        for artist in slide.moving:
            slide.fig.draw_artist(artist)
        image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
        frames.append(image.quantize(palette=fixed, dither=Image.Dither.NONE))
        if progress is not None:
            progress((index + 1) / (len(steps) + 1))  # writing the file is the last share
    return frames


def write_gif(events: list[Event], out_path: Path, stride: int | None = None, size: Size = SLIDE_SIZE,
              progress: Progress | None = None) -> Path:
    """Write the animation; ExportError when it would have more than MAX_FRAMES frames."""
    run = replay(events)
    steps = frame_steps(run.first, run.last, stride or auto_stride(run.first, run.last))
    if progress is not None:
        progress(0.0)
    with slide_style():
        frames = render_frames(events, run, steps, size, progress)
    durations = [FRAME_MS] * (len(frames) - 1) + [LAST_FRAME_MS]
    frames[0].save(out_path, save_all=True, append_images=frames[1:], duration=durations, loop=0, optimize=False)
    if progress is not None:
        progress(1.0)
    return out_path
