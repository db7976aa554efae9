"""The ranks of one tensor-parallel engine: a torch.distributed process group, and the store beside it.

Two channels, as vLLM keeps them apart:
- the all-reduces of the forward go through a process group: gloo on CPU, NCCL on CUDA. Every
  collective has the group's timeout, so a rank that hangs fails the step instead of the run;
- the step's input goes from rank 0 to the others through the rendezvous store (a TCPStore), not a
  collective: a worker may wait for the next step as long as a server stays idle, where a
  collective would time out.
Each worker also beats on the store (a counter a thread of its own raises), so a failed step can name
a rank that stopped or wedged apart from the ranks that only waited for it.

Who can talk to them: a TCPStore and gloo's pairs take any connection and ask for nothing, so they
listen only where the ranks are: `local_store` binds 127.0.0.1 (a socket bound here and handed to the
store: TCPStore's own host name only tells clients where to connect, and it would listen on every
interface), and gloo's pairs listen on the address the Link names (loopback for ranks on one machine).
What a rank reads from the store it trusts only once signed with the run's secret (tp_auth.py), and
what it acts on is plain data checked field by field (tp_wire.py): a client of the store that is not
the run's own can fail a run at most, never run code in a rank.

Rendezvous: `kvscope` spawning its own ranks hosts a TCPStore on 127.0.0.1 (port 0: the OS picks a
free one, closed with the process); under `torchrun` the store is the one torchrun's environment
names (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), and listens where torchrun puts it. Everything
after the store is the same code.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvscope.backend.engine.tp_auth import Refused, RunSecret

HEARTBEAT_S = 0.2  # a worker's heartbeat period
SILENCE_BEATS = 5  # a rank whose heartbeat is still for this many periods is named as the one that hangs
WAIT_FOREVER = timedelta(days=365)  # a worker waits for its next step as long as rank 0 lives
STORE_TIMEOUT = timedelta(seconds=60)  # connecting to the store
STARTUP = timedelta(minutes=30)  # a rank waiting for its shard while rank 0 builds the others
LOOPBACK = "127.0.0.1"
REASON_CHARS = 300  # what rank 0 repeats of a worker's reason for stopping
HOST_CHARS = 120  # what the header keeps of a rank's host label


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


@dataclass(frozen=True)
class Link:
    """Where this rank's gloo pairs listen: one address (loopback for ranks on one machine), or the
    interfaces a multi-host launch names (GLOO_SOCKET_IFNAME)."""

    host: str | None = LOOPBACK
    interfaces: tuple[str, ...] = ()

    def devices(self) -> list:
        if self.interfaces:
            return [dist.ProcessGroupGloo.create_device(interface=name) for name in self.interfaces]
        return [dist.ProcessGroupGloo.create_device(hostname=self.host)]


def host_label(link: Link) -> str:
    """Where a rank runs, as the header lists it: the machine's name and the address (or the interfaces) its
    collectives use. Ranks kvscope spawned share one; ranks torchrun put on other hosts differ at least in
    the address (network namespaces of one machine share its name)."""
    return f"{socket.gethostname()} ({','.join(link.interfaces) if link.interfaces else link.host})"[:HOST_CHARS]


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was launched by torchrun (or any env:// launcher), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def torchrun_store() -> dist.Store:
    """The store of torchrun's rendezvous (its agent's, or rank 0's), as init_process_group's env:// finds it."""
    store, _, _ = next(dist.rendezvous("env://", timeout=STORE_TIMEOUT))
    return store


def torchrun_link() -> Link:
    """Where gloo listens under torchrun: the interfaces GLOO_SOCKET_IFNAME names; else loopback when every
    rank is on this machine; else the address this machine reaches MASTER_ADDR from (the interface the
    launch already uses between the machines), never every interface."""
    names = tuple(n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n)
    if names:
        return Link(None, names)
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
        return Link(LOOPBACK)
    return Link(route_to(os.environ["MASTER_ADDR"]))


def route_to(host: str) -> str:
    """The local address this machine sends from to reach `host` (a UDP connect sends nothing)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(address)
        return s.getsockname()[0]


def local_store(world: int, host: str = LOOPBACK) -> dist.TCPStore:
    """A store for ranks spawned on this machine, listening on `host` only, on a port the OS picks; closed
    when the store is dropped. TCPStore(host, is_master=True) alone would listen on every interface: the
    socket is bound here and handed over (the store owns it from then on)."""
    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT,
                         master_listen_fd=listener.detach())


class TPGroup:
    """One rank's view of its group: rank, world size, the all-reduce, and the store's signed step channel.

    `store`: the session's own keys (a PrefixStore under the run's namespace); `secret` signs and checks
    every value this channel carries."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float,
                 secret: RunSecret, link: Link = Link()) -> None:
        self.store, self.rank, self.world, self.device, self.secret = store, rank, world, device, secret
        self.host = host_label(link)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = link.devices()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world, opts)
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

    # ---- a worker's shard, once: its spec (signed JSON), then its tensors -------------------------------

    def send_shard(self, spec: bytes, state: bytes, dst: int) -> None:
        """Rank 0: send rank `dst` its spec (which carries the state's digest) and its state dict's bytes."""
        self.store.set(f"sending/{dst}", "")
        for data in (self.secret.sign(f"spec/{dst}", spec), state):
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self.pg.send([torch.tensor([tensor.numel()], device=self.device)], dst, 0).wait()
            self.pg.send([tensor], dst, 1).wait()

    def recv_shard(self) -> tuple[bytes, bytes]:
        """A worker: (its spec's body, checked as rank 0's, and the state dict's bytes, to check against it)."""
        # Rank 0 builds the shards one after another (minutes for a big model): the wait for its turn is on
        # the store, so that the transfer alone runs under the collective timeout.
        self.store.wait([f"sending/{self.rank}"], STARTUP)
        frame, state = self._recv_bytes(), self._recv_bytes()
        return self.secret.open(f"spec/{self.rank}", frame), state

    def _recv_bytes(self) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.pg.recv([size], 0, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self.pg.recv([data], 0, 1).wait()
        return data.cpu().numpy().tobytes()

    # ---- the step channel: rank 0 posts, the others read -------------------------------------------

    def post(self, body: bytes) -> None:
        """Rank 0: the next step's body for every other rank (tp_wire.py), signed for this step alone."""
        self.store.set(f"step/{self.step}", self.secret.sign(f"step/{self.step}", body))
        if self.step:
            self.store.delete_key(f"step/{self.step - 1}")  # every rank read it: they all-reduced with rank 0 since
        self.step += 1

    def receive(self) -> bytes:
        """A worker: wait for rank 0's next body and return it once its signature holds (Refused otherwise:
        another process wrote the key, or copied another step's value there)."""
        key = f"step/{self.step}"
        self.store.wait([key], WAIT_FOREVER)
        self.step += 1
        return self.secret.open(key, self.store.get(key))

    # ---- why a rank stopped ----------------------------------------------------------------------------

    def say_refused(self, reason: str) -> None:
        """A worker that refuses a message: its reason, signed, for rank 0 to report."""
        self.store.set(f"refused/{self.rank}", self.secret.sign(f"refused/{self.rank}", reason.encode()))

    def refusal(self, rank: int) -> str | None:
        """Rank 0: why `rank` refused a message, if it said so (and it was `rank` that said it)."""
        try:
            if not self.store.check([f"refused/{rank}"]):
                return None
            body = self.secret.open(f"refused/{rank}", self.store.get(f"refused/{rank}"))
        except (RuntimeError, Refused):  # the store is gone, or another process wrote there
            return None
        return body.decode(errors="replace")[:REASON_CHARS]

    # ---- heartbeats ----------------------------------------------------------------------------------

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
