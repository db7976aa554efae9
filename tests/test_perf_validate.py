"""bench/perf_validate.py: the overhead fit, and a quick run that prints its table (numbers not judged: CI is noisy)."""

import json

import pytest

from bench import perf_validate
from kvscope.backend.perf import calibrate


def test_the_overhead_fit_is_least_squares_with_no_negative_term():
    # y = 2 + 3·rows + 0·tokens exactly: the fit finds it.
    rows = [(1.0, r, t) for r, t in [(1, 1), (2, 2), (4, 4), (1, 100), (3, 40), (8, 8)]]
    y = [2 + 3 * r for _, r, _ in rows]
    assert perf_validate.nonnegative_least_squares(rows, y) == pytest.approx([2, 3, 0], abs=1e-9)
    # y falls with rows: a plain fit would give a negative slope; the constrained one drops the term.
    rows = [(1.0, r, 0.0) for r in (1, 2, 3, 4)]
    fit = perf_validate.nonnegative_least_squares(rows, [10.0, 9.0, 8.0, 7.0])
    assert fit[1] == 0 and fit[0] == pytest.approx(8.5)


FIGURES = {"version": calibrate.CACHE_VERSION, "host": "test", "device": "test CPU", "fp32_flops": 1e11,
           "bf16_flops": 1e11, "mem_bandwidth": 4e10, "gemv_efficiency": 0.45, "gemm_efficiency": 0.3,
           "memory_bytes": 2e10, "measured_at": "2026-12-01T00:00:00+00:00"}


def test_a_quick_run_prints_a_row_per_scenario(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(perf_validate, "this_machine", lambda recalibrate: FIGURES)
    out = tmp_path / "pv.json"
    assert perf_validate.main(["--quick", "--models", "demo", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "median abs. error" in printed and "18.0 GB/s over one token, 12.0 over several" in printed
    result = json.loads(out.read_text())
    assert [r["scenario"] for r in result["rows"]] == list(perf_validate.QUICK_SCENARIOS)
    fitted = result["overhead_s"]["demo"]
    assert set(fitted) == set(perf_validate.OVERHEADS) and all(v >= 0 for v in fitted.values())
    for r in result["rows"]:
        assert r["iterations"] > 0 and r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert f"| demo | {r['scenario']} | {r['iterations']} |" in printed
