"""Serving metrics: per request TTFT / TPOT / end-to-end, and per iteration throughput and KV use."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.sequence import Sequence


@dataclass
class RequestTimes:
    arrival: float
    scheduled: float | None = None  # the start of the first iteration that ran it (queueing ends there)
    first_token: float | None = None
    finish: float | None = None
    num_output_tokens: int = 0
    # Disaggregated prefill: the link's seconds moving the request's blocks to its decode instance. The
    # first token counts as given once it is there: first_token includes them.
    transfer_s: float | None = None

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def queue(self) -> float | None:
        """Time from arrival until an iteration first ran it (vLLM's queue interval, to its first scheduling)."""
        return None if self.scheduled is None else self.scheduled - self.arrival

    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.finish is None or self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)

    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


def slots_holding_tokens(seqs: Iterable[Sequence], blocks: BlockManager) -> int:
    """Distinct cache slots that hold a computed token (a shared block counts once)."""
    fill: dict[int, int] = {}
    block_size = blocks.block_size
    for seq in seqs:
        for i, block in enumerate(blocks.block_table(seq.seq_id)):
            used = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            fill[block] = max(fill.get(block, 0), used)
    return sum(fill.values())


@dataclass
class KVSnapshot:
    usage: float
    waste: float
    blocks_saved_by_sharing: int


def kv_snapshot(pools: list[tuple[list[Sequence], BlockManager]]) -> KVSnapshot:
    """KV use over one pool, or the pools of a disaggregated engine's instances, each with its sequences.

    usage: reserved blocks over all; waste: reserved-but-empty slots over all slots; blocks saved
    by sharing (forks, prefix hits): what every table would hold unshared, less the distinct blocks."""
    used = num_blocks = empty = slots = saved = 0
    for seqs, blocks in pools:
        used += blocks.num_used_blocks
        num_blocks += blocks.num_blocks
        empty += blocks.num_used_blocks * blocks.block_size - slots_holding_tokens(seqs, blocks)
        slots += blocks.num_blocks * blocks.block_size
        held = [b for s in seqs for b in blocks.block_table(s.seq_id)]
        saved += len(held) - len(set(held))
    return KVSnapshot(used / num_blocks, empty / slots, saved)


class MetricsTracker:
    """Accumulates what the `metrics` events and the final table report."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent iterations
        self.total_output_tokens = 0
        self.total_prefill_tokens = 0
        self.start: float | None = None
        self.last: float | None = None
        # Time-averaged over iterations: what fraction of reserved slots were holding tokens.
        self._waste_sum = 0.0
        self._usage_sum = 0.0
        self._samples = 0
        self.peak_blocks_saved_by_sharing = 0

    def on_iteration(self, now: float, num_prefill_tokens: int, num_output_tokens: int) -> None:
        self.start = now if self.start is None else self.start
        self.last = now
        self.total_prefill_tokens += num_prefill_tokens
        self.total_output_tokens += num_output_tokens
        self._recent.append((now, num_output_tokens))
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()

    def tokens_per_s(self) -> float:
        """Output tokens per second over the recent window."""
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0

    def observe_kv(self, seqs: list[Sequence], blocks: BlockManager) -> KVSnapshot:
        """This iteration's KV use, added to the running means."""
        return self.observe(kv_snapshot([(seqs, blocks)]))

    def observe(self, kv: KVSnapshot) -> KVSnapshot:
        self._usage_sum += kv.usage
        self._waste_sum += kv.waste
        self._samples += 1
        self.peak_blocks_saved_by_sharing = max(self.peak_blocks_saved_by_sharing, kv.blocks_saved_by_sharing)
        return kv

    def mean_kv(self) -> tuple[float, float]:
        """Mean (usage, waste) over the iterations seen."""
        n = max(1, self._samples)
        return self._usage_sum / n, self._waste_sum / n


@dataclass
class SpecStats:
    """Running totals behind speculative decoding's acceptance rate, alpha and tokens per verify."""

    num_verifies: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_appended: int = 0  # accepted + the resampled or bonus token
    # alpha = E[sum_x min(p(x), q(x))], over the drafted positions the target judged (those up to the
    # first rejection): later ones were drafted after a token the target did not keep.
    alpha_sum: float = 0.0
    num_judged: int = 0

    def record(self, num_proposed: int, num_accepted: int, expected_accept: list[float]) -> None:
        judged = expected_accept[:num_accepted + 1]
        self.num_verifies += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_appended += num_accepted + 1
        self.alpha_sum += sum(judged)
        self.num_judged += len(judged)

    def summary(self) -> dict[str, float]:
        """The metrics event's spec fields."""
        return {"spec_acceptance_rate": self.num_accepted / max(1, self.num_proposed),
                "spec_alpha": self.alpha_sum / max(1, self.num_judged),
                "spec_tokens_per_verify": self.num_appended / max(1, self.num_verifies)}
