"""Pictures of a run from its events alone: the timeline, block pool and batch views as PNG or SVG
(matplotlib's Agg and SVG renderers, no browser), the run as an animated GIF, a lesson's moment, all
slide-sized (16:9, 1920×1080 by default), the lesson as a self-contained HTML handout, and the timeline
as a Chrome/Perfetto trace.

Shared by `kvscope export` and the dashboard's export menu. The events are replayed into a
RunRecord, as the live dashboard does: the state (block tables, requests) comes from RunState, the
past (who ran, waited or sat preempted at each iteration) from RunHistory, and the colours from
frontend/palette.py, so that an exported picture shows what the page showed. See docs/export.md.

One module per output (timeline, blocks, batch, gif, perfetto, lesson, handout), with what they share in
options (what can be asked), replayed (the events replayed), figure (the frame of every picture) and draw
(the still pictures by view).
"""

from kvscope.frontend.export.options import FORMATS, LESSON_EXPORTS, SLIDE_SIZE, VIEWS, X_UNITS, ExportError, \
    check_options, parse_size
from kvscope.frontend.export.write import render

__all__ = ["FORMATS", "LESSON_EXPORTS", "SLIDE_SIZE", "VIEWS", "X_UNITS", "ExportError", "check_options",
           "parse_size", "render"]
