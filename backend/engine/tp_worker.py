"""A tensor-parallel worker: ranks 1..N-1, each running its shard of every forward rank 0 asks for.

Rank 0 (tp_runner.py) hosts the scheduler, the block manager, the sampler and the events; a worker
holds only its shard of the weights and its share of the KV pool, and loops: read the step's input
from the store, run the forward (the same ModelRunner as rank 0, its all-reduces meeting rank 0's).
The block table in each input drives every rank's pool alike. A thread beats on the store meanwhile,
so rank 0 can tell a hung rank from a waiting one.

What a worker trusts: nothing it reads unless signed with the run's secret (tp_auth.py), and then
only plain data of the right shape (tp_wire.py). It builds its shard itself from a description and
loads tensors only (model/shard_spec.py, `torch.load(weights_only=True)`). A message that fails a
check stops the worker (REFUSED), its reason left signed on the store for rank 0 to report.

Sessions: a worker kvscope spawned serves one engine and exits. Under torchrun the worker processes
outlive engines (a server makes a new one per run), so they serve one session after another, each
opened by rank 0 under its own store prefix, until rank 0 says `exit`.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.tp_auth import Refused, RunSecret, SecretMissing
from kvscope.backend.engine.tp_group import (HEARTBEAT_S, LOOPBACK, STORE_TIMEOUT, WAIT_FOREVER, Link, TPGroup,
                                             torchrun_env, torchrun_link, torchrun_store)
from kvscope.backend.engine.tp_wire import Pool, Session, WorkerSpec, decode_session, decode_spec, decode_step
from kvscope.backend.model.shard_spec import DTYPES, ShardError, build_shard, load_shard
from kvscope.backend.model.sharding import connect, shard_config, shard_plan

PARENT_POLL_S = 0.2
GROUP_FAILED = 3  # a worker's exit status when it stopped because the group failed, not by its own fault
REFUSED = 4  # a worker's exit status when it refused a message (unsigned, or not the data it must be)


def spawned_worker(argv: list[str]) -> int:
    """A rank kvscope spawned on this machine: `python -m kvscope.backend.engine.tp_worker PORT RANK WORLD PARENT`,
    the run's secret in its environment (tp_auth.SECRET_ENV), never on its command line.

    A fresh interpreter (not multiprocessing's spawn, which re-runs the parent's main script: a user's
    script without a __main__ guard would start a second engine)."""
    port, rank, world, parent = (int(a) for a in argv)
    _die_with_parent(parent)
    secret = RunSecret.from_env(forget=True)
    store = dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=STORE_TIMEOUT)
    return serve_sessions(store, rank, world, secret, Link(LOOPBACK), once=True)


def torchrun_worker() -> NoReturn:
    """The entry point of ranks 1..N-1 under torchrun (the CLI calls it instead of the command)."""
    rank, world = torchrun_env()
    try:
        secret = RunSecret.from_env(forget=True)
    except SecretMissing as e:
        print(f"kvscope rank {rank}: under torchrun {e}", file=sys.stderr, flush=True)
        exit_now(2)
    exit_now(serve_sessions(torchrun_store(), rank, world, secret, torchrun_link(), once=False))


def serve_sessions(store: dist.Store, rank: int, world: int, secret: RunSecret, link: Link, once: bool) -> int:
    """Serve rank 0's sessions on `store` (all under the run's namespace); the process's exit status."""
    runs = dist.PrefixStore(secret.namespace(), store)
    number = 0
    while True:
        key = f"session/{number}"
        runs.wait([key], WAIT_FOREVER)
        try:
            session = decode_session(secret.open(key, runs.get(key)), number)
        except Refused as e:
            _stop(rank, f"refused session {number}: {e}", REFUSED)
        if session is None:
            return 0
        runs.set(f"{key}/joined/{rank}", secret.sign(f"{key}/joined/{rank}", b""))  # rank 0 checks these first
        run_session(dist.PrefixStore(session.prefix(), runs), rank, world, session, secret, link)
        if once:
            return 0
        number += 1


def run_session(store: dist.Store, rank: int, world: int, session: Session, secret: RunSecret, link: Link) -> None:
    """One engine's forwards on this rank, until rank 0 ends the session; the process exits on any failure."""
    torch.set_num_threads(session.threads)
    device = torch.device("cpu")
    if session.device == "cuda":  # one GPU a rank: torchrun's local rank, or the rank on one machine
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)  # NCCL binds the group to the current device
    group = None
    try:
        group = TPGroup(store, rank, world, device, session.timeout_s, secret, link)
        runner, pool = receive_shard(group, device)
        group.store.set(f"ready/{rank}", secret.sign(f"ready/{rank}", group.host.encode()))  # where it runs
        serve_steps(group, runner, pool)
    except (Refused, ShardError) as e:  # a message this rank will not act on: rank 0 reports why
        if group is not None:
            _tell(group, str(e))
        _stop(rank, f"refused: {e}", REFUSED)
    except Exception as e:  # the group failed (a rank or rank 0 left): rank 0 reports it; this rank says why it stops
        _stop(rank, f"stopped: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}", GROUP_FAILED)


def receive_shard(group: TPGroup, device: torch.device) -> tuple[ModelRunner, Pool]:
    """Build this rank's shard from rank 0's spec and tensors (checked, never unpickled), and its KV pool."""
    body, state_bytes = group.recv_shard()
    spec: WorkerSpec = decode_spec(body, group.rank, group.world)
    if len(state_bytes) != spec.state_bytes or hashlib.sha256(state_bytes).hexdigest() != spec.state_sha256:
        raise Refused("the shard's tensors are not the ones its spec names (their SHA-256 differs)")
    plan = shard_plan(spec.config, spec.rank, spec.world)
    skeleton = build_shard(spec.config, plan, spec.storage, DTYPES[spec.dtype])
    state = load_tensors(state_bytes, device)
    del state_bytes
    model = load_shard(skeleton, state, device)
    connect(model, group.all_reduce)
    dtype = DTYPES[spec.dtype]
    cache = KVCache(shard_config(spec.config, plan), spec.num_blocks, spec.block_size, dtype, device, spec.kv_dtype)
    return ModelRunner(model, cache, spec.attention), Pool(spec.num_blocks, spec.block_size, spec.config.vocab_size)


def load_tensors(data: bytes, device: torch.device) -> dict[str, torch.Tensor]:
    """A state dict saved by torch.save, loaded as tensors only: weights_only's unpickler builds tensors and
    plain containers and refuses every other object, so no bytes run code here (Refused naming the failure)."""
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location=device)
    except Exception as e:  # noqa: BLE001 - an UnpicklingError for a forbidden object, or not a torch file at all
        raise Refused(f"the shard's tensors do not load as tensors only ({type(e).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise Refused("the shard's tensors are not a state dict")
    return state


def serve_steps(group: TPGroup, runner: ModelRunner, pool: Pool) -> None:
    """Run each step rank 0 posts, until it ends the session; a heartbeat thread beats meanwhile."""
    beating = threading.Event()
    heart = threading.Thread(target=_heartbeat, args=(group, beating), daemon=True)
    heart.start()
    try:
        while (inp := decode_step(group.receive(), pool)) is not None:
            runner.forward(inp)
    finally:
        beating.set()
        heart.join()  # not left inside a store call while the store and the group are torn down


def _tell(group: TPGroup, reason: str) -> None:
    try:
        group.say_refused(reason)
    except Exception:  # noqa: BLE001 - the store is gone: this rank's stderr still says why
        pass


def _stop(rank: int, why: str, status: int) -> NoReturn:
    """Say why on stderr and end the process at once: the group's destructors, with a peer gone, may hang."""
    print(f"kvscope rank {rank}: {why}", file=sys.stderr, flush=True)
    exit_now(status)


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


def exit_now(status: int) -> NoReturn:
    """End a worker process without the interpreter's teardown, whose order of C++ destructors (the store,
    gloo's threads) can abort it (SIGABRT) and hide its status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(spawned_worker(sys.argv[1:]))
