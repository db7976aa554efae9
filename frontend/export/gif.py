"""The run as an animated GIF for slides: the block pool above the timeline, one frame per iteration
(or every `stride` iterations), drawn by the same functions as the still pictures.

Each frame replays the events up to its iteration. The timeline keeps the whole run's x range in
every frame, so it grows from left to right instead of rescaling. Frames are mapped onto a fixed
palette (Pillow, no dithering) made of frontend/palette.py's colours plus greys for text, so
every colour in the GIF is exactly the page's.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from PIL import Image

from kvscope.frontend import palette
from kvscope.frontend.export.blocks import draw_blocks
from kvscope.frontend.export.options import ExportError
from kvscope.frontend.export.replayed import Event, replay
from kvscope.frontend.export.timeline import draw_timeline

MAX_FRAMES = 400  # a slide, not a film: longer runs take a stride
FRAME_MS = 250  # 4 iterations a second, the page's default speed
WIDTH_PX = 1200


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


def frame_steps(first: int, last: int, stride: int) -> list[int]:
    """The iterations shown: every stride-th from the first, and always the last; ExportError past
    MAX_FRAMES, counted before any list is made (a trace's steps may lie far apart)."""
    shown = range(first, last + 1, stride)
    count = len(shown) + (shown[-1] != last)
    if count > MAX_FRAMES:
        raise ExportError("stride", f"{count} frames; use a stride of at least {-(-(last - first + 1) // MAX_FRAMES)}")
    return list(shown) if shown[-1] == last else [*shown, last]


def _pixels(fig: Figure, width: int) -> Image.Image:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    return image.resize((width, round(image.height * width / image.width)), Image.Resampling.LANCZOS)


def draw_frame(events: list[Event], step: int, first: int, last: int) -> Image.Image:
    """One frame: the block pool and the timeline as of iteration `step`, stacked."""
    run = replay(events, step)
    timeline = draw_timeline(run)
    timeline.axes[0].set_xlim(first, last + 1.5)  # the whole run's range in every frame
    top, bottom = _pixels(draw_blocks(run), WIDTH_PX), _pixels(timeline, WIDTH_PX)
    image = Image.new("RGB", (WIDTH_PX, top.height + bottom.height), "white")
    image.paste(top, (0, 0))
    image.paste(bottom, (0, top.height))
    return image


def write_gif(events: list[Event], out_path: Path, stride: int = 1) -> Path:
    """Write the animation; ExportError when it would have more than MAX_FRAMES frames."""
    run = replay(events)
    fixed = _palette_image()
    frames = [draw_frame(events, step, run.first, run.last).quantize(palette=fixed, dither=Image.Dither.NONE)
              for step in frame_steps(run.first, run.last, stride)]
    height = max(f.height for f in frames)  # the timeline's legend may grow as phases appear
    frames = [f if f.height == height else _pad(f, height) for f in frames]
    frames[0].save(out_path, save_all=True, append_images=frames[1:], duration=FRAME_MS, loop=0, optimize=False)
    return out_path


def _pad(frame: Image.Image, height: int) -> Image.Image:
    padded = Image.new("P", (frame.width, height), palette_colors().index("#ffffff"))
    padded.putpalette(frame.getpalette())
    padded.paste(frame, (0, 0))
    return padded
