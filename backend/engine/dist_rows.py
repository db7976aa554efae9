"""The whole raw distribution of tokens, kept for the sampling view's what-if: recent ones in the server,
chosen ones in the run's own events.

A token event carries only the top `dist_top_n` tokens: enough to draw the bars, not enough to
recompute the sampler's stages exactly at other settings (temperature moves mass into and out of
the tail, and top-p's cut depends on all of it). A row is the raw (T = 1) probability of every
vocabulary token as little-endian float32: 4 bytes per entry (8 KB for the demo's 2,048, 196 KB for
SmolLM2's 49,152). float32 because the what-if must equal the engine's to 1e-6; float16 would not.

Two stores, both bounded in bytes:
- `DistRows`, a served run's recent rows (GET /api/runs/{id}/dist), the oldest going first: the
  default budget holds about two thousand demo tokens or eighty SmolLM2 ones. The server reads rows
  from its HTTP threads while the engine thread writes, hence the lock.
- `RecordedRows`, which tokens' rows go into their own token event (`dist.raw_probs_f32`, base64), so
  that the trace, and so a saved run reopened from the library or a replay of the trace, is exact for
  them as the live run was: the tokens a lesson or the sampling view starts from. See its docstring.

The engine pays for rows only when events carry `dist` (level `full`).
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict

import torch

DEFAULT_BUDGET_BYTES = 16 * 2**20
# Per run, float32 bytes: 128 demo rows or 5 SmolLM2 ones. The trace holds base64, 4/3 of it (1.4 MB at
# most), which keeps a trace small enough to upload for a replay (--max-body-bytes, 2 MB by default).
RECORD_BUDGET_BYTES = 2**20

RowKey = tuple[str, int, int]  # (request_id, seq_id, position)


def row_bytes(raw_probs: torch.Tensor) -> bytes:
    """raw_probs [V] (any float dtype, any device) as little-endian float32 bytes."""
    return raw_probs.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()


def row_text(row: bytes) -> str:
    """A row as a token event and the dist route carry it (base64)."""
    return base64.b64encode(row).decode("ascii")


class DistRows:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._rows: OrderedDict[RowKey, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, seq_id: int, position: int, row: bytes) -> None:
        """Keep a row (row_bytes); a row larger than the whole budget is never kept."""
        if len(row) > self.budget_bytes:
            return
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


class RecordedRows:
    """Which tokens carry their whole row in their own event: each sequence's first token (the lesson's
    first_token moment, and where every answer begins) and each token a grammar's mask forced (the lesson's
    mask_forced: the model's own favourite was masked), until the run has spent `budget_bytes` on rows;
    the run's first forced token even past it, as a lesson pauses there. A token whose grammar allowed
    no more tokens than the event's top rows hold needs no row (the caller asks for none): those rows
    are its whole distribution, and the view computes it exactly from them (one_token_allowed's token,
    and in structured-output every token but those inside a free-text string)."""

    def __init__(self, budget_bytes: int = RECORD_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.forced_taken = False

    def take(self, first: bool, forced: bool, size: int) -> bool:
        """Whether to record a row of `size` bytes for a token (and count it when so)."""
        if not (first or forced):
            return False
        lesson = forced and not self.forced_taken
        if self.bytes + size > self.budget_bytes and not lesson:
            return False
        self.forced_taken |= forced
        self.bytes += size
        return True
