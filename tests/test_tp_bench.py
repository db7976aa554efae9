"""bench/tp.py and the link it measures: a quick run at TP=1 and TP=2 prints measured and predicted steps
side by side (numbers not judged: CI is noisy), the gloo ping fits a latency and a bandwidth, and --cuda
refuses rather than measuring something else."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import tp
from kvscope.backend.perf import calibrate, link_calibrate

FIGURES = {"version": calibrate.CACHE_VERSION, "host": "test", "device": "test CPU, 1 threads", "fp32_flops": 5e10,
           "bf16_flops": 5e10, "mem_bandwidth": 2e10, "gemv_efficiency": 0.6, "gemm_efficiency": 0.4,
           "memory_bytes": 2e10, "measured_at": "2026-12-01T00:00:00+00:00"}


@pytest.fixture
def own_threads():
    """The bench sets one thread for this process (a rank's); the tests after it keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_quick_run_prints_each_step_measured_and_predicted_at_tp1_and_tp2(tmp_path, capsys, monkeypatch,
                                                                           own_threads):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tp, "calibrate", lambda device: FIGURES)
    out = tmp_path / "tp.json"
    assert tp.main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["workload"], r["tp"]) for r in result["rows"]] == [
        ("decode", 1), ("prefill", 1), ("decode", 2), ("prefill", 2)]
    assert result["degrees"] == {"demo": 2} and "demo: TP=2" in printed
    for r in result["rows"]:
        assert r["iterations"] > 0 and r["measured_ms"] > 0 and r["rest_ms"] > 0
        predicted = [r["predicted_ms"], r["predicted_compute_ms"], r["predicted_overhead_ms"], r["predicted_speedup"]]
        assert all(math.isfinite(v) and v > 0 for v in predicted)
        assert len(r["errors"]) == r["iterations"] and all(math.isfinite(e) for e in r["errors"])
        assert f"| demo | {r['workload']} | {r['tp']} | {r['iterations']} |" in printed
    for r in result["rows"]:  # only TP=2 steps all-reduce, measured (rank 0's time) and predicted
        assert (r["allreduce_ms"] > 0) == (r["predicted_allreduce_ms"] > 0) == (r["tp"] == 2)
    link = result["links"]["2"]
    assert link["backend"] == "gloo" and link["bandwidth"] > 0 and link["step_post_s"] > 0
    assert [d["tp"] for d in result["per_degree"]] == [1, 2] and "| demo | 2 |" in printed
    assert all(math.isfinite(d["unfitted_median_abs_error"]) for d in result["per_degree"])
    assert set(result["overhead_s"]) == {"demo TP=1", "demo TP=2"}, "the overheads are fitted at each degree"
    assert not (tmp_path / "cache/kvscope/link-gloo-2.json").exists(), "a smoke run does not replace the cached link"


def test_the_link_fit_recovers_latency_and_bandwidth_from_a_ping():
    # t = 300 µs + sent / 2 GB/s; at 2 ranks each rank sends the whole message
    sizes = [256, 4096, 65536, 1 << 20, 4 << 20]
    latency, bandwidth = link_calibrate.fit_link([(m, 3e-4 + m / 2e9) for m in sizes], 2)
    assert latency == pytest.approx(3e-4) and bandwidth == pytest.approx(2e9)
    # Two points whose line crosses zero below 1 MB: no negative latency, the slope through the origin instead
    latency, bandwidth = link_calibrate.fit_link([(1 << 20, 5e-4), (4 << 20, 3e-3)], 2)
    assert latency == 0 and (4 << 20) / 3e-3 < bandwidth < (1 << 20) / 5e-4  # between the two points' rates


def test_a_ping_between_two_processes_measures_every_size(own_threads):
    figures = link_calibrate.measure_link("gloo", 2, repeats=3, sizes=(256, 65536))
    assert [size for size, _ in figures["samples"]] == [256, 65536]
    assert all(seconds > 0 for _, seconds in figures["samples"]) and figures["step_post_s"] > 0


def test_cuda_without_a_gpu_stops_with_a_message(capsys, monkeypatch, own_threads):
    monkeypatch.setattr(tp.torch.cuda, "is_available", lambda: False)
    assert tp.main(["--cuda", "--quick"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_cuda_with_fewer_gpus_than_ranks_stops_with_a_message(capsys, monkeypatch, own_threads):
    monkeypatch.setattr(tp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tp.torch.cuda, "device_count", lambda: 1)
    assert tp.main(["--cuda", "--quick"]) == 2
    assert "TP=2 needs 2 GPUs" in capsys.readouterr().err
