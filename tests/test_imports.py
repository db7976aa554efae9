"""Imports flow one way: the command line over the front end over the back end, model under engine.

The test parses every module's imports (no code runs) and fails on a cycle or a forbidden direction,
so a convenient import that runs back up the layers is caught the day it is written. And the dashboard
runs without torch: importing it costs seconds, and only measuring this machine needs it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from kvscope import PARTS

ROOT = Path(__file__).resolve().parents[1]
# Each folder of the repository and the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"kvscope": "kvscope", **{part: f"kvscope.{part}" for part in PARTS if part != "scenarios"}}

# (importer prefix, imported prefix): the importer must never import the imported.
FORBIDDEN = [
    ("kvscope.backend", "kvscope.frontend"), ("kvscope.backend", "kvscope.cli"), ("kvscope.frontend", "kvscope.cli"),
    ("kvscope.kernels", "kvscope.backend"), ("kvscope.kernels", "kvscope.frontend"),
    ("kvscope.backend.model", "kvscope.backend.engine"), ("kvscope.backend.model", "kvscope.backend.server"),
    ("kvscope.backend.engine", "kvscope.backend.server"), ("kvscope.backend.events", "kvscope.backend.engine"),
    ("kvscope.backend.events", "kvscope.backend.server"),
    ("kvscope.backend.engine.kv_cache", "kvscope.backend.engine.request"),
]


def module_names() -> dict[str, Path]:
    names = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = (package, *path.relative_to(ROOT / folder).with_suffix("").parts)
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imported(name, path, known) for name, path in known.items()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None (a package importing its own submodules is fine)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if within(nxt, node) or within(node, nxt):
                continue  # package <-> its own submodule
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_against_the_layers():
    graph = import_graph()
    wrong = [f"{a} imports {b}" for a, targets in graph.items() for b in targets
             for low, high in FORBIDDEN if within(a, low) and within(b, high)]
    assert wrong == []


def test_there_is_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_walk_sees_real_imports():
    graph = import_graph()
    assert "kvscope.backend.engine.block_manager" in graph["kvscope.backend.engine.scheduler"]
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


# Every front-end module imported in a fresh interpreter: torch must not be among what they pull in.
DASHBOARD_IMPORTS = """
import importlib, pkgutil, sys
import kvscope.frontend as frontend
for module in pkgutil.walk_packages(frontend.__path__, "kvscope.frontend."):
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
print("torch" in sys.modules)
"""


def test_the_dashboard_imports_no_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", DASHBOARD_IMPORTS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
