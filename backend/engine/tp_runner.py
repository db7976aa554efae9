"""Rank 0 of a tensor-parallel engine: it starts the other ranks, hands each its shard, and runs the step.

`start_tensor_parallel` shards the model (model/sharding.py), opens a group (tp_group.py) either by
spawning world - 1 local processes (tp_worker.spawned_worker) or with the ranks torchrun started,
and sends every worker its shard as data: a spec saying how each layer is stored and the tensors
(model/shard_spec.py, tp_wire.py), never a pickled module. `TensorParallelRunner` is a ModelRunner
whose forward first posts the step's input to the workers (plain data, signed with the run's secret:
tp_auth.py): every rank then runs the same forward on its shard, and the all-reduces inside meet.
Rank 0 alone computes logits and samples.

A rank that dies, hangs or refuses a message fails the step: the collective raises (gloo's peer
closed, or the group's timeout), and the runner names the rank (a spawned process that exited, with
the reason it left on the store when it refused a message, or one whose heartbeat on the store
stopped), stops the rest, and raises RankFailed. The engine's run fails; the process that hosts it (a
server) goes on. `close` may come from another thread while a forward is under way (a server failing
a stalled run): the workers are killed then, and the forward's own thread closes the rest.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvscope.backend.engine.kv_cache import DTYPE_NAMES, KVCache, kv_dtype_name
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.step_input import StepInput
from kvscope.backend.engine.tp_auth import Refused, RunSecret, SecretMissing
from kvscope.backend.engine.tp_group import (HOST_CHARS, LOOPBACK, Link, RankFailed, TPGroup, local_store,
                                             torchrun_env, torchrun_link, torchrun_store)
from kvscope.backend.engine.tp_wire import Session, WorkerSpec, encode_session, encode_step
from kvscope.backend.engine.tp_worker import GROUP_FAILED, REFUSED
from kvscope.backend.errors import KvscopeError
from kvscope.backend.model.quant import weight_bytes
from kvscope.backend.model.shard_spec import describe_storage
from kvscope.backend.model.sharding import FIELD, ShardPlan, connect, shard_config, shard_model, shard_plan
from kvscope.backend.model.transformer import CausalLM

JOIN_S = 5.0  # how long a worker told to stop gets before it is killed
CLOSED = "this tensor-parallel engine was closed: its ranks are stopped"


@dataclass
class Ranks:
    """The other ranks' processes when kvscope spawned them (None under torchrun: torchrun owns them),
    and the store they met at: a spawned group's TCPStore (and its port) lives as long as the ranks."""

    processes: list[subprocess.Popen] | None
    store: dist.Store
    grace_s: float = JOIN_S  # how long a stopping worker gets before it is killed

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every spawned rank that has exited; a negative code is the signal."""
        return [(r + 1, p.poll()) for r, p in enumerate(self.processes or []) if p.poll() is not None]

    def kill(self) -> None:
        """Kill the spawned ranks now, from any thread (a collective waiting on them fails at once)."""
        for p in self.processes or []:
            if p.poll() is None:
                p.kill()

    def stop(self) -> None:
        for p in self.processes or []:
            try:
                p.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(JOIN_S)
        if self.processes is None:
            _torchrun["lock"].release()  # the next engine may open a session


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: the same forward as every worker's, after posting them the step's input."""

    def __init__(self, model: CausalLM, cache: KVCache, attention: str, group: TPGroup, ranks: Ranks,
                 layout: dict, batch_invariant: bool = False) -> None:
        # batch-invariant: rank 0 posts each token's forward as a step of its own, so every rank runs one row
        super().__init__(model, cache, attention, batch_invariant=batch_invariant)
        self.group, self.ranks, self.layout = group, ranks, layout
        self.failure: str | None = None
        self._busy = threading.Lock()  # held through a forward: a close from another thread must not pull the group
        self._finalizer = weakref.finalize(self, _close, group, ranks)  # an engine dropped unclosed frees its ranks

    @torch.no_grad()
    def forward(self, inp: StepInput) -> torch.Tensor:
        with self._busy:
            if self.failure is not None:
                raise RankFailed(self.failure)
            step = self.group.step
            try:
                self.group.post(encode_step(inp))  # the forward's fields only: workers need the batch, not its sampling
                return super().forward(inp)
            except RuntimeError as e:  # a collective (or the store) failed: find the rank, stop the others
                e.__traceback__ = None  # its frames hold the failed collective, which holds the group's sockets
                self.failure = self._diagnose(step, e)
                self.ranks.grace_s = 0.0  # a hung rank is not waited for
                self._finalizer()
                raise RankFailed(self.failure) from None

    def _diagnose(self, step: int, error: RuntimeError) -> str:
        silent = self.group.silent()  # first: the beats it waits for also give a killed rank time to be reaped
        dead = dict(self.ranks.dead())
        # A rank that lost a peer exits too (GROUP_FAILED): the one to name died of something else, or hangs.
        failed = [r for r, code in dead.items() if code != GROUP_FAILED]
        hung = [r for r in silent if r not in dead]
        if failed or not hung and dead:
            rank = (failed or list(dead))[0]
            code = dead[rank]
            if code == REFUSED:
                why = self.group.refusal(rank) or "it did not say why"
                return f"tensor-parallel rank {rank} refused step {step}: {why}"
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            return f"tensor-parallel rank {rank} {how} during step {step}"
        if hung:
            return (f"tensor-parallel rank {hung[0]} stopped answering during step {step} (its heartbeat stopped; "
                    f"collectives wait {self.layout['timeout_s']:g} s)")
        return f"a collective of step {step} failed: {(str(error).strip().splitlines() or [''])[0][:200]}"

    def allreduce_fields(self) -> dict:
        """The iteration event's `allreduce`: what this step's all-reduces moved and cost on rank 0."""
        return {"allreduce": self.group.stats.take()}

    def close(self) -> None:
        """Tell the workers to stop, and wait for them (killed after JOIN_S); then no forward runs. From another
        thread during a forward, kill the workers instead: the forward fails and its thread closes the rest."""
        if not self._busy.acquire(blocking=False):
            self.ranks.kill()
            return
        try:
            self.failure = self.failure or CLOSED
            self._finalizer()
        finally:
            self._busy.release()


def _close(group: TPGroup, ranks: Ranks) -> None:
    try:
        group.post(encode_step(None))
    except Exception:  # noqa: BLE001 - the store's host is gone: the workers stop on their own
        pass
    ranks.stop()
    group.pg = group.store = ranks.store = None  # the last references: the store's port and gloo's sockets close


def start_tensor_parallel(model: CausalLM, cache_args: dict, attention: str, device: torch.device,
                          world: int, timeout_s: float, batch_invariant: bool = False,
                          ) -> tuple[TensorParallelRunner, KVCache]:
    """Shard `model` over `world` ranks, start them, and return rank 0's runner and KV cache.

    cache_args: KVCache's arguments but the config (num_blocks, block_size, dtype, kv_dtype)."""
    config = model.config
    plans = [shard_plan(config, r, world) for r in range(world)]
    group, ranks = _open_group(world, device, timeout_s)
    layout_ranks, codes = [], {}
    try:
        for plan in plans[1:]:
            shard = shard_model(model, plan, codes)
            layout_ranks.append(_rank_layout(plan, shard, config, cache_args))
            group.send_shard(*_worker_spec(shard, plan, cache_args, attention), plan.rank)
            del shard
    except Exception:
        _close(group, ranks)
        raise
    own = shard_model(model, plans[0], codes).to(device)
    del codes
    try:  # the first step's time is the step's, not a worker still unpacking its shard
        hosts = _wait_for(group.store, "ready", group.secret, ranks, world, JOIN_TIMEOUT_S, "get ready", group)
    except RankFailed:
        _close(group, ranks)
        raise
    connect(own, group.all_reduce)
    cache = KVCache(shard_config(config, plans[0]), device=device, **cache_args)
    layout = {"size": world, "backend": group.backend, "launcher": "spawn" if ranks.processes is not None else "torchrun",
              "timeout_s": timeout_s, "embedding": "replicated", "lm_head": "rank 0",
              "kv_heads_replicated": plans[0].kv_replicated,
              "ranks": [_rank_layout(plans[0], own, config, cache_args), *layout_ranks]}
    for rank, host in zip(layout["ranks"], [group.host, *hosts], strict=True):
        rank["host"] = host
    return TensorParallelRunner(own, cache, attention, group, ranks, layout, batch_invariant), cache


def _worker_spec(shard: CausalLM, plan: ShardPlan, cache_args: dict, attention: str) -> tuple[bytes, bytes]:
    """(the spec's JSON, the state dict's bytes) for rank `plan.rank`: a description and tensors, no module."""
    buffer = io.BytesIO()
    torch.save(shard.state_dict(), buffer)
    state = buffer.getvalue()
    spec = WorkerSpec(config=shard.config, rank=plan.rank, world=plan.world, storage=describe_storage(shard),
                      dtype=DTYPE_NAMES[cache_args["dtype"]], num_blocks=cache_args["num_blocks"],
                      block_size=cache_args["block_size"], kv_dtype=cache_args["kv_dtype"], attention=attention,
                      state_bytes=len(state), state_sha256=hashlib.sha256(state).hexdigest())
    return spec.model_dump_json().encode(), state


def _rank_layout(plan: ShardPlan, shard: CausalLM, config, cache_args: dict) -> dict:
    """What the header says one rank holds."""
    kv_token = shard_config(config, plan).kv_bytes_per_token(kv_dtype_name(cache_args["kv_dtype"], cache_args["dtype"]))
    return {"rank": plan.rank, "heads": list(plan.heads), "kv_heads": list(plan.kv_heads),
            "intermediate": list(plan.intermediate), "weight_bytes": weight_bytes(shard),
            "kv_bytes_per_token": kv_token,
            "kv_bytes": kv_token * cache_args["block_size"] * cache_args["num_blocks"]}


# ---- opening a group ------------------------------------------------------------------------------

_torchrun = {"next": 0, "lock": threading.Lock()}  # torchrun's worker ranks serve one session at a time
JOIN_POLL_S = 0.05
JOIN_TIMEOUT_S = 120.0  # a rank's interpreter starting and importing torch, on a busy machine
WORKER = "kvscope.backend.engine.tp_worker"


def _open_group(world: int, device: torch.device, timeout_s: float) -> tuple[TPGroup, Ranks]:
    threads = max(1, torch.get_num_threads() // world)
    launched = torchrun_env()
    if launched is None:
        secret, link = RunSecret.new(), Link(LOOPBACK)
        store = local_store(world)
        ranks = Ranks(_spawn(store.port, world, secret, device), store)
        session = Session(0, device.type, timeout_s, threads)
    else:
        secret, link = _torchrun_secret(launched, world), torchrun_link()
        if not _torchrun["lock"].acquire(blocking=False):
            raise RankFailed("under torchrun one tensor-parallel engine runs at a time (its ranks serve one session)")
        store = torchrun_store()
        session, ranks = Session(_torchrun["next"], device.type, timeout_s, threads), Ranks(None, store)
        _torchrun["next"] += 1
        if session.number == 0:
            atexit.register(_end_sessions, dist.PrefixStore(secret.namespace(), store), secret)
    runs = dist.PrefixStore(secret.namespace(), store)
    key = f"session/{session.number}"
    runs.set(key, secret.sign(key, encode_session(session)))
    try:
        _wait_for(runs, f"{key}/joined", secret, ranks, world, JOIN_TIMEOUT_S, "join")
        return TPGroup(dist.PrefixStore(session.prefix(), runs), 0, world, device, timeout_s, secret, link), ranks
    except Exception:
        ranks.kill()
        ranks.stop()
        raise


def _spawn(port: int, world: int, secret: RunSecret, device: torch.device) -> list[subprocess.Popen]:
    """Ranks 1..world-1 as fresh interpreters; the secret in their environment, never on their command line."""
    env = {**os.environ, **secret.environ()}
    if device.type == "cuda":  # NCCL's bootstrap listens where NCCL_SOCKET_IFNAME says: here, loopback
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return [subprocess.Popen([sys.executable, "-m", WORKER, str(port), str(r), str(world), str(os.getpid())], env=env)
            for r in range(1, world)]


def _torchrun_secret(launched: tuple[int, int], world: int) -> RunSecret:
    rank, size = launched
    if rank != 0 or size != world:
        raise RankFailed(f"torchrun started {size} ranks (this is rank {rank}); tensor_parallel is {world}: "
                         "launch with --nproc-per-node (times nodes) equal to --tensor-parallel")
    try:
        return RunSecret.from_env()
    except SecretMissing as e:  # refused before the store is touched: the field, as any other bad setting
        raise KvscopeError(FIELD, f"under torchrun {e}") from None


def _end_sessions(runs: dist.Store, secret: RunSecret) -> None:
    """At rank 0's exit under torchrun: the workers' next session is `exit`."""
    key = f"session/{_torchrun['next']}"
    runs.set(key, secret.sign(key, encode_session(None)))


def _wait_for(store: dist.Store, prefix: str, secret: RunSecret, ranks: Ranks, world: int, timeout_s: float,
              what: str, group: TPGroup | None = None) -> list[str]:
    """Until every worker set f"{prefix}/{rank}", signed by that rank: a rank that exits first (a broken
    install, no memory, a message it refused: `group` has its reason) or never comes is named now, not
    after a collective's timeout; a value another process wrote there fails the start. Returns what each
    worker said there, in rank order, as printable text of at most HOST_CHARS (a ready rank: where it runs)."""
    deadline = time.monotonic() + timeout_s
    said = []
    for r in range(1, world):
        key = f"{prefix}/{r}"
        while not store.check([key]):
            for rank, code in ranks.dead():
                why = group.refusal(rank) if group is not None and code == REFUSED else None
                raise RankFailed(f"tensor-parallel rank {rank} exited with status {code} before it could {what}"
                                 + (f": it refused {why}" if why else ""))
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel rank {r} did not {what} within {timeout_s:g} s")
            time.sleep(JOIN_POLL_S)
        try:
            body = secret.open(key, store.get(key))
        except Refused as e:
            raise RankFailed(f"tensor-parallel rank {r} could not {what}: {e}") from None
        said.append("".join(c for c in body.decode("utf-8", "replace") if c.isprintable())[:HOST_CHARS])
    return said
