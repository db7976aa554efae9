"""A recorded run priced on other hardware: the modelled times, the model's sizes, the latencies, the roofline."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.history import Cell, Column, RunHistory
from kvscope.backend.events.state import RunState
from kvscope.backend.perf.cost_model import BatchItem, iteration_cost
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.hardware import HardwareProfile, profile_from
from kvscope.backend.perf.machine_cache import CACHE_VERSION
from kvscope.backend.perf.model_run import (ModelledStep, RequestSteps, batch_item, layer_quant, modelled_latency,
                                    modelled_times, run_deployment, run_shape)
from kvscope.backend.perf.shapes import get_shape
from kvscope.backend.perf.whatif import deployment
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario

SMOL = get_shape("smollm2-135m").config
FIGURES = {"version": CACHE_VERSION, "host": "h", "device": "test CPU", "fp32_flops": 7e10, "bf16_flops": 7e10,
           "mem_bandwidth": 3e10, "gemv_efficiency": 0.5, "gemm_efficiency": 0.3, "memory_bytes": 1e10,
           "measured_at": "2026-12-01T00:00:00+00:00"}
HEADER = {"model": {"name": "llama-3-8b", "dtype": "bfloat16"}, "config": {}, "weights": None}


def iteration(step: int, *rows: tuple[str, int, int]) -> dict:
    return {"type": "iteration", "step": step, "batch": [
        {"request_id": f"r{i}", "seq_id": i, "phase": p, "num_query_tokens": q, "context_len": c}
        for i, (p, q, c) in enumerate(rows)]}


def smol_header(name: str = "elsewhere/smollm2", dtype: str = "float32") -> dict:
    """A header as the engine writes it for SmolLM2's sizes: no hidden or MLP size, the weights' bytes."""
    params = get_shape("smollm2-135m").num_parameters()
    model = {"name": name, "n_layers": SMOL.num_hidden_layers, "n_heads": SMOL.num_attention_heads,
             "n_kv_heads": SMOL.num_key_value_heads, "head_dim": SMOL.head_dim, "attention": "gqa",
             "vocab_size": SMOL.vocab_size, "dtype": dtype, "kv_bytes_per_token": 0}
    return {"model": model, "config": {}, "weights": {"bytes_unquantized": params * 4}}


# ---- modelled times ---------------------------------------------------------------------------------

def test_each_iteration_costs_what_the_cost_model_says_for_its_batch_on_the_chosen_hardware():
    events = [iteration(0, ("prefill", 512, 512)), iteration(1, ("decode", 1, 513), ("prefill", 64, 64)),
              iteration(2)]  # an empty iteration is skipped
    steps = modelled_times(HEADER, events, "h100")
    dep = deployment("llama-3-8b", "h100")
    assert [s.step for s in steps] == [0, 1]
    for s, e in zip(steps, events):
        cost = iteration_cost(dep, e["batch"])
        assert (s.time_s, s.flops, s.bytes, s.bound) == (cost.time_s, cost.flops, cost.bytes, cost.bound)
    assert [s.phase for s in steps] == ["prefill", "prefill"]  # 64 prefill tokens outweigh one decode
    assert modelled_times(HEADER, [iteration(5, ("decode", 1, 600))], "h100")[0].phase == "decode"


def test_other_hardware_and_more_gpus_change_the_times():
    events = [iteration(0, *[("decode", 1, 1024)] * 8)]
    h100, l4 = (modelled_times(HEADER, events, hw)[0].time_s for hw in ("h100", "l4"))
    assert l4 > 3 * h100  # decode is memory-bound: 3.35 TB/s against 0.3 TB/s
    assert modelled_times(HEADER, events, "h100", tp=2)[0].time_s < h100
    with pytest.raises(PerfError, match="single device"):
        modelled_times(HEADER, events, profile_from(FIGURES), tp=2)  # this-machine is one device


def test_a_recompute_row_is_a_prefill_that_samples_once():
    assert batch_item("recompute", 40, 40) == BatchItem("prefill", 40, 40)
    assert batch_item("decode", 40, 40) == BatchItem("prefill", 40, 40)  # no KV cache: the events say decode
    assert batch_item("decode", 1, 40) == BatchItem("decode", 1, 40)
    header = {**HEADER, "config": {"kv_cache": False}}
    recompute = modelled_times(header, [iteration(0, ("decode", 40, 40))], "h100")[0]
    assert recompute.phase == "recompute"
    assert recompute.flops == iteration_cost(deployment("llama-3-8b", "h100"), [BatchItem("prefill", 40, 40)]).flops


def test_the_run_is_modelled_as_it_was_stored_quantized_weights_and_int8_kv():
    header = {**HEADER, "config": {"weight_quant": "int4", "quant_group_size": 64, "kv_cache_dtype": "int8"}}
    dep, _ = run_deployment(header, "h100")
    assert (dep.weight_quant, dep.kv_cache_dtype, dep.quant_group_size) == ("int4", "int8", 64)
    events = [iteration(0, ("decode", 1, 4096))]
    assert modelled_times(header, events, "h100")[0].bytes < modelled_times(HEADER, events, "h100")[0].bytes / 3


def test_a_gguf_file_run_natively_is_priced_by_its_own_layers_int8_lm_head_included():
    header = smol_header()  # as quant.native_summary writes it for SmolLM2's Q4_1 file
    header["weights"] |= {"quant": "int4", "group_size": 32, "lm_head": "int8 per row", "gguf": {"Q4_1": 210},
                          "layers": {"int4 g32": 210, "int8 per row": 1}}
    dep, _ = run_deployment(header, profile_from(FIGURES))
    assert (dep.weight_quant, dep.quant_group_size, dep.lm_head_quant) == ("int4", 32, ("int8", 0))
    lm_head, q_proj = dep.shape.lm_head(), dep.shape.attention_linears()[0]
    assert dep.weight_bytes(lm_head) == lm_head.params + 2  # int8 codes, one bf16 scale (per-row scales: 98 KB)
    assert dep.weight_bytes(q_proj) == q_proj.params / 2 + q_proj.params / 32 * 4  # int4 g32, bf16 scale + zero
    assert layer_quant("float32") == ("none", 0) and layer_quant("int4 g64") == ("int4", 64)


# ---- the model's sizes -----------------------------------------------------------------------------

def test_sizes_come_from_a_named_shape_a_shipped_config_or_the_header():
    named = run_shape({"name": "llama-3-8b", "dtype": "bfloat16"})
    assert named.source == "the named shape llama-3-8b" and named.shape.config.intermediate_size == 14336
    shipped = run_shape({"name": "demo", "dtype": "float32"})
    assert shipped.source == "demo's config.json"
    assert (shipped.shape.config.hidden_size, shipped.shape.config.intermediate_size) == (256, 768)
    assert shipped.shape.dtype == "float32"  # the run's dtype, not the file's float16
    assert run_shape({"name": "smollm2", "dtype": "float32"}).source == "the named shape smollm2-135m"
    gone = run_shape({"name": "/a/folder/not/here", "dtype": "float32",  # a trace from another machine
                      "config": shipped.shape.config.model_dump(mode="json")})
    assert gone.source == "the trace header" and gone.shape.config.intermediate_size == 768
    h = smol_header()
    estimated = run_shape(h["model"], h["weights"])
    assert estimated.source == "estimated from the trace header"
    c = estimated.shape.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (576, 1536, 30)


def test_a_header_that_cannot_be_sized_says_why():
    h = smol_header()
    with pytest.raises(PerfError, match="no weight bytes"):
        run_shape(h["model"], None)
    with pytest.raises(PerfError, match="MLA"):
        run_shape({**h["model"], "attention": "mla"}, h["weights"])
    with pytest.raises(PerfError, match="num_attention_heads"):
        run_shape({**h["model"], "n_kv_heads": 4}, h["weights"])  # 9 heads, 4 KV heads: no model has that
    assert run_shape({**h["model"], "name": ""}, h["weights"]).source == "estimated from the trace header"
    with pytest.raises(PerfError, match="model.dtype"):
        run_shape({**h["model"], "dtype": "float8"}, h["weights"])


# ---- latencies --------------------------------------------------------------------------------------

def test_modelled_ttft_tpot_and_throughput_follow_the_engine_time_rules():
    steps = [ModelledStep(s, "decode", t, 1.0, 1.0, "memory") for s, t in ((0, 1.0), (1, 2.0), (2, 3.0), (4, 4.0))]
    requests = [RequestSteps(1, 2, 4, 3),  # TTFT: steps 1..2 = 5 s; TPOT: (step 3 idle + 4) / 2 later tokens
                RequestSteps(0, 0, None, 1),  # TTFT 1 s; not finished: no TPOT
                RequestSteps(3, None, None, 0)]  # no first token yet
    latency = modelled_latency(steps, requests, output_tokens=20)
    assert latency.ttft_s == pytest.approx((5.0 + 1.0) / 2)
    assert latency.tpot_s == pytest.approx(2.0)
    assert latency.tokens_per_s == pytest.approx(2.0)  # 20 tokens over 10 s
    assert modelled_latency([], [], 0) == type(latency)(None, None, None)
    # joined mid-run: the record starts at step 1, so the request that arrived at 0 is left out
    partial = modelled_latency(steps[1:], requests, output_tokens=0, known_from=1)
    assert partial.ttft_s == pytest.approx(5.0) and partial.tokens_per_s is None  # no token events on record


def test_modelled_ttft_counts_the_requests_there_from_the_start_as_engine_time_does(tiny):
    """Requests there before the first iteration arrive at step -1: they were left out, so the modelled
    TTFT showed "-" in most demo runs. Priced at the engine's own durations, it is the engine's TTFT."""
    from kvscope.frontend.hardware import request_steps

    scenario = Scenario.model_validate({"name": "t", "model": "demo", "engine": {"block_size": 4, "num_blocks": 64},
                                        "requests": [{"id": "a", "prompt": "ROMEO:", "max_tokens": 4},
                                                     {"id": "b", "prompt": "KING:", "max_tokens": 3,
                                                      "arrival_step": 2}]})
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(scenario, bus, loaded=tiny).run()
    state, history = RunState(), RunHistory()
    for e in events:
        state.apply(e)
        history.apply(e, state)
    assert state.requests["a"].arrival_step == -1
    steps = [ModelledStep(e["step"], "decode", e["duration_s"], 1.0, 1.0, "memory")
             for e in events if e["type"] == "iteration" and e["batch"]]
    latency = modelled_latency(steps, request_steps(state), output_tokens=7)
    engine = [history.engine_ttft(r.arrival_step, r.first_token_step) for r in state.requests.values()]
    assert len(request_steps(state)) == 2 and latency.ttft_s == pytest.approx(sum(engine) / 2)


# ---- the dashboard's side: priced columns, roofline points, this-machine -------------------------------

def test_columns_are_priced_incrementally_as_the_events_are():
    from kvscope.frontend.hardware import ModelledRun

    dep, shaped = run_deployment(HEADER, "h100")
    cols = [Column(0, 0.1, 0.1, [Cell("a", "prefill", 32, 32), Cell("b", "waiting")], 32, 64, 4),
            Column(1, 0.2, 0.1, [Cell("b", "waiting")], 0, 64, 4),  # nothing ran
            Column(2, 0.3, 0.1, [Cell("a", "decode", 1, 33), Cell("b", "prefill", 16, 16)], 17, 64, 4)]
    run = ModelledRun(dep, shaped.source)
    run.extend(cols[:1])
    run.extend(cols)
    events = [iteration(0, ("prefill", 32, 32)), iteration(2, ("decode", 1, 33), ("prefill", 16, 16))]
    assert list(run.steps.values()) == modelled_times(HEADER, events, "h100")
    t0, t2 = run.steps[0].time_s, run.steps[2].time_s
    assert [run.clock(c) for c in cols] == [(t0, t0), (t0, 0.0), (t0 + t2, t2)]


def test_a_roofline_point_is_intensity_against_attained_flops_under_the_roofs():
    from kvscope.frontend.views.roofline import roof_line, roofline_point

    step = modelled_times(HEADER, [iteration(3, *[("decode", 1, 1024)] * 4)], "h100")[0]
    x, y, at, micros, roofs, compute, memory, fixed, measured = roofline_point(step)
    assert (x, at, measured) == (step.flops / step.bytes, 3, False) and y == pytest.approx(step.flops / step.time_s)
    assert micros == round(step.time_s * 1e6, 2)
    # The split the tooltip shows: the roofs' time (memory-bound here) plus the profile's fixed cost
    assert fixed == pytest.approx(50.0) and roofs + fixed == pytest.approx(micros, abs=0.02)
    assert compute < memory == pytest.approx(roofs, rel=1e-3)
    peak, bw = 989.4e12, 3.35e12
    line = roof_line(peak, bw, x, x)
    (x0, y0), (ridge, top), (x1, y1) = line
    assert ridge == pytest.approx(peak / bw) and top == y1 == peak
    assert y0 == pytest.approx(bw * x0) and x0 <= x <= x1
    assert y < min(bw * x, peak)  # overhead keeps every iteration under its roof


async def test_this_machine_is_measured_in_a_thread_while_the_page_keeps_running(monkeypatch):
    from kvscope.frontend import hardware
    from kvscope.frontend.client import RunFeed

    loop_thread = threading.current_thread()
    measured_in: list[threading.Thread] = []
    released = threading.Event()  # the measurement lasts until the page has run on ten times without it

    datasheet = hardware.get_hardware

    def slow_measurement(name: str) -> HardwareProfile:
        if name != "this-machine":
            return datasheet(name)
        measured_in.append(threading.current_thread())
        released.wait(timeout=60)  # on the loop's thread it would hold the page: no tick would come to release it
        return profile_from(FIGURES)

    monkeypatch.setattr(hardware, "read_cache", lambda: None)
    monkeypatch.setattr(hardware, "get_hardware", slow_measurement)
    choice = hardware.HardwareChoice(RunFeed(None, "x"))
    heard: list[str | None] = []
    choice.on_change(lambda: heard.append(choice.problem()))
    task = asyncio.create_task(choice.choose("this-machine", 1))
    ticks = 0
    while not task.done():  # bounded: the measurement returns within 60 s whatever happens
        ticks += 1
        if ticks == 10:
            released.set()
        await asyncio.sleep(0.01)
    assert ticks >= 10 and measured_in and measured_in[0] is not loop_thread
    assert heard[0].startswith("measuring this machine") and choice.label == "test CPU (measured)"
    monkeypatch.setattr(hardware, "read_cache", lambda: FIGURES)  # the next choice reads the cache
    monkeypatch.setattr(hardware, "get_hardware", lambda name: pytest.fail("measured twice"))
    await choice.choose("this-machine", 1)
    assert choice.profile.mem_bandwidth == FIGURES["mem_bandwidth"]


def test_a_simulated_run_is_kept_by_the_reducer_and_says_so_in_the_modelled_line():
    from kvscope.backend.events.state import RunState
    from kvscope.backend.perf.model_run import ModelledLatency
    from kvscope.frontend.views.metrics import modelled_text

    header = {"type": "header", "seq": 0, "step": -1, "t": 0.0, "schema_version": 1, "run_id": "r", "scenario": None,
              "config": {}, "model": {"name": "llama-3-8b", "dtype": "bfloat16"}, "cache": {"num_blocks": 4}}
    for extra, simulated in (({"simulated": True}, True), ({}, False)):  # headers before simulate mode lack it
        state = RunState()
        state.apply({**header, **extra})
        assert state.simulated is simulated and RunState.from_snapshot(state.snapshot()).simulated is simulated
    latency = ModelledLatency(2.5e-4, 4e-5, 12_345.6)
    assert modelled_text(latency, "NVIDIA L4 24GB", False) == \
        "modelled on NVIDIA L4 24GB: mean TTFT 250 µs · mean TPOT 40 µs · 12,346 tokens/s"
    assert modelled_text(latency, "NVIDIA L4 24GB", True).startswith("simulated run (no weights ran")


# ---- the fixed cost: the third limit ---------------------------------------------------------------

def test_a_step_measured_here_keeps_its_clock_and_what_its_roofs_do_not_explain_is_its_fixed_cost():
    from kvscope.backend.perf.model_run import as_measured, median_fixed_s

    priced = modelled_times(smol_header(), [iteration(7, ("decode", 1, 40))], profile_from(FIGURES))[0]
    assert priced.roof_s > 0 and priced.fixed_s == pytest.approx(priced.time_s - priced.roof_s)
    measured = as_measured(priced, 3 * priced.roof_s)  # the engine took twice the roofs' time beyond them
    assert measured.measured and measured.time_s == pytest.approx(3 * priced.roof_s)
    assert measured.fixed_s == pytest.approx(2 * priced.roof_s) and measured.limit == "fixed cost"
    assert as_measured(priced, priced.roof_s / 2).fixed_s == 0.0  # faster than the roofs: no negative cost
    assert median_fixed_s([measured, priced, as_measured(priced, priced.roof_s + 1.0)]) == measured.fixed_s
    assert median_fixed_s([measured], phase="prefill") is None


def test_the_dashed_roof_is_the_roofs_lowered_by_the_fixed_cost():
    from kvscope.frontend.views.roofline import fixed_cost_line

    peak, bw, nbytes, fixed = 1e12, 1e10, 1e8, 0.02  # a 100 MB step: 10 ms at the bandwidth roof, +20 ms fixed
    line = fixed_cost_line(peak, bw, nbytes, fixed, 1.0, 10.0)
    assert line[0][0] <= 1.0 and line[-1][0] >= 400  # spans the ridge (100 FLOP/B) as the roofs do
    for x, y in line:
        assert y == pytest.approx(x * nbytes / (max(x * nbytes / peak, nbytes / bw) + fixed))
        assert y < min(bw * x, peak)  # always under the roofs
    assert line[0][1] == pytest.approx(line[0][0] * bw / 3)  # memory-bound: a third of the slanted roof
    assert fixed_cost_line(peak, bw, nbytes, 0.0, 1.0, 10.0) == []  # no fixed cost, nothing to draw


def test_a_run_on_this_machine_is_set_against_its_measured_roofs_only_where_it_ran_here():
    from kvscope.frontend.hardware import HardwareChoice

    class Feed:
        epoch, history = 0, RunHistory()
        state = RunState()

    here = profile_from(FIGURES)
    assert here.measures("cpu") and not here.measures("cuda:0") and not here.measures(None)
    assert not profile_from({**FIGURES, "device": "NVIDIA H100"}).measures("cpu")
    assert not HardwareProfile("h100", "H100", 1, 1, 1, 1, 1, None, "").measures("cuda")  # a datasheet: not measured
    feed = Feed()
    feed.state.model, feed.state.device = smol_header()["model"], "cpu"
    feed.state.weights = smol_header()["weights"]
    choice = HardwareChoice(feed)
    choice.profile, choice.name = here, "this-machine"
    cols = [Column(0, 0.05, 0.05, [Cell("a", "decode", 1, 40)], 1, 64, 4)]
    feed.history.columns = cols
    run = choice.modelled()
    assert run is not None and run.measured
    assert run.roofline_steps[0].measured and run.roofline_steps[0].time_s == 0.05 and run.roofline_steps[0].fixed_s > 0
    assert not run.steps[0].measured  # the timeline's modelled axis and the modelled latencies stay modelled
    feed.state.config, choice._runs = {"tensor_parallel": 2}, {}  # it ran over 2 ranks, priced on one: a model
    assert not choice._run().measured
    feed.state.config, feed.state.simulated, choice._runs = {}, True, {}  # simulate mode's times are modelled
    assert not choice._run().measured
