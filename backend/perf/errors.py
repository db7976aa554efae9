"""The one error of the perf package: a bad model shape, hardware name or what-if setting."""

from __future__ import annotations


class PerfError(ValueError):
    """An input the cost model cannot take: which field, and why (the CLI prints it and exits 2)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def unknown_name(field: str, name: str, valid: list[str]) -> PerfError:
    """The error for a name outside a registry, listing the valid ones."""
    return PerfError(field, f"unknown name {name!r}; valid: {', '.join(valid)}")
