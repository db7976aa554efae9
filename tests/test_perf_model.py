"""The roofline cost model: hand-calculated iterations, named shapes and GPUs, calibration, `whatif`."""

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.backend.config import ModelConfig
from kvscope.backend.perf import calibrate, link_calibrate
from kvscope.backend.perf.cost_model import (BatchItem, Deployment, experts_touched, iteration_cost, resident_bytes,
                                     stored_bytes)
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.hardware import DATASHEET, HARDWARE_NAMES, HardwareProfile, LinkProfile, get_hardware, profile_from
from kvscope.backend.perf.shapes import SHAPES, Linear, get_shape, shape_from_config
from kvscope.backend.perf.whatif import decode_knee, deployment, format_table, whatif
from kvscope.cli import build_parser, cmd_whatif, main

ROOT = Path(__file__).resolve().parents[1]

# A model small enough to cost by hand: 2 layers, hidden 8, 2 query heads and 1 KV head of 4, fp32.
TINY = shape_from_config(ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=4), "tiny")
# Round numbers: 1000 FLOP/s, 100 B/s (ridge 10 FLOP/B), no overhead, a 10 B/s link with no latency.
TOY_GPU = HardwareProfile("toy", "toy GPU", 1000.0, 1000.0, 1000.0, 100.0, 1e6, LinkProfile("toy-link", 10.0, 0.0),
                          "test", iteration_overhead_s=0.0)


def ops(cost) -> dict:
    return {op.group: op for op in cost.ops}


# ---- one iteration by hand ------------------------------------------------------------------------

def test_a_row_attends_causally_to_its_context():
    assert BatchItem("decode", 1, 10).keys_attended == 10
    assert BatchItem("prefill", 4, 4).keys_attended == 1 + 2 + 3 + 4
    assert BatchItem("prefill", 3, 10).keys_attended == 8 + 9 + 10  # a later chunk sees the earlier ones


def test_only_sampling_rows_reach_the_lm_head():
    assert BatchItem("prefill", 16, 16).sampled_rows == 1
    assert BatchItem("prefill", 16, 16, samples=False).sampled_rows == 0
    assert BatchItem("decode", 1, 9).sampled_rows == 1
    assert BatchItem("verify", 5, 20).sampled_rows == 5


def test_a_decode_row_costs_what_the_hand_calculation_says():
    cost = iteration_cost(Deployment(TINY, TOY_GPU), [BatchItem("decode", 1, 5)])
    by = ops(cost)
    # q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192 weights a layer, 2 FLOPs and 4 bytes each, 2 layers
    assert (by["attn_proj"].flops, by["attn_proj"].bytes) == (768, 1536)
    # gate, up 8x16 and down 16x8: 384 weights a layer
    assert (by["mlp"].flops, by["mlp"].bytes) == (1536, 3072)
    # 2 layers x 2 heads x (2·4 QK + 2·4 PV) x 5 keys; KV 2·2·1·4·4 = 64 B/token, 5 read + 1 written
    assert (by["attention"].flops, by["attention"].bytes) == (320, 6 * 64)
    assert (by["lm_head"].flops, by["lm_head"].bytes) == (160, 320)
    assert by["mlp"].time_s == pytest.approx(3072 / 100) and by["mlp"].bound == "memory"
    assert cost.flops == 768 + 1536 + 320 + 160
    assert cost.time_s == pytest.approx((1536 + 3072 + 384 + 320) / 100)
    assert cost.bound == "memory" and cost.intensity == pytest.approx(2784 / 5312)


def test_a_prefill_chunk_that_does_not_finish_skips_the_lm_head():
    cost = iteration_cost(Deployment(TINY, TOY_GPU), [BatchItem("prefill", 4, 4, samples=False)])
    assert (ops(cost)["lm_head"].flops, ops(cost)["lm_head"].bytes) == (0, 0)
    assert ops(cost)["attention"].flops == 2 * 2 * 16 * 10


def test_a_group_past_the_ridge_is_compute_bound():
    cost = iteration_cost(Deployment(TINY, TOY_GPU), [BatchItem("prefill", 64, 64)])
    mlp = ops(cost)["mlp"]
    assert mlp.intensity == pytest.approx(64 / 2)  # 2 FLOPs per token per 4-byte weight
    assert mlp.bound == "compute" and mlp.time_s == pytest.approx(mlp.flops / 1000)


def test_a_measured_profile_streams_weights_below_the_roof_and_pays_its_overheads():
    # this-machine's empirical roofline: one token's linears at half the bandwidth, several at a quarter;
    # 1 s per iteration, 2 s per sequence, 3 s per token.
    cpu = replace(TOY_GPU, gemv_efficiency=0.5, gemm_efficiency=0.25, iteration_overhead_s=1.0,
                  row_overhead_s=2.0, token_overhead_s=3.0)
    one = iteration_cost(Deployment(TINY, cpu), [BatchItem("decode", 1, 5)])
    assert ops(one)["mlp"].time_s == pytest.approx(3072 / 50)  # a GEMV: 100 B/s x 0.5
    assert ops(one)["attention"].time_s == pytest.approx(384 / 100)  # the KV cache streams at the roof
    assert one.overhead_s == pytest.approx(1 + 2 + 3)
    two = iteration_cost(Deployment(TINY, cpu), [BatchItem("decode", 1, 5), BatchItem("prefill", 3, 3)])
    assert ops(two)["mlp"].time_s == pytest.approx(3072 / 25)  # four tokens: a GEMM at 100 B/s x 0.25
    assert ops(two)["lm_head"].time_s == pytest.approx(320 / 25)  # two sampling rows: a GEMM too
    assert two.overhead_s == pytest.approx(1 + 2 * 2 + 3 * 4)


def test_iteration_event_batch_items_are_accepted_as_they_are():
    event_batch = [{"request_id": "r0", "seq_id": 0, "phase": "decode", "num_query_tokens": 1, "context_len": 5}]
    assert iteration_cost(Deployment(TINY, TOY_GPU), event_batch).flops == 2784


@pytest.mark.parametrize("item, field", [
    ({"phase": "sample", "num_query_tokens": 1, "context_len": 2}, "batch[0].phase"),
    ({"phase": "decode", "num_query_tokens": 3, "context_len": 2}, "batch[0]"),
    ({"phase": "decode"}, "batch[0]"),
])
def test_a_malformed_batch_item_names_its_field(item, field):
    with pytest.raises(PerfError) as e:
        iteration_cost(Deployment(TINY, TOY_GPU), [item])
    assert e.value.field == field


def test_quantized_weights_count_codes_plus_their_scales_bf16_where_a_kernel_reads_them():
    w = Linear("w", 8, 8)
    assert stored_bytes(w, "bfloat16", "none", 4) == 128
    assert stored_bytes(w, "bfloat16", "int8", 4) == 64 + 8 * 2 * 4
    assert stored_bytes(w, "bfloat16", "int4", 4) == 32 + 8 * 2 * 4
    assert stored_bytes(w, "bfloat16", "int8", 0) == 64 + 2  # one scale per tensor, bf16 for the int8 kernel
    w = Linear("w", 64, 16)  # a group torch's int4 kernel takes: a bf16 zero per group beside each scale
    assert stored_bytes(w, "bfloat16", "int4", 32) == 16 * 32 + 16 * 2 * (2 + 2)


def test_int4_weights_make_a_memory_bound_decode_about_three_times_faster():
    bf16 = whatif("llama-3-8b", "h100", 1, 128)
    int4 = whatif("llama-3-8b", "h100", 1, 128, weight_quant="int4")
    # 2 bytes per weight against 0.5 + (2-byte scale + 2-byte zero) / 64 = 0.5625: at most 3.6x
    assert 3.2 < bf16["time_s"] / int4["time_s"] < 3.6


def test_a_group_size_that_does_not_tile_a_layer_is_refused():
    with pytest.raises(PerfError) as e:
        whatif("smollm2-135m", "h100", 1, 1, weight_quant="int8", quant_group_size=100)
    assert e.value.field == "quant_group_size" and "576" in e.value.reason


def test_kv_bytes_come_from_the_engines_kv_formula_and_split_across_ranks():
    llama = get_shape("llama-3-8b")
    assert Deployment(llama, DATASHEET["h100"]).kv_bytes_per_token == llama.config.kv_bytes_per_token("bfloat16")
    int8 = Deployment(llama, DATASHEET["h100"], kv_cache_dtype="int8").kv_bytes_per_token
    assert int8 == llama.config.kv_bytes_per_token("int8") == 2 * 32 * 8 * (128 + 4)
    assert Deployment(llama, DATASHEET["h100"], tp=2).kv_bytes_per_token == 131072 / 2
    mla = get_shape("deepseek-v2-lite")  # the latent is not split by heads: every rank keeps it whole
    assert Deployment(mla, DATASHEET["h100"], tp=4).kv_bytes_per_token == 27 * (512 + 64) * 2


def test_mla_attends_in_absorbed_form_over_the_latent():
    mla = Deployment(get_shape("deepseek-v2-lite"), DATASHEET["h100"])
    attention = ops(iteration_cost(mla, [BatchItem("decode", 1, 100)]))["attention"]
    assert attention.flops == 27 * 16 * (2 * (512 + 64) + 2 * 512) * 100
    assert attention.bytes == 101 * 27 * 576 * 2


def test_moe_reads_the_experts_its_tokens_touch():
    assert experts_touched(64, 6, 1) == pytest.approx(6)
    assert experts_touched(64, 6, 1000) == pytest.approx(64)
    dep = Deployment(get_shape("deepseek-v2-lite"), DATASHEET["h100"])
    one = iteration_cost(dep, [BatchItem("decode", 1, 1)])
    many = iteration_cost(dep, [BatchItem("decode", 1, 1)] * 512)
    # One token reads about its active weights (2.7B); 512 tokens read nearly all 15.7B.
    assert one.bytes / 2 == pytest.approx(get_shape("deepseek-v2-lite").num_parameters(active_only=True)
                                          - 102400 * 2048, rel=0.01)
    assert many.bytes / 2 > 15e9


# ---- tensor parallelism ---------------------------------------------------------------------------

def test_tensor_parallel_ranks_split_the_weights_and_pay_two_all_reduces_a_layer():
    one = iteration_cost(Deployment(TINY, TOY_GPU), [BatchItem("decode", 1, 5)])
    two = iteration_cost(Deployment(TINY, TOY_GPU, tp=2), [BatchItem("decode", 1, 5)])
    assert ops(two)["mlp"].bytes == ops(one)["mlp"].bytes / 2
    assert ops(two)["attention"].flops == ops(one)["attention"].flops / 2
    reduce = ops(two)["all_reduce"]
    # 2 all-reduces x 2 layers; each rank sends 2·(2-1)/2 of 8 hidden x 4 bytes, at 10 B/s
    assert reduce.link_bytes == 4 * 32 and reduce.time_s == pytest.approx(4 * 32 / 10)
    assert reduce.bound == "link" and reduce.bytes == 0


@pytest.mark.parametrize("shape, hw, tp, says", [("llama-3-8b", "h100", 3, "1, 2, 4, 8"),
                                                 ("smollm2-135m", "h100", 2, "9 attention heads")])
def test_an_impossible_tensor_parallel_degree_is_refused(shape, hw, tp, says):
    with pytest.raises(PerfError) as e:
        whatif(shape, hw, 1, 16, tp=tp)
    assert e.value.field == "tp" and says in e.value.reason


def test_a_single_device_cannot_be_split():
    cpu = replace(DATASHEET["l4"], name="cpu", link=None)
    with pytest.raises(PerfError, match="single device"):
        Deployment(get_shape("llama-3-8b"), cpu, tp=2)


def test_kvscopes_own_ranks_price_the_whole_lm_head_on_rank_0():
    split = iteration_cost(Deployment(TINY, TOY_GPU, tp=2), [BatchItem("decode", 1, 5)])
    rank_0 = iteration_cost(Deployment(TINY, TOY_GPU, tp=2, vocab_parallel=False), [BatchItem("decode", 1, 5)])
    one = iteration_cost(Deployment(TINY, TOY_GPU), [BatchItem("decode", 1, 5)])
    assert ops(rank_0)["lm_head"].bytes == ops(one)["lm_head"].bytes == 2 * ops(split)["lm_head"].bytes
    assert ops(rank_0)["lm_head"].flops == ops(one)["lm_head"].flops
    assert ops(rank_0)["mlp"].bytes == ops(split)["mlp"].bytes  # the rest is split as before


def test_a_local_link_takes_any_degree_and_prices_its_latency_and_the_step_post():
    local = replace(TOY_GPU, link=LinkProfile("gloo", 10.0, 0.5, step_post_s=0.25, local=True))
    two = iteration_cost(Deployment(TINY, local, tp=2), [BatchItem("decode", 1, 5)])
    # 4 all-reduces of 32 B (each rank sends all of it at tp 2) at 10 B/s, plus 0.5 s each; one post
    assert ops(two)["all_reduce"].time_s == pytest.approx(4 * (32 / 10 + 0.5))
    assert ops(two)["step_post"].time_s == 0.25 and ops(two)["step_post"].bound == "link"
    assert "step_post" not in ops(iteration_cost(Deployment(TINY, TOY_GPU, tp=2), [BatchItem("decode", 1, 5)]))
    with pytest.raises(PerfError, match="1, 2, 4, 8"):
        Deployment(get_shape("smollm2-135m"), DATASHEET["h100"], tp=3)
    assert Deployment(get_shape("smollm2-135m"), replace(DATASHEET["h100"], link=local.link), tp=3).tp == 3


def test_a_pcie_link_makes_the_all_reduces_slower_than_nvlink():
    nvlink = whatif("llama-3-70b", "h100", 32, 1024, tp=4)
    pcie = whatif("llama-3-70b", "h100", 32, 1024, tp=4, link="pcie5")
    reduce = {r["link"]: next(op for op in r["ops"] if op["group"] == "all_reduce") for r in (nvlink, pcie)}
    assert reduce["pcie5"]["time_s"] > 3 * reduce["nvlink4"]["time_s"]


# ---- validation against the well-known figure -------------------------------------------------------

def test_llama_3_8b_decode_at_batch_1_on_h100_takes_its_weight_bytes_over_bandwidth():
    dep = deployment("llama-3-8b", "h100")
    weights_over_bandwidth = resident_bytes(dep) / dep.hardware.mem_bandwidth
    assert weights_over_bandwidth == pytest.approx(4.8e-3, rel=0.01)
    tpot = whatif("llama-3-8b", "h100", 1, 512)["time_s"]
    assert tpot == pytest.approx(weights_over_bandwidth, rel=0.10)


def test_decode_turns_compute_bound_at_a_plausible_batch():
    dep = deployment("llama-3-8b", "h100")
    curve = [whatif("llama-3-8b", "h100", b, 128)["bound"] for b in (1, 8, 64, 256, 1024)]
    assert curve == ["memory", "memory", "memory", "memory", "compute"]
    knee = decode_knee(dep, 128)
    assert 256 < knee < 1024  # above the ridge (295 FLOP/B): the KV reads keep intensity below B
    assert whatif("llama-3-8b", "h100", knee - 1, 128)["bound"] == "memory"
    assert whatif("llama-3-8b", "h100", knee, 128)["bound"] == "compute"


def test_long_context_decode_never_turns_compute_bound_with_gqa():
    assert decode_knee(deployment("llama-3-8b", "h100"), 1024) is None


def test_the_docs_knee_table_is_what_the_model_computes():
    row = re.compile(r"^\| `([a-z0-9-]+)` \| [\d.]+ \| (\d+) \| (\w+) \| (\w+) \|", re.M)
    rows = row.findall((ROOT / "docs/perf_model.md").read_text())
    assert {name for name, *_ in rows} == set(DATASHEET)
    for name, ridge, k128, k512 in rows:
        dep = deployment("llama-3-8b", name)
        assert int(ridge) == round(dep.hardware.ridge("bfloat16"))
        assert [str(decode_knee(dep, c) or "none") for c in (128, 512)] == [k128, k512]


# ---- shapes and profiles ------------------------------------------------------------------------------

def test_the_named_shapes_and_gpus_are_the_contracts():
    assert set(SHAPES) == {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b", "deepseek-v2-lite", "smollm2-135m"}
    assert HARDWARE_NAMES == ["h100", "h200", "a100-80gb", "l4", "rtx-4090", "this-machine"]


@pytest.mark.parametrize("name, billions", [("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("qwen2.5-7b", 7.62),
                                            ("mistral-7b", 7.25), ("deepseek-v2-lite", 15.71),
                                            ("smollm2-135m", 0.1345)])
def test_shapes_have_their_published_parameter_counts(name, billions):
    assert get_shape(name).num_parameters() / 1e9 == pytest.approx(billions, rel=0.005)


def test_kv_bytes_per_token_of_the_small_and_the_latent_models():
    assert get_shape("smollm2-135m").config.kv_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2
    assert get_shape("deepseek-v2-lite").config.kv_bytes_per_token("bfloat16") == 27 * (512 + 64) * 2


def test_deepseek_v2_lite_models_its_active_parameters_per_token():
    assert get_shape("deepseek-v2-lite").num_parameters(active_only=True) / 1e9 == pytest.approx(2.66, rel=0.01)


def test_a_loaded_models_config_becomes_a_shape():
    config = ModelConfig.from_hf_dict(json.loads((ROOT / "backend/models/demo-mla/config.json").read_text()))
    result = whatif(shape_from_config(config, "demo-mla"), "l4", 4, 64)
    assert result["model_shape"] == "demo-mla" and result["bound"] == "memory"


@pytest.mark.parametrize("call, field", [(lambda: get_shape("llama-4"), "model_shape"),
                                         (lambda: get_hardware("b200"), "hardware")])
def test_unknown_names_list_the_valid_ones(call, field):
    with pytest.raises(PerfError) as e:
        call()
    assert e.value.field == field and "valid:" in str(e.value) and "\n" not in str(e.value)
    assert ("llama-3-8b" if field == "model_shape" else "this-machine") in str(e.value)


# ---- this machine ------------------------------------------------------------------------------------

def test_calibration_measures_matmul_flops_copy_bandwidth_and_weight_streams_quickly():
    figures = calibrate.calibrate(seconds=0.3, device="cpu")
    assert figures["fp32_flops"] > 1e8 and figures["mem_bandwidth"] > 1e8 and figures["memory_bytes"] > 0
    assert 0 < figures["gemm_efficiency"] <= 1 and 0 < figures["gemv_efficiency"] <= 1
    profile = profile_from(figures)
    assert profile.weight_bandwidth(1) == pytest.approx(figures["mem_bandwidth"] * figures["gemv_efficiency"])
    assert profile.weight_bandwidth(4) == pytest.approx(figures["mem_bandwidth"] * figures["gemm_efficiency"])


FIGURES = {"version": calibrate.CACHE_VERSION, "device": "test CPU", "fp32_flops": 7e10, "bf16_flops": 7e10,
           "mem_bandwidth": 3e10, "gemv_efficiency": 0.5, "gemm_efficiency": 0.25, "memory_bytes": 2e10,
           "measured_at": "2026-12-01T00:00:00+00:00"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "calibrate", lambda: dict(FIGURES, host=calibrate.platform.node()))
    return tmp_path


def test_this_machine_is_measured_once_then_read_from_the_cache(cache_dir, monkeypatch):
    first = get_hardware("this-machine")
    assert json.loads((cache_dir / "kvscope/this-machine.json").read_text())["mem_bandwidth"] == 3e10
    monkeypatch.setattr(calibrate, "calibrate", lambda: pytest.fail("measured again"))
    assert get_hardware("this-machine") == first
    assert first.name == "this-machine" and first.ridge("float32") == pytest.approx(7e10 / 3e10)


def test_a_corrupt_or_foreign_cache_is_measured_again(cache_dir):
    path = cache_dir / "kvscope/this-machine.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dict(FIGURES, host="another-host", mem_bandwidth=1.0)))
    assert calibrate.this_machine()["mem_bandwidth"] == 3e10
    path.write_text("{not json")
    assert calibrate.this_machine()["mem_bandwidth"] == 3e10
    older = {k: v for k, v in FIGURES.items() if "efficiency" not in k}  # version 1: no weight streams
    path.write_text(json.dumps(dict(older, version=1, host=calibrate.platform.node(), mem_bandwidth=1.0)))
    assert calibrate.this_machine()["gemv_efficiency"] == 0.5


def test_this_machine_cannot_be_split_across_ranks(cache_dir):
    with pytest.raises(PerfError, match="single device"):
        whatif("smollm2-135m", "this-machine", 1, 16, tp=2)


LINK = {"version": calibrate.CACHE_VERSION, "backend": "gloo", "latency_s": 3e-4, "bandwidth": 2e9,
        "step_post_s": 1e-4, "samples": [], "measured_at": "2026-12-01T00:00:00+00:00"}


def test_this_machine_over_gloo_is_split_across_processes_with_the_link_measured_once(cache_dir, monkeypatch):
    measured = []
    monkeypatch.setattr(link_calibrate, "measure_link", lambda backend, world: measured.append(world) or
                        dict(LINK, world=world, host=calibrate.platform.node()))
    result = whatif("smollm2-135m", "this-machine", 1, 16, tp=3, link="gloo")
    assert result["link"] == "gloo" and result["tp"] == 3
    reduce = next(op for op in result["ops"] if op["group"] == "all_reduce")
    # 60 all-reduces of one token's hidden state (576 x 2 bytes, bf16): 4/3 of it sent, at 2 GB/s, plus 0.3 ms
    assert reduce["time_s"] == pytest.approx(60 * (4 / 3 * 1152 / 2e9 + 3e-4))
    whatif("smollm2-135m", "this-machine", 4, 16, tp=3, link="gloo")
    assert measured == [3]  # the second what-if read link-gloo-3.json
    assert json.loads((cache_dir / "kvscope/link-gloo-3.json").read_text())["latency_s"] == 3e-4
    with pytest.raises(PerfError, match="gloo or nccl"):
        get_hardware("this-machine", "nvlink4")


# ---- the command ----------------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["whatif", *argv])


def test_whatif_prints_a_table_by_op_group(capsys):
    cmd_whatif(parse("--model-shape", "llama-3-8b", "--hardware", "h100", "--batch", "1", "--context", "1024"))
    out = capsys.readouterr().out
    assert out.startswith("llama-3-8b on NVIDIA H100 SXM5 80GB: decode step of 1 sequence at context 1,024")
    for group in ("attn_proj", "mlp", "attention", "lm_head", "fixed cost", "iteration"):
        assert re.search(rf"^{group} ", out, re.M)
    assert "all_reduce" not in out


def test_whatif_json_has_the_iterations_figures(capsys):
    cmd_whatif(parse("--model-shape", "llama-3-70b", "--hardware", "h200", "--batch", "8", "--context", "512",
                     "--prefill", "--tp", "8", "--kv-cache-dtype", "int8", "--json"))
    result = json.loads(capsys.readouterr().out)
    assert result["bound"] == "compute" and result["phase"] == "prefill" and result["tp"] == 8
    assert result["time_s"] == pytest.approx(sum(op["time_s"] for op in result["ops"]) + result["overhead_s"])
    assert result["flops"] == pytest.approx(sum(op["flops"] for op in result["ops"]))
    assert result["bytes"] > 0 and result["memory"]["fits"]


def test_whatif_gives_three_limits_and_takes_a_measured_fixed_cost(capsys):
    """Compute, memory and the fixed cost side by side; --fixed-ms puts a measured one (eager or compiled) in."""
    assumed = whatif("smollm2-135m", "h100", 1, 512)
    assert assumed["fixed_s"] == assumed["overhead_s"] == 50e-6 and assumed["limit"] == "memory"
    assert assumed["roof_s"] == pytest.approx(sum(op["time_s"] for op in assumed["ops"]))
    assert assumed["compute_s"] < assumed["memory_s"] <= assumed["roof_s"]
    eager = whatif("smollm2-135m", "h100", 1, 512, fixed_s=0.004)
    assert eager["limit"] == "fixed cost" and eager["time_s"] == pytest.approx(eager["roof_s"] + 0.004)
    cmd_whatif(parse("--model-shape", "smollm2-135m", "--hardware", "h100", "--batch", "64", "--context", "512",
                     "--fixed-ms", "4"))
    assert re.search(r"^three limits: compute .* ms, memory .* ms, fixed cost 4 ms: fixed cost dominates$",
                     capsys.readouterr().out, re.M)
    for bad in ("-1", "nan", "inf"):
        assert main(["whatif", "--model-shape", "smollm2-135m", "--hardware", "h100", "--batch", "1", "--context",
                     "16", "--fixed-ms", bad]) == 2
        assert capsys.readouterr().err.startswith("kvscope whatif: --fixed-ms: must be a finite number >= 0")


def test_whatif_table_marks_a_model_that_does_not_fit():
    table = format_table(whatif("llama-3-70b", "l4", 1, 128))
    assert "(does not fit)" in table


def test_whatif_on_a_measured_profile_says_how_fast_weights_stream(cache_dir):
    measured = format_table(whatif("smollm2-135m", "this-machine", 4, 128))
    assert "weights stream at 15.0 GB/s over one token, 7.5 over several (measured; the roof is 30.0 GB/s)" in measured
    assert "weights stream" not in format_table(whatif("smollm2-135m", "h100", 4, 128))  # datasheet: at the roof


def test_whatif_refuses_a_bad_batch_with_its_flag(capsys):
    assert main(["whatif", "--model-shape", "llama-3-8b", "--hardware", "h100", "--batch", "0", "--context", "16"]) == 2
    assert capsys.readouterr().err == "kvscope whatif: --batch: must be >= 1, got 0\n"


def test_whatif_names_the_valid_hardware(capsys):
    assert main(["whatif", "--model-shape", "llama-3-8b", "--hardware", "h1000", "--batch", "1", "--context", "16"]) == 2
    assert "--hardware: unknown name 'h1000'; valid: " in capsys.readouterr().err
