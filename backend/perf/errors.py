"""The one error of the perf package: a bad model shape, hardware name or what-if setting."""

from __future__ import annotations

from kvscope.backend.errors import KvscopeError


class PerfError(KvscopeError):
    """An input the cost model cannot take: which field, and why (the CLI prints it and exits 2)."""


def unknown_name(field: str, name: str, valid: list[str]) -> PerfError:
    """The error for a name outside a registry, listing the valid ones."""
    return PerfError(field, f"unknown name {name!r}; valid: {', '.join(valid)}")
