"""Latency benchmark: the wall-clock figures that no test asserts (a loaded CI machine would fail them).

    python -m bench.latency [--only dashboard,export,simulate,sigterm]

Each figure is measured once, in this process or in servers it starts on free loopback ports, and
printed beside its target as a ratio (measured / target; below 1 is within it):
- dashboard: an event received by the dashboard process until it is painted in headless Chromium
  (p50, p95), and a click on a help marker until its text shows, while an unpaced 2048-block,
  64-request run floods the page (needs /usr/bin/chromium and playwright);
- export: `blocks` of a 2048-block pool drawn as PNG and SVG;
- simulate: a Llama-3-70B shape on 8 H100s, 32 requests, no weights;
- sigterm: `kvscope serve` paused with a stream in flight, from SIGTERM to exit.
Run it on a quiet machine (never beside tests); docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.report import command_line, progress, table
from bench.soak import ROOT, launch
from kvscope.backend.server.serve import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
TARGETS = {"paint p50 (ms)": 150, "paint p95 (ms)": 150, "click to text (s)": 2.0, "export 2048 blocks (s)": 10,
           "simulate 70B x 32 requests (s)": 20, "SIGTERM to exit (s)": 5}


def stress_scenario(model: str) -> dict:
    """The page's worst case: 2048 blocks, 64 requests arriving at once, half sharing a prefix."""
    return {"name": "stress", "model": model, "seed": 0, "description": "A flood of requests.",
            "engine": {"block_size": 16, "num_blocks": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048},
            "generate": {"count": 64, "arrival": {"process": "burst"}, "prompt_tokens": {"min": 16, "max": 96},
                         "max_tokens": {"min": 100, "max": 160}, "shared_prefix": {"tokens": 32, "fraction": 0.5},
                         "sampling": {"temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": True}}}


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}")
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def dashboard(model: str) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    api_port, ui_port = free_port(), free_port()
    server = launch(["--port", str(api_port), "--model", model])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ui = subprocess.Popen([sys.executable, "-m", "kvscope.frontend", "--backend", f"http://127.0.0.1:{api_port}",
                           "--port", str(ui_port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=60)
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{ui_port}"), 120, "the dashboard did not start")
        run_id = api.post("/api/runs", json={"scenario": stress_scenario(model), "speed": 0,
                                             "paused": True}).json()["run_id"]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{ui_port}/?run={run_id}")
            page.wait_for_function("window.kvscope && kvscope.latency.length > 0")
            time.sleep(0.5)
            page.evaluate("kvscope.latency.length = 0")
            api.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
            clicks = []
            for i in range(6):
                time.sleep(0.6)
                began = time.monotonic()
                page.locator(".kv-help").first.click()
                page.locator(".kv-explain").first.wait_for(state="visible" if i % 2 == 0 else "hidden")
                clicks.append(time.monotonic() - began)
            wait_until(lambda: api.get(f"/api/runs/{run_id}").json()["finished"], 600, "the stress run")
            time.sleep(0.5)
            painted = page.evaluate("kvscope.latency.map((x) => x[1])")
            browser.close()
    finally:
        api.close()
        for proc in (ui, server):
            proc.terminate()
            proc.wait(timeout=30)
    progress(f"dashboard: {len(painted)} updates painted")
    return {"paint p50 (ms)": percentile(painted, 0.5), "paint p95 (ms)": percentile(painted, 0.95),
            "click to text (s)": max(clicks)}


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def export(model: str) -> dict[str, float]:
    from kvscope.backend.events.bus import EventBus
    from kvscope.backend.events.trace import TraceWriter, read_trace
    from kvscope.backend.run import ScenarioRun
    from kvscope.backend.scenario import Scenario
    from kvscope.frontend.export import render

    scenario = {**stress_scenario(model), "engine": {"block_size": 4, "num_blocks": 2048, "max_num_seqs": 4,
                                                     "max_num_batched_tokens": 64, "batching": "static"}}
    scenario["generate"] = {**scenario["generate"], "count": 6, "max_tokens": {"min": 8, "max": 16}}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "pool.jsonl"
        bus, writer = EventBus(level="full"), TraceWriter(trace)
        bus.subscribe(writer)
        ScenarioRun(Scenario.model_validate(scenario), bus).run()
        writer.close()
        events = read_trace(trace)
        started = time.perf_counter()
        render(events, "blocks", Path(tmp) / "blocks.png", step=3)
        render(events, "blocks", Path(tmp) / "blocks.svg", step=3)
        return {"export 2048 blocks (s)": time.perf_counter() - started}


def simulate() -> dict[str, float]:
    from kvscope.backend.run import ScenarioRun
    from kvscope.backend.scenario import Scenario

    scenario = Scenario.model_validate({
        "name": "big", "seed": 0, "simulate": {"model_shape": "llama-3-70b", "hardware": "h100", "tp": 8},
        "engine": {"block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 2048, "events": "off"},
        "generate": {"count": 32, "arrival": {"process": "burst"}, "prompt_tokens": {"min": 64, "max": 512},
                     "max_tokens": {"min": 16, "max": 64}, "sampling": {"temperature": 1.0, "seed": 3}}})
    started = time.perf_counter()
    ScenarioRun(scenario).run()
    return {"simulate 70B x 32 requests (s)": time.perf_counter() - started}


def sigterm(model: str) -> dict[str, float]:
    port = free_port()
    proc = launch(["--port", str(port), "--model", model])
    url = f"http://127.0.0.1:{port}"
    httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 1}, timeout=60)  # the api run exists
    httpx.post(f"{url}/api/runs/api/control", json={"action": "pause"}, timeout=10)
    body = {"prompt": "ab", "max_tokens": 8, "stream": True}
    reader = threading.Thread(target=lambda: _drain(f"{url}/v1/completions", body), daemon=True)
    reader.start()
    wait_until(lambda: httpx.get(f"{url}/api/runs/api", timeout=10).json()["waiting"], 60, "the stream in flight")
    started = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return {"SIGTERM to exit (s)": time.perf_counter() - started}


def _drain(url: str, body: dict) -> None:
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as s:
            for _ in s.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="dashboard,export,simulate,sigterm", help="comma-separated figures to measure")
    p.add_argument("--model", default="demo")
    args = p.parse_args()
    measures = {"dashboard": lambda: dashboard(args.model), "export": lambda: export(args.model),
                "simulate": simulate, "sigterm": lambda: sigterm(args.model)}
    wanted = args.only.split(",")
    if unknown := [w for w in wanted if w not in measures]:
        p.error(f"--only: unknown figure(s) {', '.join(unknown)} (choose from {', '.join(measures)})")
    if "dashboard" in wanted and not Path(CHROMIUM).exists():
        progress(f"dashboard skipped: {CHROMIUM} is not installed")
        wanted.remove("dashboard")
    figures: dict[str, float] = {}
    for name in wanted:
        progress(name)
        figures.update(measures[name]())
    rows = [[name, f"{value:.3g}", TARGETS[name], f"{value / TARGETS[name]:.2f}", "yes" if value <= TARGETS[name]
             else "no"] for name, value in figures.items()]
    print(command_line("bench.latency", sys.argv[1:]))
    print(table(["figure", "measured", "target", "measured / target", "within"], rows))
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
