"""The physical blocks of the paged KV cache: who holds which block, and which blocks can be reused.

Pure bookkeeping (vLLM v1 / nano-vllm style): ref counts, one free queue, prefix hashes, and every
sequence's block table, keyed by its seq_id (this module alone writes a table; `block_table` hands
out a copy). It never touches tensors; when a shared block must be copied it returns (src, dst) pairs
for the runner. It reads a sequence's tokens and computed count, which the scheduler writes.

Free queue: block ids in eviction order (front = evicted first), an OrderedDict so that a prefix
hit can take a cached block out of the middle in O(1). Allocation pops the front. A block whose
ref count reaches 0 goes to the back; a sequence drops its blocks tail first, so its tail is
evicted before its prefix.

Prefix caching: a FULL block of computed tokens gets a chained hash
`hash_block(parent_hash, token_ids)`. Beside the hash we keep the block's token ids and a
`content_id` of its parent block; a hit must match both, so a hash collision (even at a parent
further up the chain) never yields a false hit. A free block keeps its hash ("cached") until it
is popped for a new allocation; then `block_evict` comes just before its `block_alloc`.

Event rules (their fields: backend/events/schema.py). Each change is reported through `emit(type,
**fields)` as it happens: the scheduler records them in order among the step's other outputs, and
the engine emits them as events (step_events.py). Replaying the block events alone rebuilds every
table and the free list:
- `block_alloc(block_id, seq_id, logical_index)`: the block leaves the free list, ref count 1,
  `table[logical_index] = block_id` (an append, or a replacement during copy-on-write).
- `block_share(..., logical_index, ref_count, reason)`: the sequence takes one more reference;
  the block leaves the free list if it was there; `table[logical_index] = block_id`.
- `block_copy(src_block_id, dst_block_id, seq_id)`: data only (the runner copies the KV). A
  copy-on-write is emitted as `block_alloc(dst at src's index)`, `block_copy`, `block_free(src)`.
- `block_free(block_id, seq_id, cached)`: the sequence drops ONE reference, emitted for every
  block a sequence drops, shared or not. The reducer removes the block from that sequence's table
  (if still there: after a copy-on-write it was already replaced) and decrements the ref count;
  only when it reaches 0 does the block go to the back of the free list. `cached` says whether the
  block stays findable by its prefix hash; it matters only once the ref count is 0.
- `block_evict(block_id)`: the block's hash is forgotten; the free list is unchanged (the
  `block_alloc` that follows takes it off).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvscope.backend.engine.sequence import Sequence

ROOT_HASH = 0  # parent hash of a sequence's first block; a constant keeps hashes reproducible
ROOT_CONTENT = -1  # parent content id of a sequence's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: equal only if the whole prefix up to it is (almost surely) equal."""
    return hash((parent_hash, token_ids))


@dataclass(frozen=True)
class BlockContent:
    """What a full, computed block holds. Blocks with equal content share one `content_id`."""
    hash: int
    parent_content_id: int
    token_ids: tuple[int, ...]
    content_id: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 emit: Callable[..., None]) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._emit = emit
        self._ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._content: dict[int, BlockContent] = {}  # block id -> content, for committed blocks
        self._hash_to_block: dict[int, int] = {}  # the one findable ("canonical") block per hash
        self._next_content_id = 0
        self._write_end: dict[int, int] = {}  # seq_id -> end of the slots reserved by allocate_slots
        self._tables: dict[int, list[int]] = {}  # seq_id -> logical block index -> physical block id
        self._lookup_tokens = 0
        self._hit_tokens = 0

    # ---- counters -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a findable prefix (a hit would revive them)."""
        return sum(1 for block in self._free if block in self._content)

    @property
    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first."""
        return list(self._free)

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens matched by the prefix cache / tokens looked up, over all `match_prefix` calls."""
        return self._hit_tokens / self._lookup_tokens if self._lookup_tokens else 0.0

    @property
    def prefix_counts(self) -> tuple[int, int]:
        """(tokens matched, tokens looked up): the hit rate's parts, to add up over several pools."""
        return self._hit_tokens, self._lookup_tokens

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (logical index -> physical block id); empty if it holds none."""
        return list(self._tables.get(seq_id, ()))

    def num_blocks_of(self, seq_id: int) -> int:
        return len(self._tables.get(seq_id, ()))

    def _table(self, seq: Sequence) -> list[int]:
        """The sequence's own table, made on first use (removed again when the sequence lets go of every block)."""
        return self._tables.setdefault(seq.seq_id, [])

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks `allocate_slots(seq, num_new_tokens)` would take, copy-on-write included."""
        end = seq.num_computed_tokens + num_new_tokens
        grow = max(0, self._blocks_for(end) - self.num_blocks_of(seq.seq_id))
        return grow + len(self._shared_in_write_range(seq, end))

    # ---- prefix cache ---------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that `match_prefix` would share, without sharing them (no side effects).

        Looks up all of `token_ids` (a sequence resumed after a recompute preemption reuses its own
        output too), but never all of it: the last token must be computed to give logits.
        """
        if not self.enable_prefix_caching:
            return []
        tokens, hits = seq.token_ids, []
        parent_hash, parent_content_id = self._root(seq)
        for i in range((len(tokens) - 1) // self.block_size):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent_hash, block_tokens)
            block = self._hash_to_block.get(h)
            if block is None or not self._same_content(block, parent_content_id, block_tokens):
                break
            hits.append(block)
            parent_hash, parent_content_id = h, self._content[block].content_id
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether sharing `hits` and then computing num_new_tokens more would find enough free blocks."""
        total = len(hits) * self.block_size + num_new_tokens
        reviving = sum(1 for b in hits if b in self._free)  # shared cached blocks leave the free queue
        return self._blocks_for(total) - len(hits) <= len(self._free) - reviving

    def match_prefix(self, seq: Sequence, hits: list[int] | None = None, count: bool = True) -> int:
        """Share the longest cached prefix of a newly admitted sequence; returns the matched tokens
        (the scheduler, the one writer of sequence state, records them as computed).

        `count=False` leaves the prefix hit rate alone (a draft model's lookups are not requests')."""
        if not self.enable_prefix_caching:
            return 0
        assert not self.num_blocks_of(seq.seq_id), "match_prefix expects a sequence without blocks"
        for block in self.lookup_prefix(seq) if hits is None else hits:
            self._share(seq, block, "prefix_cache")
        matched = self.num_blocks_of(seq.seq_id) * self.block_size
        if count:
            self._lookup_tokens += len(seq.token_ids)
            self._hit_tokens += matched
        return matched

    def commit_computed(self, seq: Sequence) -> None:
        """Register the hashes of the blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        table = self._tables.get(seq.seq_id, [])
        first = num_full
        # Committed blocks form a prefix of the table, so walking back costs only the new ones.
        while first > 0 and table[first - 1] not in self._content:
            first -= 1
        for index in range(first, num_full):
            self._commit_block(seq, table, index)

    def _commit_block(self, seq: Sequence, table: list[int], index: int) -> None:
        block = table[index]
        block_tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
        parent_hash, parent_content_id = self._root(seq)
        if index > 0:
            parent = self._content[table[index - 1]]
            parent_hash, parent_content_id = parent.hash, parent.content_id
        h = hash_block(parent_hash, block_tokens)
        canonical = self._hash_to_block.get(h)
        if canonical is not None and self._same_content(canonical, parent_content_id, block_tokens):
            content_id = self._content[canonical].content_id  # same content computed twice
        else:
            content_id = self._new_content_id()
        if canonical is None:
            self._hash_to_block[h] = block
        # else: keep the existing mapping; this block is valid for its holders, just not findable.
        self._content[block] = BlockContent(h, parent_content_id, block_tokens, content_id)

    @staticmethod
    def _root(seq: Sequence) -> tuple[int, int]:
        """(parent hash, parent content id) of a sequence's first block, apart per cache namespace."""
        if seq.cache_namespace == 0:
            return ROOT_HASH, ROOT_CONTENT
        return hash((ROOT_HASH, -seq.cache_namespace)), ROOT_CONTENT - seq.cache_namespace  # ints: no per-process salt

    def _same_content(self, block: int, parent_content_id: int, block_tokens: tuple[int, ...]) -> bool:
        content = self._content[block]
        return content.parent_content_id == parent_content_id and content.token_ids == block_tokens

    def _new_content_id(self) -> int:
        self._next_content_id += 1
        return self._next_content_id - 1

    def _is_cached(self, block: int) -> bool:
        content = self._content.get(block)
        return content is not None and self._hash_to_block.get(content.hash) == block

    def _forget(self, block: int) -> None:
        """The block's content is about to change: it must no longer be found by its hash."""
        content = self._content.pop(block, None)
        if content is not None and self._hash_to_block.get(content.hash) == block:
            del self._hash_to_block[content.hash]

    # ---- allocation -----------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Cover `num_computed_tokens + num_new_tokens` slots; None (and no change) if blocks run out.

        Every write must be reserved here first. Returns the (src, dst) block copies the runner
        must do before writing: a shared block about to be written (after a fork, or a truncation
        into a shared block) is replaced by a private copy.
        """
        end = seq.num_computed_tokens + num_new_tokens
        shared = self._shared_in_write_range(seq, end)
        grow = max(0, self._blocks_for(end) - self.num_blocks_of(seq.seq_id))
        if not self.can_allocate(grow + len(shared)):
            return None
        table = self._table(seq)
        copies = [self._copy_on_write(seq, table, index) for index in shared]
        for index in self._write_range(seq, end):
            # A full block rewritten after a truncation: its hash would promise the old tokens.
            self._forget(table[index])
        for _ in range(grow):
            block = self._take_free_block()
            table.append(block)
            self._emit_alloc(seq, block, len(table) - 1)
        self._write_end[seq.seq_id] = end
        return copies

    def _write_range(self, seq: Sequence, end: int) -> range:
        """Logical indices of the existing blocks that the slots [num_computed_tokens, end) write."""
        return range(seq.num_computed_tokens // self.block_size,
                     min(self.num_blocks_of(seq.seq_id), self._blocks_for(end)))

    def _shared_in_write_range(self, seq: Sequence, end: int) -> list[int]:
        table = self._tables.get(seq.seq_id, [])
        return [i for i in self._write_range(seq, end) if self._ref_count[table[i]] > 1]

    def _copy_on_write(self, seq: Sequence, table: list[int], index: int) -> tuple[int, int]:
        src = table[index]
        dst = self._take_free_block()
        table[index] = dst
        self._emit_alloc(seq, dst, index)
        self._emit("block_copy", src_block_id=src, dst_block_id=dst, seq_id=seq.seq_id)
        self._release(seq, src)
        return src, dst

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        if block in self._content:  # only findable blocks keep their content once free
            self._forget(block)
            self._emit("block_evict", block_id=block)
        self._ref_count[block] = 1
        return block

    def _share(self, seq: Sequence, block: int, reason: str) -> None:
        if self._ref_count[block] == 0:
            del self._free[block]  # a cached block revived by a prefix hit
        self._ref_count[block] += 1
        table = self._table(seq)
        table.append(block)
        self._emit("block_share", block_id=block, seq_id=seq.seq_id, request_id=seq.request_id,
                   logical_index=len(table) - 1, ref_count=self._ref_count[block],
                   reason=reason)

    def _emit_alloc(self, seq: Sequence, block: int, logical_index: int) -> None:
        self._emit("block_alloc", block_id=block, seq_id=seq.seq_id, request_id=seq.request_id,
                   logical_index=logical_index)

    def adopt(self, tables: list[tuple[Sequence, list[int]]]) -> dict[int, int] | None:
        """Blocks here for sequences arriving with their computed KV from another pool (disaggregated
        prefill): each distinct block of theirs there gets one free block here, held by as many of them
        as held it there (a prompt block a request's forks share stays shared, and is copied on write
        as it would have been). Returns their block -> its block here, for the caller to copy the
        contents over; None (and no change) if too few blocks are free."""
        distinct = list(dict.fromkeys(block for _, table in tables for block in table))
        if not self.can_allocate(len(distinct)):
            return None
        here: dict[int, int] = {}
        for seq, table in tables:
            assert not self.num_blocks_of(seq.seq_id), "adopt expects sequences without blocks here"
            for block in table:
                if block in here:
                    self._share(seq, here[block], "transfer")
                else:
                    here[block] = self._take_free_block()
                    self._table(seq).append(here[block])
                    self._emit_alloc(seq, here[block], self.num_blocks_of(seq.seq_id) - 1)
            self.commit_computed(seq)
        return here

    # ---- release --------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop all of the sequence's blocks, tail first (so its tail is evicted before its prefix).

        Nothing of it is computed any more: the scheduler sets num_computed_tokens to 0."""
        table = self._tables.pop(seq.seq_id, [])
        while table:
            self._release(seq, table.pop())
        self._write_end.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes after this copy first.

        The parent's reserved slots are dropped too: both sequences must call `allocate_slots`
        before writing, which makes the copies. The child has the parent's computed tokens (the
        scheduler records them).
        """
        assert not self.num_blocks_of(child.seq_id), "fork expects a child without blocks"
        for block in self.block_table(parent.seq_id):
            self._share(child, block, "fork")
        self._write_end.pop(parent.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the sequence to `num_tokens` slots (rejected speculative tokens roll back).

        Blocks past the end are dropped tail first. Every block keeps its hash: its content is
        still valid until rewritten, and the next `allocate_slots` either forgets the hash of the
        kept partial block (before this sequence overwrites it) or copies the block if another
        sequence holds it by then. The caller (the scheduler) trims `seq.token_ids` and lowers
        `num_computed_tokens` to at most num_tokens.
        """
        keep = self._blocks_for(num_tokens)
        table = self._tables.get(seq.seq_id, [])
        while len(table) > keep:
            self._release(seq, table.pop())
        if seq.seq_id in self._write_end:
            self._write_end[seq.seq_id] = min(self._write_end[seq.seq_id], num_tokens)

    def _release(self, seq: Sequence, block: int) -> None:
        """The sequence drops one reference; at zero the block joins the back of the free queue."""
        assert self._ref_count[block] > 0
        self._ref_count[block] -= 1
        cached = self._is_cached(block)
        if self._ref_count[block] == 0:
            if not cached:
                self._content.pop(block, None)  # unfindable content is useless once free
            self._free[block] = None
        self._emit("block_free", block_id=block, seq_id=seq.seq_id, request_id=seq.request_id,
                   cached=cached)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- checks ---------------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the bookkeeping is consistent with the live sequences' block tables."""
        seqs = list(seqs)
        holders = Counter(block for seq in seqs for block in self._tables.get(seq.seq_id, ()))
        assert sum(holders.values()) == sum(map(len, self._tables.values())), "a table of no live sequence"
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
        for block in range(self.num_blocks):
            assert self._ref_count[block] == holders[block], f"block {block}: ref count vs tables"
            assert (self._ref_count[block] == 0) == (block in self._free), f"block {block}: free xor held"
            if block in self._free and block in self._content:
                assert self._is_cached(block), f"free block {block} keeps unfindable content"
        for h, block in self._hash_to_block.items():
            assert self._content[block].hash == h
        for seq in seqs:
            table = self._tables.get(seq.seq_id, [])
            assert len(set(table)) == len(table), f"seq {seq.seq_id}: repeated block"
            assert seq.num_computed_tokens <= len(table) * self.block_size
            self._check_private_writes(seq)

    def _check_private_writes(self, seq: Sequence) -> None:
        """Slots reserved for writing lie in blocks no other sequence holds: no two write one slot."""
        table = self._tables.get(seq.seq_id, [])
        end = min(self._write_end.get(seq.seq_id, 0), len(table) * self.block_size)
        for position in range(seq.num_computed_tokens, end):
            block = table[position // self.block_size]
            assert self._ref_count[block] == 1, f"seq {seq.seq_id} would write shared block {block}"
            assert block not in self._content, f"seq {seq.seq_id} would rewrite hashed block {block}"
