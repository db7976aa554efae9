"""A fuzzing class: tensor-parallel runs with a hostile store client (issue #35, points 1, 5 and 7).

A case starts a TP=2 scenario run on the live server, lets it take two steps, and then, as a process of
the same machine could, connects to the run's rendezvous store (its port is on the rank's command
line) and does one to three hostile things (fuzz_cases.STORE_ATTACKS): plant a pickle that opens a file
where rank 1 reads its next step (the issue's attack), junk or a forged frame there, replay the current
step's value at the next key, delete keys, flood the store with keys or one large value, write garbage
on its socket, connect from another address of this machine. Then the run goes on to its end.

What must hold after each case, besides fuzz.py's checks after every case (the server lives, the api
run serves a normal request and holds no block once idle, no other run failed, RSS bounded):
- no code ran in a rank: the planted pickle's file does not exist;
- a connection to the store from an address other than loopback is refused;
- the case's run finished, or failed naming a rank (a clean failure), within CASE_S;
- its ranks are gone within RELEASE_S of its end (point 5);
- once the run is forgotten (DELETE), the server's resident memory and its children's are back within
  RSS_MB of what they were before the case.
"""

from __future__ import annotations

import json
import pickle
import re
import socket
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import httpx
import torch.distributed as dist

from bench.soak import rss_mb

CASE_S = 120.0  # the run's start (a rank process importing torch), its steps, and its end
RELEASE_S = 15.0
RSS_MB = 100.0
TP_SCENARIO = {"name": "fuzz-tp", "model": "demo", "seed": 0,
               "engine": {"tensor_parallel": 2, "tensor_parallel_timeout_s": 20, "block_size": 4, "num_blocks": 64},
               "requests": [{"id": "a", "prompt": "ROMEO:", "max_tokens": 12,
                             "sampling": {"temperature": 0, "ignore_eos": True}}]}
FLOOD_KEYS, LARGE_BYTES = 2000, 8 << 20


class Opens:
    """Unpickled, this opens (creates) a file; its pickle names only builtins.open, so any process loads it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def hostile_store_case(client: httpx.Client, server_pid: int, body: str) -> str:
    """One case: its answer ("finished", "refused"), or "broke: ..." naming the invariant it broke."""
    spec = json.loads(body)
    rss_before = tree_rss_mb(server_pid)
    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "opened-by-a-rank"
        started = client.post("/api/runs", json={"scenario": TP_SCENARIO, "paused": True})
        if started.status_code != 201:
            return f"broke: the TP run did not start ({started.status_code}: {started.text[:200]})"
        run_id = started.json()["run_id"]
        try:
            answer = _attack_run(client, server_pid, run_id, spec, marker)
        finally:
            client.delete(f"/api/runs/{run_id}")
        if answer.startswith("broke"):
            return answer
        if marker.exists():
            return "broke: a rank unpickled the planted value (its file exists)"
    if not _within(RELEASE_S, lambda: not ranks_of(server_pid)):
        return "broke: the forgotten run's ranks are still running"
    if not _within(RELEASE_S, lambda: tree_rss_mb(server_pid) <= rss_before + RSS_MB):
        return f"broke: RSS {tree_rss_mb(server_pid):.0f} MB after the run was forgotten, {rss_before:.0f} before"
    return answer


def _attack_run(client: httpx.Client, server_pid: int, run_id: str, spec: dict, marker: Path) -> str:
    if not _within(CASE_S, lambda: ranks_of(server_pid)):
        return "broke: the run's rank never started"
    [(rank_pid, port)] = ranks_of(server_pid)
    client.post(f"/api/runs/{run_id}/control", json={"action": "step", "value": 2})
    if not _within(CASE_S, lambda: client.get(f"/api/runs/{run_id}").json()["step"] >= 1):
        return "broke: the run did not take its two steps"
    refused = attack(port, spec["attacks"], bytes.fromhex(spec["junk"]), marker)
    if refused:
        return refused
    client.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
    if not _within(CASE_S, lambda: client.get(f"/api/runs/{run_id}").json()["finished"]):
        return f"broke: the run neither finished nor failed within {CASE_S:g} s"
    snapshot = client.get(f"/api/runs/{run_id}").json()
    if not _within(RELEASE_S, lambda: not ranks_of(server_pid)):
        return f"broke: rank {rank_pid} still runs {RELEASE_S:g} s after its run ended"
    if not snapshot["failed"]:
        return "finished"
    error = snapshot.get("error") or ""
    if "RankFailed: tensor-parallel rank 1 refused" not in error:
        return f"broke: the run failed, not by a rank's refusal: {error[:300]}"
    return "refused"


def attack(port: int, attacks: list[str], junk: bytes, marker: Path) -> str | None:
    """Do `attacks` to the store at `port`; "broke: ..." when the store lets in what it must refuse."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    steps = [(m[1], int(m[2])) for key in store.list_keys() if (m := re.fullmatch(r"(.*step/)(\d+)", key))]
    prefix, last = max(steps, key=lambda step: step[1])
    current, following = f"{prefix}{last}", f"{prefix}{last + 1}"
    for action in attacks:
        if action == "pickle at the next step":
            store.set(following, pickle.dumps(Opens(marker)))
        elif action == "junk at the next step":
            store.set(following, junk)
        elif action == "a forged frame at the next step":
            store.set(following, b"kvscope-tp1" + bytes(32) + b'{"stop":true}')
        elif action == "the current step replayed at the next":
            store.set(following, store.get(current))
        elif action == "the current step deleted":
            store.delete_key(current)
        elif action == "a flood of keys":
            store.multi_set([f"fuzz/{i}" for i in range(FLOOD_KEYS)], [junk] * FLOOD_KEYS)
        elif action == "a large value":
            store.set("fuzz/large", bytes(LARGE_BYTES))
        elif action == "garbage on the store's socket":
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(junk + bytes(range(256)))
        elif action == "a connection from another address":
            address = other_address()
            if address is not None and _connects(address, port):
                return f"broke: the store accepted a connection on {address}"
        else:
            raise ValueError(f"unknown attack {action!r}")
    return None


def ranks_of(server_pid: int) -> list[tuple[int, int]]:
    """(pid, store port) of each tensor-parallel rank the server spawned (`tp_worker PORT RANK WORLD PARENT`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        module = next((i for i, a in enumerate(argv) if a.endswith(b"tp_worker")), None)
        if ppid == server_pid and module is not None:
            found.append((int(proc.name), int(argv[module + 1])))
    return found


def tree_rss_mb(pid: int) -> float:
    """The resident memory of a process and of the ranks it spawned."""
    total = rss_mb(pid)
    for child, _ in ranks_of(pid):
        try:
            total += rss_mb(child)
        except (OSError, RuntimeError):  # it ended since it was listed
            pass
    return total


def other_address() -> str | None:
    """An IPv4 address of this machine's own network namespace other than loopback (eth0's), or None."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((a for a in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out) if not a.startswith("127.")), None)


def _connects(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
    except OSError:
        return False
    return True


def _within(seconds: float, condition) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
