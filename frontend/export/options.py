"""What an export may ask for: a view, an output format, an x unit; ExportError names what is wrong."""

from __future__ import annotations

from pathlib import Path

from kvscope.backend.errors import KvscopeError

VIEWS = ("timeline", "blocks", "batch")
FORMATS = (".png", ".svg", ".json", ".gif")
X_UNITS = ("steps", "seconds")


class ExportError(KvscopeError):
    """Bad export input; `field` names what to fix: view, out, x, step, stride or trace."""


def check_options(view: str, out_path: Path, x: str = "steps", stride: int = 1) -> None:
    """Raise ExportError for an unknown view, format, x unit or stride, or a missing output folder."""
    if view not in VIEWS:
        raise ExportError("view", f"not a view (use {', '.join(VIEWS)})")
    if out_path.suffix.lower() not in FORMATS:
        raise ExportError("out", f"unknown format {out_path.suffix or '(none)'!r} (use .png, .svg, .json or .gif)")
    if out_path.suffix.lower() == ".json" and view != "timeline":
        raise ExportError("view", "a .json export is the timeline as a Perfetto trace; use .png or .svg")
    if stride < 1:
        raise ExportError("stride", "must be at least 1 (frames every N iterations)")
    if x not in X_UNITS:
        raise ExportError("x", f"not an x unit (use {' or '.join(X_UNITS)})")
    if not out_path.parent.is_dir():
        raise ExportError("out", f"the folder {str(out_path.parent)!r} does not exist")
