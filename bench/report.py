"""What every benchmark prints the same way: markdown tables, progress lines, the command that ran."""

from __future__ import annotations

import os
import shlex
import sys


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (docs/benchmarks.md pastes them as they are)."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def progress(message: str) -> None:
    """On stderr, so that stdout stays the report."""
    print(f"... {message}", file=sys.stderr, flush=True)


def command_line(module: str, argv: list[str]) -> str:
    """The command to reproduce a run, with the thread settings that change its numbers."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ)
    return " ".join(filter(None, [env, f"python -m {module}", shlex.join(argv)]))
