"""A tensor-parallel worker: ranks 1..N-1, each running its shard of every forward rank 0 asks for.

Rank 0 (tp_runner.py) hosts the scheduler, the block manager, the sampler and the events; a worker
holds only its shard of the weights (sharding.py) and its share of the KV pool, and loops: read the
step's input from the store, run the forward (the same ModelRunner as rank 0, its all-reduces meeting
rank 0's). The block table in each input drives every rank's pool alike. A thread beats on the store
meanwhile, so rank 0 can tell a hung rank from a waiting one.

Sessions: a worker kvscope spawned serves one engine and exits. Under torchrun the worker processes
outlive engines (a server makes a new one per run), so they serve one session after another, each
opened by rank 0 under its own store prefix, until rank 0 says `exit`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from kvscope.backend.config import ModelConfig
from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.tp_group import HEARTBEAT_S, WAIT_FOREVER, TPGroup, torchrun_env, torchrun_store
from kvscope.backend.model.sharding import connect
from kvscope.backend.model.transformer import CausalLM

SESSIONS = "kvscope/session"  # the store key of session n is f"{SESSIONS}/{n}"
PARENT_POLL_S = 0.2
GROUP_FAILED = 3  # a worker's exit status when it stopped because the group failed, not by its own fault


@dataclass(frozen=True)
class Session:
    """How rank 0 opens a session: the store prefix, the device type, the collective timeout, threads."""

    number: int
    device: str
    timeout_s: float
    threads: int

    def prefix(self) -> str:
        return f"{SESSIONS}/{self.number}/"


@dataclass
class WorkerSpec:
    """What rank 0 sends a worker once: its shard, and the KV pool it allocates (the same block count)."""

    model: CausalLM
    cache_config: ModelConfig  # the shard's heads (sharding.shard_config)
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: str
    attention: str


def spawned_worker(argv: list[str]) -> int:
    """A rank kvscope spawned on this machine: `python -m kvscope.backend.engine.tp_worker PORT RANK WORLD PARENT`.

    A fresh interpreter (not multiprocessing's spawn, which re-runs the parent's main script: a user's
    script without a __main__ guard would start a second engine)."""
    port, rank, world, parent = (int(a) for a in argv)
    _die_with_parent(parent)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    return serve_sessions(store, rank, world, once=True)


def torchrun_worker() -> NoReturn:
    """The entry point of ranks 1..N-1 under torchrun (the CLI calls it instead of the command)."""
    rank, world = torchrun_env()
    exit_now(serve_sessions(torchrun_store(), rank, world, once=False))


def serve_sessions(store: dist.Store, rank: int, world: int, once: bool) -> int:
    number = 0
    while True:
        key = f"{SESSIONS}/{number}"
        store.wait([key], WAIT_FOREVER)
        session = store.get(key).decode()
        if session == "exit":
            return 0
        device, timeout_s, threads = session.split()
        store.set(f"{key}/joined/{rank}", "")  # rank 0 waits for these before it builds the group
        try:
            run_session(store, rank, world, Session(number, device, float(timeout_s), int(threads)))
        except Exception as e:  # the group failed (a rank or rank 0 left): rank 0 reports it; this rank says why it stops
            print(f"kvscope rank {rank}: stopped: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
                  file=sys.stderr, flush=True)
            exit_now(GROUP_FAILED)
        if once:
            return 0
        number += 1


def run_session(store: dist.Store, rank: int, world: int, session: Session) -> None:
    torch.set_num_threads(session.threads)
    device = torch.device("cpu")
    if session.device == "cuda":  # one GPU a rank: torchrun's local rank, or the rank on one machine
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)  # NCCL binds the group to the current device
    group = TPGroup(dist.PrefixStore(session.prefix(), store), rank, world, device, session.timeout_s)
    spec: WorkerSpec = group.recv_object(0)
    model = spec.model.to(device)
    connect(model, group.all_reduce)
    cache = KVCache(spec.cache_config, spec.num_blocks, spec.block_size, spec.dtype, device, spec.kv_dtype)
    runner = ModelRunner(model, cache, spec.attention)
    group.store.set(f"ready/{rank}", "")
    beating = threading.Event()
    heart = threading.Thread(target=_heartbeat, args=(group, beating), daemon=True)
    heart.start()
    try:
        while (inp := group.receive()) is not None:
            runner.forward(inp)
    finally:
        beating.set()
        heart.join()  # not left inside a store call while the store and the group are torn down


def _heartbeat(group: TPGroup, stop: threading.Event) -> None:
    """Count up on the store while this process runs: a rank that is stopped or wedged stops counting,
    which is how rank 0 tells it from a rank that only waits in the same failed collective."""
    while not stop.wait(HEARTBEAT_S):
        try:
            group.beat()
        except Exception:  # noqa: BLE001 - the store went with rank 0: the step loop ends on its own
            return


def _die_with_parent(parent: int) -> None:
    """This process ends when the one that spawned it does (even by SIGKILL), so no rank outlives its engine's
    process to hold memory or a port. Watched, not PR_SET_PDEATHSIG: that fires when the parent *thread*
    ends, and a server builds its engines on threads that come and go."""
    def watch() -> None:
        while os.getppid() == parent:  # an orphan is re-parented (to init, or a subreaper)
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def exit_now(status: int) -> None:
    """End a worker process without the interpreter's teardown, whose order of C++ destructors (the store,
    gloo's threads) can abort it (SIGABRT) and hide its status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(spawned_worker(sys.argv[1:]))
