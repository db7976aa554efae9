"""Tensor-parallel ranks talk only to their own run (issue #35, point 1).

The store and gloo listen on loopback only; every value a worker reads from the store is signed with
the run's secret (tp_auth.py) and is plain data checked field by field (tp_wire.py); a worker builds
its shard from a description and loads tensors only (model/shard_spec.py). The attack of the issue,
a pickle planted where rank 1 reads its next step, runs nothing: the rank refuses it and the run fails
naming why. The unit tests below need no process; the last ones start real ranks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench.fuzz_store import other_address
from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_input import RowTokens, step_input
from kvscope.backend.engine.tp_auth import SECRET_ENV, Refused, RunSecret, SecretMissing
from kvscope.backend.engine.tp_group import RankFailed
from kvscope.backend.engine.tp_wire import Pool, decode_step, encode_step
from kvscope.backend.engine.tp_worker import load_tensors
from kvscope.backend.model.attention import DenseCausalBackend
from kvscope.backend.model.loader import load_model
from kvscope.backend.model.quant import quantize_model
from kvscope.backend.model.shard_spec import ShardError, build_shard, describe_storage, load_shard
from kvscope.backend.model.sharding import connect, shard_model, shard_plan
from tests.test_tp_robustness import listening

WAIT_S = 30.0
POOL = Pool(num_blocks=8, block_size=4, vocab_size=100)


class Opens:
    """Unpickled, this opens (creates) a file: what the issue's attacker stored at a step key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def a_step():
    rows = [RowTokens("a", 0, "prefill", [5, 6, 7, 8, 9], 0, [3, 1], samples=True),
            RowTokens("b", 1, "decode", [42], 6, [0, 2], samples=True)]
    return step_input(rows, [(2, 4)], block_size=4)


def body(**fields) -> bytes:
    """a_step's message with `fields` replaced, as a forged frame's body would carry it."""
    message = json.loads(encode_step(a_step()))
    return json.dumps({"step": {**message["step"], **fields}}).encode()


# ---- the wire: plain data, checked ------------------------------------------------------------------


def test_a_step_crosses_as_json_and_comes_back_with_the_forwards_fields_equal():
    inp = a_step()
    wire = encode_step(inp)
    back = decode_step(wire, POOL)
    for name in ("seq_ids", "phases", "query_starts", "context_lens", "block_tables", "input_ids", "positions",
                 "slot_mapping", "logit_rows", "block_copies"):
        assert getattr(back, name) == getattr(inp, name), name
    assert back.request_ids == ["", ""] and back.sampling == []  # no names a client chose, no sampling
    assert b"\x80" not in wire and wire.startswith(b'{"step":')  # JSON, not a pickle
    assert decode_step(encode_step(None), POOL) is None


@pytest.mark.parametrize("fields, says", [
    ({"input_ids": [5, 6, 7, 8, True, 42]}, "input_ids is not a list[int]"),
    ({"input_ids": [5, 6, 7, 8, 9.0, 42]}, "input_ids is not a list[int]"),
    ({"phases": ["prefill", "exec"]}, "phases is not a list"),
    ({"block_copies": [[2, 4, 6]]}, "block_copies is not a list[tuple[int, int]]"),
    ({"block_tables": [[3, 1], "0,2"]}, "block_tables is not a list[list[int]]"),
    ({"input_ids": [5, 6, 7, 8, 9, 100]}, "input_ids reach outside the vocabulary"),
    ({"slot_mapping": [12, 13, 14, 15, 4, 10 ** 30]}, "slot_mapping reach outside the KV pool"),
    ({"block_tables": [[3, 8], [0, 2]]}, "block_tables reach outside the KV pool"),
    ({"block_copies": [[2, -1]]}, "block_copies reach outside the KV pool"),
    ({"query_starts": [0, 5, 7]}, "query_starts do not span the tokens"),
    ({"context_lens": [5, 9]}, "context_lens[1] (9) is outside its 1 queries and 2 blocks"),
    ({"context_lens": [5]}, "context_lens has 1 rows, seq_ids 2"),
])
def test_a_step_that_breaks_a_type_or_a_bound_is_refused_naming_the_field(fields, says):
    with pytest.raises(Refused, match=re.escape(says)):
        decode_step(body(**fields), POOL)


@pytest.mark.parametrize("raw", [
    pickle.dumps(a_step()), b"", b"[" * 100_000 + b"]" * 100_000, b'{"step": {"input_ids": NaN}}',
    b'{"step": {}, "extra": 1}', b'{"stop": false}', "\udcff".encode("utf-8", "surrogatepass"),
])
def test_a_step_body_that_is_not_the_message_is_refused(raw):
    with pytest.raises(Refused, match="the step message"):
        decode_step(raw, POOL)


def test_a_frame_is_opened_only_with_its_runs_secret_and_for_its_own_step():
    secret, other = RunSecret.new(), RunSecret.new()
    frame = secret.sign("step/3", b"data")
    assert secret.open("step/3", frame) == b"data"
    for who, purpose, value in [(other, "step/3", frame), (secret, "step/4", frame),
                                (secret, "step/3", frame[:-1] + b"x"), (secret, "step/3", pickle.dumps(a_step()))]:
        with pytest.raises(Refused):
            who.open(purpose, value)
    assert secret.namespace() != other.namespace() and secret.key.decode() not in secret.namespace()
    assert secret.key.decode() not in repr(secret)


def test_a_launch_without_a_long_enough_secret_is_refused_saying_how_to_set_one():
    with pytest.raises(SecretMissing, match=f"{SECRET_ENV} is not set.*secrets.token_hex"):
        RunSecret.from_env({})
    with pytest.raises(SecretMissing, match="has 5 characters"):
        RunSecret.from_env({SECRET_ENV: "short"})
    env = {SECRET_ENV: "x" * 32}
    assert RunSecret.from_env(env, forget=True).key == b"x" * 32 and SECRET_ENV not in env


def test_a_pickled_object_in_place_of_the_shards_tensors_runs_nothing(tmp_path):
    marker = tmp_path / "opened"
    planted = {"w": Opens(marker)}
    for payload in (pickle.dumps(planted, protocol=2), _saved(planted), _saved(torch.nn.Linear(2, 2))):
        with pytest.raises(Refused, match="do not load as tensors only"):
            load_tensors(payload, torch.device("cpu"))
    assert not marker.exists()
    assert load_tensors(_saved({"w": torch.ones(2)}), torch.device("cpu"))["w"].tolist() == [1.0, 1.0]


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ---- the shard: built from its description, tensors loaded ---------------------------------------


@pytest.mark.parametrize("name, quant", [("demo", "none"), ("demo-mla", "none"), ("demo", "int8"), ("demo", "int4")])
def test_a_shard_rebuilt_from_its_description_and_tensors_computes_what_rank_0s_shard_does(name, quant):
    loaded = load_model(name)
    model = loaded.model if quant == "none" else quantize_model(loaded.model, quant, 32)
    plan = shard_plan(loaded.config, 1, 2)
    shard = shard_model(model, plan)
    storage = describe_storage(shard)
    assert {s.kind for s in storage.linears.values()} == {"float" if quant == "none" else quant}
    rebuilt = build_shard(loaded.config, plan, type(storage).model_validate_json(storage.model_dump_json()),
                          torch.float32)
    rebuilt = load_shard(rebuilt, load_tensors(_saved(shard.state_dict()), torch.device("cpu")), torch.device("cpu"))
    for m in (shard, rebuilt):
        connect(m, lambda y: y)  # one rank's partial sums: both must compute the same ones
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    positions = torch.arange(5)[None]
    attn = DenseCausalBackend(absorb_mla=False)
    torch.testing.assert_close(rebuilt(ids, positions, attn), shard(ids, positions, attn), rtol=0, atol=0)


def test_tensors_that_do_not_fit_the_shard_this_rank_builds_are_refused_naming_the_tensor(demo):
    plan = shard_plan(demo.config, 1, 2)
    shard = shard_model(demo.model, plan)
    storage = describe_storage(shard)
    state = shard.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    cases = [({**state, name: state[name][:-1]}, f"tensor '{name}' is (127, 256)"),
             ({**state, name: state[name].to(torch.float16)}, "torch.float16; this shard holds"),
             ({k: v for k, v in state.items() if k != name}, f"no tensor '{name}'"),
             ({**state, "evil": torch.ones(1)}, "an unexpected tensor 'evil'")]
    for bad, says in cases:
        with pytest.raises(ShardError, match=re.escape(says)):
            load_shard(build_shard(demo.config, plan, storage, torch.float32), bad, torch.device("cpu"))
    extra = {**storage.linears, "model.layers.0.mlp.nope": storage.linears["model.layers.0.mlp.up_proj"]}
    wrong = storage.model_copy(update={"linears": extra})
    with pytest.raises(ShardError, match="names other layers than this model has"):
        build_shard(demo.config, plan, wrong, torch.float32)


# ---- real ranks ------------------------------------------------------------------------------------


def eventually(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def tp_engine(demo) -> Engine:
    engine = Engine(demo, EngineConfig(tensor_parallel=2, tensor_parallel_timeout_s=10, events="off"))
    engine.add_request("r", "ROMEO:\n", 200, SamplingParams(temperature=0, ignore_eos=True))
    return engine


def test_every_socket_of_a_group_listens_on_loopback_and_a_connection_from_another_address_is_refused(demo):
    address = other_address()
    if address is None:
        pytest.skip("this machine has no IPv4 address besides loopback to connect from")
    before = listening(os.getpid())
    engine = tp_engine(demo)
    try:
        [worker] = engine.executor.runner.ranks.processes
        ours = (listening(os.getpid()) - before) | listening(worker.pid)
        assert ours and {ip for ip, _ in ours} == {"127.0.0.1"}, ours
        store_port = engine.executor.runner.ranks.store.port
        for _, port in ours:  # the store's port, and gloo's
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=5).close()
        assert store_port in {port for _, port in ours}
        engine.step()  # the group still works
    finally:
        engine.close()


def test_a_pickle_planted_at_the_next_step_key_runs_nothing_and_fails_the_run_naming_why(demo, tmp_path):
    """The issue's attack: a client of the store (on loopback, where the store listens) lists the keys, finds
    the step channel, and sets rank 1's next step to a pickle that opens a file."""
    marker = tmp_path / "opened-by-rank-1"
    engine = tp_engine(demo)
    try:
        for _ in range(3):
            engine.step()
        [worker] = engine.executor.runner.ranks.processes
        client = dist.TCPStore("127.0.0.1", engine.executor.runner.ranks.store.port, is_master=False,
                               timeout=timedelta(seconds=10))
        steps = [re.fullmatch(r"(.*step/)(\d+)", k) for k in client.list_keys()]
        prefix, last = max(((m[1], int(m[2])) for m in steps if m), key=lambda pm: pm[1])
        client.set(f"{prefix}{last + 1}", pickle.dumps(Opens(marker)))
        eventually(lambda: worker.poll() is not None, "rank 1 stopped on reading it")
        with pytest.raises(RankFailed, match=rf"tensor-parallel rank 1 refused step {last + 1}: the value at "
                                             rf"step/{last + 1} is not a kvscope frame"):
            engine.step()
        assert not marker.exists(), "rank 1 unpickled the planted value"
        assert worker.returncode == 4
    finally:
        engine.close()
