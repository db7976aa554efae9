"""bench/spec_decode.py on a tiny setting: the table has its columns and its numbers are sane."""

import json

import pytest

from bench import spec_decode


def test_prediction_is_tokens_per_verify_over_iteration_cost():
    assert spec_decode.predicted(0.5, 1, 0.0) == pytest.approx(1.5)  # 1 + alpha tokens for one step
    assert spec_decode.predicted(0.0, 4, 0.25) == pytest.approx(1 / 2)  # nothing accepted, 2 steps paid
    assert spec_decode.predicted(1.0, 3, 0.0) == pytest.approx(4.0)  # every draft and the bonus
    assert spec_decode.parse_ks("1-3,8") == [1, 2, 3, 8]


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_bench_prints_the_table_with_sane_values(tmp_path, capsys, temperature):
    out = tmp_path / "spec.json"
    argv = ["--ks", "1,2", "--requests", "2", "--max-tokens", "10", "--prompt-tokens", "16", "--repeat", "1",
            "--temperature", temperature, "--json", str(out)]
    assert spec_decode.main(argv) == 0
    printed = capsys.readouterr().out
    for column in spec_decode.SPEEDUP_HEADERS + spec_decode.BREAKDOWN_HEADERS:
        assert f" {column} |" in printed, column
    assert ("PASS:" in printed) != ("FAIL:" in printed)

    result = json.loads(out.read_text())
    assert [r["k"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert 0 <= r["alpha"] <= 1 and 0 <= r["acceptance_rate"] <= 1
        assert 1 <= r["tokens_per_verify"] <= r["k"] + 1 and 0 < r["drafts_per_verify"] <= r["k"]
        assert r["c"] > 0 and r["predicted"] > 0 and r["measured"] > 0 and r["verify_over_decode"] > 0
        assert r["measured_over_predicted"] == pytest.approx(r["measured"] / r["predicted"])
        if temperature == "0":
            assert r["same_outputs"] == 2  # greedy speculative decoding is exact
    assert result["plain"]["decode_forward_ms"] > 0
    assert result["target"]["best_k"] in (1, 2)
