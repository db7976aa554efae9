"""Files from anywhere are checked against bounds before anything is sized from them (docs/api.md, "Limits").

Crafted hostile files: replay traces (uploaded to POST /api/runs, read by `kvscope replay` and
`kvscope export`), GGUF files (written with gguf.GGUFWriter into tmp_path, tiny, then with fields
that lie) and config.json variants. Each gives one line naming the file and the field (exit 2 on the
command line, a 400 from the API) and allocates nothing big: the checks run on the numbers first,
which the tests hold by construction (what would allocate is replaced by a tripwire) and by the
tracemalloc peak. And `kvscope export` draws every trace kvscope itself writes, the server's
windowed /trace download and traces at `events: summary` and `off` included.
"""

from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from PIL import Image

from kvscope.backend.config import EngineConfig, ModelConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request import RequestError
from kvscope.backend.errors import ModelLoadError
from kvscope.backend.events import trace
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.trace import TraceError, TraceWriter, parse_trace, read_trace
from kvscope.backend.model import gguf_loader
from kvscope.backend.model.loader import load_model
from kvscope.backend.model.transformer import CausalLM, parameter_shapes
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.simulate import simulation
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import API_RUN_ID, RunManager
from kvscope.cli import main
from kvscope.frontend.export.gif import frame_steps
from kvscope.frontend.export.replayed import replay
from kvscope.frontend.views.attention import MAX_ROWS, mask_items
from tests.conftest import make_tiny_model
from tests.server_helpers import app_client, wait_for

MB = 1024**2
SMALL_PEAK = 16 * MB  # what refusing a hostile file may cost; the hostile sizes are gigabytes
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def peak_bytes(action: Callable[[], object]) -> int:
    """The most memory Python held (tracemalloc) while `action` ran."""
    tracemalloc.start()
    try:
        action()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ---- traces -------------------------------------------------------------------------------------------


def record(tiny_dir: str, path: Path, events: str = "full") -> Path:
    """A small run of the tiny model written as a trace, as `kvscope run --trace` writes one."""
    scenario = Scenario.model_validate({
        "name": "small", "model": tiny_dir, "engine": {"block_size": 4, "num_blocks": 32, "max_model_len": 64,
                                                        "events": events},
        "requests": [{"id": "a", "prompt": "ROMEO:", "max_tokens": 8, "sampling": GREEDY},
                     {"id": "b", "prompt": "JULIET: O", "max_tokens": 6, "arrival_step": 2, "sampling": GREEDY}]})
    bus = EventBus(level=events)
    with TraceWriter(path) as writer:
        bus.subscribe(writer)
        ScenarioRun(scenario, bus=bus).run()
    return path


@pytest.fixture(scope="module")
def recorded(tiny_dir, tmp_path_factory) -> list[dict]:
    return read_trace(record(tiny_dir, tmp_path_factory.mktemp("trace") / "small.jsonl"))


def first(events: list[dict], kind: str) -> dict:
    return json.loads(json.dumps(next(e for e in events if e["type"] == kind)))  # a copy to lie in


def changed(event: dict, **fields) -> dict:
    """A copy of the event with fields replaced; `cache__num_blocks` reaches into cache."""
    event = json.loads(json.dumps(event))
    for path, value in fields.items():
        *outer, last = path.split("__")
        target = event
        for key in outer:
            target = target[key]
        target[last] = value
    return event


def jsonl(events: list[dict]) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def header_and(recorded: list[dict], *events: dict, **header_fields) -> str:
    return jsonl([changed(recorded[0], **header_fields), *events])


# Each: (what it claims, the trace's text from the recorded one, the words of its one line).
HOSTILE_TRACES = [
    ("a pool of 1e7 blocks", lambda r: header_and(r, cache__num_blocks=10**7),
     "trace:1: header event: field 'cache.num_blocks': 10000000 is outside 1..1,000,000"),
    ("a block size of 0", lambda r: header_and(r, cache__block_size=0),
     "trace:1: header event: field 'cache.block_size': 0 is outside 1..256"),
    ("a max_model_len of 1e9", lambda r: header_and(r, config__max_model_len=10**9),
     "trace:1: header event: field 'config.max_model_len': Input should be less than or equal to 1000000"),
    ("a config field of the wrong type", lambda r: header_and(r, config__max_num_seqs="many"),
     "trace:1: header event: field 'config.max_num_seqs': Input should be a valid integer"),
    ("a lesson step that is not a step", lambda r: header_and(r, scenario__lesson=["pause here"]),
     "trace:1: header event: field 'scenario.lesson.0': a lesson step is {at: moment, text: words}"),
    ("a block_alloc at logical index 2e8", lambda r: header_and(r, changed(first(r, "block_alloc"),
                                                                           logical_index=2 * 10**8)),
     "trace:2: block_alloc event: field 'logical_index': 200000000 is past the longest block table, 16 blocks"),
    ("a block id outside the pool", lambda r: header_and(r, changed(first(r, "block_alloc"), block_id=32)),
     "trace:2: block_alloc event: field 'block_id': block 32 is outside the pool of 32 blocks"),
    ("a negative block id", lambda r: header_and(r, changed(first(r, "block_free"), block_id=-1)),
     "trace:2: block_free event: field 'block_id': -1 is negative"),
    ("a copy into a block outside the pool", lambda r: header_and(r, {
        "type": "block_copy", "seq": 1, "step": 0, "t": 0.0, "src_block_id": 0, "dst_block_id": 10**6, "seq_id": 0}),
     "trace:2: block_copy event: field 'dst_block_id': block 1000000 is outside the pool of 32 blocks"),
    ("a sequence id of 2**60", lambda r: header_and(r, changed(first(r, "token"), seq_id=2**60)),
     "trace:2: token event: field 'seq_id': 1152921504606846976 is not below 2**53"),
    ("a step of 2**60", lambda r: header_and(r, changed(first(r, "token"), step=2**60)),
     "trace:2: token event: field 'step': 1152921504606846976 is not below 2**53"),
    ("a mask over 1e9 queries", lambda r: header_and(r, changed(first(r, "attention_mask"),
                                                                query_positions=[0, 10**9], key_len=10**9)),
     "trace:2: attention_mask event: field 'query_positions': [0, 1000000000) with key_len 1000000000 is not"),
    ("a token at position 1e9", lambda r: header_and(r, changed(first(r, "token"), position=10**9)),
     "trace:2: token event: field 'position': 1000000000 is not below max_model_len 64"),
    ("a batch entry with a context of 1e9", lambda r: header_and(r, changed(
        first(r, "iteration"), batch=[{**first(r, "iteration")["batch"][0], "context_len": 10**9}])),
     "trace:2: iteration event: field 'batch.0': "),
    ("NaN", lambda r: header_and(r) + json.dumps(first(r, "token")).replace('"logprob": ', '"logprob": NaN, "x": ')
     + "\n", "trace:2: not JSON (NaN is not a number JSON allows)"),
    ("a float too large", lambda r: header_and(r) + json.dumps(changed(first(r, "token"), logprob=1.0)).replace(
        '"logprob": 1.0', '"logprob": 1e999') + "\n",
     "trace:2: not JSON this reader takes (1e999 is too large for a float)"),
    ("JSON nested 5000 deep", lambda r: header_and(r) + "[" * 5000 + "]" * 5000 + "\n",
     "trace:2: not JSON this reader takes (nested too deep)"),
    ("sampling nested 40 deep", lambda r: header_and(r, changed(first(r, "request_arrived"),
                                                                 sampling={"a": json.loads("[" * 40 + "]" * 40)})),
     "trace:2: request_arrived event: field 'sampling.a"),
]


def some(cases: list[tuple], *claims: str) -> dict:
    """parametrize's arguments for the cases making these claims (ids: the claims)."""
    chosen = [case for case in cases if case[0] in claims]
    assert len(chosen) == len(claims)
    return {"argvalues": chosen, "ids": list(claims)}


@pytest.mark.parametrize("claim, text_of, message", HOSTILE_TRACES, ids=[c[0] for c in HOSTILE_TRACES])
def test_a_hostile_trace_is_one_line_naming_the_field_before_anything_is_sized(recorded, claim, text_of, message):
    text = text_of(recorded)

    def refuse():
        with pytest.raises(TraceError) as error:
            parse_trace(text)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)

    assert peak_bytes(refuse) < SMALL_PEAK


@pytest.mark.parametrize("claim, text_of, message", **some(HOSTILE_TRACES, "a pool of 1e7 blocks", "a max_model_len of 1e9",
                                                            "a lesson step that is not a step",
                                                            "a block_alloc at logical index 2e8"))
def test_the_api_answers_a_hostile_trace_with_a_400_naming_the_field(tiny_dir, recorded, claim, text_of, message):
    client = app_client(RunManager(default_model=tiny_dir))
    with client:
        answer = {}
        peak = peak_bytes(lambda: answer.update(r=client.post("/api/runs", json={"trace": text_of(recorded)})))
        assert answer["r"].status_code == 400 and answer["r"].json()["error"].startswith(message)
        assert answer["r"].json()["field"] == message.split(": ")[0]
        assert client.get("/api/runs").json() == []  # no run was started
    assert peak < SMALL_PEAK


@pytest.mark.parametrize("command", ["export", "replay"])
@pytest.mark.parametrize("claim, text_of, message", **some(HOSTILE_TRACES, "a pool of 1e7 blocks",
                                                            "a block_alloc at logical index 2e8"))
def test_the_cli_refuses_a_hostile_trace_in_one_line_and_exit_2(recorded, tmp_path, capsys, monkeypatch, command,
                                                                 claim, text_of, message):
    monkeypatch.setattr("kvscope.backend.server.serve.serve_forever", lambda *_: pytest.fail("replay served"))
    path = tmp_path / "hostile.jsonl"
    path.write_text(text_of(recorded))
    args = ["export", str(path), "--out", str(tmp_path / "x.png")] if command == "export" else \
        ["replay", str(path), "--no-ui"]
    codes = []
    assert peak_bytes(lambda: codes.append(main(args))) < SMALL_PEAK
    assert codes == [2]
    expected = message.replace("trace:", f"{path}:", 1)
    assert one_line(capsys.readouterr().err).startswith(f"kvscope {command}: {expected}")


def test_a_trace_that_starts_mid_run_may_leave_at_most_one_pool_of_unknown_table_entries(recorded):
    """Two sequences first seen at their 1,000,000th block: the reducer would hold 2e6 holes from 2 lines."""
    far = [changed(first(recorded, "block_alloc"), seq_id=seq, logical_index=999_999) for seq in (7, 8)]
    text = header_and(recorded, *far, cache__block_size=1, config__block_size=1, config__max_model_len=1_000_000)
    with pytest.raises(TraceError, match=r"trace:3: block_alloc event: field 'logical_index': more than 1,000,000 "
                                         r"block-table entries come before the trace's first event"):
        parse_trace(text)
    assert parse_trace(header_and(recorded, far[0], cache__block_size=1, config__block_size=1,
                                  config__max_model_len=1_000_000))  # one sequence's are fine


def test_too_many_lines_or_bytes_are_refused_before_any_is_parsed(recorded, tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "MAX_TRACE_EVENTS", 3)
    with pytest.raises(TraceError, match=r"^trace: 5 lines; a trace has at most 3 events$"):
        parse_trace(jsonl(recorded[:5]))
    path = tmp_path / "big.jsonl"
    path.write_text(jsonl(recorded[:2]))
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 100)
    with pytest.raises(TraceError, match=r"bytes; a trace is read whole, at most 100 bytes$"):
        read_trace(path)


def test_every_trace_kvscope_writes_passes_the_bounds(recorded):
    assert parse_trace(jsonl(recorded)) == recorded


def test_an_engine_never_has_a_pool_larger_than_a_trace_may_claim(tiny, monkeypatch):
    """So that every trace kvscope writes is one it reads: a pool from a memory budget, or a simulated GPU's."""
    monkeypatch.setattr("kvscope.backend.engine.engine.KVCache", lambda *_: pytest.fail("a KV cache was allocated"))
    config = EngineConfig(num_blocks=None, kv_cache_memory_mb=1024, block_size=1)  # 2,097,152 blocks of 512 B
    with pytest.raises(RequestError, match=r"^engine.kv_cache_memory_mb: 1024 MB holds 2,097,152 blocks of 1 tokens; "
                                           r"an engine has at most 1,000,000"):
        Engine(tiny, config)
    with pytest.raises(PerfError, match=r"^engine.block_size: the KV pool .* holds 10,345,673 blocks of 1 tokens"):
        simulation("smollm2-135m", "h200", 1, None, 0.9, EngineConfig(block_size=1, kv_cache_dtype="int8"), 0)


def test_the_mask_view_builds_only_the_rows_it_draws():
    """Within the bounds a step may hold many masks of a million queries each: 1e9 rows, 600 drawn."""
    masks = [{"query_positions": [0, 1_000_000], "key_len": 1_000_000, "request_id": f"r{i}"} for i in range(1000)]
    out = {}
    assert peak_bytes(lambda: out.update(drawn=mask_items(masks, {}))) < SMALL_PEAK
    items, rows, keys = out["drawn"]
    assert len(items) <= MAX_ROWS and (rows, keys) == (10**9, 10**9)
    assert [item[0] for item in items[:2]] == [0, -(-10**9 // MAX_ROWS)]  # every stride-th row


# ---- kvscope export of the traces kvscope writes ----------------------------------------------------------

EXPORTS = [("timeline", ".png"), ("blocks", ".png"), ("batch", ".png"), ("timeline", ".json"), ("timeline", ".gif")]


@pytest.fixture(scope="module")
def windowed(tiny_dir, tmp_path_factory) -> Path:
    """The server's own GET /api/runs/api/trace: its header and a window of 40 events that starts after both
    requests arrived and ends while they still run (the batch view gave a KeyError on such a download)."""
    manager = RunManager(default_model=tiny_dir, limits=ServiceLimits(trace_window=40))
    client = app_client(manager)
    path = tmp_path_factory.mktemp("windowed") / "api.jsonl"
    with client:
        run = manager.api_run()
        assert client.post(f"/api/runs/{API_RUN_ID}/control", json={"action": "pause"}).status_code == 200
        for prompt in ("ROMEO:", "JULIET: O"):
            body = {"prompt": prompt, "max_tokens": 40, "sampling": GREEDY}
            assert client.post(f"/api/runs/{API_RUN_ID}/requests", json=body).status_code == 201
        client.post(f"/api/runs/{API_RUN_ID}/control", json={"action": "step", "value": 12})
        wait_for(lambda: run.state.step >= 11)
        path.write_text(client.get(f"/api/runs/{API_RUN_ID}/trace").text)
    manager.stop_all()
    return path


def test_the_windowed_download_starts_mid_run_and_its_requests_are_running(windowed):
    events = read_trace(windowed)
    types = [e["type"] for e in events]
    assert types[0] == "header" and "request_arrived" not in types and "request_finished" not in types
    run = replay(events)
    assert run.first > 0 and run.state.running == ["live-1", "live-2"]
    for view in run.state.requests.values():  # arrived before the window: its first token is not this one
        assert (view.status, view.joined, view.first_token_step) == ("running", True, None) and view.output_token_ids


@pytest.mark.parametrize("view, suffix", EXPORTS)
def test_export_draws_each_view_of_the_servers_windowed_trace(windowed, tmp_path, capsys, view, suffix):
    out = tmp_path / f"{view}{suffix}"
    assert main(["export", str(windowed), "--out", str(out), "--view", view]) in (0, None)
    assert capsys.readouterr().out.startswith(f"wrote {out}")
    run = replay(read_trace(windowed))
    assert run.order == ["live-1", "live-2"]  # known from their iterations, though they arrived before the window
    if suffix == ".json":
        threads = {e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"] if e["name"] == "thread_name"}
        assert {"live-1", "live-2"} <= threads
    if suffix == ".gif":
        with Image.open(out) as gif:
            assert gif.n_frames == len(frame_steps(run.first, run.last, 1)) == run.last - run.first + 1


@pytest.mark.parametrize("view, suffix", EXPORTS)
def test_export_draws_each_view_of_a_summary_trace(tiny_dir, tmp_path, capsys, view, suffix):
    path = record(tiny_dir, tmp_path / "summary.jsonl", events="summary")
    out = tmp_path / f"{view}{suffix}"
    assert main(["export", str(path), "--out", str(out), "--view", view]) in (0, None)
    assert out.stat().st_size > 0


def test_export_of_a_trace_without_iterations_is_one_line_saying_so(tiny_dir, tmp_path, capsys):
    path = record(tiny_dir, tmp_path / "off.jsonl", events="off")
    for view, suffix in EXPORTS:
        assert main(["export", str(path), "--out", str(tmp_path / f"x{suffix}"), "--view", view]) == 2
        assert one_line(capsys.readouterr().err) == (f"kvscope export: {path}: no iteration events to draw "
                                                     "(recorded with engine.events=off?)")


def test_a_gif_of_steps_far_apart_is_refused_before_its_frames_are_listed():
    with pytest.raises(Exception, match=r"stride: 1000000000001 frames; use a stride of at least 2500000001"):
        frame_steps(0, 10**12, 1)


# ---- config.json ----------------------------------------------------------------------------------------


@pytest.fixture
def folder(tiny_dir, tmp_path) -> Path:
    """A copy of the tiny model's folder whose config.json a test rewrites."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


@pytest.fixture
def nothing_built(monkeypatch):
    """Tripwires on what sizes itself from config.json: the model and the tensors read into memory."""
    def built(*_, **__):
        raise AssertionError("sized from config.json before it was checked")

    monkeypatch.setattr("kvscope.backend.model.loader.CausalLM", built)
    monkeypatch.setattr("kvscope.backend.model.loader.read_weights", built)


DELETE = object()
HOSTILE_CONFIGS = [
    ("a size as a string", {"hidden_size": "64"}, "hidden_size: Input should be a valid integer"),
    ("a count as a fraction", {"num_hidden_layers": 2.5}, "num_hidden_layers: Input should be a valid integer"),
    ("a count as true", {"num_attention_heads": True}, "num_attention_heads: Input should be a valid integer"),
    ("a negative layer count", {"num_hidden_layers": -1}, "num_hidden_layers: Input should be greater than 0"),
    ("zero heads", {"num_attention_heads": 0}, "num_attention_heads: Input should be greater than 0"),
    ("zero KV heads", {"num_key_value_heads": 0}, "num_key_value_heads: Input should be greater than 0"),
    ("KV heads that do not divide", {"num_key_value_heads": 3},
     "num_attention_heads (4) must be divisible by num_key_value_heads (3)"),
    ("a head_dim left out that does not divide", {"head_dim": DELETE, "hidden_size": 66},
     "head_dim: not given, and hidden_size (66) is not a multiple of num_attention_heads (4)"),
    ("an odd head_dim", {"head_dim": 15}, "head_dim (15) must be even (RoPE)"),
    ("a vocabulary of 1e12", {"vocab_size": 10**12}, "vocab_size: Input should be less than or equal to 4194304"),
    ("a vocabulary the weights do not have", {"vocab_size": 4096},
     "tensor model.embed_tokens.weight has shape [2048, 64], config.json implies [4096, 64]"),
    ("1e6 layers", {"num_hidden_layers": 10**6}, "num_hidden_layers: Input should be less than or equal to 1024"),
    ("layers the weights do not have", {"num_hidden_layers": 1000},
     "missing tensor model.layers.10.input_layernorm.weight (8982 missing in all)"),
    ("a huge hidden size", {"hidden_size": 10**7}, "hidden_size: Input should be less than or equal to 131072"),
    ("a huge FFN", {"intermediate_size": 10**9}, "intermediate_size: Input should be less than or equal to 1048576"),
    ("a huge head_dim", {"head_dim": 10**6}, "head_dim: Input should be less than or equal to 1024"),
    ("a context of 1e12", {"max_position_embeddings": 10**12},
     "max_position_embeddings: Input should be less than or equal to 16777216"),
    ("an infinite rope_theta", {"rope_theta": float("inf")}, "rope_theta: Input should be a finite number"),
    ("a missing vocab_size", {"vocab_size": DELETE}, "missing field vocab_size"),
    ("a missing head count", {"num_attention_heads": DELETE}, "missing field num_attention_heads"),
    ("a null head count", {"num_attention_heads": None}, "num_attention_heads: Input should be a valid integer"),
    ("a list, not an object", "[1, 2]", "a config is a JSON object, not list"),
    ("rope_scaling as a string", {"rope_scaling": "yes"}, "rope_scaling: an object ({rope_type, factor, ...}) or null"),
    ("a rope_scaling factor of 0", {"rope_scaling": {"rope_type": "linear", "factor": 0}},
     "rope_scaling.factor: Input should be greater than 0"),
    ("llama3 factors that divide by zero", {"rope_scaling": {"rope_type": "llama3", "factor": 8,
                                                             "low_freq_factor": 4, "high_freq_factor": 4}},
     "high_freq_factor (4.0) must be above low_freq_factor (4.0)"),
    ("an EOS outside the vocabulary", {"eos_token_id": 10**6},
     "eos_token_id: 1000000 is not a token of the vocabulary (0..2047)"),
    ("MLA sizes of the wrong type", {"mla": {"kv_lora_rank": "x", "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                                             "v_head_dim": 8}}, "mla.kv_lora_rank: Input should be a valid integer"),
    ("attention_bias as a string", {"attention_bias": "false"}, "attention_bias: 'false' is not true or false"),
    ("architectures as a string", {"architectures": "LlamaForCausalLM"},
     "architectures: unsupported architecture '(none)'"),
]


def write_config(folder: Path, change) -> Path:
    path = folder / "config.json"
    if isinstance(change, str):
        path.write_text(change)
        return path
    config = json.loads(path.read_text())
    for key, value in change.items():
        if value is DELETE:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("claim, change, message", HOSTILE_CONFIGS, ids=[c[0] for c in HOSTILE_CONFIGS])
def test_a_hostile_config_json_is_one_line_naming_the_field_before_any_allocation(folder, nothing_built, claim,
                                                                                  change, message):
    path = write_config(folder, change)

    def refuse():
        with pytest.raises(ModelLoadError) as error:
            load_model(folder)
        assert message in str(error.value) and "\n" not in str(error.value)
        assert str(error.value).startswith(str(path) if "tensor" not in message else str(folder))

    assert peak_bytes(refuse) < SMALL_PEAK


def test_generate_with_a_hostile_config_json_is_one_line_and_exit_2(folder, capsys):
    path = write_config(folder, {"vocab_size": 10**12})
    assert main(["generate", "--prompt", "a", "--model", str(folder)]) == 2
    assert one_line(capsys.readouterr().err) == (f"kvscope generate: {path}: vocab_size: Input should be less than or "
                                                 "equal to 4194304")


def test_a_context_longer_than_the_engines_blames_no_flag_it_generates(folder, capsys):
    """max_position_embeddings 2e6 once failed as '--num-draft-tokens: ...', a flag never given."""
    write_config(folder, {"max_position_embeddings": 2_000_000})
    assert main(["generate", "--prompt", "a", "--max-tokens", "2", "--temperature", "0", "--model", str(folder)]) == 0
    assert capsys.readouterr().out.strip()


def test_a_bad_engine_flag_is_named_as_given(capsys):
    assert main(["generate", "--prompt", "a", "--speculative", "ngram", "--num-draft-tokens", "99"]) == 2
    assert one_line(capsys.readouterr().err) == ("kvscope generate: --num-draft-tokens: Input should be less than or "
                                                 "equal to 16")


@pytest.mark.parametrize("variant", ["gqa", "mla", "biases", "tied"])
def test_parameter_shapes_are_the_built_models(variant):
    """The weights on disk are checked against parameter_shapes, which must say what CausalLM builds."""
    config = make_tiny_model(mla=variant == "mla").config
    if variant == "biases":
        config = config.model_copy(update={"qkv_bias": True, "o_bias": True, "mlp_bias": True})
    if variant == "tied":
        config = config.model_copy(update={"tie_word_embeddings": not config.tie_word_embeddings})
    built = {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}
    assert parameter_shapes(config) == built


def test_a_config_without_head_dim_derives_it():
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 64,
                                       "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4})
    assert (config.head_dim, config.num_key_value_heads, config.max_position_embeddings) == (16, 4, 2048)


# ---- GGUF -----------------------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8, 16, 2, 1, 4, 16
TOKENS = [*(chr(ord("a") + i) for i in range(VOCAB - 1)), "ab"]  # and one merge, "a b"


def tiny_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM), f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_up.weight": (FFN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    return shapes


def write_gguf(path: Path, metadata: dict | None = None, shapes: dict | None = None, tokens: list[str] = TOKENS) -> Path:
    """A one-layer llama of a few hundred floats; `metadata` overrides or adds keys (None removes one)."""
    rng = np.random.default_rng(0)
    values = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": HIDDEN,
              "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
              "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 10000.0,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": VOCAB,
              "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
              "tokenizer.ggml.token_type": [1] * len(tokens), "tokenizer.ggml.eos_token_id": 0,
              **(metadata or {})}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if value is not None:
            w.add_key_value(key, value, value_type(value))
    for name, shape in (shapes or tiny_shapes(1)).items():
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def value_type(value) -> gguf.GGUFValueType:
    T = gguf.GGUFValueType
    if isinstance(value, list):
        return T.ARRAY
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**32:
        return T.UINT64
    return {bool: T.BOOL, int: T.UINT32, float: T.FLOAT32, str: T.STRING}[type(value)]


def patched(path: Path, offset: int, fmt: str, value) -> Path:
    """The file with one number overwritten: a field that lies about what follows it."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))
    return path


def patched_bytes(path: Path, old: bytes, new: bytes) -> Path:
    """The file with the first `old` (of the same length) replaced."""
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    path.write_bytes(data.replace(old, new, 1))
    return path


def value_offset(path: Path, key: str) -> int:
    """Where a metadata field's value starts (after its key and type); an array's: its item type."""
    field = gguf.GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def tensor_dims_offset(path: Path, name: str) -> int:
    """Where a tensor info's n_dims starts (the dims follow it)."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return tensor.field.offset + 8 + len(name.encode())


def lie(fmt: str, where: Callable[[Path], int], value) -> Callable[[Path], Path]:
    """A writer of the honest file with the number at `where` replaced by `value`."""
    def write(path: Path) -> Path:
        honest = write_gguf(path)
        return patched(honest, where(honest), fmt, value)

    return write


# Each: (the lie, how to write it, the words of its one line after the file's path, what it must not reach).
HOSTILE_GGUFS = [
    ("an array of 1e12 token types", lie("<Q", lambda p: value_offset(p, "tokenizer.ggml.token_type") + 4, 10**12),
     "tokenizer.ggml.token_type: an array of 1,000,000,000,000 items; at most 1,048,576 are read", "reader"),
    ("an array longer than the file", lie("<Q", lambda p: value_offset(p, "tokenizer.ggml.token_type") + 4, 10**6),
     "tokenizer.ggml.token_type: 4,000,000 bytes at offset", "reader"),
    ("a string longer than the file", lie("<Q", lambda p: value_offset(p, "tokenizer.ggml.model"), 2**40),
     "tokenizer.ggml.model: 1,099,511,627,776 bytes at offset", "reader"),
    ("1e12 metadata fields", lie("<Q", lambda p: 16, 10**12), "GGUF.kv_count: more than 4,194,304 metadata values",
     "reader"),
    ("1e12 tensors", lie("<Q", lambda p: 8, 10**12), "GGUF.tensor_count: 1,000,000,000,000 tensors; at most 65,536",
     "reader"),
    ("a tensor of 2**40 rows", lie("<Q", lambda p: tensor_dims_offset(p, "token_embd.weight") + 4 + 8, 2**40),
     "tensor token_embd.weight: its 35,184,372,088,832 bytes at offset", "reader"),
    ("a tensor of 9 dimensions", lie("<I", lambda p: tensor_dims_offset(p, "token_embd.weight"), 9),
     "tensor token_embd.weight: 9 dimensions (1 to 4)", "reader"),
    ("an unknown value type", lie("<I", lambda p: value_offset(p, "llama.block_count") - 4, 99),
     "llama.block_count: unknown value type 99", "reader"),
    ("an unknown tensor type", lie("<I", lambda p: tensor_dims_offset(p, "token_embd.weight") + 4 + 2 * 8, 999),
     "tensor token_embd.weight: unknown tensor type 999", "reader"),
    ("tensor data past the end", lie("<Q", lambda p: tensor_dims_offset(p, "token_embd.weight") + 4 + 2 * 8 + 4,
                                     2**40), "tensor token_embd.weight: its 512 bytes at offset", "reader"),
    ("a key given twice", lambda p: patched_bytes(write_gguf(p, {"x.a": 1, "x.b": 2}), b"x.b", b"x.a"),
     "x.a: given twice", "reader"),
    ("an architecture that is not UTF-8", lambda p: patched_bytes(write_gguf(p), b"llama", b"ll\xffma"),
     "general.architecture: not readable", "data"),
    ("zero heads", lambda p: write_gguf(p, {"llama.attention.head_count": 0}),
     "llama.attention.head_count: Input should be greater than 0", "data"),
    ("a head count as text", lambda p: write_gguf(p, {"llama.attention.head_count": "2"}),
     "llama.attention.head_count: Input should be a valid integer", "data"),
    ("heads that do not divide the width", lambda p: write_gguf(p, {"llama.attention.head_count": 3,
                                                                    "llama.attention.head_count_kv": 1}),
     "llama.attention.key_length: not given, and hidden_size (8) is not a multiple of num_attention_heads (3)", "data"),
    ("a vocabulary of 1e12", lambda p: write_gguf(p, {"llama.vocab_size": 10**12}),
     "llama.vocab_size: Input should be less than or equal to 4194304", "data"),
    ("a vocabulary the embedding does not have", lambda p: write_gguf(p, {"llama.vocab_size": 4096}),
     "tensor model.embed_tokens.weight has shape [16, 8], the metadata implies [4096, 8]", "data"),
    ("more layers than tensors", lambda p: write_gguf(p, {"llama.block_count": 2}),
     "missing tensor model.layers.1.", "data"),
    ("a query projection of the wrong shape", lambda p: write_gguf(p, shapes={**tiny_shapes(1),
                                                                              "blk.0.attn_q.weight": (4, HIDDEN)}),
     "tensor model.layers.0.self_attn.q_proj.weight has shape [4, 8], the metadata implies [8, 8]", "data"),
    ("more tokens than the vocabulary", lambda p: write_gguf(p, tokens=[*TOKENS, "z"]),
     "tokenizer.ggml.tokens: 17 tokens, more than the 16 rows of token_embd.weight", "data"),
    ("tokens that are numbers", lambda p: write_gguf(p, {"tokenizer.ggml.tokens": list(range(VOCAB))}),
     "tokenizer.ggml.tokens: not an array of strings", "data"),
    ("an EOS outside the vocabulary", lambda p: write_gguf(p, {"tokenizer.ggml.eos_token_id": 99}),
     "tokenizer.ggml.eos_token_id: 99 is not a token of the vocabulary (0..15)", "data"),
]


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch) -> None:
    """Conversions go to the test's own cache, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("claim, write, message, before", HOSTILE_GGUFS, ids=[c[0] for c in HOSTILE_GGUFS])
def test_a_hostile_gguf_is_one_line_naming_the_field_before_anything_is_sized(tmp_path, monkeypatch, claim, write,
                                                                            message, before):
    path = write(tmp_path / "hostile.gguf")

    def tripwire(*_, **__):
        raise AssertionError(f"the {before} was reached")

    if before == "reader":  # the header's lengths are checked before gguf.GGUFReader walks them
        monkeypatch.setattr(gguf_loader, "GGUFReader", tripwire)
    monkeypatch.setattr(gguf_loader, "read_tensors", tripwire)  # no tensor data is read for any of them

    def refuse():
        with pytest.raises(ModelLoadError) as error:
            load_model(path)
        assert str(error.value).startswith(f"{path}: {message}") and "\n" not in str(error.value)

    assert peak_bytes(refuse) < SMALL_PEAK


def test_the_tiny_honest_gguf_loads(tmp_path):
    loaded = load_model(write_gguf(tmp_path / "tiny.gguf"))
    assert (loaded.config.vocab_size, loaded.config.head_dim, loaded.config.num_key_value_heads) == (VOCAB, 4, 1)


def test_generate_with_a_hostile_gguf_is_one_line_and_exit_2(tmp_path, capsys):
    path = HOSTILE_GGUFS[0][1](tmp_path / "hostile.gguf")
    assert main(["generate", "--prompt", "a", "--model", str(path)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"kvscope generate: {path}: tokenizer.ggml.token_type: ")
