"""Chart data grouped by iterations, so that an update resends little and the browser draws little.

ECharts' `setOption` merges series by id but replaces a series' whole `data`, and repaints every
shape of the chart on any update. So the newest iterations live in a small "live" series that is
resent each tick, and once a chunk of iterations is complete it moves into an "era" series
(`ERA` iterations), resent only then. `build` turns a series' items into shapes; merging runs of
equal cells there keeps the shape count, and with it the browser's cost per update, low.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CHUNK = 16  # iterations in the live series
ERA = 256  # iterations per sealed series: bounds what one seal resends


class Chunks:
    def __init__(self, prefix: str, size: int = CHUNK, build: Callable[[list[Any]], list[Any]] | None = None,
                 era: int = ERA) -> None:
        self.prefix = prefix
        self.size = size
        self.era_chunks = max(1, era // size)
        self.build = build or (lambda items: items)
        self.items: dict[int, list[Any]] = {}  # chunk -> its items
        self.live = -1  # the newest chunk
        self.dirty: set[str] = set()

    def add(self, step: int, item: Any) -> None:
        k = max(step, 0) // self.size
        if k > self.live:
            if self.live >= 0:
                self.dirty.add(self._series_of(self.live, sealed=True))  # the old live chunk seals
            self.live = k
        self.items.setdefault(k, []).append(item)
        self.dirty.add(self._series_of(k, sealed=k < self.live))

    def clear(self) -> None:
        self.items.clear()
        self.dirty.clear()
        self.live = -1

    def _series_of(self, k: int, sealed: bool) -> str:
        return f"{self.prefix}e{k // self.era_chunks}" if sealed else f"{self.prefix}live"

    def _data(self, series: str) -> list[Any]:
        if series.endswith("live"):
            return self.build(self.items.get(self.live, []))
        era = int(series.removeprefix(f"{self.prefix}e"))
        chunks = range(era * self.era_chunks, min((era + 1) * self.era_chunks, self.live))
        return self.build([item for k in chunks for item in self.items.get(k, [])])

    def take_dirty(self) -> list[tuple[str, list[Any]]]:
        """(series id, data) of every series changed since the last call."""
        out = [(series, self._data(series)) for series in sorted(self.dirty)]
        self.dirty.clear()
        return out

    def all(self) -> list[tuple[str, list[Any]]]:
        self.dirty.clear()
        if self.live < 0:
            return []
        eras = sorted({self._series_of(k, sealed=True) for k in self.items if k < self.live})
        return [(series, self._data(series)) for series in [*eras, f"{self.prefix}live"]]
