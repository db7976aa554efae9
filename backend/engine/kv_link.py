"""The link between disaggregated instances: a torch.distributed group with one rank per instance, and
the send/recv that moves a request's KV blocks from a prefill instance's cache to a decode instance's.

Each instance is a rank of one gloo group, which moves host memory: a CUDA cache's blocks are copied to
the host and back (NCCL would take the same calls between GPUs, one rank per GPU; not run here).
kvscope runs every instance in one process, so the ranks are built side by side here (KVLink says
how), over a store and gloo pairs listening on 127.0.0.1 only (tp_group.local_store, tp_group.Link).
What moves is real: the sender
gathers the blocks out of its cache tensor and sends them, the receiver writes them into the blocks
its own block manager gave, over gloo's TCP pairs.

A transfer is two messages from rank `src` to rank `dst`:
    1. the block table: int64 [2, n], the source block ids over the destination ids (the receiver
       checks it against the blocks it expects: a cross-wired transfer fails, never lands elsewhere);
    2. the contents: [layers, planes, n, block_size, kv_heads, head_dim] of the cache's storage
       dtype, and for an int8 cache its scales [layers, planes, n, block_size, kv_heads] after it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.tp_group import LOOPBACK, Link, local_store

LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


class TransferFailed(RuntimeError):
    """A transfer did not complete: the message says between which instances and why."""


@dataclass(frozen=True)
class Transfer:
    """What one request's handoff moved, as the receiving side measured it."""

    num_blocks: int
    bytes: int  # contents and scales; the block table's 16 bytes a block are counted too
    seconds: float  # from the first send to the last byte received


class KVLink:
    """One gloo rank per instance, all in this process; `send_blocks` moves blocks between two of them.

    gloo connects a group's pairs as it is built, every rank's constructor waiting for the others, and
    a constructor holds Python's lock: ranks of one process would wait on each other forever. So the
    group is built lazily (TORCH_GLOO_LAZY_INIT: a pair connects at its first message) and each pair
    that will carry blocks exchanges a first message here, its receive on a thread of its own (a
    receive waits without the lock). From then on a transfer posts its receive and its send from one
    thread, as asynchronous work, and waits for both."""

    def __init__(self, world: int, pairs: list[tuple[int, int]], timeout_s: float = 60.0) -> None:
        self.world, self.backend, self.host = world, "gloo", LOOPBACK
        self._store = local_store(world)
        with _lazy_gloo():
            self.groups = [self._group(rank, world, timeout_s) for rank in range(world)]
        self._tag = 0
        for src, dst in pairs:
            self._connect(src, dst)

    def _group(self, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = Link(LOOPBACK).devices()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupGloo(dist.PrefixStore("kv_link", self._store), rank, world, opts)

    def _connect(self, src: int, dst: int) -> None:
        """The pair's first message, which connects it: the receive waits on a thread of its own."""
        self._tag += 1
        hello, got, failed = torch.ones(1), torch.zeros(1), []

        def receive() -> None:
            try:
                self.groups[dst].recv([got], src, self._tag).wait()
            except RuntimeError as e:
                failed.append(e)

        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        try:
            self.groups[src].send([hello], dst, self._tag).wait()
        except RuntimeError as e:
            failed.append(e)
        receiver.join()
        if failed or got.item() != 1:
            raise TransferFailed(f"instance {src} -> {dst}: the link did not connect: {failed[:1]}")

    def send_blocks(self, src: int, dst: int, src_cache: KVCache, dst_cache: KVCache,
                    src_blocks: list[int], dst_blocks: list[int]) -> Transfer:
        """Copy src_cache's `src_blocks` into dst_cache's `dst_blocks` (same order), from rank src to rank dst."""
        started = time.perf_counter()
        self._tag += 1
        table = torch.tensor([src_blocks, dst_blocks], dtype=torch.int64)  # [2, n]
        got_table = torch.empty_like(table)
        self._move([table], [got_table], src, dst)
        if not torch.equal(got_table, table):
            raise TransferFailed(f"instance {dst} received the block table of another transfer")
        index = torch.tensor(src_blocks, dtype=torch.long, device=src_cache.data.device)
        # gloo moves host memory: a GPU cache's blocks go through it (NCCL between GPUs has not run here)
        planes = [src_cache.data[:, :, index].cpu()]  # [layers, planes, n, block_size, kv_heads, head_dim]
        if src_cache.scales is not None:
            planes.append(src_cache.scales[:, :, index].cpu())  # [layers, planes, n, block_size, kv_heads]
        received = [torch.empty_like(p) for p in planes]
        self._move(planes, received, src, dst)
        into = torch.tensor(dst_blocks, dtype=torch.long, device=dst_cache.data.device)
        dst_cache.data[:, :, into] = received[0].to(dst_cache.data.device)
        if dst_cache.scales is not None:
            dst_cache.scales[:, :, into] = received[1].to(dst_cache.data.device)
        num_bytes = table.numel() * table.element_size() + sum(p.numel() * p.element_size() for p in planes)
        return Transfer(len(src_blocks), num_bytes, time.perf_counter() - started)

    def _move(self, sent: list[torch.Tensor], into: list[torch.Tensor], src: int, dst: int) -> None:
        """Each tensor of `sent` from rank src into the same-shaped one of `into` at rank dst."""
        for i, (tensor, buffer) in enumerate(zip(sent, into, strict=True)):
            tag = self._tag * 8 + i
            receiving = self.groups[dst].recv([buffer], src, tag)
            sending = self.groups[src].send([tensor.contiguous()], dst, tag)
            try:
                sending.wait()
                receiving.wait()
            except RuntimeError as e:
                raise TransferFailed(f"instance {src} -> {dst}: {e}") from None

    def close(self) -> None:
        """Let the group go (its pairs' sockets close with it); idempotent."""
        self.groups, self._store = [], None


@contextmanager
def _lazy_gloo() -> Iterator[None]:
    """gloo groups built meanwhile connect each pair at its first message (read by their constructor)."""
    before = os.environ.get(LAZY_INIT)
    os.environ[LAZY_INIT] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[LAZY_INIT]
        else:
            os.environ[LAZY_INIT] = before
