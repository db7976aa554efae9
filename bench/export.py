"""Export benchmark: how long `kvscope export` takes to draw a slide of a typical scenario.

    python -m bench.export [--scenarios shared-prefix,memory-pressure,beam-search] [--model demo]

Each scenario is run once headless (its trace in a temporary folder), then drawn as the run GIF
(1920×1080, every iteration up to gif.AUTO_FRAMES frames) and as each still PNG, each timed with the
wall clock in this process. The target is issue #22's: a typical scenario's GIF in under 10 s on the
2-core machine. Run it on a quiet machine (never beside tests); docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from bench.report import command_line, progress, table

GIF_TARGET_S = 10.0
DEFAULT_SCENARIOS = "shared-prefix,memory-pressure,beam-search"


def record(name: str, model: str, folder: Path) -> list[dict]:
    from kvscope.backend.events.bus import EventBus
    from kvscope.backend.events.trace import TraceWriter, read_trace
    from kvscope.backend.run import ScenarioRun
    from kvscope.backend.scenario import load_scenario

    path = folder / f"{name}.jsonl"
    scenario = load_scenario(name, [f"model={model}"])
    bus = EventBus()
    with TraceWriter(path) as writer:
        bus.subscribe(writer)
        ScenarioRun(scenario, bus=bus).run()
    return read_trace(path)


def timed(render_one) -> float:
    started = time.perf_counter()
    render_one()
    return time.perf_counter() - started


def measure(name: str, model: str, folder: Path) -> list:
    from kvscope.frontend.export import render

    events = record(name, model, folder)
    iterations = sum(e["type"] == "iteration" for e in events)
    gif = folder / f"{name}.gif"
    gif_s = timed(lambda: render(events, "blocks", gif))
    with Image.open(gif) as image:
        frames, size = image.n_frames, f"{image.width}×{image.height}"
    stills = {view: timed(lambda v=view: render(events, v, folder / f"{name}-{v}.png"))
              for view in ("timeline", "blocks", "batch")}
    return [name, iterations, frames, size, f"{gif_s:.1f}", f"{gif.stat().st_size / 1e6:.1f}",
            *(f"{s:.1f}" for s in stills.values()), "yes" if gif_s <= GIF_TARGET_S else "no"]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.export", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help="comma-separated bundled scenario names")
    p.add_argument("--model", default="demo")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-export-") as tmp:
        for name in args.scenarios.split(","):
            progress(name)
            rows.append(measure(name, args.model, Path(tmp)))
    print(command_line("bench.export", sys.argv[1:]))
    print(table(["scenario", "iterations", "GIF frames", "size", "GIF (s)", "GIF (MB)", "timeline PNG (s)",
                 "blocks PNG (s)", "batch PNG (s)", f"GIF within {GIF_TARGET_S:.0f} s"], rows))


if __name__ == "__main__":
    main()
