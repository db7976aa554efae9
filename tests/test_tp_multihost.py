"""Tensor-parallel ranks on separate hosts, run for real: two network namespaces of this machine, joined by a
veth pair, each with its own address, stand for two hosts on one link. torchrun's rendezvous runs over
that link and gloo's pairs listen on its addresses (docs/engine.md, "Launching": the recipe is the same).

Making namespaces needs CAP_NET_ADMIN (root in this project's containers); without it the module is skipped,
saying so.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvscope.backend.engine.tp_auth import SECRET_ENV
from tests.server_helpers import wait_for

NET = "10.213.7"  # a /24 that no network of this machine uses: the two hosts' link
PORT = 29531  # torchrun's store on the first host (a namespace of its own: nothing else listens there)
TIMEOUT_S = 240


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def pids_in(host: Host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split()]


def kill_all_in(host: Host) -> None:
    for pid in pids_in(host):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    """Two hosts: namespaces `<tag>a` and `<tag>b`, at NET.1 and NET.2, loopback up in each."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): the multi-host test makes network namespaces with it")
    tag = f"kv{os.getpid() % 100_000}"
    a, b = Host(f"{tag}a", f"{NET}.1"), Host(f"{tag}b", f"{NET}.2")
    try:
        ip("netns", "add", a.namespace)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"this machine cannot make a network namespace ({e.stderr.strip()}): the multi-host test "
                    "needs CAP_NET_ADMIN")
    try:
        ip("netns", "add", b.namespace)
        ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for host, device in ((a, f"{tag}va"), (b, f"{tag}vb")):
            ip("link", "set", device, "netns", host.namespace)
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", device)
            ip("-n", host.namespace, "link", "set", device, "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
        yield a, b
    finally:
        for host in (a, b):
            kill_all_in(host)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)


def launch(host: Host, node_rank: int, first: Host, args: list[str], env: dict) -> subprocess.Popen:
    """`torchrun ... -m kvscope ARGS --tensor-parallel 2` on `host`, one rank on each of the two hosts; the
    first host's rank is rank 0 (node rank 0 holds torchrun's store)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node_rank), "--master-addr", first.address, "--master-port", str(PORT),
               "-m", "kvscope", *args, "--tensor-parallel", "2"]
    return subprocess.Popen(["ip", "netns", "exec", host.namespace, *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def on_both(hosts: tuple[Host, Host], args: list[str]) -> tuple[subprocess.Popen, subprocess.Popen]:
    env = {**os.environ, SECRET_ENV: secrets.token_hex(16)}  # the same secret on every host, as the recipe says
    a, b = hosts
    return launch(a, 0, a, args, env), launch(b, 1, a, args, env)


def scenario_file(tmp_path: Path, requests: int, max_tokens: int) -> Path:
    path = tmp_path / "two-hosts.yaml"
    path.write_text(yaml.safe_dump({
        "name": "two-hosts", "model": "demo", "seed": 0, "engine": {"block_size": 8, "num_blocks": 256},
        "requests": [{"id": f"r{i}", "prompt": prompt, "max_tokens": max_tokens, "sampling": {"temperature": 0},
                      "arrival_step": i} for i, prompt in enumerate(["ROMEO:", "JULIET:", "KING HENRY:"][:requests])]}))
    return path


def tokens_of(trace: Path) -> dict[str, list[int]]:
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    return {e["request_id"]: e["output_token_ids"] for e in events if e["type"] == "request_finished"}


def test_two_hosts_run_the_model_as_one_and_the_header_says_where_each_rank_ran(hosts, tmp_path) -> None:
    from kvscope.backend.events.state import RunState
    from kvscope.backend.events.trace import read_trace
    from kvscope.frontend.export.blocks import strip_titles

    path = scenario_file(tmp_path, 3, 12)
    alone = tmp_path / "alone.jsonl"
    subprocess.run([sys.executable, "-m", "kvscope", "run", str(path), "--trace", str(alone)], check=True,
                   capture_output=True, timeout=TIMEOUT_S)
    sharded = tmp_path / "two-hosts.jsonl"
    first, second = on_both(hosts, ["run", str(path), "--trace", str(sharded)])
    out, err = first.communicate(timeout=TIMEOUT_S)
    second.communicate(timeout=TIMEOUT_S)
    assert first.returncode == 0 and second.returncode == 0, err[-3000:]
    assert tokens_of(sharded) == tokens_of(alone)  # token for token, as on one machine

    events = read_trace(sharded)
    layout = events[0]["tensor_parallel"]
    assert layout["launcher"] == "torchrun" and layout["size"] == 2
    assert [r["host"].split(" ")[-1] for r in layout["ranks"]] == [f"({h.address})" for h in hosts]
    state = RunState()
    for e in events:
        state.apply(e)
    titles = strip_titles(state)  # the block pool's strip titles, on the page and in its exports
    assert [f"({h.address})" in t for t, h in zip(titles, hosts, strict=True)] == [True, True], titles


def test_a_killed_host_fails_the_run_naming_its_rank_as_on_one_machine(hosts, tmp_path) -> None:
    """The second host's processes are killed mid-run: rank 0 names rank 1, in one line, and exits."""
    path = scenario_file(tmp_path, 3, 400)
    trace = tmp_path / "killed.jsonl"
    first, second = on_both(hosts, ["run", str(path), "--trace", str(trace)])
    steps = lambda: trace.exists() and trace.read_text().count('"type":"iteration"') >= 20  # noqa: E731
    wait_for(lambda: steps() or first.poll() is not None, "no steps under way", TIMEOUT_S)
    assert first.poll() is None, first.stderr.read()[-3000:]
    kill_all_in(hosts[1])
    _, err = first.communicate(timeout=TIMEOUT_S)
    second.communicate(timeout=TIMEOUT_S)
    assert first.returncode != 0
    # as on one machine: "kvscope run: --tensor-parallel: tensor-parallel rank 1 stopped answering during step 21
    # (its heartbeat stopped; ...)" (a killed host's process exit cannot be seen from here; its heartbeat stops)
    line = next((line for line in err.splitlines() if line.startswith("kvscope run: --tensor-parallel: ")), None)
    assert line is not None and "tensor-parallel rank 1 stopped answering during step" in line, err[-3000:]
