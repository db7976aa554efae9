"""The `this-machine` figures calibrate.py measured, kept as JSON under $XDG_CACHE_HOME/kvscope
(default ~/.cache/kvscope) and reused on the same host.

Apart from calibrate.py because reading them needs no torch, which measuring does: the dashboard shows
a profile measured before without importing torch (tests/test_imports.py holds it to that).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

CACHE_VERSION = 2
FIGURES = ("device", "fp32_flops", "bf16_flops", "mem_bandwidth", "gemv_efficiency", "gemm_efficiency",
           "memory_bytes", "measured_at")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvscope" / "this-machine.json"


def read_cache() -> dict | None:
    """The saved figures of this host, or None (missing, unreadable, older format or another host)."""
    try:
        figures = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(figures, dict) or any(key not in figures for key in FIGURES):
        return None
    if figures.get("version") != CACHE_VERSION or figures.get("host") != platform.node():
        return None
    return figures


def write_cache(figures: dict) -> None:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))
