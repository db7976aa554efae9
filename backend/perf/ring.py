"""A ring all-reduce's traffic: one formula for the cost model (cost_model.py) and for fitting a measured
link (link_calibrate.py), apart from both so that neither imports the other."""

from __future__ import annotations


def ring_bytes_sent(message: float, tp: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `message` bytes over tp ranks: 2(tp-1)/tp of it."""
    return 2 * (tp - 1) / tp * message
