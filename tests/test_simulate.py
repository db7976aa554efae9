"""Simulate mode: the real scheduler and block manager on a model shape, each iteration priced by the cost model."""

from __future__ import annotations

import math

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.schema import parse_event
from kvscope.backend.perf.cost_model import BatchItem, iteration_cost, resident_bytes
from kvscope.backend.perf.simulate import PoolShape
from kvscope.backend.perf.whatif import deployment
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario, ScenarioError
from kvscope.cli import main

H100_8B = deployment("llama-3-8b", "h100")


def utilization_for(tokens: int, dep=H100_8B) -> float:
    """The gpu_memory_utilization that leaves a KV pool of about `tokens` tokens after the weights."""
    return (resident_bytes(dep) + tokens * dep.kv_bytes_per_token + 1e6) / dep.hardware.memory_bytes


def scenario(engine: dict | None = None, simulate: dict | None = None, **fields) -> Scenario:
    data = {"name": "sim", "seed": 0,
            "simulate": {"model_shape": "llama-3-8b", "hardware": "h100", **(simulate or {})},
            "engine": {"block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512, **(engine or {})},
            "generate": {"count": 12, "arrival": {"process": "uniform", "rate_per_step": 0.5},
                         "prompt_tokens": {"min": 16, "max": 200}, "max_tokens": {"min": 4, "max": 40},
                         "sampling": {"temperature": 1.0, "seed": 3}}}
    return Scenario.model_validate({**data, **fields})


def run(s: Scenario, level: str = "full", on_step=None) -> tuple[ScenarioRun, list[dict]]:
    events: list[dict] = []
    bus = EventBus(level=level)
    bus.subscribe(events.append)
    sim = ScenarioRun(s, bus)
    sim.run(on_step)
    return sim, events


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_a_simulated_run_emits_the_same_events_as_a_real_one_each_validating_strictly():
    _, events = run(scenario())
    for e in events:
        parse_event(e)
    kinds = {e["type"] for e in events}
    assert {"header", "request_arrived", "iteration", "block_alloc", "token", "attention_mask", "request_finished",
            "metrics", "run_finished"} <= kinds
    header = events[0]
    assert header["simulated"]["model_shape"] == "llama-3-8b" and header["simulated"]["hardware"] == "h100"
    assert header["model"]["name"] == "llama-3-8b" and header["model"]["n_layers"] == 32
    assert header["model"]["vocab_size"] == 128256 and header["model"]["eos_token_ids"] == []
    assert header["attention_backend"] == "simulated"
    assert all(e["bound"] in ("memory", "compute") and e["intensity"] > 0 for e in of(events, "iteration"))


def test_each_request_runs_to_its_max_tokens():
    s = scenario()
    sim, events = run(s)
    done = {e["request_id"]: e for e in of(events, "request_finished")}
    asked = {e["request_id"]: e["max_tokens"] for e in of(events, "request_arrived")}
    assert len(done) == 12 and all(e["finish_reason"] == "length" for e in done.values())
    assert {rid: len(e["output_token_ids"]) for rid, e in done.items()} == asked


def test_modelled_times_are_the_cost_models():
    """No chunked prompt here (budget 512 > any prompt), so an event's batch prices exactly as the runner's."""
    _, events = run(scenario())
    clock = 0.0
    for it in of(events, "iteration"):
        cost = iteration_cost(H100_8B, it["batch"])
        assert it["duration_s"] == pytest.approx(cost.time_s, rel=1e-9)
        assert (it["intensity"], it["bound"]) == (pytest.approx(cost.intensity), cost.bound)
        clock += it["duration_s"]
        assert it["t"] == pytest.approx(clock, rel=1e-9)  # the clock moves only by priced iterations
    # TTFT: from the arrival to the end of the iteration that drew the first token, in modelled seconds.
    t_of_step = {it["step"]: it["t"] for it in of(events, "iteration")}
    arrived = {e["request_id"]: e["t"] for e in of(events, "request_arrived")}
    first = {}
    for e in of(events, "token"):
        first.setdefault(e["request_id"], t_of_step[e["step"]])
    for e in of(events, "request_finished"):
        assert e["ttft_s"] == pytest.approx(first[e["request_id"]] - arrived[e["request_id"]], rel=1e-9, abs=1e-12)


def test_block_manager_invariants_hold_under_pressure_with_preemptions():
    s = scenario(simulate={"gpu_memory_utilization": utilization_for(640)},
                 engine={"max_num_seqs": 12, "prefix_caching": True},
                 generate={"count": 12, "arrival": {"process": "burst"}, "prompt_tokens": {"min": 16, "max": 200},
                           "max_tokens": {"min": 20, "max": 60}, "shared_prefix": {"tokens": 32, "fraction": 0.5}})
    checked = []

    def check(r: ScenarioRun) -> None:
        r.engine.blocks.check_invariants(r.engine.live_sequences())
        checked.append(r.engine.step_no)

    sim, events = run(s, "summary", check)
    assert of(events, "preempt") and len(checked) == sim.engine.step_no
    assert all(e["finish_reason"] == "length" for e in of(events, "request_finished"))


def test_the_kv_pool_is_gpu_memory_times_utilization_less_the_weights_per_rank():
    dep = deployment("llama-3-70b", "h100", tp=8)
    sim, events = run(scenario(simulate={"model_shape": "llama-3-70b", "tp": 8}), "off")
    info, cache = events[0]["simulated"], events[0]["cache"]
    pool = 80e9 * 0.9 - resident_bytes(dep)
    assert info["kv_pool_bytes_per_gpu"] == pytest.approx(pool)
    assert info["kv_bytes_per_token_per_gpu"] == 320 * 1024 / 8  # 8 KV heads over 8 ranks: one each
    assert cache["num_blocks"] == math.floor(pool / (16 * info["kv_bytes_per_token_per_gpu"]))
    assert cache["bytes_per_block"] == 16 * 320 * 1024  # the whole model's block, as the KV formula says
    assert isinstance(sim.engine.cache, PoolShape)  # sizes only: no tensor of the real model's size


def test_a_big_shape_simulates_without_weights():
    sim, _ = run(scenario(simulate={"model_shape": "llama-3-70b", "tp": 8},
                          engine={"max_num_seqs": 32, "max_num_batched_tokens": 2048},
                          generate={"count": 32, "arrival": {"process": "burst"},
                                    "prompt_tokens": {"min": 64, "max": 512}, "max_tokens": {"min": 16, "max": 64}}),
                 "off")
    assert sim.summary()["finished"] == 32  # bench/latency.py times it: a second or two on 2 cores


def test_an_int8_cache_and_int4_weights_change_the_modelled_time():
    base = sum(e["duration_s"] for e in of(run(scenario(), "summary")[1], "iteration"))
    kv8 = sum(e["duration_s"] for e in of(run(scenario(engine={"kv_cache_dtype": "int8"}), "summary")[1], "iteration"))
    w4 = sum(e["duration_s"] for e in of(run(scenario(engine={"weight_quant": "int4"}), "summary")[1], "iteration"))
    assert w4 < kv8 < base


def test_parallel_sampling_and_beams_run_in_simulation():
    s = scenario(generate=None, requests=[
        {"id": "n", "prompt_tokens": 40, "max_tokens": 6, "sampling": {"n": 3, "temperature": 1.0, "seed": 1}},
        {"id": "beams", "prompt_tokens": 40, "max_tokens": 6, "sampling": {"beam_width": 2}}])
    _, events = run(s)
    for e in events:
        parse_event(e)
    done = {e["request_id"]: e for e in of(events, "request_finished")}
    assert len(done["n"]["outputs"]) == 3 and of(events, "seq_fork")


def test_simulate_mode_refuses_speculative_decoding_and_weights_that_do_not_fit():
    with pytest.raises(ScenarioError, match="engine.speculative"):
        ScenarioRun(scenario(engine={"speculative": {"method": "ngram"}}))
    with pytest.raises(ScenarioError, match="raise tp"):
        ScenarioRun(scenario(simulate={"model_shape": "llama-3-70b"}))


def test_paged_keeps_96_percent_of_reserved_slots_holding_tokens_and_contiguous_far_fewer():
    """The vLLM paper (Kwon et al. 2023, §2.3 and fig. 2): pre-paging servers use 20.4-38.2% of their KV
    memory for token states; vLLM wastes under 4%. Same request mix, same pool, kv_waste from the metrics."""
    def held_of_reserved(layout: str) -> float:
        s = scenario(simulate={"gpu_memory_utilization": utilization_for(16384)},
                     engine={"kv_layout": layout, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
                             "max_model_len": 2048, "prefix_caching": False, "events": "off"},
                     generate={"count": 16, "arrival": {"process": "burst"},
                               "prompt_tokens": {"min": 128, "max": 512}, "max_tokens": {"min": 64, "max": 256}})
        sim, events = run(s, "off")
        assert sim.summary()["finished"] == 16
        # kv_waste is reserved-but-empty slots over the pool, kv_usage reserved over the pool.
        metrics = [e for e in of(events, "metrics") if e["kv_usage"] > 0]
        return sum(1 - e["kv_waste"] / e["kv_usage"] for e in metrics) / len(metrics)

    paged, contiguous = held_of_reserved("paged"), held_of_reserved("contiguous")
    assert paged >= 0.96
    assert contiguous < 0.4


# ---- the command line ------------------------------------------------------------------------------

def test_run_simulate_prints_the_metrics_table_in_modelled_time(capsys, tmp_path):
    report = tmp_path / "r.json"
    code = main(["run", "shared-prefix", "--simulate", "--model-shape", "llama-3-70b", "--hardware", "h100",
                 "--tp", "8", "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 0 and "TTFT" in out and "simulated: llama-3-70b on 8 x NVIDIA H100" in out
    assert '"model_shape": "llama-3-70b"' in report.read_text()


@pytest.mark.parametrize("argv, message", [
    (["--simulate", "--model-shape", "llama-3-7b"], "--model-shape llama-3-7b: .*valid: deepseek-v2-lite, llama-3-70b"),
    (["--simulate", "--model-shape", "llama-3-8b", "--hardware", "h1000"], "--hardware h1000: .*valid: h100, h200"),
    (["--simulate", "--model-shape", "llama-3-8b", "--tp", "3"], "--tp 3: "),
    (["--simulate"], "--simulate: needs --model-shape"),
    (["--model-shape", "llama-3-8b"], "--model-shape: only with --simulate"),
])
def test_run_simulate_refuses_bad_flags_in_one_line(capsys, argv, message):
    import re

    assert main(["run", "shared-prefix", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
