"""Each view's still picture by name, as render() and the lesson's pictures draw it."""

from __future__ import annotations

from collections.abc import Callable

from matplotlib.figure import Figure

from kvscope.frontend.export.batch import draw_batch
from kvscope.frontend.export.blocks import draw_blocks
from kvscope.frontend.export.timeline import draw_timeline

DRAW: dict[str, Callable[..., Figure]] = {"timeline": draw_timeline, "blocks": draw_blocks, "batch": draw_batch}
