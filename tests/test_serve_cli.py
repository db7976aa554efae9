"""`kvscope serve`: the real command line prints each address once it listens, and stops on a signal."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvscope.backend.server.serve import free_port, is_loopback

ROOT = Path(__file__).resolve().parents[1]


def start(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NICEGUI"))}
    return subprocess.Popen([sys.executable, "-m", "kvscope", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, needle: str, timeout: float = 300) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while not any(needle in line for line in lines):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, f"no line with {needle!r}: {lines}"
        lines.append(line)
    return lines


def stop(proc: subprocess.Popen) -> str:
    """Ctrl-C: the command says what stopped, in one line, and exits 130 (128 + SIGINT), as shells expect."""
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert f"kvscope {proc.args[3]}: stopped by Ctrl-C" in out and "Traceback" not in out, out
    return out


def test_serve_no_ui_answers_as_soon_as_it_prints_its_address_and_stops_cleanly():
    port = free_port()
    proc = start("serve", "--no-ui", "--port", str(port))
    try:
        lines = read_until(proc, "API on")
        # No retry: the address is printed only once the socket listens.
        assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=10).json()["status"] == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/schema/openapi.json").status_code == 200
        assert any(s["name"] == "long-prompt" for s in httpx.get(f"http://127.0.0.1:{port}/api/scenarios").json())
    finally:
        out = stop(proc)
    assert f"http://127.0.0.1:{port}" in "".join(lines)
    assert "Bearer" not in out  # loopback: no token needed
    # What it does while a model loads (seconds to a minute for a real one), then what it loaded
    assert lines[0] == "loading demo (weights: native) ...\n"
    assert re.fullmatch(r"loaded demo in [\d.]+ s: \d+ layers, [\d.,]+ MiB of weights held\n", lines[1]), lines


def test_version_is_the_installed_packages() -> None:
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", "kvscope", "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"kvscope {version('kvscope')}\n")


def test_serve_loads_its_model_at_launch_under_the_limits_it_was_given():
    """/health turns 200 with no request sent; the API run it started keeps --paused-ttl-s (it was once
    built before the limits were set: paused by a client, it never resumed)."""
    port = free_port()
    proc = start("serve", "--no-ui", "--port", str(port), "--paused-ttl-s", "1")
    try:
        read_until(proc, "API on")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model never loaded"
            time.sleep(0.1)
        assert client.post("/api/runs/api/control", json={"action": "pause"}).status_code == 200
        answer = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 1})  # the client waits 60 s
        assert answer.status_code == 200  # the API run resumed after its second paused (under the default, 15 min)
    finally:
        stop(proc)


def test_serve_prints_the_dashboard_address_once_the_dashboard_answers():
    api_port, ui_port = free_port(), free_port()
    proc = start("serve", "--port", str(api_port), "--ui-port", str(ui_port))
    try:
        lines = read_until(proc, "dashboard on")
        assert any(f"API on http://127.0.0.1:{api_port}" in line for line in lines)
        assert httpx.get(f"http://127.0.0.1:{ui_port}/", timeout=30).status_code == 200  # no retry either
    finally:
        out = stop(proc)
    assert f"the API on 127.0.0.1:{api_port} and the dashboard on http://127.0.0.1:{ui_port} closed" in out


def test_ctrl_c_in_kvscope_run_says_how_far_the_run_got_and_keeps_the_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    proc = start("run", "poisson-load", "--set", "generate.count=500", "--trace", str(trace))
    deadline = time.monotonic() + 300
    while not (trace.is_file() and '"type":"iteration"' in trace.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the run never started"
        time.sleep(0.2)
    out = stop(proc)
    assert re.search(rf"stopped by Ctrl-C at iteration \d+, \d+ of 500 requests finished; {trace} holds", out)
    assert trace.read_text().endswith("\n")  # whole lines: the file closed cleanly


def test_only_loopback_hosts_skip_the_token():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.5", "example.org"))
