"""This host's link between tensor-parallel ranks, measured: all-reduces and step posts between local processes.

kvscope's ranks on one host are processes joined by torch.distributed (gloo on CPU, NCCL between GPUs:
backend/engine/tp_group.py). The cost model prices their link as any other (cost_model.link_costs): a
latency per all-reduce plus the bytes a rank sends in a ring over a bandwidth, and here also rank 0's
cost of posting each step's input to the other ranks through the store. All three are measured by a
ping through the engine's own TPGroup, so a time is taken as an `iteration` event's `allreduce.ms`
takes it: `world` local processes all-reduce messages of a few sizes (a decode step's few KB to a long
prefill's MBs), rank 0 keeps the median per size (a step meets the typical call, not the best one), and
t = latency + sent / bandwidth is fitted relative to t, so that the small messages, where a CPU link
spends its time, weigh as much as the large ones. Then rank 0 posts small step messages and times them.

Every all-reduce of the ping follows a burst of work on each rank (GAP_S of small matmuls), as a step's
all-reduces follow a layer's matmuls. Back to back, gloo's threads never sleep: on the 2-core
development VM a small all-reduce took ~0.1 ms that way, and ~0.35 ms after a burst of work, which
is what a step's all-reduces cost there (waking a thread on a virtual CPU is the price).

The figures are cached per backend and rank count (machine_cache.py: `link-gloo-2.json`);
`link_figures(recalibrate=True)` measures again. The other ranks run one thread each, as a
tensor-parallel engine started from one thread gives them.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist

from kvscope.backend.engine.tp_auth import RunSecret
from kvscope.backend.engine.tp_group import TPGroup, local_store
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.least_squares import nonnegative_least_squares
from kvscope.backend.perf.machine_cache import CACHE_VERSION, read_cache, write_cache
from kvscope.backend.perf.ring import ring_bytes_sent

DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # the backend kvscope's ranks use on each device type
# Messages in bytes: a decode step all-reduces tokens x hidden x 4 B (a few KB), a prefill up to MBs; a
# GPU gets larger ones, as its link only shows its bandwidth past a few MB.
SIZES = {"cpu": (256, 4 << 10, 64 << 10, 1 << 20, 4 << 20), "cuda": (64 << 10, 1 << 20, 16 << 20, 64 << 20)}
REPEATS = 40  # timed all-reduces per size, after WARMUP untimed ones
GAP_S = 2e-4  # the work before each all-reduce: a few small matmuls' worth
WARMUP = 5
POSTS = 100
POST_BYTES = 2048  # a step's JSON body (tp_wire.py) for a small batch
TIMEOUT_S = 60.0
LINK_FIGURES = ("backend", "world", "latency_s", "bandwidth", "step_post_s", "measured_at")
MODULE = "kvscope.backend.perf.link_calibrate"


def link_figures(backend: str = "gloo", world: int = 2, recalibrate: bool = False) -> dict:
    """The cached figures of this host's link between `world` local ranks, or a fresh measurement (saved)."""
    name = f"link-{backend}-{world}"
    cached = None if recalibrate else read_cache(name, LINK_FIGURES)
    if cached is not None:
        return cached
    figures = measure_link(backend, world)
    try:
        write_cache(figures, name)
    except OSError:
        pass  # the cache only saves seconds; a read-only home must not stop a what-if
    return figures


def measure_link(backend: str = "gloo", world: int = 2, repeats: int = REPEATS,
                 sizes: tuple[int, ...] | None = None) -> dict:
    """Ping `world` - 1 spawned processes from this one; the fitted link as a JSON-ready dict."""
    device = check_link(backend, world)
    sizes = sizes or SIZES[device]
    store, secret = local_store(world), RunSecret.new()
    env = {**os.environ, **secret.environ()}  # as the engine hands its ranks the secret: never on a command line
    peers = [subprocess.Popen([sys.executable, "-m", MODULE, str(store.port), str(rank), str(world), backend,
                               str(repeats), *map(str, sizes)], env=env) for rank in range(1, world)]
    try:
        group = TPGroup(dist.PrefixStore(secret.namespace(), store), 0, world, rank_device(device, 0), TIMEOUT_S,
                        secret)
        seconds = ping(group, sizes, repeats)
        post_s = time_posts(group)
    except BaseException as e:  # a peer that died, a timeout, Ctrl-C: the others would wait for the timeout
        dead = [f"rank {r} exited with status {p.poll()}" for r, p in enumerate(peers, 1) if p.poll() is not None]
        for p in peers:
            p.kill()
        if isinstance(e, RuntimeError):
            raise PerfError("link", f"the {backend} ping failed: {'; '.join(dead) or str(e).splitlines()[0]}") from None
        raise
    finally:
        stop(peers)
    latency, bandwidth = fit_link(list(zip(sizes, seconds, strict=True)), world)
    return {"version": CACHE_VERSION, "host": platform.node(), "backend": backend, "world": world,
            "latency_s": latency, "bandwidth": bandwidth, "step_post_s": post_s,
            "samples": [[size, s] for size, s in zip(sizes, seconds, strict=True)],
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def check_link(backend: str, world: int) -> str:
    """The device type of the backend, once this host can run `world` ranks of it."""
    if backend not in DEVICES:
        raise PerfError("link", f"unknown local link {backend!r}; valid: {', '.join(DEVICES)}")
    if world < 2:
        raise PerfError("tp", f"a link joins at least 2 ranks, got {world}")
    if DEVICES[backend] == "cuda" and torch.cuda.device_count() < world:
        raise PerfError("link", f"nccl between {world} ranks needs {world} GPUs (one each); this host has "
                                f"{torch.cuda.device_count()}")
    return DEVICES[backend]


def rank_device(device: str, rank: int) -> torch.device:
    """A rank's device: GPU `rank` on CUDA, made current (NCCL binds its group to the current device)."""
    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def ping(group: TPGroup, sizes: tuple[int, ...], repeats: int) -> list[float]:
    """Every rank: all-reduce a message of each size `repeats` times; rank 0's median seconds per size."""
    medians = []
    for size in sizes:
        x = torch.zeros(size // 4, device=group.device)  # zeros: summing in place never overflows
        for _ in range(WARMUP):
            group.all_reduce(x)
        group.stats.take()
        times = []
        for _ in range(repeats):
            work(GAP_S)
            group.all_reduce(x)
            times.append(group.stats.take()["ms"] / 1e3)
        medians.append(statistics.median(times))
    return medians


def work(seconds: float) -> None:
    """Small matmuls on this thread for `seconds`: the layer a step computes before its all-reduce."""
    a = torch.ones(64, 64)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a @ a


def time_posts(group: TPGroup) -> float:
    """Rank 0: median seconds to post a step's input. Each post is followed by a one-element all-reduce,
    as a step's all-reduces follow its post: a rank must read a message before the next one replaces it."""
    token = torch.zeros(1, device=group.device)
    times = []
    for _ in range(POSTS):
        started = time.perf_counter()
        group.post(bytes(POST_BYTES))
        times.append(time.perf_counter() - started)
        group.all_reduce(token)
    group.post(b"")  # an empty body: the peers stop
    return statistics.median(times)


def fit_link(samples: list[tuple[int, float]], world: int) -> tuple[float, float]:
    """(latency_s, bandwidth) of t = latency + sent / bandwidth over (message bytes, seconds), least squares
    relative to t (each equation divided by its t), neither term negative."""
    rows = [(1 / t, ring_bytes_sent(m, world) / t) for m, t in samples]
    latency, per_byte = nonnegative_least_squares(rows, [1.0] * len(rows))
    return latency, 1 / max(per_byte, 1e-13)  # a flat line (every size latency-bound): 10 TB/s, not zero time


def stop(peers: list[subprocess.Popen]) -> None:
    for p in peers:
        try:
            p.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def peer(argv: list[str]) -> int:
    """A spawned rank: `python -m kvscope.backend.perf.link_calibrate PORT RANK WORLD BACKEND REPEATS SIZE...`."""
    port, rank, world, backend, repeats, *sizes = argv
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", int(port), int(world), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    secret = RunSecret.from_env(forget=True)
    group = TPGroup(dist.PrefixStore(secret.namespace(), store), int(rank), int(world),
                    rank_device(DEVICES[backend], int(rank)), TIMEOUT_S, secret)
    ping(group, tuple(int(s) for s in sizes), int(repeats))
    token = torch.zeros(1, device=group.device)
    while group.receive():
        group.all_reduce(token)
    return 0


if __name__ == "__main__":
    sys.exit(peer(sys.argv[1:]))
