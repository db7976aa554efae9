"""A tensor-parallel rank that dies or hangs fails its run by name, and nothing outlives it.

Ranks are real processes here (gloo on 127.0.0.1): a test kills or stops one with a signal, as the
kernel's OOM killer or a wedged driver would, and checks what the user is told, that the other ranks
are gone, and that no port stays bound. Every wait is bounded.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.tp_auth import SECRET_ENV
from kvscope.backend.engine.tp_group import RankFailed
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import app_client, in_process, wait_for

WAIT_S = 30.0


def listening_ports(pid: int | None = None) -> set[int]:
    """The TCP ports process `pid` (default: this one) listens on."""
    return {port for _, port in listening(pid or os.getpid())}


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (IPv4; IPv6 addresses as hex)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                address, port = fields[1].split(":")
                ip = socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address
                found.add((ip, int(port, 16)))
    return found


def rank_pids(parent: int) -> list[int]:
    """Processes whose parent is `parent` and that run a tensor-parallel worker."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == parent and b"tp_worker" in cmdline:
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("sig, world, victim, says", [
    (signal.SIGKILL, 2, 1, "tensor-parallel rank 1 was killed by signal 9 during step 3"),
    (signal.SIGSTOP, 2, 1, "tensor-parallel rank 1 stopped answering during step 3"),
    # the ranks that lose a peer exit too: the one named is the one that failed
    (signal.SIGKILL, 4, 3, "tensor-parallel rank 3 was killed by signal 9 during step 3"),
    (signal.SIGSTOP, 4, 2, "tensor-parallel rank 2 stopped answering during step 3"),
])
def test_a_rank_that_dies_or_hangs_fails_the_step_naming_it_and_frees_the_rest(demo, sig, world, victim, says):
    before = listening_ports()
    engine = Engine(demo, EngineConfig(tensor_parallel=world, tensor_parallel_timeout_s=3, events="off"))
    engine.add_request("long", "ROMEO:\n", 500, SamplingParams(temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    workers = engine.executor.runner.ranks.processes
    os.kill(workers[victim - 1].pid, sig)
    with pytest.raises(RankFailed, match=says):
        for _ in range(100):
            engine.step()
    assert all(p.poll() is not None for p in workers), "every other rank is stopped (a stopped one killed)"
    with pytest.raises(RankFailed, match=says):
        engine.step()  # the engine stays failed: no step runs on half a model
    engine.close()
    wait_for(lambda: listening_ports() <= before, "the group's ports closed")


def test_closing_an_engine_stops_its_ranks_and_closes_its_ports(demo):
    before = listening_ports()
    engine = Engine(demo, EngineConfig(tensor_parallel=2, events="off"))
    assert listening_ports() - before, "the store and gloo listen while the ranks run"
    workers = engine.executor.runner.ranks.processes
    engine.close()
    engine.close()  # twice is fine
    assert [p.poll() for p in workers] == [0], "told to stop, the ranks exit cleanly"
    wait_for(lambda: listening_ports() <= before, "the group's ports closed")


def test_ranks_outlive_the_thread_that_started_them(demo):
    """A server builds engines on threads that end (a loader, a run's worker): the ranks are the process's."""
    built: list[Engine] = []
    starter = threading.Thread(target=lambda: built.append(Engine(demo, EngineConfig(tensor_parallel=2, events="off"))))
    starter.start()
    starter.join()
    [engine] = built
    # Gone from the kernel too: a death signal tied to the thread (PR_SET_PDEATHSIG) has been sent by now.
    wait_for(lambda: not Path(f"/proc/self/task/{starter.native_id}").exists(), "the starting thread ended")
    workers = engine.executor.runner.ranks.processes
    engine.add_request("a", "ROMEO:\n", 4, SamplingParams(temperature=0))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert [p.poll() for p in workers] == [0], "no rank was killed: each exited when told to stop"


def test_a_served_run_whose_rank_dies_fails_and_the_server_serves_the_next_run():
    manager = RunManager(default_model="demo")
    client = app_client(manager)
    scenario = {"name": "tp", "model": "demo", "seed": 0,
                "engine": {"tensor_parallel": 2, "tensor_parallel_timeout_s": 3, "num_blocks": 64},
                "requests": [{"id": "r", "prompt": "ROMEO:\n", "max_tokens": 40,
                              "sampling": {"temperature": 0, "ignore_eos": True}}]}
    with client:
        run_id = client.post("/api/runs", json={"scenario": scenario, "paused": True}).json()["run_id"]
        wait_for(lambda: rank_pids(os.getpid()), "the run's rank started")
        [pid] = rank_pids(os.getpid())
        os.kill(pid, signal.SIGKILL)
        client.post(f"/api/runs/{run_id}/control", json={"action": "resume"})
        wait_for(lambda: client.get(f"/api/runs/{run_id}").json()["failed"], "the run failed")
        error = client.get(f"/api/runs/{run_id}").json()["error"]
        assert "RankFailed: tensor-parallel rank 1 was killed by signal 9" in error
        again = {**scenario, "engine": {"num_blocks": 64}}
        next_id = client.post("/api/runs", json={"scenario": again, "speed": 0}).json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{next_id}").json()["finished"], "the next run finished")
        assert not client.get(f"/api/runs/{next_id}").json()["failed"]
        assert client.get("/api/runs").status_code == 200
    manager.stop_all()


def test_sigterm_stops_every_rank_of_a_command(tmp_path):
    """`kvscope run` killed by SIGTERM (a container stopping): its ranks die with it (each watches its parent)."""
    scenario = tmp_path / "long.yaml"
    scenario.write_text("name: long\nmodel: demo\nengine: {tensor_parallel: 2, num_blocks: 128}\n"
                        "requests:\n  - {id: r, prompt: 'ROMEO:', max_tokens: 1000, "
                        "sampling: {temperature: 0, ignore_eos: true}}\n")
    cmd = subprocess.Popen([sys.executable, "-m", "kvscope", "run", str(scenario)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        wait_for(lambda: rank_pids(cmd.pid), "the rank started")
        [rank] = rank_pids(cmd.pid)
        cmd.send_signal(signal.SIGTERM)
        cmd.wait(WAIT_S)
        wait_for(lambda: not Path(f"/proc/{rank}").exists() or
                   Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", "the rank is gone")
    finally:
        cmd.kill()
        cmd.wait()


def kvscope(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize("command, says", [
    (["generate", "--prompt", "hi", "--tensor-parallel", "0"], "--tensor-parallel: Input should be greater than or "
                                                                "equal to 1"),
    (["generate", "--prompt", "hi", "--tensor-parallel", "3"], "--tensor-parallel: 3 does not divide the model's 8 "
                                                                "attention heads"),
    (["generate", "--prompt", "hi", "--tensor-parallel", "65"], "--tensor-parallel: Input should be less than or "
                                                                 "equal to 64"),
    (["serve", "--no-ui", "--port", "8791", "--tensor-parallel", "16"], "--tensor-parallel 16: 16 does not divide"),
    (["run", "continuous-batching", "--tensor-parallel", "-2"], "--tensor-parallel -2"),
])
def test_bad_tensor_parallel_values_are_one_line_errors_naming_the_constraint(command, says):
    done = kvscope(*command)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def torchrun(args: list[str], env: dict) -> subprocess.CompletedProcess:
    launcher = Path(sys.executable).with_name("torchrun")
    launcher = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", "-m", "kvscope", *args,
                           "--tensor-parallel", "2"], capture_output=True, text=True, timeout=180, env=env)


def test_torchrun_launches_the_same_engine(tmp_path):
    """Every rank runs the command under torchrun; rank 0 runs it, the others serve it: same tokens as TP=1.
    The launch sets the run's secret for every rank (docs/engine.md, "Launching")."""
    args = ["generate", "--prompt", "ROMEO:", "--temperature", "0", "--max-tokens", "12"]
    alone = kvscope(*args)
    ranked = torchrun(args, {**os.environ, SECRET_ENV: secrets.token_hex(16)})
    assert ranked.returncode == 0, ranked.stderr[-2000:]
    assert ranked.stdout == alone.stdout and alone.stdout.strip()


def test_torchrun_without_the_runs_secret_is_refused_saying_how_to_set_it():
    """torchrun's store listens where torchrun puts it, for anyone who reaches it: without a secret to sign
    with, no rank acts on what it reads there, and the launch stops before any step, saying why."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    ranked = torchrun(["generate", "--prompt", "ROMEO:", "--max-tokens", "2"], env)
    assert ranked.returncode != 0
    # whichever rank comes first says it (torchrun then stops the other): rank 0 as the flag's error, a worker
    # as its one line
    assert f"under torchrun {SECRET_ENV} is not set" in ranked.stderr, ranked.stderr[-3000:]
    assert "secrets.token_hex(16)" in ranked.stderr


@pytest.mark.parametrize("engine, field, says", [
    ({"tensor_parallel": 9}, "engine.tensor_parallel", "9 ranks; this server starts at most 4 for a run"),
    ({"tensor_parallel": 3}, "engine.tensor_parallel", "3 does not divide the model's 8 attention heads"),
    ({"tensor_parallel": 0}, "engine.tensor_parallel", "greater than or equal to 1"),
    ({"tensor_parallel": "two"}, "engine.tensor_parallel", "valid integer"),
    ({"tensor_parallel": 2, "num_blocks": None, "kv_cache_memory_mb": 1e6}, "engine.kv_cache_memory_mb", "KV cache"),
])
def test_a_served_run_past_the_rank_limit_or_the_model_is_a_400_before_any_process(engine, field, says):
    from kvscope.backend.server.limits import ServiceLimits

    manager = RunManager(default_model="demo", limits=ServiceLimits(max_tensor_parallel=4, max_kv_memory_mb=512))
    client = app_client(manager)
    scenario = {"name": "tp", "model": "demo", "engine": engine, "requests": [{"id": "r", "prompt": "hi"}]}
    with client:
        refused = client.post("/api/runs", json={"scenario": scenario})
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
        assert refused.json()["field"].endswith(field)
        assert not rank_pids(os.getpid())
        assert client.get("/api/runs").status_code == 200
    manager.stop_all()


def test_the_other_ranks_weight_shards_count_against_the_servers_weight_memory():
    """Ranks 1.. hold their shards in their own processes: a copy of the run's alone, sized before any
    process starts, refused past --max-weight-memory-mb, listed by /api/limits while the run is held."""
    from kvscope.backend.scenario import validate
    from kvscope.backend.server.limits import ServiceLimits, weight_needs

    def scenario(ranks: int) -> dict:
        return {"name": "tp", "model": "demo", "engine": {"tensor_parallel": ranks},
                "requests": [{"id": "r", "prompt": "hi", "max_tokens": 2}]}

    tp = validate(scenario(2), "tp")
    model, shards = weight_needs(tp.model, tp.engine)
    assert shards.field == "engine.tensor_parallel" and shards.key.shards_of
    assert 0.5 < shards.bytes / model.bytes < 0.6  # half of every layer; the embedding whole (docs/engine.md)
    assert weight_needs(tp.model, tp.engine)[1].key != shards.key  # no two runs share them
    mb = 1024**2
    tight = RunManager(default_model="demo", limits=ServiceLimits(max_weight_memory_mb=1.2 * model.bytes / mb))
    with in_process(tight) as client:
        refused = client.post("/api/runs", json={"scenario": scenario(2)})
        assert refused.status_code == 400 and refused.json()["field"] == "engine.tensor_parallel", refused.text
        assert "the other tensor-parallel ranks' shards" in refused.json()["error"]
        assert not rank_pids(os.getpid())
        assert client.post("/api/runs", json={"scenario": scenario(1)}).status_code == 201
    roomy = RunManager(default_model="demo", limits=ServiceLimits(max_weight_memory_mb=2 * model.bytes / mb))
    with in_process(roomy) as client:
        started = client.post("/api/runs", json={"scenario": scenario(2), "paused": True})
        assert started.status_code == 201, started.text
        run_id = started.json()["run_id"]
        copies = client.get("/api/limits").json()["weight_copies"]
        assert [c["rank_shards"] for c in copies] == [False, True] and copies[1]["runs"] == 1
        assert copies[1]["bytes"] == shards.bytes
        assert client.post(f"/api/runs/{run_id}/control", json={"action": "resume"}).status_code in (200, 201)
