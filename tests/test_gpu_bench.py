"""bench/gpu.py, the GPU checks in one run: without CUDA it says so and measures nothing; its interpreter smoke
runs the matmul and engine parts through the same code on the CPU (the engine's greedy tokens equal the
reference's on the Triton backend). Timings mean nothing here."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest
import torch

from bench import gpu

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run everything")
def test_without_cuda_it_says_the_figures_need_a_gpu(capsys):
    assert gpu.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_the_interpreter_smoke_runs_the_matmuls_and_the_engine_against_the_reference(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--interpret-smoke", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {r["kind"] for r in results["matmuls"]} == {"int8 per row", "int4 g64", "float32 (torch)"}
    assert [(r["weights"], r["greedy_equal"]) for r in results["engine"]] == [("none", "1/1"), ("int4", "1/1")]
    printed = capsys.readouterr().out
    assert "## 3. weight-only matmuls" in printed and "## 4. the engine" in printed and "failed" not in printed
