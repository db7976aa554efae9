"""What an export may ask for: a view (or a lesson's moment or handout), an output format, an x unit, a size;
ExportError names what is wrong."""

from __future__ import annotations

import re
from pathlib import Path

from kvscope.backend.errors import KvscopeError

VIEWS = ("timeline", "blocks", "batch")
LESSON_EXPORTS = ("moment", "handout")  # a lesson step's picture (.png, .svg); the whole lesson (.html)
FORMATS = (".png", ".svg", ".json", ".gif", ".html")
X_UNITS = ("steps", "seconds")
SLIDE_SIZE = (1920, 1080)  # a 16:9 slide at full HD: what a projector shows without scaling
MIN_WIDTH, MAX_WIDTH = 640, 7680


class ExportError(KvscopeError):
    """Bad export input; `field` names what to fix: view, out, x, step, stride, size, moment or trace."""


def parse_size(text: str) -> tuple[int, int]:
    """'1280' -> (1280, 720): a width alone keeps the slide's 16:9; 'WxH' asks for another shape."""
    match = re.fullmatch(r"(\d+)(?:[x×](\d+))?", text.strip().lower())
    if match is None:
        raise ExportError("size", "use WIDTHxHEIGHT (1920x1080) or a width alone (16:9)")
    width = int(match.group(1))
    height = int(match.group(2)) if match.group(2) else round(width * 9 / 16)
    if not MIN_WIDTH <= width <= MAX_WIDTH or not MIN_WIDTH * 9 // 32 <= height <= MAX_WIDTH:
        raise ExportError("size", f"width {MIN_WIDTH}..{MAX_WIDTH} px, height at least {MIN_WIDTH * 9 // 32} px")
    return width, height


def check_options(view: str, out_path: Path, x: str = "steps", stride: int | None = None,
                  moment: str | None = None) -> None:
    """Raise ExportError for an unknown view, format, x unit or stride, a format the view has not, a moment
    export without its moment, or a missing output folder."""
    suffix = out_path.suffix.lower()
    if view not in VIEWS + LESSON_EXPORTS:
        raise ExportError("view", f"not a view (use {', '.join(VIEWS + LESSON_EXPORTS)})")
    if suffix not in FORMATS:
        raise ExportError("out", f"unknown format {out_path.suffix or '(none)'!r} (use .png, .svg, .json, .gif or .html)")
    if suffix == ".json" and view != "timeline":
        raise ExportError("view", "a .json export is the timeline as a Perfetto trace; use .png or .svg")
    if (suffix == ".html") != (view == "handout"):
        raise ExportError("out", "the lesson handout is an .html file, and an .html file is the handout")
    if view == "moment" and suffix not in (".png", ".svg"):
        raise ExportError("out", "a moment is a still picture: use .png or .svg")
    if view == "moment" and not moment:
        raise ExportError("moment", "name the lesson moment to draw (a step's `at`, e.g. copy_on_write)")
    if stride is not None and stride < 1:
        raise ExportError("stride", "must be at least 1 (frames every N iterations)")
    if x not in X_UNITS:
        raise ExportError("x", f"not an x unit (use {' or '.join(X_UNITS)})")
    if not out_path.parent.is_dir():
        raise ExportError("out", f"the folder {str(out_path.parent)!r} does not exist")
