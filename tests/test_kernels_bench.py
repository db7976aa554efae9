"""bench/kernels.py runs as one prepared script: without CUDA it says so and exits 0, and its
measuring code works end to end (one tiny case on the CPU interpreter)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest

pytest.importorskip("triton")

import torch

from bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the whole grid")
def test_without_cuda_it_says_the_figures_need_a_gpu(tmp_path, capsys):
    assert bench.main(["--json", str(tmp_path / "out.json")]) == 0
    assert "need a GPU" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == []


def test_interpret_smoke_measures_one_case_against_sdpa(tmp_path):
    assert bench.main(["--interpret-smoke", "--json", str(tmp_path / "out.json")]) == 0
    [row] = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert row["max_abs_err"] < 1e-4 and row["kernel_us"] > 0 and row["sdpa_us"] > 0


def test_peak_bandwidth_is_found_by_device_name():
    assert bench.peak_for("NVIDIA H100 80GB HBM3") == 3350
    assert bench.peak_for("NVIDIA H100 PCIe") == 2000
    assert bench.peak_for("NVIDIA GH200 480GB") == 4000
    assert bench.peak_for("NVIDIA A100-SXM4-80GB") == 2039
    assert bench.peak_for("NVIDIA A10G") == 600
    assert bench.peak_for("Some Future GPU") is None
