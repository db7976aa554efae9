"""The whole raw distribution of recent tokens, kept for the sampling view's what-if.

A token event carries only the top `dist_top_n` tokens: enough to draw the bars, not enough to
recompute the sampler's stages exactly at other settings (temperature moves mass into and out of
the tail, and top-p's cut depends on all of it). So a served run keeps the raw (T = 1) probability
row of each token it emits, the whole vocabulary, in a store bounded in bytes; the oldest rows go
first. A row is 4 bytes per vocabulary entry (8 KB for the demo's 2,048, 196 KB for SmolLM2's
49,152): the default budget holds about two thousand demo tokens or eighty SmolLM2 ones.

The engine pays for it only when events carry `dist` (level `full`) and a store is attached
(`StepEvents.rows`); headless runs attach none. The server reads rows from its HTTP threads while
the engine thread writes, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

DEFAULT_BUDGET_BYTES = 16 * 2**20

RowKey = tuple[str, int, int]  # (request_id, seq_id, position)


class DistRows:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._rows: OrderedDict[RowKey, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, seq_id: int, position: int, raw_probs: torch.Tensor) -> None:
        """Keep raw_probs [V] (any float dtype, any device) as little-endian float32 bytes."""
        row = raw_probs.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
        if len(row) > self.budget_bytes:
            return  # a row larger than the whole budget is never kept
        with self._lock:
            old = self._rows.pop((request_id, seq_id, position), None)
            self.bytes -= len(old) if old is not None else 0
            self._rows[(request_id, seq_id, position)] = row
            self.bytes += len(row)
            while self.bytes > self.budget_bytes:
                _, evicted = self._rows.popitem(last=False)
                self.bytes -= len(evicted)

    def get(self, request_id: str, seq_id: int, position: int) -> bytes | None:
        """The row as float32 bytes, or None when it was never kept or has been evicted."""
        with self._lock:
            return self._rows.get((request_id, seq_id, position))

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)
