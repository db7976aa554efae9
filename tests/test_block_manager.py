"""The block manager, told as stories on tiny caches with exact block ids, then a random-operation
state machine that checks the invariants, a simulated KV cache and a replay of the events after
every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvscope.backend.engine import block_manager
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.sequence import Sequence

# The exact fields of each block event, as backend/events/schema.py declares them.
EVENT_FIELDS = {
    "block_alloc": {"block_id", "seq_id", "request_id", "logical_index"},
    "block_free": {"block_id", "seq_id", "request_id", "cached"},
    "block_share": {"block_id", "seq_id", "request_id", "logical_index", "ref_count", "reason"},
    "block_copy": {"src_block_id", "dst_block_id", "seq_id"},
    "block_evict": {"block_id"},
}


def make(num_blocks: int, block_size: int, prefix_caching: bool = True) -> tuple[BlockManager, list]:
    events: list[tuple[str, dict]] = []

    def emit(type: str, **fields) -> None:
        assert set(fields) == EVENT_FIELDS[type], type
        events.append((type, fields))

    return BlockManager(num_blocks, block_size, prefix_caching, emit), events


def seq(seq_id: int, tokens: list[int] | range, request_id: str | None = None) -> Sequence:
    tokens = list(tokens)
    return Sequence(seq_id, request_id or f"r{seq_id}", tokens, len(tokens))


def compute(bm: BlockManager, s: Sequence, num_tokens: int) -> list[tuple[int, int]]:
    """What one engine step does for a sequence: reserve, compute, commit."""
    copies = bm.allocate_slots(s, num_tokens)
    assert copies is not None
    s.num_computed_tokens += num_tokens
    bm.commit_computed(s)
    return copies


# The block manager keeps blocks; the scheduler, the one writer of a sequence's state, records what the
# cache holds of it. These do both, as the scheduler does.

def do_match(bm: BlockManager, s: Sequence) -> int:
    s.num_computed_tokens = s.num_cached_prompt_tokens = bm.match_prefix(s)
    return s.num_computed_tokens


def do_free(bm: BlockManager, s: Sequence) -> None:
    bm.free(s)
    s.num_computed_tokens = 0


def do_fork(bm: BlockManager, parent: Sequence, child: Sequence) -> None:
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens


def do_truncate(bm: BlockManager, s: Sequence, num_tokens: int) -> None:
    bm.truncate(s, num_tokens)
    s.num_computed_tokens = min(s.num_computed_tokens, num_tokens)


def alloc(block: int, s: Sequence, index: int) -> tuple[str, dict]:
    return "block_alloc", dict(block_id=block, seq_id=s.seq_id, request_id=s.request_id, logical_index=index)


def free(block: int, s: Sequence, cached: bool) -> tuple[str, dict]:
    return "block_free", dict(block_id=block, seq_id=s.seq_id, request_id=s.request_id, cached=cached)


def share(block: int, s: Sequence, index: int, ref_count: int, reason: str = "prefix_cache") -> tuple[str, dict]:
    return "block_share", dict(block_id=block, seq_id=s.seq_id, request_id=s.request_id,
                               logical_index=index, ref_count=ref_count, reason=reason)


def replay_block_events(events: list[tuple[str, dict]], num_blocks: int) -> tuple[dict, list, set]:
    """Rebuild (block tables by seq_id, free list in order, free blocks still cached) from events alone."""
    tables: dict[int, list[int]] = {}
    free_list = list(range(num_blocks))
    ref = [0] * num_blocks
    cached_free: set[int] = set()
    for type, f in events:
        if type in ("block_alloc", "block_share"):
            block = f["block_id"]
            if type == "block_alloc":
                assert block not in cached_free, "a cached block is evicted before it is reused"
                assert ref[block] == 0
                ref[block] = 1
            else:
                assert f["ref_count"] == ref[block] + 1
                ref[block] = f["ref_count"]
            if block in free_list:
                free_list.remove(block)
            cached_free.discard(block)
            table = tables.setdefault(f["seq_id"], [])
            if f["logical_index"] == len(table):
                table.append(block)
            else:
                table[f["logical_index"]] = block  # copy-on-write replaces the shared block
        elif type == "block_free":
            block, table = f["block_id"], tables[f["seq_id"]]
            if block in table:
                table.remove(block)
            ref[block] -= 1
            if ref[block] == 0:
                free_list.append(block)
                if f["cached"]:
                    cached_free.add(block)
        elif type == "block_evict":
            cached_free.remove(f["block_id"])
    return {k: v for k, v in tables.items() if v}, free_list, cached_free


def assert_replay_matches(bm: BlockManager, events: list, seqs: list[Sequence]) -> None:
    tables, free_list, cached_free = replay_block_events(events, bm.num_blocks)
    assert tables == {s.seq_id: bm.block_table(s.seq_id) for s in seqs if bm.block_table(s.seq_id)}
    assert free_list == bm.free_block_ids
    assert len(cached_free) == bm.num_cached_blocks


# ---- stories ------------------------------------------------------------------------------------


def test_blocks_are_allocated_in_order_and_decode_fills_the_partial_block_first():
    bm, events = make(num_blocks=8, block_size=4, prefix_caching=False)
    a, b = seq(0, range(10)), seq(1, range(5))
    assert bm.allocate_slots(a, 10) == []
    assert bm.block_table(a.seq_id) == [0, 1, 2]
    assert events == [alloc(0, a, 0), alloc(1, a, 1), alloc(2, a, 2)]
    assert bm.allocate_slots(b, 5) == []
    assert bm.block_table(b.seq_id) == [3, 4]
    assert bm.free_block_ids == [5, 6, 7]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (5, 3)

    a.num_computed_tokens = 10
    assert bm.blocks_needed(a, 2) == 0  # slots 10 and 11 fit in block 2
    assert bm.blocks_needed(a, 3) == 1
    assert bm.allocate_slots(a, 3) == []
    assert bm.block_table(a.seq_id) == [0, 1, 2, 5]
    bm.check_invariants([a, b])


def test_a_finished_sequence_frees_its_tail_first_and_its_full_blocks_stay_cached():
    bm, events = make(num_blocks=6, block_size=4)
    a = seq(0, range(10))
    compute(bm, a, 10)  # blocks 0 and 1 are full, block 2 holds 2 tokens
    events.clear()
    do_free(bm, a)
    assert events == [free(2, a, cached=False), free(1, a, cached=True), free(0, a, cached=True)]
    assert bm.block_table(a.seq_id) == [] and a.num_computed_tokens == 0
    assert bm.free_block_ids == [3, 4, 5, 2, 1, 0]  # the tail will be evicted before the prefix
    assert bm.num_cached_blocks == 2


def test_a_request_with_the_same_prefix_shares_the_full_blocks():
    bm, events = make(num_blocks=8, block_size=4)
    a = seq(0, range(10))
    compute(bm, a, 10)
    b = seq(1, [*range(8), 100, 101, 102])
    events.clear()
    assert do_match(bm, b) == 8
    assert bm.block_table(b.seq_id) == [0, 1]
    assert (b.num_computed_tokens, b.num_cached_prompt_tokens) == (8, 8)
    assert events == [share(0, b, 0, ref_count=2), share(1, b, 1, ref_count=2)]
    assert bm.allocate_slots(b, 3) == []
    assert bm.block_table(b.seq_id) == [0, 1, 3]
    assert bm.prefix_hit_rate == pytest.approx(8 / 11)
    bm.check_invariants([a, b])

    # a finishes: its shared blocks are dropped by a but stay held by b, so only block 2 is free.
    events.clear()
    do_free(bm, a)
    assert events == [free(2, a, False), free(1, a, True), free(0, a, True)]
    assert bm.free_block_ids == [4, 5, 6, 7, 2]
    assert (bm.ref_count(0), bm.ref_count(1)) == (1, 1)
    bm.check_invariants([b])


def test_a_prefix_hit_revives_cached_blocks_from_the_middle_of_the_free_queue():
    bm, events = make(num_blocks=8, block_size=4)
    a = seq(0, range(10))
    compute(bm, a, 10)
    do_free(bm, a)
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 2, 1, 0]
    c = seq(1, range(10))
    events.clear()
    assert do_match(bm, c) == 8
    assert events == [share(0, c, 0, ref_count=1), share(1, c, 1, ref_count=1)]
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 2]
    assert bm.num_cached_blocks == 0
    bm.check_invariants([c])


def test_the_whole_prompt_is_never_matched_and_a_recomputed_duplicate_keeps_the_first_block_findable():
    bm, events = make(num_blocks=8, block_size=4)
    a = seq(0, range(8))
    compute(bm, a, 8)
    b = seq(1, range(8))
    assert do_match(bm, b) == 4  # the last token must be computed to get logits
    assert bm.block_table(b.seq_id) == [0]
    compute(bm, b, 4)
    assert bm.block_table(b.seq_id) == [0, 2]  # block 2 holds the same tokens as block 1
    events.clear()
    do_free(bm, b)
    assert events == [free(2, b, cached=False), free(0, b, cached=True)]
    d = seq(2, range(9))
    assert do_match(bm, d) == 8 and bm.block_table(d.seq_id) == [0, 1]


def test_lru_eviction_emits_evict_before_alloc_and_evicts_the_tail_first():
    bm, events = make(num_blocks=3, block_size=2)
    a = seq(0, [1, 2, 3, 4])
    compute(bm, a, 4)
    do_free(bm, a)
    assert bm.free_block_ids == [2, 1, 0]
    b = seq(1, [7, 8, 9, 10])
    events.clear()
    assert bm.allocate_slots(b, 4) == []
    assert events == [alloc(2, b, 0), ("block_evict", dict(block_id=1)), alloc(1, b, 1)]
    assert bm.num_cached_blocks == 1
    c = seq(2, [1, 2, 3, 4, 5])
    assert do_match(bm, c) == 2  # [1, 2] survived in block 0; [3, 4] was evicted with block 1
    assert bm.block_table(c.seq_id) == [0]
    bm.check_invariants([b, c])


def test_a_hash_collision_never_gives_a_false_hit(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda parent_hash, token_ids: 42)
    bm, _ = make(num_blocks=8, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    # Every block hashes to 42. b's second block has the tokens of a's FIRST block: only the chain
    # (the parent's content) tells them apart.
    b = seq(1, [1, 2, 1, 2, 9])
    assert do_match(bm, b) == 2 and bm.block_table(b.seq_id) == [0]
    c = seq(2, [3, 4, 5])
    assert do_match(bm, c) == 0 and bm.block_table(c.seq_id) == []
    bm.check_invariants([a, b, c])


def test_fork_shares_every_block_and_the_first_write_copies_the_partial_last_block():
    bm, events = make(num_blocks=8, block_size=4)
    parent = seq(0, range(6), request_id="r0")
    compute(bm, parent, 6)  # block 0 full, block 1 holds 2 tokens
    child = seq(1, range(6), request_id="r0")
    events.clear()
    do_fork(bm, parent, child)
    assert bm.block_table(child.seq_id) == [0, 1] and child.num_computed_tokens == 6
    assert events == [share(0, child, 0, 2, "fork"), share(1, child, 1, 2, "fork")]
    bm.check_invariants([parent, child])

    parent.token_ids.append(6)
    child.token_ids.append(60)
    assert bm.blocks_needed(child, 1) == 1
    events.clear()
    assert bm.allocate_slots(child, 1) == [(1, 2)]
    assert bm.block_table(child.seq_id) == [0, 2]
    assert events == [alloc(2, child, 1),
                      ("block_copy", dict(src_block_id=1, dst_block_id=2, seq_id=1)),
                      free(1, child, cached=False)]
    assert bm.ref_count(1) == 1
    assert bm.allocate_slots(parent, 1) == []  # block 1 is the parent's alone now
    assert bm.block_table(parent.seq_id) == [0, 1]
    bm.check_invariants([parent, child])


def test_truncate_frees_the_emptied_tail_and_the_rewrite_of_the_kept_block_forgets_its_hash():
    bm, events = make(num_blocks=8, block_size=4)
    a = seq(0, range(10))
    compute(bm, a, 10)
    events.clear()
    do_truncate(bm, a, 5)
    a.token_ids = a.token_ids[:5]
    assert events == [free(2, a, cached=False)]
    assert bm.block_table(a.seq_id) == [0, 1] and a.num_computed_tokens == 5
    b = seq(1, range(10))
    assert do_match(bm, b) == 8  # block 1 is not rewritten yet: still valid, now shared
    do_free(bm, b)

    a.token_ids += [50, 51, 52]
    assert compute(bm, a, 3) == []  # a holds block 1 alone again: it is rewritten in place
    c = seq(2, range(10))
    assert do_match(bm, c) == 4  # block 1 no longer promises tokens 4..7
    d = seq(3, [0, 1, 2, 3, 4, 50, 51, 52, 9])
    assert do_match(bm, d) == 8 and bm.block_table(d.seq_id) == [0, 1]


def test_truncate_keeps_dropped_full_blocks_cached_because_their_content_is_still_valid():
    bm, events = make(num_blocks=8, block_size=4)
    a = seq(0, range(12))
    compute(bm, a, 12)
    events.clear()
    do_truncate(bm, a, 8)
    assert events == [free(2, a, cached=True)]
    b = seq(1, range(13))
    assert do_match(bm, b) == 12 and bm.block_table(b.seq_id) == [0, 1, 2]


def test_truncate_of_a_shared_block_keeps_it_and_the_next_write_copies_it():
    bm, _ = make(num_blocks=8, block_size=4)
    parent = seq(0, range(8))
    compute(bm, parent, 8)
    child = seq(1, range(8), request_id="r0")
    do_fork(bm, parent, child)
    do_truncate(bm, child, 6)
    child.token_ids = child.token_ids[:6] + [66]
    assert bm.block_table(child.seq_id) == [0, 1] and child.num_computed_tokens == 6
    assert bm.allocate_slots(child, 1) == [(1, 2)]
    d = seq(2, range(9))
    assert do_match(bm, d) == 8  # the parent's block 1 is untouched and still findable


def test_allocation_failure_changes_nothing():
    bm, events = make(num_blocks=3, block_size=4)
    a, b = seq(0, range(8)), seq(1, range(100, 108))
    assert bm.allocate_slots(a, 8) == []
    n_events = len(events)
    assert bm.blocks_needed(b, 8) == 2 and not bm.can_allocate(2)
    assert bm.allocate_slots(b, 8) is None
    assert bm.block_table(b.seq_id) == [] and len(events) == n_events and bm.free_block_ids == [2]

    # The copy for copy-on-write counts too.
    a.num_computed_tokens = 6
    child = seq(2, range(8), request_id="r0")
    do_fork(bm, a, child)
    assert bm.allocate_slots(child, 1) == [(1, 2)]
    a2 = seq(3, range(6), request_id="r0")
    do_fork(bm, a, a2)
    assert bm.allocate_slots(a2, 1) is None  # block 1 is shared and no block is left for the copy
    assert bm.block_table(a2.seq_id) == [0, 1] and bm.block_table(child.seq_id) == [0, 2]
    bm.check_invariants([a, child, a2])


def test_without_prefix_caching_nothing_is_matched_or_cached():
    bm, events = make(num_blocks=4, block_size=2, prefix_caching=False)
    a = seq(0, [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    do_free(bm, a)
    assert all(not f["cached"] for t, f in events if t == "block_free")
    b = seq(1, [1, 2, 3, 4, 5])
    assert do_match(bm, b) == 0 and bm.block_table(b.seq_id) == []
    assert bm.prefix_hit_rate == 0.0


def test_check_invariants_notices_a_table_no_live_sequence_holds():
    bm, _ = make(num_blocks=4, block_size=2)
    a, b = seq(0, [1, 2, 3]), seq(1, [4, 5])
    bm.allocate_slots(a, 3)
    bm.allocate_slots(b, 2)
    bm.check_invariants([a, b])
    with pytest.raises(AssertionError):
        bm.check_invariants([a])  # b's table leaked: nobody frees it


def test_a_full_story_replays_from_events_alone():
    bm, events = make(num_blocks=6, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    child = seq(1, [1, 2, 3, 4, 5], request_id="r0")
    do_fork(bm, a, child)
    child.token_ids.append(7)
    compute(bm, child, 1)
    b = seq(2, [1, 2, 3, 4, 9, 9])
    do_match(bm, b)
    compute(bm, b, 2)
    do_truncate(bm, a, 3)
    do_free(bm, child)
    assert_replay_matches(bm, events, [a, b])
    do_free(bm, a)
    do_free(bm, b)
    assert_replay_matches(bm, events, [])
    assert bm.num_used_blocks == 0


# ---- random operations --------------------------------------------------------------------------


class Simulation:
    """The engine's side on a tiny cache: admit / allocate / compute / fork / truncate / free.

    A simulated KV cache (each slot holds the token prefix its K/V was computed from) catches
    false prefix hits and writes into shared blocks; the events are replayed after every step.
    Operations take plain ints and pick their target modulo what exists, so that both hypothesis
    and a seeded random loop can drive them.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.bm, self.events = make(num_blocks, block_size, prefix_caching)
        self.live: list[Sequence] = []
        self.reserved: dict[int, int] = {}  # seq_id -> end of the slots allocate_slots reserved
        self.kv: dict[int, list] = {}  # block -> per slot, the token prefix its K/V came from
        self.history: list[list[int]] = []  # token lists seen, so that later prompts share prefixes
        self.next_id = 0

    def _new_seq(self, tokens: list[int], request_id: str) -> Sequence:
        s = Sequence(self.next_id, request_id, tokens, len(tokens))
        self.next_id += 1
        self.live.append(s)
        return s

    def _pick(self, i: int) -> Sequence:
        return self.live[i % len(self.live)]

    def admit(self, fresh: list[int], reuse: int | None, cut: int | None, chunk: int) -> None:
        """A new prompt (optionally the start of an earlier sequence + `fresh`), then its first chunk."""
        prompt = list(fresh)
        if reuse is not None and self.history:
            old = self.history[reuse % len(self.history)]
            prompt = old[:len(old) if cut is None else cut % (len(old) + 1)] + prompt
        s = self._new_seq(prompt, f"r{self.next_id}")
        self.history.append(list(prompt))
        matched = do_match(self.bm, s)
        assert matched < len(prompt) and matched % self.bm.block_size == 0
        self.step(len(self.live) - 1, 1 + chunk % (len(prompt) - matched), fresh)

    def allocate(self, i: int, n: int) -> None:
        s = self._pick(i)
        before = (list(self.bm.block_table(s.seq_id)), self.bm.free_block_ids, len(self.events))
        needed = self.bm.blocks_needed(s, n)
        copies = self.bm.allocate_slots(s, n)
        if copies is None:
            assert not self.bm.can_allocate(needed)
            assert before == (self.bm.block_table(s.seq_id), self.bm.free_block_ids, len(self.events))
            return
        for src, dst in copies:
            self.kv[dst] = list(self.kv.get(src, [None] * self.bm.block_size))
        self.reserved[s.seq_id] = s.num_computed_tokens + n

    def compute(self, i: int, fill: list[int]) -> None:
        """Compute the reserved slots; sampled tokens (from `fill`) extend the sequence as needed."""
        s = self._pick(i)
        end = self.reserved.get(s.seq_id, 0)
        while len(s.token_ids) < end:
            s.token_ids.append(fill[len(s.token_ids) % len(fill)] if fill else 0)
        bs, table = self.bm.block_size, self.bm.block_table(s.seq_id)
        for pos in range(s.num_computed_tokens, end):
            self.kv.setdefault(table[pos // bs], [None] * bs)[pos % bs] = tuple(s.token_ids[:pos + 1])
        s.num_computed_tokens = max(s.num_computed_tokens, end)
        self.bm.commit_computed(s)

    def step(self, i: int, n: int, fill: list[int]) -> None:
        """The common engine path: reserve slots, then compute them."""
        self.allocate(i, n)
        self.compute(i, fill)

    def fork(self, i: int) -> None:
        parent = self._pick(i)
        child = self._new_seq(list(parent.token_ids), parent.request_id)
        child.num_prompt_tokens = parent.num_prompt_tokens
        do_fork(self.bm, parent, child)
        self.reserved.pop(parent.seq_id, None)  # both must allocate (and copy) before writing

    def truncate(self, i: int, n: int) -> None:
        s = self._pick(i)
        n %= len(s.token_ids) + 1
        self.history.append(list(s.token_ids))
        do_truncate(self.bm, s, n)
        s.token_ids = s.token_ids[:n]
        if s.seq_id in self.reserved:
            self.reserved[s.seq_id] = min(self.reserved[s.seq_id], n)

    def free(self, i: int) -> None:
        s = self._pick(i)
        self.history.append(list(s.token_ids))
        do_free(self.bm, s)
        self.live.remove(s)
        self.reserved.pop(s.seq_id, None)

    def check(self) -> None:
        self.bm.check_invariants(self.live)
        bs = self.bm.block_size
        for s in self.live:
            table = self.bm.block_table(s.seq_id)
            for pos in range(s.num_computed_tokens):
                slot = self.kv[table[pos // bs]][pos % bs]
                assert slot == tuple(s.token_ids[:pos + 1]), f"seq {s.seq_id} reads a wrong slot {pos}"
        assert_replay_matches(self.bm, self.events, self.live)

    def free_all(self) -> None:
        while self.live:
            self.free(0)
        assert self.bm.num_used_blocks == 0 and self.bm.num_free_blocks == self.bm.num_blocks
        assert_replay_matches(self.bm, self.events, [])


def run_random_ops(rng: random.Random, num_ops: int) -> Simulation:
    sim = Simulation(rng.randint(1, 12), rng.randint(1, 4), rng.random() < 0.7)
    tokens = lambda k: [rng.randint(0, 2) for _ in range(k)]  # noqa: E731  (a tiny vocabulary: prefixes repeat)
    ops = [
        (3, lambda: sim.admit(tokens(rng.randint(1, 6)), rng.choice([None, 0, 1, 2, 3]),
                              rng.choice([None, rng.randint(0, 20)]), rng.randint(0, 20))),
        (6, lambda: sim.step(rng.randint(0, 9), rng.randint(1, 5), tokens(5))),
        (2, lambda: sim.allocate(rng.randint(0, 9), rng.randint(0, 5))),
        (1, lambda: sim.compute(rng.randint(0, 9), tokens(5))),
        (2, lambda: sim.fork(rng.randint(0, 9))),
        (3, lambda: sim.truncate(rng.randint(0, 9), rng.randint(0, 20))),
        (2, lambda: sim.free(rng.randint(0, 9))),
    ]
    for _ in range(num_ops):
        _, op = rng.choices(ops, weights=[w for w, _ in ops])[0]
        if sim.live or op is ops[0][1]:
            op()
            sim.check()
        if len(sim.live) > 4:
            sim.free(rng.randint(0, 9))
    return sim


@pytest.mark.parametrize("seed", range(300))
def test_random_operations_keep_every_invariant(seed):
    sim = run_random_ops(random.Random(seed), num_ops=40)
    sim.free_all()


TOKENS = st.integers(0, 2)
TARGET = st.integers(0, 9)


class BlockManagerMachine(RuleBasedStateMachine):
    """The same operations, chosen and shrunk by hypothesis."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), prefix_caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.sim = Simulation(num_blocks, block_size, prefix_caching)

    @precondition(lambda self: len(self.sim.live) < 4)
    @rule(fresh=st.lists(TOKENS, min_size=1, max_size=6), reuse=st.none() | TARGET,
          cut=st.none() | st.integers(0, 20), chunk=st.integers(0, 20))
    def admit(self, fresh, reuse, cut, chunk) -> None:
        self.sim.admit(fresh, reuse, cut, chunk)

    @precondition(lambda self: self.sim.live)
    @rule(i=TARGET, n=st.integers(1, 5), fill=st.lists(TOKENS, min_size=1, max_size=5))
    def step(self, i, n, fill) -> None:
        self.sim.step(i, n, fill)

    @precondition(lambda self: self.sim.live)
    @rule(i=TARGET, n=st.integers(0, 5))
    def allocate(self, i, n) -> None:
        self.sim.allocate(i, n)

    @precondition(lambda self: self.sim.live)
    @rule(i=TARGET, fill=st.lists(TOKENS, min_size=1, max_size=5))
    def compute(self, i, fill) -> None:
        self.sim.compute(i, fill)

    @precondition(lambda self: 0 < len(self.sim.live) < 4)
    @rule(i=TARGET)
    def fork(self, i) -> None:
        self.sim.fork(i)

    @precondition(lambda self: self.sim.live)
    @rule(i=TARGET, n=st.integers(0, 20))
    def truncate(self, i, n) -> None:
        self.sim.truncate(i, n)

    @precondition(lambda self: self.sim.live)
    @rule(i=TARGET)
    def free(self, i) -> None:
        self.sim.free(i)

    @invariant()
    def consistent(self) -> None:
        self.sim.check()

    def teardown(self) -> None:
        if hasattr(self, "sim"):
            self.sim.free_all()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerMachine = BlockManagerMachine.TestCase
