"""`kvscope serve --no-ui`: the real command line starts the API on 127.0.0.1 and stops on a signal."""

import shutil
import signal
import subprocess
import time

import httpx
import pytest

from backend.server.serve import free_port, is_loopback


def test_serve_no_ui_answers_and_stops_cleanly():
    exe = shutil.which("kvscope") or pytest.skip("kvscope is not installed as a script")
    port = free_port()
    proc = subprocess.Popen([exe, "serve", "--no-ui", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).json() == {"status": "ok"}
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/schema/openapi.json").status_code == 200
        assert any(s["name"] == "long-prompt" for s in httpx.get(f"http://127.0.0.1:{port}/api/scenarios").json())
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}" in out
    assert "Bearer" not in out  # loopback: no token needed


def test_only_loopback_hosts_skip_the_token():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.5", "example.org"))
