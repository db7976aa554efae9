"""The ranks of one tensor-parallel engine: a torch.distributed process group, and the store beside it.

Two channels, as vLLM keeps them apart:
- the all-reduces of the forward go through a process group: gloo on CPU, NCCL on CUDA. Every
  collective has the group's timeout, so a rank that hangs fails the step instead of the run;
- the step's input goes from rank 0 to the others through the rendezvous store (a TCPStore), not a
  collective: a worker may wait for the next step as long as a server stays idle, where a
  collective would time out.
Each worker also beats on the store (a counter a thread of its own raises), so a failed step can name
a rank that stopped or wedged apart from the ranks that only waited for it.

Rendezvous: `kvscope` spawning its own ranks hosts a TCPStore on 127.0.0.1 (port 0: the OS picks a
free one, closed with the process); under `torchrun` the store is the one torchrun's environment
names (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). Everything after the store is the same code.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HEARTBEAT_S = 0.2  # a worker's heartbeat period
SILENCE_BEATS = 5  # a rank whose heartbeat is still for this many periods is named as the one that hangs
WAIT_FOREVER = timedelta(days=365)  # a worker waits for its next step as long as rank 0 lives
STORE_TIMEOUT = timedelta(seconds=60)  # connecting to the store
STARTUP = timedelta(minutes=30)  # a rank waiting for its shard while rank 0 builds the others


class RankFailed(RuntimeError):
    """A rank died, hung or broke a collective: the message names it."""


@dataclass
class AllReduceStats:
    """What the all-reduces of one step cost, as rank 0 measured them."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def take(self) -> dict:
        """The iteration event's `allreduce` field, and a fresh count for the next step."""
        out = {"count": self.count, "bytes": self.bytes, "ms": round(self.seconds * 1e3, 4)}
        self.count, self.bytes, self.seconds = 0, 0, 0.0
        return out


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was launched by torchrun (or any env:// launcher), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def torchrun_store() -> dist.Store:
    """The store of torchrun's rendezvous (its agent's, or rank 0's), as init_process_group's env:// finds it."""
    store, _, _ = next(dist.rendezvous("env://", timeout=STORE_TIMEOUT))
    return store


def local_store(world: int) -> dist.TCPStore:
    """A store for ranks spawned on this machine, on a port the OS picks; closed when this process ends."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


class TPGroup:
    """One rank's view of its group: rank, world size, the all-reduce, and the store's step channel."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        self.store, self.rank, self.world, self.device = store, rank, world, device
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world, timeout)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.stats = AllReduceStats()
        self.step = 0  # the next step's number on the store channel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x across ranks in place, and count it (rank 0's time includes waiting for the slowest rank)."""
        started = time.perf_counter()
        self.pg.allreduce([x]).wait()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.stats.count += 1
        self.stats.bytes += x.numel() * x.element_size()
        self.stats.seconds += time.perf_counter() - started
        return x

    # ---- whole objects, once (a rank's shard at the start) -----------------------------------------

    def send_object(self, obj: object, dst: int) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(self.device)
        self.store.set(f"sending/{dst}", "")
        self.pg.send([torch.tensor([data.numel()], device=self.device)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()

    def recv_object(self, src: int = 0) -> object:
        # Rank 0 builds the shards one after another (minutes for a big model): the wait for its turn is on
        # the store, so that the transfer alone runs under the collective timeout.
        self.store.wait([f"sending/{self.rank}"], STARTUP)
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.pg.recv([size], src, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self.pg.recv([data], src, 1).wait()
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False, map_location=self.device)

    # ---- the step channel: rank 0 posts, the others read -------------------------------------------

    def post(self, message: object) -> None:
        """Rank 0: the next step's message for every other rank (None: stop)."""
        self.store.set(f"step/{self.step}", pickle.dumps(message))
        if self.step:
            self.store.delete_key(f"step/{self.step - 1}")  # every rank read it: they all-reduced with rank 0 since
        self.step += 1

    def receive(self) -> object:
        """A worker: wait for rank 0's next message and read it."""
        key = f"step/{self.step}"
        self.store.wait([key], WAIT_FOREVER)
        self.step += 1
        return pickle.loads(self.store.get(key))

    def beat(self) -> None:
        """A worker's heartbeat thread: one more beat."""
        self.store.add(f"beat/{self.rank}", 1)

    def silent(self) -> list[int]:
        """Rank 0, after a failed step: the ranks whose heartbeat did not move over a few beats (stopped,
        wedged, or gone with their machine), where a healthy rank keeps beating while it waits."""
        def beats() -> list[int]:
            return [self.store.add(f"beat/{r}", 0) for r in range(1, self.world)]
        try:
            before = beats()
            time.sleep(SILENCE_BEATS * HEARTBEAT_S)
            after = beats()
        except RuntimeError:  # the store is unreachable: nothing to tell apart
            return []
        return [r for r, b, a in zip(range(1, self.world), before, after, strict=True) if a == b]
