"""backend/perf/disaggregation.py prices disaggregated prefill and decode against colocated engines, and
bench/disaggregation.py sets it against a measured run (its numbers not judged here: CI is noisy).

The pricing: a transfer is the link's latency plus the prompt's whole blocks over its lanes; a decode
instance's TPOT is a fixed point of its step and its batch, so more decode instances lower it under load;
long prompts lengthen a colocated engine's steps and leave a decode instance's alone; a load that a part
cannot carry saturates the deployment; a bad input is a PerfError naming its field.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import disaggregation as bench
from kvscope import cli
from kvscope.backend.perf import calibrate
from kvscope.backend.perf.disaggregation import (Pool, RequestClass, compare, fixed_point, format_table,
                                                 mg1_wait, price_colocated, price_disaggregated, prompt_chunks)
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.hardware import INFINIBAND, NVLINK4
from kvscope.backend.perf.whatif import deployment

LLAMA_70B_KV = 80 * 2 * 8 * 128 * 2  # bytes per token: layers x (K, V) x KV heads x head_dim x bf16


@pytest.fixture(scope="module")
def tp4():
    return deployment("llama-3-70b", "h100", tp=4)


@pytest.fixture(scope="module")
def h100():
    return deployment("llama-3-8b", "h100")


def test_a_transfer_is_the_links_latency_plus_the_prompts_whole_blocks_over_its_lanes(tp4):
    # 2,001 tokens fill 126 blocks of 16: 2,016 tokens' KV moves, a quarter over each of 4 rank pairs.
    one = [RequestClass(2001, 128, 1.0)]
    over_ib = price_disaggregated(Pool(tp4, 1), Pool(tp4, 1), INFINIBAND, one).classes[0]
    assert over_ib.kv_bytes == 2016 * LLAMA_70B_KV
    assert over_ib.transfer_s == pytest.approx(10e-6 + 2016 * LLAMA_70B_KV / (4 * 50e9))
    assert over_ib.ttft_s == pytest.approx(over_ib.queue_s + over_ib.prefill_s + over_ib.transfer_s)
    over_nvlink = price_disaggregated(Pool(tp4, 1), Pool(tp4, 1), NVLINK4, one).classes[0]
    assert over_nvlink.transfer_s == pytest.approx(8e-6 + 2016 * LLAMA_70B_KV / (4 * 450e9))
    assert over_nvlink.prefill_s == over_ib.prefill_s and over_nvlink.queue_s == over_ib.queue_s


def test_a_colocated_engine_moves_nothing(tp4):
    priced = price_colocated(Pool(tp4, 2), [RequestClass(2001, 128, 1.0)]).classes[0]
    assert priced.transfer_s == 0 and priced.kv_bytes == 0


def test_more_decode_instances_lower_tpot_under_load(h100):
    load = [RequestClass(1024, 256, 20.0)]
    one = price_disaggregated(Pool(h100, 1), Pool(h100, 1), NVLINK4, load)
    two = price_disaggregated(Pool(h100, 1), Pool(h100, 2), NVLINK4, load)
    assert one.saturated is None and two.saturated is None
    assert two.decode_batch < one.decode_batch and two.tpot_s < one.tpot_s
    assert two.classes == one.classes  # the prefill side is the same


def test_the_decode_batch_is_littles_law_at_the_fixed_point(h100):
    load = [RequestClass(1024, 256, 20.0)]
    priced = price_disaggregated(Pool(h100, 1), Pool(h100, 1), NVLINK4, load)
    assert priced.decode_batch == pytest.approx(1 + 20.0 * 255 * priced.tpot_s)


def test_long_prompts_lengthen_a_colocated_engines_steps_and_not_a_decode_instances(h100):
    chat = [RequestClass(256, 256, 10.0)]
    with_documents = chat + [RequestClass(8192, 2, 2.0)]  # long prompts, almost no decoding
    colocated = [price_colocated(Pool(h100, 1), mix).tpot_s for mix in (chat, with_documents)]
    disaggregated = [price_disaggregated(Pool(h100, 1), Pool(h100, 1), NVLINK4, mix).tpot_s
                     for mix in (chat, with_documents)]
    assert colocated[1] > 1.2 * colocated[0]
    assert disaggregated[1] < 1.01 * disaggregated[0]


def test_a_load_the_prefill_instances_cannot_carry_saturates_the_deployment(h100):
    flood = [RequestClass(8192, 64, 1000.0)]
    priced = price_disaggregated(Pool(h100, 1), Pool(h100, 1), NVLINK4, flood)
    assert priced.saturated.startswith("prefill instances") and priced.utilization["prefill"] > 1
    assert math.isinf(priced.tpot_s) and math.isinf(priced.classes[0].ttft_s)
    assert priced.classes[0].kv_bytes > 0  # still what one request would move
    assert priced.to_json()["ttft_s"] is None and priced.to_json()["tpot_s"] is None


def test_weights_that_do_not_fit_one_gpu_saturate_both_layouts():
    result = compare("llama-3-70b", "h100", 2048, 256, 1.0)
    for layout in ("colocated", "disaggregated"):
        assert result[layout]["saturated"].startswith("memory: weights of 141.1 GB per GPU at tp 1")
    assert "saturated: memory" in format_table(result)


def test_prompts_run_in_chunks_of_the_budget_and_only_the_last_samples():
    chunks = prompt_chunks(5000, 2048)
    assert [(c.num_query_tokens, c.context_len, c.samples) for c in chunks] == \
        [(2048, 2048, False), (2048, 4096, False), (904, 5000, True)]


def test_the_queue_is_m_d_1_for_one_prompt_length_and_the_fixed_point_solves_t_equals_step():
    rate, service = 4.0, 0.1  # rho 0.4
    assert mg1_wait([rate], [service]) == pytest.approx(0.4 * service / (2 * 0.6))
    assert math.isinf(mg1_wait([10.0], [0.1]))
    assert fixed_point(lambda t: 1 + 0.5 * t, 100.0) == pytest.approx(2.0)
    assert fixed_point(lambda t: 1 + 2 * t, 100.0) is None  # grows faster than t: no load it can carry


def test_the_comparison_fills_the_same_gpus_and_prints_a_table():
    result = compare("llama-3-70b", "h100", 2048, 256, 4.0, prefill_tp=4, decode_tp=4, link="nvlink4")
    assert result["colocated"]["instances"] == 2 and result["colocated"]["gpus"] == 8
    assert result["disaggregated"]["gpus"] == 8 and result["link"]["lanes"] == 4
    table = format_table(result)
    assert "8 = 2×tp4" in table and "8 = 1×tp4+1×tp4" in table and "over nvlink4 at 450 GB/s × 4 lanes" in table
    json.dumps(result)  # no infinity, no object JSON cannot hold


@pytest.mark.parametrize("change, field", [
    (dict(prompt_tokens=0), "prompt_tokens"), (dict(output_tokens=1), "output_tokens"), (dict(rate=0.0), "rate"),
    (dict(rate=math.nan), "rate"), (dict(prefill_instances=0), "prefill_instances"),
    (dict(decode_instances=0), "decode_instances"), (dict(link="ib"), "link"), (dict(decode_tp=3), "decode_tp"),
    (dict(prefill_tp=16), "prefill_tp"), (dict(colocated_tp=3), "colocated_tp"),
    (dict(hardware="tpu-v5"), "hardware"), (dict(chunk_tokens=0), "chunk_tokens"), (dict(max_batch=0), "max_batch"),
])
def test_a_bad_input_is_refused_naming_its_field(change, field):
    args = dict(model_shape="llama-3-8b", hardware="h100", prompt_tokens=512, output_tokens=64, rate=1.0) | change
    with pytest.raises(PerfError) as refused:
        compare(**args)
    assert refused.value.field == field


def test_the_command_line_prints_the_table_and_names_the_flag_it_refuses(capsys):
    base = ["whatif-disaggregated", "--model-shape", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "512",
            "--output-tokens", "64", "--rate", "1"]
    assert cli.main(base) in (0, None)
    assert "TTFT (ms)" in capsys.readouterr().out
    assert cli.main([*base, "--link", "ib"]) == 2
    assert "kvscope whatif-disaggregated: --link: unknown name 'ib'; valid: nvlink4" in capsys.readouterr().err


FIGURES = {"version": calibrate.CACHE_VERSION, "host": "test", "device": "test CPU", "fp32_flops": 1e11,
           "bf16_flops": 1e11, "mem_bandwidth": 4e10, "gemv_efficiency": 0.45, "gemm_efficiency": 0.3,
           "memory_bytes": 2e10, "measured_at": "2026-12-01T00:00:00+00:00"}


def test_the_bench_runs_a_tiny_workload_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "this_machine", lambda recalibrate: FIGURES)  # the 4 s calibration
    monkeypatch.setattr(bench, "CALIBRATION_TOKENS", 4)
    out = tmp_path / "d.json"
    assert bench.main(["--requests", "4", "--rounds", "1", "--rate", "50", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| TTFT p50 (ms) |" in printed and "| disaggregated 1+1 | KV transfer mean |" in printed
    result = json.loads(out.read_text())
    assert set(result["layouts"]) == set(bench.LAYOUTS)
    for layout, figures in result["layouts"].items():
        assert figures["requests"] == 4 and figures["engines"] == bench.ENGINES[layout]
        assert (figures["kv_bytes_per_request"] > 0) == layout.startswith("disaggregated")
    assert all(row["measured_s"] > 0 for row in result["model"] if row["figure"] != "queue mean")
