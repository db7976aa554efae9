"""A sequence: one stream of tokens. A request has one (n = 1) or several (n > 1, beam search).

Its blocks are not here: the block manager keeps every block table, keyed by `seq_id`
(`BlockManager.block_table`). Only the scheduler writes a sequence's fields (tests/test_one_writer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SeqStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler finds sequences in its lists by who they are
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # of those, how many came from the prefix cache
    # Which model's K/V the blocks hold: 0 the target, 1 a speculative draft model. Prefix-cache
    # hashes are kept apart per namespace, so equal tokens never share blocks across models.
    cache_namespace: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
