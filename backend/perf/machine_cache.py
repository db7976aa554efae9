"""The figures calibrate.py and link_calibrate.py measured, kept as JSON under $XDG_CACHE_HOME/kvscope
(default ~/.cache/kvscope) and reused on the same host: `this-machine.json`, and one file per local link
(`link-gloo-2.json`: gloo between 2 ranks).

Apart from calibrate.py because reading them needs no torch, which measuring does: the dashboard shows
a profile measured before without importing torch (tests/test_imports.py holds it to that).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

CACHE_VERSION = 2
THIS_MACHINE_FILE = "this-machine"
FIGURES = ("device", "fp32_flops", "bf16_flops", "mem_bandwidth", "gemv_efficiency", "gemm_efficiency",
           "memory_bytes", "measured_at")


def cache_path(name: str = THIS_MACHINE_FILE) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvscope" / f"{name}.json"


def read_cache(name: str = THIS_MACHINE_FILE, figures: tuple[str, ...] = FIGURES) -> dict | None:
    """The saved figures of this host, or None (missing, unreadable, older format, another host, or a figure
    missing)."""
    try:
        saved = json.loads(cache_path(name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or any(key not in saved for key in figures):
        return None
    if saved.get("version") != CACHE_VERSION or saved.get("host") != platform.node():
        return None
    return saved


def write_cache(figures: dict, name: str = THIS_MACHINE_FILE) -> None:
    path = cache_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))
