"""`kvscope replay` / `kvscope serve` start the API and the dashboard and print where to look."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvscope.backend.events.bus import EventBus
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import validate
from kvscope.backend.server.serve import free_port
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def write_trace(path: Path) -> None:
    scenario = validate({"name": "cli-replay", "model": "unused", "engine": {"block_size": 4, "num_blocks": 16},
                         "requests": [{"id": "r0", "prompt": "ROMEO:\n", "max_tokens": 4}]}, "test")
    bus, events = EventBus(), []
    bus.subscribe(events.append)
    ScenarioRun(scenario, bus, loaded=make_tiny_model()).run()
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def test_replay_serves_api_and_dashboard_opened_on_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    write_trace(trace)
    api_port, ui_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NICEGUI"))}
    proc = subprocess.Popen([sys.executable, "-m", "kvscope", "replay", str(trace), "--port", str(api_port),
                             "--ui-port", str(ui_port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while not any("dashboard on" in line for line in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        url = next(re.search(r"(http://\S+)", line).group(1) for line in lines if "dashboard on" in line)
        run_id = next(re.search(r"as run (\w+)", line).group(1) for line in lines if "as run" in line)
        assert url == f"http://127.0.0.1:{ui_port}/?run={run_id}"
        assert get(f"http://127.0.0.1:{api_port}/api/health") == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                assert get(url) == 200
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("the dashboard did not answer")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode in (0, 130)


def test_serve_refuses_a_busy_ui_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "kvscope", "serve", "--port", str(free_port()),
                                 "--ui-port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"--ui-port {port}" in result.stderr and "Traceback" not in result.stderr
