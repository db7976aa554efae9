"""Non-negative least squares for the few terms a measured profile fits (overheads, a link's latency and
bandwidth): a negative overhead or latency would be noise, not a figure."""

from __future__ import annotations

import itertools

import torch


def nonnegative_least_squares(rows: list[tuple[float, ...]], y: list[float]) -> list[float]:
    """argmin |Ax - y| over x >= 0, for a few columns: the best of the plain fits on each subset of them."""
    a, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    best, best_residual = [0.0] * a.shape[1], float(b.square().sum())
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x = torch.linalg.lstsq(a[:, cols], b).solution.squeeze(1)
            if (x < 0).any():
                continue
            residual = float((a[:, cols] @ x.unsqueeze(1) - b).square().sum())
            if residual < best_residual:
                best, best_residual = [0.0] * a.shape[1], residual
                for c, v in zip(cols, x.tolist(), strict=True):
                    best[c] = v
    return best
