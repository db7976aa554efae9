"""bench/q8_routes.py: the two int4 planes carry a Q8_0 matrix's weights exactly (the route is right, so its
timing means something), and the script prints its table. Timings mean nothing here."""

from __future__ import annotations

import json

import torch

from bench import q8_routes


def test_two_int4_planes_are_the_q8_0_weights_exactly_and_rows_are_not():
    codes, scales = q8_routes.q8_0_blocks(64, 96, torch.Generator().manual_seed(1))
    packed, scales_zeros = q8_routes.int4_planes(codes, scales)
    # the kernel applied to the identity reads its weights back; float32 activations and scales (its scalar loop)
    # so that no bfloat16 output rounds them: the two planes' sum is the file's weight to the bit
    planes = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(96), packed, q8_routes.GROUP, scales_zeros.float())
    weights = (codes.view(64, -1, 32).float() * scales[..., None]).view(64, 96)
    assert torch.equal((planes[:, :64] + planes[:, 64:]).T, weights)
    rows, row_scales = q8_routes.int8_rows(codes, scales)
    assert not torch.equal(rows.float() * row_scales.float()[:, None], weights)  # re-quantized per row


def test_the_script_prints_both_routes_per_layer(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(q8_routes, "SHAPES", {"small": (64, 96)})
    out = tmp_path / "q8.json"
    assert q8_routes.main(["--reps", "5", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    (row,) = figures["one_token"]
    assert row["planes_error"] < row["rows_error"] and row["rows_us"] > 0 and row["planes_us"] > 0
    assert [r["m"] for r in figures["by_rows"]] == list(q8_routes.ROWS)
    assert all(r["kernel_error"] < 1e-2 and r["tiles_error"] < 1e-2 for r in figures["by_rows"])  # bfloat16's rounding
    printed = capsys.readouterr().out
    assert "| small [64 x 96] |" in printed and "| small [64 x 96] | 128 |" in printed
